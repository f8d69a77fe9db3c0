"""The supervisor: starts, watches, replaces and stops the worker processes.

  dispatcher ─TASK─► slot.task_conn ─► worker process ─► slot.result_conn ─► poll() ─► iterator
                                              │ dies / hangs                  Arrived(slot, Result)
    poll() waits on ─ every result socket     ▼
                    ─ every process sentinel     Died(slot, DeathReport) ─► recovery decides;
                    ─ a SIGCHLD wake-up pipe       it calls respawn(), the task source re-sends
                    ─ (timeout) liveness polling + task_timeout
                                                 Lost(slot, Undecodable): a result that came whole
                                                 and cannot be rebuilt here; the worker is fine

Detection is by waiting, not guessing: a sentinel becomes readable when the process exits; a
SIGCHLD handler (``hooks.ChildSignal``) writes to the wake-up pipe so a death is seen even while
the user is busy; and every POLL_INTERVAL_S the slots are checked with ``is_alive()`` for what
the others miss (a grandchild holding the sentinel open). A timeout alone never declares a
worker dead: only ``task_timeout`` does, and then the worker is killed first, so "dead" is
always a fact. ``task_timeout`` counts the job's running time, not a pause of this process nor
a worker's wait for a CPU (``clocks``).
The shared segments batches travel in are the supervisor's (``transport.pools.LoaderPool``):
each TASK sent carries a grant, each segment's fd goes to a worker process once, over its
result socket, before the first task that grants it; a grant ends with the task's result, a
result of a later generation, or the worker's death (``mark_dead``).
Nothing in /dev/shm is ever deleted here: a dead worker's leftovers cannot be told from
another job's segments or from a batch passed on (docs/recovery.md).

Slot states (one object per worker id, kept across respawns; ``slots.WorkerSlot``):
    STARTING ──READY msg──► READY ──death/hang──► DEAD ──respawn()──► STARTING
    any ──shutdown()──► STOPPED
A STARTING worker sends BOOTED when it starts running our code; with task_timeout set, it is
hung if worker_init_fn then runs longer than task_timeout, or if BOOTED has not come
within max(task_timeout, clocks.BOOT_TIMEOUT_S) of the start.
Invariants (``check_invariants``): a slot in STARTING/READY has a process and watched fds; a
DEAD or STOPPED slot has neither; ``outstanding`` lists the task ids sent to the slot and not
yet received, in send order, each once. ``statistics()``: processes started, deaths reported
(and hangs killed), and each slot's pid and state.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import pickle
import select
import signal
import socket
import threading
import time
from typing import Any

from ...core.errors import WorkerCrashError
from ..protocol import (
    Booted,
    InitError,
    Ready,
    Result,
    Started,
    Stop,
    TaskMsg,
    ToWorker,
    result_from_wire,
)
from ..transport import LoaderPool, Receiver, Undecodable
from ..transport.taskpipe import send_task
from ..worker import WorkerSpec, worker_main
from .advice import storm_message, warn_seeding, warn_unpicklable
from .clocks import credit_cpu_wait, discount_pauses, hang_clock, mark_cpu_wait
from .events import Arrived, DeathReport, Died, Event, Lost, death_cause
from .hooks import ChildSignal, Continued, fds_to_close, register_fds, unregister_fds
from .slots import DEAD, READY_STATE, STARTING, STOPPED, SupervisorStatistics, WorkerSlot

log = logging.getLogger("resumable_loader")

# Liveness polling catches deaths that the sentinel misses (a worker's own child keeps the
# sentinel pipe open). Half a second bounds that rare delay without costing anything visible.
POLL_INTERVAL_S = 0.5
# On shutdown, idle workers exit at once on STOP; a worker busy in user code gets this long to
# finish its batch before it is killed (its result would be thrown away anyway).
SHUTDOWN_GRACE_S = 1.0
# A worker that does not exit within this after SIGKILL is stuck in the kernel (D state);
# give up waiting rather than hang the caller.
KILL_JOIN_S = 5.0
# Respawn-storm guard: more respawns than max(this, 4 per worker) with not one result received
# in between is not a flaky worker but a broken setup (every worker OOM-killed as it starts, or
# killed as hung because it cannot start or load a batch within task_timeout); raise instead of
# looping. Deaths between results are left to the per-task poison limit.
STORM_MIN_RESPAWNS = 20

# The loader's segment pool (issue #26; ``transport.pools.LoaderPool``): on unless a benchmark
# compares without it (then each worker keeps a pool of its own).
LOADER_POOL = True


# ---- the supervisor ------------------------------------------------------------------------------
# One object, because its poller, its fd table and its slots change together: every start,
# death and shutdown touches all three, and check_invariants() states them as one. What needs
# none of that state lives in the modules beside this one, or at the end of this one.
class Supervisor:
    """Owns the worker processes of one loader (or of one epoch, without persistent workers).

    Args:
        ctx: the multiprocessing context.
        make_spec: ``wid -> WorkerSpec``.
        num_workers: how many worker slots.
        task_timeout: seconds a task may run before its worker is declared hung, or None.
        fork_lock: held by the pin thread while pinning; taken here around every start.
    """

    def __init__(
        self,
        ctx: Any,
        make_spec: Any,
        num_workers: int,
        task_timeout: float | None,
        fork_lock: threading.Lock,
    ) -> None:
        self.ctx = ctx if ctx is not None else multiprocessing.get_context()
        # The process whose workers these are. A copy of this object in a forked child (a
        # worker of another loader, a user's os.fork) owns none of them: see here().
        self.pid = os.getpid()
        self._is_fork = self.ctx.get_start_method() == "fork"
        self.make_spec = make_spec
        self.slots = [WorkerSlot(w) for w in range(num_workers)]
        self.task_timeout = task_timeout
        self.fork_lock = fork_lock
        self._poller = select.poll()
        self._fds: dict[int, tuple[str, WorkerSlot | None]] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        register_fds(self._wake_r, self._wake_w)
        self._watch(self._wake_r, "wake", None)
        ChildSignal.add(self._wake_w)
        Continued.add()
        self._last_poll = time.monotonic()
        self._seen = self._last_poll  # when this supervisor last looked at the clock
        self.paused_s = 0.0  # this process's pauses seen so far, not counted as running time
        self.respawns_without_progress = 0
        # Why the workers were respawned since the last result (DeathReport.key -> count),
        # and the last such death: what the storm error reports.
        self._storm_causes: collections.Counter[str] = collections.Counter()
        self._storm_last = ""
        self._starts = self._deaths = self._killed = 0
        self._warned_seeding = False
        self.closed = False
        # The segments lent to the workers (made at the first start, when the prefetch
        # window is known); None without memfd, under file_system, or with LOADER_POOL off.
        self.pool: LoaderPool | None = None
        self._pool_gen: dict[int, int] = {}  # worker id -> latest generation it sent

    # ---- fd bookkeeping ------------------------------------------------------------------
    def _watch(self, fd: int, kind: str, slot: WorkerSlot | None) -> None:
        self._fds[fd] = (kind, slot)
        self._poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)

    def _unwatch(self, fd: int) -> None:
        if self._fds.pop(fd, None) is not None:
            try:
                self._poller.unregister(fd)
            except (KeyError, ValueError):
                pass

    def watch_extra(self, fd: int, name: str) -> None:
        """Also wake poll() when ``fd`` is readable (the pin thread's wake-up pipe)."""
        self._watch(fd, name, None)

    def unwatch_extra(self, fd: int) -> None:
        """Stop waking poll() for an fd given to ``watch_extra`` (before its owner closes it)."""
        self._unwatch(fd)

    # ---- lifecycle -----------------------------------------------------------------------
    def start_all(self) -> None:
        """Start a process for every slot (the first start; ``respawn`` replaces one)."""
        for slot in self.slots:
            self._start(slot)

    def _start(self, slot: WorkerSlot) -> None:
        task_r, task_w = self.ctx.Pipe(duplex=False)
        result_r, result_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        main_fds = (task_w.fileno(), result_r.fileno())
        register_fds(*main_fds)
        spec: WorkerSpec = self.make_spec(slot.wid)
        if self.pool is None and LOADER_POOL and hasattr(os, "memfd_create"):
            import torch.multiprocessing

            if torch.multiprocessing.get_sharing_strategy() == "file_descriptor":
                # The window's tasks and the batch the caller holds, whichever workers.
                cap = len(self.slots) * spec.prefetch_factor + 1
                self.pool = LoaderPool(cap, register_fds, unregister_fds)
        with self.fork_lock:
            if self._is_fork:
                spec.close_fds = fds_to_close()
            else:
                spec.close_fds = []
            spec.main_pid = os.getpid()
            proc = self.ctx.Process(
                target=worker_main,
                args=(spec, task_r, result_w),
                name=f"resumable_loader-worker-{slot.wid}",
                daemon=True,
            )
            # Ctrl-C in a terminal signals the whole process group, workers too, and it is the
            # main process's to handle. A worker ignores SIGINT once it runs our code; blocked
            # until then (the mask survives fork and exec), a Ctrl-C during its start cannot
            # kill it with a traceback, and is discarded when the worker ignores it.
            _start_mp_helpers(self.ctx.get_start_method())
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                proc.start()
            except BaseException as e:
                # No worker: none of the four pipe ends has an owner.
                unregister_fds(*main_fds)
                for end in (task_r, task_w, result_r, result_w):
                    end.close()
                if isinstance(e, (TypeError, AttributeError, pickle.PicklingError)):
                    warn_unpicklable(self.ctx.get_start_method(), e)
                raise
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        # The child has its copies now; ours would keep the pipes open after it dies.
        task_r.close()
        result_w.close()
        self._starts += 1
        slot.proc = proc
        slot.pid = proc.pid or -1
        slot.task_conn = task_w
        slot.result_conn = Receiver(result_r, self.pool)
        slot.state = STARTING
        slot.booted = False
        slot.running = None
        slot.start_since = time.monotonic()
        slot.busy_since = time.monotonic()
        mark_cpu_wait(slot, self.task_timeout)
        self._watch(result_r.fileno(), "conn", slot)
        self._watch(proc.sentinel, "sentinel", slot)

    def respawn(self, slot: WorkerSlot, report: DeathReport | None = None) -> None:
        """Start a replacement process for a DEAD slot (same worker id, same seeds).

        ``report`` is the death it replaces (None: a persistent pool's worker that died
        between epochs); the storm error says what the deaths were.
        """
        self.respawns_without_progress += 1
        if report is not None:
            self._storm_causes[report.key] += 1
            self._storm_last = f"worker {slot.wid} (pid {report.pid}) {report.cause}"
        limit = max(STORM_MIN_RESPAWNS, 4 * len(self.slots))
        if self.respawns_without_progress > limit:
            raise WorkerCrashError(
                storm_message(
                    self.respawns_without_progress,
                    self._storm_causes,
                    self._storm_last,
                    self.task_timeout,
                )
            )
        self._start(slot)

    def _close_channels(self, slot: WorkerSlot) -> None:
        """Unregister and close a slot's result socket and task pipe."""
        for conn in (slot.result_conn, slot.task_conn):
            if conn is None:
                continue
            try:
                fd = conn.fileno()
                self._unwatch(fd)
                unregister_fds(fd)
            except OSError:
                pass
            conn.close()
        slot.task_conn = slot.result_conn = None

    def _release(self, slot: WorkerSlot) -> None:
        """Close a slot's channels and stop watching it (its process must be gone)."""
        self._close_channels(slot)
        if slot.proc is not None:
            self._unwatch(slot.proc.sentinel)

    def mark_dead(self, slot: WorkerSlot, kill: bool = False) -> int | None:
        """Reap (killing first if asked) and release a slot; returns the exit code."""
        proc = slot.proc
        if kill and proc is not None and proc.exitcode is None:
            try:
                proc.kill()
            except OSError:
                pass
        exitcode = None
        if proc is not None:
            proc.join(KILL_JOIN_S if kill else 1.0)
            if proc.exitcode is None:  # closed its pipe but still running: make it a fact
                proc.kill()
                proc.join(KILL_JOIN_S)
            exitcode = proc.exitcode
        if self.pool is not None:
            # Reaped (or stuck in the kernel after SIGKILL: it runs no more code either).
            self.pool.drop_worker(slot.wid)
            self._pool_gen.pop(slot.wid, None)
        self._release(slot)
        if proc is not None:
            try:
                proc.close()
            except ValueError:
                pass
        slot.proc = None
        slot.state = DEAD
        return exitcode

    # ---- I/O -----------------------------------------------------------------------------
    def send(self, slot: WorkerSlot, msg: ToWorker) -> bool:
        """Send to a live slot; False if its pipe is broken (death is handled by poll())."""
        if self.pool is not None and type(msg) is TaskMsg and self.pool.wanted():
            msg = msg._replace(grant=self._grant(slot, msg))
        try:
            if type(msg) is TaskMsg:
                send_task(slot.task_conn.fileno(), msg)  # the per-batch one: see transport.taskpipe
            else:
                slot.task_conn.send(msg)
            return True
        except (BrokenPipeError, ConnectionResetError, OSError, AttributeError):
            return False

    def _grant(self, slot: WorkerSlot, msg: TaskMsg) -> int:
        """The pooled segment task ``msg`` may be collated into (its id), or -1."""
        pool, conn = self.pool, slot.result_conn
        if pool is None or conn is None:
            return -1
        key = (slot.wid, msg.gen, msg.tid)
        seg = pool.grant(key)
        if seg is None:
            return -1
        if not pool.send_fd(slot.wid, conn.sock, seg):
            pool.end(key)
            return -1
        return seg.id

    def poll(self, timeout_s: float | None) -> list[Event]:
        """Wait up to ``timeout_s`` for results and deaths; return them as events.

        The other messages (BOOTED, READY, STARTED, INIT_ERROR) change the slot and make no
        event; a watched extra fd (the pin thread's) only ends the wait: its owner drains it.
        """
        ms = -1 if timeout_s is None else max(0, int(timeout_s * 1000 + 0.999))
        self._discount_pauses(time.monotonic(), None)  # since the last look: the user's time
        try:
            ready = self._poller.poll(ms)
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for safety
            ready = []
        self._discount_pauses(time.monotonic(), None if ms < 0 else ms / 1000)
        events: list[Event] = []
        # slot -> (why, kill): "" when the exit status will say why
        dead: dict[WorkerSlot, tuple[str, bool]] = {}
        readable = self._sort_ready(ready, dead)
        now = time.monotonic()
        if now - self._last_poll >= POLL_INTERVAL_S:
            self._last_poll = now
            for slot in self.slots:
                if slot.alive and slot not in dead and not slot.proc.is_alive():
                    dead[slot] = ("", False)
        # A dead worker's socket is read too: everything it sent before it died is whole and
        # in the socket buffer (its last words, such as a worker_init_fn error, arrive just
        # before its exit). Only a message cut short by the death is discarded; its task re-runs.
        for slot in self.slots:
            if slot.alive and (slot in readable or slot in dead):
                self._read(slot, dead, events)
        for slot in self.slots:
            hang = hang_clock(slot, self.task_timeout)
            if hang is not None and slot not in dead and now > hang[0]:
                if credit_cpu_wait(slot):
                    hang = hang_clock(slot, self.task_timeout)
                if hang is not None and now > hang[0]:
                    dead[slot] = (hang[1], True)
        for slot, (why, kill) in dead.items():
            events.append(Died(slot, self._report_death(slot, why, kill)))
        return events

    def _sort_ready(
        self,
        ready: list[tuple[int, int]],
        dead: dict[WorkerSlot, tuple[str, bool]],
    ) -> set[WorkerSlot]:
        """Handle the wake-up pipe and sentinels; return the slots with data."""
        readable: set[WorkerSlot] = set()
        for fd, _ev in ready:
            entry = self._fds.get(fd)
            if entry is None:
                continue
            kind, slot = entry
            if kind == "conn" and slot is not None:
                readable.add(slot)
            elif kind == "wake":
                try:
                    while os.read(fd, 4096):
                        pass
                except BlockingIOError:
                    pass
            elif kind == "sentinel":
                assert slot is not None
                dead.setdefault(slot, ("", False))
        return readable

    def _report_death(self, slot: WorkerSlot, why: str, kill: bool) -> DeathReport:
        """Reap (killing first if ``kill``) and describe a dead or hung worker."""
        pid = slot.pid
        was_ready = slot.state == READY_STATE
        exitcode = self.mark_dead(slot, kill=kill)
        self._deaths += 1
        self._killed += kill
        cause, key = death_cause(why, exitcode, slot.init_error)
        return DeathReport(pid, exitcode, cause, key, was_ready)

    def _read(
        self,
        slot: WorkerSlot,
        dead: dict[WorkerSlot, tuple[str, bool]],
        events: list[Event],
    ) -> None:
        """Turn what a slot's socket holds into events; note in ``dead`` if it is gone."""
        conn = slot.result_conn
        assert conn is not None
        before = conn.received
        try:
            # A live worker's socket is read until a short read (poll() wakes again for
            # anything left); a dead one's to its end, its last words included.
            msgs = conn.feed(drain=slot in dead)
        except Exception as exc:
            # The channel broke (fds dropped by the kernel): what is left in it cannot be
            # framed, so the worker is replaced. (A message that came whole but cannot be
            # unpickled is no such thing: an Undecodable, below.)
            dead[slot] = (f"sent a result that could not be received ({exc!r})", True)
            return
        if conn.received != before:
            # Progress. While the user was busy between batches the worker's results waited
            # in the socket (or it waited to write them): that time is not a hang.
            slot.busy_since = time.monotonic()
            mark_cpu_wait(slot, self.task_timeout)
        for msg in msgs:
            if type(msg) is tuple:  # a Result as workers send it (result_to_wire)
                try:
                    msg = result_from_wire(msg)
                except (IndexError, TypeError):
                    pass  # not one of ours: said below
            if isinstance(msg, Result):
                self.respawns_without_progress = 0
                self._storm_causes.clear()
                if self.pool is not None:
                    self._end_grant(slot, msg)
                events.append(Arrived(slot, msg))
            elif isinstance(msg, Started):
                slot.running = msg.tid
            elif isinstance(msg, Booted):
                slot.booted = True
                slot.start_since = time.monotonic()  # worker_init_fn's time starts now
                mark_cpu_wait(slot, self.task_timeout)
            elif isinstance(msg, Ready):
                if msg.seeded and not self._warned_seeding:
                    self._warned_seeding = True
                    warn_seeding()
                slot.state = READY_STATE
                slot.start_failures = 0
                slot.init_error = None
                slot.busy_since = time.monotonic()
                mark_cpu_wait(slot, self.task_timeout)
            elif isinstance(msg, InitError):
                slot.init_error = msg.error
                dead[slot] = ("failed to start", False)
            elif isinstance(msg, Undecodable):
                self._undecodable(slot, msg, dead, events)
            else:
                # Not one of ours: a worker that sends it is not running our code.
                dead[slot] = (f"sent an unknown message {type(msg).__name__}", True)
        _channel_end(slot, conn, dead)

    def _undecodable(
        self,
        slot: WorkerSlot,
        msg: Undecodable,
        dead: dict[WorkerSlot, tuple[str, bool]],
        events: list[Event],
    ) -> None:
        """A message from ``slot`` came whole and cannot be rebuilt here."""
        if msg.tid < 0:
            # Not a result, so no task to name: one of our own messages that cannot be read.
            dead[slot] = (f"sent a message that could not be rebuilt ({msg.error!r})", True)
            return
        # A result: the worker made it and sent it, so it is not dead (nor a failed start);
        # recovery names the task.
        self.respawns_without_progress = 0
        if self.pool is not None:
            self._end_grant(slot, msg)
        events.append(Lost(slot, msg))

    def _end_grant(self, slot: WorkerSlot, msg: Result | Undecodable) -> None:
        """The pooled segment lent for ``msg``'s task is the caller's batch now (or free)."""
        pool = self.pool
        assert pool is not None
        pool.ended += 1
        if pool.grants:
            pool.end((slot.wid, msg.gen, msg.tid), not isinstance(msg, Undecodable))
            if msg.gen > self._pool_gen.get(slot.wid, msg.gen):
                pool.end_before(slot.wid, msg.gen)  # it dropped its older tasks
        self._pool_gen[slot.wid] = msg.gen

    def _discount_pauses(self, now: float, asked: float | None) -> None:
        """Take the time this process did not run since it last looked (``_seen``) off every
        hang clock (``clocks.discount_pauses``), and count it in ``paused_s``."""
        start, self._seen = self._seen, now
        self.paused_s += discount_pauses(self.slots, start, now, asked)

    def next_deadline(self, now: float) -> float:
        """The latest time poll() should return by, for polling and task_timeout checks."""
        deadline = self._last_poll + POLL_INTERVAL_S
        for slot in self.slots:
            hang = hang_clock(slot, self.task_timeout)
            if hang is not None:
                deadline = min(deadline, hang[0] + 0.001)
        return max(deadline, now)

    # ---- checks and figures --------------------------------------------------------------
    def statistics(self) -> SupervisorStatistics:
        """What this supervisor has done so far, and each slot's pid and state now."""
        return SupervisorStatistics(
            starts=self._starts,
            deaths=self._deaths,
            killed=self._killed,
            respawns_without_progress=self.respawns_without_progress,
            pids=tuple(s.pid if s.alive else -1 for s in self.slots),
            states=tuple(s.describe_state() for s in self.slots),
        )

    def check_invariants(self) -> None:
        """Assert the slot invariants of the module docstring (for tests)."""
        watched = set(self._fds)
        for slot in self.slots:
            if slot.alive:
                assert slot.proc is not None and slot.task_conn is not None, slot
                assert slot.result_conn is not None, slot
                assert slot.result_conn.fileno() in watched, f"{slot}: socket not watched"
                assert slot.proc.sentinel in watched, f"{slot}: sentinel not watched"
            else:
                assert slot.proc is None, f"{slot}: a process kept after its death"
                assert slot.task_conn is None and slot.result_conn is None, slot
            assert len(set(slot.outstanding)) == len(slot.outstanding), slot
        if self.closed:
            assert all(s.state == STOPPED for s in self.slots)

    def here(self) -> bool:
        """Whether this is the process that started these workers (not a forked copy)."""
        return os.getpid() == self.pid

    def shutdown(self) -> None:
        """Stop every worker and release every fd; safe to call twice, and from finalizers.

        In a forked child (a finalizer or a garbage collection that runs in another loader's
        worker, which inherited this object) it only marks the copy closed: the processes are
        not the child's to stop, and the fd numbers may by now be the child's own files.
        """
        if self.closed:
            return
        self.closed = True
        if not self.here():
            return
        live = [s for s in self.slots if s.proc is not None]
        for slot in live:
            self.send(slot, Stop())
        # Closing our ends unblocks a worker stuck writing a large result to a full socket.
        for slot in live:
            self._close_channels(slot)
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for slot in live:
            slot.proc.join(max(0.0, deadline - time.monotonic()))
        for slot in live:
            proc = slot.proc
            if proc.exitcode is None:
                try:
                    proc.kill()
                except OSError:
                    pass
                proc.join(KILL_JOIN_S)
            self._unwatch(proc.sentinel)
            try:
                proc.close()
            except ValueError:
                pass
            slot.proc = None
            slot.state = STOPPED
        for slot in self.slots:
            slot.state = STOPPED
        if self.pool is not None:
            self.pool.close()  # (held batches keep their segments mapped until dropped)
        ChildSignal.remove(self._wake_w)
        Continued.remove()
        for fd in (self._wake_r, self._wake_w):
            self._unwatch(fd)
            unregister_fds(fd)
            try:
                os.close(fd)
            except OSError:
                pass


# ---- helpers that need no supervisor -------------------------------------------------------------
def _start_mp_helpers(method: str) -> None:
    """Start multiprocessing's own helpers before SIGINT is blocked around a start.

    The resource tracker's first start unblocks SIGINT when it is done (it blocks and
    unblocks around its own spawn), which would undo our block. The fork server is not
    started under the block either: it, and every process it forks for anyone, would keep
    SIGINT blocked. So a forkserver worker is unprotected for the moment between the fork
    server's fork and worker_main (the README says so).
    """
    if method == "fork":
        return
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()
    if method == "forkserver":
        forkserver.ensure_running()


def _channel_end(
    slot: WorkerSlot, conn: Receiver, dead: dict[WorkerSlot, tuple[str, bool]]
) -> None:
    """After a read's messages: whether the channel says the worker is gone or broken."""
    if conn.failure is not None:
        # The channel broke after the messages just handled (first: a READY among them
        # makes this a death of a started worker, not a failed start).
        why = f"sent a result that could not be received ({conn.failure!r})"
        dead.setdefault(slot, (why, True))
    if conn.eof:
        # The writer is gone: a death, described by its exit status once reaped.
        dead.setdefault(slot, ("", False))
