"""The fuzzer as the user: every public operation of docs/api.md, against what the docs promise.

``UserMachine`` runs one training job the way the docs' recipes write it -- the README's
quickstart for one process, docs/distributed.md's recipe for ranks (simulated: one loader per
rank in this process, each with torch's ``DistributedSampler(num_replicas=W, rank=r)``) -- and
checks every sample it delivers against ``_reference``, a small model of the docs' promises
computed from (seed, epoch, position) alone: never from another run of the same loader
configuration, never from the loader's state.

The job (drawn once): a map dataset of plain items or a ``Mixture`` of two or three sources;
``shuffle=False``, ``shuffle=True`` or a ``DistributedSampler`` (shuffle or not, drop_last or
not) on 1-3 ranks; batch size 1-4 and drop_last; 0-2 fork workers per rank, persistent or not,
in_order or not.

Rules (each compares every batch delivered with the model):

* ``take``: the next 1-3 batches on every rank, or on one rank (ranks out of step); past an
  epoch's end the user's ``for epoch in ...`` loop starts the next one (``set_epoch`` on the
  rank's sampler) once every rank has ended its epoch;
* ``leave``: ``break`` out of the epoch on every rank (the next ``take`` starts the next epoch);
* ``kill``: SIGKILL one worker of one rank (``resumable_loader.testing.kill_worker``);
* ``set_weights``: between epochs, new ``Mixture`` weights from the next epoch's first position
  on every rank's mixture, before ``iter()`` (data-plans.md);
* ``resume``: ``state_dict()`` on every rank, wherever the job stands (mid-epoch, after an
  epoch's last batch, after ``StopIteration``, after a ``break``), through dict, bytes,
  ``torch.save`` or json; optionally ``skip_samples``; then fresh loaders built as a restarted
  script builds them: another batch size, another number of ranks (``merge_rank_states``),
  other workers / persistence / in_order, a ``Mixture`` with new weights; the state loaded and
  the epoch taken from it as the recipes say.

Known bugs (issue 31) are switched off by ``KNOWN_BUGS``: remove an item as its fix lands.
"""

from __future__ import annotations

import contextlib
import os
import signal
import warnings
from dataclasses import dataclass, replace
from typing import Any

import _reference as R
import pytest
import torch
from _leaks import start_multiprocessing_helpers
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule
from torch.utils.data import Dataset, DistributedSampler

from resumable_loader import (
    CheckpointError,
    DataLoader,
    Mixture,
    merge_rank_states,
    skip_samples,
)
from resumable_loader.testing import Resources, leaks_since, roundtrip_state, worker_pids

# Known bugs the machine steers around (each place that does says which), so that a bug found
# can be switched off until its fix lands -- the rules stay. Every switch of issue 31 is fixed:
#   item1: the distributed recipe's start_epoch (sampler_epoch) replayed an epoch whose last
#          batch was delivered before the state was taken.
#   item2: Mixture.set_weights() before iter() did not reach persistent workers.
#   item5: new weights at a resume under a shuffling sampler started only at the next epoch.
#   item11: a resize with DistributedSampler(drop_last=True) miscounted what it drops.
#   skip-out-of-step (found by this machine): skip_samples refused a DistributedSampler job as
#          "between two epochs" when the only ranks that consumed anything had delivered their
#          whole share (fuzz/test_regressions.py).
#   skip-pad-warning (found by this machine): a state from skip_samples loaded on a world size
#          that must pad or drop the rest did so without the promised RuntimeWarning.
KNOWN_BUGS: set[str] = set()
# FUZZ_KNOWN_BUGS="item2,item5" (or "" for none) overrides the set, to check a fix.
if "FUZZ_KNOWN_BUGS" in os.environ:
    KNOWN_BUGS = {b for b in os.environ["FUZZ_KNOWN_BUGS"].split(",") if b}

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
EXAMPLES = {"ci": 150, "long": 5000}.get(PROFILE, settings.default.max_examples)
STEPS = 10
WATCHDOG_S = 30.0  # torch's timeout: a lost batch fails the example instead of hanging it
MAX_TOTAL_WORKERS = 3  # two cores: all ranks together
SOURCES = ("a", "b", "c")

