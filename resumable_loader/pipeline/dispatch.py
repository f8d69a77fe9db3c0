"""Stage 2 of the pipeline: the dispatcher -- task ids, the outstanding table, sending.

Task ids are the positions of batches in the epoch (``next_tid`` is the next new one). A task
is *outstanding* from the moment it is drawn until its result reaches the main process.

Which tasks there are and whom they go to is the task source's (``pipeline.tasks``): torch's turns
while the workers are healthy (task i to worker i mod n, passing over a stream worker whose
shard ran dry), so ``get_worker_info().id`` inside a batch is what torch's loader would give.
They deviate only to recover: a dead map-style worker's tasks are queued here (``resend``) and
go straight to the least-loaded survivors (ahead of their prefetched work: workers run the
lowest id first); a dead stream worker's tasks stay on its slot for its replacement.

Invariants (``check_invariants``):
  * every outstanding task is in exactly one place: in the ``outstanding`` list of the live
    slot it was sent to, in ``resend`` (map, waiting for a worker), or in the ``outstanding``
    list of a DEAD stream slot (waiting for its replacement);
  * no outstanding id has been released by the reorder buffer.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .protocol import Delivery, Epoch, Result, StreamNote, StreamResume, TaskMsg
from .supervisor.slots import WorkerSlot
from .supervisor.supervisor import Supervisor

if TYPE_CHECKING:
    from ..state.schema import ResumePoint
    from .pin import PinStage
    from .reorder import ReorderBuffer


class Task:
    __slots__ = ("failures", "payload", "tid", "worker")

    def __init__(self, tid: int, payload: Any, worker: int = -1) -> None:
        self.tid = tid
        self.payload = payload  # sample indices (map) or fetch number k (stream)
        self.worker = worker  # assigned slot, -1 while waiting to be re-sent
        self.failures: list[str] = []  # one line per worker death while running it


class TaskSource(Protocol):
    """What the dispatcher, recovery and the iterator ask of an epoch's tasks."""

    done: bool  # no new task will be drawn this epoch
    unit: str  # what a task's payload lists, for logs: "samples" or "fetches"

    def begin(self, disp: Dispatcher) -> None:
        """The epoch starts: put tasks owed from the resumed position into the table."""

    def fill(self, disp: Dispatcher) -> None:
        """Draw new tasks and assign them while the prefetch window has room."""

    def resume(self, slot: WorkerSlot) -> StreamResume | None:
        """The position a (new or replaced) worker starts the epoch from."""

    def take_back(self, disp: Dispatcher, slot: WorkerSlot) -> None:
        """A worker died: place the tasks it held."""

    def after_respawn(self, disp: Dispatcher, slot: WorkerSlot) -> list[tuple[int, Delivery]]:
        """Its replacement started: send it what it should do; deliveries decided here."""

    def poisoned(
        self, disp: Dispatcher, slot: WorkerSlot
    ) -> tuple[StreamNote | None, list[tuple[int, Delivery]]]:
        """A task of ``slot`` was given up: the poison item's note, and other deliveries."""

    def received(self, slot: WorkerSlot, msg: Result) -> StreamNote | None:
        """A result arrived from ``slot``; the note its delivery carries."""

    def delivered(self, tid: int, item: Delivery) -> None:
        """Task ``tid`` was handed to the caller (or raised to them)."""

    def export(
        self, rp: ResumePoint, disp: Dispatcher, reorder: ReorderBuffer, pin: PinStage | None
    ) -> None:
        """Write the position into the state's resume point."""

    def describe(self, task: Task) -> str:
        """The task, in an error message."""


