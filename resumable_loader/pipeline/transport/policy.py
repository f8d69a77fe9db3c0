"""When a worker's batch may use shared memory, and what the two ways of running out look like.

A full /dev/shm: when a storage cannot get shared memory (torch raises "unable to allocate
shared memory(shm) ... No space left on device"; its allocator reserves the pages with
posix_fallocate, so a full tmpfs fails here and cannot SIGBUS later), the storage is copied into
the message instead (the reducers' fallback), and the main side warns, once per process, with
the numbers the worker saw (``warn_shm``, from the worker's ``ShmNote``). ``ShmPolicy`` keeps a
worker from trying /dev/shm batch after batch while it stays full. The frame is the same either
way.

Out of file descriptors (``ulimit -n``): each batch in flight holds an fd or a few. When a
process has none left while it moves a batch, the error says which limit it hit, how many were
open and what to change (``FdLimitError``, ``fd_limit_text``).

This module owns the detection (``shm_exhausted``, ``fds_exhausted``), the worker's backoff
and the words; it makes the worker's ``SegmentPool`` (``pools``) when a batch first needs one.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import warnings
from typing import Any, NamedTuple, Protocol

import torch

from .pools import SegmentPool, new_worker_pool

# Where torch's shm_open() segments live (both sharing strategies) on Linux.
SHM_DIR = "/dev/shm"
# After a failed shared-memory allocation a worker sends its next 1, 2, 4, ... batches (doubling
# while failures go on) without trying /dev/shm: a failed attempt costs an fallocate that fills
# the tmpfs and is rolled back, and a map-style batch is then read a second time. 64 batches is
# a few seconds of a typical epoch: /dev/shm is tried again soon after it has room.
SHM_BACKOFF_MAX = 64
# The main process warns once about a full /dev/shm: one line that says what to change is
# useful, the same line per batch for a week is not.
_shm_warned = False


class ShmNote(NamedTuple):
    """What a worker saw when it could not (or chose not to) use /dev/shm; plain data."""

    reason: str
    total: int  # /dev/shm's size in bytes (0: unknown)
    used: int  # bytes in use there at the time
    pid: int  # the worker


def shm_usage() -> tuple[int, int]:
    """(size, bytes in use) of /dev/shm; (0, 0) if it cannot be read."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0, 0
    return st.f_blocks * st.f_frsize, (st.f_blocks - st.f_bfree) * st.f_frsize


def _shm_free() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return sys.maxsize  # unknown: let the allocation itself say
    return st.f_bavail * st.f_frsize


class FdLimitError(OSError):
    """A process ran out of file descriptors (``ulimit -n``) while moving a batch."""

    def __init__(self, text: str) -> None:
        super().__init__(errno.EMFILE, text)

    def __str__(self) -> str:
        return str(self.strerror)


def fds_exhausted(exc: BaseException) -> bool:
    """Whether ``exc`` says that this process (or the system) has no file descriptor left."""
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
        return True
    return isinstance(exc, (OSError, RuntimeError)) and "Too many open files" in str(exc)


