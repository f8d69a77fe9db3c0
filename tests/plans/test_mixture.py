"""Data plans (``_mixture``): a ``Mixture`` of named sources is a pure function of the global
position. Checked against plain reference computations: proportions in every window, no repeat
within a pass, the same (source, index) sequence however it is cut (objects, epochs, ranks,
batch sizes, workers, resumes), weight changes at a resume, and the refusals."""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import subprocess
import sys
import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from _datasets import Tagged
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from resumable_loader import CheckpointError, DataLoader, Mixture, merge_rank_states
from resumable_loader.cli.main import main as cli_main
from resumable_loader.plans.interleave import permute
from resumable_loader.testing import check_resume, roundtrip_state

FAST = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


class Fingerprinted(Tagged):
    """A ``Tagged`` source with a ``fingerprint()`` (a manifest hash, say)."""

    def __init__(self, name: str, n: int, fp: Any) -> None:
        super().__init__(name, n)
        self.fp = fp

    def fingerprint(self) -> Any:
        return self.fp


def tagged(lengths: dict[str, int]) -> dict[str, Tagged]:
    return {name: Tagged(name, n) for name, n in lengths.items()}


def plan(mix: Mixture, positions: range | list[int]) -> list[tuple[str, int]]:
    """(source, index) of each global position, read from a fresh epoch-0 view."""
    return [mix.source_of(g) for g in positions]


def depth(weights: dict[str, float]) -> int:
    """The stratification bound: the depth of the tree over the positive-weight sources."""
    k = sum(1 for w in weights.values() if w > 0)
    return math.ceil(math.log2(k)) if k > 1 else 0


def max_window_error(seq: list[str], weights: dict[str, float]) -> float:
    """The largest |count - n * share| of any source over any window of any length n."""
    names = sorted(weights)
    total = sum(weights.values())
    share = np.array([weights[n] / total for n in names])
    onehot = np.array([[s == n for n in names] for s in seq], dtype=np.int64)
    prefix = np.vstack([np.zeros(len(names), dtype=np.int64), np.cumsum(onehot, axis=0)])
    worst = 0.0
    for n in range(1, len(seq) + 1):
        err = np.abs((prefix[n:] - prefix[:-n]) - n * share)
        worst = max(worst, float(err.max()))
    return worst


def check_passes(seq: list[tuple[str, int]], lengths: dict[str, int]) -> None:
    """Each source's draws, cut into passes of its length: no repeat within a pass, and a
    complete pass is a permutation of the whole source."""
    for name, n in lengths.items():
        drawn = [i for s, i in seq if s == name]
        for start in range(0, len(drawn), n):
            chunk = drawn[start : start + n]
            assert len(set(chunk)) == len(chunk), f"{name}: a repeat within pass {start // n}"
            assert all(0 <= i < n for i in chunk)
            if len(chunk) == n:
                assert sorted(chunk) == list(range(n))


sources_st = st.dictionaries(
    st.sampled_from(["web", "code", "math", "books", "wiki"]),
    st.integers(1, 40),
    min_size=1,
    max_size=5,
)


@st.composite
def mixtures(draw: Any) -> tuple[dict[str, int], dict[str, float], int]:
    lengths = draw(sources_st)
    ws = draw(
        st.lists(
            st.one_of(st.integers(0, 9), st.floats(0.01, 5.0)),
            min_size=len(lengths),
            max_size=len(lengths),
        )
    )
    weights = dict(zip(sorted(lengths), ws))
    if not any(weights.values()):
        weights[sorted(lengths)[0]] = 1
    return lengths, weights, draw(st.integers(0, 2**64 - 1))


# ---- the plan itself ----------------------------------------------------------------------------
@FAST
@given(mixtures(), st.integers(0, 10**12))
def test_every_window_holds_the_proportions_within_the_tree_depth(
    m: tuple[dict[str, int], dict[str, float], int], start: int
) -> None:
    lengths, weights, seed = m
    mix = Mixture(tagged(lengths), weights, seed=seed)
    seq = [s for s, _ in plan(mix, range(start, start + 300))]
    assert max_window_error(seq, weights) <= depth(weights) + 1e-9
    for name, w in weights.items():
        if w == 0:
            assert name not in seq


def test_exact_ratios_of_decimal_weights() -> None:
    # 0.7 and 0.3 are read as 7/10 and 3/10: every 10 positions hold exactly 7 and 3.
    mix = Mixture(tagged({"a": 5, "b": 5}), {"a": 0.7, "b": 0.3}, seed=1)
    seq = [s for s, _ in plan(mix, range(10**6, 10**6 + 1000))]
    assert max_window_error(seq, {"a": 0.7, "b": 0.3}) < 1
    assert Counter(seq) == {"a": 700, "b": 300}


