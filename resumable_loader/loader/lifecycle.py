"""An iterator's life, and the position that outlives it.

A training loop leaves the ``for`` in many ways: the epoch ends (StopIteration), or the caller
breaks, slices with ``islice``, raises in the loop body, is interrupted by Ctrl-C or a SIGTERM
handler, or simply drops the iterator. In every case ``loader.state_dict()`` must still say
exactly what that iterator delivered, until the next ``iter(loader)`` begins -- but holding
that position must not keep worker processes, pipes or shared memory alive.

So the position is not the iterator's: it is a ``Cursor``, which reads the live position from
the stages that know it (the reorder buffer, the dispatcher, the task source) while the
iterator runs, and is *frozen* into plain data when the iterator ends -- before the workers are
released, from the iterator's finalizer, so a dropped iterator hands over its position without
anyone calling ``close()``. The loader keeps the cursor of its latest iterator.

Life of an iterator (``Life``), with the transitions that lead out of ``OPEN``:

    OPEN ──StopIteration──► FINISHED     the epoch was delivered to its end
         ──close/supersede─► ABANDONED   left before its end: a newer iter(), load_state_dict(),
         ──interrupt──────►              or a KeyboardInterrupt/SystemExit inside next()
         ──loader.close()─► CLOSED
         ──fatal error────► BROKEN       every later next() raises that error again

Each state but OPEN is final. ``BROKEN`` is checked first, so a broken iterator keeps raising
its own error rather than a generic "closed".
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable
from typing import Any


class Life(enum.Enum):
    OPEN = "open"
    FINISHED = "finished"
    ABANDONED = "abandoned"
    BROKEN = "broken"
    CLOSED = "closed"


class Cursor:
    """The position of one epoch's iterator, as plain data, able to outlive the iterator.

    Args:
        epoch: the epoch the iterator delivers.
        read: ``() -> ResumePoint``, the live position. It must not reference the iterator
            (only the stages it reads), so that the iterator can be freed by reference
            counting.

    Invariant: exactly one of ``_read`` and ``_frozen`` is set.
    """

    __slots__ = ("_frozen", "_read", "epoch", "finished", "tail")

    def __init__(self, epoch: int, read: Callable[[], Any]) -> None:
        self.epoch = epoch
        self.finished = False  # the iterator raised StopIteration
        # A Stream's epoch that the ranks' agreement ended with batches left on this rank:
        # the tail record (``loader.stream_ranks``); the next epoch starts from it.
        self.tail: dict[str, Any] | None = None
        self._read: Callable[[], Any] | None = read
        self._frozen: Any = None

    def bind(self, read: Callable[[], Any]) -> None:
        """Read the position from other stages from now on (they were built after the cursor)."""
        if self._read is not None:
            self._read = read

    @property
    def frozen(self) -> bool:
        return self._read is None

    def position(self) -> Any:
        """The position now: live while the iterator runs, a copy of the frozen one after."""
        if self._read is not None:
            return self._read()
        assert self._frozen is not None
        return copy.deepcopy(self._frozen)

    def freeze(self) -> None:
        """Take the position one last time and let go of the stages (idempotent)."""
        if self._read is not None:
            # If reading fails (a user sampler's state_dict() raising), the cursor stays live,
            # so that state_dict() raises that error too instead of inventing a position.
            self._frozen = self._read()
            self._read = None
