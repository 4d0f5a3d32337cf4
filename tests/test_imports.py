"""The package's import graph: no cycles among module-level imports, and every module imports on its own.

The graph is read statically from each module's AST:

* *module-level* edges run when the module is imported: top-level ``import``/``from ... import``,
  also inside ``if``/``try``/``with`` blocks and class bodies, but not under
  ``if TYPE_CHECKING:`` (never run);
* *lazy* edges run when a function is called: imports inside ``def`` bodies;
* *type-only* edges sit under ``if TYPE_CHECKING:``.

A cycle among module-level or lazy edges fails (ARCHITECTURE.md, "Layering": no import cycles): a lazy
import that closes a cycle hides a layering mistake (the lower module needs something of the
upper one), even though Python can run it. The exceptions are listed in ``ALLOWED_CYCLES``, each
with its reason (none today). Cycles that need a type-only edge never run, but fail too unless
listed in ``ALLOWED_TYPE_CYCLES``: a lower module should not name an upper one's types.

``from . import x`` is an edge to the submodule ``x`` when there is one, else to the package's
``__init__`` (it needs a name the package defines); ``from .x import y`` is an edge to ``x`` (and
to ``x.y`` when that is a submodule). The implicit "a submodule needs its parent package"
dependency is left out: every submodule would otherwise be in a cycle with ``__init__``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "mixprec"

#: Cycles through lazy imports that are accepted, as the tuple of their modules in the order
#: ``format_cycles`` prints them (smallest name first) -> why. Empty: the package has none. An entry
#: must name a cycle that exists (``test_allowed_cycles_are_real``), so a fixed one is removed here.
ALLOWED_CYCLES: dict[tuple[str, ...], str] = {}
#: Cycles that close through a TYPE_CHECKING import and are kept on purpose, with the reason (none today).
ALLOWED_TYPE_CYCLES: dict[tuple[str, ...], str] = {}


@dataclass(frozen=True)
class Edge:
    """One import statement's dependency of ``source`` on ``target`` (both dotted module names)."""

    source: str
    target: str
    kind: str  # "module", "lazy" or "type"
    line: int

    def where(self, files: dict[str, Path]) -> str:
        path = files[self.source]
        try:
            path = path.relative_to(Path.cwd())
        except ValueError:
            pass
        return f"{self.source} -> {self.target} ({path}:{self.line}, {self.kind})"


def package_modules(package: str = PACKAGE, root: Path | None = None) -> dict[str, Path]:
    """Every module of ``package`` (dotted name -> file), found on disk without importing it."""
    if root is None:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, f"{package} is not an importable package"
        root = Path(next(iter(spec.submodule_search_locations)))
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = [package, *rel.parts]
        if parts[-1] == "__init__":
            parts.pop()
        if any(not p.isidentifier() for p in parts):
            continue
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_edges(name: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """The import edges of one module into the package (see the module notes for the rules)."""
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    edges: list[Edge] = []

    def resolve(node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def add(target: str, kind: str, line: int) -> None:
        if target != PACKAGE and not target.startswith(PACKAGE + "."):
            return
        # the deepest module the dotted name names (import mixprec.numerics._stats -> that module)
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in modules and target != name:
            edges.append(Edge(name, target, kind, line))

    def visit(nodes: list[ast.stmt], kind: str) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, kind, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                mod = resolve(node)
                for alias in node.names:
                    sub = f"{mod}.{alias.name}"
                    if sub in modules:  # from . import x / from .pkg import sub: the submodule
                        add(sub, kind, node.lineno)
                    else:  # a name defined by mod (a package's __init__ or a module)
                        add(mod, kind, node.lineno)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, "lazy" if kind == "module" else kind)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, "type")
                visit(node.orelse, kind)
            else:  # if/try/with/for/while/class/match bodies run with their parent
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    for child in getattr(node, field, None) or []:
                        visit(child.body if isinstance(child, (ast.ExceptHandler, ast.match_case)) else [child], kind)

    visit(tree.body, "module")
    return edges


def import_graph(modules: dict[str, Path]) -> list[Edge]:
    """Every edge of every module."""
    return [e for name, path in modules.items() for e in import_edges(name, path, modules)]


