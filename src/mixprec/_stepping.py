"""The one skip-or-step protocol: run an optimizer's step unless ``found_inf`` says skip.

Every path that steps an optimizer for mixprec (``MixedPrecision.step``,
``MasterWeightOptimizer.step``, ``GradScaler.step``, the guarded ``optimizer.step()`` of a
prepared optimizer) ends here, so the decision is made the same way everywhere: on the device
for optimizers that accept ``grad_scale``/``found_inf`` (``_step_supports_amp_scaling``),
with one named host read otherwise.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ._finite import unscale_and_check_

__all__ = ["step_optimizer", "step_with_result"]


def step_with_result(optimizer: Any, found_inf: Tensor, grad_scale: Tensor | None, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[Tensor, Any]:
    """step_optimizer's body, also returning what ``optimizer.step`` returned (None when skipped)."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        sentinel = object()
        old = (getattr(optimizer, "grad_scale", sentinel), getattr(optimizer, "found_inf", sentinel))
        optimizer.grad_scale = grad_scale
        optimizer.found_inf = found_inf
        try:
            ret = optimizer.step(*args, **kwargs)
        finally:
            for name, value in zip(("grad_scale", "found_inf"), old):
                if value is sentinel:
                    try:
                        delattr(optimizer, name)
                    except AttributeError:
                        pass
                else:
                    setattr(optimizer, name, value)
        return found_inf > 0, ret
    if grad_scale is not None:
        # the optimizer cannot unscale: do it here, fused, and fold its flag in
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        found_inf = unscale_and_check_(grads, grad_scale.double().reciprocal().float(), found_inf.clone())
    skipped = found_inf > 0
    # Host sync: this optimizer cannot skip on the device, so the host decides whether to call it.
    if bool(skipped.item()):
        return skipped, None
    return skipped, optimizer.step(*args, **kwargs)


def step_optimizer(optimizer: Any, found_inf: Tensor, grad_scale: Tensor | None = None, *args: Any,
                   **kwargs: Any) -> Tensor:
    """Run ``optimizer.step(*args, **kwargs)`` unless ``found_inf`` says to skip; return ``skipped``.

    * Optimizers with ``_step_supports_amp_scaling`` (torch's ``fused=True`` Adam/AdamW/SGD,
      ``mixprec.optim``, ``MasterWeightOptimizer``): ``optimizer.grad_scale`` and
      ``optimizer.found_inf`` are set as ``torch.amp.GradScaler`` does, ``step`` is called and
      skips on the device, and the attributes are removed again. No host sync.
    * Any other optimizer: exactly one host sync (reading ``found_inf``) decides whether to call
      ``step``. A ``grad_scale`` is then applied first by a fused unscale of its gradients.

    Args:
        optimizer: A ``torch.optim.Optimizer`` (or anything with ``step`` and ``param_groups``).
        found_inf: 0-d float32 flag from ``unscale_`` (non-zero: skip).
        grad_scale: Scale the gradients still carry (``None``: already unscaled).
        *args, **kwargs: Passed to ``optimizer.step``.

    Returns:
        ``skipped``: 0-d bool tensor on ``found_inf``'s device.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.ones(2)
        >>> opt = torch.optim.SGD([p], lr=0.5, fused=True)
        >>> bool(step_optimizer(opt, torch.tensor(1.0))), p.tolist()
        (True, [1.0, 1.0])
    """
    return step_with_result(optimizer, found_inf, grad_scale, args, kwargs)[0]
