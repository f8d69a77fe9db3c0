"""torchft replica groups that die and come back; every sample in exactly one committed step.

    python examples/torchft_ddp.py            # needs torchft (pip install torchft), CPU only

It starts a torchft lighthouse and three replica groups (one process each, gloo), running
torchft's train_ddp.py loop with our loader wrapped in ``ReplicaGroupLoader``. Group 1
SIGKILLs itself between ``backward()`` and ``should_commit()`` at step 5; it is restarted two
steps later and heals from a live group. Every process writes the sample ids it was dealt and
whether each step committed; at the end of the epoch the launcher takes, for each step, the
attempt that committed, and prints how many samples of the epoch are missing or repeated:

    epoch 0: 240 samples, 0 missing, 0 repeated

The gradients are averaged with ``manager.allreduce`` rather than torchft's
``DistributedDataParallel``, whose comm hook fails when a group dies inside the allreduce
(docs/torchft.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

N, BATCH, GROUPS = 240, 4, 3
KILL_GROUP, KILL_STEP, RESTART_STEP = 1, 5, 7


class Items(torch.utils.data.Dataset[int]):
    """Item ``i`` is ``i``: the batches name the samples they hold."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def group(gid: int, record: Path, kill: bool, gate: Path) -> None:
    """One replica group: train_ddp.py's loop with ReplicaGroupLoader."""
    import torch.distributed as dist
    from torch import nn, optim
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.http_transport import HTTPTransport

    from resumable_loader import DataLoader
    from resumable_loader.integrations.torchft import ReplicaGroupLoader

    out = record.open("a")

    def log(**fields: Any) -> None:
        out.write(json.dumps(fields) + "\n")
        out.flush()  # a SIGKILLed group must not lose what it already wrote

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    inner = optim.SGD(model.parameters(), lr=0.1)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=3)),
        min_replica_size=1,
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            inner.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"g{gid}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=10),
        use_async_quorum=False,  # the loader deals after the step's quorum
        checkpoint_transport=HTTPTransport(timeout=timedelta(seconds=10), num_chunks=0),
    )
    loader = DataLoader(
        Items(), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True
    )
    trainloader = ReplicaGroupLoader(loader, manager)
    optimizer = Optimizer(manager, inner)
    log(ev="ready")
    # The first groups up would otherwise form the first quorum alone and train a lineage of
    # their own (min_replicas=1): start together, as a job launcher does.
    while not gate.with_name("start").exists():
        time.sleep(0.01)

    for batch in trainloader:
        step = trainloader.last_step
        log(ev="deal", step=step.step, q=manager._quorum_id, real=step.real, ids=batch.tolist())
        optimizer.zero_grad()
        model(batch.float()[:, None].repeat(1, 4) * 0.01).pow(2).mean().backward()
        for work in [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]:
            work.wait()
        if kill and step.step == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)  # between backward and should_commit
        optimizer.step()
        log(
            ev="outcome",
            step=step.step,
            q=manager._quorum_id,
            committed=manager.current_step() == step.step + 1,
        )
        # Hold the live groups here until the restarted one is up, whatever its import time.
        while not kill and manager.current_step() == RESTART_STEP and not gate.exists():
            time.sleep(0.05)
    trainloader.close()
    manager.shutdown(wait=False)


def read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def launch(work: Path) -> None:
    from torchft._torchft import LighthouseServer

    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("*"):
        old.unlink()
    gate = work / "gate"
    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=500,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=1000,
    )
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse.address())

    def start(gid: int, incarnation: int, kill: bool = False) -> subprocess.Popen[bytes]:
        args = [
            sys.executable,
            __file__,
            "--group",
            str(gid),
            "--work",
            str(work),
            "--incarnation",
            str(incarnation),
        ]
        logfile = (work / f"g{gid}.{incarnation}.log").open("w")
        return subprocess.Popen(
            args + ["--kill"] * kill, env=env, stdout=logfile, stderr=subprocess.STDOUT
        )

    def wait_for(predicate: Any) -> None:
        while not predicate():
            time.sleep(0.1)

    procs = [start(gid, 0, kill=gid == KILL_GROUP) for gid in range(GROUPS)]
    wait_for(lambda: all(read(work / f"g{gid}.0.jsonl") for gid in range(GROUPS)))
    (work / "start").touch()
    procs[KILL_GROUP].wait()
    print(f"group {KILL_GROUP} killed at step {KILL_STEP}, before should_commit")
    wait_for(
        lambda: any(
            r["ev"] == "outcome" and r["step"] == RESTART_STEP - 1
            for r in read(work / "g0.0.jsonl")
        )
    )
    procs[KILL_GROUP] = start(KILL_GROUP, 1)
    wait_for(lambda: any(r["ev"] == "ready" for r in read(work / f"g{KILL_GROUP}.1.jsonl")))
    gate.touch()
    print(f"group {KILL_GROUP} restarted at step {RESTART_STEP}")
    for proc in procs:
        proc.wait()
    lighthouse.shutdown()

    deals: dict[tuple[int, int], list[int]] = defaultdict(list)
    committed: dict[int, int] = {}
    for path in work.glob("*.jsonl"):
        for r in read(path):
            if r["ev"] == "deal" and r["real"]:
                deals[(r["step"], r["q"])] += r["ids"]
            elif r["ev"] == "outcome" and r["committed"]:
                committed[r["step"]] = max(committed.get(r["step"], -1), r["q"])
    # A step counts once, in the attempt that committed last; a dead group's deal counts too.
    trained = Counter(i for step, q in committed.items() for i in deals[(step, q)])
    missing = N - len(trained)
    repeated = sum(n - 1 for n in trained.values())
    print(f"epoch 0: {N} samples, {missing} missing, {repeated} repeated")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/torchft_ddp_example"))
    parser.add_argument("--group", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--incarnation", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--kill", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.group is None:
        launch(args.work)
    else:
        group(
            args.group,
            args.work / f"g{args.group}.{args.incarnation}.jsonl",
            args.kill,
            args.work / "gate",
        )
