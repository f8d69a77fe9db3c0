"""What the framework integrations share (torch only): re-building a loader sharded over the
ranks with our DistributedSampler path, the job's global state, and its file in a checkpoint
folder (written atomically, read without running code)."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from ..core.compat import random_sampler_num_samples
from ..core.errors import CheckpointError
from ..loader.dataloader import DataLoader
from ..plans.samplers import BatchSampler as OurBatchSampler
from ..plans.samplers import RandomSampler as OurRandomSampler
from ..state.codec import dump_state, load_state
from ..state.ranks import merge_rank_states


def _loader_kwargs(loader: DataLoader[Any]) -> dict[str, Any]:
    """Every constructor argument of ``loader`` but the dataset and its sampling."""
    return dict(
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        in_order=loader.in_order,
        task_timeout=loader.task_timeout,
        max_task_attempts=loader.max_task_attempts,
        on_poison=loader.on_poison,
        retry=loader.retry,
        stream_state_every=loader.stream_state_every,
        seed_per_sample=loader.seed_per_sample,
    )


def agreed_seed(seed: int, world: int) -> int:
    """``seed``, checked to be the same on every rank (a collective when ``world`` > 1).

    Raises:
        ValueError: the ranks disagree.
    """
    dist = torch.distributed
    if world > 1 and dist.is_available() and dist.is_initialized():
        seeds: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seeds, seed)
        if len(set(seeds)) > 1:
            raise ValueError(
                f"the ranks disagree on the shuffle seed (rank: seed {dict(enumerate(seeds))}): "
                "every rank must shuffle the same global order. Pass seed=... (the same on "
                "every rank), give the loader a generator=torch.Generator().manual_seed(s), or "
                "call accelerate.utils.set_seed(s) before building it."
            )
    return seed


def _split_stream(dataset: Any, world: int, rank: int) -> Any:
    """Hugging Face ``datasets``' streams know how to split themselves by rank (accelerate's
    ``prepare_data_loader`` does the same); any other stream is given to each rank as is."""
    hf = sys.modules.get("datasets")
    if world > 1 and hf is not None and isinstance(dataset, hf.IterableDataset):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(dataset, rank=rank, world_size=world)
    return dataset


def shard(
    loader: DataLoader[Any],
    world: int,
    rank: int,
    seed: int | None,
    cls: type[DataLoader[Any]] | None = None,
    pin_memory: bool | None = None,
) -> DataLoader[Any]:
    """A loader like ``loader`` that takes rank ``rank``'s share of every epoch.

    Map-style with torch's ``RandomSampler`` or ``SequentialSampler``: rebuilt over torch's
    ``DistributedSampler`` (with one rank too), so that its order is a function of (seed,
    sampler epoch) -- exact in every epoch after a resume -- and its state can be resumed on
    another number of ranks. A loader already over a ``DistributedSampler`` of this world is
    kept. A stream: each rank iterates its own (``datasets``' streams are split by rank).

    Args:
        loader: our loader, built as for one process.
        world, rank: the number of processes and this one's index.
        seed: the shuffle seed; None: the loader's generator's seed, else torch's initial seed.
        cls: the class of the loader built (default: the loader's own).
        pin_memory: override the loader's ``pin_memory``.

    Raises:
        ValueError: a sampler that cannot be shared over ranks, or ranks that disagree on the
            seed (both only with more than one process).
    """
    kwargs = _loader_kwargs(loader)
    if pin_memory is not None:
        kwargs["pin_memory"] = pin_memory
    cls = cls or type(loader)
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        return cls(
            _split_stream(dataset, world, rank),
            batch_size=loader.batch_size,
            drop_last=loader.drop_last,
            **kwargs,
        )
    sampler = loader.sampler
    batched = loader.batch_size is not None
    if batched and type(loader.batch_sampler) not in (BatchSampler, OurBatchSampler):
        if world > 1:
            raise ValueError(
                f"cannot share a batch_sampler of type {type(loader.batch_sampler).__name__} "
                f"over {world} processes: give each rank its own batch sampler (built for its "
                "rank) and prepare the loader with one process per loader, or use "
                "batch_size=... with shuffle=True"
            )
        return cls(dataset, batch_sampler=loader.batch_sampler, **kwargs)
    dsampler: Any
    if isinstance(sampler, DistributedSampler):
        if (sampler.num_replicas, sampler.rank) != (world, rank):
            raise ValueError(
                f"the loader's DistributedSampler is built for rank {sampler.rank} of "
                f"{sampler.num_replicas}, but this is rank {rank} of {world} processes"
            )
        dsampler = sampler
    elif type(sampler) in (RandomSampler, OurRandomSampler, SequentialSampler):
        # (ours: what shuffle=True hands out, carrying the loader's seed chain)
        shuffle = type(sampler) is not SequentialSampler
        if shuffle and (
            sampler.replacement  # type: ignore[attr-defined]
            or random_sampler_num_samples(sampler) is not None
        ):
            raise ValueError(
                "cannot share a RandomSampler with replacement=True or num_samples over "
                "processes; pass a DistributedSampler of your own"
            )
        if seed is None:
            gen = loader.generator
            seed = gen.initial_seed() if gen is not None else torch.initial_seed()
        dsampler = DistributedSampler(
            dataset,
            num_replicas=world,
            rank=rank,
            shuffle=shuffle,
            seed=agreed_seed(seed, world),
            drop_last=False,
        )
    else:
        if world > 1:
            raise ValueError(
                f"cannot share a sampler of type {type(sampler).__name__} over {world} "
                "processes: pass a torch DistributedSampler, or shuffle=True / False"
            )
        dsampler = sampler  # one process: the sampler as it is
    return cls(
        dataset,
        batch_size=loader.batch_size,
        sampler=dsampler,
        drop_last=loader.drop_last,
        **kwargs,
    )


def set_sampler_epoch(loader: DataLoader[Any], epoch: int) -> None:
    """Tell the loader's DistributedSampler (if any) which epoch comes next."""
    if isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(epoch)


def global_state(loader: DataLoader[Any]) -> dict[str, Any]:
    """The job's state: every rank's ``state_dict()`` gathered (a collective when a process
    group is up), in the form any number of ranks can load."""
    local = loader.state_dict()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, local)
        return merge_rank_states(states)
    return merge_rank_states([local])


def write_state(folder: str, name: str, state: dict[str, Any]) -> str:
    """Write ``state`` to ``folder/name`` atomically: a unique temporary file in the folder,
    fsync, rename over the name, fsync of the folder. Returns the path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    data = dump_state(state)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Only the temporary file this call created.
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


def read_state(folder: str, name: str, what: str) -> dict[str, Any]:
    """Read a state written by ``write_state``; decoding runs no code.

    Raises:
        CheckpointError: the file is missing (``what`` says which writer it expected).
    """
    path = os.path.join(folder, name)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(
            f"cannot resume the loader: {path} does not exist. The checkpoint folder was not "
            f"written by {what}, so it holds no loader position."
        ) from None
    return load_state(data)
