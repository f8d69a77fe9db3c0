"""The iterator's lifecycle (``_lifecycle``): the cursor, the final states, and teardown by
reference counting alone.

The broad table of loop shapes (break, islice, exceptions, Ctrl-C) is in test_loop_shapes.py;
this file pins the mechanism: what each end state says and raises, and that after any error
dropping the iterator and the loader ends every worker without the garbage collector.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest
import torch
from _datasets import RangeData
from torch.utils.data import Dataset

from resumable_loader import DataLoader, LoaderClosedError, WorkerCrashError
from resumable_loader.loader.lifecycle import Cursor, Life
from resumable_loader.testing import Fault, FaultyDataset, canonical, reference_stream


class Augmented(Dataset):
    """Item i: its index and a random augmentation drawn from torch's global RNG."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, int(torch.randint(0, 10**6, ()))])


def _make(num_workers: int, **kw: Any) -> Callable[[], DataLoader[Any]]:
    def make() -> DataLoader[Any]:
        return DataLoader(
            Augmented(),
            batch_size=2,
            shuffle=True,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(7),
            **kw,
        )

    return make


# ---- the cursor -------------------------------------------------------------------------------
def test_cursor_reads_live_until_frozen_then_keeps_a_copy() -> None:
    box = {"consumed": 1}
    cursor = Cursor(3, lambda: dict(box))
    assert cursor.position() == {"consumed": 1}
    box["consumed"] = 2
    assert cursor.position() == {"consumed": 2}
    cursor.freeze()
    box["consumed"] = 99
    assert cursor.frozen
    got = cursor.position()
    assert got == {"consumed": 2}
    got["consumed"] = -1  # a caller's edit must not reach the frozen position
    assert cursor.position() == {"consumed": 2}
    cursor.freeze()  # idempotent
    cursor.bind(lambda: {"consumed": 5})  # too late: frozen stays frozen
    assert cursor.position() == {"consumed": 2}


def test_cursor_stays_live_when_reading_fails_at_freeze() -> None:
    calls = []

    def read() -> dict[str, Any]:
        calls.append(1)
        raise RuntimeError("sampler.state_dict() failed")

    cursor = Cursor(0, read)
    with pytest.raises(RuntimeError, match="state_dict"):
        cursor.freeze()
    assert not cursor.frozen  # state_dict() raises the same error rather than inventing one
    with pytest.raises(RuntimeError):
        cursor.position()
    assert len(calls) == 2


# ---- end states -------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_end_state_reports_and_raises_what_it_should(num_workers: int) -> None:
    make = _make(num_workers)
    ref = reference_stream(make, epochs=2)
    loader = make()
    try:
        it = iter(loader)
        got = [canonical(next(it)) for _ in range(2)]
        alive = loader.state_dict()
        assert (alive["epoch"], alive["consumed"]) == (0, 2)
        assert it.life is Life.OPEN
        # every worker delivered a batch, so each one has started and is ready
        assert loader.statistics().worker_states == ("ready",) * num_workers
        del it  # abandoned by dropping it: the position stays, the workers go
        assert loader.state_dict() == alive
        assert loader.statistics().workers_alive == 0
        # torch's meaning of iter(): the next epoch, not the rest of the abandoned one
        it = iter(loader)
        assert [canonical(b) for b in it] == ref[1]
        assert it.life is Life.FINISHED
        with pytest.raises(StopIteration):
            next(it)  # an exhausted iterator keeps saying so
        after = loader.state_dict()
        assert (after["epoch"], after["consumed"]) == (2, 0)
    finally:
        loader.close()
    assert got == ref[0][:2]
    # the abandoned position resumes exactly in a new loader
    resumed = make()
    try:
        resumed.load_state_dict(alive)
        rest = [canonical(b) for b in resumed]
        assert got + rest == ref[0]
        assert [canonical(b) for b in resumed] == ref[1]
    finally:
        resumed.close()


