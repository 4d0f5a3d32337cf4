"""The numerics report (what the monitor found and what it recommends), tables and JSON.

Plain-text tables need nothing; :func:`print_tables` uses ``rich`` when it is installed
(``pip install rich`` or ``mixprec[cli]``) and falls back to plain text otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import IO, Any

from .._policy import Policy
from ._stats import Log2Histogram, thresholds

__all__ = [
    "ModuleNumerics",
    "NumericsReport",
    "ParamNumerics",
    "ScaleRange",
    "build_report",
    "format_table",
    "fp32_divergence",
    "jsonable",
    "print_tables",
    "rich_console",
]

F16 = thresholds("f16")
#: The report's line (and the monitor's warning) when no step was sampled.
NOTHING_SAMPLED = ("NOTHING WAS SAMPLED: the monitor records only while attached (`with NumericsMonitor(model, ...) as "
                   "mon:` around the training loop, or mon.attach()); the figures and recommendations below rest on no "
                   "data.")
#: The largest static scale mixprec recommends (DynamicScaler's default ceiling, 2**24).
MAX_RECOMMENDED_SCALE = 2.0**24
#: Headroom the recommended scale leaves under the largest gradient, in binades (x16).
HEADROOM_BITS = 4
#: BF16 stagnation above this fraction of updated elements is reported as a problem.
STAGNATION_WARN = 0.01
#: A parameter whose gradient was computed in FP16 is flagged as possibly flushed when at least this
#: fraction of its gradient values are exact zeros (pre-flight ``check`` fails above 10% lost, too) ...
FLUSHED_ZERO_WARN = 0.1
#: ... and at least this fraction of its non-zero values are FP16 subnormals at the loss scale: the values sit
#: at the bottom of FP16's range, where the missing ones were flushed. (Zeros from ReLUs, unused embedding
#: rows or masks come with gradients in FP16's normal range and are not flagged.)
FLUSHED_SUBNORMAL_HINT = 0.05
#: A monitored FP32 loss this many times its first value (and beyond FP16's maximum) has exploded:
#: the run diverged in FP32 itself (a learning rate 10x too high typically grows the loss by orders
#: of magnitude within a few steps; noisy but healthy losses stay within a few x of the first).
DIVERGENCE_FACTOR = 1e3


# ----- small formatting helpers ---------------------------------------------------------------------
def _g(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    if x == 0:
        return "0"
    return f"{x:.{digits}g}"


def _pct(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0%"
    if x < 0.0001:
        return "<0.01%"
    return f"{x:.2%}"


def _pow2(x: float | None) -> str:
    if x is None:
        return "-"
    e = math.log2(x)
    return f"2^{int(e)}" if e.is_integer() else _g(x)


def jsonable(obj: Any) -> Any:
    """Convert dataclasses, tuples, sets and non-finite floats into JSON-safe values (inf/NaN -> null)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain-text table: columns padded to width, numbers right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))

    def numeric(c: str) -> bool:
        return bool(c) and (c[0].isdigit() or (c[0] in "-<+" and len(c) > 1 and c[1].isdigit()))

    def line(r: Sequence[str]) -> str:
        # The first column holds names (which may look numeric, e.g. "0.weight"): always left-aligned.
        return "  ".join(
            c.rjust(w) if i and numeric(c) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()

    out = []
    if title:
        out.append(title)
    out.append(line(list(headers)))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def rich_console(file: IO[str] | None = None) -> Any:
    """A ``rich`` console on ``file``.

    Raises:
        ImportError: rich is not installed; the message says how to install it.
    """
    try:
        from rich.console import Console
    except ImportError:
        raise ImportError("rich tables need the 'rich' package: pip install rich (or pip install 'mixprec[cli]')") from None
    # Not a terminal (a pipe, a file, CI logs): rich would wrap at 80 columns; tables need more.
    width = None if file is None or (hasattr(file, "isatty") and file.isatty()) else 200
    return Console(file=file, soft_wrap=True, width=width)


def print_tables(tables: Sequence[tuple[str, Sequence[str], Sequence[Sequence[Any]]]], lines: Sequence[str] = (),
                 file: IO[str] | None = None, use_rich: bool | None = None, header: Sequence[str] = ()) -> None:
    """Print ``header`` lines, the ``(title, headers, rows)`` tables, then ``lines``: with rich when available.

    Args:
        use_rich: ``True`` requires rich (ImportError with an install hint), ``False`` never
            uses it, ``None`` uses it when installed.
    """
    import sys

    file = file if file is not None else sys.stdout
    console = None
    if use_rich is not False:
        try:
            console = rich_console(file)
        except ImportError:
            if use_rich:
                raise
    if console is None:
        for ln in header:
            print(ln, file=file)
        for title, headers, rows in tables:
            print(format_table(headers, rows, title), file=file)
            print(file=file)
        for ln in lines:
            print(ln, file=file)
        return
    from rich.table import Table

    for ln in header:
        console.print(ln, highlight=False, markup=False)
    for title, headers, rows in tables:
        t = Table(title=title, title_justify="left", show_lines=False)
        for h in headers:
            t.add_column(h, overflow="fold")
        for r in rows:
            t.add_row(*[str(c) for c in r])
        console.print(t)
    for ln in lines:
        console.print(ln, highlight=False, markup=False)


# ----- the report's pieces --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModuleNumerics:
    """What one module's outputs and output gradients looked like (gradients unscaled).

    Attributes:
        name: Qualified module name (``""`` is the root).
        type: Class name.
        act_dtypes / grad_dtypes: Dtypes the outputs and their gradients were computed in.
        act_absmax: Largest finite output magnitude seen.
        act_nonfinite: Fraction of output values that were inf/NaN.
        act_overflow_f16: Fraction of output values that would overflow FP16.
        fp16_headroom_bits: ``log2(65504 / act_absmax)``: binades left before FP16 overflows
            (negative: already beyond).
        grad_absmax: Largest unscaled gradient magnitude flowing into the outputs.
        grad_lost_f16: Fraction of non-zero output gradients that flush to zero in FP16 at scale 1.
        grad_lost_f16_at_scale: The same at the report's loss scale.
        samples: Output tensors recorded.
        norm_island: The module is a normalization layer, an FP32 island under every preset (``i=norm``).
        nonfinite_input: Every call of the module that returned inf/NaN had received NaN inputs
            or held inf/NaN parameters already (left by an earlier non-finite update): it only
            passed them on (``False`` when none returned inf/NaN). Inputs holding only ``±inf``
            do not count: they are legitimate (attention masks).
        nonfinite_made_in_half: Whether a call that made inf/NaN (not :attr:`nonfinite_input`)
            computed in half precision: autocast to FP16/BF16 was on, or a parameter, input or
            output was FP16/BF16/FP8. ``None``: not recorded (no such call, or statistics built
            elsewhere): :attr:`computed_in_half` then looks at the output dtypes.
    """

    name: str
    type: str
    act_dtypes: list[str]
    grad_dtypes: list[str]
    act_absmax: float
    act_nonfinite: float
    act_overflow_f16: float
    fp16_headroom_bits: float | None
    grad_absmax: float
    grad_lost_f16: float
    grad_lost_f16_at_scale: float
    samples: int
    norm_island: bool = False
    nonfinite_input: bool = False
    nonfinite_made_in_half: bool | None = None

    @classmethod
    def from_histograms(cls, name: str, type_name: str, act: Log2Histogram, grad: Log2Histogram,
                        act_dtypes: list[str], grad_dtypes: list[str], scale: float,
                        norm_island: bool = False, *, nonfinite_input: bool = False,
                        nonfinite_made_in_half: bool | None = None) -> ModuleNumerics:
        """Summarise one module's histograms.

        Args:
            name / type_name / act_dtypes / grad_dtypes / norm_island / nonfinite_input /
                nonfinite_made_in_half: As the attributes.
            act / grad: Histograms of its outputs and (unscaled) output gradients.
            scale: The report's loss scale.

        Returns:
            The module's :class:`ModuleNumerics`.
        """
        a = act.summary()
        fa = act.fractions("f16", 1.0)
        gsum = grad.summary()
        amax = a["absmax"]
        return cls(
            name=name, type=type_name, act_dtypes=act_dtypes, grad_dtypes=grad_dtypes, act_absmax=amax,
            act_nonfinite=fa["nonfinite"], act_overflow_f16=fa["overflow"],
            fp16_headroom_bits=math.log2(F16.max / amax) if amax > 0 else None,
            grad_absmax=gsum["absmax"], grad_lost_f16=grad.lost_fraction("f16", 1.0),
            grad_lost_f16_at_scale=grad.lost_fraction("f16", scale), samples=act.samples, norm_island=norm_island,
            nonfinite_input=nonfinite_input, nonfinite_made_in_half=nonfinite_made_in_half,
        )

    @property
    def computed_in_half(self) -> bool:
        """Whether the module computed its inf/NaN in half precision (FP16, BF16 or FP8).

        :attr:`nonfinite_made_in_half` when recorded. Otherwise whether its outputs were half
        values (an FP32 output can still come from an FP16 computation, ``(x @ w).float()`` under
        autocast: only the monitor's record tells those apart).
        """
        if self.nonfinite_made_in_half is not None:
            return self.nonfinite_made_in_half
        return any(d in ("f16", "bf16") or d.startswith("float8") for d in self.act_dtypes)


@dataclasses.dataclass(frozen=True)
class ParamNumerics:
    """One parameter's gradients (unscaled) and updates.

    Attributes:
        name / module / dtype / numel: The parameter.
        grad_dtypes: Dtypes its gradients arrived in.
        grad_absmax: Largest unscaled gradient magnitude.
        grad_zero: Fraction of gradient values that were exactly zero.
        grad_lost_f16 / grad_lost_f16_at_scale: Fraction of non-zero gradient values that flush
            to zero in FP16 at scale 1 / at the report's loss scale.
        updated: Elements whose weight changed in the measured steps (``None``: not measured).
        stagnant_bf16 / stagnant_f16: Fraction of those whose update was below half an ulp of
            the weight in BF16 / FP16: they would not move if the weight were stored in that format.
        fp32_island: The parameter belongs to an FP32 island of the monitor's policy (a norm
            layer by default): it is stored in FP32 under that policy, so the report's stagnation
            figures and finding leave it out.
        grad_subnormal_f16_at_scale: Fraction of the non-zero finite gradient values that are
            FP16 subnormals at the report's loss scale (values at the bottom of FP16's range).
    """

    name: str
    module: str
    dtype: str
    numel: int
    grad_dtypes: list[str]
    grad_absmax: float
    grad_zero: float
    grad_lost_f16: float
    grad_lost_f16_at_scale: float
    updated: int | None
    stagnant_bf16: float | None
    stagnant_f16: float | None
    fp32_island: bool = False
    grad_subnormal_f16_at_scale: float = 0.0

    @classmethod
    def from_record(cls, name: str, module: str, dtype: str, numel: int, grad: Log2Histogram, grad_dtypes: list[str],
                    update_counts: list[int] | None, scale: float, *, fp32_island: bool = False) -> ParamNumerics:
        """Summarise one parameter's gradient histogram and update counts.

        Args:
            name / module / dtype / numel / grad_dtypes / fp32_island: As the attributes.
            grad: Histogram of its (unscaled) gradients.
            update_counts: ``[updated, below half a BF16 ulp, below half an FP16 ulp]`` or ``None``.
            scale: The report's loss scale.

        Returns:
            The parameter's :class:`ParamNumerics`.
        """
        s = grad.summary()
        fr = grad.fractions("f16", scale)
        nonzero = 1.0 - fr["zero"] - fr["nonfinite"]
        updated = stag_b = stag_h = None
        if update_counts is not None:
            updated = int(update_counts[0])
            stag_b = update_counts[1] / updated if updated else 0.0
            stag_h = update_counts[2] / updated if updated else 0.0
        return cls(
            name=name, module=module, dtype=dtype, numel=numel, grad_dtypes=grad_dtypes, grad_absmax=s["absmax"],
            grad_zero=s["zero"] / s["total"] if s["total"] else 0.0, grad_lost_f16=grad.lost_fraction("f16", 1.0),
            grad_lost_f16_at_scale=grad.lost_fraction("f16", scale), updated=updated, stagnant_bf16=stag_b,
            stagnant_f16=stag_h, fp32_island=fp32_island,
            grad_subnormal_f16_at_scale=fr["subnormal"] / nonzero if nonzero > 0 else 0.0,
        )


@dataclasses.dataclass(frozen=True)
class ScaleRange:
    """Loss scales for FP16 (powers of two; gradients unscaled).

    Attributes:
        low: Smallest scale at which at most ``max_lost`` of the non-zero gradient values flush
            to zero (``None``: no scale up to 2**40 is enough).
        high: Largest scale at which the largest gradient stays below the FP16 maximum
            (``None``: no gradient was seen).
        recommended: A static scale inside ``[low, high]`` with up to 16x headroom below ``high``,
            at most 2**24; ``high`` when the range is empty.
        feasible: ``low <= high``: one static scale keeps the largest gradient finite and
            recovers the small ones.
        max_lost: The tolerance used for ``low``.
    """

    low: float | None
    high: float | None
    recommended: float | None
    feasible: bool
    max_lost: float


@dataclasses.dataclass(frozen=True)
class NumericsReport:
    """What :class:`~mixprec.numerics.NumericsMonitor` observed, and what it recommends.

    Attributes:
        device: Where the model ran.
        sampled_steps / every: How much was observed.
        loss_scale: The scale "at the current scale" figures refer to.
        modules / params: Per-module and per-parameter statistics.
        overflow_risk: Names of modules whose activations overflow FP16 or come within
            ``overflow_margin`` of its maximum, largest first.
        activation_grad_underflow / param_grad_underflow: ``{"f16": {"scale_1": f, "current_scale": f},
            "bf16": {...}}``: fractions of non-zero gradient values that flush to zero.
        grad_absmax: Largest unscaled gradient (activation or parameter).
        scale_range: :class:`ScaleRange` for FP16.
        stagnation: ``{"bf16": f, "f16": f, "worst": [[name, f], ...]}``; fractions of updated
            weight elements whose update is below half an ulp (``None`` without an optimizer), over
            the parameters that would be stored in half precision (FP32 islands left out).
        recommended_islands: FP32 islands to add for FP16 (policy ``i=`` entries).
        recommended_preset: The preset mixprec recommends for this model on this device
            (``"none"`` when the FP32 run itself diverged: :attr:`fp32_diverged`).
        fp16_policy: A policy string for FP16 with the recommended scale and islands, or ``None``
            when FP16 cannot work.
        findings: The reasoning, one sentence per finding.
        histograms: Pooled log2 histograms (``activations``, ``activation_grads``, ``param_grads``):
            ``{"total", "zero", "nonfinite", "absmax", "bins": {k: count}}`` (bin k: ``[2**k, 2**(k+1))``).
        fp32_diverged: Why the monitored FP32 run itself diverged (see :func:`fp32_divergence`), or
            ``None``. When set, the statistics describe a diverging model, not a precision problem:
            no precision change, FP32 island or loss scale is recommended.
    """

    device: str
    sampled_steps: int
    every: int
    loss_scale: float
    modules: list[ModuleNumerics]
    params: list[ParamNumerics]
    overflow_risk: list[str]
    activation_grad_underflow: dict[str, dict[str, float]]
    param_grad_underflow: dict[str, dict[str, float]]
    grad_absmax: float
    scale_range: ScaleRange
    stagnation: dict[str, Any]
    recommended_islands: list[str]
    recommended_preset: str
    fp16_policy: str | None
    findings: list[str]
    histograms: dict[str, dict[str, Any]]
    fp32_diverged: str | None = None

    def module(self, name: str) -> ModuleNumerics:
        """The statistics of one module by qualified name (KeyError when not watched)."""
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"module {name!r} was not watched; watched: {[m.name for m in self.modules][:10]}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (schema ``mixprec.numerics/1``; inf/NaN as null)."""
        d = jsonable(self)
        d["schema"] = "mixprec.numerics/1"
        return d

    def to_json(self, **kwargs: Any) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), **kwargs)

    # ----- tables -----
    def tables(self, top: int = 15) -> list[tuple[str, list[str], list[list[str]]]]:
        """``(title, headers, rows)`` for the module and parameter tables (``top`` rows each)."""
        mods = sorted(self.modules, key=lambda m: -m.act_absmax)[:top]
        mod_rows = [[
            m.name or "(root)", m.type, "/".join(m.act_dtypes) or "-", _g(m.act_absmax),
            "-" if m.fp16_headroom_bits is None else f"{m.fp16_headroom_bits:+.1f}",
            _pct(m.act_nonfinite) if m.act_nonfinite else "0%", _g(m.grad_absmax),
            _pct(m.grad_lost_f16), _pct(m.grad_lost_f16_at_scale),
        ] for m in mods]
        scale = _pow2(self.loss_scale)
        mod_table = (
            f"Modules (top {len(mods)} of {len(self.modules)} by activation magnitude; gradients unscaled)",
            ["module", "type", "dtype", "act absmax", "FP16 headroom (bits)", "act inf/nan", "grad absmax",
             "grad lost FP16 @1", f"@{scale}"],
            mod_rows,
        )
        params = sorted(self.params, key=lambda p: -(p.grad_lost_f16 or 0))[:top]
        par_rows = [[
            p.name, p.dtype, "/".join(p.grad_dtypes) or "-", _g(p.grad_absmax), _pct(p.grad_zero),
            _pct(p.grad_lost_f16), _pct(p.grad_lost_f16_at_scale),
            *(("FP32 island", "-") if p.fp32_island else (_pct(p.stagnant_bf16), _pct(p.stagnant_f16))),
        ] for p in params]
        par_table = (
            f"Parameters (top {len(params)} of {len(self.params)} by FP16 gradient underflow)",
            ["parameter", "dtype", "grad dtype", "grad absmax", "grad zero", "lost FP16 @1", f"@{scale}",
             "update < 1/2 ulp BF16", "FP16"],
            par_rows,
        )
        return [mod_table, par_table]

    def summary_lines(self) -> list[str]:
        """The findings and recommendations as text lines."""
        sr = self.scale_range
        lines = [f"mixprec numerics report: {self.sampled_steps} sampled step(s) (every {self.every}), device "
                 f"{self.device}, loss scale {_pow2(self.loss_scale)}"]
        if self.sampled_steps == 0:
            lines.append(NOTHING_SAMPLED)
        ag = self.activation_grad_underflow["f16"]
        pg = self.param_grad_underflow["f16"]
        lines.append(
            f"FP16 gradient underflow (non-zero values that flush to zero): activation gradients "
            f"{_pct(ag['scale_1'])} at scale 1, {_pct(ag['current_scale'])} at {_pow2(self.loss_scale)}; parameter "
            f"gradients {_pct(pg['scale_1'])} / {_pct(pg['current_scale'])}."
        )
        if sr.high is not None or sr.low is not None:
            lines.append(
                f"FP16 loss-scale range: {_pow2(sr.low)} .. {_pow2(sr.high)} "
                f"({'feasible' if sr.feasible else 'EMPTY: no static scale fits'}); recommended static scale "
                f"{_pow2(sr.recommended)}."
            )
        st = self.stagnation
        if st.get("bf16") is not None:
            lines.append(f"Updates below half an ulp of the weight: {_pct(st['bf16'])} in BF16, {_pct(st['f16'])} in FP16.")
        lines.append("Findings:")
        lines.extend(f"  - {f}" for f in self.findings)
        if self.fp32_diverged is not None:
            lines.append("Recommended preset: none: the FP32 run itself diverged; fix it (learning rate, data, "
                         "initialisation) before choosing a precision.")
            return lines
        islands = "+".join(self.recommended_islands) or "-"
        lines.append(f"Recommended preset: {self.recommended_preset}. FP32 islands for FP16: {islands}.")
        if self.fp16_policy:
            lines.append(f"FP16 policy: {self.fp16_policy}")
        return lines

    def table(self, top: int = 15) -> str:
        """The report as plain text: summary, findings, module and parameter tables."""
        parts = ["\n".join(self.summary_lines())]
        parts += [format_table(h, r, t) for t, h, r in self.tables(top)]
        return "\n\n".join(parts)

    def print(self, file: IO[str] | None = None, top: int = 15, use_rich: bool | None = None) -> None:
        """Print the tables (with rich when installed) and the summary."""
        lines = self.summary_lines()
        print_tables(self.tables(top), lines[1:], file=file, use_rich=use_rich, header=lines[:1])

    def __str__(self) -> str:
        return self.table()


