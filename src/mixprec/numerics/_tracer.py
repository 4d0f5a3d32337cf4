"""Find the first module whose values became inf or NaN, in forward or in backward.

``trace_nonfinite`` runs one forward (and backward) step under hooks on every module and stops
at the first place a non-finite value appears, in execution order:

* forward, **input**: a module is called with inf/NaN inputs although every module before it
  produced finite outputs, so the values were made by its caller's own code between submodule
  calls (or they are in the batch, for the root);
* forward, **output**: a module received finite inputs and returned inf/NaN (modules run
  children first, so a parent is only named when its children were clean: then the cause is
  its own code);
* backward, **grad_input** / **param_grad**: a module received a finite gradient for its outputs
  and produced an inf/NaN gradient for its inputs or one of its parameters;
* backward, **grad_output**: an inf/NaN gradient arrived at a module's output from code that
  is not a watched module (its caller's own code, or the loss).

To see each module's own gradient contributions the tracer passes every module's inputs and
outputs through an identity autograd function that *copies* them (a view would make in-place
operations such as ``ReLU(inplace=True)`` illegal), so a trace uses more memory than a plain
step. It syncs with the host at every check. It is a diagnostic for one batch, not a
training-time hook.

Optionally the guilty module is re-run in FP32 (a copy, autocast off) on the same inputs (and,
for backward, the same output gradient): a finite FP32 result means precision is the cause.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._autocast import autocast, resolve_device_type
from .._casting import _compile_target, cast_module, is_prepared, run_of, strip_forward_patches
from .._checkpoint import canonical_name
from .._fp8 import fp8_modules
from .._policy import Policy
from .._tree import floating_tensors, tree_map
from ._findings import jsonable
from ._stats import TensorStats, tensor_stats, thresholds

__all__ = ["FP32Rerun", "TraceResult", "trace_nonfinite"]

Phase = Literal["forward", "backward"]
Where = Literal["input", "output", "grad_input", "grad_output", "param_grad", "loss"]


@dataclasses.dataclass(frozen=True)
class FP32Rerun:
    """The guilty module re-run in FP32 on the same inputs.

    Attributes:
        finite: The FP32 result has no inf/NaN.
        absmax: Its largest magnitude (of the outputs in forward, of the input and parameter
            gradients in backward).
        exceeds: The formats (``"f16"``, ``"bf16"``) whose maximum ``absmax`` exceeds.
        precision_is_cause: ``True`` when FP32 is finite (the low precision made the inf/NaN),
            ``False`` when FP32 fails too (a bug, bad data or a diverged model), ``None`` when
            the re-run could not be made.
        note: How it was run, or why not.
    """

    finite: bool | None
    absmax: float | None
    exceeds: list[str]
    precision_is_cause: bool | None
    note: str


@dataclasses.dataclass(frozen=True)
class TraceResult:
    """Where inf/NaN first appeared in one training step.

    Attributes:
        found: Whether any inf/NaN appeared.
        phase: ``"forward"`` or ``"backward"``.
        module: Qualified name of the module to blame (``""`` is the root model; ``None`` when the
            values came from the batch or the loss function).
        module_type: Its class name.
        where: ``"output"``, ``"input"`` (made by the module's own code before calling the
            submodule named in ``detail``), ``"grad_input"``, ``"param_grad"``, ``"grad_output"``
            (made by the module's own code after calling the submodule named in ``detail``), or
            ``"loss"``.
        detail: One line on exactly where (the submodule, the parameter).
        kind: ``"inf"``, ``"nan"`` or ``"inf and nan"``.
        input_stats: Statistics of what flowed into the step that failed (forward: the module's
            inputs; backward: the gradient of its outputs), in ``stats_dtype``.
        output_stats: Statistics of the non-finite tensors.
        stats_dtype: The format the statistics are computed for.
        fp32_rerun: :class:`FP32Rerun`, or ``None`` when not asked for.
        loss: The loss value (``None`` when the trace stopped before it).
        policy: The policy the step ran under (``None``: the model as given).
        loss_scale: The loss was multiplied by this before backward.
    """

    found: bool
    phase: Phase | None = None
    module: str | None = None
    module_type: str | None = None
    where: Where | None = None
    detail: str = ""
    kind: str = ""
    input_stats: list[TensorStats] = dataclasses.field(default_factory=list)
    output_stats: list[TensorStats] = dataclasses.field(default_factory=list)
    stats_dtype: str = "f16"
    fp32_rerun: FP32Rerun | None = None
    loss: float | None = None
    policy: str | None = None
    loss_scale: float = 1.0

    @property
    def location(self) -> str:
        """Where the first inf/NaN appeared, as a phrase (``"in the code of the root model (Net) itself, between ..."``).

        The one wording of the location: :attr:`explanation`, ``check``'s finding and ``doctor``'s use it.
        """
        if not self.found:
            return "nowhere"
        name = "the root model" if self.module == "" else repr(self.module)
        typ = f" ({self.module_type})" if self.module_type else ""
        if self.where == "loss":
            return "in the loss"
        if self.module is None:
            return "in the batch" if self.where == "input" else "in the gradient the loss function returned"
        return {
            "output": f"in the output of {name}{typ}",
            "input": f"in the code of {name}{typ} itself, {self.detail}",
            "grad_output": f"in the backward of the code of {name}{typ} itself, {self.detail}",
            "param_grad": f"in the gradient of {self.detail} of {name}{typ}",
        }.get(self.where or "", f"in the input gradient of {name}{typ}")

    @property
    def explanation(self) -> str:
        """A paragraph saying what happened, whether precision is the cause and what to do."""
        if not self.found:
            loss = "" if self.loss is None else f" (loss {self.loss:.6g})"
            return f"No inf/NaN in forward or backward{loss}."
        parts_head = {"loss": ", computed from finite model outputs", "output": ", whose inputs were finite",
                      "input": "; every submodule before returned finite values",
                      "param_grad": ", whose output gradient was finite", "grad_input": ", whose output gradient was finite"}
        head = f"{self.phase}: {self.kind} first appeared {self.location}"
        if self.module is None and self.where == "input":
            head = f"{self.phase}: the batch already contains {self.kind}"
        elif self.module is not None or self.where == "loss":
            head += parts_head.get(self.where or "", "")
        parts = [head + "."]
        if self.input_stats:
            amax = max(s.absmax for s in self.input_stats)
            what = "inputs" if self.phase == "forward" else "incoming gradient"
            parts.append(f"Its {what}: absmax {amax:.4g} in {self.stats_dtype}.")
        r = self.fp32_rerun
        if r is not None:
            if r.precision_is_cause:
                ex = f", largest value {r.absmax:.4g}" + (f" > the {'/'.join(r.exceeds)} maximum" if r.exceeds else "")
                parts.append(f"Re-run in FP32: finite{ex}: precision is the cause.")
            elif r.precision_is_cause is False and r.finite is None:
                parts.append(f"{r.note[0].upper()}{r.note[1:]} (check the inputs, the data, the learning rate).")
            elif r.precision_is_cause is False:
                parts.append("Re-run in FP32: also non-finite: not a precision problem (check the inputs, the data, "
                             "the learning rate).")
            else:
                parts.append(f"FP32 re-run: {r.note}")
        if self.advice:
            parts.append(self.advice)
        return " ".join(parts)

    @property
    def output_exceeds_range(self) -> bool:
        """Whether the guilty module's forward output itself lies beyond the compute format's range.

        ``True`` when the FP32 re-run of a forward output was finite but larger than a half
        format's maximum (:attr:`FP32Rerun.exceeds`): the value, not an intermediate, overflows,
        so an FP32 island cannot help (an island computes in FP32 inside but hands its outputs
        back in the compute dtype, ``mixprec._casting._island_forward``).
        """
        r = self.fp32_rerun
        return bool(self.phase == "forward" and self.where == "output" and r is not None and r.precision_is_cause
                    and r.exceeds)

    @property
    def advice(self) -> str:
        """What to do when precision is the cause (``""`` otherwise): the last sentence of :attr:`explanation`.

        An FP32 island is advised only where it can help: an overflow inside the module (an
        intermediate, finite again in its output) or in its backward. When the module's output
        itself exceeds the format's range (:attr:`output_exceeds_range`), the island would hand the
        same value back in FP16, so the advice is BF16 (FP32's exponent range) or rescaling.
        """
        r = self.fp32_rerun
        if r is None or not r.precision_is_cause:
            return ""
        if self.module is not None and self.output_exceeds_range and self.module_type != "MixprecFloat8Linear":
            fmt = "/".join(r.exceeds)
            limit = " and ".join(f"{thresholds(d).max:.6g}" for d in r.exceeds)
            name = "the model" if self.module == "" else repr(self.module)
            rescale = ("e.g. smaller weights in it, or a normalization after it" if self.module
                       else "e.g. a normalization before the last operation")
            return (f"The output of {name} itself exceeds the {fmt} maximum ({limit}; {r.absmax:.4g} in FP32), so an "
                    f"FP32 island would not help: an island computes in FP32 inside but hands its outputs back in the "
                    f"compute dtype. Use bf16 (the range of FP32, no loss scaling), or rescale the computation so the "
                    f"output fits ({rescale}).")
        if self.module and self.module_type == "MixprecFloat8Linear":
            return (f"{self.module!r} runs its GEMMs in FP8 (f8=): leave it out with f8_layers=auto "
                    f"(mixprec.numerics.fp8_plan measures each layer) or globs that skip it, or make it an "
                    f"FP32 island (i=norm+name:{self.module}).")
        if self.module:
            fix = "lower the loss scale" if self.phase == "backward" and self.loss_scale > 1 else "rescale the computation"
            return f"Keep it in FP32 (policy island i=norm+name:{self.module}), use bf16, or {fix}."
        if self.module == "":
            return "Use bf16, or find the overflowing operation in the model's forward and run it in FP32 " \
                   "(mixprec.autocast.fp32())."
        return ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (inf/NaN as null), with the explanation."""
        d = jsonable(self)
        d["input_stats"] = [s.to_dict() for s in self.input_stats]
        d["output_stats"] = [s.to_dict() for s in self.output_stats]
        d["explanation"] = self.explanation
        return d

    def __str__(self) -> str:
        return self.explanation


# ----- the trace machinery ---------------------------------------------------------------------------
class _Stop(Exception):
    """Raised from a hook to end the traced step at the first inf/NaN."""


class _Tap(torch.autograd.Function):
    """Identity (a copy) whose backward hands the incoming gradients to a callback."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[tuple[torch.Tensor | None, ...]], None], *tensors: torch.Tensor) -> Any:
        ctx.callback = callback
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.callback(grads)
        return (None, *grads)


def _nonfinite(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in tensors if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _kind(tensors: list[torch.Tensor]) -> str:
    has_nan = any(bool(torch.isnan(t).any()) for t in tensors)
    has_inf = any(bool(torch.isinf(t).any()) for t in tensors)
    return "inf and nan" if has_nan and has_inf else "nan" if has_nan else "inf"


@dataclasses.dataclass
class _Event:
    phase: Phase
    module: str | None
    where: Where
    detail: str
    bad: list[torch.Tensor]
    incoming: list[torch.Tensor]
    rerun: str | None  # module to re-run


def _named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()`` under the names users (and policies' ``name:`` islands) know.

    ``torch.compile``'s wrappers (an ``OptimizedModule`` submodule) are left out and the
    ``_orig_mod.`` they add is dropped from the names (:func:`mixprec._checkpoint.canonical_name`),
    so a compiled submodule is reported as ``blocks.0``, not ``blocks.0._orig_mod``.
    """
    return [(canonical_name(n), m) for n, m in model.named_modules()
            if not isinstance(m, torch._dynamo.eval_frame.OptimizedModule)]


class _Tracer:
    def __init__(self, model: nn.Module, backward: bool) -> None:
        self.model = model
        self.backward = backward
        self.named = _named_modules(model)
        self.modules = dict(self.named)
        self.stack: list[str] = []
        self.parent: dict[str, str | None] = {}
        self.last_child: dict[str, str] = {}
        self.saved_inputs: dict[str, tuple[Any, Any]] = {}
        self.saved_grad_out: dict[str, list[torch.Tensor | None]] = {}
        self.grad_out_ok: set[str] = set()
        self.event: _Event | None = None
        self.handles: list[RemovableHandle] = []
        self.enabled = True

    def attach(self) -> None:
        for name, m in self.named:
            self.handles.append(m.register_forward_pre_hook(functools.partial(self.pre, name), with_kwargs=True))
            self.handles.append(m.register_forward_hook(functools.partial(self.post, name), with_kwargs=True))
            for pname, p in m.named_parameters(recurse=False):
                if p.requires_grad:
                    self.handles.append(p.register_hook(functools.partial(self.param_grad, name, pname)))

    def detach(self) -> None:
        self.enabled = False
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def stop(self, event: _Event) -> None:
        if self.event is None:
            self.event = event
        raise _Stop

    # forward
    def pre(self, name: str, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if not self.enabled:
            return None
        parent = self.stack[-1] if self.stack else None
        bad = _nonfinite(floating_tensors((args, kwargs)))
        if bad:
            if parent is None:
                self.stop(_Event("forward", None if name == "" else name, "input", "the model's inputs" if name == ""
                                 else f"inputs of {name!r} called from outside the model", bad, [], None))
            after = self.last_child.get(parent) if parent is not None else None
            where = f"between {after!r} and {name!r}" if after else f"before calling {name!r}"
            self.stop(_Event("forward", parent, "input", where, bad,
                             floating_tensors(self.saved_inputs.get(parent, ((), {}))) if parent is not None else [],
                             parent))
        self.parent[name] = parent
        self.stack.append(name)
        self.saved_inputs[name] = (args, kwargs)
        if not self.backward or not torch.is_grad_enabled():
            return None
        return self._tap((args, kwargs), functools.partial(self.grad_input, name))

    def post(self, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if not self.enabled:
            return None
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        parent = self.parent.get(name)
        if parent is not None:
            self.last_child[parent] = name
        bad = _nonfinite(floating_tensors(output))
        if bad:
            self.stop(_Event("forward", name, "output", "its output", bad, floating_tensors((args, kwargs)), name))
        if not self.backward or not torch.is_grad_enabled():
            return None
        return self._tap(output, functools.partial(self.grad_output, name))

    @staticmethod
    def _tap(obj: Any, callback: Callable[[tuple[torch.Tensor | None, ...]], None]) -> Any:
        tensors = [t for t in floating_tensors(obj) if t.requires_grad]
        unique = list({id(t): t for t in tensors}.values())
        if not unique:
            return None
        copies = _Tap.apply(callback, *unique)
        new = {id(t): c for t, c in zip(unique, copies)}
        return tree_map(lambda t: new.get(id(t), t), obj)

    # backward
    def _incoming(self, name: str | None) -> list[torch.Tensor]:
        return [g for g in self.saved_grad_out.get(name, []) if g is not None] if name is not None else []

    def grad_output(self, name: str, grads: tuple[torch.Tensor | None, ...]) -> None:
        if not self.enabled:
            return
        self.saved_grad_out[name] = list(grads)
        bad = _nonfinite([g for g in grads if g is not None])
        if not bad:
            self.grad_out_ok.add(name)
            return
        parent = self.parent.get(name)
        if name == "" or parent is None:
            self.stop(_Event("backward", None, "grad_output", "the loss function's backward", bad, [], None))
        self.stop(_Event("backward", parent, "grad_output", f"after calling {name!r}", bad,
                         self._incoming(parent), parent))

    def grad_input(self, name: str, grads: tuple[torch.Tensor | None, ...]) -> None:
        if not self.enabled:
            return
        bad = _nonfinite([g for g in grads if g is not None])
        if bad:
            self.stop(_Event("backward", name, "grad_input", "its input gradient", bad,
                             self._incoming(name), name))

    def param_grad(self, name: str, pname: str, grad: torch.Tensor) -> None:
        if not self.enabled or grad is None:
            return
        bad = _nonfinite([grad])
        if bad:
            self.stop(_Event("backward", name, "param_grad", f"parameter {pname!r}", bad,
                             self._incoming(name), name))


# ----- FP32 re-run --------------------------------------------------------------------------------------
def _fp32_copy(module: nn.Module) -> nn.Module:
    m = strip_forward_patches(copy.deepcopy(module))  # cast_module's input/output casts and islands
    for sub in m.modules():  # drop every hook (the tracer's, a user's)
        sub._forward_hooks.clear()
        sub._forward_pre_hooks.clear()
        sub._backward_hooks.clear()
        sub._backward_pre_hooks.clear()
        for attr in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
            d = getattr(sub, attr, None)
            if isinstance(d, dict):
                d.clear()
    m.zero_grad(set_to_none=True)
    for _, sub in fp8_modules(m):  # an FP8 linear re-runs as a plain FP32 linear (F.linear, FP8 off)
        sub.mixprec_fp8_enabled = False  # type: ignore[assignment]
    return m.float()


def _to_fp32(obj: Any, requires_grad: bool) -> Any:
    def conv(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        x = t.detach().float()
        return x.requires_grad_(True) if requires_grad else x
    return tree_map(conv, obj)


def _fp32_truth(model: nn.Module, work: nn.Module, cast_here: bool) -> tuple[dict[int, torch.Tensor], str]:
    """``{id(parameter of work): its full-precision value}`` and where the values come from.

    The cast copy's half weights may already be inf or rounded (a weight of 1e5 in FP16), so the
    FP32 re-run takes each parameter's full-precision value: the uncast model's (``policy=``
    given: ``work`` is its cast copy), or a prepared run's FP32 masters (``*-master``) and
    ``param + compensation`` (``bf16-pure``). Elsewhere nothing: the weights as they are.
    """
    # Names without torch.compile's '_orig_mod.': work may be the compiled model's inner module.
    if cast_here:
        orig = {canonical_name(n): p for n, p in model.named_parameters()}
        return ({id(p): orig[canonical_name(n)].detach() for n, p in work.named_parameters() if canonical_name(n) in orig},
                "the model's FP32 weights")
    prec = run_of(model)
    truth: dict[int, torch.Tensor] = {}
    for opt in getattr(prec, "optimizers", ()) or ():
        if callable(getattr(opt, "master_values", None)):
            truth.update((id(p), v.detach()) for p, v in zip(opt.model_params, opt.master_values()) if p.dtype != v.dtype)
        elif callable(full := getattr(opt, "full_precision_params", None)):
            truth.update((id(p), v) for p, v in full().items() if p.dtype != v.dtype)
    # work may be a copy of model (copy_model=True): its parameters by name
    by_name = {canonical_name(n): truth[id(p)] for n, p in model.named_parameters() if id(p) in truth}
    work_truth = {id(p): by_name[canonical_name(n)] for n, p in work.named_parameters() if canonical_name(n) in by_name}
    return work_truth, ("the run's FP32 masters" if work_truth else "")


def _rerun(ev: _Event, tracer: _Tracer, device_type: str, truth: dict[int, torch.Tensor] | None = None,
           source: str = "") -> FP32Rerun:
    name = ev.rerun
    if name is None or name not in tracer.modules or name not in tracer.saved_inputs:
        return FP32Rerun(None, None, [], None, "not re-run: the values did not come from a module")
    module = tracer.modules[name]
    args, kwargs = tracer.saved_inputs[name]
    try:
        m32 = _fp32_copy(module)
        if truth:
            for p32, p in zip(m32.parameters(), module.parameters()):
                value = truth.get(id(p))
                if value is not None and value.shape == p32.shape:
                    p32.data = value.detach().float().clone()
        with torch.autocast(device_type=device_type, enabled=False):
            if ev.phase == "forward":
                with torch.no_grad():
                    out = m32(*_to_fp32(args, False), **_to_fp32(kwargs, False))
                results = floating_tensors(out)
            else:
                a32, k32 = _to_fp32(args, True), _to_fp32(kwargs, True)
                with torch.enable_grad():
                    out = m32(*a32, **k32)
                    outs = list({id(t): t for t in floating_tensors(out) if t.requires_grad}.values())
                    gouts = tracer.saved_grad_out.get(name)
                    if gouts is None or len(gouts) != len(outs):
                        return FP32Rerun(None, None, [], None, "not re-run: the output gradient was not recorded")
                    pairs = [(o, g.detach().float()) for o, g in zip(outs, gouts) if g is not None]
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                results = [t.grad for t in floating_tensors((a32, k32)) if t.grad is not None]
                results += [p.grad for p in m32.parameters() if p.grad is not None]
    except Exception as e:  # a module that cannot run alone (needs state from its caller)
        return FP32Rerun(None, None, [], None, f"could not re-run {name!r} alone in FP32: {type(e).__name__}: {e}")
    if not results:
        return FP32Rerun(None, None, [], None, "the FP32 re-run produced no floating tensors")
    finite = not _nonfinite(results)
    absmax = max(float(torch.where(torch.isnan(t), 0.0, t.abs()).max()) if t.numel() else 0.0 for t in results)
    exceeds = [d for d in ("f16", "bf16") if absmax > thresholds(d).max]
    fp8 = ", FP8 off" if fp8_modules(module) else ""
    weights = f" ({source})" if source and truth else ""
    return FP32Rerun(finite, absmax, exceeds, finite, f"{name or 'the model'} copied to FP32{weights}, autocast off{fp8}, "
                     "same " + ("inputs" if ev.phase == "forward" else "inputs and output gradient"))


# ----- public entry point ------------------------------------------------------------------------------
def _short_dtype(dtype: torch.dtype) -> str:
    return thresholds(dtype).dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else \
        str(dtype).removeprefix("torch.")


def _stats_name(stats_dtype: str | torch.dtype | None, pol: Policy | None, device_type: str,
                already_fp32: bool) -> str | None:
    """The format the trace's statistics are computed for; ``None``: the failing tensors' own dtype.

    The explicit ``stats_dtype``; else the compute dtype of the format the step really ran in:
    the policy's (the trace runs under it), the enclosing autocast's (it casts the inputs of its
    ops), FP32 for a model that runs in FP32. Otherwise the dtypes the values really had, not a
    prepared run's policy: a model prepared under ``fp16-mixed`` and run outside its autocast
    computes in FP32 (its weights are FP32), one prepared with half weights yields half values,
    and both show in the tensors themselves.

    Args:
        stats_dtype: The caller's choice, or ``None``.
        pol: The policy the trace runs under, or ``None``.
        device_type: The device type whose autocast state counts.
        already_fp32: The step runs in FP32 (no policy, no autocast, FP32 weights, not prepared).

    Returns:
        A short dtype name, or ``None`` to label with the failing tensors' dtype.
    """
    if stats_dtype is not None:
        return thresholds(stats_dtype).dtype
    if pol is not None:
        return thresholds(pol.compute_dtype).dtype
    if already_fp32:
        return "f32"
    if torch.is_autocast_enabled(device_type):
        return _short_dtype(torch.get_autocast_dtype(device_type))
    return None


def _call_model(model: nn.Module, batch: Any) -> Any:
    return model(batch)


def trace_nonfinite(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    policy: Policy | str | None = None,
    *,
    loss_scale: float = 1.0,
    backward: bool = True,
    rerun_fp32: bool = True,
    copy_model: bool = True,
    stats_dtype: str | torch.dtype | None = None,
) -> TraceResult:
    """Run one step and name the first module (forward or backward) whose values became inf or NaN.

    Args:
        model: The model. With ``policy=None`` it runs as it is (call this inside your own
            ``autocast`` region, or on a model prepared by ``MixedPrecision``). A
            ``torch.compile``'d model is traced through the module it wraps (the same
            parameters, run eagerly under the hooks), and modules are named without
            ``_orig_mod.``, as ``name:`` islands match them.
        batch: One batch, as ``loss_fn`` takes it; ``loss_fn`` is then called with that module.
        loss_fn: ``loss_fn(model, batch) -> scalar loss`` (forward included). ``None``: forward
            only, as ``model(batch)``.
        policy: Run under this policy instead (a preset or grammar string): a copy of ``model``
            is cast with :func:`mixprec.cast_module` and run inside :class:`mixprec.autocast`.
            The model itself is never changed.
        loss_scale: Multiply the loss by this before backward (to reproduce a loss-scaled step).
        backward: Also trace the backward pass (needs ``loss_fn``).
        rerun_fp32: Re-run the guilty module in FP32 to say whether precision is the cause.
        copy_model: Trace a deep copy, so parameters, gradients and buffers (BatchNorm
            statistics) of ``model`` stay untouched. ``False`` saves memory; gradients are then
            saved and restored, but buffers do change.
        stats_dtype: Format for the statistics of the failing module's inputs; default: the
            format the step computed in (the policy's compute dtype; without a policy, the
            enclosing autocast's dtype, ``f32`` for a model that runs in FP32, else the failing
            tensors' own dtype: a prepared model traced outside its autocast is labelled with the
            dtypes it really ran in, not its policy's compute dtype).

    Returns:
        :class:`TraceResult`; ``str(result)`` explains it.

    Raises:
        ValueError: ``policy`` given for a model already prepared with ``cast_module``; a
            non-scalar loss.

    Host syncs: one per tensor checked (a diagnostic, not for the training loop).

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> with torch.no_grad():
        ...     _ = m[0].weight.fill_(3e4)
        >>> r = trace_nonfinite(m, torch.ones(2, 4), lambda m, b: m(b).sum(), policy="p=bf16,c=bf16")
        >>> r.found
        False
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"trace_nonfinite needs an nn.Module, got {type(model).__name__}")
    pol = Policy.parse(policy) if policy is not None else None
    if pol is not None and is_prepared(model):
        raise ValueError(
            "this model is already prepared (cast_module / MixedPrecision.prepare): trace it as it is with policy=None "
            "inside prec.autocast(), or pass the FP32 model with policy=..."
        )
    device_type = resolve_device_type(model)
    # Nothing in half precision: an FP32 re-run could only repeat the traced step.
    already_fp32 = (pol is None and not is_prepared(model) and not torch.is_autocast_enabled(device_type)
                    and all(p.dtype == torch.float32 for p in model.parameters() if p.is_floating_point()))
    work = copy.deepcopy(model) if copy_model or pol is not None else model
    if work is not model:
        work.zero_grad(set_to_none=True)
    if pol is not None:
        from ._fp8_plan import apply_fp8  # f8= policies: the chosen linears in FP8, as prepare() converts them

        apply_fp8(work, pol, batch, loss_fn)
        cast_module(work, pol)
    # A torch.compile'd model: trace the module it wraps (the same parameters, and cast_module's hooks sit
    # there too). Eager hooks then need no graph breaks (each check reads a bool back, which dynamo cannot
    # trace), and module names come without '_orig_mod.', as policies' name: islands match them.
    traced = _compile_target(work)
    stats_name = _stats_name(stats_dtype, pol, device_type, already_fp32)
    do_backward = backward and loss_fn is not None

    if do_backward and torch.is_inference_mode_enabled():
        raise ValueError("trace_nonfinite under torch.inference_mode() cannot run its backward (no graph is recorded "
                         "there); call it outside inference_mode, or pass backward=False for the forward only.")
    saved_grads = None
    if not copy_model and pol is None:
        saved_grads = [(p, p.grad) for p in traced.parameters()]
        # A live master-weight run's FP32 master gradients too: its accumulation hooks run in the trace's backward.
        run = run_of(model)
        saved_grads += [(m, m.grad) for opt in getattr(run, "optimizers", ()) or ()
                        for m in getattr(opt, "masters", ()) if m.grad is not None]
        for p, _ in saved_grads:
            p.grad = None

    tracer = _Tracer(traced, do_backward)
    tracer.attach()
    loss_value: float | None = None
    region = autocast(pol, device_type) if pol is not None else contextlib.nullcontext()
    try:
        try:
            # (gradients on even when called under torch.no_grad(): the backward is part of the trace)
            with region, (torch.enable_grad() if do_backward else contextlib.nullcontext()):
                out = loss_fn(traced, batch) if loss_fn is not None else _call_model(traced, batch)
            if loss_fn is not None:
                if not isinstance(out, torch.Tensor) or out.numel() != 1:
                    raise ValueError(f"loss_fn must return a scalar tensor, got {type(out).__name__} "
                                     f"{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}")
                loss_value = float(out.detach().float())
                if not math.isfinite(loss_value):
                    tracer.stop(_Event("forward", None, "loss", "the loss function", [out.detach()], [], None))
                if do_backward:
                    with torch.enable_grad():  # (the scaling multiply too, under a caller's no_grad)
                        (out.float() * loss_scale).backward()
        except _Stop:
            pass
    finally:
        tracer.detach()
        if saved_grads is not None:
            for p, g in saved_grads:
                p.grad = g

    ev = tracer.event
    pol_str = str(pol) if pol is not None else None
    if ev is None:
        return TraceResult(found=False, loss=loss_value, policy=pol_str, loss_scale=loss_scale,
                           stats_dtype=stats_name or "f32")
    if stats_name is None:  # the dtype the failing step's values really had
        stats_name = _short_dtype(next((t.dtype for t in [*ev.incoming, *ev.bad] if t.is_floating_point()), torch.float32))
    module = ev.module
    mtype = type(tracer.modules[module]).__name__ if module is not None and module in tracer.modules else None
    rerun = None
    if rerun_fp32 and ev.rerun is not None:
        if already_fp32:
            rerun = FP32Rerun(None, None, [], False, "not re-run: the traced step already ran in FP32 (FP32 weights, no "
                              "policy, autocast off), so precision is not the cause")
        else:
            truth, source = _fp32_truth(model, traced, pol is not None)
            rerun = _rerun(ev, tracer, device_type, truth, source)
    return TraceResult(
        found=True, phase=ev.phase, module=module, module_type=mtype, where=ev.where, detail=ev.detail,
        kind=_kind(ev.bad), input_stats=[tensor_stats(t, stats_name) for t in ev.incoming],
        output_stats=[tensor_stats(t, stats_name) for t in ev.bad], stats_dtype=stats_name, fp32_rerun=rerun,
        loss=loss_value, policy=pol_str, loss_scale=loss_scale,
    )
