"""The fused (``torch.compile``d) step of a :class:`~mixprec.optim.LowPrecisionOptimizer` (``fused=True``).

Algorithm (issue 27: compile a fixed number of graphs, not one per parameter shape):

1. Each (device, dtype) bucket is laid out once into *tiles* (``T`` elements,
   :meth:`FusedStep._fused_tile_numel`: 2**16 on a CPU, 2**23 elsewhere (2**21 in a bucket of at most
   2**22 elements), at most ``chunk_numel``):
   every full slice of ``_BIG * T``, then of ``T``, elements of a contiguous parameter is a
   *direct* tile (its 1-D views of the parameter, states, compensation buffer and mirror are the
   kernel's inputs, written in place);
   the rest (small tensors, the remainders of large ones, non-contiguous tensors) is packed into
   tiles of at most ``T`` elements and ``_SEGS`` segments (whole tensors first, never split),
   gathered each step by ``torch.cat`` (padded with zeros to ``T``; gradients by ``_chunk_cat``)
   and scattered back by ``torch.split_with_sizes_copy``, except: the states and compensation
   buffers of a tile of whole tensors live in the tile's own buffers
   (:meth:`FusedStep._home_states`); and off the CPU (``_parts._ONE_OP_COPY_DEVICES``) parameters
   and gradients move by ``_foreach_copy_`` through two ``(T,)`` buffers the bucket's packed tiles
   share (:class:`_Copies`), other kinds by ``cat`` and ``split`` + ``_foreach_copy_``.
2. One compiled function steps one tile. Its inputs have fixed shapes: the tile's buffers, a
   ``(T,)`` int32 segment index ``pid`` and per-segment tables of ``_SEGS`` entries (the
   per-parameter scalars, random keys, global index bases, mirror flags), read in the kernel as
   ``table[pid]`` (``table[0]`` in a direct tile: one segment). So the graphs (at most three:
   direct tiles of two sizes, packed tiles) depend on the dtypes, device, compensation, state
   dtype, the compiled-in hyper-parameters, mirrors yes/no and ``T`` only: a 6-block model
   compiles what a 2-block one does, and a param group added later compiles nothing new.
3. Per step and bucket, outside the graph: the step counters are stacked, spread to the
   (tile, segment) tables by one ``index_select``, and the scalars and random keys computed on
   those short vectors; then one call per tile.

The per-element arithmetic is the eager step's (``_update``, the same rounding), so the fused
step equals the eager one bit for bit. Buckets holding a non-contiguous parameter of more than
``T`` elements step eagerly.
"""

from __future__ import annotations

import time
import types
import warnings
from collections.abc import Callable
from itertools import accumulate, chain
from typing import Any, cast

import torch
from torch import Tensor

import mixprec.optim._parts as _parts  # _parts._ONE_OP_COPY_DEVICES: read where used, one setting for both modules

from .._dist import local_tensor as _local
from .._dtypes import HALF
from .._remainder import join_edited, split
from ._parts import (
    _COMP_KEY,
    _DYNAMIC_GROUP_KEYS,
    _SLOT_COMP,
    _SLOT_PARAM,
    _STREAMS_PER_PARAM,
    OptimizerParts,
    _Bucket,
    _chunk_cat,
    _DeviceCtx,
    _Plan,
    _same_values,
    _scatter,
    _Segment,
    _Tile,
)
from ._rounding import comp_of_weight, counter_bits, step_keys, stochastic_round, stream_key, with_edits
from ._triton_step import eligible as _triton_eligible
from ._triton_step import step_bucket as _triton_step_bucket

__all__ = ["FusedStep"]

#: Compiled steps are shared by every optimizer in the process, keyed by the tile step's configuration.
_FUSED_CACHE: dict[Any, Callable[..., None]] = {}
_FUSED_CACHE_SIZE = 64
#: Configurations one optimizer may compile before it falls back to the eager step.
_MAX_COMPILES = 32
#: Segments (parameter pieces) per packed tile: the length of the per-segment tables (a fixed
#: input shape). 128 bounds the tables to a few KiB while a 2**16-element tile of small tensors
#: (biases, norms: hundreds of elements each) still packs full.
_SEGS = 128
#: Tile elements of the compiled step: on a CPU small enough that the zero padding of the last
#: tile costs little on small models; elsewhere large, because each call costs host time (guards,
#: the wrapper, a packed tile's gather and scatter). Measured on an H200 (torch 2.11, GPT-2 124M's
#: 148 tensors, `benchmarks/gpu_suite.py`): the Kahan step took 28.7 ms at 2**19 (112 calls, 20
#: of them packed) and 21.4 ms at 2**21 (48 calls, 18 packed), against 2.3 ms for torch's fused
#: AdamW; after packed tiles held their states, 15.0 ms at 2**21 (51 calls) and 8.3 ms at 2**23
#: (13 calls): host-bound either way (docs/optim.md), fewer calls faster. A bucket of at most
#: ``_GPU_SMALL_BUCKET`` elements takes tiles of ``_GPU_SMALL_TILE`` (at most): a small model's one
#: packed tile is then not mostly padding (compute and the memory of its held states). Two tile
#: sizes, so two sets of graphs at most per configuration, whatever the models' sizes.
_CPU_FUSED_TILE = 1 << 16
_GPU_FUSED_TILE = 1 << 23
_GPU_SMALL_TILE = 1 << 21
_GPU_SMALL_BUCKET = 1 << 22
#: Direct tiles also come ``_BIG`` times larger (a third graph at most): a large tensor then
#: takes a quarter of the calls.
_BIG = 4
#: Whether tile calls after the first go straight to the compiled graph (:class:`_TileCall`); off:
#: every call through dynamo, as before (``benchmarks/step_overhead.py --tile-calls dynamo`` compares).
_DIRECT_CALLS = True
_MIRROR = "mirror"  # the buffer kind of the mirrors in a tile's cached views
_REM = "rem"  # the buffer kind of the int16 remainders (bf16-master-r16) in a tile's cached views


