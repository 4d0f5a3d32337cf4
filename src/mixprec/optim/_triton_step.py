"""AdamW's step (Kahan, stochastic rounding or none; BF16 or FP32) as one Triton kernel per bucket (CUDA).

The fused step of :class:`~mixprec.optim.AdamW` (and ``Adam``) on BF16 parameters with
``compensation="kahan"`` and FP32 states is ``bf16-pure``'s default step. Compiled by Inductor it
steps fixed-size tiles, and the small tensors (most of a GPT's) are gathered into packed tiles and
scattered back every step: on an H200 that step took 2.5x torch's fused AdamW on GPT-2's 148
tensors. This module steps a whole bucket in place, reading and writing each element once (Kahan:
param 2 + compensation 2 + gradient 2 + states 8 bytes read, 12 written: 26 bytes per parameter;
torch's fused AdamW on FP32 parameters moves 28). It covers AdamW/Adam on BF16 parameters with any
compensation and on FP32 parameters (FP32 islands), FP32 or BF16 states; not ``amsgrad``.

Algorithm (one Triton program per ``BLOCK`` elements of one tensor, the multi-tensor-apply pattern
of :mod:`mixprec._edit_kernel`): device tables hold each tensor's data pointers (parameter,
compensation, ``exp_avg``, ``exp_avg_sq``; the gradients' in a second table, rebuilt when their
addresses change), element count, global element offset, random keys per stream slot, and each
block's tensor and first element. Two launches per bucket: the full blocks, unmasked (16-byte
vector loads when every pointer is aligned, ``ALIGNED``), then each tensor's partial last block,
masked. Per tensor the step's scalars (``step_size``, ``bc2_sqrt``: :meth:`AdamW._step_scalars`
of the stacked step counters) and random keys (:func:`~mixprec.optim._rounding.step_keys`) are
computed by torch on short vectors before the launches. Per element the arithmetic is the eager
step's, operation by operation (``_update`` with ``comp_of_weight`` before it, the roundings
after it): single-rounding FP32 operations, IEEE division and square root, no contraction into
FMAs (``enable_fp_fusion=False``); the BF16 roundings are done on bit patterns (round to nearest
even, and the counter-based stochastic roundings, :func:`_sr_counter`'s rule with
:func:`counter_bits`' hash in 32-bit unsigned arithmetic), exact on every backend, Triton's CPU
interpreter included. So the kernel equals the eager step bit for bit (NaN payloads aside). A
skipped step (``found_inf``) writes nothing, decided on the device.

Safety, as :mod:`mixprec._edit_kernel`: Triton is imported lazily; the first use per (device,
kernel variant) compiles the kernel and checks it against the eager step on two small tensors with
the group's hyper-parameters (one host sync per variant and process); a failure or a mismatch
warns once and the caller keeps the compiled tile step. Used on :data:`DEVICES` (CUDA) only;
the caller never reaches it under a ``TorchDispatchMode``, while a CUDA graph is captured, or
inside a dynamo trace (``_parts._compile_blocked``, the step's graph break).
"""

from __future__ import annotations

import operator
import os
import time
import warnings
from collections.abc import Mapping
from itertools import chain
from typing import Any, cast

import torch
from torch import Tensor

from .._edit_kernel import device_index as _index
from .._edit_kernel import import_triton, on_device
from ._parts import (
    _SLOT_COMP,
    _SLOT_PARAM,
    _SLOT_STATE0,
    _STREAMS_PER_PARAM,
    OptimizerParts,
    _Bucket,
    _DeviceCtx,
    _Plan,
)
from ._rounding import step_keys, stream_key

__all__ = ["BLOCK", "DEVICES", "AdamWTables", "reset", "step_bucket"]

