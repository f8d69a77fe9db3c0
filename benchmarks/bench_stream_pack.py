"""``Stream.pack``: tokens/s against a plain generator, and the padding each packing leaves.

Documents: lognormal lengths (``lognormvariate(6.2, 1.1)``: mean about 900 tokens, about 10 %
longer than 2,048), tokens as uint16 arrays in memory (the read costs nothing, so the figures
are the packer's and the pipeline's own cost). Rows of ``SEQ = 2048`` tokens with the four
companions (``input_ids``, ``position_ids``, ``segment_ids``, ``labels``, int64).

1. **pack alone** (one process, no loader): ``Stream.pack`` (concat; best_fit window 1,024)
   against a plain Python/numpy generator doing the same concat-split with the same four
   fields, over the same documents. The concat rows of both are checked equal first.
2. **the whole stream** (read -> map (uint16 -> int64, a stand-in for a tokenizer) -> pack ->
   default collate, 2 workers, batch 8): ``Stream`` under our ``DataLoader`` against the plain
   generator as an ``IterableDataset`` (each worker packs its half of the shards) under torch's
   ``DataLoader``. Both deliver every token once (checked by count and sum).
3. **padding**: pad fraction of best_fit with windows 64..4,096 (from the Stream's own
   ``pad``/``tokens_out`` counters) against next-fit (a new row when the next document does not
   fit) and one document per row (documents longer than a row split into row-sized pieces in
   every case), and concat.

Run: python3 benchmarks/bench_stream_pack.py [--quick] [--rounds N]
Exits non-zero if a packing is wrong (rows differ, a token lost or repeated).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator
from typing import Any

import _common as C
import numpy as np
import torch

from resumable_loader import Stream

SEQ = 2048
BATCH = 8
WORKERS = 2
SHARDS = 16
MU, SIGMA = 6.2, 1.1


class BenchError(Exception):
    pass


# ---- documents (built once; forked workers share them) ----

DOCS: list[list[np.ndarray]] = []


def build_docs(n_docs: int, seed: int = 0) -> list[list[np.ndarray]]:
    rng = random.Random(seed)
    per = n_docs // SHARDS
    out = []
    for s in range(SHARDS):
        shard = []
        for i in range(per):
            n = max(1, int(rng.lognormvariate(MU, SIGMA)))
            shard.append(((np.arange(n) + s * 7 + i) % 65000).astype(np.uint16))
        out.append(shard)
    return out


def read(shard: int, start: int) -> Iterator[np.ndarray]:
    yield from DOCS[shard][start:]


def to_ids(raw: np.ndarray) -> np.ndarray:
    return raw.astype(np.int64)


def total_tokens(shards: list[int]) -> tuple[int, int]:
    """(count, sum) of the tokens in ``shards``, the check every run is held to."""
    n = sum(len(d) for s in shards for d in DOCS[s])
    t = sum(int(d.sum(dtype=np.int64)) for s in shards for d in DOCS[s])
    return n, t


# ---- the plain generator: concat-then-split with numpy, the same four fields ----


def plain_rows(shards: list[int], seq: int = SEQ) -> Iterator[dict[str, np.ndarray]]:
    """Concatenate the shards' documents and cut rows of ``seq`` tokens; the last one padded."""
    buf: list[np.ndarray] = []
    have = 0
    for s in shards:
        for raw in DOCS[s]:
            doc = to_ids(raw)
            at = 0
            while at < len(doc):
                n = min(seq - have, len(doc) - at)
                buf.append(doc[at : at + n])
                have += n
                at += n
                if have == seq:
                    yield plain_row(buf, seq)
                    buf, have = [], 0
    if have:
        yield plain_row(buf, seq)


def plain_row(pieces: list[np.ndarray], seq: int) -> dict[str, np.ndarray]:
    ids = np.zeros(seq, dtype=np.int64)
    pos = np.zeros(seq, dtype=np.int64)
    seg = np.zeros(seq, dtype=np.int64)
    labels = np.full(seq, -100, dtype=np.int64)
    at = 0
    for k, p in enumerate(pieces, 1):
        n = len(p)
        ids[at : at + n] = p
        pos[at : at + n] = np.arange(n)
        seg[at : at + n] = k
        labels[at + 1 : at + n] = p[1:]
        at += n
    pos[at:] = np.arange(seq - at)
    return {"input_ids": ids, "position_ids": pos, "segment_ids": seg, "labels": labels}


class PlainDataset(torch.utils.data.IterableDataset):
    """The plain generator as torch's loader runs it: each worker packs its share of shards."""

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        info = torch.utils.data.get_worker_info()
        w, k = (info.id, info.num_workers) if info is not None else (0, 1)
        return plain_rows(list(range(w, SHARDS, k)))


def stream(mode: str = "concat", window: int = 1024, partitions: int = 1) -> Stream:
    return (
        Stream.from_shards(list(range(SHARDS)), read, partitions=partitions, shuffle_shards=False)
        .map(to_ids)
        .pack(SEQ, key=None, mode=mode, window=window)
    )


# ---- 1. pack alone ----


def timed_rows(rows: Iterator[dict[str, np.ndarray]], expect: tuple[int, int]) -> dict[str, float]:
    t0 = time.perf_counter()
    n = t = 0
    for r in rows:
        ids = r["input_ids"][r["segment_ids"] > 0]
        n += len(ids)
        t += int(ids.sum())
    dt = time.perf_counter() - t0
    if (n, t) != expect:
        raise BenchError(f"tokens (count, sum) {(n, t)}, expected {expect}")
    return {"s": dt, "tok_per_s": n / dt}


