"""Equal batches on every rank for a finite ``Stream`` (issue #33): the ranks' agreement and the
tail it leaves.

Under ``torch.distributed`` each rank reads its own partitions, and partitions hold different
numbers of rows: left alone, one rank runs out of batches first, and the others wait for it in
their next collective forever (DDP's hang). So the epoch's iterator keeps a *credit*, the same
on every rank: while it is positive, the next batch is delivered and the credit drops by one;
when it reaches 0, every rank counts the batches it holds ready (waiting for at least one, or
for its epoch's end) and the ranks take the minimum with one ``all_reduce(MIN)`` of an int64 on
a gloo group (``Agreement``). A minimum of 0 ends the epoch on every rank at the same batch.

Why this is correct: the credit changes only by the same steps on every rank (the agreed value,
then -1 per delivered batch), so every rank reaches 0 -- and calls the collective -- after the
same number of batches; a rank never promises a batch it does not hold (ready in its reorder
buffer, or fetched ahead with ``num_workers=0``); and an epoch ends only when some rank holds
none and its own partitions are drawn to their end, so no rank is left without a batch while
another goes on. Errors raised in ``next()`` consume no credit. The collectives per epoch lie
between ``batches / (workers x prefetch_factor)`` (the trainer is the slower side: the prefetch
window is full) and ``batches`` (loading is).

The rows a rank could not deliver -- the *tail* -- stay in its partitions' cursors: the cursors
the state holds are those of the batches delivered, never those of the batches read ahead. With
``stream_tail="carry"`` (the default) the next epoch's readers start from those delivered
cursors, and a ``Stream`` reader draws an unfinished earlier pass first; with ``"drop"`` those
partitions start the next pass. Either way the epoch's end is counted: one ``RuntimeWarning`` on
each rank that had rows left, and a ``tail`` record in the Stream's state (``carry_point``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..plans import streams as P
from ..plans.stream import Stream
from ..state import schema as S

CARRY = "carry"
DROP = "drop"
TAILS = (CARRY, DROP, None)

# One gloo group per default process group, made at the first Stream epoch that needs it (a
# collective: every rank reaches its first iter() of a Stream loader together).
_GLOO: dict[int, Any] = {}


def check_tail(tail: Any) -> str | None:
    """``DataLoader(stream_tail=...)``, checked.

    Raises:
        ValueError: not "carry", "drop" or None.
    """
    if tail not in TAILS:
        raise ValueError(
            f"stream_tail must be 'carry', 'drop' or None, got {tail!r} ('carry': rows a rank "
            "could not deliver come first in the next epoch; 'drop': they are skipped; None: "
            "no agreement between ranks, each runs its own partitions to their end)"
        )
    return tail


def _world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _default_backend() -> str:
    """The default process group's backend (a function: a test stands in another)."""
    return str(torch.distributed.get_backend())


