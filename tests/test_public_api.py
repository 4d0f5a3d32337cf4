"""The public API stays small and deliberate: adding or removing a name must change this test."""

from __future__ import annotations

import mixprec

EXPECTED = {
    "DynamicScaler", "GradScaler", "LossScaler", "MasterWeightOptimizer", "MixedPrecision", "NoOpScaler",
    "NumericsError", "NumericsMonitor", "Policy", "StaticScaler", "StepInfo", "__version__", "all_finite",
    "audit", "autocast", "cast_module", "cast_tree", "check", "convert_state_dict", "distributed",
    "for_inference", "fp32_state_dict", "load", "numerics", "optim", "save", "tensor_stats", "uncast_module",
}


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


def test_submodules_have_their_own_all():
    for mod in (mixprec.optim, mixprec.numerics, mixprec.distributed):
        assert mod.__all__, mod.__name__
        for name in mod.__all__:
            assert hasattr(mod, name), f"{mod.__name__}.{name}"
