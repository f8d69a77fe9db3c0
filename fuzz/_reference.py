"""What the docs promise a user, as plain arithmetic: the reference model of ``test_fuzz_user``.

Nothing here reads the loader's state or calls its internals. An epoch's global order is a
pure function of (seed, epoch, dataset size), which the docs define:

* ``shuffle=False``: ``range(n)``;
* ``shuffle=True``: a permutation that depends only on the loader's generator seed and the
  epoch ("the epoch's order depends only on its seed, never on the batch size", data-plans.md;
  the permutation itself is not documented, so ``ShuffleOracle`` reads it once per epoch from a
  plain uninterrupted loader with batch size 1 and no workers, and checks it is a permutation);
* torch's ``DistributedSampler``: torch's own permutation (``seed + epoch``), padded by repeating
  its head or trimmed to a multiple of the world size; rank r takes r, r + W, ...
  (distributed.md). ``torch_shard`` asks torch's sampler itself, to check ``global_order``.

A sample is a *position* in that order; its value is ``value_of(position)`` (the dataset's item
at the index the order holds there; for a ``Mixture``, ``source_of`` at the epoch's global
position). The consumer's place in an epoch is, per rank, the positions of its share not yet
delivered; batches are consecutive chunks of it (``cut``), and every resume, re-cut or skip is a
move on those positions, as data-plans.md ("Another batch size", "Skips") and distributed.md
("Resuming on another number of ranks") describe it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DistributedSampler

# A padding position (a repeat that torch's DistributedSampler or a re-cut adds to even the
# shares) is a negative number: PAD - k stands for a repeat of position ``k``.
PAD = -1


def is_pad(pos: int) -> bool:
    return pos <= PAD


def pad_of(pos: int) -> int:
    """The position a padding entry repeats."""
    return PAD - pos


def padding(pos: int) -> int:
    """The padding entry that repeats position ``pos``."""
    return PAD - pos


@dataclass
class Spec:
    """How the job's sampler orders an epoch (everything the order depends on)."""

    n: int
    sampler: str  # "seq", "shuffle" or "dist"
    seed: int = 0
    dist_shuffle: bool = False
    dist_drop_last: bool = False


def torch_shard(spec: Spec, epoch: int, world: int, rank: int) -> list[int]:
    """Rank ``rank``'s indices for ``epoch`` as torch's own DistributedSampler gives them."""
    s = DistributedSampler(
        range(spec.n),
        num_replicas=world,
        rank=rank,
        shuffle=spec.dist_shuffle,
        seed=spec.seed,
        drop_last=spec.dist_drop_last,
    )
    s.set_epoch(epoch)
    return list(s)


def cut_for_ranks(positions: list[int], world: int, drop_last: bool) -> list[list[int]]:
    """Share ``positions`` (in order) among ``world`` ranks as torch cuts an epoch.

    Equal shares: the tail is trimmed to a multiple of ``world`` (``drop_last``) or padded by
    repeating the head (as torch repeats its indices' head); rank r takes r, r + W, ...
    """
    if drop_last:
        total = len(positions) // world * world
        padded = positions[:total]
    else:
        total = math.ceil(len(positions) / world) * world if positions else 0
        extra = total - len(positions)
        reps = (positions * math.ceil(extra / len(positions)))[:extra] if extra else []
        padded = positions + [padding(p) for p in reps]
    return [padded[r::world] for r in range(world)]


class ShuffleOracle:
    """The permutation of each epoch for ``shuffle=True`` and one generator seed.

    The docs promise that the order depends only on the generator's seed and the epoch (not on
    the batch size, the workers or any resume), so an uninterrupted loader of batch size 1 with
    no workers reads it; nothing else of the loader is used by the model.
    """

    def __init__(self, n: int, seed: int) -> None:
        from resumable_loader import DataLoader

        self.n = n
        self._loader = DataLoader(
            list(range(n)),
            batch_size=1,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed),
        )
        self._epochs: list[list[int]] = []

    def order(self, epoch: int) -> list[int]:
        while len(self._epochs) <= epoch:
            perm = [int(b) for b in self._loader]
            assert sorted(perm) == list(range(self.n)), f"shuffle=True gave {perm}"
            self._epochs.append(perm)
        return self._epochs[epoch]

    def close(self) -> None:
        self._loader.close()


def global_order(spec: Spec, epoch: int, oracle: ShuffleOracle | None) -> list[int]:
    """The dataset indices of ``epoch`` in order, padding excluded."""
    if spec.sampler == "seq":
        return list(range(spec.n))
    if spec.sampler == "shuffle":
        assert oracle is not None
        return list(oracle.order(epoch))
    if spec.dist_shuffle:
        g = torch.Generator()
        g.manual_seed(spec.seed + epoch)
        return torch.randperm(spec.n, generator=g).tolist()
    return list(range(spec.n))


