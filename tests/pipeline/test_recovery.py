"""Recovery's decisions (``_recovery``), with real slots and a real dispatcher over a fake
supervisor: no process is started. What a death means -- blame, attempts, poison or skip,
failed starts, respawn storms, re-sending -- is decided here; test_supervisor.py and
test_crash_table.py check the same with real processes."""

from __future__ import annotations

from typing import Any

import pytest

from resumable_loader import WorkerCrashError
from resumable_loader.pipeline.dispatch import Dispatcher, TaskSource
from resumable_loader.pipeline.protocol import Epoch, Result, Status, TaskMsg, WorkerError
from resumable_loader.pipeline.recovery import POISON, SKIPPED, Recovery, torch_words
from resumable_loader.pipeline.stats import Counters
from resumable_loader.pipeline.supervisor.events import DeathReport
from resumable_loader.pipeline.supervisor.slots import DEAD, READY_STATE, STARTING, WorkerSlot
from resumable_loader.pipeline.tasks import MapTasks, StreamTasks

END = Status.END


class FakeSupervisor:
    """Slots and the calls Recovery and the dispatcher make; records every message sent."""

    def __init__(self, n: int, storm_after: int | None = None) -> None:
        self.slots = [WorkerSlot(w) for w in range(n)]
        for slot in self.slots:
            slot.state = READY_STATE
            slot.pid = 100 + slot.wid
        self.sent: list[tuple[int, Any]] = []
        self.respawned: list[int] = []
        self.storm_after = storm_after

    def send(self, slot: WorkerSlot, msg: Any) -> bool:
        self.sent.append((slot.wid, msg))
        return True

    def respawn(self, slot: WorkerSlot, report: Any = None) -> None:
        if self.storm_after is not None and len(self.respawned) >= self.storm_after:
            raise WorkerCrashError("respawn storm: workers are dying faster than they can work")
        self.respawned.append(slot.wid)
        slot.state = STARTING
        slot.pid = 200 + len(self.respawned)


def pipeline(
    n_workers: int = 2,
    *,
    iterable: bool = False,
    on_poison: str = "raise",
    storm_after: int | None = None,
) -> tuple[FakeSupervisor, Dispatcher, Recovery, Counters]:
    sup = FakeSupervisor(n_workers, storm_after)
    tasks: TaskSource
    if iterable:
        tasks = StreamTasks(n_workers, None)
    else:
        indices = iter([[2 * k, 2 * k + 1] for k in range(10)])
        tasks = MapTasks(None, indices, 0, n_workers, lambda tid: False, False)  # type: ignore[arg-type]
    disp = Dispatcher(sup, tasks, 2, 0, lambda: 0)
    counters = Counters()
    recovery = Recovery(
        sup,
        disp,
        epoch=0,
        max_attempts=3,
        on_poison=on_poison,
        counters=counters,
        start_method="fork",
    )
    disp.fill()
    return sup, disp, recovery, counters


def die(
    sup: FakeSupervisor, slot: WorkerSlot, *, ready: bool = True, key: str = "sigkill"
) -> DeathReport:
    """What the supervisor does before reporting: the slot is DEAD."""
    slot.state = DEAD
    return DeathReport(slot.pid, -9, "was killed by SIGKILL", key, ready)


def test_a_death_blames_the_running_task_respawns_and_resends_the_rest() -> None:
    sup, disp, recovery, counters = pipeline()
    w0 = sup.slots[0]
    assert list(w0.outstanding) == [0, 2]  # dealt to the least-loaded worker in turn
    sup.sent.clear()
    out = recovery.on_death(w0, die(sup, w0))
    assert out.fatal is None and out.deliver == []
    assert len(disp.tasks[0].failures) == 1  # the earliest sent is what it was running
    assert "while loading samples [0, 1] (task 0)" in disp.tasks[0].failures[0]
    assert disp.tasks[2].failures == []
    assert sup.respawned == [0]
    # The replacement is told the epoch; the map tasks wait for any ready worker.
    assert [type(m) for w, m in sup.sent if w == 0] == [Epoch]
    assert sorted(disp.resend) == [0, 2]
    disp.fill()
    resent = [m.tid for w, m in sup.sent if isinstance(m, TaskMsg)]
    assert resent == [0, 2] and all(w == 1 for w, m in sup.sent if isinstance(m, TaskMsg))
    assert counters.respawns_by_cause["sigkill"] == 1
    assert counters.resent_tasks == 2
    disp.check_invariants(lambda tid: False)


