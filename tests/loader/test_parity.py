"""Behaviour parity with ``torch.utils.data.DataLoader``, side by side.

Each test builds torch's loader and ours with identical arguments and compares what they do; torch
2.13 is the reference. What is covered:

* constructor: signature (torch's parameters are a prefix of ours, extras keyword-only with
  defaults), ``DataLoader[int]``, ``isinstance`` of torch's class, every invalid combination
  (same exception type and message), ``len()``, attributes frozen after ``__init__``;
* the batch stream, without randomness, over the table
  ``{map, custom sampler, custom batch_sampler, sharded iterable, uneven iterable}``
  x ``batch_size {None, 1, 7, 7+drop_last}`` x ``num_workers {0, 1, 2, 4}``
  x ``in_order {True, False}`` (fork), plus ``{map, iterable} x {fork, spawn, forkserver}`` with 2
  workers, persistent workers over 3 epochs and ``pin_memory=True`` on a CPU-only machine;
  ``in_order=False`` is compared as a multiset of batches, everything else batch for batch;
* shuffling: an epoch is a permutation cut like torch's, epochs differ, the same seed (global or
  ``generator=``) repeats the order and the augmentation draws, another seed does not. Shuffled
  order is never compared with torch's own draws;
* ``worker_init_fn`` calls and ``get_worker_info()`` inside and outside workers;
* errors from the dataset, an iterable or ``collate_fn`` re-raised with torch's type, the original
  message, and iteration continuing exactly like torch's; ``timeout=``;
* teardown: break, ``del``, an exception out of the loop, ``close()``, ``with``, interpreter exit.

Self-test mode: ``RL_PARITY_SELFTEST=1 pytest tests/loader/test_parity.py`` aliases ``Ours``
to torch's own DataLoader and skips the tests of our extras (``close()``, ``with``, extra
keywords), which checks that the tests themselves are right (torch must pass them against itself).
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
import typing
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from _datasets import (
    EveryOtherReversedSampler,
    FailingCollate,
    FailingDataset,
    FailingStream,
    RandomAugDataset,
    RangeDataset,
    ShardedStream,
    SlowDataset,
    StreamWithLen,
    UnevenStream,
    VariableBatchSampler,
    WorkerInfoDataset,
    collect_torch_reference_garbage,
    record_worker_init,
    torch_error_type,
)
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import get_worker_info

from resumable_loader.testing import Resources, leaks_since

SELFTEST = os.environ.get("RL_PARITY_SELFTEST") == "1"
if SELFTEST:
    Ours = TorchDataLoader
else:
    from resumable_loader import DataLoader as Ours

ours_only = pytest.mark.skipif(SELFTEST, reason="tests an extra of ours; RL_PARITY_SELFTEST=1")

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:Length of IterableDataset:UserWarning"),
]

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent
N = 41  # odd and prime: every batch size and worker count leaves a ragged end
SEED = 1234
# Generous: a worker process that has been told to stop should be gone long before this.
GONE_DEADLINE_S = 10.0


# --------------------------------------------------------------------------------------------
# comparison helpers


def assert_same(got, expected, where: str = "batch") -> None:
    """Exact structural equality: types, dict keys (in order), dtypes, shapes and values."""
    assert type(got) is type(expected), (
        f"{where}: type {type(got).__name__} != expected {type(expected).__name__}"
    )
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype, f"{where}: dtype {got.dtype} != {expected.dtype}"
        assert got.shape == expected.shape, f"{where}: shape {got.shape} != {expected.shape}"
        assert torch.equal(got, expected), f"{where}: {got.tolist()} != {expected.tolist()}"
    elif isinstance(expected, np.ndarray):
        assert got.dtype == expected.dtype, f"{where}: dtype {got.dtype} != {expected.dtype}"
        assert got.shape == expected.shape, f"{where}: shape {got.shape} != {expected.shape}"
        assert np.array_equal(got, expected), f"{where}: {got.tolist()} != {expected.tolist()}"
    elif isinstance(expected, dict):
        assert list(got) == list(expected), f"{where}: keys {list(got)} != {list(expected)}"
        for key in expected:
            assert_same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), f"{where}: length {len(got)} != {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{where}[{i}]")
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def canon(x):
    """A hashable, exact rendering of a batch, for multiset comparison."""
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), tuple(x.shape), tuple(x.flatten().tolist()))
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.shape, tuple(x.flatten().tolist()))
    if isinstance(x, dict):
        return ("dict", tuple((k, canon(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(canon(v) for v in x))
    return (type(x).__name__, x)


def assert_same_stream(got: list, expected: list) -> None:
    assert expected, "the reference stream is empty: this configuration tests nothing"
    assert len(got) == len(expected), f"{len(got)} batches != torch's {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        assert_same(g, e, f"batch {i}")


def assert_same_multiset(got: list, expected: list) -> None:
    assert expected, "the reference stream is empty: this configuration tests nothing"
    g, e = collections.Counter(map(canon, got)), collections.Counter(map(canon, expected))
    assert g == e, (
        f"{len(got)} batches vs torch's {len(expected)}; "
        f"{sum((g - e).values())} unexpected, {sum((e - g).values())} missing"
    )


def indices(batches: list) -> list[int]:
    """The sample indices of a list of dict batches, in order."""
    return [int(i) for b in batches for i in torch.as_tensor(b["idx"]).flatten().tolist()]


# --------------------------------------------------------------------------------------------
# process helpers


def live_children() -> set[int]:
    """Our child processes (recursive), excluding multiprocessing's long-lived helpers."""
    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            out.add(child.pid)  # a zombie is still ours until reaped
            continue
        except psutil.AccessDenied:
            cmd = ""
        if not any(h in cmd for h in ("forkserver", "resource_tracker")):
            out.add(child.pid)
    return out


