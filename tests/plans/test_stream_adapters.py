"""``resumable_loader.adapters`` (issue #33): Parquet, Arrow IPC (the ``datasets`` cache) and
WebDataset-style tar files as a ``Stream``'s shards. Every reader is checked at every start
row against the file's rows read from the beginning, and a Stream over each resumes on another
layout with every row once, each partition's rows in the uninterrupted run's order."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from resumable_loader import DataLoader, Stream, dump_state, load_state
from resumable_loader.adapters import (
    arrow_reader,
    hf_cache_files,
    parquet_reader,
    webdataset_reader,
)

LENGTHS = [23, 7, 0, 16]  # rows per shard: one empty, one shorter than a row group


def _rows(shard: int) -> list[dict[str, Any]]:
    return [
        {"id": shard * 1000 + i, "text": f"s{shard}r{i}", "n": i * i} for i in range(LENGTHS[shard])
    ]


def _table(shard: int) -> pa.Table:
    rows = _rows(shard)
    return pa.table(
        {k: [r[k] for r in rows] for k in ("id", "text", "n")},
        schema=pa.schema([("id", pa.int64()), ("text", pa.string()), ("n", pa.int64())]),
    )


@pytest.fixture
def parquet_shards(tmp_path: Path) -> list[str]:
    paths = []
    for s in range(len(LENGTHS)):
        path = tmp_path / f"part-{s}.parquet"
        pq.write_table(_table(s), path, row_group_size=5)  # several row groups per shard
        paths.append(str(path))
    return paths


@pytest.fixture
def arrow_shards(tmp_path: Path) -> list[str]:
    """Even shards in the IPC stream format (the ``datasets`` cache), odd in the file format;
    record batches of 6 rows."""
    paths = []
    for s in range(len(LENGTHS)):
        path = tmp_path / f"part-{s}.arrow"
        table = _table(s)
        new = pa.ipc.new_stream if s % 2 == 0 else pa.ipc.new_file
        with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=6):
                writer.write_batch(batch)
        paths.append(str(path))
    return paths


def _tar_samples(shard: int) -> list[dict[str, Any]]:
    return [
        {"__key__": f"d{shard}/k{i:03d}", "txt": f"s{shard}r{i}".encode(), "cls": str(i).encode()}
        for i in range(LENGTHS[shard])
    ]


def _write_tar(path: Path, samples: list[dict[str, Any]], mode: str = "w") -> None:
    with tarfile.open(path, mode) as tar:
        folder = tarfile.TarInfo("d")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)  # a directory member is not a sample field
        for sample in samples:
            for ext in ("txt", "cls"):
                data = sample[ext]
                info = tarfile.TarInfo(f"{sample['__key__']}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def tar_shards(tmp_path: Path) -> list[str]:
    paths = []
    for s in range(len(LENGTHS)):
        path = tmp_path / f"part-{s}.tar"
        _write_tar(path, _tar_samples(s))
        paths.append(str(path))
    return paths


# ---- each reader at every start --------------------------------------------------------------


def test_parquet_reader_starts_at_every_row(parquet_shards: list[str]) -> None:
    read = parquet_reader(batch_rows=3)
    for s, path in enumerate(parquet_shards):
        for start in range(LENGTHS[s] + 2):
            assert list(read(path, start)) == _rows(s)[start:], (s, start)
    only = parquet_reader(["text"])
    assert list(only(parquet_shards[0], 21)) == [{"text": "s0r21"}, {"text": "s0r22"}]


def test_arrow_reader_starts_at_every_row_in_both_ipc_formats(arrow_shards: list[str]) -> None:
    read = arrow_reader(batch_rows=4)
    for s, path in enumerate(arrow_shards):
        for start in range(LENGTHS[s] + 2):
            assert list(read(path, start)) == _rows(s)[start:], (s, start)
    assert list(arrow_reader(["id"])(arrow_shards[3], 15)) == [{"id": 3015}]


def test_webdataset_reader_groups_by_key_and_starts_at_every_sample(
    tar_shards: list[str], tmp_path: Path
) -> None:
    read = webdataset_reader()
    for s, path in enumerate(tar_shards):
        for start in range(LENGTHS[s] + 2):
            assert list(read(path, start)) == _tar_samples(s)[start:], (s, start)
    gz = tmp_path / "part.tar.gz"
    _write_tar(gz, _tar_samples(1), "w:gz")
    decoded = webdataset_reader(lambda x: (x["__key__"], x["txt"].decode()))
    assert list(decoded(str(gz), 5)) == [("d1/k005", "s1r5"), ("d1/k006", "s1r6")]


def test_bad_arguments_are_refused_with_the_argument_named(parquet_shards: list[str]) -> None:
    with pytest.raises(TypeError, match="columns must be a list"):
        parquet_reader("text")
    with pytest.raises(ValueError, match="batch_rows must be an int >= 1"):
        arrow_reader(batch_rows=0)
    with pytest.raises(TypeError, match="decode must be callable"):
        webdataset_reader(decode=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start must be an int >= 0"):
        list(parquet_reader()(parquet_shards[0], -1))


def test_importing_the_adapters_imports_no_optional_library() -> None:
    code = (
        "import sys, resumable_loader.adapters as a; a.parquet_reader(); a.webdataset_reader();"
        "print(sorted(m for m in ('pyarrow', 'datasets') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


# ---- as a Stream's shards, resumed on another layout ---------------------------------------


def _ids(batch: Any) -> list[int]:
    if isinstance(batch, dict):  # default collate of dict rows
        return [int(x) for x in batch["id"]]
    return [int(x) for x in batch]


def _stream(shards: list[str], read: Any) -> Stream:
    return Stream.from_shards(shards, read, partitions=2, seed=3)


def _resumed(shards: list[str], read: Any, key: Any) -> None:
    """A 2-worker loader saved after 3 batches, resumed with num_workers=0 and another batch
    size: every row of the shards once, and each shard's rows in the shard's own order (a
    partition reads its shards one after the other), the shards read directly as reference."""
    files = {s: [key(x) for x in _ids_of_rows(read(path, 0))] for s, path in enumerate(shards)}
    shard_of = {x: s for s, xs in files.items() for x in xs}
    loader = DataLoader(_stream(shards, read), batch_size=4, num_workers=2)
    it = iter(loader)
    head = [key(x) for _ in range(3) for x in _ids_of(next(it))]
    state = load_state(dump_state(loader.state_dict()))
    del it, loader
    again = DataLoader(_stream(shards, read), batch_size=3)
    again.load_state_dict(state)
    got = head + [key(x) for b in again for x in _ids_of(b)]
    assert sorted(got) == sorted(shard_of)
    for s, xs in files.items():
        assert [x for x in got if shard_of[x] == s] == xs


def _ids_of_rows(rows: Any) -> list[Any]:
    return [r["id"] if "id" in r else r["__key__"] for r in rows]


def _ids_of(batch: Any) -> list[Any]:
    if isinstance(batch, dict) and "id" in batch:
        return _ids(batch)
    if isinstance(batch, dict):
        return list(batch["__key__"])
    return list(batch)


def test_parquet_shards_in_a_stream_resume_on_another_layout(parquet_shards: list[str]) -> None:
    _resumed(parquet_shards, parquet_reader(["id"], batch_rows=4), int)


def test_tar_shards_in_a_stream_resume_on_another_layout(tar_shards: list[str]) -> None:
    def key(k: str) -> int:  # "d2/k005" -> 2005
        return int(k[1 : k.index("/")]) * 1000 + int(k.rsplit("k", 1)[1])

    _resumed(tar_shards, webdataset_reader(), key)


def test_a_datasets_cache_is_read_as_arrow_shards(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [r for s in range(len(LENGTHS)) for r in _rows(s)]
    ds = datasets.Dataset.from_list(rows)
    with pytest.raises(ValueError, match="no cache files"):
        hf_cache_files(ds)
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    disk = datasets.load_from_disk(str(tmp_path / "ds"))
    files = hf_cache_files(disk)
    assert len(files) == 3
    read = arrow_reader()
    assert [r for f in files for r in read(f, 0)] == rows
    assert next(iter(read(files[1], 4))) == disk[len(list(read(files[0], 0))) + 4]
    with pytest.raises(ValueError, match="flatten_indices"):
        hf_cache_files(disk.shuffle(seed=0))
    _resumed(files, arrow_reader(["id"]), int)


def test_the_example_runs_and_checks_every_row_once() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "stream_shards.py"
    out = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    for name in ("parquet", "webdataset"):
        assert f"{name}: 32 rows with 2 workers, then 355 after the resume" in out.stdout
