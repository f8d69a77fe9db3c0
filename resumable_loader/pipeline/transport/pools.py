"""Shared-memory segments reused batch after batch (issue #26): the worker's pool and the
loader's.

A fresh segment per batch costs more than the work of an image batch -- every page zeroed,
faulted in by the worker and again by the main process, then torn down. So each worker keeps a
few segments (``SegmentPool``: its share of the prefetch window and the batch the caller holds);
torch's collate writes the batch straight into a free one (``collating``); the message carries
(offset, length) in it, and the segment's fd only the first time; the main process maps each
segment once (``SegmentMapping``) and rebuilds the batch's storages over it, each holding a
``Lease`` whose end hands the segment back (a flag byte at its end). A worker never writes into
a segment whose flag is set, so a batch the caller holds is never overwritten; a batch that
finds none free takes a fresh segment, as before.

The loader's pool (``LoaderPool``): a pool per worker holds ``workers x (prefetch + 1)``
segments, one more per worker than the window and the batch the caller holds need. So under a
loader the segments are the main process's instead, at most ``window + 1``, lent task by task:
each task carries a grant, each segment's fd goes to a worker process once (over its result
socket, the other way), and the worker's ``SegmentPool`` collates into the granted segment
under the same flag rule. Without a grant (the transport used alone) a worker keeps its own
pool as above.

This module owns the segments, their flags, mappings and leases, and the grants; what a
message says about them is the reducers' (``reducers``), and whether a batch may use shared
memory at all is the policy's (``policy``). It sits below both, so it also holds the two sizes
they share with it (``PACK_ALIGN``, ``INLINE_MAX``) and ``byte_view``.

It stays long (two pools, the two sides of each): the sections below follow a segment from the
worker that fills it to the main process that maps it, then the loader's pool that lends it.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from ...core import compat
from .memfd import reserve as reserve_pages

# Storages packed into one segment start at multiples of this: a rebuilt tensor keeps the
# alignment its dtype and vectorised kernels expect.
PACK_ALIGN = 64
# Copy storages up to this size into the message: one memcpy beats an fd round trip + mmap.
# (The reducers apply it; it is here, below them, because the pool's allocator skips such
# storages too.)
INLINE_MAX = 32 * 1024
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


def byte_view(storage: torch.UntypedStorage) -> Any:
    """A numpy uint8 array over ``storage``'s bytes (no copy): how segments are sliced and
    filled."""
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


# ---- the worker's pool ----


class Segment:
    """A pooled segment, worker side: its storage (which owns the fd) and a byte view of it.
    Its last ``PACK_ALIGN`` bytes hold its lending flag (see ``SegmentPool``)."""

    __slots__ = ("announced", "base", "flag", "id", "size", "storage", "view")

    def __init__(self, sid: int, size: int) -> None:
        self.id = sid
        self.size = size  # bytes for batches, before the flag
        self.storage: torch.UntypedStorage | None = compat.new_shared(size + PACK_ALIGN)
        self.view = byte_view(self.storage)
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


def reserve(fd: int, nbytes: int) -> None:
    """Give a new granted segment its size, its pages reserved. (A function of its own:
    ``testing.ShmFailure`` makes it fail as a full /dev/shm makes torch's allocations fail.)

    Raises:
        RuntimeError: no room, in the words of torch's allocator (and of ``memfd``), so that
            the batch is redone out of shared memory as when any other allocation fails.
    """
    reserve_pages(fd, nbytes, _POOL_NAME)


class _GrantedSegment(Segment):
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
        0: only if one has). Raises ``reserve``'s RuntimeError if there is no room for it,
        OSError if it cannot be mapped."""
        size = os.fstat(self.fd).st_size - PACK_ALIGN
        if size <= 0:
            if not want:
                return
            size = _round_up(max(want, self.hint) * 33 // 32, POOL_ROUND)
            # Reserved now (as memfd does): a lack of memory fails here, never as a SIGBUS.
            reserve(self.fd, size + PACK_ALIGN)
        mapping = SegmentMapping(self.fd, size)
        buf = (ctypes.c_uint8 * (size + PACK_ALIGN)).from_address(mapping.addr)
        buf._mapping = mapping  # type: ignore[attr-defined]  # unmapped with its last slice
        self.view = byte_view(torch.frombuffer(buf, dtype=torch.uint8).untyped_storage())
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
    is gone (``Lease``). A worker killed mid-write leaves a segment that was never lent, in a
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
        self.segments: dict[int, Any] = {}  # id -> Segment (or _GrantedSegment)
        self.next_id = 0
        self.retired: list[int] = []  # ids the main process must forget (sent with a message)
        self.target: Segment | None = None  # the segment the batch being built goes into
        self.offset = 0  # bytes of ``target`` taken by the batch being built
        self.asked = 0  # shared bytes the current collate asked for (aligned)
        self.demand = 0  # ... and the last one's
        self.thread = 0  # the thread whose collate allocates from the pool (0: none)

    def _free(self) -> list[Segment]:
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
        seg = Segment(self.next_id, _round_up(want + want // 32, POOL_ROUND))
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


_torch_new_shared = compat.torch_new_shared()
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


def new_worker_pool(cap: int) -> SegmentPool:
    """Make this process's segment pool (a worker's: at most one per process), the one
    ``collating()`` allocates from, holding at most ``cap`` segments."""
    global _worker_pool
    _worker_pool = SegmentPool(cap)
    return _worker_pool


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
    if not compat.new_shared_replaced():
        # Installed once and kept: setting a class attribute per batch invalidated Python's
        # method caches for every storage type (a few microseconds a batch). Outside a
        # collate -- other threads, other times -- it defers to torch's own (``pool.thread``).
        compat.replace_new_shared(_pooled_new_shared)
    pool.thread = threading.get_ident()
    try:
        yield
    finally:
        pool.thread = 0
        pool.demand = pool.asked


# ---- mappings and leases (main side) ----

# Main side: mappings made with mmap(2) directly, so that no fd is held per pooled segment
# (Python's mmap module keeps a dup of the fd for as long as the mapping lives).
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
_libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class SegmentMapping:
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
        self.leases = 0  # batches this process holds in it (``Lease``)

    def __del__(self, _munmap: Any = _libc.munmap) -> None:  # (bound now: safe at exit)
        _munmap(self.addr, self.size + PACK_ALIGN)


class Lease:
    """Main side: one batch's hold on a pooled segment. Every storage rebuilt over the segment
    refers to it; when the last goes, the segment goes back to its worker (its flag).

    Only in the process that received the batch: a worker forked later holds a copy of the
    lease (of everything this process held), and that copy going away at the worker's exit
    must not give back a segment whose batch this process still holds.
    """

    __slots__ = ("pid", "seg")

    def __init__(self, seg: SegmentMapping) -> None:
        self.seg = seg
        self.pid = os.getpid()
        seg.leases += 1

    def __del__(self) -> None:
        if os.getpid() == self.pid:
            seg = self.seg
            seg.leases -= 1
            if not seg.leases:
                seg.flag.value = 0


# ---- the loader's pool (main side) ----

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
        self.mapping: SegmentMapping | None = None
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
                    self.mapping = SegmentMapping(self.fd, size)
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
