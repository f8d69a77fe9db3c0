"""``Stream.pack`` alone (no loader; ``iter()`` as torch's loader drives it with
``num_workers=0``): rows of exactly ``seq_len`` tokens, every token of every document in
exactly one row or in a counted drop, the companions, the counters at every state, and an
exact resume at any row -- over Hypothesis-drawn document lengths, ``seq_len``, mode, window
and partitions. Tokens encode (document, offset) (``tests/_token_shards.py``), so each check is
computed from the fixture, never from the packer's own output."""

from __future__ import annotations

import itertools
import os
from collections import Counter
from typing import Any

import _token_shards as T
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_loader import CheckpointError, Stream, dump_state, load_state, pack_collate
from resumable_loader.plans import stream_pack as K
from resumable_loader.plans import streams as S

PAD = -1  # no token is negative: padding is told apart without the packer's own segment_ids


def _stream(docs: T.Docs, partitions: int, seq_len: int, **kw: Any) -> Stream:
    kw.setdefault("pad_id", PAD)
    return Stream.from_shards(docs.shards, docs, partitions=partitions).pack(seq_len, **kw)


def _run(s: Stream, stop: int | None = None) -> tuple[list[dict[str, np.ndarray]], list[Any]]:
    """Rows (all, or ``stop`` of them) and the state after each row."""
    rows, states = [], []
    for row in s:
        rows.append(row)
        states.append(s.state_dict())
        if len(rows) == stop:
            break
    return rows, states


