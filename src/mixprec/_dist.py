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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["agree_found_inf_", "is_distributed", "local_grad", "resolve_group"]


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
