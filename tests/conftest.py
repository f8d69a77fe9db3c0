"""Shared fixtures: every test is checked for leaked child processes, threads, fds and shm."""

from __future__ import annotations

import pytest

from resumable_loader.testing import Resources, leaks_since


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run the long soak/fuzz profiles")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests marked heavy_imports load big modules into the test process (datasets with pyarrow
    # and pandas, transformers' Trainer, torch.distributed.checkpoint with sympy) and run last:
    # fork() copies the page tables of the process it forks, so every worker the later tests
    # start would cost more with them loaded (a few ms per worker per 100 MB, thousands of
    # workers in a run). The sort is stable: the rest keep their order.
    items.sort(key=lambda item: item.get_closest_marker("heavy_imports") is not None)
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow profile: pass --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _multiprocessing_helpers():
    """Start multiprocessing's own helper processes once, before any baseline is taken.

    The first spawn starts the resource tracker and the first forkserver start starts the fork
    server; each keeps a pipe fd in this process for its whole life. They are not ours to clean
    up, and starting them here keeps them out of every test's leak check.
    """
    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()
    # Workers forked from a server that has torch imported start in milliseconds, not seconds
    # (what a user gets from multiprocessing.set_forkserver_preload too).
    multiprocessing.set_forkserver_preload(["torch", "resumable_loader"])
    forkserver.ensure_running()
    _open_the_accelerator()
    yield


def _open_the_accelerator() -> None:
    """With a GPU, the first pinned allocation opens the driver's device files, an event fd and
    pipes that the CUDA runtime keeps for the life of the process (in the main thread, and more
    the first time a thread sets its device, as the pin thread does). Open them once here, as
    a training job's first step does, so that the first pinning test is not blamed for them."""
    import threading

    import torch

    if not torch.cuda.is_available():
        return
    torch.empty(1).pin_memory()

    def pin_thread() -> None:
        torch.cuda.set_device(torch.cuda.current_device())
        torch.empty(1).pin_memory()

    t = threading.Thread(target=pin_thread)
    t.start()
    t.join()


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest):
    """Fail the test if it left a child process, one of our threads, an fd or a shm entry."""
    if "allow_leaks" in request.keywords:
        yield
        return
    before = Resources.now()
    yield
    problems = leaks_since(before)
    if problems:
        pytest.fail("test leaked " + "; ".join(problems), pytrace=False)
