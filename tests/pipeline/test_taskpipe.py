"""The task pipe (``_taskpipe``): TaskMsg frames written by ``send_task`` and the rare messages
written by ``Connection.send``, read back by the worker's ``TaskReader`` -- whole, in order, and
with one read for every frame already waiting."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from resumable_loader.pipeline.protocol import Epoch, Stop, StreamResume, TaskMsg
from resumable_loader.pipeline.transport import taskpipe as _taskpipe
from resumable_loader.pipeline.transport.taskpipe import TaskReader, send_task


@pytest.fixture
def pipe():
    r, w = multiprocessing.Pipe(duplex=False)
    yield r, w
    r.close()
    w.close()


def _counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real_read = os.read

    def read(fd: int, n: int) -> bytes:
        calls.append(fd)
        return real_read(fd, n)

    monkeypatch.setattr(_taskpipe.os, "read", read)
    return calls


def test_messages_arrive_whole_and_in_order_from_both_writers(pipe, monkeypatch) -> None:
    r, w = pipe
    reads = _counting_reads(monkeypatch)
    epoch = Epoch(3, 1, 1234, None, None)
    w.send(epoch)  # the rare messages keep multiprocessing's own send
    for tid in range(5):
        send_task(w.fileno(), TaskMsg(3, tid, [tid, tid + 10]))
    w.send(Stop())
    reader = TaskReader(r.fileno())
    got = [reader.recv() for _ in range(7)]
    assert got[0] == epoch and type(got[0]) is Epoch
    assert got[1:6] == [TaskMsg(3, t, [t, t + 10]) for t in range(5)]
    assert all(type(m) is TaskMsg for m in got[1:6])
    assert type(got[6]) is Stop
    # Everything was waiting: one read took all seven frames (Connection.recv reads the
    # header and the body of each apart: 14 reads).
    assert len(reads) == 1
    assert reader.drained and not reader.pending()


def test_a_frame_split_across_reads_is_completed(pipe) -> None:
    r, w = pipe
    frame_writer = os.fdopen(os.dup(w.fileno()), "wb", buffering=0)
    try:
        msg = TaskMsg(1, 7, list(range(20)))
        send_task(w.fileno(), msg)
        data = os.read(r.fileno(), 1 << 16)  # take the frame out, to write it back in pieces
        reader = TaskReader(r.fileno())
        frame_writer.write(data[:3])  # not even the whole length
        done: list[object] = []
        t = threading.Thread(target=lambda: done.append(reader.recv()))
        t.start()
        frame_writer.write(data[3:10])
        frame_writer.write(data[10:])
        t.join(10)
        assert done == [msg]
    finally:
        frame_writer.close()


def test_a_message_larger_than_a_read_arrives_whole(pipe) -> None:
    r, w = pipe
    # An Epoch carrying a large stream state (over the 64 KiB pipe and the read size).
    state = {"buffer": bytes(range(256)) * 8192}  # 2 MiB
    epoch = Epoch(2, 0, 99, StreamResume(state, False, 3, 5), None)

    def write() -> None:
        w.send(epoch)
        send_task(w.fileno(), TaskMsg(2, 0, 5))

    writer = threading.Thread(target=write)
    writer.start()
    reader = TaskReader(r.fileno())
    assert reader.recv() == epoch
    assert reader.recv() == TaskMsg(2, 0, 5)
    writer.join(10)


def test_a_closed_pipe_is_eof(pipe) -> None:
    r, w = pipe
    send_task(w.fileno(), TaskMsg(0, 0, [0]))
    w.close()
    reader = TaskReader(r.fileno())
    assert reader.recv() == TaskMsg(0, 0, [0])  # what was sent before the close still comes
    with pytest.raises(EOFError):
        reader.recv()


def test_send_task_to_a_gone_reader_raises_broken_pipe(pipe) -> None:
    r, w = pipe
    r.close()
    with pytest.raises(BrokenPipeError):
        send_task(w.fileno(), TaskMsg(0, 0, [0]))
