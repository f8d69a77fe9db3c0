"""Fuzzing the loader end to end: kills, hangs, transient errors, checkpoints, epochs.

Two Hypothesis ``RuleBasedStateMachine``s drive one loader each through a drawn configuration
-- a map dataset (six kinds of sampler) or one of three streams (state on the dataset, on the
iterator, none), 0-3 workers, prefetch 1-3, persistent workers, in_order, batch size None or
1-4, drop_last, the pin thread, stream_state_every, the start method (fork mostly; forkserver
and spawn rarely, since a spawned worker takes seconds to start) -- and a few faults drawn with
it (``FaultyDataset`` crashes in a chosen worker, transient errors for a ``RetryPolicy``):

* ``LoaderMachine`` -- every rule below, 0-3 workers;
* ``KillMachine`` -- 1-3 workers, and the rules that kill workers weigh more: each kill is
  followed by batches, so the replacement is exercised, and a checkpoint can be taken while a
  death is still unnoticed.

Rules:

* ``take``: the next 1-4 batches;
* ``kill``: SIGKILL, SIGSEGV or SIGSTOP (with ``task_timeout``) sent to one or every live
  worker from outside;
* ``arm``: the next fetch of a sample raises a transient error, or makes its worker exit
  (``os._exit`` can only happen inside the worker);
* ``checkpoint``: ``state_dict()`` through dict, ``dump_state`` bytes, torch.save
  (``weights_only`` load) or json, then continue from it -- in a freshly built loader with
  another generator, after the global RNG was reseeded and drawn from (for map-style
  datasets, often with other num_workers / prefetch / persistence / start method) or in the
  same loader via ``load_state_dict``;
* ``rewind``: go back to an earlier checkpoint, in a fresh loader;
* ``new_epoch``: ``iter(loader)`` again, abandoning the rest of the epoch where the next epoch
  is then still well defined (else the epoch is finished first);
* ``abandon``: leave the loop the ways training loops do (issue #9) -- ``break`` after 1-3
  batches, ``islice`` over the iterator, ``for batch in islice(loader, j)`` (a new ``iter()``:
  the next epoch), an exception or ``KeyboardInterrupt`` raised in the loop body, or
  ``del it`` -- and drop the iterator.
  Then ``state_dict()`` must still describe exactly what it delivered, and non-persistent
  workers must be gone (a bounded wait, no garbage collection); then either checkpoint (a
  fresh loader, or ``load_state_dict`` on the same one, which continues the saved position)
  or call ``iter(loader)``, which starts the next epoch (torch's meaning).

The model is the uninterrupted reference run (computed lazily, one epoch at a time: with
``num_workers=0`` for map-style datasets, whose values do not depend on the workers; with the
same ``num_workers`` for streams, whose shards do). After every step the batches delivered in
the current epoch must be the reference's prefix -- or, with ``in_order=False``, a sub-multiset
of the epoch's reference, and the whole multiset once the epoch ends: nothing lost, nothing
repeated, nothing changed. ``state_dict()`` must agree with the model after every step, and
the loader's own ``check_invariants()`` must hold. Teardown closes every loader and fails the
example if a child process, a ``resumable_loader*`` thread, an fd or a /dev/shm entry is left.

Known bugs are steered around (each place names its regression test under tests/).
Example counts: 200 per machine under the ``ci`` profile, 5000 under ``long`` (fuzz/README.md).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import wraps
from typing import Any

import _fuzz_data as F
import psutil
import pytest
import torch
from _leaks import start_multiprocessing_helpers
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from torch.utils.data import RandomSampler

from resumable_loader import DataLoader, LoaderClosedError, RetryPolicy
from resumable_loader.testing import (
    Fault,
    FaultyDataset,
    Resources,
    canonical,
    leaks_since,
    roundtrip_state,
    worker_pids,
)

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
# The ci profile keeps all of fuzz/ to a few minutes on two cores (the default run's budget is
# 10 minutes in all); long is the pre-release soak.
EXAMPLES = {"ci": 35, "long": 5000}.get(PROFILE, settings.default.max_examples)
STEPS = 10

MAP_SAMPLERS = ("seq", "shuffle", "replacement", "stateful", "nostate", "batch_sampler")
STREAMS = {
    "dataset_state": F.DatasetStateStream,
    "iterator_state": F.IteratorStateStream,
    "plain": F.PlainStream,
}
# A worker that is never detected as dead, or a fetch that never returns, must fail the example
# rather than hang the run: torch's own timeout turns it into a RuntimeError.
WATCHDOG_S = 30.0
# Large enough that the kills and armed faults of one example never make a task poison (each
# step adds at most a few deaths), and retries never run out; poison tasks are tested elsewhere.
MAX_TASK_ATTEMPTS = 50
RETRY = RetryPolicy(attempts=40, backoff_s=0.0)
TASK_TIMEOUT_S = 0.5
# How long non-persistent workers may take to end after their iterator is dropped.
RELEASE_S = 10.0

pytestmark = pytest.mark.filterwarnings(
    # The plain stream is fast-forwarded on resume, by design; the warning says so.
    "ignore:resuming an iterable dataset without state_dict:RuntimeWarning"
)


@dataclass(frozen=True)
class Opts:
    """Loader settings that may change when a checkpoint is resumed in a fresh loader."""

    num_workers: int
    prefetch: int
    persistent: bool
    in_order: bool
    method: str
    pin_thread: bool
    task_timeout: float | None
    state_every: int | None = None  # streams: stream_state_every

    def __repr__(self) -> str:  # short: it is printed for every checkpoint step
        every = f", state_every={self.state_every}"
        if self.num_workers == 0:
            return f"Opts(w0, in_order={self.in_order}, pin={self.pin_thread}{every})"
        return (
            f"Opts(w{self.num_workers}, pf{self.prefetch}, persistent={self.persistent}, "
            f"in_order={self.in_order}, {self.method}, pin={self.pin_thread}, "
            f"task_timeout={self.task_timeout}{every})"
        )


REFERENCE_MAP_OPTS = Opts(0, 2, False, True, "fork", False, None)


@dataclass(frozen=True)
class Config:
    kind: str  # "map" or a key of STREAMS
    n: int
    sampler: str  # map only (MAP_SAMPLERS)
    num_samples: int  # sampler "replacement" only
    batch_size: int | None
    drop_last: bool
    seed: int
    faults: tuple[tuple[int, str, int | None, int], ...]  # (value, action, worker, attempts)
    opts: Opts

    @property
    def stream(self) -> bool:
        return self.kind != "map"


def _identity_pin(batch: Any) -> Any:
    return batch


# ---- strategies ---------------------------------------------------------------------------------
# fork mostly: each spawned or forkserver worker costs seconds on a two-core machine. One
# example in RARE_METHODS is forkserver, one spawn; Hypothesis favours the ends of an integer
# range, so they sit in the middle (and fork is where it shrinks to). Those examples also keep
# their workers (persistent, at most two), or every epoch would start them again.
RARE_METHODS = 150 if PROFILE == "ci" else 30


@st.composite
def start_methods(draw: Any, spawn: bool = True) -> str:
    k = draw(st.integers(0, RARE_METHODS - 1))
    rare = {RARE_METHODS // 2: "forkserver", RARE_METHODS // 2 + 1: "spawn"}
    method = rare.get(k, "fork")
    return "forkserver" if method == "spawn" and not spawn else method


@st.composite
def opts_strategy(
    draw: Any, num_workers: int | None = None, min_workers: int = 0, spawn: bool = True
) -> Opts:
    nw = draw(st.integers(min_workers, 3)) if num_workers is None else num_workers
    method = draw(start_methods(spawn)) if nw else "fork"
    if method != "fork" and num_workers is None:
        nw = min(nw, 2)
    # SIGSTOP is only detected through task_timeout (which counts from a worker's BOOTED
    # message, so a slow spawn start is no hang).
    task_timeout = TASK_TIMEOUT_S if nw and draw(st.integers(0, 3)) == 0 else None
    return Opts(
        num_workers=nw,
        prefetch=draw(st.integers(1, 3)) if nw else 2,
        persistent=(draw(st.booleans()) or method != "fork") if nw else False,
        in_order=draw(st.booleans()),
        method=method,
        pin_thread=draw(st.integers(0, 4)) == 0,
        task_timeout=task_timeout,
        # None: adaptive; 2, 3: a resume or respawn replays the fetches since the last state.
        state_every=draw(st.sampled_from([None, None, 1, 2, 3])),
    )


@st.composite
def configs(draw: Any, min_workers: int = 0, spawn: bool = True) -> Config:
    kind = draw(st.sampled_from(["map", "map", "dataset_state", "iterator_state", "plain"]))
    n = draw(st.integers(1, 16) if kind == "map" else st.integers(0, 12))
    sampler = draw(st.sampled_from(MAP_SAMPLERS)) if kind == "map" else "seq"
    batch_size = None if sampler == "batch_sampler" else draw(st.none() | st.integers(1, 4))
    drop_last = batch_size is not None and draw(st.booleans())
    opts = draw(opts_strategy(min_workers=min_workers, spawn=spawn))
    faults: list[tuple[int, str, int | None, int]] = []
    max_value = n - 1 if kind == "map" else n + 3 * max(0, opts.num_workers - 1)
    for _ in range(draw(st.integers(0, 2))):
        value = draw(st.integers(0, max(0, max_value)))
        actions = ["transient"]
        if opts.num_workers:
            actions += ["exit", "sigkill", "sigsegv"] if kind == "map" else ["exit"]
        if not actions:
            continue
        action = draw(st.sampled_from(actions))
        worker = draw(st.integers(0, opts.num_workers - 1)) if action != "transient" else None
        faults.append((value, action, worker, draw(st.integers(1, 2))))
    return Config(
        kind=kind,
        n=n,
        sampler=sampler,
        num_samples=draw(st.integers(1, 16)),
        batch_size=batch_size,
        drop_last=drop_last,
        seed=draw(st.integers(0, 2**16)),
        faults=tuple(faults),
        opts=opts,
    )


def traced(fn: Callable[..., None]) -> Callable[..., None]:
    """Log the step; a failure carries the whole log of its example as an exception note.

    Hypothesis prints the steps of a failing example, except when the failure does not
    replay (a timing-dependent bug ends as a Flaky error): the note still says what ran.
    """

    @wraps(fn)
    def step(self: _LoaderModel, **kw: Any) -> None:
        shown = {k: v for k, v in kw.items() if k != "data"}
        self.trace.append(f"{fn.__name__}({shown})")
        try:
            fn(self, **kw)
        except BaseException as exc:
            if not getattr(exc, "_fuzz_traced", False):
                exc._fuzz_traced = True  # type: ignore[attr-defined]
                exc.add_note("steps of this example:\n  " + "\n  ".join(self.trace))
            raise

    return step


class _LeftTheLoop(Exception):
    """Raised by a loop body of the ``abandon`` rule (a training step that failed)."""


# ---- the model ----------------------------------------------------------------------------------
@dataclass
class Position:
    """Where the consumer is: epoch, batches consumed in it, StopIteration seen, what came."""

    epoch: int = 0
    consumed: int = 0
    stopped: bool = False
    unordered: bool = False  # some batch of this epoch came from an in_order=False loader
    got: tuple[Any, ...] = ()

    def next_epoch(self) -> Position:
        return Position(self.epoch + 1)


class _LoaderModel(RuleBasedStateMachine):
    """The loader under test, its reference and the checks; the machines below add rules.

    (No rule has a precondition: Hypothesis switches rules off at random per example -- swarm
    testing -- and an example whose remaining rules all have false preconditions is thrown
    away after its loaders were built. A rule that does not apply does the nearest thing.)
    """

    min_workers = 0
    spawn = True  # whether the start method may be drawn as spawn

    def __init__(self) -> None:
        super().__init__()
        start_multiprocessing_helpers()
        self.baseline = Resources.now()
        self.tmp = tempfile.mkdtemp(prefix="fuzz-loader-")
        self.loader: Any = None
        self.it: Any = None
        self.ref_loader: Any = None
        self.ref: list[list[Any]] = []
        self.checkpoints: list[tuple[dict[str, Any], Position]] = []
        self.pos = Position()
        self.generation = 0
        self.loader_batches = 0  # batches the current loader object has delivered
        self.trace: list[str] = []
        self.respawns = self.retries = self.kills = 0
        self.started = time.monotonic()

    # ---- building ----------------------------------------------------------------------
    def _dataset(self, for_reference: bool, opts: Opts) -> Any:
        c = self.cfg
        arm_dir = None if for_reference else self.arm_dir
        if c.stream:
            return STREAMS[c.kind](c.n, arm_dir)
        ds = F.MapData(c.n, arm_dir)
        if for_reference or not c.faults:
            return ds
        faults = {}
        for value, action, worker, attempts in c.faults:
            if action != "transient" and (worker is None or worker >= opts.num_workers):
                continue  # a crash fault in the main process would kill the test itself
            faults[value] = Fault(action, attempts=frozenset(range(attempts)), worker=worker)
        return FaultyDataset(ds, faults, self.fault_dir)

    def _build(self, opts: Opts, *, for_reference: bool = False, seed: int | None = None) -> Any:
        c = self.cfg
        kw: dict[str, Any] = dict(
            num_workers=opts.num_workers,
            generator=torch.Generator().manual_seed(c.seed if seed is None else seed),
            in_order=opts.in_order,
            max_task_attempts=MAX_TASK_ATTEMPTS,
            retry=None if for_reference else RETRY,
        )
        if c.sampler == "batch_sampler":
            kw["batch_sampler"] = F.VariableBatchSampler(c.n, (1, 3, 2))
        else:
            kw["batch_size"] = c.batch_size
            kw["drop_last"] = c.drop_last
            if c.sampler == "shuffle":
                kw["shuffle"] = True
            elif c.sampler == "replacement":
                kw["sampler"] = RandomSampler(
                    range(c.n), replacement=True, num_samples=c.num_samples
                )
            elif c.sampler == "stateful":
                kw["sampler"] = F.StatefulSampler(c.n, seed=c.seed)
            elif c.sampler == "nostate":
                kw["sampler"] = F.NoStateSampler(c.n)
        if c.stream:
            kw["stream_state_every"] = opts.state_every
        if opts.num_workers:
            kw.update(
                prefetch_factor=opts.prefetch,
                persistent_workers=opts.persistent,
                multiprocessing_context=opts.method,
                timeout=WATCHDOG_S,
                task_timeout=opts.task_timeout,
            )
        loader = DataLoader(self._dataset(for_reference, opts), **kw)
        if opts.pin_thread:
            loader._force_pin_fn = _identity_pin  # the pin-thread path, without an accelerator
        return loader

    def _reference(self, epoch: int) -> list[Any]:
        while len(self.ref) <= epoch:
            self.ref.append([canonical(b) for b in self.ref_loader])
        return self.ref[epoch]

    def _setup(self, cfg: Config) -> None:
        self.cfg = cfg
        self.opts = cfg.opts
        self.arm_dir = os.path.join(self.tmp, "arm")
        self.fault_dir = os.path.join(self.tmp, "faults")
        os.mkdir(self.arm_dir)
        os.mkdir(self.fault_dir)
        if cfg.stream:
            for value, action, _worker, _attempts in cfg.faults:
                F.arm(self.arm_dir, action, value)
            # Same shards; none of the machinery that the run under test exercises.
            ref_opts = Opts(cfg.opts.num_workers, 2, False, True, "fork", False, None, 1)
        else:
            ref_opts = REFERENCE_MAP_OPTS
        self.ref_loader = self._build(ref_opts, for_reference=True)
        self.loader = self._build(cfg.opts)
        self.it = iter(self.loader)

    def _tally(self, loader: Any) -> None:
        stats = loader.statistics()
        self.respawns += stats.respawns
        self.retries += stats.retries

    def teardown(self) -> None:
        self.it = None
        if self.loader is not None:
            self._tally(self.loader)
            c = self.cfg
            event(f"config: {c.kind}, {c.opts.num_workers} workers, {c.opts.method}")
            for name, value in [
                ("kills sent", self.kills),
                ("respawns", self.respawns),
                ("retries", self.retries),
                ("epochs reached", self.pos.epoch),
                ("loaders resumed", self.generation),
            ]:
                event(f"{name}: {'3+' if value >= 3 else value}")
        for loader in (self.loader, self.ref_loader):
            if loader is not None:
                loader.close()
        self.loader = self.ref_loader = None
        self.checkpoints.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)
        problems = leaks_since(self.baseline, settle_s=5.0)
        assert not problems, "the example leaked " + "; ".join(problems)
        if os.environ.get("FUZZ_PROFILE_LOG"):
            with open(os.environ["FUZZ_PROFILE_LOG"], "a") as f:
                took = time.monotonic() - self.started
                f.write(f"{took:.2f} {type(self).__name__} {' | '.join(self.trace)}\n")

    # ---- checking ----------------------------------------------------------------------
    def _check_batch(self, batch: Any) -> None:
        p = self.pos
        ref = self._reference(p.epoch)
        got = (*p.got, batch)
        p.unordered = p.unordered or (not self.opts.in_order and self.opts.num_workers > 0)
        if p.unordered:
            extra = Counter(map(repr, got)) - Counter(map(repr, ref))
            assert not extra, (
                f"epoch {p.epoch}: batch {len(got) - 1} was not in the reference epoch, or came "
                f"more often than there: {list(extra)!r:.300}"
            )
        else:
            assert len(got) <= len(ref), (
                f"epoch {p.epoch}: batch {len(got) - 1} is beyond the {len(ref)} batches of the "
                f"reference: {batch!r:.200}"
            )
            assert batch == ref[len(got) - 1], (
                f"epoch {p.epoch}, batch {len(got) - 1}: got {batch!r:.200}, "
                f"expected {ref[len(got) - 1]!r:.200}"
            )
        p.got = got
        p.consumed += 1

    def _check_stop(self) -> None:
        p = self.pos
        ref = self._reference(p.epoch)
        if p.unordered:
            missing = Counter(map(repr, ref)) - Counter(map(repr, p.got))
            assert not missing, f"epoch {p.epoch} ended without {sum(missing.values())} batches"
        else:
            assert p.consumed == len(ref), (
                f"epoch {p.epoch} ended after {p.consumed} batches; the reference has {len(ref)}"
            )
        p.stopped = True

    def _next(self) -> None:
        if self.pos.stopped:
            try:
                batch = next(self.it)
            except StopIteration:
                return
            raise AssertionError(f"a batch after StopIteration: {canonical(batch)!r:.200}")
        try:
            batch = next(self.it)
        except StopIteration:
            self._check_stop()
            return
        self._check_batch(canonical(batch))
        self.loader_batches += 1

    @invariant()
    def state_agrees_with_the_model(self) -> None:
        if self.loader is None:
            return
        try:
            self._check_state()
        except BaseException as exc:
            exc.add_note("after the steps:\n  " + "\n  ".join(self.trace))
            raise

    def _check_state(self) -> None:
        self.loader.check_invariants()
        stats = self.loader.statistics()
        assert stats.batches == self.loader_batches, (
            f"statistics().batches is {stats.batches}; the loader delivered {self.loader_batches}"
        )
        assert 0 <= stats.workers_alive <= self.opts.num_workers, stats
        sd = self.loader.state_dict()
        p = self.pos
        epoch, consumed = (p.epoch + 1, 0) if p.stopped else (p.epoch, p.consumed)
        if self._at_epoch_end(sd):
            epoch, consumed = p.epoch + 1, 0
        assert sd["epoch"] == epoch, ("state_dict()['epoch']", sd["epoch"], "expected", epoch)
        if self.cfg.stream:
            delivered = sum(w["delivered"] for w in sd["workers"])
            assert delivered == consumed, (sd["workers"], "expected in all", consumed)
        else:
            assert sd["consumed"] + len(sd["delivered_ahead"]) == consumed, (
                sd["consumed"],
                sd["delivered_ahead"],
                "expected in all",
                consumed,
            )

    def _at_epoch_end(self, sd: dict[str, Any]) -> bool:
        """Every batch of the epoch was delivered, StopIteration not yet seen, and the state
        already says "the start of the next epoch": docs/guarantees.md, "A state taken after the
        last batch, before StopIteration" (the loader may say so when it knows the epoch is over;
        otherwise it says "all batches of this epoch delivered")."""
        p = self.pos
        return (
            not p.stopped
            and sd["epoch"] == p.epoch + 1
            and p.consumed == len(self._reference(p.epoch))
        )

    # ---- actions (the rules of the machines below call these) --------------------------
    def do_take(self, k: int) -> None:
        for _ in range(k):
            self._next()

    def _booted_worker_pids(self) -> set[int]:
        """Workers the loader has heard from (they run our code: initializing or ready)."""
        stats = self.loader.statistics()
        return {
            pid
            for pid, state in zip(stats.worker_pids, stats.worker_states)
            if state in ("initializing", "ready")
        }

    def do_kill(self, which: int, sig: str, every: bool) -> None:
        if not self.opts.num_workers:
            return
        if sig == "SIGSTOP" and self.opts.task_timeout is None:
            sig = "SIGKILL"  # a stopped worker is only found through task_timeout
        ours = {c.pid for c in psutil.Process().children()}
        live = [pid for pid in worker_pids(self.loader) if pid > 0 and pid in ours]
        if sig == "SIGSTOP":
            # A worker stopped before it booted is found only after BOOT_TIMEOUT_S (a minute);
            # tests/pipeline/test_supervisor.py::test_worker_hung_while_booting_is_replaced
            # covers that with a shorter limit.
            live = [pid for pid in live if pid in self._booted_worker_pids()]
        if not live:
            self.trace[-1] += " -> no live worker"
            return
        targets = live if every else [live[which % len(live)]]
        self.trace[-1] += f" -> {sig} to worker pids {targets}"
        for pid in targets:
            try:
                os.kill(pid, getattr(signal, sig))
                self.kills += 1
            except ProcessLookupError:
                pass

    def do_arm(self, data: st.DataObject, exit_only: bool = False) -> None:
        c = self.cfg
        top = c.n - 1 if not c.stream else c.n + 3 * max(0, self.opts.num_workers - 1)
        values = range(max(0, top) + 1)
        kinds = ["exit"] if self.opts.num_workers else []
        if not exit_only:
            kinds.append("transient")
        if not kinds:
            return
        kind = data.draw(st.sampled_from(kinds), label="kind")
        value = data.draw(st.sampled_from(values), label="value")
        self.trace[-1] += f" -> {kind} {value}"
        F.arm(self.arm_dir, kind, value)

    def _resume(
        self, sd: dict[str, Any], at: Position, fresh: bool, opts: Opts, other_seed: int = 0
    ) -> None:
        if fresh:
            old, self.it = self.loader, None
            self._tally(old)
            old.close()
            self.loader_batches = 0
            self.loader = None
            self.opts = opts
            self.generation += 1
            # As a restarted process builds it: the global RNG moved on, and another generator
            # (another seed in the script): the state decides the saved epoch and every later
            # one.
            torch.manual_seed(other_seed)
            torch.rand(other_seed % 7 + 1)
            self.loader = self._build(opts, seed=other_seed)
        self.loader.load_state_dict(sd)
        self.it = iter(self.loader)
        self.pos = at.next_epoch() if at.stopped else replace(at)

    def do_checkpoint(self, via: str, fresh: bool, keep: bool, data: st.DataObject) -> None:
        sd = roundtrip_state(self.loader.state_dict(), via)
        if via != "json":
            json.dumps(sd)  # our datasets' states are json-able, so the whole state must be
        at = replace(self.pos)
        if self._at_epoch_end(sd):
            at.stopped = True  # the state resumes as if StopIteration had been seen
        if keep:
            self.checkpoints.append((sd, at))
        opts = self.opts
        if fresh:
            if self.cfg.stream:
                # A stream's shards are fixed by num_workers; keep in_order as it was, so the
                # model stays simple.
                opts = data.draw(
                    opts_strategy(self.opts.num_workers, spawn=self.spawn), label="opts"
                )
                opts = replace(opts, in_order=self.opts.in_order)
            else:
                opts = data.draw(
                    opts_strategy(min_workers=self.min_workers, spawn=self.spawn), label="opts"
                )
            self.trace[-1] += f" -> {opts!r}"
        other = data.draw(st.integers(0, 2**31), label="resumed generator seed") if fresh else 0
        self._resume(sd, at, fresh, opts, other)

    def do_rewind(self, data: st.DataObject) -> None:
        if not self.checkpoints:
            return
        i = data.draw(st.integers(0, len(self.checkpoints) - 1), label="checkpoint")
        sd, at = self.checkpoints[i]
        self.trace[-1] += f" -> checkpoint {i} at {at.epoch}/{at.consumed}"
        other = data.draw(st.integers(0, 2**31), label="resumed generator seed")
        self._resume(sd, at, True, self.opts, other)

    def _can_abandon(self) -> bool:
        """Whether the next epoch is well defined when this one is left unfinished."""
        c = self.cfg
        if self.pos.stopped:
            return True
        if c.kind == "map":
            # A user sampler with state has been drawn ahead (prefetch) and does not rewind.
            return c.sampler != "stateful"
        if c.kind == "dataset_state":
            # The dataset's cursor persists in the main process (no workers) or in persistent
            # workers, where prefetching moved it past what was consumed: as with torch.
            return self.opts.num_workers > 0 and not self.opts.persistent
        return True

    # ---- leaving the loop (issue #9) ----------------------------------------------------
    def _got(self, batch: Any) -> None:
        """A batch the caller's own loop received."""
        self._check_batch(canonical(batch))
        self.loader_batches += 1

    def _leave(self, it: Any, how: str, j: int) -> None:
        """Consume up to ``j`` batches of ``it`` as a loop shaped ``how`` does, then stop."""
        # A `for` loop can only break or raise once it has received a batch: j=0 acts as 1.
        if how == "break":
            for n, batch in enumerate(it, 1):
                self._got(batch)
                if n >= j:
                    break
            else:
                self._check_stop()
        elif how == "islice":
            n = 0
            for batch in itertools.islice(it, j):
                self._got(batch)
                n += 1
            if n < j:
                self._check_stop()
        elif how in ("raise", "interrupt"):
            exc = _LeftTheLoop if how == "raise" else KeyboardInterrupt
            try:
                for n, batch in enumerate(it, 1):
                    self._got(batch)
                    if n >= j:
                        raise exc(f"the loop body raised after {n} batches")
                self._check_stop()
            except exc:
                pass
        elif how == "del":
            for _ in range(j):
                try:
                    batch = next(it)
                except StopIteration:
                    self._check_stop()
                    break
                self._got(batch)
        else:
            raise ValueError(how)

    def _live_workers(self) -> set[int]:
        ours = {c.pid for c in psutil.Process().children()}
        return {pid for pid in worker_pids(self.loader) if pid > 0 and pid in ours}

    def _check_released(self, pids: set[int]) -> None:
        """Non-persistent workers end once their iterator is dropped: the position the loader
        keeps is plain data. Polls the kernel's view (bounded); never runs the collector."""
        deadline = time.monotonic() + RELEASE_S
        while True:
            left = pids & {c.pid for c in psutil.Process().children()}
            if not left:
                return
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"workers {sorted(left)} still alive {RELEASE_S:.0f} s after their "
                    "(non-persistent) iterator was dropped"
                )
            time.sleep(0.01)

    def do_abandon(
        self, how: str, j: int, then: str, via: str, fresh: bool, keep: bool, data: Any
    ) -> None:
        if then == "next_epoch" and not self._can_abandon():
            self.trace[-1] += " -> finishing the epoch first"
            while not self.pos.stopped:
                self._next()
        if how == "islice_loader":
            # `for batch in islice(loader, j)` calls iter(loader): the current iterator is
            # dropped and the next epoch begins (torch's meaning).
            if not self._can_abandon():
                self.trace[-1] += " -> finishing the epoch first"
                while not self.pos.stopped:
                    self._next()
            self.it = None
            self.pos = self.pos.next_epoch()
            it = iter(self.loader)
            how = "islice"
            if then == "next_epoch" and not self._can_abandon():
                then = "checkpoint"  # this epoch, left early, has no well-defined successor
        else:
            it, self.it = self.it, None
        watched = set() if self.opts.persistent else self._live_workers()
        if not self.pos.stopped:
            self._leave(it, how, j)
        del it
        p = self.pos
        self.trace[-1] += f" -> left at {p.epoch}/{p.consumed}{' (ended)' if p.stopped else ''}"
        if watched:
            self._check_released(watched)
        self._check_state()  # the position outlives the iterator
        if then == "checkpoint":
            self.do_checkpoint(via, fresh, keep, data)
        else:
            self.it = iter(self.loader)
            self.pos = self.pos.next_epoch()

    def do_new_epoch(self) -> None:
        if not self._can_abandon():
            self.trace[-1] += " -> finishing the epoch first"
            while not self.pos.stopped:
                self._next()
        old = self.it
        self.it = iter(self.loader)
        superseded = self.opts.persistent and self.opts.num_workers and not self.pos.stopped
        if old is not None and superseded:
            try:
                next(old)
            except LoaderClosedError:
                pass
            else:
                raise AssertionError("a superseded iterator of persistent workers still works")
        del old
        self.pos = self.pos.next_epoch()


