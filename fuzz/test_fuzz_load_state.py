"""Fuzzing the decoding side of the loader: damaged states into ``load_state_dict``.

The codec fuzzer (test_fuzz_codec.py) covers bytes -> dict; this covers dict -> loader. Real
states are taken from real loaders of several kinds (map-style with a builtin, a stateful or a
fast-forwarded sampler, ``in_order=False`` states with ``delivered_ahead``, streams with state
on the dataset, on the iterator, or none, with and without workers), at several points of two
epochs. Each example mutates one of them 1-4 times -- a value replaced by arbitrary data
(plain data, and what else a pickle or ``torch.load`` can hand back: tuples, sets, tensors,
numpy scalars and arrays), an int nudged or blown up, a type changed, a key deleted or added,
a value wrapped in a list or a dict, the whole state replaced -- and loads it into a loader
that is fresh, that has already loaded a valid state, or that is part-way through an epoch.

Properties:

* only ``CheckpointError`` escapes ``load_state_dict``;
* a refused state changes nothing: ``state_dict()`` is what it was, and the loader (and a
  running iterator) goes on to yield exactly the batches it would have yielded;
* a value nested deeper than the codec's limit (counted from the state, exactly), or one that
  makes the state hold itself, is refused with a CheckpointError naming the field -- never a
  RecursionError -- wherever it sits (``test_deep_and_self_holding_values_...``);
* an accepted state is one the loader can run from: ``state_dict()`` returns it, and the next
  two epochs iterate without an exception (unless the mutation touched the user's own sampler
  or dataset state, whose validity only the user's ``load_state_dict`` knows), yielding no
  more batches than an epoch has.

Example counts come from the profile in fuzz/conftest.py (HYPOTHESIS_PROFILE=ci|long).
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import _fuzz_data as F
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from torch.utils.data.distributed import DistributedSampler

from resumable_loader import CheckpointError, DataLoader
from resumable_loader.testing import canonical

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
WATCHDOG_S = 30.0

pytestmark = [
    pytest.mark.filterwarnings("ignore:resuming an iterable dataset without state_dict"),
    pytest.mark.timeout(0 if PROFILE == "long" else 900),
]


# ---- the loaders --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    """A way to build a loader; ``source_workers`` builds the ones the real states come from."""

    name: str
    make: Callable[[int], DataLoader]  # num_workers -> loader
    workers: int  # of the loader states are loaded into
    source_workers: int
    user_state_keys: tuple[str, ...] = ()  # where the user's own state lives in a state


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def _kw(nw: int) -> dict[str, Any]:
    if not nw:
        return {}
    return dict(multiprocessing_context="fork", timeout=WATCHDOG_S, persistent_workers=False)


KINDS = [
    Kind(
        "map-shuffle",
        lambda nw: DataLoader(
            F.MapData(10), batch_size=3, shuffle=True, generator=_gen(), **_kw(nw)
        ),
        0,
        0,
    ),
    Kind(
        "map-unordered",  # states with delivered_ahead, loaded without workers
        lambda nw: DataLoader(
            F.MapData(10),
            batch_size=2,
            drop_last=True,
            in_order=False,
            num_workers=nw,
            prefetch_factor=3 if nw else None,
            generator=_gen(),
            **_kw(nw),
        ),
        0,
        2,
    ),
    Kind(
        "map-stateful-sampler",  # sampler_state, drawn, outstanding
        lambda nw: DataLoader(
            F.MapData(9),
            batch_size=2,
            sampler=F.StatefulSampler(9, seed=3),
            num_workers=nw,
            generator=_gen(),
            **_kw(nw),
        ),
        0,
        2,
        ("sampler_state",),
    ),
    Kind(
        "map-batch-sampler",  # fast-forwarded
        lambda nw: DataLoader(
            F.MapData(8),
            batch_sampler=F.VariableBatchSampler(8, (1, 3)),
            num_workers=nw,
            generator=_gen(),
            **_kw(nw),
        ),
        0,
        0,
    ),
    Kind(
        "map-distributed",  # distributed: sampler_epoch, history (a 3 -> 2 re-cut among them)
        lambda nw: DataLoader(
            F.MapData(11),
            batch_size=2,
            sampler=DistributedSampler(F.MapData(11), num_replicas=2, rank=1, seed=3),
            num_workers=nw,
            **_kw(nw),
        ),
        0,
        0,
    ),
    Kind(
        "stream-dataset-state",
        lambda nw: DataLoader(F.DatasetStateStream(7), batch_size=2, generator=_gen(), **_kw(nw)),
        0,
        0,
        ("dataset_state",),
    ),
    Kind(
        "stream-plain",
        lambda nw: DataLoader(F.PlainStream(5), batch_size=None, generator=_gen(), **_kw(nw)),
        0,
        0,
        ("dataset_state",),
    ),
    Kind(
        "stream-iterator-state-w2",
        lambda nw: DataLoader(
            F.IteratorStateStream(5),
            batch_size=None,
            num_workers=nw,
            generator=_gen(),
            **_kw(nw),
        ),
        2,
        2,
        ("dataset_state",),
    ),
]
# The two-worker stream costs a worker start per loader: drawn less often.
KIND_WEIGHTS = [3, 2, 3, 2, 3, 3, 2, 1]

_STATES: dict[str, list[dict[str, Any]]] = {}
_REFERENCE: dict[tuple[str, int], list[list[Any]]] = {}


def real_states(kind: Kind) -> list[dict[str, Any]]:
    """States of a source loader: before iterating, after each batch, after StopIteration,
    and part-way through the second epoch."""
    if kind.name not in _STATES:
        states = []
        loader = kind.make(kind.source_workers)
        with loader:
            states.append(loader.state_dict())
            for epoch in range(2):
                it = iter(loader)
                for k, _ in enumerate(it):
                    if epoch == 0 or k == 1:
                        states.append(loader.state_dict())
                states.append(loader.state_dict())
        _STATES[kind.name] = states
    return _STATES[kind.name]


def batches(loader: DataLoader, it: Any = None, epochs: int = 2) -> list[list[Any]]:
    """What the loader yields: the rest of ``it`` (or a new epoch), then more epochs."""
    out = []
    for _ in range(epochs):
        out.append([canonical(b) for b in (it if it is not None else loader)])
        it = None
    return out


def reference(kind: Kind, state_index: int) -> list[list[Any]]:
    """Two epochs of a fresh loader (-1), or of one that loaded real state ``state_index``."""
    key = (kind.name, state_index)
    if key not in _REFERENCE:
        loader = kind.make(kind.workers)
        with loader:
            if state_index >= 0:
                loader.load_state_dict(copy.deepcopy(real_states(kind)[state_index]))
            _REFERENCE[key] = batches(loader)
    return _REFERENCE[key]


# ---- mutations ----------------------------------------------------------------------------------
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, -1, 2, 3, 7, 100, 2**31, 2**63 - 1, 2**63, 2**64, 10**30])
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
# What else a pickle or torch.load(weights_only=True) may hand back inside a "state".
ODD = st.sampled_from(
    [
        (1, 2),
        (),
        frozenset({1}),
        {1, 2},
        np.int64(2),
        np.float32(1.5),
        np.bool_(True),
        np.array(3),
        torch.tensor(2),
        np.array([1, 2]),
        torch.tensor([1, 1]),
        float("nan"),
        float("inf"),
        "resumable_loader.DataLoader",
        "iterable",
        "map",
    ]
)
VALUES = st.recursive(
    SCALARS | ODD,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
KEYS = st.sampled_from(
    [
        "format",
        "version",
        "config",
        "seed",
        "epoch",
        "consumed",
        "delivered_ahead",
        "sampler_state",
        "drawn",
        "sampler_done",
        "outstanding",
        "workers",
        "next_worker",
        "id",
        "delivered",
        "exhausted",
        "dataset_state",
        "state_at",
        "distributed",
        "sampler_epoch",
        "history",
        "generator_draws",
        "pos",
        "epoch",
        "batch_size",
        "num_workers",
    ]
) | st.text(max_size=6)

Path = tuple[Any, ...]
# Nudges keep a state well-formed but move it (often to where it is no longer consistent).
HOWS = ["replace"] * 2 + ["nudge"] * 3 + ["retype"] * 2 + ["delete", "add", "add", "wrap"]
# Mostly one mutation: the first field found damaged ends the load, and hides the others.
MUTATIONS = st.sampled_from([1, 1, 1, 2, 3, 4])


def paths(obj: Any, prefix: Path = ()) -> list[Path]:
    """Every path into ``obj`` (the root included), parents before children."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths(v, (*prefix, i))
    return out


