"""Real ranks: ``torchrun`` processes under a gloo process group, saving the loader with
torch.distributed.checkpoint mid-epoch and resuming on the same and on other numbers of ranks.

The union of what every rank consumed before and after the resume must be the interrupted
epoch exactly once (23 samples; the numbers are chosen so that no padding is needed), and the
epoch after it must be torch's own DistributedSampler shards on the new world size.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.data.distributed import DistributedSampler

JOB = Path(__file__).parents[1] / "_dist_job.py"
N = 23


def torchrun(world: int, *args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(JOB.parent.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            str(JOB),
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def results(out: Path, phase: str, world: int) -> list[dict]:
    return [json.loads((out / f"{phase}-rank{r}.json").read_text()) for r in range(world)]


def torchs_shards(world: int, epoch: int) -> list[list[int]]:
    shards = []
    for rank in range(world):
        s = DistributedSampler(range(N), num_replicas=world, rank=rank, shuffle=True, seed=7)
        s.set_epoch(epoch)
        shards.append(list(s))
    return shards


# Fewer ranks after a DCP resume runs in the slow profile only: the re-cut itself is tested in
# process for every pair of sizes (test_distributed.py), and the DCP path by the rows here.
CASES = [
    pytest.param(2, 2, 3, False, marks=pytest.mark.slow, id="2to2"),
    pytest.param(2, 3, 3, True, id="2to3-worker-killed"),
    pytest.param(3, 2, 2, False, marks=pytest.mark.slow, id="3to2"),
]


@pytest.mark.parametrize(("before", "after", "steps", "kill"), CASES)
def test_dcp_resume_on_any_world_size_delivers_the_epoch_exactly_once(
    tmp_path: Path, before: int, after: int, steps: int, kill: bool
) -> None:
    ckpt = tmp_path / "ckpt"
    torchrun(before, str(tmp_path), str(ckpt), "save", str(steps), "kill" if kill else "")
    torchrun(after, str(tmp_path), str(ckpt), "resume")
    saved, resumed = results(tmp_path, "save", before), results(tmp_path, "resume", after)
    taken = [i for r in saved for i in r["got"]["1"]]
    rest = [i for r in resumed for i in r["got"]["1"]]
    # Rank 0 was one batch ahead when the checkpoint was taken: its extra batch counts.
    assert len(saved[0]["got"]["1"]) == len(saved[1]["got"]["1"]) + 2
    counts = collections.Counter(taken + rest)
    left = N - len(taken)
    pad = -left % after if before != after else -N % before
    assert set(counts) == set(range(N))
    assert sum(counts.values()) == N + pad
    if before == after:
        # Each rank continued its own shard: exactly torch's shard of epoch 1.
        for r in range(before):
            assert saved[r]["got"]["1"] + resumed[r]["got"]["1"] == torchs_shards(before, 1)[r]
    if kill:
        # Rank 1 SIGKILLed a worker after its first batch, and nothing above changed. Whether
        # the death was seen before the save depends on what was already prefetched (a
        # respawn is then not needed): the recovery itself is tested in test_crash_table.
        assert saved[1]["got"]["killed"] and saved[1]["respawns"] in (0, 1)
    for r in range(after):
        assert resumed[r]["got"]["2"] == torchs_shards(after, 2)[r]


# 2 ranks x batch 4 over 96 samples: 12 steps an epoch, a checkpoint every 3. Killed at step 7,
# it resumes from step 6, mid-epoch; killed at step 13, from step 12: the state was taken right
# after epoch 0's last batch, and the recipe must start epoch 1, not train epoch 0 again.
KILLS = [
    pytest.param(7, id="mid-epoch"),
    # Slow profile (a torchrun job of about 45 s here): every save point of the recipe, the
    # epochs' ends among them, is resumed in process by test_distributed_recipe.py.
    pytest.param(13, marks=pytest.mark.slow, id="at-an-epochs-end"),
]


@pytest.mark.parametrize("crash_at", KILLS)
def test_the_ddp_example_killed_and_resumed_on_three_ranks(tmp_path: Path, crash_at: int) -> None:
    example = JOB.parent.parent / "examples" / "ddp_elastic.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(JOB.parent.parent), env.get("PYTHONPATH", "")])
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    first = subprocess.run(
        [
            *run,
            "--nproc-per-node=2",
            str(example),
            "--ckpt",
            str(tmp_path),
            "--crash-at",
            str(crash_at),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert first.returncode != 0  # rank 0 was SIGKILLed at step crash_at
    second = subprocess.run(
        [*run, "--nproc-per-node=3", str(example), "--ckpt", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"resumed {tmp_path}/step-{crash_at - 1:05d}" in second.stdout
    assert "every sample of every epoch trained exactly once" in second.stdout