def check_same_rows() -> None:
    ours = iter(stream("concat"))
    for i, ref in enumerate(plain_rows(list(range(SHARDS)))):
        got = next(ours)
        for f in ref:
            if not np.array_equal(got[f], ref[f]):
                raise BenchError(f"row {i}: {f} differs between Stream.pack and the plain packer")


# ---- 2. the whole stream ----


def whole(loader_cls: type, ds: Any, expect: tuple[int, int]) -> dict[str, float]:
    t0 = time.perf_counter()
    loader = loader_cls(ds, batch_size=BATCH, num_workers=WORKERS)
    n = t = 0
    for b in loader:
        ids = b["input_ids"][b["segment_ids"] > 0]
        n += ids.numel()
        t += int(ids.sum())
    dt = time.perf_counter() - t0
    C.close_loader(loader)
    del loader
    if (n, t) != expect:
        raise BenchError(f"tokens (count, sum) {(n, t)}, expected {expect}")
    return {"s": dt, "tok_per_s": n / dt}


# ---- 3. padding ----


def pieces(seq: int = SEQ) -> list[int]:
    return [
        min(seq, len(d) - o) for s in range(SHARDS) for d in DOCS[s] for o in range(0, len(d), seq)
    ]


def next_fit_pad(lengths: list[int], seq: int = SEQ) -> float:
    rows, room = 0, 0
    for n in lengths:
        if n > room:
            rows, room = rows + 1, seq
        room -= n
    return 1 - sum(lengths) / (rows * seq)


def stream_pad(mode: str, window: int) -> float:
    s = stream(mode, window)
    for _ in s:
        pass
    c = dict(zip(s.cursor_fields(), s.state_dict()[0]))
    if c["tokens_in"] != c["tokens_out"] + c["dropped"] + c["carry_left"] or c["carry_left"]:
        raise BenchError(f"counters do not add up: {c}")
    return c["pad"] / (c["pad"] + c["tokens_out"])


def main() -> int:
    p = C.base_parser(__doc__.splitlines()[0], start_method=False)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--docs", type=int, default=40_000)
    args = C.parse(p)
    n_docs = 6_000 if args.quick else args.docs
    rounds = 2 if args.quick else args.rounds
    DOCS[:] = build_docs(n_docs)
    all_shards = list(range(SHARDS))
    expect = total_tokens(all_shards)
    print(C.env_line())
    print(
        f"{n_docs} documents in {SHARDS} shards, {expect[0]:,} tokens, seq_len {SEQ}, "
        f"{rounds} rounds alternated"
    )
    check_same_rows()

    runs = C.alternate(
        {
            "plain generator (concat)": lambda: timed_rows(plain_rows(all_shards), expect),
            "Stream.pack concat": lambda: timed_rows(iter(stream("concat")), expect),
            "Stream.pack best_fit w=1024": lambda: timed_rows(
                iter(stream("best_fit", 1024)), expect
            ),
        },
        rounds,
    )
    base = C.median([r["tok_per_s"] for r in runs["plain generator (concat)"]])
    table = []
    summary: dict[str, Any] = {"docs": n_docs, "tokens": expect[0], "seq_len": SEQ}
    for name, rs in runs.items():
        tps = C.median([r["tok_per_s"] for r in rs])
        table.append([name, tps / 1e6, tps / base])
        summary[f"alone:{name}"] = tps
    print("\n1. pack alone, one process (median of rounds)")
    C.print_table(["packer", "Mtokens/s", "vs plain"], table, 2)

    loader_cls = C.loader_api().DataLoader
    torch_cls = C.torch_loader()
    runs = C.alternate(
        {
            "plain generator, torch DataLoader": lambda: whole(torch_cls, PlainDataset(), expect),
            "Stream read->map->pack, our DataLoader": lambda: whole(
                loader_cls, stream("concat", partitions=WORKERS), expect
            ),
        },
        rounds,
    )
    base = C.median([r["tok_per_s"] for r in runs["plain generator, torch DataLoader"]])
    table = []
    for name, rs in runs.items():
        tps = C.median([r["tok_per_s"] for r in rs])
        table.append([name, tps / 1e6, tps / base, C.median([r["s"] for r in rs])])
        summary[f"whole:{name}"] = tps
    print(f"\n2. the whole stream, {WORKERS} workers, batch {BATCH} (median of rounds)")
    C.print_table(["pipeline", "Mtokens/s", "vs plain", "epoch s"], table, 2)

    lengths = pieces()
    table = [
        ["one document per row", 1 - sum(lengths) / (len(lengths) * SEQ)],
        ["next-fit", next_fit_pad(lengths)],
    ]
    for w in (64, 256, 1024, 4096):
        table.append([f"best_fit window {w}", stream_pad("best_fit", w)])
    table.append(["concat", stream_pad("concat", 1)])
    print(f"\n3. padding (share of row tokens that are pad), {len(lengths)} pieces <= {SEQ}")
    C.print_table(["packing", "pad %"], [[n, 100 * x] for n, x in table], 3)
    summary.update({f"pad:{n}": x for n, x in table})
    C.emit_summary("stream_pack", summary)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"FAILED: {e}")
        sys.exit(2)