@FAST
@given(mixtures(), st.integers(0, 10**9))
def test_no_item_of_a_source_repeats_within_a_pass(
    m: tuple[dict[str, int], dict[str, float], int], start: int
) -> None:
    lengths, weights, seed = m
    mix = Mixture(tagged(lengths), weights, seed=seed)
    counts = mix.counts_before(start)
    seq = plan(mix, range(start, start + 400))
    # Cut at the pass boundaries: drop each source's draws until its next pass starts.
    aligned = []
    skip = {n: (-counts[n]) % lengths[n] for n in lengths}
    for s, i in seq:
        if skip[s]:
            skip[s] -= 1
        else:
            aligned.append((s, i))
    check_passes(aligned, lengths)
    # counts_before is the closed form of what the positions drew.
    after = mix.counts_before(start + 400)
    assert {n: after[n] - counts[n] for n in lengths} == {
        n: sum(1 for s, _ in seq if s == n) for n in lengths
    }


@pytest.mark.parametrize("n", [*range(1, 70), 255, 256, 257, 1000])
def test_each_pass_permutation_is_a_bijection(n: int) -> None:
    keys = (11, 22, 33, 2**30 - 1)
    assert sorted(permute(x, n, keys) for x in range(n)) == list(range(n))
    if n >= 8:
        assert [permute(x, n, keys) for x in range(n)] != list(range(n)), "not shuffled"


def test_passes_differ_and_seeds_differ() -> None:
    mix = Mixture(tagged({"a": 50}), {"a": 1}, seed=3)
    first, second = plan(mix, range(50)), plan(mix, range(50, 100))
    assert sorted(first) == sorted(second) and first != second
    assert plan(Mixture(tagged({"a": 50}), {"a": 1}, seed=4), range(50)) != first


def test_deterministic_and_free_of_global_rngs() -> None:
    lengths = {"web": 97, "code": 13, "math": 5}
    weights = {"web": 5, "code": 2.5, "math": 0.5}
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    a = plan(Mixture(tagged(lengths), weights, seed=9), range(2000))
    assert random.getstate() == states[0]
    assert np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.get_rng_state(), states[2])
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    # The order of the mapping does not matter either: names are sorted.
    reordered = {n: Tagged(n, lengths[n]) for n in reversed(list(lengths))}
    assert plan(Mixture(reordered, weights, seed=9), range(2000)) == a
    unpickled = pickle.loads(pickle.dumps(Mixture(tagged(lengths), weights, seed=9)))
    assert plan(unpickled, range(2000)) == a


def test_the_plan_is_the_same_in_another_interpreter() -> None:
    # Another process with another hash seed: nothing may depend on hash() or the RNGs.
    code = (
        "from resumable_loader import Mixture\n"
        "m = Mixture({n: range(k) for n, k in [('web', 97), ('code', 13), ('math', 5)]},\n"
        "            {'web': 5, 'code': 2.5, 'math': 0.5}, seed=9)\n"
        "print([m.source_of(g) for g in range(3000, 3300)])\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    lengths = {"web": 97, "code": 13, "math": 5}
    mix = Mixture(tagged(lengths), {"web": 5, "code": 2.5, "math": 0.5}, seed=9)
    assert out.stdout.strip() == repr(plan(mix, range(3000, 3300)))


def test_epochs_are_blocks_of_global_positions() -> None:
    mix = Mixture(tagged({"a": 7, "b": 4}), {"a": 2, "b": 1}, seed=5)
    n = len(mix)
    assert n == 11
    flat = [mix[g] for g in range(3 * n)]
    assert flat[:n] == list(mix)
    mix.set_epoch(2)
    assert mix.epoch == 2
    assert [mix[i] for i in range(n)] == list(mix) == flat[2 * n :]
    assert mix[-1] == flat[-1] and mix.source_of(-n) == mix.source_of(0)
    with pytest.raises(IndexError, match="out of range"):
        mix[-n - 1]
    assert flat[:n] != flat[n : 2 * n], "epochs must differ"


def test_num_samples_sets_the_epoch_length_and_small_sources_cycle() -> None:
    mix = Mixture(tagged({"big": 1000, "tiny": 3}), {"big": 1, "tiny": 1}, num_samples=60)
    assert len(mix) == 60
    seq = plan(mix, range(60))
    assert Counter(s for s, _ in seq) == {"big": 30, "tiny": 30}
    check_passes(seq, {"big": 1000, "tiny": 3})  # tiny: ten full passes


# ---- cut over objects, ranks and resumes --------------------------------------------------------
@FAST
@given(
    mixtures(),
    st.lists(st.integers(1, 60), min_size=1, max_size=6),
    st.integers(1, 4),
    st.sampled_from(["dict", "json", "torch"]),
)
def test_the_sequence_is_the_same_however_it_is_cut(
    m: tuple[dict[str, int], dict[str, float], int], cuts: list[int], world: int, via: str
) -> None:
    lengths, weights, seed = m
    total = sum(cuts)
    reference = plan(Mixture(tagged(lengths), weights, seed=seed), range(total))
    # Resumed at every cut, each piece by a fresh object loaded from the last one's state
    # (built with another seed: the state's seed wins, as the loader's does).
    got: list[tuple[str, int]] = []
    prev: Mixture | None = None
    at = 0
    for size in cuts:
        mix = Mixture(tagged(lengths), weights, seed=seed ^ 1)
        if prev is None:
            mix = Mixture(tagged(lengths), weights, seed=seed)
        else:
            mix.load_state_dict(roundtrip_state(prev.state_dict(), via))
        got += plan(mix, range(at, at + size))
        prev, at = mix, at + size
    assert got == reference
    # Strided over ranks, each on its own copy: the union, put back in position order.
    merged: list[Any] = [None] * total
    for rank in range(world):
        mix = pickle.loads(pickle.dumps(Mixture(tagged(lengths), weights, seed=seed)))
        for g in range(rank, total, world):
            merged[g] = mix.source_of(g)
    assert merged == reference


N = 48
LENGTHS = {"web": 30, "code": 11, "math": 4}
WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}


