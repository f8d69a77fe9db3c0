"""The ways a training loop really ends, each resumed and compared with an uninterrupted run.

Issue #9. A loop leaves the ``for`` by ``break``, ``itertools.islice``, an exception raised in
its body, ``KeyboardInterrupt`` (Ctrl-C lands in the body almost always), ``del it``, or by
reaching the end of the epoch; a checkpoint may also be taken inside the loop. The contract
(docs/guarantees.md, "Leaving the loop"), for the latest iterator of a loader:

* alive (between batches): ``state_dict()`` describes the batches it delivered so far;
* abandoned: it describes exactly what that iterator delivered (epoch E, k batches) until the
  next ``iter(loader)``; a new loader given that state continues with batch k of epoch E;
* finished (StopIteration): it describes the start of epoch E + 1.

``iter(loader)`` on the same loader after an abandoned epoch starts the next epoch (torch's
meaning); after ``load_state_dict()`` it continues the saved position instead. Non-persistent
workers go as soon as the iterator is dropped, and after any error the loader raised, dropping
the iterator and the loader ends every worker without the garbage collector.

The table: dataset (map-style with random augmentation; a stream whose cursor is on the
dataset; a stream whose state is on its iterator; a plain stream) x workers (0, 2, 2
persistent) x loop shape. Every stream item also carries draws from the python, numpy and
torch RNGs, so comparing batches compares values, not only indices. Each row runs the shape,
takes ``state_dict()`` after the loop (through ``torch.save`` in some rows), resumes it in a
fresh loader to the end of the following epoch, and checks that the same loader's next
``iter()`` is the reference's next epoch.

Two places where the contract leaves room: after the last batch but before StopIteration
docs/guarantees.md lets the state say either (E, all batches) or the start of E + 1 (both resume
the same stream; ``_expected_positions``); and the same loader's next epoch is not compared where
the dataset object itself keeps the stream's cursor in a process that outlives the epoch
(``_cursor_in_dataset``). ``test_preemption_recipe_...`` runs the preemption recipe
(docs/preemption.md), which takes the loop's epoch from the loader's state, so either answer
trains on the same batches.

The garbage collector is switched off in this module (never run): a reference cycle that keeps
workers alive must show up as workers still alive, not be hidden by a collection that happens
to run.
"""

from __future__ import annotations

import gc
import itertools
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import psutil
import pytest
import torch
from _datasets import RandomAugDataset
from _streams import IteratorStateShard, Shard, StatefulShard

from resumable_loader import DataLoader, WorkerCrashError
from resumable_loader.testing import (
    Fault,
    FaultyDataset,
    canonical,
    reference_stream,
    roundtrip_state,
)

pytestmark = pytest.mark.filterwarnings(
    # The plain stream is fast-forwarded on resume, by design; the warning says so.
    "ignore:resuming an iterable dataset without state_dict:RuntimeWarning"
)

EPOCHS = 3  # shapes run in epoch 0 or 1; a resume runs to the end of the following epoch
RELEASE_S = 10.0  # bound on waiting for the kernel to report that worker processes ended


