"""The suite's own leak check (``testing.Resources`` / ``leaks_since``): whose /dev/shm names it
counts.

/dev/shm is the whole machine's, and other test runs and jobs share it: their workers make torch
segments too, and die (killed, or ended while their main process still holds a batch, as under
the file_system strategy) with the names still there. Such a name, appearing while one of our
tests runs, is not our leak; a name left by a process of our own tree is. The processes here are
made with ``os.fork`` and synchronised through pipes: no sleeps.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator

import pytest

from resumable_loader.testing import Resources, leaks_since

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="Linux /dev/shm")


def _name(pid: int) -> str:
    return f"torch_{pid}_12345_2"  # the shape of torch's names: torch_<maker's pid>_<rand>_<n>


@contextlib.contextmanager
def _removed_at_end(name: str) -> Iterator[None]:
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")


def _make_name_and_wait(go: int, told: int, leave: int) -> None:
    """In a forked process: on a byte from ``go``, make this process's name in /dev/shm, say
    its pid on ``told``, then end (leaving the name) on a byte from ``leave``."""
    os.read(go, 1)
    fd = os.open(f"/dev/shm/{_name(os.getpid())}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    os.write(told, struct.pack("i", os.getpid()))
    os.read(leave, 1)


def test_a_name_left_by_a_dead_process_of_another_job_is_not_counted_as_ours() -> None:
    go_r, go_w = os.pipe()
    told_r, told_w = os.pipe()
    leave_r, leave_w = os.pipe()
    before = Resources.now()  # (the pipes are the test's: open before it)
    middle = os.fork()
    if middle == 0:  # pragma: no cover (forked processes)
        try:
            if os.fork() == 0:
                # Once the middle process is gone, this one is no descendant of ours: another
                # job's process, as far as this process can tell. It starts the maker and
                # reaps it, as another job's main process reaps its dead worker.
                maker = os.fork()
                if maker == 0:
                    _make_name_and_wait(go_r, told_w, leave_r)
                    os._exit(0)
                os.waitpid(maker, 0)
                os.write(told_w, b"r")
        finally:
            os._exit(0)
    try:
        os.waitpid(middle, 0)
        os.write(go_w, b"x")
        (other,) = struct.unpack("i", os.read(told_r, 4))
        with _removed_at_end(_name(other)):
            # Its name appeared while a check was running (the check's first look at it happens
            # while its maker is alive) ...
            Resources.now()
            # ... and the maker is gone (ended and reaped) by the end of the test, its name left
            # behind.
            os.write(leave_w, b"x")
            assert os.read(told_r, 1) == b"r"
            assert os.path.exists(f"/dev/shm/{_name(other)}")
            assert leaks_since(before, settle_s=0) == []
    finally:
        for fd in (go_r, go_w, told_r, told_w, leave_r, leave_w):
            os.close(fd)


def test_a_name_left_by_a_dead_process_of_ours_is_a_leak() -> None:
    """The check still finds what it is for: a killed worker of ours leaving its name."""
    go_r, go_w = os.pipe()
    told_r, told_w = os.pipe()
    leave_r, leave_w = os.pipe()
    before = Resources.now()  # (the pipes are the test's: open before it)
    child = os.fork()
    if child == 0:  # pragma: no cover (a forked process)
        try:
            _make_name_and_wait(go_r, told_w, leave_r)
        finally:
            os._exit(0)
    try:
        os.write(go_w, b"x")
        (pid,) = struct.unpack("i", os.read(told_r, 4))
        with _removed_at_end(_name(pid)):
            Resources.now()
            os.write(leave_w, b"x")
            os.waitpid(child, 0)
            assert leaks_since(before, settle_s=0) == [f"/dev/shm entries ['{_name(pid)}']"]
    finally:
        for fd in (go_r, go_w, told_r, told_w, leave_r, leave_w):
            os.close(fd)
