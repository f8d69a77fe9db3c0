"""Kill timeline: batches delivered over time while a worker is SIGKILLed every K batches.

One map-style workload (3x64x64 float32 items after ~0.2 ms of CPU each, batch 16,
2 workers): a thread waits until K, 2K, 3K, ... batches have been delivered and each time
SIGKILLs one worker (worker 0, then 1, then 0, ...). Every batch's arrival time is recorded.

- ours (``resumable_loader.DataLoader``): the victim's pid comes from
  ``loader.statistics().worker_pids``; the loader respawns the worker and re-sends its tasks,
  so the line keeps going with a blip at each kill. Its stream is checked: every index once,
  in order (the script exits non-zero otherwise).
- torch's ``DataLoader`` and torchdata's ``StatefulDataLoader`` (when importable): the victim
  is a child process of this one (psutil); both raise ``RuntimeError: DataLoader worker
  (pid N) is killed by signal``, and the run records where they stopped.
- ours and torch's without kills, for reference.

Each loader runs 3 times (quick: once), the order rotated every round; the run with the median
last-batch time is shown, and the cost of a kill to ours is the median over rounds of
(kills run - no-kills run) / kills. Times are from the loader's constructor (worker start-up
included). The figures are printed; the full series is in the last-line JSON, from which
``plots.py`` draws ``timeline.png`` (``--png PATH`` draws it right away).

Run: python3 benchmarks/bench_timeline.py [--quick] [--batches N] [--kill-every K]
     [--repeats N] [--start-method fork|spawn|forkserver] [--png PATH]
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
import time
from typing import Any

import _common as C
from bench_throughput import HeavyDataset, stateful_loader

ITEM_WORK_S = 0.2e-3
BATCH = 16
WORKERS = 2


def ours_pids(loader: Any) -> list[int]:
    """Live worker pids by worker id (-1: not running) from the loader's own statistics."""
    return [int(p) for p in loader.statistics().worker_pids]


def child_pids(loader: Any) -> list[int]:
    """torch / torchdata: the live children of this process, oldest first."""
    return C.worker_pids()


class Killer(threading.Thread):
    """SIGKILLs worker (j % WORKERS) once ``delivered`` reaches (j + 1) * every, j = 0, 1, ...
    (not after the epoch's last batch)."""

    def __init__(self, loader: Any, find_pids: Any, every: int, t0: float, last: int) -> None:
        super().__init__(daemon=True)
        self.last = last  # no kill once this many batches are delivered: the epoch is over
        self.loader = loader
        self.find_pids = find_pids
        self.every = every
        self.t0 = t0
        self.cond = threading.Condition()
        self.delivered = 0
        self.done = False
        self.kills: list[dict[str, Any]] = []

    def batch(self) -> None:
        with self.cond:
            self.delivered += 1
            if self.delivered % self.every == 0:
                self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify()

    def run(self) -> None:
        target = self.every
        while target < self.last:
            with self.cond:
                while not self.done and self.delivered < target:
                    self.cond.wait()
                if self.done:
                    return
                at = self.delivered
            victim = self._victim(len(self.kills))
            if victim is None:
                # every worker is being respawned right now: try again shortly
                time.sleep(0.002)
                continue
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append({"t": time.perf_counter() - self.t0, "batch": at, "pid": victim})
            target += self.every

    def _victim(self, j: int) -> int | None:
        deadline = time.perf_counter() + 1.0
        while time.perf_counter() < deadline:
            try:
                pids = self.find_pids(self.loader)
            except Exception:  # the loader is closing
                return None
            want = j % WORKERS
            if want < len(pids) and pids[want] > 0:
                return pids[want]
            alive = [p for p in pids if p > 0]
            if alive:
                return alive[0]
            time.sleep(0.001)
        return None


def _settle(loader: Any) -> None:
    """Close the loader and let its workers go. torch's SIGCHLD handler can raise the
    "killed by signal" error again while its iterator shuts down (in any bytecode of the main
    thread): such repeats are expected after a kill and are swallowed here."""
    for _ in range(5):
        try:
            C.close_loader(loader)
            return
        except RuntimeError:
            continue


