"""``Stream.mix``: named Streams interleaved by weight inside each partition.

A mixture of Streams is itself a ``Stream`` with ``P`` partitions whose chains start at a mix
node instead of a shard source (``Stream._chain``; the one seam in ``plans/stream.py``).
Partition ``p`` of the mixture, pass ``e``, draws from partition ``p`` of each source, pass
``e``; its ``m``-th item comes from the source that the ``Mixture`` interleave
(``interleave.Segment``: a Bresenham tree over the sources; its phases drawn from the seed and
spread over the partitions, ``_phases``) names for position ``m``. Which item of that source
comes next is the source chain's own position: no arithmetic, no index. So within a
partition, over any window of ``n`` items under one set of weights, a source's count is within
``ceil(log2 S)`` of ``n * weight`` (``S``: sources with a positive weight), and no source item
is drawn twice in a pass.

**Partition counts.** A source with ``P_s`` partitions where ``P_s`` divides ``P`` (``F =
P / P_s``) is read with a stride: mixed partition ``p`` reads source partition ``p mod P_s`` and
keeps every ``F``-th of its items, from offset ``p div P_s``. The ``F`` mixed partitions that
share a source partition take each of its items once between them; each reads all of it (``F``
times the reads, counted in the source's ``src``). Any other count is refused at ``mix()``.

**The position** of a mixed partition (after the reader's head) is
``[m, seg] + for each source: its chain's position (+ ``seen`` for a strided one), took, out``:
``m`` mixed items drawn in the pass, ``seg`` the ``m`` where the current interleave segment
began, ``took`` the items drawn from the source in the pass, ``out`` 1 once the source's
partition ran out in the pass. All zeros at a pass start, as the node contract asks.

**Weights history.** The state's header names the sources (their shard digests, partitions,
pipelines, cursor fields) and the weights history, newest last. The newest weights always
govern; a Stream built with other weights that loads a state appends them and starts a new
segment (``seg = m``) in every partition it loaded, at its own position: the rows before stay,
each source continues at its cursor, and the interleave restarts with the new weights there.

**Exhaustion.** ``on_exhausted="stop"``: the mixed partition's pass ends when one of its
sources runs out (the others' leftovers of that pass are not drawn). ``"renormalize"``: the
source is masked out and a new segment over the others starts at that ``m``. Either way the
source's ``out`` flag and every source's ``took`` stay in the cursor (``exhaustion`` sums them).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ..core.errors import CheckpointError
from . import stream_nodes as N
from .interleave import Segment, check_weights
from .mixture_state import same_ratios
from .streams import META_KEY, PASS, deal_one

__all__ = ["MIX_KEY", "POLICIES", "MixPlan", "MixSource", "exhaustion", "source_record"]

MIX_KEY = "mix"  # the Stream header's key that describes the mixture
MIX_VERSION = 1
POLICIES = ("stop", "renormalize")
# The mix node's own fields, before the sources' (see the module docstring).
OWN_FIELDS = ("m", "seg")
# What each source adds after its chain's position.
SOURCE_TAIL = ("took", "out")


@dataclass(frozen=True)
class MixSource:
    """One named source as the mixture sees it: how to build its chain, what its position
    fields are, and what the state records about it (checked at a resume)."""

    name: str
    partitions: int
    chain: Callable[[int, int], N.Node]  # (partition, pass) -> its chain at the pass start
    fields: tuple[str, ...]  # its chain's position fields
    record: dict[str, Any]  # shards, seed, shuffle_shards, partitions, pipeline, fields
    shard_count: int
    stats: Callable[[], dict[str, int]]  # its reads in this process (``Stream.read_stats``)


def _digest(records: list[dict[str, Any]]) -> str:
    keep = [
        [r["name"], r["partitions"], r["shards"], r["seed"], r["shuffle_shards"]] for r in records
    ]
    text = json.dumps(keep, sort_keys=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def _ratio_key(fracs: tuple[Fraction, ...]) -> tuple[Fraction, ...]:
    total = sum(fracs)
    return tuple(f / total for f in fracs)


class MixPlan:
    """What a mixed Stream holds about its mixture: the sources, ``P``, the exhaustion policy
    and the weights history (newest last). Never changed in place: a load returns a new plan,
    so Streams that share one (``Stream._with`` copies) are not touched."""

    def __init__(
        self,
        sources: list[MixSource],
        partitions: int,
        policy: str,
        history: list[dict[str, int | float]],
    ) -> None:
        self.sources = sources
        self.names = tuple(s.name for s in sources)
        self.partitions = partitions
        self.policy = policy
        self.history = history
        _, self.fracs = check_weights(history[-1], self.names)
        self.records = [s.record for s in sources]
        self.digest = _digest(self.records)
        self.shard_count = sum(s.shard_count for s in sources)
        fields: list[str] = list(OWN_FIELDS)
        self.spans: list[tuple[int, int]] = []  # where each source's chain position sits
        for s in sources:
            start = len(fields)
            fields += [f"{s.name}.{f}" for f in s.fields]
            if self.stride(s) > 1:
                fields.append(f"{s.name}.seen")
            self.spans.append((start, len(fields)))
            fields += [f"{s.name}.{f}" for f in SOURCE_TAIL]
        self.fields = tuple(fields)

    @classmethod
    def build(
        cls,
        sources: list[MixSource],
        weights: Any,
        partitions: int | None,
        policy: Any,
    ) -> MixPlan:
        """A plan checked for use (``sources`` sorted by name).

        Raises:
            ValueError: an unknown policy, weights that do not fit the sources, or partition
                counts that do not fit (naming the fix).
            TypeError: weights that are not a mapping of numbers.
        """
        if policy not in POLICIES:
            raise ValueError(f"on_exhausted must be one of {list(POLICIES)}, got {policy!r}")
        names = tuple(s.name for s in sources)
        plain, _ = check_weights(weights, names)
        counts = {s.name: s.partitions for s in sources}
        total = sum(s.shard_count for s in sources)
        if partitions is None:
            partitions = max(counts.values())
        elif type(partitions) is not int or not 1 <= partitions <= total:
            raise ValueError(
                f"partitions must be an int in 1..{total} (the sources' shards together), "
                f"got {partitions!r}"
            )
        wrong = {n: c for n, c in counts.items() if partitions % c}
        if wrong:
            raise ValueError(
                f"Stream.mix: the mixture has {partitions} partitions, and source(s) "
                f"{wrong} (name: partitions) do not divide it. Mixed partition p reads "
                "partition p mod P_s of a source with P_s partitions, so each P_s must divide "
                f"the mixture's. Build those sources with partitions= a divisor of {partitions} "
                "(equal to it: no source is read twice), or give mix() partitions= a multiple of "
                "every source's."
            )
        return cls(sources, partitions, policy, [plain])

    # ---- what it is ----

    def stride(self, source: MixSource) -> int:
        return self.partitions // source.partitions

    @property
    def name(self) -> str:
        """The stage name in the Stream's ``pipeline``."""
        return f"mix({','.join(self.names)};{self.policy})"

    def header(self) -> dict[str, Any]:
        """The state header's ``mix`` entry (plain data)."""
        return {
            "version": MIX_VERSION,
            "on_exhausted": self.policy,
            "sources": [dict(r) for r in self.records],
            "weights": [dict(w) for w in self.history],
        }

    def root(self, partition: int, epoch: int, seed: int) -> N.Node:
        """Mixed partition ``partition``'s mix node for pass ``epoch``, at the pass start."""
        return _Mix(self, partition, epoch, seed)

    def read_stats(self) -> dict[str, int]:
        """The sources' reads in this process, summed (opens, seeks, samples skipped)."""
        total: dict[str, int] = {}
        for s in self.sources:
            for k, v in s.stats().items():
                total[k] = total.get(k, 0) + v
        return total

    # ---- a resume ----

    def adopt(self, header: Any, cursors: dict[int, list[int]], offset: int) -> MixPlan:
        """This plan after loading a state whose header's ``mix`` entry is ``header`` and whose
        cursors (mix position at ``offset``) are ``cursors``: the state's weights history, and
        this plan's weights appended if they differ, with a new segment at each loaded
        partition's position (``cursors`` are updated in place).

        Raises:
            CheckpointError: the state's mixture has other sources (names, shards, partitions,
                seeds, pipelines), another policy, a malformed history or cursor.
        """
        history = self.check_header(header)
        self._check_cursors(cursors, offset)
        _, fracs = check_weights(history[-1], self.names)
        if same_ratios(fracs, self.fracs):
            return MixPlan(self.sources, self.partitions, self.policy, history)
        # New weights: every loaded partition starts a segment at its own position (a fresh
        # partition, at m = 0, already starts one there).
        for c in cursors.values():
            c[offset + 1] = c[offset]
        return MixPlan(self.sources, self.partitions, self.policy, [*history, self.history[-1]])

    def check_header(self, header: Any) -> list[dict[str, int | float]]:
        """The weights history of a state's ``mix`` entry, checked against this mixture's
        sources and policy (before the header's generic checks, so that a changed source is
        named, not reported as a changed shard list).

        Raises:
            CheckpointError: naming the source and the field that differ.
        """
        if not isinstance(header, dict):
            raise CheckpointError(
                "Stream state: stream.mix is missing or not a dict: the state is not a "
                "mixture's (Stream.mix); load it into the Stream that saved it"
            )
        version = header.get("version")
        if version != MIX_VERSION:
            raise CheckpointError(
                f"Stream state: stream.mix.version {version!r} is not one this version reads "
                f"({MIX_VERSION})"
            )
        saved = header.get("sources")
        if not isinstance(saved, list):
            raise CheckpointError("Stream state: stream.mix.sources must be a list")
        saved_names = [r.get("name") if isinstance(r, dict) else None for r in saved]
        if saved_names != list(self.names):
            raise CheckpointError(
                f"Stream state: stream.mix.sources are {saved_names}, this mixture's are "
                f"{list(self.names)}: a state keeps the sources it was taken with; mix the same "
                "named Streams (the weights may change, the sources may not)"
            )
        for r, mine in zip(saved, self.records):
            for key in ("shards", "partitions", "seed", "shuffle_shards", "fields", MIX_KEY):
                if r.get(key) != mine.get(key):
                    raise CheckpointError(
                        f"Stream state: stream.mix.sources[{mine['name']!r}].{key} is "
                        f"{r.get(key)!r}, this mixture's source has {mine.get(key)!r}: build "
                        f"the source {mine['name']!r} as the checkpoint's was (the same shards, "
                        "partitions, seed and stages; an inner mixture with its weights)"
                    )
        policy = header.get("on_exhausted")
        if policy != self.policy:
            raise CheckpointError(
                f"Stream state: stream.mix.on_exhausted is {policy!r}, this mixture's is "
                f"{self.policy!r}: build the mixture with on_exhausted={policy!r}"
            )
        history = header.get("weights")
        if not isinstance(history, list) or not history:
            raise CheckpointError("Stream state: stream.mix.weights must be a non-empty list")
        plain_history = []
        for i, w in enumerate(history):
            try:
                plain, _ = check_weights(w, self.names)
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"Stream state: stream.mix.weights[{i}]: {e}") from None
            plain_history.append(plain)
        return plain_history

    def _check_source(self, p: int, epoch: int, s: MixSource, pos: list[int]) -> None:
        """A source's position in mixed partition ``p``: a shard source's ``shard_i`` within
        its partition's shards, ``offset`` within the samples read (an inner mixture's
        fields are ints, checked when the outer state is parsed)."""
        if s.fields[:3] != N.SOURCE_FIELDS:
            return
        shard_i, off, src = pos[:3]
        n = _shards_in(s.record, epoch, p % s.partitions)
        if shard_i > n:
            raise CheckpointError(
                f"Stream state: partition {p} field '{s.name}.shard_i' is {shard_i}, but the "
                f"source's partition reads {n} shards in pass {epoch}"
            )
        if off > src:
            raise CheckpointError(
                f"Stream state: partition {p} field '{s.name}.offset' is {off}, more than the "
                f"{src} samples ('{s.name}.src') the source read in its pass"
            )

    def _check_cursors(self, cursors: dict[int, list[int]], offset: int) -> None:
        for p, c in cursors.items():
            m, seg = c[offset], c[offset + 1]
            if seg > m:
                raise CheckpointError(
                    f"Stream state: partition {p} field 'seg' is {seg}, after its 'm' {m}"
                )
            took = 0
            for (start, end), s in zip(self.spans, self.sources):
                self._check_source(p, c[PASS], s, c[offset + start : offset + end])
                took += c[offset + end]
                if c[offset + end + 1] > 1:
                    raise CheckpointError(
                        f"Stream state: partition {p} field '{s.name}.out' must be 0 or 1"
                    )
            if took != m:
                raise CheckpointError(
                    f"Stream state: partition {p}: the sources' 'took' add up to {took}, not "
                    f"to its 'm' {m} (every mixed item comes from one source)"
                )


