"""Child processes for tests/pipeline/test_hardening_proc.py (run as a script, in a session of
its own).

``pause METHOD FD``: iterate a loader whose tasks take a while, writing one byte to FD each
time it wants to be paused (the test then stops and continues the whole process group): first
when it goes straight back to waiting for data, then from inside its own "training step". At
the end it writes one JSON line: whether the epoch equals an uninterrupted
run, and the respawns and skipped tasks.

``orphan METHOD DIR``: iterate a loader whose worker hangs in its batch; that worker writes its
pid to DIR/hanging first. The test SIGKILLs this process and watches the worker.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from resumable_loader import DataLoader
from resumable_loader.testing import canonical

PAUSE_AT = (1, 4)  # batches after which the child asks to be paused
TASK_TIMEOUT = 0.8  # longer than a healthy task (0.3 s), shorter than a pause


class SlowAug(torch.utils.data.Dataset):
    """Item i: a random draw under the loader's per-task seed, after ``delay`` seconds."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.delay)  # the sample's loading time
        return torch.rand(3) + i


class Hangs(torch.utils.data.Dataset):
    """Item 2 hangs its worker for good (after writing the worker's pid to ``path``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 2:
            with open(self.path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(self.path + ".tmp", self.path)
            while True:
                time.sleep(3600)
        return i


def pause(method: str, fd: int) -> None:
    def make(delay: float, **kw) -> DataLoader:
        return DataLoader(
            SlowAug(16, delay), batch_size=2, generator=torch.Generator().manual_seed(7), **kw
        )

    ref = [canonical(b) for b in make(0.0)]
    loader = make(
        0.15,
        num_workers=2,
        multiprocessing_context=method,
        task_timeout=TASK_TIMEOUT,
        on_poison="skip",
    )
    got = []
    for i, batch in enumerate(loader):
        got.append(canonical(batch))
        if i == PAUSE_AT[0]:
            os.write(fd, b"p")  # and back to waiting for data, where the pause falls
        elif i == PAUSE_AT[1]:
            os.write(fd, b"p")
            time.sleep(0.1)  # the training step, which the pause falls into
    stats = loader.statistics()
    loader.close()
    result = {"same": got == ref, "respawns": stats.respawns, "skipped": len(stats.skipped_tasks)}
    os.write(fd, json.dumps(result).encode() + b"\n")


def orphan(method: str, folder: str) -> None:
    loader = DataLoader(
        Hangs(os.path.join(folder, "hanging")),
        batch_size=1,
        num_workers=1,
        multiprocessing_context=method,
    )
    for _ in loader:
        pass


if __name__ == "__main__":
    if sys.argv[1] == "pause":
        pause(sys.argv[2], int(sys.argv[3]))
    else:
        orphan(sys.argv[2], sys.argv[3])
