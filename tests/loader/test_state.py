"""state_dict()/load_state_dict(): exact resume, compared with an uninterrupted run.

Every resume test goes through ``resumable_loader.testing.check_resume``: run uninterrupted;
for each save point k, consume k batches, save, rebuild, load, run on, and compare the rest of
this epoch and the next with the reference.
"""

from __future__ import annotations

import copy
import multiprocessing
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from _datasets import (
    RandomAugDataset,
    RangeData,
    RecordingDataset,
    VariableBatchSampler,
    read_records,
)
from _streams import (
    IteratorStateShard,
    NoStateSampler,
    PosState,
    ResetInIterShard,
    SeqSamplerWithState,
    Shard,
    StartInIterShard,
    StatefulSampler,
    StatefulShard,
    StateMadeInIterShard,
    read_values,
)
from torch.utils.data import IterableDataset

from resumable_loader import CheckpointError, DataLoader
from resumable_loader.testing import canonical, check_resume, reference_stream, roundtrip_state

N = 19  # odd on purpose: a partial last batch


def gen(seed: int = 1234) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


MAP_CONFIGS = {
    "w0": dict(num_workers=0, batch_size=3),
    "w0-shuffle-droplast": dict(num_workers=0, batch_size=4, shuffle=True, drop_last=True),
    "w2-shuffle": dict(num_workers=2, batch_size=3, shuffle=True),
    "w2-persistent-pf1": dict(
        num_workers=2, batch_size=3, shuffle=True, persistent_workers=True, prefetch_factor=1
    ),
    "w3-pf3": dict(num_workers=3, batch_size=4, prefetch_factor=3, shuffle=True),
    "w2-bsNone": dict(num_workers=2, batch_size=None, shuffle=True),
    "w2-batch-sampler": dict(num_workers=2, batch_sampler=VariableBatchSampler(N, [1, 4, 2])),
    "w2-no-state-sampler": dict(num_workers=2, batch_size=3, sampler=NoStateSampler(N)),
    "w2-replacement": dict(
        num_workers=2,
        batch_size=3,
        sampler=torch.utils.data.RandomSampler(range(N), replacement=True, num_samples=13),
    ),
    "w2-unordered": dict(num_workers=2, batch_size=2, shuffle=True, in_order=False),
    "w3-unordered-persistent": dict(
        num_workers=3, batch_size=3, in_order=False, persistent_workers=True
    ),
}

# A spread of save points, for the tests whose subject is not the save point itself.
SPREAD = [0, 1, 3, 6, 7, 8, 11, 14, 15]


