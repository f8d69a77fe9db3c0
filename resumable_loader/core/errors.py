"""Exception types.

Two families, kept apart on purpose:

* misuse by the caller (a closed loader, a state from another configuration): ``LoaderClosedError``
  and ``CheckpointError`` -- fix the calling code or the checkpoint;
* failures from outside (a worker killed by the OOM killer, a sample that segfaults its decoder):
  ``WorkerCrashError`` -- the message names the worker, pid, signal and sample indices.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "LoaderClosedError", "RemoteTraceback", "WorkerCrashError"]


class CheckpointError(ValueError):
    """A loader state could not be decoded, or does not fit the loader it is loaded into.

    Raised by :func:`resumable_loader.load_state`, :func:`resumable_loader.dump_state` and
    :meth:`resumable_loader.DataLoader.load_state_dict`. When it is raised by
    ``load_state_dict`` the loader is left exactly as it was.
    """


class WorkerCrashError(RuntimeError):
    """Workers kept dying (or hanging) on the same task, or respawned faster than is sane --
    or a task's result arrived but could not be rebuilt in the main process (its ``__cause__``
    is the unpickling error; the worker was not restarted).

    Attributes:
        task_id: the task (batch number within the epoch) that could not be loaded, if any.
        indices: the sample indices of that task, if known.
        attempts: one human-readable line per failed attempt.
    """

    def __init__(
        self,
        message: str,
        *,
        task_id: int | None = None,
        indices: object = None,
        attempts: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.task_id = task_id
        self.indices = indices
        self.attempts = attempts


class LoaderClosedError(RuntimeError):
    """The loader (or iterator) was used after ``close()``."""


class RemoteTraceback(Exception):
    """Carries the formatted traceback of an exception raised inside a worker process.

    Set as ``__cause__`` of the exception re-raised in the main process, so the worker's frames
    show up in the printed traceback under "The above exception was the direct cause...".
    """

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n" + self.tb
