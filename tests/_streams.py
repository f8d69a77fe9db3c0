"""Picklable streams and samplers with state, for the state and supervisor tests.

``Shard(n, record=None)``         the values worker k of W owns: k, k+W, ... < n + 3k (uneven:
                                  workers end at different times); every item also carries draws
                                  from python/numpy/torch RNGs; ``record`` appends each produced
                                  value to a file (O_APPEND) to prove nothing is read twice.
``StatefulShard``                 ``Shard`` with ``state_dict``/``load_state_dict`` (a cursor;
                                  rewinds itself when its generator ends, as many datasets do).
``IteratorStateShard``            state on the iterator object instead of the dataset.
``ResetInIterShard``              its own iterator; ``__iter__`` resets the cursor (torchdata's
                                  order: ``iter()``, then ``load_state_dict``).
``StartInIterShard``              ``__iter__`` starts from a position loaded before it (the
                                  other order).
``StateMadeInIterShard``          ``load_state_dict`` fails before ``__iter__`` made the cursor.
``StatefulSampler(n, seed)``      a user sampler with its own ``state_dict`` (epoch + position).
``NoStateSampler(n)``             a custom sampler without state (fast-forwarded on resume).
``PosState``                      mixin: ``state_dict``/``load_state_dict`` of a cursor ``pos``.
``SeqSamplerWithState(n)``        0..n-1 in order; a user sampler whose state is its position.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
from torch.utils.data import IterableDataset, Sampler, get_worker_info


def _shard(n: int) -> list[int]:
    info = get_worker_info()
    w, nw = (info.id, info.num_workers) if info is not None else (0, 1)
    return list(range(w, n + 3 * w, nw))


def _item(v: int) -> torch.Tensor:
    return torch.tensor(
        [
            v,
            random.randint(0, 10**6),
            int(np.random.randint(0, 10**6)),
            int(torch.randint(0, 10**6, ())),
        ]
    )


def _record(path: str | None, v: int) -> None:
    if path is not None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{v}\n".encode())
        finally:
            os.close(fd)


def read_values(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


class Shard(IterableDataset):
    def __init__(self, n: int, record: str | None = None) -> None:
        self.n = n
        self.record = record

    def __iter__(self):
        for v in _shard(self.n):
            _record(self.record, v)
            yield _item(v)


class StatefulShard(Shard):
    def __init__(self, n: int, record: str | None = None) -> None:
        super().__init__(n, record)
        self.pos = 0

    def __iter__(self):
        values = _shard(self.n)
        while self.pos < len(values):
            v = values[self.pos]
            self.pos += 1
            _record(self.record, v)
            yield _item(v)
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos, "big": list(range(8))}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


class StartInIterShard(IterableDataset):
    """Written for the other order (``load_state_dict`` first): the loaded position waits
    in the dataset, and ``__iter__`` builds an iterator that starts there (and takes it)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pending = 0
        self.live: _ShardIter | None = None

    def __iter__(self):
        self.live = _ShardIter(self.n)
        self.live.pos, self.pending = self.pending, 0
        return self.live

    def state_dict(self) -> dict:
        return {"pos": self.live.pos if self.live is not None else self.pending}

    def load_state_dict(self, sd: dict) -> None:
        self.pending = sd["pos"]


class StateMadeInIterShard(IterableDataset):
    """Its cursor is made by ``__iter__``: ``load_state_dict`` before the first ``iter()``
    raises (a dataset written strictly for torchdata's order)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        self.values = _shard(self.n)
        self.cursor = {"pos": 0}
        return self

    def __next__(self):
        pos = self.cursor["pos"]
        if pos >= len(self.values):
            raise StopIteration
        self.cursor["pos"] = pos + 1
        return _item(self.values[pos])

    def state_dict(self) -> dict:
        return dict(self.cursor)

    def load_state_dict(self, sd: dict) -> None:
        self.cursor["pos"] = sd["pos"]  # AttributeError before __iter__


class _ShardIter:
    def __init__(self, n: int) -> None:
        self.values = _shard(n)
        self.pos = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pos >= len(self.values):
            raise StopIteration
        v = self.values[self.pos]
        self.pos += 1
        return _item(v)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


class ResetInIterShard(_ShardIter, IterableDataset):
    """Written for torchdata's order (``iter()`` first, then ``load_state_dict``): ``__iter__``
    resets the cursor eagerly and the dataset is its own iterator."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.values: list[int] = []
        self.pos = 0

    def __iter__(self):
        self.values = _shard(self.n)  # in the worker: its own shard
        self.pos = 0
        return self


class IteratorStateShard(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return _ShardIter(self.n)


class StatefulSampler(Sampler[int]):
    """Shuffles with its own seed per epoch; its state is (epoch, position)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n = n
        self.seed = seed
        self.epoch = 0
        self.pos = 0
        self.state_dict_calls = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        while self.pos < self.n:
            i = order[self.pos]
            self.pos += 1
            yield i
        self.pos = 0
        self.epoch += 1

    def state_dict(self) -> dict:
        self.state_dict_calls += 1
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch = sd["epoch"]
        self.pos = sd["pos"]


class NoStateSampler(Sampler[int]):
    """Odd indices then even ones: custom, deterministic, no state methods."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        yield from range(1, self.n, 2)
        yield from range(0, self.n, 2)


class PosState:
    """state_dict()/load_state_dict() of a cursor kept in ``self.pos``."""

    pos: int

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


class SeqSamplerWithState(PosState, torch.utils.data.Sampler[int]):
    """0..n-1 in order; its state is the position (a user sampler with state_dict)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            yield self.pos - 1
        self.pos = 0
