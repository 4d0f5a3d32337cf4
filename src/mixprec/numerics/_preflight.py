"""Pre-flight check: one forward and backward of the user's model in FP32 and under a policy, compared.

Like Ultralytics' ``check_amp`` for YOLO, but for any model and offline: the model is
deep-copied twice, one copy runs in FP32 (autocast off, TF32 off), the other is cast with
:func:`mixprec.cast_module` and runs under :class:`mixprec.autocast`; both see the same batch
and the same random seed, with dropout switched off (``dropout=True`` keeps it). The loss, the model's outputs and every
parameter gradient are compared (relative error and SQNR in dB), together with the device's
support for the compute dtype, and a verdict with reasons comes back. The check never changes
the model or the user's precision; acting on the verdict is the caller's decision.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from .._autocast import autocast, resolve_device_type, tf32
from .._casting import cast_module, is_prepared, uncast_module
from .._dtypes import device_supports, dtype_name
from .._errors import NumericsError
from .._fp8 import revert_linears
from .._policy import DYNAMIC_SCALE_RANGE, Policy
from .._tree import tree_leaves
from ._findings import format_table, jsonable, print_tables
from ._fp8_plan import apply_fp8
from ._tracer import TraceResult, trace_nonfinite

__all__ = ["CheckResult", "CheckThresholds", "ParamComparison", "check", "preflight"]

Verdict = Literal["pass", "warn", "fail"]


@dataclasses.dataclass(frozen=True)
class CheckThresholds:
    """Limits for the pre-flight verdict (a ``warn`` limit and a ``fail`` limit for each measure).

    The defaults were set on small models on a CPU, where BF16 autocast also keeps softmax and
    layer norm in BF16 (harsher than CUDA autocast). Measured with ``mixprec check``: the ``gpt``
    workload 48.5 dB output / 51.0 dB gradient SQNR under bf16-mixed, 66.5 / 69.7 dB under
    fp16-mixed; the ``cnn`` workload 46.9 / 25.4 dB (bf16-mixed) and 65.2 / 36.0 dB (fp16-mixed);
    a small nn.TransformerEncoder LM 48.6 / 36.0 dB (bf16-mixed). The limits sit well below, so
    ``fail`` means something is broken (inf/NaN, underflow, a loss off by 20%), not "BF16 is noisy".

    Attributes:
        loss_rel_warn / loss_rel_fail: Relative error of the loss.
        output_sqnr_warn_db / output_sqnr_fail_db: SQNR of the model's outputs (all floating
            outputs together) against FP32; below the limit is bad.
        grad_sqnr_warn_db / grad_sqnr_fail_db: SQNR of all parameter gradients together.
        grad_lost_warn / grad_lost_fail: Fraction of gradient elements that are non-zero in
            FP32 but zero under the policy (underflow).
    """

    loss_rel_warn: float = 0.02
    loss_rel_fail: float = 0.2
    output_sqnr_warn_db: float = 15.0
    output_sqnr_fail_db: float = 6.0
    grad_sqnr_warn_db: float = 10.0
    grad_sqnr_fail_db: float = 3.0
    grad_lost_warn: float = 0.01
    grad_lost_fail: float = 0.1


@dataclasses.dataclass(frozen=True)
class ParamComparison:
    """One parameter's gradient under the policy against FP32.

    Attributes:
        name: Qualified parameter name.
        dtype: The parameter's dtype under the policy.
        grad_dtype: Its gradient's dtype under the policy (``None``: no gradient).
        rel_err: ``||g_policy - g_fp32|| / ||g_fp32||`` (``inf`` when FP32's is zero and the policy's not).
        sqnr_db: ``10 log10(||g_fp32||^2 / ||g_policy - g_fp32||^2)`` (``inf``: identical).
        lost: Fraction of the non-zero FP32 gradient elements that are zero under the policy.
        finite: The policy's gradient has no inf/NaN.
    """

    name: str
    dtype: str
    grad_dtype: str | None
    rel_err: float
    sqnr_db: float
    lost: float
    finite: bool


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """The pre-flight verdict and the measurements behind it.

    Attributes:
        verdict: ``"pass"``, ``"warn"`` (usable, with the caveats in ``reasons``) or ``"fail"``.
        reasons: Why, one sentence each (empty for a clean pass).
        notes: Information that did not affect the verdict (e.g. FP16 on a CPU is slow).
        policy: The policy checked (grammar string).
        device: Where it ran.
        loss_fp32 / loss_policy / loss_rel_err: The losses and their relative difference.
        output_rel_err / output_sqnr_db: The model outputs against FP32.
        grad_rel_err / grad_sqnr_db / grad_lost: All parameter gradients against FP32
            (``None`` without backward).
        loss_scale: The loss scale the policy run used (after ``backoffs`` halvings for dynamic scaling).
        backoffs: How often the scale was halved because gradients overflowed (as a dynamic scaler would).
        finite: Loss, outputs and gradients under the policy were finite.
        params: Per-parameter comparisons, worst SQNR first.
        trace: Where inf/NaN first appeared under the policy (when it did).
        thresholds: The limits used.
    """

    verdict: Verdict
    reasons: list[str]
    notes: list[str]
    policy: str
    device: str
    loss_fp32: float | None
    loss_policy: float | None
    loss_rel_err: float | None
    output_rel_err: float | None
    output_sqnr_db: float | None
    grad_rel_err: float | None
    grad_sqnr_db: float | None
    grad_lost: float | None
    loss_scale: float
    backoffs: int
    finite: bool
    params: list[ParamComparison]
    trace: TraceResult | None
    thresholds: CheckThresholds

    @property
    def ok(self) -> bool:
        """``verdict != "fail"``."""
        return self.verdict != "fail"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (schema ``mixprec.check/1``; inf/NaN as null)."""
        d = jsonable(self)
        d["trace"] = self.trace.to_dict() if self.trace is not None else None
        d["schema"] = "mixprec.check/1"
        return d

    def summary_lines(self) -> list[str]:
        """Verdict, measurements and reasons as text lines."""
        name = Policy.parse(self.policy).name or self.policy
        lines = [f"mixprec check: {name} on {self.device}: {self.verdict.upper()}"]

        def f(x: float | None, fmt: str) -> str:
            return "-" if x is None else ("inf" if x == math.inf else format(x, fmt))

        lines.append(
            f"  loss {f(self.loss_policy, '.6g')} vs FP32 {f(self.loss_fp32, '.6g')} (rel. err {f(self.loss_rel_err, '.2e')}); "
            f"outputs SQNR {f(self.output_sqnr_db, '.1f')} dB (rel. err {f(self.output_rel_err, '.2e')})"
        )
        if self.grad_sqnr_db is not None or self.grad_rel_err is not None:
            lines.append(
                f"  gradients SQNR {f(self.grad_sqnr_db, '.1f')} dB (rel. err {f(self.grad_rel_err, '.2e')}), "
                f"{f(None if self.grad_lost is None else 100 * self.grad_lost, '.2f')}% lost to underflow; loss scale "
                f"{self.loss_scale:g}" + (f" after {self.backoffs} backoff(s)" if self.backoffs else "")
            )
        lines += [f"  - {r}" for r in self.reasons]
        lines += [f"  note: {n}" for n in self.notes]
        if self.trace is not None and self.trace.found:
            lines.append(f"  trace: {self.trace.explanation}")
        return lines

    def param_table(self, top: int = 10) -> tuple[str, list[str], list[list[str]]]:
        """``(title, headers, rows)`` of the ``top`` worst parameter gradients."""
        rows = [[p.name, p.dtype, p.grad_dtype or "-", f"{p.sqnr_db:.1f}" if math.isfinite(p.sqnr_db) else "inf",
                 f"{p.rel_err:.2e}" if math.isfinite(p.rel_err) else str(p.rel_err), f"{100 * p.lost:.2f}%",
                 "yes" if p.finite else "NO"] for p in self.params[:top]]
        return (f"Worst parameter gradients under the policy ({min(top, len(self.params))} of {len(self.params)})",
                ["parameter", "dtype", "grad dtype", "SQNR dB", "rel. err", "lost", "finite"], rows)

    def table(self, top: int = 10) -> str:
        """Plain-text rendering: summary and the worst parameters."""
        t, h, r = self.param_table(top)
        return "\n".join(self.summary_lines()) + ("\n\n" + format_table(h, r, t) if r else "")

    def print(self, file: Any = None, top: int = 10, use_rich: bool | None = None) -> None:
        """Print with rich when installed."""
        tables = [self.param_table(top)] if self.params else []
        print_tables(tables, (), file=file, use_rich=use_rich, header=self.summary_lines())

    def __str__(self) -> str:
        return "\n".join(self.summary_lines())


