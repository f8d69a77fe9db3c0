"""One torchft replica group process's training loop, a subprocess of
tests/integrations/test_torchft.py and benchmarks/bench_torchft_exactly_once.py.

It owns nothing of the package: it is the harness's victim and witness. Group rank 0 hosts
the group's TCPStore (rank 1 of a two-process group finds its port in ``$STORE_FILE``),
builds a torchft ``Manager`` (gloo), trains a tiny linear model on a dataset whose item ``i``
is ``i``, and writes one JSON line per event to ``$RECORD``: ``ready`` once the manager is
built, ``deal`` (the step's sample ids and this process's share), ``outcome`` (whether the
step committed), ``send`` (this group sends its state to a healing one), and ``done`` with
the final weights saved beside the record. ``KILL_AT=<step>:<phase>`` makes it SIGKILL its
whole process group (every process of the replica group), deterministically, at ``top``
(before ``next()``), ``before_backward`` (after the forward: the peers' gradient allreduce
then runs against a dead group), ``after_backward`` (before ``should_commit``) or ``in_send``
(while sending its state to a healing group). ``START_FILE`` holds the first groups until
all are up; ``GATE_STEP``/``GATE_FILE`` hold a live group after that step until the harness
has brought a restarted group up, so the restart lands mid-epoch whatever the import time.

``LOADER=ours`` (the default): our loader in ``ReplicaGroupLoader``, the synchronous quorum;
``deal`` is written before the forward, so a group that dies mid-step still says what it was
dealt. ``LOADER=baseline``: torchft's ``DistributedSampler`` and torchdata's
``StatefulDataLoader`` as torchft's train_ddp.py uses them (the default async quorum, the
loader's state not registered; ``BASELINE_STATE=1`` registers it with the manager), stopped
at ``STOP_STEP``; ``deal`` is written after the gradient allreduce, when the step's quorum
is known, with ``real`` = ``is_participating()`` (a group healing under the async quorum
has its gradient zeroed).

``SEED_PER_SAMPLE=1``: items are ``(i, torch.rand(2))`` under ``seed_per_sample=True`` and
``deal`` carries the values. ``CKPT=<path>`` saves model, optimizer, manager and loader
state after every committed step; ``RESUME=<path>`` starts from such a file (a whole-job
restart). ``GRADS=manual`` (the default) averages the gradients with ``manager.allreduce``
after ``backward()``; ``GRADS=ddp`` uses torchft's ``DistributedDataParallel`` instead, whose
comm hook asserts when a peer dies inside the allreduce (docs/torchft.md).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn, optim
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.http_transport import HTTPTransport

from resumable_loader import DataLoader
from resumable_loader.integrations.torchft import ReplicaGroupLoader

GID = int(os.environ["REPLICA_GROUP_ID"])
GROUPS = int(os.environ.get("NUM_REPLICA_GROUPS", "3"))
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
N = int(os.environ.get("N", "96"))
BATCH = int(os.environ.get("BATCH", "4"))
KILL_AT = os.environ.get("KILL_AT", "")
GATE_STEP = int(os.environ.get("GATE_STEP", "-1"))
GATE_FILE = os.environ.get("GATE_FILE", "")
START_FILE = os.environ.get("START_FILE", "")
STORE_FILE = os.environ.get("STORE_FILE", "")
GRADS = os.environ.get("GRADS", "manual")
LOADER = os.environ.get("LOADER", "ours")
BASELINE_STATE = os.environ.get("BASELINE_STATE") == "1"
STOP_STEP = int(os.environ.get("STOP_STEP", "-1"))
SEED_PER_SAMPLE = os.environ.get("SEED_PER_SAMPLE") == "1"
CKPT = os.environ.get("CKPT", "")
RESUME = os.environ.get("RESUME", "")
RECORD = os.environ["RECORD"]

_record_file = open(RECORD, "a")  # noqa: SIM115 - kept open for the whole process


def record(**fields: Any) -> None:
    # Flushed per line: a SIGKILL must not lose what the process already said.
    _record_file.write(json.dumps(fields) + "\n")
    _record_file.flush()


def kill_if(step: int, phase: str) -> None:
    if f"{step}:{phase}" == KILL_AT:
        record(ev="kill", step=step, phase=phase)
        # The whole replica group dies, as when its node goes: the harness starts a group's
        # processes in one process group.
        os.killpg(os.getpgrp(), signal.SIGKILL)


class Items(torch.utils.data.Dataset[Any]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        # With seed_per_sample the random value is a function of (epoch seed, i) alone.
        return (i, torch.rand(2)) if SEED_PER_SAMPLE else i


class KillOnSend(HTTPTransport[Any]):
    """The HTTP transport, recording (and, on ``KILL_AT=<step>:in_send``, dying in) a send."""

    def send_checkpoint(self, dst_ranks: list[int], step: int, *args: Any, **kwargs: Any) -> None:
        record(ev="send", step=step, to=list(dst_ranks))
        kill_if(step, "in_send")
        super().send_checkpoint(dst_ranks, step, *args, **kwargs)


def group_store() -> dist.TCPStore:
    """Rank 0 hosts the group's store on a free port and writes it down for the other rank."""
    if RANK == 0:
        store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        if STORE_FILE:
            with open(STORE_FILE + ".tmp", "w") as f:
                f.write(str(store.port))
            os.replace(STORE_FILE + ".tmp", STORE_FILE)
        return store
    while not os.path.exists(STORE_FILE):
        time.sleep(0.01)
    with open(STORE_FILE) as f:
        port = int(f.read())
    return dist.TCPStore("localhost", port, is_master=False)


