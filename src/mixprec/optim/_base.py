"""Shared machinery of mixprec's low-precision optimizers: grouping, the compensated commit,
on-device skipping, state dicts and the conversion from ``torch.optim``.

One step, for each param group and each (device, param dtype, grad dtype) bucket of it:

1. The bucket is cut into *tiles* of at most ``chunk_numel`` elements (at most 2**17 on a CPU,
   where a tile's temporaries then stay in cache and come from the heap, not from fresh pages):
   a contiguous parameter larger than that is cut into near-equal slices, one tile each; the
   others are packed whole. The tiles and the 1-D views of every parameter, state and
   compensation buffer they cover are built once per bucket structure (:class:`_EagerLayout`,
   checked each step by data pointers, on the host) and reused, so a step makes no
   per-parameter views: it launches a fixed number of kernels per tile, whatever the number of
   tensors (``tests/optim/test_eager_ops.py`` counts them).
2. Per bucket: the step counters are stacked (one ``torch.stack``); the per-parameter scalars
   (``_step_scalars``: bias corrections) and the random keys of each (stream, parameter)
   mixed with its step count are computed on those short vectors.
3. Gather, per tile: the parameters, states and compensation buffers by one ``torch.cat`` of
   the cached views each (a one-segment tile uses the view itself), the gradients by one
   ``torch._chunk_cat`` (any shapes and strides, upcast in the same kernel), then upcast to
   FP32 (FP64 for FP64 parameters). The gradients are divided by ``grad_scale`` when given.
4. The optimizer's arithmetic (``_update``) runs in FP32 on those flat buffers: one kernel per
   operation per tile. Per-parameter scalars reach the elements by one ``index_select`` with a
   per-element parameter index (built per tile by a ``cumsum`` over segment starts: parallel,
   no host sync), or as a 0-d tensor in a one-segment tile.
5. Commit: the new FP32 weight ``w`` is rounded into the parameter's dtype by the compensation
   rule (``"kahan"``: ``p = round(w)``, ``c = SR(w - p)`` where ``c`` is the compensation buffer
   and ``w`` was computed from ``p + c``; ``"stochastic"``: ``p = SR(w)``; ``"none"``:
   ``p = round(w)``; SR is stochastic rounding). The Kahan buffer is itself stored with
   stochastic rounding: it has only 8 significant bits, and round-to-nearest would drop every
   update below half *its* ulp (about 2**-18 of the weight when the buffer is near its largest),
   which stalls SGD once its updates shrink; stored unbiased, ``p + c`` is an unbiased
   ~16-bit representation of the weight. Half-precision states are stored with stochastic rounding (see
   ``state_dtype``). The random bits are ``counter_bits`` of each element's global index,
   hashed in int32 lanes (``counter_bits32``, the same bits) unless an index reaches 2**31.
   With ``found_inf`` each new buffer is ``where(found_inf != 0, old, new)`` (on a CPU as three
   bit operations, see :func:`_unless_skipped`), then ``split`` + one
   ``torch._foreach_copy_`` scatters every buffer back into its cached views.
6. Step counters (0-d FP32 tensors on the parameter's device) get ``+1`` (``+ (found_inf == 0)``
   with ``found_inf``) by one ``torch._foreach_add_`` per bucket.

Only whole non-contiguous tensors (gathered by a copy, written back whole), 0-d gradients and,
with ``sync_mirrors`` (a master-weight step whose fused form is off), the mirror sync get
per-tensor ops. Each tile costs about 100-250 ops of host work (AdamW + Kahan, to AdamW +
stochastic rounding + BF16 states), so the aten ops per step are ``bucket constant + tiles x
per-tile constant``, independent of the number of parameter tensors.

Cost of the on-device skip: the step is always computed; with ``found_inf`` given, one extra
select per persistent buffer (parameters, each state, compensation) per tile, and the old
values stay alive until the commit. No host synchronisation. A skipped step still draws its
random bits, so the random stream does not depend on which steps were skipped.

Transient memory is bounded by the tile: about 40-48 bytes per element of ``chunk_numel``
(measured 640-770 MiB at the default 2**24 on a GPT-2-small-sized parameter set, 160-190 MiB at
2**22; ~6 MiB for a CPU tile), independent of model size; the cached layout holds views only (no
memory of its own beyond a few index tensors per tile). Lower ``chunk_numel`` to trade step time
for memory: each tile costs a fixed host time (~0.2-0.4 ms on a CPU), so GPU tiles much smaller
than ~10M elements leave the GPU idle.

Speed (H100, torch 2.11, 124M parameters in 148 tensors, median step, measured before the
tiled layout of issue 27): torch fused AdamW FP32 1.8 ms, torch foreach AdamW FP32 4.4 ms; this
AdamW with FP32 parameters 8.6 ms, BF16 + Kahan + FP32 states 13.9 ms (16.8 ms with
``found_inf``), BF16 + Kahan + BF16 states 18.7 ms, BF16 + stochastic + BF16 states 16.5 ms
(17.8 ms with ``found_inf``). The unfused elementwise chain (~250 bytes of memory traffic per
element) is the cost. After the tiled layout, on an H200 (torch 2.11, 2026-11-27, GPT-2 124M's
148 tensors, ``found_inf`` given, ``benchmarks/gpu_suite.py``): BF16 + Kahan + FP32 states 29.8
and 31.1 ms against 2.26-2.77 ms for torch's fused AdamW, about twice the H100 figure above; the
suite's profile put 26.5 ms of it in 780 kernels per step (device-bound: the unfused chain).
CPU measurements: ``docs/optim.md``.

The fused step (``fused=True``; default on CUDA/XPU with Triton; ``_fused_step.py``): the same
``_update`` arithmetic and commit, compiled once per configuration (dtypes, compensation,
hyper-parameters but the LR, ...) as a step of one fixed-size tile; each bucket is cut into such
tiles (full slices of large tensors stepped in place, the rest packed and padded) and stepped
one call per tile, equal to the eager step bit for bit. CPU measurements and the default rule:
``docs/optim.md``.

``DTensor`` parameters (FSDP2): the step runs on local shards (``_local_tensor``); states and
compensation buffers are ``DTensor``s with the parameter's placements; random bits use each
element's global position (``Shard(0)``), so a sharded run equals the unsharded one bit for bit.
"""

