"""The per-partition pipeline of a ``Stream``: a chain of nodes, each with a restartable position.

A partition's rows come out of a chain: a source node (its shards, read in the pass's order),
then one node per stage (``map``, ``filter``, and the buffering stages: shuffle, pack, mix). Every
node answers three calls:

* ``pull()``: the next item, or ``END`` when the partition's pass has no further one;
* ``position()``: a list of ints (``len(fields)`` of them) such that a fresh chain, after
  ``seek(position)``, pulls exactly the items this one would pull next. A buffering node's
  position is the position of its input where its buffer began, plus its own counters: a seek
  re-reads that buffer (bounded) instead of storing samples;
* ``seek(position)``: go there (lazily: the work happens at the next ``pull()``).

Three rules keep the cursor table simple and the re-deal of ``loader/resume.py`` generic: a
node's position at the start of a pass is all zeros; a position is a function of what was
pulled, never of the layout; and a chain that was seeked reports, after each later pull, the
same position the original chain reported after that pull (``random_map`` keys each item's
generator by it). A node that raised is thrown away; the reader rebuilds the chain
from the last position it recorded, so a failed pull neither loses nor repeats an item.

A stage is described by a ``Stage`` (picklable, sent to workers with the ``Stream``); it names
itself in the state's ``pipeline`` and builds its node over the node before it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..state.seeds import STREAM_ITEM, derive_seed

__all__ = [
    "END",
    "SOURCE_FIELDS",
    "Context",
    "FilterStage",
    "MapStage",
    "Node",
    "RandomMapStage",
    "Source",
    "Stage",
    "stage_name",
]

END: Any = object()  # a partition's pass has no further item

# The source's position: which of the pass's shards it is reading (index into the partition's
# shard list), the next sample of that shard (what ``read(shard, offset)`` starts at), and the
# source samples read in this pass.
SOURCE_FIELDS: tuple[str, ...] = ("shard_i", "offset", "src")


@dataclass(frozen=True)
class Context:
    """What a node may depend on besides its input: the Stream's seed, the pass and the
    partition (never the rank, worker or batch size)."""

    seed: int
    epoch: int
    partition: int


class Node:
    """One stage of one partition's chain (see the module docstring for the contract)."""

    fields: tuple[str, ...] = ()

    def pull(self) -> Any:
        raise NotImplementedError

    def position(self) -> list[int]:
        raise NotImplementedError

    def seek(self, pos: list[int]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Drop open shard iterators (files, generators); the node is not used again."""


class Stage:
    """A stage's description: picklable, compared by ``name`` in a saved state."""

    name: str = ""

    def fields(self, upstream: tuple[str, ...]) -> tuple[str, ...]:
        """The chain's position fields once this stage is appended to ``upstream``."""
        return upstream

    def build(self, upstream: Node, ctx: Context) -> Node:
        raise NotImplementedError


def stage_name(kind: str, fn: Callable[..., Any]) -> str:
    return f"{kind}:{getattr(fn, '__qualname__', None) or type(fn).__name__}"


# ---- the source ----


class Source(Node):
    """A partition's shards for one pass, read one after the other from its cursor.

    ``open_shard(shard_key, start)`` returns an iterator over the shard's samples from
    ``start`` (the Stream's ``_open``: it seeks, or reads and discards for a reader without
    ``start``). A read error leaves the position where it was: the chain is rebuilt and the
    shard reopened there.
    """

    fields = SOURCE_FIELDS

    def __init__(self, shard_keys: list[Any], open_shard: Callable[[Any, int], Iterator[Any]]):
        self.keys = shard_keys
        self.open_shard = open_shard
        self.shard_i = 0
        self.offset = 0
        self.src = 0
        self.it: Iterator[Any] | None = None

    def pull(self) -> Any:
        while True:
            it = self.it
            if it is None:
                if self.shard_i >= len(self.keys):
                    return END
                it = self.it = self.open_shard(self.keys[self.shard_i], self.offset)
            try:
                sample = next(it)
            except StopIteration:
                self.it = None
                self.shard_i += 1
                self.offset = 0
                continue
            self.offset += 1
            self.src += 1
            return sample

    def position(self) -> list[int]:
        return [self.shard_i, self.offset, self.src]

    def seek(self, pos: list[int]) -> None:
        self.shard_i, self.offset, self.src = pos
        self.it = None

    def close(self) -> None:
        self.it = None


# ---- map and filter ----


@dataclass(frozen=True)
class MapStage(Stage):
    fn: Callable[[Any], Any]

    @property
    def name(self) -> str:  # type: ignore[override]
        return stage_name("map", self.fn)

    def build(self, upstream: Node, ctx: Context) -> Node:
        return _Map(upstream, self.fn)


class _Map(Node):
    """``fn`` on each item; no position of its own."""

    def __init__(self, up: Node, fn: Callable[[Any], Any]) -> None:
        self.up = up
        self.fn = fn
        self.fields = up.fields

    def pull(self) -> Any:
        item = self.up.pull()
        return item if item is END else self.fn(item)

    def position(self) -> list[int]:
        return self.up.position()

    def seek(self, pos: list[int]) -> None:
        self.up.seek(pos)

    def close(self) -> None:
        self.up.close()


@dataclass(frozen=True)
class FilterStage(Stage):
    fn: Callable[[Any], bool]

    @property
    def name(self) -> str:  # type: ignore[override]
        return stage_name("filter", self.fn)

    def fields(self, upstream: tuple[str, ...]) -> tuple[str, ...]:
        # One count per filter: the input items it dropped in this pass (accounting; the
        # input's own position already steps past them, so a resume never re-reads one).
        return (*upstream, "filtered")

    def build(self, upstream: Node, ctx: Context) -> Node:
        return _Filter(upstream, self.fn)


class _Filter(Node):
    def __init__(self, up: Node, fn: Callable[[Any], bool]) -> None:
        self.up = up
        self.fn = fn
        self.fields = (*up.fields, "filtered")
        self.dropped = 0

    def pull(self) -> Any:
        while True:
            item = self.up.pull()
            if item is END or self.fn(item):
                return item
            self.dropped += 1

    def position(self) -> list[int]:
        return [*self.up.position(), self.dropped]

    def seek(self, pos: list[int]) -> None:
        self.up.seek(pos[:-1])
        self.dropped = pos[-1]

    def close(self) -> None:
        self.up.close()


# ---- random_map: a generator per item, keyed by where the item is ----


@dataclass(frozen=True)
class RandomMapStage(Stage):
    fn: Callable[[Any, np.random.Generator], Any]

    @property
    def name(self) -> str:  # type: ignore[override]
        return stage_name("random_map", self.fn)

    def build(self, upstream: Node, ctx: Context) -> Node:
        return _RandomMap(upstream, self.fn, ctx)


class _RandomMap(Node):
    """``fn(item, rng)``, ``rng`` a numpy Generator seeded from (the Stream's seed, the pass,
    the partition, the item's position in the partition). The position is the same however
    the chain got there (a resume, another layout, a respawned worker), so the draws are too;
    and the process's global RNGs are left alone (with ``num_workers=0`` they are the
    trainer's)."""

    def __init__(self, up: Node, fn: Callable[[Any, np.random.Generator], Any], ctx: Context):
        self.up = up
        self.fn = fn
        self.fields = up.fields
        self.key = (ctx.seed, ctx.epoch, ctx.partition)

    def pull(self) -> Any:
        item = self.up.pull()
        if item is END:
            return item
        seed = derive_seed(STREAM_ITEM, *self.key, *self.up.position())
        return self.fn(item, np.random.Generator(np.random.PCG64(seed)))

    def position(self) -> list[int]:
        return self.up.position()

    def seek(self, pos: list[int]) -> None:
        self.up.seek(pos)

    def close(self) -> None:
        self.up.close()
