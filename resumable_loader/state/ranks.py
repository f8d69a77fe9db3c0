"""Ranks: torch's DistributedSampler as a built-in sampler, global states, elastic resume.

**The global order.** With ``DistributedSampler(ds, num_replicas=W, rank=r, shuffle, seed,
drop_last)`` an epoch's order ``P`` depends only on (seed, sampler epoch, len(ds)): a
permutation (or ``range``). torch cuts it for W ranks -- padded by repeating its head up to a
multiple of W, or (``drop_last``) trimmed down to one -- and rank r takes positions
r, r + W, r + 2W, ... So after every rank has consumed c samples, the consumed positions are
exactly ``P[:c * W]``: a prefix, whatever W is.

**A level** is one world size's cut of a sequence. An epoch starts at level 0: the sequence is
``P`` and the cut is torch's own, so a rank's indices equal ``list(sampler)``. A resume on W'
ranks from a state saved by W ranks opens the next level: its sequence is what the previous
level left unconsumed -- every position of the previous cut, minus those each rank consumed
(each rank's own count: ranks out of step are honoured, not rounded), minus the padding (those
samples were repeats) -- in order, and W' ranks cut it as torch cuts an epoch. The state keeps
the levels' history ``[[W, [samples consumed by each rank]], ...]``, so any number of resizes in
one epoch compose. The only samples repeated or dropped beyond what the uninterrupted run
repeats or drops (``drop_last``: the first cut's trimmed tail; ``DataLoader(drop_last=True)``:
incomplete last batches) are those torch's own rule gives at the end of the remaining sequence
(fewer than W'); the resume then warns with the epoch's whole account (``epoch_account``).

**Global state.** ``dcp.save`` calls ``state_dict()`` on every rank and keeps one copy of each
key; ``dcp.load`` asks ``state_dict()`` for the keys to read. So inside DCP the loader returns
the *global* state -- every rank's own state, gathered, the same on every rank under the same
fixed keys -- which any world size can read. Elsewhere ``state_dict()`` stays the rank's own
(no collective: rank 0 alone may call it for ``torch.save``), and ``merge_rank_states`` turns
the per-rank states of all ranks into the global one.
"""

from __future__ import annotations

import base64
import math
import sys
from typing import Any

import numpy as np
import torch
from torch.utils.data.distributed import DistributedSampler

from ..core.errors import CheckpointError
from .codec import clip_repr, dump_state, load_state
from .seeds import DIST_SEED, derive_seed

GLOBAL_FORMAT = "resumable_loader.DataLoader.global"
GLOBAL_VERSION = 1


def is_torch_distributed_sampler(sampler: Any) -> bool:
    """torch's DistributedSampler, or a subclass that keeps its order (same ``__iter__``)."""
    return (
        isinstance(sampler, DistributedSampler)
        and type(sampler).__iter__ is DistributedSampler.__iter__
    )


def epoch_order(sampler: DistributedSampler, sampler_epoch: int) -> np.ndarray:
    """The epoch's order P, before torch's cut for the ranks (as DistributedSampler makes it)."""
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if sampler.shuffle:
        g = torch.Generator()
        g.manual_seed(sampler.seed + sampler_epoch)
        return torch.randperm(n, generator=g).numpy()
    return np.arange(n, dtype=np.int64)