def _steps(ref: list[list[Any]]) -> list[int]:
    """Every save point of epoch 0 (every batch, before and after StopIteration); in epoch 1
    its first two, its middle one and its last two. A resume in epoch 1 differs from one in
    epoch 0 by the seed chain's next link and the epoch's number, not by where in the epoch
    it falls."""
    first, later = len(ref[0]) + 2, len(ref[1]) + 2
    return [*range(first), *(first + k for k in sorted({0, 1, later // 2, later - 2, later - 1}))]


@pytest.mark.parametrize("name", list(MAP_CONFIGS))
def test_map_resume_matches_uninterrupted_run(name: str) -> None:
    cfg = MAP_CONFIGS[name]

    def make() -> DataLoader:
        return DataLoader(RandomAugDataset(N), generator=gen(), **copy.deepcopy(cfg))

    in_order = cfg.get("in_order", True)
    ref = reference_stream(make, 2)
    n = check_resume(make, epochs=2, steps=_steps(ref), in_order=in_order, reference=ref)
    assert n > 0


@pytest.mark.parametrize("via", ["dict", "bytes", "torch", "json"])
def test_resume_through_each_storage_format(via: str) -> None:
    def make() -> DataLoader:
        return DataLoader(
            RandomAugDataset(N), batch_size=3, shuffle=True, num_workers=2, generator=gen()
        )

    check_resume(make, epochs=2, via=via, steps=SPREAD)


@pytest.mark.parametrize(("before", "after"), [(0, 2), (2, 0), (2, 3)])
def test_map_resume_with_other_num_workers_gives_identical_batches(before: int, after: int) -> None:
    def make(nw: int = before) -> DataLoader:
        return DataLoader(
            RandomAugDataset(N), batch_size=3, shuffle=True, num_workers=nw, generator=gen()
        )

    check_resume(make, epochs=2, make_resumed=lambda: make(after))


def test_resumed_epoch_ignores_the_new_loaders_generator_and_global_seed() -> None:
    # The saved epoch's seed is in the state; only the epochs after it draw from the
    # (new) generator, as torch draws at each iter().
    def make() -> DataLoader:
        return DataLoader(
            RandomAugDataset(N), batch_size=3, shuffle=True, num_workers=2, generator=gen(1)
        )

    def make_resumed() -> DataLoader:
        torch.manual_seed(999)
        return DataLoader(
            RandomAugDataset(N), batch_size=3, shuffle=True, num_workers=2, generator=gen(2)
        )

    check_resume(make, epochs=1, make_resumed=make_resumed)


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("source", ["global", "generator"])
def test_reseeding_before_iter_repeats_the_epoch(nw: int, source: str) -> None:
    # torch draws an epoch's seed at each iter(): the same seed before iter() gives the same
    # epoch -- the shuffle and the random augmentations.
    g = torch.Generator()
    loader = DataLoader(
        RandomAugDataset(N),
        batch_size=3,
        shuffle=True,
        num_workers=nw,
        generator=g if source == "generator" else None,
    )

    def epoch(seed: int | None) -> list:
        if seed is not None:
            (g if source == "generator" else torch.random.default_generator).manual_seed(seed)
        return [canonical(b) for b in loader]

    first = epoch(5)
    assert epoch(5) == first
    assert epoch(None) != first, "an epoch without reseeding repeated the last one"
    assert epoch(6) != first


@pytest.mark.parametrize("nw", [0, 2])
def test_global_rng_restored_with_the_model_resumes_later_epochs_exactly(nw: int) -> None:
    # A script that saves torch's global RNG with the model and restores it after
    # load_state_dict() (the transformers Trainer does) is not reseeding it: the later epochs
    # are still the saved job's.
    def make() -> DataLoader:
        return DataLoader(RandomAugDataset(N), batch_size=3, shuffle=True, num_workers=nw)

    torch.manual_seed(0)
    reference = reference_stream(make, epochs=3)
    torch.manual_seed(0)
    first = make()
    got = [[canonical(b) for b in first]]
    it = iter(first)
    got.append([canonical(next(it)) for _ in range(2)])
    saved = roundtrip_state(first.state_dict(), "torch"), torch.get_rng_state()
    del it
    first.close()

    torch.manual_seed(999)  # the new process: its own RNG history
    resumed = make()
    resumed.load_state_dict(saved[0])
    torch.set_rng_state(saved[1])
    got[1] += [canonical(b) for b in resumed]
    got.append([canonical(b) for b in resumed])
    resumed.close()
    assert got == reference


def test_values_do_not_depend_on_the_number_of_workers() -> None:
    streams = [
        reference_stream(
            lambda nw=nw: DataLoader(
                RandomAugDataset(N), batch_size=3, shuffle=True, num_workers=nw, generator=gen()
            ),
            epochs=2,
        )
        for nw in (0, 1, 3)
    ]
    assert streams[0] == streams[1] == streams[2]
    assert streams[0][0] != streams[0][1], "two epochs gave the same batches"


def test_stateful_user_sampler_is_saved_through_its_own_state() -> None:
    def make() -> DataLoader:
        return DataLoader(
            RandomAugDataset(N),
            batch_size=3,
            sampler=StatefulSampler(N, seed=5),
            num_workers=2,
            generator=gen(),
        )

    loader = make()
    assert loader.state_dict()["config"]["sampler"].startswith("stateful:")
    it = iter(loader)
    next(it)
    sd = loader.state_dict()
    loader.close()
    assert "sampler_state" in sd and sd["sampler_state"]["pos"] > 0
    check_resume(make, epochs=2, steps=SPREAD)


def test_stateful_sampler_single_process() -> None:
    def make() -> DataLoader:
        return DataLoader(
            RandomAugDataset(N), batch_size=4, sampler=StatefulSampler(N, seed=3), generator=gen()
        )

    check_resume(make, epochs=2)


def test_resume_refetches_nothing_already_consumed(tmp_path) -> None:
    first_log, second_log = str(tmp_path / "first"), str(tmp_path / "second")
    n, k = 40, 5
    loader = DataLoader(
        RecordingDataset(n, first_log), batch_size=4, shuffle=True, num_workers=2, generator=gen()
    )
    it = iter(loader)
    consumed = [idx for _ in range(k) for idx in next(it)["idx"].tolist()]
    sd = loader.state_dict()
    loader.close()
    resumed = DataLoader(RecordingDataset(n, second_log), batch_size=4, shuffle=True, num_workers=2)
    resumed.load_state_dict(sd)
    rest = [idx for b in resumed for idx in b["idx"].tolist()]
    resumed.close()
    fetched_again = read_records(second_log)
    assert sorted(consumed + rest) == list(range(n)), "a sample was lost or repeated"
    assert not set(fetched_again) & set(consumed), "the resumed loader re-fetched consumed samples"
    assert sorted(fetched_again) == sorted(rest), (
        "the resumed loader fetched more than it delivered"
    )


def test_fast_forwarded_sampler_fetches_no_data_while_skipping(tmp_path) -> None:
    log = str(tmp_path / "log")
    first = str(tmp_path / "first")  # the same class of data, or the resume refuses it
    loader = DataLoader(RecordingDataset(N, first), batch_size=3, sampler=NoStateSampler(N))
    it = iter(loader)
    for _ in range(4):
        next(it)
    sd = loader.state_dict()
    resumed = DataLoader(RecordingDataset(N, log), batch_size=3, sampler=NoStateSampler(N))
    resumed.load_state_dict(sd)
    rest = [i for b in resumed for i in b["idx"].tolist()]
    assert read_records(log) == rest


def test_state_is_plain_data_for_torch_json_and_msgpack() -> None:
    loader = DataLoader(
        RandomAugDataset(N), batch_size=3, shuffle=True, num_workers=2, in_order=False
    )
    it = iter(loader)
    next(it)
    next(it)
    sd = loader.state_dict()
    loader.close()

    def plain(x) -> bool:
        if isinstance(x, dict):
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return x is None or isinstance(x, (bool, int, float, str, bytes))

    assert plain(sd), sd
    for via in ("torch", "json", "bytes"):
        assert roundtrip_state(sd, via) == sd


def test_state_dict_before_iterating_and_after_the_epoch() -> None:
    loader = DataLoader(RandomAugDataset(N), batch_size=3, generator=gen())
    sd0 = loader.state_dict()
    assert (sd0["epoch"], sd0["consumed"]) == (0, 0)
    batches = list(loader)
    sd1 = loader.state_dict()
    assert (sd1["epoch"], sd1["consumed"]) == (1, 0)
    # Neither epoch has begun in its state: its seed is drawn at its iter(), from the
    # generator, whose state (one seed further in sd1) is the state's seed chain.
    assert sd0["seed"] is None and sd1["seed"] is None
    assert "generator" in sd0["seed_chain"] and sd0["seed_chain"] != sd1["seed_chain"]
    again = DataLoader(RandomAugDataset(N), batch_size=3, generator=gen())
    again.load_state_dict(sd0)
    assert [canonical(b) for b in again] == [canonical(b) for b in batches]
    second = list(loader)
    again = DataLoader(RandomAugDataset(N), batch_size=3, generator=gen())
    again.load_state_dict(sd1)
    assert [canonical(b) for b in again] == [canonical(b) for b in second]


# ---- validation -------------------------------------------------------------------------------
def _saved(**kw) -> dict:
    loader = DataLoader(RandomAugDataset(N), batch_size=3, shuffle=True, generator=gen(), **kw)
    it = iter(loader)
    next(it)
    return loader.state_dict()


@pytest.mark.parametrize(
    ("field", "other"),
    [
        ("dataset_len", dict(dataset=RandomAugDataset(N + 1))),
        # Another batch_size re-cuts the position in samples here (test_rebatch.py).
        ("drop_last", dict(drop_last=True)),
        ("sampler", dict(shuffle=False)),
    ],
)
def test_mismatched_configuration_is_refused_and_changes_nothing(field: str, other: dict) -> None:
    sd = _saved()
    kw = dict(dataset=RandomAugDataset(N), batch_size=3, shuffle=True, generator=gen())
    kw.update(other)
    loader = DataLoader(**kw)
    before = loader.state_dict()
    with pytest.raises(CheckpointError) as info:
        loader.load_state_dict(sd)
    msg = str(info.value)
    assert f"config.{field}" in msg
    assert repr(sd["config"][field]) in msg and repr(before["config"][field]) in msg
    assert loader.state_dict() == before
    assert len(list(loader)) == len(loader)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda sd: sd.update(version=99), "version"),
        (lambda sd: sd.update(format="something else"), "format"),
        (lambda sd: sd.update(consumed=-1), "consumed"),
        (lambda sd: sd.update(consumed=10**6), "consumed"),
        (lambda sd: sd.update(seed="x"), "seed"),
        (lambda sd: sd.update(delivered_ahead=[0]), "delivered_ahead"),
        (lambda sd: sd.pop("config"), "config"),
    ],
)
def test_damaged_state_is_refused_with_the_field_named(mutate, field: str) -> None:
    sd = _saved()
    mutate(sd)
    loader = DataLoader(RandomAugDataset(N), batch_size=3, shuffle=True, generator=gen())
    before = loader.state_dict()
    with pytest.raises(CheckpointError, match=field):
        loader.load_state_dict(sd)
    assert loader.state_dict() == before


def test_not_a_dict_is_refused() -> None:
    loader = DataLoader(RandomAugDataset(N), batch_size=3)
    with pytest.raises(CheckpointError, match="expected a dict"):
        loader.load_state_dict([1, 2, 3])  # type: ignore[arg-type]


# ---- iterable datasets ------------------------------------------------------------------------
STREAMS = {
    "stateful": StatefulShard,
    "iterator-state": IteratorStateShard,
    "plain": Shard,
    # The two orders a dataset may be written for: iter() then load_state_dict (torchdata's),
    # or load_state_dict then iter().
    "reset-in-iter": ResetInIterShard,
    "start-in-iter": StartInIterShard,
    "state-made-in-iter": StateMadeInIterShard,
}
STREAM_CONFIGS = {
    "w0-b3": dict(num_workers=0, batch_size=3),
    "w0-bNone": dict(num_workers=0, batch_size=None),
    "w2-b3": dict(num_workers=2, batch_size=3),
    "w2-b3-droplast-persistent": dict(
        num_workers=2, batch_size=3, drop_last=True, persistent_workers=True
    ),
    "w3-bNone": dict(num_workers=3, batch_size=None),
    "w2-b2-unordered": dict(num_workers=2, batch_size=2, in_order=False),
    # The state rides with every 3rd result only: a resume replays the fetches since.
    "w2-b2-sparse-state": dict(num_workers=2, batch_size=2, stream_state_every=3),
}


@pytest.mark.parametrize("config", list(STREAM_CONFIGS))
@pytest.mark.parametrize("kind", list(STREAMS))
def test_stream_resume_matches_uninterrupted_run(kind: str, config: str) -> None:
    cfg = STREAM_CONFIGS[config]
    cls = STREAMS[kind]

    def make() -> DataLoader:
        return DataLoader(cls(11), generator=gen(), **cfg)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the plain stream's fast-forward note
        ref = reference_stream(make, 2)
        in_order = cfg.get("in_order", True)
        check_resume(make, epochs=2, steps=_steps(ref), in_order=in_order, reference=ref)


def test_stateful_stream_resume_reads_nothing_twice(tmp_path) -> None:
    log = str(tmp_path / "values")
    loader = DataLoader(StatefulShard(20), batch_size=2, num_workers=2, generator=gen())
    it = iter(loader)
    consumed = [int(v) for _ in range(4) for v in next(it)[:, 0]]
    sd = loader.state_dict()
    loader.close()
    resumed = DataLoader(StatefulShard(20, record=log), batch_size=2, num_workers=2)
    resumed.load_state_dict(sd)
    rest = [int(v) for b in resumed for v in b[:, 0]]
    assert sorted(consumed + rest) == sorted(v for w in (0, 1) for v in range(w, 20 + 3 * w, 2))
    assert sorted(read_values(log)) == sorted(rest), "the resumed stream re-read consumed items"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_plain_stream_resume_warns_once_about_fast_forward(num_workers: int) -> None:
    loader = DataLoader(Shard(12), batch_size=2, num_workers=num_workers)
    it = iter(loader)
    next(it)
    next(it)
    sd = loader.state_dict()
    loader.close()
    resumed = DataLoader(Shard(12), batch_size=2, num_workers=num_workers)
    resumed.load_state_dict(sd)
    with pytest.warns(RuntimeWarning, match="fast-forwarded") as record:
        list(resumed)
    ours = [w for w in record if "fast-forwarded" in str(w.message)]
    assert len(ours) == 1
    assert ours[0].filename == __file__, "the warning must point at the caller's iter()"


def test_stream_resume_with_other_num_workers_is_refused() -> None:
    loader = DataLoader(StatefulShard(12), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    sd = loader.state_dict()
    loader.close()
    other = DataLoader(StatefulShard(12), batch_size=2, num_workers=3)
    with pytest.raises(CheckpointError, match=r"config\.num_workers.*sharded per worker"):
        other.load_state_dict(sd)


def test_stream_state_records_each_workers_dataset_state() -> None:
    loader = DataLoader(StatefulShard(12), batch_size=2, num_workers=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    sd = loader.state_dict()
    loader.close()
    delivered = [w["delivered"] for w in sd["workers"]]
    assert delivered == [2, 1]
    assert [w["dataset_state"]["pos"] for w in sd["workers"]] == [4, 2]
    assert sd["next_worker"] == 1


# ---- persistent workers, and damaged states ---------------------------------------------------
class CursorOnDataset(PosState, IterableDataset):
    """Values 0..3; the cursor (the state) lives on the dataset object, as in many datasets."""

    def __init__(self, reached: Any = None) -> None:
        self.pos = 0
        self.reached = reached  # an Event set once the cursor has moved past item 1

    def __iter__(self):
        while self.pos < 4:
            self.pos += 1
            if self.pos == 2 and self.reached is not None:
                self.reached.set()
            yield self.pos - 1
        self.pos = 0


# A regression found by the fuzzers in fuzz/.
def test_load_state_into_persistent_workers_restarts_the_dataset() -> None:
    ctx = multiprocessing.get_context("fork")
    prefetched = ctx.Event()
    loader = DataLoader(
        CursorOnDataset(prefetched),
        batch_size=None,
        num_workers=1,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    with loader:
        it = iter(loader)
        # the worker prefetches items 0 and 1: its dataset's cursor is at 2
        assert prefetched.wait(30), "the worker never read item 1"
        del it
        loader.load_state_dict(loader.state_dict())  # epoch 0, nothing consumed
        assert list(loader) == [0, 1, 2, 3]  # got [2, 3]


# A regression found by the fuzzers in fuzz/.
@pytest.mark.parametrize("entry", [None, 5, "ab"])
def test_malformed_skipped_entries_are_refused(entry: object) -> None:
    loader = DataLoader(RangeData(), batch_size=2)
    before = loader.state_dict()
    damaged = dict(before, skipped=[entry])
    with pytest.raises(CheckpointError, match="skipped"):
        loader.load_state_dict(damaged)
    assert loader.state_dict() == before


# A regression found by the fuzzers in fuzz/.
@pytest.mark.parametrize("indices", [None, [None], [], 1])
def test_malformed_outstanding_indices_are_refused(indices: object) -> None:
    def make() -> DataLoader:
        return DataLoader(RangeData(), batch_size=2, sampler=SeqSamplerWithState(4))

    sd = make().state_dict()
    # As saved after drawing batch 0 ([0, 1]) and before consuming it -- with the batch damaged.
    damaged = dict(sd, seed=7, drawn=1, sampler_state={"pos": 2}, outstanding=[[0, indices]])
    loader = make()
    with pytest.raises(CheckpointError, match="outstanding"):
        loader.load_state_dict(damaged)


# A regression found by the fuzzers in fuzz/.
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("format", np.array([1, 2])),
        ("version", torch.tensor([1, 1])),
        ("config.batch_size", np.array([2, 2])),
    ],
    ids=["format-ndarray", "version-tensor", "config-ndarray"],
)
def test_array_valued_fields_are_refused(field: str, value: object) -> None:
    loader = DataLoader(RangeData(), batch_size=2)
    sd = loader.state_dict()
    if field.startswith("config."):
        damaged = dict(sd, config=dict(sd["config"], **{field.split(".")[1]: value}))
    else:
        damaged = dict(sd, **{field: value})
    with pytest.raises(CheckpointError):
        loader.load_state_dict(damaged)


# A regression found by the fuzzers in fuzz/.
@pytest.mark.parametrize("key", ["outstanding", "delivered_ahead", "sampler_done"])
def test_state_missing_a_position_field_is_refused(key: str) -> None:
    if key == "delivered_ahead":
        # Batch 1 was delivered ahead of batch 0 (in_order=False); deleting the field would
        # deliver it again.
        loader = DataLoader(RangeData(), batch_size=1)
        damaged = dict(loader.state_dict(), seed=7, delivered_ahead=[1])
    else:
        # Batch 0 ([0, 1]) was drawn from the sampler and not consumed; without 'outstanding'
        # it is lost.
        loader = DataLoader(RangeData(), batch_size=2, sampler=SeqSamplerWithState(4))
        damaged = dict(
            loader.state_dict(),
            seed=7,
            drawn=1,
            sampler_state={"pos": 2},
            outstanding=[[0, [0, 1]]],
        )
    loader.load_state_dict(dict(damaged))  # the intact state loads
    del damaged[key]
    with pytest.raises(CheckpointError, match=key):
        loader.load_state_dict(damaged)
