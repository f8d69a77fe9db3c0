"""A training script shaped as the README's quickstart, for ``test_whole_truth``.

    python tests/_resume_job.py SPEC_JSON

It seeds torch's global RNG at the top, builds the loader, loads ``state_in`` if given (as the
quickstart does: ``start_epoch = state["epoch"]``), and runs ``EPOCHS`` epochs in which every
step draws from torch, numpy and ``random`` the way dropout and augmentation do. Each batch is
appended to ``out`` as one json line (flushed: a SIGKILL keeps what came before). At ``stop``
(``[epoch, step]``) it saves ``loader.state_dict()`` to ``state_out`` with an atomic write and
then leaves the loop the way ``how`` says: ``break``, ``raise`` (an exception out of the loop,
caught at the top), or ``kill`` (SIGKILL itself, as a preempted job dies).

SPEC keys: kind ("map" | "stream"), workers, persistent, generator (None or a seed), seed (the
script's torch.manual_seed), noise (extra global draws before the loader is built), stop, how,
state_in, state_out, out.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from resumable_loader import DataLoader
from resumable_loader.testing import canonical

EPOCHS = 3
N = 24


class AugMap(Dataset):
    """Item i: its index and one draw each from torch, numpy and ``random``."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"i": i, "t": torch.rand(1), "n": np.random.rand(), "r": random.random()}


class AugStream(IterableDataset):
    """A stream sharded over workers (item j to worker j % W), with O(1) state: its position.
    Each item carries draws from the three RNGs, as an augmentation would."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self):
        info = get_worker_info()
        k, w = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = list(range(k, N, w))
        while self.pos < len(mine):
            j = mine[self.pos]
            self.pos += 1
            yield {"i": j, "t": torch.rand(1), "n": np.random.rand(), "r": random.random()}
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd["pos"]


def build(spec: dict[str, Any]) -> DataLoader:
    gen = None
    if spec.get("generator") is not None:
        gen = torch.Generator().manual_seed(spec["generator"])
    stream = spec["kind"] == "stream"
    return DataLoader(
        AugStream() if stream else AugMap(),
        batch_size=4,
        shuffle=None if stream else True,
        num_workers=spec["workers"],
        persistent_workers=spec.get("persistent", False),
        generator=gen,
    )


def _save(state: dict[str, Any], path: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        torch.save({"loader": state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Stop(Exception):
    pass


def train(spec: dict[str, Any]) -> None:
    torch.manual_seed(spec.get("seed", 0))
    for _ in range(spec.get("noise", 0)):
        torch.rand(3), np.random.rand(3), random.random()
    loader = build(spec)
    start_epoch = 0
    if spec.get("state_in"):
        state = torch.load(spec["state_in"], weights_only=True)["loader"]
        loader.load_state_dict(state)
        start_epoch = state["epoch"]
    stop = spec.get("stop")
    how = spec.get("how", "break")
    with open(spec["out"], "a") as out:
        try:
            for epoch in range(start_epoch, EPOCHS):
                for step, batch in enumerate(loader):
                    out.write(json.dumps([epoch, canonical(batch)]) + "\n")
                    out.flush()
                    # The training step: dropout and augmentation draw from every global RNG.
                    torch.rand(7), np.random.rand(5), random.random()
                    if stop is not None and [epoch, step] == stop:
                        _save(loader.state_dict(), spec["state_out"])
                        if how == "kill":
                            os.kill(os.getpid(), signal.SIGKILL)
                        if how == "raise":
                            raise _Stop
                        break
                else:
                    continue
                break  # the inner loop stopped: leave the job
        except _Stop:
            pass
        finally:
            loader.close()


if __name__ == "__main__":
    train(json.loads(sys.argv[1]))
