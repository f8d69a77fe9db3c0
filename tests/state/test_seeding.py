"""Seeding (``_seeding``): every seed is derived from the base seed, pinned across releases,
and python/numpy/torch are seeded before anything user code draws -- ``iter(dataset)`` too."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

from resumable_loader import DataLoader
from resumable_loader.state.seeds import TASK, derive_seed


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


def _reference_seeding(seed: int) -> tuple[object, object, bytes]:
    """What seeding the three RNGs for a task must leave, by the official calls alone: the
    python and numpy states of ``random.seed``/``np.random.seed``, and torch's state of
    ``manual_seed`` with the caller's ``initial_seed()`` kept in its seed field."""
    import struct

    import numpy as np

    reported = torch.initial_seed()
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    gen = torch.Generator()
    gen.manual_seed(seed)
    state = bytearray(gen.get_state().numpy().tobytes())
    state[:8] = struct.pack("<Q", reported)
    return random.getstate(), np.random.get_state(legacy=False), bytes(state)


@pytest.mark.parametrize("seed", [0, 1, 2**32 + 5, 2**63 - 1])
def test_task_seeding_leaves_the_states_the_official_calls_leave(seed: int) -> None:
    # seed_global_rngs takes shortcuts (the C seeding under random.seed, the seed field written
    # in place): the three states must be exactly those of the plain calls, whatever the
    # caller's own initial seed (one above 2**63 included) and cached gaussians.
    import numpy as np

    from resumable_loader.state.seeds import seed_global_rngs

    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        for callers_seed in (7, 2**64 - 3):
            torch.manual_seed(callers_seed)
            random.gauss(0.0, 1.0)  # a cached gaussian in python's state
            np.random.randn()  # ... and in numpy's
            want = _reference_seeding(seed)
            torch.manual_seed(callers_seed)
            random.gauss(0.0, 1.0)
            np.random.randn()
            seed_global_rngs(seed)
            assert random.getstate() == want[0]
            got_np = np.random.get_state(legacy=False)
            assert got_np["state"]["pos"] == want[1]["state"]["pos"]
            assert (got_np["state"]["key"] == want[1]["state"]["key"]).all()
            assert (got_np["has_gauss"], got_np["gauss"]) == (want[1]["has_gauss"], 0.0)
            assert torch.get_rng_state().numpy().tobytes() == want[2]
            assert torch.initial_seed() == callers_seed
            assert random.random() == random.Random(seed).random()
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


class DrawsNoNumpy(torch.utils.data.Dataset):
    """Draws from python's and torch's RNGs only: a fetch that leaves numpy's state as seeded."""

    def __len__(self) -> int:
        return 9

    def __getitem__(self, i: int) -> list[float]:
        return [random.random(), random.gauss(0.0, 1.0), float(torch.rand(()))]


@pytest.mark.parametrize("caller_draws", [False, True], ids=["caller-idle", "caller-draws"])
def test_a_fetch_that_draws_nothing_from_numpy_leaves_the_callers_cached_gaussian(
    caller_draws: bool,
) -> None:
    # A fetch that leaves numpy as seeded skips clearing numpy's gaussian cache: the caller's
    # own cached gaussian (and its stream) must still come back exactly.
    import numpy as np

    def run(load: bool) -> list[float]:
        random.seed(5)
        np.random.seed(6)
        torch.manual_seed(7)
        np.random.randn()  # a cached gaussian in the caller's numpy state
        loader = DataLoader(DrawsNoNumpy(), batch_size=3, generator=torch.Generator())
        mine: list[float] = []
        for _ in loader if load else range(len(loader)):
            if caller_draws:
                mine += _caller_draws(np)
        return mine + _caller_draws(np)

    assert run(load=True) == run(load=False), "loading batches moved the caller's RNGs"


def test_seeds_of_derives_what_derive_seed_derives() -> None:
    # The per-epoch shortcut hashes the fixed part once: the seeds must be derive_seed's, to
    # the bit (the derivation is pinned: test_seed_derivation_is_pinned).
    from resumable_loader.state.seeds import STREAM, seeds_of

    for base in (0, 12345, 2**63 - 1):
        task, fetch = seeds_of(TASK, base), seeds_of(STREAM, base, 0)
        for i in (0, 1, 17, 2**40, -1):
            assert task(i) == derive_seed(TASK, base, i)
            assert fetch(i) == derive_seed(STREAM, base, 0, i)
    assert seeds_of(TASK, 0, 0)(0) == 2728742965430448696
