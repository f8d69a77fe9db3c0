"""Stage 3 of the pipeline: the worker process (and the fetchers the main process reuses).

A worker reads messages from its own task pipe and answers on its own result pipe -- one pair
per worker, so a worker killed mid-write can corrupt nothing but its own pipe, which the
supervisor throws away with it (a shared queue would stay locked by the dead writer).

    main ──(Epoch | TaskMsg | Stop)──► task pipe ──► worker ──► result pipe ──(Result)──► main

(the messages, typed, are in ``_protocol``).

Per task: seed python/numpy/torch from (epoch seed, task), fetch, collate, and send the
result in one message together with the dataset's state for stateful streams ("state rides with
the data"). Tasks waiting in the pipe are run lowest id first, so a task re-sent after a crash
overtakes the prefetched ones queued behind it.
"""

from __future__ import annotations

import heapq
import inspect
import math
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch
from torch.utils.data._utils import worker as torch_worker

from . import _transport
from ._errors import RemoteTraceback
from ._mixture import follow_epoch
from ._protocol import (
    Booted,
    Epoch,
    InitError,
    Ready,
    Result,
    Started,
    Status,
    StreamResume,
    TaskMsg,
    result_to_wire,
)
from ._schema import has_state, same_state
from ._seeding import (
    SAMPLE,
    STREAM,
    TASK,
    capture_rngs,
    derive_seed,
    restore_rngs,
    seed_global_rngs,
    seeds_of,
)
from ._shm import use_anonymous_shared_memory
from ._taskpipe import TaskReader

# The messages and statuses are in _protocol; these names stay importable from here.
OK, ERROR, END = Status.OK, Status.ERROR, Status.END

# Stream state snapshots may cost at most this fraction of the fetch time: a state that is
# expensive to take (a 100k-entry shuffle buffer) then rides with every k-th result only, and a
# resume or respawn replays the < k fetches since (seeded, hence exact). Cheap states -- the
# usual cursor -- ride with every result and nothing is ever read twice.
STATE_BUDGET = 0.03
# ... and never fewer than one snapshot per this many fetches, which bounds a replay.
MAX_STATE_INTERVAL = 256
# A snapshot cheaper than this always rides with its result, whatever the fetch costs: it is
# below the loader's own fixed cost per batch, so saving it would buy nothing.
STATE_FREE_S = 50e-6
# Shipping a snapshot costs too: the worker's write, and the copy into the main process, which
# is the pipeline's serial stage. Charged at about 1 GB/s on top of the measured time.
STATE_BYTE_COST_S = 1e-9
# Judge the cost only after this many snapshots (their minimum): one preempted snapshot on a
# busy machine must not make a cheap state sparse.
STATE_WARMUP = 8

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


class StreamEnd(Exception):
    """The worker's stream has no further batch."""


class KeyErrorMessage(str):
    """KeyError repr()s its argument; keep the multi-line message readable."""

    def __repr__(self) -> str:
        return self


class WorkerError:
    """A picklable record of an exception raised while loading a task."""

    def __init__(self, where: str, exc: BaseException | None = None) -> None:
        if exc is None:
            exc = sys.exc_info()[1]
        assert exc is not None
        self.where = where
        self.type_name = type(exc).__name__
        self.text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.exc_type: type[BaseException] | None = type(exc)
        try:
            pickle.dumps(self.exc_type)
        except Exception:
            self.exc_type = None

    def exception(self) -> BaseException:
        """The exception to raise in the main process (its ``__cause__`` is the remote tb)."""
        msg = f"Caught {self.type_name} {self.where}.\nOriginal {self.text}"
        exc: BaseException
        t = self.exc_type
        if t is KeyError:
            exc = KeyError(KeyErrorMessage(msg))
        else:
            try:
                exc = t(msg) if t is not None else RuntimeError(msg)
            except Exception:
                exc = RuntimeError(msg)
        exc.__cause__ = RemoteTraceback(self.text)
        return exc


# --------------------------------------------------------------------------------------------
# Fetchers: shared by worker processes and the single-process iterator.


class MapFetcher:
    """Fetch a task of a map-style dataset: indices -> collated batch (like torch's)."""

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Any) -> None:
        self.dataset = dataset
        self.auto = auto_collation
        self.collate = collate_fn
        self.getitems = getattr(dataset, "__getitems__", None) if auto_collation else None
        self.shared = True  # in a worker: the collate may allocate in /dev/shm (see _collate)
        # seed_per_sample: the RNGs are seeded from (this, index) before each dataset[index].
        self.sample_seed: int | None = None

    def _seeded_item(self, i: Any) -> Any:
        assert self.sample_seed is not None
        seed_global_rngs(derive_seed(SAMPLE, self.sample_seed, int(i)))
        return self.dataset[i]

    def fetch(self, indices: Any) -> Any:
        if self.sample_seed is not None:
            if self.auto:
                data = [self._seeded_item(i) for i in indices]
                return _collate(self.collate, data, self.shared)
            return _collate(self.collate, self._seeded_item(indices), self.shared)
        if self.auto:
            if self.getitems:
                data = self.getitems(indices)
            else:
                ds = self.dataset
                data = [ds[i] for i in indices]
            return _collate(self.collate, data, self.shared)
        return _collate(self.collate, self.dataset[indices], self.shared)


