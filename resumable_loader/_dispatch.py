"""Stage 2 of the pipeline: the dispatcher -- task ids, the outstanding table, assignment.

Task ids are the positions of batches in the epoch (``send_idx`` is the next new one). A task
is *outstanding* from the moment it is drawn until its result reaches the main process.

Assignment is torch's while the workers are healthy: task i goes to worker i mod n, skipping
workers that cannot take it (a stream worker whose shard ran dry), so ``get_worker_info().id``
inside a batch is what torch's loader would give. It deviates only to recover: a map-style
task's values depend on its id alone, so a dead worker's tasks go straight to the least-loaded
survivors (ahead of their prefetched work: workers run the lowest id first), and its turn is
skipped until its replacement is ready. Stream tasks belong to one worker's shard, so a dead
stream worker's tasks wait for its replacement.

Invariants (``check_invariants``):
  * every outstanding task is in exactly one place: in the ``outstanding`` list of the live
    slot it was sent to, in ``resend`` (map, waiting for a worker), or in the ``outstanding``
    list of a DEAD stream slot (waiting for its replacement);
  * no outstanding id has been released by the reorder buffer.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator
from typing import Any

from ._protocol import Epoch, StreamResume, TaskMsg
from ._supervisor import READY_STATE, STARTING, Supervisor, WorkerSlot


def resume_message(state: dict[Any, bytes], state_at: int, count: int) -> StreamResume | None:
    """Where a stream worker resumes: load ``state`` (taken after ``state_at`` fetches),
    then replay the fetches up to ``count`` without sending them."""
    if not state and not count:
        return None
    return StreamResume(state or None, True, state_at if state else 0, count)


class Task:
    __slots__ = ("failures", "payload", "tid", "worker")

    def __init__(self, tid: int, payload: Any, worker: int = -1) -> None:
        self.tid = tid
        self.payload = payload  # sample indices (map) or fetch number k (stream)
        self.worker = worker  # assigned slot, -1 while waiting to be re-sent
        self.failures: list[str] = []  # one line per worker death while running it


class Dispatcher:
    def __init__(
        self,
        sup: Supervisor,
        iterable: bool,
        prefetch_factor: int,
        source: Iterator[Any],
        start_tid: int,
        seen: Any,
        backlog: Any,
        next_worker: int = 0,
        in_order: bool = True,
    ) -> None:
        self.sup = sup
        # in_order=False: like torch, a worker holding its share of the prefetch limit is
        # passed over for the next one in turn, so a slow batch does not hold up the others.
        self.in_order = in_order
        self.iterable = iterable
        self.limit = max(1, prefetch_factor * len(sup.slots))
        self.source = source
        self.source_done = False
        self.send_idx = start_tid
        self._seen = seen  # tid -> already released (a checkpoint taken with in_order=False)
        self._backlog = backlog  # () -> results received but not yet released
        self.tasks: dict[int, Task] = {}
        self.resend: list[int] = []  # map tids owed a worker, lowest first
        # The slot whose turn is next: a map task's id mod n (a resume continues the turns),
        # a stream's saved next worker.
        self.cycle = next_worker if iterable else start_tid % max(1, len(sup.slots))
        self.recovering: set[int] = set()  # map: slots respawned this epoch, not yet ready
        self.gen = 0  # epoch generation stamped on messages
        self.epoch = 0  # the epoch, and the base seed, every Epoch message carries
        self.base_seed = 0
        self.sample_seed: int | None = None  # seed_per_sample: what samples' seeds derive from
        self.record: dict[int, Any] | None = None  # stateful samplers: tid -> indices drawn

    # ---- assignment ----------------------------------------------------------------------
    def _eligible(self) -> list[WorkerSlot]:
        slots = self.sup.slots
        ready = [s for s in slots if s.state == READY_STATE]
        return ready if ready else [s for s in slots if s.state == STARTING]

    def _least_loaded(self, cap: int | None) -> WorkerSlot | None:
        best = None
        for slot in self._eligible():
            n = len(slot.outstanding)
            if cap is not None and n >= cap:
                continue
            if best is None or n < len(best.outstanding):
                best = slot
        return best

    def _full(self, slot: WorkerSlot, active: int) -> bool:
        """in_order=False only: whether ``slot`` holds its share of the prefetch limit."""
        return not self.in_order and len(slot.outstanding) >= self.limit // max(1, active)

    def _in_turn(self) -> WorkerSlot | None:
        """The map worker whose turn it is (torch's order), skipping one being replaced."""
        slots = self.sup.slots
        n = len(slots)
        for step in range(n):
            slot = slots[(self.cycle + step) % n]
            if slot.state == READY_STATE:
                self.recovering.discard(slot.wid)
            elif slot.state != STARTING or slot.wid in self.recovering:
                continue
            if self._full(slot, n):
                continue
            self.cycle = (slot.wid + 1) % n
            return slot
        return None

    def _send(self, slot: WorkerSlot, task: Task) -> None:
        task.worker = slot.wid
        if not slot.outstanding:
            slot.busy_since = time.monotonic()
        slot.outstanding.append(task.tid)
        if slot.alive:
            self.sup.send(slot, TaskMsg(self.gen, task.tid, task.payload))

    def add_owed(self, tid: int, payload: Any) -> None:
        """A task drawn before a checkpoint and not consumed: send it again (map)."""
        self.tasks[tid] = Task(tid, payload)
        heapq.heappush(self.resend, tid)

    def fill(self) -> None:
        """Send re-sent tasks at once, then new tasks up to the prefetch limits."""
        tasks = self.tasks
        while self.resend:
            slot = self._least_loaded(None)
            if slot is None:
                break
            self._send(slot, tasks[heapq.heappop(self.resend)])
        if self.iterable:
            self._fill_stream()
            return
        while not self.source_done and len(tasks) + self._backlog() < self.limit:
            slot = self._in_turn()
            if slot is None:
                return
            while True:
                try:
                    payload = next(self.source)
                except StopIteration:
                    self.source_done = True
                    return
                tid = self.send_idx
                self.send_idx = tid + 1
                if not self._seen(tid):
                    break
            task = Task(tid, payload)
            tasks[tid] = task
            if self.record is not None:
                self.record[tid] = payload
            self._send(slot, task)

    def _fill_stream(self) -> None:
        slots = self.sup.slots
        n = len(slots)
        # Shards end only when results arrive, never during one fill: count them once.
        active = sum(not s.exhausted for s in slots)
        if not active:
            self.source_done = True
            return
        while len(self.tasks) + self._backlog() < self.limit:
            slot = None
            for step in range(n):
                cand = slots[(self.cycle + step) % n]
                if not cand.exhausted and not self._full(cand, active):
                    slot = cand
                    break
            if slot is None:
                return
            tid = self.send_idx
            self.send_idx = tid + 1
            task = Task(tid, slot.next_k)
            slot.next_k += 1
            self.tasks[tid] = task
            self._send(slot, task)
            self.cycle = (slot.wid + 1) % n

    def send_epoch(self, slot: WorkerSlot) -> None:
        """Tell a (new or respawned) worker which epoch it serves, and for a stream, where its
        shard stands: the state it last delivered, and the fetches to replay after it."""
        resume = None
        if self.iterable and not slot.exhausted:
            # An exhausted worker gets no task this epoch; restoring its end-of-stream state
            # would leave a persistent worker's dataset there for the next epoch, where the
            # uninterrupted run's dataset ran its iterator to the end.
            resume = resume_message(slot.recv_state, slot.recv_at, slot.recv_count)
        self.sup.send(slot, Epoch(self.gen, self.epoch, self.base_seed, resume, self.sample_seed))

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
        says so (STARTED, recorded in ``slot.running``).
        """
        tids = sorted(slot.outstanding)
        running = slot.running if slot.running in slot.outstanding else None
        if running is None and slot.outstanding:
            running = slot.outstanding[0]
        blamed = self.tasks[running] if running is not None else None
        if not self.iterable:
            self.recovering.add(slot.wid)
            slot.outstanding.clear()
            for tid in tids:
                self.tasks[tid].worker = -1
                heapq.heappush(self.resend, tid)
        return blamed, tids

    def resend_stream(self, slot: WorkerSlot) -> None:
        """After a stream slot's respawn: send its tasks again, in order."""
        for tid in sorted(slot.outstanding):
            self.sup.send(slot, TaskMsg(self.gen, tid, self.tasks[tid].payload))
        slot.busy_since = time.monotonic()

    def drop(self, tid: int) -> Task | None:
        """Remove a task from the table (it was given up as poison)."""
        task = self.tasks.pop(tid, None)
        if task is None:
            return None
        if tid in self.resend:
            self.resend.remove(tid)
            heapq.heapify(self.resend)
        for slot in self.sup.slots:
            if tid in slot.outstanding:
                slot.outstanding.remove(tid)
        return task

    def check_invariants(self, released: Any) -> None:
        seen: dict[int, str] = {}
        for slot in self.sup.slots:
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