def make_mix(**kw: Any) -> Mixture:
    kw.setdefault("num_samples", N)
    return Mixture(tagged(LENGTHS), kw.pop("weights", WEIGHTS), seed=42, **kw)


def flat(batches: Any) -> list[str]:
    return [x for b in batches for x in b]


@pytest.mark.parametrize("workers", [0, 2])
def test_values_through_the_loader_match_a_list_comprehension(workers: int) -> None:
    reference = make_mix()
    # The loader tells the mixture its epoch at each iter() (in the workers too).
    with DataLoader(make_mix(), batch_size=5, num_workers=workers) as loader:
        for epoch in range(2):
            reference.set_epoch(epoch)
            expected = [reference[i] for i in range(N)]
            assert flat(loader) == expected
    assert expected != [make_mix()[i] for i in range(N)], "epoch 1 must differ from epoch 0"


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_sampler_shares_union_to_the_epoch(world: int) -> None:
    reference = [make_mix()[i] for i in range(N)]
    union: list[str] = []
    for rank in range(world):
        sampler = DistributedSampler(make_mix(), world, rank, shuffle=True, seed=7)
        with DataLoader(make_mix(), batch_size=4, sampler=sampler) as loader:
            got = flat(loader)
        assert got == [reference[p] for p in sampler]
        union += got
    assert sorted(union) == sorted(reference)


@pytest.mark.parametrize(
    ("workers", "shuffle", "batch_size"), [(0, True, 5), (2, False, 4), (2, True, 3)]
)
def test_loader_resume_continues_the_uninterrupted_stream(
    workers: int, shuffle: bool, batch_size: int
) -> None:
    def make() -> DataLoader:
        return DataLoader(
            make_mix(),
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=workers,
            generator=torch.Generator().manual_seed(5),
        )

    assert check_resume(make, epochs=1, via="json", steps=[0, 3, 7, 11, 100]) >= 4


# ---- weights changed at a resume ----------------------------------------------------------------
@FAST
@given(mixtures(), st.data())
def test_new_weights_from_the_resume_point_on(
    m: tuple[dict[str, int], dict[str, float], int], data: Any
) -> None:
    lengths, old, seed = m
    names = sorted(lengths)
    new = dict(zip(names, data.draw(st.permutations([old[n] for n in names]))))
    new[names[-1]] = data.draw(st.integers(0, 4))
    if not any(new.values()):
        new[names[0]] = 1
    at = data.draw(st.integers(0, 300))
    before = Mixture(tagged(lengths), old, seed=seed)
    uninterrupted = plan(before, range(at + 300))
    resumed = Mixture(tagged(lengths), new, seed=seed)
    resumed.load_state_dict(json.loads(json.dumps(before.state_dict())), resume_at=at)
    got = plan(resumed, range(at + 300))
    assert got[:at] == uninterrupted[:at], "what was consumed must stay consumed"
    assert max_window_error([s for s, _ in got[at:]], new) <= depth(new) + 1e-9
    check_passes(got, lengths)  # the current pass of each source continues: no repeat
    # The state carries the change: a third object continues the same plan.
    third = Mixture(tagged(lengths), new, seed=0)
    third.load_state_dict(resumed.state_dict())
    assert plan(third, range(at + 300)) == got


