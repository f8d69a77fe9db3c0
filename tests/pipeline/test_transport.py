"""The result channel (``transport.framing``, ``transport.reducers``): framed messages over a
socket, read by ``Receiver``."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def _round_trip(obj: Any) -> Any:
    """``obj`` sent through our transport over a socket pair, and received."""
    import socket

    from resumable_loader.pipeline.transport.framing import Receiver, send

    ours, theirs = socket.socketpair()
    recv = Receiver(ours)
    try:
        send(theirs, obj)
        (got,) = recv.feed()
    finally:
        theirs.close()
        recv.close()
    return got


def test_receiver_returns_messages_sent_just_before_the_sender_closed() -> None:
    import socket

    from resumable_loader.pipeline.transport.framing import Receiver, send

    ours, theirs = socket.socketpair()
    recv = Receiver(ours)
    try:
        send(theirs, ("last", "words"))
        send(theirs, ("and", torch.arange(3)))
        theirs.close()  # the worker exits right after sending
        msgs = recv.feed()
        assert recv.eof, "the closed end must be noticed"
        assert [m[0] for m in msgs] == ["last", "and"], "whole messages before EOF are kept"
        assert torch.equal(msgs[1][1], torch.arange(3))
        assert recv.feed() == [] and recv.eof
    finally:
        recv.close()


def test_a_message_over_4_gib_is_framed_with_its_full_length() -> None:
    """Issue #25 item 6: a batch copied inline over 4 GiB (a non-tensor batch, or one that
    found /dev/shm full) must be framed -- not fail with a struct.error that the worker then
    reports as a pickling failure. Checked on the frame itself, without 4 GiB of memory."""
    from resumable_loader.pipeline.transport import framing

    class FakePayload:
        """Only its length is read until the socket takes it."""

        def __len__(self) -> int:
            return 2**32 + 17

    class FakeSocket:
        def __init__(self) -> None:
            self.header = b""

        def sendmsg(self, buffers: list, anc: list = ()) -> int:  # type: ignore[assignment]
            self.header = bytes(buffers[0])
            return len(buffers[0]) + len(buffers[1])  # as if the kernel took it all

    sock = FakeSocket()
    framing._send_frame(sock, FakePayload(), 2**32 + 3, [], (7, 2**40))  # type: ignore[arg-type]
    # The receiver reads the header back with the same layout: every length intact.
    assert framing._HEADER.unpack_from(sock.header) == (2**32 + 17, 0, 2**32 + 3, 7, 2**40)


def test_small_tensors_arrive_exact_with_their_views_still_sharing_memory() -> None:
    """Small tensors travel as bytes + dtype + shape (issue #26, per-batch overhead): every
    kind arrives with the sender's values, dtype, shape and strides, and tensors that shared
    a storage in the batch still share one -- whether they took that path or torch's."""

    base = torch.arange(12, dtype=torch.int16).view(3, 4)
    sent = {
        "base": base,
        "flat": base.view(-1),  # the whole storage too: same bytes, memo'd once
        "row": base[1],  # an offset view: torch's path, over the same storage
        "t": base.t(),  # not contiguous: torch's path
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "bool": torch.tensor([True, False]),
        "half": torch.randn(2, 3).half(),
        "empty": torch.zeros(0, 5),
        "grad": torch.ones(3, requires_grad=True),
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    got = _round_trip(sent)
    for key, want in sent.items():
        have = got[key]
        assert type(have) is type(want), key
        assert have.dtype == want.dtype and have.shape == want.shape, key
        assert have.stride() == want.stride(), key
        assert have.requires_grad == want.requires_grad, key
        assert torch.equal(have.detach(), want.detach()), key
    storage = got["base"].untyped_storage().data_ptr()
    for key in ("flat", "row", "t"):
        assert got[key].untyped_storage().data_ptr() == storage, f"{key} no longer shares base"
    got["base"][1, 0] = 99
    assert got["flat"][4] == 99 and got["row"][0] == 99 and got["t"][0, 1] == 99
    # A tensor that was no view is none on arrival either (rebuilt in place to its shape).
    for key in ("scalar", "bool", "half"):
        assert got[key]._base is None, f"{key} arrived as a view"


def test_conjugate_and_negative_views_arrive_with_their_values() -> None:
    """torch's tensor reduction drops the lazy conjugate and negative bits, so ``z.conj()``
    arrived as ``z`` (torch's own loader does the same). Ours sets the bit again on arrival:
    the values are the sender's, small (bytes path) or large (shared memory), and the view
    still shares its base's storage."""

    small = torch.tensor([1 + 2j, -3 + 0.5j], dtype=torch.complex64)
    large = torch.full((40_000,), 2 - 5j, dtype=torch.complex128)
    sent = {
        "small": small,
        "small_conj": small.conj(),
        "large_conj": large.conj(),
        "neg": small.conj().imag,  # a real view with the negative bit set
        "large_neg": large.conj().imag,
    }
    assert sent["small_conj"].is_conj() and sent["neg"].is_neg()
    got = _round_trip(sent)
    for key, want in sent.items():
        have = got[key]
        assert have.dtype == want.dtype and have.shape == want.shape, key
        plain = have.resolve_conj().resolve_neg()
        assert torch.equal(plain, want.resolve_conj().resolve_neg()), key
    got["small"][0] = 7 + 7j
    assert got["small_conj"][0] == 7 - 7j, "the conjugate view no longer shares its base"


def test_feed_without_drain_reads_once_per_message_and_loses_nothing(monkeypatch) -> None:
    """Issue #26: a live worker's socket is read until a short read, not until EAGAIN (the
    extra read cost a syscall and an exception per small batch). What one read leaves
    behind comes with the next call; ``drain=True`` still reads to the end."""
    import socket

    from resumable_loader.pipeline.transport import framing
    from resumable_loader.pipeline.transport.framing import Receiver, send

    ours, theirs = socket.socketpair()
    recv = Receiver(ours)
    reads = []
    real = socket.socket.recvmsg

    class CountingSocket(socket.socket):
        def recvmsg(self, *args):  # type: ignore[override]
            reads.append(1)
            return real(self, *args)

    recv.sock = CountingSocket(fileno=socket.dup(ours.fileno()))
    recv.sock.setblocking(False)
    try:
        for i in range(3):
            send(theirs, ("batch", i, torch.tensor([i])))
            (msg,) = recv.feed(drain=False)
            assert msg[:2] == ("batch", i) and torch.equal(msg[2], torch.tensor([i]))
        assert len(reads) == 3, "one read per message: no read that only finds nothing"
        # A message larger than one read: the rest arrives with the calls that follow.
        big = bytes(range(256)) * (framing._READ_CHUNK // 128)
        send(theirs, ("big", big))
        send(theirs, ("after", 1))
        got = []
        for _ in range(10):
            got += recv.feed(drain=False)
            if len(got) == 2:
                break
        assert got == [("big", big), ("after", 1)]
        theirs.close()
        assert recv.feed(drain=True) == [] and recv.eof
    finally:
        recv.sock.close()
        recv.sock = ours
        recv.close()
        theirs.close()


def test_a_result_travels_as_a_plain_tuple_and_comes_back_the_same() -> None:
    """Issue #26: a Result goes on the wire as a plain tuple with an int status (cheaper to
    pickle than a named tuple and an enum member) and is rebuilt exactly."""
    import pickle

    from resumable_loader.pipeline.protocol import Result, Status, result_from_wire, result_to_wire

    for status in Status:
        msg = Result(3, 17, status, {"x": [1, 2]}, {"k": b"v"}, 2, True)
        wire = result_to_wire(msg)
        assert type(wire) is tuple and type(wire[2]) is int
        back = result_from_wire(pickle.loads(pickle.dumps(wire)))
        assert back == msg and type(back) is Result
        assert type(back.status) is Status and back.status is status


# ---- identity: storages that start at one address (issue #31 item 3) ------------------------
class _OneArray(torch.utils.data.Dataset):
    """Sample i: tensors cut from one numpy array, as a language-model dataset cuts its inputs
    and labels from one token array. Several storages start at one address, or overlap."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        import numpy as np

        a = np.arange(self.n, dtype=np.int64) * 3 + i
        whole = torch.from_numpy(a)
        return {
            "inputs": torch.from_numpy(a[:-1]),  # starts where "ids" does, and comes first
            "ids": whole,
            "labels": torch.from_numpy(a[1:]),  # its tail: another start, overlapping
            "again": torch.from_numpy(a),  # the same bytes, another storage
            "middle": torch.from_numpy(a[2:-2]),
            "head": whole[:-1],  # views of one storage ("ids"'s): they share it in torch too
            "tail": whole[1:],
        }


def _list_collate(samples: list[Any]) -> list[Any]:
    return list(samples)


def _tensors(obj: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a batch, by its path."""
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(_tensors(value, f"{path}/{key}"))
    return out


def _sharing(batch: Any) -> set[tuple[str, str]]:
    """The pairs of tensors whose storages overlap in memory: what writing into one changes."""
    found = _tensors(batch)
    spans = {}
    for path, t in found.items():
        start = t.untyped_storage().data_ptr()
        spans[path] = (start, start + t.untyped_storage().nbytes())
    names = sorted(spans)
    return {
        (a, b)
        for k, a in enumerate(names)
        for b in names[k + 1 :]
        if spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
    }


def _same_arrival(ours: list[Any], theirs: list[Any]) -> None:
    from resumable_loader.testing import canonical

    assert len(ours) == len(theirs)
    for k, (mine, ref) in enumerate(zip(ours, theirs)):
        assert canonical(mine) == canonical(ref), f"batch {k}: other values than torch's"
        assert _sharing(mine) == _sharing(ref), f"batch {k}: other sharing than torch's"


@pytest.mark.parametrize("n", [16, 8192], ids=["small", "over-32KiB"])
@pytest.mark.parametrize("how", ["batch_size=None", "list_collate", "default_collate"])
def test_storages_that_start_at_one_address_arrive_as_torchs_loader_delivers_them(
    n: int, how: str
) -> None:
    """Issue #31 item 3: storages were told apart by their address alone, so the shorter of
    ``from_numpy(a)`` and ``from_numpy(a[:-1])`` arrived with the other's length and values
    (small), or the batch could not be rebuilt at all (over 32 KiB: "Trying to resize storage
    that is not resizable"), and the worker was killed for it. Each must arrive with torch's
    values, and share memory on arrival exactly where torch's loader's batch does."""
    from _datasets import collect_torch_reference_garbage
    from torch.utils.data import DataLoader as TorchLoader

    from resumable_loader import DataLoader

    kw: dict[str, Any] = {"batch_size": None}
    if how != "batch_size=None":
        kw = {"batch_size": 2}
        if how == "list_collate":
            kw["collate_fn"] = _list_collate
    common = dict(num_workers=2, multiprocessing_context="fork", pin_memory=False, **kw)
    theirs = list(TorchLoader(_OneArray(n), **common))
    collect_torch_reference_garbage()
    with DataLoader(_OneArray(n), **common) as loader:
        ours = list(loader)
    if how == "batch_size=None":
        # The reference checked too: torch's batches are the samples as the dataset makes them.
        from resumable_loader.testing import canonical

        direct = [_OneArray(n)[i] for i in range(4)]
        assert [canonical(b) for b in theirs] == [canonical(b) for b in direct]
    _same_arrival(ours, theirs)


@pytest.mark.parametrize("n", [16, 8192, 40_000], ids=["small", "solo-fds", "packed"])
def test_the_transport_keeps_storages_apart_by_identity_not_address(n: int) -> None:
    """The transport alone, without shared memory in the sender (each large storage is shared
    at send): storages that start at one address, overlap, or lie over the same bytes arrive
    each with its own values, as distinct copies; the views of one storage still share it.
    ``n=40_000`` has more large storages than ``MAX_FDS_PER_MSG``: they are packed into one
    segment, which must not merge them either."""
    import numpy as np

    from resumable_loader.pipeline.transport import reducers

    a = np.arange(n, dtype=np.int64) * 7
    whole = torch.from_numpy(a)
    sent: dict[str, Any] = {
        "short": torch.from_numpy(a[:-3]),
        "whole": whole,
        "view": whole[: n // 2],  # whole's own storage, through torch's path
    }
    if n == 40_000:
        # Five distinct storages over the same bytes or their start: more than one fd each.
        sent.update({f"cut{k}": torch.from_numpy(a[: n - k]) for k in range(1, 4)})
        assert len(sent) - 1 > reducers.MAX_FDS_PER_MSG
    want = {k: v.clone() for k, v in sent.items()}
    got = _round_trip(sent)
    for key, value in want.items():
        assert got[key].shape == value.shape, key
        assert torch.equal(got[key], value), key
    shared = _sharing(got)
    assert shared == {("/view", "/whole")}, f"only the views of one storage share: {shared}"


# ---- a result that cannot be rebuilt in the main process (issue #31 item 3) ------------------
class _RefusedHere:
    """Rebuilt by a function that raises outside DataLoader workers: a value the main process
    cannot unpickle (as a class it cannot import would be), though the worker made it fine."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> Any:
        return (_rebuild_refused_here, (self.value,))


def _rebuild_refused_here(value: int) -> Any:
    if torch.utils.data.get_worker_info() is None:
        raise ValueError(f"value {value} cannot be rebuilt in this process")
    return _RefusedHere(value)


def test_a_message_that_cannot_be_rebuilt_comes_back_as_undecodable_between_the_others() -> None:
    """The transport alone: a message that arrives whole but cannot be unpickled is returned
    in its place as ``Undecodable`` with the tag it was sent with and the error; the messages
    around it (with fds of their own) arrive as they were, and its fds are closed (the leak
    check after the test)."""
    import socket

    from resumable_loader.pipeline.transport.framing import Receiver, Undecodable, send

    big = torch.arange(20_000, dtype=torch.int64)  # travels on an fd
    ours, theirs = socket.socketpair()
    recv = Receiver(ours)
    try:
        send(theirs, ("before", big))
        send(theirs, ("bad", big * 2, _RefusedHere(3)), tag=(4, 11))
        send(theirs, ("after", big * 3), tag=(4, 12))
        got = recv.feed()
    finally:
        theirs.close()
        recv.close()
    assert [type(m).__name__ for m in got] == ["tuple", "Undecodable", "tuple"], got
    assert got[0][0] == "before" and torch.equal(got[0][1], big)
    assert got[2][0] == "after" and torch.equal(got[2][1], big * 3)
    lost = got[1]
    assert isinstance(lost, Undecodable) and (lost.gen, lost.tid) == (4, 11)
    assert isinstance(lost.error, ValueError) and "value 3" in str(lost.error)


def test_a_read_that_fails_after_whole_messages_returns_them_first(monkeypatch) -> None:
    """A read that fails (fds dropped by the kernel: the channel is broken) must not take the
    messages completed before it in the same ``feed`` with it: a worker's READY among them
    decides whether its death counts as a failed start. They are returned; the error is kept
    in ``failure`` and raised by the next call."""
    import socket

    from resumable_loader.pipeline.transport import policy
    from resumable_loader.pipeline.transport.framing import Receiver, send

    ours, theirs = socket.socketpair()
    recv = Receiver(ours)
    real = Receiver._recv
    calls = [0]

    def then_fail(self: Receiver) -> bool:
        calls[0] += 1
        if calls[0] == 1:
            return real(self)
        raise policy.FdLimitError("cut short")

    monkeypatch.setattr(Receiver, "_recv", then_fail)
    try:
        send(theirs, ("ready", 1))
        assert recv.feed() == [("ready", 1)]
        assert isinstance(recv.failure, policy.FdLimitError)
        with pytest.raises(policy.FdLimitError, match="cut short"):
            recv.feed()
        assert recv.failure is None
    finally:
        theirs.close()
        recv.close()


class _OneRefused(torch.utils.data.Dataset):
    """Sample i is i, except sample ``bad``, which the main process cannot rebuild."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Any:
        return {"x": torch.full((3,), i), "extra": _RefusedHere(i) if i == self.bad else i}


def test_a_result_the_main_process_cannot_rebuild_names_its_task_and_kills_no_worker() -> None:
    """Issue #31 item 3: a result the main process could not unpickle was taken for a broken
    worker: killed and respawned with every try, its READY lost with the result (read in the
    same go), so that it ended in "failed to start 3 times ... Fix worker_init_fn" -- blaming a
    healthy worker's start-up for a sample. Now the error comes at that batch's position and
    names the task, its samples and the worker; no worker is killed, and the other batches
    come as the uninterrupted run's (the iterator goes on, as after a dataset's exception)."""
    from resumable_loader import DataLoader, WorkerCrashError
    from resumable_loader.testing import canonical

    def make(bad: int) -> DataLoader:
        return DataLoader(
            _OneRefused(bad),
            batch_size=2,
            collate_fn=_list_collate,
            num_workers=2,
            multiprocessing_context="fork",
        )

    # The reference: the same loader over a dataset with no such sample.
    with make(bad=-1) as loader:
        reference = [canonical(b) for b in loader]
    got: list[Any] = []
    errors: list[WorkerCrashError] = []
    with make(bad=1) as loader:  # in worker 0's first batch, the one sent with its READY
        it = iter(loader)
        pids = {loader.statistics().worker_pids}
        while True:
            try:
                got.append(canonical(next(it)))
            except StopIteration:
                break
            except WorkerCrashError as exc:
                errors.append(exc)
                got.append("error")
            if len(got) < len(reference):  # (the last batch ends the epoch: workers stop)
                pids.add(loader.statistics().worker_pids)
        stats = loader.statistics()
    assert len(errors) == 1, errors
    err = errors[0]
    text = str(err)
    assert "samples [0, 1] (task 0)" in text and "worker 0 (pid" in text, text
    assert "could not rebuild" in text and "_rebuild_refused_here" in text, text
    assert "batch's own code" in text and "bug in resumable_loader" not in text, text
    assert "failed to start" not in text and "worker_init_fn" not in text, text
    assert err.task_id == 0 and err.indices == [0, 1]
    assert isinstance(err.__cause__, ValueError) and "value 1" in str(err.__cause__)
    assert got == ["error", *reference[1:]]
    assert stats.respawns == 0 and len(pids) == 1, (stats, pids)


class _StreamOneRefused(torch.utils.data.IterableDataset):
    """Worker w's shard: the items i < 10 with i % 2 == w; item ``bad`` cannot be rebuilt in
    the main process."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        wid, n = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, 10, n):
            yield (i, _RefusedHere(i)) if i == self.bad else (i, None)


def test_a_stream_result_that_cannot_be_rebuilt_ends_that_shard_and_kills_no_worker() -> None:
    """A stream's result also carries its shard's state, so the shard cannot go on past one
    that was lost: the error comes at its position, naming the worker's stream batch, that
    worker's stream ends there for the epoch (its prefetched batches are not delivered), the
    other worker's batches all come, and no worker is killed."""
    from resumable_loader import DataLoader, WorkerCrashError

    got: list[Any] = []
    errors: list[WorkerCrashError] = []
    with DataLoader(
        _StreamOneRefused(bad=4), batch_size=None, num_workers=2, multiprocessing_context="fork"
    ) as loader:
        it = iter(loader)
        while True:
            try:
                got.append(next(it)[0])
            except StopIteration:
                break
            except WorkerCrashError as exc:
                errors.append(exc)
                got.append("error")
        stats = loader.statistics()
    # Worker 0's shard is 0 2 4 6 8; worker 1's 1 3 5 7 9, in turns.
    assert got == [0, 1, 2, 3, "error", 5, 7, 9], got
    (err,) = errors
    assert "stream batch 2 of worker 0" in str(err) and "stream ends here" in str(err), err
    assert "failed to start" not in str(err) and isinstance(err.__cause__, ValueError)
    assert stats.respawns == 0, stats


class _BadBytesForOurRebuild:
    """Reduced to our own small-tensor rebuild with bytes that do not fit its dtype: the main
    process fails inside the loader's code, as it did for issue #31's mixed-up storages."""

    def __reduce__(self) -> Any:
        from resumable_loader.pipeline.transport import reducers

        return (reducers._rebuild_small_tensor, (bytearray(3), torch.int64, (1,)))


class _BadBytesForOurStateCodec:
    """Reduced to a function of the package outside the transport (the state codec) that
    refuses its bytes: a failure in any of the loader's modules is the loader's, not the
    batch's."""

    def __reduce__(self) -> Any:
        from resumable_loader.state.codec import load_state

        return (load_state, (b"not a state",))


def _class_from_a_module_the_receiver_lacks() -> Any:
    """An instance of a class whose module exists while it is pickled, then is gone -- as a
    class defined in a module only the workers import."""
    import sys
    import types

    module = types.ModuleType("_only_in_workers")
    exec("class OnlyInWorkers:\n    pass\n", module.__dict__)
    sys.modules["_only_in_workers"] = module
    return module.OnlyInWorkers()


@pytest.mark.parametrize(
    "case", ["batch's code", "missing class", "our rebuild", "our other module"]
)
def test_an_undecodable_message_says_whose_failure_it_most_likely_is(case: str) -> None:
    """ "Our bug or the sample's; say which": read from where unpickling failed -- in code of
    the batch's own, in finding a class the main process lacks, or inside the loader's own
    rebuilding of tensors."""
    import socket
    import sys

    from resumable_loader.pipeline.transport.framing import Receiver, Undecodable, send

    ours, theirs = socket.socketpair()
    recv = Receiver(ours)
    try:
        if case == "batch's code":
            send(theirs, ("batch", _RefusedHere(1)), tag=(0, 5))
        elif case == "missing class":
            send(theirs, ("batch", _class_from_a_module_the_receiver_lacks()), tag=(0, 5))
            del sys.modules["_only_in_workers"]
        elif case == "our rebuild":
            send(theirs, ("batch", _BadBytesForOurRebuild()), tag=(0, 5))
        else:
            send(theirs, ("batch", _BadBytesForOurStateCodec()), tag=(0, 5))
        (lost,) = recv.feed()
    finally:
        sys.modules.pop("_only_in_workers", None)
        theirs.close()
        recv.close()
    assert isinstance(lost, Undecodable) and lost.tid == 5, lost
    if case == "batch's code":
        assert "batch's own code" in lost.blame and "_rebuild_refused_here" in lost.blame
        assert "test_transport.py" in lost.blame, lost.blame
    elif case == "missing class":
        assert isinstance(lost.error, (ImportError, AttributeError)), lost.error
        assert "cannot import" in lost.blame, lost.blame
    else:
        assert "bug in resumable_loader" in lost.blame and "report" in lost.blame, lost.blame
    assert "batch's own code" not in lost.blame or case == "batch's code"
