"""Stream.shuffle(B): what a resume re-reads, what the shuffle costs, and a reservoir's re-read.

Three measurements, CPU only (items are ints read at no cost, so every figure is the Stream's
and the loader's own overhead):

* **Resume** (``resume`` rows): a Stream of ``2 P`` shards of ``4 B`` samples in ``P``
  partitions, ``shuffle(B)``, run under our DataLoader (``num_workers=0``, batch 64) until every
  partition is half-way through its second window; then a new loader and
  ``load_state_dict(state)``: the samples read and the wall time (median of ``--reps``) to the
  first batch, and to the point where every partition delivered again (``P`` rows: the whole
  resume cost), for a reader that seeks (``read(shard, start)``) and one that cannot
  (``read(shard)``: it reads and discards the window's offset in its shard). Beside it the
  bound ``P x B`` and the same resume without a shuffle.
* **Throughput** (``throughput`` rows): items/s of one pass (wall), and CPU microseconds per
  item (this process and the loader's workers: other load barely moves it), unshuffled vs
  ``shuffle(256)`` vs ``shuffle(4096)``, the Stream alone in this process and under our
  DataLoader (2 workers, batch 64), alternated round by round.
* **Reservoir** (``reservoir`` rows): a classic shuffle buffer (``buf[j] = new; yield old``)
  whose state holds positions only must re-read back to its oldest buffered item at a
  resume. Simulated over ``60 B`` steps, checkpoints every 997 steps after ``20 B``: the mean
  and largest span, against the windowed shuffle's at most ``B``.

Run: python3 benchmarks/bench_stream_shuffle.py [--quick] [--rounds N]
Exits non-zero only if a resumed stream differs from the uninterrupted one.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import _common as C

from resumable_loader import DataLoader, Stream

BATCH = 64


class Seekable:
    """``read(shard, start)`` over shards of ``length`` ints, counting the samples read."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.reads = 0

    def __call__(self, shard: int, start: int) -> Iterator[int]:
        base = shard * self.length
        for i in range(start, self.length):
            self.reads += 1
            yield base + i


class FromZero(Seekable):
    """``read(shard)``: the same shards, from sample 0 only (a resume reads its way in)."""

    def __call__(self, shard: int) -> Iterator[int]:  # type: ignore[override]
        return super().__call__(shard, 0)


def _stream(read: Any, p: int, b: int | None) -> Stream:
    s = Stream.from_shards(list(range(2 * p)), read, partitions=p)
    return s if b is None else s.shuffle(b)


def _first(it: Any) -> list[int]:
    return list(next(it).tolist())


