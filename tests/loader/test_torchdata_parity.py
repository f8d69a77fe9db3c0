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


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata's own
def test_an_epochs_end_here_and_in_torchdata() -> None:
    # docs/guarantees.md, "An epoch's end, here and in torchdata": its table, measured. A state
    # taken after StopIteration resumes with the next epoch in both; one taken after the last
    # batch, before StopIteration, does here, and gives torchdata an empty first pass.
    torchdata = pytest.importorskip("torchdata.stateful_dataloader")
    data = list(range(8))
    whole = [[0, 1], [2, 3], [4, 5], [6, 7]]

    def two_passes_after_resume(make, *, after_stop: bool) -> list[list[list[int]]]:
        loader = make()
        it = iter(loader)
        for _ in range(len(loader)):
            next(it)
        if after_stop:
            assert next(it, None) is None
        state = loader.state_dict()
        again = make()
        again.load_state_dict(state)
        return [[b.tolist() for b in again] for _ in range(2)]

    def ours():
        return DataLoader(data, batch_size=2)

    def theirs():
        return torchdata.StatefulDataLoader(data, batch_size=2)

    assert two_passes_after_resume(ours, after_stop=True) == [whole, whole]
    assert two_passes_after_resume(theirs, after_stop=True) == [whole, whole]
    assert two_passes_after_resume(ours, after_stop=False) == [whole, whole]
    assert two_passes_after_resume(theirs, after_stop=False) == [[], whole]
