"""``skip_samples`` on a ``Stream``'s loader state (issue #33): the next ``n`` rows of the
canonical order, taken by setting each partition cursor's ``skip``, nothing read offline.

Every check compares the skipped run against the uninterrupted run: the rows delivered after
the skip are the uninterrupted run's without the next ``n`` rows of the canonical order
(``(pass, rows, partition)``, modelled here by a brute-force heap over the rows each partition
had delivered), on the same layout and on another one."""

from __future__ import annotations

import contextlib
import copy
import heapq
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _stream_shards as F
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_loader import (
    CheckpointError,
    DataLoader,
    Stream,
    dump_state,
    load_state,
    merge_rank_states,
    skip_samples,
)
from resumable_loader.cli.main import main
from resumable_loader.plans.streams import deal
from resumable_loader.state.skip import water_fill

# Every skip of a Stream's state warns that its rows are read in the workers (checked once,
# in test_a_skip_says_its_rows_are_read_not_delivered).
pytestmark = pytest.mark.filterwarnings("ignore:skip_samples. a Stream:RuntimeWarning")

SHARDS = 32  # 2..6 samples each: 8 shards, about 32 rows, per partition
PARTITIONS = 4
EPOCHS = 2
Run = list[tuple[int, list[float]]]


def _make() -> Stream:
    return Stream.from_shards(list(range(SHARDS)), F.read, partitions=PARTITIONS).map(F.plus_half)


def _run(workers: int, batch: int, state: Any = None, stop: int | None = None) -> tuple[Run, Any]:
    """Epochs 0..EPOCHS-1 from ``state`` (or the start); the state after ``stop`` batches."""
    loader = DataLoader(_make(), batch_size=batch, num_workers=workers, stream_tail=None)
    start = 0
    if state is not None:
        loader.load_state_dict(state)
        start = state.get("epoch", 0)  # a global state: the test resumes epoch 0
    out: Run = []
    try:
        for epoch in range(start, EPOCHS):
            for b in loader:
                out.append((epoch, b.tolist()))
                if len(out) == stop:
                    return out, load_state(dump_state(loader.state_dict()))
    finally:
        del loader
    return out, None


_REF: dict[tuple[int, int], Run] = {}


def _ref(workers: int, batch: int) -> Run:
    if (workers, batch) not in _REF:
        _REF[workers, batch] = _run(workers, batch)[0]
    return _REF[workers, batch]


