"""``Stream``: an iterable dataset read from shards, whose position is one cursor per partition.

The shards are dealt to ``P`` partitions (``plans/streams.py`` owns that arithmetic). Each
partition is a deterministic sequence of rows: its shards in a seeded order per pass, each read
with ``read(shard, start)``, then the ``map``/``filter`` stages. A reader -- one rank x worker,
or the main process -- owns whole partitions and draws their rows in the canonical order: the
next row comes from the live partition with the smallest ``(pass, rows drawn, partition)``. So
a reader's output depends only on its partitions' cursors, never on how it got there, and a
resume needs the cursors alone: no sample is kept in the state and nothing is replayed.

This module is runtime code (it runs in the workers, as ``Mixture.__getitem__`` does): the
``Stream`` class, its stages, the partition source and the reader.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..core.errors import CheckpointError
from . import stream_mix as M
from . import stream_nodes as N
from . import stream_pack as K
from . import streams as S
from .stream_shuffle import ShuffleStage, check_buffer_size

__all__ = ["Stream"]


def _takes_start(read: Callable[..., Any]) -> bool:
    """Whether ``read`` accepts a second positional argument (the start sample): a reader
    that does not can only be skipped into by reading."""
    try:
        sig = inspect.signature(read)
    except (TypeError, ValueError):
        return True  # a builtin or C callable we cannot inspect: trust it with two arguments
    positional = 0
    for param in sig.parameters.values():
        if param.kind == param.VAR_POSITIONAL:
            return True
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            positional += 1
    return positional >= 2


def _no_read(shard: Any, start: int) -> Iterator[Any]:
    """A mixture's own reader: it has no shards (its sources read theirs)."""
    return iter(())


