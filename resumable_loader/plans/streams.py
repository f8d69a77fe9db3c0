"""The partition plan of a ``Stream``: pure arithmetic on (seed, pass, shards, partitions).

A ``Stream``'s shards are dealt to ``P`` partitions, fixed at the first run and kept in the
state. This module owns everything about that plan that needs no data and no process:

* ``default_partitions`` and ``check_partitions``: how many partitions a shard list gets;
* ``deal``: which shards partition ``p`` reads in pass ``e``, and in which order;
* ``owned`` and ``check_layout``: which partitions one reader (rank x worker) owns, and which
  layouts are valid (ranks x workers must divide ``P``; the error names the valid ones);
* ``canonical_order``: the global stream's order, by ``(pass, row in pass, partition)``;
* the state's shape: the cursor fields, ``shard_digest``, and ``parse_state`` (validation of a
  saved Stream state, every refusal a ``CheckpointError`` naming the field).

The runtime side -- reading shards, the per-partition pipelines, the reader -- is
``plans/stream.py``; it runs in workers, as ``Mixture.__getitem__`` does.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.errors import CheckpointError
from .interleave import pass_keys, permute

__all__ = [
    "CURSOR_FIELDS",
    "HEAD_FIELDS",
    "STATE_KIND",
    "STATE_VERSION",
    "StreamMeta",
    "canonical_order",
    "check_layout",
    "check_partitions",
    "deal",
    "deal_one",
    "default_partitions",
    "fresh_cursor",
    "merge_cursors",
    "owned",
    "parse_state",
    "partition_key",
    "positional_stages",
    "shard_digest",
    "valid_readers",
]

STATE_KIND = "resumable_loader.Stream"
STATE_VERSION = 1
META_KEY = "stream"  # the state's one non-partition key; the others are partition ids

# A partition's cursor: one list of ints, positions only -- never samples. Its head is the
# reader's, the same for every pipeline:
#   pass     the partition's pass (its own epoch)
#   done     1 once pass `pass` was drawn to its end
#   rows     rows drawn from this pass (the key of the canonical order; skipped rows count)
#   skip     rows still to be drawn and discarded before the next delivered one (skip_samples)
# and its tail is the partition chain's position (``plans/stream_nodes.py``): the source's
# ``shard_i`` (index into deal(pass)[p]), ``offset`` (the next sample of that shard) and
# ``src`` (source samples read in this pass), then each stage's own fields (a filter's
# ``filtered`` count, a shuffle's window, a packer's carry). The state's ``stream.fields``
# names them all; a position at a pass's start is all zeros.
HEAD_FIELDS = ("pass", "done", "rows", "skip")
PASS, DONE, ROWS, SKIP = range(len(HEAD_FIELDS))
SHARD_I = len(HEAD_FIELDS)  # the source's fields come first in every chain over shards
OFFSET, SRC = SHARD_I + 1, SHARD_I + 2
# The fields of a Stream with no stage after the read (kept for tests and tools).
CURSOR_FIELDS = (*HEAD_FIELDS, "shard_i", "offset", "src")

# At least this many shards per partition by default: partitions of equal-sized shards then
# differ in length by at most about 1/8.
SHARDS_PER_PARTITION = 8
MAX_DEFAULT_PARTITIONS = 4096

# Stages whose function may change at a resume: their positions count input items, whatever
# the function does. Every other stage's name carries what its position means (a shuffle's
# buffer size, ...), so a state is only valid for the same name, in the same order.
FREE_STAGES = ("map:", "random_map:", "filter:")


def positional_stages(pipeline: Sequence[str]) -> list[str]:
    """The stages of ``pipeline`` (``Stream.pipeline()``) a state's positions depend on, by
    what a position means in them: every stage that buffers (shuffle, pack), and a filter
    before one; a concat packer's carry is a token count that any ``seq_len`` continues, so
    its ``seq_len`` is not part of that (a best-fit window's rows are, and keep it)."""
    stages = list(pipeline[1:])
    buffers = [i for i, name in enumerate(stages) if not name.startswith(FREE_STAGES)]
    out = []
    for i, name in enumerate(stages):
        # A filter before a stage that buffers decides which items fill its windows: another
        # filter would re-read another window from the same position. It is compared by name
        # (an edited function under the same name cannot be seen).
        if name.startswith(FREE_STAGES) and not (
            name.startswith("filter:") and buffers and i < buffers[-1]
        ):
            continue
        out.append("pack:concat" if name.startswith("pack:concat(") else name)
    return out


# ---- how many partitions ----


def default_partitions(n_shards: int) -> int:
    """The largest ``2**a`` or ``3 * 2**a`` that is at most ``max(1, n_shards // 8)`` and at
    most 4096: numbers that the usual layouts (powers of two, times three) divide."""
    cap = min(max(1, n_shards // SHARDS_PER_PARTITION), MAX_DEFAULT_PARTITIONS)
    best = 1
    p = 1
    while p <= cap:
        best = max(best, p)
        if 3 * p <= cap:
            best = max(best, 3 * p)
        p *= 2
    return best


def check_partitions(partitions: Any, n_shards: int) -> int:
    """``partitions`` checked against the shard count (None: the default).

    Raises:
        ValueError: not an int in ``1 .. n_shards``.
    """
    if partitions is None:
        return default_partitions(n_shards)
    if type(partitions) is not int or not 1 <= partitions <= n_shards:
        raise ValueError(
            f"partitions must be an int in 1..{n_shards} (the number of shards), got {partitions!r}"
        )
    return partitions


# ---- dealing shards ----


def deal(seed: int, epoch: int, n_shards: int, partitions: int, shuffle: bool) -> list[list[int]]:
    """The shard indices each partition reads in pass ``epoch``, in reading order.

    The shards are put in a seeded order per pass (a keyed bijection: no RNG state), then dealt
    round-robin, so partitions' shard counts differ by at most one. A pure function of its
    arguments: every process computes the same deal, and the state need not hold it.
    """
    if shuffle:
        keys = pass_keys(seed, "stream-shards", epoch)
        order = [permute(i, n_shards, keys) for i in range(n_shards)]
    else:
        order = list(range(n_shards))
    return [order[p::partitions] for p in range(partitions)]


def deal_one(
    seed: int, epoch: int, n_shards: int, partitions: int, shuffle: bool, p: int
) -> list[int]:
    """``deal(...)[p]`` alone, in O(n_shards / partitions): what one reader computes for each
    partition it owns."""
    if shuffle:
        keys = pass_keys(seed, "stream-shards", epoch)
        return [permute(i, n_shards, keys) for i in range(p, n_shards, partitions)]
    return list(range(p, n_shards, partitions))


def shard_digest(shards: Sequence[Any]) -> str:
    """A digest of the shard list (each key's ``repr``), which a state is checked against."""
    text = json.dumps([repr(k) for k in shards])
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]


# ---- layouts ----


def valid_readers(partitions: int) -> list[int]:
    """The reader counts (ranks x max(num_workers, 1)) that divide ``partitions``."""
    return [d for d in range(1, partitions + 1) if partitions % d == 0]


def check_layout(partitions: int, world_size: int, num_workers: int) -> None:
    """Refuse a layout whose readers do not divide the partitions.

    Raises:
        ValueError: naming the valid reader counts and, for this world size, the valid
            ``num_workers``.
    """
    k = max(num_workers, 1)
    if partitions % (world_size * k) == 0:
        return
    readers = valid_readers(partitions)
    per_rank = [d for d in readers if partitions % (world_size * d) == 0]
    with_ranks = (
        f"; with {world_size} ranks: num_workers in {', '.join(map(str, per_rank))}"
        if per_rank
        else f"; no num_workers fits {world_size} ranks"
    )
    raise ValueError(
        f"Stream has {partitions} partitions (fixed at the first run; a state keeps them): "
        f"{world_size} ranks x {k} workers = {world_size * k} readers do not divide them. "
        f"Valid readers per job (ranks x max(num_workers, 1)): "
        f"{', '.join(map(str, readers))}{with_ranks}. Or build the Stream with another "
        f"partitions= (for few shards of equal size, partitions=len(shards))."
    )


def owned(partitions: int, world_size: int, rank: int, num_workers: int, worker: int) -> list[int]:
    """The partitions reader (rank, worker) owns: ``p mod W == rank`` and
    ``(p div W) mod K == worker``."""
    k = max(num_workers, 1)
    return [
        p for p in range(partitions) if p % world_size == rank and (p // world_size) % k == worker
    ]


def canonical_order(rows: dict[int, int], start: dict[int, int] | None = None) -> list[int]:
    """The partition of each row of the canonical stream over one pass, given each
    partition's number of ``rows`` (and the rows already taken, ``start``): rows are sorted by
    ``(row in pass, partition)``. The reference a reader's order is checked against."""
    start = start or {}
    heap = [(start.get(p, 0), p) for p in rows if start.get(p, 0) < rows[p]]
    heapq.heapify(heap)
    out = []
    while heap:
        k, p = heap[0]
        out.append(p)
        if k + 1 < rows[p]:
            heapq.heapreplace(heap, (k + 1, p))
        else:
            heapq.heappop(heap)
    return out


# ---- the state ----


def fresh_cursor(epoch: int, width: int) -> list[int]:
    """A partition's cursor of ``width`` ints at the start of pass ``epoch`` (every node's
    position at a pass's start is zeros)."""
    c = [0] * width
    c[PASS] = epoch
    return c


@dataclass(frozen=True)
class StreamMeta:
    """What a Stream's state says about the plan (its ``"stream"`` key)."""

    seed: int
    partitions: int
    shuffle_shards: bool
    epoch: int
    shard_count: int
    digest: str
    pipeline: tuple[str, ...]
    fields: tuple[str, ...]

    def to_state(self, layout: dict[str, int]) -> dict[str, Any]:
        return {
            "kind": STATE_KIND,
            "version": STATE_VERSION,
            "seed": self.seed,
            "partitions": self.partitions,
            "shuffle_shards": self.shuffle_shards,
            "epoch": self.epoch,
            "shards": {"count": self.shard_count, "digest": self.digest},
            "pipeline": list(self.pipeline),
            "fields": list(self.fields),
            "layout": dict(layout),
        }


def _field(obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise CheckpointError(f"Stream state: {where}{key} is missing")
    return obj[key]


def _int(value: Any, where: str, low: int = 0) -> int:
    if type(value) is not int or value < low:
        raise CheckpointError(f"Stream state: {where} must be an int >= {low}, got {value!r}")
    return value


def _parse_meta(
    meta: Any,
    shard_count: int,
    digest: str,
    partitions: int | None,
    fields: tuple[str, ...],
    ours: tuple[str, ...] | None,
) -> StreamMeta:
    kind = _field(meta, "kind", "stream.")
    if kind != STATE_KIND:
        raise CheckpointError(f"Stream state: stream.kind is {kind!r}, expected {STATE_KIND!r}")
    version = _field(meta, "version", "stream.")
    if version != STATE_VERSION:
        raise CheckpointError(
            f"Stream state: stream.version {version!r} is not one this version reads "
            f"({STATE_VERSION})"
        )
    p_saved = _int(_field(meta, "partitions", "stream."), "stream.partitions", 1)
    if partitions is not None and partitions != p_saved:
        raise CheckpointError(
            f"Stream state: stream.partitions is {p_saved}, but this Stream was built with "
            f"partitions={partitions}; partitions are fixed at the first run (build it with "
            f"partitions=None or {p_saved})"
        )
    shards = _field(meta, "shards", "stream.")
    count = _field(shards, "count", "stream.shards.")
    if count != shard_count:
        raise CheckpointError(
            f"Stream state: stream.shards.count is {count!r}, this Stream has {shard_count} "
            "shards; a changed shard list cannot keep positions (start a fresh epoch)"
        )
    saved_digest = _field(shards, "digest", "stream.shards.")
    if saved_digest != digest:
        raise CheckpointError(
            f"Stream state: stream.shards.digest {saved_digest!r} is not this Stream's "
            f"{digest!r}: the shard list changed; positions cannot be kept (start a fresh epoch)"
        )
    if p_saved > shard_count:
        raise CheckpointError(
            f"Stream state: stream.partitions {p_saved} exceeds the {shard_count} shards"
        )
    saved_fields = _field(meta, "fields", "stream.")
    if not isinstance(saved_fields, list) or saved_fields != list(fields):
        raise CheckpointError(
            f"Stream state: stream.fields {saved_fields!r} are not this Stream's "
            f"{list(fields)}: the state was taken with another pipeline (its stages decide "
            "the cursor's fields); resume with the checkpoint's pipeline, or start the next "
            "epoch afresh"
        )
    seed = _field(meta, "seed", "stream.")
    if type(seed) is not int:
        raise CheckpointError(f"Stream state: stream.seed must be an int, got {seed!r}")
    shuffle = _field(meta, "shuffle_shards", "stream.")
    if type(shuffle) is not bool:
        raise CheckpointError(
            f"Stream state: stream.shuffle_shards must be a bool, got {shuffle!r}"
        )
    epoch = _int(_field(meta, "epoch", "stream."), "stream.epoch")
    pipeline = _field(meta, "pipeline", "stream.")
    if not isinstance(pipeline, list) or not all(isinstance(s, str) for s in pipeline):
        raise CheckpointError("Stream state: stream.pipeline must be a list of str")
    if ours is not None and positional_stages(pipeline) != positional_stages(ours):
        raise CheckpointError(
            f"Stream state: stream.pipeline is {pipeline}, this Stream's is {list(ours)}: the "
            f"stages {positional_stages(pipeline)} decide what a position means and must be "
            f"the same (this Stream has {positional_stages(ours)}); resume with the "
            "checkpoint's pipeline, or start the next epoch afresh"
        )
    return StreamMeta(
        seed, p_saved, shuffle, epoch, count, saved_digest, tuple(pipeline), tuple(fields)
    )


def partition_key(key: Any) -> Any:
    """A partition id as the state holds it: an int, or -- after a trip through json, which
    writes every key as a string -- its decimal string (``"17"``, never ``"017"`` or
    ``"+1"``). Anything else is returned unchanged, for the caller to refuse."""
    if type(key) is str and key.isdigit() and key.isascii() and str(int(key)) == key:
        return int(key)
    return key


def _parse_cursor(
    key: Any, value: Any, meta: StreamMeta, deals: dict[int, Any], shard_fields: bool
) -> list[int]:
    key = partition_key(key)
    if type(key) is not int or not 0 <= key < meta.partitions:
        raise CheckpointError(
            f"Stream state: key {key!r} is neither 'stream' nor a partition in "
            f"0..{meta.partitions - 1}"
        )
    where = f"partition {key}"
    fields = meta.fields
    if not isinstance(value, (list, tuple)) or len(value) != len(fields):
        raise CheckpointError(
            f"Stream state: {where} must be a list of {len(fields)} ints {list(fields)}, "
            f"got {value!r}"
        )
    c = [_int(v, f"{where} field {f!r}") for f, v in zip(fields, value)]
    if c[DONE] > 1:
        raise CheckpointError(f"Stream state: {where} field 'done' must be 0 or 1")
    if c[PASS] > meta.epoch:
        raise CheckpointError(
            f"Stream state: {where} is in pass {c[PASS]}, after stream.epoch {meta.epoch}"
        )
    if not shard_fields:
        return c  # a mixture's chain: its own fields are checked by ``stream_mix``
    n = deals.get(c[PASS])
    if n is None:
        # Only the shard count of this partition matters: deal_one is O(shards / P).
        n = deals[c[PASS]] = {}
    if key not in n:
        n[key] = len(
            deal_one(
                meta.seed, c[PASS], meta.shard_count, meta.partitions, meta.shuffle_shards, key
            )
        )
    if c[SHARD_I] > n[key]:
        raise CheckpointError(
            f"Stream state: {where} field 'shard_i' is {c[SHARD_I]}, but the partition "
            f"reads {n[key]} shards in pass {c[PASS]}"
        )
    if c[OFFSET] > c[SRC]:
        raise CheckpointError(
            f"Stream state: {where} field 'offset' is {c[OFFSET]}, more than the {c[SRC]} "
            "source samples ('src') read in its pass"
        )
    return c


def parse_state(
    state: Any,
    *,
    shard_count: int,
    digest: str,
    partitions: int | None,
    fields: tuple[str, ...] = CURSOR_FIELDS,
    shard_fields: bool = True,
    pipeline: tuple[str, ...] | None = None,
) -> tuple[StreamMeta, dict[int, list[int]]]:
    """A saved Stream state checked against this Stream: its plan and its cursors.

    ``partitions=None``: the Stream was built without an explicit count and adopts the
    state's. ``fields`` are this Stream's cursor fields (its pipeline's); a state with others
    is refused. ``pipeline`` is this Stream's ``pipeline()``: a state whose stages other than
    ``map`` and ``filter`` differ (another shuffle buffer size, ...) is refused. Cursors are
    checked field by field; ranges that need the deal (``shard_i``) are checked against it
    when the chain starts at the shards (``shard_fields``; a mixture's chain starts at its mix
    node, whose fields ``plans/stream_mix.py`` checks).

    Raises:
        CheckpointError: naming the field that does not fit.
    """
    if not isinstance(state, dict):
        raise CheckpointError(
            f"Stream state must be a dict (Stream.state_dict()), got {type(state).__name__}"
        )
    meta = _parse_meta(
        _field(state, META_KEY, ""), shard_count, digest, partitions, fields, pipeline
    )
    deals: dict[int, Any] = {}
    cursors = {
        partition_key(key): _parse_cursor(key, value, meta, deals, shard_fields)
        for key, value in state.items()
        if key != META_KEY
    }
    if len(cursors) != len(state) - 1:
        raise CheckpointError("Stream state: a partition is there twice (as 3 and as '3')")
    return meta, cursors


def merge_cursors(states: Iterable[dict[int, list[int]]]) -> dict[int, list[int]]:
    """Several readers' cursors as one table (each partition in one reader only).

    Raises:
        CheckpointError: a partition in two readers' states.
    """
    table: dict[int, list[int]] = {}
    for s in states:
        for p, c in s.items():
            if p in table:
                raise CheckpointError(f"Stream state: partition {p} is in two readers' states")
            table[p] = c
    return table
