"""``skip_samples``: a loader state ``n`` samples further along its stream, reading nothing.

After a loss spike a job wants to go on *past* the samples that caused it, without loading
them. The position of a map-style loader is a sample cursor (``state.cursor``), so a skip is
arithmetic on the state, done offline -- on a checkpoint file, before any loader exists:

* built-in samplers (``shuffle=False/True``, a ``Mixture`` under them): the epoch's rest is
  cut ``n`` samples later (``sample_cut``); the next ``iter()`` starts there, with the loader's
  batch size. O(1) (O(holes) with batches delivered ahead).
* torch's ``DistributedSampler``: the job's global state (every rank's position) opens a level
  (``state.ranks``) for the ranks' consumed samples and one more of world size 1 that takes
  the next ``n`` samples of the global stream: any number of ranks then resumes after them.
  O(number of ranks + levels).
* a ``resumable_loader.Stream``: its position is one cursor per partition, and the next ``n``
  rows of its canonical order (by ``(pass, rows, partition)``) are water-filled onto the
  cursors' ``skip`` field, O(P log n). Nothing is read here; the worker that owns a partition
  draws its skipped rows at the next start and discards them (``plans.stream._Reader``): they
  are read, mapped and filtered, not collated or sent. See ``_skip_stream``.
* other streams, user batch samplers, stateful user samplers and replayed samplers: refused
  (see ``skip_samples``).

A skip stays inside the epoch the state is in: past its end, the next epoch's order would be
needed, and with it its seed (a ``DistributedSampler``'s epoch is set by the script), which a
state between epochs does not always pin down. It is recorded in ``skipped_samples`` as
``[epoch, samples of that epoch not left before it, count]``.
"""

from __future__ import annotations

import copy
import operator
import re
import warnings
from typing import Any

from ..core.errors import CheckpointError
from . import ranks as D
from . import schema as S
from .codec import clip_repr
from .cursor import Cut, check_cut
from .seeds import DIST_SEED, derive_seed

__all__ = ["skip_samples", "water_fill"]

_RANDOM = re.compile(r"random\(replacement=(True|False), num_samples=(\d+)\)")
_DIST = re.compile(r"distributed\(shuffle=(True|False), seed=(-?\d+), drop_last=(True|False)\)")


def skip_samples(state: dict[str, Any], n: int) -> dict[str, Any]:
    """A new loader state ``n`` samples further along the stream than ``state``; nothing is
    read or fetched for the samples skipped, and ``state`` is not changed.

    The loader that loads the result (with any batch size, and -- for a ``DistributedSampler``
    job's global state -- any number of ranks) delivers what the uninterrupted run would have
    delivered after those ``n`` samples. The skip is recorded in the state's
    ``skipped_samples`` (shown by ``python -m resumable_loader inspect``).

    Args:
        state: a ``DataLoader.state_dict()`` -- one loader's, or the job's global state (saved
            by ``torch.distributed.checkpoint``, or ``merge_rank_states``); for a
            ``DistributedSampler`` only the global state says where every rank stands.
        n: how many samples of the global stream to skip, ``>= 0``. A global state of ranks
            under another sampler than ``DistributedSampler`` (each rank iterates its own
            stream) skips ``n`` samples of each rank's stream: ``world_size * n`` in all.
            For a ``Stream``: ``n`` rows of its canonical order (``(pass, rows, partition)``),
            set as each partition cursor's ``skip``; the worker that reads a partition draws
            those rows at the next start and discards them (they are read, not delivered: the
            cost is reading them), and a partition that ends inside its skip ends there.

    Returns:
        The new state, of the same kind (one loader's, or global).

    Raises:
        TypeError: ``n`` is not an int.
        ValueError: ``n`` is negative.
        CheckpointError: the state is malformed; or its position cannot be moved without reading
            (an iterable dataset other than a ``Stream``, a user ``batch_sampler``, whose
            batches' size is its own, a sampler with its own ``state_dict()``, a sampler that is
            replayed, one rank's state under a ``DistributedSampler`` or of a ``Stream`` on
            several ranks, a ``DistributedSampler`` job between epochs, a ``Stream``'s state
            before its epoch's first batch); or fewer than ``n`` samples are left of its epoch
            (for a ``Stream``: no partition is left). The message says which and what to do.
    """
    if isinstance(n, bool):
        raise TypeError(f"skip_samples: n must be an int, not {n!r}")
    n = operator.index(n)
    if n < 0:
        raise ValueError(f"skip_samples: n must be >= 0, not {n}")
    if D.is_global(state):
        states = D.split_global(state)
        if _is_stream(states[0]):
            return D.merge_rank_states(_skip_stream(states, n))
        if all(_description(sd).startswith("distributed(") for sd in states):
            return D.merge_rank_states(_skip_distributed(states, n))
        # Other samplers: each rank iterates its own stream, and skips in it.
        return D.merge_rank_states([_skip_one(sd, n) for sd in states])
    if _is_stream(state):
        config = state.get(S.K_CONFIG)
        if not isinstance(config, dict):
            raise _fail(
                f"{S.K_CONFIG} is missing or not a dict, got {clip_repr(config)}: the state is "
                "damaged (a loader's state_dict() always has it)"
            )
        world = config.get("world_size")
        if world != 1:
            raise _fail(
                f"this is one rank's state of a Stream read by {clip_repr(world)} ranks, and a "
                "skip takes the next rows of the whole job's stream, whose cursors are in every "
                "rank's state. Skip the job's global state: the one "
                "torch.distributed.checkpoint saved, or merge_rank_states([the state of every "
                "rank])."
            )
        return _skip_stream([state], n)[0]
    return _skip_one(state, n)


