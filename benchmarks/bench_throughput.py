"""Epoch time of resumable_loader.DataLoader against the machine's limit and the other loaders.

The limit is measured in the same run: the same items fetched and collated in this process,
with no loader at all, and divided by the number of processes that can do that work at once
(min(num_workers, cores); 1 for num_workers=0). No loader can beat it on this machine; every
loader's epoch is reported as a multiple of it and of torch's.

Workloads (fresh loaders every run; limit, ours, torch's -- and, when importable, torchdata's
StatefulDataLoader, Google Grain's DataLoader (multiprocessing prefetch, per-worker buffer 2)
and Meta SPDL's thread pipeline (2 threads) -- alternated in one process; Grain and SPDL are
optional benchmark dependencies, measured on heavy, image, image-ng and light, and skipped
with one line each when they do not import). Goals of issue #26: heavy, image and image-ng
<= 1.25x the limit and faster than every other loader; light <= 20x the limit; light0 <= 1.5x
torch.

- heavy: 3x64x64 float32 items, each after ~50 us of CPU spin, batch 64, 2 workers
  (3 MiB/batch).
- image: shaped like image training, (3x224x224 uint8 image, int label) items after ~200 us
  of CPU (a stand-in for decoding), batch 32, 2 workers (4.6 MiB/batch).
- image-ng: the image workload with work that releases the GIL (numpy ufuncs on 256 KiB
  arrays, as decoders do), where threads compete with processes.
- image-f: the same as float32 (18.4 MiB/batch). Goal: <= 1.00x torch.
- dict50: each item a dict of 50 float32 fields of 320 values plus its index, batch 32,
  2 workers: 51 tensors per batch, 50 of them of 40 KiB. Goal: <= 1.00x torch.
- light: an int -> 1-element tensor, batch_size 1, 2 workers, ~20k items: the loader's own
  per-batch bookkeeping dominates.
- light-nt: the light workload with bare ints and a collate_fn that makes no tensor, so no
  shared-memory segment per batch: only the loader's bookkeeping is left. Goal as light.
- light0: the light workload with num_workers=0 (per batch).

Per run we record the first-batch latency (constructor + iter + first batch, so worker start-up
is in it) and the steady epoch time (first batch to the end of the epoch); the ratios are on
the steady epoch time, each the median of the per-round ratios (min and max shown).

Run: python3 benchmarks/bench_throughput.py [--quick] [--rounds N] [--workloads a,b]
     [--start-method fork|spawn|forkserver]
Exits non-zero only if a loader delivered the wrong number of batches or samples.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import _common as C
import torch
from torch.utils.data import Dataset, default_collate

HEAVY_WORK_S = 50e-6
IMAGE_WORK_S = 200e-6
DICT_FIELDS = 50
DICT_FIELD_LEN = 320  # float32 values per item and field: 40 KiB per field in a batch of 32


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


class ImageDataset(Dataset):
    """(3x224x224 image, label) items after ~200 us of CPU work, like a decoded training image.

    The image is uint8 (or float32 with ``dtype``) filled with ``idx % 251``; the label is idx.
    """

    def __init__(self, n: int, dtype: torch.dtype = torch.uint8, nogil: bool = False) -> None:
        self.n = n
        self.dtype = dtype
        self.nogil = nogil  # the work releases the GIL (numpy), as a decoder's does

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        (C.spin_nogil if self.nogil else C.spin)(IMAGE_WORK_S)
        return torch.full((3, 224, 224), idx % 251, dtype=self.dtype), idx


class DictDataset(Dataset):
    """Items are dicts of DICT_FIELDS small float32 tensors plus the index (as a 0-d tensor)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        item = {f"f{k:02d}": torch.full((DICT_FIELD_LEN,), float(k)) for k in range(DICT_FIELDS)}
        item["idx"] = torch.tensor(idx)
        return item


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


