"""What ``iter(loader)`` settles before it builds the epoch's iterator: the epoch's seed under
a DistributedSampler, the samples' seeds, the pin function, the workers' supervisor, and the
one warning of a stream resumed by replay.

Functions of the values the loader passes in; the loader keeps its fields to itself.
"""

from __future__ import annotations

import multiprocessing
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..core.errors import CheckpointError
from ..pipeline.pin import pin_memory
from ..pipeline.supervisor.supervisor import Supervisor
from ..pipeline.worker import WorkerSpec
from ..plans.index_plan import DISTRIBUTED, ITERABLE, IndexPlan
from ..state import schema as S
from ..state.seeds import DIST_SEED, SAMPLE, WORKER, derive_seed


def distributed_epoch(plan: IndexPlan, rp: S.ResumePoint | None) -> int:
    """Set the DistributedSampler epoch (and resize levels) the next epoch iterates, and
    return its seed: a function of (sampler seed, sampler epoch, level, rank), the same in
    a resumed run, with no RNG drawn.

    Raises:
        CheckpointError: ``rp`` is inside a sampler epoch other than the sampler's now.
    """
    sampler = plan.sampler
    history: list[Any] = []
    if rp is not None and (rp.consumed or rp.ahead or rp.history):
        if sampler.epoch != rp.sampler_epoch:
            raise CheckpointError(
                f"cannot continue the saved epoch: the state is in the middle of the "
                f"DistributedSampler's epoch {rp.sampler_epoch}, but set_epoch("
                f"{sampler.epoch}) was called after load_state_dict(). Call "
                f"sampler.set_epoch({rp.sampler_epoch}) for the resumed epoch (the loader "
                "state's ['distributed']['sampler_epoch'])."
            )
        history = rp.history
    plan.dist_position = (sampler.epoch, history)
    return derive_seed(
        DIST_SEED, sampler.seed, sampler.epoch, len(history), sampler.num_replicas, sampler.rank
    )


def sample_seed(seed_per_sample: bool, plan: IndexPlan, seed: int) -> int | None:
    """What each sample's seed derives from (``seed_per_sample``), else None; ``seed`` is
    the epoch's."""
    if not seed_per_sample or plan.kind == ITERABLE:
        return None
    if plan.kind == DISTRIBUTED:
        sampler = plan.sampler
        return derive_seed(SAMPLE, sampler.seed, sampler.epoch)
    return derive_seed(SAMPLE, seed)


def pin_fn(pin: bool, pin_memory_device: str) -> Callable[[Any], Any] | None:
    """The pin function of an epoch (torch's warnings, at the caller of ``iter()``: called
    from ``DataLoader._epoch_setup``, called from ``__iter__``)."""
    if not pin:
        return None
    if pin_memory_device:
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as the "
            f"device,ignore pin_memory_device='{pin_memory_device}'.",
            stacklevel=4,
        )
    acc = getattr(torch, "accelerator", None)
    available = acc.is_available() if acc is not None else torch.cuda.is_available()
    if not available:
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, then device "
            "pinned memory won't be used.",
            stacklevel=4,
        )
        return None
    return pin_memory


def make_supervisor(
    context: Any, task_timeout: float | None, fork_lock: threading.Lock, spec: dict[str, Any]
) -> Supervisor:
    """The supervisor of an epoch's workers; ``spec``: ``WorkerSpec``'s fields but the
    worker's id and seed (each worker's seed derives from ``spec["base_seed"]``).

    ``spec`` is a plain dict, not a closure over the loader: the supervisor is kept alive by
    the finalizer registered on the loader, and must not keep the loader alive in turn."""
    base = spec["base_seed"]

    def make_spec(wid: int) -> WorkerSpec:
        return WorkerSpec(worker_id=wid, worker_seed=derive_seed(WORKER, base, wid), **spec)

    return Supervisor(
        context or multiprocessing.get_context(),
        make_spec,
        spec["num_workers"],
        task_timeout,
        fork_lock,
    )


def warn_fast_forward(dataset: Any, rp: S.ResumePoint | None) -> bool:
    """Say that resuming a stream without state replays it (called by ``__iter__``: the
    warning points at the caller's ``iter()``). Returns whether it warned."""
    if rp is None or S.has_state(dataset):
        # A dataset with state that had no snapshot yet (stream_state_every > 1): the
        # replay is bounded by the snapshot interval, as documented; nothing to warn of.
        return False
    replayed = [
        w.delivered
        for w in rp.workers
        if w.dataset_state is None and w.delivered and not w.exhausted
    ]
    if not replayed:
        return False
    warnings.warn(
        f"resuming an iterable dataset without state_dict()/load_state_dict(): the stream is "
        f"fast-forwarded by re-reading {replayed[0]} batches inside the worker(s) "
        "(O(consumed)). Implement state_dict() and load_state_dict() on the dataset (or its "
        "iterator) to resume in O(1).",
        RuntimeWarning,
        stacklevel=3,
    )
    return True
