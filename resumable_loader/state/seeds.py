"""Seed derivation: every random draw the loader makes is a pure function of the epoch's seed.

Each epoch's seed comes from the loader's ``SeedChain`` (below): drawn at ``iter()`` from the
loader's ``generator`` as torch draws its base seed, or -- without one -- derived from a root
drawn once from torch's global RNG when the loader is built. The chain's state is part of the
loader's state, so a resumed job's later epochs are the saved job's whatever the resumed
process's RNGs hold. Every other seed is derived from the epoch's seed by hashing:

* the epoch's shuffle (or a custom sampler's draws): derive(SAMPLER, seed)
* worker ``w``'s process seed:                        derive(WORKER, seed, w)
* a map-style task (batch ``t`` of the epoch):        derive(TASK, seed, t)
* the ``k``-th fetch of stream worker ``w``:          derive(STREAM, seed, w, k)
* ``iter(dataset)`` in stream worker ``w``:           derive(STREAM, seed, w, -1)
* a ``Stream.random_map`` item (its own generator):   derive(STREAM_ITEM, stream seed, pass,
  partition, *the item's position in its partition) -- no loader seed: the layout-free value

Before each task, python ``random``, numpy's global RNG and torch's CPU generator are seeded with
the task seed, so a batch's random augmentations depend only on which batch it is -- not on
which worker ran it, whether that worker was respawned, or how many workers there are.
"""

from __future__ import annotations

import _random
import base64
import ctypes
import hashlib
import random
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..core.compat import (
    memmove_address,
    numpy_bit_generator,
    numpy_global_rng,
    python_random_instance,
)

SAMPLER = 1
WORKER = 2
TASK = 3
STREAM = 4
DIST_SEED = 5  # an epoch's seed under a DistributedSampler
SAMPLE = 6  # a sample's own seed (seed_per_sample)
STREAM_ITEM = 7  # a Stream item's generator in random_map: (stream seed, pass, partition, position)

_MASK64 = (1 << 64) - 1
_PERSON = b"resumable-loader"  # domain separation from any other blake2b use
# The C seeding under ``random.Random.seed`` (``random.seed`` of an int is this, then
# ``gauss_next = None``).
_py_seed = _random.Random.seed


# The packing of (domain, *parts) by number of parts: a format string built per call costs
# about as much as the hash (derive_seed runs once per batch, in the main process with
# num_workers=0).
_PACKERS: dict[int, Any] = {}


def derive_seed(domain: int, *parts: int) -> int:
    """A 63-bit seed from ``domain`` and ``parts`` (a keyed hash: no structure survives)."""
    pack = _PACKERS.get(len(parts))
    if pack is None:
        pack = _PACKERS[len(parts)] = struct.Struct(f"<{len(parts) + 1}Q").pack
    packed = pack(domain, *[p & _MASK64 for p in parts])
    digest = hashlib.blake2b(packed, digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "little") >> 1


def seeds_of(domain: int, *prefix: int) -> Callable[[int], int]:
    """``last -> derive_seed(domain, *prefix, last)``, with the fixed part hashed once (blake2b
    hashes bytes given in pieces as it hashes them whole): half the cost of a task's seed,
    which the main process derives once per batch with ``num_workers=0``."""
    head = hashlib.blake2b(digest_size=8, person=_PERSON)
    head.update(struct.pack(f"<{len(prefix) + 1}Q", domain, *[p & _MASK64 for p in prefix]))
    pack = _U64.pack

    def seed(last: int) -> int:
        h = head.copy()
        h.update(pack(last & _MASK64))
        return int.from_bytes(h.digest(), "little") >> 1

    return seed


