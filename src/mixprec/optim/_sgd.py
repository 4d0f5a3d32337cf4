"""SGD (momentum, dampening, Nesterov, weight decay) for BF16/FP16 parameters with compensated updates."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from ._base import DEFAULT_CHUNK_NUMEL, Compensation, LowPrecisionOptimizer
from ._parts import lr_on

__all__ = ["SGD"]


class SGD(LowPrecisionOptimizer):
    """Stochastic gradient descent whose updates survive BF16/FP16 parameters.

    Algorithm, per parameter, arithmetic in FP32 (``w`` is ``param + kahan_comp`` for
    ``compensation="kahan"``, else ``param``, upcast)::

        g = -grad if maximize else grad;  g = g / grad_scale        (when given)
        g = g + weight_decay * w
        if momentum:
            buf = g                                     on the first step
            buf = momentum * buf + (1 - dampening) * g  afterwards
            g = g + momentum * buf if nesterov else buf
        w = w - lr * g
        then param (and kahan_comp) are rounded from w as in AdamW.

    With FP32 parameters this is ``torch.optim.SGD``. Whether a step is the first is decided on
    the device from the step counter (``state["step"]``, which mixprec's SGD keeps), so a first
    step skipped by ``found_inf`` leaves the buffer uninitialised, as torch's GradScaler would.

    Bytes per parameter for BF16 parameters with momentum (param + grad + compensation +
    momentum_buffer): ``kahan`` + FP32 state 10, ``kahan`` + BF16 state 8, ``stochastic`` + BF16
    state 6; without momentum there is no state (6 with ``kahan``, 4 otherwise).

    Args:
        params: Parameters or param groups.
        lr: Learning rate.
        momentum: Momentum factor (0 disables the buffer).
        dampening: Dampening of the momentum.
        weight_decay: L2 penalty added to the gradient (as torch's SGD).
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        maximize: Maximize the objective.
        compensation, state_dtype, seed, generator, chunk_numel, fused: As :class:`mixprec.optim.AdamW`.

    Raises:
        ValueError: an invalid hyper-parameter, compensation or state dtype.

    Example:
        >>> model = torch.nn.Linear(16, 4).to(torch.bfloat16)
        >>> opt = SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, compensation="stochastic", seed=0)
        >>> model(torch.randn(2, 16, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step(); opt.zero_grad()
    """

    _ALL_STATE_KEYS = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        compensation: Compensation = "kahan",
        state_dtype: torch.dtype | str = torch.float32,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
        fused: bool | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
        }
        super().__init__(params, defaults, compensation=compensation, state_dtype=state_dtype, seed=seed,
                         generator=generator, chunk_numel=chunk_numel, fused=fused)

    def _state_keys(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        return self._ALL_STATE_KEYS if group["momentum"] != 0 else ()

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        if not group["momentum"] >= 0.0:
            raise ValueError(f"invalid momentum={group['momentum']!r}; use momentum >= 0.")
        group.setdefault("maximize", False)
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(
                f"nesterov=True needs momentum > 0 and dampening == 0 (got momentum={group['momentum']!r}, "
                f"dampening={group['dampening']!r})."
            )

    def _step_scalars(
        self, group: Mapping[str, Any], steps_old: Tensor, steps_new: Tensor, dtype: torch.dtype
    ) -> dict[str, Tensor]:
        if group["momentum"] == 0 or group["dampening"] == 0:
            return {}
        # First step: torch's buffer is a clone of g (no dampening); later ones take (1 - dampening) * g.
        return {"coef": torch.where(steps_old == 0, 1.0, 1.0 - group["dampening"]).to(dtype)}

    def _update(
        self,
        group: Mapping[str, Any],
        w: Tensor,
        grad: Tensor,
        states: dict[str, Tensor],
        scalars: Mapping[str, Tensor],
        expand: Callable[[Tensor], Tensor],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
        wd = group["weight_decay"]
        if isinstance(lr, Tensor):
            lr = lr_on(lr, w.device, w.dtype)
        # Single-rounding ops only (see AdamW._update: eager and compiled steps agree bit for bit).
        # In-place ops only on this function's own temporaries (inputs are read-only), as AdamW._update.
        g = grad.neg() if group["maximize"] else grad
        if wd != 0:
            g = (w * wd).add_(g)  # g + w * wd
        new: dict[str, Tensor] = {}
        if momentum != 0:
            buf = states["momentum_buffer"]
            if dampening == 0:
                # First step: buf is 0, so momentum * 0 + g == g, torch's clone of g.
                buf = (buf * momentum).add_(g)
            else:
                buf = (buf * momentum).add_(g * expand(scalars["coef"]))
            new["momentum_buffer"] = buf
            g = (buf * momentum).add_(g) if group["nesterov"] else buf
        w_new = (g * lr).neg_().add_(w)  # w - g * lr (x - y == -y + x exactly, signed zeros included)
        return w_new, new
