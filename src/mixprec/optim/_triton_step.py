"""The Kahan-compensated AdamW step as one Triton kernel over every tensor of a bucket (CUDA).

The fused step of :class:`~mixprec.optim.AdamW` (and ``Adam``) on BF16 parameters with
``compensation="kahan"`` and FP32 states is ``bf16-pure``'s default step. Compiled by Inductor it
steps fixed-size tiles, and the small tensors (most of a GPT's) are gathered into packed tiles and
scattered back every step: on an H200 that step took 2.5x torch's fused AdamW on GPT-2's 148
tensors. This module steps the whole bucket in one launch, in place, reading and writing each
element once (param 2 + compensation 2 + gradient 2 + states 8 bytes read, 12 written: 26 bytes
per parameter, torch's fused AdamW on FP32 parameters moves 28).

Algorithm (one Triton program per ``BLOCK`` elements of one tensor, the multi-tensor-apply pattern
of :mod:`mixprec._edit_kernel`): device tables hold each tensor's data pointers (parameter,
compensation, ``exp_avg``, ``exp_avg_sq``; the gradients' in a second table, rebuilt when their
addresses change), element count, first block, global element offset, and each block's tensor.
Per tensor the step's scalars (``step_size``, ``bc2_sqrt``: :meth:`AdamW._step_scalars` of the
stacked step counters) and random keys (:func:`~mixprec.optim._rounding.step_keys`) are computed
by torch on short vectors before the launch. Per element the arithmetic is the eager step's,
operation by operation (``_update`` with ``comp_of_weight`` before it, the rounding after it):
single-rounding FP32 operations, IEEE division and square root, no contraction into FMAs
(``enable_fp_fusion=False``); the BF16 roundings are done on bit patterns (round to nearest even,
and the counter-based stochastic rounding of the compensation, :func:`_sr_counter`'s rule with
:func:`counter_bits`' hash in 32-bit unsigned arithmetic), exact on every backend, Triton's CPU
interpreter included. So the kernel equals the eager step bit for bit (NaN payloads aside). A
skipped step (``found_inf``) masks every load and store: nothing changes, read on the device.

Safety, as :mod:`mixprec._edit_kernel`: Triton is imported lazily; the first use per (device,
kernel variant) compiles the kernel and checks it against the eager step on two small tensors with
the group's hyper-parameters (one host sync per variant and process); a failure or a mismatch
warns once and the caller keeps the compiled tile step. Used on :data:`DEVICES` (CUDA) only;
the caller never reaches it under a ``TorchDispatchMode``, while a CUDA graph is captured, or
inside a dynamo trace (``_parts._compile_blocked``, the step's graph break).
"""

from __future__ import annotations

import importlib
import operator
import os
import time
import warnings
from collections.abc import Mapping
from itertools import chain
from typing import Any, cast

import torch
from torch import Tensor

from .._edit_kernel import on_device
from ._parts import _SLOT_COMP, _STREAMS_PER_PARAM, OptimizerParts, _Bucket, _DeviceCtx, _Plan
from ._rounding import step_keys, stream_key

__all__ = ["BLOCK", "DEVICES", "KahanTables", "reset", "step_bucket"]

#: Devices whose eligible buckets step through the kernel (tests add ``"cpu"`` with ``TRITON_INTERPRET=1``).
DEVICES: frozenset[str] = frozenset({"cuda"})
#: Elements per Triton program.
BLOCK = 2048
_KEYS = ("exp_avg", "exp_avg_sq")
_DATA_PTR = operator.methodcaller("data_ptr")

tl: Any = None  # triton.language once _build imported it
_kernel: list[Any] = []  # the jitted kernel, built on first use
_state: dict[tuple[Any, ...], bool] = {}  # (device type, index, variant) -> passed its first-use check


def reset() -> None:
    """Forget the built kernel and the first-use checks (tests; a change of ``TRITON_INTERPRET``)."""
    _kernel.clear()
    _state.clear()


