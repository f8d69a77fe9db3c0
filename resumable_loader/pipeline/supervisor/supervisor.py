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
SIGCHLD handler (installed from the main thread, chained to any earlier handler) writes to the
wake-up pipe so a death is seen even while the user is busy; and every POLL_INTERVAL_S the slots
are checked with ``is_alive()`` for what the others miss (a grandchild holding the sentinel
open). A timeout alone never declares a worker dead: only ``task_timeout`` does, and then the
worker is killed first, so "dead" is always a fact. ``task_timeout`` counts the job's running
time: a pause of this process (a wait that overran, a SIGCONT) is taken off every hang clock,
so a job stopped as a whole and continued loses no worker (``_discount_pauses``). Nor is a
worker's own wait for a CPU on a busy machine (its run-queue delay, ``_credit_cpu_wait``): a
worker that is ready to run and not given the CPU is not hung, it is starved.
The shared segments batches travel in are the supervisor's (``_transport.LoaderPool``): each
TASK sent carries a grant, each segment's fd goes to a worker process once, over its result
socket, before the first task that grants it; a grant ends with the task's result, a result of
a later generation, or the worker's death (``mark_dead``).
Nothing in /dev/shm is ever deleted here: a dead worker's leftovers cannot be told from
another job's segments or from a batch passed on (docs/recovery.md).

Slot states (one object per worker id, kept across respawns):
    STARTING ──READY msg──► READY ──death/hang──► DEAD ──respawn()──► STARTING
    any ──shutdown()──► STOPPED
