"""Cost of checkpointing: state_dict() time and size, resume latency, re-fetched samples.

(a) ``loader.state_dict()`` mid-epoch at 8 workers, shuffle=True, batch 64, map datasets of
    10^4 and 10^7 items (computed from the index, never materialised): median time per call
    over 10^4 calls, ``len(dump_state(sd))`` and the json size. Goal: <= 5 us, <= 1 KB, no
    growth with the dataset's size.
(b) Time from ``load_state_dict(sd)`` on a freshly built loader to its first batch, against a
    fresh loader's first batch (same config, 2 workers, ~1 ms items, batch 8), alternated.
    Goal: median ratio <= 1.1.
(c) Re-fetched samples on resume: a dataset that logs every fetched index (one O_APPEND file per
    worker process). Run k batches, state_dict, rebuild, load, consume the rest. Reported: the
    resumed loader's batches holding an index the first loader had already delivered, and the
    samples the resumed loader fetched that the first had delivered (goal 0 for both), plus the
    first loader's prefetched-but-undelivered samples (information only).

Run: python3 benchmarks/bench_state.py [--quick] [--start-method fork|spawn|forkserver]
Exits non-zero only if the delivered stream is wrong (an index lost or delivered twice).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import _common as C
import torch
from torch.utils.data import Dataset


class RecordingDataset(Dataset):
    """Item i is i after ``work_s`` of CPU work; every fetch appends "i\\n" to a log file.

    One file per process (``{log_dir}/{tag}.{pid}.log``, O_APPEND), so concurrent workers never
    interleave partial lines. The fd is reopened after a fork (the pid changes).
    """

    def __init__(self, n: int, log_dir: str, tag: str, work_s: float) -> None:
        self.n = n
        self.log_dir = log_dir
        self.tag = tag
        self.work_s = work_s
        self._fd: int | None = None
        self._fd_pid = -1

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["_fd"], d["_fd_pid"] = None, -1
        return d

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> int:
        pid = os.getpid()
        if self._fd is None or self._fd_pid != pid:
            path = os.path.join(self.log_dir, f"{self.tag}.{pid}.log")
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._fd_pid = pid
        C.spin(self.work_s)
        os.write(self._fd, f"{idx}\n".encode())
        return idx

    def close_log(self) -> None:
        if self._fd is not None and self._fd_pid == os.getpid():
            os.close(self._fd)
        self._fd = None


def read_log(log_dir: str, tag: str) -> list[int]:
    out: list[int] = []
    for name in sorted(os.listdir(log_dir)):
        if name.startswith(tag + "."):
            with open(os.path.join(log_dir, name)) as f:
                out.extend(int(line) for line in f if line.strip())
    return out


def _mp(workers: int, start_method: str) -> dict[str, Any]:
    return {"multiprocessing_context": start_method} if workers > 0 else {}


def _gen(seed: int = 1234) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _json_size(sd: Any) -> int | str:
    try:
        return len(json.dumps(sd, separators=(",", ":")).encode())
    except (TypeError, ValueError) as e:
        return f"n/a ({type(e).__name__}: {e})"[:60]


def _roundtrip(api: C.LoaderAPI, sd: dict[str, Any]) -> dict[str, Any]:
    """What a real checkpoint would hand back: dump_state, then load_state when public."""
    if api.load_state is None:
        return sd
    return api.load_state(api.dump_state(sd))


# ----------------------------------------------------------------------------------------------
# (a) state_dict() time and size
# ----------------------------------------------------------------------------------------------


def part_a(api: C.LoaderAPI, start_method: str, calls: int) -> tuple[list[list[Any]], dict]:
    rows = []
    summary: dict[str, Any] = {}
    for n in (10**4, 10**7):
        loader = api.DataLoader(
            C.IndexDataset(n),
            batch_size=64,
            shuffle=True,
            num_workers=8,
            generator=_gen(),
            **_mp(8, start_method),
        )
        it = iter(loader)
        for _ in range(10):
            next(it)
        time.sleep(0.2)  # let the workers fill their prefetch slots: a busy, realistic state
        sd = loader.state_dict()
        times = []
        pc = time.perf_counter
        for _ in range(calls):
            t0 = pc()
            loader.state_dict()
            times.append(pc() - t0)
        packed = len(api.dump_state(sd))
        js = _json_size(sd)
        del it
        C.close_loader(loader)
        med_us = C.median(times) * 1e6
        p99_us = C.percentile(times, 99) * 1e6
        rows.append([f"{n:.0e} items", med_us, p99_us, packed, js, "<= 5 us, <= 1024 B"])
        summary[f"n_{n}"] = {
            "state_dict_us_median": med_us,
            "state_dict_us_p99": p99_us,
            "msgpack_bytes": packed,
            "json_bytes": js,
        }
    s4, s7 = summary[f"n_{10**4}"], summary[f"n_{10**7}"]
    summary["msgpack_growth_bytes"] = s7["msgpack_bytes"] - s4["msgpack_bytes"]
    return rows, summary


# ----------------------------------------------------------------------------------------------
# (b) resume latency
# ----------------------------------------------------------------------------------------------

B_N, B_BATCH, B_WORK_S, B_SKIP = 2000, 8, 1e-3, 20


class WorkDataset(Dataset):
    """Item i is i after ``work_s`` of CPU work."""

    def __init__(self, n: int, work_s: float) -> None:
        self.n = n
        self.work_s = work_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> int:
        C.spin(self.work_s)
        return idx


def part_b(api: C.LoaderAPI, start_method: str, rounds: int) -> tuple[list[list[Any]], dict]:
    ds = WorkDataset(B_N, B_WORK_S)

    def build() -> Any:
        return api.DataLoader(
            ds,
            batch_size=B_BATCH,
            shuffle=True,
            num_workers=2,
            generator=_gen(),
            **_mp(2, start_method),
        )

    src = build()
    it = iter(src)
    for _ in range(B_SKIP):
        next(it)
    sd = _roundtrip(api, src.state_dict())
    del it
    C.close_loader(src)

    def resumed() -> dict[str, float]:
        loader = build()
        t0 = time.perf_counter()
        loader.load_state_dict(sd)
        next(iter(loader))
        t1 = time.perf_counter()
        C.close_loader(loader)
        return {"first_s": t1 - t0}

    def fresh() -> dict[str, float]:
        loader = build()
        t0 = time.perf_counter()
        next(iter(loader))
        t1 = time.perf_counter()
        C.close_loader(loader)
        return {"first_s": t1 - t0}

    runs = C.alternate({"resumed": resumed, "fresh": fresh}, rounds, budget_s=60)
    ratios = C.per_round_ratio(runs, "resumed", "fresh", "first_s")
    r_ms = C.median([r["first_s"] for r in runs["resumed"]]) * 1e3
    f_ms = C.median([r["first_s"] for r in runs["fresh"]]) * 1e3
    rows = [
        [
            f"resume after {B_SKIP} batches (bs {B_BATCH}, ~{B_WORK_S * 1e3:.0f} ms/item)",
            r_ms,
            f_ms,
            C.median(ratios),
            min(ratios),
            max(ratios),
            "<= 1.10",
        ]
    ]
    return rows, {
        "resumed_first_batch_ms": r_ms,
        "fresh_first_batch_ms": f_ms,
        "ratio_median": C.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "rounds": rounds,
    }


# ----------------------------------------------------------------------------------------------
# (c) re-fetched samples on resume
# ----------------------------------------------------------------------------------------------

C_N, C_BATCH, C_WORK_S, C_K = 1600, 8, 200e-6, 50


def part_c(api: C.LoaderAPI, start_method: str, workers: int) -> tuple[list[Any], dict, bool]:
    log_dir = tempfile.mkdtemp(prefix="rl_bench_state_")
    try:
        ds1 = RecordingDataset(C_N, log_dir, "first", C_WORK_S)
        l1 = api.DataLoader(
            ds1,
            batch_size=C_BATCH,
            shuffle=True,
            num_workers=workers,
            generator=_gen(),
            **_mp(workers, start_method),
        )
        it = iter(l1)
        delivered1: list[int] = []
        for _ in range(C_K):
            delivered1.extend(int(x) for x in next(it))
        sd = _roundtrip(api, l1.state_dict())
        del it
        C.close_loader(l1)
        ds1.close_log()

        ds2 = RecordingDataset(C_N, log_dir, "resumed", C_WORK_S)
        l2 = api.DataLoader(
            ds2,
            batch_size=C_BATCH,
            shuffle=True,
            num_workers=workers,
            generator=_gen(),
            **_mp(workers, start_method),
        )
        l2.load_state_dict(sd)
        batches2 = [[int(x) for x in b] for b in l2]
        C.close_loader(l2)
        ds2.close_log()

        fetched1 = read_log(log_dir, "first")
        fetched2 = read_log(log_dir, "resumed")
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)

    d1 = set(delivered1)
    delivered2 = [i for b in batches2 for i in b]
    bad_batches = sum(1 for b in batches2 if d1.intersection(b))
    refetched = sum(1 for i in fetched2 if i in d1)
    prefetch_waste = len(set(fetched1) - d1)
    dup_fetch2 = len(fetched2) - len(set(fetched2))
    everything = delivered1 + delivered2
    complete = sorted(everything) == list(range(C_N))
    lost = C_N - len(set(everything))
    twice = len(everything) - len(set(everything))
    row = [
        f"{workers} workers, k={C_K} of {-(-C_N // C_BATCH)} batches",
        bad_batches,
        refetched,
        prefetch_waste,
        dup_fetch2,
        "yes" if complete else f"NO: {lost} lost, {twice} twice",
    ]
    summary = {
        "workers": workers,
        "redelivered_batches": bad_batches,
        "refetched_delivered_samples": refetched,
        "first_run_prefetched_unconsumed": prefetch_waste,
        "resumed_duplicate_fetches": dup_fetch2,
        "stream_complete": complete,
        "lost": lost,
        "delivered_twice": twice,
    }
    return row, summary, complete


def main() -> int:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="A/B rounds for (b) (default 7)")
    p.add_argument("--parts", default="a,b,c", help="comma-separated subset of a,b,c")
    args = C.parse(p)
    api = C.loader_api()
    parts = set(args.parts.split(","))
    calls = 10**3 if args.quick else 10**4
    rounds = args.rounds or (2 if args.quick else 7)
    print(C.env_line(args.start_method))
    print(f"ours: {api.name}")
    if api.selftest:
        print(
            "SELF-TEST: the shim's state is a batch counter and it resumes by re-reading; "
            "the figures below test this script, not resumable_loader"
        )
    summary: dict[str, Any] = {"start_method": args.start_method}
    ok = True

    if "a" in parts:
        t = time.perf_counter()
        rows, summary["a"] = part_a(api, args.start_method, calls)
        print(
            f"\n(a) state_dict() mid-epoch, 8 workers, shuffle, batch 64; {calls} calls "
            f"({time.perf_counter() - t:.1f} s)"
        )
        C.print_table(["dataset", "median us", "p99 us", "msgpack B", "json B", "goal"], rows)
        print(
            f"msgpack size growth 10^4 -> 10^7 items: {summary['a']['msgpack_growth_bytes']} B"
            " (goal 0)"
        )

    if "b" in parts:
        t = time.perf_counter()
        rows, summary["b"] = part_b(api, args.start_method, rounds)
        print(
            f"\n(b) first batch: load_state_dict(sd) on a new loader vs a fresh loader; "
            f"{rounds} rounds ({time.perf_counter() - t:.1f} s)"
        )
        C.print_table(["case", "resumed ms", "fresh ms", "ratio", "min", "max", "goal"], rows)

    if "c" in parts:
        t = time.perf_counter()
        rows = []
        summary["c"] = []
        for workers in (2, 0):
            row, s, complete = part_c(api, args.start_method, workers)
            rows.append(row)
            summary["c"].append(s)
            ok = ok and complete
        print(
            f"\n(c) re-fetch on resume, shuffle, batch {C_BATCH}, {C_N} items "
            f"({time.perf_counter() - t:.1f} s)"
        )
        C.print_table(
            [
                "case",
                "redelivered batches",
                "refetched delivered samples",
                "1st run prefetched unused",
                "resumed dup fetches",
                "stream complete",
            ],
            rows,
        )
        print("goals: redelivered batches 0, refetched delivered samples 0")

    summary["stream_ok"] = ok
    C.emit_summary("state", summary)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
