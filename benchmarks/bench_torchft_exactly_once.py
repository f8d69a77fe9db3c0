"""Exactly once under torchft: our ReplicaGroupLoader against torchft's own data path.

    python benchmarks/bench_torchft_exactly_once.py            # needs torchft (the test extra)
    python benchmarks/bench_torchft_exactly_once.py --quick    # one schedule

Real torchft processes on CPU (gloo): a lighthouse in this process, replica groups of one
process each running tests/_torchft_job.py, which SIGKILL themselves at a named point of a
step and are restarted behind a gate (the harness of tests/integrations/test_torchft.py,
imported from there). Each schedule runs three times:

* **ours**: ``ReplicaGroupLoader`` over our ``DataLoader`` (shuffle, 2 workers), the
  synchronous quorum;
* **baseline (i)**: torchft's ``DistributedSampler`` + torchdata's ``StatefulDataLoader``
  (2 workers) as torchft's train_ddp.py uses them: the default async quorum, the loader's
  state not registered, so a restarted group starts its shard again;
* **baseline (ii)**: the same with the loader's state registered with the manager
  (torchft#309's suggestion), so a healing group takes a peer's loader state.

The baselines stop at the step our run of the same schedule ended its epoch at, so both
train the same number of steps. For each run the records give, per step, the attempt that
committed (the highest quorum id), and its samples: those of the groups that were dealt the
step and participated (a group healing under the async quorum has its gradient zeroed; a
group that died after its allreduce still counts). Over the epoch's ``n`` samples:
**missing** = samples never in a committed step, **repeated** = committed samples beyond
the first of each. The script exits 1 when ours is not 0 / 0.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Schedule:
    """Which groups die where, and which one comes back while `live` waits at `gate`."""

    name: str
    groups: int
    kills: dict[int, str]
    # (group, live group whose commit of the step before `gate` starts it, gate step)
    restart: tuple[int, int, int] | None = None
    survivors: list[tuple[int, int]] = field(default_factory=list)


SCHEDULES = [
    Schedule(
        "T1 2 groups: g1 killed before should_commit at step 3, back at 5",
        2,
        {1: "3:after_backward"},
        (1, 0, 5),
        [(0, 0), (1, 1)],
    ),
    Schedule(
        "T2 g1 killed at the top of step 5, back at 7",
        3,
        {1: "5:top"},
        (1, 0, 7),
        [(0, 0), (1, 1), (2, 0)],
    ),
    Schedule("T3 g2 killed at step 4, never back", 3, {2: "4:top"}, None, [(0, 0), (1, 0)]),
    Schedule(
        "T4 g1 and g2 killed at step 4, g1 back at 7",
        3,
        {1: "4:top", 2: "4:top"},
        (1, 0, 7),
        [(0, 0), (1, 1)],
    ),
    Schedule(
        "T5 g1 killed before commit at 6 (never back), g2 at 9 (back at 11)",
        3,
        {1: "6:after_backward", 2: "9:after_backward"},
        (2, 0, 11),
        [(0, 0), (2, 1)],
    ),
    Schedule(
        "A  g1 dies inside step 3's allreduce, never back",
        3,
        {1: "3:before_backward"},
        None,
        [(0, 0), (2, 0)],
    ),
]

VARIANTS = {
    "ours": {"LOADER": "ours"},
    "baseline (i)": {"LOADER": "baseline"},
    "baseline (ii)": {"LOADER": "baseline", "BASELINE_STATE": "1"},
}


def harness() -> Any:
    """tests/integrations/test_torchft.py, imported by path (tests/ is not a package)."""
    path = ROOT / "tests" / "integrations" / "test_torchft.py"
    spec = importlib.util.spec_from_file_location("_torchft_harness", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(
    h: Any,
    lighthouse: str,
    schedule: Schedule,
    env: dict[str, str],
    n: int,
    batch: int,
    keep: Path | None,
) -> list[dict[str, Any]]:
    """One schedule under one variant; the records of every process (kept under `keep`)."""
    place: Any = (
        tempfile.TemporaryDirectory(prefix="bench_torchft_")
        if keep is None
        else contextlib.nullcontext(tempfile.mkdtemp(prefix=f"{schedule.name[:2]}_", dir=keep))
    )
    with place as tmp:
        job = h.Job(
            Path(tmp),
            lighthouse,
            n=n,
            BATCH=str(batch),
            NUM_REPLICA_GROUPS=str(schedule.groups),
            **env,
        )
        try:
            for gid in range(schedule.groups):
                extra = {}
                if gid in schedule.kills:
                    extra["KILL_AT"] = schedule.kills[gid]
                # Every group but the one that comes back waits at the gate (a dead one never
                # reaches it), so that the restart lands at the same step in every run.
                if schedule.restart is not None and gid != schedule.restart[0]:
                    extra.update(GATE_STEP=str(schedule.restart[2]), GATE_FILE=str(job.gate))
                job.start(gid, **extra)
            job.go()
            if schedule.restart is not None:
                gid, live, gate = schedule.restart
                job.restart(gid, 1, live=live, gate_step=gate)
                job.open_gate()
            return job.finish(schedule.survivors)
        finally:
            job.close()


def committed_steps(h: Any, records: list[dict[str, Any]]) -> int:
    return len({d["step"] for d in h.committed_deals(records)})


def main() -> int:
    p = _common.base_parser(__doc__.splitlines()[0], start_method=False)
    p.add_argument("--n", type=int, default=240, help="samples in the epoch")
    p.add_argument("--batch", type=int, default=4, help="per-process batch size")
    p.add_argument("--keep", type=Path, help="keep every run's records under this folder")
    p.add_argument("--schedules", default="", help="comma-separated prefixes (T1,T3,...)")
    args = p.parse_args()
    # A SIGTERM unwinds like Ctrl-C, so that the harness kills the groups it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # Up to 18 runs of real processes: far more than _common's watchdog allows.
    faulthandler.dump_traceback_later(300 if args.quick else 2400, exit=True)
    if importlib.util.find_spec("torchft") is None or importlib.util.find_spec("torchdata") is None:
        print("needs torchft and torchdata: pip install -c constraints.txt -e '.[test]'")
        return 2
    # The lighthouse logs every quorum at INFO to this process's stderr; the groups' own logs
    # go to files, and keep INFO.
    rust_log = os.environ.get("RUST_LOG")
    os.environ["RUST_LOG"] = "warn"
    from torchft._torchft import LighthouseServer

    if rust_log is None:
        del os.environ["RUST_LOG"]
    else:
        os.environ["RUST_LOG"] = rust_log

    h = harness()
    wanted = [s for s in args.schedules.split(",") if s]
    schedules = [s for s in SCHEDULES if not wanted or any(s.name.startswith(w) for w in wanted)]
    if args.quick:
        schedules = schedules[:1]
    print(_common.env_line())
    print(f"n={args.n} batch={args.batch}, one process per group, torchft 0.2.0 (gloo, CPU)")
    server = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        # How long a quorum waits for a live group that has not asked yet (torchft's default
        # is 60 s). Under load a group can be late by more than a step: with 100 ms, two
        # groups took turns missing the quorum and healing, and one that missed the epoch's
        # last quorum formed one of its own (min_replicas=1) and trained that step again.
        join_timeout_ms=2000,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=1000,
    )
    rows, summary, wrong = [], {}, False
    try:
        for schedule in schedules:
            row: list[Any] = [schedule.name]
            stop = None
            for variant, env in VARIANTS.items():
                env = dict(env)
                if stop is not None:
                    env["STOP_STEP"] = str(stop)
                t0 = time.monotonic()
                records = run(h, server.address(), schedule, env, args.n, args.batch, args.keep)
                seconds = time.monotonic() - t0
                ids = h.committed_ids(records)
                missing, repeated = h.missing_repeated(ids, args.n)
                if variant == "ours":
                    stop = committed_steps(h, records)
                    wrong |= (missing, repeated) != (0, 0)
                row.append(f"{missing} / {repeated}")
                summary[f"{schedule.name[:2]} {variant}"] = {
                    "missing": missing,
                    "repeated": repeated,
                    "steps": committed_steps(h, records),
                    "seconds": round(seconds, 1),
                }
                print(
                    f"  {schedule.name[:2]} {variant}: {missing} missing, {repeated} repeated, "
                    f"{committed_steps(h, records)} committed steps, {seconds:.1f} s",
                    flush=True,
                )
            rows.append(row)
    finally:
        server.shutdown()
    print()
    _common.print_table(
        [
            "schedule",
            "ours missing / repeated",
            "baseline (i) missing / repeated",
            "baseline (ii) missing / repeated",
        ],
        rows,
    )
    _common.emit_summary("torchft_exactly_once", summary)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
