"""AdamW (and Adam) for BF16/FP16 parameters with Kahan-compensated or stochastically rounded updates."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from ._base import DEFAULT_CHUNK_NUMEL, Compensation, LowPrecisionOptimizer
from ._parts import lr_on

__all__ = ["Adam", "AdamW"]


class AdamW(LowPrecisionOptimizer):
    """AdamW (Loshchilov & Hutter) whose updates survive BF16/FP16 parameters.

    Algorithm, per parameter, arithmetic in FP32 (``w`` is ``param + kahan_comp`` for
    ``compensation="kahan"``, else ``param``, upcast)::

        g = -grad if maximize else grad;  g = g / grad_scale            (when given)
        g = g + weight_decay * w                                         (decoupled_weight_decay=False: Adam's L2)
        w = w * (1 - lr * weight_decay)                                  (decoupled_weight_decay=True: AdamW)
        m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g;  t = step + 1
        v_hat = max(v_max, v) if amsgrad else v
        w = w - lr / (1 - beta1**t) * m / (sqrt(v_hat) / sqrt(1 - beta2**t) + eps)
        param = round(w); kahan_comp = stochastic_round(w - param)      ("kahan")
        param = stochastic_round(w)                                      ("stochastic")
        param = round(w)                                                 ("none")

    With FP32 parameters this is ``torch.optim.AdamW`` (same operation order; tested to agree
    within FP32 rounding). Bias corrections are computed in FP64 on the device from each
    parameter's step counter. Multi-tensor: see :mod:`mixprec.optim._base` for how a step is
    chunked, gathered and committed, and for the cost of skipping on ``found_inf``.

    Bytes per parameter (param + grad + compensation + exp_avg + exp_avg_sq) for BF16 parameters:
    ``kahan`` + FP32 states 2+2+2+4+4 = 14; ``kahan`` + BF16 states 10; ``stochastic`` or
    ``none`` + BF16 states 8; FP32 parameters + FP32 states 16 (amsgrad adds one state).

    Args:
        params: Parameters or param groups (as torch.optim).
        lr: Learning rate (float or 1-element tensor).
        betas: ``(beta1, beta2)``.
        eps: Added to the denominator.
        weight_decay: Decoupled (AdamW) by default.
        amsgrad: Keep the running maximum of ``exp_avg_sq`` (one more state).
        maximize: Maximize the objective.
        decoupled_weight_decay: ``False`` gives Adam's L2 penalty added to the gradient.
        compensation: ``"kahan"`` (default; a compensation buffer in the parameter dtype),
            ``"stochastic"`` (unbiased rounding from random bits) or ``"none"`` (round to
            nearest: updates below half an ulp are lost). Only FP16/BF16 parameters are
            affected; FP32 parameters (FP32 islands) are updated exactly as with FP32 AdamW.
        state_dtype: ``torch.float32`` (default) or ``torch.bfloat16`` for ``exp_avg``,
            ``exp_avg_sq`` (and ``max_exp_avg_sq``). BF16 states are stored with stochastic
            rounding, since round-to-nearest would freeze ``exp_avg_sq`` (its per-step change at
            ``beta2=0.999`` is below half a BF16 ulp). FP64 parameters keep FP64 states.
        seed: The run's seed for stochastic rounding (default ``torch.initial_seed()``, so
            ``torch.manual_seed`` makes runs reproducible). The random bits are a counter-based
            hash of (seed, step, buffer, global element position): DDP replicas with one seed
            round identically, ``DTensor`` shards like the unsharded tensor (``docs/optim.md``).
        generator: Deprecated: only its ``initial_seed()`` is used, as ``seed``.
        chunk_numel: Elements per tile of the eager multi-tensor step (default 2**24; a CPU
            uses at most 2**17). The step's temporaries are about 40-48 bytes per tile element
            (~0.7 GiB by default on a GPU); smaller tiles use less memory and more host time.
            It also caps the fused step's tile (2**16 elements on a CPU, 2**23 elsewhere, 2**21 for
            a bucket of at most 2**22 elements).
        fused: ``True``: each (group, device, dtype) bucket steps through one ``torch.compile``d
            tile step, or on CUDA (not ``amsgrad``, BF16 or FP32 parameters) one Triton kernel
            over all its tensors (``_triton_step``), equal to the eager step bit for bit (first-step
            compile time in ``compile_seconds``, cached process-wide per configuration, not per
            parameter shape);
            ``False``: the eager foreach step; ``None`` (default): fused on CUDA/XPU with Triton,
            eager on CPU (the rule and measurements: ``docs/optim.md``, :meth:`fused_enabled`).

    Raises:
        ValueError: an invalid hyper-parameter, compensation or state dtype; an unsupported
            parameter dtype.

    Example:
        >>> model = torch.nn.Linear(16, 4).to(torch.bfloat16)
        >>> opt = AdamW(model.parameters(), lr=1e-3, compensation="kahan", state_dtype=torch.bfloat16)
        >>> model(torch.randn(2, 16, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step(); opt.zero_grad()
        >>> sorted(opt.state[model.weight])
        ['exp_avg', 'exp_avg_sq', 'kahan_comp', 'step']
    """

    _ALL_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _DECOUPLED_DEFAULT = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool | None = None,
        compensation: Compensation = "kahan",
        state_dtype: torch.dtype | str = torch.float32,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
        fused: bool | None = None,
    ) -> None:
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._DECOUPLED_DEFAULT
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        super().__init__(params, defaults, compensation=compensation, state_dtype=state_dtype, seed=seed,
                         generator=generator, chunk_numel=chunk_numel, fused=fused)

    def _state_keys(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        return self._ALL_STATE_KEYS if group["amsgrad"] else self._ALL_STATE_KEYS[:2]

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas={betas!r}; use a pair (beta1, beta2).")
        b1, b2 = (float(b) for b in betas)
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas={betas!r}; each beta must be in [0, 1).")
        group["betas"] = (b1, b2)
        if not group["eps"] >= 0.0:
            raise ValueError(f"invalid eps={group['eps']!r}; use eps >= 0.")
        group.setdefault("decoupled_weight_decay", self._DECOUPLED_DEFAULT)
        group.setdefault("maximize", False)
        group.setdefault("amsgrad", False)

    def _step_scalars(
        self, group: Mapping[str, Any], steps_old: Tensor, steps_new: Tensor, dtype: torch.dtype
    ) -> dict[str, Tensor]:
        lr = group["lr"]
        beta1, beta2 = group["betas"]
        f64 = torch.float64 if steps_new.device.type != "mps" else torch.float32
        if isinstance(lr, Tensor):
            lr = lr_on(lr, steps_new.device, f64)
        # Bias corrections in FP64 (as torch computes them in Python), one per segment.
        t = steps_new.to(f64)
        step_size = lr / (1 - torch.pow(beta1, t))
        bc2_sqrt = (1 - torch.pow(beta2, t)).sqrt_()
        return {"step_size": step_size.to(dtype), "bc2_sqrt": bc2_sqrt.to(dtype)}

    def _update(
        self,
        group: Mapping[str, Any],
        w: Tensor,
        grad: Tensor,
        states: dict[str, Tensor],
        scalars: Mapping[str, Tensor],
        expand: Callable[[Tensor], Tensor],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        lr = group["lr"]
        # Python floats (or a 0-d FP64 lr tensor), whatever the user's form, also when a scheduler
        # writes them mid-run: a (1,)-shaped lr would promote the decayed weight to FP64, a NumPy
        # FP32 scalar compute 1 - lr * wd or 1 - beta in FP32 (each then differing from a float,
        # from the fused steps and from the others).
        beta1, beta2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        if not type(beta1) is type(beta2) is type(eps) is type(wd) is float:  # (no call on the usual path)
            beta1, beta2, eps, wd = (_number(v) for v in (beta1, beta2, eps, wd))
        if isinstance(lr, Tensor):
            lr = lr_on(lr, w.device, torch.float64 if w.device.type != "mps" else torch.float32).reshape(())
        elif type(lr) is not float:
            lr = float(lr)
        # Only single-rounding ops (+ - * / sqrt), no lerp/addcmul/alpha=: ATen's CPU kernels fuse
        # those into FMAs and Inductor (fp-contract off) does not, so the compiled step (fused=True)
        # equals this eager one bit for bit only when no op has a fused form.
        # In-place ops only on this function's own temporaries (inputs are read-only): the same
        # single rounding per op, fewer fresh buffers (each costs page faults on a CPU).
        g = grad.neg() if group["maximize"] else grad
        decoupled = group["decoupled_weight_decay"]
        if wd != 0 and not decoupled:
            g = (w * wd).add_(g)  # g + w * wd
        w_new = w * (1 - lr * wd) if wd != 0 and decoupled else w
        m_old = states["exp_avg"]
        m = (g - m_old).mul_(1 - beta1).add_(m_old)  # torch's lerp(m, g, 1 - beta1), unfused: m + (g - m) * (1 - beta1)
        v = (states["exp_avg_sq"] * beta2).add_((g * g).mul_(1 - beta2))
        new = {"exp_avg": m, "exp_avg_sq": v}
        if group["amsgrad"]:
            v_hat = torch.maximum(states["max_exp_avg_sq"], v)
            new["max_exp_avg_sq"] = v_hat
        else:
            v_hat = v
        denom = v_hat.sqrt().div_(expand(scalars["bc2_sqrt"])).add_(eps)
        # torch: param.addcdiv_(exp_avg, denom, value=-step_size) == w - (step_size * m) / denom
        delta = (m * expand(scalars["step_size"])).div_(denom)
        w_new = w_new.sub_(delta) if w_new is not w else delta.neg_().add_(w)  # w - delta, exactly
        return w_new, new


def _number(v: Any) -> Any:
    """A hyper-parameter as a Python float (a NumPy scalar, an int), or the tensor a user gave."""
    return v if isinstance(v, Tensor) else float(v)


class Adam(AdamW):
    """Adam: :class:`AdamW` with ``weight_decay=0`` and L2 weight decay (added to the gradient) by default.

    ``decoupled_weight_decay=True`` makes it AdamW, as in ``torch.optim.Adam``. All other
    arguments, the compensation modes and the memory figures are those of :class:`AdamW`.

    Example:
        >>> opt = Adam(torch.nn.Linear(4, 2).parameters(), lr=1e-3, weight_decay=1e-4)
        >>> opt.param_groups[0]["decoupled_weight_decay"]
        False
    """

    _DECOUPLED_DEFAULT = False

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
        compensation: Compensation = "kahan",
        state_dtype: torch.dtype | str = torch.float32,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
        fused: bool | None = None,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=decoupled_weight_decay, compensation=compensation,
                         state_dtype=state_dtype, seed=seed, generator=generator, chunk_numel=chunk_numel,
                         fused=fused)