def _build() -> Any:
    """The jitted kernel (built once), or None when Triton does not import."""
    if _kernel:
        return _kernel[0]
    global tl
    try:  # typed Any: mypy need not know Triton (not installed everywhere)
        triton: Any = importlib.import_module("triton")
        tl = importlib.import_module("triton.language")  # a module global: Triton resolves the kernel's names there
    except Exception:
        return None

    @triton.jit
    def kahan_adamw_kernel(p_ptrs, c_ptrs, m_ptrs, v_ptrs, g_ptrs, numels, block_tensor, block_start, bases,
                           step_size, bc2_sqrt, ka, kb, decay, scale, keep,
                           beta1c, beta2, beta2c, eps, wd,
                           BLOCK: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr, G_BF16: tl.constexpr,
                           HAS_SCALE: tl.constexpr, HAS_KEEP: tl.constexpr, MAXIMIZE: tl.constexpr, L2: tl.constexpr,
                           DECAY: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.load(block_tensor + pid)
        start = tl.multiple_of(tl.load(block_start + pid), BLOCK)
        idx = start + tl.arange(0, BLOCK)  # int64: tensors past 2**31 elements
        pp = tl.load(p_ptrs + t).to(tl.pointer_type(tl.uint16))
        cp = tl.load(c_ptrs + t).to(tl.pointer_type(tl.uint16))
        mp = tl.load(m_ptrs + t).to(tl.pointer_type(tl.float32))
        vp = tl.load(v_ptrs + t).to(tl.pointer_type(tl.float32))
        if G_BF16:
            gp = tl.load(g_ptrs + t).to(tl.pointer_type(tl.uint16))
        else:
            gpf = tl.load(g_ptrs + t).to(tl.pointer_type(tl.float32))
        if ALIGNED:  # every pointer 16-byte aligned (checked on the host): 16-byte vector loads and stores
            pp = tl.multiple_of(pp, 16)
            cp = tl.multiple_of(cp, 16)
            mp = tl.multiple_of(mp, 16)
            vp = tl.multiple_of(vp, 16)
            if G_BF16:
                gp = tl.multiple_of(gp, 16)
            else:
                gpf = tl.multiple_of(gpf, 16)
        if MASKED:  # the last, partial block of a tensor
            n = tl.load(numels + t)
            if HAS_KEEP:  # a skipped step (found_inf): no element is read or written
                n = tl.where(tl.load(keep) != 0.0, n, 0)
            inside = idx < n
        elif HAS_KEEP:  # full blocks: read unmasked (vector loads), written only when the step is kept
            inside = (tl.full([BLOCK], 0.0, tl.float32) + tl.load(keep)) != 0.0  # one value: vector stores still
        else:
            inside = None
        if MASKED:
            w = (tl.load(pp + idx, mask=inside, other=0).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            c = (tl.load(cp + idx, mask=inside, other=0).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            m_old = tl.load(mp + idx, mask=inside, other=0.0)
            v_old = tl.load(vp + idx, mask=inside, other=0.0)
            if G_BF16:
                g = (tl.load(gp + idx, mask=inside, other=0).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            else:
                g = tl.load(gpf + idx, mask=inside, other=0.0)
        else:
            w = (tl.load(pp + idx).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            c = (tl.load(cp + idx).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            m_old = tl.load(mp + idx)
            v_old = tl.load(vp + idx)
            if G_BF16:
                g = (tl.load(gp + idx).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            else:
                g = tl.load(gpf + idx)
        if HAS_SCALE:
            g = tl.math.div_rn(g, tl.load(scale))
        if MAXIMIZE:
            g = -g
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
        # The parameter: round to nearest even on the bit pattern (inf past the largest finite; NaN kept).
        wb = wn.to(tl.uint32, bitcast=True)
        p16 = tl.where((wb & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, (wb + 0x7FFF + ((wb >> 16) & 1)) >> 16)
        cx = wn - (p16 << 16).to(tl.float32, bitcast=True)  # exact
        # 32 random bits per element: counter_bits(ka, kb, global index), 32-bit unsigned arithmetic.
        gidx = tl.load(bases + t) + idx
        x = (gidx & 0xFFFFFFFF).to(tl.uint32) ^ tl.load(ka + t).to(tl.uint32)
        x = ((x >> 16) ^ x) * 0x45D9F3B
        x = x ^ tl.load(kb + t).to(tl.uint32) ^ (gidx >> 32).to(tl.uint32)
        x = ((x >> 16) ^ x) * 0x45D9F3B
        x = ((x >> 16) ^ x) * 0x45D9F3B
        bits = (x >> 16) ^ x
        # The compensation, rounded stochastically (the upper 16 random bits added below the cut);
        # from the top bucket up (inf, NaN) to nearest, as _sr_counter.
        xb = cx.to(tl.uint32, bitcast=True)
        near = tl.where((xb & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, (xb + 0x7FFF + ((xb >> 16) & 1)) >> 16)
        c16 = tl.where((xb & 0x7FFFFFFF) < 0x7F7F0000, (xb + (bits >> 16)) >> 16, near)
        tl.store(pp + idx, p16.to(tl.uint16), mask=inside)
        tl.store(cp + idx, c16.to(tl.uint16), mask=inside)
        tl.store(mp + idx, m, mask=inside)
        tl.store(vp + idx, v, mask=inside)

    _kernel.append(kahan_adamw_kernel)
    return kahan_adamw_kernel


def eligible(opt: OptimizerParts, group: Mapping[str, Any], plan: _Plan, keys: tuple[str, ...]) -> bool:
    """Whether a bucket may step through the kernel (host work only; contiguity is checked with the tables).

    AdamW/Adam's own arithmetic (a subclass overriding ``_update`` or ``_step_scalars`` is left to
    the compiled step), Kahan compensation of BF16 parameters, FP32 states, no ``amsgrad``, no
    mirrors or remainders (the master presets' fused step), on :data:`DEVICES`, and Triton imports.
    """
    cls = type(opt)
    p0 = plan.params[0]
    if (plan.device.type not in DEVICES or p0.dtype != torch.bfloat16 or opt.compensation != "kahan"
            or opt.state_dtype != torch.float32 or keys != _KEYS or group.get("amsgrad")
            or _origin(cls._update) != _ADAMW_UPDATE or _origin(cls._step_scalars) != _ADAMW_SCALARS
            or opt.mirrors or opt.remainders):
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


def _index(device: torch.device) -> int | None:
    if device.type == "cuda" and device.index is None:
        return torch.cuda.current_device()
    return device.index


class KahanTables:
    """The device tables of one bucket, rebuilt when its tensors' addresses change (a plan's ``triton``).

    One ``int64`` buffer: the parameters', compensations', ``exp_avg``'s and ``exp_avg_sq``'s data
    pointers, the element counts, global element offsets and the two random keys per tensor, then
    per block (``BLOCK`` elements) of each launch its tensor and its first element: one launch over
    the full blocks (no masks: vector loads where every pointer is 16-byte aligned) and one over the
    tensors' last, partial blocks. Built on the host and copied once per build (from pinned memory
    on CUDA: no host sync). The gradients' pointers are a second table, rebuilt when they move
    (steady training reuses the caching allocator's addresses, so rarely). Holds the tensors whose
    pointers it stores.
    """

    __slots__ = ("aligned", "bufs", "device_index", "full", "g_aligned", "g_host", "g_ptrs", "g_sig", "g_table", "host",
                 "ka0", "kb0", "sig", "table", "tail", "views")

    def __init__(self, sig: tuple[Any, ...], b: _Bucket, seed: int) -> None:
        device = b.params[0].device
        n = len(b.params)
        numels = [p.numel() for p in b.params]
        bufs = [*b.params, *b.comps, *b.states["exp_avg"], *b.states["exp_avg_sq"]]
        streams = [stream_key(seed, i * _STREAMS_PER_PARAM + _SLOT_COMP) for i in b.ids]
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
        # Each section padded to an even length: every one starts 16-byte aligned, so Triton's pointer
        # specialisation (alignment) is the same for every bucket size (one compile per variant).
        sections = [[t.data_ptr() for t in bufs[i * n:(i + 1) * n]] for i in range(4)]
        sections += [numels, list(b.offsets), [k[0] for k in streams], [k[1] for k in streams],
                     full_t, full_s, tail_t, tail_s]
        flat: list[int] = []
        spans: list[tuple[int, int]] = []
        for sec in sections:
            spans.append((len(flat), len(sec)))
            flat += sec
            flat += [0] * (len(sec) & 1)
        host = torch.tensor(flat, dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
        self.host = host  # kept: a pinned source must outlive its asynchronous copy
        self.table = host.to(device, non_blocking=True)
        # p, c, m, v pointers | numels | offsets | ka0 | kb0 | full blocks' tensors, starts | tail blocks' tensors, starts
        self.views = [self.table[a:a + k] for a, k in spans]
        self.ka0, self.kb0 = self.views[6], self.views[7]
        self.full, self.tail = len(full_t), len(tail_t)
        self.aligned = all(t.data_ptr() % 16 == 0 for t in bufs)
        self.sig = sig
        self.bufs = bufs
        self.device_index = _index(device) if device.type == "cuda" else None
        self.g_sig: list[int] | None = None
        self.g_host: Tensor | None = None
        self.g_table: Tensor | None = None
        self.g_aligned = False
        self.g_ptrs: list[Tensor] = []

    def grads(self, grads: list[Tensor]) -> Tensor | None:
        """The gradients' pointer table (rebuilt when they moved); ``None`` when one is not contiguous."""
        ptrs = list(map(_DATA_PTR, grads))
        if ptrs != self.g_sig:
            if not all(g.is_contiguous() for g in grads):
                return None
            host = torch.tensor(ptrs, dtype=torch.int64)
            if self.device_index is not None:
                host = host.pin_memory()
            self.g_host = host
            self.g_table = host.to(self.table.device, non_blocking=True)
            self.g_sig = ptrs
            self.g_aligned = all(q % 16 == 0 for q in ptrs)
        self.g_ptrs = grads  # their storages outlive the launch
        return self.g_table


def _tables(opt: OptimizerParts, plan: _Plan, b: _Bucket) -> KahanTables | None:
    """The bucket's cached tables (rebuilt when seed, streams, offsets or any address changed); ``None``: not contiguous."""
    ptrs = tuple(map(_DATA_PTR, chain(b.params, b.comps, b.states["exp_avg"], b.states["exp_avg_sq"])))
    sig = (opt.seed, tuple(b.ids), tuple(b.offsets), ptrs)
    tables: KahanTables | None = plan.triton
    if tables is not None and tables.sig == sig:
        return tables
    plan.triton = None
    bufs = (*b.params, *b.comps, *b.states["exp_avg"], *b.states["exp_avg_sq"])
    if not all(t.is_contiguous() for t in bufs):
        return None
    plan.triton = KahanTables(sig, b, opt.seed)
    return plan.triton


def _launch(tables: KahanTables, g_table: Tensor, scalars: Mapping[str, Tensor], ka: Tensor, kb: Tensor,
            decay: Tensor | None, ctx: _DeviceCtx, group: Mapping[str, Any], g_bf16: bool) -> None:
    """The bucket's two launches, full blocks then partial ones (no host sync)."""
    v = tables.views
    beta1, beta2 = group["betas"]
    wd = float(group["weight_decay"])
    decoupled = bool(group["decoupled_weight_decay"])
    dummy = v[4]  # a pointer for the arguments a variant does not read
    kernel = _kernel[0]
    with on_device(tables.device_index):
        for masked, count, blocks, starts in ((False, tables.full, v[8], v[9]), (True, tables.tail, v[10], v[11])):
            if not count:
                continue
            kernel[(count,)](
                v[0], v[1], v[2], v[3], g_table, v[4], blocks, starts, v[5],
                scalars["step_size"], scalars["bc2_sqrt"], ka, kb,
                decay if decay is not None else dummy, ctx.scale if ctx.scale is not None else dummy,
                ctx.keep if ctx.keep is not None else dummy,
                1.0 - beta1, beta2, 1.0 - beta2, float(group["eps"]), wd,
                BLOCK=BLOCK, MASKED=masked, ALIGNED=tables.aligned and tables.g_aligned, G_BF16=g_bf16,
                HAS_SCALE=ctx.scale is not None, HAS_KEEP=ctx.keep is not None, MAXIMIZE=bool(group["maximize"]),
                L2=wd != 0 and not decoupled, DECAY=wd != 0 and decoupled, enable_fp_fusion=False)


def step_bucket(opt: OptimizerParts, group: Mapping[str, Any], plan: _Plan, b: _Bucket,
                ctx: _DeviceCtx, lr_t: Tensor) -> bool:
    """Step one eligible bucket through the kernel; ``False``: the caller steps it otherwise (nothing changed).

    Per step: the stacked step counters, the scalars and random keys on those short vectors, the
    decay factor ``1 - lr * weight_decay`` (FP64, as the eager step, then FP32), one launch, one
    ``_foreach_add_`` counting the steps. The first use of a variant runs :func:`_first_check`.
    """
    tables = _tables(opt, plan, b)
    if tables is None:
        return False
    g_table = tables.grads(b.grads)
    if g_table is None:
        return False
    gdt = b.grads[0].dtype
    if gdt not in (torch.bfloat16, torch.float32):
        return False
    wd = float(group["weight_decay"])
    decoupled = bool(group["decoupled_weight_decay"])
    variant = (gdt, ctx.scale is not None, ctx.keep is not None, bool(group["maximize"]), wd != 0 and not decoupled,
               wd != 0 and decoupled)
    key = (plan.device.type, _index(plan.device), variant)
    ok = _state.get(key)
    if ok is None:
        t0 = time.perf_counter()
        ok = _state[key] = _untraced(_first_check)(opt, group, plan.device, gdt, ctx)
        cast(Any, opt).compile_seconds += time.perf_counter() - t0
    if not ok:
        return False
    steps_old = torch.stack(b.steps)
    steps_new = steps_old + (ctx.keep if ctx.keep is not None else 1.0)
    scalars = opt._step_scalars(group, steps_old, steps_new, torch.float32)
    ka, kb = step_keys((tables.ka0, tables.kb0), steps_old)
    decay = (1 - lr_t.reshape(()) * wd).to(torch.float32) if wd != 0 and decoupled else None
    _untraced(_launch)(tables, g_table, scalars, ka, kb, decay, ctx, group, gdt == torch.bfloat16)
    opt._count_steps(b, ctx)
    return True


_UNTRACED: dict[Any, Any] = {}


def _untraced(fn: Any) -> Any:
    """``torch._dynamo.disable(fn)``, made once: Triton's launcher is never traced (the step is a graph break anyway)."""
    got = _UNTRACED.get(fn)
    if got is None:
        import torch._dynamo  # (imported by then wherever a GPU step runs; lazily here, not at mixprec's import)

        got = _UNTRACED[fn] = torch._dynamo.disable(fn)
    return got


def _first_check(opt: OptimizerParts, group: Mapping[str, Any], device: torch.device, gdt: torch.dtype,
                 ctx: _DeviceCtx) -> bool:
    """Compile the kernel and compare one step with the eager step on two small tensors (one host sync).

    The tensors: ``3 * BLOCK + 37`` and 300 elements, at global offsets 5 and ``2**32 + 7`` (both
    halves of the index hash), weights over many binades with valid and stale compensations,
    gradients, moments and step counts 3 and 10, the group's hyper-parameters, a ``grad_scale`` of
    1024 and a ``found_inf`` of 0 where the step has them.
    """
    ctx = _DeviceCtx(torch.tensor(1024.0, device=device) if ctx.scale is not None else None,
                     torch.tensor(False, device=device) if ctx.skip is not None else None,
                     torch.tensor(1.0, device=device) if ctx.keep is not None else None)
    try:
        g = torch.Generator().manual_seed(1234)
        sizes = (3 * BLOCK + 37, 300)

        def make() -> tuple[list[Tensor], ...]:
            ps, cs, gs, ms, vs = [], [], [], [], []
            for n in sizes:
                w32 = torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 3, (n,), generator=g)
                p = w32.to(torch.bfloat16)
                c = (w32 - p.float()).to(torch.bfloat16)
                c[::11] = torch.randn(c[::11].shape, generator=g).to(torch.bfloat16)  # stale compensations
                ps.append(p)
                cs.append(c)
                gs.append((torch.randn(n, generator=g) * 10.0 ** torch.randint(-5, 1, (n,), generator=g)).to(gdt))
                ms.append(torch.randn(n, generator=g) * 1e-3)
                vs.append(torch.rand(n, generator=g) * 1e-5)
            return ps, cs, gs, ms, vs

        base = make()
        results = []
        for fused in (False, True):
            ps, cs, gs, ms, vs = ([t.clone().to(device) for t in kind] for kind in base)
            steps = [torch.tensor(3.0, device=device), torch.tensor(10.0, device=device)]
            b = _Bucket(ps, gs, cs, {"exp_avg": ms, "exp_avg_sq": vs}, steps, [3, 1000], [5, (1 << 32) + 7],
                        [None, None], [None, None])
            plan = _Plan(device, ps)
            if fused:
                lr = group["lr"]
                lr_t = torch.tensor([float(lr)] if not isinstance(lr, Tensor) else [float(lr.detach().cpu())],
                                    dtype=torch.float64, device=device)
                tables = _tables(opt, plan, b)
                g_table = tables.grads(gs) if tables is not None else None
                if tables is None or g_table is None:
                    raise RuntimeError("internal: the check's tensors are not contiguous")
                steps_old = torch.stack(steps)
                steps_new = steps_old + (ctx.keep if ctx.keep is not None else 1.0)
                scalars = opt._step_scalars(group, steps_old, steps_new, torch.float32)
                ka, kb = step_keys((tables.ka0, tables.kb0), steps_old)
                wd = float(group["weight_decay"])
                decoupled = bool(group["decoupled_weight_decay"])
                decay = (1 - lr_t.reshape(()) * wd).to(torch.float32) if wd != 0 and decoupled else None
                _launch(tables, g_table, scalars, ka, kb, decay, ctx, group, gdt == torch.bfloat16)
                opt._count_steps(b, ctx)
            else:
                cast(Any, opt)._step_bucket(dict(group), plan, b, _KEYS, ctx)
            results.append([*ps, *cs, *ms, *vs, *steps])
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
        f"mixprec: the Triton Kahan AdamW step on {device.type}{interp} is off: {why}. The compiled tile step "
        "runs instead; results are the same. Please report this with your torch and triton versions.",
        RuntimeWarning, stacklevel=5)

