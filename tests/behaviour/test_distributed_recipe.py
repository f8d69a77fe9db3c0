"""The recipe of docs/distributed.md, copied as a user copies it, resumes exactly from every
state a run produces.

    start_epoch = loader.state_dict()["distributed"]["sampler_epoch"]   # after the load
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            ...

A job of W ranks runs the recipe uninterrupted and takes every rank's state at every point a
script can save: after ``set_epoch`` before the loop, after each batch (the last one of an
epoch too), and after ``StopIteration``. From each point's ``merge_rank_states``, W' new ranks
run the same recipe; what they train, added to what was trained before the save, must be the
uninterrupted run: the interrupted epoch once (on W' != W ranks, a re-cut of its rest), every
later epoch exactly the uninterrupted W'-rank run's, and no epoch that had ended trained again.
Ranks are simulated in one process (``DistributedSampler(num_replicas=W, rank=r)``), as in
``test_distributed.py``; ``examples/ddp_elastic.py`` runs the recipe on real ranks
(``test_distributed_ranks.py``).
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import pytest
from _datasets import RangeData
from torch.utils.data.distributed import DistributedSampler

from resumable_loader import CheckpointError, DataLoader, merge_rank_states
from resumable_loader.testing import roundtrip_state

N = 12  # 2 and 3 ranks cut it evenly: what is repeated is the re-cut's pad alone
BATCH = 2
EPOCHS = 3


def make(world: int, rank: int, n: int = N) -> DataLoader:
    ds = RangeData(n)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=42)
    return DataLoader(ds, batch_size=BATCH, sampler=sampler)


# The two ways the docs read the epoch to start from: distributed.md's, and the README's
# (`ckpt["loader"]["epoch"]`), which a script counting epochs from 0 may use as well.
RECIPES = {
    "sampler_epoch": lambda sd: sd["distributed"]["sampler_epoch"],
    "epoch": lambda sd: sd["epoch"],
}


def run_recipe(loader: DataLoader, start_epoch: int, on_save=None) -> list[tuple[int, list]]:
    """The docs' loop; ``(epoch, sample ids)`` per batch. ``on_save(point, trained)`` is called
    where a script may save: ``(epoch, "top")``, ``(epoch, k)`` after batch k, and
    ``(epoch, "end")``, with what was trained up to there."""
    got: list[tuple[int, list]] = []
    save = on_save or (lambda point, trained: None)
    for epoch in range(start_epoch, EPOCHS):
        loader.sampler.set_epoch(epoch)
        save((epoch, "top"), got)
        for k, batch in enumerate(loader):
            got.append((epoch, batch.tolist()))
            save((epoch, k), got)
        save((epoch, "end"), got)
    return got


def uninterrupted(
    world: int, n: int = N
) -> tuple[list[list], dict[Any, list[dict]], dict[Any, list[list]]]:
    """Each rank's batches, its state at every save point, and what it had trained there."""
    runs = []
    states: dict[Any, list[dict]] = collections.defaultdict(list)
    before: dict[Any, list[list]] = collections.defaultdict(list)
    for rank in range(world):
        loader = make(world, rank, n)

        def save(point, trained, loader=loader):
            states[point].append(roundtrip_state(loader.state_dict(), "torch"))
            before[point].append(list(trained))

        runs.append(run_recipe(loader, 0, save))
    return runs, states, before


def by_epoch(batches: list[tuple[int, list]]) -> dict[int, list[list]]:
    out: dict[int, list[list]] = collections.defaultdict(list)
    for epoch, ids in batches:
        out[epoch].append(ids)
    return out


PAIRS = [(2, 2), (2, 3), (3, 2)]


