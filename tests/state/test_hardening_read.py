"""Malformed states from files: ``load_state_dict`` refuses each with a CheckpointError that
names the field (``_schema.parse_state``'s nesting check, ``_distributed.split_global``), never
another exception from the value itself. The codec's bounds are in test_codec.py, ``inspect``'s
in test_cli.py, ``save_checkpoint`` in test_checkpoint.py."""

from __future__ import annotations

import io
import sys
from typing import Any

import pytest
import torch

from resumable_loader import CheckpointError, DataLoader, dump_state, merge_rank_states
from resumable_loader.state.codec import MAX_DEPTH


def _nested(levels: int) -> list[Any]:
    """``[[...[]...]]``: ``levels`` lists."""
    root: list[Any] = []
    inner = root
    for _ in range(levels - 1):
        inner.append([])
        inner = inner[0]
    return root


def _through_torch_file(obj: Any) -> Any:
    """``obj`` as ``torch.load(weights_only=True)`` reads it back from a ``torch.save`` file.

    torch.save pickles recursively, so writing a 3,000-deep value needs a higher recursion
    limit; reading it does not (torch's restricted unpickler is iterative): a file can hold
    what our code could never have written."""
    buf = io.BytesIO()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        torch.save(obj, buf)
    finally:
        sys.setrecursionlimit(limit)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _loader() -> DataLoader:
    return DataLoader(list(range(10)), batch_size=2, shuffle=True)


@pytest.mark.parametrize(
    ("where", "field"),
    [
        (("seed",), "seed"),
        (("format",), "format"),
        (("delivered_ahead",), "delivered_ahead"),
        (("config", "dataset_len"), "config.dataset_len"),
        (("stats",), "stats"),  # a key the schema does not know
    ],
)
def test_a_3000_deep_value_from_torch_load_is_a_checkpoint_error_naming_the_field(
    where: tuple[str, ...], field: str
) -> None:
    loader = _loader()
    before = loader.state_dict()
    state = loader.state_dict()
    target = state
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = _nested(3000)
    loaded = _through_torch_file(state)
    with pytest.raises(CheckpointError, match=f"state: {field}.*: nested deeper than {MAX_DEPTH}"):
        loader.load_state_dict(loaded)
    assert loader.state_dict() == before  # the loader was left as it was


def test_nesting_counts_shared_values_at_every_place_they_appear() -> None:
    # One list shared by two fields: fine where it is shallow, too deep where it is not.
    loader = _loader()
    state = loader.state_dict()
    shared = _nested(MAX_DEPTH - 2)
    state["a"] = shared
    state["b"] = {"c": {"d": shared}}
    with pytest.raises(CheckpointError, match=r"b\.c\.d: nested deeper"):
        loader.load_state_dict(state)
    del state["b"]
    loader.load_state_dict(state)  # its deepest list at depth MAX_DEPTH - 2: within the limit
    # The codec agrees on where the limit is.
    dump_state(state)
    state["b"] = {"c": {"d": shared}}
    with pytest.raises(CheckpointError, match="nested deeper"):
        dump_state(state)


def test_a_deeply_nested_dict_key_is_a_checkpoint_error() -> None:
    key: tuple[Any, ...] = ()
    for _ in range(3000):
        key = (key,)
    loader = _loader()
    state = loader.state_dict()
    state["stats"] = {key: 1}
    with pytest.raises(CheckpointError, match=r"state: stats\[.*nested deeper than"):
        loader.load_state_dict(_through_torch_file(state))


def test_a_state_that_holds_itself_is_a_checkpoint_error() -> None:
    loader = _loader()
    state = loader.state_dict()
    state["config"]["loop"] = [state]
    with pytest.raises(CheckpointError, match=r"config\.loop\[0\]: the state holds itself"):
        loader.load_state_dict(_through_torch_file(state))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("version", torch.tensor([1, 2])),
        ("version", torch.tensor(1)),
        ("version", _nested(3000)),
        ("world_size", torch.tensor(1)),
        ("ranks", [torch.tensor([1, 2])]),
        ("ranks", ["not base64!"]),
    ],
)
def test_a_damaged_global_state_is_a_checkpoint_error_naming_the_field(
    field: str, value: Any
) -> None:
    loader = _loader()
    state = merge_rank_states([loader.state_dict()])
    state[field] = value
    with pytest.raises(CheckpointError, match=f"cannot load DataLoader state: {field}"):
        loader.load_state_dict(state)
