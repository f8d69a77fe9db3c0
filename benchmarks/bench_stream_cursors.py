"""R4 of issue #33: what a ``Stream``'s state costs at P = 1024 partitions.

(``bench_stream_state.py`` is the older benchmark of a generic iterable dataset with a
100,000-number state, which the README cites; this one is the Stream's own.)

A Stream over 2048 synthetic shards dealt to 1024 partitions, ``read -> filter`` (a cursor of
8 ints), under our DataLoader with batch 32, one reader (``num_workers=0``) and 4 workers. After
40 batches (every partition begun), measured in this process, median over repeats:

* ``stream.state_dict()`` of the Stream alone (one reader holds all 1024 cursors);
* ``loader.state_dict()``, and its size as msgpack through our codec (``dump_state``) and as
  json;
* ``load_state_dict(state)`` on a freshly built loader (the parse and the plan; the same
  layout), and on a loader of the other layout (the re-deal: every cursor merged and dealt
  again);
* ``merge_rank_states([state])`` and ``skip_samples(state, 1000)`` (the global state and the
  water-filling over 1024 cursors);
* ``python -m resumable_loader inspect``'s block: ``format_summary(state)``.

Run: python3 benchmarks/bench_stream_cursors.py [--quick]
Design 8.1 expects ``state_dict()`` around 0.1 ms at P = 1024.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import _common as C

from resumable_loader import (
    DataLoader,
    Stream,
    dump_state,
    load_state,
    merge_rank_states,
    skip_samples,
)
from resumable_loader.cli.summary import format_summary, jsonable

PARTITIONS = 1024
SHARDS = 2048
BATCH = 32
WARM_BATCHES = 40  # 1280 rows: every partition has drawn at least one


def read(shard: int, start: int) -> Iterator[int]:
    for i in range(start, 64):
        yield shard * 1000 + i


def odd(x: int) -> bool:
    return x % 2 == 1


def make() -> Stream:
    return Stream.from_shards(list(range(SHARDS)), read, partitions=PARTITIONS).filter(odd)


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of one call."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return C.median(times)


def measure(workers: int, other: int, repeats: int) -> dict[str, Any]:
    loader = DataLoader(make(), batch_size=BATCH, num_workers=workers)
    it = iter(loader)
    for _ in range(WARM_BATCHES):
        next(it)
    state = load_state(dump_state(loader.state_dict()))
    out: dict[str, Any] = {"workers": workers}
    out["loader_state_dict_us"] = timed(loader.state_dict, repeats) * 1e6
    if workers == 0:
        stream = loader.dataset
        out["stream_state_dict_us"] = timed(stream.state_dict, repeats) * 1e6
    del it
    C.close_loader(loader)
    out["msgpack_bytes"] = len(dump_state(state))
    out["json_bytes"] = len(json.dumps(jsonable(state)))
    out["dump_state_us"] = timed(lambda: dump_state(state), repeats) * 1e6

    def load(k: int) -> Callable[[], None]:
        fresh = DataLoader(make(), batch_size=BATCH, num_workers=k)
        return lambda: fresh.load_state_dict(state)

    same, redeal = load(workers), load(other)
    out["load_same_layout_us"] = timed(same, repeats) * 1e6
    out[f"load_redealt_to_{other}_workers_us"] = timed(redeal, repeats) * 1e6
    out["merge_rank_states_us"] = timed(lambda: merge_rank_states([state]), repeats) * 1e6
    out["skip_1000_us"] = timed(lambda: skip_samples(state, 1000), repeats) * 1e6
    out["inspect_us"] = timed(lambda: format_summary(state), repeats) * 1e6
    return out


def main() -> int:
    p = C.base_parser(__doc__.splitlines()[0], start_method=False)
    args = C.parse(p)
    repeats = 20 if args.quick else 200
    print(C.env_line())
    print(
        f"Stream: {SHARDS} shards, {PARTITIONS} partitions, read -> filter (8-int cursors); "
        f"batch {BATCH}; state after {WARM_BATCHES} batches; median of {repeats} calls"
    )
    rows, summary = [], {}
    for workers, other in ((0, 4), (4, 0)):
        r = measure(workers, other, repeats)
        summary[f"workers_{workers}"] = r
        rows.append(
            [
                "1 reader (num_workers=0)" if workers == 0 else f"{workers} workers",
                r.get("stream_state_dict_us", "-"),
                r["loader_state_dict_us"],
                r["msgpack_bytes"],
                r["json_bytes"],
                r["load_same_layout_us"],
                r[f"load_redealt_to_{other}_workers_us"],
                r["merge_rank_states_us"],
                r["skip_1000_us"],
                r["inspect_us"],
            ]
        )
    print()
    C.print_table(
        [
            "layout",
            "stream.state_dict us",
            "loader.state_dict us",
            "msgpack B",
            "json B",
            "load (same) us",
            "load (re-deal) us",
            "merge_rank_states us",
            "skip 1000 us",
            "inspect us",
        ],
        rows,
        digits=3,
    )
    print(
        "load (re-deal): the state loaded by a loader of the other layout (4 workers <-> "
        "num_workers=0); msgpack B: len(dump_state(state)); json B: len(json.dumps(state))"
    )
    C.emit_summary("stream_cursors", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
