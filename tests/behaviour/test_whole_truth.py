"""The state is the whole truth: after ``load_state_dict()`` the rest of the job -- the
interrupted epoch and every later one, indices and augmentation values -- is the uninterrupted
job, whatever the resumed process's RNGs hold, whatever seed it used and whatever ``generator``
its loader got.

Each row is a training script shaped as the README's quickstart (``tests/_resume_job.py``: seed
at the top, every step drawing from torch, numpy and ``random``), run three ways: uninterrupted
(the reference), stopped at a step after saving the state (``break``, an exception, or SIGKILL in
a child process), and resumed in a *new process* whose RNGs moved. The stopped run's batches
followed by the resumed run's must be the reference's, for all three epochs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader

from resumable_loader import CheckpointError, DataLoader
from resumable_loader.testing import canonical

sys.path.insert(0, str(Path(__file__).parents[1]))
import _resume_job as job

JOB = str(Path(__file__).parents[1] / "_resume_job.py")

# (id, spec of the first run, what the restarted script changes, where it stops, how)
ROWS: list[tuple[str, dict[str, Any], dict[str, Any], list[int], str]] = [
    ("quickstart-map-w0-e0", {"kind": "map", "workers": 0}, {"noise": 5}, [0, 2], "break"),
    ("quickstart-map-w2-e1", {"kind": "map", "workers": 2}, {"noise": 3}, [1, 1], "raise"),
    ("another-seed-map-w2", {"kind": "map", "workers": 2}, {"seed": 1234}, [1, 3], "break"),
    (
        "another-generator-map-w0",
        {"kind": "map", "workers": 0, "generator": 1},
        {"generator": 99},
        [1, 0],
        "break",
    ),
    (
        "generator-added-map-w2-persistent",
        {"kind": "map", "workers": 2, "persistent": True},
        {"generator": 5, "seed": 77},
        [0, 4],
        "break",
    ),
    ("quickstart-stream-w0-e1", {"kind": "stream", "workers": 0}, {"noise": 2}, [1, 2], "raise"),
    ("another-seed-stream-w2", {"kind": "stream", "workers": 2}, {"seed": 4321}, [0, 3], "break"),
    (
        "persistent-stream-w2-generator",
        {"kind": "stream", "workers": 2, "persistent": True, "generator": 3},
        {"generator": 8, "noise": 9},
        [1, 4],
        "break",
    ),
    ("sigkill-map-w2-e1", {"kind": "map", "workers": 2}, {"seed": 9}, [1, 2], "kill"),
]


def _lines(path: Path) -> list[Any]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _child(spec: dict[str, Any], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(
        [sys.executable, JOB, json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=check,
    )


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """The uninterrupted run of each distinct first-run spec (computed once)."""
    refs: dict[str, list[Any]] = {}
    for _, first, _, _, _ in ROWS:
        key = json.dumps(first, sort_keys=True)
        if key not in refs:
            out = tmp_path_factory.mktemp("ref") / "out.jsonl"
            job.train(dict(first, out=str(out)))
            refs[key] = _lines(out)
    return refs


@pytest.mark.parametrize(
    ("first", "restart", "stop", "how"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_resumed_job_is_the_uninterrupted_job(
    tmp_path: Path,
    references: dict[str, list[Any]],
    first: dict[str, Any],
    restart: dict[str, Any],
    stop: list[int],
    how: str,
) -> None:
    ref = references[json.dumps(first, sort_keys=True)]
    assert {e for e, _ in ref} == {0, 1, 2}
    ckpt, out1, out2 = tmp_path / "ckpt.pt", tmp_path / "first.jsonl", tmp_path / "resumed.jsonl"
    spec = dict(first, stop=stop, how=how, state_out=str(ckpt), out=str(out1))
    if how == "kill":
        proc = _child(spec, check=False)
        assert proc.returncode == -9, proc.stderr
    else:
        job.train(spec)
    assert ckpt.exists()
    resumed = dict(first, **restart, state_in=str(ckpt), out=str(out2))
    _child(resumed)
    got = _lines(out1) + _lines(out2)
    assert len(got) == len(ref)
    assert got == ref, "the resumed job differs from the uninterrupted one"


def _aug_loader(**kw: Any) -> DataLoader:
    return DataLoader(job.AugMap(), batch_size=4, shuffle=True, **kw)


def test_two_loaders_built_after_the_same_seed_give_the_same_job() -> None:
    def job_of() -> list[Any]:
        torch.manual_seed(3)
        loader = _aug_loader()
        out = []
        for _ in range(3):
            out.append([canonical(b) for b in loader])
            torch.rand(11)  # training steps move the global RNG between epochs
        return out

    assert job_of() == job_of()


def test_reseeding_the_global_rng_before_iter_repeats_the_epoch_and_resume_keeps_it() -> None:
    # torch's behaviour, kept: manual_seed(s) just before iter() gives that epoch again. And a
    # script that reseeds before every epoch resumes into the same later epochs.
    loader = _aug_loader()
    torch.manual_seed(5)
    first = [canonical(b) for b in loader]
    torch.manual_seed(5)
    assert [canonical(b) for b in loader] == first
    torch.manual_seed(6)
    assert [canonical(b) for b in loader] != first

    def per_epoch_seeds(resume_at: tuple[int, int] | None) -> list[Any]:
        torch.manual_seed(0)
        loader, out, state = _aug_loader(), [], None
        for e in range(3):
            torch.manual_seed(100 + e)
            for k, b in enumerate(loader):
                out.append(canonical(b))
                torch.rand(2)
                if (e, k) == resume_at:
                    state = loader.state_dict()
                    break
            if state is not None:
                break
        if state is None:
            return out
        torch.manual_seed(42)  # the restarted process
        resumed = _aug_loader()
        resumed.load_state_dict(state)
        for e in range(state["epoch"], 3):
            torch.manual_seed(100 + e)
            out += [canonical(b) for b in resumed]
        return out

    assert per_epoch_seeds((1, 2)) == per_epoch_seeds(None)


def test_the_state_wins_over_a_generator_given_to_the_resumed_loader() -> None:
    ref_loader = _aug_loader()
    ref = [[canonical(b) for b in ref_loader] for _ in range(3)]
    sd = ref_loader.state_dict()  # after 3 epochs: the chain as epoch 3 draws it
    fourth = [canonical(b) for b in ref_loader]
    other = _aug_loader(generator=torch.Generator().manual_seed(123))
    other.load_state_dict(sd)
    assert [canonical(b) for b in other] == fourth
    assert ref  # three epochs really ran


def test_a_state_taken_before_the_first_iter_fixes_the_first_epoch() -> None:
    a = _aug_loader()
    sd = a.state_dict()
    exp = [canonical(b) for b in a]
    torch.rand(99)
    b = _aug_loader()
    it = iter(b)
    next(it)
    b.load_state_dict(sd)
    assert b.state_dict() == sd
    assert [canonical(x) for x in b] == exp


def test_a_mid_epoch_state_without_its_seed_is_refused() -> None:
    loader = _aug_loader()
    it = iter(loader)
    next(it)
    sd = loader.state_dict()
    assert sd["consumed"] == 1 and sd["seed"] is not None
    with pytest.raises(CheckpointError, match=r"seed: None .* inside epoch 0 \(consumed=1\)"):
        _aug_loader().load_state_dict(dict(sd, seed=None))


@pytest.mark.parametrize("chain", [None, {"root": -1, "next": 0}, {"generator": "!!"}, {"x": 1}])
def test_a_damaged_seed_chain_is_refused_naming_it(chain: Any) -> None:
    sd = _aug_loader().state_dict()
    loader = _aug_loader()
    before = loader.state_dict()
    with pytest.raises(CheckpointError, match="seed_chain"):
        loader.load_state_dict(dict(sd, seed_chain=chain))
    assert loader.state_dict() == before


def test_an_older_state_version_is_refused() -> None:
    sd = _aug_loader().state_dict()
    with pytest.raises(CheckpointError, match="version"):
        _aug_loader().load_state_dict(dict(sd, version=2))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_rebuilt_loader_over_our_batch_sampler_resumes_through_its_own_state(
    workers: int,
) -> None:
    # What a library that rebuilds the loader around loader.batch_sampler does (accelerate's
    # prepare() with use_stateful_dataloader=True builds torchdata's loader over it).
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def rebuilt(ours: DataLoader) -> Any:
        return stateful.StatefulDataLoader(
            ours.dataset, batch_sampler=ours.batch_sampler, num_workers=workers
        )

    torch.manual_seed(0)
    ref = rebuilt(_aug_loader())
    want = [[b["i"].tolist() for b in ref] for _ in range(3)]
    torch.manual_seed(0)
    first = rebuilt(_aug_loader())
    got = [[b["i"].tolist() for b in first]]
    it = iter(first)
    got.append([next(it)["i"].tolist() for _ in range(2)])
    sd = first.state_dict()
    del it
    torch.manual_seed(77)
    torch.rand(5)
    again = rebuilt(_aug_loader())
    again.load_state_dict(sd)
    got[1] += [b["i"].tolist() for b in again]
    got.append([b["i"].tolist() for b in again])
    assert got == want


def test_torch_dataloader_over_our_batch_sampler_gives_our_epochs() -> None:
    torch.manual_seed(0)
    ours = _aug_loader()
    mine = [[b["i"].tolist() for b in ours] for _ in range(2)]
    torch.manual_seed(0)
    other = _aug_loader()
    theirs = TorchDataLoader(other.dataset, batch_sampler=other.batch_sampler)
    assert [[b["i"].tolist() for b in theirs] for _ in range(2)] == mine


def test_torch_initial_seed_inside_a_worker_is_what_worker_init_fn_set() -> None:
    # torch's test_worker_init_fn: the user's seed is what they read; the draws stay per batch.
    loader = DataLoader(_InitialSeed(), batch_size=2, num_workers=2, worker_init_fn=_seed_12345)
    with pytest.warns(RuntimeWarning, match="worker_init_fn"):
        seeds = [int(x) for b in loader for x in b]
    assert seeds == [12345] * 8


class _InitialSeed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return torch.initial_seed()


def _seed_12345(worker_id: int) -> None:
    torch.manual_seed(12345)


# One worker count: each run is a new process importing accelerate (seconds); torchdata's
# num_workers=0 path is covered in-process above.
@pytest.mark.parametrize("workers", [2])
def test_accelerate_rebuilding_our_loader_resumes_exactly_in_a_new_process(
    tmp_path: Path, workers: int
) -> None:
    # accelerate's prepare() with use_stateful_dataloader=True throws our loader away and builds
    # torchdata's over our batch sampler; save_state()/load_state() then carry that loader's
    # state, and with it our sampler's: the resumed run (a new process, resuming in epoch 1)
    # trains exactly the uninterrupted run's samples, epoch 2 included.
    pytest.importorskip("accelerate")
    pytest.importorskip("torchdata.stateful_dataloader")
    script = str(Path(__file__).parents[1] / "_accelerate_job.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))

    def run(**spec: Any) -> None:
        spec = dict(spec, workers=workers, ckpt=str(tmp_path / "ckpt"), stop=[1, 2])
        subprocess.run(
            [sys.executable, script, json.dumps(spec)],
            env=env,
            check=True,
            timeout=180,
            capture_output=True,
        )

    run(phase="ref", seed=0, out=str(tmp_path / "ref.jsonl"))
    run(phase="save", seed=0, out=str(tmp_path / "got.jsonl"))
    run(phase="resume", seed=31, noise=17, out=str(tmp_path / "got.jsonl"))
    ref, got = _lines(tmp_path / "ref.jsonl"), _lines(tmp_path / "got.jsonl")
    assert len(ref) == 24
    assert got == ref


@pytest.mark.parametrize("at", [(0, 2), (1, 1)])
def test_a_sampler_with_its_own_generator_resumes_every_later_epoch(at: tuple[int, int]) -> None:
    # torch's SubsetRandomSampler draws from the generator it was given, not from the loader's
    # seed: the state keeps that generator's state as the epoch began, so the fast-forward of
    # the resumed epoch redraws the same order and the later epochs follow it.
    def make() -> DataLoader:
        g = torch.Generator().manual_seed(11)
        sampler = torch.utils.data.SubsetRandomSampler(list(range(0, 24, 2)), generator=g)
        return DataLoader(job.AugMap(), batch_size=3, sampler=sampler)

    torch.manual_seed(0)
    ref = make()
    want = [[canonical(b) for b in ref] for _ in range(3)]
    torch.manual_seed(0)
    first = make()
    got = [[canonical(b) for b in first] for _ in range(at[0])]
    it = iter(first)
    got.append([canonical(next(it)) for _ in range(at[1])])
    sd = first.state_dict()
    assert "sampler_generator" in sd
    del it
    resumed = make()
    torch.rand(3)
    resumed.load_state_dict(sd)
    got[-1] += [canonical(b) for b in resumed]
    while len(got) < 3:
        got.append([canonical(b) for b in resumed])
    assert got == want
