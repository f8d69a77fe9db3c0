"""Soak: 20,000 batches with a worker SIGKILLed every 50 batches; nothing may change or leak.

    python fuzz/soak.py [--batches 20000] [--kill-every 50] [--start-method fork]

Compares every delivered batch with the uninterrupted reference (num_workers=0: a batch's
values do not depend on the workers), and prints lost, duplicated and changed batches (must be
0) and RSS, open fds, child processes and /dev/shm entries at the start and at the end (must not
grow). Exits 1 if anything is wrong.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from collections import Counter

import psutil
import torch
from _leaks import shm_entries
from torch.utils.data import Dataset

from resumable_loader import DataLoader
from resumable_loader.testing import canonical, worker_pids

N = 1000  # samples per epoch


class Augmented(Dataset):
    """Tiny items with random augmentations from python, numpy and torch RNGs."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        import numpy as np

        return torch.tensor(
            [
                i,
                random.randint(0, 10**6),
                int(np.random.randint(0, 10**6)),
                int(torch.randint(0, 10**6, ())),
            ]
        )


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
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=20000)
    p.add_argument("--kill-every", type=int, default=50)
    p.add_argument("--start-method", default="fork")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2)
    args = p.parse_args()

    def make(num_workers: int) -> DataLoader:
        kw = {}
        if num_workers:
            kw = dict(multiprocessing_context=args.start_method, persistent_workers=True)
        return DataLoader(
            Augmented(),
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
    reference = [[canonical(b) for b in ref_loader] for _ in range(epochs)]
    print(f"reference: {epochs} epochs of {per_epoch} batches in {time.monotonic() - t0:.1f} s")

    loader = make(args.workers)
    lost = duplicated = changed = kills = 0
    start = end = None
    delivered = 0
    t0 = time.monotonic()
    for epoch in range(epochs):
        got = []
        for batch in loader:
            got.append(canonical(batch))
            delivered += 1
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
    for k in ("rss_mb", "fds", "children", "shm"):
        print(f"{k:10}{start[k]:>8}{end[k]:>8}{after[k]:>8}")
    bad = lost or duplicated or changed
    for k in ("fds", "children", "shm"):
        bad = bad or end[k] > start[k] or after[k] > start[k]
    bad = bad or end["rss_mb"] > start["rss_mb"] + 100  # allocator noise, not a per-kill leak
    print("FAIL" if bad else "OK")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
