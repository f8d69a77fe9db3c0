"""Counters kept by a loader and the frozen snapshot ``DataLoader.statistics()`` returns."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class LoaderStatistics:
    """A snapshot of a loader's counters since it was built (all epochs).

    Attributes:
        batches: batches delivered to the caller.
        respawns: workers replaced after a death or hang.
        respawns_by_cause: respawns keyed by cause: ``"signal:SIGKILL"``, ``"exit:1"``,
            ``"hang"``, ``"init_error"``, ``"recv_error"``.
        retries: transient-error retries made inside workers (see ``RetryPolicy``).
        resent_tasks: tasks sent again because the worker holding them died.
        duplicates_dropped: results that arrived twice and were dropped.
        skipped_tasks: poison tasks skipped under ``on_poison="skip"``, as
            ``(epoch, task id, sample indices)`` (indices as a tuple: the snapshot is immutable).
        wait_time_s: time the caller spent blocked waiting for data.
        workers_alive: worker processes running now.
        worker_pids: the pid of each worker slot of the current iterator (or persistent pool),
            by worker id; -1 for a slot whose process is not running. Empty without workers.
        worker_states: each slot's state, by worker id: ``"starting"`` (its process does not
            run our code yet), ``"initializing"`` (in ``worker_init_fn``), ``"ready"``,
            ``"dead"`` (being replaced) or ``"stopped"``.
    """

    batches: int = 0
    respawns: int = 0
    respawns_by_cause: MappingProxyType[str, int] = field(
        default_factory=lambda: MappingProxyType({})
    )
    retries: int = 0
    resent_tasks: int = 0
    duplicates_dropped: int = 0
    skipped_tasks: tuple[tuple[int, int, Any], ...] = ()
    wait_time_s: float = 0.0
    workers_alive: int = 0
    worker_pids: tuple[int, ...] = ()
    worker_states: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # A snapshot built from a plain dict (by ``__reduce__`` on unpickling) is as read-only
        # as one built from the counters.
        if not isinstance(self.respawns_by_cause, MappingProxyType):
            object.__setattr__(
                self, "respawns_by_cause", MappingProxyType(dict(self.respawns_by_cause))
            )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A mappingproxy does not pickle: the snapshot travels with a copy of its dict and is
        # rebuilt through the constructor, which wraps it read-only again.
        values = (getattr(self, f.name) for f in fields(self))
        return (
            type(self),
            tuple(dict(v) if isinstance(v, MappingProxyType) else v for v in values),
        )


class Counters:
    """The mutable counters behind ``LoaderStatistics`` (main process only)."""

    def __init__(self) -> None:
        self.batches = 0
        self.respawns_by_cause: collections.Counter[str] = collections.Counter()
        self.retries = 0
        self.resent_tasks = 0
        self.duplicates_dropped = 0
        self.skipped: list[list[Any]] = []  # [epoch, tid, indices]: also saved in the state
        self.wait_time_s = 0.0

    def snapshot(
        self, worker_pids: tuple[int, ...], worker_states: tuple[str, ...]
    ) -> LoaderStatistics:
        return LoaderStatistics(
            batches=self.batches,
            respawns=sum(self.respawns_by_cause.values()),
            respawns_by_cause=MappingProxyType(dict(self.respawns_by_cause)),
            retries=self.retries,
            resent_tasks=self.resent_tasks,
            duplicates_dropped=self.duplicates_dropped,
            skipped_tasks=tuple(
                (e, t, tuple(i) if isinstance(i, list) else i) for e, t, i in self.skipped
            ),
            wait_time_s=self.wait_time_s,
            workers_alive=sum(1 for pid in worker_pids if pid > 0),
            worker_pids=worker_pids,
            worker_states=worker_states,
        )
