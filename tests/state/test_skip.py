"""``skip_samples`` and ``python -m resumable_loader skip``: a state n samples further along,
reading nothing. Compared against the uninterrupted run with those n samples removed, and the
fetches counted (the skipped samples are never fetched)."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _datasets import RangeDataset, ShardedStream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from resumable_loader import (
    CheckpointError,
    DataLoader,
    Mixture,
    dump_state,
    load_state,
    merge_rank_states,
    skip_samples,
)
from resumable_loader.cli.main import main
from resumable_loader.cli.summary import format_summary

FAST = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


class Counting(Dataset):
    """Item i is i; every fetch is recorded (num_workers=0: in this process)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.fetched.append(int(i))
        return int(i)


def _flat(batches: Any) -> list[int]:
    out: list[int] = []
    for b in batches:
        out += b.tolist() if isinstance(b, torch.Tensor) else [int(b)]
    return out


def _loader(ds: Any, b: int | None, shuffle: bool, seed: int = 4, **kw: Any) -> DataLoader:
    g = torch.Generator()
    g.manual_seed(seed)
    return DataLoader(ds, batch_size=b, shuffle=shuffle, generator=g, **kw)


@FAST
@given(
    n=st.integers(1, 30),
    b=st.sampled_from([None, 1, 3, 4]),
    b2=st.sampled_from([None, 2, 5]),
    k=st.integers(0, 8),
    skip=st.integers(0, 30),
    shuffle=st.booleans(),
    twice=st.booleans(),
)
def test_skip_is_the_uninterrupted_stream_without_those_samples(
    n: int, b: int | None, b2: int | None, k: int, skip: int, shuffle: bool, twice: bool
) -> None:
    order = _flat(_loader(Counting(n), None, shuffle))  # the epoch, never interrupted
    ds = Counting(n)
    first = _loader(ds, b, shuffle)
    it = iter(first)
    per = b or 1
    k = min(k, -(-n // per) - 1)  # stay inside the epoch
    before = _flat(next(it) for _ in range(k))
    assert before == order[: len(before)]
    state = first.state_dict()
    left = n - len(before)
    skip = min(skip, left)
    parts = [skip // 2, skip - skip // 2] if twice else [skip]
    for part in parts:
        state = skip_samples(state, part)
    ds.fetched.clear()
    second = _loader(ds, b2, shuffle, seed=11)  # another generator: the state's chain wins
    second.load_state_dict(load_state(dump_state(state)))
    after = _flat(second)
    assert after == order[len(before) + skip :]
    assert ds.fetched == after  # nothing fetched for the skipped samples
    assert sum(e[2] for e in state["skipped_samples"]) == skip
    # The next epoch is whole again, as in the uninterrupted run.
    ref = _loader(Counting(n), b2, shuffle)
    list(ref)
    assert _flat(second) == _flat(ref)


def test_skip_in_a_mixture_reads_none_of_the_skipped_samples() -> None:
    a, c = Counting(7), Counting(5)
    mix = Mixture({"a": a, "c": c}, {"a": 2, "c": 1}, seed=3)
    ref = [mix[i] for i in range(len(mix))]
    a.fetched.clear()
    c.fetched.clear()
    loader = DataLoader(mix, batch_size=2)
    it = iter(loader)
    before = _flat([next(it), next(it)])
    state = skip_samples(loader.state_dict(), 5)
    a.fetched.clear()
    c.fetched.clear()
    mix2 = Mixture({"a": a, "c": c}, {"a": 2, "c": 1}, seed=3)
    resumed = DataLoader(mix2, batch_size=3)
    resumed.load_state_dict(state)
    after = _flat(resumed)
    assert before + after == ref[:4] + ref[9:]
    assert len(a.fetched) + len(c.fetched) == len(after)


def test_a_skip_past_the_epoch_end_is_refused_and_changes_nothing() -> None:
    loader = _loader(RangeDataset(10), 4, True)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    copy = load_state(dump_state(state))
    with pytest.raises(CheckpointError, match="only 6 are left of epoch 0"):
        skip_samples(state, 7)
    assert state == copy
    end = skip_samples(state, 6)  # to the end exactly: the epoch has nothing left
    again = _loader(RangeDataset(10), 4, True)
    again.load_state_dict(end)
    assert list(again) == []
    assert len(list(again)) == 3  # the next epoch, whole


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: DataLoader(ShardedStream(8), batch_size=2), "iterable dataset"),
        (
            lambda: DataLoader(
                RangeDataset(8), sampler=DistributedSampler(RangeDataset(8), 2, 0), batch_size=2
            ),
            "global state",
        ),
        (
            lambda: DataLoader(
                RangeDataset(8), sampler=torch.utils.data.SubsetRandomSampler(range(8))
            ),
            "replayed",
        ),
    ],
    ids=["stream", "one-rank", "replayed-sampler"],
)
def test_positions_that_cannot_move_without_reading_are_refused(make: Any, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        skip_samples(make().state_dict(), 1)


def test_bad_counts_are_refused() -> None:
    state = DataLoader(RangeDataset(4)).state_dict()
    with pytest.raises(ValueError, match=">= 0"):
        skip_samples(state, -1)
    with pytest.raises(TypeError):
        skip_samples(state, True)


def _ranks(n: int, world: int, b: int) -> list[DataLoader]:
    ds = RangeDataset(n)
    return [
        DataLoader(ds, batch_size=b, sampler=DistributedSampler(ds, world, r, seed=2))
        for r in range(world)
    ]


def _ids(batch: Any) -> list[int]:
    return batch["idx"].tolist()


def test_a_distributed_jobs_global_stream_skips_on_any_world_size() -> None:
    """2 ranks of batch 3 take 2 steps (12 samples of the epoch's order), 5 are skipped, and 3
    ranks of batch 4 deliver the rest: none of the consumed or skipped samples again."""
    n = 40
    order = [int(i) for i in DistributedSampler(RangeDataset(n), 1, 0, seed=2)]
    job = _ranks(n, 2, 3)
    its = [iter(x) for x in job]
    before = [i for _ in range(2) for it in its for i in _ids(next(it))]
    assert sorted(before) == sorted(order[:12])
    state = skip_samples(merge_rank_states([x.state_dict() for x in job]), 5)
    after: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # torch's padding, announced
        for loader in _ranks(n, 3, 4):
            loader.load_state_dict(state)
            after += [i for batch in loader for i in _ids(batch)]
    assert not set(after) & set(order[:17])
    assert set(after) == set(order[17:])
    assert len(after) == 24  # 23 left, padded to a multiple of 3 ranks
    summary = format_summary(state)
    assert "skipped samples  5 in 1 skips" in summary


# ---- the CLI -------------------------------------------------------------------------------


def _state_after(k: int) -> tuple[dict[str, Any], list[int]]:
    loader = _loader(RangeDataset(20), 2, True)
    it = iter(loader)
    for _ in range(k):
        next(it)
    state = loader.state_dict()
    return state, [i for batch in it for i in _ids(batch)]


def _resumed(state: dict[str, Any]) -> list[int]:
    loader = _loader(RangeDataset(20), 2, True)
    loader.load_state_dict(state)
    return [i for batch in loader for i in _ids(batch)]


def test_cli_skips_in_a_dump_state_file_in_place(tmp_path: Path) -> None:
    state, rest = _state_after(3)
    path = tmp_path / "loader.rls"
    path.write_bytes(dump_state(state))
    assert main(["skip", str(path), "--samples", "4"]) == 0
    new = load_state(path.read_bytes())
    assert _resumed(new) == rest[4:]
    assert [p.name for p in tmp_path.iterdir()] == ["loader.rls"]  # no temporary file left


def test_cli_skips_in_a_torch_save_checkpoint_by_key_and_by_search(tmp_path: Path) -> None:
    state, rest = _state_after(2)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.ones(3)}, "train": {"loader": state}}, path)
    out = tmp_path / "out.pt"
    assert main(["skip", str(path), "--samples", "3", "--key", "train.loader", "-o", str(out)]) == 0
    ckpt = torch.load(out, weights_only=True)
    assert torch.equal(ckpt["model"]["w"], torch.ones(3))
    assert _resumed(ckpt["train"]["loader"]) == rest[3:]
    assert main(["skip", str(path), "--samples", "1"]) == 0  # found without --key, in place
    assert _resumed(torch.load(path, weights_only=True)["train"]["loader"]) == rest[1:]


