"""Hugging Face accelerate: keep our loader, shard it, place its batches, checkpoint it.

``accelerator.prepare(loader)`` never keeps a loader: ``Accelerator._prepare_one`` hands every
``torch.utils.data.DataLoader`` to ``prepare_data_loader`` (``accelerate/data_loader.py``),
which builds a ``DataLoaderShard`` over a new torch ``DataLoader`` from the loader's dataset,
batch sampler and constructor arguments. ``prepare_data_loader`` below does what ``prepare``
does for a loader -- one share of each epoch per process, batches on ``accelerator.device`` --
and keeps ours::

    model, optimizer = accelerator.prepare(model, optimizer)
    loader = prepare_data_loader(accelerator, loader)  # instead of prepare(..., loader)
    accelerator.load_state(ckpt)                         # if resuming: the loader continues
    for epoch in range(start_epoch, epochs):
        loader.sampler.set_epoch(epoch)                  # map-style: as with any DDP sampler
        for batch in loader:
            ...
            accelerator.save_state(ckpt)                 # the loader's state goes with it

The state is written by a save-state pre-hook as ``resumable_loader_<i>.state`` in the
checkpoint folder (our codec, written atomically) and read back by a load-state pre-hook: not
through ``register_for_checkpointing``, whose ``load_custom_state`` (``checkpointing.py``)
unpickles the file and whose ``save_custom_state`` keeps rank 0's object only.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from typing import Any

try:
    import accelerate
    from accelerate.utils import send_to_device
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "resumable_loader.integrations.accelerate needs Hugging Face accelerate (tested with "
        "1.15.0): pip install 'accelerate>=1.15'"
    ) from e

import torch

from .._loader import DataLoader
from . import _common

__all__ = ["prepare_data_loader", "state_file_name"]

_TESTED = "1.15.0"

# The loaders prepared for each accelerator, in order: the i-th one's state is file i.
_PREPARED: weakref.WeakKeyDictionary[Any, list[DataLoader[Any]]] = weakref.WeakKeyDictionary()


def state_file_name(index: int) -> str:
    """The file, inside an ``accelerator.save_state`` folder, of the ``index``-th loader
    prepared with ``prepare_data_loader`` (0 for the first)."""
    return f"resumable_loader_{index}.state"


class _Placed(Iterator[Any]):
    """One epoch's batches, each moved to the device as it is taken. It holds nothing ahead
    of the loader's iterator, so the loader's ``state_dict()`` stays what the caller took."""

    def __init__(self, it: Iterator[Any], device: torch.device, non_blocking: bool) -> None:
        self._it = it
        self._device = device
        self._non_blocking = non_blocking

    def __next__(self) -> Any:
        return send_to_device(next(self._it), self._device, non_blocking=self._non_blocking)


# One placing subclass per loader class, made on first use.
_PLACING: dict[Any, Any] = {}


def _placing(base: Any) -> Any:
    """``base`` with batches moved to ``placement_device``: the class of a prepared loader
    whose device is not the CPU (on the CPU the loader keeps its own class)."""
    cls = _PLACING.get(base)
    if cls is None:

        def __iter__(self: Any) -> Iterator[Any]:
            return _Placed(base.__iter__(self), self.placement_device, self.pin_memory)

        cls = type(base.__name__, (base,), {"__iter__": __iter__, "__module__": base.__module__})
        _PLACING[base] = cls
    return cls


def prepare_data_loader(
    accelerator: accelerate.Accelerator,
    loader: DataLoader[Any],
    *,
    seed: int | None = None,
    device_placement: bool | None = None,
) -> DataLoader[Any]:
    """Our loader, ready for ``accelerator``'s processes: what ``accelerator.prepare(loader)``
    would give, without replacing the loader.

    The returned loader is a ``resumable_loader.DataLoader`` with every argument of ``loader``
    (respawn, ``task_timeout``, retries, seeds, state). A map-style loader over torch's
    ``RandomSampler`` or ``SequentialSampler`` is rebuilt over torch's ``DistributedSampler``
    for this process -- also with one process, so that a checkpoint resumes on any number of
    processes -- and the order of an epoch is then a function of (``seed``, the sampler's
    epoch): call ``loader.sampler.set_epoch(epoch)`` before each epoch, as with any
    distributed sampler. A stream is iterated by each process as it is (Hugging Face
    ``datasets`` streams are split by rank first); a stream of your own must read its rank.

    Batches are moved to ``accelerator.device`` as they are taken, from pinned memory and
    without blocking when the device is a GPU (the CPU needs no move: the loader keeps its
    class). ``accelerator.save_state()`` writes the loader's state (every process's, gathered)
    into its folder and ``accelerator.load_state()`` gives it back, so the next ``iter()``
    continues where the checkpoint was taken. The original ``loader`` is not used again.

    Args:
        accelerator: the ``Accelerator`` whose processes, device and checkpoints to use.
        loader: our loader, built as for a single process.
        seed: the shuffle seed of the ``DistributedSampler`` (the same on every process).
            Default: the loader's ``generator``'s initial seed, else ``torch.initial_seed()``
            (which ``accelerate.utils.set_seed`` sets).
        device_placement: move batches to the device; default ``accelerator.device_placement``.

    Returns:
        The prepared loader.

    Raises:
        TypeError: ``loader`` is not a ``resumable_loader.DataLoader``.
        ValueError: its sampler cannot be shared over the processes, or the processes disagree
            on the seed.
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"prepare_data_loader expects a resumable_loader.DataLoader, got "
            f"{type(loader).__name__}; prepare torch's loaders with accelerator.prepare()"
        )
    if device_placement is None:
        device_placement = accelerator.device_placement
    device = torch.device(accelerator.device)
    move = bool(device_placement) and device.type != "cpu"
    prepared = _common.shard(
        loader,
        accelerator.num_processes,
        accelerator.process_index,
        seed,
        cls=_placing(type(loader)) if move else None,
        pin_memory=True if move and device.type == "cuda" else None,
    )
    if move:
        prepared.placement_device = device
    _register(accelerator, prepared)
    return prepared


def _register(accelerator: Any, loader: DataLoader[Any]) -> None:
    loaders = _PREPARED.get(accelerator)
    if loaders is None:
        loaders = _PREPARED[accelerator] = []
        # Weak: the accelerator keeps the hooks, the hooks must not keep the accelerator.
        ref = weakref.ref(accelerator)
        accelerator.register_save_state_pre_hook(functools.partial(_save_hook, ref))
        accelerator.register_load_state_pre_hook(functools.partial(_load_hook, ref))
    loaders.append(loader)


def _save_hook(acc_ref: Any, models: Any, weights: Any, output_dir: str) -> None:
    acc = acc_ref()
    if acc is None:
        return
    for i, loader in enumerate(_PREPARED.get(acc, [])):
        state = _common.global_state(loader)  # every process takes part
        if acc.is_main_process:
            _common.write_state(output_dir, state_file_name(i), state)


def _load_hook(acc_ref: Any, models: Any, input_dir: str) -> None:
    acc = acc_ref()
    if acc is None:
        return
    for i, loader in enumerate(_PREPARED.get(acc, [])):
        state = _common.read_state(
            input_dir,
            state_file_name(i),
            "accelerator.save_state() with resumable_loader.integrations.accelerate"
            f".prepare_data_loader() (loader {i} of {len(_PREPARED[acc])})",
        )
        loader.load_state_dict(state)
