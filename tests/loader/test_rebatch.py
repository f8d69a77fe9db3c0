"""Another batch size (and world size) at a resume: the position is a sample cursor.

Every test compares against an uninterrupted reference run: the epoch's order of samples and
each sample's values (``seed_per_sample=True``) are read from a loader that was never stopped,
and the samples before and after the resume must be that order, each exactly once.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch
from _datasets import (
    CursorSampler,
    EveryOtherReversedSampler,
    RandomAugDataset,
    RangeDataset,
    ShardedStream,
    Tagged,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data.distributed import DistributedSampler

from resumable_loader import CheckpointError, DataLoader, Mixture, merge_rank_states

FAST = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _samples(batch: Any) -> list[tuple[int, float, float, float]]:
    """A collated batch of ``RandomAugDataset`` items (or one item) as (index, draws...)."""
    if isinstance(batch["idx"], int):
        return [(batch["idx"], batch["py"], batch["np"], float(batch["torch"][0]))]
    return [
        (int(i), float(p), float(n), float(t[0]))
        for i, p, n, t in zip(batch["idx"], batch["py"], batch["np"], batch["torch"])
    ]


def _loader(n: int, b: int | None, shuffle: bool, drop_last: bool, seed: int) -> DataLoader:
    return DataLoader(
        RandomAugDataset(n),
        batch_size=b,
        shuffle=shuffle,
        drop_last=drop_last and b is not None,  # torch refuses it without batching
        generator=_gen(seed),
        seed_per_sample=True,
    )


def _cut(rest: list[Any], b: int | None, drop_last: bool) -> list[list[Any]]:
    """``rest`` as a loader cuts it into batches (the reference's batching, by hand)."""
    per = b or 1
    out = [rest[i : i + per] for i in range(0, len(rest), per)]
    if drop_last and b is not None and out and len(out[-1]) < per:
        out.pop()
    return out


@FAST
@given(
    n=st.integers(1, 23),
    sizes=st.lists(st.sampled_from([None, 1, 2, 3, 5, 8]), min_size=3, max_size=3),
    stops=st.lists(st.integers(0, 12), min_size=2, max_size=2),
    ahead_bits=st.integers(0, 15),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
)
def test_resume_with_other_batch_sizes_continues_the_sample_stream(
    n: int,
    sizes: list[int | None],
    stops: list[int],
    ahead_bits: int,
    drop_last: bool,
    shuffle: bool,
) -> None:
    """Saved with batch size b after k batches (and some batches delivered ahead, as with
    in_order=False), resumed with b', saved again after k' batches, resumed with b'': the
    samples delivered in all are the uninterrupted epoch's, each once, in its order, with
    its values; only the epoch's last partial batch is dropped (drop_last), by the last cut."""
    if drop_last:  # it must match at a resume, and torch refuses it without batching
        sizes = [size or 4 for size in sizes]
    # The reference: the epoch's order and each sample's values, never interrupted.
    ref_loader = _loader(n, None, shuffle, False, seed=7)
    order = [s for item in ref_loader for s in _samples(item)]
    rest = list(order)  # what is still to come, in order
    delivered: list[Any] = []

    # Hop 1: batch size b, k batches consumed, some later batches delivered ahead.
    b = sizes[0]
    first = _loader(n, b, shuffle, drop_last, seed=7)
    it = iter(first)
    batches = _cut(rest, b, drop_last)
    k = min(stops[0], len(batches))
    for want in batches[:k]:
        assert _samples(next(it)) == want
    ahead = [t for t in range(k + 1, len(batches)) if ahead_bits >> (t - k - 1) & 1]
    state = first.state_dict()
    if ahead and state["epoch"] == 0:
        state["delivered_ahead"] = ahead  # as in_order=False leaves it
    else:
        ahead = []
    taken = [s for t in [*range(k), *ahead] for s in batches[t]]
    if k == len(batches) and not ahead:
        taken = list(rest)  # the epoch was delivered to its end: the next epoch is next
    delivered += taken
    rest = [s for s in rest if s not in taken]
    state = json.loads(json.dumps(state))  # plain data

    # Hop 2: batch size b', another generator (the state's seed chain wins), k' batches.
    second = _loader(n, sizes[1], shuffle, drop_last, seed=99)
    second.load_state_dict(state)
    it = iter(second)
    batches = _cut(rest, sizes[1], drop_last)
    k2 = min(stops[1], len(batches))
    for want in batches[:k2]:
        assert _samples(next(it)) == want
    state = second.state_dict()
    taken = [s for batch in batches[:k2] for s in batch]
    if k2 == len(batches):
        taken = list(rest)
    delivered += taken
    rest = [s for s in rest if s not in taken]

    # Hop 3: batch size b'' to the epoch's end, then a whole next epoch.
    third = _loader(n, sizes[2], shuffle, drop_last, seed=5)
    third.load_state_dict(state)
    got = [s for item in third for s in _samples(item)]
    if state["epoch"] == 0:
        assert got == [s for batch in _cut(rest, sizes[2], drop_last) for s in batch]
        delivered += got
        # Each sample of the epoch once at most; all of them but a dropped tail.
        assert len({s[0] for s in delivered}) == len(delivered)
        assert set(delivered) <= set(order)
        missing = len(order) - len(delivered)
        assert missing < (sizes[2] or 1) if drop_last else missing == 0
        next_epoch = [s for item in third for s in _samples(item)]
    else:
        next_epoch = got
    # The next epoch is cut with b'' from its start, as the uninterrupted run cuts it.
    ref = _loader(n, sizes[2], shuffle, drop_last, seed=7)
    list(ref)
    assert next_epoch == [s for item in ref for s in _samples(item)]


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_state_resaved_before_iterating_keeps_the_cut(shuffle: bool) -> None:
    """load_state_dict() then state_dict() (a checkpoint before the first batch) holds the
    re-cut position, and loads again with a third batch size."""
    ref = [s for item in _loader(20, 1, shuffle, False, 3) for s in _samples(item)]
    first = _loader(20, 4, shuffle, False, 3)
    it = iter(first)
    before = _samples(next(it)) + _samples(next(it))
    second = _loader(20, 3, shuffle, False, 3)
    second.load_state_dict(first.state_dict())
    third = _loader(20, 6, shuffle, False, 3)
    third.load_state_dict(second.state_dict())
    assert before + [s for item in third for s in _samples(item)] == ref


def test_workers_resume_with_another_batch_size() -> None:
    """The re-cut reaches worker processes too (the tasks are cut in the main process)."""
    ref = [s for item in _loader(30, 1, True, False, 2) for s in _samples(item)]
    first = _loader(30, 4, True, False, 2)
    it = iter(first)
    before = [s for _ in range(3) for s in _samples(next(it))]
    state = first.state_dict()
    del it
    second = DataLoader(
        RandomAugDataset(30), batch_size=7, shuffle=True, num_workers=2, seed_per_sample=True
    )
    second.load_state_dict(state)
    with second:
        assert before + [s for item in second for s in _samples(item)] == ref


def test_a_version_3_state_is_upgraded() -> None:
    loader = _loader(10, 2, True, False, 1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    state["version"] = 3
    del state["skipped_samples"]
    rest = [s for item in it for s in _samples(item)]
    again = _loader(10, 2, True, False, 1)
    again.load_state_dict(state)
    assert again.state_dict()["version"] == 4
    assert [s for item in again for s in _samples(item)] == rest


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda b: {"sampler": EveryOtherReversedSampler(16), "batch_size": b}, "re-cut"),
        (lambda b: {"sampler": CursorSampler(16), "batch_size": b}, "its own state_dict"),
    ],
    ids=["fast-forwarded-sampler", "stateful-sampler"],
)
def test_samplers_that_cannot_be_recut_refuse_another_batch_size(make: Any, match: str) -> None:
    first = DataLoader(RangeDataset(16), **make(4))
    it = iter(first)
    next(it)
    state = first.state_dict()
    second = DataLoader(RangeDataset(16), **make(2))
    before = second.state_dict()
    with pytest.raises(CheckpointError, match=match) as info:
        second.load_state_dict(state)
    assert "batch_size=4" in str(info.value)
    assert second.state_dict() == before  # left as it was
    second.load_state_dict(DataLoader(RangeDataset(16), **make(2)).state_dict())


