"""Say so when a Hugging Face ``datasets`` stream with a shuffle buffer is checkpointed (no
framework imports).

``datasets.IterableDataset.shuffle(buffer_size=n)`` keeps up to ``n`` examples in memory and
draws from them at random (``BufferShuffledExamplesIterable`` in
``datasets/iterable_dataset.py``). Its ``state_dict()`` records where the source stands, not
the buffer's content: ``load_state_dict`` logs "Loading a state dict of a shuffle buffer of a
dataset without the buffer content" and refills the buffer from there, so the examples it
held at the checkpoint are never trained. No loader can resume such a stream exactly, and
``datasets`` says so only in a log line; the loader says so with a warning when a state is
taken or loaded.

``datasets`` is looked up in ``sys.modules``, never imported: a stream of it exists only if
the user imported it.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

# Set on a loader once it has been warned about (its instance dict; torch allows new names).
_WARNED = "_shuffle_buffer_warned"


def shuffle_buffer_size(dataset: Any) -> int | None:
    """The buffer size of the shuffle buffer in ``dataset``'s pipeline, if ``dataset`` is a
    ``datasets.IterableDataset`` with one (``.shuffle(buffer_size=...)``); else None."""
    hf = sys.modules.get("datasets")
    if hf is None or not isinstance(dataset, getattr(hf, "IterableDataset", ())):
        return None
    module = sys.modules.get("datasets.iterable_dataset")
    buffered = getattr(module, "BufferShuffledExamplesIterable", None)
    if buffered is None:
        return None
    # The pipeline is a tree of examples iterables: one source (ex_iterable) or several
    # (ex_iterables, for interleave/concatenate).
    todo = [getattr(dataset, "_ex_iterable", None)]
    while todo:
        ex = todo.pop()
        if ex is None:
            continue
        if isinstance(ex, buffered):
            return int(ex.buffer_size)
        todo.append(getattr(ex, "ex_iterable", None))
        todo.extend(getattr(ex, "ex_iterables", None) or ())
    return None


def warn_shuffle_buffer(loader: Any, when: str) -> None:
    """Warn once per loader (``RuntimeWarning``) when its dataset is a ``datasets`` stream
    with a shuffle buffer, whose content no state holds. ``when``: what the caller is doing
    ("saving" or "resuming"), for the message."""
    if loader.__dict__.get(_WARNED):
        return
    size = shuffle_buffer_size(loader.dataset)
    if size is None:
        return
    loader.__dict__[_WARNED] = True
    warnings.warn(
        f"{when} a loader over a Hugging Face datasets stream shuffled with a buffer "
        f"(.shuffle(buffer_size={size})): datasets does not keep the buffer's content in its "
        "state, so a resume refills the buffer and never trains the up to "
        f"{size} examples it held at the checkpoint (datasets only logs 'Loading a state "
        "dict of a shuffle buffer of a dataset without the buffer content'). No loader can "
        "resume this exactly. To resume exactly, drop the buffer: shuffle a map-style "
        "datasets.Dataset before .to_iterable_dataset(num_shards=...), and call "
        "set_epoch(epoch) on the stream, which reshuffles its shards each epoch.",
        RuntimeWarning,
        stacklevel=3,
    )
