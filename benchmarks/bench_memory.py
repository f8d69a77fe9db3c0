"""Peak memory of resumable_loader.DataLoader against torch.utils.data.DataLoader (issue #16).

Workloads (2 workers, prefetch_factor 2, fork; fresh loaders every run, ours and torch's
alternated in one process, the order rotated every round):

- image: 32 x 3x224x224 float32 per batch (18.4 MiB), items filled with their index; the loop
  reads every batch (``batch.sum()``, as a copy to the GPU would). Each batch travels through
  /dev/shm.
- small: batches of 64 x 64 float32 (16 KiB, copied inline through the socket by ours).

From the first batch on (before it, the main process's pages are not yet shared with forked
workers, and its PSS is that of a process alone), a sampler thread in this process reads every
SAMPLE_S: the PSS of this process and of each live worker (``psutil memory_full_info().pss``: a
page mapped by n processes counts 1/n in each, so PSS adds up across processes without counting
a shared batch twice), the use of /dev/shm (``os.statvfs``, less its use before the run), and
the shared memory the job holds ("shared": every shared-memory file mapped or open in this
process or a worker, /dev/shm and memfd alike, counted once per inode by its allocated bytes).
Since our workers' segments are memfds (``resumable_loader.pipeline.transport.memfd``),
which /dev/shm's statvfs does not see, "shared" is the figure that compares the loaders;
"/dev/shm" says what each leaves in the shared tmpfs. Reported: the peaks over the epoch --
main, workers (summed), all of them together (summed at the same instant: the run's real
footprint), /dev/shm and shared -- and the per-round ratios ours/torch (median). The issue's
goal: within 1.1x of torch.

Then the cost of the fallback path -- a batch copied through the result socket because /dev/shm
is full -- against the shared-memory path:

- transport alone: a forked sender builds and sends image batches (in shared memory, as
  default_collate does in a worker; or in ordinary memory, copied inline) to this process,
  which receives and drops them: wall time per batch, and CPU time per batch of this process
  (the pipeline's serial stage) and of the sender;
- whole loader: the image epoch with ``testing.ShmFailure`` (every shared-memory allocation in
  the workers fails) against the same epoch without it, per batch.

/dev/shm is shared by everything on the machine: other processes using it during the run move
the /dev/shm figures (the PSS figures are this run's own).

Run: python3 benchmarks/bench_memory.py [--quick] [--rounds N] [--workloads image,small]
[--workers N]
Exits non-zero only if a loader delivered the wrong number of batches.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import threading
import time
from typing import Any

import _common as C
import psutil
import torch
from torch.utils.data import Dataset

SAMPLE_S = 0.005
WORKERS = 2
PREFETCH = 2
MiB = 2**20


class ImageDataset(Dataset):
    """Item i: a 3x224x224 float32 image filled with i (no decoding cost: memory is the point)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 224, 224), float(i))