def test_a_worker_that_said_started_is_blamed_for_that_task() -> None:
    sup, disp, recovery, _ = pipeline()
    w0 = sup.slots[0]
    w0.running = 2  # a re-sent task overtook the one sent first (STARTED)
    recovery.on_death(w0, die(sup, w0))
    assert disp.tasks[0].failures == [] and len(disp.tasks[2].failures) == 1


@pytest.mark.parametrize("on_poison", ["raise", "skip"])
def test_the_third_death_on_one_task_makes_it_poison(on_poison: str) -> None:
    sup, disp, recovery, _ = pipeline(on_poison=on_poison)
    w0 = sup.slots[0]
    for attempt in range(3):
        out = recovery.on_death(w0, die(sup, w0))
        if attempt < 2:
            assert out.deliver == []
            w0.state = READY_STATE
            w0.outstanding.appendleft(0)  # re-sent to it again, and it died again
            disp.tasks[0].worker = 0
            disp.resend.remove(0)
    assert out.fatal is None
    [(tid, (status, payload, extra))] = out.deliver
    assert tid == 0 and extra is None and 0 not in disp.tasks
    if on_poison == "raise":
        assert status == POISON and isinstance(payload, WorkerCrashError)
        assert payload.task_id == 0 and payload.indices == [0, 1] and len(payload.attempts) == 3
        assert "killed the worker 3 times" in str(payload) and "on_poison='skip'" in str(payload)
        # torch's own sentence too, for the last death (the second replacement, pid 202)
        assert "DataLoader worker (pid 202) is killed by signal: Killed." in str(payload)
    else:
        assert status == SKIPPED and payload[:2] == (0, [0, 1]) and "(skipped)" in payload[2]


def _init_error(exc: BaseException) -> WorkerError:
    try:
        raise exc
    except BaseException:
        return WorkerError("in worker_init_fn of DataLoader worker 1")


def test_a_worker_init_fn_error_is_raised_as_the_users_own_at_once() -> None:
    sup, disp, recovery, _ = pipeline()
    w1 = sup.slots[1]
    w1.init_error = _init_error(ValueError("worker_init_fn: bad config"))
    out = recovery.on_death(w1, die(sup, w1, ready=False, key="init_error"))
    assert type(out.fatal) is ValueError and "bad config" in str(out.fatal)
    assert "Traceback" in str(out.fatal.__cause__)
    assert sup.respawned == []  # a bug report is not a crash: nothing is retried
    assert all(t.failures == [] for t in disp.tasks.values())


def test_transient_failed_starts_blame_no_task_and_end_the_epoch_at_the_limit() -> None:
    sup, disp, recovery, _ = pipeline()
    recovery.transient = (OSError,)  # a RetryPolicy's exceptions
    w1 = sup.slots[1]
    w1.init_error = _init_error(ConnectionError("worker_init_fn: no data server"))
    for attempt in range(3):
        out = recovery.on_death(w1, die(sup, w1, ready=False, key="init_error"))
        if attempt < 2:
            assert out.fatal is None
    assert all(t.failures == [] for t in disp.tasks.values())  # no task is to blame
    assert isinstance(out.fatal, WorkerCrashError)
    assert "failed to start 3 times in a row" in str(out.fatal)
    assert isinstance(out.fatal.__cause__, ConnectionError)
    assert "no data server" in str(out.fatal.__cause__)
    assert sup.respawned == [1, 1]  # not a third time: the epoch is over


def test_failed_starts_under_spawn_advise_the_main_guard() -> None:
    sup, _, recovery, _ = pipeline()
    recovery.start_method = "spawn"
    w0 = sup.slots[0]
    for _ in range(3):
        out = recovery.on_death(w0, die(sup, w0, ready=False, key="exit"))
    assert out.fatal is not None and "if __name__ == '__main__':" in str(out.fatal)


