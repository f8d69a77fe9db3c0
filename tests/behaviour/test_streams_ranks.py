"""Real ranks for a ``Stream`` (issue #33): one process per rank under a gloo process group
(``tests/_stream_rank_job.py``), workers under each.

A job of 2 ranks x 2 workers is SIGKILLed after ``dcp.save({"loader": loader})`` (and after
each rank saved its own state, which the test merges with ``merge_rank_states``), then resumed
on other layouts through ``dcp.load`` or the merged global state. Checked against the
uninterrupted run (the Stream read alone, one partition at a time): each partition's rows, over
the epochs run, are its rows of pass 0 then pass 1, in order -- so every sample of each pass is
delivered exactly once, whatever the layouts. Then equal batches on every rank: the ranks agree
on each epoch's number of batches, and a rank's rows left over (its tail) are carried into the
next epoch or dropped, and counted. The partitions are not shuffled across shards
(``shuffle_shards=False``): a sample's partition is then ``shard mod P`` in every pass.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import _stream_shards as F
import pytest
from _stream_rank_job import PARTITIONS, SHARDS, make_stream

from resumable_loader import (
    DataLoader,
    dump_state,
    load_state,
    merge_rank_states,
    save_checkpoint,
)

JOB = Path(__file__).parents[1] / "_stream_rank_job.py"
# A rank that waits for a peer that never comes (a DDP hang) fails the test here instead of
# hanging it: a job of a few hundred samples takes seconds.
RANKS_TIMEOUT_S = 180


def run_ranks(world: int, spec: dict[str, Any]) -> list[int]:
    """The job on ``world`` ranks, each its own process, joined through env:// (what torchrun
    sets up, without its agent); their return codes. A rank past the timeout is killed and
    the test fails (a hang)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["PYTHONPATH"] = os.pathsep.join([str(JOB.parent), str(JOB.parent.parent)])
    procs = [
        subprocess.Popen(
            [sys.executable, str(JOB), json.dumps(spec)],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a SIGKILLed rank's workers are found by their group
        )
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=RANKS_TIMEOUT_S)[0])
            except subprocess.TimeoutExpired:
                pytest.fail(f"ranks did not finish in {RANKS_TIMEOUT_S} s: a hang")
    finally:
        for p in procs:  # a rank that failed leaves the others waiting for it
            if p.poll() is None:
                p.kill()
                p.wait()
    if spec.get("stop") is None:
        for r, (p, out) in enumerate(zip(procs, outputs)):
            assert p.returncode == 0, f"rank {r}: {out[-3000:]}"
    return [p.returncode for p in procs]


def results(out: Path, phase: str, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"{phase}-rank{r}.json").read_text()) for r in range(world)]