def find_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """The shortest cycle through each module that is on one, deduplicated, sorted.

    Tarjan's strongly connected components first (a module is on a cycle iff its component
    has more than one member; self-imports are not edges), then a breadth-first search inside
    the component for the shortest way back to the module.
    """
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        graph.setdefault(e.source, {}).setdefault(e.target, e)
        graph.setdefault(e.target, {})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []

    def strongconnect(v: str) -> None:  # recursive: the package has tens of modules, not thousands
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    def shortest_cycle(start: str, members: set[str]) -> list[Edge]:
        prev: dict[str, Edge] = {}
        frontier, seen = [start], {start}
        while frontier:
            nxt = []
            for v in frontier:
                for w, e in sorted(graph[v].items()):
                    if w == start:
                        path = [e]
                        while path[0].source != start:
                            path.insert(0, prev[path[0].source])
                        return path
                    if w in members and w not in seen:
                        seen.add(w)
                        prev[w] = e
                        nxt.append(w)
            frontier = nxt
        raise AssertionError(f"{start} is in a strongly connected component but on no cycle")

    cycles: dict[tuple[str, ...], list[Edge]] = {}
    for comp in sccs:
        for v in comp:
            c = shortest_cycle(v, set(comp))
            first = min(range(len(c)), key=lambda i: c[i].source)  # rotate: the smallest name first
            c = c[first:] + c[:first]
            cycles.setdefault(tuple(e.source for e in c), c)
    return [cycles[k] for k in sorted(cycles)]


def format_cycles(cycles: list[list[Edge]], files: dict[str, Path]) -> str:
    return "\n".join(
        "cycle " + " -> ".join([c[0].source] + [e.target for e in c]) + ":\n"
        + "\n".join("    " + e.where(files) for e in c)
        for c in cycles
    )


# ----- the package ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    return package_modules()


@pytest.fixture(scope="module")
def edges(modules: dict[str, Path]) -> list[Edge]:
    return import_graph(modules)


def test_no_import_cycle_at_module_level(modules, edges):
    cycles = find_cycles([e for e in edges if e.kind == "module"])
    assert not cycles, (
        f"{len(cycles)} import cycle(s) among module-level imports (ARCHITECTURE.md, Layering: core -> distributed -> "
        f"integrations, bench, cli; no cycles). Move the shared code down a layer (e.g. mixprec._dist), or import "
        f"the upper module inside the function that needs it:\n{format_cycles(cycles, modules)}"
    )


def test_no_import_cycle_through_lazy_imports(modules, edges):
    """Cycles that close through an import inside a function: they run, so they fail too (unless allowed)."""
    cycles = find_cycles([e for e in edges if e.kind in ("module", "lazy")])
    bad = [c for c in cycles if tuple(e.source for e in c) not in ALLOWED_CYCLES]
    assert not bad, (
        f"{len(bad)} import cycle(s) through imports inside functions. The lower module needs something of the "
        f"upper one: move that piece into a private leaf both can import (as mixprec._dist, mixprec._version, "
        f"mixprec.bench._environment, mixprec.optim._convert), or pass it in as an argument. A cycle that must stay "
        f"goes into ALLOWED_CYCLES with its reason:\n{format_cycles(bad, modules)}"
    )


def test_allowed_cycles_are_real(edges):
    cycles = {tuple(e.source for e in c) for c in find_cycles([e for e in edges if e.kind in ("module", "lazy")])}
    stale = sorted(set(ALLOWED_CYCLES) - cycles)
    assert not stale, f"ALLOWED_CYCLES lists cycles the package no longer has; remove them: {stale}"


def _type_only_cycles(edges: list[Edge]) -> list[list[Edge]]:
    cycles = find_cycles([e for e in edges if e.kind in ("module", "lazy", "type")])
    return [c for c in cycles if any(e.kind == "type" for e in c)
            and tuple(e.source for e in c) not in ALLOWED_TYPE_CYCLES]


def test_cycles_through_type_only_imports_fail_unless_allowed(modules, edges):
    """A cycle that closes only through a TYPE_CHECKING import never runs, but a lower module still names an
    upper one's types: move the type (a Protocol) down, or list the cycle in ALLOWED_TYPE_CYCLES with its reason."""
    typed = _type_only_cycles(edges)
    assert not typed, f"{len(typed)} import cycle(s) through type-only imports:\n{format_cycles(typed, modules)}"


def test_the_type_only_check_can_fail():
    """The check above sees a planted cycle (so its passing means something)."""
    planted = [Edge("mixprec._low", "mixprec._high", "type", 1), Edge("mixprec._high", "mixprec._low", "module", 1)]
    assert len(_type_only_cycles(planted)) == 1


