"""Rank agreement and local shards: the part of ``torch.distributed`` the core needs.

A private leaf: it imports nothing from mixprec, so every core module (the scalers, the
fused checks, ``MixedPrecision``) can use it without importing :mod:`mixprec.distributed`,
the DDP/FSDP2 glue that sits on top of the core. ``mixprec.distributed`` re-exports these
names; that is their public home.

* :func:`agree_found_inf_`: all-reduce the ``found_inf`` flag with ``MAX`` before anyone
  decides to skip, so one rank's overflow makes every rank skip the step (otherwise the
  replicas' weights would drift apart).
* :func:`local_grad`: the local shard of a DTensor gradient (FSDP2), for in-place unscaling.
* :func:`is_distributed`, :func:`resolve_group`: the group questions both ask.
* :func:`check_prepare_target` (with :func:`is_fsdp2`, :func:`check_fsdp_policy`,
  :func:`fsdp_param_dtype`): what ``prepare`` checks of a DDP-wrapped or FSDP2-sharded model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "agree_found_inf_",
    "check_fsdp_policy",
    "check_prepare_target",
    "fsdp_param_dtype",
    "is_distributed",
    "is_fsdp2",
    "local_grad",
    "resolve_group",
]


def is_distributed(group: Any = None) -> bool:
    """Return ``True`` when ``torch.distributed`` is initialised and ``group`` (default: world) has more than one rank.

    Args:
        group: A process group, or ``None`` for the world.

    Returns:
        Whether a collective over ``group`` would involve another rank.

    Example:
        >>> is_distributed()  # no init_process_group in this process
        False
    """
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1)


def resolve_group(group: Any = None) -> Any:
    """Return the process group to use: ``group`` itself, or the world group when ``None``.

    Args:
        group: A process group, or ``None`` for the world.

    Returns:
        ``group``, or ``torch.distributed.group.WORLD``.

    Raises:
        ValueError: ``torch.distributed`` is not initialised (call ``init_process_group`` first).
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "torch.distributed is not initialised; call torch.distributed.init_process_group(...) first "
            "(torchrun sets the environment it reads)."
        )
    return group if group is not None else dist.group.WORLD


def agree_found_inf_(found_inf: Tensor, group: Any = None) -> Tensor:
    """All-reduce ``found_inf`` with ``MAX`` in place across ``group``; a no-op when not distributed.

    Collective: every rank of ``group`` must call it the same number of times, in the same order
    (the scalers call it once per ``unscale_``). It runs on the communication stream; no host
    sync. A CPU flag under the NCCL backend is reduced through a copy on the current CUDA device.

    Args:
        found_inf: 0-d float32 flag (1.0 = some gradient was inf/NaN on this rank).
        group: The process group (``None``: the default, world).

    Returns:
        ``found_inf`` itself, now the maximum over the group's ranks.

    Example:
        >>> import torch
        >>> agree_found_inf_(torch.tensor(0.0))  # not distributed: unchanged
        tensor(0.)
    """
    if not is_distributed(group):
        return found_inf
    dist = torch.distributed
    if found_inf.device.type == "cpu" and dist.get_backend(group) == "nccl":
        tmp = found_inf.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(tmp, op=dist.ReduceOp.MAX, group=group)
        found_inf.copy_(tmp)
        return found_inf
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf


def local_grad(t: Tensor) -> Tensor:
    """Return the local shard of a DTensor gradient (in-place ops on it change the DTensor), else ``t``.

    Args:
        t: A gradient: a plain tensor, or a DTensor (FSDP2 parameters' gradients).

    Returns:
        ``t.to_local()`` for a DTensor (a view of its local shard), ``t`` itself otherwise.

    Example:
        >>> import torch
        >>> g = torch.ones(2)
        >>> local_grad(g) is g
        True
    """
    if type(t) is Tensor:  # the common case, without an attribute lookup
        return t
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