def shard_datapipe(dataset: Any, worker_id: int, num_workers: int) -> None:
    """A datapipe's ``sharding_filter`` keeps worker ``worker_id``'s share (of this rank's),
    as torch's workers apply it before ``worker_init_fn``."""
    from torch.utils.data import IterDataPipe

    if not isinstance(dataset, IterDataPipe):
        return
    world, rank = 1, 0
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    torch.utils.data.graph_settings.apply_sharding(
        dataset, num_workers * world, worker_id * world + rank
    )


def seed_datapipe(dataset: Any, seed: int) -> None:
    """A datapipe's shufflers draw from one seed shared by all workers (derived from the
    epoch's), as in torch: sharding then splits one order, not one order per worker."""
    from torch.utils.data import IterDataPipe

    if isinstance(dataset, IterDataPipe):
        rng = torch.Generator()
        rng.manual_seed(derive_seed(STREAM, seed, -1, -1))
        torch.utils.data.graph_settings.apply_random_seed(dataset, rng)


def _collate(collate: Any, data: Any, shared: bool) -> Any:
    """``collate(data)``; with ``shared=False``, out of /dev/shm.

    torch's default_collate allocates its output in shared memory when get_worker_info() is
    set (so the batch needs no copy to be sent). When /dev/shm is full, the worker info is
    hidden for the collate alone -- the dataset's own calls still see it -- and the batch is
    built in ordinary memory, to be copied into the message.
    """
    if shared:
        if not _transport.has_pool():
            return collate(data)
        with _transport.collating():  # into the worker's pooled segment
            return collate(data)
    info = torch_worker._worker_info
    torch_worker._worker_info = None
    try:
        return collate(data)
    finally:
        torch_worker._worker_info = info


ITER_START = -1  # the fetch number whose seed is in force while iter(dataset) runs