def test_set_weights_history_and_its_rules() -> None:
    mix = make_mix()
    reference = plan(mix, range(200))
    mix.set_weights({"web": 3, "code": 1, "math": 1}, 120)
    mix.set_weights({"web": 1, "code": 2, "math": 3}, 150)
    assert [start for start, _ in mix.history] == [0, 120, 150]
    # The same ratios again change nothing; the newest segment's start replaces it.
    mix.set_weights({"web": 10, "code": 20, "math": 30}, 170)
    assert len(mix.history) == 3
    mix.set_weights({"web": 1, "code": 0, "math": 0}, 150)
    assert mix.history[-1] == (150, {"web": 1, "code": 0, "math": 0})
    seq = plan(mix, range(400))
    assert seq[:120] == reference[:120]
    assert {s for s, _ in seq[150:]} == {"web"}
    check_passes(seq, LENGTHS)
    with pytest.raises(ValueError, match=r"from position 150 on.*>= 150"):
        mix.set_weights(WEIGHTS, 149)
    assert [s for s, _ in mix.history] == [0, 120, 150]


def test_new_weights_without_a_resume_point_keep_the_checkpoints_with_a_warning() -> None:
    saved = make_mix().state_dict()
    mix = make_mix(weights={"web": 1, "code": 1, "math": 1})
    with pytest.warns(UserWarning, match=r"kept the checkpoint's.*resume_at="):
        mix.load_state_dict(saved)
    assert mix.weights == WEIGHTS and plan(mix, range(100)) == plan(make_mix(), range(100))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_mix().load_state_dict(saved)  # same weights: nothing to say


# ---- state and refusals -------------------------------------------------------------------------
def test_state_is_plain_small_data_with_the_fingerprints() -> None:
    srcs = {"web": Fingerprinted("web", 10**7, fp="sha256:abc"), "code": Tagged("code", 3)}
    mix = Mixture(srcs, {"web": 0.9, "code": 0.1}, seed=2**64 - 1)
    mix.set_weights({"web": 0.5, "code": 0.5}, 10**12)
    sd = mix.state_dict()
    assert json.loads(json.dumps(sd)) == sd
    assert roundtrip_state(sd, "torch") == sd
    assert sd["sources"] == [
        {"name": "code", "length": 3, "fingerprint": None},
        {"name": "web", "length": 10**7, "fingerprint": "sha256:abc"},
    ]
    assert len(json.dumps(sd)) < 500
    other = Mixture(
        dict(srcs, web=Fingerprinted("web", 10**7, fp="sha256:abd")), {"web": 1, "code": 1}
    )
    assert other.fingerprint() != mix.fingerprint()
    assert mix.fingerprint() == Mixture(srcs, {"web": 1, "code": 1}, seed=1).fingerprint()


def _refusal(mix: Mixture, state: Any, *match: str) -> None:
    before = mix.state_dict()
    with pytest.raises(CheckpointError) as info:
        mix.load_state_dict(state, resume_at=0)
    for text in match:
        assert text in str(info.value), str(info.value)
    assert mix.state_dict() == before, "a refused state must leave the mixture as it was"


def test_changed_sources_are_refused_naming_what_changed() -> None:
    saved = make_mix().state_dict()
    added = Mixture(dict(tagged(LENGTHS), wiki=Tagged("wiki", 5)), dict(WEIGHTS, wiki=1))
    _refusal(added, saved, "['wiki'] added", "checkpoint: ['code', 'math', 'web']")
    removed = Mixture(tagged({"web": 30, "code": 11}), {"web": 1, "code": 1}, num_samples=N)
    _refusal(removed, saved, "['math'] removed")
    longer = Mixture(tagged(dict(LENGTHS, code=12)), WEIGHTS, num_samples=N)
    _refusal(longer, saved, "source 'code' had 11 items in the checkpoint, now 12")
    fp = Mixture(
        dict(tagged(LENGTHS), web=Fingerprinted("web", 30, fp="v2")), WEIGHTS, num_samples=N
    )
    _refusal(fp, saved, "source 'web' has fingerprint 'v2', the checkpoint None")
    _refusal(make_mix(num_samples=N + 1), saved, "num_samples=48, this one 49")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda sd: sd.pop("weights"), "missing keys ['weights']"),
        (lambda sd: sd.update(kind="loader"), "kind is 'loader'"),
        (lambda sd: sd.update(version=3), "version 3"),
        (lambda sd: sd.update(rests=[]), "'rests' is []"),  # a version-1 plan has none
        (lambda sd: sd.update(version=2, rests=[{"epoch": 0}]), "rests[0] is"),
        (lambda sd: sd.update(seed=-1), "seed must be in"),
        (lambda sd: sd.update(weights=[]), "non-empty list"),
        (lambda sd: sd["weights"][0].update({"from": 3}), "start at 0"),
        (lambda sd: sd["weights"].append(dict(sd["weights"][0])), "increasing positions"),
        (lambda sd: sd["weights"][0]["weights"].pop("web"), "no weight for ['web']"),
        (lambda sd: sd["weights"][0]["weights"].update(web=-1), "must be >= 0"),
        (lambda sd: sd.update(sources="web"), "'sources' is 'web'"),
        # A rest's counts carry into the segment that starts the next epoch: there must be one.
        (
            lambda sd: sd.update(
                version=2,
                rests=[
                    {
                        "epoch": 0,
                        "length": N,
                        "order": {"kind": "random", "seed": 0},
                        "from": 5,
                        "weights": dict(WEIGHTS),
                    }
                ],
            ),
            "no weights segment starts the epoch after",
        ),
    ],
)
def test_malformed_states_are_refused(change: Any, match: str) -> None:
    sd = make_mix().state_dict()
    change(sd)
    _refusal(make_mix(), sd, match)


