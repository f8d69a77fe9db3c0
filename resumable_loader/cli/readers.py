"""What the CLI reads from PATH, and where the loader state sits in what it read.

``read_checkpoint`` tells the three inputs apart and decodes each without running code from
it: a ``dump_state`` file (by its magic header; ``load_state`` unpickles nothing), a
``torch.save`` file (``torch.load(weights_only=True)``, its tensors kept on the CPU), or a
``torch.distributed.checkpoint`` directory (``dcp.load_dcp``). Nothing is read with plain
``pickle``.

``locate`` then finds the loader state in what was read: at ``--key`` (a dotted path, followed
by ``dig``), the object itself, or the one dict inside it that looks like a state
(``find_state``). Several candidates are refused, never guessed between: ``--key`` names the
one meant.
"""

from __future__ import annotations

import os
from typing import Any

from ..core.errors import CheckpointError
from ..state.codec import MAGIC, load_state
from ..state.ranks import GLOBAL_FORMAT
from ..state.schema import FORMAT as STATE_FORMAT
from ..state.schema import K_CONSUMED, KNOWN_KEYS
from .dcp import load_dcp
from .files import check_expansion, open_regular
from .messages import CliError, first_line, kind_of, list_keys

# ---- reading PATH ----


def read_checkpoint(path: str, locations: set[str] | None = None) -> tuple[Any, str, bool]:
    """Read PATH as a dump_state or torch.save file, or the loader entries of a DCP
    directory: (object, description, is a dump file). A torch.save file's tensors are read
    onto the CPU; ``locations`` (if given) receives the devices they were saved on."""
    if os.path.isdir(path):
        return load_dcp(path), "torch.distributed.checkpoint directory", False
    try:
        with open_regular(path) as f:
            # Sniff first: a torch.save training checkpoint can be gigabytes, and torch.load
            # reads it itself.
            is_dump = f.read(len(MAGIC)) == MAGIC
            data = f.read() if is_dump else b""
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if is_dump:
        try:
            state = load_state(MAGIC + data)
        except CheckpointError as exc:
            raise CliError(f"{path}: {exc}") from exc
        return state, f"dump_state file, {len(MAGIC) + len(data)} bytes, checksum ok", True
    try:
        import torch
    except ImportError as exc:
        raise CliError(
            f"{path} does not start with the dump_state magic {MAGIC!r}, and torch (needed to "
            "read torch.save files) is not installed"
        ) from exc
    try:
        obj = torch.load(path, weights_only=True, map_location=_on_cpu(locations))
    except Exception as exc:
        raise CliError(
            f"{path} is neither a dump_state file (no {MAGIC!r} magic) nor a file that "
            f"torch.load(weights_only=True) reads ({type(exc).__name__}: "
            f"{first_line(str(exc))})"
        ) from exc
    check_expansion(obj, os.path.getsize(path), path)
    return obj, "torch.save file", False


def _on_cpu(locations: set[str] | None) -> Any:
    """A ``map_location`` for ``torch.load`` that keeps every storage on the CPU, where it is
    deserialised, and notes in ``locations`` the device each was saved on."""
    if locations is None:
        return "cpu"

    def keep(storage: Any, location: str) -> Any:
        locations.add(str(location))
        return storage

    return keep


# ---- finding the loader state in it ----


def looks_like_state(obj: dict[Any, Any]) -> bool:
    """Whether ``obj`` is a loader state (a rank's, or a job's global one) rather than a
    training checkpoint around one."""
    # A state without a "format" key (hand-made, or from an older writer) still has several of
    # the schema's keys, "consumed" among them; a training checkpoint around a state may share
    # generic ones ("epoch", "config", "dataset"), but not that one.
    fmt = obj.get("format")
    if isinstance(fmt, str) and fmt in (STATE_FORMAT, GLOBAL_FORMAT):
        return True
    return K_CONSUMED in obj and len(set(KNOWN_KEYS) & set(obj)) >= 3


# How far the search for the loader state looks: a training checkpoint nests its parts a few
# levels (``trainer.state.loader``, ``states.0.loader``); a file nested deeper, or with more
# containers than this, is not walked to the end -- --key says where the state is.
SEARCH_DEPTH = 16
SEARCH_CONTAINERS = 100_000


