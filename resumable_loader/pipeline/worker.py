"""Stage 3 of the pipeline: the worker process (and the fetchers the main process reuses).

A worker reads messages from its own task pipe and answers on its own result pipe -- one pair
per worker, so a worker killed mid-write can corrupt nothing but its own pipe, which the
supervisor throws away with it (a shared queue would stay locked by the dead writer).

    main ──(Epoch | TaskMsg | Stop)──► task pipe ──► worker ──► result pipe ──(Result)──► main

(the messages, typed, are in ``protocol``).

Per task: seed python/numpy/torch from (epoch seed, task), fetch, collate, and send the
result in one message together with the dataset's state for stateful streams ("state rides with
the data"). Tasks waiting in the pipe are run lowest id first, so a task re-sent after a crash
overtakes the prefetched ones queued behind it.

The module reads top to bottom as a worker lives: its start (``WorkerSpec``, ``worker_main``:
fds, signals, worker_init_fn, READY), the parent watch that ends it when the main process is
gone (``_ParentWatch``), and the task loop (``_WorkerLoop``).
"""

from __future__ import annotations

import heapq
import os
import select
import signal
import threading
import time
from typing import Any

import torch
from torch.utils.data._utils import worker as torch_worker

from ..core.compat import set_worker_signal_handlers
from ..plans.mixture import follow_epoch
from ..state.seeds import (
    STREAM,
    TASK,
    derive_seed,
    seed_global_rngs,
    seeds_of,
)
from . import transport as _transport
from .fetch import (
    END,
    ERROR,
    OK,
    MapFetcher,
    StreamEnd,
    StreamFetcher,
    make_retrier,
    seed_datapipe,
    shard_datapipe,
)
from .protocol import (
    Booted,
    Epoch,
    InitError,
    Ready,
    Result,
    Started,
    StreamResume,
    TaskMsg,
    WorkerError,
    result_to_wire,
)
from .transport.memfd import use_anonymous_shared_memory
from .transport.taskpipe import TaskReader

# How often an idle worker checks that its parent is still alive. A worker whose parent died
# must not linger; one second keeps the check cheap and the orphan's life short.
PARENT_CHECK_INTERVAL_S = 1.0
PARENT_CHECK_INTERVAL_MS = int(PARENT_CHECK_INTERVAL_S * 1000)
# The parent watch (``_ParentWatch``) sees the main process die at once where the kernel can
# say so (a pidfd, the task pipe's hang-up); where it cannot, it looks this often.
PARENT_WATCH_TICK_S = 0.25
# An orphan busy in a batch is asked to stop at its next Python instruction (SIGTERM), never in
# the middle of a C call such as torch's shared-memory allocation, which would leave a segment's
# name behind. One stuck in C code that does not return to Python is killed after this.
ORPHAN_GRACE_S = 0.5
# When the main process lets a worker go (it closes the task pipe on shutdown), an idle worker
# leaves by itself within milliseconds; one still busy after this is stopped as an orphan is,
# well within the main process's own SHUTDOWN_GRACE_S before it would SIGKILL it.
HANGUP_GRACE_S = 0.25


# ---- the worker's start --------------------------------------------------------------------------


class WorkerSpec:
    """Everything a worker process needs; pickled once per (re)spawn."""

    def __init__(self, **kw: Any) -> None:
        self.worker_id: int = kw["worker_id"]
        self.num_workers: int = kw["num_workers"]
        self.dataset: Any = kw["dataset"]
        self.iterable: bool = kw["iterable"]
        self.auto_collation: bool = kw["auto_collation"]
        self.collate_fn: Any = kw["collate_fn"]
        self.batch_size: int | None = kw["batch_size"]
        self.drop_last: bool = kw["drop_last"]
        self.worker_seed: int = kw["worker_seed"]
        self.base_seed: int = kw["base_seed"]
        self.init_fn: Any = kw["init_fn"]
        self.retry: Any = kw["retry"]
        self.state_every: int | None = kw.get("state_every")
        self.prefetch_factor: int = kw.get("prefetch_factor", 2)
        self.close_fds: list[int] = kw.get("close_fds", [])
        # The main process (under forkserver the worker's parent is the fork server).
        self.main_pid: int = kw.get("main_pid", 0)


def _set_worker_info(spec: WorkerSpec) -> None:
    """Make torch's ``get_worker_info()`` answer here as in torch's own workers: datasets
    shard and seed themselves by it."""
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=spec.worker_id, num_workers=spec.num_workers, seed=spec.worker_seed, dataset=spec.dataset
    )


