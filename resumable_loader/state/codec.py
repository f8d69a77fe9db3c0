"""The byte codec for loader states: ``dump_state`` and ``load_state``.

A loader state is plain data (None, bool, int, float, str, bytes, list, dict with str or int
keys). ``dump_state`` turns one into bytes that ``load_state`` turns back into an equal dict, and
``load_state`` refuses everything else with a :class:`CheckpointError` -- never another exception,
never code execution, never an allocation the input does not justify.

Byte layout (all integers little-endian)::

    offset  size  field
         0     8  magic            b"RLSTATE\\0" -- tells a state file from a zip/pickle/torch file
         8     2  codec version    uint16, currently 1
        10     2  flags            uint16, 0 in version 1 (room for e.g. compression)
        12     4  reserved         uint32, 0 in version 1
        16     8  payload length   uint64, the exact number of bytes after the header
        24    16  checksum         blake2b (digest_size=16) of bytes 0..23 followed by the payload
        40     n  payload          msgpack (bin type for bytes, str as UTF-8), one map

The checksum covers the header fields as well as the payload, so a flipped bit anywhere except in
the magic or the version is reported as corruption. It detects accidents (a torn write, a flipped
bit, a concatenated file); it is not a signature -- anyone can write a file that passes it, which
is harmless because decoding such a file still only ever produces plain data.

The codec version is the version of this byte layout; the ``"version"`` key inside a loader state
is the version of the state's schema, checked by the loader, not here.
"""

from __future__ import annotations

import hashlib
import re
import reprlib
import struct
from collections.abc import Iterator
from sys import getsizeof
from typing import Any, NoReturn

import msgpack

from ..core.errors import CheckpointError

__all__ = ["dump_state", "load_state"]

# Eight bytes that no pickle, zip (torch.save), gzip or JSON file starts with; the NUL keeps a
# state from being mistaken for text.
MAGIC = b"RLSTATE\0"

# Bumped only when the byte layout changes incompatibly; a reader refuses a version it does not
# know rather than guessing, and says to upgrade.
CODEC_VERSION = 1

# No flags are defined in version 1. A reader refuses unknown flags (after the checksum has shown
# the header is intact) because a flag may change how the payload must be read.
CODEC_FLAGS = 0

# magic, version, flags, reserved, payload length, checksum.
HEADER = struct.Struct("<8sHHIQ16s")
HEADER_SIZE = HEADER.size  # 40

# blake2b with a 16-byte digest: a CRC32 misses some multi-bit errors and has only 2**32 values;
# 128 bits of a cryptographic hash miss no realistic corruption, at several hundred MB/s.
CHECKSUM_SIZE = 16

# The checksum covers the header up to (not including) the checksum field.
_CHECKSUMMED_HEADER = HEADER_SIZE - CHECKSUM_SIZE

# msgpack integers: int64 for negatives, uint64 for non-negatives.
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1

# Nesting limit for containers. Real states nest about six levels; user state rarely more than a
# handful. 256 stays far below msgpack's decoder stack (1024) and Python's recursion limit, which
# json.dumps and pickle (torch.save) hit on deeper data, and it stops a reference cycle early.
MAX_DEPTH = 256

# The memory a decode may take: DECODED_BYTES_PER_BYTE per payload byte plus DECODED_ALLOWANCE,
# so that load_state and inspect stay under 20 bytes per byte of file whatever it holds. What is
# built is priced at what CPython pays (``sys.getsizeof``) for each list, dict and scalar --
# a shared one (None, a small int, a one-character str) costs nothing -- when its hook runs;
# until then each payload byte is charged TRANSIENT_BYTES_PER_BYTE, the most what msgpack
# builds from one byte out of the hooks' sight costs (an item of a list not yet complete, its
# slot included), save the ``_HOT`` scalars below (see ``_Budget``). A real state is a few kB
# (a Mixture's weight history or 1,024 stream partitions: tens of kB), far inside the
# allowance, and long lists of ints, floats, strs or bytes fit the limit; a long run of tiny
# containers (``[[]] * n``, ``[[1, 2]] * n``: 27-64 bytes per byte) or of very short strs or
# small negative ints does not -- store such data as bytes or as one flat list.
DECODED_BYTES_PER_BYTE = 18
DECODED_ALLOWANCE = 2 << 20
TRANSIENT_BYTES_PER_BYTE = 12

