"""``Stream.mix`` alone, without a loader (``plans/stream_mix.py``): the per-partition window
bound, every source item once per pass, the exhaustion policies and their counts, weights
changed at a resume, and the refusals. Rows are checked against a model of each source
partition built from the deal alone (``_stream_mix_sources.source_rows``), never against the
mixture itself."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from typing import Any

import _stream_mix_sources as X
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_loader import CheckpointError, Stream
from resumable_loader.plans.stream_mix import exhaustion

P = 4
SIZES = {"web": (32, P), "code": (16, P), "math": (8, P)}


def _mix(
    weights: dict[str, int | float],
    policy: str = "stop",
    sizes: dict[str, tuple[int, int]] = SIZES,
    seed: int = 0,
) -> Stream:
    sources = {name: X.source(name, *sizes[name]) for name in weights}
    return Stream.mix(sources, weights, seed=seed, on_exhausted=policy)


def _per_partition(rows: list[Any], sizes: dict[str, tuple[int, int]], epoch: int = 0) -> dict:
    out: dict[int, list[Any]] = {}
    for x in rows:
        out.setdefault(X.partition_of(x, sizes, epoch), []).append(x)
    return out


def _window_deviation(seq: list[str], weights: dict[str, int]) -> Fraction:
    """The largest ``|count of a source - n * its weight share|`` over every window of
    ``seq``: for one source, the range of ``count(first k) - k * share`` over the prefixes."""
    total = sum(weights.values())
    worst = Fraction(0)
    for name, w in weights.items():
        share = Fraction(w, total)
        c = 0
        d = [Fraction(0)]
        for k, s in enumerate(seq, 1):
            c += s == name
            d.append(c - k * share)
        worst = max(worst, max(d) - min(d))
    return worst


def _bound(weights: dict[str, int]) -> int:
    return math.ceil(math.log2(max(2, sum(1 for w in weights.values() if w > 0))))


def _source_order_kept(rows: list[Any], epoch: int = 0) -> None:
    """Each source's rows in each partition are a prefix of that source partition's rows
    (the model), so nothing is repeated or skipped inside a source."""
    for p, seq in _per_partition(rows, SIZES, epoch).items():
        for name in X.NAMES:
            mine = [x for x in seq if X.source_of(x) == name]
            model = X.source_rows(name, *SIZES[name], p, epoch)
            assert mine == model[: len(mine)], (p, name)


# ---- one pass ----


def test_renormalize_draws_every_item_of_every_source_once_in_source_order() -> None:
    mix = _mix({"web": 3, "code": 2, "math": 1}, "renormalize")
    rows = list(mix)
    expected = sorted(
        x for name in X.NAMES for q in range(P) for x in X.source_rows(name, *SIZES[name], q, 0)
    )
    assert sorted(rows) == expected
    _source_order_kept(rows)
    counts = exhaustion(mix.state_dict())
    for name in X.NAMES:
        assert counts[name]["ran_out"] == P
        assert counts[name]["took"] == sum(1 for x in rows if X.source_of(x) == name)


@given(weights=st.lists(st.integers(1, 5), min_size=3, max_size=3), seed=st.integers(0, 2**20))
@settings(max_examples=15, deadline=None)
def test_stop_ends_each_partition_at_its_first_exhausted_source_and_counts_it(
    weights: list[int], seed: int
) -> None:
    named = dict(zip(X.NAMES, weights))
    mix = _mix(named, "stop", seed=seed)
    rows = list(mix)
    assert len(set(rows)) == len(rows)
    _source_order_kept(rows)
    counts = exhaustion(mix.state_dict())
    assert sum(c["stopped"] for c in counts.values()) == P  # one source ended each partition
    for name in X.NAMES:
        assert counts[name]["took"] == sum(1 for x in rows if X.source_of(x) == name)
    for p, seq in _per_partition(rows, SIZES).items():
        drawn = {n: sum(1 for x in seq if X.source_of(x) == n) for n in X.NAMES}
        full = {n: len(X.source_rows(n, *SIZES[n], p, 0)) for n in X.NAMES}
        # The source that stopped the pass gave all of its partition; the others no more.
        assert any(drawn[n] == full[n] for n in X.NAMES), p
        assert all(drawn[n] <= full[n] for n in X.NAMES), p
    # Under "renormalize" the same mixture draws more: the leftovers "stop" left.
    assert len(list(_mix(named, "renormalize", seed=seed))) > len(rows)


@given(
    weights=st.lists(st.integers(0, 6), min_size=2, max_size=3).filter(lambda w: sum(w) > 0),
    seed=st.integers(0, 2**32),
)
@settings(max_examples=40, deadline=None)
def test_every_window_of_a_partition_is_within_the_bound(weights: list[int], seed: int) -> None:
    named = dict(zip(X.NAMES, weights))
    mix = _mix(named, "stop", seed=seed)
    for p, seq in _per_partition(list(mix), SIZES).items():
        names = [X.source_of(x) for x in seq]
        assert _window_deviation(names, named) <= _bound(named), (p, names)
        for name, w in named.items():
            if w == 0:
                assert name not in names


def test_a_source_with_fewer_partitions_is_read_with_a_stride_each_item_once() -> None:
    sizes = {"web": (32, 4), "code": (16, 2), "math": (8, 1)}
    mix = _mix({"web": 2, "code": 1, "math": 1}, "renormalize", sizes)
    rows = list(mix)
    for name in X.NAMES:
        n, p_s = sizes[name]
        model = [x for q in range(p_s) for x in X.source_rows(name, n, p_s, q, 0)]
        assert sorted(x for x in rows if X.source_of(x) == name) == sorted(model)
    # Mixed partition p keeps items p div P_s, + F, + 2F, ... of source partition p mod P_s.
    parts = _by_partition(mix, 4)
    for name in ("code", "math"):
        n, p_s = sizes[name]
        every = 4 // p_s
        for p in range(4):
            want = X.source_rows(name, n, p_s, p % p_s, 0)[p // p_s :: every]
            assert [x for x in parts[p] if X.source_of(x) == name] == want, (name, p)


def _by_partition(stream: Stream, partitions: int) -> dict[int, list[Any]]:
    """Each partition's rows of one pass, read alone: ``partitions`` simulated ranks, each
    owning one partition (``p mod world == rank``)."""
    out = {}
    for r in range(partitions):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(torch.distributed, "is_available", lambda: True)
            m.setattr(torch.distributed, "is_initialized", lambda: True)
            m.setattr(torch.distributed, "get_world_size", lambda *a, **k: partitions)
            m.setattr(torch.distributed, "get_rank", lambda *a, r=r, **k: r)
            out[r] = list(stream)
    return out


# ---- resumes ----


def _take(stream: Stream, n: int) -> tuple[list[Any], dict[Any, Any]]:
    """The first ``n`` rows of ``stream`` (one reader) and its state after them, as json."""
    it = iter(stream)
    rows = [next(it) for _ in range(n)]
    return rows, json.loads(json.dumps(_str_keys(stream.state_dict())), object_hook=_int_keys)


def _str_keys(state: dict[Any, Any]) -> dict[str, Any]:
    return {str(k): v for k, v in state.items()}


def _int_keys(d: dict[str, Any]) -> dict[Any, Any]:
    return {int(k) if k.isdigit() else k: v for k, v in d.items()}


@given(
    k=st.integers(0, 160),
    policy=st.sampled_from(["stop", "renormalize"]),
    strided=st.booleans(),
)
@settings(max_examples=30, deadline=None)
def test_a_resume_at_any_row_continues_the_uninterrupted_pass(
    k: int, policy: str, strided: bool
) -> None:
    sizes = {"web": (32, 4), "code": (16, 2 if strided else 4), "math": (8, 4)}
    weights = {"web": 3, "code": 2, "math": 1}
    ref = list(_mix(weights, policy, sizes))
    k = min(k, len(ref))
    head, state = _take(_mix(weights, policy, sizes), k)
    resumed = _mix(weights, policy, sizes)
    resumed.load_state_dict(state)
    assert head + list(resumed) == ref


@given(
    k=st.integers(1, 100),
    new=st.lists(st.integers(0, 4), min_size=3, max_size=3).filter(lambda w: sum(w) > 0),
    zero=st.sampled_from(X.NAMES),
)
@settings(max_examples=30, deadline=None)
def test_new_weights_at_a_resume_apply_from_each_partitions_position(
    k: int, new: list[int], zero: str
) -> None:
    old = {"web": 3, "code": 2, "math": 1}
    weights = dict(zip(X.NAMES, new))
    weights[zero] = 0
    if not any(weights.values()):
        weights[next(n for n in X.NAMES if n != zero)] = 1
    ref = list(_mix(old, "stop"))
    head, state = _take(_mix(old, "stop"), min(k, len(ref) - 1))
    resumed = _mix(weights, "stop")
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert head == ref[: len(head)]  # what was delivered stays delivered
    assert not [x for x in rest if X.source_of(x) == zero]  # weight 0: nothing after
    assert len(set(head + rest)) == len(head + rest)  # no source item twice in the pass
    _source_order_kept(head + rest)  # each source continues at its cursor
    # After the resume point each partition follows the new weights within the bound.
    for p, seq in _per_partition(rest, SIZES).items():
        names = [X.source_of(x) for x in seq]
        assert _window_deviation(names, weights) <= _bound(weights), p
    saved = resumed.state_dict()["stream"]["mix"]["weights"]
    assert saved == [old, weights]


def test_a_resume_seeks_each_source_partition_once_and_skips_nothing() -> None:
    weights = {"web": 2, "code": 1, "math": 1}
    _, state = _take(_mix(weights, "renormalize"), 30)
    fields = state["stream"]["fields"]
    mid_shard = sum(
        1
        for k, c in state.items()
        if k != "stream"
        for name in weights
        if c[fields.index(f"{name}.offset")] > 0
    )
    assert mid_shard > 0
    resumed = _mix(weights, "renormalize")
    resumed.load_state_dict(state)
    list(resumed)
    stats = resumed.read_stats()
    assert stats["seeks"] == mid_shard  # one seek per source partition inside a shard
    assert stats["skipped"] == 0


def test_a_state_saved_after_new_weights_resumes_without_another_change() -> None:
    """The history in the state says the new weights already apply: loading it into a
    mixture with the same new weights starts no further segment."""
    old = {"web": 1, "code": 1, "math": 1}
    new = {"web": 1, "code": 0, "math": 3}
    _, state = _take(_mix(old, "renormalize"), 20)
    cont = _mix(new, "renormalize")
    cont.load_state_dict(state)
    ref = list(cont)
    again = _mix(new, "renormalize")
    again.load_state_dict(state)
    head, state2 = _take(again, 25)
    last = _mix(new, "renormalize")
    last.load_state_dict(state2)
    assert head + list(last) == ref
    assert state2["stream"]["mix"]["weights"] == [old, new]


def test_the_next_pass_uses_the_newest_weights_from_its_start() -> None:
    old = {"web": 1, "code": 1, "math": 1}
    new = {"web": 0, "code": 1, "math": 0}
    _, state = _take(_mix(old, "stop"), 10)
    mix = _mix(new, "stop")
    mix.load_state_dict(state)
    list(mix)
    mix.set_epoch(1)
    assert {X.source_of(x) for x in mix} == {"code"}


def test_stages_after_the_mix_apply_to_the_mixed_rows() -> None:
    weights = {"web": 1, "code": 1}
    mix = _mix(weights, "stop")
    halves = mix.map(_half)
    assert list(halves) == [x / 2 for x in mix]
    assert halves.pipeline() == ["mix(code,web;stop)", "map:_half"]
    assert halves.cursor_fields()[4:6] == ("m", "seg")


def _half(x: int) -> float:
    return x / 2


def test_the_state_is_plain_data_and_names_its_sources() -> None:
    _, state = _take(_mix({"web": 1, "code": 1}, "stop"), 7)
    header = state["stream"]
    assert [s["name"] for s in header["mix"]["sources"]] == ["code", "web"]
    assert header["mix"]["sources"][0]["shards"]["count"] == 16
    assert header["mix"]["weights"] == [{"code": 1, "web": 1}]
    assert len(state) == 1 + P and all(
        len(c) == len(header["fields"]) for k, c in state.items() if k != "stream"
    )


# ---- refusals ----


def test_partition_counts_that_do_not_divide_the_mixture_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"\{'code': 3\}.*partitions= a divisor of 4"):
        _mix({"web": 1, "code": 1}, sizes={"web": (32, 4), "code": (16, 3)})


def test_bad_arguments_are_refused() -> None:
    web = X.source("web", 32, 4)
    with pytest.raises(TypeError, match="dict of named Streams"):
        Stream.mix([web], {"web": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be Streams"):
        Stream.mix({"web": [1, 2]}, {"web": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="on_exhausted"):
        Stream.mix({"web": web}, {"web": 1}, on_exhausted="cycle")
    with pytest.raises(ValueError, match="no weight for"):
        Stream.mix({"web": web}, {"code": 1})


def test_a_state_whose_sources_differ_is_refused_by_fingerprint_and_load() -> None:
    _, state = _take(_mix({"web": 1, "code": 1}), 5)
    other = Stream.mix(
        {"web": X.source("web", 32, 4), "code": X.source("code", 12, 4)}, {"web": 1, "code": 1}
    )
    assert other.fingerprint() != _mix({"web": 1, "code": 1}).fingerprint()
    with pytest.raises(CheckpointError, match="shards"):
        other.load_state_dict(state)
    renamed = Stream.mix(
        {"web": X.source("web", 32, 4), "kode": X.source("code", 16, 4)}, {"web": 1, "kode": 1}
    )
    with pytest.raises(CheckpointError):
        renamed.load_state_dict(state)
    reseeded = Stream.mix(
        {
            "web": X.source("web", 32, 4),
            "code": Stream.from_shards(X.keys("code", 16), X.F.read, seed=9, partitions=4),
        },
        {"web": 1, "code": 1},
    )
    with pytest.raises(CheckpointError, match=r"sources\['code'\]\.seed"):
        reseeded.load_state_dict(state)


def test_another_policy_and_a_plain_streams_state_are_refused() -> None:
    _, state = _take(_mix({"web": 1, "code": 1}, "stop"), 5)
    with pytest.raises(CheckpointError, match="on_exhausted='stop'"):
        _mix({"web": 1, "code": 1}, "renormalize").load_state_dict(state)
    plain = X.source("web", 32, 4)
    with pytest.raises(CheckpointError):
        plain.load_state_dict(state)
    _, plain_state = _take(X.source("web", 32, 4), 3)
    with pytest.raises(CheckpointError):
        _mix({"web": 1, "code": 1}).load_state_dict(plain_state)


def test_a_malformed_mix_cursor_is_refused_naming_the_field() -> None:
    _, state = _take(_mix({"web": 1, "code": 1}), 9)
    fields = state["stream"]["fields"]
    bad = {k: list(v) if k != "stream" else v for k, v in state.items()}
    bad[0][fields.index("web.took")] += 1
    with pytest.raises(CheckpointError, match="'took' add up to"):
        _mix({"web": 1, "code": 1}).load_state_dict(bad)
    bad = {k: list(v) if k != "stream" else v for k, v in state.items()}
    bad[1][fields.index("seg")] = bad[1][fields.index("m")] + 1
    with pytest.raises(CheckpointError, match="field 'seg'"):
        _mix({"web": 1, "code": 1}).load_state_dict(bad)


def test_a_mixture_of_a_mixture_resumes_exactly_and_its_inner_weights_are_fixed() -> None:
    def outer(inner_weights: dict[str, int]) -> Stream:
        inner = Stream.mix(
            {"web": X.source("web", 32, 4), "code": X.source("code", 16, 4)},
            inner_weights,
            on_exhausted="renormalize",
        )
        return Stream.mix(
            {"wc": inner, "math": X.source("math", 8, 4)},
            {"wc": 3, "math": 1},
            on_exhausted="renormalize",
        )

    ref = list(outer({"web": 1, "code": 1}))
    assert (
        len(set(ref))
        == len(ref)
        == len(list(_mix({"web": 1, "code": 1, "math": 1}, "renormalize")))
    )
    head, state = _take(outer({"web": 1, "code": 1}), 50)
    resumed = outer({"web": 1, "code": 1})
    resumed.load_state_dict(state)
    assert head + list(resumed) == ref
    with pytest.raises(CheckpointError, match=r"sources\['wc'\]\.mix"):
        outer({"web": 1, "code": 0}).load_state_dict(state)


def test_a_source_position_out_of_its_partition_is_refused_naming_the_field() -> None:
    _, state = _take(_mix({"web": 1, "code": 1}), 9)
    fields = state["stream"]["fields"]
    bad = {k: list(v) if k != "stream" else v for k, v in state.items()}
    bad[2][fields.index("code.shard_i")] = 99
    with pytest.raises(
        CheckpointError, match=r"'code\.shard_i' is 99, but the source's partition reads 4"
    ):
        _mix({"web": 1, "code": 1}).load_state_dict(bad)
