"""A ``Stream`` under our ``DataLoader``: an exact resume on the same layout (ranks, workers,
batch size), at every position of a small two-epoch run, compared with the uninterrupted run;
every sample of each epoch exactly once; the state through the codec, and through a killed and
restarted process. And the Stream under torch's own ``DataLoader``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import _stream_shards as F
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_loader import CheckpointError, DataLoader, Stream, dump_state, load_state
from resumable_loader.testing import kill_at

JOB = str(Path(__file__).parents[1] / "_stream_job.py")
SHARDS = 16
EPOCHS = 2


def _make(partitions: int = 8, seed: int = 0, shards: int = SHARDS) -> Stream:
    return Stream.from_shards(list(range(shards)), F.read, partitions=partitions, seed=seed).map(
        F.plus_half
    )


def _loader(stream: Stream, workers: int, batch: int, persistent: bool = False) -> DataLoader:
    return DataLoader(
        stream, batch_size=batch, num_workers=workers, persistent_workers=persistent and workers > 0
    )


def _run(
    workers: int,
    batch: int,
    *,
    persistent: bool = False,
    partitions: int = 8,
    seed: int = 0,
    state: Any = None,
    stop: int | None = None,
) -> tuple[list[tuple[int, list[float]]], Any]:
    """The README's loop over EPOCHS epochs: (epoch, batch) pairs, and the state at ``stop``."""
    loader = _loader(_make(partitions, seed), workers, batch, persistent)
    start = 0
    if state is not None:
        loader.load_state_dict(state)
        start = state["epoch"]
    out: list[tuple[int, list[float]]] = []
    try:
        for epoch in range(start, EPOCHS):
            for b in loader:
                out.append((epoch, b.tolist()))
                if len(out) == stop:
                    return out, load_state(dump_state(loader.state_dict()))
    finally:
        del loader
    return out, None


def _exactly_once(run: list[tuple[int, list[float]]]) -> None:
    for epoch in range(EPOCHS):
        got = sorted(x for e, b in run if e == epoch for x in b)
        assert got == [x + 0.5 for x in F.all_samples(list(range(SHARDS)))], epoch


_REFS: dict[tuple[int, int, bool], list[tuple[int, list[float]]]] = {}


def _ref(workers: int, batch: int, persistent: bool = False) -> list[tuple[int, list[float]]]:
    key = (workers, batch, persistent)
    if key not in _REFS:
        _REFS[key] = _run(workers, batch, persistent=persistent)[0]
    return _REFS[key]


def test_every_epoch_is_every_sample_once_and_epochs_differ() -> None:
    for workers in (0, 2):
        ref = _ref(workers, 3)
        _exactly_once(ref)
        e0 = [x for e, b in ref if e == 0 for x in b]
        e1 = [x for e, b in ref if e == 1 for x in b]
        assert e0 != e1  # a new shard order each pass


def test_persistent_workers_follow_the_epoch() -> None:
    ref = _ref(2, 3, persistent=True)
    _exactly_once(ref)
    assert ref == _ref(2, 3)


def test_num_workers_0_resumes_exactly_at_every_position() -> None:
    ref = _ref(0, 3)
    for k in range(1, len(ref) + 1):
        head, state = _run(0, 3, stop=k)
        assert state is not None
        rest, _ = _run(0, 3, state=state)
        assert head + rest == ref, k


@given(
    k=st.integers(1, 60),
    batch=st.integers(1, 7),
    partitions=st.sampled_from([1, 2, 4, 8, 16]),
    seed=st.integers(0, 5),
)
@settings(max_examples=25, deadline=None)
def test_num_workers_0_resumes_exactly_for_any_batch_size_and_partitions(
    k: int, batch: int, partitions: int, seed: int
) -> None:
    ref, _ = _run(0, batch, partitions=partitions, seed=seed)
    k = min(k, len(ref))
    head, state = _run(0, batch, partitions=partitions, seed=seed, stop=k)
    rest, _ = _run(0, batch, partitions=partitions, seed=seed, state=state)
    assert head + rest == ref
    _exactly_once(ref)


@pytest.mark.parametrize("persistent", [False, True])
def test_two_workers_resume_exactly(persistent: bool) -> None:
    ref = _ref(2, 3, persistent)
    n0 = sum(1 for e, _ in ref if e == 0)
    for k in (1, 4, n0 - 1, n0, n0 + 2, len(ref) - 1):
        head, state = _run(2, 3, persistent=persistent, stop=k)
        assert state is not None
        # O(P) state: each worker holds the cursors of its own partitions, nothing else.
        held = [
            sorted(p for p in w["dataset_state"] if p != "stream")
            for w in state["workers"]
            if w["dataset_state"]
        ]
        assert all(len(h) == 4 for h in held) and len({p for h in held for p in h}) == sum(
            map(len, held)
        )
        rest, _ = _run(2, 3, persistent=persistent, state=state)
        assert head + rest == ref, k


