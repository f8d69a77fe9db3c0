"""Dataset checks (``_fingerprint``): a state records the data it was taken on -- the dataset's
class, its length (``config.dataset_len``) and its ``fingerprint()``; a ``Mixture``'s sources in
its plan -- and ``load_state_dict`` refuses changed data, or with
``on_dataset_change="continue"`` keeps the position on the new data with one warning.

Every resume is compared with an uninterrupted run: on the checkpoint's data for a clean resume,
on the new data for a "continue" (what a loader over the new data yields after the same
number of batches). States go through ``torch.save``/``torch.load(weights_only=True)`` and
``dump_state``/``load_state`` as a job's would."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _datasets import CursorSampler
from torch.utils.data import ConcatDataset, Dataset, Subset

from resumable_loader import CheckpointError, DataLoader, Mixture, merge_rank_states
from resumable_loader.cli.main import main
from resumable_loader.state.codec import dump_state
from resumable_loader.testing import FaultyDataset, roundtrip_state

VIAS = ["torch", "bytes"]
N, B, K = 30, 4, 3  # samples, batch size, batches consumed before the checkpoint


class Corpus(Dataset):
    """Item i is ``base + i``; no ``fingerprint()``."""

    def __init__(self, n: int = N, base: int = 0) -> None:
        self.n, self.base = n, base

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range({self.n})")
        return self.base + i


class OtherCorpus(Corpus):
    """Another class over the same items."""


class Manifest(Corpus):
    """A ``Corpus`` whose ``fingerprint()`` returns ``fp`` (or raises it, if an exception)."""

    def __init__(self, n: int = N, base: int = 0, fp: Any = "sha256:v1") -> None:
        super().__init__(n, base)
        self.fp = fp

    def fingerprint(self) -> Any:
        if isinstance(self.fp, BaseException):
            raise self.fp
        return self.fp


def make(ds: Dataset, shuffle: bool = True, seed: int = 7, **kw: Any) -> DataLoader:
    gen = torch.Generator()
    gen.manual_seed(seed)
    kw.setdefault("batch_size", B)
    return DataLoader(ds, shuffle=shuffle, generator=gen, **kw)


def flat(batches: Any) -> list[list[int]]:
    return [[int(x) for x in b] for b in batches]


def saved_after(loader: DataLoader, k: int = K) -> dict[str, Any]:
    it = iter(loader)
    for _ in range(k):
        next(it)
    return loader.state_dict()


def two_epochs(loader: DataLoader) -> list[list[list[int]]]:
    return [flat(loader), flat(loader)]


def load_quietly(loader: DataLoader, state: dict[str, Any], **kw: Any) -> list[str]:
    """Load ``state``; return the messages of the warnings it raised (all of them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.load_state_dict(state, **kw)
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def refused(loader: DataLoader, state: dict[str, Any], *fragments: str, **kw: Any) -> str:
    """Load must raise CheckpointError holding ``fragments``, warn nothing, change nothing."""
    before = loader.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError) as info:
            loader.load_state_dict(state, **kw)
    assert not caught, [str(w.message) for w in caught]
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, msg
    assert loader.state_dict() == before, "a refused state changed the loader"
    return msg


# ---- what a state records --------------------------------------------------------------------
@pytest.mark.parametrize("via", [*VIAS, "json"])
def test_the_state_records_the_data_and_survives_storage(via: str) -> None:
    sd = roundtrip_state(saved_after(make(Manifest())), via)
    assert sd["dataset"] == {"class": "Manifest", "fingerprint": "sha256:v1"}
    assert sd["config"]["dataset_len"] == N  # the length: one place, the config
    plain = roundtrip_state(make(Corpus()).state_dict(), via)
    assert plain["dataset"] == {"class": "Corpus", "fingerprint": None}
    # The same data resumes silently, and exactly.
    want = two_epochs(make(Manifest()))
    resumed = make(Manifest(), seed=99)
    assert load_quietly(resumed, sd) == []
    assert two_epochs(resumed) == [want[0][K:], want[1]]


def test_the_class_is_named_without_its_module() -> None:
    # A script's dataset class is __main__.Corpus when the script runs and train.Corpus when a
    # launcher (or a test) imports it: the same class, so the same data.
    as_script = type("Corpus", (Corpus,), {"__module__": "__main__"})
    sd = saved_after(make(Corpus()))
    want = two_epochs(make(as_script()))
    resumed = make(as_script())
    assert load_quietly(resumed, sd) == []
    assert two_epochs(resumed) == [want[0][K:], want[1]]


