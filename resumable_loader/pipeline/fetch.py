"""The fetchers: one task's samples read, seeded and collated -- in a worker process, or in the
main process when ``num_workers=0`` -- and the retry policy for transient errors.

A map-style task is a list of indices (or one index); a stream task is the next fetch of the
worker's iterator, whose dataset state rides with the result ("state rides with the data").
Both seed python/numpy/torch per task from the epoch's seed, so a task re-sent after a crash,
or retried after a transient error, has the values it would have had the first time.
"""

from __future__ import annotations

import inspect
import math
import pickle
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data._utils import worker as torch_worker

from ..state.schema import has_state, same_state
from ..state.seeds import (
    SAMPLE,
    STREAM,
    capture_rngs,
    derive_seed,
    restore_rngs,
    seed_global_rngs,
)
from . import transport as _transport
from .protocol import (
    Status,
    StreamResume,
)

# The messages and statuses are in pipeline.protocol; these names stay importable from here.
OK, ERROR, END = Status.OK, Status.ERROR, Status.END

# Stream state snapshots may cost at most this fraction of the fetch time: a state that is
# expensive to take (a 100k-entry shuffle buffer) then rides with every k-th result only, and a
# resume or respawn replays the < k fetches since (seeded, hence exact). Cheap states -- the
# usual cursor -- ride with every result and nothing is ever read twice.
STATE_BUDGET = 0.03
# ... and never fewer than one snapshot per this many fetches, which bounds a replay.
MAX_STATE_INTERVAL = 256
# A snapshot cheaper than this always rides with its result, whatever the fetch costs: it is
# below the loader's own fixed cost per batch, so saving it would buy nothing.
STATE_FREE_S = 50e-6
# Shipping a snapshot costs too: the worker's write, and the copy into the main process, which
# is the pipeline's serial stage. Charged at about 1 GB/s on top of the measured time.
STATE_BYTE_COST_S = 1e-9
# Judge the cost only after this many snapshots (their minimum): one preempted snapshot on a
# busy machine must not make a cheap state sparse.
STATE_WARMUP = 8


class StreamEnd(Exception):
    """The worker's stream has no further batch."""


@dataclass(frozen=True)
class RetryPolicy:
    """Retry transient errors inside the worker, with exponential backoff (via tenacity).

    A fetch (``__getitem__``/``__getitems__`` + collate for map-style datasets; ``next()`` and
    collate for a stream) raising one of ``exceptions`` is tried again, up to ``attempts``
    times in all, waiting ``backoff_s * 2**n`` (at most ``max_backoff_s``) between tries, so
    that a retried batch has the same values as one that succeeded first time: a map-style
    task's RNGs are re-seeded before each try; a stream keeps the items already read and puts
    the RNGs back as they were before the step that raised. A generator that raised is
    finished and is not retried. Other exceptions are re-raised in the main process at once,
    as torch does.
    """

    exceptions: tuple[type[BaseException], ...] = (OSError, TimeoutError)
    attempts: int = 3
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("RetryPolicy backoffs must be >= 0")
        if not self.exceptions or not all(
            isinstance(e, type) and issubclass(e, BaseException) for e in self.exceptions
        ):
            raise ValueError(
                f"RetryPolicy.exceptions must be exception types, got {self.exceptions!r}"
            )


# --------------------------------------------------------------------------------------------
# Fetchers: shared by worker processes and the single-process iterator.


class MapFetcher:
    """Fetch a task of a map-style dataset: indices -> collated batch (like torch's)."""

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Any) -> None:
        self.dataset = dataset
        self.auto = auto_collation
        self.collate = collate_fn
        self.getitems = getattr(dataset, "__getitems__", None) if auto_collation else None
        self.shared = True  # in a worker: the collate may allocate in /dev/shm (see _collate)
        # seed_per_sample: the RNGs are seeded from (this, index) before each dataset[index].
        self.sample_seed: int | None = None

    def _seeded_item(self, i: Any) -> Any:
        assert self.sample_seed is not None
        seed_global_rngs(derive_seed(SAMPLE, self.sample_seed, int(i)))
        return self.dataset[i]

    def fetch(self, indices: Any) -> Any:
        if self.sample_seed is not None:
            if self.auto:
                data = [self._seeded_item(i) for i in indices]
                return _collate(self.collate, data, self.shared)
            return _collate(self.collate, self._seeded_item(indices), self.shared)
        if self.auto:
            if self.getitems:
                data = self.getitems(indices)
            else:
                ds = self.dataset
                data = [ds[i] for i in indices]
            return _collate(self.collate, data, self.shared)
        return _collate(self.collate, self.dataset[indices], self.shared)


