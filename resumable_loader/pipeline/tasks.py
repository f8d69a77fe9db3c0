"""Where an epoch's tasks come from, and what their results advance: one interface, two sources.

The dispatcher (``pipeline.dispatch``) keeps the table of outstanding tasks and sends them; a task
source decides what the tasks are, and owns everything that differs between map-style datasets
and streams:

                    MapTasks                               StreamTasks
  a task is         a batch of sample indices from the     fetch k of worker w's shard
                    sampler's order for the epoch
  assigned          torch's turns: task i to worker        round-robin over the shards not yet
                    i mod n (a worker being replaced is     dry, each task its shard's next
                    passed over)                            fetch number
  after a death     re-sent at once to the least-loaded     kept for the replacement, which
                    ready worker                            resumes the shard, then gets them
  poison            only that task                          the shard ends there this epoch
  position          consumed / ahead (reorder buffer); a    per shard, what was delivered, and
  (the state)       stateful sampler's state, drawn and     the worker whose batch comes next
                    outstanding tasks

A shard's position has one type, ``ShardPosition``, kept twice per worker: as *received* (where
a replacement worker resumes the shard) and as *delivered* (what the state records).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ..state.schema import ResumePoint, WorkerPosition
from .fetch import decode_state, merge_state
from .protocol import Delivery, Result, Status, StreamNote, StreamResume

if TYPE_CHECKING:
    from ..plans.index_plan import IndexPlan
    from .dispatch import Dispatcher, Task, TaskSource
    from .pin import PinStage
    from .reorder import ReorderBuffer
    from .supervisor.slots import WorkerSlot

_ADVANCES = (Status.OK, Status.ERROR)  # a fetch made (a batch or the user's error)
_ENDS = (Status.END, Status.POISON, Status.SKIPPED)  # no fetch: the shard ends


def encode_plain(state: Any) -> dict[Any, bytes]:
    """A dataset state as the main process keeps it: each top-level value pickled apart, so
    that a result's delta replaces only the keys it names."""
    if isinstance(state, dict):
        return {k: pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL) for k, v in state.items()}
    return {None: pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)}


class ShardPosition:
    """How far one stream worker's shard has got: ``fetched`` fetches, the latest dataset state
    among them (``state``, encoded, taken after ``state_at`` of them), and whether it is dry."""

    __slots__ = ("exhausted", "fetched", "state", "state_at")

    def __init__(
        self,
        fetched: int = 0,
        exhausted: bool = False,
        state: dict[Any, bytes] | None = None,
        state_at: int = 0,
    ) -> None:
        self.fetched = fetched
        self.exhausted = exhausted
        self.state: dict[Any, bytes] = state if state is not None else {}
        self.state_at = state_at

    @classmethod
    def of(cls, wp: WorkerPosition) -> ShardPosition:
        if wp.dataset_state is None:
            return cls(wp.delivered, wp.exhausted)
        return cls(wp.delivered, wp.exhausted, encode_plain(wp.dataset_state), wp.state_at)

    def copy(self) -> ShardPosition:
        return ShardPosition(self.fetched, self.exhausted, dict(self.state), self.state_at)

    def advance(self, status: Status, delta: Any, drained: bool) -> None:
        """One result (or a delivery decided by recovery) of this shard."""
        if status in _ADVANCES:
            self.fetched += 1
            if delta is not None:
                merge_state(self.state, delta)
                self.state_at = self.fetched
        if drained or status in _ENDS:
            self.exhausted = True

    def position(self) -> WorkerPosition:
        """As the state writes it (the dataset state decoded)."""
        if not self.state:
            return WorkerPosition(self.fetched, self.exhausted)
        return WorkerPosition(self.fetched, self.exhausted, decode_state(self.state), self.state_at)

    def resume(self) -> StreamResume | None:
        """Where a worker starting on this shard resumes: load the state, then replay the
        fetches after it without sending them (None: from the shard's start)."""
        if self.exhausted or (not self.state and not self.fetched):
            # An exhausted shard gets no task this epoch; restoring its end-of-stream state
            # would leave a persistent worker's dataset there for the next epoch, where the
            # uninterrupted run's dataset ran its iterator to the end.
            return None
        at = self.state_at if self.state else 0
        return StreamResume(self.state or None, True, at, self.fetched)


