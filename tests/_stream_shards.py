"""Synthetic shards for the ``Stream`` tests: picklable readers whose samples say where they
came from, so a test can check every sample of an epoch exactly once.

``shard_len(s)``              shard ``s``'s length: 2..6, uneven on purpose (partitions end at
                              different rows, so the canonical order's exhaustion is exercised).
``sample(s, i)``              sample ``i`` of shard ``s``: ``s * 1000 + i``.
``read(s, start)``            a seekable reader.
``read_from_zero(s)``         a reader that can only start at 0 (a resume skips by reading).
``Counted(path)``             a seekable reader that appends ``"s i"`` for every sample it yields
                              to ``path`` (O_APPEND: workers may share it), so a test counts
                              reads across processes.
``all_samples(shards)``       every sample of the shards, as a sorted list.
"""

from __future__ import annotations

import os
from collections.abc import Iterator


def shard_len(s: int) -> int:
    return 2 + (s * 7) % 5


def sample(s: int, i: int) -> int:
    return s * 1000 + i


def read(s: int, start: int) -> Iterator[int]:
    for i in range(start, shard_len(s)):
        yield sample(s, i)


def read_from_zero(s: int) -> Iterator[int]:
    for i in range(shard_len(s)):
        yield sample(s, i)


class Counted:
    """A seekable reader that records every sample it yields (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, s: int, start: int) -> Iterator[int]:
        for i in range(start, shard_len(s)):
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, f"{s} {i}\n".encode())
            finally:
                os.close(fd)
            yield sample(s, i)


def reads(path: str) -> list[tuple[int, int]]:
    try:
        with open(path) as f:
            return [(int(a), int(b)) for a, b in (line.split() for line in f if line.strip())]
    except FileNotFoundError:
        return []


def all_samples(shards: list[int]) -> list[int]:
    return sorted(sample(s, i) for s in shards for i in range(shard_len(s)))


def odd(x: int) -> bool:
    return x % 2 == 1


def plus_half(x: int) -> float:
    return x + 0.5