class _FusedLayout:
    """The fused step's cached structure of one bucket: tiles, their views and per-segment tables.

    Valid while ``sig`` (seed, state keys, tile size, stream ids, offsets, mirrors) and ``ptrs``
    (data pointers of every parameter, compensation buffer, state and mirror) match.
    ``tiles[t]`` is a :class:`~mixprec.optim._parts._Tile`; ``direct[t]`` is the numel of a
    direct tile (one full slice of ``T`` or ``_BIG * T`` elements, stepped in place), 0 for a packed one. Tables, one row per tile: ``seg_param`` (flat
    ``(tiles * _SEGS,)`` int64: the bucket position of each segment), ``bases`` (int64 global
    index of a segment's first element minus its tile-local start), ``flags`` (whether a
    segment has a mirror; when the optimizer has mirrors), ``ka0``/``kb0`` (int64
    ``(tiles, slots, _SEGS)`` stream keys), ``pids`` (int32 ``(T,)`` segment of each element of
    a packed tile; ``None`` for a direct one).
    """

    __slots__ = ("bases", "copies", "copy_bufs", "direct", "direct_args", "flags", "home_pad", "homes", "ka0", "kb0",
                 "key_rows", "keys_buf", "mirror_dtype", "pads", "pids", "ptrs", "rem_tiles", "seg_param", "sig", "slots",
                 "stage_bufs", "stage_origs", "table_keys", "table_rows", "tables_buf", "tile_numel", "tiles")

    def __init__(self, sig: tuple[Any, ...], ptrs: list[int], tile_numel: int) -> None:
        self.sig = sig
        self.ptrs = ptrs
        self.tile_numel = tile_numel
        self.tiles: list[_Tile] = []
        self.direct: list[int] = []
        self.pids: list[Tensor | None] = []
        self.seg_param: Tensor | None = None
        self.bases: Tensor | None = None
        self.flags: Tensor | None = None
        self.ka0: Tensor | None = None
        self.kb0: Tensor | None = None
        self.slots: tuple[int, ...] = ()
        self.mirror_dtype: torch.dtype | None = None
        #: dtype -> zeros of ``tile_numel`` elements: the padding of packed tiles (sliced, never written).
        self.pads: dict[torch.dtype, Tensor] = {}
        # Per-step tables written in place into buffers whose per-tile rows are cached views: a
        # tensor index per tile and table costs ~3 us of host time, as much as a small kernel.
        self.table_keys: tuple[str, ...] | None = None
        self.tables_buf: Tensor | None = None  # (scalar keys, tiles, _SEGS)
        self.table_rows: list[list[Tensor]] = []
        self.keys_buf: Tensor | None = None  # (2, tiles, slots, _SEGS) int64: ka, kb
        self.key_rows: list[tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]] = []
        #: (parameter, compensation, states, mirror, remainder) views of a direct tile, None for a packed one
        #: (the parameter is None in a remainder tile: its placeholder is neither read nor written).
        self.direct_args: list[tuple[Tensor | None, Tensor | None, list[Tensor], Tensor | None, Tensor | None] | None] = []
        #: Per tile: whether its segments are remainder-stored masters (``bf16-master-r16`` in the kernel).
        self.rem_tiles: list[bool] = []
        #: Non-contiguous tensors of parameters larger than a tile (``channels_last`` weights, their
        #: states) and their contiguous stand-ins, which the tiles slice: copied in before the tiles,
        #: back after (see :class:`_Stager`).
        self.stage_origs: list[Tensor] = []
        self.stage_bufs: list[Tensor] = []
        #: Per tile, the buffer kinds (compensation, states) whose tensors live in one ``(T,)`` buffer
        #: of the tile (:meth:`FusedStep._home_states`): stepped in place, neither gathered nor scattered.
        self.homes: list[dict[str | None, Tensor]] = []
        self.home_pad = 0  # bytes of those buffers that no tensor holds (the tile's padding)
        #: Off the CPU (``_parts._ONE_OP_COPY_DEVICES``): per tile, the cached copies that move a packed
        #: tile's parameters and gradients through the bucket's two ``(T,)`` buffers ``copy_bufs``
        #: (parameter, gradient), shared by its tiles in turn (:class:`_Copies`); None: gathered by ``cat``.
        self.copies: list[_Copies | None] = []
        self.copy_bufs: list[Tensor] = []


class _Copies:
    """How one packed tile's parameters and gradients reach the bucket's shared ``(T,)`` buffers, built once.

    On CUDA, a ``cat`` needs a 1-D view of every gradient each step and the ``split`` after it one
    of every parameter: an aten op each, host time that grows with the tile's tensors. Here the
    destination slices are cached views of the two buffers, shaped like the tensors, so a step
    copies with one ``_foreach_copy_`` per direction and zeroes the tile's padding with one
    ``_foreach_zero_`` (a previous, fuller tile of the bucket left values there): per tile a fixed
    number of ops (:meth:`gather` makes a view only for a segment that is part of a tensor).
    ``params``/``param_dst``: the tile's parameters (the tensors, or the 1-D slice of a partial
    segment) and their slices of the parameter buffer; ``grad_dst``: the gradient buffer's
    slices; ``whole[j]``: segment ``j`` is a whole tensor; ``pads``: the buffers' padding views.
    """

    __slots__ = ("grad_dst", "pads", "param_dst", "params", "segs", "whole")

    def __init__(self, tile: _Tile, pbuf: Tensor, gbuf: Tensor) -> None:
        self.segs = tile.segs
        self.whole = [s.start == 0 and s.stop == t.numel() for s, t in zip(tile.segs, tile.tensors[None])]
        self.params: list[Tensor] = []
        self.param_dst: list[Tensor] = []
        self.grad_dst: list[Tensor] = []
        a = 0
        for t, v, n, whole in zip(tile.tensors[None], tile.views[None], tile.sizes, self.whole):
            self.params.append(t if whole else cast(Tensor, v))
            self.param_dst.append(pbuf[a:a + n].view(t.shape) if whole else pbuf[a:a + n])
            self.grad_dst.append(gbuf[a:a + n].view(t.shape) if whole else gbuf[a:a + n])
            a += n
        self.pads = [pbuf[a:], gbuf[a:]] if a < pbuf.numel() else []

    def gather(self, grads: list[Tensor]) -> None:
        """Copy this step's gradients and the parameters into the shared buffers (zero padding after them)."""
        srcs = [grads[s.param] if w else grads[s.param].reshape(-1)[s.start:s.stop] for w, s in zip(self.whole, self.segs)]
        torch._foreach_copy_(self.grad_dst, srcs)
        torch._foreach_copy_(self.param_dst, self.params)
        if self.pads:
            torch._foreach_zero_(self.pads)

    def scatter(self) -> None:
        """Write the stepped parameters back from the parameter buffer."""
        torch._foreach_copy_(self.params, self.param_dst)


