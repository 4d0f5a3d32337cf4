"""What every part of a :class:`~mixprec.optim.LowPrecisionOptimizer` stands on: its layout and its hooks.

The optimizer is written in parts, one concept a module (``_base.py`` says how a step runs):

* here: the buckets, segments and device context a step works on, the tensor helpers, and
  :class:`OptimizerParts`, the members every part uses (the subclass hooks of the algorithm, the
  state layout: state dtypes, compensation, random-stream slots, global offsets, step counting);
* ``_fused_step.py``: the fused (``torch.compile``d) step;
* ``_triton_step.py``: on CUDA, AdamW/Adam's fused step as one Triton kernel per bucket;
* ``_state_io.py``: state creation, ``state_dict``/``load_state_dict``, full-precision weights, memory;
* ``_base.py``: ``LowPrecisionOptimizer`` itself (construction, ``step`` and the eager, tiled step).
"""

from __future__ import annotations

import operator
import os
import sys
from collections.abc import Callable, Mapping
from itertools import accumulate, chain
from typing import Any, Literal, NamedTuple, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._dist import _PLAIN as _PLAIN_TYPES
from .._dist import dtensor_like
from .._dist import is_dtensor as _is_dtensor
from .._dist import local_tensor as _local
from .._dtypes import HALF

__all__ = ["DEFAULT_CHUNK_NUMEL", "Compensation", "OptimizerParts", "lr_on"]


Compensation = Literal["kahan", "stochastic", "none"]
_PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_STATE_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # version 1 held generator states (dropped on load: see load_state_dict)
#: Stream id of a buffer: ``16 * (parameter's position in the optimizer) + slot``.
_SLOT_PARAM, _SLOT_COMP, _SLOT_STATE0 = 0, 1, 2
_STREAMS_PER_PARAM = 16
#: Default chunk (the eager step's tile on a GPU; a CPU caps tiles at 2**17): 16 Mi elements keeps
#: the GPU busy (host work per tile is fixed) while bounding the step's temporaries (~0.7 GiB for
#: AdamW) however large the model or a single parameter is.
DEFAULT_CHUNK_NUMEL = 1 << 24
#: Group entries that are not compiled into a fused step (``lr`` is a tensor input).
_DYNAMIC_GROUP_KEYS = frozenset({"params", "lr", "param_names", "initial_lr"})
_COMP_KEY = "kahan_comp"
_STEP_KEY = "step"
_GRAD = operator.attrgetter("grad")
_SHAPE = operator.attrgetter("shape")
_DISPATCH_STACK_LEN = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)


def _compile_blocked() -> bool:
    """Whether nothing can be compiled now, outside a ``torch.compile`` trace (host only, no sync).

    * A ``TorchDispatchMode`` is active (``FlopCounterMode``, a memory tracker, a tracer's mode):
      dynamo compiles nothing under one; a ``fullgraph`` compile fails, and a frame it meets is
      skipped for good.
    * ``torch.compile`` is off in this process (``TORCH_COMPILE_DISABLE=1`` or
      ``torch._dynamo.config.disable = True``): torch runs compiled functions eagerly then.
    * A CUDA graph is being captured: a first compile there (Inductor's autotuning syncs) would
      invalidate the capture; the eager step is captured instead.

    The step then runs eagerly (bit for bit the fused step), and the fused step is not turned off:
    the next step that can compile does.
    """
    if torch.compiler.is_compiling():
        return False
    if _DISPATCH_STACK_LEN():
        return True
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return True
    cfg = sys.modules.get("torch._dynamo.config")  # (not imported until something compiles: then the variable decides)
    if cfg is not None:
        return bool(cfg.disable)
    return os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1"


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
    mirrors: list[Tensor | None]  # receives the committed value in its own dtype (see OptimizerParts.mirrors)
    rems: list[Tensor | None]  # int16 remainder of a remainder-stored master (see OptimizerParts.remainders)


class _DeviceCtx(NamedTuple):
    scale: Tensor | None  # grad_scale, on the device, the compute dtype applied at use
    skip: Tensor | None  # 0-d bool: found_inf != 0
    keep: Tensor | None  # 0-d float32: 1.0 - skip


