"""Loader states at a sample position of their epoch, for replica-group training (issue #34).

A job under torchft has one position: the committed prefix ``[0, c)`` of the current epoch's
order. It is kept as a plain built-in loader state (``state.schema``) whose ``sample_cut``
starts at ``c`` with no holes and whose ``consumed`` is 0 -- the form ``skip_samples`` and a
resume with another batch size produce -- so any plain ``DataLoader`` can load it and continue
at sample ``c``. These helpers read and write that position without touching the rest of the
state (seed, seed chain, data plan, dataset record).
"""

from __future__ import annotations

import copy
from typing import Any

from .cursor import Cut

__all__ = ["cut_state", "position_of", "state_at"]


def position_of(state: dict[str, Any], per_task: int) -> int | None:
    """The committed sample position of a built-in state with nothing delivered ahead, or
    None when it has holes or batches delivered ahead (not a plain prefix)."""
    if state.get("delivered_ahead"):
        return None
    raw = state.get("sample_cut")
    consumed = int(state.get("consumed", 0))
    if raw is None:
        return consumed * per_task
    if raw.get("holes"):
        return None
    return int(raw["start"]) + consumed * per_task


def cut_state(state: dict[str, Any], cut: Cut) -> dict[str, Any]:
    """``state`` (a copy) with its epoch's rest set to ``cut``, nothing consumed of it."""
    out = copy.deepcopy(state)
    out["consumed"] = 0
    out["delivered_ahead"] = []
    out["sample_cut"] = cut.to_state()
    return out


def state_at(state: dict[str, Any], start: int) -> dict[str, Any]:
    """``state`` (a copy) at sample position ``start`` of the same epoch: ``[0, start)``
    consumed, the rest to come in order."""
    return cut_state(state, Cut(start))
