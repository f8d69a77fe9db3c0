"""Readers for common shard formats, to build a ``Stream`` with ``Stream.from_shards``.

Each function returns a ``read(shard, start)`` callable: it yields the shard's samples from
sample ``start`` on, so a resume reopens each partition's current shard at its cursor. They are
small picklable objects (a Stream is sent to worker processes with its reader), and import
their library only when called, so ``import resumable_loader`` never needs ``pyarrow``.

==========================  ===========================  =====================================
reader                      a shard is                   what ``start`` costs
==========================  ===========================  =====================================
``parquet_reader()``        a Parquet file (HF Hub       reads the footer, skips whole row
                            ``refs/convert/parquet``,    groups by their row counts, decodes
                            ``Dataset.to_parquet``)      one row group partly: O(row groups)
``arrow_reader()``          an Arrow IPC file or stream  memory-maps the file and slices the
                            (a ``datasets`` cache file:  table: O(record batches), no sample
                            ``Dataset.cache_files``)     data read
``webdataset_reader()``     a tar file of samples        reads the tar headers of the first
                            grouped by basename          ``start`` samples (their data is
                            (WebDataset's layout)        seeked over in an uncompressed tar,
                                                         read and dropped in a compressed one)
==========================  ===========================  =====================================

Example (docs/streams.md, "Adapters"; ``examples/stream_shards.py`` runs it end to end)::

    from resumable_loader import DataLoader, Stream
    from resumable_loader.adapters import parquet_reader

    stream = Stream.from_shards(sorted(glob.glob("data/*.parquet")), parquet_reader(["text"]))
    loader = DataLoader(stream.map(tokenize), batch_size=8, num_workers=4)
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

__all__ = ["arrow_reader", "hf_cache_files", "parquet_reader", "webdataset_reader"]

# Rows decoded per Arrow record batch: large enough to amortise Arrow's per-batch cost, small
# enough that a seek into the middle of a row group decodes little more than it delivers.
DEFAULT_BATCH_ROWS = 1024


def _pyarrow(what: str) -> Any:
    try:
        import pyarrow
    except ImportError as exc:
        raise ImportError(
            f"{what} needs pyarrow (pip install pyarrow; `datasets` installs it too)"
        ) from exc
    return pyarrow


def _check_columns(columns: Sequence[str] | None) -> list[str] | None:
    if columns is None:
        return None
    if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
        raise TypeError(f"columns must be a list of column names, got {columns!r}")
    return list(columns)


def _check_rows(batch_rows: int) -> int:
    if type(batch_rows) is not int or batch_rows < 1:
        raise ValueError(f"batch_rows must be an int >= 1, got {batch_rows!r}")
    return batch_rows


def _check_start(start: int) -> int:
    if type(start) is not int or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    return start


# ---- Parquet ----


class ParquetReader:
    """``read(path, start)`` over a Parquet file: rows as dicts of the chosen ``columns``
    (see ``parquet_reader``)."""

    def __init__(self, columns: Sequence[str] | None, batch_rows: int) -> None:
        self.columns = _check_columns(columns)
        self.batch_rows = _check_rows(batch_rows)

    def __call__(self, path: str | os.PathLike[str], start: int) -> Iterator[dict[str, Any]]:
        _check_start(start)
        _pyarrow("parquet_reader")
        import pyarrow.parquet as pq

        with pq.ParquetFile(path) as pf:
            meta = pf.metadata
            first, skip = 0, start
            # Whole row groups before `start` are passed over by their row counts (footer
            # metadata): nothing of them is read.
            while first < meta.num_row_groups and skip >= meta.row_group(first).num_rows:
                skip -= meta.row_group(first).num_rows
                first += 1
            if first == meta.num_row_groups:
                return
            batches = pf.iter_batches(
                batch_size=self.batch_rows,
                row_groups=list(range(first, meta.num_row_groups)),
                columns=self.columns,
            )
            for batch in batches:
                if skip >= batch.num_rows:
                    skip -= batch.num_rows
                    continue
                if skip:
                    batch, skip = batch.slice(skip), 0
                yield from batch.to_pylist()

    def __repr__(self) -> str:
        return f"parquet_reader(columns={self.columns!r}, batch_rows={self.batch_rows})"


def parquet_reader(
    columns: Sequence[str] | None = None, batch_rows: int = DEFAULT_BATCH_ROWS
) -> ParquetReader:
    """A reader of Parquet shards: each sample is one row, a dict of ``columns`` (all if None).

    ``read(path, start)`` reads the file's footer, passes over whole row groups before row
    ``start`` by their row counts, and decodes from the row group that holds it, in record
    batches of ``batch_rows`` rows: a resume costs O(row groups) of metadata and at most one
    row group's batches before ``start``. Needs ``pyarrow``.

    Raises:
        TypeError: ``columns`` is not a list of names.
        ValueError: ``batch_rows`` is not an int >= 1.
    """
    return ParquetReader(columns, batch_rows)


# ---- Arrow IPC (the `datasets` cache) ----


class ArrowReader:
    """``read(path, start)`` over an Arrow IPC file or stream (see ``arrow_reader``)."""

    def __init__(self, columns: Sequence[str] | None, batch_rows: int) -> None:
        self.columns = _check_columns(columns)
        self.batch_rows = _check_rows(batch_rows)

    def __call__(self, path: str | os.PathLike[str], start: int) -> Iterator[dict[str, Any]]:
        _check_start(start)
        pa = _pyarrow("arrow_reader")
        with pa.memory_map(os.fspath(path), "r") as source:
            table = _read_ipc(pa, source)
            if self.columns is not None:
                table = table.select(self.columns)
            # A slice of a memory-mapped table is a view: nothing before `start` is read.
            for batch in table.slice(start).to_batches(max_chunksize=self.batch_rows):
                yield from batch.to_pylist()

    def __repr__(self) -> str:
        return f"arrow_reader(columns={self.columns!r}, batch_rows={self.batch_rows})"


def _read_ipc(pa: Any, source: Any) -> Any:
    """The table of an Arrow IPC file (random-access format) or stream (the format
    ``datasets`` writes its cache in), zero-copy from the memory map."""
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()


def arrow_reader(
    columns: Sequence[str] | None = None, batch_rows: int = DEFAULT_BATCH_ROWS
) -> ArrowReader:
    """A reader of Arrow IPC shards -- such as a Hugging Face ``datasets`` cache file (see
    ``hf_cache_files``): each sample is one row, a dict of ``columns`` (all if None).

    ``read(path, start)`` memory-maps the file and slices its table at row ``start``: a resume
    reads the record batches' headers only, O(record batches), never the rows before it.
    Needs ``pyarrow``.

    Raises:
        TypeError: ``columns`` is not a list of names.
        ValueError: ``batch_rows`` is not an int >= 1.
    """
    return ArrowReader(columns, batch_rows)


def hf_cache_files(dataset: Any) -> list[str]:
    """The Arrow files behind a Hugging Face ``datasets.Dataset`` (``load_dataset(...)``
    without ``streaming``), in its order: shards for ``Stream.from_shards(files,
    arrow_reader())``.

    Raises:
        ValueError: the dataset is held in memory only (no cache files), or was transformed
            without being written (``select``/``shuffle`` make an indices mapping over the
            files, which the files alone do not follow): ``flatten_indices()`` or
            ``save_to_disk`` first.
    """
    files = getattr(dataset, "cache_files", None)
    if isinstance(files, dict):
        raise ValueError(
            f"a DatasetDict (splits {sorted(files)}): pass one split, e.g. "
            f"hf_cache_files(ds[{next(iter(sorted(files)))!r}])"
        )
    if not files:
        raise ValueError(
            "the dataset has no cache files (it is held in memory): save it with "
            "dataset.save_to_disk(dir) or write Parquet shards (dataset.to_parquet) first"
        )
    if getattr(dataset, "_indices", None) is not None:
        raise ValueError(
            "the dataset has an indices mapping (after select, shuffle, train_test_split...), "
            "which its cache files do not hold: call dataset.flatten_indices() first"
        )
    names = [f["filename"] for f in files]
    # take/skip/select(range) keep no indices mapping: they slice the table over the same
    # files, which still hold every row. The files are the dataset only if they hold exactly
    # its rows.
    pa = _pyarrow("hf_cache_files")
    held = 0
    for name in names:
        with pa.memory_map(name, "r") as source:
            held += _read_ipc(pa, source).num_rows
    if held != len(dataset):
        raise ValueError(
            f"the dataset has {len(dataset)} rows but its cache files hold {held} (a "
            "take/skip/select of a contiguous range slices the same files): write the "
            "selection first (dataset.flatten_indices() after a select, or "
            "dataset.save_to_disk(dir)) and read those files"
        )
    return names


# ---- WebDataset-style tar files ----


def _split_name(name: str) -> tuple[str, str]:
    """WebDataset's convention: ``dir/sample001.seg.png`` is sample ``dir/sample001``, field
    ``seg.png`` (the key ends at the first dot of the basename)."""
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), (ext if dot else "")


class WebDatasetReader:
    """``read(tar_path, start)`` over a tar of samples grouped by basename (see
    ``webdataset_reader``)."""

    def __init__(self, decode: Callable[[dict[str, Any]], Any] | None) -> None:
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be callable or None, got {decode!r}")
        self.decode = decode

    def __call__(self, path: str | os.PathLike[str], start: int) -> Iterator[Any]:
        _check_start(start)
        decode = self.decode
        with tarfile.open(os.fspath(path), "r:*") as tar:
            key: str | None = None
            index = -1
            sample: dict[str, Any] | None = None
            while (member := tar.next()) is not None:
                if not member.isfile():
                    continue
                k, ext = _split_name(member.name)
                if k != key:
                    if sample is not None:
                        yield decode(sample) if decode is not None else sample
                    key, index = k, index + 1
                    # Samples before `start`: their headers are read, their data is not
                    # (tarfile seeks over it in an uncompressed file).
                    sample = {"__key__": k} if index >= start else None
                if sample is not None:
                    data = tar.extractfile(member)
                    sample[ext] = data.read() if data is not None else b""
                # CPython's TarFile keeps every header it reads (for getmembers(), which is
                # never called here): dropped, so that a shard of a million members does not
                # hold a million headers.
                cast(Any, tar).members.clear()
            if sample is not None:
                yield decode(sample) if decode is not None else sample

    def __repr__(self) -> str:
        return f"webdataset_reader(decode={self.decode!r})"


def webdataset_reader(decode: Callable[[dict[str, Any]], Any] | None = None) -> WebDatasetReader:
    """A reader of WebDataset-style tar shards: consecutive members with the same key (the
    path up to the basename's first dot) form one sample, ``{"__key__": key, ext: bytes,
    ...}`` (``a/x.jpg``, ``a/x.cls`` -> ``{"__key__": "a/x", "jpg": ..., "cls": ...}``),
    passed through ``decode`` if given. Only the standard library's ``tarfile`` is used.

    ``read(tar, start)`` reads the tar headers of the first ``start`` samples and skips their
    data: O(start) headers of 512 bytes, with the data seeked over in an uncompressed tar (in
    a compressed one, ``.tar.gz``, it is decompressed and dropped: O(bytes before start)).

    Raises:
        TypeError: ``decode`` is not callable.
    """
    return WebDatasetReader(decode)