def resume_rows(p: int, b: int, length: int, reps: int) -> list[dict[str, Any]]:
    """One (P, B) cell: the state, then a resume with each reader kind (and without shuffle);
    times are the median of ``reps`` resumes, each on a fresh loader (the reads are the same
    every time)."""
    out = []
    for shuffled in (True, False):
        bb = b if shuffled else None
        # Every partition half-way through its second window: P * 1.5 B rows in canonical order.
        k = p * (3 * b // 2) // BATCH
        loader = DataLoader(_stream(Seekable(length), p, bb), batch_size=BATCH)
        it = iter(loader)
        for _ in range(k):
            next(it)
        state = loader.state_dict()
        ref = [x for _ in range(-(-p // BATCH)) for x in next(it).tolist()]
        del it, loader
        for kind in ("seek", "from0") if shuffled else ("seek",):
            runs = []
            for _ in range(reps + 1):  # the first is a warm-up, dropped
                read = Seekable(length) if kind == "seek" else FromZero(length)
                again = DataLoader(_stream(read, p, bb), batch_size=BATCH)
                t0 = time.perf_counter()
                again.load_state_dict(state)
                it2 = iter(again)
                got = _first(it2)
                t1 = time.perf_counter()
                first_reads = read.reads
                while len(got) < p:  # every partition delivered once more
                    got += _first(it2)
                t2 = time.perf_counter()
                if got != ref:
                    print(f"WRONG STREAM after the resume: P={p} B={bb} reader={kind}")
                    sys.exit(1)
                runs.append((t1 - t0, t2 - t0, first_reads, read.reads, len(got)))
                del it2, again
            runs = runs[1:]
            out.append(
                {
                    "P": p,
                    "B": bb if bb else "none",
                    "reader": kind,
                    "first_batch_reads": runs[0][2],
                    "first_batch_ms": C.median([r[0] for r in runs]) * 1e3,
                    "all_partitions_reads": runs[0][3],
                    "all_partitions_rows": runs[0][4],
                    "all_partitions_ms": C.median([r[1] for r in runs]) * 1e3,
                    "bound_P_x_B": p * b if shuffled else 0,
                }
            )
    return out


def _cpu_s() -> float:
    """CPU seconds of this process and of its reaped children (the loader's workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _one_pass(make: Any, workers: int | None) -> dict[str, float]:
    """One pass: items per wall second, and CPU microseconds per item (this process plus the
    workers, which the loader has reaped once the pass ended; other load on the machine
    barely moves it, unlike the wall time)."""
    s = make()
    t0, c0 = time.perf_counter(), _cpu_s()
    if workers is None:
        n = sum(1 for _ in s)
    else:
        loader = DataLoader(s, batch_size=BATCH, num_workers=workers)
        n = sum(len(b) for b in loader)
        del loader
        gc.collect()
    return {
        "items_s": n / (time.perf_counter() - t0),
        "cpu_us_per_item": (_cpu_s() - c0) / n * 1e6,
    }


def throughput(rounds: int, shards: int, length: int, budget_s: float) -> dict[str, Any]:
    def measure(b: int | None, workers: int | None) -> Any:
        return lambda: _one_pass(lambda: _stream(Seekable(length), shards // 2, b), workers)

    out: dict[str, Any] = {}
    for where, workers in (("stream alone", None), ("loader, 2 workers", 2)):
        fns = {
            name: measure(b, workers)
            for name, b in (("unshuffled", None), ("shuffle(256)", 256), ("shuffle(4096)", 4096))
        }
        runs = C.alternate(fns, rounds, budget_s=budget_s)
        out[where] = {
            name: {
                "items_s": C.median([r["items_s"] for r in rs]),
                "vs_unshuffled": C.median(C.per_round_ratio(runs, name, "unshuffled", "items_s")),
                "cpu_us_per_item": C.median([r["cpu_us_per_item"] for r in rs]),
                "rounds": len(rs),
            }
            for name, rs in runs.items()
        }
    return out


def reservoir(b: int, seed: int = 0) -> dict[str, float]:
    """A reservoir of ``b`` items: the span from its oldest buffered item to the read head at
    checkpoints (what a resume from positions alone must re-read)."""
    rng = random.Random(seed)
    born = list(range(b))  # the input position of each buffered item
    head = b
    spans = []
    for t in range(60 * b):
        born[rng.randrange(b)] = head  # the evicted item is emitted, the new one buffered
        head += 1
        if t > 20 * b and t % 997 == 0:
            spans.append(head - min(born))
    return {
        "B": b,
        "mean_span": sum(spans) / len(spans),
        "max_span": max(spans),
        "mean_over_B": sum(spans) / len(spans) / b,
        "max_over_B": max(spans) / b,
        "checkpoints": len(spans),
    }


def main() -> None:
    p = C.base_parser(__doc__.splitlines()[0], start_method=False)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=3, help="resumes timed per cell (median)")
    args = C.parse(p)
    # The reader without start warns once per Stream that a resume reads its way in: expected.
    warnings.filterwarnings("ignore", message="Stream: read\\(\\) takes no start sample")
    print("command: python benchmarks/bench_stream_shuffle.py" + (" --quick" if args.quick else ""))
    print(C.env_line())
    cells = [(16, 256)] if args.quick else [(16, 256), (16, 4096), (256, 256), (256, 4096)]
    rows = []
    for parts, b in cells:
        rows += resume_rows(parts, b, 4 * b, 1 if args.quick else args.reps)
    print()
    print(
        "resume: samples read and wall time from load_state_dict to the first batch (64 rows) "
        "and until every partition delivered again; num_workers=0"
    )
    keys = list(rows[0])
    C.print_table(keys, [[r[k] for k in keys] for r in rows], digits=1)

    rounds = 2 if args.quick else args.rounds
    tp = throughput(rounds, 32, 2000 if args.quick else 10_000, 40 if args.quick else 90)
    print()
    print(f"throughput: one pass of 16 partitions x {2000 if args.quick else 10_000} items x 2")
    tp_rows = [
        [where, name, f["items_s"], f["vs_unshuffled"], f["cpu_us_per_item"], f["rounds"]]
        for where, by in tp.items()
        for name, f in by.items()
    ]
    C.print_table(
        ["where", "stream", "items/s (wall)", "x unshuffled", "CPU us/item", "rounds"],
        tp_rows,
        digits=2,
    )

    res = [reservoir(b) for b in ((256,) if args.quick else (256, 4096))]
    print()
    print("reservoir re-read span (positions-only state) vs the windowed shuffle's <= B")
    keys = list(res[0])
    C.print_table(keys, [[r[k] for k in keys] for r in res], digits=1)
    C.emit_summary("stream_shuffle", {"resume": rows, "throughput": tp, "reservoir": res})


if __name__ == "__main__":
    main()
