"""Memory (issue #16): a sent batch is freed at once, shared memory in use is bounded by the
prefetch window, and a full /dev/shm costs speed, never a batch.

How memory is seen: ``/proc/<pid>/maps`` lists every segment a process has mapped; torch's are
``/dev/shm/torch_*`` (the file_descriptor strategy unlinks them at once, so they read
"(deleted)"). A segment is identified by its (device, inode), so one mapped by a worker and by the
main process at the same moment counts once.

No test here calls ``gc.collect()``: a batch kept alive by a reference cycle is exactly what they
must see. The garbage collector is left enabled where users have it, and also switched off (in the
workers by their ``worker_init_fn``, in this process for the epoch) so that a cycle keeps its batch
for certain instead of until the collector happens to run.

A full /dev/shm is injected with ``testing.ShmFailure`` everywhere, and made for real -- a private
small tmpfs on /dev/shm in a mount namespace of its own -- where the machine permits it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _datasets import sharing_strategy
from torch.utils.data import Dataset, IterableDataset, default_collate, get_worker_info

from resumable_loader import DataLoader, RetryPolicy
from resumable_loader.pipeline import transport as _transport
from resumable_loader.pipeline.transport import policy as shm_policy
from resumable_loader.pipeline.transport import pools, reducers
from resumable_loader.testing import (
    ShmFailure,
    canonical,
    kill_worker,
    reference_stream,
    worker_pids,
)

# A sample of 128 KiB, a batch of 8: 1 MiB per batch, far above the 32 KiB copied inline, so
# every batch travels through /dev/shm -- and small enough for a few hundred batches to take a
# second or two on two cores.
FLOATS = 32 * 1024
BATCH = 8
EPOCH_BATCHES = 300
WORKERS = 2
PREFETCH = 2
WINDOW = WORKERS * PREFETCH  # tasks outstanding + results received and not yet released


def pool_bound(workers: int = WORKERS, prefetch: int = PREFETCH) -> int:
    """Segments alive at once under file_descriptor: the loader's pool (issue #26), the
    window's tasks and the batch the caller holds, whichever workers built them."""
    return workers * prefetch + 1


# ---- datasets (module level: picklable) ---------------------------------------------------------
def big_sample(i: int) -> torch.Tensor:
    """Sample i: the value i everywhere but one random draw, so a batch rebuilt with other
    random numbers would differ."""
    x = torch.full((FLOATS,), float(i))
    x[0] = torch.rand(())
    return x


class BigMap(Dataset):
    def __init__(self, n: int, slow_worker: int | None = None, delay_s: float = 0.0) -> None:
        self.n = n
        self.slow_worker = slow_worker
        self.delay_s = delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        if self.slow_worker is not None and info is not None and info.id == self.slow_worker:
            # The workload of a slow worker (a slow disk), not a synchronisation.
            time.sleep(self.delay_s)
        return big_sample(i)


class BigStream(IterableDataset):
    """Sharded by worker: worker w yields samples w, w + W, w + 2W, ..."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(wid, self.n, nw):
            yield big_sample(i)


def gc_off(worker_id: int) -> None:
    """worker_init_fn: no cycle collector in the worker, so a cycle keeps its batch for sure."""
    gc.disable()


def plain_stack(items: list[torch.Tensor]) -> torch.Tensor:
    """A custom collate_fn: its output is ordinary memory, moved to /dev/shm when sent."""
    return torch.stack(items)


def noisy_collate(items: list[torch.Tensor]) -> torch.Tensor:
    """A custom collate_fn that draws a random number *before* default_collate allocates (in
    /dev/shm, in a worker): redone after a failed allocation, it must draw the same number."""
    noise = torch.rand(())
    out = default_collate(items)
    out[:, 1] += noise
    return out


# Live weak references to the items this worker's dataset returned (see the retry test).
_ITEMS: list[weakref.ref[torch.Tensor]] = []


class ProbedMap(Dataset):
    """Records a weak reference to every item it reads; ``bad`` indices raise once read."""

    def __init__(self, n: int, bad: frozenset[int]) -> None:
        self.n = n
        self.bad = bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        x = big_sample(i)  # read, then found broken: the frame of the error refers to it
        _ITEMS.append(weakref.ref(x))
        if i in self.bad:
            raise ValueError(f"sample {i} is broken")
        return x


def probing_collate(items: list[torch.Tensor]) -> dict[str, Any]:
    """Collate, and count the items of *earlier* fetches still alive in this worker: with
    nothing holding them (no cycle), only this batch's own items are."""
    alive = sum(1 for r in _ITEMS if r() is not None)
    _ITEMS[:] = [r for r in _ITEMS if r() is not None]
    return {"x": torch.stack(items), "stale": alive - len(items)}