def run(
    name: str, loader_cls: type, ds: HeavyDataset, method: str, kill_every: int | None, find: Any
) -> dict[str, Any]:
    """One epoch; with ``kill_every``, a Killer thread SIGKILLs a worker every that many
    batches. Returns the arrival series and what happened."""
    t0 = time.perf_counter()
    loader = loader_cls(ds, batch_size=BATCH, num_workers=WORKERS, multiprocessing_context=method)
    killer = Killer(loader, find, kill_every, t0, -(-len(ds) // BATCH)) if kill_every else None
    times: list[float] = []
    indices: list[int] = []
    error = None
    t_error = None
    if killer is not None:
        killer.start()
    it = None
    try:
        it = iter(loader)
        for b in it:
            times.append(time.perf_counter() - t0)
            indices.extend(int(v) for v in b[:, 0, 0, 0])
            if killer is not None:
                killer.batch()
    except Exception as e:  # torch / torchdata: "DataLoader worker (pid N) is killed by signal"
        t_error = time.perf_counter() - t0
        error = f"{type(e).__name__}: {e}".splitlines()[0]
    finally:
        if killer is not None:
            killer.stop()
            try:
                killer.join(5)
            except RuntimeError as e:
                # torch's SIGCHLD handler raises in the main thread for a worker that died
                # after its iterator already failed: the same error, seen again.
                error = error or f"{type(e).__name__}: {e}".splitlines()[0]
                killer.join(5)
    stats = C.statistics_dict(loader)
    del it
    _settle(loader)
    kills = killer.kills if killer is not None else []
    gaps_after_kill = []
    for k in kills:
        # the gap that spans the kill: from the last batch before it to the first one after
        after = [t for t in times if t > k["t"]]
        before = [t for t in times if t <= k["t"]]
        if after and before:
            gaps_after_kill.append(after[0] - before[-1])
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {
        "name": name,
        "kill_every": kill_every,
        "times": times,
        "batches": len(times),
        "end_s": times[-1] if times else float("nan"),
        "first_batch_s": times[0] if times else float("nan"),
        "median_gap_ms": C.median(gaps) * 1e3,
        "max_gap_spanning_kill_ms": max(gaps_after_kill, default=float("nan")) * 1e3,
        "kills": kills,
        "error": error,
        "t_error": t_error,
        "indices_ok": indices == list(range(len(indices))),
        "respawns": stats.get("respawns"),
        "resent_tasks": stats.get("resent_tasks"),
    }


def print_runs(runs: list[dict[str, Any]]) -> None:
    """The table of the runs shown: batches, timing, kills and how each run ended."""
    rows = []
    for r in runs:
        if r["error"]:
            outcome = f"stopped at batch {r['batches']}, {r['t_error']:.2f} s: {r['error'][:60]}"
        else:
            outcome = "completed"
        rows.append([
            r["name"], r["batches"], r["end_s"], r["median_gap_ms"], len(r["kills"]),
            r["max_gap_spanning_kill_ms"], r["respawns"] if r["respawns"] is not None else "-",
            outcome,
        ])  # fmt: skip
    print()
    C.print_table(
        ["loader", "batches", "last batch s", "median gap ms", "kills",
         "max gap over a kill ms", "respawns", "outcome"],
        rows, digits=2,
    )  # fmt: skip


def main() -> int:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--batches", type=int, default=None, help="epoch length (default 400, quick 200)"
    )
    p.add_argument("--kill-every", type=int, default=40, help="batches between kills (40)")
    p.add_argument("--repeats", type=int, default=None, help="runs of each (default 3, quick 1)")
    p.add_argument("--png", default=None, help="draw the timeline to this PNG (needs matplotlib)")
    args = C.parse(p)
    n_batches = args.batches or (200 if args.quick else 400)
    repeats = args.repeats or (1 if args.quick else 3)
    api = C.loader_api()
    ds = HeavyDataset(n_batches * BATCH, ITEM_WORK_S)  # 3x64x64 float32, ~0.2 ms each
    sdl = stateful_loader()
    print(C.env_line(args.start_method))
    print(
        f"ours: {api.name}; {n_batches} batches of {BATCH} x 3x64x64 float32 items "
        f"(~{ITEM_WORK_S * 1e3:.1f} ms of CPU each), {WORKERS} workers; SIGKILL a worker every "
        f"{args.kill_every} batches (from a thread)"
    )
    if sdl is None:
        print("torchdata is not installed: its StatefulDataLoader is not measured")
    if api.selftest:
        print("SELF-TEST: 'ours' is the torch shim and stops at the first kill like torch")

    plan: list[tuple[str, type, int | None, Any]] = [
        ("ours, no kills", api.DataLoader, None, None),
        ("torch, no kills", C.torch_loader(), None, None),
        ("ours", api.DataLoader, args.kill_every, child_pids if api.selftest else ours_pids),
        ("torch", C.torch_loader(), args.kill_every, child_pids),
    ]
    if sdl is not None:
        plan.append(("torchdata", sdl, args.kill_every, child_pids))
    # one untimed warm-up epoch of ours and torch's (imports, allocator, page cache)
    for cls in (api.DataLoader, C.torch_loader()):
        run("warm-up", cls, HeavyDataset(4 * BATCH, ITEM_WORK_S), args.start_method, None, None)

    # Every loader runs `repeats` times, the order rotated each round so load drift spreads
    # evenly; the run with the median end time is the one shown and drawn.
    all_runs: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in plan}
    ok = True
    for rep in range(repeats):
        k = rep % len(plan)
        for name, cls, every, find in plan[k:] + plan[:k]:
            r = run(name, cls, ds, args.start_method, every, find)
            all_runs[name].append(r)
            bad = r["error"] or not r["indices_ok"] or r["batches"] != n_batches
            if name.startswith("ours") and not api.selftest and bad:
                print(f"{name}: WRONG STREAM or error: {r['error']}", file=sys.stderr)
                ok = False
            print(f"  {name} #{rep + 1}: {r['batches']} batches in {r['end_s']:.2f} s", flush=True)
    runs = []
    for rs in all_runs.values():
        pick = sorted(rs, key=lambda r: r["end_s"])[(len(rs) - 1) // 2]
        runs.append({**pick, "end_s_runs": [r["end_s"] for r in rs]})

    print_runs(runs)
    per_kill = []
    for with_k, without in zip(all_runs.get("ours", []), all_runs.get("ours, no kills", [])):
        if not with_k["error"] and with_k["kills"]:
            per_kill.append((with_k["end_s"] - without["end_s"]) / len(with_k["kills"]))
    if per_kill:
        print(
            f"ours: each kill added {C.median(per_kill) * 1e3:+.0f} ms to the epoch (median over "
            f"{len(per_kill)} rounds of (kills run - no-kills run) / kills; "
            f"per round: {', '.join(f'{x * 1e3:+.0f}' for x in per_kill)} ms)"
        )
    print(
        f"{repeats} run(s) of each loader, order rotated; the table and chart show the run "
        "with the median last-batch time"
    )
    print("time: seconds since the loader's constructor; gap over a kill: last batch before "
          "the kill -> first batch after it")  # fmt: skip
    summary: dict[str, Any] = {
        "start_method": args.start_method,
        "n_batches": n_batches,
        "batch_size": BATCH,
        "workers": WORKERS,
        "item_work_ms": ITEM_WORK_S * 1e3,
        "kill_every": args.kill_every,
        "repeats": repeats,
        "ours_ms_per_kill_median": C.median(per_kill) * 1e3 if per_kill else None,
        "torchdata": sdl is not None,
        "loaders": [
            {
                k: (round(v, 5) if isinstance(v, float) else v)
                for k, v in r.items()
                if k not in ("times", "kills")
            }
            | {
                "times": [round(t, 4) for t in r["times"]],
                "kills": [{**k, "t": round(k["t"], 4)} for k in r["kills"]],
            }
            for r in runs
        ],
        "stream_ok": ok,
    }
    summary["foreign_cpu_share"] = C.foreign_cpu_share()
    summary["cpus"] = os.cpu_count()
    summary["loadavg_1m_end"] = os.getloadavg()[0]
    if args.png:
        import plots

        if plots.draw_timeline(args.png, summary):
            print(f"drew {args.png}")
        else:
            print("matplotlib is not importable: no PNG")
    C.emit_summary("timeline", summary)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
