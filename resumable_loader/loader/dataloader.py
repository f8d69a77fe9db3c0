"""The public ``DataLoader``: torch's arguments and checks, the state, and the wiring.

``iter(loader)`` builds the epoch's iterator (``_iterators``) from an ``EpochSetup``; the
pipeline it runs is drawn in the package docstring (``resumable_loader/__init__.py``).
``state_dict()`` reads the latest iterator's ``Cursor`` (``_lifecycle``) and writes it with
``_schema``; ``load_state_dict()`` validates a state and keeps the position for the next
``iter()``. Under ``torch.distributed.checkpoint`` the state is the job's (``_distributed``).

``state_dict()`` describes what the caller consumed -- never what was prefetched -- so a loader
built the same way and given that state yields exactly the batches the uninterrupted run would
have yielded next.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import multiprocessing
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data import Dataset, Sampler, SequentialSampler

from ..core.errors import CheckpointError, LoaderClosedError
from ..pipeline.fetch import RetryPolicy
from ..pipeline.pin import pin_memory
from ..pipeline.stats import Counters, LoaderStatistics
from ..pipeline.supervisor.supervisor import Supervisor
from ..pipeline.worker import WorkerSpec
from ..plans.index_plan import BUILTIN, DISTRIBUTED, FASTFORWARD, ITERABLE, STATEFUL, IndexPlan
from ..plans.mixture import Mixture, RestAt, follow_epoch, hold_epoch, load_plan, plan_changes
from ..plans.samplers import BatchSampler as OurBatchSampler
from ..plans.samplers import RandomSampler as OurRandomSampler
from ..plans.samplers import recorded_name
from ..state import fingerprint as F
from ..state import ranks as D
from ..state import schema as S
from ..state.codec import clip_text
from ..state.cursor import Cut, check_cut
from ..state.seeds import (
    DIST_SEED,
    SAMPLE,
    WORKER,
    SeedChain,
    decode_generator,
    derive_seed,
    encode_generator,
)
from .hf_streams import warn_shuffle_buffer
from .iterators import CURRENT_DEVICE, BaseIter, EpochSetup, MultiProcessIter, SingleProcessIter
from .lifecycle import Cursor
from .rebuilt import watched_multiprocessing_context

T_co = TypeVar("T_co", covariant=True)

_TORCH_HAS_IN_ORDER = "in_order" in inspect.signature(_TorchDataLoader.__init__).parameters


def _check_deferred_args(generator: Any, prefetch_factor: Any) -> None:
    """Check the arguments torch's constructor stores unchecked: a wrong one would fail at the
    first batch, far from the call that passed it (torch: TypeError or AssertionError from its
    iterator) -- or, for prefetch_factor 0, not at all."""
    if generator is not None and not isinstance(generator, torch.Generator):
        seed = generator if type(generator) is int else "seed"
        raise TypeError(
            f"generator must be a torch.Generator or None, got {_kind(generator)} "
            f"{clip_text(repr(generator), 60)}; to seed the loader, pass "
            f"generator=torch.Generator().manual_seed({seed})"
        )
    # torch's constructor has refused it without workers, and made None 2 with them.
    if prefetch_factor is not None and (
        isinstance(prefetch_factor, bool) or not isinstance(prefetch_factor, int)
    ):
        raise TypeError(
            f"prefetch_factor must be an int >= 1 (batches loaded ahead per worker) or None, "
            f"got {_kind(prefetch_factor)} {clip_text(repr(prefetch_factor), 60)}"
        )
    if prefetch_factor is not None and prefetch_factor < 1:
        raise ValueError(
            f"prefetch_factor must be an int >= 1 (batches loaded ahead per worker) or None, "
            f"got {prefetch_factor}"
        )


def _kind(value: Any) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def _check_our_args(
    task_timeout: float | None,
    max_task_attempts: int,
    on_poison: str,
    retry: RetryPolicy | None,
    stream_state_every: int | None,
    snapshot_every_n_steps: int | None,
    seed_per_sample: bool,
) -> int | None:
    """Validate the arguments beyond torch's; return ``stream_state_every`` with torchdata's
    ``snapshot_every_n_steps`` folded in."""
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
    if type(seed_per_sample) is not bool:
        raise TypeError(f"seed_per_sample must be a bool, got {seed_per_sample!r}")
    return stream_state_every


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
        _check_deferred_args(generator, self.prefetch_factor)
        stream_state_every = _check_our_args(
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
        self.seed_per_sample = seed_per_sample
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

    def _own_samplers(self, sampler: Any, batch_sampler: Any) -> SeedChain | None:
        """Hand out samplers that carry the loader's seed chain (``_samplers``), and return
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
        # torch's meaning of iter(): a new epoch, also after an abandoned one; a state given
        # to load_state_dict() is continued instead.
        rp, self._resume = self._resume, None
        epoch = rp.epoch if rp is not None else self._next_epoch
        # Where the epoch is cut from: a resume with another batch size or a skip moved it.
        self._plan.cut = rp.cut if rp is not None and self._plan.kind == BUILTIN else None
        if self._plan.kind == DISTRIBUTED:
            self._seed = self._distributed_epoch(rp)
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
            self._warn_fast_forward(rp)
            setup = self._epoch_setup(epoch)
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

    def _epoch_setup(self, epoch: int) -> EpochSetup:
        """What the epoch's iterator takes from this loader (see ``_iterators``)."""
        self._pool_gen += 1
        pin_fn = self._pin_fn()
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
            sample_seed=self._sample_seed(),
            data_plan=(
                self.dataset.state_dict()
                if isinstance(self.dataset, Mixture) and self.num_workers > 0
                else None
            ),
            len_reported=self._IterableDataset_len_called,
            pin_fn=pin_fn,
            pin_device=None if self._force_pin_fn is not None else CURRENT_DEVICE,
            fork_lock=self._fork_lock,
            gen=self._pool_gen,
            length=self.__len__,
            make_supervisor=functools.partial(self._make_supervisor, epoch),
            drop_pool=self._drop_pool,
        )

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

    def _pin_fn(self) -> Callable[[Any], Any] | None:
        if self._force_pin_fn is not None:
            return self._force_pin_fn
        if not self.pin_memory:
            return None
        if self.pin_memory_device:
            warnings.warn(
                "pin_memory_device is deprecated, the current accelerator will be used as the "
                f"device,ignore pin_memory_device='{self.pin_memory_device}'.",
                stacklevel=4,
            )
        acc = getattr(torch, "accelerator", None)
        available = acc.is_available() if acc is not None else torch.cuda.is_available()
        if not available:
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, then device "
                "pinned memory won't be used.",
                stacklevel=4,
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
            prefetch_factor=self.prefetch_factor or 2,
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

    def _warn_fast_forward(self, rp: S.ResumePoint | None) -> None:
        """Called by ``__iter__``: say once that resuming a stream without state replays it."""
        if self._warned_ff or rp is None or S.has_state(self.dataset):
            # A dataset with state that had no snapshot yet (stream_state_every > 1): the
            # replay is bounded by the snapshot interval, as documented; nothing to warn of.
            return
        replayed = [
            w.delivered
            for w in rp.workers
            if w.dataset_state is None and w.delivered and not w.exhausted
        ]
        if not replayed:
            return
        n = replayed[0]
        self._warned_ff = True
        warnings.warn(
            f"resuming an iterable dataset without state_dict()/load_state_dict(): the stream is "
            f"fast-forwarded by re-reading {n} batches inside the worker(s) (O(consumed)). "
            "Implement state_dict() and load_state_dict() on the dataset (or its iterator) to "
            "resume in O(1).",
            RuntimeWarning,
            stacklevel=3,
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
                # A batch_sampler passed in: its batches' size is its own (batch_size is None).
                "batch_sampler": self._batch_sampler_description(),
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
        data = self._dataset_record()  # a broken fingerprint() fails every state_dict()
        cursor = self._cursor
        ended: int | None = None  # DISTRIBUTED: the sampler epoch just delivered to its end
        if self._resume is not None:
            if self._resume.source is not None and not self._resume.dataset_changes:
                sd = copy.deepcopy(self._resume.source)
                if isinstance(self.dataset, Mixture):
                    # The plan as loaded: with new weights from the resume point on, which the
                    # state read does not hold.
                    sd[S.K_PLAN] = self.dataset.state_dict()
                return sd
            # Re-cut from a global state, or resumed onto changed data: the position read, on
            # this loader's data (so a resume from it on the same data checks clean).
            pending = copy.copy(self._resume)
            pending.dataset = data
            if pending.dataset_changes:
                mix = self.dataset
                pending.plan = mix.state_dict() if isinstance(mix, Mixture) else None
            return pending.to_state(self._config)
        if cursor is not None and not cursor.finished:
            rp: S.ResumePoint = cursor.position()
            rp.seed = self._seed
            rp.cut = self._plan.cut
            if self._delivered_to_its_end(rp):
                # Only StopIteration is left of this epoch: say so as the state after it does,
                # so a resume (and a trainer counting epochs, such as Lightning) starts the
                # next epoch. torchdata's StatefulDataLoader resumes into the epoch's empty
                # rest instead (docs/guarantees.md, "An epoch's end, here and in torchdata").
                rp = self._epoch_start(rp.epoch + 1)
                ended = self._plan.dist_position[0]
        else:
            rp = self._epoch_start(self._next_epoch)
            if cursor is not None:  # after StopIteration
                ended = self._plan.dist_position[0]
        if self._plan.kind == DISTRIBUTED:
            rp.distributed = True
            if rp.seed is not None:  # within an epoch: the sampler epoch and levels it uses
                rp.sampler_epoch, rp.history = self._plan.dist_position
                rp.ended = False
            else:
                # Between epochs: the sampler epoch to set next -- after an epoch's end, the
                # one after it, as `epoch` is the loader's next (see _distributed).
                rp.sampler_epoch, rp.ended = D.next_sampler_epoch(self._plan.sampler.epoch, ended)
        rp.chain = None if self._plan.kind == DISTRIBUTED else self._chain.state()
        if isinstance(self.dataset, Mixture):
            rp.plan = self.dataset.state_dict()
        gen = self._plan.sampler_generator
        if gen is not None:
            # Inside an epoch: as it began (the resume fast-forwards through the same draws);
            # between epochs: as the next epoch begins.
            rp.sampler_rng = self._epoch_rng if rp.seed is not None else encode_generator(gen)
        rp.skipped = [list(x) for x in self._counters.skipped]
        rp.skipped_samples = [list(x) for x in self._skipped_samples]
        rp.dataset = data
        return rp.to_state(self._config)

    def _dataset_record(self) -> dict[str, Any]:
        """The data as a state records it (``_fingerprint``): a ``Mixture``'s fingerprints are
        its sources', in its plan."""
        return F.record(self.dataset, per_source=isinstance(self.dataset, Mixture))

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
            return rp.consumed >= self._plan.cut_tasks(self._plan.cut)
        if kind == DISTRIBUTED:
            return rp.consumed >= self._plan.distributed_tasks(*self._plan.dist_position)
        return False

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
        data = self._dataset_record()
        stateful = self._plan.kind == STATEFUL
        if D.is_global(state_dict):
            states = D.split_global(state_dict)
            world, rank = self._config["world_size"], self._config["rank"]
            if (
                len(states) != world
                or self._plan.kind != DISTRIBUTED
                or any(not self._same_batch(sd) for sd in states)
                or D.fresh_level(states)
            ):
                # Another world size or batch size (re-cut), or a sampler that cannot be
                # re-cut: the re-cut says which. A level nothing was taken of (after
                # skip_samples) is cut here even on the same shape, and the re-cut warns
                # where that cut pads or drops samples.
                self._load_checked(self._recut(states, data), None, policy, rebatch=True)
                return
            state_dict = states[rank]
        rp = S.ResumePoint.from_state(
            state_dict, self._config, stateful, dataset=data, dataset_change_ok=True
        )
        D.settle(rp)
        same = self._same_batch(state_dict) and (rp.cut is None or self._plan.kind == BUILTIN)
        self._load_checked(rp, state_dict, policy, rebatch=not same)

    @property
    def _user_batches(self) -> bool:
        """Whether the batches come from a ``batch_sampler`` passed in (torch then sets
        ``batch_size`` to None): their size is the batch sampler's own."""
        return self._auto_collation and self.batch_size is None

    def _batch_sampler_description(self) -> str | None:
        """A ``batch_sampler`` passed in, as the state's config records it: its class, and
        for torch's (or our) ``BatchSampler`` its batch size and drop_last -- so that a resume
        with another batch size is refused, not read as batches of the new size. None where
        the loader makes its own batches (or none)."""
        if not self._user_batches:
            return None
        bs = self.batch_sampler
        name = recorded_name(bs)
        if isinstance(bs, torch.utils.data.BatchSampler):
            return f"{name}(batch_size={bs.batch_size}, drop_last={bs.drop_last})"
        return name

    def _same_batch(self, sd: Any) -> bool:
        cfg = sd.get(S.K_CONFIG) if isinstance(sd, dict) else None
        if not isinstance(cfg, dict):
            return False
        mine = self._config["batch_sampler"]
        # A state that does not say whether a batch_sampler made its batches (written before
        # that was recorded) is taken as this loader's, as it was then.
        return S.same_state(cfg.get("batch_size"), self.batch_size) and S.same_state(
            cfg.get("batch_sampler", mine), mine
        )

    def _refuse_batch_sampler(self, rp: S.ResumePoint) -> None:
        """Refuse to re-cut a position whose batches, or this loader's, come from a
        ``batch_sampler`` passed in: the state counts batches of the batch sampler's making,
        whose size it does not hold, and the docs promise a refusal both ways."""
        if rp.per_task() is not None and not self._user_batches:
            return
        if rp.batch_sampler:
            cfg = rp.source.get(S.K_CONFIG) if isinstance(rp.source, dict) else None
            desc = cfg.get("batch_sampler") if isinstance(cfg, dict) else None
            theirs = "the checkpoint's batches came from a batch_sampler" + (
                f" ({clip_text(desc, 200)})" if isinstance(desc, str) else ""
            )
        elif rp.per_task() is None:
            theirs = (
                "the checkpoint has batch_size=None and does not say whether a batch_sampler "
                "made its batches (it was written before that was recorded)"
            )
        else:
            theirs = f"the checkpoint has batch_size={rp.batch}"
        mine = (
            f"this loader's come from a batch_sampler ({self._config['batch_sampler']})"
            if self._user_batches
            else f"this loader has batch_size={self.batch_size}"
        )
        raise CheckpointError(
            f"cannot load DataLoader state: config.batch_size: {theirs}, {mine}. A position "
            "counted in batches of a batch_sampler passed to the loader cannot be re-cut into "
            "other batches (nor cut from another batch size: the batch sampler decides its "
            "batches). Resume with the checkpoint's own batching, or build the loader with "
            "batch_size=... (shuffle=True/False, a DistributedSampler or a Mixture), whose "
            "position is a sample cursor."
        )

    def _rebatch(self, rp: S.ResumePoint) -> S.ResumePoint:
        """A position saved with another batch size, as this loader's: the samples consumed
        become a sample cut (``_cursor``) from which this loader's batches are cut. Pure: the
        loader is not changed.

        Raises:
            CheckpointError: a sampler whose position cannot be re-cut, with what to do.
        """
        kind = self._plan.kind
        mine = self.batch_size
        if kind != BUILTIN and rp.cut is not None:
            raise CheckpointError(
                f"cannot load DataLoader state: {S.K_CUT}: a sample cut, but this loader's "
                f"sampler ({self._plan.description}) is not one of torch's Sequential/"
                "RandomSampler. The state is damaged, or from a loader with another sampler."
            )
        if rp.source is not None and self._same_batch(rp.source):
            return rp
        if rp.source is None and S.same_state(rp.batch, mine) and not self._user_batches:
            return rp  # re-cut from a global state: a fresh level, cut by this loader
        self._refuse_batch_sampler(rp)
        saved = f"batch_size={rp.batch}, this loader has batch_size={mine}"
        if kind == DISTRIBUTED:
            raise CheckpointError(
                f"cannot load DataLoader state: config.batch_size: the checkpoint has {saved}. "
                "With a DistributedSampler another batch size re-cuts the whole job's position, "
                "which one rank's state does not hold: load the job's global state (saved by "
                "torch.distributed.checkpoint, or resumable_loader.merge_rank_states([the state "
                "of every rank])) on every rank."
            )
        if kind != BUILTIN:
            what = (
                "a sampler with its own state_dict()"
                if kind == STATEFUL
                else "a batch_sampler or sampler whose order only replaying it reproduces"
            )
            raise CheckpointError(
                f"cannot load DataLoader state: config.batch_size: the checkpoint has {saved}. "
                f"This loader's position is counted in batches of {what} "
                f"({self._plan.description}), which cannot be re-cut into other batches. Resume "
                f"with batch_size={rp.batch}, or use shuffle=True/False, a DistributedSampler "
                "or a Mixture, whose position is a sample cursor."
            )
        n = self._plan.epoch_samples()
        assert n is not None
        # Bounded by the epoch before advance(), which would clamp a cut past the end to
        # "nothing left" and silently drop the epoch.
        _, problem = check_cut(rp.cut.to_state() if rp.cut is not None else None, n)
        if problem is not None:
            raise CheckpointError(
                f"cannot load DataLoader state: {S.K_CUT}: {problem}. The state is damaged, "
                "or from another dataset."
            )
        cut = rp.cut or Cut()
        try:
            cut = cut.advance(n, rp.per_task() or 1, rp.consumed, rp.ahead, self.drop_last)
        except ValueError as e:
            raise CheckpointError(
                f"cannot load DataLoader state: consumed: {e} (batch_size={rp.batch}). Build "
                "the loader over the dataset of the checkpoint."
            ) from None
        # The rest of the epoch is cut from the first sample not consumed, with this batch size:
        # the seed, and hence the order and the per-sample seeds, are the epoch's own.
        return dataclasses.replace(
            rp,
            cut=None if cut.is_trivial else cut,
            consumed=0,
            ahead=frozenset(),
            batch=mine,
            source=None,
        )

    def _load_checked(
        self,
        rp: S.ResumePoint,
        state_dict: dict[str, Any] | None,
        policy: str,
        *,
        rebatch: bool,
    ) -> None:
        """``_load_point`` (of the position re-cut for this batch size, if ``rebatch``), after
        the dataset check: refuse changed data, or note the changes in ``rp`` and warn of them
        once the state is loaded."""
        mix = self.dataset
        if isinstance(mix, Mixture) and rp.plan is not None:
            rp.dataset_changes = [*rp.dataset_changes, *plan_changes(mix, rp.plan)]
        changes = rp.dataset_changes
        if changes and policy == F.RAISE:
            raise F.changed_error(changes)
        try:
            if rebatch:
                self._load_point(self._rebatch(rp), None)
            else:
                self._load_point(rp, state_dict)
        except CheckpointError as e:
            if not changes:
                raise
            raise CheckpointError(
                f"{e} (The data changed since the checkpoint: {'; '.join(changes)}. "
                "on_dataset_change='continue' keeps the checkpoint's position, which must fit "
                "the new data.)"
            ) from None
        if changes:
            F.warn_changed(changes, "DataLoader", stacklevel=3)

    def _recut(self, states: list[dict[str, Any]], data: dict[str, Any]) -> S.ResumePoint:
        """The position of this rank from every rank's state of a job on another world size."""
        config = self._config
        world = len(states)
        stateful = self._plan.kind == STATEFUL
        if self._plan.kind != DISTRIBUTED:
            if world == config["world_size"]:
                return S.ResumePoint.from_state(
                    states[config["rank"]], config, stateful, dataset=data, dataset_change_ok=True
                )
            raise CheckpointError(
                f"cannot load DataLoader state: world_size: the checkpoint is from {world} "
                f"ranks, this loader has {config['world_size']}. Only torch's "
                "DistributedSampler's position can be re-cut for another number of ranks; "
                "with any other sampler, resume on the same number of ranks."
            )
        points = [
            S.ResumePoint.from_state(
                sd,
                dict(config, world_size=world, rank=r),
                False,
                dataset=data,
                dataset_change_ok=True,
            )
            for r, sd in enumerate(states)
        ]
        for p in points:
            self._refuse_batch_sampler(p)
        rp: S.ResumePoint = D.recut(
            points, self._plan, self.batch_size if self._auto_collation else None, self.drop_last
        )
        # A fresh level: nothing of it consumed yet.
        rp.batch, rp.batch_sampler = self.batch_size, self._user_batches
        if rp.history:
            # Inside the epoch: its seed, as iter() derives it again, so that a state saved
            # before that iter() is one a loader reads back (an epoch with levels has begun).
            s = self._plan.sampler
            rp.seed = derive_seed(
                DIST_SEED, s.seed, rp.sampler_epoch, len(rp.history), s.num_replicas, s.rank
            )
        # Every rank read the same data: its changes, once each.
        rp.dataset_changes = list(dict.fromkeys(c for p in points for c in p.dataset_changes))
        return rp

    def _load_point(self, rp: S.ResumePoint, state_dict: dict[str, Any] | None) -> None:
        for tid, idx in rp.outstanding:
            if isinstance(idx, list) != self._auto_collation:
                shape = "a list of sample indices" if self._auto_collation else "one index"
                raise CheckpointError(
                    f"cannot load DataLoader state: outstanding: task {tid} has {idx!r}, but a "
                    f"task of this loader is {shape}. The state is damaged, or from a loader "
                    "that batches differently."
                )
        self._check_fits(rp)
        gen = self._plan.sampler_generator
        if (gen is None) != (rp.sampler_rng is None) and rp.seed is not None:
            raise CheckpointError(
                f"cannot load DataLoader state: {S.K_SAMPLER_RNG}: the checkpoint's sampler "
                f"{'drew from' if gen is None else 'had no'} generator of its own, this "
                f"loader's sampler {'has none' if gen is None else 'has one'}. Build the "
                "sampler as the checkpoint's was (with or without generator=)."
            )
        # The last check that can refuse the state, and the first change: nothing below raises
        # for a state that was validated, so a refused state leaves the loader as it was.
        self._load_plan(rp)
        if gen is not None and rp.sampler_rng is not None:
            gen.set_state(decode_generator(rp.sampler_rng))
        rp.source = copy.deepcopy(state_dict) if state_dict is not None else None
        if rp.source is not None:
            # An older version read as this one (``S.UPGRADABLE``) is saved again as this one.
            rp.source[S.K_VERSION] = S.VERSION
            if rp.distributed:  # and a state from before `ended`, as `settle` read it
                rp.source[S.K_DIST] = rp.to_state(self._config)[S.K_DIST]
        if rp.distributed:
            # The sampler's epoch as it was: inside an epoch, the one to continue (iter()
            # refuses another); after an epoch's end, the one that ended, so that a script that
            # never calls set_epoch() iterates it again as it did uninterrupted. The recipe's
            # set_epoch(state's sampler_epoch) then moves on.
            self._plan.sampler.set_epoch(D.sampler_epoch_now(rp))
        old = self._active()
        if old is not None:
            old.abandon("replaced by load_state_dict(): iterate the loader again to continue")
        self._cursor = None
        if self._pool is not None:
            # Its workers carry datasets advanced by prefetching and seeds of the old state:
            # resume as a freshly built loader would.
            self._drop_pool()
        if rp.chain is not None:
            # The saved job's seed chain wins over this loader's generator and the global RNG:
            # the epochs after the resumed one are the saved job's.
            self._chain.load(rp.chain)
        self._resume = rp
        self._next_epoch = rp.epoch
        self._counters.skipped = [[e, t, S.plain_indices(i)] for e, t, i in rp.skipped]
        self._skipped_samples = [list(x) for x in rp.skipped_samples]

    def _check_fits(self, rp: S.ResumePoint) -> None:
        """The position lies inside an epoch of this loader."""
        if self._plan.kind == DISTRIBUTED:
            share = self._plan.distributed_tasks(rp.sampler_epoch, rp.history)
            if rp.consumed + len(rp.ahead) > share:
                raise CheckpointError(
                    f"cannot load DataLoader state: consumed: the state has {rp.consumed} "
                    f"batches consumed, but this rank's share of the epoch has only {share}. "
                    "Build the loader with the dataset, batch size and sampler of the checkpoint."
                )
        if self._plan.kind == BUILTIN and rp.cut is not None:
            _, problem = check_cut(rp.cut.to_state(), self._plan.epoch_samples())
            if problem is not None:
                raise CheckpointError(
                    f"cannot load DataLoader state: {S.K_CUT}: {problem}. The state is damaged, "
                    "or from another dataset."
                )
        if self._plan.kind in (BUILTIN, FASTFORWARD):
            try:
                total = len(self) if rp.cut is None else self._plan.cut_tasks(rp.cut)
            except TypeError:
                total = None
            if total is not None and rp.consumed + len(rp.ahead) > total:
                raise CheckpointError(
                    f"cannot load DataLoader state: consumed: the state has {rp.consumed} "
                    f"batches consumed, but an epoch of this loader has only {total}. Build the "
                    "loader with the dataset and batch size of the checkpoint."
                )

    def _load_plan(self, rp: S.ResumePoint) -> None:
        """A ``Mixture``'s plan from the state: the last check that can refuse it (the mixture
        is left as it was on refusal). New weights the mixture was built with apply from the
        first sample not yet consumed, in the order the sampler delivers the epoch (see
        ``_plan_resume``), or are refused where that order cannot be recomputed."""
        mix = self.dataset
        if not isinstance(mix, Mixture):
            # On changed data (another class: the check named it) a plan is not ours to follow.
            if rp.plan is not None and not rp.dataset_changes:
                raise CheckpointError(
                    f"cannot load DataLoader state: {S.K_PLAN}: the state holds a Mixture's "
                    f"plan, but this loader's dataset is a {type(mix).__name__}. Build the "
                    "loader over the Mixture the checkpoint was taken with."
                )
            return
        if rp.plan is None:
            if rp.dataset_changes:
                return  # the checkpoint's data was no Mixture: this one's plan, as it was built
            raise CheckpointError(
                f"cannot load DataLoader state: {S.K_PLAN}: missing, but this loader's dataset "
                "is a Mixture. The state was taken over another dataset."
            )
        resume, behind = self._plan_resume(rp, len(mix))
        changed = load_plan(mix, rp.plan, resume=resume, changes_ok=bool(rp.dataset_changes))
        if changed and behind:
            warnings.warn(behind, RuntimeWarning, stacklevel=4)

    def _plan_resume(self, rp: S.ResumePoint, n: int) -> tuple[int | RestAt | str, str]:
        """Where a ``Mixture``'s new weights begin at this resume: after every sample consumed.

        The epoch's sampler visits its positions in an order; what was consumed is a prefix of
        that order, less any batches delivered ahead (``in_order=False``) or ranks out of step.
        The new weights begin at the place ``top`` just after the last consumed sample: a
        global position when the order is ``range(n)``, else a place in the order (``RestAt``:
        the k-th sample delivered after the resume is the k-th of the new weights). The few
        unconsumed samples before ``top`` keep the old weights: the second value says so (a
        warning, if the weights changed), or is empty. A str first: the reason the order
        cannot be recomputed (the load is refused if the weights changed).
        """
        epoch = rp.epoch
        begun = rp.consumed or rp.ahead or rp.history or rp.drawn or rp.cut is not None
        if not begun:
            return epoch * n, ""
        kind, sampler = self._plan.kind, self._plan.sampler
        order: dict[str, Any] | None = None
        if kind == BUILTIN:
            cut = (rp.cut or Cut()).advance(n, self._plan.per_task(), rp.consumed, rp.ahead)
            top = max([cut.start, *(f + c for f, c in cut.holes)])
            behind = top - cut.start - sum(c for _, c in cut.holes)
            if type(sampler) is not SequentialSampler:
                if sampler.replacement or sampler.num_samples != n:
                    why = (
                        f"the sampler draws {sampler.num_samples} positions of {n}"
                        f"{' with replacement' if sampler.replacement else ''}, so the rest "
                        "of the epoch is no set of positions that new weights could be given to"
                    )
                    return why, ""
                assert rp.seed is not None  # begun: inside an epoch
                order = {"kind": "random", "seed": rp.seed}
        elif kind == DISTRIBUTED:
            top, behind = self._distributed_top(rp, n)
            if sampler.shuffle:
                order = {"kind": "distributed", "seed": sampler.seed, "epoch": rp.sampler_epoch}
        else:
            why = (
                f"the loader cannot recompute the order of its sampler ({self._plan.description})"
                ", so it cannot tell which samples of the epoch are still to come"
            )
            return why, ""
        note = (
            f"the Mixture's new weights apply after the last sample consumed, from place {top} "
            f"of epoch {epoch}'s order of {n}; {behind} samples before it were not consumed "
            "(delivered ahead out of order, or ranks out of step) and keep the checkpoint's "
            "weights"
            if behind
            else ""
        )
        if top >= n:
            return (epoch + 1) * n, note
        if order is None or top == 0:
            return epoch * n + top, note
        return RestAt(epoch, top, order), note

    def _distributed_top(self, rp: S.ResumePoint, n: int) -> tuple[int, int]:
        """A DistributedSampler epoch: one past the last place (in the epoch's order, before
        torch's cut) any rank consumed, and how many places before it are still to come.

        The levels of ``rp.history`` hold each rank's count. A rank's own state (the level it
        is in has samples consumed) says only what this rank consumed: the other ranks are
        taken to be in step with it, as ranks that step together are."""
        s = self._plan.sampler
        drop_last = s.drop_last
        seq = np.arange(n, dtype=np.int64)  # places, cut and re-cut as the positions are
        top = -1
        levels = list(rp.history)
        own: np.ndarray | None = None
        if rp.consumed or rp.ahead:
            share = len(self._plan.distributed_share(rp.sampler_epoch, rp.history))
            bs = self._plan.per_task()
            mine = [np.arange(min(share, rp.consumed * bs), dtype=np.int64)]
            mine += [np.arange(t * bs, min(share, (t + 1) * bs), dtype=np.int64) for t in rp.ahead]
            own = np.concatenate(mine)
        for world, consumed in levels:
            total = min(len(seq), D.cut_length(len(seq), world, drop_last))
            for r, c in enumerate(consumed):
                took = seq[r : min(total, c * world + r) : world]
                if len(took):
                    top = max(top, int(took.max()))
            seq = D.remaining(seq, world, consumed, drop_last)
        if own is not None:
            world = s.num_replicas
            total = min(len(seq), D.cut_length(len(seq), world, drop_last))
            taken = np.zeros(len(seq), dtype=bool)
            for r in range(world):
                at = own * world + r
                taken[at[at < total]] = True
            if taken.any():
                top = max(top, int(seq[taken].max()))
            seq = seq[~taken]
        top += 1
        return top, int((seq < top).sum())

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


__all__ = ["DataLoader", "RetryPolicy"]