def worker_main(spec: WorkerSpec, task_conn: Any, result_conn: Any) -> None:
    """Entry point of a worker process."""
    # Under fork we inherited the main process's ends of every loader pipe; holding them would
    # keep a dead sibling's pipe open and hide its EOF from the main process.
    own = {task_conn.fileno(), result_conn.fileno()}
    for fd in spec.close_fds:
        if fd in own:
            continue
        try:
            os.close(fd)
        except OSError:
            pass
    # Ctrl-C is the main process's to handle; a worker dying of it would look like a crash.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by our parent to start
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGCONT, signal.SIG_DFL)  # the main process's pause hook (under fork)
    signal.signal(signal.SIGTERM, _terminate_at_a_safe_point)
    try:
        set_worker_signal_handlers()  # prints a clear message on SIGSEGV/SIGBUS
    except Exception:
        pass
    torch.set_num_threads(1)
    # Batches in shared memory with no name, so a kill leaves nothing in /dev/shm
    # (transport.memfd).
    use_anonymous_shared_memory()
    parent = os.getppid()
    watch = _ParentWatch(spec.main_pid or parent, parent, task_conn.fileno())
    if not watch.main_alive():
        return  # the main process died while this worker was starting
    watch.start()
    try:
        _run_worker(spec, task_conn, result_conn, parent)
    finally:
        watch.leave()


def _run_worker(spec: WorkerSpec, task_conn: Any, result_conn: Any, parent: int) -> None:
    """A started worker: BOOTED, worker_init_fn, READY, then the task loop until it ends."""
    wid = spec.worker_id
    where = f"in DataLoader worker {wid} (pid {os.getpid()})"
    # From here on, a start that takes too long is worker_init_fn's doing (task_timeout).
    if not _send(result_conn, Booted(wid)):
        return
    seeded = False
    try:
        seed_global_rngs(spec.worker_seed, keep_initial_seed=False)
        _set_worker_info(spec)
        shard_datapipe(spec.dataset, wid, spec.num_workers)
        if spec.init_fn is not None:
            before = torch.initial_seed()
            spec.init_fn(wid)
            # Our per-batch seeding will override the user's: the main process says so once.
            seeded = torch.initial_seed() != before
    except Exception:
        err = WorkerError(f"in worker_init_fn of DataLoader worker {wid} (pid {os.getpid()})")
        _send(result_conn, InitError(wid, err))
        return
    if not _send(result_conn, Ready(wid, os.getpid(), seeded)):
        return
    try:
        _loop(spec, task_conn, result_conn, parent, where)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the main process closed our pipes: shut down quietly


