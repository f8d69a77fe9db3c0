"""The ``python -m resumable_loader inspect`` CLI (``__main__``): the summary it prints, its
JSON output, and one-line errors (exit status 2) for every file it cannot read."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _datasets import loader_state

from resumable_loader.cli.main import main
from resumable_loader.cli.summary import format_summary
from resumable_loader.state.codec import dump_state

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "resumable_loader", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_cli_inspects_a_dump_state_file(tmp_path: Path) -> None:
    path = tmp_path / "state.rls"
    path.write_bytes(dump_state(loader_state()))
    proc = run_cli("inspect", str(path))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "dump_state file" in out and "checksum ok" in out
    assert "resumable_loader.DataLoader, version 2" in out
    assert "iterable, length unknown" in out
    assert "17 tasks consumed; delivered ahead: [19, 20]" in out
    assert "task 18: 4 indices [72, 73, 74, 75]" in out
    assert "epoch 2 task 7: 4 indices [28, 29, 30, 31]" in out
    assert "rank 0 of world size 1" in out
    assert f"seed             {2**63 - 1}" in out


def test_cli_inspects_a_torch_save_file_by_key(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "train": {"loader": loader_state()}}, path)
    proc = run_cli("inspect", str(path), "--key", "train.loader")
    assert proc.returncode == 0, proc.stderr
    assert "torch.save file, key 'train.loader'" in proc.stdout
    assert "17 tasks consumed" in proc.stdout

    assert_one_line_error(
        run_cli("inspect", str(path), "--key", "loader"),
        "no key 'loader'",
        "top-level keys: model, train",
    )


def test_a_training_checkpoint_with_epoch_config_and_dataset_keys_is_not_taken_for_a_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Common top-level keys of a training checkpoint are also names in a loader state; the
    # state is the entry that holds one, not the checkpoint around it.
    path = tmp_path / "ckpt.pt"
    ckpt = {"epoch": 3, "config": {"lr": 0.1}, "dataset": "web-v2", "loader": loader_state()}
    torch.save(ckpt, path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "key 'loader'" in out and "17 tasks consumed" in out


def test_cli_refuses_corrupt_and_missing_files_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt = tmp_path / "corrupt.rls"
    data = bytearray(dump_state(loader_state()))
    data[-1] ^= 1
    corrupt.write_bytes(bytes(data))
    truncated = tmp_path / "truncated.rls"
    truncated.write_bytes(bytes(data[:-10]))
    cases = [
        (corrupt, "checksum mismatch"),
        (truncated, "truncated"),
        (tmp_path / "missing", "No such file"),
        (tmp_path, "is a directory but not a torch.distributed.checkpoint one"),
    ]
    for path, expected in cases:
        assert main(["inspect", str(path)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert len(captured.err.splitlines()) == 1 and expected in captured.err, captured.err


def test_cli_garbage_file_exits_2_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "garbage.bin"
    path.write_bytes(b"\x00not a checkpoint\xff" * 50)
    assert_one_line_error(run_cli("inspect", str(path)), "is neither a dump_state file")


def test_cli_json_output_parses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "state.rls"
    state = loader_state()
    path.write_bytes(dump_state(state))
    assert main(["inspect", str(path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    buf = state["workers"][0]["dataset_state"]["buf"]
    assert printed["workers"][0]["dataset_state"]["buf"] == {
        "$bytes": base64.b64encode(buf).decode()
    }
    assert printed["outstanding"] == state["outstanding"]


def test_cli_finds_the_one_loader_state_without_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {}, "loader": loader_state()}, path)
    assert main(["inspect", str(path)]) == 0
    assert "loader state found at key 'loader'" in capsys.readouterr().out

    torch.save({"a": loader_state(), "b": {"c": loader_state()}}, path)
    assert main(["inspect", str(path)]) == 2
    assert "several loader states (a, b.c); choose one with --key" in capsys.readouterr().err

    torch.save({"model": {}, "optim": {}}, path)
    assert main(["inspect", str(path)]) == 2
    assert "no loader state found" in capsys.readouterr().err


def test_cli_key_into_a_non_dict_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "states": [loader_state()]}, path)
    assert main(["inspect", str(path), "--key", "states.0"]) == 0
    assert "17 tasks consumed" in capsys.readouterr().out
    assert main(["inspect", str(path), "--key", "model.w"]) == 2
    assert "is a Tensor, not a loader state" in capsys.readouterr().err
    assert main(["inspect", str(path), "--key", "model.w.x"]) == 2
    err = capsys.readouterr().err
    assert "'model.w' is a Tensor, which has no key 'x'" in err and len(err.splitlines()) == 1


def test_cli_handles_a_torch_state_that_holds_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ckpt.pt"
    state = loader_state()
    state["workers"][0]["dataset_state"] = state  # pickle allows cycles; plain data does not
    torch.save({"loader": state}, path)
    assert main(["inspect", str(path), "--key", "loader"]) == 0
    assert "17 tasks consumed" in capsys.readouterr().out
    assert main(["inspect", str(path), "--key", "loader", "--json"]) == 2
    err = capsys.readouterr().err
    assert "holds itself" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "state",
    [
        {},
        {"format": "something.else"},
        {"config": "not a dict", "workers": 3, "outstanding": {"x": 1}, "skipped": None},
        {"config": {}, "workers": [None, {}, {"id": "zero", "exhausted": "maybe"}]},
        {"outstanding": [[1], [2, None], "x"], "skipped": [[1, 2], [1, 2, 3]], "stats": []},
        {"delivered_ahead": [1.5, None, "x"], "sampler_state": [1, 2], "extra": b"\x00"},
        {1: "int key", "stats": {"k" * 100: 1}, "config": {"dataset_len": -1, "x": 1}},
    ],
)
def test_summary_survives_missing_and_odd_fields(state: dict[Any, Any]) -> None:
    text = format_summary(state)
    assert text.startswith("resumable_loader state")
    assert "config" in text


def test_summary_of_an_empty_state_shows_dashes() -> None:
    text = format_summary({})
    assert "seed             -" in text
    assert "workers          -" in text
    assert "format           -, version -" in text


def test_summary_explains_outstanding_seeds_and_worker_states() -> None:
    from resumable_loader.state.seeds import SAMPLER, derive_seed

    state = loader_state(outstanding=None)
    del state["outstanding"]
    state["config"]["sampler"] = "random(replacement=False, num_samples=19)"
    text = format_summary(state)
    seed, consumed = state["seed"], state["consumed"]
    assert f"shuffle {derive_seed(SAMPLER, seed)}" in text
    assert f"tasks {consumed} on are recomputed from the seed" in text
    assert "state_at" in text and '{"pos": 36' in text  # worker 0's state, previewed
    assert "stats" in text.split("other keys")[1]  # an unknown key is listed as such


@pytest.mark.heavy_imports
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_cli_inspects_the_loader_in_a_dcp_directory(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.utils.data.distributed import DistributedSampler

    from resumable_loader import DataLoader

    ds = list(range(10))
    loader = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, 1, 0, seed=5))
    it = iter(loader)
    next(it)
    # Without a process group DCP saves from one process; the loader state is still global.
    dcp.save({"loader": loader, "model": {"w": torch.zeros(3)}}, checkpoint_id=str(tmp_path))
    proc = run_cli("inspect", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "torch.distributed.checkpoint directory" in out
    assert "world size 1 (any number of ranks can load it)" in out
    assert "rank 0 of 1" in out and "1 tasks consumed" in out
    assert "sampler epoch    0 (DistributedSampler)" in out


# --- inspecting never unpickles: a planted DCP directory runs nothing --------------------------


class _Planted:
    """A payload: unpickling it creates the directory ``marker`` (pickled as a call to
    ``os.mkdir``, so nothing of this module is needed to run it)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.mkdir, (str(self.marker),))


