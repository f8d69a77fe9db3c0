"""One rank of a small data-parallel job, run by ``torchrun`` from ``test_distributed_ranks``.

    torchrun --standalone --nproc-per-node W tests/_dist_job.py OUT CKPT PHASE [STEPS] [KILL]

``save``: every rank takes STEPS batches of sampler epoch 1 (rank 0 one more: the ranks are
out of step), then all save the loader with torch.distributed.checkpoint into CKPT. With KILL,
rank 1 SIGKILLs one of its workers after its first batch. ``resume``: every rank loads CKPT
with DCP and runs the recipe of docs/distributed.md up to epoch 2: the rest of epoch 1, then
epoch 2 whole. Each rank writes what it
consumed, as json, to OUT/PHASE-rank<r>.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from resumable_loader import DataLoader
from resumable_loader.testing import worker_pids

N = 23


class Ids(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def main() -> None:
    out, ckpt, phase = sys.argv[1:4]
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    kill = len(sys.argv) > 5 and sys.argv[5] == "kill"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = Ids()
    sampler = DistributedSampler(ds, shuffle=True, seed=7)
    loader = DataLoader(
        ds, batch_size=2, sampler=sampler, num_workers=2, multiprocessing_context="fork"
    )
    got: dict[str, list[int]] = {}
    if phase == "save":
        sampler.set_epoch(1)
        it = iter(loader)
        taken = []
        for k in range(steps + (rank == 0)):
            taken += next(it).tolist()
            if kill and rank == 1 and k == 0:
                killed = worker_pids(loader)[0]
                os.kill(killed, signal.SIGKILL)
                got["killed"] = [killed]
        got["1"] = taken
        if rank == 0:
            # Rank 0 alone asks for its own state (as for torch.save): no collective, no hang.
            assert loader.state_dict()["config"]["rank"] == 0
        dcp.save({"loader": loader}, checkpoint_id=ckpt)
    else:
        dcp.load({"loader": loader}, checkpoint_id=ckpt)
        # The recipe of docs/distributed.md: the epoch from the state, not one this job knows.
        start_epoch = loader.state_dict()["distributed"]["sampler_epoch"]
        for epoch in range(start_epoch, 3):
            sampler.set_epoch(epoch)
            got[str(epoch)] = [i for b in loader for i in b.tolist()]
    with open(os.path.join(out, f"{phase}-rank{rank}.json"), "w") as f:
        stats = loader.statistics()
        json.dump({"world": dist.get_world_size(), "got": got, "respawns": stats.respawns}, f)
    loader.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
