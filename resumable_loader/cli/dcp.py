"""``torch.distributed.checkpoint`` directories: the loader's entries read without running
code, and (for ``skip``) a copy written with them replaced.

Reading (``read_dcp_metadata``, ``load_dcp``). torch's own reader would unpickle ``.metadata``
with plain ``pickle`` and non-tensor entries with ``torch.load(weights_only=False)``, so a
planted file would run its code. Here ``.metadata`` goes through ``_DcpUnpickler``, whose only
reachable classes are inert records (``_DcpRecord``) standing in for the names in
``_DCP_CLASSES``; then only the loader's entries -- those beside a ``*.format`` entry that
names a loader state -- are read, at the offset their record gives, with
``torch.load(weights_only=True)``. The model's tensors are never read.

Writing (``write_dcp_copy``). A DCP checkpoint is several files, which no rename replaces at
once, so the result of a skip is a new directory: the files copied, the changed entries in a
data file of their own (``DCP_SKIP_FILE``), and the metadata -- read a second time, now into
torch's classes, after the inert reader accepted it -- pointed at that file. It is built under
a temporary name beside OUT and renamed, so OUT appears whole or not at all.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

from ..state.checkpoint import create_unique, fsync_directory
from ..state.codec import clip_repr, clip_text
from ..state.ranks import GLOBAL_FORMAT
from ..state.schema import FORMAT as STATE_FORMAT
from .files import check_expansion, open_regular
from .messages import CliError, first_line, list_keys

# ---- reading: the metadata as inert records, the loader's entries with weights_only ----

# A DCP directory's metadata file, and the most inspect reads of it: a job's metadata lists each
# tensor chunk, a few hundred bytes apiece; a billion-parameter model's is a few MB.
DCP_METADATA = ".metadata"
MAX_DCP_METADATA = 256 << 20

# What a .metadata file written by torch 2.13's dcp.save refers to. Each is read as an inert
# record (a _DcpRecord subclass of the same name): pickle hands it its arguments and state, and
# nothing of the class it stands for runs. Anything else is refused, unread.
_DCP_CLASSES = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }
)


class _DcpRecord:
    """Stands in for one of the classes in ``_DCP_CLASSES``: keeps what pickle gives it."""

    __slots__ = ("args", "state")
    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any, **kwargs: Any) -> _DcpRecord:
        self = super().__new__(cls)
        self.args = args
        self.state = None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def fields(self) -> dict[Any, Any]:
        """The instance's attributes as pickled: a dict, or a (dict, slots dict) pair."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2:
            merged: dict[Any, Any] = {}
            for part in state:
                if isinstance(part, dict):
                    merged.update(part)
            return merged
        return state if isinstance(state, dict) else {}


class _DcpUnpickler(pickle.Unpickler):
    """Reads a DCP ``.metadata`` file into ``_DcpRecord``s and plain containers.

    ``find_class`` is the one way a pickle reaches code; it returns a record class for the
    names in ``_DCP_CLASSES`` (and for torch's dtypes), and refuses every other name, so the
    only code a file can call is ``_DcpRecord``'s own. Persistent ids are refused by the base
    class (no ``persistent_load``).
    """

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.records: dict[tuple[str, str], type[_DcpRecord]] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES or (module == "torch" and _is_dtype_name(name)):
            record = self.records.get((module, name))
            if record is None:
                record = type(name, (_DcpRecord,), {"__slots__": ()})
                self.records[(module, name)] = record
            return record if module != "torch" or name == "Size" else record()
        raise pickle.UnpicklingError(
            f"it refers to {clip_text(module, 80)}.{clip_text(name, 80)}, which a "
            "torch.distributed.checkpoint metadata file never holds (a crafted file may use "
            "it to run code); inspect reads none of it"
        )


def _is_dtype_name(name: str) -> bool:
    import torch

    # The module's own dict, not getattr: torch's module __getattr__ imports submodules.
    return isinstance(vars(torch).get(name), torch.dtype)


