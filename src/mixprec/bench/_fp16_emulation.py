"""FP16 numerics on a CPU without FP16 kernels: FP16 storage, FP32 arithmetic.

GPUs run FP16 work with FP16 *storage* and FP32 *arithmetic*: tensor cores multiply FP16
numbers (their products are exact in FP32: 11-bit x 11-bit significands fit in 24 bits) and
accumulate in FP32, elementwise kernels load FP16, compute in FP32 and store FP16, and
reductions accumulate in FP32. Each operator's result is rounded to FP16 once, when it is
stored.

CPUs without AVX512-FP16/AMX-FP16 have no fast FP16 kernels (an FP16 matmul is 23-170x slower
than FP32 on our CI machines), so a benchmark that runs FP16 presets natively measures
nothing but that slowness. :class:`FP16Emulation` reproduces the GPU numerics at FP32 speed:
a ``TorchDispatchMode`` that sees every ATen operator (forward, backward and optimizer),
upcasts its FP16 inputs to FP32 (exact), runs the FP32 kernel, and rounds each result that
would have been FP16 back to FP16 (round-to-nearest-even, as a store does). In-place and
``out=`` operators on FP16 tensors compute on an FP32 copy and write the rounded result back
into the original FP16 storage. Views and pure data movement (copies, casts, indexing,
concatenation) run natively: they do no arithmetic, so FP16 and FP32 give the same bits.

What it does *not* emulate: the order of FP32 summation inside a kernel (a GPU's tiling
differs from the CPU's), and kernels that round intermediates to FP16 inside one operator.
Results therefore match native FP16 to within FP32 summation-order noise: usually bit for
bit, otherwise by one FP16 rounding step where an FP32 result lies next to a rounding
boundary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["FP16Emulation", "fp16_emulation_applies"]

_HALF = torch.float16
aten = torch.ops.aten

# Operators that move or select FP16 values without arithmetic: running them natively in
# FP16 gives the same bits as FP32-then-round and avoids two conversions.
_PASSTHROUGH_NAMES = {
    "_to_copy", "copy_", "clone", "detach", "alias", "lift_fresh", "lift_fresh_copy",
    "empty_like", "empty_strided", "empty", "zeros_like", "ones_like", "full_like", "new_empty",
    "new_empty_strided", "new_zeros", "new_ones", "new_full", "fill_", "zero_", "fill",
    "index_select", "embedding", "cat", "stack", "_local_scalar_dense", "masked_fill", "masked_fill_",
    "where", "constant_pad_nd", "gather", "repeat", "expand_copy", "_unsafe_view", "view_copy",
    "slice_scatter", "select_scatter", "as_strided_scatter", "split_with_sizes_copy", "split_copy",
    "unbind_copy", "eq", "ne", "lt", "le", "gt", "ge", "isinf", "isnan", "isfinite", "sign",
    "_has_compatible_shallow_copy_type", "is_same_size", "equal", "set_", "resize_", "tril", "triu",
    "flip", "roll", "permute_copy", "t_copy", "transpose_copy", "index", "_index_put_impl_",
    "relu", "abs", "neg", "max", "min", "amax", "amin",
    "maximum", "minimum", "sort", "topk", "argmax", "argmin", "max_pool2d_with_indices",
    "threshold_backward", "masked_scatter", "nonzero", "_pin_memory", "to",
}
# ``index_put_`` with accumulate=True sums, so it is emulated; without accumulation
# ``_index_put_impl_`` only writes values (passthrough above is for the accumulate=False path,
# checked below).


def _name(func: Any) -> str:
    return func._schema.name.split("::", 1)[-1]


def fp16_emulation_applies(*dtypes: torch.dtype | None) -> bool:
    """True when any of the given dtypes is FP16 (the emulation changes nothing otherwise)."""
    return any(dt == _HALF for dt in dtypes)


class FP16Emulation(TorchDispatchMode):
    """Run FP16 tensors' operators as FP16 storage + FP32 arithmetic (GPU numerics on a CPU).

    Use it as a context manager around the whole training step (forward, backward and
    optimizer step), outside any tracking mode that should see FP16 tensors::

        with FP16Emulation():
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().mean()
            loss.backward()
            optimizer.step()

    Tensors in other dtypes (FP32, BF16, integers) pass through untouched; an operator with
    no FP16 tensor argument runs exactly as without the mode.

    Attributes:
        emulated_ops: How many operator calls were upcast and rounded.
        passthrough_ops: How many FP16 operator calls ran natively (views and data movement).

    Example:
        >>> a, b = torch.randn(8, 8).half(), torch.randn(8, 8).half()
        >>> with FP16Emulation():
        ...     c = a @ b
        >>> c.dtype
        torch.float16
    """

    def __init__(self) -> None:
        super().__init__()
        self.emulated_ops = 0
        self.passthrough_ops = 0
        self._out_dtypes: dict[Any, tuple[torch.dtype | None, ...] | None] = {}

    # ----- the dispatch hook --------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not _any_half(args) and not _any_half(kwargs.values()):
            return func(*args, **kwargs)
        if self._is_passthrough(func, args, kwargs):
            self.passthrough_ops += 1
            return func(*args, **kwargs)
        self.emulated_ops += 1
        return self._emulate(func, args, kwargs)

    def _is_passthrough(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        name = _name(func)
        if name in ("_index_put_impl_", "index_put", "index_put_"):
            accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
            return not accumulate
        cached = _PASSTHROUGH_CACHE.get(func)
        if cached is None:
            # Views (outputs alias an input without writing it) must stay views of the FP16 tensor.
            cached = name in _PASSTHROUGH_NAMES or any(
                r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns
            )
            _PASSTHROUGH_CACHE[func] = cached
        return cached

    def _emulate(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        upcast: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(fp32 copy) -> (original, copy)

        def up(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                if x.dtype == _HALF:
                    c = x.float()
                    upcast[id(c)] = (x, c)
                    return c
                return x
            if x is _HALF:  # dtype arguments (sum(dtype=), _softmax_backward_data(input_dtype=)) compute in FP32 too
                return torch.float32
            return x

        out_dtypes = self._native_out_dtypes(func, args, kwargs)
        a32 = _map_args(up, args)
        k32 = {k: _map_one(up, v) for k, v in kwargs.items()}
        if _name(func) in ("_softmax", "_log_softmax") and len(a32) > 2 and a32[2]:
            a32 = (*a32[:2], False, *a32[3:])  # half_to_float: the FP32 input already gives FP32
        result = func(*a32, **k32)
        # Write back every FP16 argument the operator mutated (in-place and out= variants).
        for copy in _written_args(func, a32, k32):
            pair = upcast.get(id(copy))
            if pair is not None:
                pair[0].copy_(pair[1])  # rounds to FP16 (round-to-nearest-even), in place
        # Returned aliases of mutated arguments are handed back as the original FP16 tensors;
        # fresh results are rounded to the dtype the native operator would have returned.
        counter = [0]

        def down(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            i = counter[0]
            counter[0] += 1
            pair = upcast.get(id(leaf))
            if pair is not None:
                return pair[0]
            want = out_dtypes[i] if out_dtypes is not None and i < len(out_dtypes) else None
            if want is None:
                want = _guess_dtype(leaf, args, kwargs)
            return leaf.to(want) if leaf.dtype != want else leaf

        if isinstance(result, (tuple, list)):
            return type(result)(_map_one(down, r) for r in result)
        return down(result)

    # ----- what dtype a native FP16 run would have returned ---------------------------------------
    def _native_out_dtypes(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[torch.dtype | None, ...] | None:
        """Output dtypes of the native call, from a meta-device run (cached by signature)."""
        try:
            key = (func, _signature(args), _signature(tuple(kwargs.items())))
            return self._out_dtypes[key]
        except KeyError:
            pass
        except TypeError:  # unhashable signature: compute without caching
            return _meta_out_dtypes(func, args, kwargs)
        dtypes = _meta_out_dtypes(func, args, kwargs)
        if len(self._out_dtypes) > 8192:
            self._out_dtypes.clear()
        self._out_dtypes[key] = dtypes
        return dtypes


_PASSTHROUGH_CACHE: dict[Any, bool] = {}
_WRITTEN_CACHE: dict[Any, tuple[tuple[int, str, bool], ...]] = {}


# The helpers below walk aten arguments under __torch_dispatch__: tensors and one level of tensor lists
# (op schemas), never user containers, on the per-op hot path; so they are not mixprec._tree.
def _any_half(values: Any) -> bool:
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.dtype == _HALF:
                return True
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, torch.Tensor) and x.dtype == _HALF:
                    return True
    return False


def _map_one(fn: Any, v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return type(v)(fn(x) for x in v)
    return fn(v)


def _map_args(fn: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(_map_one(fn, a) for a in args)


def _written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors (after upcasting) that ``func`` writes: its ``(a!)`` arguments."""
    spec = _WRITTEN_CACHE.get(func)
    if spec is None:
        schema = func._schema
        spec = tuple(
            (i, a.name, a.kwarg_only)
            for i, a in enumerate(schema.arguments)
            if schema.is_mutable and a.alias_info is not None and a.alias_info.is_write
        )
        _WRITTEN_CACHE[func] = spec
    written: list[torch.Tensor] = []
    for i, name, kwarg_only in spec:
        value = kwargs.get(name) if (kwarg_only or i >= len(args)) else args[i]
        if isinstance(value, torch.Tensor):
            written.append(value)
        elif isinstance(value, (list, tuple)):
            written.extend(v for v in value if isinstance(v, torch.Tensor))
    return written


