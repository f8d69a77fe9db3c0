"""The short soak: ``fuzz/soak.py`` run as a ``slow`` test (``pytest tests/behaviour/test_soak.py
--run-slow``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_short_soak_loses_duplicates_changes_and_leaks_nothing() -> None:
    """fuzz/soak.py for 2,000 batches, a worker SIGKILLed every 50 (the full soak is 20,000).

    Here rather than in fuzz/ so that the suite's ``--run-slow`` applies without registering
    the option a second time from fuzz/conftest.py.
    """
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(root / "fuzz" / "soak.py"), "--batches", "2000", "--kill-every", "50"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lost 0, duplicated 0, changed 0" in proc.stdout, proc.stdout
