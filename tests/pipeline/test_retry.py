"""Retries of transient errors (``RetryPolicy``; ``_worker.make_retrier``) in streams: a retry
keeps what was already read, restores the RNGs, and never turns an error into a silent end.

The datasets here are module-level (picklable); the tests use the fork start method.
"""

from __future__ import annotations

import os
import random
import tempfile
import warnings

import numpy as np
import pytest
import torch
from _datasets import collect_torch_reference_garbage
from torch.utils.data import IterableDataset, get_worker_info

from resumable_loader import DataLoader, RetryPolicy


def _first_to_fire(flag: str) -> bool:
    """Create ``flag`` atomically: True for the one caller that made it. Both workers read the
    whole (unsharded) stream, so a check-then-create let both fire at once (1 run in 6)."""
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class CursorStream(IterableDataset):
    """Values 0..n-1; the iterator is a class (so a RetryPolicy applies to its ``next()``) and
    the first fetch of ``flaky`` raises OSError once, leaving the cursor where it was."""

    def __init__(self, n: int, flaky: int, flag_dir: str) -> None:
        self.n = n
        self.flaky = flaky
        self.flag = os.path.join(flag_dir, "fired")

    def __iter__(self) -> _Cursor:
        return _Cursor(self)


class _Cursor:
    def __init__(self, ds: CursorStream) -> None:
        self.ds = ds
        self.pos = 0

    def __iter__(self) -> _Cursor:
        return self

    def __next__(self) -> int:
        if self.pos >= self.ds.n:
            raise StopIteration
        if self.pos == self.ds.flaky and _first_to_fire(self.ds.flag):
            raise OSError("transient")
        self.pos += 1
        return self.pos - 1


