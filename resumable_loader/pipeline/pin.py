"""Stage 4 of the pipeline (optional): the pin-memory thread.

The main process hands each received batch to this thread, which copies its tensors into
page-locked memory and hands it back; the main process waits on the thread's wake-up pipe
together with the workers' pipes, so it never blocks on the thread alone.

While pinning, the thread holds ``fork_lock``; the supervisor takes the same lock around a
``fork`` respawn, so a replacement worker is never forked while this thread is inside the
allocator or a queue with its locks held (fork copies those locks, never their owner).
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data._utils.pin_memory import pin_memory as _torch_pin_memory

from .protocol import Delivery, Status, WorkerError

# How long close() waits for the thread to finish the batch in hand. Pinning one batch takes
# milliseconds; a thread still busy after this is abandoned (it is a daemon).
JOIN_TIMEOUT_S = 5.0


def pin_memory(data: Any) -> Any:
    """Pin every tensor in ``data`` exactly as torch's loader does: torch's own function (it
    calls an object's ``pin_memory()`` first, keeps container types, copies mutable ones)."""
    return _torch_pin_memory(data)


def current_device_index() -> int | None:
    """The accelerator device the pin thread should use (the caller's current one)."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "current_device_index"):
        return int(acc.current_device_index()) if acc.is_available() else None
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _set_device_index(index: int) -> None:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "set_device_index"):
        acc.set_device_index(index)
    else:
        torch.cuda.set_device(index)


class PinStage:
    """A daemon thread pinning (tid, item) pairs; results come back through ``drain()``."""

    def __init__(
        self,
        fork_lock: threading.Lock,
        pin_fn: Callable[[Any], Any] = pin_memory,
        device_index: int | None = None,
    ):
        self._in: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._out: collections.deque[tuple[int, Any]] = collections.deque()
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._fork_lock = fork_lock
        self._pin = pin_fn
        self._device_index = device_index
        # Submitted and not drained yet: task id -> the stream worker it came from (None for
        # map-style). A checkpoint needs the lowest of them: it may be the next batch out.
        self._held: dict[int, int | None] = {}
        self._thread = threading.Thread(target=self._run, name="resumable_loader-pin", daemon=True)
        self._thread.start()

    @property
    def wake_fd(self) -> int:
        return self._r

    @property
    def in_flight(self) -> int:
        return len(self._held)

    def held(self) -> dict[int, int | None]:
        """The items in the pin thread: task id -> the stream worker it came from."""
        return self._held

    def submit(self, tid: int, item: Any) -> None:
        extra = item[2]
        self._held[tid] = extra[0] if extra is not None else None
        self._in.put((tid, item))

    def drain(self) -> list[tuple[int, Any]]:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while self._out:
            tid, item = self._out.popleft()
            self._held.pop(tid, None)
            out.append((tid, item))
        return out

    def _run(self) -> None:
        # As torch's pin thread: one intra-op thread for the copies (the setting is per
        # thread), on the device that was current where the iterator was made.
        torch.set_num_threads(1)
        if self._device_index is not None:
            _set_device_index(self._device_index)
        while True:
            job = self._in.get()
            if job is None:
                return
            tid, item = job
            status, payload, stream = item
            if status == Status.OK:
                try:
                    with self._fork_lock:
                        payload = self._pin(payload)
                except Exception:
                    status, payload = Status.ERROR, WorkerError("in the pin-memory thread")
            self._out.append((tid, Delivery(status, payload, stream)))
            del job, item, payload
            try:
                os.write(self._w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full, so a wake-up is already pending

    def close(self) -> None:
        if self._thread.is_alive():
            self._in.put(None)
            self._thread.join(JOIN_TIMEOUT_S)
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._out.clear()