def test_a_fault_injector_records_the_dataset_it_wraps(tmp_path: Path) -> None:
    # resumable_loader.testing's wrappers change no data: a job run through one resumes on the
    # plain dataset (and the other way round), and the wrapped dataset's fingerprint is checked.
    faulty = make(FaultyDataset(Manifest(), {}, tmp_path))
    sd = saved_after(faulty)
    assert sd["dataset"] == {"class": "Manifest", "fingerprint": "sha256:v1"}
    want = two_epochs(make(Manifest()))
    resumed = make(Manifest())
    assert load_quietly(resumed, sd) == []
    assert two_epochs(resumed) == [want[0][K:], want[1]]
    refused(make(FaultyDataset(Manifest(fp="v2"), {}, tmp_path)), sd, "'v2'")


def test_wrappers_are_recorded_by_class_and_length_only() -> None:
    # Subset and ConcatDataset are not looked into: a changed inner fingerprint of the same
    # length goes unseen (documented), a changed length does not.
    sub = make(Subset(Manifest(fp="a"), range(20))).state_dict()
    assert sub["dataset"] == {"class": "Subset", "fingerprint": None}
    assert load_quietly(make(Subset(Manifest(fp="b"), range(20))), sub) == []
    refused(make(Subset(Manifest(fp="a"), range(19))), sub, "config.dataset_len", "20", "19")
    cat = make(ConcatDataset([Corpus(10), Corpus(20)])).state_dict()
    assert cat["config"]["dataset_len"] == 30
    assert cat["dataset"]["class"] == "ConcatDataset"