def cut_length(n: int, world: int, drop_last: bool) -> int:
    """How many positions torch's cut of ``n`` for ``world`` ranks has (padded or trimmed)."""
    if drop_last:
        return (n // world) * world
    return math.ceil(n / world) * world


def rank_share(seq: np.ndarray, world: int, rank: int, drop_last: bool) -> np.ndarray:
    """Rank ``rank``'s positions of torch's cut of ``seq`` for ``world`` ranks."""
    total = cut_length(len(seq), world, drop_last)
    if total > len(seq):
        if len(seq) == 0:
            return seq
        reps = math.ceil(total / len(seq))
        seq = np.tile(seq, reps)[:total]
    return seq[rank:total:world]


def remaining(seq: np.ndarray, world: int, consumed: list[int], drop_last: bool) -> np.ndarray:
    """What a level leaves: ``seq``'s cut positions no rank consumed, padding excluded.

    ``consumed[r]`` is how many samples rank r took from its share (its first ones).
    """
    total = min(len(seq), cut_length(len(seq), world, drop_last))
    taken = np.zeros(total, dtype=bool)
    for r, c in enumerate(consumed):
        taken[r : min(total, c * world + r) : world] = True
    return seq[:total][~taken]


def level_sequence(order: np.ndarray, history: list[Any], drop_last: bool) -> np.ndarray:
    """The sequence of the current level, after the levels in ``history``."""
    seq = order
    for world, consumed in history:
        seq = remaining(seq, world, consumed, drop_last)
    return seq


def remaining_length(length: int, world: int, consumed: list[int], drop_last: bool) -> int:
    """``len(remaining(seq, ...))`` for a ``seq`` of ``length``, without the sequence."""
    total = min(length, cut_length(length, world, drop_last))
    taken = sum(min(c, max(0, -(-(total - r) // world))) for r, c in enumerate(consumed))
    return total - taken


def level_length(length: int, history: list[Any], drop_last: bool) -> int:
    """``len(level_sequence(order, ...))`` for an ``order`` of ``length``, without it."""
    for world, consumed in history:
        length = remaining_length(length, world, consumed, drop_last)
    return length


def samples_taken(tasks: int, share: int, batch_size: int | None) -> int:
    """Samples a rank consumed with ``tasks`` batches of its share of ``share`` samples."""
    return min(share, tasks * (batch_size or 1))


# ---- between two epochs ---------------------------------------------------------------------
# The script, not the loader, sets a DistributedSampler's epoch. A state between two epochs
# says which epoch comes next as a script that calls ``set_epoch(epoch)`` before each epoch
# sets it -- the documented recipe reads ``state["distributed"]["sampler_epoch"]`` -- so right
# after an epoch's end it is the one after, as ``state["epoch"]`` is. ``ended`` records that
# the sampler itself still holds the epoch that ended: a load puts that back, so a script that
# never calls ``set_epoch()`` goes on iterating the same epoch, as it did uninterrupted.
def next_sampler_epoch(current: int, ended: int | None) -> tuple[int, bool]:
    """``(sampler_epoch, ended)`` of a state between two epochs: ``current`` is the
    sampler's epoch now; ``ended`` the sampler epoch that was just delivered to its end (None:
    none was, since the loader was built or loaded)."""
    if ended is not None and current == ended:
        return current + 1, True
    # set_epoch() already chose the next one (or no epoch ran): that is what comes next.
    return current, False


def begun(rp: Any) -> bool:
    """Whether the position is inside an epoch (its seed drawn, or something consumed)."""
    return rp.seed is not None or bool(rp.consumed or rp.ahead or rp.history)


def settle(rp: Any) -> None:
    """Check ``ended`` of a state read, and give states written before it was recorded one.

    Those wrote the sampler's own epoch between epochs: right after an epoch's end, the one
    that ended, so the recipe trained it again. With ``set_epoch(epoch)`` per epoch from 0, as
    the docs' recipe does, that state's ``epoch`` (the loader's count of epochs) is one more
    than its sampler epoch; a state taken after ``set_epoch()`` chose the next epoch has the
    two equal. The first is read as "ended" and says the next epoch, as a state written now
    does. (A script numbering its epochs otherwise cannot be told apart: its old state reads as
    it did.)

    Raises:
        CheckpointError: ``ended`` in a state inside an epoch, or with sampler epoch 0.
    """
    if not rp.distributed:
        return
    if rp.ended is None:
        rp.ended = not begun(rp) and rp.epoch >= 1 and rp.sampler_epoch == rp.epoch - 1
        if rp.ended:
            rp.sampler_epoch += 1
    elif rp.ended and (begun(rp) or rp.sampler_epoch < 1):
        raise CheckpointError(
            "cannot load DataLoader state: distributed.ended: true, but the state is inside an "
            f"epoch or says sampler epoch {rp.sampler_epoch} comes next (after an epoch's end "
            "it is one after the epoch that ended). The state is damaged."
        )


def sampler_epoch_now(rp: Any) -> int:
    """The epoch a DistributedSampler held when ``rp`` was taken (a load sets it back)."""
    return rp.sampler_epoch - 1 if rp.ended else rp.sampler_epoch


# ---- re-cut for another world size ---------------------------------------------------------
def recut(
    points: list[Any],
    plan: Any,
    batch: int | None,
    batch_drop: bool,
    notes: list[str] | None = None,
) -> Any:
    """This rank's resume point, from the positions of every rank of a job with another world
    size or batch size (``points[r]`` is rank r's validated ``ResumePoint``; its ``batch`` is
    the batch size its ``consumed`` counts in). The new level starts with nothing consumed,
    so this loader cuts it with its own batch size ``batch`` (None: no batching) and
    ``drop_last`` (``batch_drop``), which the warning's count of what is dropped needs.
    ``notes``: where the warning goes instead of ``warnings.warn`` (a resume plan emits it
    once the load is accepted).

    Raises:
        CheckpointError: what cannot be continued exactly (in_order=False positions, ranks in
            different epochs), with what to do.
    """
    from .schema import ResumePoint

    world = len(points)
    sampler = plan.sampler
    for p in points:
        settle(p)
    if any(p.ahead for p in points):
        raise CheckpointError(
            "cannot load DataLoader state: delivered_ahead: the checkpoint was taken with "
            "in_order=False, whose delivered batches are not a prefix of each rank's share; "
            f"it resumes only on the same number of ranks ({world})."
        )
    check_ranks(points, sampler)
    epoch = min(p.epoch for p in points)
    within = [p for p in points if p.epoch == epoch]
    started = [p for p in within if p.consumed or p.history]
    done = [p for p in points if p.epoch != epoch]
    skipped = sorted({tuple(map(repr, x)): x for p in points for x in p.skipped}.values())
    # What every rank holds alike: a Mixture's plan and the skips (skip_samples writes each
    # into every rank's state). Without the plan a Mixture job could not resume re-cut.
    common = {"plan": points[0].plan, "skipped_samples": points[0].skipped_samples}
    if not started and not done:
        # The epoch had not begun anywhere: a plain start, with the sampler's epoch.
        return ResumePoint(
            seed=None,
            epoch=epoch,
            distributed=True,
            sampler_epoch=points[0].sampler_epoch,
            ended=points[0].ended,
            skipped=skipped,
            **common,
        )
    ref = (started or within)[0]
    seq = level_sequence(epoch_order(sampler, ref.sampler_epoch), ref.history, sampler.drop_last)
    share = cut_length(len(seq), world, sampler.drop_last) // world
    for r, p in enumerate(points):
        per = p.per_task() or 1
        if p.epoch == epoch and p.consumed and (p.consumed - 1) * per >= share:
            # (Checked here, not by the loader's own fit check: a re-cut reads every rank's
            # count, which samples_taken would clamp to the share, hiding the damage.)
            raise CheckpointError(
                f"cannot load DataLoader state: ranks[{r}].consumed: the state of rank {r} "
                f"has {p.consumed} batches of {per} consumed, but a rank's share of the "
                f"epoch has only {share} samples. The state is damaged, or from another "
                "dataset: build the loader with the dataset and sampler of the checkpoint."
            )
    taken = [
        share if p.epoch != epoch else samples_taken(p.consumed, share, p.per_task())
        for p in points
    ]
    # A level no rank took anything of (a skip's, or a re-cut's before iter()) is not one:
    # with drop_last its tail would be trimmed to the old world size, dropping samples.
    history = [*ref.history, [world, taken]] if any(taken) else list(ref.history)
    # What each rank of the closed level delivered: a rank at its share's end counts as having
    # taken all of it, but DataLoader(drop_last=True) dropped its incomplete last batch.
    delivered_now = [
        kept(t, p.per_task(), batch_drop) if p.epoch != epoch else t for t, p in zip(taken, points)
    ]
    levels = history_levels(
        len(sampler.dataset), ref.history, ref.skipped_samples, epoch, sampler.drop_last
    )
    not_delivered = sum(sum(c) for _, c, d in levels if d == [0])
    if any(taken):
        levels.append((world, taken, delivered_now))
    _warn_uneven(
        total=len(sampler.dataset),
        levels=levels,
        world=sampler.num_replicas,
        drop_last=sampler.drop_last,
        batch=(batch, batch_drop),
        notes=notes,
        skipped=not_delivered,
    )
    return ResumePoint(
        seed=None,
        epoch=epoch,
        distributed=True,
        sampler_epoch=ref.sampler_epoch,
        history=history,
        skipped=skipped,
        **common,
    )


def check_ranks(points: list[Any], sampler: Any) -> None:
    """What every rank's entry of a global state must agree on, checked alike by every rank
    that loads it, whatever its world size (``points[r]``: rank r's validated, settled
    ``ResumePoint``): a job's ranks are at most one batch apart -- those past the epoch's
    end at the next epoch's start --, those inside the epoch in the same sampler epoch and
    level, and each rank's seed is the one ``sampler`` (the loader's ``DistributedSampler``,
    whose seed the config check matched) derives for that rank. Cheap: no epoch order.

    Raises:
        CheckpointError: the entries disagree, or a seed is not its rank's.
    """
    world = len(points)
    epoch = min(p.epoch for p in points)
    within = [p for p in points if p.epoch == epoch]
    started = [p for p in within if p.consumed or p.history]
    done = [p for p in points if p.epoch != epoch]
    if any(p.epoch != epoch + 1 or p.consumed or p.history for p in done):
        raise CheckpointError(
            "cannot load DataLoader state: epoch: the ranks' states are more than one batch "
            f"apart (epochs {sorted({p.epoch for p in points})}); take the checkpoint at a "
            "step all ranks reached."
        )
    if started or done:
        ref = (started or within)[0]
        if any((p.sampler_epoch, p.history) != (ref.sampler_epoch, ref.history) for p in within):
            raise CheckpointError(
                "cannot load DataLoader state: distributed: the ranks' states are from "
                "different epochs of the DistributedSampler; take the checkpoint at a step all "
                "ranks reached."
            )
    for r, p in enumerate(points):
        if p.seed is None or p.ended:
            continue  # between epochs: the seed is drawn at the next iter()
        want = derive_seed(DIST_SEED, sampler.seed, p.sampler_epoch, len(p.history), world, r)
        if p.seed != want:
            raise CheckpointError(
                f"cannot load DataLoader state: ranks[{r}].seed: the state of rank {r} has "
                f"{clip_repr(p.seed)}, but its DistributedSampler (seed {sampler.seed}, sampler "
                f"epoch {p.sampler_epoch}, level {len(p.history)}, rank {r} of {world}) "
                f"derives {want}. The state is damaged: load the global state as it was saved."
            )


def history_levels(
    n: int, history: list[Any], skips: list[list[int]], epoch: int, drop_last: bool
) -> list[Level]:
    """The epoch's ``history`` as ``Level`` s: what each rank took of each level and what it
    delivered. A level ``skip_samples`` wrote (world size 1, its ``n`` samples taken at the
    place its ``skipped_samples`` record names) delivered nothing: those samples are skipped,
    and the re-cut's account must not count them delivered."""
    pending = [list(x) for x in skips if len(x) == 3 and x[0] == epoch]
    out: list[Level] = []
    length = n
    for w, c in history:
        record = [epoch, n - length, c[0]] if w == 1 and len(c) == 1 else None
        if record is not None and record in pending:
            pending.remove(record)
            out.append((w, list(c), [0]))
        else:
            out.append((w, list(c), list(c)))
        length = remaining_length(length, w, c, drop_last)
    return out


def fresh_level(states: list[Any]) -> bool:
    """Whether every rank's state (unvalidated, as ``split_global`` returns them) stands at
    the start of a level that follows the epoch's first, with nothing of it taken: what
    ``skip_samples`` writes, or a re-cut saved before ``iter()``. Such a level is cut by the
    loader that loads it, even on the world size that saved it, so the load must go through
    ``recut``, which warns where that cut pads or drops samples (``_warn_uneven``)."""

    def fresh(sd: Any) -> bool:
        dist = sd.get("distributed") if isinstance(sd, dict) else None
        history = dist.get("history") if isinstance(dist, dict) else None
        return (
            isinstance(history, list)
            and bool(history)
            and sd.get("consumed") == 0
            and not sd.get("delivered_ahead")
        )

    return all(fresh(sd) for sd in states)


def delivered(length: int, world: int, counts: list[int]) -> tuple[int, int]:
    """``(real, repeats)``: of the samples each rank r delivered -- the first ``counts[r]`` of
    its share of torch's cut of a level of ``length`` for ``world`` ranks -- how many are
    samples of the level, and how many are padding (repeats of its head)."""
    real = sum(
        min(c, max(0, -(-(length - r) // world))) for r, c in enumerate(counts) if r < length
    )
    return real, sum(counts) - real


def kept(share: int, batch: int | None, batch_drop: bool) -> int:
    """Samples of a share of ``share`` a rank delivers: ``DataLoader(drop_last=True)`` drops an
    incomplete last batch."""
    return share // batch * batch if batch_drop and batch else share


Level = tuple[int, list[int], list[int]]  # world size, samples each rank took, delivered


def epoch_account(
    n: int, levels: list[Level], world: int, drop_last: bool, batch: Any
) -> tuple[int, int, int]:
    """``(missed, repeated, left)`` of an epoch of ``n`` samples: its earlier ``levels``, then
    the rest (``left`` samples) cut for ``world`` ranks, each delivering its share as ``batch``
    (batch size, drop_last) cuts it. Nothing is delivered twice but padding (a level's rest
    excludes what was taken), so the samples missed are those no level delivered."""
    real = repeated = 0
    length = n
    for w, taken, counts in levels:
        r, p = delivered(length, w, counts)
        real, repeated = real + r, repeated + p
        length = remaining_length(length, w, taken, drop_last)
    share = cut_length(length, world, drop_last) // world
    r, p = delivered(length, world, [kept(share, *batch)] * world)
    return n - real - r, repeated + p, length


def _warn_uneven(
    *,
    total: int,
    levels: list[Level],
    world: int,
    drop_last: bool,
    batch: tuple[int | None, bool],
    notes: list[str] | None = None,
    skipped: int = 0,
) -> None:
    """Warn (or add to ``notes``) when the re-cut of what the epoch's ``levels`` left, for
    ``world`` ranks, repeats or drops samples (torch's rule for an epoch's end), with the
    epoch's whole account: what earlier cuts trimmed, what incomplete last batches dropped,
    and what an uninterrupted run would have left out. ``skipped``: samples of the levels that
    ``skip_samples`` skipped (not delivered, and not dropped by any cut)."""
    missed, repeated, left = epoch_account(total, levels, world, drop_last, batch)
    extra = left % world
    if not extra:
        return
    import warnings

    if drop_last:
        said = (
            f"the last {extra} of them are dropped (DistributedSampler(drop_last=True)), as "
            "torch drops the tail of an epoch"
        )
    else:
        said = (
            f"{world - extra} of them are repeated to pad the last step (DistributedSampler("
            "drop_last=False)), as torch pads an epoch"
        )
    here = extra if drop_last else 0
    # Trimmed by the earlier cuts: every sample not taken there and not left.
    taken = sum(sum(c) for _, c, _ in levels)
    trimmed = total - left - taken if drop_last else 0
    worlds = " then ".join(str(w) for w, _, _ in levels)
    parts = [
        f"{k} {why}"
        for k, why in (
            (here, "by this cut"),
            (trimmed, f"by the epoch's cut for {worlds} ranks"),
            (skipped, "skipped by skip_samples"),
            (
                missed - here - trimmed - skipped,
                "in incomplete last batches (DataLoader(drop_last=True))",
            ),
        )
        if k
    ]
    account = f"{total - missed} of the epoch's {total} samples are delivered"
    if repeated:
        account += f", {repeated} of them twice"
    if missed:
        account += f"; {missed} are not ({', '.join(parts)})"
    first = levels[0][0] if levels else world
    u_missed, u_repeated, _ = epoch_account(total, [], first, drop_last, batch)
    unbroken = f"leaves out {u_missed}" + (f" and repeats {u_repeated}" if u_repeated else "")
    message = (
        f"resuming on {world} ranks: {left} samples of the epoch are left, not a multiple of "
        f"{world}; {said}. In all, {account}; an uninterrupted run on {first} ranks (with "
        f"this batch size) {unbroken}."
    )
    if notes is not None:
        notes.append(message)
        return
    warnings.warn(message, RuntimeWarning, stacklevel=4)


# ---- inside DCP -----------------------------------------------------------------------------
def called_by_dcp() -> bool:
    """Whether ``torch.distributed.checkpoint`` (save or load) is calling us: there, every
    rank calls ``state_dict()`` together, so a collective is safe."""
    frame: Any = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "").startswith("torch.distributed.checkpoint"):
            return True
        frame = frame.f_back
    return False


def gather(local: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's state, in rank order (a collective when a process group is up)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return [local]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, local)
    return out


def merge_rank_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The global state of a job from the ``state_dict()`` of each of its ranks (rank order).

    Save each rank's ``loader.state_dict()`` (``torch.save`` per rank, as usual); to resume on
    another number of ranks, load them all and pass ``merge_rank_states(states)`` to every
    new rank's ``load_state_dict``. The result is plain data of fixed keys (the ranks' states
    are encoded as text), so it is also what ``dcp.save`` stores.

    Raises:
        CheckpointError: the states are not one per rank 0..W-1 of one job.
    """
    if not isinstance(states, (list, tuple)) or not states:
        raise CheckpointError(
            "merge_rank_states: expected a list with the state_dict() of every rank, got "
            f"{type(states).__name__}"
        )
    world = len(states)
    for r, sd in enumerate(states):
        cfg = sd.get("config") if isinstance(sd, dict) else None
        if not isinstance(cfg, dict) or cfg.get("world_size") != world or cfg.get("rank") != r:
            got = (cfg or {}).get("world_size"), (cfg or {}).get("rank")
            raise CheckpointError(
                f"merge_rank_states: entry {r} should be the state of rank {r} of {world} "
                f"(config world_size, rank), but says {got}. Pass every rank's state, in rank "
                "order."
            )
    return {
        "format": GLOBAL_FORMAT,
        "version": GLOBAL_VERSION,
        "world_size": world,
        "ranks": [base64.b64encode(dump_state(sd)).decode("ascii") for sd in states],
    }


def is_global(sd: Any) -> bool:
    """Whether ``sd`` says it is a job's global state (its ``format``); nothing else is read."""
    fmt = sd.get("format") if isinstance(sd, dict) else None
    return type(fmt) is str and fmt == GLOBAL_FORMAT


def split_global(sd: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-rank states inside a global state.

    Every field is checked by type before it is compared or used, so a damaged file (a tensor
    or a deeply nested list where an int belongs) is a CheckpointError naming the field, never
    a RuntimeError or RecursionError from the value itself.

    Raises:
        CheckpointError: damaged or of an unknown version.
    """
    version = sd.get("version")
    if type(version) is not int or version != GLOBAL_VERSION:
        raise CheckpointError(
            f"cannot load DataLoader state: version: this library reads global version "
            f"{GLOBAL_VERSION}, the state is {clip_repr(version)}. Load it with the "
            "resumable_loader release that wrote it."
        )
    ranks, world = sd.get("ranks"), sd.get("world_size")
    if type(world) is not int or world < 1:
        raise CheckpointError(
            f"cannot load DataLoader state: world_size: expected an int >= 1, got "
            f"{clip_repr(world)}. The state is damaged."
        )
    if not isinstance(ranks, list) or len(ranks) != world or not all(type(x) is str for x in ranks):
        raise CheckpointError(
            f"cannot load DataLoader state: ranks: expected {world} encoded rank states (one str "
            f"each), got {clip_repr(ranks)}. The state is damaged."
        )
    states = []
    for r, text in enumerate(ranks):
        try:
            states.append(load_state(base64.b64decode(text, validate=True)))
        except (ValueError, CheckpointError) as e:
            raise CheckpointError(
                f"cannot load DataLoader state: ranks[{r}]: the state of rank {r} does not "
                f"decode ({e}). The state is damaged."
            ) from None
    return states


__all__ = ["merge_rank_states"]
