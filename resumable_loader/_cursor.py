"""The sample cursor: where an epoch stands in samples, whatever batch size cut it.

An epoch of a built-in sampler is an order of ``n`` positions (``range(n)`` or a seeded
permutation, see ``_sampling``). Cut into batches of ``b`` from position 0, "``k`` batches
consumed" means "positions ``[0, k*b)`` consumed". That is the common case, and the state
keeps it so (``consumed`` counts batches). Another batch size at a resume, or a skip, moves the
cut: the rest of the epoch is then

    the positions ``[start, n)``, minus ``holes`` (``[(first, count), ...]``)

cut into batches of the loader's batch size from ``start``. ``holes`` are positions already
delivered ahead of the consumed prefix (``in_order=False``): they must not come again. A
``Cut`` is batch-size free: it names positions, so any batch size continues from it, and a
cut of a cut (a second resume with a third batch size) is again a cut.

Everything here is arithmetic on ``start`` and the holes -- O(number of holes) per batch,
never O(n) -- so a resume or a skip at sample 10^9 costs what one at sample 10 costs.
"""

from __future__ import annotations

import bisect
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
        return max(0, n - self.start - sum(c for _, c in self.holes))

    def tasks(self, n: int, per_task: int, drop_last: bool) -> int:
        """How many batches of ``per_task`` the rest makes (a partial last one unless
        ``drop_last``)."""
        m = self.left(n)
        return m // per_task if drop_last else -(-m // per_task)

    def positions(self, a: int, b: int) -> np.ndarray:
        """The epoch positions of the rest's items ``[a, b)`` (in order), as int64."""
        j = np.arange(a, b, dtype=np.int64)
        if not self.holes:
            return j + self.start
        # Before hole i, kept item number k sits at position start + k + (holes before i).
        kept_at, skipped = self._index()
        i = np.searchsorted(np.asarray(kept_at, dtype=np.int64), j, side="right")
        return j + self.start + np.asarray(skipped, dtype=np.int64)[i]

    def position(self, k: int) -> int:
        """The epoch position of the rest's item ``k`` (``n``-free: past the last hole the
        positions simply run on)."""
        kept_at, skipped = self._index()
        return self.start + k + skipped[bisect.bisect_right(kept_at, k)]

    def _index(self) -> tuple[list[int], list[int]]:
        # kept_at[i]: the item number at which hole i begins; skipped[i]: the positions in holes
        # before item numbers >= kept_at[i - 1] (skipped[0] = 0).
        kept_at, skipped, total = [], [0], 0
        for first, count in self.holes:
            kept_at.append(first - self.start - total)
            total += count
            skipped.append(total)
        return kept_at, skipped

    def advance(
        self, n: int, per_task: int, consumed: int, ahead: frozenset[int] | set[int] = frozenset()
    ) -> Cut:
        """The rest after ``consumed`` batches of ``per_task`` items of this rest, and the
        batches ``ahead`` (their ids), were delivered.

        Raises:
            ValueError: a batch beyond the rest of the epoch.
        """
        m = self.left(n)
        # The last batch may be partial: consumed, it takes what was left.
        done = min(consumed * per_task, m)
        if consumed > -(-m // per_task) or any(t * per_task >= m for t in ahead):
            raise ValueError(
                f"{consumed} batches consumed and batches {sorted(ahead)[:5]} delivered ahead "
                f"do not fit in the {m} samples left of the epoch"
            )
        holes = list(self.holes)
        for t in ahead:
            holes.extend(_runs(self.positions(t * per_task, min(m, (t + 1) * per_task))))
        start = self.position(done) if done < m else n
        return _normal(start, holes, n)

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


def _runs(pos: np.ndarray) -> list[tuple[int, int]]:
    """Increasing positions as (first, count) runs of consecutive ones."""
    if not len(pos):
        return []
    breaks = np.flatnonzero(np.diff(pos) != 1) + 1
    firsts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(pos)]))
    return [(int(pos[a]), int(e - a)) for a, e in zip(firsts, ends)]


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
    while merged and merged[0][0] <= start:
        start = max(start, merged.pop(0)[1])
    start = min(start, n)
    return Cut(start, tuple((f, e - f) for f, e in merged if f < n))


def check_cut(raw: object, n: int | None) -> tuple[Cut | None, str | None]:
    """A state's ``sample_cut`` entry read back: (the cut, None), or (None, the problem).

    ``n`` (the epoch's positions, when known) bounds the start and the holes.
    """
    if raw is None:
        return None, None
    if not isinstance(raw, dict) or set(raw) != {"start", "holes"}:
        return None, "expected {start: int, holes: [[first, count], ...]}"
    start, holes = raw["start"], raw["holes"]
    if type(start) is not int or start < 0 or (n is not None and start > n):
        return None, f"start must be an int in [0, {n if n is not None else 'n'}]"
    if not isinstance(holes, list):
        return None, "holes must be a list of [first, count]"
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
        out.append((h[0], h[1]))
    if n is not None and prev > n:
        return None, f"a hole ends at {prev}, past the epoch's {n} positions"
    return Cut(start, tuple(out)), None