#: Devices whose eligible buckets step through the kernel (tests add ``"cpu"`` with ``TRITON_INTERPRET=1``).
DEVICES: frozenset[str] = frozenset({"cuda"})
#: Elements per Triton program.
BLOCK = 2048
_KEYS = ("exp_avg", "exp_avg_sq")
_DATA_PTR = operator.methodcaller("data_ptr")
_CONTIGUOUS = operator.methodcaller("is_contiguous")
_DTYPE = operator.attrgetter("dtype")

tl: Any = None  # triton.language once _build imported it
_kernel: list[Any] = []  # the jitted kernel, built on first use
_state: dict[tuple[Any, ...], bool] = {}  # (device type, index, variant) -> passed its first-use check
#: How a BF16 parameter is rounded: to nearest (``compensation="none"``), Kahan, stochastically.
_COMP_MODE = {"none": 0, "kahan": 1, "stochastic": 2}


def reset() -> None:
    """Forget the built kernel and the first-use checks (tests; a change of ``TRITON_INTERPRET``)."""
    _kernel.clear()
    _state.clear()


def _build() -> Any:
    """The jitted kernel (built once), or None when Triton does not import."""
    if _kernel:
        return _kernel[0]
    global tl
    modules = import_triton()
    if modules is None:
        return None
    triton, tl = modules

    # Every pointer argument unspecialised: Triton would otherwise compile a variant per alignment of the
    # small tables' views (the data's alignment is a constexpr of its own, ALIGNED).
    @triton.jit(do_not_specialize=list(range(22)))
    def adamw_kernel(p_ptrs, c_ptrs, m_ptrs, v_ptrs, g_ptrs, numels, block_tensor, block_start, bases,
                     step_size, bc2_sqrt, ka_p, kb_p, ka_c, kb_c, ka_m, kb_m, ka_v, kb_v, decay, scale, keep,
                     beta1c, beta2, beta2c, eps, wd,
                     BLOCK: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr, P_BF16: tl.constexpr,
                     COMP: tl.constexpr, S_BF16: tl.constexpr, G_BF16: tl.constexpr, HAS_SCALE: tl.constexpr,
                     HAS_KEEP: tl.constexpr, MAXIMIZE: tl.constexpr, L2: tl.constexpr, DECAY: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.load(block_tensor + pid)
        start = tl.multiple_of(tl.load(block_start + pid), BLOCK)
        idx = start + tl.arange(0, BLOCK)  # int64: tensors past 2**31 elements
        # BF16 data as its 16-bit patterns (uint16), converted exactly on the bit pattern below.
        if P_BF16:
            pp = tl.load(p_ptrs + t).to(tl.pointer_type(tl.uint16))
        else:
            pp = tl.load(p_ptrs + t).to(tl.pointer_type(tl.float32))
        if S_BF16:
            mp = tl.load(m_ptrs + t).to(tl.pointer_type(tl.uint16))
            vp = tl.load(v_ptrs + t).to(tl.pointer_type(tl.uint16))
        else:
            mp = tl.load(m_ptrs + t).to(tl.pointer_type(tl.float32))
            vp = tl.load(v_ptrs + t).to(tl.pointer_type(tl.float32))
        if G_BF16:
            gp = tl.load(g_ptrs + t).to(tl.pointer_type(tl.uint16))
        else:
            gp = tl.load(g_ptrs + t).to(tl.pointer_type(tl.float32))
        if ALIGNED:  # every data pointer 16-byte aligned (checked on the host): 16-byte vector loads and stores
            pp = tl.multiple_of(pp, 16)
            mp = tl.multiple_of(mp, 16)
            vp = tl.multiple_of(vp, 16)
            gp = tl.multiple_of(gp, 16)
        if MASKED:  # the last, partial block of a tensor
            n = tl.load(numels + t)
            if HAS_KEEP:  # a skipped step (found_inf): no element is read or written
                n = tl.where(tl.load(keep) != 0.0, n, 0)
            inside = idx < n
            w_raw = tl.load(pp + idx, mask=inside, other=0)
            m_raw = tl.load(mp + idx, mask=inside, other=0)
            v_raw = tl.load(vp + idx, mask=inside, other=0)
            g_raw = tl.load(gp + idx, mask=inside, other=0)
        else:  # full blocks: read unmasked (vector loads), written only when the step is kept
            if HAS_KEEP:
                inside = (tl.full([BLOCK], 0.0, tl.float32) + tl.load(keep)) != 0.0  # one value: vector stores still
            else:
                inside = None
            w_raw = tl.load(pp + idx)
            m_raw = tl.load(mp + idx)
            v_raw = tl.load(vp + idx)
            g_raw = tl.load(gp + idx)
        # BF16 -> FP32 on the bit pattern (exact everywhere, the interpreter included).
        if P_BF16:
            w = (w_raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            w = w_raw
        if S_BF16:
            m_old = (m_raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            v_old = (v_raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            m_old = m_raw
            v_old = v_raw
        if G_BF16:
            g = (g_raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            g = g_raw
        if HAS_SCALE:
            g = tl.math.div_rn(g, tl.load(scale))
        if MAXIMIZE:
            g = -g
        gidx = tl.load(bases + t) + idx  # global element index: the random bits are a function of it
        if COMP == 1:
            cp = tl.load(c_ptrs + t).to(tl.pointer_type(tl.uint16))
            if ALIGNED:
                cp = tl.multiple_of(cp, 16)
            if MASKED:
                c = (tl.load(cp + idx, mask=inside, other=0).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            else:
                c = (tl.load(cp + idx).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            # comp_of_weight: the compensation where it can belong to the weight (|c| <= ulp(w) / 2), else 0.
            bound = (w.to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True) * 0.00390625  # * 2**-8
            bound = tl.maximum(bound, 9.183549615799121e-41)  # 2**-133, the finest BF16 half-ulp
            w = w + tl.where(tl.abs(c) <= bound, c, 0.0)
        if L2:
            g = w * wd + g
        if DECAY:
            wn = w * tl.load(decay)
        else:
            wn = w
        m = (g - m_old) * beta1c + m_old
        v = v_old * beta2 + (g * g) * beta2c
        denom = tl.math.div_rn(tl.math.sqrt_rn(v), tl.load(bc2_sqrt + t)) + eps
        wn = wn - tl.math.div_rn(m * tl.load(step_size + t), denom)
        if P_BF16:
            wb = wn.to(tl.uint32, bitcast=True)
            if COMP == 2:  # stochastic rounding of the parameter itself
                p16 = _mp_sr16(wb, _mp_bits(ka_p, kb_p, t, gidx))
            else:
                p16 = _mp_rne16(wb)
            tl.store(pp + idx, p16.to(tl.uint16), mask=inside)
            if COMP == 1:  # the remainder, exact in FP32, stored with stochastic rounding
                cx = wn - (p16 << 16).to(tl.float32, bitcast=True)
                c16 = _mp_sr16(cx.to(tl.uint32, bitcast=True), _mp_bits(ka_c, kb_c, t, gidx))
                tl.store(cp + idx, c16.to(tl.uint16), mask=inside)
        else:
            tl.store(pp + idx, wn, mask=inside)
        if S_BF16:  # BF16 states: stochastic rounding (to nearest would freeze exp_avg_sq)
            m16 = _mp_sr16(m.to(tl.uint32, bitcast=True), _mp_bits(ka_m, kb_m, t, gidx))
            v16 = _mp_sr16(v.to(tl.uint32, bitcast=True), _mp_bits(ka_v, kb_v, t, gidx))
            tl.store(mp + idx, m16.to(tl.uint16), mask=inside)
            tl.store(vp + idx, v16.to(tl.uint16), mask=inside)
        else:
            tl.store(mp + idx, m, mask=inside)
            tl.store(vp + idx, v, mask=inside)

    @triton.jit
    def _mp_bits(ka, kb, t, gidx):
        """counter_bits(ka[t], kb[t], gidx) in 32-bit unsigned arithmetic: 32 random bits per element."""
        x = (gidx & 0xFFFFFFFF).to(tl.uint32) ^ tl.load(ka + t).to(tl.uint32)
        x = ((x >> 16) ^ x) * 0x45D9F3B
        x = x ^ tl.load(kb + t).to(tl.uint32) ^ (gidx >> 32).to(tl.uint32)
        x = ((x >> 16) ^ x) * 0x45D9F3B
        x = ((x >> 16) ^ x) * 0x45D9F3B
        return (x >> 16) ^ x

    @triton.jit
    def _mp_rne16(xb):
        """The BF16 bits nearest the FP32 bits ``xb`` (ties to even; inf past the largest finite; NaN kept)."""
        return tl.where((xb & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, (xb + 0x7FFF + ((xb >> 16) & 1)) >> 16)

    @triton.jit
    def _mp_sr16(xb, bits):
        """_sr_counter's BF16 rule: the upper 16 random bits added below the cut; from the top bucket up, to nearest."""
        return tl.where((xb & 0x7FFFFFFF) < 0x7F7F0000, (xb + (bits >> 16)) >> 16, _mp_rne16(xb))

    # The helpers are module globals: Triton resolves a kernel's callees among its globals.
    globals().update(_mp_bits=_mp_bits, _mp_rne16=_mp_rne16, _mp_sr16=_mp_sr16)
    _kernel.append(adamw_kernel)
    return adamw_kernel


def eligible(opt: OptimizerParts, group: Mapping[str, Any], plan: _Plan, keys: tuple[str, ...]) -> bool:
    """Whether a bucket may step through the kernel (host work only; contiguity is checked with the tables).

    AdamW/Adam's own arithmetic (a subclass overriding ``_update`` or ``_step_scalars`` is left to
    the compiled step), BF16 parameters (any compensation) or FP32 ones (an FP32 island), FP32 or
    BF16 states, no ``amsgrad``, no mirrors or remainders (the master presets' fused step), on
    :data:`DEVICES`, and Triton imports. (Tensor betas, eps or weight decay never get here: the
    caller, ``_step_bucket_fused``, steps those eagerly.)
    """
    cls = type(opt)
    p0 = plan.params[0]
    if (plan.device.type not in DEVICES or p0.dtype not in (torch.bfloat16, torch.float32)
            or opt._state_dtype_for(p0) not in (torch.bfloat16, torch.float32) or keys != _KEYS
            or group.get("amsgrad") or _origin(cls._update) != _ADAMW_UPDATE
            or _origin(cls._step_scalars) != _ADAMW_SCALARS or opt.mirrors or opt.remainders):
        return False
    if _state.get((plan.device.type, _index(plan.device), "import")) is False:
        return False
    if not _kernel and _build() is None:
        _state[(plan.device.type, _index(plan.device), "import")] = False
        return False
    return True


#: AdamW's own arithmetic, by where it is defined (``_adamw`` imports this module's importers: no import here).
_ADAMW_UPDATE = ("mixprec.optim._adamw", "AdamW._update")
_ADAMW_SCALARS = ("mixprec.optim._adamw", "AdamW._step_scalars")


def _origin(fn: Any) -> tuple[str, str]:
    return getattr(fn, "__module__", ""), getattr(fn, "__qualname__", "")


class AdamWTables:
    """The device tables of one bucket, rebuilt when its tensors' addresses change (a plan's ``triton``).

    One ``int64`` buffer: the parameters', compensations' (Kahan only), ``exp_avg``'s and
    ``exp_avg_sq``'s data pointers, the element counts, global element offsets, the random keys of
    each stream slot the step draws (``(slots, n)``), then per block (``BLOCK`` elements) of each
    launch its tensor and its first element: one launch over the full blocks (no masks: vector
    loads where every pointer is 16-byte aligned) and one over the tensors' last, partial blocks.
    Built on the host and copied once per build (from pinned memory on CUDA: no host sync). The
    gradients' pointers are a second table, rebuilt when they move (steady training reuses the
    caching allocator's addresses, so rarely). Holds the tensors whose pointers it stores.
    """

    __slots__ = ("aligned", "bufs", "device_index", "full", "g_aligned", "g_host", "g_sig", "g_table", "host",
                 "ka0", "kb0", "sig", "slots", "table", "tail", "views")

    def __init__(self, sig: tuple[Any, ...], b: _Bucket, seed: int, slots: tuple[int, ...]) -> None:
        device = b.params[0].device
        numels = [p.numel() for p in b.params]
        bufs = [*b.params, *b.comps, *b.states["exp_avg"], *b.states["exp_avg_sq"]]
        keys = [[stream_key(seed, i * _STREAMS_PER_PARAM + slot) for i in b.ids] for slot in slots]
        full_t: list[int] = []
        full_s: list[int] = []
        tail_t: list[int] = []
        tail_s: list[int] = []
        for i, k in enumerate(numels):
            whole = k // BLOCK
            full_t += [i] * whole
            full_s += range(0, whole * BLOCK, BLOCK)
            if k % BLOCK:
                tail_t.append(i)
                tail_s.append(whole * BLOCK)
        ptrs = [[t.data_ptr() for t in kind] for kind in (b.params, b.comps, b.states["exp_avg"], b.states["exp_avg_sq"])]
        sections = [*ptrs, numels, list(b.offsets), [k[0] for row in keys for k in row],
                    [k[1] for row in keys for k in row], full_t, full_s, tail_t, tail_s]
        flat: list[int] = []
        spans: list[tuple[int, int]] = []
        for sec in sections:
            spans.append((len(flat), len(sec)))
            flat += sec
            flat += [0] * (len(sec) & 1)  # sections 16-byte aligned
        host = torch.tensor(flat or [0], dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
        self.host = host  # kept: a pinned source must outlive its asynchronous copy
        self.table = host.to(device, non_blocking=True)
        # p, c, m, v pointers | numels | offsets | ka0 | kb0 | full blocks' tensors, starts | tail blocks' tensors, starts
        self.views = [self.table[a:a + k] for a, k in spans]
        self.slots = slots
        self.ka0 = self.views[6].view(len(slots), len(b.params))
        self.kb0 = self.views[7].view(len(slots), len(b.params))
        self.full, self.tail = len(full_t), len(tail_t)
        self.aligned = all(t.data_ptr() % 16 == 0 for t in bufs)
        self.sig = sig
        self.bufs = bufs
        self.device_index = _index(device) if device.type == "cuda" else None
        self.g_sig: list[int] | None = None
        self.g_host: Tensor | None = None
        self.g_table: Tensor | None = None
        self.g_aligned = False

    def grads(self, grads: list[Tensor]) -> Tensor:
        """The gradients' pointer table, rebuilt when they moved.

        Holds no gradient: the launch is stream-ordered before any later use of their memory, so
        ``zero_grad`` frees them as it does after torch's step (the caller checked their layout).
        """
        ptrs = list(map(_DATA_PTR, grads))
        if ptrs != self.g_sig:
            host = torch.tensor(ptrs, dtype=torch.int64)
            if self.device_index is not None:
                host = host.pin_memory()
            self.g_host = host
            self.g_table = host.to(self.table.device, non_blocking=True)
            self.g_sig = ptrs
            self.g_aligned = all(q % 16 == 0 for q in ptrs)
        return cast(Tensor, self.g_table)


def _tables(opt: OptimizerParts, plan: _Plan, b: _Bucket) -> AdamWTables | None:
    """The bucket's cached tables (rebuilt when seed, streams, offsets or any address changed).

    ``None`` when the kernel cannot step the bucket as it is now (checked every step, host work
    only: a tensor re-pointed or replaced keeps or reuses an address): a parameter, gradient,
    compensation or state that is not contiguous (the kernel walks memory order, the random bits
    follow the logical one), or a compensation or state not in the dtype the step writes (the
    eager step converts those; the kernel would read the bytes as another type).
    """
    bufs = b.states["exp_avg"] + b.states["exp_avg_sq"]
    pdt = b.params[0].dtype
    if (not all(map(_CONTIGUOUS, chain(b.params, b.grads, b.comps, bufs)))
            or set(map(_DTYPE, bufs)) != {opt._state_dtype_for(b.params[0])}
            or (b.comps and set(map(_DTYPE, b.comps)) != {pdt})):
        plan.triton = None
        return None
    ptrs = tuple(map(_DATA_PTR, chain(b.params, b.comps, bufs)))
    sig = (opt.seed, tuple(b.ids), tuple(b.offsets), ptrs)
    tables: AdamWTables | None = plan.triton
    if tables is not None and tables.sig == sig:
        return tables
    plan.triton = None
    plan.triton = AdamWTables(sig, b, opt.seed, opt._random_slots(b, _KEYS))
    return plan.triton


def _launch(tables: AdamWTables, g_table: Tensor, scalars: Mapping[str, Tensor], keys: tuple[Tensor, Tensor] | None,
            decay: Tensor | None, ctx: _DeviceCtx, group: Mapping[str, Any], modes: tuple[bool, int, bool, bool]) -> None:
    """The bucket's two launches, full blocks then partial ones (no host sync).

    ``keys``: the random keys of this step, ``(slots, n)`` each; ``modes``: BF16 parameters, the
    compensation mode, BF16 states, BF16 gradients.
    """
    v = tables.views
    beta1, beta2 = (float(b) for b in group["betas"])  # NumPy scalars as the eager step takes them (floats)
    wd = float(group["weight_decay"])
    decoupled = bool(group["decoupled_weight_decay"])
    dummy = v[4]  # a pointer for the arguments a variant does not read
    rows = {slot: (keys[0][j], keys[1][j]) for j, slot in enumerate(tables.slots)} if keys is not None else {}
    (ka_p, kb_p), (ka_c, kb_c) = rows.get(_SLOT_PARAM, (dummy, dummy)), rows.get(_SLOT_COMP, (dummy, dummy))
    (ka_m, kb_m), (ka_v, kb_v) = rows.get(_SLOT_STATE0, (dummy, dummy)), rows.get(_SLOT_STATE0 + 1, (dummy, dummy))
    p_bf16, comp, s_bf16, g_bf16 = modes
    kernel = _kernel[0]
    with on_device(tables.device_index):
        for masked, count, blocks, starts in ((False, tables.full, v[8], v[9]), (True, tables.tail, v[10], v[11])):
            if not count:
                continue
            kernel[(count,)](
                v[0], v[1] if comp == 1 else dummy, v[2], v[3], g_table, v[4], blocks, starts, v[5],
                scalars["step_size"], scalars["bc2_sqrt"], ka_p, kb_p, ka_c, kb_c, ka_m, kb_m, ka_v, kb_v,
                decay if decay is not None else dummy, ctx.scale if ctx.scale is not None else dummy,
                ctx.keep if ctx.keep is not None else dummy,
                1.0 - beta1, beta2, 1.0 - beta2, float(group["eps"]), wd,
                BLOCK=BLOCK, MASKED=masked, ALIGNED=tables.aligned and tables.g_aligned, P_BF16=p_bf16, COMP=comp,
                S_BF16=s_bf16, G_BF16=g_bf16, HAS_SCALE=ctx.scale is not None, HAS_KEEP=ctx.keep is not None,
                MAXIMIZE=bool(group["maximize"]), L2=wd != 0 and not decoupled, DECAY=wd != 0 and decoupled,
                enable_fp_fusion=False)


def _modes(opt: OptimizerParts, p: Tensor, gdt: torch.dtype) -> tuple[bool, int, bool, bool]:
    """(BF16 parameters, compensation mode, BF16 states, BF16 gradients) of a bucket whose first parameter is ``p``."""
    p_bf16 = p.dtype == torch.bfloat16
    return (p_bf16, _COMP_MODE[opt.compensation] if p_bf16 else 0, opt._state_dtype_for(p) == torch.bfloat16,
            gdt == torch.bfloat16)


def _step(opt: OptimizerParts, group: Mapping[str, Any], tables: AdamWTables, g_table: Tensor, b: _Bucket,
          ctx: _DeviceCtx, lr_t: Tensor, modes: tuple[bool, int, bool, bool]) -> None:
    """The per-step work around the launch: scalars and keys on short vectors, the launch, the step counts."""
    steps_old = torch.stack(b.steps)
    steps_new = steps_old + (ctx.keep if ctx.keep is not None else 1.0)
    scalars = opt._step_scalars(group, steps_old, steps_new, torch.float32)
    keys = step_keys((tables.ka0, tables.kb0), steps_old) if tables.slots else None
    wd = float(group["weight_decay"])
    decay = (1 - lr_t.reshape(()) * wd).to(torch.float32) if wd != 0 and group["decoupled_weight_decay"] else None
    _untraced(_launch)(tables, g_table, scalars, keys, decay, ctx, group, modes)
    # Written through raw pointers: autograd's version counters as an in-place op bumps them (a graph
    # built before the step then refuses its stale weights, as after the eager step).
    _bump_versions(tables.bufs)
    opt._count_steps(b, ctx)


def _bump_versions(tensors: list[Tensor]) -> None:
    """``torch.autograd.graph.increment_version`` of every tensor (one call; one per tensor before torch 2.6)."""
    try:
        torch.autograd.graph.increment_version(tensors)
    except TypeError:  # torch < 2.6 takes one tensor
        for t in tensors:
            torch.autograd.graph.increment_version(t)


def step_bucket(opt: OptimizerParts, group: Mapping[str, Any], plan: _Plan, b: _Bucket,
                ctx: _DeviceCtx, lr_t: Tensor) -> bool:
    """Step one eligible bucket through the kernel; ``False``: the caller steps it otherwise (nothing changed).

    Per step: the stacked step counters, the scalars and random keys on those short vectors, the
    decay factor ``1 - lr * weight_decay`` (FP64, as the eager step, then FP32), the launches, one
    ``_foreach_add_`` counting the steps. The first use of a variant runs :func:`_first_check`.
    """
    gdt = b.grads[0].dtype
    if gdt not in (torch.bfloat16, torch.float32):
        return False
    tables = _tables(opt, plan, b)
    if tables is None:
        return False
    g_table = tables.grads(b.grads)
    modes = _modes(opt, b.params[0], gdt)
    wd = float(group["weight_decay"])
    decoupled = bool(group["decoupled_weight_decay"])
    variant = (modes, ctx.scale is not None, ctx.keep is not None, bool(group["maximize"]), wd != 0 and not decoupled,
               wd != 0 and decoupled)
    key = (plan.device.type, _index(plan.device), variant)
    ok = _state.get(key)
    if ok is None:
        t0 = time.perf_counter()
        ok = _state[key] = _untraced(_first_check)(opt, group, plan.device, b.params[0].dtype, gdt, ctx, lr_t)
        cast(Any, opt).compile_seconds += time.perf_counter() - t0
    if not ok:
        return False
    _step(opt, group, tables, g_table, b, ctx, lr_t, modes)
    return True


_UNTRACED: dict[Any, Any] = {}


def _untraced(fn: Any) -> Any:
    """``torch._dynamo.disable(fn)``, made once: Triton's launcher is never traced (the step is a graph break anyway)."""
    got = _UNTRACED.get(fn)
    if got is None:
        import torch._dynamo  # (imported by then wherever a GPU step runs; lazily here, not at mixprec's import)

        got = _UNTRACED[fn] = torch._dynamo.disable(fn)
    return got


def _first_check(opt: OptimizerParts, group: Mapping[str, Any], device: torch.device, pdt: torch.dtype,
                 gdt: torch.dtype, ctx: _DeviceCtx, lr_t: Tensor) -> bool:
    """Compile the kernel and compare one step with the eager step on two small tensors (one host sync).

    The tensors: ``3 * BLOCK + 37`` and 300 elements, at global offsets 5 and ``2**32 + 7`` (both
    halves of the index hash), weights over many binades with valid and stale compensations,
    gradients, moments and step counts 3 and 10, the group's hyper-parameters, a ``grad_scale`` of
    1024 and a ``found_inf`` of 0 where the step has them.
    """
    ctx = _DeviceCtx(torch.tensor(1024.0, device=device) if ctx.scale is not None else None,
                     torch.tensor(False, device=device) if ctx.skip is not None else None,
                     torch.tensor(1.0, device=device) if ctx.keep is not None else None)
    kahan = opt._uses_kahan(torch.empty(0, dtype=pdt))
    sdt = opt._state_dtype_for(torch.empty(0, dtype=pdt))
    try:
        g = torch.Generator().manual_seed(1234)
        sizes = (3 * BLOCK + 37, 300)
        base: list[list[Tensor]] = [[], [], [], [], []]
        for n in sizes:
            w32 = torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 3, (n,), generator=g)
            p = w32.to(pdt)
            c = (w32 - p.float()).to(pdt)
            c[::11] = torch.randn(c[::11].shape, generator=g).to(pdt)  # stale compensations
            for kind, value in enumerate((p, c, (torch.randn(n, generator=g)
                                                 * 10.0 ** torch.randint(-5, 1, (n,), generator=g)).to(gdt),
                                          (torch.randn(n, generator=g) * 1e-3).to(sdt),
                                          (torch.rand(n, generator=g) * 1e-5).to(sdt))):
                base[kind].append(value)
        results = []
        for fused in (False, True):
            ps, cs, gs, ms, vs = ([t.clone().to(device) for t in kind] for kind in base)
            steps = [torch.tensor(3.0, device=device), torch.tensor(10.0, device=device)]
            b = _Bucket(ps, gs, cs if kahan else [], {"exp_avg": ms, "exp_avg_sq": vs}, steps, [3, 1000],
                        [5, (1 << 32) + 7], [None, None], [None, None])
            plan = _Plan(device, ps)
            if fused:
                tables = _tables(opt, plan, b)
                if tables is None:
                    raise RuntimeError("internal: the check's tensors are not contiguous")
                g_table = tables.grads(gs)
                _step(opt, group, tables, g_table, b, ctx, lr_t, _modes(opt, ps[0], gdt))
            else:
                cast(Any, opt)._step_bucket(dict(group), plan, b, _KEYS, ctx)
            results.append([*ps, *(cs if kahan else []), *ms, *vs, *steps])
        same = all(_same(a, e) for a, e in zip(results[1], results[0]))
    except Exception as exc:  # any failure of an optional fast path: the compiled step serves
        _warn(device, f"it failed ({type(exc).__name__}: {exc})")
        return False
    if not same:
        _warn(device, "it disagreed with the eager step on its first-use check")
        return False
    return True


def _same(a: Tensor, b: Tensor) -> bool:
    """Bit for bit, except that any NaN matches any NaN (a backend may canonicalise a NaN's payload)."""
    nan = a.isnan() & b.isnan()
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return bool(((a.view(bits) == b.view(bits)) | nan).all())


def _warn(device: torch.device, why: str) -> None:
    interp = " under TRITON_INTERPRET=1" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    warnings.warn(
        f"mixprec: the Triton AdamW step on {device.type}{interp} is off: {why}. The compiled tile step "
        "runs instead; results are the same. Please report this with your torch and triton versions.",
        RuntimeWarning, stacklevel=5)