# n chosen for ~0.5-5 s steady epochs of torch's loader with 2 workers on 2 cores. "light"
# sends one 1-element tensor per batch, which torch moves through a shared-memory segment
# (~0.5 ms of its ~0.6 ms per batch on the reference machine), hence its smaller n; "light-nt"
# sends bare ints, leaving only the per-batch bookkeeping (queues, pickling, reordering).
# budget_s caps a workload's wall time in the default run, so a slow loader cannot push the
# script past its time.
WORKLOADS: dict[str, dict[str, Any]] = {
    "heavy": {"kind": "heavy", "n": 16384, "quick_n": 4096, "batch_size": 64, "workers": 2,
              "goal_limit": 1.25, "goal_torch": 1.00, "budget_s": 35},
    "image": {"kind": "image", "n": 4096, "quick_n": 1024, "batch_size": 32, "workers": 2,
              "goal_limit": 1.25, "goal_torch": 1.00, "budget_s": 30},
    "image-ng": {"kind": "image-ng", "n": 4096, "quick_n": 1024, "batch_size": 32, "workers": 2,
                 "goal_limit": 1.25, "goal_torch": 1.00, "budget_s": 30},
    "image-f": {"kind": "image-f", "n": 2048, "quick_n": 512, "batch_size": 32, "workers": 2,
                "goal_limit": None, "goal_torch": 1.00, "budget_s": 30},
    "dict50": {"kind": "dict", "n": 4096, "quick_n": 1024, "batch_size": 32, "workers": 2,
               "goal_limit": None, "goal_torch": 1.00, "budget_s": 30},
    "light": {"kind": "light", "n": 8000, "quick_n": 2000, "batch_size": 1, "workers": 2,
              "goal_limit": 20, "goal_torch": 0.80, "budget_s": 40},
    "light-nt": {"kind": "int", "n": 10000, "quick_n": 2000, "batch_size": 1, "workers": 2,
                 "goal_limit": None, "goal_torch": 0.80, "budget_s": 25},
    "light0": {"kind": "light", "n": 20000, "quick_n": 2000, "batch_size": 1, "workers": 0,
               "goal_limit": None, "goal_torch": 1.50, "budget_s": 20},
}  # fmt: skip


def make_dataset(kind: str, n: int) -> Dataset:
    if kind == "image":
        return ImageDataset(n)
    if kind == "image-ng":
        return ImageDataset(n, nogil=True)
    if kind == "image-f":
        return ImageDataset(n, torch.float32)
    return {"heavy": HeavyDataset, "dict": DictDataset, "light": LightDataset,
            "int": C.IndexDataset}[kind](n)  # fmt: skip


class StreamError(Exception):
    pass


def _checksum(batch: Any, kind: str) -> float:
    """The sum of the sample indices in ``batch`` (each loader's stream is checked with it)."""
    if type(batch).__module__.startswith(("numpy", "grain")):
        batch = torch.as_tensor(batch)  # (Grain's batches are numpy arrays)
    if kind == "int":
        return float(batch)
    if kind == "heavy":
        return float(batch[:, 0, 0, 0].double().sum().item())
    if kind in ("image", "image-f", "image-ng"):
        images, labels = (torch.as_tensor(x) for x in batch)
        if not torch.equal(images[:, 0, 0, 0].long(), labels % 251):
            raise StreamError("an image does not match its label")
        return float(labels.sum().item())
    if kind == "dict":
        if len(batch) != DICT_FIELDS + 1:
            raise StreamError(f"a batch has {len(batch)} fields")
        return float(batch["idx"].sum().item())
    return float(batch.double().sum().item())


