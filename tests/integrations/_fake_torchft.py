"""A pure-Python stand-in for torchft's ``Manager`` under a synchronous quorum (issue #34).

It does what torchft 0.2.0's ``Manager`` does as far as a data loader can see it
(``manager.py``; design-34 section 1.1):

* ``start_quorum()`` computes the step's quorum from the lighthouse's members (here: the
  ``World``'s groups that asked this round), sorted by replica id. Every member participates
  (sync quorum: healers included), ``participating_rank`` is the index in that order.
* A member whose step is below the quorum's ``max_step`` heals inside ``start_quorum``: its
  step becomes ``max_step`` and its registered ``load`` fns are called with what the source's
  registered ``state_dict`` fns return *at that moment* (in torchft, from the source's quorum
  thread while the source is inside its own ``start_quorum``). With ``init_sync`` at step 0
  every member but the first heals from it. A failed heal reports an error and leaves the
  step where it was.
* ``should_commit()`` is per group: True unless this group's step was errored or the world
  aborts the attempt; on True the step moves on.
* A second ``start_quorum`` in a step would be a second lighthouse round; the fake counts
  them so a test can assert the loader absorbed it.

``World`` runs G groups (one process each) in lockstep, one round per step attempt, and keeps
each group's *lineage* -- the committed attempts its state descends from -- so a test can
check what every live group's history trained.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Attempt:
    """One step attempt: what each participant dealt, and whether any group committed it."""

    aid: int
    step: int
    deals: dict[str, tuple[int | None, bool, list[int], int]] = field(default_factory=dict)
    # group -> (share, real, ids, epoch)


class World:
    """The lighthouse and the groups' ledger."""

    def __init__(self, *, init_sync: bool = True) -> None:
        self.init_sync = init_sync
        self.managers: dict[str, FakeManager] = {}  # live incarnations by replica id
        self.lineage: dict[str, list[int]] = {}  # replica id -> committed attempt ids
        self.attempts: list[Attempt] = []
        self._members: list[str] | None = None
        self.abort = False  # the round's allreduce fails for everyone
        self.local_fail: set[str] = set()  # groups whose should_commit is False this round
        self.fail_heal: set[str] = set()  # healers whose checkpoint fetch fails this round
        self._ids = itertools.count()

    def join(self, manager: FakeManager) -> None:
        self.managers[manager.replica_id] = manager
        self.lineage[manager.replica_id] = []

    def leave(self, replica_id: str) -> None:
        del self.managers[replica_id]

    def begin_round(self, members: list[str]) -> Attempt:
        """The groups that ask for this round's quorum (all of them before anyone deals)."""
        self._members = sorted(members)
        att = Attempt(next(self._ids), -1)
        self.attempts.append(att)
        return att

    def quorum(self, replica_id: str) -> tuple[list[str], int]:
        # Without rounds (a test of one loop): every live group asks at every step.
        members = self._members if self._members is not None else sorted(self.managers)
        assert replica_id in members
        max_step = max(self.managers[m]._step for m in members)
        return members, max_step

    def source_for(self, replica_id: str, max_step: int) -> str | None:
        """The up-to-date member a healer fetches from (None: it need not heal)."""
        members = self._members if self._members is not None else sorted(self.managers)
        me = self.managers[replica_id]
        up = [m for m in members if self.managers[m]._step == max_step]
        if me._step != max_step:
            return up[0]
        if self.init_sync and max_step == 0 and replica_id != up[0]:
            return up[0]
        return None


class FakeManager:
    """torchft's ``Manager`` as a loader sees it (sync quorum, min_replica_size=1)."""

    def __init__(self, world: World, replica_id: str, *, use_async_quorum: bool = False):
        self._world = world
        self.replica_id = replica_id
        self._use_async_quorum = use_async_quorum
        self._group_rank = 0
        self._group_world_size = 1
        self._step = 0
        self._errored: Exception | None = None
        self._quorum: tuple[int, int | None] | None = None
        self._participating_replica_rank: int | None = None
        # torchft's own two registries (the loader unregisters from them at close()).
        self._load_state_dict_fns: dict[str, Callable[[Any], None]] = {}
        self._user_state_dicts: dict[str, Callable[[], Any]] = {}
        self.quorums = 0  # lighthouse rounds asked for
        self.heals: list[tuple[int, str]] = []  # (step, source)
        world.join(self)

    # -- torchft's API --

    def register_state_dict_fn(
        self, key: str, load: Callable[[Any], None], save: Callable[[], Any]
    ) -> None:
        assert key not in self._load_state_dict_fns, key
        assert key not in self._user_state_dicts, key
        self._load_state_dict_fns[key] = load
        self._user_state_dicts[key] = save

    def _manager_state_dict(self) -> dict[str, Any]:
        user = {k: save() for k, save in self._user_state_dicts.items()}
        return {"user": user, "step": self._step}

    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False) -> None:
        self.quorums += 1
        self._errored = None
        members, max_step = self._world.quorum(self.replica_id)
        rank = members.index(self.replica_id)
        self._quorum = (len(members), rank)
        self._participating_replica_rank = rank
        source = self._world.source_for(self.replica_id, max_step)
        if source is None:
            return
        if self.replica_id in self._world.fail_heal:
            self._errored = RuntimeError("recv_checkpoint failed")
            return
        sent = self._world.managers[source]._manager_state_dict()
        self._step = sent["step"]
        self._world.lineage[self.replica_id] = list(self._world.lineage[source])
        self.heals.append((max_step, source))
        for key, load in self._load_state_dict_fns.items():
            load(sent["user"][key])

    def wait_quorum(self) -> None:
        assert self._quorum is not None, "wait_quorum before start_quorum"

    def num_participants(self) -> int:
        self.wait_quorum()
        assert self._quorum is not None
        return self._quorum[0]

    def participating_rank(self) -> int | None:
        self.wait_quorum()
        return self._participating_replica_rank

    def is_participating(self) -> bool:
        return self._participating_replica_rank is not None

    def current_step(self) -> int:
        return self._step

    def errored(self) -> Exception | None:
        return self._errored

    def report_error(self, e: Exception) -> None:
        self._errored = e

    def should_commit(self) -> bool:
        w = self._world
        ok = (
            self._errored is None
            and not w.abort
            and self.replica_id not in w.local_fail
            and self._quorum is not None
        )
        if ok:
            w.lineage[self.replica_id].append(w.attempts[-1].aid if w.attempts else -1)
            self._step += 1
        self._quorum = None
        return ok


class FakeOptimizer:
    """torchft's ``OptimizerWrapper``: ``zero_grad`` opens the quorum, ``step`` commits."""

    def __init__(self, manager: FakeManager) -> None:
        self.manager = manager

    def zero_grad(self) -> None:
        self.manager.start_quorum()

    def step(self) -> bool:
        return self.manager.should_commit()