def test_a_stream_refuses_another_batch_size() -> None:
    first = DataLoader(ShardedStream(8), batch_size=2)
    with pytest.raises(CheckpointError, match=r"config\.batch_size"):
        DataLoader(ShardedStream(8), batch_size=4).load_state_dict(first.state_dict())


def test_one_ranks_state_refuses_another_batch_size_under_a_distributed_sampler() -> None:
    ds = RangeDataset(16)
    first = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, 2, 0, shuffle=False))
    next(iter(first))
    second = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 2, 0, shuffle=False))
    with pytest.raises(CheckpointError, match="global state"):
        second.load_state_dict(first.state_dict())


@pytest.mark.parametrize(
    "cut",
    [{"start": 11}, {"start": 2, "holes": [[1, 1]]}, {"start": 2, "holes": [[5, 9]]}, [1, 2]],
)
def test_a_damaged_sample_cut_is_refused(cut: Any) -> None:
    loader = _loader(10, 2, False, False, 1)
    state = dict(loader.state_dict(), sample_cut=cut)
    if isinstance(cut, dict):
        cut.setdefault("holes", [])
    with pytest.raises(CheckpointError, match="sample_cut"):
        _loader(10, 2, False, False, 1).load_state_dict(state)


def _ranks(
    ds: Any, world: int, b: int, seed: int, drop_last: bool = False, tail: bool = False
) -> list[DataLoader]:
    return [
        DataLoader(
            ds,
            batch_size=b,
            drop_last=drop_last,
            sampler=DistributedSampler(ds, world, r, shuffle=True, seed=seed, drop_last=tail),
            seed_per_sample=True,
        )
        for r in range(world)
    ]


