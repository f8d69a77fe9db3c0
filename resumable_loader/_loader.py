"""The DataLoader and its iterators: where the stages are wired together.

This is the one drawing of the pipeline (docs/internals.md walks along it); each box names its
module.

 sampler / batch_sampler ──► dispatcher ──► task pipe (one per worker) ──► worker process
  (_sampling: the epoch's     (_dispatch: task id = position in          (_worker: per-task
   order; position is state)   the epoch; outstanding: id → indices,      seeded RNGs, fetch,
                               worker; Epoch and re-sends)                collate, send)
                                                                                │
 user ◄── reorder buffer ◄── pin thread ◄── result socket (one per worker) ◄────┘
        (_reorder: releases    (_pin:        (_transport: tensors' fds in-band, never blocks;
         ids in order, drops    optional)     a result carries its stream state delta)
         duplicates)

 supervisor (_supervisor): waits on every result socket, process sentinel and a SIGCHLD
   wake-up pipe, polls liveness, enforces task_timeout; reports each death as a DeathReport.
 recovery (_recovery): turns a death report into decisions -- blame, attempts, poison or
   skip, respawn, EPOCH, re-send -- which the iterator only sees as items or a fatal error.
 lifecycle (_lifecycle): the iterator's states (open → finished / abandoned / broken / closed)
   and the Cursor: the position, read from the reorder buffer, dispatcher and stream ledger,
   frozen when the iterator ends, kept by the loader until the next iter().
 state (_schema: plain-data state, ResumePoint.to_state / from_state; _codec: its bytes).
 messages (_protocol): every message between the main process and a worker, typed, and the
   one Status enum of results and deliveries.
 ranks (_distributed): torch's DistributedSampler cut into shards and re-cut for another world
   size; the global state gathered under torch.distributed.checkpoint.

With num_workers=0 the same state contract holds, with no processes: the main process fetches
each task itself, under the same per-task seeds (its own RNG streams saved and restored).

``state_dict()`` describes what the caller consumed -- never what was prefetched -- so a loader
built the same way and given that state yields exactly the batches the uninterrupted run would
have yielded next.
"""

from __future__ import annotations

import copy
import functools
import inspect
import multiprocessing
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data import Dataset, Sampler

from . import _distributed as D
from . import _schema as S
from ._dispatch import Dispatcher
from ._errors import CheckpointError, LoaderClosedError
from ._lifecycle import Cursor, Life
from ._pin import PinStage, current_device_index, pin_memory
from ._protocol import Delivery, Result, StreamResume
from ._recovery import SKIPPED, Recovery
from ._reorder import ReorderBuffer
from ._sampling import BUILTIN, DISTRIBUTED, FASTFORWARD, ITERABLE, STATEFUL, IndexPlan
from ._seeding import (
    DIST_SEED,
    SAMPLE,
    STREAM,
    TASK,
    WORKER,
    FetchRngs,
    GlobalRngGuard,
    derive_seed,
    draw_base_seed,
    seed_global_rngs,
)
from ._stats import Counters, LoaderStatistics
from ._supervisor import DeathReport, Supervisor, WorkerSlot
from ._tasks import MapTasks, StreamTasks, TaskSource
from ._worker import (
    END,
    ERROR,
    OK,
    MapFetcher,
    StreamEnd,
    StreamFetcher,
    WorkerSpec,
    make_retrier,
    seed_datapipe,
)

T_co = TypeVar("T_co", covariant=True)

_TORCH_HAS_IN_ORDER = "in_order" in inspect.signature(_TorchDataLoader.__init__).parameters

_SKIP = object()


@dataclass(frozen=True)
class RetryPolicy:
    """Retry transient errors inside the worker, with exponential backoff (via tenacity).

    A fetch (``__getitem__``/``__getitems__`` + collate for map-style datasets; ``next()`` and
    collate for a stream) raising one of ``exceptions`` is tried again, up to ``attempts``
    times in all, waiting ``backoff_s * 2**n`` (at most ``max_backoff_s``) between tries, so
    that a retried batch has the same values as one that succeeded first time: a map-style
    task's RNGs are re-seeded before each try; a stream keeps the items already read and puts
    the RNGs back as they were before the step that raised. A generator that raised is
    finished and is not retried. Other exceptions are re-raised in the main process at once,
    as torch does.
    """

    exceptions: tuple[type[BaseException], ...] = (OSError, TimeoutError)
    attempts: int = 3
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("RetryPolicy backoffs must be >= 0")
        if not self.exceptions or not all(
            isinstance(e, type) and issubclass(e, BaseException) for e in self.exceptions
        ):
            raise ValueError(
                f"RetryPolicy.exceptions must be exception types, got {self.exceptions!r}"
            )


# KeyboardInterrupt and SystemExit (a SIGTERM handler calling sys.exit) are not errors of the
# data: raised inside next(), they end the iterator (see _lifecycle), and the batch being
# loaded is not counted as delivered.
_INTERRUPTS = (KeyboardInterrupt, SystemExit)
_INTERRUPTED = "interrupted inside next() (KeyboardInterrupt or SystemExit)"


def _fresh(err: BaseException) -> BaseException:
    """A copy of a stored error to raise, so the stored one never holds a traceback.

    A traceback holds the iterator's frames, and the iterator holds the stored error: raising
    the stored error itself would form a reference cycle, and the iterator (and whatever it
    keeps alive) would wait for the garbage collector.
    """
    try:
        copied = copy.copy(err)
    except Exception:
        return err
    copied.__cause__ = err.__cause__
    return copied