# ---- measuring ----------------------------------------------------------------------------------
def shm_segments(pid: int) -> set[tuple[str, str]]:
    """(device, inode) of each torch /dev/shm segment process ``pid`` has mapped."""
    out = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                # torch's named segments, or our workers' anonymous ones (memfd, _shm).
                if len(parts) == 6 and parts[5].startswith(
                    ("/dev/shm/torch_", "/memfd:resumable_loader")
                ):
                    out.add((parts[3], parts[4]))
    except (FileNotFoundError, ProcessLookupError):
        pass  # a worker that just died maps nothing
    return out


@contextlib.contextmanager
def collector(enabled: bool) -> Iterator[None]:
    """Switch this process's cycle collector on or off for the block (never run it)."""
    was = gc.isenabled()
    if enabled:
        gc.enable()
    else:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        else:
            gc.disable()


@pytest.fixture(scope="module")
def shm_manager() -> None:
    """Start torch's shm manager in this process before any leak-check baseline.

    Under the file_system strategy the main process connects to the shm manager of whoever
    allocated a segment, and torch keeps that socket open for the life of the process (its
    own DataLoader leaves the same two fds behind). A manager started here first is the one
    forked workers use, so those sockets exist before the baseline and are not counted. The
    manager is a child of this process, and exits with it.
    """
    with sharing_strategy("file_system"):
        torch.UntypedStorage._new_shared(64)