def fp32_divergence(losses: Sequence[float]) -> str | None:
    """Why a run's losses show that it diverged, or ``None`` when they do not.

    A run diverged when a loss is inf/NaN, or when a loss exceeds both FP16's maximum and
    ``DIVERGENCE_FACTOR`` times the first loss's magnitude (an explosion, not noise).

    Args:
        losses: The losses of consecutive training steps (Python floats; NaN/inf allowed).

    Returns:
        A sentence naming the step and the loss, or ``None``.

    Example:
        >>> fp32_divergence([0.69, 14.9, 1.2e5, float("inf")]) is not None
        True
        >>> fp32_divergence([0.69, 0.6, 0.5]) is None
        True
    """
    if not losses:
        return None
    first = abs(losses[0]) if math.isfinite(losses[0]) else None
    for i, v in enumerate(losses):
        if not math.isfinite(v):
            return f"the loss became {v} at step {i} (first loss {_g(losses[0])})"
        if first is not None and abs(v) > F16.max and abs(v) > DIVERGENCE_FACTOR * first:
            return f"the loss grew from {_g(losses[0])} to {_g(v)} by step {i}"
    return None


def mark_fp32_divergence(report: NumericsReport, reason: str) -> NumericsReport:
    """The report of a monitored FP32 run that diverged: no precision advice from its statistics.

    The activations and gradients of a diverging model exceed any format's range (FP16's, then
    FP32's), so the overflow, loss-scale, island and stagnation figures say nothing about precision:
    they are dropped from the recommendations, and the findings say the FP32 run itself diverged.

    Args:
        report: The report built from the run's statistics.
        reason: What showed the divergence (:func:`fp32_divergence`).

    Returns:
        A copy of ``report`` with ``fp32_diverged`` set, one finding, no islands, no FP16 policy,
        no loss-scale range and no stagnation figures.
    """
    finding = (f"The monitored FP32 run itself diverged: {reason}. This is not a precision problem (no "
               "format, FP32 island or loss scale fixes it; bf16-mixed diverges the same way): lower the learning "
               "rate (or add warm-up / gradient clipping), check the data and the initialisation, then run mixprec "
               "doctor again. The activation and gradient figures below were recorded while the model diverged.")
    return dataclasses.replace(
        report, fp32_diverged=reason, findings=[finding], recommended_islands=[], fp16_policy=None,
        recommended_preset="none",
        scale_range=ScaleRange(low=None, high=None, recommended=None, feasible=False,
                               max_lost=report.scale_range.max_lost),
        stagnation={"bf16": None, "f16": None, "worst": []},
    )


