"""Write the saved-state corpus: ``<case>.state`` (``dump_state`` bytes) and ``<case>.json``.

Run by hand, from the repository root, at the commit whose states the corpus should hold:

    PYTHONPATH=$PWD python tests/data/states/make_states.py [--overwrite]

It is not a test (pytest collects only ``test_*.py``) and the corpus is not regenerated in CI:
its point is to keep states written by *old* code, which ``tests/state/test_saved_states.py`` loads
with the current code. Regenerating it at a newer commit would throw that away, so the script
writes only the cases that have no files yet (new cases go next to the old files) unless
``--overwrite`` is given.

Each case builds a loader (``cases.py``), runs it part-way, saves ``state_dict()``, and keeps
running the same loader -- the uninterrupted run -- to record the batches due next: the rest of
the pass the state was taken in and one more full pass (or two full passes after a state taken
after the epoch's last batch, at ``StopIteration`` or just before it). A case resumed under
another configuration (another batch size, new mixture weights, another number of ranks) has no
uninterrupted run of its own: its batches are those a loader resumed at this commit delivers,
and the script checks them against the uninterrupted run where the two must agree (the same
samples, re-cut; every sample of the epoch once) before writing the case.
"""

from __future__ import annotations

import base64
import collections
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cases  # noqa: E402

from resumable_loader import dump_state, load_state, merge_rank_states  # noqa: E402


# ---- running a loader --------------------------------------------------------------------------
def run_to_save(loader, prefix: list[tuple[int | None, int | None]]):
    """Runs the passes of ``prefix``, each ``(set_epoch, batches)`` (``None`` batches: to
    ``StopIteration``); returns the last pass's live iterator (None if it ended) and the
    batches consumed."""
    it, taken = None, []
    for epoch, take in prefix:
        cases.start_pass(loader, epoch)
        it = iter(loader)
        if take is None:
            taken += [cases.plain(b) for b in it]
            it = None
        else:
            taken += [cases.plain(next(it)) for _ in range(take)]
    return it, taken


def continue_run(loader, it, set_epoch: list[int | None]) -> list[list[Any]]:
    """The passes after the save point: the rest of ``it`` (if the save was inside a pass),
    then full passes, each started as ``set_epoch`` says."""
    rest = [] if it is None else [cases.plain(b) for b in it]
    if not rest:
        # Saved after the epoch's last batch: the state says "epoch e + 1, nothing consumed",
        # and a resumed loader's next ``for`` is that epoch, as the uninterrupted run's next
        # ``for`` is. The empty rest is not a pass of its own.
        it = None
    passes = []
    for k, epoch in enumerate(set_epoch):
        if k == 0 and it is not None:
            assert epoch is None, "a pass already under way is not restarted"
            passes.append(rest)
        else:
            cases.start_pass(loader, epoch)
            passes.append([cases.plain(b) for b in loader])
    return passes


def resumed_run(builder: str, args: dict, data: bytes, set_epoch: list[int | None]):
    """What a loader built from ``args`` delivers after loading ``data``, and its state right
    after the load."""
    loader = cases.build(builder, args)
    try:
        loader.load_state_dict(load_state(data))
        at_load = loader.state_dict()
        return continue_run(loader, None, set_epoch), at_load
    finally:
        loader.close()


def flat(passes: list[list[Any]]) -> list[Any]:
    return [item for batches in passes for batch in batches for item in batch]


# ---- the cases ---------------------------------------------------------------------------------
N = 30  # not a multiple of the batch sizes: every epoch ends with a short batch
N_DIST = 23  # not a multiple of 2 or 3 ranks: DistributedSampler pads

