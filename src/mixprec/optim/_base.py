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

import time
import types
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping
from copy import deepcopy
from itertools import accumulate, chain
from typing import Any, Literal, NamedTuple, cast, get_args

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._dtypes import dtype_name, parse_dtype
from .._errors import check_fused, unknown_choice
from ._rounding import counter_bits, step_keys, stochastic_round, stream_key, with_edits

__all__ = ["Compensation", "LowPrecisionOptimizer"]

Compensation = Literal["kahan", "stochastic", "none"]
_HALF = (torch.bfloat16, torch.float16)
_PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_PLAIN = frozenset({Tensor, torch.nn.Parameter})  # tensor types that are never a DTensor
_STATE_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # version 1 held generator states (dropped on load: see load_state_dict)
#: Stream id of a buffer: ``16 * (parameter's position in the optimizer) + slot``.
_SLOT_PARAM, _SLOT_COMP, _SLOT_STATE0 = 0, 1, 2
_STREAMS_PER_PARAM = 16
#: Default chunk: 16 Mi elements keeps the GPU busy (host work per chunk is fixed) while bounding
#: the step's temporaries (~0.7 GiB for AdamW) however large the model or a single parameter is.
DEFAULT_CHUNK_NUMEL = 1 << 24
#: Group entries that are not compiled into a fused step (``lr`` is a tensor input).
_DYNAMIC_GROUP_KEYS = frozenset({"params", "lr", "param_names", "initial_lr"})
#: Compiled steps are shared by every optimizer in the process, keyed by bucket structure.
_FUSED_CACHE: dict[Any, Callable[..., None]] = {}
_FUSED_CACHE_SIZE = 64
#: Structures one optimizer may compile before it falls back to the eager step.
_MAX_COMPILES = 32
_COMP_KEY = "kahan_comp"
_STEP_KEY = "step"


class _Segment(NamedTuple):
    param: int  # position in the bucket's parameter list
    start: int  # element range of the flattened parameter
    stop: int


class _Bucket(NamedTuple):
    """One (device, dtype) bucket of a param group, as local tensors (a ``DTensor``'s shard)."""

    params: list[Tensor]
    grads: list[Tensor]
    comps: list[Tensor]  # Kahan compensation buffers; empty without Kahan
    states: dict[str, list[Tensor]]  # per-element states by key, parallel to params
    steps: list[Tensor]  # 0-d FP32 step counters
    ids: list[int]  # position of each parameter in the optimizer (its random streams)
    offsets: list[int]  # global flat position of each local tensor's first element
    mirrors: list[Tensor | None]  # receives the committed value in its own dtype (see _mirrors)


class _DeviceCtx(NamedTuple):
    scale: Tensor | None  # grad_scale, on the device, the compute dtype applied at use
    skip: Tensor | None  # 0-d bool: found_inf != 0
    keep: Tensor | None  # 0-d float32: 1.0 - skip


class _Plan:
    """One (device, param dtype, grad dtype) bucket of a param group, kept across steps.

    ``params`` are the parameters (the cache key holds their ids); the rest is filled by the
    fused step: ``struct`` (shapes, strides and dtypes that select the compiled function) for
    the mirrors ``struct_key``, and ``hp_key`` (the compiled-in hyper-parameters) for ``hp``.
    """

    __slots__ = ("device", "hp", "hp_key", "params", "struct", "struct_key")

    def __init__(self, device: torch.device, params: list[Tensor]) -> None:
        self.device = device
        self.params = params
        self.struct: tuple[Any, ...] | None = None
        self.struct_key: tuple[int, ...] = ()
        self.hp: dict[str, Any] | None = None
        self.hp_key = ""


