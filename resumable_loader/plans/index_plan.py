"""Stage 1 of the pipeline: where the sample indices of each task come from.

A *task* is one batch (or one sample with ``batch_size=None``) of an epoch; its id is its
position in the epoch's batch order. This module turns the loader's sampler into a per-epoch
source of task indices that can start at any position:

* ``builtin``: torch's own ``SequentialSampler`` / ``RandomSampler`` (exact types), batched by
  torch's ``BatchSampler`` or unbatched. Their order is recomputed from the epoch's seed, so the
  state is O(1): seed + position, never a permutation or a generator tensor.
* ``stateful``: a user sampler/batch sampler with ``state_dict()``/``load_state_dict()`` (also
  inside torch's ``BatchSampler``); its own state is saved, as of the batches drawn so far,
  together with the indices of batches drawn but not yet consumed.
* ``distributed``: torch's ``DistributedSampler`` (batched by torch's ``BatchSampler`` or
  unbatched). Its order is recomputed from (its seed, its epoch) and the levels of a resume on
  another number of ranks (see ``state.ranks``): the state is O(1) per rank, and a state can be
  re-cut for another world size.
* ``fastforward``: any other sampler; on resume its iterator is re-created and ``position``
  tasks are drawn and discarded (no data is fetched). O(position) sampler steps; exact when the
  sampler's order is a function of the epoch (e.g. ``DistributedSampler`` after ``set_epoch``)
  or of torch's global RNG, which it draws from a per-epoch seed (``_SeededDraws``).
* ``iterable``: an IterableDataset; tasks carry no indices, the workers' streams decide.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler

from ..state import ranks as D
from ..state.cursor import Cut
from ..state.schema import has_state
from ..state.seeds import SAMPLER, derive_seed
from .samplers import BatchSampler as _OurBatchSampler
from .samplers import RandomSampler as _OurRandomSampler
from .samplers import recorded_name, shuffle_order

# torch's batching and orders, and ours (the loader's own, which carry its seed chain).
_BATCHERS = (BatchSampler, _OurBatchSampler)
_ORDERS = (SequentialSampler, RandomSampler, _OurRandomSampler)

BUILTIN = "builtin"
STATEFUL = "stateful"
FASTFORWARD = "fastforward"
DISTRIBUTED = "distributed"
ITERABLE = "iterable"


class IndexPlan:
    """How one loader draws task indices. Built once per loader; ``epoch()`` per epoch.

    Args:
        dataset: the loader's dataset.
        sampler: the loader's ``sampler`` attribute.
        batch_sampler: the loader's ``batch_sampler`` attribute (None without auto-batching).
        auto_collation: whether the loader batches (``batch_sampler is not None``).
    """

    def __init__(
        self, dataset: Any, sampler: Any, batch_sampler: Any, auto_collation: bool
    ) -> None:
        self._sampler = sampler
        self._batch_sampler = batch_sampler
        self._auto = auto_collation
        index_sampler = batch_sampler if auto_collation else sampler
        self._index_sampler = index_sampler
        inner = sampler
        # Whose state_dict() holds the position: the index sampler, or the sampler inside
        # torch's own BatchSampler (which only groups consecutive draws).
        self._stateful_obj: Any = None
        ours = type(index_sampler) in (_OurBatchSampler, _OurRandomSampler)
        if not isinstance(dataset, IterableDataset) and not ours:
            if has_state(index_sampler):
                self._stateful_obj = index_sampler
            elif auto_collation and type(batch_sampler) in _BATCHERS and has_state(sampler):
                self._stateful_obj = sampler
        if isinstance(dataset, IterableDataset):
            self.kind = ITERABLE
            self.description = "iterable"
        elif self._stateful_obj is not None:
            self.kind = STATEFUL
            self.description = f"stateful:{recorded_name(self._stateful_obj)}"
        else:
            builtin_batching = not auto_collation or type(batch_sampler) in _BATCHERS
            if auto_collation and type(batch_sampler) in _BATCHERS:
                inner = batch_sampler.sampler
            if builtin_batching and D.is_torch_distributed_sampler(inner):
                self.kind = DISTRIBUTED
                # Not its world size or rank: a state may be resumed on another world size.
                self.description = (
                    f"distributed(shuffle={inner.shuffle}, seed={inner.seed}, "
                    f"drop_last={inner.drop_last})"
                )
            elif builtin_batching and type(inner) in _ORDERS:
                self.kind = BUILTIN
                if type(inner) is SequentialSampler:
                    self.description = "sequential"
                else:
                    self.description = (
                        f"random(replacement={inner.replacement}, num_samples={inner.num_samples})"
                    )
            else:
                self.kind = FASTFORWARD
                self.description = f"fastforward:{recorded_name(index_sampler)}"
                if auto_collation and type(batch_sampler) in _BATCHERS:
                    self.description += f"({recorded_name(inner)})"
        self._inner = inner
        # FASTFORWARD: a generator of the sampler's own (torch's SubsetRandomSampler and
        # WeightedRandomSampler take one). Its state at each epoch's start is saved, so the
        # fast-forward of a resumed epoch redraws what was drawn, and later epochs follow.
        self.sampler_generator: torch.Generator | None = None
        if self.kind == FASTFORWARD:
            for obj in (index_sampler, inner):
                gen = getattr(obj, "generator", None)
                if isinstance(gen, torch.Generator):
                    self.sampler_generator = gen
                    break
        # DISTRIBUTED: the sampler epoch and the levels' history of the epoch being iterated,
        # set by the loader before it asks for the epoch (see ``distributed_share``).
        self.dist_position: tuple[int, list[Any]] = (0, [])
        self._share_cache: tuple[Any, np.ndarray] | None = None
        # BUILTIN: where the epoch being iterated is cut from (a resume with another batch
        # size, or a skip); None: from position 0. Set by the loader at each iter().
        self.cut: Cut | None = None

    def epoch_samples(self) -> int | None:
        """The positions of one epoch's order: built-in samplers (the RandomSampler's
        ``num_samples``, else the dataset's length) and a DistributedSampler (the dataset's
        length, before torch's cut for the ranks); None for the rest."""
        if self.kind == BUILTIN:
            inner = self._inner
            if type(inner) is SequentialSampler:
                return len(inner.data_source)
            return int(inner.num_samples)
        if self.kind == DISTRIBUTED:
            return len(self._inner.dataset)
        return None

    def per_task(self) -> int:
        """Samples per task: the batch size, or 1 without auto-batching."""
        return self._batching()[0] or 1

    def cut_tasks(self, cut: Cut | None) -> int:
        """BUILTIN: how many tasks an epoch cut by ``cut`` (None: from 0) makes."""
        n = self.epoch_samples()
        assert n is not None
        bs, drop_last = self._batching()
        return (cut or Cut()).tasks(n, bs or 1, drop_last)

    def distributed_share(self, sampler_epoch: int, history: list[Any]) -> np.ndarray:
        """This rank's sample indices of the epoch at the level after ``history`` (cached)."""
        key = (sampler_epoch, repr(history))
        if self._share_cache is None or self._share_cache[0] != key:
            s = self._inner
            seq = D.level_sequence(D.epoch_order(s, sampler_epoch), history, s.drop_last)
            share = D.rank_share(seq, s.num_replicas, s.rank, s.drop_last)
            self._share_cache = (key, share)
        return self._share_cache[1]

    def distributed_tasks(self, sampler_epoch: int, history: list[Any]) -> int:
        """How many tasks this rank's share of that epoch makes."""
        return _BuiltinEpoch(
            self.distributed_share(sampler_epoch, history), self._batching(), 0
        ).tasks

    @property
    def sampler(self) -> Any:
        """The sampler that orders the samples (inside torch's BatchSampler, if any)."""
        return self._inner

    def sampler_state(self) -> Any:
        """The stateful sampler's own state (as of the tasks drawn so far), else None."""
        if self.kind == STATEFUL:
            return self._stateful_obj.state_dict()
        return None

    def batches(
        self,
        base_seed: int,
        start: int,
        sampler_state: Any = None,
        sampler_done: bool = False,
    ) -> Iterator[Any]:
        """An iterator over the task indices of the epoch seeded ``base_seed``, starting at task
        ``start``. For torch's own and fast-forwarded samplers the order is the seed's alone; a
        DistributedSampler's depends on its epoch and levels (``dist_position``), a stateful
        sampler's on its own state.

        For ``stateful`` samplers, ``sampler_state`` (if given) is loaded first and ``start``
        is the number of tasks already drawn in this epoch (their indices are in the state).

        Raises:
            IndexError: ``start`` lies beyond the end of a ``fastforward`` sampler's epoch.
        """
        if self.kind == ITERABLE:
            raise TypeError("an iterable dataset has no sampler order: its tasks are fetches")
        if self.kind == STATEFUL:
            if sampler_state is not None:
                self._stateful_obj.load_state_dict(sampler_state)
            if sampler_done:
                # Drawn to the end; touching the sampler now would start its next epoch. The
                # marker keeps saying "done", so a later checkpoint of this epoch says so too.
                return _DrawnOut()
            if self._stateful_obj is self._index_sampler:
                return _EagerEnd(self._index_sampler, None, False, start)
            bs, drop_last = self._batching()
            return _EagerEnd(self._stateful_obj, bs, drop_last, start)
        if self.kind == FASTFORWARD:
            it = _SeededDraws(self._index_sampler, derive_seed(SAMPLER, base_seed))
            for skipped in range(start):
                try:
                    next(it)
                except StopIteration:
                    raise IndexError(
                        f"the sampler's epoch has only {skipped} batches, but the state says "
                        f"{start} were consumed"
                    ) from None
            return it
        if self.kind == DISTRIBUTED:
            share = self.distributed_share(*self.dist_position)
            return _BuiltinEpoch(share, self._batching(), start)
        return _BuiltinEpoch(self._order(base_seed), self._batching(), start, self.cut)

    def _batching(self) -> tuple[int | None, bool]:
        if not self._auto:
            return None, False
        return self._batch_sampler.batch_size, self._batch_sampler.drop_last

    def _order(self, base_seed: int) -> np.ndarray | int:
        """The epoch's sample order as an int64 array, or the length for sequential order."""
        inner = self._inner
        if type(inner) is SequentialSampler:
            return len(inner.data_source)
        return shuffle_order(
            len(inner.data_source), inner.num_samples, inner.replacement, base_seed
        )


