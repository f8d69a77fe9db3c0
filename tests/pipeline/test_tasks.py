"""The task sources (``_tasks``): what map-style and stream tasks are, where they go, what a
death and poison do to them, and how their position is written -- over a fake supervisor, no
process started. test_recovery.py drives the same sources through recovery's decisions."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from resumable_loader.pipeline.dispatch import Dispatcher
from resumable_loader.pipeline.protocol import (
    Delivery,
    Epoch,
    Result,
    Status,
    StreamResume,
    TaskMsg,
)
from resumable_loader.pipeline.reorder import ReorderBuffer
from resumable_loader.pipeline.supervisor.slots import DEAD, READY_STATE, WorkerSlot
from resumable_loader.pipeline.tasks import MapTasks, ShardPosition, StreamTasks, encode_plain
from resumable_loader.state.schema import ResumePoint, WorkerPosition


def encode_delta(new: dict[str, Any], old: dict[str, Any]) -> dict[Any, bytes]:
    """What a worker sends when its dataset's state went from ``old`` to ``new``."""
    return {**encode_plain(new), **{k: b"" for k in old if k not in new}}


class FakeSupervisor:
    def __init__(self, n: int) -> None:
        self.slots = [WorkerSlot(w) for w in range(n)]
        for slot in self.slots:
            slot.state = READY_STATE
        self.sent: list[tuple[int, Any]] = []

    def send(self, slot: WorkerSlot, msg: Any) -> bool:
        self.sent.append((slot.wid, msg))
        return True


def tasks_sent(sup: FakeSupervisor) -> list[tuple[int, int, Any]]:
    return [(w, m.tid, m.payload) for w, m in sup.sent if isinstance(m, TaskMsg)]


def test_map_tasks_are_dealt_in_torchs_turns_and_a_dead_workers_go_to_the_others() -> None:
    sup = FakeSupervisor(3)
    indices = iter([[k] for k in range(100)])
    tasks = MapTasks(None, indices, 0, 3, lambda tid: False, False)  # type: ignore[arg-type]
    disp = Dispatcher(sup, tasks, 2, 0, lambda: 0)  # type: ignore[arg-type]
    disp.fill()
    # task i to worker i mod n, up to the window (2 per worker)
    assert tasks_sent(sup) == [(t % 3, t, [t]) for t in range(6)]
    w1 = sup.slots[1]
    w1.state = DEAD
    blamed, tids = disp.on_death(w1)
    assert blamed is not None and blamed.tid == 1 and tids == [1, 4]
    assert list(w1.outstanding) == [] and sorted(disp.resend) == [1, 4]
    sup.sent.clear()
    del disp.tasks[0], disp.tasks[2]  # two results came in: room for two more
    sup.slots[0].outstanding.remove(0)
    sup.slots[2].outstanding.remove(2)
    disp.fill()
    # the dead worker's tasks first, to the least-loaded ready workers; then new tasks, in
    # turn, passing over the worker being replaced
    sent = tasks_sent(sup)
    assert [t for _, t, _ in sent[:2]] == [1, 4] and all(w != 1 for w, _, _ in sent)
    disp.check_invariants(lambda tid: tid in (0, 2))


def test_map_tasks_skip_ids_already_delivered_and_record_a_stateful_samplers_draws() -> None:
    sup = FakeSupervisor(2)
    reorder = ReorderBuffer(False, 2, frozenset({3}))  # 0, 1 and 3 were delivered
    indices = iter([[k] for k in range(2, 20)])
    tasks = MapTasks(None, indices, 2, 2, reorder.seen, True, owed=[(2, [2])])  # type: ignore[arg-type]
    disp = Dispatcher(sup, tasks, 2, 2, lambda: 0)  # type: ignore[arg-type]
    tasks.begin(disp)
    disp.fill()
    # task 2 was owed (drawn before the checkpoint): re-sent; new draws start at 2 too, but
    # id 2 is taken by the owed task's table entry and 3 was delivered
    sent = [t for _, t, _ in tasks_sent(sup)]
    assert sent[0] == 2 and 3 not in sent
    assert tasks.drawn is not None and set(tasks.drawn) == set(disp.tasks)
    tasks.delivered(2, Delivery(Status.OK, None, None))
    assert 2 not in tasks.drawn


