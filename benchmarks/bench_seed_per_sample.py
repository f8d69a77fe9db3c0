"""What ``seed_per_sample=True`` costs per item: the same epoch with and without it.

    python benchmarks/bench_seed_per_sample.py [--rounds 7] [--items 4096]

The dataset draws one number from each of python ``random``, numpy and torch per item (a
typical augmentation's RNG use, with no other work), batch 32, in the main process
(``num_workers=0``, so the loader's own cost is not hidden behind workers). Reported: time per
item for each setting (median of alternating rounds) and the difference -- the price of
seeding the three RNGs before every ``dataset[i]``.
"""

from __future__ import annotations

import random
import time

import numpy as np
import torch
from _common import alternate, base_parser, env_line, median, parse, print_table
from torch.utils.data import Dataset


class Augmented(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, float, float, float]:
        return i, random.random(), float(np.random.rand()), float(torch.rand(()))


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], start_method=False)
    p.add_argument("--items", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=7)
    args = parse(p)
    if args.quick:
        args.items, args.rounds = 512, 3
    from resumable_loader import DataLoader

    ds = Augmented(args.items)

    def epoch(per_sample: bool):
        def run() -> dict[str, float]:
            loader = DataLoader(ds, batch_size=32, seed_per_sample=per_sample)
            t0 = time.perf_counter()
            for _ in loader:
                pass
            return {"us_per_item": (time.perf_counter() - t0) / args.items * 1e6}

        return run

    runs = alternate({"off": epoch(False), "on": epoch(True)}, args.rounds)
    off = median([r["us_per_item"] for r in runs["off"]])
    on = median([r["us_per_item"] for r in runs["on"]])
    print(env_line())
    print_table(
        ["seed_per_sample", "us / item (median)", "rounds"],
        [["off", off, len(runs["off"])], ["on", on, len(runs["on"])], ["cost", on - off, ""]],
    )


if __name__ == "__main__":
    main()
