"""Walking and rebuilding nested structures of tensors (module inputs/outputs, batches)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["floating_tensors", "iter_tensors", "map_tensors"]


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor inside lists, tuples, dicts (``ModelOutput`` too) and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (str, bytes)) or obj is None:
        return
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from iter_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from iter_tensors(o)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))


def floating_tensors(obj: Any) -> list[torch.Tensor]:
    """The floating-point tensors inside ``obj``, in order."""
    return [t for t in iter_tensors(obj) if t.is_floating_point()]


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Rebuild ``obj`` with ``fn`` applied to every tensor; containers keep their types.

    Containers whose tensors all come back unchanged are returned as they are (same object).
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (str, bytes)) or obj is None:
        return obj
    if isinstance(obj, tuple):
        items = [map_tensors(o, fn) for o in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        items = [map_tensors(o, fn) for o in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
    if isinstance(obj, dict):
        pairs = {k: map_tensors(v, fn) for k, v in obj.items()}
        if all(pairs[k] is obj[k] for k in obj):
            return obj
        out = obj.copy()  # keeps the dict subclass (OrderedDict, ModelOutput) and its extra state
        for k, v in pairs.items():
            out[k] = v
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        if all(changes[k] is getattr(obj, k) for k in changes):
            return obj
        return dataclasses.replace(obj, **changes)
    return obj
