"""mixprec: mixed-precision training for PyTorch.

Policies (``Policy``), casting with FP32 islands (``cast_module``), autocast (``autocast``),
loss scaling, FP32 master weights and one object that owns the whole lifecycle
(``MixedPrecision``). See README.md for the presets and a training example.
"""

from ._autocast import autocast
from ._casting import cast_module, cast_tree, uncast_module
from ._errors import NumericsError
from ._policy import Policy

__version__ = "0.1.0"

__all__ = [
    "NumericsError",
    "Policy",
    "__version__",
    "autocast",
    "cast_module",
    "cast_tree",
    "uncast_module",
]
