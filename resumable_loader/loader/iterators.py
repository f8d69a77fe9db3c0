"""The iterators of one epoch: ``iter(loader)`` returns one of these.

``MultiProcessIter`` (``num_workers > 0``) wires the stages of the pipeline drawn in the
package docstring (``resumable_loader/__init__.py``) for one epoch: the supervisor's workers,
a task source and the dispatcher, recovery, the optional pin thread and the reorder buffer;
it hands the caller what the reorder buffer releases. ``SingleProcessIter``
(``num_workers=0``) fetches each task in the main process under the same per-task seeds.

An iterator reads nothing of its loader but the ``EpochSetup`` the loader gives it: the
loader's settings for the epoch and the few hooks it lends (its length, the fast-forward
warning, a supervisor, dropping a persistent pool that broke). Both iterators live by
``loader.lifecycle``: their position is a ``Cursor`` that outlives them.
"""

from __future__ import annotations

import copy
import functools
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.errors import LoaderClosedError
from ..pipeline.dispatch import Dispatcher, TaskSource
from ..pipeline.fetch import (
    END,
    ERROR,
    OK,
    MapFetcher,
    StreamEnd,
    StreamFetcher,
    make_retrier,
    seed_datapipe,
)
from ..pipeline.pin import PinStage, current_device_index
from ..pipeline.protocol import Delivery, Result, StreamResume
from ..pipeline.recovery import SKIPPED, Recovery
from ..pipeline.reorder import ReorderBuffer
from ..pipeline.stats import Counters
from ..pipeline.supervisor.events import Arrived, DeathReport, Lost
from ..pipeline.supervisor.slots import WorkerSlot
from ..pipeline.supervisor.supervisor import Supervisor
from ..pipeline.tasks import MapTasks, StreamTasks
from ..plans.index_plan import ITERABLE, STATEFUL, IndexPlan
from ..state import schema as S
from ..state.seeds import (
    STREAM,
    TASK,
    FetchRngs,
    GlobalRngGuard,
    derive_seed,
    seed_global_rngs,
    seeds_of,
)
from .lifecycle import Cursor, Life

if TYPE_CHECKING:
    from ..pipeline.fetch import RetryPolicy

_SKIP = object()
# EpochSetup.pin_device: the current accelerator, looked up when the pin thread starts.
CURRENT_DEVICE = object()


@dataclass(frozen=True)
class EpochSetup:
    """What an epoch's iterator takes from its loader (it reads nothing else of it)."""

    epoch: int
    seed: int  # the epoch's seed
    plan: IndexPlan
    counters: Counters
    dataset: Any
    num_workers: int
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    batch_size: int | None
    drop_last: bool
    retry: RetryPolicy | None
    in_order: bool
    timeout: float
    prefetch_factor: int
    max_task_attempts: int
    on_poison: str
    sample_seed: int | None  # seed_per_sample: what each sample's seed derives from
    data_plan: dict[str, Any] | None  # a Mixture's state_dict() at iter(), for the workers
    len_reported: int | None  # an iterable dataset's len(loader), if the caller asked for it
    pin_fn: Callable[[Any], Any] | None
    pin_device: Any  # for the pin thread: a device index, None, or CURRENT_DEVICE
    fork_lock: threading.Lock  # held by the pin thread while pinning; taken around forks
    gen: int  # the epoch's generation, stamped on its messages to and from workers
    length: Callable[[], int]  # len(loader)
    make_supervisor: Callable[[], Supervisor]
    drop_pool: Callable[[], None]  # a broken epoch's persistent workers are not reused
    # A Stream on several ranks (``loader.stream_ranks``): ``agree(ready) -> batches`` the
    # ranks all deliver next (0: the epoch ends on every rank), and ``on_cut(position,
    # batches, ready)``, the tail record of an epoch it ended with batches left here (it warns).
    agree: Callable[[int], int] | None = None
    on_cut: Callable[[Any, int, int, int], Any] | None = None


# KeyboardInterrupt and SystemExit (a SIGTERM handler calling sys.exit) are not errors of the
# data: raised inside next(), they end the iterator (see loader.lifecycle), and the batch being
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


