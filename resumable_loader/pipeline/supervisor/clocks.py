"""The hang clocks: when a worker counts as hung under ``task_timeout``, and the time taken
off those clocks because the job, not the worker, did not run.

``task_timeout`` counts a job's running time. A pause of this process (a wait that overran, a
SIGCONT) is taken off every hang clock, so a job stopped as a whole and continued loses no
worker (``discount_pauses``). Nor is a worker's own wait for a CPU on a busy machine counted
(its run-queue delay, ``credit_cpu_wait``): a worker that is ready to run and not given the CPU
is not hung, it is starved. A slot's clocks are ``busy_since`` (its oldest task, once READY)
and ``start_since`` (its start, then its BOOTED message); ``hang_clock`` says which one runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from .cpu import cpu_figures
from .hooks import Continued
from .slots import READY_STATE, STARTING, WorkerSlot

# With task_timeout set, a starting worker is hung once worker_init_fn has run for
# task_timeout, or once it has shown no sign of life (BOOTED) for max(task_timeout, this):
# booting under spawn/forkserver imports torch and unpickles the dataset, seconds normally and
# more on a loaded machine; a minute of silence is a stuck import or a stopped process.
BOOT_TIMEOUT_S = 60.0
# A wait in poll() that overran what it asked for by more than this was a pause of this process
# (stopped, frozen, a suspended VM) rather than a late wake-up on a busy machine; the overrun
# is not counted towards task_timeout. A quarter second is far above a scheduler's delay.
PAUSE_SLACK_S = 0.25


def hang_clock(slot: WorkerSlot, timeout: float | None) -> tuple[float, str] | None:
    """When a slot counts as hung (monotonic time) and how to say so; None if never."""
    if timeout is None:
        return None
    if slot.state == READY_STATE:
        if not slot.outstanding:
            return None
        return slot.busy_since + timeout, f"hung (no result for {timeout:g} s: task_timeout)"
    if slot.state != STARTING:
        return None
    if slot.booted:
        why = f"hung in worker_init_fn (not ready after {timeout:g} s: task_timeout)"
        return slot.start_since + timeout, why
    limit = max(timeout, BOOT_TIMEOUT_S)
    return slot.start_since + limit, f"hung while starting (no sign of life for {limit:g} s)"


def discount_pauses(
    slots: Iterable[WorkerSlot], start: float, now: float, asked: float | None
) -> float:
    """Take the time this process did not run between ``start`` and ``now`` (its last look and
    this one) off the hang clocks of ``slots``; return that time (0.0: none).

    A worker is hung when it makes no progress while the rest of the job runs; a paused job
    (stopped as a whole, frozen, a suspended VM) is not a hung one, and its pause must not
    turn into a kill, a poison task or a skip. The pause is seen two ways: a wait that
    overran what it ``asked`` for (by more than PAUSE_SLACK_S), and a SIGCONT received
    since the last look (everything before it counts as paused). ``asked`` is None for the
    time between two looks, spent in the user's code, which counts as running unless a
    SIGCONT came.
    """
    paused = 0.0
    if asked is not None and now - start - asked > PAUSE_SLACK_S:
        paused = now - start - asked
    resumed = Continued.last
    if resumed > start:
        paused = max(paused, min(resumed, now) - start)
    if paused <= 0.0:
        return 0.0
    end = start + paused  # the paused stretch, counted from the start of the interval
    for slot in slots:
        # A clock started before the pause moves on by all of it; one started inside it,
        # by the part after its start.
        slot.busy_since += max(0.0, end - max(slot.busy_since, start))
        slot.start_since += max(0.0, end - max(slot.start_since, start))
    return paused


def mark_cpu_wait(slot: WorkerSlot, task_timeout: float | None) -> None:
    """A hang clock of ``slot`` (re)started now: note its CPU figures so far (one read of
    /proc per start of a clock, and only with task_timeout set)."""
    if task_timeout is not None and slot.pid > 0:
        slot.cpu = cpu_figures(slot.pid, state=False)
        slot.cpu_seen = time.monotonic()


def credit_cpu_wait(slot: WorkerSlot) -> bool:
    """Take the time ``slot``'s worker waited for a CPU since its clock started off its
    hang clocks; True if that moved them.

    A worker is hung when it makes no progress while the rest of the job runs. One that is
    runnable but not scheduled (a machine with more busy processes than cores) is the rest
    of the job not running, for it: on a loaded machine a start or a batch that takes a
    few milliseconds of CPU can take seconds on the clock, and killing it for that kills
    its replacement too, until the storm guard ends the epoch. A stopped worker, one
    blocked in a read, or one spinning on a CPU it gets, waits for no CPU: it is still
    found after task_timeout of running time. Looked at only when a clock has run out.
    (A stretch that is also one of this process's pauses, ``discount_pauses``, or a wait
    that began before the clock started, may be taken off twice: a hang is then found up
    to that much later, never sooner.)
    """
    before, seen = slot.cpu, slot.cpu_seen
    now = time.monotonic()
    figures = cpu_figures(slot.pid) if before is not None else None
    if before is None or figures is None:
        return False
    # Waits that ended (the kernel adds a wait when the CPU is given)...
    credit = max(0, figures.waited - before.waited) / 1e9
    if figures.runnable and figures.ran == before.ran:
        # ...and the one in progress: runnable now and not run since the last look. Noted
        # as waited, so that it is not credited again once the kernel counts it.
        ongoing = max(0.0, now - seen)
        credit += ongoing
        figures = figures._replace(waited=max(figures.waited, before.waited) + int(ongoing * 1e9))
    slot.cpu, slot.cpu_seen = figures, now
    if credit <= 0:
        return False
    slot.busy_since += credit
    slot.start_since += credit
    return True
