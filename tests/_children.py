"""Training jobs in child processes: run one, SIGKILLed or not, and compare its steps.

Shared by the trainer integrations' tests (Lightning in ``test_integrations``, accelerate and
transformers in ``test_integrations_hf``). A child runs in its own process group; after a
SIGKILL its orphaned workers must exit by themselves, and nothing of the group is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

import resumable_loader

# A child's wait limit: a Lightning process starts in ~3 s, a loaded 2-core box can be slower.
CHILD_TIMEOUT_S = 180
# A worker whose main process was SIGKILLed notices within a second (docs/guarantees.md);
# allow for load.
ORPHAN_EXIT_S = 15.0


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    # The child imports the very resumable_loader this process tests.
    here = str(Path(resumable_loader.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [here, env.get("PYTHONPATH")] if p)
    return env


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def run_child(script: Path, *args: str, killed: bool) -> str:
    """Run the script in its own process group; return its output.

    ``killed``: it must end by SIGKILL, and then its orphaned workers must exit by themselves.
    Whatever happens, nothing of the group is left running.
    """
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=_child_env(),
        start_new_session=True,  # its own process group: the workers inherit it
        text=True,
    )
    pgid = proc.pid
    try:
        out, _ = proc.communicate(timeout=CHILD_TIMEOUT_S)
        expected = -signal.SIGKILL if killed else 0
        assert proc.returncode == expected, (
            f"{' '.join(args)}: exit status {proc.returncode}, expected {expected}\n{out[-6000:]}"
        )
        if killed:
            # A worker whose main process died exits within a second; poll the process table
            # until it is empty (a condition, not a sleep standing in for one).
            deadline = time.monotonic() + ORPHAN_EXIT_S
            while (left := _group_members(pgid)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not left, f"orphaned workers still running {ORPHAN_EXIT_S}s later: {left}"
        return out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)  # anything of the group still there


def free_port() -> int:
    """A TCP port free on localhost now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    script: Path, *args: str, world: int, killed: bool, env: dict[str, str] | None = None
) -> list[str]:
    """Run ``world`` copies of the script as the ranks of one job (torch's environment
    variables, a gloo rendezvous on a free local port), each in its own process group; return
    their outputs in rank order.

    ``killed``: every rank must end by SIGKILL, and then its orphaned workers must exit by
    themselves. Whatever happens, nothing of the groups is left running.
    """
    port = str(free_port())
    procs = []
    # Files, not pipes: a rank blocked on a full pipe would hang the other in a collective.
    files = [tempfile.TemporaryFile("w+") for _ in range(world)]  # noqa: SIM115 (closed below)
    try:
        for rank in range(world):
            renv = dict(_child_env(), **(env or {}))
            renv.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *args],
                    stdout=files[rank],
                    stderr=subprocess.STDOUT,
                    env=renv,
                    start_new_session=True,
                    text=True,
                )
            )
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        outs = []
        for f in files:
            f.seek(0)
            outs.append(f.read())
        expected = -signal.SIGKILL if killed else 0
        for rank, (p, out) in enumerate(zip(procs, outs)):
            assert p.returncode == expected, (
                f"rank {rank} of {' '.join(args)}: exit status {p.returncode}, expected "
                f"{expected}\n{out[-6000:]}"
            )
        if killed:
            deadline = time.monotonic() + ORPHAN_EXIT_S
            while (
                left := [pid for p in procs for pid in _group_members(p.pid)]
            ) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not left, f"orphaned workers still running {ORPHAN_EXIT_S}s later: {left}"
        return outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for f in files:
            f.close()


def read_steps(log: Path) -> list[tuple[int, int, list[int]]]:
    """(global step, epoch, sample ids) per line of a training log."""
    if not log.exists():
        return []
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return [(r["step"], r["epoch"], r["ids"]) for r in rows]


def assert_same_steps(got: list[Any], ref: list[Any], where: str, out: str = "") -> None:
    """Each global step trained on the batch the uninterrupted run trained on at that step:
    none repeated, none skipped."""
    a = [(s, ids) for s, _, ids in got]
    b = [(s, ids) for s, _, ids in ref]
    if a != b:
        k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise AssertionError(
            f"{where}: {len(a)} steps recorded, the uninterrupted run has {len(b)}; first "
            f"difference at row {k}: got {got[k : k + 3]} expected {ref[k : k + 3]} "
            f"((step, epoch, ids)); all rows got {got}\n{out[-1500:]}"
        )