def shard_datapipe(dataset: Any, worker_id: int, num_workers: int) -> None:
    """A datapipe's ``sharding_filter`` keeps worker ``worker_id``'s share (of this rank's),
    as torch's workers apply it before ``worker_init_fn``."""
    from torch.utils.data import IterDataPipe

    if not isinstance(dataset, IterDataPipe):
        return
    world, rank = 1, 0
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    torch.utils.data.graph_settings.apply_sharding(
        dataset, num_workers * world, worker_id * world + rank
    )


def seed_datapipe(dataset: Any, seed: int) -> None:
    """A datapipe's shufflers draw from one seed shared by all workers (derived from the
    epoch's), as in torch: sharding then splits one order, not one order per worker."""
    from torch.utils.data import IterDataPipe

    if isinstance(dataset, IterDataPipe):
        rng = torch.Generator()
        rng.manual_seed(derive_seed(STREAM, seed, -1, -1))
        torch.utils.data.graph_settings.apply_random_seed(dataset, rng)


def _collate(collate: Any, data: Any, shared: bool) -> Any:
    """``collate(data)``; with ``shared=False``, out of /dev/shm.

    torch's default_collate allocates its output in shared memory when get_worker_info() is
    set (so the batch needs no copy to be sent). When /dev/shm is full, the worker info is
    hidden for the collate alone -- the dataset's own calls still see it -- and the batch is
    built in ordinary memory, to be copied into the message.
    """
    if shared:
        if not _transport.has_pool():
            return collate(data)
        with _transport.collating():  # into the worker's pooled segment
            return collate(data)
    info = torch_worker._worker_info
    torch_worker._worker_info = None
    try:
        return collate(data)
    finally:
        torch_worker._worker_info = info


ITER_START = -1  # the fetch number whose seed is in force while iter(dataset) runs