@FAST
@given(
    n=st.integers(1, 30),
    world=st.integers(1, 3),
    world2=st.integers(1, 4),
    b=st.integers(1, 4),
    b2=st.integers(1, 5),
    k=st.integers(0, 6),
    drop_last=st.booleans(),
    tail=st.booleans(),
)
def test_distributed_resume_with_another_batch_and_world_size(
    n: int, world: int, world2: int, b: int, b2: int, k: int, drop_last: bool, tail: bool
) -> None:
    """W ranks with batch b consume k steps; the job's global state resumes on W' ranks with
    batch b': every sample of the epoch comes at most once, with the uninterrupted run's
    values, apart from the repeats torch's padding adds (fewer than W + W'); none is missing
    but the tails torch drops (DistributedSampler(drop_last): fewer than W, then W'; the
    loader's drop_last: fewer than b' per new rank)."""
    ds = RandomAugDataset(n)
    values = {s[0]: s for item in _ranks(ds, 1, 1, 3)[0] for s in _samples(item)}
    loaders = _ranks(ds, world, b, 3, drop_last, tail)
    its = [iter(x) for x in loaders]
    before = []
    steps = min(k, min(len(x) for x in loaders) - 1)
    for _ in range(max(0, steps)):
        for it in its:
            before += _samples(next(it))
    state = merge_rank_states([x.state_dict() for x in loaders])
    after = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # torch's padding, announced
        for loader in _ranks(ds, world2, b2, 3, drop_last, tail):
            loader.load_state_dict(state)
            after += [s for item in loader for s in _samples(item)]
    got = before + after
    assert all(values[s[0]] == s for s in got)
    ids = {s[0] for s in got}
    assert len(got) - len(ids) < (1 if tail else world + world2)  # torch pads without tail
    dropped = (world - 1 + world2 - 1 if tail else 0) + (world2 * (b2 - 1) if drop_last else 0)
    assert n - len(ids) <= dropped


