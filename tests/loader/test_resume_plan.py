"""The resume plan as a table: (a loader built with X, a state saved with Y) → the plan.

``plan_resume(state, shape, policy)`` is a pure function of a state and a loader's
``LoaderShape``: these rows call it directly -- no worker processes, no iteration after the
load -- and check the fields of the ``ResumePlan`` it returns (the position, the re-cut, the
Mixture's plan load, the generator and seed chain, the warnings) or the ``CheckpointError`` it
raises. The end-to-end resumes (the batches after a load) are test_state.py's and
test_rebatch.py's; here, for each refusal row, ``load_state_dict`` is also checked to leave the
loader -- its state, iterator, dataset, sampler and generators -- exactly as it was.
"""

from __future__ import annotations

import base64
import warnings
from collections.abc import Callable
from dataclasses import FrozenInstanceError, dataclass, field
from typing import Any

import pytest
import torch
from _datasets import CursorSampler, EveryOtherReversedSampler, RangeDataset, ShardedStream
from torch.utils.data import BatchSampler, IterableDataset, SequentialSampler, SubsetRandomSampler
from torch.utils.data.distributed import DistributedSampler

from resumable_loader import CheckpointError, DataLoader, Mixture, merge_rank_states, skip_samples
from resumable_loader.loader.resume import ResumePlan, plan_resume
from resumable_loader.state.codec import dump_state, load_state
from resumable_loader.state.cursor import Cut

N = 16