def _fail(problem: str) -> CheckpointError:
    return CheckpointError(f"cannot skip samples: {problem}")


def _description(sd: Any) -> str:
    cfg = sd.get(S.K_CONFIG) if isinstance(sd, dict) else None
    sampler = cfg.get("sampler") if isinstance(cfg, dict) else None
    if not isinstance(sampler, str):
        raise _fail(
            f"config.sampler: expected the sampler's description (a str), got "
            f"{clip_repr(sampler)}. Pass a DataLoader.state_dict()."
        )
    return sampler


def _parse(sd: dict[str, Any]) -> S.ResumePoint:
    """Validate ``sd`` against its own config (what a loader built as it was would check)."""
    cfg = sd.get(S.K_CONFIG)
    fields = (*S.MUST_MATCH, "batch_size", "num_workers")
    if not isinstance(cfg, dict) or any(k not in cfg for k in fields):
        raise _fail(f"config: expected a dict with {list(fields)}; the state is damaged")
    return S.parse_state(sd, cfg, _description(sd).startswith("stateful:"))


def _epoch_samples(sd: dict[str, Any]) -> int:
    """The positions of one epoch of a built-in sampler, from the state's config."""
    desc = _description(sd)
    length = sd[S.K_CONFIG].get("dataset_len")
    if desc == "sequential":
        total = length
    elif (m := _RANDOM.fullmatch(desc)) is not None:
        total = int(m.group(2))
    else:
        kind = sd[S.K_CONFIG].get("dataset_kind")
        if kind == "iterable":
            why = (
                "the loader reads an iterable dataset, whose position is what each worker "
                "fetched: no sample can be passed over without reading it. Skip inside the "
                "dataset (its own state_dict()), iterate the loader past the samples, or read "
                "it as a resumable_loader.Stream, whose cursors a skip moves"
            )
        elif desc.startswith("distributed("):
            why = (
                "this is one rank's state under a DistributedSampler, and a skip moves the "
                "whole job's stream. Skip the job's global state: the one "
                "torch.distributed.checkpoint saved, or merge_rank_states([the state of "
                "every rank])"
            )
        elif desc.startswith("stateful:"):
            why = (
                f"the sampler ({desc}) keeps its own position in its state_dict(), which only "
                "it can move. Skip with the sampler itself, or use shuffle=True/False, a "
                "DistributedSampler or a Mixture, whose position is a sample cursor"
            )
        else:
            why = (
                f"the sampler ({desc}) is replayed from the epoch's start on resume, so its "
                "position is counted in batches of its own making. Use shuffle=True/False, a "
                "DistributedSampler or a Mixture, whose position is a sample cursor"
            )
        raise _fail(why + ".")
    if type(total) is not int or total < 0:
        raise _fail(f"config.dataset_len: expected an int, got {clip_repr(total)}")
    return total