# Scalars that cost more than TRANSIENT_BYTES_PER_BYTE per byte that encodes them, by the bytes
# that start them, and the most one costs (the object and its 8-byte slot in a list): negative
# fixints -32..-6 (a new 28-byte int from 1 byte), int8 (one from 2), strs of 2 to 7 bytes (up
# to 100 bytes each: "ab", one non-Latin-1 character), and str8/str16 headers (a crafted file
# may write a short str in them). A flat list of them would take 20-40 bytes per byte before
# any hook could refuse it, so every payload byte that could start one is charged before
# decoding as if it did. Bytes inside other values are charged too: nothing in ASCII text, ~7
# per byte in binary data or floats, ~12 in East Asian text -- within the limit.
_HOT = (
    (bytes(range(0xE0, 0xFB)), 36),
    (b"\xd0", 36),
    (bytes(range(0xA2, 0xA8)), 108),
    (b"\xd9\xda", 108),
)

_SCALARS = (type(None), bool, float, bytes)

# The path of a value: the keys and indices from the root down to it, after the root's own
# placeholder (the walk's stack of keys, copied only when a value is refused).
_Where = list[Any]

# Ends a frame of the walk (next(iterator, _DONE)).
_DONE = object()


class _NotPlain(Exception):
    """A value found by the walk that is not plain data; turned into a CheckpointError."""

    def __init__(self, where: _Where, problem: str, hint: str) -> None:
        super().__init__(problem)
        self.where = where[1:]  # the walk's key stack starts with the root's (no) key
        self.problem = problem
        self.hint = hint

    def describe(self, root: str) -> str:
        return f"{_render_path(root, self.where)}: {self.problem}"


def dump_state(sd: dict[Any, Any]) -> bytes:
    """Encode a loader state as bytes that :func:`load_state` turns back into an equal dict.

    Args:
        sd: the state, a dict of plain data: None, bool, int (from -2**63 to 2**64-1), float,
            str, bytes, list and dict with str or int keys, at most ``MAX_DEPTH`` (256)
            containers deep, the state dict itself included.
            Tuples are accepted and encoded as lists (they come back as lists). Dict subclasses
            such as ``OrderedDict`` are accepted and come back as plain dicts. Nothing else is:
            not numpy arrays or scalars, tensors, sets, bytearrays, enums or namedtuples.

    Returns:
        The header (magic, codec version, length, checksum) followed by the msgpack payload.

    Raises:
        CheckpointError: ``sd`` is not a dict, or holds something that is not plain data; the
            message names the path of the offending value (``state['workers'][1]...``) and how
            to fix it.
    """
    if not isinstance(sd, dict):
        raise CheckpointError(
            f"dump_state() expects the dict returned by state_dict(), got {_type_name(sd)}"
        )
    try:
        _walk(sd, decoded=False)
    except _NotPlain as exc:
        raise CheckpointError(f"{exc.describe('state')}; {exc.hint}") from None
    try:
        payload = msgpack.packb(sd, use_bin_type=True, datetime=False)
    except Exception as exc:  # the walk admits only what msgpack packs; kept for the contract
        raise CheckpointError(f"could not encode the state as msgpack: {exc}") from exc
    try:
        _decode_payload(payload)  # priced as load_state prices it: the same code, not a model
    except _OverBudget as exc:
        # load_state would refuse it: better no checkpoint now than one that never loads.
        raise CheckpointError(
            f"the state is too large for its size in bytes: {exc.detail}; load_state() "
            "refuses such a file -- store long runs of tiny containers, short strs or small "
            "negative ints as bytes or as one flat list of ints in your state_dict()"
        ) from None
    return _frame(payload)


