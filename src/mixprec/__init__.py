"""mixprec: mixed-precision training for PyTorch.

The training loop: a policy (``Policy``), one object that owns the lifecycle
(``MixedPrecision``, whose ``step`` returns a ``StepInfo``), casting with FP32 islands
(``cast_module``, ``uncast_module``, ``cast_tree``), autocast (``autocast``), loss scaling
(``LossScaler``, ``NoOpScaler``, ``StaticScaler``, ``DynamicScaler``, ``GradScaler``), FP32
master weights (``MasterWeightOptimizer``), the inf/NaN check (``all_finite``, ``NumericsError``)
and checkpoints (``save``, ``load``).

Submodules: ``mixprec.optim`` (low-precision optimizers with Kahan summation or stochastic
rounding), ``mixprec.numerics`` (telemetry, tracer, pre-flight check, audit),
``mixprec.checkpoint`` (save/load, state-dict conversion, FP32 export, inference casting) and
``mixprec.distributed`` (agreement across ranks, DDP and FSDP2 glue).
See README.md for the presets and a training example.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from . import checkpoint, distributed, numerics, optim
from ._autocast import autocast
from ._casting import cast_module, cast_tree, uncast_module
from ._checkpoint import load, save
from ._ema import EMA
from ._errors import NumericsError
from ._finite import all_finite
from ._fp8 import fp8_disabled
from ._grad_scaler import GradScaler
from ._master import MasterWeightOptimizer
from ._policy import Policy
from ._precision import MixedPrecision
from ._scaler import DynamicScaler, LossScaler, NoOpScaler, StaticScaler
from ._stepping import StepInfo
from ._version import __version__

__all__ = [
    "EMA",
    "DynamicScaler",
    "GradScaler",
    "LossScaler",
    "MasterWeightOptimizer",
    "MixedPrecision",
    "NoOpScaler",
    "NumericsError",
    "Policy",
    "StaticScaler",
    "StepInfo",
    "__version__",
    "all_finite",
    "autocast",
    "cast_module",
    "cast_tree",
    "checkpoint",
    "distributed",
    "fp8_disabled",
    "load",
    "numerics",
    "optim",
    "save",
    "uncast_module",
]

# Names that left the top level, and the public submodule that holds them now. They stay
# importable from ``mixprec`` for one release, with a DeprecationWarning naming the new place.
_MOVED = {
    "convert_state_dict": "checkpoint",
    "for_inference": "checkpoint",
    "fp32_state_dict": "checkpoint",
    "NumericsMonitor": "numerics",
    "audit": "numerics",
    "check": "numerics",
    "tensor_stats": "numerics",
}
_REMOVED_IN = "0.3"

if TYPE_CHECKING:  # type checkers see the deprecated names; at run time __getattr__ serves them
    from .checkpoint import convert_state_dict as convert_state_dict
    from .checkpoint import for_inference as for_inference
    from .checkpoint import fp32_state_dict as fp32_state_dict
    from .numerics import NumericsMonitor as NumericsMonitor
    from .numerics import audit as audit
    from .numerics import check as check
    from .numerics import tensor_stats as tensor_stats
else:

    def __getattr__(name: str) -> Any:
        """Serve a deprecated top-level name from its new module, with a DeprecationWarning."""
        module = _MOVED.get(name)
        if module is None:
            raise AttributeError(f"module 'mixprec' has no attribute {name!r}")
        warnings.warn(
            f"mixprec.{name} is deprecated and will be removed in mixprec {_REMOVED_IN}; "
            f"use mixprec.{module}.{name} (from mixprec.{module} import {name}).",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
