"""A ``Stream``'s partition plan (``plans/streams.py``) and the Stream alone, without a loader
(``plans/stream.py``): the deal, the layouts, the canonical order, the state's validation, and
an exact resume at every position of a small stream -- through a plain ``iter()``, as torch's
loader with ``num_workers=0`` drives it."""

from __future__ import annotations

import copy
import json
import pickle
from collections import Counter
from typing import Any

import _stream_shards as F
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_loader import CheckpointError, Stream
from resumable_loader.plans import streams as S

# ---- the plan ----


@pytest.mark.parametrize(
    ("n", "expected"),
    [(1, 1), (7, 1), (16, 2), (24, 3), (64, 8), (1000, 96), (4096, 512), (10**6, 4096)],
)
def test_default_partitions_are_powers_of_two_or_three_times_one(n: int, expected: int) -> None:
    assert S.default_partitions(n) == expected


@given(
    n=st.integers(1, 200),
    data=st.data(),
    seed=st.integers(-(2**40), 2**40),
    epoch=st.integers(0, 5),
    shuffle=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_deal_is_a_partition_of_the_shards_and_deal_one_agrees(
    n: int, data: Any, seed: int, epoch: int, shuffle: bool
) -> None:
    p = data.draw(st.integers(1, n))
    parts = S.deal(seed, epoch, n, p, shuffle)
    assert sorted(i for part in parts for i in part) == list(range(n))
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1
    assert parts == S.deal(seed, epoch, n, p, shuffle)  # a pure function
    for q in range(p):
        assert S.deal_one(seed, epoch, n, p, shuffle, q) == parts[q]


def test_deal_changes_with_the_pass_and_the_seed_when_shuffled() -> None:
    a = S.deal(0, 0, 64, 8, True)
    assert a != S.deal(0, 1, 64, 8, True)
    assert a != S.deal(1, 0, 64, 8, True)
    assert S.deal(0, 0, 64, 8, False) == S.deal(5, 3, 64, 8, False)


@pytest.mark.parametrize("p", [1, 6, 12, 48])
def test_owned_partitions_cover_every_partition_once_on_every_valid_layout(p: int) -> None:
    for world in S.valid_readers(p):
        for k in S.valid_readers(p // world):
            seen = Counter(
                q for r in range(world) for w in range(k) for q in S.owned(p, world, r, k, w)
            )
            assert seen == Counter(range(p))
            S.check_layout(p, world, k)  # valid: no error


def test_an_invalid_layout_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError) as e:
        S.check_layout(48, 5, 4)
    msg = str(e.value)
    assert "48 partitions" in msg and "5 ranks x 4 workers = 20 readers" in msg
    assert "1, 2, 3, 4, 6, 8, 12, 16, 24, 48" in msg
    with pytest.raises(ValueError, match=r"with 4 ranks: num_workers in 1, 2, 3, 4, 6, 12"):
        S.check_layout(48, 4, 5)


def test_canonical_order_is_row_then_partition_and_drops_finished_ones() -> None:
    assert S.canonical_order({0: 2, 1: 3, 2: 1}) == [0, 1, 2, 0, 1, 1]
    assert S.canonical_order({0: 2, 1: 3, 2: 1}, {0: 2, 1: 1}) == [2, 1, 1]


# ---- the Stream alone ----


def _stream(shards: int = 12, partitions: int | None = 4, **kw: Any) -> Stream:
    return Stream.from_shards(list(range(shards)), F.read, partitions=partitions, **kw)


def test_a_pass_is_every_sample_once_in_canonical_order() -> None:
    s = _stream()
    out = list(s)
    assert sorted(out) == F.all_samples(list(range(12)))
    # Each partition's rows are its shards in deal order; the stream interleaves them.
    deal = S.deal(0, 0, 12, 4, True)
    per_part = {
        p: [F.sample(sh, i) for sh in deal[p] for i in range(F.shard_len(sh))] for p in range(4)
    }
    order = S.canonical_order({p: len(v) for p, v in per_part.items()})
    taken = Counter[int]()
    expected = []
    for p in order:
        expected.append(per_part[p][taken[p]])
        taken[p] += 1
    assert out == expected


def test_each_pass_has_its_own_shard_order() -> None:
    s = _stream()
    first = list(s)
    s.set_epoch(1)
    second = list(s)
    assert sorted(first) == sorted(second) and first != second
    s.set_epoch(0)
    assert list(s) == first


def _cut_and_resume(make: Any, k: int, via: str = "plain") -> tuple[list[Any], list[Any]]:
    ref = list(make())
    s = make()
    it = iter(s)
    head = [next(it) for _ in range(k)]
    state = s.state_dict()
    if via == "json":
        # As a user's json checkpoint does it: int keys come back as strings.
        state = json.loads(json.dumps(state))
    elif via == "pickle":
        state = pickle.loads(pickle.dumps(state))
    t = make()
    t.load_state_dict(copy.deepcopy(state))
    return ref, head + list(t)


@given(
    k=st.integers(0, 45), partitions=st.sampled_from([1, 2, 3, 4, 6, 12]), seed=st.integers(0, 9)
)
@settings(max_examples=80, deadline=None)
def test_a_resume_at_any_position_continues_exactly(k: int, partitions: int, seed: int) -> None:
    def make() -> Stream:
        return _stream(partitions=partitions, seed=seed).filter(F.odd).map(F.plus_half)

    ref, got = _cut_and_resume(make, min(k, 20))
    assert got == ref


@pytest.mark.parametrize("via", ["json", "pickle"])
def test_the_state_is_plain_data(via: str) -> None:
    ref, got = _cut_and_resume(_stream, 17, via)
    assert got == ref


def test_the_state_holds_one_short_cursor_per_partition_and_no_samples() -> None:
    s = _stream(shards=40, partitions=8)
    it = iter(s)
    for _ in range(30):
        next(it)
    state = s.state_dict()
    assert sorted(k for k in state if k != "stream") == list(range(8))
    assert all(len(state[p]) == len(S.CURSOR_FIELDS) for p in range(8))
    assert sum(state[p][S.ROWS] for p in range(8)) == 30
    flat = json.dumps({str(k): v for k, v in state.items()})
    assert len(flat) < 1200


def test_a_filter_position_counts_input_samples_so_a_resume_never_rereads_a_dropped_one(
    tmp_path: Any,
) -> None:
    log = str(tmp_path / "reads")
    shards = list(range(12))

    def make() -> Stream:
        return Stream.from_shards(shards, F.Counted(log), partitions=4).filter(F.odd)

    s = make()
    it = iter(s)
    head = [next(it) for _ in range(9)]
    state = s.state_dict()
    before = F.reads(log)
    t = make()
    t.load_state_dict(state)
    rest = list(t)
    after = F.reads(log)[len(before) :]
    assert sorted(head + rest) == [x for x in F.all_samples(shards) if x % 2]
    # The resumed run read only what the first did not: no sample twice, no dropped one again.
    assert sorted(before + after) == sorted(
        (s_, i) for s_ in shards for i in range(F.shard_len(s_))
    )
    assert t.read_stats()["seeks"] >= 1 and t.read_stats()["skipped"] == 0


def test_a_reader_without_start_is_skipped_into_counted_and_warned_once() -> None:
    shards = list(range(12))

    def make() -> Stream:
        return Stream.from_shards(shards, F.read_from_zero, partitions=4)

    s = make()
    it = iter(s)
    head = [next(it) for _ in range(10)]
    state = s.state_dict()
    offsets = sum(state[p][S.OFFSET] for p in range(4))
    t = make()
    t.load_state_dict(state)
    with pytest.warns(RuntimeWarning, match="reads and discards"):
        rest = list(t)
    assert head + rest == list(make())
    assert t.read_stats()["skipped"] == offsets > 0
    assert t.read_stats()["seeks"] == 0


def test_a_read_error_reopens_the_shard_at_its_cursor() -> None:
    calls = {"n": 0}

    def flaky(s: int, start: int) -> Any:
        for i in range(start, F.shard_len(s)):
            calls["n"] += 1
            if calls["n"] in (5, 11):
                raise OSError("transient")
            yield F.sample(s, i)

    s = Stream.from_shards(list(range(12)), flaky, partitions=4).map(F.plus_half)
    out = []
    it = iter(s)
    while True:
        try:
            out.append(next(it))
        except OSError:
            continue
        except StopIteration:
            break
    assert out == list(_stream().map(F.plus_half))


def test_a_map_error_does_not_lose_its_sample() -> None:
    fails = {7}

    def fragile(x: int) -> int:
        if x in fails:
            fails.discard(x)
            raise ValueError("once")
        return x

    s = _stream().map(fragile)
    ref = list(_stream())
    fails.add(ref[5])
    out: list[int] = []
    it = iter(s)
    while True:
        try:
            out.append(next(it))
        except ValueError:
            continue
        except StopIteration:
            break
    assert out == ref


def test_an_iterator_loaded_after_iter_continues_from_the_state() -> None:
    """torchdata's order: iter() first, then load_state_dict into the live iterator."""
    ref = list(_stream())
    s = _stream()
    it = iter(s)
    for _ in range(8):
        next(it)
    state = s.state_dict()
    t = _stream()
    it2 = iter(t)
    t.load_state_dict(state)
    assert list(it2) == ref[8:]


def test_a_state_loaded_after_an_abandoned_iteration_is_where_the_next_iter_starts() -> None:
    ref = list(_stream())
    s = _stream()
    it = iter(s)
    for _ in range(8):
        next(it)
    state = s.state_dict()
    for _ in range(5):
        next(it)  # the run goes on, then is rewound to the state
    s.load_state_dict(state)
    assert list(s) == ref[8:]


def test_partitions_none_adopts_the_state_and_the_seed_of_the_state_wins() -> None:
    s = Stream.from_shards(list(range(12)), F.read, partitions=6, seed=3)
    it = iter(s)
    head = [next(it) for _ in range(5)]
    t = Stream.from_shards(list(range(12)), F.read, seed=99)
    assert t.partitions == 1
    t.load_state_dict(s.state_dict())
    assert t.partitions == 6
    assert head + list(t) == list(Stream.from_shards(list(range(12)), F.read, partitions=6, seed=3))


def _state() -> dict[Any, Any]:
    s = _stream()
    it = iter(s)
    for _ in range(6):
        next(it)
    return s.state_dict()


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda st: st.pop("stream"), r"stream is missing"),
        (lambda st: st["stream"].update(kind="x"), r"stream.kind"),
        (lambda st: st["stream"].update(version=9), r"stream.version"),
        (lambda st: st["stream"]["shards"].update(count=13), r"stream.shards.count"),
        (lambda st: st["stream"]["shards"].update(digest="sha256:0"), r"shard list changed"),
        (lambda st: st["stream"].update(fields=["a"]), r"stream.fields"),
        (lambda st: st["stream"].update(seed="0"), r"stream.seed"),
        (lambda st: st.update({7: [0] * 7}), r"key 7 is neither"),
        (lambda st: st.update({0: [0, 0, 1]}), r"partition 0 must be a list of 7"),
        (lambda st: st[1].__setitem__(S.OFFSET, -1), r"partition 1 field 'offset'"),
        (lambda st: st[1].__setitem__(S.DONE, 2), r"'done' must be 0 or 1"),
        (lambda st: st[1].__setitem__(S.PASS, 4), r"after stream.epoch"),
        (lambda st: st[2].__setitem__(S.SHARD_I, 9), r"'shard_i' is 9"),
        (lambda st: st[2].__setitem__(S.OFFSET, 99), r"'offset' is 99, more than"),
    ],
)
def test_a_malformed_state_is_refused_naming_the_field(mutate: Any, match: str) -> None:
    st_ = _state()
    mutate(st_)
    with pytest.raises(CheckpointError, match=match):
        _stream().load_state_dict(st_)


