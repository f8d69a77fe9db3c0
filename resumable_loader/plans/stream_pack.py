"""``Stream.pack``: token sequences packed into rows of exactly ``seq_len`` tokens, per partition.

A packer is one node of a partition's chain (``plans/stream_nodes.py``), after the shuffle and
the mix, before the reader's interleave: a row is a function of that partition's documents
only, so no layout (ranks, workers, batch size) changes it, and its position is positions
only -- the carry of a split document is a place to re-read, never tokens::

    documents --> [concat]   fill a row from the carry, then from the next documents; the
                             rest of a split document is the carry of the next row
              --> [best_fit] read a window of M documents, split or drop those longer than
                             seq_len, best-fit-decreasing into bins, emit the bins in order

Positions (the node's fields after its input's):

* concat: the input's position *before the carry document*, ``carry_out`` (its tokens already
  in rows; 0: no carry, and the input's position is its current one), then the counters;
* best_fit: the input's position *at the window's start*, ``fit_rows(...)`` (the window's bins
  already emitted; 0 once a window is emitted whole, with the input's position at its end),
  then the counters. The field's name holds ``seq_len``, ``window`` and ``long``: a bin count
  means nothing under other ones, so a state taken with others is refused at load;
* the counters: ``docs`` (documents pulled), ``tokens_in`` (their full lengths),
  ``tokens_out`` (tokens in rows), ``pad``, ``dropped`` (counted losses: ``long="drop"``
  documents, a tail under ``tail="drop"``), ``carry_left`` (pulled tokens not yet in a row).
  ``tokens_in == tokens_out + dropped + carry_left`` at every position.

A seek re-reads at most the carry document (concat) or the window (best_fit), and checks the
re-read against the counters: data that changed under a saved position is an error, not a
silent loss.

``pack_collate`` flattens a batch of rows for variable-length attention (``cu_seqlens``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import stream_nodes as N

__all__ = ["COUNTER_FIELDS", "MODES", "PackStage", "check_pack_args", "pack_collate"]

MODES = ("concat", "best_fit")
LONG_POLICIES = ("split", "drop")
TAIL_POLICIES = ("pad", "drop")
IGNORE_INDEX = -100  # the label torch's and HF's cross-entropy skip

COUNTER_FIELDS = ("docs", "tokens_in", "tokens_out", "pad", "dropped", "carry_left")
DOCS, TOKENS_IN, TOKENS_OUT, PAD, DROPPED, CARRY_LEFT = range(len(COUNTER_FIELDS))


def check_pack_args(
    seq_len: Any, key: Any, mode: Any, window: Any, pad_id: Any, long: Any, tail: Any
) -> None:
    """Refuse ``Stream.pack`` arguments that cannot work, naming the argument and the fix.

    Raises:
        ValueError: a value out of range or not one of the choices.
        TypeError: a value of the wrong type.
    """
    if type(seq_len) is not int or seq_len < 1:
        raise ValueError(f"pack(seq_len=...) must be an int >= 1, got {seq_len!r}")
    if key is not None and not isinstance(key, str):
        raise TypeError(
            f"pack(key=...) must be a str (the item's token field) or None (the item is the "
            f"token sequence), got {key!r}"
        )
    if mode not in MODES:
        raise ValueError(f"pack(mode=...) must be one of {MODES}, got {mode!r}")
    if type(window) is not int or window < 1:
        raise ValueError(f"pack(window=...) must be an int >= 1 (documents), got {window!r}")
    if type(pad_id) is not int:
        raise TypeError(f"pack(pad_id=...) must be an int, got {pad_id!r}")
    if long not in LONG_POLICIES:
        raise ValueError(f"pack(long=...) must be one of {LONG_POLICIES}, got {long!r}")
    if tail not in TAIL_POLICIES:
        raise ValueError(f"pack(tail=...) must be one of {TAIL_POLICIES}, got {tail!r}")


@dataclass(frozen=True)
class PackStage(N.Stage):
    """``Stream.pack``'s description (see ``Stream.pack`` for the arguments)."""

    seq_len: int
    key: str | None = "input_ids"
    mode: str = "concat"
    window: int = 1024
    pad_id: int = 0
    long: str = "split"
    tail: str = "pad"

    @property
    def name(self) -> str:  # type: ignore[override]
        if self.mode == "concat":
            return f"pack:concat(seq_len={self.seq_len})"
        return f"pack:best_fit(seq_len={self.seq_len},window={self.window},long={self.long})"

    def own_fields(self) -> tuple[str, ...]:
        if self.mode == "concat":
            # seq_len may change at a resume: the carry's tokens continue in rows of the new
            # length, each token still once.
            return ("carry_out", *COUNTER_FIELDS)
        return (
            f"fit_rows(seq_len={self.seq_len},window={self.window},long={self.long})",
            *COUNTER_FIELDS,
        )

    def fields(self, upstream: tuple[str, ...]) -> tuple[str, ...]:
        return (*upstream, *self.own_fields())

    def build(self, upstream: N.Node, ctx: N.Context) -> N.Node:
        if self.mode == "concat":
            return _Concat(upstream, self)
        return _BestFit(upstream, self)