def _fused_segments(params: list[Tensor], mirrors: list[Tensor | None], tile: int, segs: int,
                    rems: list[Tensor | None] | None = None) -> tuple[list[list[_Segment]], list[int]] | str:
    """Cut a bucket into direct tiles (one full slice of ``_BIG * tile`` or ``tile`` elements) and packed tiles.

    A contiguous tensor (with a contiguous mirror, if any) gives as many direct tiles of
    ``_BIG * tile`` elements as fit, then of ``tile`` elements (fewer calls for large tensors:
    each call costs ~30 us of host time on a CPU). The rest is packed into tiles of at most
    ``tile`` elements and ``segs`` segments:

    * tensors that were not sliced, whole, never split, by first fit in decreasing size (a tile
      of whole tensors can hold their states itself: :meth:`FusedStep._home_states`);
    * then the remainders of sliced tensors, in order, contiguous pieces split across tile
      boundaries so that every such tile but the last is full.

    A string (the reason) when a non-contiguous tensor exceeds ``tile`` elements (it cannot be
    sliced without a copy: the bucket steps eagerly). Remainder-stored masters (``rems[i]`` not
    ``None``) come after the others and never share a tile with them: their parameter is a
    placeholder, and their mirror and remainder are what is sliced. The tiling changes no
    result: every element's arithmetic and random bits depend on its tensor and position only.
    """
    out: list[list[_Segment]] = []
    direct: list[int] = []
    rems = rems if rems is not None else [None] * len(params)
    whole: list[int] = []
    rest: list[tuple[int, int, bool]] = []  # (param, first element left, sliceable): remainders, in order
    later: list[tuple[int, int, bool]] = []  # the same for remainder-stored masters
    for i, (p, m, r) in enumerate(zip(params, mirrors, rems)):
        n = p.numel()
        if n == 0:
            continue
        if r is not None:
            sliceable = m is not None and m.is_contiguous() and r.is_contiguous()
        else:
            sliceable = p.is_contiguous() and (m is None or m.is_contiguous())
        start = 0
        if sliceable:
            for size in (_BIG * tile, tile):
                while n - start >= size:
                    out.append([_Segment(i, start, start + size)])
                    direct.append(size)
                    start += size
        elif n > tile:
            t = m if m is not None and (r is not None or p.is_contiguous()) else p  # the tensor that is not contiguous
            return (f"parameter {i} of the bucket is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}, "
                    f"e.g. channels_last) and has more than a tile's {tile} elements; contiguous weights keep it fused")
        if start == n:
            continue
        if r is not None:
            later.append((i, start, sliceable))
        elif start == 0:
            whole.append(i)
        else:
            rest.append((i, start, True))
    bins: list[list[_Segment]] = []
    fill: list[int] = []
    for i in sorted(whole, key=lambda i: -params[i].numel()):  # stable: equal sizes keep their order
        n = params[i].numel()
        for k, f in enumerate(fill):
            if f + n <= tile and len(bins[k]) < segs:
                bins[k].append(_Segment(i, 0, n))
                fill[k] += n
                break
        else:
            bins.append([_Segment(i, 0, n)])
            fill.append(n)
    out.extend(bins)
    direct.extend([0] * len(bins))
    for pieces in (rest, later):
        cur: list[_Segment] = []
        cur_n = 0
        for i, start, sliceable in pieces:
            n = params[i].numel()
            while start < n:
                if cur and (len(cur) == segs or cur_n == tile or (not sliceable and cur_n + n > tile)):
                    out.append(cur)
                    direct.append(0)
                    cur, cur_n = [], 0
                stop = min(n, start + tile - cur_n) if sliceable else n
                cur.append(_Segment(i, start, stop))
                cur_n += stop - start
                start = stop
        if cur:
            out.append(cur)
            direct.append(0)
    return out, direct


