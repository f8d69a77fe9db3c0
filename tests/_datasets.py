"""Picklable test datasets, samplers and helpers shared by the test suite.

Everything here is defined at module level so it pickles by reference and works under the
``fork``, ``spawn`` and ``forkserver`` start methods (a spawned worker imports this module by
name; pytest puts ``tests/`` on ``sys.path``, and multiprocessing hands ``sys.path`` to its
children). Every item is a pure function of its index, so two loaders over the same dataset can
be compared batch for batch.

Helpers:
    ``collect_torch_reference_garbage()``  run torch's loader first, then this, then ours.
    ``torch_error_type(**kw)``  the error torch's loader raises, its workers stopped at once.
    ``loader_state(**overrides)``     a plain state shaped like ``DataLoader.state_dict()`` (two
                                      stream workers, mid-epoch), for the codec and CLI tests.

Datasets:
    ``make_item(i)``                  the item every dataset below yields for value ``i``: a dict
                                      of an int, a float64 tensor, an int16 numpy array and a str.
    ``RangeDataset(n, as_tuple=False)``  map-style; item i is ``make_item(i)`` (or a tuple of it).
    ``RangeData(n=4)``                map-style; the ints 0..n-1 (item i is i).
    ``RandomAugDataset(n)``           map-style; item i draws from python ``random``, numpy's
                                      global RNG and torch's global RNG (for seeding tests).
    ``ShardedStream(n)``              IterableDataset sharded with ``get_worker_info()``: worker k
                                      of W yields ``make_item(j)`` for j = k, k+W, ... < n.
    ``StreamWithLen(n)``              ``ShardedStream`` that also defines ``__len__`` (= n).
    ``UnevenStream(m)``               IterableDataset whose length depends on the worker: worker k
                                      yields (k+1)*m items (values k*1000 + j), so workers end at
                                      different times. Without workers it acts as worker 0 of 1.
    ``FailingDataset(n, bad, exc)``   map-style; raises ``exc(f"bad index {i}")`` for i in ``bad``.
    ``FailingStream(n, bad, exc)``    ``ShardedStream`` as a generator that raises at values in
                                      ``bad`` (which ends that worker's generator, as in python).
    ``SlowDataset(n, slow, delay)``   map-style; sleeps ``delay`` seconds before items in ``slow``.
    ``RecordingDataset(n, path)``     map-style; appends one line per fetched index to ``path``
                                      (one O_APPEND write, so safe across worker processes);
                                      read back with ``read_records(path)``.
    ``WorkerInfoDataset(n)``          map-style; item i is a dict describing
                                      ``get_worker_info()`` where the item was fetched.

Samplers and callables:
    ``EveryOtherReversedSampler(n)``  yields n-1, n-3, n-5, ... (a custom ``Sampler``).
    ``VariableBatchSampler(n, sizes)``  consecutive batches whose sizes cycle through ``sizes``.
    ``FailingCollate(bad)``           ``default_collate`` that raises ValueError on a batch holding
                                      an index in ``bad``.
    ``record_worker_init(path, worker_id)``  a ``worker_init_fn`` (bind ``path`` with
                                      ``functools.partial``) appending "worker_id pid" to ``path``.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info
from torch.utils.data.dataloader import default_collate

__all__ = [
    "EveryOtherReversedSampler",
    "FailingCollate",
    "FailingDataset",
    "FailingStream",
    "RandomAugDataset",
    "RangeData",
    "RangeDataset",
    "RecordingDataset",
    "ShardedStream",
    "SlowDataset",
    "StreamWithLen",
    "UnevenStream",
    "VariableBatchSampler",
    "WorkerInfoDataset",
    "collect_torch_reference_garbage",
    "loader_state",
    "make_item",
    "read_records",
    "record_worker_init",
]


def make_item(i: int) -> dict:
    """The item for value ``i``: covers int, tensor, numpy and str collation."""
    return {
        "idx": i,
        "x": torch.tensor([i, i * i], dtype=torch.float64),
        "np": np.array([i, -i], dtype=np.int16),
        "tag": f"s{i}",
    }


def _append_line(path: str, line: str) -> None:
    # One write() on an O_APPEND fd is atomic for short lines, whichever process makes it.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _worker_shard() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class RangeDataset(Dataset):
    """Map-style dataset of ``n`` items; item i is ``make_item(i)`` (a 2-tuple if ``as_tuple``)."""

    def __init__(self, n: int, as_tuple: bool = False) -> None:
        self.n = n
        self.as_tuple = as_tuple

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        item = make_item(i)
        return (item["x"], item["idx"]) if self.as_tuple else item


class RangeData(torch.utils.data.Dataset):
    """Map-style, ``n`` items (four by default): item i is the int i."""

    n = 4  # a subclass that skips __init__ still has four items

    def __init__(self, n: int = 4) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class RandomAugDataset(Dataset):
    """Item i holds one draw each from python ``random``, numpy's global RNG and torch's."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {
            "idx": i,
            "py": random.random(),
            "np": np.random.rand(),
            "torch": torch.rand(1),
        }