def test_an_iterator_replaced_by_a_newer_one_says_so() -> None:
    loader = _make(2, persistent_workers=True)()
    try:
        old = iter(loader)
        next(old)
        new = iter(loader)
        assert old.life is Life.ABANDONED
        with pytest.raises(LoaderClosedError, match="replaced by a newer iter"):
            next(old)
        next(new)
    finally:
        loader.close()
    assert new.life is Life.CLOSED
    with pytest.raises(LoaderClosedError, match="was closed"):
        next(new)


def _failing_init(worker_id: int) -> None:
    raise ValueError(f"worker_init_fn refuses worker {worker_id}")


def test_a_broken_iterator_raises_its_own_error_again_not_closed() -> None:
    loader = DataLoader(Augmented(), batch_size=2, num_workers=1, worker_init_fn=_failing_init)
    it = iter(loader)
    with pytest.raises(ValueError, match="worker_init_fn refuses worker 0") as first:
        next(it)
    assert it.life is Life.BROKEN
    with pytest.raises(ValueError, match="worker_init_fn refuses worker 0") as again:
        next(it)
    assert str(again.value) == str(first.value)
    assert "Traceback" in str(again.value.__cause__)  # the worker's frames
    # nothing was delivered: the position says so
    sd = loader.state_dict()
    assert (sd["epoch"], sd["consumed"]) == (0, 0)
    loader.close()


# A regression found by the fuzzers in fuzz/.
@pytest.mark.parametrize("persistent", [False, True])
def test_exhausted_iterator_keeps_raising_stop_iteration(persistent: bool) -> None:
    loader = DataLoader(
        RangeData(),
        batch_size=2,
        num_workers=2,
        persistent_workers=persistent,
        multiprocessing_context="fork",
    )
    with loader:
        it = iter(loader)
        assert len(list(it)) == 2
        with pytest.raises(StopIteration):
            next(it)


# ---- interrupts inside next() -----------------------------------------------------------------
class _InterruptingBatches:
    """A batch sampler over 12 items in pairs whose ``fire``-th draw raises KeyboardInterrupt
    (the main process, as a Ctrl-C arriving while the loader draws its next task)."""

    def __init__(self, fire: int | None) -> None:
        self.fire = fire

    def __len__(self) -> int:
        return 6

    def __iter__(self) -> Iterator[list[int]]:
        for k in range(6):
            if k == self.fire:
                self.fire = None  # only once
                raise KeyboardInterrupt
            yield [2 * k, 2 * k + 1]