def test_a_resume_point_before_the_checkpoints_newest_weights_is_refused() -> None:
    mix = make_mix()
    mix.set_weights({"web": 1, "code": 1, "math": 1}, 100)
    fresh = make_mix(weights={"web": 0, "code": 1, "math": 0})
    with pytest.raises(CheckpointError, match="apply from 100 on"):
        fresh.load_state_dict(mix.state_dict(), resume_at=99)
    assert fresh.history == [(0, {"web": 0, "code": 1, "math": 0})]


@pytest.mark.parametrize(
    ("sources", "weights", "kw", "exc", "match"),
    [
        ({}, {}, {}, ValueError, "non-empty mapping"),
        ({"a": Tagged("a", 0)}, {"a": 1}, {}, ValueError, "source 'a' is empty"),
        ({"a": iter([1])}, {"a": 1}, {}, TypeError, "has no len()"),
        ({1: Tagged("a", 2)}, {1: 1}, {}, TypeError, "names must be strings"),
        ({"a": Tagged("a", 2)}, {"b": 1}, {}, ValueError, "no weight for ['a']"),
        ({"a": Tagged("a", 2)}, {"a": 0}, {}, ValueError, "all are 0"),
        ({"a": Tagged("a", 2)}, {"a": float("nan")}, {}, ValueError, "finite"),
        ({"a": Tagged("a", 2)}, {"a": True}, {}, TypeError, "must be a number"),
        ({"a": Tagged("a", 2)}, [1], {}, TypeError, "must be a mapping"),
        ({"a": Tagged("a", 2)}, {"a": 1}, {"seed": -1}, ValueError, "seed must be in"),
        ({"a": Tagged("a", 2)}, {"a": 1}, {"num_samples": 0}, ValueError, "num_samples must"),
        ({"a": Fingerprinted("a", 2, fp=3)}, {"a": 1}, {}, TypeError, "must return a str"),
    ],
)
def test_bad_arguments_say_what_is_wrong(
    sources: Any, weights: Any, kw: dict[str, Any], exc: type, match: str
) -> None:
    with pytest.raises(exc) as info:
        Mixture(sources, weights, **kw)
    assert match in str(info.value)


# ---- the loader keeps the plan -------------------------------------------------------------


def _mix(weights: dict[str, float]) -> Mixture:
    return Mixture({"a": list(range(10)), "b": list(range(100, 113))}, weights, seed=3)


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, True)])
def test_the_loader_saves_the_plan_and_new_weights_apply_from_the_resume(
    workers: int, persistent: bool
) -> None:
    # The loader sets the epoch (the main process and persistent workers) and saves the plan in
    # its state; a loader over the same sources with new weights continues the consumed stream
    # and uses the new weights from the first unconsumed sample (a sequential epoch) on.
    def loader(mix: Mixture) -> DataLoader:
        return DataLoader(mix, batch_size=4, num_workers=workers, persistent_workers=persistent)

    n, k = len(_mix({"a": 1, "b": 1})), 2  # resume after 2 batches of epoch 1
    at = n + 4 * k
    want_mix = _mix({"a": 1, "b": 1})
    want_mix.set_weights({"a": 1, "b": 3}, at)
    ref = loader(want_mix)
    want = [[int(x) for b in ref for x in b] for _ in range(3)]
    ref.close()

    first = loader(_mix({"a": 1, "b": 1}))
    got = [[int(x) for b in first for x in b]]
    it = iter(first)
    got.append([int(x) for _ in range(k) for x in next(it)])
    sd = first.state_dict()
    assert sd["data_plan"]["weights"] == [{"from": 0, "weights": {"a": 1, "b": 1}}]
    del it
    first.close()
    resumed = loader(_mix({"a": 1, "b": 3}))
    resumed.load_state_dict(sd)
    got[1] += [int(x) for b in resumed for x in b]
    got.append([int(x) for b in resumed for x in b])
    resumed.close()
    assert got == want