def get(obj: Any, path: Path) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def put(root: Any, path: Path, value: Any) -> Any:
    """``root`` with the value at ``path`` replaced (in place below the root)."""
    if not path:
        return value
    get(root, path[:-1])[path[-1]] = value
    return root


def retyped(value: Any, data: st.DataObject) -> Any:
    if isinstance(value, bool):
        return data.draw(st.sampled_from([int(value), str(value), None, np.bool_(value)]))
    if isinstance(value, int):
        return data.draw(
            st.sampled_from([float(value), str(value), value != 0, None, np.int64(value % 2**62)])
        )
    if isinstance(value, str):
        return data.draw(st.sampled_from([value.encode(), [value], None, 0]))
    if isinstance(value, list):
        return data.draw(st.sampled_from([tuple(value), dict(enumerate(value)), None, len(value)]))
    if isinstance(value, dict):
        return data.draw(st.sampled_from([list(value.items()), list(value), None, {}]))
    return data.draw(VALUES)


def nudged(value: Any, data: st.DataObject) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        how = data.draw(st.sampled_from(["step", "negate", "huge", "double"]))
        if how == "step":
            return value + data.draw(st.integers(-3, 3))
        if how == "negate":
            return -value - 1
        if how == "huge":
            return data.draw(st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, 10**30]))
        return value * 2 + 1
    if isinstance(value, list) and value:
        how = data.draw(st.sampled_from(["duplicate", "reverse", "drop"]))
        if how == "duplicate":
            return [*value, value[-1]]
        if how == "reverse":
            return value[::-1]
        return value[1:]
    return data.draw(VALUES)