# name: (why, builder, args, prefix, set_epoch after the save)
SIMPLE: dict[str, tuple[str, str, dict, list, list]] = {
    "shuffle_mid_epoch": (
        "shuffle=True with a seeded generator, 3 batches into epoch 0",
        "map",
        dict(n=N, batch_size=4, shuffle=True, seed=11),
        [(None, 3)],
        [None, None],
    ),
    "shuffle_next_epoch": (
        "shuffle=True, across an epoch boundary: all of epoch 0, then 2 batches of epoch 1",
        "map",
        dict(n=N, batch_size=4, shuffle=True, seed=12),
        [(None, None), (None, 2)],
        [None, None],
    ),
    "sequential_mid_epoch": (
        "shuffle=False, 5 batches into epoch 0",
        "map",
        dict(n=N, batch_size=4),
        [(None, 5)],
        [None, None],
    ),
    "shuffle_epoch_end": (
        "shuffle=True, every batch of epoch 0 consumed but the iterator not yet at StopIteration",
        "map",
        dict(n=N, batch_size=4, shuffle=True, seed=13),
        [(None, 8)],
        [None, None],
    ),
    "after_stop_iteration": (
        "shuffle=True, saved after epoch 0's iterator raised StopIteration",
        "map",
        dict(n=N, batch_size=4, shuffle=True, seed=14),
        [(None, None)],
        [None, None],
    ),
    "drop_last": (
        "shuffle=True, drop_last=True, 4 batches into epoch 0",
        "map",
        dict(n=N, batch_size=4, shuffle=True, seed=15, drop_last=True),
        [(None, 4)],
        [None, None],
    ),
    "seed_per_sample": (
        "seed_per_sample=True over a random augmentation, shuffled, 3 batches into epoch 0",
        "map",
        dict(n=N, batch_size=4, shuffle=True, seed=16, jitter=True, seed_per_sample=True),
        [(None, 3)],
        [None, None],
    ),
    "map_two_workers": (
        "a random augmentation (per-task seeds) with num_workers=2, shuffled, mid-epoch",
        "map",
        dict(n=N, batch_size=4, shuffle=True, seed=17, jitter=True, num_workers=2),
        [(None, 3)],
        [None, None],
    ),
    "stream_two_workers": (
        "an IterableDataset with state_dict/load_state_dict split over num_workers=2",
        "stream",
        dict(n=25, batch_size=3, num_workers=2),
        [(None, 3)],
        [None, None],
    ),
    "stateful_sampler": (
        "a user sampler with its own state_dict/load_state_dict",
        "sampler",
        dict(n=N, batch_size=4, seed=3),
        [(None, 3)],
        [None, None],
    ),
    "rebuilt_batch_sampler": (
        "our BatchSampler from loader.batch_sampler passed as batch_sampler= (accelerate)",
        "rebuilt",
        dict(n=N, batch_size=4, seed=18),
        [(None, 3)],
        [None, None],
    ),
    "dist_rank0": (
        "DistributedSampler(num_replicas=2, rank=0, shuffle), 2 batches into sampler epoch 1",
        "dist",
        dict(n=N_DIST, batch_size=2, world=2, rank=0, seed=7),
        [(1, 2)],
        [None, 2],
    ),
    "dist_rank1": (
        "DistributedSampler(num_replicas=2, rank=1, shuffle), 3 batches into sampler epoch 1",
        "dist",
        dict(n=N_DIST, batch_size=2, world=2, rank=1, seed=7),
        [(1, 3)],
        [None, 2],
    ),
    "mixture": (
        "a Mixture of two sources weighted 2:1, shuffled, 3 batches into epoch 0",
        "mixture",
        dict(
            sources={"web": [20, 0], "code": [10, 1000]},
            weights={"web": 2, "code": 1},
            batch_size=4,
            mix_seed=5,
            shuffle=True,
            seed=19,
        ),
        [(None, 3)],
        [None, None],
    ),
}


def write(name: str, data: bytes, record: dict) -> None:
    if (HERE / f"{name}.state").exists() and "--overwrite" not in sys.argv:
        print(f"kept {name}: it holds states of the commit that wrote it")
        return
    (HERE / f"{name}.state").write_bytes(data)
    (HERE / f"{name}.json").write_text(json.dumps(record) + "\n")


def record_of(name: str, why: str, builder: str, data: bytes, runs: list[dict]) -> dict:
    state = load_state(data)
    return {
        "case": name,
        "why": why,
        "state_format": state["format"],
        "state_version": state["version"],
        # A job's global state (merge_rank_states) has its own version and holds each rank's
        # state as the base64 of bytes in the loader's format.
        "rank_state_versions": [
            load_state(base64.b64decode(r))["version"] for r in state.get("ranks", [])
        ],
        "builder": builder,
        "runs": runs,
    }


def simple_cases() -> None:
    for name, (why, builder, args, prefix, set_epoch) in SIMPLE.items():
        loader = cases.build(builder, args)
        it, _ = run_to_save(loader, prefix)
        data = dump_state(loader.state_dict())
        passes = continue_run(loader, it, set_epoch)
        del it
        loader.close()
        # The corpus is only worth keeping if the code that wrote it resumes it exactly.
        again, _ = resumed_run(builder, args, data, set_epoch)
        assert again == passes, f"{name}: this commit does not resume its own state"
        run = {"args": args, "set_epoch": set_epoch, "passes": passes, "reference": "uninterrupted"}
        write(name, data, record_of(name, why, builder, data, [run]))


