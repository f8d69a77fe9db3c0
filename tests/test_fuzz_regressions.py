"""Regressions found by the fuzzers in fuzz/, each shrunk to a minimal reproducer.

A test marked ``xfail(strict=True)`` is a bug not fixed yet: when the fix lands the test
passes, strict xfail turns that into a failure, and the marker must go (keep the test). The
fuzzers steer around these areas until then; each place that does so names the test here.

Everything is module-level (picklable) and uses the fork start method unless a test says.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _datasets import collect_torch_reference_garbage
from torch.utils.data import IterableDataset, get_worker_info

from resumable_loader import CheckpointError, DataLoader, RetryPolicy, WorkerCrashError
from resumable_loader.testing import worker_pids


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
        if self.pos == self.ds.flaky and not os.path.exists(self.ds.flag):
            open(self.ds.flag, "w").close()
            raise OSError("transient")
        self.pos += 1
        return self.pos - 1


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


class RangeData(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


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


class ShortSecondShard(IterableDataset):
    """Worker 0 yields 0..5; worker 1 yields only 100, after a pause -- with batch_size=2 its
    one batch is partial, so its shard is known to be drained when that batch arrives."""

    def __iter__(self):
        info = get_worker_info()
        if info is None or info.id == 0:
            yield from range(6)
        else:
            time.sleep(0.2)
            yield 100


def test_killing_a_drained_stream_worker_replays_nothing() -> None:
    # Tasks 0, 2 go to worker 0 and 1, 3 to worker 1 (prefetch 2). Task 1 brings worker 1's
    # partial, draining batch; task 3 (an END) is still outstanding when worker 1 is killed.
    # A race (the END must still be unread when the kill is seen): one try shows it about
    # two times in three, so up to 20 make it certain; the first failing try ends the test.
    for _ in range(20):
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


class PosState:
    """state_dict()/load_state_dict() of a cursor kept in ``self.pos``."""

    pos: int

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


class CursorOnDataset(PosState, IterableDataset):
    """Values 0..3; the cursor (the state) lives on the dataset object, as in many datasets."""

    def __init__(self, reached: Any = None) -> None:
        self.pos = 0
        self.reached = reached  # an Event set once the cursor has moved past item 1

    def __iter__(self):
        while self.pos < 4:
            self.pos += 1
            if self.pos == 2 and self.reached is not None:
                self.reached.set()
            yield self.pos - 1
        self.pos = 0


def test_load_state_into_persistent_workers_restarts_the_dataset() -> None:
    ctx = multiprocessing.get_context("fork")
    prefetched = ctx.Event()
    loader = DataLoader(
        CursorOnDataset(prefetched),
        batch_size=None,
        num_workers=1,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    with loader:
        it = iter(loader)
        # the worker prefetches items 0 and 1: its dataset's cursor is at 2
        assert prefetched.wait(30), "the worker never read item 1"
        del it
        loader.load_state_dict(loader.state_dict())  # epoch 0, nothing consumed
        assert list(loader) == [0, 1, 2, 3]  # got [2, 3]


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


class TwoItems(IterableDataset):
    def __iter__(self):
        return iter([0, 1])


def slow_pin(batch):
    time.sleep(0.2)
    return batch


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
    # The pin thread, without an accelerator (as in tests/test_supervisor.py); real
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


class _DrawingCursor(_Cursor):
    def __next__(self) -> tuple[int, int]:
        v = super().__next__()
        return v, random.randint(0, 10**9)  # a random augmentation, seeded per fetch


class DrawingCursorStream(CursorStream):
    """``CursorStream`` whose items also carry a draw from python's global RNG."""

    def __iter__(self) -> _DrawingCursor:
        return _DrawingCursor(self)


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


class HangOnFirstStart:
    """A ``worker_init_fn`` that hangs the first worker start (a stuck network mount, say)."""

    def __init__(self, flag_dir: str) -> None:
        self.flag = os.path.join(flag_dir, "started")

    def __call__(self, worker_id: int) -> None:
        if not os.path.exists(self.flag):
            open(self.flag, "w").close()
            time.sleep(3600)


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


def test_worker_hung_while_booting_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    import resumable_loader._supervisor as sup

    # A spawn boot takes one to two seconds here; six leaves room on a loaded machine.
    monkeypatch.setattr(sup, "BOOT_TIMEOUT_S", 6.0)
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


