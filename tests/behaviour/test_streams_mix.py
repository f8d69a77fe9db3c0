"""``Stream.mix`` under our DataLoader: a state resumes bit-identically on the same layout
(with workers), on another ``num_workers`` and batch size every source item of the epoch once
with each partition's rows those of the uninterrupted run, and new weights at a resume reach
the workers (a source weighted 0 gives nothing after the resume point)."""

from __future__ import annotations

import signal
from typing import Any

import _stream_mix_sources as X
import pytest
import torch

from resumable_loader import (
    CheckpointError,
    DataLoader,
    Stream,
    dump_state,
    load_state,
    merge_rank_states,
)
from resumable_loader.testing import kill_at

SIZES = {"web": (32, 4), "code": (16, 4)}
WEIGHTS = {"web": 3, "code": 1}
EPOCHS = 2
Run = list[tuple[int, list[int]]]


def _make(weights: dict[str, int] = WEIGHTS, policy: str = "renormalize") -> Stream:
    return Stream.mix(
        {name: X.source(name, *SIZES[name]) for name in SIZES}, weights, on_exhausted=policy
    )


def _run(
    workers: int,
    batch: int,
    state: Any = None,
    stop: int | None = None,
    weights: dict[str, int] = WEIGHTS,
    policy: str = "renormalize",
) -> tuple[Run, Any]:
    """Epochs 0..EPOCHS-1 from ``state`` (or the start); the state after ``stop`` batches."""
    loader = DataLoader(
        _make(weights, policy), batch_size=batch, num_workers=workers, stream_tail=None
    )
    start = 0
    if state is not None:
        loader.load_state_dict(state)
        start = state["epoch"]
    out: Run = []
    try:
        for epoch in range(start, EPOCHS):
            for b in loader:
                out.append((epoch, b.tolist()))
                if len(out) == stop:
                    return out, load_state(dump_state(loader.state_dict()))
    finally:
        del loader
    return out, None


