"""The state schema (``_schema``): ``ResumePoint.to_state`` and ``from_state`` are inverses.

Every writer of a state goes through ``to_state`` and the one reader is ``from_state``; a
Hypothesis property checks that a position survives the round trip unchanged, and that a state
read back is written out again exactly (types, key order and all)."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_loader._schema import KNOWN_KEYS, ResumePoint, WorkerPosition
from resumable_loader._seeding import SeedChain
from resumable_loader.testing import roundtrip_state, same_state

ints = st.integers(min_value=0, max_value=10**6)
plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


# A seed chain: a root and the next epoch's number, or a CPU generator's state.
chains = st.builds(
    lambda root, n: {"root": root, "next": n}, st.integers(0, 2**63 - 1), st.integers(0, 2**40)
) | st.integers(0, 2**63 - 1).map(lambda s: SeedChain(torch.Generator().manual_seed(s)).state())


@st.composite
def positions(draw: Any) -> tuple[ResumePoint, dict[str, Any]]:
    kind = draw(st.sampled_from(["map", "stateful", "iterable"]))
    num_workers = draw(st.integers(0, 4))
    config = {
        "dataset_kind": "iterable" if kind == "iterable" else "map",
        "dataset_len": None if kind == "iterable" else 1000,
        "batch_size": draw(st.sampled_from([None, 1, 8])),
        "drop_last": draw(st.booleans()),
        "sampler": "RandomSampler",
        "num_workers": num_workers,
        "world_size": 1,
        "rank": 0,
    }
    consumed = draw(ints)
    rp = ResumePoint(
        seed=draw(st.integers(0, 2**63 - 1)),
        epoch=draw(ints),
        chain=draw(chains),
        consumed=consumed,
        stateful=kind == "stateful",
        iterable=kind == "iterable",
    )
    if kind != "iterable":
        rp.ahead = frozenset(draw(st.lists(st.integers(consumed + 1, consumed + 50), max_size=4)))
    if kind == "stateful":
        rp.drawn = consumed + len(rp.ahead) + draw(st.integers(0, 5))
        rp.sampler_state = draw(plain)
        rp.sampler_done = draw(st.booleans())
        ids = st.integers(0, rp.drawn - 1) if rp.drawn else st.nothing()
        tids = draw(st.lists(ids, unique=True, max_size=3 if rp.drawn else 0))
        rp.outstanding = sorted((t, [(2 * t) % 1000, (2 * t + 1) % 1000]) for t in tids)
    if kind == "iterable":
        for _ in range(max(1, num_workers)):
            delivered = draw(ints)
            state = draw(st.none() | plain.filter(lambda v: v is not None))
            at = draw(st.integers(0, delivered)) if state is not None else 0
            rp.workers.append(WorkerPosition(delivered, draw(st.booleans()), state, at))
        rp.next_worker = draw(st.integers(0, max(1, num_workers) - 1))
    rp.skipped = [[draw(ints), draw(ints), [1, 2]] for _ in range(draw(st.integers(0, 2)))]
    return rp, config


@settings(max_examples=200, deadline=None)
@given(positions(), st.sampled_from(["dict", "bytes", "torch", "json"]))
def test_to_state_then_from_state_is_the_identity(
    case: tuple[ResumePoint, dict[str, Any]], via: str
) -> None:
    rp, config = case
    sd = rp.to_state(config)
    assert list(sd)[:5] == list(KNOWN_KEYS)[:5]
    assert all(k in KNOWN_KEYS for k in sd)
    back = ResumePoint.from_state(roundtrip_state(sd, via), config, rp.stateful)
    assert back == rp
    assert same_state(back.to_state(config), sd)