def _world() -> tuple[int, int]:
    """(world size, rank) as torch's DistributedSampler takes them."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class Stream(IterableDataset):
    """An iterable dataset over shards, with an exact resume from a state of O(partitions) ints.

    Build it with :meth:`Stream.from_shards`, then chain :meth:`map` and :meth:`filter`. The
    shards are dealt to ``partitions`` partitions (fixed at the first run and kept in the state);
    each reader (rank x worker; ranks from ``torch.distributed`` when it is initialized) reads
    whole partitions, and interleaves their rows in a canonical order that does not depend on
    the layout. ``state_dict()`` is one short list of ints per partition; ``load_state_dict``
    continues every partition at its cursor, seeking with ``read(shard, start)``.

    Under ``resumable_loader.DataLoader`` the state rides with every batch and the loader's
    ``state_dict()`` resumes exactly on the same layout (ranks, ``num_workers``, batch size).
    Under torch's own ``DataLoader`` it is a correct ``IterableDataset`` (each worker reads its
    own partitions); call ``set_epoch(e)`` before each epoch there, as with ``Mixture``.
    See docs/streams.md for what is promised at this stage and what is refused.
    """

    _shards: list[Any]
    _read: Callable[..., Any]
    _seekable: bool
    _seed: int
    _shuffle: bool
    _explicit: int | None
    _partitions: int
    _digest: str
    _stages: tuple[N.Stage, ...]
    # The chain's root: None reads ``_shards`` (``from_shards``); a mixture's plan
    # (``Stream.mix``) starts each chain at a mix node over the sources' chains instead.
    _mix: M.MixPlan | None
    _shard_count: int

    def __init__(self) -> None:
        raise TypeError("build a Stream with Stream.from_shards(shards, read, ...)")

    # ---- construction ----

    @classmethod
    def from_shards(
        cls,
        shards: Sequence[Any],
        read: Callable[..., Any],
        *,
        seed: int = 0,
        shuffle_shards: bool = True,
        partitions: int | None = None,
    ) -> Stream:
        """A Stream over ``shards``, each read by ``read(shard, start)``.

        Args:
            shards: the shard keys (paths, URLs, anything picklable), in a fixed order.
            read: ``read(shard, start)`` yields the shard's samples from sample ``start`` on
                (a resume seeks). A reader taking only ``read(shard)`` is allowed: a resume
                then reads and discards ``start`` samples (counted in ``read_stats()``, and
                warned about once).
            seed: the Stream's own seed: the shard order of each pass comes from it alone,
                never from the loader's seed.
            shuffle_shards: put the shards in a seeded order per pass (else the given order).
            partitions: how many partitions the shards are dealt to; None: the largest
                ``2**a`` or ``3 * 2**a`` with at least 8 shards each. Fixed by a state.

        Raises:
            ValueError: no shards, or ``partitions`` out of ``1..len(shards)``.
            TypeError: ``read`` is not callable, or ``seed`` is not an int.
        """
        shards = list(shards)
        if not shards:
            raise ValueError("Stream.from_shards needs at least one shard")
        if not callable(read):
            raise TypeError(f"read must be callable, got {read!r}")
        if type(seed) is not int:
            raise TypeError(f"seed must be an int, got {seed!r}")
        self = cls.__new__(cls)
        self._shards = shards
        self._read = read
        self._seekable = _takes_start(read)
        self._seed = seed
        self._shuffle = bool(shuffle_shards)
        self._explicit = partitions
        self._partitions = S.check_partitions(partitions, len(shards))
        self._digest = S.shard_digest(shards)
        self._stages = ()
        self._mix = None
        self._shard_count = len(shards)
        self._reset_runtime()
        return self

    @classmethod
    def mix(
        cls,
        streams: dict[str, Stream],
        weights: dict[str, int | float],
        *,
        seed: int = 0,
        on_exhausted: str = "stop",
        partitions: int | None = None,
    ) -> Stream:
        """Named Streams interleaved by weight, inside each partition (``plans/stream_mix.py``).

        Partition ``p`` of the mixture draws from partition ``p`` of each source (a source with
        ``P_s`` partitions, ``P_s`` dividing the mixture's, is read with a stride: see
        docs/streams.md, "Mixing streams"); item ``m`` comes from the source the ``Mixture``
        interleave names, so over any window of ``n`` items of a partition each source's count
        is within ``ceil(log2(sources))`` of ``n * weight``. ``.map``/``.filter`` and later
        stages apply after the mix. A Stream built with other weights that loads this one's
        state continues every partition at its position with the new weights.

        Args:
            streams: the sources by name (built with ``from_shards``, with their own stages,
                or mixtures themselves).
            weights: a weight per source name (ratios; 0 draws nothing from it).
            seed: the interleave's seed (its phases); the sources keep their own.
            on_exhausted: ``"stop"``: a partition's pass ends when one of its sources runs
                out; ``"renormalize"``: that source is left out and the others go on.
            partitions: the mixture's partition count; None: the largest source's. Every
                source's partition count must divide it.

        Raises:
            TypeError: ``streams`` is not a dict of Streams, or ``seed`` is not an int.
            ValueError: weights that do not name the sources, an unknown ``on_exhausted``,
                or partition counts that do not fit (the error names the fix).
        """
        if not isinstance(streams, dict) or not streams:
            raise TypeError("Stream.mix needs a non-empty dict of named Streams")
        for name, s in streams.items():
            if not isinstance(name, str) or not name or not isinstance(s, Stream):
                raise TypeError(
                    f"Stream.mix: {name!r}: the sources must be Streams under non-empty str "
                    f"names, got {type(s).__name__}"
                )
            if "." in name:
                # Cursor fields are named "<source>.<field>": "a.b" would collide with the
                # fields of source "b" of a mixture named "a".
                raise ValueError(f"Stream.mix: source name {name!r} may not contain '.'")
        seen: dict[int, str] = {}
        for name, s in streams.items():
            if id(s) in seen:
                raise ValueError(
                    f"Stream.mix: sources {seen[id(s)]!r} and {name!r} are the same Stream "
                    "object: every item would come twice. To weight a source up, give it a "
                    "larger weight"
                )
            seen[id(s)] = name
        if type(seed) is not int:
            raise TypeError(f"seed must be an int, got {seed!r}")
        head = len(S.HEAD_FIELDS)
        sources = []
        for name, given in sorted(streams.items()):
            # A copy: a later load_state_dict on the caller's Stream (its seed, partitions)
            # must not change a mixture that recorded them.
            s = type(given).__new__(type(given))
            s.__dict__.update(given.__dict__)
            s._reset_runtime()
            sources.append(
                M.MixSource(
                    name,
                    s._partitions,
                    s._chain,
                    s.cursor_fields()[head:],
                    {"name": name, **M.source_record(s._meta().to_state({}), s._mix)},
                    s._shard_count,
                    s.read_stats,
                )
            )
        plan = M.MixPlan.build(sources, weights, partitions, on_exhausted)
        self = cls.__new__(cls)
        self._shards = []
        self._read = _no_read  # never called: the sources read their own shards
        self._seekable = True
        self._seed = seed
        self._shuffle = False
        self._explicit = partitions
        self._partitions = plan.partitions
        self._digest = plan.digest
        self._stages = ()
        self._mix = plan
        self._shard_count = plan.shard_count
        self._reset_runtime()
        return self

    def _reset_runtime(self) -> None:
        self._epoch = 0
        self._loaded: dict[int, list[int]] | None = None
        self._layout: dict[str, int] = {}
        self._reader: _Reader | None = None
        self._stats = {"opens": 0, "seeks": 0, "skipped": 0}
        self._warned = False
        # The loader's record of the rows the ranks' agreement left at an epoch's end (the
        # state's stream.tail): kept while this reader continues the cursors it came with.
        self._tail: dict[str, Any] | None = None

    def _with(self, stage: N.Stage) -> Stream:
        """A new Stream with ``stage`` appended (each stage module's builder method calls it)."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._stages = (*self._stages, stage)
        new._reset_runtime()
        return new

    def map(self, fn: Callable[[Any], Any]) -> Stream:
        """A new Stream whose samples are ``fn(sample)`` (deterministic per sample)."""
        if not callable(fn):
            raise TypeError(f"map() needs a callable, got {fn!r}")
        return self._with(N.MapStage(fn))

    def random_map(self, fn: Callable[[Any, np.random.Generator], Any]) -> Stream:
        """A new Stream whose samples are ``fn(sample, rng)``: for random augmentations.

        ``rng`` is a ``numpy.random.Generator`` of the sample's own, seeded from the Stream's
        seed, the pass, the partition and the sample's position in it -- never from the
        loader's seed, the rank, the worker or the batch size. So a resume, on any layout,
        draws for each sample exactly what the uninterrupted run drew, and the process's
        global RNGs (the trainer's, with ``num_workers=0``) are left alone. Draw only from
        ``rng``: ``torch.rand`` or ``random.random`` inside ``fn`` are not reproduced.
        Costs about 7 us per sample (the generator's seeding).
        """
        if not callable(fn):
            raise TypeError(f"random_map() needs a callable, got {fn!r}")
        return self._with(N.RandomMapStage(fn))

    def filter(self, fn: Callable[[Any], bool]) -> Stream:
        """A new Stream keeping the samples for which ``fn(sample)`` is true. Its position
        counts input samples, so a resume never reads a dropped sample again."""
        if not callable(fn):
            raise TypeError(f"filter() needs a callable, got {fn!r}")
        return self._with(N.FilterStage(fn))

    def shuffle(self, buffer_size: int) -> Stream:
        """A new Stream whose partitions are each shuffled in windows of ``buffer_size``.

        Each partition's input is cut into windows of ``buffer_size`` consecutive items, and
        each window comes out in a permutation keyed by (seed, pass, partition, window): no RNG
        state and no samples in the state, whose cursor gains ``win`` and ``taken``. A resume
        re-reads at most ``buffer_size`` input items per partition (plus those a filter before
        the shuffle drops among them). Each reader holds up to ``buffer_size`` items per
        partition it owns. See docs/streams.md, "Shuffle".

        Raises:
            TypeError: ``buffer_size`` is not an int.
            ValueError: ``buffer_size`` is below 1.
        """
        return self._with(ShuffleStage(check_buffer_size(buffer_size)))

    def pack(
        self,
        seq_len: int,
        *,
        key: str | None = "input_ids",
        mode: str = "concat",
        window: int = 1024,
        pad_id: int = 0,
        long: str = "split",
        tail: str = "pad",
    ) -> Stream:
        """A new Stream of rows of exactly ``seq_len`` tokens packed from each partition's
        documents (``item[key]``, a 1-D int sequence; other fields are not kept).

        Each row is a dict of int64 arrays of shape ``[seq_len]``: ``input_ids`` (padded with
        ``pad_id``), ``position_ids`` (0, 1, ... from each segment's start: a document, or the
        part of one in this row), ``segment_ids`` (1, 2, ... per segment, 0 on padding) and
        ``labels`` (the tokens, with -100 at each segment's first token and on padding), so
        torch's default collate stacks them; ``pack_collate`` flattens a batch for varlen
        attention. Every token of every document is in exactly one row, or in a counted drop;
        the cursor counts ``tokens_in == tokens_out + dropped + carry_left``.

        Args:
            seq_len: the tokens per row.
            key: the item's token field; None: the item is the token sequence.
            mode: ``"concat"``: documents one after the other, cut at ``seq_len`` (the rest of
                a split document starts the next row; padding only at a pass's end).
                ``"best_fit"``: best-fit-decreasing over windows of ``window`` documents (a
                document is split only when longer than ``seq_len``).
            window: best_fit's documents per window (a resume re-reads up to that many).
            pad_id: the padding token.
            long: best_fit's documents longer than ``seq_len``: ``"split"`` into pieces of
                ``seq_len`` tokens, or ``"drop"`` (counted in ``dropped``).
            tail: concat's last partial row of a partition's pass: ``"pad"`` it (counted in
                ``pad``) or ``"drop"`` it (counted in ``dropped``).

        Raises:
            ValueError, TypeError: an argument that cannot work, named with its fix.
        """
        K.check_pack_args(seq_len, key, mode, window, pad_id, long, tail)
        return self._with(K.PackStage(seq_len, key, mode, window, pad_id, long, tail))

    # ---- what it is ----

    @property
    def partitions(self) -> int:
        """The number of partitions (fixed at the first run; a loaded state sets it)."""
        return self._partitions

    def check_readers(self, num_workers: int) -> None:
        """Refuse a loader whose readers (ranks x ``max(num_workers, 1)``) do not divide the
        partitions. Our DataLoader calls it at ``iter()`` in the main process, so that the
        error is raised there before any worker starts.

        Raises:
            ValueError: naming the valid reader counts (``plans.streams.check_layout``).
        """
        world, _ = _world()
        S.check_layout(self._partitions, world, num_workers)

    def pipeline(self) -> list[str]:
        """The stages, by name: ``["read", "map:tokenize", "filter:<lambda>"]``."""
        root = "read" if self._mix is None else self._mix.name
        return [root] + [stage.name for stage in self._stages]

    def cursor_fields(self) -> tuple[str, ...]:
        """The names of a partition cursor's ints: the reader's head, then the chain's
        position (the source's, then each stage's own)."""
        fields = N.SOURCE_FIELDS if self._mix is None else self._mix.fields
        for stage in self._stages:
            fields = stage.fields(fields)
        return (*S.HEAD_FIELDS, *fields)

    def _chain(self, partition: int, epoch: int) -> N.Node:
        """Partition ``partition``'s chain for pass ``epoch``, at the pass's start."""
        if self._mix is not None:
            return self._build_stages(
                self._mix.root(partition, epoch, self._seed), partition, epoch
            )
        keys = [
            self._shards[i]
            for i in S.deal_one(
                self._seed, epoch, len(self._shards), self._partitions, self._shuffle, partition
            )
        ]
        return self._build_stages(N.Source(keys, self._open), partition, epoch)

    def _build_stages(self, node: N.Node, partition: int, epoch: int) -> N.Node:
        ctx = N.Context(self._seed, epoch, partition)
        for stage in self._stages:
            node = stage.build(node, ctx)
        return node

    def fingerprint(self) -> str:
        """The shard list's digest: a loader state records it and refuses another list."""
        return f"stream:{self._digest}"

    def read_stats(self) -> dict[str, int]:
        """This process's reads so far: shards opened, opens that seeked (``start > 0``), and
        samples read only to be skipped (a reader without ``start``); a mixture's sources'
        reads, summed."""
        if self._mix is not None:
            return self._mix.read_stats()
        return dict(self._stats)

    def set_epoch(self, epoch: int) -> None:
        """The pass the next ``iter()`` reads (a new shard order each pass). Our DataLoader
        sets it at each epoch; under torch's loader call it before each epoch."""
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._epoch = epoch

    # ---- the state ----

    def _meta(self) -> S.StreamMeta:
        return S.StreamMeta(
            self._seed,
            self._partitions,
            self._shuffle,
            self._epoch,
            self._shard_count,
            self._digest,
            tuple(self.pipeline()),
            self.cursor_fields(),
        )

    def _header(self) -> dict[str, Any]:
        """The state's ``"stream"`` entry: the plan, and a mixture's sources and weights."""
        head = self._meta().to_state(self._layout)
        if self._mix is not None:
            head[M.MIX_KEY] = self._mix.header()
        if self._tail is not None:
            head["tail"] = dict(self._tail)
        return head

    def state_dict(self) -> dict[Any, Any]:
        """The position: ``{"stream": plan, p: cursor, ...}`` for the partitions this reader
        holds (all of them with ``num_workers=0`` on one rank). Plain ints, no samples."""
        if self._loaded is not None:  # loaded for the next iter(): that is the position now
            return self._state_of(self._loaded)
        return self._state_of(self._reader.cursors if self._reader is not None else {})

    def _state_of(self, cursors: dict[int, list[int]]) -> dict[Any, Any]:
        out: dict[Any, Any] = {S.META_KEY: self._header()}
        for p in sorted(cursors):
            out[p] = list(cursors[p])
        return out

    def state_dict_changes(self) -> dict[Any, Any] | None:
        """The keys of ``state_dict()`` that changed since the last call, or None: take the
        whole ``state_dict()`` (no reader yet, or a reader that began or was restored since).

        Our loader's workers call it after each batch: only the partitions the batch moved
        are copied and compared, so the per-batch cost does not grow with the partitions a
        worker owns. The ``"stream"`` header is always included.
        """
        if self._loaded is not None or self._reader is None:
            return None
        return self._changes_of(self._reader)

    def _changes_of(self, reader: _Reader) -> dict[Any, Any] | None:
        if reader.full:
            reader.full = False
            reader.dirty.clear()
            return None
        out: dict[Any, Any] = {S.META_KEY: self._header()}
        cursors = reader.cursors
        for p in reader.dirty:
            out[p] = list(cursors[p])
        reader.dirty.clear()
        return out

    def _parse(self, state: Any) -> tuple[S.StreamMeta, dict[int, list[int]], Any]:
        """``state`` checked against this Stream: its plan, its cursors (new lists), and the
        mixture plan it implies (this Stream's, with new weights appended). Changes nothing."""
        header = state.get(S.META_KEY) if isinstance(state, dict) else None
        if self._mix is not None and isinstance(header, dict):
            self._mix.check_header(header.get(M.MIX_KEY))  # names a changed source first
        meta, cursors = S.parse_state(
            state,
            shard_count=self._shard_count,
            digest=self._digest,
            partitions=self._explicit,
            fields=self.cursor_fields(),
            shard_fields=self._mix is None,
            pipeline=tuple(self.pipeline()),
        )
        mix = self._mix
        if mix is not None:
            # The sources, and new weights (a segment starts at each partition's position).
            saved = len(mix.check_header(state[S.META_KEY].get(M.MIX_KEY)))
            mix = mix.adopt(state[S.META_KEY].get(M.MIX_KEY), cursors, len(S.HEAD_FIELDS))
            after = S.positional_stages(self.pipeline())
            inside = sorted(p for p, c in cursors.items() if c[S.ROWS] and not c[S.DONE])
            if len(mix.history) > saved and after and inside:
                # A stage after the mix that buffers (a shuffle window, a packer's carry or
                # window) saves the mix's position where its buffer began, and re-reads that
                # buffer at a resume: through the new weights it would be another buffer, so
                # rows would be lost and repeated.
                raise CheckpointError(
                    f"Stream state: new mixture weights at a resume need the mix to be the "
                    f"last stage that buffers, but {after} come after it, and partitions "
                    f"{inside[:8]}{'...' if len(inside) > 8 else ''} are inside a pass, where "
                    "they would re-read their buffer through the new weights. Resume with the "
                    "checkpoint's weights, and change them at an epoch's start (a state taken "
                    "at an epoch's end, or before the first batch)"
                )
        return meta, cursors, mix

    def adopted_state(self, state: Any) -> dict[Any, Any]:
        """``state`` as this Stream holds it once loaded: for a mixture built with new weights,
        the weights history with them appended and each partition's new segment in its
        cursor. Our loader writes it for a worker that has not run yet, so that a state saved
        before that worker's first batch says what the worker will do.

        Raises:
            CheckpointError: as ``load_state_dict``.
        """
        _, cursors, mix = self._parse(state)
        header = dict(state[S.META_KEY])
        if mix is not None:
            header[M.MIX_KEY] = mix.header()
        return {S.META_KEY: header, **cursors}

    def check_state(self, state: Any) -> tuple[S.StreamMeta, dict[int, list[int]]]:
        """Check ``state`` as ``load_state_dict`` would, changing nothing: our loader calls it
        in the main process for every worker's state, so that a damaged or foreign state is
        refused at ``load_state_dict`` on every rank, not at a worker's first batch.

        Raises:
            CheckpointError: naming the field, as ``load_state_dict``.
        """
        meta, cursors, _ = self._parse(state)
        return meta, cursors

    def load_state_dict(self, state: dict[Any, Any]) -> None:
        """Continue from ``state`` at the next ``iter()`` (or at once, when iterating).

        The state's seed, shard order and partitions win over the ones given to
        ``from_shards`` (an explicit different ``partitions=`` is refused).

        Raises:
            CheckpointError: the state is malformed or taken on another shard list.
        """
        meta, cursors, mix = self._parse(state)
        self._mix = mix
        self._seed = meta.seed
        self._shuffle = meta.shuffle_shards
        self._partitions = meta.partitions
        self._epoch = meta.epoch
        layout = state[S.META_KEY].get("layout")
        self._layout = dict(layout) if isinstance(layout, dict) else {}
        tail = state[S.META_KEY].get("tail")
        self._tail = dict(tail) if isinstance(tail, dict) else None
        reader = self._reader
        if reader is not None and not reader.started and not reader.closed:
            # Loaded into an iterator that has not yielded yet (torchdata's order: iter()
            # first, then load_state_dict): that iterator continues from the state.
            reader.restore(self._cursors_for(reader.parts, cursors, meta.epoch))
            self._loaded = None
        else:
            # The next iter() continues from it (an iterator already under way is left alone).
            self._loaded = cursors

    def _cursors_for(
        self, parts: list[int], loaded: dict[int, list[int]] | None, epoch: int
    ) -> dict[int, list[int]]:
        """The starting cursor of each partition a reader owns: its loaded cursor if that is
        in this pass, or in an earlier pass it has not finished (a carry: those rows come
        first), else the pass's start."""
        out = {}
        width = len(self.cursor_fields())
        for p in parts:
            c = loaded.get(p) if loaded is not None else None
            if loaded is not None and c is None:
                raise CheckpointError(
                    f"Stream state: partition {p} is owned by this reader but not in the "
                    f"state it loaded (which holds partitions {sorted(loaded)}); load the state "
                    "this reader saved, on the same layout"
                )
            if c is not None and (c[S.PASS] == epoch or (c[S.PASS] < epoch and not c[S.DONE])):
                out[p] = list(c)
            else:
                out[p] = S.fresh_cursor(epoch, width)
        return out

    # ---- reading ----

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        k, wid = (info.num_workers, info.id) if info is not None else (1, 0)
        world, rank = _world()
        S.check_layout(self._partitions, world, k)
        parts = S.owned(self._partitions, world, rank, k, wid)
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            self._tail = None  # a fresh pass: no record of an earlier epoch's end rides along
        cursors = self._cursors_for(parts, loaded, self._epoch)
        self._layout = {"world_size": world, "rank": rank, "num_workers": k, "worker": wid}
        if self._reader is not None:
            self._reader.close()
        self._reader = _Reader(self, parts, cursors, self._epoch)
        return self._reader

    def _open(self, shard: Any, start: int) -> Iterator[Any]:
        self._stats["opens"] += 1
        if self._seekable:
            if start:
                self._stats["seeks"] += 1
            return iter(self._read(shard, start))
        if start:
            self._stats["skipped"] += start
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"Stream: read() takes no start sample, so resuming shard {shard!r} at "
                    f"sample {start} reads and discards {start} samples (each resumed shard "
                    "costs its offset; give read a second parameter, start, to seek)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return itertools.islice(iter(self._read(shard)), start, None)

    def __getstate__(self) -> dict[str, Any]:
        # A live reader holds open shard iterators (generators, files): a copy sent to a
        # worker starts without it, from its own iter().
        state = dict(self.__dict__)
        state["_reader"] = None
        return state

    def __repr__(self) -> str:
        return (
            f"Stream({self._shard_count} shards, {self._partitions} partitions, seed "
            f"{self._seed}, {' -> '.join(self.pipeline())})"
        )


class _Reader:
    """One reader's partitions, drawn in canonical order; an iterator (not a generator), so a
    read error leaves it usable: the failing partition's chain is thrown away and rebuilt from
    its cursor (the position after its last row) on the next pull."""

    def __init__(
        self, stream: Stream, parts: list[int], cursors: dict[int, list[int]], epoch: int
    ) -> None:
        self.stream = stream
        self.parts = parts
        self.epoch = epoch
        self.closed = False
        self.started = False  # yielded a row: a later load_state_dict is for the next iter()
        self.width = len(stream.cursor_fields())
        self.cursors: dict[int, list[int]] = {}
        self.heap: list[tuple[int, int, int]] = []
        self.chains: dict[int, N.Node] = {}
        self.dirty: set[int] = set()  # partitions moved since the last state_dict_changes()
        self.full = True  # the next state_dict_changes() must say "take the whole state"
        self.restore(cursors)

    def restore(self, cursors: dict[int, list[int]]) -> None:
        self._drop_all()
        self.cursors = cursors
        self.full = True
        # A cursor in an earlier pass it has not finished (a carry) sorts first: its rows come
        # before this pass's.
        self.heap = [
            (c[S.PASS], c[S.ROWS], p)
            for p, c in cursors.items()
            if not c[S.DONE] and c[S.PASS] <= self.epoch
        ]
        heapq.heapify(self.heap)

    def _drop(self, p: int) -> None:
        chain = self.chains.pop(p, None)
        if chain is not None:
            chain.close()

    def _drop_all(self) -> None:
        for p in list(self.chains):
            self._drop(p)

    def close(self) -> None:
        self.closed = True
        self._drop_all()

    def __iter__(self) -> _Reader:
        return self

    # The state of this iteration (our loader reads it through the reader it iterates, so
    # another iter() of the same Stream -- a user's look at it with num_workers=0 -- cannot
    # move the loader's state; ``pipeline/fetch.py`` checks ``states_its_dataset``).
    states_its_dataset = True

    def state_dict(self) -> dict[Any, Any]:
        return self.stream._state_of(self.cursors)

    def state_dict_changes(self) -> dict[Any, Any] | None:
        return self.stream._changes_of(self)

    def __next__(self) -> Any:
        heap = self.heap
        cursors = self.cursors
        head = len(S.HEAD_FIELDS)
        while heap:
            e, k, p = heap[0]
            c = cursors[p]
            chain = self.chains.get(p)
            if chain is None:
                chain = self.chains[p] = self.stream._chain(p, e)
                chain.seek(c[head:])
            try:
                item = chain.pull()
            except BaseException:
                # The cursor still holds the position after the last row: the next pull
                # rebuilds the chain there, so nothing is lost or repeated.
                self._drop(p)
                raise
            self.dirty.add(p)
            if item is N.END:
                # The pass's final position: what a mix's sources drew and which ran out, a
                # packer's counters (its dropped tail); a done partition is never sought.
                c[head:] = chain.position()
                self._drop(p)
                if e < self.epoch:
                    # A carried pass is finished: the partition goes on with this pass.
                    cursors[p] = S.fresh_cursor(self.epoch, self.width)
                    heapq.heapreplace(heap, (self.epoch, 0, p))
                else:
                    c[S.DONE] = 1
                    heapq.heappop(heap)
                continue
            c[S.ROWS] = k + 1
            c[head:] = chain.position()
            heapq.heapreplace(heap, (e, k + 1, p))
            if c[S.SKIP]:
                c[S.SKIP] -= 1  # a row skip_samples moved past: drawn, not delivered
                continue
            self.started = True
            return item
        self.close()
        raise StopIteration