class FusedStep(OptimizerParts):
    """The fused step of ``LowPrecisionOptimizer``: one compiled tile step per configuration (module docstring)."""

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
        a chain of ~30 memory-bound kernels and the compiled one a few; on a CPU the compiled
        step is faster too, but its first step costs seconds of C++ compilation, which dominates
        short runs and test suites, so it is opt-in there, except when the model runs compiled
        (``_prefer_fused``, set by ``MixedPrecision`` once it saw a compiled backward: the user
        already pays compile time, and the fused step is then the faster one). Also off (with a
        warning naming the cause) after a compile failure under ``fused=None``, and after more
        than ``_MAX_COMPILES`` configurations (e.g. a scheduler changing ``betas`` every step).
        A step taken under a ``TorchDispatchMode`` (``FlopCounterMode``, a memory tracker) or while
        ``torch.compile`` is disabled (``TORCH_COMPILE_DISABLE=1``) runs eagerly whatever this says
        (``_parts._compile_blocked``): the eager step equals the fused one bit for bit, and the
        steps after it are fused again.
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

    def _fused_tile_numel(self, device: torch.device, bucket_numel: int) -> int:
        """Elements per compiled tile of a bucket of ``bucket_numel`` elements (see ``_CPU_FUSED_TILE``), at most
        ``chunk_numel``."""
        if device.type == "cpu":
            tile = _CPU_FUSED_TILE
        elif bucket_numel <= _GPU_SMALL_BUCKET:
            tile = min(_GPU_FUSED_TILE, _GPU_SMALL_TILE)
        else:
            tile = _GPU_FUSED_TILE
        return min(self.chunk_numel, tile)

    def _step_bucket_fused(self, gi: int, group: dict[str, Any], plan: _Plan, keys: tuple[str, ...],
                           ctx: _DeviceCtx, sts: list[dict[str, Any]] | None = None) -> bool:
        """Step one bucket tile by tile with the compiled tile step (built on first use, shared process-wide).

        Returns ``False`` (the caller steps eagerly) when compiling failed under ``fused=None``,
        too many configurations were compiled, the bucket cannot be tiled without copies
        (a large non-contiguous parameter, mirrors of two dtypes), or a hyper-parameter other than
        ``lr`` is a tensor (compiled in as a constant, it cannot be).
        """
        params = plan.params
        p0 = params[0]
        device = plan.device
        hp = {k: v for k, v in group.items() if k not in _DYNAMIC_GROUP_KEYS}
        if any(isinstance(x, Tensor) for v in hp.values() for x in (v if isinstance(v, (tuple, list)) else (v,))):
            return False  # a tensor hyper-parameter other than lr (betas from a scheduler): compiled in, it cannot be
        if plan.hp is None or not _same_values(hp, plan.hp):
            plan.hp, plan.hp_key = hp, repr(sorted(hp.items(), key=lambda kv: kv[0]))
        lr = group["lr"]
        lr_t: Tensor
        if isinstance(lr, Tensor):
            lr_t = _parts.lr_on(lr.detach(), device, torch.float64).reshape(1)
        else:
            lr_key = (gi, device)
            lr_cached = self._lr_tensors.get(lr_key)
            if lr_cached is None:
                lr_cached = self._lr_tensors[lr_key] = torch.zeros(1, dtype=torch.float64, device=device)
            lr_t = lr_cached.fill_(float(lr))  # a kernel with a host scalar: no sync, no recompile when the LR changes
        # Random bits only where something is stochastically rounded (half parameters with Kahan or
        # stochastic compensation, half states): FP32 steps skip the key kernels.
        bits = (p0.dtype in HALF and self.compensation != "none") or self._state_dtype_for(p0) in HALF
        b = self._bucket(group, params, self._streams() if bits else None, sts)
        # AdamW/Adam on a GPU (BF16 or FP32 parameters, not amsgrad): the whole bucket in one Triton kernel, no tiles.
        if _triton_eligible(self, group, plan, keys) and _triton_step_bucket(self, group, plan, b, ctx, lr_t):
            return True
        layout = self._fused_layout(plan, b, keys)
        if isinstance(layout, str):
            self._warn_eager_bucket(layout)
            return False
        if not layout.tiles:  # only empty tensors (empty shards): nothing to update, the steps still count
            self._count_steps(b, ctx)
            return True
        acc = torch.promote_types(p0.dtype, torch.float32)
        n_tiles = len(layout.tiles)
        # Per-(tile, segment) step counts, scalars and random keys: a few tiny kernels per bucket
        # (inside the graph Inductor would recompute them, pow and the key hash, per element).
        steps_old = torch.stack(b.steps).index_select(0, cast(Tensor, layout.seg_param))
        steps_new = steps_old + (ctx.keep if ctx.keep is not None else 1.0)
        scalars = self._step_scalars(group, steps_old, steps_new, acc)
        scalar_keys = tuple(sorted(scalars))
        if layout.table_keys != scalar_keys:
            layout.table_keys = scalar_keys
            buf = layout.tables_buf = torch.empty((len(scalar_keys), n_tiles, _SEGS), dtype=acc, device=device)
            layout.table_rows = [list(buf[:, t].unbind(0)) for t in range(n_tiles)]
        if scalar_keys:
            torch.stack([scalars[k].view(n_tiles, _SEGS) for k in scalar_keys], out=layout.tables_buf)
        if layout.slots:
            ka, kb = step_keys((cast(Tensor, layout.ka0), cast(Tensor, layout.kb0)),
                               steps_old.view(n_tiles, 1, _SEGS))
            torch.stack([ka, kb], out=layout.keys_buf)
        spec: tuple[Any, ...] = (
            type(self), self.compensation, self.state_dtype, p0.dtype, b.grads[0].dtype, layout.tile_numel, _SEGS,
            keys, plan.hp_key, ctx.scale is not None, ctx.skip is not None, device, self.sync_mirrors,
            layout.mirror_dtype, layout.slots, scalar_keys,
        )
        # Every tile kind's compiled step before any tile is stepped: a compile that fails (or the
        # compile limit) then sends the whole bucket to the eager step with nothing updated twice.
        # (direct size, remainder tile) -> the compiled tile step
        fns: dict[tuple[int, bool], Callable[..., None]] = {}
        flat_grads: dict[int, Tensor] = {}
        for t in range(n_tiles):
            variant = (layout.direct[t], layout.rem_tiles[t])
            if variant in fns:
                continue
            got = self._tile_fn((*spec, *variant), hp, p0.dtype, keys, scalar_keys, layout, bool(variant[0]))
            if got is None:
                return False
            tspec, fn, compiled_here = got
            if compiled_here:
                # Compiled on copies of what the kernel writes (its first call compiles): no state changes here.
                args = _scratch(self._tile_args(b, layout, t, layout.tiles[t], keys, lr_t, ctx, flat_grads))
                t0 = time.perf_counter()
                try:
                    fn(*args)
                except Exception as e:  # compile errors surface at the first call (backend, dynamo, C++ toolchain)
                    return self._compile_failed(e)
                self.compile_seconds += time.perf_counter() - t0
                _FUSED_CACHE[tspec] = fn
                while len(_FUSED_CACHE) > _FUSED_CACHE_SIZE:
                    _FUSED_CACHE.pop(next(iter(_FUSED_CACHE)))
                self._fused_fns[tspec] = fn
            fns[variant] = fn
        if layout.stage_bufs:  # logical order, as the eager step gathers them: the same random bits
            torch._foreach_copy_(layout.stage_bufs, layout.stage_origs)
        for t, tile in enumerate(layout.tiles):
            direct = layout.direct[t]
            args = self._tile_args(b, layout, t, tile, keys, lr_t, ctx, flat_grads)
            fns[(direct, layout.rem_tiles[t])](*args)
            if not direct:
                copies = layout.copies[t] if layout.copy_bufs and args[0] is layout.copy_bufs[0] else None
                self._scatter_tile(tile, args, keys, layout.mirror_dtype is not None, layout.homes[t], copies)
        if layout.stage_bufs:
            torch._foreach_copy_(layout.stage_origs, layout.stage_bufs)
        self._count_steps(b, ctx)
        return True

    def _tile_fn(self, spec: tuple[Any, ...], hp: dict[str, Any], pdt: torch.dtype, keys: tuple[str, ...],
                 scalar_keys: tuple[str, ...], layout: _FusedLayout,
                 direct: bool) -> tuple[Any, Callable[..., None], bool] | None:
        """``(spec, compiled tile step, whether it still compiles at its first call)``; ``None``: too many compiled."""
        fn = self._fused_fns.get(spec)
        if fn is not None:
            return spec, fn, False
        fn = _FUSED_CACHE.get(spec)
        if fn is not None:
            self._fused_fns[spec] = fn
            return spec, fn, False
        if len(self._fused_fns) >= _MAX_COMPILES:
            self._fused_off = (f"{_MAX_COMPILES} step configurations compiled already (hyper-parameters "
                               "other than lr are compiled in: is a scheduler changing them every step?)")
            warnings.warn(f"{type(self).__name__}: using the eager step from now on: {self._fused_off}. "
                          "Pass fused=False to silence this.", RuntimeWarning, stacklevel=5)
            return None
        return spec, self._build_fused(hp, pdt, keys, scalar_keys, layout, direct, len(_FUSED_CACHE)), True

    def _compile_failed(self, e: Exception) -> bool:
        """Raise under ``fused=True``; otherwise warn and turn the fused step off (returns ``False``)."""
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
            stacklevel=5,
        )
        return False

    @staticmethod
    def _tile_args(b: _Bucket, layout: _FusedLayout, t: int, tile: _Tile, keys: tuple[str, ...], lr: Tensor,
                   ctx: _DeviceCtx, flat_grads: dict[int, Tensor]) -> tuple[Any, ...]:
        """The compiled tile step's arguments for tile ``t``: views (direct) or padded gathers (packed)."""
        mirrored = layout.mirror_dtype is not None
        fixed = layout.direct_args[t]
        p: Tensor | None
        if fixed is not None:
            s = tile.segs[0]
            flat = flat_grads.get(s.param)
            if flat is None:  # once per parameter and step (a copy only for a non-contiguous gradient)
                flat = flat_grads[s.param] = b.grads[s.param].reshape(-1)
            grad = flat[s.start:s.stop]
            p, comp, states, mirror, rem = fixed
        else:
            pad = layout.tile_numel - tile.total
            in_rem = layout.rem_tiles[t]
            copies = layout.copies[t]
            if copies is not None and not torch.compiler.is_compiling():
                copies.gather(b.grads)
                p, grad = layout.copy_bufs
            else:
                grad = _gather_grads(b, tile, pad, layout)
                p = None if in_rem else _gather_padded(layout, tile, None, pad)
            homes = layout.homes[t]
            comp = None
            if b.comps:
                comp = homes[_COMP_KEY] if _COMP_KEY in homes else _gather_padded(layout, tile, _COMP_KEY, pad)
            states = [homes[k] if k in homes else _gather_padded(layout, tile, k, pad) for k in keys]
            mirror = _gather_padded(layout, tile, _MIRROR, pad) if mirrored else None
            rem = _gather_padded(layout, tile, _REM, pad) if in_rem else None
        ka, kb, bases, flags = layout.key_rows[t]
        return (p, grad, comp, states, mirror, rem, layout.pids[t], layout.table_rows[t], lr, ctx.scale, ctx.skip,
                ka, kb, bases, flags)

    @staticmethod
    def _scatter_tile(tile: _Tile, args: tuple[Any, ...], keys: tuple[str, ...], mirrored: bool,
                      homes: dict[str | None, Tensor], copies: _Copies | None = None) -> None:
        """Write a packed tile's stepped buffers back into its tensors (one ``split_with_sizes_copy`` each;
        nothing for the kinds that live in the tile's own buffers, ``homes``; the parameters by ``copies``
        when they were gathered into the shared buffer, which ``args[0]`` then is)."""
        n = tile.total
        if copies is not None:
            copies.scatter()
        elif args[0] is not None:  # (not in a remainder tile: its parameters are placeholders)
            _scatter(tile, None, args[0][:n])
        if args[2] is not None and _COMP_KEY not in homes:
            _scatter(tile, _COMP_KEY, args[2][:n])
        for k, v in zip(keys, args[3]):
            if k not in homes:
                _scatter(tile, k, v[:n])
        if mirrored:
            _scatter(tile, _MIRROR, args[4][:n])
        if args[5] is not None:
            _scatter(tile, _REM, args[5][:n])

    def _warn_eager_bucket(self, why: str) -> None:
        """Warn, once per optimizer and cause, that a bucket steps eagerly although the fused step is on."""
        if why in self._eager_warned:
            return
        self._eager_warned.add(why)
        warnings.warn(f"{type(self).__name__}: the fused step cannot tile a bucket ({why}); that bucket steps "
                      "eagerly (same result, slower). Pass fused=False to silence this.", RuntimeWarning,
                      stacklevel=5)

    def _fused_layout(self, plan: _Plan, b: _Bucket, keys: tuple[str, ...]) -> _FusedLayout | str:
        """The bucket's tiles, cached views and per-segment tables; rebuilt when the structure changes.

        Checked every step on the host: the seed, state keys, tile size, stream ids, global
        offsets, mirrors, and the data pointer of every parameter, compensation buffer, state
        and mirror. A string: why the bucket cannot be tiled (see :func:`_fused_segments`).
        """
        device = plan.device
        tile_numel = self._fused_tile_numel(device, sum(map(_NUMEL, b.params)))
        mirror_ids = (*map(id, b.mirrors), *map(id, b.rems))
        sig = (self.seed, keys, tile_numel, tuple(b.ids), tuple(b.offsets), mirror_ids, self.compensation)
        ptrs = _layout_ptrs(b, keys)
        layout = plan.fused
        if layout is not None and layout.sig == sig and layout.ptrs == ptrs:
            return layout
        plan.fused = None  # drop the old views before building the new ones
        # Mirrors yes/no is decided per optimizer, not per bucket: a bucket of an optimizer that has
        # mirrors (a master-weight step) without one of its own (a group added later, FP32 norms only)
        # compiles nothing new; its tiles write into scratch, masked by the flags.
        mirror_dtypes = {m.dtype for m in chain(b.mirrors, self.mirrors.values()) if m is not None}
        if len(mirror_dtypes) > 1:
            return f"mirrors of two dtypes: {sorted(map(str, mirror_dtypes))}"
        if any(r is not None and m is None for m, r in zip(b.mirrors, b.rems)):
            return "a remainder without its weight"  # (internal: FusedShadow always sets both)
        layout = _FusedLayout(sig, ptrs, tile_numel)
        # Remainder-stored masters' parameters are placeholders: never staged (their weight and remainder are).
        stage = _Stager(b.params, tile_numel, layout)
        params_in = stage.tensors(b.params, skip={i for i, r in enumerate(b.rems) if r is not None})
        mirrors_in = stage.optional(b.mirrors)
        rems_in = stage.optional(b.rems)
        comps_in = stage.tensors(b.comps) if b.comps else []
        states_in = {k: stage.tensors(b.states[k]) for k in keys}
        cut = _fused_segments(params_in, mirrors_in, tile_numel, _SEGS, rems_in)
        if isinstance(cut, str):
            return cut
        mdt = next(iter(mirror_dtypes)) if mirror_dtypes else None
        layout.mirror_dtype = mdt
        mirrors: list[Tensor] = []
        if mdt is not None:
            # A segment without a mirror writes its rounded value into scratch (flag 0 in the kernel).
            scratch = torch.empty(max(p.numel() for p in b.params), dtype=mdt, device=device)
            mirrors = [m if m is not None else scratch[:p.numel()].view(p.shape) for p, m in zip(b.params, mirrors_in)]
            layout.flags = torch.tensor(
                [[s < len(segs) and b.mirrors[segs[s].param] is not None for s in range(_SEGS)] for segs in cut[0]],
                dtype=torch.bool).to(device, non_blocking=True)
        seg_param: list[int] = []
        bases: list[list[int]] = []
        # Detached: a direct tile's views are compiled-step inputs, and a view of a parameter would
        # carry requires_grad=True where a packed tile's gathered buffer does not (a dynamo guard:
        # a second graph). In-place writes through them reach the parameters all the same.
        params = [p.detach() for p in params_in]
        mirrors = [m.detach() for m in mirrors]
        for segs, direct in zip(*cut):
            tile = _Tile(segs, b.offsets, device)
            in_rem = b.rems[segs[0].param] is not None
            layout.rem_tiles.append(in_rem)
            if in_rem:  # the parameters are placeholders: the kernel reads and writes weight and remainder
                tile.bind(_REM, cast(list[Tensor], rems_in))
            else:
                tile.bind(None, params)
            if b.comps:
                tile.bind(_COMP_KEY, comps_in)
            for k in keys:
                tile.bind(k, states_in[k])
            if mdt is not None:
                tile.bind(_MIRROR, mirrors)
            layout.tiles.append(tile)
            layout.direct.append(direct)
            if direct:
                layout.pids.append(None)  # one segment: the kernel reads table[0]
            else:  # padding elements get segment len(segs) (a table entry of its own, or the last one)
                counts = [*tile.sizes, tile_numel - tile.total]
                ids = torch.arange(len(counts), dtype=torch.int32).clamp_(max=_SEGS - 1)
                layout.pids.append(ids.repeat_interleave(torch.tensor(counts)).to(device, non_blocking=True))
            seg_param.extend([s.param for s in segs] + [0] * (_SEGS - len(segs)))
            starts = [0, *_cumsum(tile.sizes)[:-1]]
            bases.append([b.offsets[s.param] + s.start - c for s, c in zip(segs, starts)] + [0] * (_SEGS - len(segs)))
        layout.seg_param = torch.tensor(seg_param, dtype=torch.int64).to(device, non_blocking=True)
        slots = layout.slots = self._random_slots(b, keys)
        if slots:
            layout.bases = torch.tensor(bases, dtype=torch.int64).to(device, non_blocking=True)
            table = [[[stream_key(self.seed, b.ids[j] * _STREAMS_PER_PARAM + slot)
                       for j in seg_param[t * _SEGS:(t + 1) * _SEGS]] for slot in slots] for t in range(len(cut[0]))]
            layout.ka0 = torch.tensor([[[k[0] for k in row] for row in tt] for tt in table],
                                      dtype=torch.int64).to(device, non_blocking=True)
            layout.kb0 = torch.tensor([[[k[1] for k in row] for row in tt] for tt in table],
                                      dtype=torch.int64).to(device, non_blocking=True)
            layout.keys_buf = torch.empty((2, *layout.ka0.shape), dtype=torch.int64, device=device)
        n_tiles = len(layout.tiles)
        kbuf, fl, ba = layout.keys_buf, layout.flags, layout.bases
        layout.key_rows = [(None if kbuf is None else kbuf[0, t], None if kbuf is None else kbuf[1, t],
                            None if ba is None else ba[t], None if fl is None else fl[t]) for t in range(n_tiles)]
        layout.homes = [{} for _ in layout.tiles]
        layout.copies = [None] * len(layout.tiles)
        if not torch.compiler.is_compiling():  # (under an outer trace the tiles gather, as before)
            self._home_states(plan, b, layout, keys, comps_in, states_in)
            layout.ptrs = _layout_ptrs(b, keys)  # the homed states moved
            if device.type not in _parts._ONE_OP_COPY_DEVICES:
                _build_copies(layout, b)
        for tile, direct, in_rem in zip(layout.tiles, layout.direct, layout.rem_tiles):
            v = tile.views
            layout.direct_args.append(None if not direct else (
                None if in_rem else cast(Tensor, v[None][0]), cast(Tensor, v[_COMP_KEY][0]) if b.comps else None,
                [cast(Tensor, v[k][0]) for k in keys], cast(Tensor, v[_MIRROR][0]) if mdt is not None else None,
                cast(Tensor, v[_REM][0]) if in_rem else None))
        plan.fused = layout
        return layout

    def _home_states(self, plan: _Plan, b: _Bucket, layout: _FusedLayout, keys: tuple[str, ...],
                     comps_in: list[Tensor], states_in: dict[str, list[Tensor]]) -> None:
        """Move the compensation buffers and states of each packed tile of whole tensors into one buffer per kind.

        Algorithm: for a packed tile at least 3/4 full whose segments are all whole tensors, and a buffer kind whose
        tensors are this optimizer's own plain state tensors, allocate one ``(T,)`` buffer, copy the
        tensors into it one after the other and re-point each (``Tensor.set_``: the same tensor
        object, in ``self.state`` as before) at its slice. The compiled tile step then reads and
        writes that buffer in place: no ``cat`` before it, no ``split_with_sizes_copy`` after
        it, for that kind (host work per packed tile that grew with its segments: on a CPU 212-236
        us for 16 segments before, 109-131 us after, against 28-31 us for a direct tile;
        ``benchmarks/tile_host_cost.py``). Values, ``state_dict`` keys and the
        step's results are unchanged; the state tensors of small parameters then share storage
        (``torch.save`` writes each buffer once). Parameters and their gradients are the user's:
        they are still gathered. Redone whenever the layout is rebuilt (a ``load_state_dict``
        brings new tensors).
        """
        tile_numel = layout.tile_numel
        state = self.state
        kinds = ([(_COMP_KEY, comps_in)] if b.comps else []) + [(k, states_in[k]) for k in keys]
        for t, tile in enumerate(layout.tiles):
            # At least 3/4 full: the buffers' padding is memory for as long as the layout lives (a gathered
            # tile's is only for its step), so it stays under a third of the states the tile holds.
            if layout.direct[t] or layout.rem_tiles[t] or tile.total * 4 < tile_numel * 3:
                continue
            for kind, tensors in kinds:
                ts = tile.tensors[kind]
                if len({x.dtype for x in ts}) != 1 or not all(
                        s.start == 0 and s.stop == x.numel() and _homable(x, state.get(plan.params[s.param]), kind)
                        for s, x in zip(tile.segs, ts)):
                    continue
                buf = torch.zeros(tile_numel, dtype=ts[0].dtype, device=ts[0].device)
                a = 0
                with torch.no_grad():
                    for x in ts:
                        n = x.numel()
                        buf[a:a + n].copy_(x.reshape(-1))
                        x.set_(buf.untyped_storage(), a, x.shape, x.stride())  # x stays the same tensor object
                        a += n
                tile.bind(kind, tensors)  # views of the new storage
                layout.homes[t][kind] = buf
                layout.home_pad += (tile_numel - a) * buf.element_size()

    def _build_fused(self, hp: dict[str, Any], pdt: torch.dtype, keys: tuple[str, ...], scalar_keys: tuple[str, ...],
                     layout: _FusedLayout, direct: bool, n: int) -> Callable[..., None]:
        """A ``torch.compile``d step of one ``T``-element tile (static shapes, hyper-parameters but ``lr`` baked in).

        Inputs: the tile's parameter, gradient, compensation, states and mirror (``(T,)``,
        updated in place), its segment index ``pid`` (int32 ``(T,)``) and per-segment tables
        (``_SEGS`` entries: the scalars of :meth:`_step_scalars`, the random keys mixed with the
        step counts, the global index bases, mirror flags), the LR, ``grad_scale`` and
        ``found_inf``. Per-parameter values reach the elements as ``table[pid]``; in the
        variant for direct tiles (``direct``: one segment) as ``table[0]``, a scalar the kernel
        loads once instead of a gather per element (measured ~1.5x the kernel time on a CPU). Each
        configuration gets its own code object so that dynamo's per-code cache (and its
        recompile limit) is per configuration. The arithmetic is the eager step's (the
        subclass's ``_update``, called on an uninitialised instance: ``_update`` must not read
        instance attributes).
        """
        acc = torch.promote_types(pdt, torch.float32)
        half = pdt in HALF
        stochastic = half and self.compensation == "stochastic"
        sync_mirrors = self.sync_mirrors
        sdt = self._state_dtype_for(torch.empty(0, dtype=pdt))
        cls = type(self)
        update = cls.__new__(cls)._update
        slots = layout.slots
        state_slot = {k: self._state_slot(k) for k in keys}

        def fused_tile(
            p: Tensor | None, grad: Tensor, comp: Tensor | None, states: list[Tensor], mirror: Tensor | None,
            rem: Tensor | None, pid: Tensor | None, scalars: list[Tensor], lr: Tensor, scale: Tensor | None,
            skip: Tensor | None,
            ka: Tensor | None, kb: Tensor | None, bases: Tensor | None, flags: Tensor | None,
        ) -> None:
            group = dict(hp)
            # lr arrives with shape (1,): dynamo turns a 0-d float64 input into a Python float
            # (SymFloat), which Inductor fails to tensorify and restarts the whole trace from scratch
            # (about a fifth of the step's compile time); a view taken inside the graph is not an input.
            group["lr"] = lr.reshape(())
            index = None if direct else cast(Tensor, pid).long()

            def expand(v: Tensor) -> Tensor:
                return v[0] if index is None else v[index]

            g = grad.to(acc)
            if scale is not None:
                g = g / scale
            if rem is not None and mirror is not None:
                # Remainder-stored masters (bf16-master-r16): the parameter is a placeholder (not an input);
                # the FP32 value is the model's BF16 weight joined with its remainder, read in this pass.
                w = join_edited(mirror, rem)
            else:
                w = cast(Tensor, p).to(acc)
            p_old = p
            if sync_mirrors and mirror is not None and rem is None:
                # An edit of the model's weight since the last step (p.data.clamp_, a pruning mask)
                # wins over the master, elementwise: the exact check of weight_edits="values".
                edited = with_edits(w, mirror)
                w = torch.where(expand(cast(Tensor, flags)), edited, w)  # segments with a mirror only
                p_old = w.to(pdt)  # what a skipped step keeps: the master with the edits
            if comp is not None:
                w = w + comp_of_weight(w, comp, pdt)  # (see the eager step)
            s_old = dict(zip(keys, states))
            w_new, s_new = update(group, w, g, {k: v.to(acc) for k, v in s_old.items()},
                                  dict(zip(scalar_keys, scalars)), expand)
            gidx = None
            if ka is not None:  # global element index: the random bits are a function of it
                gidx = torch.arange(g.numel(), dtype=torch.int64, device=g.device) + expand(cast(Tensor, bases))

            def rand(slot: int) -> Tensor:
                row = slots.index(slot)
                return counter_bits(expand(cast(Tensor, ka)[row]), expand(cast(Tensor, kb)[row]), cast(Tensor, gidx))

            new: list[tuple[Tensor, Tensor, Tensor]] = []  # (destination, new value, value if skipped)
            if rem is not None and mirror is not None:
                hi, lo = split(w_new.to(torch.float32))  # weight and remainder; the placeholder is not written
                new.append((mirror, hi, mirror))
                new.append((rem, lo, rem))
            elif half:
                p_new = stochastic_round(w_new, pdt, bits=rand(_SLOT_PARAM)) if stochastic else w_new.to(pdt)
                new.append((cast(Tensor, p), p_new, cast(Tensor, p_old)))
                if comp is not None:
                    new.append((comp, stochastic_round(w_new - p_new.to(acc), pdt, bits=rand(_SLOT_COMP)), comp))
            else:
                new.append((cast(Tensor, p), w_new.to(pdt), cast(Tensor, p_old)))
            for k in keys:
                v = s_new[k]
                v = stochastic_round(v, sdt, bits=rand(state_slot[k])) if sdt in HALF else v.to(sdt)
                new.append((s_old[k], v, s_old[k]))
            for dst, value, old in new:
                dst.copy_(torch.where(skip, old, value) if skip is not None else value)
            if mirror is not None and rem is None:  # the copy back into the model's half weight, in the same kernel
                mirror.copy_(cast(Tensor, p).to(mirror.dtype))

        code = fused_tile.__code__.replace(co_name=f"_mixprec_fused_tile_{n}")
        fn = types.FunctionType(code, fused_tile.__globals__, code.co_name, fused_tile.__defaults__,
                                fused_tile.__closure__)
        # emulate_precision_casts: keep every rounding to the half dtype (Inductor elides a
        # half->FP32 round trip by default, which would make the Kahan remainder w - round(w) zero).
        # size_asserts off: the layout fixes every input's size and stride per configuration (dynamo's
        # guards check them at the first call; later calls skip dynamo, see _TileCall).
        # assert_indirect_indexing off: ``pid`` is built by the layout, always inside the tables; the
        # check is a vector compare per 16 elements on a CPU.
        options: dict[str, str | int | bool | Callable[..., Any]] = {"emulate_precision_casts": True,
                                                                     "size_asserts": False,
                                                                     "assert_indirect_indexing": False,
                                                                     **_eager_division_options()}
        return _TileCall(fn, options)