def load_state(data: bytes | bytearray | memoryview) -> dict[Any, Any]:
    """Decode bytes written by :func:`dump_state`.

    Decoding runs no code from the input (no pickle, msgpack extension types are refused) and
    allocates memory in proportion to the input: the declared payload length is checked against
    the actual length first, and msgpack's size limits are set from it.

    Args:
        data: the bytes of a state, e.g. ``open(path, "rb").read()``.

    Returns:
        The state dict, holding only plain data (lists where tuples were dumped).

    Raises:
        CheckpointError: for every malformed input -- wrong argument type, empty, truncated,
            foreign bytes, a newer codec version, a checksum mismatch, trailing bytes, a payload
            that is not plain msgpack data. The message says what was wrong and what to do; when
            msgpack itself raised, its exception is the ``__cause__``.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CheckpointError(
            f"load_state() expects bytes, got {_type_name(data)}; to load a file, pass its "
            "contents: load_state(open(path, 'rb').read())"
        )
    try:
        # One copy: it works for any memoryview (non-contiguous, any format) and keeps a buffer
        # that another thread mutates from changing under the checksum.
        buf = bytes(data)
    except (ValueError, TypeError, BufferError) as exc:
        raise CheckpointError(f"could not read the buffer passed to load_state(): {exc}") from exc

    flags, reserved, declared, checksum = _read_header(buf)
    actual = len(buf) - HEADER_SIZE
    if declared > actual:
        _fail(
            f"truncated: the header declares a {declared}-byte payload but only {actual} bytes "
            "follow it; the file was cut short (interrupted write or partial copy) -- use an "
            "earlier checkpoint"
        )
    if declared < actual:
        _fail(
            f"{actual - declared} unexpected trailing bytes after the {declared}-byte payload; "
            "the file was appended to or concatenated with something else -- use an earlier "
            "checkpoint, or cut the file to its first "
            f"{HEADER_SIZE + declared} bytes if you know the extra bytes were appended"
        )
    payload = memoryview(buf)[HEADER_SIZE:]  # not a copy: its memory counts towards the limit
    if _checksum(buf[:_CHECKSUMMED_HEADER], payload) != checksum:
        _fail(
            "checksum mismatch: the state is corrupt (its bytes changed after dump_state wrote "
            "them -- a disk or transfer error, or an edit); use an earlier checkpoint"
        )
    if flags != CODEC_FLAGS or reserved != 0:
        _fail(
            f"the header uses flags {flags:#06x} / reserved {reserved:#010x} that codec version "
            f"{CODEC_VERSION} does not define; it was written by a newer resumable_loader -- "
            "upgrade resumable_loader to load it"
        )
    try:
        state = _decode_payload(payload, whole=buf)
    except _OverBudget as exc:
        _fail(
            f"refused while decoding: {exc.detail}; dump_state never writes such a payload -- "
            "use a file that dump_state wrote"
        )
    if not isinstance(state, dict):
        _fail(
            f"the payload decodes to {_type_name(state)}, not a dict; it was not written by "
            "dump_state -- use a file that was"
        )
    return state


def _read_header(buf: bytes) -> tuple[int, int, int, bytes]:
    """Check the magic and the codec version; return flags, reserved, length and checksum."""
    n = len(buf)
    if n == 0:
        _fail(
            "empty input (0 bytes); the state was never written or was truncated to nothing -- "
            "use an earlier checkpoint"
        )
    if buf[: len(MAGIC)] != MAGIC[:n]:
        _fail(
            f"not a resumable_loader state: {_sniff(buf)}; load_state() reads only the bytes "
            "that dump_state() writes"
        )
    if n < HEADER_SIZE:
        _fail(
            f"truncated: {n} bytes, but the header alone is {HEADER_SIZE} bytes; the file was "
            "cut short (interrupted write or partial copy) -- use an earlier checkpoint"
        )
    _magic, version, flags, reserved, declared, checksum = HEADER.unpack_from(buf)
    if version != CODEC_VERSION:
        if version > CODEC_VERSION:
            _fail(
                f"state codec version {version} is newer than this resumable_loader reads "
                f"(version {CODEC_VERSION}); upgrade resumable_loader to load it (or, if no "
                "newer version wrote it, the header is corrupt)"
            )
        _fail(
            f"state codec version {version} does not exist (versions start at 1); the header is "
            "corrupt -- use an earlier checkpoint"
        )
    return flags, reserved, declared, checksum


def _decode_payload(payload: bytes | memoryview, whole: bytes | None = None) -> object:
    """Decode ``payload`` within its memory budget (``_Budget``); ``whole``: the file that ends
    with it, if it is a view of one (counted in place rather than copied)."""
    limit = len(payload)  # no string, array or map can be longer than the bytes that hold it
    budget = _Budget(limit, bytes(payload) if whole is None else whole)
    try:
        obj = msgpack.unpackb(
            payload,
            raw=False,
            use_list=True,
            list_hook=budget.list_hook,
            # msgpack builds each dict itself: with object_pairs_hook it would first build a
            # 56-byte tuple per pair (28 bytes per byte of a map of small pairs), out of reach
            # of the budget until the map ends. A key repeated in a map keeps its last value,
            # as in json; dump_state never writes one.
            strict_map_key=False,  # int keys are allowed; object_hook checks every key
            object_hook=budget.object_hook,
            ext_hook=_refuse_ext,
            timestamp=0,  # timestamps bypass ext_hook; they decode to Timestamp, refused below
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=limit,
            max_map_len=limit,
            max_ext_len=limit,
        )
    except (CheckpointError, _OverBudget):
        raise
    except TypeError as exc:
        kind = re.fullmatch(r"unhashable type: '(\w+)'", str(exc))
        if kind is None:
            raise _not_msgpack(exc) from exc
        _fail(
            f"the payload has a map key of type {kind[1]}; dump_state writes only str and int "
            "keys -- use a file that dump_state wrote"
        )
    except Exception as exc:  # ValueError, ExtraData, FormatError, StackError, ...
        raise _not_msgpack(exc) from exc
    try:
        if not _decoded_is_plain(obj):
            _walk(obj, decoded=True)  # finds the fault and its path
    except _NotPlain as exc:
        raise CheckpointError(
            f"the payload holds data dump_state never writes, at {exc.describe('state')}; use a "
            "file that dump_state wrote"
        ) from None
    return obj


def _not_msgpack(exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"the payload is not valid msgpack although its checksum matches "
        f"({_describe_exc(exc)}); it was written by something other "
        "than dump_state -- use a file that dump_state wrote"
    )


class _OverBudget(Exception):
    """Decoding would take more memory than the payload's budget allows (``detail`` says
    how much); load_state and dump_state word it for their callers."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def _shared_scalars() -> tuple[Any, ...]:
    """The scalars msgpack hands out shared rather than built (None, the bools, CPython's small
    ints, empty and one-character strs and bytes): found by decoding them twice, so that a
    Python that caches fewer merely charges more. Kept alive here: their ids stay theirs."""
    sample = [
        None,
        True,
        False,
        *range(-32, 257),
        "",
        *map(chr, range(256)),
        b"",
        *(bytes((i,)) for i in range(256)),
    ]
    payload = msgpack.packb(sample, use_bin_type=True)
    first, second = msgpack.unpackb(payload), msgpack.unpackb(payload)
    return tuple(a for a, b in zip(first, second) if a is b)


