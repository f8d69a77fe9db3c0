"""Real trainers and real stateful datasets under our DataLoader (issue #9).

* Hugging Face ``datasets``: an ``IterableDataset`` (``state_dict()``/``load_state_dict()``)
  built locally, used the way its docs say (``set_epoch`` before each epoch), resumed at
  several points and with SIGKILLed workers; compared with an uninterrupted run, values
  included (a ``.map`` augmentation draws random numbers).
* PyTorch Lightning: its ``Trainer`` keeps the state of every loader that has
  ``state_dict()``/``load_state_dict()`` in its checkpoints (``_Stateful`` check in
  ``CombinedLoader._state_dicts``; saved by ``FitLoop.on_save_checkpoint`` under
  ``loops.fit_loop.state_dict.combined_loader``) and gives it back to the loader in
  ``fit(ckpt_path=...)`` (``FitLoop._load_combined_loader_states``, before the epoch's one
  ``iter()``; only while the fit loop is "restarting", i.e. the saved epoch was unfinished or
  the training is bounded by ``max_steps``). For a loader with a ``len()`` Lightning fetches no
  batch ahead (``_PrefetchDataFetcher.__iter__``), so the checkpoint written after global step k
  holds the state "k+1 batches of this epoch consumed". Training runs in child processes that
  are SIGKILLed mid-epoch and resumed from ``last.ckpt``; the sample ids of every global step
  must equal those of an uninterrupted run.

Both kinds of test also leave the loop the way users do before saving (``break``, ``islice``,
an exception or Ctrl-C in the loop body; for Lightning: a ``max_steps`` budget, after which
``fit`` has torn its iterator down before ``trainer.save_checkpoint``).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

# No network at test time: everything here is built locally.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from _children import assert_same_steps, read_steps, run_child

from resumable_loader import DataLoader
from resumable_loader.testing import canonical, kill_at, kill_worker, roundtrip_state

if TYPE_CHECKING:
    import datasets

# datasets, transformers and lightning in the test process: see tests/conftest.py.
pytestmark = pytest.mark.heavy_imports

# ---- Hugging Face datasets --------------------------------------------------------------------
HF_ITEMS = 48
HF_SHARDS = 4
HF_BATCH = 4
HF_EPOCHS = 2
HF_BATCHES = HF_ITEMS // HF_BATCH  # per epoch, whatever the number of workers


def _augment(example: dict[str, Any]) -> dict[str, Any]:
    """A random augmentation, drawn from the global RNGs the loader seeds per fetch."""
    return {"noise": random.random(), "jitter": float(torch.rand(()))}


def make_hf_stream() -> datasets.IterableDataset:
    """Items are their own id; 4 shards, so 2 workers get 2 each.

    No ``.shuffle(buffer_size=...)``: datasets documents that a shuffle buffer's content is not
    in its state (a resume refills it), so no loader can resume one exactly.
    """
    # Imported here, not at collection: datasets brings pyarrow and pandas (85 MB) into the test
    # process, and every worker of every later test is forked from it (tests/conftest.py runs
    # the tests marked heavy_imports last).
    import datasets

    ds = datasets.Dataset.from_dict({"id": list(range(HF_ITEMS))})
    return ds.to_iterable_dataset(num_shards=HF_SHARDS).map(_augment)


HF_CONFIGS = {
    "w0": dict(num_workers=0),
    "w2": dict(num_workers=2),
    "w2-persistent": dict(num_workers=2, persistent_workers=True),
}
# How each config's saved state travels, as a user stores it (see testing.roundtrip_state).
HF_VIA = {"w0": "json", "w2": "torch", "w2-persistent": "bytes"}


def make_hf_loader(config: str) -> tuple[datasets.IterableDataset, DataLoader[Any]]:
    ds = make_hf_stream()
    loader = DataLoader(
        ds, batch_size=HF_BATCH, generator=torch.Generator().manual_seed(7), **HF_CONFIGS[config]
    )
    return ds, loader


def hf_epochs(
    ds: datasets.IterableDataset, loader: DataLoader[Any], start: int = 0
) -> Iterator[tuple[int, Iterator[Any]]]:
    """The user's epoch loop: ``set_epoch`` (datasets reshuffles its shards per epoch, and
    a loaded state applies only to the epoch it was saved in), then one pass of the loader."""
    for epoch in range(start, HF_EPOCHS):
        ds.set_epoch(epoch)
        yield epoch, iter(loader)


_HF_REFERENCE: dict[str, list[list[Any]]] = {}


def hf_reference(config: str) -> list[list[Any]]:
    """The canonical batches of an uninterrupted run, per epoch (cached per config)."""
    if config not in _HF_REFERENCE:
        ds, loader = make_hf_loader(config)
        with loader:
            ref = [[canonical(b) for b in it] for _, it in hf_epochs(ds, loader)]
        assert [len(r) for r in ref] == [HF_BATCHES] * HF_EPOCHS
        ids = [sorted(i for b in r for i in _ids(b)) for r in ref]
        assert ids == [list(range(HF_ITEMS))] * HF_EPOCHS, "each epoch holds every item once"
        assert ref[0] != ref[1], "epochs differ (shard order and augmentation)"
        _HF_REFERENCE[config] = ref
    return _HF_REFERENCE[config]


def _ids(batch: Any) -> list[int]:
    """The sample ids of a canonical batch."""
    fields = dict(batch[1])
    return list(fields["id"][3])


class _LeaveLoop(Exception):
    """Raised by the training step to leave the loop (a NaN check, a failed step...)."""


def consume(it: Iterator[Any], n: int, leave: str) -> list[Any]:
    """Take ``n`` batches from ``it`` and leave the loop the way a training loop does.

    ``leave``: "inside" (the state is taken by the caller while the iterator is alive),
    "break", "islice" (``itertools.islice(it, n)``), "exception" and "ctrl-c" (raised by the
    loop body after its n-th batch), "epoch-end" (the loop runs until StopIteration).
    """
    got: list[Any] = []
    if leave == "epoch-end":
        got = [canonical(b) for b in it]
    elif leave == "islice":
        got = [canonical(b) for b in itertools.islice(it, n)]
    elif leave in ("inside", "break"):
        if n:
            for b in it:
                got.append(canonical(b))
                if len(got) == n:
                    break
    elif leave in ("exception", "ctrl-c"):
        exc = _LeaveLoop if leave == "exception" else KeyboardInterrupt
        try:
            for b in it:
                got.append(canonical(b))
                if len(got) == n:
                    raise exc(f"left after {n} batches")
        except (_LeaveLoop, KeyboardInterrupt):
            pass
    else:
        raise ValueError(leave)
    return got


def hf_save_then_resume(config: str, epoch: int, n: int, leave: str) -> list[list[Any]]:
    """Run to batch ``n`` of ``epoch``, leave the loop as ``leave`` says, save the state, and
    run the rest of the epochs in a fresh dataset and loader loaded from it.

    Returns the batches of every epoch, both runs together."""
    got: list[list[Any]] = [[] for _ in range(HF_EPOCHS)]
    ds, loader = make_hf_loader(config)
    with loader:
        for e, it in hf_epochs(ds, loader):
            if e < epoch:
                got[e] = [canonical(b) for b in it]
                continue
            if leave == "inside":
                got[e] = consume(it, n, leave)
                sd = loader.state_dict()  # between batches, iterator alive
            else:
                got[e] = consume(it, n, leave)
                del it  # the loop's iterator is gone, as it is after `for` in user code
                sd = loader.state_dict()
            break
    # The user saves its own epoch counter with the loader state: the epoch to run next.
    resume_epoch = epoch + 1 if leave == "epoch-end" else epoch
    sd = roundtrip_state(sd, HF_VIA[config])
    del ds, loader
    ds, loader = make_hf_loader(config)
    with loader:
        loader.load_state_dict(sd)
        for e, it in hf_epochs(ds, loader, start=resume_epoch):
            got[e].extend(canonical(b) for b in it)
    return got


def assert_same_stream(got: list[list[Any]], ref: list[list[Any]], where: str) -> None:
    for e, (g, r) in enumerate(zip(got, ref)):
        if g != r:
            k = next((k for k, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
            raise AssertionError(
                f"{where}: epoch {e} differs from the uninterrupted run at batch {k}: "
                f"{len(g)} batches, expected {len(r)}; "
                f"ids got {[_ids(b) for b in g]}, expected {[_ids(b) for b in r]}; "
                f"first differing batch got {g[k : k + 1]!r:.300} expected {r[k : k + 1]!r:.300}"
            )


# Save points (epoch, batches consumed in it): early, mid, after the last batch but before
# StopIteration, and in the second epoch (whose shard order differs).
HF_POINTS = [(0, 1), (0, 7), (0, HF_BATCHES), (1, 4)]


@pytest.mark.parametrize("config", list(HF_CONFIGS))
def test_hf_iterable_resumes_exactly_state_taken_in_loop(config: str) -> None:
    """State taken between batches while the iterator is alive, and after StopIteration."""
    ref = hf_reference(config)
    for epoch, n in [*HF_POINTS, (0, 0)]:
        got = hf_save_then_resume(config, epoch, n, "inside")
        assert_same_stream(got, ref, f"{config}: state in the loop at epoch {epoch} batch {n}")
    for epoch in range(HF_EPOCHS):
        got = hf_save_then_resume(config, epoch, HF_BATCHES, "epoch-end")
        assert_same_stream(got, ref, f"{config}: state after StopIteration of epoch {epoch}")


@pytest.mark.parametrize("leave", ["break", "islice", "exception", "ctrl-c"])
@pytest.mark.parametrize("config", list(HF_CONFIGS))
def test_hf_iterable_resumes_exactly_after_leaving_the_loop(config: str, leave: str) -> None:
    """Issue #9: leave the ``for`` loop, then ``loader.state_dict()``: it describes exactly
    what the loop received, and a fresh loader continues there."""
    ref = hf_reference(config)
    for epoch, n in HF_POINTS:
        got = hf_save_then_resume(config, epoch, n, leave)
        assert_same_stream(got, ref, f"{config}: {leave} at epoch {epoch} after {n} batches")


@pytest.mark.parametrize("config", ["w2", "w2-persistent"])
def test_hf_iterable_sigkilled_workers_give_the_uninterrupted_stream(config: str) -> None:
    """A worker SIGKILLed mid-epoch is respawned from its stream's last delivered state."""
    ref = hf_reference(config)
    plans = [{2: [(0, signal.SIGKILL)]}, {1: [(1, signal.SIGKILL)], 6: [(0, signal.SIGKILL)]}]
    ds, loader = make_hf_loader(config)
    with loader:
        got = []
        for epoch, plan in enumerate(plans):
            ds.set_epoch(epoch)
            got.append([canonical(b) for b in kill_at(loader, plan)])
        stats = loader.statistics()
    del ds, loader  # a failure's traceback must not keep the dataset's shared memory open
    assert_same_stream(got, ref, f"{config}: workers SIGKILLed")
    # kill_worker raises if the worker is not running, so three kills landed; each one that
    # caught its worker with work left was followed by a respawn.
    assert stats.respawns_by_cause.get("signal:SIGKILL", 0) >= 1, stats


