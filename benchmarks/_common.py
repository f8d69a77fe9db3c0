"""Shared timing tools for the benchmarks in this folder.

Every script in ``benchmarks/`` imports this module (it is on ``sys.path`` because the scripts
are run as ``python3 benchmarks/NAME.py``; spawned workers inherit that path).

What lives here:

- ``loader_api()``: the loader under test. Normally ``resumable_loader.DataLoader``. With
  ``RL_BENCH_SELFTEST=1`` it is a thin shim over ``torch.utils.data.DataLoader`` whose
  ``state_dict`` only counts delivered batches and whose ``load_state_dict`` re-reads and drops
  them; it exists so that every code path of the scripts can be run before the real loader
  exists. Figures taken in self-test mode say nothing about ``resumable_loader``.
- ``IndexDataset(n)``: item i is the int i (the benchmarks' zero-cost dataset).
- ``spin(seconds)``: CPU busy work on ``time.thread_time`` (``time.sleep`` would let the other
  processes use the core and hide the loader's own CPU cost).
- ``alternate(...)``: A/B measurement in one process, the order swapped every round so neither
  side always runs first (warm caches, CPU frequency and page-cache drift cancel out).
- ``median``, ``percentile``, ``print_table``, ``env_line``, ``emit_summary``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics as _stats
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    # Lets `python3 benchmarks/x.py` import the package from the checkout without installing it.
    sys.path.insert(1, REPO_ROOT)

# torch warns when num_workers exceeds the cores; several benchmarks do that on purpose.
warnings.filterwarnings("ignore", message=r"This DataLoader will create \d+ worker processes")

SELFTEST_ENV = "RL_BENCH_SELFTEST"
START_METHODS = ("fork", "spawn", "forkserver")


def selftest() -> bool:
    """True when the scripts run against torch's DataLoader (``RL_BENCH_SELFTEST=1``)."""
    return os.environ.get(SELFTEST_ENV, "") not in ("", "0")


# ----------------------------------------------------------------------------------------------
# The loader under test
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SelfTestStatistics:
    """What the self-test shim reports from ``statistics()``: torch never respawns anything."""

    respawns: int = 0
    resent_tasks: int = 0
    duplicates_dropped: int = 0
    wait_time_s: float = 0.0


def _make_selftest_loader() -> type:
    import torch.utils.data as tud

    class SelfTestLoader(tud.DataLoader):
        """torch's DataLoader with a naive state: "n batches consumed", resumed by re-reading.

        It deliberately re-fetches what was consumed, so bench_state's re-fetch counters must
        show non-zero figures with it: that is how the counters themselves are tested.
        """

        def __init__(
            self, *args: Any, task_timeout: Any = None, max_task_attempts: int = 3, **kwargs: Any
        ) -> None:
            super().__init__(*args, **kwargs)
            self._rl_consumed = 0
            self._rl_skip = 0

        def __iter__(self) -> Iterator[Any]:
            it = super().__iter__()
            skip, self._rl_skip = self._rl_skip, 0
            self._rl_consumed = 0
            for _ in range(skip):
                next(it)
                self._rl_consumed += 1

            def gen() -> Iterator[Any]:
                for batch in it:
                    self._rl_consumed += 1
                    yield batch

            return gen()

        def state_dict(self) -> dict[str, Any]:
            return {"version": 0, "consumed": self._rl_consumed}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self._rl_skip = int(sd["consumed"])

        def statistics(self) -> SelfTestStatistics:
            return SelfTestStatistics()

        def close(self) -> None:
            pass

    return SelfTestLoader


@dataclasses.dataclass(frozen=True)
class LoaderAPI:
    """The names a benchmark needs from the loader under test."""

    DataLoader: type
    dump_state: Callable[[dict[str, Any]], bytes]
    load_state: Callable[[bytes], dict[str, Any]] | None  # None: not public (yet)
    name: str
    selftest: bool


def loader_api() -> LoaderAPI:
    """The loader under test (see the module docstring for the self-test substitute)."""
    if selftest():
        import msgpack

        return LoaderAPI(
            DataLoader=_make_selftest_loader(),
            dump_state=lambda sd: msgpack.packb(sd, use_bin_type=True),
            load_state=lambda b: msgpack.unpackb(b, raw=False, strict_map_key=False),
            name="SELF-TEST shim (torch DataLoader)",
            selftest=True,
        )
    import resumable_loader as rl

    return LoaderAPI(
        DataLoader=rl.DataLoader,
        dump_state=rl.dump_state,
        load_state=getattr(rl, "load_state", None),
        name="resumable_loader",
        selftest=False,
    )


