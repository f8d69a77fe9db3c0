"""torchft: our ``DataLoader`` inside a replica-group training loop, every sample of an epoch
in exactly one committed step (issue #34).

``ReplicaGroupLoader(loader, manager)`` wraps a plain loader for a torchft ``Manager``. The
job's data position is one committed prefix ``[0, c)`` of the epoch's order, the same on
every replica group; ``plans.replica_deal`` cuts each step's global batch over the step's
participants, and ``c`` moves only when this group's ``should_commit()`` says True.

How the loader learns the step's participants before it hands out the batch: ``next()``
opens the step's quorum itself (``manager.start_quorum()``), waits for it, and only then
deals. Two methods of the manager *instance* are wrapped so that torchft's own loop works
unchanged: ``start_quorum`` absorbs a second call in the same step (the one
``OptimizerWrapper.zero_grad()`` makes after the loop took its batch), and ``should_commit``
records the step's outcome. docs/torchft.md says why this and not the alternatives.

torchft itself is never imported: the manager is duck-typed (its version is read from the
installed package's metadata), so this module imports without torchft installed and the
state machine is tested against a fake manager.
"""

from __future__ import annotations

import copy
import os
import re
import threading
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..core.errors import CheckpointError
from ..loader.dataloader import DataLoader, own_rank_state, resumes_at_next_iter
from ..plans.mixture import Mixture
from ..plans.replica_deal import share_window, step_take
from ..state.cursor import Cut
from ..state.replica import cut_state, position_of, state_at

__all__ = ["ReplicaGroupLoader", "StepInfo"]

_FORMAT = "resumable_loader.torchft"
_VERSION = 1
_RANDOM = re.compile(r"random\(replacement=(True|False), num_samples=(\d+)\)")
# Methods of torchft's Manager this module calls; a manager without them is not one.
_MANAGER_API = (
    "start_quorum",
    "should_commit",
    "num_participants",
    "participating_rank",
    "current_step",
    "errored",
    "is_participating",
    "register_state_dict_fn",
)


@dataclass(frozen=True)
class StepInfo:
    """What the last ``next()`` dealt.

    Attributes:
        step: the manager's step (``current_step()``) the batch belongs to.
        participants: ``num_participants()`` of the step's quorum.
        rank: ``participating_rank()`` (None: a spare or a healing replica).
        share: this process's share index (``rank * group_world_size + group_rank``), or None.
        shares: how many shares the step was cut into.
        start: the committed position the step was dealt from.
        take: how many positions the step takes (they are committed if it commits).
        real: the batch is this process's share of the step; False for a stand-in batch
            (errored step, spare, or an empty share at the epoch's very end), whose samples
            are not this process's to train.
    """

    step: int
    participants: int
    rank: int | None
    share: int | None
    shares: int
    start: int
    take: int
    real: bool


@dataclass
class _Window:
    """The speculative deal in flight: the inner loader iterating this share of the next
    steps, valid while the steps commit with the same shares."""

    it: Iterator[Any]
    epoch: tuple[int, int]  # (epoch, its seed)
    shares: int
    share: int
    next_c: int
    left: int