class BaseIter:
    """What both iterators share: the lifecycle (see ``loader.lifecycle``) and the cursor."""

    _cursor: Cursor
    _finalizer: Any

    def __init__(self, setup: EpochSetup) -> None:
        self._setup_of = setup
        self.epoch = setup.epoch
        self._life = Life.OPEN
        self._why = ""  # why it was abandoned, for the error a later next() raises
        self._broken: BaseException | None = None
        self._plan: IndexPlan = setup.plan
        self._iterable = self._plan.kind == ITERABLE
        self._stateful_sampler = self._plan.kind == STATEFUL
        self._base: int = setup.seed
        self._counters: Counters = setup.counters
        # An iterable dataset's len(loader), if the caller asked for it: more batches than that
        # is warned about, as torch does (scripts watch for it).
        self._len_reported: int | None = setup.len_reported if self._iterable else None
        self._num_yielded = 0  # batches of this epoch delivered (from the resumed position)
        # Equal batches on every rank (``loader.stream_ranks``): the batches every rank may
        # still deliver before the ranks agree again; the same on every rank.
        self._agree = setup.agree
        self._credit = 0

    def __iter__(self) -> BaseIter:
        return self

    @property
    def cursor(self) -> Cursor:
        """Its position, which outlives it (the loader keeps the latest one)."""
        return self._cursor

    @property
    def supervisor(self) -> Supervisor | None:
        """The supervisor of its workers (None without workers)."""
        return None

    def __len__(self) -> int:
        return self._setup_of.length()

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
                f"Length of IterableDataset {self._setup_of.dataset} was reported to be "
                f"{reported} (when accessing len(dataloader)), but {self._num_yielded} "
                "samples have been fetched."
            )
            if self._setup_of.num_workers > 0:
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

    def _cut(self, ready: int, depth: int) -> None:
        """The ranks agreed to end the epoch here. With batches left on this rank, record the
        tail on the cursor (the loader starts the next epoch from it) and warn, at the caller
        of ``next()`` (``depth`` frames above this one)."""
        setup = self._setup_of
        if ready and setup.on_cut is not None:
            self._cursor.tail = setup.on_cut(
                self._cursor.position(), self._num_yielded, ready, depth + 1
            )
        self._finish()

    # ---- transitions out of OPEN (each final) ---------------------------------------------
    def _finish(self) -> None:
        self._cursor.finished = True
        self._end(Life.FINISHED)

    def abandon(self, why: str) -> None:
        """Left before its end: keep the position, release the workers. ``why`` is said by
        the error a later ``next()`` raises."""
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

    __slots__ = (
        "ahead",
        "consumed",
        "cut_state",
        "drawn",
        "exhausted",
        "fetcher",
        "k",
        "seed",
        "source",
        "tid",
    )

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
        # A Stream on several ranks: the stream's state before the batch fetched ahead and not
        # yet delivered (the ranks' agreement decides): the position until it is delivered, and
        # for good when the agreement ends the epoch before it.
        self.cut_state: Any = None


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
        if p.cut_state is not None:
            state = copy.deepcopy(p.cut_state)
        else:
            state = copy.deepcopy(holder.state_dict()) if holder is not None else None
        # A batch fetched ahead and left undelivered may have run the stream dry: the
        # position is before it.
        exhausted = p.exhausted or (p.fetcher.ended and p.cut_state is None)
        rp.workers = [S.WorkerPosition(p.k, exhausted, state, p.k if state is not None else 0)]
    return rp


