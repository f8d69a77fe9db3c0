"""The result channel from a worker to the main process: a Unix socketpair, framed by hand.

Why not torch's usual path (a pipe, with each tensor's shared-memory fd fetched afterwards by
connecting back to the sender's resource-sharer thread)? Because unpickling would then depend on
the sender being alive and responsive: a worker SIGSTOPped (or hung) after sending leaves the
main process blocked forever inside ``pickle.loads``. Here the fds travel *in-band*, attached to
the message with SCM_RIGHTS, so a received message needs nothing more from its sender; and the
main side reads without ever blocking (``Receiver.feed``), so a worker stopped halfway through a
send cannot stall it either.

Frame: header ``<II`` (payload length, number of fds) sent with the fds attached, then the
pickled payload. Storages of at most ``INLINE_MAX`` bytes are copied into the payload instead:
for small batches that is cheaper than passing and mapping an fd.
"""

from __future__ import annotations

import array
import io
import os
import socket
import struct
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

_HEADER = struct.Struct("<II")
# Linux refuses more than SCM_MAX_FD (253) fds in one message; storages beyond this many in
# one batch are copied into the payload instead.
FDS_PER_MSG = 250
# Copy storages up to this size into the message: one memcpy beats an fd round trip + mmap.
INLINE_MAX = 32 * 1024
_RECV_CHUNK = 1 << 20
_ANC_SPACE = socket.CMSG_SPACE(FDS_PER_MSG * array.array("i").itemsize)

_tls = threading.local()


def _rebuild_fd_storage(index: int, nbytes: int) -> torch.UntypedStorage:
    fd = _tls.fds[index]
    _tls.used.add(index)
    try:
        return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # type: ignore[attr-defined]
    finally:
        os.close(fd)


def _rebuild_bytes_storage(data: bytes) -> torch.UntypedStorage:
    return torch.UntypedStorage.from_buffer(data, dtype=torch.uint8)


def _rebuild_empty_storage() -> torch.UntypedStorage:
    return torch.UntypedStorage(0)


class _Pickler(ForkingPickler):
    """ForkingPickler (torch's reductions included) with in-band fds for CPU storages."""

    def __init__(self, file: Any, fds: list[int]) -> None:
        super().__init__(file, 5)
        self._fds = fds
        self.dispatch_table[torch.UntypedStorage] = self._reduce_storage

    def _reduce_storage(self, storage: torch.UntypedStorage) -> Any:
        if storage.device.type != "cpu":
            raise RuntimeError("cannot send a non-CPU storage from a DataLoader worker")
        nbytes = storage.nbytes()
        if nbytes == 0:
            return (_rebuild_empty_storage, ())
        if nbytes <= INLINE_MAX or len(self._fds) >= FDS_PER_MSG:
            view = torch.empty(0, dtype=torch.uint8).set_(storage)
            return (_rebuild_bytes_storage, (view.numpy().tobytes(),))
        if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
            from torch.multiprocessing.reductions import reduce_storage

            return reduce_storage(storage)  # file_system: needs no live sender
        fd, size = storage._share_fd_cpu_()
        self._fds.append(fd)
        return (_rebuild_fd_storage, (len(self._fds) - 1, size))


def dumps(obj: Any) -> tuple[bytes, list[int]]:
    """Pickle ``obj``; returns the payload and the fds it refers to (owned by their storages)."""
    buf = io.BytesIO()
    fds: list[int] = []
    _Pickler(buf, fds).dump(obj)
    return buf.getvalue(), fds


def send(sock: socket.socket, obj: Any) -> None:
    """Worker side: send one message (blocking). Pickling errors raise before any byte is sent."""
    payload, fds = dumps(obj)
    header = _HEADER.pack(len(payload), len(fds))
    if fds:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        sent = sock.sendmsg([header, payload], anc)
    else:
        sent = sock.send(header + payload) if len(payload) < 65536 else 0
    data = memoryview(header + payload) if sent < len(header) + len(payload) else None
    if data is not None:
        sock.sendall(data[sent:])


class ChannelClosed(Exception):
    """The peer closed its end (it exited or died)."""


class Receiver:
    """Main side: assembles messages from a non-blocking socket; never blocks.

    ``feed()`` reads what is available and returns the complete messages, each unpickled.
    A large payload is received straight into a buffer of its final size (no copies in the
    main process, which is the pipeline's serial stage).
    Invariant: ``_fds`` holds the fds received and not yet handed to a message, in order;
    they are closed if the channel closes first.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()  # kept after close(): the supervisor unregisters by number
        self._buf = bytearray()  # bytes read but not yet part of a message body
        self._body: bytearray | None = None  # the large payload being filled in place
        self._got = 0  # bytes of _body filled
        self._need_fds = 0
        self._payload_len = -1
        self._fds: list[int] = []
        self.eof = False  # the sender has closed its end (exited or was killed)
        self.received = 0  # bytes read so far: progress, even before a message is whole

    def fileno(self) -> int:
        return self.fd

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
                data, anc, _flags, _addr = self.sock.recvmsg(_RECV_CHUNK, _ANC_SPACE)
                n = len(data)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise ChannelClosed(str(exc)) from exc
        self._take_fds(anc)
        if n == 0:
            raise ChannelClosed("end of stream")
        self.received += n
        if data is None:
            self._got += n
        else:
            self._buf += data
        return True

    def feed(self) -> list[Any]:
        """Read everything available; return the messages completed (may be empty).

        Once the sender is gone, ``eof`` is set: the messages it completed before going are
        still returned (a worker's last words, such as its worker_init_fn error, arrive just
        before its exit), and a partial message is discarded.
        """
        out: list[Any] = []
        while True:
            if self._payload_len < 0 and len(self._buf) >= _HEADER.size:
                self._payload_len, self._need_fds = _HEADER.unpack_from(self._buf)
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
                out.append(self._decode(payload, fds))
                continue
            if self.eof:
                return out
            try:
                more = self._recv()
            except ChannelClosed:
                self.eof = True
                return out
            if not more:
                return out

    def _decode(self, payload: bytes | bytearray, fds: list[int]) -> Any:
        _tls.fds, _tls.used = fds, set()
        try:
            return ForkingPickler.loads(payload)
        finally:
            for i, fd in enumerate(fds):
                if i not in _tls.used:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            _tls.fds = _tls.used = None

    def close(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
        self._buf.clear()
        self.sock.close()
