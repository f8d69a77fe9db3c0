"""Plans: the arithmetic of a weighted mixture -- global position -> (source, item).

Owns the pure part of ``Mixture`` (``plans/mixture.py``): functions of (seed, weights history,
global position) and nothing else. No datasets, no current epoch, no caches: the ``Mixture``
holds the plan built here and asks it where a position draws from. Three layers:

* **Weights** (``check_weights``). The weights are exact integers (a float weight is read as
  the decimal it prints as: 0.7 is 7/10); only their ratios matter.
* **Interleave** (which source: ``Segment``). The sources with a positive weight are the leaves
  of a balanced binary tree; each inner node splits its positions between its two halves like a
  Bresenham line: of the first ``m`` positions that reach a node whose left half weighs ``a``
  of ``t``, ``(m * a + phase) // t`` go left. So the count of a source among the first ``m``
  positions is a closed form (O(depth) to compute), position ``m`` is located in O(depth), and
  over any window of ``n`` positions a source's count is within ``depth`` (= ceil(log2 of the
  number of sources)) of ``n * weight``. The phases are drawn from the seed.
* **Passes** (which index: ``pass_keys``, ``permute``). The ``c``-th sample drawn from a source
  of length ``L`` is item ``perm(c mod L)`` of pass ``c // L``, where ``perm`` is a seeded
  bijection of ``range(L)`` keyed by (seed, source name, pass): a 4-round Feistel network on
  the two digits of ``c mod L`` in base ceil(sqrt(L)), cycle-walked back into range. O(1)
  memory, so a source of 10^9 items costs nothing to start, and no item of a source repeats
  before the whole source was seen.

Weights may change: the plan is a list of segments, each (first global position, weights).
A source's count at the start of a segment is carried over from the segments before it
(``segment_after``), so its passes continue across a change: what was drawn stays drawn,
nothing of the current pass repeats. A change at a resume inside a shuffled epoch is a *rest*
(``Rest``): keyed by the place in the epoch's sampler order, not by position, since the
consumed positions are scattered but the consumed places are a prefix (``build_plan``,
``places_in_order``, ``rest_draw``).
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

import numpy as np

from ..core.errors import CheckpointError
from .samplers import order_of

__all__ = [
    "Rest",
    "Segment",
    "build_plan",
    "check_weights",
    "pass_keys",
    "permutation",
    "permute",
    "places_in_order",
    "rest_draw",
    "segment_after",
]

_M30 = (1 << 30) - 1
# Odd 30-bit multipliers for the round hash (any odd constants with mixed bits would do; these
# are fixed forever: they decide every pass's order, so changing them is a new state version).
_C1 = 0x2C1B3C6D
_C2 = 0x297A2D39
# Luby-Rackoff: four rounds of a Feistel network with a pseudorandom round function make a
# pseudorandom permutation; fewer leave visible structure in small domains.
_ROUNDS = 4


# ---- passes: which item of a source --------------------------------------------------------
def _derive(*parts: object) -> bytes:
    """32 bytes determined by ``parts`` alone (never by the process's RNGs or hash seed)."""
    text = json.dumps(parts, separators=(",", ":"), ensure_ascii=True)
    return hashlib.blake2b(text.encode(), digest_size=32, person=b"rl.mixture").digest()


def pass_keys(seed: int, name: str, npass: int) -> tuple[int, ...]:
    """The four 30-bit round keys of pass ``npass`` over source ``name``: they choose the
    permutation (``permute``) that pass draws its items in."""
    raw = _derive(seed, "pass", name, npass)
    return tuple(int.from_bytes(raw[4 * r : 4 * r + 4], "little") & _M30 for r in range(_ROUNDS))


def permute(x: int, n: int, keys: tuple[int, ...]) -> int:
    """Item ``x`` of a bijection of ``range(n)`` chosen by four 30-bit ``keys`` (``0 <= x < n``).

    A Feistel network over the two digits (hi, lo) of ``x`` in base ``a = ceil(sqrt(n))``:
    each round adds a keyed hash of one digit to the other, mod ``a`` (undone by subtracting),
    so it permutes ``range(a * a)``. Walking along the cycle of ``x`` until the value falls
    back below ``n`` restricts it to ``range(n)``; as ``a * a < n + 2 * sqrt(n) + 1``, the walk
    almost always takes one step (a power-of-two domain would take up to four). The hash is
    a 30-bit multiply-xorshift, unrolled: CPython's arithmetic on ints below 2**30 is its
    fast path, and this function is most of a sample's cost.
    """
    if n <= 1:
        return 0
    a = math.isqrt(n - 1) + 1
    k0, k1, k2, k3 = keys
    while True:
        hi, lo = divmod(x, a)
        z = lo ^ k0
        z = ((z ^ (z >> 15)) * _C1) & _M30
        z = ((z ^ (z >> 12)) * _C2) & _M30
        hi = (hi + (z ^ (z >> 15))) % a
        z = hi ^ k1
        z = ((z ^ (z >> 15)) * _C1) & _M30
        z = ((z ^ (z >> 12)) * _C2) & _M30
        lo = (lo + (z ^ (z >> 15))) % a
        z = lo ^ k2
        z = ((z ^ (z >> 15)) * _C1) & _M30
        z = ((z ^ (z >> 12)) * _C2) & _M30
        hi = (hi + (z ^ (z >> 15))) % a
        z = hi ^ k3
        z = ((z ^ (z >> 15)) * _C1) & _M30
        z = ((z ^ (z >> 12)) * _C2) & _M30
        lo = (lo + (z ^ (z >> 15))) % a
        x = hi * a + lo
        if x < n:
            return x


def _rounds(x: np.ndarray, a: int, keys: tuple[int, ...]) -> np.ndarray:
    """``permute``'s four rounds on an int64 array of values below ``a * a`` (every product
    stays below 2**60, so int64 holds the same numbers as CPython's ints)."""
    hi, lo = np.divmod(x, a)
    for r, key in enumerate(keys):
        z = (lo if r % 2 == 0 else hi) ^ key
        z = ((z ^ (z >> 15)) * _C1) & _M30
        z = ((z ^ (z >> 12)) * _C2) & _M30
        if r % 2 == 0:
            hi = (hi + (z ^ (z >> 15))) % a
        else:
            lo = (lo + (z ^ (z >> 15))) % a
    return hi * a + lo


def permutation(n: int, keys: tuple[int, ...]) -> np.ndarray:
    """``[permute(x, n, keys) for x in range(n)]`` as an int64 array, computed in numpy: the
    same numbers, in O(n) vectorised work instead of n calls (a shuffle window's whole order
    at once)."""
    if n <= 1:
        return np.zeros(n, dtype=np.int64)
    a = math.isqrt(n - 1) + 1
    out = _rounds(np.arange(n, dtype=np.int64), a, keys)
    walk = np.flatnonzero(out >= n)
    while walk.size:  # cycle-walk the few values that land in [n, a * a), as permute does
        out[walk] = _rounds(out[walk], a, keys)
        walk = walk[out[walk] >= n]
    return out


# ---- weights: exact ratios -----------------------------------------------------------------
def _exact(weight: object, name: str) -> tuple[int | float, Fraction]:
    """A weight as plain data (int or float) and as the exact fraction it stands for.

    Raises:
        TypeError: not a real number (a bool is not a weight either).
        ValueError: negative, NaN or infinite.
    """
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise TypeError(f"the weight of source {name!r} must be a number, not {weight!r}")
    if isinstance(weight, numbers.Integral):
        plain: int | float = int(weight)
        frac = Fraction(plain)
    else:
        plain = float(weight)
        if not math.isfinite(plain):
            raise ValueError(f"the weight of source {name!r} must be finite, not {plain!r}")
        # The decimal the float prints as (repr is the shortest round-trip form, the same on
        # every platform): 0.7 means 7/10, so 0.7/0.3 interleaves exactly 7 to 3.
        frac = Fraction(repr(plain))
    if frac < 0:
        raise ValueError(f"the weight of source {name!r} must be >= 0, not {plain!r}")
    return plain, frac


def check_weights(
    weights: object, names: tuple[str, ...]
) -> tuple[dict[str, int | float], tuple[Fraction, ...]]:
    """Validate a weights mapping against the source names (sorted).

    Returns:
        the weights as plain data (name -> int or float), and as exact fractions in the
        order of ``names``.

    Raises:
        TypeError: not a mapping, or a weight that is not a number.
        ValueError: weights that do not name exactly ``names``, a negative, infinite or NaN
            weight, or all weights 0.
    """
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"weights must be a mapping from source name to weight, not {type(weights).__name__}"
        )
    missing = [n for n in names if n not in weights]
    unknown = sorted(repr(k) for k in weights if k not in names)
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"no weight for {missing}")
        if unknown:
            parts.append(f"weights for unknown sources [{', '.join(unknown)}]")
        raise ValueError(
            f"{' and '.join(parts)}: give one weight per source, for exactly {list(names)}"
        )
    plain: dict[str, int | float] = {}
    fracs = []
    for n in names:
        plain[n], frac = _exact(weights[n], n)
        fracs.append(frac)
    if not any(fracs):
        raise ValueError("at least one source must have a positive weight; all are 0")
    return plain, tuple(fracs)