# ---- refusals (the default) -------------------------------------------------------------------
@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize(
    ("new", "fragments"),
    [
        (Manifest(N + 2), ["config.dataset_len", "the checkpoint has 30, this loader has 32"]),
        (
            Manifest(fp="sha256:v2"),
            ["fingerprint() is 'sha256:v2', the checkpoint's was 'sha256:v1'"],
        ),
        (
            Corpus(),
            ["class is Corpus, the checkpoint's was Manifest", "None"],
        ),
    ],
    ids=["length", "fingerprint", "class"],
)
def test_changed_data_is_refused_naming_both_values_and_the_fix(
    via: str, new: Dataset, fragments: list[str]
) -> None:
    sd = roundtrip_state(saved_after(make(Manifest())), via)
    loader = make(new)
    refused(
        loader,
        sd,
        "the data changed since the checkpoint",
        *fragments,
        "Resume with the checkpoint's data",
        "on_dataset_change='continue'",
    )
    assert len(flat(loader)) == -(-len(new) // B)  # a fresh epoch, untouched by the refusal


def test_every_change_is_named_in_one_refusal() -> None:
    sd = saved_after(make(Manifest()))
    msg = refused(make(OtherCorpus(N + 1)), sd)
    assert "class is" in msg and "dataset_len" in msg and "fingerprint() is None" in msg


# ---- on_dataset_change="continue" ------------------------------------------------------------
@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(
    ("new", "said"),
    [
        (Manifest(N + 6, base=1000), "the checkpoint has 30, this loader has 36"),
        (Manifest(N - 6, base=1000), "the checkpoint has 30, this loader has 24"),
        (Manifest(base=1000, fp="sha256:v2"), "'sha256:v2', the checkpoint's was 'sha256:v1'"),
        (OtherCorpus(base=1000), "class is OtherCorpus"),
    ],
    ids=["grown", "shrunk", "fingerprint", "class"],
)
def test_continue_resumes_by_position_on_the_new_data_with_one_warning(
    via: str, shuffle: bool, new: Dataset, said: str
) -> None:
    sd = roundtrip_state(saved_after(make(Manifest(), shuffle=shuffle)), via)
    # The reference: an uninterrupted run over the new data (same seed): after the K batches
    # the checkpoint consumed, it yields the rest; the next epoch is its next epoch.
    want = two_epochs(make(new, shuffle=shuffle))
    resumed = make(new, shuffle=shuffle, seed=12345)  # the state's seed chain wins
    caught = load_quietly(resumed, sd, on_dataset_change="continue")
    assert len(caught) == 1, caught
    assert caught[0].startswith("RuntimeWarning: DataLoader.load_state_dict(on_dataset_change=")
    assert said in caught[0]
    assert two_epochs(resumed) == [want[0][K:], want[1]]


@pytest.mark.parametrize("shuffle", [True, False])
def test_continue_with_another_batch_size_keeps_the_sample_position(shuffle: bool) -> None:
    # The position is a sample cursor: K batches of B consumed on the old data are the first
    # K*B samples of the new data's order, whatever batch size cuts the rest.
    sd = saved_after(make(Manifest(), shuffle=shuffle))
    new = Manifest(N + 5, base=1000, fp="sha256:v2")
    order = [x for b in flat(make(new, shuffle=shuffle)) for x in b]
    resumed = make(new, shuffle=shuffle, batch_size=3)
    assert len(load_quietly(resumed, sd, on_dataset_change="continue")) == 1
    rest = flat(resumed)
    assert [x for b in rest for x in b] == order[K * B :]
    assert {len(b) for b in rest[:-1]} == {3}


def test_a_sampler_num_samples_given_explicitly_stays_the_samplers() -> None:
    # RandomSampler's num_samples follows the dataset's length unless given: one given equal to
    # the old length is the same sampler over the grown data, not a changed sampler.
    def loader(n: int) -> DataLoader:
        gen = torch.Generator()
        gen.manual_seed(3)
        ds = Corpus(n)
        sampler = torch.utils.data.RandomSampler(ds, replacement=True, num_samples=N)
        return DataLoader(ds, batch_size=B, sampler=sampler, generator=gen)

    sd = saved_after(loader(N))
    assert sd["config"]["sampler"] == f"random(replacement=True, num_samples={N})"
    want = two_epochs(loader(N + 6))
    resumed = loader(N + 6)
    assert len(load_quietly(resumed, sd, on_dataset_change="continue")) == 1
    assert two_epochs(resumed) == [want[0][K:], want[1]]


def test_a_state_taken_after_a_continue_records_the_new_data() -> None:
    sd = saved_after(make(Manifest()))
    new = Manifest(N + 2, fp="sha256:v2")
    resumed = make(new)
    load_quietly(resumed, sd, on_dataset_change="continue")
    again = resumed.state_dict()  # before iterating: the position loaded, on the new data
    assert again["dataset"]["fingerprint"] == "sha256:v2"
    assert again["config"]["dataset_len"] == N + 2
    want = two_epochs(make(new))
    fresh = make(new)
    assert load_quietly(fresh, again) == []  # the same data now: no change, no warning
    assert two_epochs(fresh) == [want[0][K:], want[1]]


def test_continue_past_the_end_of_the_new_data_is_refused_clearly() -> None:
    sd = saved_after(make(Manifest(), shuffle=False), k=5)  # 20 of 30 samples consumed
    loader = make(Manifest(12, fp="sha256:v2"), shuffle=False)  # 3 batches in all
    msg = refused(
        loader,
        sd,
        "consumed",
        "an epoch of this loader has only 3",
        "the checkpoint has 30, this loader has 12",
        "must fit the new data",
        on_dataset_change="continue",
    )
    assert "IndexError" not in msg
    # The same with another batch size: the sample cursor (20) is past the new end (12).
    other = make(Manifest(12, fp="sha256:v2"), shuffle=False, batch_size=3)
    refused(other, sd, "consumed", "must fit the new data", on_dataset_change="continue")


def test_an_outstanding_batch_past_the_end_of_the_new_data_is_refused() -> None:
    # A sampler with its own state: batches it drew and the caller did not consume are
    # re-sent by index, which must exist in the new data.
    sd = saved_after(DataLoader(Corpus(), batch_size=B, sampler=CursorSampler(N)), k=2)
    sd["drawn"] += 1
    sd["outstanding"] = [[sd["drawn"] - 1, [24, 25, 26, 27]]]  # drawn, not yet delivered
    loader = DataLoader(Corpus(25), batch_size=B, sampler=CursorSampler(25))
    refused(
        loader,
        sd,
        "outstanding",
        "task 2 holds sample indices [24, 25, 26, 27]",
        "now has 25 samples",
        on_dataset_change="continue",
    )


@pytest.mark.parametrize("value", ["ignore", "Continue", None, True, ["continue"]])
def test_other_values_of_on_dataset_change_are_a_value_error(value: Any) -> None:
    sd = saved_after(make(Corpus()))
    loader = make(Corpus())
    before = loader.state_dict()
    with pytest.raises(ValueError, match=r"on_dataset_change must be 'raise' .*or 'continue'"):
        loader.load_state_dict(sd, on_dataset_change=value)
    assert loader.state_dict() == before
    with pytest.raises(ValueError, match="on_dataset_change must be"):
        mixture({"a": 10}).load_state_dict(mixture({"a": 10}).state_dict(), on_dataset_change=value)


def test_on_dataset_change_is_keyword_only() -> None:
    sd = make(Corpus()).state_dict()
    with pytest.raises(TypeError):
        make(Corpus()).load_state_dict(sd, "continue")  # type: ignore[misc]


# ---- a broken fingerprint() --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fp", "exc", "fragments"),
    [
        (OSError("manifest.json: no such file"), RuntimeError, ["raised OSError", "manifest"]),
        (1234, TypeError, ["must return a str", "not int"]),
        (b"sha", TypeError, ["must return a str", "not bytes"]),
        ("x" * 5000, ValueError, ["5000 characters", "at most 1024"]),
    ],
)
def test_a_broken_fingerprint_is_a_clear_error_naming_the_dataset(
    fp: Any, exc: type[Exception], fragments: list[str]
) -> None:
    loader = make(Manifest(fp=fp))
    with pytest.raises(exc) as info:
        loader.state_dict()
    msg = str(info.value)
    assert "the dataset (Manifest): fingerprint()" in msg
    for fragment in fragments:
        assert fragment in msg, msg
    if isinstance(fp, BaseException):
        assert info.value.__cause__ is fp
    with pytest.raises(exc):  # at a resume too, before anything is loaded
        loader.load_state_dict(make(Corpus()).state_dict())
    # A Mixture names the source (the same words: one function says them).
    with pytest.raises(exc, match=r"source 'web': fingerprint\(\)"):
        Mixture({"web": Manifest(fp=fp), "code": Corpus(5)}, {"web": 1, "code": 1})


