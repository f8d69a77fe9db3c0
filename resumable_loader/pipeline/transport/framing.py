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
travels (the payload is ``reducers``': ``dumps`` makes it, ``decode`` rebuilds it).

A message that arrives whole but cannot be rebuilt here (unpickling it raises: a class the
main process cannot import, a rebuild that fails, no fd left to map it) is not a broken
channel: its frame is known, so the messages before and after it are read as usual, and it is
returned as ``Undecodable`` with its tag and the error -- the main process can then name the
task it was, instead of taking a healthy worker for a dead one (issue #31 item 3).

This module owns the frame, the socket's two ends (``send``, ``Receiver``) and the main
side's record of the sender's own pooled segments (``Receiver.pool_update``).
"""

from __future__ import annotations

import array
import os
import socket
import struct
import traceback
from typing import Any, NamedTuple

import torch

from ...core.errors import RemoteTraceback
from .policy import FdLimitError, ShmPolicy, fd_limit_text
from .pools import Lease, LoaderPool, SegmentMapping
from .reducers import decode, dumps

# 64-bit lengths: a message of any size torch's own pipe would carry (multiprocessing frames
# over 2 GiB with an 8-byte length too) can be framed -- a batch copied inline over 4 GiB (a
# non-tensor batch, or a large one that found /dev/shm full) included (issue #25).
_HEADER = struct.Struct("<QIQqq")
# The tag of a message that is not a task's result.
NO_TAG = (-1, -1)
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
        self._pool_segs: dict[int, SegmentMapping] = {}

    def fileno(self) -> int:
        return self.fd

    def pool_update(self, info: Any, fds: list[int], used: set[int]) -> Lease | None:
        """A message's news of the sender's pool (see ``reducers``' ``_pool_info``), read while
        the message is decoded: ``fds`` are its fds (one may be a new segment's: its index goes
        into ``used``). Returns the lease of the segment it lends, for its storages (None: it
        lends none)."""
        sid, new, retired, demand, granted = info
        if granted:
            pool = self.pool
            if pool is None:
                raise RuntimeError("a batch in a granted segment, and the receiver has no pool")
            if demand:
                pool.demand = demand
            if sid < 0:
                return None
            seg = pool.segments[sid]
            if not seg.mapped():
                raise RuntimeError(f"pooled segment {sid} came unsized")
            assert seg.mapping is not None
            seg.filled = True
            return Lease(seg.mapping)
        for old in retired:
            self._pool_segs.pop(old, None)  # unmapped once no batch in it is held
        if new is not None:
            index, size = new
            used.add(index)
            try:
                self._pool_segs[sid] = SegmentMapping(fds[index], size)
            finally:
                os.close(fds[index])
        return Lease(self._pool_segs[sid]) if sid >= 0 else None

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
            return decode(payload, self._body_len, fds, self.pool_update)
        except Exception as exc:
            blame = _blame(exc)
            return Undecodable(*self._tag, _without_frames(exc), blame)

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


# The whole package (three folders up: transport, pipeline, resumable_loader): a rebuild that
# fails in any of our modules -- a message class's own, say -- is ours to fix.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
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
    if code is decode.__code__:
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