def batch_ids(batch: Any) -> tuple[list[int], list[Any] | None]:
    if SEED_PER_SAMPLE:
        return batch[0].tolist(), batch[1].tolist()
    return batch.tolist(), None


def main() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    inner = optim.SGD(model.parameters(), lr=0.1)
    store = group_store()

    def load_state(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def save_state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=3)),
        min_replica_size=1,
        load_state_dict=load_state,
        state_dict=save_state,
        replica_id=f"g{GID}",
        store_addr="localhost",
        store_port=store.port,
        rank=RANK,
        world_size=WORLD,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        # The baseline runs what users run: torchft's default, the async quorum.
        use_async_quorum=LOADER == "baseline",
        checkpoint_transport=KillOnSend(timeout=timedelta(seconds=10), num_chunks=0),
    )
    net: nn.Module = DistributedDataParallel(manager, model) if GRADS == "ddp" else model
    opt = Optimizer(manager, inner)
    if LOADER == "baseline":
        baseline(manager, net, model, opt)
    else:
        ours(manager, net, model, opt, inner)
    torch.save(model.state_dict(), RECORD + ".pt")
    record(ev="done", step=manager.current_step())
    manager.shutdown(wait=False)


def wait_to_start() -> None:
    record(ev="ready", pid=os.getpid())
    # Groups that reach the first quorum before the others would form it alone and train a
    # lineage of their own (min_replicas=1): the harness starts the first ones together.
    while START_FILE and not os.path.exists(START_FILE):
        time.sleep(0.01)


def train_step(manager: Any, net: nn.Module, model: nn.Module, batch: Any, step: int) -> None:
    """Forward, backward and the gradient average; the kill points between them."""
    x = batch[0] if SEED_PER_SAMPLE else batch
    loss = net(x.float()[:, None].repeat(1, 4) * 0.01).pow(2).mean()
    kill_if(step, "before_backward")
    try:
        loss.backward()
    except Exception as e:  # torchft DDP's comm hook asserts when a peer dies mid-allreduce
        record(ev="backward_error", step=step, err=repr(e)[:300])
        manager.report_error(e)
    if GRADS != "ddp":
        # Failures are reported to the manager by allreduce itself; should_commit says no.
        works = [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]
        for work in works:
            work.wait()


