"""A worker's batches live in shared memory with no name (``_shm``): a worker killed at any
moment leaves nothing in /dev/shm, and nothing there is ever deleted by us."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch.utils.data import Dataset

from resumable_loader import DataLoader
from resumable_loader.pipeline.transport.memfd import new_anonymous_shared
from resumable_loader.testing import Resources, canonical, kill_at, leaks_since

MiB = 1 << 20


def _torch_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("torch_")}


def test_an_anonymous_segment_is_shared_memory_with_no_name() -> None:
    before = _torch_names()
    s = new_anonymous_shared(MiB)
    t = torch.empty(0, dtype=torch.uint8).set_(s)
    t.fill_(5)
    fd, size = s._share_fd_cpu_()
    # Another mapping of the same memory, as the main process makes it from the fd.
    other = torch.UntypedStorage._new_shared_fd_cpu(fd, size)
    assert size == MiB and s.is_shared()
    assert torch.empty(0, dtype=torch.uint8).set_(other)[:3].tolist() == [5, 5, 5]
    assert _torch_names() == before


class _Big(Dataset):
    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((MiB // 4,), float(i))  # 1 MiB a sample: batches of 4 MiB


def _mapped_from(address: int) -> str:
    """The file behind the mapping that holds ``address`` in this process (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *rest = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return rest[-1].strip() if len(rest) == 5 else ""
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_batch_from_a_worker_lives_in_a_memfd_not_in_dev_shm() -> None:
    # torch's allocator would map /dev/shm/torch_<pid>_... (named until it unlinks it); ours is
    # an anonymous memory file, which has no name in /dev/shm at any moment.
    loader = DataLoader(_Big(), batch_size=4, num_workers=1)
    batch = next(iter(loader))
    where = _mapped_from(batch.data_ptr())
    del batch
    loader.close()
    assert where.startswith("/memfd:resumable_loader"), where


def _stack_privately(samples: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(samples)  # a collate_fn whose output is not in shared memory


@pytest.mark.parametrize(
    "how",
    [
        pytest.param(dict(batch_size=None), id="the-sample-itself"),
        pytest.param(dict(batch_size=4, collate_fn=_stack_privately), id="own-collate"),
    ],
)
def test_a_batch_made_outside_shared_memory_still_travels_in_a_memfd(how: dict) -> None:
    # The worker's batch is in its private memory: torch's _share_fd_cpu_ would move it into a
    # segment of its own making, named in /dev/shm until it unlinks it (a kill in between leaves
    # the name); it is copied into an anonymous one instead, as a collate's output is made.
    loader = DataLoader(_Big(), num_workers=1, **how)
    batch = next(iter(loader))
    where = _mapped_from(batch.data_ptr())
    del batch
    loader.close()
    assert where.startswith("/memfd:resumable_loader"), where


def test_workers_killed_mid_epoch_again_and_again_leave_no_name_in_dev_shm() -> None:
    # Under torch's allocator a kill between its shm_open() and unlink() leaves a name behind
    # (measured: ~6% of random kills with 1 MiB batches). Ours has no name to leave: the
    # stream is the uninterrupted one and /dev/shm holds no name of our workers after 24 kills.
    def make() -> DataLoader:
        return DataLoader(_Big(), batch_size=4, num_workers=2, max_task_attempts=10)

    ref = make()
    want = [canonical(b) for b in ref]
    ref.close()
    before = Resources.now()
    loader = make()
    plan = {n: [(n % 2, signal.SIGKILL)] for n in range(len(want) - 1)}
    got = [canonical(b) for b in kill_at(loader, plan)]
    assert loader.statistics().respawns >= 6  # a kill may land on a worker already dying
    loader.close()
    assert got == want
    # Judged as the suite's leak check judges: /dev/shm is the machine's, and another job's
    # names may appear meanwhile.
    assert [p for p in leaks_since(before) if p.startswith("/dev/shm")] == []