@pytest.fixture(autouse=True)
def _no_automatic_gc() -> Iterator[None]:
    """No collection may run during a test (and none is ever requested)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# ---- the configurations -----------------------------------------------------------------------
def _dataset_kwargs(name: str) -> dict[str, Any]:
    if name == "map":
        return dict(dataset=RandomAugDataset(11), batch_size=2, shuffle=True)  # 6 batches
    if name == "stateful":
        return dict(dataset=StatefulShard(10), batch_size=2)  # cursor on the dataset
    if name == "stateful-iter":
        return dict(dataset=IteratorStateShard(10), batch_size=3)  # state on the iterator
    if name == "plain":
        return dict(dataset=Shard(10), batch_size=2)  # no state: fast-forwarded
    raise ValueError(name)


DATASETS = ["map", "stateful", "stateful-iter", "plain"]
WORKERS = {
    "w0": dict(num_workers=0),
    "w2": dict(num_workers=2),
    "w2-persistent": dict(num_workers=2, persistent_workers=True),
}


def _factory(dataset: str, workers: str) -> Callable[[], DataLoader[Any]]:
    def make() -> DataLoader[Any]:
        return DataLoader(
            generator=torch.Generator().manual_seed(2020),
            **_dataset_kwargs(dataset),
            **WORKERS[workers],
        )

    return make


@cache
def _reference(dataset: str, workers: str) -> tuple[tuple[Any, ...], ...]:
    ref = reference_stream(_factory(dataset, workers), epochs=EPOCHS)
    assert all(len(epoch) >= 4 for epoch in ref), [len(epoch) for epoch in ref]
    assert ref[0] != ref[1], "two epochs gave the same batches: values are not compared"
    return tuple(tuple(epoch) for epoch in ref)


def _position(sd: dict[str, Any]) -> tuple[int, int]:
    """(epoch, batches delivered in it) according to a state."""
    if "workers" in sd:  # a stream: each worker's delivered count
        return sd["epoch"], sum(w["delivered"] for w in sd["workers"])
    return sd["epoch"], sd["consumed"] + len(sd["delivered_ahead"])


def _expected_positions(e: int, k: int, n: int, finished: bool) -> set[tuple[int, int]]:
    """What a state may say after epoch ``e`` of ``n`` batches delivered ``k`` of them.

    After StopIteration: the start of epoch e + 1. Before it: (e, k) -- except that after the
    last batch (k == n) docs/guarantees.md lets the loader say "the start of epoch e + 1" when it
    knows the epoch is over; the stream resumed from either is the same (a resume from
    (e, n) yields an empty rest of epoch e first)."""
    if finished:
        return {(e + 1, 0)}
    if k == n:
        return {(e, k), (e + 1, 0)}
    return {(e, k)}


def _cursor_in_dataset(dataset: str, workers: str) -> bool:
    """The dataset object itself holds the stream's cursor, in a process that outlives the
    epoch (the main process with 0 workers, or persistent workers). After an abandoned epoch
    its next epoch starts wherever the cursor was left (prefetching moved it past what was
    consumed), exactly as with torch's DataLoader: the reference has no such epoch."""
    return dataset == "stateful" and workers != "w2"