pytestmark = pytest.mark.filterwarnings(
    # A resize whose rest is not a multiple of the ranks warns how many samples it repeats or
    # drops (distributed.md); the model counts them itself.
    "ignore::RuntimeWarning"
)


# ---- data ---------------------------------------------------------------------------------------
class Items(Dataset[int]):
    """Item i is i: a delivered sample names its dataset index."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class Source(Dataset[int]):
    """A Mixture source; item i of source k is ``1000 * (k + 1) + i``."""

    def __init__(self, k: int, n: int) -> None:
        self.k, self.n = k, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return 1000 * (self.k + 1) + i


@dataclass(frozen=True)
class Opts:
    num_workers: int
    persistent: bool
    in_order: bool

    def __repr__(self) -> str:
        return f"Opts(w{self.num_workers}, persistent={self.persistent}, in_order={self.in_order})"


@dataclass(frozen=True)
class Job:
    spec: R.Spec
    world: int
    batch_size: int
    drop_last: bool
    opts: Opts
    mixture: tuple[int, ...] | None  # the sources' lengths
    weights: tuple[int, ...] | None
    mix_seed: int = 0


def opts_for(world: int) -> Any:
    cap = MAX_TOTAL_WORKERS // world
    return st.builds(
        lambda nw, persistent, in_order: Opts(nw, persistent and nw > 0, in_order),
        st.integers(0, min(2, cap)),
        st.booleans(),
        st.booleans(),
    )


def weights_strategy(k: int) -> Any:
    # At least one source drawn from: a zero is moved to a one rather than filtered out.
    return st.lists(st.integers(0, 3), min_size=k, max_size=k).map(
        lambda w: tuple(w) if any(w) else (1, *w[1:])
    )


@st.composite
def jobs(draw: Any) -> Job:
    sampler = draw(st.sampled_from(["seq", "shuffle", "dist", "dist"]))
    mixture = None
    weights = None
    if draw(st.booleans()):
        k = draw(st.integers(2, 3))
        mixture = tuple(draw(st.lists(st.integers(1, 4), min_size=k, max_size=k)))
        weights = draw(weights_strategy(k))
        n = sum(mixture)
    else:
        n = draw(st.integers(1, 10))
    world = draw(st.integers(1, 3)) if sampler == "dist" else 1
    spec = R.Spec(
        n=n,
        sampler=sampler,
        seed=draw(st.integers(0, 2**16)),
        dist_shuffle=sampler == "dist" and draw(st.booleans()),
        dist_drop_last=sampler == "dist" and draw(st.booleans()),
    )
    return Job(
        spec=spec,
        world=world,
        batch_size=draw(st.integers(1, 4)),
        drop_last=draw(st.booleans()),
        opts=draw(opts_for(world)),
        mixture=mixture,
        weights=weights,
        mix_seed=draw(st.integers(0, 100)),
    )


# ---- one simulated rank -------------------------------------------------------------------------
@dataclass
class Rank:
    loader: Any
    sampler: Any
    mix: Any
    it: Any = None
    status: str = "running"  # running | ended (StopIteration seen) | left (break)
    user_epoch: int = 0


def _values(batch: Any) -> list[int]:
    return [int(v) for v in batch]


class UserMachine(RuleBasedStateMachine):
    """One job driven as the docs' recipes drive it; the model is ``_reference``."""

    def __init__(self) -> None:
        super().__init__()
        start_multiprocessing_helpers()
        self.baseline = Resources.now()
        self.ranks: list[Rank] = []
        self.oracle: R.ShuffleOracle | None = None
        self.ref_mix: Any = None
        self.trace: list[str] = []
        # After a resume with new weights under a shuffling sampler, once item 5 is fixed: the
        # docs promise the new weights from the resume point on, in an order this model does
        # not compute; from there to the example's end the samples are checked for what the
        # weights allow (batch sizes, no source weighted 0 but in the holes that keep the old
        # weights), not one by one.
        self.loose = False
        # data-plans.md: the unconsumed samples before the last consumed one (batches delivered
        # ahead, ranks out of step) "keep the old weights": in loose mode, how many samples of
        # this epoch may still come from a source the new weights gave 0.
        self.old_weights_left = 0
        self.ambiguous = False
        self.resumes = 0

    # ---- building, as the user's script does ------------------------------------------
    def _mixture(self, weights: tuple[int, ...]) -> Mixture:
        assert self.job.mixture is not None
        names = SOURCES[: len(self.job.mixture)]
        sources = {name: Source(k, n) for k, (name, n) in enumerate(zip(names, self.job.mixture))}
        return Mixture(sources, dict(zip(names, weights)), seed=self.job.mix_seed)

    def _build_rank(self, rank: int, world: int, batch_size: int, opts: Opts, weights: Any) -> Rank:
        job = self.job
        mix = self._mixture(weights) if job.mixture is not None else None
        ds: Any = mix if mix is not None else Items(job.spec.n)
        kw: dict[str, Any] = dict(
            batch_size=batch_size,
            drop_last=job.drop_last,
            num_workers=opts.num_workers,
            in_order=opts.in_order,
            max_task_attempts=50,
        )
        if opts.num_workers:
            kw.update(
                persistent_workers=opts.persistent,
                multiprocessing_context="fork",
                timeout=WATCHDOG_S,
            )
        sampler = None
        if job.spec.sampler == "dist":
            sampler = DistributedSampler(
                ds,
                num_replicas=world,
                rank=rank,
                shuffle=job.spec.dist_shuffle,
                seed=job.spec.seed,
                drop_last=job.spec.dist_drop_last,
            )
            kw["sampler"] = sampler
        elif job.spec.sampler == "shuffle":
            kw["shuffle"] = True
            kw["generator"] = torch.Generator().manual_seed(job.spec.seed)
        return Rank(DataLoader(ds, **kw), sampler, mix)

    def value_of(self, epoch: int, index: int) -> int:
        if self.ref_mix is None:
            return index
        self.ref_mix.set_epoch(epoch)
        name, i = self.ref_mix.source_of(index)
        return 1000 * (SOURCES.index(name) + 1) + i

    @initialize(job=jobs())
    def setup(self, job: Job) -> None:
        self.trace.append(f"setup({job})")
        self.job = job
        self.world, self.batch_size, self.opts = job.world, job.batch_size, job.opts
        self.weights = job.weights
        if job.spec.sampler == "shuffle":
            self.oracle = R.ShuffleOracle(job.spec.n, job.spec.seed)
        if job.mixture is not None:
            self.ref_mix = self._mixture(job.weights or ())
        self.model = self._fresh_epoch(0)
        self.ranks = [
            self._build_rank(r, job.world, job.batch_size, job.opts, job.weights)
            for r in range(job.world)
        ]
        for rank in self.ranks:
            self._start_epoch(rank, 0)

    def _fresh_epoch(self, epoch: int) -> R.Epoch:
        return R.start_epoch(
            self.job.spec, epoch, self.world, self.batch_size, self.job.drop_last, self.oracle
        )

    def _start_epoch(self, rank: Rank, epoch: int) -> None:
        """The top of the user's ``for epoch in range(start_epoch, n)`` loop."""
        rank.user_epoch = epoch
        if rank.sampler is not None:
            rank.sampler.set_epoch(epoch)
        rank.it = iter(rank.loader)
        rank.status = "running"

    def teardown(self) -> None:
        event(f"sampler {self.job.spec.sampler}" if self.ranks else "not set up")
        event(f"resumes: {min(self.resumes, 3)}")
        for rank in self.ranks:
            rank.it = None
            rank.loader.close()
        self.ranks = []
        if self.oracle is not None:
            self.oracle.close()
        problems = leaks_since(self.baseline, settle_s=5.0)
        assert not problems, "the example leaked " + "; ".join(problems)

    # ---- checking -----------------------------------------------------------------------
    def _check_batch(self, r: int, batch: Any) -> None:
        got = _values(batch)
        place = self.model.ranks[r]
        e = self.model
        todo = [i for i in range(len(place.batches)) if i not in place.delivered]
        assert todo, f"rank {r}, epoch {e.epoch}: a batch {got} after the model's last one"
        unordered = not self.opts.in_order and self.opts.num_workers
        if self.loose:
            # What the new weights allow: the model's batch size, no source weighted 0. Under
            # in_order=False any undelivered batch may come first (the epoch's short last one).
            pool = todo if unordered else todo[:1]
            fits = [i for i in pool if len(place.batches[i]) == len(got)]
            assert fits, (got, [place.batches[i] for i in pool], self.trace)
            zero = {
                1000 * (SOURCES.index(s) + 1) for s, w in self.ref_mix.weights.items() if w == 0
            }
            old = sum(v // 1000 * 1000 in zero for v in got)
            # A padding sample repeats a position of the epoch (distributed.md: torch pads "by
            # repeating its head"), whose sample may be one the old weights gave: "the
            # positions before g keep their samples" (data-plans.md).
            pads = max(sum(R.is_pad(p) for p in place.batches[i]) for i in fits)
            assert old <= self.old_weights_left + pads, (
                f"a source weighted 0 in {got} ({self.old_weights_left} samples of the epoch "
                f"keep the old weights; {pads} of the batch are padding)"
                "\nsteps:\n  " + "\n  ".join(self.trace)
            )
            self.old_weights_left -= max(0, old - pads)
            # Equal-length batches: which one came is unknown, so is whether the batches
            # delivered are a prefix (a later resume must not rely on it: distributed.md refuses
            # a state with batches delivered ahead on another world size).
            self.ambiguous = self.ambiguous or len(fits) > 1
            place.delivered.add(fits[0])
            return
        # Once the model lost track of which equal batch came, the rest of the epoch is
        # compared as a multiset of batches.
        candidates = todo if unordered or self.ambiguous else todo[:1]
        matches = [i for i in candidates if R.values(e, place.batches[i], self.value_of) == got]
        if matches:
            # Two undelivered batches of equal values (a Mixture repeats a small source's
            # items): which one came is unknown, and with it the exact position.
            self.ambiguous = self.ambiguous or len(matches) > 1
            place.delivered.add(matches[0])
            return
        expected = [R.values(e, place.batches[i], self.value_of) for i in candidates]
        promise = f"one of {expected}" if len(expected) > 1 else f"{expected[0]}"
        raise AssertionError(
            f"rank {r}/{self.world}, epoch {e.epoch}: got {got}, the docs promise {promise}"
            "\nsteps:\n  " + "\n  ".join(self.trace)
        )

    def _next(self, r: int) -> None:
        rank = self.ranks[r]
        if rank.status != "running":
            if all(x.status != "running" for x in self.ranks):
                self._next_epoch()
            else:
                return  # this rank waits for the others to end their epoch
        try:
            batch = next(rank.it)
        except StopIteration:
            left = [
                i
                for i in range(len(self.model.ranks[r].batches))
                if i not in self.model.ranks[r].delivered
            ]
            assert not left, (
                f"rank {r}, epoch {self.model.epoch}: StopIteration with {len(left)} batches "
                "of the epoch still due"
            )
            rank.status = "ended"
            rank.it = None
            if all(x.status == "ended" for x in self.ranks):
                self.model.emptied_by_skip = False
            return
        self._check_batch(r, batch)

    def _next_epoch(self) -> None:
        """Every rank has ended or left its epoch: the user's loop goes on to the next one."""
        epoch = self.ranks[0].user_epoch + 1
        assert all(x.user_epoch + 1 == epoch for x in self.ranks)
        if self.model.epoch + 1 != epoch:
            raise AssertionError(
                f"the user's loop is at epoch {epoch - 1}, the data at epoch {self.model.epoch}"
            )
        self.model = self._fresh_epoch(epoch)
        # (self.loose stays: which positions the new weights hold after the fix of item 5 is
        # that fix's choice, and later epochs' sources follow from it.)
        self.ambiguous = False
        self.old_weights_left = 0  # the holes were the last epoch's
        for rank in self.ranks:
            self._start_epoch(rank, epoch)

    # ---- rules --------------------------------------------------------------------------
    @rule(k=st.integers(1, 3), one=st.none() | st.integers(0, 2))
    def take(self, k: int, one: int | None) -> None:
        self.trace.append(f"take(k={k}, one={one})")
        who = range(self.world) if one is None else [one % self.world]
        for _ in range(k):
            for r in who:
                self._next(r)

    @rule()
    def leave(self) -> None:
        """``break`` out of the epoch on every rank; the state keeps the position."""
        self.trace.append("leave()")
        for rank in self.ranks:
            if rank.status == "running":
                rank.it = None
                rank.status = "left"

    @rule(r=st.integers(0, 2), w=st.integers(0, 1))
    def kill(self, r: int, w: int) -> None:
        rank = self.ranks[r % self.world]
        if rank.status != "running" or not self.opts.num_workers:
            return
        pids = worker_pids(rank.loader)
        pid = pids[w % len(pids)] if pids else 0
        self.trace.append(f"kill(rank={r % self.world}, pid={pid})")
        if pid > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    @rule(weights=st.data())
    def set_weights(self, weights: st.DataObject) -> None:
        """New weights before ``iter()``: from the first position of the next epoch."""
        if self.job.mixture is None:
            return
        # Weights change between epochs (data-plans.md): the user's loop finishes this one.
        while not self.model.finished() and any(x.status == "running" for x in self.ranks):
            for r in range(self.world):
                self._next(r)
        if not self.model.finished():
            return  # left with a break: the next epoch would start mid-way through nothing
        if "item2" in KNOWN_BUGS and self.opts.persistent:
            return  # item2: set_weights before iter() does not reach persistent workers
        w = weights.draw(weights_strategy(len(self.job.mixture)), label="weights")
        at = (self.model.epoch + 1) * self.job.spec.n
        self.trace.append(f"set_weights({w}, from_position={at})")
        named = dict(zip(SOURCES, w))
        for rank in self.ranks:
            rank.mix.set_weights(named, from_position=at)
        self.ref_mix.set_weights(named, from_position=at)
        self.weights = w

    @rule(
        via=st.sampled_from(["dict", "bytes", "torch", "json"]),
        data=st.data(),
    )
    def resume(self, via: str, data: st.DataObject) -> None:
        """Checkpoint every rank wherever it stands; resume in fresh loaders per the recipes."""
        job = self.job
        states = [roundtrip_state(rank.loader.state_dict(), via) for rank in self.ranks]
        e = self.model
        finished = e.finished()
        for r, sd in enumerate(states):
            # The quickstart resumes its epoch loop at state["epoch"]: a rank that delivered
            # its share's last batch is at the next epoch's start (guarantees.md).
            done = e.ranks[r].done() and not e.emptied_by_skip
            assert sd["epoch"] == e.epoch + done, (
                f"rank {r}: state_dict()['epoch'] is {sd['epoch']}; the rank is "
                f"{'past the end of' if done else 'in'} epoch {e.epoch}"
            )
        dist = job.spec.sampler == "dist"
        world = data.draw(st.integers(1, 3), label="world") if dist else 1
        batch_size = data.draw(st.integers(1, 4), label="batch_size")
        opts = data.draw(opts_for(world), label="opts")
        weights = self.weights
        if job.mixture is not None and data.draw(st.booleans(), label="new weights"):
            weights = data.draw(weights_strategy(len(job.mixture)), label="weights")
        # Every draw is made whatever the job's state, so that a replay (timing decides which
        # batches came first under in_order=False) draws the same choices.
        left = len(e.left()) if not finished else 0
        skip_drawn = data.draw(st.none() | st.integers(0, 12), label="skip")
        skip = min(skip_drawn, left) if skip_drawn is not None else 0
        own_drawn = data.draw(st.booleans(), label="own states")
        if self.ambiguous and not finished:
            # The model does not know which of two equal batches came (in_order=False): only
            # a resume whose outcome does not depend on it.
            world, batch_size, skip, weights = self.world, self.batch_size, 0, self.weights
            opts = replace(opts, num_workers=min(opts.num_workers, MAX_TOTAL_WORKERS // world))
        own = dist and world == self.world and batch_size == self.batch_size and not skip
        own = own and own_drawn
        ahead = dist and any(r.delivered != set(range(len(r.delivered))) for r in e.ranks)
        reshaped = world != self.world or batch_size != self.batch_size or skip
        if ahead and reshaped:
            # distributed.md: with batches delivered ahead (in_order=False) the ranks' batches
            # are not a prefix of their shares: refused on another world size (and, by the
            # same reasoning, another batch size or a skip); exact on the same one.
            merged_state = merge_rank_states(states)
            probe = self._build_rank(0, world, batch_size, Opts(0, False, True), weights)
            try:
                with pytest.raises(CheckpointError):
                    if skip:
                        skip_samples(merged_state, skip)
                    else:
                        probe.loader.load_state_dict(merged_state)
            finally:
                probe.loader.close()
            world, batch_size, skip, own = self.world, self.batch_size, 0, True
            opts = replace(opts, num_workers=min(opts.num_workers, MAX_TOTAL_WORKERS // world))
        # data-plans.md: a DistributedSampler job between epochs (nothing of the epoch
        # consumed yet) cannot be skipped in: the script, not the state, sets the next epoch.
        between = dist and len(e.left()) == len(e.order)
        if skip and between:
            with pytest.raises(CheckpointError, match="between two epochs"):
                skip_samples(merge_rank_states(states), skip)
            skip = 0
        if skip and dist and "skip-out-of-step" in KNOWN_BUGS:
            done = [r.done() for r in e.ranks]
            started = any(r.delivered for r, d in zip(e.ranks, done) if not d)
            if any(done) and not started and not e.gone:
                skip = 0  # skip-out-of-step: refused as "between two epochs"
        done = [r.done() for r in e.ranks]
        same_shape = world == self.world and batch_size == self.batch_size and not skip
        if dist and any(done) and not all(done) and same_shape:
            # A rank that finished its share resumes (on the same shape) into the next epoch
            # while the others finish this one: the model keeps one epoch for the whole job,
            # so this resume is not taken (the states were checked above).
            self.trace.append("resume: not taken, ranks across an epoch's end")
            return
        self.trace.append(
            f"resume(via={via}, world={world}, batch_size={batch_size}, {opts!r}, "
            f"weights={weights}, skip={skip}, own={own}) at epoch {e.epoch} "
            f"{'(finished)' if finished else ''}"
        )
        merged = merge_rank_states(states) if dist and not own else None
        base = merged if merged is not None else states[0]
        if skip:
            base = skip_samples(base, skip)
        for rank in self.ranks:
            rank.it = None
            rank.loader.close()
        self.ranks = []
        new = [self._build_rank(r, world, batch_size, opts, weights) for r in range(world)]
        self.ranks = new
        said: list[str] = []
        for r, rank in enumerate(new):
            sd = states[r] if own else base
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                rank.loader.load_state_dict(sd)
            said += [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        self.resumes += 1
        # The model: the rest of the epoch, re-cut where the resume changed its shape.
        if finished:
            self.world, self.batch_size = world, batch_size
            model = self._fresh_epoch(e.epoch + 1)
            self.ambiguous = False
            self.old_weights_left = 0  # the holes were the finished epoch's
        elif dist and same_shape:
            # On the same world size and batch size each rank continues its own share, from
            # its own state or the job's global one: nothing to re-cut, nothing to pad.
            model = R.keep(e)
        elif same_shape:
            model = R.recut(e, job.spec, world, batch_size, job.drop_last)
        else:
            model = R.recut(e, job.spec, world, batch_size, job.drop_last, skip)
            if dist:
                self._check_uneven_warning(e, model, skip, said)
        if job.mixture is not None and weights != self.weights:
            self._new_weights_at_resume(e, model, finished, weights, said)
        self.model, self.world, self.batch_size, self.opts = model, world, batch_size, opts
        self.weights = weights
        for rank in new:
            if dist:
                # docs/distributed.md's recipe, as written there.
                start = rank.loader.state_dict()["distributed"]["sampler_epoch"]
                if "item1" in KNOWN_BUGS and finished:
                    start = model.epoch  # item1: the recipe replays the finished epoch
            else:
                start = states[0]["epoch"] if not skip else base["epoch"]  # the quickstart
            assert start == model.epoch, (
                f"the recipe resumes the user's loop at epoch {start}; the data is at epoch "
                f"{model.epoch}"
            )
            self._start_epoch(rank, start)
        # An epoch a skip emptied ends at its first iter(), which the loop above called: from
        # here a state is the next epoch's start (guarantees.md, "the loader knows").
        self.model.emptied_by_skip = False

    @rule(
        k=st.integers(0, 3),
        via=st.sampled_from(["dict", "bytes", "torch", "json"]),
        data=st.data(),
    )
    def take_then_resume(self, k: int, via: str, data: st.DataObject) -> None:
        """A preemption after some steps: the rule that makes resumes common (Hypothesis
        switches whole rules off per example)."""
        if k:
            self.take(k=k, one=None)
        self.resume(via=via, data=data)

    def _check_uneven_warning(self, e: R.Epoch, model: R.Epoch, skip: int, said: list[str]) -> None:
        """distributed.md: a rest that is not a multiple of the new world size is padded or
        trimmed, and "a RuntimeWarning says how many samples"."""
        taken = {p for r in e.ranks for p in r.delivered_positions() if not R.is_pad(p)}
        before = set(range(len(e.order))) - e.gone - taken
        rest = e.left()[skip:]
        shares = [p for r in model.ranks for p in r.share]
        pads = sum(R.is_pad(p) for p in shares)
        dropped = len(before) - skip - sum(not R.is_pad(p) for p in shares)
        if not taken and not e.gone:
            return  # the epoch's start: torch's own shards, padded as torch pads them
        if skip and "skip-pad-warning" in KNOWN_BUGS:
            return  # skip-pad-warning: no warning after skip_samples
        if pads:
            assert any(f"{pads} of them are repeated" in m for m in said), (
                f"the resume repeats {pads} samples to pad the last step; it warned {said}"
            )
        trim = len(before) - len(rest) - skip
        # The old world size's trim is what the uninterrupted run leaves out too: the warning is
        # owed when the new cut drops more (then it gives the whole account).
        if dropped > trim and "item11" not in KNOWN_BUGS:
            assert any(str(dropped) in m and "dropped" in m for m in said), (
                f"the resume drops {dropped} samples of the epoch ({trim} by the old world "
                f"size's trim); it warned {said}"
            )

    def _new_weights_at_resume(
        self,
        e: R.Epoch,
        model: R.Epoch,
        finished: bool,
        weights: tuple[int, ...],
        said: list[str],
    ) -> None:
        """data-plans.md ("Through the loader"): a mixture built with new weights gets them
        after the last sample consumed: from the global position after it under
        ``shuffle=False``; from that place of the epoch's order (a rest) under a shuffling
        sampler. The unconsumed samples before it (batches delivered ahead under
        in_order=False, ranks out of step) keep the old weights, and the load warns."""
        n = self.job.spec.n
        # Consumed or skipped (a skip's samples are not ahead); not a share that drop_last
        # leaves without a batch, which the loader never delivers but nobody consumed. The
        # model's positions are places in the epoch's order, as the docs' rests count them.
        consumed = set(model.gone) | {
            p for r in model.ranks for p in r.delivered_positions() if not R.is_pad(p)
        }
        top = max(consumed) + 1 if consumed else 0
        # data-plans.md: "Batches delivered ahead out of order (in_order=False), or ranks out
        # of step, leave a few unconsumed samples before the last consumed one: those keep the
        # old weights, and the load says how many with a RuntimeWarning."
        behind = top - len(consumed)
        if finished:
            at = (e.epoch + 1) * n
        elif not consumed:
            at = e.epoch * n  # nothing of the epoch consumed: its first position
        elif self.job.spec.sampler == "seq":
            # data-plans.md: "shuffle=False: from the global position after the last sample
            # consumed" -- exact, the holes before it included (they keep the old plan).
            at = e.epoch * n + top
            if behind:
                event("new weights at a resume: holes keep the old weights (shuffle=False)")
                assert any(f"{behind} samples before it were not consumed" in m for m in said), (
                    f"{behind} samples before the new weights' start keep the old weights; "
                    f"the load warned {said}"
                )
        elif "item5" in KNOWN_BUGS:
            at = (e.epoch + 1) * n  # item5: the docs' own words before the fix
        else:
            at = e.epoch * n
            self.loose = True
            # A rank's own state takes the other ranks to be in step with it, so the ranks
            # may place the start differently: the job-wide count of holes bounds each one's.
            self.old_weights_left = behind
            if behind:
                event("new weights at a resume: holes keep the old weights (loose)")
        self.ref_mix.set_weights(dict(zip(SOURCES, weights)), from_position=at)
        self.trace[-1] += f" -> new weights from {at}"


UserMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    # FUZZ_NO_SHRINK=1: report the first failure as found (shrinking a failure takes minutes).
    phases=[Phase.explicit, Phase.reuse, Phase.generate]
    if os.environ.get("FUZZ_NO_SHRINK")
    else list(Phase),
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
TestUserMachine = pytest.mark.timeout(0 if PROFILE == "long" else 600)(UserMachine.TestCase)