class _TileCall:
    """A compiled tile step that, once compiled, calls Inductor's graph directly, without dynamo's entry.

    A call through ``torch.compile``'s wrapper costs host time on every tile: dynamo's frame
    entry, its guards over the ~20 inputs, three wrappers and a config patch (about 35 of the 50 us
    per call measured on a CPU; on an H200 tile calls cost 0.2-0.4 ms each). The tile step's inputs
    are fixed by construction: every call of one configuration passes tensors of the same shapes,
    strides, dtypes and devices (direct slices of ``T`` or ``_BIG * T`` elements, padded gathers,
    table rows), which is what the guards check. So the first call goes through dynamo (with
    Inductor as the backend, these options), and the backend records which argument each graph
    input is (by identity with the call's arguments); later calls pass those tensors straight to
    the compiled graph (Inductor's and AOTAutograd's wrappers still run: input mutations, alignment).

    The dynamo path stays for: calls before the graph is known, calls with grad mode on or inside
    an outer ``torch.compile`` trace, and every call once a second graph was compiled for this
    code (a guard failed: the graph to use is then dynamo's choice) or when an input could not be
    matched to exactly one argument. The first direct call is checked: a ``TypeError`` or
    ``IndexError`` from it (the compiled graph takes its inputs another way in this torch; raised
    while unpacking them, before any kernel) turns the direct calls off and the call goes through
    dynamo instead.
    """

    __slots__ = ("_args", "_graphs", "_verified", "dynamo_fn", "graph_fn", "options", "picks")

    def __init__(self, fn: Callable[..., None], options: dict[str, Any]) -> None:
        self.options = options
        self._args: tuple[Any, ...] | None = None
        self._graphs = 0
        self._verified = False
        self.graph_fn: Callable[..., Any] | None = None
        #: Per graph input: (argument position, index in a list argument or -1 for a tensor argument).
        self.picks: list[tuple[int, int]] | None = None
        self.dynamo_fn = torch.compile(fn, dynamic=False, fullgraph=True, backend=self._backend)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        compiled = cast(Callable[..., Any], compile_fx(gm, example_inputs, config_patches=self.options))
        self._graphs += 1
        picks = _input_picks(self._args, example_inputs) if self._graphs == 1 and self._args is not None else None
        self.graph_fn, self.picks = (compiled, picks) if picks is not None else (None, None)
        return compiled

    def __call__(self, *args: Any) -> None:
        picks = self.picks
        if picks is not None and _DIRECT_CALLS and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            inputs = [args[i] if j < 0 else args[i][j] for i, j in picks]
            if self._verified:
                cast(Callable[..., Any], self.graph_fn)(*inputs)
                return
            try:
                cast(Callable[..., Any], self.graph_fn)(*inputs)
            except (TypeError, IndexError):
                self.picks = self.graph_fn = None  # not this torch's calling convention: dynamo from now on
            else:
                self._verified = True
                return
        self._args = args
        try:
            self.dynamo_fn(*args)
        finally:
            self._args = None


