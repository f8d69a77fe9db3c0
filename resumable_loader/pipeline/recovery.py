"""What a worker's death means for the epoch: blame, attempts, poison or skip, respawn, re-send.

The supervisor notices a death (or a hang it killed) and reports it; ``Recovery.on_death``
decides what follows and carries it out on the supervisor and the dispatcher:

    death report ──► blame: the task the worker was running (none if it never got ready)
                 ──► attempts: that task's failures += 1; at max_task_attempts it is poison:
                       on_poison="raise": a WorkerCrashError at its position in the stream
                       on_poison="skip":  a skipped task, with a warning
                       (a stream's shard cannot get past it: that worker's stream ends here)
                 ──► a start that failed with an exception of the user's (worker_init_fn, or
                     restoring the stream): raised as the user's own error, as torch does --
                     unless the RetryPolicy names it as transient, then it counts as below
                 ──► start failures: at max_task_attempts in a row, the epoch is broken
                 ──► respawn the same worker id (a respawn storm is fatal), send it the epoch,
                     re-send its tasks (map-style tasks go to any ready worker at once)

    a result that arrived whole but cannot be rebuilt here (``on_lost``) is no death: the
    worker goes on, nothing is retried (it would come back the same), and a WorkerCrashError
    naming the task, its samples and the worker goes to that task's position

The iterator only sees the ``Outcome``: items to put into the reorder buffer at their task's
position (errors, skips, stream ends) or a fatal error to break with.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, field

from ..core.errors import WorkerCrashError
from .dispatch import Dispatcher, Task
from .protocol import Delivery, Status, WorkerError
from .stats import Counters
from .supervisor.events import DeathReport
from .supervisor.slots import WorkerSlot
from .supervisor.supervisor import Supervisor

log = logging.getLogger("resumable_loader")

# The statuses recovery decides (see pipeline.protocol.Status), importable from here too.
POISON, SKIPPED = Status.POISON, Status.SKIPPED


@dataclass
class Outcome:
    """What the iterator must do after a death.

    Attributes:
        deliver: (task id, reorder item) pairs to release at those positions.
        fatal: the epoch cannot go on: raise this (its ``__cause__`` set), or None.
    """

    deliver: list[tuple[int, Delivery]] = field(default_factory=list)
    fatal: BaseException | None = None


def torch_words(report: DeathReport) -> str:
    """torch's own sentence for this death, which scripts and tests match on ("" for a hang,
    which torch has no words for)."""
    code = report.exitcode
    if code is None or report.key == "hang":
        return ""
    if code < 0:
        try:
            name = signal.strsignal(-code) or f"signal {-code}"
        except ValueError:
            name = f"signal {-code}"
        return f"DataLoader worker (pid {report.pid}) is killed by signal: {name}."
    return f"DataLoader worker (pid {report.pid}) exited unexpectedly with exit code {code}."


class Recovery:
    """Turns death reports into decisions for one epoch's pipeline.

    Args:
        sup: the supervisor (``respawn``, ``ctx``).
        disp: the dispatcher (the task table, ``send_epoch``) and its task source (where a
            dead worker's tasks go; what poison does to a stream's shard).
        epoch: for messages.
        max_attempts: deaths a task may cause before it is poison; failed starts in a row a
            worker slot may have before the epoch is broken.
        on_poison: "raise" or "skip".
        counters: the loader's statistics counters.
        start_method: the multiprocessing start method (for advice in errors).
        transient: exception types a RetryPolicy names: a worker_init_fn raising one of these
            is started again (a failed start); any other is raised as it is.
    """

    def __init__(
        self,
        sup: Supervisor,
        disp: Dispatcher,
        *,
        epoch: int,
        max_attempts: int,
        on_poison: str,
        counters: Counters,
        start_method: str,
        transient: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.sup = sup
        self.disp = disp
        self.source = disp.source
        self.epoch = epoch
        self.max_attempts = max_attempts
        self.on_poison = on_poison
        self.counters = counters
        self.start_method = start_method
        self.transient = transient

    def on_death(self, slot: WorkerSlot, report: DeathReport) -> Outcome:
        out = Outcome()
        blamed, tids = self.disp.on_death(slot)
        if slot.init_error is not None and not self._is_transient(slot.init_error):
            # The user's code raised (worker_init_fn, or the stream's iter()/load_state_dict()
            # when the epoch began): a bug report, not a crash. Raised as torch does, with its
            # type, message and the worker's traceback; no respawn, no task blamed.
            out.fatal = slot.init_error.exception()
            return out
        if not report.was_ready or slot.init_error is not None:
            # It never ran a task: its start failed, and no task is to blame.
            slot.start_failures += 1
            where = f" while starting (holding {self.source.describe(blamed)})" if blamed else ""
            blamed = None
        else:
            where = f" while loading {self.source.describe(blamed)}" if blamed else ""
        line = f"worker {slot.wid} (pid {report.pid}) {report.cause}{where}"
        log.warning("DataLoader %s", line)
        if blamed is not None:
            blamed.failures.append(line)
            if len(blamed.failures) >= self.max_attempts:
                self._poison(slot, blamed, report, out)
        if slot.start_failures >= self.max_attempts:
            out.fatal = self._failed_start(slot, report, line)
            return out
        try:
            self.sup.respawn(slot, report)
        except WorkerCrashError as storm:
            out.fatal = WorkerCrashError(str(storm) + _in_torchs_words(report), attempts=(line,))
            return out
        self.counters.respawns_by_cause[report.key] += 1
        self.disp.send_epoch(slot)
        out.deliver.extend(self.source.after_respawn(self.disp, slot))
        self._log_resent(slot, report, [t for t in tids if t in self.disp.tasks])
        return out

    def on_lost(
        self, slot: WorkerSlot, tid: int, error: BaseException, blame: str
    ) -> list[tuple[int, Delivery]]:
        """Task ``tid``'s result came from ``slot`` whole, and unpickling it here raised
        ``error`` (``blame``: whose failure that most likely is): what to deliver. The worker
        is healthy and keeps its other tasks; the task is not sent again (its result would be
        the same), whatever ``on_poison`` says -- like an exception of the dataset, the error
        goes to the task's position and the iterator goes on. A stream's shard ends there, as
        after a poison task: the result held its state, and a shard cannot resume past a state
        it never read."""
        task = self.disp.tasks.get(tid)
        if task is None or task.worker != slot.wid:
            return []  # a duplicate of a result already taken, or a task given up
        what = self.source.describe(task)
        line = (
            f"worker {slot.wid} (pid {slot.pid}) sent the result of {what}, and it could not "
            f"be rebuilt in the main process ({type(error).__name__}: {error})"
        )
        log.warning("DataLoader %s", line)
        message = (
            f"DataLoader could not rebuild the result of {what} of epoch {self.epoch}: worker "
            f"{slot.wid} (pid {slot.pid}) loaded it and sent it whole, and unpickling it in the "
            f"main process raised {type(error).__name__}: {error}. The worker did not fail and "
            f"goes on; the batch is given up, not loaded again. {blame}"
        )
        self.disp.drop(tid)
        extra, ends = self.source.poisoned(self.disp, slot)
        if extra is not None:
            message += (
                f" Worker {slot.wid}'s stream ends here this epoch: the lost result held its "
                "state, and a stream cannot resume past a state it never read."
            )
        err = WorkerCrashError(message, task_id=tid, indices=task.payload, attempts=(line,))
        err.__cause__ = error
        return [*ends, (tid, Delivery(POISON, err, extra))]

    def _is_transient(self, err: WorkerError) -> bool:
        return err.exc_type is not None and issubclass(err.exc_type, self.transient)

    def _failed_start(self, slot: WorkerSlot, report: DeathReport, line: str) -> WorkerCrashError:
        if report.key == "hang":
            advice = "; if worker_init_fn is merely slow, raise task_timeout above its run time"
        elif slot.init_error is None and self.start_method != "fork":
            advice = (
                "; under spawn/forkserver a worker re-imports the main module, so guard the "
                "script's top level with `if __name__ == '__main__':`"
            )
        else:
            advice = ""
        err = WorkerCrashError(
            f"DataLoader worker {slot.wid} failed to start {slot.start_failures} times in a "
            f"row (last: pid {report.pid} {report.cause}). Fix worker_init_fn or the worker "
            f"environment{advice}. The loader's state_dict() still describes what was consumed."
            + _in_torchs_words(report),
            attempts=(line,),
        )
        if slot.init_error is not None:
            err.__cause__ = slot.init_error.exception()
        return err

    def _poison(self, slot: WorkerSlot, task: Task, report: DeathReport, out: Outcome) -> None:
        attempts = tuple(task.failures)
        indices = task.payload
        if report.key == "hang":
            # The worker did not crash: we killed it, and the task may merely be slow.
            advice = (
                "\nThe task ran past task_timeout each time (the loader killed its worker as "
                "hung): if it is merely slow, raise task_timeout; if it hangs (a read that never "
                "returns), remove or repair the sample, or build the loader with "
                "on_poison='skip' to skip such tasks."
            )
        else:
            advice = (
                "\nThe sample probably crashes its decoder or exhausts memory: remove or repair "
                "it, or build the loader with on_poison='skip' to skip such tasks."
            )
        message = (
            f"DataLoader gave up on {self.source.describe(task)} of epoch {self.epoch}: it "
            f"killed the worker {len(attempts)} times (max_task_attempts={self.max_attempts}):"
            "\n  " + "\n  ".join(attempts) + advice + _in_torchs_words(report)
        )
        self.disp.drop(task.tid)
        extra, ends = self.source.poisoned(self.disp, slot)
        out.deliver.extend(ends)
        if self.on_poison == "skip":
            item = Delivery(SKIPPED, (task.tid, indices, message + " (skipped)"), extra)
        else:
            err = WorkerCrashError(message, task_id=task.tid, indices=indices, attempts=attempts)
            item = Delivery(POISON, err, extra)
        out.deliver.append((task.tid, item))

    def _log_resent(self, slot: WorkerSlot, report: DeathReport, live: list[int]) -> None:
        self.counters.resent_tasks += len(live)
        if not live:
            log.info(
                "DataLoader worker %d: pid %d -> %d (%s)",
                slot.wid,
                report.pid,
                slot.pid,
                report.key,
            )
            return
        log.info(
            "DataLoader worker %d: pid %d -> %d (%s); re-sending tasks %s (%s %s)",
            slot.wid,
            report.pid,
            slot.pid,
            report.key,
            live,
            self.source.unit,
            [self.disp.tasks[t].payload for t in live],
        )


def _in_torchs_words(report: DeathReport) -> str:
    words = torch_words(report)
    return f"\n(The last death in torch's words: {words})" if words else ""


__all__ = ["POISON", "SKIPPED", "Outcome", "Recovery", "torch_words"]
