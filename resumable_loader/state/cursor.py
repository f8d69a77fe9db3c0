"""The sample cursor: where an epoch stands in samples, whatever batch size cut it.

An epoch of a built-in sampler is an order of ``n`` positions (``range(n)`` or a seeded
permutation, see ``plans.index_plan``). Cut into batches of ``b`` from position 0, "``k`` batches
consumed" means "positions ``[0, k*b)`` consumed". That is the common case, and the state
keeps it so (``consumed`` counts batches). Another batch size at a resume, or a skip, moves the
cut: the rest of the epoch is then

    the positions ``[start, n)``, minus ``holes`` (``[(first, count), ...]``)

cut into batches of the loader's batch size from ``start``. ``holes`` are positions already
delivered ahead of the consumed prefix (``in_order=False``): they must not come again. A
``Cut`` is batch-size free: it names positions, so any batch size continues from it, and a
cut of a cut (a second resume with a third batch size) is again a cut.

Everything here is arithmetic on ``start`` and the holes -- O(holes) once per cut, then
O(log holes) per item, never O(n) -- so a resume or a skip at sample 10^9 costs what one at
sample 10 costs.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Cut:
    """The rest of an epoch of ``n`` positions: ``[start, n)`` minus ``holes``.

    ``holes`` are sorted, disjoint ``(first, count)`` ranges, each inside ``(start, n)``: none
    begins at ``start`` (the start would be moved past it) and none is empty.
    """

    start: int = 0
    holes: tuple[tuple[int, int], ...] = ()

    @property
    def is_trivial(self) -> bool:
        """The whole epoch, cut from position 0: the same as no cut at all."""
        return self.start == 0 and not self.holes

    def left(self, n: int) -> int:
        """How many positions of an epoch of ``n`` are still to come."""
        return max(0, n - self.start - self._in_holes)

    def tasks(self, n: int, per_task: int, drop_last: bool) -> int:
        """How many batches of ``per_task`` the rest makes (a partial last one unless
        ``drop_last``)."""
        m = self.left(n)
        return m // per_task if drop_last else -(-m // per_task)

    def positions(self, a: int, b: int) -> np.ndarray:
        """The epoch positions of the rest's items ``[a, b)`` (in order), as int64."""
        return self._at(np.arange(a, b, dtype=np.int64))

    def position(self, k: int) -> int:
        """The epoch position of the rest's item ``k`` (``n``-free: past the last hole the
        positions simply run on)."""
        return int(self._at(np.array([k], dtype=np.int64))[0])

    def _at(self, j: np.ndarray) -> np.ndarray:
        """The epoch positions of the rest's items ``j`` (int64): O(len(j) log holes)."""
        if not self.holes:
            return j + self.start
        # Before hole i, kept item number k sits at position start + k + (holes before i).
        kept_at, skipped = self._index
        i = np.searchsorted(kept_at, j, side="right")
        return j + self.start + skipped[i]

    @functools.cached_property
    def _in_holes(self) -> int:
        return sum(c for _, c in self.holes)

    @functools.cached_property
    def _index(self) -> tuple[np.ndarray, np.ndarray]:
        # Built once per cut (a cut is immutable): every batch of an epoch reads it.
        # kept_at[i]: the item number at which hole i begins; skipped[i]: the positions in
        # holes before item numbers >= kept_at[i - 1] (skipped[0] = 0).
        firsts = np.array([f for f, _ in self.holes], dtype=np.int64)
        counts = np.array([c for _, c in self.holes], dtype=np.int64)
        skipped = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        return firsts - self.start - skipped[:-1], skipped

    def advance(
        self,
        n: int,
        per_task: int,
        consumed: int,
        ahead: frozenset[int] | set[int] = frozenset(),
        drop_last: bool = False,
    ) -> Cut:
        """The rest after ``consumed`` batches of ``per_task`` items of this rest, and the
        batches ``ahead`` (their ids), were delivered.

        Raises:
            ValueError: a batch beyond the rest of the epoch (with ``drop_last``, a partial
                last batch is no batch).
        """
        m = self.left(n)
        tasks = self.tasks(n, per_task, drop_last)
        if consumed > tasks or any(t >= tasks for t in ahead):
            raise ValueError(
                f"{consumed} batches consumed and batches {sorted(ahead)[:5]} delivered ahead "
                f"do not fit in the {m} samples left of the epoch"
            )
        # The last batch may be partial: consumed, it takes what was left.
        done = min(consumed * per_task, m)
        holes = list(self.holes)
        for t in ahead:
            holes += self._runs_of(t * per_task, min(m, (t + 1) * per_task))
        start = self.position(done) if done < m else n
        return _normal(start, holes, n)

    def _runs_of(self, a: int, b: int) -> list[tuple[int, int]]:
        """The epoch positions of the rest's items ``[a, b)`` as (first, count) runs, without
        listing the items: O(log holes + runs), whatever the batch size."""
        if not self.holes:
            return [(self.start + a, b - a)]
        kept_at, skipped = self._index
        # The positions run on by one from item to item, except where a hole begins: at the
        # kept_at inside (a, b).
        lo = int(np.searchsorted(kept_at, a, side="right"))
        hi = int(np.searchsorted(kept_at, b - 1, side="right"))
        edges = [a, *kept_at[lo:hi].tolist(), b]
        return [
            (self.start + e0 + int(skipped[lo + s]), e1 - e0)
            for s, (e0, e1) in enumerate(itertools.pairwise(edges))
        ]

    def skip(self, n: int, count: int) -> Cut:
        """The rest once its first ``count`` items are skipped.

        Raises:
            ValueError: ``count`` is more than what is left of the epoch.
        """
        m = self.left(n)
        if count > m:
            raise ValueError(f"only {m} samples are left of the epoch")
        start = self.position(count) if count < m else n
        return _normal(start, list(self.holes), n)

    def to_state(self) -> dict[str, object]:
        return {"start": self.start, "holes": [[f, c] for f, c in self.holes]}