class _SeededDraws(Iterator[Any]):
    """Iterate a sampler with torch's global RNG swapped for the epoch's own.

    torch's SubsetRandomSampler, WeightedRandomSampler and RandomSampler subclasses draw from
    torch's global generator when they have none of their own. Under this wrapper they draw
    from a generator seeded from the epoch's seed, whose state lives here between draws:
    the order is the same in a resumed run (whatever the global seed there), and the
    user's global RNG is left alone. Costs ~2 us per draw.
    """

    def __init__(self, sampler: Any, seed: int) -> None:
        glob = torch.random.default_generator
        saved = glob.get_state()
        try:
            glob.manual_seed(seed)
            self._it = iter(sampler)
            self._rng = glob.get_state()
        finally:
            glob.set_state(saved)

    def __next__(self) -> Any:
        glob = torch.random.default_generator
        saved = glob.get_state()
        glob.set_state(self._rng)
        try:
            return next(self._it)
        finally:
            self._rng = glob.get_state()
            glob.set_state(saved)


class _BuiltinEpoch(Iterator[Any]):
    """Random access into one epoch's order: task ``t`` is computed, not iterated to.

    With a ``cut`` (see ``state.cursor``), the tasks are the batches of the rest of the epoch it
    names, cut from its start; task ``t`` is still computed, in O(log holes) per sample."""

    __slots__ = ("_bs", "_cut", "_left", "_n", "_ntasks", "_order", "_pos")

    def __init__(
        self,
        order: np.ndarray | int,
        batching: tuple[int | None, bool],
        start: int,
        cut: Cut | None = None,
    ):
        self._order = None if isinstance(order, int) else order
        self._n = order if isinstance(order, int) else len(order)
        self._cut = None if cut is None or cut.is_trivial else cut
        left = self._n if self._cut is None else self._cut.left(self._n)
        self._left = left
        bs, drop_last = batching
        self._bs = bs
        if bs is None:
            self._ntasks = left
        else:
            self._ntasks = left // bs if drop_last else math.ceil(left / bs)
        if start > self._ntasks:
            raise IndexError(
                f"the epoch has only {self._ntasks} batches, but the state says {start} were "
                "consumed"
            )
        self._pos = start

    @property
    def tasks(self) -> int:
        return self._ntasks

    def __next__(self) -> Any:
        t = self._pos
        if t >= self._ntasks:
            raise StopIteration
        self._pos = t + 1
        bs = self._bs
        order = self._order
        if self._cut is not None:
            a = t * (bs or 1)
            pos = self._cut.positions(a, min(a + (bs or 1), self._left))
            if order is not None:
                pos = order[pos]
            return int(pos[0]) if bs is None else pos.tolist()
        if bs is None:
            return t if order is None else int(order[t])
        a = t * bs
        b = min(a + bs, self._n)
        if order is None:
            return list(range(a, b))
        return order[a:b].tolist()