@pytest.mark.parametrize("entry", [None, 5, "ab"])
def test_malformed_skipped_entries_are_refused(entry: object) -> None:
    loader = DataLoader(RangeData(), batch_size=2)
    before = loader.state_dict()
    damaged = dict(before, skipped=[entry])
    with pytest.raises(CheckpointError, match="skipped"):
        loader.load_state_dict(damaged)
    assert loader.state_dict() == before


class SeqSamplerWithState(PosState, torch.utils.data.Sampler[int]):
    """0..n-1 in order; its state is the position (a user sampler with state_dict)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            yield self.pos - 1
        self.pos = 0


@pytest.mark.parametrize("indices", [None, [None], []])
def test_malformed_outstanding_indices_are_refused(indices: object) -> None:
    def make() -> DataLoader:
        return DataLoader(RangeData(), batch_size=2, sampler=SeqSamplerWithState(4))

    sd = make().state_dict()
    # As saved after drawing batch 0 ([0, 1]) and before consuming it -- with the batch damaged.
    damaged = dict(sd, drawn=1, sampler_state={"pos": 2}, outstanding=[[0, indices]])
    loader = make()
    with pytest.raises(CheckpointError, match="outstanding"):
        loader.load_state_dict(damaged)


# ---- the short soak ----------------------------------------------------------------------------
@pytest.mark.slow
def test_short_soak_loses_duplicates_changes_and_leaks_nothing() -> None:
    """fuzz/soak.py for 2,000 batches, a worker SIGKILLed every 50 (the full soak is 20,000).

    Here rather than in fuzz/ so that the suite's ``--run-slow`` applies without registering
    the option a second time from fuzz/conftest.py.
    """
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(root / "fuzz" / "soak.py"), "--batches", "2000", "--kill-every", "50"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lost 0, duplicated 0, changed 0" in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("format", np.array([1, 2])),
        ("version", torch.tensor([1, 1])),
        ("config.batch_size", np.array([2, 2])),
    ],
    ids=["format-ndarray", "version-tensor", "config-ndarray"],
)
def test_array_valued_fields_are_refused(field: str, value: object) -> None:
    loader = DataLoader(RangeData(), batch_size=2)
    sd = loader.state_dict()
    if field.startswith("config."):
        damaged = dict(sd, config=dict(sd["config"], **{field.split(".")[1]: value}))
    else:
        damaged = dict(sd, **{field: value})
    with pytest.raises(CheckpointError):
        loader.load_state_dict(damaged)


@pytest.mark.parametrize("key", ["outstanding", "delivered_ahead", "sampler_done"])
def test_state_missing_a_position_field_is_refused(key: str) -> None:
    if key == "delivered_ahead":
        # Batch 1 was delivered ahead of batch 0 (in_order=False); deleting the field would
        # deliver it again.
        loader = DataLoader(RangeData(), batch_size=1)
        damaged = dict(loader.state_dict(), delivered_ahead=[1])
    else:
        # Batch 0 ([0, 1]) was drawn from the sampler and not consumed; without 'outstanding'
        # it is lost.
        loader = DataLoader(RangeData(), batch_size=2, sampler=SeqSamplerWithState(4))
        damaged = dict(
            loader.state_dict(), drawn=1, sampler_state={"pos": 2}, outstanding=[[0, [0, 1]]]
        )
    loader.load_state_dict(dict(damaged))  # the intact state loads
    del damaged[key]
    with pytest.raises(CheckpointError, match=key):
        loader.load_state_dict(damaged)


class OneShotStateSampler(torch.utils.data.Sampler):
    """Yields 0..n-1 once per epoch; its state is (epoch, position), rewinding at the end."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.pos = n, 0, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            yield self.pos - 1
        self.pos, self.epoch = 0, self.epoch + 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.pos = sd["epoch"], sd["pos"]


def test_checkpoint_of_a_resumed_drawn_out_sampler_epoch_stays_drawn_out() -> None:
    # Found by KillMachine: resume a state whose sampler epoch was already drawn to the end,
    # checkpoint again before anything is drawn, resume that: the second state lost
    # sampler_done and the rewound sampler's next epoch leaked into this one.
    def make() -> DataLoader:
        return DataLoader(
            RangeData(),
            batch_size=None,
            sampler=OneShotStateSampler(1),
            num_workers=1,
            prefetch_factor=1,
            multiprocessing_context="fork",
        )

    first = make()
    with first:
        it1 = iter(first)  # kept: an iterator dropped at once would abandon its epoch
        sd = first.state_dict()
    assert sd["sampler_done"] and sd["outstanding"] == [[0, 0]]
    second = make()
    with second:
        second.load_state_dict(sd)
        it2 = iter(second)
        sd2 = second.state_dict()
    assert sd2["sampler_done"], "a resumed drawn-out epoch must stay drawn out"
    del it1, it2
    third = make()
    with third:
        third.load_state_dict(sd2)
        assert list(third) == [0]


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
        if any(item[0] == self.flaky for item in items) and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            raise OSError("transient, in collate")
        return [noise, *items]


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


