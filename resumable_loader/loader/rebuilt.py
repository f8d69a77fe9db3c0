"""Say so when another library rebuilds one of our loaders as its own (no framework imports).

``accelerate``'s ``prepare_data_loader`` and ``skip_first_batches`` (in
``accelerate/data_loader.py``) never keep the loader they are given: they read its dataset,
sampler, batch sampler and torch's constructor arguments -- every one of them through
``getattr(dataloader, name)`` -- and build a torch ``DataLoader`` of their own from them.
Respawn, ``task_timeout``, retries, the per-task seeds and our state are silently gone.

One of the attributes they read is ``multiprocessing_context``, which torch already makes a
property. Ours adds one check to its getter: whether the frame reading it belongs to
``accelerate``. Nothing of accelerate is patched and nothing is imported; our own code reads
the attribute once per worker pool, so the check costs nothing measurable.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from torch.utils.data import DataLoader as _TorchDataLoader

_TORCH_PROPERTY: Any = _TorchDataLoader.multiprocessing_context
# Set on a loader once it has been warned about (its instance dict; torch allows new names).
_WARNED = "_rebuild_warned"

# Which accelerate function rebuilt it -> what the user should call instead.
_ADVICE = {
    "prepare_data_loader": (
        "accelerate's prepare() replaced this resumable_loader.DataLoader with its own "
        "DataLoaderShard over torch's DataLoader. That drops what this loader adds: respawning "
        "dead or hung workers (task_timeout, max_task_attempts, retry), the per-batch seeds "
        "that make augmentations repeatable, and state_dict(): accelerator.save_state() saves "
        "no loader position with accelerate's default configuration, so a resumed run "
        "restarts the epoch. Keep the loader out of prepare() and call "
        "`loader = resumable_loader.integrations.accelerate.prepare_data_loader(accelerator, "
        "loader)` instead: it shards it over the processes, puts batches on the device and "
        "saves its state with accelerator.save_state()."
    ),
    "skip_first_batches": (
        "accelerate's skip_first_batches() (which transformers' Trainer calls on "
        "resume_from_checkpoint) rebuilt this resumable_loader.DataLoader as torch's "
        "DataLoader: it re-reads and throws away the skipped batches of a stream, and "
        "re-draws a map-style epoch's order from a fresh generator. Resume the loader with "
        "load_state_dict() instead; under the Trainer, use "
        "resumable_loader.integrations.transformers.ResumableTrainer, which does."
    ),
}


def _accelerate_caller(frame: Any) -> tuple[str, int] | None:
    """If ``frame`` is accelerate's, the accelerate function rebuilding the loader (as a key
    of ``_ADVICE``) and how many frames up the user's code starts; else None."""
    if not frame.f_globals.get("__name__", "").startswith("accelerate."):
        return None
    name = "prepare_data_loader"
    up = 1
    f = frame
    while f is not None and f.f_globals.get("__name__", "").startswith("accelerate."):
        if f.f_code.co_name in _ADVICE:
            name = f.f_code.co_name
        f = f.f_back
        up += 1
    return name, up


def _get(self: Any) -> Any:
    value = _TORCH_PROPERTY.fget(self)
    if not self.__dict__.get(_WARNED):
        found = _accelerate_caller(sys._getframe(1))
        if found is not None:
            name, up = found
            self.__dict__[_WARNED] = True
            # stacklevel: this getter, then the accelerate frames, then the user's call.
            warnings.warn(_ADVICE[name], UserWarning, stacklevel=up + 1)
    return value


def _set(self: Any, value: Any) -> None:
    _TORCH_PROPERTY.fset(self, value)


def watched_multiprocessing_context() -> property:
    """torch's ``multiprocessing_context`` property (its getter, setter and validation) with a
    getter that warns once per loader when accelerate reads it to rebuild the loader."""
    return property(_get, _set, doc=_TORCH_PROPERTY.__doc__)