def torch_loader() -> type:
    import torch.utils.data as tud

    return tud.DataLoader


def close_loader(loader: Any) -> None:
    """Close ours (torch's loader has no close); then collect so its workers are gone."""
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    gc.collect()


def statistics_dict(loader: Any) -> dict[str, Any]:
    """``loader.statistics()`` as plain data ({} when the loader has none).

    Fields are read one by one (no ``dataclasses.asdict``: it deep-copies, and read-only
    mappings such as ``mappingproxy`` cannot be copied); mappings become dicts.
    """
    fn = getattr(loader, "statistics", None)
    if fn is None:
        return {}
    snap = fn()
    if dataclasses.is_dataclass(snap) and not isinstance(snap, type):
        raw = {f.name: getattr(snap, f.name) for f in dataclasses.fields(snap)}
    elif isinstance(snap, Mapping):
        raw = dict(snap)
    else:
        raw = {k: getattr(snap, k) for k in dir(snap) if not k.startswith("_")}
    return {k: _plain(v) for k, v in raw.items()}


def _plain(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_plain(x) for x in v]
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    return v


# ----------------------------------------------------------------------------------------------
# Work and timing
# ----------------------------------------------------------------------------------------------


class IndexDataset:
    """Map-style dataset whose item i is the int i: no per-item storage or work, so 10^7 items
    cost nothing and a run measures the loader's own bookkeeping."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> int:
        return idx


def spin(seconds: float) -> None:
    """Busy-work for ``seconds`` of this thread's CPU time (not sleep: see module docstring).

    On ``time.thread_time``, not a wall clock: a deadline in wall time would count as work the
    time a thread spends preempted by other processes or waiting for the GIL -- two threads
    would then both "finish" GIL-bound work in the time of one, and a loaded machine would do
    the limit's work for free.
    """
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


_nogil = threading.local()


def spin_nogil(seconds: float) -> None:
    """CPU work for ``seconds`` that releases the GIL, as image decoders do: numpy ufuncs on
    256 KiB arrays (each call computes with the GIL released; only the loop around holds it)."""
    import numpy as np

    bufs = getattr(_nogil, "bufs", None)
    if bufs is None:  # per thread: SPDL and Grain call datasets from several threads
        bufs = _nogil.bufs = [np.ones(1 << 16, dtype=np.float32) for _ in range(3)]
    a, b, c = bufs
    end = time.thread_time() + seconds  # (CPU time: see ``spin``)
    while time.thread_time() < end:
        np.multiply(a, b, out=c)
        np.sqrt(c, out=c)


def median(xs: Sequence[float]) -> float:
    return float(_stats.median(xs)) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; nan for an empty list."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q / 100.0 * (len(s) - 1))))
    return float(s[k])


def alternate(
    fns: dict[str, Callable[[], dict[str, float]]],
    rounds: int,
    *,
    warmup: bool = True,
    budget_s: float | None = None,
    min_rounds: int = 2,
) -> dict[str, list[dict[str, float]]]:
    """Run every measurement once per round, rotating the order each round.

    Each function returns a dict of figures for one run (e.g. ``{"epoch_s": 1.2}``). With two
    functions the order is A B, B A, A B, ...; with more it rotates. ``warmup`` runs each once
    first and drops the result (imports, page cache, allocator). With ``budget_s``, no round is
    started that would likely end past the budget (warm-up included) once ``min_rounds`` are
    done: a slow loader shortens the run instead of blowing the time limit. Returns
    name -> list of runs (as many as the rounds actually run).
    """
    names = list(fns)
    t_start = time.monotonic()
    if warmup:
        for n in names:
            fns[n]()
            gc.collect()
    out: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    t_rounds = time.monotonic()
    for r in range(rounds):
        k = r % len(names)
        order = names[k:] + names[:k]
        for n in order:
            out[n].append(fns[n]())
            gc.collect()
        now = time.monotonic()
        per_round = (now - t_rounds) / (r + 1)
        if (
            budget_s is not None
            and r + 1 >= min_rounds
            and r + 1 < rounds
            and now - t_start + per_round > budget_s
        ):
            print(f"  (time budget {budget_s:.0f} s: stopped after {r + 1} of {rounds} rounds)")
            break
    return out


def per_round_ratio(
    runs: dict[str, list[dict[str, float]]], num: str, den: str, key: str
) -> list[float]:
    """Per-round ratios num/den of figure ``key`` (the pairs ran in the same round)."""
    return [a[key] / b[key] for a, b in zip(runs[num], runs[den]) if b[key] > 0]


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def env_line(start_method: str | None = None) -> str:
    import torch

    parts = [
        f"python {platform.python_version()}",
        f"torch {torch.__version__}",
        f"cpus {os.cpu_count()}",
        f"affinity {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'}",
        f"start_method {start_method or 'n/a'}",
        f"platform {platform.platform(terse=True)}",
        f"loadavg(1m) at start {os.getloadavg()[0]:.2f}",
    ]
    if selftest():
        parts.append("SELF-TEST (torch DataLoader stands in for ours)")
    return "env: " + ", ".join(parts)


def fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, float):
        if x != x:  # nan
            return "-"
        return f"{x:.{digits}f}"
    return str(x)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 3) -> None:
    cells = [[fmt(c, digits) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line)
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print(
            "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        )
    sys.stdout.flush()


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and o != o:
        return None
    return str(o)


def _clean(o: Any) -> Any:
    if isinstance(o, float):
        return None if o != o else round(o, 6)
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def _cpu_snapshot() -> tuple[float, float, float]:
    """(wall, busy cpu-seconds of the whole machine, cpu-seconds of this process + reaped kids)."""
    import psutil

    t = psutil.cpu_times()
    # guest time is already counted in user time on Linux; idle, iowait and steal are not ours
    skip = ("idle", "iowait", "steal", "guest", "guest_nice")
    busy = sum(v for k, v in t._asdict().items() if k not in skip)
    own = os.times()
    return time.monotonic(), busy, own.user + own.system + own.children_user + own.children_system


_START = _cpu_snapshot()


def foreign_cpu_share() -> float:
    """Share of the machine's CPU time used by processes other than this run since it started.

    Everything this script started and reaped (workers included) is subtracted, so what is left
    is other people's load: on a shared machine, a figure above ~0.1 means noisy timings.
    """
    wall0, busy0, own0 = _START
    wall1, busy1, own1 = _cpu_snapshot()
    capacity = (wall1 - wall0) * (os.cpu_count() or 1)
    if capacity <= 0:
        return 0.0
    return max(0.0, ((busy1 - busy0) - (own1 - own0)) / capacity)


def emit_summary(bench: str, summary: dict[str, Any]) -> None:
    """The last line of every script: one JSON object (nan becomes null)."""
    foreign = foreign_cpu_share()
    print(
        f"other processes used {foreign:.0%} of the machine's CPU time during this run"
        + (" -- WARNING: timings are noisy, rerun on a quiet machine" if foreign > 0.1 else "")
    )
    payload = {"bench": bench, "selftest": selftest(), "foreign_cpu_share": foreign, **summary}
    print(json.dumps(_clean(payload), sort_keys=True, default=_json_default))
    sys.stdout.flush()


def parse(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the arguments and arm a watchdog, so a hung loader cannot hang the benchmark.

    After WATCHDOG_S (quick: WATCHDOG_QUICK_S) every thread's traceback is printed and the
    process exits with status 1.
    """
    import faulthandler

    args = p.parse_args()
    limit = WATCHDOG_QUICK_S if getattr(args, "quick", False) else WATCHDOG_S
    faulthandler.dump_traceback_later(limit, exit=True)
    return args


# Far above the expected run times (~20 s quick, < 3 min default): only a hang reaches them.
WATCHDOG_S = 900
WATCHDOG_QUICK_S = 300


def base_parser(description: str, *, start_method: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="~20 s sanity run with small sizes")
    if start_method:
        p.add_argument("--start-method", choices=START_METHODS, default="fork")
    return p


def worker_pids() -> list[int]:
    """Live child processes of this one, oldest first, without multiprocessing's helpers."""
    import psutil

    out = []
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(child.cmdline())
            created = child.create_time()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if "forkserver" in cmd or "resource_tracker" in cmd:
            continue
        out.append((created, child.pid))
    return [pid for _, pid in sorted(out)]
