"""Command line tools: ``python -m resumable_loader inspect PATH [--key KEY] [--json]`` and
``python -m resumable_loader skip PATH --samples N [--key KEY] [-o OUT]``.

``inspect`` prints a readable summary of a saved loader state: where the loader stands (epoch,
consumed tasks), what it will re-send (outstanding tasks), and what each worker carries. PATH is a
file written from ``dump_state`` (recognised by its magic header), by ``torch.save`` (loaded with
``weights_only=True``), or a ``torch.distributed.checkpoint`` directory (its metadata read into
inert records, the loader's entries with ``weights_only=True``): inspecting an untrusted file or
directory runs no code from it, and nothing it reads is unpickled by plain ``pickle``.

``skip`` writes the state ``N`` samples further along (``skip_samples``), reading nothing of
the data: over PATH atomically (a temporary file, fsync, rename), keeping its mode, owner and
group, or to OUT; a read-only file is not replaced, and ``N`` 0 writes nothing. A DCP
directory is several files, which no rename replaces at once: its result is a new directory
OUT (the files copied, the loader's entries rewritten in a file of their own, the metadata
pointed at it).

Exit status: 0 on success, 2 with a one-line message on stderr for input that cannot be read.
"""

from __future__ import annotations

import argparse
import base64
import errno
import io
import json
import os
import pickle
import stat
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..core.errors import CheckpointError
from ..state.checkpoint import create_unique, fsync_directory, write_atomic
from ..state.codec import MAGIC, clip_repr, clip_text, dump_state, encoded_size, load_state
from ..state.ranks import GLOBAL_FORMAT, is_global, split_global
from ..state.schema import FORMAT, K_CONSUMED, K_DATASET, K_PLAN, KNOWN_KEYS
from ..state.seeds import SAMPLER, derive_seed

# What a state written by DataLoader.state_dict() holds: the schema's own constants, not copies.
STATE_FORMAT = FORMAT

# How much of a long list the summary shows: enough to recognise a task, short enough to read.
SHOW_TASKS = 5
SHOW_INDICES = 8
SHOW_KEYS = 20

MISSING = "-"


class CliError(Exception):
    """Bad input: reported as one line on stderr with exit status 2, never as a traceback."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 ok, 2 bad input or usage).

    Args:
        argv: the arguments after the program name; ``sys.argv[1:]`` when None.
    """
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        run: Callable[[argparse.Namespace], int] = args.run
        return run(args)
    except CliError as exc:
        print(f"{parser.prog} {args.command}: error: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `... inspect x | head`: the reader left, which is not an error. Point stdout at
        # /dev/null so the interpreter's flush at exit does not raise again (Python docs recipe).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m resumable_loader",
        description="Tools for resumable_loader checkpoints.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect = commands.add_parser(
        "inspect",
        help="summarise a saved loader state",
        description=(
            "Print a readable summary of a loader state saved with dump_state() or torch.save(). "
            "torch.save files are loaded with weights_only=True."
        ),
    )
    inspect.add_argument(
        "path",
        metavar="PATH",
        help="a dump_state or torch.save file, or a torch.distributed.checkpoint directory",
    )
    inspect.add_argument(
        "--key",
        help=(
            "where the loader state sits inside the file, as a dotted path (e.g. 'loader' or "
            "'train.loader'); by default the file itself, or the one loader state found in it"
        ),
    )
    inspect.add_argument(
        "--json",
        action="store_true",
        help=(
            'print the whole state as JSON instead (bytes as {"$bytes": BASE64}; non-finite '
            "floats as NaN/Infinity)"
        ),
    )
    inspect.set_defaults(run=_inspect)
    skip = commands.add_parser(
        "skip",
        help="move a saved loader state N samples on, reading none of them",
        description=(
            "Write the loader state N samples further along its stream (skip_samples()), "
            "reading nothing of the data. Over PATH (atomically) unless -o is given; a "
            "torch.distributed.checkpoint directory needs -o NEW_DIRECTORY. torch.save files "
            "are loaded with weights_only=True."
        ),
    )
    skip.add_argument(
        "path",
        metavar="PATH",
        help="a dump_state or torch.save file, or a torch.distributed.checkpoint directory",
    )
    skip.add_argument(
        "--samples", type=int, required=True, metavar="N", help="how many samples to skip"
    )
    skip.add_argument(
        "--key",
        help="where the loader state sits inside the file (as for inspect); by default the "
        "file itself, or the one loader state found in it",
    )
    skip.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="write the result here instead of over PATH (for a DCP directory: a new "
        "directory, which must not exist)",
    )
    skip.set_defaults(run=_skip)
    return parser


def _inspect(args: argparse.Namespace) -> int:
    obj, source, from_dump = _load(args.path)
    if args.key is not None:
        state = _dig(obj, args.key, args.path)
        source += f", key {args.key!r}"
        if not isinstance(state, dict):
            raise CliError(
                f"the value at {args.key!r} in {args.path} is {_kind(state)}, not a loader "
                "state (a dict); choose another --key"
            )
    elif isinstance(obj, dict) and (from_dump or _looks_like_state(obj)):
        state = obj  # a dump_state file holds the state itself
    else:
        keys, state = _find_state(obj, args.path)
        source += f", loader state found at key {_label(keys)!r}"
    try:
        if args.json:
            text = json.dumps(_jsonable(state), indent=2, allow_nan=True)
        else:
            text = format_summary(state, f"{args.path} ({source})")
    except RecursionError as exc:  # only a torch.save file can hold a reference cycle
        raise CliError(f"the state in {args.path} holds itself or is nested too deeply") from exc
    print(text)
    return 0


