"""A shuffled ``Stream`` (``Stream.shuffle``) under our ``DataLoader``, each run compared with
the uninterrupted run: on the same layout a resume is bit-identical, also after a worker or the
whole job was SIGKILLed while a shuffle window was half filled, and after a read error inside a
fill; on another layout (workers, batch size, simulated ranks) every row of the epoch comes
once and each partition's rows are the uninterrupted run's, in its order. The stream has a
filter before the shuffle and a map and a filter after it (``tests/_shuffle_job.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _shuffle_job as J
import _stream_shards as F
import pytest
import torch

from resumable_loader import (
    CheckpointError,
    DataLoader,
    RetryPolicy,
    Stream,
    dump_state,
    load_state,
    merge_rank_states,
)
from resumable_loader.plans.streams import deal

JOB = str(Path(__file__).parents[1] / "_shuffle_job.py")
B = 3
EPOCHS = 2
Run = list[tuple[int, list[float]]]


def _run(
    workers: int,
    batch: int,
    *,
    read: Any = F.read,
    state: Any = None,
    stop: int | None = None,
    retry: RetryPolicy | None = None,
) -> tuple[Run, Any]:
    """EPOCHS epochs from ``state`` (or the start): (epoch, batch) pairs, and the state after
    ``stop`` batches."""
    loader = DataLoader(
        J.make(B, read), batch_size=batch, num_workers=workers, retry=retry, stream_tail=None
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


_REFS: dict[tuple[int, int], Run] = {}


def _ref(workers: int, batch: int) -> Run:
    if (workers, batch) not in _REFS:
        _REFS[workers, batch] = _run(workers, batch)[0]
    return _REFS[workers, batch]


def _partition_of(epoch: int) -> dict[int, int]:
    """Shard -> the partition that reads it in pass ``epoch``."""
    parts = deal(0, epoch, J.SHARDS, J.PARTITIONS, True)
    return {s: p for p, shards in enumerate(parts) for s in shards}


def _per_partition(run: Run, epoch: int) -> dict[int, list[float]]:
    where = _partition_of(epoch)
    out: dict[int, list[float]] = {}
    for e, b in run:
        if e == epoch:
            for x in b:
                out.setdefault(where[int(x) // 1000], []).append(x)
    return out


def _check_rows(run: Run, ref: Run, epochs: int = EPOCHS) -> None:
    """Every row of each epoch once, and each partition's rows in the reference's order."""
    for epoch in range(epochs):
        assert sorted(x for e, b in run if e == epoch for x in b) == J.expected_samples(), epoch
        assert _per_partition(run, epoch) == _per_partition(ref, epoch), epoch


def _mid_fill_target() -> tuple[int, int]:
    """(shard, i) of a sample read in the middle of a window's fill: the second input item of
    window 1 (the shuffle's input, after the filter before it) of a partition in pass 0."""
    plain = Stream.from_shards(list(range(J.SHARDS)), F.read, partitions=J.PARTITIONS)
    seq = _per_partition([(0, [float(x) for x in plain.filter(J.keep_before)])], 0)
    longest = max(seq.values(), key=len)
    assert len(longest) > B + 1
    return divmod(int(longest[B + 1]), 1000)


# ---- the same layout ----


def test_a_pass_is_every_row_once_and_shuffled_within_partitions() -> None:
    ref = _ref(0, 3)
    _check_rows(ref, ref)
    unshuffled = list(
        Stream.from_shards(list(range(J.SHARDS)), F.read, partitions=J.PARTITIONS)
        .filter(J.keep_before)
        .map(F.plus_half)
        .filter(J.keep_after)
    )
    assert [x for e, b in ref if e == 0 for x in b] != unshuffled
    assert _ref(2, 3) != ref  # the workers' interleave differs; each partition's rows do not
    _check_rows(_ref(2, 3), ref)


@pytest.mark.parametrize("workers", [0, 2])
def test_same_layout_resumes_bit_identically(workers: int) -> None:
    ref = _ref(workers, 3)
    n0 = sum(1 for e, _ in ref if e == 0)
    for k in (2, 5, n0 + 3):  # inside windows of epoch 0, and in epoch 1
        head, state = _run(workers, 3, stop=k)
        rest, _ = _run(workers, 3, state=state)
        assert head + rest == ref, k


def test_a_worker_killed_while_a_window_is_half_filled_is_replaced_exactly(
    tmp_path: Path,
) -> None:
    """The worker owning the target's partition SIGKILLs itself in the middle of a window's
    fill; its replacement restores from the last received cursor (the window's start) and the
    epochs are the uninterrupted run's."""
    marker = str(tmp_path / "died")
    got, _ = _run(2, 3, read=J.DieOnce(marker, F.sample(*_mid_fill_target()), "worker"))
    assert os.path.exists(marker)  # it did die
    assert got == _ref(2, 3)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_read_error_inside_a_window_fill_loses_nothing(tmp_path: Path, workers: int) -> None:
    marker = str(tmp_path / "raised")
    read = J.DieOnce(marker, F.sample(*_mid_fill_target()), "raise")
    got, _ = _run(workers, 3, read=read, retry=RetryPolicy(backoff_s=0.0))
    assert os.path.exists(marker)
    assert got == _ref(workers, 3)


def _job(spec: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(
        [sys.executable, JOB, json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,  # the job's own process group: its kill takes only the job
    )


@pytest.mark.parametrize("workers", [2, pytest.param(0, marks=pytest.mark.slow)])
def test_a_job_killed_while_a_window_is_half_filled_resumes_bit_identically(
    tmp_path: Path, workers: int
) -> None:
    """The whole job (main process and workers, one process group) is SIGKILLed when a
    reader is in the middle of a window's fill, as a preemption kills it; the restarted job
    loads its last checkpoint (saved after every batch) and its batches are the uninterrupted
    run's, bit for bit."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    spec = {
        "buffer_size": B,
        "workers": workers,
        "batch_size": 3,
        "epochs": EPOCHS,
        "out": str(out),
        "ckpt": str(ckpt),
        "marker": str(tmp_path / "died"),
        "target": list(_mid_fill_target()),
    }
    killed = _job(spec)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    n = json.loads(ckpt.read_text())["n"]
    ref = [[e, b] for e, b in _ref(workers, 3)]
    assert 0 < n < len(ref)  # it died mid-run, after a checkpoint
    resumed = _job(spec)
    assert resumed.returncode == 0, resumed.stderr
    assert [json.loads(x) for x in out.read_text().splitlines()] == ref


# ---- another layout ----


@pytest.mark.parametrize(
    ("saved", "now"),
    [
        ((2, 3), (0, 4)),
        ((1, 4), (2, 1)),
        pytest.param((0, 3), (4, 2), marks=pytest.mark.slow),
        pytest.param((4, 2), (1, 5), marks=pytest.mark.slow),
    ],
)
def test_another_layout_every_row_once_in_partition_order(
    saved: tuple[int, int], now: tuple[int, int]
) -> None:
    ref = _ref(*saved)
    n0 = sum(1 for e, _ in ref if e == 0)
    for k in (2, n0 // 2, n0 + 1):
        head, state = _run(*saved, stop=k)
        rest, _ = _run(*now, state=state)
        _check_rows(head + rest, ref)


@contextlib.contextmanager
def _as_rank(mp: pytest.MonkeyPatch, world: int, rank: int) -> Iterator[None]:
    """torch.distributed's world as the Stream and the loader read it (as in
    test_streams_elastic.py; forked workers inherit it)."""
    with mp.context() as m:
        m.setattr(torch.distributed, "is_available", lambda: True)
        m.setattr(torch.distributed, "is_initialized", lambda: True)
        m.setattr(torch.distributed, "get_world_size", lambda *a, **k: world)
        m.setattr(torch.distributed, "get_rank", lambda *a, **k: rank)
        yield


def _job_epoch0(
    mp: pytest.MonkeyPatch, world: int, workers: int, batch: int, state: Any = None, stop: int = 0
) -> tuple[list[float], Any]:
    """Epoch 0 on ``world`` simulated ranks, one after the other: the rows they delivered, and
    (``stop``) the job's global state after each consumed ``stop`` batches."""
    got: list[float] = []
    states = []
    for r in range(world):
        with _as_rank(mp, world, r):
            loader = DataLoader(J.make(B), batch_size=batch, num_workers=workers, stream_tail=None)
            if state is not None:
                loader.load_state_dict(state)
            for i, b in enumerate(loader, 1):
                got += b.tolist()
                if i == stop:
                    break
            states.append(load_state(dump_state(loader.state_dict())))
            assert stop == 0 or states[-1]["epoch"] == 0  # no rank ran out of its share
            del loader
    return got, merge_rank_states(states)


@pytest.mark.parametrize(
    ("saved", "now"), [((2, 1, 3), (4, 0, 2)), ((1, 2, 3), (2, 2, 5)), ((4, 0, 2), (8, 0, 1))]
)
def test_a_global_state_resumes_on_other_ranks_every_row_once_in_partition_order(
    monkeypatch: pytest.MonkeyPatch, saved: tuple[int, int, int], now: tuple[int, int, int]
) -> None:
    ref = [(e, b) for e, b in _ref(0, 3) if e == 0]
    head, state = _job_epoch0(monkeypatch, *saved, stop=2)
    rest, _ = _job_epoch0(monkeypatch, *now, state=state)
    _check_rows([(0, head + rest)], ref, epochs=1)


def test_a_re_dealt_state_re_reads_at_most_b_per_partition(tmp_path: Path) -> None:
    """On another layout each partition continues at its cursor, refilling the window it was
    in: of the rows delivered before the save, the resumed run reads at most B per partition
    again (a counting reader logs every sample read)."""
    log = str(tmp_path / "reads")
    ref = [(e, b) for e, b in _ref(2, 3) if e == 0]
    head, state = _run(2, 3, stop=4)
    loader = DataLoader(J.make(B, F.Counted(log)), batch_size=5, num_workers=1)
    loader.load_state_dict(state)
    rest = [x for b in loader for x in b.tolist()]  # the rest of epoch 0
    del loader
    _check_rows([(0, [x for _, b in head for x in b] + rest)], ref, epochs=1)
    before = {x for _, b in head for x in b}
    where = _partition_of(0)
    again: dict[int, int] = {}
    for s_, i in F.reads(log):
        if F.sample(s_, i) + 0.5 in before:
            again[where[s_]] = again.get(where[s_], 0) + 1
    assert again and max(again.values()) <= B, again


def test_a_state_of_another_buffer_size_is_refused_naming_the_pipeline() -> None:
    _, state = _run(0, 3, stop=3)
    loader = DataLoader(J.make(B + 1), batch_size=3)
    # Refused at load (the main process checks every worker's Stream state), the loader
    # left as it was.
    with pytest.raises(CheckpointError, match=r"stream.pipeline .* 'shuffle\(B=3\)'.*must be"):
        loader.load_state_dict(state)
    del loader