class _BaseIter:
    """What both iterators share: the lifecycle (see ``_lifecycle``) and the cursor."""

    _cursor: Cursor
    _finalizer: Any

    def __init__(self, loader: DataLoader[Any], epoch: int) -> None:
        self._loader = loader
        self.epoch = epoch
        self._life = Life.OPEN
        self._why = ""  # why it was abandoned, for the error a later next() raises
        self._broken: BaseException | None = None
        self._plan: IndexPlan = loader._plan
        self._iterable = self._plan.kind == ITERABLE
        self._stateful_sampler = self._plan.kind == STATEFUL
        self._base: int = loader._seed
        self._counters: Counters = loader._counters
        # An iterable dataset's len(loader), if the caller asked for it: more batches than that
        # is warned about, as torch does (scripts watch for it).
        self._len_reported: int | None = (
            loader._IterableDataset_len_called if self._iterable else None
        )
        self._num_yielded = 0  # batches of this epoch delivered (from the resumed position)

    def __iter__(self) -> _BaseIter:
        return self

    def __len__(self) -> int:
        return len(self._loader)

    @property
    def life(self) -> Life:
        return self._life

    @property
    def finished(self) -> bool:
        return self._life is Life.FINISHED

    @property
    def is_open(self) -> bool:
        return self._life is Life.OPEN

    def _check_usable(self) -> None:
        life = self._life
        if life is Life.OPEN:
            return
        if life is Life.BROKEN:
            self._raise_broken()
        if life is Life.FINISHED:
            raise StopIteration  # an exhausted iterator keeps saying so, as torch's does
        if life is Life.CLOSED:
            raise LoaderClosedError("this DataLoader was closed; build a new one to iterate again")
        raise LoaderClosedError(
            f"this DataLoader iterator was {self._why}. Its position is kept in "
            "loader.state_dict(); to continue from it, call "
            "loader.load_state_dict(loader.state_dict()) and then iter(loader)"
        )

    def _delivered(self, batch: Any) -> Any:
        """Count a batch handed to the caller; warn when a stream overruns its reported len."""
        self._counters.batches += 1
        self._num_yielded += 1
        reported = self._len_reported
        if reported is not None and self._num_yielded > reported:
            msg = (
                f"Length of IterableDataset {self._loader.dataset} was reported to be "
                f"{reported} (when accessing len(dataloader)), but {self._num_yielded} "
                "samples have been fetched."
            )
            if self._loader.num_workers > 0:
                # Its first words are torch's (scripts and torch's tests match on them).
                msg += (
                    " For multiprocessing data-loading, this usually means each worker iterates "
                    "its own copy of the dataset: shard it with "
                    "torch.utils.data.get_worker_info() so they do not all yield it all."
                )
            warnings.warn(msg, UserWarning, stacklevel=3)
        return batch

    def _raise_broken(self) -> None:
        assert self._broken is not None
        err = _fresh(self._broken)
        try:
            raise err
        finally:
            del err

    def _deliver_skipped(self, payload: Any) -> None:
        tid, indices, message = payload
        self._counters.skipped.append([self.epoch, tid, indices])
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    # ---- transitions out of OPEN (each final) ---------------------------------------------
    def _finish(self) -> None:
        self._cursor.finished = True
        self._end(Life.FINISHED)

    def _abandon(self, why: str) -> None:
        """Left before its end: keep the position, release the workers."""
        self._why = why
        self._end(Life.ABANDONED)

    def close(self) -> None:
        """The loader was closed (loader.close())."""
        self._end(Life.CLOSED)

    def _end(self, life: Life) -> None:
        if self._life is Life.OPEN:
            self._life = life
        self._finalizer()  # freezes the cursor, then releases what the iterator holds


# ---- num_workers=0 ----------------------------------------------------------------------------
class _SingleProgress:
    """What a num_workers=0 iterator has delivered. Its cursor reads this, not the iterator."""

    __slots__ = ("ahead", "consumed", "drawn", "exhausted", "fetcher", "k", "seed", "source", "tid")

    def __init__(self, rp: S.ResumePoint | None) -> None:
        # Ids > consumed already delivered (in_order=False), for the state.
        self.ahead: set[int] = set(rp.ahead) if rp else set()
        self.consumed = rp.consumed if rp else 0
        self.drawn: dict[int, Any] = {}  # stateful samplers: drawn, not yet consumed
        self.tid = 0  # the next task id to draw
        self.source: Any = None
        self.seed = 0  # the map task being fetched: what a retry re-seeds with
        # Streams:
        self.fetcher: Any = None
        self.k = 0  # fetches delivered
        self.exhausted = False


def _single_position(
    epoch: int, plan: IndexPlan, p: _SingleProgress, stateless: list[bool]
) -> S.ResumePoint:
    rp = S.ResumePoint(
        seed=0,  # the loader's, filled in by state_dict()
        epoch=epoch,
        consumed=p.consumed,
        ahead=frozenset(p.ahead),
        stateful=plan.kind == STATEFUL,
        iterable=plan.kind == ITERABLE,
    )
    if rp.stateful:
        rp.sampler_state = plan.sampler_state()
        rp.drawn = p.tid
        rp.sampler_done = bool(getattr(p.source, "done", False))
        rp.outstanding = sorted(p.drawn.items())
    if rp.iterable:
        holder = None if stateless[0] else p.fetcher.holder
        state = copy.deepcopy(holder.state_dict()) if holder is not None else None
        exhausted = p.exhausted or p.fetcher.ended
        rp.workers = [S.WorkerPosition(p.k, exhausted, state, p.k if state is not None else 0)]
    return rp


