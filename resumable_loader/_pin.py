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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ._worker import ERROR, WorkerError

# How long close() waits for the thread to finish the batch in hand. Pinning one batch takes
# milliseconds; a thread still busy after this is abandoned (it is a daemon).
JOIN_TIMEOUT_S = 5.0


def pin_memory(data: Any) -> Any:
    """Pin every tensor in ``data`` (nested mappings/sequences/namedtuples, objects with a
    ``pin_memory()`` method), as torch's loader does."""
    if isinstance(data, torch.Tensor):
        return data.pin_memory()
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, Mapping):
        try:
            return type(data)({k: pin_memory(v) for k, v in data.items()})  # type: ignore[call-arg]
        except TypeError:
            return {k: pin_memory(v) for k, v in data.items()}
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(pin_memory(x) for x in data))
    if isinstance(data, tuple):
        return tuple(pin_memory(x) for x in data)
    if isinstance(data, Sequence):
        try:
            return type(data)([pin_memory(x) for x in data])  # type: ignore[call-arg]
        except TypeError:
            return [pin_memory(x) for x in data]
    if hasattr(data, "pin_memory"):
        return data.pin_memory()
    return data


class PinStage:
    """A daemon thread pinning (tid, item) pairs; results come back through ``drain()``."""

    def __init__(self, fork_lock: threading.Lock, pin_fn: Callable[[Any], Any] = pin_memory):
        self._in: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._out: collections.deque[tuple[int, Any]] = collections.deque()
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._fork_lock = fork_lock
        self._pin = pin_fn
        self.in_flight = 0
        self._thread = threading.Thread(target=self._run, name="resumable_loader-pin", daemon=True)
        self._thread.start()

    @property
    def wake_fd(self) -> int:
        return self._r

    def submit(self, tid: int, item: Any) -> None:
        self.in_flight += 1
        self._in.put((tid, item))

    def drain(self) -> list[tuple[int, Any]]:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while self._out:
            out.append(self._out.popleft())
        self.in_flight -= len(out)
        return out

    def _run(self) -> None:
        while True:
            job = self._in.get()
            if job is None:
                return
            tid, item = job
            status, payload, extra = item
            if status == 0:  # OK
                try:
                    with self._fork_lock:
                        payload = self._pin(payload)
                except Exception:
                    status, payload = ERROR, WorkerError("in the pin-memory thread")
            self._out.append((tid, (status, payload, extra)))
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
