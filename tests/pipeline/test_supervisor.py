"""The supervisor: dead and hung workers are replaced and the stream comes out identical.

Each case runs a loader whose workers die (or hang) at a chosen batch and compares what it
delivers with an uninterrupted reference run; the autouse fixture in conftest.py then checks
that no child process, thread, fd or shm segment was left behind.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import pytest
import torch
from _datasets import RandomAugDataset, RangeData, torch_error_type
from _streams import Shard, StatefulShard

from resumable_loader import DataLoader, RetryPolicy, WorkerCrashError
from resumable_loader.pipeline.supervisor.events import Died
from resumable_loader.testing import (
    Fault,
    FaultyDataset,
    FaultyStream,
    canonical,
    kill_at,
    kill_worker,
)

N, BS = 24, 4  # 6 batches: task t holds samples 4t .. 4t+3
POSITIONS = {"first": 1, "mid": 10, "last": 23}
ALL_METHODS = ["fork", "spawn", "forkserver"]


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(42)


def reference(**kw) -> list:
    loader = DataLoader(RandomAugDataset(N), batch_size=BS, generator=gen(), **kw)
    return [canonical(b) for b in loader]


def faulty_loader(tmp_path, faults: dict, **kw) -> DataLoader:
    kw.setdefault("num_workers", 2)
    kw.setdefault("multiprocessing_context", "fork")
    ds = FaultyDataset(RandomAugDataset(N), faults, tmp_path)
    return DataLoader(ds, batch_size=BS, generator=gen(), **kw)


# ---- deaths inside the worker, at the first / a middle / the last batch -------------------------
@pytest.mark.parametrize("where", list(POSITIONS))
@pytest.mark.parametrize("action", ["sigkill", "sigsegv", "exit"])
def test_worker_death_is_invisible_in_the_stream(tmp_path, action: str, where: str) -> None:
    loader = faulty_loader(tmp_path, {POSITIONS[where]: Fault(action)})
    got = [canonical(b) for b in loader]
    stats = loader.statistics()
    assert got == reference()
    assert stats.respawns == 1, stats
    expected_cause = {"sigkill": "signal:SIGKILL", "sigsegv": "signal:SIGSEGV", "exit": "exit:3"}[
        action
    ]
    assert dict(stats.respawns_by_cause) == {expected_cause: 1}
    assert stats.resent_tasks >= 1


@pytest.mark.parametrize("method", ALL_METHODS)
def test_all_workers_dying_at_once_under_each_start_method(tmp_path, method: str) -> None:
    # Tasks 0 and 1 start together on workers 0 and 1; both die on their first attempt.
    loader = faulty_loader(
        tmp_path, {1: Fault("sigkill"), 5: Fault("sigsegv")}, multiprocessing_context=method
    )
    got = [canonical(b) for b in loader]
    assert got == reference()
    assert loader.statistics().respawns == 2


@pytest.mark.parametrize("method", ALL_METHODS)
def test_sigkill_from_outside_mid_epoch(method: str) -> None:
    # 4 * N samples: many more batches than can be in flight when the workers are killed.
    def make(**kw) -> DataLoader:
        return DataLoader(RandomAugDataset(4 * N), batch_size=BS, generator=gen(), **kw)

    ref = [canonical(b) for b in make()]
    loader = make(num_workers=2, multiprocessing_context=method)
    plan = {2: [(0, signal.SIGKILL), (1, signal.SIGKILL)]}
    got = [canonical(b) for b in kill_at(loader, plan)]
    assert got == ref
    assert loader.statistics().respawns_by_cause["signal:SIGKILL"] == 2


def fork_a_grandchild(worker_id: int) -> None:
    """worker_init_fn: fork a child that inherits (and so holds open) the worker's process
    sentinel and result socket, and outlives the worker by 3 s (6 polling intervals)."""
    parent = os.getpid()
    if os.fork() == 0:
        try:
            while os.getppid() == parent:
                time.sleep(0.02)  # the grandchild's own lifetime, not a test synchronisation
            time.sleep(3.0)
        finally:
            os._exit(0)


def test_death_hidden_from_sentinel_and_socket_is_found_by_polling() -> None:
    # A worker's own child keeps the sentinel pipe and the result socket open, so neither
    # reports the worker's death; only the liveness polling (is_alive) can find it.
    def make(**kw) -> DataLoader:
        return DataLoader(RandomAugDataset(4 * N), batch_size=BS, generator=gen(), **kw)

    ref = [canonical(b) for b in make()]
    loader = make(
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=fork_a_grandchild,
        timeout=2.5,  # the grandchild lets go after 3 s: the death must be found before that
    )
    got = []
    for i, batch in enumerate(loader):
        got.append(canonical(batch))
        if i == 2:
            kill_worker(loader, 0, signal.SIGKILL)
    assert got == ref
    assert dict(loader.statistics().respawns_by_cause) == {"signal:SIGKILL": 1}


def test_hung_worker_is_killed_after_task_timeout(tmp_path) -> None:
    loader = faulty_loader(tmp_path, {10: Fault("stop")}, task_timeout=1.0)
    got = [canonical(b) for b in loader]
    assert got == reference()
    assert dict(loader.statistics().respawns_by_cause) == {"hang": 1}


def test_worker_hung_in_user_code_is_replaced(tmp_path) -> None:
    loader = faulty_loader(tmp_path, {23: Fault("hang")}, task_timeout=1.0)
    assert [canonical(b) for b in loader] == reference()
    assert loader.statistics().respawns_by_cause["hang"] == 1


@pytest.mark.parametrize("pin_memory", [False, True])
def test_a_slow_training_step_is_not_a_hung_worker(tmp_path, pin_memory: bool) -> None:
    # While the user spends longer than task_timeout between batches, finished results wait
    # in the workers' sockets; the supervisor must not read that wait as a hang.
    loader = faulty_loader(tmp_path, {}, task_timeout=0.2, pin_memory=pin_memory)
    if pin_memory:
        loader._force_pin_fn = lambda batch: batch
    got = []
    for batch in loader:
        got.append(canonical(batch))
        time.sleep(0.4)  # the training step: longer than task_timeout (not a synchronisation)
    assert got == reference()
    assert loader.statistics().respawns == 0


def test_timeout_alone_never_declares_a_worker_dead(tmp_path) -> None:
    # torch's `timeout` raises in the caller; the worker is not killed or respawned for it.
    loader = faulty_loader(tmp_path, {10: Fault("stop")}, timeout=0.5)
    it = iter(loader)
    next(it)
    next(it)
    with pytest.raises(RuntimeError, match=r"timed out after 0\.5 seconds"):
        for _ in it:
            pass
    assert loader.statistics().respawns == 0
    loader.close()  # the stopped worker is killed on close


# ---- poison tasks -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ALL_METHODS)
def test_poison_sample_raises_naming_the_samples_then_the_stream_goes_on(
    tmp_path, method: str
) -> None:
    loader = faulty_loader(
        tmp_path, {10: Fault("sigkill", attempts=None)}, multiprocessing_context=method
    )
    ref = reference()
    got = []
    it = iter(loader)
    with pytest.raises(WorkerCrashError) as info:
        for batch in it:
            got.append(canonical(batch))
    err = info.value
    assert got == ref[:2]
    assert err.indices == [8, 9, 10, 11] and err.task_id == 2
    assert "[8, 9, 10, 11]" in str(err) and "SIGKILL" in str(err) and "on_poison='skip'" in str(err)
    assert len(err.attempts) == 3 and all("pid" in a for a in err.attempts)
    assert isinstance(err, RuntimeError)
    rest = [canonical(b) for b in it]
    assert rest == ref[3:], "the batches after the poison task must still come, in order"


def test_poison_sample_can_be_skipped(tmp_path) -> None:
    loader = faulty_loader(tmp_path, {23: Fault("exit", attempts=None)}, on_poison="skip")
    with pytest.warns(RuntimeWarning, match=r"\[20, 21, 22, 23\]"):
        got = [canonical(b) for b in loader]
    assert got == reference()[:-1]
    stats = loader.statistics()
    assert stats.skipped_tasks == ((0, 5, (20, 21, 22, 23)),)
    assert loader.state_dict()["skipped"] == [[0, 5, [20, 21, 22, 23]]]


def test_max_task_attempts_bounds_the_retries(tmp_path) -> None:
    loader = faulty_loader(
        tmp_path, {1: Fault("sigkill", attempts=frozenset({0, 1}))}, max_task_attempts=3
    )
    assert [canonical(b) for b in loader] == reference()
    loader2 = faulty_loader(
        tmp_path / "x", {1: Fault("sigkill", attempts=frozenset({0}))}, max_task_attempts=1
    )
    (tmp_path / "x").mkdir(exist_ok=True)
    with pytest.raises(WorkerCrashError, match="max_task_attempts=1"):
        list(loader2)
    loader2.close()


# ---- errors that are not crashes ----------------------------------------------------------------
def test_unpicklable_result_is_an_error_at_its_position(tmp_path) -> None:
    # collate_fn=list keeps the items as they are, so the batch really holds the lambda.
    loader = faulty_loader(tmp_path, {10: Fault("unpicklable")}, collate_fn=list)
    ref = reference(collate_fn=list)
    it = iter(loader)
    got = [canonical(next(it)), canonical(next(it))]
    with pytest.raises(Exception, match=r"could not be sent \(pickling\)"):
        next(it)
    got += [canonical(b) for b in it]
    assert got == ref[:2] + ref[3:]
    assert loader.statistics().respawns == 0


class HoldsALambda(torch.utils.data.Dataset):
    """Cannot be pickled (a lambda), so a spawn worker for it cannot be started."""

    def __init__(self) -> None:
        self.transform = lambda x: x

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return self.transform(i)


def test_the_warning_for_a_worker_that_cannot_be_started_points_at_the_callers_line() -> None:
    # The warning walks out of the package's frames, whichever layer they are in (it once
    # stopped at the supervisor's folder and pointed into the loader's own code).
    loader = DataLoader(HoldsALambda(), num_workers=1, multiprocessing_context="spawn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
            line = sys._getframe().f_lineno + 1
            iter(loader)
    said = [w for w in caught if str(w.message).startswith("Got pickle error")]
    assert [(w.filename, w.lineno) for w in said] == [(__file__, line)]


def test_transient_errors_are_retried_with_identical_values(tmp_path) -> None:
    loader = faulty_loader(
        tmp_path,
        {5: Fault("transient", attempts=frozenset({0, 1})), 17: Fault("transient")},
        retry=RetryPolicy(attempts=3, backoff_s=0.001),
    )
    assert [canonical(b) for b in loader] == reference()
    assert loader.statistics().retries == 3


def test_transient_errors_beyond_the_policy_are_raised(tmp_path) -> None:
    loader = faulty_loader(
        tmp_path,
        {5: Fault("transient", attempts=None)},
        retry=RetryPolicy(attempts=2, backoff_s=0.001),
    )
    with pytest.raises(OSError, match="transient error"):
        list(loader)
    loader.close()


class FlakyInit:
    """A worker_init_fn failing the first ``times`` starts of worker ``wid`` (counted in a file)."""

    def __init__(self, path: str, wid: int | None, times: int) -> None:
        self.path, self.wid, self.times = path, wid, times

    def __call__(self, worker_id: int) -> None:
        if self.wid is not None and worker_id != self.wid:
            return
        with open(self.path, "a") as f:
            f.write(".")
        if os.path.getsize(self.path) <= self.times:
            raise ConnectionError("init could not reach the data server")


def test_worker_init_fn_failure_is_retried(tmp_path) -> None:
    loader = DataLoader(
        RandomAugDataset(N),
        batch_size=BS,
        num_workers=2,
        generator=gen(),
        worker_init_fn=FlakyInit(str(tmp_path / "n"), wid=1, times=1),
        retry=RetryPolicy(),  # names OSError (ConnectionError's base) as transient
    )
    assert [canonical(b) for b in loader] == reference()
    assert loader.statistics().respawns_by_cause["init_error"] == 1


def test_worker_init_fn_failing_every_time_raises_with_its_traceback(tmp_path) -> None:
    loader = DataLoader(
        RandomAugDataset(N),
        batch_size=BS,
        num_workers=2,
        worker_init_fn=FlakyInit(str(tmp_path / "n"), wid=None, times=100),
        retry=RetryPolicy(),
    )
    with pytest.raises(WorkerCrashError, match="failed to start 3 times") as info:
        list(loader)
    assert isinstance(info.value.__cause__, ConnectionError)
    assert "data server" in str(info.value.__cause__)
    # The loader is broken, but its state still says what was consumed.
    assert loader.state_dict()["consumed"] == 0
    loader.close()


def _init_bug(worker_id: int) -> None:
    raise ValueError(f"worker_init_fn has a bug (worker {worker_id})")


def test_worker_init_fn_raising_is_raised_as_torch_does_not_retried() -> None:
    # An exception from user code is a bug report, not a crash: raised at once, with its type,
    # its message and the worker's traceback; no respawn (no RetryPolicy names ValueError).
    kw = dict(dataset=RandomAugDataset(N), batch_size=BS, num_workers=2, worker_init_fn=_init_bug)
    their_type = torch_error_type(**kw)
    assert issubclass(their_type, ValueError)
    loader = DataLoader(**kw, retry=RetryPolicy())
    with pytest.raises(ValueError, match="worker_init_fn has a bug") as ours:
        list(loader)
    assert type(ours.value) is their_type
    assert "in worker_init_fn of DataLoader worker" in str(ours.value)
    assert "Traceback" in str(ours.value.__cause__)  # the worker's own frames
    assert loader.statistics().respawns == 0
    assert loader.state_dict()["consumed"] == 0
    loader.close()


# ---- variations: in_order=False, pin thread, persistent workers, threads ------------------------
def test_unordered_stream_survives_deaths(tmp_path) -> None:
    loader = faulty_loader(tmp_path, {1: Fault("sigkill"), 14: Fault("sigsegv")}, in_order=False)
    got = sorted(map(repr, (canonical(b) for b in loader)))
    assert got == sorted(map(repr, reference()))


def test_pin_thread_path_survives_deaths(tmp_path) -> None:
    pinned = []

    def fake_pin(batch):
        pinned.append(1)
        return batch

    loader = faulty_loader(tmp_path, {10: Fault("sigkill"), 18: Fault("exit")})
    loader._force_pin_fn = fake_pin  # the pin thread, without needing an accelerator
    got = [canonical(b) for b in loader]
    assert got == reference()
    assert len(pinned) == len(got)


def test_persistent_workers_recover_across_epochs(tmp_path) -> None:
    loader = faulty_loader(
        tmp_path, {10: Fault("sigkill", attempts=frozenset({0, 1}))}, persistent_workers=True
    )
    ref_loader = DataLoader(RandomAugDataset(N), batch_size=BS, generator=gen())
    ref = [[canonical(b) for b in ref_loader] for _ in range(3)]
    got = [[canonical(b) for b in loader] for _ in range(3)]
    assert got == ref
    assert loader.statistics().respawns == 2  # attempts 0 and 1: epoch 0 and epoch 1
    loader.close()


def test_iterating_from_another_thread(tmp_path) -> None:
    loader = faulty_loader(tmp_path, {10: Fault("sigkill")})
    out: list = []
    t = threading.Thread(target=lambda: out.extend(canonical(b) for b in loader))
    t.start()
    t.join(60)
    assert out == reference()


def test_respawns_are_logged_with_worker_pid_cause_and_samples(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="resumable_loader")
    loader = faulty_loader(tmp_path, {10: Fault("sigkill")})
    list(loader)
    text = caplog.text
    assert "was killed by SIGKILL while loading samples [8, 9, 10, 11]" in text
    assert "re-sending tasks" in text and "->" in text


# ---- streams ------------------------------------------------------------------------------------
def sample_id(item) -> int:
    return int(item[0])


@pytest.mark.parametrize("cls", [StatefulShard, Shard])
@pytest.mark.parametrize("where", [0, 9, 13], ids=["first", "mid", "last"])
def test_stream_worker_killed_mid_stream_continues_exactly(tmp_path, cls, where) -> None:
    # Shard(14) over 2 workers: worker 0 yields 0, 2, .., 12; worker 1 yields 1, 3, .., 15.
    def make(faults):
        return DataLoader(
            FaultyStream(cls(14), faults, tmp_path, key=sample_id),
            batch_size=3,
            num_workers=2,
            generator=gen(),
        )

    ref = [canonical(b) for b in make({})]
    loader = make({where: Fault("sigkill")})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = [canonical(b) for b in loader]
    assert got == ref
    assert loader.statistics().respawns == 1


def test_stream_poison_ends_that_workers_shard(tmp_path) -> None:
    # Worker 1 yields 1, 3, 5, ..: sample 5 kills it every time, in its third batch.
    faults = {5: Fault("sigkill", attempts=None)}
    loader = DataLoader(
        FaultyStream(StatefulShard(10), faults, tmp_path, key=sample_id),
        batch_size=1,
        num_workers=2,
        on_poison="skip",
    )
    with pytest.warns(RuntimeWarning, match="gave up"):
        got = [int(v) for b in loader for v in b[:, 0]]
    assert sorted(got) == sorted([*range(0, 10, 2), 1, 3]), "worker 1's shard ends at the poison"


def test_a_dead_workers_clean_up_deletes_no_shm_name_it_did_not_record() -> None:
    # A name that only looks like the dead worker's (another job's segment in a shared
    # /dev/shm, with the same pid in its own pid namespace) must survive the worker's death.
    def make(**kw) -> DataLoader:
        return DataLoader(RandomAugDataset(4 * N), batch_size=BS, generator=gen(), **kw)

    ref = [canonical(b) for b in make()]
    loader = make(num_workers=2)
    planted = None
    try:
        got = []
        for i, batch in enumerate(loader):
            got.append(canonical(batch))
            if i == 1:
                pid = loader.statistics().worker_pids[0]
                planted = f"/dev/shm/torch_{pid}_planted"
                with open(planted, "wb") as f:
                    f.write(b"not ours")
                kill_worker(loader, 0, signal.SIGKILL)
        assert got == ref
        assert loader.statistics().respawns == 1
        loader.close()
        with open(planted, "rb") as f:
            assert f.read() == b"not ours"
    finally:
        loader.close()
        if planted is not None and os.path.exists(planted):
            os.unlink(planted)


def test_respawn_storm_ends_in_a_clear_error(tmp_path) -> None:
    # Every sample kills its worker; with attempts effectively unlimited, only the storm
    # guard stops the loop.
    faults = {i: Fault("sigkill", attempts=None) for i in range(N)}
    loader = faulty_loader(tmp_path, faults, max_task_attempts=1000)
    with pytest.raises(WorkerCrashError, match="respawn storm"):
        list(loader)
    assert loader.state_dict()["consumed"] == 0  # the state still says what was consumed
    loader.close()


def test_sigchld_chains_to_the_previous_handler_and_restores_it(tmp_path) -> None:
    calls = []

    def previous(signum, frame):
        calls.append(signum)

    old = signal.signal(signal.SIGCHLD, previous)
    try:
        loader = faulty_loader(tmp_path, {10: Fault("sigkill")})
        assert [canonical(b) for b in loader] == reference()
        assert calls, "the handler installed before the loader was not called"
        assert signal.getsignal(signal.SIGCHLD) is previous, "the previous handler was not restored"
    finally:
        signal.signal(signal.SIGCHLD, old)


# ---- a worker's INIT_ERROR is read even when its exit is seen first ---------------------------
def _fail_init(worker_id: int) -> None:
    raise ValueError(f"init of worker {worker_id} is broken")


def test_worker_init_error_is_reported_even_when_the_exit_is_seen_first() -> None:
    """A worker sends INIT_ERROR and exits; if the main side only looks after the exit, it must
    still read the error (CI once saw "exited with code 0" and no cause here)."""
    loader = DataLoader(RandomAugDataset(8), batch_size=4, num_workers=1, worker_init_fn=_fail_init)
    sup = loader._make_supervisor(0)
    try:
        sup.start_all()
        slot = sup.slots[0]
        slot.proc.join(30)
        assert slot.proc.exitcode is not None, "the worker should have exited"
        events = sup.poll(0)
        dead = [e.report for e in events if isinstance(e, Died) and e.slot is slot]
        assert len(dead) == 1
        _pid, _code, cause, key, _was_ready = dead[0]
        assert (cause, key) == ("raised ValueError in worker_init_fn", "init_error")
        assert "init of worker 0 is broken" in str(slot.init_error.exception())
    finally:
        sup.shutdown()


# ---- the supervisor's own figures and invariants ---------------------------------------------
def test_supervisor_counts_starts_and_deaths_and_keeps_its_slot_invariants() -> None:
    loader = DataLoader(RandomAugDataset(8), batch_size=4, num_workers=2)
    sup = loader._make_supervisor(0)
    try:
        sup.start_all()
        sup.check_invariants()
        victim = sup.slots[0]
        victim.proc.kill()
        victim.proc.join(30)  # the process is gone; the supervisor has not looked yet
        died = []
        for _ in range(100):  # each poll waits for the sentinel, so this is bounded, not a spin
            died += [e for e in sup.poll(1.0) if isinstance(e, Died) and e.slot is victim]
            if died:
                break
        assert len(died) == 1 and died[0].report.key == "signal:SIGKILL"
        sup.check_invariants()  # a DEAD slot holds no process and no fd
        stats = sup.statistics()
        assert (stats.starts, stats.deaths, stats.killed) == (2, 1, 0)
        assert stats.pids[0] == -1 and stats.states[0] == "dead"
        sup.respawn(victim)
        sup.check_invariants()
        stats = sup.statistics()
        assert stats.starts == 3 and stats.states[0] in ("starting", "initializing", "ready")
        assert stats.pids[0] == victim.pid > 0
    finally:
        sup.shutdown()
    sup.check_invariants()
    assert sup.statistics().states == ("stopped", "stopped")


# ---- workers hung before their first task: in worker_init_fn, or while booting -----------------
class HangOnFirstStart:
    """A ``worker_init_fn`` that hangs the first worker start (a stuck network mount, say)."""

    def __init__(self, flag_dir: str) -> None:
        self.flag = os.path.join(flag_dir, "started")

    def __call__(self, worker_id: int) -> None:
        if not os.path.exists(self.flag):
            open(self.flag, "w").close()
            time.sleep(3600)


# A regression found by the fuzzers in fuzz/.
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_worker_hung_in_worker_init_fn_is_replaced_after_task_timeout(method: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        loader = DataLoader(
            RangeData(),
            batch_size=2,
            num_workers=1,
            multiprocessing_context=method,
            worker_init_fn=HangOnFirstStart(d),
            task_timeout=0.5,
            timeout=60,  # a watchdog for this test: raises instead of hanging
        )
        with loader:
            got = [b.tolist() for b in loader]
            stats = loader.statistics()
    assert got == [[0, 1], [2, 3]]
    assert stats.respawns_by_cause == {"hang": 1}


def _hang(worker_id: int) -> None:
    time.sleep(3600)


# A regression found by the fuzzers in fuzz/.
def test_worker_init_fn_hanging_every_time_is_a_start_failure_not_a_poison_sample() -> None:
    loader = DataLoader(
        RangeData(),
        batch_size=2,
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=_hang,
        task_timeout=0.3,
        timeout=60,
    )
    with pytest.raises(WorkerCrashError, match="failed to start 3 times") as info:
        list(loader)
    text = str(info.value)
    assert "hung in worker_init_fn (not ready after 0.3 s: task_timeout)" in text
    assert "raise task_timeout" in text
    assert "gave up on" not in text and "__main__" not in text


class HangWhileUnpickledFirst(RangeData):
    """Unpickling it hangs the first time: a worker stuck before it runs any of our code (an
    import from a stalled network filesystem, say)."""

    def __init__(self, flag_dir: str) -> None:
        self.flag = os.path.join(flag_dir, "unpickled")

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if not os.path.exists(self.flag):
            open(self.flag, "w").close()
            time.sleep(3600)


# A regression found by the fuzzers in fuzz/.
def test_worker_hung_while_booting_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    import resumable_loader.pipeline.supervisor.clocks as clocks

    # A spawn boot takes one to two seconds here; six leaves room on a loaded machine.
    monkeypatch.setattr(clocks, "BOOT_TIMEOUT_S", 6.0)
    with tempfile.TemporaryDirectory() as d:
        loader = DataLoader(
            HangWhileUnpickledFirst(d),
            batch_size=2,
            num_workers=1,
            multiprocessing_context="spawn",
            task_timeout=0.5,
            timeout=60,
        )
        with loader:
            got = [b.tolist() for b in loader]
            stats = loader.statistics()
    assert got == [[0, 1], [2, 3]]
    assert stats.respawns_by_cause == {"hang": 1}


# ---- starved workers: a loaded machine is not a hang (issue #31) --------------------------------
BUSY = 2_000_000  # sum(range(BUSY)): ~25 ms of CPU


class BusyRange(torch.utils.data.Dataset):
    """Map-style; item i is i, after ``sum(range(work))`` (a fixed amount of CPU work)."""

    def __init__(self, work: int) -> None:
        self.work = work

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        sum(range(self.work))
        return i


class PinTo:
    """A ``worker_init_fn`` that runs its worker on ``cpu`` only, then does ``sum(range(work))``
    (a start that needs some CPU: imports, opening files)."""

    def __init__(self, cpu: int, work: int) -> None:
        self.cpu, self.work = cpu, work

    def __call__(self, worker_id: int) -> None:
        os.sched_setaffinity(0, {self.cpu})
        sum(range(self.work))


def _busy_processes_on(cpu: int, n: int) -> list[subprocess.Popen]:
    """``n`` processes spinning on ``cpu`` (other jobs' work), returned once they spin there."""
    code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nprint('on', flush=True)\nwhile 1: pass"
    procs = [
        subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", code], stdout=subprocess.PIPE, text=True
        )
        for _ in range(n)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline() == "on\n"
    return procs


# A regression found by the fuzzers in fuzz/ (KillMachine on a loaded machine: 21 respawns
# without a result, every worker killed as hung while it waited for a CPU).
@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="no run-queue figures")
@pytest.mark.parametrize("busy", ["start", "batch"])
def test_a_worker_starved_of_cpu_is_not_killed_as_hung(busy: str) -> None:
    # The worker's start (worker_init_fn) or each batch takes ~50 ms of CPU; sharing its CPU
    # with eight busy processes, it takes ~0.5 s on the clock, more than task_timeout. The
    # worker is runnable all along: it is starved, not hung.
    cpu = min(os.sched_getaffinity(0))
    data_work, init_work = (0, 2 * BUSY) if busy == "start" else (BUSY, 0)
    ref = [b.tolist() for b in DataLoader(BusyRange(data_work), batch_size=2)]
    loader = DataLoader(
        BusyRange(data_work),
        batch_size=2,
        num_workers=1,
        multiprocessing_context="fork",
        worker_init_fn=PinTo(cpu, init_work),
        task_timeout=0.2,
        timeout=60,
    )
    hogs = _busy_processes_on(cpu, 8)
    try:
        got = [b.tolist() for b in loader]
        stats = loader.statistics()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
            assert hog.stdout is not None
            hog.stdout.close()
        loader.close()
    assert got == ref
    assert stats.respawns == 0, dict(stats.respawns_by_cause)


