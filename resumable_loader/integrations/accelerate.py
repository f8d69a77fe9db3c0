"""Hugging Face accelerate: keep our loader, shard it, place its batches, checkpoint it.

``accelerator.prepare(loader)`` never keeps a loader: ``Accelerator._prepare_one`` hands every
``torch.utils.data.DataLoader`` to ``prepare_data_loader`` (``accelerate/data_loader.py``),
which builds a ``DataLoaderShard`` over a new torch ``DataLoader`` from the loader's dataset,
batch sampler and constructor arguments. ``prepare_data_loader`` below does what ``prepare``
does for a loader -- one share of each epoch per process, batches on ``accelerator.device``,
each epoch registered with the accelerator's ``GradientState`` and its end announced before
its last batch (``DataLoaderShard.__iter__``), which ``accelerator.accumulate`` and
``gather_for_metrics`` read -- and keeps ours::

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

import copy
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

from ..loader.dataloader import DataLoader, has_exact_length, own_rank_state, took_last_batch
from ..loader.hf_streams import warn_shuffle_buffer
from ..state.ranks import called_by_dcp, gather, merge_rank_states
from . import _common

__all__ = ["prepare_data_loader", "state_file_name"]

_TESTED = "1.15.0"

# The loaders prepared for each accelerator, in order: the i-th one's state is file i.
_PREPARED: weakref.WeakKeyDictionary[Any, list[DataLoader[Any]]] = weakref.WeakKeyDictionary()


def state_file_name(index: int) -> str:
    """The file, inside an ``accelerator.save_state`` folder, of the ``index``-th loader
    prepared with ``prepare_data_loader`` (0 for the first)."""
    return f"resumable_loader_{index}.state"


def _remainder(loader: DataLoader[Any], world: int) -> int:
    """What accelerate's ``DataLoaderStateMixin.begin`` records as ``remainder``: the samples
    of the job's last step that are real (``gather_for_metrics`` cuts the padding a
    ``DistributedSampler`` repeats), or -1 without a length or with ``drop_last``."""
    if loader.drop_last or loader.batch_size is None:
        return -1
    try:
        length = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return -1
    return length % (loader.batch_size * world)


class _Epoch(Iterator[Any]):
    """One epoch of a prepared loader, run as accelerate runs one of its ``DataLoaderShard``:
    the loader is registered with the accelerator's ``GradientState`` while the epoch runs,
    and ``end_of_dataloader`` is set on it before its last batch is handed out, so that
    ``accelerator.accumulate`` steps at the epoch's end and ``gather_for_metrics`` drops the
    padding. Each batch is moved to the device (if any) as it is taken.

    Where the epoch's length is not known (a stream, a sampler of your own), the end is found
    as accelerate finds it, by taking one batch ahead; the loader's ``state_dict()`` then
    answers with the position taken before that batch, so it stays what the caller consumed.
    """

    def __init__(self, loader: Any, it: Iterator[Any]) -> None:
        self._loader = loader  # a prepared loader: ``prepare_data_loader`` set its attributes
        self._it = it
        self._device: torch.device | None = loader.__dict__.get("placement_device")
        self._ahead: list[Any] = []  # the batch taken ahead, if any
        self._error: BaseException | None = None  # raised by the batch taken ahead
        self._registered = True
        loader.end_of_dataloader = False
        loader.remainder = _remainder(loader, loader._accelerate_world)
        loader.gradient_state._add_dataloader(loader)

    def _end(self) -> None:
        if self._registered:
            self._registered = False
            self._loader.gradient_state._remove_dataloader(self._loader)

    def __next__(self) -> Any:
        loader = self._loader
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        exact = has_exact_length(loader)
        if self._ahead:
            batch = self._ahead.pop()
        else:
            # The caller's position without this batch: what the state says until the
            # look-ahead below returns (a Ctrl-C in it never hands this batch out).
            before = None if exact else own_rank_state(loader)
            try:
                batch = next(self._it)
            except StopIteration:
                self._end()
                raise
            loader._held_state = before
        last = took_last_batch(loader)
        held = None  # the caller's position once it has this batch, while one is held ahead
        if last is None:
            # (the loader's own state, without the checks and the warning of state_dict())
            after = own_rank_state(loader)
            try:
                self._ahead.append(next(self._it))
                held, last = after, False
            except StopIteration:
                last = True
            except Exception as e:
                # Our iterator stays usable after a failed batch (on_poison="raise"): the
                # caller gets this batch now and the error at the next one, in order.
                self._error, last = e, False
        loader._held_state = held
        if last:
            loader.end_of_dataloader = True
        if self._device is not None:
            batch = send_to_device(batch, self._device, non_blocking=loader.pin_memory)
        return batch


# One prepared subclass per loader class, made on first use.
_PREPARED_CLASSES: dict[Any, Any] = {}


def _prepared_class(base: Any) -> Any:
    """``base`` run as accelerate runs its loaders (see ``_Epoch``): the class of every loader
    ``prepare_data_loader`` returns. Its name and module are ``base``'s."""
    cls = _PREPARED_CLASSES.get(base)
    if cls is None:

        def __iter__(self: Any) -> Iterator[Any]:
            self._held_state = None
            return _Epoch(self, base.__iter__(self))

        def state_dict(self: Any) -> dict[str, Any]:
            held = self.__dict__.get("_held_state")
            if held is None:
                return base.state_dict(self)
            warn_shuffle_buffer(self, "saving")
            if called_by_dcp():
                return merge_rank_states(gather(held))
            return copy.deepcopy(held)

        def load_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
            self._held_state = None
            return base.load_state_dict(self, *args, **kwargs)

        state_dict.__doc__ = base.state_dict.__doc__
        load_state_dict.__doc__ = base.load_state_dict.__doc__
        namespace = {
            "__iter__": __iter__,
            "state_dict": state_dict,
            "load_state_dict": load_state_dict,
            "__module__": base.__module__,
            "__doc__": base.__doc__,
        }
        cls = type(base.__name__, (base,), namespace)
        _PREPARED_CLASSES[base] = cls
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
    without blocking when the device is a GPU (the CPU needs no move). Each epoch runs as
    accelerate runs its own loaders: the loader is registered with the accelerator's
    ``GradientState`` while it runs, and ``end_of_dataloader`` is set before the epoch's last
    batch, so ``accelerator.accumulate`` steps at every epoch's end and ``gather_for_metrics``
    drops the padding. A loader whose epoch length is not exact (a stream, a sampler of your
    own) takes one batch ahead to see the end, as accelerate's do; its ``state_dict()`` still
    gives the position of what the caller took. The loader's class is a subclass of
    ``loader``'s, with its name. ``accelerator.save_state()`` writes the loader's state (every
    process's, gathered) into its folder and ``accelerator.load_state()`` gives it back, so the
    next ``iter()`` continues where the checkpoint was taken. The original ``loader`` is not
    used again.

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
        cls=_prepared_class(type(loader)),
        pin_memory=True if move and device.type == "cuda" else None,
    )
    prepared.placement_device = device if move else None
    prepared.gradient_state = accelerator.gradient_state
    prepared._accelerate_world = accelerator.num_processes
    prepared._held_state = None
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
