"""The private torch, numpy and Python APIs the package relies on, checked once at import, and
the accessors through which the rest of the package reaches every one of them (no other module
reads an underscored name of torch, numpy or Python: tests/package/test_layers.py).

torch makes no promise about names that start with an underscore, so a torch release may move or
drop any of them. Without this check the failure would surface far from its cause: as an
``AttributeError`` inside a worker while it sends its first batch, or as a crash report naming
a sample. Here it is an ``ImportError`` that names the installed torch, the missing API and the
torch versions this package is tested with.
"""

from __future__ import annotations

import ctypes
import importlib
import random
import sys
from collections.abc import Callable
from operator import attrgetter, methodcaller
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
    ("torch", "UntypedStorage._new_shared", "a batch's storages and segments in shared memory"),
    ("torch", "storage._StorageBase._new_shared", "the segment pool falling back to torch's own"),
    ("torch", "UntypedStorage._cdata", "telling a message's storages apart when sending it"),
    ("torch", "_neg_view", "sending a tensor with its lazy negative bit"),
    ("torch", "_C._set_worker_signal_handlers", "clear messages when a worker segfaults"),
    ("torch.utils.data", "DataLoader._auto_collation", "telling batched from unbatched loading"),
    ("torch.utils.data._utils.worker", "WorkerInfo", "get_worker_info() inside our workers"),
    ("torch.utils.data._utils.worker", "_worker_info", "get_worker_info() inside our workers"),
    ("torch.utils.data._utils.pin_memory", "pin_memory", "pin_memory=True"),
    ("torch.multiprocessing.reductions", "reduce_storage", "the file_system sharing strategy"),
)

