"""What a ``Stream``'s position costs with many partitions: the state, and the per-batch delta.

A ``Stream`` keeps one cursor of a few ints per partition. Measured for P = 64, 256 and 1,024
partitions in one reader (a worker that owns all of them, the worst case):

* ``Stream.state_dict()``: time, and its size as json and through our checkpoint encoding
  (``dump_state``), and ``Stream.load_state_dict`` of it;
* the per-batch cost in a worker: draw a batch of 8 rows and take the state delta the worker
  sends with it (``StreamFetcher.state_delta``), with the partitions the batch moved only
  (``Stream.state_dict_changes``) against every cursor pickled and compared (the generic path,
  forced by hiding that method).

Run: python benchmarks/bench_stream_partitions.py [--quick]
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from _common import base_parser, emit_summary, env_line, median, parse, print_table

from resumable_loader import Stream, dump_state
from resumable_loader.pipeline.fetch import StreamFetcher

ROWS_PER_BATCH = 8


def _read(shard: int, start: int) -> Iterator[int]:
    for i in range(start, 1_000_000):
        yield shard * 1_000_000 + i


def _time(fn: Any, reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return median(out)


def _per_batch(p: int, reps: int, changes: bool) -> float:
    s = Stream.from_shards(list(range(p)), _read, partitions=p)
    if not changes:
        s.state_dict_changes = None  # type: ignore[method-assign,assignment]
    it = iter(s)
    f = StreamFetcher.__new__(StreamFetcher)  # only its state_delta is timed
    f.holder = s
    f.prev_state = {}
    f.state_delta()

    def batch() -> None:
        for _ in range(ROWS_PER_BATCH):
            next(it)
        f.state_delta()

    batch()
    return _time(batch, reps)


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], start_method=False)
    p.add_argument("--reps", type=int, default=200)
    args = parse(p)
    reps = 20 if args.quick else args.reps
    print(
        "command: python benchmarks/bench_stream_partitions.py" + (" --quick" if args.quick else "")
    )
    print(env_line())
    rows = []
    summary: dict[str, Any] = {}
    for parts in (64, 256, 1024):
        s = Stream.from_shards(list(range(parts)), _read, partitions=parts)
        it = iter(s)
        for _ in range(parts * 3):
            next(it)
        state = s.state_dict()
        sd_us = _time(s.state_dict, reps) * 1e6
        js = len(json.dumps({str(k): v for k, v in state.items()}))
        enc = len(dump_state(state))
        fresh = Stream.from_shards(list(range(parts)), _read, partitions=parts)
        load_us = _time(lambda f=fresh, st=state: f.load_state_dict(st), reps) * 1e6
        moved = _per_batch(parts, reps, True) * 1e6
        whole = _per_batch(parts, reps, False) * 1e6
        summary[str(parts)] = {
            "state_dict_us": sd_us,
            "json_bytes": js,
            "encoded_bytes": enc,
            "load_us": load_us,
            "batch_moved_only_us": moved,
            "batch_every_cursor_us": whole,
        }
        rows.append([parts, sd_us, js, enc, load_us, moved, whole])
    print()
    print(f"one reader owning every partition; a batch = {ROWS_PER_BATCH} rows drawn + the delta")
    print_table(
        [
            "partitions",
            "state_dict us",
            "json B",
            "dump_state B",
            "load us",
            "batch+delta us (moved)",
            "batch+delta us (every cursor)",
        ],
        rows,
        digits=0,
    )
    emit_summary("bench_stream_partitions", summary)


if __name__ == "__main__":
    main()
