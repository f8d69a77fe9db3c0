"""resumable_loader: a drop-in torch DataLoader for long, preemptible training jobs.

Save ``loader.state_dict()`` next to the model; after a preemption build the loader again,
``load_state_dict()`` it, and the next batch is exactly the one the uninterrupted run would
have produced. Workers that die or hang are replaced and their tasks re-sent.

The package is in layers, each a folder, each importing only the ones below it (a test,
tests/package/test_layers.py, keeps it so; docs/internals.md, "Layers", has the table):

    core      the exception types; the private torch/python APIs we use, checked at import
    state     the checkpoint format: schema, codec, atomic files, fingerprints, the sample
              cursor, seeds, ranks and global states, skip_samples -- no processes
    plans     which sample each place of an epoch holds: the index plan over torch's
              samplers, our samplers, Mixture
    pipeline  one epoch's tasks through worker processes: messages, tasks, dispatch, fetch,
              worker, transport/, supervisor/, recovery, pin, reorder
    loader    the public DataLoader, its resume (parse -> plan -> apply), the epoch iterators
    cli, integrations, testing   on top: the cli reads only state; integrations use the loader

This is the one drawing of the pipeline (docs/internals.md walks along it); each box names its
module (under pipeline/ unless it says otherwise), in the order a batch meets them.

 sampler / batch_sampler ──► task source ──► dispatcher ──► task pipe ──► worker process
  (plans/index_plan: the     (tasks: map      (dispatch:     (transport/   (worker: per-task
   epoch's order; position   batches or a     the table of   taskpipe:     seeded RNGs;
   is state)                 stream's shards; outstanding    one per       fetch: fetch and
                             assignment, what tasks; Epoch,  worker; a     collate into the
                             a death does,    TaskMsg,       task in one   granted segment;
                             the position)    re-sends)      write)        send)
                                                                                 │
 user ◄── reorder buffer ◄── pin thread ◄── result socket (one per worker) ◄─────┘
        (reorder: releases     (pin:         (transport/framing: the frame, tensors' fds
         ids in order, drops    optional)     in-band, never blocks; a result carries its
         duplicates)                          stream state delta; reducers: how storages
                                              travel; pools: the loader's shared-memory
                                              segments, LoaderPool, lent task by task, their
                                              fds sent the other way; policy: a full /dev/shm)

 iterators (loader/iterators): one epoch's wiring of the stages above; the loader
   (loader/dataloader) builds it from an EpochSetup, and keeps its Cursor.
 supervisor (supervisor/): waits on every result socket, process sentinel and a SIGCHLD
   wake-up pipe, polls liveness, enforces task_timeout; reports results and deaths as typed
   events (Arrived, Died; Lost: a result that came whole and cannot be rebuilt).
 recovery (recovery): turns a death report into decisions -- blame, attempts, poison or
   skip, respawn, EPOCH, re-send (where to, the task source says) -- which the iterator only
   sees as items or a fatal error; a lost result into the error at its task's position.
 lifecycle (loader/lifecycle): the iterator's states (open → finished / abandoned / broken /
   closed) and the Cursor: the position, read from the reorder buffer, dispatcher and task
   source, frozen when the iterator ends, kept by the loader until the next iter().
 messages (protocol): every message between the main process and a worker, typed, and the
   one Status enum of results and deliveries.
 resume (loader/resume): a state parsed against a frozen LoaderShape into a frozen
   ResumePlan, or refused; DataLoader._apply installs the plan and cannot fail.
 state (state/schema: plain-data state, ResumePoint; codec: its bytes; checkpoint:
   save_checkpoint's atomic write; fingerprint: the data a state was taken on and what
   changed since; ranks: DistributedSampler shards, the re-cut for another world size, the
   global state under torch.distributed.checkpoint).
 plans (plans/mixture): a Mixture of named map-style sources, a dataset whose position ->
   (source, index) is arithmetic on (seed, weights history, global position): no iterator
   state (the arithmetic: plans/interleave; its saved plan: plans/mixture_state).

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
from .plans.stream import Stream  # noqa: E402
from .plans.stream_pack import pack_collate  # noqa: E402
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
    "Stream",
    "WorkerCrashError",
    "__version__",
    "dump_state",
    "load_state",
    "merge_rank_states",
    "pack_collate",
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
