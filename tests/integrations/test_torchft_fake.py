"""ReplicaGroupLoader against a fake torchft Manager (issue #34, stages 1-2): the deal, the
committed cursor, healing through the registered state, and the refusals. No torchft needed.

The lockstep test runs G replica groups through random schedules -- joins, leaves (at the top
of a step or between backward and should_commit), aborted steps, one group's commit failing
alone, failed heals, epoch ends -- and checks every live group's committed history against an
uninterrupted plain loader: each epoch's committed samples, in step and share order, are that
run's order (so none missing, none twice), with the same values under ``seed_per_sample``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from _fake_torchft import FakeManager, FakeOptimizer, World
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resumable_loader import DataLoader, Mixture
from resumable_loader.core.errors import CheckpointError
from resumable_loader.integrations.torchft import ReplicaGroupLoader
from resumable_loader.plans.replica_deal import share_bounds, share_window, step_take
from resumable_loader.state.cursor import Cut
from resumable_loader.state.replica import position_of, state_at

# ---- the deal (plans.replica_deal) ----


@given(
    n=st.integers(1, 60),
    c_frac=st.floats(0, 1),
    shares=st.integers(1, 7),
    b=st.integers(1, 5),
)
def test_shares_of_a_step_tile_its_take(n: int, c_frac: float, shares: int, b: int) -> None:
    c = min(n - 1, int(c_frac * n))
    take = step_take(c, n, shares, b)
    got: list[int] = []
    for s in range(shares):
        lo, hi = share_bounds(take, shares, s, b)
        assert 0 <= hi - lo <= b
        got += range(lo, hi)
    assert got == list(range(take))
    sizes = [share_bounds(take, shares, s, b) for s in range(shares)]
    assert max(h - lo for lo, h in sizes) - min(h - lo for lo, h in sizes) <= (
        0 if take == shares * b else 1
    )


@given(
    n=st.integers(1, 80),
    c_frac=st.floats(0, 1),
    shares=st.integers(1, 5),
    b=st.integers(1, 4),
    max_steps=st.integers(1, 6),
)
def test_share_window_is_the_shares_of_the_next_steps(
    n: int, c_frac: float, shares: int, b: int, max_steps: int
) -> None:
    c = min(n - 1, int(c_frac * n))
    for share in range(shares):
        cut, steps = share_window(c, n, shares, share, b, max_steps)
        # Brute force: deal step after step from c, assuming each commits.
        want: list[list[int]] = []
        pos = c
        for _ in range(steps):
            take = step_take(pos, n, shares, b)
            lo, hi = share_bounds(take, shares, share, b)
            want.append(list(range(pos + lo, pos + hi)))
            pos += take
        if cut is None:
            assert steps == 1 and want == [[]]
            continue
        got = cut.positions(0, cut.left(n)).tolist()
        batches = [got[i : i + b] for i in range(0, len(got), b)]
        assert batches == want
        assert steps <= max_steps


def test_state_helpers_round_trip() -> None:
    dl = DataLoader(list(range(10)), batch_size=3)
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    assert position_of(state, 3) == 3
    at = state_at(state, 7)
    assert position_of(at, 3) == 7 and at["consumed"] == 0 and state["consumed"] == 1
    plain = DataLoader(list(range(10)), batch_size=3)
    plain.load_state_dict(at)
    assert [x.tolist() for x in plain] == [[7, 8, 9]]
    assert position_of({**state, "sample_cut": Cut(2, ((5, 1),)).to_state()}, 3) is None


# ---- the lockstep harness ----


class _Indexed(torch.utils.data.Dataset[Any]):
    """Item i is (i, a value drawn from the sample's RNG)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return i, torch.rand(())


def _loader(n: int, b: int, shuffle: bool, mixture: bool = False) -> DataLoader[Any]:
    data: Any = _Indexed(n)
    if mixture:
        data = Mixture({"a": _Indexed(n // 2), "b": _Indexed(n - n // 2)}, {"a": 1, "b": 1})
    return DataLoader(
        data,
        batch_size=b,
        shuffle=shuffle,
        seed_per_sample=True,
        generator=torch.Generator().manual_seed(7),
    )


def _reference(
    n: int, b: int, shuffle: bool, epochs: int, mixture: bool
) -> list[list[tuple[int, float]]]:
    dl = _loader(n, b, shuffle, mixture)
    out = []
    for _ in range(epochs):
        ep: list[tuple[int, float]] = []
        for ids, vals in dl:
            ep += zip(ids.tolist(), vals.tolist())
        out.append(ep)
    return out


class _Group:
    def __init__(self, world: World, gid: int, inc: int, n: int, b: int, kw: dict[str, Any]):
        self.rid = f"g{gid}:{inc}"
        self.manager = FakeManager(world, self.rid)
        self.rl = ReplicaGroupLoader(_loader(n, b, **kw), self.manager, window_steps=3)
        self.opt = FakeOptimizer(self.manager)
        self.it = iter(self.rl)


def _position(rl: ReplicaGroupLoader) -> tuple[int, int]:
    state = rl.state_dict()
    return int(state["epoch"]), int(state["sample_cut"]["start"])


_EVENTS = st.sampled_from(
    ["step"] * 6 + ["abort", "local_fail", "kill_top", "kill_after", "restart", "fail_heal"]
)


def _run(
    events: list[str],
    picks: list[int],
    *,
    groups: int,
    n: int,
    b: int,
    epochs: int,
    shuffle: bool,
    mixture: bool = False,
) -> tuple[World, dict[str, _Group], dict[int, Any]]:
    kw = {"shuffle": shuffle, "mixture": mixture}
    world = World()
    alive = {g.rid: g for g in (_Group(world, i, 0, n, b, kw) for i in range(groups))}
    dead_gids: list[int] = []
    incs = dict.fromkeys(range(groups), 0)
    finished: dict[str, _Group] = {}
    deals: dict[int, Any] = {}
    pick = iter(picks * 50)
    rounds = 0
    ev_iter = iter(events)
    while alive:
        rounds += 1
        assert rounds < 2000, "the schedule does not end"
        ev = next(ev_iter, "step")
        world.abort = ev == "abort"
        world.local_fail = set()
        world.fail_heal = set()
        kill_after: str | None = None
        if ev == "kill_top" and len(alive) > 1:
            rid = sorted(alive)[next(pick) % len(alive)]
            world.leave(rid)
            dead_gids.append(int(rid[1:].split(":")[0]))
            del alive[rid]
        elif ev == "local_fail":
            world.local_fail = {sorted(alive)[next(pick) % len(alive)]}
        elif ev in ("restart", "fail_heal") and dead_gids:
            gid = dead_gids.pop(next(pick) % len(dead_gids))
            incs[gid] += 1
            g = _Group(world, gid, incs[gid], n, b, kw)
            alive[g.rid] = g
            if ev == "fail_heal":
                world.fail_heal = {g.rid}
        # Groups at their epoch's end: begin the next one, or leave after the last.
        for rid in list(alive):
            g = alive[rid]
            epoch, pos = _position(g.rl)
            if pos == n:
                with pytest.raises(StopIteration):
                    next(g.it)
                if epoch == epochs - 1:
                    world.leave(rid)
                    finished[rid] = alive.pop(rid)
                    continue
                g.it = iter(g.rl)
        if not alive:
            break
        if ev == "kill_after" and len(alive) > 1:
            kill_after = sorted(alive)[next(pick) % len(alive)]
        att = world.begin_round(list(alive))
        for rid in sorted(alive, key=lambda r: hash((r, rounds)) % 7):
            g = alive[rid]
            ids, vals = next(g.it)
            g.opt.zero_grad()  # absorbed: the loader opened the step's quorum
            info = g.rl.last_step
            assert info is not None
            if g.manager.errored() is not None:
                world.abort = True  # its allreduce is skipped, so everyone's fails
            att.step = info.step
            att.deals[rid] = (
                info.share,
                info.real,
                list(zip(ids.tolist(), vals.tolist())),
                g.rl.epoch,
                (info.start, info.take, info.shares, g.manager.errored() is None),
            )
        if kill_after is not None:
            world.leave(kill_after)
            dead_gids.append(int(kill_after[1:].split(":")[0]))
            del alive[kill_after]
        for rid in sorted(alive):
            alive[rid].opt.step()
        deals[att.aid] = att
    return world, finished, deals


def _check(
    world: World,
    finished: dict[str, _Group],
    deals: dict[int, Any],
    reference: list[list[tuple[int, float]]],
) -> None:
    assert finished, "no group finished"
    by_aid = {a.aid: a for a in world.attempts}
    for att in world.attempts:
        # Every participant that took part for real dealt from the same place.
        places = {d[4][:3] for d in att.deals.values() if d[4][3]}
        assert len(places) <= 1, places
    for rid, g in finished.items():
        assert g.manager.quorums == len([a for a in world.attempts if rid in a.deals]), (
            "one quorum per step"
        )
        per_epoch: dict[int, list[tuple[int, float]]] = {}
        for aid in world.lineage[rid]:
            att = by_aid[aid]
            real = sorted((d for d in att.deals.values() if d[1]), key=lambda d: d[0])
            for _share, _real, items, epoch, _ in real:
                per_epoch.setdefault(epoch, []).extend(items)
        assert sorted(per_epoch) == list(range(len(reference)))
        for e, items in per_epoch.items():
            assert [i for i, _ in items] == [i for i, _ in reference[e]], (rid, e)
            torch.testing.assert_close([v for _, v in items], [v for _, v in reference[e]])


_SCHEDULES = {
    "events": st.lists(_EVENTS, max_size=30),
    "picks": st.lists(st.integers(0, 10), min_size=1, max_size=5),
    "groups": st.integers(1, 3),
    "n": st.integers(5, 40),
    "b": st.integers(1, 4),
    "shuffle": st.booleans(),
}


def _lockstep(
    events: list[str], picks: list[int], groups: int, n: int, b: int, shuffle: bool
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        world, finished, deals = _run(
            events, picks, groups=groups, n=n, b=b, epochs=2, shuffle=shuffle
        )
    _check(world, finished, deals, _reference(n, b, shuffle, 2, False))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**_SCHEDULES)
def test_lockstep_schedules_commit_every_sample_once(
    events: list[str], picks: list[int], groups: int, n: int, b: int, shuffle: bool
) -> None:
    _lockstep(events, picks, groups, n, b, shuffle)


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**_SCHEDULES)
def test_lockstep_schedules_commit_every_sample_once_soak(
    events: list[str], picks: list[int], groups: int, n: int, b: int, shuffle: bool
) -> None:
    _lockstep(events, picks, groups, n, b, shuffle)


def test_a_mixture_under_shuffle_with_a_kill_and_a_heal() -> None:
    events = ["step", "kill_after", "step", "abort", "restart", "step", "local_fail"]
    world, finished, deals = _run(
        events, [1], groups=3, n=22, b=2, epochs=2, shuffle=True, mixture=True
    )
    _check(world, finished, deals, _reference(22, 2, True, 2, True))
    healed = [m for m in world.managers.values()] + [g.manager for g in finished.values()]
    assert any(h for m in healed for h in m.heals if h[0] > 0), "a group healed mid-run"


# ---- the loop as torchft writes it, and the guarantees around it ----


def _ft(world: World, rid: str, n: int = 12, b: int = 2, **kw: Any) -> tuple[Any, ...]:
    m = FakeManager(world, rid)
    rl = ReplicaGroupLoader(DataLoader(list(range(n)), batch_size=b, shuffle=True, **kw), m)
    return m, rl, FakeOptimizer(m)


def test_for_loop_ends_at_the_same_committed_step_and_iter_starts_the_next_epoch() -> None:
    world = World()
    m, rl, opt = _ft(world, "g0", generator=torch.Generator().manual_seed(1))
    seen: list[int] = []
    for epoch in range(2):
        for batch in rl:
            opt.zero_grad()
            seen += batch.tolist()
            opt.step()
        assert sorted(seen[epoch * 12 :]) == list(range(12))
    assert m.current_step() == 12 and rl.epoch == 1
    # An aborted step is dealt again: the next() after it returns the same samples.
    it = iter(rl)
    first = next(it).tolist()
    world.abort = True
    opt.step()
    world.abort = False
    assert next(it).tolist() == first


def test_healer_resumes_from_a_live_peer_at_the_step_being_dealt() -> None:
    world = World()
    gen = {"generator": torch.Generator().manual_seed(3)}
    _m0, rl0, opt0 = _ft(world, "g0", **gen)
    for _ in range(3):
        world.begin_round(["g0"])
        next(rl0)
        opt0.zero_grad()
        opt0.step()
    # A new group, built on another generator: the heal gives it g0's seeds and position.
    m1, rl1, opt1 = _ft(world, "g1", generator=torch.Generator().manual_seed(99))
    world.begin_round(["g0", "g1"])
    b0 = next(rl0)
    b1 = next(rl1)
    assert m1.heals == [(3, "g0")] and m1.current_step() == 3
    assert rl0.last_step is not None and rl1.last_step is not None
    assert rl1.last_step.start == rl0.last_step.start == 6
    assert rl0.last_step.share == 0 and rl1.last_step.share == 1
    assert b0.tolist() + b1.tolist() == _plain_order(3, 12, 2)[6:10]
    opt0.zero_grad()
    opt1.zero_grad()
    assert opt0.step() and opt1.step()
    assert rl0.state_dict() == rl1.state_dict()


def _plain_order(seed: int, n: int, b: int) -> list[int]:
    dl = DataLoader(
        list(range(n)), batch_size=b, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    return [i for x in dl for i in x.tolist()]


def test_state_loads_into_a_plain_loader_and_a_whole_job_restart() -> None:
    world = World()
    gen = {"generator": torch.Generator().manual_seed(5)}
    _m, rl, opt = _ft(world, "g0", **gen)
    for _ in range(2):
        world.begin_round(["g0"])
        next(rl)
        opt.step()
    saved = rl.state_dict()
    assert saved["torchft"]["step"] == 2
    order = _plain_order(5, 12, 2)
    plain = DataLoader(list(range(12)), batch_size=5, shuffle=True)
    plain.load_state_dict({k: v for k, v in saved.items() if k != "torchft"})
    assert [i for x in plain for i in x.tolist()] == order[4:]
    # A whole-job restart: the loader's state may be loaded before the manager's (dcp.load
    # loads in key order), but a fresh manager (step 0) is refused at the first next().
    world2 = World()
    m2, rl2, _opt2 = _ft(world2, "g0")
    rl2.load_state_dict(saved)
    world2.begin_round(["g0"])
    with pytest.raises(CheckpointError, match="manager step 2 but the manager is at step 0"):
        next(rl2)
    assert m2.quorums == 0, "a refused next() opened a quorum"
    m2._step = 2  # manager.load_state_dict({"step": 2, ...})
    assert next(rl2).tolist() == order[4:6]


def test_empty_share_at_the_epochs_end_sits_the_step_out() -> None:
    world = World()
    gen = {"generator": torch.Generator().manual_seed(2)}
    ms = [_ft(world, f"g{i}", n=7, b=2, **gen) for i in range(3)]
    steps = 0
    got: list[int] = []
    while True:
        if all(rl.state_dict()["sample_cut"]["start"] == 7 for _, rl, _ in ms):
            break
        world.begin_round([f"g{i}" for i in range(3)])
        for m, rl, _ in ms:
            batch = next(rl)
            if rl.last_step.real:
                got += batch.tolist()
            else:
                assert not m.is_participating()
        for _, _, opt in ms:
            opt.step()
        steps += 1
    assert sorted(got) == list(range(7)) and steps == 2  # 6, then 1 over three shares


def test_two_processes_per_group_deal_rank_by_group_rank() -> None:
    # One manager per process in torchft; here one process of each group: g0's rank 0 and
    # g1's rank 1, of groups of two.
    world = World()
    rls = [
        ReplicaGroupLoader(
            DataLoader(list(range(16)), batch_size=2),
            FakeManager(world, f"g{g}"),
            group_rank=g,
            group_world_size=2,
        )
        for g in range(2)
    ]
    world.begin_round(["g0", "g1"])
    assert [next(rl).tolist() for rl in rls] == [[0, 1], [6, 7]]
    info = rls[1].last_step
    assert info is not None and info.shares == 4 and info.share == 3


# ---- refusals ----


def test_async_quorum_is_refused() -> None:
    m = FakeManager(World(), "g0", use_async_quorum=True)
    with pytest.raises(ValueError, match="use_async_quorum=False"):
        ReplicaGroupLoader(DataLoader(list(range(4)), batch_size=2), m)


class _Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(4))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dataset": _Stream(), "batch_size": 2}, "streams .* per committed step .* map-style"),
        ({"dataset": list(range(8)), "batch_size": 2, "in_order": False}, "in_order=True"),
        ({"dataset": list(range(8)), "batch_size": 2, "on_poison": "skip"}, "on_poison='raise'"),
        ({"dataset": list(range(8)), "batch_size": None}, "needs batch_size"),
        ({"dataset": list(range(8)), "batch_size": 2, "drop_last": True}, "drop_last=False"),
        (
            {
                "dataset": list(range(8)),
                "batch_sampler": torch.utils.data.BatchSampler(
                    torch.utils.data.SequentialSampler(range(8)), 2, False
                ),
            },
            "batch_sampler",
        ),
        (
            {
                "dataset": list(range(8)),
                "batch_size": 2,
                "sampler": torch.utils.data.DistributedSampler(
                    list(range(8)), num_replicas=2, rank=0
                ),
            },
            "drop the DistributedSampler",
        ),
        (
            {
                "dataset": list(range(8)),
                "batch_size": 2,
                "sampler": torch.utils.data.SubsetRandomSampler(range(8)),
            },
            "built-in order only",
        ),
    ],
)
def test_loaders_it_cannot_deal_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ReplicaGroupLoader(DataLoader(**kwargs), FakeManager(World(), "g0"))


def test_one_loader_per_manager_and_close_restores_it() -> None:
    m = FakeManager(World(), "g0")
    rl = ReplicaGroupLoader(DataLoader(list(range(4)), batch_size=2), m)
    assert "start_quorum" in m.__dict__ and "should_commit" in m.__dict__
    assert "resumable_loader" in m._user_state_dicts
    with pytest.raises(ValueError, match="one ReplicaGroupLoader per manager"):
        ReplicaGroupLoader(DataLoader(list(range(4)), batch_size=2), m, key="other")
    rl.close()
    assert "start_quorum" not in m.__dict__ and "should_commit" not in m.__dict__
    assert not m._user_state_dicts and not m._load_state_dict_fns


def test_a_heal_from_a_group_built_otherwise_is_refused() -> None:
    world = World()
    _m0, rl0, _ = _ft(world, "g0", b=2)
    _m1, rl1, _ = _ft(world, "g1", b=3)
    world.begin_round(["g0", "g1"])
    next(rl0)
    with pytest.raises(CheckpointError, match="batch_size=2, this loader has batch_size=3"):
        next(rl1)


def test_quorum_opened_before_next_is_joined_and_a_peer_reads_the_settled_step() -> None:
    # Loop order (b): zero_grad() before next(). The loader finds the quorum open and only
    # waits; a peer healing in that quorum reads the previous step as settled.
    world = World()
    gen = {"generator": torch.Generator().manual_seed(4)}
    m0, rl0, opt0 = _ft(world, "g0", **gen)
    got: list[int] = []
    for _ in range(2):
        opt0.zero_grad()
        got += next(rl0).tolist()
        opt0.step()
    m1, rl1, opt1 = _ft(world, "g1")
    world.begin_round(["g0", "g1"])
    opt0.zero_grad()  # g0's quorum is open; its last step is not settled by a next() yet
    opt1.zero_grad()  # g1 heals from g0 here
    assert m1.heals == [(2, "g0")]
    got += next(rl0).tolist() + next(rl1).tolist()
    assert m0.quorums == 3 and m1.quorums == 1
    opt0.step()
    opt1.step()
    assert got == _plain_order(4, 12, 2)[:8]


def test_workers_and_pinned_batches_through_a_kill_and_a_heal() -> None:
    # The deal is a loader state, so the loader's own pipeline runs it: worker processes,
    # pin_memory, per-sample seeds.
    world = World()
    make = {
        "batch_size": 3,
        "shuffle": True,
        "num_workers": 2,
        "persistent_workers": True,
        "pin_memory": torch.cuda.is_available(),
        "seed_per_sample": True,
    }

    def loader() -> DataLoader[Any]:
        made = DataLoader(_Indexed(30), generator=torch.Generator().manual_seed(11), **make)
        built.append(made)
        return made

    built: list[DataLoader[Any]] = []
    groups = {}
    for rid in ("g0", "g1"):
        m = FakeManager(world, rid)
        groups[rid] = (m, ReplicaGroupLoader(loader(), m))
    committed: list[tuple[int, float]] = []
    step = 0
    while any(rl.state_dict()["sample_cut"]["start"] < 30 for _, rl in groups.values()):
        world.begin_round(sorted(groups))
        dealt = {}
        for rid, (_, rl) in sorted(groups.items()):
            ids, vals = next(rl)
            dealt[rid] = list(zip(ids.tolist(), vals.tolist()))
        if step == 1:  # g1 dies after backward; its share is in the committed step
            world.leave("g1")
            del groups["g1"]
        if step == 3:  # g1 comes back and heals from g0
            m = FakeManager(world, "g1")
            groups["g1"] = (m, ReplicaGroupLoader(loader(), m))
        oks = [FakeOptimizer(m).step() for rid, (m, _) in sorted(groups.items()) if rid in dealt]
        if all(oks):
            committed += [x for rid in sorted(dealt) for x in dealt[rid]]
        step += 1
    assert groups["g1"][0].heals and groups["g1"][0].heals[0][0] > 0
    ref = loader()
    want = [x for ids, vals in ref for x in zip(ids.tolist(), vals.tolist())]
    assert [i for i, _ in committed] == [i for i, _ in want]
    torch.testing.assert_close([v for _, v in committed], [v for _, v in want])
    for made in built:
        made.close()


# ---- review 34's findings: what the wrapper takes in, and what a heal refuses ----


def test_a_loader_iterated_before_wrapping_starts_the_epoch_its_next_iter_would() -> None:
    # A peeked batch: a plain loader's next iter() is a new epoch, whole; so is the wrapper's.
    def peeked() -> DataLoader[Any]:
        dl = DataLoader(
            list(range(10)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3)
        )
        next(iter(dl))
        return dl

    plain = peeked()
    want = [i for x in plain for i in x.tolist()]
    m = FakeManager(World(), "g0")
    rl, opt = ReplicaGroupLoader(peeked(), m), FakeOptimizer(m)
    assert len(rl) == 5
    got: list[int] = []
    for batch in rl:
        opt.zero_grad()
        got += batch.tolist()
        assert opt.step()
    assert got == want


def _mix(weight_b: float, **kw: Any) -> DataLoader[Any]:
    mix = Mixture({"a": list(range(10)), "b": list(range(100, 110))}, {"a": 1, "b": weight_b})
    return DataLoader(
        mix, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0), **kw
    )