def _input_picks(args: tuple[Any, ...], inputs: list[Tensor]) -> list[tuple[int, int]] | None:
    """Where each graph input is among ``args`` (tensors, or lists of tensors), by identity; ``None`` if not exactly once."""
    flat = [(i, -1, a) for i, a in enumerate(args) if isinstance(a, Tensor)]
    flat += [(i, j, t) for i, a in enumerate(args) if isinstance(a, (list, tuple))
             for j, t in enumerate(a) if isinstance(t, Tensor)]
    picks: list[tuple[int, int]] = []
    for x in inputs:
        found = [(i, j) for i, j, t in flat if t is x]
        if len(found) != 1:
            return None
        picks.append(found[0])
    return picks


def _scratch(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A tile step's arguments with copies of the buffers it writes (parameter, compensation, states, mirror,
    remainder: positions 0, 2, 3, 4, 5), for the call that compiles it; the rest is only read."""
    def copy(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.clone()

    return (copy(args[0]), args[1], copy(args[2]), [t.clone() for t in args[3]], copy(args[4]), copy(args[5]),
            *args[6:])


class _Stager:
    """Contiguous stand-ins for the non-contiguous tensors of a bucket's parameters larger than a tile.

    Such a tensor (a ``channels_last`` conv weight, its states, its half weight) cannot be sliced
    into tiles without a copy. Its stand-in is a contiguous buffer of the same shape, allocated
    once with the layout (memory: one more copy of those tensors only); the step copies every
    original into its stand-in before the tiles (one ``_foreach_copy_``) and back after, so the
    tiles see the elements in logical order, as the eager step's ``reshape`` does (the same
    global positions, hence the same random bits). Smaller non-contiguous tensors are gathered
    whole into packed tiles, as before.
    """

    def __init__(self, params: list[Tensor], tile: int, layout: _FusedLayout) -> None:
        self.big = [p.numel() > tile for p in params]
        self.layout = layout

    def one(self, i: int, t: Tensor) -> Tensor:
        if not self.big[i] or t.is_contiguous():
            return t
        t = _local(t)  # (a DTensor mirror: this rank's shard is what the tiles step)
        buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        self.layout.stage_origs.append(t.detach())
        self.layout.stage_bufs.append(buf)
        return buf

    def tensors(self, ts: list[Tensor], skip: frozenset[int] | set[int] = frozenset()) -> list[Tensor]:
        return [t if i in skip else self.one(i, t) for i, t in enumerate(ts)]

    def optional(self, ts: list[Tensor | None]) -> list[Tensor | None]:
        return [None if t is None else self.one(i, t) for i, t in enumerate(ts)]


def _eager_division_options() -> dict[str, bool]:
    """Inductor options, by the installed torch's names, that make Triton divide and keep subnormals as eager does.

    Triton lowers ``x / y`` to an approximate division (``div.full``, ~2 ulp) and may flush FP32
    subnormals (tiny Kahan remainders) to zero; eager CUDA kernels do neither, so without these
    the compiled step on a GPU would not equal the eager one bit for bit. ``emulate_precision_casts``
    already turns off Triton's FMA contraction. CPU (C++) kernels are unaffected. Names:
    ``eager_numerics.division_rounding``/``eager_numerics.disable_ftz`` (torch >= 2.12),
    ``emulate_divison_rounding`` (sic; torch 2.5-2.11); an option this torch lacks is left out.
    """
    from torch._inductor import config

    numerics = getattr(config, "eager_numerics", None)
    out: dict[str, bool] = {}
    if numerics is not None and hasattr(numerics, "division_rounding"):
        out["eager_numerics.division_rounding"] = True
    elif hasattr(config, "emulate_divison_rounding"):
        out["emulate_divison_rounding"] = True
    if numerics is not None and hasattr(numerics, "disable_ftz"):
        out["eager_numerics.disable_ftz"] = True
    return out


def _layout_ptrs(b: _Bucket, keys: tuple[str, ...]) -> list[int]:
    """The data pointers a fused layout is valid for: every parameter, compensation buffer, state, mirror and remainder."""
    return list(map(_DATA_PTR, chain(b.params, b.comps, *(b.states[k] for k in keys),
                                     (m for m in b.mirrors if m is not None), (r for r in b.rems if r is not None))))


_DATA_PTR = Tensor.data_ptr
_NUMEL = Tensor.numel


def _build_copies(layout: _FusedLayout, b: _Bucket) -> None:
    """Give each packed tile of parameters (not a remainder tile) its :class:`_Copies` through two shared buffers."""
    packed = [t for t, (d, r) in enumerate(zip(layout.direct, layout.rem_tiles)) if not d and not r]
    if not packed:
        return
    p0, g0 = layout.tiles[packed[0]].tensors[None][0], b.grads[0]
    pbuf = torch.zeros(layout.tile_numel, dtype=p0.dtype, device=p0.device)
    gbuf = torch.zeros(layout.tile_numel, dtype=g0.dtype, device=g0.device)
    layout.copy_bufs = [pbuf, gbuf]
    for t in packed:
        tile = layout.tiles[t]
        # (a part of a tensor is always of a contiguous one, whose 1-D view exists: checked, not assumed)
        if all(v is not None or (s.start == 0 and s.stop == x.numel())
               for v, s, x in zip(tile.views[None], tile.segs, tile.tensors[None])):
            layout.copies[t] = _Copies(tile, pbuf, gbuf)


def _homable(x: Tensor, st: Any, kind: str | None) -> bool:
    """Whether ``x`` may move into a tile's buffer: the optimizer's own plain, contiguous state tensor (not a view, a
    ``DTensor``'s shard or a staged stand-in)."""
    return (st is not None and st.get(kind) is x and type(x) is Tensor and x._base is None and x.is_contiguous()
            and not x.requires_grad)


def _gather_padded(layout: _FusedLayout, tile: _Tile, kind: str | None, pad: int) -> Tensor:
    """A packed tile's elements of one buffer kind, zero-padded to the tile size (one ``cat``, a copy)."""
    views = tile.views[kind]
    parts = [v if v is not None else t.reshape(-1) for v, t in zip(views, tile.tensors[kind])]
    if pad:
        parts.append(_zeros(layout, parts[0], pad))
    return torch.cat(parts)


def _zeros(layout: _FusedLayout, ref: Tensor, pad: int) -> Tensor:
    """``pad`` zeros of ``ref``'s dtype: a slice of the layout's one zero tile per dtype (never written)."""
    zeros = layout.pads.get(ref.dtype)
    if zeros is None:
        zeros = layout.pads[ref.dtype] = torch.zeros(layout.tile_numel, dtype=ref.dtype, device=ref.device)
    return zeros[:pad]


def _gather_grads(b: _Bucket, tile: _Tile, pad: int, layout: _FusedLayout) -> Tensor:
    """A packed tile's gradient elements in the gradients' dtype, zero-padded: one ``_chunk_cat`` on a CPU, one
    ``cat`` of flat views elsewhere (``_parts._ONE_OP_COPY_DEVICES``)."""
    segs = tile.segs
    gs = [b.grads[s.param] for s in segs]
    g0 = gs[0]
    pieces = [g if s.start == 0 and s.stop == g.numel() else g.reshape(-1)[s.start:s.stop] for g, s in zip(gs, segs)]
    if g0.device.type not in _parts._ONE_OP_COPY_DEVICES or _chunk_cat is None:  # (or a torch without _chunk_cat)
        parts = [x.reshape(-1) for x in pieces]
        if pad:
            parts.append(_zeros(layout, g0, pad))
        return torch.cat(parts)
    out = torch.empty(tile.total + pad, dtype=g0.dtype, device=g0.device)
    if pad:
        out[tile.total:].zero_()
    # One kernel gathers gradients of any shapes and strides (0-d ones need a 1-element view).
    _chunk_cat([x if x.dim() else x.reshape(1) for x in pieces], 0, 1, out=out[:tile.total].view(1, tile.total))
    return out


def _cumsum(sizes: list[int]) -> list[int]:
    return list(accumulate(sizes))

