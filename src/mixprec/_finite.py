"""Fused inf/NaN checks: one kernel per (device, dtype) group, no host sync.

Two entry points:

* :func:`all_finite` answers "is every element of these tensors finite?" as a 0-d bool tensor
  without modifying anything (one ``torch._foreach_norm(ord=inf)`` per group: the largest
  magnitude is inf for an inf and NaN for a NaN).
* :func:`unscale_and_check_` is the loss-scaling workhorse: it multiplies gradients in place by
  ``1/scale`` and raises a ``found_inf`` flag, with exactly one
  ``torch._amp_foreach_non_finite_check_and_unscale_`` call per (device, dtype) group, as
  ``torch.amp.GradScaler`` does.

Neither reads anything back to the host.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from typing import cast

import torch
from torch import Tensor

__all__ = ["all_finite", "combine_found_inf", "group_by_device_and_dtype", "unscale_and_check_", "unscale_groups"]


def _dense(tensors: Iterable[Tensor | None]) -> list[Tensor]:
    """``None`` dropped, sparse tensors replaced by their values (the per-tensor work, kept minimal: hot path)."""
    ts = [t for t in tensors if t is not None]
    if any(map(_IS_SPARSE, ts)):  # map + attrgetter: the loop stays in C
        ts = [t._values() if t.is_sparse else t for t in ts]
    return ts


_IS_SPARSE = operator.attrgetter("is_sparse")

Groups = dict[tuple[torch.device, torch.dtype], list[Tensor]]


def group_by_device_and_dtype(tensors: list[Tensor]) -> Groups:
    """Group dense tensors by (device, dtype) with torch's C++ helper (no per-tensor Python work).

    Complex groups are replaced by their real views (same memory, a real dtype).
    """
    # torch's stub takes and returns lists of Optional[Tensor]; ours hold no None, so none come back
    grouped = torch._C._group_tensors_by_device_and_dtype([cast("list[Tensor | None]", tensors)], False)
    out: Groups = {}
    for (dev, dtype), (lists, _) in grouped.items():
        group = cast("list[Tensor]", lists[0])
        if dtype.is_complex:  # complex64 -> float32 views: may join an existing float32 group
            group = [torch.view_as_real(t) for t in group]
            dtype = group[0].dtype
        key = (dev, dtype)
        out[key] = out[key] + group if key in out else group
    return out


def all_finite(tensors: Iterable[Tensor | None] | Tensor) -> Tensor:
    """Return a 0-d bool tensor: ``True`` when every element of every tensor is finite.

    Integer and bool tensors are finite by definition and skipped; ``None`` entries are skipped;
    sparse tensors are checked through their values, complex ones through their real view.
    Nothing is modified (no version-counter bump, safe on tensors saved for backward).

    Cost: per (device, dtype) group one ``torch._foreach_norm(ord=inf)`` (the largest magnitude
    is ``inf`` for an inf and ``NaN`` for a NaN), then three tiny ops in all (stack, compare,
    all); norms from other devices are moved to the first tensor's device. No host sync.

    Args:
        tensors: A tensor or an iterable of tensors (e.g. ``[p.grad for p in model.parameters()]``).

    Returns:
        0-d ``torch.bool`` tensor on the first tensor's device (CPU when there are no tensors).

    Example:
        >>> import torch, mixprec
        >>> bool(mixprec.all_finite([torch.ones(3), torch.tensor([1.0, float("inf")])]))
        False
    """
    given = [tensors] if isinstance(tensors, Tensor) else [t for t in tensors if t is not None]
    floating = [t for t in _dense(given) if (t.is_floating_point() or t.is_complex()) and t.numel()]
    if not floating:
        return torch.ones((), dtype=torch.bool, device=given[0].device if given else "cpu")
    device = given[0].device
    norms: list[Tensor] = []
    for (dev, _dtype), group in group_by_device_and_dtype(floating).items():
        group_norms = torch._foreach_norm(group, float("inf"))
        norms += group_norms if dev == device else [n.to(device, non_blocking=True) for n in group_norms]
    # max|x| < inf is False for inf and for NaN (every comparison with NaN is False)
    return (torch.stack(norms) < math.inf).all()


def unscale_and_check_(
    tensors: Iterable[Tensor | None],
    inv_scale: Tensor | None,
    found_inf: Tensor | None = None,
) -> Tensor:
    """Multiply ``tensors`` in place by ``inv_scale`` and flag any inf/NaN in ``found_inf``.

    Exactly one ``torch._amp_foreach_non_finite_check_and_unscale_`` call per (device, dtype)
    group; with ``inv_scale=None`` the same call runs with a 1.0 factor (check only: values
    unchanged), except off the CPU, where a check only is a read-only ``_foreach_norm(inf)`` and
    three tiny ops per group (the fused kernel writes every element back even with a factor of 1:
    half the memory traffic). Where torch has no such kernel (bfloat16 on CUDA), a
    ``_foreach_norm(inf)`` check and a ``_foreach_mul_`` do the same per group. ``None`` entries are skipped; sparse tensors are unscaled through their
    ``_values()`` (coalesce FP16 sparse gradients first, as ``torch.amp.GradScaler`` does).
    No host sync.

    Args:
        tensors: Floating tensors (typically gradients) to unscale in place.
        inv_scale: 0-d float32 tensor ``1/scale``, correctly rounded (``_scaler.ScaleCore.inv_scale``: bit for bit torch.amp's),
            or ``None`` to check only.
        found_inf: Optional 0-d float32 tensor to accumulate into (set to 1.0 when a non-finite
            value is found, never cleared). Created (0.0) on the first tensor's device when ``None``.

    Returns:
        ``found_inf``: 0-d float32 tensor, 1.0 when any value was inf/NaN; on the device of
        ``found_inf`` when given, else of the first tensor (of ``inv_scale``, or CPU, when
        there are no tensors). Flags from other devices are folded in with a max.

    Example:
        >>> import torch
        >>> g = [torch.tensor([2.0, 4.0])]
        >>> unscale_and_check_(g, torch.tensor(0.5)).item(), g[0].tolist()
        (0.0, [1.0, 2.0])
    """
    ts = _dense(tensors)
    if found_inf is None:
        if ts:
            device = ts[0].device
        elif inv_scale is not None:
            device = inv_scale.device
        else:
            device = torch.device("cpu")
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
    if not ts:
        return found_inf
    return unscale_groups(group_by_device_and_dtype(ts), inv_scale, found_inf)


# (device type, dtype) pairs without a fused check-and-unscale kernel, learnt on first use: torch's
# CUDA kernel has no bfloat16 (torch 2.11), its CPU kernel has.
_NO_FUSED_KERNEL: set[tuple[str, torch.dtype]] = set()


def _check_and_unscale_foreach(group: list[Tensor], flag: Tensor, inv_scale: Tensor | None, inv: Tensor) -> None:
    """The fused kernel's contract with foreach ops: flag non-finite inputs, then multiply (a few launches per group)."""
    norms = torch._foreach_norm(group, float("inf"))  # checked before the multiply, as the fused kernel does
    bad = (torch.stack(norms) < math.inf).all().logical_not()
    flag.clamp_(min=bad.to(flag.dtype))
    if inv_scale is not None:
        # A factor of the group's dtype keeps _foreach_mul_ on its fused path (an FP32 0-d factor sends
        # BF16 tensors down a per-tensor path on CUDA: one launch per tensor, measured). Exact for
        # power-of-two scales (all that dynamic scaling with the default factors produces); otherwise
        # the factor is rounded to BF16 first (<= 1 BF16 ulp from the fused kernel's result).
        torch._foreach_mul_(group, inv.to(group[0].dtype))


def _foreach_route(dev: torch.device, dtype: torch.dtype, inv_scale: Tensor | None) -> bool:
    """Whether a group takes :func:`_check_and_unscale_foreach` instead of the fused kernel.

    Where torch has no fused kernel for it (learnt on first use), and for a check only off the
    CPU: a read-only norm instead of the fused kernel, which writes every element back even with a
    factor of 1 (half the memory traffic; a GPU step's check of FP32 gradients was ~0.3 ms of
    GPT-2 124M's on an H200).
    """
    return (dev.type, dtype) in _NO_FUSED_KERNEL or (inv_scale is None and dev.type != "cpu")


_ONES: dict[torch.device, Tensor] = {}


def _one(device: torch.device) -> Tensor:
    """A shared, never-written 0-d float32 1.0 on ``device``: the check-only factor (no kernel per step)."""
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def unscale_groups(groups: Groups, inv_scale: Tensor | None, found_inf: Tensor) -> Tensor:
    """:func:`unscale_and_check_` on tensors already grouped by :func:`group_by_device_and_dtype`."""
    home = found_inf.device
    if len(groups) == 1:
        # The common case (one device, one dtype) without the per-device bookkeeping: this runs
        # every step, and its Python cost is most of what unscaling costs for small models.
        ((dev, dtype), group), = groups.items()
        factor = inv_scale if inv_scale is not None else _one(dev)
        if dev == home and factor.device == dev and not _foreach_route(dev, dtype, inv_scale):
            grad_mode = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)  # what torch.no_grad() does, without its context-manager cost
            try:
                torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, factor)
                return found_inf
            except NotImplementedError:  # dispatch fails before touching anything: the general path below
                _NO_FUSED_KERNEL.add((dev.type, dtype))
            finally:
                torch._C._set_grad_enabled(grad_mode)
    per_device_inv: dict[torch.device, Tensor] = {}
    per_device_flag: dict[torch.device, Tensor] = {home: found_inf}
    with torch.no_grad():
        for (dev, dtype), group in groups.items():
            inv = per_device_inv.get(dev)
            if inv is None:
                if inv_scale is None:
                    inv = _one(dev)
                else:
                    inv = inv_scale if inv_scale.device == dev else inv_scale.to(dev, non_blocking=True)
                per_device_inv[dev] = inv
            flag = per_device_flag.get(dev)
            if flag is None:
                flag = per_device_flag[dev] = torch.zeros((), dtype=torch.float32, device=dev)
            if _foreach_route(dev, dtype, inv_scale):
                _check_and_unscale_foreach(group, flag, inv_scale, inv)
                continue
            try:
                torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
            except NotImplementedError:  # dispatch fails before touching anything: safe to fall back
                _NO_FUSED_KERNEL.add((dev.type, dtype))
                _check_and_unscale_foreach(group, flag, inv_scale, inv)
        for dev, flag in per_device_flag.items():
            if dev != home:
                found_inf.clamp_(min=flag.to(home, non_blocking=True))
    return found_inf


def combine_found_inf(flags: Sequence[Tensor], device: torch.device | None = None) -> Tensor:
    """One 0-d ``found_inf`` from several (the flags of several devices, optimizers or loss blocks).

    The maximum, as FP32: non-zero exactly when one of them is. On ``device`` (default: the first
    flag's). A single flag on that device is returned as it is (no kernel). No host sync. The one
    place flags are combined: ``MixedPrecision``'s iteration, ``GradScaler``, ``mixprec.apex``.
    """
    dev = flags[0].device if device is None else device
    if len(flags) == 1 and flags[0].device == dev:
        return flags[0]
    return torch.stack([f.reshape(()).to(device=dev, dtype=torch.float32, non_blocking=True) for f in flags]).amax()
