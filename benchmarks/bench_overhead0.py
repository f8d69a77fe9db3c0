"""Per-batch CPU time with ``num_workers=0``: ours against torch's DataLoader (issue #26).

With no workers every cost of a batch lands in the caller's process, so the figure is the CPU
time of this process (``time.process_time``) per batch, which other processes on the machine
barely change -- unlike the wall time ``bench_throughput.py --workloads light0`` reports,
which a loaded machine can swing by 2x. Epochs of a tiny dataset, batch size 1, ours and
torch's alternated in one process, the order rotated every round; the ratio is the median of
the per-round ratios.

Workloads:

- light0: item i is the 1-element tensor [i], collated by torch's default_collate (the
  throughput benchmark's light0);
- int0: item i is the bare int i and the collate returns it (no tensor at all: what is left
  is the loaders' bookkeeping and, in ours, the per-task seeding of python's, numpy's and
  torch's generators and the giving back of the caller's states);
- light0-shuffle: light0 with ``shuffle=True``.

Goal (issue #26): ours <= 1.5x torch's per batch, the caller's RNG streams untouched.

Run: python3 benchmarks/bench_overhead0.py [--quick] [--rounds N] [--workloads light0,int0]
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any

import _common as C
import torch
from torch.utils.data import Dataset


class LightDataset(Dataset):
    """Item i is the 1-element int64 tensor [i]."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def collate_int(samples: list[int]) -> int:
    """batch_size 1: the batch is the bare int."""
    return samples[0]


WORKLOADS: dict[str, dict[str, Any]] = {
    "light0": {"dataset": LightDataset, "kw": {}},
    "int0": {"dataset": C.IndexDataset, "kw": {"collate_fn": collate_int}},
    "light0-shuffle": {"dataset": LightDataset, "kw": {"shuffle": True}},
}


def epoch(loader_cls: type, workload: str, n: int) -> dict[str, float]:
    spec = WORKLOADS[workload]
    loader = loader_cls(spec["dataset"](n), batch_size=1, num_workers=0, **spec["kw"])
    got = 0
    c0 = time.process_time()
    for _ in loader:
        got += 1
    cpu = time.process_time() - c0
    C.close_loader(loader)
    if got != n:
        print(f"ERROR: {loader_cls.__module__} delivered {got} batches, expected {n}")
        sys.exit(1)
    return {"cpu_us_per_batch": cpu / n * 1e6}


def main() -> int:
    p = C.base_parser(__doc__.splitlines()[0], start_method=False)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--workloads", default="light0,int0,light0-shuffle")
    args = C.parse(p)
    print(C.env_line(None))
    n = 2000 if args.quick else 10000
    rounds = 3 if args.quick else args.rounds
    ours, theirs = C.loader_api().DataLoader, C.torch_loader()
    rows, summary = [], {}
    for w in [w for w in args.workloads.split(",") if w]:
        runs = C.alternate(
            {
                "ours": functools.partial(epoch, ours, w, n),
                "torch": functools.partial(epoch, theirs, w, n),
            },
            rounds,
            budget_s=20 if args.quick else 60,
        )
        key = "cpu_us_per_batch"
        ratios = C.per_round_ratio(runs, "ours", "torch", key)
        o = C.median([r[key] for r in runs["ours"]])
        t = C.median([r[key] for r in runs["torch"]])
        r = C.median(ratios)
        rows.append([w, o, t, r, min(ratios), max(ratios), len(ratios)])
        summary[w] = {"ours_us": o, "torch_us": t, "ratio": r, "ratio_min": min(ratios),
                      "ratio_max": max(ratios), "rounds": len(ratios), "goal": 1.5}  # fmt: skip
    print()
    print(f"CPU time per batch, num_workers=0, batch_size=1, {n} batches per epoch")
    C.print_table(
        ["workload", "ours us", "torch us", "ours/torch", "min", "max", "rounds"], rows, digits=2
    )
    C.emit_summary("overhead0", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
