"""A resume as parse → plan → apply: ``plan_resume`` turns a state into a frozen ``ResumePlan``.

``DataLoader.load_state_dict`` takes a ``LoaderShape`` (``shape``: what a resume reads of the
loader), calls ``plan_resume(state, shape, policy)``, and hands the plan to the loader's
``_apply``, the one place a load changes the loader. ``plan_resume`` reads the state and the
shape only: it validates the state (``state.schema``), settles or re-cuts the position for
this loader's batch size and world size (``state.ranks``, ``state.cursor``), checks that the
position fits an epoch of this loader, and validates and builds a ``Mixture``'s plan without
installing it (``plans.mixture.plan_load``); a ``Stream``'s state on another layout is
re-dealt (its partition cursors merged and dealt to this loader's workers). Everything that
can refuse the state happens here, before anything is changed: a refused state leaves the
loader as it was by construction.

    state ──► parse (schema.parse_state, or ranks.split_global + recut)
          ──► data check (fingerprint changes; a Mixture's plan_changes)
          ──► re-batch (another batch size: a sample cut; a Stream: the re-deal) ──► fits?
          ──► Mixture plan load (pure half) ──► ResumePlan ──► DataLoader._apply
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import SequentialSampler

from ..core.errors import CheckpointError
from ..plans import streams as P
from ..plans.index_plan import BUILTIN, DISTRIBUTED, FASTFORWARD, STATEFUL
from ..plans.mixture import plan_changes, plan_load
from ..plans.mixture_state import PlanLoad, RestAt
from ..state import fingerprint as F
from ..state import ranks as D
from ..state import schema as S
from ..state.codec import clip_text
from ..state.cursor import Cut, check_cut
from ..state.seeds import DIST_SEED, derive_seed
from .shape import LoaderShape


@dataclass(frozen=True)
class ResumePlan:
    """What a validated state changes in the loader; ``DataLoader._apply`` applies it.

    Attributes:
        point: the position the next ``iter()`` continues (never changed after planning);
            its ``source`` is the state ``state_dict()`` echoes until then (None: it writes
            the position instead -- after a re-cut, or on changed data).
        mixture: the dataset's ``Mixture`` plan to install (``plans.mixture.apply_plan_load``),
            or None (no Mixture, or the checkpoint's data was none).
        sampler_rng: the state of the sampler's own generator to set, or None.
        chain: the seed chain to continue (the saved job's later epochs), or None.
        sampler_epoch: the DistributedSampler's epoch to set, or None.
        skipped: poison tasks skipped so far, for the loader's counters.
        skipped_samples: ``skip_samples`` records, for the next states.
        warnings: RuntimeWarnings to emit once the plan is applied (a re-cut's account of
            padded or dropped samples, new Mixture weights that reach some samples late).
        changes: how the data differs from the checkpoint's (``on_dataset_change=
            "continue"``): one warning names them.
    """

    point: S.ResumePoint
    mixture: PlanLoad | None
    sampler_rng: str | None
    chain: dict[str, Any] | None
    sampler_epoch: int | None
    skipped: tuple[list[Any], ...]
    skipped_samples: tuple[list[int], ...]
    warnings: tuple[str, ...]
    changes: tuple[str, ...]


def plan_resume(state: Any, shape: LoaderShape, policy: str) -> ResumePlan:
    """The plan that continues ``state`` (a ``state_dict()``, or a job's global state) on the
    loader ``shape`` describes. Pure: reads the state and the shape, changes neither.

    Args:
        state: what was given to ``load_state_dict``.
        shape: the loader (``LoaderShape``).
        policy: ``on_dataset_change`` (``state.fingerprint.RAISE`` or ``CONTINUE``), checked.

    Raises:
        CheckpointError: the state is malformed, from another version or configuration, does
            not fit this loader, or (policy "raise") was taken on other data; the message names
            the field, both values and the fix.
    """
    notes: list[str] = []
    if D.is_global(state):
        states = D.split_global(state)
        world, rank = shape.config["world_size"], shape.config["rank"]
        if _global_redeals(states, shape):
            rp = _merged_ranks(states, shape)
            return _checked(_redeal(rp, shape), None, shape, policy, notes, False)
        if (
            len(states) != world
            or shape.kind != DISTRIBUTED
            or any(not _same_batch(sd, shape) for sd in states)
            or D.fresh_level(states)
        ):
            # Another world size or batch size (re-cut), or a sampler that cannot be
            # re-cut: the re-cut says which. A level nothing was taken of (after
            # skip_samples) is cut here even on the same shape, and the re-cut warns
            # where that cut pads or drops samples.
            return _checked(_recut(states, shape, notes), None, shape, policy, notes, True)
        _check_every_rank(states, shape)
        state = states[rank]
    rp = S.ResumePoint.from_state(
        state, shape.config, shape.kind == STATEFUL, dataset=shape.data, dataset_change_ok=True
    )
    D.settle(rp)
    rp = _check_streams(rp, shape)
    if rp.iterable:
        # The loader keeps the workers' dataset states until its workers load them: copies,
        # so that the caller reusing the dict it passed cannot change the resume.
        rp = dataclasses.replace(
            rp,
            workers=[
                dataclasses.replace(w, dataset_state=copy.deepcopy(w.dataset_state))
                for w in rp.workers
            ],
        )
    if _redeals(rp, shape):
        return _checked(_redeal(rp, shape), None, shape, policy, notes, False)
    same = _same_batch(state, shape) and (rp.cut is None or shape.kind == BUILTIN)
    return _checked(rp, state, shape, policy, notes, not same)


def _checked(
    rp: S.ResumePoint,
    state: dict[str, Any] | None,
    shape: LoaderShape,
    policy: str,
    notes: list[str],
    rebatch: bool,
) -> ResumePlan:
    """The plan of the position (re-cut for this batch size, if ``rebatch``), after the
    dataset check: refuse changed data, or carry the changes into the plan, which warns of
    them once it is applied."""
    mix = shape.mixture
    if mix is not None and rp.plan is not None:
        rp = dataclasses.replace(
            rp, dataset_changes=[*rp.dataset_changes, *plan_changes(mix, rp.plan)]
        )
    changes = rp.dataset_changes
    if changes and policy == F.RAISE:
        raise F.changed_error(changes)
    try:
        if rebatch:
            plan = _plan_point(_rebatch(rp, shape), None, shape, notes)
        else:
            plan = _plan_point(rp, state, shape, notes)
    except CheckpointError as e:
        if not changes:
            raise
        raise CheckpointError(
            f"{e} (The data changed since the checkpoint: {'; '.join(changes)}. "
            "on_dataset_change='continue' keeps the checkpoint's position, which must fit "
            "the new data.)"
        ) from None
    return dataclasses.replace(plan, changes=tuple(changes))


def _plan_point(
    rp: S.ResumePoint, state: dict[str, Any] | None, shape: LoaderShape, notes: list[str]
) -> ResumePlan:
    """The last checks of a position in this loader's batches, and its plan."""
    for tid, idx in rp.outstanding:
        if isinstance(idx, list) != shape.auto_collation:
            what = "a list of sample indices" if shape.auto_collation else "one index"
            raise CheckpointError(
                f"cannot load DataLoader state: outstanding: task {tid} has {idx!r}, but a "
                f"task of this loader is {what}. The state is damaged, or from a loader "
                "that batches differently."
            )
    _check_fits(rp, shape)
    gen = shape.sampler_generator
    if gen == (rp.sampler_rng is None) and rp.seed is not None:
        raise CheckpointError(
            f"cannot load DataLoader state: {S.K_SAMPLER_RNG}: the checkpoint's sampler "
            f"{'had no' if gen else 'drew from'} generator of its own, this "
            f"loader's sampler {'has one' if gen else 'has none'}. Build the "
            "sampler as the checkpoint's was (with or without generator=)."
        )
    mixture = _mixture_load(rp, shape, notes)
    source = copy.deepcopy(state) if state is not None else None
    if source is not None:
        # An older version read as this one (``S.UPGRADABLE``) is saved again as this one.
        source[S.K_VERSION] = S.VERSION
        if rp.distributed:  # and a state from before `ended`, as `settle` read it
            source[S.K_DIST] = rp.to_state(shape.config)[S.K_DIST]
    return ResumePlan(
        point=dataclasses.replace(rp, source=source),
        mixture=mixture,
        sampler_rng=rp.sampler_rng if gen else None,
        chain=rp.chain,
        # The sampler's epoch as it was: inside an epoch, the one to continue (iter()
        # refuses another); after an epoch's end, the one that ended, so that a script that
        # never calls set_epoch() iterates it again as it did uninterrupted. The recipe's
        # set_epoch(state's sampler_epoch) then moves on.
        sampler_epoch=D.sampler_epoch_now(rp) if rp.distributed else None,
        skipped=tuple([e, t, S.plain_indices(i)] for e, t, i in rp.skipped),
        skipped_samples=tuple(list(x) for x in rp.skipped_samples),
        warnings=tuple(notes),
        changes=(),
    )


# ---- batch size and world size -------------------------------------------------------------
def _same_batch(sd: Any, shape: LoaderShape) -> bool:
    """Whether the state ``sd`` counts its position in this loader's batches."""
    cfg = sd.get(S.K_CONFIG) if isinstance(sd, dict) else None
    if not isinstance(cfg, dict):
        return False
    mine = shape.config["batch_sampler"]
    # A state that does not say whether a batch_sampler made its batches (written before
    # that was recorded) is taken as this loader's, as it was then.
    return S.same_state(cfg.get("batch_size"), shape.batch_size) and S.same_state(
        cfg.get("batch_sampler", mine), mine
    )


def _refuse_batch_sampler(rp: S.ResumePoint, shape: LoaderShape) -> None:
    """Refuse to re-cut a position whose batches, or this loader's, come from a
    ``batch_sampler`` passed in: the state counts batches of the batch sampler's making,
    whose size it does not hold, and the docs promise a refusal both ways."""
    if rp.per_task() is not None and not shape.user_batches:
        return
    if rp.batch_sampler:
        cfg = rp.source.get(S.K_CONFIG) if isinstance(rp.source, dict) else None
        desc = cfg.get("batch_sampler") if isinstance(cfg, dict) else None
        theirs = "the checkpoint's batches came from a batch_sampler" + (
            f" ({clip_text(desc, 200)})" if isinstance(desc, str) else ""
        )
    elif rp.per_task() is None:
        theirs = (
            "the checkpoint has batch_size=None and does not say whether a batch_sampler "
            "made its batches (it was written before that was recorded)"
        )
    else:
        theirs = f"the checkpoint has batch_size={rp.batch}"
    mine = (
        f"this loader's come from a batch_sampler ({shape.config['batch_sampler']})"
        if shape.user_batches
        else f"this loader has batch_size={shape.batch_size}"
    )
    raise CheckpointError(
        f"cannot load DataLoader state: config.batch_size: {theirs}, {mine}. A position "
        "counted in batches of a batch_sampler passed to the loader cannot be re-cut into "
        "other batches (nor cut from another batch size: the batch sampler decides its "
        "batches). Resume with the checkpoint's own batching, or build the loader with "
        "batch_size=... (shuffle=True/False, a DistributedSampler or a Mixture), whose "
        "position is a sample cursor."
    )


def _rebatch(rp: S.ResumePoint, shape: LoaderShape) -> S.ResumePoint:
    """A position saved with another batch size, as this loader's: the samples consumed
    become a sample cut (``state.cursor``) from which this loader's batches are cut.

    Raises:
        CheckpointError: a sampler whose position cannot be re-cut, with what to do.
    """
    kind = shape.kind
    mine = shape.batch_size
    description = shape.plan.description
    if kind != BUILTIN and rp.cut is not None:
        raise CheckpointError(
            f"cannot load DataLoader state: {S.K_CUT}: a sample cut, but this loader's "
            f"sampler ({description}) is not one of torch's Sequential/"
            "RandomSampler. The state is damaged, or from a loader with another sampler."
        )
    if rp.source is not None and _same_batch(rp.source, shape):
        return rp
    if rp.source is None and S.same_state(rp.batch, mine) and not shape.user_batches:
        return rp  # re-cut from a global state: a fresh level, cut by this loader
    _refuse_batch_sampler(rp, shape)
    saved = f"batch_size={rp.batch}, this loader has batch_size={mine}"
    if kind == DISTRIBUTED:
        raise CheckpointError(
            f"cannot load DataLoader state: config.batch_size: the checkpoint has {saved}. "
            "With a DistributedSampler another batch size re-cuts the whole job's position, "
            "which one rank's state does not hold: load the job's global state (saved by "
            "torch.distributed.checkpoint, or resumable_loader.merge_rank_states([the state "
            "of every rank])) on every rank."
        )
    if kind != BUILTIN:
        what = (
            "a sampler with its own state_dict()"
            if kind == STATEFUL
            else "a batch_sampler or sampler whose order only replaying it reproduces"
        )
        raise CheckpointError(
            f"cannot load DataLoader state: config.batch_size: the checkpoint has {saved}. "
            f"This loader's position is counted in batches of {what} "
            f"({description}), which cannot be re-cut into other batches. Resume "
            f"with batch_size={rp.batch}, or use shuffle=True/False, a DistributedSampler "
            "or a Mixture, whose position is a sample cursor."
        )
    n = shape.plan.epoch_samples()
    assert n is not None
    # Bounded by the epoch before advance(), which would clamp a cut past the end to
    # "nothing left" and silently drop the epoch.
    _, problem = check_cut(rp.cut.to_state() if rp.cut is not None else None, n)
    if problem is not None:
        raise CheckpointError(
            f"cannot load DataLoader state: {S.K_CUT}: {problem}. The state is damaged, "
            "or from another dataset."
        )
    cut = rp.cut or Cut()
    try:
        cut = cut.advance(n, rp.per_task() or 1, rp.consumed, rp.ahead, shape.drop_last)
    except ValueError as e:
        raise CheckpointError(
            f"cannot load DataLoader state: consumed: {e} (batch_size={rp.batch}). Build "
            "the loader over the dataset of the checkpoint."
        ) from None
    # The rest of the epoch is cut from the first sample not consumed, with this batch size:
    # the seed, and hence the order and the per-sample seeds, are the epoch's own.
    return dataclasses.replace(
        rp,
        cut=None if cut.is_trivial else cut,
        consumed=0,
        ahead=frozenset(),
        batch=mine,
        source=None,
    )


# ---- a Stream on another layout: the re-deal ------------------------------------------------
# A Stream's position is one cursor per partition, and a reader's output depends only on its
# partitions' cursors (docs/streams.md). So a state saved by K workers with batch size b
# continues on K' workers with b': merge every worker's cursors into one table, and give each
# new worker its own partitions' cursors. Batches then differ from the uninterrupted run's;
# each partition's rows do not.
def _redeals(rp: S.ResumePoint, shape: LoaderShape) -> bool:
    """Whether ``rp`` is a Stream's position taken on another worker count or batch size."""
    if not rp.iterable or not S.is_stream_record(rp.dataset, shape.data):
        return False
    k = max(1, shape.config["num_workers"])
    return len(rp.workers) != k or not S.same_state(rp.batch, shape.batch_size)


def _global_redeals(states: list[dict[str, Any]], shape: LoaderShape) -> bool:
    """Whether a global state is a Stream's, taken on another world size, worker count or
    batch size (on the same layout each rank continues its own entry, bit-identically)."""
    first = states[0]
    if not S.is_stream_record(first.get(S.K_DATASET), shape.data):
        return False
    cfg = first.get(S.K_CONFIG)
    if not isinstance(cfg, dict):
        return False  # the rank's own check names what is wrong
    return (
        len(states) != shape.config["world_size"]
        or not S.same_state(cfg.get("num_workers"), shape.config["num_workers"])
        or not _same_batch(first, shape)
    )


def _merged_ranks(states: list[dict[str, Any]], shape: LoaderShape) -> S.ResumePoint:
    """Every rank's entry of a Stream's global state as one position whose workers are all
    the job's readers (``_redeal`` then merges their cursors and deals this rank's).

    Raises:
        CheckpointError: an entry its own rank would refuse, or entries in different epochs.
    """
    points = _rank_points(states, shape)
    for p in points:
        D.settle(p)
    epochs = {p.epoch for p in points}
    if len(epochs) > 1:
        raise CheckpointError(
            f"cannot load DataLoader state: epoch: the ranks' entries of the global state are "
            f"in epochs {[p.epoch for p in points]}; a job's ranks save in one epoch. The "
            "state is damaged, or merged from states of different steps."
        )
    return dataclasses.replace(points[0], workers=[w for p in points for w in p.workers])


def _check_streams(rp: S.ResumePoint, shape: LoaderShape) -> S.ResumePoint:
    """Every worker's Stream state checked in the main process, on every layout, before the
    position is taken: what the worker's ``load_state_dict`` would refuse at its first batch
    (a damaged cursor, another pipeline) is refused here, on every rank alike; and what no
    worker could see alone: headers that disagree (one plan for the whole job), a header in
    another epoch than the loader state's, and a worker state that does not hold exactly the
    partitions its reader owned.

    Returns ``rp`` with each worker's state as that worker holds it once loaded
    (``Stream.adopted_state``: a mixture's new weights and segments), so that a state saved
    before a worker's first batch agrees with the ones saved after.

    Raises:
        CheckpointError: naming the worker and the field.
    """
    stream = shape.stream
    if stream is None or not rp.iterable:
        return rp
    first: tuple[int, dict[str, Any]] | None = None
    for i, w in enumerate(rp.workers):
        st = w.dataset_state
        if st is None:
            continue
        where = f"cannot load DataLoader state: {S.K_WORKERS}[{i}].dataset_state"
        try:
            meta, cursors = stream.check_state(st)
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None
        header = st[P.META_KEY]
        if meta.epoch != rp.epoch:
            raise CheckpointError(
                f"{where}: stream.epoch is {meta.epoch}, the loader state's epoch is "
                f"{rp.epoch}: a worker's Stream state is always of the loader's epoch. The "
                "state is damaged."
            )
        plan = {k: v for k, v in header.items() if k not in ("layout", "tail")}
        if first is None:
            first = (i, plan)
        elif plan != first[1]:
            j, other = first
            field = next(k for k in sorted(set(plan) | set(other)) if plan.get(k) != other.get(k))
            raise CheckpointError(
                f"{where}: stream.{field} is {clip_text(repr(plan.get(field)), 60)}, but "
                f"{S.K_WORKERS}[{j}]'s is {clip_text(repr(other.get(field)), 60)}: a job's "
                "workers share one Stream plan. The state is damaged."
            )
        layout = header.get("layout")
        try:
            world, rank = layout["world_size"], layout["rank"]
            k, wid = layout["num_workers"], layout["worker"]
            if not all(type(v) is int for v in (world, rank, k, wid)) or not (
                0 <= rank < world and 0 <= wid < k and world * k <= meta.partitions
            ):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{where}: stream.layout {clip_text(repr(layout), 80)} does not name the "
                "reader that saved it (world_size, rank, num_workers, worker). The state is "
                "damaged."
            ) from None
        owned = P.owned(meta.partitions, world, rank, k, wid)
        if sorted(cursors) != owned:
            raise CheckpointError(
                f"{where}: it holds the cursors of partitions "
                f"{clip_text(repr(sorted(cursors)), 60)}, but its reader (rank {rank} of "
                f"{world}, worker {wid} of {k}) owned {clip_text(repr(owned), 60)}: a partition "
                "missing from it would start its pass again. The state is damaged."
            )
    workers = [
        w
        if w.dataset_state is None
        else dataclasses.replace(w, dataset_state=stream.adopted_state(w.dataset_state))
        for w in rp.workers
    ]
    return dataclasses.replace(rp, workers=workers)


def _redeal(rp: S.ResumePoint, shape: LoaderShape) -> S.ResumePoint:
    """The position of a Stream's state, re-dealt to this loader's workers.

    Raises:
        CheckpointError: a worker's state lags what it delivered (a replay, which only the
            saving layout can do), a partition in two workers' states, or a layout whose
            readers do not divide the partitions.
    """
    metas, tables = [], []
    for i, w in enumerate(rp.workers):
        st = w.dataset_state
        if w.delivered and (st is None or w.state_at != w.delivered):
            raise CheckpointError(
                f"cannot load DataLoader state: {S.K_WORKERS}[{i}].state_at: worker {i}'s "
                f"Stream state is from fetch {w.state_at if st is not None else 0} of the "
                f"{w.delivered} it delivered, so only a replay on the saving layout "
                "(num_workers, batch_size) reaches its position. Resume on that layout."
            )
        if st is None:
            continue
        if not isinstance(st, dict) or not isinstance(st.get(P.META_KEY), dict):
            raise CheckpointError(
                f"cannot load DataLoader state: {S.K_WORKERS}[{i}].dataset_state: not a "
                f"Stream's state (no {P.META_KEY!r} key). The state is damaged."
            )
        metas.append(st[P.META_KEY])
        tables.append({P.partition_key(p): c for p, c in st.items() if p != P.META_KEY})
    if not metas:
        # No worker had read a row of this epoch (empty partitions, or a state taken before
        # the first batch): this loader's workers start the pass afresh -- or stay ended.
        done = all(w.exhausted for w in rp.workers)
        k = max(1, shape.config["num_workers"])
        return dataclasses.replace(
            rp,
            consumed=0,
            ahead=frozenset(),
            workers=[S.WorkerPosition(0, done, None, 0) for _ in range(k)],
            next_worker=0,
            batch=shape.batch_size,
            source=None,
        )
    meta = metas[0]
    table = P.merge_cursors(tables)
    parts, epoch, fields = meta.get("partitions"), meta.get("epoch"), meta.get("fields")
    if type(parts) is not int or parts < 1 or type(epoch) is not int or epoch < 0:
        raise CheckpointError(
            f"cannot load DataLoader state: {S.K_WORKERS}[].dataset_state: stream.partitions "
            f"and stream.epoch must be ints, got {parts!r} and {epoch!r}. The state is damaged."
        )
    if not isinstance(fields, list) or len(fields) <= len(P.HEAD_FIELDS):
        raise CheckpointError(
            f"cannot load DataLoader state: {S.K_WORKERS}[].dataset_state: stream.fields must "
            f"name a cursor's fields, got {clip_text(repr(fields), 80)}. The state is damaged."
        )
    world, rank = shape.config["world_size"], shape.config["rank"]
    k = max(1, shape.config["num_workers"])
    for p, c in table.items():
        # The Stream checks each cursor's fields when it loads them (in the worker); a key
        # outside the partitions would be dealt to no reader, its rows silently lost.
        if type(p) is not int or not 0 <= p < parts or not isinstance(c, list):
            raise CheckpointError(
                f"cannot load DataLoader state: {S.K_WORKERS}[].dataset_state: key "
                f"{clip_text(repr(p), 40)} is not a partition in 0..{parts - 1} with a cursor "
                "(a list of ints). The state is damaged."
            )
    try:
        P.check_layout(parts, world, k)
    except ValueError as e:
        raise CheckpointError(f"cannot load DataLoader state: {e}") from None
    done = all(w.exhausted for w in rp.workers)
    workers = []
    for wid in range(k):
        # A partition no saved worker had a state for was not begun: its pass's start.
        fresh = P.fresh_cursor(epoch, len(fields))
        mine = {p: table.get(p) or list(fresh) for p in P.owned(parts, world, rank, k, wid)}
        # The header names the reader that holds it now: a state saved before this loader's
        # workers run must describe this layout, not the saving one's worker 0.
        layout = {"world_size": world, "rank": rank, "num_workers": k, "worker": wid}
        head = dict(meta, layout=layout)
        workers.append(S.WorkerPosition(0, done, {P.META_KEY: head, **mine}, 0))
    return dataclasses.replace(
        rp,
        consumed=0,
        ahead=frozenset(),
        workers=workers,
        next_worker=0,
        batch=shape.batch_size,
        source=None,
    )


def _recut(states: list[dict[str, Any]], shape: LoaderShape, notes: list[str]) -> S.ResumePoint:
    """The position of this rank from every rank's state of a job on another world size."""
    config = shape.config
    world = len(states)
    if shape.kind != DISTRIBUTED:
        if world == config["world_size"]:
            return _rank_points(states, shape)[config["rank"]]
        raise CheckpointError(
            f"cannot load DataLoader state: world_size: the checkpoint is from {world} "
            f"ranks, this loader has {config['world_size']}. Only torch's "
            "DistributedSampler's position can be re-cut for another number of ranks; "
            "with any other sampler, resume on the same number of ranks."
        )
    points = _rank_points(states, shape)
    for p in points:
        _refuse_batch_sampler(p, shape)
    batch = shape.batch_size if shape.auto_collation else None
    rp: S.ResumePoint = D.recut(points, shape.plan, batch, shape.drop_last, notes)
    seed = rp.seed
    if rp.history:
        # Inside the epoch: its seed, as iter() derives it again, so that a state saved
        # before that iter() is one a loader reads back (an epoch with levels has begun).
        s = shape.plan.sampler
        seed = derive_seed(
            DIST_SEED, s.seed, rp.sampler_epoch, len(rp.history), s.num_replicas, s.rank
        )
    return dataclasses.replace(
        rp,
        seed=seed,
        # A fresh level: nothing of it consumed yet.
        batch=shape.batch_size,
        batch_sampler=shape.user_batches,
        # Every rank read the same data: its changes, once each.
        dataset_changes=list(dict.fromkeys(c for p in points for c in p.dataset_changes)),
    )


# ---- every rank's entry of a global state ---------------------------------------------------
# Every rank loads the same global state and must come to the same answer: were each to check
# only its own entry, a damaged entry would be refused by its rank alone, and under DDP the
# others would go on into their first collective and wait for it forever. So each rank checks
# every entry (a parse of each rank's small state: O(ranks), no communication).
def _rank_points(states: list[dict[str, Any]], shape: LoaderShape) -> list[S.ResumePoint]:
    """Every rank's entry, validated as that rank's state of a job of ``len(states)`` ranks."""
    config, world = shape.config, len(states)
    points = []
    for r, sd in enumerate(states):
        try:
            point = S.ResumePoint.from_state(
                sd,
                dict(config, world_size=world, rank=r),
                shape.kind == STATEFUL,
                dataset=shape.data,
                dataset_change_ok=True,
            )
            points.append(_check_streams(point, shape))
        except CheckpointError as e:
            if r == config["rank"] and world == config["world_size"]:
                raise  # this rank's own entry: its error as a rank's own state gives it
            raise CheckpointError(
                f"{e} (In ranks[{r}], the state of rank {r} of the global state: every rank "
                "checks every rank's entry.)"
            ) from None
    return points


def _check_every_rank(states: list[dict[str, Any]], shape: LoaderShape) -> None:
    """Refuse a global state loaded on the world size and batch size that saved it if any
    rank's entry is one its own rank would refuse, or the entries disagree: what the re-cut
    (``_recut``, ``ranks.recut``) checks of them on another world size."""
    points = _rank_points(states, shape)
    for p in points:
        D.settle(p)
    D.check_ranks(points, shape.plan.sampler)
    begun = [p for p in points if p.consumed or p.ahead]
    if not begun:
        return
    # The entries inside the epoch share its sampler epoch and level (check_ranks), and
    # torch's cut gives every rank a share of one length: one count for all.
    ref = begun[0]
    share = shape.plan.distributed_tasks(ref.sampler_epoch, ref.history)
    for r, p in enumerate(points):
        if p.consumed + len(p.ahead) > share:
            raise CheckpointError(
                f"cannot load DataLoader state: ranks[{r}].consumed: the state of rank {r} "
                f"has {p.consumed} batches consumed, but a rank's share of the epoch has only "
                f"{share}. The state is damaged, or from another dataset: build the loader "
                "with the dataset, batch size and sampler of the checkpoint."
            )


# ---- the position fits this loader ---------------------------------------------------------
def _check_fits(rp: S.ResumePoint, shape: LoaderShape) -> None:
    """The position lies inside an epoch of this loader."""
    plan = shape.plan
    _check_skipped_fit(rp, shape)
    if shape.kind == DISTRIBUTED:
        share = plan.distributed_tasks(rp.sampler_epoch, rp.history)
        if rp.consumed + len(rp.ahead) > share:
            raise CheckpointError(
                f"cannot load DataLoader state: consumed: the state has {rp.consumed} "
                f"batches consumed, but this rank's share of the epoch has only {share}. "
                "Build the loader with the dataset, batch size and sampler of the checkpoint."
            )
        _check_ahead_fits(rp, share, "this rank's share of the epoch")
    if shape.kind == BUILTIN and rp.cut is not None:
        _, problem = check_cut(rp.cut.to_state(), plan.epoch_samples())
        if problem is not None:
            raise CheckpointError(
                f"cannot load DataLoader state: {S.K_CUT}: {problem}. The state is damaged, "
                "or from another dataset."
            )
    if shape.kind in (BUILTIN, FASTFORWARD):
        try:
            total = shape.length if rp.cut is None else plan.cut_tasks(rp.cut)
        except TypeError:
            total = None
        if total is not None and rp.consumed + len(rp.ahead) > total:
            raise CheckpointError(
                f"cannot load DataLoader state: consumed: the state has {rp.consumed} "
                f"batches consumed, but an epoch of this loader has only {total}. Build the "
                "loader with the dataset and batch size of the checkpoint."
            )
        if total is not None:
            _check_ahead_fits(rp, total, "an epoch of this loader")


def _check_ahead_fits(rp: S.ResumePoint, tasks: int, what: str) -> None:
    """Batches delivered ahead are batches of the epoch: their ids lie below its ``tasks``.
    (Their count alone may fit while an id lies past the end: such a batch was never sent,
    and the resume would skip it and deliver it, or deliver nothing, silently.)"""
    if rp.ahead and max(rp.ahead) >= tasks:
        raise CheckpointError(
            f"cannot load DataLoader state: {S.K_AHEAD}: the state has batch "
            f"{max(rp.ahead)} delivered ahead, but {what} has only {tasks} batches (ids 0 to "
            f"{tasks - 1}). The state is damaged, or from a loader over other data or with "
            "another batch size: build the loader with the dataset and batch size of the "
            "checkpoint."
        )


def _check_skipped_fit(rp: S.ResumePoint, shape: LoaderShape) -> None:
    """Poison batches skipped in the state's own epoch are batches of it: their task ids lie
    below the most tasks its epoch can make. Each keeps the id of the cut (batch size) it
    was skipped in, so the bound is the epoch's samples (a batch holds at least one) for the
    samplers that re-cut; a stateful sampler's were drawn. Not checked on changed data (the
    epoch was the old data's) nor for streams (no length)."""
    if rp.dataset_changes:
        return
    kind = shape.kind
    bound: int | None = None
    if kind in (BUILTIN, DISTRIBUTED):
        bound = shape.plan.epoch_samples()
    elif kind == STATEFUL:
        bound = rp.drawn
    elif kind == FASTFORWARD:
        bound = shape.length
    if bound is None:
        return
    for epoch, tid, idx in rp.skipped:
        if epoch == rp.epoch and not 0 <= tid < bound:
            raise CheckpointError(
                f"cannot load DataLoader state: {S.K_SKIPPED}: task {tid} of epoch {epoch} "
                f"(the state's) was skipped (sample indices {clip_text(repr(idx), 80)}), but "
                f"an epoch of this loader has at most {bound} tasks. The state is damaged, "
                "or from a loader over other data: build the loader with the dataset and "
                "sampler of the checkpoint."
            )


# ---- a Mixture's plan ----------------------------------------------------------------------
def _mixture_load(rp: S.ResumePoint, shape: LoaderShape, notes: list[str]) -> PlanLoad | None:
    """A ``Mixture``'s plan from the state, validated and built, not installed: the last check
    that can refuse the state. New weights the mixture was built with apply from the first
    sample not yet consumed, in the order the sampler delivers the epoch (see
    ``_mixture_resume``), or are refused where that order cannot be recomputed."""
    mix = shape.mixture
    if mix is None:
        # On changed data (another class: the check named it) a plan is not ours to follow.
        if rp.plan is not None and not rp.dataset_changes:
            raise CheckpointError(
                f"cannot load DataLoader state: {S.K_PLAN}: the state holds a Mixture's "
                f"plan, but this loader's dataset is a {shape.dataset_name}. Build the "
                "loader over the Mixture the checkpoint was taken with."
            )
        return None
    if rp.plan is None:
        if rp.dataset_changes:
            return None  # the checkpoint's data was no Mixture: this one's plan, as it was built
        raise CheckpointError(
            f"cannot load DataLoader state: {S.K_PLAN}: missing, but this loader's dataset "
            "is a Mixture. The state was taken over another dataset."
        )
    resume, behind = _mixture_resume(rp, len(mix), shape)
    load = plan_load(mix, rp.plan, resume=resume, changes_ok=bool(rp.dataset_changes))
    if load.applied and behind:
        notes.append(behind)
    return load


def _mixture_resume(
    rp: S.ResumePoint, n: int, shape: LoaderShape
) -> tuple[int | RestAt | str, str]:
    """Where a ``Mixture``'s new weights begin at this resume: after every sample consumed.

    The epoch's sampler visits its positions in an order; what was consumed is a prefix of
    that order, less any batches delivered ahead (``in_order=False``) or ranks out of step.
    The new weights begin at the place ``top`` just after the last consumed sample: a
    global position when the order is ``range(n)``, else a place in the order (``RestAt``:
    the k-th sample delivered after the resume is the k-th of the new weights). The few
    unconsumed samples before ``top`` keep the old weights: the second value says so (a
    warning, if the weights changed), or is empty. A str first: the reason the order
    cannot be recomputed (the load is refused if the weights changed).
    """
    epoch = rp.epoch
    begun = rp.consumed or rp.ahead or rp.history or rp.drawn or rp.cut is not None
    if not begun:
        return epoch * n, ""
    kind, sampler = shape.kind, shape.plan.sampler
    order: dict[str, Any] | None = None
    if kind == BUILTIN:
        cut = (rp.cut or Cut()).advance(n, shape.plan.per_task(), rp.consumed, rp.ahead)
        top = max([cut.start, *(f + c for f, c in cut.holes)])
        behind = top - cut.start - sum(c for _, c in cut.holes)
        if type(sampler) is not SequentialSampler:
            if sampler.replacement or sampler.num_samples != n:
                why = (
                    f"the sampler draws {sampler.num_samples} positions of {n}"
                    f"{' with replacement' if sampler.replacement else ''}, so the rest "
                    "of the epoch is no set of positions that new weights could be given to"
                )
                return why, ""
            assert rp.seed is not None  # begun: inside an epoch
            order = {"kind": "random", "seed": rp.seed}
    elif kind == DISTRIBUTED:
        top, behind = _distributed_top(rp, n, shape)
        if sampler.shuffle:
            order = {"kind": "distributed", "seed": sampler.seed, "epoch": rp.sampler_epoch}
    else:
        why = (
            f"the loader cannot recompute the order of its sampler ({shape.plan.description})"
            ", so it cannot tell which samples of the epoch are still to come"
        )
        return why, ""
    note = (
        f"the Mixture's new weights apply after the last sample consumed, from place {top} "
        f"of epoch {epoch}'s order of {n}; {behind} samples before it were not consumed "
        "(delivered ahead out of order, or ranks out of step) and keep the checkpoint's "
        "weights"
        if behind
        else ""
    )
    if top >= n:
        return (epoch + 1) * n, note
    if order is None or top == 0:
        return epoch * n + top, note
    return RestAt(epoch, top, order), note


def _distributed_top(rp: S.ResumePoint, n: int, shape: LoaderShape) -> tuple[int, int]:
    """A DistributedSampler epoch: one past the last place (in the epoch's order, before
    torch's cut) any rank consumed, and how many places before it are still to come.

    The levels of ``rp.history`` hold each rank's count. A rank's own state (the level it
    is in has samples consumed) says only what this rank consumed: the other ranks are
    taken to be in step with it, as ranks that step together are."""
    plan = shape.plan
    s = plan.sampler
    drop_last = s.drop_last
    seq = np.arange(n, dtype=np.int64)  # places, cut and re-cut as the positions are
    top = -1
    levels = list(rp.history)
    own: np.ndarray | None = None
    if rp.consumed or rp.ahead:
        share = len(plan.distributed_share(rp.sampler_epoch, rp.history))
        bs = plan.per_task()
        mine = [np.arange(min(share, rp.consumed * bs), dtype=np.int64)]
        mine += [np.arange(t * bs, min(share, (t + 1) * bs), dtype=np.int64) for t in rp.ahead]
        own = np.concatenate(mine)
    for world, consumed in levels:
        total = min(len(seq), D.cut_length(len(seq), world, drop_last))
        for r, c in enumerate(consumed):
            took = seq[r : min(total, c * world + r) : world]
            if len(took):
                top = max(top, int(took.max()))
        seq = D.remaining(seq, world, consumed, drop_last)
    if own is not None:
        world = s.num_replicas
        total = min(len(seq), D.cut_length(len(seq), world, drop_last))
        taken = np.zeros(len(seq), dtype=bool)
        for r in range(world):
            at = own * world + r
            taken[at[at < total]] = True
        if taken.any():
            top = max(top, int(seq[taken].max()))
        seq = seq[~taken]
    top += 1
    return top, int((seq < top).sum())
