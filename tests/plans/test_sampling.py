"""Sampling (``_sampling``): how each kind of sampler is classified, positioned and resumed --
torch's own samplers by O(1) position, samplers with ``state_dict`` through their state, the
rest by fast-forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _datasets import RangeData
from _streams import SeqSamplerWithState
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from resumable_loader import DataLoader
from resumable_loader.plans.index_plan import BUILTIN, FASTFORWARD, STATEFUL, IndexPlan


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("start", [0, 3, 6])
def test_builtin_sequential_positions_match_torch_batching(drop_last: bool, start: int) -> None:
    ds = list(range(20))
    bs = BatchSampler(SequentialSampler(ds), 3, drop_last)
    plan = IndexPlan(ds, bs.sampler, bs, True)
    assert plan.kind == BUILTIN
    assert list(plan.batches(0, start)) == list(bs)[start:]


def test_builtin_random_positions_are_o1_and_consistent() -> None:
    ds = list(range(50))
    bs = BatchSampler(RandomSampler(ds), 4, False)
    plan = IndexPlan(ds, bs.sampler, bs, True)
    full = list(plan.batches(99, 0))
    assert sorted(i for b in full for i in b) == ds
    assert list(plan.batches(99, 5)) == full[5:]
    # An epoch's order is its seed's alone: another epoch (another seed) differs, and the same
    # seed repeats it, as reseeding before torch's iter() does.
    assert list(plan.batches(100, 0)) != full, "epochs must differ"
    assert list(plan.batches(99, 0)) == full


def test_sampler_kinds_are_classified() -> None:
    ds = list(range(10))

    class WithState(SequentialSampler):
        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            pass

    custom = BatchSampler([1, 2, 3], 2, False)
    assert IndexPlan(ds, custom.sampler, custom, True).kind == FASTFORWARD
    st = BatchSampler(WithState(ds), 2, False)
    assert IndexPlan(ds, st.sampler, st, True).kind == STATEFUL


# ---- stateful samplers ------------------------------------------------------------------------
class OneShotStateSampler(torch.utils.data.Sampler):
    """Yields 0..n-1 once per epoch; its state is (epoch, position), rewinding at the end."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.pos = n, 0, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            yield self.pos - 1
        self.pos, self.epoch = 0, self.epoch + 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.pos = sd["epoch"], sd["pos"]


# A regression found by the fuzzers in fuzz/.
def test_checkpoint_of_a_resumed_drawn_out_sampler_epoch_stays_drawn_out() -> None:
    # Found by KillMachine: resume a state whose sampler epoch was already drawn to the end,
    # checkpoint again before anything is drawn, resume that: the second state lost
    # sampler_done and the rewound sampler's next epoch leaked into this one.
    def make() -> DataLoader:
        return DataLoader(
            RangeData(),
            batch_size=None,
            sampler=OneShotStateSampler(1),
            num_workers=1,
            prefetch_factor=1,
            multiprocessing_context="fork",
        )

    first = make()
    with first:
        it1 = iter(first)  # kept: an iterator dropped at once would abandon its epoch
        sd = first.state_dict()
    assert sd["sampler_done"] and sd["outstanding"] == [[0, 0]]
    second = make()
    with second:
        second.load_state_dict(sd)
        it2 = iter(second)
        sd2 = second.state_dict()
    assert sd2["sampler_done"], "a resumed drawn-out epoch must stay drawn out"
    del it1, it2
    third = make()
    with third:
        third.load_state_dict(sd2)
        assert list(third) == [0]


class NumpyIndexSampler(SeqSamplerWithState):
    """A stateful sampler that yields numpy integers, as many real samplers do."""

    def __iter__(self):
        perm = np.random.RandomState(7).permutation(self.n)
        while self.pos < self.n:
            self.pos += 1
            yield perm[self.pos - 1]
        self.pos = 0


# A regression found by the fuzzers in fuzz/.
@pytest.mark.parametrize("num_workers", [0, 2])
def test_numpy_indices_from_a_sampler_make_a_plain_state(num_workers: int) -> None:
    from resumable_loader import dump_state, load_state
    from resumable_loader.testing import check_resume

    def make() -> DataLoader:
        return DataLoader(
            RangeData(),
            batch_size=1,
            sampler=NumpyIndexSampler(4),
            num_workers=num_workers,
            multiprocessing_context="fork" if num_workers else None,
        )

    loader = make()
    it = iter(loader)
    next(it)
    sd = loader.state_dict()
    loader.close()
    assert load_state(dump_state(sd)) == sd  # would raise CheckpointError on numpy.int64
    for via in ("torch", "json"):
        assert check_resume(make, via=via, epochs=1) > 0


# ---- fast-forwarded samplers that draw from the global RNG ------------------------------------
class MyRandomSampler(torch.utils.data.RandomSampler):
    """A subclass: not torch's exact type, so it is fast-forwarded."""


# A regression found by the fuzzers in fuzz/.
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["subset", "weighted", "subclass"])
def test_samplers_drawing_from_the_global_rng_resume_under_another_seed(
    kind: str, num_workers: int
) -> None:
    # They drew from torch's global RNG, which the resuming process seeds differently: the
    # fast-forward replayed another order, and samples were repeated and skipped silently.
    from resumable_loader.testing import check_resume

    def make() -> DataLoader:
        sampler = {
            "subset": lambda: torch.utils.data.SubsetRandomSampler(range(12)),
            "weighted": lambda: torch.utils.data.WeightedRandomSampler(
                [1.0] * 12, 12, replacement=False
            ),
            "subclass": lambda: MyRandomSampler(range(12)),
        }[kind]()
        return DataLoader(
            list(range(12)),
            batch_size=3,
            sampler=sampler,
            num_workers=num_workers,
            multiprocessing_context="fork" if num_workers else None,
            generator=torch.Generator().manual_seed(1),
        )

    def resumed() -> DataLoader:
        torch.manual_seed(12345)
        return make()

    torch.manual_seed(0)
    assert check_resume(make, make_resumed=resumed, epochs=2) > 0
