"""A ``Stream`` over Parquet and WebDataset-style tar shards, interrupted and resumed on
another number of workers: every row of the epoch read once.

    python examples/stream_shards.py            # writes small shards in a temporary folder
    python examples/stream_shards.py --keep DIR # ... or in DIR, kept afterwards

It writes 12 Parquet files (what ``datasets.Dataset.to_parquet`` or the Hub's parquet
conversion give; an Arrow cache of ``load_dataset`` reads the same way with
``arrow_reader()`` over ``hf_cache_files(ds)``) and 12 tar files of ``.txt``/``.cls`` pairs,
then for each format: reads 4 batches with 2 workers, saves the loader state (atomically,
through ``save_checkpoint``; read back with ``torch.load(weights_only=True)``), builds a new
loader with ``num_workers=0`` and another batch size, loads the state and reads the rest of
the epoch. It prints how many rows each part
read and checks that together they are every row of the shards once, each shard's rows in
order. Needs ``pyarrow`` (``pip install pyarrow``) for the Parquet half.
"""

from __future__ import annotations

import argparse
import io
import os
import tarfile
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from resumable_loader import DataLoader, Stream, save_checkpoint
from resumable_loader.adapters import parquet_reader, webdataset_reader

SHARDS = 12
ROWS = [20 + 7 * (i % 5) for i in range(SHARDS)]  # rows per shard, uneven on purpose


def text(shard: int, i: int) -> str:
    return f"shard {shard:02d} row {i:03d}"


def write_parquet(folder: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = []
    for s in range(SHARDS):
        path = os.path.join(folder, f"train-{s:05d}.parquet")
        rows = [text(s, i) for i in range(ROWS[s])]
        table = pa.table({"text": rows, "label": [i % 3 for i in range(ROWS[s])]})
        pq.write_table(table, path, row_group_size=8)
        paths.append(path)
    return paths


def write_tars(folder: str) -> list[str]:
    paths = []
    for s in range(SHARDS):
        path = os.path.join(folder, f"train-{s:05d}.tar")
        with tarfile.open(path, "w") as tar:
            for i in range(ROWS[s]):
                for ext, data in (("txt", text(s, i).encode()), ("cls", str(i % 3).encode())):
                    info = tarfile.TarInfo(f"s{s:02d}/{i:03d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def decode(sample: dict[str, Any]) -> dict[str, Any]:
    """A WebDataset sample (bytes per field) as the Parquet rows look."""
    return {"text": sample["txt"].decode(), "label": int(sample["cls"])}


def texts(batch: dict[str, Any]) -> list[str]:
    return list(batch["text"])  # default collate: a dict of lists (strings) and tensors


def run(name: str, shards: list[str], read: Callable[..., Any], folder: str) -> None:
    def stream() -> Stream:
        return Stream.from_shards(shards, read, seed=0, partitions=4)

    loader = DataLoader(stream(), batch_size=8, num_workers=2)
    it = iter(loader)
    head = [t for _ in range(4) for t in texts(next(it))]
    ckpt = os.path.join(folder, f"{name}.ckpt")
    save_checkpoint({"loader": loader.state_dict()}, ckpt)
    del it, loader  # as if the job were preempted here

    resumed = DataLoader(stream(), batch_size=5, num_workers=0)  # another layout
    resumed.load_state_dict(torch.load(ckpt, weights_only=True)["loader"])
    rest = [t for batch in resumed for t in texts(batch)]

    everything = sorted(text(s, i) for s in range(SHARDS) for i in range(ROWS[s]))
    assert sorted(head + rest) == everything, "a row was lost or read twice"
    for s in range(SHARDS):
        mine = [t for t in head + rest if t.startswith(f"shard {s:02d} ")]
        assert mine == sorted(mine), f"shard {s}'s rows out of order"
    print(
        f"{name}: {len(head)} rows with 2 workers, then {len(rest)} after the resume with "
        f"num_workers=0: all {len(everything)} rows once, each shard in order"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", metavar="DIR", help="write the shards here and keep them")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or tmp
        os.makedirs(folder, exist_ok=True)
        try:
            parquet = write_parquet(folder)
        except ImportError:
            print("parquet: skipped (pip install pyarrow)")
        else:
            run("parquet", parquet, parquet_reader(["text", "label"]), folder)
        run("webdataset", write_tars(folder), webdataset_reader(decode), folder)


if __name__ == "__main__":
    main()