def test_a_mixture_resumed_with_another_batch_size_and_weights() -> None:
    """shuffle=False over a Mixture: 2 batches of 4 consumed, resumed with batches of 3 and new
    weights, which apply from position 8 -- the first one not consumed."""

    def mix(weights: dict[str, int]) -> Mixture:
        return Mixture({"a": Tagged("a", 11), "b": Tagged("b", 7)}, weights, seed=1)

    first = DataLoader(mix({"a": 1, "b": 1}), batch_size=4)
    it = iter(first)
    before = next(it) + next(it)
    second = DataLoader(mix({"a": 5, "b": 1}), batch_size=3)
    second.load_state_dict(first.state_dict())
    after = [v for batch in second for v in batch]
    ref = mix({"a": 1, "b": 1})
    ref.set_weights({"a": 5, "b": 1}, from_position=8)
    assert before + after == [ref[p] for p in range(18)]
    assert before == [mix({"a": 1, "b": 1})[p] for p in range(8)]


def test_a_mixture_under_a_distributed_sampler_recuts_with_its_plan() -> None:
    """The global state's re-cut carries the Mixture's plan (it was dropped: 'data_plan:
    missing'), so a Mixture job resumes on another world size and batch size."""

    def mix() -> Mixture:
        # 16 positions: 2 ranks take 4, and 3 ranks share the 12 left without padding.
        sources = {"a": Tagged("a", 11), "b": Tagged("b", 7)}
        return Mixture(sources, {"a": 2, "b": 1}, seed=4, num_samples=16)

    def ranks(world: int, b: int) -> list[DataLoader]:
        m = mix()
        return [
            DataLoader(m, batch_size=b, sampler=DistributedSampler(m, world, r, shuffle=True))
            for r in range(world)
        ]

    job = ranks(2, 2)
    its = [iter(x) for x in job]
    before = [v for it in its for v in next(it)]
    state = merge_rank_states([x.state_dict() for x in job])
    after = []
    for loader in ranks(3, 3):
        loader.load_state_dict(state)
        after += [v for batch in loader for v in batch]
    ref = mix()
    assert sorted(before + after) == sorted(ref[p] for p in range(16))


# ---- a user batch_sampler (review of #24, E1) ----------------------------------------------


def _user_batches(ds: Any, size: int, sampler: Any = None) -> DataLoader:
    inner = torch.utils.data.SequentialSampler(ds) if sampler is None else sampler
    return DataLoader(ds, batch_sampler=torch.utils.data.BatchSampler(inner, size, False))


def _idx(loader: DataLoader) -> list[list[int]]:
    return [batch["idx"].tolist() for batch in loader]


def test_a_user_batch_sampler_resumes_exactly_and_refuses_another_batching() -> None:
    """Its batches' size is the batch sampler's own (torch sets batch_size=None): its state
    counts those batches. The same batching resumes at the next one; any other is refused
    (before the fix, each read "2 batches" as 2 samples, or as 2 batches of the new size)."""
    ds = RangeDataset(24)
    first = _user_batches(ds, 4)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    same = _user_batches(ds, 4)
    same.load_state_dict(state)
    assert _idx(same) == [list(range(a, a + 4)) for a in range(8, 24, 4)]
    for other in (DataLoader(ds, batch_size=4), _user_batches(ds, 8)):
        before = other.state_dict()
        with pytest.raises(CheckpointError, match="batch_sampler") as info:
            other.load_state_dict(state)
        assert "batch_size=4, drop_last=False" in str(info.value)
        assert other.state_dict() == before  # left as it was
    # ... and the other way round: a batch_size=4 position is not cut by a batch sampler.
    plain = DataLoader(ds, batch_size=4)
    next(iter(plain))
    with pytest.raises(CheckpointError, match="batch_sampler"):
        _user_batches(ds, 4).load_state_dict(plain.state_dict())


