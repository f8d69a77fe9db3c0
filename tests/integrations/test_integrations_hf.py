"""Hugging Face accelerate and the transformers Trainer around our loader (issue #23).

Training jobs (``_hf_jobs.py``: a Linear layer, 22 items or a 40-item stream, an augmentation
value per item) run in child processes, are SIGKILLed right after the checkpoint of a step in
the middle of an epoch, and are resumed in a new process. The resumed run must train, step by
step, the samples and augmentation values of an uninterrupted run, end with its weights bit for
bit, and fetch nothing it had trained before the kill. In-process tests cover what accelerate's
own ``prepare()`` does to our loader (the warning) and the pieces of the integrations.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate", reason="the accelerate integration needs accelerate")
pytest.importorskip("transformers", reason="the Trainer integration needs transformers")

import torch
from _children import _child_env, run_ranks
from accelerate import Accelerator
from accelerate.data_loader import skip_first_batches
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data.distributed import DistributedSampler

from resumable_loader import CheckpointError, DataLoader
from resumable_loader.integrations import _common
from resumable_loader.integrations.accelerate import _prepared_class, prepare_data_loader

# accelerate and transformers in the test process: see tests/conftest.py.
pytestmark = pytest.mark.heavy_imports

JOBS = Path(__file__).parents[1] / "_hf_jobs.py"
# The job's shape (``_hf_jobs``): batches of 4 out of 22 items or a 40-item stream, 3 epochs.
# Steps of a whole run: over all ranks for a map dataset, per rank for a stream (each rank
# reads its own 40 items per epoch); the Trainer's stream runs max_steps=9.
STEPS = {
    ("accelerate", "map"): 18,
    ("accelerate", "stream"): 30,
    ("trainer", "map"): 18,
    ("trainer", "stream"): 9,
    # 10 items a pass in batches of 3: max_steps=10, or 5 steps of 2 accumulated batches.
    ("trainer", "passes"): 10,
    ("trainer", "passes-ga2"): 10,
}
# Batches per optimizer step (the Trainer's gradient_accumulation_steps in the job).
ACCUMULATION = {"passes-ga2": 2}


def read_rows(log: Path, rank: int = 0) -> list[dict[str, Any]]:
    """Every training step a rank logged: step, epoch, ids, augmentation values."""
    path = Path(f"{log}.rank{rank}")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def fetched(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def assert_same_rows(got: list[dict[str, Any]], ref: list[dict[str, Any]], where: str) -> None:
    if got != ref:
        k = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        raise AssertionError(
            f"{where}: {len(got)} steps, the uninterrupted run has {len(ref)}; first difference "
            f"at row {k}: got {got[k : k + 2]} expected {ref[k : k + 2]}"
        )


def job(
    tmp: Path, which: str, name: str, kill_at: int, resume: bool, data: str, workers: int, world=1
) -> Path:
    """Run the job (``world`` ranks) with checkpoints in ``tmp/name``; return its log path.
    The dataset's fetches are logged to ``<log>.fetched`` (rank 0's, with one rank)."""
    log = tmp / f"{name}.log"
    env = {"FETCH_LOG": f"{log}.fetched"} if world == 1 else {}
    if resume:
        Path(f"{log}.fetched").unlink(missing_ok=True)  # only the resumed run's fetches
    args = [which, str(tmp / name), str(log), str(kill_at), "1" if resume else "0", data]
    run_ranks(JOBS, *args, str(workers), world=world, killed=kill_at >= 0, env=env)
    return log


def reference_here(tmp: Path, which: str, data: str, workers: int) -> Path:
    """The uninterrupted run of one process, in this one: the job's own code, without the
    seconds of a new interpreter importing torch and transformers."""
    import _hf_jobs

    log = tmp / "ref.log"
    run = _hf_jobs.run_accelerate if which == "accelerate" else _hf_jobs.run_trainer
    run(str(tmp / "ref"), str(log), -1, False, data, workers)
    return log


def kill_and_resume(
    tmp: Path, which: str, data: str, kill_at: int, workers: int, world: int = 1
) -> None:
    """The uninterrupted run, then one killed after step ``kill_at`` and resumed: the same
    rows on every rank and the same weights; the resumed run fetched only what it trained."""
    if world == 1:
        ref = reference_here(tmp, which, data, workers)
    else:
        ref = job(tmp, which, "ref", -1, False, data, workers, world)
    job(tmp, which, "run", kill_at, False, data, workers, world)
    before = [read_rows(tmp / "run.log", r) for r in range(world)]
    rows = kill_at * ACCUMULATION.get(data, 1)
    assert [len(b) for b in before] == [rows] * world, "killed after that step's checkpoint"
    run = job(tmp, which, "run", -1, True, data, workers, world)
    for r in range(world):
        assert_same_rows(read_rows(run, r), read_rows(ref, r), f"{which} {data} rank {r}")
    # A map epoch is shared by the ranks; each rank reads a whole stream of its own.
    assert len(read_rows(ref)) == STEPS[which, data] // (world if data == "map" else 1)
    weights = Path(f"{run}.weights").read_text()
    assert weights == Path(f"{ref}.weights").read_text(), "the same final weights, bit for bit"
    if world == 1 and not data.startswith("passes"):  # (passes read the items again)
        after = [i for row in read_rows(run)[kill_at:] for i in row["ids"]]
        got = fetched(Path(f"{run}.fetched"))
        trained_before = {i for row in before[0] for i in row["ids"]}
        if which == "trainer" and data == "stream":
            # max_steps ends the run before the stream does: the loader prefetched past it.
            assert not trained_before & set(got), "the resumed run re-read trained items"
            assert set(after) <= set(got)
        else:
            # The run ends where an epoch ends, so nothing is prefetched beyond it: every fetch
            # of the resumed run is a sample it trained.
            assert sorted(got) == sorted(after), "the resumed run fetched other samples"


# ---- accelerate --------------------------------------------------------------------------------
@pytest.mark.parametrize(("data", "kill_at", "workers"), [("map", 9, 2), ("stream", 13, 1)])
def test_accelerate_prepare_data_loader_sigkilled_mid_epoch_resumes_exactly(
    tmp_path: Path, data: str, kill_at: int, workers: int
) -> None:
    """``prepare_data_loader`` + ``accelerator.save_state()`` after every step; killed in the
    middle of epoch 1, resumed with ``accelerator.load_state()``: epochs 1 and 2 as the
    uninterrupted run, augmentation values included. ``stream``: a stream with state."""
    kill_and_resume(tmp_path, "accelerate", data, kill_at, workers)


@pytest.mark.slow
@pytest.mark.parametrize(("data", "kill_at"), [("map", 4), ("stream", 13)])
def test_accelerate_two_processes_sigkilled_mid_epoch_resume_exactly(
    tmp_path: Path, data: str, kill_at: int
) -> None:
    """Two gloo ranks: each takes its DistributedSampler share (map: 3 steps per epoch per
    rank) or reads its own part of the stream (10 steps per epoch); both killed in epoch 1,
    resumed; every rank's steps and the weights as uninterrupted."""
    kill_and_resume(tmp_path, "accelerate", data, kill_at, workers=1, world=2)