def wait_gone(pids: set[int], *, zombie_is_gone: bool = False) -> set[int]:
    """Poll until no pid in ``pids`` is alive (or the deadline passes); returns those left."""

    def alive() -> set[int]:
        left = set()
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                if zombie_is_gone and proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                left.add(pid)
            except psutil.NoSuchProcess:
                pass
        return left

    end = time.monotonic() + GONE_DEADLINE_S
    left = alive()
    while left and time.monotonic() < end:
        time.sleep(0.02)
        left = alive()
    return left


def our_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("resumable_loader")}


@pytest.fixture(scope="module")
def mp_helpers():
    """Start multiprocessing's forkserver and resource tracker before the leak snapshot.

    They live for the rest of the session (and keep an fd open); started lazily inside a test,
    the leak check would blame that test for them. The forkserver preloads torch, as users do,
    so each forkserver worker costs a fork rather than a torch import (no effect if an earlier
    test already started it).
    """
    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    multiprocessing.set_forkserver_preload(["torch", "numpy", "_datasets"])
    forkserver.ensure_running()
    resource_tracker.ensure_running()


@pytest.fixture(autouse=True)
def _restore_rngs():
    """Tests below seed the global RNGs; leave them as we found them."""
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    yield
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


# --------------------------------------------------------------------------------------------
# 1. constructor parity


def test_signature_extends_torchs() -> None:
    theirs = list(inspect.signature(TorchDataLoader).parameters.values())
    ours = list(inspect.signature(Ours).parameters.values())

    def shape(params):
        return [(p.name, p.kind, p.default) for p in params]

    assert shape(ours[: len(theirs)]) == shape(theirs)
    extras = ours[len(theirs) :]
    for p in extras:
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, f"extra parameter {p.name} not kw-only"
        assert p.default is not inspect.Parameter.empty, f"extra parameter {p.name} lacks default"


def test_subscript_and_isinstance() -> None:
    alias = Ours[int]
    assert typing.get_origin(alias) is Ours
    loader = alias(RangeDataset(3))
    assert isinstance(loader, Ours)
    assert isinstance(loader, TorchDataLoader)


_ITERABLE = ShardedStream(5)
_SAMPLER = EveryOtherReversedSampler(5)
_BATCH_SAMPLER = VariableBatchSampler(5)

INVALID_ARGS = {
    "num_workers<0": dict(num_workers=-1),
    "timeout<0": dict(timeout=-1),
    "prefetch_factor-without-workers": dict(prefetch_factor=2),
    "prefetch_factor<0": dict(num_workers=2, prefetch_factor=-1),
    "persistent-without-workers": dict(persistent_workers=True),
    "iterable+shuffle": dict(dataset=_ITERABLE, shuffle=True),
    "iterable+sampler": dict(dataset=_ITERABLE, sampler=_SAMPLER),
    "iterable+batch_sampler": dict(dataset=_ITERABLE, batch_sampler=_BATCH_SAMPLER),
    "sampler+shuffle": dict(sampler=_SAMPLER, shuffle=True),
    "batch_sampler+batch_size": dict(batch_sampler=_BATCH_SAMPLER, batch_size=2),
    "batch_sampler+shuffle": dict(batch_sampler=_BATCH_SAMPLER, shuffle=True),
    "batch_sampler+sampler": dict(batch_sampler=_BATCH_SAMPLER, sampler=_SAMPLER),
    "batch_sampler+drop_last": dict(batch_sampler=_BATCH_SAMPLER, drop_last=True),
    "batch_size=None+drop_last": dict(batch_size=None, drop_last=True),
    "mp_context-bad-string": dict(num_workers=2, multiprocessing_context="bogus"),
    "mp_context-bad-type": dict(num_workers=2, multiprocessing_context=42),
    "mp_context-without-workers": dict(multiprocessing_context="fork"),
}


@pytest.mark.parametrize("kwargs", INVALID_ARGS.values(), ids=INVALID_ARGS.keys())
def test_invalid_arguments_raise_like_torch(kwargs: dict) -> None:
    kwargs = {"dataset": RangeDataset(5), **kwargs}
    with pytest.raises(Exception) as theirs:
        TorchDataLoader(**kwargs)
    with pytest.raises(Exception) as ours:
        Ours(**kwargs)
    assert type(ours.value) is type(theirs.value)
    assert str(ours.value) == str(theirs.value)


