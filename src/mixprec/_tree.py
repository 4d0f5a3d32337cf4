"""The one map over nested tensors: module inputs and outputs, batches, loss-scaling targets.

Every walker in mixprec (``cast_tree`` and the casting hooks, the loss scaler's ``scale``,
the numerics hooks, the benchmark's device moves) goes through :func:`tree_map` or
:func:`tree_leaves`, so they all agree on what a container is:

* ``torch.Tensor`` (subclasses too, ``nn.Parameter`` included): a leaf handed to ``fn``.
* ``list`` and ``tuple`` (their subclasses too): rebuilt as ``type(obj)(items)``; named
  tuples as ``type(obj)(*items)``. ``torch.return_types`` (``torch.max(x, 0)``) are tuples
  whose constructor takes one sequence, so they rebuild too.
* ``dict`` and its subclasses: a plain ``dict`` is rebuilt as a dict with the same key
  order; a dict that is also a dataclass and whose keys are its fields (Hugging Face
  ``ModelOutput``) with ``type(obj)(**pairs)``, the way ``transformers`` itself rebuilds it
  (its ``update`` and ``__delitem__`` raise, and its ``__post_init__`` registers the keys); any other subclass
  (``OrderedDict``, ``defaultdict``, your own) as a shallow ``copy.copy`` with the changed
  values assigned, which keeps the type and its extra state (``default_factory``).
* Dataclass instances (frozen too): ``dataclasses.replace`` with their ``init`` fields, as
  ``cast_tree`` always did; fields with ``init=False`` are not walked (``__post_init__``
  computes them again from the new values).
* Anything else (``None``, numbers, strings, ``torch.Size``'s ints, Hugging Face ``Cache``
  objects, other mappings): a leaf returned as it is, never handed to ``fn``.

A container whose tensors all come back as the very same objects is returned as it is (no
copy), so mapping the identity, or casting a structure that is already in the target dtype,
allocates nothing.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch

__all__ = ["floating_tensors", "tree_leaves", "tree_map"]

T = TypeVar("T")


def _is_namedtuple(obj: tuple[Any, ...]) -> bool:
    return hasattr(obj, "_fields")


def _is_dataclass_instance(obj: object) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def tree_map(fn: Callable[[torch.Tensor], Any], obj: T) -> T:
    """Apply ``fn`` to every tensor inside ``obj``; containers are rebuilt with their own types.

    The container rules are in the module docstring: lists, tuples, named tuples, dicts
    (``OrderedDict``, Hugging Face ``ModelOutput``), dataclasses (frozen too) are walked;
    other objects are left alone. Containers with nothing changed are returned as they are.

    Args:
        fn: Called once per tensor leaf (in order: sequence order, dict key order, dataclass
            field order); what it returns takes the tensor's place.
        obj: A tensor, a nesting of containers, or any other object.

    Returns:
        ``obj`` with every tensor replaced by ``fn(tensor)``.

    Raises:
        TypeError: ``fn`` is not callable.

    Example:
        >>> out = tree_map(lambda t: t * 2, {"x": torch.ones(2), "n": 3, "t": (torch.zeros(1),)})
        >>> out["x"].tolist(), out["n"], out["t"][0].tolist()
        ([2.0, 2.0], 3, [0.0])
    """
    if not callable(fn):
        raise TypeError(
            f"tree_map(fn, obj) needs a callable fn taking a tensor, got {type(fn).__name__} {fn!r}; "
            "note the order: fn first, then the structure."
        )
    return _map(fn, obj)


def _map(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if obj is None or isinstance(obj, (str, bytes, int, float)):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [_map(fn, o) for o in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if isinstance(obj, tuple) and _is_namedtuple(obj):
            return type(obj)(*items)
        return items if type(obj) is list else type(obj)(items)
    if isinstance(obj, dict):
        pairs = {k: _map(fn, v) for k, v in obj.items()}
        changed = [k for k, v in pairs.items() if v is not obj[k]]
        if not changed:
            return obj
        if type(obj) is dict:
            return pairs
        if _is_dataclass_instance(obj) and set(pairs) <= {f.name for f in dataclasses.fields(cast(Any, obj)) if f.init}:
            # Hugging Face ModelOutput: its keys are its non-None fields; transformers rebuilds it the same way.
            return type(obj)(**pairs)
        out = copy.copy(obj)
        for k in changed:
            out[k] = pairs[k]
        return out
    if _is_dataclass_instance(obj):
        changes = {f.name: _map(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        if all(v is getattr(obj, k) for k, v in changes.items()):
            return obj
        return dataclasses.replace(obj, **changes)
    return obj


def tree_leaves(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor inside ``obj``, in the order :func:`tree_map` visits them.

    Walks exactly the containers :func:`tree_map` rebuilds (see the module docstring), so
    the tensors yielded are the ones ``tree_map`` would hand to its ``fn``.

    Args:
        obj: A tensor, a nesting of containers, or any other object.

    Yields:
        The tensors, in order.

    Example:
        >>> [t.tolist() for t in tree_leaves([torch.ones(1), {"a": (torch.zeros(1), "s")}])]
        [[1.0], [0.0]]
    """
    if isinstance(obj, torch.Tensor):
        yield obj
    elif obj is None or isinstance(obj, (str, bytes, int, float)):
        return
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tree_leaves(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tree_leaves(o)
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            if f.init:
                yield from tree_leaves(getattr(obj, f.name))


def floating_tensors(obj: Any) -> list[torch.Tensor]:
    """The floating-point tensors inside ``obj`` (FP64 and FP8 included), in :func:`tree_leaves` order."""
    return [t for t in tree_leaves(obj) if t.is_floating_point()]
