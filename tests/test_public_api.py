"""The public API stays small and deliberate: adding or removing a name must change this test."""

from __future__ import annotations

import ast
import importlib
import re
import warnings
from pathlib import Path

import pytest

import mixprec

SRC = Path(mixprec.__file__).resolve().parent

EXPECTED = {
    # the training loop
    "Policy", "MixedPrecision", "StepInfo", "autocast", "cast_module", "uncast_module", "cast_tree",
    "LossScaler", "NoOpScaler", "StaticScaler", "DynamicScaler", "GradScaler", "MasterWeightOptimizer",
    "all_finite", "NumericsError", "save", "load", "EMA",
    # FP8 off for evaluation (docs/fp8.md)
    "fp8_disabled",
    # the version and the public submodules
    "__version__", "checkpoint", "distributed", "numerics", "optim",
}

# Old top-level name -> the public module that holds it now (deprecated aliases, for one release).
MOVED = {
    "convert_state_dict": "checkpoint",
    "fp32_state_dict": "checkpoint",
    "for_inference": "checkpoint",
    "NumericsMonitor": "numerics",
    "audit": "numerics",
    "check": "numerics",
    "tensor_stats": "numerics",
}

CHECKPOINT_ALL = {"CheckpointError", "convert_state_dict", "for_inference", "fp32_state_dict", "load", "save"}


def test_all_is_the_reviewed_set():
    assert set(mixprec.__all__) == EXPECTED, (
        f"added: {sorted(set(mixprec.__all__) - EXPECTED)}, removed: {sorted(EXPECTED - set(mixprec.__all__))}"
    )
    assert len(mixprec.__all__) == len(set(mixprec.__all__)), "duplicate names in __all__"


def test_every_name_resolves_and_is_documented():
    for name in mixprec.__all__:
        obj = getattr(mixprec, name)
        if name != "__version__":
            assert (obj.__doc__ or "").strip(), f"mixprec.{name} has no docstring"


def test_no_private_module_leaks_into_the_namespace_listing():
    assert not [n for n in mixprec.__all__ if n.startswith("_") and n != "__version__"]


def test_star_import_gives_exactly_all():
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # a star import must not touch deprecated names
        exec("from mixprec import *", ns)  # the statement under test
    assert set(ns) - {"__builtins__"} == set(mixprec.__all__)
    assert not set(MOVED) & set(ns)


#: Every public submodule and its reviewed ``__all__``: adding or removing a name must change this table.
SUBMODULE_ALL: dict[str, set[str]] = {
    "mixprec.optim": {"Adam", "AdamW", "Compensation", "LowPrecisionOptimizer", "SGD", "from_torch", "kahan_add_",
                      "stochastic_round"},
    "mixprec.numerics": {"AuditResult", "AuditRow", "CheckResult", "CheckThresholds", "FP32Rerun", "Fp8CastStats",
                         "Fp8LayerDecision", "Fp8Plan", "Log2Histogram", "ModuleNumerics", "NumericsMonitor",
                         "NumericsReport", "ParamComparison", "ParamNumerics", "ScaleRange", "TensorStats", "Thresholds",
                         "TraceResult", "audit", "check", "fp8_cast_stats", "fp8_plan", "preflight", "tensor_stats",
                         "thresholds", "trace_nonfinite"},
    "mixprec.distributed": {"agree_found_inf_", "fsdp_mixed_precision", "fully_shard", "is_distributed",
                            "reduce_dtype_for", "resolve_group", "wrap_ddp"},
    "mixprec.checkpoint": CHECKPOINT_ALL,
    "mixprec.integrations": set(),
    "mixprec.integrations.accelerate": {"MixprecAccelerator", "as_mixed_precision", "attach", "check_accelerator"},
    "mixprec.integrations.lightning": {"MixprecFabricPrecision", "MixprecPrecision"},
    "mixprec.integrations.transformers": {"MIXPREC_NAME", "MixprecTrainer", "MixprecTrainerMixin", "check_training_args"},
    "mixprec.bench": {"ALL_PRESETS", "BASELINE", "BUILTIN_WORKLOADS", "BenchError", "CompareResult", "DENSE_PEAK_TFLOPS",
                      "FP16Emulation", "LiveTensorTracker", "MIN_SEEDS", "NOISE_K", "RowResult", "SeedRow", "SeedsResult",
                      "Workload", "default_presets", "load_workload", "model_state_bytes", "parse_presets",
                      "parse_seeds", "peak_tflops", "resolve_device", "run_compare", "run_compare_seeds",
                      "seed_verdict"},
    "mixprec.apex": {"disable_casts", "float_function", "half_function", "initialize", "load_state_dict",
                     "master_params", "promote_function", "register_float_function", "register_half_function",
                     "register_promote_function", "scale_loss", "state_dict"},
    "mixprec.cli": {"build_parser", "main"},
}