def seed_global_rngs(seed: int, *, keep_initial_seed: bool = True) -> None:
    """Seed python ``random``, numpy's global RNG and torch's CPU generator with ``seed``.

    Only the CPU generator: seeding CUDA from a data worker would initialise CUDA there.

    With ``keep_initial_seed`` (the default), ``torch.initial_seed()`` goes on reporting what
    it reported before: the draws are the task's, the seed a user reads is theirs (the one a
    ``worker_init_fn`` set, or the worker's own). The generator's state and the seed it reports
    are separate fields of that state, so both can hold.
    """
    inst: Any = python_random_instance()
    # What random.seed(seed) does for an int, without its checks for str and bytes seeds.
    _py_seed(inst, seed)
    inst.gauss_next = None
    np.random.seed(seed & 0xFFFFFFFF)
    gen = torch.random.default_generator
    if keep_initial_seed and _seed_field_ok():
        _seed_torch_keeping(gen, seed, _U64.pack(gen.initial_seed()))
    else:
        gen.manual_seed(seed)


_U64 = struct.Struct("<Q")


def _seed_torch_keeping(gen: torch.Generator, seed: int, seed_field: bytes | int) -> None:
    """``gen`` seeded with ``seed``, its seed field (the state's first 8 bytes, see
    ``_seed_field_ok``) set to the 8 bytes at ``seed_field`` (bytes, or an address)."""
    tmpl = _template()
    tmpl.manual_seed(seed)
    state = tmpl.get_state()
    # 8 bytes written in place: a tensor slice assignment costs more than all the rest.
    _memmove(state.data_ptr(), seed_field, 8)
    gen.set_state(state)


_tmpl: torch.Generator | None = None
_seed_field: bool | None = None


def _template() -> torch.Generator:
    global _tmpl
    if _tmpl is None:
        _tmpl = torch.Generator()
    return _tmpl


def _seed_field_ok() -> bool:
    """Whether a CPU generator's state starts with its seed as 8 little-endian bytes, so that
    the seed it reports can be set apart from its draws (checked once, on private generators;
    another layout keeps torch's plain ``manual_seed``)."""
    global _seed_field
    if _seed_field is None:
        try:
            a, b = torch.Generator(), torch.Generator()
            a.manual_seed(0x1234_5678_9ABC)
            st = a.get_state()
            ok = bytes(st[:8].tolist()) == struct.pack("<Q", 0x1234_5678_9ABC)
            if ok:
                st[:8] = torch.frombuffer(bytearray(struct.pack("<Q", 77)), dtype=torch.uint8)
                b.set_state(st)
                ok = b.initial_seed() == 77 and torch.equal(
                    torch.rand(4, generator=a), torch.rand(4, generator=b)
                )
            _seed_field = ok
        except Exception:
            _seed_field = False
    return _seed_field


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
    memmove_address()
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
        addr_a = numpy_bit_generator(a).ctypes.state_address
        addr_b = numpy_bit_generator(b).ctypes.state_address
        words = _NP_WORDS.unpack(ctypes.string_at(addr_a, _MT_BYTES))
        _, key, pos, _, _ = a.get_state()
        if words[:624] != tuple(key.tolist()) or words[624] != pos:
            return False
        _memmove(addr_b, addr_a, _MT_BYTES)
        return bool(b.random_sample() == a.random_sample())
    except Exception:
        return False


def _np_gauss_offset() -> int | None:
    """Where numpy's legacy ``RandomState`` object keeps its cached gaussian -- an int flag
    (``has_gauss``), then the double -- if the layout checks out: found on a private instance
    by the value ``get_state`` reports, then written through and read back with ``get_state``
    and a draw. The flag, its padding and the double are copied as ``_GAUSS_BYTES`` bytes."""
    try:
        a: Any = np.random.RandomState(12345)
        a.randn()  # one gaussian drawn, its pair cached
        _, _, _, has, cached = a.get_state()
        size = type(a).__basicsize__
        mem = ctypes.string_at(id(a), size)
        needle = struct.pack("=d", cached)
        at = mem.find(needle)
        off = at - 8
        if has != 1 or at < 0 or mem.count(needle) != 1 or at % 8 or off < object.__basicsize__:
            return None
        if struct.unpack_from("=i", mem, off)[0] != 1:
            return None
        b: Any = np.random.RandomState(678)  # none cached
        _memmove(id(b) + off, id(a) + off, _GAUSS_BYTES)
        if b.get_state()[3:] != (1, cached) or b.randn() != cached:
            return None
        c: Any = np.random.RandomState(9)
        a.randn()  # the cached one: none left
        _memmove(id(c) + off, id(b) + off, _GAUSS_BYTES)  # b has none left either
        if c.get_state()[3] != 0 or a.get_state()[3] != 0:
            return None
    except Exception:
        return None
    return off