from __future__ import annotations

import operator
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Mapping
from itertools import chain
from typing import Any, cast, get_args

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._dtypes import HALF, dtype_name, parse_dtype
from .._errors import check_fused, eager_only, unknown_choice
from .._remainder import join_edited, placeholder, split_into_
from ._fused_step import FusedStep
from ._parts import (
    _COMP_KEY,
    _GRAD,
    _PARAM_DTYPES,
    _SLOT_COMP,
    _SLOT_PARAM,
    _STATE_DTYPES,
    _STEP_KEY,
    _STREAMS_PER_PARAM,
    DEFAULT_CHUNK_NUMEL,
    Compensation,
    _Bucket,
    _chunk_cat,
    _compile_blocked,
    _device_ctx,
    _DeviceCtx,
    _EagerLayout,
    _Plan,
    _scatter,
    _Segment,
    _Tile,
)
from ._rounding import (
    comp_of_weight,
    counter_bits,
    counter_bits32,
    step_keys,
    stochastic_round,
    stream_key,
    to_int32_lanes,
    with_edits,
)
from ._state_io import StateIO

#: What a plan's cache checks of each gradient (one C-level call per gradient).
_GRAD_META = operator.attrgetter("dtype", "device", "layout")

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
        self._eager_warned: set[str] = set()  # why a bucket stepped eagerly under the fused step (warned once)
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
        #: id(param) -> int16 remainder of a remainder-stored master (see OptimizerParts.remainders).
        self.remainders: dict[int, Tensor] = {}
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
        check = self.__dict__.get("_added_check")  # set by MixedPrecision.prepare: parameters it cast
        if check is not None:
            check(params)
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
            _eager_warned=set(),
            _key_cache={},
            _offsets={},
            _lr_tensors={},
            _plan_cache={},
            mirrors={},
            sync_mirrors=False,
            remainders={},
            _prefer_fused=self._prefer_fused,
        )
        source = self._torch_source() if self._torch_source is not None else None
        if source is not None:  # strong here: a copy of a run links to the copy of the torch optimizer (memo)
            state["_torch_source"] = source
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_torch_source" not in state:  # (also load_state_dict's call: the link stays)
            super().__setstate__(state)
            return
        state = dict(state)
        source = state.pop("_torch_source")
        super().__setstate__(state)
        if source is not None:
            self._link_source(source)

    def _link_source(self, source: Optimizer) -> None:
        """Internal (``from_torch``): ``source`` is the torch optimizer this one was converted from.

        An LR scheduler built on ``source`` keeps following this optimizer: each step of it sets
        torch's "step ran" mark on ``source`` (torch's step wrapper calls ``_optimizer_step_code``
        after every step; no cost on the step itself), and :meth:`load_state_dict` points
        ``source.param_groups`` at the loaded groups. ``source`` is held weakly (its stale state
        is not kept alive by this optimizer); a ``copy.deepcopy`` or pickle of this optimizer
        links the copy to the copy of ``source`` (the same object when both are in the copied run).
        """
        self._torch_source = weakref.ref(source)

    def _optimizer_step_code(self) -> None:
        """torch's marker after each step (its profiler finds optimizers by that frame), then the source's mark."""
        Optimizer._optimizer_step_code(self)
        ref = self._torch_source
        source = ref() if ref is not None else None
        if source is not None:
            source._opt_called = True  # type: ignore[attr-defined]  # torch's private mark, read by its LR schedulers

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

        Under ``torch.compile`` (``torch.compile(opt.step)``, or a compiled train step that calls
        it) the step runs eagerly behind one graph break, with the same numbers as an eager step:
        traced, Inductor folds the round trip of the Kahan remainder ``w - round(w)`` to 0 and
        the stochastic rounding's bits away, and AOTAutograd refuses the in-place writes to a
        single parameter's no-grad views. Its own fused step still compiles its tiles.
        """
        if torch.compiler.is_compiling():  # the one test the eager hot path pays
            return _step_outside_trace(self, closure, grad_scale, found_inf)
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
        # Under a TorchDispatchMode (FlopCounterMode, a memory tracker, a tracer's mode) or with torch.compile
        # disabled nothing compiles: that step runs eagerly (bit for bit the fused one; a mode sees every op),
        # with the fused step kept on for the steps after it, not turned off as after a failed compile.
        blocked: bool | None = None  # asked once per step, and only when a bucket would fuse
        for gi, group in enumerate(self.param_groups):
            keys = self._state_keys(group)
            for plan in self._plans(gi, group):
                device = plan.device
                ctx = ctxs.get(device)
                if ctx is None:
                    ctx = ctxs[device] = _device_ctx(device, grad_scale, found_inf)
                sts = self._ensure_states(plan.params, group, keys)
                if self.fused_enabled(device):
                    if blocked is None:
                        blocked = _compile_blocked()
                    if not blocked and self._step_bucket_fused(gi, group, plan, keys, ctx, sts):
                        continue
                if streams is None:
                    streams = self._streams()
                self._step_bucket(group, plan, self._bucket(group, plan.params, streams, sts), keys, ctx)
        return loss

    #: ``step`` without torch's hook wrapper (torch's ``Optimizer`` wraps each subclass's ``step`` in
    #: ``_patch_step_function``), for callers that ran the hooks already: a step reached from a trace,
    #: ``_fused.FusedShadow`` (the hooks of the torch optimizer it steps for, run once).
    _step_unhooked = step

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
        # C-level maps: this runs every step, and Python per parameter is what a GPU step of many tensors costs.
        sig = (tuple(map(id, params)), tuple(map(_GRAD_META, map(_GRAD, params))))
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

    def _ensure_states(self, params: list[Tensor], group: Mapping[str, Any],
                       keys: tuple[str, ...]) -> list[dict[str, Any]]:
        """Create the missing state entries of ``params`` (a dict lookup per parameter when all exist).

        Returns:
            The parameters' state dicts, in order (the bucket reuses them: a tensor-keyed lookup
            is a Python-level ``Tensor.__hash__`` call per parameter and step).
        """
        need = {_STEP_KEY, *keys}
        if self._uses_kahan(params[0]):  # a bucket holds one parameter dtype
            need.add(_COMP_KEY)
        state = self.state
        sts = list(map(state.get, params))  # (C-level: every step)
        if None not in sts and all(map(need.issubset, cast(list[dict[str, Any]], sts))):
            return cast(list[dict[str, Any]], sts)
        for p, st in zip(params, sts):
            if st is None or not st.keys() >= need:
                self._init_state(p, group)
        return list(map(state.__getitem__, params))

    def _step_bucket(self, group: dict[str, Any], plan: _Plan, b: _Bucket, keys: tuple[str, ...],
                     ctx: _DeviceCtx) -> None:
        """The eager step of one bucket: a fixed number of kernels per tile, whatever the number of tensors.

        Per step and bucket: the step counters are stacked (one ``stack``), the per-parameter
        scalars and the random keys are computed on those vectors, then each cached tile
        (:meth:`_layout`) is stepped by :meth:`_step_tile`, and one ``_foreach_add_`` counts the
        steps.
        """
        if self.sync_mirrors:
            self._sync_from_mirrors(b)
        rem = [(p, m, r) for p, m, r in zip(b.params, b.mirrors, b.rems) if r is not None and m is not None]
        for p, m, r in rem:  # remainder-stored masters (the fused kernel joins them itself): their FP32 values
            p.data = join_edited(m, r)
        layout = self._layout(plan, b, keys)
        acc = torch.promote_types(b.params[0].dtype, torch.float32)
        steps_old = torch.stack(b.steps)
        steps_new = steps_old + (ctx.keep if ctx.keep is not None else 1.0)
        scalars = self._step_scalars(group, steps_old, steps_new, acc)
        rkeys: dict[torch.dtype, tuple[Tensor, Tensor]] = {}
        if layout.slots:
            # (slot, parameter) keys mixed with each parameter's step count: a few tiny kernels per bucket.
            ka, kb = step_keys((cast(Tensor, layout.ka0), cast(Tensor, layout.kb0)), steps_old)
            rkeys[torch.int64] = (ka, kb)
            if not all(t.big_index for t in layout.tiles):
                rkeys[torch.int32] = (to_int32_lanes(ka), to_int32_lanes(kb))
        flat_grads: dict[int, Tensor] = {}  # a sliced tensor's flattened gradient, shared by its tiles
        skip_masks: dict[torch.dtype, Tensor] = {}
        for tile in layout.tiles:
            self._step_tile(group, b, layout, tile, keys, scalars, rkeys, flat_grads, skip_masks, acc, ctx)
        self._count_steps(b, ctx)
        pairs = [(m, p) for m, p, r in zip(b.mirrors, b.params, b.rems) if m is not None and r is None]
        if pairs:
            torch._foreach_copy_([m for m, _ in pairs], [p for _, p in pairs])
        for p, m, r in rem:  # split again; the master goes back to its placeholder
            split_into_(p, m, r)
            p.data = placeholder(p)

    @staticmethod
    def _sync_from_mirrors(b: _Bucket) -> None:
        """The eager form of the fused kernel's mirror sync: edited mirror elements win."""
        for m, p in zip(b.mirrors, b.params):
            if m is not None:
                with_edits(p, m, out=p)

    # ----- the eager step, tile by tile -------------------------------------------------------------------
    def _tile_numel(self, device: torch.device) -> int:
        """Elements per eager tile: ``chunk_numel``, at most ``_CPU_TILE_NUMEL`` on a CPU (see the module docstring)."""
        return min(self.chunk_numel, _CPU_TILE_NUMEL) if device.type == "cpu" else self.chunk_numel

    def _layout(self, plan: _Plan, b: _Bucket, keys: tuple[str, ...]) -> _EagerLayout:
        """The bucket's tiles with their cached views and random-stream keys; rebuilt when the structure changes.

        Checked every step (host work only, no kernel): the seed, state keys, tile size, stream
        ids, global offsets, and the data pointer of every parameter, compensation buffer and
        state tensor (a ``load_state_dict``, a new state or ``p.data = ...`` changes one).
        """
        device = plan.device
        tile_numel = self._tile_numel(device)
        sig = (self.seed, keys, tile_numel, tuple(b.ids), tuple(b.offsets))
        ptrs = [t.data_ptr() for t in chain(b.params, b.comps, *(b.states[k] for k in keys))]
        layout = plan.eager
        if layout is not None and layout.sig == sig and layout.ptrs == ptrs:
            return layout
        plan.eager = None  # drop the old views before building the new ones
        tiles = [_Tile(segs, b.offsets, device) for segs in _tile_segments(b.params, tile_numel)]
        for tile in tiles:
            tile.bind(None, b.params)
            if b.comps:
                tile.bind(_COMP_KEY, b.comps)
            for k in keys:
                tile.bind(k, b.states[k])
        slots = self._random_slots(b, keys)
        ka0 = kb0 = None
        if slots:
            table = [[stream_key(self.seed, i * _STREAMS_PER_PARAM + slot) for i in b.ids] for slot in slots]
            ka0 = torch.tensor([[k[0] for k in row] for row in table], dtype=torch.int64).to(device, non_blocking=True)
            kb0 = torch.tensor([[k[1] for k in row] for row in table], dtype=torch.int64).to(device, non_blocking=True)
        layout = plan.eager = _EagerLayout(sig, ptrs, tiles, slots, ka0, kb0)
        return layout

    def _step_tile(
        self,
        group: dict[str, Any],
        b: _Bucket,
        layout: _EagerLayout,
        tile: _Tile,
        keys: tuple[str, ...],
        scalars: Mapping[str, Tensor],
        rkeys: Mapping[torch.dtype, tuple[Tensor, Tensor]],
        flat_grads: dict[int, Tensor],
        skip_masks: dict[torch.dtype, Tensor],
        acc: torch.dtype,
        ctx: _DeviceCtx,
    ) -> None:
        """Gather one tile into flat buffers, update it in ``acc``, commit (round, skip) and scatter it back.

        About 100-250 aten ops (by optimizer, compensation and state dtype; the bit casts among
        them are views, no kernel), none per tensor: ``torch.cat`` of
        the cached views gathers each buffer kind, ``torch._chunk_cat`` the gradients,
        ``index_select`` by a per-element segment index expands per-parameter scalars and keys,
        ``torch.split_with_sizes_copy`` into the cached views scatters. Only whole
        non-contiguous tensors (and 0-d gradients) get a per-tensor copy or view.
        """
        segs = tile.segs
        single = len(segs) == 1
        p0 = b.params[segs[0].param]
        device, pdt = p0.device, p0.dtype
        kahan = bool(b.comps)
        local: Tensor | None = None
        expand: Callable[[Tensor], Tensor]
        if single:
            i = segs[0].param

            def expand(v: Tensor) -> Tensor:
                return v[i]  # 0-d: broadcasts over the tile
        else:
            # Segment number of each element: ones at the segment starts, summed (no host sync, and
            # parallel on a GPU, unlike repeat_interleave's thread per segment).
            local = torch.zeros(tile.total, dtype=torch.int32, device=device).index_fill_(
                0, cast(Tensor, tile.local_starts), 1).cumsum_(0)
            pid = cast(Tensor, tile.pids).index_select(0, local)

            def expand(v: Tensor) -> Tensor:
                return v.index_select(0, pid)

        p_old = _gather(tile, None)
        grad = self._tile_grad(b, tile, flat_grads, acc)
        if ctx.scale is not None:
            grad = grad / ctx.scale
        w = p_old.to(acc)
        c_old = None
        if kahan:
            c_old = _gather(tile, _COMP_KEY)
            # Limited to half an ulp of the weight: a no-op after our own steps, and an edit of the weight
            # since (pruning, clipping through p.data) is not undone by its stale compensation.
            w = w + comp_of_weight(w, c_old, pdt)
        s_old = {k: _gather(tile, k) for k in keys}
        s_acc = {k: v.to(acc) for k, v in s_old.items()}
        w_new, s_new = self._update(group, w, grad, s_acc, scalars, expand)
        del grad, w, s_acc
        index: list[Tensor] = []

        def rand(slot: int) -> Tensor:
            """32 random bits per element of the tile for one buffer kind: ``counter_bits`` of (seed,
            the parameter's step count before this step, stream ``16 * position + slot``, global index)."""
            row = layout.slots.index(slot)
            big = tile.big_index
            ka, kb = rkeys[torch.int64 if big else torch.int32]
            idt = torch.int64 if big else torch.int32
            if not index:
                if single:
                    index.append(torch.arange(tile.first_index, tile.first_index + tile.total, dtype=idt,
                                              device=device))
                else:
                    index.append(torch.arange(tile.total, dtype=idt, device=device).add_(
                        cast(Tensor, tile.bases).index_select(0, cast(Tensor, local))))
            ka_e, kb_e = expand(ka[row]), expand(kb[row])
            return counter_bits(ka_e, kb_e, index[0]) if big else counter_bits32(ka_e, kb_e, index[0])

        new: dict[str | None, Tensor] = {}
        if pdt in HALF:
            if self.compensation == "stochastic":
                new[None] = stochastic_round(w_new, pdt, bits=rand(_SLOT_PARAM))
            else:
                new[None] = w_new.to(pdt)
            if kahan:
                # The remainder w - p is exact in FP32; stochastic rounding stores it unbiased. Round-to-
                # nearest would drop every update below half an ulp of the *buffer* (~2**-18 of the
                # weight once the buffer is large), and SGD with shrinking updates stalls (tested).
                new[_COMP_KEY] = stochastic_round(w_new - new[None], pdt, bits=rand(_SLOT_COMP))  # promoted: exact
        else:
            new[None] = w_new.to(pdt)
        del w_new
        sdt = self._state_dtype_for(p0)
        for k in keys:
            if sdt in HALF:
                # Round-to-nearest would freeze exp_avg_sq: with beta2 = 0.999 its per-step change is
                # 0.1 % of its value, below half a BF16 ulp (0.39 %). Stochastic rounding keeps it unbiased.
                new[k] = stochastic_round(s_new[k], sdt, bits=rand(self._state_slot(k)))
            else:
                new[k] = s_new[k].to(sdt)
        del s_new
        index.clear()
        olds: dict[str | None, Tensor | None] = {None: p_old, _COMP_KEY: c_old}
        olds.update(s_old)
        for kind, value in new.items():
            if ctx.skip is not None:
                old = cast(Tensor, olds[kind])
                if single and tile.views[kind][0] is not None:
                    # ``old`` is the tensor's own storage (a one-segment tile gathers no copy): select
                    # into it, with no copy back (a full pass per buffer saved).
                    _select_into(ctx.skip, old, value, skip_masks)
                    continue
                value = _unless_skipped(ctx.skip, old, value, skip_masks)
            _scatter(tile, kind, value)

    @staticmethod
    def _tile_grad(b: _Bucket, tile: _Tile, flat_grads: dict[int, Tensor], acc: torch.dtype) -> Tensor:
        """The tile's gradient elements as one flat ``acc`` tensor (one ``_chunk_cat`` for whole tensors)."""
        segs = tile.segs
        if len(segs) == 1:
            s = segs[0]
            g = b.grads[s.param]
            if s.start == 0 and s.stop == g.numel():
                return g.reshape(-1).to(acc)
            flat = flat_grads.get(s.param)
            if flat is None:
                flat = flat_grads[s.param] = g.reshape(-1)
            return flat[s.start:s.stop].to(acc)
        gs = [b.grads[s.param] for s in segs]
        if _chunk_cat is None:  # pragma: no cover - torch without _chunk_cat
            return torch.cat([g.reshape(-1) for g in gs]).to(acc)
        out = torch.empty((1, tile.total), dtype=acc, device=gs[0].device)
        # One kernel gathers and upcasts gradients of any shapes and strides (0-d ones need a 1-element view).
        _chunk_cat([g if g.dim() else g.reshape(1) for g in gs], 0, 1, out=out)
        return out[0]