def _locate(obj: Any, key: str | None, path: str, from_dump: bool) -> tuple[list[Any], Any]:
    """The loader state in ``obj``: (the keys that lead to it, the state)."""
    if key is not None:
        keys = _key_path(obj, key, path)
        state = obj
        for k in keys:
            state = state[k]
        if not isinstance(state, dict):
            raise CliError(
                f"the value at {key!r} in {path} is {_kind(state)}, not a loader state (a "
                "dict); choose another --key"
            )
        return keys, state
    if isinstance(obj, dict) and (from_dump or _looks_like_state(obj)):
        return [], obj
    return _find_state(obj, path)


def _key_path(obj: Any, dotted: str, path: str) -> list[Any]:
    """The keys (dict keys as stored, list indices as ints) that ``_dig`` follows."""
    _dig(obj, dotted, path)  # raises the readable error for a wrong key
    keys: list[Any] = []
    current = obj
    for part in dotted.split("."):
        if isinstance(current, dict):
            k: Any = part if part in current else int(part)
        else:
            k = int(part)
        keys.append(k)
        current = current[k]
    return keys


def _skip(args: argparse.Namespace) -> int:
    from ..state.skip import skip_samples

    if args.samples < 0:
        raise CliError(f"--samples must be >= 0, not {args.samples}")
    if os.path.isdir(args.path):
        return _skip_dcp(args)
    out = args.output or args.path
    # Before anything is read: a protected file is refused at once, not after a long load.
    replaced = _replaced_file(out, args.output is not None)
    locations: set[str] = set()
    obj, _, from_dump = _load(args.path, locations)
    elsewhere = sorted(loc for loc in locations if loc != "cpu")
    if elsewhere:
        # Read onto the CPU and written back, they would come back as CPU tensors: a training
        # checkpoint that no longer loads where it was saved, or that loads slower.
        raise CliError(
            f"{args.path} holds tensors saved on {', '.join(map(repr, elsewhere[:3]))}, which "
            "this command reads onto the CPU and would write back there; nothing was written. "
            "Run skip on a machine with that device, or in Python: "
            "state = resumable_loader.skip_samples(state, n) before torch.save"
        )
    keys, state = _locate(obj, args.key, args.path, from_dump)
    try:
        new = skip_samples(state, args.samples)
    except CheckpointError as exc:
        raise CliError(f"{args.path}: {exc}") from exc
    where = f" (key {_label(keys)!r})" if keys else ""
    if args.samples == 0:
        # Nothing moves: PATH keeps its bytes and its mtime (a rewrite through torch.save is
        # not byte-identical, and a new mtime reads as "changed" to backups and job
        # schedulers). OUT, if named, is a copy of PATH's bytes.
        if args.output is None:
            print(
                f"0 samples to skip in {args.path}{where}: nothing written, the file is as it was"
            )
            return 0
        payload: Any = _read_bytes(args.path)
    else:
        if keys:
            parent = obj
            for k in keys[:-1]:
                parent = parent[k]
            if not isinstance(parent, (dict, list)):
                raise CliError(
                    f"{args.path}: the loader state sits inside {_kind(parent)}, which cannot "
                    "be changed; save it inside a dict"
                )
            parent[keys[-1]] = new
        else:
            obj = new
        payload = dump_state(obj) if from_dump else obj
    try:
        write_atomic(payload, out, replaced)
    except OSError as exc:
        raise CliError(f"cannot write {out}: {exc.strerror or exc}") from exc
    print(f"skipped {args.samples} samples of the loader state in {args.path}{where}; wrote {out}")
    return 0


