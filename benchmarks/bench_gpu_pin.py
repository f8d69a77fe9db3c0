"""pin_memory=True throughput of resumable_loader against torch's DataLoader, feeding a GPU.

The heavy workload of bench_throughput (3x64x64 float32 items after ~50 us of CPU work), batch
64, 4 workers, pin_memory=True; every batch is copied with ``.to("cuda", non_blocking=True)``
and reduced on the GPU (no host sync per batch; one ``torch.cuda.synchronize()`` at the end).
Ours and torch's alternate in one process; reported: median per-round ratio of the steady epoch
time (first batch -> end, goal <= 1.00) and the first-batch latency.

Without CUDA it prints "no CUDA, skipped" and exits 0. ``--device cpu`` runs the same code
without pinning or a GPU, only to check the script itself.

Run: python3 benchmarks/bench_gpu_pin.py [--quick] [--rounds N] [--start-method ...]
Exits non-zero only if a loader delivered the wrong number of samples.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import _common as C
import torch
from bench_throughput import HeavyDataset

BATCH = 64
WORKERS = 4
GOAL = 1.00


class StreamError(Exception):
    pass


def one_epoch(
    loader_cls: type, ds: HeavyDataset, device: str, start_method: str, label: str
) -> dict[str, float]:
    pin = device == "cuda"
    n = len(ds)
    if pin:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loader = loader_cls(
        ds,
        batch_size=BATCH,
        num_workers=WORKERS,
        pin_memory=pin,
        multiprocessing_context=start_method,
    )
    it = iter(loader)
    first = next(it).to(device, non_blocking=True)
    acc = first[:, 0, 0, 0].double().sum()
    if pin:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    batches = 1
    for batch in it:
        acc += batch.to(device, non_blocking=True)[:, 0, 0, 0].double().sum()
        batches += 1
    total = float(acc.item())  # synchronises with the GPU
    t2 = time.perf_counter()
    del it
    C.close_loader(loader)
    if batches != -(-n // BATCH) or total != n * (n - 1) / 2:
        raise StreamError(
            f"{label}: {batches} batches, sum {total:.0f}; expected "
            f"{-(-n // BATCH)} and {n * (n - 1) / 2:.0f}"
        )
    return {"first_s": t1 - t0, "steady_s": t2 - t1, "total_s": t2 - t0}


def main() -> int:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="A/B rounds (default 5, quick 2)")
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: no pinning, no GPU; only checks this script",
    )
    args = C.parse(p)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA, skipped")
        C.emit_summary("gpu_pin", {"skipped": "no CUDA"})
        return 0
    rounds = args.rounds or (2 if args.quick else 5)
    n = 8192 if args.quick else 65536
    api = C.loader_api()
    print(C.env_line(args.start_method))
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "none (--device cpu)"
    print(
        f"ours: {api.name}; gpu: {gpu}; {n} items, batch {BATCH}, {WORKERS} workers, "
        f"pin_memory={args.device == 'cuda'}; {rounds} rounds (+1 warm-up)"
    )
    ds = HeavyDataset(n)
    fns = {
        "ours": lambda: one_epoch(api.DataLoader, ds, args.device, args.start_method, "ours"),
        "torch": lambda: one_epoch(C.torch_loader(), ds, args.device, args.start_method, "torch"),
    }
    try:
        runs = C.alternate(fns, rounds)
    except StreamError as e:
        print(f"WRONG STREAM: {e}", file=sys.stderr)
        C.emit_summary("gpu_pin", {"stream_ok": False, "error": str(e)})
        return 1
    ratios = C.per_round_ratio(runs, "ours", "torch", "steady_s")
    med = {side: {k: C.median([r[k] for r in runs[side]]) for k in runs[side][0]} for side in runs}
    print()
    C.print_table(
        ["case", "ours s", "torch s", "ratio", "min", "max", "ours 1st ms", "torch 1st ms", "goal"],
        [
            [
                f"heavy n={n} pinned -> {args.device}",
                med["ours"]["steady_s"],
                med["torch"]["steady_s"],
                C.median(ratios),
                min(ratios),
                max(ratios),
                med["ours"]["first_s"] * 1e3,
                med["torch"]["first_s"] * 1e3,
                f"<= {GOAL:.2f}",
            ]
        ],
    )
    summary: dict[str, Any] = {
        "device": args.device,
        "gpu": gpu,
        "n": n,
        "rounds": rounds,
        "start_method": args.start_method,
        "ratio_steady_median": C.median(ratios),
        "ratio_steady_min": min(ratios),
        "ratio_steady_max": max(ratios),
        "ours_steady_s": med["ours"]["steady_s"],
        "torch_steady_s": med["torch"]["steady_s"],
        "ours_first_batch_ms": med["ours"]["first_s"] * 1e3,
        "torch_first_batch_ms": med["torch"]["first_s"] * 1e3,
        "goal_ratio": GOAL,
        "stream_ok": True,
    }
    C.emit_summary("gpu_pin", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
