"""A worker's shared memory has no name: anonymous memory files (``memfd_create``).

torch's allocator makes a batch's shared memory with ``shm_open("/torch_<pid>_...")``, maps it
and unlinks the name a moment later. A worker killed in between (the OOM killer does not wait)
leaves that name in /dev/shm, holding its memory until someone deletes it -- and nobody can
tell, from the name alone, a dead worker's leftover from another job's live segment or from a
batch passed on to another process (issue #25: we never delete by name pattern). So inside our
workers, the allocation torch's collate and our transport use (``_new_using_fd_cpu``) makes a
``memfd`` instead: the same shared mapping, passed to the main process as an fd as before, but
with no name anywhere. Its memory goes when the last fd and mapping go -- a SIGKILLed worker's
included -- and it is not bounded by the size of /dev/shm (a container's 64 MiB default), only
by the memory the job may use.

The pages are reserved at allocation (``posix_fallocate``), as torch does for /dev/shm, so a
lack of memory is an error there, reported in torch's words (the transport's small-/dev/shm
fallback recognises them), and never a SIGBUS while the batch is written.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import torch

from ...core.compat import set_shared_allocator, storage_from_fd

_NAME = "resumable_loader-batch"
_storage_from_fd = storage_from_fd()  # torch's, private (``core.compat``)


def reserve(fd: int, nbytes: int, name: str) -> None:
    """Size memfd ``fd`` (named ``name``) to ``nbytes`` with its pages reserved now: a lack of
    memory fails here, never later as a SIGBUS on first touch.

    Raises:
        RuntimeError: no room, in the words of torch's allocator ("unable to allocate shared
            memory(shm)", with the errno), so that callers treat it as a full /dev/shm.
    """
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        code = exc.errno if exc.errno is not None else errno.ENOMEM
        raise RuntimeError(
            f"unable to allocate shared memory(shm) for file <memfd:{name}>: "
            f"{os.strerror(code)} ({code})"
        ) from None


def new_anonymous_shared(nbytes: int) -> torch.UntypedStorage:
    """A CPU storage of ``nbytes`` in shared memory that has no name (see the module docstring).

    Raises:
        RuntimeError: the memory could not be reserved (torch's "unable to allocate shared
            memory(shm)" wording, with the errno).
    """
    fd = os.memfd_create(_NAME, os.MFD_CLOEXEC)
    try:
        if nbytes:
            reserve(fd, nbytes, _NAME)
        # torch keeps a duplicate of the fd for the storage's life; ours is closed below.
        return _storage_from_fd(fd, nbytes)
    finally:
        os.close(fd)


def _new_using_fd_cpu(cls: Any, size: int) -> torch.UntypedStorage:
    return new_anonymous_shared(size)


def use_anonymous_shared_memory() -> bool:
    """In a worker process: make torch's fd-based shared allocation (the default strategy's,
    used by ``default_collate`` in workers and by our transport) anonymous. Returns whether it
    did: not under the ``file_system`` strategy (named on purpose), nor where ``memfd_create``
    is missing (Linux < 3.17): torch's own allocator stays there."""
    if not hasattr(os, "memfd_create"):
        return False
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        # file_system: the user chose named segments, counted by torch's shm manager (which
        # removes them when the job ends), so that batches can be passed on by name.
        return False
    try:
        new_anonymous_shared(64)
    except (OSError, RuntimeError):
        return False
    set_shared_allocator(_new_using_fd_cpu)
    return True
