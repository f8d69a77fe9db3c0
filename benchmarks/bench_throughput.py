"""Epoch time of resumable_loader.DataLoader against torch.utils.data.DataLoader.

Workloads (fresh loaders every run, ours and torch's alternated in one process):

- heavy: map dataset of 3x64x64 float32 items, each after ~50 us of CPU spin, batch 64,
  2 workers. Goal: steady epoch ratio ours/torch <= 1.00.
- light: an int -> 1-element tensor, batch_size 1, 2 workers, ~20k items: the loader's own
  per-batch bookkeeping dominates. Goal: steady epoch ratio <= 0.80.
- light-nt: the light workload with bare ints and a collate_fn that makes no tensor, so no
  shared-memory segment per batch: only the loader's bookkeeping is left. Goal as light.
- light0: the light workload with num_workers=0 (reference, no goal).

Per run we record the first-batch latency (constructor + iter + first batch, so worker start-up
is in it) and the steady epoch time (first batch to the end of the epoch); the goals are on the
steady epoch time. Reported: median of the per-round ratios ours/torch and the raw medians.

Run: python3 benchmarks/bench_throughput.py [--quick] [--rounds N] [--start-method fork|spawn|...]
Exits non-zero only if a loader delivered the wrong number of batches or samples.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import _common as C
import torch
from torch.utils.data import Dataset

HEAVY_WORK_S = 50e-6


class HeavyDataset(Dataset):
    """3x64x64 float32 items after ~50 us of CPU work; item i is filled with the value i."""

    def __init__(self, n: int, work_s: float = HEAVY_WORK_S) -> None:
        self.n = n
        self.work_s = work_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> torch.Tensor:
        C.spin(self.work_s)
        return torch.full((3, 64, 64), float(idx), dtype=torch.float32)


class LightDataset(Dataset):
    """Item i is the 1-element int64 tensor [i]: almost no work per sample."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> torch.Tensor:
        return torch.tensor([idx])


def collate_int(samples: list[int]) -> torch.Tensor | int:
    """batch_size 1 only: the batch is the bare int (module level so spawn can pickle it)."""
    return samples[0]


# n chosen for ~1-5 s steady epochs of torch's loader with 2 workers on 2 cores. "light" sends
# one 1-element tensor per batch, which torch moves through a shared-memory segment (~0.5 ms of
# its ~0.6 ms per batch on the reference machine), hence its smaller n; "light-nt" sends bare
# ints, leaving only the per-batch bookkeeping (queues, pickling, reordering). budget_s caps a
# workload's wall time in the default run, so a slow loader cannot push the script past 3 min.
WORKLOADS: dict[str, dict[str, Any]] = {
    "heavy": {
        "kind": "heavy",
        "n": 16384,
        "quick_n": 4096,
        "batch_size": 64,
        "workers": 2,
        "goal": 1.00,
        "budget_s": 35,
    },
    "light": {
        "kind": "light",
        "n": 8000,
        "quick_n": 2000,
        "batch_size": 1,
        "workers": 2,
        "goal": 0.80,
        "budget_s": 45,
    },
    "light-nt": {
        "kind": "int",
        "n": 10000,
        "quick_n": 2000,
        "batch_size": 1,
        "workers": 2,
        "goal": 0.80,
        "budget_s": 45,
    },
    "light0": {
        "kind": "light",
        "n": 20000,
        "quick_n": 2000,
        "batch_size": 1,
        "workers": 0,
        "goal": None,
        "budget_s": 20,
    },
}


class StreamError(Exception):
    pass


def _checksum(batch: Any, kind: str) -> float:
    if kind == "int":
        return float(batch)
    if kind == "heavy":
        return float(batch[:, 0, 0, 0].double().sum().item())
    return float(batch.double().sum().item())