def _skip_one(sd: dict[str, Any], n: int) -> dict[str, Any]:
    """One loader's state, built-in sampler: move the cut."""
    if not isinstance(sd, dict):
        raise _fail(f"expected a loader state (a dict), got {type(sd).__name__}")
    total, rp, cut = _position(sd)
    left = cut.left(total)
    if n > left:
        raise _fail(_past_end(n, left, rp.epoch))
    out = copy.deepcopy(sd)
    if n == 0:
        return out
    cut = cut.skip(total, n)
    out[S.K_VERSION] = S.VERSION
    out[S.K_CONSUMED] = 0
    out[S.K_AHEAD] = []
    out.pop(S.K_CUT, None)
    if not cut.is_trivial:
        out[S.K_CUT] = cut.to_state()
    out[S.K_SKIPPED_SAMPLES] = [*rp.skipped_samples, [rp.epoch, total - left, n]]
    return out


# The most samples ``uncut`` lists one by one as batches delivered ahead: each hole of a cut
# (a batch delivered ahead of the consumed prefix) becomes one id per sample. An honest state's
# holes are a few in-flight windows; a crafted one could name a hole of 2**62 samples.
MAX_UNCUT_AHEAD = 1 << 20


def uncut(sd: dict[str, Any]) -> dict[str, Any]:
    """The same position as ``sd`` (one loader's state under a built-in sampler, as
    ``skip_samples`` returns it) written without a ``sample_cut``: in batches of one sample
    (``config.batch_size`` 1), ``consumed`` the samples before the cut's start and
    ``delivered_ahead`` the samples of its holes. A loader re-cuts it to its own batch size, as
    it does any state saved with another one, and delivers the same samples.

    For a checkpoint that can hold only the keys it already had: a
    ``torch.distributed.checkpoint`` directory saved from ``{"loader": loader.state_dict()}``,
    which ``dcp.load`` fills from a fresh loader's keys, among which there is no cut.

    Raises:
        CheckpointError: what ``skip_samples`` refuses, or a cut whose holes hold more than
            ``MAX_UNCUT_AHEAD`` samples.
    """
    _, _, cut = _position(sd)
    if sum(count for _, count in cut.holes) > MAX_UNCUT_AHEAD:
        raise _fail(
            f"{S.K_CUT}: its holes hold more than {MAX_UNCUT_AHEAD} samples, too many to list "
            "as batches delivered ahead; the state is damaged"
        )
    out = copy.deepcopy(sd)
    out.pop(S.K_CUT, None)
    out[S.K_VERSION] = S.VERSION
    if out[S.K_CONFIG].get("batch_size") is not None:
        out[S.K_CONFIG]["batch_size"] = 1  # None (unbatched) already counts single samples
    out[S.K_CONSUMED] = cut.start
    out[S.K_AHEAD] = [p for first, count in cut.holes for p in range(first, first + count)]
    return out


def _position(sd: dict[str, Any]) -> tuple[int, S.ResumePoint, Cut]:
    """One loader's state under a built-in sampler: the epoch's samples, the parsed position,
    and the cut with the consumed batches and those delivered ahead folded in."""
    total = _epoch_samples(sd)
    rp = _parse(sd)
    per_task = _per_task(rp)
    # Checked against the epoch's length here: the parse alone cannot bound it, and advance()
    # on a cut past the end would clamp what is left to 0 instead of saying it is damaged.
    _, problem = check_cut(rp.cut.to_state() if rp.cut is not None else None, total)
    if problem is not None:
        raise _fail(f"{S.K_CUT}: {problem}; the state is damaged")
    drop_last = sd[S.K_CONFIG].get("drop_last") is True
    try:
        cut = (rp.cut or Cut()).advance(total, per_task, rp.consumed, rp.ahead, drop_last)
    except ValueError as e:
        raise _fail(f"{e}; the state is damaged") from None
    return total, rp, cut


