"""The public surface of mixprec.numerics (house rule 1: a snapshot of __all__)."""

from mixprec import numerics


def test_all_snapshot() -> None:
    assert sorted(numerics.__all__) == [
        "AuditResult", "AuditRow", "CheckResult", "CheckThresholds", "FP32Rerun", "Log2Histogram", "ModuleNumerics",
        "NumericsMonitor", "NumericsReport", "ParamComparison", "ParamNumerics", "ScaleRange", "TensorStats",
        "Thresholds", "TraceResult", "audit", "check", "preflight", "tensor_stats", "thresholds", "trace_nonfinite",
    ]
    for name in numerics.__all__:
        assert getattr(numerics, name).__doc__, name
