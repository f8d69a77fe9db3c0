"""The task pipe from the main process to a worker: multiprocessing's frames, written and read
with as few system calls as the small, frequent messages allow (issue #26).

    main ──(Epoch | TaskMsg | Stop)──► task pipe ──► worker

The frame is ``multiprocessing.connection.Connection``'s: a 4-byte big-endian signed length
(-1, then an 8-byte length, for a payload over 2 GiB) and the pickled message. The rare messages
(``Epoch``, ``Stop``) still go through ``Connection.send``. A ``TaskMsg`` -- one per batch, the
hot path of a small batch -- is written by ``send_task`` as a plain tuple, pickled by plain
``pickle`` (``ForkingPickler`` copies its reducer table for every message: twice the cost of the
pickling itself) in one ``write``; the worker's ``TaskReader`` turns a plain tuple back into a
``TaskMsg``. Its payload (the sample indices, or a stream's fetch number) is plain data.

The worker reads with ``TaskReader``: one ``read`` takes every frame waiting (where
``Connection.recv`` reads the header and the body apart, two calls per message), and a read
that came back short says the pipe was empty then, so the worker need not ask the pipe again
before it starts the task it has.
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any

from ..protocol import TaskMsg

_LEN = struct.Struct("!i")
_LEN64 = struct.Struct("!Q")
# One read takes up to this much: many small frames, or the head of a large one.
READ_CHUNK = 64 * 1024


def send_task(fd: int, msg: TaskMsg) -> None:
    """Main side: write one ``TaskMsg`` to the task pipe's fd (blocking, whole).

    Raises:
        OSError: the pipe is broken (BrokenPipeError: the worker is gone) or closed.
    """
    body = pickle.dumps(tuple(msg), pickle.HIGHEST_PROTOCOL)
    n = len(body)
    frame = _LEN.pack(n) + body if n < 0x7FFFFFFF else _LEN.pack(-1) + _LEN64.pack(n) + body
    sent = os.write(fd, frame)
    while sent < len(frame):  # (a blocking pipe writes it all, save for a signal mid-write)
        sent += os.write(fd, memoryview(frame)[sent:])


class TaskReader:
    """Worker side: the messages of a task pipe, from as few reads as possible.

    Invariant: ``_buf[_pos:]`` holds the bytes read and not yet returned as messages: whole
    frames, then at most the start of one.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf: bytes | bytearray = b""
        self._pos = 0
        # The last read returned less than it asked for: the pipe held nothing more then.
        self.drained = False

    def _frame(self) -> memoryview | None:
        """The next whole frame's body from the buffer, or None if it is not all here."""
        buf, pos = self._buf, self._pos
        have = len(buf) - pos
        if have < 4:
            return None
        (n,) = _LEN.unpack_from(buf, pos)
        head = 4
        if n == -1:
            if have < 12:
                return None
            (n,) = _LEN64.unpack_from(buf, pos + 4)
            head = 12
        if have < head + n:
            return None
        self._pos = pos + head + n
        return memoryview(buf)[pos + head : pos + head + n]

    def pending(self) -> bool:
        """Whether a whole message is already buffered (no read needed)."""
        pos = self._pos
        if self._frame() is None:
            return False
        self._pos = pos
        return True

    def _read(self) -> None:
        """Blocking reads until more is buffered: one for small frames, a frame's worth for a
        large one (read into its final buffer). Raises EOFError when the main process closed
        its end."""
        rest = self._buf[self._pos :]
        need = 0  # the length of the frame begun in ``rest``, once its header is here
        if len(rest) >= 4:
            (n,) = _LEN.unpack_from(rest, 0)
            if n != -1:
                need = 4 + n
            elif len(rest) >= 12:
                need = 12 + _LEN64.unpack_from(rest, 4)[0]
        if need > READ_CHUNK:
            # A large message (an Epoch with a big stream state): its bytes straight into one
            # buffer, not concatenated read after read.
            buf = bytearray(need)
            got = len(rest)
            buf[:got] = rest
            with memoryview(buf) as view:
                while got < need:
                    k = os.readv(self.fd, [view[got:]])
                    if not k:
                        raise EOFError("the task pipe was closed")
                    got += k
            self._buf, self._pos, self.drained = buf, 0, False
            return
        data = os.read(self.fd, READ_CHUNK)
        if not data:
            raise EOFError("the task pipe was closed")
        self.drained = len(data) < READ_CHUNK
        self._buf = rest + data if rest else data
        self._pos = 0

    def recv(self) -> Any:
        """The next message (blocking until it is whole): a ``TaskMsg``, or what
        ``Connection.send`` sent."""
        while True:
            body = self._frame()
            if body is not None:
                break
            self._read()
        with body:
            obj = pickle.loads(body)
        if type(obj) is tuple:
            return TaskMsg(*obj)
        return obj
