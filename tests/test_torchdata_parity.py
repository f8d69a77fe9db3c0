"""What a user migrating from torchdata's StatefulDataLoader relies on (issue #12's torchdata
half). Differences kept on purpose are in docs/differences.md."""

from __future__ import annotations

import warnings

import pytest
import torch
from _streams import StatefulShard

from resumable_loader import DataLoader
from resumable_loader.testing import check_resume


def test_snapshot_every_n_steps_is_torchdatas_name_for_stream_state_every() -> None:
    loader = DataLoader(StatefulShard(12), batch_size=2, snapshot_every_n_steps=3)
    assert loader.stream_state_every == 3
    same = DataLoader(StatefulShard(12), snapshot_every_n_steps=2, stream_state_every=2)
    assert same.stream_state_every == 2
    with pytest.raises(ValueError, match="two names for one setting"):
        DataLoader(StatefulShard(12), snapshot_every_n_steps=2, stream_state_every=5)
    # torchdata's 0 (no periodic snapshot) is our adaptive default; ours has no 0.
    assert DataLoader(StatefulShard(12), snapshot_every_n_steps=0).stream_state_every is None
    with pytest.raises(ValueError, match="stream_state_every must be an int >= 1"):
        DataLoader(StatefulShard(12), stream_state_every=0)
    with pytest.raises(ValueError, match="stream_state_every must be an int >= 1"):
        DataLoader(StatefulShard(12), snapshot_every_n_steps=-1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_snapshots_every_n_steps_resume_exactly(num_workers: int) -> None:
    def make() -> DataLoader:
        return DataLoader(
            StatefulShard(14),
            batch_size=2,
            num_workers=num_workers,
            snapshot_every_n_steps=3,
            generator=torch.Generator().manual_seed(0),
        )

    # Save points between snapshots too: a resume replays the fetches since the last one,
    # silently (the replay is bounded by the interval; nothing is wrong with the dataset).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_resume(make, epochs=2, steps=[1, 2, 4, 5, 7, 9, 11]) == 7