class Agreement:
    """The ranks' ``all_reduce(MIN)`` of the batches each holds ready, on a gloo group."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.calls = 0

    def __call__(self, ready: int) -> int:
        t = torch.tensor([ready], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        self.calls += 1
        return int(t.item())


def rank_agreement(dataset: Any, tail: str | None) -> Agreement | None:
    """The agreement an epoch of ``dataset`` needs: a ``Stream`` on more than one rank, unless
    ``stream_tail=None``; else None. The default group serves if its backend is gloo; else a
    gloo group is made once (collectively: every rank's first such ``iter()``)."""
    if tail is None or not isinstance(dataset, Stream):
        return None
    world, _ = _world()
    if world == 1:
        return None
    dist = torch.distributed
    if _default_backend() == "gloo":
        return Agreement(None)
    key = id(dist.group.WORLD)
    if key not in _GLOO:
        _GLOO[key] = dist.new_group(backend="gloo")
    return Agreement(_GLOO[key])


def _meta(stream: Stream, epoch: int, world: int, rank: int, k: int) -> dict[str, Any]:
    meta = dict(stream.state_dict()[P.META_KEY])
    meta["epoch"] = epoch
    meta["layout"] = {"world_size": world, "rank": rank, "num_workers": k}
    return meta


def carry_point(
    stream: Stream,
    position: S.ResumePoint,
    record: dict[str, Any],
    num_workers: int,
) -> S.ResumePoint:
    """The start of the epoch after one the agreement ended with rows left on this rank.

    ``position`` is the ended epoch's (its workers' *delivered* cursors), ``record`` the tail
    record (``tail_record``). Each worker that had not run dry gets its partitions' cursors:
    under "carry" an unfinished one as it is (its rows come first), else the next pass's start;
    a partition it had delivered nothing of is at the ended pass's start.
    """
    world, rank = _world()
    k = max(1, num_workers)
    epoch = position.epoch + 1
    width = len(stream.cursor_fields())
    meta = _meta(stream, epoch, world, rank, k)
    meta["tail"] = dict(record)
    workers = []
    for w in range(k):
        wp = position.workers[w] if w < len(position.workers) else S.WorkerPosition()
        if wp.exhausted:
            workers.append(S.WorkerPosition())  # every partition of it drawn to its end
            continue
        saved = wp.dataset_state if isinstance(wp.dataset_state, dict) else {}
        mine: dict[Any, Any] = {P.META_KEY: meta}
        for p in P.owned(stream.partitions, world, rank, k, w):
            c = saved.get(p)
            c = list(c) if c is not None else P.fresh_cursor(position.epoch, width)
            keep = record["rule"] == CARRY and not c[P.DONE]
            mine[p] = c if keep else P.fresh_cursor(epoch, width)
        workers.append(S.WorkerPosition(0, False, mine, 0))
    return S.ResumePoint(seed=None, epoch=epoch, iterable=True, workers=workers)


def tail_record(
    stream: Stream, position: S.ResumePoint, batches: int, ready: int, rule: str, num_workers: int
) -> dict[str, Any]:
    """What the agreement's end of an epoch left on this rank: its epoch, the batches every
    rank delivered, the batches this rank had read ahead (rows it held but did not deliver: the
    tail's known part), and the partitions not drawn to their end (the rest of the tail is in
    them, unread)."""
    world, rank = _world()
    k = max(1, num_workers)
    left = []
    for w in range(k):
        wp = position.workers[w] if w < len(position.workers) else S.WorkerPosition()
        if wp.exhausted:
            continue
        saved = wp.dataset_state if isinstance(wp.dataset_state, dict) else {}
        for p in P.owned(stream.partitions, world, rank, k, w):
            c = saved.get(p)
            if c is None or not c[P.DONE]:
                left.append(p)
    return {
        "epoch": position.epoch,
        "rule": rule,
        "rank": rank,
        "batches": batches,
        "ready": ready,
        "partitions": sorted(left),
    }


def tail_warning(record: dict[str, Any]) -> str:
    """The one ``RuntimeWarning`` of an epoch the agreement ended with rows left here."""
    e = record["epoch"]
    then = (
        f"their rows come first in epoch {e + 1} (stream_tail='carry')"
        if record["rule"] == CARRY
        else f"their rows are dropped: epoch {e + 1} starts them at their next pass "
        "(stream_tail='drop')"
    )
    return (
        f"DataLoader: epoch {e} of the Stream ended after {record['batches']} batches on every "
        f"rank (the ranks' agreement: a rank ran out); rank {record['rank']} had "
        f"{record['ready']} more batches read ahead and partitions {record['partitions']} not "
        f"drawn to their end: {then}. The state records it as stream.tail."
    )


def on_cut(
    stream: Any,
    rule: Any,
    num_workers: int,
    position: S.ResumePoint,
    batches: int,
    ready: int,
    stacklevel: int = 2,
) -> dict[str, Any]:
    """The tail record of an epoch the agreement ended with ``ready`` batches left on this
    rank; warns once with it (``stacklevel`` from the caller's frame)."""
    record = tail_record(stream, position, batches, ready, rule, num_workers)
    warnings.warn(tail_warning(record), RuntimeWarning, stacklevel=stacklevel + 1)
    return record
