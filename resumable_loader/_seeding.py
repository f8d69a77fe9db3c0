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

import ctypes
import hashlib
import random
import struct
from typing import Any

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
    """Saves and restores the three global RNGs around a block (the slow, general way).

    ``FetchRngs`` does the same around each in-process fetch for a few microseconds; this one
    (~60 us: numpy's ``get_state``/``set_state`` are most of it) is kept for the rare blocks.
    """

    __slots__ = ("_saved",)

    def __enter__(self) -> GlobalRngGuard:
        self._saved = capture_rngs()
        return self

    def __exit__(self, *exc: object) -> None:
        restore_rngs(self._saved)


# -- Raw Mersenne Twister states ---------------------------------------------------------------
# python's ``random`` and numpy's legacy global RNG are both MT19937: 624 32-bit words and a
# position, 2500 bytes. Saving the caller's state as those bytes and writing them back costs a
# fraction of a microsecond; ``getstate``/``get_state`` build a 625-element tuple or a dict and
# an array (7 and 24 us). The layouts are checked once, on private instances, by reading and
# writing through them and comparing with the official getters; a layout that does not check
# out (another interpreter, another numpy) leaves the official getters and setters in use.
_MT_BYTES = 4 + 624 * 4
_MT_WORDS = struct.Struct("=i624I")  # python's RandomObject: int index, then uint32 state[624]
_NP_WORDS = struct.Struct("=624Ii")  # numpy's mt19937_state: uint32 key[624], then int pos
# Holds the GIL while copying (a CFUNCTYPE would release it, and another thread could see half a
# state); string_at is already such a function.
_memmove = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes._memmove_addr  # type: ignore[attr-defined]
)


def _py_state_offset() -> int | None:
    """Where python's MT state sits in a ``random.Random`` object, if the layout checks out."""
    import _random

    off = object.__basicsize__
    if _random.Random.__basicsize__ < off + _MT_BYTES:
        return None
    try:
        a, b = random.Random(12345), random.Random(678)
        a.random()
        words = _MT_WORDS.unpack(ctypes.string_at(id(a) + off, _MT_BYTES))
        if words[1:] + words[:1] != a.getstate()[1]:
            return None
        _memmove(id(b) + off, id(a) + off, _MT_BYTES)
        if b.getstate()[1] != a.getstate()[1] or b.random() != a.random():
            return None
    except Exception:
        return None
    return off


def _np_state_ok() -> bool:
    """Whether numpy's MT19937 state reads and writes as ``_NP_WORDS`` at its state address."""
    try:
        a: Any = np.random.RandomState(12345)
        b: Any = np.random.RandomState(678)
        a.random_sample()
        addr_a = a._bit_generator.ctypes.state_address
        addr_b = b._bit_generator.ctypes.state_address
        words = _NP_WORDS.unpack(ctypes.string_at(addr_a, _MT_BYTES))
        _, key, pos, _, _ = a.get_state()
        if words[:624] != tuple(key.tolist()) or words[624] != pos:
            return False
        _memmove(addr_b, addr_a, _MT_BYTES)
        return bool(b.random_sample() == a.random_sample())
    except Exception:
        return False


_layouts: tuple[int | None, bool] | None = None


def _raw_layouts() -> tuple[int | None, bool]:
    global _layouts
    if _layouts is None:
        _layouts = (_py_state_offset(), _np_state_ok())
    return _layouts


class FetchRngs:
    """Seeds the three global RNGs for one in-process (num_workers=0) fetch and gives the
    caller's states back after it, exactly: ``with rngs.seeded(seed): fetch()``.

    Data loading in the main process must not disturb the user's own random streams (dropout,
    their sampling); torch's loader lets them interleave, we keep them apart. The states are
    saved as raw bytes (see ``_MT_BYTES``), so a batch costs a few microseconds, most of it the
    seeding itself. What raw bytes leave out is carried apart: python's ``gauss_next``; numpy's
    cached gaussian (``has_gauss``), which only ``get_state`` shows: it is read in full when the
    caller's numpy state is not the one given back after the previous fetch -- the caller drew
    from it in between -- and otherwise known to be none, as given back. A cached gaussian to
    give back is given back with ``set_state``.
    """

    __slots__ = ("_np", "_np_back", "_np_full", "_py", "_py_gauss", "_seed", "_torch")

    def __init__(self) -> None:
        self._seed = 0
        self._np_back: bytes | None = None  # the numpy state given back last (no cached gauss)
        self._np_full: Any = None  # the caller's numpy state from get_state, when needed

    def seeded(self, seed: int) -> FetchRngs:
        self._seed = seed
        return self

    def __enter__(self) -> FetchRngs:
        py_off, np_ok = _raw_layouts()
        inst: Any = random._inst
        self._py = (
            ctypes.string_at(id(inst) + py_off, _MT_BYTES)
            if py_off is not None
            else inst.getstate()
        )
        self._py_gauss = inst.gauss_next
        self._np = None
        self._np_full = None
        if np_ok and type(np.random.mtrand._rand._bit_generator) is np.random.MT19937:
            raw = ctypes.string_at(_np_address(), _MT_BYTES)
            if raw == self._np_back:
                self._np = raw  # as given back last time: no cached gaussian
            else:
                full: Any = np.random.get_state()
                if full[3] == 0:
                    self._np = raw
                else:
                    self._np_full = full
        else:
            self._np_full = np.random.get_state()
        self._torch = torch.random.default_generator.get_state()
        seed_global_rngs(self._seed)
        return self

    def __exit__(self, *exc: object) -> None:
        py_off, _ = _raw_layouts()
        inst: Any = random._inst
        if py_off is not None:
            _memmove(id(inst) + py_off, self._py, _MT_BYTES)
            inst.gauss_next = self._py_gauss
        else:
            inst.setstate(self._py)
        if self._np is not None:
            np.random.seed(0)  # clears a gaussian the fetch may have left cached
            _memmove(_np_address(), self._np, _MT_BYTES)
            self._np_back = self._np
        else:
            np.random.set_state(self._np_full)
            self._np_back = None
        self._np = self._np_full = None
        torch.random.default_generator.set_state(self._torch)


def _np_address() -> int:
    rand: Any = np.random.mtrand._rand
    return int(rand._bit_generator.ctypes.state_address)


def draw_base_seed(generator: torch.Generator | None) -> int:
    """Draw a fresh 63-bit base seed from ``generator`` or torch's global RNG (like torch does)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) & (
        (1 << 63) - 1
    )
