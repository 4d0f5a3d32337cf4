"""Distributed glue: every rank takes the same skip decision.

When ``torch.distributed`` is initialised with more than one rank, a ``found_inf`` flag is
all-reduced with ``MAX`` over the process group before anyone decides to skip, so one rank's
overflow makes every rank skip the step (otherwise the replicas' weights would drift apart).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["agree_found_inf_", "is_distributed"]


def is_distributed(group: Any = None) -> bool:
    """Return ``True`` when ``torch.distributed`` is initialised and ``group`` (default: world) has more than one rank."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1)


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