_CPU_TILE_NUMEL = 1 << 17


@eager_only(
    "mixprec.optim's step runs eagerly behind one graph break (traced, Inductor rounds the Kahan remainder and "
    "the stochastic rounding away): call optimizer.step() outside torch.compile(fullgraph=True)"
)
def _step_outside_trace(opt: LowPrecisionOptimizer, closure: Callable[[], Any] | None,
                        grad_scale: Tensor | float | None, found_inf: Tensor | None) -> Any:
    """``opt.step`` reached from a traced frame: the eager step, bit for bit (see :meth:`LowPrecisionOptimizer.step`).

    The step hooks already ran in the traced wrapper around it (torch's ``profile_hook_step``),
    so this calls the unhooked step, not ``opt.step``.
    """
    return opt._step_unhooked(closure, grad_scale=grad_scale, found_inf=found_inf)


_SAME_SIZE_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
                  torch.float64: torch.int64}


def _unless_skipped(skip: Tensor, old: Tensor, value: Tensor, masks: dict[torch.dtype, Tensor]) -> Tensor:
    """``where(skip, old, value)`` for flat contiguous tensors of one dtype (``skip`` 0-d bool).

    On a CPU as ``old ^ ((value ^ old) & -(not skip))`` on the bit patterns: ATen's CPU ``where``
    is a scalar loop (~4x an add even with a 0-d condition), three bit kernels are faster;
    elsewhere ``where`` (one kernel). Bit for bit the same, NaN and -0.0 included.
    """
    if value.device.type != "cpu":
        return torch.where(skip, old, value)
    it, mask = _keep_mask(skip, value.dtype, masks)
    ob = old.view(it)
    if value.data_ptr() == old.data_ptr():  # an update that returned its input: nothing to select
        return value
    # In place: value is the step's own new buffer (a fresh tile-sized buffer costs page faults on a CPU).
    value.view(it).bitwise_xor_(ob).bitwise_and_(mask).bitwise_xor_(ob)
    return value


