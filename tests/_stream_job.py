"""A training loop over a ``Stream`` for ``test_streams_exact``'s restarted-process case.

    python tests/_stream_job.py SPEC_JSON

It builds the loader over the synthetic shards (``_stream_shards``), loads ``state_in`` if
given (``start_epoch = state["epoch"]``, as the README's quickstart does), and runs ``epochs``
epochs, appending each batch to ``out`` as one json line (flushed: a SIGKILL keeps what came
before). After ``stop`` batches it saves ``loader.state_dict()`` to ``state_out`` atomically
(``dump_state`` + ``save_checkpoint``) and SIGKILLs itself, as a preempted job dies.

SPEC keys: shards, partitions, workers, persistent, batch_size, epochs, stop, state_in,
state_out, out.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import _stream_shards as F

from resumable_loader import DataLoader, Stream, dump_state, load_state, save_checkpoint


def main(spec: dict) -> None:
    stream = Stream.from_shards(
        list(range(spec["shards"])), F.read, partitions=spec["partitions"]
    ).map(F.plus_half)
    loader = DataLoader(
        stream,
        batch_size=spec["batch_size"],
        num_workers=spec["workers"],
        persistent_workers=spec["persistent"],
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
                out.write(json.dumps([epoch, batch.tolist()]) + "\n")
                out.flush()
                n += 1
                if n == spec.get("stop"):
                    save_checkpoint(dump_state(loader.state_dict()), spec["state_out"])
                    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