def test_an_explicit_other_partition_count_is_refused() -> None:
    with pytest.raises(CheckpointError, match=r"partitions=6; partitions are fixed"):
        _stream(partitions=6).load_state_dict(_state())


def test_a_state_missing_an_owned_partition_is_refused_at_iter() -> None:
    st_ = _state()
    del st_[3]
    t = _stream()
    t.load_state_dict(st_)
    with pytest.raises(CheckpointError, match="partition 3 is owned by this reader"):
        iter(t)


def test_construction_refusals() -> None:
    with pytest.raises(ValueError, match="at least one shard"):
        Stream.from_shards([], F.read)
    with pytest.raises(ValueError, match=r"partitions must be an int in 1..3"):
        Stream.from_shards([0, 1, 2], F.read, partitions=4)
    with pytest.raises(TypeError, match="read must be callable"):
        Stream.from_shards([0], 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="from_shards"):
        Stream()
    with pytest.raises(ValueError, match="epoch must be"):
        _stream().set_epoch(-1)


def test_a_stream_pickles_without_its_live_reader() -> None:
    s = _stream().map(F.plus_half)
    it = iter(s)
    next(it)
    t = pickle.loads(pickle.dumps(s))
    assert list(t) == list(_stream().map(F.plus_half))
    assert s.pipeline() == ["read", "map:plus_half"]
    assert s.fingerprint().startswith("stream:sha256:")


