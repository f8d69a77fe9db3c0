"""A real Ctrl-C, and the usual SIGTERM preemption handler, in a child training process.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the training process
and every worker. Here a child Python process runs in its own session (``start_new_session``),
iterates a loader with two workers, appends each batch's sample ids to a file, and says on a
pipe when it has consumed k batches; the parent then sends SIGINT to the whole group with
``os.killpg``, exactly what a terminal does. The child catches ``KeyboardInterrupt`` outside
its loop, saves ``loader.state_dict()`` with ``torch.save``, writes its loader's
``statistics()``, and exits. The SIGTERM rows install the usual cluster-preemption handler (a
flag that the loop checks; it breaks at the next step) and signal the child alone.

Asserted: the child consumed exactly what it reported; no worker printed a traceback or a
``KeyboardInterrupt``; no process of the group is left; no worker was counted or logged as
crashed or respawned; and a fresh loader given the saved state continues the stream exactly
(values included) as an uninterrupted run.

Synchronisation is by the child's pipe and its exit, never by sleeping; every wait is bounded
and the whole group is SIGKILLed in a ``finally``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from _datasets import RandomAugDataset

from resumable_loader import DataLoader
from resumable_loader.testing import canonical, reference_stream

N = 16
BATCH = 2
K = 3  # batches the child consumes before it is signalled (0 in the worker-start rows)
SEED = 77
READY_S = 90.0  # a spawn start imports torch twice on a loaded two-core machine
EXIT_S = 60.0
GROUP_GONE_S = 10.0

CHILD = r"""
import json, logging, os, select, signal, sys

# A terminal's Python starts with SIGINT raising KeyboardInterrupt. A test run started in the
# background without job control (`bash .ci/run &`, nohup) has SIGINT ignored, and a process it
# starts keeps it ignored: this child would never see the Ctrl-C it is about to get.
signal.signal(signal.SIGINT, signal.default_int_handler)

import torch
from _datasets import RandomAugDataset

from resumable_loader import DataLoader
from resumable_loader.testing import Fault, FaultyDataset

cfg = json.loads(sys.argv[1])
out = cfg["out"]
if cfg["method"] == "forkserver":
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "resumable_loader"])

handler = logging.FileHandler(os.path.join(out, "log"))
handler.setLevel(logging.INFO)
logger = logging.getLogger("resumable_loader")
logger.setLevel(logging.INFO)
logger.addHandler(handler)

# The preemption handler only sets a flag: a handler that takes a lock (threading.Event.set)
# deadlocks when the signal lands while the main thread holds that same lock, as it does for a
# few instructions inside Event.wait(). The "training step" below waits on the C-level wakeup
# fd instead, which any thread that receives the signal writes to.
preempted = False
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
if cfg["mode"] == "sigterm":

    def on_sigterm(signum, frame):
        global preempted
        preempted = True

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.set_wakeup_fd(wake_w)

dataset = RandomAugDataset(cfg["n"])
if cfg["hang"] is not None:
    # The first fetch of this sample never returns: next() waits for it when Ctrl-C comes.
    dataset = FaultyDataset(dataset, {cfg["hang"]: Fault("hang")}, out)
loader = DataLoader(
    dataset,
    batch_size=cfg["batch"],
    shuffle=True,
    num_workers=2,
    persistent_workers=cfg["persistent"],
    multiprocessing_context=cfg["method"],
    generator=torch.Generator().manual_seed(cfg["seed"]),
)
ready = os.fdopen(int(cfg["ready_fd"]), "w")
how = "ended"


def report_and_train() -> bool:
    # Tell the parent that k batches were consumed, then run a training step that only
    # Ctrl-C or SIGTERM ends; False if neither came.
    ready.write("ready\n")
    ready.flush()
    if cfg["hang"] is not None:
        return True
    select.select([wake_r], [], [], cfg["wait_s"])  # Ctrl-C raises out of it
    return preempted


