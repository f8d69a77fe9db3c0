"""The deal of one training step's global batch over the step's shares (issue #34).

Under replica groups (torchft) the job's position is one committed prefix ``[0, c)`` of the
epoch's order, the same on every group. Step ``k`` takes the next ``take`` positions and cuts
them into ``shares`` consecutive blocks, one per process that trains the step (``shares =
participants x group world size``). Nothing here knows about torchft: it is arithmetic on
``(c, n, shares, share, per_share)``, so any group computes any other group's block without
talking to it, and a step that did not commit is dealt again from the same ``c`` for whoever
trains it next.

The rule: a full step takes ``shares * per_share`` positions, one batch of ``per_share`` per
share. Only the epoch's last step can be short; its ``take = n - c`` is spread evenly (blocks
differ by at most one position, none larger than ``per_share``), so no process gets a tiny
remainder while another gets a whole batch. A share is empty only when fewer positions than
shares are left.

``share_window`` turns "this share of the next steps" into a ``Cut`` (``state.cursor``): the
share's blocks are what is left, the other shares' blocks are holes. A plain loader state with
that cut, iterated with batch size ``per_share``, yields exactly this share's batch of each
step in turn -- the whole pipeline (workers, prefetch, pin_memory, a Mixture) is the loader's
own, and the window is where speculation lives: it is thrown away when a step surprises.
"""

from __future__ import annotations

from ..state.cursor import Cut

__all__ = ["share_bounds", "share_window", "step_take"]


def step_take(c: int, n: int, shares: int, per_share: int) -> int:
    """How many positions of an epoch of ``n`` the step dealt at ``c`` takes."""
    if shares < 1 or per_share < 1:
        raise ValueError(f"shares and per_share must be >= 1, not {shares} and {per_share}")
    if not 0 <= c <= n:
        raise ValueError(f"the cursor {c} is outside the epoch's {n} positions")
    return min(shares * per_share, n - c)


def share_bounds(take: int, shares: int, share: int, per_share: int) -> tuple[int, int]:
    """Share ``share``'s items ``[lo, hi)`` of a step that takes ``take`` positions."""
    if not 0 <= share < shares:
        raise ValueError(f"share {share} is outside [0, {shares})")
    if take == shares * per_share:
        return share * per_share, (share + 1) * per_share
    return share * take // shares, (share + 1) * take // shares


def share_window(
    c: int, n: int, shares: int, share: int, per_share: int, max_steps: int
) -> tuple[Cut | None, int]:
    """This share's blocks of the steps dealt from ``c``, as a cut of the epoch.

    Returns ``(cut, steps)``: the cut's batches of ``per_share`` are the share's batches of the
    next ``steps`` steps (at most ``max_steps``), assuming each of them commits with the same
    shares. Full steps are windowed together; the epoch's short last step is a window of its
    own. ``cut`` is None when this share of the next step is empty (``steps`` is then 1).
    """
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, not {max_steps}")
    step = shares * per_share
    full = (n - c) // step
    if full == 0:
        take = step_take(c, n, shares, per_share)
        lo, hi = share_bounds(take, shares, share, per_share)
        if lo == hi:
            return None, 1
        start, end = c + lo, c + hi
        tail = ((end, n - end),) if end < n else ()
        return Cut(start, tail), 1
    steps = min(full, max_steps)
    lo = share * per_share
    start = c + lo
    holes: list[tuple[int, int]] = []
    if shares > 1:
        # Between this share's block of step t and of step t+1: the other shares' blocks.
        gap = step - per_share
        holes = [(c + t * step + lo + per_share, gap) for t in range(steps - 1)]
    end = c + (steps - 1) * step + lo + per_share
    if end < n:
        holes.append((end, n - end))
    return Cut(start, tuple(holes)), steps