# ---- helpers ----------------------------------------------------------------------------------
def _live_children() -> list[str]:
    """Our child processes (zombies included), not multiprocessing's own helpers."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                out.append(f"{child.pid} (zombie)")
                continue
            cmd = " ".join(child.cmdline())
        except psutil.ZombieProcess:
            out.append(f"{child.pid} (zombie)")
            continue
        except psutil.NoSuchProcess:
            continue
        if "forkserver" in cmd or "resource_tracker" in cmd or "torch_shm_manager" in cmd:
            continue  # long-lived helpers of multiprocessing and torch, not ours
        out.append(f"{child.pid} ({cmd[:80]})")
    return out


def _children_after_release() -> list[str]:
    """Our child processes still there after waiting (bounded) for them to end. Polls what the
    kernel reports; runs no collector and waits for no event of ours."""
    deadline = time.monotonic() + RELEASE_S
    while True:
        left = _live_children()
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.01)


def _epochs(loader: DataLoader[Any], first: int, last: int) -> list[list[Any]]:
    return [[canonical(b) for b in loader] for _ in range(first, last + 1)]


def _resume_and_compare(
    make: Callable[[], DataLoader[Any]],
    sd: dict[str, Any],
    ref: tuple[tuple[Any, ...], ...],
    last_epoch: int,
    via: str,
    where: str,
) -> None:
    """A new loader given ``sd`` continues at its position, to the end of ``last_epoch``."""
    epoch, k = _position(sd)
    resumed = make()
    try:
        resumed.load_state_dict(roundtrip_state(sd, via))
        got = _epochs(resumed, epoch, last_epoch)
    finally:
        resumed.close()
    expected = [list(ref[epoch][k:])] + [list(e) for e in ref[epoch + 1 : last_epoch + 1]]
    for i, (g, x) in enumerate(zip(got, expected)):
        if g != x:
            at = next((j for j, (a, b) in enumerate(zip(g, x)) if a != b), min(len(g), len(x)))
            raise AssertionError(
                f"{where}: resumed from (epoch {epoch}, {k} batches) via {via}: epoch "
                f"{epoch + i} differs from the uninterrupted run at batch {at} of what was "
                f"resumed: got {len(g)} batches, expected {len(x)}; got {g[at : at + 1]!r:.300} "
                f"expected {x[at : at + 1]!r:.300}"
            )


# ---- the loop shapes --------------------------------------------------------------------------
class TrainStepFailed(Exception):
    """What a training step raises (a NaN check, a CUDA OOM...)."""


LAST = -1  # k: every batch of the epoch, then leave before StopIteration


@dataclass(frozen=True)
class Shape:
    how: str  # break, islice, raise, interrupt, del, inside, end
    k: int | None  # batches delivered when the loop is left (inside: when the state is taken)
    epoch: int  # earlier epochs run to their end first, in the same loader
    via: str  # how the state is stored before the resume

    @property
    def finishes(self) -> bool:
        return self.how in ("inside", "end")

    @property
    def id(self) -> str:
        at = "" if self.k is None else "@last" if self.k == LAST else f"@{self.k}"
        return f"{self.how}{at}-e{self.epoch}-{self.via}"


SHAPES = [
    Shape("break", 1, 0, "dict"),
    Shape("break", 3, 1, "torch"),
    Shape("break", LAST, 0, "torch"),  # all delivered; StopIteration never seen
    Shape("islice", 0, 0, "dict"),  # iter() was called; nothing delivered
    Shape("islice", 2, 1, "torch"),
    Shape("raise", 2, 0, "torch"),  # an exception in the loop body
    Shape("interrupt", 3, 0, "dict"),  # KeyboardInterrupt in the loop body
    Shape("del", 0, 1, "torch"),
    Shape("del", 2, 0, "dict"),
    Shape("inside", 2, 0, "torch"),  # state taken inside the loop, which then runs on
    Shape("end", None, 0, "dict"),
    Shape("end", None, 1, "torch"),
]


def _leave(shape: Shape, loader: DataLoader[Any], k: int) -> tuple[list[Any], dict | None]:
    """Run one epoch's loop of ``shape``; what it got, and the state taken inside (if any)."""
    got: list[Any] = []
    inside = None
    if shape.how == "break":
        for batch in loader:
            got.append(canonical(batch))
            if len(got) == k:
                break
    elif shape.how == "islice":
        for batch in itertools.islice(loader, k):
            got.append(canonical(batch))
    elif shape.how in ("raise", "interrupt"):
        exc = TrainStepFailed if shape.how == "raise" else KeyboardInterrupt
        try:
            for batch in loader:
                got.append(canonical(batch))
                if len(got) == k:
                    raise exc(f"raised by the loop body after {k} batches")
        except exc:
            pass
        else:
            raise AssertionError(f"the epoch ended before batch {k}")
    elif shape.how == "del":
        it = iter(loader)
        for _ in range(k):
            got.append(canonical(next(it)))
        del it
    elif shape.how == "inside":
        for batch in loader:
            got.append(canonical(batch))
            if len(got) == k:
                inside = loader.state_dict()
    elif shape.how == "end":
        for batch in loader:
            got.append(canonical(batch))
    else:
        raise ValueError(shape.how)
    return got, inside


