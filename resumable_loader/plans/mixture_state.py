"""A ``Mixture``'s plan as plain data: its format, its validation against the sources, and a
load planned without touching the mixture.

A saved plan is read in two halves, so that a refused state changes nothing by construction:
``plan_load`` validates a state against a frozen record of the mixture's sources (``Sources``)
and builds the segments and rests it would install (``PlanLoad``), or raises
``CheckpointError``; ``Mixture.apply_load`` installs that, and cannot fail. The loader plans a
Mixture's load together with the rest of its resume (``loader/resume.py``).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple

from ..core.errors import CheckpointError
from ..state import fingerprint as F
from ..state.codec import clip_repr
from .interleave import Rest, Segment, build_plan, check_weights
from .samplers import check_order

STATE_KIND = "resumable_loader.Mixture"
# Version 2 adds "rests" (weights changed inside a shuffled epoch, keyed by the sampler's order).
# A plan without them is still written as version 1, so that a library that reads only version 1
# keeps loading every plan it can serve; one with them must not be read by it (it would ignore
# them and serve the old weights).
STATE_VERSION = 2
READS = (1, 2)
STATE_KEYS = ("kind", "version", "seed", "num_samples", "epoch", "sources", "weights")
REST_KEYS = {"epoch", "length", "order", "from", "weights"}


class RestAt(NamedTuple):
    """Where new weights begin inside epoch ``epoch`` of a shuffling sampler: at place
    ``start`` (``0 < start < len``) of the epoch's order ``order`` (see ``interleave.Rest``)."""

    epoch: int
    start: int
    order: dict[str, Any]


@dataclass(frozen=True)
class Sources:
    """What a saved plan is checked against: the mixture's source names (sorted), their
    lengths and ``fingerprint()`` results as taken when it was built, and ``num_samples``."""

    names: tuple[str, ...]
    lengths: tuple[int, ...]
    fingerprints: tuple[str | None, ...]
    num_samples: int


@dataclass(frozen=True)
class PlanLoad:
    """A Mixture plan load, validated and built but not installed (``plan_load``): the seed,
    epoch, segments and rests to install, the data changes found, whether new weights were
    applied, and -- ``kept`` -- the warning that the checkpoint's weights were kept (only for
    a load without a resume point)."""

    seed: int
    epoch: int
    segments: list[Segment]
    rests: dict[int, list[Rest]]
    changes: tuple[str, ...]
    applied: bool
    kept: str | None