def rebatch_case() -> None:
    # Saved with batch size 4, resumed with 6: the same samples in the same order, re-cut.
    why = "shuffle=True, saved with batch_size=4 after 3 batches, resumed with batch_size=6"
    args = dict(n=N, batch_size=4, shuffle=True, seed=21)
    loader = cases.build("map", args)
    it, _ = run_to_save(loader, [(None, 3)])
    data = dump_state(loader.state_dict())
    reference = continue_run(loader, it, [None, None])
    del it
    loader.close()
    new_args = dict(args, batch_size=6)
    passes, _ = resumed_run("map", new_args, data, [None, None])
    assert flat(passes[:1]) == flat(reference[:1]), "the rest of the epoch is not the same samples"
    assert all(len(b) == 6 for b in passes[0][:-1])
    assert flat(passes[1:]) == flat(reference[1:]), "the next epoch holds other samples"
    run = {
        "args": new_args,
        "set_epoch": [None, None],
        "passes": passes,
        "reference": "resumed at the corpus's commit; its samples are the uninterrupted run's",
    }
    write("rebatch", data, record_of("rebatch", why, "map", data, [run]))


def mixture_new_weights_case() -> None:
    why = "a Mixture saved under weights 2:1, 3 shuffled batches in, resumed with weights 1:3"
    args = SIMPLE["mixture"][2]
    loader = cases.build("mixture", args)
    it, _ = run_to_save(loader, [(None, 3)])
    data = dump_state(loader.state_dict())
    reference = continue_run(loader, it, [None, None])
    del it
    loader.close()
    new_args = dict(args, weights={"web": 1, "code": 3})
    passes, _ = resumed_run("mixture", new_args, data, [None, None])
    # The rest of the epoch is the same number of samples with more of "code" (values >= 1000).
    assert len(flat(passes[:1])) == len(flat(reference[:1]))
    code = sum(v[0] >= 1000 for v in flat(passes[:1]))
    assert code > sum(v[0] >= 1000 for v in flat(reference[:1])), "the new weights did not apply"
    run = {
        "args": new_args,
        "set_epoch": [None, None],
        "passes": passes,
        "reference": "resumed at the corpus's commit with the new weights (no uninterrupted run)",
    }
    write(
        "mixture_new_weights", data, record_of("mixture_new_weights", why, "mixture", data, [run])
    )


def merged_cases() -> None:
    # Two ranks of a job, rank 0 one batch ahead (as ranks are when a job is stopped), merged
    # into the job's global state and resumed on 1 and on 3 ranks.
    base = dict(n=N_DIST, batch_size=2, seed=7)
    taken, states = [], []
    for rank, steps in ((0, 3), (1, 2)):
        loader = cases.build("dist", dict(base, world=2, rank=rank))
        it, got = run_to_save(loader, [(1, steps)])
        taken += [v[0] for b in got for v in b]
        states.append(loader.state_dict())
        del it
        loader.close()
    data = dump_state(merge_rank_states(states))
    epoch = torch.randperm(N_DIST, generator=torch.Generator().manual_seed(7 + 1)).tolist()
    for world in (1, 3):
        name = f"dist_merged_on_{world}"
        why = f"the global state of 2 DistributedSampler ranks (one a batch ahead), on {world}"
        runs = []
        for rank in range(world):
            args = dict(base, world=world, rank=rank)
            passes, _ = resumed_run("dist", args, data, [None, 2])
            runs.append(
                {
                    "args": args,
                    "set_epoch": [None, 2],
                    "passes": passes,
                    "reference": "resumed at the corpus's commit; the ranks' rest of the epoch "
                    "holds every sample the saved ranks had not taken",
                }
            )
        rest = [v[0] for r in runs for b in r["passes"][0] for v in b]
        delivered = collections.Counter(taken + rest)
        assert set(delivered) == set(epoch), f"{name}: a sample of the epoch is missing"
        assert max(delivered.values()) <= 2, f"{name}: a sample came three times"
        write(name, data, record_of(name, why, "dist", data, runs))


def main() -> None:
    torch.manual_seed(0)  # the loaders' seed roots without a generator: a reproducible corpus
    simple_cases()
    rebatch_case()
    mixture_new_weights_case()
    merged_cases()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
    ).stdout.strip()
    size = sum(p.stat().st_size for p in HERE.iterdir() if p.is_file())
    print(f"{len(list(HERE.glob('*.state')))} cases, run at {commit}, {size} bytes in all")


if __name__ == "__main__":
    main()