def _replaced_file(target: str, named: bool) -> os.stat_result | None:
    """The stat of the file a write to ``target`` would replace (None if there is none), whose
    owner, group and mode the new file keeps. A file without write permission is refused: a
    checkpoint made read-only is one someone meant to keep, and a rename would replace it
    whatever its mode (root may write anything, so the mode bits are read, not access())."""
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CliError(f"cannot write {target}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise CliError(f"cannot write {target}: not a regular file")
    if not st.st_mode & 0o222 or not os.access(target, os.W_OK):
        other = "another -o OUT" if named else "-o OUT"
        raise CliError(
            f"{target} is read-only (mode {stat.S_IMODE(st.st_mode):04o}): skip does not "
            f"replace a checkpoint protected from writing; nothing was written. Write the "
            f"result elsewhere with {other}, or make the file writable first (chmod u+w) if "
            "it is meant to be replaced"
        )
    return st


def _read_bytes(path: str) -> bytes:
    try:
        with _open_regular(path) as f:
            return bytes(f.read())
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _skip_dcp(args: argparse.Namespace) -> int:
    """A DCP directory: the result is a new directory (see the module docstring)."""
    from ..state.skip import skip_samples

    path, out = args.path, args.output
    if out is not None and _is_within(out, path) and not _is_within(path, out):
        raise CliError(
            f"{out} lies inside {path}: the new checkpoint directory would be written into "
            "the original one; give -o a directory outside it"
        )
    if args.samples and (out is None or os.path.realpath(out) == os.path.realpath(path)):
        raise CliError(
            f"{path} is a torch.distributed.checkpoint directory: several files, which cannot "
            "be replaced all at once; give -o NEW_DIRECTORY (the result is written there, "
            "and the original is left as it was)"
        )
    if out is not None and os.path.lexists(out):
        raise CliError(f"{out} exists; -o names a new directory for the result")
    obj = _load_dcp(path)
    keys, state = _locate(obj, args.key, path, False)
    try:
        new = skip_samples(state, args.samples)
    except CheckpointError as exc:
        raise CliError(f"{path}: {exc}") from exc
    where = f"(key {_label(keys)!r})"
    if args.samples == 0:
        if out is None:
            print(
                f"0 samples to skip in {path} {where}: nothing written, the directory is as it was"
            )
            return 0
        _write_dcp_copy(path, out, {})
        print(f"0 samples to skip in {path} {where}; copied it to {out}")
        return 0
    prefix = _label(keys) + "." if keys else ""
    entries, _ = _read_dcp_metadata(path)
    held = {fqn[len(prefix) :] for fqn in entries if fqn.startswith(prefix)}
    flat = _dcp_entries(new)
    if set(flat) - held:
        # dcp.load fills the keys of the state_dict it is given. A state saved as
        # loader.state_dict() is loaded into a fresh loader's state_dict(), which has no
        # sample_cut: an entry added for it would be passed over, and the loader would resume
        # at the epoch's start. The same position without a cut fits the keys the checkpoint
        # has.
        from ..state.skip import uncut

        try:
            flat = _dcp_entries(uncut(new))
        except CheckpointError as exc:
            raise CliError(f"{path}: {exc}") from exc
    added, dropped = sorted(set(flat) - held), sorted(held - set(flat))
    if added or dropped:
        raise CliError(
            f"{path}: the skipped state does not fit the entries the checkpoint has (new: "
            f"{_list_keys(added) or 'none'}; gone: {_list_keys(dropped) or 'none'}), and "
            "dcp.load reads only the entries its state_dict names; skip in the job instead: "
            "state = resumable_loader.skip_samples(state, n) before dcp.save"
        )
    _write_dcp_copy(path, out, {prefix + k: v for k, v in flat.items()})
    print(
        f"skipped {args.samples} samples of the loader state in {path} {where}; wrote the "
        f"new checkpoint directory {out}"
    )
    return 0


def _dcp_entries(state: dict[Any, Any]) -> dict[str, Any]:
    """The entries ``dcp.save`` stores ``state`` under: dotted key -> value. Dicts are opened
    (an empty one leaves no entry); a list is one entry unless it holds a dict, when its items
    are entries by index -- torch's ``flatten_state_dict`` rule, which ``dcp.load`` applies to
    the state_dict it fills."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    return dict(flat)


def _is_within(inner: str, outer: str) -> bool:
    """Whether the path ``inner`` is ``outer`` or lies under it, links resolved."""
    a, b = os.path.realpath(inner), os.path.realpath(outer)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


# The data file the new directory's loader entries go to.
DCP_SKIP_FILE = "__resumable_loader_skip.distcp"


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Reads a ``.metadata`` file into torch's own classes, to write it back changed. Only the
    names ``_DCP_CLASSES`` allows (dataclasses of torch's checkpoint metadata, an enum, torch's
    dtypes) are reachable -- as ``torch.load(weights_only=True)`` allows only its own list --
    and the file was read by the inert reader first (``_read_dcp_metadata``)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES or (module == "torch" and _is_dtype_name(name)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {clip_text(module, 80)}.{clip_text(name, 80)}")


def _write_dcp_copy(path: str, out: str, changed: dict[str, Any]) -> None:
    """``out``: a new directory with ``path``'s files, the ``changed`` entries in a data file
    of their own and the metadata pointing at it. Built beside ``out`` under a temporary
    name and renamed into place, so ``out`` appears complete or not at all. With nothing
    changed, it is a copy: the metadata's bytes too."""
    parent, name = os.path.split(os.path.abspath(out))
    with _open_regular(os.path.join(path, DCP_METADATA)) as f:
        raw = f.read(MAX_DCP_METADATA + 1)
    try:
        # Nothing changed: the metadata is copied as it is, never rebuilt.
        meta = _DcpMetadataUnpickler(io.BytesIO(raw)).load() if changed else None
    except Exception as exc:
        # Allowed classes built from crafted arguments fail in their own ways (TypeError,
        # ValueError, ...): the file is damaged, which is one line and exit 2, not a traceback.
        raise CliError(
            f"{path}/{DCP_METADATA}: cannot be read back to be rewritten "
            f"({type(exc).__name__}: {_first_line(str(exc))}); the checkpoint is damaged, "
            "nothing was written"
        ) from exc
    names = sorted(os.listdir(path))
    if changed and DCP_SKIP_FILE in names:
        raise CliError(f"{path} already holds {DCP_SKIP_FILE}: skip from the original checkpoint")
    fd, tmp_file = create_unique(parent, name)  # reserves a unique name for the directory
    os.close(fd)
    tmp = tmp_file[: -len(".tmp")] + ".dir.tmp"
    os.unlink(tmp_file)
    os.mkdir(tmp, 0o777)
    made: list[str] = []
    try:
        for entry in names:
            if entry == DCP_METADATA:
                continue
            src = os.path.join(path, entry)
            if os.path.isdir(src) and not os.path.islink(src):
                raise CliError(f"{path} holds a directory {entry!r}; a DCP checkpoint is flat")
            with _open_regular(src) as f_in:
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


def _load(path: str, locations: set[str] | None = None) -> tuple[Any, str, bool]:
    """Read PATH as a dump_state or torch.save file, or the loader entries of a DCP
    directory: (object, description, is a dump file). A torch.save file's tensors are read
    onto the CPU; ``locations`` (if given) receives the devices they were saved on."""
    if os.path.isdir(path):
        return _load_dcp(path), "torch.distributed.checkpoint directory", False
    try:
        with _open_regular(path) as f:
            # Sniff first: a torch.save training checkpoint can be gigabytes, and torch.load
            # reads it itself.
            is_dump = f.read(len(MAGIC)) == MAGIC
            data = f.read() if is_dump else b""
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if is_dump:
        try:
            state = load_state(MAGIC + data)
        except CheckpointError as exc:
            raise CliError(f"{path}: {exc}") from exc
        return state, f"dump_state file, {len(MAGIC) + len(data)} bytes, checksum ok", True
    try:
        import torch
    except ImportError as exc:
        raise CliError(
            f"{path} does not start with the dump_state magic {MAGIC!r}, and torch (needed to "
            "read torch.save files) is not installed"
        ) from exc
    try:
        obj = torch.load(path, weights_only=True, map_location=_on_cpu(locations))
    except Exception as exc:
        raise CliError(
            f"{path} is neither a dump_state file (no {MAGIC!r} magic) nor a file that "
            f"torch.load(weights_only=True) reads ({type(exc).__name__}: "
            f"{_first_line(str(exc))})"
        ) from exc
    _check_expansion(obj, os.path.getsize(path), path)
    return obj, "torch.save file", False


def _on_cpu(locations: set[str] | None) -> Any:
    """A ``map_location`` for ``torch.load`` that keeps every storage on the CPU, where it is
    deserialised, and notes in ``locations`` the device each was saved on."""
    if locations is None:
        return "cpu"

    def keep(storage: Any, location: str) -> Any:
        locations.add(str(location))
        return storage

    return keep


# A pickle can refer to one list many times: [a, a] with a = [b, b], ... is 40 levels of
# doubling in a few hundred bytes. The summary and --json walk values as a tree, so they would
# visit it 2**40 times. An honest file refers to each value at least once in its own bytes, so
# its tree has at most about as many values as the file has bytes; beyond this allowance on top,
# inspect refuses rather than walk.
EXPANSION_ALLOWANCE = 1 << 20


def _check_expansion(obj: Any, size: int, path: str) -> None:
    """Refuse an object from a file of ``size`` bytes whose values, counted as a tree (shared
    containers once per place they appear), number more than ``size + EXPANSION_ALLOWANCE``.
    Each container is walked once, so this costs what the file holds, not what it expands to.
    """
    limit = size + EXPANSION_ALLOWANCE
    container = (dict, list, tuple)
    if not isinstance(obj, container):
        return
    counted: dict[int, int] = {}  # id -> the values under a container walked, itself included
    open_ids = {id(obj)}
    frames: list[list[Any]] = [[_children(obj), id(obj), 1]]
    while frames:
        frame = frames[-1]
        child = next(frame[0], _END)
        if child is _END:
            frames.pop()
            open_ids.discard(frame[1])
            counted[frame[1]] = frame[2]
            if frames:
                frames[-1][2] += frame[2]
            continue
        if not isinstance(child, container) or id(child) in open_ids:
            frame[2] += 1  # a leaf, or a cycle (the summary's recursion guard reports those)
        elif id(child) in counted:
            frame[2] += counted[id(child)]
        elif not any(issubclass(k, container) for k in set(map(type, _children(child)))):
            counted[id(child)] = len(child) + 1  # only leaves: counted at C speed
            frame[2] += len(child) + 1
        else:
            open_ids.add(id(child))
            frames.append([_children(child), id(child), 1])
            continue
        if frame[2] > limit:
            raise CliError(
                f"{path} refers to its own values so often that they expand to more than "
                f"{limit} values ({size} bytes of file); a crafted file? inspect does not walk it"
            )


_END = object()


def _children(value: Any) -> Any:
    return iter(value.values() if isinstance(value, dict) else value)


def _open_regular(path: str) -> Any:
    """Open a file for reading, refusing anything but a regular file: opening a FIFO would wait
    forever for a writer, and a device (/dev/zero) never ends."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _load_dcp(path: str) -> Any:
    """The loader states of a torch.distributed.checkpoint directory, read without torch's
    reader: it unpickles ``.metadata`` with plain ``pickle`` and non-tensor entries with
    ``torch.load(weights_only=False)``, so a planted file would run its code. Here the metadata
    goes through a reader that builds only inert records (``_DcpUnpickler``), and each wanted
    entry's bytes are read at the offset the metadata gives and loaded with
    ``torch.load(weights_only=True)``. Only the loader's entries are read: those beside a
    ``*.format`` entry that names a loader state; never the model's tensors.
    """
    entries, storage = _read_dcp_metadata(path)
    keys = list(entries)
    roots = []
    for key in keys:
        if key.endswith(".format") and entries[key] == "BytesStorageMetadata":
            fmt = _read_dcp_value(path, key, storage.get(key))
            if type(fmt) is str and fmt in (STATE_FORMAT, GLOBAL_FORMAT):
                roots.append(key[: -len(".format")])
    wanted = [k for k in keys if any(k.startswith(r + ".") for r in roots)]
    if not wanted:
        raise CliError(f"no loader state in the checkpoint {path} (keys: {_list_keys(keys)})")
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
            f"{_first_line(str(exc))})"
        ) from exc
    _check_expansion(value, len(data), f"{path}: entry {key!r}")
    return value


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


def _read_dcp_metadata(path: str) -> tuple[dict[str, str], dict[str, Any]]:
    """A DCP directory's entries (key -> the name of its metadata class) and the storage
    records of its non-tensor entries (key -> the fields of its _StorageInfo)."""
    meta_path = os.path.join(path, DCP_METADATA)
    not_dcp = f"{path} is a directory but not a torch.distributed.checkpoint one"
    try:
        with _open_regular(meta_path) as f:
            data = f.read(MAX_DCP_METADATA + 1)
    except OSError as exc:
        raise CliError(f"{not_dcp} (cannot read {DCP_METADATA}: {exc.strerror or exc})") from exc
    if len(data) > MAX_DCP_METADATA:
        raise CliError(f"{meta_path} is larger than {MAX_DCP_METADATA >> 20} MiB; not read")
    try:
        md = _DcpUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # UnpicklingError, EOFError, ValueError, TypeError, ...
        raise CliError(
            f"{not_dcp}: its {DCP_METADATA} cannot be read safely: {_first_line(str(exc))}"
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
        with _open_regular(os.path.join(path, name)) as f:
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


def _looks_like_state(obj: dict[Any, Any]) -> bool:
    # A state without a "format" key (hand-made, or from an older writer) still has several of
    # the schema's keys, "consumed" among them; a training checkpoint around a state may share
    # generic ones ("epoch", "config", "dataset"), but not that one.
    fmt = obj.get("format")
    if isinstance(fmt, str) and fmt in (STATE_FORMAT, GLOBAL_FORMAT):
        return True
    return K_CONSUMED in obj and len(set(KNOWN_KEYS) & set(obj)) >= 3


# How far the search for the loader state looks: a training checkpoint nests its parts a few
# levels (``trainer.state.loader``, ``states.0.loader``); a file nested deeper, or with more
# containers than this, is not walked to the end -- --key says where the state is.
SEARCH_DEPTH = 16
SEARCH_CONTAINERS = 100_000


def _find_state(obj: Any, path: str) -> tuple[list[Any], dict[Any, Any]]:
    """The one loader state in ``obj``, at any depth up to ``SEARCH_DEPTH`` through dicts,
    lists and tuples: (the keys that lead to it, the state). A state is not searched inside;
    any other container reached twice (a torch.save file may share one, or hold itself) is
    searched once."""
    found: list[tuple[list[Any], dict[Any, Any]]] = []
    seen: set[int] = set()
    stack: list[tuple[list[Any], Any]] = [([], obj)]
    cut_short = ""
    while stack:
        keys, value = stack.pop()
        # A state is counted at every key that holds it (torch.save keeps one object saved
        # twice as one): a skip written at one key would leave the other behind.
        if keys and isinstance(value, dict) and _looks_like_state(value):
            found.append((keys, value))
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        if len(seen) > SEARCH_CONTAINERS:
            cut_short = f"; the search stopped after {SEARCH_CONTAINERS} dicts and lists"
            break
        if len(keys) >= SEARCH_DEPTH:
            cut_short = f"; the search looks {SEARCH_DEPTH} levels deep"
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value)
        inner = [([*keys, k], v) for k, v in items if isinstance(v, (dict, list, tuple))]
        stack.extend(reversed(inner))  # popped in the file's order
    if len(found) == 1:
        return found[0]
    if found:
        labels = [_label(keys) for keys, _ in found]
        raise CliError(
            f"{path} holds several loader states ({_list_keys(labels)}); choose one with "
            f"--key (e.g. --key {labels[0]})"
        )
    raise CliError(
        f"no loader state found in {path}{cut_short}; pass --key to say where it is "
        f"({_top_level(obj)})"
    )


def _label(keys: list[Any]) -> str:
    """The dotted key for a path of keys, as --key takes it."""
    return ".".join(map(str, keys))


def _dig(obj: Any, dotted: str, path: str) -> Any:
    """Follow a dotted key ('train.loader', 'states.0') into nested dicts and lists."""
    current = obj
    walked: list[str] = []
    for part in dotted.split("."):
        where = repr(".".join(walked)) if walked else "the top level"
        if isinstance(current, dict):
            if part in current:
                current = current[part]
            elif _is_int(part) and int(part) in current:
                current = current[int(part)]
            else:
                keys = f"{where} has keys: {_list_keys(current)}" if walked else ""
                raise CliError(
                    f"no key {dotted!r} in {path}: "
                    + (f"{keys}; {_top_level(obj)}" if keys else _top_level(obj))
                )
        elif isinstance(current, (list, tuple)) and _is_int(part) and int(part) < len(current):
            current = current[int(part)]
        else:
            raise CliError(
                f"no key {dotted!r} in {path}: {where} is {_kind(current)}, which has no key "
                f"{part!r}; {_top_level(obj)}"
            )
        walked.append(part)
    return current


def _top_level(obj: Any) -> str:
    if isinstance(obj, dict):
        return f"top-level keys: {_list_keys(obj)}" if obj else "the file holds an empty dict"
    return f"the file holds {_kind(obj)}, not a dict"


def _list_keys(keys: Any) -> str:
    names = [repr(k) if not isinstance(k, str) else k for k in keys]
    shown = ", ".join(names[:SHOW_KEYS])
    return shown + (f", ... ({len(names)} in all)" if len(names) > SHOW_KEYS else "")


# ---------------------------------------------------------------------------------------------
# The summary. Every field may be missing or of the wrong type (a hand-edited file, a state from
# another writer): each one is shown as "-" when absent and generically when it is not what the
# schema says, so inspecting never fails on the contents of a state.


def format_summary(state: dict[Any, Any], source: str = "") -> str:
    """A readable multi-line summary of a loader state dict (or of a job's global state: its
    world size, then each rank's state)."""
    if is_global(state):
        return _global_summary(state, source)
    out = _Lines()
    out.line(f"resumable_loader state: {source}" if source else "resumable_loader state")
    fmt, version = state.get("format", MISSING), state.get("version", MISSING)
    out.field("format", f"{_scalar(fmt)}, version {_scalar(version)}")
    if isinstance(fmt, str) and fmt != STATE_FORMAT:
        out.line(f"  (not {STATE_FORMAT!r}: fields below may mean something else)")

    config = state.get("config", MISSING)
    out.line("config")
    if isinstance(config, dict):
        _config_lines(out, config)
    else:
        out.field("  (config)", _describe(config))
    _dataset_lines(out, state.get(K_DATASET, MISSING), state.get(K_PLAN, MISSING))

    seed, epoch = state.get("seed", MISSING), state.get("epoch", MISSING)
    out.field("seed", _scalar(seed) if seed is not None else "None (drawn when the epoch begins)")
    out.field("epoch", _scalar(epoch))
    if _is_count(seed) and _is_count(epoch):
        distributed = isinstance(config, dict) and str(config.get("sampler")).startswith(
            "distributed("
        )
        shuffle = (
            "the DistributedSampler's (its seed + epoch)"
            if distributed
            else str(derive_seed(SAMPLER, seed))
        )
        out.field("epoch seeds", f"shuffle {shuffle}; each batch from (seed, task id)")
    consumed = state.get("consumed", MISSING)
    ahead = state.get("delivered_ahead", MISSING)
    out.field(
        "position",
        f"{_scalar(consumed)} tasks consumed; delivered ahead: {_int_list(ahead, SHOW_INDICES)}",
    )
    cut = state.get("sample_cut", MISSING)
    if isinstance(cut, dict):
        holes = cut.get("holes")
        out.field(
            "sample cut",
            f"the rest of the epoch from position {_scalar(cut.get('start', MISSING))}"
            + (f", less {_describe(holes)} delivered ahead" if holes else "")
            + "; tasks count from there",
        )
    elif cut is not MISSING:
        out.field("sample cut", _describe(cut))
    dist = state.get("distributed", MISSING)
    if isinstance(dist, dict):
        history = dist.get("history") or "none"
        out.field(
            "sampler epoch",
            f"{_scalar(dist.get('sampler_epoch', MISSING))} (DistributedSampler); resizes "
            "within it [[world size, [samples each rank took]], ...]: "
            + clip_text(str(history), 60),
        )
    sampler = config.get("sampler") if isinstance(config, dict) else None
    _outstanding_lines(out, state.get("outstanding", MISSING), sampler, consumed)
    sampler_state = state.get("sampler_state", MISSING)
    if sampler_state is MISSING or sampler_state is None:
        out.field("sampler_state", "absent" if sampler_state is None else MISSING)
    else:
        out.field("sampler_state", f"present: {_describe(sampler_state)}")
    _worker_lines(out, state.get("workers", MISSING), state.get("next_worker", MISSING))
    _skipped_lines(out, state.get("skipped", MISSING))
    _skipped_sample_lines(out, state.get("skipped_samples", MISSING))
    extra = [k for k in state if k not in KNOWN_KEYS]
    if extra:
        out.line(f"other keys ({len(extra)})")
        for key in extra[:SHOW_KEYS]:
            out.field(f"  {clip_text(str(key), 12)}", _describe(state[key]))
        if len(extra) > SHOW_KEYS:
            out.line(f"  ... {len(extra) - SHOW_KEYS} more")
    return out.text()


def _global_summary(state: dict[Any, Any], source: str) -> str:
    head = f"resumable_loader global state: {source}" if source else "resumable_loader global state"
    try:
        ranks = split_global(state)
    except CheckpointError as exc:
        return f"{head}\n  {exc}"
    parts = [f"{head}\n  world size {len(ranks)} (any number of ranks can load it)"]
    for r, rank_state in enumerate(ranks):
        parts.append(format_summary(rank_state, f"rank {r} of {len(ranks)}"))
    return "\n".join(parts)


def _config_lines(out: _Lines, config: dict[Any, Any]) -> None:
    def get(key: str) -> str:
        return _scalar(config.get(key, MISSING))

    kind = config.get("dataset_kind", MISSING)
    length = config.get("dataset_len", MISSING)
    if type(length) is int:
        size = f"{length} samples"
    else:
        size = "length unknown" if length is None else f"length {_scalar(length)}"
    out.field("  dataset", f"{_scalar(kind)}, {size}")
    out.field("  batch_size", f"{get('batch_size')} (drop_last: {get('drop_last')})")
    if config.get("batch_sampler") is not None:
        out.field("  batch_sampler", get("batch_sampler"))
    out.field("  sampler", get("sampler"))
    out.field("  num_workers", get("num_workers"))
    out.field("  distributed", f"rank {get('rank')} of world size {get('world_size')}")
    known = {"dataset_kind", "dataset_len", "batch_size", "batch_sampler", "drop_last", "sampler"}
    known |= {"num_workers", "world_size", "rank"}
    for key, value in config.items():
        if key not in known:
            out.field(f"  {clip_text(str(key), 12)}", _describe(value))


def _dataset_lines(out: _Lines, record: Any, plan: Any) -> None:
    """The data the state was taken on: the dataset's class and fingerprint, and a Mixture's
    sources (its plan holds their names, lengths and fingerprints)."""
    if record is MISSING:
        out.field("dataset", "- (not recorded: a resume checks the length only)")
    elif isinstance(record, dict) and isinstance(record.get("class"), str):
        fp = record.get("fingerprint", MISSING)
        if fp is None and isinstance(plan, dict):
            said = "fingerprints per source (data_plan)"
        elif fp is None:
            said = "no fingerprint() (class and length checked)"
        else:
            said = f"fingerprint {_fingerprint(fp)}"
        out.field("dataset", f"{clip_text(record['class'], 100)}; {said}")
    else:
        out.field("dataset", _describe(record))
    if isinstance(plan, dict):
        _plan_lines(out, plan)
    elif plan is not MISSING and plan is not None:
        out.field("data_plan", _describe(plan))


def _plan_lines(out: _Lines, plan: dict[Any, Any]) -> None:
    """A Mixture's plan: seed, epoch, num_samples, newest weights, and each source."""
    weights = plan.get("weights", MISSING)
    if isinstance(weights, list) and weights and isinstance(weights[-1], dict):
        newest = weights[-1]
        segments = f"{len(weights)} segment" + "s" * (len(weights) != 1)
        said = (
            f"{clip_repr(newest.get('weights', MISSING), 80)} from position "
            f"{_scalar(newest.get('from', MISSING))} ({segments})"
        )
    else:
        said = _describe(weights)
    out.field(
        "data_plan",
        f"seed {_scalar(plan.get('seed', MISSING))}, epoch {_scalar(plan.get('epoch', MISSING))}"
        f", num_samples {_scalar(plan.get('num_samples', MISSING))}; weights {said}",
    )
    rests = plan.get("rests", MISSING)
    if isinstance(rests, list) and rests and isinstance(rests[-1], dict):
        # Weights changed at a resume inside a shuffled epoch: keyed by the order, not positions.
        last = rests[-1]
        out.line(
            f"{'':17}and {clip_repr(last.get('weights', MISSING), 80)} from place "
            f"{_scalar(last.get('from', MISSING))} of epoch {_scalar(last.get('epoch', MISSING))}"
            f"'s sampler order ({len(rests)} change" + "s" * (len(rests) != 1) + " inside an epoch)"
        )
    elif rests is not MISSING:
        out.line(f"{'':17}rests: {_describe(rests)}")
    sources = plan.get("sources", MISSING)
    if not isinstance(sources, list):
        out.line(f"{'':17}sources: {_describe(sources)}")
        return
    for source in sources[:SHOW_KEYS]:
        if isinstance(source, dict):
            out.line(
                f"{'':17}source {_describe(source.get('name', MISSING))}: "
                f"{_scalar(source.get('length', MISSING))} items, fingerprint "
                f"{_fingerprint(source.get('fingerprint', MISSING))}"
            )
        else:
            out.line(f"{'':17}{_describe(source)}")
    if len(sources) > SHOW_KEYS:
        out.line(f"{'':17}... {len(sources) - SHOW_KEYS} more")


def _fingerprint(value: Any) -> str:
    # Longer than other strings: a digest is compared by eye, and sha256 hex alone is 64.
    return repr(clip_text(value, 100)) if isinstance(value, str) else _describe(value)


def _outstanding_lines(out: _Lines, outstanding: Any, sampler: Any, consumed: Any) -> None:
    if outstanding is MISSING and isinstance(sampler, str) and _is_count(consumed):
        if sampler == "sequential" or sampler.startswith("random("):
            out.field(
                "outstanding",
                f"- (built-in sampler: tasks {consumed} on are recomputed from the seed)",
            )
            return
        if sampler.startswith("fastforward:"):
            out.field(
                "outstanding",
                f"- (the sampler is replayed for {consumed} tasks, then tasks {consumed} on "
                "are drawn)",
            )
            return
    if not isinstance(outstanding, list):
        out.field("outstanding", _describe(outstanding))
        return
    out.field("outstanding", f"{len(outstanding)} tasks")
    for entry in outstanding[:SHOW_TASKS]:
        if isinstance(entry, list) and len(entry) == 2:
            task_id, indices = entry
            out.line(f"{'':17}task {_scalar(task_id)}: {_indices(indices)}")
        else:
            out.line(f"{'':17}{_describe(entry)}")
    if len(outstanding) > SHOW_TASKS:
        out.line(f"{'':17}... {len(outstanding) - SHOW_TASKS} more")


def _worker_lines(out: _Lines, workers: Any, next_worker: Any) -> None:
    if not isinstance(workers, list):
        out.field("workers", f"{_describe(workers)} (next: {_scalar(next_worker)})")
        return
    out.field("workers", f"{len(workers)} (next: {_scalar(next_worker)})")
    if not workers:
        return
    out.line(f"  {'id':>4}  {'delivered':>9}  {'exhausted':<9}  {'state_at':>8}  dataset_state")
    for worker in workers:
        if not isinstance(worker, dict):
            out.line(f"  {_describe(worker)}")
            continue
        exhausted = worker.get("exhausted", MISSING)
        flag = "yes" if exhausted is True else "no" if exhausted is False else _scalar(exhausted)
        dataset_state = worker.get("dataset_state", MISSING)
        ds = "None" if dataset_state is None else _describe(dataset_state)
        if isinstance(dataset_state, (dict, list)):
            ds += _preview(dataset_state)
        out.line(
            f"  {_scalar(worker.get('id', MISSING)):>4}  "
            f"{_scalar(worker.get('delivered', MISSING)):>9}  {flag:<9}  "
            f"{_scalar(worker.get('state_at', MISSING)):>8}  {ds}"
        )


def _skipped_lines(out: _Lines, skipped: Any) -> None:
    if not isinstance(skipped, list):
        out.field("skipped", _describe(skipped))
        return
    out.field("skipped", f"{len(skipped)} poison tasks" if skipped else "none")
    for entry in skipped[:SHOW_TASKS]:
        if isinstance(entry, list) and len(entry) == 3:
            epoch, task_id, indices = entry
            line = f"epoch {_scalar(epoch)} task {_scalar(task_id)}: {_indices(indices)}"
            out.line(f"{'':17}{line}")
        else:
            out.line(f"{'':17}{_describe(entry)}")
    if len(skipped) > SHOW_TASKS:
        out.line(f"{'':17}... {len(skipped) - SHOW_TASKS} more")


def _skipped_sample_lines(out: _Lines, skipped: Any) -> None:
    if skipped is MISSING:
        return
    if not isinstance(skipped, list):
        out.field("skipped samples", _describe(skipped))
        return
    total = sum(e[2] for e in skipped if isinstance(e, list) and len(e) == 3 and _is_count(e[2]))
    out.field("skipped samples", f"{total} in {len(skipped)} skips" if skipped else "none")
    for entry in skipped[:SHOW_TASKS]:
        if isinstance(entry, list) and len(entry) == 3:
            epoch, before, count = entry
            out.line(
                f"{'':17}epoch {_scalar(epoch)}: {_scalar(count)} samples, after "
                f"{_scalar(before)} of the epoch"
            )
        else:
            out.line(f"{'':17}{_describe(entry)}")
    if len(skipped) > SHOW_TASKS:
        out.line(f"{'':17}... {len(skipped) - SHOW_TASKS} more")


class _Lines:
    def __init__(self) -> None:
        self._lines: list[str] = []

    def line(self, text: str) -> None:
        self._lines.append(text)

    def field(self, name: str, value: str) -> None:
        self._lines.append(f"{name:<16} {value}")

    def text(self) -> str:
        return "\n".join(self._lines)


def _scalar(value: Any) -> str:
    """A short rendering of a value expected to be a scalar; '-' when it is missing."""
    if value is MISSING:
        return MISSING
    if isinstance(value, str):
        return clip_text(value, 60)
    return _describe(value)


def _indices(indices: Any) -> str:
    if not isinstance(indices, list):
        return _describe(indices)
    return f"{len(indices)} indices {_int_list(indices, SHOW_INDICES)}"


def _int_list(values: Any, limit: int) -> str:
    if not isinstance(values, list):
        return _describe(values)
    shown = ", ".join(clip_text(_scalar(v), 20) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def _describe(value: Any) -> str:
    """One line saying what a value is: type, size, first keys, encoded size."""
    if value is MISSING:
        return MISSING
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(clip_text(value, 60))
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        keys = [clip_text(str(k), 20) for k in list(value)[:6]]
        more = ", ..." if len(value) > 6 else ""
        text = f"dict, {len(value)} keys" + (f" ({', '.join(keys)}{more})" if keys else "")
        return text + _size_suffix(value)
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}" + _size_suffix(value)
    kind = type(value)
    shape = getattr(value, "shape", None)
    return f"{kind.__module__}.{kind.__qualname__}" + (f" {tuple(shape)}" if shape else "")


def _size_suffix(value: Any) -> str:
    size = encoded_size(value)
    return "" if size is None else f", {_human_bytes(size)}"


def _human_bytes(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    if size < 1024**2:
        return f"{size / 1024:.1f} KiB"
    return f"{size / 1024**2:.1f} MiB"


def _jsonable(value: Any) -> Any:
    """A JSON-ready copy: bytes as {"$bytes": base64}, keys as str, other objects by repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        return {
            k if isinstance(k, (str, int)) and not isinstance(k, bool) else repr(k): _jsonable(v)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return {"$repr": clip_text(repr(value), 200)}


def _kind(value: Any) -> str:
    return f"a {type(value).__name__}"


def _preview(value: Any) -> str:
    """': ' and the first characters of a small container, if it can be shown as JSON."""
    try:
        return ": " + clip_text(json.dumps(_jsonable(value), ensure_ascii=False), 60)
    except (RecursionError, ValueError):
        return ""  # it holds itself (torch.save allows cycles): the line above says enough


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit()


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return clip_text(lines[0], 200) if lines else "no message"


def _one_line(text: str) -> str:
    return " ".join(text.split())