_SHARED = _shared_scalars()
_SHARED_IDS = frozenset(map(id, _SHARED))
_SHARED_BY_KIND: dict[type, frozenset[Any]] = {
    kind: frozenset(x for x in _SHARED if type(x) is kind) for kind in (int, str, bytes)
}
# Values that cost nothing beyond their slot: shared singletons, and containers (charged by
# their own hook).
_FREE_KINDS = frozenset({type(None), bool, list, dict})


def _scalars_cost(items: Any, kinds: set[type]) -> int:
    """What the scalars among ``items`` (a list, or a dict's keys or values, of the types
    ``kinds``) cost beyond their slots: each one msgpack built. Shared scalars cost nothing, and
    a container was charged by its own hook. Values of one type (the common case) are priced at
    C speed."""
    if len(kinds) == 1:
        [kind] = kinds
        if kind in _FREE_KINDS:
            return 0
        cost = sum(map(getsizeof, items))
        shared = _SHARED_BY_KIND.get(kind)
        if shared:  # by value: among values of one kind, msgpack shares exactly these
            cost -= sum(map(getsizeof, filter(shared.__contains__, items)))
        return cost
    return sum(
        getsizeof(x) for x in items if type(x) not in _FREE_KINDS and id(x) not in _SHARED_IDS
    )


