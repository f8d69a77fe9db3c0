"""How a message's storages and tensors are pickled in a worker and rebuilt in the main process.

One fd per batch (issue #11): every storage that travels through shared memory takes a slot
while the message is pickled; only then, with all of them known, is each placed (``_place``).
A batch of at most ``MAX_FDS_PER_MSG`` such storages sends each on its own fd, as it lies (the
usual image batch: one large storage, collated straight into shared memory). A batch of more
-- a dict of 50 fields -- is packed: its largest ``MAX_FDS_PER_MSG - 1`` storages already in
shared memory still go on their own fds (no copy), the rest are copied into one segment, and
the main process rebuilds each as a storage over its slice of that segment (``_unpack``). A
received storage holds its fd open for as long as it lives (torch maps with the fd kept), so
one fd per batch rather than per tensor is what keeps a large prefetch window under
``ulimit -n``. The slices keep the segment alive through ordinary references (slice -> array
-> segment): it is freed, fd and all, when the caller drops the last tensor of the batch.

Storages of at most ``INLINE_MAX`` bytes are copied into the message's body instead: for small
batches that is cheaper than passing and mapping an fd. A storage collated into a pooled
segment (``pools``) travels as (offset, length) in it. A storage that may not or cannot use
shared memory (``policy``) is copied into the message and warned about on arrival.

Memory: a batch has one owner at a time. Nothing on the send path may form a reference cycle
with the batch: the pickler's memo holds every object it pickled until the pickler dies, so a
pickler kept alive by a cycle would keep the batch -- and its /dev/shm segment -- until Python's
cycle collector happened to run (issue #16: 42 segments mapped per worker). Hence the storage
reducer is a module function that finds the message's ``Outbox`` in a thread-local while that
message is pickled, never a bound method of the pickler. The rebuild functions find what they
need on the main side (the message's fds, the lease of its pooled segment) in the same
thread-local, set by ``decode`` for the one message it unpickles.

This module owns the payload -- ``dumps`` makes it, ``decode`` reads it back; the frame around
it, and the socket, are ``framing``'s.
"""

from __future__ import annotations

import ctypes
import errno
import io
import os
import pickle
import threading
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor as _torch_reduce_tensor

from ...core import compat
from .policy import (
    FdLimitError,
    ShmNote,
    ShmPolicy,
    fd_limit_text,
    fds_exhausted,
    shm_exhausted,
    shm_usage,
    warn_shm,
)
from .pools import INLINE_MAX, PACK_ALIGN, Lease, Segment, byte_view

# At most this many fds per message (see the module docstring): enough for the batches whose
# few large storages are best sent as they lie, few enough that num_workers x prefetch_factor
# batches in flight stay far below a 1024-fd limit.
MAX_FDS_PER_MSG = 4
# ... and only storages of at least this size keep an fd of their own in a packed batch: below
# it, copying the storage into the shared segment costs less than a segment of its own.
SOLO_MIN = 256 * 1024

# This thread's message: the one being pickled (``out``), or the one being decoded (its
# ``fds``, those ``used``, its ``slots``, the ``lease`` of its pooled segment, its ``fallback``
# storages, the receiver's ``pool_update``). Reducers and rebuild functions are called by
# pickle with their own arguments only: this is how they find it.
_tls = threading.local()

# torch's private storage and tensor APIs (``core.compat``), bound once: each is called per
# storage or tensor of a batch.
_storage_from_fd = compat.storage_from_fd()
_share_fd = compat.storage_share_fd()
_shared_decref = compat.storage_shared_decref()
_storage_key = compat.storage_identity()
_neg_view = compat.neg_view()
_forking_reducers = compat.forking_pickler_reducers()


# ---- storages and tensors: how each is reduced, and rebuilt ----


def _rebuild_fd_storage(index: int, nbytes: int) -> torch.UntypedStorage:
    fd = _tls.fds[index]
    _tls.used.add(index)
    try:
        return _storage_from_fd(fd, nbytes)
    finally:
        os.close(fd)


def _rebuild_empty_storage() -> torch.UntypedStorage:
    return torch.UntypedStorage(0)


def _rebuild_fallback_storage(data: bytearray, note: tuple[Any, ...]) -> torch.UntypedStorage:
    """A storage that could not get shared memory in the worker and came inline instead.

    ``data`` is already a fresh bytearray (unpickled from the payload): the storage borrows it,
    no second copy. The main side notes the fallback, and ``decode`` warns once the
    whole message is in, with the size of the batch.
    """
    storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
    pending = getattr(_tls, "fallback", None)
    if pending is None:  # unpickled outside ``decode``: warn for this storage alone
        warn_shm(len(data), ShmNote(*note))
    else:
        pending.append((len(data), note))
    return storage


def _rebuild_pooled(off: int, nbytes: int) -> torch.UntypedStorage:
    lease = _tls.lease
    buf = (ctypes.c_uint8 * nbytes).from_address(lease.seg.addr + off)
    buf._lease = lease  # type: ignore[attr-defined]  # the storage holds buf, buf the lease
    return torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()


