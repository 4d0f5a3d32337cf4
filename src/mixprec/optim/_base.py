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
(~250 bytes of memory traffic per element) is the cost; a fused kernel is the next step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from copy import deepcopy
from itertools import chain
from typing import Any, Literal, NamedTuple, cast, get_args

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._dtypes import dtype_name, parse_dtype
from .._errors import unknown_choice
from ._rounding import stochastic_round

__all__ = ["Compensation", "LowPrecisionOptimizer"]

Compensation = Literal["kahan", "stochastic", "none"]
_HALF = (torch.bfloat16, torch.float16)
_PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_STATE_VERSION = 1
#: Default chunk: 16 Mi elements keeps the GPU busy (host work per chunk is fixed) while bounding
#: the step's temporaries (~0.7 GiB for AdamW) however large the model or a single parameter is.
DEFAULT_CHUNK_NUMEL = 1 << 24
_COMP_KEY = "kahan_comp"
_STEP_KEY = "step"


class _Segment(NamedTuple):
    param: int  # position in the bucket's parameter list
    start: int  # element range of the flattened parameter
    stop: int


class _DeviceCtx(NamedTuple):
    scale: Tensor | None  # grad_scale, on the device, the compute dtype applied at use
    skip: Tensor | None  # 0-d bool: found_inf != 0
    keep: Tensor | None  # 0-d float32: 1.0 - skip


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
        self.compensation: Compensation = compensation
        self.state_dtype: torch.dtype = sdt
        self.chunk_numel: int = chunk_numel
        if seed is None:
            # torch.initial_seed() does not consume random numbers, and follows torch.manual_seed().
            seed = generator.initial_seed() if generator is not None else torch.initial_seed()
        self.seed: int = int(seed)
        self._generators: dict[torch.device, torch.Generator] = {}
        self._pending_generator_states: dict[str, Tensor] = {}
        if generator is not None:
            self._generators[_normalize_device(generator.device)] = generator
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

    def _update(
        self,
        group: Mapping[str, Any],
        w: Tensor,
        grad: Tensor,
        states: dict[str, Tensor],
        steps_old: Tensor,
        steps_new: Tensor,
        expand: Callable[[Tensor], Tensor],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The update on flat compute-dtype buffers, all inputs read-only. Returns ``(w_new, states_new)``.

        ``steps_old``/``steps_new`` hold one step count per segment (FP32, on the device);
        ``expand(v)`` turns such a per-segment vector into something broadcastable to ``w``.
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

    def __getstate__(self) -> dict[str, Any]:  # pickling / deepcopy: generators travel as their states
        state = super().__getstate__()
        state.update(
            compensation=self.compensation,
            state_dtype=self.state_dtype,
            chunk_numel=self.chunk_numel,
            seed=self.seed,
            _pending_generator_states={**self._pending_generator_states, **self._generator_states()},
            _generators={},
        )
        return state

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
        for group in self.param_groups:
            buckets: dict[tuple[torch.device, torch.dtype, torch.dtype], list[Tensor]] = defaultdict(list)
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients.")
                buckets[(p.device, p.dtype, g.dtype)].append(p)
            for (device, _, _), params in buckets.items():
                if device not in ctxs:
                    ctxs[device] = _device_ctx(device, grad_scale, found_inf)
                self._step_bucket(group, params, ctxs[device])
        return loss

    def _step_bucket(self, group: dict[str, Any], params: list[Tensor], ctx: _DeviceCtx) -> None:
        for p in params:
            self._init_state(p, group)
        steps = [self.state[p][_STEP_KEY] for p in params]
        grads = [cast(Tensor, p.grad).reshape(-1) for p in params]
        for segs in self._chunks(params):
            self._step_chunk(group, params, grads, steps, segs, ctx)
        if ctx.keep is None:
            torch._foreach_add_(steps, 1.0)
        else:
            # The list-of-tensors overload stays on the device (the single-tensor one reads it on the host).
            torch._foreach_add_(steps, [ctx.keep] * len(steps))

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
        params: list[Tensor],
        grads: list[Tensor],
        steps: list[Tensor],
        segs: list[_Segment],
        ctx: _DeviceCtx,
    ) -> None:
        p0 = params[segs[0].param]
        device, pdt = p0.device, p0.dtype
        acc = torch.promote_types(pdt, torch.float32)
        kahan = pdt in _HALF and self.compensation == "kahan"
        ps = [params[s.param] for s in segs]
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
            c_old = gather(_COMP_KEY, [self.state[p][_COMP_KEY] for p in ps])
            w = w + c_old.to(acc)
        keys = self._state_keys(group)
        s_old = {k: gather(k, [self.state[p][k] for p in ps]) for k in keys}
        s_acc = {k: v.to(acc) for k, v in s_old.items()}
        steps_old = torch.stack([steps[s.param] for s in segs])
        steps_new = steps_old + (ctx.keep if ctx.keep is not None else 1.0)

        w_new, s_new = self._update(group, w, grad, s_acc, steps_old, steps_new, self._expander(sizes))
        del grad, w, s_acc

        new: dict[str | None, Tensor] = {}
        if pdt in _HALF:
            if self.compensation == "stochastic":
                new[None] = stochastic_round(w_new, pdt, generator=self._generator(device))
            else:
                new[None] = w_new.to(pdt)
            if kahan:
                # The remainder w - p is exact in FP32; stochastic rounding stores it unbiased. Round-to-
                # nearest would drop every update below half an ulp of the *buffer* (~2**-18 of the
                # weight once the buffer is large), and SGD with shrinking updates stalls (tested).
                new[_COMP_KEY] = stochastic_round(w_new - new[None].to(acc), pdt, generator=self._generator(device))
        else:
            new[None] = w_new.to(pdt)
        del w_new
        sdt = self._state_dtype_for(p0)
        for k in keys:
            if sdt in _HALF:
                # Round-to-nearest would freeze exp_avg_sq: with beta2 = 0.999 its per-step change is
                # 0.1 % of its value, below half a BF16 ulp (0.39 %). Stochastic rounding keeps it unbiased.
                new[k] = stochastic_round(s_new[k], sdt, generator=self._generator(device))
            else:
                new[k] = s_new[k].to(sdt)
        del s_new
        olds: dict[str | None, Tensor | None] = {None: p_old, _COMP_KEY: c_old}
        olds.update(s_old)
        for key, tensors, views in buffers:
            value = new[key]
            if ctx.skip is not None:
                old = olds[key]
                assert old is not None
                value = torch.where(ctx.skip, old, value)
            pieces = value.split(sizes) if len(segs) > 1 else (value,)
            dsts = [v if v is not None else t for v, t in zip(views, tensors)]
            srcs = [x if v is not None else x.view(t.shape) for x, v, t in zip(pieces, views, tensors)]
            torch._foreach_copy_(dsts, srcs)

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
                st[k] = torch.zeros(p.shape, dtype=self._state_dtype_for(p), device=p.device)
        if self._uses_kahan(p) and _COMP_KEY not in st:
            st[_COMP_KEY] = torch.zeros(p.shape, dtype=p.dtype, device=p.device)

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
                out[k] = _as_state_tensor(v, p, p.dtype, copy)
            elif k in keys or k in self._ALL_STATE_KEYS:
                out[k] = _as_state_tensor(v, p, self._state_dtype_for(p), copy)
            else:
                out[k] = deepcopy(v) if copy else v
        if _STEP_KEY not in out and any(k in out for k in keys):
            out[_STEP_KEY] = torch.ones((), dtype=torch.float32, device=p.device)  # buffers exist: not the first step
        return out

    def _generator(self, device: torch.device) -> torch.Generator:
        device = _normalize_device(device)
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            pending = self._pending_generator_states.pop(str(device), None)
            if pending is not None:
                gen.set_state(pending)
            else:
                gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def _generator_states(self) -> dict[str, Tensor]:
        return {str(d): g.get_state() for d, g in self._generators.items()}

    def state_dict(self) -> dict[str, Any]:
        """The ``torch.optim`` state dict plus a ``"mixprec"`` entry.

        Per-parameter ``state`` holds ``step`` (0-d FP32), the moments in ``state_dtype`` and,
        for ``compensation="kahan"`` on FP16/BF16 parameters, ``kahan_comp`` (parameter dtype).
        ``"mixprec"`` holds ``version``, ``compensation``, ``state_dtype`` (name), ``seed`` and
        ``generators`` (``{device: generator state}``), so that a resumed run continues bit for bit,
        stochastic rounding included. Tensors are the live state (as in torch); save or copy it.
        """
        sd = super().state_dict()
        sd["mixprec"] = {
            "version": _STATE_VERSION,
            "compensation": self.compensation,
            "state_dtype": dtype_name(self.state_dtype),
            "seed": self.seed,
            "generators": {**self._pending_generator_states, **self._generator_states()},
        }
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` or from a ``torch.optim`` optimizer of the same algorithm.

        Tensors are copied into this optimizer's dtypes and devices (moments into
        ``state_dtype``, ``kahan_comp`` into the parameter dtype, ``step`` to a 0-d FP32 tensor on
        the parameter's device). A torch checkpoint has no compensation: the buffers start at zero.
        To move FP32 weights into this run without losing what the cast drops, use
        :meth:`load_full_precision_params_`.

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
            if meta.get("version") != _STATE_VERSION:
                raise ValueError(f"mixprec optimizer state version {meta.get('version')!r}; this mixprec reads "
                                 f"version {_STATE_VERSION} (upgrade mixprec?).")
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
        self._generators = {}
        self._pending_generator_states = {}
        if meta is not None:
            self.seed = int(meta.get("seed", self.seed))
            self._pending_generator_states = {str(d): s.clone() for d, s in meta.get("generators", {}).items()}
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
            v = v.detach().to(p.device)
            p.copy_(v)
            if self._uses_kahan(p):
                acc = torch.promote_types(v.dtype, torch.float32)
                self.state[p][_COMP_KEY].copy_(v.to(acc) - p.to(acc))

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
            ``numel`` (parameter elements), ``params``, ``grads`` (existing ``.grad`` tensors),
            ``compensation`` (``kahan_comp``), ``states`` (moments and other per-element
            buffers), ``scalars`` (0-d step counters) and ``total`` (all but ``numel``).
            ``(params + grads + compensation + states) / numel`` is the bytes-per-parameter
            figure: 14 for Kahan with FP32 states on BF16 AdamW, 10 with BF16 states, 8 for
            stochastic rounding with BF16 states, 16 for FP32 parameters with FP32 states.
        """
        out = dict.fromkeys(("numel", "params", "grads", "compensation", "states", "scalars"), 0)
        for g in self.param_groups:
            for p in g["params"]:
                out["numel"] += p.numel()
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
    return t.numel() * t.element_size()


def _normalize_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        mod = getattr(torch, device.type, None)
        if mod is not None and hasattr(mod, "current_device"):
            device = torch.device(device.type, mod.current_device())
    return device


def _cat(views: list[Tensor]) -> Tensor:
    return views[0] if len(views) == 1 else torch.cat(views)


def _flat_view(t: Tensor, s: _Segment) -> Tensor | None:
    """The segment's elements of ``t`` as a 1-D view; ``None`` for a whole non-contiguous tensor."""
    if s.start == 0 and s.stop == t.numel():
        return t.view(-1) if t.is_contiguous() else None
    return t.view(-1)[s.start:s.stop]  # only contiguous tensors are cut into slices


def _as_state_tensor(v: Any, p: Tensor, dtype: torch.dtype, copy: bool) -> Tensor:
    t = torch.as_tensor(v)
    if tuple(t.shape) != tuple(p.shape):
        raise ValueError(f"optimizer state of shape {tuple(t.shape)} for a parameter of shape {tuple(p.shape)}.")
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