class StreamFetcher:
    """Fetch batches from an iterable dataset's iterator, tracking its state.

    The state holder is the dataset if it has ``state_dict``/``load_state_dict`` (the
    torch/torchdata "Stateful" shape), else the iterator if it has them, else nothing (the
    stream is then fast-forwarded by replaying fetches).

    Args:
        state_every: take the state after every n-th fetch; None: adaptively, so that taking
            it costs at most STATE_BUDGET of the fetch time (every fetch when it is cheap).
        exact_retry: a RetryPolicy is in force: snapshot the global RNGs before each step
            (each ``next()`` and the collate), so that a retry resumes from the step that
            raised with the RNGs as they were then (~75 us per item, numpy's get_state
            most of it).

    A fetch that raises keeps what it already read in ``partial`` (the items pulled, or the
    whole batch if the collate raised): a retry continues from there, so nothing read from
    the stream is lost. A generator that raised is finished, so it is never retried
    (``can_retry``): its error goes to the caller and its stream ends, as in torch.
    """

    def __init__(
        self,
        dataset: Any,
        auto_collation: bool,
        collate_fn: Any,
        batch_size: int | None,
        drop_last: bool,
        state_every: int | None = None,
        exact_retry: bool = False,
    ) -> None:
        self.dataset = dataset
        self.auto = auto_collation
        self.collate = collate_fn
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.it: Any = None
        self.ended = False
        self.partial: list[Any] = []  # items a failed attempt pulled; a retry starts with them
        self.track_rngs = exact_retry
        self.rngs_before: Any = None  # the global RNGs just before the step that raised last
        self.broken = False  # a generator raised: it is finished, a retry would end the stream
        self.holder: Any = None
        self.prev_state: dict[Any, bytes] = {}
        self.state_every = state_every
        self.interval = 1
        self.since_state = 0
        self.count = 0  # fetches made this epoch
        self._fetch_s: float | None = None
        self._state_s: float | None = None
        self._snapshots = 0
        self.shared = True  # in a worker: the collate may allocate in /dev/shm (see _collate)
        # Snapshot the RNGs before the collate even without a RetryPolicy, so that a collate
        # redone out of a full /dev/shm draws the same numbers (set by the worker loop for a
        # custom collate_fn and large batches: ~35 us, against a batch worth sharing).
        self.guard_collate = False

    @property
    def stateful(self) -> bool:
        return self.holder is not None

    def start(self, resume: StreamResume | None, seed_for: Any, run: Any = None) -> None:
        """Begin the epoch's stream; restore it from ``resume`` (a ``StreamResume``).

        ``run(fn, seed)`` seeds and calls ``fn`` under the fetch's retry policy: a replayed fetch
        is retried exactly like the original was, so a transient error while replaying cannot
        shift the stream.
        """
        self.ended = False
        self.partial = []
        self.broken = False
        self.rngs_before = None
        self.prev_state = {}
        self.count = 0
        self.since_state = 0
        ds = self.dataset
        state = None
        at = count = 0
        if resume is not None:
            raw, encoded, at, count = resume
            if raw:
                state = decode_state(raw) if encoded else raw
                if encoded:
                    self.prev_state = dict(raw)  # what the main process holds: deltas from it
        # iter() may draw random numbers (a shard order shuffled per epoch): it draws from
        # the epoch's stream seed, so a resumed or respawned worker draws the same.
        seed_global_rngs(seed_for(ITER_START))
        if has_state(ds):
            loaded = False
            if state is not None:
                try:
                    ds.load_state_dict(state)
                    loaded = True
                except Exception:
                    # A dataset that builds what load_state_dict needs in __iter__ (written for
                    # torchdata's order): load it after iter(), below.
                    pass
            self.it = iter(ds)
            if state is not None and not (loaded and same_state(ds.state_dict(), state)):
                # iter() reset the position just loaded: the dataset was written for
                # torchdata's order (iter() first, then load_state_dict). Load it again into the
                # iterator that now exists. A dataset whose iter() starts from the loaded state
                # (or a generator, which runs nothing yet) reports it unchanged: loaded once.
                ds.load_state_dict(state)
            self.holder = ds
        else:
            self.it = iter(ds)
            self.holder = self.it if has_state(self.it) else None
            if state is not None:
                if self.holder is None:
                    raise RuntimeError(
                        "a saved stream state cannot be restored: neither the dataset nor its "
                        "iterator has load_state_dict()"
                    )
                self.holder.load_state_dict(state)
        for k in range(at, count):
            try:
                if run is not None:
                    run(self._pull, seed_for(k))
                else:
                    seed_global_rngs(seed_for(k))
                    self._pull()
            except StreamEnd:
                break
            except Exception:
                # It failed after its retries in the original run too (fetches are seeded and
                # deterministic); that error was delivered there.
                self.fetch_failed()
        self.count = count

    def _next_item(self, it: Any) -> Any:
        if self.track_rngs:
            self.rngs_before = capture_rngs()
        try:
            return next(it)
        except StopIteration:
            self.ended = True
            raise StreamEnd from None
        except BaseException:
            if inspect.isgenerator(it):
                self.broken = True
            raise

    def _pull(self) -> list[Any] | Any:
        items, self.partial = self.partial, []
        if not self.auto:
            if items:
                return items[0]  # read before a failed collate
            if self.ended:
                raise StreamEnd
            return self._next_item(self.it)
        bs = self.batch_size
        assert bs is not None
        while len(items) < bs and not self.ended:
            try:
                items.append(self._next_item(self.it))
            except StreamEnd:
                break
            except BaseException:
                self.partial = items  # a retry must not lose what this attempt already read
                raise
        if not items or (self.drop_last and len(items) < bs):
            self.ended = True
            raise StreamEnd
        return items

    def fetch(self, _k: Any = None) -> Any:
        items = self._pull()
        # None unless taken now: a collate redone for lack of /dev/shm must never be handed an
        # earlier batch's RNGs.
        self.rngs_before = capture_rngs() if self.track_rngs or self.guard_collate else None
        try:
            return _collate(self.collate, items, self.shared)
        except BaseException:
            self.partial = items if self.auto else [items]
            raise

    def can_retry(self) -> bool:
        return not self.broken

    def before_retry(self) -> None:
        """Put the RNGs back as they were before the step that raised."""
        if self.rngs_before is not None:
            restore_rngs(self.rngs_before)

    def fetch_failed(self) -> None:
        """The fetch failed for good (its error goes to the caller): drop its partial batch,
        as torch does."""
        self.partial = []

    def after_fetch(self, fetch_s: float) -> dict[Any, bytes] | None:
        """Count a fetch; return the state delta if a snapshot is due with this result."""
        self.count += 1
        if self.holder is None:
            return None
        f = self._fetch_s
        self._fetch_s = fetch_s if f is None else 0.8 * f + 0.2 * fetch_s
        self.since_state += 1
        due = self.state_every if self.state_every is not None else self.interval
        if self.since_state < due:
            return None
        self.since_state = 0
        t0 = time.perf_counter()
        delta = self.state_delta()
        took = time.perf_counter() - t0
        took += STATE_BYTE_COST_S * sum(len(v) for v in delta.values())
        if self.state_every is None:
            # The cheapest snapshot seen is its true cost: being preempted (a busy machine)
            # only ever adds time, and must not make a cheap state go sparse.
            c = self._state_s
            self._state_s = took if c is None else min(c, took)
            self._snapshots += 1
            if self._snapshots < STATE_WARMUP or self._state_s <= STATE_FREE_S:
                self.interval = 1
            else:
                budget = STATE_BUDGET * max(self._fetch_s, 1e-9)
                ratio = math.ceil(self._state_s / budget)
                self.interval = max(1, min(MAX_STATE_INTERVAL, ratio))
        return delta

    def state_delta(self) -> dict[Any, bytes]:
        """The changed keys of the holder's state since the last snapshot, pickled per key.

        Only changed values travel to the main process; unchanged ones are compared as bytes
        here, in the worker, which has the time (it runs in parallel with the others).
        """
        sd = self.holder.state_dict()
        if not isinstance(sd, dict):
            sd = {None: sd}
        prev = self.prev_state
        delta = {}
        for key, value in sd.items():
            blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            if prev.get(key) != blob:
                delta[key] = blob
        for key in prev.keys() - sd.keys():
            delta[key] = b""  # removed key
        if delta:
            prev.update(delta)
            for key in [k for k, v in delta.items() if v == b""]:
                prev.pop(key, None)
        return delta


