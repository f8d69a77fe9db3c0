"""What a resume reads of a loader: its configuration, as a state's ``config`` records it, and
a frozen description (``LoaderShape``) taken once per ``load_state_dict()``.

The resume plan (``resume.plan_resume``) is a function of the state and this description
alone: it never reads the loader, so it cannot change it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..plans.index_plan import BUILTIN, DISTRIBUTED, FASTFORWARD, ITERABLE, IndexPlan
from ..plans.mixture import Mixture
from ..plans.samplers import recorded_name
from ..plans.stream import Stream


def loader_config(
    dataset: Any,
    plan: IndexPlan,
    *,
    batch_size: int | None,
    batch_sampler: str | None,
    drop_last: bool,
    num_workers: int,
) -> dict[str, Any]:
    """The configuration a state is valid for (the state's ``config``; see ``state.schema``).

    ``batch_sampler``: a batch_sampler passed in, as ``batch_sampler_description`` says it.
    """
    try:
        n = len(dataset)
    except TypeError:
        n = None
    ws, rank = 1, 0
    dist = torch.distributed
    if plan.kind == DISTRIBUTED:
        # The sampler's own view: what its shard depends on.
        ws, rank = plan.sampler.num_replicas, plan.sampler.rank
    elif dist.is_available() and dist.is_initialized():
        ws, rank = dist.get_world_size(), dist.get_rank()
    return {
        "dataset_kind": "iterable" if plan.kind == ITERABLE else "map",
        "dataset_len": n,
        "batch_size": batch_size,
        # A batch_sampler passed in: its batches' size is its own (batch_size is None).
        "batch_sampler": batch_sampler,
        "drop_last": drop_last,
        "sampler": plan.description,
        "num_workers": num_workers,
        "world_size": ws,
        "rank": rank,
    }


def batch_sampler_description(batch_sampler: Any, user_batches: bool) -> str | None:
    """A ``batch_sampler`` passed in, as the state's config records it: its class, and for
    torch's (or our) ``BatchSampler`` its batch size and drop_last -- so that a resume with
    another batch size is refused, not read as batches of the new size. None where the loader
    makes its own batches (or none): ``user_batches`` is False."""
    if not user_batches:
        return None
    bs = batch_sampler
    name = recorded_name(bs)
    if isinstance(bs, torch.utils.data.BatchSampler):
        return f"{name}(batch_size={bs.batch_size}, drop_last={bs.drop_last})"
    return name


@dataclass(frozen=True)
class LoaderShape:
    """A loader as a resume sees it, taken once per ``load_state_dict()``.

    The values are copies; ``plan``, ``mixture`` and ``stream`` are the loader's own objects, of
    which the resume plan calls only what reads (``IndexPlan``'s epoch arithmetic, whose share
    cache is a memo; ``plan_changes`` and ``plan_load``, which validate and build without
    installing; ``Stream.check_state``).
    """

    config: dict[str, Any]  # the state's ``config`` for this loader (``loader_config``)
    plan: IndexPlan  # the sampler's kind, description and epoch arithmetic
    data: dict[str, Any]  # the data's record (``state.fingerprint.record``)
    dataset_name: str  # the dataset's class, as a refusal names it
    batch_size: int | None
    drop_last: bool
    auto_collation: bool
    # ``len(loader)`` for the built-in and fast-forwarded samplers (None: it has none).
    length: int | None
    # Whether the sampler draws from a generator of its own (``IndexPlan.sampler_generator``).
    sampler_generator: bool
    mixture: Mixture | None  # the dataset, if it is a Mixture
    # The dataset, if it is a Stream: its ``check_state`` reads each worker's state (pure).
    stream: Stream | None = None

    @property
    def kind(self) -> str:
        """The sampler's kind (``plans.index_plan``: BUILTIN, DISTRIBUTED, ...)."""
        return self.plan.kind

    @property
    def user_batches(self) -> bool:
        """Whether the batches come from a ``batch_sampler`` passed in (torch then sets
        ``batch_size`` to None): their size is the batch sampler's own."""
        return self.auto_collation and self.batch_size is None


def loader_length(plan: IndexPlan, length: Any) -> int | None:
    """``len(loader)`` (``length``: the loader's ``__len__``) where a resume checks a position
    against it -- the built-in and fast-forwarded samplers -- else None, without calling it
    (torch's ``len()`` of a loader over an iterable dataset is recorded by torch)."""
    if plan.kind not in (BUILTIN, FASTFORWARD):
        return None
    try:
        return int(length())
    except TypeError:
        return None