def test_the_graph_sees_the_package(modules, edges):
    # a guard against a walker that silently finds nothing
    assert {"mixprec", "mixprec._scaler", "mixprec._scale_history", "mixprec._dist", "mixprec.distributed"} <= set(modules)
    got = {(e.source, e.target, e.kind) for e in edges}
    assert ("mixprec._scaler", "mixprec._scale_history", "module") in got
    assert ("mixprec", "mixprec.distributed", "module") in got
    # the private leaves import nothing from mixprec (beyond _dtypes/_errors)
    for leaf in ("mixprec._dist", "mixprec._version", "mixprec._tree"):
        assert {e.target for e in edges if e.source == leaf} <= {"mixprec._dtypes", "mixprec._errors"}, leaf
    # the core reads the rank agreement and the prepare checks from the leaf, never from the public glue
    core = [m for m in {e.source for e in edges} if m.startswith("mixprec._") and "." not in m[len("mixprec."):]]
    assert not [e for e in edges if e.source in core and e.target == "mixprec.distributed" and e.kind != "type"]


def test_the_version_has_one_home():
    # mixprec._version is what pyproject.toml builds with and what the CLI and checkpoints record
    import mixprec
    import mixprec._version

    assert mixprec.__version__ == mixprec._version.__version__


_IMPORT_EACH = textwrap.dedent("""
    import importlib, importlib.machinery, importlib.util, json, sys, traceback

    names, package, root, pyc = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    import torch  # kept loaded: only the package's own modules are cleared between imports

    # Each module's source is compiled once, not at each of its ~140 imports (machines that set
    # PYTHONDONTWRITEBYTECODE would recompile it every time): byte code goes to a private folder.
    sys.pycache_prefix, sys.dont_write_bytecode = pyc, False

    def clear():
        for mod in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[mod]

    def stub_parents(name):
        # the parent packages as empty shells with the right __path__: the module runs with only the
        # imports it makes itself, not those of the package __init__ that normally runs first
        parts = name.split(".")
        for i in range(1, len(parts)):
            pkg = ".".join(parts[:i])
            spec = importlib.machinery.ModuleSpec(pkg, None, is_package=True)
            spec.submodule_search_locations = [root + "/" + "/".join(parts[1:i])]
            sys.modules[pkg] = importlib.util.module_from_spec(spec)

    failures = {}
    for name in names:
        for mode in ("package", "alone"):
            clear()
            if mode == "alone":
                if name == package:
                    continue
                stub_parents(name)
            try:
                importlib.import_module(name)
            except BaseException as e:
                failures[f"{name} ({mode})"] = "".join(traceback.format_exception_only(type(e), e)).strip()
    print(json.dumps(failures))
""")


def test_every_module_imports_on_its_own(modules, tmp_path):
    """Each module imports in a fresh interpreter state: after the package (entry through ``__init__``), and
    alone (parents stubbed, so a module that needs a partly initialised package or an import cycle fails)."""
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.submodule_search_locations
    root = str(next(iter(spec.submodule_search_locations)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _IMPORT_EACH, json.dumps(sorted(modules)), PACKAGE, root,
                           str(tmp_path / "pyc")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failures, "modules that do not import on their own:\n" + "\n".join(
        f"  {k}: {v}" for k, v in sorted(failures.items()))


# ----- the checker itself --------------------------------------------------------------------------
def _write_package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    root = tmp_path / PACKAGE
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text), encoding="utf-8")
    return package_modules(root=root)


def test_checker_finds_module_level_cycles_and_classifies_lazy_ones(tmp_path):
    mods = _write_package(tmp_path, {
        "__init__.py": "from . import a\nfrom .sub import helper\n",
        "a.py": "from ._b import x\nimport mixprec.sub.deep\n",
        "_b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\nelse:\n    pass\n"
                  "try:\n    from .a import y\nexcept ImportError:\n    y = None\nx = 1\n"),
        "c.py": "def f():\n    from ._b import x\n    return x\nclass K:\n    from . import a\n",
        "sub/__init__.py": "from .deep import helper\n",
        "sub/deep.py": "def helper():\n    from .. import __version__\n",
    })
    edges = import_graph(mods)
    got = {(e.source, e.target, e.kind) for e in edges}
    assert got == {
        ("mixprec", "mixprec.a", "module"), ("mixprec", "mixprec.sub", "module"),
        ("mixprec.a", "mixprec._b", "module"), ("mixprec.a", "mixprec.sub.deep", "module"),
        ("mixprec._b", "mixprec.c", "type"), ("mixprec._b", "mixprec.a", "module"),
        ("mixprec.c", "mixprec._b", "lazy"), ("mixprec.c", "mixprec.a", "module"),
        ("mixprec.sub", "mixprec.sub.deep", "module"), ("mixprec.sub.deep", "mixprec", "lazy"),
    }
    module_cycles = find_cycles([e for e in edges if e.kind == "module"])
    assert [[e.source for e in c] for c in module_cycles] == [["mixprec._b", "mixprec.a"]]
    text = format_cycles(module_cycles, mods)
    assert "cycle mixprec._b -> mixprec.a -> mixprec._b" in text and "_b.py:7, module" in text
    every = {tuple(e.source for e in c): {e.kind for e in c} for c in find_cycles(edges)}
    assert every[("mixprec._b", "mixprec.a")] == {"module"}
    assert every[("mixprec._b", "mixprec.c")] == {"type", "lazy"}  # legal: reported, not failed
    assert every[("mixprec", "mixprec.sub", "mixprec.sub.deep")] == {"module", "lazy"}
    # and without the module-level cycle there is none
    mods = _write_package(tmp_path, {"_b.py": "x = 1\n"})
    assert find_cycles([e for e in import_graph(mods) if e.kind == "module"]) == []