# ---- the interleave: which source ----------------------------------------------------------
class Segment:
    """The interleave from global position ``start`` on, under one set of weights.

    ``base[k]``: how many samples of source ``k`` the segments before this one drew.
    ``phase(node, depth, total)``, if given, chooses each node's phase in ``range(total)``
    instead of the seed (``Stream.mix`` spreads them over its partitions); the window bound
    holds for any phases.
    """

    __slots__ = ("base", "nodes", "paths", "phase", "root", "start", "weights")

    def __init__(
        self,
        start: int,
        weights: dict[str, int | float],
        fracs: tuple[Fraction, ...],
        base: tuple[int, ...],
        seed: int,
        phase: Callable[[int, int, int], int] | None = None,
    ) -> None:
        self.start = start
        self.weights = weights
        self.base = base
        self.phase = phase
        denominator = math.lcm(*(f.denominator for f in fracs))
        ints = [int(f * denominator) for f in fracs]
        common = math.gcd(*ints)
        ints = [w // common for w in ints]
        # nodes[i] = (left weight, total weight, phase, left child, right child); a child >= 0
        # is a node, a child < 0 is the leaf (source) -child - 1.
        self.nodes: list[tuple[int, int, int, int, int]] = []
        self.paths: list[list[tuple[int, bool]]] = [[] for _ in ints]
        leaves = [k for k, w in enumerate(ints) if w > 0]
        self.root = self._build(leaves, ints, seed, [])

    def _build(self, leaves: list[int], ints: list[int], seed: int, path: list[Any]) -> int:
        if len(leaves) == 1:
            self.paths[leaves[0]] = list(path)
            return -leaves[0] - 1
        i = len(self.nodes)
        self.nodes.append((0, 0, 0, 0, 0))  # placeholder: the children get later numbers
        mid = len(leaves) // 2
        a = sum(ints[k] for k in leaves[:mid])
        t = a + sum(ints[k] for k in leaves[mid:])
        if self.phase is None:
            phase = int.from_bytes(_derive(seed, "phase", self.start, i)[:16], "little") % t
        else:
            phase = self.phase(i, len(path), t)
        lo = self._build(leaves[:mid], ints, seed, [*path, (i, True)])
        hi = self._build(leaves[mid:], ints, seed, [*path, (i, False)])
        self.nodes[i] = (a, t, phase, lo, hi)
        return i

    def locate(self, m: int) -> tuple[int, int]:
        """The source of position ``start + m``, and how many of its samples this segment drew
        before it."""
        node = self.root
        nodes = self.nodes
        while node >= 0:
            a, t, phase, lo, hi = nodes[node]
            v = m * a + phase
            before = v // t
            # Position m goes left iff the left half's count steps between m and m + 1.
            if (v + a) // t > before:
                m, node = before, lo
            else:
                m, node = m - before, hi
        return -node - 1, m

    def count(self, k: int, m: int) -> int:
        """How many of the first ``m`` positions of this segment source ``k`` draws."""
        path = self.paths[k]
        if not path and self.root != -k - 1:
            return 0  # weight 0 here
        for node, left in path:
            a, t, phase, _, _ = self.nodes[node]
            before = (m * a + phase) // t
            m = before if left else m - before
        return m

    def totals(self, m: int) -> tuple[int, ...]:
        """Each source's count of samples drawn before position ``start + m``, this segment's
        and the earlier ones'."""
        return tuple(b + self.count(k, m) for k, b in enumerate(self.base))


class Rest:
    """The rest of one epoch after a weights change at a resume under a shuffling sampler.

    The sampler visits the epoch's positions in an order (``order``: its plain-data name, see
    ``samplers.order_of``); the samples at places ``start``, ``start + 1``, ... of that order
    are drawn under ``seg`` (new weights), the ``m``-th of them at the segment's position
    ``m``. Which positions were consumed before the change is thereby the order's prefix,
    whatever positions it holds: the k-th sample delivered after the resume is the k-th of
    the segment.
    """

    __slots__ = ("epoch", "order", "seg", "start")

    def __init__(self, epoch: int, order: dict[str, Any], start: int, seg: Segment) -> None:
        self.epoch = epoch
        self.order = order
        self.start = start
        self.seg = seg

    def to_state(self, n: int) -> dict[str, Any]:
        """The rest as plain data (an entry of a ``Mixture`` state's ``rests``), in an epoch
        of ``n`` positions."""
        return {
            "epoch": self.epoch,
            "length": n,
            "order": dict(self.order),
            "from": self.start,
            "weights": dict(self.seg.weights),
        }


def places_in_order(order: dict[str, Any], n: int) -> np.ndarray:
    """``places[p]``: the place of position ``p`` in the epoch order ``order`` of ``n``
    positions (the inverse of ``samplers.order_of``). O(n) memory, once per epoch."""
    places = np.empty(n, dtype=np.int64)
    places[order_of(order, n)] = np.arange(n, dtype=np.int64)
    return places


def rest_draw(group: list[Rest], place: int) -> tuple[int, int] | None:
    """(source, its sample count) of place ``place`` in an epoch whose rests are ``group`` (in
    order), or None before the first rest."""
    rest = None
    for r in group:  # one per weights change in the epoch: a short list
        if r.start > place:
            break
        rest = r
    if rest is None:
        return None
    k, m = rest.seg.locate(place - rest.start)
    return k, rest.seg.base[k] + m


# ---- the weights history -------------------------------------------------------------------
def segment_after(
    earlier: list[Segment],
    start: int,
    plain: dict[str, int | float],
    fracs: tuple[Fraction, ...],
    seed: int,
) -> Segment:
    """A segment from ``start`` on, its counts carried over from ``earlier`` (O(#segments)
    work, once per change)."""
    if earlier:
        prev = earlier[-1]
        base = prev.totals(start - prev.start)
    else:
        base = (0,) * len(fracs)
    return Segment(start, plain, fracs, base, seed)


def build_plan(
    specs: list[Any], rest_specs: list[Any], seed: int, num_samples: int
) -> tuple[list[Segment], dict[int, list[Rest]]]:
    """The segments of ``specs`` (``(start, weights, fractions)``) and the rests of
    ``rest_specs`` (``(epoch, order, start, weights, fractions)``, in order), each with the
    counts carried over from what comes before it, in epochs of ``num_samples`` positions.
    An epoch's rests draw after the whole epoch's draws under the segments (``Rest``), and the
    next epoch's segment after them.

    Raises:
        CheckpointError: an epoch's rests without a segment that starts the next epoch.
    """
    n = num_samples
    groups: dict[int, list[Any]] = {}
    for r in rest_specs:
        groups.setdefault(r[0], []).append(r)
    anchors = {(e + 1) * n: e for e in groups}
    built: list[Segment] = []
    rests: dict[int, list[Rest]] = {}
    for start, plain, fracs in specs:
        e = anchors.pop(start, None)
        if e is None or not built:
            built.append(segment_after(built, start, plain, fracs, seed))
            continue
        prev = built[-1]
        base = prev.totals(start - prev.start)
        made = []
        group = groups[e]
        for i, (_, order, at, rplain, rfracs) in enumerate(group):
            seg = Segment(e * n + at, rplain, rfracs, base, seed)
            stop = group[i + 1][2] if i + 1 < len(group) else n
            base = seg.totals(stop - at)
            made.append(Rest(e, order, at, seg))
        rests[e] = made
        built.append(Segment(start, plain, fracs, base, seed))
    if anchors:
        raise CheckpointError(
            "bad Mixture state: the weights changed inside epoch(s) "
            f"{sorted(anchors.values())} but no weights segment starts the epoch after"
        )
    return built, rests
