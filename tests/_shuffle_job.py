"""A shuffled ``Stream`` for ``test_streams_shuffle``, and the training loop its killed-process
case runs in a subprocess.

    python tests/_shuffle_job.py SPEC_JSON

``make(buffer_size, read)``   16 synthetic shards (``_stream_shards``) in 8 partitions, a filter
                              before the shuffle, then ``shuffle(buffer_size)``, a map and a
                              filter after it: every kind of stage around the shuffle.
``DieOnce(marker, target, scope)``  a seekable reader that, the first time it reads sample
                              ``target`` (``marker`` does not exist yet: it is created
                              atomically), SIGKILLs its worker (``scope="worker"``) or the whole
                              job, main process and workers together, as a preemption does
                              (``scope="job"``: the job runs in its own process group), or raises
                              ``OSError`` (``scope="raise"``: a transient read error).

The loop (``main``) builds the loader, resumes from ``ckpt`` if it exists, and runs ``epochs``
epochs. After each batch it writes the batch to ``out`` (one json line) and then saves
``{"n": batches written, "state": loader.state_dict()}`` atomically to ``ckpt``; a resumed run
first cuts ``out`` back to the ``n`` lines its checkpoint covers (a batch written after the last
save is produced again), so ``out`` ends as the uninterrupted run's batches, if the resume is
exact.

SPEC keys: buffer_size, workers, batch_size, epochs, out, ckpt, target ([shard, i] or null),
marker.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import _stream_shards as F

from resumable_loader import DataLoader, Stream, dump_state, load_state, save_checkpoint

SHARDS = 16
PARTITIONS = 8


def keep_before(x: int) -> bool:
    """The filter before the shuffle: drops about one sample in seven."""
    return x % 7 != 3


def keep_after(x: float) -> bool:
    """The filter after the shuffle (and the map): drops about one sample in five."""
    return int(x) % 5 != 1


def make(buffer_size: int, read: Any = F.read) -> Stream:
    return (
        Stream.from_shards(list(range(SHARDS)), read, partitions=PARTITIONS)
        .filter(keep_before)
        .shuffle(buffer_size)
        .map(F.plus_half)
        .filter(keep_after)
    )


def expected_samples() -> list[float]:
    """Every sample one pass delivers, sorted."""
    return sorted(
        x + 0.5 for x in F.all_samples(list(range(SHARDS))) if keep_before(x) and keep_after(x)
    )


class DieOnce:
    """A seekable reader that fails once, at sample ``target`` (see the module docstring)."""

    def __init__(self, marker: str, target: int, scope: str) -> None:
        self.marker = marker
        self.target = target
        self.scope = scope

    def __call__(self, s: int, start: int) -> Iterator[int]:
        for i in range(start, F.shard_len(s)):
            x = F.sample(s, i)
            if x == self.target and self._first():
                if self.scope == "raise":
                    raise OSError(f"transient read error at sample {x}")
                if self.scope == "job":
                    os.killpg(os.getpgrp(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            yield x

    def _first(self) -> bool:
        try:
            os.close(os.open(self.marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            return False
        return True


def main(spec: dict[str, Any]) -> None:
    target = spec.get("target")
    read: Any = F.read
    if target is not None:
        # The kill takes the whole process group: only a job that leads its own group (started
        # with start_new_session=True) may arm it, never one sharing the test runner's group.
        if os.getpgrp() != os.getpid():
            raise SystemExit("_shuffle_job: a target needs its own process group")
        read = DieOnce(spec["marker"], F.sample(*target), "job")
    loader = DataLoader(
        make(spec["buffer_size"], read), batch_size=spec["batch_size"], num_workers=spec["workers"]
    )
    n, start = 0, 0
    if os.path.exists(spec["ckpt"]):
        with open(spec["ckpt"]) as f:
            saved = json.load(f)
        n = saved["n"]
        state = load_state(base64.b64decode(saved["state"]))
        loader.load_state_dict(state)
        start = state["epoch"]
        with open(spec["out"]) as f:
            lines = f.readlines()[:n]
        with open(spec["out"], "w") as f:
            f.writelines(lines)
    with open(spec["out"], "a") as out:
        for epoch in range(start, spec["epochs"]):
            for batch in loader:
                out.write(json.dumps([epoch, batch.tolist()]) + "\n")
                out.flush()
                n += 1
                state64 = base64.b64encode(dump_state(loader.state_dict())).decode()
                save_checkpoint(json.dumps({"n": n, "state": state64}).encode(), spec["ckpt"])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