@pytest.mark.parametrize("shape", SHAPES, ids=[s.id for s in SHAPES])
@pytest.mark.parametrize("workers", list(WORKERS))
@pytest.mark.parametrize("dataset", DATASETS)
def test_loop_shape_resumes_exactly(dataset: str, workers: str, shape: Shape) -> None:
    make = _factory(dataset, workers)
    ref = _reference(dataset, workers)
    e = shape.epoch
    k = len(ref[e]) if shape.k in (None, LAST) else shape.k
    where = f"{dataset}/{workers}/{shape.id}"
    loader = make()
    try:
        for earlier in range(e):
            assert [canonical(b) for b in loader] == list(ref[earlier]), f"{where}: epoch {earlier}"
        got, inside = _leave(shape, loader, k)
        after = loader.state_dict()
        assert got == list(ref[e][: len(got)]), f"{where}: the loop got other batches"
        assert len(got) == (len(ref[e]) if shape.finishes else k), where
        expected_at = _expected_positions(e, k, len(ref[e]), shape.finishes)
        assert _position(after) in expected_at, (
            f"{where}: after leaving the loop state_dict() says (epoch, delivered) = "
            f"{_position(after)}, expected one of {sorted(expected_at)}"
        )
        if inside is not None:
            assert _position(inside) == (e, k), f"{where}: state taken inside the loop"
        if workers == "w2":
            left = _children_after_release()
            assert not left, f"{where}: workers still alive with no iterator: {left}"
            assert loader.statistics().workers_alive == 0, where
        # torch's meaning of iter(): the next epoch, also after an abandoned one
        if shape.finishes or not _cursor_in_dataset(dataset, workers):
            it = iter(loader)
            assert _position(loader.state_dict()) == (e + 1, 0), (
                f"{where}: after the next iter(), the state is {_position(loader.state_dict())}"
            )
            again = [canonical(b) for b in it]
            del it
            assert again == list(ref[e + 1]), (
                f"{where}: the same loader's next iter() is not epoch {e + 1}: got "
                f"{len(again)} batches, expected {len(ref[e + 1])}"
            )
    finally:
        loader.close()
    saved = inside if inside is not None else after
    _resume_and_compare(make, saved, ref, e + 1, shape.via, where)


# ---- the preemption recipe (docs/preemption.md), with the user's epoch counter ----------------
def _train(
    loader: DataLoader[Any], start_epoch: int, preempt_at: int | None
) -> tuple[list[tuple[int, Any]], int]:
    """The SIGTERM recipe of docs/preemption.md; the flag is set at a step count rather than by a
    signal (test_interrupts.py sends real ones). Returns (epoch, batch) trained on, and the epoch
    counter at the end."""
    trained: list[tuple[int, Any]] = []
    preempted = False
    epoch = start_epoch
    while epoch < EPOCHS and not preempted:
        for batch in loader:
            trained.append((epoch, canonical(batch)))
            if len(trained) == preempt_at:
                preempted = True  # the SIGTERM handler ran during this training step
            if preempted:
                break
        else:
            epoch += 1
    return trained, epoch


PREEMPT_AT: dict[str, Callable[[tuple[tuple[Any, ...], ...]], int]] = {
    "mid-epoch": lambda ref: 3,
    "after-the-last-batch": lambda ref: len(ref[0]),  # StopIteration not yet seen
    "after-the-first-batch-of-epoch-1": lambda ref: len(ref[0]) + 1,
}


# A loop with its own epoch counter, preempted after an epoch's last batch (before
# StopIteration), is left out on purpose: where the loader knows the epoch is over, its state
# is the next epoch's start (as torchdata's, and as Lightning needs), so such a loop would train
# one epoch more than it meant to. docs/preemption.md says to take the epoch from the loader's
# state.
COUNTER_POINTS = [
    (counter, point)
    for counter in ("epoch-from-loader-state", "own-epoch-counter")
    for point in PREEMPT_AT
    if not (counter == "own-epoch-counter" and point == "after-the-last-batch")
]