def _per_task(rp: S.ResumePoint) -> int:
    """Samples per batch of the state's position; refused where a batch_sampler made them."""
    per_task = rp.per_task()
    if per_task is None:
        why = (
            "the loader's batches came from a batch_sampler passed to it"
            if rp.batch_sampler
            else "the state has batch_size=None and does not say whether a batch_sampler made "
            "its batches (it was written before that was recorded)"
        )
        raise _fail(
            f"{why}: its position counts batches of the batch sampler's making, whose size the "
            "state does not hold. Skip with the batch sampler itself, or build the loader with "
            "batch_size=... (shuffle=True/False, a DistributedSampler or a Mixture)."
        )
    return per_task


def _past_end(n: int, left: int, epoch: int) -> str:
    return (
        f"{n} samples asked, but only {left} are left of epoch {epoch}, and a skip stays within "
        f"the epoch the state is in. Skip {left} now; skip the rest from a state taken in the "
        "next epoch."
    )


def _skip_distributed(states: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The ranks' states of a DistributedSampler job, ``n`` samples later: a new level for what
    each rank consumed, and one of world size 1 taking the next ``n`` samples."""
    points = [_parse(sd) for sd in states]
    for p in points:
        # As a load reads them: a finished rank's sampler_epoch is the next epoch's.
        D.settle(p)
    desc = _description(states[0])
    m = _DIST.fullmatch(desc)
    total = states[0][S.K_CONFIG].get("dataset_len")
    if m is None or any(_description(sd) != desc for sd in states) or type(total) is not int:
        raise _fail(
            f"the ranks' states disagree on the sampler or the dataset ({clip_repr(desc)}); "
            "the state is damaged"
        )
    sampler_seed, drop_last = int(m.group(2)), m.group(3) == "True"
    if any(p.ahead for p in points):
        raise _fail(
            "delivered_ahead: a rank delivered batches ahead of its consumed prefix "
            "(in_order=False), which a skip of the global stream cannot pass over exactly. "
            "Take the checkpoint with in_order=True."
        )
    epoch = min(p.epoch for p in points)
    within = [p for p in points if p.epoch == epoch]
    done = [p for p in points if p.epoch != epoch]
    if any(p.epoch != epoch + 1 or p.consumed or p.history for p in done):
        raise _fail(
            f"the ranks' states are more than one batch apart (epochs "
            f"{sorted({p.epoch for p in points})}); take the checkpoint at a step all ranks "
            "reached."
        )
    started = [p for p in within if p.consumed or p.history]
    # A rank that delivered its whole share is in the next epoch already, but the job is not:
    # the ranks still inside the epoch say which epoch it is (docs/distributed.md, "the
    # finished ranks count as having taken their whole share").
    if not started and not done:
        raise _fail(
            "the job is between two epochs of its DistributedSampler, and a skip stays inside "
            "the epoch the state is in. Skip from a state taken after the first step of the "
            "next epoch (the one the script sets with sampler.set_epoch(); the docs' recipe "
            "sets the state's distributed.sampler_epoch)."
        )
    ref = (started or within)[0]
    if any((p.sampler_epoch, p.history) != (ref.sampler_epoch, ref.history) for p in within):
        raise _fail(
            "distributed: the ranks' states are from different epochs of the "
            "DistributedSampler; take the checkpoint at a step all ranks reached."
        )
    world = len(points)
    length = D.level_length(total, ref.history, drop_last)
    share = D.cut_length(length, world, drop_last) // world
    taken = [
        share if p.epoch != epoch else D.samples_taken(p.consumed, share, _per_task(p))
        for p in points
    ]
    # With nothing taken at this level it is not closed (below), so no drop_last trim to this
    # world size applies: all of it is left.
    left = D.remaining_length(length, world, taken, drop_last) if any(taken) else length
    if n > left:
        raise _fail(_past_end(n, left, epoch))
    if n == 0:
        return [copy.deepcopy(sd) for sd in states]
    # Nothing taken at the current level (a skip after a skip, or after a re-cut): no level
    # of zeros, whose drop_last trim to this world size would drop samples.
    history = [*ref.history, *([[world, taken]] if any(taken) else []), [1, [n]]]
    record = [epoch, total - left, n]
    out = []
    for r, (sd, p) in enumerate(zip(states, points)):
        new = copy.deepcopy(sd)
        new[S.K_VERSION] = S.VERSION
        new[S.K_EPOCH] = epoch
        new[S.K_CONSUMED] = 0
        new[S.K_AHEAD] = []
        # The seed the loader derives for this level (informative: a loader derives it again).
        new[S.K_SEED] = derive_seed(
            DIST_SEED, sampler_seed, ref.sampler_epoch, len(history), world, r
        )
        new[S.K_DIST] = {"sampler_epoch": ref.sampler_epoch, "history": history, "ended": False}
        new[S.K_SKIPPED_SAMPLES] = [*p.skipped_samples, record]
        out.append(new)
    return out


# ---- a Stream: the next rows of the canonical order, water-filled onto the cursors ----------
# A ``resumable_loader.Stream``'s position is one cursor per partition (``plans/streams.py``):
# a head ``[pass, done, rows, skip]`` and its chain's position. A reader draws from its live
# partition with the smallest ``(pass, rows, p)``, and a cursor's ``skip`` rows are drawn and
# discarded before the next delivered one (``rows`` counts them). So the canonical stream after
# a state continues at ``rows + skip`` of each partition, and the next ``n`` rows of it are
# found from the cursors alone: the lowest live pass takes them all (a pass's rows sort before
# the next pass's), and within it the partitions are filled up to one level ``L`` (each to row
# ``L``, the last level's rows to the lowest partitions). The arithmetic does not know how many
# rows a partition has left (that depends on the data): a partition that ends inside its skip
# ends there, its ``skip`` left over in its cursor (shown by ``inspect``), and the rows it
# could not give are not taken from other partitions.
#
# This module sits below ``plans`` (the state layer), so it reads the cursor's layout from the
# state's own ``stream.fields`` and repeats the two formulas it needs: which reader owns a
# partition (``plans.streams.owned``) and which cursor a reader starts a partition from
# (``Stream._cursors_for``). Were they to drift, a skipped state would put a cursor in a worker
# that does not read it, which the same-layout tests of tests/state/test_skip_stream.py load.
_STREAM_HEAD = ["pass", "done", "rows", "skip"]
_PASS, _DONE, _ROWS, _SKIP = range(4)
# The skip walks every partition (those without a cursor are at their pass's start), so a
# crafted header's count is bounded before that walk: far above any real shard list's.
MAX_STREAM_PARTITIONS = 1 << 24


def _is_stream(sd: Any) -> bool:
    """Whether ``sd`` is a loader state over a ``resumable_loader.Stream`` (its dataset
    record's class)."""
    record = sd.get(S.K_DATASET) if isinstance(sd, dict) else None
    return isinstance(record, dict) and record.get("class") == S.STREAM_CLASS


def _owned(parts: int, world: int, workers: int, rank: int, worker: int) -> list[int]:
    """The partitions reader (rank, worker) reads (``plans.streams.owned``): ``p mod W ==
    rank`` and ``(p div W) mod K == worker``, i.e. ``rank + W * worker`` every ``W * K``."""
    return list(range(rank + world * worker, parts, world * workers))


def _start_cursor(c: list[int] | None, epoch: int, width: int) -> list[int]:
    """The cursor a reader of loader epoch ``epoch`` starts a partition from
    (``Stream._cursors_for``): its own if in this pass, or in an earlier pass it has not
    finished (a carry), else the pass's start."""
    if c is not None and (c[_PASS] == epoch or (c[_PASS] < epoch and not c[_DONE])):
        return list(c)
    fresh = [0] * width
    fresh[_PASS] = epoch
    return fresh


def water_fill(keys: dict[int, tuple[int, int]], n: int) -> dict[int, int]:
    """How many of the next ``n`` rows of the canonical order each partition gives.

    Args:
        keys: each live partition's ``(pass, rows + skip)``: where its next row sorts.
        n: rows to take, ``>= 0``.

    Returns:
        ``{p: rows}`` for the partitions that give at least one; the counts sum to ``n`` (the
        arithmetic takes every partition as long enough; ``keys`` empty gives ``{}``).
    """
    if n == 0 or not keys:
        return {}
    low = min(e for e, _ in keys.values())
    level = {p: k for p, (e, k) in keys.items() if e == low}

    def below(top: int) -> int:  # rows the partitions give to reach row `top` (excluded)
        return sum(top - k for k in level.values() if k < top)

    # The highest level L all partitions below it can be filled to with at most n rows.
    lo, hi = min(level.values()), min(level.values()) + n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if below(mid) <= n:
            lo = mid
        else:
            hi = mid - 1
    out = {p: lo - k for p, k in level.items() if k < lo}
    # The rest: row L of the partitions that reach it, in partition order.
    rest = n - below(lo)
    for p in sorted(p for p, k in level.items() if k <= lo)[:rest]:
        out[p] = out.get(p, 0) + 1
    return out


def _stream_meta(states: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The first worker state's ``stream`` header and its fields, checked for what the skip
    reads (the Stream checks the rest when it loads the state)."""
    for r, sd in enumerate(states):
        for i, w in enumerate(sd[S.K_WORKERS]):
            ds = w.get("dataset_state")
            if ds is None:
                continue
            where = f"ranks[{r}]." * (len(states) > 1) + f"{S.K_WORKERS}[{i}].dataset_state"
            meta = ds.get("stream") if isinstance(ds, dict) else None
            if not isinstance(meta, dict):
                raise _fail(f"{where}: not a Stream's state (no 'stream' header); it is damaged")
            fields, parts = meta.get("fields"), meta.get("partitions")
            if (
                not isinstance(fields, list)
                or fields[: len(_STREAM_HEAD)] != _STREAM_HEAD
                or type(parts) is not int
                or not 1 <= parts <= MAX_STREAM_PARTITIONS
            ):
                raise _fail(
                    f"{where}.stream: expected partitions (an int in 1..{MAX_STREAM_PARTITIONS}) "
                    "and fields starting "
                    f"with {_STREAM_HEAD}, got {clip_repr(parts)} and {clip_repr(fields)}; the "
                    "state is damaged, or from a newer version"
                )
            return meta, fields
    raise _fail(
        "no worker has delivered a batch of this epoch yet, so the state holds no partition "
        "cursors (nor the Stream's plan, which comes with them). Skip from a state taken after "
        "the first batch of the epoch."
    )


def _skip_stream(states: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """Every rank's state of a Stream's job (one, for a single process), ``n`` rows of the
    canonical order later: each partition's share is added to its cursor's ``skip``."""
    points = [_parse(sd) for sd in states]
    epochs = {p.epoch for p in points}
    if len(epochs) > 1:
        raise _fail(
            f"the ranks' states are in epochs {[p.epoch for p in points]}; take the checkpoint "
            "at a step all ranks reached."
        )
    epoch = points[0].epoch
    world = len(states)
    nw = [sd[S.K_CONFIG].get("num_workers") for sd in states]
    k = nw[0]
    if type(k) is not int or k < 0 or any(x != k for x in nw):
        raise _fail(f"config.num_workers: the ranks' states disagree ({clip_repr(nw)})")
    k = max(k, 1)
    meta, fields = _stream_meta(states)
    parts = meta["partitions"]
    if parts % (world * k):
        raise _fail(
            f"the Stream's {parts} partitions are not divided by the state's {world} ranks x "
            f"{k} workers; the state is damaged"
        )
    table, ended = _stream_table(points, world, k, parts, fields)
    start = {p: _start_cursor(table.get(p), epoch, len(fields)) for p in range(parts)}
    live = {
        p: (c[_PASS], c[_ROWS] + c[_SKIP])
        for p, c in start.items()
        if p not in ended and not c[_DONE] and c[_PASS] <= epoch
    }
    if n and not live:
        raise _fail(
            f"every partition of epoch {epoch} has ended: nothing is left of it, and a skip "
            "stays within the epoch the state is in. Skip from a state taken in the next epoch."
        )
    share = water_fill(live, n)
    out = [copy.deepcopy(sd) for sd in states]
    if n == 0:
        return out
    warnings.warn(
        f"skip_samples: a Stream's {n} skipped rows are read, not delivered: the worker "
        f"that owns each of the {len(share)} partitions concerned reads its share (and the "
        "samples its filters drop among them) at the next start, before its first batch",
        RuntimeWarning,
        stacklevel=3,
    )
    before = sum(c[_ROWS] + c[_SKIP] for c in start.values() if c[_PASS] == epoch)
    for r, (new, rp) in enumerate(zip(out, points)):
        for i, w in enumerate(new[S.K_WORKERS]):
            mine = _owned(parts, world, k, r, i)
            if not any(p in share for p in mine):
                continue
            ds = w.get("dataset_state")
            if ds is None:
                # Nothing delivered yet by this worker: its state starts here, with every
                # partition it reads (a Stream refuses a state that lacks one).
                head = copy.deepcopy(meta)
                head["layout"] = {"world_size": world, "rank": r, "num_workers": k, "worker": i}
                ds = w["dataset_state"] = {"stream": head}
                w["state_at"] = w["delivered"]
            for p in mine:
                if p in share:
                    c = ds[p] = start[p]
                    c[_SKIP] += share[p]
                elif p not in ds:
                    ds[p] = start[p]
        new[S.K_VERSION] = S.VERSION
        new[S.K_SKIPPED_SAMPLES] = [*rp.skipped_samples, [epoch, before, n]]
    return out


def _stream_table(
    points: list[S.ResumePoint], world: int, k: int, parts: int, fields: list[str]
) -> tuple[dict[int, list[int]], set[int]]:
    """Every worker's cursors as one table, and the partitions of workers whose reader ran
    dry this epoch (it starts nothing more in it, and its END carried no cursors, so they may
    look unfinished). Each cursor is checked for what the skip reads."""
    table: dict[int, list[int]] = {}
    ended: set[int] = set()
    for r, rp in enumerate(points):
        if len(rp.workers) != k:
            raise _fail(f"{S.K_WORKERS}: {len(rp.workers)} entries for {k} workers; damaged")
        for i, w in enumerate(rp.workers):
            where = f"ranks[{r}]." * (world > 1) + f"{S.K_WORKERS}[{i}]"
            mine = _owned(parts, world, k, r, i)
            reads = set(mine)
            if w.exhausted:
                ended.update(mine)
            if w.delivered and (w.dataset_state is None or w.state_at != w.delivered):
                raise _fail(
                    f"{where}.state_at: the worker's Stream state is from fetch "
                    f"{w.state_at if w.dataset_state is not None else 0} of the {w.delivered} "
                    "it delivered, so its cursors are behind its position (only a replay "
                    "reaches it). Take the checkpoint with stream_state_every=1, the default "
                    "for a Stream."
                )
            ds = w.dataset_state
            if ds is None:
                continue
            if not isinstance(ds, dict) or not isinstance(ds.get("stream"), dict):
                raise _fail(f"{where}.dataset_state: not a Stream's state; it is damaged")
            for p, c in ds.items():
                if p != "stream":
                    table[p] = _checked_cursor(p, c, reads, fields, where)
    return table, ended


def _checked_cursor(p: Any, c: Any, mine: set[int], fields: list[str], where: str) -> list[int]:
    if type(p) is not int or p not in mine:
        raise _fail(
            f"{where}.dataset_state: key {clip_repr(p)} is not one of the partitions this "
            f"worker reads ({clip_repr(sorted(mine))}); the state is damaged"
        )
    if (
        not isinstance(c, list)
        or len(c) != len(fields)
        or not all(type(v) is int and v >= 0 for v in c)
        or c[_DONE] > 1
    ):
        raise _fail(
            f"{where}.dataset_state: partition {p} must be a cursor of {len(fields)} ints >= 0 "
            f"({fields}), got {clip_repr(c)}; the state is damaged"
        )
    return c
