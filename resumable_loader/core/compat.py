"""The private torch and Python APIs the package relies on, checked once at import, and the
accessors through which the package reaches the ones it replaces or reads as a whole.

torch makes no promise about names that start with an underscore, so a torch release may move or
drop any of them. Without this check the failure would surface far from its cause: as an
``AttributeError`` inside a worker while it sends its first batch, or as a crash report naming
a sample. Here it is an ``ImportError`` that names the installed torch, the missing API and the
torch versions this package is tested with.
"""

from __future__ import annotations

import importlib
import random
import sys
from collections.abc import Callable
from typing import Any

# What pyproject.toml declares; keep the two in step.
TESTED_TORCH = ">=2.13,<2.14"

# (module, dotted attribute path, what we use it for). A ``None`` path asks only that the
# module imports.
PRIVATE_APIS: tuple[tuple[str, str | None, str], ...] = (
    ("torch", "UntypedStorage._new_shared_fd_cpu", "receiving a batch's shared-memory fds"),
    ("torch", "UntypedStorage._share_fd_cpu_", "sending a batch's shared-memory fds"),
    ("torch", "UntypedStorage._shared_decref", "giving back a batch that was not sent"),
    ("torch", "UntypedStorage._new_using_fd_cpu", "a worker's batches in anonymous memory"),
    ("torch", "UntypedStorage._new_using_filename_cpu", "testing.ShmFailure (file_system)"),
    ("torch", "_C._set_worker_signal_handlers", "clear messages when a worker segfaults"),
    ("torch.utils.data", "DataLoader._auto_collation", "telling batched from unbatched loading"),
    ("torch.utils.data._utils.worker", "WorkerInfo", "get_worker_info() inside our workers"),
    ("torch.utils.data._utils.worker", "_worker_info", "get_worker_info() inside our workers"),
    ("torch.utils.data._utils.pin_memory", "pin_memory", "pin_memory=True"),
    ("torch.multiprocessing.reductions", "reduce_storage", "the file_system sharing strategy"),
)


def _missing(module: str, path: str | None) -> str | None:
    """The first name of ``module.path`` that cannot be found, or None when all are there."""
    try:
        obj: Any = importlib.import_module(module)
    except ImportError:
        return module
    found = module
    for part in (path or "").split(".") if path else ():
        if not hasattr(obj, part):
            return f"{found}.{part}"
        obj = getattr(obj, part)
        found = f"{found}.{part}"
    return None


def check_torch(apis: tuple[tuple[str, str | None, str], ...] = PRIVATE_APIS) -> None:
    """Raise ImportError if the installed torch lacks a private API the package uses.

    Raises:
        ImportError: naming the installed torch version, each missing API and what it is used
            for, and the tested torch versions.
    """
    missing = [
        f"{name} (used for {purpose})"
        for module, path, purpose in apis
        if (name := _missing(module, path)) is not None
    ]
    if not missing:
        return
    import torch

    raise ImportError(
        f"resumable_loader does not work with the installed torch {torch.__version__}: it lacks "
        + "; ".join(missing)
        + f". resumable_loader is tested with torch{TESTED_TORCH}; install a torch in that range "
        "(pip install 'torch" + TESTED_TORCH + "')."
    )


# Python's own, checked the same way (as ``check_torch`` does, but naming Python).
PRIVATE_PYTHON_APIS: tuple[tuple[str, str | None, str], ...] = (
    ("random", "_inst", "saving and seeding python's random in each task"),
)


def check_python(apis: tuple[tuple[str, str | None, str], ...] = PRIVATE_PYTHON_APIS) -> None:
    """Raise ImportError if this Python lacks a private API the package uses.

    Raises:
        ImportError: naming the Python version and each missing API and what it is used for.
    """
    missing = [
        f"{name} (used for {purpose})"
        for module, path, purpose in apis
        if (name := _missing(module, path)) is not None
    ]
    if missing:
        raise ImportError(
            f"resumable_loader does not work with this Python ({sys.version.split()[0]}): it "
            "lacks " + "; ".join(missing) + "."
        )


# Checked when the package is imported (it imports this module first).
check_python()


# ---- accessors ----


def python_random_instance() -> random.Random:
    """The ``random.Random`` behind the ``random`` module's functions (``random._inst``): its
    state is what ``random.getstate()`` reads. Looked up on each call: a program may replace
    it."""
    return random._inst


# torch's allocator of a new shared CPU storage, by sharing strategy.
_ALLOCATORS = {"file_descriptor": "_new_using_fd_cpu", "file_system": "_new_using_filename_cpu"}


def shared_allocator(strategy: str = "file_descriptor") -> Callable[[int], Any]:
    """torch's allocator of a new CPU storage in shared memory under sharing ``strategy``
    (``UntypedStorage._new_using_fd_cpu``, or ``_new_using_filename_cpu`` for "file_system"),
    bound to the class: ``shared_allocator()(nbytes)`` makes one."""
    import torch

    return getattr(torch.UntypedStorage, _ALLOCATORS[strategy])


def set_shared_allocator(fn: Callable[[Any, int], Any], strategy: str = "file_descriptor") -> None:
    """Make ``fn(cls, nbytes)`` torch's allocator of shared CPU storages under ``strategy`` in
    this process (what ``default_collate`` in a worker and ``share_memory_()`` call)."""
    import torch

    setattr(torch.UntypedStorage, _ALLOCATORS[strategy], classmethod(fn))