# ---- carry and skip: the two head fields a loader sets ----


def test_an_unfinished_earlier_pass_is_drawn_first_then_the_next_pass() -> None:
    """A state whose cursors are inside pass 0, loaded for pass 1 (a rank's tail carried into
    the next epoch): the rest of pass 0 comes first, in its own order, then all of pass 1 --
    nothing of either pass lost or repeated."""
    ref = _stream()
    ref.set_epoch(0)
    pass0 = list(ref)
    ref.set_epoch(1)
    pass1 = list(ref)
    s = _stream()
    it = iter(s)
    for _ in range(7):
        next(it)
    state = s.state_dict()
    again = _stream()
    again.load_state_dict(state)
    again.set_epoch(1)
    assert list(again) == pass0[7:] + pass1


def test_a_cursor_s_skip_rows_are_drawn_and_not_delivered() -> None:
    """``skip`` in a cursor (what skip_samples writes): the partition's next ``skip`` rows are
    taken in their canonical places and dropped; every other row comes as before."""
    s = _stream()
    expected = list(s)
    state = _stream().state_dict()
    fields = list(state["stream"]["fields"])
    fresh = [0] * len(fields)
    for p in range(4):
        state[p] = list(fresh)
    state[2][S.SKIP] = 3
    again = _stream()
    again.load_state_dict(state)
    got = list(again)
    p2 = set(S.deal_one(0, 0, 12, 4, True, 2))  # partition 2's shards in pass 0
    first3 = [x for x in expected if x // 1000 in p2][:3]
    assert got == [x for x in expected if x not in first3]
    assert again.state_dict()[2][S.SKIP] == 0


def test_state_dict_changes_applied_in_turn_rebuild_state_dict_at_every_row() -> None:
    """What a worker sends after each batch (only the partitions it moved) must add up to the
    whole state: a missed partition would resume it from an old cursor."""
    s = _stream(shards=12, partitions=6).filter(F.odd)
    held: dict[Any, Any] = {}
    for epoch in range(2):
        s.set_epoch(epoch)
        it = iter(s)
        while True:
            changes = s.state_dict_changes()
            if changes is None:
                held = copy.deepcopy(s.state_dict())
            else:
                held.update(copy.deepcopy(changes))
            assert held == s.state_dict()
            if next(it, None) is None:
                break
        if epoch == 0:  # a load into a live reader: the next call says "take it whole"
            saved = s.state_dict()
            s.load_state_dict(saved)
            assert s.state_dict_changes() is None
            assert s.state_dict() == saved


def _draw(x: int, rng: Any) -> tuple[int, float]:
    return x, float(rng.random())


def test_random_map_after_a_shuffle_resumes_with_the_same_draws() -> None:
    """random_map keys each sample's generator by its chain position: a shuffle's position
    after a resume mid-window must be the one the uninterrupted chain reported."""

    def make() -> Stream:
        return _stream().filter(F.odd).shuffle(3).random_map(_draw)

    n = len(list(make()))
    assert n > 10
    for k in range(n + 1):
        ref, got = _cut_and_resume(make, k)
        assert got == ref, k
    assert len({v for _, v in ref}) == len(ref)