# 10 samples, batches of 3 (the last one of 1), gradients accumulated over 3 batches: each epoch
# is one step of 3 batches and one of the epoch's last batch, as accelerate steps at an end.
ACC_N, ACC_BATCH, ACC_STEPS, ACC_EPOCHS = 10, 3, 3, 3


def _accumulating(ours: bool, shuffle: bool) -> tuple[Accelerator, Any, Any, Any]:
    """A fresh accelerator (accumulating over ``ACC_STEPS``), model, optimizer and loader
    over the samples 0..9: ours through ``prepare_data_loader``, or torch's through
    ``accelerator.prepare``."""
    acc = Accelerator(cpu=True, gradient_accumulation_steps=ACC_STEPS)
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    data = torch.arange(ACC_N, dtype=torch.float32).unsqueeze(1) / ACC_N
    if ours:
        gen = torch.Generator().manual_seed(3)
        loader = prepare_data_loader(
            acc, DataLoader(data, batch_size=ACC_BATCH, shuffle=shuffle, generator=gen)
        )
    else:
        loader = acc.prepare(TorchDataLoader(data, batch_size=ACC_BATCH, shuffle=shuffle))
    return acc, model, opt, loader


def _accumulate_epochs(
    acc: Accelerator, model: Any, opt: Any, loader: Any, epochs: range, save: str | None = None
) -> list[list[float]]:
    """The docs' loop under ``accelerator.accumulate``: every optimizer step's batch values,
    in order. ``save``: ``accelerator.save_state(save)`` after the first epoch's last batch."""
    steps: list[list[float]] = []
    taken: list[float] = []
    for epoch in epochs:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for batch in loader:
            with acc.accumulate(model):
                acc.backward(model(batch).pow(2).mean())
                taken += batch.flatten().tolist()
                if acc.sync_gradients:
                    steps.append(taken)
                    taken = []
                opt.step()
                opt.zero_grad()
        if save is not None and epoch == epochs[0]:
            acc.save_state(save)
    return steps


