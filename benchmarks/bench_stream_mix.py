"""How close a ``Stream.mix`` keeps each source to its weight: per partition, and globally.

    python benchmarks/bench_stream_mix.py [--quick] [--rows 200] [--seeds 3]

Inside each partition the mix is ``Mixture``'s stratified interleave, so over any window of
``n`` items a source's count is within ``ceil(log2 S)`` of ``n * share`` (``S`` sources with a
positive weight): that bound is guaranteed and checked here. The global stream (every
partition's rows in the canonical order, what one reader sees; ``P`` readers each see one
partition) interleaves ``P`` such sequences; their phases are spread over the partitions
(``plans/stream_mix._phases``) but its window deviation is not bounded by the same constant:
this script measures it.

Sources: ``S`` Streams with one shard per partition, each long enough that no source runs out
within the first ``--rows`` rows of any partition (so every window is under one set of weights).
The deviation of a sequence is the largest ``|count of a source in a window - n * share|``
over every window and every source: for one source the range of ``count(first k) - k *
share`` over the prefixes, exact with fractions, O(rows). Reported per (S, weights, P): the
per-partition maximum over all partitions and seeds, the global maximum and median over seeds,
and the bound. CPU only; seconds.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator
from fractions import Fraction

from _common import base_parser, emit_summary, env_line, parse, print_table

from resumable_loader import Stream

WEIGHT_SETS = [
    (3, 1),
    (1, 1),
    (6, 3, 1),
    (1, 1, 1),
    (4, 3, 2, 1),
    (5, 4, 3, 2, 1),
    (1, 1, 1, 1, 1),
]
SHARD = 10_000  # a sample is shard * SHARD + i; a source's shards are k * 1000 + partition


def read(shard: int, start: int) -> Iterator[int]:
    for i in range(start, SHARD):
        yield shard * SHARD + i


def deviation(seq: list[int], shares: list[Fraction]) -> Fraction:
    worst = Fraction(0)
    for k, share in enumerate(shares):
        c = 0
        lo = hi = Fraction(0)
        for n, s in enumerate(seq, 1):
            c += s == k
            d = c - n * share
            lo, hi = min(lo, d), max(hi, d)
        worst = max(worst, hi - lo)
    return worst


def run(weights: tuple[int, ...], partitions: int, rows: int, seed: int) -> tuple[float, float]:
    sources = {
        f"s{k}": Stream.from_shards(
            [k * 1000 + p for p in range(partitions)],
            read,
            shuffle_shards=False,
            partitions=partitions,
        )
        for k in range(len(weights))
    }
    mix = Stream.mix(sources, {f"s{k}": w for k, w in enumerate(weights)}, seed=seed)
    total = sum(weights)
    shares = [Fraction(w, total) for w in weights]
    it = iter(mix)
    glob = [next(it) for _ in range(rows * partitions)]
    source = [x // SHARD // 1000 for x in glob]
    per: dict[int, list[int]] = {}
    for x, s in zip(glob, source):
        per.setdefault(x // SHARD % 1000, []).append(s)
    assert all(len(v) == rows for v in per.values())
    return float(max(deviation(v, shares) for v in per.values())), float(deviation(source, shares))


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], start_method=False)
    p.add_argument("--rows", type=int, default=200, help="rows per partition")
    p.add_argument("--seeds", type=int, default=3)
    args = parse(p)
    rows, seeds, parts = (120, 2, (8,)) if args.quick else (args.rows, args.seeds, (8, 64))
    print(env_line())
    print(f"{rows} rows per partition, seeds 0..{seeds - 1}; deviation = max over windows")
    table, summary = [], []
    t0 = time.perf_counter()
    for weights in WEIGHT_SETS:
        bound = math.ceil(math.log2(len(weights)))
        for P in parts:
            per, glob = zip(*(run(weights, P, rows, s) for s in range(seeds)))
            ok = max(per) <= bound
            table.append(
                [
                    "/".join(map(str, weights)),
                    P,
                    bound,
                    max(per),
                    statistics.median(glob),
                    max(glob),
                    "yes" if ok else "NO",
                ]
            )
            summary.append(
                {
                    "weights": list(weights),
                    "P": P,
                    "bound": bound,
                    "per_partition_max": max(per),
                    "global_median": statistics.median(glob),
                    "global_max": max(glob),
                }
            )
            if not ok:
                raise SystemExit(f"per-partition bound broken for {weights}, P={P}")
    print_table(
        ["weights", "P", "bound", "per-part max", "global median", "global max", "within"],
        table,
        digits=2,
    )
    print(f"took {time.perf_counter() - t0:.1f} s")
    emit_summary("stream_mix", {"rows": rows, "seeds": seeds, "cases": summary})


if __name__ == "__main__":
    main()
