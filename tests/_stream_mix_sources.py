"""Sources for the ``Stream.mix`` tests: named Streams over disjoint shard ranges, so a sample
says which source it came from (``source_of``), and a model of each source partition's rows
that does not use the Stream (``source_rows``: the deal, then each shard's samples in order).

``web``: shards 0.., ``code``: shards 100.., ``math``: shards 200..; sample ``i`` of shard ``s``
is ``s * 1000 + i`` (``_stream_shards``), so ``x // 100_000`` is the source's index.
"""

from __future__ import annotations

from typing import Any

import _stream_shards as F

from resumable_loader import Stream
from resumable_loader.plans.streams import deal

NAMES = ("web", "code", "math")
BASE = {"web": 0, "code": 100, "math": 200}
SEEDS = {"web": 1, "code": 2, "math": 3}


def keys(name: str, n: int) -> list[int]:
    return list(range(BASE[name], BASE[name] + n))


def source(name: str, n: int, partitions: int) -> Stream:
    return Stream.from_shards(keys(name, n), F.read, seed=SEEDS[name], partitions=partitions)


def source_of(x: Any) -> str:
    return NAMES[int(x) // 100_000]


def source_rows(name: str, n: int, partitions: int, q: int, epoch: int) -> list[int]:
    """Partition ``q``'s rows of source ``name`` in pass ``epoch``, from the deal alone."""
    ks = keys(name, n)
    shards = [ks[i] for i in deal(SEEDS[name], epoch, n, partitions, True)[q]]
    return [F.sample(s, i) for s in shards for i in range(F.shard_len(s))]


def partition_of(x: Any, sizes: dict[str, tuple[int, int]], epoch: int) -> int:
    """The partition of a row of a mixture whose sources all have its partition count
    (``sizes``: name -> (shards, partitions))."""
    name = source_of(x)
    n, p = sizes[name]
    shard = int(x) // 1000
    for q, part in enumerate(deal(SEEDS[name], epoch, n, p, True)):
        if shard - BASE[name] in part:
            return q
    raise AssertionError(f"{x} is in no partition of {name}")