class ShardedStream(IterableDataset):
    """Iterable of ``make_item(j)``, j < n; worker k of W yields j = k, k+W, k+2W, ..."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict]:
        k, w = _worker_shard()
        return (make_item(j) for j in range(k, self.n, w))


class StreamWithLen(ShardedStream):
    """``ShardedStream`` with ``__len__`` (the total over all workers, as torch expects)."""

    def __len__(self) -> int:
        return self.n


class UnevenStream(IterableDataset):
    """Worker k yields (k+1)*m items, values k*1000 + j: workers run dry at different times."""

    def __init__(self, m: int) -> None:
        self.m = m

    def __iter__(self) -> Iterator[dict]:
        k, _ = _worker_shard()
        return (make_item(k * 1000 + j) for j in range((k + 1) * self.m))


class FailingDataset(Dataset):
    """Map-style ``RangeDataset`` whose items in ``bad`` raise ``exc(f"bad index {i}")``."""

    def __init__(self, n: int, bad: Iterable[int] = (), exc: type[Exception] = ValueError) -> None:
        self.n = n
        self.bad = frozenset(bad)
        self.exc = exc

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if i in self.bad:
            raise self.exc(f"bad index {i}")
        return make_item(i)


class FailingStream(IterableDataset):
    """Sharded like ``ShardedStream``; a generator that raises ``exc`` at the values in ``bad``.

    As with any python generator, the raise ends that worker's stream.
    """

    def __init__(self, n: int, bad: Iterable[int] = (), exc: type[Exception] = ValueError) -> None:
        self.n = n
        self.bad = frozenset(bad)
        self.exc = exc

    def __iter__(self) -> Iterator[dict]:
        k, w = _worker_shard()
        for j in range(k, self.n, w):
            if j in self.bad:
                raise self.exc(f"bad index {j}")
            yield make_item(j)


class SlowDataset(Dataset):
    """Map-style ``RangeDataset`` that sleeps ``delay`` seconds before each item in ``slow``."""

    def __init__(self, n: int, slow: Iterable[int] = (), delay: float = 1.0) -> None:
        self.n = n
        self.slow = frozenset(slow)
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if i in self.slow:
            time.sleep(self.delay)
        return make_item(i)


class RecordingDataset(Dataset):
    """Map-style ``RangeDataset`` that appends each fetched index to the file ``path``."""

    def __init__(self, n: int, path: str | os.PathLike) -> None:
        self.n = n
        self.path = os.fspath(path)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        _append_line(self.path, str(i))
        return make_item(i)


def read_records(path: str | os.PathLike) -> list[int]:
    """The indices a ``RecordingDataset`` fetched, in write order ([] if none yet)."""
    try:
        with open(path) as f:
            return [int(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


class WorkerInfoDataset(Dataset):
    """Item i describes ``get_worker_info()`` as seen by the process that fetched it.

    Keys: ``idx``, ``pid``, ``in_worker`` (info is not None), and when in a worker: ``id``,
    ``num_workers``, ``seed``, ``seed_type`` (type name), ``dataset_type`` (qualname of
    ``info.dataset``) and ``dataset_n`` (its ``n``). Use with ``batch_size=None``.
    """

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        info = get_worker_info()
        out: dict = {"idx": i, "pid": os.getpid(), "in_worker": info is not None}
        if info is not None:
            out.update(
                id=info.id,
                num_workers=info.num_workers,
                seed=info.seed,
                seed_type=type(info.seed).__name__,
                dataset_type=type(info.dataset).__qualname__,
                dataset_n=getattr(info.dataset, "n", None),
            )
        return out


class EveryOtherReversedSampler(Sampler[int]):
    """Yields n-1, n-3, n-5, ... down to 0 or 1."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n - 1, -1, -2))

    def __len__(self) -> int:
        return math.ceil(self.n / 2)


class VariableBatchSampler(Sampler[list[int]]):
    """Consecutive index batches over range(n) whose sizes cycle through ``sizes``."""

    def __init__(self, n: int, sizes: Sequence[int] = (1, 2, 3, 5)) -> None:
        self.n = n
        self.sizes = tuple(sizes)

    def _batches(self) -> list[list[int]]:
        out, start, k = [], 0, 0
        while start < self.n:
            size = self.sizes[k % len(self.sizes)]
            out.append(list(range(start, min(start + size, self.n))))
            start += size
            k += 1
        return out

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