# ---- rows ----


def _tokens(item: Any, key: str | None) -> np.ndarray:
    seq = item if key is None else item[key]
    if isinstance(seq, torch.Tensor):
        seq = seq.numpy()
    arr = np.asarray(seq)
    if arr.ndim != 1 or (arr.dtype.kind not in "iu" and arr.size):
        raise ValueError(
            f"Stream.pack: {'the item' if key is None else repr(key)} must be a 1-D sequence of "
            f"int tokens, got {type(seq).__name__} of shape {arr.shape} and dtype {arr.dtype}"
        )
    return arr


_ARANGES: dict[int, np.ndarray] = {}


def _arange(n: int) -> np.ndarray:
    """``0 .. n-1`` (int64), cached: a row's positions are slices of it."""
    a = _ARANGES.get(n)
    if a is None:
        a = _ARANGES[n] = np.arange(n, dtype=np.int64)
        a.flags.writeable = False
    return a


def _row(pieces: list[np.ndarray], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """A row from its segments (each a contiguous run of one document), padded to seq_len.

    ``position_ids`` restart at 0 at every segment (a split document's continuation cannot
    attend to its head in another row); the padding is one more run of positions from 0.
    ``segment_ids`` are 1, 2, ... per segment and 0 on padding; ``labels`` are the tokens with
    ``-100`` at each segment's first token (the token before it is another document's) and on
    padding.
    """
    # A row has a few segments (concat: about seq_len / mean document length + 1): slice
    # assignments per segment cost less than building index arrays for a vectorised fill.
    ar = _arange(seq_len)
    ids = np.empty(seq_len, dtype=np.int64)
    position_ids = np.empty(seq_len, dtype=np.int64)
    segment_ids = np.empty(seq_len, dtype=np.int64)
    starts = []
    at = 0
    for k, piece in enumerate(pieces, 1):
        end = at + len(piece)
        ids[at:end] = piece
        position_ids[at:end] = ar[: end - at]
        segment_ids[at:end] = k
        starts.append(at)
        at = end
    ids[at:] = pad_id
    position_ids[at:] = ar[: seq_len - at]
    segment_ids[at:] = 0
    labels = ids.copy()
    labels[starts] = IGNORE_INDEX
    labels[at:] = IGNORE_INDEX
    return {
        "input_ids": ids,
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        "labels": labels,
    }


def _check_reread(what: str, expected: int, got: int) -> None:
    if expected != got:
        raise RuntimeError(
            f"Stream.pack: re-reading the {what} at a saved position found {got} tokens where "
            f"the state counted {expected}: the data under the stream changed since the state "
            "was saved (resume on the same shards and map/filter functions)"
        )


# ---- concat ----


class _Concat(N.Node):
    """Concat-then-split: each row is the carry, then the next documents, cut at seq_len."""

    def __init__(self, up: N.Node, stage: PackStage) -> None:
        self.up = up
        self.stage = stage
        self.seq_len = stage.seq_len
        self.fields = (*up.fields, *stage.own_fields())
        self.counters = [0] * len(COUNTER_FIELDS)
        self.carry: np.ndarray | None = None  # the split document, and its tokens in rows: t
        self.t = 0
        self.before_carry: list[int] = []  # the input's position before the carry was pulled
        self.pending: list[int] | None = None  # a seek not yet acted on (seek is lazy)

    def _restore(self, pos: list[int]) -> None:
        n_up = len(self.up.fields)
        self.counters = list(pos[n_up + 1 :])
        t = pos[n_up]
        self.carry, self.t = None, 0
        if t:
            self.before_carry = self.up.position()
            doc = self.up.pull()
            if doc is N.END:
                _check_reread("carry document", self.counters[CARRY_LEFT] + t, 0)
            tokens = _tokens(doc, self.stage.key)
            _check_reread("carry document", self.counters[CARRY_LEFT] + t, len(tokens))
            self.carry, self.t = tokens, t

    def pull(self) -> Any:
        if self.pending is not None:
            pos, self.pending = self.pending, None
            self._restore(pos)
        c = self.counters
        S = self.seq_len
        pieces: list[np.ndarray] = []
        room = S
        up, key = self.up, self.stage.key
        while room:
            carry = self.carry
            if carry is None:
                before = up.position()
                doc = up.pull()
                if doc is N.END:
                    break
                carry = _tokens(doc, key)
                c[DOCS] += 1
                c[TOKENS_IN] += len(carry)
                c[CARRY_LEFT] += len(carry)
                if not len(carry):
                    continue  # an empty document: counted, nothing to place
                self.carry, self.t, self.before_carry = carry, 0, before
            t = self.t
            n = min(room, len(carry) - t)
            pieces.append(carry[t : t + n])
            room -= n
            if t + n == len(carry):
                self.carry, self.t = None, 0
            else:
                self.t = t + n
        used = S - room
        if not used:
            return N.END
        c[CARRY_LEFT] -= used
        if room and self.stage.tail == "drop":
            c[DROPPED] += used  # the pass's last partial row: counted, not delivered
            return N.END
        c[TOKENS_OUT] += used
        c[PAD] += room
        return _row(pieces, S, self.stage.pad_id)

    def position(self) -> list[int]:
        if self.pending is not None:
            return list(self.pending)
        if self.carry is not None:
            return [*self.before_carry, self.t, *self.counters]
        return [*self.up.position(), 0, *self.counters]

    def seek(self, pos: list[int]) -> None:
        n_up = len(self.up.fields)
        self.up.seek(pos[:n_up])
        self.carry, self.t = None, 0
        self.pending = list(pos)

    def close(self) -> None:
        self.carry = None
        self.up.close()


# ---- best fit ----


def best_fit_bins(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Best-fit-decreasing: the items (by index into ``lengths``, each ``<= seq_len``) of each
    bin, bins in the order they were opened, items in a bin in arrival order.

    Items are placed longest first (ties: earlier first), each into the open bin with the least
    room that still fits it (ties: the earlier bin), else into a new bin. A pure function: a
    resume re-packs the re-read window into the same bins.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rooms: list[tuple[int, int]] = []  # (room left, bin), sorted
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(rooms, (n, -1))
        if k < len(rooms):
            room, at = rooms.pop(k)
        else:
            room, at = seq_len, len(bins)
            bins.append([])
        bins[at].append(i)
        bisect.insort(rooms, (room - n, at))
    for items in bins:
        items.sort()
    return bins


class _BestFit(N.Node):
    """Best-fit-decreasing over windows of ``window`` documents."""

    def __init__(self, up: N.Node, stage: PackStage) -> None:
        self.up = up
        self.stage = stage
        self.fields = (*up.fields, *stage.own_fields())
        self.counters = [0] * len(COUNTER_FIELDS)
        self.start: list[int] = []  # the input's position at the window's start
        self.rows: list[list[np.ndarray]] = []  # the window's bins, as pieces
        self.emitted = 0  # bins of the window already emitted
        self.pending: list[int] | None = None

    def _fill(self, count: bool) -> bool:
        """Read the next window and pack it; ``count``: a fresh window (not a seek's re-read),
        whose documents the counters have not seen yet. False: the input had no document
        left."""
        S, key, c = self.stage.seq_len, self.stage.key, self.counters
        self.start = self.up.position()
        pieces: list[np.ndarray] = []
        more = True
        for _ in range(self.stage.window):
            doc = self.up.pull()
            if doc is N.END:
                more = False
                break
            tokens = _tokens(doc, key)
            if count:
                c[DOCS] += 1
                c[TOKENS_IN] += len(tokens)
            if len(tokens) > S and self.stage.long == "drop":
                if count:
                    c[DROPPED] += len(tokens)
                continue
            if count:
                c[CARRY_LEFT] += len(tokens)
            pieces.extend(tokens[i : i + S] for i in range(0, len(tokens), S))
        bins = best_fit_bins([len(p) for p in pieces], S)
        self.rows = [[pieces[i] for i in b] for b in bins]
        self.emitted = 0
        return more

    def pull(self) -> Any:
        if self.pending is not None:
            pos, self.pending = self.pending, None
            n_up = len(self.up.fields)
            self.counters = list(pos[n_up + 1 :])
            self._fill(count=False)
            self.emitted = pos[n_up]
            left = sum(len(p) for row in self.rows[self.emitted :] for p in row)
            _check_reread("best-fit window", self.counters[CARRY_LEFT], left)
        while self.emitted == len(self.rows):
            # A window of empty or dropped documents makes no row: read the next one.
            if not self._fill(count=True) and not self.rows:
                return N.END
        pieces = self.rows[self.emitted]
        self.emitted += 1
        if self.emitted == len(self.rows):
            self.rows = []  # the window is emitted whole: the position moves past it
            self.emitted = 0
        used = sum(len(p) for p in pieces)
        c = self.counters
        c[CARRY_LEFT] -= used
        c[TOKENS_OUT] += used
        c[PAD] += self.stage.seq_len - used
        return _row(pieces, self.stage.seq_len, self.stage.pad_id)

    def position(self) -> list[int]:
        if self.pending is not None:
            return list(self.pending)
        if self.rows:
            return [*self.start, self.emitted, *self.counters]
        return [*self.up.position(), 0, *self.counters]

    def seek(self, pos: list[int]) -> None:
        n_up = len(self.up.fields)
        self.up.seek(pos[:n_up])
        self.rows, self.emitted = [], 0
        self.pending = list(pos) if pos[n_up] else None
        if self.pending is None:
            self.counters = list(pos[n_up + 1 :])

    def close(self) -> None:
        self.rows = []
        self.up.close()


# ---- collate for variable-length attention ----


def pack_collate(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A batch of packed rows as one flat sequence, for variable-length attention.

    Concatenates the rows into ``input_ids``, ``position_ids``, ``labels`` and
    ``segment_ids`` of shape ``[1, B * seq_len]``, and builds ``cu_seqlens`` (int32, the
    cumulative lengths of the segments, starting at 0; each row's padding is a segment of its
    own, so the last entry is ``B * seq_len``) and ``max_seqlen`` (an int), the arguments of
    flash-attention's varlen kernels. No attention crosses a document boundary or a row.

    Args:
        rows: the rows of ``Stream.pack`` (dicts of 1-D arrays or tensors of one length).

    Returns:
        The flat batch (torch tensors) with ``cu_seqlens`` and ``max_seqlen``.

    Raises:
        ValueError: no rows, a row without the fields ``Stream.pack`` makes, or rows of
            different lengths.
    """
    if not rows:
        raise ValueError("pack_collate needs at least one row")
    fields = ("input_ids", "position_ids", "labels", "segment_ids")
    out: dict[str, Any] = {}
    for f in fields:
        try:
            cols = [torch.as_tensor(r[f]) for r in rows]
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"pack_collate: each row must hold {list(fields)} (the rows of Stream.pack), "
                f"a row lacks {f!r}"
            ) from e
        if len({c.shape for c in cols}) != 1 or cols[0].ndim != 1:
            raise ValueError(
                f"pack_collate: rows must be 1-D and of one length, got {f!r} of shapes "
                f"{sorted({tuple(c.shape) for c in cols})}"
            )
        out[f] = torch.cat(cols).unsqueeze(0)
    seg = out["segment_ids"][0]
    n = seg.numel()
    seq_len = n // len(rows)
    # A segment starts where the segment id changes, and at every row's start (two rows'
    # segments can share an id, padding too).
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = seg[1:] != seg[:-1]
    starts[::seq_len] = True
    bounds = torch.cat([starts.nonzero().flatten(), torch.tensor([n])]).to(torch.int32)
    out["cu_seqlens"] = bounds
    out["max_seqlen"] = int((bounds[1:] - bounds[:-1]).max())
    return out
