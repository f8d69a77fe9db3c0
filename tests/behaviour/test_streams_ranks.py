"""Real ranks for a ``Stream`` (issue #33): one process per rank under a gloo process group
(``tests/_stream_rank_job.py``), workers under each.

A job of 2 ranks x 2 workers is SIGKILLed after ``dcp.save({"loader": loader})`` (and after
each rank saved its own state, which the test merges with ``merge_rank_states``), then resumed
on other layouts through ``dcp.load`` or the merged global state. Checked against the
uninterrupted run (the Stream read alone, one partition at a time): each partition's rows, over
the epochs run, are its rows of pass 0 then pass 1, in order -- so every sample of each pass is
delivered exactly once, whatever the layouts. The partitions are not shuffled across shards
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

from resumable_loader import dump_state, load_state, merge_rank_states, save_checkpoint

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
    """Each partition delivered its pass 0 and then its pass 1, each row once, in order."""
    ref = reference()
    got = per_partition(runs, 2)
    assert sum(map(len, ref.values())) == len(F.all_samples(list(range(SHARDS))))
    for p in range(PARTITIONS):
        assert got[p] == ref[p] + ref[p], p


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