def cut(share: list[int], batch_size: int, drop_last: bool) -> list[list[int]]:
    """A rank's share in consecutive batches; ``drop_last`` drops a short last one."""
    chunks = [share[i : i + batch_size] for i in range(0, len(share), batch_size)]
    if drop_last and chunks and len(chunks[-1]) < batch_size:
        chunks.pop()
    return chunks


@dataclass
class RankPlace:
    """One rank's place in an epoch: its share (positions, padding marked) and its batches."""

    share: list[int]
    batches: list[list[int]]
    delivered: set[int] = field(default_factory=set)

    def left(self) -> list[int]:
        """Positions of the share not delivered, in order (a dropped tail included)."""
        gone = {p for i in self.delivered for p in self.batches[i]}
        return [p for p in self.share if p not in gone]

    def delivered_positions(self) -> list[int]:
        return [p for i in sorted(self.delivered) for p in self.batches[i]]

    def done(self) -> bool:
        return len(self.delivered) == len(self.batches)


@dataclass
class Epoch:
    """The whole job's place in one epoch: the order and each rank's place."""

    epoch: int
    order: list[int]  # position -> dataset index, padding excluded
    ranks: list[RankPlace]
    # A skip that consumed the rest: the epoch still has to be iterated once (it yields
    # nothing), unlike an epoch whose last batch was delivered (data-plans.md, "Skips").
    emptied_by_skip: bool = False
    # Positions consumed or skipped before the current cut.
    gone: frozenset[int] = frozenset()

    def index(self, pos: int) -> int:
        return self.order[pad_of(pos) if is_pad(pos) else pos]

    def finished(self) -> bool:
        return all(r.done() for r in self.ranks) and not self.emptied_by_skip

    def left(self) -> list[int]:
        """Positions no rank has consumed, in the epoch's order, padding excluded."""
        # distributed.md: "the finished ranks count as having taken their whole share" (with
        # the DataLoader's drop_last, the short tail of a share that it never delivers too).
        taken = {p for r in self.ranks for p in (r.share if r.done() else r.delivered_positions())}
        if taken:
            # A level some rank consumed from is closed: its DistributedSampler(drop_last)
            # trim stays dropped (what issue 31 item 11 counts in the resize's warning).
            kept = {p for r in self.ranks for p in r.share if not is_pad(p)}
        else:
            # Nothing consumed since the last cut: no trim of it applies, all is left.
            kept = set(range(len(self.order))) - self.gone
        return sorted(kept - taken)


def start_epoch(
    spec: Spec,
    epoch: int,
    world: int,
    batch_size: int,
    drop_last: bool,
    oracle: ShuffleOracle | None,
) -> Epoch:
    """A fresh epoch as the docs define it, for ``world`` ranks (1 without a DistributedSampler)."""
    order = global_order(spec, epoch, oracle)
    positions = list(range(len(order)))
    shares = (
        cut_for_ranks(positions, world, spec.dist_drop_last)
        if spec.sampler == "dist"
        else [positions]
    )
    e = Epoch(epoch, order, [RankPlace(s, cut(s, batch_size, drop_last)) for s in shares])
    if spec.sampler == "dist":
        for r, place in enumerate(e.ranks):
            mine = [e.index(p) for p in place.share]
            assert mine == torch_shard(spec, epoch, world, r), (
                f"the model's shard of rank {r}/{world} in epoch {epoch} is {mine}, torch's "
                f"is {torch_shard(spec, epoch, world, r)}"
            )
    return e


def recut(
    e: Epoch,
    spec: Spec,
    world: int,
    batch_size: int,
    drop_last: bool,
    skip: int = 0,
) -> Epoch:
    """The rest of ``e`` after a resume that re-cuts it: another batch size, another number of
    ranks, or a skip of ``skip`` samples.

    Without a DistributedSampler the rest is the share's undelivered positions in order (the
    batches delivered ahead under in_order=False are holes; a dropped tail comes back into
    play), the first ``skip`` of them passed over, cut in batches. Under one, what no rank
    consumed (padding excluded) is shared among the new ranks as torch cuts an epoch.
    """
    left = e.left()
    rest = left[skip:]
    dist = spec.sampler == "dist"
    shares = cut_for_ranks(rest, world, spec.dist_drop_last) if dist else [rest]
    ranks = [RankPlace(s, cut(s, batch_size, drop_last)) for s in shares]
    gone = frozenset(range(len(e.order))) - frozenset(rest)
    out = Epoch(e.epoch, e.order, ranks, gone=gone)
    out.emptied_by_skip = bool(skip) and all(not r.batches for r in ranks)
    return out


def keep(e: Epoch) -> Epoch:
    """The rest of ``e`` as a same-shaped resume continues it: the same batches."""
    ranks = [
        RankPlace(list(r.share), [list(b) for b in r.batches], set(r.delivered)) for r in e.ranks
    ]
    return Epoch(e.epoch, e.order, ranks, e.emptied_by_skip, e.gone)


def values(e: Epoch, batch: list[int], value_of: Any) -> list[int]:
    """The values the positions of ``batch`` hold (``value_of(epoch, dataset index)``)."""
    return [value_of(e.epoch, e.index(p)) for p in batch]
