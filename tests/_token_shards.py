"""Synthetic token shards for the ``Stream.pack`` tests: every token says which document it is
and where in it, so a test checks every token of a pass exactly once.

``token(doc, offset)``        ``doc << 20 | offset`` (int64); ``doc_of``/``offset_of`` decode it.
``Docs(lengths)``             a picklable seekable reader over shards whose documents have the
                              given lengths: ``lengths[s][i]`` is the length of document ``i``
                              of shard ``s``, whose id is ``s * 1000 + i``. A document is
                              ``{"input_ids": int64 array, "doc": id}``.
``seeded(shards, docs, mean, seed)``  ``Docs`` with lengths from a seeded lognormal (mean about
                              ``mean`` tokens, some empty and some long ones on purpose).
``Docs.tokens(s)``            shard ``s``'s documents' tokens, in reading order.
``Counted(docs, path)``       ``docs`` that append ``"s i"`` for every document read to ``path``
                              (O_APPEND: workers may share it).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence

import numpy as np

SHIFT = 20


def token(doc: int, offset: int) -> int:
    return (doc << SHIFT) | offset


def doc_of(tok: int) -> int:
    return tok >> SHIFT


def offset_of(tok: int) -> int:
    return tok & ((1 << SHIFT) - 1)


def doc_id(s: int, i: int) -> int:
    return s * 1000 + i


class Docs:
    """A seekable reader (see the module docstring)."""

    def __init__(self, lengths: Sequence[Sequence[int]]) -> None:
        self.lengths = [list(x) for x in lengths]

    def doc(self, s: int, i: int) -> dict[str, object]:
        d = doc_id(s, i)
        ids = (np.int64(d) << SHIFT) | np.arange(self.lengths[s][i], dtype=np.int64)
        return {"input_ids": ids, "doc": d}

    def __call__(self, s: int, start: int) -> Iterator[dict[str, object]]:
        for i in range(start, len(self.lengths[s])):
            yield self.doc(s, i)

    def tokens(self, s: int) -> list[int]:
        return [token(doc_id(s, i), o) for i, n in enumerate(self.lengths[s]) for o in range(n)]

    def doc_lengths(self) -> dict[int, int]:
        return {doc_id(s, i): n for s, ls in enumerate(self.lengths) for i, n in enumerate(ls)}

    @property
    def shards(self) -> list[int]:
        return list(range(len(self.lengths)))


def seeded(shards: int, docs: int, mean: float, seed: int = 0) -> Docs:
    """``shards`` shards of ``docs`` documents each (give or take 2), lognormal lengths."""
    rng = random.Random(seed)
    sigma = 0.9
    mu = np.log(mean) - sigma**2 / 2
    lengths = []
    for _ in range(shards):
        n = max(1, docs + rng.randint(-2, 2))
        lengths.append(
            [0 if rng.random() < 0.03 else int(rng.lognormvariate(mu, sigma)) + 1 for _ in range(n)]
        )
    return Docs(lengths)


class Counted(Docs):
    """``Docs`` that record every document they yield (see the module docstring)."""

    def __init__(self, lengths: Sequence[Sequence[int]], path: str) -> None:
        super().__init__(lengths)
        self.path = path

    def __call__(self, s: int, start: int) -> Iterator[dict[str, object]]:
        for i in range(start, len(self.lengths[s])):
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, f"{s} {i}\n".encode())
            finally:
                os.close(fd)
            yield self.doc(s, i)


def reads(path: str) -> list[tuple[int, int]]:
    try:
        with open(path) as f:
            return [(int(a), int(b)) for a, b in (line.split() for line in f if line.strip())]
    except FileNotFoundError:
        return []
