"""Exact comparison of nested state (state dicts, snapshots) shared by the tests."""

from __future__ import annotations

from typing import Any

import torch


def equal_tree(a: Any, b: Any) -> bool:
    """Bit-exact equality of nested tensors, dicts (same key order), lists/tuples (same type) and scalars.

    Tensors must match in dtype, shape and every element; NaN equals NaN (the scalers' statistics
    hold NaN-free floats, but a poisoned value must compare equal to itself).
    """
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(equal_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal_tree(x, y) for x, y in zip(a, b))
    return bool(a == b) or (a != a and b != b)
