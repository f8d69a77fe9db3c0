"""The two guards every reader of the CLI goes through: what it opens, and how much it walks.

``open_regular`` opens only a regular file: a FIFO given as PATH (or planted in a DCP
directory) would block the command forever waiting for a writer, and a device such as
``/dev/zero`` never ends. ``check_expansion`` refuses an unpickled object whose shared
references make it vastly larger as a tree than the file it came from, before the summary or
``--json`` walks it as one. Neither decodes anything; the decoders (``load_state``,
``torch.load(weights_only=True)``, the DCP metadata reader) are in ``readers`` and ``dcp``.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

from .messages import CliError


def open_regular(path: str) -> Any:
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


def read_bytes(path: str) -> bytes:
    """The whole of a regular file (``skip`` copies a file's bytes, not a re-encoding of them).

    Raises:
        CliError: the file cannot be read, or is not a regular file.
    """
    try:
        with open_regular(path) as f:
            return bytes(f.read())
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from exc


# A pickle can refer to one list many times: [a, a] with a = [b, b], ... is 40 levels of
# doubling in a few hundred bytes. The summary and --json walk values as a tree, so they would
# visit it 2**40 times. An honest file refers to each value at least once in its own bytes, so
# its tree has at most about as many values as the file has bytes; beyond this allowance on top,
# inspect refuses rather than walk.
EXPANSION_ALLOWANCE = 1 << 20


def check_expansion(obj: Any, size: int, path: str) -> None:
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