def after_step(manager: Any, step: int) -> None:
    record(
        ev="outcome",
        step=step,
        q=manager._quorum_id,
        committed=manager.current_step() == step + 1,
    )
    kill_if(manager.current_step(), "top")
    if GATE_FILE and manager.current_step() == GATE_STEP:
        while not os.path.exists(GATE_FILE):
            time.sleep(0.05)


def ours(manager: Any, net: nn.Module, model: nn.Module, opt: Any, inner: Any) -> None:
    loader = ReplicaGroupLoader(
        DataLoader(
            Items(),
            batch_size=BATCH,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
            seed_per_sample=SEED_PER_SAMPLE,
            generator=torch.Generator().manual_seed(0),
        ),
        manager,
    )
    if RESUME:
        # A whole-job restart: the manager's step first, so that the loader's state matches it.
        saved = torch.load(RESUME, weights_only=False)
        manager.load_state_dict(saved["manager"])
        model.load_state_dict(saved["model"])
        inner.load_state_dict(saved["optim"])
        loader.load_state_dict(saved["loader"])
    wait_to_start()
    kill_if(manager.current_step(), "top")
    for batch in loader:
        info = loader.last_step
        ids, values = batch_ids(batch)
        record(
            ev="deal",
            g=GID,
            rank=RANK,
            step=info.step,
            q=manager._quorum_id,  # test-only read: names the attempt
            n=info.participants,
            r=info.rank,
            share=info.share,
            real=info.real,
            ids=ids,
            values=values,
        )
        opt.zero_grad()
        train_step(manager, net, model, batch, info.step)
        kill_if(info.step, "after_backward")
        opt.step()
        if CKPT and manager.current_step() == info.step + 1:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optim": inner.state_dict(),
                    "manager": manager.state_dict(),
                    "loader": loader.state_dict(),
                },
                CKPT + ".tmp",
            )
            os.replace(CKPT + ".tmp", CKPT)
        after_step(manager, info.step)
    loader.close()


def baseline(manager: Any, net: nn.Module, model: nn.Module, opt: Any) -> None:
    """torchft's train_ddp.py data path: its sampler shards by replica group, torchdata's
    loader reads the shard; the loop runs until STOP_STEP as train_ddp.py's does."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchft.data import DistributedSampler

    sampler = DistributedSampler(
        Items(),
        replica_rank=GID,
        num_replica_groups=GROUPS,
        group_rank=RANK,
        num_replicas=WORLD,
        shuffle=True,
        seed=0,
    )
    loader = StatefulDataLoader(Items(), batch_size=BATCH, sampler=sampler, num_workers=2)
    if BASELINE_STATE:
        # torchft#309's suggestion: the loader's state travels with the heal.
        manager.register_state_dict_fn("dataloader", loader.load_state_dict, loader.state_dict)

    def batches() -> Any:
        while True:  # train_ddp.py's `while True: for batch in loader`
            yield from loader

    # The group joins its first quorum at zero_grad(), after the loader's first batch: only
    # then is it as ready as ours at `ready` (whose next() joins the quorum before its workers
    # start), so that the gate holds the live groups until a restarted group really joins.
    stream = batches()
    first = next(stream)
    wait_to_start()
    kill_if(manager.current_step(), "top")
    if manager.current_step() < STOP_STEP:
        for batch in itertools.chain([first], stream):
            opt.zero_grad()  # the step's quorum starts here, asynchronously
            train_step(manager, net, model, batch, manager.current_step())
            # The quorum is known now (the allreduce waited for it), and with it the step a
            # healing group jumped to and whether this group's gradient counts.
            step = manager.current_step()
            ids, values = batch_ids(batch)
            record(
                ev="deal",
                g=GID,
                rank=RANK,
                step=step,
                q=manager._quorum_id,
                share=GID * WORLD + RANK,
                real=manager.is_participating(),
                ids=ids,
                values=values,
            )
            kill_if(step, "after_backward")
            opt.step()
            after_step(manager, step)
            if manager.current_step() >= STOP_STEP:
                break


if __name__ == "__main__":
    main()
    sys.exit(0)