def _weights(model: Any) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def test_accelerate_accumulate_steps_at_each_epoch_end_as_plain_prepare_does() -> None:
    """``accelerator.accumulate`` over our prepared loader makes the optimizer steps that
    accelerate's own prepared torch loader makes -- 2 per epoch, the second at the epoch's
    end with its 1 leftover batch -- over the same batches, to bit-identical weights."""
    ref_acc, ref_model, ref_opt, ref_loader = _accumulating(ours=False, shuffle=False)
    ref = _accumulate_epochs(ref_acc, ref_model, ref_opt, ref_loader, range(ACC_EPOCHS))
    assert len(ref) == 2 * ACC_EPOCHS, "accelerate steps at every epoch's end"
    acc, model, opt, loader = _accumulating(ours=True, shuffle=False)
    with loader:
        got = _accumulate_epochs(acc, model, opt, loader, range(ACC_EPOCHS))
        assert not acc.gradient_state.in_dataloader, "the loader unregistered at its end"
        # What gather_for_metrics reads, batch by batch: the same as for accelerate's loader.
        state = acc.gradient_state
        seen = [(state.in_dataloader, state.end_of_dataloader, state.remainder) for _ in loader]
    ref_state = ref_acc.gradient_state
    expected = [
        (ref_state.in_dataloader, ref_state.end_of_dataloader, ref_state.remainder)
        for _ in ref_loader
    ]
    assert expected[-1] == (True, True, ACC_N % ACC_BATCH)
    assert seen == expected
    assert got == ref, f"{len(got)} optimizer steps, accelerate's loader makes {len(ref)}"
    assert _weights(model) == _weights(ref_model), "the same weights, bit for bit"


def test_accelerate_save_state_at_an_epoch_end_resumes_to_the_uninterrupted_weights(
    tmp_path: Path,
) -> None:
    """The docs' recipe with ``accelerator.accumulate`` and a shuffling loader:
    ``save_state`` after epoch 0's last batch, then new objects ``load_state`` and train
    epochs 1 and 2. The optimizer steps and final weights are those of the uninterrupted run
    (no accumulation was pending at the save: the epoch's end stepped)."""
    acc, model, opt, loader = _accumulating(ours=True, shuffle=True)
    with loader:
        ref = _accumulate_epochs(acc, model, opt, loader, range(ACC_EPOCHS))
    ref_weights = _weights(model)

    ckpt = str(tmp_path / "ckpt")
    acc, model, opt, loader = _accumulating(ours=True, shuffle=True)
    with loader:
        first = _accumulate_epochs(acc, model, opt, loader, range(1), save=ckpt)
    acc, model, opt, loader = _accumulating(ours=True, shuffle=True)
    with loader:
        acc.load_state(ckpt)
        start = loader.state_dict()["epoch"]
        assert start == 1, "the state saved at the epoch's last batch begins the next epoch"
        rest = _accumulate_epochs(acc, model, opt, loader, range(start, ACC_EPOCHS))
    assert first + rest == ref
    assert _weights(model) == ref_weights, "the same weights, bit for bit"