@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_read_disjoint_partitions_and_each_resumes_exactly(
    monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """Two ranks (the world size and rank a Stream reads from torch.distributed, stubbed here:
    one process plays each rank in turn; forked workers inherit the stub): together every
    sample once, and each rank's own state resumes that rank exactly."""
    import resumable_loader.plans.stream as stream_module

    seen: list[float] = []
    for rank in range(2):
        monkeypatch.setattr(stream_module, "_world", lambda rank=rank: (2, rank))
        ref, _ = _run(workers, 2)
        rank0 = [x for e, b in ref if e == 0 for x in b]
        seen += rank0
        head, state = _run(workers, 2, stop=5)
        rest, _ = _run(workers, 2, state=state)
        assert head + rest == ref
    assert sorted(seen) == [x + 0.5 for x in F.all_samples(list(range(SHARDS)))]


def test_a_killed_worker_is_replaced_and_the_epoch_is_unchanged() -> None:
    """A respawned worker restores its partitions from the cursors of the last result the
    main process received: the batches are the uninterrupted run's."""
    ref = [b for e, b in _ref(2, 3) if e == 0]
    loader = _loader(_make(), 2, 3)
    got = [
        b.tolist() for b in kill_at(loader, {2: [(0, signal.SIGKILL)], 6: [(1, signal.SIGKILL)]})
    ]
    assert got == ref


@pytest.mark.slow
def test_two_workers_resume_exactly_at_every_position() -> None:
    ref = _ref(2, 3)
    for k in range(1, len(ref) + 1):
        head, state = _run(2, 3, stop=k)
        rest, _ = _run(2, 3, state=state)
        assert head + rest == ref, k


def test_a_killed_process_resumes_exactly(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    base = {
        "shards": SHARDS,
        "partitions": 8,
        "workers": 2,
        "persistent": False,
        "batch_size": 3,
        "epochs": EPOCHS,
    }

    def job(**kw: Any) -> subprocess.CompletedProcess[str]:
        spec = dict(base, **kw)
        return subprocess.run(
            [sys.executable, JOB, json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    ref_out, out, state = tmp_path / "ref", tmp_path / "out", tmp_path / "state"
    assert job(out=str(ref_out)).returncode == 0
    killed = job(out=str(out), stop=9, state_out=str(state))
    assert killed.returncode == -9, killed.stderr
    assert job(out=str(out), state_in=str(state)).returncode == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    ref = [json.loads(x) for x in ref_out.read_text().splitlines()]
    assert lines == ref
    # The script is the test's loop: its uninterrupted run is the in-process one.
    assert ref == [[e, b] for e, b in _ref(2, 3)]


def test_a_resume_reads_only_what_it_delivers_no_replay(tmp_path: Path) -> None:
    """The state rides with every batch: a resumed worker seeks each partition to its cursor
    and reads nothing twice -- the samples it reads are exactly the ones it delivers."""
    log = str(tmp_path / "reads")

    def loader() -> DataLoader:
        s = Stream.from_shards(list(range(SHARDS)), F.Counted(log), partitions=8)
        return DataLoader(s, batch_size=3, num_workers=2)

    first = loader()
    it = iter(first)
    head = [x for _ in range(5) for x in next(it).tolist()]
    state = load_state(dump_state(first.state_dict()))
    del it, first
    os.unlink(log)
    second = loader()
    second.load_state_dict(state)
    rest = [x for b in second for x in b.tolist()]
    reads = F.reads(log)
    assert sorted(head + rest) == F.all_samples(list(range(SHARDS)))
    assert sorted(F.sample(s, i) for s, i in reads) == sorted(rest)


def test_another_shard_list_is_refused() -> None:
    _, state = _run(0, 3, stop=4)
    loader = _loader(_make(shards=SHARDS + 1), 0, 3)
    # The workers' Stream states name the shard list (or the loader's record, the fingerprint).
    with pytest.raises(CheckpointError, match=r"fingerprint|shards\.count"):
        loader.load_state_dict(state)


def test_readers_that_do_not_divide_the_partitions_are_refused() -> None:
    loader = _loader(_make(partitions=8), 3, 3)
    with pytest.raises(ValueError, match=r"3 readers do not divide them.*1, 2, 4, 8"):
        list(loader)


def test_under_torch_dataloader_every_sample_once_and_set_epoch_reshuffles() -> None:
    for workers in (0, 2):
        s = _make()
        loader = torch.utils.data.DataLoader(s, batch_size=3, num_workers=workers)
        epochs = []
        for e in range(2):
            s.set_epoch(e)
            epochs.append([x for b in loader for x in b.tolist()])
        for got in epochs:
            assert sorted(got) == [x + 0.5 for x in F.all_samples(list(range(SHARDS)))]
        assert epochs[0] != epochs[1]
        if workers == 0:
            assert [x for e, b in _ref(0, 3) for x in b] == epochs[0] + epochs[1]


def test_under_torch_dataloader_num_workers_0_the_stream_state_resumes() -> None:
    s = _make()
    loader = torch.utils.data.DataLoader(s, batch_size=3)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(5)]
    state = s.state_dict()
    t = _make()
    t.load_state_dict(state)
    rest = [b.tolist() for b in torch.utils.data.DataLoader(t, batch_size=3)]
    ref = [b.tolist() for b in torch.utils.data.DataLoader(_make(), batch_size=3)]
    assert [x for b in head + rest for x in b] == [x for b in ref for x in b]