def public_submodules() -> set[str]:
    """Every module of the package whose dotted name has no private (``_``) part."""
    out = set()
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1 and not any(p.startswith("_") for p in parts[1:]):
            out.add(".".join(parts))
    return out


def test_every_public_submodule_is_in_the_table():
    assert public_submodules() == set(SUBMODULE_ALL)


@pytest.mark.parametrize("name", sorted(SUBMODULE_ALL))
def test_submodule_all_is_the_reviewed_set(name):
    mod = importlib.import_module(name)
    got = set(mod.__all__)
    assert got == SUBMODULE_ALL[name], f"added: {sorted(got - SUBMODULE_ALL[name])}, removed: {sorted(SUBMODULE_ALL[name] - got)}"
    assert len(mod.__all__) == len(got), "duplicate names in __all__"
    for attr in mod.__all__:
        assert hasattr(mod, attr), f"{name}.{attr}"


def test_architecture_names_every_public_submodule():
    text = (SRC.parents[1] / "ARCHITECTURE.md").read_text()
    intro = text.split("## The data path")[0]
    named = set(re.findall(r"`(mixprec(?:\.[a-z][a-z_]*)+)`", intro)) | {
        f"mixprec.integrations.{m}" for m in re.findall(r"`integrations\.([a-z_]+)`", intro)}
    assert named == set(SUBMODULE_ALL), (
        f"ARCHITECTURE.md's intro omits {sorted(set(SUBMODULE_ALL) - named)}, or names {sorted(named - set(SUBMODULE_ALL))}")


def test_checkpoint_module_is_the_reviewed_set():
    assert set(mixprec.checkpoint.__all__) == CHECKPOINT_ALL
    assert mixprec.checkpoint.save is mixprec.save and mixprec.checkpoint.load is mixprec.load
    assert issubclass(mixprec.checkpoint.CheckpointError, ValueError)


@pytest.mark.parametrize("name", sorted(MOVED))
def test_moved_name_warns_and_is_the_same_object(name):
    module = MOVED[name]
    new = getattr(importlib.import_module(f"mixprec.{module}"), name)
    assert name in importlib.import_module(f"mixprec.{module}").__all__
    message = (f"mixprec.{name} is deprecated and will be removed in mixprec 0.3; "
               f"use mixprec.{module}.{name} (from mixprec.{module} import {name}).")
    with pytest.warns(DeprecationWarning, match=re.escape(message)) as record:
        old = getattr(mixprec, name)
    assert old is new
    assert record[0].filename == __file__, "the warning should point at the caller"
    with pytest.warns(DeprecationWarning, match=re.escape(f"mixprec.{name} is deprecated")):
        exec(f"from mixprec import {name} as alias", {})  # the import form users write
    assert name not in mixprec.__all__


def test_unknown_name_is_a_plain_attribute_error():
    with pytest.raises(AttributeError, match=re.escape("module 'mixprec' has no attribute 'no_such_name'")):
        mixprec.no_such_name  # noqa: B018 - the attribute access is the test
    assert not hasattr(mixprec, "uncast_modules")


# ----- layering: no import cycles between mixprec's modules -------------------------------------------------
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_imports(tree: ast.Module) -> list[ast.ImportFrom | ast.Import]:
    """Imports that run when the module is imported: module level, also inside if/try, not in functions."""
    found: list[ast.ImportFrom | ast.Import] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(block)
            elif isinstance(node, (ast.With,)):
                visit(node.body)

    visit(tree.body)
    return found


def _import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _import_time_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            for t in targets:
                if t in files and t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def test_no_import_cycles():
    graph = _import_graph()
    assert "mixprec._precision" in graph and "mixprec.checkpoint" in graph
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def dfs(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                dfs(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            dfs(start, [start])
    assert cycles == [], "import cycles (a module may import only modules below it): " + "; ".join(
        " -> ".join(c) for c in cycles
    )