VIAS = st.sampled_from(["dict", "bytes", "torch", "json"])
SIGNALS = st.sampled_from(["SIGKILL", "SIGSEGV", "SIGSTOP"])
# How a training loop is left, and what follows (see ``do_abandon``).
LEAVE_WAYS = st.sampled_from(["break", "islice", "islice_loader", "raise", "interrupt", "del"])
AFTER_LEAVING = st.sampled_from(["checkpoint", "next_epoch"])


class LoaderMachine(_LoaderModel):
    """Every rule, with 0-3 workers."""

    @initialize(cfg=configs())
    @traced
    def setup(self, cfg: Config) -> None:
        self._setup(cfg)

    @rule(k=st.integers(1, 4))
    @traced
    def take(self, k: int) -> None:
        self.do_take(k)

    @rule(which=st.integers(0, 2), sig=SIGNALS, every=st.booleans())
    @traced
    def kill(self, which: int, sig: str, every: bool) -> None:
        self.do_kill(which, sig, every)

    @rule(data=st.data())
    @traced
    def arm(self, data: st.DataObject) -> None:
        self.do_arm(data)

    @rule(via=VIAS, fresh=st.booleans(), keep=st.booleans(), data=st.data())
    @traced
    def checkpoint(self, via: str, fresh: bool, keep: bool, data: st.DataObject) -> None:
        self.do_checkpoint(via, fresh, keep, data)

    @rule(data=st.data())
    @traced
    def rewind(self, data: st.DataObject) -> None:
        self.do_rewind(data)

    @rule()
    @traced
    def new_epoch(self) -> None:
        self.do_new_epoch()

    @rule(
        how=LEAVE_WAYS,
        j=st.integers(0, 3),
        then=AFTER_LEAVING,
        via=VIAS,
        fresh=st.booleans(),
        keep=st.booleans(),
        data=st.data(),
    )
    @traced
    def abandon(
        self, how: str, j: int, then: str, via: str, fresh: bool, keep: bool, data: Any
    ) -> None:
        self.do_abandon(how, j, then, via, fresh, keep, data)