def test_stream_tasks_follow_each_shard_and_resume_where_it_was_received() -> None:
    sup = FakeSupervisor(2)
    rp = ResumePoint(seed=0, epoch=0, consumed=5)
    rp.workers = [WorkerPosition(3, False, {"pos": 3}, 3), WorkerPosition(2, False)]
    rp.next_worker = 1
    tasks = StreamTasks(2, rp)
    disp = Dispatcher(sup, tasks, 2, 5, lambda: 0)  # type: ignore[arg-type]
    for slot in sup.slots:
        disp.send_epoch(slot)
    disp.fill()
    epochs = {w: m.resume for w, m in sup.sent if isinstance(m, Epoch)}
    assert epochs[0] == StreamResume(epochs[0].state, True, 3, 3) and epochs[0].state
    assert epochs[1] == StreamResume(None, True, 0, 2)
    # round-robin from the saved next worker; each task is its shard's next fetch number
    assert tasks_sent(sup) == [(1, 5, 2), (0, 6, 3), (1, 7, 3), (0, 8, 4)]

    # Worker 0 returns fetch 3 with a new state; it dies holding fetch 4. Its replacement
    # resumes from the state received with fetch 3 and gets fetch 4 again.
    w0 = sup.slots[0]
    disp.on_result(w0, 6)
    note = tasks.received(w0, Result(0, 6, Status.OK, "b", encode_delta({"pos": 4}, {}), 0, False))
    assert note is not None and note.worker == 0
    w0.state = DEAD
    disp.on_death(w0)
    assert list(w0.outstanding) == [8]  # kept for the replacement
    w0.state = READY_STATE
    sup.sent.clear()
    disp.send_epoch(w0)
    assert tasks.after_respawn(disp, w0) == []
    [(_, epoch_msg), (_, resent)] = sup.sent
    assert isinstance(epoch_msg, Epoch) and epoch_msg.resume is not None
    assert (epoch_msg.resume.state_at, epoch_msg.resume.fetched) == (4, 4)
    assert isinstance(resent, TaskMsg) and (resent.tid, resent.payload) == (8, 4)

    # The state is written from what was delivered, not received.
    reorder = ReorderBuffer(True, 5, frozenset())
    out = ResumePoint(seed=0, epoch=0, consumed=5)
    tasks.export(out, disp, reorder, None)
    assert out.iterable and out.workers[0] == WorkerPosition(3, False, {"pos": 3}, 3)
    assert out.next_worker == 1  # task 5, the lowest not delivered, is worker 1's


def test_a_poisoned_shard_ends_and_its_other_tasks_become_ends() -> None:
    sup = FakeSupervisor(2)
    tasks = StreamTasks(2, None)
    disp = Dispatcher(sup, tasks, 2, 0, lambda: 0)  # type: ignore[arg-type]
    disp.fill()
    w0 = sup.slots[0]
    disp.drop(0)  # the poison task itself, as recovery drops it
    note, ends = tasks.poisoned(disp, w0)
    assert note is not None and note.drained
    assert [(tid, item.status) for tid, item in ends] == [(2, Status.END)]
    assert tasks.received_at[0].exhausted
    sup.sent.clear()
    disp.fill()
    assert all(w == 1 for w, _, _ in tasks_sent(sup))  # no task to a dry shard


@given(
    st.lists(
        st.tuples(
            st.sampled_from([Status.OK, Status.ERROR, Status.END]),
            st.none() | st.dictionaries(st.sampled_from("abc"), st.integers()),
            st.booleans(),
        ),
        max_size=12,
    )
)
def test_a_shard_position_written_and_read_back_is_the_same(steps: list[Any]) -> None:
    pos = ShardPosition()
    state: dict[str, int] = {}
    for status, new_state, drained in steps:
        delta = None
        if new_state is not None:
            delta = encode_delta(new_state, state)
            state = new_state
        pos.advance(status, delta, drained)
    written = pos.position()
    again = ShardPosition.of(written)
    assert again.position() == written
    assert again.resume() == pos.resume()
    assert written.delivered == sum(s in (Status.OK, Status.ERROR) for s, _, _ in steps)
    assert written.exhausted == any(d or s == Status.END for s, _, d in steps)
