"""What the supervisor reports: a worker's exit in words and as a statistics key, the
``DeathReport`` of a death or a killed hang, and the events ``Supervisor.poll`` returns
(``Arrived``, ``Died``, ``Lost``).

The words are read by users in error messages and matched by tests ("was killed by SIGKILL",
"hung (no result for 5 s: task_timeout)"); the keys are ``statistics().respawns_by_cause``'s.
"""

from __future__ import annotations

import re
import signal
from typing import NamedTuple

from ..protocol import Result, WorkerError
from ..transport import Undecodable
from .slots import WorkerSlot


# ---- exits in words ------------------------------------------------------------------------------
def describe_exit(exitcode: int | None) -> str:
    """How a process ended, for a sentence: "was killed by SIGKILL", "exited with code 1"."""
    if exitcode is None:
        return "did not exit"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def exit_cause(exitcode: int | None) -> str:
    """A short key for statistics: 'signal:SIGKILL', 'exit:1', ..."""
    if exitcode is None:
        return "unknown"
    if exitcode < 0:
        try:
            return f"signal:{signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal:{-exitcode}"
    return f"exit:{exitcode}"


def death_cause(why: str, exitcode: int | None, init_error: WorkerError | None) -> tuple[str, str]:
    """A death's cause in words and its statistics key, from what the supervisor saw.

    ``why`` is "" when the exit status says it all; "failed to start" when worker_init_fn
    raised (``init_error``); a hang ("hung ...") that the worker was killed for; or what the
    worker's channel did wrong, followed by how the process then ended.
    """
    if why.startswith("hung"):
        return why, "hang"
    if why == "failed to start":
        err = init_error
        where = re.split(r" (?:of|in) DataLoader worker", err.where)[0] if err else ""
        return f"raised {err.type_name if err else 'an error'} {where}", "init_error"
    if why:
        return f"{why}; then {describe_exit(exitcode)}", "recv_error"
    return describe_exit(exitcode), exit_cause(exitcode)


# ---- reports and events --------------------------------------------------------------------------


class DeathReport(NamedTuple):
    """A worker's death (or a hang it was killed for), as the supervisor saw it."""

    pid: int
    exitcode: int | None
    cause: str  # "was killed by SIGKILL", "hung (no result for 5 s: task_timeout)", ...
    key: str  # the cause's category, for statistics().respawns_by_cause
    was_ready: bool  # it had started (run worker_init_fn); a death before is a failed start


class Arrived(NamedTuple):
    """Event: a task's result from ``slot`` (events keep the order received)."""

    slot: WorkerSlot
    msg: Result


class Died(NamedTuple):
    """Event: ``slot``'s worker died or hung (and was killed); the slot is now DEAD."""

    slot: WorkerSlot
    report: DeathReport


class Lost(NamedTuple):
    """Event: a task's result from ``slot`` arrived whole but could not be rebuilt in this
    process (``msg.error``). Not a death: the worker goes on; recovery names the task."""

    slot: WorkerSlot
    msg: Undecodable


Event = Arrived | Died | Lost
