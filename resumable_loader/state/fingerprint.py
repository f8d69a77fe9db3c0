"""Dataset checks: what data a state was taken on, and what changed since.

A loader state records its dataset as ``{"class", "fingerprint"}`` (the ``dataset`` key: the
class's ``__qualname__``, and what its ``fingerprint()`` returns); its
length is ``config.dataset_len`` (one truth, checked here too). A ``Mixture`` records each
source's name, length and fingerprint in its plan (``data_plan``), so its own record carries no
fingerprint: its sources are compared one by one, which names the one that changed.

A fingerprint is the string a dataset's ``fingerprint()`` method returns (a manifest hash, a
file list digest). Wrappers are not looked into: a ``Subset`` or ``ConcatDataset`` is recorded
by its class and length, unless it has a ``fingerprint()`` of its own.

At ``load_state_dict`` a change is refused by default (``CheckpointError``, naming every change
with both values); ``on_dataset_change="continue"`` keeps the position on the new data and says
so with one ``RuntimeWarning``. A state without a record (written before dataset checks) has its
length checked, its class and fingerprint not.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from ..core.errors import CheckpointError
from .codec import clip_repr, clip_text

RAISE = "raise"
CONTINUE = "continue"
POLICIES = (RAISE, CONTINUE)

# A fingerprint rides in every state_dict(): a digest, not a file list. 1024 characters holds any
# hash with room for a prefix ("sha256:...", a manifest path and its hash) and keeps a state small.
MAX_FINGERPRINT = 1024

K_CLASS = "class"
K_FINGERPRINT = "fingerprint"


def check_policy(value: Any) -> str:
    """``value`` if it is a valid ``on_dataset_change``.

    Raises:
        ValueError: anything but ``"raise"`` or ``"continue"``.
    """
    if not isinstance(value, str) or value not in POLICIES:
        raise ValueError(
            f"on_dataset_change must be 'raise' (refuse a state taken on other data) or "
            f"'continue' (keep its position on the new data, with a warning), got {value!r}"
        )
    return value


def class_name(obj: Any) -> str:
    """The qualified name of ``obj``'s class (``__qualname__``: ``Corpus``,
    ``Outer.Corpus``), without its module: a script's classes are ``__main__.Corpus`` when it
    runs and ``train.Corpus`` when imported (a launcher, a test), and a class moved to another
    module reads the same data."""
    return type(obj).__qualname__


def fingerprint_of(dataset: Any, what: str) -> str | None:
    """What ``dataset.fingerprint()`` returns, or None without such a method.

    Args:
        dataset: any dataset.
        what: how an error names it ("source 'web'", "the dataset (pkg.Corpus)").

    Raises:
        TypeError: ``fingerprint()`` returned something other than a str.
        ValueError: it returned a str longer than ``MAX_FINGERPRINT`` characters.
        RuntimeError: ``fingerprint()`` raised (chained as ``__cause__``).
    """
    method = getattr(dataset, "fingerprint", None)
    if not callable(method):
        return None
    try:
        fp = method()
    except Exception as exc:
        raise RuntimeError(
            f"{what}: fingerprint() raised {type(exc).__name__}: {clip_text(str(exc), 200)}. "
            "The loader records it in every state_dict() and compares it at "
            "load_state_dict(); make it return the data's digest (computed once, it is "
            "called at each of them), or remove it to have the class and length checked only"
        ) from exc
    if not isinstance(fp, str):
        raise TypeError(
            f"{what}: fingerprint() must return a str (a manifest hash, a file list digest), "
            f"not {type(fp).__name__}"
        )
    if len(fp) > MAX_FINGERPRINT:
        raise ValueError(
            f"{what}: fingerprint() returned {len(fp)} characters ({clip_repr(fp, 60)}); it is "
            f"saved in every state, so keep it to a digest of at most {MAX_FINGERPRINT} "
            "(hashlib.sha256(manifest).hexdigest(), say)"
        )
    return fp


# A wrapper that is no change of data names, in this class attribute, the attribute holding the
# dataset it reads; the record is that dataset's. resumable_loader.testing's fault injectors do:
# a job run through one resumes on the plain dataset (a test's reference run, a repaired job).
WRAPS = "_records_as"


def recorded(dataset: Any) -> Any:
    """The dataset a state records for ``dataset``: itself, or what a wrapper that declares
    ``WRAPS`` on its class wraps (looked up on the class: a dataset's own ``__getattr__`` may
    answer any name)."""
    for _ in range(16):  # wrappers of wrappers; a cycle stops here
        attr = getattr(type(dataset), WRAPS, None)
        if type(attr) is not str:
            break
        dataset = getattr(dataset, attr)
    return dataset


def record(dataset: Any, *, per_source: bool = False) -> dict[str, Any]:
    """The state's record of ``dataset``: its class, and its fingerprint (None when it has no
    ``fingerprint()``, or when ``per_source``: a ``Mixture``'s plan holds each source's)."""
    dataset = recorded(dataset)
    name = class_name(dataset)
    fp = None if per_source else fingerprint_of(dataset, f"the dataset ({name})")
    return {K_CLASS: name, K_FINGERPRINT: fp}


def record_problem(rec: Any) -> str | None:
    """What is wrong with a record read from a state, or None if it is well formed."""
    if (
        isinstance(rec, dict)
        and type(rec.get(K_CLASS)) is str
        and K_FINGERPRINT in rec
        and (rec[K_FINGERPRINT] is None or type(rec[K_FINGERPRINT]) is str)
    ):
        return None
    return f"expected {{class: str, fingerprint: str or None}}, got {clip_repr(rec)}"


def changes(
    saved: dict[str, Any] | None, saved_len: Any, now: dict[str, Any] | None, now_len: Any
) -> list[str]:
    """What differs between the data a state was taken on and the data at hand, one line each.

    Args:
        saved: the state's record, or None (an older state: class and fingerprint not checked).
        saved_len: the state's ``config.dataset_len``.
        now: the loader's record, or None (only the length is compared).
        now_len: the loader's ``config.dataset_len``.
    """
    out = []
    if saved is not None and now is not None and saved[K_CLASS] != now[K_CLASS]:
        out.append(f"the dataset's class is {now[K_CLASS]}, the checkpoint's was {saved[K_CLASS]}")
    if saved_len != now_len:
        out.append(
            f"config.dataset_len (the dataset's length): the checkpoint has {saved_len!r}, "
            f"this loader has {now_len!r}"
        )
    if saved is not None and now is not None and saved[K_FINGERPRINT] != now[K_FINGERPRINT]:
        out.append(
            f"the dataset's fingerprint() is {clip_repr(now[K_FINGERPRINT], 120)}, the "
            f"checkpoint's was {clip_repr(saved[K_FINGERPRINT], 120)}"
        )
    return out


def changed_error(lines: Sequence[str], what: str = "DataLoader") -> CheckpointError:
    """The refusal of a state taken on other data (``on_dataset_change="raise"``)."""
    return CheckpointError(
        f"cannot load {what} state: the data changed since the checkpoint: {'; '.join(lines)}. "
        "Resume with the checkpoint's data; or pass load_state_dict(state, "
        "on_dataset_change='continue') to keep the checkpoint's position on the new data (what "
        "was consumed stays consumed, the rest is read from the new data); or start afresh "
        "without load_state_dict()."
    )


def warn_changed(lines: Sequence[str], what: str, stacklevel: int) -> None:
    """The one warning of a resume onto changed data (``on_dataset_change="continue"``)."""
    warnings.warn(
        f"{what}.load_state_dict(on_dataset_change='continue'): the data changed since the "
        f"checkpoint: {'; '.join(lines)}. Resuming by position: what was consumed stays "
        "consumed, and the rest is read from the new data.",
        RuntimeWarning,
        stacklevel=stacklevel + 1,
    )
