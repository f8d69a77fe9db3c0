"""The loader's segment pool (issue #26, ``transport.LoaderPool``).

The main process makes the shared segments, at most ``num_workers x prefetch_factor + 1``, and
lends one to each task it sends (a grant); the worker collates into it only if the caller no
longer holds the batch that was last in it (its flag byte). These tests check what that must
never change: a held batch is never overwritten, a worker killed while writing (or while
sending) a granted segment delivers nothing of it and the segment is given out again, and
nothing stays open or mapped afterwards -- and what it is for: the segments alive at once are
the prefetch window's and the caller's one batch, however many workers there are.

Segments are counted as test_memory.py does: by (device, inode) in ``/proc/<pid>/maps``, so a
segment mapped by the main process and by workers counts once.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, default_collate

from resumable_loader import DataLoader
from resumable_loader.pipeline import transport as _transport
from resumable_loader.pipeline.transport import framing, pools
from resumable_loader.testing import canonical, reference_stream, worker_pids

FLOATS = 32 * 1024  # 128 KiB a sample
BATCH = 8  # 1 MiB a batch: far above what is copied inline
PREFETCH = 2


class Big(Dataset):
    """Sample i: i everywhere but one random draw (a batch rebuilt with other random numbers,
    or overwritten by another batch, would differ)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.full((FLOATS,), float(i))
        x[0] = torch.rand(())
        return x


def make_loader(n_batches: int, workers: int = 2, **kw: Any) -> DataLoader:
    kw.setdefault("shuffle", True)
    return DataLoader(
        Big(n_batches * BATCH),
        batch_size=BATCH,
        num_workers=workers,
        prefetch_factor=PREFETCH if workers else None,
        generator=torch.Generator().manual_seed(26),
        **kw,
    )


def segments(pid: int) -> set[tuple[str, str]]:
    """(device, inode) of each of our shared segments process ``pid`` has mapped."""
    out = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/memfd:resumable_loader"):
                    out.add((parts[3], parts[4]))
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def pool_of(loader: DataLoader) -> _transport.LoaderPool:
    """The loader's segment pool (its persistent workers' supervisor's)."""
    pool = loader._pool.pool  # type: ignore[union-attr]
    assert pool is not None, "the loader made no segment pool"
    return pool


def assert_nothing_mapped() -> None:
    assert segments(os.getpid()) == set(), "a pooled segment is still mapped here"


# ---- a held batch is never overwritten ----------------------------------------------------------
@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("keep", ["all", "every-third"])
def test_held_batches_are_never_overwritten(workers: int, keep: str) -> None:
    """The caller keeps batches (all of them, or every third) while the loader goes on: the
    pool runs out of free segments and grants the held ones; no worker may write into a
    segment whose batch the caller still holds. Every batch, checked at the end of two epochs
    of persistent workers, equals the uninterrupted single-process run's."""
    n = 15
    reference = reference_stream(lambda: make_loader(n, workers=0), epochs=2)
    loader = make_loader(n, workers=workers, persistent_workers=True)
    held: list[list[torch.Tensor]] = []
    try:
        for _ in range(2):
            epoch = []
            for k, batch in enumerate(loader):
                if keep == "all" or k % 3 == 0:
                    epoch.append(batch)
            held.append(epoch)
        assert len(pool_of(loader).segments) <= workers * PREFETCH + 1
    finally:
        loader.close()
    for e in range(2):
        want = reference[e] if keep == "all" else reference[e][::3]
        assert [canonical(b) for b in held[e]] == want, f"epoch {e}: a held batch changed"
    del held, epoch, batch
    assert_nothing_mapped()


# ---- the peak: the window and the caller's batch ------------------------------------------------
@pytest.mark.parametrize("workers", [2, 4])
def test_segments_alive_are_the_window_and_the_held_batch(workers: int) -> None:
    """However many workers, the segments made over an epoch -- seen anywhere, counted by
    inode -- are exactly ``num_workers x prefetch_factor + 1``: the tasks in flight and the
    batch the caller holds. (A pool per worker made ``num_workers x (prefetch_factor + 1)``,
    and more for the first batches.)"""
    n = 40
    window = workers * PREFETCH
    loader = make_loader(n, workers=workers)
    ever: set[tuple[str, str]] = set()
    batches = 0
    try:
        for batch in loader:
            batches += 1
            assert batch.shape == (BATCH, FLOATS)
            for pid in [os.getpid(), *worker_pids(loader)]:
                if pid > 0:
                    ever |= segments(pid)
            # Given back before the next one is asked for, so that no worker ever finds its
            # granted segment still held and takes a fresh one (that race is bench_memory's).
            del batch
    finally:
        loader.close()
    assert batches == n
    assert len(ever) == window + 1, f"{len(ever)} segments over the epoch, window {window}"
    assert_nothing_mapped()