class FailingCollate:
    """``default_collate`` that raises ``ValueError`` on a batch holding an index in ``bad``."""

    def __init__(self, bad: Iterable[int]) -> None:
        self.bad = frozenset(bad)

    def __call__(self, batch: list[dict]):
        hit = sorted(self.bad.intersection(item["idx"] for item in batch))
        if hit:
            raise ValueError(f"collate refused index {hit[0]}")
        return default_collate(batch)


class CursorSampler(torch.utils.data.Sampler[int]):
    """``range(n)`` in order, with its position as its state (it rewinds at the epoch's end):
    the smallest stateful sampler, which the loader saves through its own ``state_dict()``."""

    def __init__(self, n: int) -> None:
        self.n, self.pos = n, 0

    def __iter__(self) -> Any:
        while self.pos < self.n:
            self.pos += 1
            yield self.pos - 1
        self.pos = 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd["pos"]


class Tagged(torch.utils.data.Dataset):
    """Item ``i`` is the string ``"name/i"``: a source of a ``Mixture`` whose items say where
    they came from."""

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n = name, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < self.n:
            raise IndexError(f"{self.name}: index {i} out of range({self.n})")
        return f"{self.name}/{i}"


def record_worker_init(path: str, worker_id: int) -> None:
    """``worker_init_fn`` body: append "worker_id pid" to ``path`` (bind path with partial)."""
    _append_line(path, f"{worker_id} {os.getpid()}")


def collect_torch_reference_garbage() -> None:
    """Free what torch's own DataLoader left in reference cycles, before ours runs.

    After a worker's error torch's iterator is kept alive by a cycle (ExceptionWrapper.reraise
    raises the exception from a frame whose locals hold it), with its queues' pipes and the
    shared memory of its prefetched batches, until the garbage collector runs. The leak check
    after every test never runs the collector -- a cycle of *ours* must show up as a leak -- so
    a test that uses torch's loader as the reference runs it first, calls this, then runs ours.
    """
    import gc

    gc.collect()


def torch_error_type(**kwargs: Any) -> type[BaseException]:
    """The type of the error torch's own DataLoader(**kwargs) raises when iterated.

    After a worker's error torch's shutdown joins each worker with a 5 s timeout (its
    MP_STATUS_CHECK_INTERVAL), and its workers do not exit within it: 10 s per reference run
    with two workers. The reference needs only the error, so its workers are killed once it
    is raised (their pids unregistered first, or torch's SIGCHLD handler would report them as
    crashed), and its garbage is collected before ours runs.
    """
    import gc

    from torch.utils.data._utils import signal_handling

    loader = torch.utils.data.DataLoader(**kwargs)
    it: Any = None
    try:
        it = iter(loader)  # with no workers, the dataset's __iter__ runs here
        for _ in it:
            pass
    except BaseException as e:
        error = type(e)
    else:
        raise AssertionError(f"torch's DataLoader({kwargs}) raised nothing")
    finally:
        workers = getattr(it, "_workers", [])
        if getattr(it, "_worker_pids_set", False):
            signal_handling._remove_worker_pids(id(it))
            it._worker_pids_set = False
        for w in workers:
            w.kill()
        for w in workers:
            w.join()
        if workers:
            it._shutdown_workers()
        del it, loader
    gc.collect()
    return error


def loader_state(**overrides: Any) -> dict[str, Any]:
    """A state shaped like DataLoader.state_dict(): two workers, iterable dataset, mid-epoch."""
    state: dict[str, Any] = {
        "format": "resumable_loader.DataLoader",
        "version": 2,
        "config": {
            "dataset_kind": "iterable",
            "dataset_len": None,
            "batch_size": 4,
            "drop_last": False,
            "sampler": "SequentialSampler",
            "num_workers": 2,
            "world_size": 1,
            "rank": 0,
        },
        "seed": 2**63 - 1,
        "epoch": 3,
        "consumed": 17,
        "delivered_ahead": [19, 20],
        "sampler_state": {"generator": b"\x01\x02" * 8, "offset": 68},
        "outstanding": [[18, [72, 73, 74, 75]], [21, [84, 85, 86, 87]]],
        "workers": [
            {
                "id": 0,
                "delivered": 9,
                "exhausted": False,
                "dataset_state": {"pos": 36, "buf": b"\x00\xff" * 10, "name": "shard-0 ✓"},
            },
            {"id": 1, "delivered": 8, "exhausted": True, "dataset_state": None},
        ],
        "next_worker": 1,
        "skipped": [[2, 7, [28, 29, 30, 31]]],
        "stats": {"respawns": 1, "batches": 17},
    }
    state.update(overrides)
    return state


@contextlib.contextmanager
def sharing_strategy(name: str) -> Iterator[None]:
    """torch.multiprocessing's sharing strategy set to ``name`` for the block, then restored."""
    old = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(name)
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(old)
