"""Process-level helpers for the fuzzers' teardown leak checks and the soak script.

The leak check itself is ``resumable_loader.testing.Resources`` / ``leaks_since`` (the one the
test suite runs after every test). multiprocessing's own long-lived helpers (the fork server,
the resource tracker) are not ours to clean up: ``start_multiprocessing_helpers()`` starts them
once, before any baseline is taken, and ``Resources`` leaves them out.
"""

from __future__ import annotations

import os

import psutil

_helpers_started = False


def start_multiprocessing_helpers() -> None:
    """Start the resource tracker and the fork server (once per process)."""
    global _helpers_started
    if _helpers_started:
        return
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()
    forkserver.ensure_running()
    _helpers_started = True


def rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def shm_entries() -> set[str]:
    """Every /dev/shm entry (not only torch's): the soak reports them all."""
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()
