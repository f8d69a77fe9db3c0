"""The samplers a shuffling loader hands out: torch's classes, carrying the loader's seed chain.

``DataLoader(ds, shuffle=True)`` exposes ``loader.sampler`` and ``loader.batch_sampler`` as
torch's own do, and other libraries rebuild loaders around them: accelerate's ``prepare()``
(over torchdata's ``StatefulDataLoader`` with ``use_stateful_dataloader=True``), Lightning, or a
user's ``DataLoader(ds, batch_sampler=loader.batch_sampler)``. torch's ``RandomSampler`` keeps
its position and its future shuffles in a generator nobody saves, so such a rebuilt loader
resumes into other samples. Ours are subclasses of torch's (every ``isinstance`` check holds)
whose epochs come from the loader's ``SeedChain``, and which save and restore themselves with
the protocol torchdata reads (``state_dict()``/``load_state_dict()`` on the sampler and on its
iterator):

* ``iter(sampler)`` begins an epoch: its seed is the chain's next (so iterating the sampler
  yields exactly the order the loader itself would give that epoch), its order is
  ``shuffle_order(...)`` of that seed, computed, not drawn step by step.
* ``sampler.state_dict()`` is the chain as the current epoch drew it plus how far that epoch's
  iterator went (or, once the epoch's iterator ran out, the chain as the next epoch draws it).
  ``load_state_dict()`` makes the next ``iter()`` that epoch again from that position.
* The iterators' own ``state_dict()`` is their position alone, so torchdata's "load the
  sampler, ``iter()`` it, load the iterator" lands on the same place.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler as _TorchBatchSampler
from torch.utils.data import RandomSampler as _TorchRandomSampler

from ..core.errors import CheckpointError
from ..state.seeds import SAMPLER, SeedChain, check_chain, derive_seed

_CHAIN = "seed_chain"
_YIELDED = "yielded"


def shuffle_order(n: int, num_samples: int, replacement: bool, seed: int) -> np.ndarray:
    """An epoch's sample order for ``RandomSampler(data of n, replacement, num_samples)``
    under the epoch's ``seed``: a pure function, so any position is computed, not replayed."""
    g = torch.Generator()
    g.manual_seed(derive_seed(SAMPLER, seed))
    if replacement:
        return torch.randint(high=n, size=(num_samples,), dtype=torch.int64, generator=g).numpy()
    parts = [torch.randperm(n, generator=g) for _ in range(num_samples // n)]
    if num_samples % n:
        parts.append(torch.randperm(n, generator=g)[: num_samples % n])
    if not parts:
        return np.empty(0, dtype=np.int64)
    return torch.cat(parts).numpy()


class _OrderIter(Iterator[int]):
    """One epoch of a ``RandomSampler``: its order, and how far it went."""

    def __init__(self, order: np.ndarray, start: int) -> None:
        self._order = order
        self.yielded = min(start, len(order))
        self.done = False

    def __next__(self) -> int:
        if self.yielded >= len(self._order):
            self.done = True
            raise StopIteration
        i = int(self._order[self.yielded])
        self.yielded += 1
        return i

    def state_dict(self) -> dict[str, Any]:
        return {_YIELDED: self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.yielded = min(_position(state, "sampler iterator"), len(self._order))


class RandomSampler(_TorchRandomSampler):
    """torch's ``RandomSampler`` whose epochs come from a loader's ``SeedChain`` (see the
    module docstring). ``generator`` is the chain's: reading it reads the chain's generator,
    and assigning one (as accelerate does to synchronise ranks) makes the chain draw from it."""

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        *,
        chain: SeedChain,
    ) -> None:
        self._chain = chain
        super().__init__(data_source, replacement=replacement, num_samples=num_samples)
        self._live: Any = None  # weakref to the latest epoch's iterator
        self._resume_at: int | None = None

    @property
    def chain(self) -> SeedChain:
        return self._chain

    @property
    def generator(self) -> torch.Generator | None:
        return self._chain.generator

    @generator.setter
    def generator(self, gen: torch.Generator | None) -> None:
        # torch's __init__ assigns its generator argument (None): that keeps the chain's.
        if gen is not None:
            self._chain.generator = gen

    def __iter__(self) -> Iterator[int]:
        seed = self._chain.next_seed()
        start, self._resume_at = self._resume_at or 0, None
        order = shuffle_order(len(self.data_source), self.num_samples, self.replacement, seed)
        it = _OrderIter(order, start)
        self._live = weakref.ref(it)
        return it

    def state_dict(self) -> dict[str, Any]:
        it = self._live() if self._live is not None else None
        if self._resume_at is not None:
            return {_CHAIN: self._chain.state(), _YIELDED: self._resume_at}
        if it is None or it.done:
            return {_CHAIN: self._chain.state(), _YIELDED: 0, "next_epoch": True}
        return {_CHAIN: self._chain.state_before(), _YIELDED: it.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise CheckpointError(
                f"cannot load RandomSampler state: expected a dict, got {state!r:.80}"
            )
        problem = check_chain(state.get(_CHAIN))
        if problem is not None:
            raise CheckpointError(f"cannot load RandomSampler state: {_CHAIN}: {problem}")
        at = _position(state, "RandomSampler")
        self._chain.load(state[_CHAIN])
        self._live = None
        self._resume_at = None if state.get("next_epoch") else at


class _BatchIter(Iterator[list[int]]):
    def __init__(self, inner: _OrderIter, batch_size: int, drop_last: bool) -> None:
        self._inner = inner
        self._bs = batch_size
        self._drop_last = drop_last

    def __next__(self) -> list[int]:
        batch = []
        for _ in range(self._bs):
            try:
                batch.append(next(self._inner))
            except StopIteration:
                break
        if not batch or (self._drop_last and len(batch) < self._bs):
            raise StopIteration
        return batch

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._inner.load_state_dict(state)


class BatchSampler(_TorchBatchSampler):
    """torch's ``BatchSampler`` over our ``RandomSampler``, saving and restoring its state."""

    sampler: RandomSampler

    def __iter__(self) -> Iterator[list[int]]:
        inner = iter(self.sampler)
        assert isinstance(inner, _OrderIter)
        return _BatchIter(inner, self.batch_size, self.drop_last)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


# ---- the names states record ----------------------------------------------------------------
# A state's config names a batch sampler passed to the loader by its class (accelerate passes
# ours when it rebuilds a loader), and a resume compares that name. These classes lived in the
# flat module ``resumable_loader._samplers`` until the layers redesign (issue #32) moved them:
# states keep naming them so, or every checkpoint saved before the move would be refused.
_RECORDED_NAMES: dict[type, str] = {
    RandomSampler: "resumable_loader._samplers.RandomSampler",
    BatchSampler: "resumable_loader._samplers.BatchSampler",
}


def recorded_name(obj: object) -> str:
    """The name a state records for ``obj``'s class: ``module.qualname``, or for our own
    samplers the name every state has recorded for them (see above)."""
    cls = type(obj)
    return _RECORDED_NAMES.get(cls) or f"{cls.__module__}.{cls.__qualname__}"


def _position(state: Any, what: str) -> int:
    at = state.get(_YIELDED) if isinstance(state, dict) else None
    if type(at) is not int or at < 0:
        raise CheckpointError(
            f"cannot load {what} state: {_YIELDED}: expected an int >= 0, got {at!r:.40}"
        )
    return at


# ---- an epoch's order, named in plain data --------------------------------------------------
# A data plan that changed its weights inside a shuffled epoch keys the rest of that epoch by
# each sample's place in the epoch's order (see ``plans.mixture``). It names the order in its state,
# so that a worker, a resumed job and an uninterrupted reference all compute the same one.
ORDER_RANDOM = "random"  # ours or torch's RandomSampler, without replacement, one pass
ORDER_DISTRIBUTED = "distributed"  # torch's DistributedSampler(shuffle=True): before its cut


def check_order(spec: Any) -> str | None:
    """What is wrong with an order's plain-data name, or None."""
    if not isinstance(spec, dict) or spec.get("kind") not in (ORDER_RANDOM, ORDER_DISTRIBUTED):
        return f"expected {{'kind': 'random' or 'distributed', ...}}, got {spec!r:.80}"
    want = {"kind", "seed"} | ({"epoch"} if spec["kind"] == ORDER_DISTRIBUTED else set())
    if set(spec) != want or any(type(spec[k]) is not int or spec[k] < 0 for k in want - {"kind"}):
        return f"expected the keys {sorted(want)} (ints >= 0), got {spec!r:.80}"
    return None


def order_of(spec: dict[str, Any], n: int) -> np.ndarray:
    """The order of ``range(n)`` that ``spec`` names: ``{"kind": "random", "seed": s}`` is
    ``shuffle_order(n, n, False, s)`` (the loader's epoch seed ``s``);
    ``{"kind": "distributed", "seed": s, "epoch": e}`` is torch's ``DistributedSampler`` order
    of its epoch ``e`` under its seed ``s`` (before torch pads or trims it for the ranks)."""
    if spec["kind"] == ORDER_RANDOM:
        return shuffle_order(n, n, False, spec["seed"])
    g = torch.Generator()
    g.manual_seed(spec["seed"] + spec["epoch"])  # as DistributedSampler.__iter__ seeds it
    return torch.randperm(n, generator=g).numpy()
