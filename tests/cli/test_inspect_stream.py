"""``python -m resumable_loader inspect`` on a ``Stream``'s saved state (issue #33): the Stream
block (plan, passes, rows drawn, pending skips, counters) read from the state alone, the job's
block of a global state, and ``--check`` of the cursor table -- including files an attacker
wrote, which give a clear message and never a traceback."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _stream_shards as F
import pytest
import torch

from resumable_loader import DataLoader, Stream, dump_state, merge_rank_states, skip_samples
from resumable_loader.cli.main import main

# Every skip of a Stream's state warns that its rows are read in the workers (checked once,
# in test_a_skip_says_its_rows_are_read_not_delivered).
pytestmark = pytest.mark.filterwarnings("ignore:skip_samples. a Stream:RuntimeWarning")

SHARDS = 32
PARTITIONS = 4


def _state(workers: int = 2, batches: int = 3) -> dict[str, Any]:
    stream = Stream.from_shards(list(range(SHARDS)), F.read, partitions=PARTITIONS).filter(F.odd)
    loader = DataLoader(stream, batch_size=3, num_workers=workers, stream_tail=None)
    it = iter(loader)
    for _ in range(batches):
        next(it)
    state = loader.state_dict()
    del it, loader
    return state


def _cursors(state: dict[str, Any]) -> dict[int, list[int]]:
    return {
        p: c
        for w in state["workers"]
        if w["dataset_state"] is not None
        for p, c in w["dataset_state"].items()
        if p != "stream"
    }


def _inspect(tmp_path: Path, capsys: Any, state: Any, *flags: str) -> tuple[int, str]:
    path = tmp_path / "state.rls"
    path.write_bytes(dump_state(state))
    code = main(["inspect", str(path), *flags])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out


def test_inspect_shows_the_stream_block_from_the_state(tmp_path: Path, capsys: Any) -> None:
    state = skip_samples(_state(), 5)
    cursors = _cursors(state)
    rows = [c[2] for c in cursors.values()]
    code, out = _inspect(tmp_path, capsys, state, "--check")
    assert code == 0
    assert "stream           4 partitions, seed 0, shards 32 (sha256:" in out
    assert "pipeline read -> filter:odd" in out
    assert "epoch 0: 4 partitions in pass 0, 0 finished it" in out
    assert (
        f"rows drawn this pass per partition: min {min(rows)} / median "
        f"{sorted(rows)[(len(rows) - 1) // 2]} / max {max(rows)}; {sum(rows)} in all"
    ) in out
    assert statistics.median_low(rows) == sorted(rows)[(len(rows) - 1) // 2]
    assert "pending skips: 5 rows in" in out
    src = sum(c[6] for c in cursors.values())
    dropped = sum(c[7] for c in cursors.values())
    assert f"this pass: source samples read {src}, dropped by filters {dropped}" in out
    assert "check: ok (4 partition cursors)" in out


def test_inspect_shows_a_skip_that_a_partition_could_not_give(tmp_path: Path, capsys: Any) -> None:
    state = _state(workers=0)
    ds = state["workers"][0]["dataset_state"]
    ds[2][1], ds[2][3] = 1, 4  # finished its pass with 4 rows of its skip left
    code, out = _inspect(tmp_path, capsys, state, "--check")
    assert code == 0
    assert "1 finished it" in out
    assert "skips left on finished partitions (rows they could not give): 4 in partitions 2" in out


@contextlib.contextmanager
def _as_rank(monkeypatch: pytest.MonkeyPatch, world: int, rank: int) -> Iterator[None]:
    with monkeypatch.context() as m:
        m.setattr(torch.distributed, "is_available", lambda: True)
        m.setattr(torch.distributed, "is_initialized", lambda: True)
        m.setattr(torch.distributed, "get_world_size", lambda *a, **k: world)
        m.setattr(torch.distributed, "get_rank", lambda *a, **k: rank)
        yield


def test_inspect_a_global_state_shows_the_jobs_stream(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = []
    for r in range(2):
        with _as_rank(monkeypatch, 2, r):
            states.append(_state(workers=1, batches=2))
    code, out = _inspect(tmp_path, capsys, merge_rank_states(states), "--check")
    assert code == 0
    assert "the job's Stream (every rank's cursors)" in out
    assert "epoch 0: 4 partitions in pass 0" in out
    # Each rank's own block holds its half of the partitions.
    assert out.count("epoch 0: 2 partitions in pass 0, 0 finished it (this rank's partitions") == 2
    assert "check: ok (4 partition cursors)" in out


def test_check_names_a_cursor_in_the_wrong_worker(tmp_path: Path, capsys: Any) -> None:
    state = _state()
    w0, w1 = (w["dataset_state"] for w in state["workers"])
    p = next(k for k in w0 if k != "stream")
    w1[p] = w0.pop(p)
    code, out = _inspect(tmp_path, capsys, state, "--check")
    assert code == 1
    assert f"partition {p} is read by rank 0 worker 0, not by this one (rank 0 worker 1)" in out


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda h: h.update(partitions="many"), "stream.partitions: must be an int >= 1"),
        (lambda h: h.update(partitions=2**62), "more than the 32 shards"),
        (lambda h: h.update(fields=["rows"] * 10**4), "stream.fields: must be a list of names"),
        (lambda h: h.update(shards=[1, 2]), "stream.shards: must be"),
        (lambda h: h.update(pipeline={"x": 1}), "stream.pipeline: must be a list of str"),
        (lambda h: h.clear(), "stream.kind: None"),
    ],
    ids=["partitions-str", "partitions-huge", "fields", "shards", "pipeline", "empty"],
)
def test_an_attackers_stream_header_gives_a_clear_message(
    tmp_path: Path, capsys: Any, damage: Any, says: str
) -> None:
    state = _state()
    damage(state["workers"][0]["dataset_state"]["stream"])
    code, out = _inspect(tmp_path, capsys, state)
    assert code == 0  # the summary never fails on a state's contents
    assert "damaged: " in out and says in out
    code, out = _inspect(tmp_path, capsys, state, "--check")
    assert code == 1
    assert says in out.split("check: ", 1)[1]


def test_an_attackers_cursors_give_a_clear_message(tmp_path: Path, capsys: Any) -> None:
    state = _state()
    ds = state["workers"][0]["dataset_state"]
    ds[10**18] = [0] * 8
    ds["x" * 500] = "y"
    p = next(k for k in ds if k != "stream" and type(k) is int and k < PARTITIONS)
    ds[p] = [0, 7, -1, 0, 0, 9, 1, 0]
    code, out = _inspect(tmp_path, capsys, state, "--check")
    assert code == 1
    assert "key 1000000000000000000 is not a partition id" in out
    assert f"partition {p}: a cursor is 8 ints >= 0" in out


def test_check_on_a_state_that_is_not_a_streams(tmp_path: Path, capsys: Any) -> None:
    loader = DataLoader(list(range(10)), batch_size=2)
    code, out = _inspect(tmp_path, capsys, loader.state_dict(), "--check")
    assert code == 0
    assert "stream  " not in out
    assert "check: not a Stream's state" in out


def test_partitions_prints_every_cursor_under_its_field_names(tmp_path: Path, capsys: Any) -> None:
    state = _state()
    code, out = _inspect(tmp_path, capsys, state, "--partitions")
    assert code == 0
    table = out.split("partition  ", 1)[1].splitlines()
    assert table[0].split() == [
        "pass",
        "done",
        "rows",
        "skip",
        "shard_i",
        "offset",
        "src",
        "filtered",
    ]
    rows = {int(line.split()[0]): [int(v) for v in line.split()[1:]] for line in table[1:]}
    assert rows == _cursors(state)
