"""Saved states of an older commit still load and continue exactly: the checkpoint format's
promise to users, kept across refactors.

``tests/data/states/`` holds states written by the code at 575ea78 (before the layers redesign
of issue #32): each case's ``<case>.state`` is the ``dump_state`` bytes of a loader's
``state_dict()`` -- state version 4 (a job's global state: version 1, holding version-4 rank
states); the test reads the version from each file, see ``test_the_corpus_is_the_one_written``
-- and ``<case>.json`` the batches the uninterrupted run delivered after it (or, for a resume
under another configuration, the batches the resume delivered at that commit, checked there
against the uninterrupted run: see ``make_states.py``). Here each loader is rebuilt the way
``cases.py`` builds it, the bytes are loaded with the current code, and the batches must be
the recorded ones: the same values, in the same order.

A failure means that a user's saved checkpoint would no longer resume, or would resume at
another sample or with other values. Do not regenerate the corpus to make it pass: a state
already on a user's disk cannot be regenerated either. Make the code read it, or, if the format
must change, upgrade old states on load (as ``_schema`` does for earlier versions) and keep
these files.
"""

from __future__ import annotations

import base64
import json
import sys
import warnings
from pathlib import Path

import pytest

from resumable_loader import load_state

STATES = Path(__file__).parents[1] / "data" / "states"
# Imported as the top-level module ``cases``, as make_states.py imported it when it wrote the
# states: a user sampler's state records its class as ``module.qualname``.
sys.path.insert(0, str(STATES))
import cases  # noqa: E402

CASES = sorted(p.stem for p in STATES.glob("*.json"))

# A resume under another configuration does not hand back the state it loaded: the state right
# after the load describes the loader it is now. What it holds instead is checked per case.
CHANGED_AT_LOAD = {"rebatch", "mixture_new_weights", "dist_merged_on_1", "dist_merged_on_3"}

# The warnings a load may give, by case; any other RuntimeWarning from the load or the
# iteration fails the test (a warning is part of what the old state resumes to).
WARNS = {
    # 23 - (6 + 4) = 13 samples left: not a multiple of 3 ranks, so 2 are repeated to pad.
    "dist_merged_on_3": "13 samples of the epoch are left, not a multiple of 3",
}


def test_the_corpus_is_the_one_written() -> None:
    # A file lost from the corpus would silently make the test below smaller.
    assert (
        sorted(
            [
                "after_stop_iteration",
                "dist_merged_on_1",
                "dist_merged_on_3",
                "dist_rank0",
                "dist_rank1",
                "drop_last",
                "map_two_workers",
                "mixture",
                "mixture_new_weights",
                "rebatch",
                "rebuilt_batch_sampler",
                "seed_per_sample",
                "sequential_mid_epoch",
                "shuffle_epoch_end",
                "shuffle_mid_epoch",
                "shuffle_next_epoch",
                "stateful_sampler",
                "stream_two_workers",
            ]
        )
        == CASES
    )
    for name in CASES:
        record = json.loads((STATES / f"{name}.json").read_text())
        state = load_state((STATES / f"{name}.state").read_bytes())
        assert (state["format"], state["version"]) == (
            record["state_format"],
            record["state_version"],
        ), name
        # Every case holds loader states of version 4 (575ea78's), a global state in its ranks.
        ranks = [_rank_state(r)["version"] for r in state.get("ranks", [])]
        assert ranks == record["rank_state_versions"], name
        assert set(ranks or [state["version"]]) == {4}, name


def _rank_state(encoded: str) -> dict:
    return load_state(base64.b64decode(encoded))


def _check_state_at_load(name: str, saved: dict, now: dict, args: dict) -> None:
    """``state_dict()`` right after ``load_state_dict(saved)``."""
    if name not in CHANGED_AT_LOAD:
        # Loaded and not yet iterated, a loader's state is the state it loaded.
        assert now == saved
        return
    if name == "rebatch":
        # Saved after 3 batches of 4, resumed with batches of 6: the position becomes a sample
        # cut (the rest of the epoch starts at sample 12) and batches of the new size count
        # from there. Everything else is the saved state.
        assert now["config"] == dict(saved["config"], batch_size=6)
        assert (now["consumed"], now["sample_cut"]) == (0, {"start": 12, "holes": []})
        rest = {"config", "consumed", "sample_cut"}
        assert _without(now, rest) == _without(saved, rest)
    elif name == "mixture_new_weights":
        # The mixture was built with new weights: the plan keeps the saved weights up to the
        # resume point and records a rest of the shuffled epoch from place 12 (3 batches of 4)
        # under the new weights. Everything else is the saved state.
        old, new = saved["data_plan"], now["data_plan"]
        same = {"kind", "seed", "num_samples", "epoch", "sources"}
        assert {k: new[k] for k in same} == {k: old[k] for k in same}
        assert new["weights"][: len(old["weights"])] == old["weights"]
        assert new["weights"][-1]["weights"] == args["weights"]
        assert [(r["epoch"], r["from"], r["weights"]) for r in new["rests"]] == [
            (0, 12, args["weights"])
        ]
        assert _without(now, {"data_plan"}) == _without(saved, {"data_plan"})
    else:
        # A job's global state loaded outside torch.distributed.checkpoint: state_dict() is
        # this rank's own state, on the new world size, holding the epoch the saved ranks were
        # in and how many samples each of them took (the level its re-cut stands on).
        ranks = [_rank_state(r) for r in saved["ranks"]]
        assert now["format"] == ranks[0]["format"]
        assert now["version"] == ranks[0]["version"]
        assert (now["config"]["world_size"], now["config"]["rank"]) == (
            args["world"],
            args["rank"],
        )
        took = [r["consumed"] * r["config"]["batch_size"] for r in ranks]
        assert now["distributed"] == {
            "sampler_epoch": ranks[0]["distributed"]["sampler_epoch"],
            "history": [[saved["world_size"], took]],
            "ended": False,
        }
        assert now["epoch"] == ranks[0]["epoch"]


def _without(state: dict, keys: set[str]) -> dict:
    return {k: v for k, v in state.items() if k not in keys}


@pytest.mark.parametrize("name", CASES)
def test_a_saved_state_loads_and_continues_exactly(name: str) -> None:
    record = json.loads((STATES / f"{name}.json").read_text())
    data = (STATES / f"{name}.state").read_bytes()
    for run in record["runs"]:
        loader = cases.build(record["builder"], run["args"])
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loader.load_state_dict(load_state(data))
                _check_state_at_load(name, load_state(data), loader.state_dict(), run["args"])
                passes = []
                for epoch in run["set_epoch"]:
                    cases.start_pass(loader, epoch)
                    passes.append([cases.plain(b) for b in loader])
        finally:
            loader.close()
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        if name in WARNS:
            assert len(said) == 1 and WARNS[name] in said[0], said
        else:
            assert said == []
        where = f"{name}, rank {run['args'].get('rank', 0)}"
        for k, (got, want) in enumerate(zip(passes, run["passes"])):
            assert got == want, f"{where}: pass {k} after the resume differs"
        assert len(passes) == len(run["passes"]) == 2