def _select_into(skip: Tensor, old: Tensor, value: Tensor, masks: dict[torch.dtype, Tensor]) -> None:
    """``old = where(skip, old, value)`` in place (``old`` flat and contiguous, ``value`` the step's own new buffer).

    On a CPU as ``old ^= (value ^ old) & -(not skip)`` on the bit patterns (see :func:`_unless_skipped`),
    elsewhere one ``where`` written into ``old``. Bit for bit :func:`_unless_skipped`'s result.
    """
    if value.data_ptr() == old.data_ptr():  # an update that returned its input: nothing to select
        return
    if value.device.type != "cpu":
        torch.where(skip, old, value, out=old)
        return
    it, mask = _keep_mask(skip, value.dtype, masks)
    ob = old.view(it)
    ob.bitwise_xor_(value.view(it).bitwise_xor_(ob).bitwise_and_(mask))


def _keep_mask(skip: Tensor, dtype: torch.dtype, masks: dict[torch.dtype, Tensor]) -> tuple[torch.dtype, Tensor]:
    """The integer dtype of ``dtype``'s width and its 0-d mask: all ones when the step is not skipped (cached per step)."""
    it = _SAME_SIZE_INT[dtype]
    mask = masks.get(it)
    if mask is None:
        mask = masks[it] = torch.logical_not(skip).to(it).neg_()
    return it, mask


