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
