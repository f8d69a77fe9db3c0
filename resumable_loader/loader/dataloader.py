"""The public ``DataLoader``: torch's arguments and behaviour, the state, and the wiring.

``iter(loader)`` builds the epoch's iterator (``loader.iterators``) from an ``EpochSetup``
(what it settles first is ``loader.epochs``'s); the pipeline it runs is drawn in the package
docstring (``resumable_loader/__init__.py``). ``state_dict()`` writes what the loader knows --
the latest iterator's ``Cursor`` (``loader.lifecycle``) -- through ``loader.state_out``;
under ``torch.distributed.checkpoint`` the state is the job's (``state.ranks``).

``load_state_dict()`` is parse → plan → apply: ``_shape()`` describes this loader
(``loader.shape``), ``plan_resume`` (``loader.resume``) validates the state against that
description and returns a frozen plan or refuses, and ``_apply`` -- the one place a load
changes the loader -- installs it; the position is continued at the next ``iter()``.

``state_dict()`` describes what the caller consumed -- never what was prefetched -- so a loader
built the same way and given that state yields exactly the batches the uninterrupted run would
have yielded next.

A framework that runs the loader's epochs itself (``integrations/``) asks three questions torch's
``DataLoader`` has no method for; the functions at the end of this module answer them (see
"frameworks" there): the integrations read no private name of the loader.
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data import Dataset, Sampler

from ..core.errors import CheckpointError, LoaderClosedError
from ..pipeline.fetch import RetryPolicy
from ..pipeline.stats import Counters, LoaderStatistics
from ..pipeline.supervisor.supervisor import Supervisor
from ..plans.index_plan import BUILTIN, DISTRIBUTED, ITERABLE, IndexPlan
from ..plans.mixture import Mixture, apply_plan_load, follow_epoch, hold_epoch
from ..plans.samplers import BatchSampler as OurBatchSampler
from ..plans.samplers import RandomSampler as OurRandomSampler
from ..plans.stream import Stream
from ..state import fingerprint as F
from ..state import ranks as D
from ..state import schema as S
from ..state.seeds import SeedChain, decode_generator, encode_generator
from .args import check_deferred_args, check_our_args
from .epochs import distributed_epoch, make_supervisor, pin_fn, sample_seed, warn_fast_forward
from .hf_streams import warn_shuffle_buffer
from .iterators import CURRENT_DEVICE, BaseIter, EpochSetup, MultiProcessIter, SingleProcessIter
from .lifecycle import Cursor
from .rebuilt import watched_multiprocessing_context
from .resume import ResumePlan, plan_resume
from .shape import LoaderShape, batch_sampler_description, loader_config, loader_length
from .state_out import StateView, dataset_record, delivered_to_its_end, rank_state
from .stream_ranks import carry_point, check_tail, on_cut, rank_agreement

T_co = TypeVar("T_co", covariant=True)

_TORCH_HAS_IN_ORDER = "in_order" in inspect.signature(_TorchDataLoader.__init__).parameters


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
        stream_tail: a ``Stream`` under ``torch.distributed``: the ranks agree on each
            epoch's number of batches, so that every rank gets the same number (a rank left
            without a batch would hang DDP); this says what becomes of the rows a rank could
            not deliver. ``"carry"`` (default): they come first in the next epoch;
            ``"drop"``: they are skipped (their partitions start the next pass). Counted in
            one ``RuntimeWarning`` and in the state (docs/streams.md, "Ranks and equal
            batches"). ``None``: no agreement, each rank runs its partitions to their end.

    Methods beyond torch's: ``state_dict()``, ``load_state_dict()``, ``statistics()``,
    ``close()`` and context-manager use.
    """

    # torch's property, plus a warning (once per loader) when accelerate reads it to rebuild
    # this loader as its own (integrations/_rebuilt.py).
    multiprocessing_context = watched_multiprocessing_context()

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
        stream_tail: str | None = "carry",
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
        check_deferred_args(generator, self.prefetch_factor)
        stream_state_every = check_our_args(
            task_timeout,
            max_task_attempts,
            on_poison,
            retry,
            stream_state_every,
            snapshot_every_n_steps,
            seed_per_sample,
        )
        self.task_timeout = task_timeout
        self.max_task_attempts = max_task_attempts
        self.on_poison = on_poison
        self.retry = retry
        self.stream_state_every = stream_state_every
        if stream_state_every is None and isinstance(dataset, Stream):
            # A Stream's state is a few ints per partition: it rides with every batch, so a
            # resume or a respawned worker never replays a fetch.
            self.stream_state_every = 1
        self.seed_per_sample = seed_per_sample
        self.stream_tail = check_tail(stream_tail)
        chain = self._own_samplers(sampler, batch_sampler)
        self._plan = IndexPlan(dataset, self.sampler, self.batch_sampler, self._auto_collation)
        if chain is None:
            chain = SeedChain(self._generator(), rooted=self._plan.kind != DISTRIBUTED)
        self._chain: SeedChain = chain
        self._counters = Counters()
        # The seed of the latest epoch begun; self._chain (above) is where the next epochs'
        # seeds come from (its state is in every state_dict(): later epochs are the saved job's).
        self._seed = 0
        self._epoch_rng: str | None = None  # a fast-forwarded sampler's generator at iter()
        self._next_epoch = 0
        self._resume: S.ResumePoint | None = None
        self._skipped_samples: list[list[int]] = []  # skip_samples() records, for the state
        self._active: Callable[[], BaseIter | None] = lambda: None
        # The position of the latest iterator; it outlives the iterator (loader.lifecycle).
        self._cursor: Cursor | None = None
        self._pool: Supervisor | None = None
        self._pool_finalizer: Any = None
        self._pool_gen = 0
        self._fork_lock = threading.Lock()
        self._config_cache: dict[str, Any] | None = None
        self._closed = False
        self._warned_ff = False
        self._force_pin_fn: Callable[[Any], Any] | None = None  # tests: pin without a GPU

    def _own_samplers(self, sampler: Any, batch_sampler: Any) -> SeedChain | None:
        """Hand out samplers that carry the loader's seed chain (``plans.samplers``), and return
        that chain; or the chain of one of ours the caller passed in; else None.

        Where torch made a ``RandomSampler`` itself (``shuffle=True``), ours replaces it and its
        ``BatchSampler``, so a loader another library rebuilds around them resumes through
        that library's own state.
        """
        passed = batch_sampler.sampler if isinstance(batch_sampler, OurBatchSampler) else sampler
        if isinstance(passed, OurRandomSampler):
            return passed.chain
        if (
            sampler is not None
            or batch_sampler is not None
            or type(self.sampler) is not torch.utils.data.RandomSampler
        ):
            return None
        chain = SeedChain(self.generator)
        ours = OurRandomSampler(self.dataset, chain=chain)  # type: ignore[arg-type]
        # torch's __setattr__ refuses these once __init__ is done: set them as it would have.
        object.__setattr__(self, "sampler", ours)
        if self.batch_sampler is not None:
            batches = OurBatchSampler(ours, self.batch_size, self.drop_last)  # type: ignore[arg-type]
            object.__setattr__(self, "batch_sampler", batches)
        return chain

    # ---- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Any:
        if self._closed:
            raise LoaderClosedError("this DataLoader was closed; build a new one to iterate again")
        agree = None
        if isinstance(self.dataset, Stream):
            self.dataset.check_readers(self.num_workers)  # here, not in a worker
            agree = rank_agreement(self.dataset, self.stream_tail)
        # torch's meaning of iter(): a new epoch, also after an abandoned one; a state given
        # to load_state_dict() is continued instead -- or the tail the ranks' agreement left
        # of the epoch before, where there is one.
        rp, self._resume = self._resume, None
        if rp is None:
            rp = self._carry_point()
        epoch = rp.epoch if rp is not None else self._next_epoch
        # Where the epoch is cut from: a resume with another batch size or a skip moved it.
        self._plan.cut = rp.cut if rp is not None and self._plan.kind == BUILTIN else None
        if self._plan.kind == DISTRIBUTED:
            try:
                self._seed = distributed_epoch(self._plan, rp)
            except CheckpointError:
                self._resume = rp  # nothing was delivered: the next iter() may try again
                raise
        else:
            if rp is not None and rp.seed is not None:
                self._seed = rp.seed
                self._chain.look()  # this iter() looked too: a reseed is one after it
            else:
                self._seed = self._chain.next_seed()
        old = self._active()
        if old is not None and self.persistent_workers and old.is_open:
            old.abandon(
                "replaced by a newer iter(loader): with persistent_workers one worker "
                "pool serves one iterator at a time"
            )
        it: BaseIter
        follow_epoch(self.dataset, epoch)
        if self.num_workers > 0:
            # The workers serve this epoch from the plan as it is now (it travels with the
            # epoch): a later change inside the epoch would reach the state but not them.
            hold_epoch(self.dataset, epoch)
        gen = self._plan.sampler_generator
        self._epoch_rng = encode_generator(gen) if gen is not None else None
        try:
            if not self._warned_ff and warn_fast_forward(self.dataset, rp):
                self._warned_ff = True  # once per loader
            setup = self._epoch_setup(epoch, agree)
            if self.num_workers == 0:
                it = SingleProcessIter(setup, rp)
            elif self.persistent_workers:
                if self._pool is None or self._pool.closed:
                    self._pool = self._make_supervisor(epoch)
                    self._pool.start_all()
                    self._pool_finalizer = weakref.finalize(self, self._pool.shutdown)
                it = MultiProcessIter(setup, rp, self._pool)
            else:
                it = MultiProcessIter(setup, rp, None)
        except BaseException:
            self._resume = rp  # nothing was delivered: the next iter() starts over from it
            raise
        self._next_epoch = epoch + 1
        self._active = weakref.ref(it)
        self._cursor = it.cursor
        return it

    def _epoch_setup(self, epoch: int, agree: Any = None) -> EpochSetup:
        """What the epoch's iterator takes from this loader (see ``loader.iterators``)."""
        self._pool_gen += 1
        pin = self._force_pin_fn
        if pin is None:
            pin = pin_fn(self.pin_memory, self.pin_memory_device)
        return EpochSetup(
            epoch=epoch,
            seed=self._seed,
            plan=self._plan,
            counters=self._counters,
            dataset=self.dataset,
            num_workers=self.num_workers,
            auto_collation=self._auto_collation,
            collate_fn=self.collate_fn,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            retry=self.retry,
            in_order=self.in_order,
            timeout=self.timeout,
            prefetch_factor=self.prefetch_factor or 0,
            max_task_attempts=self.max_task_attempts,
            on_poison=self.on_poison,
            sample_seed=sample_seed(self.seed_per_sample, self._plan, self._seed),
            data_plan=(
                self.dataset.state_dict()
                if isinstance(self.dataset, Mixture) and self.num_workers > 0
                else None
            ),
            len_reported=self._IterableDataset_len_called,
            pin_fn=pin,
            pin_device=None if self._force_pin_fn is not None else CURRENT_DEVICE,
            fork_lock=self._fork_lock,
            gen=self._pool_gen,
            length=self.__len__,
            make_supervisor=functools.partial(self._make_supervisor, epoch),
            drop_pool=self._drop_pool,
            agree=agree,
            on_cut=(
                functools.partial(on_cut, self.dataset, self.stream_tail, self.num_workers)
                if agree is not None
                else None
            ),
        )

    def _carry_point(self) -> S.ResumePoint | None:
        """The start of the next epoch when the ranks' agreement ended the last one with
        batches left on this rank (``loader.stream_ranks.carry_point``), else None."""
        cursor = self._cursor
        if cursor is None or not cursor.finished or cursor.tail is None:
            return None
        assert isinstance(self.dataset, Stream) and self.stream_tail is not None
        return carry_point(self.dataset, cursor.position(), cursor.tail, self.num_workers)

    def _generator(self) -> torch.Generator | None:
        """The generator an epoch's seed is drawn from: the loader's, else that of torch's own
        RandomSampler, else None (torch's global RNG)."""
        gen = self.generator
        if gen is None and type(self.sampler) is torch.utils.data.RandomSampler:
            gen = self.sampler.generator
        return gen

    def _make_supervisor(self, epoch: int) -> Supervisor:
        """The workers' supervisor (``loader.epochs.make_supervisor``) for this loader."""
        spec = dict(
            num_workers=self.num_workers,
            dataset=self.dataset,
            iterable=self._plan.kind == ITERABLE,
            auto_collation=self._auto_collation,
            collate_fn=self.collate_fn,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            # The seed of the epoch the workers start in (persistent ones keep it: each
            # epoch's own seed reaches them with its EPOCH message).
            base_seed=self._seed,
            init_fn=self.worker_init_fn,
            retry=self.retry,
            state_every=self.stream_state_every,
            prefetch_factor=self.prefetch_factor or 2,
        )
        context = self.multiprocessing_context
        return make_supervisor(context, self.task_timeout, self._fork_lock, spec)

    def _drop_pool(self) -> None:
        if self._pool_finalizer is not None:
            self._pool_finalizer()
        self._pool = None
        self._pool_finalizer = None

    # ---- state ---------------------------------------------------------------------------
    @property
    def _config(self) -> dict[str, Any]:
        if self._config_cache is None:
            self._config_cache = loader_config(
                self.dataset,
                self._plan,
                batch_size=self.batch_size,
                batch_sampler=batch_sampler_description(self.batch_sampler, self._user_batches),
                drop_last=self.drop_last,
                num_workers=self.num_workers,
            )
        return self._config_cache

    @property
    def _user_batches(self) -> bool:
        """Whether the batches come from a ``batch_sampler`` passed in (torch then sets
        ``batch_size`` to None): their size is the batch sampler's own."""
        return self._auto_collation and self.batch_size is None

    def state_dict(self) -> dict[str, Any]:
        """The position of what the caller has consumed, as plain data.

        Valid at any moment between batches. Loading it into a loader built the same way makes
        that loader yield exactly the batches this one would have yielded next. Save it with
        ``torch.save`` (``weights_only=True`` loads it), json, or ``dump_state``.

        It is this rank's own state (no collective: rank 0 alone may call it), except when
        ``torch.distributed.checkpoint`` calls it (``dcp.save``/``dcp.load`` call it on every
        rank): there it is the job's global state, gathered from every rank and the same on
        all of them, which any number of ranks can load (see ``merge_rank_states``).

        It records the data it was taken on (``dataset``): the dataset's class and, if it has a
        ``fingerprint()`` method, the string that returns (called at each ``state_dict()``:
        keep it cheap); its length is ``config.dataset_len``.

        Raises:
            TypeError: the dataset's ``fingerprint()`` returned something other than a str.
            ValueError: it returned more than 1024 characters (a state holds a digest).
            RuntimeError: it raised (chained as ``__cause__``).
        """
        warn_shuffle_buffer(self, "saving")
        if D.called_by_dcp():
            return D.merge_rank_states(D.gather(self._rank_state()))
        return self._rank_state()

    def _rank_state(self) -> dict[str, Any]:
        """This rank's own state (``state_out``); a broken ``fingerprint()`` fails it."""
        return rank_state(
            StateView(
                data=dataset_record(self.dataset),
                config=self._config,
                plan=self._plan,
                dataset=self.dataset,
                cursor=self._cursor,
                resume=self._resume,
                seed=self._seed,
                next_epoch=self._next_epoch,
                chain=self._chain,
                epoch_rng=self._epoch_rng,
                skipped=self._counters.skipped,
                skipped_samples=self._skipped_samples,
                num_workers=self.num_workers,
                carry=self._carry_point(),
            )
        )

    def load_state_dict(
        self, state_dict: dict[str, Any], *, on_dataset_change: str = "raise"
    ) -> None:
        """Continue from ``state_dict`` at the next ``iter(loader)``.

        The data must be the checkpoint's: the dataset's class, length and ``fingerprint()``
        (a ``Mixture``: each source's name, length and fingerprint). A state without that
        record (written before dataset checks) has only its length checked.

        Args:
            state_dict: a ``state_dict()`` (or a job's global state).
            on_dataset_change: ``"raise"`` (default): refuse a state taken on other data.
                ``"continue"``: keep its position on the new data -- what was consumed stays
                consumed, the rest of the epoch is read from the new data (under a shuffling
                sampler, the new data's order) -- with one ``RuntimeWarning`` naming what
                changed. A position past the end of the new data is still refused.

        Raises:
            CheckpointError: the state is malformed, from another version, from another
                configuration, or (``on_dataset_change="raise"``) taken on other data (the
                message names the field, both values and the fix). The loader is then left
                exactly as it was.
            ValueError: ``on_dataset_change`` is neither ``"raise"`` nor ``"continue"``.
            TypeError, ValueError, RuntimeError: the dataset's ``fingerprint()`` is broken
                (see ``state_dict``).
        """
        policy = F.check_policy(on_dataset_change)
        warn_shuffle_buffer(self, "resuming")
        plan = plan_resume(state_dict, self._shape(), policy)
        self._apply(plan)

    def _shape(self) -> LoaderShape:
        """This loader as a resume reads it (``shape``); its data record is taken first."""
        data = dataset_record(self.dataset)
        mix = self.dataset
        return LoaderShape(
            config=dict(self._config),
            plan=self._plan,
            data=data,
            dataset_name=type(mix).__name__,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            auto_collation=self._auto_collation,
            length=loader_length(self._plan, self.__len__),
            sampler_generator=self._plan.sampler_generator is not None,
            mixture=mix if isinstance(mix, Mixture) else None,
            stream=mix if isinstance(mix, Stream) else None,
        )

    def _apply(self, plan: ResumePlan) -> None:
        """The one place a load changes the loader. Nothing here refuses: every check ran in
        ``plan_resume``, so a refused state left the loader as it was."""
        if plan.mixture is not None:
            apply_plan_load(self.dataset, plan.mixture)  # type: ignore[arg-type]
        gen = self._plan.sampler_generator
        if gen is not None and plan.sampler_rng is not None:
            gen.set_state(decode_generator(plan.sampler_rng))
        if plan.sampler_epoch is not None:
            self._plan.sampler.set_epoch(plan.sampler_epoch)
        old = self._active()
        if old is not None:
            old.abandon("replaced by load_state_dict(): iterate the loader again to continue")
        self._cursor = None
        if self._pool is not None:
            # Its workers carry datasets advanced by prefetching and seeds of the old state:
            # resume as a freshly built loader would.
            self._drop_pool()
        if plan.chain is not None:
            # The saved job's seed chain wins over this loader's generator and the global RNG:
            # the epochs after the resumed one are the saved job's.
            self._chain.load(plan.chain)
        self._resume = plan.point
        self._next_epoch = plan.point.epoch
        self._counters.skipped = [list(x) for x in plan.skipped]
        self._skipped_samples = [list(x) for x in plan.skipped_samples]
        for note in plan.warnings:  # stacklevel 3: the caller of load_state_dict()
            warnings.warn(note, RuntimeWarning, stacklevel=3)
        if plan.changes:
            F.warn_changed(plan.changes, "DataLoader", stacklevel=3)

    def statistics(self) -> LoaderStatistics:
        """A frozen snapshot of respawns, retries, re-sent tasks, dropped duplicates, waits,
        and the workers' pids (see ``LoaderStatistics``)."""
        sup = self._pool
        if sup is None:
            it = self._active()
            sup = it.supervisor if it is not None else None
        if sup is None:
            return self._counters.snapshot((), ())
        workers = sup.statistics()
        return self._counters.snapshot(workers.pids, workers.states)

    def check_invariants(self) -> None:
        """Assert the pipeline's invariants (for tests): reorder buffer, task table, and the
        supervisor's slots."""
        it = self._active()
        if isinstance(it, MultiProcessIter) and it.is_open:
            it.check_invariants()
        if self._pool is not None:
            self._pool.check_invariants()

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