class SmallDataset(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((64,), float(i))


WORKLOADS: dict[str, dict[str, Any]] = {
    "image": {"dataset": ImageDataset, "batch": 32, "batches": 60, "quick": 16},
    "small": {"dataset": SmallDataset, "batch": 64, "batches": 600, "quick": 150},
}


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


_SHARED_MARKS = ("/dev/shm/", "/memfd:")


def shared_files(pid: int, into: dict[tuple[int, int], int]) -> None:
    """Add the shared-memory files ``pid`` holds -- mapped or open, named in /dev/shm or
    anonymous (``memfd``), unlinked ones included -- to ``into``: (device, inode) -> bytes
    allocated. Counted by inode, a segment mapped or held by several processes counts once.

    Why not /dev/shm's ``statvfs`` alone: our workers' segments are memfds, which live in the
    kernel's internal tmpfs, not in /dev/shm; ``statvfs`` would show ours at 0 and compare
    nothing. (Needs to read /proc/PID/map_files: root, or the same user with CAP_SYS_ADMIN on
    older kernels; where it cannot, the mappings without an open fd are missed.)
    """
    paths = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if "/dev/shm/" in line or "/memfd:" in line:
                    paths.append(f"/proc/{pid}/map_files/{line.split(None, 1)[0]}")
        for fd in os.listdir(f"/proc/{pid}/fd"):
            path = f"/proc/{pid}/fd/{fd}"
            try:
                target = os.readlink(path)
            except OSError:
                continue
            if target.startswith(_SHARED_MARKS):
                paths.append(path)
    except OSError:
        return  # the process is gone
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        into[(st.st_dev, st.st_ino)] = st.st_blocks * 512


def shared_held(pids: list[int]) -> int:
    """Bytes of shared memory held by ``pids`` together (see ``shared_files``)."""
    files: dict[tuple[int, int], int] = {}
    for pid in pids:
        shared_files(pid, files)
    return sum(files.values())


def pss(pid: int) -> int:
    try:
        return int(psutil.Process(pid).memory_full_info().pss)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return 0


class Sampler(threading.Thread):
    """Peaks of main PSS, summed worker PSS and /dev/shm use, sampled every SAMPLE_S."""

    def __init__(self) -> None:
        super().__init__(name="bench-memory-sampler", daemon=True)
        self.stop = threading.Event()
        self.main_pss = self.workers_pss = self.total_pss = self.shm = self.shared = 0
        self.shm_base = shm_used()

    def sample(self) -> None:
        main = pss(os.getpid())
        pids = C.worker_pids()
        workers = sum(pss(p) for p in pids)
        self.shared = max(self.shared, shared_held([os.getpid(), *pids]))
        self.main_pss = max(self.main_pss, main)
        self.workers_pss = max(self.workers_pss, workers)
        self.total_pss = max(self.total_pss, main + workers)
        self.shm = max(self.shm, shm_used() - self.shm_base)

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            self.sample()

    def finish(self) -> None:
        self.sample()
        self.stop.set()
        self.join()


def run_epoch(loader_cls: type, workload: str, n_batches: int, **kw: Any) -> dict[str, float]:
    spec = WORKLOADS[workload]
    sampler = Sampler()
    t0 = time.perf_counter()
    loader = loader_cls(
        spec["dataset"](n_batches * spec["batch"]),
        batch_size=spec["batch"],
        num_workers=WORKERS,
        prefetch_factor=PREFETCH,
        **kw,
    )
    n = 0
    try:
        for batch in loader:
            float(batch.sum())  # the training step reads the batch
            n += 1
            if n == 1:
                sampler.start()
        del batch
    finally:
        if sampler.is_alive():
            sampler.finish()
        C.close_loader(loader)
    if n != n_batches:
        print(f"ERROR: {loader_cls.__module__} delivered {n} batches, expected {n_batches}")
        sys.exit(1)
    return {
        "epoch_s": time.perf_counter() - t0,
        "main_pss_mib": sampler.main_pss / MiB,
        "workers_pss_mib": sampler.workers_pss / MiB,
        "total_pss_mib": sampler.total_pss / MiB,
        "shm_mib": sampler.shm / MiB,
        "shared_mib": sampler.shared / MiB,
    }


FIGURES = ("main_pss_mib", "workers_pss_mib", "total_pss_mib", "shm_mib", "shared_mib", "epoch_s")


def compare(workloads: list[str], rounds: int, quick: bool) -> dict[str, Any]:
    ours = C.loader_api().DataLoader
    theirs = C.torch_loader()
    rows, summary = [], {}
    for w in workloads:
        n = WORKLOADS[w]["quick" if quick else "batches"]
        runs = C.alternate(
            {
                "ours": functools.partial(run_epoch, ours, w, n),
                "torch": functools.partial(run_epoch, theirs, w, n),
            },
            rounds,
            budget_s=60 if quick else 150,
        )
        med = {name: {k: C.median([r[k] for r in runs[name]]) for k in FIGURES} for name in runs}
        ratios = {k: C.median(C.per_round_ratio(runs, "ours", "torch", k)) for k in FIGURES}
        for name in ("torch", "ours"):
            rows.append([w, name, *(med[name][k] for k in FIGURES)])
        rows.append([w, "ours/torch", *(ratios[k] for k in FIGURES)])
        summary[w] = {"median": med, "ratio": ratios, "rounds": len(runs["ours"])}
    print()
    print("peaks over one epoch (median of the rounds); ratio rows: median of the per-round ratios")
    C.print_table(
        [
            "workload",
            "loader",
            "main PSS MiB",
            "workers PSS MiB",
            "all PSS MiB",
            "/dev/shm MiB",
            "shared MiB",
            "epoch s",
        ],
        rows,
        digits=2,
    )
    return summary


# ---- the fallback path's cost -------------------------------------------------------------------
def _sender(sock: socket.socket, n: int, nbytes: int, shared: bool) -> None:
    """Child: build n batches as a worker would and send them; shared=False: inline copies."""
    from resumable_loader.pipeline import transport as _transport

    policy = _transport.ShmPolicy()
    for i in range(n):
        if shared:
            storage = torch.UntypedStorage._new_shared(nbytes)  # as default_collate in a worker
            batch = torch.empty(0).set_(storage).view(-1)
        else:
            batch = torch.empty(nbytes // 4)
        batch.fill_(float(i))
        _transport.send(sock, ("batch", batch), policy, shared)
        del batch
    sock.close()


def transport_cost(n: int, nbytes: int, shared: bool) -> dict[str, float]:
    from resumable_loader.pipeline import transport as _transport

    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the sender: runs _sender and exits without returning into this script
        code = 1
        try:
            ours.close()
            # As in a worker: the parent's intra-op thread pool does not survive fork (a
            # parallel fill_ in the child would wait forever on it).
            torch.set_num_threads(1)
            _sender(theirs, n, nbytes, shared)
            code = 0
        finally:
            os._exit(code)
    theirs.close()
    receiver = _transport.Receiver(ours)
    import select

    got = 0
    c0, t0 = time.process_time(), time.perf_counter()
    while not receiver.eof:
        if not select.select([receiver], [], [], 60.0)[0]:
            os.kill(pid, 9)  # a sender silent for a minute is stuck: end it, report below
            os.waitpid(pid, 0)
            receiver.close()
            print(f"ERROR: the sender stopped after {got} of {n} batches")
            sys.exit(1)
        for msg in receiver.feed():
            float(msg[1][0])  # touch it
            got += 1
            del msg
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    _, status, usage = os.wait4(pid, 0)
    receiver.close()
    if got != n or status != 0:
        print(f"ERROR: transport delivered {got} of {n} batches (sender status {status})")
        sys.exit(1)
    return {
        "wall_ms": wall / n * 1e3,
        "main_cpu_ms": cpu / n * 1e3,
        "sender_cpu_ms": (usage.ru_utime + usage.ru_stime) / n * 1e3,
    }


def fallback_cost(rounds: int, quick: bool) -> dict[str, Any]:
    import warnings

    from resumable_loader.pipeline.transport import policy as shm_policy
    from resumable_loader.testing import ShmFailure

    nbytes = 32 * 3 * 224 * 224 * 4
    n = 40 if quick else 150
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fallback's warning, expected here
        t_runs = C.alternate(
            {
                "shm": lambda: transport_cost(n, nbytes, True),
                "inline": lambda: transport_cost(n, nbytes, False),
            },
            rounds,
            budget_s=40 if quick else 90,
        )
    ours = C.loader_api().DataLoader
    n_batches = WORKLOADS["image"]["quick" if quick else "batches"]

    def full_shm_epoch() -> dict[str, float]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the fallback's own warning
            shm_policy._shm_warned = False
            return run_epoch(ours, "image", n_batches, worker_init_fn=ShmFailure())

    l_runs = C.alternate(
        {"shm": lambda: run_epoch(ours, "image", n_batches), "inline": full_shm_epoch},
        rounds,
        budget_s=60 if quick else 120,
    )
    rows = []
    out: dict[str, Any] = {}
    for path in ("shm", "inline"):
        t = {k: C.median([r[k] for r in t_runs[path]]) for k in t_runs[path][0]}
        epoch = C.median([r["epoch_s"] for r in l_runs[path]]) / n_batches * 1e3
        main_pss = C.median([r["main_pss_mib"] for r in l_runs[path]])
        shm = C.median([r["shm_mib"] for r in l_runs[path]])
        rows.append(
            [path, t["wall_ms"], t["main_cpu_ms"], t["sender_cpu_ms"], epoch, main_pss, shm]
        )
        out[path] = {**t, "loader_ms_per_batch": epoch, "main_pss_mib": main_pss, "shm_mib": shm}
    d = [b - a for a, b in zip(rows[0][1:], rows[1][1:])]
    rows.append(["inline - shm", *d])
    print()
    print(
        f"the fallback path, per 18.4 MiB batch: transport alone ({n} batches, sender forked), "
        f"and the whole loader (image epoch, {n_batches} batches; inline = every shared-memory "
        "allocation in the workers fails)"
    )
    C.print_table(
        [
            "path",
            "transport wall ms",
            "main CPU ms",
            "sender CPU ms",
            "loader ms/batch",
            "main PSS MiB",
            "/dev/shm MiB",
        ],
        rows,
        digits=2,
    )
    return out


def main() -> int:
    global WORKERS
    p = C.base_parser(__doc__.splitlines()[0], start_method=False)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", default="image,small")
    p.add_argument("--no-fallback", action="store_true", help="skip the fallback-cost part")
    p.add_argument("--workers", type=int, default=WORKERS, help="num_workers (default 2)")
    args = C.parse(p)
    WORKERS = args.workers
    print(C.env_line("fork"))
    api = C.loader_api()
    print(
        f"ours: {api.name}; {WORKERS} workers, prefetch_factor {PREFETCH}; /dev/shm "
        f"{os.statvfs('/dev/shm').f_blocks * os.statvfs('/dev/shm').f_frsize / MiB:.0f} MiB, "
        f"{shm_used() / MiB:.1f} MiB in use at start"
    )
    workloads = [w for w in args.workloads.split(",") if w]
    summary: dict[str, Any] = {"memory": compare(workloads, args.rounds, args.quick)}
    if not args.no_fallback and not api.selftest:
        summary["fallback"] = fallback_cost(args.rounds, args.quick)
    C.emit_summary("memory", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