@pytest.mark.parametrize(("counter", "point"), COUNTER_POINTS)
@pytest.mark.parametrize("workers", ["w0", "w2"])
@pytest.mark.parametrize("dataset", DATASETS)
def test_preemption_recipe_trains_on_the_uninterrupted_stream(
    dataset: str, workers: str, point: str, counter: str
) -> None:
    """Preempted, saved after leaving the loop, resumed: the (epoch, batch) pairs trained on
    are the uninterrupted run's. The loop's epoch counter is either taken from the loader's
    state (what docs/preemption.md advises) or kept by the loop itself and saved beside the loader's
    state (what the recipe did before, and what torch users write)."""
    make = _factory(dataset, workers)
    ref = _reference(dataset, workers)
    uninterrupted = [(e, b) for e in range(EPOCHS) for b in ref[e]]
    at = PREEMPT_AT[point](ref)
    loader = make()
    try:
        first, epoch = _train(loader, 0, at)
        sd = roundtrip_state(loader.state_dict(), "torch")
    finally:
        loader.close()
    assert first == uninterrupted[:at]
    resumed = make()
    try:
        resumed.load_state_dict(sd)
        start = sd["epoch"] if counter == "epoch-from-loader-state" else epoch
        second, end = _train(resumed, start, None)
    finally:
        resumed.close()
    got = first + second
    if got != uninterrupted:
        i = next((i for i, (a, b) in enumerate(zip(got, uninterrupted)) if a != b), None)
        i = min(len(got), len(uninterrupted)) if i is None else i
        raise AssertionError(
            f"{dataset}/{workers}, preempted {point} (step {at}; the loop's epoch counter was "
            f"{epoch}, the state says epoch {sd['epoch']}), resumed at epoch {start}: trained "
            f"on {len(got)} batches, the uninterrupted run on {len(uninterrupted)}; first "
            f"difference at step {i}: got epoch/batch {got[i : i + 1]!r:.200}, expected "
            f"{uninterrupted[i : i + 1]!r:.200}"
        )
    assert end == EPOCHS


# ---- alive, abandoned, finished ---------------------------------------------------------------
@pytest.mark.parametrize("workers", list(WORKERS))
@pytest.mark.parametrize("dataset", DATASETS)
def test_alive_abandoned_and_finished_states_each_resume(dataset: str, workers: str) -> None:
    make = _factory(dataset, workers)
    ref = _reference(dataset, workers)
    where = f"{dataset}/{workers}"
    loader = make()
    try:
        it = iter(loader)
        got = [canonical(next(it)) for _ in range(2)]
        alive = loader.state_dict()
        assert _position(alive) == (0, 2), f"{where}: alive state {_position(alive)}"
        got.append(canonical(next(it)))  # state_dict() did not disturb the live iterator
        assert got == list(ref[0][:3]), where
        assert _position(loader.state_dict()) == (0, 3), where
        del it
        abandoned = loader.state_dict()
        assert _position(abandoned) == (0, 3), f"{where}: abandoned state {_position(abandoned)}"
        assert _position(loader.state_dict()) == (0, 3), f"{where}: the position must stay"
        if workers == "w2":
            left = _children_after_release()
            assert not left, f"{where}: workers kept alive by the held position: {left}"
        # load_state_dict() on the same loader: iter() continues the saved position
        loader.load_state_dict(roundtrip_state(abandoned, "torch"))
        rest = [canonical(b) for b in loader]
        assert got + rest == list(ref[0]), (
            f"{where}: iter() after load_state_dict() did not continue the saved position"
        )
        finished = loader.state_dict()
        assert _position(finished) == (1, 0), f"{where}: finished state {_position(finished)}"
        assert [canonical(b) for b in loader] == list(ref[1]), f"{where}: next epoch"
    finally:
        loader.close()
    _resume_and_compare(make, alive, ref, 1, "dict", f"{where} alive")
    _resume_and_compare(make, abandoned, ref, 1, "json", f"{where} abandoned")
    _resume_and_compare(make, finished, ref, 2, "bytes", f"{where} finished")