def _tile_segments(params: list[Tensor], limit: int) -> list[list[_Segment]]:
    """Cut a bucket into tiles of at most ``limit`` elements.

    A contiguous tensor larger than ``limit`` is cut into near-equal slices, one tile each; the
    other tensors are packed whole, in order, into tiles of at most ``limit`` elements (a larger
    non-contiguous tensor gets a tile of its own). Empty tensors get no segment.
    """
    tiles: list[list[_Segment]] = []
    cur: list[_Segment] = []
    cur_n = 0
    for i, p in enumerate(params):
        n = p.numel()
        if n == 0:  # an empty shard: nothing to update (and a segment start must be an element)
            continue
        if n > limit and p.is_contiguous():
            pieces = -(-n // limit)
            size = -(-n // pieces)
            tiles.extend([_Segment(i, a, min(a + size, n))] for a in range(0, n, size))
            continue
        if cur and cur_n + n > limit:
            tiles.append(cur)
            cur, cur_n = [], 0
        cur.append(_Segment(i, 0, n))
        cur_n += n
    if cur:
        tiles.append(cur)
    return tiles


def _gather(tile: _Tile, kind: str | None) -> Tensor:
    """The tile's elements of one buffer kind as a flat tensor (the view itself for a one-segment tile)."""
    views = tile.views[kind]
    if len(views) == 1:
        v = views[0]
        return v if v is not None else tile.tensors[kind][0].reshape(-1)
    if tile.contiguous:
        return torch.cat(cast(list[Tensor], views))
    return torch.cat([v if v is not None else t.reshape(-1) for v, t in zip(views, tile.tensors[kind])])