_GAUSS_BYTES = 16  # int has_gauss, 4 bytes of padding, double gauss

# (python's MT state offset, numpy's MT layout ok, numpy's cached gaussian offset)
_layouts: tuple[int | None, bool, int | None] | None = None


def _raw_layouts() -> tuple[int | None, bool, int | None]:
    global _layouts
    if _layouts is None:
        np_ok = _np_state_ok()
        _layouts = (_py_state_offset(), np_ok, _np_gauss_offset() if np_ok else None)
    return _layouts


class FetchRngs:
    """Seeds the three global RNGs for one in-process (num_workers=0) fetch and gives the
    caller's states back after it, exactly: ``with rngs.seeded(seed): fetch()``.

    Data loading in the main process must not disturb the user's own random streams (dropout,
    their sampling); torch's loader lets them interleave, we keep them apart. The states are
    saved as raw bytes (see ``_MT_BYTES``), so a batch costs a few microseconds, most of it the
    seeding itself. Raw bytes hold the Mersenne Twister words; the cached gaussians are carried
    apart: python's ``gauss_next`` attribute, and numpy's ``has_gauss`` and ``gauss`` fields,
    as raw bytes too (``_np_gauss_offset``). Where a layout does not check out, the official
    getters and setters are used (numpy's ``get_state``/``set_state``: ~50 us a batch).
    """

    __slots__ = (
        "_gauss_at",
        "_inst",
        "_np_at",
        "_np_bg",
        "_np_full",
        "_np_rand",
        "_py",
        "_py_at",
        "_py_gauss",
        "_saved",
        "_saved_buf",
        "_seed",
        "_torch",
    )

    def __init__(self) -> None:
        self._seed = 0
        # The caller's raw states while a fetch runs -- python's MT words, numpy's, numpy's
        # cached gaussian -- copied into one buffer made once (a bytes object per state and
        # batch costs more than the copy).
        self._saved_buf = ctypes.create_string_buffer(2 * _MT_BYTES + _GAUSS_BYTES)
        at = ctypes.addressof(self._saved_buf)
        self._saved = (at, at + _MT_BYTES, at + 2 * _MT_BYTES)
        # The global generators' objects, and where their raw fields lie (0: that generator
        # takes the slow path), looked up again only when one of the objects changes.
        self._inst: Any = None
        self._np_rand: Any = None
        self._np_bg: Any = None
        self._py_at = self._np_at = self._gauss_at = 0
        self._py: Any = None  # the slow paths' saved states
        self._np_full: Any = None

    def seeded(self, seed: int) -> FetchRngs:
        self._seed = seed
        return self

    def _look(self, inst: Any, rand: Any, bg: Any) -> None:
        py_off, _, gauss_off = _raw_layouts()
        self._inst, self._np_rand, self._np_bg = inst, rand, bg
        self._py_at = id(inst) + py_off if py_off is not None and type(inst) is random.Random else 0
        self._np_at = self._gauss_at = 0
        numpy_raw = type(rand) is np.random.RandomState and type(bg) is np.random.MT19937
        if gauss_off is not None and numpy_raw:
            self._np_at = int(bg.ctypes.state_address)
            self._gauss_at = id(rand) + gauss_off

    def __enter__(self) -> FetchRngs:
        inst: Any = python_random_instance()
        rand, bg = numpy_global_rng()
        if inst is not self._inst or rand is not self._np_rand or bg is not self._np_bg:
            self._look(inst, rand, bg)
        py_saved, np_saved, gauss_saved = self._saved
        if self._py_at:
            _memmove(py_saved, self._py_at, _MT_BYTES)
        else:
            self._py = inst.getstate()
        self._py_gauss = inst.gauss_next
        if self._np_at:
            _memmove(np_saved, self._np_at, _MT_BYTES)
            _memmove(gauss_saved, self._gauss_at, _GAUSS_BYTES)
        else:
            self._np_full = np.random.get_state()
        # What seed_global_rngs(seed) does, with what is known here: numpy's generator is
        # the RandomState looked up above, and the caller's seed field of torch's state is the
        # first 8 bytes of the state just saved.
        gen = torch.random.default_generator
        self._torch = saved = gen.get_state()
        seed = self._seed
        _py_seed(inst, seed)
        inst.gauss_next = None
        if self._np_at:
            rand.seed(seed & 0xFFFFFFFF)
        else:
            np.random.seed(seed & 0xFFFFFFFF)
        if _seed_field_ok():
            _seed_torch_keeping(gen, seed, saved.data_ptr())
        else:
            gen.manual_seed(seed)
        return self

    def __exit__(self, *exc: object) -> None:
        py_saved, np_saved, gauss_saved = self._saved
        inst = self._inst
        if self._py_at:
            _memmove(self._py_at, py_saved, _MT_BYTES)
        else:
            inst.setstate(self._py)
        inst.gauss_next = self._py_gauss
        if self._np_at:
            _memmove(self._np_at, np_saved, _MT_BYTES)
            _memmove(self._gauss_at, gauss_saved, _GAUSS_BYTES)
        else:
            np.random.set_state(self._np_full)
        self._py = self._np_full = None
        torch.random.default_generator.set_state(self._torch)