# ---- parsing ----------------------------------------------------------------------------
def parse_plan(
    state: Any, record: Sources, check_num_samples: bool
) -> tuple[int, int, list[tuple[int, Any]], list[str], list[tuple[int, Any, int, Any]]]:
    """Validate ``state`` against the sources of ``record``; nothing is changed. Returns its
    seed, epoch, segments, how the sources (and ``num_samples``, when
    ``check_num_samples``) differ from the checkpoint's, and its rests."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"a Mixture state is a dict, not {type(state).__name__}")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"not a Mixture state: missing keys {missing}")
    if state["kind"] != STATE_KIND:
        raise CheckpointError(f"not a Mixture state: kind is {state['kind']!r}")
    if state["version"] not in READS or isinstance(state["version"], bool):
        raise CheckpointError(
            f"Mixture state version {state['version']!r}; this resumable_loader reads "
            f"versions {list(READS)}. Resume with the version that saved it."
        )
    changes = source_changes(state["sources"], record)
    try:
        seed = check_int("seed", state["seed"], 0, 1 << 64)
        epoch = check_int("epoch", state["epoch"], 0, None)
        num_samples = check_int("num_samples", state["num_samples"], 1, None)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"bad Mixture state: {e}") from None
    if num_samples != record.num_samples and check_num_samples:
        changes.append(
            f"the checkpoint's Mixture has num_samples={num_samples}, this one "
            f"{record.num_samples} (global positions fall in other epochs; build it with "
            f"num_samples={num_samples} to keep them)"
        )
    history = state["weights"]
    if not isinstance(history, list) or not history:
        raise CheckpointError("bad Mixture state: 'weights' must be a non-empty list")
    segments: list[tuple[int, Any]] = []
    for j, seg in enumerate(history):
        if not isinstance(seg, Mapping) or set(seg) != {"from", "weights"}:
            raise CheckpointError(f"bad Mixture state: weights[{j}] is {clip_repr(seg)}")
        start = seg["from"]
        earlier = segments[-1][0] if segments else -1
        if not is_int(start) or start <= earlier or (j == 0 and start != 0):
            raise CheckpointError(
                f"bad Mixture state: weights[{j}] starts at {start!r}; the segments must "
                "start at 0 and at increasing positions"
            )
        try:
            check_weights(seg["weights"], record.names)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"bad Mixture state: weights[{j}]: {e}") from None
        segments.append((start, seg["weights"]))
    return seed, epoch, segments, changes, parse_rests(state, record)


def parse_rests(state: Mapping[str, Any], record: Sources) -> list[tuple[int, Any, int, Any]]:
    """A state's ``rests`` (version 2), validated: ``(epoch, order, start, weights)``."""
    raw = state.get("rests")
    if raw is None:
        return []
    if state["version"] == 1 or not isinstance(raw, list):
        raise CheckpointError(f"bad Mixture state: 'rests' is {clip_repr(raw)}")
    rests: list[tuple[int, Any, int, Any]] = []
    for j, r in enumerate(raw):
        ok = isinstance(r, Mapping) and set(r) == REST_KEYS
        if ok:
            e, length, at = r["epoch"], r["length"], r["from"]
            ok = is_int(e) and e >= 0 and is_int(length) and is_int(at)
        if not ok:
            raise CheckpointError(f"bad Mixture state: rests[{j}] is {clip_repr(r)}")
        if length != record.num_samples:
            raise CheckpointError(
                f"the checkpoint's Mixture changed its weights inside epoch {e} of "
                f"{length} positions (a shuffled epoch, keyed by its order); this one has "
                f"num_samples={record.num_samples}. Build it with num_samples={length}."
            )
        problem = check_order(r["order"])
        if not 0 < at < length or problem is not None:
            raise CheckpointError(
                f"bad Mixture state: rests[{j}]: "
                f"{problem or f'from is {at}, not inside the epoch (0, {length})'}"
            )
        if rests and (rests[-1][0], rests[-1][2]) >= (e, at):
            raise CheckpointError(f"bad Mixture state: rests[{j}] is out of order")
        if rests and rests[-1][0] == e and rests[-1][1] != r["order"]:
            raise CheckpointError(f"bad Mixture state: rests[{j}]: one epoch, two orders")
        try:
            check_weights(r["weights"], record.names)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"bad Mixture state: rests[{j}]: {exc}") from None
        rests.append((e, dict(r["order"]), at, r["weights"]))
    return rests


def source_changes(saved: Any, record: Sources) -> list[str]:
    """How each source of ``record`` differs from the checkpoint's (length, fingerprint), one
    line each.

    Raises:
        CheckpointError: malformed, or sources added or removed.
    """
    if not isinstance(saved, list) or not all(
        isinstance(s, Mapping)
        and {"name", "length", "fingerprint"} <= set(s)
        # Typed before they are hashed or compared: a damaged file may hold a list or an
        # array there, whose hash raises and whose == is elementwise.
        and type(s["name"]) is str
        and type(s["length"]) is int
        and (s["fingerprint"] is None or type(s["fingerprint"]) is str)
        for s in saved
    ):
        raise CheckpointError(f"bad Mixture state: 'sources' is {clip_repr(saved)}")
    theirs = {s["name"]: s for s in saved}
    added = [n for n in record.names if n not in theirs]
    removed = sorted(n for n in theirs if n not in record.names)
    if added or removed:
        change = []
        if added:
            change.append(f"{added} added")
        if removed:
            change.append(f"{removed} removed")
        raise CheckpointError(
            f"the Mixture's sources changed since the checkpoint: {' and '.join(change)} "
            f"(checkpoint: {sorted(theirs)}, now: {list(record.names)}). Resume with the "
            "checkpoint's sources; set a source's weight to 0 to stop drawing from it "
            "(on_dataset_change='continue' does not apply: the weights name the sources)."
        )
    changes = []
    for n, length, fp in zip(record.names, record.lengths, record.fingerprints):
        if theirs[n]["length"] != length:
            changes.append(
                f"source {n!r} had {clip_repr(theirs[n]['length'])} items in the "
                f"checkpoint, now {length} (its passes draw other items)"
            )
        if theirs[n]["fingerprint"] != fp:
            changes.append(
                f"source {n!r} has fingerprint {clip_repr(fp, 120)}, the checkpoint "
                f"{clip_repr(theirs[n]['fingerprint'], 120)}"
            )
    return changes