class MapTasks:
    """Map-style datasets: the sampler's batches, assigned in torch's turns.

    Args:
        plan: the loader's index plan (a stateful sampler's state is read from it).
        indices: the epoch's batches of indices, from the first new task on (``start``, or
            for a resumed stateful sampler the number of tasks it had drawn).
        start: the tasks consumed before this iterator: the first turn is ``start mod n``.
        n: the number of workers.
        seen: ``tid -> bool``, already delivered (a state taken with ``in_order=False``).
        stateful: a stateful sampler: its drawn, unconsumed tasks are part of the state.
        owed: such tasks drawn before the checkpoint and not consumed, (tid, indices).
    """

    unit = "samples"

    def __init__(
        self,
        plan: IndexPlan,
        indices: Iterator[Any],
        start: int,
        n: int,
        seen: Callable[[int], bool],
        stateful: bool,
        owed: Iterable[tuple[int, Any]] = (),
    ) -> None:
        self.plan = plan
        self.indices = indices
        self.done = False
        self.cycle = start % max(1, n)  # whose turn is next: task id mod n
        self.recovering: set[int] = set()  # slots replaced this epoch, not yet ready
        self.seen = seen
        self.drawn: dict[int, Any] | None = {} if stateful else None  # tid -> indices
        self.owed = sorted(owed)

    def begin(self, disp: Dispatcher) -> None:
        for tid, indices in self.owed:
            if not self.seen(tid) and self.drawn is not None:
                disp.add_owed(tid, indices)
                self.drawn[tid] = indices
        self.owed = []

    def _in_turn(self, disp: Dispatcher) -> WorkerSlot | None:
        """The worker whose turn it is (torch's order), passing over one being replaced."""
        slots = disp.slots
        n = len(slots)
        for step in range(n):
            slot = slots[(self.cycle + step) % n]
            if slot.ready:
                self.recovering.discard(slot.wid)
            elif not slot.alive or slot.wid in self.recovering:
                continue
            if disp.full(slot, n):
                continue
            self.cycle = (slot.wid + 1) % n
            return slot
        return None

    def _draw(self, disp: Dispatcher) -> tuple[int, Any] | None:
        while True:
            try:
                payload = next(self.indices)
            except StopIteration:
                self.done = True
                return None
            tid = disp.new_tid()
            if not self.seen(tid):
                return tid, payload

    def fill(self, disp: Dispatcher) -> None:
        while not self.done and disp.has_room():
            slot = self._in_turn(disp)
            if slot is None:
                return
            drawn = self._draw(disp)
            if drawn is None:
                return
            tid, payload = drawn
            if self.drawn is not None:
                self.drawn[tid] = payload
            disp.assign(slot, tid, payload)

    def resume(self, slot: WorkerSlot) -> StreamResume | None:
        return None

    def take_back(self, disp: Dispatcher, slot: WorkerSlot) -> None:
        # A map task's values depend on its id alone: any worker may run it, at once.
        self.recovering.add(slot.wid)
        disp.requeue(slot)

    def after_respawn(self, disp: Dispatcher, slot: WorkerSlot) -> list[tuple[int, Delivery]]:
        return []

    def poisoned(
        self, disp: Dispatcher, slot: WorkerSlot
    ) -> tuple[StreamNote | None, list[tuple[int, Delivery]]]:
        return None, []

    def received(self, slot: WorkerSlot, msg: Result) -> StreamNote | None:
        return None

    def delivered(self, tid: int, item: Delivery) -> None:
        if self.drawn is not None:
            self.drawn.pop(tid, None)

    def export(
        self, rp: ResumePoint, disp: Dispatcher, reorder: ReorderBuffer, pin: PinStage | None
    ) -> None:
        if self.drawn is not None:
            rp.stateful = True
            rp.sampler_state = self.plan.sampler_state()
            rp.drawn = disp.next_tid
            rp.sampler_done = self.done or bool(getattr(self.indices, "done", False))
            rp.outstanding = sorted(self.drawn.items())

    def describe(self, task: Task) -> str:
        return f"samples {task.payload} (task {task.tid})"