# ---- an exception raised by the dataset -------------------------------------------------------
BAD = 4  # the sample whose fetch raises
ERROR = ("error", "ValueError")


def _ids(batch: Any) -> list[int]:
    """The sample ids of a canonical RandomAugDataset batch."""
    tag, fields = batch
    assert tag == "dict"
    return list(dict(fields)["idx"][3])


def _collect(loader: DataLoader[Any]) -> list[Any]:
    """One epoch consumed as torch allows: a dataset error is recorded and iteration goes on."""
    out: list[Any] = []
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return out
        except ValueError:
            out.append(ERROR)
        else:
            out.append(canonical(batch))


def _raising_factory(workers: str, state_dir: Any) -> Callable[[], DataLoader[Any]]:
    def make() -> DataLoader[Any]:
        ds = FaultyDataset(RandomAugDataset(11), {BAD: Fault("raise", attempts=None)}, state_dir)
        return DataLoader(
            ds,
            batch_size=2,
            shuffle=True,
            generator=torch.Generator().manual_seed(2020),
            **WORKERS[workers],
        )

    return make


@pytest.mark.parametrize("workers", list(WORKERS))
def test_dataset_exception_is_consumed_like_torch(workers: str, tmp_path: Any) -> None:
    """The batch whose sample raised is used up: the iterator (and a resume) goes past it."""
    clean = _reference("map", workers)
    expected = [[ERROR if BAD in _ids(b) else b for b in epoch] for epoch in clean]
    bad_at = [next(i for i, b in enumerate(epoch) if b == ERROR) for epoch in expected]
    make = _raising_factory(workers, tmp_path)

    # The loop goes on after the error, as torch's iterator allows.
    loader = make()
    try:
        assert _collect(loader) == expected[0]
        assert _position(loader.state_dict()) == (1, 0)
    finally:
        loader.close()

    # The error ends the for loop (the usual case): the state is past the failed batch.
    loader = make()
    got: list[Any] = []
    try:
        try:
            for batch in loader:
                got.append(canonical(batch))
        except ValueError:
            pass
        else:
            raise AssertionError("the dataset's error was not raised")
        sd = loader.state_dict()
        assert got == expected[0][: bad_at[0]]
        # Past the failed batch -- the next epoch's start if that batch was the epoch's last.
        past = (0, bad_at[0] + 1) if bad_at[0] + 1 < len(expected[0]) else (1, 0)
        assert _position(sd) == past, (
            f"after the dataset error at batch {bad_at[0]}: state at {_position(sd)}"
        )
        assert _collect(loader) == expected[1], "the same loader's next iter()"
    finally:
        loader.close()
    resumed = make()
    try:
        resumed.load_state_dict(roundtrip_state(sd, "torch"))
        if past[0] == 0:
            rest = _collect(resumed)
            assert rest == expected[0][bad_at[0] + 1 :], "the resumed rest of epoch 0"
        assert _collect(resumed) == expected[1], "the resumed loader's epoch 1"
    finally:
        resumed.close()


# ---- after any error, dropping the iterator and the loader ends every worker, without gc ------
def _poison(state_dir: Any, persistent: bool) -> DataLoader[Any]:
    ds = FaultyDataset(RandomAugDataset(12), {5: Fault("sigkill", attempts=None)}, state_dir)
    return DataLoader(
        ds, batch_size=2, num_workers=2, persistent_workers=persistent, max_task_attempts=2
    )


def _raising(state_dir: Any, persistent: bool) -> DataLoader[Any]:
    ds = FaultyDataset(RandomAugDataset(12), {5: Fault("raise", attempts=None)}, state_dir)
    return DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=persistent)