def read_dcp_metadata(path: str) -> tuple[dict[str, str], dict[str, Any]]:
    """A DCP directory's entries (key -> the name of its metadata class) and the storage
    records of its non-tensor entries (key -> the fields of its _StorageInfo)."""
    meta_path = os.path.join(path, DCP_METADATA)
    not_dcp = f"{path} is a directory but not a torch.distributed.checkpoint one"
    try:
        with open_regular(meta_path) as f:
            data = f.read(MAX_DCP_METADATA + 1)
    except OSError as exc:
        raise CliError(f"{not_dcp} (cannot read {DCP_METADATA}: {exc.strerror or exc})") from exc
    if len(data) > MAX_DCP_METADATA:
        raise CliError(f"{meta_path} is larger than {MAX_DCP_METADATA >> 20} MiB; not read")
    try:
        md = _DcpUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # UnpicklingError, EOFError, ValueError, TypeError, ...
        raise CliError(
            f"{not_dcp}: its {DCP_METADATA} cannot be read safely: {first_line(str(exc))}"
        ) from exc
    fields = md.fields() if type(md).__name__ == "Metadata" and isinstance(md, _DcpRecord) else {}
    entries = fields.get("state_dict_metadata")
    storage_data = fields.get("storage_data")
    if not isinstance(entries, dict) or not isinstance(storage_data, dict):
        raise CliError(f"{not_dcp}: its {DCP_METADATA} does not describe a checkpoint's entries")
    kinds: dict[str, str] = {}
    for key, entry in entries.items():
        if type(key) is not str or not isinstance(entry, _DcpRecord):
            raise CliError(f"{not_dcp}: its {DCP_METADATA} lists an entry {clip_repr(key)}")
        kinds[key] = type(entry).__name__
    storage: dict[str, Any] = {}
    for index, info in storage_data.items():
        if not isinstance(index, _DcpRecord) or not isinstance(info, _DcpRecord):
            raise CliError(f"{not_dcp}: its {DCP_METADATA} has a malformed storage entry")
        fqn = index.fields().get("fqn")
        if type(fqn) is str and kinds.get(fqn) == "BytesStorageMetadata":
            storage[fqn] = info.fields()
    return kinds, storage


def _read_dcp_entry(path: str, key: str, info: dict[Any, Any] | None) -> bytes:
    """The bytes of a non-tensor entry, from the file and at the offset its record gives."""
    if info is None:
        raise CliError(f"{path}: entry {key!r} has no storage record in {DCP_METADATA}")
    name, offset, length = info.get("relative_path"), info.get("offset"), info.get("length")
    if (
        type(name) is not str
        or name in ("", ".", "..")
        or os.path.basename(name) != name
        or type(offset) is not int
        or type(length) is not int
        or offset < 0
        or length < 0
    ):
        raise CliError(
            f"{path}: entry {key!r} has a malformed storage record (file {clip_repr(name)}, "
            f"offset {clip_repr(offset)}, length {clip_repr(length)}); a file of the "
            "checkpoint directory itself is expected"
        )
    if info.get("transform_descriptors"):
        raise CliError(
            f"{path}: entry {key!r} is stored through stream transforms "
            f"({clip_repr(info['transform_descriptors'])}), which inspect does not read"
        )
    try:
        with open_regular(os.path.join(path, name)) as f:
            size = os.fstat(f.fileno()).st_size
            if offset + length > size:
                raise CliError(
                    f"{path}: entry {key!r} lies at bytes {offset}..{offset + length} of {name}, "
                    f"which has only {size}: the checkpoint is truncated"
                )
            f.seek(offset)
            return f.read(length)
    except OSError as exc:
        raise CliError(f"{path}: cannot read {name}: {exc.strerror or exc}") from exc


def _read_dcp_value(path: str, key: str, info: dict[Any, Any] | None) -> Any:
    """A non-tensor entry's value, loaded with ``torch.load(weights_only=True)``."""
    import torch

    data = _read_dcp_entry(path, key, info)
    try:
        value = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CliError(
            f"{path}: entry {key!r} is not plain data that torch.load(weights_only=True) "
            f"reads, and inspect never unpickles anything else ({type(exc).__name__}: "
            f"{first_line(str(exc))})"
        ) from exc
    check_expansion(value, len(data), f"{path}: entry {key!r}")
    return value


def load_dcp(path: str) -> Any:
    """The loader states of a torch.distributed.checkpoint directory, read without torch's
    reader: it unpickles ``.metadata`` with plain ``pickle`` and non-tensor entries with
    ``torch.load(weights_only=False)``, so a planted file would run its code. Here the metadata
    goes through a reader that builds only inert records (``_DcpUnpickler``), and each wanted
    entry's bytes are read at the offset the metadata gives and loaded with
    ``torch.load(weights_only=True)``. Only the loader's entries are read: those beside a
    ``*.format`` entry that names a loader state; never the model's tensors.
    """
    entries, storage = read_dcp_metadata(path)
    keys = list(entries)
    roots = []
    for key in keys:
        if key.endswith(".format") and entries[key] == "BytesStorageMetadata":
            fmt = _read_dcp_value(path, key, storage.get(key))
            if type(fmt) is str and fmt in (STATE_FORMAT, GLOBAL_FORMAT):
                roots.append(key[: -len(".format")])
    wanted = [k for k in keys if any(k.startswith(r + ".") for r in roots)]
    if not wanted:
        raise CliError(f"no loader state in the checkpoint {path} (keys: {list_keys(keys)})")
    out: dict[str, Any] = {}
    for key in wanted:
        if entries[key] != "BytesStorageMetadata":
            raise CliError(
                f"{path}: entry {key!r} is stored as a tensor ({entries[key]}); a loader state "
                "never is -- the checkpoint was not written by dcp.save of a resumable_loader"
            )
        value = _read_dcp_value(path, key, storage.get(key))
        *parents, last = key.split(".")
        node = out
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise CliError(f"{path}: entry {key!r} lies inside another entry's value")
            node = child
        node[last] = value
    return out


# ---- writing: a new directory, the loader's entries replaced ----


