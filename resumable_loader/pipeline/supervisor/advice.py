"""What the supervisor tells the user in words of its own: the warning for a worker that could
not be started (its first words are torch's, which scripts match), the warning for a
worker_init_fn that seeds torch, and the respawn storm's error.

Kept apart from the mechanics so that the wording can be read, and kept, in one place: tests
and users' scripts match it.
"""

from __future__ import annotations

import collections
import os
import sys
import warnings

# The package's own folder (resumable_loader/, three up from here): a warning is meant for the
# user's line, past every frame of ours in whichever layer it is.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def warn_unpicklable(method: str, error: BaseException) -> None:
    """Say, as torch does (its first words, which scripts match), that a worker could not be
    started because what it needs could not be pickled; the error itself follows."""
    warnings.warn(
        "Got pickle error when attempting to start a worker Process: the "
        f"{method!r} start method sends the dataset, collate_fn and worker_init_fn to each "
        f"worker by pickling, and that failed ({type(error).__name__}: {error}). Make them "
        "picklable (module-level classes and functions, no lambdas or open handles), or use "
        "multiprocessing_context='fork' where it is available.",
        stacklevel=_outside_the_package(),
    )


def _outside_the_package() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside this package."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        _PACKAGE_DIR
    ):
        frame, level = frame.f_back, level + 1
    return level


def warn_seeding() -> None:
    """Say once that the loader re-seeds every batch, so a worker_init_fn's seed is overridden."""
    warnings.warn(
        "worker_init_fn called torch.manual_seed(): the loader seeds python's random, numpy and "
        "torch again before every batch, from (epoch seed, batch), so that a batch has the same "
        "values after a resume whichever worker loads it. That seeding overrides your draws while "
        "batches are loaded (torch.initial_seed() still reports your seed). To choose "
        "the randomness, seed the loader instead: DataLoader(..., "
        "generator=torch.Generator().manual_seed(s)).",
        RuntimeWarning,
        # At the user's loop (the next() that saw the worker's report), as the loader's
        # other warnings are: a filter by module, and the line in a log, are then the user's.
        stacklevel=_outside_the_package(),
    )


def storm_message(
    respawns: int, causes: collections.Counter[str], last: str, task_timeout: float | None
) -> str:
    """The respawn storm's error: ``respawns`` without a result in between, their ``causes``
    (``DeathReport.key`` -> count) and the ``last`` death in words."""
    said = ", ".join(f"{key} x{count}" for key, count in causes.most_common())
    head = f"respawn storm: {respawns} worker respawns without a single result in between"
    head += f" (causes: {said}; last: {last})" if said else ""
    hangs = causes["hang"]
    if hangs * 2 > sum(causes.values()):
        # We killed them: saying they died would send the user looking for an OOM killer.
        return (
            f"{head}. {hangs} of them were not deaths: the loader killed the workers as "
            f"hung, because they did not start or deliver a batch within "
            f"task_timeout={task_timeout:g} s of running time. If the workers are "
            "merely slow (a slow worker_init_fn, stream restore or batch; a machine that "
            "swaps), raise task_timeout above the time a worker needs to start and load a "
            "batch there."
        )
    return (
        f"{head}: workers are dying faster than they can do work. Check the worker logs / "
        "dmesg for the OOM killer, lower num_workers or memory use."
    )