def _per_partition(run: Run, epoch: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e, b in run:
        if e == epoch:
            for x in b:
                out.setdefault(X.partition_of(x, SIZES, epoch), []).append(x)
    return out


def _every_item_once(run: Run) -> None:
    """Under "renormalize" an epoch is every item of every source, once."""
    for epoch in range(EPOCHS):
        got = sorted(x for e, b in run if e == epoch for x in b)
        want = sorted(
            x
            for name, (n, p) in SIZES.items()
            for q in range(p)
            for x in X.source_rows(name, n, p, q, epoch)
        )
        assert got == want, epoch


@pytest.mark.parametrize(("workers", "policy"), [(0, "stop"), (2, "renormalize"), (2, "stop")])
def test_same_layout_resumes_bit_identically(workers: int, policy: str) -> None:
    ref, _ = _run(workers, 3, policy=policy)
    if policy == "renormalize":
        _every_item_once(ref)
    for stop in (1, 7, len(ref) // 2 + 3):
        head, state = _run(workers, 3, stop=stop, policy=policy)
        rest, _ = _run(workers, 3, state=state, policy=policy)
        assert head + rest == ref, stop


@pytest.mark.parametrize(("now_workers", "now_batch"), [(0, 5), (1, 2), (4, 4)])
def test_another_layout_delivers_every_item_once_in_partition_order(
    now_workers: int, now_batch: int
) -> None:
    ref, _ = _run(2, 3)
    head, state = _run(2, 3, stop=9)
    rest, _ = _run(now_workers, now_batch, state=state)
    _every_item_once(head + rest)
    for epoch in range(EPOCHS):
        assert _per_partition(head + rest, epoch) == _per_partition(ref, epoch), epoch


def test_new_weights_at_a_resume_reach_the_workers_and_survive_another_resume() -> None:
    head, state = _run(2, 3, stop=6)
    new = {"web": 1, "code": 0}
    cont, _ = _run(2, 3, state=state, weights=new)
    first = [x for e, b in cont if e == 0 for x in b]
    assert not [x for x in first if X.source_of(x) == "code"]
    got = [x for e, b in head + cont if e == 0 for x in b]
    assert len(got) == len(set(got))
    # Epoch 1 draws only web, every web item once ("renormalize": code is weighted 0 and is
    # never drawn, web runs to its end).
    epoch1 = sorted(x for e, b in cont if e == 1 for x in b)
    assert epoch1 == sorted(x for q in range(4) for x in X.source_rows("web", 32, 4, q, 1))
    # Saved again after the change and resumed with the same weights: the continuation of
    # the first resumed run, on the same layout and on another.
    mid, state2 = _run(2, 3, state=state, weights=new, stop=4)
    assert mid == cont[:4]
    again, _ = _run(2, 3, state=state2, weights=new)
    assert mid + again == cont
    other, _ = _run(0, 5, state=state2, weights=new)
    for epoch in range(EPOCHS):
        assert _per_partition(mid + other, epoch) == _per_partition(cont, epoch), epoch
    assert state2["workers"][0]["dataset_state"]["stream"]["mix"]["weights"] == [WEIGHTS, new]


def test_a_killed_worker_is_replaced_and_the_mixed_epoch_is_unchanged() -> None:
    """A respawned worker rebuilds its mixed partitions (every source's chain) from the last
    received cursors: the batches are the uninterrupted run's."""
    ref = [b for e, b in _run(2, 3)[0] if e == 0]
    loader = DataLoader(_make(), batch_size=3, num_workers=2)
    got = [
        b.tolist() for b in kill_at(loader, {2: [(0, signal.SIGKILL)], 9: [(1, signal.SIGKILL)]})
    ]
    assert got == ref


def test_the_loader_refuses_a_state_of_a_mixture_of_other_sources() -> None:
    _, state = _run(0, 3, stop=2)
    other = Stream.mix(
        {"web": X.source("web", 32, 4), "code": X.source("code", 12, 4)},
        WEIGHTS,
        on_exhausted="renormalize",
    )
    loader = DataLoader(other, batch_size=3)
    # The workers' Stream states name the source (or the loader's record, the fingerprint).
    with pytest.raises(CheckpointError, match=r"fingerprint|sources\['code'\]"):
        loader.load_state_dict(state)


def _job_epoch0(
    monkeypatch: pytest.MonkeyPatch,
    world: int,
    workers: int,
    batch: int,
    state: Any = None,
    stop: int | None = None,
    weights: dict[str, int] = WEIGHTS,
) -> tuple[list[int], Any]:
    """Epoch 0 on ``world`` simulated ranks run one after the other: what they delivered, and
    (``stop``) the job's global state after each consumed ``stop`` batches."""
    got: list[int] = []
    states = []
    for r in range(world):
        with monkeypatch.context() as m:
            m.setattr(torch.distributed, "is_available", lambda: True)
            m.setattr(torch.distributed, "is_initialized", lambda: True)
            m.setattr(torch.distributed, "get_world_size", lambda *a, **k: world)
            m.setattr(torch.distributed, "get_rank", lambda *a, r=r, **k: r)
            loader = DataLoader(
                _make(weights), batch_size=batch, num_workers=workers, stream_tail=None
            )
            if state is not None:
                loader.load_state_dict(state)
            for i, b in enumerate(loader, 1):
                got += b.tolist()
                if i == stop:
                    break
            states.append(load_state(dump_state(loader.state_dict())))
            del loader
    return got, merge_rank_states(states) if stop is not None else None


def test_a_global_state_resumes_on_other_ranks_with_new_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Saved on 2 simulated ranks x 1 worker, resumed on 4 ranks x 0 workers with the same
    weights (every item once, partition order kept) and with code weighted 0 (nothing of code
    after the resume, no item twice)."""
    ref, _ = _run(0, 3)
    head, state = _job_epoch0(monkeypatch, 2, 1, 3, stop=4)
    rest, _ = _job_epoch0(monkeypatch, 4, 0, 2, state=state)
    run = [(0, head + rest)]
    want = sorted(x for e, b in ref if e == 0 for x in b)
    assert sorted(head + rest) == want
    assert _per_partition(run, 0) == _per_partition(ref, 0)
    rest, _ = _job_epoch0(monkeypatch, 4, 0, 2, state=state, weights={"web": 1, "code": 0})
    assert not [x for x in rest if X.source_of(x) == "code"]
    assert len(set(head + rest)) == len(head + rest)
    assert sorted(x for x in head + rest if X.source_of(x) == "web") == [
        x for x in want if X.source_of(x) == "web"
    ]