class _Plan:
    """One (device, param dtype, grad dtype) bucket of a param group, kept across steps.

    ``params`` are the parameters (the cache key holds their ids); the rest is filled by the
    fused step: ``hp_key`` (the compiled-in hyper-parameters) for ``hp`` and ``fused``, its
    cached tiles (``_fused_step._FusedLayout``); and by the eager step: ``eager``, its cached
    tiles (:class:`_EagerLayout`).
    """

    __slots__ = ("device", "eager", "fused", "hp", "hp_key", "params", "triton")

    def __init__(self, device: torch.device, params: list[Tensor]) -> None:
        self.device = device
        self.params = params
        self.hp: dict[str, Any] | None = None
        self.hp_key = ""
        self.eager: _EagerLayout | None = None
        self.fused: Any = None
        self.triton: Any = None  # _triton_step.AdamWTables of a bucket stepped by the Triton kernel


class _Tile:
    """Elements of a bucket that the eager step updates together: whole tensors, or a slice of one.

    Built once per bucket structure (:class:`_EagerLayout`), so a step makes no per-tensor views.
    ``views[kind][j]`` is the 1-D view of segment ``j``'s elements in one buffer kind (``kind``
    ``None``: the parameters; ``"kahan_comp"``; a state key), or ``None`` for a whole
    non-contiguous tensor, which is gathered by a copy and written back whole
    (``tensors[kind][j]``). Segments are never empty (empty tensors get none).
    """

    __slots__ = ("bases", "big_index", "contiguous", "first_index", "local_starts", "pids", "segs", "sizes",
                 "tensors", "total", "views")

    def __init__(self, segs: list[_Segment], offsets: list[int], device: torch.device) -> None:
        self.segs = segs
        self.sizes = [s.stop - s.start for s in segs]
        self.total = sum(self.sizes)
        self.views: dict[str | None, list[Tensor | None]] = {}
        self.tensors: dict[str | None, list[Tensor]] = {}
        self.contiguous = True
        # Global flat index of each segment's first element (random bits are a function of it).
        firsts = [offsets[s.param] + s.start for s in segs]
        self.first_index = firsts[0]
        #: Whether some global index is >= 2**31: then the random bits are hashed in int64 lanes.
        self.big_index = max(f + n for f, n in zip(firsts, self.sizes)) > 1 << 31
        self.pids: Tensor | None = None  # multi-segment tiles: bucket position of each segment (int64)
        self.local_starts: Tensor | None = None  # tile-local start of segments 1.. (int64)
        self.bases: Tensor | None = None  # global index minus tile-local position, per segment
        if len(segs) > 1:
            starts = list(accumulate(self.sizes[:-1]))
            self.pids = torch.tensor([s.param for s in segs], dtype=torch.int64).to(device, non_blocking=True)
            self.local_starts = torch.tensor(starts, dtype=torch.int64).to(device, non_blocking=True)
            idt = torch.int64 if self.big_index else torch.int32
            self.bases = torch.tensor([f - c for f, c in zip(firsts, [0, *starts])], dtype=idt).to(
                device, non_blocking=True)

    def bind(self, kind: str | None, tensors: list[Tensor]) -> None:
        """Cache the views of this tile's segments into ``tensors`` (one per bucket parameter)."""
        ts = [tensors[s.param] for s in self.segs]
        views = [_flat_view(t, s) for t, s in zip(ts, self.segs)]
        self.views[kind] = views
        self.tensors[kind] = ts
        if any(v is None for v in views):
            self.contiguous = False


class _EagerLayout:
    """The eager step's cached structure of one bucket: tiles, their views, and the random-stream keys.

    Valid while ``sig`` (seed, state keys, tile size, random stream ids, global offsets) and
    ``ptrs`` (the data pointers of every parameter, compensation buffer and state, in order)
    match: a replaced state (``load_state_dict``) or a swapped ``p.data`` changes a pointer (the
    cached views keep the old storage alive, so no new tensor can reuse its address).
    """

    __slots__ = ("ka0", "kb0", "ptrs", "sig", "slots", "tiles")

    def __init__(self, sig: tuple[Any, ...], ptrs: list[int], tiles: list[_Tile], slots: tuple[int, ...],
                 ka0: Tensor | None, kb0: Tensor | None) -> None:
        self.sig = sig
        self.ptrs = ptrs
        self.tiles = tiles
        #: random stream slots drawn (``_SLOT_PARAM``, ``_SLOT_COMP``, state slots) and, per slot
        #: (rows) and bucket parameter (columns), the int64 stream keys (``stream_key``).
        self.slots = slots
        self.ka0 = ka0
        self.kb0 = kb0


