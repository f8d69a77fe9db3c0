"""``Stream.shuffle(buffer_size)``: a seeded windowed shuffle per partition, resumed from positions.

Each partition's input is cut into windows of ``B = buffer_size`` consecutive items (the last
one of a pass may be shorter). Window ``w`` is read whole, then emitted in a keyed permutation
of its ``n <= B`` items: the ``o``-th item out is input item ``w * B + perm_w(o)``, where
``perm_w`` is ``interleave.permute`` (``interleave.permutation``: a whole window at once) under
keys drawn from (the Stream's seed, pass, partition, window). So the order is a pure function
of those numbers: no RNG state, no samples in the state, the same in every process and on every
layout.

The node's position is the input's position where the current window began, then
``(win, taken)``: the window's number in the pass and how many of its items were emitted. A
seek re-reads that window (at most ``B`` input items, plus those a filter before the shuffle
drops inside it) and emits from item ``taken`` of its permutation on. Once a window is used
up the position moves to the next window's start at once, so a state taken at a window's end
re-reads nothing.

Why windows and not a reservoir (``buffer[j] = new; yield old``): a reservoir's state without
samples must name where each buffered item was read, and a resume re-reads back to the oldest
one -- about ``B ln B`` items on average, with no bound (docs/streams.md, "Shuffle", measured
by benchmarks/bench_stream_shuffle.py). A window bounds it by ``B`` and keeps the state at two
ints. Within a window every item is equally likely at every place; across windows the reader's
interleave of partitions mixes further (the global stream's span is about ``P x B``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.errors import CheckpointError
from .interleave import pass_keys, permutation
from .stream_nodes import END, Context, Node, Stage

__all__ = ["SHUFFLE_FIELDS", "ShuffleStage", "check_buffer_size", "window_keys"]

# The shuffle's own position fields, after its input's: the window's number in the pass, and
# the items of it already emitted.
SHUFFLE_FIELDS: tuple[str, ...] = ("win", "taken")


def check_buffer_size(buffer_size: Any) -> int:
    """``buffer_size`` checked: an int >= 1 (1 keeps the input order).

    Raises:
        TypeError: not an int (a bool or float is refused: a window holds whole items).
        ValueError: below 1.
    """
    if type(buffer_size) is not int:
        raise TypeError(f"shuffle(buffer_size) needs an int, got {buffer_size!r}")
    if buffer_size < 1:
        raise ValueError(
            f"shuffle(buffer_size) must be >= 1 (the items per shuffled window), got {buffer_size}"
        )
    return buffer_size


def window_keys(ctx: Context, depth: int, win: int) -> tuple[int, ...]:
    """The permutation keys of window ``win`` of partition ``ctx.partition`` in pass
    ``ctx.epoch``, for the shuffle whose input has ``depth`` position fields (two shuffles in
    one chain get different orders). Fixed forever: they decide every shuffled order, so a
    change is a new state version."""
    return pass_keys(ctx.seed, f"stream-shuffle/{depth}/{ctx.partition}/{win}", ctx.epoch)


@dataclass(frozen=True)
class ShuffleStage(Stage):
    """``Stream.shuffle(buffer_size)``'s description (see the module docstring)."""

    buffer_size: int

    @property
    def name(self) -> str:  # type: ignore[override]
        # The buffer size is in the name: a state is refused by a Stream with another one
        # (its positions count windows of that size).
        return f"shuffle(B={self.buffer_size})"

    def fields(self, upstream: tuple[str, ...]) -> tuple[str, ...]:
        return (*upstream, *SHUFFLE_FIELDS)

    def build(self, upstream: Node, ctx: Context) -> Node:
        return _Shuffle(upstream, self.buffer_size, ctx)


class _Shuffle(Node):
    """One partition's windowed shuffle for one pass.

    Invariants between calls: ``restart`` is the input's position where window ``win`` began;
    ``window`` is None until the window is read (after a seek, or once a window is used up),
    else its items with the emitted ones set to None (so their memory goes with the caller);
    ``0 <= taken <= len(window)``; ``after`` is the input's position once the window was read,
    which is where window ``win + 1`` begins.
    """

    def __init__(self, up: Node, size: int, ctx: Context) -> None:
        self.up = up
        self.size = size
        self.ctx = ctx
        self.depth = len(up.fields)
        self.fields = (*up.fields, *SHUFFLE_FIELDS)
        self.restart = [0] * self.depth
        self.win = 0
        self.taken = 0
        self.window: list[Any] | None = None
        self.after: list[int] = self.restart
        self.order: list[int] = []  # the window's permutation: order[o] is emitted o-th
        self.ended = False  # the input returned END: no window after this one

    def _fill(self) -> list[Any]:
        # An input that raises here leaves this node half-filled; the reader throws it away
        # and rebuilds the chain at the last cursor (the window's start): nothing is lost.
        pull = self.up.pull
        window = []
        for _ in range(self.size):
            item = pull()
            if item is END:
                self.ended = True
                break
            window.append(item)
        if self.taken > len(window):
            raise CheckpointError(
                f"Stream state: partition {self.ctx.partition} field 'taken' is {self.taken}, "
                f"but window {self.win} of pass {self.ctx.epoch} holds {len(window)} items. "
                "The state is damaged, or was taken on other data."
            )
        self.after = self.up.position()
        self.order = permutation(len(window), window_keys(self.ctx, self.depth, self.win)).tolist()
        self.window = window
        return window

    def pull(self) -> Any:
        window = self.window
        if window is None:
            if self.ended:
                return END
            window = self._fill()
        n = len(window)
        if self.taken >= n:  # a state saved at a window's end by hand: nothing left in it
            if self.ended or n == 0:
                # The input's final position (a mix's "ran out" flags) goes in the cursor.
                self._next_window()
                return END
            self._next_window()
            return self.pull()
        i = self.order[self.taken]
        item = window[i]
        window[i] = None
        self.taken += 1
        if self.taken == n:
            self._next_window()
        return item

    def _next_window(self) -> None:
        # The next window begins where this one's read stopped: a state taken now re-reads
        # nothing of the used-up window.
        self.restart = self.after
        self.win += 1
        self.taken = 0
        self.window = None

    def position(self) -> list[int]:
        return [*self.restart, self.win, self.taken]

    def seek(self, pos: list[int]) -> None:
        *restart, win, taken = pos
        if taken > self.size:
            raise CheckpointError(
                f"Stream state: partition {self.ctx.partition} field 'taken' is {taken}, more "
                f"than the shuffle's buffer_size {self.size}. The state is damaged."
            )
        self.up.seek(restart)
        self.restart = list(restart)
        self.win = win
        self.taken = taken
        self.window = None
        self.ended = False

    def close(self) -> None:
        self.window = None
        self.up.close()