def start_epoch():
    it = iter(loader)  # the workers start here
    if cfg["k"] == 0 and not report_and_train():
        raise SystemExit("no signal came")
    return it


with open(os.path.join(out, "batches"), "w") as batches:
    try:
        for step, batch in enumerate(start_epoch(), 1):
            batches.write(json.dumps(batch["idx"].tolist()) + "\n")
            batches.flush()
            if step == cfg["k"] and not report_and_train():
                how = "no signal came"
                break
            if preempted:
                how = "preempted"
                break
        else:
            if preempted:
                how = "preempted"
    except KeyboardInterrupt:
        how = "interrupted"
ready.close()
tmp = os.path.join(out, "ckpt.pt.tmp")
torch.save({"loader": loader.state_dict()}, tmp)
os.replace(tmp, os.path.join(out, "ckpt.pt"))
stats = loader.statistics()
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump(
        {
            "how": how,
            "batches": stats.batches,
            "respawns": stats.respawns,
            "respawns_by_cause": dict(stats.respawns_by_cause),
            "resent_tasks": stats.resent_tasks,
        },
        f,
    )
loader.close()
"""

# name: (signal sent and where it lands, start method, persistent workers)
ROWS = {
    "sigint-while-workers-start-fork": ("sigint-at-start", "fork", False),
    "sigint-while-workers-start-spawn": ("sigint-at-start", "spawn", False),
    "sigint-while-workers-start-forkserver": ("sigint-at-start", "forkserver", False),
    "sigint-in-loop-body-fork": ("sigint", "fork", False),
    "sigint-in-loop-body-fork-persistent": ("sigint", "fork", True),
    "sigint-inside-next-fork": ("sigint-in-next", "fork", False),
    "sigint-in-loop-body-forkserver": ("sigint", "forkserver", False),
    "sigint-in-loop-body-spawn": ("sigint", "spawn", True),
    "sigterm-flag-fork": ("sigterm", "fork", False),
    "sigterm-flag-forkserver-persistent": ("sigterm", "forkserver", True),
}


def _make() -> DataLoader[Any]:
    return DataLoader(
        RandomAugDataset(N),
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(SEED),
    )


def _ids(batch: Any) -> list[int]:
    tag, fields = batch
    assert tag == "dict"
    return list(dict(fields)["idx"][3])


def _group(pgid: int) -> list[str]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    out = []
    for proc in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if os.getpgid(proc.pid) != pgid or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
        except (ProcessLookupError, psutil.Error):
            continue
        out.append(f"{proc.pid} ({' '.join(proc.info['cmdline'] or [])[:80]})")
    return out


def _group_after_exit(pgid: int) -> list[str]:
    """Processes of the group still alive after a bounded wait (the fork server and the
    resource tracker leave when their pipes to the exited child close)."""
    deadline = time.monotonic() + GROUP_GONE_S
    while True:
        left = _group(pgid)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.01)  # polling the kernel's view of the group, not a synchronisation


def _read_line(fd: int, timeout: float) -> str:
    """One line from the child's pipe, or "" on EOF or timeout."""
    deadline = time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return ""
        chunk = os.read(fd, 64)
        if not chunk:
            return ""
        data += chunk
    return data.decode().strip()