class Dispatcher:
    """The table of outstanding tasks, and the sending of tasks and epochs.

    What the tasks are, whom they go to and what a death does to them is the task source's
    (``pipeline.tasks``: map-style or stream); the dispatcher keeps where each task is.

    Args:
        sup: the supervisor (its slots, ``send``).
        source: the epoch's task source.
        prefetch_factor: tasks in flight per worker (the window is this times the workers).
        start_tid: the first new task id.
        backlog: ``() -> int``, results received but not yet released to the caller.
        in_order: False: a worker holding its share of the window is passed over (torch's).
    """

    def __init__(
        self,
        sup: Supervisor,
        source: TaskSource,
        prefetch_factor: int,
        start_tid: int,
        backlog: Callable[[], int],
        in_order: bool = True,
    ) -> None:
        self.sup = sup
        self.slots: list[WorkerSlot] = sup.slots
        self.source = source
        # in_order=False: like torch, a worker holding its share of the prefetch limit is
        # passed over for the next one in turn, so a slow batch does not hold up the others.
        self.in_order = in_order
        self.limit = max(1, prefetch_factor * len(self.slots))
        self.next_tid = start_tid
        self._backlog = backlog
        self.tasks: dict[int, Task] = {}
        self.resend: list[int] = []  # tids owed any worker (map), lowest first
        self.gen = 0  # epoch generation stamped on messages
        self.epoch = 0  # the epoch, and the base seed, every Epoch message carries
        self.base_seed = 0
        self.sample_seed: int | None = None  # seed_per_sample: what samples' seeds derive from
        self.data_plan: dict[str, Any] | None = None  # a Mixture's plan (see Epoch)

    # ---- what task sources call ----------------------------------------------------------
    def has_room(self) -> bool:
        """Whether the prefetch window takes another task."""
        return len(self.tasks) + self._backlog() < self.limit

    def new_tid(self) -> int:
        tid = self.next_tid
        self.next_tid = tid + 1
        return tid

    def full(self, slot: WorkerSlot, active: int) -> bool:
        """in_order=False only: whether ``slot`` holds its share of the prefetch limit."""
        return not self.in_order and len(slot.outstanding) >= self.limit // max(1, active)

    def assign(self, slot: WorkerSlot, tid: int, payload: Any) -> None:
        """A new task: record it and send it to ``slot``."""
        task = Task(tid, payload)
        self.tasks[tid] = task
        self._send(slot, task)

    def add_owed(self, tid: int, payload: Any) -> None:
        """A task drawn before a checkpoint and not consumed: send it again (map)."""
        self.tasks[tid] = Task(tid, payload)
        heapq.heappush(self.resend, tid)

    def requeue(self, slot: WorkerSlot) -> None:
        """Take a dead slot's tasks back, to go to any worker (map)."""
        for tid in slot.outstanding:
            self.tasks[tid].worker = -1
            heapq.heappush(self.resend, tid)
        slot.outstanding.clear()

    def resend_held(self, slot: WorkerSlot) -> None:
        """After a slot's respawn: send it the tasks it holds again, in order (stream)."""
        for tid in sorted(slot.outstanding):
            self.sup.send(slot, TaskMsg(self.gen, tid, self.tasks[tid].payload))
        slot.busy_since = time.monotonic()

    # ---- assignment ----------------------------------------------------------------------
    def _eligible(self) -> list[WorkerSlot]:
        ready = [s for s in self.slots if s.ready]
        return ready if ready else [s for s in self.slots if s.alive]

    def _least_loaded(self) -> WorkerSlot | None:
        best = None
        for slot in self._eligible():
            if best is None or len(slot.outstanding) < len(best.outstanding):
                best = slot
        return best

    def _send(self, slot: WorkerSlot, task: Task) -> None:
        task.worker = slot.wid
        if not slot.outstanding:
            slot.busy_since = time.monotonic()
        slot.outstanding.append(task.tid)
        if slot.alive:
            self.sup.send(slot, TaskMsg(self.gen, task.tid, task.payload))

    def fill(self) -> None:
        """Send re-sent tasks at once, then new tasks up to the prefetch limits."""
        while self.resend:
            slot = self._least_loaded()
            if slot is None:
                break
            self._send(slot, self.tasks[heapq.heappop(self.resend)])
        self.source.fill(self)

    def send_epoch(self, slot: WorkerSlot) -> None:
        """Tell a (new or respawned) worker which epoch it serves, and where it resumes (a
        stream's shard: the state last received from it, and the fetches to replay after it)."""
        resume = self.source.resume(slot)
        self.sup.send(
            slot,
            Epoch(self.gen, self.epoch, self.base_seed, resume, self.sample_seed, self.data_plan),
        )

    # ---- results and deaths --------------------------------------------------------------
    def on_result(self, slot: WorkerSlot, tid: int) -> Task | None:
        """The task a result completes, or None for a duplicate/stale result."""
        task = self.tasks.get(tid)
        if task is None or task.worker != slot.wid:
            return None
        del self.tasks[tid]
        out = slot.outstanding
        if out and out[0] == tid:
            out.popleft()
        else:
            out.remove(tid)
        slot.busy_since = time.monotonic()
        return task

    def on_death(self, slot: WorkerSlot) -> tuple[Task | None, list[int]]:
        """Take back a dead slot's tasks; returns (the task it was running, all its tids).

        The task it was running is the earliest sent of those it held: a worker runs tasks in
        arrival order, except that it takes a lower id first (a re-sent task), and then it
        says so (STARTED, recorded in ``slot.running``). Where the tasks go is the source's.
        """
        tids = sorted(slot.outstanding)
        running = slot.running if slot.running in slot.outstanding else None
        if running is None and slot.outstanding:
            running = slot.outstanding[0]
        blamed = self.tasks[running] if running is not None else None
        self.source.take_back(self, slot)
        return blamed, tids

    def drop(self, tid: int) -> Task | None:
        """Remove a task from the table (it was given up as poison)."""
        task = self.tasks.pop(tid, None)
        if task is None:
            return None
        if tid in self.resend:
            self.resend.remove(tid)
            heapq.heapify(self.resend)
        for slot in self.slots:
            if tid in slot.outstanding:
                slot.outstanding.remove(tid)
        return task

    def check_invariants(self, released: Callable[[int], bool]) -> None:
        seen: dict[int, str] = {}
        for slot in self.slots:
            for tid in slot.outstanding:
                assert tid not in seen, f"task {tid} outstanding twice ({seen[tid]}, {slot})"
                seen[tid] = repr(slot)
        for tid in self.resend:
            assert tid not in seen, f"task {tid} both queued for re-send and outstanding"
            seen[tid] = "resend"
        assert set(seen) == set(self.tasks), (
            f"task table {sorted(self.tasks)} != placed tasks {sorted(seen)}"
        )
        for tid in self.tasks:
            assert not released(tid), f"outstanding task {tid} was already released"
