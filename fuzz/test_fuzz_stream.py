"""The fuzzer as a ``Stream`` user (issue #33): a job cut into segments, each a fresh loader.

One job (drawn once): shards of 0-6 samples (sample ``i`` of shard ``s`` is ``1000 * s + i``),
a partition count dividing the shard count, and the pipeline -- optionally a ``filter``, a
``shuffle`` and a ``random_map`` (which pairs each sample with a draw from its own
generator). Then a chain of segments, as a preempted job lives: each segment builds the loader
as the README's quickstart does (another ``num_workers`` valid for the partitions, another
batch size, persistent or not, ``in_order`` or not), loads the previous segment's state
(through dict, ``dump_state`` bytes, ``torch.save`` or json), runs the quickstart's
``for epoch in range(state["epoch"], EPOCHS)`` loop, leaves it after some batches (``break``,
or an exception raised inside the loop), optionally SIGKILLs a worker on the way, and saves
``state_dict()``. The last segment runs to the end.

The model (``_model``) is never a loader run: pass ``e`` of partition ``p`` is the samples of
its shards (``deal``, the arithmetic docs/streams.md describes), those the filter keeps; their
order within the partition (in shard order, or the shuffle's) and each sample's ``random_map``
draw come from the Stream iterated alone, with no loader (docs/streams.md: neither depends on
the layout). Checked: every epoch delivers every sample of the
model exactly once, each partition's samples in the model's order, with the model's draws; and
a segment on the saving layout delivers bit-identically what an uninterrupted run of that layout
from the same state delivers.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from _leaks import start_multiprocessing_helpers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resumable_loader import DataLoader, Stream
from resumable_loader.plans.streams import deal
from resumable_loader.testing import roundtrip_state, worker_pids

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
EXAMPLES = int(os.environ.get("FUZZ_STREAM_EXAMPLES", {"ci": 25, "long": 2000}.get(PROFILE, 25)))
EPOCHS = 2


@dataclass(frozen=True)
class Reader:
    """``read(shard, start)`` over shards of the given lengths (picklable for spawn)."""

    lengths: tuple[int, ...]

    def __call__(self, s: int, start: int) -> Iterator[int]:
        for i in range(start, self.lengths[s]):
            yield 1000 * s + i


def keep(x: int) -> bool:
    return x % 3 != 1


def noisy(x: int, rng: Any) -> tuple[int, float]:
    return x, float(rng.random())


@dataclass(frozen=True)
class Job:
    lengths: tuple[int, ...]
    partitions: int
    seed: int
    filtered: bool
    noisy: bool
    shuffle: int  # 0: none, else the buffer size

    def stream(self) -> Stream:
        s = Stream.from_shards(
            list(range(len(self.lengths))),
            Reader(self.lengths),
            seed=self.seed,
            partitions=self.partitions,
        )
        if self.filtered:
            s = s.filter(keep)
        if self.shuffle:
            s = s.shuffle(self.shuffle)
        if self.noisy:
            s = s.random_map(noisy)
        return s


@dataclass(frozen=True)
class Segment:
    workers: int
    batch: int
    persistent: bool
    in_order: bool
    stop: int  # batches to take before leaving (0: run to the end)
    how: str  # "break" or "raise"
    kill_after: int | None  # SIGKILL worker 0 after this many batches of the segment
    via: str


@st.composite
def jobs(draw: Any) -> Job:
    n = draw(st.integers(1, 12))
    lengths = tuple(draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)))
    parts = draw(st.sampled_from([p for p in (1, 2, 3, 4, 6, 8, 12) if p <= n]))
    return Job(
        lengths,
        parts,
        draw(st.integers(0, 3)),
        draw(st.booleans()),
        draw(st.booleans()),
        draw(st.sampled_from([0, 0, 1, 2, 3, 5])),
    )


def segments(job: Job) -> Any:
    workers = [w for w in (0, 1, 2, 3, 4) if job.partitions % max(w, 1) == 0]
    return st.builds(
        Segment,
        workers=st.sampled_from(workers),
        batch=st.integers(1, 5),
        persistent=st.booleans(),
        in_order=st.booleans(),
        stop=st.integers(1, 8),
        how=st.sampled_from(["break", "raise"]),
        kill_after=st.none() | st.integers(0, 3),
        via=st.sampled_from(["dict", "bytes", "torch", "json"]),
    )


def _model(job: Job) -> dict[int, dict[int, list[Any]]]:
    """Epoch -> partition -> its samples in order (with their draws), from the docs: which
    samples a partition holds is the deal's arithmetic and the filter; their order within the
    partition (the shuffle's windows) and their draws do not depend on the layout, so the
    Stream iterated alone, with no loader, gives them."""
    out: dict[int, dict[int, list[Any]]] = {}
    s = job.stream()
    for e in range(EPOCHS):
        parts = deal(job.seed, e, len(job.lengths), job.partitions, True)
        where = {sh: p for p, shards in enumerate(parts) for sh in shards}
        s.set_epoch(e)
        alone = list(iter(s))
        out[e] = {p: [] for p in range(job.partitions)}
        for x in alone:
            sample = x[0] if job.noisy else x
            out[e][where[sample // 1000]].append(x)
        for p, shards in enumerate(parts):
            xs = [1000 * sh + i for sh in shards for i in range(job.lengths[sh])]
            if job.filtered:
                xs = [x for x in xs if keep(x)]
            got = [x[0] if job.noisy else x for x in out[e][p]]
            assert sorted(got) == sorted(xs), "the Stream alone lost or repeated a sample"
            if not job.shuffle:
                assert got == xs, "the Stream alone reordered an unshuffled partition"
    return out


class _Leave(Exception):
    pass


def _items(batch: Any, job: Job) -> list[Any]:
    if job.noisy:
        xs, vs = batch
        return list(zip(xs.tolist(), vs.tolist()))
    return batch.tolist()


def _segment(job: Job, seg: Segment, state: Any, last: bool) -> tuple[list[Any], Any]:
    """One process's life: build, load, loop, leave; returns [(epoch, batch items)] and the
    state it saved (None for the last segment)."""
    loader = DataLoader(
        job.stream(),
        batch_size=seg.batch,
        num_workers=seg.workers,
        persistent_workers=seg.persistent and seg.workers > 0,
        in_order=seg.in_order,
    )
    got: list[Any] = []
    try:
        start = 0
        if state is not None:
            loader.load_state_dict(state)
            start = state["epoch"]
        try:
            for epoch in range(start, EPOCHS):
                for batch in loader:
                    got.append((epoch, _items(batch, job)))
                    if seg.kill_after == len(got) and seg.workers > 0:
                        pids = [p for p in worker_pids(loader) if p > 0]
                        if pids:
                            os.kill(pids[0], signal.SIGKILL)
                    if not last and len(got) >= seg.stop:
                        if seg.how == "raise":
                            raise _Leave
                        break
                else:
                    continue
                break
        except _Leave:
            pass
        saved = None if last else roundtrip_state(loader.state_dict(), seg.via)
    finally:
        loader.close()
    return got, saved


def _check(job: Job, batches: list[Any]) -> None:
    model = _model(job)
    for e in range(EPOCHS):
        got = [x for ep, b in batches if ep == e for x in b]
        where = {}
        for p, xs in model[e].items():
            for x in xs:
                where[x] = p
        want = sorted((x for xs in model[e].values() for x in xs), key=repr)
        assert sorted(got, key=repr) == want, f"epoch {e}: not every sample exactly once"
        per: dict[int, list[Any]] = {}
        for x in got:
            per.setdefault(where[x], []).append(x)
        for p, xs in model[e].items():
            assert per.get(p, []) == xs, f"epoch {e} partition {p}: order or values differ"


@pytest.fixture(scope="module", autouse=True)
def _helpers() -> None:
    start_multiprocessing_helpers()


@given(data=st.data())
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
def test_a_stream_job_cut_anywhere_on_any_layouts_is_the_uninterrupted_job(data: Any) -> None:
    job = data.draw(jobs(), label="job")
    segs = data.draw(st.lists(segments(job), min_size=1, max_size=4), label="segments")
    batches: list[Any] = []
    state = None
    for i, seg in enumerate(segs):
        last = i == len(segs) - 1
        got, saved = _segment(job, seg, state, last)
        if state is not None and seg.kill_after is None:
            # The saving layout is this segment's: an uninterrupted run of it from the same
            # state must deliver the same batches, bit for bit.
            prev = segs[i - 1]
            if (prev.workers, prev.batch) == (seg.workers, seg.batch) and seg.in_order:
                ref, _ = _segment(job, Segment(**{**seg.__dict__, "stop": 10**6}), state, True)
                assert got == ref[: len(got)], "same layout: the batches differ"
        batches += got
        state = saved
    _check(job, batches)