@pytest.mark.heavy_imports
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_cli_skips_in_a_dcp_directory_into_a_new_one(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    n = 20
    ref = _ranks(n, 1, 2)[0]
    order = [i for batch in ref for i in _ids(batch)]
    loader = _ranks(n, 1, 2)[0]
    it = iter(loader)
    next(it)
    ckpt, out = tmp_path / "ckpt", tmp_path / "skipped"
    dcp.save({"loader": loader, "model": {"w": torch.arange(3.0)}}, checkpoint_id=str(ckpt))
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    assert main(["skip", str(ckpt), "--samples", "5"]) == 2  # in place: refused
    assert main(["skip", str(ckpt), "--samples", "5", "-o", str(out)]) == 0
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before  # untouched
    resumed = _ranks(n, 1, 2)[0]
    model = {"w": torch.zeros(3)}
    dcp.load({"loader": resumed, "model": model}, checkpoint_id=str(out))
    assert torch.equal(model["w"], torch.arange(3.0))
    assert [i for batch in resumed for i in _ids(batch)] == order[7:]
    assert main(["inspect", str(out)]) == 0


class _Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.mkdir, (str(self.marker),))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_cli_skip_refuses_planted_files_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "ran"
    bad = tmp_path / "bad.pt"
    bad.write_bytes(pickle.dumps({"loader": _Planted(marker)}))
    data = bad.read_bytes()
    assert main(["skip", str(bad), "--samples", "1"]) == 2
    assert "weights_only=True" in capsys.readouterr().err
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    assert main(["skip", str(ckpt), "--samples", "1", "-o", str(tmp_path / "o")]) == 2
    assert "cannot be read safely" in capsys.readouterr().err
    assert not marker.exists()
    assert bad.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt", "ckpt"]
    # A state that cannot move: one clear line, nothing written.
    stream = tmp_path / "stream.rls"
    stream.write_bytes(dump_state(DataLoader(ShardedStream(4)).state_dict()))
    assert main(["skip", str(stream), "--samples", "1"]) == 2
    assert "iterable dataset" in capsys.readouterr().err


