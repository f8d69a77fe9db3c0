"""Command line tools: ``python -m resumable_loader inspect PATH [--key KEY] [--json]`` and
``python -m resumable_loader skip PATH --samples N [--key KEY] [-o OUT]``.
``inspect --check`` also checks a Stream's partition cursors (exit status 1 if broken).

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

Exit status: 0 on success, 2 with a one-line message on stderr for input that cannot be read,
1 when ``inspect --check`` finds a Stream's cursor table broken.

This module parses the arguments, runs ``inspect`` and maps failures to exit statuses; the work
is in the modules beside it, each importing only those listed after it:

    main      arguments, ``inspect``, exit statuses
    skip      ``skip``: the state moved on, written back (a file replaced, a DCP copy made)
    readers   PATH read (dump_state / torch.save / DCP) and the loader state found in it
    dcp       DCP directories: entries read as inert data, a changed copy written
    files     regular files only, and a bound on what an unpickled object expands to
    summary   ``inspect``'s text and JSON (imports only ``streams`` and ``messages``)
    streams   a Stream's block of ``inspect`` and its ``--check``, from the state alone
    messages  ``CliError`` and the helpers its one-line messages are made with
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..core.errors import CheckpointError
from ..state.ranks import is_global, split_global
from .messages import CliError, kind_of
from .readers import dig, find_state, key_label, looks_like_state, read_checkpoint
from .skip import run_skip
from .streams import check, read_table, table_lines
from .summary import format_summary, jsonable


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
    inspect.add_argument(
        "--partitions",
        action="store_true",
        help="also print a Stream's cursor table: one line per partition, one column per field",
    )
    inspect.add_argument(
        "--check",
        action="store_true",
        help=(
            "also check a Stream's cursor table (header, each cursor's width and ranges, each "
            "partition in one worker, the one its layout names); exit status 1 if it breaks one"
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
    skip.set_defaults(run=run_skip)
    return parser


def _inspect(args: argparse.Namespace) -> int:
    """``inspect``: PATH's loader state printed as a summary, or as JSON with ``--json``."""
    obj, source, from_dump = read_checkpoint(args.path)
    if args.key is not None:
        state = dig(obj, args.key, args.path)
        source += f", key {args.key!r}"
        if not isinstance(state, dict):
            raise CliError(
                f"the value at {args.key!r} in {args.path} is {kind_of(state)}, not a loader "
                "state (a dict); choose another --key"
            )
    elif isinstance(obj, dict) and (from_dump or looks_like_state(obj)):
        state = obj  # a dump_state file holds the state itself
    else:
        keys, state = find_state(obj, args.path)
        source += f", loader state found at key {key_label(keys)!r}"
    try:
        if args.json:
            text = json.dumps(jsonable(state), indent=2, allow_nan=True)
        else:
            text = format_summary(state, f"{args.path} ({source})")
    except RecursionError as exc:  # only a torch.save file can hold a reference cycle
        raise CliError(f"the state in {args.path} holds itself or is nested too deeply") from exc
    print(text)
    if args.partitions:
        _partitions(state)
    return _check(state) if args.check else 0


def _partitions(state: dict[str, Any]) -> None:
    """``inspect --partitions``: a Stream's cursor table (every rank's, for a global state)."""
    try:
        table = read_table(split_global(state) if is_global(state) else [state])
    except CheckpointError as exc:
        print(f"partitions: the global state is damaged: {exc}")
        return
    if table is None:
        print("partitions: not a Stream's state")
        return
    print("\n".join(table_lines(table)))


def _check(state: dict[str, Any]) -> int:
    """``inspect --check``: a Stream's cursor table checked (``cli/streams.py``); 1 if it
    breaks an invariant, each problem on a line of its own."""
    try:
        states = split_global(state) if is_global(state) else [state]
    except CheckpointError as exc:
        print(f"check: the global state is damaged: {exc}")
        return 1
    table = read_table(states)
    if table is None:
        print("check: not a Stream's state; --check checks a Stream's partition cursors")
        return 0
    problems = check(table)
    if not problems:
        print(f"check: ok ({len(table.cursors)} partition cursors)")
        return 0
    print(f"check: {len(problems)} problem" + "s" * (len(problems) != 1))
    for problem in problems:
        print(f"  {problem}")
    return 1


def _one_line(text: str) -> str:
    # A message that quotes a file (a key, a torch error) may hold newlines; exit status 2
    # promises one line on stderr.
    return " ".join(text.split())
