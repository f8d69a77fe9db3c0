"""Epoch time vs num_workers (1 and 2): ours, torch's and torchdata's loaders against the limit.

A light version of bench_throughput.py (its datasets, its limit and its epoch loop): the heavy
and image workloads at smaller sizes, each with num_workers 1 and 2. The limit is the same
fetch + collate in this process with no loader, divided by min(workers, cores): with 2 cores,
2 workers is every core, so the limit halves from 1 to 2 workers and a loader that scales
does too. Per workload and worker count, limit / ours / torch / torchdata are alternated in
one process (order rotated every round, a warm-up run of each first); the figures are medians
over the rounds, and "x the limit" the median of the per-round ratios.

Run: python3 benchmarks/bench_workers.py [--quick] [--rounds N] [--workers 1,2]
     [--workloads heavy,image] [--start-method fork|spawn|forkserver]
Exits non-zero only if a loader delivered the wrong number of batches or samples.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import _common as C
import bench_throughput as T

# epoch sizes: smaller than bench_throughput's default run so the whole script stays ~1 min
SIZES = {"heavy": (4096, 2048), "image": (1024, 512)}  # name -> (default n, quick n)
LABELS = {
    "heavy": "3x64x64 f32 items, 50 us each, batch 64",
    "image": "3x224x224 u8 + label, 200 us each, batch 32",
}


def _measurements(
    name: str, ds: Any, cfg: dict[str, Any], api: C.LoaderAPI, sdl: type | None, sm: str
) -> dict[str, Any]:
    """The epoch functions alternated for one workload and worker count."""
    fns = {
        "limit": lambda: T.limit_epoch(ds, cfg, f"limit/{name}"),
        "ours": lambda: T.one_epoch(api.DataLoader, ds, cfg, sm, f"ours/{name}"),
        "torch": lambda: T.one_epoch(C.torch_loader(), ds, cfg, sm, f"torch/{name}"),
    }
    if sdl is not None:
        fns["torchdata"] = lambda: T.one_epoch(sdl, ds, cfg, sm, f"torchdata/{name}")
    return fns


def main() -> int:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="A/B rounds (default 3, quick 2)")
    p.add_argument("--workers", default="1,2", help="worker counts (default 1,2)")
    p.add_argument("--workloads", default=",".join(SIZES), help="subset of: " + ",".join(SIZES))
    p.add_argument("--png", default=None, help="draw the chart to this PNG (needs matplotlib)")
    args = C.parse(p)
    rounds = args.rounds or (2 if args.quick else 3)
    counts = [int(w) for w in args.workers.split(",")]
    api = C.loader_api()
    sdl = T.stateful_loader()
    cores = T.limit_divisor(os.cpu_count() or 1)
    print(C.env_line(args.start_method))
    print(f"ours: {api.name}; {cores} cores; rounds {rounds} (+1 warm-up each)")
    if sdl is None:
        print("torchdata is not installed: its StatefulDataLoader is not measured")

    rows = []
    summary: dict[str, Any] = {
        "start_method": args.start_method,
        "rounds": rounds,
        "cores": cores,
        "torchdata": sdl is not None,
        "workloads": {},
    }
    failed = False
    sm = args.start_method
    for name in args.workloads.split(","):
        n = SIZES[name][1 if args.quick else 0]
        ds = T.make_dataset(T.WORKLOADS[name]["kind"], n)
        per: dict[str, Any] = {}
        for w in counts:
            cfg = {**T.WORKLOADS[name], "workers": w}
            fns = _measurements(name, ds, cfg, api, sdl, sm)
            t0 = time.perf_counter()
            try:
                runs = C.alternate(fns, rounds, budget_s=None if args.quick else 25)
            except T.StreamError as e:
                print(f"{name} w={w}: WRONG STREAM: {e}", file=sys.stderr)
                failed = True
                continue
            steady = {s: C.median([r["steady_s"] for r in runs[s]]) for s in runs}
            x_limit = {s: C.median(C.per_round_ratio(runs, s, "limit", "steady_s"))
                       for s in runs if s != "limit"}  # fmt: skip
            per[str(w)] = {"n": n, "label": LABELS[name], "steady_s": steady,
                           "x_limit": x_limit, "rounds_run": len(runs["ours"]),
                           "limit_divisor": T.limit_divisor(w)}  # fmt: skip
            row = [f"{name} w={w} (n={n})", steady["limit"], steady["ours"], steady["torch"],
                   x_limit["ours"], x_limit["torch"]]  # fmt: skip
            if sdl is not None:
                row += [steady["torchdata"], x_limit["torchdata"]]
            rows.append(row)
            print(f"  {name} w={w}: done in {time.perf_counter() - t0:.1f} s", flush=True)
        summary["workloads"][name] = per

    print()
    headers = ["workload", "limit s", "ours s", "torch s", "ours x limit", "torch x limit"]
    if sdl is not None:
        headers += ["torchdata s", "torchdata x limit"]
    C.print_table(headers, rows, digits=2)
    print(
        f"steady epoch (first batch -> end), median over rounds; limit = fetch + collate with "
        f"no loader / min(workers, {cores} cores); x limit: median of per-round ratios"
    )
    summary["stream_ok"] = not failed
    summary["foreign_cpu_share"] = C.foreign_cpu_share()
    if args.png:
        import plots

        print(f"drew {args.png}" if plots.draw_workers(args.png, summary) else "no matplotlib")
    C.emit_summary("workers", summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
