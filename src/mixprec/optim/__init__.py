"""Optimizers for half-precision parameters without FP32 master weights (the ``bf16-pure`` preset).

BF16 keeps 8 mantissa bits: an update below half an ulp of a weight (about 1/512 of it) rounds
away, so plain BF16 training stalls. These optimizers compute the step in FP32 and commit it with
``compensation="kahan"`` (a compensation buffer in the parameter dtype keeps the lost low bits),
``"stochastic"`` (unbiased stochastic rounding from seeded random bits) or ``"none"``. Optimizer
states are FP32 by default or BF16 (``state_dtype``) for the least memory. With FP32 parameters
they behave like ``torch.optim.AdamW``/``Adam``/``SGD``. ``fused=True`` runs each step as
``torch.compile``d kernels, or on CUDA for AdamW/Adam as one Triton kernel per bucket (equal to
the eager step bit for bit either way); the random bits of stochastic
rounding are a counter-based hash of (seed, step, buffer, global element position), so DDP
replicas and FSDP2 (``DTensor``) shards round consistently. See ``docs/optim.md``.

* :class:`AdamW`, :class:`Adam`, :class:`SGD`: the optimizers.
* :func:`from_torch`: convert a ``torch.optim.AdamW``/``Adam``/``SGD`` (groups, hyper-parameters, state).
* ``optimizer.load_full_precision_params_({param: fp32_value})``: load FP32 weights into a
  half-precision run, seeding the compensation with what the cast lost.
* :func:`stochastic_round`, :func:`kahan_add_`: the rounding primitives.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(8, 2)
    >>> w32 = {p: p.detach().clone() for p in model.parameters()}
    >>> _ = model.to(torch.bfloat16)
    >>> opt = from_torch(torch.optim.AdamW(model.parameters(), lr=1e-3), compensation="kahan")
    >>> opt.load_full_precision_params_(w32)
"""

from ._adamw import Adam, AdamW
from ._base import Compensation, LowPrecisionOptimizer
from ._convert import from_torch
from ._rounding import kahan_add_, stochastic_round
from ._sgd import SGD

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "Compensation",
    "LowPrecisionOptimizer",
    "from_torch",
    "kahan_add_",
    "stochastic_round",
]
