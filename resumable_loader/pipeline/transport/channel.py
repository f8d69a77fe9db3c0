"""The result channel from a worker to the main process: a Unix socketpair, framed by hand.

Why not torch's usual path (a pipe, with each tensor's shared-memory fd fetched afterwards by
connecting back to the sender's resource-sharer thread)? Because unpickling would then depend on
the sender being alive and responsive: a worker SIGSTOPped (or hung) after sending leaves the
main process blocked forever inside ``pickle.loads``. Here the fds travel *in-band*, attached to
the message with SCM_RIGHTS, so a received message needs nothing more from its sender; and the
main side reads without ever blocking (``Receiver.feed``), so a worker stopped halfway through a
send cannot stall it either.

Frame: header ``<QIQqq`` (payload length, number of fds, body length, and the message's tag:
a result's epoch generation and task id, -1 -1 for other messages) sent with the fds
attached, then the payload: the pickled message (the body), then -- when the message holds
storages that travel through shared memory -- the pickled slot table that says how each of them
travels. Storages of at most ``INLINE_MAX`` bytes are copied into the body instead: for small
batches that is cheaper than passing and mapping an fd.

A message that arrives whole but cannot be rebuilt here (unpickling it raises: a class the
main process cannot import, a rebuild that fails, no fd left to map it) is not a broken
channel: its frame is known, so the messages before and after it are read as usual, and it is
returned as ``Undecodable`` with its tag and the error -- the main process can then name the
task it was, instead of taking a healthy worker for a dead one (issue #31 item 3).

One fd per batch (issue #11): every storage that travels through shared memory takes a slot
while the message is pickled; only then, with all of them known, is each placed. A batch of at
most ``MAX_FDS_PER_MSG`` such storages sends each on its own fd, as it lies (the usual image
batch: one large storage, collated straight into shared memory). A batch of more -- a dict of
50 fields -- is packed: its largest ``MAX_FDS_PER_MSG - 1`` storages already in shared memory
still go on their own fds (no copy), the rest are copied into one segment, and the main process
rebuilds each as a storage over its slice of that segment (``_unpack``). A received storage
holds its fd open for as long as it lives (torch maps with the fd kept), so one fd per batch
rather than per tensor is what keeps a large prefetch window under ``ulimit -n``. The slices
keep the segment alive through ordinary references (slice -> array -> segment): it is freed,
fd and all, when the caller drops the last tensor of the batch.

A pool of segments (issue #26): a fresh segment per batch costs more than the work of an
image batch -- every page zeroed, faulted in by the worker and again by the main process, then
torn down. So each worker keeps a few segments (``SegmentPool``: its share of the prefetch
window and the batch the caller holds); torch's collate writes the batch straight into a free
one (``collating``); the message carries (offset, length) in it, and the segment's fd only the
first time; the main process maps each segment once and rebuilds the batch's storages over it,
each holding a ``_Lease`` whose end hands the segment back (a flag byte at its end). A worker
never writes into a segment whose flag is set, so a batch the caller holds is never
overwritten; a batch that finds none free takes a fresh segment, as before.

The loader's pool (issue #26, ``LoaderPool``): a pool per worker holds ``workers x (prefetch
+ 1)`` segments, one more per worker than the window and the batch the caller holds need. So
under a loader the segments are the main process's instead, at most ``window + 1``, lent task
by task: each task carries a grant, each segment's fd goes to a worker process once (over its
result socket, the other way), and the worker's ``SegmentPool`` collates into the granted
segment under the same flag rule. Without a grant (the transport used alone) a worker keeps
its own pool as above.

Memory: a batch has one owner at a time. Nothing on the send path may form a reference cycle
with the batch: the pickler's memo holds every object it pickled until the pickler dies, so a
pickler kept alive by a cycle would keep the batch -- and its /dev/shm segment -- until Python's
cycle collector happened to run (issue #16: 42 segments mapped per worker). Hence the storage
reducer is a module function that finds the message's ``_Outbox`` in a thread-local while that
message is pickled, never a bound method of the pickler.

A full /dev/shm: when a storage cannot get shared memory (torch raises "unable to allocate
shared memory(shm) ... No space left on device"; its allocator reserves the pages with
posix_fallocate, so a full tmpfs fails here and cannot SIGBUS later), the storage is copied into
the message instead and rebuilt by ``_rebuild_fallback_storage``, which on the main side also
warns, once per process, with the numbers the worker saw. ``ShmPolicy`` keeps a worker from
trying /dev/shm batch after batch while it stays full. The frame is the same either way.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import io
import os
import pickle
import socket
import struct
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import reduce_tensor as _torch_reduce_tensor

from ...core.errors import RemoteTraceback
from .memfd import reserve

# 64-bit lengths: a message of any size torch's own pipe would carry (multiprocessing frames
# over 2 GiB with an 8-byte length too) can be framed -- a batch copied inline over 4 GiB (a
# non-tensor batch, or a large one that found /dev/shm full) included (issue #25).
_HEADER = struct.Struct("<QIQqq")
# The tag of a message that is not a task's result.
NO_TAG = (-1, -1)
# At most this many fds per message (see the module docstring): enough for the batches whose
# few large storages are best sent as they lie, few enough that num_workers x prefetch_factor
# batches in flight stay far below a 1024-fd limit.
MAX_FDS_PER_MSG = 4
# ... and only storages of at least this size keep an fd of their own in a packed batch: below
# it, copying the storage into the shared segment costs less than a segment of its own.
SOLO_MIN = 256 * 1024
# Storages packed into one segment start at multiples of this: a rebuilt tensor keeps the
# alignment its dtype and vectorised kernels expect.
PACK_ALIGN = 64
# Copy storages up to this size into the message: one memcpy beats an fd round trip + mmap.
INLINE_MAX = 32 * 1024
_RECV_CHUNK = 1 << 20  # a payload over this is received in place (see Receiver.feed)
# One read asks for at most this: recvmsg allocates the size it is asked for, and a 1 MiB
# buffer is an mmap and munmap per call (~12 us, more than the rest of a small batch's read).
_READ_CHUNK = 64 * 1024
# Room for as many fds as Linux passes in one message (SCM_MAX_FD), though we send at most
# MAX_FDS_PER_MSG: fds that find no room are discarded by the kernel.
_ANC_SPACE = socket.CMSG_SPACE(253 * array.array("i").itemsize)
# A plain int: socket.MSG_CTRUNC is an IntFlag, and ``int & IntFlag`` builds a flag object in
# Python (~0.6 us, per read).
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
# Where torch's shm_open() segments live (both sharing strategies) on Linux.
SHM_DIR = "/dev/shm"
# After a failed shared-memory allocation a worker sends its next 1, 2, 4, ... batches (doubling
# while failures go on) without trying /dev/shm: a failed attempt costs an fallocate that fills
# the tmpfs and is rolled back, and a map-style batch is then read a second time. 64 batches is
# a few seconds of a typical epoch: /dev/shm is tried again soon after it has room.
SHM_BACKOFF_MAX = 64
# Pooled segments are sized in these steps, with 1/32 of headroom, so that batches that vary
# a little in size (variable-length fields) still fit the segments already made.
POOL_ROUND = 64 * 1024
# A worker granted a segment that still holds the caller's previous batch waits this long at
# most for it to be given back (see ``SegmentPool.wait_given_back``), looking every step. The
# caller gives it back when ``next()`` returns, so the wait is normally short; it runs long
# only while the main process waits for a CPU (a loaded machine), when a worker has nothing
# better to do with one either.
POOL_WAIT_S = 0.02
POOL_WAIT_STEP_S = 0.0001

_tls = threading.local()
# The main process warns once about a full /dev/shm: one line that says what to change is
# useful, the same line per batch for a week is not.
_shm_warned = False


def _rebuild_fd_storage(index: int, nbytes: int) -> torch.UntypedStorage:
    fd = _tls.fds[index]
    _tls.used.add(index)
    try:
        return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # type: ignore[attr-defined]
    finally:
        os.close(fd)


def _rebuild_empty_storage() -> torch.UntypedStorage:
    return torch.UntypedStorage(0)


def _rebuild_fallback_storage(data: bytearray, note: tuple[Any, ...]) -> torch.UntypedStorage:
    """A storage that could not get shared memory in the worker and came inline instead.

    ``data`` is already a fresh bytearray (unpickled from the payload): the storage borrows it,
    no second copy. The main side notes the fallback, and ``Receiver._decode`` warns once the
    whole message is in, with the size of the batch.
    """
    storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
    pending = getattr(_tls, "fallback", None)
    if pending is None:  # unpickled outside a Receiver: warn for this storage alone
        _warn_shm(len(data), ShmNote(*note))
    else:
        pending.append((len(data), note))
    return storage


class ShmNote(NamedTuple):
    """What a worker saw when it could not (or chose not to) use /dev/shm; plain data."""

    reason: str
    total: int  # /dev/shm's size in bytes (0: unknown)
    used: int  # bytes in use there at the time
    pid: int  # the worker


def _shm_usage() -> tuple[int, int]:
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
        # The last batch was packed into one segment (see ``_place``): the next one, likely
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
                total, used = _shm_usage()
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
        global _worker_pool
        if self.pool is None and self._pool_segments:
            if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
                # file_system names its segments and counts references in its manager
                # process: not pooled, the per-batch path stays.
                return None
            self.pool = _worker_pool = SegmentPool(self._pool_segments)
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
        total, used = _shm_usage()
        self.note = ShmNote(str(exc), total, used, os.getpid())

    def sent(self, out: _Outbox) -> None:
        """After a message went out: learn how much shared memory a batch needs."""
        need = out.shared_bytes + out.fallback_bytes + out.pooled_bytes
        self._sent_any = True
        self.packing = out.packed
        if need:
            self._need = need
        if out.shared_bytes and not self._failed_now:
            self._backoff = 0  # /dev/shm worked again: a new failure starts a new backoff


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class _Segment:
    """A pooled segment, worker side: its storage (which owns the fd) and a byte view of it.
    Its last ``PACK_ALIGN`` bytes hold its lending flag (see ``SegmentPool``)."""

    __slots__ = ("announced", "base", "flag", "id", "size", "storage", "view")

    def __init__(self, sid: int, size: int) -> None:
        self.id = sid
        self.size = size  # bytes for batches, before the flag
        self.storage: torch.UntypedStorage | None = torch.UntypedStorage._new_shared(
            size + PACK_ALIGN
        )
        self.view = _byte_view(self.storage)
        self.flag = self.view[size : size + 1]  # 1: the main process holds a batch in it
        self.base = self.storage.data_ptr()
        self.announced = False  # the main process has mapped it

    @property
    def lent(self) -> bool:
        return bool(self.flag[0])

    def map(self, want: int) -> None:
        """(Made mapped: see ``_GrantedSegment``.)"""

    def close(self) -> None:
        """(Its storage owns its fd.)"""


def _reserve(fd: int, nbytes: int) -> None:
    """Give a new granted segment its size, its pages reserved. (A function of its own:
    ``testing.ShmFailure`` makes it fail as a full /dev/shm makes torch's allocations fail.)

    Raises:
        RuntimeError: no room, in the words of torch's allocator (and of ``_shm``), so that
            the batch is redone out of shared memory as when any other allocation fails.
    """
    reserve(fd, nbytes, _POOL_NAME)


class _GrantedSegment(_Segment):
    """Worker side: one of the loader's segments (``LoaderPool``), lent to this worker task by
    task. The main process makes it empty; the first worker to collate into it gives it its
    size (the batch's, with the pool's headroom) and reserves its pages; every process maps it
    once, and keeps no fd once it is mapped."""

    __slots__ = ("fd", "hint")

    def __init__(self, sid: int, fd: int, hint: int) -> None:  # (owns ``fd``)
        self.id = sid
        self.fd = fd
        self.hint = hint  # the batch size the main process last heard of (0: unknown)
        self.size = 0  # 0: not mapped here yet
        self.storage = None
        self.base = 0
        self.announced = True  # the main process has it

    @property
    def lent(self) -> bool:
        if not self.size:
            try:
                self.map(0)  # another worker may have sized it and sent a batch in it
            except OSError:
                return False  # (``alloc`` tries again, and takes a fresh segment)
        return bool(self.size and self.flag[0])

    def map(self, want: int) -> None:
        """Map it here, sizing it for ``want`` bytes first if no worker has yet (``want``
        0: only if one has). Raises ``_reserve``'s RuntimeError if there is no room for it,
        OSError if it cannot be mapped."""
        size = os.fstat(self.fd).st_size - PACK_ALIGN
        if size <= 0:
            if not want:
                return
            size = _round_up(max(want, self.hint) * 33 // 32, POOL_ROUND)
            # Reserved now (as _shm does): a lack of memory fails here, never as a SIGBUS.
            _reserve(self.fd, size + PACK_ALIGN)
        mapping = _Mapping(self.fd, size)
        buf = (ctypes.c_uint8 * (size + PACK_ALIGN)).from_address(mapping.addr)
        buf._mapping = mapping  # type: ignore[attr-defined]  # unmapped with its last slice
        self.view = _byte_view(torch.frombuffer(buf, dtype=torch.uint8).untyped_storage())
        self.flag = self.view[size : size + 1]
        self.base = mapping.addr
        self.size = size
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SegmentPool:
    """Worker side: shared-memory segments reused batch after batch (issue #26).

    A fresh segment per batch costs an fallocate that zeroes every page, a page fault per
    page in the worker and again in the main process, and the teardown: ~0.65 ms per MiB,
    more than the work of an image batch's copy. A pooled segment is created, mapped and
    faulted in once, by both processes; then each batch is collated straight into it.

    One owner at a time: each segment ends with a flag byte that says the main process holds
    a batch in it. The worker sets it before it sends the batch and never writes into a
    segment whose flag is set; the main process clears it when the last tensor of that batch
    is gone (``_Lease``). A worker killed mid-write leaves a segment that was never lent, in a
    message never completed: nothing of it is delivered, and its memory goes with the last
    mapping.

    At most ``cap`` segments: the worker's share of the prefetch window and the batch the
    caller holds. A batch that finds none free goes through a fresh segment as before, so a
    caller that keeps batches costs memory, never correctness.
    Invariant: ``target`` is free (flag clear) or None while a batch is being built.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        # The segments are the loader's (``LoaderPool``), lent task by task: this pool then
        # makes none of its own, and ``grant`` is the one the current task may use (-1: none).
        self.granted = False
        self.grant = -1
        self.reported = 0  # the demand last reported to the main process
        self.patience = POOL_WAIT_S  # see ``wait_given_back``
        self.segments: dict[int, Any] = {}  # id -> _Segment (or _GrantedSegment)
        self.next_id = 0
        self.retired: list[int] = []  # ids the main process must forget (sent with a message)
        self.target: _Segment | None = None  # the segment the batch being built goes into
        self.offset = 0  # bytes of ``target`` taken by the batch being built
        self.asked = 0  # shared bytes the current collate asked for (aligned)
        self.demand = 0  # ... and the last one's
        self.thread = 0  # the thread whose collate allocates from the pool (0: none)

    def _free(self) -> list[_Segment]:
        return [s for s in self.segments.values() if not s.lent]

    def reserve_free(self) -> bool:
        """Before a batch: take a free segment that fits the last batch; False if none.
        (A granted segment is taken whatever its flag: ``collating`` looks again, when the
        collate begins -- by then the caller has normally dropped the batch it held there.)"""
        self.target = None
        want = self.demand
        if self.granted:
            seg = self.segments.get(self.grant)
            if seg is not None and (not seg.size or seg.size >= want):
                self.target = seg
        elif want:
            fits = [s for s in self._free() if s.size >= want]
            if fits:
                self.target = min(fits, key=lambda s: s.size)
        return self.target is not None

    def reserve_new(self) -> None:
        """No free segment fits: make one if the pool has room (retiring a free one that is
        too small). Raises what torch's allocator raises when /dev/shm is full."""
        want = self.demand
        if not want or self.granted:
            return
        if len(self.segments) >= self.cap:
            free = self._free()
            if not free:
                return  # every segment is lent: this batch takes a fresh one
            old = min(free, key=lambda s: s.size)
            del self.segments[old.id]
            self.retired.append(old.id)
        seg = _Segment(self.next_id, _round_up(want + want // 32, POOL_ROUND))
        self.next_id += 1
        self.segments[seg.id] = seg
        self.target = seg

    def wait_given_back(self) -> bool:
        """The granted segment still holds the batch the caller had when the task was sent
        (the oldest held: the loader refills its window inside ``next()``, before the caller
        drops the batch it holds). It is normally given back a moment later: wait for that,
        at most ``patience`` -- halved after each wait in vain, so a caller that keeps its
        batches costs a worker little; back to ``POOL_WAIT_S`` after a wait that paid, and
        a little of it back with each granted segment found free. Whether it was given back."""
        seg = self.target
        assert seg is not None
        if not self.granted or self.patience <= 0.0:
            return False
        deadline = time.monotonic() + self.patience
        while seg.lent:
            if time.monotonic() >= deadline:
                self.patience = self.patience / 2 if self.patience > POOL_WAIT_S / 64 else 0.0
                return False
            time.sleep(POOL_WAIT_STEP_S)
        self.patience = POOL_WAIT_S
        return True

    def take_grant(self, sid: int, sock: socket.socket) -> None:
        """Worker side: the current task may use the loader's segment ``sid`` (-1: none).
        A segment new to this process has its fd waiting in ``sock`` (``LoaderPool.send_fd``,
        sent before the task): read the frames until it is here, mapping each."""
        self.granted = True
        self.grant = sid
        while sid >= 0 and sid not in self.segments:
            fds = array.array("i")
            frame, anc, _flags, _addr = sock.recvmsg(_GRANT.size, _GRANT_ANC, socket.MSG_WAITALL)
            for level, kind, blob in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(blob[: len(blob) - len(blob) % fds.itemsize])
            if len(frame) < _GRANT.size:
                for fd in fds:
                    os.close(fd)
                raise EOFError("the main process closed the result socket")
            new, hint, retired = _GRANT.unpack(frame)
            if retired >= 0:
                # Unmapped once no batch this worker built in it is alive.
                old = self.segments.pop(retired, None)
                if old is not None:
                    old.close()
            for fd in fds:
                if new >= 0:
                    self.segments[new] = _GrantedSegment(new, fd, hint)
                    new = -1
                else:
                    os.close(fd)

    def alloc(self, nbytes: int) -> torch.UntypedStorage:
        """The collate's ``_new_shared``: a slice of the reserved segment when it fits."""
        if nbytes <= INLINE_MAX:
            return torch.UntypedStorage(nbytes)  # copied into the message anyway
        aligned = _round_up(nbytes, PACK_ALIGN)
        self.asked += aligned
        seg = self.target
        if seg is not None and not seg.size:
            try:
                seg.map(max(self.demand, nbytes))  # the first batch in a new granted segment
            except OSError:
                seg = self.target = None  # not mapped: a fresh segment, as without one
            if seg is not None and seg.lent:
                seg = self.target = None
        if seg is not None and self.offset + nbytes <= seg.size:
            off = self.offset
            self.offset += aligned
            piece = seg.view[off : off + nbytes]
            return torch.frombuffer(piece, dtype=torch.uint8).untyped_storage()
        return _torch_new_shared(torch.UntypedStorage, nbytes)  # does not fit: a fresh one

    def where(self, storage: torch.UntypedStorage) -> int:
        """The offset of ``storage`` in the reserved segment, or -1 if it does not lie there."""
        seg = self.target
        if seg is None:
            return -1
        off = storage.data_ptr() - seg.base
        # Its whole extent, not only its start: it travels as (offset, its own length).
        return off if off >= 0 and off + storage.nbytes() <= seg.size else -1


_torch_new_shared = torch.storage._StorageBase.__dict__["_new_shared"].__func__
_worker_pool: SegmentPool | None = None  # this worker's (at most one per process)


def _pooled_new_shared(cls: Any, size: int, *, device: Any = "cpu") -> Any:
    pool = _worker_pool
    if (
        pool is None
        or cls is not torch.UntypedStorage
        or pool.thread != threading.get_ident()
        or torch.device(device).type != "cpu"
    ):
        return _torch_new_shared(cls, size, device=device)
    return pool.alloc(size)


def has_pool() -> bool:
    """Whether this process has a segment pool (a worker's, once it made one): without one,
    ``collating()`` changes nothing, and a collate need not enter it (the main process with
    ``num_workers=0`` collates once per batch; entering costs a couple of microseconds)."""
    return _worker_pool is not None


@contextlib.contextmanager
def collating() -> Iterator[None]:
    """Worker side, around a collate that may use shared memory: torch's collate allocates
    its output with ``_new_shared``; in this thread, for this call, such an allocation comes
    from the pool's reserved segment when it fits, so the batch is written where it travels.
    """
    pool = _worker_pool
    if pool is None or pool.thread:
        yield
        return
    pool.offset = pool.asked = 0
    if pool.target is not None:
        if not pool.target.lent:
            pool.patience = min(POOL_WAIT_S, pool.patience + POOL_WAIT_S / 32)
        elif not pool.wait_given_back():
            pool.target = None  # the caller keeps that batch: a fresh segment, as without one
    if "_new_shared" not in torch.UntypedStorage.__dict__:
        # Installed once and kept: setting a class attribute per batch invalidated Python's
        # method caches for every storage type (a few microseconds a batch). Outside a
        # collate -- other threads, other times -- it defers to torch's own (``pool.thread``).
        torch.UntypedStorage._new_shared = classmethod(_pooled_new_shared)  # type: ignore[assignment,method-assign]
    pool.thread = threading.get_ident()
    try:
        yield
    finally:
        pool.thread = 0
        pool.demand = pool.asked


# Main side: mappings made with mmap(2) directly, so that no fd is held per pooled segment
# (Python's mmap module keeps a dup of the fd for as long as the mapping lives).
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
_libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    """Main side: one pooled segment, mapped (its pages populated) once and unmapped when the
    last reference goes: the receiver's, or that of a lease on a batch still held. (A worker
    forked later inherits the mapping, as it inherits a held batch's: MADV_DONTFORK would make
    a dataset that refers to a delivered batch crash in the child.)"""

    __slots__ = ("addr", "flag", "leases", "size")

    def __init__(self, fd: int, size: int) -> None:
        import mmap

        length = size + PACK_ALIGN
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        addr = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of a pooled segment of {size} bytes: {os.strerror(err)}")
        self.addr: int = addr
        self.size = size
        self.flag = ctypes.c_uint8.from_address(addr + size)
        self.leases = 0  # batches this process holds in it (``_Lease``)

    def __del__(self, _munmap: Any = _libc.munmap) -> None:  # (bound now: safe at exit)
        _munmap(self.addr, self.size + PACK_ALIGN)


class _Lease:
    """Main side: one batch's hold on a pooled segment. Every storage rebuilt over the segment
    refers to it; when the last goes, the segment goes back to its worker (its flag).

    Only in the process that received the batch: a worker forked later holds a copy of the
    lease (of everything this process held), and that copy going away at the worker's exit
    must not give back a segment whose batch this process still holds.
    """

    __slots__ = ("pid", "seg")

    def __init__(self, seg: _Mapping) -> None:
        self.seg = seg
        self.pid = os.getpid()
        seg.leases += 1

    def __del__(self) -> None:
        if os.getpid() == self.pid:
            seg = self.seg
            seg.leases -= 1
            if not seg.leases:
                seg.flag.value = 0


# The main process's word to a worker about its segments (``LoaderPool.send_fd``): the id and
# size of a segment whose fd rides along (-1: none), and the id of one retired (-1: none).
_GRANT = struct.Struct("<qQq")
_GRANT_ANC = socket.CMSG_SPACE(array.array("i").itemsize)
_POOL_NAME = "resumable_loader-pool"


class _PoolSegment:
    """Main side: one of the loader's segments (see ``LoaderPool``)."""

    __slots__ = ("fd", "filled", "grant", "id", "mapping", "since", "size")

    def __init__(self, sid: int, fd: int) -> None:
        self.id = sid
        self.fd = fd  # kept: sent to each worker (process) the first time it is granted
        self.size = 0  # 0: not sized yet (the first worker to use it sizes it)
        self.mapping: _Mapping | None = None
        self.grant: tuple[int, int, int] | None = None  # (worker id, gen, task id)
        # (gen, task id) of the batch in it: batches are delivered in task order, so the held
        # segment with the lowest is the batch the caller got first -- the one it drops next.
        self.since = (0, 0)
        self.filled = False  # a batch of its current grant was received in it

    def mapped(self) -> bool:
        """Map it here once a worker has sized it; whether it is mapped."""
        if self.mapping is None:
            try:
                size = os.fstat(self.fd).st_size - PACK_ALIGN
                if size > 0:
                    self.mapping = _Mapping(self.fd, size)
                    self.size = size
            except OSError:
                pass
        return self.mapping is not None

    @property
    def held(self) -> bool:
        """The caller holds a batch in it (the flag its worker set before sending)."""
        return self.mapped() and bool(self.mapping.flag.value)  # type: ignore[union-attr]


class LoaderPool:
    """Main side: shared-memory segments owned by the loader and lent to its workers, task by
    task (issue #26), so that the segments alive at once are the prefetch window's and the
    batch the caller holds -- whichever workers built them.

    Each task's message carries a grant (``grant``): a segment the worker may collate the
    batch into if its flag is clear (see ``SegmentPool``: the worker sets the flag before it
    sends, the caller's last drop of the batch clears it; the flag stays the one-owner rule).
    Grants are picked from the free segments that fit, else a new one is made below ``cap``,
    else the held segment whose batch came first (the batch the caller is about to drop: the
    window is refilled inside ``next()``, while the caller still holds the last one). A grant
    ends with the worker's result for that task (``end``), with a result of a later epoch
    generation from that worker (its queued tasks were dropped), or with the worker's
    confirmed death (``drop_worker``): a segment it was writing is then given out again and
    rewritten whole; no message of it completed, so nothing of it was delivered.

    The fds are kept here (``send_fd`` passes each to a worker process once, over its result
    socket, before the task that first grants it), and registered so that forked workers
    close them. ``close`` closes them; a segment whose batch is still held stays mapped
    through its lease until the caller drops it.
    Invariant: a segment is granted to at most one task; ``grants`` maps each granted task
    to its segment's id.
    """

    def __init__(self, cap: int, register: Any = None, unregister: Any = None) -> None:
        self.cap = cap
        self.segments: dict[int, _PoolSegment] = {}
        self.grants: dict[tuple[int, int, int], int] = {}
        self.known: dict[int, set[int]] = {}  # worker id -> segment ids its process has
        self.retire_news: dict[int, list[int]] = {}  # worker id -> ids it must forget
        self.demand = 0  # shared bytes of the last batch a worker reported
        self.next_id = 0
        self.ended = 0  # results received (counted by the supervisor)
        self.closed = False
        self._register = register
        self._unregister = unregister

    def _make(self) -> _PoolSegment | None:
        # Empty: the first worker to collate into it sizes it for its batch (a grant goes out
        # before any batch size is known: the first window's tasks).
        try:
            fd = os.memfd_create(_POOL_NAME, os.MFD_CLOEXEC)
        except OSError:
            return None  # (out of fds: the batch takes a fresh segment, as without a pool)
        seg = _PoolSegment(self.next_id, fd)
        if self._register is not None:
            self._register(fd)
        self.next_id += 1
        self.segments[seg.id] = seg
        return seg

    def _retire(self, seg: _PoolSegment) -> None:
        del self.segments[seg.id]
        if self._unregister is not None:
            self._unregister(seg.fd)
        os.close(seg.fd)
        for wid, ids in self.known.items():
            if seg.id in ids:
                ids.discard(seg.id)
                self.retire_news.setdefault(wid, []).append(seg.id)

    def wanted(self) -> bool:
        """Whether tasks get grants: not once a window of results came and none needed
        shared memory (small batches, copied through the socket: a few microseconds less
        per task, and the task message as it was)."""
        return not self.closed and (self.demand > 0 or self.ended <= self.cap)

    def grant(self, key: tuple[int, int, int]) -> _PoolSegment | None:
        """A segment for task ``key`` (worker id, gen, task id), or None (a fresh one)."""
        sid = self.grants.get(key)
        if sid is not None:  # the same task sent again to the same worker
            return self.segments[sid]
        want = self.demand
        if not self.wanted():
            return None
        idle = [s for s in self.segments.values() if s.grant is None]
        free = [s for s in idle if not s.held]
        fits = [s for s in free if not s.size or s.size >= want]
        seg: _PoolSegment | None = None
        if fits:
            seg = min(fits, key=lambda s: (not s.size, s.size))  # sized ones first
        else:
            if len(self.segments) >= self.cap and free:
                self._retire(min(free, key=lambda s: s.size))  # too small for today's batches
            if len(self.segments) < self.cap:
                seg = self._make()
            if seg is None:
                held = [s for s in idle if s.held and s.size >= want]
                if held:
                    seg = min(held, key=lambda s: s.since)
        if seg is not None:
            seg.grant = key
            self.grants[key] = seg.id
        return seg

    def send_fd(self, wid: int, sock: socket.socket, seg: _PoolSegment) -> bool:
        """Make sure worker ``wid``'s process has ``seg`` (its fd, once); False if it could
        not be sent (the grant is then withdrawn by the caller)."""
        ids = self.known.setdefault(wid, set())
        if seg.id in ids:
            return True
        news = self.retire_news.pop(wid, [])
        frames = [_GRANT.pack(-1, 0, old) for old in news[:-1]]
        frames.append(_GRANT.pack(seg.id, self.demand, news[-1] if news else -1))
        head = b"".join(frames[:-1])
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [seg.fd]))]
        try:
            # A few dozen bytes into a buffer the worker never fills (it writes the other
            # way): these do not block.
            if head:
                sock.sendall(head)
            sent = sock.sendmsg([frames[-1]], anc)
            if sent < _GRANT.size:
                sock.sendall(frames[-1][sent:])
        except OSError:
            return False
        ids.add(seg.id)
        return True

    def end(self, key: tuple[int, int, int], rebuilt: bool = True) -> None:
        """Task ``key``'s result arrived: its grant ends (its segment holds the batch, if
        the worker used it: the lease of the rebuilt storages has it now).

        ``rebuilt=False``: it arrived but could not be rebuilt (``Undecodable``): nothing of
        it is held here, so the flag its worker set for it is cleared -- unless a lease made
        before the failure still lives (its end clears it)."""
        sid = self.grants.pop(key, None)
        seg = self.segments.get(sid) if sid is not None else None
        if seg is not None:
            seg.grant = None
            if not rebuilt and seg.mapped() and not seg.mapping.leases:  # type: ignore[union-attr]
                seg.mapping.flag.value = 0  # type: ignore[union-attr]
                seg.filled = False
            if seg.filled:
                seg.filled = False
                seg.since = key[1:]

    def end_before(self, wid: int, gen: int) -> None:
        """Worker ``wid`` sent a result of generation ``gen``: it dropped its older tasks."""
        for key in [k for k in self.grants if k[0] == wid and k[1] < gen]:
            self.end(key)

    def drop_worker(self, wid: int) -> None:
        """Worker ``wid``'s process is confirmed dead: what it was granted is free again,
        whatever it wrote (no message of it completed: its flag is cleared), and its
        replacement gets the fds anew."""
        for key in [k for k in self.grants if k[0] == wid]:
            sid = self.grants.pop(key)
            seg = self.segments.get(sid)
            if seg is not None:
                seg.grant = None
                seg.filled = False
                if seg.mapped() and not seg.mapping.leases:  # type: ignore[union-attr]
                    # Set by the dead worker for a message that never completed.
                    seg.mapping.flag.value = 0  # type: ignore[union-attr]
        self.known.pop(wid, None)
        self.retire_news.pop(wid, None)

    def close(self) -> None:
        """Close every fd; mappings go with their last lease (or now, if none is held)."""
        self.closed = True
        segs, self.segments = list(self.segments.values()), {}
        self.grants.clear()
        self.known.clear()
        for seg in segs:
            if self._unregister is not None:
                self._unregister(seg.fd)
            try:
                os.close(seg.fd)
            except OSError:
                pass


def _rebuild_pooled(off: int, nbytes: int) -> torch.UntypedStorage:
    lease = _tls.lease
    buf = (ctypes.c_uint8 * nbytes).from_address(lease.seg.addr + off)
    buf._lease = lease  # type: ignore[attr-defined]  # the storage holds buf, buf the lease
    return torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()


class _Outbox:
    """One message's pickling: the fds to attach and how its storages travel.

    It must not refer to the pickler (see the module docstring): the pickler's dispatch table
    refers to it.
    """

    __slots__ = (
        "fallback_bytes",
        "fds",
        "keep",
        "lent",
        "packed",
        "policy",
        "pool",
        "pool_seg",
        "pool_sent",
        "pooled_bytes",
        "shared_bytes",
        "shm",
        "slot_of",
        "slots",
        "small",
    )

    def __init__(self, fds: list[int], shm: bool, policy: ShmPolicy | None) -> None:
        self.fds = fds
        self.shm = shm  # large storages may go through /dev/shm
        self.policy = policy
        self.shared_bytes = 0
        self.fallback_bytes = 0
        # file_system storages whose segment torch's reducer took a reference on for the
        # receiver (its unpickling gives it back): given back here if the message is not sent.
        self.lent: list[torch.UntypedStorage] = []
        # Storages bound for shared memory, in slot order, until ``_place`` decides how each
        # travels; ``slot_of`` maps a storage (``_identity``) to its slot.
        self.slots: list[torch.UntypedStorage] = []
        self.slot_of: dict[int, int] = {}
        # The packed segment: it owns the fd in ``fds`` until the message is sent.
        self.keep: torch.UntypedStorage | None = None
        self.packed = False  # whether storages were packed into one segment
        # The worker's segment pool, and its segment this message lends (None: none).
        self.pool = policy.pool if policy is not None else None
        self.pool_seg: _Segment | None = None
        self.pooled_bytes = 0
        self.pool_sent: tuple[bool, int] = (False, 0)  # see ``_pool_info``
        # Small storages copied into the message (``_identity`` -> the storage, kept alive so
        # that its key cannot be reused, and its bytes): one bytearray per storage, which
        # pickle's memo sends once, so tensors that shared it still share it when rebuilt.
        self.small: dict[int, tuple[torch.UntypedStorage, bytearray]] = {}

    def unsent(self) -> None:
        """The message did not reach the receiver: return the references taken for it, or
        their segments would stay in /dev/shm until the shm manager exits with this run."""
        lent, self.lent = self.lent, []
        for storage in lent:
            storage._shared_decref()


def _byte_view(storage: torch.UntypedStorage) -> Any:
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


def _reduce_storage(out: _Outbox, storage: torch.UntypedStorage) -> Any:
    if storage.device.type != "cpu":
        raise RuntimeError("cannot send a non-CPU storage from a DataLoader worker")
    nbytes = storage.nbytes()
    if nbytes == 0:
        return (_rebuild_empty_storage, ())
    if out.pool is not None:
        off = out.pool.where(storage)
        if off >= 0:  # collated into the pooled segment: it travels as it lies
            out.pool_seg = out.pool.target
            out.pooled_bytes += nbytes
            return (_rebuild_pooled, (off, nbytes))
    if nbytes <= INLINE_MAX:
        return (_rebuild_small_storage, (_small_bytes(out, storage, nbytes),))
    # Already in shared memory (a collate in a worker allocates there): sharing allocates
    # nothing, so it is done even for a batch that was told to stay out of /dev/shm.
    if out.shm or storage.is_shared():
        # Placed once the whole message is pickled (``_place``); the same storage reached
        # through two tensors takes one slot, so the tensors still share it on the other side.
        # (``out.slots`` keeps the storage alive: its key is not reused in this message.)
        key = _identity(storage)
        slot = out.slot_of.get(key)
        if slot is None:
            slot = out.slot_of[key] = len(out.slots)
            out.slots.append(storage)
        return (_rebuild_slot, (slot,))
    return _fallback(out, storage)


def _identity(storage: torch.UntypedStorage) -> int:
    """Which storage this is, as torch counts them: its StorageImpl (every tensor and Python
    object of one storage has the same). Not its data pointer: two storages may start at one
    address and differ in size -- ``torch.from_numpy(a)`` and ``torch.from_numpy(a[:-1])`` --
    and each must arrive with its own bytes (issue #31 item 3). As in torch's own loader,
    distinct storages arrive as distinct copies, even where their memory overlapped in the
    worker; the tensors of one storage still share it on arrival. Unique only while the storage
    lives: a key is kept only next to a reference to its storage."""
    return int(storage._cdata)


def _small_bytes(out: _Outbox, storage: torch.UntypedStorage, nbytes: int) -> bytearray:
    key = _identity(storage)
    held = out.small.get(key)
    if held is None:
        held = out.small[key] = (storage, bytearray(ctypes.string_at(storage.data_ptr(), nbytes)))
    return held[1]


def _rebuild_small_storage(data: bytearray) -> torch.UntypedStorage:
    return torch.frombuffer(data, dtype=torch.uint8).untyped_storage()


def _rebuild_small_tensor(data: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> Any:
    flat = torch.frombuffer(data, dtype=dtype)
    # A 1-d tensor is its whole storage (see _reduce_tensor): frombuffer's shape already.
    # Other shapes: resized in place to the same number of elements (no reallocation), not
    # view(), which costs ~0.9 us more and makes it a view of a tensor nobody holds.
    if len(shape) == 1:
        return flat
    return flat.resize_(*shape) if shape else flat.resize_(())


def _rebuild_conj(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.conj()


def _rebuild_neg(tensor: torch.Tensor) -> torch.Tensor:
    return torch._neg_view(tensor)


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    """A small plain CPU tensor that is its whole storage travels as its bytes, its dtype and
    its shape: a third of the cost of torch's reduction, which rebuilds a typed storage and
    sets the tensor's metadata field by field -- per batch, on both sides, the largest fixed
    cost of a small batch. Anything else goes through torch's ``reduce_tensor`` unchanged.
    Its bytes are the storage's (``_small_bytes``): a view of the same storage elsewhere in the
    message still shares them once rebuilt."""
    # torch's reduction drops the lazy conjugate and negative bits: a ``z.conj()`` would arrive
    # as ``z``. Send the view without the bit (same storage) and set it again on arrival.
    if tensor.is_conj():
        return (_rebuild_conj, (tensor.conj(),))
    if tensor.is_neg():
        return (_rebuild_neg, (torch._neg_view(tensor),))
    out = _tls.out
    if (
        type(tensor) is torch.Tensor
        and not tensor.requires_grad
        and tensor.layout == torch.strided
        and tensor.device.type == "cpu"
        and tensor.storage_offset() == 0
        and tensor.is_contiguous()
        and not tensor.is_quantized
    ):
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if 0 < nbytes <= INLINE_MAX and nbytes == tensor.nbytes:
            pool = out.pool
            if pool is None or pool.where(storage) < 0:
                data = _small_bytes(out, storage, nbytes)
                return (_rebuild_small_tensor, (data, tensor.dtype, tuple(tensor.shape)))
    return _torch_reduce_tensor(tensor)


def _fallback(out: _Outbox, storage: Any) -> Any:
    """A storage copied into the message because it may not (or cannot) use /dev/shm."""
    out.fallback_bytes += storage.nbytes()
    note = out.policy.note if out.policy is not None else None
    if note is None:
        total, used = _shm_usage()
        note = ShmNote("shared memory was not used for this batch", total, used, os.getpid())
    # A writable buffer pickles (protocol 5, in band) as a bytearray straight from the storage:
    # no intermediate bytes object.
    return (_rebuild_fallback_storage, (pickle.PickleBuffer(_byte_view(storage)), tuple(note)))


def _place(out: _Outbox) -> Any:
    """Decide how each slot's storage travels (see the module docstring); the slot table.

    The table is ``(pack, entries)``: ``pack`` the reduced shared segment holding the packed
    storages (None if none are), each entry ``(SOLO, reduced)``, ``(PACKED, offset, nbytes)``
    or ``(INLINE, reduced)``. Raises what sharing raises (a full /dev/shm: ``dumps`` then
    sends the message again without it).
    """
    slots = out.slots
    solo: list[int] = list(range(len(slots)))
    packed: list[int] = []
    if len(slots) > MAX_FDS_PER_MSG:
        # Keep the largest storages that are already shared as they lie; copy the others.
        by_size = sorted(solo, key=lambda i: slots[i].nbytes(), reverse=True)
        keep = [i for i in by_size if slots[i].is_shared() and slots[i].nbytes() >= SOLO_MIN]
        keep = keep[: MAX_FDS_PER_MSG - 1]
        if out.shm:
            solo, packed = keep, sorted(set(solo) - set(keep))
        else:  # may not allocate: the already shared ones go inline beyond the fd budget
            solo = keep + [i for i in by_size if i not in keep][: MAX_FDS_PER_MSG - len(keep)]
    entries: list[Any] = [None] * len(slots)
    for i in solo:
        entries[i] = (SOLO, _share(out, slots[i]))
        out.shared_bytes += slots[i].nbytes()
    pack = None
    if packed:
        offsets, total = [], 0
        for i in packed:
            offsets.append(total)
            total += -(-slots[i].nbytes() // PACK_ALIGN) * PACK_ALIGN
        segment = torch.UntypedStorage._new_shared(total)
        dest = _byte_view(segment)
        for i, off in zip(packed, offsets):
            n = slots[i].nbytes()
            dest[off : off + n] = _byte_view(slots[i])
            entries[i] = (PACKED, off, n)
        del dest
        pack = _share(out, segment)
        out.keep = segment
        out.packed = True
        out.shared_bytes += total
    for i, e in enumerate(entries):
        if e is None:
            entries[i] = (INLINE, _fallback(out, slots[i]))
    return pack, entries


# Slot table entry kinds (see ``_place``).
SOLO, PACKED, INLINE = 0, 1, 2


def _rebuild_slot(index: int) -> torch.UntypedStorage:
    return _tls.slots[index]


def _pool_info(out: _Outbox) -> Any:
    """What the main process must learn about the worker's pool with this message (None:
    nothing): ``(the segment id this message lends or -1, (fd index, size) of that segment if
    it is new to the main process, ids retired)``."""
    pool, seg = out.pool, out.pool_seg
    if pool is not None and pool.granted:
        # ``(id or -1, None, [], demand, True)``: the main process has every granted segment
        # mapped; it learns here how large batches are, to size the segments it makes.
        if seg is None and pool.demand == pool.reported:
            return None
        pool.reported = pool.demand
        return (seg.id if seg is not None else -1, None, [], pool.demand, True)
    if pool is None or (seg is None and not pool.retired):
        return None
    new = None
    if seg is not None and not seg.announced:
        assert seg.storage is not None  # (the worker's own: granted ones are announced)
        out.fds.append(seg.storage._share_fd_cpu_()[0])  # (owned by the segment's storage)
        new = (len(out.fds) - 1, seg.size)
    out.pool_sent = (new is not None, len(pool.retired))
    return (seg.id if seg is not None else -1, new, list(pool.retired), 0, False)


def _unpack(table: Any) -> list[torch.UntypedStorage]:
    """Main side: the storages of a message's slots, from its slot table (see ``_place``)."""
    pack_reduced, entries, pool_info = table
    if pool_info is not None:
        _tls.receiver._pool_update(pool_info)
    whole = None
    if pack_reduced is not None:
        fn, args = pack_reduced
        whole = _byte_view(fn(*args))
    out = []
    for entry in entries:
        kind = entry[0]
        if kind == PACKED:
            off, n = entry[1], entry[2]
            assert whole is not None
            # A storage over the slice: it holds the slice, which holds the segment.
            out.append(torch.frombuffer(whole[off : off + n], dtype=torch.uint8).untyped_storage())
        else:
            fn, args = entry[1]
            out.append(fn(*args))
    return out


def _share(out: _Outbox, storage: torch.UntypedStorage) -> Any:
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        from torch.multiprocessing.reductions import reduce_storage

        reduced = reduce_storage(storage)  # file_system: needs no live sender
        out.lent.append(storage)
        return reduced
    fd, size = storage._share_fd_cpu_()
    out.fds.append(fd)
    return (_rebuild_fd_storage, (len(out.fds) - 1, size))


def _reduce_outbox_storage(storage: torch.UntypedStorage) -> Any:
    return _reduce_storage(_tls.out, storage)


# ForkingPickler copies copyreg's table and its own reducers into a fresh dict for every
# pickler: ~10 us a message, the largest fixed cost of pickling a small batch. The merged table
# is built once instead (again when a reducer was registered since) and shared by every
# message's pickler; the storage entry finds the message's outbox in ``_tls.out`` while that
# message is pickled, so nothing in the table refers to a message (see the module docstring).
_table_cache: list[Any] = [None, -1, -1]  # [table, len(copyreg's), len(ForkingPickler's)]


def _dispatch_table() -> dict[Any, Any]:
    import copyreg

    extra: dict[Any, Any] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    table, n_copyreg, n_extra = _table_cache
    if table is None or n_copyreg != len(copyreg.dispatch_table) or n_extra != len(extra):
        table = dict(copyreg.dispatch_table)
        table.update(extra)
        table[torch.UntypedStorage] = _reduce_outbox_storage
        table[torch.Tensor] = _reduce_tensor
        _table_cache[:] = [table, len(copyreg.dispatch_table), len(extra)]
    return table


def dumps(
    obj: Any, policy: ShmPolicy | None = None, shm: bool = True
) -> tuple[bytes, int, list[int], _Outbox]:
    """Pickle ``obj``; returns the payload, the length of its body (the rest is the slot
    table), the fds it refers to (owned by their storages) and how its storages travel.
    ``shm=False``: large storages not already in shared memory are copied into the payload."""
    buf = io.BytesIO()
    out = _Outbox([], shm, policy)
    pickler = pickle.Pickler(buf, 5)
    pickler.dispatch_table = _dispatch_table()
    outer = getattr(_tls, "out", None)  # (a reducer of the batch may itself call dumps)
    _tls.out = out
    try:
        pickler.dump(obj)
    finally:
        _tls.out = outer
        # The memo refers to everything pickled; release it now, whatever refers to the pickler.
        pickler.clear_memo()
        del pickler
    body_len = buf.tell()
    pool_info = _pool_info(out)
    if out.slots or pool_info is not None:
        table: Any = (None, [])
        try:
            if out.slots:
                table = _place(out)
        except (RuntimeError, OSError) as exc:
            out.unsent()  # (storages already lent under file_system)
            out.slots = []
            if not shm or not (shm_exhausted(exc) or fds_exhausted(exc)):
                raise
            if policy is not None:
                why = exc if shm_exhausted(exc) else FdLimitError(fd_limit_text("sharing a batch"))
                policy.failed(why)
            # Out of the full /dev/shm: the storages not already there are copied instead.
            payload, body_len, fds, again = dumps(obj, policy, False)
            again.fallback_bytes += out.fallback_bytes
            return payload, body_len, fds, again
        out.slots = []  # the table refers to what is needed now
        ForkingPickler(buf, 5).dump((*table, pool_info))
    return buf.getvalue(), body_len, out.fds, out


def send(
    sock: socket.socket,
    obj: Any,
    policy: ShmPolicy | None = None,
    shm: bool = True,
    tag: tuple[int, int] = NO_TAG,
) -> None:
    """Worker side: send one message (blocking). Pickling errors raise before any byte is sent.

    ``policy``/``shm``: see ``ShmPolicy`` and ``dumps``. ``tag``: a result's (generation,
    task id), readable on arrival without unpickling (see ``Undecodable``).
    """
    payload, body_len, fds, out = dumps(obj, policy, shm)
    pool, seg = out.pool, out.pool_seg
    if seg is not None:
        # Lent before a byte goes out: the main process may give it back as soon as it has it.
        seg.flag[0] = 1
    try:
        _send_frame(sock, payload, body_len, fds, tag)
    except BaseException:
        out.unsent()  # a message cut short is discarded whole by the receiver
        if seg is not None:
            seg.flag[0] = 0
        raise
    out.lent = []
    if pool is not None:
        seg_sent, retired = out.pool_sent
        if seg_sent:
            seg.announced = True  # type: ignore[union-attr]
        del pool.retired[:retired]
    if policy is not None:
        policy.sent(out)


def _send_frame(
    sock: socket.socket,
    payload: bytes,
    body_len: int,
    fds: list[int],
    tag: tuple[int, int] = NO_TAG,
) -> None:
    header = _HEADER.pack(len(payload), len(fds), body_len, *tag)
    total = len(header) + len(payload)
    if fds:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        sent = sock.sendmsg([header, payload], anc)
    elif total < 65536:
        sent = sock.send(header + payload)
    else:
        sent = sock.sendmsg([header, payload])  # no concatenated copy of a large payload
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    if sent < total:
        sock.sendall(memoryview(payload)[sent - len(header) :])


class ChannelClosed(Exception):
    """The peer closed its end (it exited or died)."""


class Undecodable(NamedTuple):
    """What ``Receiver.feed`` returns for a message that arrived whole but could not be
    rebuilt (unpickled) here. ``gen``, ``tid``: its tag (a result's epoch generation and task
    id; -1 -1: not a result); ``error``: what unpickling raised, without its frames (nothing
    half-rebuilt stays alive through them), its traceback kept as text for the report;
    ``blame``: whose failure it most likely is, in a sentence (see ``_blame``)."""

    gen: int
    tid: int
    error: BaseException
    blame: str


class Receiver:
    """Main side: assembles messages from a non-blocking socket; never blocks.

    ``feed()`` reads what is available and returns the complete messages, each unpickled.
    A large payload is received straight into a buffer of its final size (no copies in the
    main process, which is the pipeline's serial stage).
    Invariant: ``_fds`` holds the fds received and not yet handed to a message, in order;
    they are closed if the channel closes first.
    """

    def __init__(self, sock: socket.socket, pool: LoaderPool | None = None) -> None:
        sock.setblocking(False)
        self.pool = pool  # the loader's segments, lent to the sender task by task
        self.sock = sock
        self.fd = sock.fileno()  # kept after close(): the supervisor unregisters by number
        self._buf = bytearray()  # bytes read but not yet part of a message body
        self._body: bytearray | None = None  # the large payload being filled in place
        self._got = 0  # bytes of _body filled
        self._need_fds = 0
        self._payload_len = -1
        self._body_len = 0
        self._tag = NO_TAG  # the tag of the message being received
        self._fds: list[int] = []
        # A read failed after messages were completed in the same ``feed`` (those are returned
        # first: a worker's READY must not be lost with it); raised by the next ``feed``.
        self.failure: BaseException | None = None
        self.eof = False  # the sender has closed its end (exited or was killed)
        self.received = 0  # bytes read so far: progress, even before a message is whole
        self._short = False  # the last read returned less than it asked for
        # The sender's pooled segments, each mapped here once (see ``SegmentPool``).
        self._pool_segs: dict[int, _Mapping] = {}

    def fileno(self) -> int:
        return self.fd

    def _pool_update(self, info: Any) -> None:
        """A message's news of the sender's pool (see ``_pool_info``); the lease of the
        segment it lends goes to ``_tls.lease`` for its storages."""
        sid, new, retired, demand, granted = info
        if granted:
            pool = self.pool
            if pool is None:
                raise RuntimeError("a batch in a granted segment, and the receiver has no pool")
            if demand:
                pool.demand = demand
            if sid >= 0:
                seg = pool.segments[sid]
                if not seg.mapped():
                    raise RuntimeError(f"pooled segment {sid} came unsized")
                assert seg.mapping is not None
                seg.filled = True
                _tls.lease = _Lease(seg.mapping)
            return
        for old in retired:
            self._pool_segs.pop(old, None)  # unmapped once no batch in it is held
        if new is not None:
            index, size = new
            _tls.used.add(index)
            try:
                self._pool_segs[sid] = _Mapping(_tls.fds[index], size)
            finally:
                os.close(_tls.fds[index])
        if sid >= 0:
            _tls.lease = _Lease(self._pool_segs[sid])

    def _take_fds(self, anc: list[tuple[int, int, bytes]]) -> None:
        for level, kind, blob in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(blob[: len(blob) - len(blob) % fds.itemsize])
                self._fds.extend(fds)

    def _recv(self) -> bool:
        """One read; False if nothing was available.

        Always recvmsg with room for fds: a plain recv() that meets a segment carrying fds
        makes the kernel discard them.
        """
        try:
            if self._body is not None and self._got < len(self._body):
                view = memoryview(self._body)[self._got :]
                n, anc, _flags, _addr = self.sock.recvmsg_into([view], _ANC_SPACE)
                data = None
            else:
                data, anc, _flags, _addr = self.sock.recvmsg(_READ_CHUNK, _ANC_SPACE)
                n = len(data)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise ChannelClosed(str(exc)) from exc
        self._take_fds(anc)
        if _flags & _MSG_CTRUNC:
            # The kernel dropped fds that had no room here: their message cannot be rebuilt.
            raise FdLimitError(fd_limit_text("receiving a batch"))
        if n == 0:
            raise ChannelClosed("end of stream")
        self.received += n
        if data is None:
            self._got += n
            self._short = n < len(view)
        else:
            self._buf += data
            self._short = n < _READ_CHUNK
        return True

    def feed(self, drain: bool = True) -> list[Any]:
        """Read what is available; return the messages completed (may be empty).

        Once the sender is gone, ``eof`` is set: the messages it completed before going are
        still returned (a worker's last words, such as its worker_init_fn error, arrive just
        before its exit), and a partial message is discarded. A message that came whole but
        cannot be unpickled is returned as an ``Undecodable`` in its place. A read that fails
        (fds dropped for want of room: ``FdLimitError``) raises -- after the messages completed
        before it, which this call returns, leaving the error in ``failure`` for the next.

        Args:
            drain: read until the socket has nothing more (or is closed). False: stop after
                a read that returned less than it asked for (the socket was most likely empty
                then): the read that would only say "nothing more" (EAGAIN), one per batch
                of a small-batch epoch, is left out. What a short read left behind keeps the
                socket readable, so a level-triggered poll calls again at once.
        """
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure
        out: list[Any] = []
        self._short = False
        while True:
            if self._payload_len < 0 and len(self._buf) >= _HEADER.size:
                length, nfds, body_len, gen, tid = _HEADER.unpack_from(self._buf)
                self._payload_len, self._need_fds, self._body_len = length, nfds, body_len
                self._tag = (gen, tid)
                del self._buf[: _HEADER.size]
                if self._payload_len > _RECV_CHUNK and len(self._buf) < self._payload_len:
                    # Large: receive the rest in place, straight into its final buffer.
                    self._body = bytearray(self._payload_len)
                    self._got = len(self._buf)
                    self._body[: self._got] = self._buf
                    self._buf.clear()
            # fds ride with the header's bytes, so they are normally here before the body is.
            fds_ready = self._payload_len >= 0 and len(self._fds) >= self._need_fds
            payload: Any = None
            if fds_ready and self._body is not None and self._got == self._payload_len:
                payload, self._body = self._body, None
            elif fds_ready and self._body is None and len(self._buf) >= self._payload_len:
                payload = bytes(self._buf[: self._payload_len])
                del self._buf[: self._payload_len]
            if payload is not None:
                fds = self._fds[: self._need_fds]
                del self._fds[: self._need_fds]  # any further fds belong to the next message
                self._payload_len = -1
                self._need_fds = 0
                out.append(self._rebuild(payload, fds))
                continue
            if self.eof or (self._short and not drain):
                return out
            try:
                more = self._recv()
            except ChannelClosed:
                self.eof = True
                return out
            except Exception as exc:
                if not out:
                    raise
                self.failure = exc
                return out
            if not more:
                return out

    def _rebuild(self, payload: bytes | bytearray, fds: list[int]) -> Any:
        """The message, or an ``Undecodable`` if it cannot be unpickled (the channel itself
        is fine: its frame was whole)."""
        try:
            return self._decode(payload, self._body_len, fds)
        except Exception as exc:
            blame = _blame(exc)
            return Undecodable(*self._tag, _without_frames(exc), blame)

    def _decode(self, payload: bytes | bytearray, body_len: int, fds: list[int]) -> Any:
        if not fds and body_len == len(payload):
            # No fd and no slot table (a small batch, every storage inline): nothing to map
            # or close, only a fallback storage to note.
            _tls.fallback = []
            try:
                msg = pickle.loads(payload)
                fallback = _tls.fallback
            finally:
                _tls.fallback = None
            if fallback:
                _warn_shm(sum(n for n, _ in fallback), ShmNote(*fallback[-1][1]))
            return msg
        _tls.fds, _tls.used, _tls.fallback, _tls.receiver = fds, set(), [], self
        try:
            with memoryview(payload) as view:
                if body_len < len(payload):
                    _tls.slots = _unpack(ForkingPickler.loads(view[body_len:]))
                msg = ForkingPickler.loads(view[:body_len])
            fallback = _tls.fallback
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE) or "Too many open files" in str(exc):
                raise FdLimitError(fd_limit_text("mapping a received batch")) from exc
            raise
        except RuntimeError as exc:
            if "Too many open files" in str(exc):
                raise FdLimitError(fd_limit_text("mapping a received batch")) from exc
            raise
        finally:
            _tls.slots = _tls.lease = _tls.receiver = None
            for i, fd in enumerate(fds):
                if i not in _tls.used:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            _tls.fds = _tls.used = _tls.fallback = None
        if fallback:
            _warn_shm(sum(n for n, _ in fallback), ShmNote(*fallback[-1][1]))
        return msg

    def close(self) -> None:
        if torch.multiprocessing.get_sharing_strategy() == "file_system" and not self.eof:
            # Decode and drop what is already here instead of discarding the bytes: under
            # file_system the sender took a reference on each segment for us (torch's
            # protocol), which only unpickling gives back; left unread, those segments would
            # stay in /dev/shm until this process exits (a `break` out of every epoch would
            # leave a prefetch window's worth each time). Under file_descriptor, closing the
            # socket releases the fds in flight.
            try:
                self.feed()
            except Exception:
                pass  # a message that cannot be decoded now is beyond saving
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
        self._buf.clear()
        # Batches still held keep their segments mapped through their leases.
        self._pool_segs.clear()
        self.sock.close()


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _blame(exc: BaseException) -> str:
    """Whose failure it most likely is that a message could not be unpickled here, read from
    where ``exc`` was raised: in our rebuilding of tensors and storages (ours, or torch's on
    our behalf) it is a bug of ours; in code of the batch's own (a ``__setstate__``, a
    reduce function) or in looking up a class the main process does not have, the batch's."""
    if isinstance(exc, FdLimitError):
        return "This process had no file descriptor left to map it: see above for what to do."
    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return "The error came with no traceback to say where it was raised."
    code = last.tb_frame.f_code
    ours = (
        "It was raised while the loader rebuilt the batch's tensors: a bug in "
        "resumable_loader -- please report it, with this traceback."
    )
    if code is Receiver._decode.__code__:
        # Raised by the unpickler itself, not in a function it called.
        if isinstance(exc, (ImportError, AttributeError)):
            return (
                "The batch refers to a class or function the main process cannot import "
                "(one defined only where the workers load it): define it in a module both "
                "import."
            )
        return (
            "Either the batch holds something the main process cannot unpickle, or this is "
            "a bug in resumable_loader (then please report it, with this traceback)."
        )
    path = os.path.abspath(code.co_filename)
    if path.startswith((_PACKAGE_DIR, _TORCH_DIR)):
        return ours
    return (
        f"It was raised by the batch's own code while it was rebuilt ({code.co_name}, "
        f"{path}:{last.tb_lineno}): the batch holds an object that cannot be rebuilt in the "
        "main process."
    )


def _without_frames(exc: BaseException) -> BaseException:
    """``exc`` as an ``Undecodable`` keeps it: its traceback, and that of each exception it
    was raised from or during, turned into text (a ``RemoteTraceback`` at the root of its
    ``__cause__`` chain, printed first), and its frames dropped. A frame keeps its callers'
    frames, and their variables, alive: the receiver's message list that holds the error (a
    cycle), the iterator, and whatever the unpickling had built (storages, fds, mapped
    segments) -- until the user's error went and the cycle collector ran."""
    text = "".join(traceback.format_exception(exc))
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and not any(link is c for c in chain):
        chain.append(link)
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    root = exc
    for _ in chain:  # (bounded: causes may form a loop)
        if root.__cause__ is None:
            root.__cause__ = RemoteTraceback(text)
            break
        root = root.__cause__
    return exc


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _warn_shm(nbytes: int, note: ShmNote) -> None:
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