def find_state(obj: Any, path: str) -> tuple[list[Any], dict[Any, Any]]:
    """The one loader state in ``obj``, at any depth up to ``SEARCH_DEPTH`` through dicts,
    lists and tuples: (the keys that lead to it, the state). A state is not searched inside;
    any other container reached twice (a torch.save file may share one, or hold itself) is
    searched once."""
    found: list[tuple[list[Any], dict[Any, Any]]] = []
    seen: set[int] = set()
    stack: list[tuple[list[Any], Any]] = [([], obj)]
    cut_short = ""
    while stack:
        keys, value = stack.pop()
        # A state is counted at every key that holds it (torch.save keeps one object saved
        # twice as one): a skip written at one key would leave the other behind.
        if keys and isinstance(value, dict) and looks_like_state(value):
            found.append((keys, value))
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        if len(seen) > SEARCH_CONTAINERS:
            cut_short = f"; the search stopped after {SEARCH_CONTAINERS} dicts and lists"
            break
        if len(keys) >= SEARCH_DEPTH:
            cut_short = f"; the search looks {SEARCH_DEPTH} levels deep"
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value)
        inner = [([*keys, k], v) for k, v in items if isinstance(v, (dict, list, tuple))]
        stack.extend(reversed(inner))  # popped in the file's order
    if len(found) == 1:
        return found[0]
    if found:
        labels = [key_label(keys) for keys, _ in found]
        raise CliError(
            f"{path} holds several loader states ({list_keys(labels)}); choose one with "
            f"--key (e.g. --key {labels[0]})"
        )
    raise CliError(
        f"no loader state found in {path}{cut_short}; pass --key to say where it is "
        f"({_top_level(obj)})"
    )


def key_label(keys: list[Any]) -> str:
    """The dotted key for a path of keys, as --key takes it."""
    return ".".join(map(str, keys))


def dig(obj: Any, dotted: str, path: str) -> Any:
    """Follow a dotted key ('train.loader', 'states.0') into nested dicts and lists."""
    current = obj
    walked: list[str] = []
    for part in dotted.split("."):
        where = repr(".".join(walked)) if walked else "the top level"
        if isinstance(current, dict):
            if part in current:
                current = current[part]
            elif _is_int(part) and int(part) in current:
                current = current[int(part)]
            else:
                keys = f"{where} has keys: {list_keys(current)}" if walked else ""
                raise CliError(
                    f"no key {dotted!r} in {path}: "
                    + (f"{keys}; {_top_level(obj)}" if keys else _top_level(obj))
                )
        elif isinstance(current, (list, tuple)) and _is_int(part) and int(part) < len(current):
            current = current[int(part)]
        else:
            raise CliError(
                f"no key {dotted!r} in {path}: {where} is {kind_of(current)}, which has no key "
                f"{part!r}; {_top_level(obj)}"
            )
        walked.append(part)
    return current


def _top_level(obj: Any) -> str:
    if isinstance(obj, dict):
        return f"top-level keys: {list_keys(obj)}" if obj else "the file holds an empty dict"
    return f"the file holds {kind_of(obj)}, not a dict"


def locate(obj: Any, key: str | None, path: str, from_dump: bool) -> tuple[list[Any], Any]:
    """The loader state in ``obj`` (as ``skip`` needs it): (the keys that lead to it, so the
    new state can be put back there, and the state). ``inspect`` needs only the state and
    reads it with ``dig`` and ``find_state`` itself."""
    if key is not None:
        keys = _key_path(obj, key, path)
        state = obj
        for k in keys:
            state = state[k]
        if not isinstance(state, dict):
            raise CliError(
                f"the value at {key!r} in {path} is {kind_of(state)}, not a loader state (a "
                "dict); choose another --key"
            )
        return keys, state
    if isinstance(obj, dict) and (from_dump or looks_like_state(obj)):
        return [], obj
    return find_state(obj, path)


def _key_path(obj: Any, dotted: str, path: str) -> list[Any]:
    """The keys (dict keys as stored, list indices as ints) that ``dig`` follows."""
    dig(obj, dotted, path)  # raises the readable error for a wrong key
    keys: list[Any] = []
    current = obj
    for part in dotted.split("."):
        if isinstance(current, dict):
            k: Any = part if part in current else int(part)
        else:
            k = int(part)
        keys.append(k)
        current = current[k]
    return keys


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit()
