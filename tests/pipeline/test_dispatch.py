"""The dispatcher (``_dispatch``): the task table, which task a death is blamed on, and the
table's invariants while workers die and tasks are re-sent."""

from __future__ import annotations

import torch
from _datasets import RandomAugDataset

from resumable_loader import DataLoader
from resumable_loader.testing import Fault, FaultyDataset


def test_a_death_is_blamed_on_the_task_the_worker_was_running() -> None:
    import collections
    from types import SimpleNamespace

    from resumable_loader.pipeline.dispatch import Dispatcher, Task
    from resumable_loader.pipeline.supervisor.slots import WorkerSlot
    from resumable_loader.pipeline.tasks import StreamTasks

    slot = WorkerSlot(1)
    # A stream's tasks stay on the dead slot (for its replacement): what on_death reports.
    tasks = StreamTasks(2, None)
    disp = Dispatcher(SimpleNamespace(slots=[slot]), tasks, 3, 0, lambda: 0)
    for tid in (3, 5, 2):  # task 2 was re-sent to this worker after 3 and 5
        disp.tasks[tid] = Task(tid, [tid], worker=1)
    slot.outstanding = collections.deque([3, 5, 2])
    # Workers run tasks in arrival order: 3 was running, not the lowest id held (2).
    blamed, tids = disp.on_death(slot)
    assert blamed is not None and blamed.tid == 3 and tids == [2, 3, 5]

    # A worker that takes a re-sent lower id first says so (STARTED): that one is blamed.
    slot.outstanding = collections.deque([5, 2])
    slot.running = 2
    blamed, _ = disp.on_death(slot)
    assert blamed is not None and blamed.tid == 2


def test_invariants_hold_after_every_batch_through_crashes(tmp_path) -> None:
    ds = FaultyDataset(RandomAugDataset(40), {5: Fault("sigkill"), 22: Fault("exit")}, tmp_path)
    loader = DataLoader(
        ds, batch_size=2, num_workers=3, in_order=False, generator=torch.Generator().manual_seed(0)
    )
    n = 0
    for _ in loader:
        loader.check_invariants()
        n += 1
    assert n == 20
    assert loader.statistics().respawns == 2