@pytest.mark.parametrize("config", ["w2", "w2-persistent"])
def test_hf_iterable_sigkilled_worker_then_break_resumes_exactly(config: str) -> None:
    """Kill a worker, go on, leave the loop, save: the resumed run ends the epochs exactly."""
    ref = hf_reference(config)
    ds, loader = make_hf_loader(config)
    got: list[list[Any]] = [[] for _ in range(HF_EPOCHS)]
    with loader:
        ds.set_epoch(0)
        got[0] = [canonical(b) for b in loader]
        ds.set_epoch(1)
        it = iter(loader)
        for b in it:
            got[1].append(canonical(b))
            if len(got[1]) == 3:
                kill_worker(loader, 0, signal.SIGKILL)
            if len(got[1]) == 7:
                break
        del it
        sd = roundtrip_state(loader.state_dict(), HF_VIA[config])
    del ds, loader
    ds, loader = make_hf_loader(config)
    with loader:
        loader.load_state_dict(sd)
        ds.set_epoch(1)
        got[1].extend(canonical(b) for b in loader)
    del ds, loader  # a failure's traceback must not keep the dataset's shared memory open
    assert_same_stream(got, ref, f"{config}: worker killed, then break at batch 7 of epoch 1")


def test_hf_shuffle_buffer_stream_warns_once_when_saved_and_once_when_resumed() -> None:
    """``.shuffle(buffer_size=8)``: datasets keeps no buffer content in its state, so a resume
    never trains the examples the buffer held (here the resumed epoch lacks some ids of the
    uninterrupted one). ``state_dict()`` says so once per loader with a RuntimeWarning naming
    the buffer and the fix, and so does ``load_state_dict()`` in the resuming loader; a stream
    without a buffer is not warned about."""
    import datasets

    def loader_over_buffered() -> DataLoader[Any]:
        ds = datasets.Dataset.from_dict({"id": list(range(24))}).to_iterable_dataset(num_shards=2)
        return DataLoader(ds.shuffle(seed=0, buffer_size=8), batch_size=4)

    def ids(batches: Iterator[Any]) -> list[int]:
        return [i for b in batches for i in b["id"].tolist()]

    match = r"shuffle\(buffer_size=8\).*no loader can resume this exactly.*drop the buffer"
    with loader_over_buffered() as loader:
        whole = ids(iter(loader))
    with loader_over_buffered() as loader:
        it = iter(loader)
        first = ids(itertools.islice(it, 2))
        with pytest.warns(RuntimeWarning, match=f"(?si)^saving .*{match}") as saved:
            state = loader.state_dict()
            loader.state_dict()
        del it
    with loader_over_buffered() as loader:
        with pytest.warns(RuntimeWarning, match=f"(?si)^resuming .*{match}") as resumed:
            loader.load_state_dict(state)
        rest = ids(iter(loader))
    assert [len(saved), len(resumed)] == [1, 1], "once per loader"
    assert sorted(whole) == list(range(24))
    assert sorted(first + rest) != sorted(whole), "the buffer's examples were lost at the resume"

    _, plain = make_hf_loader("w0")
    with plain, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        plain.load_state_dict(plain.state_dict())