def _same_values(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """``a == b`` for hyper-parameter dicts; ``False`` where a value cannot be compared (a tensor)."""
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False


class OptimizerParts(Optimizer):
    """The members the parts of ``LowPrecisionOptimizer`` share (see the module docstring).

    Attributes set by ``LowPrecisionOptimizer.__init__``, declared here so each part can use them.
    """

    _step_supports_amp_scaling = True
    #: Every per-element state key the algorithm may use (for importing checkpoints).
    _ALL_STATE_KEYS: tuple[str, ...] = ()

    compensation: Compensation
    state_dtype: torch.dtype
    chunk_numel: int
    seed: int
    fused: bool | None
    compile_seconds: float
    _fused_fns: dict[Any, Callable[..., None]]
    _fused_off: str | None
    _eager_warned: set[str]
    _key_cache: dict[Any, tuple[Tensor, ...]]
    _offsets: dict[int, int]
    _lr_tensors: dict[Any, Tensor]
    _plan_cache: dict[int, tuple[Any, list[_Plan]]]
    #: id(param) -> a tensor that receives the committed value in its own dtype: the model's half weight of
    #: an FP32 master (``MasterWeightOptimizer``'s fused step copies back in the same kernel; set by
    #: ``mixprec._fused.FusedShadow``).
    mirrors: dict[int, Tensor]
    #: Carry edits of a mirror into its parameter before the update (``weight_edits="values"`` of
    #: ``MasterWeightOptimizer``, in the fused kernel): ``p = where(mirror == round(p), p, mirror)``.
    sync_mirrors: bool
    #: id(param) -> the ``int16`` remainder of a remainder-stored FP32 master (``bf16-master-r16``): the
    #: parameter is a placeholder, its value ``join_edited(mirror, remainder)``, and the step writes
    #: ``split(new value)`` into mirror and remainder (set by ``mixprec._fused.FusedShadow``).
    remainders: dict[int, Tensor]
    _prefer_fused: bool

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
        """Per-parameter quantities of the update (bias corrections, ...), one value per parameter.

        ``steps_old``/``steps_new`` hold one FP32 step count per parameter of a bucket (on the
        device); each returned tensor has their shape, in ``dtype`` (the compute dtype), and must
        be elementwise in the step counts. Computed once per bucket and step, outside the
        per-element work (eager: expanded per tile; fused: outside the compiled graph, where
        Inductor would otherwise recompute them for every vector of elements).
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

        ``scalars`` is :meth:`_step_scalars`'s result; ``expand(v)`` turns such a per-parameter
        tensor into something broadcastable to ``w`` (the elements' values). Elementwise,
        single-rounding ops only (no ``lerp``/``addcmul``/``alpha=``), so the compiled step
        equals the eager one bit for bit; and no instance attributes (compiled steps are shared
        between instances). In-place ops are fine on the function's own temporaries, never on
        its inputs (some are views of the live tensors).
        """
        raise NotImplementedError

    # ----- layout ----------------------------------------------------------------------------------------
    def _streams(self) -> dict[int, int]:
        """``id(param) -> position`` over all groups: the parameter's part of its random stream ids."""
        return {id(p): i for i, p in enumerate(chain.from_iterable(g["params"] for g in self.param_groups))}

    def _bucket(self, group: Mapping[str, Any], params: list[Tensor], streams: Mapping[int, int] | None,
                sts: list[dict[str, Any]] | None = None) -> _Bucket:
        """The local tensors of a bucket (a ``DTensor``'s shard; the tensor itself otherwise).

        ``streams`` (``id(param) -> position``): the parameters' random stream ids; ``None`` when
        the step draws no random bits (``ids`` is then empty). ``sts``: the parameters' state
        dicts when the caller has them (looked up here otherwise).
        """
        # Once per step and bucket, O(parameters): C-level map()s, and no _local() where no tensor is a DTensor
        # (host time per parameter is what a GPU step of many small tensors is made of).
        if sts is None:
            sts = list(map(self.state.__getitem__, params))
        keys = self._state_keys(group)
        kahan = self._uses_kahan(params[0])
        if not _PLAIN_TYPES.issuperset(map(type, params)) and any(map(_is_dtensor, params)):
            locals_ = [_local(p) for p in params]
            grads = [_local(cast(Tensor, p.grad)) for p in params]
            comps = [_local(s[_COMP_KEY]) for s in sts] if kahan else []
            states = {k: [_local(s[k]) for s in sts] for k in keys}
        else:
            locals_, grads = params, list(map(_GRAD, params))
            comps = list(map(operator.itemgetter(_COMP_KEY), sts)) if kahan else []
            states = {k: list(map(operator.itemgetter(k), sts)) for k in keys}
        shapes = list(map(_SHAPE, locals_))
        for kind, held in (("kahan_comp", comps), *states.items()):
            if held and list(map(_SHAPE, held)) != shapes:
                _refuse_reshaped(params, kind, held)
        ids = list(map(id, params))
        return _Bucket(
            locals_, grads, comps, states,
            list(map(operator.itemgetter(_STEP_KEY), sts)),
            list(map(streams.__getitem__, ids)) if streams is not None else [],
            self._offsets_of(params, ids),
            list(map(self.mirrors.get, ids)),
            list(map(self.remainders.get, ids)),
        )

    def _offsets_of(self, params: list[Tensor], ids: list[int]) -> list[int]:
        """Each parameter's global flat offset: the cached ones by one C-level ``map``, else :meth:`_offset` per tensor."""
        offs = list(map(self._offsets.get, ids))
        return cast(list[int], offs) if None not in offs else list(map(self._offset, params))

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

    @staticmethod
    def _count_steps(b: _Bucket, ctx: _DeviceCtx) -> None:
        if ctx.keep is None:
            torch._foreach_add_(b.steps, 1.0)
        else:
            # The list-of-tensors overload stays on the device (the single-tensor one reads it on the host).
            torch._foreach_add_(b.steps, [ctx.keep] * len(b.steps))

    def _state_slot(self, key: str) -> int:
        return _SLOT_STATE0 + self._ALL_STATE_KEYS.index(key)

    def _random_slots(self, b: _Bucket, keys: tuple[str, ...]) -> tuple[int, ...]:
        """The random stream slots a bucket's step draws: stochastically rounded parameters, the Kahan
        buffer, half states (eager and fused step alike, so both draw the same bits).

        Raises:
            RuntimeError: the bucket draws random bits but has no stream ids (an internal error).
        """
        p0 = b.params[0]
        slots: list[int] = []
        if p0.dtype in HALF and self.compensation == "stochastic":
            slots.append(_SLOT_PARAM)
        if b.comps:
            slots.append(_SLOT_COMP)
        if self._state_dtype_for(p0) in HALF:
            slots.extend(self._state_slot(k) for k in keys)
        if slots and len(b.ids) != len(b.params):
            raise RuntimeError("internal: the bucket has no random stream ids but draws random bits")
        return tuple(slots)

    def _state_dtype_for(self, p: Tensor) -> torch.dtype:
        return torch.float64 if p.dtype == torch.float64 else self.state_dtype

    def _uses_kahan(self, p: Tensor) -> bool:
        return self.compensation == "kahan" and p.dtype in HALF


def _nbytes(t: Tensor) -> int:
    t = _local(t)  # a DTensor counts what this rank holds
    return t.numel() * t.element_size()


def _zeros_like(p: Tensor, dtype: torch.dtype) -> Tensor:
    """Zeros of ``p``'s shape in ``dtype``; for a ``DTensor`` a ``DTensor`` of the same spec (sharded like ``p``)."""
    local = _local(p)
    return dtensor_like(p, torch.zeros(local.shape, dtype=dtype, device=local.device))


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


#: ``torch._chunk_cat``: one kernel gathers tensors of any shapes and strides into one flat buffer
#: (the tiles' gradients, eager and fused step); ``None`` on a torch without it.
_chunk_cat: Callable[..., Tensor] | None = getattr(torch, "_chunk_cat", None)


_split_copy: Callable[..., Any] | None = getattr(torch, "split_with_sizes_copy", None)

#: Whether the one-op gather and scatter (``_chunk_cat``, ``split_with_sizes_copy``) are the cheap
#: route on a device type. On a CPU they are (``split`` + ``_foreach_copy_`` took ~1.5x the host
#: time). On CUDA both copy their table of pointers to the device through pinned memory on every
#: call: an H200 (torch 2.11, GPT-2's fused Kahan step, cProfile) spent 79 us of host time per
#: ``_chunk_cat`` and 65 us per ``split_with_sizes_copy`` against 28 us per ``torch.cat`` of a
#: similar list, whose pointers travel as kernel arguments, as ``_foreach_copy_``'s do. Elsewhere:
#: a fused packed tile's parameters and gradients move by ``_foreach_copy_`` through two shared
#: buffers (``_fused_step._Copies``), other gathers by ``cat`` of flat views and scatters by
#: ``split`` + ``_foreach_copy_``; the values are the same either way.
_ONE_OP_COPY_DEVICES = frozenset({"cpu"})


def _scatter(tile: _Tile, kind: str | None, value: Tensor) -> None:
    """Write a flat tile value back into its tensors (one ``split_with_sizes_copy`` on a CPU; ``split`` +
    ``_foreach_copy_`` elsewhere, see ``_ONE_OP_COPY_DEVICES``, and when a whole tensor is not contiguous)."""
    views = tile.views[kind]
    if len(views) == 1:
        v = views[0]
        if v is not None:
            v.copy_(value)
        else:
            t = tile.tensors[kind][0]
            t.copy_(value.view(t.shape))
        return
    if tile.contiguous and _split_copy is not None and value.device.type in _ONE_OP_COPY_DEVICES:
        _split_copy(value, tile.sizes, 0, out=cast(list[Tensor], views))  # one op, no list of pieces
        return
    pieces = value.split(tile.sizes)
    if tile.contiguous:  # no host-to-device table (CUDA), or a torch without split_with_sizes_copy
        torch._foreach_copy_(cast(list[Tensor], views), list(pieces))
        return
    ts = tile.tensors[kind]
    dsts = [v if v is not None else t for v, t in zip(views, ts)]
    srcs = [x if v is not None else x.view(t.shape) for x, v, t in zip(pieces, views, ts)]
    torch._foreach_copy_(dsts, srcs)


def lr_on(lr: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """A tensor learning rate on ``device`` in ``dtype``, without a device sync for a CPU one.

    ``lr.to(cuda)`` from (pageable) CPU memory is a blocking copy: a host sync per call, and
    illegal inside a CUDA graph capture. A CPU ``lr`` (torch's recipe for compiled optimizers
    is ``lr=torch.tensor(0.01)``) is read on the host instead (CPU memory: no device sync) and
    written by a fill kernel; the value rounds as ``.to(dtype)`` rounds it. Inside a trace (the
    compiled step) the plain conversion, which the graph records.
    """
    if lr.device.type == "cpu" and device.type != "cpu" and not torch.compiler.is_compiling():
        return torch.full(lr.shape, float(lr), dtype=dtype, device=device)
    return lr.to(device=device, dtype=dtype)


def _refuse_reshaped(params: list[Tensor], kind: str, held: list[Tensor]) -> None:
    """Raise: a parameter's shape differs from its ``kind`` state's (it changed shape after the state was made)."""
    i = next(i for i, (p, t) in enumerate(zip(params, held)) if _local(p).shape != t.shape)
    raise RuntimeError(
        f"a parameter of shape {tuple(_local(params[i]).shape)} has optimizer state {kind!r} of shape "
        f"{tuple(held[i].shape)}: the parameter changed shape after its state was created (resize_token_embeddings, "
        "a parameter's .data replaced by a tensor of another shape). Resize before prepare() and before the first "
        "step, or prepare the resized model with a fresh optimizer."
    )
