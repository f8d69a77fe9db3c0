"""Adversarial tests of ``Stream`` under our ``DataLoader`` (issue #33), written from the user
docs (README.md, docs/streams.md, docs/guarantees.md, docs/distributed.md) only.

Each test names the promise it checks and compares against an uninterrupted run (or, for a
damaged state, expects a ``CheckpointError`` before anything is delivered). The tests that
fail are findings; ``xfail(strict=True)`` marks the ones where it is not certain the docs
promise the behaviour. Adds about 10 s to the default run on the shared 2-core machine.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _stream_shards as F
import pytest
import torch

from resumable_loader import (
    CheckpointError,
    DataLoader,
    Stream,
    dump_state,
    load_state,
    merge_rank_states,
)
from resumable_loader.plans.streams import deal

SHARDS = 16
PARTITIONS = 8
ALL = [x + 0.5 for x in F.all_samples(list(range(SHARDS)))]
Run = list[tuple[int, list[float]]]


def _make() -> Stream:
    return Stream.from_shards(list(range(SHARDS)), F.read, partitions=PARTITIONS).map(F.plus_half)


def _run(
    workers: int,
    batch: int,
    *,
    state: Any = None,
    stop: int | None = None,
    epochs: int = 1,
    make: Callable[[], Stream] = _make,
) -> tuple[Run, Any]:
    """The README's loop: (epoch, batch) pairs, and the state (through the codec) at ``stop``.
    (``stream_tail=None``: the ranks some tests simulate run one after the other in this
    process, so they cannot agree on an epoch's batches.)"""
    loader = DataLoader(make(), batch_size=batch, num_workers=workers, stream_tail=None)
    start = 0
    if state is not None:
        loader.load_state_dict(state)
        start = state["epoch"]
    out: Run = []
    try:
        for epoch in range(start, epochs):
            for b in loader:
                out.append((epoch, b.tolist()))
                if len(out) == stop:
                    return out, load_state(dump_state(loader.state_dict()))
    finally:
        del loader
    return out, None


def _epoch0(run: Run) -> list[float]:
    return sorted(x for e, b in run if e == 0 for x in b)


def _missing_and_repeated(got: list[float]) -> tuple[list[float], list[float]]:
    have, want = collections.Counter(got), collections.Counter(ALL)
    return sorted((want - have).elements()), sorted((have - want).elements())


def _per_partition(run: Run) -> dict[int, list[float]]:
    where = {s: p for p, shards in enumerate(deal(0, 0, SHARDS, PARTITIONS, True)) for s in shards}
    out: dict[int, list[float]] = {}
    for e, b in run:
        if e == 0:
            for x in b:
                out.setdefault(where[int(x) // 1000], []).append(x)
    return out


def _refused_or_exactly_once(head: Run, state: Any, workers: int, batch: int) -> None:
    """A damaged state must be refused (``CheckpointError``, at load or at the latest before a
    batch is delivered); if it is taken, epoch 0 must still be every sample exactly once."""
    try:
        rest, _ = _run(workers, batch, state=state)
    except CheckpointError:
        return
    missing, repeated = _missing_and_repeated(_epoch0(head + rest))
    assert (missing, repeated) == ([], []), "accepted, and the epoch is not every sample once"


# ---- 1. a dataset error under the loader ---------------------------------------------------
class _FailsOnce:
    """``x + 0.5``, raising ``ValueError`` the first time (in any process) it sees ``bad``."""

    def __init__(self, flags: str, bad: int) -> None:
        self.flags, self.bad = flags, bad

    def __call__(self, x: int) -> float:
        flag = os.path.join(self.flags, str(x))
        if x == self.bad and not os.path.exists(flag):
            open(flag, "w").close()
            raise ValueError(f"a decoder failed on sample {x}")
        return x + 0.5


class _ReadFailsOnce:
    """A seekable reader raising ``OSError`` the first time (in any process) it reaches ``bad``."""

    def __init__(self, flags: str, bad: int) -> None:
        self.flags, self.bad = flags, bad

    def __call__(self, s: int, start: int) -> Iterator[int]:
        for i in range(start, F.shard_len(s)):
            x = F.sample(s, i)
            flag = os.path.join(self.flags, f"r{x}")
            if x == self.bad and not os.path.exists(flag):
                open(flag, "w").close()
                raise OSError(f"a read failed at sample {x}")
            yield x


def _failing(kind: str, flags: Path) -> Callable[[], Stream]:
    def make() -> Stream:
        if kind == "map":
            return Stream.from_shards(list(range(SHARDS)), F.read, partitions=PARTITIONS).map(
                _FailsOnce(str(flags), 7002)
            )
        return Stream.from_shards(
            list(range(SHARDS)), _ReadFailsOnce(str(flags), 7002), partitions=PARTITIONS
        ).map(F.plus_half)

    return make


def _loop_through_one_error(
    kind: str, workers: int, flags: Path, *, resume: bool
) -> list[list[float]]:
    """Epoch 0, catching the one dataset error: go on with the same iterator (the
    uninterrupted run), or (``resume``) save ``state_dict()`` there and finish the epoch in a
    new loader of the same layout."""
    flags.mkdir()
    make = _failing(kind, flags)
    loader = DataLoader(make(), batch_size=3, num_workers=workers)
    it = iter(loader)
    out: list[list[float]] = []
    errors = 0
    while True:
        try:
            b = next(it)
        except StopIteration:
            break
        except (ValueError, OSError):
            errors += 1
            if not resume:
                continue
            state = load_state(dump_state(loader.state_dict()))
            del it, loader
            again = DataLoader(make(), batch_size=3, num_workers=workers)
            again.load_state_dict(state)
            out += [b.tolist() for b in again]
            break
        out.append(b.tolist())
    assert errors == 1
    return out


@pytest.mark.parametrize("kind", ["map", "read"])
def test_a_state_taken_after_a_dataset_error_resumes_as_the_loop_that_goes_on(
    kind: str, tmp_path: Path
) -> None:
    """guarantees.md: after an exception ``state_dict()`` describes exactly what the iterator
    delivered, and resuming it continues with the next batch. With 2 workers, the run resumed
    from the state taken at a map (or read) error loses the sample that raised (7002.5), which
    the loop that goes on delivers."""
    goes_on = _loop_through_one_error(kind, 2, tmp_path / "a", resume=False)
    resumed = _loop_through_one_error(kind, 2, tmp_path / "b", resume=True)
    assert resumed == goes_on


# ---- 2. damaged states: refused, never a traceback or a hang --------------------------------
class _Hang(Exception):
    pass


def _raise_hang(*_: Any) -> None:
    raise _Hang


def test_a_huge_partition_count_in_a_state_is_refused_at_once_on_another_layout() -> None:
    """``stream.partitions`` 10**9 in a state (the Stream alone refuses it at once: "exceeds
    the 16 shards") makes ``load_state_dict`` on another layout work O(partitions): 4.5 s for
    10**6, no answer for 10**9 in 20 s (stopped here after 3 s)."""
    _, state = _run(2, 3, stop=5)
    for w in state["workers"]:
        w["dataset_state"]["stream"]["partitions"] = 10**9
    loader = DataLoader(_make(), batch_size=3, num_workers=0)
    old = signal.signal(signal.SIGALRM, _raise_hang)
    signal.alarm(3)
    t0 = time.monotonic()
    try:
        with pytest.raises(CheckpointError, match="partitions"):
            loader.load_state_dict(state)
    except _Hang:
        pytest.fail("load_state_dict ran 3 s on a state claiming 10**9 partitions")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - t0 < 2


def _json(state: Any) -> Any:
    return json.loads(json.dumps(state))


def _set_offset(state: Any) -> Any:
    ds = state["workers"][0]["dataset_state"]
    ds[next(p for p in ds if p != "stream")][5] = -1  # 'offset'
    return state


_DAMAGE: dict[str, Callable[[Any], Any]] = {
    "offset--1": _set_offset,
    "key-foo": lambda s: s["workers"][0]["dataset_state"].__setitem__("foo", [0] * 7) or s,
    "partitions-16": lambda s: (
        s["workers"][0]["dataset_state"]["stream"].update(partitions=16) or s
    ),
}


@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_a_damaged_stream_state_is_refused_by_load_state_dict_on_the_same_layout(
    damage: str,
) -> None:
    """streams.md: a malformed state is one ``CheckpointError`` naming the field;
    guarantees.md: a refused state leaves the loader as it was. On the saving layout the
    workers' Stream states are not checked by ``load_state_dict``: it takes them (replacing
    the loader's position), and the first ``next()`` raises from worker 0 with its traceback
    in the message ("Original Traceback ... streams.py ... _parse_cursor"); a key 'foo' is
    taken without a word. On another layout the same states are refused at load."""
    _, good = _run(2, 3, stop=5)
    bad = _DAMAGE[damage](copy.deepcopy(good))
    loader = DataLoader(_make(), batch_size=3, num_workers=2)
    it = iter(loader)
    next(it)
    before = loader.state_dict()
    try:
        with pytest.raises(CheckpointError) as e:
            loader.load_state_dict(bad)
        assert "Traceback" not in str(e.value)
        assert loader.state_dict() == before
    finally:
        del it, loader


@contextlib.contextmanager
def _as_rank(monkeypatch: pytest.MonkeyPatch, world: int, rank: int) -> Iterator[None]:
    """torch.distributed's world as the Stream and the loader read it (as
    tests/behaviour/test_streams_elastic.py simulates ranks)."""
    with monkeypatch.context() as m:
        m.setattr(torch.distributed, "is_available", lambda: True)
        m.setattr(torch.distributed, "is_initialized", lambda: True)
        m.setattr(torch.distributed, "get_world_size", lambda *a, **k: world)
        m.setattr(torch.distributed, "get_rank", lambda *a, **k: rank)
        yield


def test_a_global_state_with_a_damaged_stream_cursor_is_refused_by_every_rank_at_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """distributed.md: a global state is refused by every rank or by none, so that no rank
    goes on into a collective that a refusing rank never reaches. Rank 1's entry has a cursor
    with offset -1: on the saving layout rank 0 loads it and trains, rank 1 loads it too and
    raises only at its first ``next()`` (from its worker) -- in a DDP job, rank 0 hangs."""
    states = []
    for r in range(2):
        with _as_rank(monkeypatch, 2, r):
            _, state = _run(2, 3, stop=2)
            states.append(state)
    _set_offset(states[1])
    bad = merge_rank_states(states)
    for r in range(2):
        with _as_rank(monkeypatch, 2, r):
            loader = DataLoader(_make(), batch_size=3, num_workers=2, stream_tail=None)
            with pytest.raises(CheckpointError, match="offset"):
                loader.load_state_dict(bad)
            del loader


@pytest.mark.parametrize("epoch", [1, 10**30])
@pytest.mark.parametrize("now", [(2, 3), (1, 3)], ids=["same-layout", "re-dealt"])
def test_a_worker_stream_state_in_another_epoch_than_the_loader_state_is_refused(
    epoch: int, now: tuple[int, int]
) -> None:
    """A loader state in epoch 0 whose worker 0's Stream header says ``epoch`` 1 (or 10**30;
    every state a run writes has the two equal) is taken, and epoch 0 then delivers up to 62
    samples twice."""
    head, state = _run(2, 3, stop=5)
    state["workers"][0]["dataset_state"]["stream"]["epoch"] = epoch
    _refused_or_exactly_once(head, state, *now)


def test_a_re_deal_refuses_a_worker_state_missing_one_of_its_partitions() -> None:
    """On the saving layout a worker state without one of its own partitions is refused
    ("partition 2 is owned by this reader but not in the state"); re-dealt to 1 worker, the
    partition is taken as not begun and its first rows (11000.5, 11001.5) come twice, though
    that worker had delivered 3 batches (so it had begun every partition it owns)."""
    head, state = _run(2, 3, stop=5)
    ds = state["workers"][0]["dataset_state"]
    del ds[2]
    _refused_or_exactly_once(head, state, 1, 3)


def test_workers_whose_stream_headers_disagree_on_the_seed_are_refused() -> None:
    """Each worker's Stream state carries the Stream's seed (which wins over the script's).
    Worker 1's header says seed 5, worker 0's 0: on the saving layout each worker deals
    the shards with its own seed, and epoch 0 loses some samples and repeats others. (A
    re-deal takes worker 0's header and ignores worker 1's.)"""
    head, state = _run(2, 3, stop=5)
    state["workers"][1]["dataset_state"]["stream"]["seed"] = 5
    _refused_or_exactly_once(head, state, 2, 3)


# ---- 3. plain data ----------------------------------------------------------------------------
def test_a_stream_loader_state_through_json_resumes_exactly() -> None:
    """``json.loads(json.dumps(loader.state_dict()))``: the partition keys come back as str;
    they were refused (at the first ``next()``, from a worker, on the saving layout)."""
    ref, _ = _run(2, 3)
    head, state = _run(2, 3, stop=5)
    rest, _ = _run(2, 3, state=_json(state))
    assert head + rest == ref


def test_changing_the_loaded_dict_afterwards_does_not_change_the_resume() -> None:
    """The caller reuses the dict it passed to ``load_state_dict`` (zeroes its cursors)
    before iterating: the loader shared those lists, so its resume changed (repeated rows)."""
    ref, _ = _run(0, 3)
    head, state = _run(0, 3, stop=4)
    loader = DataLoader(_make(), batch_size=3, num_workers=0)
    loader.load_state_dict(state)
    for w in state["workers"]:
        for p, cursor in w["dataset_state"].items():
            if p != "stream":
                cursor[:] = [0] * len(cursor)
    rest = [(0, b.tolist()) for b in loader]
    assert head + rest == ref


def _filtered() -> Stream:
    return (
        Stream.from_shards(list(range(SHARDS)), F.read, partitions=PARTITIONS)
        .filter(F.odd)
        .map(F.plus_half)
    )


@pytest.mark.parametrize("now", [(2, 3), (1, 3), (0, 3)], ids=["same-layout", "re-dealt", "w0"])
def test_a_state_of_another_pipeline_is_refused_by_load_state_dict(now: tuple[int, int]) -> None:
    """guarantees.md: a state taken under another configuration is refused with a
    ``CheckpointError``, and the loader is left as it was. A state saved with a
    ``.filter`` stage, loaded after the script dropped the filter, is taken by
    ``load_state_dict`` on every layout; the refusal ("the state was taken with another
    pipeline") comes at the first ``next()``, with 2 workers wrapped in a worker's traceback."""
    _, state = _run(2, 3, stop=5, make=_filtered)
    loader = DataLoader(_make(), batch_size=now[1], num_workers=now[0])
    before = loader.state_dict()
    try:
        with pytest.raises(CheckpointError, match="another pipeline") as e:
            loader.load_state_dict(state)
        assert "Traceback" not in str(e.value)
        assert loader.state_dict() == before
    finally:
        del loader


def test_looking_at_the_stream_does_not_change_the_loaders_state_num_workers_0() -> None:
    """guarantees.md: ``state_dict()`` describes exactly what the iterator delivered. With
    ``num_workers=0``, a user who peeks at the loader's Stream (``next(iter(stream))``, to log
    a sample) mid-epoch leaves the loop's batches as they were, but ``state_dict()`` now
    holds the peek's position: the resume repeats 8 samples of the epoch. (With workers the
    state is unchanged.)"""
    ref, _ = _run(0, 3)
    stream = _make()
    loader = DataLoader(stream, batch_size=3, num_workers=0)
    it = iter(loader)
    head = [(0, next(it).tolist()) for _ in range(3)]
    next(iter(stream))
    state = load_state(dump_state(loader.state_dict()))
    del it, loader
    rest, _ = _run(0, 3, state=state)
    assert head + rest == ref