class StreamTasks:
    """Iterable datasets: each worker reads its own shard; task k of a worker is its k-th fetch.

    Args:
        n: the number of workers.
        rp: the position to resume from (None: the epoch's start).
    """

    unit = "fetches"

    def __init__(self, n: int, rp: ResumePoint | None) -> None:
        saved = rp.workers if rp is not None else []
        self.delivered_at = [
            ShardPosition.of(saved[w]) if w < len(saved) else ShardPosition() for w in range(n)
        ]
        self.received_at = [p.copy() for p in self.delivered_at]
        self.next_fetch = [p.fetched for p in self.delivered_at]
        self.cycle = rp.next_worker if rp is not None else 0
        self.done = False

    def begin(self, disp: Dispatcher) -> None:
        pass  # a shard's position travels in its worker's Epoch message

    def fill(self, disp: Dispatcher) -> None:
        slots = disp.slots
        n = len(slots)
        received = self.received_at
        # Shards end only when results arrive, never during one fill: count them once.
        active = sum(not p.exhausted for p in received)
        if not active:
            self.done = True
            return
        while disp.has_room():
            slot = None
            for step in range(n):
                cand = slots[(self.cycle + step) % n]
                if not received[cand.wid].exhausted and not disp.full(cand, active):
                    slot = cand
                    break
            if slot is None:
                return
            w = slot.wid
            disp.assign(slot, disp.new_tid(), self.next_fetch[w])
            self.next_fetch[w] += 1
            self.cycle = (w + 1) % n

    def resume(self, slot: WorkerSlot) -> StreamResume | None:
        return self.received_at[slot.wid].resume()

    def take_back(self, disp: Dispatcher, slot: WorkerSlot) -> None:
        pass  # they belong to the shard: its replacement gets them

    def after_respawn(self, disp: Dispatcher, slot: WorkerSlot) -> list[tuple[int, Delivery]]:
        if not self.received_at[slot.wid].exhausted:
            disp.resend_held(slot)
            return []
        # Its shard ran dry in a batch already received: what it still held can only be ENDs.
        # Resolve them here; a replacement would read the shard again.
        return self._end_held(disp, slot)

    def poisoned(
        self, disp: Dispatcher, slot: WorkerSlot
    ) -> tuple[StreamNote | None, list[tuple[int, Delivery]]]:
        # The shard cannot get past the poison batch: it ends there this epoch.
        self.received_at[slot.wid].exhausted = True
        return StreamNote(slot.wid, None, True), self._end_held(disp, slot)

    def _end_held(self, disp: Dispatcher, slot: WorkerSlot) -> list[tuple[int, Delivery]]:
        out = []
        for tid in sorted(slot.outstanding):
            disp.drop(tid)
            out.append((tid, Delivery(Status.END, None, StreamNote(slot.wid, None, True))))
        return out

    def received(self, slot: WorkerSlot, msg: Result) -> StreamNote | None:
        self.received_at[slot.wid].advance(msg.status, msg.state_delta, msg.drained)
        return StreamNote(slot.wid, msg.state_delta, msg.drained)

    def delivered(self, tid: int, item: Delivery) -> None:
        note = item.stream
        if note is not None:
            self.delivered_at[note.worker].advance(item.status, note.delta, note.drained)

    def export(
        self, rp: ResumePoint, disp: Dispatcher, reorder: ReorderBuffer, pin: PinStage | None
    ) -> None:
        rp.iterable = True
        rp.ahead = frozenset()
        rp.workers = [p.position() for p in self.delivered_at]
        rp.next_worker = self._next_worker(disp, reorder, pin)

    def _next_worker(self, disp: Dispatcher, reorder: ReorderBuffer, pin: PinStage | None) -> int:
        """The worker whose batch the caller gets next (round-robin continues from it): that
        of the lowest task not yet delivered, wherever it is -- outstanding, in the pin thread,
        or buffered for its turn."""
        best_tid, best_w = None, self.cycle
        for tid, task in disp.tasks.items():
            if best_tid is None or tid < best_tid:
                best_tid, best_w = tid, task.worker
        for tid, worker in pin.held().items() if pin is not None else ():
            if (best_tid is None or tid < best_tid) and worker is not None:
                best_tid, best_w = tid, worker
        for tid, item in reorder.items():
            if (best_tid is None or tid < best_tid) and item.stream is not None:
                best_tid, best_w = tid, item.stream.worker
        return best_w

    def describe(self, task: Task) -> str:
        return f"stream batch {task.payload} of worker {task.worker} (task {task.tid})"


__all__ = ["MapTasks", "ShardPosition", "StreamTasks", "TaskSource", "encode_plain"]
