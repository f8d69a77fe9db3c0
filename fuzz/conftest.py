"""Hypothesis settings profiles shared by every fuzzer in fuzz/.

Pick one with the environment variable ``HYPOTHESIS_PROFILE`` (default ``ci``):

* ``ci``   -- about 300 examples per test: the whole of fuzz/ stays well under a minute on two
  cores, so it runs on every change;
* ``long`` -- 20000 examples per test, for a soak before a release or after touching a codec or
  the loader's state machine: ``HYPOTHESIS_PROFILE=long python3 -m pytest fuzz``.

Both turn the per-example deadline off: a worker start or a GC pause on a loaded CI machine is
not a failure, and a slow example still counts against pytest's own timeout. ``print_blob`` makes
a failure print the ``@reproduce_failure`` line to paste into the test.

Hypothesis binds settings when ``@given`` decorates a test, so the profile is loaded here, at
import, before pytest imports the test modules of this folder.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", max_examples=300, deadline=None, derandomize=False, print_blob=True)
settings.register_profile(
    "long", max_examples=20_000, deadline=None, derandomize=False, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