# ---- PyTorch Lightning -------------------------------------------------------------------------
LIGHTNING_SCRIPT = '''
"""A tiny Lightning fit on CPU over a map dataset whose items are their own index.

Every training step appends (global step, epoch, sample ids) to LOG, flushed and fsynced, so
the lines written before a SIGKILL survive it.

usage: script.py fit ROOT LOG KILL_AT RESUME
           epoch-bounded fit, a checkpoint after every step (ROOT/ckpt/last.ckpt); the process
           SIGKILLs itself at the start of global step KILL_AT (-1: never), when last.ckpt
           holds step KILL_AT - 1; RESUME=1: fit(ckpt_path=last.ckpt)
       script.py budgets ROOT LOG B1,B2,...
           fit(max_steps=B1), leave fit, trainer.save_checkpoint(ROOT/budget0.ckpt); a new
           Trainer, module and loader: fit(max_steps=B2, ckpt_path=budget0.ckpt), ...
"""
import json
import os
import signal
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from resumable_loader import DataLoader

N, BATCH, EPOCHS, SEED = @PARAMS@


class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor(i)


class Net(pl.LightningModule):
    def __init__(self, log, kill_at=-1):
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)
        self.log_path = log
        self.kill_at = kill_at

    def train_dataloader(self):
        return DataLoader(
            Ids(),
            batch_size=BATCH,
            shuffle=True,
            num_workers=2,
            generator=torch.Generator().manual_seed(SEED),
        )

    def training_step(self, batch, batch_idx):
        if self.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # preempted mid-step, workers running
        rec = {"step": self.global_step, "epoch": self.current_epoch, "ids": batch.tolist()}
        with open(self.log_path, "a") as f:
            f.write(json.dumps(rec) + "\\n")
            f.flush()
            os.fsync(f.fileno())
        return self.lin(batch.float().unsqueeze(1) / N).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(root, **kw):
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        **kw,
    )


def save_weights(net, log):
    with open(log + ".weights", "w") as f:
        json.dump([p.detach().flatten().tolist() for p in net.parameters()], f)


def main():
    mode, root, log = sys.argv[1:4]
    torch.manual_seed(0)
    if mode == "fit":
        kill_at, resume = int(sys.argv[4]), sys.argv[5] == "1"
        ckpt = ModelCheckpoint(
            dirpath=os.path.join(root, "ckpt"), every_n_train_steps=1, save_last=True, save_top_k=0
        )
        net = Net(log, kill_at)
        t = trainer(root, max_epochs=EPOCHS, callbacks=[ckpt])
        t.fit(net, ckpt_path=os.path.join(root, "ckpt", "last.ckpt") if resume else None)
        save_weights(net, log)
    elif mode == "budgets":
        path = None
        for i, budget in enumerate(int(b) for b in sys.argv[4].split(",")):
            net = Net(log)
            t = trainer(root, max_epochs=-1, max_steps=budget, enable_checkpointing=False)
            t.fit(net, ckpt_path=path)
            path = os.path.join(root, f"budget{i}.ckpt")
            t.save_checkpoint(path)  # after fit: its iterator was torn down
        save_weights(net, log)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
'''

