"""Adversarial tests of the Stream stages of issue #33 (mix, shuffle, pack, skip, inspect),
written from docs/streams.md alone. Each test states the promise it checks and compares the
resumed run against the whole epoch's items (every item exactly once), never against itself."""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _stream_shards as F
import _token_shards as T
import numpy as np
import pytest

from resumable_loader import CheckpointError, DataLoader, Stream, dump_state, load_state
from resumable_loader.plans.stream_mix import exhaustion

REPO = Path(__file__).resolve().parents[2]
WEB = list(range(16))
CODE = list(range(100, 108))
OLD = {"web": 0.7, "code": 0.3}
NEW = {"web": 0.2, "code": 0.8}


def _len(s: int, i: int) -> int:
    return (s * 7 + i * 13) % 40 + 1


class _Docs:
    """A seekable reader: shard ``s`` holds ``5 + s % 3`` documents whose tokens name them."""

    def __call__(self, s: int, start: int) -> Iterator[dict[str, Any]]:
        for i in range(start, 5 + s % 3):
            ids = (np.int64(T.doc_id(s, i)) << T.SHIFT) | np.arange(_len(s, i), dtype=np.int64)
            yield {"input_ids": ids}


def _every_token() -> list[int]:
    return sorted(
        T.token(T.doc_id(s, i), o)
        for s in WEB + CODE
        for i in range(5 + s % 3)
        for o in range(_len(s, i))
    )


def _cat(batch: list[Any]) -> np.ndarray:
    """Documents of any length in one batch: their tokens one after the other."""
    return np.concatenate([np.asarray(x["input_ids"]).ravel() for x in batch])


def _mix(weights: dict[str, float]) -> Stream:
    web = Stream.from_shards(WEB, _Docs(), seed=1, partitions=4)
    code = Stream.from_shards(CODE, _Docs(), seed=2, partitions=4)
    return Stream.mix({"web": web, "code": code}, weights, seed=0, on_exhausted="renormalize")


def _run(
    stream: Stream, workers: int, batch: int, state: Any = None, stop: int | None = None
) -> tuple[list[int], Any]:
    """Epoch 0 from ``state`` (or its start): its tokens, and the state after ``stop`` batches."""
    loader = DataLoader(
        stream, batch_size=batch, num_workers=workers, collate_fn=_cat, stream_tail=None
    )
    if state is not None:
        loader.load_state_dict(state)
    out: list[int] = []
    for n, b in enumerate(loader, 1):
        out += [t for t in np.asarray(b).ravel().tolist() if t != -1]
        if n == stop:
            return out, load_state(dump_state(loader.state_dict()))
    return out, None


def _once(tokens: list[int]) -> tuple[int, int]:
    """(repeated, missing) against every token of the epoch."""
    want = _every_token()
    c = collections.Counter(tokens)
    return sum(v - 1 for v in c.values() if v > 1), len(set(want) - set(c))


def test_new_weights_at_a_resume_of_a_mix_then_shuffle_deliver_every_item_once() -> None:
    """Promise ("New weights at a resume"): each source continues at its cursor, nothing of the
    pass repeats. mix -> shuffle(3), saved with 2 workers after 3 batches, resumed on the same
    layout with new weights: items of the half-read shuffle windows are delivered twice and
    others never (the window is re-read from the mix position where it began, under the new
    weights' interleave). Now refused at load, naming the stage after the mix; at an epoch's
    start the new weights apply (nothing is buffered then)."""
    head, state = _run(_mix(OLD).shuffle(3), 2, 4, stop=3)
    with pytest.raises(CheckpointError, match=r"new mixture weights at a resume .*shuffle"):
        _run(_mix(NEW).shuffle(3), 2, 4, state=state)
    tail, _ = _run(_mix(OLD).shuffle(3), 2, 4, state=state)  # the checkpoint's weights
    assert _once(head + tail) == (0, 0)


def test_new_weights_at_a_resume_of_a_mix_then_pack_keep_every_token_once() -> None:
    """Promise: pack keeps every token in one row, and mix weights may change at a resume.
    mix -> pack(32), saved with num_workers=0 after 3 batches (a document split across rows),
    resumed with new weights: the first batch raises ``RuntimeError: Stream.pack: re-reading
    the carry document at a saved position found 1 tokens where the state counted 38``. Now
    refused at load, naming the stage after the mix."""
    head, state = _run(_mix(OLD).pack(32, pad_id=-1), 0, 4, stop=3)
    with pytest.raises(CheckpointError, match=r"new mixture weights at a resume .*pack"):
        _run(_mix(NEW).pack(32, pad_id=-1), 0, 4, state=state)
    tail, _ = _run(_mix(OLD).pack(32, pad_id=-1), 0, 4, state=state)  # the checkpoint's weights
    assert _once(head + tail) == (0, 0)


