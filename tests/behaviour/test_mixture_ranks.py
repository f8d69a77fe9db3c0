"""Real ranks (one process each, gloo): a ``Mixture`` job under ``DistributedSampler`` stopped on
2 ranks with its state saved through torch.distributed.checkpoint, resumed on 3 ranks with
another batch size and new weights. Compared with an uninterrupted run of the plan the resume
made: every position of the interrupted epoch is delivered exactly once with the value it has
there, the new weights govern the rest of that epoch, and the next epoch follows them."""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from _mixture_dist_job import RESUMED, SAVED, N, mixture, pairs
from torch.utils.data.distributed import DistributedSampler

from resumable_loader import DataLoader

JOB = Path(__file__).parents[1] / "_mixture_dist_job.py"


def run_ranks(world: int, *args: str) -> None:
    """The job on ``world`` ranks, each its own process, joined through env:// (what torchrun
    sets up, without its agent: two launches of it would take most of this test's time)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["PYTHONPATH"] = os.pathsep.join([str(JOB.parent.parent), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, str(JOB), *args],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:  # a rank that failed leaves the others waiting for it
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r}: {out[-3000:]}"


def _results(out: Path, phase: str, world: int) -> list[dict]:
    return [json.loads((out / f"{phase}-rank{r}.json").read_text()) for r in range(world)]


def test_a_mixture_job_resumed_on_three_ranks_with_another_batch_and_weights(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    run_ranks(2, str(tmp_path), str(ckpt), "save")
    run_ranks(3, str(tmp_path), str(ckpt), "resume")
    before = [p for r in _results(tmp_path, "save", 2) for p in r["1"]]
    after = [p for r in _results(tmp_path, "resume", 3) for p in r["1"]]
    assert len(before) == 2 * 2 * 2  # 2 ranks, 2 steps, batch 2
    positions = collections.Counter(p for p, _ in before + after)
    assert positions == collections.Counter(range(N))  # each position of the epoch once
    # The reference: an uninterrupted run of 2 ranks (simulated, in this process) under the
    # plan the resume made, from the epoch's first sample: each position holds the value the
    # interrupted and resumed job delivered for it. (The mixture's epoch is the loader's: its
    # first, 0, whatever epoch the script gave the sampler.)
    plans = [r["plan"] for r in _results(tmp_path, "resume", 3)]
    assert all(p == plans[0] for p in plans), "every rank computes the same plan"

    def uninterrupted(sampler_epoch: int) -> dict[int, str]:
        values: dict[int, str] = {}
        for rank in range(2):
            ref = mixture(RESUMED)
            ref.load_state_dict(plans[0])
            sampler = DistributedSampler(ref, 2, rank, shuffle=True, seed=7)
            sampler.set_epoch(sampler_epoch)
            with DataLoader(ref, batch_size=2, sampler=sampler) as loader:
                for _ in range(sampler_epoch - 1):  # the loader's epochs: 0, then 1
                    for _ in loader:
                        pass
                values.update((p, v) for p, v in pairs(loader))
        return values

    assert dict(before + after) == uninterrupted(1)
    # The rest of the interrupted epoch follows the new weights (a:1, b:3), within the
    # stratification bound of two sources; before the resume, the old ones.
    rest = collections.Counter(v.split("/")[0] for _, v in after)
    assert abs(rest["b"] - 3 * len(after) / 4) <= 1, rest
    old = mixture(SAVED)
    assert all(v == old[p][1] for p, v in before)
    # The next epoch: the new weights, from its first position.
    epoch2 = [p for r in _results(tmp_path, "resume", 3) for p in r["2"]]
    assert {p for p, _ in epoch2} == set(range(N))
    assert len(epoch2) == 27  # torch pads 26 positions to 3 equal shares
    reference = uninterrupted(2)
    assert all(v == reference[p] for p, v in epoch2)