def _underflow(h: Log2Histogram, scale: float) -> dict[str, dict[str, float]]:
    return {
        dt: {"scale_1": h.lost_fraction(dt, 1.0), "current_scale": h.lost_fraction(dt, scale)}
        for dt in ("f16", "bf16")
    }


def _scale_range(pooled: Log2Histogram, gmax: float, max_lost: float) -> ScaleRange:
    low = pooled.smallest_scale_keeping("f16", max_lost=max_lost)
    high = None
    if gmax > 0 and math.isfinite(gmax):
        e = math.floor(math.log2(F16.max / gmax))
        if gmax * 2.0**e >= F16.max:  # exactly at the boundary
            e -= 1
        high = 2.0**e
    if high is None:
        rec = low
        feasible = low is not None
    elif low is None or low > high:
        rec, feasible = high, False
    else:
        rec = min(max(low, high / 2**HEADROOM_BITS), high)
        if rec > MAX_RECOMMENDED_SCALE and low <= MAX_RECOMMENDED_SCALE:
            rec = MAX_RECOMMENDED_SCALE
        feasible = True
    return ScaleRange(low=low, high=high, recommended=rec, feasible=feasible, max_lost=max_lost)


def build_report(*, modules: list[ModuleNumerics], params: list[ParamNumerics], act_grads: Log2Histogram,
                 param_grads: Log2Histogram, loss_scale: float, max_lost: float, sampled_steps: int, every: int,
                 overflow_margin: float, bf16_supported: bool, device: str, update_measured: bool,
                 activations: Log2Histogram | None = None) -> NumericsReport:
    """Turn the monitor's statistics into findings and recommendations (see :class:`NumericsReport`).

    Algorithm (overflow and islands):
        1. A module that returned inf/NaN only when its inputs already held NaN (or its weights
           inf/NaN) passed them on: it is not blamed (``ModuleNumerics.nonfinite_input``). When
           inf/NaN was seen but every module that returned it had received it, a finding says it
           entered the monitored modules from outside them.
        2. inf/NaN made by a module that computed in FP32 (no autocast to a half dtype, no half
           parameters, inputs or outputs: ``ModuleNumerics.computed_in_half``) is not a precision
           problem: a finding says so, and no FP32 island is advised for it (such a module is
           still at risk, with its own finding, when its finite outputs come near FP16's maximum).
        3. A module whose FP32/BF16 outputs exceed FP16's maximum overflows in FP16 whatever
           runs inside it: an FP32 island hands its outputs back in the compute dtype, so the
           advice is BF16 or rescaling, and no FP16 policy is offered (``fp16_policy=None``).
        4. The other modules at risk (inf/NaN made in half precision, or outputs within
           ``overflow_margin`` of FP16's maximum) get an FP32 island: it helps where the
           overflow is inside the module or in its backward.

    Exact zeros in gradients computed in FP16 can be values that already flushed (the underflow
    figures count non-zero values only): a parameter with at least ``FLUSHED_ZERO_WARN`` zeros
    whose non-zero values are FP16 subnormals at the loss scale (at least
    ``FLUSHED_SUBNORMAL_HINT``) is named in a finding, and so is one whose recorded gradients were
    zero everywhere (nothing left to sit at FP16's bottom: it never trains).

    Args:
        modules / params: Per-module and per-parameter statistics.
        act_grads / param_grads / activations: Pooled histograms (gradients unscaled).
        loss_scale: The scale "at the current scale" figures refer to.
        max_lost: Fraction of non-zero gradients a recommended loss scale may flush.
        sampled_steps / every / device: Recorded as they are.
        overflow_margin: Headroom factor under FP16's maximum below which a module is at risk.
        bf16_supported: The device computes in BF16 (decides the preset).
        update_measured: Stagnation was measured.

    Returns:
        The :class:`NumericsReport`.
    """
    findings: list[str] = []
    # (1) a module counts as making inf/NaN only when some call of it had finite inputs
    makes_nonfinite = [m for m in modules if m.act_nonfinite > 0 and not m.nonfinite_input]
    # (2) made in FP32 (or FP64): the data, a bug or a diverged model, whatever the precision
    fp32_nonfinite = [m for m in makes_nonfinite if not m.computed_in_half]
    risk = sorted(
        (m for m in modules if (m in makes_nonfinite and m.computed_in_half) or m.act_absmax * overflow_margin >= F16.max),
        key=lambda m: -m.act_absmax,
    )
    # (3) the output itself beyond FP16's range (seen finite in FP32/BF16): an island cannot help
    output_overflow = [m for m in risk if m.act_overflow_f16 > 0]
    for m in fp32_nonfinite:
        findings.append(f"{m.name or '(root)'} ({m.type}) produced inf/NaN in FP32 activations ({_pct(m.act_nonfinite)}) "
                        "computing in FP32 from NaN-free inputs and finite weights: not a precision problem (no format or FP32 island changes it); check the "
                        "data, the operation's domain (log, sqrt, division) and the learning rate.")
    received = [m.name or "(root)" for m in modules if m.act_nonfinite > 0 and m.nonfinite_input]
    if received and not makes_nonfinite:
        findings.append(
            "inf/NaN entered the monitored modules from outside them (the batch, the parent's own code between "
            "modules, or weights made NaN by an earlier update): every module that returned it had received NaN "
            f"inputs or held non-finite weights ({', '.join(received[:5])}{', ...' if len(received) > 5 else ''}). "
            "mixprec.numerics.trace_nonfinite on the failing batch names where it first appears.")
    for m in risk:
        if m in makes_nonfinite and m not in fp32_nonfinite:  # (made in FP32: its finding is above)
            # (an FP32 output computed in half precision, '(x @ w).float()' under autocast: say where it was made)
            where = ("" if any(d in ("f16", "bf16") or d.startswith("float8") for d in m.act_dtypes)
                     else ", computed in half precision (autocast, or half weights or inputs)")
            findings.append(f"{m.name or '(root)'} ({m.type}) produced inf/NaN activations in "
                            f"{'/'.join(m.act_dtypes)} ({_pct(m.act_nonfinite)}){where}.")
        elif m.act_overflow_f16 > 0:
            findings.append(f"{m.name or '(root)'} ({m.type}) has activations up to {_g(m.act_absmax)}, beyond the FP16 "
                            f"maximum 65504: its output overflows in FP16. An FP32 island would not help (it computes "
                            f"in FP32 inside but hands its outputs back in FP16): use BF16 (the range of FP32), or "
                            f"rescale so the output fits (e.g. smaller weights in {m.name or 'it'!s}, or a "
                            f"normalization after it).")
        else:
            findings.append(f"{m.name or '(root)'} ({m.type}) has activations up to {_g(m.act_absmax)}, within "
                            f"{overflow_margin:g}x of the FP16 maximum 65504: at risk of overflow in FP16.")

    pooled = Log2Histogram().merge_(act_grads).merge_(param_grads)
    gmax = max(act_grads.summary()["absmax"], param_grads.summary()["absmax"])
    sr = _scale_range(pooled, gmax, max_lost)
    ag = _underflow(act_grads, loss_scale)
    pg = _underflow(param_grads, loss_scale)
    lost1 = pooled.lost_fraction("f16", 1.0)
    if lost1 > max_lost:
        findings.append(f"{_pct(lost1)} of the non-zero gradient values flush to zero in FP16 without loss scaling "
                        f"(activation gradients {_pct(ag['f16']['scale_1'])}, parameter gradients {_pct(pg['f16']['scale_1'])}).")
    if loss_scale != 1.0:
        lost_s = pooled.lost_fraction("f16", loss_scale)
        findings.append(f"At the current loss scale {_pow2(loss_scale)}, {_pct(lost_s)} still flush to zero"
                        + (f" and the largest gradient ({_g(gmax)}) overflows FP16." if gmax * loss_scale >= F16.max else "."))
    if sr.feasible and sr.recommended is not None and (lost1 > max_lost or (sr.high is not None and sr.high < 1)):
        findings.append(f"A static loss scale in {_pow2(sr.low)}..{_pow2(sr.high)} keeps the largest gradient finite and "
                        f"loses at most {_pct(max_lost)} of the small ones; {_pow2(sr.recommended)} leaves headroom.")
    elif not sr.feasible and sr.high is not None:
        findings.append(f"The gradients span more than FP16 can hold: any scale that keeps the largest ({_g(gmax)}) "
                        f"finite (<= {_pow2(sr.high)}) still flushes more than {_pct(max_lost)} of the small ones.")

    # Flushed values arrive as exact zeros, which the underflow figures above (non-zero values only) cannot
    # count: name the FP16-computed gradients that are mostly zeros with their other values at FP16's bottom.
    f16_modules = {m.name for m in modules if "f16" in m.act_dtypes or "f16" in m.grad_dtypes}
    # A gradient that is zero everywhere has no non-zero values left to sit at FP16's bottom: every one may have
    # flushed, and the parameter never trains; it is named too (grad_zero counts recorded gradients only, so a
    # parameter that never received one is not).
    f16_grads = [p for p in params if "f16" in p.grad_dtypes or p.module in f16_modules]
    all_zero = [p for p in f16_grads if p.grad_zero >= 1.0]
    flushed = [p for p in f16_grads if FLUSHED_ZERO_WARN <= p.grad_zero < 1.0
               and p.grad_subnormal_f16_at_scale >= FLUSHED_SUBNORMAL_HINT]
    if flushed or all_zero:
        flushed.sort(key=lambda p: -p.grad_zero)
        parts = []
        if all_zero:
            zs = ", ".join(p.name for p in all_zero[:5]) + (", ..." if len(all_zero) > 5 else "")
            parts.append(f"every value zero in {zs}: these weights never train")
        if flushed:
            names = ", ".join(f"{p.name} {_pct(p.grad_zero)}" for p in flushed[:5]) + (", ..." if len(flushed) > 5 else "")
            parts.append(f"zero fraction {names}, with the non-zero values FP16 subnormals at the loss scale "
                         f"{_pow2(loss_scale)}")
        mods = ", ".join(dict.fromkeys(p.module or "(root)" for p in [*all_zero, *flushed]))
        findings.append(
            f"Gradients computed in FP16 are largely exact zeros ({'; '.join(parts)}; modules {mods}): zeros in FP16 "
            "gradients can be underflow, values flushed to zero before the monitor saw them, which the underflow "
            "figures (non-zero values only) do not count. Use a larger loss scale, dynamic scaling (ls=dynamic) or "
            "bf16; monitoring an FP32 run (as mixprec doctor does) measures what FP16 loses.")

    # stagnation, over the weights a half-precision preset would store in half precision: an FP32
    # island's weights (norm layers under every preset) stay FP32, so their small updates are kept.
    half = [p for p in params if not p.fp32_island]
    updated = sum(p.updated or 0 for p in half)
    stagnation: dict[str, Any] = {"bf16": None, "f16": None, "worst": []}
    if update_measured:
        stag_b = sum((p.stagnant_bf16 or 0) * (p.updated or 0) for p in half)
        stag_h = sum((p.stagnant_f16 or 0) * (p.updated or 0) for p in half)
        stagnation["bf16"] = stag_b / updated if updated else 0.0
        stagnation["f16"] = stag_h / updated if updated else 0.0
        worst = sorted((p for p in half if p.updated), key=lambda p: -(p.stagnant_bf16 or 0))[:5]
        stagnation["worst"] = [[p.name, p.stagnant_bf16] for p in worst if p.stagnant_bf16]
        if stagnation["bf16"] > STAGNATION_WARN:
            names = ", ".join(n for n, _ in stagnation["worst"][:3])
            findings.append(
                f"{_pct(stagnation['bf16'])} of weight updates are below half a BF16 ulp of the weight (most in {names}): "
                "BF16 weights without FP32 masters would not move there. Keep FP32 weights (bf16-mixed) or masters "
                "(bf16-master), or use compensated updates (bf16-pure); avoid bf16-true."
            )

    # islands and presets
    # (4) islands where they can help: not for a module whose output itself exceeds FP16's range
    islands: list[str] = []
    for m in risk:
        if m.name and not m.norm_island and m not in output_overflow:
            islands.append(f"name:{m.name}")
    fp16_ok = sr.feasible and not output_overflow and all(m.name or m.norm_island for m in risk)
    fp16_policy = None
    if fp16_ok:
        island_spec = "+".join(["norm", *islands])
        init = sr.recommended if sr.recommended is not None else 2.0**16
        fp16_policy = str(Policy.parse(f"p=f32,c=f16,o=f32,ls=dynamic:{int(init) if init >= 1 else init},i={island_spec}"))
    if bf16_supported:
        preset = "bf16-mixed"
        findings.append("Recommended bf16-mixed: BF16 has FP32's exponent range, so no loss scaling is needed"
                        + (" and the FP16 overflows above do not occur" if risk else "")
                        + "; FP32 weights keep small updates.")
    elif fp16_ok:
        preset = "fp16-mixed"
        findings.append(f"This device has no BF16: use FP16 with the policy below (static scale {_pow2(sr.recommended)} or "
                        "dynamic scaling starting there" + (f", FP32 islands {', '.join(islands)})." if islands else ")."))
    else:
        preset = "fp32"
        rescale = (f" (or rescale the outputs of {', '.join(m.name or '(root)' for m in output_overflow)} into FP16's "
                   "range)" if output_overflow else "")
        findings.append(f"This device has no BF16 and FP16 cannot hold this model's values: stay in FP32 (or TF32)"
                        f"{rescale}.")
    if not findings:
        findings.append("No numerical problems seen.")

    hist = {"activation_grads": act_grads.summary(), "param_grads": param_grads.summary()}
    if activations is not None:
        hist["activations"] = activations.summary()
    return NumericsReport(
        device=device, sampled_steps=sampled_steps, every=every, loss_scale=loss_scale, modules=modules, params=params,
        overflow_risk=[m.name for m in risk], activation_grad_underflow=ag, param_grad_underflow=pg, grad_absmax=gmax,
        scale_range=sr, stagnation=stagnation, recommended_islands=islands, recommended_preset=preset,
        fp16_policy=fp16_policy, findings=findings, histograms=hist,
    )
