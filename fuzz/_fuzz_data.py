"""Picklable datasets and samplers for the loader fuzzers (fuzz/) and the soak script.

Everything is defined at module level so it pickles by reference under fork, spawn and
forkserver (a spawned worker imports this module by name: pytest puts fuzz/ on ``sys.path``,
and multiprocessing hands ``sys.path`` to its children). The classes are copies in spirit of
tests/_datasets.py and tests/_streams.py, kept here so the fuzzers do not move when those test
helpers change.

Every item is a pure function of its value and of the global RNGs (python, numpy, torch) that
the loader seeds per task: comparing two runs batch for batch also checks the seeding.

Faults armed at run time (``arm``): a file ``t-<value>`` in ``arm_dir`` makes the next fetch of
that sample raise ``OSError`` (a transient error, for a ``RetryPolicy``); a file ``x-<value>``
makes the next worker process that fetches it call ``os._exit(3)``. The file is removed by the
fetch that fires it (``unlink`` succeeds in exactly one process), so each armed fault fires
once, whichever worker -- or respawned worker -- gets there first. Without an ``arm_dir``
(reference loaders) nothing is ever checked.

Datasets:
    ``MapData(n, arm_dir=None)``              map-style; item i is ``item(i)``.
    ``DatasetStateStream(n, arm_dir=None)``   stream, state on the dataset (a cursor that
                                              rewinds when the iterator ends, as many do).
    ``IteratorStateStream(n, arm_dir=None)``  stream, state on the iterator object.
    ``PlainStream(n, arm_dir=None)``          stream without state (fast-forwarded on resume).
    Streams are sharded unevenly: worker k of W yields k, k+W, ... < n + 3k, so workers end at
    different times. Their iterators are classes, not generators, so a ``RetryPolicy`` applies
    to their ``next()``; a fetch that raises leaves the cursor where it was.

Samplers:
    ``StatefulSampler(n, seed)``       shuffles per epoch with its own seed; state (epoch, pos).
    ``NoStateSampler(n)``              odd indices, then even ones; no state (fast-forwarded).
    ``VariableBatchSampler(n, sizes)`` consecutive batches whose sizes cycle through ``sizes``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

__all__ = [
    "DatasetStateStream",
    "IteratorStateStream",
    "MapData",
    "NoStateSampler",
    "PlainStream",
    "StatefulSampler",
    "VariableBatchSampler",
    "arm",
    "item",
]


def item(v: int) -> torch.Tensor:
    """The item of value ``v``: the value and one draw from each global RNG."""
    return torch.tensor(
        [
            v,
            random.randint(0, 10**6),
            int(np.random.randint(0, 10**6)),
            int(torch.randint(0, 10**6, ())),
        ]
    )


def arm(arm_dir: str, kind: str, value: int) -> None:
    """Arm a one-shot fault on the next fetch of ``value``: kind "transient" or "exit"."""
    prefix = {"transient": "t", "exit": "x"}[kind]
    fd = os.open(os.path.join(arm_dir, f"{prefix}-{value}"), os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)


def _fire(arm_dir: str | None, value: int) -> None:
    if arm_dir is None:
        return
    if get_worker_info() is not None:
        try:
            os.unlink(os.path.join(arm_dir, f"x-{value}"))
        except FileNotFoundError:
            pass
        else:
            os._exit(3)
    try:
        os.unlink(os.path.join(arm_dir, f"t-{value}"))
    except FileNotFoundError:
        return
    raise OSError(f"armed transient error on sample {value}")


class MapData(Dataset):
    def __init__(self, n: int, arm_dir: str | None = None) -> None:
        self.n = n
        self.arm_dir = arm_dir

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        _fire(self.arm_dir, i)
        return item(i)


def shard(n: int) -> list[int]:
    """The values the calling worker owns (uneven: worker k ends at n + 3k)."""
    info = get_worker_info()
    w, nw = (info.id, info.num_workers) if info is not None else (0, 1)
    return list(range(w, n + 3 * w, nw))


class _StreamIter:
    """Cursor over this worker's shard; the cursor lives in ``self.owner`` (dataset or self)."""

    def __init__(self, owner: Any, n: int, arm_dir: str | None) -> None:
        self.owner = owner if owner is not None else self
        self.values = shard(n)
        self.arm_dir = arm_dir
        self.done = False
        if owner is None:
            self.pos = 0

    def __iter__(self) -> _StreamIter:
        return self

    def __next__(self) -> torch.Tensor:
        owner = self.owner
        if self.done or owner.pos >= len(self.values):
            if not self.done:
                self.done = True
                if owner is not self:
                    owner.pos = 0  # a dataset-level cursor rewinds for the next epoch
            raise StopIteration
        v = self.values[owner.pos]
        _fire(self.arm_dir, v)  # raising here leaves the cursor on v: a retry re-reads it
        owner.pos += 1
        return item(v)


class _IterWithState(_StreamIter):
    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd["pos"]


class PlainStream(IterableDataset):
    def __init__(self, n: int, arm_dir: str | None = None) -> None:
        self.n = n
        self.arm_dir = arm_dir

    def __iter__(self) -> Iterator[torch.Tensor]:
        return _StreamIter(None, self.n, self.arm_dir)


class IteratorStateStream(PlainStream):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return _IterWithState(None, self.n, self.arm_dir)


class DatasetStateStream(PlainStream):
    def __init__(self, n: int, arm_dir: str | None = None) -> None:
        super().__init__(n, arm_dir)
        self.pos = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        return _StreamIter(self, self.n, self.arm_dir)

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = sd["pos"]


class StatefulSampler(Sampler[int]):
    """Shuffles with its own seed per epoch; its state is (epoch, position)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n = n
        self.seed = seed
        self.epoch = 0
        self.pos = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        while self.pos < self.n:
            i = order[self.pos]
            self.pos += 1
            yield i
        self.pos = 0
        self.epoch += 1

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch = sd["epoch"]
        self.pos = sd["pos"]


class NoStateSampler(Sampler[int]):
    """Odd indices then even ones: custom, deterministic, no state methods."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        yield from range(1, self.n, 2)
        yield from range(0, self.n, 2)


class VariableBatchSampler(Sampler[list[int]]):
    """Consecutive index batches over range(n) whose sizes cycle through ``sizes``."""

    def __init__(self, n: int, sizes: Sequence[int] = (1, 2, 3)) -> None:
        self.n = n
        self.sizes = tuple(sizes)

    def _batches(self) -> list[list[int]]:
        out, start, k = [], 0, 0
        while start < self.n:
            size = self.sizes[k % len(self.sizes)]
            out.append(list(range(start, min(start + size, self.n))))
            start += size
            k += 1
        return out

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())