def mutate(state: Any, data: st.DataObject) -> tuple[Any, list[Path]]:
    """Apply one mutation; returns the new state and the paths it touched."""
    how = data.draw(st.sampled_from(HOWS), label="how")
    where = data.draw(st.sampled_from(list(paths(state))), label="path")
    value = get(state, where)
    if how == "replace":
        state = put(state, where, data.draw(VALUES, label="value"))
    elif how == "nudge":
        state = put(state, where, nudged(value, data))
    elif how == "retype":
        state = put(state, where, retyped(value, data))
    elif how == "delete":
        if not where:
            return data.draw(VALUES | st.just({}), label="root"), [where]
        parent = get(state, where[:-1])
        del parent[where[-1]]
    elif how == "add":
        if isinstance(value, dict):
            value[data.draw(KEYS, label="key")] = data.draw(VALUES, label="value")
        elif isinstance(value, list):
            value.append(data.draw(VALUES, label="value"))
        else:
            state = put(state, where, [value, data.draw(VALUES, label="value")])
    else:  # wrap: wrong nesting
        wrapper = data.draw(st.sampled_from(["list", "dict"]), label="wrapper")
        state = put(state, where, [value] if wrapper == "list" else {"value": value})
    note(f"{how} at {list(where)}")
    return state, [where]


def touches_user_state(kind: Kind, touched: list[Path]) -> bool:
    for path in touched:
        if not path:
            continue
        if any(k in kind.user_state_keys for k in path if isinstance(k, str)):
            return True
        # Nesting a user-state key's parent under a new key, or deleting the key holding the
        # workers' list, changes what the user's load_state_dict() sees too.
        if path[0] in ("workers", "sampler_state") and len(path) <= 2:
            return True
    return False


