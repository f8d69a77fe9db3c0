"""The schema of a loader state: what the user consumed, as plain data, and its validation.

``ResumePoint`` is the one reader and the one writer: ``to_state`` writes the plain dict that
``state_dict()`` returns, and ``from_state`` validates one and reads it back (the round trip is
the identity). The bytes of a state file are ``state.codec``'s business.

A state is a dict of plain data (None/bool/int/float/str/bytes/list/dict with str keys): it
survives ``torch.save`` + ``torch.load(weights_only=True)``, json (when the dataset's own state
is json-able) and msgpack (``dump_state``). Keys:

    format, version       what this is; refused if unknown
    config                the configuration the state is valid for (refused on mismatch);
                          its ``batch_sampler`` describes a batch_sampler passed to the
                          loader (its class, and torch's batch size and drop_last), None where
                          the loader batches itself: such batches' size is the batch
                          sampler's own (``batch_size`` None), so the position is not re-cut
    seed                  the epoch's seed, every other seed of the epoch derives from it;
                          None when the epoch has not begun (drawn at its ``iter()``)
    seed_chain            where the next epochs' seeds come from: {root, next} (a root drawn
                          when the loader was built; epoch n's seed derives from it) or
                          {generator} (the loader's generator's state, base64). None under
                          torch's DistributedSampler (its seed and epoch decide)
    epoch                 the epoch to continue (or start)
    consumed              batches of that epoch the user has consumed, in order
    delivered_ahead       task ids > consumed already delivered (in_order=False)
    sampler_state, drawn, sampler_done, outstanding
                          stateful user samplers only: the sampler's own state (as of ``drawn``
                          batches; ``sampler_done`` if its epoch was drawn to the end, after
                          which many samplers rewind), and the indices of drawn batches not
                          yet consumed
    workers, next_worker  iterable datasets only: per worker {id, delivered, exhausted,
                          dataset_state, state_at}: batches consumed, the dataset's state
                          after ``state_at`` of them (the rest are replayed on resume); and
                          the worker whose batch comes next
    skipped               poison tasks skipped so far: [epoch, task id, indices]
    skipped_samples       samples skipped by ``skip_samples`` (read never): [epoch, samples of
                          that epoch consumed or skipped before, count]
    sample_cut            built-in samplers only, and only once a resume with another batch
                          size or a skip moved the cut: {start, holes}: the rest of the epoch
                          is its positions [start, n) minus holes [[first, count], ...]
                          (delivered ahead), and ``consumed``/``delivered_ahead`` count the
                          batches of *that* rest (see ``state.cursor``). Absent: cut from position 0
    sampler_generator     a fast-forwarded sampler's own generator (SubsetRandomSampler(...,
                          generator=g)): its state at the epoch's start (inside an epoch) or
                          now (between epochs); absent for other samplers
    data_plan             a ``Mixture`` dataset's own state (its seed, weights history and
                          sources' names, lengths and fingerprints); absent for other datasets
    dataset               the data the state was taken on: {class, fingerprint} (its length is
                          config.dataset_len; see ``state.fingerprint``). Absent in states written
                          before dataset checks: their class and fingerprint are not checked
    distributed           torch's DistributedSampler only: {sampler_epoch, history, ended}:
                          the sampler epoch the loader delivers next (inside an epoch, the one
                          being iterated; between epochs, the one a script that calls
                          ``set_epoch(epoch)`` per epoch sets next), the levels of resumes on
                          another world size within it ([[world size, [samples each rank
                          took]], ...]), and whether the state was taken right after epoch
                          ``sampler_epoch - 1`` was delivered to its end, the sampler still set
                          to it (absent in states written before it was recorded: see
                          ``state.ranks.settle``)
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import CheckpointError
from . import fingerprint as F
from .codec import MAX_DEPTH, clip_repr, clip_text
from .cursor import Cut, check_cut
from .seeds import check_chain, check_generator

FORMAT = "resumable_loader.DataLoader"
# 4: the position may be a sample cursor (``sample_cut``), and skips are recorded
# (``skipped_samples``): a version-3 reader would ignore the cut and resume at the wrong sample,
# so it must refuse these states. A version-3 state is a version-4 state without those keys (the
# epoch cut from position 0, nothing skipped): it is read as one (``UPGRADABLE``).
# 3: the seed chain (the source of every later epoch's seed) is part of the state, so later
# epochs no longer depend on the resumed process's RNGs. 2: the epoch's seed was drawn at each
# iter() from the generator or the global RNG, which a version-2 state does not hold: its later
# epochs cannot be honoured, so it is refused (as is version 1, one seed per loader).
VERSION = 4
UPGRADABLE = (3,)

K_FORMAT = "format"
K_VERSION = "version"
K_CONFIG = "config"
K_SEED = "seed"
K_CHAIN = "seed_chain"
K_DIST = "distributed"
K_EPOCH = "epoch"
K_CONSUMED = "consumed"
K_AHEAD = "delivered_ahead"
K_SAMPLER_STATE = "sampler_state"
K_DRAWN = "drawn"
K_SAMPLER_DONE = "sampler_done"
K_OUTSTANDING = "outstanding"
K_WORKERS = "workers"
K_NEXT_WORKER = "next_worker"
K_SKIPPED = "skipped"
K_PLAN = "data_plan"
K_SAMPLER_RNG = "sampler_generator"
K_SKIPPED_SAMPLES = "skipped_samples"
K_CUT = "sample_cut"
K_DATASET = "dataset"

# The top-level keys, in the order a state holds them (and the CLI's summary shows them).
KNOWN_KEYS = (
    K_FORMAT,
    K_VERSION,
    K_CONFIG,
    K_SEED,
    K_CHAIN,
    K_DIST,
    K_SKIPPED,
    K_SKIPPED_SAMPLES,
    K_EPOCH,
    K_CUT,
    K_CONSUMED,
    K_AHEAD,
    K_SAMPLER_STATE,
    K_DRAWN,
    K_SAMPLER_DONE,
    K_OUTSTANDING,
    K_WORKERS,
    K_NEXT_WORKER,
    K_SAMPLER_RNG,
    K_PLAN,
    K_DATASET,
)

# Config fields that must match for a state to be loaded; num_workers and batch_size only for
# streams (a map-style batch does not depend on which worker loads it; a stream's shards do, and
# its position is in fetches). A map-style state's batch size may differ: the loader re-cuts the
# position in samples where its sampler allows it (``DataLoader.load_state_dict``). dataset_len
# is checked with the rest of the data (``state.fingerprint``): a load may opt to continue past it.
MUST_MATCH = (
    "dataset_kind",
    "drop_last",
    "sampler",
    "world_size",
    "rank",
)

_FIX = {
    "dataset_kind": "load the state into a loader over the same kind of dataset",
    "batch_size": "an iterable dataset's position is in batches fetched per worker: build the "
    "loader with the batch_size the checkpoint was taken with",
    "drop_last": "build the loader with the drop_last the checkpoint was taken with",
    "sampler": "build the loader with the same sampler / shuffle setting as the checkpoint",
    "world_size": "resume with the same number of ranks, or -- with a DistributedSampler -- "
    "load the job's global state on the new ranks: saved by torch.distributed.checkpoint, or "
    "resumable_loader.merge_rank_states([the state of every rank])",
    "rank": "load each rank's own state, or the job's global state (saved by "
    "torch.distributed.checkpoint, or resumable_loader.merge_rank_states) on every rank",
    "num_workers": "an iterable dataset is sharded per worker, so a stream checkpoint can only "
    "resume with the same num_workers",
}


@dataclass
class WorkerPosition:
    """Where one stream worker's shard stands, as far as the caller consumed it."""

    delivered: int = 0
    exhausted: bool = False
    dataset_state: Any = None
    state_at: int = 0  # dataset_state was taken after this many of the delivered fetches

    def to_state(self, wid: int) -> dict[str, Any]:
        return {
            "id": wid,
            "delivered": self.delivered,
            "exhausted": self.exhausted,
            "dataset_state": self.dataset_state,
            "state_at": self.state_at if self.dataset_state is not None else 0,
        }