def _hanging(state_dir: Any, persistent: bool) -> DataLoader[Any]:
    # Sample 5 never returns: torch's `timeout` gives up on its batch (and kills nothing).
    ds = FaultyDataset(RandomAugDataset(12), {5: Fault("hang", attempts=None)}, state_dir)
    return DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=persistent, timeout=0.5)


ERROR_CASES: dict[str, tuple[Callable[[Any, bool], DataLoader[Any]], type[BaseException]]] = {
    "poison": (_poison, WorkerCrashError),
    "dataset-exception": (_raising, ValueError),
    "timeout": (_hanging, RuntimeError),
}


@pytest.mark.parametrize("leave", ["next-then-del", "for-loop"])
@pytest.mark.parametrize("persistent", [False, True], ids=["w2", "w2-persistent"])
@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_after_an_error_del_ends_every_worker_without_gc(
    case: str, persistent: bool, leave: str, tmp_path: Any
) -> None:
    build, expected = ERROR_CASES[case]
    loader = build(tmp_path, persistent)
    loader_ref = weakref.ref(loader)
    raised = ""
    if leave == "next-then-del":
        it = iter(loader)
        it_ref = weakref.ref(it)
        try:
            for _ in range(20):
                next(it)
        except expected as exc:
            raised = type(exc).__name__  # the exception itself is not kept
        assert raised, f"{case}: no {expected.__name__} was raised"
        del it
    else:
        it_ref = None
        try:
            for _ in loader:
                pass
        except expected as exc:
            raised = type(exc).__name__
        assert raised, f"{case}: no {expected.__name__} was raised"
    del loader
    left = _children_after_release()
    if left:
        alive = [
            name
            for name, ref in (("the loader", loader_ref), ("the iterator", it_ref))
            if ref is not None and ref() is not None
        ]
        raise AssertionError(
            f"{case}: after {raised} and del, worker processes are still alive after "
            f"{RELEASE_S:.0f} s without a garbage collection: {left}; still referenced: "
            f"{', '.join(alive) or 'neither the loader nor the iterator'}"
        )


# ---- the pin thread holds the next batch when the state is taken ------------------------------
def _slow_pin(batch: Any) -> Any:
    # Pinning that takes a while (a large batch): while the caller gets batch k, the result of
    # batch k + 1 is already received and waits in the pin thread. Not a synchronisation: a
    # faster pin only makes the test less sensitive, never wrong.
    time.sleep(0.1)
    return batch


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dataset", ["stateful-iter", "plain"])
def test_state_taken_while_the_pin_thread_holds_the_next_batch(dataset: str, k: int) -> None:
    """Found by the fuzzer's abandon rule: a stream's state must name the worker of the next
    batch even when that batch is still in the pin thread (pin_memory=True with an
    accelerator; here the pin-thread path without one)."""

    def make(pin: bool) -> DataLoader[Any]:
        loader = DataLoader(
            generator=torch.Generator().manual_seed(3),
            num_workers=3,
            **_dataset_kwargs(dataset),
        )
        if pin:
            loader._force_pin_fn = _slow_pin  # the pin-thread path, without an accelerator
        return loader

    ref = reference_stream(lambda: make(False), epochs=1)[0]
    loader = make(True)
    try:
        it = iter(loader)
        got = [canonical(next(it)) for _ in range(k)]
        sd = loader.state_dict()
        del it
        assert _position(loader.state_dict()) == _position(sd) == (0, k)
    finally:
        loader.close()
    resumed = make(False)
    try:
        resumed.load_state_dict(sd)
        rest = [canonical(b) for b in resumed]
    finally:
        resumed.close()
    assert got == ref[:k]
    assert rest == ref[k:], (
        f"resumed after {k} batches (state's next_worker {sd.get('next_worker')}): the rest "
        f"differs from the uninterrupted run at batch "
        f"{next((i for i, (a, b) in enumerate(zip(rest, ref[k:])) if a != b), len(rest))}"
    )
