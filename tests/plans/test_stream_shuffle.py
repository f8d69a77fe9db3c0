"""``Stream.shuffle(buffer_size)`` alone, without a loader (``plans/stream_shuffle.py``): each
window is a permutation of its input; a resume at any point continues exactly as the
uninterrupted run does, re-reading at most ``buffer_size`` items per partition (counted by a
reader that logs every sample it yields); the state holds positions only; bad arguments and
states are refused naming what is wrong."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import _stream_shards as F
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_loader import CheckpointError, Stream
from resumable_loader.plans import streams as S
from resumable_loader.plans.interleave import pass_keys, permutation, permute


class Lengths:
    """A seekable reader over shards of the given lengths: sample ``i`` of shard ``s`` is
    ``s * 1000 + i``; every sample yielded is appended to ``log`` (reads are counted)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.log: list[int] = []

    def __call__(self, s: int, start: int) -> Iterator[int]:
        for i in range(start, self.lengths[s]):
            self.log.append(s * 1000 + i)
            yield s * 1000 + i


def _by_partition(samples: list[int], n: int, p: int, seed: int, epoch: int = 0) -> dict:
    where = {s: q for q, shards in enumerate(S.deal(seed, epoch, n, p, True)) for s in shards}
    out: dict[int, list[int]] = {q: [] for q in range(p)}
    for x in samples:
        out[where[x // 1000]].append(x)
    return out


def _odd(x: int) -> bool:
    return x % 2 == 1


def _make(
    read: Any, n: int, p: int, b: int, seed: int = 0, filtered: bool = False, shuffle: bool = True
) -> Stream:
    s = Stream.from_shards(list(range(n)), read, partitions=p, seed=seed)
    if filtered:
        s = s.filter(_odd)  # before the shuffle: its drops sit inside the windows
    return s.shuffle(b) if shuffle else s


# ---- the order ----


@given(n=st.integers(0, 300), seed=st.integers(0, 2**40), name=st.text(max_size=5))
@settings(max_examples=60, deadline=None)
def test_permutation_is_permute_for_a_whole_window(n: int, seed: int, name: str) -> None:
    keys = pass_keys(seed, name, 0)
    assert permutation(n, keys).tolist() == [permute(x, n, keys) for x in range(n)]


@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=9),
    data=st.data(),
    b=st.integers(1, 9),
    seed=st.integers(0, 3),
    filtered=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_each_window_is_a_permutation_of_its_input(
    lengths: list[int], data: Any, b: int, seed: int, filtered: bool
) -> None:
    n = len(lengths)
    p = data.draw(st.integers(1, n), label="partitions")
    plain = _by_partition(list(_make(Lengths(lengths), n, p, b, seed, filtered, False)), n, p, seed)
    mixed = _by_partition(list(_make(Lengths(lengths), n, p, b, seed, filtered)), n, p, seed)
    for q in range(p):
        u, v = plain[q], mixed[q]
        assert len(u) == len(v)
        for w in range(0, len(u), b):
            assert sorted(v[w : w + b]) == sorted(u[w : w + b]), (q, w)


def test_buffer_size_1_keeps_the_order_and_windows_differ_by_partition_pass_and_window() -> None:
    lengths = [40] * 8
    plain = list(_make(Lengths(lengths), 8, 4, 1, shuffle=False))
    assert list(_make(Lengths(lengths), 8, 4, 1)) == plain
    # 16-item windows: the offset pattern of each (partition, window) is its own permutation.
    s = _make(Lengths(lengths), 8, 4, 16)
    patterns = set()
    for epoch in (0, 1):
        s.set_epoch(epoch)
        got = _by_partition(list(s), 8, 4, 0, epoch)
        plain_s = _make(Lengths(lengths), 8, 4, 16, shuffle=False)
        plain_s.set_epoch(epoch)
        ref = _by_partition(list(plain_s), 8, 4, 0, epoch)
        for q in range(4):
            for w in range(0, 80, 16):
                window = ref[q][w : w + 16]
                patterns.add(tuple(window.index(x) for x in got[q][w : w + 16]))
    assert len(patterns) == 2 * 4 * 5  # every (pass, partition, window) its own order


# ---- resume ----


def _cut(make: Any, k: int) -> tuple[list[int], dict[Any, Any], Any]:
    read = Lengths(make.lengths)
    s = make(read)
    it = iter(s)
    head = [next(it) for _ in range(k)]
    return head, copy.deepcopy(s.state_dict()), read


class _Maker:
    def __init__(self, lengths: list[int], p: int, b: int, seed: int, filtered: bool) -> None:
        self.lengths, self.p, self.b, self.seed, self.filtered = lengths, p, b, seed, filtered

    def __call__(self, read: Any) -> Stream:
        return _make(read, len(self.lengths), self.p, self.b, self.seed, self.filtered)


@given(
    lengths=st.lists(st.integers(0, 14), min_size=1, max_size=9),
    data=st.data(),
    b=st.integers(1, 9),
    seed=st.integers(0, 3),
    filtered=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_a_resume_anywhere_continues_exactly_and_re_reads_at_most_b_per_partition(
    lengths: list[int], data: Any, b: int, seed: int, filtered: bool
) -> None:
    n = len(lengths)
    p = data.draw(st.integers(1, n), label="partitions")
    make = _Maker(lengths, p, b, seed, filtered)
    ref = list(make(Lengths(lengths)))
    k = data.draw(st.integers(0, len(ref)), label="resume after")
    head, state, first = _cut(make, k)
    again = Lengths(lengths)
    t = make(again)
    t.load_state_dict(state)
    rest = list(t)
    assert head + rest == ref
    # What the resumed run read that the first had read too: the windows it refilled.
    overlap = _by_partition([x for x in again.log if x in set(first.log)], n, p, seed)
    assert len(again.log) == len(set(again.log))  # nothing read twice after the resume
    for q in range(p):
        kept = [x for x in overlap[q] if not filtered or _odd(x)]
        assert len(kept) <= b, (q, kept)
        taken = state[q][-1] if q in state else 0
        if taken == 0:
            assert overlap[q] == [], q  # a window's end: nothing re-read
        else:
            # The refilled window: ``taken`` of its items delivered before, the rest read (in
            # the first run's fill) but not delivered; every delivered one is in it.
            delivered = set(head) & set(kept)
            assert len(delivered) == taken, q


@pytest.mark.parametrize("via", ["json", "deepcopy"])
def test_the_state_holds_positions_only(via: str) -> None:
    lengths = [30] * 8
    make = _Maker(lengths, 4, 8, 0, False)
    ref = list(make(Lengths(lengths)))
    head, state, _ = _cut(make, 21)
    assert state["stream"]["fields"][-2:] == ["win", "taken"]
    assert state["stream"]["pipeline"] == ["read", "shuffle(B=8)"]
    for q in range(4):
        assert all(type(v) is int for v in state[q]) and len(state[q]) == 9
    if via == "json":
        raw = json.loads(json.dumps({str(key): v for key, v in state.items()}))
        state = {(key if key == "stream" else int(key)): v for key, v in raw.items()}
    t = make(Lengths(lengths))
    t.load_state_dict(state)
    assert head + list(t) == ref


def test_across_passes_and_an_unfinished_pass_carried_first() -> None:
    lengths = [9] * 6
    make = _Maker(lengths, 3, 4, 1, False)
    s = make(Lengths(lengths))
    pass0 = list(s)
    s.set_epoch(1)
    pass1 = list(s)
    assert sorted(pass0) == sorted(pass1) and pass0 != pass1
    head, state, _ = _cut(make, 10)
    t = make(Lengths(lengths))
    t.load_state_dict(state)
    t.set_epoch(1)
    assert head + list(t) == pass0 + pass1


def test_a_map_before_and_after_the_shuffle_is_resumed_and_may_change() -> None:
    def make(fn: Any) -> Stream:
        return (
            Stream.from_shards(list(range(12)), F.read, partitions=4)
            .map(fn)
            .shuffle(5)
            .map(F.plus_half)
        )

    ref = list(make(abs))
    s = make(abs)
    it = iter(s)
    head = [next(it) for _ in range(13)]
    t = make(int)  # another function: the positions count input items, so still valid
    t.load_state_dict(s.state_dict())
    assert head + list(t) == ref


def test_two_shuffles_in_one_chain_have_their_own_orders_and_resume_anywhere() -> None:
    def make() -> Stream:
        return Stream.from_shards(list(range(12)), F.read, partitions=3).shuffle(4).shuffle(3)

    ref = list(make())
    once = list(Stream.from_shards(list(range(12)), F.read, partitions=3).shuffle(4))
    assert sorted(ref) == sorted(once) and ref != once
    assert make().cursor_fields()[-4:] == ("win", "taken", "win", "taken")
    for k in range(len(ref) + 1):
        s = make()
        it = iter(s)
        head = [next(it) for _ in range(k)]
        t = make()
        t.load_state_dict(copy.deepcopy(s.state_dict()))
        assert head + list(t) == ref, k


# ---- errors inside a window's fill ----


def test_a_read_error_inside_a_window_fill_loses_nothing() -> None:
    calls = {"n": 0}

    def flaky(s: int, start: int) -> Any:
        for i in range(start, F.shard_len(s)):
            calls["n"] += 1
            if calls["n"] in (3, 17, 30):  # inside fills (B=6 windows, shards of 2..6)
                raise OSError("transient")
            yield F.sample(s, i)

    def make(read: Any) -> Stream:
        return Stream.from_shards(list(range(12)), read, partitions=4).shuffle(6)

    out, errors = _drain(iter(make(flaky)))
    assert errors == 3
    assert out == list(make(F.read))


def test_a_map_error_inside_a_window_fill_loses_nothing() -> None:
    ref = list(Stream.from_shards(list(range(12)), F.read, partitions=4).shuffle(6))
    fails = {F.sample(3, 1), F.sample(7, 0)}

    def fragile(x: int) -> int:
        if x in fails:
            fails.discard(x)
            raise ValueError("once")
        return x

    s = Stream.from_shards(list(range(12)), F.read, partitions=4).map(fragile).shuffle(6)
    out, errors = _drain(iter(s))
    assert errors == 2
    assert out == ref


def _drain(it: Any) -> tuple[list[Any], int]:
    out, errors = [], 0
    while True:
        try:
            out.append(next(it))
        except (OSError, ValueError):
            errors += 1
        except StopIteration:
            return out, errors


# ---- refusals ----


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (0, ValueError, r"must be >= 1"),
        (-3, ValueError, r"must be >= 1"),
        (2.0, TypeError, r"needs an int"),
        (True, TypeError, r"needs an int"),
        ("8", TypeError, r"needs an int"),
    ],
)
def test_a_bad_buffer_size_is_refused(bad: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Stream.from_shards([0, 1], F.read).shuffle(bad)


def _state_b(b: int, k: int = 7) -> dict[Any, Any]:
    s = Stream.from_shards(list(range(12)), F.read, partitions=4).shuffle(b)
    it = iter(s)
    for _ in range(k):
        next(it)
    return copy.deepcopy(s.state_dict())


def test_another_buffer_size_or_no_shuffle_is_refused() -> None:
    state = _state_b(4)
    with pytest.raises(CheckpointError, match=r"shuffle\(B=4\).*this Stream has \['shuffle\(B=5\)"):
        Stream.from_shards(list(range(12)), F.read, partitions=4).shuffle(5).load_state_dict(state)
    with pytest.raises(CheckpointError, match=r"stream.fields"):
        Stream.from_shards(list(range(12)), F.read, partitions=4).load_state_dict(state)


def test_a_taken_beyond_the_window_is_refused() -> None:
    state = _state_b(4)
    q = next(q for q in range(4) if state[q][-1] > 0)
    state[q][-1] = 5
    t = Stream.from_shards(list(range(12)), F.read, partitions=4).shuffle(4)
    t.load_state_dict(state)
    with pytest.raises(CheckpointError, match=rf"partition {q} field 'taken' is 5, more than"):
        list(t)
    # Within the buffer size but past what the window holds: one partition of 6 items in
    # windows of 4 and 2, the state inside the short one.
    s = Stream.from_shards([0], Lengths([6]), partitions=1).shuffle(4)
    it = iter(s)
    for _ in range(5):
        next(it)
    state = copy.deepcopy(s.state_dict())
    assert state[0][-2:] == [1, 1]
    state[0][-1] = 3
    t = Stream.from_shards([0], Lengths([6]), partitions=1).shuffle(4)
    t.load_state_dict(state)
    with pytest.raises(CheckpointError, match=r"'taken' is 3, but window 1 of pass 0 holds 2"):
        list(t)
