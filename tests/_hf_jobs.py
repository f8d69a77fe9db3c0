"""Child training jobs for ``test_integrations_hf``: accelerate and transformers on CPU.

    python _hf_jobs.py accelerate|trainer OUT LOG KILL_AT RESUME DATA [WORKERS]

``DATA`` is ``map`` (a map dataset whose items are their own index, shuffled), ``stream`` (a
stream with ``state_dict()``, each rank reading its own part), or, for the Trainer only,
``passes`` / ``passes-ga2``: a 10-item stream in batches of 3 (4 batches a pass) that
``max_steps`` runs through more than twice, without and with gradient accumulation 2. Every
item carries an augmentation value drawn from python's ``random`` (the loader seeds it per
batch). Every training step appends (global step, epoch, ids, augmentation values) to
``LOG.rank<r>``, fsynced; ``FETCH_LOG`` (env) receives one line per item the dataset
produced. After the checkpoint of global step ``KILL_AT`` every rank SIGKILLs itself (-1:
never). ``RESUME=1`` resumes from ``OUT``'s checkpoint. At the end rank 0 writes the weights
to ``LOG.weights``.
Ranks come from torch's environment variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

N, BATCH, EPOCHS, SEED = 22, 4, 3, 1234
STREAM_N, STREAM_STEPS = 40, 9  # the stream: items per rank; the Trainer's max_steps
# ``passes``: items per rank, batch size, and (gradient accumulation -> the Trainer's max_steps)
PASSES_N, PASSES_BATCH, PASSES_STEPS = 10, 3, {1: 10, 2: 5}


def _fetched(i: int) -> None:
    log = os.environ.get("FETCH_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{i}\n")


class Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        _fetched(i)
        return {"ids": torch.tensor(i), "aug": torch.tensor(random.random())}


class Stream(torch.utils.data.IterableDataset):
    """Rank r of W reads r, r + W, ...: ``STREAM_N`` items; its state is its cursor."""

    def __init__(self, n: int = STREAM_N) -> None:
        self.n = n
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd["pos"]

    def __iter__(self):
        dist = torch.distributed
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        while self.pos < self.n:
            i = rank + world * self.pos
            self.pos += 1
            _fetched(i)
            yield {"ids": torch.tensor(i), "aug": torch.tensor(random.random())}
        self.pos = 0  # the next epoch reads from the start again


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def forward(self, ids: torch.Tensor, aug: torch.Tensor) -> dict[str, torch.Tensor]:
        x = torch.stack([ids.float() / N, aug.float()], 1)
        return {"loss": self.lin(x).pow(2).mean()}


def record(log: str, rank: int, step: int, epoch: int, batch: dict[str, Any]) -> None:
    rec = {"step": step, "epoch": epoch, "ids": batch["ids"].tolist()}
    rec["aug"] = batch["aug"].tolist()
    with open(f"{log}.rank{rank}", "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def save_weights(model: torch.nn.Module, log: str) -> None:
    with open(log + ".weights", "w") as f:
        json.dump([p.detach().flatten().tolist() for p in model.parameters()], f)


def run_accelerate(out: str, log: str, kill_at: int, resume: bool, data: str, workers: int):
    from accelerate import Accelerator

    from resumable_loader import DataLoader
    from resumable_loader.integrations.accelerate import prepare_data_loader

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    ds = Ids() if data == "map" else Stream()
    loader = DataLoader(
        ds,
        batch_size=BATCH,
        shuffle=data == "map",
        num_workers=workers,
        generator=torch.Generator().manual_seed(SEED),
    )
    loader = prepare_data_loader(acc, loader)
    start, step = 0, 0
    progress = os.path.join(out, "progress.json")
    if resume:
        acc.load_state(out)
        with open(progress) as f:
            start, step = json.load(f)
    for epoch in range(start, EPOCHS):
        loader.sampler.set_epoch(epoch) if data == "map" else None
        for batch in loader:
            record(log, acc.process_index, step, epoch, batch)
            loss = model(**batch)["loss"]
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            step += 1
            acc.save_state(out)
            if acc.is_main_process:
                # The user's own counters; the loader's epoch says which epoch comes next.
                with open(progress + ".tmp", "w") as f:
                    json.dump([loader.state_dict()["epoch"], step], f)
                os.replace(progress + ".tmp", progress)
            if step == kill_at:
                acc.wait_for_everyone()
                os.kill(os.getpid(), signal.SIGKILL)
    if acc.is_main_process:
        save_weights(acc.unwrap_model(model), log)
    loader.close()
    acc.end_training()


def run_trainer(
    out: str, log: str, kill_at: int, resume: bool, data: str, workers: int, stop: bool = False
):
    """``stop``: after the checkpoint of step ``kill_at``, stop training (``train`` returns)
    instead of SIGKILLing the process: for a run inside the test process."""
    from transformers import TrainerCallback, TrainingArguments

    from resumable_loader.integrations.transformers import ResumableTrainer

    class Kill(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            if state.global_step == kill_at:
                if stop:
                    control.should_training_stop = True
                    return control
                torch.distributed.barrier() if torch.distributed.is_initialized() else None
                os.kill(os.getpid(), signal.SIGKILL)
            return None

    class Logged(ResumableTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            epoch = int(self.state.epoch or 0) if data != "stream" else 0
            record(log, self.args.process_index, self.state.global_step, epoch, inputs)
            return super().training_step(model, inputs, num_items_in_batch)

    passes = data.startswith("passes")
    accumulation = 2 if data == "passes-ga2" else 1
    max_steps = {"map": -1, "stream": STREAM_STEPS}.get(data, PASSES_STEPS[accumulation])
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=PASSES_BATCH if passes else BATCH,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=EPOCHS,
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=2,
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        dataloader_num_workers=workers,
        seed=SEED,
        logging_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
        learning_rate=0.1,
    )
    ds = Ids() if data == "map" else Stream(PASSES_N if passes else STREAM_N)
    trainer = Logged(model=Net(), args=args, train_dataset=ds, callbacks=[Kill()])
    trainer.train(resume_from_checkpoint=True if resume else None)
    if args.process_index == 0:
        save_weights(trainer.model, log)


def main() -> None:
    which, out, log, kill_at, resume, data = sys.argv[1:7]
    workers = int(sys.argv[7]) if len(sys.argv) > 7 else 2
    run = run_accelerate if which == "accelerate" else run_trainer
    run(out, log, int(kill_at), resume == "1", data, workers)
    # The Trainer and accelerate start the process group and leave it up. Torn down by the
    # interpreter's exit instead, its gloo threads can be destroyed while joinable: the child
    # then aborts ("terminate called without an active exception", exit -6) after a finished
    # run (seen once in CI). As every job of ours does, end the group before exiting.
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