# 13 samples: torch pads each rank's share, and the last batch is short.
@pytest.mark.parametrize("n", [N, 13], ids=["even", "padded"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize(("before", "after"), PAIRS, ids=[f"{a}to{b}" for a, b in PAIRS])
def test_the_recipe_resumes_every_state_of_a_run_exactly(before, after, recipe, n) -> None:
    runs, states, trained = uninterrupted(before, n)
    reference = [by_epoch(r) for r in uninterrupted(after, n)[0]]
    steps = len(make(before, 0, n))
    assert len(states) == EPOCHS * (2 + steps)  # every point, every epoch
    for point, rank_states in states.items():
        merged = roundtrip_state(merge_rank_states(rank_states), "json")
        done = [by_epoch(t) for t in trained[point]]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "resuming on", RuntimeWarning)
            resumed = []
            for rank in range(after):
                loader = make(after, rank, n)
                loader.load_state_dict(merged)
                start_epoch = RECIPES[recipe](loader.state_dict())
                resumed.append(by_epoch(run_recipe(loader, start_epoch)))
        epoch = point[0]
        ended = point[1] == "end" or point[1] == steps - 1
        for e in range(EPOCHS):
            if e < epoch or (e == epoch and ended):
                # Trained to its end before the save: not one batch of it again.
                assert all(e not in r for r in resumed), (point, e)
            elif e > epoch:
                assert [r[e] for r in resumed] == [r[e] for r in reference], (point, e)
        if ended:
            continue
        # The interrupted epoch: its rest, on the new ranks.
        first = [ids for r in done for b in r.get(epoch, []) for ids in b]
        rest = [ids for r in resumed for b in r.get(epoch, []) for ids in b]
        if before == after:
            whole = [by_epoch(r)[epoch] for r in runs]
            assert [d.get(epoch, []) + r.get(epoch, []) for d, r in zip(done, resumed)] == whole
        else:
            counts = collections.Counter(first + rest)
            # Mid-epoch nothing of torch's own padding (each share's last sample) was taken:
            # what repeats is the re-cut's pad, as torch pads an epoch.
            pad = -(n - len(first)) % after
            assert set(counts) == set(range(n)), point
            assert sum(counts.values()) == n + pad, point
            assert len({len(r.get(epoch, [])) for r in resumed}) == 1  # equal steps: no hang


def test_a_state_after_an_epochs_end_says_the_next_epoch_in_both_fields() -> None:
    # As in the issue (2 ranks, batch 2, shuffle, seed 42): saved right after the last batch of
    # epoch 0, after StopIteration, and after set_epoch(1). Both fields name epoch 1, the one
    # to train next.
    _, states, _ = uninterrupted(2)
    for point in [(0, N // 2 // BATCH - 1), (0, "end"), (1, "top")]:
        for sd in states[point]:
            assert (sd["epoch"], sd["distributed"]["sampler_epoch"]) == (1, 1), point


def test_a_script_that_never_calls_set_epoch_resumes_as_it_ran() -> None:
    # Without set_epoch() torch's sampler repeats epoch 0's order: a resume after an epoch's
    # end must go on repeating it (the loader puts the sampler's own epoch back).
    ref = make(2, 1)
    reference = [[b.tolist() for b in ref] for _ in range(2)]
    first = make(2, 1)
    assert [b.tolist() for b in first] == reference[0]
    sd = roundtrip_state(first.state_dict(), "json")
    again = make(2, 1)
    again.load_state_dict(sd)
    assert [b.tolist() for b in again] == reference[1]


def as_written_before_ended(sd: dict) -> dict:
    """The state as the releases before ``distributed.ended`` wrote it: between two epochs,
    the sampler's own epoch (right after an epoch's end, the one that ended), and no ``ended``."""
    old = dict(sd, distributed=dict(sd["distributed"]))
    if old["distributed"].pop("ended", False):
        old["distributed"]["sampler_epoch"] -= 1
    return old


@pytest.mark.filterwarnings("ignore:resuming on:RuntimeWarning")
@pytest.mark.parametrize(("before", "after"), [(2, 2), (2, 3)], ids=["2to2", "2to3"])
def test_a_state_written_before_ended_still_resumes_by_the_recipe(before, after) -> None:
    _, states, _ = uninterrupted(before)
    reference = [by_epoch(r) for r in uninterrupted(after)[0]]
    last = N // before // BATCH - 1
    for point in [(0, last), (0, "end"), (1, "top"), (1, 0)]:
        old = [as_written_before_ended(sd) for sd in states[point]]
        resumed = []
        for rank in range(after):
            loader = make(after, rank)
            loader.load_state_dict(old[rank] if before == after else merge_rank_states(old))
            start_epoch = loader.state_dict()["distributed"]["sampler_epoch"]
            resumed.append(by_epoch(run_recipe(loader, start_epoch)))
        assert all(0 not in r for r in resumed), point
        assert [r[2] for r in resumed] == [r[2] for r in reference], point


def test_ended_inside_an_epoch_is_refused_as_damaged() -> None:
    _, states, _ = uninterrupted(2)
    sd = dict(states[(0, 0)][0])
    sd["distributed"] = dict(sd["distributed"], ended=True)
    with pytest.raises(CheckpointError, match=r"distributed\.ended.*damaged"):
        make(2, 0).load_state_dict(sd)