def one_epoch(
    loader_cls: type, ds: Dataset, cfg: dict[str, Any], start_method: str, label: str
) -> dict[str, float]:
    kwargs: dict[str, Any] = {"batch_size": cfg["batch_size"], "num_workers": cfg["workers"]}
    if cfg["workers"] > 0:
        kwargs["multiprocessing_context"] = start_method
    if cfg["kind"] == "int":
        kwargs["collate_fn"] = collate_int
    n = len(ds)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    loader = loader_cls(ds, **kwargs)
    it = iter(loader)
    first = next(it)
    t1 = time.perf_counter()
    batches = 1
    total = _checksum(first, cfg["kind"])
    for batch in it:
        batches += 1
        total += _checksum(batch, cfg["kind"])
    t2 = time.perf_counter()
    del it
    C.close_loader(loader)
    want_batches = -(-n // cfg["batch_size"])
    want_total = n * (n - 1) / 2
    if batches != want_batches or total != want_total:
        raise StreamError(
            f"{label}: got {batches} batches (sum of indices {total:.0f}), "
            f"expected {want_batches} (sum {want_total:.0f})"
        )
    return {"first_s": t1 - t0, "steady_s": t2 - t1, "total_s": t2 - t0}


def main() -> int:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="A/B rounds (default 4, quick 2)")
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="comma-separated subset of: " + ",".join(WORKLOADS),
    )
    args = C.parse(p)
    rounds = args.rounds or (2 if args.quick else 4)
    api = C.loader_api()
    print(C.env_line(args.start_method))
    print(f"ours: {api.name}; rounds {rounds} (+1 warm-up each); order rotates every round")

    rows = []
    summary: dict[str, Any] = {"start_method": args.start_method, "rounds": rounds}
    failed = False
    for name in args.workloads.split(","):
        cfg = WORKLOADS[name]
        n = cfg["quick_n"] if args.quick else cfg["n"]
        ds: Dataset = {"heavy": HeavyDataset, "light": LightDataset, "int": C.IndexDataset}[
            cfg["kind"]
        ](n)
        fns = {
            "ours": lambda ds=ds, cfg=cfg, name=name: one_epoch(
                api.DataLoader, ds, cfg, args.start_method, f"ours/{name}"
            ),
            "torch": lambda ds=ds, cfg=cfg, name=name: one_epoch(
                C.torch_loader(), ds, cfg, args.start_method, f"torch/{name}"
            ),
        }
        t_start = time.perf_counter()
        try:
            runs = C.alternate(fns, rounds, budget_s=None if args.quick else cfg["budget_s"])
        except StreamError as e:
            print(f"{name}: WRONG STREAM: {e}", file=sys.stderr)
            failed = True
            continue
        r_steady = C.per_round_ratio(runs, "ours", "torch", "steady_s")
        r_total = C.per_round_ratio(runs, "ours", "torch", "total_s")
        med = {
            side: {k: C.median([r[k] for r in runs[side]]) for k in runs[side][0]} for side in runs
        }
        rows.append(
            [
                f"{name} (n={n}, bs={cfg['batch_size']}, w={cfg['workers']})",
                med["ours"]["steady_s"],
                med["torch"]["steady_s"],
                C.median(r_steady),
                min(r_steady),
                max(r_steady),
                med["ours"]["first_s"] * 1e3,
                med["torch"]["first_s"] * 1e3,
                C.median(r_total),
                "-" if cfg["goal"] is None else f"<= {cfg['goal']:.2f}",
            ]
        )
        summary[name] = {
            "n": n,
            "rounds_run": len(r_steady),
            "ratio_steady_median": C.median(r_steady),
            "ratio_steady_min": min(r_steady),
            "ratio_steady_max": max(r_steady),
            "ratio_total_median": C.median(r_total),
            "ours_steady_s": med["ours"]["steady_s"],
            "torch_steady_s": med["torch"]["steady_s"],
            "ours_first_batch_ms": med["ours"]["first_s"] * 1e3,
            "torch_first_batch_ms": med["torch"]["first_s"] * 1e3,
            "goal_ratio": cfg["goal"],
            "wall_s": time.perf_counter() - t_start,
        }
        print(f"  {name}: done in {time.perf_counter() - t_start:.1f} s", flush=True)

    print()
    C.print_table(
        [
            "workload",
            "ours s",
            "torch s",
            "ratio",
            "min",
            "max",
            "ours 1st ms",
            "torch 1st ms",
            "ratio(total)",
            "goal",
        ],
        rows,
    )
    print(
        "ratio = median over rounds of (ours steady epoch / torch steady epoch); "
        "steady = first batch -> end; 1st = constructor -> first batch"
    )
    summary["stream_ok"] = not failed
    C.emit_summary("throughput", summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