def reference() -> dict[int, list[int]]:
    """Each partition's rows in one pass, as the Stream alone reads them (shards in the given
    order: the same rows in every pass)."""
    stream = make_stream()
    out: dict[int, list[int]] = {p: [] for p in range(PARTITIONS)}
    for x in stream:
        out[(x // 1000) % PARTITIONS].append(x)
    return out


def per_partition(runs: list[list[dict[str, Any]]], epochs: int) -> dict[int, list[int]]:
    """The rows each partition delivered, in order: runs one after the other, and within a
    run, epoch by epoch (a partition is read by one rank at a time, in its order)."""
    out: dict[int, list[int]] = {p: [] for p in range(PARTITIONS)}
    for ranks in runs:
        for e in range(epochs):
            for r in ranks:
                for batch in r["epochs"].get(str(e), []):
                    for x in batch:
                        out[(int(x) // 1000) % PARTITIONS].append(int(x))
    return out


def check_two_passes(runs: list[list[dict[str, Any]]]) -> None:
    """Over two epochs each partition delivered all its pass 0, then a prefix of its pass 1,
    each row once, in order. (The ranks' agreement ends epoch 1 on every rank when one runs
    out: the others' rows left of it come first in epoch 2, which these jobs do not run.)"""
    ref = reference()
    got = per_partition(runs, 2)
    assert sum(map(len, ref.values())) == len(F.all_samples(list(range(SHARDS))))
    for p in range(PARTITIONS):
        assert len(got[p]) >= len(ref[p]), p
        assert got[p] == (ref[p] + ref[p])[: len(got[p])], p


def killed_job(tmp: Path, stop: int = 3) -> None:
    """2 ranks x 2 workers, batch 2: each rank saves after ``stop`` batches, then dies."""
    spec = {"out": str(tmp), "phase": "save", "workers": 2, "batch": 2, "epochs": 2}
    codes = run_ranks(2, dict(spec, stop=stop, ckpt=str(tmp / "ckpt")))
    assert all(c == -9 for c in codes), codes  # SIGKILLed after saving
    states = [load_state((tmp / f"own-rank{r}.state").read_bytes()) for r in range(2)]
    save_checkpoint(dump_state(merge_rank_states(states)), str(tmp / "merged.state"))


def test_a_killed_two_by_two_job_resumes_on_three_ranks_through_dcp(tmp_path: Path) -> None:
    """The default run's case: 2 ranks x 2 workers killed, resumed on 3 ranks x 1 worker
    through ``dcp.load``; before resuming, each new rank is refused a rank's own state (it
    holds only that rank's partitions) and a layout whose readers do not divide the
    partitions."""
    killed_job(tmp_path)
    spec = {
        "out": str(tmp_path),
        "phase": "resume",
        "workers": 1,
        "batch": 3,
        "epochs": 2,
        "dcp": str(tmp_path / "ckpt"),
        "refuse": [[1, str(tmp_path / "own-rank0.state")], [3, str(tmp_path / "merged.state")]],
    }
    run_ranks(3, spec)
    check_two_passes([results(tmp_path, "save", 2), results(tmp_path, "resume", 3)])
    for r in results(tmp_path, "resume", 3):
        own, layout = r["refused"]
        assert own is not None and "config.world_size: the checkpoint has 2" in own
        assert "merge_rank_states" in own  # the fix
        assert layout is not None and "3 ranks x 3 workers = 9 readers do not divide" in layout
        assert "Valid readers per job (ranks x max(num_workers, 1)): 1, 2, 3, 4, 6, 12" in layout


@pytest.mark.slow
@pytest.mark.parametrize(("world", "workers", "source"), [(1, 4, "dcp"), (3, 1, "merged")])
def test_a_killed_two_by_two_job_resumes_on_other_layouts(
    tmp_path: Path, world: int, workers: int, source: str
) -> None:
    killed_job(tmp_path, stop=5)
    spec: dict[str, Any] = {
        "out": str(tmp_path),
        "phase": "resume",
        "workers": workers,
        "batch": 4,
        "epochs": 2,
    }
    if source == "dcp":
        spec["dcp"] = str(tmp_path / "ckpt")
    else:
        spec["state"] = str(tmp_path / "merged.state")
    run_ranks(world, spec)
    check_two_passes([results(tmp_path, "save", 2), results(tmp_path, "resume", world)])


# ---- equal batches on every rank -------------------------------------------------------------
# SHARDS = 27 uneven shards: 2 ranks own 57 and 49 rows (19 and 17 batches of 3), 3 ranks 34,
# 37 and 35. Left alone, a rank runs out before the others and DDP hangs in its next collective.


def check_equal_batches(ranks: list[dict[str, Any]], epochs: range) -> int:
    """Every rank delivered the same number of batches in each epoch; returns the last."""
    counts = []
    for e in epochs:
        counts = [len(r["epochs"][str(e)]) for r in ranks]
        assert len(set(counts)) == 1, (e, counts)
    return counts[0]


def rows_of(rank: dict[str, Any], epoch: int) -> list[int]:
    return [int(x) for b in rank["epochs"].get(str(epoch), []) for x in b]


def tail_records(state: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        w["dataset_state"]["stream"]["tail"]
        for w in state["workers"]
        if w["dataset_state"] is not None and "tail" in w["dataset_state"]["stream"]
    ]


def test_ranks_get_equal_batches_and_a_ranks_tail_comes_first_in_the_next_epoch(
    tmp_path: Path,
) -> None:
    """2 ranks x 1 persistent worker, batch 3, two epochs: 17 batches on each rank in each
    epoch (rank 0 holds 19); rank 0's 6 rows left of pass 0 come first in epoch 1, in each
    partition's order (the persistent worker is given the delivered cursors, not its own
    prefetched ones); what it delivered over both epochs is each partition's rows in order,
    once, and its state at the end says exactly where each partition stands."""
    spec = {"out": str(tmp_path), "phase": "a", "workers": 1, "batch": 3, "epochs": 2}
    spec["persistent"] = True
    run_ranks(2, dict(spec, end_states=True))
    ranks = results(tmp_path, "a", 2)
    assert check_equal_batches(ranks, range(2)) == 17
    ref = reference()
    # Uneven on purpose: alone, rank 0 would deliver 19 batches of pass 0 and rank 1 17.
    own = [sum(len(ref[p]) for p in range(r, PARTITIONS, 2)) for r in range(2)]
    assert own == [57, 49]
    got = per_partition([ranks], 2)
    for p in range(PARTITIONS):
        assert got[p] == (ref[p] * 2)[: len(got[p])], p  # in order, nothing twice or skipped
    # Rank 0's tail of epoch 0: counted in its state and in one warning.
    end0 = load_state((tmp_path / "a-end0-rank0.state").read_bytes())
    (record,) = tail_records(end0)
    assert record["epoch"] == 0 and record["batches"] == 17 and record["rule"] == "carry"
    delivered0 = per_partition([[{"epochs": {"0": ranks[0]["epochs"]["0"]}}]], 1)
    carried = sorted(x for p in record["partitions"] for x in ref[p][len(delivered0[p]) :])
    assert len(carried) == 57 - 17 * 3
    assert sorted(rows_of(ranks[0], 1)[: len(carried)]) == carried  # first in epoch 1
    warned = [w for w in ranks[0]["warnings"] if "epoch 0 of the Stream ended after 17" in w]
    assert len(warned) == 1 and "partitions" in warned[0] and "stream_tail='carry'" in warned[0]
    assert ranks[1]["warnings"] == []  # rank 1 ran out: nothing left, nothing said
    # The state at epoch 1's end holds each of rank 0's partitions where it stands.
    end1 = load_state((tmp_path / "a-end1-rank0.state").read_bytes())
    (record,) = tail_records(end1)
    assert record["epoch"] == 1 and record["batches"] == 17
    cursors = {
        p: c
        for w in end1["workers"]
        for p, c in (w["dataset_state"] or {}).items()
        if p != "stream"
    }
    assert sorted(cursors) == list(range(0, PARTITIONS, 2))
    for p, c in cursors.items():
        pass_, done, rows = c[:3]
        assert len(got[p]) == pass_ * len(ref[p]) + (len(ref[p]) if done else rows), p


def test_stream_tail_is_checked() -> None:
    with pytest.raises(ValueError, match=r"stream_tail must be 'carry', 'drop' or None"):
        DataLoader(make_stream(), batch_size=2, stream_tail="keep")


@pytest.mark.slow
def test_states_at_epoch_ends_resume_on_other_layouts_exactly(tmp_path: Path) -> None:
    """Epoch 0 on 2 ranks x 2 workers, epoch 1 on 3 ranks x 1 worker from its end's DCP
    checkpoint, epoch 2 on 1 rank x 4 workers from the merged states of epoch 1's end: every
    rank of a job gets the same number of batches, each carried tail comes first, and over
    the three epochs each partition delivered its rows three times over, in order. On the
    same layout, each rank's own state at epoch 0's end gives epoch 1 bit-identically."""
    base: dict[str, Any] = {"out": str(tmp_path), "batch": 3, "end_states": True}
    run_ranks(2, dict(base, phase="a", workers=2, epochs=1))
    end0 = str(tmp_path / "a-end0-dcp")
    run_ranks(3, dict(base, phase="b", workers=1, epochs=2, dcp=end0, in_order=False))
    states = [load_state((tmp_path / f"b-end1-rank{r}.state").read_bytes()) for r in range(3)]
    merged = tmp_path / "b-end1.state"
    save_checkpoint(dump_state(merge_rank_states(states)), str(merged))
    run_ranks(1, dict(base, phase="c", workers=4, epochs=3, state=str(merged)))
    # The same layout from each rank's own state at epoch 0's end: epoch 1 bit-identical.
    own = str(tmp_path / "a-end0-rank{rank}.state")
    run_ranks(2, dict(base, phase="same", workers=2, epochs=2, state=own))
    same = results(tmp_path, "same", 2)
    a, b, c = (results(tmp_path, x, w) for x, w in (("a", 2), ("b", 3), ("c", 1)))
    run_ranks(2, dict(base, phase="a2", workers=2, epochs=2))  # the uninterrupted 2 x 2 run
    a2 = results(tmp_path, "a2", 2)
    assert [r["epochs"]["1"] for r in same] == [r["epochs"]["1"] for r in a2]
    check_equal_batches(a, range(1))
    check_equal_batches(b, range(1, 2))
    ref = reference()
    got = per_partition([a, b, c], 3)
    for p in range(PARTITIONS):
        assert got[p] == ref[p] * 3, p
    # Each rank of epoch 1 (one worker: its own canonical order) began with epoch 0's tail of
    # its partitions.
    done0 = per_partition([a], 1)
    for r, rank in enumerate(b):
        carried = sorted(x for p in range(r, PARTITIONS, 3) for x in ref[p][len(done0[p]) :])
        assert sorted(rows_of(rank, 1)[: len(carried)]) == carried, r


@pytest.mark.slow
def test_a_dropped_tail_is_counted_and_the_next_epoch_starts_its_partitions_afresh(
    tmp_path: Path,
) -> None:
    """3 ranks, num_workers=0, ``stream_tail="drop"``: equal batches; each epoch delivers a
    prefix of each partition's pass (the dropped rows never come); the record names them.
    The default group is taken for nccl's here: the agreement runs on a gloo group of its
    own."""
    spec = {"out": str(tmp_path), "phase": "a", "workers": 0, "batch": 4, "epochs": 2}
    run_ranks(3, dict(spec, end_states=True, tail="drop", new_group=True))
    ranks = results(tmp_path, "a", 3)
    ref = reference()
    dropped: dict[int, list[int]] = {}
    for e in range(2):
        n = check_equal_batches(ranks, range(e, e + 1))
        got = per_partition([[{"epochs": {"0": r["epochs"][str(e)]}} for r in ranks]], 1)
        short = {p for p in range(PARTITIONS) if len(got[p]) < len(ref[p])}
        for p in range(PARTITIONS):
            assert got[p] == ref[p][: len(got[p])], (e, p)
        records = [
            rec
            for r in range(3)
            for rec in tail_records(load_state((tmp_path / f"a-end{e}-rank{r}.state").read_bytes()))
        ]
        assert all(rec["rule"] == "drop" and rec["batches"] == n for rec in records)
        assert short <= {p for rec in records for p in rec["partitions"]}
        dropped[e] = sorted(short)
    assert dropped[0], "the shards are uneven: some rank had rows left"


# ---- the tail's arithmetic, in one process (one rank: partitions p of worker p mod 2) -------
def _position() -> Any:
    """Epoch 0 of 2 workers cut by the agreement: worker 0 ran dry; worker 1 delivered rows of
    partitions 1 (finished), 3 (4 rows in) and nothing of 5 yet."""
    from resumable_loader.state.schema import ResumePoint, WorkerPosition

    stream = make_stream()
    width = len(stream.cursor_fields())
    meta = stream.state_dict()["stream"]
    c1, c3 = [0, 1, 7] + [0] * (width - 3), [0, 0, 4] + [0] * (width - 3)
    state = {"stream": meta, 1: c1, 3: c3}
    workers = [WorkerPosition(5, True), WorkerPosition(3, False, state, 3)]
    return stream, ResumePoint(seed=1, epoch=0, iterable=True, workers=workers), width


@pytest.mark.parametrize("rule", ["carry", "drop"])
def test_the_next_epoch_starts_from_the_delivered_cursors_or_drops_them(rule: str) -> None:
    from resumable_loader.loader.stream_ranks import carry_point, tail_record

    stream, position, width = _position()
    record = tail_record(stream, position, batches=6, ready=2, rule=rule, num_workers=2)
    assert record == {
        "epoch": 0,
        "rule": rule,
        "rank": 0,
        "batches": 6,
        "ready": 2,
        "partitions": [3, 5, 7, 9, 11],
    }
    nxt = carry_point(stream, position, record, 2)
    assert nxt.epoch == 1 and nxt.seed is None
    assert nxt.workers[0].dataset_state is None  # dry: its partitions start pass 1
    state = nxt.workers[1].dataset_state
    assert state["stream"]["epoch"] == 1 and state["stream"]["tail"] == record
    fresh1 = [1] + [0] * (width - 1)
    assert state[1] == fresh1  # finished in pass 0
    if rule == "carry":
        assert state[3] == [0, 0, 4] + [0] * (width - 3)  # its pass 0 goes on first
        assert state[5] == [0] * width  # nothing delivered: all of pass 0 to come
    else:
        assert state[3] == state[5] == fresh1
    assert sorted(p for p in state if p != "stream") == [1, 3, 5, 7, 9, 11]