# Private attributes that only an instance has (no class attribute to look for): (module,
# class, arguments that make an instance, attribute, what we use it for).
PRIVATE_INSTANCE_APIS: tuple[tuple[str, str, tuple[Any, ...], str, str], ...] = (
    (
        "torch.utils.data",
        "RandomSampler",
        (range(1),),
        "_num_samples",
        "telling a RandomSampler given num_samples from one that draws its data source's length",
    ),
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


def _missing_on_instance(module: str, cls: str, args: tuple[Any, ...], attr: str) -> str | None:
    """``module.cls(*args).attr`` when an instance made so lacks ``attr`` (or cannot be made),
    else None."""
    name = f"{module}.{cls}().{attr}"
    try:
        return None if hasattr(getattr(importlib.import_module(module), cls)(*args), attr) else name
    except Exception:
        return name


def check_torch(
    apis: tuple[tuple[str, str | None, str], ...] = PRIVATE_APIS,
    instance_apis: tuple[tuple[str, str, tuple[Any, ...], str, str], ...] = PRIVATE_INSTANCE_APIS,
) -> None:
    """Raise ImportError if the installed torch lacks a private API the package uses.

    Raises:
        ImportError: naming the installed torch version, each missing API and what it is used
            for, and the tested torch versions.
    """
    missing = [
        f"{name} (used for {purpose})"
        for module, path, purpose in apis
        if (name := _missing(module, path)) is not None
    ] + [
        f"{name} (used for {purpose})"
        for module, cls, args, attr, purpose in instance_apis
        if (name := _missing_on_instance(module, cls, args, attr)) is not None
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
    ("ctypes", "_memmove_addr", "copying RNG states while holding the GIL"),
    ("multiprocessing.reduction", "ForkingPickler._extra_reducers", "pickling a batch"),
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


# numpy's, checked the same way (as ``check_torch`` does, but naming numpy).
PRIVATE_NUMPY_APIS: tuple[tuple[str, str | None, str], ...] = (
    ("numpy.random.mtrand", "_rand", "saving and seeding numpy's global RNG in each task"),
    ("numpy.random", "RandomState._bit_generator", "saving and seeding numpy's global RNG"),
)


def check_numpy(apis: tuple[tuple[str, str | None, str], ...] = PRIVATE_NUMPY_APIS) -> None:
    """Raise ImportError if the installed numpy lacks a private API the package uses.

    Raises:
        ImportError: naming the installed numpy version and each missing API and what it is
            used for.
    """
    missing = [
        f"{name} (used for {purpose})"
        for module, path, purpose in apis
        if (name := _missing(module, path)) is not None
    ]
    if missing:
        import numpy

        raise ImportError(
            f"resumable_loader does not work with the installed numpy {numpy.__version__}: it "
            "lacks " + "; ".join(missing) + "."
        )


# Checked when the package is imported (it imports this module first).
check_python()
check_numpy()


# ---- accessors ----


def python_random_instance() -> random.Random:
    """The ``random.Random`` behind the ``random`` module's functions (``random._inst``): its
    state is what ``random.getstate()`` reads. Looked up on each call: a program may replace
    it."""
    return random._inst


def memmove_address() -> int:
    """The address of C's ``memmove`` (``ctypes._memmove_addr``), for a ``ctypes.PYFUNCTYPE``
    over it: ``ctypes.memmove`` itself releases the GIL while it copies."""
    return ctypes._memmove_addr  # type: ignore[attr-defined]


def forking_pickler_reducers() -> dict[Any, Any]:
    """The reducers registered with ``ForkingPickler.register`` (torch registers its tensor
    and storage reducers there), as the live dict: a reducer registered later is in it."""
    from multiprocessing.reduction import ForkingPickler

    return ForkingPickler._extra_reducers  # type: ignore[attr-defined]


def numpy_global_rng() -> tuple[Any, Any]:
    """numpy's global ``RandomState`` (``numpy.random.mtrand._rand``: what ``np.random.seed``
    and ``np.random.rand`` use) and its bit generator. Looked up on each call: a program may
    replace either."""
    import numpy as np

    rand = np.random.mtrand._rand
    return rand, rand._bit_generator


# A ``RandomState``'s bit generator, read as a C attribute lookup (no Python call).
numpy_bit_generator: Callable[[Any], Any] = attrgetter("_bit_generator")


def random_sampler_num_samples(sampler: Any) -> int | None:
    """The ``num_samples`` a torch ``RandomSampler`` was given, or None where it draws its
    data source's length (its public ``num_samples`` cannot tell the two apart)."""
    return sampler._num_samples


def set_worker_signal_handlers() -> None:
    """torch's handlers that print a clear message when a worker dies of SIGSEGV or SIGBUS
    (what torch's own workers install)."""
    import torch

    torch._C._set_worker_signal_handlers()


# ---- accessors: shared-memory storages ----
# Hot paths (a batch's every storage) bind these once at import: ``share_fd = storage_share_fd()``.


def storage_share_fd() -> Callable[[Any], tuple[int, int]]:
    """``f(storage)``: ``storage._share_fd_cpu_()``, which moves the storage into shared memory
    if it is not there and returns (its fd, its size); the fd stays the storage's. Looked up on
    the storage at each call (in C): ``testing.ShmFailure`` replaces it in a worker."""
    return methodcaller("_share_fd_cpu_")


def storage_from_fd() -> Callable[[int, int], Any]:
    """``UntypedStorage._new_shared_fd_cpu``: ``f(fd, nbytes)`` maps a storage over a shared
    fd, keeping a duplicate of the fd for the storage's life."""
    import torch

    return torch.UntypedStorage._new_shared_fd_cpu  # type: ignore[attr-defined]


def storage_shared_decref() -> Callable[[Any], Any]:
    """``f(storage)``: ``storage._shared_decref()``, which gives back the reference the shm
    manager took when the storage was shared for sending."""
    return methodcaller("_shared_decref")


def storage_identity() -> Callable[[Any], int]:
    """``f(storage)``: the address of the storage's StorageImpl (``_cdata``), the same for
    every tensor and Python object of one storage."""
    return attrgetter("_cdata")


def neg_view() -> Callable[[Any], Any]:
    """``torch._neg_view``: a view of a tensor with its lazy negative bit flipped."""
    import torch

    return torch._neg_view


def new_shared(nbytes: int) -> Any:
    """A new CPU storage of ``nbytes`` in shared memory, as a collate in a worker makes one
    (``UntypedStorage._new_shared``): looked up on each call, so that it goes through the
    worker's segment pool while that is installed (``replace_new_shared``)."""
    import torch

    return torch.UntypedStorage._new_shared(nbytes)


def torch_new_shared() -> Callable[..., Any]:
    """torch's own ``_new_shared`` as a plain function ``f(cls, nbytes, *, device)``, whatever
    replaced it on ``UntypedStorage`` since."""
    import torch

    return torch.storage._StorageBase.__dict__["_new_shared"].__func__


def new_shared_replaced() -> bool:
    """Whether ``replace_new_shared`` already ran in this process."""
    import torch

    return "_new_shared" in torch.UntypedStorage.__dict__


def replace_new_shared(fn: Callable[..., Any]) -> None:
    """Make ``fn(cls, nbytes, *, device)`` what ``UntypedStorage._new_shared`` calls in this
    process (what ``default_collate`` in a worker allocates its output with)."""
    import torch

    torch.UntypedStorage._new_shared = classmethod(fn)  # type: ignore[assignment,method-assign]


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