def test_a_respawn_storm_is_fatal() -> None:
    sup, _, recovery, _ = pipeline(storm_after=0)
    w0 = sup.slots[0]
    out = recovery.on_death(w0, die(sup, w0))
    assert out.fatal is not None and "respawn storm" in str(out.fatal)
    assert "is killed by signal: Killed." in str(out.fatal)


def test_a_poisoned_stream_batch_ends_that_workers_shard() -> None:
    sup, disp, recovery, _ = pipeline(iterable=True)
    w0 = sup.slots[0]
    assert list(w0.outstanding) == [0, 2]
    for attempt in range(3):
        out = recovery.on_death(w0, die(sup, w0))
        if attempt < 2:
            w0.state = READY_STATE
    assert isinstance(disp.source, StreamTasks) and disp.source.received_at[0].exhausted
    by_tid = {tid: item for tid, item in out.deliver}
    assert by_tid[0][0] == POISON
    assert by_tid[2] == (END, None, (0, None, True))  # the rest of the shard: ends
    assert not disp.tasks.keys() & {0, 2}


def test_an_exhausted_stream_worker_is_replaced_but_its_tasks_end() -> None:
    sup, disp, recovery, _ = pipeline(iterable=True)
    w1 = sup.slots[1]
    assert isinstance(disp.source, StreamTasks)
    disp.source.received_at[1].exhausted = True  # its shard ran dry in a batch already received
    sup.sent.clear()
    out = recovery.on_death(w1, die(sup, w1))
    assert sorted(out.deliver) == [
        (1, (END, None, (1, None, True))),
        (3, (END, None, (1, None, True))),
    ]
    assert [type(m) for _, m in sup.sent] == [Epoch]  # told the epoch, but nothing re-sent
    assert not disp.tasks.keys() & {1, 3}


def test_a_stream_worker_killed_after_its_draining_batch_reads_its_shard_no_more() -> None:
    # The end-to-end case of tests/pipeline/test_streams.py without its race: worker 1's partial
    # batch (task 1) arrives marked drained; it dies still holding task 3 (an END it never sent).
    sup, disp, recovery, _ = pipeline(iterable=True)
    tasks = disp.source
    assert isinstance(tasks, StreamTasks)
    w1 = sup.slots[1]
    assert list(w1.outstanding) == [1, 3]
    assert disp.on_result(w1, 1) is not None
    tasks.received(w1, Result(0, 1, Status.OK, [100], None, 0, True))
    sup.sent.clear()
    out = recovery.on_death(w1, die(sup, w1))
    assert out.fatal is None and sup.respawned == [1]
    assert out.deliver == [(3, (END, None, (1, None, True)))]
    # The replacement is told the epoch with nothing to resume or replay, and is sent nothing.
    assert [(w, type(m)) for w, m in sup.sent] == [(1, Epoch)]
    assert sup.sent[0][1].resume is None
    disp.fill()
    assert all(w == 0 for w, m in sup.sent if isinstance(m, TaskMsg))
    disp.check_invariants(lambda tid: tid == 1)


def test_torchs_words_for_each_kind_of_death() -> None:
    def words(exitcode: int | None, key: str = "x") -> str:
        return torch_words(DeathReport(42, exitcode, "cause", key, True))

    assert words(-11) == "DataLoader worker (pid 42) is killed by signal: Segmentation fault."
    assert words(-9) == "DataLoader worker (pid 42) is killed by signal: Killed."
    assert words(3) == "DataLoader worker (pid 42) exited unexpectedly with exit code 3."
    assert words(-9, key="hang") == ""  # torch has no words for a hang
    assert words(None) == ""


def test_a_segfaulting_sample_is_reported_in_torchs_words_too(tmp_path: Any) -> None:
    import torch
    from torch.utils.data import TensorDataset

    from resumable_loader import DataLoader
    from resumable_loader.testing import Fault, FaultyDataset

    ds = FaultyDataset(
        TensorDataset(torch.arange(8)), {5: Fault("sigsegv", attempts=None)}, tmp_path
    )
    loader = DataLoader(ds, batch_size=2, num_workers=2, max_task_attempts=2)
    with (
        loader,
        pytest.raises(
            WorkerCrashError,
            match=r"DataLoader worker \(pid \d+\) is killed by signal: Segmentation fault\.",
        ) as info,
    ):
        for _ in loader:
            pass
    assert info.value.indices == [4, 5]