@pytest.mark.parametrize(
    "record",
    [
        {"class": "Manifest"},  # no fingerprint key
        {"class": 3, "fingerprint": None},
        {"class": "Manifest", "fingerprint": 7},
        ["Manifest", "sha256:v1"],
        None,
    ],
)
def test_a_damaged_record_is_refused_naming_the_field(record: Any) -> None:
    sd = saved_after(make(Manifest()))
    sd["dataset"] = record
    refused(make(Manifest()), sd, "dataset: expected {class: str, fingerprint: str or None}")
    refused(make(Manifest()), sd, "the state is damaged", on_dataset_change="continue")


# ---- a state from before dataset checks ------------------------------------------------------
@pytest.mark.parametrize("via", VIAS)
def test_a_state_without_the_record_loads_with_only_its_length_checked(via: str) -> None:
    sd = saved_after(make(Manifest()))
    del sd["dataset"]  # as written before dataset checks (same state version)
    sd = roundtrip_state(sd, via)
    # Class and fingerprint are not checked: another of each loads silently, by position.
    want = two_epochs(make(OtherCorpus(base=1000)))
    resumed = make(OtherCorpus(base=1000))
    assert load_quietly(resumed, sd) == []
    assert two_epochs(resumed) == [want[0][K:], want[1]]
    # Its length still is.
    refused(make(Manifest(N + 1)), sd, "config.dataset_len", "30", "31")


# ---- a job's global state (torch.distributed.checkpoint, merge_rank_states) ------------------
def test_a_global_state_is_checked_too() -> None:
    sd = merge_rank_states([saved_after(make(Manifest()))])
    refused(make(Manifest(fp="sha256:v2")), sd, "'sha256:v2', the checkpoint's was 'sha256:v1'")
    want = two_epochs(make(Manifest(fp="sha256:v2", base=1000)))
    resumed = make(Manifest(fp="sha256:v2", base=1000))
    assert len(load_quietly(resumed, sd, on_dataset_change="continue")) == 1
    assert two_epochs(resumed) == [want[0][K:], want[1]]