def _partition(epoch: int, x: float) -> int:
    shards = deal(0, epoch, SHARDS, PARTITIONS, True)
    return next(p for p, s in enumerate(shards) if int(x) // 1000 in s)


def _per_partition(run: Run, epoch: int) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {p: [] for p in range(PARTITIONS)}
    for e, b in run:
        if e == epoch:
            for x in b:
                out[_partition(epoch, x)].append(x)
    return out


def _next_rows(rows: dict[int, int], n: int) -> dict[int, int]:
    """Brute force: the partitions of the next ``n`` rows of the canonical order, one row at a
    time from a heap of ``(rows drawn, p)`` (every partition taken as long enough)."""
    heap = [(k, p) for p, k in rows.items()]
    heapq.heapify(heap)
    taken: Counter[int] = Counter()
    for _ in range(n):
        k, p = heapq.heappop(heap)
        taken[p] += 1
        heapq.heappush(heap, (k + 1, p))
    return dict(taken)


def _expected(ref: Run, head: Run, n: int) -> tuple[dict[int, list[float]], int]:
    """Epoch 0's rows per partition after ``head`` and a skip of ``n``: the reference's rows of
    each partition less its share of the next ``n`` rows of the canonical order (a partition
    that ends inside its share ends there), and the rows such partitions could not give."""
    ref_p, head_p = _per_partition(ref, 0), _per_partition(head, 0)
    share = _next_rows({p: len(head_p[p]) for p in range(PARTITIONS)}, n)
    out, short = {}, 0
    for p, rows in ref_p.items():
        k, s = len(head_p[p]), share.get(p, 0)
        assert rows[:k] == head_p[p]
        out[p] = rows[:k] + rows[k + s :]
        short += max(0, k + s - len(rows))
    return out, short


def _check(ref: Run, head: Run, rest: Run, n: int) -> None:
    """Epoch 0 as the model says, and epoch 1 untouched (every row once, partition order)."""
    want, _ = _expected(ref, head, n)
    assert _per_partition(head + rest, 0) == want
    got1 = sorted(x for e, b in rest if e == 1 for x in b)
    assert got1 == sorted(x for e, b in ref if e == 1 for x in b)
    assert _per_partition(rest, 1) == _per_partition(ref, 1)


# ---- the arithmetic ----------------------------------------------------------------------------


@given(
    rows=st.lists(st.integers(0, 12), min_size=1, max_size=9),
    passes=st.lists(st.integers(0, 1), min_size=9, max_size=9),
    n=st.integers(0, 60),
)
@settings(max_examples=200, deadline=None)
def test_water_fill_takes_the_next_rows_of_the_canonical_order(
    rows: list[int], passes: list[int], n: int
) -> None:
    keys = {p: (passes[p], k) for p, k in enumerate(rows)}
    heap = [(e, k, p) for p, (e, k) in keys.items()]
    heapq.heapify(heap)
    want: Counter[int] = Counter()
    for _ in range(n):
        e, k, p = heapq.heappop(heap)
        want[p] += 1
        heapq.heappush(heap, (e, k + 1, p))
    assert water_fill(keys, n) == dict(want)


# ---- same layout -------------------------------------------------------------------------------


@pytest.mark.parametrize(("stop", "n"), [(1, 1), (3, 5), (4, 10), (2, 23)])
def test_a_skip_is_the_uninterrupted_run_less_the_next_n_rows(stop: int, n: int) -> None:
    """One reader (num_workers=0): its output is the canonical order itself, so the skipped run
    is exactly the uninterrupted run with the ``n`` rows after the state cut out."""
    ref = _ref(0, 3)
    head, state = _run(0, 3, stop=stop)
    assert head == ref[:stop]
    before = copy.deepcopy(state)
    skipped = skip_samples(state, n)
    assert state == before  # the state given is not changed
    rest, _ = _run(0, 3, state=skipped)
    flat = [x for _, b in ref for x in b]
    got = [x for _, b in head + rest for x in b]
    pos = 3 * stop
    _, short = _expected(ref, head, n)
    assert short == 0  # no partition ends inside its share: the model is the plain cut
    assert got == flat[:pos] + flat[pos + n :]
    _check(ref, head, rest, n)
    assert skipped["skipped_samples"] == [[0, pos, n]]


def test_a_skip_on_two_workers_resumes_on_the_same_layout() -> None:
    """Two readers: worker 1 may not have delivered yet (no cursors in the state); its
    partitions' shares are written into a state of its own."""
    ref = _ref(2, 3)
    for stop, n in ((1, 9), (4, 6)):
        head, state = _run(2, 3, stop=stop)
        rest, _ = _run(2, 3, state=skip_samples(state, n))
        _check(ref, head, rest, n)


def test_a_partition_that_ends_inside_its_skip_ends_there_and_shows_the_shortfall() -> None:
    ref = _ref(0, 3)
    head, state = _run(0, 3, stop=2)
    n = 120  # more than some partitions have left: about 32 rows each, 6 delivered
    want, short = _expected(ref, head, n)
    assert short > 0
    loader = DataLoader(_make(), batch_size=3)
    loader.load_state_dict(skip_samples(state, n))
    rest: Run = []
    left = []
    for b in loader:
        rest.append((0, b.tolist()))
        ds = loader.state_dict()["workers"][0]["dataset_state"] or {}  # None: the epoch ended
        left.append(sum(c[3] for p, c in ds.items() if p != "stream" and c[1] == 1))
    assert _per_partition(head + rest, 0) == want
    # The rows those partitions could not give stay in their finished cursors' skip.
    assert max(left) == short


# ---- another layout, and ranks -----------------------------------------------------------------


@pytest.mark.parametrize(("saved", "now"), [((2, 3), (0, 4)), ((0, 3), (4, 2)), ((1, 2), (2, 5))])
def test_a_skip_then_resume_on_another_layout(saved: tuple[int, int], now: tuple[int, int]) -> None:
    ref = _ref(*saved)
    head, state = _run(*saved, stop=3)
    rest, _ = _run(*now, state=skip_samples(state, 11))
    _check(ref, head, rest, 11)


@contextlib.contextmanager
def _as_rank(monkeypatch: pytest.MonkeyPatch, world: int, rank: int) -> Iterator[None]:
    with monkeypatch.context() as m:
        m.setattr(torch.distributed, "is_available", lambda: True)
        m.setattr(torch.distributed, "is_initialized", lambda: True)
        m.setattr(torch.distributed, "get_world_size", lambda *a, **k: world)
        m.setattr(torch.distributed, "get_rank", lambda *a, **k: rank)
        yield


def test_a_global_state_skips_and_resumes_on_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two simulated ranks (one after the other) save; the job's global state skips 7 rows of
    the whole stream and one process resumes it."""
    ref = [(e, b) for e, b in _ref(0, 3) if e == 0]
    head: Run = []
    states = []
    for r in range(2):
        with _as_rank(monkeypatch, 2, r):
            got, state = _run(1, 2, stop=2)
            head += got
            states.append(state)
    skipped = skip_samples(merge_rank_states(states), 7)
    rest, _ = _run(0, 5, state=skipped)
    _check(ref + [(e, b) for e, b in _ref(0, 3) if e == 1], head, rest, 7)
    with pytest.raises(CheckpointError, match=r"one rank's state .* merge_rank_states"):
        skip_samples(states[0], 7)


# ---- refusals and the command line ---------------------------------------------------------------


def test_a_state_without_cursors_is_refused_with_what_to_do() -> None:
    loader = DataLoader(_make(), batch_size=3)
    with pytest.raises(CheckpointError, match=r"no worker has delivered a batch .* first batch"):
        skip_samples(loader.state_dict(), 3)
    _, state = _run(0, 3, stop=1)
    assert skip_samples(state, 0) == state
    damaged = load_state(dump_state(state))
    damaged["workers"][0]["dataset_state"][1][3] = -1
    with pytest.raises(CheckpointError, match=r"partition 1 must be a cursor of 7 ints"):
        skip_samples(damaged, 3)
    crafted = load_state(dump_state(state))
    crafted["workers"][0]["dataset_state"]["stream"]["partitions"] = 2**62  # no walk of 2**62
    with pytest.raises(CheckpointError, match=r"expected partitions \(an int in 1\.\.16777216\)"):
        skip_samples(crafted, 3)


def test_a_skip_says_its_rows_are_read_not_delivered() -> None:
    _, state = _run(0, 3, stop=1)
    with pytest.warns(RuntimeWarning, match=r"7 skipped rows are read, not delivered"):
        skip_samples(state, 7)


def test_the_cli_skips_a_saved_stream_state(tmp_path: Path, capsys: Any) -> None:
    ref = _ref(0, 3)
    head, state = _run(0, 3, stop=2)
    path = tmp_path / "ckpt.pt"
    torch.save({"loader": state, "step": 2}, path)
    assert main(["skip", str(path), "--samples", "4", "--key", "loader"]) == 0
    out = capsys.readouterr().out
    assert "skipped 4 samples" in out
    assert "note: skip_samples: a Stream's 4 skipped rows are read, not delivered" in out
    saved = torch.load(path, weights_only=True)
    assert saved["loader"] == skip_samples(state, 4)
    rest, _ = _run(0, 3, state=saved["loader"])
    _check(ref, head, rest, 4)


def test_two_skips_are_one_skip_of_their_sum() -> None:
    ref = _ref(0, 3)
    head, state = _run(0, 3, stop=3)
    twice = skip_samples(skip_samples(state, 4), 5)
    assert twice["skipped_samples"] == [[0, 9, 4], [0, 13, 5]]
    rest, _ = _run(0, 3, state=twice)
    _check(ref, head, rest, 9)


def _uneven_read(shard: int, start: int) -> Iterator[int]:
    """Even shards hold 1 row, odd ones 12: with 4 partitions in shard order, partitions 0 and
    2 (worker 0 of 2) run dry long before 1 and 3 (worker 1)."""
    for i in range(start, 1 if shard % 2 == 0 else 12):
        yield shard * 1000 + i


def test_a_worker_that_ran_dry_gets_no_share() -> None:
    """One of two workers has delivered all its rows (its reader ended, and its END carried no
    cursors, so one of its partitions still looks unfinished: its 16 rows filled 4 whole
    batches of 4): the next rows of the stream are all the other worker's, even past the level
    the dry partitions stopped at."""

    def make() -> Stream:
        return Stream.from_shards(list(range(32)), _uneven_read, partitions=4, shuffle_shards=False)

    def per_partition(rows: list[int]) -> dict[int, list[int]]:
        return {p: [x for x in rows if (x // 1000) % 4 == p] for p in range(4)}

    ref = [x for b in DataLoader(make(), batch_size=4) for x in b.tolist()]
    loader = DataLoader(make(), batch_size=4, num_workers=2)
    head: list[int] = []
    state = None
    for b in loader:
        head += b.tolist()
        sd = loader.state_dict()
        if [w["exhausted"] for w in sd["workers"]] == [True, False]:
            state = load_state(dump_state(sd))
            break
    del loader
    assert state is not None
    cursors = state["workers"][0]["dataset_state"]
    assert any(c[1] == 0 for p, c in cursors.items() if p != "stream")  # looks unfinished
    drawn = {p: len(rows) for p, rows in per_partition(head).items()}
    level = max(drawn[0], drawn[2]) + 3  # past the dry partitions' rows: 8 each
    n = (level - drawn[1]) + (level - drawn[3])
    skipped = skip_samples(state, n)
    again = DataLoader(make(), batch_size=4, num_workers=2)
    again.load_state_dict(skipped)
    rest = [x for b in again for x in b.tolist()]
    del again
    want = per_partition(ref)
    for p in (1, 3):  # each live partition less the rows up to the level
        want[p] = want[p][: drawn[p]] + want[p][level:]
    assert per_partition(head + rest) == want


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_the_cli_skips_a_dcp_checkpoint_into_a_new_one_that_resumes_elsewhere(
    tmp_path: Path,
) -> None:
    """A 2-worker loader saved with torch.distributed.checkpoint (its global state), skipped by
    the CLI into a new directory, loaded by a loader with num_workers=0."""
    import torch.distributed.checkpoint as dcp

    ref = _ref(2, 3)
    loader = DataLoader(_make(), batch_size=3, num_workers=2)
    it = iter(loader)
    head: Run = [(0, next(it).tolist()) for _ in range(2)]
    dcp.save({"loader": loader}, checkpoint_id=str(tmp_path / "ckpt"))
    del it, loader
    assert main(["skip", str(tmp_path / "ckpt"), "--samples", "5", "-o", str(tmp_path / "o")]) == 0
    resumed = DataLoader(_make(), batch_size=3)
    dcp.load({"loader": resumed}, checkpoint_id=str(tmp_path / "o"))
    rest: Run = [(e, b.tolist()) for e in range(EPOCHS) for b in resumed]
    _check(ref, head, rest, 5)
