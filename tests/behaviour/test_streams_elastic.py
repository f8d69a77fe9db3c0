"""A ``Stream``'s state resumed on another layout (issue #33, stage 2, one rank): another
``num_workers`` and another batch size. Each resumed run is checked against the uninterrupted
run: every sample of each epoch exactly once, and each partition's rows in the same order
(only the interleave of partitions across readers, and the batches, may differ)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import _stream_shards as F
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

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
EPOCHS = 2
Run = list[tuple[int, list[float]]]


def _make() -> Stream:
    return Stream.from_shards(list(range(SHARDS)), F.read, partitions=PARTITIONS).map(F.plus_half)


def _run(workers: int, batch: int, state: Any = None, stop: int | None = None) -> tuple[Run, Any]:
    """Epochs 0..EPOCHS-1 from ``state`` (or the start); the state after ``stop`` batches."""
    # stream_tail=None: simulated ranks run one after the other, so they cannot agree on an
    # epoch's batches (the real ranks' agreement is tests/behaviour/test_streams_ranks.py).
    loader = DataLoader(_make(), batch_size=batch, num_workers=workers, stream_tail=None)
    start = 0
    if state is not None:
        loader.load_state_dict(state)
        start = state["epoch"]
    out: Run = []
    try:
        for epoch in range(start, EPOCHS):
            for b in loader:
                out.append((epoch, b.tolist()))
                if len(out) == stop:
                    return out, load_state(dump_state(loader.state_dict()))
    finally:
        del loader
    return out, None


def _partition_of(epoch: int) -> dict[int, int]:
    """Shard -> the partition that reads it in pass ``epoch``."""
    return {
        s: p for p, shards in enumerate(deal(0, epoch, SHARDS, PARTITIONS, True)) for s in shards
    }


def _per_partition(run: Run, epoch: int) -> dict[int, list[float]]:
    where = _partition_of(epoch)
    out: dict[int, list[float]] = {}
    for e, b in run:
        if e == epoch:
            for x in b:
                out.setdefault(where[int(x) // 1000], []).append(x)
    return out


def _check(run: Run, ref: Run) -> None:
    """Every sample of each epoch once, and each partition's rows in the reference's order."""
    for epoch in range(EPOCHS):
        got = sorted(x for e, b in run if e == epoch for x in b)
        assert got == [x + 0.5 for x in F.all_samples(list(range(SHARDS)))], epoch
        assert _per_partition(run, epoch) == _per_partition(ref, epoch), epoch


_REF: dict[tuple[int, int], Run] = {}


def _ref(workers: int, batch: int) -> Run:
    if (workers, batch) not in _REF:
        _REF[workers, batch] = _run(workers, batch)[0]
    return _REF[workers, batch]


def _resized(saved: tuple[int, int], now: tuple[int, int], k: int) -> Run:
    head, state = _run(*saved, stop=k)
    assert state is not None
    rest, _ = _run(*now, state=state)
    return head + rest


@pytest.mark.parametrize(
    ("saved", "now"),
    [((2, 3), (0, 3)), ((0, 3), (2, 3)), ((2, 3), (4, 5)), ((4, 2), (1, 7)), ((1, 4), (2, 1))],
)
def test_another_layout_delivers_every_sample_once_in_partition_order(
    saved: tuple[int, int], now: tuple[int, int]
) -> None:
    ref = _ref(*saved)
    n0 = sum(1 for e, _ in ref if e == 0)
    for k in (1, n0 // 2, n0, n0 + 1):
        _check(_resized(saved, now, k), ref)


@given(
    k=st.integers(1, 40),
    batch=st.integers(1, 6),
    now_batch=st.integers(1, 6),
)
@settings(max_examples=15, deadline=None)
def test_num_workers_0_any_batch_sizes(k: int, batch: int, now_batch: int) -> None:
    """In one process: a resume with another batch size (and a chain of two)."""
    ref = _ref(0, batch)
    k = min(k, len(ref))
    head, state = _run(0, batch, stop=k)
    mid, state2 = _run(0, now_batch, state=state, stop=2)
    if state2 is None:
        _check(head + mid, ref)
        return
    rest, _ = _run(0, batch, state=state2)
    _check(head + mid + rest, ref)


def test_a_layout_that_does_not_divide_the_partitions_is_refused_at_load() -> None:
    _, state = _run(2, 3, stop=2)
    loader = DataLoader(_make(), batch_size=3, num_workers=3)
    with pytest.raises(CheckpointError, match=r"8 partitions .* 3 readers do not divide"):
        loader.load_state_dict(state)


def test_a_re_dealt_state_saved_before_iterating_loads_again() -> None:
    ref = _ref(2, 3)
    head, state = _run(2, 3, stop=5)
    loader = DataLoader(_make(), batch_size=4, num_workers=1)
    loader.load_state_dict(state)
    again = load_state(dump_state(loader.state_dict()))
    del loader
    rest, _ = _run(4, 2, state=again)
    _check(head + rest, ref)


def test_a_worker_state_that_lags_its_deliveries_is_refused_on_another_layout() -> None:
    """Only a replay on the saving layout reaches such a position (an interrupted fetch)."""
    _, state = _run(2, 3, stop=4)
    w = state["workers"][0]
    w["state_at"] = w["delivered"] - 1
    loader = DataLoader(_make(), batch_size=3, num_workers=1)
    with pytest.raises(CheckpointError, match=r"workers\[0\]\.state_at: .* Resume on that layout"):
        loader.load_state_dict(state)


# ---- simulated ranks: torch.distributed's world as the Stream and the loader read it -------
@contextlib.contextmanager
def _as_rank(monkeypatch: pytest.MonkeyPatch, world: int, rank: int) -> Iterator[None]:
    with monkeypatch.context() as m:
        m.setattr(torch.distributed, "is_available", lambda: True)
        m.setattr(torch.distributed, "is_initialized", lambda: True)
        m.setattr(torch.distributed, "get_world_size", lambda *a, **k: world)
        m.setattr(torch.distributed, "get_rank", lambda *a, **k: rank)
        yield


def _job_epoch0(
    monkeypatch: pytest.MonkeyPatch,
    world: int,
    workers: int,
    batch: int,
    state: Any = None,
    stop: int | None = None,
) -> tuple[list[float], Any]:
    """Epoch 0 on ``world`` simulated ranks run one after the other: the samples they
    delivered, and (``stop``) the job's global state after each consumed ``stop`` batches (or
    its whole share)."""
    got: list[float] = []
    states = []
    ended = False
    for r in range(world):
        with _as_rank(monkeypatch, world, r):
            loader = DataLoader(_make(), batch_size=batch, num_workers=workers, stream_tail=None)
            if state is not None:
                loader.load_state_dict(state)
            for i, b in enumerate(loader, 1):
                got += b.tolist()
                if i == stop:
                    break
            states.append(load_state(dump_state(loader.state_dict())))
            ended = ended or states[-1]["epoch"] != 0
            del loader
    # A rank past its share is in the next epoch while the others are not: equal batches on
    # every rank (stage 3) is what keeps ranks in step; such a state is refused meanwhile.
    return got, None if ended and stop is not None else merge_rank_states(states)


@pytest.mark.parametrize(
    ("saved", "now"),
    [
        ((2, 1, 3), (1, 0, 4)),
        ((1, 2, 3), (4, 0, 2)),
        ((4, 0, 2), (2, 2, 5)),
        ((2, 2, 2), (8, 0, 1)),
    ],
)
def test_a_global_state_resumes_on_other_ranks_workers_and_batch_size(
    monkeypatch: pytest.MonkeyPatch, saved: tuple[int, int, int], now: tuple[int, int, int]
) -> None:
    ref = [(e, b) for e, b in _ref(0, 3) if e == 0]
    for stop in (1, 3):
        head, state = _job_epoch0(monkeypatch, *saved, stop=stop)
        rest, _ = _job_epoch0(monkeypatch, *now, state=state)
        run = [(0, head + rest)]
        assert sorted(head + rest) == [x + 0.5 for x in F.all_samples(list(range(SHARDS)))]
        assert _per_partition(run, 0) == _per_partition(ref, 0)


def test_a_ranks_own_state_on_another_world_size_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _as_rank(monkeypatch, 2, 0):
        _, state = _run(0, 3, stop=2)
    with _as_rank(monkeypatch, 4, 0):
        loader = DataLoader(_make(), batch_size=3)
        with pytest.raises(CheckpointError, match=r"config\.world_size: the checkpoint has 2"):
            loader.load_state_dict(state)


_LAYOUTS = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([0, 0, 1, 2]), st.integers(1, 5))


@given(
    chain=st.lists(st.tuples(_LAYOUTS, st.integers(1, 2)), min_size=1, max_size=3), last=_LAYOUTS
)
@settings(max_examples=6, deadline=None)
def test_chains_of_resizes_deliver_every_sample_once_in_partition_order(
    chain: list[tuple[tuple[int, int, int], int]], last: tuple[int, int, int]
) -> None:
    """Epoch 0 through resizes of ranks, workers and batch size, each after a few batches."""
    ref = [(e, b) for e, b in _ref(0, 3) if e == 0]
    got: list[float] = []
    state = None
    with pytest.MonkeyPatch.context() as mp:
        for layout, stop in chain:
            more, state = _job_epoch0(mp, *layout, state=state, stop=stop)
            assume(state is not None)
            got += more
        more, _ = _job_epoch0(mp, *last, state=state)
    got += more
    assert sorted(got) == [x + 0.5 for x in F.all_samples(list(range(SHARDS)))]
    assert _per_partition([(0, got)], 0) == _per_partition(ref, 0)


def test_readers_that_do_not_divide_the_partitions_are_refused_by_iter_in_the_main_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _as_rank(monkeypatch, 3, 0):
        loader = DataLoader(_make(), batch_size=3, num_workers=2, stream_tail=None)
        with pytest.raises(ValueError, match=r"3 ranks x 2 workers = 6 readers") as e:
            iter(loader)
    assert "Traceback" not in str(e.value)  # raised here, not re-raised from a worker


def test_a_cursor_of_no_partition_is_refused_when_re_dealt() -> None:
    _, state = _run(2, 3, stop=4)
    ds = state["workers"][0]["dataset_state"]
    ds[PARTITIONS + 3] = ds.pop(next(p for p in ds if p != "stream"))
    loader = DataLoader(_make(), batch_size=3, num_workers=1)
    with pytest.raises(
        CheckpointError, match=r"key 11 is (not|neither 'stream' nor) a partition in 0\.\.7"
    ):
        loader.load_state_dict(state)


# ---- random_map: the draws belong to the sample, not to the layout ----


def _noisy(x: int, rng: Any) -> tuple[int, float]:
    return x, float(rng.random())


def _make_random() -> Stream:
    return Stream.from_shards(list(range(SHARDS)), F.read, partitions=PARTITIONS).random_map(_noisy)


def _pairs(workers: int, batch: int, state: Any = None, stop: int | None = None) -> Any:
    loader = DataLoader(_make_random(), batch_size=batch, num_workers=workers)
    if state is not None:
        loader.load_state_dict(state)
    out: list[tuple[int, float]] = []
    for ids, vals in loader:
        out += zip(ids.tolist(), vals.tolist())
        if stop is not None and len(out) >= stop:
            return out, load_state(dump_state(loader.state_dict()))
    return out, None


def test_random_map_draws_the_same_per_sample_on_another_layout_and_leaves_global_rngs() -> None:
    """A random augmentation in a Stream: resumed on another num_workers and batch size, each
    sample gets the value the uninterrupted run gave it (its generator is keyed by the
    sample's place in its partition), and the trainer's global RNG is not touched."""
    torch.manual_seed(5)
    control = torch.rand(3)
    torch.manual_seed(5)
    alone = list(_make_random())  # as torch's DataLoader with num_workers=0 drives it
    assert torch.equal(torch.rand(3), control)
    ref, _ = _pairs(0, 4)
    assert sorted(ref) == sorted(alone)
    assert len({v for _, v in ref}) == len(ref)  # real draws, not a constant
    head, state = _pairs(2, 3, stop=10)
    torch.manual_seed(99)  # a restarted process whose RNGs moved
    rest, _ = _pairs(4, 5, state=state)
    assert sorted(head + rest) == sorted(ref)


@pytest.mark.parametrize("now", [(2, 3), (0, 5)])
def test_a_loader_state_through_json_resumes_on_the_same_and_another_layout(
    now: tuple[int, int],
) -> None:
    """json writes the partition keys of each worker's Stream state as strings; found by
    fuzz/test_fuzz_stream.py: such a state was refused ("key '0' is neither 'stream' nor a
    partition")."""
    import json

    ref = _ref(2, 3)
    head, state = _run(2, 3, stop=3)
    rest, _ = _run(*now, state=json.loads(json.dumps(state)))
    _check(head + rest, ref)


def _nothing(shard: int, start: int) -> Iterator[int]:
    return iter(())


def test_a_state_of_empty_partitions_resumes_on_another_num_workers_and_back() -> None:
    """Found by fuzz/test_fuzz_stream.py: no worker had read a row, so no Stream state was in
    the loader state, and the re-deal kept the saving layout's worker entries; the state the
    resumed loader then wrote was refused ("workers: expected 2 worker entries, got [...]")."""

    def make(workers: int) -> DataLoader:
        s = Stream.from_shards([0, 1], _nothing, partitions=2)
        return DataLoader(s, batch_size=1, num_workers=workers)

    state = None
    for workers in (0, 2, 0, 1, 2):
        loader = make(workers)
        if state is not None:
            loader.load_state_dict(state)
            # Saved again before iterating (a job preempted right after its resume): the
            # state must describe this loader's layout.
            loader.load_state_dict(loader.state_dict())
        assert list(loader) == []
        assert list(loader) == []  # the next epoch too
        state = loader.state_dict()