# ---- review of #24 -------------------------------------------------------------------------


def test_a_user_batch_samplers_position_is_not_skipped() -> None:
    """Its batches' size is not in the state (batch_size=None): before the fix, 2 batches of
    4 were read as 2 samples and the skip resumed at sample 3."""
    ds = RangeDataset(24)
    batches = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(ds), 4, False)
    loader = DataLoader(ds, batch_sampler=batches)
    it = iter(loader)
    next(it), next(it)
    with pytest.raises(CheckpointError, match="batch_sampler"):
        skip_samples(loader.state_dict(), 1)


def _dist_drop_last(world: int, rank: int) -> DataLoader:
    ds = RangeDataset(24)
    return DataLoader(
        ds, batch_size=1, sampler=DistributedSampler(ds, world, rank, shuffle=False, drop_last=True)
    )


def _after(state: dict[str, Any], world: int) -> list[int]:
    out: list[int] = []
    for r in range(world):
        loader = _dist_drop_last(world, r)
        loader.load_state_dict(state)
        out += [i for batch in loader for i in _ids(batch)]
    return sorted(out)


def test_a_skip_adds_no_empty_level_that_drop_last_would_trim() -> None:
    """4 ranks take 2 samples each (0-7), 5 are skipped: 13-23 are left. Before the fix a
    level of zeros was added at each skip (and at each re-cut of a skipped state), whose
    drop_last trim to 4 ranks dropped samples: 3 ranks got 6 of them, not 9, and a second
    skip of 3 left 16-19 instead of 16-23."""
    job = [_dist_drop_last(4, r) for r in range(4)]
    its = [iter(x) for x in job]
    for _ in range(2):
        for it in its:
            next(it)
    state = skip_samples(merge_rank_states([x.state_dict() for x in job]), 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the announced drop_last tail
        assert _after(state, 3) == list(range(13, 22))  # 11 left, 9 for 3 ranks
        assert _after(skip_samples(state, 3), 4) == list(range(16, 24))
        # A re-cut loaded and saved before iter() holds no empty level either.
        recut = [_dist_drop_last(2, r) for r in range(2)]
        for loader in recut:
            loader.load_state_dict(state)
        again = merge_rank_states([x.state_dict() for x in recut])
        assert _after(skip_samples(again, 3), 4) == list(range(16, 24))


@pytest.mark.parametrize(
    "cut",
    [{"start": 10**12, "holes": []}, {"start": 10, "holes": [[30, 100]]}],
    ids=["start-past-the-end", "hole-past-the-end"],
)
def test_a_damaged_sample_cut_is_refused_by_a_skip(cut: dict[str, Any]) -> None:
    """Before the fix: "only 0 samples are left" rather than the state is damaged."""
    state = dict(_loader(RangeDataset(24), 4, False).state_dict(), sample_cut=cut)
    with pytest.raises(CheckpointError, match=r"sample_cut.*damaged"):
        skip_samples(state, 1)


class _UnhashableIndex:
    """Pickles as torch's MetadataIndex (an allowed class) whose offset is a list: the
    storage_data key it makes cannot be hashed when the real classes are built."""

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # what pickle names: as torch's dataclass pickles
        from torch.distributed.checkpoint.metadata import MetadataIndex

        return MetadataIndex

    def __reduce__(self) -> tuple[Any, ...]:
        import copyreg

        state = {"fqn": self.fqn, "offset": [0], "index": None}
        return (copyreg.__newobj__, (self.__class__,), state)


@pytest.mark.heavy_imports
def test_cli_skip_refuses_a_metadata_file_that_fails_to_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A .metadata of allowed classes built from values that make them raise: one line, exit
    2, nothing written (before the fix: a TypeError traceback)."""
    ckpt = tmp_path / "ckpt"
    _saved_dcp(ckpt)
    meta = pickle.loads((ckpt / ".metadata").read_bytes())  # our own file: trusted here
    index = next(k for k in meta.storage_data if k.fqn.startswith("loader."))
    meta.storage_data[_UnhashableIndex(index.fqn)] = meta.storage_data.pop(index)
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    out = tmp_path / "out"
    assert main(["skip", str(ckpt), "--samples", "1", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "damaged" in err and "TypeError" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _saved_dcp(ckpt: Path) -> None:
    import torch.distributed.checkpoint as dcp

    loader = _ranks(20, 1, 2)[0]
    next(iter(loader))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.distributed is disabled
        dcp.save({"loader": loader}, checkpoint_id=str(ckpt))


def test_cli_skip_refuses_an_output_inside_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    _saved_dcp(ckpt)
    before = sorted(p.name for p in ckpt.iterdir())
    assert main(["skip", str(ckpt), "--samples", "1", "-o", str(ckpt / "sub")]) == 2
    assert "inside" in capsys.readouterr().err
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_cli_skip_refuses_tensors_saved_on_another_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read onto the CPU and written back, a CUDA tensor would come back a CPU one. No GPU
    here: the file's location tag says cuda:0, as torch.save writes it for a CUDA tensor."""
    import torch.serialization as ser

    state, _ = _state_after(2)
    path = tmp_path / "ckpt.pt"
    with monkeypatch.context() as m:
        m.setattr(ser, "location_tag", lambda storage: "cuda:0")
        torch.save({"model": {"w": torch.ones(3)}, "loader": state}, path)
    data = path.read_bytes()
    assert main(["skip", str(path), "--samples", "1"]) == 2
    err = capsys.readouterr().err
    assert "'cuda:0'" in err and "skip_samples" in err
    assert path.read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


# ---- issue #31: the CLI's smaller items ------------------------------------------------------


def _mixture() -> Mixture:
    return Mixture({"a": RangeDataset(13), "c": RangeDataset(7)}, {"a": 2, "c": 1}, seed=3)


@pytest.mark.heavy_imports
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize(
    ("data", "ahead", "n", "rest"),
    [
        ("shuffled", [], 5, lambda order: order[4 + 5 :]),
        ("mixture", [], 5, lambda order: order[4 + 5 :]),
        # Batch 3 (samples 6 and 7) was delivered ahead (in_order=False): a hole in the rest.
        ("shuffled", [3], 1, lambda order: order[5:6] + order[8:]),
    ],
    ids=["shuffled", "mixture", "delivered-ahead"],
)
def test_cli_skips_in_a_dcp_directory_saved_from_a_plain_state_dict(
    tmp_path: Path, data: str, ahead: list[int], n: int, rest: Any
) -> None:
    """The docs' other DCP recipe: dcp.save({"loader": loader.state_dict(), ...}), resumed with
    dcp.load into a fresh loader's state_dict(). That one has no sample_cut: before the fix the
    skip was refused ("entries the checkpoint lacks"); written with a sample_cut entry, dcp.load
    would pass it over and the loader would start the epoch again. (A Mixture's plan holds
    lists of dicts, which DCP stores item by item.)"""
    import torch.distributed.checkpoint as dcp

    def make() -> DataLoader:
        if data == "mixture":
            return DataLoader(_mixture(), batch_size=2)
        return _loader(RangeDataset(20), 2, True)

    order = [i for batch in make() for i in _ids(batch)]  # never interrupted
    loader = make()
    it = iter(loader)
    next(it), next(it)
    ckpt, out = tmp_path / "ckpt", tmp_path / "skipped"
    saved = dict(loader.state_dict(), delivered_ahead=ahead)
    dcp.save({"loader": saved, "model": {"w": torch.arange(3.0)}}, checkpoint_id=ckpt)
    assert main(["skip", str(ckpt), "--samples", str(n), "-o", str(out)]) == 0

    resumed = make()
    state = {"loader": resumed.state_dict(), "model": {"w": torch.zeros(3)}}
    dcp.load(state, checkpoint_id=str(out))
    resumed.load_state_dict(state["loader"])
    assert torch.equal(state["model"]["w"], torch.arange(3.0))
    assert [i for batch in resumed for i in _ids(batch)] == rest(order)


def _checkpoint_after(tmp_path: Path, k: int) -> tuple[Path, list[int]]:
    state, rest = _state_after(k)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.ones(3)}, "loader": state}, path)
    return path, rest


