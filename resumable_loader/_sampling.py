"""Stage 1 of the pipeline: where the sample indices of each task come from.

A *task* is one batch (or one sample with ``batch_size=None``) of an epoch; its id is its
position in the epoch's batch order. This module turns the loader's sampler into a per-epoch
source of task indices that can start at any position:

* ``builtin``: torch's own ``SequentialSampler`` / ``RandomSampler`` (exact types), batched by
  torch's ``BatchSampler`` or unbatched. Their order is recomputed from (seed, epoch), so the
  state is O(1): seed + position, never a permutation or a generator tensor.
* ``stateful``: a user sampler/batch sampler with ``state_dict()``/``load_state_dict()``; its
  own state is saved, together with the indices of tasks drawn but not yet consumed.
* ``fastforward``: any other sampler; on resume its iterator is re-created and ``position``
  tasks are drawn and discarded (no data is fetched). O(position) sampler steps; exact when the
  sampler's order is a function of the epoch (e.g. ``DistributedSampler`` after ``set_epoch``).
* ``iterable``: an IterableDataset; tasks carry no indices, the workers' streams decide.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler

from ._seeding import SAMPLER, derive_seed

BUILTIN = "builtin"
STATEFUL = "stateful"
FASTFORWARD = "fastforward"
ITERABLE = "iterable"


def _qualname(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _has_state(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


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
        if isinstance(dataset, IterableDataset):
            self.kind = ITERABLE
            self.description = "iterable"
        elif _has_state(index_sampler):
            self.kind = STATEFUL
            self.description = f"stateful:{_qualname(index_sampler)}"
        else:
            builtin_batching = not auto_collation or type(batch_sampler) is BatchSampler
            if auto_collation and type(batch_sampler) is BatchSampler:
                inner = batch_sampler.sampler
            if builtin_batching and type(inner) in (SequentialSampler, RandomSampler):
                self.kind = BUILTIN
                if type(inner) is SequentialSampler:
                    self.description = "sequential"
                else:
                    self.description = (
                        f"random(replacement={inner.replacement}, num_samples={inner.num_samples})"
                    )
            else:
                self.kind = FASTFORWARD
                self.description = f"fastforward:{_qualname(index_sampler)}"
        self._inner = inner

    @property
    def index_sampler(self) -> Any:
        return self._index_sampler

    def sampler_state(self) -> Any:
        """The stateful sampler's own state (as of the tasks drawn so far), else None."""
        if self.kind == STATEFUL:
            return self._index_sampler.state_dict()
        return None

    def epoch(
        self, base_seed: int, epoch: int, start: int, sampler_state: Any = None
    ) -> Iterator[Any]:
        """An iterator over the task indices of ``epoch``, starting at task ``start``.

        For ``stateful`` samplers, ``sampler_state`` (if given) is loaded first and ``start``
        is ignored: the sampler's own state says where it is.

        Raises:
            IndexError: ``start`` lies beyond the end of a ``fastforward`` sampler's epoch.
        """
        if self.kind == ITERABLE:
            return _forever()
        if self.kind == STATEFUL:
            if sampler_state is not None:
                self._index_sampler.load_state_dict(sampler_state)
            return iter(self._index_sampler)
        if self.kind == FASTFORWARD:
            it = iter(self._index_sampler)
            for skipped in range(start):
                try:
                    next(it)
                except StopIteration:
                    raise IndexError(
                        f"the sampler's epoch has only {skipped} batches, but the state says "
                        f"{start} were consumed"
                    ) from None
            return it
        return _BuiltinEpoch(self._order(base_seed, epoch), self._batching(), start)

    def _batching(self) -> tuple[int | None, bool]:
        if not self._auto:
            return None, False
        return self._batch_sampler.batch_size, self._batch_sampler.drop_last

    def _order(self, base_seed: int, epoch: int) -> np.ndarray | int:
        """The epoch's sample order as an int64 array, or the length for sequential order."""
        inner = self._inner
        if type(inner) is SequentialSampler:
            return len(inner.data_source)
        n = len(inner.data_source)
        num_samples = inner.num_samples
        g = torch.Generator()
        g.manual_seed(derive_seed(SAMPLER, base_seed, epoch))
        if inner.replacement:
            return torch.randint(high=n, size=(num_samples,), dtype=torch.int64, generator=g).numpy()
        parts = [torch.randperm(n, generator=g) for _ in range(num_samples // n)]
        if num_samples % n:
            parts.append(torch.randperm(n, generator=g)[: num_samples % n])
        if not parts:
            return np.empty(0, dtype=np.int64)
        return torch.cat(parts).numpy()


def _forever() -> Iterator[None]:
    while True:
        yield None


class _BuiltinEpoch(Iterator[Any]):
    """Random access into one epoch's order: task ``t`` is computed, not iterated to."""

    __slots__ = ("_bs", "_n", "_ntasks", "_order", "_pos")

    def __init__(self, order: np.ndarray | int, batching: tuple[int | None, bool], start: int):
        self._order = None if isinstance(order, int) else order
        self._n = order if isinstance(order, int) else len(order)
        bs, drop_last = batching
        self._bs = bs
        if bs is None:
            self._ntasks = self._n
        else:
            self._ntasks = self._n // bs if drop_last else math.ceil(self._n / bs)
        if start > self._ntasks:
            raise IndexError(
                f"the epoch has only {self._ntasks} batches, but the state says {start} were "
                "consumed"
            )
        self._pos = start

    def __next__(self) -> Any:
        t = self._pos
        if t >= self._ntasks:
            raise StopIteration
        self._pos = t + 1
        bs = self._bs
        order = self._order
        if bs is None:
            return t if order is None else int(order[t])
        a = t * bs
        b = min(a + bs, self._n)
        if order is None:
            return list(range(a, b))
        return order[a:b].tolist()
