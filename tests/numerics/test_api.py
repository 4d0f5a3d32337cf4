"""The public surface of mixprec.numerics (house rule 1: a snapshot of __all__)."""

from mixprec import numerics


def test_all_snapshot() -> None:
    assert sorted(numerics.__all__) == [
        "AuditResult", "AuditRow", "CheckResult", "CheckThresholds", "FP32Rerun", "Fp8CastStats", "Fp8LayerDecision",
        "Fp8Plan", "Log2Histogram", "ModuleNumerics", "NumericsMonitor", "NumericsReport", "ParamComparison",
        "ParamNumerics", "ScaleRange", "TensorStats", "Thresholds", "TraceResult", "audit", "check", "fp8_cast_stats",
        "fp8_plan", "preflight", "tensor_stats", "thresholds", "trace_nonfinite",
    ]
    for name in numerics.__all__:
        assert getattr(numerics, name).__doc__, name