@pytest.fixture
def fresh_shm_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The full-/dev/shm warning is shown once per process: let this test see it again."""
    monkeypatch.setattr(shm_policy, "_shm_warned", False)


def make_loader(kind: str, n_batches: int, **kw: Any) -> DataLoader:
    n = n_batches * BATCH
    dataset = BigMap(n) if kind == "map" else BigStream(n)
    kw.setdefault("num_workers", WORKERS)
    kw.setdefault("prefetch_factor", PREFETCH)
    if kind == "map":
        kw.setdefault("shuffle", True)
    return DataLoader(dataset, batch_size=BATCH, generator=torch.Generator().manual_seed(16), **kw)


# ---- freed at once: the send path forms no cycle ------------------------------------------------
class _Reader(threading.Thread):
    """Reads ``n`` messages from a socket (the main side), so a large send cannot block."""

    def __init__(self, sock: socket.socket, n: int) -> None:
        super().__init__(name="test-reader", daemon=True)
        self.receiver = _transport.Receiver(sock)
        self.n = n
        self.msgs: list[Any] = []

    def run(self) -> None:
        import select

        while len(self.msgs) < self.n:
            select.select([self.receiver], [], [], 1.0)
            self.msgs.extend(self.receiver.feed())
            if self.receiver.eof:
                return


@pytest.mark.parametrize("shm", [True, False], ids=["shared", "copied-inline"])
def test_a_sent_batch_is_freed_by_reference_counting_alone(
    fresh_shm_warning: None, shm: bool
) -> None:
    """The pickler's memo refers to every object it pickled, so the pickler must die with the
    send: it once sat in a cycle (pickler -> dispatch table -> bound method -> pickler) and
    kept every batch -- and its /dev/shm segment -- until the collector ran."""
    ours, theirs = socket.socketpair()
    reader = _Reader(ours, 2)
    # Entered before the reader starts: it may decode (and warn) as soon as the bytes arrive.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reader.start()
        try:
            with collector(False):
                big = torch.rand(1 << 18)  # 1 MiB: an fd, or a copy in the payload
                small = torch.arange(10)  # inline
                alive = [weakref.ref(big), weakref.ref(small)]
                _transport.send(theirs, ("batch", {"big": big, "small": small}), None, shm)
                del big, small
                assert [r() is None for r in alive] == [True, True], "the sender holds the batch"
                _transport.send(theirs, ("end",))
                reader.join(30)
                assert not reader.is_alive()
                got = reader.msgs[0][1]["big"]
                got_ref = weakref.ref(got)
                assert got.shape == (1 << 18,)
                del got
                reader.msgs.clear()
                assert got_ref() is None, "the receiving side still holds the batch"
        finally:
            theirs.close()
            reader.join(30)
            reader.receiver.close()
    # A batch copied for want of shared memory is said once (the main side's warning).
    assert len(caught) == (0 if shm else 1), [str(w.message) for w in caught]


def test_shm_exhaustion_is_recognised_from_torchs_error_and_nothing_else() -> None:
    full = RuntimeError(
        "unable to allocate shared memory(shm) for file </torch_3415_2256211144_1>: "
        "No space left on device (28)"
    )
    assert _transport.shm_exhausted(full)
    assert _transport.shm_exhausted(OSError(28, "No space left on device", "/dev/shm/x"))
    # A full disk under the dataset, or another torch error, is not /dev/shm.
    assert not _transport.shm_exhausted(OSError(28, "No space left on device", "/data/x"))
    assert not _transport.shm_exhausted(RuntimeError("No space left on device"))
    assert not _transport.shm_exhausted(RuntimeError("unable to mmap 4096 bytes from file <x>"))
    assert not _transport.shm_exhausted(ValueError(str(full)))


def test_a_worker_backs_off_from_a_full_shm_and_returns_when_it_has_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    free = [10 << 30]
    monkeypatch.setattr(shm_policy, "_shm_free", lambda: free[0])
    policy = _transport.ShmPolicy()
    full = RuntimeError(
        "unable to allocate shared memory(shm) for file </torch_1>: No space left on device (28)"
    )

    def batch(shared: int = 0, fallback: int = 0) -> None:
        out = reducers.Outbox([], True, policy)
        out.shared_bytes, out.fallback_bytes = shared, fallback
        policy.sent(out)

    MiB = 1 << 20
    assert policy.allow() and policy.note is None
    batch(shared=MiB)
    # Failures in a row: skip 1, then 2, then 4 batches before trying again.
    schedule = []
    for _ in range(3):
        assert policy.allow()
        policy.failed(full)
        batch(fallback=MiB)
        skipped = 0
        while not policy.allow():
            skipped += 1
            batch(fallback=MiB)
        schedule.append(skipped)
    assert schedule == [1, 2, 4]
    assert policy.note is not None and "No space left" in policy.note.reason
    # A batch through /dev/shm again ends the backoff: the next failure skips one batch.
    batch(shared=MiB)
    assert policy.allow()
    policy.failed(full)
    batch(fallback=MiB)
    assert not policy.allow()
    batch(fallback=MiB)
    # Less room than the last batch needed: not even tried, and no backoff grows from it.
    assert policy.allow()
    batch(shared=MiB)
    free[0] = MiB - 1
    assert not policy.allow() and "free" in policy.note.reason
    batch(fallback=MiB)
    free[0] = 2 * MiB
    assert policy.allow()


def torch_shm_names() -> set[str]:
    return {x for x in os.listdir("/dev/shm") if x.startswith("torch_")}


@pytest.mark.parametrize("how", ["left-unread", "cut-short"])
def test_a_message_that_never_arrives_gives_its_file_system_segments_back(
    shm_manager: None, how: str
) -> None:
    """Under file_system, pickling a storage takes a reference on its named segment for the
    receiver, and only unpickling gives it back. A message left in the socket when the channel
    closes is decoded and dropped; one whose send fails returns the reference itself.
    Otherwise the name would stay in /dev/shm until the shm manager exits with the run."""
    before = torch_shm_names()
    ours, theirs = socket.socketpair()
    receiver = _transport.Receiver(ours)
    try:
        with sharing_strategy("file_system"):
            big = torch.rand(1 << 18)  # 1 MiB: shared by name
            if how == "cut-short":
                receiver.close()
                with pytest.raises((BrokenPipeError, ConnectionResetError)):
                    _transport.send(theirs, ("batch", big))
            else:
                _transport.send(theirs, ("batch", big))
                assert torch_shm_names() - before, "the batch should be in /dev/shm by name"
            del big
            receiver.close()  # (again, for cut-short: closing twice is allowed)
        assert torch_shm_names() - before == set()
    finally:
        theirs.close()
        receiver.close()


# The matrix: map-style and stream x pin thread or not x both sharing strategies, with the
# collector off (a cycle then keeps every batch: the test fails for sure); and the collector on,
# as users have it, on two corners.
MATRIX = [
    pytest.param(kind, pin, strategy, False, id=f"{kind}-{'pin' if pin else 'nopin'}-{strategy}")
    for kind in ("map", "stream")
    for pin in (False, True)
    for strategy in ("file_descriptor", "file_system")
] + [
    pytest.param("map", False, "file_descriptor", True, id="map-nopin-file_descriptor-gc_on"),
    pytest.param("stream", True, "file_system", True, id="stream-pin-file_system-gc_on"),
]


@pytest.mark.parametrize("kind, pin, strategy, gc_on", MATRIX)
def test_each_process_maps_a_bounded_number_of_segments_all_epoch(
    shm_manager: None, kind: str, pin: bool, strategy: str, gc_on: bool
) -> None:
    """Under file_system, a worker maps at most the one batch it is building; the main process,
    once the caller has dropped its batch, at most the results in the prefetch window -- over
    300 batches. Under file_descriptor, batches travel in pooled segments, reused: the
    segments ever created over the epoch, anywhere, stay within the pools (a batch never
    given back would make its worker create new ones)."""
    with sharing_strategy(strategy), collector(gc_on):
        loader = make_loader(kind, EPOCH_BATCHES, worker_init_fn=None if gc_on else gc_off)
        if pin:
            # The pin thread without an accelerator; returning the batch itself keeps the
            # shared storage alive through the pin stage, so a reference held there would show.
            loader._force_pin_fn = lambda batch: batch
        most_worker = most_main = batches = 0
        ever: set[tuple[str, str]] = set()
        try:
            base = shm_segments(os.getpid())
            for batch in loader:
                batches += 1
                assert batch.shape == (BATCH, FLOATS)
                for pid in worker_pids(loader):
                    if pid > 0:
                        # (less what a forked worker inherited from this process at its start)
                        mine = shm_segments(pid) - base
                        most_worker = max(most_worker, len(mine))
                        ever |= mine
                del batch
                main = shm_segments(os.getpid()) - base
                most_main = max(most_main, len(main))
                ever |= main
        finally:
            loader.close()
    assert batches == EPOCH_BATCHES
    if strategy == "file_system":
        assert most_worker <= 1, f"a worker had {most_worker} segments mapped (a batch not freed)"
        assert most_main <= WINDOW, f"the main process had {most_main} segments mapped"
    else:
        # (a pool, and the fresh segment of a batch that finds every pooled one lent)
        # (a worker maps the pool's segments it was lent, and the fresh segment of a batch
        # whose granted one the caller still held)
        assert most_worker <= pool_bound() + 1, f"a worker had {most_worker} segments mapped"
        assert len(ever) <= pool_bound(), f"{len(ever)} segments created in one epoch"


@pytest.mark.parametrize("recovery", [False, True], ids=["steady", "worker-killed"])
def test_segments_in_flight_stay_within_the_window_while_a_slow_worker_holds_back_results(
    recovery: bool,
) -> None:
    """Worker 0 is slow, so worker 1's results wait in the reorder buffer: all the segments
    mapped anywhere stay within prefetch_factor x num_workers, plus the batch the caller
    holds -- also after worker 1 is killed and its tasks are sent again."""
    prefetch = 3
    window = prefetch * WORKERS
    n_batches = 48
    loader = DataLoader(
        BigMap(n_batches * BATCH, slow_worker=0, delay_s=0.004),
        batch_size=BATCH,
        num_workers=WORKERS,
        prefetch_factor=prefetch,
        worker_init_fn=gc_off,
    )
    most_total = most_main = most_inherited = batches = 0
    ever_main: set[tuple[str, str]] = set()
    try:
        with collector(False):
            me = os.getpid()
            base = shm_segments(me)
            for batch in loader:
                batches += 1
                pids = [p for p in worker_pids(loader) if p > 0]
                main_now = shm_segments(me) - base
                ever_main |= main_now
                workers = set().union(*(shm_segments(p) for p in pids)) - base
                # A worker respawned by fork inherits what this process had mapped at that
                # moment, and keeps it mapped for its life (see the report of issue #16); a
                # worker never maps a received batch otherwise.
                inherited = (workers - main_now) & ever_main
                # The caller holds `batch`; every other segment is a task or result in flight.
                most_total = max(most_total, len((workers - inherited) | main_now))
                most_inherited = max(most_inherited, len(inherited))
                del batch
                most_main = max(most_main, len(shm_segments(me) - base))
                if recovery and batches == n_batches // 2:
                    kill_worker(loader, 1, signal.SIGKILL)
            stats = loader.statistics()
    finally:
        loader.close()
    assert batches == n_batches
    if recovery:
        assert stats.respawns == 1
    # Slack 0: the dispatcher refills the window only when the caller takes a batch, and a
    # worker builds only a task already counted in it, so this snapshot cannot run ahead.
    print(
        f"most segments: in flight {most_total}, in the main process {most_main}, "
        f"inherited by a respawned worker {most_inherited}"
    )
    bound = pool_bound(WORKERS, prefetch)
    assert most_total <= bound, f"{most_total} segments in flight, window {window}, bound {bound}"
    # Inherited mappings are at most what this process held when the worker was forked;
    # without a respawn there are none (1: a worker seen between sending a batch and dropping
    # it, after this process already released it -- a race, not a leak).
    assert most_inherited <= (bound if recovery else 1)
    # The case under test happened: results waited in the main process, behind worker 0.
    assert most_main >= 2, "no result ever waited in the reorder buffer: the test proves nothing"


@pytest.mark.parametrize("retry", [False, True], ids=["no-retry", "retry-policy"])
def test_a_failed_fetch_leaves_nothing_alive(retry: bool) -> None:
    """An error's traceback refers to the frames it came through, and they to what the fetch
    had read. Under a RetryPolicy, tenacity keeps the last error in its retry state, which its
    own frames in that traceback refer to: a cycle that kept those items until the collector
    ran. Without one, the error is dropped once reported."""
    bad = frozenset({17, 41})
    loader = DataLoader(
        ProbedMap(64, bad),
        batch_size=4,
        num_workers=1,
        collate_fn=probing_collate,
        worker_init_fn=gc_off,
        retry=RetryPolicy(exceptions=(ValueError,), attempts=2, backoff_s=0) if retry else None,
    )
    stale, errors = [], 0
    try:
        it = iter(loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                break
            except ValueError:
                errors += 1  # the broken samples' batches, after their retries
                continue
            stale.append(batch["stale"])
    finally:
        loader.close()
    assert errors == len(bad)
    assert len(stale) == 16 - len(bad)
    assert set(stale) == {0}, f"items of earlier fetches still alive in the worker: {stale}"


KILL_UNDER_FILE_SYSTEM = textwrap.dedent(
    """
    import signal, torch
    torch.multiprocessing.set_sharing_strategy("file_system")
    torch.UntypedStorage._new_shared(64)  # this process's shm manager, for the workers
    from torch.utils.data import Dataset
    from resumable_loader import DataLoader
    from resumable_loader.testing import kill_worker

    class Big(Dataset):
        def __len__(self):
            return 640
        def __getitem__(self, i):
            return torch.full((32768,), float(i))

    loader = DataLoader(Big(), batch_size=8, num_workers=2)
    held, n = [], 0
    for batch in loader:
        n += 1
        held = [*held[-2:], batch]  # the caller keeps its last batches, from both workers
        del batch
        if n % 20 == 0:
            kill_worker(loader, n // 20 % 2, signal.SIGKILL)
    held.clear()
    loader.close()
    print("completed", n)
    """
)


def test_a_killed_worker_under_file_system_does_not_abort_the_main_process(
    tmp_path: Path,
) -> None:
    script = tmp_path / "kill_fs.py"
    script.write_text(KILL_UNDER_FILE_SYSTEM)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "completed 80" in proc.stdout


# ---- a full /dev/shm: injected ------------------------------------------------------------------
FALLBACK_CASES = [
    # default_collate cannot allocate its output in /dev/shm (what a small /dev/shm does first)
    pytest.param("map", "alloc", None, "file_descriptor", 1, id="map-collate-fd"),
    pytest.param("stream", "alloc", None, "file_descriptor", 1, id="stream-collate-fd"),
    pytest.param("map", "alloc", None, "file_system", 3, id="map-collate-fs-every3"),
    pytest.param("stream", "alloc", None, "file_system", 2, id="stream-collate-fs-every2"),
    # a custom collate's ordinary storage cannot be moved into /dev/shm to be sent
    pytest.param("map", "share", plain_stack, "file_descriptor", 1, id="map-send-fd"),
    pytest.param("stream", "share", plain_stack, "file_system", 2, id="stream-send-fs-every2"),
    # a custom collate drawing random numbers before its allocation fails: redone, same draws
    pytest.param("map", "alloc", noisy_collate, "file_descriptor", 2, id="map-noisy-collate"),
    pytest.param("stream", "alloc", noisy_collate, "file_descriptor", 2, id="stream-noisy-collate"),
]


@pytest.mark.parametrize("kind, where, collate, strategy, every", FALLBACK_CASES)
def test_a_full_shm_costs_speed_never_a_batch(
    shm_manager: None,
    fresh_shm_warning: None,
    kind: str,
    where: str,
    collate: Any,
    strategy: str,
    every: int,
) -> None:
    """Batches that cannot get shared memory come through the socket instead: the stream is the
    uninterrupted run's, nothing is blamed on a sample (max_task_attempts=1 would end the run at
    the first "crash"), and one warning says what happened and what to do."""
    n_batches = 24
    extra = {"collate_fn": collate} if collate is not None else {}
    with sharing_strategy(strategy):
        reference = reference_stream(lambda: make_loader(kind, n_batches, **extra))[0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = make_loader(
                kind,
                n_batches,
                worker_init_fn=ShmFailure(where=where, every=every),
                max_task_attempts=1,
                **extra,
            )
            try:
                got = [canonical(b) for b in loader]
                stats = loader.statistics()
            finally:
                loader.close()
    assert len(got) == n_batches
    assert got == reference, "a batch sent without shared memory differs from the reference"
    assert stats.respawns == 0 and stats.resent_tasks == 0
    shm_warnings = [w for w in caught if "shared memory" in str(w.message)]
    assert len(shm_warnings) == 1, [str(w.message) for w in caught]
    assert shm_warnings[0].category is RuntimeWarning
    text = str(shm_warnings[0].message)
    # Its numbers (the batch, /dev/shm's size and use) and what to do.
    assert "a batch of 1.0 MiB" in text and "/dev/shm is " in text and "in use" in text
    for remedy in ("--shm-size", "--ipc=host", "num_workers", "prefetch_factor"):
        assert remedy in text, remedy


def test_the_warning_is_shown_once_per_process(fresh_shm_warning: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            loader = make_loader("map", 6, worker_init_fn=ShmFailure())
            try:
                assert len(list(loader)) == 6
            finally:
                loader.close()
    assert len([w for w in caught if "shared memory" in str(w.message)]) == 1


def test_a_warning_turned_into_an_error_does_not_lose_the_batch(
    fresh_shm_warning: None, capfd: pytest.CaptureFixture[str]
) -> None:
    """Raised inside the receiving of a message, the warning would count as a broken worker:
    it is printed instead, and the batch arrives."""
    reference = reference_stream(lambda: make_loader("map", 6))[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = make_loader("map", 6, worker_init_fn=ShmFailure(), max_task_attempts=1)
        try:
            got = [canonical(b) for b in loader]
            stats = loader.statistics()
        finally:
            loader.close()
    assert got == reference and stats.respawns == 0
    assert "RuntimeWarning: DataLoader: a batch of" in capfd.readouterr().err


# ---- a full /dev/shm: for real ------------------------------------------------------------------
# Run in a mount namespace of its own, on a private tmpfs of the given size on /dev/shm: the
# machine's /dev/shm is not touched, and the namespace (with anything left in it) ends with the
# child. Batches are compared with a run of num_workers=0 (which needs no /dev/shm) by digest.
REAL_SHM_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys, warnings
    import torch
    from torch.utils.data import Dataset
    from resumable_loader import DataLoader

    mib, n_batches = float(sys.argv[1]), int(sys.argv[2])
    floats = int(mib * 2**20 / 4 / 32)

    class Images(Dataset):
        def __len__(self):
            return 32 * n_batches
        def __getitem__(self, i):
            x = torch.full((floats,), float(i))
            x[:4] = torch.rand(4)
            return x

    def digests(num_workers):
        loader = DataLoader(Images(), batch_size=32, shuffle=True, num_workers=num_workers,
                            generator=torch.Generator().manual_seed(3), max_task_attempts=1)
        try:
            out = [hashlib.sha1(b.numpy().tobytes()).hexdigest() for b in loader]
            return out, (loader.statistics().respawns if num_workers else 0)
        finally:
            loader.close()

    reference, _ = digests(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, respawns = digests(2)
    print(json.dumps({
        "same": got == reference, "batches": len(got), "respawns": respawns,
        "warnings": [str(w.message) for w in caught if "shared memory" in str(w.message)],
    }))
    """
)


