"""What the kernel says of a worker's CPU time: how long its main thread ran, and how long it
was ready to run but waited for a CPU (read from /proc; None on another OS).

The supervisor reads these only when a hang clock starts and when one runs out, to tell a hung
worker (no progress while it could run) from a starved one (runnable, not given a CPU on a
machine with more busy processes than cores): see ``clocks.credit_cpu_wait``.
"""

from __future__ import annotations

from typing import NamedTuple


class CpuFigures(NamedTuple):
    """What the kernel says of a process's main thread and the CPU (``cpu_figures``)."""

    ran: int  # ns it has run on a CPU
    waited: int  # ns it was runnable but waited for a CPU, counted when it got one
    runnable: bool  # running or waiting for a CPU now (False when not asked)


def cpu_figures(pid: int, state: bool = True) -> CpuFigures | None:
    """/proc/<pid>/schedstat, and with ``state`` the state in /proc/<pid>/stat; None where the
    kernel does not say (another OS, or no such process).

    Only the main thread: it runs the tasks. A wait of other threads (a user's thread pool) is
    not seen, so a worker starved that way is judged by the clock alone.
    """
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            ran, waited = (int(x) for x in f.read().split()[:2])
        if not state:
            return CpuFigures(ran, waited, False)
        with open(f"/proc/{pid}/stat", "rb") as f:
            code = f.read().rpartition(b")")[2].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    return CpuFigures(ran, waited, code == b"R")