def _same_values(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """``a == b`` for hyper-parameter dicts; ``False`` where a value cannot be compared (a tensor)."""
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False


class LowPrecisionOptimizer(Optimizer):
    """Base class of :class:`mixprec.optim.AdamW` and :class:`mixprec.optim.SGD` (see the module docstring).

    Subclasses define the state keys that hold one value per element (``_state_keys``) and the
    FP32 update on flat buffers (``_update``); this class does everything around it.
    """

    _step_supports_amp_scaling = True
    #: Every per-element state key the algorithm may use (for importing checkpoints).
    _ALL_STATE_KEYS: tuple[str, ...] = ()

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
        self._mirrors: dict[int, Tensor] = {}
        #: Carry edits of a mirror into its parameter before the update (``weight_edits="values"``
        #: of MasterWeightOptimizer, done in the fused kernel): ``p = where(mirror == round(p), p, mirror)``.
        self._sync_mirrors = False
        #: fused=None on a CPU: on when set (MixedPrecision sets it once the model ran compiled).
        self._prefer_fused = False
        super().__init__(params, defaults)

    # ----- hooks for subclasses ------------------------------------------------------------------
    def _state_keys(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        """State entries with one value per parameter element, stored in ``state_dtype``."""
        raise NotImplementedError

    def _validate_group(self, group: dict[str, Any]) -> None:
        """Check a param group's hyper-parameters; raise ``ValueError`` with the fix.

        Checks ``lr`` and ``weight_decay``, which every optimizer here has; subclasses call it
        first and check their own hyper-parameters after.
        """
        lr = group["lr"]
        if isinstance(lr, Tensor):
            if lr.numel() != 1:
                raise ValueError(f"lr as a tensor must have one element, got shape {tuple(lr.shape)}.")
        elif not lr >= 0.0:
            raise ValueError(f"invalid learning rate lr={lr!r}; use lr >= 0.")
        if not group["weight_decay"] >= 0.0:
            raise ValueError(f"invalid weight_decay={group['weight_decay']!r}; use weight_decay >= 0.")

    def _step_scalars(
        self, group: Mapping[str, Any], steps_old: Tensor, steps_new: Tensor, dtype: torch.dtype
    ) -> dict[str, Tensor]:
        """Per-parameter quantities of the update (bias corrections, ...), one value per segment.

        ``steps_old``/``steps_new`` hold one FP32 step count per segment (on the device); each
        returned tensor has their shape, in ``dtype`` (the compute dtype). Computed once per
        chunk (eager) or per bucket (fused, outside the compiled graph: Inductor would
        otherwise recompute them for every vector of elements).
        """
        return {}

    def _update(
        self,
        group: Mapping[str, Any],
        w: Tensor,
        grad: Tensor,
        states: dict[str, Tensor],
        scalars: Mapping[str, Tensor],
        expand: Callable[[Tensor], Tensor],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The update on flat compute-dtype buffers, all inputs read-only. Returns ``(w_new, states_new)``.

        ``scalars`` is :meth:`_step_scalars`'s result; ``expand(v)`` turns such a per-segment
        tensor into something broadcastable to ``w``. Elementwise, single-rounding ops only
        (no ``lerp``/``addcmul``/``alpha=``), so the compiled step equals the eager one bit for
        bit; and no instance attributes (compiled steps are shared between instances).
        """
        raise NotImplementedError

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
            _mirrors={},
            _sync_mirrors=False,
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

    def _streams(self) -> dict[int, int]:
        """``id(param) -> position`` over all groups: the parameter's part of its random stream ids."""
        return {id(p): i for i, p in enumerate(chain.from_iterable(g["params"] for g in self.param_groups))}

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

    def _bucket(self, group: Mapping[str, Any], params: list[Tensor], streams: Mapping[int, int] | None) -> _Bucket:
        """The local tensors of a bucket (a ``DTensor``'s shard; the tensor itself otherwise).

        ``streams`` (``id(param) -> position``): the parameters' random stream ids; ``None`` when
        the step draws no random bits (``ids`` is then empty).
        """
        state = self.state
        sts = [state[p] for p in params]
        keys = self._state_keys(group)
        return _Bucket(
            [_local(p) for p in params],
            [_local(cast(Tensor, p.grad)) for p in params],
            [_local(s[_COMP_KEY]) for s in sts] if self._uses_kahan(params[0]) else [],
            {k: [_local(s[k]) for s in sts] for k in keys},
            [s[_STEP_KEY] for s in sts],
            [streams[id(p)] for p in params] if streams is not None else [],
            [self._offset(p) for p in params],
            [self._mirrors.get(id(p)) for p in params],
        )

    def _offset(self, p: Tensor) -> int:
        """The global flat position of ``p``'s first local element (cached; see :meth:`_set_global_offsets`)."""
        off = self._offsets.get(id(p))
        if off is None:
            off = 0
            if _is_dtensor(p):
                from .._dist import global_flat_offset

                off = global_flat_offset(p)
            self._offsets[id(p)] = off
        return off

    def _step_bucket(self, group: dict[str, Any], b: _Bucket, ctx: _DeviceCtx) -> None:
        if self._sync_mirrors:
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

    # ----- the fused (compiled) step ------------------------------------------------------------------
    @property
    def prefer_fused(self) -> bool:
        """Set by ``MixedPrecision`` once the model runs compiled: ``fused=None`` then fuses on a CPU too."""
        return self._prefer_fused

    @prefer_fused.setter
    def prefer_fused(self, value: bool) -> None:
        self._prefer_fused = bool(value)

    def fused_enabled(self, device: torch.device | str) -> bool:
        """Whether steps on ``device`` run compiled (``torch.compile``, Inductor).

        ``fused=True``: always (a compile error raises). ``fused=False``: never. ``fused=None``
        (default): on CUDA and XPU when Triton is available; off on CPU and other devices. The
        rule and the measurements behind it are in ``docs/optim.md``: on a GPU the eager step is
        a chain of ~30 memory-bound kernels and the compiled one a few (the 124M-parameter eager
        Kahan step was 7.7x torch's fused AdamW); on a CPU the compiled step is faster too, but
        its first step costs ~10-30 s of C++ compilation per bucket structure, which dominates
        short runs and test suites, so it is opt-in there, except when the model runs compiled
        (``_prefer_fused``, set by ``MixedPrecision`` once it saw a compiled backward: the user
        already pays compile time, and the fused step is then the faster one). Also off (with a warning naming the
        cause) after a compile failure under ``fused=None``, and after more than
        ``_MAX_COMPILES`` structures (e.g. a scheduler changing ``betas`` every step).
        """
        if self._fused_off is not None:
            return False
        if self.fused is not None:
            return self.fused
        dev = torch.device(device)
        if self._prefer_fused and dev.type == "cpu":
            return True
        if dev.type not in ("cuda", "xpu"):
            return False
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # pragma: no cover - very old torch
            return False
        return bool(has_triton())

    def _step_bucket_fused(self, gi: int, group: dict[str, Any], plan: _Plan, keys: tuple[str, ...],
                           ctx: _DeviceCtx) -> bool:
        """Step one bucket with its compiled function (built on first use, shared process-wide).

        Returns ``False`` (the caller steps eagerly) when compiling failed under ``fused=None``
        or too many structures were compiled. The per-step host work is a few list
        comprehensions: the bucket's structure and hyper-parameter key are cached on ``plan``.
        """
        params = plan.params
        p0 = params[0]
        device = plan.device
        hp = {k: v for k, v in group.items() if k not in _DYNAMIC_GROUP_KEYS}
        if plan.hp is None or not _same_values(hp, plan.hp):
            plan.hp, plan.hp_key = hp, repr(sorted(hp.items(), key=lambda kv: kv[0]))
        lr = group["lr"]
        lr_t: Tensor
        if isinstance(lr, Tensor):
            lr_t = lr.detach().to(device=device, dtype=torch.float64).reshape(())
        else:
            lr_key = (gi, device)
            lr_cached = self._lr_tensors.get(lr_key)
            if lr_cached is None:
                lr_cached = self._lr_tensors[lr_key] = torch.zeros((), dtype=torch.float64, device=device)
            lr_t = lr_cached.fill_(float(lr))  # a kernel with a host scalar: no sync, no recompile when the LR changes
        # Random bits only where something is stochastically rounded (half parameters with Kahan or
        # stochastic compensation, half states): FP32 steps skip the key kernels.
        bits = (p0.dtype in _HALF and self.compensation != "none") or self._state_dtype_for(p0) in _HALF
        b = self._bucket(group, params, self._streams() if bits else None)
        mirror_ids = tuple(map(id, b.mirrors))
        if plan.struct is None or plan.struct_key != mirror_ids:
            # Shapes, strides and dtypes select the compiled function; dynamo's guards check them
            # on every call, so a later layout change (a swapped p.data) recompiles, never misreads.
            plan.struct_key = mirror_ids
            plan.struct = tuple(
                (tuple(p.shape), tuple(p.stride()), p.dtype, type(p), tuple(g.shape), tuple(g.stride()), g.dtype,
                 None if m is None else (m.dtype, tuple(m.stride())))
                for p, g, m in zip(b.params, b.grads, b.mirrors))
        spec: tuple[Any, ...] = (
            type(self), self.compensation, self.state_dtype, plan.struct, keys, plan.hp_key,
            ctx.scale is not None, ctx.skip is not None, device, self._sync_mirrors,
        )
        acc = torch.promote_types(p0.dtype, torch.float32)
        # Per-parameter scalars and random keys outside the graph (a few tiny kernels per bucket):
        # inside, Inductor would recompute them (pow, the key hash) for every vector of elements.
        steps_old = torch.stack(b.steps)
        steps_new = steps_old + (ctx.keep if ctx.keep is not None else 1.0)
        scalars = self._step_scalars(group, steps_old, steps_new, acc)
        scalar_keys = tuple(sorted(scalars))
        ka = kb = offsets = None
        if bits:
            rand_keys, offsets = self._fused_keys(b, keys, device)
            ka, kb = step_keys((rand_keys[..., 0], rand_keys[..., 1]), steps_old[:, None])
        spec = (*spec, scalar_keys)
        args = (b.params, b.grads, b.comps, [b.states[k] for k in keys], [scalars[k] for k in scalar_keys], lr_t,
                ctx.scale, ctx.skip, ka, kb, offsets, b.mirrors)
        fn = self._fused_fns.get(spec)
        if fn is not None:
            fn(*args)
            self._count_steps(b, ctx)
            return True
        fn = _FUSED_CACHE.get(spec)
        compiled_here = fn is None
        if fn is None:
            if len(self._fused_fns) >= _MAX_COMPILES:
                self._fused_off = (f"{_MAX_COMPILES} step structures compiled already (hyper-parameters other than lr "
                                   "are compiled in: is a scheduler changing them every step?)")
                warnings.warn(f"{type(self).__name__}: using the eager step from now on: {self._fused_off}. Pass "
                              "fused=False to silence this.", RuntimeWarning, stacklevel=4)
                return False
            fn = self._build_fused(hp, b, keys, scalar_keys, len(_FUSED_CACHE))
        t0 = time.perf_counter()
        try:
            fn(*args)
        except Exception as e:  # compile errors surface at the first call (backend, dynamo, C++ toolchain)
            if not compiled_here:
                raise
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if self.fused:
                raise RuntimeError(
                    f"{type(self).__name__}(fused=True): torch.compile of the fused step failed ({why}). Use "
                    "fused=False for the eager step, or fix the compiler setup (a C++ compiler on CPU, Triton on GPU)."
                ) from e
            self._fused_off = why
            warnings.warn(
                f"{type(self).__name__}: the fused (torch.compile) step failed to build, using the eager step from "
                f"now on ({why}). Pass fused=False to silence this.",
                RuntimeWarning,
                stacklevel=4,
            )
            return False
        if compiled_here:
            self.compile_seconds += time.perf_counter() - t0
            _FUSED_CACHE[spec] = fn
            while len(_FUSED_CACHE) > _FUSED_CACHE_SIZE:
                _FUSED_CACHE.pop(next(iter(_FUSED_CACHE)))
        self._fused_fns[spec] = fn
        self._count_steps(b, ctx)
        return True

    @staticmethod
    def _count_steps(b: _Bucket, ctx: _DeviceCtx) -> None:
        if ctx.keep is None:
            torch._foreach_add_(b.steps, 1.0)
        else:
            # The list-of-tensors overload stays on the device (the single-tensor one reads it on the host).
            torch._foreach_add_(b.steps, [ctx.keep] * len(b.steps))

    def _fused_keys(self, b: _Bucket, keys: tuple[str, ...], device: torch.device) -> tuple[Tensor, Tensor]:
        """The bucket's stream keys (int64 ``(n, 2 + len(keys), 2)``) and offsets (int64 ``(n,)``), cached."""
        slots = (_SLOT_PARAM, _SLOT_COMP, *(self._state_slot(k) for k in keys))
        cache_key = ("fused", device, tuple(b.ids), tuple(b.offsets), slots)
        cached = self._key_cache.get(cache_key)
        if cached is None:
            if len(self._key_cache) > 4096:
                self._key_cache.clear()
            table = [[list(stream_key(self.seed, i * _STREAMS_PER_PARAM + s)) for s in slots] for i in b.ids]
            kt = torch.tensor(table, dtype=torch.int64).to(device, non_blocking=True)
            ot = torch.tensor(b.offsets, dtype=torch.int64).to(device, non_blocking=True)
            cached = self._key_cache[cache_key] = (kt, ot)
        return cached[0], cached[1]

    def _build_fused(
        self, hp: dict[str, Any], b: _Bucket, keys: tuple[str, ...], scalar_keys: tuple[str, ...], n: int
    ) -> Callable[..., None]:
        """A ``torch.compile``d step for one bucket structure (static shapes, hyper-parameters but ``lr`` baked in).

        The per-parameter scalars (from the step counts), the LR, ``grad_scale``, ``found_inf``,
        the random keys (mixed with the step counts) and the global offsets are tensor inputs, so neither a new step, a scheduler's LR, another
        seed nor another optimizer with the same structure needs a new graph: compiled steps
        are cached process-wide by structure. Each structure gets its own code object so that
        dynamo's per-code cache (and its recompile limit) is per structure. The arithmetic is
        the eager step's (the subclass's ``_update``, called on an uninitialised instance:
        ``_update`` must not read instance attributes).
        """
        p0 = b.params[0]
        pdt = p0.dtype
        acc = torch.promote_types(pdt, torch.float32)
        half = pdt in _HALF
        kahan = bool(b.comps)
        stochastic = half and self.compensation == "stochastic"
        sync_mirrors = self._sync_mirrors
        sdt = self._state_dtype_for(p0)
        cls = type(self)
        update = cls.__new__(cls)._update
        scalar = _scalar_expand
        slot_of = {k: 2 + j for j, k in enumerate(keys)}  # column in the key table (0: param, 1: comp)

        def fused_step(
            ps: list[Tensor], gs: list[Tensor], comps: list[Tensor], states: list[list[Tensor]],
            scalars: list[Tensor], lr: Tensor, scale: Tensor | None, skip: Tensor | None,
            ka: Tensor | None, kb: Tensor | None, offsets: Tensor | None, mirrors: list[Tensor | None],
        ) -> None:
            group = dict(hp)
            group["lr"] = lr
            for i, p in enumerate(ps):
                g = gs[i].to(acc)
                if scale is not None:
                    g = g / scale
                w = p.to(acc)
                mirror = mirrors[i]
                p_old: Tensor = p
                if sync_mirrors and mirror is not None:
                    # An edit of the model's weight since the last step (p.data.clamp_, a pruning
                    # mask) wins over the master, elementwise, in this pass over the weights: the
                    # exact check of weight_edits="values" without three extra kernels per tensor.
                    w = with_edits(w, mirror)
                    p_old = w.to(p.dtype)  # what a skipped step keeps: the master with the edits
                if kahan:
                    w = w + comps[i].to(acc)
                s_old = {k: states[j][i] for j, k in enumerate(keys)}
                w_new, s_new = update(group, w, g, {k: v.to(acc) for k, v in s_old.items()},
                                      {k: scalars[j][i] for j, k in enumerate(scalar_keys)}, scalar)
                index = None
                if ka is not None:  # random bits drawn (stochastic rounding somewhere in this bucket)
                    index = (torch.arange(p.numel(), dtype=torch.int64, device=p.device)
                             + cast(Tensor, offsets)[i]).view(p.shape)

                def rand(col: int, i: int = i, index: Tensor | None = index) -> Tensor:
                    return counter_bits(cast(Tensor, ka)[i, col], cast(Tensor, kb)[i, col], cast(Tensor, index))

                new: list[tuple[Tensor, Tensor, Tensor]] = []  # (destination, new value, value if skipped)
                if half:
                    p_new = stochastic_round(w_new, pdt, bits=rand(0)) if stochastic else w_new.to(pdt)
                    new.append((p, p_new, p_old))
                    if kahan:
                        c = comps[i]
                        new.append((c, stochastic_round(w_new - p_new.to(acc), pdt, bits=rand(1)), c))
                else:
                    new.append((p, w_new.to(pdt), p_old))
                for k in keys:
                    v = s_new[k]
                    v = stochastic_round(v, sdt, bits=rand(slot_of[k])) if sdt in _HALF else v.to(sdt)
                    new.append((s_old[k], v, s_old[k]))
                for dst, value, old in new:
                    dst.copy_(torch.where(skip, old, value) if skip is not None else value)
                if mirror is not None:  # the copy back into the model's half weight, in the same kernel
                    mirror.copy_(p.to(mirror.dtype))

        code = fused_step.__code__.replace(co_name=f"_mixprec_fused_step_{n}")
        fn = types.FunctionType(code, fused_step.__globals__, code.co_name, fused_step.__defaults__,
                                fused_step.__closure__)
        # emulate_precision_casts: keep every rounding to the half dtype (Inductor elides a
        # half->FP32 round trip by default, which would make the Kahan remainder w - round(w) zero).
        # size_asserts off: dynamo's guards already check every input's sizes and strides; the
        # generated wrapper's second check cost ~0.2 ms per call for a 29-tensor bucket on a CPU.
        options: dict[str, str | int | bool | Callable[..., Any]] = {"emulate_precision_casts": True,
                                                                     "size_asserts": False}
        return cast(Callable[..., None], torch.compile(fn, dynamic=False, fullgraph=True, options=options))

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

    def _state_slot(self, key: str) -> int:
        return _SLOT_STATE0 + self._ALL_STATE_KEYS.index(key)

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

    # ----- state ---------------------------------------------------------------------------------------
    def _state_dtype_for(self, p: Tensor) -> torch.dtype:
        return torch.float64 if p.dtype == torch.float64 else self.state_dtype

    def _uses_kahan(self, p: Tensor) -> bool:
        return self.compensation == "kahan" and p.dtype in _HALF

    def _init_state(self, p: Tensor, group: Mapping[str, Any]) -> None:
        st = self.state[p]
        if _STEP_KEY not in st:
            st[_STEP_KEY] = torch.zeros((), dtype=torch.float32, device=p.device)
        for k in self._state_keys(group):
            if k not in st:
                st[k] = _zeros_like(p, self._state_dtype_for(p))
        if self._uses_kahan(p) and _COMP_KEY not in st:
            st[_COMP_KEY] = _zeros_like(p, p.dtype)

    def _import_state(self, p: Tensor, group: Mapping[str, Any], value: Mapping[str, Any], copy: bool) -> dict[str, Any]:
        """One parameter's state from a checkpoint or a torch optimizer, in this optimizer's dtypes."""
        keys = self._state_keys(group)
        out: dict[str, Any] = {}
        for k, v in value.items():
            if v is None:
                continue  # e.g. an unset momentum_buffer in old torch checkpoints
            if k == _STEP_KEY:
                t = torch.as_tensor(v).to(device=p.device, dtype=torch.float32).reshape(())
                out[k] = t.clone() if copy else t
            elif k == _COMP_KEY:
                if not self._uses_kahan(p):
                    continue  # resolved by the compensation check in load_state_dict
                out[k] = _as_state_tensor(v, p, p.dtype, copy, self._offset(p))
            elif k in keys or k in self._ALL_STATE_KEYS:
                out[k] = _as_state_tensor(v, p, self._state_dtype_for(p), copy, self._offset(p))
            else:
                out[k] = deepcopy(v) if copy else v
        if _STEP_KEY not in out and any(k in out for k in keys):
            out[_STEP_KEY] = torch.ones((), dtype=torch.float32, device=p.device)  # buffers exist: not the first step
        return out

    def state_dict(self) -> dict[str, Any]:
        """The ``torch.optim`` state dict plus a ``"mixprec"`` entry.

        Per-parameter ``state`` holds ``step`` (0-d FP32), the moments in ``state_dtype`` and,
        for ``compensation="kahan"`` on FP16/BF16 parameters, ``kahan_comp`` (parameter dtype).
        ``"mixprec"`` holds ``version`` (2), ``compensation``, ``state_dtype`` (name) and ``seed``.
        The random bits of stochastic rounding are a function of the seed, the step counters and
        the element positions, so these entries resume a run bit for bit, stochastic rounding
        included (version 1 also held per-device generator states). Tensors are the live state
        (as in torch); save or copy it.
        """
        sd = super().state_dict()
        sd["mixprec"] = {
            "version": _STATE_VERSION,
            "compensation": self.compensation,
            "state_dtype": dtype_name(self.state_dtype),
            "seed": self.seed,
        }
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` or from a ``torch.optim`` optimizer of the same algorithm.

        Tensors are copied into this optimizer's dtypes and devices (moments into
        ``state_dtype``, ``kahan_comp`` into the parameter dtype, ``step`` to a 0-d FP32 tensor on
        the parameter's device). A torch checkpoint has no compensation: the buffers start at zero.
        To move FP32 weights into this run without losing what the cast drops, use
        :meth:`load_full_precision_params_`.

        A version-1 state dict (mixprec before counter-based stochastic rounding) loads: its
        seed is kept and its generator states are dropped, so stochastic rounding continues with
        the counter-based bits of that seed (the steps after resuming round differently from
        what the old version would have done; everything else resumes exactly).

        Raises:
            ValueError: different group or parameter counts; a mixprec checkpoint whose
                ``compensation`` differs from this optimizer's (resuming would silently drop or
                invent compensation buffers); an unknown ``version``.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)  # type: ignore[arg-type]  # torch types it dict; any Mapping passes through, as in torch
            if result is not None:
                state_dict = result
        meta = state_dict.get("mixprec")
        if meta is not None:
            if meta.get("version") not in _READABLE_VERSIONS:
                raise ValueError(f"mixprec optimizer state version {meta.get('version')!r}; this mixprec reads "
                                 f"versions {_READABLE_VERSIONS} (upgrade mixprec?).")
            if meta.get("compensation") != self.compensation:
                raise ValueError(
                    f"the checkpoint was written with compensation={meta.get('compensation')!r}, this optimizer uses "
                    f"compensation={self.compensation!r}; build it with compensation={meta.get('compensation')!r} to "
                    "resume, or move only the weights (load_full_precision_params_)."
                )
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} parameter group(s), this optimizer {len(groups)}.")
        for i, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(f"parameter group {i} has {len(g['params'])} parameters here and "
                                 f"{len(sg['params'])} in the state dict.")
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                          chain.from_iterable(g["params"] for g in groups)))
        new_groups = []
        for g, sg in zip(groups, saved_groups):
            sg["params"] = g["params"]
            if "param_names" in g and "param_names" not in sg:
                sg["param_names"] = g["param_names"]
            new_groups.append(sg)
        for sg in new_groups:
            self._validate_group(sg)
        owner = {id(p): g for g in new_groups for p in g["params"]}
        state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        for k, v in state_dict["state"].items():
            if k in id_map:
                p = id_map[k]
                state[p] = self._import_state(p, owner[id(p)], v, copy=True)
            else:
                state[k] = v
        self.__setstate__({"state": state, "param_groups": new_groups})
        self._key_cache.clear()
        if meta is not None and int(meta.get("seed", self.seed)) != self.seed:
            self.seed = int(meta["seed"])
            self._key_cache.clear()
            self._fused_fns.clear()  # the seed's stream keys are constants of the compiled steps
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # ----- full-precision weights --------------------------------------------------------------------------
    @torch.no_grad()
    def load_full_precision_params_(self, values: Mapping[Tensor, Tensor]) -> None:
        """Set parameters from full-precision values, seeding the compensation with what the cast loses.

        For each ``param: value``, ``param`` becomes ``value`` rounded to nearest in the parameter
        dtype and, with ``compensation="kahan"`` on an FP16/BF16 parameter, its compensation
        buffer becomes ``round(value - param)``, so ``param + compensation`` equals the FP32
        weight to about 17 significant bits instead of 8 and nothing the cast dropped is lost
        for the updates that follow. With ``"stochastic"`` or ``"none"`` there is no buffer:
        only the nearest rounding is kept. Step counters and moments are left as they are
        (created, at zero, when missing).

        Args:
            values: Maps parameters of this optimizer (the tensor objects in ``param_groups``)
                to tensors of the same shape, any floating dtype and device (typically the FP32
                weights from before the model was cast).

        Raises:
            ValueError: a key that is not a parameter of this optimizer, or a shape mismatch.

        Example:
            >>> from mixprec.optim import AdamW
            >>> w32 = torch.randn(8)
            >>> p = torch.nn.Parameter(w32.to(torch.bfloat16))
            >>> opt = AdamW([p], compensation="kahan")
            >>> opt.load_full_precision_params_({p: w32})
            >>> bool((opt.full_precision_params()[p] - w32).abs().max() < 1e-4 * w32.abs().max())
            True
        """
        owner: dict[int, dict[str, Any]] = {id(p): g for g in self.param_groups for p in g["params"]}
        for p, v in values.items():
            group = owner.get(id(p))
            if group is None:
                raise ValueError(f"load_full_precision_params_: a tensor of shape {tuple(p.shape)} is not a parameter "
                                 "of this optimizer; key the mapping by the optimizer's own parameter tensors.")
            if tuple(v.shape) != tuple(p.shape):
                raise ValueError(f"load_full_precision_params_: value of shape {tuple(v.shape)} for a parameter of "
                                 f"shape {tuple(p.shape)}.")
        for p, v in values.items():
            group = owner[id(p)]
            self._init_state(p, group)
            lp = _local(p)
            lv = _local_value(v.detach(), p, self._offset(p)).to(lp.device)
            lp.copy_(lv)
            if self._uses_kahan(p):
                acc = torch.promote_types(lv.dtype, torch.float32)
                _local(self.state[p][_COMP_KEY]).copy_(lv.to(acc) - lp.to(acc))

    @torch.no_grad()
    def full_precision_params(self) -> dict[Tensor, Tensor]:
        """The weights as the optimizer sees them: ``param + compensation`` in FP32 (a new tensor each).

        For parameters without a compensation buffer this is ``param`` upcast to FP32 (FP64
        parameters stay FP64). Use it to export or evaluate the run's best estimate of the weights.

        Returns:
            ``{param: tensor}`` over every parameter of every group.
        """
        out: dict[Tensor, Tensor] = {}
        for g in self.param_groups:
            for p in g["params"]:
                acc = torch.promote_types(p.dtype, torch.float32)
                w = p.detach().to(acc)
                comp = self.state.get(p, {}).get(_COMP_KEY)
                out[p] = w + comp.to(acc) if comp is not None else w.clone()
        return out

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held per category over all parameters of all groups (persistent model state).

        Returns:
            ``numel`` (parameter elements this process holds: a ``DTensor``'s local shard), ``params``, ``grads`` (existing ``.grad`` tensors),
            ``compensation`` (``kahan_comp``), ``states`` (moments and other per-element
            buffers), ``scalars`` (0-d step counters) and ``total`` (all but ``numel``).
            ``(params + grads + compensation + states) / numel`` is the bytes-per-parameter
            figure: 14 for Kahan with FP32 states on BF16 AdamW, 10 with BF16 states, 8 for
            stochastic rounding with BF16 states, 16 for FP32 parameters with FP32 states.
        """
        out = dict.fromkeys(("numel", "params", "grads", "compensation", "states", "scalars"), 0)
        for g in self.param_groups:
            for p in g["params"]:
                out["numel"] += _local(p).numel()
                out["params"] += _nbytes(p)
                if p.grad is not None:
                    out["grads"] += _nbytes(p.grad)
                for k, v in self.state.get(p, {}).items():
                    if not isinstance(v, Tensor):
                        continue
                    if k == _COMP_KEY:
                        out["compensation"] += _nbytes(v)
                    elif v.dim() == 0:
                        out["scalars"] += _nbytes(v)
                    else:
                        out["states"] += _nbytes(v)
        out["total"] = sum(v for k, v in out.items() if k != "numel")
        return out


# ----- helpers ------------------------------------------------------------------------------------------------
def _nbytes(t: Tensor) -> int:
    t = _local(t)  # a DTensor counts what this rank holds
    return t.numel() * t.element_size()


def _is_dtensor(t: Tensor) -> bool:
    return callable(getattr(t, "to_local", None)) and hasattr(t, "placements")


def _local(t: Tensor) -> Tensor:
    """A ``DTensor``'s local shard (the tensor itself: in-place writes reach the DTensor), else ``t``."""
    if type(t) in _PLAIN or not _is_dtensor(t):  # the exact-type test first: the step calls this per tensor
        return t
    # _local_tensor, not to_local(): with grad mode on, to_local() returns a new autograd view each call.
    local = getattr(t, "_local_tensor", None)
    return cast(Tensor, local if isinstance(local, Tensor) else cast(Any, t).to_local())


def _zeros_like(p: Tensor, dtype: torch.dtype) -> Tensor:
    """Zeros of ``p``'s shape in ``dtype``; for a ``DTensor`` a ``DTensor`` of the same spec (sharded like ``p``)."""
    if not _is_dtensor(p):
        return torch.zeros(p.shape, dtype=dtype, device=p.device)
    from torch.distributed.tensor import DTensor

    d = cast(Any, p)
    local = torch.zeros(_local(p).shape, dtype=dtype, device=_local(p).device)
    return DTensor.from_local(local, d.device_mesh, d.placements, run_check=False, shape=p.shape, stride=p.stride())


def _local_value(v: Tensor, p: Tensor, offset: int) -> Tensor:
    """The part of ``v`` (a value for parameter ``p``) that ``p``'s local shard holds.

    ``v`` a ``DTensor``: its local shard. ``v`` a plain tensor of ``p``'s global shape while
    ``p`` is a ``DTensor``: the elements ``offset ..`` of its flattened form (dim-0 shards).
    """
    if _is_dtensor(v):
        return _local(v)
    lp = _local(p)
    if _is_dtensor(p) and tuple(v.shape) != tuple(lp.shape):
        return v.reshape(-1)[offset:offset + lp.numel()].view(lp.shape)
    return v


def _scalar_expand(v: Tensor) -> Tensor:
    return v.reshape(())


def _cat(views: list[Tensor]) -> Tensor:
    return views[0] if len(views) == 1 else torch.cat(views)


def _flat_view(t: Tensor, s: _Segment) -> Tensor | None:
    """The segment's elements of ``t`` as a 1-D view; ``None`` for a whole non-contiguous tensor."""
    if s.start == 0 and s.stop == t.numel():
        return t.view(-1) if t.is_contiguous() else None
    return t.view(-1)[s.start:s.stop]  # only contiguous tensors are cut into slices


def _as_state_tensor(v: Any, p: Tensor, dtype: torch.dtype, copy: bool, offset: int = 0) -> Tensor:
    t = v if isinstance(v, Tensor) else torch.as_tensor(v)
    if tuple(t.shape) != tuple(p.shape):
        raise ValueError(f"optimizer state of shape {tuple(t.shape)} for a parameter of shape {tuple(p.shape)}.")
    if _is_dtensor(p):  # a DTensor state sharded like its parameter (from DCP, or a full tensor sliced)
        lp = _local(p)
        local = _local_value(t, p, offset).to(device=lp.device, dtype=dtype).clone(
            memory_format=torch.contiguous_format)
        out = _zeros_like(p, dtype)
        _local(out).copy_(local)
        return out
    out = t.to(device=p.device, dtype=dtype, memory_format=torch.contiguous_format)
    if copy and out is t:
        out = out.clone(memory_format=torch.contiguous_format)
    return out


def _device_ctx(device: torch.device, grad_scale: Tensor | float | None, found_inf: Tensor | None) -> _DeviceCtx:
    scale = None
    if grad_scale is not None:
        scale = torch.as_tensor(grad_scale, dtype=torch.float32).to(device, non_blocking=True).reshape(())
    skip = keep = None
    if found_inf is not None:
        f = torch.as_tensor(found_inf).to(device, non_blocking=True).reshape(())
        skip = f != 0
        keep = (~skip).to(torch.float32)
    return _DeviceCtx(scale, skip, keep)