def merge_state(into: dict[Any, bytes], delta: dict[Any, bytes] | None) -> None:
    """Apply a per-key state delta (b"" marks a removed key)."""
    if not delta:
        return
    into.update(delta)
    if b"" in delta.values():
        for key in [k for k, v in delta.items() if v == b""]:
            into.pop(key, None)


def decode_state(encoded: dict[Any, bytes]) -> Any:
    """Per-key pickled state -> the dataset's plain state (inverse of ``state_delta``)."""
    if set(encoded) == {None}:
        return pickle.loads(encoded[None])
    return {k: pickle.loads(v) for k, v in encoded.items()}


def make_retrier(retry: Any, reseed: Any, can_retry: Any = None) -> Any:
    """A callable ``run(fn, *args) -> (result, retries)`` honouring a RetryPolicy (or None).

    ``reseed()`` runs before each retry (not before the first attempt, which the caller has
    seeded); ``can_retry()``, if given, may veto a retry."""
    if retry is None:

        def run_once(fn: Any, *args: Any) -> tuple[Any, int]:
            return fn(*args), 0

        return run_once

    import tenacity

    types = tuple(retry.exceptions)

    def run(fn: Any, *args: Any) -> tuple[Any, int]:
        retrier = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(retry.attempts),
            wait=tenacity.wait_exponential(multiplier=retry.backoff_s, max=retry.max_backoff_s),
            retry=tenacity.retry_if_exception(
                lambda exc: isinstance(exc, types) and (can_retry is None or can_retry())
            ),
            reraise=True,
            # Only between attempts: the first runs as the caller seeded it.
            before_sleep=lambda _state: reseed(),
        )
        try:
            result = retrier(fn, *args)
        except BaseException as exc:
            # tenacity keeps the error in its retry state, which its own frames in the error's
            # traceback refer to: a cycle that would hold the failed fetch's frames -- the items
            # it read -- until the collector runs. The finished frames are not needed (the
            # traceback's text is what travels), so clear them.
            traceback.clear_frames(exc.__traceback__)
            raise
        return result, retrier.statistics.get("attempt_number", 1) - 1

    return run


# --------------------------------------------------------------------------------------------
# The worker process.


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
    from torch.utils.data._utils import worker as torch_worker

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
        torch._C._set_worker_signal_handlers()  # prints a clear message on SIGSEGV/SIGBUS
    except Exception:
        pass
    torch.set_num_threads(1)
    # Batches in shared memory with no name, so a kill leaves nothing in /dev/shm (_shm).
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


def _send(sock: Any, msg: Any) -> bool:
    try:
        _transport.send(sock, msg)
        return True
    except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
        return False


def _loop(spec: WorkerSpec, task_conn: Any, result_conn: Any, parent: int, where: str) -> None:
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
        # (see _transport.SegmentPool).
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
                if isinstance(self.fetcher, MapFetcher):
                    self.fetcher.sample_seed = msg.sample_seed
                    # A worker's copy of a data plan is as old as the worker: the epoch and
                    # the plan it serves are the main process's, as its state saves them.
                    follow_epoch(self.spec_dataset, msg.epoch, msg.plan)
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
        # storages are copied into the segment anyway (see _transport._place).
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
                raise
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
        a reference or form a cycle with it (see _transport)."""
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
