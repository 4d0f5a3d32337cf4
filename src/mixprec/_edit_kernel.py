"""The master-weight edit check as one Triton kernel over every (master, weight) pair of a group.

``MasterWeightOptimizer``'s edit check (``_master.carry_edits_``) is, per element,
``master = where(weight == round(master), master, float(weight))``. Eagerly, with torch's foreach
ops, it is six flat ops over scratch buffers and about 48 bytes of memory traffic per
element (there is no foreach ``where``). On a GPU that is ~4.7 GB per step for GPT-2's 124M
parameters, about as long as the optimizer step itself. This module does it in one launch per
(device, weight dtype) group, reading 6 bytes per element and writing only the edited ones, with
no temporaries.

Algorithm (one Triton program per ``BLOCK`` elements of one tensor, apex's multi-tensor-apply
pattern): device tables hold each pair's two data pointers and element count, and each block's
tensor; a program loads its pair's pointers, its ``BLOCK`` masters and weights, rounds the
masters to the weights' dtype and stores the weight (as FP32) where it differs or where the master
is NaN (what ``where`` gives: ``NaN == x`` is false). BF16 rounding is done on the bit pattern
(``bits + 0x7FFF + lsb``, truncated: round to nearest even, inf on overflow), which is exact on
every backend, Triton's CPU interpreter included (its float cast to BF16 truncates); FP16 uses the
float cast, round to nearest even. The 1-D views follow ``_master.EditViews``: the pairs
are dense with equal strides, so element ``i`` in memory order of one is element ``i`` of the other.

Safety: Triton is imported lazily; the first use per (device, weight dtype) compiles the kernel
and checks it against the ``where`` form on every 16-bit pattern (one host sync, once per
process). A failed compile or a mismatch warns once and the caller keeps the foreach check. Used
on :data:`DEVICES` (CUDA) where Triton imports; never while a CUDA graph is being captured before
that first check ran (its sync would break the capture). Under a dynamo trace (a compiled train
step around ``prec.step``) the caller takes the foreach ops instead, and the launch itself is
``torch._dynamo.disable``d, so Triton's launcher is never traced.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BLOCK", "DEVICES", "EditTables", "available", "carry_edits_triton_", "device_index", "import_triton", "reset"]

#: Devices whose edit check runs as this kernel (tests add ``"cpu"`` with ``TRITON_INTERPRET=1``).
DEVICES: frozenset[str] = frozenset({"cuda"})
#: Elements per Triton program.
BLOCK = 2048
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16)

tl: Any = None  # triton.language once _build imported it
_kernel: list[Any] = []  # the jitted kernel, built on first use
_state: dict[tuple[str, int | None, torch.dtype], bool] = {}  # (device type, index, weight dtype) -> passed its first check


def reset() -> None:
    """Forget the built kernel and the first-use checks (tests; a change of ``TRITON_INTERPRET``)."""
    _kernel.clear()
    _state.clear()


def available(device: torch.device, weight_dtype: torch.dtype, master_dtype: torch.dtype) -> bool:
    """Whether a group of this device and dtypes may use the kernel (before its first-use check).

    Host work only: the device type, the dtypes, an earlier failure, an importable Triton; and no
    CUDA graph being captured (building the tables copies them to the device).
    """
    if device.type not in DEVICES or master_dtype != torch.float32 or weight_dtype not in _WEIGHT_DTYPES:
        return False
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    if _state.get((device.type, device_index(device), weight_dtype)) is False:
        return False
    return bool(_kernel) or _build() is not None


def device_index(device: torch.device) -> int | None:
    """The device's index (the current one for a bare ``cuda``): first-use checks are per device."""
    if device.type == "cuda" and device.index is None:
        return torch.cuda.current_device()
    return device.index


def import_triton() -> tuple[Any, Any] | None:
    """``(triton, triton.language)``, imported lazily, or None without Triton (or with a broken one).

    Typed ``Any``: mypy need not know Triton (not installed everywhere). A kernel's module keeps
    ``triton.language`` as its global ``tl``: Triton resolves a kernel's names among its globals.
    """
    try:
        return importlib.import_module("triton"), importlib.import_module("triton.language")
    except Exception:
        return None


