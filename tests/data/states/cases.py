"""The datasets, samplers and loader builders of the saved-state corpus (``*.state``/``*.json``).

Shared by ``make_states.py``, which wrote the corpus, and ``tests/state/test_saved_states.py``,
which loads it. Both import this file as the top-level module ``cases`` (each puts this folder on
``sys.path``), and nothing here may be renamed or moved: a state records the qualified names of its
dataset's class, of a user sampler's class (``module.qualname``) and of a batch sampler passed in,
so a renamed class would make the saved states refer to data this code no longer builds -- which is
a different failure from the one the corpus is there to catch.

Every item is a pure function of its index (and, for ``Jitter``, of the RNG seeds the loader
sets), so a batch recorded at one commit can be compared with one produced at another.
Builders use only the public API, as a user's script would.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, Sampler, get_worker_info

from resumable_loader import DataLoader, Mixture


# ---- datasets ----------------------------------------------------------------------------------
class Squares(Dataset):
    """Map-style; item i is ``[base + i, i * i]``."""

    def __init__(self, n: int, base: int = 0) -> None:
        self.n = n
        self.base = base

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.tensor([self.base + i, i * i])


class Jitter(Dataset):
    """Map-style with a random augmentation: item i is ``[i, python, numpy, torch draws]``, so
    a resume that seeds any of the three RNGs differently changes the recorded values."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.tensor(
            [
                i,
                random.randint(0, 10**6),
                int(np.random.randint(0, 10**6)),
                int(torch.randint(0, 10**6, ())),
            ]
        )


class CursorStream(IterableDataset):
    """A stream with ``state_dict``/``load_state_dict``: worker k of W yields ``[v, v * v]`` for
    v = k, k + W, ... < n; its state is the cursor into that shard. It rewinds when its shard
    ends, as many streams do, so the next epoch starts the shard again."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0

    def _shard(self) -> list[int]:
        info = get_worker_info()
        k, w = (0, 1) if info is None else (info.id, info.num_workers)
        return list(range(k, self.n, w))

    def __iter__(self):
        values = self._shard()
        while self.pos < len(values):
            v = values[self.pos]
            self.pos += 1
            yield torch.tensor([v, v * v])
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


class CursorSampler(Sampler[int]):
    """A user sampler with its own state (epoch, position): a fresh seeded order per epoch."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self.epoch = 0
        self.pos = 0

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
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch = sd["epoch"]
        self.pos = sd["pos"]


# ---- builders ----------------------------------------------------------------------------------
def _gen(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


def _workers(num_workers: int) -> dict[str, Any]:
    # fork: workers start in milliseconds, which keeps the test fast.
    return {"num_workers": num_workers, "multiprocessing_context": "fork" if num_workers else None}


def map_loader(
    n: int,
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int | None = None,
    drop_last: bool = False,
    num_workers: int = 0,
    jitter: bool = False,
    seed_per_sample: bool = False,
) -> DataLoader:
    ds = Jitter(n) if jitter else Squares(n)
    return DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=shuffle,
        generator=_gen(seed),
        drop_last=drop_last,
        seed_per_sample=seed_per_sample,
        **_workers(num_workers),
    )


def dist_loader(n: int, batch_size: int, *, world: int, rank: int, seed: int) -> DataLoader:
    ds = Squares(n)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    return DataLoader(ds, batch_size=batch_size, sampler=sampler)


def rebuilt_loader(n: int, batch_size: int, *, seed: int) -> DataLoader:
    """What accelerate's prepare() does: a second loader over the first one's batch sampler
    (our ``BatchSampler`` over our ``RandomSampler``); the state's config records its class."""
    first = DataLoader(Squares(n), batch_size=batch_size, shuffle=True, generator=_gen(seed))
    return DataLoader(first.dataset, batch_sampler=first.batch_sampler)


def mixture_loader(
    sources: dict[str, list[int]],
    weights: dict[str, float],
    batch_size: int,
    *,
    mix_seed: int,
    shuffle: bool,
    seed: int | None = None,
) -> DataLoader:
    """``sources``: name -> [length, base]. Each source's values start at its own base, so a
    batch says which source it read (named in the args, not taken from the dict's order)."""
    datasets = {name: Squares(n, base=base) for name, (n, base) in sources.items()}
    return DataLoader(
        Mixture(datasets, weights, seed=mix_seed),
        batch_size=batch_size,
        shuffle=shuffle,
        generator=_gen(seed),
    )


def stream_loader(n: int, batch_size: int, *, num_workers: int) -> DataLoader:
    return DataLoader(CursorStream(n), batch_size=batch_size, **_workers(num_workers))


def sampler_loader(n: int, batch_size: int, *, seed: int) -> DataLoader:
    return DataLoader(Squares(n), batch_size=batch_size, sampler=CursorSampler(n, seed))


BUILDERS = {
    "map": map_loader,
    "dist": dist_loader,
    "rebuilt": rebuilt_loader,
    "mixture": mixture_loader,
    "stream": stream_loader,
    "sampler": sampler_loader,
}


def build(builder: str, args: dict[str, Any]) -> DataLoader:
    return BUILDERS[builder](**args)


def start_pass(loader: DataLoader, epoch: int | None) -> None:
    """Before an epoch's ``iter()``: what a training script does with a ``DistributedSampler``
    (``set_epoch``); ``None`` where the loader moves on by itself."""
    if epoch is not None:
        loader.sampler.set_epoch(epoch)


def plain(batch: Any) -> Any:
    """A batch as json data: every dataset here yields one tensor per item."""
    return batch.tolist()