class _Budget:
    """Bounds the memory a decode takes, as msgpack goes, and stops it as soon as the bound
    passes the payload's limit (``decoded_budget``): the memory spent before a refusal is
    bounded too.

    The bound: what is built and charged (each container and its scalars, at what CPython
    pays, when its hook runs) plus TRANSIENT_BYTES_PER_BYTE for every payload byte not yet
    charged (what msgpack may have built from it, out of the hooks' sight: the items of an open
    list), plus the ``_HOT`` scalars, which may cost more per byte, charged before decoding.
    A hook takes back the transient charge of the bytes it prices (at least: its scalars
    re-encoded, see ``_encoded``), so plain data -- ints, floats, strs, bytes in long lists --
    costs what it costs, and only runs of tiny containers add up past the limit."""

    def __init__(self, payload_size: int, whole: bytes) -> None:
        """``whole``: bytes that end with the payload (the file, or the payload itself)."""
        self.size = payload_size
        self.left = decoded_budget(payload_size)
        head = whole[: len(whole) - payload_size]
        hot = sum(w * (_count(whole, start) - _count(head, start)) for start, w in _HOT)
        self._charge(TRANSIENT_BYTES_PER_BYTE * payload_size + hot)

    def list_hook(self, items: list[Any]) -> list[Any]:
        kinds = set(map(type, items))
        if kinds <= _ONE_BYTE:  # [], [None, True], [[], {}]: nothing to re-encode
            encoded = 1 + sum(map(_ONE_BYTE_KINDS.__getitem__, map(type, items)))
            self._charge(getsizeof(items) - TRANSIENT_BYTES_PER_BYTE * encoded)
            return items
        if kinds == _INT and all(map(_SHARED_INTS.__contains__, items)):  # [1, 2]
            self._charge(getsizeof(items) - TRANSIENT_BYTES_PER_BYTE * (1 + len(items)))
            return items
        cost = getsizeof(items) + _scalars_cost(items, kinds)
        self._charge(cost - TRANSIENT_BYTES_PER_BYTE * _encoded(items, kinds))
        return items

    def object_hook(self, obj: dict[Any, Any]) -> dict[Any, Any]:
        keys = set(map(type, obj))
        if not keys <= _KEY_TYPES:
            key = next(k for k in obj if type(k) not in _KEY_TYPES)
            _fail(
                f"the payload has a map key of type {_type_name(key)}; dump_state writes only "
                "str and int keys -- use a file that dump_state wrote"
            )
        values = set(map(type, obj.values()))
        cost = getsizeof(obj) + _scalars_cost(obj, keys) + _scalars_cost(obj.values(), values)
        self._charge(cost - TRANSIENT_BYTES_PER_BYTE * _encoded(obj, values))
        return obj

    def _charge(self, cost: int) -> None:
        self.left -= cost
        if self.left < 0:
            raise _OverBudget(_over_budget(self.size))