# ---- leaving when the main process is gone -------------------------------------------------------
# A worker must not outlive its main process (it would keep its memory, and one stuck in a
# batch would never leave), yet must not die at an arbitrary instruction either (a name left in
# /dev/shm that nothing may delete). So a thread watches for the death, and the worker is asked
# to stop at a Python instruction boundary; SIGKILL is only the last resort.
def _terminate_at_a_safe_point(signum: int, frame: Any) -> None:
    """SIGTERM: die of it, at a Python instruction boundary (where handlers run).

    The kernel's default would end the worker wherever it is, possibly inside torch's
    shared-memory allocation, between creating a segment's name and unlinking it: the name
    would stay in /dev/shm, and nothing may delete it for us (we cannot tell it from another
    job's). Here no C call is in progress, so nothing is half made.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


class _ParentWatch(threading.Thread):
    """Ends the worker within a second of its main process's death, even mid-batch.

    The task loop checks its parent only between tasks, so a worker whose main process was
    SIGKILLed would finish the batch it is in (forever, in a hung read). This thread waits for
    the main process's end: its pidfd becomes readable (Linux >= 5.3), or the task pipe hangs up
    (the main process's end closed: it died, or let this worker go), or -- where neither can be
    had -- the parent changes. Then it asks the worker's main thread to stop (SIGTERM, taken at
    the next Python instruction), and kills the process if that has not happened in
    ORPHAN_GRACE_S.

    Not PR_SET_PDEATHSIG: that follows the thread that started the worker (a loader iterated in
    a thread that ends would lose its workers), under forkserver it follows the fork server,
    and its signal lands at any instruction (SIGKILL mid-allocation leaves a name in /dev/shm).
    """

    def __init__(self, main_pid: int, parent: int, task_fd: int) -> None:
        super().__init__(name="resumable_loader-parent-watch", daemon=True)
        self.main_pid = main_pid
        self.parent = parent
        self.task_fd = task_fd
        self.lock = threading.Lock()
        self.leaving = False
        self.pidfd: int | None = None
        try:
            self.pidfd = os.pidfd_open(main_pid)
        except (AttributeError, OSError):
            pass  # gone already (ESRCH), an old kernel, or a seccomp filter: see main_alive()

    def main_alive(self) -> bool:
        """Whether the main process still runs; checked once more after the pidfd was taken,
        since the main process may have died before this worker got to watch it."""
        if self.pidfd is None:
            try:
                os.kill(self.main_pid, 0)
            except ProcessLookupError:
                return False
            except OSError:
                pass
        return not self._died_within(0.0)

    def _died_within(self, seconds: float) -> bool:
        """Whether the main process is seen dead within ``seconds`` (at once if it is).

        A dying process closes its files before it is reported as ended, so the task pipe can
        hang up a moment before the pidfd becomes readable: wait for the pidfd, not a bare
        moment. (poll, not select: the fd may be above FD_SETSIZE.)
        """
        if self.pidfd is not None:
            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)
            return bool(poller.poll(int(seconds * 1000)))
        if os.getppid() == self.parent and seconds > 0:
            time.sleep(seconds)
        return os.getppid() != self.parent

    def leave(self) -> None:
        """The worker is leaving by itself (STOP, or its pipe's EOF): do not signal it."""
        with self.lock:
            self.leaving = True

    def run(self) -> None:
        poller = select.poll()
        if self.pidfd is not None:
            poller.register(self.pidfd, select.POLLIN)
        # Mask 0: only POLLHUP/POLLERR, so the tasks waiting in the pipe are not consumed here.
        poller.register(self.task_fd, 0)
        tick = -1 if self.pidfd is not None else int(PARENT_WATCH_TICK_S * 1000)
        while not poller.poll(tick):
            if os.getppid() != self.parent:
                break
        # If only the pipe hung up, the main process let this worker go (shutdown, or it was
        # declared dead): an idle worker leaves by itself meanwhile; a busy one is stopped.
        self._died_within(HANGUP_GRACE_S)
        with self.lock:
            busy = not self.leaving
        main = threading.main_thread().ident
        if busy and main is not None:
            try:
                signal.pthread_kill(main, signal.SIGTERM)
            except (OSError, ValueError):
                pass
        time.sleep(ORPHAN_GRACE_S)  # its time to stop; the process ends, this thread with it
        os.kill(os.getpid(), signal.SIGKILL)


# ---- the task loop -------------------------------------------------------------------------------
def _send(sock: Any, msg: Any) -> bool:
    """Send a message of ours; False when the main process is gone (the caller ends quietly)."""
    try:
        _transport.send(sock, msg)
        return True
    except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
        return False


def _loop(spec: WorkerSpec, task_conn: Any, result_conn: Any, parent: int, where: str) -> None:
    """Run the task loop until STOP, the pipe's end, or the main process's death."""
    _WorkerLoop(spec, task_conn, result_conn, parent, where).run()


class _WorkerLoop:
    """A worker's life after Ready: take tasks lowest id first, fetch each under its seed, send
    each result (with a stream's state delta) as soon as it is ready.

    A batch is never kept on ``self``: it lives in ``_result``'s and ``run``'s locals until it
    is sent, then it is dropped and freed at once (its /dev/shm segment with it).
    """

    def __init__(
        self, spec: WorkerSpec, task_conn: Any, result_conn: Any, parent: int, where: str
    ) -> None:
        self.spec = spec
        self.task_conn = task_conn
        self.result_conn = result_conn
        self.parent = parent
        self.where = where
        self.wid = spec.worker_id
        self.fetcher: Any
        if spec.iterable:
            self.fetcher = StreamFetcher(
                spec.dataset,
                spec.auto_collation,
                spec.collate_fn,
                spec.batch_size,
                spec.drop_last,
                spec.state_every,
                exact_retry=spec.retry is not None,
            )
            self.run_task = make_retrier(
                spec.retry, self.fetcher.before_retry, self.fetcher.can_retry
            )
        else:
            self.fetcher = MapFetcher(spec.dataset, spec.auto_collation, spec.collate_fn)
            self.run_task = make_retrier(spec.retry, self._reseed)
        self.spec_dataset = spec.dataset
        self.base = spec.base_seed
        self._seeds = self._seeds_for(self.base)
        self.epoch = 0
        self.gen = -1  # epoch generation: results carry it so stale ones can be told apart
        self.seed = 0  # the task being fetched: what a map-style retry re-seeds with
        # The collate functions known to draw no random numbers (torch's defaults): one redone
        # for lack of /dev/shm needs no RNG snapshot to give the same batch.
        from torch.utils.data import default_collate, default_convert

        self.custom_collate = spec.collate_fn not in (default_collate, default_convert)
        # Pooled segments: the loader's, lent task by task (TaskMsg.grant); a worker whose
        # loader has no pool keeps its share of the window and the caller's batch itself
        # (see transport.pools.SegmentPool).
        self.shm = _transport.ShmPolicy(spec.prefetch_factor + 1)
        self.shm_ok = True  # the batch being built may use /dev/shm (ShmPolicy.allow)
        self.grants: dict[int, int] = {}  # task id -> the loader's segment lent for it
        self.pending: list[tuple[int, int, Any]] = []  # heap of (tid, arrival number, payload)
        self.poller = select.poll()
        self.poller.register(task_conn.fileno(), select.POLLIN)
        self.tasks = TaskReader(task_conn.fileno())
        self.arrivals = 0

    def _seeds_for(self, base: int) -> Any:
        """``k -> `` the seed of task ``k`` (map) or of fetch ``k`` of this worker's shard
        (stream) under epoch seed ``base``: ``derive_seed`` with its fixed part hashed once."""
        if self.spec.iterable:
            return seeds_of(STREAM, base, self.wid)
        return seeds_of(TASK, base)

    def _reseed(self) -> None:
        seed_global_rngs(self.seed)

    def run(self) -> None:
        while self._receive():
            tid, arrival, payload = heapq.heappop(self.pending)
            overtakes = any(a < arrival for _, a, _ in self.pending)
            if overtakes and not _send(self.result_conn, Started(tid)):
                return
            msg = self._result(tid, payload)
            if not self._send_result(tid, msg):
                return
            del msg

    # ---- receiving -----------------------------------------------------------------------
    def _receive(self) -> bool:
        """Take everything waiting in the pipe (so the lowest task id runs first), blocking
        while there is nothing to do; False when the worker must exit."""
        tasks, ready = self.tasks, self.poller.poll
        # (select.poll on the pipe, made once: Connection.poll builds a selector per call.
        # Any event -- data, or the hang-up that ends the loop -- is a recv.) One read takes
        # every message waiting; one that came back short emptied the pipe, so it is not
        # asked again before this task runs.
        tasks.drained = False
        while not self.pending or tasks.pending() or (not tasks.drained and ready(0)):
            if not self.pending and not tasks.pending() and not ready(PARENT_CHECK_INTERVAL_MS):
                if os.getppid() != self.parent:
                    return False  # orphaned: our main process is gone
                continue
            msg = tasks.recv()
            if isinstance(msg, TaskMsg):
                if msg.gen == self.gen:
                    if msg.grant is not None:  # the loader's segment for it (LoaderPool)
                        self.grants[msg.tid] = msg.grant
                    heapq.heappush(self.pending, (msg.tid, self.arrivals, msg.payload))
                    self.arrivals += 1
            elif isinstance(msg, Epoch):
                self.pending.clear()
                self.grants.clear()
                self.gen, self.epoch, self.base = msg.gen, msg.epoch, msg.base_seed
                self._seeds = self._seeds_for(self.base)
                # A worker's copy of a data plan (a Mixture, a Stream's pass) is as old as the
                # worker: the epoch and the plan it serves are the main process's, as its
                # state saves them.
                follow_epoch(self.spec_dataset, msg.epoch, msg.plan)
                if isinstance(self.fetcher, MapFetcher):
                    self.fetcher.sample_seed = msg.sample_seed
                elif not self._start_stream(msg.resume):
                    return False
            else:  # Stop
                return False
        return True

    def _start_stream(self, resume: StreamResume | None) -> bool:
        base, wid = self.base, self.wid

        def seed_for(k: int) -> int:
            return derive_seed(STREAM, base, wid, k)

        def run_start(fn: Any, fetch_seed: int) -> Any:
            seed_global_rngs(fetch_seed)
            return self.run_task(fn)[0]

        try:
            seed_datapipe(self.spec.dataset, base)
            self.fetcher.start(resume, seed_for, run_start)
        except Exception:
            doing = "while restoring the stream state" if resume else "in iter() of the dataset"
            _send(self.result_conn, InitError(wid, WorkerError(f"{doing} {self.where}")))
            return False
        return True

    # ---- one task ------------------------------------------------------------------------
    def _result(self, tid: int, payload: Any) -> Result:
        """Fetch one task under its seed: its ``Result`` (OK, END or ERROR)."""
        spec, fetcher, shm = self.spec, self.fetcher, self.shm
        self.seed = self._seeds(payload if spec.iterable else tid)
        seed_global_rngs(self.seed)
        shm.take_grant(self.grants.pop(tid, None), self.result_conn)
        self.shm_ok = shm.allow()
        # A batch that will be packed into one segment is collated out of /dev/shm: its
        # storages are copied into the segment anyway (see transport.reducers).
        # A pooled segment takes them all as they lie.
        fetcher.shared = self.shm_ok and (shm.pooled or not shm.packing)
        if not shm.large and not self.custom_collate:
            # Every batch so far fit in its message (small tensors, no tensors): torch's
            # collate would build each in a storage from the pool hook, 9 us more than in
            # ordinary memory. One that turns out large is shared at send (one copy), and from
            # then on batches go to /dev/shm as above. (A custom collate_fn keeps seeing its
            # worker info: _collate hides it for an unshared collate.)
            fetcher.shared = False
        if spec.iterable:
            fetcher.guard_collate = self.custom_collate and fetcher.shared and shm.large
        gen = self.gen
        try:
            if not spec.iterable:
                data, retries = self.run_task(self._fetch, payload)
                return Result(gen, tid, OK, data, None, retries, False)
            t0 = time.perf_counter()
            try:
                data, retries = self.run_task(self._fetch, payload)
            except StreamEnd:
                raise
            except Exception:
                fetcher.count += 1  # the fetch happened; a replay must make it too
                fetcher.fetch_failed()
                err = WorkerError(f"{self.where} while loading stream batch {payload}")
                # The state as the stream now stands goes with the error: a resume then
                # continues where this worker goes on, instead of replaying the failed fetch
                # (whose raising sample was not consumed) and dropping what the replay reads.
                delta = fetcher.failed_snapshot()
                return Result(gen, tid, ERROR, err, delta, 0, fetcher.ended)
            delta = fetcher.after_fetch(time.perf_counter() - t0)
            return Result(gen, tid, OK, data, delta, retries, fetcher.ended)
        except StreamEnd:
            return Result(gen, tid, END, None, None, 0, True)
        except Exception:
            what = f"samples {payload}" if not spec.iterable else f"stream batch {payload}"
            err = WorkerError(f"{self.where} while loading {what}")
            return Result(gen, tid, ERROR, err, None, 0, spec.iterable and fetcher.ended)

    def _fetch(self, payload: Any) -> Any:
        """One fetch; a collate that finds /dev/shm full is redone out of it, same values."""
        fetcher = self.fetcher
        try:
            return fetcher.fetch(payload)
        except Exception as exc:
            if not fetcher.shared or not _transport.shm_exhausted(exc):
                raise
            self.shm.failed(exc)
        # (Out of the except block: the error and its frames are gone before the redo.)
        fetcher.shared = self.shm_ok = False
        if self.spec.iterable:
            # The items read are kept (fetcher.partial); the RNGs go back to where they were
            # before the collate, when a snapshot was taken (see guard_collate).
            fetcher.before_retry()
        else:
            seed_global_rngs(self.seed)  # a task is seeded: read again from its seed
        return fetcher.fetch(payload)

    def _send_result(self, tid: int, msg: Result) -> bool:
        """Send; False when the main process is gone. ``msg`` is the batch's only owner here:
        sent, then dropped by the caller, it is freed at once -- nothing on this path may keep
        a reference or form a cycle with it (see pipeline.transport)."""
        try:
            # Tagged with its task: one the main process cannot rebuild can still be named.
            wire = result_to_wire(msg)
            _transport.send(self.result_conn, wire, self.shm, self.shm_ok, (msg.gen, tid))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            return False
        except Exception:
            # The batch could not be pickled (nothing was sent): say so instead of dying.
            err = WorkerError(f"{self.where}: the batch of task {tid} could not be sent (pickling)")
            return _send(self.result_conn, Result(self.gen, tid, ERROR, err, None, 0, False))
        return True
