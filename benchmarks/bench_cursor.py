"""The sample cursor: skip_samples() and a resume with another batch size, at 10^7 samples.

Both are arithmetic on the state (a cursor and the holes left by batches delivered ahead), so
their cost must not grow with the position. Measured for a sequential and a shuffled epoch of
10^7 samples (a ``Mixture`` of two sources under ``shuffle=False`` for the first), half of it
consumed, against the same resume with the batch size unchanged:

* ``skip_samples(state, 10^6)`` on a plain state and on one with 64 batches delivered ahead;
* ``load_state_dict(state)`` with batch size 96 for a state saved with 64, and the time from
  there to the first batch (``next(iter(loader))``), beside the same with 64. The shuffled
  epoch's first batch includes drawing its permutation of 10^7 (torch's ``randperm``), which
  every resume of a shuffled epoch pays, re-cut or not.
"""

from __future__ import annotations

import time
from typing import Any

from _common import base_parser, emit_summary, env_line, median, parse, print_table

from resumable_loader import DataLoader, Mixture, skip_samples

N = 10**7


class _Index:
    """Item i is i (zero cost: the figures are the loader's own)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _dataset(kind: str) -> Any:
    if kind == "mixture":
        return Mixture({"a": _Index(N // 2), "b": _Index(N - N // 2)}, {"a": 3, "b": 1})
    return _Index(N)


def _state(kind: str, consumed_batches: int) -> dict[str, Any]:
    """A state half-way through the epoch, taken without reading half an epoch: the position
    is set as the loader writes it (the loader's own state_dict() shape)."""
    loader = DataLoader(_dataset(kind), batch_size=64, shuffle=kind == "shuffled")
    next(iter(loader))
    state = loader.state_dict()
    state["consumed"] = consumed_batches
    return state


def _time(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], start_method=False)
    p.add_argument("--reps", type=int, default=20)
    args = parse(p)
    reps = 3 if args.quick else args.reps
    print("command: python benchmarks/bench_cursor.py" + (" --quick" if args.quick else ""))
    print(env_line())
    half = N // 2 // 64
    rows = []
    summary: dict[str, Any] = {}
    for kind in ("mixture", "shuffled"):
        state = _state(kind, half)
        ahead = dict(state, delivered_ahead=list(range(half + 1, half + 129, 2)))
        skip_us = _time(lambda s=state: skip_samples(s, 10**6), reps * 10) * 1e6
        skip_ahead_us = _time(lambda s=ahead: skip_samples(s, 10**6), reps * 10) * 1e6
        figures = {"skip_us": skip_us, "skip_with_64_holes_us": skip_ahead_us}
        for batch in (64, 96):
            loader = DataLoader(_dataset(kind), batch_size=batch, shuffle=kind == "shuffled")
            load = _time(lambda ld=loader, s=state: ld.load_state_dict(s), reps)
            loader.load_state_dict(state)
            t0 = time.perf_counter()
            first = next(iter(loader))
            first_s = time.perf_counter() - t0
            assert len(first) == batch
            figures[f"load_b{batch}_ms"] = load * 1e3
            figures[f"first_batch_b{batch}_ms"] = first_s * 1e3
        summary[kind] = figures
        rows.append(
            [
                kind,
                skip_us,
                skip_ahead_us,
                figures["load_b64_ms"],
                figures["load_b96_ms"],
                figures["first_batch_b64_ms"],
                figures["first_batch_b96_ms"],
            ]
        )
    print()
    print(f"epoch of {N} samples, {half * 64} consumed in batches of 64 (median of the reps)")
    print_table(
        [
            "epoch",
            "skip_samples us",
            "skip, 64 holes us",
            "load b=64 ms",
            "load b=96 ms",
            "1st batch b=64 ms",
            "1st batch b=96 ms",
        ],
        rows,
    )
    emit_summary("cursor", summary)


if __name__ == "__main__":
    main()