def _count(data: bytes, values: bytes) -> int:
    """How many bytes of ``data`` are among ``values``: translate counts at C speed, and its
    copy is gone at once."""
    return len(data) - len(data.translate(None, values))


def _encoded(container: list[Any] | dict[Any, Any], kinds: set[type]) -> int:
    """At most the bytes that encode ``container`` (a list, or a dict whose values are of the
    types ``kinds``) without its containers, which count their own: re-encoded in msgpack's
    shortest form, floats counted as float32 (the shortest a file may hold them in)."""
    if kinds & _CONTAINERS:
        if isinstance(container, dict):
            container = {k: v for k, v in container.items() if type(v) not in _CONTAINERS}
        else:
            container = [x for x in container if type(x) is not list and type(x) is not dict]
    size = len(msgpack.packb(container, use_bin_type=True, datetime=False))
    if float in kinds:
        items = container.values() if isinstance(container, dict) else container
        size -= 4 * sum(type(x) is float for x in items)
    return size


# Values that take one byte each and nothing to price: nil, the bools; containers count their
# own bytes (0 here).
_ONE_BYTE_KINDS = {type(None): 1, bool: 1, list: 0, dict: 0}
_ONE_BYTE = frozenset(_ONE_BYTE_KINDS)
_INT = {int}
_SHARED_INTS = _SHARED_BY_KIND[int]


_KEY_TYPES = frozenset({str, int})
_EMPTY_LIST = getsizeof([])
_EMPTY_DICT = getsizeof({})


def _refuse_ext(code: int, data: bytes) -> NoReturn:
    _fail(
        f"the payload holds a msgpack extension value (type code {code}, {len(data)} bytes); "
        "dump_state never writes extension types and load_state does not decode them -- use a "
        "file that dump_state wrote"
    )


def _walk(root: object, *, decoded: bool) -> None:
    """Raise _NotPlain at the first value under ``root`` that is not plain data.

    Iterative, so that depth is limited by ``MAX_DEPTH`` rather than by Python's recursion limit,
    and lazy: it holds one iterator per open container, so its own memory grows with the depth,
    not with the number of values. ``decoded`` is true for the output of msgpack, which needs no
    range or encoding checks.
    """
    # frames[i] iterates over the (key, value) pairs of the i-th open container; keys[i] is the
    # key of the value it gave last: the path of the value at hand, after the root's None.
    frames: list[Iterator[tuple[Any, Any]]] = [iter(((None, root),))]
    keys: list[Any] = [None]
    while frames:
        item: Any = next(frames[-1], _DONE)
        if item is _DONE:
            frames.pop()
            keys.pop()
            continue
        key, value = item
        keys[-1] = key
        kind = type(value)
        if kind is str:
            if not decoded:
                _check_str(value, keys, "str")
        elif kind is int:
            if not decoded:
                _check_int(value, keys)
        elif kind in _SCALARS:
            pass
        elif kind is list or (kind is tuple and not decoded):
            if len(frames) > MAX_DEPTH:
                raise _NotPlain(keys, f"nested deeper than {MAX_DEPTH} levels", _DEPTH_HINT)
            if _leaves_are_plain(value, decoded):
                continue
            frames.append(enumerate(value))
            keys.append(None)
        elif isinstance(value, dict) and (kind is dict or not decoded):
            if len(frames) > MAX_DEPTH:
                raise _NotPlain(keys, f"nested deeper than {MAX_DEPTH} levels", _DEPTH_HINT)
            for k in value:
                _check_key(k, keys, decoded)
            frames.append(iter(value.items()))
            keys.append(None)
        else:
            raise _NotPlain(keys, f"type {_type_name(value)} is not plain data", _hint(value))


