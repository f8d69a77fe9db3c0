"""What the main process and a worker say to each other, and what a result's status means.

Every message is a named tuple of this module (picklable by reference: workers under spawn and
forkserver import it too), sent over the worker's two pipes -- the two sent once per batch as
plain tuples (``TaskMsg``: see ``transport.taskpipe``; ``Result``: ``result_to_wire``),
cheaper to pickle:

    main ──(Epoch | TaskMsg | Stop)──► task pipe ──► worker
    worker ──► result socket ──(Booted | Ready | InitError | Started | Result)──► main

A worker's life in messages: ``Booted`` when it runs our code, then ``Ready`` once
``worker_init_fn`` returned (or ``InitError`` if it raised). Per epoch the main process sends
``Epoch`` (which epoch, its seeds, a data plan's state, and for a stream where its shard
resumes), then ``TaskMsg``
after ``TaskMsg``; the worker answers each with one ``Result``, and sends ``Started`` when it
begins a task out of arrival order (a re-sent task overtaking queued ones). ``Stop`` ends it.

``Status`` is the one list of what a result (or a delivery decided by recovery) is.
"""

from __future__ import annotations

import enum
import pickle
import sys
import traceback
from typing import Any, NamedTuple

from ..core.errors import RemoteTraceback


class Status(enum.IntEnum):
    """What a result, or an item the iterator delivers, holds."""

    OK = 0  # the batch
    ERROR = 1  # a WorkerError: the user's exception, re-raised in the main process
    END = 2  # the worker's stream is exhausted (no batch)
    POISON = 3  # recovery: the WorkerCrashError to raise at this task's position
    SKIPPED = 4  # recovery: (tid, indices, message) of a poison task skipped (on_poison="skip")


# ---- main -> worker ----------------------------------------------------------------------------
class StreamResume(NamedTuple):
    """Where a stream worker's shard resumes: load ``state`` (taken after ``state_at``
    fetches; ``encoded`` if it is the main process's delta-encoded copy), then replay the
    fetches ``state_at .. fetched - 1`` without sending them."""

    state: Any
    encoded: bool
    state_at: int
    fetched: int


class Epoch(NamedTuple):
    """Serve epoch ``epoch`` (generation ``gen`` stamps its messages) under ``base_seed``;
    ``sample_seed`` for ``seed_per_sample``, else None; ``resume``: a stream's position;
    ``plan``: a ``Mixture`` dataset's plan (its ``state_dict()`` as the main process held it at
    ``iter()``, which the loader's state saves), else None. A worker's copy of the dataset is
    as old as the worker: with persistent workers, the plan reaches it only here."""

    gen: int
    epoch: int
    base_seed: int
    resume: StreamResume | None
    sample_seed: int | None
    plan: dict[str, Any] | None = None


class TaskMsg(NamedTuple):
    """Fetch task ``tid``: ``payload`` is its sample indices (map) or fetch number (stream).

    ``grant``: the loader's pooled segment the batch may be collated into (its id; -1: none
    this time; None: the loader has no pool, the worker keeps its own). See
    ``pipeline.transport.LoaderPool``."""

    gen: int
    tid: int
    payload: Any
    grant: int | None = None


class Stop(NamedTuple):
    """Exit now."""


# ---- worker -> main ----------------------------------------------------------------------------
class Booted(NamedTuple):
    """The process runs our code; ``worker_init_fn`` comes next."""

    worker_id: int


class Ready(NamedTuple):
    """Started; ``seeded``: ``worker_init_fn`` called ``torch.manual_seed``."""

    worker_id: int
    pid: int
    seeded: bool


class InitError(NamedTuple):
    """Starting failed (``worker_init_fn``, or a stream's ``iter()``/state restore raised)."""

    worker_id: int
    error: WorkerError


class Started(NamedTuple):
    """The worker began task ``tid`` out of arrival order."""

    tid: int


class Result(NamedTuple):
    """Task ``tid`` of generation ``gen``: ``payload`` by ``status``; streams also send the
    dataset's state delta (or None), and ``drained`` once their shard is exhausted."""

    gen: int
    tid: int
    status: Status
    payload: Any
    state_delta: Any
    retries: int
    drained: bool


_STATUSES = tuple(Status)


def result_to_wire(msg: Result) -> tuple[Any, ...]:
    """How a ``Result`` travels: a plain tuple, its status an int. Pickling a named tuple (its
    class by name, ``__getnewargs__``) and an enum member (``__reduce_ex__``, then a call to
    the enum on arrival) cost ~4 us per message on the two sides, with small batches most of
    a message's pickling."""
    return (msg[0], msg[1], int(msg[2]), *msg[3:])


def result_from_wire(wire: tuple[Any, ...]) -> Result:
    """The ``Result`` a plain tuple from ``result_to_wire`` stands for."""
    return Result(wire[0], wire[1], _STATUSES[wire[2]], *wire[3:])


ToWorker = Epoch | TaskMsg | Stop
FromWorker = Booted | Ready | InitError | Started | Result


# ---- inside the main process -------------------------------------------------------------------
class StreamNote(NamedTuple):
    """The stream part of a delivery: which worker's shard it advances, and how."""

    worker: int
    delta: Any
    drained: bool


class Delivery(NamedTuple):
    """An item on its way to the user, through the pin thread and the reorder buffer."""

    status: Status
    payload: Any
    stream: StreamNote | None


class KeyErrorMessage(str):
    """KeyError repr()s its argument; keep the multi-line message readable."""

    def __repr__(self) -> str:
        return self


class WorkerError:
    """A picklable record of an exception raised while loading a task."""

    def __init__(self, where: str, exc: BaseException | None = None) -> None:
        if exc is None:
            exc = sys.exc_info()[1]
        assert exc is not None
        self.where = where
        self.type_name = type(exc).__name__
        self.text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.exc_type: type[BaseException] | None = type(exc)
        try:
            pickle.dumps(self.exc_type)
        except Exception:
            self.exc_type = None

    def exception(self) -> BaseException:
        """The exception to raise in the main process (its ``__cause__`` is the remote tb)."""
        msg = f"Caught {self.type_name} {self.where}.\nOriginal {self.text}"
        exc: BaseException
        t = self.exc_type
        if t is KeyError:
            exc = KeyError(KeyErrorMessage(msg))
        else:
            try:
                exc = t(msg) if t is not None else RuntimeError(msg)
            except Exception:
                exc = RuntimeError(msg)
        exc.__cause__ = RemoteTraceback(self.text)
        return exc
