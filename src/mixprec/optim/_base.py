"""Shared machinery of mixprec's low-precision optimizers: grouping, the compensated commit,
on-device skipping, state dicts and the conversion from ``torch.optim``.

One step, for each param group and each (device, param dtype, grad dtype) bucket of it:

1. The bucket is cut into *chunks* of at most ``chunk_numel`` elements (a larger contiguous
   parameter is cut into slices); a loop over chunks, never over parameters, launches kernels.
2. Gather: the chunk's parameters, gradients, states and compensation buffers are concatenated
   into flat buffers (``torch.cat``; a chunk of one tensor is a view, no copy) and upcast to
   FP32 (FP64 for FP64 parameters). The gradients are divided by ``grad_scale`` when given.
3. The optimizer's arithmetic runs in FP32 on those flat buffers: one kernel per operation per
   chunk. Per-parameter quantities (bias corrections from each parameter's step counter) are
   expanded to the elements on the device (one ``torch.cat`` of stride-0 views).
4. Commit: the new FP32 weight ``w`` is rounded into the parameter's dtype by the compensation
   rule (``"kahan"``: ``p = round(w)``, ``c = SR(w - p)`` where ``c`` is the compensation buffer
   and ``w`` was computed from ``p + c``; ``"stochastic"``: ``p = SR(w)``; ``"none"``:
   ``p = round(w)``; SR is stochastic rounding). The Kahan buffer is itself stored with
   stochastic rounding: it has only 8 significant bits, and round-to-nearest would drop every
   update below half *its* ulp (about 2**-18 of the weight when the buffer is near its largest),
   which stalls SGD once its updates shrink; stored unbiased, ``p + c`` is an unbiased
   ~16-bit representation of the weight. Half-precision states are stored with stochastic rounding (see
   ``state_dtype``). With ``found_inf`` each new buffer is ``torch.where(found_inf != 0, old,
   new)``, then ``torch._foreach_copy_`` scatters every buffer back into its tensors.
5. Step counters (0-d FP32 tensors on the parameter's device) get ``+1`` (``+ (found_inf == 0)``
   with ``found_inf``) by one ``torch._foreach_add_`` per bucket.

Cost of the on-device skip: the step is always computed; with ``found_inf`` given, one extra
``torch.where`` per persistent buffer (parameters, each state, compensation) per chunk, and the
old values stay alive until the commit. No host synchronisation. A skipped step still draws its
random bits, so the random stream does not depend on which steps were skipped.

Transient memory is bounded by the chunk: about 40-48 bytes per element of ``chunk_numel``
(measured 640-770 MiB at the default 2**24 on a GPT-2-small-sized parameter set, 160-190 MiB at
2**22), independent of model size. Lower ``chunk_numel`` to trade step time for memory: each
chunk costs a fixed ~0.5 ms of host work, so chunks much smaller than ~10M elements leave a GPU idle.

Speed (H100, torch 2.11, 124M parameters in 148 tensors, median step): torch fused AdamW FP32
1.8 ms, torch foreach AdamW FP32 4.4 ms; this AdamW with FP32 parameters 8.6 ms, BF16 + Kahan +
FP32 states 13.9 ms (16.8 ms with ``found_inf``), BF16 + Kahan + BF16 states 18.7 ms, BF16 +
stochastic + BF16 states 16.5 ms (17.8 ms with ``found_inf``). The unfused elementwise chain
(~250 bytes of memory traffic per element) is the cost.

The fused step (``fused=True``; default on CUDA/XPU with Triton): each bucket runs one
``torch.compile``d function (:meth:`LowPrecisionOptimizer._build_fused`): the same ``_update``
arithmetic and commit on each parameter's local tensor, one kernel per parameter, equal to the
eager step bit for bit. Per-parameter scalars (``_step_scalars``) and the random keys are
computed outside the graph; compiled functions are cached process-wide by bucket structure.
CPU measurements and the default rule: ``docs/optim.md``.

``DTensor`` parameters (FSDP2): the step runs on local shards (``_local_tensor``); states and
compensation buffers are ``DTensor``s with the parameter's placements; random bits use each
element's global position (``Shard(0)``), so a sharded run equals the unsharded one bit for bit.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping
from itertools import accumulate
from typing import Any, cast, get_args

import torch
from torch import Tensor

from .._dtypes import dtype_name, parse_dtype
from .._errors import check_fused, unknown_choice
from ._fused_step import FusedStep
from ._parts import (
    _COMP_KEY,
    _HALF,
    _PARAM_DTYPES,
    _SLOT_COMP,
    _SLOT_PARAM,
    _STATE_DTYPES,
    _STEP_KEY,
    _STREAMS_PER_PARAM,
    DEFAULT_CHUNK_NUMEL,
    Compensation,
    _Bucket,
    _cat,
    _device_ctx,
    _DeviceCtx,
    _flat_view,
    _Plan,
    _Segment,
)
from ._rounding import counter_bits, step_keys, stochastic_round, stream_key, with_edits
from ._state_io import StateIO

__all__ = ["DEFAULT_CHUNK_NUMEL", "Compensation", "LowPrecisionOptimizer"]


class LowPrecisionOptimizer(FusedStep, StateIO):
    """Base class of :class:`mixprec.optim.AdamW` and :class:`mixprec.optim.SGD` (see the module docstring).

    Subclasses define the state keys that hold one value per element (``_state_keys``) and the
    FP32 update on flat buffers (``_update``); this class does everything around it.
    """

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        compensation: Compensation = "kahan",
        state_dtype: torch.dtype | str = torch.float32,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
        fused: bool | None = None,
    ) -> None:
        if compensation not in get_args(Compensation):
            raise unknown_choice("compensation", compensation, get_args(Compensation),
                                 "'kahan' keeps a compensation buffer in the parameter dtype, 'stochastic' rounds "
                                 "stochastically, 'none' rounds to nearest.")
        sdt = parse_dtype(state_dtype)
        if sdt not in _STATE_DTYPES:
            raise ValueError(
                f"state_dtype={state_dtype!r}: optimizer states are kept in torch.float32 (default) or torch.bfloat16 "
                "(least memory). float16 is refused because exp_avg_sq holds squared gradients, which leave FP16's "
                "range (underflow below 6e-8, overflow above 65504)."
            )
        if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1:
            raise ValueError(f"chunk_numel={chunk_numel!r}; use a positive int (default {DEFAULT_CHUNK_NUMEL}).")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
        check_fused(fused)
        if generator is not None:
            if seed is not None:
                raise ValueError(f"pass seed={seed!r} or generator=, not both; generator= is deprecated: the random "
                                 "bits of stochastic rounding are a function of seed, step and element position.")
            warnings.warn(
                "generator= is deprecated and only supplies the seed (generator.initial_seed()): stochastic rounding "
                "now draws counter-based bits from (seed, step, tensor, element position), not from a generator's "
                "stream. Pass seed=int instead.",
                DeprecationWarning,
                stacklevel=3,
            )
            seed = generator.initial_seed()
        self.compensation: Compensation = compensation
        self.state_dtype: torch.dtype = sdt
        self.chunk_numel: int = chunk_numel
        if seed is None:
            # torch.initial_seed() does not consume random numbers, and follows torch.manual_seed().
            seed = torch.initial_seed()
        self.seed: int = int(seed)
        #: ``fused`` as passed (``None``: decided per device, see :meth:`fused_enabled`).
        self.fused: bool | None = fused
        #: Seconds spent compiling fused steps so far (first step of each structure); 0.0 when eager.
        self.compile_seconds: float = 0.0
        self._fused_fns: dict[Any, Callable[..., None]] = {}
        self._fused_off: str | None = None  # why fused=None fell back to eager
        self._key_cache: dict[Any, tuple[Tensor, ...]] = {}
        self._offsets: dict[int, int] = {}  # id(param) -> global position of its first element
        self._lr_tensors: dict[Any, Tensor] = {}
        #: group index -> (signature of its parameters with gradients, their buckets): see _plans.
        self._plan_cache: dict[int, tuple[Any, list[_Plan]]] = {}
        #: id(param) -> a tensor that receives the committed value in its own dtype (the model's
        #: half weight of an FP32 master: MasterWeightOptimizer's fused step copies back in-graph).
        self.mirrors: dict[int, Tensor] = {}
        #: Carry edits of a mirror into its parameter before the update (``weight_edits="values"``
        #: of MasterWeightOptimizer, done in the fused kernel): ``p = where(mirror == round(p), p, mirror)``.
        self.sync_mirrors = False
        #: fused=None on a CPU: on when set (MixedPrecision sets it once the model ran compiled).
        self._prefer_fused = False
        super().__init__(params, defaults)

    # ----- configuration ---------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as ``torch.optim.Optimizer.add_param_group``), checking its hyper-parameters.

        Raises:
            ValueError: an invalid hyper-parameter, or a parameter that is not FP16, BF16, FP32
                or FP64 (complex and integer tensors are not supported).
        """
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for p in params:
            if isinstance(p, Tensor) and p.dtype not in _PARAM_DTYPES:
                raise ValueError(
                    f"{type(self).__name__} updates float16/bfloat16/float32/float64 parameters; got a {p.dtype} "
                    f"parameter of shape {tuple(p.shape)}. Leave it out of the optimizer or use a torch.optim optimizer for it."
                )
        group = dict(param_group)
        group["params"] = params
        n = len(self.param_groups)
        super().add_param_group(group)
        try:
            self._validate_group(self.param_groups[n])
        except Exception:
            del self.param_groups[n]
            raise

    def __repr__(self) -> str:
        base = super().__repr__()
        return f"{base[:-1]}mixprec: compensation={self.compensation}, state_dtype={dtype_name(self.state_dtype)}\n)"

    def __getstate__(self) -> dict[str, Any]:  # pickling / deepcopy: compiled steps are rebuilt on demand
        state = super().__getstate__()
        state.update(
            compensation=self.compensation,
            state_dtype=self.state_dtype,
            chunk_numel=self.chunk_numel,
            seed=self.seed,
            fused=self.fused,
            compile_seconds=self.compile_seconds,
            _fused_fns={},
            _fused_off=self._fused_off,
            _key_cache={},
            _offsets={},
            _lr_tensors={},
            _plan_cache={},
            mirrors={},
            sync_mirrors=False,
            _prefer_fused=self._prefer_fused,
        )
        return state

    # ----- stochastic rounding: counter-based random bits ----------------------------------------------
    def _set_global_offsets(self, offsets: Mapping[Tensor, int]) -> None:
        """Internal hook: the global position of each given parameter's first local element.

        A parameter that is a shard of a larger tensor (an FSDP2 ``DTensor``'s local part, a
        slice) rounds with the random bits of the positions it holds in the whole tensor, so
        sharded and unsharded runs round identically. ``offsets`` maps parameters to the flat
        index (row-major, in the whole tensor) of the shard's first element; the shard's
        elements must be consecutive there (true for dim-0 sharding). Unlisted parameters keep
        their offset (0 by default).
        """
        for p, off in offsets.items():
            if isinstance(off, bool) or not isinstance(off, int) or off < 0:
                raise ValueError(f"global offset {off!r} for a parameter of shape {tuple(p.shape)}; use an int >= 0.")
            self._offsets[id(p)] = off
        self._key_cache.clear()
        self._fused_fns.clear()

    # ----- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grad_scale: Tensor | float | None = None,
        found_inf: Tensor | None = None,
    ) -> Any:
        """Update every parameter that has a gradient.

        Args:
            closure: Re-evaluates the model and returns the loss (as ``torch.optim``).
            grad_scale: The gradients are divided by it inside the step (they are not modified).
                Defaults to ``self.grad_scale`` when that attribute is set, which is how
                ``torch.amp.GradScaler`` and mixprec's scalers hand it over
                (``_step_supports_amp_scaling = True``).
            found_inf: 0-d tensor; when non-zero the step changes nothing: parameters, states,
                step counters and compensation buffers stay bit-identical. Decided on the device
                (``torch.where``), without a host sync. Defaults to ``self.found_inf``.

        Returns:
            The closure's loss, or ``None``.

        Raises:
            RuntimeError: a sparse gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        ctxs: dict[torch.device, _DeviceCtx] = {}
        streams: dict[int, int] | None = None  # built only when a bucket needs random stream ids
        for gi, group in enumerate(self.param_groups):
            keys = self._state_keys(group)
            for plan in self._plans(gi, group):
                device = plan.device
                ctx = ctxs.get(device)
                if ctx is None:
                    ctx = ctxs[device] = _device_ctx(device, grad_scale, found_inf)
                self._ensure_states(plan.params, group, keys)
                if self.fused_enabled(device) and self._step_bucket_fused(gi, group, plan, keys, ctx):
                    continue
                if streams is None:
                    streams = self._streams()
                self._step_bucket(group, self._bucket(group, plan.params, streams), ctx)
        return loss

    def _plans(self, gi: int, group: Mapping[str, Any]) -> list[_Plan]:
        """The (device, param dtype, grad dtype) buckets of group ``gi``'s parameters that have gradients.

        Cached per group and rebuilt when the set of parameters with gradients, or a gradient's
        dtype, device or layout, changes: the step's per-parameter bookkeeping is paid once, not
        per step (issue 14: the fused step of a small model was mostly Python). The cache holds
        the parameters themselves, so their ids cannot be reused while it matches.

        Raises:
            RuntimeError: a sparse gradient.
        """
        params = [p for p in group["params"] if p.grad is not None]
        sig = (tuple(map(id, params)), tuple((g.dtype, g.device, g.layout) for g in (p.grad for p in params)))
        cached = self._plan_cache.get(gi)
        if cached is not None and cached[0] == sig:
            return cached[1]
        buckets: dict[tuple[torch.device, torch.dtype, torch.dtype], list[Tensor]] = defaultdict(list)
        for p in params:
            g = cast(Tensor, p.grad)
            if g.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients.")
            buckets[(p.device, p.dtype, g.dtype)].append(p)
        plans = [_Plan(device, ps) for (device, _, _), ps in buckets.items()]
        self._plan_cache[gi] = (sig, plans)
        return plans

    def _ensure_states(self, params: list[Tensor], group: Mapping[str, Any], keys: tuple[str, ...]) -> None:
        """Create the missing state entries of ``params`` (a dict lookup per parameter when all exist)."""
        need = {_STEP_KEY, *keys}
        if self._uses_kahan(params[0]):  # a bucket holds one parameter dtype
            need.add(_COMP_KEY)
        state = self.state
        for p in params:
            st = state.get(p)
            if st is None or not st.keys() >= need:
                self._init_state(p, group)

    def _step_bucket(self, group: dict[str, Any], b: _Bucket, ctx: _DeviceCtx) -> None:
        if self.sync_mirrors:
            self._sync_from_mirrors(b)
        grads = [g.reshape(-1) for g in b.grads]
        for segs in self._chunks(b.params):
            self._step_chunk(group, b, grads, segs, ctx)
        self._count_steps(b, ctx)
        pairs = [(m, p) for m, p in zip(b.mirrors, b.params) if m is not None]
        if pairs:
            torch._foreach_copy_([m for m, _ in pairs], [p for _, p in pairs])

    @staticmethod
    def _sync_from_mirrors(b: _Bucket) -> None:
        """The eager form of the fused kernel's mirror sync: edited mirror elements win."""
        for m, p in zip(b.mirrors, b.params):
            if m is not None:
                with_edits(p, m, out=p)

    # ----- the eager step, chunk by chunk ---------------------------------------------------------------
    def _chunks(self, params: list[Tensor]) -> list[list[_Segment]]:
        limit = self.chunk_numel
        chunks: list[list[_Segment]] = []
        cur: list[_Segment] = []
        cur_n = 0
        for i, p in enumerate(params):
            n = p.numel()
            if n > limit and p.is_contiguous():
                if cur:
                    chunks.append(cur)
                    cur, cur_n = [], 0
                chunks.extend([_Segment(i, a, min(a + limit, n))] for a in range(0, n, limit))
                continue
            if cur and cur_n + n > limit:
                chunks.append(cur)
                cur, cur_n = [], 0
            cur.append(_Segment(i, 0, n))
            cur_n += n
        if cur:
            chunks.append(cur)
        return chunks

    def _step_chunk(
        self,
        group: dict[str, Any],
        b: _Bucket,
        grads: list[Tensor],
        segs: list[_Segment],
        ctx: _DeviceCtx,
    ) -> None:
        p0 = b.params[segs[0].param]
        device, pdt = p0.device, p0.dtype
        acc = torch.promote_types(pdt, torch.float32)
        kahan = bool(b.comps)
        ps = [b.params[s.param] for s in segs]
        sizes = [s.stop - s.start for s in segs]

        # One flat view per tensor serves both the gather (source) and the scatter (destination);
        # None marks a non-contiguous tensor, gathered by a copy and written back whole.
        buffers: list[tuple[str | None, list[Tensor], list[Tensor | None]]] = []

        def gather(key: str | None, tensors: list[Tensor]) -> Tensor:
            views = [_flat_view(t, s) for t, s in zip(tensors, segs)]
            buffers.append((key, tensors, views))
            return _cat([v if v is not None else t.reshape(-1) for v, t in zip(views, tensors)])

        p_old = gather(None, ps)
        grad = _cat([grads[s.param][s.start:s.stop] for s in segs]).to(acc)
        if ctx.scale is not None:
            grad = grad / ctx.scale
        w = p_old.to(acc)
        c_old = None
        if kahan:
            c_old = gather(_COMP_KEY, [b.comps[s.param] for s in segs])
            w = w + c_old.to(acc)
        keys = tuple(b.states)
        s_old = {k: gather(k, [b.states[k][s.param] for s in segs]) for k in keys}
        s_acc = {k: v.to(acc) for k, v in s_old.items()}
        steps_old = torch.stack([b.steps[s.param] for s in segs])
        steps_new = steps_old + (ctx.keep if ctx.keep is not None else 1.0)

        expand = self._expander(sizes)
        scalars = self._step_scalars(group, steps_old, steps_new, acc)
        w_new, s_new = self._update(group, w, grad, s_acc, scalars, expand)
        del grad, w, s_acc
        rand = self._chunk_bits(b, segs, sizes, steps_old, expand, device)

        new: dict[str | None, Tensor] = {}
        if pdt in _HALF:
            if self.compensation == "stochastic":
                new[None] = stochastic_round(w_new, pdt, bits=rand(_SLOT_PARAM))
            else:
                new[None] = w_new.to(pdt)
            if kahan:
                # The remainder w - p is exact in FP32; stochastic rounding stores it unbiased. Round-to-
                # nearest would drop every update below half an ulp of the *buffer* (~2**-18 of the
                # weight once the buffer is large), and SGD with shrinking updates stalls (tested).
                new[_COMP_KEY] = stochastic_round(w_new - new[None].to(acc), pdt, bits=rand(_SLOT_COMP))
        else:
            new[None] = w_new.to(pdt)
        del w_new
        sdt = self._state_dtype_for(p0)
        for k in keys:
            if sdt in _HALF:
                # Round-to-nearest would freeze exp_avg_sq: with beta2 = 0.999 its per-step change is
                # 0.1 % of its value, below half a BF16 ulp (0.39 %). Stochastic rounding keeps it unbiased.
                new[k] = stochastic_round(s_new[k], sdt, bits=rand(self._state_slot(k)))
            else:
                new[k] = s_new[k].to(sdt)
        del s_new
        olds: dict[str | None, Tensor | None] = {None: p_old, _COMP_KEY: c_old}
        olds.update(s_old)
        for key, tensors, views in buffers:
            value = new[key]
            if ctx.skip is not None:
                old = olds[key]
                if old is not None:
                    value = torch.where(ctx.skip, old, value)
            pieces = value.split(sizes) if len(segs) > 1 else (value,)
            dsts = [v if v is not None else t for v, t in zip(views, tensors)]
            srcs = [x if v is not None else x.view(t.shape) for x, v, t in zip(pieces, views, tensors)]
            torch._foreach_copy_(dsts, srcs)

    def _chunk_bits(
        self,
        b: _Bucket,
        segs: list[_Segment],
        sizes: list[int],
        steps_old: Tensor,
        expand: Callable[[Tensor], Tensor],
        device: torch.device,
    ) -> Callable[[int], Tensor]:
        """``rand(slot)``: the chunk's 32 random bits per element for one buffer kind (lazy).

        Element ``j`` of segment ``s`` gets ``counter_bits`` of (seed, the parameter's step
        count before this step, stream ``16 * position + slot``, global index ``offset +
        s.start + j``): the same bits as the fused step and as any other chunking.
        """
        index: list[Tensor] = []

        def rand(slot: int) -> Tensor:
            streams = tuple(b.ids[s.param] * _STREAMS_PER_PARAM + slot for s in segs)
            bases = tuple(b.offsets[s.param] + s.start - c for s, c in zip(segs, accumulate([0, *sizes[:-1]])))
            cache_key = (device, streams, bases)
            cached = self._key_cache.get(cache_key)
            if cached is None:
                if len(self._key_cache) > 4096:
                    self._key_cache.clear()
                keys = [stream_key(self.seed, st) for st in streams]
                ka0, kb0, base = (torch.tensor(v, dtype=torch.int64).to(device, non_blocking=True)
                                  for v in ([k[0] for k in keys], [k[1] for k in keys], list(bases)))
                cached = self._key_cache[cache_key] = (ka0, kb0, base)
            ka0, kb0, base = cached
            if not index:
                total = sum(sizes)
                index.append(torch.arange(total, dtype=torch.int64, device=device) + expand(base))
            ka, kb = step_keys((ka0, kb0), steps_old)
            return counter_bits(expand(ka), expand(kb), index[0])

        return rand

    @staticmethod
    def _expander(sizes: list[int]) -> Callable[[Tensor], Tensor]:
        if len(sizes) == 1:
            return lambda v: v.reshape(())

        def expand(v: Tensor) -> Tensor:
            # One batched cat kernel over stride-0 views: no host sync, and (unlike CUDA's
            # repeat_interleave, one thread per segment) fast for segments of millions of elements.
            return torch.cat([x.expand(n) for x, n in zip(v.unbind(), sizes)])

        return expand
