"""Stage 5 of the pipeline: the reorder buffer between the workers and the user.

Results arrive in any order (workers run in parallel, a re-sent task finishes late). With
``in_order=True`` the buffer releases task ``rcvd`` only, then ``rcvd + 1``, ...; with
``in_order=False`` it releases whatever has arrived, in the order it arrived (as torch does),
and remembers which ids beyond ``rcvd`` went out early, so a checkpoint can say exactly what
was consumed.

Invariants (``check_invariants``):
  * every buffered id is >= rcvd and not in ``ahead``;
  * every id in ``ahead`` is > rcvd;
  * ids < rcvd have all been released (or skipped), exactly once.
A result for an id already released or already buffered is a duplicate (a worker that died
after sending) and is dropped, counted in ``duplicates``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from .protocol import Delivery


@dataclass(frozen=True)
class ReorderStatistics:
    rcvd: int
    buffered: int
    ahead: int
    duplicates: int


class ReorderBuffer:
    __slots__ = ("_ahead", "_arrived", "_buf", "duplicates", "in_order", "rcvd")

    def __init__(self, in_order: bool, start: int = 0, ahead: frozenset[int] = frozenset()):
        self.in_order = in_order
        self.rcvd = start  # every id below this has been released
        self._buf: dict[int, Delivery] = {}
        self._arrived: collections.deque[int] = collections.deque()  # in_order=False: ids in _buf
        self._ahead: set[int] = set(ahead)  # released ids > rcvd (in_order=False only)
        self.duplicates = 0
        self._advance()

    def __len__(self) -> int:
        """Results buffered, waiting for their turn."""
        return len(self._buf)

    def seen(self, tid: int) -> bool:
        """Whether ``tid`` was already released or is waiting here."""
        return tid < self.rcvd or tid in self._ahead or tid in self._buf

    def put(self, tid: int, item: Delivery) -> bool:
        """Buffer ``item`` for ``tid``; False (and counted) if it is a duplicate."""
        if self.seen(tid):
            self.duplicates += 1
            return False
        self._buf[tid] = item
        if not self.in_order:
            self._arrived.append(tid)
        return True

    def ready(self) -> bool:
        if self.in_order:
            return self.rcvd in self._buf
        return bool(self._buf)

    def pop(self) -> tuple[int, Delivery]:
        """Release the next item; call only when ``ready()``."""
        if self.in_order:
            tid = self.rcvd
            item = self._buf.pop(tid)
            self.rcvd = tid + 1
        else:
            tid = self._arrived.popleft()
            item = self._buf.pop(tid)
            if tid == self.rcvd:
                self.rcvd = tid + 1
            else:
                self._ahead.add(tid)
        self._advance()
        return tid, item

    def _advance(self) -> None:
        ahead = self._ahead
        while self.rcvd in ahead:
            ahead.discard(self.rcvd)
            self.rcvd += 1

    @property
    def ahead(self) -> frozenset[int]:
        """Ids > rcvd already released (in_order=False)."""
        return frozenset(self._ahead)

    def items(self) -> list[tuple[int, Delivery]]:
        """The buffered (id, item) pairs, lowest id first."""
        return sorted(self._buf.items(), key=lambda kv: kv[0])

    def buffered_ids(self) -> list[int]:
        return sorted(self._buf)

    def statistics(self) -> ReorderStatistics:
        return ReorderStatistics(self.rcvd, len(self._buf), len(self._ahead), self.duplicates)

    def check_invariants(self) -> None:
        for tid in self._buf:
            assert tid >= self.rcvd, f"buffered id {tid} is below rcvd {self.rcvd}"
            assert tid not in self._ahead, f"buffered id {tid} was already released"
        for tid in self._ahead:
            assert tid > self.rcvd, f"released-ahead id {tid} is not above rcvd {self.rcvd}"
        if not self.in_order:
            assert sorted(self._arrived) == sorted(self._buf), "arrival queue and buffer disagree"