def test_a_plan_over_other_sources_is_refused_and_nothing_changes() -> None:
    sd = DataLoader(_mix({"a": 1, "b": 1}), batch_size=4).state_dict()
    other = Mixture({"a": list(range(10)), "c": list(range(13))}, {"a": 1, "c": 1}, seed=3)
    loader = DataLoader(other, batch_size=4)
    before = loader.state_dict()
    with pytest.raises(CheckpointError, match="added"):
        loader.load_state_dict(sd)
    assert loader.state_dict() == before
    with pytest.raises(CheckpointError, match="class is list, the checkpoint's was Mixture"):
        DataLoader(list(range(23)), batch_size=4).load_state_dict(sd)
    del sd["dataset"]  # a state from before dataset checks: the plan itself is refused
    with pytest.raises(CheckpointError, match="data_plan"):
        DataLoader(list(range(23)), batch_size=4).load_state_dict(sd)


def test_a_state_refused_after_the_plan_check_leaves_the_mixture_unchanged() -> None:
    # The sampler-generator check refuses this state after the plan would have been taken:
    # the mixture's new weights must still be the ones it was built with.
    def loader(mix: Mixture, gen: torch.Generator | None) -> DataLoader:
        sampler = torch.utils.data.SubsetRandomSampler(range(len(mix)), generator=gen)
        return DataLoader(mix, batch_size=4, sampler=sampler)

    first = loader(_mix({"a": 1, "b": 1}), torch.Generator().manual_seed(5))
    it = iter(first)
    next(it)
    sd = first.state_dict()
    del it
    assert "sampler_generator" in sd
    mix = _mix({"a": 1, "b": 3})
    resumed = loader(mix, None)
    before = (mix.history, resumed.state_dict())
    with pytest.raises(CheckpointError, match="sampler_generator"):
        resumed.load_state_dict(sd)
    assert (mix.history, resumed.state_dict()) == before


# ---- the plan reaches the workers (issue #31 item 2) ------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_weights_set_before_iter_reach_persistent_workers_and_the_resume(workers: int) -> None:
    # Epoch 1 under weights set between the epochs: persistent workers got the dataset when
    # they started (epoch 0), and must serve epoch 1 from the plan the main process holds --
    # the one its state saves, so that a resume inside epoch 1 continues the same stream.
    def loader(mix: Mixture) -> DataLoader:
        return DataLoader(mix, batch_size=4, num_workers=workers, persistent_workers=workers > 0)

    n, k = len(_mix({"a": 1, "b": 1})), 2
    reference = _mix({"a": 1, "b": 1})
    reference.set_weights({"a": 1, "b": 3}, from_position=n)
    reference.set_epoch(1)
    want = [reference[i] for i in range(n)]  # epoch 1, read straight from the plan

    mix = _mix({"a": 1, "b": 1})
    first = loader(mix)
    for _ in first:  # epoch 0 starts the persistent workers
        pass
    mix.set_weights({"a": 1, "b": 3}, from_position=n)
    it = iter(first)
    got = [int(x) for _ in range(k) for x in next(it)]
    sd = first.state_dict()
    got += [int(x) for b in it for x in b]
    first.close()
    assert got == want, "epoch 1 must follow the weights set before its iter()"
    assert sd["data_plan"]["weights"][-1] == {"from": n, "weights": {"a": 1, "b": 3}}

    resumed = loader(_mix({"a": 1, "b": 3}))  # the plan's newest weights: nothing new
    resumed.load_state_dict(sd)
    rest = [int(x) for b in resumed for x in b]
    resumed.close()
    assert rest == want[4 * k :]


def test_a_weights_change_inside_an_epoch_its_workers_serve_is_refused() -> None:
    # The workers hold the epoch's plan from iter() on: a change inside that epoch would reach
    # the state but not them. From the next epoch on it reaches them with that epoch.
    mix = _mix({"a": 1, "b": 1})
    n = len(mix)
    with DataLoader(mix, batch_size=4, num_workers=2, persistent_workers=True) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(ValueError, match=f"workers serve the epoch up to position {n}"):
            mix.set_weights({"a": 0, "b": 1}, from_position=n - 1)
        assert mix.history == [(0, {"a": 1, "b": 1})]
        mix.set_weights({"a": 0, "b": 1}, from_position=n)
        first = [int(x) for b in it for x in b]
        second = [int(x) for b in loader for x in b]
    assert any(x < 100 for x in first)  # epoch 0 keeps "a"
    assert second and all(x >= 100 for x in second)  # epoch 1: "b" alone