# ----- prepare-time checks of DDP and FSDP2 models --------------------------------------------------
def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules is sharded with FSDP2 (``fully_shard``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def check_fsdp_policy(policy: Any) -> None:
    """Raise ``ValueError`` for a policy FSDP2 cannot represent (half parameters without FP32 masters)."""
    if policy.param_dtype != torch.float32 and not policy.has_masters:
        raise ValueError(
            f"policy {policy.label!r} stores parameters in half precision without FP32 masters, which "
            "FSDP2 cannot do: it keeps the sharded parameters in their original dtype and only casts the gathered "
            "copy. Use 'bf16-master' / 'fp16-master' (FSDP2's FP32 shards are the masters) or a '*-mixed' policy."
        )


def fsdp_param_dtype(module: Any) -> tuple[bool, torch.dtype | None]:
    """(known, param_dtype) of an FSDPModule's mixed-precision policy (private FSDP2 state)."""
    try:
        mp = module._get_fsdp_state()._mp_policy
    except AttributeError:
        return False, None
    return True, mp.param_dtype


def check_prepare_target(
    model: nn.Module, policy: Any, grad_accumulation: str,
    island_modules: Callable[[nn.Module, Any], Iterable[tuple[str, nn.Module]]],
) -> bool:
    """Validate a model handed to ``MixedPrecision.prepare``; return ``True`` for an FSDP2 model.

    Args:
        model: The model handed to ``prepare``.
        policy: The run's :class:`mixprec.Policy`.
        grad_accumulation: ``"fp32"`` or ``"compute"``.
        island_modules: ``mixprec._casting.island_modules`` (passed in: this leaf imports nothing from mixprec).

    Raises:
        ValueError: a DDP-wrapped model (prepare the plain model, then ``mixprec.distributed.wrap_ddp``);
            an FSDP2 model under a policy FSDP2 cannot represent, with ``grad_accumulation="compute"``,
            or whose ``MixedPrecisionPolicy`` computes in another dtype than ``policy`` (each
            message names the module and both dtypes).
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "prepare() got a DistributedDataParallel model. DDP builds its gradient buckets for the dtypes it sees, and "
            "prepare() may change them; prepare the plain model, then wrap it: model, opt = prec.prepare(model, opt); "
            "ddp = mixprec.distributed.wrap_ddp(prec, model)."
        )
    if not is_fsdp2(model):
        return False
    from torch.distributed.fsdp import FSDPModule

    name = policy.label
    check_fsdp_policy(policy)
    if grad_accumulation != "fp32":
        raise ValueError(
            f"grad_accumulation={grad_accumulation!r} with FSDP2: FSDP2 accumulates gradients in its FP32 sharded "
            "parameters' dtype, so compute-dtype accumulation is not available; use the default 'fp32'."
        )
    islands = {id(m) for _, m in island_modules(model, policy)} if policy.has_masters else set()
    named = dict(model.named_modules())
    want = policy.compute_dtype if policy.has_masters else None
    for qname, mod in named.items():
        if not isinstance(mod, FSDPModule):
            continue
        known, pdt = fsdp_param_dtype(mod)
        if not known:
            continue
        pdt = None if pdt == torch.float32 else pdt
        expect = None if id(mod) in islands else want
        if pdt != expect:
            raise ValueError(
                f"FSDP2 module {qname or '<root>'!r} gathers parameters in {pdt or 'their FP32 dtype'} but policy "
                f"{name!r} needs {expect or 'FP32 (autocast computes in ' + str(policy.compute_dtype) + ')'} there; "
                "shard with mixprec.distributed.fully_shard(model, policy) or "
                "mp_policy=mixprec.distributed.fsdp_mixed_precision(policy)."
            )
    if policy.has_masters:
        # An island whose parameters sit in a half-precision FSDP group would compute in half.
        for qname, mod in island_modules(model, policy):
            if isinstance(mod, FSDPModule) or not any(True for _ in mod.parameters(recurse=False)):
                continue
            parts = qname.split(".") if qname else []
            for k in range(len(parts) - 1, -1, -1):
                owner = named.get(".".join(parts[:k]))
                if isinstance(owner, FSDPModule):
                    raise ValueError(
                        f"FP32 island {qname!r} is not sharded on its own, so FSDP2 would gather its parameters in "
                        f"{policy.compute_dtype} with its parent; shard it first (mixprec.distributed.fully_shard does) "
                        "or drop it from the policy's fp32_islands."
                    )
    return True

