"""``inspect``'s output: the readable summary of a loader state, and its JSON rendering.

Every field may be missing or of the wrong type (a hand-edited file, a state from another
writer): each one is shown as "-" when absent and generically when it is not what the schema
says, so inspecting never fails on the contents of a state. Long lists are cut (``SHOW_*``)
and long strings clipped, so that a large state still reads as a page.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from ..core.errors import CheckpointError
from ..state.codec import clip_repr, clip_text, encoded_size
from ..state.ranks import is_global, split_global
from ..state.schema import FORMAT as STATE_FORMAT
from ..state.schema import K_DATASET, K_PLAN, KNOWN_KEYS
from ..state.seeds import SAMPLER, derive_seed
from . import streams as ST
from .messages import SHOW_KEYS

# How much of a long list the summary shows: enough to recognise a task, short enough to read.
SHOW_TASKS = 5
SHOW_INDICES = 8

MISSING = "-"

# ---- the summary, part by part ----


def format_summary(state: dict[Any, Any], source: str = "") -> str:
    """A readable multi-line summary of a loader state dict (or of a job's global state: its
    world size, then each rank's state)."""
    if is_global(state):
        return _global_summary(state, source)
    out = _Lines()
    out.line(f"resumable_loader state: {source}" if source else "resumable_loader state")
    fmt, version = state.get("format", MISSING), state.get("version", MISSING)
    out.field("format", f"{_scalar(fmt)}, version {_scalar(version)}")
    if isinstance(fmt, str) and fmt != STATE_FORMAT:
        out.line(f"  (not {STATE_FORMAT!r}: fields below may mean something else)")

    config = state.get("config", MISSING)
    out.line("config")
    if isinstance(config, dict):
        _config_lines(out, config)
    else:
        out.field("  (config)", _describe(config))
    _dataset_lines(out, state.get(K_DATASET, MISSING), state.get(K_PLAN, MISSING))

    seed, epoch = state.get("seed", MISSING), state.get("epoch", MISSING)
    out.field("seed", _scalar(seed) if seed is not None else "None (drawn when the epoch begins)")
    out.field("epoch", _scalar(epoch))
    if _is_count(seed) and _is_count(epoch):
        distributed = isinstance(config, dict) and str(config.get("sampler")).startswith(
            "distributed("
        )
        shuffle = (
            "the DistributedSampler's (its seed + epoch)"
            if distributed
            else str(derive_seed(SAMPLER, seed))
        )
        out.field("epoch seeds", f"shuffle {shuffle}; each batch from (seed, task id)")
    consumed = state.get("consumed", MISSING)
    ahead = state.get("delivered_ahead", MISSING)
    out.field(
        "position",
        f"{_scalar(consumed)} tasks consumed; delivered ahead: {_int_list(ahead, SHOW_INDICES)}",
    )
    cut = state.get("sample_cut", MISSING)
    if isinstance(cut, dict):
        holes = cut.get("holes")
        out.field(
            "sample cut",
            f"the rest of the epoch from position {_scalar(cut.get('start', MISSING))}"
            + (f", less {_describe(holes)} delivered ahead" if holes else "")
            + "; tasks count from there",
        )
    elif cut is not MISSING:
        out.field("sample cut", _describe(cut))
    dist = state.get("distributed", MISSING)
    if isinstance(dist, dict):
        history = dist.get("history") or "none"
        out.field(
            "sampler epoch",
            f"{_scalar(dist.get('sampler_epoch', MISSING))} (DistributedSampler); resizes "
            "within it [[world size, [samples each rank took]], ...]: "
            + clip_text(str(history), 60),
        )
    sampler = config.get("sampler") if isinstance(config, dict) else None
    _outstanding_lines(out, state.get("outstanding", MISSING), sampler, consumed)
    sampler_state = state.get("sampler_state", MISSING)
    if sampler_state is MISSING or sampler_state is None:
        out.field("sampler_state", "absent" if sampler_state is None else MISSING)
    else:
        out.field("sampler_state", f"present: {_describe(sampler_state)}")
    _worker_lines(out, state.get("workers", MISSING), state.get("next_worker", MISSING))
    _stream_lines(out, ST.read_table([state]))
    _skipped_lines(out, state.get("skipped", MISSING))
    _skipped_sample_lines(out, state.get("skipped_samples", MISSING))
    extra = [k for k in state if k not in KNOWN_KEYS]
    if extra:
        out.line(f"other keys ({len(extra)})")
        for key in extra[:SHOW_KEYS]:
            out.field(f"  {clip_text(str(key), 12)}", _describe(state[key]))
        if len(extra) > SHOW_KEYS:
            out.line(f"  ... {len(extra) - SHOW_KEYS} more")
    return out.text()


def _global_summary(state: dict[Any, Any], source: str) -> str:
    head = f"resumable_loader global state: {source}" if source else "resumable_loader global state"
    try:
        ranks = split_global(state)
    except CheckpointError as exc:
        return f"{head}\n  {exc}"
    parts = [f"{head}\n  world size {len(ranks)} (any number of ranks can load it)"]
    table = ST.read_table(ranks)
    if table is not None:
        job = _Lines()
        job.line("the job's Stream (every rank's cursors)")
        _stream_lines(job, table)
        parts.append(job.text())
    for r, rank_state in enumerate(ranks):
        parts.append(format_summary(rank_state, f"rank {r} of {len(ranks)}"))
    return "\n".join(parts)


def _config_lines(out: _Lines, config: dict[Any, Any]) -> None:
    def get(key: str) -> str:
        return _scalar(config.get(key, MISSING))

    kind = config.get("dataset_kind", MISSING)
    length = config.get("dataset_len", MISSING)
    if type(length) is int:
        size = f"{length} samples"
    else:
        size = "length unknown" if length is None else f"length {_scalar(length)}"
    out.field("  dataset", f"{_scalar(kind)}, {size}")
    out.field("  batch_size", f"{get('batch_size')} (drop_last: {get('drop_last')})")
    if config.get("batch_sampler") is not None:
        out.field("  batch_sampler", get("batch_sampler"))
    out.field("  sampler", get("sampler"))
    out.field("  num_workers", get("num_workers"))
    out.field("  distributed", f"rank {get('rank')} of world size {get('world_size')}")
    known = {"dataset_kind", "dataset_len", "batch_size", "batch_sampler", "drop_last", "sampler"}
    known |= {"num_workers", "world_size", "rank"}
    for key, value in config.items():
        if key not in known:
            out.field(f"  {clip_text(str(key), 12)}", _describe(value))


def _dataset_lines(out: _Lines, record: Any, plan: Any) -> None:
    """The data the state was taken on: the dataset's class and fingerprint, and a Mixture's
    sources (its plan holds their names, lengths and fingerprints)."""
    if record is MISSING:
        out.field("dataset", "- (not recorded: a resume checks the length only)")
    elif isinstance(record, dict) and isinstance(record.get("class"), str):
        fp = record.get("fingerprint", MISSING)
        if fp is None and isinstance(plan, dict):
            said = "fingerprints per source (data_plan)"
        elif fp is None:
            said = "no fingerprint() (class and length checked)"
        else:
            said = f"fingerprint {_fingerprint(fp)}"
        out.field("dataset", f"{clip_text(record['class'], 100)}; {said}")
    else:
        out.field("dataset", _describe(record))
    if isinstance(plan, dict):
        _plan_lines(out, plan)
    elif plan is not MISSING and plan is not None:
        out.field("data_plan", _describe(plan))


def _plan_lines(out: _Lines, plan: dict[Any, Any]) -> None:
    """A Mixture's plan: seed, epoch, num_samples, newest weights, and each source."""
    weights = plan.get("weights", MISSING)
    if isinstance(weights, list) and weights and isinstance(weights[-1], dict):
        newest = weights[-1]
        segments = f"{len(weights)} segment" + "s" * (len(weights) != 1)
        said = (
            f"{clip_repr(newest.get('weights', MISSING), 80)} from position "
            f"{_scalar(newest.get('from', MISSING))} ({segments})"
        )
    else:
        said = _describe(weights)
    out.field(
        "data_plan",
        f"seed {_scalar(plan.get('seed', MISSING))}, epoch {_scalar(plan.get('epoch', MISSING))}"
        f", num_samples {_scalar(plan.get('num_samples', MISSING))}; weights {said}",
    )
    rests = plan.get("rests", MISSING)
    if isinstance(rests, list) and rests and isinstance(rests[-1], dict):
        # Weights changed at a resume inside a shuffled epoch: keyed by the order, not positions.
        last = rests[-1]
        out.line(
            f"{'':17}and {clip_repr(last.get('weights', MISSING), 80)} from place "
            f"{_scalar(last.get('from', MISSING))} of epoch {_scalar(last.get('epoch', MISSING))}"
            f"'s sampler order ({len(rests)} change" + "s" * (len(rests) != 1) + " inside an epoch)"
        )
    elif rests is not MISSING:
        out.line(f"{'':17}rests: {_describe(rests)}")
    sources = plan.get("sources", MISSING)
    if not isinstance(sources, list):
        out.line(f"{'':17}sources: {_describe(sources)}")
        return
    for source in sources[:SHOW_KEYS]:
        if isinstance(source, dict):
            out.line(
                f"{'':17}source {_describe(source.get('name', MISSING))}: "
                f"{_scalar(source.get('length', MISSING))} items, fingerprint "
                f"{_fingerprint(source.get('fingerprint', MISSING))}"
            )
        else:
            out.line(f"{'':17}{_describe(source)}")
    if len(sources) > SHOW_KEYS:
        out.line(f"{'':17}... {len(sources) - SHOW_KEYS} more")


def _fingerprint(value: Any) -> str:
    # Longer than other strings: a digest is compared by eye, and sha256 hex alone is 64.
    return repr(clip_text(value, 100)) if isinstance(value, str) else _describe(value)


def _outstanding_lines(out: _Lines, outstanding: Any, sampler: Any, consumed: Any) -> None:
    if outstanding is MISSING and isinstance(sampler, str) and _is_count(consumed):
        if sampler == "sequential" or sampler.startswith("random("):
            out.field(
                "outstanding",
                f"- (built-in sampler: tasks {consumed} on are recomputed from the seed)",
            )
            return
        if sampler.startswith("fastforward:"):
            out.field(
                "outstanding",
                f"- (the sampler is replayed for {consumed} tasks, then tasks {consumed} on "
                "are drawn)",
            )
            return
    if not isinstance(outstanding, list):
        out.field("outstanding", _describe(outstanding))
        return
    out.field("outstanding", f"{len(outstanding)} tasks")
    for entry in outstanding[:SHOW_TASKS]:
        if isinstance(entry, list) and len(entry) == 2:
            task_id, indices = entry
            out.line(f"{'':17}task {_scalar(task_id)}: {_indices(indices)}")
        else:
            out.line(f"{'':17}{_describe(entry)}")
    if len(outstanding) > SHOW_TASKS:
        out.line(f"{'':17}... {len(outstanding) - SHOW_TASKS} more")


def _worker_lines(out: _Lines, workers: Any, next_worker: Any) -> None:
    if not isinstance(workers, list):
        out.field("workers", f"{_describe(workers)} (next: {_scalar(next_worker)})")
        return
    out.field("workers", f"{len(workers)} (next: {_scalar(next_worker)})")
    if not workers:
        return
    out.line(f"  {'id':>4}  {'delivered':>9}  {'exhausted':<9}  {'state_at':>8}  dataset_state")
    for worker in workers:
        if not isinstance(worker, dict):
            out.line(f"  {_describe(worker)}")
            continue
        exhausted = worker.get("exhausted", MISSING)
        flag = "yes" if exhausted is True else "no" if exhausted is False else _scalar(exhausted)
        dataset_state = worker.get("dataset_state", MISSING)
        ds = "None" if dataset_state is None else _describe(dataset_state)
        if isinstance(dataset_state, (dict, list)):
            ds += _preview(dataset_state)
        out.line(
            f"  {_scalar(worker.get('id', MISSING)):>4}  "
            f"{_scalar(worker.get('delivered', MISSING)):>9}  {flag:<9}  "
            f"{_scalar(worker.get('state_at', MISSING)):>8}  {ds}"
        )


def _stream_lines(out: _Lines, table: ST.StreamTable | None) -> None:
    """A Stream's block (``cli/streams.py``): its plan and where its partitions stand."""
    if table is None:
        return
    for name, text in ST.lines(table):
        if name:
            out.field(name, text)
        else:
            out.line(f"{'':17}{text}")


def _skipped_lines(out: _Lines, skipped: Any) -> None:
    if not isinstance(skipped, list):
        out.field("skipped", _describe(skipped))
        return
    out.field("skipped", f"{len(skipped)} poison tasks" if skipped else "none")
    for entry in skipped[:SHOW_TASKS]:
        if isinstance(entry, list) and len(entry) == 3:
            epoch, task_id, indices = entry
            line = f"epoch {_scalar(epoch)} task {_scalar(task_id)}: {_indices(indices)}"
            out.line(f"{'':17}{line}")
        else:
            out.line(f"{'':17}{_describe(entry)}")
    if len(skipped) > SHOW_TASKS:
        out.line(f"{'':17}... {len(skipped) - SHOW_TASKS} more")


def _skipped_sample_lines(out: _Lines, skipped: Any) -> None:
    if skipped is MISSING:
        return
    if not isinstance(skipped, list):
        out.field("skipped samples", _describe(skipped))
        return
    total = sum(e[2] for e in skipped if isinstance(e, list) and len(e) == 3 and _is_count(e[2]))
    out.field("skipped samples", f"{total} in {len(skipped)} skips" if skipped else "none")
    for entry in skipped[:SHOW_TASKS]:
        if isinstance(entry, list) and len(entry) == 3:
            epoch, before, count = entry
            out.line(
                f"{'':17}epoch {_scalar(epoch)}: {_scalar(count)} samples, after "
                f"{_scalar(before)} of the epoch"
            )
        else:
            out.line(f"{'':17}{_describe(entry)}")
    if len(skipped) > SHOW_TASKS:
        out.line(f"{'':17}... {len(skipped) - SHOW_TASKS} more")


# ---- one value in a few words ----


class _Lines:
    """The summary's lines. ``field`` puts its name in a 16-column gutter, which is why
    continuation lines elsewhere are indented by 17."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def line(self, text: str) -> None:
        self._lines.append(text)

    def field(self, name: str, value: str) -> None:
        self._lines.append(f"{name:<16} {value}")

    def text(self) -> str:
        return "\n".join(self._lines)


def _scalar(value: Any) -> str:
    """A short rendering of a value expected to be a scalar; '-' when it is missing."""
    if value is MISSING:
        return MISSING
    if isinstance(value, str):
        return clip_text(value, 60)
    return _describe(value)


def _indices(indices: Any) -> str:
    if not isinstance(indices, list):
        return _describe(indices)
    return f"{len(indices)} indices {_int_list(indices, SHOW_INDICES)}"


def _int_list(values: Any, limit: int) -> str:
    if not isinstance(values, list):
        return _describe(values)
    shown = ", ".join(clip_text(_scalar(v), 20) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def _describe(value: Any) -> str:
    """One line saying what a value is: type, size, first keys, encoded size."""
    if value is MISSING:
        return MISSING
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(clip_text(value, 60))
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        keys = [clip_text(str(k), 20) for k in list(value)[:6]]
        more = ", ..." if len(value) > 6 else ""
        text = f"dict, {len(value)} keys" + (f" ({', '.join(keys)}{more})" if keys else "")
        return text + _size_suffix(value)
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}" + _size_suffix(value)
    kind = type(value)
    shape = getattr(value, "shape", None)
    return f"{kind.__module__}.{kind.__qualname__}" + (f" {tuple(shape)}" if shape else "")


def _size_suffix(value: Any) -> str:
    size = encoded_size(value)
    return "" if size is None else f", {_human_bytes(size)}"


def _human_bytes(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    if size < 1024**2:
        return f"{size / 1024:.1f} KiB"
    return f"{size / 1024**2:.1f} MiB"


def _preview(value: Any) -> str:
    """': ' and the first characters of a small container, if it can be shown as JSON."""
    try:
        return ": " + clip_text(json.dumps(jsonable(value), ensure_ascii=False), 60)
    except (RecursionError, ValueError):
        return ""  # it holds itself (torch.save allows cycles): the line above says enough


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


# ---- JSON ----


def jsonable(value: Any) -> Any:
    """A JSON-ready copy: bytes as {"$bytes": base64}, keys as str, other objects by repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        return {
            k if isinstance(k, (str, int)) and not isinstance(k, bool) else repr(k): jsonable(v)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return {"$repr": clip_text(repr(value), 200)}