# Phases spread over the partitions. Partition p's node at depth d gets the phase
# frac(u + p * alpha_d) * total, with u drawn from (seed, pass, segment start, node) and the
# same in every partition: a Kronecker sequence, so the P partitions' phases are spread evenly
# over range(total) whatever P is, and the global stream's counts stay close to the weights
# (Hermite's identity: sum_p floor(x + p/P) = floor(P x)). alpha_0 is the golden ratio's
# conjugate; deeper nodes take frac(sqrt(prime)) for other primes, so a child does not fall
# into step with its parent. Fixed-point integers (64 bits), so every platform computes the
# same phases; these constants decide every mixture's order: changing them is a new version.
_ONE = 1 << 64
_ALPHAS = (
    (math.isqrt(5 << 128) - _ONE) >> 1,  # (sqrt(5) - 1) / 2
    *(math.isqrt(q << 128) % _ONE for q in (2, 3, 7, 11, 13, 17, 19, 23)),
)


def _shards_in(record: dict[str, Any], epoch: int, q: int) -> int:
    """How many shards partition ``q`` of a source (its state ``record``) reads in pass
    ``epoch``."""
    count = record["shards"]["count"]
    return len(
        deal_one(record["seed"], epoch, count, record["partitions"], record["shuffle_shards"], q)
    )


