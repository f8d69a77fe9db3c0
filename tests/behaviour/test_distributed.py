"""torch's DistributedSampler: the same shards as torch, exact resume per rank, and a job's
state re-cut for another number of ranks -- every sample of the interrupted epoch delivered
exactly once over all ranks.

Ranks are simulated in one process here (a DistributedSampler takes ``num_replicas`` and
``rank`` without a process group): the arithmetic is the subject. Real ranks under a gloo
process group, with torch.distributed.checkpoint, are in ``test_distributed_ranks.py``.
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from _datasets import RandomAugDataset, RangeDataset
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data.distributed import DistributedSampler

from resumable_loader import CheckpointError, DataLoader, merge_rank_states
from resumable_loader.testing import roundtrip_state

N = 23  # not a multiple of any world size used: padding and trimming both happen
BS = 2


def make(world: int, rank: int, *, drop_last: bool = False, nw: int = 0, shuffle: bool = True):
    ds = RangeDataset(N)
    sampler = DistributedSampler(
        ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last
    )
    return DataLoader(ds, batch_size=BS, sampler=sampler, num_workers=nw)


def ids(batch) -> list[int]:
    return [int(i) for i in batch["idx"].flatten().tolist()]


def epoch_of(loader, epoch: int) -> list[list[int]]:
    loader.sampler.set_epoch(epoch)
    return [ids(b) for b in loader]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_rank_gets_torchs_shard(world: int, drop_last: bool) -> None:
    for rank in range(world):
        ours = make(world, rank, drop_last=drop_last)
        ds = RangeDataset(N)
        theirs = TorchDataLoader(
            ds,
            batch_size=BS,
            sampler=DistributedSampler(
                ds, num_replicas=world, rank=rank, shuffle=True, seed=7, drop_last=drop_last
            ),
        )
        for epoch in (0, 3):
            theirs.sampler.set_epoch(epoch)
            assert epoch_of(ours, epoch) == [ids(b) for b in theirs]
            assert len(ours) == len(theirs)


@pytest.mark.parametrize("nw", [0, 2])
def test_same_world_size_resumes_each_rank_exactly(nw: int) -> None:
    world = 3
    for rank in range(world):
        ref = make(world, rank, nw=nw)
        reference = [epoch_of(ref, e) for e in (0, 1)]
        for stop in range(len(reference[0]) + 1):
            first = make(world, rank, nw=nw)
            first.sampler.set_epoch(0)
            it = iter(first)
            got = [ids(next(it)) for _ in range(stop)]
            sd = roundtrip_state(first.state_dict(), "json")
            del it
            first.close()
            again = make(world, rank, nw=nw)
            again.load_state_dict(sd)
            if sd["epoch"] == 0:  # else the epoch was delivered to its end: the next one
                got += [ids(b) for b in again]  # the loader set the sampler's saved epoch
            assert got == reference[0], f"rank {rank}, stop {stop}"
            assert epoch_of(again, 1) == reference[1]
            again.close()


def test_values_resume_exactly_without_the_global_rng() -> None:
    # An epoch's seed under a DistributedSampler comes from the sampler's seed and epoch and
    # the rank: a resumed rank draws the same augmentations whatever its global RNG says.
    def loader() -> DataLoader:
        ds = RandomAugDataset(N)
        return DataLoader(ds, batch_size=BS, sampler=DistributedSampler(ds, 2, 1, seed=3))

    def canon(b) -> list:
        return [b[k].tolist() for k in sorted(b)]

    ref = loader()
    reference = [canon(b) for b in ref]
    first = loader()
    it = iter(first)
    got = [canon(next(it)) for _ in range(3)]
    sd = first.state_dict()
    del it
    torch.manual_seed(12345)
    again = loader()
    again.load_state_dict(sd)
    assert got + [canon(b) for b in again] == reference


def run_ranks(world: int, steps: list[int], epoch: int, *, drop_last: bool = False):
    """Each rank of a ``world``-rank job consumes ``steps[r]`` batches of ``epoch``; returns
    what each consumed and each rank's state."""
    consumed, states = [], []
    for rank in range(world):
        loader = make(world, rank, drop_last=drop_last)
        loader.sampler.set_epoch(epoch)
        it = iter(loader)
        consumed.append([i for _ in range(steps[rank]) for i in ids(next(it))])
        states.append(roundtrip_state(loader.state_dict(), "torch"))
        del it
        loader.close()
    return consumed, states