def _interrupting(num_workers: int, fire: int | None) -> DataLoader[Any]:
    return DataLoader(
        Augmented(),
        batch_sampler=_InterruptingBatches(fire),
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(5),
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_interrupt_inside_next_keeps_exactly_what_was_delivered(num_workers: int) -> None:
    ref = reference_stream(lambda: _interrupting(num_workers, None))[0]
    # The 6th draw: with workers the first 4 are drawn by iter() (the prefetch window), and
    # the 6th while the second batch is handed over.
    loader = _interrupting(num_workers, 5)
    got = []
    it = iter(loader)
    with pytest.raises(KeyboardInterrupt):
        while True:
            got.append(canonical(next(it)))
    assert it.life is Life.ABANDONED
    with pytest.raises(LoaderClosedError, match="interrupted"):
        next(it)
    sd = loader.state_dict()
    loader.close()
    assert got == ref[: len(got)]
    assert sd["consumed"] == len(got)
    resumed = _interrupting(num_workers, None)
    try:
        resumed.load_state_dict(sd)
        assert got + [canonical(b) for b in resumed] == ref
    finally:
        resumed.close()


# ---- no reference cycles: everything ends when the last reference goes -------------------------
def _poisoned(tmp: Any, persistent: bool) -> DataLoader[Any]:
    ds = FaultyDataset(Augmented(), {3: Fault("sigkill", attempts=None)}, tmp)
    return DataLoader(
        ds, batch_size=2, num_workers=2, max_task_attempts=2, persistent_workers=persistent
    )


def _raising(tmp: Any, num_workers: int) -> DataLoader[Any]:
    ds = FaultyDataset(Augmented(), {3: Fault("raise", attempts=None)}, tmp)
    return DataLoader(ds, batch_size=2, num_workers=num_workers)


class _Slow(Augmented):
    def __getitem__(self, i: int) -> torch.Tensor:
        if i >= 4:
            import time

            time.sleep(5)  # the load the main process's `timeout` gives up on
        return super().__getitem__(i)


ERRORS = {
    "poison": (lambda tmp: _poisoned(tmp, False), WorkerCrashError),
    "poison-persistent": (lambda tmp: _poisoned(tmp, True), WorkerCrashError),
    "dataset-exception": (lambda tmp: _raising(tmp, 2), ValueError),
    "dataset-exception-nw0": (lambda tmp: _raising(tmp, 0), ValueError),
    "failed-start": (
        lambda tmp: DataLoader(
            Augmented(), batch_size=2, num_workers=2, worker_init_fn=_failing_init
        ),
        ValueError,
    ),
    "timeout": (
        lambda tmp: DataLoader(_Slow(), batch_size=2, num_workers=1, timeout=0.3),
        RuntimeError,
    ),
}


def _children() -> list[psutil.Process]:
    # psutil also lists multiprocessing's fork server / resource tracker, and torch's shm
    # manager once a test used the file_system strategy: long-lived helpers, not ours
    helpers = ("forkserver", "resource_tracker", "torch_shm_manager")
    return [
        c
        for c in psutil.Process().children()
        if not any(h in " ".join(c.cmdline()) for h in helpers)
    ]


@pytest.mark.parametrize("case", list(ERRORS))
def test_after_any_error_dropping_iterator_and_loader_ends_workers_without_gc(
    case: str, tmp_path: Any
) -> None:
    make, expected = ERRORS[case]
    gc.collect()  # start from a clean heap; from here on the collector must not run
    gc.disable()
    try:
        loader = make(tmp_path)
        it = iter(loader)
        refs = weakref.ref(it), weakref.ref(loader)
        try:
            for _ in range(10):
                next(it)
        except expected:
            pass
        else:
            pytest.fail(f"{case}: no {expected.__name__} was raised")
        del it, loader
        # Freed by reference counting alone: a cycle would keep both (and the workers) alive.
        assert [r() is None for r in refs] == [True, True], f"{case}: kept alive by a cycle"
        assert psutil.wait_procs(_children(), timeout=10)[1] == []
    finally:
        gc.enable()


# ---- a state taken after the last batch -------------------------------------------------------
class _CountingStream(torch.utils.data.IterableDataset):
    """0..n-1, split over workers. Where a shard's length is not a multiple of the batch size
    its last batch is short, so its end is seen while that batch is filled (10 items in
    batches of 3: a shard of 10, or two of 5)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(wid, self.n, nw))


END_KNOWN = {
    "map-builtin": lambda nw: _make(nw)(),
    "stream-short-last-batch": lambda nw: DataLoader(
        _CountingStream(10), batch_size=3, num_workers=nw
    ),
}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("case", list(END_KNOWN))
def test_after_the_last_batch_of_a_known_end_the_state_is_the_next_epochs_start(
    case: str, num_workers: int
) -> None:
    make = lambda: END_KNOWN[case](num_workers)  # noqa: E731
    ref = reference_stream(make, epochs=2)
    loader = make()
    try:
        it = iter(loader)
        got = [canonical(next(it)) for _ in range(len(ref[0]))]
        at_end = loader.state_dict()  # every batch delivered, StopIteration not yet raised
        with pytest.raises(StopIteration):
            next(it)
        after_stop = loader.state_dict()
    finally:
        loader.close()
    assert got == ref[0]
    assert (at_end["epoch"], at_end["consumed"]) == (1, 0)
    assert at_end == after_stop
    resumed = make()
    try:
        resumed.load_state_dict(at_end)
        assert [canonical(b) for b in resumed] == ref[1]  # the next epoch, at once
    finally:
        resumed.close()