def _phases(seed: int, partition: int, epoch: int, start: int) -> Callable[[int, int, int], int]:
    """The phase chooser of one partition's segment from ``start`` in pass ``epoch``."""

    def phase(node: int, depth: int, total: int) -> int:
        text = json.dumps([seed, "stream-mix", epoch, start, node])
        u = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        alpha = _ALPHAS[depth % len(_ALPHAS)]
        return ((u + partition * alpha) % _ONE) * total >> 64

    return phase


class _Stride(N.Node):
    """Every ``every``-th item of a source partition from ``first`` (a source with fewer
    partitions than the mixture); its position adds ``seen``, the input items pulled."""

    def __init__(self, up: N.Node, every: int, first: int) -> None:
        self.up = up
        self.every = every
        self.first = first
        self.seen = 0
        self.fields = (*up.fields, "seen")

    def pull(self) -> Any:
        while True:
            item = self.up.pull()
            if item is N.END:
                return item
            i = self.seen
            self.seen += 1
            if i % self.every == self.first:
                return item

    def position(self) -> list[int]:
        return [*self.up.position(), self.seen]

    def seek(self, pos: list[int]) -> None:
        self.up.seek(pos[:-1])
        self.seen = pos[-1]

    def close(self) -> None:
        self.up.close()


class _Mix(N.Node):
    """One mixed partition's pass: item ``m`` from the source ``Segment.locate`` names."""

    def __init__(self, plan: MixPlan, partition: int, epoch: int, seed: int) -> None:
        self.plan = plan
        self.fields = plan.fields
        self.seed = seed
        self.partition = partition
        self.epoch = epoch
        ups: list[N.Node] = []
        for s in plan.sources:
            every = plan.stride(s)
            node = s.chain(partition % s.partitions, epoch)
            ups.append(_Stride(node, every, partition // s.partitions) if every > 1 else node)
        self.ups = ups
        n = len(ups)
        self.m = 0
        self.seg = 0
        self.took = [0] * n
        self.out = [0] * n
        self.segment: Segment | None = None

    def _segment(self) -> Segment | None:
        if self.segment is None:
            fracs = tuple(Fraction(0) if o else f for f, o in zip(self.plan.fracs, self.out))
            if not any(fracs):
                return None
            phase = _phases(self.seed, self.partition, self.epoch, self.seg)
            self.segment = Segment(self.seg, {}, fracs, (0,) * len(fracs), self.seed, phase)
        return self.segment

    def pull(self) -> Any:
        stop = self.plan.policy == "stop"
        while True:
            if stop and any(self.out):
                return N.END
            seg = self._segment()
            if seg is None:
                return N.END  # every source with a positive weight ran out
            k, _ = seg.locate(self.m - self.seg)
            item = self.ups[k].pull()
            if item is N.END:
                self.out[k] = 1
                # renormalize: the others go on from here, in a segment without it
                self.seg = self.m
                self.segment = None
                continue
            self.m += 1
            self.took[k] += 1
            return item

    def position(self) -> list[int]:
        pos = [self.m, self.seg]
        for k, up in enumerate(self.ups):
            pos += up.position()
            pos += [self.took[k], self.out[k]]
        return pos

    def seek(self, pos: list[int]) -> None:
        self.m, self.seg = pos[0], pos[1]
        for k, (start, end) in enumerate(self.plan.spans):
            self.ups[k].seek(list(pos[start:end]))
            self.took[k], self.out[k] = pos[end], pos[end + 1]
        self.segment = None

    def close(self) -> None:
        for up in self.ups:
            up.close()


def exhaustion(state: Mapping[Any, Any]) -> dict[str, dict[str, int]]:
    """What a mixed Stream's state (``Stream.state_dict()``, or a loader worker's
    ``dataset_state``) says about its sources in each partition's current pass: per source,
    ``took`` (items drawn) and ``ran_out`` (partitions where it ran out); and under
    ``on_exhausted="stop"``, ``stopped``: the partitions whose pass it ended.

    Raises:
        ValueError: not a mixed Stream's state.
    """
    header = state.get(META_KEY) if isinstance(state, Mapping) else None
    mix = header.get(MIX_KEY) if isinstance(header, dict) else None
    if not isinstance(header, dict) or not isinstance(mix, dict):
        raise ValueError("exhaustion() needs a mixed Stream's state (Stream.mix(...).state_dict())")
    fields = header["fields"]
    policy = mix["on_exhausted"]
    out: dict[str, dict[str, int]] = {}
    for r in mix["sources"]:
        name = r["name"]
        took_i = fields.index(f"{name}.took")
        out_i = fields.index(f"{name}.out")
        took = ran_out = 0
        for key, c in state.items():
            if key == META_KEY:
                continue
            took += c[took_i]
            ran_out += c[out_i]
        row = {"took": took, "ran_out": ran_out}
        if policy == "stop":
            row["stopped"] = ran_out  # under "stop" a source that ran out ended the pass
        out[name] = row
    return out


def source_record(meta: dict[str, Any], mix: MixPlan | None) -> dict[str, Any]:
    """What a mixture's state records about one source, from the source's own header
    (``StreamMeta.to_state``): the keys a resume checks, and its pipeline for ``inspect``. A
    source that is itself a mixture adds its ``mix`` entry: its weights are fixed by the outer
    state (a change would need a segment in cursors the outer mixture owns)."""
    keys = ("partitions", "seed", "shuffle_shards", "shards", "pipeline", "fields")
    record = {k: meta[k] for k in keys}
    if mix is not None:
        record[MIX_KEY] = mix.header()
    return record
