"""``inspect``'s block for a ``resumable_loader.Stream``: its plan and its partition cursors.

Read from the state alone (no data, no ``Stream`` object): the header every worker's state
carries (``stream``: partitions, seed, shards, pipeline, fields) and the cursors of the
partitions each worker had begun. A cursor is ``[pass, done, rows, skip, <the chain's
position and counters>]``, the fields named by the header (docs/streams.md, "The position").

Every value may be damaged or crafted: the block says what does not fit instead of failing,
and loops only over the cursors present (never over ``range(partitions)``, which a file can
make 2**62). ``check`` lists the invariants a cursor table breaks, for ``inspect --check``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..state.codec import clip_repr, clip_text

__all__ = ["StreamTable", "check", "lines", "read_table", "table_lines"]

HEAD = ["pass", "done", "rows", "skip"]
PASS, DONE, ROWS, SKIP = range(4)
# Fields that count things over a pass (summed by the block), by what they count; the other
# fields past the head are positions (which shard, which window), meaningless summed.
COUNTERS = {
    "src": "source samples read",
    "filtered": "dropped by filters",
    "docs": "documents",
    "tokens_in": "tokens in",
    "tokens_out": "tokens out",
    "pad": "pad tokens",
    "dropped": "tokens dropped",
}
SHOW_PARTITIONS = 8


@dataclass
class StreamTable:
    """What the states say about one Stream: its header (from the first worker state that
    has one), the cursors by partition, and what did not fit (``problems``)."""

    header: dict[str, Any] | None = None
    fields: list[str] = field(default_factory=list)
    partitions: int | None = None
    epoch: Any = None
    cursors: dict[int, list[int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    exhausted: int = 0
    share: int = 1  # one rank's own state of a job on several ranks: 1/world of the partitions


def _is_stream(state: Any) -> bool:
    record = state.get("dataset") if isinstance(state, dict) else None
    if isinstance(record, dict) and record.get("class") == "Stream":
        return True
    workers = state.get("workers") if isinstance(state, dict) else None
    return isinstance(workers, list) and any(
        isinstance(w, dict)
        and isinstance(w.get("dataset_state"), dict)
        and isinstance(w["dataset_state"].get("stream"), dict)
        for w in workers
    )


def read_table(states: list[Any]) -> StreamTable | None:
    """The Stream of ``states`` (one loader state, or every rank's of a global state), or
    None when they are not a Stream's."""
    if not states or not any(_is_stream(s) for s in states):
        return None
    t = StreamTable()
    world = len(states)
    if world == 1 and isinstance(states[0], dict) and isinstance(states[0].get("config"), dict):
        ranks = states[0]["config"].get("world_size")
        t.share = ranks if type(ranks) is int and ranks >= 1 else 1
    for r, sd in enumerate(states):
        if not isinstance(sd, dict):
            t.problems.append(f"ranks[{r}]: not a loader state ({type(sd).__name__})")
            continue
        if t.epoch is None:
            t.epoch = sd.get("epoch")
        elif sd.get("epoch") != t.epoch:
            t.problems.append(
                f"ranks[{r}].epoch: {clip_repr(sd.get('epoch'))}, rank 0 has {clip_repr(t.epoch)}"
            )
        workers = sd.get("workers")
        if not isinstance(workers, list):
            t.problems.append(f"workers: expected a list, got {clip_repr(workers)}")
            continue
        config = sd.get("config")
        cfg: dict[Any, Any] = config if isinstance(config, dict) else {}
        rank = r if world > 1 else cfg.get("rank", 0)
        w_size = world if world > 1 else cfg.get("world_size", 1)
        for i, w in enumerate(workers):
            where = f"ranks[{r}]." * (world > 1) + f"workers[{i}].dataset_state"
            if not isinstance(w, dict):
                continue
            t.exhausted += w.get("exhausted") is True
            ds = w.get("dataset_state")
            if ds is None:
                continue
            if not isinstance(ds, dict):
                t.problems.append(f"{where}: not a Stream's state ({type(ds).__name__})")
                continue
            if t.header is None:
                _read_header(t, ds.get("stream"), f"{where}.stream")
            _read_cursors(t, ds, where, (rank, w_size, len(workers), i))
    if t.header is None and not t.problems:
        t.problems.append(
            "no worker state holds the Stream's header yet (no batch delivered this epoch)"
        )
    return t


def _read_header(t: StreamTable, head: Any, where: str) -> None:
    if not isinstance(head, dict):
        t.problems.append(f"{where}: missing, or not a dict ({clip_repr(head)})")
        t.header = {}
        return
    t.header = head
    kind, parts, fields = head.get("kind"), head.get("partitions"), head.get("fields")
    if kind != "resumable_loader.Stream":
        t.problems.append(f"{where}.kind: {clip_repr(kind)}, not 'resumable_loader.Stream'")
    if type(parts) is int and parts >= 1:
        t.partitions = parts
    else:
        t.problems.append(f"{where}.partitions: must be an int >= 1, got {clip_repr(parts)}")
    if type(head.get("seed")) is not int:
        t.problems.append(f"{where}.seed: must be an int, got {clip_repr(head.get('seed'))}")
    shards = head.get("shards")
    if (
        not isinstance(shards, dict)
        or type(shards.get("count")) is not int
        or shards["count"] < 1
        or not isinstance(shards.get("digest"), str)
    ):
        t.problems.append(
            f"{where}.shards: must be {{'count': an int >= 1, 'digest': a str}}, got "
            f"{clip_repr(shards)}"
        )
    elif t.partitions is not None and t.partitions > shards["count"]:
        t.problems.append(
            f"{where}.partitions: {t.partitions} partitions, more than the {shards['count']} shards"
        )
    pipeline = head.get("pipeline")
    if not isinstance(pipeline, list) or not all(isinstance(x, str) for x in pipeline):
        t.problems.append(f"{where}.pipeline: must be a list of str, got {clip_repr(pipeline)}")
    if (
        isinstance(fields, list)
        and all(isinstance(f, str) for f in fields)
        and fields[: len(HEAD)] == HEAD
    ):
        t.fields = list(fields)
    else:
        t.problems.append(
            f"{where}.fields: must be a list of names starting with {HEAD}, got {clip_repr(fields)}"
        )


def _read_cursors(
    t: StreamTable, ds: dict[Any, Any], where: str, layout: tuple[Any, Any, int, int]
) -> None:
    rank, world, workers, worker = layout
    owner_ok = type(rank) is int and type(world) is int and world >= 1
    for p, c in ds.items():
        if p == "stream":
            continue
        if type(p) is not int or p < 0 or (t.partitions is not None and p >= t.partitions):
            t.problems.append(f"{where}: key {clip_repr(p)} is not a partition id")
            continue
        if p in t.cursors:
            t.problems.append(f"{where}: partition {p} is also in another worker's state")
            continue
        width = len(t.fields)
        if (
            not isinstance(c, list)
            or (width and len(c) != width)
            or not all(type(v) is int and v >= 0 for v in c)
            or len(c) < len(HEAD)
        ):
            t.problems.append(
                f"{where}: partition {p}: a cursor is {width or 'a list of'} ints >= 0, got "
                f"{clip_repr(c)}"
            )
            continue
        if c[DONE] > 1:
            t.problems.append(f"{where}: partition {p}: done is {c[DONE]}, not 0 or 1")
        if type(t.epoch) is int and c[PASS] > t.epoch:
            t.problems.append(f"{where}: partition {p} is in pass {c[PASS]}, after epoch {t.epoch}")
        if "offset" in t.fields and "src" in t.fields:
            off, src = c[t.fields.index("offset")], c[t.fields.index("src")]
            if off > src:
                t.problems.append(
                    f"{where}: partition {p}: offset {off} exceeds the {src} source samples read"
                )
        k = max(workers, 1)
        if owner_ok and (p % world != rank or (p // world) % k != worker):
            t.problems.append(
                f"{where}: partition {p} is read by rank {p % world} worker {(p // world) % k}, "
                f"not by this one (rank {rank} worker {worker})"
            )
        t.cursors[p] = c


def _median(present: list[int], absent: int) -> tuple[int, int, int]:
    """min, median and max of ``present`` plus ``absent`` zeros (never materialised: a
    damaged header may claim 2**62 partitions)."""
    values = sorted(present)
    total = len(values) + absent
    m = (total - 1) // 2
    low = 0 if absent else values[0]
    med = 0 if m < absent else values[m - absent]
    high = values[-1] if values else 0
    return low, med, high


def _ids(ps: list[int]) -> str:
    shown = ", ".join(map(str, ps[:SHOW_PARTITIONS]))
    return shown + (", ..." if len(ps) > SHOW_PARTITIONS else "")


def lines(t: StreamTable) -> list[tuple[str, str]]:
    """The block's ``(name, text)`` lines (the summary lays them out)."""
    out: list[tuple[str, str]] = []
    h = t.header or {}
    raw = h.get("shards")
    shards: dict[Any, Any] = raw if isinstance(raw, dict) else {}
    pipeline = h.get("pipeline")
    pipe = (
        " -> ".join(clip_text(s, 40) for s in pipeline[:12])
        + (" -> ..." if len(pipeline) > 12 else "")
        if isinstance(pipeline, list) and all(isinstance(s, str) for s in pipeline)
        else clip_repr(pipeline)
    )
    digest = shards.get("digest")
    digest_text = clip_text(digest, 24) if isinstance(digest, str) else clip_repr(digest)
    out.append(
        (
            "stream",
            f"{clip_repr(t.partitions if t.partitions is not None else h.get('partitions'))} "
            f"partitions, seed {clip_repr(h.get('seed'))}, shards "
            f"{clip_repr(shards.get('count'))} ({digest_text}), pipeline {pipe}",
        )
    )
    for problem in t.problems[:3]:
        out.append(("", f"damaged: {clip_text(problem, 160)}"))
    if len(t.problems) > 3:
        out.append(("", f"... {len(t.problems) - 3} more problems (inspect --check lists them)"))
    epoch = t.epoch
    if type(epoch) is not int or not t.cursors:
        if not t.cursors:
            out.append(("", "no partition cursors in the state: every partition at its start"))
        return out
    cur = t.cursors
    this = [p for p, c in cur.items() if c[PASS] == epoch and not c[DONE]]
    done = [p for p, c in cur.items() if c[PASS] == epoch and c[DONE]]
    carried = sorted(p for p, c in cur.items() if c[PASS] < epoch and not c[DONE])
    # A rank's own state holds its share of the partitions (p mod W == rank).
    absent = (t.partitions // t.share - len(cur)) if t.partitions is not None else 0
    absent = max(absent, 0)
    text = f"epoch {epoch}: {len(this)} partitions in pass {epoch}, {len(done)} finished it"
    if carried:
        text += f", {len(carried)} carried in earlier passes (partitions {_ids(carried)})"
    if absent:
        text += f"; {absent} not begun (no cursor in the state: at their pass's start)"
    if t.share > 1:
        text += f" (this rank's partitions only: 1/{t.share} of them)"
    out.append(("", text))
    rows = [c[ROWS] for c in cur.values() if c[PASS] == epoch]
    low, med, high = _median(rows, absent)
    out.append(
        (
            "",
            f"rows drawn this pass per partition: min {low:,} / median {med:,} / max {high:,}; "
            f"{sum(rows):,} in all",
        )
    )
    pending = [(p, c[SKIP]) for p, c in cur.items() if c[SKIP] and not c[DONE]]
    short = [(p, c[SKIP]) for p, c in cur.items() if c[SKIP] and c[DONE]]
    skip_text = (
        f"pending skips: {sum(s for _, s in pending):,} rows in {len(pending)} partitions"
        if pending
        else "pending skips: none"
    )
    if short:
        skip_text += (
            f"; skips left on finished partitions (rows they could not give): "
            f"{sum(s for _, s in short):,} in partitions {_ids(sorted(p for p, _ in short))}"
        )
    out.append(("", skip_text))
    counters = [
        f"{COUNTERS[f]} {sum(c[i] for c in cur.values() if c[PASS] == epoch):,}"
        for i, f in enumerate(t.fields)
        if f in COUNTERS
    ]
    if counters:
        out.append(("", "this pass: " + ", ".join(counters)))
    return out


def table_lines(t: StreamTable) -> list[str]:
    """Every cursor in the state, one line per partition in id order, under the header's
    field names (``inspect --partitions``); partitions without a cursor are not listed."""
    fields = t.fields or [
        f"#{i}" for i in range(max((len(c) for c in t.cursors.values()), default=0))
    ]
    width = [max(len(f), 4) for f in fields]
    for c in t.cursors.values():
        width = [max(w, len(str(v))) for w, v in zip(width, c)]
    out = ["partition  " + "  ".join(f"{f:>{w}}" for f, w in zip(fields, width))]
    for p in sorted(t.cursors):
        out.append(f"{p:>9}  " + "  ".join(f"{v:>{w}}" for v, w in zip(t.cursors[p], width)))
    if t.partitions is not None and len(t.cursors) < t.partitions:
        out.append(
            f"({t.partitions - len(t.cursors)} partitions without a cursor in the state: at "
            "their pass's start, or another rank's)"
        )
    return out


def check(t: StreamTable) -> list[str]:
    """The invariants the table breaks (empty: none): a header every reader accepts,
    cursors of the header's width and ranges, each partition in one worker, the one its
    layout says, and no pass after the loader's epoch."""
    return list(t.problems)