def test_a_state_saved_after_new_weights_and_a_re_deal_loads_again() -> None:
    """Promise ("mix: new weights ... survives a second resume and a re-deal"). A plain mix
    saved with num_workers=0, resumed with new weights on 2 workers (batch 1) and saved after
    one batch: loading that state is refused, ``CheckpointError: workers[1].dataset_state:
    stream.mix is ..., but workers[0]'s is ...: The state is damaged``. Worker 0 (delivered)
    records the weights history [old, new]; worker 1 (not delivered yet) still [old]."""
    head, state = _run(_mix(OLD), 0, 4, stop=3)
    mid, state2 = _run(_mix(NEW), 2, 1, state=state, stop=1)
    tail, _ = _run(_mix(NEW), 0, 6, state=state2)
    assert _once(head + mid + tail) == (0, 0)


def test_the_skip_cli_on_a_state_without_config_gives_a_clear_error(tmp_path: Path) -> None:
    """Promise: an attacker's file into ``python -m resumable_loader skip`` gets a clear error,
    never a traceback. A Stream loader state with its ``config`` key removed: ``KeyError:
    'config'`` with a traceback from state/skip.py."""
    _, state = _run(_mix(OLD), 0, 4, stop=2)
    del state["config"]
    path = tmp_path / "state.bin"
    path.write_bytes(dump_state(state))
    out = tmp_path / "out.bin"
    cmd = [sys.executable, "-m", "resumable_loader", "skip", "--samples", "3", "-o", str(out)]
    r = subprocess.run([*cmd, str(path)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr[-800:]


@pytest.mark.parametrize("policy", ["stop", "renormalize"])
def test_a_shuffle_after_a_mix_keeps_the_exhaustion_counts_of_the_pass(policy: str) -> None:
    """Promise ("A source that runs out ... Counted: out and took stay in the cursor, the
    pass's end included"; ``exhaustion(state)`` sums them). A shuffle after the mix delivers
    the same source items, so the pass's counts must be the plain mix's. With mix -> shuffle(3)
    read to its end, one partition's ``out`` is lost: ``ran_out`` (and ``stopped``) is 3 of
    the 4 partitions where the plain mix (and mix -> pack) says 4."""
    plain = _mix_policy(policy)
    shuffled = _mix_policy(policy).shuffle(3)
    assert sum(1 for _ in plain) == sum(1 for _ in shuffled)
    assert exhaustion(shuffled.state_dict()) == exhaustion(plain.state_dict())


def _mix_policy(policy: str) -> Stream:
    web = Stream.from_shards(WEB, _Docs(), seed=1, partitions=4)
    code = Stream.from_shards(CODE, _Docs(), seed=2, partitions=4)
    return Stream.mix({"web": web, "code": code}, OLD, seed=0, on_exhausted=policy)


MATH = list(range(200, 208))


def test_a_source_name_with_a_dot_does_not_collide_with_a_nested_mixtures_fields() -> None:
    """Promise ("Counted": ``exhaustion(state)`` gives per source ``took``; the cursor names
    each source's fields by its name). An outer mixture of ``"a"`` (a mixture of ``"b"`` and
    ``"c"``) and a source named ``"a.b"``: the cursor holds two sets of ``a.b.*`` fields and
    ``exhaustion`` reports the inner web source's 95 rows as the outer ``"a.b"``'s, which gave
    48 (either refuse dotted names at ``mix()`` or keep the fields apart). Now refused."""
    web = Stream.from_shards(WEB, _Docs(), seed=1, partitions=4)
    code = Stream.from_shards(CODE, _Docs(), seed=2, partitions=4)
    math = Stream.from_shards(MATH, _Docs(), seed=3, partitions=4)
    inner = Stream.mix({"b": web, "c": code}, {"b": 1, "c": 1}, seed=5, on_exhausted="renormalize")
    with pytest.raises(ValueError, match=r"source name 'a\.b' may not contain '\.'"):
        Stream.mix({"a": inner, "a.b": math}, {"a": 1, "a.b": 1}, on_exhausted="renormalize")


def test_one_stream_object_under_two_names_in_a_mix_is_refused() -> None:
    """Promise ("no source item twice in a pass"). ``Stream.mix({"a": s, "b": s}, ...)`` with
    the same Stream object under two names is accepted, and every item of ``s`` is delivered
    twice in one pass (190 rows of 95 items); nothing warns."""
    web = Stream.from_shards(WEB, _Docs(), seed=1, partitions=4)
    with pytest.raises((ValueError, TypeError)):
        Stream.mix({"a": web, "b": web}, {"a": 1, "b": 1})


JOB = Path(__file__).parents[1] / "_break_stream_stages_job.py"


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="documented limit: the agreement is the minimum")
def test_a_rank_whose_partitions_are_empty_does_not_stall_the_carried_rows_forever(
    tmp_path: Path,
) -> None:
    """Promise ("The tail", stream_tail="carry"): "Nothing is lost; over the epochs, every row
    of every pass is delivered once". Real gloo ranks, 2 x 0 workers, rank 1's partition
    empty: every epoch ends after 0 batches on every rank (the minimum), so rank 0's 20 rows
    of pass 0 are never delivered in 3 epochs, with only the tail warning each epoch."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    spec = json.dumps({"out": str(tmp_path), "workers": 0, "epochs": 3})
    procs = [
        subprocess.Popen(
            [sys.executable, str(JOB), spec],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:  # a rank that failed leaves the other waiting for it
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    delivered = sorted(x for e in rank0.values() for b in e for x in b)
    pass0 = sorted(s * 1000 + i for s in range(0, 8, 2) for i in range(5))
    assert delivered[: len(pass0)] == pass0


@pytest.mark.parametrize("cut", ["take", "skip", "select_range"])
def test_hf_cache_files_of_a_contiguous_selection_reads_only_its_rows(
    tmp_path: Path, cut: str
) -> None:
    """Promise (adapters: ``hf_cache_files(ds)`` refuses a dataset whose order its files do
    not hold). ``ds.take(3)``, ``ds.skip(3)`` and ``ds.select(range(3, 6))`` of a dataset
    saved to disk carry no indices mapping (datasets slices the table), so they are accepted,
    but their cache file holds all 10 rows: a Stream over them reads 10 rows, not the
    selection's, silently."""
    datasets = pytest.importorskip("datasets")
    from resumable_loader.adapters import arrow_reader, hf_cache_files

    datasets.Dataset.from_dict({"text": [str(i) for i in range(10)]}).save_to_disk(tmp_path)
    ds = datasets.load_from_disk(str(tmp_path))
    part = {"take": ds.take(3), "skip": ds.skip(3), "select_range": ds.select(range(3, 6))}[cut]
    want = sorted(part["text"])
    try:
        files = hf_cache_files(part)
    except ValueError:
        return  # refused with a clear error: also what the docs allow
    rows = list(Stream.from_shards(files, arrow_reader(["text"]), partitions=len(files)))
    assert sorted(r["text"] for r in rows) == want


def test_hf_cache_files_of_a_dataset_dict_gives_a_clear_error(tmp_path: Path) -> None:
    """Bad input gets a clear error naming what was wrong. ``hf_cache_files`` of a
    ``DatasetDict`` (what ``load_dataset`` returns without ``split=``) raises ``TypeError:
    string indices must be integers, not 'str'`` from inside the adapter."""
    datasets = pytest.importorskip("datasets")
    from resumable_loader.adapters import hf_cache_files

    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(tmp_path)
    dd = datasets.DatasetDict({"train": datasets.load_from_disk(str(tmp_path))})
    with pytest.raises((TypeError, ValueError)) as err:
        hf_cache_files(dd)
    assert "string indices" not in str(err.value)
    assert "DatasetDict" in str(err.value) or "split" in str(err.value)


def _keep_all(x: int) -> bool:
    return True


def _keep_even(x: int) -> bool:
    return x % 2 == 0


def test_a_changed_filter_before_a_shuffle_repeats_nothing_and_keeps_what_it_passes() -> None:
    """Promise (Shuffle, "Refused": "changing a map or filter function is still allowed"; "the
    rows after the resume are then those of the new function"). read -> filter -> shuffle(4),
    saved after 1 batch with a filter that keeps all, resumed with one that keeps even samples:
    2 samples delivered before the save are delivered again, and 3 even samples after the
    save point are never delivered (the half-used window is re-read through the new filter and
    emitted from its old ``taken``)."""
    shards = list(range(16))

    def make(keep: Any) -> Stream:
        return Stream.from_shards(shards, F.read, partitions=4).filter(keep).shuffle(4)

    def run(keep: Any, state: Any = None, stop: int | None = None) -> tuple[list[int], Any]:
        loader = DataLoader(make(keep), batch_size=3, num_workers=0, stream_tail=None)
        if state is not None:
            loader.load_state_dict(state)
        out: list[int] = []
        for n, b in enumerate(loader, 1):
            out += b.tolist()
            if n == stop:
                return out, load_state(dump_state(loader.state_dict()))
        return out, None

    head, state = run(_keep_all, stop=1)
    # Now refused at load: a filter before a shuffle decides which items fill its windows.
    with pytest.raises(CheckpointError, match=r"stream\.pipeline .*filter:_keep_all"):
        run(_keep_even, state=state)
    tail, _ = run(_keep_all, state=state)  # the checkpoint's pipeline resumes exactly
    assert head + tail == run(_keep_all)[0]