class _SingleProcessIter(_BaseIter):
    """num_workers=0: the main process fetches each task under its task seed."""

    def __init__(self, loader: DataLoader[Any], epoch: int, rp: S.ResumePoint | None) -> None:
        super().__init__(loader, epoch)
        plan = self._plan
        self._pin = loader._pin_fn()
        p = self._p = _SingleProgress(rp)
        self._num_yielded = p.consumed
        # The ids to skip when drawn (delivered before the checkpoint, in_order=False): a set
        # apart from ``ahead``, because advancing ``consumed`` must not forget what to skip.
        self._skip = set(p.ahead)
        self._owed: list[tuple[int, Any]] = []
        self._rngs = FetchRngs()  # each fetch under its seed, the caller's RNGs kept apart
        # Set when an interrupt cut a stream fetch short: the stream then stands past items
        # never delivered, so its own state no longer matches the position, and a resume
        # replays the delivered fetches instead (seeded, hence exact).
        self._stateless = [False]
        if self._iterable:
            fetcher = StreamFetcher(
                loader.dataset,
                loader._auto_collation,
                loader.collate_fn,
                loader.batch_size,
                loader.drop_last,
                exact_retry=loader.retry is not None,
            )
            self._fetcher: Any = fetcher
            p.fetcher = fetcher
            # As in workers: a retry resumes the step that raised, with the RNGs of then.
            run = make_retrier(loader.retry, fetcher.before_retry, fetcher.can_retry)
            self._run = run
            wp = rp.workers[0] if rp else S.WorkerPosition()
            resume: StreamResume | None = None
            if wp.exhausted:
                pass  # nothing more this epoch; start the next one from a fresh iterator
            elif wp.dataset_state is not None or wp.delivered:
                if wp.dataset_state is None:
                    loader._warn_fast_forward(wp.delivered)
                at = wp.state_at if wp.dataset_state is not None else 0
                resume = StreamResume(wp.dataset_state, False, at, wp.delivered)
            base = self._base

            def replay(fn: Any, fetch_seed: int) -> Any:
                seed_global_rngs(fetch_seed)
                return run(fn)[0]

            with GlobalRngGuard():
                seed_datapipe(loader.dataset, base)
                fetcher.start(resume, lambda k: derive_seed(STREAM, base, 0, k), replay)
            p.k = wp.delivered
            p.exhausted = wp.exhausted
            p.tid = p.consumed
        else:
            # The retry re-seeds with the task being fetched: read from ``p``, not ``self``,
            # so that the iterator forms no reference cycle with its own retrier.
            self._run = make_retrier(loader.retry, lambda: seed_global_rngs(p.seed))
            self._fetcher = MapFetcher(loader.dataset, loader._auto_collation, loader.collate_fn)
            self._fetcher.sample_seed = loader._sample_seed()
            if self._stateful_sampler and rp is not None:
                p.source = plan.epoch(
                    self._base, epoch, rp.drawn, rp.sampler_state, rp.sampler_done
                )
                self._owed = sorted(rp.outstanding)
                p.tid = rp.drawn
            else:
                p.source = plan.epoch(self._base, epoch, p.consumed)
                p.tid = p.consumed
            p.drawn = dict(self._owed)
        self._cursor = Cursor(
            epoch, functools.partial(_single_position, epoch, plan, p, self._stateless)
        )
        self._finalizer = weakref.finalize(self, self._cursor.freeze)

    def _next_task(self) -> tuple[int, Any]:
        if self._owed:
            return self._owed.pop(0)
        p = self._p
        payload = next(p.source)  # StopIteration ends the epoch
        tid = p.tid
        p.tid += 1
        return tid, payload

    def __next__(self) -> Any:
        self._check_usable()
        try:
            return self._next_stream() if self._iterable else self._next_map()
        except _INTERRUPTS:
            self._abandon(_INTERRUPTED)
            raise

    def _next_map(self) -> Any:
        p = self._p
        while True:
            try:
                tid, indices = self._next_task()
            except StopIteration:
                self._finish()
                raise
            if tid in self._skip:
                self._skip.discard(tid)
                continue
            break
        if self._stateful_sampler:
            p.drawn[tid] = indices
        p.seed = derive_seed(TASK, self._base, tid)
        try:
            with self._rngs.seeded(p.seed):
                data, retries = self._run(self._fetcher.fetch, indices)
        except BaseException as exc:
            # A batch whose load raised is consumed, as with torch -- unless it was an
            # interrupt: not delivered, so not consumed, and a resume loads it again.
            if not isinstance(exc, _INTERRUPTS):
                self._consume(tid)
            raise
        self._consume(tid)
        self._counters.retries += retries
        return self._delivered(self._pin(data) if self._pin else data)

    def _consume(self, tid: int) -> None:
        p = self._p
        p.drawn.pop(tid, None)
        if tid == p.consumed:
            p.consumed += 1
            while p.consumed in p.ahead:
                p.ahead.discard(p.consumed)
                p.consumed += 1
        else:
            p.ahead.add(tid)

    def _next_stream(self) -> Any:
        p = self._p
        if p.exhausted:
            self._finish()
            raise StopIteration
        seed = derive_seed(STREAM, self._base, 0, p.k)
        try:
            with self._rngs.seeded(seed):
                data, retries = self._run(self._fetcher.fetch)
        except StreamEnd:
            p.exhausted = True
            self._finish()
            raise StopIteration from None
        except _INTERRUPTS:
            self._stateless[0] = True
            raise
        except Exception:
            self._fetcher.fetch_failed()
            p.k += 1
            p.consumed += 1
            raise
        p.k += 1
        p.consumed += 1
        self._counters.retries += retries
        return self._delivered(self._pin(data) if self._pin else data)


# ---- num_workers>0 ----------------------------------------------------------------------------
def _retire(cursor: Cursor, sup: Supervisor, owns_sup: bool, pin: PinStage | None) -> None:
    """An iterator's end, from close() or its finalizer: the position first, then the rest.

    Not a method: the finalizer must not keep the iterator alive.
    """
    try:
        cursor.freeze()
    finally:
        if pin is not None:
            if not owns_sup:
                sup.unwatch_extra(pin.wake_fd)  # the persistent pool outlives this pin thread
            pin.close()
        if owns_sup:
            sup.shutdown()


def _pipeline_position(
    epoch: int,
    reorder: ReorderBuffer,
    disp: Dispatcher,
    tasks: TaskSource,
    pin: PinStage | None,
) -> S.ResumePoint:
    """The position of a multi-process epoch, from the stages that know it."""
    rp = S.ResumePoint(
        seed=0,  # the loader's, filled in by state_dict()
        epoch=epoch,
        consumed=reorder.rcvd,
        ahead=reorder.ahead,
    )
    tasks.export(rp, disp, reorder, pin)
    return rp


