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
from .._casting import (
    _compile_target,
    _island_forward,
    _root_forward,
    cast_module,
    is_prepared,
    run_of,
    strip_forward_patches,
)
from .._checkpoint import canonical_name
from .._fp8 import fp8_modules
from .._policy import Policy
from .._tree import floating_tensors, tree_map
from ._findings import jsonable
from ._stats import TensorStats, stored_values, tensor_stats, thresholds

__all__ = ["FP32Rerun", "TraceResult", "trace_nonfinite"]

Phase = Literal["forward", "backward"]
Where = Literal["input", "output", "grad_input", "grad_output", "param_grad", "loss"]


@dataclasses.dataclass(frozen=True)
class FP32Rerun:
    """The guilty module re-run in FP32 on the same inputs.

    Attributes:
        finite: The FP32 result has no inf/NaN.
        absmax: Its largest magnitude (of the outputs in forward, of the input and parameter
            gradients in backward; of the FP32 values where the traced step had inf/NaN when
            ``looked_at`` names a submodule's inputs).
        exceeds: The formats (``"f16"``, ``"bf16"``) whose maximum ``absmax`` exceeds.
        precision_is_cause: ``True`` when FP32 is finite (the low precision made the inf/NaN),
            ``False`` when FP32 fails too (a bug, bad data or a diverged model), ``None`` when
            the re-run could not be made.
        note: How it was run, or why not.
        looked_at: What the re-run compared, when not the module's own result: for inf/NaN made
            by the module's own code before it called a submodule (``TraceResult.where ==
            "input"``), ``"the inputs of '<submodule>'"``. The FP32 re-run then looks at that same
            value, not at the module's output (a finite output proves nothing about a value
            handed to a submodule: a ``-inf`` attention mask yields finite outputs). There,
            ``precision_is_cause`` is ``True`` when some element that was inf/NaN in the traced
            step is finite in FP32, ``False`` when every one of them is inf/NaN in FP32 too.
        fp32_kind: When ``looked_at`` is set: the non-finite values FP32 has there too
            (``"-inf"``, ``"inf"``, ``"nan"``, ``"inf and nan"``; ``""``: none).
        output_absmax: When ``looked_at`` is set: the largest magnitude of the module's own FP32
            output (``inf`` when it is not finite), to tell whether an FP32 island around the
            module, which hands its outputs back in the compute dtype, can help.
    """

    finite: bool | None
    absmax: float | None
    exceeds: list[str]
    precision_is_cause: bool | None
    note: str
    looked_at: str = ""
    fp32_kind: str = ""
    output_absmax: float | None = None


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
        callee: For ``where="input"``: the submodule whose inputs held the inf/NaN (the value the
            module's own code handed to it).
        callee_island: ``callee`` is an FP32 island of the run: it takes its inputs in FP32 and
            computes in FP32, so a value beyond FP16's range overflows only where it was made.
        compute_dtype: The format the traced step computed in (``"bf16"``, ``"f16"``, ``"f32"``):
            the policy's compute dtype, the enclosing autocast's, else the dtype of the failing
            values. Advice never suggests the format the step already computed in.
        nonfinite_state: Parameters and buffers of the model that already held inf/NaN before
            the step (``"parameter '2.weight' (nan)"``): an earlier bad update or a corrupted
            checkpoint, not this step, put them there. Every non-finite parameter is named; a
            buffer holding NaN always, one holding only ``±inf`` (an attention mask can) only
            when it belongs to the module blamed (or the root's code is blamed).
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
    callee: str | None = None
    callee_island: bool = False
    compute_dtype: str | None = None
    nonfinite_state: list[str] = dataclasses.field(default_factory=list)

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
        if self.nonfinite_state:
            held = ", ".join(self.nonfinite_state[:5]) + (", ..." if len(self.nonfinite_state) > 5 else "")
            parts.append(f"The model already held inf/NaN before this step: {held}. An earlier update, the code that set it, or a corrupted "
                         "checkpoint put it there, not this step's precision: find the step that made it, and reload a "
                         "finite checkpoint.")
        if self.input_stats:
            amax = max(s.absmax for s in self.input_stats)
            what = "inputs" if self.phase == "forward" else "incoming gradient"
            parts.append(f"Its {what}: absmax {amax:.4g} in {self.stats_dtype}.")
        r = self.fp32_rerun
        if r is not None:
            at = f" ({r.looked_at})" if r.looked_at else ""
            if r.precision_is_cause:
                ex = f", largest value {r.absmax:.4g}" + (f" > the {'/'.join(r.exceeds)} maximum" if r.exceeds else "")
                if r.finite is False:  # a value looked at: some of its inf/NaN are there in FP32 too
                    parts.append(f"Re-run in FP32{at}: the {r.fp32_kind} is there in FP32 too, but the other inf/NaN "
                                 f"values are finite{ex}: precision is the cause.")
                else:
                    parts.append(f"Re-run in FP32{at}: finite{ex}: precision is the cause.")
            elif r.precision_is_cause is False and r.looked_at:
                why = ("a -inf put there on purpose, such as an additive attention mask, is no problem; otherwise check "
                       "the inputs, the data, the learning rate" if r.fp32_kind == "-inf" else
                       "check the inputs, the data, the learning rate")
                parts.append(f"Re-run in FP32{at}: the same {r.fp32_kind or self.kind} is there in FP32 too: not a "
                             f"precision problem ({why}).")
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

    def _run_exceeds(self) -> list[str]:
        """The formats of :attr:`FP32Rerun.exceeds` the traced step computed in (all of them when that is unknown).

        A value beyond FP16's maximum is no overflow in a BF16 step: only the format the step
        computed in counts for the advice.
        """
        r = self.fp32_rerun
        if r is None:
            return []
        if self.compute_dtype in ("f16", "bf16"):
            return [d for d in r.exceeds if d == self.compute_dtype]
        return list(r.exceeds)

    @property
    def output_exceeds_range(self) -> bool:
        """Whether the guilty module's forward output itself lies beyond the compute format's range.

        ``True`` when the FP32 re-run of a forward output was finite but larger than the maximum of
        the half format the step computed in (:attr:`FP32Rerun.exceeds`): the value, not an
        intermediate, overflows, so an FP32 island cannot help (an island computes in FP32 inside but
        hands its outputs back in the compute dtype, ``mixprec._casting._island_forward``).
        """
        r = self.fp32_rerun
        return bool(self.phase == "forward" and self.where == "output" and r is not None and r.precision_is_cause
                    and self._run_exceeds())

    @property
    def value_exceeds_range(self) -> bool:
        """Whether a value the module's own code handed to a submodule (``where="input"``) lies beyond the compute format's range in FP32 too.

        ``True`` when the FP32 re-run found the value finite where the traced step had inf/NaN, but
        larger than the maximum of the half format the step computed in, and the submodule computes
        in that format (it is no FP32 island, :attr:`callee_island`): running that code in FP32
        (``mixprec.autocast.fp32()``) still hands the submodule a value it computes on in that
        format, so it overflows there again.
        """
        r = self.fp32_rerun
        return bool(self.phase == "forward" and self.where == "input" and r is not None and r.looked_at
                    and r.precision_is_cause and self._run_exceeds() and not self.callee_island)

    @property
    def advice(self) -> str:
        """What to do when precision is the cause (``""`` otherwise): the last sentence of :attr:`explanation`.

        An FP32 island is advised only where it can help: an overflow inside the module (an
        intermediate, finite again in its output) or in its backward. When the module's output
        itself exceeds the format's range (:attr:`output_exceeds_range`), the island would hand the
        same value back in FP16, so the advice is BF16 (FP32's exponent range) or rescaling. The
        same holds for a value the module's own code hands to a submodule
        (:attr:`value_exceeds_range`): an FP32 region around that code (the root's own code) cannot
        help, and an island around the module only when its FP32 output fits. BF16 is never advised
        to a step that computed in BF16 already.
        """
        r = self.fp32_rerun
        if r is None or not r.precision_is_cause:
            return ""
        use_bf16 = self.compute_dtype != "bf16"
        bf16 = "use bf16, " if use_bf16 else ""
        if self.module is not None and self.output_exceeds_range and self.module_type != "MixprecFloat8Linear":
            fmt, limit = self._format_limit()
            name = "the model" if self.module == "" else repr(self.module)
            rescale = ("e.g. smaller weights in it, or a normalization after it" if self.module
                       else "e.g. a normalization before the last operation")
            return (f"The output of {name} itself exceeds the {fmt} maximum ({limit}; {r.absmax:.4g} in FP32), so an "
                    f"FP32 island would not help: an island computes in FP32 inside but hands its outputs back in the "
                    f"compute dtype. {self._bf16_or(f'rescale the computation so the output fits ({rescale}).')}")
        if self.module is not None and self.value_exceeds_range:
            fmt, limit = self._format_limit()
            callee = repr(self.callee) if self.callee else "its submodule"
            value = f"exceeds the {fmt} maximum ({limit}; {r.absmax:.4g} in FP32)"
            rescale = f"rescale the computation so the value fits (e.g. a normalization before {callee})."
            if self.module == "":
                return (f"The value the model's own code hands to {callee} itself {value}, so running that code in FP32 "
                        f"(mixprec.autocast.fp32()) would not help: {callee} computes in {fmt} and meets the same value. "
                        f"{self._bf16_or(rescale)}")
            out_fits = r.output_absmax is not None and all(r.output_absmax <= thresholds(d).max for d in self._run_exceeds())
            if not out_fits:
                out = "" if r.output_absmax is None else f" ({r.output_absmax:.4g} in FP32)"
                return (f"The value {self.module!r} hands to {callee} itself {value}, and so does the output of "
                        f"{self.module!r}{out}, so an FP32 island would not help: an island computes in FP32 inside but "
                        f"hands its outputs back in the compute dtype. {self._bf16_or(rescale)}")
            return (f"Keep it in FP32 (policy island i=norm+name:{self.module}: {callee} then computes in FP32 inside "
                    f"it, and the output of {self.module!r} fits {fmt}), {bf16}or {rescale}")
        if self.module and self.module_type == "MixprecFloat8Linear":
            return (f"{self.module!r} runs its GEMMs in FP8 (f8=): leave it out with f8_layers=auto "
                    f"(mixprec.numerics.fp8_plan measures each layer) or globs that skip it, or make it an "
                    f"FP32 island (i=norm+name:{self.module}).")
        if self.module:
            fix = "lower the loss scale" if self.phase == "backward" and self.loss_scale > 1 else "rescale the computation"
            return f"Keep it in FP32 (policy island i=norm+name:{self.module}), {bf16}or {fix}."
        if self.module == "":
            find = "find the overflowing operation in the model's forward and run it in FP32 (mixprec.autocast.fp32())."
            return f"Use bf16, or {find}" if use_bf16 else find[0].upper() + find[1:]
        return ""

    @property
    def recommended_island(self) -> str | None:
        """The FP32 island :attr:`advice` recommends, as a policy ``i=`` entry (``"name:<module>"``), or ``None``.

        ``None`` when the advice keeps no module in FP32 (precision is not the cause, the module's
        output itself exceeds the format's range, or the culprit is the root's own code).
        """
        if self.module and f"i=norm+name:{self.module}" in self.advice:
            return f"name:{self.module}"
        return None

    def _format_limit(self) -> tuple[str, str]:
        """(``"f16"``, ``"65504"``): the exceeded formats of the traced step and their maxima, for the advice."""
        exceeded = self._run_exceeds()
        return "/".join(exceeded), " and ".join(f"{thresholds(d).max:.6g}" for d in exceeded)

    def _bf16_or(self, rest: str) -> str:
        """``"Use bf16 (...), or <rest>"``; just ``rest`` (capitalised) when the step computed in BF16 already."""
        if self.compute_dtype == "bf16":
            return rest[0].upper() + rest[1:]
        return f"Use bf16 (the range of FP32, no loss scaling), or {rest}"

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
    # (a sparse gradient, nn.Embedding(sparse=True): its stored values; isfinite has no sparse kernel)
    return [t for t in tensors if t.is_floating_point() and not bool(torch.isfinite(stored_values(t)).all())]


def _kind(tensors: list[torch.Tensor]) -> str:
    has_nan = any(bool(torch.isnan(stored_values(t)).any()) for t in tensors)
    has_inf = any(bool(torch.isinf(stored_values(t)).any()) for t in tensors)
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
    # where="input" (made by the module's own code): the submodule it handed the values to, which of that
    # submodule's calls within this call of the module it was (0: the first), all the floating tensors of that
    # call's inputs (to compare element by element in the FP32 re-run), and whether gradients were on then.
    callee: str | None = None
    callee_call: int = 0
    callee_inputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    grad_enabled: bool = True


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
        # module (None: called from outside the model) -> {submodule: calls so far in its current call}
        self.calls: dict[str | None, dict[str, int]] = {}
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
        calls = self.calls.setdefault(parent, {})
        inputs = floating_tensors((args, kwargs))
        bad = _nonfinite(inputs)
        if bad:
            if parent is None:
                self.stop(_Event("forward", None if name == "" else name, "input", "the model's inputs" if name == ""
                                 else f"inputs of {name!r} called from outside the model", bad, [], None))
            after = self.last_child.get(parent) if parent is not None else None
            where = f"between {after!r} and {name!r}" if after else f"before calling {name!r}"
            self.stop(_Event("forward", parent, "input", where, bad,
                             floating_tensors(self.saved_inputs.get(parent, ((), {}))) if parent is not None else [],
                             parent, callee=name, callee_call=calls.get(name, 0), callee_inputs=inputs,
                             grad_enabled=torch.is_grad_enabled()))
        calls[name] = calls.get(name, 0) + 1
        self.calls[name] = {}  # a new call of this module: its own submodule calls count from 0
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
def _fp32_copy(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """An FP32 copy of ``module`` without hooks or mixprec patches; ``memo`` receives ``deepcopy``'s map (id -> copy)."""
    m = strip_forward_patches(copy.deepcopy(module, memo))  # cast_module's input/output casts and islands
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


def _absmax(t: torch.Tensor) -> float:
    """Largest magnitude of ``t`` (a sparse one's stored values), ignoring NaN; ``inf`` for an infinity, 0.0 when empty."""
    v = stored_values(t.detach())
    return float(torch.where(torch.isnan(v), 0.0, v.abs()).max()) if v.numel() else 0.0


def _fp32_module(module: nn.Module, truth: dict[int, torch.Tensor] | None, memo: dict[int, Any] | None = None) -> nn.Module:
    """:func:`_fp32_copy` of ``module`` with each parameter's full-precision value from ``truth``."""
    m32 = _fp32_copy(module, memo)
    if truth:
        for p32, p in zip(m32.parameters(), module.parameters()):
            value = truth.get(id(p))
            if value is not None and value.shape == p32.shape:
                p32.data = value.detach().float().clone()
    return m32


def _rerun(ev: _Event, tracer: _Tracer, device_type: str, truth: dict[int, torch.Tensor] | None = None,
           source: str = "") -> FP32Rerun:
    name = ev.rerun
    if name is None or name not in tracer.modules or name not in tracer.saved_inputs:
        return FP32Rerun(None, None, [], None, "not re-run: the values did not come from a module")
    if ev.phase == "forward" and ev.where == "input" and ev.callee is not None:
        return _rerun_callee_input(ev, name, tracer, device_type, truth, source)
    module = tracer.modules[name]
    args, kwargs = tracer.saved_inputs[name]
    try:
        m32 = _fp32_module(module, truth)
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
    absmax = max(_absmax(t) for t in results)
    exceeds = [d for d in ("f16", "bf16") if absmax > thresholds(d).max]
    return FP32Rerun(finite, absmax, exceeds, finite, f"{_how(name, module, truth, source)}, "
                     "same " + ("inputs" if ev.phase == "forward" else "inputs and output gradient"))


def _how(name: str, module: nn.Module, truth: dict[int, torch.Tensor] | None, source: str) -> str:
    fp8 = ", FP8 off" if fp8_modules(module) else ""
    weights = f" ({source})" if source and truth else ""
    return f"{name or 'the model'} copied to FP32{weights}, autocast off{fp8}"


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to_dense() if t.layout != torch.strided else t.detach()


def _rerun_callee_input(ev: _Event, name: str, tracer: _Tracer, device_type: str,
                        truth: dict[int, torch.Tensor] | None, source: str) -> FP32Rerun:
    """Re-run module ``name`` in FP32 and look at the value its own code handed to ``ev.callee``.

    The inf/NaN was made in the module's own code, between its submodule calls, and found in
    the inputs of ``ev.callee``: that value is what the FP32 re-run must look at. The module's
    FP32 output says nothing about it (a ``-inf`` additive attention mask, which
    ``nn.TransformerEncoder`` builds from ``src_key_padding_mask`` in its own code, yields finite
    outputs), so a pre-hook on the copy of ``ev.callee`` takes its inputs at the same call, and the
    two are compared element by element: precision is the cause when an element that was inf/NaN
    in the traced step is finite in FP32; an inf/NaN that is there in FP32 too (the mask) is not
    the precision's doing. The re-run keeps the traced step's gradient mode: torch's Transformer
    modules take other code paths without gradients (nested tensors, which drop the mask).
    """
    module = tracer.modules[name]
    args, kwargs = tracer.saved_inputs[name]
    looked_at = f"the inputs of {ev.callee!r}"
    memo: dict[int, Any] = {}
    captured: list[list[torch.Tensor]] = []
    calls = 0

    def grab(mod: nn.Module, a: Any, k: Any) -> None:
        nonlocal calls
        if calls == ev.callee_call:
            captured.append([t.detach() for t in floating_tensors((a, k))])
        calls += 1

    try:
        m32 = _fp32_module(module, truth, memo)
        callee = tracer.modules.get(ev.callee or "")
        c32 = memo.get(id(callee)) if callee is not None else None
        if not isinstance(c32, nn.Module):
            return FP32Rerun(None, None, [], None, f"not re-run: {ev.callee!r} is not part of {name or 'the model'!r}, so "
                             "its inputs could not be looked at in FP32", looked_at)
        handle = c32.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.autocast(device_type=device_type, enabled=False), torch.set_grad_enabled(ev.grad_enabled):
                out = m32(*_to_fp32(args, False), **_to_fp32(kwargs, False))
        finally:
            handle.remove()
    except Exception as e:  # a module that cannot run alone (needs state from its caller)
        return FP32Rerun(None, None, [], None, f"could not re-run {name!r} alone in FP32: {type(e).__name__}: {e}",
                         looked_at)
    how = f"{_how(name, module, truth, source)}, same inputs; {looked_at} compared (call {ev.callee_call + 1})"
    if not captured:
        return FP32Rerun(None, None, [], None, f"could not look at {looked_at} in FP32: {name or 'the model'} called it "
                         f"{calls} time(s) there, the traced step {ev.callee_call + 1}", looked_at)
    got = captured[0]
    outs = floating_tensors(out)
    out_absmax = max((_absmax(t) for t in outs), default=0.0)
    finite = not _nonfinite(got)
    low, f32 = [_dense(t) for t in ev.callee_inputs], [_dense(t) for t in got]
    if len(low) == len(f32) and all(a.shape == b.shape for a, b in zip(low, f32)):
        # element by element: FP32's values where the traced step had inf/NaN
        made, kept = [], []
        for a, b in zip(low, f32):
            bad = ~torch.isfinite(a.float() if a.dtype.itemsize == 1 else a)  # (FP8: no isfinite everywhere)
            if bool(bad.any()):
                fin = torch.isfinite(b)
                made.append(b[bad & fin])
                kept.append(b[bad & ~fin])
        precision = any(t.numel() for t in made)
    else:  # the call's inputs differ in number or shape in FP32: the value as a whole
        precision = finite
        made = [t[torch.isfinite(t)] for t in f32]
        kept = [t[~torch.isfinite(t)] for t in f32]
    kept = [t for t in kept if t.numel()]
    # the overflowing values when precision made them; else what FP32 has there (inf for a -inf mask)
    absmax = max((_absmax(t) for t in (made if precision else kept)), default=0.0)
    fp32_kind = ("" if not kept else "-inf" if all(bool((t == -math.inf).all()) for t in kept) else _kind(kept))
    exceeds = [d for d in ("f16", "bf16") if absmax > thresholds(d).max]
    return FP32Rerun(finite, absmax, exceeds, precision, how, looked_at, fp32_kind, out_absmax)


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


def _is_island(module: nn.Module | None) -> bool:
    """Whether ``module`` runs as an FP32 island (``cast_module`` installed its island forward, maybe under the root's)."""
    fwd = module.__dict__.get("forward") if module is not None else None
    while isinstance(fwd, functools.partial) and fwd.func in (_island_forward, _root_forward):
        if fwd.func is _island_forward:
            return True
        fwd = fwd.args[1]  # the forward the patch wraps (partial(function, module, previous, ...))
    return False


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

    The global RNG (CPU, and CUDA on the devices the model uses) is left as it was found: the
    traced step draws from it (dropout) as a training step would, then it is restored, so a run
    that traces a batch continues exactly as one that did not (as :func:`check` does).

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
    cuda = {t.device for t in [*model.parameters(), *model.buffers()] if t.device.type == "cuda"}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda.add(torch.device("cuda", torch.cuda.current_device()))
    devices = sorted({d.index if d.index is not None else torch.cuda.current_device() for d in cuda})
    with torch.random.fork_rng(devices=devices):
        return _trace(model, batch, loss_fn, policy, loss_scale=loss_scale, backward=backward, rerun_fp32=rerun_fp32,
                      copy_model=copy_model, stats_dtype=stats_dtype)


def _nonfinite_state(model: nn.Module) -> list[tuple[str, str, str]]:
    """``(kind, name, what)`` for each floating parameter and buffer of ``model`` holding inf/NaN.

    ``kind`` is ``"parameter"`` or ``"buffer"``, ``what`` ``"nan"``, ``"inf"`` or ``"inf and nan"``.
    Host syncs: two per tensor (a diagnostic).
    """
    target = _compile_target(model)
    out = []
    for kind, named in (("parameter", target.named_parameters()), ("buffer", target.named_buffers())):
        for n, t in named:
            if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
                continue
            v = t.detach()
            if v.layout != torch.strided:
                v = v.to_dense()
            nan = bool(torch.isnan(v).any())
            inf = bool(torch.isinf(v).any())
            if nan or inf:
                out.append((kind, n, "inf and nan" if nan and inf else ("nan" if nan else "inf")))
    return out


def _trace(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
           policy: Policy | str | None, *, loss_scale: float, backward: bool, rerun_fp32: bool, copy_model: bool,
           stats_dtype: str | torch.dtype | None) -> TraceResult:
    """:func:`trace_nonfinite`'s body, run inside its fork of the RNG."""
    pol = Policy.parse(policy) if policy is not None else None
    state = _nonfinite_state(model)  # before any cast (FP16 casting can make inf of large finite weights)
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
    compute_name = _stats_name(None, pol, device_type, already_fp32)
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
                           stats_dtype=stats_name or "f32", compute_dtype=compute_name)
    # the dtype the failing step's values really had
    real = _short_dtype(next((t.dtype for t in [*ev.incoming, *ev.bad] if t.is_floating_point()), torch.float32))
    stats_name = stats_name or real
    compute_name = compute_name or real
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
    # buffers with only ±inf can be masks on purpose: named only where the blame falls (the module, or the root's code)
    held = [f"{kind} {n!r} ({what})" for kind, n, what in state
            if kind == "parameter" or "nan" in what or module == ""
            or (module is not None and n.startswith(f"{module}."))]
    return TraceResult(
        nonfinite_state=held, found=True, phase=ev.phase, module=module, module_type=mtype, where=ev.where, detail=ev.detail,
        kind=_kind(ev.bad), input_stats=[tensor_stats(t, stats_name) for t in ev.incoming],
        output_stats=[tensor_stats(t, stats_name) for t in ev.bad], stats_dtype=stats_name, fp32_rerun=rerun,
        loss=loss_value, policy=pol_str, loss_scale=loss_scale, callee=ev.callee,
        callee_island=ev.callee is not None and _is_island(tracer.modules.get(ev.callee)), compute_dtype=compute_name,
    )
