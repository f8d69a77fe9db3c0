"""resumable_loader: a drop-in torch DataLoader for long, preemptible training jobs.

Save ``loader.state_dict()`` next to the model; after a preemption build the loader again,
``load_state_dict()`` it, and the next batch is exactly the one the uninterrupted run would
have produced. Workers that die or hang are replaced and their tasks re-sent.
"""

from ._codec import dump_state, load_state
from ._errors import CheckpointError, LoaderClosedError, WorkerCrashError
from ._loader import DataLoader, RetryPolicy
from ._stats import LoaderStatistics

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
]