def comparable(obj: Any) -> bool:
    """Whether ``==`` on ``obj`` is plain equality (no nan, no arrays or tensors inside)."""
    if isinstance(obj, float):
        return not math.isnan(obj)
    if isinstance(obj, dict):
        return all(comparable(k) and comparable(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(comparable(v) for v in obj)
    return obj is None or isinstance(obj, (str, bytes, int))


# ---- the property -------------------------------------------------------------------------------
def _weighted_kinds() -> st.SearchStrategy[Kind]:
    return st.sampled_from([k for k, w in zip(KINDS, KIND_WEIGHTS) for _ in range(w)])


@settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_damaged_states_are_refused_cleanly_or_resumed(data: st.DataObject) -> None:
    kind = data.draw(_weighted_kinds(), label="kind")
    states = real_states(kind)
    i = data.draw(st.integers(0, len(states) - 1), label="state")
    mutated: Any = copy.deepcopy(states[i])
    touched: list[Path] = []
    for _ in range(data.draw(MUTATIONS, label="mutations")):
        mutated, where = mutate(mutated, data)
        touched += where
    variant = data.draw(st.sampled_from(["fresh", "after-load", "mid-epoch"]), label="variant")
    event(f"{kind.name}, {variant}")

    loader = kind.make(kind.workers)
    with loader, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        it = None
        if variant == "fresh":
            expected = reference(kind, -1)
        elif variant == "after-load":
            j = data.draw(st.integers(0, len(states) - 1), label="loaded first")
            loader.load_state_dict(copy.deepcopy(states[j]))
            expected = reference(kind, j)
        else:
            expected = reference(kind, -1)
            it = iter(loader)
            k = data.draw(st.integers(0, len(expected[0])), label="batches taken")
            for _ in range(k):
                next(it)
            expected = [expected[0][k:], expected[1]]
        before = loader.state_dict()
        try:
            loader.load_state_dict(copy.deepcopy(mutated))
        except CheckpointError:
            event("refused")
            assert loader.state_dict() == before, "a refused state changed state_dict()"
            assert batches(loader, it) == expected, "a refused state changed the batches"
            return
        # (Any other exception fails the test here: only CheckpointError may escape.)
        event("accepted")
        config = mutated.get("config") if isinstance(mutated, dict) else None
        if isinstance(config, dict) and config.get("batch_size") != before["config"]["batch_size"]:
            # Another batch size: the position is re-cut into this loader's batches, so the
            # state it gives back is in those terms -- and must load as itself.
            event("accepted: another batch size")
            again = loader.state_dict()
            with kind.make(kind.workers) as other:
                other.load_state_dict(copy.deepcopy(again))
                assert other.state_dict() == again, "a re-cut state does not load as itself"
        elif comparable(mutated):
            assert loader.state_dict() == mutated, "state_dict() is not the state just loaded"
        try:
            got = batches(loader)
        except Exception:
            if touches_user_state(kind, touched):
                event("accepted; the user's state raised")
                return
            raise
        if touches_user_state(kind, touched):
            return  # the user's sampler or dataset decides what its damaged state yields
        longest = max(len(e) for e in reference(kind, -1))
        assert all(len(epoch) <= longest for epoch in got), (
            f"an accepted state gave an epoch of {[len(e) for e in got]} batches; "
            f"an epoch has at most {longest}"
        )


# ---- values no state should hold: too deep, holding itself ---------------------------------------
def _nested(levels: int, kind: str) -> Any:
    root: Any = [] if kind == "list" else {}
    inner = root
    for _ in range(levels - 1):
        child: Any = [] if kind == "list" else {}
        if kind == "list":
            inner.append(child)
        else:
            inner["x"] = child
        inner = child
    return root


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_deep_and_self_holding_values_are_refused_naming_the_field(data: st.DataObject) -> None:
    """``torch.load(weights_only=True)`` builds these from a small file. The limit is exact:
    the codec's MAX_DEPTH, counted from the state itself; a value shared by several fields
    counts where it sits deepest; a state that holds itself is refused wherever it does."""
    from resumable_loader.state.codec import MAX_DEPTH

    kind = data.draw(_weighted_kinds(), label="kind")
    states = real_states(kind)
    state = copy.deepcopy(states[data.draw(st.integers(0, len(states) - 1), label="state")])
    where = data.draw(st.sampled_from([p for p in paths(state) if p]), label="path")
    poison = data.draw(st.sampled_from(["deep", "deep", "cycle", "ancestor"]), label="poison")
    if poison == "deep":
        levels = data.draw(
            st.integers(MAX_DEPTH - len(where) - 1, MAX_DEPTH - len(where) + 1)
            | st.integers(1, 3000),
            label="levels",
        )
        value = _nested(max(1, levels), data.draw(st.sampled_from(["list", "dict"])))
        too_deep = len(where) + max(1, levels) - 1 >= MAX_DEPTH
    else:
        # The root, or the container holding the value: a cycle either way.
        value = state if poison == "cycle" else get(state, where[:-1])
        too_deep = True
    put(state, where, value)
    loader = kind.make(0)
    with loader:
        before = loader.state_dict()
        try:
            loader.load_state_dict(state)
        except CheckpointError as exc:
            message = str(exc)
            nesting = "nested deeper than" in message or "holds itself" in message
            assert nesting == too_deep, message
            if too_deep and isinstance(where[0], str):
                assert where[0] in message, message
            assert loader.state_dict() == before, "a refused state changed state_dict()"
            return
        assert not too_deep, f"accepted a state with a {poison} value at {list(where)}"
