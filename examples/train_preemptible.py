"""A preemptible training run that survives SIGKILL and worker crashes, bit for bit.

    python examples/train_preemptible.py            # the demo (about a minute on 2 cores)
    python examples/train_preemptible.py --quick    # a few seconds

What it does:
  1. trains a small model uninterrupted (the reference), with random augmentations in the
     data workers and one worker segfaulting mid-run (the loader replaces it);
  2. trains the same model again, but the training process is SIGKILLed at random steps and
     restarted each time from its last checkpoint -- model, optimizer, RNG and *loader* state
     saved together with save_checkpoint (atomic: a kill mid-save keeps the previous one) and
     loaded with torch.load(weights_only=True);
  3. checks that both runs saw exactly the same batches and ended with bit-identical weights.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import subprocess
import sys
import tempfile

import torch
from torch import nn
from torch.utils.data import Dataset

from resumable_loader import DataLoader, save_checkpoint

EPOCHS = 3


class NoisySquares(Dataset):
    """x -> x**2 regression with a random augmentation (noise) drawn in the worker."""

    def __init__(self, n: int, crash_marker: str | None = None) -> None:
        self.n = n
        self.crash_marker = crash_marker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.crash_marker and i == self.n // 2 and not os.path.exists(self.crash_marker):
            open(self.crash_marker, "w").close()
            os.kill(os.getpid(), signal.SIGSEGV)  # a decoder crash, once
        x = torch.tensor([i / self.n])
        noise = torch.randn(1) * 0.01 + random.gauss(0, 0.01)
        return x + noise, x**2


def make_loader(n: int, workdir: str) -> DataLoader:
    return DataLoader(
        NoisySquares(n, os.path.join(workdir, "crashed-once")),
        batch_size=16,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(0),
    )


def train(workdir: str, n: int, die_at: int | None) -> None:
    """One training process: resume from workdir/ckpt.pt if present; SIGKILL self at die_at."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = make_loader(n, workdir)
    ckpt_path = os.path.join(workdir, "ckpt.pt")
    step, start_epoch = 0, 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        torch.set_rng_state(ckpt["rng"])
        loader.load_state_dict(ckpt["loader"])
        # The epoch the loader continues: saved on an epoch's last step, the next one.
        step, start_epoch = ckpt["step"], ckpt["loader"]["epoch"]
    with open(os.path.join(workdir, "batches.log"), "a") as log:
        for _epoch in range(start_epoch, EPOCHS):
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                log.write(f"{step} {hashlib.sha1(x.numpy().tobytes()).hexdigest()}\n")
                log.flush()
                if step % 5 == 0:
                    # Atomic: a kill during the write leaves the previous checkpoint.
                    ckpt = {
                        "model": model.state_dict(),
                        "opt": opt.state_dict(),
                        "rng": torch.get_rng_state(),
                        "loader": loader.state_dict(),
                        "step": step,
                    }
                    save_checkpoint(ckpt, ckpt_path)
                    log.write(f"ckpt {step}\n")
                    log.flush()
                if die_at is not None and step == die_at:
                    os.kill(os.getpid(), signal.SIGKILL)  # preemption: no cleanup, no goodbye
    save_checkpoint(model.state_dict(), os.path.join(workdir, "final.pt"))
    stats = loader.statistics()
    print(f"  finished at step {step}; worker respawns: {dict(stats.respawns_by_cause)}")
    loader.close()


def batches_seen(workdir: str) -> list[str]:
    """The batch hashes in training order; a restarted process's replayed steps replace the
    ones its killed predecessor trained after the last checkpoint."""
    out: list[str] = []
    with open(os.path.join(workdir, "batches.log")) as f:
        lines = f.read().splitlines()
    for line in lines:
        a, b = line.split()
        if a == "ckpt":
            continue
        step = int(a)
        del out[step - 1 :]
        out.append(b)
    return out


def run(workdir: str, n: int, kills: list[int]) -> None:
    for die_at in [*kills, None]:
        cmd = [sys.executable, __file__, "--worker", workdir, "--n", str(n)]
        if die_at is not None:
            cmd += ["--die-at", str(die_at)]
        r = subprocess.run(cmd)
        if die_at is not None:
            print(f"  training process killed at step {die_at} (SIGKILL), restarting")
            assert r.returncode == -signal.SIGKILL, r.returncode
        else:
            assert r.returncode == 0, r.returncode


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker")
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--die-at", type=int)
    args = p.parse_args()
    if args.worker:
        train(args.worker, args.n, args.die_at)
        return
    n = 320 if args.quick else args.n
    steps = EPOCHS * ((n + 15) // 16)
    rng = random.Random(1)
    kills = sorted(rng.sample(range(3, steps - 1), 3 if args.quick else 6))
    with tempfile.TemporaryDirectory() as ref_dir, tempfile.TemporaryDirectory() as pre_dir:
        print(f"reference run: {steps} steps, uninterrupted")
        run(ref_dir, n, [])
        print(f"preempted run: killed at steps {kills}")
        run(pre_dir, n, kills)
        same_batches = batches_seen(ref_dir) == batches_seen(pre_dir)
        a = torch.load(os.path.join(ref_dir, "final.pt"), weights_only=True)
        b = torch.load(os.path.join(pre_dir, "final.pt"), weights_only=True)
        same_weights = all(torch.equal(a[k], b[k]) for k in a)
        print(f"same batches in the same order: {same_batches}")
        print(f"bit-identical final weights:    {same_weights}")
        if not (same_batches and same_weights):
            sys.exit(1)
        print("OK: the preempted run is indistinguishable from the uninterrupted one")


if __name__ == "__main__":
    main()
