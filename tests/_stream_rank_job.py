"""One rank of a ``Stream`` job under a gloo process group, started by ``test_streams_ranks``
with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or by torchrun:

    torchrun --standalone --nproc-per-node W tests/_stream_rank_job.py SPEC_JSON

The Stream: ``SHARDS`` uneven shards (``_stream_shards``: 2..6 samples each) dealt to
``PARTITIONS`` partitions without a shard shuffle, so a sample's partition is ``shard mod P``
in every pass and a test can follow each partition across epochs.

SPEC keys: ``out`` (folder), ``phase`` (the name of the files written), ``workers``,
``batch``, ``epochs`` (run epochs ``start..epochs-1``), and:

* ``stop``: after this many batches of the first epoch, save the job's state with
  ``dcp.save({"loader": loader}, checkpoint_id=ckpt)`` and each rank's own ``state_dict()``
  to ``OUT/own-rank<r>.state``, then SIGKILL this rank (after a barrier: every rank saved).
* ``dcp`` / ``state``: resume first, through ``dcp.load`` from that folder, or from a state
  file (``load_state``: a merged global state or a rank's own); ``start_epoch`` is the
  state's ``epoch`` (``{rank}`` in the file's name: each rank its own).
* ``refuse``: before resuming, try each ``[workers, state file]`` in it and record the
  ``CheckpointError`` (or ``ValueError`` from ``iter()``) it raises.
* ``end_states``: after each epoch's StopIteration, save the own state to
  ``OUT/PHASE-end<e>-rank<r>.state`` and the job's with ``dcp.save`` to ``OUT/PHASE-end<e>-dcp``.
* ``tail``: the DataLoader's ``stream_tail``; ``persistent``: ``persistent_workers=True``;
  ``in_order``: the DataLoader's; ``new_group``: the loader takes the default group for
  nccl, so its agreement makes a gloo group of its own.

Each rank writes ``OUT/PHASE-rank<r>.json``: per epoch its batches (lists of samples) in
order, the refusals' messages, and the warnings raised.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from typing import Any

import _stream_shards as F

from resumable_loader import (
    CheckpointError,
    DataLoader,
    Stream,
    dump_state,
    load_state,
    save_checkpoint,
)

SHARDS = 27
PARTITIONS = 12


def make_stream() -> Stream:
    return Stream.from_shards(
        list(range(SHARDS)), F.read, partitions=PARTITIONS, shuffle_shards=False
    )


def make_loader(spec: dict[str, Any], workers: int) -> DataLoader:
    extra: dict[str, Any] = {"stream_tail": spec["tail"]} if "tail" in spec else {}
    if "in_order" in spec:
        extra["in_order"] = spec["in_order"]
    if spec.get("persistent") and workers:
        extra["persistent_workers"] = True
    return DataLoader(make_stream(), batch_size=spec["batch"], num_workers=workers, **extra)


def main(spec: dict[str, Any]) -> None:
    # Imported here, as _mixture_dist_job does: torch.distributed.checkpoint is heavy.
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if spec.get("new_group"):
        # As under nccl: the agreement makes a gloo group of its own (the default one is gloo
        # here, so only the loader is told otherwise).
        from resumable_loader.loader import stream_ranks

        stream_ranks._default_backend = lambda: "nccl"
    out = spec["out"]
    got: dict[str, Any] = {"epochs": {}, "refused": [], "warnings": []}

    def write() -> None:
        with open(os.path.join(out, f"{spec['phase']}-rank{rank}.json"), "w") as f:
            json.dump(got, f)

    for workers, path in spec.get("refuse", []):
        loader = make_loader(spec, workers)
        try:
            with open(path, "rb") as f:
                loader.load_state_dict(load_state(f.read()))
            iter(loader)
        except (CheckpointError, ValueError) as e:
            got["refused"].append(f"{type(e).__name__}: {e}")
        else:
            got["refused"].append(None)
        loader.close()

    loader = make_loader(spec, spec["workers"])
    start = 0
    if "dcp" in spec:
        dcp.load({"loader": loader}, checkpoint_id=spec["dcp"])
        start = loader.state_dict()["epoch"]
    elif "state" in spec:
        with open(spec["state"].format(rank=rank), "rb") as f:
            loader.load_state_dict(load_state(f.read()))
        start = loader.state_dict()["epoch"]  # this rank's, from a global state too
    n = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(start, spec["epochs"]):
            rows = got["epochs"].setdefault(str(epoch), [])
            for batch in loader:
                rows.append(batch.tolist())
                n += 1
                if n == spec.get("stop"):
                    dcp.save({"loader": loader}, checkpoint_id=spec["ckpt"])
                    own = os.path.join(out, f"own-rank{rank}.state")
                    save_checkpoint(dump_state(loader.state_dict()), own)
                    write()
                    dist.barrier()
                    os.kill(os.getpid(), signal.SIGKILL)  # a preempted job dies so
            if spec.get("end_states"):
                own = os.path.join(out, f"{spec['phase']}-end{epoch}-rank{rank}.state")
                save_checkpoint(dump_state(loader.state_dict()), own)
                end = os.path.join(out, f"{spec['phase']}-end{epoch}-dcp")
                dcp.save({"loader": loader}, checkpoint_id=end)
    got["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    write()
    loader.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