def test_a_user_batch_sampler_job_refuses_a_recut() -> None:
    """A BatchSampler over a DistributedSampler on 2 ranks, its global state loaded by a loader
    with batch_size=4 or on 3 ranks: refused (before the fix: samples re-delivered)."""
    ds = RangeDataset(24)
    ranks = [_user_batches(ds, 4, DistributedSampler(ds, 2, r, shuffle=False)) for r in range(2)]
    for loader in ranks:
        next(iter(loader))
    state = merge_rank_states([x.state_dict() for x in ranks])
    again = [
        DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 2, 0, shuffle=False)),
        _user_batches(ds, 4, DistributedSampler(ds, 3, 0, shuffle=False)),
    ]
    for loader in again:
        with pytest.raises(CheckpointError, match="batch_sampler"):
            loader.load_state_dict(state)
    same = _user_batches(ds, 4, DistributedSampler(ds, 2, 1, shuffle=False))
    same.load_state_dict(state)
    assert _idx(same) == [[9, 11, 13, 15], [17, 19, 21, 23]]


# ---- a damaged cut with another batch size (review of #24, V1) -----------------------------


@pytest.mark.parametrize(
    "holes, start",
    [([], 10**12), ([[30, 100]], 10), ([[5, 10**15]], 2)],
    ids=["start-past-the-end", "hole-past-the-end", "huge-hole"],
)
def test_a_damaged_sample_cut_is_refused_by_another_batch_size(holes: Any, start: int) -> None:
    """Before the fix, the re-cut clamped what was left to 0 and delivered nothing."""
    loader = _loader(24, 4, False, False, 1)
    state = dict(loader.state_dict(), sample_cut={"start": start, "holes": holes})
    other = _loader(24, 3, False, False, 1)
    with pytest.raises(CheckpointError, match="sample_cut"):
        other.load_state_dict(state)


def test_drop_last_bounds_the_batches_a_recut_state_may_have_consumed() -> None:
    """10 samples, batch 4, drop_last: 2 batches make the epoch; a state saying 3 were consumed
    is damaged (before the fix, the check counted the partial batch torch drops)."""
    loader = _loader(10, 4, False, True, 1)
    next(iter(loader))
    state = dict(loader.state_dict(), consumed=3)
    with pytest.raises(CheckpointError, match="consumed"):
        _loader(10, 2, False, True, 1).load_state_dict(state)


# ---- the cursor with many holes (review of #24, V2) ----------------------------------------


@FAST
@given(
    n=st.integers(1, 60),
    raw=st.lists(st.tuples(st.integers(1, 59), st.integers(1, 4)), max_size=6),
    per=st.integers(1, 5),
    consumed=st.integers(0, 12),
    ahead=st.sets(st.integers(0, 14), max_size=5),
    drop_last=st.booleans(),
)
def test_the_cursor_advances_as_the_positions_it_names(
    n: int,
    raw: list[tuple[int, int]],
    per: int,
    consumed: int,
    ahead: set[int],
    drop_last: bool,
) -> None:
    """Cut.advance against the rest of the epoch as a plain list: consumed batches and those
    ahead leave it, the rest stays in order (or a ValueError for a batch past the end)."""
    from resumable_loader.state.cursor import _normal

    cut = _normal(0, [(f, c) for f, c in raw if f + c <= n], n)  # holes inside the epoch
    rest = [p for p in range(cut.start, n) if not any(f <= p < f + c for f, c in cut.holes)]
    assert cut.positions(0, len(rest)).tolist() == rest
    batches = _cut(rest, per, drop_last)
    ahead = {t for t in ahead if t > consumed}
    if consumed > len(batches) or any(t >= len(batches) for t in ahead):
        with pytest.raises(ValueError):
            cut.advance(n, per, consumed, ahead, drop_last)
        return
    gone = {p for t in [*range(consumed), *ahead] for p in batches[t]}
    new = cut.advance(n, per, consumed, ahead, drop_last)
    assert new.positions(0, new.left(n)).tolist() == [p for p in rest if p not in gone]


def test_a_cut_with_too_many_holes_is_refused() -> None:
    from resumable_loader.state.cursor import MAX_HOLES

    holes = [[2 * i + 1, 1] for i in range(MAX_HOLES + 1)]
    loader = _loader(24, 4, False, False, 1)
    state = dict(loader.state_dict(), sample_cut={"start": 0, "holes": holes})
    with pytest.raises(CheckpointError, match=f"more than the {MAX_HOLES}"):
        _loader(24, 4, False, False, 1).load_state_dict(state)