def finish_ranks(world: int, state: dict, *, drop_last: bool = False):
    """Each rank of a ``world``-rank job loads ``state`` and runs the rest of the epoch."""
    out = []
    for rank in range(world):
        loader = make(world, rank, drop_last=drop_last)
        loader.load_state_dict(state)
        out.append([ids(b) for b in loader])
    return out


def epoch_samples(epoch: int, *, drop_last: bool = False) -> list[int]:
    """The epoch's samples as the uninterrupted run's ranks cut them, padding excluded."""
    order = torch.randperm(N, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
    return order


ELASTIC = [(4, 2), (2, 3), (3, 2), (4, 1), (1, 4), (3, 3)]


@pytest.mark.parametrize(("before", "after"), ELASTIC, ids=[f"{a}to{b}" for a, b in ELASTIC])
@pytest.mark.parametrize("skew", [0, 1], ids=["in-step", "one-rank-ahead"])
def test_another_world_size_continues_the_epoch_exactly_once(before, after, skew) -> None:
    steps = [2] * before
    steps[0] += skew  # rank 0 took one batch more when the state was saved
    taken, states = run_ranks(before, steps, epoch=1)
    merged = roundtrip_state(merge_rank_states(states), "json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest = finish_ranks(after, merged)
    if before != after:
        # The new ranks take equal numbers of batches (DDP would hang otherwise). On the same
        # world size each rank continues its own shard: a rank that was ahead has one less.
        assert len({len(r) for r in rest}) == 1
    delivered = collections.Counter(
        [i for r in taken for i in r] + [i for r in rest for b in r for i in b]
    )
    # Every sample of the epoch at least once; repeated only as torch pads an epoch's last
    # step: the remainder, padded to a multiple of the new world size -- and said so.
    assert set(delivered) == set(epoch_samples(1))
    left = N - sum(len(t) for t in taken)
    pad = -left % after if before != after else -N % before  # a re-cut's, or torch's own
    assert sum(delivered.values()) - N == pad
    assert max(delivered.values()) <= 2
    said = [str(w.message) for w in caught if "samples of the epoch are left" in str(w.message)]
    # On the same world size the pad is torch's own, made by each rank's own shard: no re-cut.
    assert bool(said) == bool(pad and before != after)
    if said:
        assert f"{pad} of them are repeated" in said[0]
        # The epoch's account is the run's: every sample delivered, the padding twice.
        twice = sum(delivered.values()) - len(delivered)
        assert f"{len(delivered)} of the epoch's {N} samples are delivered, {twice} of" in said[0]


def test_an_exact_division_repeats_and_skips_nothing() -> None:
    # 4 ranks x 2 batches x 2 = 16 taken, 7 left: on 7 ranks, one each, nothing padded.
    taken, states = run_ranks(4, [2, 2, 2, 2], epoch=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        rest = finish_ranks(7, merge_rank_states(states))
    got = [i for r in taken for i in r] + [i for r in rest for b in r for i in b]
    assert sorted(got) == list(range(N)) and len(got) == N
    # And the consumed set was a prefix of the epoch's order.
    assert sorted(i for r in taken for i in r) == sorted(epoch_samples(0)[:16])


def test_the_next_epoch_on_the_new_world_size_is_torchs() -> None:
    _, states = run_ranks(3, [4, 4, 4], epoch=0)
    merged = merge_rank_states(states)
    for rank in range(2):
        loader = make(2, rank)
        loader.load_state_dict(merged)
        list(loader)
        assert epoch_of(loader, 1) == epoch_of(make(2, rank), 1)


@pytest.mark.filterwarnings("ignore:resuming on:RuntimeWarning")
def test_two_resizes_in_one_epoch_compose() -> None:
    taken1, states = run_ranks(4, [1, 1, 1, 1], epoch=0)
    merged = merge_rank_states(states)
    taken2, states2 = [], []
    for rank in range(3):
        loader = make(3, rank)
        loader.load_state_dict(merged)
        it = iter(loader)
        taken2.append([i for _ in range(1) for i in ids(next(it))])
        states2.append(loader.state_dict())
        del it
    rest = finish_ranks(2, merge_rank_states(states2))
    got = [i for r in taken1 + taken2 for i in r] + [i for r in rest for b in r for i in b]
    assert set(got) == set(range(N))
    assert len(got) - N < 2  # at most the last step's padding on 2 ranks


def test_a_state_saved_at_the_epochs_end_starts_the_next_epoch() -> None:
    _, states = run_ranks(2, [6, 6], epoch=0)  # 23 -> 12 per rank -> 6 batches: all of it
    assert all(sd["epoch"] == 1 for sd in states)
    merged = merge_rank_states(states)
    for rank in range(3):
        loader = make(3, rank)
        loader.load_state_dict(merged)
        # The recipe of docs/distributed.md, not a set_epoch(1) of the test's own knowing.
        start_epoch = loader.state_dict()["distributed"]["sampler_epoch"]
        assert start_epoch == 1
        loader.sampler.set_epoch(start_epoch)
        assert [ids(b) for b in loader] == epoch_of(make(3, rank), 1)


def test_set_epoch_to_another_epoch_before_a_mid_epoch_resume_is_refused() -> None:
    _, states = run_ranks(2, [2, 2], epoch=4)
    loader = make(2, 0)
    loader.load_state_dict(states[0])
    loader.sampler.set_epoch(5)
    with pytest.raises(CheckpointError, match=r"set_epoch\(5\).*sampler.set_epoch\(4\)"):
        iter(loader)
    loader.sampler.set_epoch(4)
    assert len(list(loader)) == 6 - 2


def test_a_ranks_own_state_on_another_world_size_is_refused_with_the_fix() -> None:
    _, states = run_ranks(2, [1, 1], epoch=0)
    with pytest.raises(CheckpointError, match="merge_rank_states"):
        make(3, 0).load_state_dict(states[0])
    with pytest.raises(CheckpointError, match=r"config\.rank"):
        make(2, 1).load_state_dict(states[0])


def test_unordered_states_resize_is_refused_same_size_is_exact() -> None:
    # As an in_order=False loader saves it: batch 3 delivered before batch 2.
    _, states = run_ranks(2, [2, 2], epoch=0)
    states[0]["delivered_ahead"] = [3]
    merged = merge_rank_states(states)
    with pytest.raises(CheckpointError, match="in_order=False"):
        make(3, 0).load_state_dict(merged)
    same = make(2, 0)
    same.load_state_dict(merged)
    whole = epoch_of(make(2, 0), 0)
    assert [ids(b) for b in same] == [whole[2], *whole[4:]]


def test_merge_rank_states_names_a_misplaced_state() -> None:
    _, states = run_ranks(2, [1, 1], epoch=0)
    with pytest.raises(CheckpointError, match="entry 0 should be the state of rank 0 of 2"):
        merge_rank_states([states[1], states[0]])


def test_other_samplers_resume_only_on_the_same_world_size() -> None:
    loader = DataLoader(RangeDataset(N), batch_size=BS, shuffle=True)
    sd = loader.state_dict()
    merged = merge_rank_states([sd])
    again = DataLoader(RangeDataset(N), batch_size=BS, shuffle=True)
    again.load_state_dict(merged)  # one rank -> one rank: its own state
    sd2 = dict(sd, config=dict(sd["config"], world_size=2, rank=0))
    sd3 = dict(sd, config=dict(sd["config"], world_size=2, rank=1))
    with pytest.raises(CheckpointError, match="Only torch's DistributedSampler"):
        again.load_state_dict(merge_rank_states([sd2, sd3]))


# ---- seed_per_sample ---------------------------------------------------------------------------
def aug_values(batches) -> dict[int, tuple]:
    out = {}
    for b in batches:
        for k, i in enumerate(b["idx"].tolist()):
            out[i] = (b["py"][k].item(), b["np"][k].item(), b["torch"][k].item())
    return out


def aug_loader(world: int, rank: int, *, bs: int = BS, nw: int = 0, per_sample: bool = True):
    ds = RandomAugDataset(N)
    return DataLoader(
        ds,
        batch_size=bs,
        sampler=DistributedSampler(ds, num_replicas=world, rank=rank, seed=7),
        num_workers=nw,
        seed_per_sample=per_sample,
        multiprocessing_context="fork" if nw else None,
    )


def test_seed_per_sample_values_depend_only_on_the_sample() -> None:
    # Whatever the world size, workers and batch size, sample i gets the same augmentation.
    def values(world: int, bs: int, nw: int, per_sample: bool = True) -> dict[int, tuple]:
        got: dict[int, tuple] = {}
        for rank in range(world):
            loader = aug_loader(world, rank, bs=bs, nw=nw, per_sample=per_sample)
            loader.sampler.set_epoch(2)
            got.update(aug_values(loader))
        return got

    reference = values(1, 2, 0)
    assert values(3, 5, 2) == reference
    assert values(2, 1, 0) == reference
    assert values(2, 4, 0, per_sample=False) != reference  # without it: per batch


@pytest.mark.filterwarnings("ignore:resuming on:RuntimeWarning")
def test_seed_per_sample_values_survive_a_resize() -> None:
    reference = aug_values(aug_loader(1, 0))
    got: dict[int, tuple] = {}
    states = []
    for rank in range(3):
        loader = aug_loader(3, rank)
        it = iter(loader)
        got.update(aug_values([next(it)]))
        states.append(loader.state_dict())
        del it
    for rank in range(2):
        loader = aug_loader(2, rank, nw=2)
        loader.load_state_dict(merge_rank_states(states))
        got.update(aug_values(loader))
    assert got == reference


@pytest.mark.filterwarnings("ignore:resuming on:RuntimeWarning")
def test_ranks_one_batch_apart_across_the_epochs_end() -> None:
    # Rank 0 delivered its whole share (its state already says "next epoch"); rank 1 is one
    # batch short. On 3 ranks, only rank 1's last batch is left to deliver.
    taken, states = run_ranks(2, [6, 5], epoch=0)
    assert [sd["epoch"] for sd in states] == [1, 0]
    rest = finish_ranks(3, merge_rank_states(states))
    got = [i for r in taken for i in r] + [i for r in rest for b in r for i in b]
    counts = collections.Counter(got)
    assert set(counts) == set(range(N))
    # 12 + 10 taken; of the two positions rank 1 did not reach, one is torch's padding: one
    # sample is left, padded to a step of 3 ranks.
    assert len(taken[0]) + len(taken[1]) == 22
    assert sum(counts.values()) == 22 + 3


# ---- what a resize drops, counted ----------------------------------------------------------------
def dropping(world: int, rank: int, batch_drop: bool) -> DataLoader:
    """``make(drop_last=True)``, the loader dropping incomplete batches too if ``batch_drop``."""
    ds = RangeDataset(N)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, seed=7, drop_last=True)
    return DataLoader(ds, batch_size=BS, sampler=sampler, drop_last=batch_drop)


# Batches each rank takes before the save: in step, one rank ahead, or (None) rank 0 at the
# end of its share and the others a batch short of it.
RESIZES = [(2, 3, [2, 2]), (2, 3, None), (3, 2, [1, 1, 1]), (4, 3, [1, 2, 1, 1])]


@pytest.mark.parametrize("batch_drop", [False, True], ids=["batches-kept", "batch-drop_last"])
@pytest.mark.parametrize(
    ("before", "after", "steps"),
    RESIZES,
    ids=[f"{a}to{b}-{'one-done' if s is None else s}" for a, b, s in RESIZES],
)
def test_a_drop_last_resize_says_how_many_samples_the_epoch_leaves_out(
    before, after, steps, batch_drop
) -> None:
    # The case: 2 -> 3 ranks mid-epoch with drop_last=True warned that 1 sample was
    # dropped and every other delivered once, while the epoch left out 3 (23 samples: 1
    # trimmed by the first cut, 2 by the re-cut). The warning's account must be the run's.
    taken = []
    states = []
    share = N // before  # torch's cut for `before` ranks, drop_last=True
    left = share * before  # what the next cut gets: the first cut, less what the ranks took
    for rank in range(before):
        loader = dropping(before, rank, batch_drop)
        k = steps[rank] if steps else len(loader) - (rank > 0)
        it = iter(loader)
        taken += [i for _ in range(k) for i in ids(next(it))]
        states.append(roundtrip_state(loader.state_dict(), "torch"))
        # A rank at its share's end counts as having taken all of it (docs/distributed.md).
        left -= share if k == len(loader) else k * BS
        del it
    merged = merge_rank_states(states)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest = []
        for rank in range(after):
            loader = dropping(after, rank, batch_drop)
            loader.load_state_dict(merged)
            rest += [i for b in loader for i in ids(b)]
    delivered = collections.Counter(taken + rest)
    assert max(delivered.values()) == 1  # drop_last: nothing repeated
    missed = N - len(delivered)
    unbroken = N - sum(len(ids(b)) for r in range(before) for b in dropping(before, r, batch_drop))
    said = {str(w.message) for w in caught if "samples of the epoch are left" in str(w.message)}
    if left % after == 0:
        assert not said  # the re-cut itself drops nothing: no warning
        return
    assert len(said) == 1  # every rank says the same
    (text,) = said
    assert f"the last {left % after} of them are dropped" in text
    assert f"{N - missed} of the epoch's {N} samples are delivered; {missed} are not" in text
    assert (
        f"an uninterrupted run on {before} ranks (with this batch size) leaves out {unbroken}"
        in text
    )
    assert "exactly once" not in text
