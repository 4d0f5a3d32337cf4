"""Walking and rebuilding nested structures of tensors (module inputs/outputs, batches).

Thin names over :mod:`mixprec._tree`, the one tree map of the package, so the numerics
hooks see exactly the tensors the casting hooks cast and the loss scaler scales.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._tree import tree_leaves, tree_map

__all__ = ["floating_tensors", "iter_tensors", "map_tensors"]


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor inside lists, tuples, dicts (``ModelOutput`` too) and dataclasses.

    Args:
        obj: A tensor, a nesting of containers, or any other object.

    Yields:
        The tensors, in :func:`mixprec._tree.tree_leaves` order.
    """
    return tree_leaves(obj)


def floating_tensors(obj: Any) -> list[torch.Tensor]:
    """The floating-point tensors inside ``obj``, in order.

    Args:
        obj: A tensor, a nesting of containers, or any other object.

    Returns:
        The floating-point tensors (FP64 and FP8 included).
    """
    return [t for t in tree_leaves(obj) if t.is_floating_point()]


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Rebuild ``obj`` with ``fn`` applied to every tensor; containers keep their types.

    Containers whose tensors all come back unchanged are returned as they are (same object).

    Args:
        obj: A tensor, a nesting of containers, or any other object.
        fn: Called once per tensor.

    Returns:
        The rebuilt structure (:func:`mixprec._tree.tree_map`).
    """
    return tree_map(fn, obj)
