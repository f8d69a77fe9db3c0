"""Fuzzing the state codec: nothing but CheckpointError ever escapes load_state.

Properties:

* any bytes -- random, behind a valid magic, or framed with a valid header and checksum --
  decode to a plain-data dict or raise CheckpointError;
* whatever load_state accepts, dump_state accepts and round-trips (one notion of "plain data");
* a valid encoding changed in any way (bit flips, inserted or deleted bytes, truncation, the
  splice of two encodings) is refused;
* any plain-data dict round-trips through dump_state / load_state exactly;
* the ``inspect`` summary and its JSON rendering never fail on a decoded dict, whatever the
  fields hold;
* dump_state and load_state agree on the memory budget: what one refuses for the memory it
  would take decoded, so does the other (checked with the allowance shrunk to a few kB).

Example counts come from the profile in fuzz/conftest.py (HYPOTHESIS_PROFILE=ci|long).
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from resumable_loader.cli.summary import format_summary, jsonable
from resumable_loader.core.errors import CheckpointError
from resumable_loader.state.codec import INT_MAX, INT_MIN, MAGIC, _frame, dump_state, load_state
from resumable_loader.state.schema import KNOWN_KEYS
from resumable_loader.testing import same_state

# --- plain data ---------------------------------------------------------------------------------

INTS = st.integers(min_value=INT_MIN, max_value=INT_MAX)
# Small ints are what states mostly hold; the edges are where encodings change width.
EDGE_INTS = st.sampled_from([0, -1, 127, 128, -32, -33, 2**31, 2**32, 2**63 - 1, 2**63, INT_MIN])
SCALARS = (
    st.none()
    | st.booleans()
    | INTS
    | EDGE_INTS
    | st.floats()  # nan, inf, -0.0 and subnormals included
    | st.text(max_size=20)  # hypothesis text() draws no lone surrogates: those are refused
    | st.binary(max_size=20)
)
KEYS = st.text(max_size=10) | INTS
# Generating nested data is most of the cost of these tests, so leaf counts are kept modest:
# codec bugs show up at the type and size edges, which small values reach as well as big ones.
PLAIN = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=12,
)
SMALL = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=4,
)
STATES = st.dictionaries(KEYS, PLAIN, max_size=5)
SMALL_STATES = st.dictionaries(KEYS, SMALL, max_size=4)


def without_tuples(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [without_tuples(v) for v in value]
    if isinstance(value, dict):
        return {k: without_tuples(v) for k, v in value.items()}
    return value


def load_or_refuse(data: bytes) -> dict[Any, Any] | None:
    """load_state(data), or None if it raised CheckpointError; any other exception fails."""
    try:
        state = load_state(data)
    except CheckpointError as exc:
        assert str(exc), "a CheckpointError must say what was wrong"
        return None
    assert isinstance(state, dict)
    return state


def assert_plain_and_stable(state: dict[Any, Any]) -> None:
    """What load_state returns, dump_state accepts and round-trips."""
    assert same_state(load_state(dump_state(state)), state)


# --- arbitrary input ----------------------------------------------------------------------------


@given(st.binary(max_size=300))
def test_arbitrary_bytes(data: bytes) -> None:
    state = load_or_refuse(data)
    assert state is None  # no random bytes carry the magic and a matching blake2b checksum


@given(st.binary(max_size=120))
def test_arbitrary_bytes_behind_the_magic(rest: bytes) -> None:
    assert load_or_refuse(MAGIC + rest) is None


@given(st.binary(max_size=200))
def test_arbitrary_payload_in_a_valid_frame(payload: bytes) -> None:
    # The checksum matches, so this reaches msgpack with whatever bytes it is given.
    state = load_or_refuse(_frame(payload))
    if state is not None:
        assert_plain_and_stable(state)


# msgpack values dump_state never writes: extension types, timestamps, keys of any type.
WIDE_SCALARS = (
    SCALARS
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))
    | st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1), st.integers(0, 999_999_999))
)
WIDE_KEYS = (
    KEYS
    | st.binary(max_size=6)
    | st.floats(allow_nan=False)
    | st.none()
    | st.booleans()
    | st.tuples(st.integers(0, 9), st.text(max_size=3))
)
WIDE = st.recursive(
    WIDE_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(WIDE_KEYS, inner, max_size=4),
    max_leaves=10,
)


@given(WIDE, st.booleans(), st.booleans())
def test_any_msgpack_value_in_a_valid_frame(value: Any, bin_type: bool, single_float: bool) -> None:
    try:
        payload = msgpack.packb(value, use_bin_type=bin_type, use_single_float=single_float)
    except OverflowError:  # a float beyond float32's range; encode it as float64 instead
        payload = msgpack.packb(value, use_bin_type=bin_type)
    state = load_or_refuse(_frame(payload))
    if state is not None:
        assert_plain_and_stable(state)


# --- mutated encodings --------------------------------------------------------------------------

POSITIONS = st.integers(min_value=0, max_value=2**16)  # taken modulo the current length
MUTATIONS = st.one_of(
    st.tuples(st.just("flip"), POSITIONS, st.integers(0, 7)),
    st.tuples(st.just("insert"), POSITIONS, st.binary(min_size=1, max_size=4)),
    st.tuples(st.just("delete"), POSITIONS, st.integers(1, 4)),
    st.tuples(st.just("truncate"), POSITIONS, st.just(0)),
    st.tuples(st.just("overwrite"), POSITIONS, st.binary(min_size=1, max_size=4)),
)


def mutate(data: bytes, mutations: list[tuple[str, int, Any]]) -> bytes:
    out = bytearray(data)
    for op, position, arg in mutations:
        if op == "flip":
            if out:
                out[position % len(out)] ^= 1 << arg
        elif op == "insert":
            at = position % (len(out) + 1)
            out[at:at] = arg
        elif op == "delete":
            at = position % (len(out) + 1)
            del out[at : at + arg]
        elif op == "truncate":
            del out[position % (len(out) + 1) :]
        else:
            at = position % (len(out) + 1)
            out[at : at + len(arg)] = arg
    return bytes(out)


@given(SMALL_STATES, st.lists(MUTATIONS, min_size=1, max_size=4))
def test_mutated_encodings_are_refused(state: dict[Any, Any], mutations: list[Any]) -> None:
    encoded = dump_state(state)
    corrupt = mutate(encoded, mutations)
    loaded = load_or_refuse(corrupt)
    if corrupt == encoded:  # e.g. a flip undone by a second flip
        assert loaded is not None and same_state(loaded, state)
    else:
        assert loaded is None


@given(SMALL_STATES, SMALL_STATES, st.integers(0, 2**16), st.integers(0, 2**16))
def test_spliced_encodings_are_refused(
    first: dict[Any, Any], second: dict[Any, Any], cut_a: int, cut_b: int
) -> None:
    a, b = dump_state(first), dump_state(second)
    spliced = a[: cut_a % (len(a) + 1)] + b[cut_b % (len(b) + 1) :]
    loaded = load_or_refuse(spliced)
    if spliced in (a, b):
        assert loaded is not None
    else:
        assert loaded is None


# --- round trips --------------------------------------------------------------------------------


@given(STATES)
def test_plain_dicts_round_trip_exactly(state: dict[Any, Any]) -> None:
    assert same_state(load_state(dump_state(state)), state)


TUPLED = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3).map(tuple) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=8,
)


@given(st.dictionaries(KEYS, TUPLED, max_size=4))
def test_tuples_round_trip_as_lists(state: dict[Any, Any]) -> None:
    assert same_state(load_state(dump_state(state)), without_tuples(state))


# --- the inspect summary ------------------------------------------------------------------------

WORKER = st.fixed_dictionaries(
    {},
    optional={
        "id": SMALL,
        "delivered": SMALL,
        "exhausted": st.booleans() | SMALL,
        "dataset_state": SMALL,
    },
)
TASK = st.tuples(SMALL, st.lists(SMALL, max_size=3)).map(list) | SMALL
SCHEMA_SHAPED = st.fixed_dictionaries(
    {},
    optional={
        **{key: SMALL for key in KNOWN_KEYS},
        "config": st.dictionaries(
            st.sampled_from(["dataset_kind", "dataset_len", "batch_size", "rank", "x"]), SMALL
        )
        | SMALL,
        "workers": st.lists(WORKER | SMALL, max_size=3) | SMALL,
        "outstanding": st.lists(TASK, max_size=7) | SMALL,
        "skipped": st.lists(st.tuples(SMALL, SMALL, SMALL).map(list) | SMALL, max_size=3),
        "extra": SMALL,
    },
)


@given(SCHEMA_SHAPED | SMALL_STATES)
def test_inspect_never_fails_on_a_decoded_state(state: dict[Any, Any]) -> None:
    decoded = load_state(dump_state(state))
    text = format_summary(decoded, "fuzz")
    assert text.startswith("resumable_loader state: fuzz")
    json.dumps(jsonable(decoded))


# --- the memory budget: dump_state and load_state agree on it -----------------------------------

DENSE = st.recursive(
    st.none() | st.integers(0, 3),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=1), inner, max_size=2)
    ),
    max_leaves=30,
)


@given(st.dictionaries(st.text(max_size=2), DENSE, max_size=4), st.integers(0, 3000))
def test_dump_and_load_agree_on_the_memory_budget(state: dict[Any, Any], allowance: int) -> None:
    """With the allowance shrunk to a few kB, small states cross the budget: whatever dump_state
    writes, load_state reads, and a payload load_state refuses for its memory is one that
    dump_state refuses to write (dump_state prices its payload by decoding it)."""
    from unittest import mock

    from resumable_loader.state import codec as _codec

    with mock.patch.object(_codec, "DECODED_ALLOWANCE", allowance):
        try:
            data = dump_state(state)
        except CheckpointError as exc:
            assert "too large for its size in bytes" in str(exc)
            with pytest.raises(CheckpointError, match="refused while decoding"):
                load_state(_frame(msgpack.packb(state, use_bin_type=True)))
            return
        assert same_state(load_state(data), state)
