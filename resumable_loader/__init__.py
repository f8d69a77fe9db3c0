"""resumable_loader: a drop-in torch DataLoader for long, preemptible training jobs.

Save ``loader.state_dict()`` next to the model; after a preemption build the loader again,
``load_state_dict()`` it, and the next batch is exactly the one the uninterrupted run would
have produced. Workers that die or hang are replaced and their tasks re-sent.

This is the one drawing of the pipeline (docs/internals.md walks along it); each box names its
module, in the order a batch meets them.

 sampler / batch_sampler ──► task source ──► dispatcher ──► task pipe ──► worker process
  (_sampling: the epoch's    (_tasks: map     (_dispatch:    (_taskpipe:   (_worker: per-task
   order; position is        batches or a     the table of   one per       seeded RNGs, fetch,
   state)                    stream's shards; outstanding    worker; a     collate into the
                             assignment, what tasks; Epoch,  task in one   granted segment,
                             a death does,    TaskMsg, re-sends) write)    send)
                             the position)                                       │
 user ◄── reorder buffer ◄── pin thread ◄── result socket (one per worker) ◄─────┘
        (_reorder: releases    (_pin:        (transport/framing: the frame, tensors' fds
         ids in order, drops    optional)     in-band, never blocks; a result carries its
         duplicates)                          stream state delta; reducers: how storages
                                              travel; pools: the loader's shared-memory
                                              segments, LoaderPool, lent task by task, their
                                              fds sent the other way; policy: a full /dev/shm)

 iterators (_iterators): one epoch's wiring of the stages above; the loader (_loader) builds
   it from an EpochSetup, and keeps its Cursor.
 supervisor (_supervisor): waits on every result socket, process sentinel and a SIGCHLD
   wake-up pipe, polls liveness, enforces task_timeout; reports results and deaths as typed
   events (Arrived, Died; Lost: a result that came whole and cannot be rebuilt).
 recovery (_recovery): turns a death report into decisions -- blame, attempts, poison or
   skip, respawn, EPOCH, re-send (where to, the task source says) -- which the iterator only
   sees as items or a fatal error; a lost result into the error at its task's position.
 lifecycle (_lifecycle): the iterator's states (open → finished / abandoned / broken / closed)
   and the Cursor: the position, read from the reorder buffer, dispatcher and task source,
   frozen when the iterator ends, kept by the loader until the next iter().
 state (_schema: plain-data state, ResumePoint.to_state / from_state; _codec: its bytes;
   _checkpoint: save_checkpoint, an atomic write of a checkpoint file; _fingerprint: the data
   a state was taken on -- class, length, fingerprint() -- and what changed since).
 messages (_protocol): every message between the main process and a worker, typed, and the
   one Status enum of results and deliveries.
 ranks (_distributed): torch's DistributedSampler cut into shards and re-cut for another world
   size; the global state gathered under torch.distributed.checkpoint.
 plans (_mixture): a Mixture of named map-style sources, a dataset whose position -> (source,
   index) is arithmetic on (seed, weights history, global position): no iterator state.

With num_workers=0 the same state contract holds, with no processes: the main process fetches
each task itself, under the same per-task seeds (its own RNG streams saved and restored).
"""

from .core.compat import check_torch as _check_torch

# Before the modules that import torch's private APIs, so a torch without them gets one clear
# ImportError instead of an AttributeError deep in a worker.
_check_torch()

from .core.errors import CheckpointError, LoaderClosedError, WorkerCrashError  # noqa: E402
from .loader.dataloader import DataLoader  # noqa: E402
from .pipeline.fetch import RetryPolicy  # noqa: E402
from .pipeline.stats import LoaderStatistics  # noqa: E402
from .plans.mixture import Mixture  # noqa: E402
from .state.checkpoint import save_checkpoint  # noqa: E402
from .state.codec import dump_state, load_state  # noqa: E402
from .state.ranks import merge_rank_states  # noqa: E402
from .state.skip import skip_samples  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "DataLoader",
    "LoaderClosedError",
    "LoaderStatistics",
    "Mixture",
    "RetryPolicy",
    "WorkerCrashError",
    "__version__",
    "dump_state",
    "load_state",
    "merge_rank_states",
    "save_checkpoint",
    "skip_samples",
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
