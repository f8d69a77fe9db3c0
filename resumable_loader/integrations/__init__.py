"""Integrations with training frameworks, each in its own module (optional dependencies).

* ``resumable_loader.integrations.accelerate``: ``prepare_data_loader(accelerator, loader)``,
  which keeps our loader where ``accelerator.prepare(loader)`` would replace it.
* ``resumable_loader.integrations.transformers``: ``ResumableTrainer``, a ``Trainer`` that
  trains from our loader and resumes it from its checkpoints without fetching a batch twice.
* ``resumable_loader.integrations.torchft``: ``ReplicaGroupLoader``, our loader in a torchft
  replica-group loop, every sample in exactly one committed step (docs/torchft.md). It
  duck-types torchft's ``Manager`` and imports nothing of torchft.

Importing this package imports neither framework; each module imports its own at its import
(and raises an ``ImportError`` naming the versions tested when it is missing or too old).
docs/integrations.md has the recipes and what each guarantees.
"""
