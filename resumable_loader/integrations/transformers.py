"""Hugging Face transformers: a ``Trainer`` that trains from our loader and resumes it exactly.

The ``Trainer`` has no stateful-loader option. ``Trainer.get_train_dataloader`` builds a torch
``DataLoader`` (``Trainer._get_dataloader``) and hands it to ``accelerator.prepare``; on
``train(resume_from_checkpoint=...)``, ``Trainer._run_epoch`` (``transformers/trainer.py``)
calls accelerate's ``skip_first_batches`` with the number of batches already trained in the
epoch: for a stream it fetches and throws away every one of them; for a map-style dataset it
builds a new torch loader whose order is drawn from a fresh generator, so from the second
epoch on it trains other samples than the uninterrupted run did.

``ResumableTrainer`` differs from the ``Trainer`` in four places only:

* ``get_train_dataloader`` builds our loader from the same ``TrainingArguments``, collator
  and train sampler, shared over the processes by torch's ``DistributedSampler`` seeded with
  ``data_seed`` (else ``seed``);
* ``_save_checkpoint`` writes the loader's state (every process's, gathered) into each
  ``checkpoint-<step>`` folder as ``resumable_loader.state``, before the Trainer's own files;
* on ``train(resume_from_checkpoint=...)`` the loader loads that state, and the Trainer's
  skip of the batches already trained is answered by the loader itself: it is already there,
  so nothing is fetched, and the Trainer keeps counting its steps as it always does (gradient
  accumulation, the epoch's last partial step, its RNG states);
* for a loader without ``len()``, which the Trainer counts as one epoch of ``max_steps``
  steps while its loop takes one epoch per pass, ``_init_training_state`` resumes the
  Trainer at the loader's pass and its position in it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

try:
    import transformers
    import transformers.trainer as _trainer_module
    from transformers import Trainer
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, has_length
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "resumable_loader.integrations.transformers needs Hugging Face transformers (tested "
        "with 5.24.0) and accelerate (1.15.0): pip install 'transformers>=5.24' 'accelerate>=1.15'"
    ) from e

import torch
from torch.utils.data import IterableDataset

from ..core.errors import CheckpointError
from ..loader.dataloader import DataLoader
from . import _common

__all__ = ["STATE_FILE", "ResumableTrainer"]

STATE_FILE = "resumable_loader.state"

# The Trainer internals this module relies on; a release without one of them fails here, at
# import, with the versions tested, rather than mid-training.
_NEEDED = (
    "_init_training_state",
    "_run_epoch",
    "_save_checkpoint",
    "_get_train_sampler",
    "_get_output_dir",
    "_remove_unused_columns",
    "_get_collator_with_removed_columns",
)
_missing = [n for n in _NEEDED if not hasattr(Trainer, n)]
if _missing or not hasattr(_trainer_module, "skip_first_batches"):
    raise ImportError(
        f"resumable_loader.integrations.transformers was tested with transformers 5.24.0; "
        f"this transformers ({transformers.__version__}) lacks Trainer."
        f"{', Trainer.'.join(_missing) or 'skip_first_batches'}"
    )


class ResumableTrainer(Trainer):
    """A ``transformers.Trainer`` whose training loader is a ``resumable_loader.DataLoader``
    saved in every checkpoint and resumed from it without fetching a batch again.

    Use it where you use ``Trainer``; the arguments are the same, plus ``loader_options``.
    From ``TrainingArguments`` it takes ``per_device_train_batch_size``,
    ``dataloader_num_workers``, ``dataloader_pin_memory`` (when the device is not the CPU),
    ``dataloader_persistent_workers``, ``dataloader_prefetch_factor``,
    ``dataloader_multiprocessing_context``, ``dataloader_in_order``, ``dataloader_drop_last``,
    ``data_seed``/``seed`` (the shuffle seed and the loader's ``generator``), the data collator
    (with unused columns removed as the Trainer does) and the train sampler the Trainer would
    use (``train_sampling_strategy``). Our loader seeds every batch itself, so the Trainer's
    ``seed_worker`` is not passed.

    ``train(resume_from_checkpoint=True | path)`` then trains, after the checkpoint, the
    batches the uninterrupted run trained, step for step, across epoch boundaries (also the
    passes of a stream without ``len()`` under ``max_steps``), with one or more processes
    (``torchrun``). ``ignore_data_skip=True`` keeps the Trainer's meaning: the
    loader starts its epoch from the beginning.

    Args:
        *args: ``Trainer``'s positional arguments.
        loader_options: keyword arguments for our loader beyond torch's (``task_timeout``,
            ``max_task_attempts``, ``on_poison``, ``retry``, ``stream_state_every``,
            ``seed_per_sample``).
        **kwargs: ``Trainer``'s keyword arguments.
    """

    def __init__(self, *args: Any, loader_options: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.loader_options = dict(loader_options or {})
        self._train_loader: DataLoader[Any] | None = None
        self._resume_dir: str | None = None
        self._resumed_batches: int | None = None
        # (epoch, batches consumed in it) of the loader state resumed from, until the Trainer
        # has read it (_init_training_state).
        self._resumed_at: tuple[int, int] | None = None

    # ---- the loader ------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader[Any]:
        """Our loader over the train dataset, as the Trainer would have built its own; with
        the checkpoint's loader state loaded when ``train`` resumes.

        Raises:
            ValueError: no train dataset, or a sampler that cannot be shared over processes.
            CheckpointError: the checkpoint being resumed holds no loader state.
        """
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if self._train_loader is not None:
            self._train_loader.close()
            self._train_loader = None
        args = self.args
        dataset: Any = self.train_dataset
        collator = self.data_collator
        hf = _trainer_module.datasets if _trainer_module.is_datasets_available() else None
        if hf is not None and isinstance(dataset, hf.Dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        sampler = None
        if not isinstance(dataset, IterableDataset):
            sampler = self._get_train_sampler(dataset)
            if type(sampler).__name__ == "BatchRebalanceSampler":
                raise ValueError(
                    "ResumableTrainer does not support train_sampling_strategy='batch_rebalance' "
                    "yet: its batches are cut per rank by the sampler itself"
                )
        seed = args.data_seed if args.data_seed is not None else args.seed
        num_workers = args.dataloader_num_workers
        context = args.dataloader_multiprocessing_context if num_workers else None
        loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_size=self._train_batch_size,
            sampler=sampler,
            collate_fn=collator,
            num_workers=num_workers,
            pin_memory=bool(args.dataloader_pin_memory) and args.device.type != "cpu",
            drop_last=args.dataloader_drop_last,
            multiprocessing_context=context,
            generator=torch.Generator().manual_seed(seed),
            prefetch_factor=args.dataloader_prefetch_factor if num_workers else None,
            persistent_workers=bool(args.dataloader_persistent_workers) and num_workers > 0,
            in_order=args.dataloader_in_order,
            **self.loader_options,
        )
        loader = _common.shard(loader, max(1, args.world_size), args.process_index, seed)
        self._train_loader = loader
        self._resumed_batches = None
        self._resumed_at = None
        if self._resume_dir is not None and not args.ignore_data_skip:
            loader.load_state_dict(
                _common.read_state(self._resume_dir, STATE_FILE, "ResumableTrainer")
            )
            resumed = loader.state_dict()
            self._resumed_batches = resumed["consumed"]
            self._resumed_at = (resumed["epoch"], resumed["consumed"])
        return loader

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        """The Trainer's (epochs trained, batches trained in the current epoch) when it
        resumes; for a loader without ``len()``, the loader's own position.

        Without a length the Trainer takes the whole run for one epoch of ``max_steps`` steps
        (``set_initial_training_values``) and counts ``global_step`` times the gradient
        accumulation as trained in it, but its epoch loop runs one epoch per pass of the
        loader: each ``_run_epoch`` takes a new ``iter()``, starting ``step`` and the
        accumulation over. The loader's state says which pass the checkpoint is in (its
        epoch, which counts the passes as the Trainer's loop does) and how far into it, so the
        resumed Trainer runs that epoch from there, as the uninterrupted one did."""
        epochs, batches = super()._init_training_state(*args, **kwargs)
        at, self._resumed_at = self._resumed_at, None
        loader = self._train_loader
        if at is not None and loader is not None and not has_length(loader):
            epochs, batches = at
        return epochs, batches

    # ---- checkpoints -------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        loader = self._train_loader
        if loader is not None:
            # Before the Trainer's files: a folder with trainer_state.json always has ours.
            state = _common.global_state(loader)  # every process takes part
            if self.args.should_save:
                folder = os.path.join(
                    self._get_output_dir(trial=trial),
                    f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}",
                )
                _common.write_state(folder, STATE_FILE, state)
        super()._save_checkpoint(model, trial)

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """``Trainer.train``; the loader is resumed from the checkpoint too, and closed (its
        workers stopped) when training ends."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"No valid checkpoint found in output directory ({self.args.output_dir})"
                )
        self._resume_dir = resume_from_checkpoint or None  # type: ignore[assignment]
        try:
            return super().train(resume_from_checkpoint or None, *args, **kwargs)
        finally:
            self._resume_dir = None
            if self._train_loader is not None:
                self._train_loader.close()

    def _run_epoch(
        self, model: Any, epoch: int, train_dataloader: Any, *args: Any, **kw: Any
    ) -> Any:
        ours = self._train_loader
        if ours is not None and train_dataloader is ours:
            _common.set_sampler_epoch(ours, epoch)
            if hasattr(ours.dataset, "set_epoch"):
                ours.dataset.set_epoch(epoch)  # as accelerate's loaders do
        with self._skip_answered_by_loader():
            return super()._run_epoch(model, epoch, train_dataloader, *args, **kw)

    @contextlib.contextmanager
    def _skip_answered_by_loader(self) -> Iterator[None]:
        """While one epoch runs, the Trainer's ``skip_first_batches`` returns our loader as it
        is -- it already resumed where the checkpoint was -- after checking that it stands
        where the Trainer counts; any other loader goes to accelerate's function unchanged.
        Only the name in ``transformers.trainer`` is swapped, and only for this call."""
        original = _trainer_module.skip_first_batches

        def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
            if dataloader is not self._train_loader or dataloader is None:
                return original(dataloader, num_batches)
            if self._resumed_batches != num_batches:
                raise CheckpointError(
                    f"cannot resume the loader exactly: the Trainer counts {num_batches} "
                    f"batches trained in this epoch, the loader state in {self._resume_dir} "
                    f"says {self._resumed_batches}. Resume from a checkpoint folder written by "
                    "ResumableTrainer with the same per-device batch size and gradient "
                    "accumulation."
                )
            self._resumed_batches = None
            return dataloader

        _trainer_module.skip_first_batches = skip_first_batches
        try:
            yield
        finally:
            if _trainer_module.skip_first_batches is skip_first_batches:
                _trainer_module.skip_first_batches = original