# Arguments torch's constructor stores unchecked, so that they fail at the first batch (or, for
# prefetch_factor=0 ... torch's iterator asserts): refused when the loader is built, saying
# what to pass.
DEFERRED_ARGS = {
    "generator-int": (
        dict(generator=1234),
        TypeError,
        r"torch\.Generator\(\)\.manual_seed\(1234\)",
    ),
    "generator-int-shuffle": (dict(generator=7, shuffle=True), TypeError, r"manual_seed\(7\)"),
    "generator-numpy": (
        dict(generator=np.random.default_rng(0)),
        TypeError,
        r"got numpy\.random\._generator\.Generator .*manual_seed\(seed\)",
    ),
    "prefetch_factor=0": (dict(num_workers=1, prefetch_factor=0), ValueError, r"an int >= 1"),
    "prefetch_factor=1.5": (dict(num_workers=1, prefetch_factor=1.5), TypeError, r"got float 1\.5"),
}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"), DEFERRED_ARGS.values(), ids=DEFERRED_ARGS.keys()
)
def test_arguments_torch_checks_at_the_first_batch_are_refused_when_built(
    kwargs: dict, error: type[Exception], message: str
) -> None:
    kwargs = {"dataset": RangeDataset(5), **kwargs}
    TorchDataLoader(**kwargs)  # torch builds it, and fails when iterated
    if "prefetch_factor" not in kwargs or kwargs["prefetch_factor"]:
        # (With prefetch_factor=0 its iterator's assert leaves a half-built iterator whose
        # __del__ raises too.)
        assert torch_error_type(**kwargs) is error
    with pytest.raises(error, match=message):
        Ours(**kwargs)


def test_a_torch_generator_subclass_is_accepted() -> None:
    class Seeded(torch.Generator):
        pass

    def order(gen: torch.Generator) -> list[int]:
        return [int(b) for b in Ours(list(range(20)), shuffle=True, generator=gen)]

    first = order(Seeded().manual_seed(3))
    assert sorted(first) == list(range(20))
    assert order(Seeded().manual_seed(3)) == first


LEN_CASES = {
    "map-bs1": dict(dataset=RangeDataset(N)),
    "map-bs7": dict(dataset=RangeDataset(N), batch_size=7),
    "map-bs7-drop_last": dict(dataset=RangeDataset(N), batch_size=7, drop_last=True),
    "map-bsNone": dict(dataset=RangeDataset(N), batch_size=None),
    "map-shuffle-bs7-drop_last": dict(
        dataset=RangeDataset(N), batch_size=7, shuffle=True, drop_last=True
    ),
    "sampler-bs7": dict(
        dataset=RangeDataset(N), sampler=EveryOtherReversedSampler(N), batch_size=7
    ),
    "batch_sampler": dict(dataset=RangeDataset(N), batch_sampler=VariableBatchSampler(N)),
    "iterable_len-bs1": dict(dataset=StreamWithLen(N)),
    "iterable_len-bs7": dict(dataset=StreamWithLen(N), batch_size=7),
    "iterable_len-bs7-drop_last": dict(dataset=StreamWithLen(N), batch_size=7, drop_last=True),
    "iterable_len-bsNone": dict(dataset=StreamWithLen(N), batch_size=None),
    "iterable_len-bs7-w2": dict(dataset=StreamWithLen(N), batch_size=7, num_workers=2),
    "map-bs7-w2": dict(dataset=RangeDataset(N), batch_size=7, num_workers=2),
}


@pytest.mark.parametrize("kwargs", LEN_CASES.values(), ids=LEN_CASES.keys())
def test_len_matches_torch(kwargs: dict) -> None:
    expected = len(TorchDataLoader(**kwargs))
    assert len(Ours(**kwargs)) == expected


def test_len_of_unsized_iterable_raises_like_torch() -> None:
    with pytest.raises(Exception) as theirs:
        len(TorchDataLoader(ShardedStream(N), batch_size=7))
    with pytest.raises(Exception) as ours:
        len(Ours(ShardedStream(N), batch_size=7))
    assert type(ours.value) is type(theirs.value)


FROZEN_ATTRS = {
    "batch_size": 3,
    "batch_sampler": VariableBatchSampler(5),
    "sampler": EveryOtherReversedSampler(5),
    "drop_last": True,
    "dataset": RangeDataset(3),
    "persistent_workers": True,
}


@pytest.mark.parametrize("attr", FROZEN_ATTRS)
def test_setting_attribute_after_init_raises_like_torch(attr: str) -> None:
    with pytest.raises(Exception) as theirs:
        setattr(TorchDataLoader(RangeDataset(5)), attr, FROZEN_ATTRS[attr])
    with pytest.raises(Exception) as ours:
        setattr(Ours(RangeDataset(5)), attr, FROZEN_ATTRS[attr])
    assert type(ours.value) is type(theirs.value)
    assert str(ours.value) == str(theirs.value)


# --------------------------------------------------------------------------------------------
# 2. stream parity without randomness

# Factories, so each loader gets its own dataset and sampler objects.
DATASETS: dict[str, Callable[[], dict]] = {
    "map": lambda: dict(dataset=RangeDataset(N)),
    "sampler": lambda: dict(
        dataset=RangeDataset(N, as_tuple=True), sampler=EveryOtherReversedSampler(N)
    ),
    "iterable": lambda: dict(dataset=ShardedStream(N)),
    "uneven_iterable": lambda: dict(dataset=UnevenStream(8)),
}
BATCHINGS = {
    "bsNone": dict(batch_size=None),
    "bs1": dict(batch_size=1),
    "bs7": dict(batch_size=7),
    "bs7-drop_last": dict(batch_size=7, drop_last=True),
}
# (num_workers, in_order); in_order=False is meaningless without workers.
WORKERS = {
    "w0": (0, True),
    "w1": (1, True),
    "w2": (2, True),
    "w2-unordered": (2, False),
    "w4": (4, True),
    "w4-unordered": (4, False),
}


