"""One torchft replica group's training loop, a subprocess of tests/integrations/test_torchft.py.

It owns nothing of the package: it is the harness's victim and witness. A group process hosts
its own TCPStore, builds a torchft ``Manager`` (synchronous quorum, gloo), trains a tiny
linear model on a dataset whose item ``i`` is ``i``, and writes one JSON line per event to
``$RECORD``: ``ready`` once the manager is built, ``deal`` (the step's sample ids, written
before the forward, so a group that dies mid-step still says what it was dealt) and
``outcome`` (whether the step committed), and ``done`` with the final weights saved beside
the record. ``KILL_AT=<step>:<phase>`` makes it SIGKILL itself, deterministically, at
``top`` (before ``next()``), ``before_backward`` (after the forward: the peers' gradient
allreduce then runs against a dead group) or ``after_backward`` (before ``should_commit``).
``START_FILE`` holds the first groups until all are up; ``GATE_STEP``/``GATE_FILE`` hold a
live group after that step until the harness has brought a restarted group up, so the
restart lands mid-epoch whatever the import time.

``GRADS=manual`` (the default) averages the gradients with ``manager.allreduce`` after
``backward()``; ``GRADS=ddp`` uses torchft's ``DistributedDataParallel`` instead, whose comm
hook asserts when a peer dies inside the allreduce (docs/torchft.md).
"""

from __future__ import annotations

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
N = int(os.environ.get("N", "96"))
BATCH = int(os.environ.get("BATCH", "4"))
KILL_AT = os.environ.get("KILL_AT", "")
GATE_STEP = int(os.environ.get("GATE_STEP", "-1"))
GATE_FILE = os.environ.get("GATE_FILE", "")
START_FILE = os.environ.get("START_FILE", "")
GRADS = os.environ.get("GRADS", "manual")
RECORD = os.environ["RECORD"]

_record_file = open(RECORD, "a")  # noqa: SIM115 - kept open for the whole process


def record(**fields: Any) -> None:
    # Flushed per line: a SIGKILL must not lose what the process already said.
    _record_file.write(json.dumps(fields) + "\n")
    _record_file.flush()


def kill_if(step: int, phase: str) -> None:
    if f"{step}:{phase}" == KILL_AT:
        record(ev="kill", step=step, phase=phase)
        os.kill(os.getpid(), signal.SIGKILL)


class Items(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def main() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)

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
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        use_async_quorum=False,
        checkpoint_transport=HTTPTransport(timeout=timedelta(seconds=10), num_chunks=0),
    )
    loader = ReplicaGroupLoader(
        DataLoader(
            Items(),
            batch_size=BATCH,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
            generator=torch.Generator().manual_seed(0),
        ),
        manager,
    )
    net: nn.Module = DistributedDataParallel(manager, model) if GRADS == "ddp" else model
    inner = optim.SGD(model.parameters(), lr=0.1)
    opt = Optimizer(manager, inner)
    record(ev="ready", pid=os.getpid())
    # Groups that reach the first quorum before the others would form it alone and train a
    # lineage of their own (min_replicas=1): the harness starts the first ones together.
    while START_FILE and not os.path.exists(START_FILE):
        time.sleep(0.01)

    kill_if(manager.current_step(), "top")
    for batch in loader:
        info = loader.last_step
        record(
            ev="deal",
            g=GID,
            step=info.step,
            q=manager._quorum_id,  # test-only read: names the attempt
            n=info.participants,
            r=info.rank,
            real=info.real,
            ids=batch.tolist(),
        )
        opt.zero_grad()
        loss = net(batch.float()[:, None].repeat(1, 4) * 0.01).pow(2).mean()
        kill_if(info.step, "before_backward")
        try:
            loss.backward()
        except Exception as e:  # torchft DDP's comm hook asserts when a peer dies mid-allreduce
            record(ev="backward_error", step=info.step, err=repr(e)[:300])
            manager.report_error(e)
        if GRADS != "ddp":
            # Failures are reported to the manager by allreduce itself; should_commit says no.
            works = [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]
            for work in works:
                work.wait()
        kill_if(info.step, "after_backward")
        opt.step()
        record(
            ev="outcome",
            step=info.step,
            q=manager._quorum_id,
            committed=manager.current_step() == info.step + 1,
        )
        kill_if(manager.current_step(), "top")
        if GATE_FILE and manager.current_step() == GATE_STEP:
            while not os.path.exists(GATE_FILE):
                time.sleep(0.05)
    torch.save(model.state_dict(), RECORD + ".pt")
    record(ev="done", step=manager.current_step())
    loader.close()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
    sys.exit(0)
