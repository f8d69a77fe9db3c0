"""Iterable datasets (streams): each worker's shard, when it is known to be drained, and what
its position in the state says -- through deaths and prefetched END fetches.

The datasets here are module-level (picklable); the tests use the fork start method.
"""

from __future__ import annotations

import os
import signal
import time
import warnings

from torch.utils.data import IterableDataset, get_worker_info

from resumable_loader import DataLoader
from resumable_loader.testing import worker_pids


class ShortSecondShard(IterableDataset):
    """Worker 0 yields 0..5; worker 1 yields only 100 -- with batch_size=2 its one batch is
    partial, so its shard is known to be drained when that batch arrives."""

    def __iter__(self):
        info = get_worker_info()
        if info is None or info.id == 0:
            yield from range(6)
        else:
            yield 100


# A regression found by the fuzzers in fuzz/.
def test_killing_a_drained_stream_worker_replays_nothing() -> None:
    # Tasks 0, 2 go to worker 0 and 1, 3 to worker 1 (prefetch 2). Task 1 brings worker 1's
    # partial, draining batch; task 3 (an END) may still be outstanding when worker 1 is
    # killed. Whether it is depends on what the main process had read; the decision for that
    # case (replace the worker, end its tasks, read nothing again) is tested without a race in
    # test_recovery.py (test_a_stream_worker_killed_after_its_draining_batch_reads_its_shard_
    # no_more). Either way the stream is the uninterrupted one.
    loader = DataLoader(
        ShortSecondShard(),
        batch_size=2,
        num_workers=2,
        prefetch_factor=2,
        multiprocessing_context="fork",
    )
    with loader:
        it = iter(loader)
        got = [next(it).tolist(), next(it).tolist()]
        os.kill(worker_pids(loader)[1], signal.SIGKILL)
        got += [b.tolist() for b in it]
    assert got == [[0, 1], [100], [2, 3], [4, 5]]


class TwoItems(IterableDataset):
    def __iter__(self):
        return iter([0, 1])


def slow_pin(batch):
    # Pinning that takes a while (a large batch): while the first batch is pinned, the main
    # process reads the next batch and the END fetch, which then wait in the pin thread's
    # FIFO when the state is taken. Workload, not synchronisation: a faster pin only makes
    # the test less sensitive, never wrong.
    time.sleep(0.2)
    return batch


# A regression found by the fuzzers in fuzz/.
def test_unordered_pinned_stream_state_does_not_end_a_worker_early() -> None:
    def make() -> DataLoader:
        return DataLoader(
            TwoItems(),
            batch_size=None,
            num_workers=1,
            prefetch_factor=4,  # the END fetch is sent with the two data fetches
            in_order=False,
            multiprocessing_context="fork",
        )

    loader = make()
    # The pin thread, without an accelerator (as in tests/pipeline/test_supervisor.py); real
    # pin_memory=True on a GPU machine takes the same path.
    loader._force_pin_fn = slow_pin
    with loader:
        it = iter(loader)
        assert next(it) == 0
        sd = loader.state_dict()
    resumed = make()
    with resumed, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fast-forward notice
        resumed.load_state_dict(sd)
        rest = list(resumed)
    assert rest == [1]  # the state says worker 0 is exhausted after 1 batch: []