_CONTAINERS = frozenset({list, dict})


def _decoded_is_plain(root: object) -> bool:
    """Whether msgpack's output ``root`` is plain data within ``MAX_DEPTH``: the common case,
    checked a level at a time at C speed (a type set per container), where ``_walk`` spends a
    Python step on every value. False means "run _walk", which finds what is wrong and where.

    msgpack's output is a tree (no container appears twice), so this visits each container
    once; its only other values are plain scalars or a Timestamp (refused here).
    """
    level: list[Any] = [root]
    depth = 0
    while level:
        if depth >= MAX_DEPTH or not set(map(type, level)) <= _CONTAINERS:
            return False
        below: list[Any] = []
        for container in level:
            items = container if type(container) is list else container.values()
            kinds = set(map(type, items))
            if kinds <= _LEAF_TYPES:
                continue
            if not kinds <= _LEAF_TYPES | _CONTAINERS:
                return False
            below.extend(x for x in items if type(x) is list or type(x) is dict)
        level = below
        depth += 1
    return True


def decoded_budget(payload_size: int) -> int:
    """The memory decoding a payload of ``payload_size`` bytes may take (see
    DECODED_BYTES_PER_BYTE)."""
    return DECODED_BYTES_PER_BYTE * payload_size + DECODED_ALLOWANCE