def test_cli_skip_refuses_to_replace_a_read_only_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint made read-only is one someone meant to keep; a rename replaces it whatever
    its mode (before the fix it was replaced, as 0644 and owned by whoever ran skip)."""
    path, rest = _checkpoint_after(tmp_path, 2)
    path.chmod(0o444)
    data = path.read_bytes()
    assert main(["skip", str(path), "--samples", "3"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "is read-only (mode 0444)" in err and "-o OUT" in err and "nothing was written" in err
    assert path.read_bytes() == data and path.stat().st_mode & 0o777 == 0o444
    # An existing read-only OUT is protected the same way.
    out = tmp_path / "out.pt"
    out.write_bytes(b"keep me")
    out.chmod(0o400)
    assert main(["skip", str(path), "--samples", "3", "-o", str(out)]) == 2
    assert "is read-only (mode 0400)" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"
    # Elsewhere, as the message says: the original stays, the result resumes 3 samples on.
    new = tmp_path / "new.pt"
    assert main(["skip", str(path), "--samples", "3", "-o", str(new)]) == 0
    assert _resumed(torch.load(new, weights_only=True)["loader"]) == rest[3:]
    assert path.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "new.pt", "out.pt"]


def test_cli_skip_in_place_keeps_the_files_mode_owner_and_group(tmp_path: Path) -> None:
    """Before the fix the rewritten file had the mode of a new file (0666 less the umask) and
    belonged to whoever ran skip. The owner can be given away only by root."""
    import os

    path, rest = _checkpoint_after(tmp_path, 2)
    path.chmod(0o640)
    if os.geteuid() == 0:
        os.chown(path, 4321, 4322)
    before = path.stat()
    assert main(["skip", str(path), "--samples", "3"]) == 0
    after = path.stat()
    assert after.st_ino != before.st_ino  # replaced by a rename, not rewritten in place
    assert after.st_mode & 0o7777 == 0o640
    assert (after.st_uid, after.st_gid) == (before.st_uid, before.st_gid)
    assert _resumed(torch.load(path, weights_only=True)["loader"]) == rest[3:]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def _nested(levels: int, inner: Any) -> Any:
    for i in range(levels):
        inner = {f"level{levels - i}": inner}
    return inner


def test_cli_finds_the_loader_state_at_any_depth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the fix the search stopped two levels deep: a trainer's checkpoint nesting its
    loader state under trainer.state.data (or in a list) was "no loader state found"."""
    state, rest = _state_after(2)
    path = tmp_path / "ckpt.pt"
    ckpt = {"model": {"w": torch.ones(3)}, "trainer": {"state": {"data": [{"loader": state}]}}}
    torch.save(ckpt, path)
    assert main(["inspect", str(path)]) == 0
    assert "loader state found at key 'trainer.state.data.0.loader'" in capsys.readouterr().out
    assert main(["skip", str(path), "--samples", "3"]) == 0
    assert "(key 'trainer.state.data.0.loader')" in capsys.readouterr().out
    saved = torch.load(path, weights_only=True)
    assert torch.equal(saved["model"]["w"], torch.ones(3))
    assert _resumed(saved["trainer"]["state"]["data"][0]["loader"]) == rest[3:]


