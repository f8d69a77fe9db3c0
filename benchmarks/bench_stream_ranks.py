"""What equal batches on every rank cost a ``Stream`` job: the ranks' agreements per epoch, and
the time each ``all_reduce(MIN)`` takes on gloo (issue #33, docs/streams.md "Ranks and equal
batches").

    python benchmarks/bench_stream_ranks.py [--ranks 2 3] [--workers 2] [--step-ms 0 5]

Each setting starts its ranks as local processes (env://, gloo), and every rank iterates one
epoch of a Stream of 96 uneven shards (``tests/_stream_shards``: 2..6 samples each, 12
partitions) with batch 4 and ``--workers`` workers, spending ``--step-ms`` per batch (a
trainer's step: 0 = loading is the slower side). Reported per setting, from rank 0: batches,
agreements (collectives), and the median and total time inside the agreement's collective.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rank_main(spec: dict) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "tests"))
    import _stream_shards as F

    from resumable_loader import DataLoader, Stream
    from resumable_loader.loader import stream_ranks

    dist.init_process_group("gloo")
    times: list[float] = []
    call = stream_ranks.Agreement.__call__

    def timed(self: stream_ranks.Agreement, ready: int) -> int:
        t0 = time.perf_counter()
        out = call(self, ready)
        times.append(time.perf_counter() - t0)
        return out

    stream_ranks.Agreement.__call__ = timed  # type: ignore[method-assign]
    stream = Stream.from_shards(list(range(96)), F.read, partitions=12, shuffle_shards=False)
    loader = DataLoader(stream, batch_size=4, num_workers=spec["workers"])
    warnings.simplefilter("ignore", RuntimeWarning)  # the tail's warning, once per rank
    batches = 0
    for _ in loader:
        batches += 1
        if spec["step_ms"]:
            time.sleep(spec["step_ms"] / 1000)  # the trainer's step
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "batches": batches,
                    "agreements": len(times),
                    "median_us": statistics.median(times) * 1e6 if times else 0.0,
                    "total_ms": sum(times) * 1e3,
                }
            )
        )
    loader.close()
    dist.destroy_process_group()


def run(world: int, workers: int, step_ms: float) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    spec = json.dumps({"workers": workers, "step_ms": step_ms})
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank-spec", spec],
            env=dict(env, RANK=str(r), WORLD_SIZE=str(world)),
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p in procs:
        if p.returncode != 0:
            raise SystemExit(f"a rank failed ({p.returncode})")
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 5.0])
    p.add_argument("--rank-spec", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_spec:
        rank_main(json.loads(args.rank_spec))
        return
    print("ranks workers step_ms batches agreements median_us_per_all_reduce total_ms")
    for world in args.ranks:
        for step in args.step_ms:
            r = run(world, args.workers, step)
            print(
                f"{world:5d} {args.workers:7d} {step:7.1f} {r['batches']:7d} "
                f"{r['agreements']:10d} {r['median_us']:25.0f} {r['total_ms']:8.1f}"
            )


if __name__ == "__main__":
    main()