def fd_limit_text(doing: str) -> str:
    """What to say when the fd limit was hit: which limit, how many were open, what to do."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        n: Any = len(os.listdir("/proc/self/fd")) - 1  # (less the listing's own)
    except OSError:
        n = "?"
    return (
        f"Too many open files while {doing} (pid {os.getpid()}): {n} file descriptors open, "
        f"and the limit (ulimit -n) is {soft}. Each batch sent through shared memory holds "
        "one descriptor (a few for a batch of several large tensors) from the worker until "
        "your loop drops it, so about num_workers x prefetch_factor batches, plus those your "
        f"loop keeps, are open at once. Raise the limit (ulimit -n {max(soft * 4, 65536)} in "
        "the shell that starts the run, or resource.setrlimit(resource.RLIMIT_NOFILE, ...) up "
        f"to the hard limit {hard}), use fewer workers or a smaller prefetch_factor, or "
        "torch.multiprocessing.set_sharing_strategy('file_system'), which names segments "
        "instead of passing descriptors."
    )


def shm_exhausted(exc: BaseException) -> bool:
    """Whether ``exc`` says that /dev/shm is full (and nothing else is wrong).

    torch's allocator raises RuntimeError("unable to allocate shared memory(shm) for file
    </torch_...>: No space left on device (28)"); both its mention of shared memory or a torch
    segment and ENOSPC are required, so that a full disk under a dataset is not taken for it.
    """
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOSPC and str(exc.filename or "").startswith(SHM_DIR)
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return ("shared memory" in text or "</torch_" in text) and "No space left on device" in text


class SentMessage(Protocol):
    """What ``ShmPolicy.sent`` learns from a message that went out (a ``reducers.Outbox``)."""

    shared_bytes: int  # storages shared as they lay, or packed into a new segment
    fallback_bytes: int  # storages copied into the message instead
    pooled_bytes: int  # storages collated into a pooled segment
    packed: bool  # storages were packed into one segment


class ShmPolicy:
    """A worker's use of /dev/shm, batch by batch.

    ``allow()`` before each batch says whether it may use shared memory (be collated into it,
    have its storages shared). It may not for a few batches after a failure (see
    SHM_BACKOFF_MAX), nor when /dev/shm has less room left than the last large batch needed:
    that allocation would fail too, after filling the tmpfs for nothing (one statvfs, about a
    microsecond, and only once batches have needed shared memory). Such a batch goes inline,
    so the worker never waits and nothing is lost; another process freeing its segments soon
    lets the next batch through /dev/shm again.

    Invariant: ``note`` is None until the first refusal or failure, then the latest one.
    """

    def __init__(self, pool_segments: int = 0) -> None:
        # At most this many pooled segments (see ``SegmentPool``); 0: no pool.
        self._pool_segments = pool_segments
        self.pool: SegmentPool | None = None
        self._skip = 0  # batches still to send without trying /dev/shm
        self._backoff = 0  # the length of the current run of skips (0: no failure pending)
        self._need = 0  # bytes of shared memory the last large batch needed
        self._failed_now = False
        self._sent_any = False
        self.note: ShmNote | None = None
        # The last batch was packed into one segment (see ``reducers``): the next one, likely
        # alike, is best collated out of /dev/shm.
        self.packing = False

    def allow(self) -> bool:
        """Whether the next batch may use /dev/shm. Call once per batch; it also reserves the
        pooled segment the batch will be collated into, when there is one (``pooled``)."""
        self._failed_now = False
        pool = self._get_pool()
        if pool is not None and pool.reserve_free():
            return True  # a segment already made: no new room needed
        if self._skip:
            self._skip -= 1
            return False
        if self._need:
            free = _shm_free()
            if free < self._need:
                total, used = shm_usage()
                reason = f"only {_mib(free)} free, and the last batch needed {_mib(self._need)}"
                self.note = ShmNote(reason, total, used, os.getpid())
                return False
        if pool is not None:
            try:
                pool.reserve_new()
            except RuntimeError as exc:
                if not shm_exhausted(exc):
                    raise
                self.failed(exc)
                return False
        return True

    def take_grant(self, grant: int | None, sock: socket.socket) -> None:
        """Worker side, before a task: the loader's segment its batch may use (``TaskMsg``'s
        grant; None: the loader has no pool, this worker keeps its own)."""
        if grant is None:
            if self.pool is not None:
                self.pool.grant = -1
            return
        pool = self._get_pool()
        if pool is not None:
            pool.take_grant(grant, sock)

    def _get_pool(self) -> SegmentPool | None:
        if self.pool is None and self._pool_segments:
            if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
                # file_system names its segments and counts references in its manager
                # process: not pooled, the per-batch path stays.
                return None
            self.pool = new_worker_pool(self._pool_segments)
        return self.pool

    @property
    def pooled(self) -> bool:
        """Whether the batch being built has a pooled segment to be collated into."""
        return self.pool is not None and self.pool.target is not None

    @property
    def large(self) -> bool:
        """Whether batches need shared memory (as far as known: true until one was sent)."""
        return self._need > 0 or not self._sent_any

    def failed(self, exc: BaseException) -> None:
        """An allocation in /dev/shm failed for lack of room (``shm_exhausted(exc)``)."""
        self._failed_now = True
        self._backoff = min(SHM_BACKOFF_MAX, self._backoff * 2 or 1)
        self._skip = self._backoff
        total, used = shm_usage()
        self.note = ShmNote(str(exc), total, used, os.getpid())

    def sent(self, out: SentMessage) -> None:
        """After a message went out: learn how much shared memory a batch needs."""
        need = out.shared_bytes + out.fallback_bytes + out.pooled_bytes
        self._sent_any = True
        self.packing = out.packed
        if need:
            self._need = need
        if out.shared_bytes and not self._failed_now:
            self._backoff = 0  # /dev/shm worked again: a new failure starts a new backoff


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def warn_shm(nbytes: int, note: ShmNote) -> None:
    """Main side: say, once per process, that batches come without shared memory, and why."""
    global _shm_warned
    if _shm_warned:
        return
    _shm_warned = True
    where = (
        f"{SHM_DIR} is {_mib(note.total)}, {_mib(note.used)} of it in use"
        if note.total
        else f"{SHM_DIR} could not be measured"
    )
    text = (
        f"DataLoader: a batch of {_mib(nbytes)} could not get shared memory in worker pid "
        f"{note.pid} ({where}; {note.reason}). It was copied through the worker's result "
        "socket instead: the batches are the same, but each such batch costs a copy in the "
        f"worker and one in the main process. To use shared memory again, give {SHM_DIR} more "
        "room (docker run --shm-size=8g, or --ipc=host; on Kubernetes an emptyDir with "
        f"medium: Memory mounted at {SHM_DIR}), or use fewer workers or a smaller "
        "prefetch_factor: about num_workers x prefetch_factor batches are in shared memory "
        "at once, plus the ones your loop holds. Shown once per process."
    )
    try:
        warnings.warn(text, RuntimeWarning, stacklevel=2)
    except Exception:
        # A filter turned warnings into errors. Raised here, inside the receiving of a
        # message, it would lose the batch and count as a broken worker: print it instead.
        print(f"RuntimeWarning: {text}", file=sys.stderr)