# ----- ARCHITECTURE.md's module order, kept true ------------------------------------------------------------------
ARCHITECTURE = Path(__file__).resolve().parents[1] / "ARCHITECTURE.md"
#: Imports inside functions from a core module to a module after it (or above the core), kept on purpose: optional or
#: heavy features loaded only when used. Each is named in ARCHITECTURE.md's "Layering".
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    ("mixprec._precision", "mixprec.numerics"): "prepare(check_batch=...) runs the pre-flight check; f8_layers=auto plans",
}


def _core_order() -> list[str]:
    """The core modules in ARCHITECTURE.md's "Core, bottom to top" table, as dotted names (a package: its name)."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("Core, bottom to top"):text.index("On top of the core")]
    names = re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)
    return ["mixprec." + n.removesuffix(".py").removesuffix("/") for n in names]


def _layer_of(module: str, order: list[str]) -> int | None:
    """Position of ``module`` (or of the core package holding it) in ``order``; None for modules above the core."""
    for i, name in enumerate(order):
        if module == name or module.startswith(name + "."):
            return i
    return None


def test_architecture_lists_every_core_module(modules):
    order = _core_order()
    core = {m for m in modules if m.count(".") == 1 and m.split(".")[1].startswith("_") and m.split(".")[1] not in
            ("__init__", "__main__")} | {"mixprec.optim"}
    assert set(order) == core, f"missing from ARCHITECTURE.md: {sorted(core - set(order))}; gone: {sorted(set(order) - core)}"


def test_core_modules_import_only_modules_above_them(edges):
    """ARCHITECTURE.md: "a module imports only modules above it in this list" (module-level and lazy imports)."""
    order = _core_order()
    bad = []
    for e in edges:
        if e.kind == "type":
            continue
        src = _layer_of(e.source, order)
        if src is None:
            continue  # modules on top of the core may import any core module
        dst = _layer_of(e.target, order)
        if dst == src:
            continue  # inside one package (optim)
        upward = (dst is None and e.target.startswith("mixprec.")) or (dst is not None and dst > src)
        top = next((n for n in order if e.source == n or e.source.startswith(n + ".")), e.source)
        target_top = e.target if dst is None else order[dst]
        if upward and (top, ".".join(target_top.split(".")[:2])) not in ALLOWED_UPWARD:
            bad.append(f"{e.source} -> {e.target} ({e.kind}, line {e.line})")
    assert not bad, ("core modules importing a module listed after them in ARCHITECTURE.md (move the piece down, or "
                     "reorder the table if the order is wrong):\n" + "\n".join(sorted(set(bad))))


def test_allowed_upward_imports_are_real(edges):
    order = _core_order()
    seen = {(e.source if _layer_of(e.source, order) is None else order[_layer_of(e.source, order)],  # type: ignore[index]
             ".".join(e.target.split(".")[:2])) for e in edges}
    assert set(ALLOWED_UPWARD) <= seen, sorted(set(ALLOWED_UPWARD) - seen)


def test_module_names_are_unique_across_the_package(modules):
    """One name, one module: ``_report`` in two packages made a reader open the wrong one."""
    by_name: dict[str, list[str]] = {}
    for m in modules:
        last = m.rsplit(".", 1)[-1]
        if last not in ("__init__", "__main__") and m.count("."):
            by_name.setdefault(last, []).append(m)
    assert not {k: v for k, v in by_name.items() if len(v) > 1}