# ---- frameworks: what an integration may ask beyond torch's API ----
# accelerate announces an epoch's end before its last batch is handed out, and takes a batch
# ahead to find that end where the length is not exact; its integration then needs the state
# without the batch it holds. Functions of this module rather than methods: a method would be
# public API that torch's DataLoader lacks (a drop-in replacement adds none), and a user's
# subclass could shadow it. Here, beside the class, they read its private attributes; the
# integrations call them and read none (issue #32, tests/package/test_layers.py).

# Samplers whose epoch length is exact: whether a batch is the epoch's last is known when it
# is taken, with nothing fetched ahead.
_EXACT_LENGTH = (BUILTIN, DISTRIBUTED)


def has_exact_length(loader: DataLoader[Any]) -> bool:
    """Whether ``loader``'s epochs have an exact length (torch's own samplers, with or without
    a ``DistributedSampler``): a stream's or a sampler of the user's does not."""
    return loader._plan.kind in _EXACT_LENGTH


def took_last_batch(loader: DataLoader[Any]) -> bool | None:
    """Whether the batch just taken from ``loader`` was its epoch's last: True or False where
    the loader knows (an exact length, or a stream whose every shard already ran dry), None
    where only taking the next batch can tell."""
    cursor = loader._cursor
    if cursor is None or cursor.finished:
        return None
    if delivered_to_its_end(loader._plan, cursor.position()):
        return True
    return False if has_exact_length(loader) else None


def resumes_at_next_iter(loader: DataLoader[Any]) -> bool:
    """Whether ``loader``'s next ``iter()`` continues a position -- a state given to
    ``load_state_dict()``, or the tail its ranks' agreement carried -- rather than beginning a
    new epoch, as torch's ``iter()`` does after an epoch begun (a batch peeked, say)."""
    return loader._resume is not None or loader._carry_point() is not None


def own_rank_state(loader: DataLoader[Any]) -> dict[str, Any]:
    """This rank's own state of ``loader`` -- what ``state_dict()`` gives outside
    ``torch.distributed.checkpoint`` -- without its checks and warning (``state_out``)."""
    return loader._rank_state()


__all__ = ["DataLoader", "RetryPolicy"]