def draw_base_seed(generator: torch.Generator | None) -> int:
    """Draw a fresh 63-bit base seed from ``generator`` or torch's global RNG (like torch does)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) & (
        (1 << 63) - 1
    )


CHAIN = 7  # an epoch's seed from the chain's root: derive(CHAIN, root, n)

# The keys of a seed chain's plain state (see ``SeedChain.state``).
CHAIN_ROOT = "root"
CHAIN_NEXT = "next"
CHAIN_GENERATOR = "generator"


class SeedChain:
    """Where each epoch's seed comes from: the loader's whole future randomness in one object
    whose state is plain data.

    Two modes:

    * **generator** (the loader was given a ``generator``, or torch's ``RandomSampler`` holds
      one): each ``iter()`` draws the epoch's seed from it, as torch draws its base seed, so
      ``generator.manual_seed(s)`` before an epoch repeats it. The state is the generator's
      state, and loading it sets the generator: later epochs draw what they drew.
    * **root** (no generator): one root is drawn from torch's global RNG when the loader is
      built (as torchdata's sampler draws its seed), and epoch n of the chain gets
      ``derive(CHAIN, root, n)``. Training steps that draw from the global RNG change nothing,
      and neither does the seed of a restarted script: the state is (root, n). A *reseed* seen
      at ``iter()`` -- the global generator is exactly in the state ``manual_seed`` leaves, and
      was not when the loader last looked -- starts a new chain from a root drawn right then, so
      ``torch.manual_seed(s)`` just before ``iter()`` repeats the epoch, as with torch. A reseed
      followed by other draws before ``iter()`` is not seen (docs/differences.md).

    ``state()`` is what the next ``iter()`` draws from; ``state_before()`` is what the current
    epoch's ``iter()`` drew from (a sampler whose epoch is re-iterated after a load needs it).
    """

    __slots__ = ("_before", "_next", "_root", "_seen_state", "generator")

    def __init__(self, generator: torch.Generator | None, *, rooted: bool = True) -> None:
        self.generator = generator
        self._root: int | None = None
        self._next = 0
        self._seen_state: torch.Tensor | None = None
        self._before: dict[str, Any] | None = None
        if generator is None and rooted:
            self._root = draw_base_seed(None)
            self.look()

    def look(self) -> None:
        """Note the global RNG as it is now (a later reseed is told apart from it)."""
        self._seen_state = torch.random.default_generator.get_state()

    def _reseeded(self) -> bool:
        """Whether torch's global RNG was reseeded since this chain last looked: it is exactly
        in the state ``manual_seed`` leaves, and was not so then. Draws (a training step) and
        ``set_rng_state`` (a trainer restoring the RNG with the model) are not reseeds."""
        gen = torch.random.default_generator
        now = gen.get_state()
        if self._seen_state is not None and torch.equal(now, self._seen_state):
            return False
        fresh = _template()
        fresh.manual_seed(gen.initial_seed())
        return torch.equal(now, fresh.get_state())

    def next_seed(self) -> int:
        """The seed of the epoch an ``iter()`` begins now."""
        self._before = self.state()
        if self.generator is not None:
            return draw_base_seed(self.generator)
        if self._root is None or self._reseeded():
            self._root, self._next = draw_base_seed(None), 0
            self._before = self.state()
        seed = derive_seed(CHAIN, self._root, self._next)
        self._next += 1
        self.look()
        return seed

    def state(self) -> dict[str, Any]:
        """What the next ``next_seed()`` draws from, as plain data."""
        if self.generator is not None:
            return {CHAIN_GENERATOR: encode_generator(self.generator)}
        if self._root is None:
            self._root = draw_base_seed(None)
            self.look()
        return {CHAIN_ROOT: self._root, CHAIN_NEXT: self._next}

    def state_before(self) -> dict[str, Any]:
        """What the latest ``next_seed()`` drew from (``state()`` if none was drawn)."""
        return dict(self._before) if self._before is not None else self.state()

    def load(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (validated by ``check_chain``): it wins over this chain's
        generator, root and whatever the global RNG holds."""
        if CHAIN_GENERATOR in state:
            if self.generator is None:
                # The saved job drew from a generator this loader was not given: keep drawing
                # from one in that state, so the later epochs are the saved job's.
                self.generator = torch.Generator()
            self.generator.set_state(decode_generator(state[CHAIN_GENERATOR]))
        else:
            self.generator = None  # the saved job's chain, not this loader's generator
            self._root, self._next = state[CHAIN_ROOT], state[CHAIN_NEXT]
        self._before = None
        self.look()


def encode_generator(gen: torch.Generator) -> str:
    """A CPU generator's state as plain data (base64 text)."""
    return base64.b64encode(gen.get_state().numpy().tobytes()).decode("ascii")


def decode_generator(text: str) -> torch.Tensor:
    """The state ``encode_generator`` wrote, for ``Generator.set_state``."""
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def check_generator(text: Any) -> str | None:
    """What is wrong with an encoded generator state, or None if a CPU generator takes it."""
    if not isinstance(text, str) or len(text) > 16384:
        return "the generator state must be a base64 string"
    try:
        base64.b64decode(text, validate=True)
        torch.Generator().set_state(decode_generator(text))
    except Exception as exc:
        return f"the generator state is not a CPU generator's ({type(exc).__name__})"
    return None


def check_chain(state: Any) -> str | None:
    """What is wrong with a seed chain's plain state, or None if it can be loaded."""
    if not isinstance(state, dict):
        return f"expected a dict, got {type(state).__name__}"
    if set(state) == {CHAIN_GENERATOR}:
        return check_generator(state[CHAIN_GENERATOR])
    if set(state) == {CHAIN_ROOT, CHAIN_NEXT}:
        root, n = state[CHAIN_ROOT], state[CHAIN_NEXT]
        if type(root) is not int or not 0 <= root < 2**63:
            return f"root must be an int in [0, 2**63), got {root!r:.40}"
        if type(n) is not int or not 0 <= n < 2**62:
            return f"next must be an int in [0, 2**62), got {n!r:.40}"
        return None
    return f"expected {{root, next}} or {{generator}}, got keys {sorted(map(str, state))[:6]}"
