"""The private torch APIs the package relies on, checked once at import.

torch makes no promise about names that start with an underscore, so a torch release may move or
drop any of them. Without this check the failure would surface far from its cause: as an
``AttributeError`` inside a worker while it sends its first batch, or as a crash report naming
a sample. Here it is an ``ImportError`` that names the installed torch, the missing API and the
torch versions this package is tested with.
"""

from __future__ import annotations

import importlib
from typing import Any

# What pyproject.toml declares; keep the two in step.
TESTED_TORCH = ">=2.13,<2.14"

# (module, dotted attribute path, what we use it for). A ``None`` path asks only that the
# module imports.
PRIVATE_APIS: tuple[tuple[str, str | None, str], ...] = (
    ("torch", "UntypedStorage._new_shared_fd_cpu", "receiving a batch's shared-memory fds"),
    ("torch", "UntypedStorage._share_fd_cpu_", "sending a batch's shared-memory fds"),
    ("torch", "UntypedStorage._shared_decref", "giving back a batch that was not sent"),
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