PL_ITEMS, PL_BATCH, PL_EPOCHS, PL_SEED = 22, 4, 3, 1234  # N, BATCH, EPOCHS, SEED of the script
PL_STEPS_PER_EPOCH = -(-PL_ITEMS // PL_BATCH)  # 6: five batches of 4, one of 2
PL_STEPS = PL_EPOCHS * PL_STEPS_PER_EPOCH


# Lightning's warning when it resumes mid-epoch with a loader that is not `_Stateful`.
NOT_RESUMABLE = "your dataloader is not resumable"


def loader_state_in(ckpt: Path) -> dict[str, Any]:
    """The state Lightning stored for our loader. Plain data: ``weights_only=True`` loads it."""
    sd = torch.load(ckpt, weights_only=True)
    states = sd["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert len(states) == 1 and states[0]["format"] == "resumable_loader.DataLoader", states
    return states[0]


@pytest.fixture(scope="module")
def lightning_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lightning") / "train.py"
    path.write_text(
        LIGHTNING_SCRIPT.replace("@PARAMS@", repr((PL_ITEMS, PL_BATCH, PL_EPOCHS, PL_SEED)))
    )
    return path


@pytest.fixture(scope="module")
def lightning_reference(
    lightning_script: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[Any], Any]:
    """The uninterrupted fit: (step, epoch, ids) per global step, and the final weights."""
    root = tmp_path_factory.mktemp("reference")
    log = root / "log"
    run_child(lightning_script, "fit", str(root), str(log), "-1", "0", killed=False)
    rows = read_steps(log)
    # Lightning iterates the loader once per epoch, a step per batch: the ids are exactly
    # our loader's epochs one after the other.
    loader = DataLoader(
        range(PL_ITEMS),
        batch_size=PL_BATCH,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(PL_SEED),
    )
    with loader:
        plain = [(e, b.tolist()) for e in range(PL_EPOCHS) for b in loader]
    assert [(e, ids) for _, e, ids in rows] == plain
    assert [s for s, _, _ in rows] == list(range(PL_STEPS))
    return rows, json.loads(Path(f"{log}.weights").read_text())


def test_lightning_fit_sigkilled_mid_epoch_resumes_to_the_same_samples_per_step(
    lightning_script: Path, lightning_reference: tuple[list[Any], Any], tmp_path: Path
) -> None:
    """SIGKILL the training process in the middle of epoch 0 and again in the middle of epoch 1
    (a run that was itself resumed), resume each time with ``fit(ckpt_path=last.ckpt)``."""
    ref, ref_weights = lightning_reference
    log = tmp_path / "log"
    outs = []
    # (kill at global step, resumed?, the loader state in last.ckpt once it is killed)
    for kill, resume, state in [(3, False, (0, 3)), (9, True, (1, 3)), (-1, True, None)]:
        out = run_child(
            lightning_script,
            "fit",
            str(tmp_path),
            str(log),
            str(kill),
            "1" if resume else "0",
            killed=kill >= 0,
        )
        outs.append(out)
        if state is not None:
            # What Lightning saved after step kill-1: that step's batch and all before it
            # consumed; nothing of the batch Lightning never fetched.
            sd = loader_state_in(tmp_path / "ckpt" / "last.ckpt")
            assert (sd["epoch"], sd["consumed"]) == state, sd
            assert [s for s, _, _ in read_steps(log)] == list(range(kill))
    assert_same_steps(read_steps(log), ref, "killed at steps 3 and 9", out)
    # Lightning recognised the loader as resumable (its `_Stateful` check), so it did not warn.
    assert not any(NOT_RESUMABLE in o for o in outs), outs
    weights = json.loads(Path(f"{log}.weights").read_text())
    assert weights == ref_weights, "same batches per step, so the same final weights, bit for bit"


def test_lightning_fit_sigkilled_after_the_last_step_of_an_epoch_resumes_exactly(
    lightning_script: Path, lightning_reference: tuple[list[Any], Any], tmp_path: Path
) -> None:
    """The checkpoint of the last step of epoch 0 is taken after its last batch, before
    StopIteration. On resume Lightning counts epoch 0 as done (``FitLoop.reset``: restarted on
    train batch end with ``is_last_batch``), moves to epoch 1, and iterates the loader it
    restored once (``FitLoop.setup_data``; ``_TrainingEpochLoop.on_run_start`` makes no second
    ``iter()`` while restarting). That ``iter()`` must yield epoch 1's batches: the state says
    "epoch 1, nothing consumed", as after StopIteration (torchdata does the same).

    Were the state "epoch 0, every batch consumed", the first ``iter()`` would yield nothing:
    Lightning's epoch 1 would get no batch, its epoch 2 our epoch 1, and the fit would stop at
    ``max_epochs`` one epoch of steps short."""
    ref, ref_weights = lightning_reference
    log = tmp_path / "log"
    kill = PL_STEPS_PER_EPOCH  # the first step of epoch 1; last.ckpt: the last one of epoch 0
    run_child(lightning_script, "fit", str(tmp_path), str(log), str(kill), "0", killed=True)
    sd = loader_state_in(tmp_path / "ckpt" / "last.ckpt")
    assert (sd["epoch"], sd["consumed"]) == (1, 0), sd
    out = run_child(lightning_script, "fit", str(tmp_path), str(log), "-1", "1", killed=False)
    assert_same_steps(read_steps(log), ref, f"killed at step {kill} (epoch 1's first)", out)
    assert json.loads(Path(f"{log}.weights").read_text()) == ref_weights


def test_lightning_leave_fit_then_save_checkpoint_resumes_exactly(
    lightning_script: Path, lightning_reference: tuple[list[Any], Any], tmp_path: Path
) -> None:
    """Issue #9 under Lightning: a ``max_steps`` budget ends ``fit`` mid-epoch, ``fit`` tears its
    iterator down (``_DataFetcher.teardown`` -> ``CombinedLoader.reset``), and only then does
    ``trainer.save_checkpoint`` ask the loader for its state. Budgets 3 (epoch 0) and 9
    (epoch 1, in a resumed run), then the rest."""
    ref, ref_weights = lightning_reference
    log = tmp_path / "log"
    out = run_child(
        lightning_script, "budgets", str(tmp_path), str(log), f"3,9,{PL_STEPS}", killed=False
    )
    for i, state in enumerate([(0, 3), (1, 3)]):
        sd = loader_state_in(tmp_path / f"budget{i}.ckpt")
        assert (sd["epoch"], sd["consumed"]) == state, (i, sd)
    assert_same_steps(read_steps(log), ref, "fit left at steps 3 and 9, saved after fit", out)
    assert json.loads(Path(f"{log}.weights").read_text()) == ref_weights