def test_a_respawn_storm_of_hangs_says_the_workers_were_killed_as_hung(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every task sleeps past task_timeout: the loader kills each worker it starts, and the
    # storm guard must say that it did so, not send the user looking for an OOM killer.
    import resumable_loader.pipeline.supervisor.supervisor as sup

    monkeypatch.setattr(sup, "STORM_MIN_RESPAWNS", 4)  # the default, 20, takes seconds here
    faults = {i: Fault("hang", attempts=None) for i in range(N)}
    loader = faulty_loader(tmp_path, faults, num_workers=1, task_timeout=0.2, max_task_attempts=100)
    with pytest.raises(WorkerCrashError, match="respawn storm") as info:
        list(loader)
    loader.close()
    text = str(info.value)
    assert "dying" not in text and "OOM" not in text
    assert "causes: hang x5" in text
    assert "killed the workers as hung" in text and "task_timeout=0.2 s" in text
    assert "raise task_timeout" in text


def test_a_task_that_keeps_hanging_is_poison_with_advice_about_task_timeout(tmp_path) -> None:
    # The worker is killed for task_timeout each time: the error must not guess at a crashing
    # decoder, and must name the remedy for a merely slow task.
    faults = {10: Fault("hang", attempts=None)}
    loader = faulty_loader(tmp_path, faults, task_timeout=0.2, max_task_attempts=2)
    with pytest.raises(WorkerCrashError, match="gave up on samples") as info:
        list(loader)
    loader.close()
    text = str(info.value)
    assert "hung (no result for 0.2 s: task_timeout)" in text
    assert "crashes its decoder" not in text
    assert "raise task_timeout" in text


# ---- blame, with real processes (the decision itself: test_recovery.py, test_dispatch.py) -------
@pytest.mark.parametrize("action", ["sigkill", "stop"])
def test_a_task_re_sent_to_a_dying_worker_is_not_blamed_for_its_death(tmp_path, action) -> None:
    # Sample 10 (task 2) crashes its worker twice, then loads; sample 14 (task 3, on the other
    # worker) crashes once. Task 2 was re-sent to the worker already running task 3; that
    # death was blamed on the lowest id held (2), so task 2 reached max_task_attempts=3 after
    # two real crashes and was given up as poison. (Found by tests/behaviour/test_crash_table.py.)
    from _datasets import RandomAugDataset

    from resumable_loader.testing import Fault, FaultyDataset, canonical

    gen = torch.Generator().manual_seed(42)
    ref = [canonical(b) for b in DataLoader(RandomAugDataset(24), batch_size=4, generator=gen)]
    faults = {10: Fault(action, attempts=frozenset({0, 1})), 14: Fault(action)}
    loader = DataLoader(
        FaultyDataset(RandomAugDataset(24), faults, tmp_path),
        batch_size=4,
        num_workers=2,
        generator=torch.Generator().manual_seed(42),
        multiprocessing_context="fork",
        task_timeout=1.0 if action == "stop" else None,
    )
    with loader:
        got = [canonical(b) for b in loader]
        assert loader.statistics().respawns == 3
    assert got == ref
