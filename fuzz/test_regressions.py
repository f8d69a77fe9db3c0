"""Minimal reproducers of bugs the fuzzers in fuzz/ found, each ``xfail(strict=True)`` until
it is fixed; the fuzzer steers around each one (``KNOWN_BUGS`` in ``test_fuzz_user.py``).

Each compares with what the docs promise, computed by hand.
"""

from __future__ import annotations

import warnings

from torch.utils.data import DistributedSampler

from resumable_loader import DataLoader, merge_rank_states, skip_samples


def _ranks(n: int, world: int, batch_size: int) -> list[tuple[DataLoader, DistributedSampler]]:
    out = []
    for r in range(world):
        s = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=False)
        s.set_epoch(0)
        out.append((DataLoader(list(range(n)), batch_size=batch_size, sampler=s), s))
    return out


# A regression found by the fuzzers in fuzz/.
def test_skip_after_one_rank_finished_its_share_skips_within_the_epoch() -> None:
    # 6 samples on 3 ranks, batch 2: rank 2 delivers its share [2, 5] and its epoch ends;
    # ranks 0 and 1 have not started. distributed.md: "the finished ranks count as having
    # taken their whole share", so the job is in epoch 0 with 4 samples left: 0, 1, 3, 4.
    job = _ranks(6, 3, 2)
    assert next(iter(job[2][0])).tolist() == [2, 5]
    state = skip_samples(merge_rank_states([dl.state_dict() for dl, _ in job]), 1)
    # skip 1 (sample 0); the rest, 1, 3, 4, on one rank in one batch of 4.
    ((dl, s),) = _ranks(6, 1, 4)
    dl.load_state_dict(state)
    s.set_epoch(dl.state_dict()["distributed"]["sampler_epoch"])
    assert [b.tolist() for b in dl] == [[1, 3, 4]]


# A regression found by the fuzzers in fuzz/.
def test_a_skipped_state_that_needs_padding_on_the_new_ranks_warns() -> None:
    # 6 samples on 2 ranks, batch 1: each rank takes one (0 and 1); skip 1 (sample 2): 3, 4, 5
    # are left for 2 ranks, so one sample is repeated to pad the last step, and
    # distributed.md says "a RuntimeWarning says how many samples".
    job = _ranks(6, 2, 1)
    assert [next(iter(dl)).tolist() for dl, _ in job] == [[0], [1]]
    state = skip_samples(merge_rank_states([dl.state_dict() for dl, _ in job]), 1)
    new = _ranks(6, 2, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dl, _ in new:
            dl.load_state_dict(state)
    assert [[b.tolist() for b in dl] for dl, _ in new] == [[[3], [5]], [[4], [3]]]
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("1 of them are repeated" in m for m in said), said


# skip-out-of-step in a later epoch: the finished rank's state already names the next sampler
# epoch (issue 31 item 1), so the skip must take the epoch from the ranks still inside it.
def test_skip_across_a_later_epochs_end_continues_the_unfinished_epoch() -> None:
    def job(world: int, batch_size: int) -> list[tuple[DataLoader, DistributedSampler]]:
        out = []
        for r in range(world):
            s = DistributedSampler(range(6), num_replicas=world, rank=r, shuffle=True, seed=3)
            out.append((DataLoader(list(range(6)), batch_size=batch_size, sampler=s), s))
        return out

    # The uninterrupted epoch 1, as torch's sampler gives it: rank r takes positions r, r + 3
    # of the epoch's order.
    shares = []
    for _, s in job(3, 2):
        s.set_epoch(1)
        shares.append(list(s))
    order = [shares[p % 3][p // 3] for p in range(6)]
    ranks = job(3, 2)
    for _, s in ranks:  # the recipe: set_epoch(epoch) before each epoch
        s.set_epoch(0)
    for dl, _ in ranks:
        assert len(list(dl)) == 1
    for _, s in ranks:
        s.set_epoch(1)
    # Rank 2 delivers its whole share of epoch 1; ranks 0 and 1 have not started it.
    assert next(iter(ranks[2][0])).tolist() == shares[2]
    state = skip_samples(merge_rank_states([dl.state_dict() for dl, _ in ranks]), 1)
    ((dl, s),) = job(1, 4)
    dl.load_state_dict(state)
    s.set_epoch(dl.state_dict()["distributed"]["sampler_epoch"])
    # Left of epoch 1: the order without rank 2's share; the first of it skipped.
    rest = [i for i in order if i not in shares[2]]
    assert [b.tolist() for b in dl] == [rest[1:]]


def test_a_skipped_state_that_drops_samples_on_the_new_ranks_warns() -> None:
    # skip-pad-warning with DistributedSampler(drop_last=True): 6 samples on 2 ranks take 0
    # and 1, skip 1 (sample 2); of 3, 4, 5 the last is dropped to cut 2 equal shares.
    def job() -> list[DataLoader]:
        return [
            DataLoader(
                list(range(6)),
                batch_size=1,
                sampler=DistributedSampler(
                    range(6), num_replicas=2, rank=r, shuffle=False, drop_last=True
                ),
            )
            for r in range(2)
        ]

    ranks = job()
    assert [next(iter(dl)).tolist() for dl in ranks] == [[0], [1]]
    state = skip_samples(merge_rank_states([dl.state_dict() for dl in ranks]), 1)
    new = job()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dl in new:
            dl.load_state_dict(state)
    assert [[b.tolist() for b in dl] for dl in new] == [[[3]], [[4]]]
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("the last 1 of them are dropped" in m for m in said), said