# A regression found by the fuzzers in fuzz/.
@pytest.mark.parametrize("num_workers", [0, 1])
def test_stream_retry_keeps_items_pulled_before_error(num_workers: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        loader = DataLoader(
            CursorStream(6, flaky=3, flag_dir=d),
            batch_size=2,
            num_workers=num_workers,
            multiprocessing_context="fork" if num_workers else None,
            retry=RetryPolicy(attempts=3, backoff_s=0.0),
        )
        with loader:
            got = [b.tolist() for b in loader]
    # Item 2 was pulled by the attempt that failed on item 3: it is lost, [[0, 1], [3, 4], [5]].
    assert got == [[0, 1], [2, 3], [4, 5]]


# A regression found by the fuzzers in fuzz/.
@pytest.mark.parametrize("num_workers", [0, 1])
def test_transient_error_while_fast_forwarding_is_retried(num_workers: int) -> None:
    method = "fork" if num_workers else None
    with tempfile.TemporaryDirectory() as d:
        first = DataLoader(
            CursorStream(3, flaky=-1, flag_dir=d),
            batch_size=None,
            num_workers=num_workers,
            multiprocessing_context=method,
        )
        with first:
            it = iter(first)
            assert next(it) == 0
            sd = first.state_dict()
        # Re-reading item 0 to skip it fails once with a transient OSError.
        resumed = DataLoader(
            CursorStream(3, flaky=0, flag_dir=d),
            batch_size=None,
            num_workers=num_workers,
            multiprocessing_context=method,
            retry=RetryPolicy(attempts=3, backoff_s=0.0),
        )
        with resumed, warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the fast-forward notice
            resumed.load_state_dict(sd)
            rest = list(resumed)
    assert rest == [1, 2]  # got [0, 1, 2]


class _DrawingCursor(_Cursor):
    def __next__(self) -> tuple[int, int]:
        v = super().__next__()
        return v, random.randint(0, 10**9)  # a random augmentation, seeded per fetch


class DrawingCursorStream(CursorStream):
    """``CursorStream`` whose items also carry a draw from python's global RNG."""

    def __iter__(self) -> _DrawingCursor:
        return _DrawingCursor(self)


# A regression found by the fuzzers in fuzz/.
@pytest.mark.parametrize("num_workers", [0, 1])
def test_stream_retry_keeps_the_random_draws_of_an_uninterrupted_run(num_workers: int) -> None:
    def run(flaky: int, flag_dir: str) -> list:
        loader = DataLoader(
            DrawingCursorStream(4, flaky=flaky, flag_dir=flag_dir),
            batch_size=2,
            collate_fn=list,
            num_workers=num_workers,
            multiprocessing_context="fork" if num_workers else None,
            generator=torch.Generator().manual_seed(5),
            retry=RetryPolicy(attempts=3, backoff_s=0.0),
        )
        with loader:
            return list(loader)

    with tempfile.TemporaryDirectory() as d:
        # Item 1 fails once: the retry starts with item 0 kept, and pulls item 1 again.
        assert run(flaky=1, flag_dir=d) == run(flaky=-1, flag_dir=d)


class _DrawThenFailCursor(_Cursor):
    """Draws from the global RNGs *before* it may raise: a retry sees the RNGs moved on."""

    def __next__(self) -> tuple[int, int, float]:
        a = random.randint(0, 10**9)
        b = float(torch.rand(()))
        v = super().__next__()
        return v, a, b


class DrawThenFailStream(CursorStream):
    def __iter__(self) -> _DrawThenFailCursor:
        return _DrawThenFailCursor(self)


class DrawThenFailCollate:
    """A collate that draws, then raises OSError once on the batch holding ``flaky``."""

    def __init__(self, flaky: int, flag_dir: str) -> None:
        self.flaky = flaky
        self.flag = os.path.join(flag_dir, "collate-fired")

    def __call__(self, items: list) -> list:
        noise = int(np.random.randint(0, 10**6))
        if any(item[0] == self.flaky for item in items) and _first_to_fire(self.flag):
            raise OSError("transient, in collate")
        return [noise, *items]


# A regression found by the fuzzers in fuzz/.
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("where", ["next", "collate"])
def test_stream_retry_is_exact_even_when_the_failing_step_drew_random_numbers(
    num_workers: int, where: str
) -> None:
    # A retry restores the RNGs as they were before the step that raised, and keeps the items
    # already read (also when the collate raised): the stream equals an uninterrupted run.
    def run(flaky: int, flag_dir: str, retry: bool = True) -> list:
        next_flaky = flaky if where == "next" else -1
        collate_flaky = flaky if where == "collate" else -1
        loader = DataLoader(
            DrawThenFailStream(12, flaky=next_flaky, flag_dir=flag_dir),
            batch_size=3,
            collate_fn=DrawThenFailCollate(collate_flaky, flag_dir),
            num_workers=num_workers,
            multiprocessing_context="fork" if num_workers else None,
            generator=torch.Generator().manual_seed(11),
            retry=RetryPolicy(attempts=3, backoff_s=0.0) if retry else None,
        )
        with loader:
            got = list(loader)
            assert loader.statistics().retries == (flaky >= 0)
            return got

    with tempfile.TemporaryDirectory() as d:
        # The reference has no RetryPolicy at all: a policy alone must not change a value.
        reference = run(flaky=-1, flag_dir=d, retry=False)
        assert run(flaky=-1, flag_dir=d) == reference
        assert run(flaky=4, flag_dir=d) == reference


class GeneratorStream(IterableDataset):
    """Values 0..5 from a generator that raises OSError at 3 (every time)."""

    def __iter__(self):  # a generator: once it raised, it is finished
        info = get_worker_info()
        if info is not None and info.id > 0:
            return
        for i in range(6):
            if i == 3:
                raise OSError("transient, but a generator cannot be resumed")
            yield i


def _drain_with_errors(loader) -> list:
    out: list = []
    it = iter(loader)
    while True:
        try:
            out.append(next(it).tolist())
        except StopIteration:
            return out
        except OSError as exc:
            assert "a generator cannot be resumed" in str(exc)
            out.append("OSError")


# A regression found by the fuzzers in fuzz/.
@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_generator_stream_is_not_retried_into_a_silent_end(num_workers: int) -> None:
    # A generator that raised is finished: retrying next() on it used to end the stream
    # without a word. Now the error reaches the caller and the stream then ends, as in torch.
    kw: dict = {"batch_size": 2, "num_workers": num_workers}
    if num_workers:
        kw["multiprocessing_context"] = "fork"
    expected = _drain_with_errors(torch.utils.data.DataLoader(GeneratorStream(), **kw))
    collect_torch_reference_garbage()
    ours = DataLoader(GeneratorStream(), retry=RetryPolicy(attempts=3, backoff_s=0.0), **kw)
    with ours:
        got = _drain_with_errors(ours)
    assert got == expected == [[0, 1], "OSError"]
