"""``skip``: a saved loader state moved N samples on (``skip_samples``), written back.

A file is replaced atomically (``state.checkpoint.write_atomic``: a temporary file beside it,
fsync, rename), the new file keeping the old one's mode, owner and group, or written to OUT.
Refused, with nothing written:

* a read-only target, before anything is read: a checkpoint made read-only is one someone
  meant to keep, and a rename would replace it whatever its mode;
* a file with tensors saved on another device than the CPU: they are read onto the CPU and
  would be written back there, and the checkpoint would no longer load where it was saved.

``N`` 0 rewrites nothing (PATH keeps its bytes and mtime; OUT gets a copy of them).

A DCP directory is several files, which no rename replaces at once: its result is a new
directory OUT (``dcp.write_dcp_copy``), never the original nor a place inside it, and only
when the skipped state has exactly the entries the checkpoint has -- ``dcp.load`` fills only
the keys of the state_dict it is given, and would silently pass over a new one.
"""

from __future__ import annotations

import argparse
import os
import stat
import warnings
from typing import Any

from ..core.errors import CheckpointError
from ..state.checkpoint import write_atomic
from ..state.codec import dump_state
from ..state.skip import skip_samples, uncut
from .dcp import dcp_entries, load_dcp, read_dcp_metadata, write_dcp_copy
from .files import read_bytes
from .messages import CliError, kind_of, list_keys
from .readers import key_label, locate, read_checkpoint


def run_skip(args: argparse.Namespace) -> int:
    """``skip``: PATH's loader state moved ``args.samples`` on, written over PATH or to
    ``args.output``; a directory goes to ``_skip_dcp``. Returns the exit status (0).

    Raises:
        CliError: bad input, a protected target, or a state ``skip_samples`` refuses;
            nothing was written.
    """
    if args.samples < 0:
        raise CliError(f"--samples must be >= 0, not {args.samples}")
    if os.path.isdir(args.path):
        return _skip_dcp(args)
    out = args.output or args.path
    # Before anything is read: a protected file is refused at once, not after a long load.
    replaced = _replaced_file(out, args.output is not None)
    locations: set[str] = set()
    obj, _, from_dump = read_checkpoint(args.path, locations)
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
    keys, state = locate(obj, args.key, args.path, from_dump)
    new = _skipped(state, args.samples, args.path)
    where = f" (key {key_label(keys)!r})" if keys else ""
    if args.samples == 0:
        # Nothing moves: PATH keeps its bytes and its mtime (a rewrite through torch.save is
        # not byte-identical, and a new mtime reads as "changed" to backups and job
        # schedulers). OUT, if named, is a copy of PATH's bytes.
        if args.output is None:
            print(
                f"0 samples to skip in {args.path}{where}: nothing written, the file is as it was"
            )
            return 0
        payload: Any = read_bytes(args.path)
    else:
        if keys:
            parent = obj
            for k in keys[:-1]:
                parent = parent[k]
            if not isinstance(parent, (dict, list)):
                raise CliError(
                    f"{args.path}: the loader state sits inside {kind_of(parent)}, which cannot "
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


def _skipped(state: Any, n: int, path: str) -> Any:
    """``skip_samples(state, n)``; its warnings (a Stream's skipped rows are read at the next
    start) printed as notes on stdout."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            new = skip_samples(state, n)
        except CheckpointError as exc:
            raise CliError(f"{path}: {exc}") from exc
    for w in caught:
        print(f"note: {w.message}")
    return new


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


def _skip_dcp(args: argparse.Namespace) -> int:
    """A DCP directory: the result is a new directory (see the module docstring)."""
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
    obj = load_dcp(path)
    keys, state = locate(obj, args.key, path, False)
    new = _skipped(state, args.samples, path)
    where = f"(key {key_label(keys)!r})"
    if args.samples == 0:
        if out is None:
            print(
                f"0 samples to skip in {path} {where}: nothing written, the directory is as it was"
            )
            return 0
        write_dcp_copy(path, out, {})
        print(f"0 samples to skip in {path} {where}; copied it to {out}")
        return 0
    prefix = key_label(keys) + "." if keys else ""
    entries, _ = read_dcp_metadata(path)
    held = {fqn[len(prefix) :] for fqn in entries if fqn.startswith(prefix)}
    flat = dcp_entries(new)
    if set(flat) - held:
        # dcp.load fills the keys of the state_dict it is given. A state saved as
        # loader.state_dict() is loaded into a fresh loader's state_dict(), which has no
        # sample_cut: an entry added for it would be passed over, and the loader would resume
        # at the epoch's start. The same position without a cut fits the keys the checkpoint
        # has.
        try:
            flat = dcp_entries(uncut(new))
        except CheckpointError as exc:
            raise CliError(f"{path}: {exc}") from exc
    added, dropped = sorted(set(flat) - held), sorted(held - set(flat))
    if added or dropped:
        raise CliError(
            f"{path}: the skipped state does not fit the entries the checkpoint has (new: "
            f"{list_keys(added) or 'none'}; gone: {list_keys(dropped) or 'none'}), and "
            "dcp.load reads only the entries its state_dict names; skip in the job instead: "
            "state = resumable_loader.skip_samples(state, n) before dcp.save"
        )
    write_dcp_copy(path, out, {prefix + k: v for k, v in flat.items()})
    print(
        f"skipped {args.samples} samples of the loader state in {path} {where}; wrote the "
        f"new checkpoint directory {out}"
    )
    return 0


def _is_within(inner: str, outer: str) -> bool:
    """Whether the path ``inner`` is ``outer`` or lies under it, links resolved."""
    a, b = os.path.realpath(inner), os.path.realpath(outer)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)