# ---- planning a load --------------------------------------------------------------------
def plan_load(
    state: Any,
    record: Sources,
    own: Mapping[str, int | float],
    resume: int | RestAt | str | None,
    changes_ok: bool,
    *,
    check_num_samples: bool,
) -> PlanLoad:
    """The pure half of a load: validate ``state`` and build the plan it gives the mixture of
    ``record`` whose newest weights are ``own``, changing nothing (``Mixture.apply_load``
    installs it). What changed in the data is allowed when
    ``changes_ok``, else refused. New weights (this mixture's, when they are not the
    checkpoint's newest) apply from ``resume``: a global position, a place in a shuffled
    epoch's order (``RestAt``), or -- a str -- nowhere: the reason they cannot."""
    seed, epoch, segments, changes, rests = parse_plan(state, record, check_num_samples)
    if changes and not changes_ok:
        raise F.changed_error(changes, "Mixture")
    own_weights, own_fracs = check_weights(own, record.names)
    specs = [(start, *check_weights(w, record.names)) for start, w in segments]
    rest_specs = [(e, order, at, *check_weights(w, record.names)) for e, order, at, w in rests]
    theirs = specs[-1][1]
    applied = False
    kept = None
    if not same_ratios(own_fracs, specs[-1][2]):
        new = (own_weights, own_fracs)
        if isinstance(resume, str):
            raise CheckpointError(
                f"this Mixture was built with weights {own_weights}, the checkpoint has "
                f"{theirs}, and they cannot apply from the resume point: {resume}. Build "
                f"the Mixture with the checkpoint's weights {theirs} to resume, then call "
                "mix.set_weights(new_weights, from_position=(epoch + 1) * len(mix)) to "
                "change them from the next epoch."
            )
        applied = resume is not None
        if isinstance(resume, RestAt):
            specs, rest_specs = with_rest(specs, rest_specs, resume, new, record.num_samples)
        elif resume is not None:
            try:
                resume = check_int("resume_at", resume, 0, None)
            except (TypeError, ValueError) as e:
                raise CheckpointError(str(e)) from None
            if resume < specs[-1][0]:
                raise CheckpointError(
                    f"the new weights {own_weights} cannot apply from global position "
                    f"{resume}: the checkpoint's weights {theirs} apply from "
                    f"{specs[-1][0]} on. Pass the position of the first unconsumed sample."
                )
            keep = specs[:-1] if resume == specs[-1][0] else specs
            specs = [*keep, (resume, *new)]
        else:
            kept = (
                f"this Mixture was built with weights {own_weights}, the checkpoint has "
                f"{theirs}: kept the checkpoint's. To change them at the resume, pass "
                "load_state_dict(state, resume_at=<first unconsumed global position>) or "
                "call set_weights() after loading."
            )
    built, built_rests = build_plan(specs, rest_specs, seed, record.num_samples)
    return PlanLoad(seed, epoch, built, built_rests, tuple(changes), applied, kept)


def with_rest(
    specs: list[Any], rest_specs: list[Any], at: RestAt, new: tuple[Any, Any], num_samples: int
) -> tuple[list[Any], list[Any]]:
    """The plan's specs with ``new`` weights from place ``at.start`` of epoch ``at.epoch``'s
    order on, and from the next epoch's first position on."""
    end = (at.epoch + 1) * num_samples
    if specs[-1][0] > end:
        raise CheckpointError(
            f"the new weights {new[0]} cannot apply inside epoch {at.epoch}: the checkpoint "
            f"schedules weights {specs[-1][1]} from global position {specs[-1][0]} on, "
            "after that epoch. Build the Mixture with the checkpoint's weights to resume."
        )
    keep = specs[:-1] if specs[-1][0] == end else specs
    earlier = []
    for r in rest_specs:
        if r[0] == at.epoch and r[1] != at.order:
            raise CheckpointError(
                f"the checkpoint changed the weights inside epoch {at.epoch} under the "
                f"sampler order {r[1]}, this loader's order is {at.order}: build the "
                "sampler as the checkpoint's was (its seed, shuffle and generator)."
            )
        if r[0] == at.epoch and r[2] > at.start:
            raise CheckpointError(
                f"the new weights {new[0]} cannot apply from place {at.start} of epoch "
                f"{at.epoch}: the checkpoint's weights {r[3]} apply from place {r[2]} on."
            )
        if r[0] != at.epoch or r[2] < at.start:
            earlier.append(r)
    return [*keep, (end, *new)], [*earlier, (at.epoch, at.order, at.start, *new)]


# ---- small checks -----------------------------------------------------------------------
def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_int(what: str, value: Any, low: int, high: int | None) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, not {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, not {value!r}") from None
    if v < low or (high is not None and v >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{what} must be {bound}, not {v}")
    return v


def same_ratios(a: tuple[Fraction, ...], b: tuple[Fraction, ...]) -> bool:
    sa, sb = sum(a), sum(b)
    return all(x * sb == y * sa for x, y in zip(a, b))