class _DrawnOut(Iterator[Any]):
    """A stateful sampler's epoch that was already drawn to the end before a checkpoint."""

    done = True

    def __next__(self) -> Any:
        raise StopIteration


class _EagerEnd(Iterator[Any]):
    """Draws a stateful sampler's epoch so that its end is never ambiguous in a checkpoint.

    Many samplers rewind their state (next epoch, position 0) when their iterator finishes,
    and torch's BatchSampler finishes it while filling the last partial batch. A state taken
    just then could not tell "epoch drawn out" from "next epoch not started". So, when the
    sampler has a length, this draws exactly the items that remain and then finishes the
    sampler's iterator at once, setting ``done`` in the same step: every checkpoint sees
    either "not finished, not rewound" or "done".

    Args:
        sampler: the stateful sampler (or batch sampler, with ``batch_size=None``).
        batch_size: group this many draws into one task; None: one draw is one task.
        drop_last: drop a final partial group (its items are still drawn, as torch does).
        tasks_drawn: tasks already drawn this epoch before the state was saved.
    """

    def __init__(self, sampler: Any, batch_size: int | None, drop_last: bool, tasks_drawn: int):
        self._it = iter(sampler)
        self._bs = batch_size
        self._drop_last = drop_last
        try:
            self._total: int | None = len(sampler)
        except TypeError:
            self._total = None
        self._drawn = tasks_drawn * (batch_size or 1)  # items drawn this epoch
        self._pushed_back: list[Any] = []
        self.done = False
        if self._total is not None and self._drawn >= self._total:
            self._finish()

    def _next_item(self) -> Any:
        if self._pushed_back:
            return self._pushed_back.pop()
        return next(self._it)

    def _finish(self) -> None:
        """Let the sampler's iterator end now (it may rewind its state)."""
        try:
            extra = next(self._it)
        except StopIteration:
            self.done = True
        else:  # the sampler yields more than its len(): keep drawing as if len were unknown
            self._pushed_back.append(extra)
            self._total = None

    def __next__(self) -> Any:
        if self.done:
            raise StopIteration
        if self._bs is None:
            try:
                item = self._next_item()
            except StopIteration:
                self.done = True
                raise
            self._drawn += 1
            if self._total is not None and self._drawn >= self._total:
                self._finish()
            return item
        want = self._bs
        if self._total is not None:
            want = min(want, self._total - self._drawn)
        batch = []
        for _ in range(want):
            try:
                batch.append(self._next_item())
            except StopIteration:
                self.done = True
                break
        self._drawn += len(batch)
        if not self.done and self._total is not None and self._drawn >= self._total:
            self._finish()
        if not batch or (self._drop_last and len(batch) < self._bs):
            self.done = True
            raise StopIteration
        return batch