def _normal(start: int, holes: list[tuple[int, int]], n: int) -> Cut:
    """Holes merged, those below ``start`` dropped, ``start`` moved past a hole it touches."""
    merged: list[list[int]] = []
    for first, count in sorted(holes):
        end = first + count
        if end <= start or count <= 0:
            continue
        first = max(first, start)
        if merged and first <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([first, end])
    # Merged holes are disjoint and not adjacent: only the first can touch the start.
    if merged and merged[0][0] <= start:
        start = merged.pop(0)[1]
    start = min(start, n)
    return Cut(start, tuple((f, e - f) for f, e in merged if f < n))


# The most holes a sample cut may hold. Holes are batches delivered ahead of the consumed
# prefix (in_order=False), at most the in-flight window (workers x prefetch_factor batches,
# each a run or a few) at each resume, and every hole the consumed prefix reaches is gone: an
# honest state holds a few hundred. The bound keeps a crafted one from costing O(holes) per
# batch of memory and time without limit; 65536 leaves two orders of magnitude of margin.
MAX_HOLES = 65536


def check_cut(raw: object, n: int | None) -> tuple[Cut | None, str | None]:
    """A state's ``sample_cut`` entry read back: (the cut, None), or (None, the problem).

    ``n`` (the epoch's positions, when known) bounds the start and the holes.
    """
    if raw is None:
        return None, None
    if not isinstance(raw, dict) or set(raw) != {"start", "holes"}:
        return None, "expected {start: int, holes: [[first, count], ...]}"
    start, holes = raw["start"], raw["holes"]
    if type(start) is not int or not 0 <= start < 2**63 or (n is not None and start > n):
        return None, f"start must be an int in [0, {n if n is not None else 'n'}]"
    if not isinstance(holes, list):
        return None, "holes must be a list of [first, count]"
    if len(holes) > MAX_HOLES:
        return None, (
            f"{len(holes)} holes, more than the {MAX_HOLES} a loader's state can hold (holes "
            "are batches delivered ahead, at most the in-flight window at each resume)"
        )
    prev = start
    out = []
    for h in holes:
        if not (
            isinstance(h, list)
            and len(h) == 2
            and type(h[0]) is int
            and type(h[1]) is int
            and h[0] > prev
            and h[1] > 0
        ):
            return None, "holes must be sorted, disjoint [first, count] ranges after start"
        prev = h[0] + h[1]
        if prev >= 2**63:
            return None, "holes must end below 2**63 (positions are int64)"
        out.append((h[0], h[1]))
    if n is not None and prev > n:
        return None, f"a hole ends at {prev}, past the epoch's {n} positions"
    return Cut(start, tuple(out)), None
