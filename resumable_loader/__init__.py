"""resumable_loader: a drop-in torch DataLoader for long, preemptible training jobs.

Save ``loader.state_dict()`` next to the model; after a preemption build the loader again,
``load_state_dict()`` it, and the next batch is exactly the one the uninterrupted run would
have produced. Workers that die or hang are replaced and their tasks re-sent.
"""

from ._compat import check_torch as _check_torch

# Before the modules that import torch's private APIs, so a torch without them gets one clear
# ImportError instead of an AttributeError deep in a worker.
_check_torch()

from ._codec import dump_state, load_state  # noqa: E402
from ._distributed import merge_rank_states  # noqa: E402
from ._errors import CheckpointError, LoaderClosedError, WorkerCrashError  # noqa: E402
from ._loader import DataLoader, RetryPolicy  # noqa: E402
from ._stats import LoaderStatistics  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "DataLoader",
    "LoaderClosedError",
    "LoaderStatistics",
    "RetryPolicy",
    "WorkerCrashError",
    "__version__",
    "dump_state",
    "load_state",
    "merge_rank_states",
]


def _claim_public_names() -> None:
    """Public objects say they are ``resumable_loader``'s, not a private module's, so that
    tracebacks, reprs and docs name ``resumable_loader.WorkerCrashError``. Pickling by reference
    still works: the package exports each under that name."""
    for name in __all__:
        obj = globals()[name]
        if getattr(obj, "__module__", "").startswith("resumable_loader."):
            obj.__module__ = __name__


_claim_public_names()
