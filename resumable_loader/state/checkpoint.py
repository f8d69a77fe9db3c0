"""``save_checkpoint``: write a checkpoint file so that a crash never costs the previous one.

``torch.save(obj, "ckpt.pt")`` truncates ``ckpt.pt`` before it writes: a SIGKILL (a preemption,
the OOM killer) or a power loss during the write leaves a file that does not load, and the
previous checkpoint is gone with it. Writing elsewhere and renaming is the cure, but only when
every step is there:

1. a temporary file of a name no one else uses, in the same directory (a rename is atomic only
   within one filesystem), created exclusively (``O_EXCL``: never someone else's file, never
   through a planted symlink) with the permissions ``open()`` would give the checkpoint;
2. the bytes, then ``fsync`` of that file: without it the rename may reach the disk before the
   data does, and a power loss leaves an empty checkpoint under the final name;
3. ``os.replace`` over the final name: readers see the old file or the new one, never a mix;
4. ``fsync`` of the directory, so that the rename itself survives a power loss.

If the write fails (an exception, a full disk), the temporary file is removed -- by the name we
recorded when we created it -- and the previous checkpoint is untouched. If the process is killed
during the write, the temporary file stays (``.NAME.<random>.tmp`` beside the checkpoint; nothing
deletes files by a name pattern) and the previous checkpoint is untouched.

The steps are public to the package (not to users: ``__all__`` is ``save_checkpoint``) because
``cli/skip`` takes them too: ``write_atomic`` replaces a checkpoint keeping its owner and mode,
and a new DCP directory is reserved with ``create_unique`` and made durable with
``fsync_directory``.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import Any

__all__ = ["save_checkpoint"]

# Unique names: 64 random bits, so two writers (two ranks, two jobs) never pick the same one; an
# O_EXCL collision is retried anyway.
_TOKEN_BYTES = 8
_ATTEMPTS = 16


def save_checkpoint(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` to ``path`` atomically: after a crash at any moment, ``path`` holds either
    the previous checkpoint or the complete new one.

    The data go to a new temporary file beside ``path`` (``.NAME.<random>.tmp``), which is
    flushed to disk (``fsync``), renamed over ``path`` (``os.replace``), and the directory is
    flushed so that the rename is durable too. The checkpoint gets the permissions a new file
    gets from ``open()`` (``0o666`` less the umask).

    Args:
        obj: bytes (or a bytearray / memoryview), written as they are -- e.g. what
            :func:`dump_state` returns, or an encoded JSON document; anything else is written
            with ``torch.save``, for ``torch.load(path, weights_only=True)`` to read.
        path: the checkpoint's file name. Its directory must exist. If ``path`` is a symlink,
            the link itself is replaced by the new file.

    Raises:
        OSError: the file could not be created, written or renamed (e.g. a full disk).
        Exception: whatever ``torch.save`` raised for ``obj`` (e.g. an object it cannot
            pickle). In every case the temporary file has been removed and ``path`` is as it
            was.
    """
    write_atomic(obj, os.fspath(path), None)


def write_atomic(obj: Any, path: str, like: os.stat_result | None) -> None:
    """``save_checkpoint``'s write; with ``like`` (the stat of the file being replaced), the new
    file takes that file's owner, group and permission bits before it is renamed into place, so
    the replacement is the same file to everyone who could read (or not read) the old one.

    Args:
        obj: bytes-like, written as they are, or anything else, written with ``torch.save``.
        path: the final file name; its directory must exist.
        like: the stat of the file being replaced, or None for ``open()``'s permissions.

    Raises:
        PermissionError: ``like``'s owner or group cannot be given to the new file (only root
            may give a file away); nothing was replaced.
    """
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = create_unique(directory, name)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(obj, (bytes, bytearray, memoryview)):
                f.write(obj)
            else:
                import torch

                torch.save(obj, f)
            f.flush()
            if like is not None:
                _take_attributes(f.fileno(), like, path)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Ours: created above under this exact name. (A KeyboardInterrupt too: a Ctrl-C during
        # a long save should not leave a stray file behind.)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_directory(directory)


def _take_attributes(fd: int, like: os.stat_result, path: str) -> None:
    """Give the open file ``fd`` the owner, group and permission bits of ``like``."""
    mine = os.fstat(fd)
    if (mine.st_uid, mine.st_gid) != (like.st_uid, like.st_gid):
        try:
            os.fchown(fd, like.st_uid, like.st_gid)
        except PermissionError as exc:
            raise PermissionError(
                exc.errno,
                f"the new file cannot keep {path}'s owner and group (uid {like.st_uid}, gid "
                f"{like.st_gid}): only root can give a file to another user; nothing was "
                "replaced",
            ) from exc
    # After the chown, which clears the set-user/group-id bits a chmod would have set.
    os.fchmod(fd, stat.S_IMODE(like.st_mode))


def create_unique(directory: str, name: str) -> tuple[int, str]:
    """A new file ``.NAME.<random>.tmp`` in ``directory``, opened for writing: (fd, path).

    The caller owns the file under exactly that path, and removes it by that path on failure.

    Raises:
        FileExistsError: every random name tried was taken.
        OSError: the directory does not admit a new file.
    """
    for _ in range(_ATTEMPTS):
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(_TOKEN_BYTES)}.tmp")
        try:
            # O_EXCL: fails on any existing name, a symlink included, so we never write through
            # a link someone planted. Mode 0o666: the umask applies, as for open().
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        return fd, tmp
    raise FileExistsError(
        f"save_checkpoint: could not create a temporary file beside {name!r} in {directory!r}: "
        f"{_ATTEMPTS} random names were all taken"
    )


def fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable. Filesystems that cannot fsync a directory say
    EINVAL; they give no stronger guarantee to ask for, so that is not an error."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)