@dataclass
class ResumePoint:
    """A position in the stream of batches: what ``state_dict()`` writes, and what a validated
    state gives the next ``iter()``.

    ``stateful`` (a user sampler with ``state_dict()``) and ``iterable`` (a stream) say which
    groups of keys the state holds.

    Built once and then only read on the resume path: ``parse_state`` makes it in one call,
    the resume plan (``loader.resume``) and ``state_dict()`` (``loader.state_out``) derive new
    ones with ``dataclasses.replace``, and the iterators only read the point they continue.
    """

    # Not frozen, for the one place that still assembles a point field by field: a running
    # epoch's position is written by the stages that know it -- the task source's ``export``
    # adds a stateful sampler's draws or a stream's shards to the point its iterator made
    # (``pipeline.tasks``, ``loader.iterators``) -- and ``state.ranks.settle`` fills in an old
    # state's ``ended`` on a freshly parsed point. Freezing it means a TaskSource contract that
    # returns fields instead; the pipeline's modules are another step's.

    seed: int | None
    epoch: int
    chain: dict[str, Any] | None = None
    consumed: int = 0
    ahead: frozenset[int] = frozenset()
    sampler_state: Any = None
    drawn: int = 0
    sampler_done: bool = False
    outstanding: list[tuple[int, Any]] = field(default_factory=list)
    workers: list[WorkerPosition] = field(default_factory=list)
    next_worker: int = 0
    skipped: list[Any] = field(default_factory=list)
    sampler_epoch: int = 0
    history: list[Any] = field(default_factory=list)
    # Whether epoch ``sampler_epoch - 1`` was just delivered to its end (the sampler still set
    # to it); None: not said (a state written before it was recorded).
    ended: bool | None = None
    plan: dict[str, Any] | None = None
    sampler_rng: str | None = None
    cut: Cut | None = None  # the rest of the epoch as positions (see ``state.cursor``)
    skipped_samples: list[list[int]] = field(default_factory=list)
    dataset: dict[str, Any] | None = None  # the data's record (``state.fingerprint.record``)
    # The batch size ``consumed`` and ``ahead`` count in: the state's config.batch_size, as read.
    batch: int | None = field(default=None, compare=False)
    # Whether the state's batches came from a batch_sampler passed to the loader (its
    # config.batch_sampler is not None); None: not said (written before that was recorded).
    batch_sampler: bool | None = field(default=None, compare=False)
    stateful: bool = False
    iterable: bool = False
    distributed: bool = False
    source: dict[str, Any] | None = field(default=None, compare=False)  # the state read
    # How the data differs from the state's (``state.fingerprint.changes``), when the load
    # allowed it.
    dataset_changes: list[str] = field(default_factory=list, compare=False)

    def per_task(self) -> int | None:
        """Samples per task in ``consumed`` and ``ahead``: the batch size (1 unbatched); None
        when unknown -- the batches of a ``batch_sampler`` passed to the loader are of its own
        making (the loader's ``batch_size`` is None), and a state written before
        ``config.batch_sampler`` was recorded does not say, with ``batch_size`` None, whether
        it batched at all. A position of unknown size per task cannot be re-cut or skipped."""
        if self.batch is not None:
            return self.batch
        return 1 if self.batch_sampler is False else None

    def to_state(self, config: dict[str, Any]) -> dict[str, Any]:
        """The plain-data state (see the module docstring for the keys)."""
        sd: dict[str, Any] = {
            K_FORMAT: FORMAT,
            K_VERSION: VERSION,
            K_CONFIG: dict(config),
            K_SEED: self.seed,
            K_CHAIN: self.chain,
            K_SKIPPED: [[e, t, plain_indices(i)] for e, t, i in self.skipped],
            K_SKIPPED_SAMPLES: [list(x) for x in self.skipped_samples],
            K_EPOCH: self.epoch,
        }
        if self.cut is not None and not self.cut.is_trivial:
            sd[K_CUT] = self.cut.to_state()
        sd |= {
            K_CONSUMED: self.consumed,
            K_AHEAD: sorted(self.ahead),
        }
        if self.stateful:
            sd[K_SAMPLER_STATE] = self.sampler_state
            sd[K_DRAWN] = self.drawn
            sd[K_SAMPLER_DONE] = self.sampler_done
            sd[K_OUTSTANDING] = [[t, plain_indices(i)] for t, i in sorted(self.outstanding)]
        if self.iterable:
            sd[K_WORKERS] = [w.to_state(wid) for wid, w in enumerate(self.workers)]
            sd[K_NEXT_WORKER] = self.next_worker
        if self.sampler_rng is not None:
            sd[K_SAMPLER_RNG] = self.sampler_rng
        if self.plan is not None:
            sd[K_PLAN] = self.plan
        if self.dataset is not None:
            sd[K_DATASET] = dict(self.dataset)
        if self.distributed:
            sd[K_DIST] = {
                "sampler_epoch": self.sampler_epoch,
                "history": [[w, list(c)] for w, c in self.history],
                "ended": self.ended is True,
            }
        return sd

    @classmethod
    def from_state(
        cls, sd: Any, config: dict[str, Any], stateful_sampler: bool, **data: Any
    ) -> ResumePoint:
        """Validate ``sd`` against a loader's ``config`` and read it (see ``parse_state``;
        ``data``: its ``dataset`` and ``dataset_change_ok``)."""
        return parse_state(sd, config, stateful_sampler, **data)