class KillMachine(_LoaderModel):
    """Workers dying: 1-3 workers; every kill is followed by batches (or a checkpoint).

    fork and forkserver only: each respawn of a spawned worker costs seconds, which made this
    machine's run time swing by a minute between seeds. Spawn is drawn by LoaderMachine and
    is in tests/behaviour/test_crash_table.py and tests/pipeline/test_supervisor.py.
    """

    min_workers = 1
    spawn = False

    @initialize(cfg=configs(min_workers=1, spawn=False))
    @traced
    def setup(self, cfg: Config) -> None:
        self._setup(cfg)

    @rule(k=st.integers(1, 4))
    @traced
    def take(self, k: int) -> None:
        self.do_take(k)

    @rule(which=st.integers(0, 2), sig=SIGNALS, every=st.booleans(), then=st.integers(0, 4))
    @traced
    def kill_then_take(self, which: int, sig: str, every: bool, then: int) -> None:
        self.do_kill(which, sig, every)
        self.do_take(then)

    @rule(which=st.integers(0, 2), via=VIAS, fresh=st.booleans(), data=st.data())
    @traced
    def kill_then_checkpoint(self, which: int, via: str, fresh: bool, data: Any) -> None:
        # The death is not noticed before state_dict(): the state must not depend on it.
        self.do_kill(which, "SIGKILL", False)
        self.do_checkpoint(via, fresh, False, data)

    @rule(data=st.data(), then=st.integers(0, 4))
    @traced
    def arm_exit_then_take(self, data: st.DataObject, then: int) -> None:
        self.do_arm(data, exit_only=True)
        self.do_take(then)

    @rule()
    @traced
    def new_epoch(self) -> None:
        self.do_new_epoch()

    @rule(
        how=LEAVE_WAYS,
        j=st.integers(0, 3),
        then=AFTER_LEAVING,
        via=VIAS,
        fresh=st.booleans(),
        keep=st.booleans(),
        data=st.data(),
    )
    @traced
    def abandon(
        self, how: str, j: int, then: str, via: str, fresh: bool, keep: bool, data: Any
    ) -> None:
        self.do_abandon(how, j, then, via, fresh, keep, data)


_SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# pytest-timeout's default (pyproject) would cut the long profile short.
_TIMEOUT = pytest.mark.timeout(0 if PROFILE == "long" else 900)

LoaderMachine.TestCase.settings = _SETTINGS
KillMachine.TestCase.settings = _SETTINGS
TestLoaderMachine = _TIMEOUT(LoaderMachine.TestCase)
TestKillMachine = _TIMEOUT(KillMachine.TestCase)