@pytest.fixture
def child(tmp_path: Path) -> Iterator[Any]:
    """Start the child in its own session; always SIGKILL its whole group at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(cfg: dict[str, Any]) -> tuple[subprocess.Popen[bytes], int, Path]:
        read_fd, write_fd = os.pipe()
        cfg = dict(cfg, out=str(tmp_path), ready_fd=write_fd)
        env = dict(os.environ)
        tests = str(Path(__file__).parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH")) if p)
        stderr = tmp_path / "stderr"
        with open(stderr, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", CHILD, json.dumps(cfg)],
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
                env=env,
                start_new_session=True,
                pass_fds=(write_fd,),
            )
        os.close(write_fd)
        procs.append(proc)
        return proc, read_fd, stderr

    try:
        yield start
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=EXIT_S)


@pytest.mark.parametrize("row", list(ROWS))
def test_signal_to_a_training_process_keeps_the_stream_exact(row: str, child: Any) -> None:
    mode, method, persistent = ROWS[row]
    ref = reference_stream(_make, epochs=2)
    hang = _ids(ref[0][K])[0] if mode == "sigint-in-next" else None
    k = 0 if mode == "sigint-at-start" else K  # 0: signalled right after iter(loader)
    proc, ready_fd, stderr_path = child(
        dict(
            mode="sigterm" if mode == "sigterm" else "sigint",
            method=method,
            persistent=persistent,
            n=N,
            batch=BATCH,
            seed=SEED,
            k=k,
            hang=hang,
            wait_s=EXIT_S,
        )
    )
    try:
        line = _read_line(ready_fd, READY_S)
    finally:
        os.close(ready_fd)
    if line != "ready":
        proc.kill()
        proc.wait(timeout=EXIT_S)
        raise AssertionError(
            f"{row}: the child did not report {k} batches within {READY_S:.0f} s "
            f"(got {line!r}); stderr:\n{stderr_path.read_text()[-3000:]}"
        )
    if mode == "sigterm":
        os.kill(proc.pid, signal.SIGTERM)  # the cluster signals the training process only
    else:
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    rc = proc.wait(timeout=EXIT_S)
    stderr = stderr_path.read_text()
    out = stderr_path.parent
    assert rc == 0, f"{row}: the child exited with {rc}; stderr:\n{stderr[-3000:]}"
    # Every check of the child's process group, reported together.
    problems = []
    left = _group_after_exit(proc.pid)
    if left:
        problems.append(f"processes of the child's group outlived it: {left}")
    # The one known gap (docs/guarantees.md): a forkserver worker cannot be shielded between the
    # fork server's fork and our code (blocking SIGINT in the fork server would block it for every
    # process it forks, ours or not). A Ctrl-C landing there kills that worker with a traceback
    # and may be seen as its death; the main process, the state and the resume stay exact.
    gap = mode == "sigint-at-start" and method == "forkserver"
    if not gap and ("Traceback" in stderr or "KeyboardInterrupt" in stderr):
        problems.append(f"a traceback or KeyboardInterrupt on stderr:\n{stderr[-3000:]}")
    result = json.loads((out / "result.json").read_text())
    expected_how = "preempted" if mode == "sigterm" else "interrupted"
    if result["how"] != expected_how or result["batches"] != k:
        problems.append(f"the loop ended as {result}, expected {expected_how!r} after {k}")
    if not gap and (result["respawns"], result["respawns_by_cause"], result["resent_tasks"]) != (
        0,
        {},
        0,
    ):
        problems.append(f"the signal was counted as a worker crash: {result}")
    logged = (out / "log").read_text()
    if logged and not gap:
        problems.append(f"the loader logged worker trouble:\n{logged}")
    assert not problems, f"{row}:\n" + "\n".join(problems)

    consumed = [json.loads(x) for x in (out / "batches").read_text().splitlines()]
    assert consumed == [_ids(b) for b in ref[0][:k]], f"{row}: the child's batches"
    sd = torch.load(out / "ckpt.pt", weights_only=True)["loader"]
    assert (sd["epoch"], sd["consumed"] + len(sd["delivered_ahead"])) == (0, k), (
        f"{row}: the saved state is at epoch {sd['epoch']}, {sd['consumed']} consumed"
    )
    resumed = _make()
    try:
        resumed.load_state_dict(sd)
        rest = [canonical(b) for b in resumed]
        assert rest == ref[0][k:], f"{row}: the rest of epoch 0 after the resume"
        assert [canonical(b) for b in resumed] == ref[1], f"{row}: epoch 1 after the resume"
    finally:
        resumed.close()