def has_state(obj: object) -> bool:
    """Whether ``obj`` saves and restores itself (``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def same_state(a: Any, b: Any) -> bool:
    """Deep equality of two saved states: dicts, lists and tuples item by item, tensors and
    arrays by value (their ``==`` is elementwise), anything else by ``==``. False rather than
    an error for values that cannot be compared."""
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(same_state(v, b[k]) for k, v in a.items())
        )
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
        )
    if hasattr(a, "shape") and hasattr(b, "shape"):
        try:
            return bool(a.shape == b.shape and (a == b).all())
        except Exception:
            return False
    return _same(a, b)


def plain_indices(idx: Any) -> Any:
    """A task's sample indices as plain ints: samplers often yield numpy or tensor integers,
    which are not plain data (json, msgpack and torch.load(weights_only=True) refuse them)."""
    if isinstance(idx, (list, tuple)):
        return [_plain_index(i) for i in idx]
    return _plain_index(idx)


def _plain_index(i: Any) -> Any:
    if type(i) is int:
        return i
    try:
        return int(operator.index(i))
    except TypeError:
        return i  # not an integer at all: parse_state says so on load


def _same(a: Any, b: Any) -> bool:
    """Equality that is a plain bool for plain data and False for anything else (an array's
    ``==`` is elementwise, and its truth value raises)."""
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


def _indices_ok(idx: Any, n: Any) -> bool:
    """Sample indices of one batch: an int (batch_size=None) or a non-empty list of ints, each in
    [0, n) when the dataset length ``n`` is known."""

    def ok(i: Any) -> bool:
        return type(i) is int and i >= 0 and (type(n) is not int or i < n)

    if type(idx) is int:
        return ok(idx)
    return isinstance(idx, list) and bool(idx) and all(ok(i) for i in idx)


def _fail(field_name: str, problem: str, fix: str) -> CheckpointError:
    return CheckpointError(f"cannot load DataLoader state: {field_name}: {problem}. {fix}.")


def _int(sd: dict[str, Any], key: str, *, minimum: int = 0) -> int:
    v = sd.get(key)
    if type(v) is not int or v < minimum:
        raise _fail(
            key, f"expected an int >= {minimum}, got {clip_repr(v)}", "the state is damaged"
        )
    return v


def _chain(sd: dict[str, Any], distributed: bool) -> dict[str, Any] | None:
    chain = sd.get(K_CHAIN)
    if chain is None and distributed:
        return None  # the DistributedSampler's seed and epoch decide every epoch's seed
    problem = check_chain(chain)
    if problem is not None:
        raise _fail(K_CHAIN, problem, "the state is damaged")
    assert isinstance(chain, dict)
    return dict(chain)


def parse_state(
    sd: Any,
    config: dict[str, Any],
    stateful_sampler: bool,
    *,
    dataset: dict[str, Any] | None = None,
    dataset_change_ok: bool = False,
) -> ResumePoint:
    """Validate ``sd`` against this loader's ``config``; raise CheckpointError naming the field.

    Pure: reads ``sd`` only, changes nothing.

    Args:
        dataset: the loader's record of its data (``state.fingerprint.record``); None compares the
            length alone.
        dataset_change_ok: read a state taken on other data (``on_dataset_change="continue"``):
            the changes are in ``dataset_changes`` of the result. Otherwise they are refused.
    """
    if isinstance(sd, dict):
        _check_nesting(sd)
    elastic = _elastic_stream(sd, dataset)
    _check_header(sd, config, elastic)
    saved = _read_dataset(sd)
    changes = F.changes(saved, sd[K_CONFIG].get("dataset_len"), dataset, config["dataset_len"])
    if changes and not dataset_change_ok:
        raise F.changed_error(changes)
    # Read field by field, in the order the checks name them, and built once: a ResumePoint
    # is not changed after it is made on the resume path (see ``ResumePoint``).
    seed = None if K_SEED in sd and sd[K_SEED] is None else _read_seed(sd)
    fields: dict[str, Any] = {
        "epoch": _int(sd, K_EPOCH),
        "chain": _chain(sd, str(config["sampler"]).startswith("distributed(")),
        "stateful": stateful_sampler,
        "iterable": config["dataset_kind"] == "iterable",
        "source": sd,
        "dataset": saved,
        "dataset_changes": changes,
    }
    consumed = fields["consumed"] = _int(sd, K_CONSUMED)
    required = (K_AHEAD, K_OUTSTANDING, K_SAMPLER_DONE) if stateful_sampler else (K_AHEAD,)
    for key in required:
        if key not in sd:
            raise _fail(key, "missing", "the state is damaged (a loader state always has it)")
    ahead = sd.get(K_AHEAD, [])
    if not isinstance(ahead, list) or any(type(t) is not int or t <= consumed for t in ahead):
        raise _fail(
            K_AHEAD,
            f"expected ids > consumed ({consumed}), got {clip_repr(ahead)}",
            "the state is damaged",
        )
    fields["ahead"] = frozenset(ahead)
    if stateful_sampler:
        fields |= _read_sampler(sd, config)
        if ahead and max(ahead) >= fields["drawn"]:
            # A batch is delivered after the sampler drew it.
            raise _fail(
                K_AHEAD,
                f"batch {max(ahead)} delivered ahead, but only {fields['drawn']} were drawn",
                "the state is damaged",
            )
    if fields["iterable"]:
        # A Stream's state is re-dealt to this loader's workers (``loader.resume``): its
        # entries are read as the saving loader's, however many there were.
        n = sd[K_CONFIG]["num_workers"] if elastic else config["num_workers"]
        fields |= _read_workers(sd, max(1, n))
        _check_stream_consumed(consumed, fields["workers"])
    if str(config["sampler"]).startswith("distributed("):
        fields |= _read_distributed(sd)
    fields["skipped"] = _read_skipped(sd)
    fields["skipped_samples"] = _read_skipped_samples(sd)
    cut, problem = check_cut(sd.get(K_CUT), None)
    if problem is not None:
        raise _fail(K_CUT, f"{problem}, got {clip_repr(sd.get(K_CUT))}", "the state is damaged")
    if cut is not None and stateful_sampler:
        raise _fail(K_CUT, "a stateful sampler's state has no sample cut", "the state is damaged")
    fields["cut"] = cut
    fields["batch"] = sd[K_CONFIG].get("batch_size")
    if "batch_sampler" in sd[K_CONFIG]:
        fields["batch_sampler"] = sd[K_CONFIG]["batch_sampler"] is not None
    fields["plan"] = _read_plan(sd, fields["epoch"], bool(consumed or ahead))
    rng = sd.get(K_SAMPLER_RNG)
    if rng is not None:
        problem = check_generator(rng)
        if problem is not None:
            raise _fail(K_SAMPLER_RNG, problem, "the state is damaged")
        fields["sampler_rng"] = rng
    rp = ResumePoint(seed=seed, **fields)
    _check_begun(rp)
    return rp


# Every seed a loader writes is 63 bits (``state.seeds``: derived or drawn so); one past them
# was not written by a loader, and would be folded into 64 bits by the seeding.
_SEED_END = 2**63


def _read_seed(sd: dict[str, Any]) -> int:
    seed = sd.get(K_SEED)
    if type(seed) is not int or not 0 <= seed < _SEED_END:
        raise _fail(
            K_SEED,
            f"expected None or an int in [0, 2**63), got {clip_repr(seed)}",
            "the state is damaged",
        )
    return seed


def _read_plan(sd: dict[str, Any], epoch: int, delivered: bool) -> dict[str, Any] | None:
    """A ``Mixture``'s plan, as far as it must agree with the rest of the state (the plan
    itself is ``plans.mixture_state``'s to validate).

    Its ``num_samples`` is the mixture's length, which the state's config records as
    ``dataset_len``. Its ``epoch`` is the one the loader's last ``iter()`` set: once a batch
    of the state's epoch was ``delivered``, that epoch. (Between epochs it is the epoch
    before, or -- before any ``iter()`` -- whatever the mixture was built with.)"""
    plan = sd.get(K_PLAN)
    if plan is None:
        return None
    if not isinstance(plan, dict):
        raise _fail(K_PLAN, f"expected a dict, got {type(plan).__name__}", "the state is damaged")
    length = sd[K_CONFIG].get("dataset_len")
    theirs = plan.get("num_samples")
    if type(theirs) is int and type(length) is int and theirs != length:
        raise _fail(
            f"{K_PLAN}.num_samples",
            f"{clip_repr(theirs)}, but the state's config.dataset_len (the Mixture's "
            f"length) is {length}",
            "the state is damaged",
        )
    theirs = plan.get("epoch")
    if delivered and type(theirs) is int and theirs != epoch:
        raise _fail(
            f"{K_PLAN}.epoch",
            f"{clip_repr(theirs)}, but the state is inside epoch {epoch}, which the loader "
            "set the Mixture to",
            "the state is damaged",
        )
    return plan


def _check_begun(rp: ResumePoint) -> None:
    """A state whose epoch has progress must carry that epoch's seed: the order of what is left
    (and the values of its batches) derive from it, and no other seed continues it exactly."""
    if rp.seed is not None:
        return
    progress = []
    if rp.consumed:
        progress.append(f"{K_CONSUMED}={rp.consumed}")
    if rp.ahead:
        progress.append(f"{K_AHEAD}={sorted(rp.ahead)[:5]}")
    if rp.stateful and (rp.drawn or rp.outstanding or rp.sampler_done):
        progress.append(f"{K_DRAWN}={rp.drawn}")
    if any(w.delivered or w.exhausted for w in rp.workers):
        progress.append(f"{K_WORKERS}[].delivered={[w.delivered for w in rp.workers][:8]}")
    if rp.history:
        progress.append("distributed.history is not empty")
    if progress:
        raise _fail(
            K_SEED,
            f"None (the epoch has not begun), but the state is inside epoch {rp.epoch} "
            f"({', '.join(progress)})",
            "the state is damaged: only the seed it was taken with continues that epoch",
        )


def _check_nesting(sd: dict[Any, Any]) -> None:
    """Refuse a state nested deeper than ``MAX_DEPTH`` containers or holding itself, naming the
    field. ``torch.load(weights_only=True)`` builds either from a small file, and the loader
    reprs, copies and compares states recursively: without this, such a state would end in a
    RecursionError or an endless copy instead of a CheckpointError.

    Iterative, and each container is walked once however often it is shared (a file can refer
    to one list millions of times): the work is linear in what the file describes.
    """
    container = (dict, list, tuple)
    height: dict[int, int] = {}  # containers walked already: id -> how many levels they hold
    open_ids = {id(sd)}  # the containers on the path from the root to the value at hand
    # One frame per open container: its (key, value) pairs, its id, its tallest child so far.
    frames: list[list[Any]] = [[iter(sd.items()), id(sd), 0]]
    keys: list[Any] = [None]  # the key of the value each frame gave last: the field's path
    while frames:
        frame = frames[-1]
        item = next(frame[0], None)
        if item is None:
            frames.pop()
            keys.pop()
            open_ids.discard(frame[1])
            height[frame[1]] = frame[2] + 1
            if frames:
                frames[-1][2] = max(frames[-1][2], frame[2] + 1)
            continue
        key, value = item
        keys[-1] = key
        if not isinstance(value, container):
            continue
        ident = id(value)
        if ident in open_ids:
            raise _fail(_field(keys), "the state holds itself", _PLAIN_FIX)
        below = height.get(ident)
        if below is None and not any(issubclass(k, container) for k in _item_kinds(value)):
            below = height[ident] = 1  # a container of leaves: the common case, at C speed
        if below is not None:
            if len(frames) + below > MAX_DEPTH:
                raise _fail(_field(keys), f"nested deeper than {MAX_DEPTH} levels", _PLAIN_FIX)
            frame[2] = max(frame[2], below)
            continue
        if len(frames) >= MAX_DEPTH:
            raise _fail(_field(keys), f"nested deeper than {MAX_DEPTH} levels", _PLAIN_FIX)
        open_ids.add(ident)
        frames.append([_pairs(value), ident, 0])
        keys.append(None)


_PLAIN_FIX = (
    "a loader state is plain data, a few levels deep; the file is damaged or was not written "
    "from state_dict() -- use an earlier checkpoint"
)


def _item_kinds(value: Any) -> set[type]:
    if isinstance(value, dict):
        return set(map(type, value.values())) | set(map(type, value))
    return set(map(type, value))


def _pairs(value: Any) -> Any:
    """(key, value) pairs of a container; a dict's tuple keys count as values too (a pickle can
    nest them as deeply as anything else)."""
    if isinstance(value, dict):
        return itertools.chain(value.items(), ((k, k) for k in value if isinstance(k, tuple)))
    return enumerate(value)


def _field(keys: list[Any]) -> str:
    """A path of keys as a field name: ``workers[0].dataset_state``."""
    out = ""
    for key in keys:
        if isinstance(key, str) and key.isidentifier():
            out += f".{key}" if out else key
        else:
            out += f"[{clip_repr(key, 40)}]"
    return clip_text(out, 200) or "the state"


def _read_distributed(sd: dict[str, Any]) -> dict[str, Any]:
    """A DistributedSampler's part: its epoch and the history of world-size changes (the
    ``ResumePoint`` fields)."""
    d = sd.get(K_DIST)
    history = d.get("history") if isinstance(d, dict) else None
    ok = (
        isinstance(d, dict)
        # Every key is ours: one we do not know would be dropped by the next state_dict().
        and set(d) <= {"sampler_epoch", "history", "ended"}
        and type(d.get("sampler_epoch")) is int
        and 0 <= d["sampler_epoch"] < 2**62
        and isinstance(history, list)
        and type(d.get("ended", False)) is bool
        and all(
            isinstance(h, list)
            and len(h) == 2
            and type(h[0]) is int
            and h[0] >= 1
            and isinstance(h[1], list)
            and len(h[1]) == h[0]
            and all(type(c) is int and c >= 0 for c in h[1])
            for h in history
        )
    )
    if not ok:
        raise _fail(
            K_DIST,
            "expected {sampler_epoch: int, history: [[world size, [samples per rank]], ...], "
            f"ended: bool (optional)}} and no other key, "
            f"got {clip_repr(d)}",
            "the state is damaged",
        )
    assert isinstance(d, dict) and isinstance(history, list)
    return {
        "distributed": True,
        "sampler_epoch": d["sampler_epoch"],
        "history": [[w, list(c)] for w, c in history],
        "ended": d.get("ended"),
    }


# The dataset record's class of a ``resumable_loader.Stream`` (``state.fingerprint.record``).
STREAM_CLASS = "Stream"


def is_stream_record(saved: Any, dataset: dict[str, Any] | None) -> bool:
    """Whether the saved dataset record and the loader's are both a Stream's."""
    return (
        isinstance(saved, dict)
        and saved.get(F.K_CLASS) == STREAM_CLASS
        and dataset is not None
        and dataset.get(F.K_CLASS) == STREAM_CLASS
    )


def _elastic_stream(sd: Any, dataset: dict[str, Any] | None) -> bool:
    """Whether ``sd`` is a Stream's state loaded into a loader over a Stream: its position is
    one cursor per partition, which any number of workers and any batch size continue (the
    re-deal, ``loader.resume``), so neither has to match."""
    return is_stream_record(sd.get(K_DATASET) if isinstance(sd, dict) else None, dataset)


def _check_header(sd: Any, config: dict[str, Any], elastic: bool = False) -> None:
    """What the state is, its version, and the configuration it was taken with (``elastic``:
    a Stream's state, whose worker count and batch size may differ)."""
    if not isinstance(sd, dict):
        raise CheckpointError(
            f"cannot load DataLoader state: expected a dict, got {type(sd).__name__}. Pass the "
            "object returned by loader.state_dict() (or resumable_loader.load_state(bytes))."
        )
    if not _same(sd.get(K_FORMAT), FORMAT):
        raise _fail(
            K_FORMAT,
            f"expected {FORMAT!r}, got {clip_repr(sd.get(K_FORMAT))}",
            "this is not a resumable_loader DataLoader state (a model or optimizer state?)",
        )
    version = sd.get(K_VERSION)
    if not (_same(version, VERSION) or any(_same(version, v) for v in UPGRADABLE)):
        raise _fail(
            K_VERSION,
            f"this library reads versions {[*UPGRADABLE, VERSION]}, the state is version "
            f"{clip_repr(version)}",
            "load it with the resumable_loader release that wrote it",
        )
    cfg = sd.get(K_CONFIG)
    if not isinstance(cfg, dict):
        raise _fail(K_CONFIG, f"expected a dict, got {type(cfg).__name__}", "the state is damaged")
    for name in _CONFIG_REQUIRED:
        if name not in cfg:
            raise _fail(f"config.{name}", "missing", _ALWAYS_THERE)
    batch = cfg["batch_size"]
    if batch is not None and (type(batch) is not int or batch < 1):
        raise _fail(
            "config.batch_size",
            f"expected None or an int >= 1, got {clip_repr(batch)}",
            "the state is damaged",
        )
    own = cfg.get("batch_sampler")
    if not (own is None or (type(own) is str and len(own) <= 1024 and batch is None)):
        raise _fail(
            "config.batch_sampler",
            f"expected None or a description (a str, only with batch_size None), got "
            f"{clip_repr(own)}",
            "the state is damaged",
        )
    saved_len = cfg["dataset_len"]
    if saved_len is not None and (type(saved_len) is not int or saved_len < 0):
        raise _fail(
            "config.dataset_len",
            f"expected None or an int >= 0, got {clip_repr(saved_len)}",
            "the state is damaged",
        )
    workers = cfg["num_workers"]
    if type(workers) is not int or workers < 0:
        raise _fail(
            "config.num_workers",
            f"expected an int >= 0, got {clip_repr(workers)}",
            "the state is damaged",
        )
    fields = list(MUST_MATCH)
    if config["dataset_kind"] == "iterable" and not elastic:
        fields += ["batch_size", "num_workers"]
    for name in fields:
        theirs = cfg.get(name)
        if _same(theirs, config[name]):
            continue
        if name == "sampler" and _same(
            _resized_sampler(theirs, saved_len, config["dataset_len"]), config[name]
        ):
            continue
        raise _fail(
            f"config.{name}",
            f"the checkpoint has {clip_repr(theirs)}, this loader has {config[name]!r}",
            _FIX[name],
        )


# Config keys every state has had, read on every resume: batch_size says what ``consumed`` counts
# (a state without it would resume at another sample), dataset_len what the data is checked
# against. (batch_sampler is newer than version 4: absent means "not said".)
_CONFIG_REQUIRED = ("batch_size", "dataset_len", "num_workers")

_ALWAYS_THERE = "the state is damaged (a loader state always has it)"


def _resized_sampler(description: Any, saved_len: Any, now_len: Any) -> Any:
    """A saved sampler description as it reads over a dataset resized from ``saved_len`` to
    ``now_len``: a RandomSampler's ``num_samples`` defaults to the dataset's length, so it
    follows the length (whose change is the dataset check's to judge, not the sampler's). One
    given explicitly, equal to the old length by chance, matches unchanged instead."""
    if type(description) is not str or type(saved_len) is not int or type(now_len) is not int:
        return description
    tail = f", num_samples={saved_len})"
    if description.startswith("random(") and description.endswith(tail):
        return f"{description[: -len(tail)]}, num_samples={now_len})"
    return description


def _read_dataset(sd: dict[str, Any]) -> dict[str, Any] | None:
    """The state's record of its data; None in a state written before dataset checks (version
    4 states too: they came within it), whose class and fingerprint are not checked."""
    if K_DATASET not in sd:
        return None
    rec = sd[K_DATASET]
    problem = F.record_problem(rec)
    if problem is not None:
        raise _fail(K_DATASET, problem, "the state is damaged")
    return {F.K_CLASS: rec[F.K_CLASS], F.K_FINGERPRINT: rec[F.K_FINGERPRINT]}


def _read_sampler(sd: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """A stateful user sampler's part: its state, what was drawn, what is outstanding (the
    ``ResumePoint`` fields)."""
    if K_SAMPLER_STATE not in sd:
        # Without it the sampler would start its epoch afresh, re-sending what was consumed.
        raise _fail(K_SAMPLER_STATE, "missing", _ALWAYS_THERE)
    drawn = _int(sd, K_DRAWN)
    done = sd.get(K_SAMPLER_DONE, False)
    if type(done) is not bool:
        raise _fail(
            K_SAMPLER_DONE, f"expected a bool, got {clip_repr(done)}", "the state is damaged"
        )
    out = sd.get(K_OUTSTANDING, [])
    if not isinstance(out, list) or not all(
        isinstance(x, list)
        and len(x) == 2
        and type(x[0]) is int
        and 0 <= x[0] < drawn
        and _indices_ok(x[1], sd[K_CONFIG].get("dataset_len"))
        for x in out
    ):
        raise _fail(
            K_OUTSTANDING,
            f"expected [[task id < drawn, indices], ...], got {clip_repr(out)}",
            "the state is damaged",
        )
    outstanding = [(t, idx) for t, idx in out]
    n = config["dataset_len"]
    for t, idx in outstanding:
        if not _indices_ok(idx, n):
            # Only on changed data (the indices fit the checkpoint's length): a resume by
            # position would re-send them to a dataset that no longer has them.
            raise _fail(
                K_OUTSTANDING,
                f"task {t} holds sample indices {clip_repr(idx)}, past the end of the "
                f"dataset, which now has {n} samples",
                "on_dataset_change='continue' keeps the position, and this one does not fit "
                "the new data; resume with the checkpoint's data, or start afresh without "
                "load_state_dict()",
            )
    return {
        "sampler_state": sd[K_SAMPLER_STATE],
        "drawn": drawn,
        "sampler_done": done,
        "outstanding": outstanding,
    }


def _read_workers(sd: dict[str, Any], n: int) -> dict[str, Any]:
    """A stream's part: where each of the ``n`` workers' shards stands, who comes next (the
    ``ResumePoint`` fields).

    Each entry has all its keys: without ``dataset_state`` a shard would restart from its
    beginning, and ``id`` (the entry's place) tells entries moved about from the right ones.
    (``state_at`` may be absent in a version-3 state: taken then after all delivered.)"""
    v4 = _same(sd[K_VERSION], VERSION)
    workers = sd.get(K_WORKERS)
    if not isinstance(workers, list) or len(workers) != n:
        raise _fail(
            K_WORKERS,
            f"expected {n} worker entries, got {clip_repr(workers)}",
            "the state is damaged",
        )
    positions: list[WorkerPosition] = []
    for i, w in enumerate(workers):
        if (
            not isinstance(w, dict)
            or type(w.get("delivered")) is not int
            or w["delivered"] < 0
            or type(w.get("exhausted")) is not bool
        ):
            raise _fail(
                f"{K_WORKERS}[{i}]", f"malformed entry {clip_repr(w)}", "the state is damaged"
            )
        for key in ("id", "dataset_state", "state_at") if v4 else ("dataset_state",):
            if key not in w:
                raise _fail(f"{K_WORKERS}[{i}].{key}", "missing", _ALWAYS_THERE)
        if "id" in w and not _same(w["id"], i):
            raise _fail(
                f"{K_WORKERS}[{i}].id",
                f"expected {i} (entries are in worker order), got {clip_repr(w['id'])}",
                "the state is damaged",
            )
        at = w.get("state_at", w["delivered"] if w["dataset_state"] is not None else 0)
        if type(at) is not int or not 0 <= at <= w["delivered"]:
            raise _fail(
                f"{K_WORKERS}[{i}].state_at",
                f"expected an int in [0, delivered={w['delivered']}], got {clip_repr(at)}",
                "the state is damaged",
            )
        positions.append(WorkerPosition(w["delivered"], w["exhausted"], w["dataset_state"], at))
    next_worker = _int(sd, K_NEXT_WORKER)
    if next_worker >= n:
        raise _fail(
            K_NEXT_WORKER,
            f"{next_worker} is not a worker id below {n}",
            "the state is damaged",
        )
    return {"workers": positions, "next_worker": next_worker}


def _check_stream_consumed(consumed: int, workers: list[WorkerPosition]) -> None:
    """A stream's ``consumed`` counts the batches released to the caller in task order; each
    was a worker's fetch (its ``delivered``) or the end of a shard (a worker left with
    ``exhausted``). While no shard has ended, ``consumed`` is at most their sum. It may be
    below it: with ``in_order=False`` the batches past the first one still loading are
    delivered, and only the workers count them (the state does not say ``in_order``, so
    neither the sum nor ``next_worker`` is checked against torch's turns)."""
    delivered = sum(w.delivered for w in workers)
    if consumed > delivered and not any(w.exhausted for w in workers):
        raise _fail(
            K_CONSUMED,
            f"{consumed} batches consumed, but the workers delivered only {delivered} "
            f"({K_WORKERS}[].delivered={[w.delivered for w in workers][:8]}) and none of "
            "their shards ended",
            "the state is damaged",
        )


def _read_triples(sd: dict[str, Any], key: str, valid: Any, shape: str) -> list[list[Any]]:
    """A list of three-item lists under ``key``, each passing ``valid``. Every state has both
    lists (``skipped_samples`` is absent only in a version-3 state: nothing skipped then);
    without one, the resume would deliver again what was skipped."""
    if key not in sd and (key == K_SKIPPED or _same(sd[K_VERSION], VERSION)):
        raise _fail(key, "missing", _ALWAYS_THERE)
    entries = sd.get(key, [])
    if not isinstance(entries, list) or not all(
        isinstance(x, list) and len(x) == 3 and valid(x) for x in entries
    ):
        raise _fail(key, f"expected {shape}, got {clip_repr(entries)}", "the state is damaged")
    return [list(x) for x in entries]


def _read_skipped(sd: dict[str, Any]) -> list[Any]:
    return _read_triples(
        sd,
        K_SKIPPED,
        lambda x: type(x[0]) is int and type(x[1]) is int,
        "[[epoch, task id, indices], ...]",
    )


def _read_skipped_samples(sd: dict[str, Any]) -> list[list[int]]:
    return _read_triples(
        sd,
        K_SKIPPED_SAMPLES,
        lambda x: all(type(v) is int and v >= 0 for v in x),
        "[[epoch, samples before, count], ...]",
    )
