"""Hypothesis settings profiles shared by every fuzzer in fuzz/, and the run's seed.

Pick a profile with the environment variable ``HYPOTHESIS_PROFILE`` (default ``ci``):

* ``ci``   -- 300 examples per test (the two loader state machines set 35 on themselves):
  the whole of fuzz/ takes about 2-3 minutes on two cores, so it runs on every change;
* ``long`` -- 20000 examples per test (5000 for the state machines), for a soak before a
  release or after touching a codec or the loader's state machine:
  ``HYPOTHESIS_PROFILE=long python3 -m pytest fuzz``.

Both turn the per-example deadline off: a worker start or a GC pause on a loaded CI machine is
not a failure, and a slow example still counts against pytest's own timeout. ``print_blob`` makes
a failure print the ``@reproduce_failure`` line to paste into the test.

Seed: every run draws one seed for all of its fuzzers (unless ``--hypothesis-seed=N`` is
given) and prints it at the end, so any failure can be replayed with
``python3 -m pytest fuzz --hypothesis-seed=N`` (the ``.hypothesis/`` database, kept out of git,
also replays a failure on the next run on the same machine).

Hypothesis binds settings when ``@given`` decorates a test, so the profile is loaded here, at
import, before pytest imports the test modules of this folder.
"""

from __future__ import annotations

import multiprocessing
import os
import random
from typing import Any

import pytest
from hypothesis import core, settings

settings.register_profile("ci", max_examples=300, deadline=None, derandomize=False, print_blob=True)
settings.register_profile(
    "long", max_examples=20_000, deadline=None, derandomize=False, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    # A forkserver worker then starts without importing torch (no effect if the server runs).
    multiprocessing.set_forkserver_preload(["torch", "resumable_loader"])
    if core.global_force_seed is None:  # no --hypothesis-seed: draw one, and say which
        core.global_force_seed = random.SystemRandom().randrange(2**32)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    seed = core.global_force_seed
    terminalreporter.write_line(
        f"fuzz/: Hypothesis seed {seed} (profile {settings.get_current_profile_name()}); "
        f"replay with: python3 -m pytest fuzz --hypothesis-seed={seed}"
    )