# ---- a worker killed while writing or sending a granted segment ---------------------------------
class KillInGrantedSegment:
    """A collate_fn that, the first time it collates a batch into a segment granted by the
    loader at or after batch ``after`` (by its first sample), scribbles over half of it and
    SIGKILLs its worker -- once: a marker file says it happened."""

    def __init__(self, after: int, marker: str) -> None:
        self.after = after
        self.marker = marker

    def __call__(self, items: list[torch.Tensor]) -> torch.Tensor:
        batch = default_collate(items)
        pool = pools._worker_pool
        granted = pool is not None and pool.granted and pool.where(batch.untyped_storage()) >= 0
        if granted and int(batch[0, 1]) >= self.after * BATCH and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            batch[: len(batch) // 2] = -1.0
            os.kill(os.getpid(), signal.SIGKILL)
        return batch


def test_a_worker_killed_while_writing_a_granted_segment_delivers_nothing_of_it(
    tmp_path: Path,
) -> None:
    """The respawned worker builds the batch again; the segment the dead one was writing is
    granted again and rewritten whole. Every batch -- the ones the caller keeps included --
    equals the uninterrupted run's, and nothing stays mapped."""
    n = 16
    reference = reference_stream(lambda: make_loader(n, shuffle=False))[0]
    marker = tmp_path / "killed"
    loader = make_loader(n, shuffle=False, collate_fn=KillInGrantedSegment(6, str(marker)))
    try:
        got = []
        kept = []
        for k, batch in enumerate(loader):
            got.append(canonical(batch))
            if k % 4 == 0:
                kept.append(batch)
        stats = loader.statistics()
    finally:
        loader.close()
    assert marker.exists(), "no worker was killed in a granted segment: the test proves nothing"
    assert stats.respawns == 1
    assert got == reference
    assert [canonical(b) for b in kept] == reference[::4]
    del kept, batch
    assert_nothing_mapped()


def die_while_sending_a_granted_batch(worker_id: int) -> None:
    """worker_init_fn: in the first incarnation of worker 0, SIGKILL the worker as it sends
    its third batch that lies in a granted segment -- after the segment's flag was set (it is
    lent to the caller), before a byte of the message went out."""
    marker = os.environ["POOL_TEST_MARKER"]
    if worker_id != 0 or os.path.exists(marker):
        return
    send_frame = framing._send_frame
    seen = [0]

    def dying_send_frame(sock: Any, payload: Any, body_len: int, fds: Any, *tag: Any) -> None:
        pool = pools._worker_pool
        seg = pool.target if pool is not None and pool.granted else None
        if seg is not None and seg.size and seg.lent:
            seen[0] += 1
            if seen[0] == 3:
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        send_frame(sock, payload, body_len, fds, *tag)

    framing._send_frame = dying_send_frame


def test_a_worker_killed_after_lending_a_segment_gets_nothing_stuck(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker sets a segment's flag (lent to the caller) just before it sends the batch; one
    killed in between leaves the flag set with no batch anywhere. Its death must give the
    segment back: after the epoch, with every batch dropped, no segment of the pool counts as
    held (a stuck one would never be granted again: a fresh segment per batch from then on).
    The stream equals the uninterrupted run's."""
    n = 16
    reference = reference_stream(lambda: make_loader(n))[0]
    marker = tmp_path / "killed"
    monkeypatch.setenv("POOL_TEST_MARKER", str(marker))
    loader = make_loader(
        n,
        persistent_workers=True,
        worker_init_fn=die_while_sending_a_granted_batch,
        multiprocessing_context="fork",
    )
    try:
        got = [canonical(b) for b in loader]
        stats = loader.statistics()
        assert marker.exists(), "no worker died while sending: the test proves nothing"
        assert stats.respawns == 1
        pool = pool_of(loader)
        held = [s.id for s in pool.segments.values() if s.held]
        assert held == [], f"segments {held} still count as held with no batch alive"
        assert not pool.grants, f"grants outstanding after the epoch: {pool.grants}"
    finally:
        loader.close()
    assert got == reference
    assert_nothing_mapped()


# ---- failures of the main process: nothing stays open or mapped ---------------------------------
class Boom(Exception):
    pass


@pytest.mark.parametrize(
    "how, method",
    [
        *((how, "fork") for how in ("raise", "del-loader", "break-then-next-epoch")),
        ("break-then-next-epoch", "spawn"),
        ("del-loader", "forkserver"),
    ],
)
def test_nothing_stays_after_the_main_process_stops_mid_epoch(how: str, method: str) -> None:
    """An exception in the caller's loop, ``del loader`` mid-epoch, or a ``break`` followed by
    a whole epoch of the same persistent workers: the batches are right (the next epoch's
    too), and once the loader and every batch are gone no fd (conftest's check) and no
    mapping of a pooled segment is left -- without the garbage collector."""
    n = 12
    persistent = how == "break-then-next-epoch"
    reference = reference_stream(lambda: make_loader(n, workers=0), epochs=2)
    loader = make_loader(n, persistent_workers=persistent, multiprocessing_context=method)
    kept = None
    if how == "raise":
        with pytest.raises(Boom):
            for k, batch in enumerate(loader):
                if k == 5:
                    kept = batch
                    raise Boom
        del batch
        loader.close()
    elif how == "del-loader":
        it = iter(loader)
        for _ in range(6):
            kept = next(it)
        del it, loader
    else:
        for k, batch in enumerate(loader):
            if k == 5:
                kept = batch
                break
        del batch
        assert [canonical(b) for b in loader] == reference[1]
        loader.close()
    assert kept is not None and canonical(kept) == reference[0][5]
    assert segments(os.getpid()), "the held batch's segment should still be mapped"
    del kept
    assert_nothing_mapped()