# ---- new weights for the rest of a shuffled epoch (issue #31 item 5) --------------------------
class Where(Mixture):
    """A Mixture whose items say which position they are: ``(position, item)``."""

    def __getitem__(self, index: int) -> Any:
        return index, super().__getitem__(index)


SHUFFLED = {"a": 40, "b": 40, "c": 20}  # weights = lengths: one pass of each per epoch


def where(weights: dict[str, int], **kw: Any) -> Where:
    return Where(tagged(SHUFFLED), weights, seed=11, **kw)


def pairs(loader: Any) -> list[tuple[int, str]]:
    return [(int(p), v) for pos, vals in loader for p, v in zip(pos.tolist(), vals)]


def check_the_rest(before: list[Any], after: list[Any], n: int) -> None:
    """Every position of the epoch exactly once; "c" (weight 0 now) never after the resume;
    no item of a source twice on either side (each side lies within one pass of it); and the
    rest split by the new weights 1:1 (within the stratification bound)."""
    assert sorted(p for p, _ in before + after) == list(range(n))
    sources = Counter(v.split("/")[0] for _, v in after)
    assert sources["c"] == 0, f"a source weighted 0 delivered {sources['c']} after the resume"
    assert abs(sources["a"] - sources["b"]) <= 2
    for side in (before, after):
        items = [v for _, v in side]
        assert len(set(items)) == len(items), "an item of a source came twice in one pass"


@pytest.mark.parametrize("workers", [0, 2])
def test_new_weights_at_a_resume_govern_the_rest_of_a_shuffled_epoch(
    workers: int, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    def loader(mix: Mixture) -> DataLoader:
        return DataLoader(
            mix,
            batch_size=4,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(5),
        )

    n, k = len(where(SHUFFLED)), 6  # 24 consumed: the rest fits in one pass of "a" and "b"
    first = loader(where(SHUFFLED))
    it = iter(first)
    before = [pair for _ in range(k) for pair in pairs([next(it)])]
    sd = json.loads(json.dumps(first.state_dict()))
    del it
    first.close()

    mix = where({"a": 1, "b": 1, "c": 0})
    resumed = loader(mix)
    resumed.load_state_dict(sd)
    at_load = resumed.state_dict()
    after = pairs(resumed)
    assert pairs(resumed) != [], "the next epoch follows"
    resumed.close()
    check_the_rest(before, after, n)
    # A checkpoint taken before the first batch holds the plan as loaded, new weights included.
    loaded, now = at_load["data_plan"], mix.state_dict()
    assert (loaded["weights"], loaded["rests"]) == (now["weights"], now["rests"])
    # ... and `inspect` shows the change inside the epoch.
    torch.save(at_load, tmp_path / "ckpt.pt")
    assert cli_main(["inspect", str(tmp_path / "ckpt.pt")]) == 0
    assert "and {'a': 1, 'b': 1, 'c': 0} from place 24 of epoch 0's" in capsys.readouterr().out

    # The reference: an uninterrupted run of the same job under the plan the resume made,
    # from the epoch's first sample. It must deliver what the interrupted run delivered, then
    # what the resumed one did: the new weights govern the samples after the resume point in
    # the order they are delivered, not positions.
    plan = mix.state_dict()
    assert [r["from"] for r in plan["rests"]] == [4 * k]
    ref_mix = where({"a": 1, "b": 1, "c": 0})
    ref_mix.load_state_dict(plan)
    with loader(ref_mix) as ref:
        assert pairs(ref) == before + after


def test_two_weight_changes_in_one_shuffled_epoch_compose() -> None:
    # Resumed with new weights, then resumed again in the same epoch with newer ones: each
    # change governs what is delivered after it, and the plan holds both.
    def loader(mix: Mixture) -> DataLoader:
        return DataLoader(
            mix, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5)
        )

    first = loader(where(SHUFFLED))
    it = iter(first)
    before = [pair for _ in range(6) for pair in pairs([next(it)])]
    sd = json.loads(json.dumps(first.state_dict()))
    del it
    middle_loader = loader(where({"a": 1, "b": 1, "c": 0}))
    middle_loader.load_state_dict(sd)
    it = iter(middle_loader)
    middle = [pair for _ in range(3) for pair in pairs([next(it)])]
    sd = json.loads(json.dumps(middle_loader.state_dict()))
    del it
    mix = where({"a": 0, "b": 1, "c": 1})
    last = loader(mix)
    last.load_state_dict(sd)
    after = pairs(last)
    for done in (first, middle_loader, last):
        done.close()

    assert sorted(p for p, _ in before + middle + after) == list(range(len(mix)))
    assert not [v for _, v in middle if v.startswith("c")]
    assert not [v for _, v in after if v.startswith("a")]
    assert [r["from"] for r in mix.state_dict()["rests"]] == [24, 36]
    ref_mix = where({"a": 0, "b": 1, "c": 1})
    ref_mix.load_state_dict(mix.state_dict())
    with loader(ref_mix) as ref:
        assert pairs(ref) == before + middle + after