def _stream_configs():
    data = [(f"{d}-{b}", DATASETS[d], BATCHINGS[b]) for d in DATASETS for b in BATCHINGS]
    data.append(
        (
            "batch_sampler",
            lambda: dict(dataset=RangeDataset(N), batch_sampler=VariableBatchSampler(N)),
            {},
        )
    )
    for name, make, batching in data:
        for wname, (workers, in_order) in WORKERS.items():
            yield pytest.param(make, batching, workers, in_order, id=f"{name}-{wname}")


def _kwargs(make, batching, workers, in_order, context="fork", **extra) -> dict:
    kwargs = {**make(), **batching, "num_workers": workers, "in_order": in_order, **extra}
    if workers:
        kwargs["multiprocessing_context"] = context
    return kwargs


@pytest.mark.parametrize(("make", "batching", "workers", "in_order"), list(_stream_configs()))
def test_stream_matches_torch(make, batching, workers, in_order) -> None:
    expected = list(TorchDataLoader(**_kwargs(make, batching, workers, in_order)))
    got = list(Ours(**_kwargs(make, batching, workers, in_order)))
    if in_order:
        assert_same_stream(got, expected)
    else:
        assert_same_multiset(got, expected)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
@pytest.mark.parametrize("dataset", ["map", "uneven_iterable"])
def test_stream_matches_torch_per_start_method(mp_helpers, dataset: str, context: str) -> None:
    # torch's stream does not depend on the start method: its reference runs under cheap fork.
    make = DATASETS[dataset]
    expected = list(TorchDataLoader(**_kwargs(make, BATCHINGS["bs7"], 2, True, "fork")))
    got = list(Ours(**_kwargs(make, BATCHINGS["bs7"], 2, True, context)))
    assert_same_stream(got, expected)


@pytest.mark.parametrize(
    ("dataset", "batching"), [("map", "bs7"), ("iterable", "bs7"), ("uneven_iterable", "bs1")]
)
def test_persistent_workers_match_torch_each_epoch(dataset: str, batching: str) -> None:
    args = (DATASETS[dataset], BATCHINGS[batching], 2, True)
    theirs = TorchDataLoader(**_kwargs(*args, persistent_workers=True))
    ours = Ours(**_kwargs(*args, persistent_workers=True))
    for epoch in range(3):
        expected = list(theirs)
        got = list(ours)
        try:
            assert_same_stream(got, expected)
        except AssertionError as e:
            raise AssertionError(f"epoch {epoch}: {e}") from None


def _pin_warnings(record: list[warnings.WarningMessage]) -> list[type[Warning]]:
    return [w.category for w in record if "pin_memory" in str(w.message)]


def _accelerator() -> bool:
    acc = getattr(torch, "accelerator", None)
    return bool(acc.is_available() if acc is not None else torch.cuda.is_available())


def _pinned(batches: list[Any]) -> list[bool]:
    """Whether each tensor of ``batches`` (in order, containers walked) is page-locked."""
    out: list[bool] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x.is_pinned())
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(batches)
    return out


@pytest.mark.skipif(not _accelerator(), reason="needs an accelerator (CUDA): pinning is real")
@pytest.mark.parametrize("workers", [0, 2], ids=["w0", "w2"])
def test_pin_memory_with_accelerator_matches_torch(workers: int) -> None:
    args = (DATASETS["map"], BATCHINGS["bs7"], workers, True)
    with warnings.catch_warnings(record=True) as theirs_w:
        warnings.simplefilter("always")
        expected = list(TorchDataLoader(**_kwargs(*args, pin_memory=True)))
    with warnings.catch_warnings(record=True) as ours_w:
        warnings.simplefilter("always")
        got = list(Ours(**_kwargs(*args, pin_memory=True)))
    assert _pin_warnings(ours_w) == _pin_warnings(theirs_w)
    theirs, ours = _pinned(expected), _pinned(got)
    assert theirs and all(theirs), "torch's loader pins every tensor with an accelerator"
    assert ours == theirs
    assert_same_stream(got, expected)


@pytest.mark.skipif(_accelerator(), reason="an accelerator is present: pinning is real")
@pytest.mark.parametrize("workers", [0, 2], ids=["w0", "w2"])
def test_pin_memory_without_accelerator_matches_torch(workers: int) -> None:
    args = (DATASETS["map"], BATCHINGS["bs7"], workers, True)
    with warnings.catch_warnings(record=True) as theirs_w:
        warnings.simplefilter("always")
        expected = list(TorchDataLoader(**_kwargs(*args, pin_memory=True)))
    with warnings.catch_warnings(record=True) as ours_w:
        warnings.simplefilter("always")
        got = list(Ours(**_kwargs(*args, pin_memory=True)))
    assert _pin_warnings(ours_w) == _pin_warnings(theirs_w)
    # and ours points at the caller's line, not into the library
    assert {w.filename for w in ours_w if "pin_memory" in str(w.message)} == {__file__}
    assert_same_stream(got, expected)


# --------------------------------------------------------------------------------------------
# 3. shuffling


def _shuffled(workers: int, **extra) -> Ours:
    kwargs = dict(batch_size=7, shuffle=True, num_workers=workers, **extra)
    if workers:
        kwargs["multiprocessing_context"] = "fork"
    return Ours(RangeDataset(N), **kwargs)