class _MultiProcessIter(_BaseIter):
    """num_workers>0: the pipeline drawn at the top of this module."""

    def __init__(
        self,
        loader: DataLoader[Any],
        epoch: int,
        rp: S.ResumePoint | None,
        pool: Supervisor | None,
    ) -> None:
        super().__init__(loader, epoch)
        self._owns_sup = pool is None
        self._in_order = loader.in_order
        self._timeout = loader.timeout
        self._pin: PinStage | None = None
        # An exception that arrived while a batch was being handed over (a Ctrl-C during the
        # dispatch that refills the prefetch window): that batch is delivered, this is raised
        # at the next call.
        self._pending: BaseException | None = None
        sup = pool if pool is not None else loader._make_supervisor(epoch)
        self._sup = sup
        self._cursor = Cursor(epoch, dict)  # bound to the stages once they exist
        self._finalizer = weakref.finalize(self, _retire, self._cursor, sup, self._owns_sup, None)
        try:
            self._setup(loader, rp)
        except BaseException:
            self._end(Life.ABANDONED)
            raise

    def _start_processes(self, loader: DataLoader[Any]) -> None:
        """The workers (a persistent pool's dead ones replaced), then the pin thread."""
        sup = self._sup
        if self._owns_sup:
            sup.start_all()
        else:
            for slot in sup.slots:
                if not slot.alive:
                    sup.respawn(slot)
        pin_fn = loader._pin_fn()
        if pin_fn is not None:
            device = None if pin_fn is loader._force_pin_fn else current_device_index()
            self._pin = PinStage(loader._fork_lock, pin_fn, device)
            sup.watch_extra(self._pin.wake_fd, "pin")
            self._finalizer.detach()
            self._finalizer = weakref.finalize(
                self, _retire, self._cursor, sup, self._owns_sup, self._pin
            )

    def _setup(self, loader: DataLoader[Any], rp: S.ResumePoint | None) -> None:
        self._start_processes(loader)
        sup = self._sup
        loader._pool_gen += 1
        start = rp.consumed if rp else 0
        ahead = rp.ahead if rp else frozenset()
        if self._iterable:
            # A stream resumes per worker; task ids restart after what was consumed.
            start, ahead = start + len(ahead), frozenset()
        self._reorder = reorder = ReorderBuffer(self._in_order, start, ahead)
        self._num_yielded = start + len(ahead)
        tasks = self._task_source(loader, rp, start, len(sup.slots))
        pin = self._pin

        def backlog() -> int:
            return len(reorder) + (pin.in_flight if pin is not None else 0)

        disp = Dispatcher(sup, tasks, loader.prefetch_factor or 0, start, backlog, self._in_order)
        disp.gen = loader._pool_gen
        disp.epoch = self.epoch
        disp.base_seed = self._base
        disp.sample_seed = loader._sample_seed()
        self._disp = disp
        self._tasks = tasks
        self._recovery = Recovery(
            sup,
            disp,
            epoch=self.epoch,
            max_attempts=loader.max_task_attempts,
            on_poison=loader.on_poison,
            counters=self._counters,
            start_method=sup.ctx.get_start_method(),
            transient=tuple(loader.retry.exceptions) if loader.retry is not None else (),
        )
        tasks.begin(disp)
        self._cursor.bind(
            functools.partial(_pipeline_position, self.epoch, reorder, disp, tasks, pin)
        )
        for slot in sup.slots:
            slot.outstanding.clear()
            disp.send_epoch(slot)
        disp.fill()

    def _task_source(
        self, loader: DataLoader[Any], rp: S.ResumePoint | None, start: int, n: int
    ) -> TaskSource:
        """The epoch's tasks: a stream's shards, or the sampler's batches from ``start``."""
        if self._iterable:
            return StreamTasks(n, rp, loader._warn_fast_forward)
        owed: list[tuple[int, Any]] = []
        if self._stateful_sampler and rp is not None:
            indices = self._plan.epoch(
                self._base, self.epoch, rp.drawn, rp.sampler_state, rp.sampler_done
            )
            owed = rp.outstanding
        else:
            indices = self._plan.epoch(self._base, self.epoch, start)
        return MapTasks(
            self._plan, indices, start, n, self._reorder.seen, self._stateful_sampler, owed
        )

    # ---- the caller's side ---------------------------------------------------------------
    def __next__(self) -> Any:
        self._check_usable()
        try:
            if self._pending is not None:
                exc, self._pending = self._pending, None
                try:
                    raise exc
                finally:
                    del exc
            return self._next_batch()
        except _INTERRUPTS:
            # Interrupted while results were being taken in: some may be half-handled, so
            # this iterator cannot go on safely. What it delivered is exactly known.
            self._abandon(_INTERRUPTED)
            raise

    def _next_batch(self) -> Any:
        reorder = self._reorder
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            if reorder.ready():
                tid, item = reorder.pop()
                # The released slot in the prefetch window goes back to work before the
                # caller gets the batch, so workers never idle while the caller computes.
                try:
                    self._disp.fill()
                except BaseException as exc:
                    self._pending = exc  # the batch is released: deliver it first
                try:
                    out = self._deliver(tid, item)
                finally:
                    # Not kept in this frame: an error raised from the item must not be
                    # reachable from its own traceback (a cycle holding the iterator).
                    item = None
                if out is not _SKIP:
                    return self._delivered(out)
                continue
            if self._epoch_done():
                self._finish()
                raise StopIteration
            now = time.monotonic()
            wait = self._sup.next_deadline(now) - now
            if deadline is not None:
                if now >= deadline:
                    raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
                wait = min(wait, deadline - now)
            self._pump(wait)
            self._counters.wait_time_s += time.monotonic() - now

    def _deliver(self, tid: int, item: Delivery) -> Any:
        self._tasks.delivered(tid, item)
        status, payload = item.status, item.payload
        del item
        if status == OK:
            return payload
        if status == ERROR:
            raise payload.exception()
        if status == END:
            return _SKIP
        if status == SKIPPED:
            self._deliver_skipped(payload)
            return _SKIP
        err, payload = payload, None  # POISON: raise it with no local left referring to it
        try:
            raise err
        finally:
            del err

    def _epoch_done(self) -> bool:
        disp = self._disp
        if not self._tasks.done or disp.tasks:
            return False
        if self._pin is not None and self._pin.in_flight:
            return False
        if len(self._reorder):
            raise AssertionError(
                f"reorder buffer holds {self._reorder.buffered_ids()} but rcvd is "
                f"{self._reorder.rcvd} and nothing is outstanding"
            )
        return True

    # ---- the workers' side ---------------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        for kind, slot, data in self._sup.poll(timeout):
            if kind == "msg":
                self._on_result(slot, data)
            elif kind == "dead":
                self._on_dead(slot, data)
        if self._pin is not None:
            for tid, item in self._pin.drain():
                if not self._reorder.put(tid, item):
                    self._counters.duplicates_dropped += 1
        self._disp.fill()

    def _on_result(self, slot: WorkerSlot, msg: Result) -> None:
        if msg.gen != self._disp.gen:
            return  # from an epoch abandoned with persistent workers
        tid = msg.tid
        if self._disp.on_result(slot, tid) is None:
            self._counters.duplicates_dropped += 1
            return
        self._counters.retries += msg.retries
        item = Delivery(msg.status, msg.payload, self._tasks.received(slot, msg))
        if self._pin is not None:
            # Everything goes through the pin thread's FIFO, errors and ENDs too: a stream's
            # END must not overtake that worker's batches still being pinned.
            self._pin.submit(tid, item)
        elif not self._reorder.put(tid, item):
            self._counters.duplicates_dropped += 1

    def _on_dead(self, slot: WorkerSlot, report: DeathReport) -> None:
        outcome = self._recovery.on_death(slot, report)
        for tid, item in outcome.deliver:
            if not self._reorder.put(tid, item):
                self._counters.duplicates_dropped += 1
        if outcome.fatal is not None:
            self._break(outcome.fatal)

    def _break(self, err: BaseException) -> None:
        self._broken = err
        self._end(Life.BROKEN)
        if not self._owns_sup:
            self._loader._drop_pool()
        self._raise_broken()

    # ---- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        r = self._reorder
        r.check_invariants()
        self._disp.check_invariants(lambda t: t < r.rcvd or t in r.ahead)