class StreamFetcher:
    """Fetch batches from an iterable dataset's iterator, tracking its state.

    The state holder is the dataset if it has ``state_dict``/``load_state_dict`` (the
    torch/torchdata "Stateful" shape), else the iterator if it has them, else nothing (the
    stream is then fast-forwarded by replaying fetches).

    Args:
        state_every: take the state after every n-th fetch; None: adaptively, so that taking
            it costs at most STATE_BUDGET of the fetch time (every fetch when it is cheap).
        exact_retry: a RetryPolicy is in force: snapshot the global RNGs before each step
            (each ``next()`` and the collate), so that a retry resumes from the step that
            raised with the RNGs as they were then (~75 us per item, numpy's get_state
            most of it).

    A fetch that raises keeps what it already read in ``partial`` (the items pulled, or the
    whole batch if the collate raised): a retry continues from there, so nothing read from
    the stream is lost. A generator that raised is finished, so it is never retried
    (``can_retry``): its error goes to the caller and its stream ends, as in torch.
    """

    def __init__(
        self,
        dataset: Any,
        auto_collation: bool,
        collate_fn: Any,
        batch_size: int | None,
        drop_last: bool,
        state_every: int | None = None,
        exact_retry: bool = False,
    ) -> None:
        self.dataset = dataset
        self.auto = auto_collation
        self.collate = collate_fn
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.it: Any = None
        self.ended = False
        self.partial: list[Any] = []  # items a failed attempt pulled; a retry starts with them
        self.track_rngs = exact_retry
        self.rngs_before: Any = None  # the global RNGs just before the step that raised last
        self.broken = False  # a generator raised: it is finished, a retry would end the stream
        self.holder: Any = None
        self.prev_state: dict[Any, bytes] = {}
        self.state_every = state_every
        self.interval = 1
        self.since_state = 0
        self.count = 0  # fetches made this epoch
        self._fetch_s: float | None = None
        self._state_s: float | None = None
        self._snapshots = 0
        self.shared = True  # in a worker: the collate may allocate in /dev/shm (see _collate)
        # Snapshot the RNGs before the collate even without a RetryPolicy, so that a collate
        # redone out of a full /dev/shm draws the same numbers (set by the worker loop for a
        # custom collate_fn and large batches: ~35 us, against a batch worth sharing).
        self.guard_collate = False

    @property
    def stateful(self) -> bool:
        return self.holder is not None

    def start(self, resume: StreamResume | None, seed_for: Any, run: Any = None) -> None:
        """Begin the epoch's stream; restore it from ``resume`` (a ``StreamResume``).

        ``run(fn, seed)`` seeds and calls ``fn`` under the fetch's retry policy: a replayed fetch
        is retried exactly like the original was, so a transient error while replaying cannot
        shift the stream.
        """
        self.ended = False
        self.partial = []
        self.broken = False
        self.rngs_before = None
        self.prev_state = {}
        self.count = 0
        self.since_state = 0
        ds = self.dataset
        state = None
        at = count = 0
        if resume is not None:
            raw, encoded, at, count = resume
            if raw:
                state = decode_state(raw) if encoded else raw
                if encoded:
                    self.prev_state = dict(raw)  # what the main process holds: deltas from it
        # iter() may draw random numbers (a shard order shuffled per epoch): it draws from
        # the epoch's stream seed, so a resumed or respawned worker draws the same.
        seed_global_rngs(seed_for(ITER_START))
        if has_state(ds):
            loaded = False
            if state is not None:
                try:
                    ds.load_state_dict(state)
                    loaded = True
                except Exception:
                    # A dataset that builds what load_state_dict needs in __iter__ (written for
                    # torchdata's order): load it after iter(), below.
                    pass
            self.it = iter(ds)
            if state is not None and not (loaded and same_state(ds.state_dict(), state)):
                # iter() reset the position just loaded: the dataset was written for
                # torchdata's order (iter() first, then load_state_dict). Load it again into the
                # iterator that now exists. A dataset whose iter() starts from the loaded state
                # (or a generator, which runs nothing yet) reports it unchanged: loaded once.
                ds.load_state_dict(state)
            self.holder = ds
            if getattr(self.it, "states_its_dataset", False):
                # The iterator answers for this iteration's state (a Stream's reader): read
                # it there, so that another iter() of the dataset cannot move it.
                self.holder = self.it
        else:
            self.it = iter(ds)
            self.holder = self.it if has_state(self.it) else None
            if state is not None:
                if self.holder is None:
                    raise RuntimeError(
                        "a saved stream state cannot be restored: neither the dataset nor its "
                        "iterator has load_state_dict()"
                    )
                self.holder.load_state_dict(state)
        for k in range(at, count):
            try:
                if run is not None:
                    run(self._pull, seed_for(k))
                else:
                    seed_global_rngs(seed_for(k))
                    self._pull()
            except StreamEnd:
                break
            except Exception:
                # It failed after its retries in the original run too (fetches are seeded and
                # deterministic); that error was delivered there.
                self.fetch_failed()
        self.count = count

    def _next_item(self, it: Any) -> Any:
        if self.track_rngs:
            self.rngs_before = capture_rngs()
        try:
            return next(it)
        except StopIteration:
            self.ended = True
            raise StreamEnd from None
        except BaseException:
            if inspect.isgenerator(it):
                self.broken = True
            raise

    def _pull(self) -> list[Any] | Any:
        items, self.partial = self.partial, []
        if not self.auto:
            if items:
                return items[0]  # read before a failed collate
            if self.ended:
                raise StreamEnd
            return self._next_item(self.it)
        bs = self.batch_size
        assert bs is not None
        while len(items) < bs and not self.ended:
            try:
                items.append(self._next_item(self.it))
            except StreamEnd:
                break
            except BaseException:
                self.partial = items  # a retry must not lose what this attempt already read
                raise
        if not items or (self.drop_last and len(items) < bs):
            self.ended = True
            raise StreamEnd
        return items

    def fetch(self, _k: Any = None) -> Any:
        items = self._pull()
        # None unless taken now: a collate redone for lack of /dev/shm must never be handed an
        # earlier batch's RNGs.
        self.rngs_before = capture_rngs() if self.track_rngs or self.guard_collate else None
        try:
            return _collate(self.collate, items, self.shared)
        except BaseException:
            self.partial = items if self.auto else [items]
            raise

    def can_retry(self) -> bool:
        return not self.broken

    def before_retry(self) -> None:
        """Put the RNGs back as they were before the step that raised."""
        if self.rngs_before is not None:
            restore_rngs(self.rngs_before)

    def fetch_failed(self) -> None:
        """The fetch failed for good (its error goes to the caller): drop its partial batch,
        as torch does."""
        self.partial = []

    def failed_snapshot(self) -> dict[Any, bytes] | None:
        """After a fetch that failed for good (its error goes to the caller): the state delta
        as the stream now stands -- the failed batch's rows dropped with it, as torch drops
        them, and the sample that raised not consumed (a ``Stream`` steps back to it). None
        where there is no state to take, or the stream ended with the error."""
        if self.holder is None or self.ended or self.broken:
            return None
        try:
            delta = self.state_delta()
        except Exception:
            return None  # the dataset cannot say: the resume replays the fetch, as before
        self.since_state = 0
        return delta

    def after_fetch(self, fetch_s: float) -> dict[Any, bytes] | None:
        """Count a fetch; return the state delta if a snapshot is due with this result."""
        self.count += 1
        if self.holder is None:
            return None
        f = self._fetch_s
        self._fetch_s = fetch_s if f is None else 0.8 * f + 0.2 * fetch_s
        self.since_state += 1
        due = self.state_every if self.state_every is not None else self.interval
        if self.since_state < due:
            return None
        self.since_state = 0
        t0 = time.perf_counter()
        delta = self.state_delta()
        took = time.perf_counter() - t0
        took += STATE_BYTE_COST_S * sum(len(v) for v in delta.values())
        if self.state_every is None:
            # The cheapest snapshot seen is its true cost: being preempted (a busy machine)
            # only ever adds time, and must not make a cheap state go sparse.
            c = self._state_s
            self._state_s = took if c is None else min(c, took)
            self._snapshots += 1
            if self._snapshots < STATE_WARMUP or self._state_s <= STATE_FREE_S:
                self.interval = 1
            else:
                budget = STATE_BUDGET * max(self._fetch_s, 1e-9)
                ratio = math.ceil(self._state_s / budget)
                self.interval = max(1, min(MAX_STATE_INTERVAL, ratio))
        return delta

    def state_delta(self) -> dict[Any, bytes]:
        """The changed keys of the holder's state since the last snapshot, pickled per key.

        Only changed values travel to the main process; unchanged ones are compared as bytes
        here, in the worker, which has the time (it runs in parallel with the others).
        """
        # A holder that knows what moved (Stream.state_dict_changes) hands only those keys,
        # so a worker owning a thousand partitions does not copy and pickle them all per batch.
        changes = getattr(self.holder, "state_dict_changes", None)
        sd = changes() if callable(changes) else None
        partial = isinstance(sd, dict)
        if not partial:
            sd = self.holder.state_dict()
        if not isinstance(sd, dict):
            sd = {None: sd}
        prev = self.prev_state
        delta = {}
        for key, value in sd.items():
            blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            if prev.get(key) != blob:
                delta[key] = blob
        if not partial:
            for key in prev.keys() - sd.keys():
                delta[key] = b""  # removed key
        if delta:
            prev.update(delta)
            for key in [k for k, v in delta.items() if v == b""]:
                prev.pop(key, None)
        return delta