def _build() -> Any:
    """The jitted kernel (built once), or None when Triton does not import (remembered for every group)."""
    if _kernel:
        return _kernel[0]
    global tl
    modules = import_triton()
    if modules is None:  # the foreach check serves
        return None  # (asked again at each build of a group's tables: rare, and cheap once the import failed)
    triton, tl = modules

    @triton.jit
    def carry_edits_kernel(m_ptrs, w_ptrs, numels, first_block, block_tensor,
                           BLOCK: tl.constexpr, W_BF16: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.load(block_tensor + pid)
        n = tl.load(numels + t)
        idx = (pid - tl.load(first_block + t)) * BLOCK + tl.arange(0, BLOCK)  # int64: tensors past 2**31 elements
        inside = idx < n
        mp = tl.load(m_ptrs + t).to(tl.pointer_type(tl.float32))
        m = tl.load(mp + idx, mask=inside, other=0.0)
        if W_BF16:  # on bit patterns: exact on every backend, subnormals included
            wp = tl.load(w_ptrs + t).to(tl.pointer_type(tl.uint16))
            wb = tl.load(wp + idx, mask=inside, other=0).to(tl.uint32)
            w = (wb << 16).to(tl.float32, bitcast=True)
            b = m.to(tl.uint32, bitcast=True)
            rb = (b + 0x7FFF + ((b >> 16) & 1)) >> 16  # round to nearest even (inf past the largest finite)
            same = (rb == wb) | (((rb | wb) & 0x7FFF) == 0)  # equal, or +0 and -0
        else:
            wp = tl.load(w_ptrs + t).to(tl.pointer_type(tl.float16))
            w = tl.load(wp + idx, mask=inside, other=0.0).to(tl.float32)
            same = w == m.to(tl.float16).to(tl.float32)
        edited = (~same) | (m != m)  # a NaN master takes the weight, as where() gives
        tl.store(mp + idx, w, mask=inside & edited)

    _kernel.append(carry_edits_kernel)
    return carry_edits_kernel


class EditTables:
    """The device tables of one (device, weight dtype) group of dense pairs, built when the group's pointers change.

    Holds the 1-D views it was built from, so their storages outlive the tables' raw pointers.
    The tables are one ``int64`` buffer (pointers, sizes, first blocks, each block's pair), built on
    the host and copied once per build, from pinned memory without a host sync on CUDA.
    ``run``: once :func:`carry_edits_triton_` has launched it, the launch itself (Triton's launcher
    with every argument bound), which the step calls directly: no Python frame of this module on
    the step's path. Triton launches on the *current* CUDA device and its current stream, so the
    caller makes :attr:`device_index` current when it is not (a second GPU: ``_master._carry_edits``).
    """

    __slots__ = ("block_tensor", "device_index", "first_block", "host", "m_ptrs", "masters", "numels", "run", "table",
                 "w_ptrs", "weights")

    def __init__(self, masters: list[torch.Tensor], weights: list[torch.Tensor]) -> None:
        device = masters[0].device
        n = len(masters)
        numels = [m.numel() for m in masters]
        blocks = [-(-k // BLOCK) for k in numels]
        first, total = [], 0
        for b in blocks:
            first.append(total)
            total += b
        owner = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), torch.tensor(blocks, dtype=torch.int64))
        host = torch.cat([torch.tensor([m.data_ptr() for m in masters] + [w.data_ptr() for w in weights]
                                       + numels + first, dtype=torch.int64), owner])
        if device.type == "cuda":
            host = host.pin_memory()  # the copy below then leaves the host free (no sync on a table rebuild)
        self.host = host  # kept: a pinned source must outlive its asynchronous copy
        self.table = host.to(device, non_blocking=True)
        self.m_ptrs, self.w_ptrs = self.table[:n], self.table[n:2 * n]
        self.numels, self.first_block = self.table[2 * n:3 * n], self.table[3 * n:4 * n]
        self.block_tensor = self.table[4 * n:]
        self.device_index = device_index(device) if device.type == "cuda" else None
        self.masters, self.weights = masters, weights
        self.run: Callable[[], Any] | None = None

    def bound(self, kernel: Any) -> Callable[[], Any]:
        """Triton's launcher of ``kernel`` over every block of the group, every argument bound."""
        return functools.partial(
            kernel[(self.block_tensor.numel(),)], self.m_ptrs, self.w_ptrs, self.numels, self.first_block,
            self.block_tensor, BLOCK=BLOCK, W_BF16=self.weights[0].dtype == torch.bfloat16)

    def launch(self) -> None:
        """One launch over every block of the group, on the tables' device (no host sync)."""
        kernel = _kernel[0] if _kernel else _build()
        if kernel is None:
            raise RuntimeError("triton does not import")
        with on_device(self.device_index):
            self.bound(kernel)()


def on_device(index: int | None) -> Any:
    """``torch.cuda.device(index)`` when ``index`` is a CUDA device other than the current one, else a no-op context."""
    if index is None or index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def carry_edits_triton_(tables: EditTables) -> bool:
    """Run the edit check of ``tables``' group as the kernel; False when the caller must run the foreach check.

    Later steps call ``tables.run`` (set here) instead.

    The first call per (device type, weight dtype) compiles the kernel and checks it against the
    ``where`` form (:func:`_first_check`: one host sync, once per process); a failure there warns
    once and every later call returns False at once. While a CUDA graph is being captured that
    first check cannot run, so the call returns False (the foreach check is captured instead).
    """
    device = tables.masters[0].device
    key = (device.type, device_index(device), tables.weights[0].dtype)
    import torch._dynamo  # (imported by then wherever a GPU step runs; lazily here, not at mixprec's import)

    ok = _state.get(key)
    if ok is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        ok = _state[key] = torch._dynamo.disable(_first_check)(device, tables.weights[0].dtype)
    if not ok:
        return False
    # Never traced: called from a frame dynamo runs eagerly (a graph break in a compiled train step), Triton's
    # launcher would otherwise be compiled frame by frame; under a trace the caller takes the foreach ops.
    tables.run = torch._dynamo.disable(tables.bound(_kernel[0]))
    with on_device(tables.device_index):
        tables.run()
    return True


def _first_check(device: torch.device, dtype: torch.dtype) -> bool:
    """Compile the kernel and compare it with the ``where`` form on every 16-bit pattern (one host sync).

    The masters cover every upper half-word with the lower halves 0, 0x7FFF, 0x8000, 0x8001 and
    0xFFFF (ties, both neighbours, inf, NaN, subnormals, both zeros); the weights are their rounding,
    with every seventh replaced by another value (an edit) and a tail shorter than a block.
    """
    try:
        hi = torch.arange(1 << 16, dtype=torch.int64, device=device) << 16
        lows = torch.tensor([0, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64, device=device)
        bits = (hi[:, None] | lows[None, :]).flatten()
        bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
        master = bits.view(torch.float32)
        weight = master.to(dtype)
        edit = torch.arange(weight.numel(), device=device) % 7 == 3
        weight = torch.where(edit, master.flip(0).to(dtype), weight)
        pieces = [master[: BLOCK * 3 + 5].clone(), master[BLOCK * 3 + 5:].clone()]
        weights = [weight[: BLOCK * 3 + 5].clone(), weight[BLOCK * 3 + 5:].clone()]
        expected = torch.where(weight == master.to(dtype), master, weight.to(torch.float32))
        EditTables(pieces, weights).launch()
        got = torch.cat(pieces)
        # Bit for bit, except that any NaN matches any NaN (a backend may canonicalise a NaN's payload).
        same = bool(((got.view(torch.int32) == expected.view(torch.int32)) | (got.isnan() & expected.isnan())).all())
    except Exception as exc:  # any failure of an optional fast path: the foreach check serves
        _warn(device, dtype, f"it failed ({type(exc).__name__}: {exc})")
        return False
    if not same:
        _warn(device, dtype, "it disagreed with the where() form on its first-use check")
        return False
    return True


def _warn(device: torch.device, dtype: torch.dtype, why: str) -> None:
    interp = " under TRITON_INTERPRET=1" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    warnings.warn(
        f"mixprec: the Triton edit check of the master weights on {device.type} ({dtype}){interp} is off: {why}. "
        "The foreach edit check (six flat ops, ~48 bytes per parameter) runs instead; results are the same. "
        "Please report this with your torch and triton versions.",
        RuntimeWarning, stacklevel=4)