@pytest.mark.parametrize(("steps", "world"), [((2, 2), 3), ((2, 1), 1)])
def test_new_weights_at_a_resume_of_a_distributed_shuffled_epoch(
    steps: tuple[int, int], world: int
) -> None:
    # Simulated ranks: 2 ranks stop after ``steps`` batches of 7, their states merged; ``world``
    # ranks resume with new weights (what is left makes even shares: no padding). Compared with
    # an uninterrupted 2-rank run under the resumed plan.
    n = len(where(SHUFFLED))

    before, states = [], []
    for r in range(2):
        mix = where(SHUFFLED)
        sampler = DistributedSampler(mix, 2, r, seed=7)
        sampler.set_epoch(3)
        loader = DataLoader(mix, batch_size=7, sampler=sampler)
        it = iter(loader)
        before += [pair for _ in range(steps[r]) for pair in pairs([next(it)])]
        states.append(loader.state_dict())
        del it
        loader.close()
    merged = json.loads(json.dumps(merge_rank_states(states)))

    mixes = [where({"a": 1, "b": 1, "c": 0}) for _ in range(world)]
    after = []
    # Ranks out of step (rank 1 a batch behind) leave rank 1's places 15, 17, ..., 25 of the
    # order unconsumed before rank 0's last one (26): those keep the old weights, and the load
    # says how many.
    behind = 6 if steps[0] > steps[1] else 0
    for r, m in enumerate(mixes):
        loader = DataLoader(m, batch_size=2, sampler=DistributedSampler(m, world, r, seed=7))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader.load_state_dict(merged)  # sets the sampler's epoch: the state's
        notes = [str(w.message) for w in caught if "checkpoint's weights" in str(w.message)]
        assert len(notes) == (1 if behind else 0)
        assert all(f"; {behind} samples before it were not consumed" in t for t in notes)
        after += pairs(loader)
        loader.close()
    plans = [m.state_dict() for m in mixes]
    assert all(p == plans[0] for p in plans), "every rank computes the same plan"

    # The samples behind: those before the last consumed place of the epoch's order (torch's,
    # read from a sampler of one rank). They keep the old weights; the rest follows the new.
    order = DistributedSampler(where(SHUFFLED), 1, 0, seed=7)
    order.set_epoch(3)
    place = {p: i for i, p in enumerate(order)}
    top = max(place[p] for p, _ in before)
    kept = [(p, v) for p, v in after if place[p] < top]
    assert len(kept) == behind
    old = where(SHUFFLED)
    assert all(old[p] == (p, v) for p, v in kept)
    check_the_rest(before + kept, [x for x in after if place[x[0]] > top], n)

    reference: dict[int, str] = {}
    for r in range(2):
        ref_mix = where({"a": 1, "b": 1, "c": 0})
        ref_mix.load_state_dict(plans[0])
        sampler = DistributedSampler(ref_mix, 2, r, seed=7)
        sampler.set_epoch(3)
        with DataLoader(ref_mix, batch_size=7, sampler=sampler) as ref:
            reference.update(pairs(ref))
    assert dict(before + after) == reference


def test_new_weights_inside_an_epoch_whose_order_is_unknown_are_refused() -> None:
    # A sampler drawing with replacement has no "rest of the epoch" to give new weights to:
    # the load is refused (not deferred to the next epoch), naming why and what to do.
    def loader(mix: Mixture) -> DataLoader:
        sampler = torch.utils.data.RandomSampler(mix, replacement=True)
        return DataLoader(mix, batch_size=4, sampler=sampler)

    first = loader(where(SHUFFLED))
    it = iter(first)
    next(it)
    sd = first.state_dict()
    del it
    first.close()
    mix = where({"a": 1, "b": 1, "c": 0})
    resumed = loader(mix)
    before = (mix.state_dict(), resumed.state_dict())
    with pytest.raises(CheckpointError, match="with replacement") as info:
        resumed.load_state_dict(sd)
    assert "set_weights(new_weights, from_position=(epoch + 1) * len(mix))" in str(info.value)
    assert (mix.state_dict(), resumed.state_dict()) == before
    resumed.close()
    with loader(where(SHUFFLED)) as same:  # the checkpoint's weights: resumes
        same.load_state_dict(sd)
        assert len(pairs(same)) == len(where(SHUFFLED)) - 4
