"""Ahead-of-time compilation of a Triton kernel for an NVIDIA GPU on a machine without one.

Triton's compiler runs on the host and ships its own ``ptxas``, so a kernel can be compiled to a
``cubin`` for a given compute capability without a device: a CPU proxy for "the kernel the GPU
runs compiles" (the interpreter runs the same source but type-checks less, and never lowers it).
"""

from __future__ import annotations

from typing import Any


def compile_for_gpu(kernel: Any, types: dict[str, str], constexprs: dict[str, Any], capability: int) -> Any:
    """``kernel`` (a ``triton.jit`` function, not interpreted) compiled for ``sm_<capability>``.

    Args:
        kernel: The jitted kernel.
        types: Each non-constexpr argument's Triton type (``"*i64"``, ``"*fp32"``, ``"fp32"``, ...).
        constexprs: Each ``tl.constexpr`` argument's value.
        capability: The compute capability, e.g. 90 (H100/H200) or 80 (A100).

    Returns:
        Triton's compiled kernel (its ``asm["cubin"]`` holds the machine code).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    missing = set(kernel.arg_names) - set(types) - set(constexprs)
    if missing:
        raise ValueError(f"no type or value for the kernel's arguments {sorted(missing)}")
    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"enable_fp_fusion": False})
