"""The fused (``torch.compile``d) step of a :class:`~mixprec.optim.LowPrecisionOptimizer` (``fused=True``)."""

from __future__ import annotations

import time
import types
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from .._remainder import join_edited, split
from ._parts import (
    _DYNAMIC_GROUP_KEYS,
    _HALF,
    _SLOT_COMP,
    _SLOT_PARAM,
    _STREAMS_PER_PARAM,
    OptimizerParts,
    _Bucket,
    _DeviceCtx,
    _Plan,
    _same_values,
    _scalar_expand,
)
from ._rounding import counter_bits, step_keys, stochastic_round, stream_key, with_edits

__all__ = ["FusedStep"]

#: Compiled steps are shared by every optimizer in the process, keyed by bucket structure.
_FUSED_CACHE: dict[Any, Callable[..., None]] = {}
_FUSED_CACHE_SIZE = 64
#: Structures one optimizer may compile before it falls back to the eager step.
_MAX_COMPILES = 32


class FusedStep(OptimizerParts):
    """The fused step of ``LowPrecisionOptimizer``: one compiled function per bucket structure (see ``_base.py``)."""

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
            lr_t = lr.detach().to(device=device, dtype=torch.float64).reshape(1)
        else:
            lr_key = (gi, device)
            lr_cached = self._lr_tensors.get(lr_key)
            if lr_cached is None:
                lr_cached = self._lr_tensors[lr_key] = torch.zeros(1, dtype=torch.float64, device=device)
            lr_t = lr_cached.fill_(float(lr))  # a kernel with a host scalar: no sync, no recompile when the LR changes
        # Random bits only where something is stochastically rounded (half parameters with Kahan or
        # stochastic compensation, half states): FP32 steps skip the key kernels.
        bits = (p0.dtype in _HALF and self.compensation != "none") or self._state_dtype_for(p0) in _HALF
        b = self._bucket(group, params, self._streams() if bits else None)
        mirror_ids = (*map(id, b.mirrors), *map(id, b.rems))
        if plan.struct is None or plan.struct_key != mirror_ids:
            # Shapes, strides and dtypes select the compiled function; dynamo's guards check them
            # on every call, so a later layout change (a swapped p.data) recompiles, never misreads.
            plan.struct_key = mirror_ids
            plan.struct = tuple(
                (tuple(p.shape), tuple(p.stride()), p.dtype, type(p), tuple(g.shape), tuple(g.stride()), g.dtype,
                 None if m is None else (m.dtype, tuple(m.stride())), None if r is None else tuple(r.stride()))
                for p, g, m, r in zip(b.params, b.grads, b.mirrors, b.rems))
        spec: tuple[Any, ...] = (
            type(self), self.compensation, self.state_dtype, plan.struct, keys, plan.hp_key,
            ctx.scale is not None, ctx.skip is not None, device, self.sync_mirrors,
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
                ctx.scale, ctx.skip, ka, kb, offsets, b.mirrors, b.rems)
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
        sync_mirrors = self.sync_mirrors
        sdt = self._state_dtype_for(p0)
        cls = type(self)
        update = cls.__new__(cls)._update
        scalar = _scalar_expand
        slot_of = {k: 2 + j for j, k in enumerate(keys)}  # column in the key table (0: param, 1: comp)

        def fused_step(
            ps: list[Tensor], gs: list[Tensor], comps: list[Tensor], states: list[list[Tensor]],
            scalars: list[Tensor], lr: Tensor, scale: Tensor | None, skip: Tensor | None,
            ka: Tensor | None, kb: Tensor | None, offsets: Tensor | None, mirrors: list[Tensor | None],
            rems: list[Tensor | None],
        ) -> None:
            group = dict(hp)
            # lr arrives with shape (1,): dynamo turns a 0-d float64 input into a Python float
            # (SymFloat), which Inductor fails to tensorify and restarts the whole trace from scratch
            # (about a fifth of the step's compile time); a view taken inside the graph is not an input.
            group["lr"] = lr.reshape(())
            for i, p in enumerate(ps):
                g = gs[i].to(acc)
                if scale is not None:
                    g = g / scale
                mirror = mirrors[i]
                rem = rems[i]
                if rem is not None and mirror is not None:
                    # A remainder-stored master (bf16-master-r16): p is a placeholder; the FP32 value is
                    # the model's BF16 weight joined with its remainder, read here, in this pass.
                    w = join_edited(mirror, rem)
                else:
                    w = p.to(acc)
                p_old: Tensor = p
                if sync_mirrors and mirror is not None and rem is None:
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
                if rem is not None and mirror is not None:
                    hi, lo = split(w_new.to(torch.float32))  # weight and remainder; the placeholder is not written
                    new.append((mirror, hi, mirror))
                    new.append((rem, lo, rem))
                elif half:
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
                if mirror is not None and rem is None:  # the copy back into the model's half weight, in the same kernel
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
