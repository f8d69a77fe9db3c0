"""Shared fixtures: every test is checked for leaked child processes, threads, fds and shm."""

from __future__ import annotations

import gc
import os
import threading
import time

import psutil
import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run the long soak/fuzz profiles")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow profile: pass --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# multiprocessing's own long-lived helpers are not ours to clean up.
_MP_HELPERS = ("forkserver", "resource_tracker", "semaphore_tracker")


def _our_children() -> set[int]:
    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            if child.status() == psutil.STATUS_ZOMBIE:
                out.add(child.pid)
                continue
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        except psutil.AccessDenied:
            cmd = ""
        if any(h in cmd for h in _MP_HELPERS):
            continue
        out.add(child.pid)
    return out


def _our_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("resumable_loader")}


def _fds() -> set[int]:
    return {int(x) for x in os.listdir("/proc/self/fd")}


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def _settle(check, deadline_s: float = 10.0):
    """Poll until ``check()`` returns a falsy leak set or the deadline passes.

    Teardown of a killed worker is asynchronous in the kernel (a zombie is reaped a moment
    after SIGKILL), so this waits on the observable condition rather than sleeping blindly.
    """
    end = time.monotonic() + deadline_s
    leak = check()
    while leak and time.monotonic() < end:
        gc.collect()
        time.sleep(0.02)
        leak = check()
    return leak


@pytest.fixture(scope="session", autouse=True)
def _multiprocessing_helpers():
    """Start multiprocessing's own helper processes once, before any baseline is taken.

    The first spawn starts the resource tracker and the first forkserver start starts the fork
    server; each keeps a pipe fd in this process for its whole life. They are not ours to clean
    up, and starting them here keeps them out of every test's leak check.
    """
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()
    forkserver.ensure_running()
    yield


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest):
    """Fail the test if it left a child process, one of our threads, an fd or a shm entry."""
    if "allow_leaks" in request.keywords:
        yield
        return
    children0, threads0, fds0, shm0 = _our_children(), _our_threads(), _fds(), _shm()
    yield
    leaked_children = _settle(lambda: _our_children() - children0)
    leaked_threads = _settle(lambda: _our_threads() - threads0)
    leaked_fds = _settle(lambda: _fds() - fds0, 5.0)
    leaked_shm = _settle(lambda: {s for s in _shm() - shm0 if "torch" in s or "psm_" in s}, 5.0)
    problems = []
    if leaked_children:
        problems.append(f"child processes {sorted(leaked_children)}")
    if leaked_threads:
        problems.append(f"threads {sorted(leaked_threads)}")
    if leaked_fds:
        details = {}
        for fd in sorted(leaked_fds):
            try:
                details[fd] = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                details[fd] = "?"
        problems.append(f"file descriptors {details}")
    if leaked_shm:
        problems.append(f"/dev/shm entries {sorted(leaked_shm)}")
    if problems:
        pytest.fail("test leaked " + "; ".join(problems), pytrace=False)