# ----- helpers ----------------------------------------------------------------------------------------------
def _fp32_base(model: nn.Module, keep_dropout: bool = True) -> nn.Module:
    base = revert_linears(copy.deepcopy(model))  # FP8 linears (f8= policies) back to nn.Linear
    if is_prepared(base):
        uncast_module(base)
    base.zero_grad(set_to_none=True)
    if not keep_dropout:
        _disable_dropout(base)
    return base.float()


def _disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to 0: ``nn.Dropout*`` modules and float ``*dropout*`` attributes.

    The attributes cover modules that pass a probability to a fused kernel themselves
    (``nn.MultiheadAttention.dropout``, Hugging Face attention's ``attention_dropout``).
    """
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for k, v in vars(m).items():
            if "dropout" in k.lower() and isinstance(v, float):
                setattr(m, k, 0.0)


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _real64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a dense real float64 tensor, to compare element by element against FP32's.

    A sparse gradient (``nn.Embedding(sparse=True)``) is densified: elementwise ops such as
    ``isfinite`` and ``reshape`` have no sparse kernels, and the rows a batch did not touch are
    zeros in both runs, as they would be in a dense gradient (the check holds every gradient in
    float64 anyway). A complex tensor (a Fourier layer's weights) becomes its real and imaginary
    parts (``torch.view_as_real``): ``.double()`` would drop the imaginary part.
    """
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.double()


def _dtype_label(dt: torch.dtype) -> str:
    """Short dtype name for the report: ``"bf16"``; ``"complex64"``, ``"int64"`` for what mixprec does not cast."""
    try:
        return dtype_name(dt)
    except ValueError:  # complex, integer: no mixprec format name
        return str(dt).removeprefix("torch.")


def _capture_output(model: nn.Module) -> tuple[list[Any], Any]:
    box: list[Any] = []

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        box.append([_real64(t) for t in tree_leaves(output) if t.is_floating_point() or t.is_complex()])

    return box, model.register_forward_hook(hook)


def _forward_only(model: nn.Module, batch: Any) -> Any:
    """``model(batch)``; for a dict batch the model rejects, an error that says how to pass one."""
    try:
        return model(batch)
    except TypeError as e:
        if isinstance(batch, Mapping):
            raise TypeError(
                f"the check without loss_fn calls model(batch), and this model rejects the dict batch (keys "
                f"{sorted(map(str, batch))[:6]}): {e}. Pass loss_fn, e.g. loss_fn=lambda m, b: m(**b).loss for a "
                "Hugging Face model (prepare(..., check_batch=batch, loss_fn=...))."
            ) from e
        raise


def _run(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None, region: Any,
         scale: float, seed: int, device: torch.device) -> tuple[float | None, list[torch.Tensor], dict[str, torch.Tensor | None]]:
    """Forward (+ scaled backward); returns loss, outputs and unscaled grads by name (dense, real float64: :func:`_real64`)."""
    model.zero_grad(set_to_none=True)
    box, handle = _capture_output(model)
    try:
        # (gradients on even when check() is called under torch.no_grad(): the check compares them)
        with _seeded(seed, device), torch.enable_grad():
            with region:
                out = loss_fn(model, batch) if loss_fn is not None else _forward_only(model, batch)
            loss: float | None = None
            if loss_fn is not None:
                if not isinstance(out, torch.Tensor) or out.numel() != 1:
                    raise ValueError(f"loss_fn must return a scalar loss tensor, got {type(out).__name__}"
                                     + (f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else ""))
                if not out.dtype.is_floating_point:
                    raise ValueError(f"loss_fn must return a scalar floating loss (what prec.backward takes), got "
                                     f"{out.dtype}; return the loss before any .long()/.item().")
                if not out.requires_grad and torch.is_inference_mode_enabled():
                    raise ValueError("check() under torch.inference_mode(): its tensors record no graph, so no "
                                     "gradient could be compared; call it outside inference_mode.")
                if not out.requires_grad and any(p.requires_grad for p in model.parameters()):
                    raise ValueError(
                        "loss_fn returned a loss that does not require grad (computed under torch.no_grad(), or from "
                        "detached tensors?), so no gradient could be compared, and prec.backward would refuse it in "
                        "training; return the loss as you would pass it to prec.backward, or loss_fn=None for a "
                        "forward-only check."
                    )
                loss = float(out.detach().float())
                if out.requires_grad:
                    (out.float() * scale).backward()
    finally:
        handle.remove()
    outputs = box[0] if box else []
    grads = {n: (_real64(p.grad) / scale if p.grad is not None else None) for n, p in model.named_parameters()}
    return loss, outputs, grads


def _compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, float]:
    """(relative error, SQNR dB) of the concatenation of ``got`` against ``ref`` (float64)."""
    sig = sum(float(r.pow(2).sum()) for r in ref)
    noise = sum(float((g.reshape(r.shape) - r).pow(2).sum()) if g.numel() == r.numel() else math.inf
                for r, g in zip(ref, got))
    if len(ref) != len(got):
        noise = math.inf
    if math.isnan(noise):
        return math.nan, -math.inf
    rel = math.sqrt(noise / sig) if sig > 0 else (0.0 if noise == 0 else math.inf)
    sqnr = math.inf if noise == 0 else (10 * math.log10(sig / noise) if sig > 0 else -math.inf)
    return rel, sqnr


