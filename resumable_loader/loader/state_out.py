"""``state_dict()``'s side of the state: what the loader knows (``StateView``) → plain data.

A state says what the caller consumed: inside an epoch, the latest iterator's position (its
``Cursor``); between epochs -- or when the epoch was delivered to its end, which a state says
as the state after it does -- the start of the next epoch; after ``load_state_dict()`` and
before the next ``iter()``, the state loaded (echoed, or the re-cut position written anew).
To it come the seed chain, a ``Mixture``'s plan, a fast-forwarded sampler's generator, the
skips, and the data's record; ``state.schema.ResumePoint.to_state`` writes the dict.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from ..plans.index_plan import BUILTIN, DISTRIBUTED, ITERABLE, STATEFUL, IndexPlan
from ..plans.mixture import Mixture
from ..state import fingerprint as F
from ..state import ranks as D
from ..state import schema as S
from ..state.seeds import SeedChain, encode_generator
from .lifecycle import Cursor


@dataclass(frozen=True)
class StateView:
    """What ``state_dict()`` reads of the loader, taken when it is called.

    The values are the loader's as of the call. ``cursor``, ``chain``, ``plan`` and
    ``dataset`` are the loader's own objects, asked only where the state needs them: the
    cursor's live position costs a walk of the pipeline's stages, a stateful sampler's state
    is the user's ``state_dict()``, and a chain that never drew a seed draws its root when
    first asked.
    """

    data: dict[str, Any]  # the data's record (``dataset_record``), taken first
    config: dict[str, Any]
    plan: IndexPlan
    dataset: Any
    cursor: Cursor | None  # the latest iterator's position (None: no iter() since load/build)
    resume: S.ResumePoint | None  # a loaded position the next iter() continues
    seed: int  # the seed of the latest epoch begun
    next_epoch: int
    chain: SeedChain
    epoch_rng: str | None  # a fast-forwarded sampler's generator at the latest iter()
    skipped: list[list[Any]]
    skipped_samples: list[list[int]]
    num_workers: int
    # A Stream's next epoch when the ranks' agreement ended the last one with rows left on
    # this rank: its workers start from the delivered cursors (``loader.stream_ranks``).
    carry: S.ResumePoint | None = None


def dataset_record(dataset: Any) -> dict[str, Any]:
    """The data as a state records it (``state.fingerprint``): a ``Mixture``'s fingerprints
    are its sources', in its plan."""
    return F.record(dataset, per_source=isinstance(dataset, Mixture))


def rank_state(view: StateView) -> dict[str, Any]:
    """This rank's own state (``DataLoader.state_dict`` outside DCP)."""
    plan, dataset = view.plan, view.dataset
    if view.resume is not None:
        return _pending_state(view, view.resume)
    cursor = view.cursor
    ended: int | None = None  # DISTRIBUTED: the sampler epoch just delivered to its end
    if cursor is not None and not cursor.finished:
        rp: S.ResumePoint = dataclasses.replace(cursor.position(), seed=view.seed, cut=plan.cut)
        if delivered_to_its_end(plan, rp):
            # Only StopIteration is left of this epoch: say so as the state after it does,
            # so a resume (and a trainer counting epochs, such as Lightning) starts the
            # next epoch. torchdata's StatefulDataLoader resumes into the epoch's empty
            # rest instead (docs/guarantees.md, "An epoch's end, here and in torchdata").
            rp = epoch_start(plan, rp.epoch + 1, view.num_workers)
            ended = plan.dist_position[0]
    else:
        rp = view.carry or epoch_start(plan, view.next_epoch, view.num_workers)
        if cursor is not None:  # after StopIteration
            ended = plan.dist_position[0]
    extra: dict[str, Any] = {}
    if plan.kind == DISTRIBUTED:
        extra["distributed"] = True
        if rp.seed is not None:  # within an epoch: the sampler epoch and levels it uses
            extra["sampler_epoch"], extra["history"] = plan.dist_position
            extra["ended"] = False
        else:
            # Between epochs: the sampler epoch to set next -- after an epoch's end, the
            # one after it, as `epoch` is the loader's next (see state.ranks).
            extra["sampler_epoch"], extra["ended"] = D.next_sampler_epoch(plan.sampler.epoch, ended)
    extra["chain"] = None if plan.kind == DISTRIBUTED else view.chain.state()
    if isinstance(dataset, Mixture):
        extra["plan"] = dataset.state_dict()
    gen = plan.sampler_generator
    if gen is not None:
        # Inside an epoch: as it began (the resume fast-forwards through the same draws);
        # between epochs: as the next epoch begins.
        extra["sampler_rng"] = view.epoch_rng if rp.seed is not None else encode_generator(gen)
    rp = dataclasses.replace(
        rp,
        skipped=[list(x) for x in view.skipped],
        skipped_samples=[list(x) for x in view.skipped_samples],
        dataset=view.data,
        **extra,
    )
    return rp.to_state(view.config)


def _pending_state(view: StateView, pending: S.ResumePoint) -> dict[str, Any]:
    """The state of a loaded position no ``iter()`` has continued yet."""
    dataset = view.dataset
    if pending.source is not None and not pending.dataset_changes:
        sd = copy.deepcopy(pending.source)
        if isinstance(dataset, Mixture):
            # The plan as loaded: with new weights from the resume point on, which the
            # state read does not hold.
            sd[S.K_PLAN] = dataset.state_dict()
        return sd
    # Re-cut from a global state, or resumed onto changed data: the position read, on
    # this loader's data (so a resume from it on the same data checks clean).
    plan = pending.plan
    if pending.dataset_changes:
        plan = dataset.state_dict() if isinstance(dataset, Mixture) else None
    return dataclasses.replace(pending, dataset=view.data, plan=plan).to_state(view.config)


def epoch_start(plan: IndexPlan, epoch: int, num_workers: int) -> S.ResumePoint:
    """The position at the start of ``epoch``, before its ``iter()``."""
    kind = plan.kind
    stateful, iterable = kind == STATEFUL, kind == ITERABLE
    # seed None: the epoch has not begun, its seed is drawn at its iter().
    return S.ResumePoint(
        seed=None,
        epoch=epoch,
        stateful=stateful,
        iterable=iterable,
        sampler_state=plan.sampler_state() if stateful else None,
        workers=[S.WorkerPosition() for _ in range(max(1, num_workers))] if iterable else [],
    )


def delivered_to_its_end(plan: IndexPlan, rp: S.ResumePoint) -> bool:
    """Whether every batch of the position's epoch was delivered, as far as is known.

    Known for torch's own samplers (their length is exact), for a stateful sampler drawn
    to its end with nothing outstanding, and for a stream whose every shard ran dry. A
    custom sampler's ``len()`` is not trusted (too long or too short, it would end an epoch
    early): its epoch ends at StopIteration, as does a stream whose end was not yet seen.
    """
    kind = plan.kind
    if kind == ITERABLE:
        return all(w.exhausted for w in rp.workers)
    if kind == STATEFUL:
        return rp.sampler_done and not rp.outstanding and not rp.ahead and rp.consumed == rp.drawn
    if kind == BUILTIN:
        return rp.consumed >= plan.cut_tasks(plan.cut)
    if kind == DISTRIBUTED:
        return rp.consumed >= plan.distributed_tasks(*plan.dist_position)
    return False
