"""``python -m resumable_loader inspect|skip``: reads and writes states through ``state`` only."""
