"""Data plans: a weighted mixture of named map-style sources, as a pure function of the position.

A ``Mixture`` maps a *global position* ``g`` (``epoch * num_samples + position in the epoch``)
to one (source, index) pair with arithmetic alone. No iterator, no per-epoch array: any sampler
may visit the positions in any order, on any number of workers or ranks, and a resume is only
a position. The arithmetic -- the stratified interleave by weight, a seeded permutation per
pass of each source, the weights history and its rests -- is ``plans/interleave.py``; this
module owns the dataset around it:

* ``Mixture``: construction and its checks, indexing (``__getitem__``, ``source_of``),
  weights changes (``set_weights``), the state (``state_dict``, ``load_state_dict``);
* the loader's side: the epoch a loader's workers serve (``follow_epoch``, ``hold_epoch``) and
  loading a saved plan in two halves (``plan_changes``, ``plan_load``, ``apply_plan_load``;
  the plan's format and its validation are ``plans/mixture_state.py``).

The state (``state_dict``) is the weights history's segments, the rests, the seed and the
sources' names, lengths and fingerprints: O(number of changes + number of sources), never
O(samples).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import operator
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from ..state import fingerprint as F
from .interleave import (
    Rest,
    Segment,
    build_plan,
    check_weights,
    pass_keys,
    permute,
    places_in_order,
    rest_draw,
    segment_after,
)
from .mixture_state import (
    STATE_KIND,
    STATE_VERSION,
    PlanLoad,
    RestAt,
    Sources,
    check_int,
    parse_plan,
    same_ratios,
)
from .mixture_state import plan_load as _plan
from .stream import Stream

__all__ = ["Mixture"]

# Round keys of recently used (source, pass) pairs. A loader touches one or two passes of each
# source at a time; the bound only keeps a long, many-source run from growing the dict.
_KEY_CACHE_SIZE = 4096


def follow_epoch(dataset: Any, epoch: int, plan: Any = None) -> None:
    """Tell a ``Mixture`` which epoch its positions are in, and (``plan``: a ``state_dict()``)
    the plan the main process holds for it. The loader calls it at ``iter()``, and each worker
    at the epoch's start with the plan its ``Epoch`` message carries: a worker's copy of the
    mixture is as old as the worker, the main process's plan is the one its state saves. Any
    other dataset is left alone. A ``Stream`` is told the epoch (its pass) the same way."""
    if isinstance(dataset, Mixture):
        if plan is not None:
            dataset._adopt(plan)
        dataset.set_epoch(epoch)
    elif isinstance(dataset, Stream):
        dataset.set_epoch(epoch)


def hold_epoch(dataset: Any, epoch: int) -> None:
    """The loader's workers serve epoch ``epoch`` of ``dataset`` from the plan as it is now:
    from here on, ``set_weights`` refuses positions before the next epoch (see ``Mixture``)."""
    if isinstance(dataset, Mixture):
        dataset._floor = max(dataset._floor, (epoch + 1) * dataset._num_samples)


def _check_sources(sources: object) -> tuple[tuple[str, ...], tuple[Any, ...], tuple[int, ...]]:
    """A ``Mixture``'s sources, checked: their names (sorted), datasets and lengths.

    Raises:
        TypeError: a name that is not a string, or a source without ``__len__``.
        ValueError: no sources, or an empty one.
    """
    if not isinstance(sources, Mapping) or not sources:
        raise ValueError("sources must be a non-empty mapping from name to dataset")
    for name in sources:
        if not isinstance(name, str):
            raise TypeError(f"source names must be strings, not {name!r}")
    names = tuple(sorted(sources))
    datasets = tuple(sources[n] for n in names)
    lengths = []
    for n, ds in zip(names, datasets):
        try:
            length = len(ds)
        except TypeError:
            raise TypeError(
                f"source {n!r} ({type(ds).__name__}) has no len(): a Mixture draws from "
                "map-style datasets"
            ) from None
        if length < 1:
            raise ValueError(f"source {n!r} is empty")
        lengths.append(length)
    return names, datasets, tuple(lengths)


class Mixture(Dataset[Any]):
    """A map-style dataset that mixes named map-style sources by weight, deterministically.

    Position ``p`` of epoch ``e`` is the global position ``g = e * num_samples + p``; ``g``
    alone (with the seed and the weights history) decides which source and which of its items
    it is. The interleave is stratified: over any window of ``n`` consecutive positions (under
    one set of weights) each source's count is within ``ceil(log2(#sources))`` of
    ``n * weight / sum(weights)``. Within a source, items are drawn in passes, each a fresh
    seeded permutation, so nothing repeats before the whole source was seen and a small
    source is cycled (upsampled). Nothing is drawn from a global RNG.

    Any sampler over ``range(len(mixture))`` works: shuffled or not, ``DistributedSampler``,
    any number of workers. The order of the loader's sampler is the order of consumption; the
    stratification holds for consecutive positions, so ``shuffle=False`` keeps it in the
    batches (the sources are shuffled within themselves already).

    The epoch: ``resumable_loader.DataLoader`` sets it, and sends the epoch and the plan to its
    workers with each epoch. Under torch's loader, ``set_epoch(e)`` before each epoch (as with
    ``DistributedSampler``), or index with global positions directly: an index ``i`` means
    global position ``epoch * num_samples + i``, and may run past the end of the epoch into
    the next ones. torch's workers hold a copy of the dataset made when they start: with
    ``persistent_workers=True`` a ``set_epoch`` or ``set_weights`` in the main process does
    not reach them.

    Args:
        sources: name -> map-style dataset (``__len__`` and ``__getitem__``), at least one.
            The names are sorted; the order of the mapping does not matter.
        weights: name -> weight (int or float, >= 0, at least one positive), one per source.
            Only ratios matter. A float is read as the decimal it prints as (0.1 is 1/10).
        seed: the plan's seed (0 <= seed < 2**64): the interleave's phases and every pass's
            permutation derive from it.
        num_samples: positions per epoch; default the sum of the sources' lengths.

    Raises:
        TypeError: a source without ``__len__``, a name that is not a string, a weight that is
            not a number, or a ``fingerprint()`` that does not return a string.
        ValueError: no sources, an empty source, weights that do not name exactly the sources,
            a negative, infinite or NaN weight, all weights 0, a bad seed or ``num_samples``,
            or a ``fingerprint()`` longer than 1024 characters.
        RuntimeError: a source's ``fingerprint()`` raised (chained).
    """

    def __init__(
        self,
        sources: Mapping[str, Any],
        weights: Mapping[str, float],
        *,
        seed: int = 0,
        num_samples: int | None = None,
    ) -> None:
        self._names, self._sources, self._lengths = _check_sources(sources)
        self._fingerprints = tuple(
            F.fingerprint_of(ds, f"source {n!r}") for n, ds in zip(self._names, self._sources)
        )
        self._seed = check_int("seed", seed, 0, 1 << 64)
        if num_samples is None:
            num_samples = sum(self._lengths)
        self._num_samples = check_int("num_samples", num_samples, 1, None)
        self._epoch = 0
        plain, fracs = check_weights(weights, self._names)
        self._segments = [Segment(0, plain, fracs, (0,) * len(self._names), self._seed)]
        self._starts = [0]
        self._keys: dict[tuple[int, int], tuple[int, ...]] = {}
        # epoch -> its rests, by start (see ``Rest``); empty in a plan never changed mid-epoch.
        self._rests: dict[int, list[Rest]] = {}
        # The place of each position in the order of the epoch whose rests were last used:
        # (epoch, array). Built on first use in that epoch, O(len) memory; never pickled.
        self._inverse: tuple[int, np.ndarray] | None = None
        # The first global position set_weights may change: a loader with workers serves an
        # epoch from the plan as it was at iter() (see ``hold_epoch``).
        self._floor = 0
        # The last plan a worker adopted from its Epoch message (``_adopt``).
        self._adopted: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # Caches are rebuilt where they are used: a spawned worker gets the plan, not an array
        # of len(mixture) entries.
        state = dict(self.__dict__)
        state["_inverse"] = None
        state["_keys"] = {}
        return state

    # ---- the plan ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._num_samples

    def __getitem__(self, index: int) -> Any:
        k, item = self._locate(self._global(index))
        return self._sources[k][item]

    def __iter__(self) -> Iterator[Any]:
        # Without it, Python's fallback iteration would call __getitem__ until an IndexError,
        # which never comes: positions run on into the next epochs.
        for i in range(self._num_samples):
            yield self[i]

    def source_of(self, index: int) -> tuple[str, int]:
        """Which source, and which of its items, ``mixture[index]`` is (for logging).

        Args:
            index: a position, as for ``mixture[index]``.

        Returns:
            ``(source name, index within the source)``.

        Raises:
            IndexError: ``index < -len(mixture)``.
        """
        k, item = self._locate(self._global(index))
        return self._names[k], item

    def counts_before(self, position: int) -> dict[str, int]:
        """How many samples of each source the global positions ``[0, position)`` draw.

        ``count // len(source)`` is the number of full passes over that source.

        Args:
            position: a global position (``epoch * len(mixture) + position in the epoch``).

        Returns:
            source name -> count.
        """
        position = check_int("position", position, 0, None)
        seg = self._segments[bisect.bisect_right(self._starts, position) - 1]
        return dict(zip(self._names, seg.totals(position - seg.start)))

    def set_epoch(self, epoch: int) -> None:
        """Make ``mixture[i]`` mean position ``i`` of epoch ``epoch``.

        Args:
            epoch: the epoch, >= 0.
        """
        self._epoch = check_int("epoch", epoch, 0, None)

    @property
    def epoch(self) -> int:
        """The epoch that ``mixture[i]`` indexes into (see ``set_epoch``)."""
        return self._epoch

    @property
    def seed(self) -> int:
        """The plan's seed."""
        return self._seed

    @property
    def names(self) -> tuple[str, ...]:
        """The sources' names, sorted."""
        return self._names

    @property
    def sources(self) -> dict[str, Any]:
        """name -> source dataset."""
        return dict(zip(self._names, self._sources))

    @property
    def weights(self) -> dict[str, int | float]:
        """The weights of the last segment of the plan (the newest ones)."""
        return dict(self._segments[-1].weights)

    @property
    def history(self) -> list[tuple[int, dict[str, int | float]]]:
        """The plan's segments: ``(first global position, weights)``, in order; the first
        starts at 0."""
        return [(s.start, dict(s.weights)) for s in self._segments]

    def set_weights(self, weights: Mapping[str, float], from_position: int) -> None:
        """Use ``weights`` from global position ``from_position`` on.

        Each source's passes continue where the positions before ``from_position`` left
        them, so no item of a source's current pass is drawn twice. The positions before
        ``from_position`` keep their samples: make it at least the global position of every
        sample already consumed. A loader whose sampler shuffles the positions of an epoch has
        consumed a scattered set of them mid-epoch: then give the start of the next epoch
        (``(epoch + 1) * len(mixture)``), or change the weights at a resume (the loader's
        ``load_state_dict`` gives them to the rest of the shuffled epoch).

        A ``resumable_loader.DataLoader`` with workers serves an epoch from the plan as it was
        at ``iter()`` (each worker gets it with the epoch): once it began epoch ``e``, a change
        before ``(e + 1) * len(mixture)`` would not reach the workers, and is refused.

        Args:
            weights: name -> weight, one per source (as in the constructor).
            from_position: the first global position drawn under ``weights``; not before the
                start of the newest segment (``history[-1][0]``), whose weights it replaces
                when equal to it.

        Raises:
            ValueError: bad weights, ``from_position`` before the newest segment's start, or
                inside an epoch a loader's workers already serve.
        """
        from_position = check_int("from_position", from_position, 0, None)
        plain, fracs = check_weights(weights, self._names)
        last = self._segments[-1]
        if from_position < self._floor:
            raise ValueError(
                f"weights cannot apply from global position {from_position}: a DataLoader's "
                f"workers serve the epoch up to position {self._floor} from the plan they got "
                "at iter(), and the loader's state saves that plan. Give a position >= "
                f"{self._floor} (the next epoch), or change the weights at a resume: build the "
                "Mixture with them and call loader.load_state_dict(state)."
            )
        if from_position < last.start:
            raise ValueError(
                f"weights cannot apply from global position {from_position}: the plan already "
                f"has weights {last.weights} from position {last.start} on, and positions "
                "drawn under them keep their samples. Give a position >= "
                f"{last.start} (the next unconsumed one)."
            )
        if same_ratios(fracs, check_weights(last.weights, self._names)[1]):
            return
        segments = self._segments[:-1] if from_position == last.start else self._segments
        self._segments = [
            *segments,
            segment_after(segments, from_position, plain, fracs, self._seed),
        ]
        self._starts = [s.start for s in self._segments]

    def fingerprint(self) -> str:
        """A digest of the data: each source's name, length and ``fingerprint()`` (if it has
        one). Not of the weights or the seed, which a resume may change or carry."""
        parts = list(zip(self._names, self._lengths, self._fingerprints))
        return "mixture:" + hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The plan as plain data: seed, epoch, ``num_samples``, the weights history and each
        source's name, length and fingerprint. Its size does not grow with the samples drawn.

        Returns:
            a dict of None/bool/int/float/str/list/dict (json, msgpack and
            ``torch.load(weights_only=True)`` safe).
        """
        state = {
            "kind": STATE_KIND,
            "version": 1,
            "seed": self._seed,
            "num_samples": self._num_samples,
            "epoch": self._epoch,
            "sources": [
                {"name": n, "length": length, "fingerprint": fp}
                for n, length, fp in zip(self._names, self._lengths, self._fingerprints)
            ],
            "weights": [{"from": s.start, "weights": dict(s.weights)} for s in self._segments],
        }
        if self._rests:
            state["version"] = STATE_VERSION
            state["rests"] = [
                r.to_state(self._num_samples) for e in sorted(self._rests) for r in self._rests[e]
            ]
        return state

    def load_state_dict(
        self,
        state: Mapping[str, Any],
        *,
        resume_at: int | None = None,
        on_dataset_change: str = "raise",
    ) -> None:
        """Continue the plan saved in ``state``: its seed, epoch and weights history.

        The sources must be the checkpoint's: the same names, lengths and fingerprints, and the
        same ``num_samples`` -- or, with ``on_dataset_change="continue"``, the same names: the
        plan then goes on over the changed sources (positions keep their sources; a changed
        source's passes draw from its new items) with one ``RuntimeWarning`` naming what
        changed. If this mixture was built with other weights than the checkpoint's newest,
        they apply from global position ``resume_at`` on (see ``set_weights``); without
        ``resume_at`` the checkpoint's weights are kept, with a ``UserWarning``. On any error
        the mixture is left exactly as it was.

        Args:
            state: a ``state_dict()``.
            resume_at: the global position of the first sample not yet consumed.
            on_dataset_change: ``"raise"`` (default) or ``"continue"``, as above.

        Raises:
            CheckpointError: a malformed state, another version, sources added or removed
                (whatever ``on_dataset_change`` says: the weights name the sources), sources
                changed or another ``num_samples`` (the message names the source and both
                values), or a ``resume_at`` before the checkpoint's newest segment.
            ValueError: ``on_dataset_change`` is neither ``"raise"`` nor ``"continue"``.
        """
        policy = F.check_policy(on_dataset_change)
        changes, _ = self._load(state, resume_at, policy == F.CONTINUE, check_num_samples=True)
        if changes:
            F.warn_changed(changes, "Mixture", stacklevel=2)

    def _load(
        self,
        state: Any,
        resume: int | RestAt | str | None,
        changes_ok: bool,
        *,
        check_num_samples: bool,
    ) -> tuple[list[str], bool]:
        """``load_state_dict``'s work: ``mixture_state.plan_load``, its warning, ``apply_load``.
        Returns what changed in the data and whether new weights were applied."""
        load = _plan(
            state,
            self.record,
            self.weights,
            resume,
            changes_ok,
            check_num_samples=check_num_samples,
        )
        if load.kept is not None:
            warnings.warn(load.kept, UserWarning, stacklevel=2)
        self.apply_load(load)
        return list(load.changes), load.applied

    @property
    def record(self) -> Sources:
        """The sources as a saved plan is checked against them (``mixture_state.Sources``)."""
        return Sources(self._names, self._lengths, self._fingerprints, self._num_samples)

    def apply_load(self, load: PlanLoad) -> None:
        """Install a plan load built for this mixture (``plan_load``): the loader's second half
        of a resume. Assignments only: it cannot fail, so a load that was not refused while
        planning completes."""
        self._seed, self._epoch = load.seed, load.epoch
        self._commit(load.segments, load.rests)
        self._floor = 0  # a loaded plan is the loader's to hold again at its next iter()

    def _commit(self, built: list[Segment], rests: dict[int, list[Rest]]) -> None:
        self._segments = built
        self._starts = [s.start for s in built]
        self._rests = rests
        self._keys = {}
        self._inverse = None

    def _adopt(self, plan: Any) -> None:
        """Serve ``plan`` (the main process's ``state_dict()``, sent with an epoch) from now
        on: its seed, weights history and rests; the epoch comes with the message."""
        if plan == self._adopted:
            return
        seed, _, segments, _, rests = parse_plan(plan, self.record, check_num_samples=False)
        specs = [(start, *check_weights(w, self._names)) for start, w in segments]
        rest_specs = [(e, order, at, *check_weights(w, self._names)) for e, order, at, w in rests]
        built, built_rests = build_plan(specs, rest_specs, seed, self._num_samples)
        self._seed = seed
        self._commit(built, built_rests)
        self._adopted = plan

    # ---- internals ---------------------------------------------------------------------------
    def _global(self, index: int) -> int:
        i = operator.index(index)
        if i < 0:
            if i < -self._num_samples:
                raise IndexError(
                    f"index {i} is out of range for a Mixture of {self._num_samples} samples"
                )
            i += self._num_samples
        return self._epoch * self._num_samples + i

    def _locate(self, g: int) -> tuple[int, int]:
        """(source, item) of global position ``g``."""
        # The segment lookup is written out here, not an interleave helper: one call less on
        # every sample's path (one segment, the common case, skips the bisect too).
        found = self._in_rest(g) if self._rests else None
        if found is not None:
            k, drawn = found
        else:
            segments = self._segments
            if len(segments) == 1:
                seg = segments[0]
            else:
                seg = segments[bisect.bisect_right(self._starts, g) - 1]
            k, m = seg.locate(g - seg.start)
            drawn = seg.base[k] + m
        length = self._lengths[k]
        npass, offset = divmod(drawn, length)
        keys = self._keys.get((k, npass))
        if keys is None:
            if len(self._keys) >= _KEY_CACHE_SIZE:
                self._keys.clear()
            keys = self._keys[(k, npass)] = pass_keys(self._seed, self._names[k], npass)
        return k, permute(offset, length, keys)

    def _in_rest(self, g: int) -> tuple[int, int] | None:
        """(source, its sample count) of ``g`` if it falls in a rest (``Rest``), else None."""
        epoch, p = divmod(g, self._num_samples)
        group = self._rests.get(epoch)
        if group is None:
            return None
        if self._inverse is None or self._inverse[0] != epoch:
            self._inverse = (epoch, places_in_order(group[0].order, self._num_samples))
        return rest_draw(group, int(self._inverse[1][p]))

    def __repr__(self) -> str:
        sources = ", ".join(f"{n}({length})" for n, length in zip(self._names, self._lengths))
        return (
            f"Mixture([{sources}], weights={self.weights}, seed={self._seed}, "
            f"num_samples={self._num_samples})"
        )


def plan_changes(dataset: Mixture, plan: Any) -> list[str]:
    """How ``dataset``'s sources differ from those of a saved ``plan`` (the loader's check;
    ``num_samples`` is left out: to the loader it is the dataset's length, checked as such).

    Raises:
        CheckpointError: a malformed plan, or sources added or removed.
    """
    return parse_plan(plan, dataset.record, check_num_samples=False)[3]


def plan_load(
    dataset: Mixture, plan: Any, *, resume: int | RestAt | str, changes_ok: bool
) -> PlanLoad:
    """The pure half of ``dataset.load_state_dict(plan, ...)`` for the loader, which checked
    the data already (``plan_changes``) and warns of changes itself, once: validates ``plan``
    and builds what ``apply_plan_load`` installs, changing nothing. New weights the mixture
    was built with apply from ``resume``: a global position, a place in a shuffled epoch's
    order, or -- a str saying why -- nowhere (refused).

    Raises:
        CheckpointError: what the load refuses (the mixture is untouched).
    """
    return _plan(plan, dataset.record, dataset.weights, resume, changes_ok, check_num_samples=False)


def apply_plan_load(dataset: Mixture, load: PlanLoad) -> None:
    """Install a ``plan_load`` result in the mixture it was planned for; cannot fail."""
    dataset.apply_load(load)
