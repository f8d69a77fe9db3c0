"""A training loop over a packed ``Stream`` for ``test_streams_pack``'s killed-process case.

    python tests/_stream_pack_job.py SPEC_JSON

It builds the loader over the synthetic token shards (``_token_shards.seeded``), loads
``state_in`` if given, and runs ``epochs`` epochs, appending each batch to ``out`` as one json
line (flushed: a SIGKILL keeps what came before). After ``stop`` batches it saves
``loader.state_dict()`` to ``state_out`` atomically (``dump_state`` + ``save_checkpoint``) and
SIGKILLs itself, as a preempted job dies.

SPEC keys: mode, seq_len, workers, batch_size, epochs, stop, state_in, state_out, out.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import _token_shards as T

from resumable_loader import DataLoader, Stream, dump_state, load_state, save_checkpoint

SHARDS, DOCS, MEAN, PARTITIONS = 16, 6, 20, 8


def make(mode: str, seq_len: int) -> Stream:
    """The packed stream the test and this job share."""
    docs = T.seeded(SHARDS, DOCS, MEAN, seed=7)
    return Stream.from_shards(docs.shards, docs, partitions=PARTITIONS).pack(
        seq_len, mode=mode, window=6, pad_id=-1
    )


def main(spec: dict) -> None:
    loader = DataLoader(
        make(spec["mode"], spec["seq_len"]),
        batch_size=spec["batch_size"],
        num_workers=spec["workers"],
    )
    start = 0
    if spec.get("state_in"):
        with open(spec["state_in"], "rb") as f:
            state = load_state(f.read())
        loader.load_state_dict(state)
        start = state["epoch"]
    n = 0
    with open(spec["out"], "a") as out:
        for epoch in range(start, spec["epochs"]):
            for batch in loader:
                out.write(json.dumps([epoch, {k: v.tolist() for k, v in batch.items()}]) + "\n")
                out.flush()
                n += 1
                if n == spec.get("stop"):
                    save_checkpoint(dump_state(loader.state_dict()), spec["state_out"])
                    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