# ---- Mixture sources -------------------------------------------------------------------------
def mixture(lengths: dict[str, int], fps: dict[str, str] | None = None) -> Mixture:
    fps = fps or {}
    sources = {
        name: Manifest(n, base=1000 * (i + 1), fp=fps[name]) if name in fps else Corpus(n, 1000)
        for i, (name, n) in enumerate(sorted(lengths.items()))
    }
    return Mixture(sources, {name: 1 for name in lengths}, seed=5)


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize(
    ("new", "said"),
    [
        (
            lambda: mixture({"code": 11, "web": 20}, {"web": "v2"}),
            "source 'web' has fingerprint 'v2', the checkpoint 'v1'",
        ),
        (
            lambda: mixture({"code": 11, "web": 24}, {"web": "v1"}),
            "source 'web' had 20 items in the checkpoint, now 24",
        ),
    ],
    ids=["fingerprint", "length"],
)
def test_a_changed_mixture_source_is_refused_or_continued(
    via: str, new: Callable[[], Mixture], said: str
) -> None:
    def loader(mix: Mixture) -> DataLoader:
        return DataLoader(mix, batch_size=B)

    old = mixture({"code": 11, "web": 20}, {"web": "v1"})
    sd = saved_after(loader(old))
    assert sd["dataset"] == {"class": "Mixture", "fingerprint": None}
    assert sd["data_plan"]["sources"][1] == {"name": "web", "length": 20, "fingerprint": "v1"}
    sd = roundtrip_state(sd, via)
    refused(loader(new()), sd, said, "on_dataset_change='continue'")

    want = two_epochs(loader(new()))
    resumed = loader(new())
    caught = load_quietly(resumed, sd, on_dataset_change="continue")
    assert len(caught) == 1 and said in caught[0], caught
    assert two_epochs(resumed) == [want[0][K:], want[1]]


def test_mixture_sources_added_are_refused_even_with_continue() -> None:
    sd = saved_after(DataLoader(mixture({"code": 11, "web": 20}), batch_size=B))
    loader = DataLoader(mixture({"code": 11, "web": 20, "wiki": 5}), batch_size=B)
    refused(loader, sd, "['wiki'] added", "does not apply", on_dataset_change="continue")


@pytest.mark.parametrize(
    "source",
    [
        {"name": ["web"], "length": 20, "fingerprint": None},
        {"name": "web", "length": torch.tensor([20, 20]), "fingerprint": None},
        {"name": "web", "length": 20, "fingerprint": 5},
    ],
)
def test_a_damaged_plan_source_is_refused_not_raised_from(source: dict[str, Any]) -> None:
    sd = mixture({"web": 20}).state_dict()
    sd["sources"] = [source]
    mix = mixture({"web": 20})
    with pytest.raises(CheckpointError, match="bad Mixture state: 'sources' is"):
        mix.load_state_dict(sd, on_dataset_change="continue")


def test_mixture_load_state_dict_continues_with_one_warning() -> None:
    saved = mixture({"code": 11, "web": 20}, {"web": "v1"}).state_dict()
    mix = mixture({"code": 11, "web": 24}, {"web": "v2"})
    with pytest.raises(CheckpointError, match="num_samples=31, this one 35"):
        mix.load_state_dict(saved)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mix.load_state_dict(saved, on_dataset_change="continue")
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    text = str(caught[0].message)
    assert "Mixture.load_state_dict" in text and "had 20 items" in text and "'v2'" in text
    assert mix.history == [(0, {"code": 1, "web": 1})]


# ---- inspect ---------------------------------------------------------------------------------
def test_inspect_shows_the_fingerprints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"loader": saved_after(make(Manifest()))}, path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "dataset          Manifest; fingerprint 'sha256:v1'" in out

    mix = mixture({"code": 11, "web": 20}, {"web": "sha256:" + "ab" * 32})
    rls = tmp_path / "mix.rls"
    rls.write_bytes(dump_state(saved_after(DataLoader(mix, batch_size=B))))
    assert main(["inspect", str(rls)]) == 0
    out = capsys.readouterr().out
    assert "dataset          Mixture; fingerprints per source (data_plan)" in out
    assert "seed 5, epoch 0, num_samples 31; weights {'code': 1, 'web': 1} from position 0" in out
    assert "source 'code': 11 items, fingerprint None" in out
    assert f"source 'web': 20 items, fingerprint 'sha256:{'ab' * 32}'" in out

    old = make(Corpus()).state_dict()
    del old["dataset"]
    rls.write_bytes(dump_state(old))
    assert main(["inspect", str(rls)]) == 0
    assert "dataset          - (not recorded: a resume checks the length only)" in (
        capsys.readouterr().out
    )
