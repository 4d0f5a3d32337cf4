"""``mixprec.numerics``: where mixed precision goes wrong, and what to change.

* :func:`tensor_stats`: how a tensor's values would land in FP16, BF16, FP8 (e4m3, e5m2):
  largest and smallest magnitudes, fractions that are zero, flush to zero, turn subnormal or overflow
  (for FP8 also under a recipe's dynamic scaling: ``scaling="tensorwise"|"rowwise"``).
* :class:`NumericsMonitor`: sampled hooks on activations, activation gradients, parameter
  gradients and updates; :meth:`NumericsMonitor.report` names the modules at FP16 overflow
  risk, the gradient fraction lost to underflow, a loss-scale range, BF16 stagnation, FP32
  islands and a preset (the analysis of Micikevicius et al. 2018, as a report);
  :meth:`NumericsMonitor.fp8_stats`: E4M3/E5M2 saturation, underflow and SQNR of each FP8 linear's operands.
* :func:`trace_nonfinite`: run one step under hooks and name the first module (forward or
  backward, input or output) that produced inf/NaN; re-run it in FP32 to tell whether precision
  is the cause.
* :func:`check`: pre-flight comparison of one forward/backward in FP32 and under a policy
  (loss, outputs, gradients: relative error and SQNR), with a verdict and reasons;
  :func:`preflight` warns or raises on it (never switches precision).
* :func:`fp8_plan`: per ``nn.Linear`` (and Hugging Face ``Conv1D``), its GEMMs in FP8 against BF16 on your batch (amax, flushed and
  subnormal fractions per operand, SQNR per GEMM, FLOPs) and which layers stay FP8, with the reason;
  :func:`fp8_cast_stats` for one tensor under a recipe's scaling.
* :func:`audit`: the dtypes actually used for parameters, masters, gradients, accumulation,
  optimizer states and communication, with silent downgrades flagged.
* The ``mixprec doctor`` and ``mixprec check`` commands (``mixprec.cli._doctor``, ``mixprec.cli._check``).
"""

from ._audit import AuditResult, AuditRow, audit
from ._findings import ModuleNumerics, NumericsReport, ParamNumerics, ScaleRange
from ._fp8_plan import Fp8CastStats, Fp8LayerDecision, Fp8Plan, fp8_cast_stats, fp8_plan
from ._monitor import NumericsMonitor
from ._preflight import CheckResult, CheckThresholds, ParamComparison, check, preflight
from ._stats import Log2Histogram, TensorStats, Thresholds, tensor_stats, thresholds
from ._tracer import FP32Rerun, TraceResult, trace_nonfinite

__all__ = [
    "AuditResult",
    "AuditRow",
    "CheckResult",
    "CheckThresholds",
    "FP32Rerun",
    "Fp8CastStats",
    "Fp8LayerDecision",
    "Fp8Plan",
    "Log2Histogram",
    "ModuleNumerics",
    "NumericsMonitor",
    "NumericsReport",
    "ParamComparison",
    "ParamNumerics",
    "ScaleRange",
    "TensorStats",
    "Thresholds",
    "TraceResult",
    "audit",
    "check",
    "fp8_cast_stats",
    "fp8_plan",
    "preflight",
    "tensor_stats",
    "thresholds",
    "trace_nonfinite",
]