class Outbox:
    """One message's pickling: the fds to attach and how its storages travel.

    It must not refer to the pickler (see the module docstring): the pickler's dispatch table
    refers to it.
    """

    __slots__ = (
        "copies",
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
        # Shared copies of storages that were not in shared memory (``shared_copy``): each
        # owns its fd in ``fds`` until the message is sent.
        self.copies: list[torch.UntypedStorage] = []
        self.packed = False  # whether storages were packed into one segment
        # The worker's segment pool, and its segment this message lends (None: none).
        self.pool = policy.pool if policy is not None else None
        self.pool_seg: Segment | None = None
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
            _shared_decref(storage)


def _reduce_storage(out: Outbox, storage: torch.UntypedStorage) -> Any:
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
    return int(_storage_key(storage))


def _small_bytes(out: Outbox, storage: torch.UntypedStorage, nbytes: int) -> bytearray:
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
    return _neg_view(tensor)


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
        return (_rebuild_neg, (_neg_view(tensor),))
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


def _fallback(out: Outbox, storage: Any) -> Any:
    """A storage copied into the message because it may not (or cannot) use /dev/shm."""
    out.fallback_bytes += storage.nbytes()
    note = out.policy.note if out.policy is not None else None
    if note is None:
        total, used = shm_usage()
        note = ShmNote("shared memory was not used for this batch", total, used, os.getpid())
    # A writable buffer pickles (protocol 5, in band) as a bytearray straight from the storage:
    # no intermediate bytes object.
    return (_rebuild_fallback_storage, (pickle.PickleBuffer(byte_view(storage)), tuple(note)))


def _place(out: Outbox) -> Any:
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
        segment = compat.new_shared(total)
        dest = byte_view(segment)
        for i, off in zip(packed, offsets):
            n = slots[i].nbytes()
            dest[off : off + n] = byte_view(slots[i])
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


def _pool_info(out: Outbox) -> Any:
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
        out.fds.append(_share_fd(seg.storage)[0])  # (owned by the segment's storage)
        new = (len(out.fds) - 1, seg.size)
    out.pool_sent = (new is not None, len(pool.retired))
    return (seg.id if seg is not None else -1, new, list(pool.retired), 0, False)


def _unpack(table: Any) -> list[torch.UntypedStorage]:
    """Main side: the storages of a message's slots, from its slot table (see ``_place``)."""
    pack_reduced, entries, pool_info = table
    if pool_info is not None:
        _tls.lease = _tls.pool_update(pool_info, _tls.fds, _tls.used)
    whole = None
    if pack_reduced is not None:
        fn, args = pack_reduced
        whole = byte_view(fn(*args))
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


def _share(out: Outbox, storage: torch.UntypedStorage) -> Any:
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        from torch.multiprocessing.reductions import reduce_storage

        reduced = reduce_storage(storage)  # file_system: needs no live sender
        out.lent.append(storage)
        return reduced
    if not storage.is_shared():
        storage = shared_copy(out, storage)
    fd, size = _share_fd(storage)
    out.fds.append(fd)
    return (_rebuild_fd_storage, (len(out.fds) - 1, size))


def shared_copy(out: Outbox, storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """``storage``'s bytes in a new segment from the shared allocator in use (a worker's is a
    memfd: ``memfd``), kept by ``out`` until the message is sent.

    A batch the worker did not collate in shared memory (the sample itself, a collate_fn of the
    user's) lies in its private memory. torch's ``_share_fd_cpu_`` would copy it too, but into
    a segment it makes itself with shm_open, whose name stays in /dev/shm until unlinked: a kill
    in between leaves it there, the very thing a worker's memfds are for. (A function of its
    own: ``testing.ShmFailure`` makes it fail as a full /dev/shm makes torch's sharing fail.)
    """
    copy = compat.new_shared(storage.nbytes())
    copy.copy_(storage)
    out.copies.append(copy)
    return copy


# ---- a message's payload (worker side) ----


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

    extra = _forking_reducers
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
) -> tuple[bytes, int, list[int], Outbox]:
    """Pickle ``obj``; returns the payload, the length of its body (the rest is the slot
    table), the fds it refers to (owned by their storages) and how its storages travel.
    ``shm=False``: large storages not already in shared memory are copied into the payload."""
    buf = io.BytesIO()
    out = Outbox([], shm, policy)
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


# ---- decoding a message (main side) ----


def decode(
    payload: bytes | bytearray,
    body_len: int,
    fds: list[int],
    pool_update: Callable[[Any, list[int], set[int]], Lease | None],
) -> Any:
    """Main side: the message in ``payload`` (its first ``body_len`` bytes the body, the rest
    its slot table), rebuilt over ``fds`` (each closed here unless a storage keeps it).

    ``pool_update(news, fds, used)`` takes the message's news of the sender's pooled segments
    (see ``_pool_info``) and returns the lease of the segment the message lends, if any.

    Raises:
        FdLimitError: no fd was left to map a storage.
        Exception: whatever unpickling raises (the caller names the message ``Undecodable``).
    """
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
            warn_shm(sum(n for n, _ in fallback), ShmNote(*fallback[-1][1]))
        return msg
    _tls.fds, _tls.used, _tls.fallback, _tls.pool_update = fds, set(), [], pool_update
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
        _tls.slots = _tls.lease = _tls.pool_update = None
        for i, fd in enumerate(fds):
            if i not in _tls.used:
                try:
                    os.close(fd)
                except OSError:
                    pass
        _tls.fds = _tls.used = _tls.fallback = None
    if fallback:
        warn_shm(sum(n for n, _ in fallback), ShmNote(*fallback[-1][1]))
    return msg
