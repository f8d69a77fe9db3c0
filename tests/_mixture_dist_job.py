"""One rank of a ``Mixture`` job under ``DistributedSampler``, started by ``test_mixture_ranks``
with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or by torchrun:

    torchrun --standalone --nproc-per-node W tests/_mixture_dist_job.py OUT CKPT PHASE

``save`` (2 ranks, batch 2, weights a:3 b:1): every rank takes STEPS batches of sampler epoch 1,
then all save the loader with torch.distributed.checkpoint into CKPT and stop. ``resume``
(any number of ranks, batch 3, weights a:1 b:3): every rank loads CKPT with DCP, runs to the end
of epoch 1, then runs epoch 2 whole. Each rank writes the (position, value) pairs it consumed,
and after a resume the Mixture's plan, as json, to OUT/PHASE-rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from _datasets import Tagged
from torch.utils.data.distributed import DistributedSampler

from resumable_loader import DataLoader, Mixture

STEPS = 2
SIZES = {"a": 9, "b": 5}
SAVED = {"a": 3, "b": 1}
RESUMED = {"a": 1, "b": 3}
N = 26  # positions per epoch: 2 ranks share it evenly, and 3 ranks share what 2 steps leave


class Positions(Mixture):
    """A Mixture whose items say which position they are: (position, item)."""

    def __getitem__(self, index: int) -> Any:
        return index, super().__getitem__(index)


def mixture(weights: dict[str, int]) -> Positions:
    return Positions({k: Tagged(k, n) for k, n in SIZES.items()}, weights, seed=5, num_samples=N)


def pairs(batches: Any) -> list[list[Any]]:
    return [[int(p), v] for pos, vals in batches for p, v in zip(pos.tolist(), vals)]


def main() -> None:
    # Imported here: the test process imports this module for its constants, and
    # torch.distributed.checkpoint (sympy with it) would add 50 MB to the process every
    # worker of every later test is forked from.
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    out, ckpt, phase = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mix = mixture(SAVED if phase == "save" else RESUMED)
    sampler = DistributedSampler(mix, shuffle=True, seed=7)
    loader = DataLoader(mix, batch_size=2 if phase == "save" else 3, sampler=sampler)
    got: dict[str, Any] = {}
    if phase == "save":
        sampler.set_epoch(1)
        it = iter(loader)
        got["1"] = pairs(next(it) for _ in range(STEPS))
        dcp.save({"loader": loader}, checkpoint_id=ckpt)
    else:
        dcp.load({"loader": loader}, checkpoint_id=ckpt)
        got["plan"] = mix.state_dict()  # as the resume made it: the test's reference runs it
        got["1"] = pairs(loader)
        sampler.set_epoch(2)
        got["2"] = pairs(loader)
    with open(os.path.join(out, f"{phase}-rank{rank}.json"), "w") as f:
        json.dump(got, f)
    loader.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