class DataLoader(_TorchDataLoader[T_co], Generic[T_co]):
    """A drop-in ``torch.utils.data.DataLoader`` with exact checkpoint/resume and
    self-healing workers.

    All of torch's arguments keep torch's meaning, defaults and validation errors. Added
    (keyword-only):

    Args:
        task_timeout: seconds a single task may run in a worker before the worker is declared
            hung, killed and replaced (its tasks re-sent). ``None`` (default): never. torch's
            ``timeout`` keeps its meaning (raise when no batch arrives in time).
        max_task_attempts: a task whose worker dies (or hangs) this many times is a poison
            task; see ``on_poison``. Also the number of consecutive failed starts of a worker
            after which the loader gives up.
        on_poison: ``"raise"`` (default): raise ``WorkerCrashError`` naming the samples at
            that batch's position (the iterator stays usable); ``"skip"``: skip the batch with a
            ``RuntimeWarning``, and record it in ``state_dict()["skipped"]`` and
            ``statistics().skipped_tasks``.
        retry: a ``RetryPolicy`` to retry transient errors inside workers, or None.
        stream_state_every: iterable datasets with state: send the dataset's state with every
            n-th result. ``None`` (default): adaptively -- with every result while taking it
            costs under 3% of a fetch (then a resume reads nothing twice), else less often, and
            a resume or respawn replays the fetches since the last state (at most 255).
            ``1``: always with every result, whatever it costs.
        snapshot_every_n_steps: torchdata's name for ``stream_state_every`` (accepted so that
            a migration from ``StatefulDataLoader`` is an import change).
        seed_per_sample: map-style datasets: seed python ``random``, numpy and torch before
            each ``dataset[i]`` from (epoch seed, i) -- with a DistributedSampler, from (its
            seed, its epoch, i), the same on every rank -- so a sample's random augmentation
            does not depend on the batch it is in: values stay identical across changes of
            world size, ``num_workers`` and batch composition. ``__getitems__`` is then not
            used (the samples are fetched one by one). Costs a few microseconds per sample.

    Methods beyond torch's: ``state_dict()``, ``load_state_dict()``, ``statistics()``,
    ``close()`` and context-manager use.
    """

    def __init__(
        self,
        dataset: Dataset[T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        task_timeout: float | None = None,
        max_task_attempts: int = 3,
        on_poison: str = "raise",
        retry: RetryPolicy | None = None,
        stream_state_every: int | None = None,
        snapshot_every_n_steps: int | None = None,
        seed_per_sample: bool = False,
    ) -> None:
        extra = {"in_order": in_order} if _TORCH_HAS_IN_ORDER else {}
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            **extra,
        )
        if not _TORCH_HAS_IN_ORDER:
            self.in_order = in_order
        if task_timeout is not None and not task_timeout > 0:
            raise ValueError(
                f"task_timeout must be a positive number of seconds or None, got {task_timeout!r}"
            )
        if type(max_task_attempts) is not int or max_task_attempts < 1:
            raise ValueError(f"max_task_attempts must be an int >= 1, got {max_task_attempts!r}")
        if on_poison not in ("raise", "skip"):
            raise ValueError(f"on_poison must be 'raise' or 'skip', got {on_poison!r}")
        if snapshot_every_n_steps is not None:
            # torchdata's name for the same thing: a migration is an import change.
            if stream_state_every not in (None, snapshot_every_n_steps):
                raise ValueError(
                    f"snapshot_every_n_steps={snapshot_every_n_steps!r} and stream_state_every="
                    f"{stream_state_every!r} disagree: they are two names for one setting; "
                    "pass one of them"
                )
            # torchdata's 0 means "no periodic snapshots": our adaptive default, which snapshots
            # only as often as it is cheap and replays exactly in between.
            stream_state_every = snapshot_every_n_steps or None
        if stream_state_every is not None and (
            type(stream_state_every) is not int or stream_state_every < 1
        ):
            raise ValueError(
                f"stream_state_every must be an int >= 1 or None, got {stream_state_every!r}"
            )
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a resumable_loader.RetryPolicy or None, got {retry!r}")
        self.task_timeout = task_timeout
        self.max_task_attempts = max_task_attempts
        self.on_poison = on_poison
        self.retry = retry
        self.stream_state_every = stream_state_every
        if type(seed_per_sample) is not bool:
            raise TypeError(f"seed_per_sample must be a bool, got {seed_per_sample!r}")
        self.seed_per_sample = seed_per_sample
        self._plan = IndexPlan(dataset, self.sampler, self.batch_sampler, self._auto_collation)
        self._counters = Counters()
        # The seed of the latest epoch begun, drawn at its iter() as torch draws its base seed;
        # and how many seeds were drawn from the loader's own generator so far (a resumed
        # loader advances its generator as far, so later epochs draw what they drew).
        self._seed = 0
        self._draws = 0
        self._next_epoch = 0
        self._resume: S.ResumePoint | None = None
        self._active: Callable[[], _BaseIter | None] = lambda: None
        # The position of the latest iterator; it outlives the iterator (see _lifecycle).
        self._cursor: Cursor | None = None
        self._pool: Supervisor | None = None
        self._pool_finalizer: Any = None
        self._pool_gen = 0
        self._fork_lock = threading.Lock()
        self._config_cache: dict[str, Any] | None = None
        self._closed = False
        self._warned_ff = False
        self._force_pin_fn: Callable[[Any], Any] | None = None  # tests: pin without a GPU

    # ---- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Any:
        if self._closed:
            raise LoaderClosedError("this DataLoader was closed; build a new one to iterate again")
        # torch's meaning of iter(): a new epoch, also after an abandoned one; a state given
        # to load_state_dict() is continued instead.
        rp, self._resume = self._resume, None
        epoch = rp.epoch if rp is not None else self._next_epoch
        if self._plan.kind == DISTRIBUTED:
            self._seed = self._distributed_epoch(rp)
        else:
            self._seed = rp.seed if rp is not None and rp.seed is not None else self._draw_seed()
        old = self._active()
        if old is not None and self.persistent_workers and old.is_open:
            old._abandon(
                "replaced by a newer iter(loader): with persistent_workers one worker "
                "pool serves one iterator at a time"
            )
        it: _BaseIter
        try:
            if self.num_workers == 0:
                it = _SingleProcessIter(self, epoch, rp)
            elif self.persistent_workers:
                if self._pool is None or self._pool.closed:
                    self._pool = self._make_supervisor(epoch)
                    self._pool.start_all()
                    self._pool_finalizer = weakref.finalize(self, self._pool.shutdown)
                it = _MultiProcessIter(self, epoch, rp, self._pool)
            else:
                it = _MultiProcessIter(self, epoch, rp, None)
        except BaseException:
            self._resume = rp  # nothing was delivered: the next iter() starts over from it
            raise
        self._next_epoch = epoch + 1
        self._active = weakref.ref(it)
        self._cursor = it._cursor
        return it

    def _distributed_epoch(self, rp: S.ResumePoint | None) -> int:
        """Set the DistributedSampler epoch (and resize levels) the next epoch iterates, and
        return its seed: a function of (sampler seed, sampler epoch, level, rank), the same in
        a resumed run, with no RNG drawn."""
        sampler = self._plan.sampler
        history: list[Any] = []
        if rp is not None and (rp.consumed or rp.ahead or rp.history):
            if sampler.epoch != rp.sampler_epoch:
                self._resume = rp  # nothing was delivered: the next iter() may try again
                raise CheckpointError(
                    f"cannot continue the saved epoch: the state is in the middle of the "
                    f"DistributedSampler's epoch {rp.sampler_epoch}, but set_epoch("
                    f"{sampler.epoch}) was called after load_state_dict(). Call "
                    f"sampler.set_epoch({rp.sampler_epoch}) for the resumed epoch (the loader "
                    "state's ['distributed']['sampler_epoch'])."
                )
            history = rp.history
        self._plan.dist_position = (sampler.epoch, history)
        return derive_seed(
            DIST_SEED, sampler.seed, sampler.epoch, len(history), sampler.num_replicas, sampler.rank
        )

    def _sample_seed(self) -> int | None:
        """What each sample's seed derives from (``seed_per_sample``), else None."""
        if not self.seed_per_sample or self._plan.kind == ITERABLE:
            return None
        if self._plan.kind == DISTRIBUTED:
            sampler = self._plan.sampler
            return derive_seed(SAMPLE, sampler.seed, sampler.epoch)
        return derive_seed(SAMPLE, self._seed)

    def _generator(self) -> torch.Generator | None:
        """The generator an epoch's seed is drawn from: the loader's, else that of torch's own
        RandomSampler, else None (torch's global RNG)."""
        gen = self.generator
        if gen is None and type(self.sampler) is torch.utils.data.RandomSampler:
            gen = self.sampler.generator
        return gen

    def _draw_seed(self) -> int:
        """A new epoch's seed, drawn as torch draws its base seed at each ``iter()``: so
        ``torch.manual_seed(s)`` (or ``generator.manual_seed(s)``) before an epoch gives the
        same epoch again."""
        gen = self._generator()
        if gen is not None:
            self._draws += 1
        return draw_base_seed(gen)

    def _pin_fn(self) -> Callable[[Any], Any] | None:
        if self._force_pin_fn is not None:
            return self._force_pin_fn
        if not self.pin_memory:
            return None
        if self.pin_memory_device:
            warnings.warn(
                "pin_memory_device is deprecated, the current accelerator will be used as the "
                f"device,ignore pin_memory_device='{self.pin_memory_device}'.",
                stacklevel=3,
            )
        acc = getattr(torch, "accelerator", None)
        available = acc.is_available() if acc is not None else torch.cuda.is_available()
        if not available:
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, then device "
                "pinned memory won't be used.",
                stacklevel=3,
            )
            return None
        return pin_memory

    def _make_supervisor(self, epoch: int) -> Supervisor:
        # The seed of the epoch the workers start in (persistent ones keep it: each epoch's
        # own seed reaches them with its EPOCH message).
        base = self._seed
        iterable = self._plan.kind == ITERABLE

        # A plain dict, not a closure over the loader: the supervisor is kept alive by the
        # finalizer registered on the loader, and must not keep the loader alive in turn.
        common = dict(
            num_workers=self.num_workers,
            dataset=self.dataset,
            iterable=iterable,
            auto_collation=self._auto_collation,
            collate_fn=self.collate_fn,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            base_seed=base,
            init_fn=self.worker_init_fn,
            retry=self.retry,
            state_every=self.stream_state_every,
        )

        def make_spec(wid: int) -> WorkerSpec:
            return WorkerSpec(worker_id=wid, worker_seed=derive_seed(WORKER, base, wid), **common)

        return Supervisor(
            self.multiprocessing_context or multiprocessing.get_context(),
            make_spec,
            self.num_workers,
            self.task_timeout,
            self._fork_lock,
        )

    def _drop_pool(self) -> None:
        if self._pool_finalizer is not None:
            self._pool_finalizer()
        self._pool = None
        self._pool_finalizer = None

    def _warn_fast_forward(self, n: int) -> None:
        if self._warned_ff or S.has_state(self.dataset):
            # A dataset with state that had no snapshot yet (stream_state_every > 1): the
            # replay is bounded by the snapshot interval, as documented; nothing to warn of.
            return
        self._warned_ff = True
        warnings.warn(
            f"resuming an iterable dataset without state_dict()/load_state_dict(): the stream is "
            f"fast-forwarded by re-reading {n} batches inside the worker(s) (O(consumed)). "
            "Implement state_dict() and load_state_dict() on the dataset (or its iterator) to "
            "resume in O(1).",
            RuntimeWarning,
            stacklevel=4,
        )

    # ---- state ---------------------------------------------------------------------------
    @property
    def _config(self) -> dict[str, Any]:
        if self._config_cache is None:
            try:
                n = len(self.dataset)  # type: ignore[arg-type]
            except TypeError:
                n = None
            ws, rank = 1, 0
            dist = torch.distributed
            if self._plan.kind == DISTRIBUTED:
                # The sampler's own view: what its shard depends on.
                ws, rank = self._plan.sampler.num_replicas, self._plan.sampler.rank
            elif dist.is_available() and dist.is_initialized():
                ws, rank = dist.get_world_size(), dist.get_rank()
            self._config_cache = {
                "dataset_kind": "iterable" if self._plan.kind == ITERABLE else "map",
                "dataset_len": n,
                "batch_size": self.batch_size,
                "drop_last": self.drop_last,
                "sampler": self._plan.description,
                "num_workers": self.num_workers,
                "world_size": ws,
                "rank": rank,
            }
        return self._config_cache

    def state_dict(self) -> dict[str, Any]:
        """The position of what the caller has consumed, as plain data.

        Valid at any moment between batches. Loading it into a loader built the same way makes
        that loader yield exactly the batches this one would have yielded next. Save it with
        ``torch.save`` (``weights_only=True`` loads it), json, or ``dump_state``.

        It is this rank's own state (no collective: rank 0 alone may call it), except when
        ``torch.distributed.checkpoint`` calls it (``dcp.save``/``dcp.load`` call it on every
        rank): there it is the job's global state, gathered from every rank and the same on
        all of them, which any number of ranks can load (see ``merge_rank_states``).
        """
        if D.called_by_dcp():
            return D.merge_rank_states(D.gather(self._rank_state()))
        return self._rank_state()

    def _rank_state(self) -> dict[str, Any]:
        cursor = self._cursor
        if self._resume is not None:
            if self._resume.source is not None:
                return copy.deepcopy(self._resume.source)
            return self._resume.to_state(self._config)  # re-cut from a global state
        if cursor is not None and not cursor.finished:
            rp: S.ResumePoint = cursor.position()
            rp.seed = self._seed
            if self._delivered_to_its_end(rp):
                # Only StopIteration is left of this epoch: say so as the state after it does,
                # so a resume (and a trainer counting epochs, such as Lightning) starts the
                # next epoch -- torchdata's StatefulDataLoader does the same.
                rp = self._epoch_start(rp.epoch + 1)
        else:
            rp = self._epoch_start(self._next_epoch)
        if self._plan.kind == DISTRIBUTED:
            rp.distributed = True
            if rp.seed is not None:  # within an epoch: the sampler epoch and levels it uses
                rp.sampler_epoch, rp.history = self._plan.dist_position
            else:
                rp.sampler_epoch = self._plan.sampler.epoch
        rp.draws = self._draws
        rp.skipped = [list(x) for x in self._counters.skipped]
        return rp.to_state(self._config)

    def _epoch_start(self, epoch: int) -> S.ResumePoint:
        kind = self._plan.kind
        # seed None: the epoch has not begun, its seed is drawn at its iter().
        rp = S.ResumePoint(
            seed=None, epoch=epoch, stateful=kind == STATEFUL, iterable=kind == ITERABLE
        )
        if rp.stateful:
            rp.sampler_state = self._plan.sampler_state()
        if rp.iterable:
            rp.workers = [S.WorkerPosition() for _ in range(max(1, self.num_workers))]
        return rp

    def _delivered_to_its_end(self, rp: S.ResumePoint) -> bool:
        """Whether every batch of the position's epoch was delivered, as far as is known.

        Known for torch's own samplers (their length is exact), for a stateful sampler drawn
        to its end with nothing outstanding, and for a stream whose every shard ran dry. A
        custom sampler's ``len()`` is not trusted (too long or too short, it would end an epoch
        early): its epoch ends at StopIteration, as does a stream whose end was not yet seen.
        """
        kind = self._plan.kind
        if kind == ITERABLE:
            return all(w.exhausted for w in rp.workers)
        if kind == STATEFUL:
            return (
                rp.sampler_done and not rp.outstanding and not rp.ahead and rp.consumed == rp.drawn
            )
        if kind == BUILTIN:
            return rp.consumed >= len(self)
        if kind == DISTRIBUTED:
            return rp.consumed >= self._plan.distributed_tasks(*self._plan.dist_position)
        return False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` at the next ``iter(loader)``.

        Raises:
            CheckpointError: the state is malformed, from another version, or from another
                configuration (the message names the field, both values and the fix). The
                loader is then left exactly as it was.
        """
        if D.is_global(state_dict):
            states = D.split_global(state_dict)
            world, rank = self._config["world_size"], self._config["rank"]
            if len(states) != world or self._plan.kind != DISTRIBUTED:
                # Another world size (re-cut), or a sampler that cannot be re-cut: the
                # re-cut says which.
                self._load_point(self._recut(states), None)
                return
            state_dict = states[rank]
        rp = S.ResumePoint.from_state(state_dict, self._config, self._plan.kind == STATEFUL)
        self._load_point(rp, state_dict)

    def _recut(self, states: list[dict[str, Any]]) -> S.ResumePoint:
        """The position of this rank from every rank's state of a job on another world size."""
        config = self._config
        world = len(states)
        if self._plan.kind != DISTRIBUTED:
            if world == config["world_size"]:
                return S.ResumePoint.from_state(
                    states[config["rank"]], config, self._plan.kind == STATEFUL
                )
            raise CheckpointError(
                f"cannot load DataLoader state: world_size: the checkpoint is from {world} "
                f"ranks, this loader has {config['world_size']}. Only torch's "
                "DistributedSampler's position can be re-cut for another number of ranks; "
                "with any other sampler, resume on the same number of ranks."
            )
        points = [
            S.ResumePoint.from_state(sd, dict(config, world_size=world, rank=r), False)
            for r, sd in enumerate(states)
        ]
        return D.recut(points, self._plan, self._batching_size())

    def _batching_size(self) -> int | None:
        return self.batch_size if self._auto_collation else None

    def _load_point(self, rp: S.ResumePoint, state_dict: dict[str, Any] | None) -> None:
        for tid, idx in rp.outstanding:
            if isinstance(idx, list) != self._auto_collation:
                shape = "a list of sample indices" if self._auto_collation else "one index"
                raise CheckpointError(
                    f"cannot load DataLoader state: outstanding: task {tid} has {idx!r}, but a "
                    f"task of this loader is {shape}. The state is damaged, or from a loader "
                    "that batches differently."
                )
        if self._plan.kind == DISTRIBUTED:
            share = self._plan.distributed_tasks(rp.sampler_epoch, rp.history)
            if rp.consumed + len(rp.ahead) > share:
                raise CheckpointError(
                    f"cannot load DataLoader state: consumed: the state has {rp.consumed} "
                    f"batches consumed, but this rank's share of the epoch has only {share}. "
                    "Build the loader with the dataset, batch size and sampler of the checkpoint."
                )
        if self._plan.kind in (BUILTIN, FASTFORWARD):
            try:
                total = len(self)
            except TypeError:
                total = None
            if total is not None and rp.consumed + len(rp.ahead) > total:
                raise CheckpointError(
                    f"cannot load DataLoader state: consumed: the state has {rp.consumed} "
                    f"batches consumed, but an epoch of this loader has only {total}. Build the "
                    "loader with the dataset and batch size of the checkpoint."
                )
        rp.source = copy.deepcopy(state_dict) if state_dict is not None else None
        if rp.distributed:
            # Its epoch, as a script that calls set_epoch() before each epoch would set it.
            self._plan.sampler.set_epoch(rp.sampler_epoch)
        old = self._active()
        if old is not None:
            old._abandon("replaced by load_state_dict(): iterate the loader again to continue")
        self._cursor = None
        if self._pool is not None:
            # Its workers carry datasets advanced by prefetching and seeds of the old state:
            # resume as a freshly built loader would.
            self._drop_pool()
        gen = self._generator()
        if gen is not None:
            # Advance the generator as far as the saved loader had drawn from it, so that the
            # epochs after the resumed one draw the seeds the uninterrupted run drew.
            for _ in range(rp.draws - self._draws):
                draw_base_seed(gen)
            self._draws = max(self._draws, rp.draws)
        self._resume = rp
        self._next_epoch = rp.epoch
        self._counters.skipped = [[e, t, S.plain_indices(i)] for e, t, i in rp.skipped]

    def statistics(self) -> LoaderStatistics:
        """A frozen snapshot of respawns, retries, re-sent tasks, dropped duplicates, waits,
        and the workers' pids (see ``LoaderStatistics``)."""
        sup = self._pool
        if sup is None:
            it = self._active()
            sup = it._sup if isinstance(it, _MultiProcessIter) else None
        pids = tuple(s.pid if s.alive else -1 for s in sup.slots) if sup is not None else ()
        return self._counters.snapshot(pids)

    def check_invariants(self) -> None:
        """Assert the pipeline's invariants (for tests): reorder buffer and task table."""
        it = self._active()
        if isinstance(it, _MultiProcessIter) and it.is_open:
            it.check_invariants()

    # ---- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop all worker processes and threads now. The loader cannot be iterated again."""
        self._closed = True
        it = self._active()
        if it is not None:
            it.close()
        self._drop_pool()

    def __enter__(self) -> DataLoader[T_co]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DataLoader", "RetryPolicy"]
