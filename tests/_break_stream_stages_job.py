"""One rank of a gloo job for ``tests/behaviour/test_break_stream_stages.py``: a Stream of 8
shards in 2 partitions (no shard shuffle), where every odd shard is empty, so rank 1's only
partition holds no rows. Runs ``epochs`` epochs under our DataLoader's equal-batches agreement
and writes each epoch's batches to ``OUT/rank<r>.json``.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python this.py SPEC_JSON
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator

import torch.distributed as dist

from resumable_loader import DataLoader, Stream


def read(s: int, start: int) -> Iterator[int]:
    """Even shards hold 5 samples, odd ones none."""
    for i in range(start, 0 if s % 2 else 5):
        yield s * 1000 + i


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    stream = Stream.from_shards(list(range(8)), read, partitions=2, shuffle_shards=False)
    loader = DataLoader(stream, batch_size=2, num_workers=spec["workers"])
    out = {e: [b.tolist() for b in loader] for e in range(spec["epochs"])}
    path = os.path.join(spec["out"], f"rank{dist.get_rank()}.json")
    with open(path, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
