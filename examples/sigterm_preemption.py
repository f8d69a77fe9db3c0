"""The cluster-preemption recipe: a SIGTERM handler sets a flag, the loop leaves at the next
step, and the checkpoint is written after leaving it.

    python examples/sigterm_preemption.py

A training process is preempted with SIGTERM three times (the parent waits until it has
trained a chosen number of steps, then signals it, as a scheduler would) and restarted from
its checkpoint each time. The batches it trained on, in order, must equal those of an
uninterrupted run: no batch repeated, none skipped, augmentations included.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils.data import Dataset

from resumable_loader import DataLoader, save_checkpoint

EPOCHS = 2
N = 96
BATCH = 8


class Augmented(Dataset):
    """Sample i and a random augmentation drawn in the worker."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, int(torch.randint(0, 1000, ()))])


def train(workdir: str) -> None:
    preempted = False

    def on_sigterm(signum: int, frame: object) -> None:
        nonlocal preempted
        preempted = True  # only a flag: a handler that takes a lock can deadlock

    signal.signal(signal.SIGTERM, on_sigterm)

    loader = DataLoader(
        Augmented(),
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(0),
    )
    ckpt_path = os.path.join(workdir, "ckpt.pt")
    step, start_epoch = 0, 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, weights_only=True)
        loader.load_state_dict(ckpt["loader"])
        # The epoch the loader continues: after the last batch of an epoch, the next one.
        step, start_epoch = ckpt["step"], ckpt["loader"]["epoch"]
    epoch = start_epoch  # the epoch to train next: advanced only when one runs to its end
    with open(os.path.join(workdir, "batches.log"), "a") as log:
        while epoch < EPOCHS and not preempted:
            for batch in loader:
                time.sleep(0.02)  # stands in for the training step
                step += 1
                log.write(f"{step} {batch.flatten().tolist()}\n")
                log.flush()
                if preempted:
                    break
            else:
                epoch += 1
    # Saved after leaving the loop: the loader still knows where the epoch stood. Atomic: if
    # SIGKILL follows the SIGTERM mid-save, the previous checkpoint is still there.
    save_checkpoint({"loader": loader.state_dict(), "step": step}, ckpt_path)
    loader.close()
    sys.exit(0 if not preempted else 143)


def read_log(workdir: str) -> list[str]:
    with open(os.path.join(workdir, "batches.log")) as f:
        return [line.split(" ", 1)[1] for line in f.read().splitlines()]


def run(workdir: str, preempt_after: list[int]) -> None:
    """Run training to the end; the i-th process gets SIGTERM once it trained
    ``preempt_after[i]`` steps (it installs its handler before its first step)."""
    cmd = [sys.executable, __file__, "--train", workdir]
    path = os.path.join(workdir, "batches.log")
    open(path, "a").close()
    for at in [*preempt_after, None]:
        before = len(read_log(workdir))
        proc = subprocess.Popen(cmd)
        if at is not None:
            # Watch the log grow (the scheduler's clock) until this run trained `at` steps.
            while len(read_log(workdir)) < before + at:
                try:
                    proc.wait(timeout=0.01)
                    raise SystemExit(f"training ended before its step {at}")
                except subprocess.TimeoutExpired:
                    pass
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        what = f"SIGTERM after {at} steps, " if at is not None else ""
        print(f"  training process: {what}exit code {code}, {len(read_log(workdir))} steps so far")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--train":
        train(sys.argv[2])
        return
    steps = EPOCHS * N // BATCH
    with tempfile.TemporaryDirectory() as ref_dir, tempfile.TemporaryDirectory() as pre_dir:
        print(f"reference run: {steps} steps, uninterrupted")
        run(ref_dir, [])
        print("preempted run: three SIGTERMs")
        run(pre_dir, [3, 6, 5])
        ref, got = read_log(ref_dir), read_log(pre_dir)
        print(f"batches trained: {len(got)} (uninterrupted: {len(ref)})")
        if got != ref:
            print("MISMATCH: the preempted run trained on other batches")
            sys.exit(1)
        print("OK: same batches in the same order, none repeated, none skipped")


if __name__ == "__main__":
    main()