def _private_shm_permitted() -> str | None:
    """None if this machine lets us mount a private tmpfs on /dev/shm, else why not."""
    if sys.platform != "linux":
        return "Linux only"
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return f"cannot mount a private tmpfs on /dev/shm: {probe.stderr.strip()!r}"
    return None


def run_in_small_shm(tmp_path: Path, shm_mib: int, batch_mib: float, n_batches: int) -> dict:
    import json

    why = _private_shm_permitted()
    if why is not None:
        pytest.skip(why)
    script = tmp_path / "small_shm.py"
    script.write_text(REAL_SHM_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = (
        f"mount -t tmpfs -o size={shm_mib}m tmpfs /dev/shm && "
        f'exec "{sys.executable}" "{script}" {batch_mib} {n_batches}'
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, env=env, timeout=280
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "shm_mib, batch_mib, n_batches, expect_warning",
    [
        # 256 MiB (a common container setting) holds the window of 18 MiB batches with room to
        # spare: before the fix, leaked batches filled it after 12 of them.
        pytest.param(256, 18.4, 40, False, id="18MiB-batches-in-256MiB"),
        # Docker's default 64 MiB holds one 37 MiB batch. Workers' batches are anonymous
        # memory (memfd), which a small /dev/shm does not bound: the epoch goes through shared
        # memory, with no warning. (A failed shared allocation -- the inline path and its
        # warning -- is driven by testing.ShmFailure in the tests above.)
        pytest.param(64, 37.0, 16, False, marks=pytest.mark.slow, id="37MiB-batches-in-64MiB"),
    ],
)
def test_an_epoch_completes_in_a_small_real_shm(
    tmp_path: Path, shm_mib: int, batch_mib: float, n_batches: int, expect_warning: bool
) -> None:
    result = run_in_small_shm(tmp_path, shm_mib, batch_mib, n_batches)
    assert result["batches"] == n_batches
    assert result["same"], "the batches differ from the uninterrupted run's"
    assert result["respawns"] == 0, "a worker died (SIGBUS, or shm failure taken for a crash)"
    assert len(result["warnings"]) == (1 if expect_warning else 0), result["warnings"]
    if expect_warning:
        assert f"/dev/shm is {shm_mib:.1f} MiB" in result["warnings"][0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "shm_mib, batch_mib",
    [pytest.param(256, 18.4, id="18MiB-in-256MiB"), pytest.param(64, 37.0, id="37MiB-in-64MiB")],
)
def test_a_long_epoch_completes_in_a_small_real_shm(
    tmp_path: Path, shm_mib: int, batch_mib: float
) -> None:
    """The issue's own runs: 300 batches."""
    result = run_in_small_shm(tmp_path, shm_mib, batch_mib, 300)
    assert result["batches"] == 300 and result["same"] and result["respawns"] == 0


# ---- the segment pool (issue #26) ---------------------------------------------------------------
MiB = 1 << 20


@pytest.fixture
def worker_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[_transport.ShmPolicy]:
    """This process plays a worker with a pool of 2 segments (restored afterwards)."""
    monkeypatch.setattr(pools, "_worker_pool", None)
    policy = _transport.ShmPolicy(pool_segments=2)
    with sharing_strategy("file_descriptor"):
        yield policy
    policy.pool = pools._worker_pool = None  # its segments' fds close with it


def test_a_pooled_segment_is_reused_only_once_the_batch_in_it_is_dropped(
    worker_pool: _transport.ShmPolicy,
) -> None:
    """Each batch is collated into a free pooled segment; one whose batch the receiver still
    holds is never written again, and is reused as soon as the batch is dropped."""
    policy = worker_pool
    ours, theirs = socket.socketpair()
    receiver = _transport.Receiver(ours)

    def send(value: int) -> torch.Tensor:
        policy.allow()
        with _transport.collating():  # what torch's collate does in a worker
            storage = torch.UntypedStorage._new_shared(MiB)
        batch = torch.empty(0, dtype=torch.uint8).set_(storage).fill_(value)
        _transport.send(theirs, ("batch", batch), policy)
        del batch, storage
        (msg,) = receiver.feed()
        return msg[1]  # type: ignore[no-any-return]

    try:
        first = send(1)  # a fresh segment: the worker learns the size of its batches
        assert policy.pool is not None and not policy.pool.segments
        second = send(2)  # the pool's first segment
        third = send(3)  # the first is held: a second one
        fourth = send(4)  # both held, the pool is full: a fresh segment
        assert sorted(policy.pool.segments) == [0, 1]
        for held, value in ((first, 1), (second, 2), (third, 3), (fourth, 4)):
            assert bool((held == value).all()), f"held batch {value} was overwritten"
        where = second.data_ptr()
        del second  # its segment goes back to the worker ...
        fifth = send(5)
        assert fifth.data_ptr() == where, "... and is the one reused"
        assert policy.pool.next_id == 2, "no segment was created for it"
        for held, value in ((first, 1), (third, 3), (fourth, 4), (fifth, 5)):
            assert bool((held == value).all()), f"held batch {value} was overwritten"
        del first, third, fourth, fifth
    finally:
        theirs.close()
        receiver.close()


def test_pooled_segments_are_unmapped_at_close_or_when_the_last_held_batch_goes(
    worker_pool: _transport.ShmPolicy,
) -> None:
    """The main process maps each pooled segment once; closing the channel unmaps them, except
    one a held batch lies in, which goes with that batch -- no collector involved."""
    policy = worker_pool
    ours, theirs = socket.socketpair()
    receiver = _transport.Receiver(ours)
    me = os.getpid()
    with collector(False):
        base = shm_segments(me)
        try:
            held = []
            for _ in range(4):
                policy.allow()
                with _transport.collating():
                    storage = torch.UntypedStorage._new_shared(MiB)
                _transport.send(theirs, torch.empty(0, dtype=torch.uint8).set_(storage), policy)
                del storage
                held += receiver.feed()
            keep = held[-1][:10]  # a view keeps its batch's segment
            del held
        finally:
            theirs.close()
            receiver.close()
        policy.pool = None  # (the worker's side: its process would exit)
        pools._worker_pool = None
        mapped = shm_segments(me) - base
        assert len(mapped) == 1, f"{len(mapped)} segments still mapped, 1 expected"
        del keep
        assert shm_segments(me) - base == set(), "the last held batch's segment stayed mapped"


class KillMidWrite:
    """A collate_fn that, in the first incarnation of the worker given task ``victim``,
    scribbles over half the batch it collated into its pooled segment and SIGKILLs itself."""

    def __init__(self, victim_first_index: int, marker: str) -> None:
        self.victim = victim_first_index
        self.marker = marker

    def __call__(self, items: list[torch.Tensor]) -> torch.Tensor:
        batch = default_collate(items)
        if int(batch[0, 1]) == self.victim and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            batch[: len(batch) // 2] = -1.0
            os.kill(os.getpid(), signal.SIGKILL)
        return batch


def test_a_worker_killed_while_writing_a_pooled_segment_delivers_nothing_of_it(
    tmp_path: Path,
) -> None:
    """A worker SIGKILLed after writing half a batch into its pooled segment: the respawned
    worker sends the batch again, whole; every batch -- those the caller holds included --
    equals the uninterrupted run's."""
    n_batches = 12
    victim = 6 * BATCH  # (not shuffled: batch 6 starts with this index)
    reference = reference_stream(lambda: make_loader("map", n_batches, shuffle=False))[0]
    loader = make_loader(
        "map",
        n_batches,
        shuffle=False,
        collate_fn=KillMidWrite(victim, str(tmp_path / "killed")),
    )
    try:
        held = list(loader)  # every batch held to the end: none may be overwritten
        stats = loader.statistics()
    finally:
        loader.close()
    assert (tmp_path / "killed").exists(), "the worker was never killed: the test proves nothing"
    assert stats.respawns == 1
    assert [canonical(b) for b in held] == reference


def test_a_forked_process_dropping_its_copy_of_a_held_batch_gives_nothing_back(
    worker_pool: _transport.ShmPolicy,
) -> None:
    """A worker forked (a respawn) while the caller holds a pooled batch inherits a copy of it;
    that copy going away in the child must not hand the segment back to its worker, which
    would then overwrite the batch the caller still holds."""
    policy = worker_pool
    ours, theirs = socket.socketpair()
    receiver = _transport.Receiver(ours)
    try:
        held = []
        for _ in range(2):  # the first batch teaches the pool its size; the second is pooled
            policy.allow()
            with _transport.collating():
                storage = torch.UntypedStorage._new_shared(MiB)
            _transport.send(theirs, torch.empty(0, dtype=torch.uint8).set_(storage), policy)
            del storage
            held += receiver.feed()
        assert policy.pool is not None
        (seg,) = policy.pool.segments.values()
        assert seg.lent
        pid = os.fork()
        if pid == 0:  # the child drops its copy of everything the parent held, then exits
            code = 0
            try:
                del held[:]
            except BaseException:
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert seg.lent, "the child's copy gave back a segment the parent still holds"
        del held
        assert not seg.lent, "the parent's drop gives it back"
    finally:
        theirs.close()
        receiver.close()


class SmallThenLarge(torch.utils.data.Dataset):
    """Items 0-5 are 1-element tensors, the rest 256 KiB: batches that fit in the message,
    then batches that need /dev/shm."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1 if i < 6 else 32 * 1024,), i, dtype=torch.int64)


def test_batches_that_grow_past_inline_size_arrive_exact() -> None:
    """Issue #26: while every batch fit in its message, workers collate out of /dev/shm (the
    default collate alone); the first batch too large for it is shared at send, and the ones
    after go through the pool. Every batch is the reference's, in order."""
    ds = SmallThenLarge()
    want = [ds[i].unsqueeze(0) for i in range(len(ds))]
    got = list(DataLoader(ds, batch_size=1, num_workers=2))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"batch {i} differs"
    del got
