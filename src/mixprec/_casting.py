"""Casting: floating tensors inside nested structures, and whole modules with FP32 islands.

``cast_module`` stores parameters in the policy's param dtype, keeps FP32 islands
(normalization layers by default) in FP32, and installs hooks so that

* the root module casts floating inputs to the compute dtype (half-parameter policies)
  and floating outputs to the output dtype (every policy), and
* every island computes in FP32 with autocast off and hands the compute dtype back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._policy import Policy

__all__ = ["cast_tree", "cast_module", "uncast_module", "island_modules", "is_prepared"]

T = TypeVar("T")
_CASTABLE = (torch.float32, torch.bfloat16, torch.float16)
_HOOKS_ATTR = "_mixprec_hooks"
_POLICY_ATTR = "_mixprec_policy"


def cast_tree(obj: T, dtype: torch.dtype, *, include_float64: bool = False) -> T:
    """Cast every floating tensor inside a nested structure to ``dtype``.

    Lists, tuples (namedtuples too), dicts (their own type: ``OrderedDict``, Hugging Face
    ``ModelOutput``) and dataclass instances are rebuilt with the same type; integer, bool
    and complex tensors, float64 tensors (unless ``include_float64``), float8 tensors and
    non-tensors are returned unchanged (the very same objects). A tensor already in
    ``dtype`` is returned as is, without a copy.

    Args:
        obj: A tensor or a nesting of containers.
        dtype: The floating dtype to cast to.
        include_float64: Also cast float64 tensors.

    Returns:
        The same structure with floating tensors cast.

    Example:
        >>> out = cast_tree({"x": torch.ones(2), "n": torch.arange(2)}, torch.bfloat16)
        >>> out["x"].dtype, out["n"].dtype
        (torch.bfloat16, torch.int64)
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"cast_tree needs a floating torch.dtype, got {dtype!r}")
    return _cast(obj, dtype, include_float64)