def _finite(ts: Sequence[torch.Tensor | None]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts if t is not None)


# ----- the check ------------------------------------------------------------------------------------------
def check(
    model: nn.Module,
    batch: Any,
    policy: Policy | str = "bf16-mixed",
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    *,
    thresholds: CheckThresholds | None = None,
    loss_scale: float | None = None,
    max_backoffs: int = 30,
    min_scale: float | None = None,
    seed: int = 0,
    trace: bool = True,
    dropout: bool = False,
) -> CheckResult:
    """Run ``model`` on ``batch`` in FP32 and under ``policy``; compare; return a verdict with reasons.

    Args:
        model: The model, FP32 (a model already prepared by ``cast_module``/``MixedPrecision`` is
            un-hooked and upcast in a copy; its reference then starts from rounded weights).
            It is never modified: both runs use deep copies.
        batch: One batch as ``loss_fn`` takes it, on the model's device.
        policy: The policy to check (preset, alias or grammar string).
        loss_fn: ``loss_fn(model, batch) -> scalar loss`` (forward included). ``None``: forward
            only, ``model(batch)``; gradients are not compared.
        thresholds: Verdict limits (:class:`CheckThresholds`).
        loss_scale: The loss scale for the policy run; default: the policy's (``init_scale``,
            else 1 for static and 2**16 for dynamic). A dynamic policy halves it while the
            gradients overflow, at most ``max_backoffs`` times, as its scaler would.
        max_backoffs: See ``loss_scale``.
        min_scale: The dynamic scaler's floor: the backoff stops there, as the scaler does (its
            steps are all skipped below it). Default: the floor of the scaler the policy makes
            (``scaler_for_policy``: 1, or ``init_scale`` when the policy starts below 1). Pass
            your scaler's ``min_scale`` when you train with a scaler of your own.
        seed: Seeds the RNG identically for both runs.
        dropout: Keep dropout on. Off by default: the comparison is about rounding, and on GPUs
            kernels of different dtypes can draw different dropout masks from the same seed
            (a CUDA run of a small transformer with dropout 0.1 measured 11 dB output SQNR under
            every policy, fp16 included, against 49 dB without dropout on the CPU).
        trace: On inf/NaN, run :func:`trace_nonfinite` to name the first module that produced it.

    Returns:
        :class:`CheckResult`.

    Raises:
        TypeError / ValueError: not a module; ``loss_fn`` does not return a scalar tensor.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
        >>> x = torch.randn(32, 8)
        >>> check(m, x, "bf16-mixed", lambda m, b: m(b).pow(2).mean()).verdict
        'pass'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"check needs an nn.Module, got {type(model).__name__}")
    pol = Policy.parse(policy)
    th = thresholds or CheckThresholds()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    device_type = resolve_device_type(model)
    reasons: list[str] = []
    notes: list[str] = []
    name = pol.label
    half = [dtype_name(dt) for dt in {p.dtype for p in model.parameters() if p.is_floating_point()} if dt != torch.float32]
    if half:
        notes.append(f"the model has {'/'.join(sorted(half))} parameters: the FP32 reference uses their rounded values.")

    def result(verdict: Verdict, **kw: Any) -> CheckResult:
        base: dict[str, Any] = {
            "loss_fp32": None, "loss_policy": None, "loss_rel_err": None, "output_rel_err": None,
            "output_sqnr_db": None, "grad_rel_err": None, "grad_sqnr_db": None, "grad_lost": None, "loss_scale": 1.0,
            "backoffs": 0, "finite": True, "params": [], "trace": None,
        }
        base.update(kw)
        return CheckResult(verdict=verdict, reasons=reasons, notes=notes, policy=str(pol), device=str(device),
                           thresholds=th, **base)

    if not device_supports(pol.compute_dtype, device):
        reasons.append(f"{device} cannot compute in {dtype_name(pol.compute_dtype)}; choose "
                       + ("an fp16 preset ('fp16-mixed') or 'fp32'." if pol.compute_dtype == torch.bfloat16 else "'bf16-mixed' or 'fp32'."))
        return result("fail")
    if device.type == "cpu" and pol.compute_dtype == torch.float16:
        notes.append("fp16 on this CPU runs without fast kernels (slow): fine for this check, slow for training.")

    # --- FP32 reference ---
    ref_model = _fp32_base(model, dropout)
    with tf32(False):  # the FP32 reference is IEEE FP32 (mixprec's one TF32 switch)
        loss32, out32, grads32 = _run(ref_model, batch, loss_fn, autocast.fp32(device_type), 1.0, seed, device)
    if (loss32 is not None and not math.isfinite(loss32)) or not _finite(out32) or not _finite(list(grads32.values())):
        reasons.append("the model produces inf/NaN in FP32 already: this is not a precision problem (check the data, "
                       "the initialisation, the loss).")
        trace32 = None
        if trace:
            try:  # where, in FP32 (policy None: the model as it is)
                backward = loss32 is not None and math.isfinite(loss32) and _finite(out32)
                trace32 = trace_nonfinite(_fp32_base(model, dropout), batch, loss_fn, None, backward=backward)
            except Exception as e:  # the trace is a bonus; the verdict stands without it
                notes.append(f"the inf/NaN trace failed: {type(e).__name__}: {e}")
            else:
                if trace32.found:
                    reasons.append(f"first {trace32.kind} in FP32: {trace32.phase}, {trace32.location}.")
        return result("fail", loss_fp32=loss32, finite=False, trace=trace32)

    # --- the policy run, with dynamic-scaler-like backoff ---
    if loss_scale is not None:
        scale = float(loss_scale)
    elif pol.loss_scale == "none":
        scale = 1.0
    else:
        scale = pol.init_scale if pol.init_scale is not None else (1.0 if pol.loss_scale == "static" else 2.0**16)
    with warnings.catch_warnings(record=True) as fp8_notes:  # apply_fp8: f8= policies
        warnings.simplefilter("always")
        fp8_model = apply_fp8(_fp32_base(model, dropout), pol, batch, loss_fn)
    for w in fp8_notes:  # "runs no layer in FP8": the report (and its JSON) says what actually ran
        if issubclass(w.category, UserWarning) and "FP8" in str(w.message):
            notes.append(" ".join(str(w.message).split()))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    pol_model = cast_module(fp8_model, pol)
    backoffs = 0
    # The floor of the scaler the policy trains with (scaler_for_policy: DynamicScaler's default floor, widened
    # down to ls=dynamic:S when S is below it): a scale below it is one training never reaches.
    if min_scale is not None:
        floor = float(min_scale)
    elif pol.init_scale is not None:
        floor = min(DYNAMIC_SCALE_RANGE[0], pol.init_scale)
    else:
        floor = DYNAMIC_SCALE_RANGE[0]
    at_floor = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # e.g. autocast's "fp16 on CPU" notices
        while True:
            lossp, outp, gradsp = _run(pol_model, batch, loss_fn, autocast(pol, device_type), scale, seed, device)
            fwd_ok = (lossp is None or math.isfinite(lossp)) and _finite(outp)
            bwd_ok = _finite(list(gradsp.values()))
            if fwd_ok and not bwd_ok and pol.loss_scale == "dynamic" and loss_scale is None and backoffs < max_backoffs:
                if scale / 2 < floor:
                    at_floor = True
                    break
                scale /= 2
                backoffs += 1
                continue
            break
    params_dtype = {n: _dtype_label(p.dtype) for n, p in pol_model.named_parameters()}
    grad_dtype = {n: (_dtype_label(p.grad.dtype) if p.grad is not None else None) for n, p in pol_model.named_parameters()}
    del pol_model, ref_model

    trace_result = None
    if not (fwd_ok and bwd_ok):
        where = "forward (loss or outputs)" if not fwd_ok else f"backward (gradients, at loss scale {scale:g})"
        if at_floor:
            reasons.append(
                f"under {name} the gradients overflow even at the dynamic loss scale's floor {scale:g} (after {backoffs} "
                f"halving(s)): the scaler cannot go lower, so training would skip every step. Use bf16 ('bf16-mixed': "
                f"FP32's range) or keep the overflowing module in FP32 (an FP32 island, i=name:<module>).")
        else:
            reasons.append(f"under {name} the {where} has inf/NaN" + (
                f" even after {backoffs} halvings of the loss scale" if backoffs else "") + ".")
        if trace:
            try:
                trace_result = trace_nonfinite(_fp32_base(model, dropout), batch, loss_fn, pol, loss_scale=scale,
                                               backward=fwd_ok and loss_fn is not None)
            except Exception as e:  # the trace is a bonus; the verdict stands without it
                notes.append(f"the inf/NaN trace failed: {type(e).__name__}: {e}")
            else:
                if trace_result.found:
                    r = trace_result
                    cause = ""
                    if r.fp32_rerun is not None and r.fp32_rerun.precision_is_cause is not None:
                        cause = ("; finite in FP32: precision is the cause" if r.fp32_rerun.precision_is_cause
                                 else "; also non-finite in FP32: not a precision problem")
                    reasons.append(f"first {r.kind}: {r.phase}, {r.location}{cause}.")
        return result("fail", loss_fp32=loss32, loss_policy=lossp, loss_scale=scale, backoffs=backoffs, finite=False,
                      trace=trace_result)

    # --- compare ---
    verdict: Verdict = "pass"

    def worse(v: Verdict) -> None:
        nonlocal verdict
        order = {"pass": 0, "warn": 1, "fail": 2}
        if order[v] > order[verdict]:
            verdict = v

    loss_rel = None
    if loss32 is not None and lossp is not None:
        loss_rel = abs(lossp - loss32) / max(abs(loss32), 1e-12)
        if loss_rel > th.loss_rel_fail:
            worse("fail")
            reasons.append(f"the loss differs from FP32 by {loss_rel:.1%} (limit {th.loss_rel_fail:.0%}): {lossp:.6g} vs {loss32:.6g}.")
        elif loss_rel > th.loss_rel_warn:
            worse("warn")
            reasons.append(f"the loss differs from FP32 by {loss_rel:.2%} (warn above {th.loss_rel_warn:.0%}).")
    out_rel, out_sqnr = _compare(out32, outp) if out32 else (None, None)
    if out_sqnr is not None:
        if out_sqnr < th.output_sqnr_fail_db:
            worse("fail")
            reasons.append(f"the outputs differ from FP32: SQNR {out_sqnr:.1f} dB (limit {th.output_sqnr_fail_db:g} dB).")
        elif out_sqnr < th.output_sqnr_warn_db:
            worse("warn")
            reasons.append(f"the outputs are noisy: SQNR {out_sqnr:.1f} dB against FP32 (warn below {th.output_sqnr_warn_db:g} dB).")

    g_rel = g_sqnr = g_lost = None
    comparisons: list[ParamComparison] = []
    if loss_fn is not None:
        ref_list, got_list = [], []
        lost_n = nonzero_n = 0
        for n, g32 in grads32.items():
            if g32 is None:
                continue
            gp = gradsp.get(n)
            gp = torch.zeros_like(g32) if gp is None else gp
            ref_list.append(g32)
            got_list.append(gp)
            nz = g32 != 0
            lost = int((nz & (gp == 0)).sum())
            nzc = int(nz.sum())
            lost_n += lost
            nonzero_n += nzc
            rel, sq = _compare([g32], [gp])
            comparisons.append(ParamComparison(n, params_dtype.get(n, "?"), grad_dtype.get(n), rel, sq,
                                               lost / nzc if nzc else 0.0, bool(torch.isfinite(gp).all())))
        comparisons.sort(key=lambda c: c.sqnr_db)
        if ref_list:
            g_rel, g_sqnr = _compare(ref_list, got_list)
            g_lost = lost_n / nonzero_n if nonzero_n else 0.0
            if g_lost > th.grad_lost_fail:
                worse("fail")
                if pol.fp8 != "none":
                    # FP8 scales each tensor (or row) by its own amax (docs/fp8.md): a loss scale multiplies the amax
                    # too and changes nothing, and the policy computes in BF16 already. The cure is per layer.
                    lossy = [c for c in sorted(comparisons, key=lambda c: -c.lost) if c.lost > th.grad_lost_warn][:3]
                    where = f" (most in {', '.join(c.name for c in lossy)})" if lossy else ""
                    rowwise = "" if pol.fp8.startswith("rowwise") else "fp8-rowwise (a scale per row, robust to outliers), "
                    fix = (f"FP8's per-{'row' if pol.fp8.startswith('rowwise') else 'tensor'} scaling flushes the small "
                           f"values next to the largest, which no loss scale changes: use f8_layers=auto "
                           f"(mixprec.numerics.fp8_plan measures each linear and keeps the lossy ones in BF16), "
                           f"{rowwise}or keep those layers in BF16 (f8_layers globs that leave them out).")
                else:
                    where = ""
                    fix = f"use a larger loss scale (this run: {scale:g}) or bf16."
                reasons.append(f"{g_lost:.1%} of the non-zero gradient elements are zero under {name}{where} (underflow; "
                               f"limit {th.grad_lost_fail:.0%}): {fix}")
            elif g_lost > th.grad_lost_warn:
                worse("warn")
                reasons.append(f"{g_lost:.2%} of the non-zero gradient elements underflow to zero under {name} "
                               f"(loss scale {scale:g}).")
            worst = ", ".join(c.name for c in comparisons[:3])
            if g_sqnr < th.grad_sqnr_fail_db:
                worse("fail")
                reasons.append(f"the gradients differ from FP32: SQNR {g_sqnr:.1f} dB (limit {th.grad_sqnr_fail_db:g} dB); "
                               f"worst: {worst}.")
            elif g_sqnr < th.grad_sqnr_warn_db:
                worse("warn")
                reasons.append(f"the gradients are noisy: SQNR {g_sqnr:.1f} dB against FP32 (warn below "
                               f"{th.grad_sqnr_warn_db:g} dB); worst: {worst}.")
    if backoffs:
        notes.append(f"the gradients overflowed at larger loss scales; {scale:g} was the first finite one "
                     f"({backoffs} halvings), as a dynamic scaler would find.")
    return result(verdict, loss_fp32=loss32, loss_policy=lossp, loss_rel_err=loss_rel, output_rel_err=out_rel,
                  output_sqnr_db=out_sqnr, grad_rel_err=g_rel, grad_sqnr_db=g_sqnr, grad_lost=g_lost, loss_scale=scale,
                  backoffs=backoffs, finite=True, params=comparisons)


def preflight(
    model: nn.Module,
    batch: Any,
    policy: Policy | str,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    *,
    on_fail: Literal["warn", "raise"] = "warn",
    _fail_arg: str = "on_fail='warn'",
    **check_kwargs: Any,
) -> CheckResult:
    """Run :func:`check` before training; warn or raise on a bad verdict. Never changes precision.

    For ``MixedPrecision``'s first-batch check: call it with the FP32 model *before* ``prepare``
    (or with the prepared model: it is un-hooked and upcast in a copy).

    Args:
        model, batch, policy, loss_fn: As :func:`check`.
        on_fail: ``"warn"`` issues a ``UserWarning`` on a ``fail`` verdict; ``"raise"`` raises
            :class:`mixprec.NumericsError`. A ``warn`` verdict always only warns.
        **check_kwargs: Passed to :func:`check` (``thresholds``, ``loss_scale``, ``seed``, ...).

    Returns:
        The :class:`CheckResult` (also when it warned).

    Raises:
        NumericsError: ``on_fail="raise"`` and the verdict is ``fail``; the message holds the reasons.
        ValueError: an unknown ``on_fail``.
    """
    if on_fail not in ("warn", "raise"):
        raise ValueError(f"on_fail={on_fail!r}; use 'warn' or 'raise'.")
    res = check(model, batch, policy, loss_fn, **check_kwargs)
    if res.verdict == "fail" and on_fail == "raise":
        # The hint names the argument the user wrote (_fail_arg: MixedPrecision.prepare forwards its on_check_fail).
        arg = _fail_arg
        raise NumericsError(
            f"pre-flight check failed for policy {Policy.parse(policy).label!r}:\n{res}\n"
            "mixprec does not switch precision for you: choose another policy (e.g. 'bf16-mixed' or 'fp32'), add FP32 "
            f"islands, or pass {arg} to train anyway."
        )
    if res.verdict != "pass":
        warnings.warn(f"mixprec pre-flight check: {res.verdict.upper()}\n{res}", UserWarning, stacklevel=2)
    return res