class SingleProcessIter(BaseIter):
    """num_workers=0: the main process fetches each task under its task seed."""

    def __init__(self, setup: EpochSetup, rp: S.ResumePoint | None) -> None:
        super().__init__(setup)
        plan, epoch = self._plan, self.epoch
        self._pin = setup.pin_fn
        p = self._p = _SingleProgress(rp)
        self._num_yielded = p.consumed
        # The ids to skip when drawn (delivered before the checkpoint, in_order=False): a set
        # apart from ``ahead``, because advancing ``consumed`` must not forget what to skip.
        self._skip = set(p.ahead)
        self._owed: list[tuple[int, Any]] = []
        # A Stream on several ranks: the batch fetched ahead, not yet granted by the ranks'
        # agreement (its data and retries).
        self._held: tuple[Any, int] | None = None
        self._rngs = FetchRngs()  # each fetch under its seed, the caller's RNGs kept apart
        # derive_seed(TASK, base, tid) and derive_seed(STREAM, base, 0, k), the fixed part
        # hashed once for the epoch.
        self._task_seed = seeds_of(TASK, self._base)
        self._fetch_seed = seeds_of(STREAM, self._base, 0)
        # Set when an interrupt cut a stream fetch short: the stream then stands past items
        # never delivered, so its own state no longer matches the position, and a resume
        # replays the delivered fetches instead (seeded, hence exact).
        self._stateless = [False]
        if self._iterable:
            self._start_stream(setup, rp)
        else:
            self._start_map(setup, rp)
        self._cursor = Cursor(
            epoch, functools.partial(_single_position, epoch, plan, p, self._stateless)
        )
        self._finalizer = weakref.finalize(self, self._cursor.freeze)

    def _start_stream(self, setup: EpochSetup, rp: S.ResumePoint | None) -> None:
        p = self._p
        fetcher = StreamFetcher(
            setup.dataset,
            setup.auto_collation,
            setup.collate_fn,
            setup.batch_size,
            setup.drop_last,
            exact_retry=setup.retry is not None,
        )
        self._fetcher: Any = fetcher
        p.fetcher = fetcher
        # As in workers: a retry resumes the step that raised, with the RNGs of then.
        run = make_retrier(setup.retry, fetcher.before_retry, fetcher.can_retry)
        self._run = run
        wp = rp.workers[0] if rp else S.WorkerPosition()
        resume: StreamResume | None = None
        if wp.exhausted:
            pass  # nothing more this epoch; start the next one from a fresh iterator
        elif wp.dataset_state is not None or wp.delivered:
            at = wp.state_at if wp.dataset_state is not None else 0
            resume = StreamResume(wp.dataset_state, False, at, wp.delivered)
        base = self._base

        def replay(fn: Any, fetch_seed: int) -> Any:
            seed_global_rngs(fetch_seed)
            return run(fn)[0]

        with GlobalRngGuard():
            seed_datapipe(setup.dataset, base)
            fetcher.start(resume, lambda k: derive_seed(STREAM, base, 0, k), replay)
        p.k = wp.delivered
        p.exhausted = wp.exhausted
        p.tid = p.consumed

    def _start_map(self, setup: EpochSetup, rp: S.ResumePoint | None) -> None:
        p = self._p
        # The retry re-seeds with the task being fetched: read from ``p``, not ``self``,
        # so that the iterator forms no reference cycle with its own retrier.
        self._run = make_retrier(setup.retry, lambda: seed_global_rngs(p.seed))
        self._once = setup.retry is None  # no RetryPolicy: fetch directly, not through _run
        self._fetcher = MapFetcher(setup.dataset, setup.auto_collation, setup.collate_fn)
        self._fetcher.sample_seed = setup.sample_seed
        if self._stateful_sampler and rp is not None:
            p.source = self._plan.batches(self._base, rp.drawn, rp.sampler_state, rp.sampler_done)
            self._owed = sorted(rp.outstanding)
            p.tid = rp.drawn
        else:
            p.source = self._plan.batches(self._base, p.consumed)
            p.tid = p.consumed
        p.drawn = dict(self._owed)

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
            self.abandon(_INTERRUPTED)
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
        p.seed = self._task_seed(tid)
        try:
            with self._rngs.seeded(p.seed):
                if self._once:
                    data, retries = self._fetcher.fetch(indices), 0
                else:
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
        if self._agree is not None:
            return self._next_agreed()
        if p.exhausted:
            self._finish()
            raise StopIteration
        seed = self._fetch_seed(p.k)
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

    def _next_agreed(self) -> Any:
        """A Stream on several ranks: fetch the next batch ahead, then agree with the other
        ranks (holding one batch at most, this rank offers 1 or 0) before delivering it."""
        p = self._p
        if self._held is None and not p.exhausted:
            holder = p.fetcher.holder
            before = holder.state_dict() if holder is not None else None
            seed = self._fetch_seed(p.k)
            try:
                with self._rngs.seeded(seed):
                    data, retries = self._run(self._fetcher.fetch)
            except StreamEnd:
                p.exhausted = True
            except _INTERRUPTS:
                self._stateless[0] = True
                raise
            except Exception:
                # Raised to the caller, as without ranks: an error consumes no credit.
                self._fetcher.fetch_failed()
                p.k += 1
                p.consumed += 1
                raise
            else:
                # Until it is delivered the position is before it: a cut, an interrupt or an
                # error in the collective leaves its rows in the stream's state.
                self._held = (data, retries)
                p.cut_state = before
        ready = 0 if self._held is None else 1
        agreed = self._agree(ready)  # type: ignore[misc]
        if agreed == 0:
            self._cut(ready, 4)
            raise StopIteration
        assert self._held is not None  # the minimum of the ranks' offers is at most ours
        (data, retries), self._held = self._held, None
        p.cut_state = None
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
        if pin is not None and sup.here():  # a forked copy owns no pin thread and no fd
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