class ReplicaGroupLoader:
    """A ``DataLoader`` for one process of a torchft replica group.

    Iterate it as the loader itself, inside torchft's loop (``next()``, then
    ``optimizer.zero_grad()``, forward, backward, ``optimizer.step()``). Each ``next()``
    settles the previous step, opens the step's quorum, and returns this process's share of
    the step's global batch: ``participants x group_world_size`` shares of ``batch_size``
    samples each, cut from the job's committed position. A step that does not commit is dealt
    again at the next ``next()``, for whoever participates then. The loader's state is
    registered with the manager under ``key``, so a healing group takes its position from a
    live peer and deals exactly the step the others deal.

    ``iter()`` continues the job's current epoch (it starts the next one only when the current
    one is fully committed); ``StopIteration`` comes at the same committed step on every group.

    Args:
        loader: a map-style ``DataLoader`` under its built-in order (``shuffle=True/False``,
            a ``Mixture`` under either), ``batch_size`` set, ``drop_last=False``,
            ``in_order=True``, ``on_poison="raise"``. Workers, ``pin_memory`` and
            ``seed_per_sample`` work as in a plain job. Its position is taken as its next
            ``iter()`` would begin: a state given to its ``load_state_dict()`` continues; a
            loader already iterated (a batch peeked) begins its next epoch.
        manager: a torchft ``Manager`` built with ``use_async_quorum=False``.
        key: the name the state is registered under (``register_state_dict_fn``).
        group_rank: this process's rank in its replica group; default: the manager's, else
            the ``RANK`` environment variable (as torchft reads it).
        group_world_size: the replica group's size; default: the manager's, else
            ``WORLD_SIZE``.
        window_steps: how many steps ahead one deal reaches (the prefetch window's reach;
            it is dealt again at every surprise).

    Raises:
        ValueError: the loader or the manager is one this integration refuses (the message
            says why and what to do).
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        manager: Any,
        *,
        key: str = "resumable_loader",
        group_rank: int | None = None,
        group_world_size: int | None = None,
        window_steps: int = 1024,
    ) -> None:
        self.loader = loader
        self._manager = manager
        self._key = key
        self._window_steps = int(window_steps)
        if self._window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, not {window_steps}")
        _check_manager(manager, key)
        self._per_share, self._epoch_len = _check_loader(loader)
        self._group_rank, self._group_world = _group_of(manager, group_rank, group_world_size)
        self._lock = threading.Lock()
        start = own_rank_state(loader)
        if not resumes_at_next_iter(loader) and start.get("seed") is not None:
            # The loader was iterated before it was wrapped (a batch peeked): as for a plain
            # loader, its next iter() is a new epoch, whole; the peeked one is left.
            start = state_at(start, self._epoch_len)
        self._committed = self._normalized(start)
        self._open = False
        self._dealt = False
        self._pending: tuple[int, int] | None = None  # (step, take)
        self._outcome: tuple[int, bool] | None = None  # (step, should_commit's answer)
        self._window: _Window | None = None
        self._iter_epoch = int(self._committed["epoch"])
        if self._position(self._committed) >= self._epoch_len:
            self._next_epoch()
            self._iter_epoch = int(self._committed["epoch"])
        self._last: StepInfo | None = None
        self._warned_open = False
        self._step_due: int | None = None  # a loaded state's step, checked at first use
        self._orig_start = manager.start_quorum
        self._orig_commit = manager.should_commit
        # What the manager holds of this object goes through a weak reference: the manager
        # must not keep a dropped loader (and its worker pool) alive as cyclic garbage, whose
        # pool shutdown would then run wherever a collection happens to run -- in another
        # loader's forked worker, say.
        self._hooks = _hooks(weakref.ref(self), key, self._orig_start, self._orig_commit)
        manager.start_quorum, manager.should_commit = self._hooks[0], self._hooks[1]
        manager.register_state_dict_fn(key, self._hooks[2], self._hooks[3])

    # ---- the manager's wrapped methods ----

    def _start_quorum(self, *args: Any, **kwargs: Any) -> None:
        # One quorum per step: a second one could change (n, r) after the deal, or clear the
        # error a failed heal set.
        if self._open:
            return
        self._open = True
        self._dealt = False
        try:
            self._orig_start(*args, **kwargs)
        except BaseException:
            self._open = False
            raise

    def _should_commit(self, *args: Any, **kwargs: Any) -> bool:
        step = int(self._manager.current_step())
        try:
            ok = bool(self._orig_commit(*args, **kwargs))
        except BaseException:
            with self._lock:
                self._outcome = (step, False)
                self._open = False
            raise
        with self._lock:
            self._outcome = (step, ok)
            self._open = False
        return ok

    # ---- the state torchft transfers ----

    def _settled(self) -> dict[str, Any]:
        """The committed state with the last step's outcome applied (under the lock)."""
        state = self._committed
        if self._pending is not None and self._outcome is not None:
            step, take = self._pending
            if self._outcome == (step, True):
                state = self._advanced(state, take)
        return state

    def _settle(self) -> None:
        with self._lock:
            self._committed = self._settled()
            self._pending = None
            self._outcome = None

    def _state_for_peer(self) -> dict[str, Any]:
        # Runs in the peer's quorum thread: reads only what the lock guards, never the inner
        # loader (its iterator and workers belong to the main thread).
        with self._lock:
            state = copy.deepcopy(self._settled())
        return self._tagged(state, int(self._manager.current_step()))

    def _load_from_peer(self, state: dict[str, Any]) -> None:
        # Main thread, inside start_quorum: only records; the deal that follows uses it.
        plain = self._check_tagged(state, int(self._manager.current_step()))
        self._check_built_alike(state)
        self._use(plain)

    def _check_built_alike(self, state: dict[str, Any]) -> None:
        """A heal takes a peer's position as it is: refuse a peer whose loader draws other
        samples or other values there (another ``Mixture`` weighting, ``seed_per_sample``),
        which the plain resume would otherwise take in silently."""
        theirs = state["torchft"].get("seed_per_sample")
        mine = bool(self.loader.seed_per_sample)
        if theirs != mine:
            raise CheckpointError(
                f"the peer's state was taken with seed_per_sample={theirs!r}, this loader has "
                f"seed_per_sample={mine!r}: every replica group must be built alike (a "
                "sample's values would depend on the group that trains it)"
            )
        mix = self.loader.dataset
        plan = state.get("data_plan")
        if isinstance(mix, Mixture) and isinstance(plan, dict) and plan.get("weights"):
            newest = plan["weights"][-1].get("weights")
            if newest != mix.weights:
                raise CheckpointError(
                    f"the peer's Mixture has weights {newest}, this loader's has "
                    f"{mix.weights}: every replica group must be built alike. To change "
                    "the weights, stop the whole job and restart every group with the new "
                    "ones from a checkpoint (ReplicaGroupLoader.load_state_dict)"
                )

    def _use(self, plain: dict[str, Any]) -> None:
        self._step_due = None
        with self._lock:
            self._committed = plain
            self._pending = None
            self._outcome = None
            self._window = None
            self._iter_epoch = int(plain["epoch"])

    def state_dict(self) -> dict[str, Any]:
        """The job's committed data position: a plain loader state (``sample_cut`` at the
        committed sample) plus a ``torchft`` record. The same on every group at the same step;
        save it with the manager's and the model's state for a whole-job restart. Without its
        ``torchft`` record it loads into a plain ``DataLoader``, which continues at the same
        sample."""
        with self._lock:
            state = copy.deepcopy(self._settled())
        return self._tagged(state, int(self._manager.current_step()))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()`` (a whole-job restart). The manager's state, from the
        same checkpoint, may be loaded before or after this one (``dcp.load`` loads its
        ``Stateful`` entries in key order): the step recorded here is checked against the
        manager's at the next ``iter()`` or ``next()``.

        Raises:
            CheckpointError: the state is not this integration's, or was taken on other data
                or with another batch size or group size; at the next ``iter()``/``next()``:
                it was taken at another step than the manager's.
        """
        plain = self._check_tagged(state, None)
        # Through the loader's own resume, at the committed position: what it changes there
        # (a Mixture built with new weights records them from that position on) is then in
        # the state every share is cut from, not applied from each share's own place.
        self.loader.load_state_dict(plain)
        self._use(self._normalized(own_rank_state(self.loader)))
        self._step_due = int(state["torchft"]["step"])

    def _check_step_due(self) -> None:
        """A loaded state's step against the manager's, once both are loaded."""
        due, self._step_due = self._step_due, None
        if due is None:
            return
        step = int(self._manager.current_step())
        if due != step:
            self._step_due = due  # still wrong at the next try
            raise CheckpointError(
                f"the loader's state was taken at manager step {due} but the manager is at "
                f"step {step}: load the manager's state (manager.load_state_dict) from the "
                "same checkpoint before iterating"
            )

    def _tagged(self, plain: dict[str, Any], step: int) -> dict[str, Any]:
        out = dict(plain)
        out["torchft"] = {
            "format": _FORMAT,
            "version": _VERSION,
            "step": step,
            "group_world_size": self._group_world,
            "epoch_len": self._epoch_len,
            "batch_size": self._per_share,
            "seed_per_sample": bool(self.loader.seed_per_sample),
        }
        return out

    def _check_tagged(self, state: dict[str, Any], step: int | None) -> dict[str, Any]:
        """The plain state of a tagged one, refusing another build (and, with ``step``
        given, another manager step)."""
        if not isinstance(state, dict) or not isinstance(state.get("torchft"), dict):
            raise CheckpointError(
                "not a ReplicaGroupLoader state: it has no 'torchft' record (a plain loader's "
                "state loads with DataLoader.load_state_dict before the loader is wrapped)"
            )
        tag = state["torchft"]
        if tag.get("format") != _FORMAT or tag.get("version") != _VERSION:
            raise CheckpointError(
                f"torchft record of format {tag.get('format')!r} version {tag.get('version')!r}"
                f"; this version reads {_FORMAT!r} version {_VERSION}"
            )
        for name, mine in (
            ("group_world_size", self._group_world),
            ("epoch_len", self._epoch_len),
            ("batch_size", self._per_share),
        ):
            if tag.get(name) != mine:
                raise CheckpointError(
                    f"the state was taken with {name}={tag.get(name)!r}, this loader has "
                    f"{name}={mine!r}: every replica group must be built alike"
                )
        if step is not None and tag.get("step") != step:
            raise CheckpointError(
                f"the state was taken at manager step {tag.get('step')!r} but the manager is "
                f"at step {step}: load the manager's state (manager.load_state_dict) first, "
                "from the same checkpoint"
            )
        plain = {k: v for k, v in state.items() if k != "torchft"}
        return self._normalized(plain)

    # ---- the committed position ----

    def _normalized(self, state: dict[str, Any]) -> dict[str, Any]:
        """A loader state as (epoch, its seed drawn, committed prefix), refusing others."""
        pos = position_of(state, self._per_share)
        if pos is None:
            raise ValueError(
                "the loader's state has batches delivered ahead or holes in its epoch: wrap "
                "the loader before iterating it (or load a state saved in order)"
            )
        if state.get("seed") is None:
            return self._with_seed(state)
        return state_at(state, min(pos, self._epoch_len))

    def _with_seed(self, state: dict[str, Any]) -> dict[str, Any]:
        # An epoch not begun has no seed yet; the loader draws it from the saved seed chain at
        # iter(), so every group that holds this state draws the same one.
        self.loader.load_state_dict({k: v for k, v in state.items() if k != "sample_cut"})
        iter(self.loader)
        drawn = own_rank_state(self.loader)
        pos = position_of(drawn, self._per_share)
        assert pos is not None and drawn.get("seed") is not None
        return state_at(drawn, pos)

    def _advanced(self, state: dict[str, Any], take: int) -> dict[str, Any]:
        return state_at(state, self._position(state) + take)

    def _position(self, state: dict[str, Any]) -> int:
        pos = position_of(state, self._per_share)
        assert pos is not None
        return pos

    def _next_epoch(self) -> None:
        """The committed epoch is used up: begin the next one the loader's own way."""
        self.loader.load_state_dict(self._committed)
        for _ in self.loader:
            raise AssertionError("an epoch committed to its end still had batches")
        with self._lock:
            self._committed = self._normalized(own_rank_state(self.loader))
            self._window = None

    # ---- iteration ----

    @property
    def epoch(self) -> int:
        """The epoch of the committed position."""
        with self._lock:
            return int(self._settled()["epoch"])

    @property
    def last_step(self) -> StepInfo | None:
        """What the last ``next()`` dealt (None before the first)."""
        return self._last

    def __iter__(self) -> ReplicaGroupLoader:
        self._check_step_due()
        self._settle()
        if self._position(self._committed) >= self._epoch_len:
            self._next_epoch()
        self._iter_epoch = int(self._committed["epoch"])
        return self

    def __len__(self) -> int:
        """Steps left in the committed epoch if every step from now commits with the last
        step's participants. Before the first step the participants are not known yet (the
        quorum comes with the first ``next()``): it counts this group alone, an upper bound
        that shrinks once other groups join."""
        shares = self._last.shares if self._last is not None else self._group_world
        left = self._epoch_len - self._position(self._settled())
        return -(-left // (shares * self._per_share))

    def __next__(self) -> Any:
        self._check_step_due()
        self._settle()
        if self._open and self._dealt:
            # A step without should_commit (optimizer.step() skipped): not committed here; if
            # the other groups committed it, torchft heals this one at the next quorum.
            if not self._warned_open:
                warnings.warn(
                    "ReplicaGroupLoader: next() before the previous step's should_commit(); "
                    "that step counts as not committed by this group",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._warned_open = True
            self._open = False
        if not self._open:
            if (
                int(self._committed["epoch"]) > self._iter_epoch
                or self._position(self._committed) >= self._epoch_len
            ):
                raise StopIteration
            self._start_quorum()
        m = self._manager
        n = int(m.num_participants())
        rank = m.participating_rank()
        step = int(m.current_step())
        # A heal inside start_quorum may have replaced the position, even into a later epoch.
        if self._position(self._committed) >= self._epoch_len:
            self._next_epoch()
            self._iter_epoch = int(self._committed["epoch"])
        c = self._position(self._committed)
        shares = max(n, 1) * self._group_world
        share = None if rank is None else int(rank) * self._group_world + self._group_rank
        take = step_take(c, self._epoch_len, shares, self._per_share)
        real = share is not None and m.errored() is None and bool(m.is_participating())
        batch = None
        if real:
            assert share is not None
            batch = self._deal(c, shares, share)
            if batch is None:  # an empty share: fewer samples left than shares
                real = False
                _sit_out(m)
        if batch is None:
            batch = self._stand_in(c)
        with self._lock:
            self._pending = (step, take)
        self._dealt = True
        self._last = StepInfo(step, n, rank, share, shares, c, take, real)
        return batch

    def _deal(self, c: int, shares: int, share: int) -> Any:
        epoch = (int(self._committed["epoch"]), int(self._committed["seed"]))
        w = self._window
        if (
            w is not None
            and w.left > 0
            and (w.epoch, w.shares, w.share, w.next_c) == (epoch, shares, share, c)
        ):
            w.left -= 1
            w.next_c = c + step_take(c, self._epoch_len, shares, self._per_share)
            return _first(w.it)
        # A surprise (abort, heal, membership change, new epoch) or the window's end.
        self._window = None
        cut, steps = share_window(
            c, self._epoch_len, shares, share, self._per_share, self._window_steps
        )
        if cut is None:
            return None
        it = self._iterate(cut)
        w = _Window(it, epoch, shares, share, c, steps)
        self._window = w
        w.left -= 1
        w.next_c = c + step_take(c, self._epoch_len, shares, self._per_share)
        return _first(w.it)

    def _stand_in(self, c: int) -> Any:
        """A batch for a step this process does not train (its gradient is zeroed or the
        step aborts): the step's first samples, so shapes and dtypes are real ones."""
        self._window = None
        end = min(c + self._per_share, self._epoch_len)
        holes = ((end, self._epoch_len - end),) if end < self._epoch_len else ()
        return _first(self._iterate(Cut(c, holes)))

    def _iterate(self, cut: Cut) -> Iterator[Any]:
        self.loader.load_state_dict(cut_state(self._committed, cut))
        return iter(self.loader)

    def close(self) -> None:
        """Give the manager its own ``start_quorum`` and ``should_commit`` back and take the
        state off its registry, so a new ``ReplicaGroupLoader`` can wrap the same manager.
        The inner loader is not closed."""
        m = self._manager
        start, commit, load, save = self._hooks
        if m.__dict__.get("start_quorum") is start:
            del m.start_quorum
        if m.__dict__.get("should_commit") is commit:
            del m.should_commit
        # torchft 0.2.0 has no unregister: its two registries are private dicts.
        for name, fn in (("_load_state_dict_fns", load), ("_user_state_dicts", save)):
            registry = getattr(m, name, None)
            if isinstance(registry, dict) and registry.get(self._key) is fn:
                del registry[self._key]


def _hooks(
    ref: weakref.ref[ReplicaGroupLoader], key: str, start: Any, commit: Any
) -> tuple[Any, Any, Any, Any]:
    """The four functions the manager is given (``start_quorum``, ``should_commit``, and the
    state's load and save), holding the loader only weakly. A loader dropped without
    ``close()`` leaves the manager's own methods behind them, and a state that is gone."""

    def gone() -> RuntimeError:
        return RuntimeError(
            f"the ReplicaGroupLoader registered under key={key!r} was dropped without "
            "close(); close() it before dropping it"
        )

    def start_quorum(*args: Any, **kwargs: Any) -> Any:
        me = ref()
        return start(*args, **kwargs) if me is None else me._start_quorum(*args, **kwargs)

    def should_commit(*args: Any, **kwargs: Any) -> Any:
        me = ref()
        return commit(*args, **kwargs) if me is None else me._should_commit(*args, **kwargs)

    def load(state: dict[str, Any]) -> None:
        me = ref()
        if me is None:
            raise gone()
        me._load_from_peer(state)

    def save() -> dict[str, Any]:
        me = ref()
        if me is None:
            raise gone()
        return me._state_for_peer()

    return start_quorum, should_commit, load, save


def _first(it: Iterator[Any]) -> Any:
    # A window's iterator ends only where the deal said it would: an early end is a bug, and
    # must not leak out of next() as the epoch's end.
    try:
        return next(it)
    except StopIteration:
        raise RuntimeError("ReplicaGroupLoader: the dealt window ended early") from None


# ---- checks ----


def _check_manager(manager: Any, key: str) -> None:
    missing = [name for name in _MANAGER_API if not callable(getattr(manager, name, None))]
    if missing:
        raise ValueError(
            f"ReplicaGroupLoader needs a torchft Manager; {type(manager).__name__} has no "
            f"{', '.join(missing)}"
        )
    if getattr(manager, "_use_async_quorum", False):
        raise ValueError(
            "ReplicaGroupLoader needs a synchronous quorum: pass use_async_quorum=False to "
            "torchft's Manager. With the async quorum a replica healing at step 0 is dealt a "
            "share its gradient never trains (torchft zeroes it), and those samples would be "
            "lost; the loader waits for the quorum before dealing anyway, so async gains "
            "nothing here"
        )
    _check_torchft_version(manager)
    if "start_quorum" in getattr(manager, "__dict__", {}):
        raise ValueError(
            "this manager's start_quorum is already wrapped (a ReplicaGroupLoader already "
            "uses it): one ReplicaGroupLoader per manager; close() the old one first"
        )
    # torchft's register_state_dict_fn fails on a taken key with a bare assert: say it here.
    for name in ("_load_state_dict_fns", "_user_state_dicts"):
        registry = getattr(manager, name, None)
        if isinstance(registry, dict) and key in registry:
            raise ValueError(
                f"this manager already has a state registered under key={key!r}: close() "
                "the ReplicaGroupLoader that registered it, or pass another key="
            )


# The torchft versions whose Manager internals (the quorum in start_quorum, the private
# attributes read here) this module was checked against.
_TESTED = ((0, 2), (0, 3))


def _check_torchft_version(manager: Any) -> None:
    """Warn when a real torchft Manager comes from a version outside the tested range (read
    from the installed distribution's metadata: torchft itself is not imported)."""
    if not type(manager).__module__.startswith("torchft"):
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torchft")
    except PackageNotFoundError:
        return
    nums = tuple(int(x) for x in re.findall(r"\d+", found)[:2])
    if not _TESTED[0] <= nums < _TESTED[1]:
        warnings.warn(
            f"ReplicaGroupLoader was checked against torchft >=0.2,<0.3, not {found}: it wraps "
            "Manager.start_quorum and should_commit and reads a few private attributes",
            RuntimeWarning,
            stacklevel=3,
        )


def _check_loader(loader: Any) -> tuple[int, int]:
    """(batch size, epoch length) of a loader the integration can deal, or ValueError."""
    if not isinstance(loader, DataLoader):
        raise ValueError(
            f"ReplicaGroupLoader wraps a resumable_loader.DataLoader, not {type(loader).__name__}"
        )
    config = own_rank_state(loader)["config"]
    if config.get("dataset_kind") != "map":
        raise ValueError(
            "ReplicaGroupLoader does not deal streams (IterableDataset): a Stream's rows "
            "cannot be cut per committed step across live groups yet; use a map-style dataset"
        )
    if not getattr(loader, "in_order", True):
        raise ValueError(
            "ReplicaGroupLoader needs in_order=True: each step's batch must be that step's "
            "own share, and with in_order=False a slow batch is overtaken by a later step's "
            "(samples trained twice and missed); build the loader with in_order=True"
        )
    if getattr(loader, "on_poison", "raise") != "raise":
        raise ValueError(
            "ReplicaGroupLoader needs on_poison='raise': a skipped batch would shift every "
            "later step onto the next step's share, and the skip cannot be agreed with the "
            "other replica groups; build the loader with on_poison='raise' (the default)"
        )
    if config.get("batch_sampler") is not None:
        raise ValueError(
            "ReplicaGroupLoader cuts each step's batch itself: a batch_sampler cannot be "
            "dealt over the step's participants; use batch_size (and shuffle) instead"
        )
    if config.get("batch_size") is None:
        raise ValueError("ReplicaGroupLoader needs batch_size (the per-process batch)")
    if config.get("drop_last"):
        raise ValueError(
            "ReplicaGroupLoader needs drop_last=False: the epoch's last step is spread over "
            "the participants, and dropping it would leave its samples out"
        )
    sampler = str(config.get("sampler"))
    if sampler == "sequential":
        n = int(config["dataset_len"])
    elif (found := _RANDOM.fullmatch(sampler)) is not None:
        n = int(found.group(2))
    elif sampler.startswith("distributed("):
        raise ValueError(
            "ReplicaGroupLoader shards by replica group itself: drop the DistributedSampler "
            "(torchft's or torch's) and pass shuffle=True or False"
        )
    else:
        raise ValueError(
            f"ReplicaGroupLoader deals the loader's built-in order only (shuffle=True/False, "
            f"a Mixture under either); this loader's sampler is {sampler}"
        )
    if n < 1:
        raise ValueError("ReplicaGroupLoader needs a non-empty epoch")
    return int(config["batch_size"]), n


def _group_of(manager: Any, rank: int | None, world: int | None) -> tuple[int, int]:
    # torchft keeps them private; it reads RANK / WORLD_SIZE itself when not given them.
    if rank is None:
        rank = getattr(manager, "_group_rank", None)
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if world is None:
        world = getattr(manager, "_group_world_size", None)
    if world is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, world = int(rank), int(world)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"group rank {rank} is outside a group of {world}")
    return rank, world


def _sit_out(manager: Any) -> None:
    """Make torchft zero this process's gradient for the step (an empty share at the epoch's
    very end): it does so for a replica without a participating rank. A private attribute of
    torchft's Manager; without it the stand-in batch would be trained (a repeat)."""
    if hasattr(manager, "_participating_replica_rank"):
        manager._participating_replica_rank = None
    else:
        warnings.warn(
            "ReplicaGroupLoader: an empty share at the epoch's end, and this manager cannot "
            "be told to sit the step out: its stand-in batch would be trained twice",
            RuntimeWarning,
            stacklevel=3,
        )
