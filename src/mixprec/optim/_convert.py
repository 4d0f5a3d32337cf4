"""``from_torch``: a ``torch.optim.AdamW``/``Adam``/``SGD`` -> the mixprec optimizer of the same algorithm.

Apart from :mod:`._base` so the base class does not import its subclasses back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from ._adamw import Adam, AdamW
from ._base import DEFAULT_CHUNK_NUMEL, Compensation, LowPrecisionOptimizer
from ._sgd import SGD

__all__ = ["from_torch"]

# group keys of torch's optimizers that mixprec's do not use (kept in the shared group dicts, ignored)
_IGNORED_TORCH_KEYS = ("foreach", "fused", "capturable")
#: The per-optimizer hook registries of ``torch.optim.Optimizer`` (torch >= 2.2), shared by the converted optimizer.
_HOOK_DICTS = (
    "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
)



def from_torch(
    optimizer: Optimizer,
    compensation: Compensation = "kahan",
    state_dtype: torch.dtype | str = torch.float32,
    *,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    fused: bool | None = None,
) -> LowPrecisionOptimizer:
    """Convert a ``torch.optim.AdamW``, ``Adam`` or ``SGD`` into the mixprec optimizer of the same algorithm.

    * ``AdamW`` -> :class:`mixprec.optim.AdamW`; ``Adam`` -> :class:`mixprec.optim.Adam` (L2
      weight decay added to the gradient, as torch's Adam, or decoupled when the torch group says
      ``decoupled_weight_decay=True``); ``SGD`` -> :class:`mixprec.optim.SGD`.
    * ``param_groups``: the converted optimizer uses *the same group dicts* as ``optimizer``, so an
      LR scheduler built on the torch optimizer keeps driving the learning rate. ``defaults`` are
      ``optimizer``'s (the hyper-parameters it was built with), so ``add_param_group`` fills a new
      group as torch would. Keys mixprec
      does not use (``foreach``, ``fused``, ``capturable``) stay in them and are ignored.
    * Hooks registered on ``optimizer`` (step pre/post, ``state_dict`` and ``load_state_dict``
      pre/post) are shared: they run around the converted optimizer's calls, with the converted
      optimizer as their first argument, and their handles still remove them.
    * torch's "``lr_scheduler.step()`` before ``optimizer.step()``" check of a scheduler built on
      ``optimizer`` follows the converted optimizer's steps: it warns exactly when it would have
      for ``optimizer`` stepped itself (a step taken before the conversion counts).
    * State (step counts, moments, momentum buffers) is carried over into ``state_dtype`` on each
      parameter's device; tensors already in the right dtype/device are shared, not copied.
      Compensation buffers start at zero: call :meth:`~LowPrecisionOptimizer.load_full_precision_params_`
      with the FP32 weights to seed them with what a cast to half precision lost.

    Do not step ``optimizer`` afterwards.

    Args:
        optimizer: The torch optimizer (exactly one of the three classes; subclasses may change
            the algorithm and are refused).
        compensation: ``"kahan"`` (default), ``"stochastic"`` or ``"none"``.
        state_dtype: ``torch.float32`` (default) or ``torch.bfloat16``.
        seed, generator, chunk_numel, fused: As the mixprec optimizers' constructors (the torch
            group's own ``fused`` flag is ignored: it names torch's CUDA kernel, not this step).

    Returns:
        The new optimizer.

    Raises:
        TypeError: any other optimizer class (the message lists the supported ones), or an
            optimizer that is already a mixprec optimizer.
        ValueError: ``differentiable=True`` (mixprec's optimizers are not differentiable), or an
            invalid compensation/state_dtype.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = from_torch(torch.optim.AdamW(model.parameters(), lr=1e-3), compensation="kahan")
        >>> type(opt).__module__, type(opt).__name__
        ('mixprec.optim._adamw', 'AdamW')
    """
    if isinstance(optimizer, LowPrecisionOptimizer):
        raise TypeError(f"from_torch: the optimizer is already a mixprec.optim.{type(optimizer).__name__}; use it as is.")
    table: dict[type, Any] = {
        torch.optim.AdamW: AdamW, torch.optim.Adam: Adam, torch.optim.SGD: SGD,
    }
    cls = table.get(type(optimizer))
    if cls is None:
        raise TypeError(
            f"from_torch converts torch.optim.AdamW, torch.optim.Adam and torch.optim.SGD; got "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}. For another optimizer keep FP32 master "
            "weights instead (MasterWeightOptimizer, or a '*-master' policy)."
        )
    for i, g in enumerate(optimizer.param_groups):
        if g.get("differentiable", False):
            raise ValueError(f"from_torch: param group {i} has differentiable=True; mixprec's optimizers are not "
                             "differentiable. Build the torch optimizer with differentiable=False.")
    def converted(g: dict[str, Any]) -> dict[str, Any]:
        ng = {k: v for k, v in g.items() if k not in _IGNORED_TORCH_KEYS and k != "differentiable"}
        if cls is Adam and "decoupled_weight_decay" not in ng:
            ng["decoupled_weight_decay"] = False
        if cls is AdamW:
            ng["decoupled_weight_decay"] = True
        return ng

    groups = [converted(g) for g in optimizer.param_groups]
    new = cls(groups, compensation=compensation, state_dtype=state_dtype, seed=seed, generator=generator,
              chunk_numel=chunk_numel, fused=fused)
    # Share the group dicts so schedulers bound to the torch optimizer keep working.
    for g, ng in zip(optimizer.param_groups, new.param_groups):
        for k, v in ng.items():
            g.setdefault(k, v)
    new.param_groups = optimizer.param_groups
    # The user's hooks (step, state_dict, load_state_dict) are shared, not copied: they fire with the
    # converted optimizer, as torch calls them, and a handle returned before the conversion still removes one.
    for name in _HOOK_DICTS:
        hooks = getattr(optimizer, name, None)
        if hooks is not None:
            setattr(new, name, hooks)
    # An LR scheduler built on the torch optimizer checks (once, at its first step) that the torch optimizer's
    # step ran, by torch's private mark ``_opt_called``. The converted optimizer steps instead: its steps set
    # the torch optimizer's mark when they run (not now: a scheduler stepped before the first step must warn,
    # as it does under every other policy). torch's step wrapper calls ``_optimizer_step_code`` after each step.
    new._link_source(optimizer)  # also: load_state_dict re-points optimizer.param_groups, after copies too
    if getattr(optimizer, "_opt_called", False):  # stepped before the conversion (one optimizer, as far as the user sees)
        new._opt_called = True
    # The user's hyper-parameters are the defaults a later add_param_group fills in (not the mixprec
    # constructor's: a group added after prepare would otherwise get lr=1e-3, no momentum, ...).
    new.defaults = {**optimizer.defaults, **new.defaults, **converted(optimizer.defaults)}
    for g in new.param_groups:
        for p in g["params"]:
            st = optimizer.state.get(p)
            if st:
                new.state[p] = new._import_state(p, g, st, copy=False)
    return new