def _partition_docs(docs: T.Docs, partitions: int) -> dict[int, list[tuple[int, int]]]:
    """Each partition's documents as (id, length), in reading order (pass 0)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for p, shards in enumerate(S.deal(0, 0, len(docs.lengths), partitions, True)):
        out[p] = [(T.doc_id(s, i), n) for s in shards for i, n in enumerate(docs.lengths[s])]
    return out


def _used(row: dict[str, np.ndarray]) -> np.ndarray:
    ids = row["input_ids"]
    n = int((ids != PAD).sum())
    assert (ids[:n] != PAD).all() and (ids[n:] == PAD).all(), "padding only at the row's end"
    return ids[:n]


def _check_companions(row: dict[str, np.ndarray], seq_len: int) -> None:
    """The companions, computed from the tokens: a segment is a run of consecutive offsets of
    one document."""
    ids = row["input_ids"]
    for f in ("input_ids", "position_ids", "segment_ids", "labels"):
        assert row[f].shape == (seq_len,) and row[f].dtype == np.int64, f
    used = _used(row)
    pos, seg, labels = [], [], []
    k = 0
    for i, tok in enumerate(used.tolist()):
        start = i == 0 or tok != int(used[i - 1]) + 1
        k += start
        pos.append(0 if start else pos[-1] + 1)
        seg.append(k)
        labels.append(-100 if start else tok)
    pad = seq_len - len(used)
    assert row["position_ids"].tolist() == pos + list(range(pad))
    assert row["segment_ids"].tolist() == seg + [0] * pad
    assert row["labels"].tolist() == labels + [-100] * pad
    assert ids.tolist()[len(used) :] == [PAD] * pad


def _segments(row: dict[str, np.ndarray]) -> list[tuple[int, int, int]]:
    """(document, first offset, length) of each segment of a row."""
    out: list[tuple[int, int, int]] = []
    for tok in _used(row).tolist():
        d, o = T.doc_of(tok), T.offset_of(tok)
        if out and out[-1][0] == d and out[-1][1] + out[-1][2] == o:
            out[-1] = (d, out[-1][1], out[-1][2] + 1)
        else:
            out.append((d, o, 1))
    return out


def _by_partition(rows: list[dict[str, np.ndarray]], docs: T.Docs, partitions: int) -> dict:
    where = {d: p for p, ds in _partition_docs(docs, partitions).items() for d, _ in ds}
    out: dict[int, list[dict[str, np.ndarray]]] = {}
    for row in rows:
        used = _used(row)
        assert len(used), "no row is all padding"
        parts = {where[T.doc_of(t)] for t in used.tolist()}
        assert len(parts) == 1, "a row holds one partition's documents"
        out.setdefault(parts.pop(), []).append(row)
    return out


def _counters(cursor: list[int], fields: tuple[str, ...]) -> dict[str, int]:
    return {f: cursor[fields.index(f)] for f in K.COUNTER_FIELDS}


def _check_states(states: list[Any], fields: tuple[str, ...], seq_len: int) -> None:
    """The counter invariant in every state: tokens_in == tokens_out + dropped + carry_left,
    and the delivered rows hold tokens_out + pad tokens."""
    for state in states:
        for p, c in state.items():
            if p == "stream":
                continue
            n = _counters(c, fields)
            assert n["tokens_in"] == n["tokens_out"] + n["dropped"] + n["carry_left"], (p, n)
            assert n["tokens_out"] + n["pad"] == c[S.ROWS] * seq_len, (p, n)


_LENGTHS = st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=6), min_size=1, max_size=6)


@given(
    lengths=_LENGTHS,
    seq_len=st.integers(1, 24),
    data=st.data(),
    tail=st.sampled_from(["pad", "drop"]),
)
@settings(max_examples=80, deadline=None)
def test_concat_rows_are_the_documents_concatenated_and_resume_exactly(
    lengths: list[list[int]], seq_len: int, data: Any, tail: str
) -> None:
    docs = T.Docs(lengths)
    partitions = data.draw(st.integers(1, len(lengths)), "partitions")
    s = _stream(docs, partitions, seq_len, tail=tail)
    rows, states = _run(s)
    fields = s.cursor_fields()
    _check_states(states, fields, seq_len)
    final = s.state_dict()
    per_part = _by_partition(rows, docs, partitions)
    for p, pdocs in _partition_docs(docs, partitions).items():
        expected = [T.token(d, o) for d, n in pdocs for o in range(n)]
        prows = per_part.get(p, [])
        got = [t for row in prows for t in _used(row).tolist()]
        total = len(expected)
        if tail == "pad":
            assert got == expected, p
            # Rows are full but for the pass's last one.
            assert all(len(_used(r)) == seq_len for r in prows[:-1])
        else:
            assert got == expected[: len(got)] and len(got) == total - total % seq_len, p
            assert all(len(_used(r)) == seq_len for r in prows)
        for row in prows:
            _check_companions(row, seq_len)
        # The pass's end: everything pulled is accounted for.
        n = _counters(final[p], fields)
        assert n["tokens_in"] == total and n["docs"] == len(pdocs), p
        assert n["carry_left"] == 0
        assert n["dropped"] == (total % seq_len if tail == "drop" else 0)
        assert n["pad"] == (-total % seq_len if tail == "pad" else 0)
    # A resume at any row continues exactly (through the codec).
    k = data.draw(st.integers(0, len(rows)), "k")
    state = load_state(dump_state(states[k - 1])) if k else None
    t = _stream(docs, partitions, seq_len, tail=tail)
    if state is not None:
        t.load_state_dict(state)
    rest, _ = _run(t)
    assert len(rows[:k] + rest) == len(rows)
    for a, b in zip(rows[:k] + rest, rows):
        for f in a:
            assert np.array_equal(a[f], b[f]), f


@given(
    lengths=_LENGTHS,
    seq_len=st.integers(1, 24),
    window=st.integers(1, 6),
    long=st.sampled_from(["split", "drop"]),
    data=st.data(),
)
@settings(max_examples=80, deadline=None)
def test_best_fit_places_each_document_or_piece_once_and_resumes_exactly(
    lengths: list[list[int]], seq_len: int, window: int, long: str, data: Any
) -> None:
    docs = T.Docs(lengths)
    partitions = data.draw(st.integers(1, len(lengths)), "partitions")
    s = _stream(docs, partitions, seq_len, mode="best_fit", window=window, long=long)
    rows, states = _run(s)
    fields = s.cursor_fields()
    _check_states(states, fields, seq_len)
    final = s.state_dict()
    per_part = _by_partition(rows, docs, partitions)
    for p, pdocs in _partition_docs(docs, partitions).items():
        kept = {d: n for d, n in pdocs if n and (long == "split" or n <= seq_len)}
        # Each piece: a document cut at multiples of seq_len, once, contiguous, in one row.
        expected = Counter(
            (d, o, min(seq_len, n - o)) for d, n in kept.items() for o in range(0, n, seq_len)
        )
        prows = per_part.get(p, [])
        got = Counter(seg for row in prows for seg in _segments(row))
        assert got == expected, p
        for row in prows:
            _check_companions(row, seq_len)
        n = _counters(final[p], fields)
        assert n["tokens_in"] == sum(n for _, n in pdocs) and n["docs"] == len(pdocs)
        assert n["dropped"] == sum(n for _, n in pdocs if n > seq_len and long == "drop")
        assert n["carry_left"] == 0
    k = data.draw(st.integers(0, len(rows)), "k")
    t = _stream(docs, partitions, seq_len, mode="best_fit", window=window, long=long)
    if k:
        t.load_state_dict(load_state(dump_state(states[k - 1])))
    rest, _ = _run(t)
    assert len(rows[:k] + rest) == len(rows)
    for a, b in zip(rows[:k] + rest, rows):
        for f in a:
            assert np.array_equal(a[f], b[f]), f


@given(
    lengths=st.lists(st.integers(1, 20), min_size=0, max_size=30),
    seq_len=st.integers(1, 20),
)
@settings(max_examples=100, deadline=None)
def test_best_fit_bins_are_best_fit_decreasing(lengths: list[int], seq_len: int) -> None:
    """Checked against a direct transcription of the rule: longest first (ties: earlier), into
    the open bin with the least room that fits (ties: earlier bin), else a new bin."""
    lengths = [min(n, seq_len) for n in lengths]
    bins = K.best_fit_bins(lengths, seq_len)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= seq_len for b in bins)
    ref: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [
            (seq_len - sum(lengths[j] for j in b), k)
            for k, b in enumerate(ref)
            if seq_len - sum(lengths[j] for j in b) >= lengths[i]
        ]
        if fits:
            ref[min(fits)[1]].append(i)
        else:
            ref.append([i])
    assert bins == [sorted(b) for b in ref]


def test_best_fit_a_worked_window() -> None:
    # seq_len 10: 7 opens bin 0, 6 opens bin 1, 4 goes to bin 1 (room 4, the least that fits),
    # 3 to bin 0 (room 3), 2 opens bin 2.
    assert K.best_fit_bins([3, 7, 2, 6, 4], 10) == [[0, 1], [3, 4], [2]]


def test_a_concat_resume_reads_only_the_documents_it_then_delivers(tmp_path: Any) -> None:
    """The carry is a position: a resume re-reads the split document (whose rest it delivers)
    and nothing before it."""
    lengths = [[5, 9, 13, 2, 7], [11, 3, 8], [6, 6, 6, 6], [17, 1]]
    log = str(tmp_path / "reads")
    ref, states = _run(_stream(T.Docs(lengths), 2, 8))
    for k in range(1, len(ref)):
        if os.path.exists(log):
            os.unlink(log)
        t = _stream(T.Counted(lengths, log), 2, 8)
        t.load_state_dict(states[k - 1])
        rest, _ = _run(t)
        read = sorted(T.doc_id(s, i) for s, i in T.reads(log))
        delivered = sorted({T.doc_of(x) for r in rest for x in _used(r).tolist()})
        assert read == delivered, k


def test_a_best_fit_resume_reads_at_most_its_window_again(tmp_path: Any) -> None:
    docs = T.seeded(4, 12, 10, seed=3)
    log = str(tmp_path / "reads")
    window = 5
    ref, states = _run(_stream(docs, 1, 16, mode="best_fit", window=window))
    total = sum(len(x) for x in docs.lengths)
    again = []
    for k in range(1, len(ref)):
        if os.path.exists(log):
            os.unlink(log)
        t = _stream(T.Counted(docs.lengths, log), 1, 16, mode="best_fit", window=window)
        t.load_state_dict(states[k - 1])
        _run(t)
        cursor = dict(zip(t.cursor_fields(), states[k - 1][0]))
        # It reads from the window's start: the documents pulled before the state, after
        # that start, are read twice -- at most a window of them.
        assert len(T.reads(log)) == total - cursor["src"]
        again.append(cursor["docs"] - cursor["src"])
    assert max(again) <= window and max(again) > 0


def test_concat_may_resume_with_another_seq_len_every_token_once() -> None:
    docs = T.seeded(3, 6, 20, seed=5)
    head, states = _run(_stream(docs, 1, 16), stop=4)
    t = _stream(docs, 1, 24)
    t.load_state_dict(states[-1])
    rest, _ = _run(t)
    got = [x for r in head + rest for x in _used(r).tolist()]
    assert got == [T.token(d, o) for d, n in _partition_docs(docs, 1)[0] for o in range(n)]
    assert {len(r["input_ids"]) for r in rest} == {24}


def test_a_best_fit_state_under_another_window_or_seq_len_is_refused() -> None:
    docs = T.seeded(3, 6, 20, seed=5)
    _, states = _run(_stream(docs, 1, 16, mode="best_fit", window=4), stop=3)
    for kw in ({"window": 8}, {"mode": "concat"}):
        t = _stream(docs, 1, 16, **{"mode": "best_fit", "window": 4, **kw})
        with pytest.raises(CheckpointError, match="another pipeline"):
            t.load_state_dict(states[-1])
    t = _stream(docs, 1, 12, mode="best_fit", window=4)
    with pytest.raises(CheckpointError, match=r"fit_rows\(seq_len=16,window=4,long=split\)"):
        t.load_state_dict(states[-1])


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_data_changed_under_a_saved_carry_is_an_error_not_a_silent_loss(mode: str) -> None:
    lengths = [[30, 30, 30]]
    _, states = _run(_stream(T.Docs(lengths), 1, 16, mode=mode, window=3), stop=1)
    # The document the saved position is inside is one token longer now.
    t = _stream(T.Docs([[31, 30, 30]]), 1, 16, mode=mode, window=3)
    t.load_state_dict(states[-1])
    with pytest.raises(RuntimeError, match="data under the stream changed"):
        next(iter(t))


def test_the_default_rows_collate_with_torch_and_the_key_may_be_none() -> None:
    docs = T.seeded(2, 8, 12, seed=2)
    plain = Stream.from_shards(docs.shards, docs, partitions=1).map(_ids).pack(10, key=None)
    loader = torch.utils.data.DataLoader(plain, batch_size=4)
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "position_ids", "segment_ids", "labels"}
    assert all(v.shape == (4, 10) and v.dtype == torch.int64 for v in batch.values())
    keyed = Stream.from_shards(docs.shards, docs, partitions=1).pack(10)
    assert all(
        np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(list(plain), list(keyed))
    )


def _ids(doc: dict[str, Any]) -> list[int]:
    return doc["input_ids"].tolist()


@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=20),
    seq_len=st.integers(1, 16),
    batch=st.integers(1, 5),
    mode=st.sampled_from(["concat", "best_fit"]),
)
@settings(max_examples=40, deadline=None)
def test_pack_collate_cu_seqlens_agree_with_the_segments(
    lengths: list[int], seq_len: int, batch: int, mode: str
) -> None:
    rows, _ = _run(_stream(T.Docs([lengths]), 1, seq_len, mode=mode, window=4), stop=batch)
    if not rows:
        return
    flat = pack_collate(rows)
    n = len(rows) * seq_len
    for f in ("input_ids", "position_ids", "labels", "segment_ids"):
        assert flat[f].shape == (1, n)
        assert flat[f][0].tolist() == [x for r in rows for x in r[f].tolist()]
    # Segments: each row's segments, then its padding as one more.
    bounds = [0]
    for r in rows:
        for _, _, length in _segments(r):
            bounds.append(bounds[-1] + length)
        if bounds[-1] % seq_len:
            bounds.append(bounds[-1] + seq_len - bounds[-1] % seq_len)
    assert flat["cu_seqlens"].dtype == torch.int32
    assert flat["cu_seqlens"].tolist() == bounds
    assert flat["max_seqlen"] == max(b - a for a, b in itertools.pairwise(bounds))


def test_pack_collate_refusals() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        pack_collate([])
    with pytest.raises(ValueError, match="lacks 'position_ids'"):
        pack_collate([{"input_ids": np.zeros(4, dtype=np.int64)}])


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [
        ({"seq_len": 0}, ValueError, r"seq_len=...\) must be an int >= 1"),
        ({"mode": "greedy"}, ValueError, r"mode=...\) must be one of"),
        ({"window": 0}, ValueError, r"window=...\) must be an int >= 1"),
        ({"pad_id": 0.5}, TypeError, r"pad_id"),
        ({"key": 3}, TypeError, r"key=...\) must be a str"),
        ({"long": "truncate"}, ValueError, r"long=...\) must be one of"),
        ({"tail": "carry"}, ValueError, r"tail=...\) must be one of"),
    ],
)
def test_pack_argument_refusals(kw: dict[str, Any], err: type, match: str) -> None:
    docs = T.Docs([[3]])
    args = {"seq_len": 8, **kw}
    with pytest.raises(err, match=match):
        Stream.from_shards(docs.shards, docs).pack(args.pop("seq_len"), **args)


def test_an_item_that_is_not_a_token_sequence_is_refused_naming_the_key() -> None:
    s = Stream.from_shards([0], T.Docs([[3]])).map(_floats).pack(8)
    with pytest.raises(ValueError, match=r"'input_ids' must be a 1-D sequence of int tokens"):
        list(s)


def _floats(doc: dict[str, Any]) -> dict[str, Any]:
    return {"input_ids": doc["input_ids"] * 0.5}


def test_the_pipeline_and_the_fields_name_the_packer() -> None:
    s = _stream(T.Docs([[3]]), 1, 8, mode="best_fit", window=4)
    assert s.pipeline() == ["read", "pack:best_fit(seq_len=8,window=4,long=split)"]
    assert s.cursor_fields()[-7:] == (
        "fit_rows(seq_len=8,window=4,long=split)",
        *K.COUNTER_FIELDS,
    )


def _short(doc: dict[str, Any]) -> bool:
    return len(doc["input_ids"]) < 25


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_a_filter_before_pack_counts_only_the_documents_it_passes(mode: str) -> None:
    docs = T.seeded(6, 8, 20, seed=11)
    s = (
        Stream.from_shards(docs.shards, docs, partitions=2)
        .filter(_short)
        .pack(16, mode=mode, window=4, pad_id=PAD)
    )
    rows, states = _run(s)
    fields = s.cursor_fields()
    _check_states(states, fields, 16)
    final = s.state_dict()
    for p, pdocs in _partition_docs(docs, 2).items():
        kept = [(d, n) for d, n in pdocs if n < 25]
        c = dict(zip(fields, final[p]))
        assert c["tokens_in"] == sum(n for _, n in kept) and c["docs"] == len(kept)
        assert c["filtered"] == len(pdocs) - len(kept) > 0
    got = sorted(t for r in rows for t in _used(r).tolist())
    assert got == sorted(
        T.token(d, o) for d, n in docs.doc_lengths().items() if n < 25 for o in range(n)
    )