@pytest.mark.parametrize("drop_last", [False, True], ids=["keep_last", "drop_last"])
@pytest.mark.parametrize("workers", [0, 2], ids=["w0", "w2"])
def test_shuffled_epoch_covers_dataset_in_torchs_batch_sizes(workers: int, drop_last: bool) -> None:
    theirs = TorchDataLoader(RangeDataset(N), batch_size=7, shuffle=True, drop_last=drop_last)
    expected_sizes = [len(b["idx"]) for b in theirs]
    batches = list(_shuffled(workers, drop_last=drop_last))
    assert [len(b["idx"]) for b in batches] == expected_sizes
    seen = indices(batches)
    assert len(set(seen)) == len(seen), "a sample was delivered twice in one epoch"
    if drop_last:
        assert set(seen) <= set(range(N))
    else:
        assert sorted(seen) == list(range(N))
    assert seen != sorted(seen), "shuffle=True delivered the samples in order"


@pytest.mark.parametrize("workers", [0, 2], ids=["w0", "w2"])
def test_shuffled_consecutive_epochs_differ(workers: int) -> None:
    loader = _shuffled(workers)
    first, second = indices(list(loader)), indices(list(loader))
    assert sorted(first) == sorted(second) == list(range(N))
    assert first != second


def _seeded_orders(how: str, seed: int, workers: int) -> list[list[int]]:
    """Two epochs of a freshly built shuffled loader, seeded the way ``how`` says."""
    if how == "global":
        torch.manual_seed(seed)
        loader = _shuffled(workers)
    else:
        torch.manual_seed(seed + 1)  # the global RNG must not matter when a generator is given
        loader = _shuffled(workers, generator=torch.Generator().manual_seed(seed))
    return [indices(list(loader)) for _ in range(2)]


@pytest.mark.parametrize("workers", [0, 2], ids=["w0", "w2"])
@pytest.mark.parametrize("how", ["global", "generator"])
def test_shuffle_same_seed_same_order(how: str, workers: int) -> None:
    first = _seeded_orders(how, SEED, workers)
    if how == "generator":
        torch.manual_seed(SEED + 99)  # ...really must not matter
    assert _seeded_orders(how, SEED, workers) == first
    assert first[0] != first[1]


@pytest.mark.parametrize("workers", [0, 2], ids=["w0", "w2"])
@pytest.mark.parametrize("how", ["global", "generator"])
def test_shuffle_different_seed_different_order(how: str, workers: int) -> None:
    assert _seeded_orders(how, SEED, workers) != _seeded_orders(how, SEED + 1, workers)


@pytest.mark.parametrize("workers", [0, 2], ids=["w0", "w2"])
@pytest.mark.parametrize("how", ["global", "generator"])
def test_reseeding_one_loader_before_each_epoch_repeats_it_like_torch(how: str, workers: int):
    # torch draws the epoch's seed at iter(): reseeding before iter() repeats the epoch, on the
    # same loader object, however many epochs it has run.
    def orders(cls) -> list[list[int]]:
        g = torch.Generator()
        loader = cls(
            RangeDataset(20),
            batch_size=4,
            shuffle=True,
            num_workers=workers,
            generator=g if how == "generator" else None,
            **({"multiprocessing_context": "fork"} if workers else {}),
        )
        out = []
        for seed in (SEED, SEED, SEED + 1, SEED):
            (g if how == "generator" else torch.random.default_generator).manual_seed(seed)
            out.append(indices(list(loader)))
        return out

    for got in (orders(TorchDataLoader), orders(Ours)):
        assert got[0] == got[1] == got[3] != got[2]


def _augmentations(seed: int) -> list[tuple[float, ...]]:
    torch.manual_seed(seed)
    loader = Ours(RandomAugDataset(12), batch_size=3, num_workers=2, multiprocessing_context="fork")
    return [
        tuple(b["py"].tolist() + b["np"].tolist() + b["torch"].flatten().tolist()) for b in loader
    ]


def test_worker_random_draws_reproducible_with_seed() -> None:
    first = _augmentations(SEED)
    assert _augmentations(SEED) == first
    assert _augmentations(SEED + 1) != first
    # Each worker is seeded differently: no two batches drew the same numbers.
    assert len(set(first)) == len(first)


# --------------------------------------------------------------------------------------------
# 4. worker_init_fn and get_worker_info


def _init_records(path: Path) -> list[tuple[int, int]]:
    if not path.exists():
        return []
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("workers", [1, 3], ids=["w1", "w3"])
def test_worker_init_fn_called_once_per_worker(tmp_path: Path, workers: int) -> None:
    path = tmp_path / "init.txt"
    loader = Ours(
        RangeDataset(N),
        batch_size=2,
        num_workers=workers,
        multiprocessing_context="fork",
        worker_init_fn=functools.partial(record_worker_init, str(path)),
    )
    assert len(list(loader)) == len(loader)
    records = _init_records(path)
    assert sorted(wid for wid, _ in records) == list(range(workers))
    assert len({pid for _, pid in records}) == workers
    assert os.getpid() not in {pid for _, pid in records}


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh_workers", "persistent"])
def test_worker_init_fn_calls_over_epochs_match_torch(tmp_path: Path, persistent: bool) -> None:
    counts = []
    for k, cls in enumerate((TorchDataLoader, Ours)):
        path = tmp_path / f"init{k}.txt"
        loader = cls(
            RangeDataset(8),
            batch_size=2,
            num_workers=2,
            multiprocessing_context="fork",
            persistent_workers=persistent,
            worker_init_fn=functools.partial(record_worker_init, str(path)),
        )
        for _ in range(3):
            list(loader)
        counts.append(collections.Counter(wid for wid, _ in _init_records(path)))
        del loader
    theirs, ours = counts
    assert ours == theirs


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_get_worker_info_in_workers(mp_helpers, context: str) -> None:
    n = 8
    items = list(
        Ours(WorkerInfoDataset(n), batch_size=None, num_workers=2, multiprocessing_context=context)
    )
    assert [it["idx"] for it in items] == list(range(n))
    assert get_worker_info() is None
    seeds: dict[int, set[int]] = collections.defaultdict(set)
    for it in items:
        assert it["in_worker"], f"item {it['idx']}: get_worker_info() was None in a worker"
        assert it["pid"] != os.getpid()
        assert it["num_workers"] == 2
        assert it["dataset_type"] == "WorkerInfoDataset"
        assert it["dataset_n"] == n
        assert it["seed_type"] == "int"
        seeds[it["id"]].add(it["seed"])
    assert set(seeds) == {0, 1}
    assert not seeds[0] & seeds[1], "two workers share a seed"