def _gen(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mix(**weights: float) -> Mixture:
    return Mixture(
        {"a": RangeDataset(10), "b": RangeDataset(6)}, weights or {"a": 1, "b": 1}, seed=3
    )


def _saved(loader: DataLoader, batches: int) -> dict[str, Any]:
    """The state of ``loader`` after ``batches`` batches (its iterator then dropped)."""
    it = iter(loader)
    for _ in range(batches):
        next(it)
    state = loader.state_dict()
    loader.close()
    return state


def _dist(world: int, rank: int, batch: int = 2, shuffle: bool = False) -> DataLoader:
    ds = RangeDataset(N)
    return DataLoader(
        ds, batch_size=batch, sampler=DistributedSampler(ds, world, rank, shuffle=shuffle)
    )


def _global(world: int, batches: int, batch: int = 2, shuffle: bool = False) -> dict[str, Any]:
    """The job's global state of ``world`` ranks, each after ``batches`` batches."""
    return merge_rank_states(
        [_saved(_dist(world, r, batch, shuffle), batches) for r in range(world)]
    )


def _with_rank(g: dict[str, Any], rank: int, **fields: Any) -> dict[str, Any]:
    """The global state ``g`` with rank ``rank``'s entry changed by ``fields``."""
    sd = load_state(base64.b64decode(g["ranks"][rank]))
    ranks = list(g["ranks"])
    ranks[rank] = base64.b64encode(dump_state(dict(sd, **fields))).decode()
    return dict(g, ranks=ranks)


def _mixed_epochs() -> dict[str, Any]:
    """A global state whose rank 1 is in sampler epoch 5, rank 0 in epoch 0."""
    late = _dist(2, 1)
    late.sampler.set_epoch(5)  # type: ignore[attr-defined]
    return merge_rank_states([_saved(_dist(2, 0), 1), _saved(late, 1)])


def _drop(state: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k not in keys}


@dataclass
class Row:
    """One case: ``saved()`` gives the state, ``loader()`` the loader it is given to."""

    name: str
    saved: Callable[[], Any]
    loader: Callable[[], DataLoader]
    policy: str = "raise"
    expect: dict[str, Any] = field(default_factory=dict)  # plan attribute path -> value
    check: Callable[[ResumePlan], None] | None = None
    refused: str | None = None  # a fragment of the CheckpointError's message


def _get(plan: ResumePlan, path: str) -> Any:
    value: Any = plan
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _mixture_applied_from(start: int) -> Callable[[ResumePlan], None]:
    def check(plan: ResumePlan) -> None:
        assert plan.mixture is not None and plan.mixture.applied
        assert plan.mixture.segments[-1].start == start
        assert not plan.mixture.rests

    return check


def _mixture_rest(plan: ResumePlan) -> None:
    assert plan.mixture is not None and plan.mixture.applied
    (rest,) = plan.mixture.rests[0]
    assert (rest.start, rest.order["kind"]) == (8, "random")
    assert plan.mixture.segments[-1].start == len(_mix())  # and from the next epoch on


def _recut_three(plan: ResumePlan) -> None:
    assert plan.point.history == [[2, [6, 6]]]  # the old level: each rank took 3 batches of 2
    assert plan.point.seed is not None and plan.point.consumed == 0
    assert plan.point.source is None  # state_dict() writes the re-cut position anew
    # 16 - 12 = 4 samples left for 3 ranks: torch's cut pads them, and the plan says so.
    assert any("resuming on 3 ranks" in w for w in plan.warnings)


PLANS = [
    Row(
        "same-loader",
        lambda: _saved(DataLoader(RangeDataset(N), batch_size=4), 2),
        lambda: DataLoader(RangeDataset(N), batch_size=4),
        expect={"point.consumed": 2, "point.cut": None, "point.epoch": 0, "mixture": None},
        check=lambda p: p.point.source is not None and p.chain is not None,
    ),
    Row(
        "epoch-delivered-to-its-end",
        lambda: _saved(DataLoader(RangeDataset(N), batch_size=4), 4),
        lambda: DataLoader(RangeDataset(N), batch_size=4),
        expect={"point.consumed": 0, "point.epoch": 1, "point.seed": None},
    ),
    Row(
        "another-batch-size-sequential",
        lambda: _saved(DataLoader(RangeDataset(N), batch_size=4), 2),
        lambda: DataLoader(RangeDataset(N), batch_size=3),
        expect={"point.consumed": 0, "point.cut": Cut(8), "point.batch": 3, "point.source": None},
    ),
    Row(
        "another-batch-size-shuffled",
        lambda: _saved(
            DataLoader(RangeDataset(N), batch_size=4, shuffle=True, generator=_gen()), 3
        ),
        lambda: DataLoader(RangeDataset(N), batch_size=5, shuffle=True),
        expect={"point.consumed": 0, "point.cut": Cut(12), "point.batch": 5},
        check=lambda p: p.point.seed is not None and p.chain is not None,
    ),
    Row(
        "fast-forwarded-sampler-with-its-generator",
        lambda: _saved(
            DataLoader(
                RangeDataset(N), batch_size=2, sampler=SubsetRandomSampler(range(N), _gen())
            ),
            2,
        ),
        lambda: DataLoader(
            RangeDataset(N), batch_size=2, sampler=SubsetRandomSampler(range(N), _gen(99))
        ),
        expect={"point.consumed": 2},
        check=lambda p: p.sampler_rng is not None,
    ),
    Row(
        "stateful-sampler",
        lambda: _saved(DataLoader(RangeDataset(16), batch_size=2, sampler=CursorSampler(16)), 3),
        lambda: DataLoader(RangeDataset(16), batch_size=2, sampler=CursorSampler(16)),
        expect={"point.consumed": 3, "point.drawn": 3, "point.stateful": True},
    ),
    Row(
        "mixture-same-weights",
        lambda: _saved(DataLoader(_mix(), batch_size=4), 2),
        lambda: DataLoader(_mix(), batch_size=4),
        expect={"mixture.applied": False, "warnings": ()},
    ),
    Row(
        "mixture-new-weights-sequential",
        lambda: _saved(DataLoader(_mix(), batch_size=4), 2),
        lambda: DataLoader(_mix(a=3, b=1), batch_size=4),
        check=_mixture_applied_from(8),
    ),
    Row(
        "mixture-new-weights-shuffled",
        lambda: _saved(DataLoader(_mix(), batch_size=4, shuffle=True, generator=_gen()), 2),
        lambda: DataLoader(_mix(a=3, b=1), batch_size=4, shuffle=True),
        check=_mixture_rest,
    ),
    Row(
        "mixture-new-weights-another-batch-size",
        lambda: _saved(DataLoader(_mix(), batch_size=4), 3),
        lambda: DataLoader(_mix(a=1, b=2), batch_size=5),
        expect={"point.cut": Cut(12), "point.batch": 5},
        check=_mixture_applied_from(12),
    ),
    Row(
        "distributed-same-world",
        lambda: _saved(_dist(2, 1), 2),
        lambda: _dist(2, 1),
        expect={"point.consumed": 2, "sampler_epoch": 0, "chain": None},
    ),
    Row(
        "distributed-global-state-on-three-ranks",
        lambda: _global(2, 3),
        lambda: _dist(3, 2),
        expect={"sampler_epoch": 0},
        check=_recut_three,
    ),
    Row(
        "distributed-global-state-another-batch-size",
        lambda: _global(2, 2, batch=2),
        lambda: _dist(2, 0, batch=3),
        expect={"point.history": [[2, [4, 4]]], "point.batch": 3},
    ),
    Row(
        "distributed-skip-then-three-ranks",
        lambda: skip_samples(_global(2, 1), 3),
        lambda: _dist(3, 0),
        # 16 - 4 taken - 3 skipped = 9 left, a multiple of 3: no warning; the skip level
        # stays in the history.
        expect={"point.history": [[2, [2, 2]], [1, [3]]], "point.skipped_samples": [[0, 4, 3]]},
        check=lambda p: not p.warnings,
    ),
    Row(
        "distributed-skip-then-two-ranks-account",
        lambda: skip_samples(_global(2, 1), 5),
        lambda: _dist(2, 0, batch=4),
        # 4 taken, 5 skipped, 7 left for 2 ranks (one padded): the 5 are not delivered.
        check=lambda p: any(
            "11 of the epoch's 16 samples are delivered" in w and "5 skipped by skip_samples" in w
            for w in p.warnings
        ),
    ),
    Row(
        "changed-data-continued",
        lambda: _saved(DataLoader(RangeDataset(N), batch_size=4), 1),
        lambda: DataLoader(RangeDataset(N + 4), batch_size=4),
        policy="continue",
        expect={"point.consumed": 1},
        check=lambda p: any("dataset_len" in c or "length" in c for c in p.changes),
    ),
]


REFUSALS = [
    Row(
        "not-a-dict",
        lambda: [1, 2],
        lambda: DataLoader(RangeDataset(N), batch_size=4),
        refused="expected a dict, got list",
    ),
    Row(
        "another-drop-last",
        lambda: _saved(DataLoader(RangeDataset(N), batch_size=4), 1),
        lambda: DataLoader(RangeDataset(N), batch_size=4, drop_last=True),
        refused="config.drop_last",
    ),
    Row(
        "another-sampler",
        lambda: _saved(DataLoader(RangeDataset(N), batch_size=4), 1),
        lambda: DataLoader(RangeDataset(N), batch_size=4, shuffle=True),
        refused="config.sampler",
    ),
    Row(
        "changed-data",
        lambda: _saved(DataLoader(RangeDataset(N), batch_size=4), 1),
        lambda: DataLoader(RangeDataset(N + 4), batch_size=4),
        refused="the data changed since the checkpoint",
    ),
    Row(
        "changed-data-past-its-end",
        lambda: _saved(DataLoader(RangeDataset(N), batch_size=2), 6),
        lambda: DataLoader(RangeDataset(8), batch_size=2),
        policy="continue",
        refused="an epoch of this loader has only 4",
    ),
    Row(
        "fast-forwarded-sampler-another-batch-size",
        lambda: _saved(
            DataLoader(RangeDataset(N), batch_size=4, sampler=EveryOtherReversedSampler(N)), 1
        ),
        lambda: DataLoader(RangeDataset(N), batch_size=2, sampler=EveryOtherReversedSampler(N)),
        refused="cannot be re-cut into other batches",
    ),
    Row(
        "stateful-sampler-another-batch-size",
        lambda: _saved(DataLoader(RangeDataset(16), batch_size=4, sampler=CursorSampler(16)), 1),
        lambda: DataLoader(RangeDataset(16), batch_size=2, sampler=CursorSampler(16)),
        refused="a sampler with its own state_dict()",
    ),
    Row(
        "stream-another-batch-size",
        lambda: DataLoader(ShardedStream(8), batch_size=2).state_dict(),
        lambda: DataLoader(ShardedStream(8), batch_size=4),
        refused="config.batch_size",
    ),
    Row(
        "a-batch-sampler-passed-in",
        lambda: _saved(DataLoader(RangeDataset(N), batch_size=4), 1),
        lambda: DataLoader(
            RangeDataset(N), batch_sampler=BatchSampler(SequentialSampler(range(N)), 3, False)
        ),
        refused="this loader's come from a batch_sampler",
    ),
    Row(
        "one-rank-another-batch-size",
        lambda: _saved(_dist(2, 0), 1),
        lambda: _dist(2, 0, batch=4),
        refused="load the job's global state",
    ),
    Row(
        "one-rank-another-world-size",
        lambda: _saved(_dist(2, 0), 1),
        lambda: _dist(3, 0),
        refused="config.world_size",
    ),
    # Every rank checks every entry of a global state: all ranks refuse it, or none.
    Row(
        "global-state-another-rank-past-its-share",
        lambda: _with_rank(_global(2, 1), 1, consumed=9),
        lambda: _dist(2, 0),
        refused="ranks[1].consumed: the state of rank 1 has 9 batches consumed",
    ),
    Row(
        "global-state-another-rank-past-its-share-re-cut",
        lambda: _with_rank(_global(2, 1), 1, consumed=9),
        lambda: _dist(3, 0),
        refused="ranks[1].consumed: the state of rank 1 has 9 batches of 2 consumed",
    ),
    Row(
        "global-state-another-rank-damaged-seed",
        lambda: _with_rank(_global(2, 1), 1, seed=123),
        lambda: _dist(2, 0),
        refused="ranks[1].seed: the state of rank 1 has 123",
    ),
    Row(
        "global-state-another-rank-of-another-version",
        lambda: _with_rank(_global(2, 1), 1, version=99),
        lambda: _dist(2, 0),
        refused="(In ranks[1], the state of rank 1 of the global state",
    ),
    Row(
        "global-state-ranks-in-different-epochs",
        _mixed_epochs,
        lambda: _dist(2, 0),
        refused="the ranks' states are from different epochs",
    ),
    Row(
        "global-state-on-another-sampler",
        lambda: _global(2, 1),
        lambda: DataLoader(RangeDataset(N), batch_size=2),
        refused="Only torch's DistributedSampler's position can be re-cut",
    ),
    Row(
        "damaged-sample-cut",
        lambda: dict(
            _saved(DataLoader(RangeDataset(N), batch_size=4), 1),
            sample_cut={"start": N + 1, "holes": []},
        ),
        lambda: DataLoader(RangeDataset(N), batch_size=4),
        refused="sample_cut",
    ),
    Row(
        "generator-of-its-own-missing",
        lambda: _saved(
            DataLoader(
                RangeDataset(N), batch_size=2, sampler=SubsetRandomSampler(range(N), _gen())
            ),
            2,
        ),
        lambda: DataLoader(RangeDataset(N), batch_size=2, sampler=SubsetRandomSampler(range(N))),
        refused="the checkpoint's sampler drew from generator of its own",
    ),
    Row(
        "mixture-plan-on-another-dataset",
        # A state without its data record (written before dataset checks): only the plan
        # tells that it was a Mixture's.
        lambda: _drop(_saved(DataLoader(_mix(), batch_size=4), 1), "dataset"),
        lambda: DataLoader(RangeDataset(N), batch_size=4),
        refused="the state holds a Mixture's plan, but this loader's dataset is a RangeDataset",
    ),
    Row(
        "mixture-without-its-plan",
        lambda: _drop(_saved(DataLoader(_mix(), batch_size=4), 1), "data_plan", "dataset"),
        lambda: DataLoader(_mix(), batch_size=4),
        refused="missing, but this loader's dataset is a Mixture",
    ),
    Row(
        "mixture-new-weights-under-an-order-not-recomputed",
        lambda: _saved(DataLoader(_mix(), batch_size=4, sampler=EveryOtherReversedSampler(N)), 1),
        lambda: DataLoader(_mix(a=3, b=1), batch_size=4, sampler=EveryOtherReversedSampler(N)),
        refused="cannot apply from the resume point",
    ),
    Row(
        "mixture-sources-changed",
        lambda: _saved(DataLoader(_mix(), batch_size=4), 1),
        lambda: DataLoader(
            Mixture({"a": RangeDataset(10), "b": RangeDataset(7)}, {"a": 1, "b": 1}, seed=3),
            batch_size=4,
        ),
        refused="source 'b' had 6 items in the checkpoint, now 7",
    ),
    # Fields that disagree with the rest of the state (docs/guarantees.md: a damaged state is
    # refused, naming the field, rather than resumed at another sample).
    Row(
        "delivered-ahead-past-the-epoch",
        lambda: dict(_saved(DataLoader(RangeDataset(N), batch_size=4), 1), delivered_ahead=[4]),
        lambda: DataLoader(RangeDataset(N), batch_size=4),
        refused="delivered_ahead: the state has batch 4 delivered ahead, but an epoch of this "
        "loader has only 4 batches",
    ),
    Row(
        "delivered-ahead-past-the-rank-share",
        lambda: dict(_saved(_dist(2, 0), 1), delivered_ahead=[4]),
        lambda: _dist(2, 0),
        refused="but this rank's share of the epoch has only 4 batches",
    ),
    Row(
        "delivered-ahead-not-drawn",
        lambda: dict(
            _saved(DataLoader(RangeDataset(16), batch_size=4, sampler=CursorSampler(16)), 1),
            delivered_ahead=[3],
        ),
        lambda: DataLoader(RangeDataset(16), batch_size=4, sampler=CursorSampler(16)),
        refused="delivered_ahead: batch 3 delivered ahead, but only",
    ),
    Row(
        "seed-past-63-bits",
        lambda: dict(_saved(DataLoader(RangeDataset(N), batch_size=4), 1), seed=2**64),
        lambda: DataLoader(RangeDataset(N), batch_size=4),
        refused="seed: expected None or an int in [0, 2**63)",
    ),
    Row(
        "skipped-task-past-the-epoch",
        lambda: dict(
            _saved(DataLoader(RangeDataset(N), batch_size=4), 1), skipped=[[0, N, [1, 2]]]
        ),
        lambda: DataLoader(RangeDataset(N), batch_size=4),
        refused=f"skipped: task {N} of epoch 0 (the state's) was skipped",
    ),
    Row(
        "stream-consumed-past-what-the-workers-delivered",
        lambda: dict(_saved(DataLoader(ShardedStream(8), batch_size=2), 1), consumed=2),
        lambda: DataLoader(ShardedStream(8), batch_size=2),
        refused="consumed: 2 batches consumed, but the workers delivered only 1",
    ),
    Row(
        "mixture-plan-of-another-length",
        lambda: _with_plan(_saved(DataLoader(_mix(), batch_size=4), 1), num_samples=N + 1),
        lambda: DataLoader(_mix(), batch_size=4),
        refused=f"data_plan.num_samples: {N + 1}, but the state's config.dataset_len",
    ),
    Row(
        "mixture-plan-of-another-epoch",
        lambda: _with_plan(_saved(DataLoader(_mix(), batch_size=4), 1), epoch=3),
        lambda: DataLoader(_mix(), batch_size=4),
        refused="data_plan.epoch: 3, but the state is inside epoch 0",
    ),
]


def _with_plan(state: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return dict(state, data_plan=dict(state["data_plan"], **changes))


def _plan(row: Row) -> ResumePlan:
    state = row.saved()
    loader = row.loader()
    try:
        return plan_resume(state, loader._shape(), row.policy)
    finally:
        loader.close()


@pytest.mark.parametrize("row", PLANS, ids=[r.name for r in PLANS])
def test_the_plan_of_a_state(row: Row) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # planning warns of nothing: the plan carries it
        plan = _plan(row)
    for path, value in row.expect.items():
        assert _get(plan, path) == value, path
    if row.check is not None:
        assert row.check(plan) is not False


@pytest.mark.parametrize("row", REFUSALS, ids=[r.name for r in REFUSALS])
def test_a_refused_state_names_what_does_not_fit(row: Row) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointError) as info:
            _plan(row)
    assert row.refused in str(info.value)


def _snapshot(loader: DataLoader) -> dict[str, Any]:
    """What a load could change, as values: the state, the sampler's epoch and generator,
    the loader's generator, the Mixture's plan."""
    sampler = loader.sampler
    gens = [loader.generator, getattr(sampler, "generator", None)]
    out = {
        "state": loader.state_dict(),
        "sampler_epoch": getattr(sampler, "epoch", None),
        "generators": [g.get_state().tolist() if g is not None else None for g in gens],
        "global_rng": torch.get_rng_state().tolist(),
    }
    if isinstance(loader.dataset, Mixture):
        out["mixture"] = (loader.dataset.state_dict(), loader.dataset.history)
    return out


@pytest.mark.parametrize("row", REFUSALS, ids=[r.name for r in REFUSALS])
def test_a_refused_state_leaves_the_loader_as_it_was(row: Row) -> None:
    state = row.saved()
    loader = row.loader()
    try:
        it = iter(loader)
        next(it)
        before = _snapshot(loader)
        with pytest.raises(CheckpointError):
            loader.load_state_dict(state, on_dataset_change=row.policy)
        assert _snapshot(loader) == before
        # The iterator the refused load would have abandoned goes on to the epoch's end.
        rest = list(it)
        if not isinstance(loader.dataset, IterableDataset):
            assert 1 + len(rest) == len(loader)
    finally:
        loader.close()


def test_a_plan_is_frozen_and_planning_changes_nothing() -> None:
    saved = _saved(DataLoader(_mix(), batch_size=4, shuffle=True, generator=_gen()), 2)
    loader = DataLoader(_mix(a=3, b=1), batch_size=4, shuffle=True, generator=_gen(5))
    before = _snapshot(loader)
    plan = plan_resume(saved, loader._shape(), "raise")
    assert _snapshot(loader) == before  # new weights planned, not installed
    with pytest.raises(FrozenInstanceError):
        plan.chain = None  # type: ignore[misc]
    loader.load_state_dict(saved)
    assert loader.dataset.history[-1][1] == {"a": 3, "b": 1}
