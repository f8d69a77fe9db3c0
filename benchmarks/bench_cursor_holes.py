"""The sample cursor with many holes: ``skip_samples`` on a state whose cut holds H holes and
A batches delivered ahead, and the cost per batch of the cut that results.

Honest states hold a few hundred holes at most (batches delivered ahead, bounded by the
in-flight window); this is the bound's neighbourhood (H = A = 8000, a 67 kB state), where
the cost was once quadratic. Run: ``python benchmarks/bench_cursor_holes.py [H]``.
"""

from __future__ import annotations

import sys
import time

from resumable_loader import DataLoader, skip_samples
from resumable_loader.state.cursor import Cut


def main() -> None:
    h = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    b = 4
    n = b * (4 * h + 10)
    loader = DataLoader(list(range(n)), batch_size=b)
    next(iter(loader))
    state = loader.state_dict()
    # H one-position holes (every other position from 2), then H batches ahead beyond them.
    state["sample_cut"] = {"start": 0, "holes": [[2 + 2 * i, 1] for i in range(h)]}
    state["consumed"] = 0
    first = (2 * h + 4) // b
    state["delivered_ahead"] = [first + 2 * i for i in range(h)]
    t = time.perf_counter()
    out = skip_samples(state, 1)
    took = time.perf_counter() - t
    holes = out["sample_cut"]["holes"]
    print(f"H = A = {h}: skip_samples {took:.3f} s ({len(holes)} holes after)")
    cut = Cut(out["sample_cut"]["start"], tuple((f, c) for f, c in holes))
    t = time.perf_counter()
    for k in range(1000):
        cut.positions(k * b, k * b + b)
    print(f"one batch's positions from that cut: {(time.perf_counter() - t) * 1e3:.1f} us")


if __name__ == "__main__":
    main()
