"""Data-parallel training under torchrun, checkpointed with torch.distributed.checkpoint, killed,
and resumed on a different number of processes -- every sample of every epoch trained once.

    torchrun --standalone --nproc-per-node 2 examples/ddp_elastic.py --ckpt /tmp/ddp --crash-at 7
    torchrun --standalone --nproc-per-node 3 examples/ddp_elastic.py --ckpt /tmp/ddp

The first command trains on 2 ranks (CPU, gloo) and saves model, optimizer and loader with DCP
every 3 steps; at step 7 rank 0 is SIGKILLed (torchrun then stops the job). The second resumes
the last checkpoint (step 6) on 3 ranks and trains to the end. Each rank writes the sample ids
it trained on between checkpoints to a ledger; at the end rank 0 reads the ledger of the
checkpointed history and prints, per epoch, that no sample was repeated or skipped.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import signal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from resumable_loader import DataLoader, save_checkpoint

N = 96  # samples; 96 = 2 * 3 * 16, so 2 and 3 ranks both cut it evenly
EPOCHS = 2
BATCH = 4
EVERY = 3  # checkpoint every this many steps


class Points(Dataset):
    """Sample i: a point on y = 3x + 1, with noise drawn in the worker (seeded per sample)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        x = torch.tensor([i / N])
        return i, x, 3 * x + 1 + 0.01 * torch.randn(1)


class Progress:
    """The step count, saved with DCP next to the model (a Stateful of its own)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def latest(ckpt: str) -> str | None:
    steps = sorted(glob.glob(os.path.join(ckpt, "step-*", ".metadata")))
    return os.path.dirname(steps[-1]) if steps else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--crash-at", type=int, default=-1, help="SIGKILL rank 0 at this step")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(1, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = Points()
    sampler = DistributedSampler(ds, shuffle=True, seed=42)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2, seed_per_sample=True)
    progress = Progress()
    state = {"model": model, "optim": optim, "loader": loader, "progress": progress}
    ledger = os.path.join(args.ckpt, "ledger")
    resume_from = latest(args.ckpt)
    if resume_from is not None:
        dcp.load(state, checkpoint_id=resume_from)
        if rank == 0:  # forget what was trained after that checkpoint: it is trained again
            for path in glob.glob(os.path.join(ledger, "*.json")):
                if int(os.path.basename(path).split("-")[0]) > progress.step:
                    os.remove(path)
        print(f"rank {rank}/{world}: resumed {resume_from}", flush=True)
    os.makedirs(ledger, exist_ok=True)
    dist.barrier()

    # The sampler epoch to train next: the interrupted one, or the one after an epoch that a
    # checkpoint at its last batch saw end (docs/distributed.md).
    start_epoch = loader.state_dict()["distributed"]["sampler_epoch"]
    seen: list[tuple[int, int]] = []  # (epoch, sample id) since the last checkpoint
    for epoch in range(start_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for ids, x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            progress.step += 1
            seen += [(epoch, int(i)) for i in ids]
            if progress.step == args.crash_at and rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # a preemption, mid-epoch
            if progress.step % EVERY == 0:
                # The ledger first, atomically: a checkpoint then always has its ledger entry
                # (a kill between the two leaves an entry past the checkpoint, which a resume
                # removes above). DCP writes .metadata last, renamed into place, so a step
                # directory with one is complete: latest() resumes only those.
                _write_ledger(ledger, progress.step, world, rank, seen)
                dcp.save(state, checkpoint_id=os.path.join(args.ckpt, f"step-{progress.step:05d}"))
                seen = []
    _write_ledger(ledger, progress.step + 1, world, rank, seen)  # the tail after the last one
    loader.close()
    dist.barrier()
    if rank == 0:
        report(ledger)
    dist.destroy_process_group()


def _write_ledger(ledger: str, step: int, world: int, rank: int, seen: list) -> None:
    path = os.path.join(ledger, f"{step:05d}-{world}-{rank}.json")
    save_checkpoint(json.dumps(seen).encode(), path)  # never half a ledger file


def report(ledger: str) -> None:
    counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in glob.glob(os.path.join(ledger, "*.json")):
        with open(path) as f:
            for epoch, i in json.load(f):
                counts[epoch][i] += 1
    ok = True
    for epoch in range(EPOCHS):
        c = counts[epoch]
        repeated = sorted(i for i, k in c.items() if k > 1)
        skipped = sorted(set(range(N)) - set(c))
        ok &= not repeated and not skipped
        print(
            f"epoch {epoch}: {sum(c.values())} samples trained, {len(c)} distinct of {N}; "
            f"repeated {repeated or 'none'}, skipped {skipped or 'none'}",
            flush=True,
        )
    print("every sample of every epoch trained exactly once" if ok else "MISMATCH", flush=True)


if __name__ == "__main__":
    main()