@pytest.mark.parametrize(
    ("theirs", "mine", "match"),
    [
        (
            {},
            {"seed_per_sample": True},
            "seed_per_sample=False, this loader has seed_per_sample=True",
        ),
        ({}, {"weight_b": 4}, r"Mixture has weights \{'a': 1, 'b': 1\}, this loader's has"),
    ],
)
def test_a_heal_from_a_group_that_draws_otherwise_is_refused(
    theirs: dict[str, Any], mine: dict[str, Any], match: str
) -> None:
    world = World()
    m0 = FakeManager(world, "g0")
    rl0 = ReplicaGroupLoader(_mix(theirs.pop("weight_b", 1), **theirs), m0)
    next(rl0)
    assert FakeOptimizer(m0).step()
    m1 = FakeManager(world, "g1")
    rl1 = ReplicaGroupLoader(_mix(mine.pop("weight_b", 1), **mine), m1)
    next(rl0)
    with pytest.raises(CheckpointError, match=match):
        next(rl1)


def test_after_a_restart_with_new_weights_a_group_built_with_them_heals() -> None:
    # Every group restarts from the checkpoint with weights b=4; later g1 dies and comes back
    # built the same way (b=4). Its heal is taken, and the epoch is the plain resume's.
    world = World()
    m0 = FakeManager(world, "g0")
    rl0, opt0 = ReplicaGroupLoader(_mix(1), m0), FakeOptimizer(m0)
    trained: list[int] = []
    for _ in range(2):
        trained += next(rl0).tolist()
        assert opt0.step()
    saved = rl0.state_dict()
    rl0.close()
    world2 = World()
    m0 = FakeManager(world2, "g0")
    m0._step = saved["torchft"]["step"]
    rl0, opt0 = ReplicaGroupLoader(_mix(4), m0), FakeOptimizer(m0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loader's own note of the new weights
        rl0.load_state_dict(saved)
    trained += next(rl0).tolist()
    assert opt0.step()
    m1 = FakeManager(world2, "g1")
    rl1, opt1 = ReplicaGroupLoader(_mix(4), m1), FakeOptimizer(m1)
    while True:
        try:
            dealt = next(rl0).tolist() + next(rl1).tolist()
        except StopIteration:
            break
        trained += dealt
        assert opt0.step() and opt1.step()
    assert m1.heals, "g1 did not heal from g0"
    plain = _mix(1)
    it = iter(plain)
    want = [i for _ in range(2) for i in next(it).tolist()]
    resumed = _mix(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed.load_state_dict(plain.state_dict())
    want += [i for x in resumed for i in x.tolist()]
    assert sorted(trained) == sorted(want)
