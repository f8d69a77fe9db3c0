"""The worker slot: one object per worker id, kept across respawns, that holds what the
supervisor knows of the process now behind it; and the supervisor's statistics.

Slot states:
    STARTING ──READY msg──► READY ──death/hang──► DEAD ──respawn()──► STARTING
    any ──shutdown()──► STOPPED
Only the supervisor changes a slot's process, channels and state; the dispatcher and recovery
read them, and keep ``outstanding`` (the task ids sent and not yet received, in send order).
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

from ..protocol import WorkerError
from .cpu import CpuFigures

STARTING = "starting"
READY_STATE = "ready"
DEAD = "dead"
STOPPED = "stopped"


class SupervisorStatistics(NamedTuple):
    """What a supervisor has done since it was built.

    ``starts`` counts every process started (first starts and replacements); ``deaths`` every
    death it reported, of which ``killed`` were hangs it killed itself; ``pids`` and
    ``states`` are per worker id (pid -1 when no process runs; states as
    ``WorkerSlot.describe_state``).
    """

    starts: int
    deaths: int
    killed: int
    respawns_without_progress: int
    pids: tuple[int, ...]
    states: tuple[str, ...]


class WorkerSlot:
    """One worker id; its process changes on respawn, the slot stays."""

    def __init__(self, wid: int) -> None:
        self.wid = wid
        self.state = DEAD
        self.proc: Any = None
        self.pid = -1
        self.task_conn: Any = None
        self.result_conn: Any = None
        self.outstanding: collections.deque[int] = collections.deque()
        self.busy_since = 0.0
        self.start_failures = 0
        self.init_error: WorkerError | None = None
        self.booted = False  # the current process has sent BOOTED
        self.start_since = 0.0  # when it was started, then when it sent BOOTED
        self.running: int | None = None  # the task it said it started out of order (STARTED)
        # Its CPU figures when its hang clock last started or was looked at, and when.
        self.cpu: CpuFigures | None = None
        self.cpu_seen = 0.0

    @property
    def alive(self) -> bool:
        return self.state in (STARTING, READY_STATE)

    @property
    def ready(self) -> bool:
        return self.state == READY_STATE

    def describe_state(self) -> str:
        """For statistics: its state, a started worker's split by whether it runs our code."""
        if self.state == STARTING:
            return "initializing" if self.booted else "starting"
        return self.state

    def __repr__(self) -> str:
        return (
            f"<worker {self.wid} pid={self.pid} {self.state} outstanding={list(self.outstanding)}>"
        )
