"""``NumericsMonitor``: sampled statistics of activations, activation gradients, parameter gradients and updates.

Hooks (installed by :meth:`NumericsMonitor.attach`, removed by :meth:`detach`):

* steps are counted at the optimizer: with ``optimizer=`` given, a step post-hook on it (a
  ``torch.optim.Optimizer``: it fires for ``opt.step()`` and ``prec.step(opt)`` alike) or else its
  ``step`` wrapped on the instance (removed on detach), so gradient-accumulation micro-batches and evaluation
  forwards stay in their step. Without an optimizer, a forward pre-hook on the root module
  starts a new step at every forward that records a graph (evaluation forwards under
  ``no_grad`` do not count), unless you call :meth:`NumericsMonitor.step` yourself. At the
  start of a sampled step the optimizer's tensors are snapshotted so the update can be measured;
* a forward hook on each tracked module (leaf modules by default) adds the magnitudes of its
  floating outputs to a :class:`~mixprec.numerics.Log2Histogram` and registers a tensor hook on
  each output that records the gradient flowing back into it (the activation gradient). It also
  counts, on the device, the calls that returned inf/NaN, those that had received it (NaN inputs,
  inf/NaN weights: passed on, not made; ``-inf`` inputs such as attention masks are legitimate)
  and whether the others computed in half precision (autocast, half weights, inputs or outputs),
  so the report blames only modules that made inf/NaN and calls it a precision problem only when
  it was made in half precision (see ``_count_nonfinite_call`` for the rules and their cost);
* a tensor hook on each parameter records its gradient as autograd produces it (before
  accumulation, so in the dtype backward computes in; a sparse gradient, ``nn.Embedding(sparse=True)``,
  by the rows it stores, coalesced: on a GPU one host sync each, ``mixprec.numerics._stats.stored_values``);
* on each FP8 linear (a model prepared under an ``f8=`` policy), and on every eligible
  ``nn.Linear`` when ``fp8=<recipe>`` is given, the GEMM operands (input, weight, output
  gradient) are counted as the recipe casts them to E4M3/E5M2: saturated, flushed, subnormal,
  SQNR (:meth:`NumericsMonitor.fp8_stats`, :meth:`NumericsMonitor.fp8_table`).

On steps that are not sampled every hook returns after one attribute check. On a
``torch.compile``'d model modules and parameters are named as in the uncompiled model (no
``_orig_mod.``), as checkpoints and ``name:`` islands name them.

Underflow that already happened is invisible to the histograms: a gradient computed in FP16
that flushed to zero arrives as an exact zero, and the underflow figures count non-zero values
only. The report therefore also flags parameters whose FP16-computed gradients are largely exact
zeros while their non-zero values sit near FP16's smallest magnitudes (see
:func:`~mixprec.numerics._findings.build_report`); to measure what FP16 would lose, monitor an FP32
run (as ``mixprec doctor`` does), where the small values are still there. Gradients are
divided by the loss scale in use (read from ``loss_scale``) so the histograms hold true,
unscaled magnitudes. Statistics stay on the device; :meth:`report` reads them back (host
syncs happen there, and when taking the loss scale from a ``torch.amp.GradScaler``).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._casting import _compile_target, island_modules
from .._checkpoint import canonical_name
from .._dtypes import HALF, device_supports
from .._fp8 import eligible_reason, is_fp8_linear, linear_weight
from .._policy import FP8_RECIPES, Policy
from .._tree import floating_tensors
from ._findings import NOTHING_SAMPLED, ModuleNumerics, NumericsReport, ParamNumerics, build_report
from ._fp8_plan import Fp8CastStats, _Cast, _recipe_casts, _stats_from_counts, cast_counts, fp8_stats_table
from ._stats import Log2Histogram, stored_values

__all__ = ["NumericsMonitor"]

# Every preset keeps normalization layers in FP32 (i=norm); the report needs to know which those are.
_NORM_POLICY = Policy(fp32_islands=("norm",))

ModuleSelection = Literal["leaves", "all"] | Iterable[str] | Callable[[str, nn.Module], bool]


@dataclasses.dataclass
class _ModuleRecord:
    name: str
    type_name: str
    norm_island: bool
    act: Log2Histogram = dataclasses.field(default_factory=Log2Histogram)
    act_grad: Log2Histogram = dataclasses.field(default_factory=Log2Histogram)
    act_dtypes: set[str] = dataclasses.field(default_factory=set)
    grad_dtypes: set[str] = dataclasses.field(default_factory=set)
    # On the device: [calls that returned inf/NaN, those of them whose inputs held NaN or whose parameters were
    # non-finite already (they passed it on), those of the others (they made it) that computed in half precision]
    nonfinite_calls: torch.Tensor | None = None


@dataclasses.dataclass
class _ParamRecord:
    name: str
    module: str
    dtype: str
    numel: int
    grad: Log2Histogram = dataclasses.field(default_factory=Log2Histogram)
    grad_dtypes: set[str] = dataclasses.field(default_factory=set)
    # update statistics: [updated elements, below half a bf16 ulp, below half an f16 ulp]
    update_counts: torch.Tensor | None = None
    # in an FP32 island under the policy: stored in FP32 whatever the preset, so never stagnant in BF16/FP16
    fp32_island: bool = False


@dataclasses.dataclass
class _Fp8Record:
    name: str
    recipe: str
    casts: dict[str, _Cast]  # operand -> how the recipe casts it (input, weight, grad_output)
    counts: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # operand -> cast_counts, summed

    def add(self, operand: str, counts: torch.Tensor) -> None:
        old = self.counts.get(operand)
        if old is None:
            self.counts[operand] = counts
        else:
            new = old + counts
            new[0] = torch.maximum(old[0], counts[0])  # amax
            self.counts[operand] = new


def _is_half(dt: torch.dtype) -> bool:
    """FP16, BF16 or an FP8 format."""
    return dt in HALF or (dt.is_floating_point and dt.itemsize == 1)


def _short(dt: torch.dtype) -> str:
    return {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}.get(
        dt, str(dt).removeprefix("torch."))


class NumericsMonitor:
    """Watch a model's numerics during training, every ``every`` steps, and report what precision it needs.

    Args:
        model: The model (any precision; hooks see values as they are computed).
        every: Sample one step in ``every`` (step 0 is sampled).
        optimizer: Optional; when given, the update of each sampled step is measured on the
            tensors the optimizer holds (the FP32 masters of a ``MasterWeightOptimizer``) to
            report BF16/FP16 stagnation (updates below half an ulp of the weight).
        loss_scale: Where to read the loss scale the backward ran at, to unscale gradients: a
            number, a 0-d tensor, a mixprec ``LossScaler`` (``.loss_scale``), a
            ``MixedPrecision`` (``.scaler``), a ``torch.amp.GradScaler``, or a callable
            returning one of these. ``None``: gradients are not scaled.
        modules: Which modules to watch: ``"leaves"`` (default: modules without children, so
            no value is counted twice), ``"all"``, qualified names, or a predicate ``(name, module) -> bool``.
        params: Record parameter gradients.
        max_elements: Estimate histograms of larger tensors from a strided subset of this many
            elements (``None``: every element).
        overflow_margin: A module is "at risk" in FP16 when its largest activation times this
            factor reaches the FP16 maximum (16: four binades of headroom).
        manual_steps: Count steps only by :meth:`step` calls (see there).
        fp8: Also count the GEMM operands of every eligible plain ``nn.Linear`` as this FP8
            recipe (``tensorwise``, ``rowwise``, ``rowwise_gw_hp``) would cast them: what FP8
            would do to a model that trains in BF16. FP8 linears are always counted, under their own recipe.
        policy: The policy (a :class:`~mixprec.Policy` or its string) whose FP32 islands
            (``island_modules(model, policy)``) keep their parameters in FP32: their updates are
            measured but left out of the BF16/FP16 stagnation figures and finding, which are about
            weights that would be stored in half precision. ``None`` (default): normalization
            layers, the islands of every preset (``i=norm``).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with NumericsMonitor(model, every=1, optimizer=opt) as mon:
        ...     for _ in range(3):
        ...         model(torch.randn(4, 8)).pow(2).mean().backward()
        ...         opt.step(); opt.zero_grad()
        >>> rep = mon.report()
        >>> rep.recommended_preset in ("bf16-mixed", "fp16-mixed", "fp32")
        True
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        every: int = 1,
        optimizer: Any = None,
        loss_scale: Any = None,
        modules: ModuleSelection = "leaves",
        params: bool = True,
        max_elements: int | None = None,
        overflow_margin: float = 16.0,
        manual_steps: bool = False,
        policy: Policy | str | None = None,
        fp8: str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"NumericsMonitor watches an nn.Module, got {type(model).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r}: sample one step in every N, N a positive integer (e.g. every=100).")
        if max_elements is not None and max_elements < 1:
            raise ValueError(f"max_elements={max_elements!r} must be a positive integer or None.")
        if fp8 is not None and fp8 not in FP8_RECIPES:
            raise ValueError(f"fp8={fp8!r}: use one of {', '.join(FP8_RECIPES)}, or None (only FP8 linears are counted).")
        if isinstance(overflow_margin, bool) or not isinstance(overflow_margin, (int, float)):
            raise TypeError(f"overflow_margin={overflow_margin!r} must be a number >= 1 (16 = four binades of headroom), "
                            f"got a {type(overflow_margin).__name__}.")
        if not overflow_margin >= 1:
            raise ValueError(f"overflow_margin={overflow_margin!r} must be >= 1 (16 = four binades of headroom).")
        self.model = model
        self.every = every
        self.optimizer = optimizer
        self.loss_scale = loss_scale
        self.track_params = params
        self.max_elements = max_elements
        self.overflow_margin = float(overflow_margin)
        self._selected = self._select(model, modules)
        self._handles: list[RemovableHandle] = []
        self._modules: dict[str, _ModuleRecord] = {}
        self._params: dict[str, _ParamRecord] = {}
        self._step = 0
        self._started = False
        self._recorded = False
        self._manual = manual_steps
        self._active = False
        self._sampled_steps = 0
        self._step_scale: torch.Tensor | float | None = None
        self._scale_taken = False
        self._last_scale: torch.Tensor | float | None = None
        self._snapshot: list[tuple[str, torch.Tensor, torch.Tensor]] | None = None
        self._update_measured = False
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._wrapped_step: Any = None
        # Per sampled step (cleared when one begins; parameters change only at optimizer steps, between steps):
        # module id -> (any parameter of its subtree non-finite, on the device; any of them half), and the NaN
        # checks of input tensors by (id, version), with a weak reference that tells a reused id apart.
        self._param_state_cache: dict[int, tuple[torch.Tensor | None, bool]] = {}
        self._nan_cache: dict[tuple[int, int], tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        island_policy = _NORM_POLICY if policy is None else Policy.parse(policy)
        island_mods = {id(m) for _, isl in island_modules(model, island_policy) for m in isl.modules()}
        island_ids = {id(p) for _, m in island_modules(model, island_policy) for p in m.parameters()}
        self._island_params = {canonical_name(n) for n, p in model.named_parameters() if id(p) in island_ids}
        self._fp8: dict[str, _Fp8Record] = {}
        self._fp8_targets: list[tuple[str, nn.Module, str]] = []
        for n, m in _compile_target(model).named_modules():
            n = canonical_name(n)
            if is_fp8_linear(m):
                self._fp8_targets.append((n, m, str(m.mixprec_recipe)))
            elif fp8 is not None and n and eligible_reason(m, n, island_policy, island_mods) is None:
                self._fp8_targets.append((n, m, fp8))

    # ----- selection and attachment ------------------------------------------------------------
    @staticmethod
    def _select(model: nn.Module, modules: ModuleSelection) -> list[tuple[str, nn.Module]]:
        # A torch.compile'd model: its modules under the names users and policies know (no '_orig_mod.';
        # the compile wrappers themselves are not layers), as checkpoints name them.
        named = [(canonical_name(n), m) for n, m in _compile_target(model).named_modules()
                 if not isinstance(m, torch._dynamo.eval_frame.OptimizedModule)]
        if modules == "leaves":
            chosen = [(n, m) for n, m in named if not any(True for _ in m.children())]
        elif modules == "all":
            chosen = named
        elif callable(modules):
            chosen = [(n, m) for n, m in named if modules(n, m)]
        elif isinstance(modules, Iterable) and not isinstance(modules, str):
            wanted = [canonical_name(w) for w in modules]  # '_orig_mod.2' (a compiled model's) is '2'
            by_name = dict(named)
            missing = [w for w in wanted if w not in by_name]
            if missing:
                sample = ", ".join(repr(n) for n, _ in named[1:6])
                raise ValueError(f"modules={missing!r} not found in the model; qualified names look like {sample}, ...")
            chosen = [(w, by_name[w]) for w in wanted]
        else:
            raise ValueError(f"modules={modules!r}: use 'leaves', 'all', a list of qualified names or a predicate.")
        return chosen

    def attach(self) -> NumericsMonitor:
        """Install the hooks (idempotent). Returns self."""
        if self._handles:
            return self
        self._handles.append(self.model.register_forward_pre_hook(self._on_root_forward, prepend=True))
        self._wrap_optimizer_step()
        for name, module in self._selected:
            rec = self._modules.setdefault(
                name, _ModuleRecord(name, type(module).__name__, _NORM_POLICY.is_fp32_island(module, name)))
            self._handles.append(module.register_forward_hook(functools.partial(self._on_forward, rec),
                                                              with_kwargs=True))
        for name, module, recipe in self._fp8_targets:
            casts = _recipe_casts(recipe)
            rec8 = self._fp8.setdefault(name, _Fp8Record(name, recipe, {
                "input": casts["output"][0], "weight": casts["output"][1], "grad_output": casts["grad_input"][0]}))
            self._handles.append(module.register_forward_hook(functools.partial(self._on_fp8_forward, rec8)))
        if self.track_params:
            owner: dict[int, str] = {}
            for mname, module in self.model.named_modules():
                for _, p in module.named_parameters(recurse=False):
                    owner.setdefault(id(p), canonical_name(mname))
            for pname, p in self.model.named_parameters():
                if not p.requires_grad or not p.is_floating_point():
                    continue
                pname = canonical_name(pname)
                rec_p = self._params.setdefault(
                    pname, _ParamRecord(pname, owner.get(id(p), ""), _short(p.dtype), p.numel(),
                                        fp32_island=pname in self._island_params))
                self._handles.append(p.register_hook(functools.partial(self._on_param_grad, rec_p)))
        return self

    def detach(self) -> None:
        """Remove every hook; the statistics collected so far are kept for :meth:`report`."""
        self._finish_update()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._unwrap_optimizer_step()

    def __enter__(self) -> NumericsMonitor:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def reset(self) -> None:
        """Forget the statistics (hooks stay)."""
        self._modules = {n: _ModuleRecord(n, r.type_name, r.norm_island) for n, r in self._modules.items()}
        self._params = {n: _ParamRecord(n, r.module, r.dtype, r.numel, fp32_island=r.fp32_island)
                        for n, r in self._params.items()}
        if self._handles:
            self.detach()
            self.attach()
        for r in self._fp8.values():
            r.counts.clear()
        self._sampled_steps = 0
        self._snapshot = None
        self._clear_call_caches()

    # ----- step counting ---------------------------------------------------------------------------
    @property
    def sampling(self) -> bool:
        """Whether the current step is sampled."""
        return self._active

    def step(self) -> None:
        """Mark the end of a training step (call after ``optimizer.step()``).

        Not needed when the monitor was given the optimizer (its ``step`` counts). Without one,
        every root forward that records a graph starts a new step; call this instead when a step
        has several such forwards (gradient accumulation). The first call switches the monitor to
        counting only these calls (``manual_steps=True`` does so from the start).
        """
        self._manual = True
        self._end_step()
        self._begin_step()

    def _begin_step(self) -> None:
        self._started = True
        self._active = self._step % self.every == 0
        self._scale_taken = False
        self._recorded = False
        self._clear_call_caches()
        if self._active:
            self._take_snapshot()

    def _end_step(self) -> None:
        if self._started:
            self._finish_update()
            self._step += 1

    def _on_root_forward(self, module: nn.Module, args: Any) -> None:
        if not self._started:
            self._begin_step()
        elif not self._manual and self._wrapped_step is None and torch.is_grad_enabled():
            self._end_step()
            self._begin_step()

    def _wrap_optimizer_step(self) -> None:
        opt = self.optimizer
        if opt is None or not callable(getattr(opt, "step", None)) or self._wrapped_step is not None:
            return
        monitor = self
        if isinstance(opt, torch.optim.Optimizer):
            # A step post-hook fires however the step is reached: opt.step(), prec.step(opt) (which calls the
            # optimizer's step below its guard, or runs its hooks around a fused step), a wrapper's step.
            def on_step(*_: Any) -> None:
                if monitor._wrapped_step is handle and not monitor._manual:
                    monitor._end_step()
                    monitor._begin_step()

            handle = opt.register_step_post_hook(on_step)
            self._wrapped_step = handle
            return
        original = opt.step

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if monitor._wrapped_step is step and not monitor._manual:
                monitor._end_step()
                monitor._begin_step()
            return out

        self._wrapped_step = step
        self._original_step = original
        opt.step = step

    def _unwrap_optimizer_step(self) -> None:
        step, self._wrapped_step = self._wrapped_step, None
        if step is None:
            return
        if isinstance(step, RemovableHandle):
            step.remove()
            return
        if self.optimizer.__dict__.get("step") is step:
            if self._original_step == type(self.optimizer).step.__get__(self.optimizer):
                del self.optimizer.step  # back to the class's method
            else:
                self.optimizer.step = self._original_step
        # else: something wrapped step after us; our wrapper stays in its chain but is inert now

    # ----- the loss scale ------------------------------------------------------------------------------
    def _resolve_scale(self) -> torch.Tensor | float | None:
        src = self.loss_scale
        for _ in range(3):
            if src is None:
                return None
            if isinstance(src, (int, float)) and not isinstance(src, bool):
                return float(src)
            if isinstance(src, torch.Tensor):
                return src.detach().clone()
            if hasattr(src, "_scale") and hasattr(src, "get_scale"):  # torch.amp.GradScaler
                if not src.is_enabled():
                    return None
                s = getattr(src, "_scale", None)
                return s.detach().clone() if isinstance(s, torch.Tensor) else float(src.get_scale())
            if hasattr(src, "loss_scale"):
                src = src.loss_scale
                continue
            if hasattr(src, "scaler"):
                src = src.scaler
                continue
            if callable(src):
                src = src()
                continue
            break
        raise TypeError(
            f"loss_scale={self.loss_scale!r}: give a number, a tensor, a LossScaler, a MixedPrecision, a "
            "torch.amp.GradScaler or a function returning the scale."
        )

    def _scale_for_step(self) -> torch.Tensor | float | None:
        if not self._scale_taken:
            self._step_scale = self._resolve_scale()
            self._scale_taken = True
            if self._step_scale is not None:
                self._last_scale = self._step_scale
        return self._step_scale

    # ----- hooks -----------------------------------------------------------------------------------------
    def _mark_recorded(self) -> None:
        if not self._recorded:
            self._recorded = True
            self._sampled_steps += 1

    def _on_forward(self, rec: _ModuleRecord, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self._active:
            return
        self._mark_recorded()
        # Inside a backward: activation checkpointing recomputes this forward. Its activations were counted
        # once already; its gradients flow through the recomputed outputs (reentrant checkpointing), so hooks.
        recompute = torch._C._current_graph_task_id() != -1
        outs = floating_tensors(output)
        counted = bool(outs) and not recompute
        before = rec.act.nonfinite_count() if counted else None
        for t in outs:
            if not recompute:
                rec.act.add_(t, max_elements=self.max_elements)
                rec.act_dtypes.add(_short(t.dtype))
            if t.requires_grad and torch.is_grad_enabled():
                t.register_hook(functools.partial(self._on_act_grad, rec))
        if counted:
            self._count_nonfinite_call(rec, module, floating_tensors((args, kwargs)), outs, before)

    @torch.no_grad()
    def _count_nonfinite_call(self, rec: _ModuleRecord, module: nn.Module, inputs: list[torch.Tensor],
                              outs: list[torch.Tensor], before: torch.Tensor | None) -> None:
        """Count one call on the device (no host sync): did it return inf/NaN, had it received it, in what precision.

        A module whose every inf/NaN-returning call had received it only passed it on and is not
        blamed (``ModuleNumerics.nonfinite_input``). "Received" means:

        * an input holds NaN. Not inf: ``-inf`` in inputs is legitimate (additive attention masks,
          padding for max-pooling), and a module that overflows while a mask is among its inputs
          made its inf/NaN itself. A module that turns an incoming inf into NaN (``inf - inf``) is
          then named too, next to the module that made the inf: the report names one module too
          many rather than none;
        * a parameter of the module (its children's included: a parent's output is made by them)
          is inf or NaN, as an earlier step's non-finite update leaves them. Weights are never
          legitimately infinite.

        Cost and ``max_elements``: whether the output holds inf/NaN is read off the output
        histogram just filled (the difference of its inf/NaN count), so it respects
        ``max_elements`` as the reported ``act_nonfinite`` does and costs no extra pass. The NaN
        check of the inputs reads every element: one NaN anywhere in a row is enough to spread
        into the output, so a strided subset could miss the NaN the output shows and blame the
        module for it. It is done once per input tensor and version per step (an output passed to
        several modules is checked once), parameters once per module per step
        (:meth:`_param_state`), so a call adds a pass over its fresh inputs, not over its
        subtree's parameters.

        The call computed in half precision when autocast to a half dtype was on for its device,
        or a parameter of its subtree, an input or an output was FP16/BF16/FP8: only a call with
        none of these computed in FP32, where inf/NaN is no precision problem. (A module handed
        half inputs that upcasts first is counted as half: that errs towards advising an FP32
        island, which the tracer's FP32 re-run checks, rather than towards calling a precision
        problem none.)
        """
        after = rec.act.nonfinite_count()
        if after is None:  # (no output element counted)
            return
        bad_out = after > before if before is not None else after > 0
        dev = bad_out.device
        bad_params, half = self._param_state(module)
        flags = [self._holds_nan(t).to(dev) for t in inputs]
        if bad_params is not None:
            flags.append(bad_params.to(dev))
        bad_in = torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool, device=dev)
        dtype = outs[0].device.type
        half = (half or any(_is_half(t.dtype) for t in (*inputs, *outs))
                or (torch.amp.is_autocast_available(dtype) and torch.is_autocast_enabled(dtype)
                    and _is_half(torch.get_autocast_dtype(dtype))))
        made = bad_out & ~bad_in
        c = torch.stack([bad_out, bad_out & bad_in, made if half else torch.zeros_like(made)]).to(torch.int64)
        rec.nonfinite_calls = c if rec.nonfinite_calls is None else rec.nonfinite_calls + c.to(rec.nonfinite_calls.device)

    def _clear_call_caches(self) -> None:
        self._param_state_cache.clear()
        self._nan_cache.clear()

    @staticmethod
    def _check_view(t: torch.Tensor) -> torch.Tensor:
        # (FP8 tensors upcast: isnan/isfinite are not implemented for them everywhere; a sparse tensor's
        # stored values: isfinite has no sparse kernel)
        d = stored_values(t.detach())
        return d.float() if d.dtype.itemsize == 1 else d

    def _holds_nan(self, t: torch.Tensor) -> torch.Tensor:
        """Whether ``t`` holds a NaN (a 0-d bool on its device), computed once per tensor and version per step."""
        try:
            key: tuple[int, int] | None = (id(t), t._version)
        except RuntimeError:  # an inference tensor has no version counter: not cached
            key = None
        if key is not None and (hit := self._nan_cache.get(key)) is not None and hit[0]() is t:
            return hit[1]
        flag = self._check_view(t).isnan().any()
        if key is not None:
            self._nan_cache[key] = (weakref.ref(t), flag)
        return flag

    def _param_state(self, module: nn.Module) -> tuple[torch.Tensor | None, bool]:
        """(any parameter of ``module``'s subtree inf/NaN: 0-d bool on the device, ``None`` when it has none;
        any of them half precision), once per module per step: a parent reuses its children's answers, so
        each parameter is read once per step whatever the depth and whichever modules are monitored.
        """
        hit = self._param_state_cache.get(id(module))
        if hit is not None:
            return hit
        flags: list[torch.Tensor] = []
        half = False
        for p in module.parameters(recurse=False):
            if p.is_floating_point():
                half = half or _is_half(p.dtype)
                flags.append(torch.isfinite(self._check_view(p)).logical_not().any())
        for child in module.children():
            f, h = self._param_state(child)
            half = half or h
            if f is not None:
                flags.append(f)
        bad = (None if not flags else flags[0] if len(flags) == 1
               else torch.stack([f.to(flags[0].device) for f in flags]).any())
        self._param_state_cache[id(module)] = (bad, half)
        return bad, half

    def _on_act_grad(self, rec: _ModuleRecord, grad: torch.Tensor) -> None:
        if grad is None or not self._active:
            return
        self._mark_recorded()
        rec.act_grad.add_(grad, scale=self._scale_for_step(), max_elements=self.max_elements)
        rec.grad_dtypes.add(_short(grad.dtype))
        return

    def _on_param_grad(self, rec: _ParamRecord, grad: torch.Tensor) -> None:
        if grad is None or not self._active:
            return
        self._mark_recorded()
        rec.grad.add_(grad, scale=self._scale_for_step(), max_elements=self.max_elements)
        rec.grad_dtypes.add(_short(grad.dtype))
        return

    def _on_fp8_forward(self, rec: _Fp8Record, module: nn.Module, args: Any, output: Any) -> None:
        if not self._active or not args or not isinstance(args[0], torch.Tensor):
            return
        self._mark_recorded()
        x = args[0].detach()
        if torch.is_autocast_enabled(x.device.type):  # the FP8 linear casts its input to the autocast dtype first
            x = x.to(torch.get_autocast_dtype(x.device.type))
        w = linear_weight(module).detach()  # (out, in), as nn.Linear holds it
        rec.add("input", self._fp8_counts(x.reshape(-1, w.shape[1]), rec.casts["input"]))
        rec.add("weight", self._fp8_counts(w, rec.casts["weight"]))
        if isinstance(output, torch.Tensor) and output.requires_grad and torch.is_grad_enabled():
            output.register_hook(functools.partial(self._on_fp8_grad, rec))

    def _on_fp8_grad(self, rec: _Fp8Record, grad: torch.Tensor) -> None:
        if grad is None or not self._active:
            return
        counts = self._fp8_counts(grad.reshape(-1, grad.shape[-1]), rec.casts["grad_output"])
        scale = self._scale_for_step()
        if scale is not None:  # dynamic FP8 scaling is blind to the loss scale; the amax and SQNR sums are not
            counts = counts.clone()
            s = scale.double() if isinstance(scale, torch.Tensor) else float(scale)
            counts[0] = counts[0] / s
            counts[6:] = counts[6:] / (s * s)
        rec.add("grad_output", counts)

    @staticmethod
    def _fp8_counts(t: torch.Tensor, cast: _Cast) -> torch.Tensor:
        return cast_counts(t, cast.dtype, cast.granularity, cast.dim, cast.pow2)

    def fp8_stats(self) -> dict[str, dict[str, Fp8CastStats]]:
        """Per FP8 linear (and, with ``fp8=``, per eligible linear): its GEMM operands cast as its recipe casts them.

        Returns:
            ``{module name: {"input" | "weight" | "grad_output": Fp8CastStats}}`` over every
            sampled step (counts summed, amax the maximum, SQNR of the summed signal and error;
            gradients unscaled). ``input`` and ``weight`` as the forward GEMM casts them (E4M3),
            ``grad_output`` as the grad-input GEMM does (E5M2 tensorwise, E4M3 rowwise). Modules
            that did not run are left out. Host sync: one per module.
        """
        out: dict[str, dict[str, Fp8CastStats]] = {}
        for name, r in self._fp8.items():
            if not r.counts:
                continue
            ops = list(r.counts)
            rows = torch.stack([r.counts[o] for o in ops]).tolist()
            out[name] = {
                o: _stats_from_counts(r.casts[o].dtype, f"{r.recipe}: {r.casts[o].granularity}", c) for o, c in zip(ops, rows)
            }
        return out

    def fp8_table(self) -> str:
        """:meth:`fp8_stats` as a table: per module and operand, format, amax, saturated, flushed, subnormal, SQNR."""
        stats = self.fp8_stats()
        if not stats:
            return "FP8: no FP8 linear ran in a sampled step (prepare under an f8= policy, or NumericsMonitor(..., fp8='tensorwise'))."
        return fp8_stats_table(stats)

    # ----- update (stagnation) measurement -------------------------------------------------------------
    def _optimizer_tensors(self) -> list[tuple[str, torch.Tensor]]:
        opt = self.optimizer
        if opt is None:
            return []
        names = {id(p): canonical_name(n) for n, p in self.model.named_parameters()}
        model_params = getattr(opt, "model_params", None)
        masters = getattr(opt, "masters", None)
        out: list[tuple[str, torch.Tensor]] = []
        if isinstance(model_params, list) and isinstance(masters, list) and len(model_params) == len(masters):
            for p, m in zip(model_params, masters):
                out.append((names.get(id(p), f"param{len(out)}"), m))
            return [(n, t) for n, t in out if t.is_floating_point()]
        for g in getattr(opt, "param_groups", []):
            for p in g["params"]:
                if isinstance(p, torch.Tensor) and p.is_floating_point():
                    out.append((names.get(id(p), f"param{len(out)}"), p))
        return out

    @torch.no_grad()
    def _take_snapshot(self) -> None:
        tensors = self._optimizer_tensors()
        self._snapshot = [(n, t, t.detach().clone()) for n, t in tensors] if tensors else None

    @torch.no_grad()
    def _finish_update(self) -> None:
        snap, self._snapshot = self._snapshot, None
        if not snap:
            return
        half_ulp_bits = {"bf16": 7, "f16": 10}
        live_bits = {torch.bfloat16: 7, torch.float16: 10}
        # Weights stored in half precision round a swamped update away: the weight does not change (delta == 0),
        # so delta alone cannot see stagnation there. An element whose gradient was non-zero was meant to move;
        # unless the step was skipped (a non-finite gradient anywhere: the loss scaler skips the whole step),
        # which is decided on the device (no host sync).
        # Compensated optimizers (mixprec.optim with compensation='kahan' or 'stochastic', bf16-pure) carry an
        # unchanged weight's update in their buffer or in expectation: nothing is lost there, so only delta counts.
        compensated = getattr(self.optimizer, "compensation", "none") not in (None, "none")
        grads = [] if compensated else [
            live.grad for _, live, _ in snap if live.dtype in live_bits and isinstance(live.grad, torch.Tensor)
            and live.grad.shape == live.shape and not live.grad.is_sparse]
        stepped = (torch.stack([torch.isfinite(g).all().to(grads[0].device) for g in grads]).all()
                   if grads else None)
        # A parameter whose group's learning rate is 0 (a warm-up's first step, a frozen group) was not meant
        # to move: unchanged is not stagnant there. (A tensor lr is read once per group: a sampled step only.)
        resting = {id(t) for g in getattr(self.optimizer, "param_groups", []) if _is_zero(g.get("lr", 1.0))
                   for t in g["params"]}
        for name, live, before in snap:
            delta = live.detach().float() - before.float()
            w = before.float().abs()
            # A zero weight can take any update (small values are representable), so it counts
            # as updated but never as stagnant.
            updated = (delta != 0) & torch.isfinite(delta)
            stuck = None
            g = live.grad
            if (stepped is not None and live.dtype in live_bits and isinstance(g, torch.Tensor)
                    and g.shape == live.shape and not g.is_sparse and id(live) not in resting):
                # meant to move (finite non-zero gradient, the step taken) but unchanged: below half an ulp
                # of the stored format, and of any format with as few or fewer mantissa bits. (Whether it
                # would have moved in a wider format is unknown: not counted stagnant there.)
                stuck = (delta == 0) & (g != 0) & torch.isfinite(g) & (w > 0) & stepped.to(g.device)
                updated = updated | stuck
            # half an ulp of w in a format with m mantissa bits: 2**(floor(log2 w) - m - 1);
            # frexp gives w = f * 2**e with f in [0.5, 1), so floor(log2 w) = e - 1.
            e = torch.frexp(torch.where(w > 0, w, 1.0)).exponent
            counts = [updated.sum()]
            for m in half_ulp_bits.values():
                half_ulp = torch.ldexp(torch.ones_like(w), (e - 2 - m))
                below = updated & (w > 0) & (delta.abs() < half_ulp)
                if stuck is not None and m > live_bits[live.dtype]:
                    below = below & ~stuck
                counts.append(below.sum())
            c = torch.stack(counts)
            rec = self._params.get(name)
            if rec is None:
                rec = self._params.setdefault(name, _ParamRecord(name, "", _short(live.dtype), live.numel(),
                                                                 fp32_island=name in self._island_params))
            rec.update_counts = c if rec.update_counts is None else rec.update_counts + c.to(rec.update_counts.device)
            self._update_measured = True

    # ----- report -------------------------------------------------------------------------------------------
    def report(self, *, loss_scale: float | None = None, max_lost: float = 0.001,
               device: torch.device | str | None = None) -> NumericsReport:
        """Summarise what was observed (host syncs happen here).

        Args:
            loss_scale: The scale to evaluate "lost at the current scale" against; default: the
                last scale read from ``loss_scale`` (1.0 when none).
            max_lost: The fraction of non-zero gradient values a recommended loss scale may
                still flush to zero in FP16 (default 0.1%).
            device: Device whose BF16 support decides the recommended preset (default: the model's).

        Returns:
            :class:`NumericsReport` (``.table()``, ``.to_dict()``, ``str()``).
        """
        if loss_scale is None:
            last = self._last_scale
            loss_scale = float(last) if last is not None else 1.0
        dev = torch.device(device) if device is not None else self._device
        modules = []
        for r in self._modules.values():
            calls = r.nonfinite_calls.tolist() if r.nonfinite_calls is not None else [0, 0, 0]
            made = calls[0] - calls[1]  # calls that made inf/NaN (from NaN-free inputs and finite parameters)
            modules.append(ModuleNumerics.from_histograms(
                r.name, r.type_name, r.act, r.act_grad, sorted(r.act_dtypes), sorted(r.grad_dtypes), loss_scale,
                r.norm_island, nonfinite_input=calls[0] > 0 and made == 0,
                nonfinite_made_in_half=calls[2] > 0 if made > 0 else None))
        params = [
            ParamNumerics.from_record(r.name, r.module, r.dtype, r.numel, r.grad, sorted(r.grad_dtypes),
                                      r.update_counts.tolist() if r.update_counts is not None else None, loss_scale,
                                      fp32_island=r.fp32_island)
            for r in self._params.values()
        ]
        if self._sampled_steps == 0:
            warnings.warn(f"NumericsMonitor.report(): {NOTHING_SAMPLED}", UserWarning, stacklevel=2)
        pooled = self.histograms
        return build_report(
            modules=modules, params=params, act_grads=pooled["activation_grads"], param_grads=pooled["param_grads"],
            activations=pooled["activations"],
            loss_scale=float(loss_scale), max_lost=max_lost, sampled_steps=self._sampled_steps, every=self.every,
            overflow_margin=self.overflow_margin, bf16_supported=device_supports(torch.bfloat16, dev),
            device=str(dev), update_measured=self._update_measured,
        )

    @property
    def histograms(self) -> dict[str, Log2Histogram]:
        """Pooled histograms: ``activations``, ``activation_grads`` (unscaled), ``param_grads`` (unscaled)."""
        out = {"activations": Log2Histogram(), "activation_grads": Log2Histogram(), "param_grads": Log2Histogram()}
        for r in self._modules.values():
            out["activations"].merge_(r.act)
            out["activation_grads"].merge_(r.act_grad)
        for p in self._params.values():
            out["param_grads"].merge_(p.grad)
        return out

    def __repr__(self) -> str:
        state = "attached" if self._handles else "detached"
        return (f"NumericsMonitor({len(self._modules)} modules, {len(self._params)} params, every={self.every}, "
                f"{self._sampled_steps} sampled steps, {state})")


def _is_zero(lr: Any) -> bool:
    """Whether a param group's learning rate is 0 (a number, or a 0-d tensor: one host read)."""
    try:
        return float(lr) == 0.0
    except (TypeError, ValueError):
        return False