def _guess_dtype(out: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype:
    """Fallback when the meta run fails: FP16 unless a full-size FP32 tensor or a dtype= asked for FP32."""
    if out.dtype != torch.float32:
        return out.dtype
    if kwargs.get("dtype") is not None:
        return kwargs["dtype"]
    flat, _ = tree_flatten((args, kwargs))
    if any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() > 0 for t in flat):
        return torch.float32
    return _HALF


def _signature(values: Any) -> tuple[Any, ...]:
    sig: list[Any] = []
    for x in _flat(values):
        if isinstance(x, torch.Tensor):
            sig.append(("T", x.dtype, x.dim() == 0))
        elif isinstance(x, float):
            sig.append("f")
        elif isinstance(x, (int, bool, str, torch.dtype, type(None))):
            sig.append(x)
        else:
            sig.append(type(x).__name__)
    return tuple(sig)


def _flat(values: Any) -> Any:
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from _flat(v)
        else:
            yield v


def _meta_out_dtypes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.dtype | None, ...] | None:
    def to_meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        if isinstance(x, torch.device):
            return torch.device("meta")
        return x

    try:
        margs, mkwargs = tree_map(to_meta, (args, kwargs))
        if "device" in mkwargs:
            mkwargs["device"] = torch.device("meta")
        res = func(*margs, **mkwargs)
    except Exception:  # no meta kernel: fall back to the guess in _guess_dtype
        return None
    leaves, _ = tree_flatten(res)
    return tuple(x.dtype if isinstance(x, torch.Tensor) else None for x in leaves if isinstance(x, torch.Tensor))
