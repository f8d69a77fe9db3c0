"""Resuming a transformers Trainer 10,000 batches into an epoch of a stream: time to the first
optimizer step, and batches fetched to get there.

Two trainers over the same stream (8 items per batch, each item ~``--item-us`` of CPU work
plus a 16-float tensor; ``dataloader_num_workers=0``, so every fetch is counted in this
process):

- trainer:   ``transformers.Trainer`` with its own loader. On ``resume_from_checkpoint`` it
             calls accelerate's ``skip_first_batches``, which reads and drops every batch
             already trained in the epoch.
- resumable: ``resumable_loader.integrations.transformers.ResumableTrainer``: the loader
             loads its state from the checkpoint and fetches nothing to resume.

The checkpoint is made by training one step, then moving the step counter (and, for
``resumable``, the loader's position, taken by iterating the loader that many batches) to
``--batches``: training 10,000 real steps first would take minutes and measure nothing more,
since a resume reads only the step counter and the loader state. Timed: from the call of
``train(resume_from_checkpoint=...)`` to the first ``on_optimizer_step`` callback, each trainer
``--rounds`` times, alternated.

Run: python3 benchmarks/bench_trainer_resume.py [--quick] [--batches N] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import _common as C
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from resumable_loader.integrations import _common as integ
from resumable_loader.integrations.transformers import STATE_FILE, ResumableTrainer

BATCH = 8
FETCHED = [0]  # items the stream produced (num_workers=0: all in this process)


class Stream(torch.utils.data.IterableDataset):
    """An endless stream with its position as state; every item costs ``item_s`` of CPU."""

    def __init__(self, item_s: float) -> None:
        self.pos = 0
        self.item_s = item_s

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd["pos"]

    def __iter__(self):
        while True:
            i = self.pos
            self.pos += 1
            FETCHED[0] += 1
            C.spin(self.item_s)
            g = torch.Generator().manual_seed(i)
            yield {"x": torch.randn(16, generator=g), "y": torch.tensor(float(i % 7))}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.lin(x).squeeze(1) - y).pow(2).mean()}


class FirstStep(TrainerCallback):
    """Records when the first optimizer step of a train() call happened."""

    def __init__(self) -> None:
        self.at: float | None = None

    def on_optimizer_step(self, args, state, control, **kw):
        if self.at is None:
            self.at = time.perf_counter()


def make(kind: str, out: str, max_steps: int, item_s: float, cb: TrainerCallback) -> Trainer:
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=10**9,
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        logging_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
        seed=1,
    )
    cls = ResumableTrainer if kind == "resumable" else Trainer
    return cls(model=Net(), args=args, train_dataset=Stream(item_s), callbacks=[cb])


def checkpoint(kind: str, root: str, batches: int, item_s: float) -> str:
    """A checkpoint folder that says ``batches`` steps (one batch each) were trained."""
    out = os.path.join(root, kind)
    trainer = make(kind, out, 1, item_s, TrainerCallback())
    trainer.train()
    trainer._save_checkpoint(trainer.model, None)  # checkpoint-1
    src, dst = os.path.join(out, "checkpoint-1"), os.path.join(out, f"checkpoint-{batches}")
    os.rename(src, dst)
    state_path = os.path.join(dst, "trainer_state.json")
    with open(state_path) as f:
        state = json.load(f)
    state["global_step"] = batches
    state["max_steps"] = batches + 1
    with open(state_path, "w") as f:
        json.dump(state, f)
    if kind == "resumable":
        # The loader's position after `batches` batches, as a trained run would have saved it.
        loader = trainer.get_train_dataloader()
        it = iter(loader)
        for _ in range(batches):
            next(it)
        integ.write_state(dst, STATE_FILE, integ.global_state(loader))
        del it
        loader.close()
    return dst


def resume(kind: str, ckpt: str, batches: int, item_s: float) -> tuple[float, int]:
    """Seconds from train(resume_from_checkpoint) to the first optimizer step; batches fetched."""
    cb = FirstStep()
    out = os.path.dirname(ckpt)
    trainer = make(kind, out, batches + 1, item_s, cb)
    FETCHED[0] = 0
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=ckpt)
    assert cb.at is not None and trainer.state.global_step == batches + 1
    # The trained step's own batch is fetched by both; count only what came before it.
    return cb.at - t0, FETCHED[0] // BATCH - 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--item-us", type=float, default=20.0)
    p.add_argument("--quick", action="store_true", help="1,000 batches, 2 rounds")
    a = p.parse_args()
    if a.quick:
        a.batches, a.rounds = 1_000, 2
    hf_logging.set_verbosity_error()
    item_s = a.item_us * 1e-6
    print(C.env_line())
    print(f"resume {a.batches} batches of {BATCH} into a stream; {a.item_us} us per item")
    root = tempfile.mkdtemp(prefix="bench_trainer_resume.")
    try:
        ckpts = {k: checkpoint(k, root, a.batches, item_s) for k in ("trainer", "resumable")}
        times: dict[str, list[float]] = {"trainer": [], "resumable": []}
        fetched: dict[str, set[int]] = {"trainer": set(), "resumable": set()}
        order = ["trainer", "resumable"]
        for r in range(a.rounds):
            for kind in order if r % 2 == 0 else order[::-1]:
                s, n = resume(kind, ckpts[kind], a.batches, item_s)
                times[kind].append(s)
                fetched[kind].add(n)
    finally:
        shutil.rmtree(root)  # the folder this run created
    rows = [
        [kind, C.median(times[kind]), ",".join(map(str, sorted(fetched[kind]))), a.rounds]
        for kind in ("trainer", "resumable")
    ]
    C.print_table(["resume with", "s to 1st step (median)", "batches fetched", "rounds"], rows)
    ratio = C.median(times["trainer"]) / C.median(times["resumable"])
    print(f"ResumableTrainer reaches its first step {ratio:.1f}x sooner")
    C.emit_summary(
        "trainer_resume",
        {
            "batches": a.batches,
            "trainer_s": C.median(times["trainer"]),
            "resumable_s": C.median(times["resumable"]),
            "trainer_fetched": sorted(fetched["trainer"]),
            "resumable_fetched": sorted(fetched["resumable"]),
        },
    )
    return 0 if fetched["resumable"] == {0} else 1


if __name__ == "__main__":
    sys.exit(main())
