"""The loader's arguments beyond what torch's constructor checks: the ones torch stores
unchecked (they would fail far from the call that passed them), and our own.

Each check raises the error a user can act on, naming the argument, the value and the fix.
"""

from __future__ import annotations

from typing import Any

import torch

from ..pipeline.fetch import RetryPolicy
from ..state.codec import clip_text


def check_deferred_args(generator: Any, prefetch_factor: Any) -> None:
    """Check the arguments torch's constructor stores unchecked: a wrong one would fail at the
    first batch, far from the call that passed it (torch: TypeError or AssertionError from its
    iterator) -- or, for prefetch_factor 0, not at all."""
    if generator is not None and not isinstance(generator, torch.Generator):
        seed = generator if type(generator) is int else "seed"
        raise TypeError(
            f"generator must be a torch.Generator or None, got {_kind(generator)} "
            f"{clip_text(repr(generator), 60)}; to seed the loader, pass "
            f"generator=torch.Generator().manual_seed({seed})"
        )
    # torch's constructor has refused it without workers, and made None 2 with them.
    if prefetch_factor is not None and (
        isinstance(prefetch_factor, bool) or not isinstance(prefetch_factor, int)
    ):
        raise TypeError(
            f"prefetch_factor must be an int >= 1 (batches loaded ahead per worker) or None, "
            f"got {_kind(prefetch_factor)} {clip_text(repr(prefetch_factor), 60)}"
        )
    if prefetch_factor is not None and prefetch_factor < 1:
        raise ValueError(
            f"prefetch_factor must be an int >= 1 (batches loaded ahead per worker) or None, "
            f"got {prefetch_factor}"
        )


def _kind(value: Any) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def check_our_args(
    task_timeout: float | None,
    max_task_attempts: int,
    on_poison: str,
    retry: RetryPolicy | None,
    stream_state_every: int | None,
    snapshot_every_n_steps: int | None,
    seed_per_sample: bool,
) -> int | None:
    """Validate the arguments beyond torch's; return ``stream_state_every`` with torchdata's
    ``snapshot_every_n_steps`` folded in."""
    if task_timeout is not None and not task_timeout > 0:
        raise ValueError(
            f"task_timeout must be a positive number of seconds or None, got {task_timeout!r}"
        )
    if type(max_task_attempts) is not int or max_task_attempts < 1:
        raise ValueError(f"max_task_attempts must be an int >= 1, got {max_task_attempts!r}")
    if on_poison not in ("raise", "skip"):
        raise ValueError(f"on_poison must be 'raise' or 'skip', got {on_poison!r}")
    if snapshot_every_n_steps is not None:
        # torchdata's name for the same thing: a migration is an import change.
        if stream_state_every not in (None, snapshot_every_n_steps):
            raise ValueError(
                f"snapshot_every_n_steps={snapshot_every_n_steps!r} and stream_state_every="
                f"{stream_state_every!r} disagree: they are two names for one setting; "
                "pass one of them"
            )
        # torchdata's 0 means "no periodic snapshots": our adaptive default, which snapshots
        # only as often as it is cheap and replays exactly in between.
        stream_state_every = snapshot_every_n_steps or None
    if stream_state_every is not None and (
        type(stream_state_every) is not int or stream_state_every < 1
    ):
        raise ValueError(
            f"stream_state_every must be an int >= 1 or None, got {stream_state_every!r}"
        )
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise TypeError(f"retry must be a resumable_loader.RetryPolicy or None, got {retry!r}")
    if type(seed_per_sample) is not bool:
        raise TypeError(f"seed_per_sample must be a bool, got {seed_per_sample!r}")
    return stream_state_every
