"""What a ``Mixture`` costs: per sample, to start an epoch, and to save its state.

    python benchmarks/bench_mixture.py [--rounds 5] [--items 200000] [--quick]

Three trivial sources (``range`` objects: an item costs nothing, so the plan's overhead shows)
weighted 0.6 / 0.3 / 0.1, read in the main process with no loader:

* *Mixture*: ``mixture[i]`` for consecutive positions (each a stratified interleave step and
  a Feistel permutation of the source's current pass);
* *Concat+WRS*: ``ConcatDataset`` indexed by torch's ``WeightedRandomSampler`` (per-item
  weights ``w / len(source)``), the usual way to mix sources with torch alone. Its draws are
  i.i.d. with replacement: no stratification, items repeat within a pass, and its state would
  be the drawn indices (or a generator state, with no way to change the weights).

Reported, in that order:

1. time per sample, median of alternating rounds, the sampler's draw of the epoch left out;
   and the time from nothing to the first sample of an epoch (building the plan, or the
   per-item weights and the epoch's draw); at ``--items`` samples and at 10^7 (sources of 6,
   3 and 1 million items);
2. the same at ``--items`` samples through our ``DataLoader`` (batch 64, no workers: the cost
   a worker pays), the sampler's draw included;
3. the Mixture's ``state_dict()`` at 10^7 samples: its time, its size as json and as
   ``dump_state`` bytes, and ``load_state_dict`` time, with one segment of weights and with
   100.
"""

from __future__ import annotations

import json
import time

import torch
from _common import alternate, base_parser, env_line, median, parse, print_table
from torch.utils.data import ConcatDataset, WeightedRandomSampler

from resumable_loader import Mixture, dump_state

WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}
SHARE = {"web": 6, "code": 3, "math": 1}


def sources(total: int) -> dict[str, range]:
    return {n: range(total * s // 10) for n, s in SHARE.items()}


def concat_wrs(total: int, items: int, seed: int) -> tuple[ConcatDataset, WeightedRandomSampler]:
    srcs = sources(total)
    names = list(srcs)
    per_item = torch.cat(
        [torch.full((len(srcs[n]),), WEIGHTS[n] / len(srcs[n]), dtype=torch.double) for n in names]
    )
    g = torch.Generator().manual_seed(seed)
    return ConcatDataset([srcs[n] for n in names]), WeightedRandomSampler(
        per_item, items, replacement=True, generator=g
    )


def per_sample(total: int, items: int) -> dict[str, object]:
    def mixture() -> dict[str, float]:
        mix = Mixture(sources(total), WEIGHTS, seed=1)
        t0 = time.perf_counter()
        for i in range(items):
            mix[i]
        return {"us": (time.perf_counter() - t0) / items * 1e6}

    def concat() -> dict[str, float]:
        ds, sampler = concat_wrs(total, items, 1)
        # Drawn before the clock starts, as a DataLoader draws the epoch at iter(): what is
        # left per sample is ConcatDataset's bisect (the draw is the "first sample" column).
        drawn = list(sampler)
        t0 = time.perf_counter()
        for i in drawn:
            ds[i]
        return {"us": (time.perf_counter() - t0) / items * 1e6}

    return {"Mixture": mixture, "Concat+WRS": concat}


def through_loader(items: int, batch_size: int) -> dict[str, object]:
    """An epoch of ``items`` samples through our DataLoader (no workers), per sample."""
    from resumable_loader import DataLoader

    def mixture() -> dict[str, float]:
        mix = Mixture(sources(items), WEIGHTS, seed=1)
        t0 = time.perf_counter()
        for _ in DataLoader(mix, batch_size=batch_size):
            pass
        return {"us": (time.perf_counter() - t0) / items * 1e6}

    def concat() -> dict[str, float]:
        ds, sampler = concat_wrs(items, items, 1)
        t0 = time.perf_counter()  # the sampler's draw is part of the epoch here
        for _ in DataLoader(ds, batch_size=batch_size, sampler=sampler):
            pass
        return {"us": (time.perf_counter() - t0) / items * 1e6}

    return {"Mixture": mixture, "Concat+WRS": concat}


def first_sample(total: int) -> tuple[float, float]:
    """Seconds from nothing to the first sample of an epoch of ``total`` samples."""
    t0 = time.perf_counter()
    mix = Mixture(sources(total), WEIGHTS, seed=1)
    mix[0]
    t_mix = time.perf_counter() - t0
    t0 = time.perf_counter()
    ds, sampler = concat_wrs(total, total, 1)
    ds[next(iter(sampler))]
    return t_mix, time.perf_counter() - t0


def state_figures(total: int, segments: int, reps: int) -> list[object]:
    mix = Mixture(sources(total), WEIGHTS, seed=1)
    for j in range(1, segments):
        w = dict(WEIGHTS, math=0.1 + 0.01 * j)
        mix.set_weights(w, j * total // segments)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sd = mix.state_dict()
        times.append(time.perf_counter() - t0)
    loads = []
    for _ in range(max(1, reps // 10)):
        fresh = Mixture(sources(total), WEIGHTS, seed=0)
        t0 = time.perf_counter()
        fresh.load_state_dict(sd, resume_at=total)
        loads.append(time.perf_counter() - t0)
    return [
        f"{total:.0e} samples, {segments} segment(s)",
        median(times) * 1e6,
        len(json.dumps(sd)),
        len(dump_state(sd)),
        median(loads) * 1e3,
    ]


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], start_method=False)
    p.add_argument("--items", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=5)
    args = parse(p)
    if args.quick:
        args.items, args.rounds = 20_000, 2
    print(
        "command: python benchmarks/bench_mixture.py "
        + " ".join(f"--{k} {v}" for k, v in (("items", args.items), ("rounds", args.rounds)))
        + (" --quick" if args.quick else "")
    )
    print(env_line())
    rows = []
    for total in (args.items, 10**7):
        runs = alternate(per_sample(total, args.items), args.rounds)
        mix_us = median([r["us"] for r in runs["Mixture"]])
        cat_us = median([r["us"] for r in runs["Concat+WRS"]])
        t_mix, t_cat = first_sample(total)
        rows.append([f"{total:.0e}", mix_us, cat_us, mix_us / cat_us, t_mix * 1e3, t_cat * 1e3])
    print()
    print(f"per sample ({args.items} reads, median of {args.rounds} alternating rounds)")
    print_table(
        [
            "epoch size",
            "Mixture us/sample",
            "Concat+WRS us/sample",
            "ratio",
            "Mixture first ms",
            "Concat+WRS first ms",
        ],
        rows,
    )
    runs = alternate(through_loader(args.items, 64), args.rounds)
    mix_us = median([r["us"] for r in runs["Mixture"]])
    cat_us = median([r["us"] for r in runs["Concat+WRS"]])
    print()
    print(f"through DataLoader(batch_size=64, num_workers=0), an epoch of {args.items} samples")
    print_table(
        ["", "Mixture us/sample", "Concat+WRS us/sample", "ratio"],
        [["epoch", mix_us, cat_us, mix_us / cat_us]],
    )
    print()
    print("Mixture state (median)")
    reps = 200 if args.quick else 2000
    print_table(
        ["state", "state_dict() us", "json bytes", "dump_state bytes", "load_state_dict ms"],
        [state_figures(10**7, 1, reps), state_figures(10**7, 100, reps)],
    )


if __name__ == "__main__":
    main()
