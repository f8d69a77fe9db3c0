"""The ```python blocks of README.md and docs/*.md, run as tests.

Each block is one test, named by page and section (``test_doc_block[README.md#quickstart]``;
a section's second block gets ``-2``). What the test does with a block is said by an HTML
comment on the line before its fence, so a doc writer sees it next to the code:

* no comment, or ``<!-- docs-test: run [prelude=NAME] -->``: the block runs once in a fresh
  namespace with a temporary directory as cwd, after ``PRELUDES[NAME]`` if one is named (the
  names a fragment takes from the text around it: a saved state, an old checkpoint).
* ``<!-- docs-test: run check-resume[=NAME] -->``: the block makes a resumable thing (a
  sampler, a stream) and ``loader`` over it (``LOADERS[NAME]`` builds that loader where the
  page leaves it to the reader). ``resumable_loader.testing.check_resume`` then checks that
  a state taken at every batch, every epoch end included, sent through ``dump_state``,
  resumes a new loader (the block run again) exactly, with and without workers.
* ``<!-- docs-test: skip (why) -->``: not run; the reason is the skip's reason.
* ``<!-- docs-test: resume [options] -->``: the block is a resume recipe, run as a job that is
  interrupted and resumed. First once uninterrupted: the reference, every batch ``train_step``
  trained, in order. Then, for every k (after each batch of every epoch, an epoch's last batch
  included, and the last of the job: a finished job started again), a fresh directory and two
  runs of the same block: the first is interrupted after k trained batches, the second
  resumes from what the first saved and runs to the end, with another torch seed (a resume
  must not depend on what the RNGs hold). The model's final weights (its ledger of trained
  batches, rolled back with the checkpoint as real weights are) must equal the reference's,
  and the second run must train exactly the reference's batches after the k-th: nothing
  repeated, nothing skipped. Options:

  - ``sigterm``: the interruption is a SIGTERM raised right after the k-th ``train_step`` (a
    recipe with a SIGTERM handler); by default ``train_step`` raises a ``KeyboardInterrupt``
    when given batch k + 1.
  - ``prelude=NAME``: the block is a loop that starts where the page's resume code ends (it
    uses ``loader`` and ``start_epoch``); ``PRELUDES[NAME]`` is that code, as the page has it.
  - ``process-group``: the block needs a ``torch.distributed`` process group; each run gets a
    gloo group of one rank (world size 1), torn down after it.

What a block may use without defining it (``_namespace``): the public names of
``resumable_loader``; ``os``, ``signal``, ``json``, ``hashlib``, ``torch``, ``Dataset``,
``IterableDataset``, ``Sampler``, ``get_worker_info``; ``dataset`` (a map-style dataset of
``DATASET_LEN`` items, each ``tensor([index, a random draw])``, so a batch's augmentation is
checked as well as its indices); ``web_ds``, ``code_ds``, ``math_ds`` and ``sources`` (the
same, as named sources for a ``Mixture``), ``weights`` and ``new_weights``; ``model`` (a
``torch.nn.Module`` whose buffers record the batches it was trained on); ``opt``, ``optim``
and ``optimizer`` (one stand-in optimizer with a state); ``train_step(batch)`` (trains on
the batch, returns the number of batches the model holds: the global step);
``num_epochs`` and ``epochs`` (2); ``every`` (1); ``root`` (``"ckpts"``), ``resuming``
(whether an earlier run of this job left a checkpoint), ``path`` (the newest ``root/step-N``
with a ``.metadata``), ``ckpt_dir`` (``"accelerate-ckpt"``); ``loader`` (a loader over
``range(LONG_LEN)``, for blocks that take a loader as given).

What is changed in a block before it runs (``_Shrink``), so that all of them run in seconds
on 2 cores: an int literal given as ``num_workers=`` or ``batch_size=`` becomes
``NUM_WORKERS`` or ``BATCH``; a checkpoint interval written as ``step % <literal>`` becomes
``step % every`` (``every`` is 1: the state after every step is saved, so every k above is a
resume point); a bare ``...`` statement in a loop over ``batch`` (the docs' "your training
step") becomes ``step = train_step(batch)``. Nothing else is touched: a name a block uses
without defining it, and that is not in the list above, is a bug in the doc.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import re
import signal
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

import resumable_loader
from resumable_loader import DataLoader, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

DATASET_LEN = 6  # with BATCH 4: batches of 4 and 2 -- mid-epoch, end of epoch, a short batch
BATCH = 4
NUM_WORKERS = 2
EPOCHS = 2
LONG_LEN = 20_000  # ``loader``'s length: a skip of a few thousand samples stays in the epoch
_CAPACITY = 64  # batches the model's ledger holds (DCP loads into tensors of a fixed size)

# A block that continues the page's resume code: that code, as the page writes it.
PRELUDES = {
    # docs/preemption.md's "Saving and resuming", up to its loop.
    "load-ckpt": """
loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=NUM_WORKERS,
                    persistent_workers=True)
start_epoch = 0
if os.path.exists("ckpt.pt"):
    ckpt = torch.load("ckpt.pt", weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    loader.load_state_dict(ckpt["loader"])
    start_epoch = ckpt["loader"]["epoch"]
""",
    # docs/data-plans.md's "Changing the weights": a Mixture's state, and where the job stood.
    "mixture-state": """
saved_mixture_state = Mixture(sources, weights, seed=0).state_dict()
g = 7
""",
    # docs/migrating-from-torchdata.md: a checkpoint StatefulDataLoader wrote mid-epoch.
    "torchdata-state": """
from torchdata.stateful_dataloader import StatefulDataLoader

old = StatefulDataLoader(dataset, batch_size=BATCH)
next(iter(old))
ckpt = {"loader": old.state_dict()}
loader = DataLoader(dataset, batch_size=BATCH)
""",
}

# Loaders over a page's classes, where the page leaves building one to the reader.
LOADERS = {
    # docs/stateful.md's streams, sharded over the workers by the class itself.
    "lines": "loader = DataLoader(Lines(LINES), batch_size=BATCH, num_workers=NUM_WORKERS)",
    "fresh-lines": (
        "loader = DataLoader(FreshLines(LINES), batch_size=BATCH, num_workers=NUM_WORKERS)"
    ),
}

# Blocks known to be wrong, for a reason tracked elsewhere: xfail(strict=True), so that the
# fix shows up as an XPASS to flip.
KNOWN_WRONG: dict[str, str] = {}


# --- extracting the blocks ---------------------------------------------------------------------

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One ```python block of a page: where it is, its code, and its docs-test comment."""

    id: str  # page#section, "-2" on for a section's later blocks: stable while prose moves
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    marker: str  # what follows "docs-test:" on the line before the fence; "" if none

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def extract_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a markdown page, dedented (a block may sit in a list item)."""
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    blocks: list[Block] = []
    section, i = "top", 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            if lines[i].startswith("#"):
                section = re.sub(r"[^a-z0-9]+", "-", lines[i].lstrip("#").lower()).strip("-")
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        if m.group(2) == "python":
            prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = _MARKER.match(prev)
            earlier = sum(b.id.split("#")[1].startswith(section) for b in blocks)
            blocks.append(
                Block(
                    id=f"{page}#{section}" + (f"-{earlier + 1}" if earlier else ""),
                    page=page,
                    line=i + 1,
                    code=textwrap.dedent("\n".join(lines[i + 1 : end])),
                    marker=marker.group(1) if marker else "",
                )
            )
        i = end + 1
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in extract_blocks(page)]


# --- what a block may use ----------------------------------------------------------------------


class _Numbers(Dataset):
    """Item i is ``tensor([offset + i, a draw from torch's RNG])``: a stand-in augmentation."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([self.offset + i, int(torch.randint(0, 1 << 30, ()))])


class _Ledger(torch.nn.Module):
    """A model whose state is the batches it was trained on, in order.

    A checkpoint holds it as a model's weights are held, and a resume rolls it back to what the
    checkpoint saw: after a resumed job, its ledger is what an uninterrupted job's would be if
    and only if the job trained the same batches. Fixed-size buffers: ``dcp.load`` loads in
    place.
    """

    rows: torch.Tensor
    count: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.register_buffer("rows", torch.full((_CAPACITY, BATCH, 2), -1, dtype=torch.long))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def record(self, batch: Any) -> list[tuple[int, ...]]:
        rows = torch.as_tensor(batch).reshape(-1, 2)
        n = int(self.count)
        assert n < _CAPACITY and len(rows) <= BATCH, "the harness's ledger is too small"
        self.rows[n, : len(rows)] = rows
        self.count += 1
        return _as_ids(rows)

    def trained(self) -> list[list[tuple[int, ...]]]:
        out = []
        for row in self.rows[: int(self.count)]:
            out.append(_as_ids(row[row[:, 0] >= 0]))
        return out


class _Optimizer:
    """A stand-in optimizer: its state is the number of steps it took (torch.optim imports
    torch._dynamo and sympy, seconds of import and a bigger process for every later fork)."""

    def __init__(self) -> None:
        self.steps = torch.zeros((), dtype=torch.long)

    def step(self) -> None:
        self.steps += 1

    def zero_grad(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps.copy_(state["steps"])


def _as_ids(rows: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in r) for r in rows]


class _Interrupted(KeyboardInterrupt):
    """What ``train_step`` raises to interrupt a run (a Ctrl-C, as far as the block knows)."""


@dataclass
class _Job:
    """One run of a block: its model, what it trained, and when to interrupt it."""

    interrupt_after: int | None = None  # trained batches before the interruption
    sigterm: bool = False  # interrupt by SIGTERM after the batch, not by raising before the next
    model: _Ledger = field(default_factory=_Ledger)
    log: list[list[tuple[int, ...]]] = field(default_factory=list)  # what this run trained
    interrupted: bool = False
    # torch's global seed when the run starts, as a script's torch.manual_seed would set it
    # (a shuffle without a generator draws from it): the interrupted run has the reference's,
    # the resumed run another, since a resume must not depend on what the RNGs hold.
    seed: int = 0

    def train_step(self, batch: Any) -> int:
        if not self.sigterm and self.interrupt_after == len(self.log):
            self.interrupted = True
            raise _Interrupted(f"the harness's interruption after {len(self.log)} batches")
        self.log.append(self.model.record(batch))
        if self.sigterm and self.interrupt_after == len(self.log):
            self.interrupted = True
            # raise_signal runs the Python handler before it returns: the block's flag is set
            # when train_step returns, as a SIGTERM arriving during the step would leave it.
            signal.raise_signal(signal.SIGTERM)
        return int(self.model.count)


def _newest_step_dir(root: str) -> str | None:
    """The ``root/step-N`` directory with the highest N that has DCP's ``.metadata``."""
    if not os.path.isdir(root):
        return None
    steps = [
        (int(m.group(1)), name)
        for name in os.listdir(root)
        if (m := re.fullmatch(r"step-(\d+)", name))
        and os.path.exists(os.path.join(root, name, ".metadata"))
    ]
    return os.path.join(root, max(steps)[1]) if steps else None


def _namespace(job: _Job) -> dict[str, Any]:
    """The names a block may use without defining them (see the module docstring)."""
    model = job.model
    opt = _Optimizer()
    root, ckpt_dir = "ckpts", "accelerate-ckpt"
    newest = _newest_step_dir(root)
    return {
        **{name: getattr(resumable_loader, name) for name in resumable_loader.__all__},
        "__name__": "__docs__",
        "os": os,
        "signal": signal,
        "json": json,
        "hashlib": hashlib,
        "torch": torch,
        "Dataset": Dataset,
        "IterableDataset": IterableDataset,
        "Sampler": Sampler,
        "get_worker_info": get_worker_info,
        "DataLoader": DataLoader,
        "save_checkpoint": save_checkpoint,
        "BATCH": BATCH,
        "LINES": [f"line {i}" for i in range(DATASET_LEN)],
        "NUM_WORKERS": NUM_WORKERS,
        "dataset": _Numbers(DATASET_LEN),
        "web_ds": _Numbers(6, 100),
        "code_ds": _Numbers(4, 200),
        "math_ds": _Numbers(3, 300),
        "sources": {"web": _Numbers(6, 100), "code": _Numbers(4, 200), "math": _Numbers(3, 300)},
        "weights": {"web": 0.6, "code": 0.3, "math": 0.1},
        "new_weights": {"web": 0.5, "code": 0.5, "math": 0.0},
        "model": model,
        "opt": opt,
        "optim": opt,
        "optimizer": opt,
        "train_step": job.train_step,
        "num_epochs": EPOCHS,
        "epochs": EPOCHS,
        "every": 1,
        "root": root,
        "resuming": newest is not None or os.path.exists(ckpt_dir) or os.path.exists("ckpt.pt"),
        "path": newest,
        "ckpt_dir": ckpt_dir,
        "loader": DataLoader(list(range(LONG_LEN)), batch_size=BATCH),
    }


# --- what is changed in a block before it runs -------------------------------------------------


class _Shrink(ast.NodeTransformer):
    """The rewrites listed in the module docstring, and nothing else."""

    def __init__(self) -> None:
        self.in_batch_loop = 0

    def visit_keyword(self, node: ast.keyword) -> ast.keyword:
        small = {"num_workers": "NUM_WORKERS", "batch_size": "BATCH"}
        if node.arg in small and isinstance(node.value, ast.Constant):
            node.value = ast.Name(small[node.arg], ast.Load())
        return node

    def visit_BinOp(self, node: ast.BinOp) -> ast.BinOp:
        self.generic_visit(node)
        is_interval = (
            isinstance(node.op, ast.Mod)
            and isinstance(node.left, ast.Name)
            and node.left.id == "step"
            and isinstance(node.right, ast.Constant)
        )
        if is_interval:
            node.right = ast.Name("every", ast.Load())
        return node

    def visit_For(self, node: ast.For) -> ast.For:
        over_batch = any(isinstance(n, ast.Name) and n.id == "batch" for n in ast.walk(node.target))
        self.in_batch_loop += over_batch
        self.generic_visit(node)
        self.in_batch_loop -= over_batch
        return node

    def visit_Expr(self, node: ast.Expr) -> ast.stmt:
        if self.in_batch_loop and isinstance(node.value, ast.Constant) and node.value.value is ...:
            return ast.parse("step = train_step(batch)").body[0]
        return node


def _compile(block: Block) -> Any:
    tree = ast.fix_missing_locations(_Shrink().visit(ast.parse(block.code)))
    return compile(tree, block.where, "exec")  # a traceback names the page and the line


# --- running a block ---------------------------------------------------------------------------


@contextlib.contextmanager
def _process_group(directory: Path) -> Iterator[None]:
    import torch.distributed as dist

    store = directory / "pg-store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _close_loaders(ns: dict[str, Any]) -> None:
    """Close every loader a run left: an interrupted block never reaches its loop's end."""
    for value in ns.values():
        closer = getattr(value, "close", None)
        if isinstance(value, torch.utils.data.DataLoader) and callable(closer):
            closer()


def _run(block: Block, directory: Path, job: _Job, options: set[str], prelude: str) -> _Job:
    """Run the block once in ``directory`` as ``job``; an interruption ends it quietly."""
    directory.mkdir(parents=True, exist_ok=True)
    code = _compile(block)
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    cwd = os.getcwd()
    os.chdir(directory)
    ns: dict[str, Any] = {}
    try:
        with _process_group(directory) if "process-group" in options else contextlib.nullcontext():
            torch.manual_seed(job.seed)
            ns = _namespace(job)
            try:
                exec(prelude, ns)
                exec(code, ns)
            except _Interrupted:
                pass
            finally:
                _close_loaders(ns)
    finally:
        os.chdir(cwd)
        signal.signal(signal.SIGTERM, previous_sigterm)
        ns.clear()
    return job


def _check_loader_resumes(block: Block, tmp_path: Path, options: set[str]) -> None:
    from resumable_loader.testing import check_resume

    code = _compile(block)
    names = [o.partition("=")[2] for o in options if o.startswith("check-resume=")]
    build = LOADERS[names[0]] if names else ""
    for workers in (0, NUM_WORKERS):

        def make_loader(workers: int = workers) -> Any:
            ns = _namespace(_Job())
            ns["NUM_WORKERS"] = workers
            torch.manual_seed(0)  # the same job each time: a script's seed, at its top
            exec(code, ns)
            exec(build, ns)
            return ns["loader"]

        cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            checked = check_resume(make_loader, epochs=EPOCHS, via="bytes")
        finally:
            os.chdir(cwd)
        assert checked >= 2 * 2, f"{block.where}: only {checked} save points"


def _check_resumes(block: Block, tmp_path: Path, options: set[str], prelude: str) -> None:
    reference = _run(block, tmp_path / "reference", _Job(), options, prelude).log
    total = len(reference)
    assert total >= 2 * 2, f"{block.where}: the reference run trained only {total} batches"
    sigterm = "sigterm" in options
    failures = []
    # k = total: a job stopped after its last batch and started again, which must train
    # nothing more. Without a SIGTERM there is no later step to interrupt: the first run ends
    # by itself there.
    for k in range(1, total + 1):
        where = tmp_path / f"k{k}"
        first = _run(block, where, _Job(interrupt_after=k, sigterm=sigterm), options, prelude)
        assert first.interrupted or (k == total and not sigterm), (
            f"{block.where}: the interruption after {k} batches never came"
        )
        assert first.log == reference[:k], f"{block.where}: run 1 trained other batches"
        second = _run(block, where, _Job(seed=1000 + k), options, prelude)
        if second.log != reference[k:] or second.model.trained() != reference:
            failures.append(
                f"interrupted after batch {k} of {total}: the resumed run trained "
                f"{second.log} where the uninterrupted run trained {reference[k:]}"
            )
    assert not failures, f"{block.where} does not resume exactly:\n" + "\n".join(failures)


def _params(in_process_group: bool) -> list[Any]:
    params = []
    for block in ALL_BLOCKS:
        if ("process-group" in block.marker.split()) != in_process_group:
            continue
        marks = []
        if any(
            heavy in block.code
            for heavy in ("accelerate", "torch.distributed", "transformers", "torchdata")
        ):
            marks.append(pytest.mark.heavy_imports)
        if block.id in KNOWN_WRONG:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_WRONG[block.id]))
        params.append(pytest.param(block, id=block.id, marks=marks))
    return params


@pytest.fixture(scope="session")
def _dcp_started(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One ``dcp.save`` in a gloo group before any test's leak baseline. The first one in a
    process leaves gloo's fds (a pipe, an epoll fd, a socket) open for the process's life,
    however the group is torn down; later ones add none. That is torch's, not a test's leak."""
    import torch.distributed.checkpoint as dcp

    directory = tmp_path_factory.mktemp("dcp")
    with _process_group(directory):
        dcp.save({"x": torch.zeros(())}, checkpoint_id=str(directory / "ckpt"))


@pytest.mark.heavy_imports
@pytest.mark.parametrize("block", _params(in_process_group=True))
def test_doc_block_in_a_process_group(block: Block, tmp_path: Path, _dcp_started: None) -> None:
    """Run one block that needs a process group (a gloo group of one rank per run)."""
    test_doc_block(block, tmp_path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("block", _params(in_process_group=False))
def test_doc_block(block: Block, tmp_path: Path) -> None:
    """Run one block as its docs-test comment says (see the module docstring)."""
    verb, _, rest = block.marker.partition(" ")
    if verb == "skip":
        pytest.skip(f"{block.where}: {rest.strip('() ') or 'marked skip'}")
    options = set(rest.split())
    preludes = [o.partition("=")[2] for o in options if o.startswith("prelude=")]
    prelude = PRELUDES[preludes[0]] if preludes else ""
    if verb == "resume":
        _check_resumes(block, tmp_path, options, prelude)
    else:
        assert verb in {"", "run"}, f"{block.where}: unknown docs-test comment {block.marker!r}"
        if any(o.partition("=")[0] == "check-resume" for o in options):
            _check_loader_resumes(block, tmp_path, options)
        else:
            _run(block, tmp_path, _Job(), options, prelude)


def test_every_page_is_read_and_every_marker_is_known() -> None:
    """The harness sees blocks on the pages that have them, and no marker it cannot read."""
    pages = {block.page for block in ALL_BLOCKS}
    assert {"README.md", "docs/preemption.md", "docs/distributed.md"} <= pages
    for block in ALL_BLOCKS:
        verb = block.marker.partition(" ")[0]
        assert verb in {"", "run", "skip", "resume"}, f"{block.where}: unknown {block.marker!r}"
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if "docs-test:" in line:
                assert _MARKER.match(line), f"{page.name}:{n}: a docs-test comment it cannot read"
    assert resumable_loader.DataLoader is DataLoader


# --- the harness itself: it must catch a recipe that resumes wrongly --------------------------

# Two ways to get a resume wrong that users write (and that preemption.md warns against): an
# epoch counter saved beside the loader's state, and a loader that is rebuilt but not loaded.
_WRONG_RECIPES = {
    "an-epoch-counter-beside-the-state": """
loader = DataLoader(dataset, batch_size=4, shuffle=True)
start_epoch = 0
if os.path.exists("ckpt.pt"):
    ckpt = torch.load("ckpt.pt", weights_only=True)
    model.load_state_dict(ckpt["model"])
    loader.load_state_dict(ckpt["loader"])
    start_epoch = ckpt["epoch"]
for epoch in range(start_epoch, num_epochs):
    for step, batch in enumerate(loader):
        train_step(batch)
        save_checkpoint(
            {"model": model.state_dict(), "loader": loader.state_dict(), "epoch": epoch}, "ckpt.pt"
        )
""",
    "the-loader-not-loaded": """
loader = DataLoader(dataset, batch_size=4, shuffle=True)
if os.path.exists("ckpt.pt"):
    model.load_state_dict(torch.load("ckpt.pt", weights_only=True)["model"])
for epoch in range(num_epochs):
    for batch in loader:
        train_step(batch)
        save_checkpoint({"model": model.state_dict()}, "ckpt.pt")
""",
}


@pytest.mark.parametrize("name", sorted(_WRONG_RECIPES))
def test_the_harness_catches_a_recipe_that_does_not_resume_exactly(
    name: str, tmp_path: Path
) -> None:
    """A wrong recipe, run as the docs' recipes are, fails the resume check at the k it is
    wrong at: the counter only after an epoch's last batch (k = 2 and 4 of 4), the unloaded
    loader everywhere."""
    block = Block(
        id=name, page="tests/behaviour/test_docs.py", line=0, code=_WRONG_RECIPES[name], marker=""
    )
    with pytest.raises(AssertionError, match="does not resume exactly") as failed:
        _check_resumes(block, tmp_path, set(), "")
    wrong_at = {int(k) for k in re.findall(r"after batch (\d+) of 4", str(failed.value))}
    assert wrong_at == ({2, 4} if name == "an-epoch-counter-beside-the-state" else {1, 2, 3, 4})
