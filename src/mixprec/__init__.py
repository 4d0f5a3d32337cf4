"""mixprec: mixed-precision training for PyTorch.

Policies (``Policy``), casting with FP32 islands (``cast_module``), autocast (``autocast``),
loss scaling (``DynamicScaler``, ``GradScaler``), FP32 master weights
(``MasterWeightOptimizer``) and one object that owns the whole lifecycle
(``MixedPrecision``). Submodules: ``mixprec.optim`` (low-precision optimizers with Kahan
summation or stochastic rounding), ``mixprec.numerics`` (telemetry, tracer, pre-flight check,
audit) and ``mixprec.distributed`` (agreement across ranks, DDP and FSDP2 glue).
See README.md for the presets and a training example.
"""

from . import distributed, numerics, optim
from ._autocast import autocast
from ._casting import cast_module, cast_tree, uncast_module
from ._checkpoint import load, save
from ._errors import NumericsError
from ._finite import all_finite
from ._grad_scaler import GradScaler
from ._master import MasterWeightOptimizer
from ._policy import Policy
from ._precision import MixedPrecision, StepInfo, convert_state_dict, for_inference, fp32_state_dict
from ._scaler import DynamicScaler, LossScaler, NoOpScaler, StaticScaler
from .numerics import NumericsMonitor, audit, check, tensor_stats

__version__ = "0.1.0"

__all__ = [
    "DynamicScaler",
    "GradScaler",
    "LossScaler",
    "MasterWeightOptimizer",
    "MixedPrecision",
    "NoOpScaler",
    "NumericsError",
    "NumericsMonitor",
    "Policy",
    "StaticScaler",
    "StepInfo",
    "__version__",
    "all_finite",
    "audit",
    "autocast",
    "cast_module",
    "cast_tree",
    "check",
    "convert_state_dict",
    "distributed",
    "for_inference",
    "fp32_state_dict",
    "load",
    "numerics",
    "optim",
    "save",
    "tensor_stats",
    "uncast_module",
]
