"""CPU time per batch of the main process and of the workers on the light workload (issue #26).

The light workload (item i is the 1-element tensor [i], batch_size 1, 2 workers) is all
per-batch overhead. Its wall time on a shared 2-core machine swings with other processes' load;
the CPU time each side spends per batch barely does, and on 2 idle cores the wall time per batch
is about (main + workers) / 2 plus what the pipeline waits. Each epoch runs in a fresh
subprocess (fork workers, a short warm-up epoch first): the main process's CPU time is its own
getrusage, the workers' that of its reaped children (each epoch starts and reaps its own).

``--trees A,B`` alternates checkouts (each epoch imports ``resumable_loader`` from its tree,
``PYTHONPATH=tree``) for an A/B in one run, the order rotated every round; the default is this
checkout alone.

Run: python3 benchmarks/bench_light_cpu.py [--quick] [--rounds N] [--batches N] [--trees A,B]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import _common as C

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# One epoch in a fresh process; prints one JSON line.
CHILD = r"""
import json, resource, sys, time
import torch
import resumable_loader as rl

class Light(torch.utils.data.Dataset):
    def __init__(self, n): self.n = n
    def __len__(self): return self.n
    def __getitem__(self, i): return torch.tensor([i])

n = int(sys.argv[1])
loader = rl.DataLoader(Light(n), batch_size=1, num_workers=2, multiprocessing_context="fork")
it = iter(loader)
for _ in range(200):
    next(it)
del it
r0, c0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
t0 = time.perf_counter()
total = 0
for batch in loader:
    total += int(batch[0])
t1 = time.perf_counter()
r1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
if total != n * (n - 1) // 2:
    sys.exit("wrong stream: the sum of the indices is %d" % total)
cpu = lambda a, b: (b.ru_utime + b.ru_stime - a.ru_utime - a.ru_stime) / n * 1e6
print(json.dumps({"main_us": cpu(r0, r1), "workers_us": cpu(c0, c1),
                  "wall_us": (t1 - t0) / n * 1e6, "main_vcsw": (r1.ru_nvcsw - r0.ru_nvcsw) / n}))
"""


def epoch(tree: str, n: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(n)], env=env, capture_output=True, text=True, cwd=tree
    )
    if out.returncode:
        print(f"ERROR in {tree}:\n{out.stderr}")
        sys.exit(1)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    p = C.base_parser(__doc__.splitlines()[0], start_method=False)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batches", type=int, default=20000, help="batches per epoch")
    p.add_argument("--trees", default=ROOT, help="comma-separated checkouts to alternate")
    args = C.parse(p)
    print(C.env_line("fork"))
    trees = [os.path.abspath(t) for t in args.trees.split(",") if t]
    n = 4000 if args.quick else args.batches
    rounds = 2 if args.quick else args.rounds
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    for r in range(rounds):
        order = trees[r % len(trees) :] + trees[: r % len(trees)]
        for tree in order:
            runs[tree].append(epoch(tree, n))
    keys = ["main_us", "workers_us", "wall_us", "main_vcsw"]
    rows, summary = [], {}
    for tree in trees:
        med = {k: C.median([x[k] for x in runs[tree]]) for k in keys}
        lo_hi = {k: (min(x[k] for x in runs[tree]), max(x[k] for x in runs[tree])) for k in keys}
        cpu = med["main_us"] + med["workers_us"]
        rows.append([tree, med["main_us"], med["workers_us"], cpu, med["wall_us"]])
        summary[tree] = {"median": med, "min_max": lo_hi, "cpu_sum_us": cpu, "rounds": rounds}
    print()
    print(f"light (1-element tensor, batch 1, 2 workers, fork), {n} batches per epoch;")
    print("CPU time per batch, median of the rounds (wall: noisy under other load)")
    C.print_table(["tree", "main us", "workers us", "sum us", "wall us"], rows, digits=1)
    C.emit_summary("light_cpu", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