def merge_state(into: dict[Any, bytes], delta: dict[Any, bytes] | None) -> None:
    """Apply a per-key state delta (b"" marks a removed key)."""
    if not delta:
        return
    into.update(delta)
    if b"" in delta.values():
        for key in [k for k, v in delta.items() if v == b""]:
            into.pop(key, None)


def decode_state(encoded: dict[Any, bytes]) -> Any:
    """Per-key pickled state -> the dataset's plain state (inverse of ``state_delta``)."""
    if set(encoded) == {None}:
        return pickle.loads(encoded[None])
    return {k: pickle.loads(v) for k, v in encoded.items()}


def make_retrier(retry: Any, reseed: Any, can_retry: Any = None) -> Any:
    """A callable ``run(fn, *args) -> (result, retries)`` honouring a RetryPolicy (or None).

    ``reseed()`` runs before each retry (not before the first attempt, which the caller has
    seeded); ``can_retry()``, if given, may veto a retry."""
    if retry is None:

        def run_once(fn: Any, *args: Any) -> tuple[Any, int]:
            return fn(*args), 0

        return run_once

    import tenacity

    types = tuple(retry.exceptions)

    def run(fn: Any, *args: Any) -> tuple[Any, int]:
        retrier = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(retry.attempts),
            wait=tenacity.wait_exponential(multiplier=retry.backoff_s, max=retry.max_backoff_s),
            retry=tenacity.retry_if_exception(
                lambda exc: isinstance(exc, types) and (can_retry is None or can_retry())
            ),
            reraise=True,
            # Only between attempts: the first runs as the caller seeded it.
            before_sleep=lambda _state: reseed(),
        )
        try:
            result = retrier(fn, *args)
        except BaseException as exc:
            # tenacity keeps the error in its retry state, which its own frames in the error's
            # traceback refer to: a cycle that would hold the failed fetch's frames -- the items
            # it read -- until the collector runs. The finished frames are not needed (the
            # traceback's text is what travels), so clear them.
            traceback.clear_frames(exc.__traceback__)
            raise
        return result, retrier.statistics.get("attempt_number", 1) - 1

    return run