class _Items(torch.utils.data.IterableDataset):
    """A stream of the floats 0..n-1 without a length (each epoch reads it again); worker w
    of W reads w, w + W, ..."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, world = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(torch.arange(w, self.n, world, dtype=torch.float32).unsqueeze(1))


@pytest.mark.filterwarnings("ignore:resuming an iterable dataset without state_dict")
@pytest.mark.parametrize("workers", [0, 2])
def test_accelerate_stream_without_length_ends_its_epoch_and_keeps_its_position(
    workers: int,
) -> None:
    """A stream has no length: the prepared loader takes one batch ahead to see its end, as
    accelerate's loader does, so ``end_of_dataloader`` is set at the epoch's last batch only,
    as for accelerate's prepared torch loader over the same stream. A ``state_dict()`` taken
    while the batch ahead is held is the caller's position: resumed in a new loader, it gives
    the rest of the uninterrupted epoch and the next one."""
    ref_acc = Accelerator(cpu=True)
    ref_loader = ref_acc.prepare(TorchDataLoader(_Items(10), batch_size=3, num_workers=workers))
    ref = [(b.flatten().tolist(), ref_acc.gradient_state.end_of_dataloader) for b in ref_loader]
    assert [end for _, end in ref] == [False] * (len(ref) - 1) + [True]

    acc = Accelerator(cpu=True)

    def prepared() -> DataLoader[Any]:
        return prepare_data_loader(acc, DataLoader(_Items(10), batch_size=3, num_workers=workers))

    with prepared() as loader:
        it = iter(loader)
        got = [(b.flatten().tolist(), acc.gradient_state.end_of_dataloader) for b in [next(it)]]
        state = loader.state_dict()
        got += [(b.flatten().tolist(), acc.gradient_state.end_of_dataloader) for b in it]
        assert got == ref
        assert not acc.gradient_state.in_dataloader
        whole = [b.flatten().tolist() for b in loader]
    with prepared() as loader:
        loader.load_state_dict(state)
        resumed = [b.flatten().tolist() for b in loader] + [b.flatten().tolist() for b in loader]
    assert resumed == [b for b, _ in ref[1:]] + whole


def test_plain_prepare_of_our_loader_warns_once_naming_the_call_to_use(tmp_path: Path) -> None:
    """``accelerator.prepare(our_loader)`` replaces the loader (the warning says so, once per
    loader, pointing at the user's line); torch's loaders and our ``prepare_data_loader`` are
    not warned about. ``skip_first_batches`` (what the Trainer calls) says what it does."""
    acc = Accelerator(cpu=True)
    ours = DataLoader(list(range(10)), batch_size=3, shuffle=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        replaced = acc.prepare(ours)  # the line the warning must name
        acc.prepare(ours)
        acc.prepare(TorchDataLoader(list(range(10)), batch_size=3))
        kept = prepare_data_loader(acc, DataLoader(list(range(10)), batch_size=3, shuffle=True))
    msgs = [w for w in caught if "resumable_loader" in str(w.message)]
    assert len(msgs) == 1, [str(w.message) for w in caught]
    assert "prepare_data_loader(accelerator, loader)" in str(msgs[0].message)
    assert (msgs[0].filename, msgs[0].lineno) == (__file__, line)
    assert type(replaced).__name__ == "DataLoaderShard", "accelerate did replace it"
    assert isinstance(kept, DataLoader) and isinstance(kept.sampler, DistributedSampler)
    # What accelerate's save_state keeps of the replaced loader: no position at all.
    acc.save_state(str(tmp_path / "ckpt"))
    names = os.listdir(tmp_path / "ckpt")
    assert not any("dl_state" in n for n in names), names
    assert "resumable_loader_0.state" in names, "the loader kept by prepare_data_loader is saved"

    with pytest.warns(UserWarning, match=r"skip_first_batches\(\).*ResumableTrainer"):
        skip_first_batches(DataLoader(list(range(10)), batch_size=3), 2)


def test_placed_batches_move_to_the_device_and_keep_the_state() -> None:
    """Off the CPU the prepared loader moves each batch as it is taken (here to the ``meta``
    device, which any machine has) and stays our loader, with our state."""
    base = DataLoader(list(range(10)), batch_size=3, shuffle=True)
    loader = _common.shard(base, 1, 0, 5, cls=_prepared_class(DataLoader))
    loader.placement_device = torch.device("meta")
    loader.gradient_state = Accelerator(cpu=True).gradient_state
    loader._accelerate_world = 1
    assert isinstance(loader, DataLoader) and type(loader).__name__ == "DataLoader"
    it = iter(loader)
    batches = [next(it), next(it)]
    assert all(b.device.type == "meta" for b in batches)
    assert loader.state_dict()["consumed"] == 2
    del it


def test_shard_refuses_what_it_cannot_share_and_reads_no_missing_state(tmp_path: Path) -> None:
    class Custom(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(range(10))

        def __len__(self) -> int:
            return 10

    loader = DataLoader(list(range(10)), batch_size=2, sampler=Custom())
    with pytest.raises(ValueError, match="cannot share a sampler of type Custom over 2"):
        _common.shard(loader, 2, 0, None)
    assert _common.shard(loader, 1, 0, None).sampler is loader.sampler  # one process: kept
    with pytest.raises(CheckpointError, match="was not written by ResumableTrainer"):
        _common.read_state(str(tmp_path), "resumable_loader.state", "ResumableTrainer")


def test_accelerate_stream_without_generator_resumes_across_the_epoch_boundary(
    tmp_path: Path,
) -> None:
    """No ``generator``, and the resumed process's global RNG holds something else: the later
    epochs still come from the saved seed chain. Saved in epoch 0, resumed into epoch 1."""
    from _hf_jobs import Stream

    def prepared(acc: Accelerator) -> DataLoader[Any]:
        return prepare_data_loader(acc, DataLoader(Stream(), batch_size=4))

    torch.manual_seed(1)
    acc = Accelerator(cpu=True)
    loader = prepared(acc)
    ref: list[Any] = []
    it = iter(loader)
    for _ in range(3):
        next(it)
    acc.save_state(str(tmp_path / "ckpt"))
    ref += [b["aug"].tolist() for b in it]
    ref += [b["aug"].tolist() for b in loader]
    loader.close()

    acc = Accelerator(cpu=True)
    loader = prepared(acc)
    acc.load_state(str(tmp_path / "ckpt"))
    torch.manual_seed(2)  # whatever the restarted process's global RNG holds
    got = [b["aug"].tolist() for b in loader] + [b["aug"].tolist() for b in loader]
    loader.close()
    assert got[:7] == ref[:7], "the rest of the interrupted epoch is exact today"
    assert got == ref


class _Interrupted(_Items):
    """``_Items`` that raises KeyboardInterrupt (a Ctrl-C) once, when asked for item ``at``."""

    def __init__(self, n: int, at: int) -> None:
        super().__init__(n)
        self.at: int | None = at

    def __iter__(self):
        for x in super().__iter__():
            if int(x) == self.at:
                self.at = None
                raise KeyboardInterrupt
            yield x


@pytest.mark.filterwarnings("ignore:resuming an iterable dataset without state_dict")
@pytest.mark.parametrize("taken", [0, 1])
def test_accelerate_stream_ctrl_c_while_taking_the_batch_ahead_keeps_the_position(
    taken: int,
) -> None:
    """A Ctrl-C while the prepared loader takes a batch ahead, after the caller took
    ``taken`` batches (the next one was fetched, never handed out): the state is the
    caller's position, and a loader resumed from it gives the rest of the uninterrupted
    epoch, the batch that was never handed out first."""
    acc = Accelerator(cpu=True)
    ref = [b.flatten().tolist() for b in TorchDataLoader(_Items(10), batch_size=3)]
    at = 3 * (taken + 1) + 1  # an item of the batch after the one fetched but not handed out
    with prepare_data_loader(acc, DataLoader(_Interrupted(10, at), batch_size=3)) as loader:
        got = []
        with pytest.raises(KeyboardInterrupt):
            for batch in loader:
                got.append(batch.flatten().tolist())
        state = loader.state_dict()
    assert got == ref[:taken] and state["consumed"] == taken
    resumed = DataLoader(_Interrupted(10, at=-1), batch_size=3)  # (no interrupt)
    with prepare_data_loader(acc, resumed) as loader:
        loader.load_state_dict(state)
        assert [b.flatten().tolist() for b in loader] == ref[taken:]


# ---- transformers' Trainer ---------------------------------------------------------------------
def test_resumable_trainer_sigkilled_mid_epoch_resumes_exactly(tmp_path: Path) -> None:
    """``ResumableTrainer``, a checkpoint every step, SIGKILLed after step 9 (epoch 1, 3 of 6)
    and resumed with ``train(resume_from_checkpoint=True)``: epochs 1 and 2 train the samples
    and augmentation values of the uninterrupted run, which ends with the same weights; the
    resumed run fetched exactly what it trained (the Trainer's skip fetched nothing)."""
    kill_and_resume(tmp_path, "trainer", "map", 9, workers=2)


@pytest.mark.parametrize(
    ("data", "stop_at"),
    [("passes", 6), ("passes", 4), ("passes-ga2", 3)],
    ids=["pass1-step2", "pass0-end", "accumulation2-pass1"],
)
def test_resumable_trainer_stream_without_length_resumes_after_a_pass(
    tmp_path: Path, data: str, stop_at: int
) -> None:
    """A 10-item stream without ``len()`` in batches of 3 (4 batches a pass), which
    ``max_steps`` runs through more than twice: training stops after the checkpoint of a
    step in the second pass, or of the first pass's last batch, and a new Trainer resumes
    with ``train(resume_from_checkpoint=True)``. It trains what the uninterrupted run
    trained, step for step, and ends with its weights; the Trainer's epoch counts the passes
    as in the uninterrupted run. (Without a length the Trainer counts the whole run as one
    epoch of ``max_steps`` steps, which no loader position within a pass matches.) In this
    process, for speed; the SIGKILLed run is the slow test below."""
    import _hf_jobs

    ref = reference_here(tmp_path, "trainer", data, workers=1)
    log = tmp_path / "run.log"
    _hf_jobs.run_trainer(str(tmp_path / "run"), str(log), stop_at, False, data, 1, stop=True)
    assert len(read_rows(log)) == stop_at * ACCUMULATION.get(data, 1)
    _hf_jobs.run_trainer(str(tmp_path / "run"), str(log), -1, True, data, 1)
    assert_same_rows(read_rows(log), read_rows(ref), f"trainer {data}")
    assert len(read_rows(ref)) == STEPS["trainer", data]
    weights = Path(f"{log}.weights").read_text()
    assert weights == Path(f"{ref}.weights").read_text(), "the same final weights, bit for bit"


@pytest.mark.slow
def test_resumable_trainer_stream_without_length_sigkilled_in_its_second_pass(
    tmp_path: Path,
) -> None:
    """As above, SIGKILLed after the checkpoint of step 6 (the second pass's second batch)
    and resumed in a new process."""
    kill_and_resume(tmp_path, "trainer", "passes", 6, workers=1)


@pytest.mark.slow
def test_resumable_trainer_stateful_stream_sigkilled_resumes_without_rereading(
    tmp_path: Path,
) -> None:
    """A stream with state under ``max_steps=9``, killed after step 4: the resumed run reads
    none of the 16 items trained before (the Trainer's own resume re-reads them all)."""
    kill_and_resume(tmp_path, "trainer", "stream", 4, workers=1)


@pytest.mark.slow
@pytest.mark.parametrize("data", ["map", "stream"])
def test_resumable_trainer_two_processes_sigkilled_resume_exactly(
    tmp_path: Path, data: str
) -> None:
    """Two gloo ranks (``TrainingArguments`` reads torch's environment variables), killed after
    step 4 (map: epoch 1 of 3 steps per rank; stream: 4 of max_steps=9), resumed: every rank's
    steps and the weights as uninterrupted."""
    kill_and_resume(tmp_path, "trainer", data, 4, workers=1, world=2)


def test_importing_the_package_imports_no_framework() -> None:
    """The integrations are optional: ``import resumable_loader`` (which installs the rebuild
    warning from ``integrations._rebuilt``) imports neither accelerate nor transformers."""
    code = (
        "import sys, resumable_loader, resumable_loader.integrations; "
        "print(sorted(m for m in ('accelerate', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_child_env(), check=True
    )
    assert out.stdout.strip() == "[]", out
