"""Seed derivation: every random draw the loader makes is a pure function of the epoch's seed.

Each epoch's seed is drawn at its ``iter()`` -- from ``generator`` (the loader's, or that of
torch's own RandomSampler) or else torch's global RNG, as torch draws its base seed -- so
``torch.manual_seed(s)`` before an epoch gives that epoch again. The state records the seed of
the epoch it is in (a resume continues that epoch whatever the RNGs say) and how many seeds
were drawn from the generator (a resumed loader draws as many first, so later epochs match).
Every other seed is derived from the epoch's seed by hashing:

* the epoch's shuffle (or a custom sampler's draws): derive(SAMPLER, seed)
* worker ``w``'s process seed:                        derive(WORKER, seed, w)
* a map-style task (batch ``t`` of the epoch):        derive(TASK, seed, t)
* the ``k``-th fetch of stream worker ``w``:          derive(STREAM, seed, w, k)
* ``iter(dataset)`` in stream worker ``w``:           derive(STREAM, seed, w, -1)

Before each task, python ``random``, numpy's global RNG and torch's CPU generator are seeded with
the task seed, so a batch's random augmentations depend only on which batch it is -- not on
which worker ran it, whether that worker was respawned, or how many workers there are.
"""

from __future__ import annotations

import hashlib
import random
import struct

import numpy as np
import torch

SAMPLER = 1
WORKER = 2
TASK = 3
STREAM = 4
DIST_SEED = 5  # an epoch's seed under a DistributedSampler
SAMPLE = 6  # a sample's own seed (seed_per_sample)

_MASK64 = (1 << 64) - 1
_PERSON = b"resumable-loader"  # domain separation from any other blake2b use


def derive_seed(domain: int, *parts: int) -> int:
    """A 63-bit seed from ``domain`` and ``parts`` (a keyed hash: no structure survives)."""
    packed = struct.pack(f"<{len(parts) + 1}Q", domain, *(p & _MASK64 for p in parts))
    digest = hashlib.blake2b(packed, digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_global_rngs(seed: int) -> None:
    """Seed python ``random``, numpy's global RNG and torch's CPU generator with ``seed``.

    Only the CPU generator: seeding CUDA from a data worker would initialise CUDA there.
    """
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.random.default_generator.manual_seed(seed)


def capture_rngs() -> tuple[object, object, torch.Tensor]:
    """The states of python ``random``, numpy's global RNG and torch's CPU generator."""
    return random.getstate(), np.random.get_state(), torch.random.default_generator.get_state()


def restore_rngs(states: tuple[object, object, torch.Tensor]) -> None:
    """Put back what ``capture_rngs()`` returned."""
    py, np_state, torch_state = states
    random.setstate(py)  # type: ignore[arg-type]
    np.random.set_state(np_state)  # type: ignore[arg-type]
    torch.random.default_generator.set_state(torch_state)


class GlobalRngGuard:
    """Saves and restores the three global RNGs around in-process (num_workers=0) fetches.

    Data loading in the main process must not disturb the user's own random streams (dropout,
    their sampling); torch's loader lets them interleave, we keep them apart. Costs ~120 us per
    batch (copying python's and numpy's states dominates).
    """

    __slots__ = ("_saved",)

    def __enter__(self) -> GlobalRngGuard:
        self._saved = capture_rngs()
        return self

    def __exit__(self, *exc: object) -> None:
        restore_rngs(self._saved)


def draw_base_seed(generator: torch.Generator | None) -> int:
    """Draw a fresh 63-bit base seed from ``generator`` or torch's global RNG (like torch does)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) & (
        (1 << 63) - 1
    )
