"""Seeding (``_seeding``): every seed is derived from the base seed, pinned across releases,
and python/numpy/torch are seeded before anything user code draws -- ``iter(dataset)`` too."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

from resumable_loader import DataLoader
from resumable_loader._seeding import TASK, derive_seed


def test_seed_derivation_is_pinned() -> None:
    # Checkpoints written today must resume identically with every future release: if this
    # changes, old states would silently produce other batches. Bump the state version instead.
    assert derive_seed(TASK, 0, 0, 0) == 2728742965430448696
    assert derive_seed(TASK, 12345, 3, 17) == 6700708199653777483
    assert derive_seed(TASK, 12345, 3, 17) != derive_seed(TASK, 12345, 3, 18)


class ShuffledAtIter(IterableDataset):
    """A plain stream that shuffles its shard when iter() is called (python's global RNG)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        order = list(range(wid, self.n, nw))
        random.shuffle(order)  # drawn in iter(), before the first fetch
        return iter(order)


# A regression found by the fuzzers in fuzz/.
@pytest.mark.parametrize("num_workers", [0, 2])
def test_randomness_drawn_in_iter_is_the_same_after_a_resume(num_workers: int) -> None:
    # iter(dataset) ran before the per-fetch seeding, under whatever the RNGs held: a resumed
    # worker shuffled its shard differently from the uninterrupted run.
    from resumable_loader.testing import check_resume

    def make() -> DataLoader:
        return DataLoader(
            ShuffledAtIter(10),
            batch_size=2,
            num_workers=num_workers,
            multiprocessing_context="fork" if num_workers else None,
            persistent_workers=bool(num_workers),
            generator=torch.Generator().manual_seed(3),
        )

    def resumed() -> DataLoader:
        random.seed(999)  # another global state in the resuming process
        torch.manual_seed(999)
        return make()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fast-forward notice
        assert check_resume(make, make_resumed=resumed, epochs=2) > 0


class DrawsEverywhere(torch.utils.data.Dataset):
    """Each item draws from python's, numpy's and torch's global RNGs -- gaussians included, so
    that a cached gaussian (python's gauss_next, numpy's has_gauss) is left behind."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> list[float]:
        import numpy as np

        return [
            random.random(),
            random.gauss(0.0, 1.0),
            float(np.random.rand()),
            float(np.random.randn()),
            float(torch.rand(())),
        ]


def _caller_draws(np) -> list[float]:
    import numpy as np

    return [
        random.random(),
        random.gauss(0.0, 1.0),
        float(np.random.rand()),
        float(np.random.randn()),  # odd: leaves a cached gaussian for the next call
        float(torch.rand(())),
    ]


@pytest.mark.parametrize("cached", [False, True], ids=["no-cached-gauss", "cached-gauss"])
@pytest.mark.parametrize("caller_draws", [False, True], ids=["caller-idle", "caller-draws"])
def test_single_process_fetches_leave_the_callers_rng_streams_untouched(
    caller_draws: bool, cached: bool
) -> None:
    # The caller's python, numpy and torch streams, cached gaussians included, go on as if no
    # batch had been loaded, whether or not the caller draws between batches; and the batches
    # are the ones the workers load (each seeded from its task alone).
    import numpy as np

    def run(load: bool, num_workers: int = 0) -> tuple[list[float], list]:
        random.seed(5)
        np.random.seed(6)
        torch.manual_seed(7)
        if cached:
            random.gauss(0.0, 1.0)  # a cached gaussian in python's and in numpy's state
            np.random.randn()
        loader = DataLoader(
            DrawsEverywhere(),
            batch_size=3,  # an odd number of gaussians per batch: one is left cached
            num_workers=num_workers,
            multiprocessing_context="fork" if num_workers else None,
            generator=torch.Generator().manual_seed(1),
        )
        mine: list[float] = []
        batches = []
        if load:
            for batch in loader:
                batches.append([[float(x) for x in col] for col in batch])
                if caller_draws:
                    mine += _caller_draws(np)
        else:
            for _ in range(len(loader)):
                if caller_draws:
                    mine += _caller_draws(np)
        mine += _caller_draws(np)
        return mine, batches

    untouched, _ = run(load=False)
    mine, batches = run(load=True)
    assert mine == untouched, "loading batches in this process moved the caller's RNGs"
    _, in_workers = run(load=True, num_workers=2)
    assert batches == in_workers, "a batch loaded in-process differs from a worker's"