def _cast(obj: Any, dtype: torch.dtype, f64: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.dtype == dtype:
            return obj
        if obj.dtype in _CASTABLE or (f64 and obj.dtype == torch.float64):
            return obj.to(dtype)
        return obj
    if isinstance(obj, (str, bytes)) or obj is None:
        return obj
    if isinstance(obj, tuple):
        items = [_cast(o, dtype, f64) for o in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
    if isinstance(obj, list):
        return type(obj)(_cast(o, dtype, f64) for o in obj)
    if isinstance(obj, dict):
        pairs = {k: _cast(v, dtype, f64) for k, v in obj.items()}
        try:
            out = type(obj)(**pairs) if dataclasses.is_dataclass(obj) else type(obj)(pairs)
        except TypeError:
            # Some dict subclasses take no mapping in their constructor: copy and assign.
            out = obj.copy()
            out.update(pairs)
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _cast(getattr(obj, f.name), dtype, f64) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def island_modules(model: nn.Module, policy: Policy) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(qualified_name, module)`` for every FP32 island of ``model`` under ``policy``.

    Submodules of an island are part of it and are not yielded separately.
    """
    skip_prefixes: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(p) for p in skip_prefixes):
            continue
        if policy.is_fp32_island(module, name):
            skip_prefixes.append(name + "." if name else "")
            yield name, module


def is_prepared(model: nn.Module) -> bool:
    """Say whether ``cast_module`` has already been applied to ``model`` (hooks installed)."""
    return hasattr(model, _HOOKS_ATTR)


def _device_types(module: nn.Module) -> set[str]:
    types = {p.device.type for p in module.parameters()} | {b.device.type for b in module.buffers()}
    return types or {"cpu"}


class _IslandHooks:
    """Forward pre/post hooks that run one module in FP32 with autocast off.

    The pre-hook enters ``torch.autocast(enabled=False)`` and casts floating inputs to FP32;
    the post-hook (registered with ``always_call=True`` so it also runs when forward raises)
    exits the autocast context and casts floating outputs to the compute dtype. A stack keeps
    re-entrant calls (a module called twice in one forward, or recursion) balanced.
    """

    def __init__(self, compute_dtype: torch.dtype, device_types: set[str]) -> None:
        self.compute_dtype = compute_dtype
        self.device_types = sorted(device_types)
        self.stack: list[list[Any]] = []

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        contexts = [torch.autocast(device_type=d, enabled=False) for d in self.device_types]
        for c in contexts:
            c.__enter__()
        self.stack.append(contexts)
        return _cast(args, torch.float32, False), _cast(kwargs, torch.float32, False)

    def post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        contexts = self.stack.pop() if self.stack else []
        for c in reversed(contexts):
            c.__exit__(None, None, None)
        if self.compute_dtype == torch.float32 or output is None:
            return output
        return _cast(output, self.compute_dtype, False)


def cast_module(model: nn.Module, policy: Policy | str) -> nn.Module:
    """Cast ``model`` in place for ``policy`` and install its input/output/island hooks.

    Algorithm:
        1. Find the FP32 islands (``policy.fp32_islands``; an island's submodules belong to it).
        2. Cast every floating parameter and buffer outside the islands to ``policy.param_dtype``
           (in place: the ``nn.Parameter`` objects keep their identity, so optimizers built on
           them stay valid); islands keep FP32. A parameter shared by an island and a
           non-island module (tied weights) stays FP32.
        3. Root hooks: cast floating inputs to ``policy.compute_dtype`` when parameters are half
           precision (with FP32 parameters autocast does the casting), and floating outputs
           to ``policy.output_dtype``.
        4. Island hooks: FP32 inputs, autocast disabled inside, outputs cast to the compute dtype.

    Args:
        model: The model (its parameters normally FP32).
        policy: A :class:`Policy` or anything :meth:`Policy.parse` accepts.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: ``model`` was already prepared (hooks installed); call
            :func:`uncast_module` first or prepare a fresh model.
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> m = cast_module(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)), "bf16-master")
        >>> m[0].weight.dtype, m[1].weight.dtype
        (torch.bfloat16, torch.float32)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"cast_module needs an nn.Module, got {type(model).__name__}")
    policy = Policy.parse(policy)
    if is_prepared(model):
        raise ValueError(
            f"this model was already prepared for policy {getattr(model, _POLICY_ATTR)!r}; preparing it again "
            f"for {str(policy)!r} would stack hooks. Build a fresh model, or call mixprec.uncast_module(model) first."
        )
    islands = dict(island_modules(model, policy))
    island_params: set[int] = set()
    island_tensor_ids: set[int] = set()
    for module in islands.values():
        for t in list(module.parameters()) + list(module.buffers()):
            island_tensor_ids.add(id(t))
        island_params.update(id(p) for p in module.parameters())

    target = policy.param_dtype
    with torch.no_grad():
        for module in islands.values():
            for p in module.parameters():
                if p.dtype in _CASTABLE and p.dtype != torch.float32:
                    p.data = p.data.float()
            for name, b in module.named_buffers(recurse=True):
                if b.dtype in _CASTABLE and b.dtype != torch.float32:
                    _set_buffer(module, name, b.float())
        for p in model.parameters():
            if id(p) not in island_tensor_ids and p.dtype in _CASTABLE and p.dtype != target:
                p.data = p.data.to(target)
        for name, b in list(model.named_buffers()):
            if id(b) not in island_tensor_ids and b.dtype in _CASTABLE and b.dtype != target:
                _set_buffer(model, name, b.to(target))

    handles: list[RemovableHandle] = []
    devices = _device_types(model)
    if policy.compute_dtype != torch.float32:
        for module in islands.values():
            hooks = _IslandHooks(policy.compute_dtype, devices)
            handles.append(module.register_forward_pre_hook(hooks.pre, with_kwargs=True))
            handles.append(module.register_forward_hook(hooks.post, with_kwargs=True, always_call=True))

    root_in = policy.param_dtype if policy.param_dtype != torch.float32 else None
    out_dtype = policy.output_dtype
    if root_in is not None and model not in islands.values():
        def _root_pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
            return _cast(args, root_in, False), _cast(kwargs, root_in, False)

        handles.append(model.register_forward_pre_hook(_root_pre, with_kwargs=True, prepend=True))

    def _root_post(module: nn.Module, args: Any, output: Any) -> Any:
        return _cast(output, out_dtype, False)

    handles.append(model.register_forward_hook(_root_post))
    object.__setattr__(model, _HOOKS_ATTR, handles)
    object.__setattr__(model, _POLICY_ATTR, str(policy))
    return model


def uncast_module(model: nn.Module) -> nn.Module:
    """Remove the hooks ``cast_module`` installed (dtypes are left as they are).

    Returns:
        ``model`` itself.
    """
    for h in getattr(model, _HOOKS_ATTR, []):
        h.remove()
    for attr in (_HOOKS_ATTR, _POLICY_ATTR):
        if hasattr(model, attr):
            object.__delattr__(model, attr)
    return model


def _set_buffer(root: nn.Module, qualified: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = qualified.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    owner._buffers[leaf] = value
