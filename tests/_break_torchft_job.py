"""One torchft replica group for tests/behaviour/test_break_torchft.py (an adversarial harness).

docs/torchft.md's loop as a user copies it (``while True: for batch in trainloader``, a
``Manager`` with the synchronous quorum, gradients averaged with ``manager.allreduce``), over
a dataset whose item ``i`` is ``(i, a value drawn from the sample's RNG)``, with
``seed_per_sample=True``. One JSON line per event goes to ``$RECORD``: ``ready``; ``deal``
(the epoch, step, quorum id, ids and values dealt, written before the forward); ``outcome``;
``done``. Knobs (environment):

* ``KILL_AT=<step>:top|after_backward``: SIGKILL at that point of that step.
* ``FAIL_COMMIT_AT=<step>``: report an error to the manager after the allreduce, so this
  group alone answers ``should_commit() == False`` (its peers commit the step).
* ``KILL_SERVING=1``: SIGKILL while serving a heal (the registered state is being sent to a
  rejoining group), after step 0.
* ``GEN=same|none``: every group builds its loader on ``Generator().manual_seed(0)``, or on
  no generator at all with a per-process global seed (docs/torchft.md: ``init_sync`` carries
  the seeds).
* ``EPOCHS``, ``N``, ``BATCH``, ``WORKERS``; ``START_FILE``, ``GATE_STEP``/``GATE_FILE`` as
  in tests/_torchft_job.py.
* ``GROUP_RANK``, ``GROUP_WS``, ``STORE_PORT``: one process of a group of ``GROUP_WS``
  (its rank 0 hosts the group's store on ``STORE_PORT``).
* ``SAVE_AT=<step>`` with ``CKPT=<path>``: after the step that brings the manager to
  ``SAVE_AT`` commits, save the documented whole-job checkpoint and stop;
  ``RESUME_FROM=<path>``: load it (manager first, then the loader) before the loop.
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
from torchft import Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.http_transport import HTTPTransport

from resumable_loader import DataLoader
from resumable_loader.integrations.torchft import ReplicaGroupLoader

GID = int(os.environ["REPLICA_GROUP_ID"])
INC = int(os.environ.get("INCARNATION", "0"))
N = int(os.environ.get("N", "48"))
BATCH = int(os.environ.get("BATCH", "3"))
EPOCHS = int(os.environ.get("EPOCHS", "1"))
WORKERS = int(os.environ.get("WORKERS", "2"))
KILL_AT = os.environ.get("KILL_AT", "")
FAIL_COMMIT_AT = int(os.environ.get("FAIL_COMMIT_AT", "-1"))
KILL_SERVING = os.environ.get("KILL_SERVING", "") == "1"
GEN = os.environ.get("GEN", "same")
GATE_STEP = int(os.environ.get("GATE_STEP", "-1"))
GATE_FILE = os.environ.get("GATE_FILE", "")
START_FILE = os.environ.get("START_FILE", "")
SAVE_AT = int(os.environ.get("SAVE_AT", "-1"))
CKPT = os.environ.get("CKPT", "")
RESUME_FROM = os.environ.get("RESUME_FROM", "")
RECORD = os.environ["RECORD"]
GROUP_RANK = int(os.environ.get("GROUP_RANK", "0"))
GROUP_WS = int(os.environ.get("GROUP_WS", "1"))
STORE_PORT = int(os.environ.get("STORE_PORT", "0"))

_record_file = open(RECORD, "a")  # noqa: SIM115 - kept open for the whole process


def record(**fields: Any) -> None:
    # Flushed per line: a SIGKILL must not lose what the process already said.
    _record_file.write(json.dumps(fields) + "\n")
    _record_file.flush()


def kill_if(step: int, phase: str) -> None:
    if f"{step}:{phase}" == KILL_AT:
        record(ev="kill", step=step, phase=phase)
        os.kill(os.getpid(), signal.SIGKILL)


class Items(torch.utils.data.Dataset[Any]):
    """Item ``i`` is ``(i, a value from the sample's RNG)``."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        return i, torch.rand(())


def main() -> None:
    torch.manual_seed(GID * 100 + INC)  # groups differ unless the loader's seeds are shared
    model = nn.Linear(4, 2)
    # The group's store lives with its rank 0 (on STORE_PORT when the group has two ranks).
    store_port = STORE_PORT
    if GROUP_RANK == 0:
        store = dist.TCPStore("localhost", STORE_PORT, is_master=True, wait_for_workers=False)
        store_port = store.port
    inner = optim.SGD(model.parameters(), lr=0.1)

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
        store_port=store_port,
        rank=GROUP_RANK,
        world_size=GROUP_WS,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        use_async_quorum=False,
        checkpoint_transport=HTTPTransport(timeout=timedelta(seconds=10), num_chunks=0),
    )
    if KILL_SERVING:

        def serving() -> dict[str, Any]:
            # Called only when this group sends its state to a healer (torchft's
            # _manager_state_dict): die mid-send, after init_sync's step-0 heal.
            if manager.current_step() > 0:
                record(ev="kill", step=manager.current_step(), phase="serving")
                os.kill(os.getpid(), signal.SIGKILL)
            return {}

        manager.register_state_dict_fn("zz_serving", lambda sd: None, serving)
    gen = {"generator": torch.Generator().manual_seed(0)} if GEN == "same" else {}
    trainloader = ReplicaGroupLoader(
        DataLoader(
            Items(),
            batch_size=BATCH,
            shuffle=True,
            num_workers=WORKERS,
            persistent_workers=WORKERS > 0,
            seed_per_sample=True,
            **gen,
        ),
        manager,
    )
    opt = Optimizer(manager, inner)
    if RESUME_FROM:
        ckpt = torch.load(RESUME_FROM, weights_only=False)
        manager.load_state_dict(ckpt["manager"])
        trainloader.load_state_dict(ckpt["loader"])
        model.load_state_dict(ckpt["model"])
        inner.load_state_dict(ckpt["optim"])
    record(ev="ready", pid=os.getpid())
    while START_FILE and not os.path.exists(START_FILE):
        time.sleep(0.01)

    kill_if(manager.current_step(), "top")
    while True:
        for ids, vals in trainloader:
            info = trainloader.last_step
            record(
                ev="deal",
                g=GID,
                epoch=trainloader.epoch,
                step=info.step,
                q=manager._quorum_id,  # test-only read: names the attempt
                real=info.real,
                ids=ids.tolist(),
                vals=vals.tolist(),
            )
            opt.zero_grad()
            loss = model(ids.float()[:, None].repeat(1, 4) * 0.01).pow(2).mean()
            loss.backward()
            works = [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]
            for work in works:
                work.wait()
            if info.step == FAIL_COMMIT_AT:
                manager.report_error(RuntimeError("injected: this group alone fails the step"))
            kill_if(info.step, "after_backward")
            opt.step()
            record(
                ev="outcome",
                step=info.step,
                q=manager._quorum_id,
                committed=manager.current_step() == info.step + 1,
            )
            if SAVE_AT >= 0 and manager.current_step() == SAVE_AT:
                torch.save(
                    {
                        "manager": manager.state_dict(),
                        "loader": trainloader.state_dict(),
                        "model": model.state_dict(),
                        "optim": inner.state_dict(),
                    },
                    CKPT,
                )
                record(ev="saved", step=SAVE_AT)
                trainloader.close()
                manager.shutdown(wait=False)
                return
            kill_if(manager.current_step(), "top")
            if GATE_FILE and manager.current_step() == GATE_STEP:
                while not os.path.exists(GATE_FILE):
                    time.sleep(0.05)
        # StopIteration: the committed epoch `trainloader.epoch` is complete.
        if trainloader.epoch >= EPOCHS - 1:
            break
    torch.save(model.state_dict(), RECORD + ".pt")
    record(ev="done", step=manager.current_step(), epoch=trainloader.epoch)
    trainloader.close()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
    sys.exit(0)
