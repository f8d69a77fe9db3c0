"""``save_checkpoint`` (``_checkpoint``): a kill mid-write leaves the previous checkpoint, a
failed write leaves no stray file, and the steps that make the write durable run in order."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from resumable_loader import dump_state, load_state, save_checkpoint

REPO = Path(__file__).resolve().parents[2]

# The child saves checkpoint 1, then starts writing checkpoint 2 and stops itself (SIGSTOP)
# from inside the write: torch.save pickles the object after opening its output, so the stop
# lands with the new file created and partly written. The parent then SIGKILLs it there.
CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    from resumable_loader import save_checkpoint

    class StopHere:
        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGSTOP)
            return (int, (0,))

    path, how = sys.argv[1], sys.argv[2]
    first = {"step": 1, "weights": torch.arange(1000.0)}
    save_checkpoint(first, path)
    second = {"step": 2, "weights": torch.zeros(1000), "stop": StopHere()}
    if how == "save_checkpoint":
        save_checkpoint(second, path)
    else:
        torch.save(second, path)
    """
)


@pytest.mark.parametrize("how", ["save_checkpoint", "torch.save"])
def test_a_kill_during_the_save_leaves_the_previous_checkpoint(tmp_path: Path, how: str) -> None:
    path = tmp_path / "ckpt.pt"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), how], env=env)
    try:
        _, status = os.waitpid(child.pid, os.WUNTRACED)  # until it stops itself mid-write
        assert os.WIFSTOPPED(status), f"the child ended first (status {status:#x})"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    if how == "torch.save":
        # The setup is honest: the same kill ruins a checkpoint written in place (torch.save
        # truncated it before pickling; the write stopped there).
        assert path.stat().st_size == 0
        with pytest.raises(EOFError):
            torch.load(path, weights_only=True)
        return
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == 1 and torch.equal(loaded["weights"], torch.arange(1000.0))
    # What the killed write leaves: its own temporary file, nothing else.
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p != path)
    assert len(leftovers) == 1 and leftovers[0].startswith(".ckpt.pt.")
    assert leftovers[0].endswith(".tmp")


def test_a_failed_save_removes_its_temporary_file_and_keeps_the_checkpoint(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"step": 1}, path)
    with pytest.raises(TypeError, match="pickle"):  # torch.save cannot pickle a lock
        save_checkpoint({"step": 2, "lock": threading.Lock()}, path)
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_the_file_and_the_rename_are_made_durable_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append(("replace", f"{os.path.basename(src)} -> {os.path.basename(dst)}"))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_checkpoint(b"payload", tmp_path / "state.rls")
    [(what0, tmp), (what1, renamed), (what2, directory)] = events
    assert (what0, what1, what2) == ("fsync", "replace", "fsync")
    assert renamed == f"{os.path.basename(tmp)} -> state.rls"
    assert os.path.dirname(tmp) == str(tmp_path) == directory


def test_bytes_are_written_as_they_are_with_the_usual_permissions(tmp_path: Path) -> None:
    state = {"format": "x", "n": [1, 2, 3]}
    path = tmp_path / "state.rls"
    save_checkpoint(dump_state(state), path)
    assert load_state(path.read_bytes()) == state
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    save_checkpoint(bytearray(b"again"), str(path))  # replaces it; str paths too
    assert path.read_bytes() == b"again"