class MultiProcessIter(BaseIter):
    """num_workers>0: the pipeline drawn in the package docstring."""

    def __init__(
        self,
        setup: EpochSetup,
        rp: S.ResumePoint | None,
        pool: Supervisor | None,
    ) -> None:
        super().__init__(setup)
        self._owns_sup = pool is None
        self._in_order = setup.in_order
        self._timeout = setup.timeout
        self._pin: PinStage | None = None
        # An exception that arrived while a batch was being handed over (a Ctrl-C during the
        # dispatch that refills the prefetch window): that batch is delivered, this is raised
        # at the next call.
        self._pending: BaseException | None = None
        sup = pool if pool is not None else setup.make_supervisor()
        self._sup = sup
        self._cursor = Cursor(self.epoch, dict)  # bound to the stages once they exist
        self._finalizer = weakref.finalize(self, _retire, self._cursor, sup, self._owns_sup, None)
        try:
            self._setup(setup, rp)
        except BaseException:
            self._end(Life.ABANDONED)
            raise

    @property
    def supervisor(self) -> Supervisor | None:
        return self._sup

    def _start_processes(self, setup: EpochSetup) -> None:
        """The workers (a persistent pool's dead ones replaced), then the pin thread."""
        sup = self._sup
        if self._owns_sup:
            sup.start_all()
        else:
            for slot in sup.slots:
                if not slot.alive:
                    sup.respawn(slot)
        pin_fn = setup.pin_fn
        if pin_fn is not None:
            device = (
                current_device_index() if setup.pin_device is CURRENT_DEVICE else setup.pin_device
            )
            self._pin = PinStage(setup.fork_lock, pin_fn, device)
            sup.watch_extra(self._pin.wake_fd, "pin")
            self._finalizer.detach()
            self._finalizer = weakref.finalize(
                self, _retire, self._cursor, sup, self._owns_sup, self._pin
            )

    def _setup(self, setup: EpochSetup, rp: S.ResumePoint | None) -> None:
        self._start_processes(setup)
        sup = self._sup
        start = rp.consumed if rp else 0
        ahead = rp.ahead if rp else frozenset()
        if self._iterable:
            # A stream resumes per worker; task ids restart after what was consumed.
            start, ahead = start + len(ahead), frozenset()
        self._reorder = reorder = ReorderBuffer(self._in_order, start, ahead)
        self._num_yielded = start + len(ahead)
        tasks = self._task_source(setup, rp, start, len(sup.slots))
        pin = self._pin

        def backlog() -> int:
            return len(reorder) + (pin.in_flight if pin is not None else 0)

        # New task ids continue after what was drawn (a stateful sampler's drawn tasks may
        # outrun what was consumed), else after what was consumed.
        first = rp.drawn if self._stateful_sampler and rp is not None else start
        disp = Dispatcher(sup, tasks, setup.prefetch_factor, first, backlog, self._in_order)
        disp.gen = setup.gen
        disp.epoch = self.epoch
        disp.base_seed = self._base
        disp.sample_seed = setup.sample_seed
        disp.data_plan = setup.data_plan
        self._disp = disp
        self._tasks = tasks
        self._recovery = Recovery(
            sup,
            disp,
            epoch=self.epoch,
            max_attempts=setup.max_task_attempts,
            on_poison=setup.on_poison,
            counters=self._counters,
            start_method=sup.ctx.get_start_method(),
            transient=tuple(setup.retry.exceptions) if setup.retry is not None else (),
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
        self, setup: EpochSetup, rp: S.ResumePoint | None, start: int, n: int
    ) -> TaskSource:
        """The epoch's tasks: a stream's shards, or the sampler's batches from ``start``."""
        if self._iterable:
            return StreamTasks(n, rp)
        owed: list[tuple[int, Any]] = []
        if self._stateful_sampler and rp is not None:
            indices = self._plan.batches(self._base, rp.drawn, rp.sampler_state, rp.sampler_done)
            owed = rp.outstanding
        else:
            indices = self._plan.batches(self._base, start)
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
            if self._agree is None:
                return self._next_batch()
            return self._next_agreed()
        except _INTERRUPTS:
            # Interrupted while results were being taken in: some may be half-handled, so
            # this iterator cannot go on safely. What it delivered is exactly known.
            self.abandon(_INTERRUPTED)
            raise

    def _next_batch(self) -> Any:
        reorder = self._reorder
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            if reorder.ready():
                out = self._release()
                if out is not _SKIP:
                    return self._delivered(out)
                continue
            if self._epoch_done():
                self._finish()
                raise StopIteration
            self._wait(deadline)

    def _release(self) -> Any:
        """Release the reorder buffer's next item: its batch, or _SKIP (a stream's end, a
        skipped batch); an error is raised."""
        tid, item = self._reorder.pop()
        # The released slot in the prefetch window goes back to work before the caller gets
        # the batch, so workers never idle while the caller computes.
        try:
            self._disp.fill()
        except BaseException as exc:
            self._pending = exc  # the batch is released: deliver it first
        try:
            return self._deliver(tid, item)
        finally:
            # Not kept in this frame: an error raised from the item must not be reachable
            # from its own traceback (a cycle holding the iterator).
            del item

    def _wait(self, deadline: float | None) -> None:
        """Take in what the workers send, for as long as the supervisor's next deadline (and
        torch's ``timeout``) allow."""
        now = time.monotonic()
        wait = self._sup.next_deadline(now) - now
        if deadline is not None:
            if now >= deadline:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
            wait = min(wait, deadline - now)
        self._pump(wait)
        self._counters.wait_time_s += time.monotonic() - now

    # ---- equal batches on every rank (a Stream under torch.distributed) ---------------------
    def _next_agreed(self) -> Any:
        """The next batch, if the ranks' credit allows it (see ``loader.stream_ranks``)."""
        if self._credit == 0:
            ready = self._ready_batches()
            self._credit = self._agree(ready)  # type: ignore[misc]
            if self._credit == 0:
                self._cut(ready, 3)
                raise StopIteration
        out = self._next_batch()  # one of the batches ready: it cannot end the epoch
        self._credit -= 1
        return out

    def _ready_batches(self) -> int:
        """The batches this rank can deliver without waiting (in the reorder buffer, in
        delivery order); waits for at least one, or returns 0 at its epoch's end. Ends of
        streams and skipped batches ahead of the first batch are released here; an error
        among them is raised (it consumes no credit)."""
        reorder = self._reorder
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            n = self._count_ready()
            if n:
                return n
            if reorder.ready():
                self._release()  # no batch is ready: an end, a skip, or an error to raise
                continue
            if self._epoch_done():
                return 0
            self._wait(deadline)

    def _count_ready(self) -> int:
        reorder = self._reorder
        n = 0
        if not self._in_order:
            return sum(1 for _, item in reorder.items() if item.status == OK)
        tid = reorder.rcvd
        for t, item in reorder.items():
            if t < tid:
                continue
            if t != tid:
                break  # a gap: the batches after it are not ready in order
            n += item.status == OK
            tid += 1
        return n

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
        for event in self._sup.poll(timeout):
            if isinstance(event, Arrived):
                self._on_result(event.slot, event.msg)
            elif isinstance(event, Lost):
                self._on_lost(event)
            else:
                self._on_dead(event.slot, event.report)
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

    def _on_lost(self, event: Lost) -> None:
        if event.msg.gen != self._disp.gen:
            return  # from an epoch abandoned with persistent workers
        msg = event.msg
        for tid, item in self._recovery.on_lost(event.slot, msg.tid, msg.error, msg.blame):
            if not self._reorder.put(tid, item):
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
            self._setup_of.drop_pool()
        self._raise_broken()

    # ---- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        r = self._reorder
        r.check_invariants()
        self._sup.check_invariants()
        self._disp.check_invariants(lambda t: t < r.rcvd or t in r.ahead)