def _check(label: str, n: int, bs: int, batches: int, total: float) -> None:
    want_batches = -(-n // bs)
    want_total = n * (n - 1) / 2
    if batches != want_batches or total != want_total:
        raise StreamError(
            f"{label}: got {batches} batches (sum of indices {total:.0f}), "
            f"expected {want_batches} (sum {want_total:.0f})"
        )


def limit_divisor(workers: int) -> int:
    """How many processes can fetch at once: the workers, capped by the cores we may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(workers, cores or 1))


def limit_epoch(ds: Dataset, cfg: dict[str, Any], label: str) -> dict[str, float]:
    """The work alone: fetch and collate every batch in this process, no loader; the times are
    divided by the processes that could share it (see ``limit_divisor``)."""
    bs = cfg["batch_size"]
    n = len(ds)  # type: ignore[arg-type]
    collate = collate_int if cfg["kind"] == "int" else default_collate
    div = limit_divisor(cfg["workers"])
    threads = torch.get_num_threads()
    if cfg["workers"]:
        torch.set_num_threads(1)  # as in a worker (both loaders set it there)
    try:
        t0 = time.perf_counter()
        first = collate([ds[i] for i in range(min(bs, n))])
        t1 = time.perf_counter()
        total = _checksum(first, cfg["kind"])
        batches = 1
        for start in range(bs, n, bs):
            batch = collate([ds[i] for i in range(start, min(start + bs, n))])
            total += _checksum(batch, cfg["kind"])
            batches += 1
            del batch
        t2 = time.perf_counter()
    finally:
        torch.set_num_threads(threads)
    _check(label, n, bs, batches, total)
    return {"first_s": (t1 - t0) / div, "steady_s": (t2 - t1) / div, "total_s": (t2 - t0) / div}


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
    del first
    for batch in it:
        batches += 1
        total += _checksum(batch, cfg["kind"])
    t2 = time.perf_counter()
    del it
    C.close_loader(loader)
    _check(label, n, cfg["batch_size"], batches, total)
    return {"first_s": t1 - t0, "steady_s": t2 - t1, "total_s": t2 - t0}


# ---- the loaders people would pick instead (optional benchmark dependencies) -----------------
# Grain (multiprocessing prefetch) and SPDL (a thread pipeline) on the workloads of issue #26.
PEER_WORKLOADS = ("heavy", "image", "image-ng", "light")


class GrainSource:
    """A Grain data source over one of our datasets; items as numpy arrays (Grain's batching
    stacks numpy arrays; ``.numpy()`` is a view, no copy)."""

    def __init__(self, ds: Dataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)  # type: ignore[arg-type]

    def __getitem__(self, idx: int) -> Any:
        item = self.ds[idx]
        if isinstance(item, tuple):
            return item[0].numpy(), item[1]
        return item.numpy()


def peers_available() -> dict[str, str]:
    """name -> version of the optional peers that import; prints a skip line for the others."""
    found = {}
    for name, module in (("grain", "grain.python"), ("spdl", "spdl.pipeline")):
        try:
            __import__(module)
            from importlib.metadata import version

            found[name] = version(name)
        except Exception as exc:  # not installed, or broken: say so and go on
            print(f"{name} is not importable ({type(exc).__name__}): not measured "
                  f"(pip install {name}, or put it on PYTHONPATH)")  # fmt: skip
    return found


def grain_epoch(ds: Dataset, cfg: dict[str, Any], label: str) -> dict[str, float]:
    """Grain's DataLoader: worker_count processes, per-worker buffer 2 (our prefetch 2)."""
    import grain.python as gp

    n = len(ds)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    loader = gp.DataLoader(
        data_source=GrainSource(ds),
        sampler=gp.IndexSampler(
            n, shard_options=gp.NoSharding(), shuffle=False, num_epochs=1, seed=0
        ),
        operations=[gp.Batch(cfg["batch_size"], drop_remainder=False)],
        worker_count=cfg["workers"],
        worker_buffer_size=2,
    )
    return _timed_epoch(iter(loader), t0, cfg, n, label)


def spdl_epoch(ds: Dataset, cfg: dict[str, Any], label: str) -> dict[str, float]:
    """SPDL's pipeline: batches fetched and collated by ``workers`` threads, in order."""
    from spdl.pipeline import PipelineBuilder

    n = len(ds)  # type: ignore[arg-type]
    bs = cfg["batch_size"]
    threads = max(1, cfg["workers"])

    def fetch(start: int) -> Any:
        return default_collate([ds[i] for i in range(start, min(start + bs, n))])

    t0 = time.perf_counter()
    pipe = (
        PipelineBuilder()
        .add_source(range(0, n, bs))
        .pipe(fetch, concurrency=threads, output_order="input")
        .add_sink(2)
        .build(num_threads=threads)
    )
    with pipe.auto_stop():
        return _timed_epoch(iter(pipe), t0, cfg, n, label)


def _timed_epoch(it: Any, t0: float, cfg: dict[str, Any], n: int, label: str) -> dict[str, float]:
    first = next(it)
    t1 = time.perf_counter()
    batches = 1
    total = _checksum(first, cfg["kind"])
    del first
    for batch in it:
        batches += 1
        total += _checksum(batch, cfg["kind"])
    t2 = time.perf_counter()
    _check(label, n, cfg["batch_size"], batches, total)
    return {"first_s": t1 - t0, "steady_s": t2 - t1, "total_s": t2 - t0}


def stateful_loader() -> type | None:
    """torchdata's StatefulDataLoader, or None when torchdata is not installed."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader  # type: ignore[no-any-return]


def _ratios(runs: dict[str, list[dict[str, float]]], num: str, den: str) -> dict[str, float]:
    r = C.per_round_ratio(runs, num, den, "steady_s")
    return {"median": C.median(r), "min": min(r, default=float("nan")),
            "max": max(r, default=float("nan"))}  # fmt: skip


def _span(r: dict[str, float]) -> str:
    return f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]"


def run_workload(
    name: str, args: Any, api: C.LoaderAPI, rounds: int, sdl: type | None, peers: dict[str, str]
) -> tuple[list[Any], dict[str, Any]]:
    cfg = WORKLOADS[name]
    n = cfg["quick_n"] if args.quick else cfg["n"]
    ds = make_dataset(cfg["kind"], n)
    sm = args.start_method
    fns = {
        "limit": lambda: limit_epoch(ds, cfg, f"limit/{name}"),
        "ours": lambda: one_epoch(api.DataLoader, ds, cfg, sm, f"ours/{name}"),
        "torch": lambda: one_epoch(C.torch_loader(), ds, cfg, sm, f"torch/{name}"),
    }
    if sdl is not None:
        fns["torchdata"] = lambda: one_epoch(sdl, ds, cfg, sm, f"torchdata/{name}")
    if name in PEER_WORKLOADS and "grain" in peers:
        fns["grain"] = lambda: grain_epoch(ds, cfg, f"grain/{name}")
    if name in PEER_WORKLOADS and "spdl" in peers:
        fns["spdl"] = lambda: spdl_epoch(ds, cfg, f"spdl/{name}")
    t_start = time.perf_counter()
    budget = None if args.quick else cfg["budget_s"] * args.budget_scale
    runs = C.alternate(fns, rounds, budget_s=budget)
    med = {side: {k: C.median([r[k] for r in runs[side]]) for k in runs[side][0]} for side in runs}
    nb = -(-n // cfg["batch_size"])
    ratios = {
        "ours_limit": _ratios(runs, "ours", "limit"),
        "torch_limit": _ratios(runs, "torch", "limit"),
        "ours_torch": _ratios(runs, "ours", "torch"),
    }
    if sdl is not None:
        ratios["torchdata_limit"] = _ratios(runs, "torchdata", "limit")
        ratios["ours_torchdata"] = _ratios(runs, "ours", "torchdata")
    others = [k for k in runs if k not in ("limit", "ours")]
    for k in others:
        ratios.setdefault(f"{k}_limit", _ratios(runs, k, "limit"))
    # The best other loader of each round (the fastest of them in that round).
    best = [min(runs[k][r]["steady_s"] for k in others) for r in range(len(runs["ours"]))]
    per_round = [o["steady_s"] / b for o, b in zip(runs["ours"], best) if b > 0]
    ratios["ours_best_other"] = {"median": C.median(per_round), "min": min(per_round),
                                 "max": max(per_round)}  # fmt: skip
    best_name = min(others, key=lambda k: ratios[f"{k}_limit"]["median"])
    us = {side: med[side]["steady_s"] / max(1, nb - 1) * 1e6 for side in med}
    row = [
        f"{name} (n={n}, bs={cfg['batch_size']}, w={cfg['workers']})",
        med["limit"]["steady_s"],
        med["ours"]["steady_s"],
        med["torch"]["steady_s"],
        _span(ratios["ours_limit"]),
        _span(ratios["torch_limit"]),
        _span(ratios["ours_torch"]),
        f"{us['ours']:.0f} / {us['torch']:.0f}",
        f"{med['ours']['first_s'] * 1e3:.0f} / {med['torch']['first_s'] * 1e3:.0f}",
    ]
    row.append(
        ", ".join(f"{k} {ratios[f'{k}_limit']['median']:.2f}" for k in others if k != "torch")
        or "-"
    )
    row.append(f"{best_name} {_span(ratios['ours_best_other'])}")
    summary = {
        "n": n,
        "batches": nb,
        "rounds_run": len(runs["ours"]),
        "limit_divisor": limit_divisor(cfg["workers"]),
        "steady_s": {side: med[side]["steady_s"] for side in med},
        "us_per_batch": us,
        "first_batch_ms": {side: med[side]["first_s"] * 1e3 for side in med},
        "ratios": ratios,
        "best_other": best_name,
        # The older summary's names, so earlier results files compare directly.
        "ratio_steady_median": ratios["ours_torch"]["median"],
        "goal_limit": cfg["goal_limit"],
        "goal_torch": cfg["goal_torch"],
        "wall_s": time.perf_counter() - t_start,
    }
    print(f"  {name}: done in {summary['wall_s']:.1f} s", flush=True)
    return row, summary


def main() -> int:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="A/B rounds (default 4, quick 2)")
    p.add_argument(
        "--budget-scale",
        type=float,
        default=1.0,
        help="multiply each workload's wall-time budget (more rounds on a quiet machine: "
        "the default budget leaves 2 rounds when Grain and SPDL are measured too)",
    )
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="comma-separated subset of: " + ",".join(WORKLOADS),
    )
    args = C.parse(p)
    rounds = args.rounds or (2 if args.quick else 4)
    api = C.loader_api()
    sdl = stateful_loader()
    peers = peers_available()
    print(C.env_line(args.start_method))
    print(f"ours: {api.name}; rounds {rounds} (+1 warm-up each); order rotates every round")
    if sdl is None:
        print("torchdata is not installed: its StatefulDataLoader is not measured")
    for name, version in peers.items():
        print(f"{name} {version}: measured on {', '.join(PEER_WORKLOADS)}")

    rows = []
    summary: dict[str, Any] = {
        "start_method": args.start_method,
        "rounds": rounds,
        "torchdata": sdl is not None,
        "peers": peers,
        "cores": limit_divisor(os.cpu_count() or 1),
    }
    failed = False
    for name in args.workloads.split(","):
        try:
            row, summary[name] = run_workload(name, args, api, rounds, sdl, peers)
        except StreamError as e:
            print(f"{name}: WRONG STREAM: {e}", file=sys.stderr)
            failed = True
            continue
        rows.append(row)

    print()
    headers = ["workload", "limit s", "ours s", "torch s", "ours/limit", "torch/limit",
               "ours/torch", "us/batch ours/torch", "1st ms ours/torch"]  # fmt: skip
    headers += ["others/limit", "ours/best other"]
    C.print_table(headers, rows)
    print(
        "limit = the same fetch + collate in one process with no loader, / min(workers, cores); "
        "ratios: median [min-max] over rounds of steady epoch times (first batch -> end); "
        "1st = constructor -> first batch"
    )
    summary["stream_ok"] = not failed
    C.emit_summary("throughput", summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