A STARTING worker sends BOOTED when it starts running our code; with task_timeout set, it is
hung if worker_init_fn then runs longer than task_timeout, or if BOOTED has not come
within max(task_timeout, BOOT_TIMEOUT_S) of the start.
Invariants (``check_invariants``): a slot in STARTING/READY has a process and watched fds; a
DEAD or STOPPED slot has neither; ``outstanding`` lists the task ids sent to the slot and not
yet received, in send order, each once. ``statistics()``: processes started, deaths reported
(and hangs killed), and each slot's pid and state.
"""

from __future__ import annotations

import collections
import logging
import math
import multiprocessing
import os
import pickle
import re
import select
import signal
import socket
import sys
import threading
import time
import warnings
from typing import Any, NamedTuple

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
    WorkerError,
    result_from_wire,
)
from ..transport import LoaderPool, Receiver, Undecodable
from ..transport.taskpipe import send_task
from ..worker import WorkerSpec, worker_main

log = logging.getLogger("resumable_loader")

STARTING = "starting"
READY_STATE = "ready"
DEAD = "dead"
STOPPED = "stopped"

# Liveness polling catches deaths that the sentinel misses (a worker's own child keeps the
# sentinel pipe open). Half a second bounds that rare delay without costing anything visible.
POLL_INTERVAL_S = 0.5
# On shutdown, idle workers exit at once on STOP; a worker busy in user code gets this long to
# finish its batch before it is killed (its result would be thrown away anyway).
SHUTDOWN_GRACE_S = 1.0
# A worker that does not exit within this after SIGKILL is stuck in the kernel (D state);
# give up waiting rather than hang the caller.
KILL_JOIN_S = 5.0
# With task_timeout set, a starting worker is hung once worker_init_fn has run for
# task_timeout, or once it has shown no sign of life (BOOTED) for max(task_timeout, this):
# booting under spawn/forkserver imports torch and unpickles the dataset, seconds normally and
# more on a loaded machine; a minute of silence is a stuck import or a stopped process.
BOOT_TIMEOUT_S = 60.0
# A wait in poll() that overran what it asked for by more than this was a pause of this process
# (stopped, frozen, a suspended VM) rather than a late wake-up on a busy machine; the overrun
# is not counted towards task_timeout. A quarter second is far above a scheduler's delay.
PAUSE_SLACK_S = 0.25
# Respawn-storm guard: more respawns than max(this, 4 per worker) with not one result received
# in between is not a flaky worker but a broken setup (every worker OOM-killed as it starts, or
# killed as hung because it cannot start or load a batch within task_timeout); raise instead of
# looping. Deaths between results are left to the per-task poison limit.
STORM_MIN_RESPAWNS = 20

# The loader's segment pool (issue #26; ``_transport.LoaderPool``): on unless a benchmark
# compares without it (then each worker keeps a pool of its own).
LOADER_POOL = True

# fds that the main process holds for all live supervisors; fork children close them.
_registry_lock = threading.Lock()
_MAIN_FDS: set[int] = set()


def _warn_unpicklable(method: str, error: BaseException) -> None:
    """Say, as torch does (its first words, which scripts match), that a worker could not be
    started because what it needs could not be pickled; the error itself follows."""
    warnings.warn(
        "Got pickle error when attempting to start a worker Process: the "
        f"{method!r} start method sends the dataset, collate_fn and worker_init_fn to each "
        f"worker by pickling, and that failed ({type(error).__name__}: {error}). Make them "
        "picklable (module-level classes and functions, no lambdas or open handles), or use "
        "multiprocessing_context='fork' where it is available.",
        stacklevel=_outside_the_package(),
    )


def _outside_the_package() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside this package."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        here + os.sep
    ):
        frame, level = frame.f_back, level + 1
    return level


def _register_fds(*fds: int) -> None:
    with _registry_lock:
        _MAIN_FDS.update(fds)


def _unregister_fds(*fds: int) -> None:
    with _registry_lock:
        _MAIN_FDS.difference_update(fds)


class _ChildSignal:
    """The process-wide SIGCHLD hook shared by all supervisors.

    The handler writes to the wake fds while holding ``lock``, and a supervisor closes its
    wake fds only after ``remove()`` (which takes the lock) has returned: so the handler never
    writes to a number that was closed and handed to another file meanwhile. The lock is
    re-entrant because the handler runs in the main thread, which may be inside add/remove.
    """

    lock = threading.RLock()
    wake_fds: set[int] = set()
    previous: Any = None
    installed = False

    @classmethod
    def _handler(cls, signum: int, frame: Any) -> None:
        with cls.lock:
            for fd in tuple(cls.wake_fds):
                try:
                    os.write(fd, b"c")
                except OSError:
                    pass  # full: a wake-up is already pending
        prev = cls.previous
        if callable(prev):
            prev(signum, frame)

    @classmethod
    def add(cls, fd: int) -> None:
        with cls.lock:
            cls.wake_fds.add(fd)
            if cls.installed or threading.current_thread() is not threading.main_thread():
                return  # off the main thread, sentinels and polling do the work
            try:
                cls.previous = signal.signal(signal.SIGCHLD, cls._handler)
                cls.installed = True
            except (ValueError, OSError):
                pass

    @classmethod
    def remove(cls, fd: int) -> None:
        with cls.lock:
            cls.wake_fds.discard(fd)
            if not cls.installed or cls.wake_fds:
                return
            if threading.current_thread() is not threading.main_thread():
                return
            try:
                if signal.getsignal(signal.SIGCHLD) == cls._handler:
                    prev = cls.previous
                    signal.signal(signal.SIGCHLD, prev if prev is not None else signal.SIG_DFL)
                cls.installed = False
                cls.previous = None
            except (ValueError, OSError):
                pass


class _Continued:
    """The process-wide SIGCONT hook: when this process was last continued after a stop.

    A stopped process runs no code, so it cannot see its own pause while it lasts; SIGCONT at
    its end is the one sign that reaches it wherever it is -- in the user's training step as
    much as in poll(). The handler (installed from the main thread, chained to any earlier
    handler, with SA_RESTART so that no system call of the user's fails with EINTR for it)
    records the time; supervisors compare it with when they last looked.
    """

    lock = threading.RLock()
    last = -math.inf  # time.monotonic() of the last SIGCONT
    users = 0
    previous: Any = None
    installed = False

    @classmethod
    def _handler(cls, signum: int, frame: Any) -> None:
        cls.last = time.monotonic()
        prev = cls.previous
        if callable(prev):
            prev(signum, frame)

    @classmethod
    def add(cls) -> None:
        with cls.lock:
            cls.users += 1
            if cls.installed or threading.current_thread() is not threading.main_thread():
                return  # off the main thread, poll()'s own overruns are the measure
            try:
                cls.previous = signal.signal(signal.SIGCONT, cls._handler)
                signal.siginterrupt(signal.SIGCONT, False)
                cls.installed = True
            except (ValueError, OSError):
                pass

    @classmethod
    def remove(cls) -> None:
        with cls.lock:
            cls.users = max(0, cls.users - 1)
            if not cls.installed or cls.users:
                return
            if threading.current_thread() is not threading.main_thread():
                return
            try:
                if signal.getsignal(signal.SIGCONT) == cls._handler:
                    prev = cls.previous
                    signal.signal(signal.SIGCONT, prev if prev is not None else signal.SIG_DFL)
                cls.installed = False
                cls.previous = None
            except (ValueError, OSError):
                pass


class CpuFigures(NamedTuple):
    """What the kernel says of a process's main thread and the CPU (``cpu_figures``)."""

    ran: int  # ns it has run on a CPU
    waited: int  # ns it was runnable but waited for a CPU, counted when it got one
    runnable: bool  # running or waiting for a CPU now (False when not asked)


def cpu_figures(pid: int, state: bool = True) -> CpuFigures | None:
    """/proc/<pid>/schedstat, and with ``state`` the state in /proc/<pid>/stat; None where the
    kernel does not say (another OS, or no such process).

    Only the main thread: it runs the tasks. A wait of other threads (a user's thread pool) is
    not seen, so a worker starved that way is judged by the clock alone.
    """
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            ran, waited = (int(x) for x in f.read().split()[:2])
        if not state:
            return CpuFigures(ran, waited, False)
        with open(f"/proc/{pid}/stat", "rb") as f:
            code = f.read().rpartition(b")")[2].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    return CpuFigures(ran, waited, code == b"R")


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "did not exit"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def exit_cause(exitcode: int | None) -> str:
    """A short key for statistics: 'signal:SIGKILL', 'exit:1', ..."""
    if exitcode is None:
        return "unknown"
    if exitcode < 0:
        try:
            return f"signal:{signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal:{-exitcode}"
    return f"exit:{exitcode}"


def _warn_seeding() -> None:
    warnings.warn(
        "worker_init_fn called torch.manual_seed(): the loader seeds python's random, numpy and "
        "torch again before every batch, from (epoch seed, batch), so that a batch has the same "
        "values after a resume whichever worker loads it. That seeding overrides your draws while "
        "batches are loaded (torch.initial_seed() still reports your seed). To choose "
        "the randomness, seed the loader instead: DataLoader(..., "
        "generator=torch.Generator().manual_seed(s)).",
        RuntimeWarning,
        stacklevel=2,
    )


class DeathReport(NamedTuple):
    """A worker's death (or a hang it was killed for), as the supervisor saw it."""

    pid: int
    exitcode: int | None
    cause: str  # "was killed by SIGKILL", "hung (no result for 5 s: task_timeout)", ...
    key: str  # the cause's category, for statistics().respawns_by_cause
    was_ready: bool  # it had started (run worker_init_fn); a death before is a failed start


class Arrived(NamedTuple):
    """Event: a task's result from ``slot`` (events keep the order received)."""

    slot: WorkerSlot
    msg: Result


class Died(NamedTuple):
    """Event: ``slot``'s worker died or hung (and was killed); the slot is now DEAD."""

    slot: WorkerSlot
    report: DeathReport


class Lost(NamedTuple):
    """Event: a task's result from ``slot`` arrived whole but could not be rebuilt in this
    process (``msg.error``). Not a death: the worker goes on; recovery names the task."""

    slot: WorkerSlot
    msg: Undecodable


Event = Arrived | Died | Lost


class SupervisorStatistics(NamedTuple):
    """What a supervisor has done since it was built.

    ``starts`` counts every process started (first starts and replacements); ``deaths`` every
    death it reported, of which ``killed`` were hangs it killed itself; ``pids`` and
    ``states`` are per worker id (pid -1 when no process runs; states as
    ``WorkerSlot.describe_state``).
    """

    starts: int
    deaths: int
    killed: int
    respawns_without_progress: int
    pids: tuple[int, ...]
    states: tuple[str, ...]


class WorkerSlot:
    """One worker id; its process changes on respawn, the slot stays."""

    def __init__(self, wid: int) -> None:
        self.wid = wid
        self.state = DEAD
        self.proc: Any = None
        self.pid = -1
        self.task_conn: Any = None
        self.result_conn: Any = None
        self.outstanding: collections.deque[int] = collections.deque()
        self.busy_since = 0.0
        self.start_failures = 0
        self.init_error: WorkerError | None = None
        self.booted = False  # the current process has sent BOOTED
        self.start_since = 0.0  # when it was started, then when it sent BOOTED
        self.running: int | None = None  # the task it said it started out of order (STARTED)
        # Its CPU figures when its hang clock last started or was looked at, and when.
        self.cpu: CpuFigures | None = None
        self.cpu_seen = 0.0

    @property
    def alive(self) -> bool:
        return self.state in (STARTING, READY_STATE)

    @property
    def ready(self) -> bool:
        return self.state == READY_STATE

    def describe_state(self) -> str:
        """For statistics: its state, a started worker's split by whether it runs our code."""
        if self.state == STARTING:
            return "initializing" if self.booted else "starting"
        return self.state

    def __repr__(self) -> str:
        return (
            f"<worker {self.wid} pid={self.pid} {self.state} outstanding={list(self.outstanding)}>"
        )


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
        self._is_fork = self.ctx.get_start_method() == "fork"
        self.make_spec = make_spec
        self.slots = [WorkerSlot(w) for w in range(num_workers)]
        self.task_timeout = task_timeout
        self.fork_lock = fork_lock
        self._poller = select.poll()
        self._fds: dict[int, tuple[str, WorkerSlot | None]] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        _register_fds(self._wake_r, self._wake_w)
        self._watch(self._wake_r, "wake", None)
        _ChildSignal.add(self._wake_w)
        _Continued.add()
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
        self._unwatch(fd)

    # ---- lifecycle -----------------------------------------------------------------------
    def start_all(self) -> None:
        for slot in self.slots:
            self._start(slot)

    def _start(self, slot: WorkerSlot) -> None:
        task_r, task_w = self.ctx.Pipe(duplex=False)
        result_r, result_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        main_fds = (task_w.fileno(), result_r.fileno())
        _register_fds(*main_fds)
        spec: WorkerSpec = self.make_spec(slot.wid)
        if self.pool is None and LOADER_POOL and hasattr(os, "memfd_create"):
            import torch.multiprocessing

            if torch.multiprocessing.get_sharing_strategy() == "file_descriptor":
                # The window's tasks and the batch the caller holds, whichever workers.
                cap = len(self.slots) * spec.prefetch_factor + 1
                self.pool = LoaderPool(cap, _register_fds, _unregister_fds)
        with self.fork_lock:
            if self._is_fork:
                with _registry_lock:
                    spec.close_fds = sorted(_MAIN_FDS)
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
            self._start_mp_helpers()
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                proc.start()
            except BaseException as e:
                # No worker: none of the four pipe ends has an owner.
                _unregister_fds(*main_fds)
                for end in (task_r, task_w, result_r, result_w):
                    end.close()
                if isinstance(e, (TypeError, AttributeError, pickle.PicklingError)):
                    _warn_unpicklable(self.ctx.get_start_method(), e)
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
        self._mark_cpu_wait(slot)
        self._watch(result_r.fileno(), "conn", slot)
        self._watch(proc.sentinel, "sentinel", slot)

    def _start_mp_helpers(self) -> None:
        """Start multiprocessing's own helpers before SIGINT is blocked around a start.

        The resource tracker's first start unblocks SIGINT when it is done (it blocks and
        unblocks around its own spawn), which would undo our block. The fork server is not
        started under the block either: it, and every process it forks for anyone, would keep
        SIGINT blocked. So a forkserver worker is unprotected for the moment between the fork
        server's fork and worker_main (the README says so).
        """
        method = self.ctx.get_start_method()
        if method == "fork":
            return
        from multiprocessing import forkserver, resource_tracker

        resource_tracker.ensure_running()
        if method == "forkserver":
            forkserver.ensure_running()

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
            raise WorkerCrashError(self._storm_message())
        self._start(slot)

    def _storm_message(self) -> str:
        n, causes = self.respawns_without_progress, self._storm_causes
        said = ", ".join(f"{key} x{count}" for key, count in causes.most_common())
        head = f"respawn storm: {n} worker respawns without a single result in between"
        head += f" (causes: {said}; last: {self._storm_last})" if said else ""
        hangs = causes["hang"]
        if hangs * 2 > sum(causes.values()):
            # We killed them: saying they died would send the user looking for an OOM killer.
            return (
                f"{head}. {hangs} of them were not deaths: the loader killed the workers as "
                f"hung, because they did not start or deliver a batch within "
                f"task_timeout={self.task_timeout:g} s of running time. If the workers are "
                "merely slow (a slow worker_init_fn, stream restore or batch; a machine that "
                "swaps), raise task_timeout above the time a worker needs to start and load a "
                "batch there."
            )
        return (
            f"{head}: workers are dying faster than they can do work. Check the worker logs / "
            "dmesg for the OOM killer, lower num_workers or memory use."
        )

    def _close_channels(self, slot: WorkerSlot) -> None:
        """Unregister and close a slot's result socket and task pipe."""
        for conn in (slot.result_conn, slot.task_conn):
            if conn is None:
                continue
            try:
                fd = conn.fileno()
                self._unwatch(fd)
                _unregister_fds(fd)
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
                send_task(slot.task_conn.fileno(), msg)  # the per-batch one: see _taskpipe
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
            hang = self._hang_clock(slot)
            if hang is not None and slot not in dead and now > hang[0]:
                if self._credit_cpu_wait(slot):
                    hang = self._hang_clock(slot)
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
        if why.startswith("hung"):
            cause, key = why, "hang"
        elif why == "failed to start":
            err = slot.init_error
            where = re.split(r" (?:of|in) DataLoader worker", err.where)[0] if err else ""
            cause, key = f"raised {err.type_name if err else 'an error'} {where}", "init_error"
        elif why:
            cause, key = f"{why}; then {describe_exit(exitcode)}", "recv_error"
        else:
            cause, key = describe_exit(exitcode), exit_cause(exitcode)
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
            self._mark_cpu_wait(slot)
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
                self._mark_cpu_wait(slot)
            elif isinstance(msg, Ready):
                if msg.seeded and not self._warned_seeding:
                    self._warned_seeding = True
                    _warn_seeding()
                slot.state = READY_STATE
                slot.start_failures = 0
                slot.init_error = None
                slot.busy_since = time.monotonic()
                self._mark_cpu_wait(slot)
            elif isinstance(msg, InitError):
                slot.init_error = msg.error
                dead[slot] = ("failed to start", False)
            elif isinstance(msg, Undecodable):
                self._undecodable(slot, msg, dead, events)
            else:
                # Not one of ours: a worker that sends it is not running our code.
                dead[slot] = (f"sent an unknown message {type(msg).__name__}", True)
        self._channel_end(slot, conn, dead)

    @staticmethod
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
        """Take the time this process did not run since it last looked off every hang clock.

        A worker is hung when it makes no progress while the rest of the job runs; a paused job
        (stopped as a whole, frozen, a suspended VM) is not a hung one, and its pause must not
        turn into a kill, a poison task or a skip. The pause is seen two ways: a wait that
        overran what it ``asked`` for (by more than PAUSE_SLACK_S), and a SIGCONT received
        since the last look (everything before it counts as paused). ``asked`` is None for the
        time between two looks, spent in the user's code, which counts as running unless a
        SIGCONT came.
        """
        start, self._seen = self._seen, now
        paused = 0.0
        if asked is not None and now - start - asked > PAUSE_SLACK_S:
            paused = now - start - asked
        resumed = _Continued.last
        if resumed > start:
            paused = max(paused, min(resumed, now) - start)
        if paused <= 0.0:
            return
        self.paused_s += paused
        end = start + paused  # the paused stretch, counted from the start of the interval
        for slot in self.slots:
            # A clock started before the pause moves on by all of it; one started inside it,
            # by the part after its start.
            slot.busy_since += max(0.0, end - max(slot.busy_since, start))
            slot.start_since += max(0.0, end - max(slot.start_since, start))

    def _mark_cpu_wait(self, slot: WorkerSlot) -> None:
        """A hang clock of ``slot`` (re)started now: note its CPU figures so far (one read of
        /proc per start of a clock, and only with task_timeout set)."""
        if self.task_timeout is not None and slot.pid > 0:
            slot.cpu = cpu_figures(slot.pid, state=False)
            slot.cpu_seen = time.monotonic()

    def _credit_cpu_wait(self, slot: WorkerSlot) -> bool:
        """Take the time ``slot``'s worker waited for a CPU since its clock started off its
        hang clocks; True if that moved them.

        A worker is hung when it makes no progress while the rest of the job runs. One that is
        runnable but not scheduled (a machine with more busy processes than cores) is the rest
        of the job not running, for it: on a loaded machine a start or a batch that takes a
        few milliseconds of CPU can take seconds on the clock, and killing it for that kills
        its replacement too, until the storm guard ends the epoch. A stopped worker, one
        blocked in a read, or one spinning on a CPU it gets, waits for no CPU: it is still
        found after task_timeout of running time. Looked at only when a clock has run out.
        (A stretch that is also one of this process's pauses, ``_discount_pauses``, or a wait
        that began before the clock started, may be taken off twice: a hang is then found up
        to that much later, never sooner.)
        """
        before, seen = slot.cpu, slot.cpu_seen
        now = time.monotonic()
        figures = cpu_figures(slot.pid) if before is not None else None
        if before is None or figures is None:
            return False
        # Waits that ended (the kernel adds a wait when the CPU is given)...
        credit = max(0, figures.waited - before.waited) / 1e9
        if figures.runnable and figures.ran == before.ran:
            # ...and the one in progress: runnable now and not run since the last look. Noted
            # as waited, so that it is not credited again once the kernel counts it.
            ongoing = max(0.0, now - seen)
            credit += ongoing
            figures = figures._replace(
                waited=max(figures.waited, before.waited) + int(ongoing * 1e9)
            )
        slot.cpu, slot.cpu_seen = figures, now
        if credit <= 0:
            return False
        slot.busy_since += credit
        slot.start_since += credit
        return True

    def _hang_clock(self, slot: WorkerSlot) -> tuple[float, str] | None:
        """When a slot counts as hung (monotonic time) and how to say so; None if never."""
        timeout = self.task_timeout
        if timeout is None:
            return None
        if slot.state == READY_STATE:
            if not slot.outstanding:
                return None
            return slot.busy_since + timeout, f"hung (no result for {timeout:g} s: task_timeout)"
        if slot.state != STARTING:
            return None
        if slot.booted:
            why = f"hung in worker_init_fn (not ready after {timeout:g} s: task_timeout)"
            return slot.start_since + timeout, why
        limit = max(timeout, BOOT_TIMEOUT_S)
        return slot.start_since + limit, f"hung while starting (no sign of life for {limit:g} s)"

    def next_deadline(self, now: float) -> float:
        """The latest time poll() should return by, for polling and task_timeout checks."""
        deadline = self._last_poll + POLL_INTERVAL_S
        for slot in self.slots:
            hang = self._hang_clock(slot)
            if hang is not None:
                deadline = min(deadline, hang[0] + 0.001)
        return max(deadline, now)

    # ---- checks and figures --------------------------------------------------------------
    def statistics(self) -> SupervisorStatistics:
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

    def shutdown(self) -> None:
        """Stop every worker and release every fd; safe to call twice, and from finalizers."""
        if self.closed:
            return
        self.closed = True
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
        _ChildSignal.remove(self._wake_w)
        _Continued.remove()
        for fd in (self._wake_r, self._wake_w):
            self._unwatch(fd)
            _unregister_fds(fd)
            try:
                os.close(fd)
            except OSError:
                pass
