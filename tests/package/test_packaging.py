"""The package as a user gets it: ``python -m build``, then the wheel in a fresh venv.

The other tests import the source tree; this one checks what the wheel and the sdist actually
contain, and that the installed wheel imports and resumes from outside the repository.

torch is not installed again (it is hundreds of megabytes): the fresh venv gets our wheel with
``--no-deps`` and sees the dependencies through a ``.pth`` file naming the directories they
are installed in here. ``build`` comes with the ``dev`` extra, which CI installs; without it this
test fails rather than skips, so that CI cannot pass without building the package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Imported from the fresh venv, from a directory outside the repository.
SMOKE = textwrap.dedent(
    """
    import importlib.resources
    import sys

    import torch

    import resumable_loader
    from resumable_loader import DataLoader

    assert resumable_loader.__file__.startswith(sys.prefix), resumable_loader.__file__
    assert importlib.resources.files("resumable_loader").joinpath("py.typed").is_file()

    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return torch.tensor([i, i * i]) + torch.rand(2)  # the augmentation must match too

    def loader():
        g = torch.Generator().manual_seed(7)
        return DataLoader(Squares(), batch_size=4, shuffle=True, generator=g, num_workers=0)

    whole = list(loader())
    first = loader()
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    nxt = next(iter(resumed))
    assert torch.equal(nxt, whole[3]), (nxt, whole[3])
    print("smoke ok", resumable_loader.__version__)
    """
)


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


def _dependency_dirs() -> list[str]:
    """Where this interpreter finds our dependencies (for the fresh venv's .pth file)."""
    import msgpack
    import numpy
    import tenacity
    import torch

    dirs = {str(Path(m.__file__).resolve().parents[1]) for m in (torch, numpy, msgpack, tenacity)}
    return sorted(dirs)


@pytest.mark.timeout(300)
def test_built_wheel_and_sdist_install_and_resume(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    # Builds the sdist, then the wheel from the sdist: a file missing from the sdist breaks
    # the wheel too.
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], cwd=tmp_path)
    (sdist,) = dist.glob("resumable_loader-*.tar.gz")
    (wheel,) = dist.glob("resumable_loader-*.whl")

    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {n.removeprefix(top + "/") for n in tar.getnames()}
    needed_in_sdist = (
        "LICENSE",
        "README.md",
        "CHANGELOG.md",
        "docs/README.md",
        "pyproject.toml",
        "resumable_loader/py.typed",
        "tests/conftest.py",
    )
    for needed in needed_in_sdist:
        assert needed in names, f"{needed} is not in the sdist"

    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = whl.read(metadata).decode()
    assert "resumable_loader/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
    assert not any(n.startswith(("tests/", "fuzz/", "benchmarks/")) for n in names)
    assert "License-Expression: BSD-3-Clause" in meta
    assert "Requires-Dist: torch<2.14,>=2.13" in meta

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
    _run([*pip, "--no-deps", "--no-index", str(wheel)], cwd=tmp_path)
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(_run([str(python), "-c", purelib], cwd=tmp_path).strip())
    (site / "_deps_from_test_env.pth").write_text("\n".join(_dependency_dirs()) + "\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    smoke = tmp_path / "smoke.py"
    smoke.write_text(SMOKE)
    out = _run([str(python), str(smoke)], cwd=tmp_path, env=env)
    assert "smoke ok 0.1.0" in out