def _over_budget(payload_size: int) -> str:
    return (
        f"decoded, it would take more than the {_mib(decoded_budget(payload_size))} of memory "
        f"allowed for a {payload_size}-byte payload ({DECODED_BYTES_PER_BYTE} bytes per "
        f"payload byte plus {_mib(DECODED_ALLOWANCE)}, so that a small file cannot fill the "
        "memory)"
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _check_key(key: object, where: _Where, decoded: bool) -> None:
    if type(key) is str:
        if not decoded:
            _check_str(key, where, "dict key")
    elif type(key) is int:
        if not decoded:
            _check_int(key, where, what="dict key")
    else:
        raise _NotPlain(
            where,
            f"dict key {clip_text(repr(key), 60)} has type {_type_name(key)}",
            "dict keys must be str or int; convert the key with str() or int()",
        )


_DEPTH_HINT = "flatten the state (or break the reference cycle, if it holds itself)"

_LEAF_TYPES = frozenset({type(None), bool, int, float, str, bytes})


def _leaves_are_plain(items: list[Any] | tuple[Any, ...], decoded: bool) -> bool:
    """Fast path for a list of scalars (sample indices, floats, names): checked at C speed.

    False means "look at each item", not "invalid": the walk then finds the item at fault.
    """
    kinds = set(map(type, items))
    if not kinds <= _LEAF_TYPES:
        return False
    if decoded:
        return True  # msgpack produced them: in range and valid UTF-8 by construction
    if kinds == {int}:
        return min(items) >= INT_MIN and max(items) <= INT_MAX
    if kinds == {str}:
        return all(map(str.isascii, items))
    return int not in kinds and str not in kinds


def _check_int(value: int, where: _Where, what: str = "int") -> None:
    if not INT_MIN <= value <= INT_MAX:
        raise _NotPlain(
            where,
            f"{what} {clip_text(repr(value), 60)} is outside the range msgpack can store "
            "(-2**63 to 2**64-1)",
            "store it as a str, or split it into smaller ints",
        )


def _check_str(value: str, where: _Where, what: str) -> None:
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _NotPlain(
            where,
            f"{what} {clip_text(repr(value), 60)} cannot be encoded as UTF-8 ({exc.reason})",
            "it holds a lone surrogate; store the raw data as bytes instead",
        ) from None


def _hint(value: object) -> str:
    """What to do with a value that is not plain data."""
    if isinstance(value, (bool, int, float, str, bytes)):
        base = next(t for t in (bool, int, float, str, bytes) if isinstance(value, t)).__name__
        return f"convert it with {base}() in your state_dict() (subclasses are not plain data)"
    if isinstance(value, tuple):
        return "convert it to a list or a dict in your state_dict() (its field names would be lost)"
    if isinstance(value, (bytearray, memoryview)):
        return "convert it to bytes in your state_dict()"
    if isinstance(value, (set, frozenset)):
        return "convert it to a sorted list in your state_dict()"
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy scalars, 0-d tensors
        return "convert it with .item() in your state_dict()"
    if hasattr(value, "tolist"):  # numpy arrays, torch tensors
        return "convert it to a list (.tolist()) or bytes in your state_dict()"
    return "convert it to None, bool, int, float, str, bytes, list or dict in your state_dict()"


def _render_path(root: str, where: _Where) -> str:
    parts = [f"[{clip_text(repr(k), 40)}]" for k in where]
    if len(parts) > 16:  # a path into deeply nested data: the ends say where it is
        parts = [*parts[:6], f"...{len(parts) - 12} more...", *parts[-6:]]
    return root + "".join(parts)


def _frame(payload: bytes) -> bytes:
    """Prefix a msgpack payload with the header; the inverse of the checks in load_state."""
    prefix = HEADER.pack(MAGIC, CODEC_VERSION, CODEC_FLAGS, 0, len(payload), b"")
    prefix = prefix[:_CHECKSUMMED_HEADER]
    return prefix + _checksum(prefix, payload) + payload


def _checksum(header_prefix: bytes, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(header_prefix, digest_size=CHECKSUM_SIZE)
    h.update(payload)
    return h.digest()


def encoded_size(value: object) -> int | None:
    """Bytes the msgpack encoding of ``value`` takes, or None if it is not plain data."""
    try:
        _walk(value, decoded=False)
        return len(msgpack.packb(value, use_bin_type=True, datetime=False))
    except Exception:
        return None


# Foreign formats worth naming when the magic does not match: (prefix, what it is, what to do).
_FOREIGN = (
    (b"PK\x03\x04", "a zip archive -- a torch.save file?", "load it with torch.load()"),
    (b"\x80", "a pickle -- a legacy torch.save file?", "load it with torch.load()"),
    (b"\x1f\x8b", "gzip-compressed", "decompress it first"),
    (b"{", "JSON text?", "load it with json.load()"),
)


def _sniff(buf: bytes) -> str:
    if len(buf) < len(MAGIC):
        return f"only {len(buf)} bytes, which do not start with the {MAGIC!r} magic"
    for prefix, what, todo in _FOREIGN:
        if buf.startswith(prefix):
            return f"it starts with {buf[:4]!r}, which looks like {what} ({todo})"
    return f"it starts with {buf[: len(MAGIC)]!r}, not the {MAGIC!r} magic"


def _type_name(value: object) -> str:
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def _describe_exc(exc: BaseException) -> str:
    text = " ".join(str(exc).split())  # one line, whatever the exception put in its message
    return f"{type(exc).__name__}: {clip_text(text, 200)}" if text else type(exc).__name__


def clip_text(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel = 4
    r.maxdict = r.maxlist = r.maxtuple = r.maxset = 8
    r.maxstring = r.maxother = r.maxlong = 80
    return r


_SHORT_REPR = _short_repr()


def clip_repr(value: object, limit: int = 200) -> str:
    """A repr of ``value`` for an error message: at most ``limit`` characters, and at most a few
    levels and items of a container, so that a huge or deeply nested value from a damaged file
    neither floods the message nor exhausts the recursion limit (``repr`` would do both)."""
    try:
        text = _SHORT_REPR.repr(value)
    except Exception as exc:  # a user object whose __repr__ raises
        text = f"<{_type_name(value)}: repr failed with {type(exc).__name__}>"
    return clip_text(text, limit)


def _fail(message: str) -> NoReturn:
    raise CheckpointError(message)
