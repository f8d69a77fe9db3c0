"""The package's layers (issue #32): every import points down, no module imports itself back
through another, and no module reads another's private names.

The layers, bottom to top (docs/internals.md, "Layers"):

    core  <  state  <  plans  <  pipeline  <  loader  <  integrations, testing, the package
                    cli reads only state (and core)
                    adapters (shard readers for a Stream) import nothing of the package

A module may import its own layer and any layer below it. ``integrations`` use the loader and
the state format, never the pipeline under it; ``cli`` reads and writes states and nothing
else (it must work on a machine where a worker could never start). Every import counts: at
module level, inside a function, and under ``if TYPE_CHECKING`` (a type-only cycle is still a
cycle a reader has to untangle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "resumable_loader"

RANK = {"core": 0, "state": 1, "plans": 2, "pipeline": 3, "loader": 4}
# What each top-level folder (or module) may import, beyond itself.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "state": {"core"},
    "plans": {"core", "state"},
    "pipeline": {"core", "state", "plans"},
    "loader": {"core", "state", "plans", "pipeline"},
    "cli": {"core", "state"},
    "adapters": set(),
    "integrations": {"core", "state", "plans", "loader", ""},
    "testing": {"core", "state", "plans", "pipeline", "loader", ""},
    "": {"core", "state", "plans", "pipeline", "loader", "cli"},  # __init__, __main__
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, int, list[str]]]:
    """(imported module, line, names imported from it) for every import of the package."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: list[tuple[str, int, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: -(node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "resumable_loader":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:  # `from . import ranks`: a module
                    found.append((sub, node.lineno, []))
                else:
                    found.append((target, node.lineno, [alias.name]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "resumable_loader":
                    found.append((alias.name, node.lineno, []))
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__",):
        return ""
    return parts[1]


def test_every_module_belongs_to_a_layer() -> None:
    for name in MODULES:
        assert _layer(name) in ALLOWED, f"{name}: a folder the layer rule does not know"


def test_every_import_points_down() -> None:
    wrong = []
    for name, path in MODULES.items():
        mine = _layer(name)
        for target, line, _ in _imports(name, path):
            theirs = _layer(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{path.relative_to(PKG.parent)}:{line}: {name} -> {target}")
    assert not wrong, "imports against the layer rule:\n" + "\n".join(wrong)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for target, _, _ in _imports(name, path):
            # A package's __init__ that only documents its folder is no edge to its modules.
            if target in MODULES and target != name:
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    graph = _graph()
    # The package itself re-exports from its modules, and `testing` and the integrations
    # import the package: edges into "resumable_loader" are the public surface, not a cycle
    # through the internals.
    for deps in graph.values():
        deps.discard("resumable_loader")
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _private_reads(name: str, path: Path) -> list[str]:
    """``from x import _name`` and ``module._name`` across modules of the package."""
    found = []
    for target, line, names in _imports(name, path):
        for n in names:
            if n.startswith("_") and not n.startswith("__"):
                found.append(f"{name}:{line}: imports {target}.{n}")
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            if node.level > 1:
                base = base[: -(node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                if f"{target}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{target}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{name}:{node.lineno}: reads {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_reads_another_modules_private_names() -> None:
    found = [r for name, path in MODULES.items() for r in _private_reads(name, path)]
    assert not found, "\n".join(found)


# ---- no object's private names read from outside its module ----
# Stricter than the import check above: any ``obj._name`` (not ``self``/``cls``) whose
# ``_name`` this module does not define itself -- a read of another module's object, or of
# torch's, numpy's or Python's internals. torch's, numpy's and Python's private APIs are read
# in ``core.compat`` alone, checked once at import; the integrations use the public loader.

# Reads allowed anywhere: (the object as written, or "*" for any, attribute) -> why.
ALLOWED_PRIVATE_READS: dict[tuple[str, str], str] = {
    # Documented in Python's library reference, underscore and all: not private API.
    ("sys", "_getframe"): "documented in the sys module's reference (the caller's frame)",
    ("os", "_exit"): "documented in the os module's reference (exit without cleanup)",
    # namedtuple's methods start with an underscore so that they cannot clash with a field.
    ("*", "_replace"): "a namedtuple's documented method",
    ("*", "_asdict"): "a namedtuple's documented method",
    ("*", "_fields"): "a namedtuple's documented attribute",
    ("*", "_make"): "a namedtuple's documented method",
}
# Modules allowed to read a framework's or library's private names: module -> {attribute: why}.
ALLOWED_PRIVATE_READS_IN: dict[str, dict[str, str]] = {
    # An integration runs the loader as the framework's own loaders run: accelerate's
    # DataLoaderShard registers itself with these, and there is no public way to.
    "resumable_loader.integrations.accelerate": {
        "_add_dataloader": "accelerate's GradientState, as its DataLoaderShard calls it",
        "_remove_dataloader": "accelerate's GradientState, as its DataLoaderShard calls it",
    },
}
# The one module that reads torch's, numpy's and Python's private APIs: each is listed in its
# PRIVATE_APIS (or the numpy/Python lists) with what it is for, and checked at import.
COMPAT = "resumable_loader.core.compat"


def _defined_names(tree: ast.AST) -> set[str]:
    """The names a module defines itself: functions, classes, assigned names and attributes,
    arguments, imports, and the strings of its ``__slots__``."""
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets):
                for const in ast.walk(node.value) if node.value is not None else ():
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        defined.add(const.value)
    return defined


def _foreign_private_reads(name: str, source: str) -> list[str]:
    """Every ``obj._name`` in ``source`` (module ``name``) that reads a private name the module
    does not define, less the allowed ones."""
    if name == COMPAT:
        return []
    tree = ast.parse(source)
    defined = _defined_names(tree)
    allowed_here = ALLOWED_PRIVATE_READS_IN.get(name, {})
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        attr = node.attr
        if not attr.startswith("_") or attr.startswith("__") or attr in defined:
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        written = ast.unparse(base)
        if (written, attr) in ALLOWED_PRIVATE_READS or ("*", attr) in ALLOWED_PRIVATE_READS:
            continue
        if attr in allowed_here:
            continue
        found.append(f"{name}:{node.lineno}: reads {written}.{attr}")
    return found


def test_no_module_reads_a_private_name_it_does_not_define() -> None:
    found = [
        r for name, path in MODULES.items() for r in _foreign_private_reads(name, path.read_text())
    ]
    assert not found, (
        "private names read across modules (torch's, numpy's and Python's go through "
        "core/compat.py; the loader's through loader.dataloader's functions for frameworks):\n"
        + "\n".join(found)
    )


def test_the_private_read_check_finds_a_read_of_another_objects_private_name() -> None:
    source = (
        "import sys, torch\n"
        "class A:\n"
        "    __slots__ = ('_mine',)\n"
        "    def f(self, loader, other):\n"
        "        self._own = sys._getframe(0)\n"
        "        other._mine\n"
        "        return loader._cursor, torch._neg_view, other._own, self._x\n"
    )
    assert _foreign_private_reads("resumable_loader.new_module", source) == [
        "resumable_loader.new_module:7: reads loader._cursor",
        "resumable_loader.new_module:7: reads torch._neg_view",
    ]
    # The framework's privates are allowed in its own integration only.
    gradient = "def f(state, loader):\n    state._add_dataloader(loader)\n"
    assert _foreign_private_reads("resumable_loader.integrations.accelerate", gradient) == []
    assert _foreign_private_reads("resumable_loader.integrations.transformers", gradient) == [
        "resumable_loader.integrations.transformers:2: reads state._add_dataloader"
    ]


def test_no_allowed_private_read_is_one_of_ours() -> None:
    # The allow-lists name Python's documented names and a framework's: never our own modules'
    # privates (those get a public door instead).
    ours = {n.rsplit(".", 1)[-1] for n in MODULES} | {"loader", "resumable_loader"}
    assert not {obj for obj, _ in ALLOWED_PRIVATE_READS} & ours
    for name, attrs in ALLOWED_PRIVATE_READS_IN.items():
        assert name.startswith("resumable_loader.integrations.")
        for path in MODULES.values():
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.Attribute, ast.Name)) and isinstance(node.ctx, ast.Store):
                    stored = node.attr if isinstance(node, ast.Attribute) else node.id
                    assert stored not in attrs, f"{stored} is ours: allow it nowhere"


@pytest.mark.parametrize("layer", sorted(RANK, key=RANK.get))
def test_a_layer_has_its_own_folder(layer: str) -> None:
    assert (PKG / layer / "__init__.py").is_file()


def test_test_files_mirror_the_folders_with_unique_names() -> None:
    """The tests mirror the package's folders; pytest imports each test file by its basename
    (rootdir-relative "prepend" mode, no __init__.py), so two files of one name in different
    folders would stop the collection of the whole run."""
    tests = PKG.parent / "tests"
    names: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}
    assert not list(tests.glob("test_*.py")), "test files live in a folder named for the layer"
