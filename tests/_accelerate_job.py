"""A job whose loader accelerate rebuilds, for ``test_whole_truth``.

    python tests/_accelerate_job.py SPEC_JSON

accelerate's ``prepare()`` with ``use_stateful_dataloader=True`` rebuilds our shuffling loader
as torchdata's ``StatefulDataLoader`` over our batch sampler. ``save``: run to ``stop``
([epoch, step]), ``accelerator.save_state(ckpt)``, and exit; ``resume``: with other global RNG
draws and seed, ``load_state(ckpt)`` and run to the end. Every batch's indices go to ``out``.
"""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from resumable_loader import DataLoader

EPOCHS = 3


def main(spec: dict) -> None:
    torch.manual_seed(spec["seed"])
    torch.rand(spec.get("noise", 0) + 1)
    acc = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
    )
    loader = acc.prepare(
        DataLoader(list(range(32)), batch_size=4, shuffle=True, num_workers=spec["workers"])
    )
    start = 0
    if spec["phase"] == "resume":
        acc.load_state(spec["ckpt"])
        start = spec["stop"][0]
    with open(spec["out"], "a") as out:
        for epoch in range(start, EPOCHS):
            for step, batch in enumerate(loader):
                out.write(json.dumps(batch.tolist()) + "\n")
                out.flush()
                torch.rand(3)  # a training step
                if spec["phase"] == "save" and [epoch, step] == spec["stop"]:
                    acc.save_state(spec["ckpt"])
                    return


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
