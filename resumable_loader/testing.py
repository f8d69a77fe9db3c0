"""Tools to test loaders -- ours, and your own datasets under ours.

Reference streams and resume checks:
    ``reference_stream(make_loader, epochs)``   the batches of an uninterrupted run
    ``check_resume(make_loader, ...)``           save at every step k, rebuild, resume, compare
    ``canonical(batch)``                         a hashable, exactly comparable form of a batch
    ``same_state(a, b)``                         exact equality of two plain-data states

Leak checks (what the test suite asserts after every test):
    ``Resources.now()``, ``leaks_since(before)``   child processes, threads, fds, /dev/shm

Fault injection (works under fork, spawn and forkserver; attempts are counted in files, so a
respawned worker sees how often a sample already crashed):
    ``Fault``, ``FaultyDataset``, ``FaultyStream``   crash/hang/fail on chosen samples/attempts
    ``worker_pids(loader)``, ``kill_worker(loader, k, sig)``   act on live workers
    ``kill_at(loader, {n: [(k, sig)]})``          iterate, signalling worker k after batch n
    ``ShmFailure(...)``                           a worker_init_fn: /dev/shm "full" in the worker
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

__all__ = [
    "Fault",
    "FaultyDataset",
    "FaultyStream",
    "Resources",
    "ShmFailure",
    "canonical",
    "check_resume",
    "kill_at",
    "kill_worker",
    "leaks_since",
    "reference_stream",
    "roundtrip_state",
    "same_state",
    "worker_pids",
]


# ---- comparing batches ------------------------------------------------------------------------
def canonical(obj: Any) -> Any:
    """A hashable form of ``obj`` that is equal exactly when the values, dtypes and shapes are."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape), tuple(obj.flatten().tolist()))
    if isinstance(obj, np.ndarray):
        return ("ndarray", str(obj.dtype), obj.shape, tuple(obj.flatten().tolist()))
    if isinstance(obj, dict):
        return ("dict", tuple((k, canonical(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(canonical(x) for x in obj))
    if isinstance(obj, float) and obj != obj:
        return ("nan",)
    return obj


def same_state(a: Any, b: Any) -> bool:
    """Exact equality of plain data: the same types all the way down (a tuple is not a list),
    dict keys in the same order, floats bit for bit (nan equals nan, -0.0 does not equal 0.0).
    ``==`` is too lenient to check that a saved state came back unchanged."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_state(a[k], b[k]) for k in a)
    return bool(a == b)


def reference_stream(make_loader: Callable[[], Any], epochs: int = 1) -> list[list[Any]]:
    """The canonical batches of ``epochs`` uninterrupted epochs of ``make_loader()``."""
    loader = make_loader()
    try:
        return [[canonical(b) for b in loader] for _ in range(epochs)]
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()


def roundtrip_state(sd: dict[str, Any], via: str) -> dict[str, Any]:
    """Send a state through a storage format: "dict", "bytes" (dump_state), "torch"
    (torch.save + torch.load(weights_only=True)) or "json"."""
    if via == "dict":
        return sd
    if via == "bytes":
        from resumable_loader import dump_state, load_state

        return load_state(dump_state(sd))
    if via == "torch":
        import io

        buf = io.BytesIO()
        torch.save({"loader": sd}, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)["loader"]
    if via == "json":
        return json.loads(json.dumps(sd))
    raise ValueError(f"unknown via {via!r}")


def _positions(ref: list[list[Any]], before_stop: bool) -> list[tuple[int, int, bool]]:
    """Every save point (epoch, batches consumed in it, saved after StopIteration?)."""
    out = []
    for e, batches in enumerate(ref):
        for j in range(len(batches) + 1):
            out.append((e, j, False))
        out.append((e, len(batches), True))
    return out if before_stop else [p for p in out if not (p[1] == len(ref[p[0]]) and not p[2])]


def _assert_same_epochs(
    got: list[list[Any]], ref: list[list[Any]], in_order: bool, where: str
) -> None:
    for epoch in range(len(ref)):
        if in_order:
            if got[epoch] != ref[epoch]:
                k = next(
                    (k for k, (a, b) in enumerate(zip(got[epoch], ref[epoch])) if a != b),
                    min(len(got[epoch]), len(ref[epoch])),
                )
                raise AssertionError(
                    f"{where}: epoch {epoch} differs from the uninterrupted run at batch "
                    f"{k}: got {len(got[epoch])} batches, expected {len(ref[epoch])}; "
                    f"got {got[epoch][k : k + 1]!r:.300} "
                    f"expected {ref[epoch][k : k + 1]!r:.300}"
                )
        else:
            a, b = Counter(map(repr, got[epoch])), Counter(map(repr, ref[epoch]))
            if a != b:
                raise AssertionError(
                    f"{where}: epoch {epoch} holds other batches than the uninterrupted run: "
                    f"missing {sum((b - a).values())}, extra {sum((a - b).values())}"
                )


def check_resume(
    make_loader: Callable[[], Any],
    *,
    epochs: int = 2,
    via: str = "dict",
    steps: Sequence[int] | None = None,
    in_order: bool = True,
    make_resumed: Callable[[], Any] | None = None,
    reference: list[list[Any]] | None = None,
) -> int:
    """Check that saving at each step and resuming in a fresh loader continues exactly.

    ``make_loader`` must build identical loaders (give it a seeded ``generator``, or seed
    torch's global RNG before building it). The resumed loader (``make_resumed``) may differ in
    ``num_workers``, ``generator`` and the like: the state carries the seed chain, so every
    later epoch is the saved job's.

    The reference is one uninterrupted run of ``epochs`` epochs. A second run takes a
    ``state_dict()`` at each chosen save point -- every batch of every epoch, after the last
    batch but before StopIteration, and after StopIteration -- while it goes on iterating, as a
    job that checkpoints every step does; its own batches must equal the reference's, and each
    state must still be what it was when taken once the run has gone on past it (a state that
    changes afterwards would be wrong in a checkpoint written asynchronously). Each state then
    goes through ``via`` (see ``roundtrip_state``), a new loader (``make_resumed()``, default
    ``make_loader()``) loads it and runs the rest of the ``epochs`` epochs. The batches
    before the save point and after it must equal the reference's; with ``in_order=False`` each
    epoch must hold the same batches as the reference's, each exactly once.

    Args:
        steps: only check these indices into the list of save points (default: all); indices
            past the last save point are ignored.

    Returns:
        the number of save points checked.

    Raises:
        AssertionError: naming the save point, and the first differing batch.
    """
    import copy

    ref = reference if reference is not None else reference_stream(make_loader, epochs)
    points = _positions(ref, before_stop=True)
    chosen = range(len(points)) if steps is None else [i for i in steps if 0 <= i < len(points)]
    make_resumed = make_resumed or make_loader
    wanted = {points[i]: i for i in chosen}
    # One run through every epoch: the batches it consumed, and the states taken on the way.
    run: list[list[Any]] = [[] for _ in range(epochs)]
    taken: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}

    def take(point: tuple[int, int, bool]) -> None:
        if point in wanted:
            sd = first.state_dict()
            taken[wanted[point]] = (sd, copy.deepcopy(sd))

    first = make_loader()
    try:
        for epoch in range(epochs):
            it = iter(first)
            take((epoch, 0, False))
            for j in range(1, len(ref[epoch]) + 1):
                try:
                    run[epoch].append(canonical(next(it)))
                except StopIteration:
                    raise AssertionError(
                        f"epoch {epoch} ended after {j - 1} batches, the reference's after "
                        f"{len(ref[epoch])}"
                    ) from None
                take((epoch, j, False))
            try:
                extra = next(it)
            except StopIteration:
                pass
            else:
                raise AssertionError(
                    f"epoch {epoch} yielded more batches than the reference: "
                    f"{canonical(extra)!r:.200}"
                )
            take((epoch, len(ref[epoch]), True))
    finally:
        first.close()
    _assert_same_epochs(run, ref, in_order, "the run that took the states")
    for i in chosen:
        e, j, after_stop = points[i]
        stop = ", after StopIteration" if after_stop else ""
        where = f"save point {i} (epoch {e}, after {j} batches{stop}, via {via})"
        sd, as_taken = taken[i]
        if not same_state(sd, as_taken):
            raise AssertionError(f"{where}: the state changed after state_dict() returned it")
        sd = roundtrip_state(sd, via)
        got = [list(run[epoch]) if epoch < e else [] for epoch in range(epochs)]
        got[e] = list(run[e][:j])
        second = make_resumed()
        try:
            second.load_state_dict(sd)
            # The epoch the state says comes next: after the last batch of an epoch whose end
            # the loader knows (its length, a drawn-out sampler, dried-up shards) that is the
            # next epoch, as after StopIteration. Were it claimed early, the batches skipped
            # would be missing below.
            start_epoch = sd["epoch"]
            if after_stop and start_epoch != e + 1:
                raise AssertionError(
                    f"after StopIteration of epoch {e} the state says {sd['epoch']}"
                )
            for epoch in range(start_epoch, epochs):
                got[epoch].extend(canonical(b) for b in second)
        finally:
            second.close()
        _assert_same_epochs(got, ref, in_order, where)
    return len(chosen)


# ---- fault injection --------------------------------------------------------------------------
ACTIONS = ("sigkill", "sigsegv", "exit", "stop", "hang", "raise", "transient", "unpicklable")


@dataclass(frozen=True)
class Fault:
    """What to do when a sample is fetched.

    Args:
        action: "sigkill", "sigsegv" (a real segfault), "exit" (``os._exit(exit_code)``),
            "stop" (SIGSTOP: a hung worker; use with ``task_timeout``), "hang" (sleep forever in
            user code), "raise" (``exc_type(message)``), "transient" (``OSError``: use with a
            ``RetryPolicy``), "unpicklable" (return an object that cannot be sent).
        attempts: the fetch attempts of this sample (0 = first) on which to act; ``None``:
            every attempt (a poison sample).
        worker: act only in this worker id (None: any).
    """

    action: str
    attempts: frozenset[int] | None = frozenset({0})
    worker: int | None = None
    exit_code: int = 3
    exc_type: type[BaseException] = ValueError
    message: str = "injected fault"

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; choose from {ACTIONS}")


def _record_attempt(state_dir: str, key: str) -> int:
    """Count attempts in a file (one byte per attempt): survives the worker that made them."""
    path = os.path.join(state_dir, f"attempts-{key}")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, b".")
    finally:
        os.close(fd)
    return os.path.getsize(path) - 1


def _act(fault: Fault, what: str) -> Any:
    info = get_worker_info()
    if fault.action not in ("raise", "transient", "unpicklable") and info is None:
        raise RuntimeError(
            f"fault {fault.action!r} on {what} would kill the main process: use num_workers > 0"
        )
    if fault.action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "sigsegv":
        import ctypes

        ctypes.string_at(0)  # a genuine invalid read
    elif fault.action == "exit":
        os._exit(fault.exit_code)
    elif fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.action == "hang":
        while True:
            time.sleep(3600)
    elif fault.action == "raise":
        raise fault.exc_type(f"{fault.message} ({what})")
    elif fault.action == "transient":
        raise OSError(f"{fault.message}: transient error ({what})")
    elif fault.action == "unpicklable":
        return lambda: None
    return None


class FaultyDataset(Dataset):
    """Wrap a map-style dataset; fetching index ``i`` applies ``faults[i]`` on chosen attempts.

    Args:
        dataset: the dataset to wrap.
        faults: sample index -> Fault.
        state_dir: a directory for the attempt counters (e.g. pytest's ``tmp_path``).

    A state records the wrapped dataset (class, ``fingerprint()``): a job run through the
    wrapper resumes on the plain dataset, and the other way round.
    """

    _records_as = "dataset"  # see state.fingerprint.WRAPS

    def __init__(self, dataset: Any, faults: dict[int, Fault], state_dir: str | os.PathLike[str]):
        self.dataset = dataset
        self.faults = dict(faults)
        self.state_dir = os.fspath(state_dir)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        fault = self.faults.get(index)
        if fault is not None:
            info = get_worker_info()
            if fault.worker is None or (info is not None and info.id == fault.worker):
                attempt = _record_attempt(self.state_dir, f"idx{index}")
                if fault.attempts is None or attempt in fault.attempts:
                    out = _act(fault, f"sample {index}, attempt {attempt}")
                    if out is not None:
                        return out
        return self.dataset[index]


class FaultyStream(IterableDataset):
    """Wrap an iterable dataset; an item whose key is in ``faults`` applies that fault.

    By default an item's key is ``(worker id, n)``, n counting the items this iterator has
    yielded (with ``num_workers=0`` the worker id is 0). A stream restored from a state starts
    counting again, so for stateful streams pass ``key``: a picklable function of the item
    (e.g. its sample id). State methods of the wrapped stream are forwarded, and a state
    records the wrapped stream (class, ``fingerprint()``), as for ``FaultyDataset``.
    """

    _records_as = "stream"  # see state.fingerprint.WRAPS

    def __init__(
        self,
        stream: Any,
        faults: dict[Any, Fault],
        state_dir: str | os.PathLike[str],
        key: Callable[[Any], Any] | None = None,
    ):
        self.stream = stream
        self.faults = dict(faults)
        self.state_dir = os.fspath(state_dir)
        self.key = key
        if callable(getattr(stream, "state_dict", None)):
            self.state_dict = stream.state_dict
            self.load_state_dict = stream.load_state_dict

    def __len__(self) -> int:
        return len(self.stream)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        wid = info.id if info is not None else 0
        for n, item in enumerate(self.stream):
            key = (wid, n) if self.key is None else self.key(item)
            fault = self.faults.get(key)
            if fault is not None:
                attempt = _record_attempt(self.state_dir, f"key-{key!r}".replace("/", "_"))
                if fault.attempts is None or attempt in fault.attempts:
                    out = _act(fault, f"item {key!r} of worker {wid}, attempt {attempt}")
                    if out is not None:
                        item = out
            yield item


def worker_pids(loader: Any) -> list[int]:
    """The pids of the loader's live worker processes, by worker id (-1: not running)."""
    return list(loader.statistics().worker_pids)


def kill_at(loader: Any, plan: Mapping[int, Iterable[tuple[int, int]]]) -> Iterator[Any]:
    """Iterate ``loader``, signalling workers at chosen batches.

    ``plan`` maps a batch number n (0-based) to ``(worker id, signal)`` pairs, sent right
    after batch n is delivered: ``signal.SIGKILL`` or ``SIGSEGV`` for a crash, ``SIGSTOP``
    for a hang (the loader needs ``task_timeout`` to notice that). For example::

        for batch in kill_at(loader, {3: [(0, signal.SIGKILL)], 7: [(1, signal.SIGSTOP)]}):
            ...

    To make a worker fail on a given sample instead, wrap the dataset in ``FaultyDataset``.
    """
    for n, batch in enumerate(loader):
        yield batch
        for worker, sig in plan.get(n, ()):
            kill_worker(loader, worker, sig)


def kill_worker(loader: Any, worker: int, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to worker ``worker`` of the loader's current iterator; returns its pid."""
    pid = worker_pids(loader)[worker]
    if pid <= 0:
        raise RuntimeError(f"worker {worker} is not running")
    os.kill(pid, sig)
    return pid


# ---- a full /dev/shm ---------------------------------------------------------------------------
SHM_WHERE = ("alloc", "share", "both")


class ShmFailure:
    """A ``worker_init_fn`` under which torch's shared-memory allocations fail in the worker,
    the way they do when /dev/shm is full (the same RuntimeError, "unable to allocate shared
    memory(shm) for file <...>: No space left on device (28)").

    Use it to check that a pipeline survives a small /dev/shm (a container's 64 MiB default)
    without one: ``DataLoader(..., worker_init_fn=ShmFailure(then=my_init))``. It works under
    fork, spawn and forkserver, and again in a respawned worker.

    Args:
        where: which allocations fail -- "alloc": a storage created in shared memory (torch's
            default_collate builds a worker's batch there); "share": an ordinary storage moved
            into shared memory to be sent (what a custom collate_fn's output needs); "both".
        every: fail one allocation in ``every``, counted per worker from its start (1: all).
        min_bytes: only allocations of at least this many bytes fail.
        then: the loader's own ``worker_init_fn``, called afterwards with the worker id.
    """

    def __init__(
        self,
        where: str = "both",
        every: int = 1,
        min_bytes: int = 0,
        then: Callable[[int], None] | None = None,
    ) -> None:
        if where not in SHM_WHERE:
            raise ValueError(f"unknown where {where!r}; choose from {SHM_WHERE}")
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every!r}")
        self.where = where
        self.every = every
        self.min_bytes = min_bytes
        self.then = then

    def __call__(self, worker_id: int) -> None:
        storage_cls = torch.UntypedStorage
        seen = [0]  # allocations of at least min_bytes in this worker

        def fail(nbytes: int) -> bool:
            if nbytes < self.min_bytes:
                return False
            n = seen[0]
            seen[0] = n + 1
            return n % self.every == 0

        def error(n: int) -> RuntimeError:
            return RuntimeError(
                "unable to allocate shared memory(shm) for file "
                f"</torch_{os.getpid()}_injected_{n}>: No space left on device (28)"
            )

        copying = _count_shared_copies(
            fail if self.where in ("share", "both") else None, lambda: error(seen[0])
        )
        if self.where in ("alloc", "both"):
            from .core.compat import set_shared_allocator, shared_allocator

            for strategy in ("file_descriptor", "file_system"):
                original = shared_allocator(strategy)  # bound to the class

                def new(cls: Any, size: int, _original: Any = original) -> Any:
                    if not copying[0] and fail(size):
                        raise error(seen[0])
                    return _original(size)

                set_shared_allocator(new, strategy)
            # The loader's pooled segments are sized in the worker without torch's allocator.
            from .pipeline.transport import pools

            reserve = pools.reserve

            def sized(fd: int, nbytes: int, _original: Any = reserve) -> None:
                if fail(nbytes):
                    raise error(seen[0])
                _original(fd, nbytes)

            pools.reserve = sized
        if self.where in ("share", "both"):
            for name in ("_share_fd_cpu_", "_share_filename_cpu_"):
                original = getattr(storage_cls, name)

                def share(self_: Any, *args: Any, _original: Any = original) -> Any:
                    # A storage already in shared memory is shared without allocating.
                    if not self_.is_shared() and fail(self_.nbytes()):
                        raise error(seen[0])
                    return _original(self_, *args)

                setattr(storage_cls, name, share)
        if self.then is not None:
            self.then(worker_id)


def _count_shared_copies(
    fail: Callable[[int], bool] | None, error: Callable[[], RuntimeError]
) -> list[bool]:
    """For ``ShmFailure``: the transport copies an ordinary storage into shared memory itself
    to send it (``reducers.shared_copy``) where torch's sharing would move it. That copy is a
    "share" allocation, failing where ``fail(nbytes)`` says (None: never), counted once; the
    allocation inside it is not an "alloc" one. Returns the flag that is set while inside."""
    from .pipeline.transport import reducers

    copying = [False]
    original = reducers.shared_copy

    def shared_copy(out: Any, storage: Any) -> Any:
        if fail is not None and fail(storage.nbytes()):
            raise error()
        copying[0] = True
        try:
            return original(out, storage)
        finally:
            copying[0] = False

    reducers.shared_copy = shared_copy
    return copying


# ---- leak checks ------------------------------------------------------------------------------
# multiprocessing's own long-lived helpers are not a loader's to clean up.
_MP_HELPERS = ("forkserver", "resource_tracker", "semaphore_tracker")


@dataclass(frozen=True)
class Resources:
    """What this process holds that a loader could leak: a snapshot to compare against.

    Attributes:
        children: pids of child processes (zombies included; multiprocessing's own fork server
            and resource tracker excluded).
        threads: names of live threads started by this library (``resumable_loader-*``).
        fds: open file descriptors.
        shm: torch's /dev/shm entries (``torch_*``).
    """

    children: frozenset[int]
    threads: frozenset[str]
    fds: frozenset[int]
    shm: frozenset[str]

    @classmethod
    def now(cls) -> Resources:
        import psutil

        _watch_shm_births()  # first: its fd is in the snapshot, and new names are judged
        children = set()
        for child in psutil.Process().children(recursive=True):
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    children.add(child.pid)
                    continue
                cmd = " ".join(child.cmdline())
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            except psutil.AccessDenied:
                cmd = ""
            if not any(h in cmd for h in _MP_HELPERS):
                children.add(child.pid)
        threads = {t.name for t in threading.enumerate() if t.name.startswith("resumable_loader")}
        fds = {int(x) for x in os.listdir("/proc/self/fd")}
        try:
            shm = {x for x in os.listdir("/dev/shm") if x.startswith("torch_")}
        except FileNotFoundError:
            shm = set()
        return cls(frozenset(children), frozenset(threads), frozenset(fds), frozenset(shm))


def _made_by_us(shm_name: str) -> bool:
    """Whether a ``torch_<pid>_...`` segment was made by this process tree.

    /dev/shm is the whole machine's: another test run's or job's workers make segments too.
    torch names a segment after the process that made it. Ours are made by this process or its
    descendants (workers, under fork, spawn or forkserver). Where the maker was seen when the
    name appeared (``_ShmBirths``), that verdict stands: the maker may be gone by now, and
    another job's dead worker (killed, or ended while its main process still holds a batch, as
    under file_system) must not count as ours. A name not seen appearing is judged now, and a
    maker that is gone is then counted as ours (a killed worker's leftovers are exactly what
    this check is for).
    """
    births = _births
    if births is not None:
        verdict = births.verdict(shm_name)
        if verdict is not None:
            return verdict
    return _maker_is_ours(shm_name)


def _maker_is_ours(shm_name: str) -> bool:
    """Whether the maker of a ``torch_<pid>_...`` segment is, now, this process or one of its
    descendants; True where it is gone (or the name has no pid)."""
    import psutil

    try:
        pid = int(shm_name.split("_")[1])
    except (IndexError, ValueError):
        return True
    me = os.getpid()
    try:
        proc = psutil.Process(pid)
        while proc is not None:
            if proc.pid == me:
                return True
            proc = proc.parent()
    except psutil.NoSuchProcess:
        return True
    return False


# ---- who made a /dev/shm name ------------------------------------------------------------------
# A leak check runs at the end of a test, when the maker of a new name may be gone: then its pid
# says nothing about whose it was. So the names are judged as they appear, while their makers
# still run: an inotify watch on /dev/shm, read by a thread of its own (and by ``Resources.now()``,
# so that a name already made is judged before its caller goes on). A maker gone within
# milliseconds of making its name (killed between torch's shm_open and its unlink) is still
# counted as ours: that is the leftover the check looks for.
_IN_MOVED_TO = 0x80
_IN_CREATE = 0x100
_IN_DELETE = 0x200
_IN_MOVED_FROM = 0x40
_IN_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then the name, NUL-padded


class _ShmBirths:
    """The verdicts (``_maker_is_ours`` when each ``torch_*`` name appeared) of the names made
    in /dev/shm since the watch began, for as long as each name exists."""

    def __init__(self, fd: int) -> None:
        self.fd = fd  # an inotify instance watching /dev/shm (non-blocking)
        self.lock = threading.Lock()
        self.verdicts: dict[str, bool] = {}
        threading.Thread(
            target=self._run, name="shm-births (resumable_loader.testing)", daemon=True
        ).start()

    @classmethod
    def start(cls) -> _ShmBirths | None:
        """A watch on /dev/shm, or None where there is none to be had (no inotify, no
        /dev/shm)."""
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):
            return None
        if fd < 0:
            return None
        mask = _IN_CREATE | _IN_MOVED_TO | _IN_DELETE | _IN_MOVED_FROM
        if libc.inotify_add_watch(fd, b"/dev/shm", mask) < 0:
            os.close(fd)
            return None
        return cls(fd)

    def _run(self) -> None:
        import select

        poller = select.poll()  # (not select(): the fd may be past FD_SETSIZE)
        poller.register(self.fd, select.POLLIN)
        while True:
            poller.poll()
            self.read()

    def read(self) -> None:
        """Judge the names that appeared since the last read; forget those that went."""
        with self.lock:
            while True:
                try:
                    buf = os.read(self.fd, 64 * 1024)
                except BlockingIOError:
                    return
                at = 0
                while at < len(buf):
                    _, mask, _, size = _IN_EVENT.unpack_from(buf, at)
                    start = at + _IN_EVENT.size
                    name = buf[start : start + size].rstrip(b"\0").decode(errors="replace")
                    at = start + size
                    if not name.startswith("torch_"):
                        continue
                    if mask & (_IN_CREATE | _IN_MOVED_TO):
                        self.verdicts[name] = _maker_is_ours(name)
                    else:
                        self.verdicts.pop(name, None)

    def verdict(self, name: str) -> bool | None:
        """Whether ``name``'s maker was ours when it appeared; None if not seen appearing."""
        with self.lock:
            return self.verdicts.get(name)


_births: _ShmBirths | None = None
_births_tried = False
_births_start = threading.Lock()  # (two threads checking at once start one watch)


def _watch_shm_births() -> None:
    """Start the watch, once per process."""
    global _births, _births_tried
    with _births_start:
        if not _births_tried:
            _births_tried = True
            _births = _ShmBirths.start()
        births = _births
    if births is not None:
        births.read()


def _forget_births_in_child() -> None:
    # A forked child has the watch's fd but not its thread: it closes the fd (a worker must not
    # keep it) and would start a watch of its own if it checked for leaks.
    global _births, _births_start, _births_tried
    if _births is not None:
        with contextlib.suppress(OSError):
            os.close(_births.fd)
    _births, _births_tried = None, False
    _births_start = threading.Lock()  # (another thread may have held it at the fork)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_births_in_child)


def leaks_since(before: Resources, settle_s: float = 10.0) -> list[str]:
    """What was acquired since ``before`` and is still held, waiting up to ``settle_s`` for it
    to go (a SIGKILLed worker is reaped a moment later); [] if nothing leaked.

    It never runs the garbage collector: a loader kept alive by a reference cycle holds its
    workers until the collector happens to run, and that is a leak this check must see.

    Returns one readable line per kind of leak.
    """
    deadline = time.monotonic() + settle_s
    while True:
        now = Resources.now()
        leaked = (
            now.children - before.children,
            now.threads - before.threads,
            now.fds - before.fds,
            frozenset(name for name in now.shm - before.shm if _made_by_us(name)),
        )
        if not any(leaked) or time.monotonic() >= deadline:
            break
        time.sleep(0.02)  # polling the kernel's reaping of killed processes, not a sync
    children, threads, fds, shm = leaked
    problems = []
    if children:
        problems.append(f"child processes {sorted(children)}")
    if threads:
        problems.append(f"threads {sorted(threads)}")
    if fds:
        details = {}
        for fd in sorted(fds):
            try:
                details[fd] = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                details[fd] = "?"
        problems.append(f"file descriptors {details}")
    if shm:
        problems.append(f"/dev/shm entries {sorted(shm)}")
    return problems