def test_get_worker_info_is_none_in_main_process() -> None:
    items = list(Ours(WorkerInfoDataset(4), batch_size=None))
    assert [it["in_worker"] for it in items] == [False] * 4
    assert {it["pid"] for it in items} == {os.getpid()}
    assert get_worker_info() is None


# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("batch_size", [None, 3])
def test_task_i_goes_to_worker_i_mod_n_like_torch(workers: int, batch_size: int | None) -> None:
    # Users and tests read get_worker_info().id inside a batch: while every worker is healthy
    # the assignment is torch's (task i -> worker i mod n), also for the first batches.
    kwargs = dict(
        dataset=WorkerInfoDataset(20),
        batch_size=batch_size,
        num_workers=workers,
        multiprocessing_context="fork",
    )

    def ids(loader) -> list:
        if batch_size is None:
            return [b["id"] for b in loader]
        return [b["id"].tolist() for b in loader]

    expected = ids(TorchDataLoader(**kwargs))
    assert ids(Ours(**kwargs)) == expected
    # A resume continues the turns where the uninterrupted run was: batch k on worker k mod n.
    ours = Ours(**kwargs)
    it = iter(ours)
    for _ in range(5):
        next(it)
    sd = ours.state_dict()
    ours.close()
    resumed = Ours(**kwargs)
    resumed.load_state_dict(sd)
    with resumed:
        assert ids(resumed) == expected[5:]


class IterRaises(torch.utils.data.IterableDataset):
    def __iter__(self):
        raise ValueError("Error in __iter__")