class ShuffledAtIter(IterableDataset):
    """A plain stream that shuffles its shard when iter() is called (python's global RNG)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        order = list(range(wid, self.n, nw))
        random.shuffle(order)  # drawn in iter(), before the first fetch
        return iter(order)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_randomness_drawn_in_iter_is_the_same_after_a_resume(num_workers: int) -> None:
    # iter(dataset) ran before the per-fetch seeding, under whatever the RNGs held: a resumed
    # worker shuffled its shard differently from the uninterrupted run.
    from resumable_loader.testing import check_resume

    def make() -> DataLoader:
        return DataLoader(
            ShuffledAtIter(10),
            batch_size=2,
            num_workers=num_workers,
            multiprocessing_context="fork" if num_workers else None,
            persistent_workers=bool(num_workers),
            generator=torch.Generator().manual_seed(3),
        )

    def resumed() -> DataLoader:
        random.seed(999)  # another global state in the resuming process
        torch.manual_seed(999)
        return make()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fast-forward notice
        assert check_resume(make, make_resumed=resumed, epochs=2) > 0


class NumpyIndexSampler(SeqSamplerWithState):
    """A stateful sampler that yields numpy integers, as many real samplers do."""

    def __iter__(self):
        perm = np.random.RandomState(7).permutation(self.n)
        while self.pos < self.n:
            self.pos += 1
            yield perm[self.pos - 1]
        self.pos = 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_numpy_indices_from_a_sampler_make_a_plain_state(num_workers: int) -> None:
    from resumable_loader import dump_state, load_state
    from resumable_loader.testing import check_resume

    def make() -> DataLoader:
        return DataLoader(
            RangeData(),
            batch_size=1,
            sampler=NumpyIndexSampler(4),
            num_workers=num_workers,
            multiprocessing_context="fork" if num_workers else None,
        )

    loader = make()
    it = iter(loader)
    next(it)
    sd = loader.state_dict()
    loader.close()
    assert load_state(dump_state(sd)) == sd  # would raise CheckpointError on numpy.int64
    for via in ("torch", "json"):
        assert check_resume(make, via=via, epochs=1) > 0


class MyRandomSampler(torch.utils.data.RandomSampler):
    """A subclass: not torch's exact type, so it is fast-forwarded."""


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["subset", "weighted", "subclass"])
def test_samplers_drawing_from_the_global_rng_resume_under_another_seed(
    kind: str, num_workers: int
) -> None:
    # They drew from torch's global RNG, which the resuming process seeds differently: the
    # fast-forward replayed another order, and samples were repeated and skipped silently.
    from resumable_loader.testing import check_resume

    def make() -> DataLoader:
        sampler = {
            "subset": lambda: torch.utils.data.SubsetRandomSampler(range(12)),
            "weighted": lambda: torch.utils.data.WeightedRandomSampler(
                [1.0] * 12, 12, replacement=False
            ),
            "subclass": lambda: MyRandomSampler(range(12)),
        }[kind]()
        return DataLoader(
            list(range(12)),
            batch_size=3,
            sampler=sampler,
            num_workers=num_workers,
            multiprocessing_context="fork" if num_workers else None,
            generator=torch.Generator().manual_seed(1),
        )

    def resumed() -> DataLoader:
        torch.manual_seed(12345)
        return make()

    torch.manual_seed(0)
    assert check_resume(make, make_resumed=resumed, epochs=2) > 0


@pytest.mark.parametrize("action", ["sigkill", "stop"])
def test_a_task_re_sent_to_a_dying_worker_is_not_blamed_for_its_death(tmp_path, action) -> None:
    # Sample 10 (task 2) crashes its worker twice, then loads; sample 14 (task 3, on the other
    # worker) crashes once. Task 2 was re-sent to the worker already running task 3; that
    # death was blamed on the lowest id held (2), so task 2 reached max_task_attempts=3 after
    # two real crashes and was given up as poison. (Found by tests/test_crash_table.py.)
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