def test_cli_names_every_loader_state_it_finds_and_bounds_the_search(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state, _ = _state_after(2)
    two = tmp_path / "two.pt"
    torch.save({"runs": {"a": {"x": {"loader": state}}, "b": [{"y": state}]}}, two)
    data = two.read_bytes()
    assert main(["skip", str(two), "--samples", "1"]) == 2
    err = capsys.readouterr().err
    assert "several loader states (runs.a.x.loader, runs.b.0.y)" in err
    assert "--key runs.a.x.loader" in err
    assert two.read_bytes() == data
    # Nested past the bound (one dict per level, 200 levels): refused in one line, without a
    # RecursionError, and --key still reaches it.
    deep = tmp_path / "deep.pt"
    torch.save(_nested(200, state), deep)
    assert main(["inspect", str(deep)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "looks 16 levels deep" in err and "--key" in err
    key = ".".join(f"level{i}" for i in range(1, 201))
    assert main(["inspect", str(deep), "--key", key]) == 0
    assert "2 tasks consumed" in capsys.readouterr().out


@pytest.mark.heavy_imports
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_cli_skip_of_zero_samples_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the fix `--samples 0` rewrote the file: new bytes (torch.save's) and a new mtime,
    which backups and job schedulers read as a changed checkpoint."""
    import os

    state, _ = _state_after(2)
    dump = tmp_path / "loader.rls"
    dump.write_bytes(dump_state(state))
    pt, _ = _checkpoint_after(tmp_path, 2)
    for path in (dump, pt):
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
        data = path.read_bytes()
        assert main(["skip", str(path), "--samples", "0"]) == 0
        assert "nothing written" in capsys.readouterr().out
        assert path.read_bytes() == data and path.stat().st_mtime_ns == 1_000_000_000
    # With -o, OUT is what was asked for: PATH's state 0 samples on, i.e. its bytes.
    out = tmp_path / "out.pt"
    assert main(["skip", str(pt), "--samples", "0", "-o", str(out)]) == 0
    assert out.read_bytes() == pt.read_bytes()
    # A DCP directory likewise; and 0 samples of a state that cannot move is still refused.
    ckpt = tmp_path / "ckpt"
    _saved_dcp(ckpt)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    assert main(["skip", str(ckpt), "--samples", "0"]) == 0
    assert "nothing written" in capsys.readouterr().out
    copy = tmp_path / "copy"
    assert main(["skip", str(ckpt), "--samples", "0", "-o", str(copy)]) == 0
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    stream = tmp_path / "stream.rls"
    stream.write_bytes(dump_state(DataLoader(ShardedStream(4)).state_dict()))
    assert main(["skip", str(stream), "--samples", "0"]) == 2
    assert "iterable dataset" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt",
        "ckpt.pt",
        "copy",
        "loader.rls",
        "out.pt",
        "stream.rls",
    ]