def dcp_entries(state: dict[Any, Any]) -> dict[str, Any]:
    """The entries ``dcp.save`` stores ``state`` under: dotted key -> value. Dicts are opened
    (an empty one leaves no entry); a list is one entry unless it holds a dict, when its items
    are entries by index -- torch's ``flatten_state_dict`` rule, which ``dcp.load`` applies to
    the state_dict it fills."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    return dict(flat)


# The data file the new directory's loader entries go to.
DCP_SKIP_FILE = "__resumable_loader_skip.distcp"


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Reads a ``.metadata`` file into torch's own classes, to write it back changed. Only the
    names ``_DCP_CLASSES`` allows (dataclasses of torch's checkpoint metadata, an enum, torch's
    dtypes) are reachable -- as ``torch.load(weights_only=True)`` allows only its own list --
    and the file was read by the inert reader first (``read_dcp_metadata``)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES or (module == "torch" and _is_dtype_name(name)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {clip_text(module, 80)}.{clip_text(name, 80)}")


def write_dcp_copy(path: str, out: str, changed: dict[str, Any]) -> None:
    """``out``: a new directory with ``path``'s files, the ``changed`` entries in a data file
    of their own and the metadata pointing at it. Built beside ``out`` under a temporary
    name and renamed into place, so ``out`` appears complete or not at all. With nothing
    changed, it is a copy: the metadata's bytes too."""
    parent, name = os.path.split(os.path.abspath(out))
    with open_regular(os.path.join(path, DCP_METADATA)) as f:
        raw = f.read(MAX_DCP_METADATA + 1)
    try:
        # Nothing changed: the metadata is copied as it is, never rebuilt.
        meta = _DcpMetadataUnpickler(io.BytesIO(raw)).load() if changed else None
    except Exception as exc:
        # Allowed classes built from crafted arguments fail in their own ways (TypeError,
        # ValueError, ...): the file is damaged, which is one line and exit 2, not a traceback.
        raise CliError(
            f"{path}/{DCP_METADATA}: cannot be read back to be rewritten "
            f"({type(exc).__name__}: {first_line(str(exc))}); the checkpoint is damaged, "
            "nothing was written"
        ) from exc
    names = sorted(os.listdir(path))
    if changed and DCP_SKIP_FILE in names:
        raise CliError(f"{path} already holds {DCP_SKIP_FILE}: skip from the original checkpoint")
    fd, tmp_file = create_unique(parent, name)  # reserves a unique name for the directory
    os.close(fd)
    tmp = tmp_file[: -len(".tmp")] + ".dir.tmp"
    os.unlink(tmp_file)
    # mkdir, like O_EXCL, fails on any existing name (a planted symlink too): the directory
    # filled below, and removed on failure, is one this call made.
    os.mkdir(tmp, 0o777)
    made: list[str] = []
    try:
        for entry in names:
            if entry == DCP_METADATA:
                continue
            src = os.path.join(path, entry)
            if os.path.isdir(src) and not os.path.islink(src):
                raise CliError(f"{path} holds a directory {entry!r}; a DCP checkpoint is flat")
            with open_regular(src) as f_in:
                dst = os.path.join(tmp, entry)
                made.append(dst)
                with open(dst, "xb") as f_out:
                    while chunk := f_in.read(1 << 24):
                        f_out.write(chunk)
                    f_out.flush()
                    os.fsync(f_out.fileno())
        if meta is not None:
            _write_changed(tmp, meta, changed, made)
        md_path = os.path.join(tmp, DCP_METADATA)
        made.append(md_path)
        with open(md_path, "xb") as f_out:
            if meta is None:
                f_out.write(raw)
            else:
                pickle.dump(meta, f_out)
            f_out.flush()
            os.fsync(f_out.fileno())
        fsync_directory(tmp)
        # rename() silently replaces an empty directory at OUT: look once more, so that a
        # directory someone made meanwhile is never taken over.
        if os.path.lexists(out):
            raise CliError(f"{out} appeared while the result was written; not replaced")
        os.rename(tmp, out)
    except BaseException:
        for made_path in made:  # ours: created above under these names
            try:
                os.unlink(made_path)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_directory(parent)


def _write_changed(tmp: str, meta: Any, changed: dict[str, Any], made: list[str]) -> None:
    """The ``changed`` entries, into ``DCP_SKIP_FILE`` in ``tmp`` (its path noted in
    ``made``), and ``meta``'s storage records pointed at them."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    blob = os.path.join(tmp, DCP_SKIP_FILE)
    made.append(blob)
    where: dict[str, Any] = {}
    with open(blob, "xb") as f_out:
        for fqn, value in changed.items():
            buf = io.BytesIO()
            torch.save(value, buf)
            where[fqn] = _StorageInfo(DCP_SKIP_FILE, f_out.tell(), buf.tell())
            f_out.write(buf.getbuffer())
        f_out.flush()
        os.fsync(f_out.fileno())
    for index in list(meta.storage_data):
        if getattr(index, "fqn", None) in where:
            meta.storage_data[index] = where[index.fqn]
