"""The crash-case table: every way a worker can fail, under every start method.

Each row runs a loader whose workers fail at a chosen batch and compares what it delivers with
an uninterrupted reference run, then checks that ``statistics().respawns_by_cause`` names the
cause. conftest.py's autouse fixture then checks that nothing (process, thread, fd, shm) was
left behind.

The dimensions of a row:

* action: SIGKILL, SIGSEGV (a real invalid read), ``os._exit(3)``, SIGSTOP (a hung worker,
  found by ``task_timeout=1.0``);
* position: the first batch (right after the workers booted), a middle one, the last one
  (the end of the epoch comes while a replacement may still be booting);
* scope: one worker dies (the survivor takes its tasks), or every worker dies (two adjacent
  batches, normally in flight on the two workers at the same time, each hold a sample that
  kills whichever worker fetches it first, so the stream has to wait for a replacement). The
  number of deaths is exact either way: each faulty sample acts on its first fetch only.

Map-style rows use ``RandomAugDataset(24)``, batch size 4 (batch b holds samples 4b .. 4b+3)
and 2 workers; the reference is the same loader with ``num_workers=0`` (a batch's values depend
only on which batch it is). Stream rows use ``FaultyStream`` over ``StatefulShard(14)`` (its
state rides with the results) or ``Shard(14)`` (no state: a replacement fast-forwards), batch
size 3, 2 workers: worker 0 yields samples 0, 2, .., 12 and worker 1 yields 1, 3, .., 15, so
the batches are [0 2 4] [1 3 5] [6 8 10] [7 9 11] [12] [13 15]; faults are keyed by sample id
(a replacement restarts its item count), and the reference is an uninterrupted 2-worker run
under fork (stream values depend on the worker and the fetch number, not the start method).

Coverage, and why it is pruned: a ``fork`` start costs milliseconds, a ``spawn`` or
``forkserver`` worker imports torch (2-3 s per start on a 2-core box, where CI has to run the
whole suite in well under 10 minutes), and each SIGSTOP row waits a second for
``task_timeout``. So:

* fork, map-style: the full action x position x scope product (24 rows);
* fork, ``StatefulShard``: the full product, except SIGSTOP once per position (21 rows);
  ``Shard``: SIGKILL at every position and scope, SIGSEGV and ``os._exit`` once (8 rows);
* spawn and forkserver, map-style: each action once, placed so that together they cover every
  position and both scopes -- SIGKILL of every worker at the first batch, SIGSEGV of every
  worker at the middle batch, ``os._exit`` of one at the last batch, SIGSTOP of one at the
  middle batch. What depends on the start method is how a worker starts, how its death is
  seen (forkserver workers are not our children: no SIGCHLD, and the exit status comes from
  the fork server) and how a replacement starts; the scheduling after a death does not;
* spawn and forkserver, ``StatefulShard``: every worker SIGKILLed at the middle batch.

The failures that are not deaths, under all three start methods:

* ``worker_init_fn`` raising, a module-level picklable callable counting starts in files:
  on worker 0's first start (its tasks go to the other worker) -> the stream is identical,
  ``{"init_error": 1}``. Under fork also on every worker's first start, and on the first
  replacement started after every worker was SIGKILLed at the middle or the last batch;
* an unpicklable result at the first, middle and last batch -> an error at that batch's
  position saying so, no respawn, then every other batch in order. Under spawn/forkserver
  the three positions are three epochs of one loader with ``persistent_workers=True``
  (``Fault(attempts={epoch})``: each epoch fetches each sample once);
* a poison sample (it kills every worker that fetches it) -> ``WorkerCrashError`` at that
  batch's position naming its indices, after three deaths, then the rest of the stream. Under
  fork at all three positions; under spawn at the first batch and under forkserver at the last
  (a poison costs two waits for a replacement; test_supervisor.py has the middle one under all
  three start methods).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from _datasets import RandomAugDataset
from _streams import Shard, StatefulShard

from resumable_loader import DataLoader, RetryPolicy, WorkerCrashError
from resumable_loader.testing import Fault, FaultyDataset, FaultyStream, canonical

METHODS = ("fork", "spawn", "forkserver")
ACTIONS = ("sigkill", "sigsegv", "exit", "stop")
WHERE = ("first", "mid", "last")
SCOPES = ("one", "every")
CAUSE = {"sigkill": "signal:SIGKILL", "sigsegv": "signal:SIGSEGV", "exit": "exit:3", "stop": "hang"}
TASK_TIMEOUT = 1.0  # for "stop" only: a hung worker is found after this long
# Under spawn/forkserver: (action, where, scope).
SPAWN_CRASHES = (
    ("sigkill", "first", "every"),
    ("sigsegv", "mid", "every"),
    ("exit", "last", "one"),
    ("stop", "mid", "one"),
)
STREAM_SPAWN_CRASHES = (("sigkill", "mid", "every"),)
# Streams under fork: SIGSTOP (a second per row) at each position once, both scopes.
STOPS = (("first", "one"), ("mid", "every"), ("last", "one"))
SHARD_OTHERS = (("sigsegv", "mid", "one"), ("exit", "last", "one"))


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(42)


def crash_rows(spawn=SPAWN_CRASHES, fork=lambda action, where, scope: True) -> list:
    """(method, action, where, scope): under fork the product pruned by ``fork`` (default:
    none), under spawn/forkserver the (action, where, scope) in ``spawn``."""
    return [
        (m, a, w, s)
        for m in METHODS
        for a in ACTIONS
        for w in WHERE
        for s in SCOPES
        if ((a, w, s) in spawn if m != "fork" else fork(a, w, s))
    ]


def timeout_kw(action: str) -> dict:
    return {"task_timeout": TASK_TIMEOUT} if action == "stop" else {}


def check_crash(loader, ref: list, action: str, deaths: int) -> None:
    """One epoch: the batches equal the reference's and every respawn has the action's cause."""
    got = [canonical(b) for b in loader]
    stats = loader.statistics()
    assert got == ref, "the stream differs from the uninterrupted run"
    assert dict(stats.respawns_by_cause) == {CAUSE[action]: deaths}, stats
    assert stats.resent_tasks >= deaths, stats


# ---- map-style: deaths and hangs ----------------------------------------------------------------
N, BS = 24, 4  # 6 batches: batch b holds samples 4b .. 4b+3
BATCH = {"first": 0, "mid": 2, "last": 5}
# The samples that fail: one in the batch at `where`, or also one in the batch running beside
# it on the other worker.
MAP_SAMPLES = {
    "one": {"first": (1,), "mid": (10,), "last": (23,)},
    "every": {"first": (1, 5), "mid": (10, 14), "last": (19, 23)},
}


def map_reference(epochs: int = 1, **kw) -> list:
    loader = DataLoader(RandomAugDataset(N), batch_size=BS, generator=gen(), **kw)
    return [[canonical(b) for b in loader] for _ in range(epochs)]


def map_loader(tmp_path, faults: dict, method: str, **kw) -> DataLoader:
    ds = FaultyDataset(RandomAugDataset(N), faults, tmp_path)
    return DataLoader(
        ds, batch_size=BS, num_workers=2, multiprocessing_context=method, generator=gen(), **kw
    )


@pytest.mark.parametrize(("method", "action", "where", "scope"), crash_rows())
def test_map_worker_death(tmp_path, method: str, action: str, where: str, scope: str) -> None:
    samples = MAP_SAMPLES[scope][where]
    faults = {i: Fault(action) for i in samples}
    with map_loader(tmp_path, faults, method, **timeout_kw(action)) as loader:
        check_crash(loader, map_reference()[0], action, len(samples))


# ---- map-style: worker_init_fn raising ----------------------------------------------------------
class InitFails:
    """A ``worker_init_fn`` that raises on the first start of each worker in ``workers``
    (None: every worker), or with ``replacement=True`` on the first replacement started after
    a death (one only, whichever worker it replaces). Starts are counted in files under
    ``state_dir``, so a replacement knows that its worker slot started before."""

    def __init__(self, state_dir: str, workers: tuple[int, ...] | None, replacement: bool):
        self.state_dir, self.workers, self.replacement = state_dir, workers, replacement

    def __call__(self, worker_id: int) -> None:
        path = os.path.join(self.state_dir, f"starts-{worker_id}")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, b".")
        finally:
            os.close(fd)
        start = os.path.getsize(path) - 1  # one slot's starts never overlap: no race
        if self.workers is not None and worker_id not in self.workers:
            return
        if self.replacement:
            if start == 0:
                return
            try:  # exactly one replacement, of any slot, gets to create the flag
                os.close(os.open(os.path.join(self.state_dir, "failed"), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
        elif start > 0:
            return
        raise ConnectionError(f"worker {worker_id}, start {start}: init could not reach the server")


# (where, scope) -> (the SIGKILL deaths before, InitFails args, failed starts). A failing
# replacement is certain only when every worker died: otherwise the survivor may finish the
# epoch before the replacement runs its worker_init_fn, hence no ("mid", "one").
INIT_CASES = {
    ("first", "one"): ((), ((0,), False), 1),
    ("first", "every"): ((), (None, False), 2),
    ("mid", "every"): (MAP_SAMPLES["every"]["mid"], (None, True), 1),
    ("last", "every"): (MAP_SAMPLES["every"]["last"], (None, True), 1),
}
INIT_ROWS = [
    (m, w, s) for m in METHODS for (w, s) in INIT_CASES if m == "fork" or (w, s) == ("first", "one")
]


@pytest.mark.parametrize(("method", "where", "scope"), INIT_ROWS)
def test_map_worker_init_fn_raises(tmp_path, method: str, where: str, scope: str) -> None:
    deaths, (workers, replacement), failures = INIT_CASES[where, scope]
    init = InitFails(str(tmp_path), workers, replacement)
    faults = {i: Fault("sigkill") for i in deaths}
    # InitFails raises ConnectionError: transient when a RetryPolicy names it (OSError), and
    # then a failed start is started again; without one it would be raised as torch does.
    with map_loader(tmp_path, faults, method, worker_init_fn=init, retry=RetryPolicy()) as loader:
        got = [canonical(b) for b in loader]
        stats = loader.statistics()
    assert got == map_reference()[0]
    expected = {"init_error": failures}
    if deaths:
        expected[CAUSE["sigkill"]] = len(deaths)
    assert dict(stats.respawns_by_cause) == expected, stats


# ---- map-style: an unpicklable result -----------------------------------------------------------
POSITION_ROWS = [
    pytest.param(m, ws, id=f"{m}-{'+'.join(ws)}")
    for m in METHODS
    for ws in ([(w,) for w in WHERE] if m == "fork" else [WHERE])
]


@pytest.mark.parametrize(("method", "positions"), POSITION_ROWS)
def test_map_unpicklable_result(tmp_path, method: str, positions) -> None:
    # collate_fn=list keeps the items as they are, so the batch really holds the lambda.
    faults = {
        MAP_SAMPLES["one"][w][0]: Fault("unpicklable", attempts=frozenset({e}))
        for e, w in enumerate(positions)
    }
    ref = map_reference(len(positions), collate_fn=list)
    with map_loader(
        tmp_path, faults, method, collate_fn=list, persistent_workers=len(positions) > 1
    ) as loader:
        for e, where in enumerate(positions):
            b = BATCH[where]
            it = iter(loader)
            got = [canonical(next(it)) for _ in range(b)]
            with pytest.raises(Exception, match=rf"task {b} could not be sent \(pickling\)"):
                next(it)
            got += [canonical(x) for x in it]
            assert got == ref[e][:b] + ref[e][b + 1 :], f"epoch {e}: unpicklable at {where}"
            assert loader.statistics().respawns == 0


# ---- map-style: a poison sample -----------------------------------------------------------------
POISON_ROWS = [
    (m, w)
    for m in METHODS
    for w in WHERE
    if m == "fork" or (m, w) in {("spawn", "first"), ("forkserver", "last")}
]


@pytest.mark.parametrize(("method", "where"), POISON_ROWS)
def test_map_poison_sample(tmp_path, method: str, where: str) -> None:
    (sample,) = MAP_SAMPLES["one"][where]
    b = BATCH[where]
    ref = map_reference()[0]
    with map_loader(tmp_path, {sample: Fault("sigkill", attempts=None)}, method) as loader:
        it = iter(loader)
        got = []
        with pytest.raises(WorkerCrashError) as info:
            for batch in it:
                got.append(canonical(batch))
        rest = [canonical(x) for x in it]
        stats = loader.statistics()
    err = info.value
    assert got == ref[:b], "the batches before the poison batch come first"
    assert err.task_id == b and err.indices == list(range(BS * b, BS * b + BS))
    assert str(err.indices) in str(err) and "SIGKILL" in str(err)
    assert len(err.attempts) == 3 and all("pid" in a for a in err.attempts)
    assert rest == ref[b + 1 :], "the batches after the poison batch must still come, in order"
    assert dict(stats.respawns_by_cause) == {CAUSE["sigkill"]: 3}, stats


# ---- streams --------------------------------------------------------------------------------
SN, SBS = 14, 3
STREAM_LAYOUT = [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11], [12], [13, 15]]
# One sample in the batch at `where`, or also one in the other worker's batch beside it.
STREAM_SAMPLES = {
    "one": {"first": (0,), "mid": (9,), "last": (13,)},
    "every": {"first": (0, 1), "mid": (8, 9), "last": (12, 13)},
}


def sample_id(item) -> int:
    return int(item[0])


def stream_loader(tmp_path, cls, faults: dict, method: str, **kw) -> DataLoader:
    return DataLoader(
        FaultyStream(cls(SN), faults, tmp_path, key=sample_id),
        batch_size=SBS,
        num_workers=2,
        multiprocessing_context=method,
        generator=gen(),
        **kw,
    )


def row_param(cls, row):
    return pytest.param(cls, *row, id="-".join((cls.__name__, *row)))


STREAM_ROWS = [
    *(
        row_param(StatefulShard, r)
        for r in crash_rows(STREAM_SPAWN_CRASHES, lambda a, w, s: a != "stop" or (w, s) in STOPS)
    ),
    *(
        row_param(Shard, r)
        for r in crash_rows((), lambda a, w, s: a == "sigkill" or (a, w, s) in SHARD_OTHERS)
    ),
]


@pytest.mark.parametrize(("cls", "method", "action", "where", "scope"), STREAM_ROWS)
def test_stream_worker_death(tmp_path, cls, method: str, action: str, where: str, scope: str):
    with stream_loader(tmp_path, cls, {}, "fork") as ref_loader:
        batches = list(ref_loader)
    assert [b[:, 0].tolist() for b in batches] == STREAM_LAYOUT
    ref = [canonical(b) for b in batches]
    samples = STREAM_SAMPLES[scope][where]
    faults = {i: Fault(action) for i in samples}
    with (
        stream_loader(tmp_path, cls, faults, method, **timeout_kw(action)) as loader,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        check_crash(loader, ref, action, len(samples))
    # Only a plain stream's replacement warns (it is fast-forwarded). Python >= 3.12 also
    # warns (DeprecationWarning) that fork() in a process with threads may deadlock: not ours.
    ours = [w for w in caught if not issubclass(w.category, DeprecationWarning)]
    for w in ours:
        assert cls is Shard and "fast-forwarded" in str(w.message), w.message
