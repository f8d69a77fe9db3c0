"""Soak: 20,000 batches with a worker SIGKILLed every 50 batches; nothing may change or leak.

    python fuzz/soak.py [--batches 20000] [--kill-every 50] [--start-method fork]
                        [--payload-kib 64] [--sharing-strategy file_descriptor]

Compares every delivered batch with the uninterrupted reference (num_workers=0: a batch's
values do not depend on the workers), and prints lost, duplicated and changed batches (must be
0) and RSS, open fds, child processes and /dev/shm entries at the start and at the end (must not
grow). Exits 1 if anything is wrong.

Each sample carries ``--payload-kib`` of pixels besides its tiny random augmentations, so a
batch is well above the 32 KiB the transport copies inline and travels through /dev/shm (0:
tiny batches only, all inline). The soak then also watches shared memory, which must not pile
up, kills or not: the most segments any worker has mapped (at most the one batch it builds), the
most the main process has mapped once the loop has dropped its batch (at most the prefetch
window), and /dev/shm's use at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import sys
import time
from collections import Counter
from typing import Any

import psutil
import torch
from _leaks import shm_entries
from torch.utils.data import Dataset

from resumable_loader import DataLoader
from resumable_loader.testing import canonical, worker_pids

N = 1000  # samples per epoch
PREFETCH = 2  # the loader's prefetch_factor (torch's default, said here for the bound below)


class Augmented(Dataset):
    """Tiny items with random augmentations from python, numpy and torch RNGs; with
    ``payload_floats``, a dict that also holds that many float32 "pixels" (seeded noise)."""

    def __init__(self, payload_floats: int = 0) -> None:
        self.payload_floats = payload_floats

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        import numpy as np

        aug = torch.tensor(
            [
                i,
                random.randint(0, 10**6),
                int(np.random.randint(0, 10**6)),
                int(torch.randint(0, 10**6, ())),
            ]
        )
        if not self.payload_floats:
            return aug
        return {"aug": aug, "pixels": torch.rand(self.payload_floats)}


def fingerprint(batch: Any) -> Any:
    """The batch, exactly comparable: tiny tensors by value, the pixels by a digest."""
    if isinstance(batch, dict):
        digest = hashlib.sha1(batch["pixels"].numpy().tobytes()).hexdigest()
        return (canonical(batch["aug"]), digest)
    return canonical(batch)


def shm_mapped(pid: int) -> int:
    """torch /dev/shm segments process ``pid`` has mapped (deleted ones included)."""
    seen = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/dev/shm/torch_"):
                    seen.add((parts[3], parts[4]))
    except (FileNotFoundError, ProcessLookupError):
        pass  # a worker just killed
    return len(seen)


def shm_used_mb() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return -1
    return (st.f_blocks - st.f_bfree) * st.f_frsize // 2**20


def _helper(child: psutil.Process) -> bool:
    """multiprocessing's own fork server / resource tracker: not the loader's children."""
    try:
        cmd = " ".join(child.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
        return False  # a zombie is a child not reaped yet: it counts
    return "forkserver" in cmd or "resource_tracker" in cmd


def snapshot() -> dict[str, int]:
    me = psutil.Process()
    kids = [c for c in me.children(recursive=True) if not _helper(c)]
    shm = len(shm_entries())  # all of /dev/shm, not only torch's segments
    return {
        "rss_mb": me.memory_info().rss // 2**20,
        "fds": len(os.listdir("/proc/self/fd")),
        "children": len(kids),
        "shm": shm,
        "shm_used_mb": shm_used_mb(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=20000)
    p.add_argument("--kill-every", type=int, default=50)
    p.add_argument("--start-method", default="fork")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument(
        "--payload-kib",
        type=int,
        default=64,
        help="pixels per sample, KiB (default 64: batches above the inline size; 0: tiny)",
    )
    p.add_argument("--sharing-strategy", choices=("file_descriptor", "file_system"), default=None)
    args = p.parse_args()
    if args.sharing_strategy:
        torch.multiprocessing.set_sharing_strategy(args.sharing_strategy)
    if torch.multiprocessing.get_sharing_strategy() == "file_system":
        # Start this process's shm manager now, for the workers to share: otherwise each
        # (re)spawned worker starts its own and torch keeps a socket to each open in this
        # process for good -- torch's own fds, which the fd check below would count.
        torch.UntypedStorage._new_shared(64)
    payload_floats = args.payload_kib * 1024 // 4

    def make(num_workers: int) -> DataLoader:
        kw: dict[str, Any] = {}
        if num_workers:
            kw = dict(
                multiprocessing_context=args.start_method,
                persistent_workers=True,
                prefetch_factor=PREFETCH,
            )
        return DataLoader(
            Augmented(payload_floats),
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(7),
            **kw,
        )

    per_epoch = -(-N // args.batch_size)
    epochs = -(-args.batches // per_epoch)
    t0 = time.monotonic()
    ref_loader = make(0)
    reference = [[fingerprint(b) for b in ref_loader] for _ in range(epochs)]
    print(f"reference: {epochs} epochs of {per_epoch} batches in {time.monotonic() - t0:.1f} s")

    loader = make(args.workers)
    lost = duplicated = changed = kills = 0
    start = end = None
    delivered = 0
    t0 = time.monotonic()
    worker_segments = main_segments = 0  # the most seen mapped at once
    main_base = shm_mapped(os.getpid())
    for epoch in range(epochs):
        got = []
        for batch in loader:
            got.append(fingerprint(batch))
            delivered += 1
            for pid in worker_pids(loader):
                if pid > 0:
                    worker_segments = max(worker_segments, shm_mapped(pid))
            del batch
            main_segments = max(main_segments, shm_mapped(os.getpid()) - main_base)
            if start is None:
                start = snapshot()
            # (Not after the last batch: nothing would be left to notice that death.)
            if delivered % args.kill_every == 0 and delivered < args.batches:
                pids = [pid for pid in worker_pids(loader) if pid > 0]
                if pids:
                    os.kill(pids[kills % len(pids)], signal.SIGKILL)
                    kills += 1
            if delivered >= args.batches:
                break
        ref = reference[epoch][: len(got)] if delivered >= args.batches else reference[epoch]
        a, b = Counter(map(repr, got)), Counter(map(repr, ref))
        lost += sum((b - a).values())
        duplicated += sum((a - b).values())
        changed += sum(1 for x, y in zip(got, ref) if x != y)
        if delivered >= args.batches:
            break
    end = snapshot()
    assert start is not None, "no batch was delivered"
    stats = loader.statistics()
    loader.close()
    after = snapshot()
    wall = time.monotonic() - t0
    print(
        f"{delivered} batches, {kills} workers SIGKILLed, {wall:.1f} s "
        f"({wall / delivered * 1e3:.2f} ms/batch); respawns {dict(stats.respawns_by_cause)}"
    )
    print(f"lost {lost}, duplicated {duplicated}, changed {changed}  (must all be 0)")
    print(f"{'':10}{'start':>8}{'end':>8}{'closed':>8}")
    for k in ("rss_mb", "fds", "children", "shm", "shm_used_mb"):
        print(f"{k:12}{start[k]:>8}{end[k]:>8}{after[k]:>8}")
    # A worker maps only the batch it is building: its tensors, each collated into a segment
    # of its own (the tiny augmentations too; they are then copied inline, so the main process
    # maps only the pixels). The main process, with the loop's batch dropped, maps only the
    # results in the prefetch window. A worker respawned by fork also inherits what the main
    # process had mapped at that moment (at most the window), and keeps it for its life.
    window = PREFETCH * args.workers
    per_batch = 2 if payload_floats else 1
    worker_bound = per_batch + (window if kills else 0)
    main_bound = window if payload_floats else 0
    print(
        f"segments mapped, most seen: a worker {worker_segments} (bound {worker_bound}), "
        f"the main process {main_segments} (bound {main_bound})"
    )
    bad = lost or duplicated or changed
    # Under file_system the batches in flight have names in /dev/shm: their number at the end
    # is the window's, not a leak; after close() none may be left.
    named = torch.multiprocessing.get_sharing_strategy() == "file_system"
    for k in ("fds", "children", "shm"):
        bad = bad or (end[k] > start[k] and not (named and k == "shm")) or after[k] > start[k]
    bad = bad or end["rss_mb"] > start["rss_mb"] + 100  # allocator noise, not a per-kill leak
    bad = bad or worker_segments > worker_bound or main_segments > main_bound
    # Shared memory in use may not grow over the run (others' use of /dev/shm can move it a
    # little; a leak of 100+ KiB per batch over thousands of batches cannot hide in 64 MiB).
    bad = bad or after["shm_used_mb"] > start["shm_used_mb"] + 64
    print("FAIL" if bad else "OK")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