class Unpicklable(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.transform = lambda x: x  # a lambda cannot be pickled for spawn/forkserver

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return self.transform(i)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_an_unpicklable_dataset_warns_and_raises_like_torch(mp_helpers, context: str) -> None:
    def outcome(cls) -> tuple[type, str, list[str]]:
        loader = cls(Unpicklable(), num_workers=2, multiprocessing_context=context)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(Exception) as info:
                iter(loader)
        said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        return info.type, str(info.value), said

    expected = outcome(TorchDataLoader)
    collect_torch_reference_garbage()
    before = Resources.now()
    with warnings.catch_warnings():
        # The pipes of the worker that could not start are closed, not left to the collector.
        warnings.simplefilter("error", ResourceWarning)
        got = outcome(Ours)
    assert got[:2] == expected[:2]
    assert [m[:40] for m in got[2]] == [m[:40] for m in expected[2]]
    assert got[2][0].startswith("Got pickle error when attempting to start a worker Process")
    assert leaks_since(before) == []


class HeldFirstItem(torch.utils.data.Dataset):
    """Item 0 is held back until the main process has received item 9: a slow sample whose
    slowness ends on a signal, not after a guessed time."""

    def __init__(self, release) -> None:
        self.release = release

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        if i == 0:
            assert self.release.wait(60), "item 9 never arrived"
        return i


class HeldFirstStream(torch.utils.data.IterableDataset):
    """Worker w yields w, w + n, ...; worker 0 holds its first item like ``HeldFirstItem``."""

    def __init__(self, release) -> None:
        self.release = release

    def __iter__(self):
        info = get_worker_info()
        for i in range(info.id, 10, info.num_workers):
            if i == 0:
                assert self.release.wait(60), "item 9 never arrived"
            yield i


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_in_order_false_passes_a_slow_worker_by_like_torch(kind: str) -> None:
    # torch, with in_order=False, gives the next task to the next worker that has room and
    # hands results over as they arrive: the other worker's items overtake the held one.
    import multiprocessing

    def order(cls) -> list[int]:
        release = multiprocessing.get_context("fork").Event()
        ds = HeldFirstItem(release) if kind == "map" else HeldFirstStream(release)
        loader = cls(
            ds,
            batch_size=None,
            num_workers=2,
            prefetch_factor=2,
            in_order=False,
            multiprocessing_context="fork",
        )
        got = []
        for x in loader:
            got.append(int(x))
            if got[-1] == 9:
                release.set()
        return got

    expected = order(TorchDataLoader)
    assert expected == (
        [1, 3, 4, 5, 6, 7, 8, 9, 0, 2] if kind == "map" else [1, 3, 5, 7, 9, 0, 2, 4, 6, 8]
    )
    assert order(Ours) == expected


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_in_dataset_iter_is_raised_like_torch(workers: int) -> None:
    # The dataset's own error, with its type and message -- not a crash to retry.
    kw = dict(dataset=IterRaises(), num_workers=workers, multiprocessing_context="fork")
    if not workers:
        kw.pop("multiprocessing_context")
    their_type = torch_error_type(**kw)
    assert issubclass(their_type, ValueError)
    loader = Ours(**kw)
    with loader, pytest.raises(ValueError, match="Error in __iter__") as ours:
        list(loader)
    assert type(ours.value) is their_type
    assert loader.statistics().respawns == 0
    if workers:
        assert "in iter() of the dataset" in str(ours.value)


class LongerThanItsLen(torch.utils.data.IterableDataset):
    """Says 4, yields 6 (and, unsharded, every worker yields all 6)."""

    def __len__(self) -> int:
        return 4

    def __iter__(self):
        return iter(range(6))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_longer_than_its_len_warns_like_torch(workers: int) -> None:
    def warned(cls) -> list[int]:
        kw = dict(dataset=LongerThanItsLen(), batch_size=None, num_workers=workers)
        if workers:
            kw["multiprocessing_context"] = "fork"
        loader = cls(**kw)
        assert len(loader) == 4  # what arms the check, in torch too
        at = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n, _ in enumerate(loader, start=1):
                said = [
                    str(w.message) for w in caught if "Length of IterableDataset" in str(w.message)
                ]
                # torch's own test matches this much of the text with workers.
                assert all(
                    not workers or "For multiprocessing data-loading, this" in m for m in said
                )
                at += [n for _ in said]
                caught.clear()
        close = getattr(loader, "close", None)
        if close is not None:
            close()
        return at

    expected = warned(TorchDataLoader)
    assert expected == list(range(5, 7 if not workers else 13))
    assert warned(Ours) == expected  # one warning per batch past the reported length


def _seeding_init(worker_id: int) -> None:
    torch.manual_seed(12345)


class InitialSeed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return torch.initial_seed()


@pytest.mark.parametrize("init", [None, _seeding_init], ids=["no-init", "seeding-init"])
def test_a_worker_init_fn_that_seeds_keeps_its_seed_and_is_told_draws_are_per_batch(init) -> None:
    # torch.initial_seed() in a worker reads as in torch: the seed worker_init_fn set, else the
    # worker's own (get_worker_info().seed). The draws are re-seeded per batch (exact values
    # after a resume), which overrides the user's seeding: said once, not silently.
    loader = Ours(
        InitialSeed(),
        batch_size=None,
        num_workers=2,
        worker_init_fn=init,
        multiprocessing_context="fork",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seeds = list(loader)
    told = [w for w in caught if "worker_init_fn called torch.manual_seed()" in str(w.message)]
    assert len(told) == (1 if init else 0)
    if init:
        assert seeds == [12345] * len(seeds)
    else:
        # Two workers, each reporting its own seed for every batch it loaded (i mod 2).
        assert len(set(seeds)) == 2 and seeds[0::2] == [seeds[0]] * len(seeds[0::2])
    draws = list(Ours(_DrawAndSeed(), batch_size=None, num_workers=2, worker_init_fn=init))
    assert len({d for d, _ in draws}) == len(draws), "the draws are not per batch"


class _DrawAndSeed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> tuple[float, int]:
        return float(torch.rand(1)), torch.initial_seed()


# 5. errors


def drain(loader, limit: int = 500) -> list:
    """Everything ``next()`` produces: ("batch", b) or ("error", exception), until exhausted."""
    events: list = []
    it = iter(loader)
    while len(events) < limit:
        try:
            events.append(("batch", next(it)))
        except StopIteration:
            return events
        except Exception as e:
            # Without its traceback: that refers to this frame, which holds ``events`` -- a
            # reference cycle that would keep the iterator alive past the leak check.
            events.append(("error", e.with_traceback(None)))
    raise AssertionError(f"the loader was still producing after {limit} events")


ERROR_CASES = {
    "map-ValueError": dict(dataset=FailingDataset(N, bad={5, 30}), batch_size=4),
    "map-KeyError": dict(dataset=FailingDataset(N, bad={5}, exc=KeyError), batch_size=4),
    "map-bsNone-ValueError": dict(dataset=FailingDataset(12, bad={3}), batch_size=None),
    "iterable-ValueError": dict(dataset=FailingStream(N, bad={9}), batch_size=3),
    "collate-ValueError": dict(
        dataset=RangeDataset(N), batch_size=4, collate_fn=FailingCollate(bad={6, 33})
    ),
}


@pytest.mark.parametrize("workers", [0, 2], ids=["w0", "w2"])
@pytest.mark.parametrize("kwargs", ERROR_CASES.values(), ids=ERROR_CASES.keys())
def test_errors_reraised_and_iteration_continues_like_torch(kwargs: dict, workers: int) -> None:
    if workers:
        kwargs = dict(kwargs, num_workers=workers, multiprocessing_context="fork")
    # torch's errors as (type, last line of the message), so that none of its objects (which
    # it keeps alive in a cycle) is still referenced when its garbage is collected
    expected = [
        (kind, (type(e), str(e).strip().splitlines()[-1]) if kind == "error" else e)
        for kind, e in drain(TorchDataLoader(**kwargs))
    ]
    collect_torch_reference_garbage()
    got = drain(Ours(**kwargs))
    assert any(kind == "error" for kind, _ in expected), "the reference raised nothing"
    assert [k for k, _ in got] == [k for k, _ in expected], "errors at other positions than torch"
    for i, ((kind, g), (_, e)) in enumerate(zip(got, expected)):
        if kind == "error":
            etype, last_line = e
            assert type(g) is etype, f"event {i}: {type(g).__name__} != {etype.__name__}"
            original = last_line.split(": ", 1)[-1].strip("'\"")
            assert original in str(g), f"event {i}: {original!r} not in {str(g)!r}"
        else:
            assert_same(g, e, f"batch {i}")


def test_timeout_raises_runtime_error_like_torch() -> None:
    kwargs = dict(
        dataset=SlowDataset(4, slow={0}, delay=1.0),
        batch_size=2,
        num_workers=1,
        timeout=0.2,
        multiprocessing_context="fork",
    )
    for cls in (TorchDataLoader, Ours):
        it = iter(cls(**kwargs))
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="timed out"):
            try:
                next(it)
            finally:
                elapsed = time.monotonic() - start
        assert elapsed < 0.9, f"{cls.__module__}: raised after {elapsed:.2f}s, not at the timeout"
        del it


# --------------------------------------------------------------------------------------------
# 6. teardown


def _two_worker_loader(cls=None, **extra):
    return (cls or Ours)(
        RangeDataset(N), batch_size=2, num_workers=2, multiprocessing_context="fork", **extra
    )


def _assert_workers_gone(workers: set[int]) -> None:
    assert len(workers) >= 2, f"expected 2 worker processes while iterating, saw {workers}"
    left = wait_gone(workers)
    assert not left, f"worker processes {sorted(left)} still alive"


def test_teardown_after_break() -> None:
    before = live_children()
    workers: set[int] = set()
    for i, _ in enumerate(_two_worker_loader()):
        workers = live_children() - before
        if i == 2:
            break
    _assert_workers_gone(workers)


def test_teardown_after_del_iterator() -> None:
    before = live_children()
    loader = _two_worker_loader()
    it = iter(loader)
    next(it)
    workers = live_children() - before
    del it
    _assert_workers_gone(workers)


def test_teardown_after_exception_in_loop_body() -> None:
    before = live_children()
    workers: set[int] = set()

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        for _ in _two_worker_loader():
            workers = live_children() - before
            raise Boom
    _assert_workers_gone(workers)


def test_teardown_persistent_workers_after_del_loader() -> None:
    before = live_children()
    loader = _two_worker_loader(persistent_workers=True)
    list(loader)
    next(iter(loader))
    workers = live_children() - before
    del loader
    _assert_workers_gone(workers)


@ours_only
def test_teardown_after_close() -> None:
    before = live_children()
    loader = _two_worker_loader()
    it = iter(loader)
    next(it)
    workers = live_children() - before
    loader.close()
    _assert_workers_gone(workers)
    assert not our_threads(), f"threads left after close(): {our_threads()}"
    del it


@ours_only
def test_teardown_after_with_block() -> None:
    before = live_children()
    with _two_worker_loader() as loader:
        assert isinstance(loader, Ours)
        it = iter(loader)
        next(it)
        workers = live_children() - before
    _assert_workers_gone(workers)
    assert not our_threads(), f"threads left after the with block: {our_threads()}"
    del it


_EXIT_SCRIPT = textwrap.dedent(
    """
    import sys

    import psutil

    if sys.argv[1] == "torch":
        from torch.utils.data import DataLoader
    else:
        from resumable_loader import DataLoader
    from _datasets import RangeDataset

    loader = DataLoader(
        RangeDataset(16), batch_size=2, num_workers=2, multiprocessing_context="fork"
    )
    it = iter(loader)
    batch = next(it)
    print(" ".join(str(p.pid) for p in psutil.Process().children(recursive=True)), flush=True)
    if sys.argv[2] == "exception":
        raise SystemExit("leaving with an error, loader still open")
    """
)


@pytest.mark.parametrize("how", ["return", "exception"])
def test_workers_gone_after_interpreter_exit(how: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]))
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, "torch" if SELFTEST else "ours", how],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == (0 if how == "return" else 1), proc.stderr
    workers = {int(p) for p in proc.stdout.split()}
    assert len(workers) >= 2, f"script saw worker pids {workers}; stderr: {proc.stderr}"
    # Orphaned workers are reparented; a zombie waiting on a non-reaping init has exited.
    left = wait_gone(workers, zombie_is_gone=True)
    assert not left, f"worker processes {sorted(left)} outlived their interpreter"


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's datapipes are deprecated
@pytest.mark.parametrize("workers", [0, 2], ids=["w0", "w2"])
def test_datapipe_shuffle_and_sharding_like_torch(workers: int) -> None:
    # torch shards a datapipe's sharding_filter across workers and seeds its shufflers with one
    # seed shared by them: each sample once per epoch, and the same epoch after reseeding.
    from torch.utils.data.datapipes.iter import IterableWrapper

    def epochs(cls) -> list[list[int]]:
        dp = IterableWrapper(range(20)).shuffle().sharding_filter()
        kw = {"multiprocessing_context": "fork"} if workers else {}
        loader = cls(dp, batch_size=None, shuffle=True, num_workers=workers, **kw)
        out = []
        for seed in (SEED, SEED, SEED + 1):
            torch.manual_seed(seed)
            out.append([int(x) for x in loader])
        return out

    for got in (epochs(TorchDataLoader), epochs(Ours)):
        assert all(sorted(e) == list(range(20)) for e in got)
        assert got[0] == got[1] != got[2]