def _saved_dcp_directory(path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.utils.data.distributed import DistributedSampler

    from resumable_loader import DataLoader

    ds = list(range(10))
    loader = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, 1, 0, seed=5))
    next(iter(loader))
    # A "format" beside a tensor: inspect reads the loader's entries only, never a tensor.
    model = {"w": torch.zeros(3), "format": "not a loader"}
    dcp.save({"loader": loader, "model": model}, checkpoint_id=str(path))


def test_cli_refuses_a_planted_dcp_metadata_file_without_running_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pickle

    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    assert main(["inspect", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert not marker.exists(), "inspect ran code from .metadata"
    assert len(err.splitlines()) == 1
    assert "its .metadata cannot be read safely: it refers to posix.mkdir" in err
    assert "inspect reads none of it" in err


@pytest.mark.heavy_imports
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_cli_refuses_a_real_dcp_directory_with_an_entry_swapped_for_a_pickle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import io
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    _saved_dcp_directory(ckpt)
    assert main(["inspect", str(ckpt)]) == 0  # the real directory reads as before
    assert "1 tasks consumed" in capsys.readouterr().out
    # The attacker's edit: the loader's entry now points at a torch.save'd payload.
    buf = io.BytesIO()
    torch.save(_Planted(marker), buf)
    (ckpt / "__planted.distcp").write_bytes(buf.getvalue())
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own file, trusted
    metadata.storage_data[MetadataIndex("loader.ranks")] = _StorageInfo(
        "__planted.distcp", 0, len(buf.getvalue())
    )
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)

    assert main(["inspect", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert not marker.exists(), "inspect ran code from a checkpoint entry"
    assert len(err.splitlines()) == 1
    assert "entry 'loader.ranks' is not plain data that torch.load(weights_only=True) reads" in err


def test_cli_refuses_a_torch_file_whose_shared_values_expand_exponentially(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 40 levels of [a, a]: 2**40 values as a tree, in about 1.6 kB of pickle. Walking it as
    # a tree (the summary, --json) would never end.
    shared: list[Any] = [[]]
    for _ in range(40):
        shared = [shared, shared]
    state = loader_state()
    state["workers"][0]["dataset_state"] = shared
    path = tmp_path / "ckpt.pt"
    torch.save({"loader": state}, path)
    for extra in ([], ["--json"]):
        assert main(["inspect", str(path), "--key", "loader", *extra]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "expand to more than" in err, err
    # An honest file of the same shape, without the sharing, is summarised as before.
    state["workers"][0]["dataset_state"] = [[i, [i]] for i in range(1000)]
    torch.save({"loader": state}, path)
    assert main(["inspect", str(path), "--key", "loader"]) == 0
    assert "17 tasks consumed" in capsys.readouterr().out


def test_cli_refuses_a_fifo_instead_of_waiting_for_a_writer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    os.mkfifo(tmp_path / "fifo")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.mkfifo(ckpt / ".metadata")
    for path in (tmp_path / "fifo", ckpt):
        assert main(["inspect", str(path)]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "not a regular file" in err, err
