"""FP8 numerics: what a recipe's scaling does to a tensor, and which linears to run in FP8 (:func:`fp8_plan`).

FP8 training (torchao's dynamic scaling) multiplies each GEMM operand by a scale before the
cast: ``tensorwise`` one scale per tensor, ``448 / amax`` for E4M3 (``57344 / amax`` for the
E5M2 gradients); ``rowwise`` one per row along the GEMM's reduction dimension, rounded down to a
power of two, everything in E4M3. Nothing saturates under dynamic scaling (the largest value
lands on the format's maximum); what goes wrong is the other end: one huge value sets the scale
and the rest are pushed into the subnormals (3 mantissa bits and fewer) or flushed to zero.

:func:`fp8_cast_stats` counts this for one tensor; :func:`fp8_plan` does it for every
``nn.Linear`` of a model on the user's batch and decides per layer.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import json
import math
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._dtypes import dtype_name
from .._fp8 import (
    convert_for_policy,
    eligible_reason,
    fp8_disabled,
    fp8_emulated,
    is_fp8_linear,
    is_linear,
    island_members,
    linear_dims,
    linear_weight,
)
from .._policy import FP8_RECIPES, Policy
from .._tree import tree_leaves
from ._stats import _check_f8, fp8_scale, thresholds

__all__ = [
    "DEFAULT_SQNR_DB",
    "Fp8CastStats",
    "Fp8LayerDecision",
    "Fp8Plan",
    "apply_fp8",
    "fp8_cast_stats",
    "fp8_plan",
    "fp8_scale",
    "fp8_stats_table",
    "gpu_shape_gains",
]

#: Default SQNR threshold (dB) of :func:`fp8_plan`. Rounding alone costs a well-scaled GEMM about
#: 27-31 dB with E4M3 operands and 22-26 dB with an E5M2 gradient (measured on Gaussian
#: operands, and on the ``gpt`` workload's linears; docs/fp8.md); 20 dB keeps those and drops
#: layers whose operands lose values to flushing (the planted outlier layer measures < 10 dB).
DEFAULT_SQNR_DB = 20.0
_GEMMS = ("output", "grad_input", "grad_weight")


@dataclasses.dataclass(frozen=True)
class _Cast:
    dtype: torch.dtype  # float8_e4m3fn / float8_e5m2, or None-like bf16 for high precision
    granularity: str  # "tensorwise" | "rowwise" | "hp"
    dim: int  # reduction dimension the rowwise scale runs along
    pow2: bool


def _recipe_casts(recipe: str) -> dict[str, tuple[_Cast, _Cast]]:
    """Per GEMM, the casts of its two operands under torchao's recipe of this name (torchao 0.18 config.py).

    output = input (M,K) @ weight.T (K,N); grad_input = grad_output (M,N) @ weight (N,K);
    grad_weight = grad_output.T (N,M) @ input (M,K).
    """
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    if recipe == "tensorwise":
        i, w, g = _Cast(e4, "tensorwise", -1, False), _Cast(e4, "tensorwise", -1, False), _Cast(e5, "tensorwise", -1, False)
        return {"output": (i, w), "grad_input": (g, w), "grad_weight": (g, i)}
    if recipe == "rowwise":
        return {
            "output": (_Cast(e4, "rowwise", -1, True), _Cast(e4, "rowwise", -1, True)),
            "grad_input": (_Cast(e4, "rowwise", -1, True), _Cast(e4, "rowwise", 0, True)),
            "grad_weight": (_Cast(e4, "rowwise", 0, True), _Cast(e4, "rowwise", 0, True)),
        }
    if recipe == "rowwise_gw_hp":
        hp = _Cast(torch.bfloat16, "hp", -1, False)
        return {
            "output": (_Cast(e4, "rowwise", -1, True), _Cast(e4, "rowwise", -1, True)),
            "grad_input": (_Cast(e4, "rowwise", -1, True), _Cast(e4, "tensorwise", -1, True)),
            "grad_weight": (hp, hp),
        }
    raise ValueError(f"unknown FP8 recipe {recipe!r}; use one of {', '.join(FP8_RECIPES)}.")


def _quantize(t: torch.Tensor, cast: _Cast) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized FP32 tensor, scaled FP32 values before rounding) under ``cast``."""
    x = t.detach().float()
    if cast.granularity == "hp":
        return x.to(cast.dtype).float(), x
    scale = fp8_scale(x, cast.dtype, cast.granularity, cast.dim, cast.pow2)
    scaled = x * scale
    fmax = torch.finfo(cast.dtype).max
    # Clamp before the cast: torch saturates E4M3 at 448 but turns E5M2 overflow into inf.
    q = scaled.clamp(-fmax, fmax).to(cast.dtype).float()
    return q / scale, scaled


@dataclasses.dataclass(frozen=True)
class Fp8CastStats:
    """How one tensor fares when cast to FP8 under a scaling (counts over all elements).

    Attributes:
        dtype: ``f8e4m3`` or ``f8e5m2``.
        scaling: ``tensorwise``, ``rowwise`` or ``scale=<s>`` (a fixed scale).
        numel: Elements.
        amax: Largest finite magnitude before scaling.
        n_saturated: Finite elements that round beyond the format's maximum after scaling (past
            the midpoint to the next step, 464 for E4M3, 61440 for E5M2; clamped, as torchao clamps).
            clamps too). Zero under dynamic scaling, which maps amax onto the maximum.
        n_flushed: Non-zero elements that round to zero after scaling.
        n_subnormal: Elements that land among the subnormals (fewer than 3 or 2 mantissa bits).
        n_nonfinite: inf/NaN elements (a dynamic scale then makes everything else zero).
        sqnr_db: Signal-to-quantization-noise ratio of the round trip, in dB (``inf`` when exact).
    """

    dtype: str
    scaling: str
    numel: int
    amax: float
    n_saturated: int
    n_flushed: int
    n_subnormal: int
    n_nonfinite: int
    sqnr_db: float

    def _frac(self, n: int) -> float:
        return n / self.numel if self.numel else 0.0

    @property
    def frac_saturated(self) -> float:
        """Fraction of elements clamped to the format's maximum."""
        return self._frac(self.n_saturated)

    @property
    def frac_flushed(self) -> float:
        """Fraction of elements flushed to zero."""
        return self._frac(self.n_flushed)

    @property
    def frac_subnormal(self) -> float:
        """Fraction of elements among the subnormals."""
        return self._frac(self.n_subnormal)

    def to_dict(self) -> dict[str, Any]:
        """The fields and the ``frac_*`` properties, JSON-ready (non-finite floats as strings)."""
        d: dict[str, Any] = dataclasses.asdict(self)
        for k in ("frac_saturated", "frac_flushed", "frac_subnormal"):
            d[k] = getattr(self, k)
        return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fp8CastStats:
        """Inverse of :meth:`to_dict`."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {k: (float(v) if k in ("amax", "sqnr_db") else v) for k, v in d.items() if k in names}
        return cls(**kw)

    def __str__(self) -> str:
        return (
            f"{self.dtype} {self.scaling}: amax {self.amax:.3g}, saturated {self.frac_saturated:.2%}, "
            f"flushed {self.frac_flushed:.2%}, subnormal {self.frac_subnormal:.2%}, SQNR {self.sqnr_db:.1f} dB"
        )


def _sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    ref, approx = ref.double(), approx.double()
    signal = ref.square().sum()
    noise = (ref - approx).square().sum()
    return torch.where(noise == 0, math.inf, 10 * torch.log10(signal / noise.clamp(min=1e-300)))


@torch.no_grad()
def fp8_cast_stats(
    t: torch.Tensor, dtype: str | torch.dtype = "f8e4m3", scaling: str | float = "tensorwise", dim: int = -1,
    pow2: bool | None = None,
) -> Fp8CastStats:
    """Count what a cast of ``t`` to FP8 under ``scaling`` saturates, flushes and rounds into subnormals.

    Algorithm: the scale of :func:`fp8_scale` (or the fixed ``scaling`` number), ``t * scale``
    clamped to the format's range and rounded by torch's cast; counts against the cast result
    (a flush is a non-zero value that becomes zero), SQNR of the de-scaled round trip.

    Args:
        t: Any floating tensor.
        dtype: ``f8e4m3`` or ``f8e5m2``.
        scaling: ``tensorwise``, ``rowwise`` (along ``dim``) or a number (a fixed scale, e.g. 1.0).
        dim: The rowwise dimension.
        pow2: Power-of-two scales (default: rowwise only).

    Returns:
        :class:`Fp8CastStats`. Host sync: one (the counts are read back together).

    Raises:
        ValueError: a non-FP8 dtype or an unknown scaling. TypeError: ``t`` is not a tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fp8_cast_stats needs a tensor, got {type(t).__name__}")
    dt = _check_f8(dtype)
    if isinstance(scaling, (int, float)) and not isinstance(scaling, bool):
        if not (scaling > 0 and math.isfinite(scaling)):
            raise ValueError(f"a fixed FP8 scale must be positive and finite, got {scaling!r}")
        label = f"scale={float(scaling):g}"
    elif isinstance(scaling, str):
        if scaling not in ("tensorwise", "rowwise"):
            raise ValueError(f"FP8 scaling {scaling!r} is not known; use 'tensorwise', 'rowwise' or a number.")
        label = scaling
    else:
        raise TypeError(f"scaling is 'tensorwise', 'rowwise' or a number, got {scaling!r}")
    return _stats_from_counts(dt, label, cast_counts(t, dt, scaling, dim, pow2).tolist())  # the one host sync


#: The entries of :func:`cast_counts`, in order.
COUNT_FIELDS = ("amax", "numel", "n_saturated", "n_flushed", "n_subnormal", "n_nonfinite", "signal", "noise")


@torch.no_grad()
def cast_counts(
    t: torch.Tensor, dtype: torch.dtype, scaling: str | float = "tensorwise", dim: int = -1, pow2: bool | None = None
) -> torch.Tensor:
    """The counts of :func:`fp8_cast_stats` as one float64 tensor on ``t``'s device (no host sync).

    Entries (:data:`COUNT_FIELDS`): amax, numel, saturated, flushed, subnormal, non-finite, and
    the sums of squares of the signal and of the round-trip error (for the SQNR). Counts of
    several tensors add up (``amax`` takes the maximum), so a monitor can accumulate them on the device.
    """
    x = t.detach().float()
    finite = torch.isfinite(x)
    xf = torch.where(finite, x, 0.0)
    scale: torch.Tensor | float
    if isinstance(scaling, str):
        scale = fp8_scale(xf, dtype, scaling, dim, pow2)
    else:
        scale = float(scaling)
    fmax = torch.finfo(dtype).max
    scaled = xf * scale
    q = scaled.clamp(-fmax, fmax).to(dtype).float()
    tiny = torch.finfo(dtype).smallest_normal
    xd = xf.double()
    return torch.stack([
        xf.abs().amax().double() if x.numel() else torch.zeros((), dtype=torch.float64, device=x.device),
        torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device),
        (scaled.abs() > thresholds(dtype).overflow).sum().double(),
        ((q == 0) & (xf != 0)).sum().double(),
        ((q != 0) & (q.abs() < tiny)).sum().double(),
        (~finite).sum().double(),
        xd.square().sum(),
        (xd - (q / scale).double()).square().sum(),
    ])


def _stats_from_counts(dt: torch.dtype, label: str, c: list[float]) -> Fp8CastStats:
    signal, noise = c[6], c[7]
    sqnr = math.inf if noise == 0 else 10 * math.log10(max(signal, 1e-300) / noise)
    return Fp8CastStats(dtype_name(dt), label, int(c[1]), c[0], int(c[2]), int(c[3]), int(c[4]), int(c[5]), sqnr)


def apply_fp8(
    model: nn.Module, policy: Policy, batch: Any = None, loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None
) -> nn.Module:
    """Convert ``model``'s linears as ``policy``'s ``f8=`` asks (as ``prepare`` does; ``auto`` measured on ``batch``).

    For the numerics tools, which run a policy on a copy of the model. No-op without ``f8=``.

    Returns:
        ``model``. Raises what :func:`mixprec._fp8.convert_for_policy` raises.
    """
    convert_for_policy(model, policy, batch, loss_fn, planner=fp8_plan)
    return model


def fp8_stats_table(stats: dict[str, dict[str, Fp8CastStats]]) -> str:
    """A table of per-module, per-operand :class:`Fp8CastStats` (``NumericsMonitor.fp8_stats()``)."""
    lines = [f"{'module':<28} {'operand':<11} {'format':<7} {'amax':>9} {'saturated':>9} {'flushed':>8} {'subnormal':>9} "
             f"{'SQNR dB':>7}"]
    for name, ops in stats.items():
        for op, st in ops.items():
            lines.append(f"{name[-28:]:<28} {op:<11} {st.dtype:<7} {st.amax:>9.3g} {st.frac_saturated:>9.2%} "
                         f"{st.frac_flushed:>8.2%} {st.frac_subnormal:>9.2%} {st.sqnr_db:>7.1f}")
    return "\n".join(lines)


# ----- the per-layer plan ------------------------------------------------------------------------------


def gpu_shape_gains(recipe: str, in_features: int, out_features: int) -> bool:
    """Whether an FP8 linear of this shape is expected to beat BF16 on an H100 (torchao's documented crossover).

    The rule is torchao 0.18's ``_auto_filter_for_recipe`` (float8_linear_utils.py), derived from
    its H100 benchmark tables (torchao/float8/README.md, "performance"): tensorwise gains unless
    ``K <= 4096 and N <= 1024``; rowwise (and rowwise_gw_hp) only when ``N > 2048``, ``K > 1024``
    and not ``N <= 4096 and K <= 2048`` (K = in_features, N = out_features). It ignores the
    token count M and torch.compile, which both matter; treat it as a floor, not a measurement.
    """
    k, n = in_features, out_features
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


@dataclasses.dataclass(frozen=True)
class Fp8LayerDecision:
    """One linear in an :class:`Fp8Plan`: its measurements and the decision.

    Attributes:
        name: Qualified module name.
        in_features, out_features: K and N.
        tokens: M, the rows of the captured input (0 when the layer did not run).
        flops: FLOPs of its three GEMMs on the batch (``6 * M * K * N``).
        operands: Cast statistics of ``input``, ``weight`` (as the forward GEMM casts them) and
            ``grad_output`` (as the grad-input GEMM casts it).
        sqnr_db: Per GEMM (``output``, ``grad_input``, ``grad_weight``): SQNR in dB of the FP8
            GEMM against the same GEMM on the BF16 operands (``inf`` where the recipe keeps it
            in high precision).
        gpu_gain: :func:`gpu_shape_gains` for this shape.
        fp8: The decision.
        reason: One line saying why.
    """

    name: str
    in_features: int
    out_features: int
    tokens: int
    flops: int
    operands: dict[str, Fp8CastStats]
    sqnr_db: dict[str, float]
    gpu_gain: bool
    fp8: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["operands"] = {k: v.to_dict() for k, v in self.operands.items()}
        d["sqnr_db"] = {k: (v if math.isfinite(v) else str(v)) for k, v in self.sqnr_db.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fp8LayerDecision:
        """Inverse of :meth:`to_dict`."""
        kw = dict(d)
        kw["operands"] = {k: Fp8CastStats.from_dict(v) for k, v in d["operands"].items()}
        kw["sqnr_db"] = {k: float(v) for k, v in d["sqnr_db"].items()}
        return cls(**kw)


@dataclasses.dataclass(frozen=True)
class Fp8Plan:
    """Which linears run in FP8, from :func:`fp8_plan`: plain, printable, savable and accepted by a policy.

    Attributes:
        recipe: ``tensorwise``, ``rowwise`` or ``rowwise_gw_hp``.
        threshold_db: The SQNR a layer's worst GEMM needs to stay in FP8.
        shape_gate: Whether :func:`gpu_shape_gains` was applied (on a GPU with FP8 GEMMs) or only reported.
        device: The device the measurement ran on.
        layers: One :class:`Fp8LayerDecision` per linear, in module order (ineligible ones included).
    """

    recipe: str
    threshold_db: float
    shape_gate: bool
    device: str
    layers: tuple[Fp8LayerDecision, ...]

    VERSION = 1

    @property
    def fp8_layers(self) -> list[str]:
        """Qualified names of the linears the plan keeps in FP8."""
        return [d.name for d in self.layers if d.fp8]

    def policy(self, base: Policy | str = "bf16-mixed") -> Policy:
        """``base`` with ``f8=<recipe>`` and ``f8_layers=`` exactly this plan's layers (``none`` if no layer).

        Example:
            ``MixedPrecision(plan.policy()).prepare(model, opt)`` runs the plan without measuring again.
        """
        return Policy.parse(base).replace(fp8=self.recipe, fp8_layers=tuple(self.fp8_layers))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with a ``version`` key."""
        return {
            "version": self.VERSION, "recipe": self.recipe, "threshold_db": self.threshold_db,
            "shape_gate": self.shape_gate, "device": self.device, "layers": [d.to_dict() for d in self.layers],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fp8Plan:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: not a plan, or another version.
        """
        if not isinstance(d, dict) or d.get("version") != cls.VERSION:
            raise ValueError(f"not an FP8 plan of version {cls.VERSION} (got version {d.get('version') if isinstance(d, dict) else d!r}).")
        return cls(
            d["recipe"], float(d["threshold_db"]), bool(d["shape_gate"]), d["device"],
            tuple(Fp8LayerDecision.from_dict(x) for x in d["layers"]),
        )

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Fp8Plan:
        """Read a plan written by :meth:`save`."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def table(self) -> str:
        """The per-layer table: shape, FLOPs, per-operand amax/flushed/subnormal, per-GEMM SQNR, decision, reason."""
        head = (
            f"FP8 plan ({self.recipe}, SQNR >= {self.threshold_db:g} dB, GPU shape gate "
            f"{'applied' if self.shape_gate else 'reported, not applied'}; measured on {self.device}): "
            f"{len(self.fp8_layers)}/{len(self.layers)} linears in FP8"
        )
        rows = [
            f"{'layer':<28} {'K x N':>11} {'GFLOP':>7} {'in amax':>8} {'in flush':>8} {'go flush':>8} "
            f"{'SQNR out/gi/gw dB':>18} {'gpu':>4}  decision"
        ]
        for d in self.layers:
            i, g = d.operands.get("input"), d.operands.get("grad_output")
            s = "/".join("hp" if not math.isfinite(d.sqnr_db.get(k, math.nan)) else f"{d.sqnr_db[k]:.0f}" for k in _GEMMS) if d.sqnr_db else "-"
            rows.append(
                f"{d.name[-28:]:<28} {f'{d.in_features}x{d.out_features}':>11} {d.flops / 1e9:>7.3f} "
                f"{(f'{i.amax:.2g}' if i else '-'):>8} {(f'{i.frac_flushed:.1%}' if i else '-'):>8} "
                f"{(f'{g.frac_flushed:.1%}' if g else '-'):>8} {s:>18} {('yes' if d.gpu_gain else 'no'):>4}  "
                f"{'FP8 ' if d.fp8 else 'BF16'} {d.reason}"
            )
        return "\n".join([head, *rows])

    def __str__(self) -> str:
        return self.table()


def _gemm_operand_stats(
    gemm: str, x: torch.Tensor, w: torch.Tensor, go: torch.Tensor, casts: dict[str, tuple[_Cast, _Cast]]
) -> dict[str, Fp8CastStats]:
    """The two operands of one GEMM as that GEMM casts them (rowwise scales run along its reduction dim)."""
    a, b = {"output": (("input", x), ("weight", w)), "grad_input": (("grad_output", go), ("weight", w)),
            "grad_weight": (("grad_output", go), ("input", x))}[gemm]
    ca, cb = casts[gemm]
    return {a[0]: _op_stats(a[1], ca), b[0]: _op_stats(b[1], cb)}


def _worst_operand(ops: dict[str, Fp8CastStats]) -> tuple[str, Fp8CastStats]:
    return max(ops.items(), key=lambda kv: (kv[1].frac_flushed + kv[1].frac_subnormal, -kv[1].sqnr_db))


def fp8_plan(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    recipe: str = "tensorwise",
    *,
    threshold_db: float = DEFAULT_SQNR_DB,
    policy: Policy | str | None = None,
    layers: Iterable[str] | None = None,
    shape_gate: bool | None = None,
) -> Fp8Plan:
    """Measure every linear's GEMMs in FP8 against BF16 on ``batch`` and choose the layers that stay FP8.

    Algorithm: on a copy of ``model`` (the model, its gradients and the RNG are left as they
    were), one forward and backward under BF16 autocast with hooks capturing each linear's input
    and output gradient (first call of each module). Per linear, each of its three GEMMs is
    repeated with the operands cast as the recipe casts them (:func:`fp8_cast_stats`: dynamic
    scales, FP8 rounding, FP32 accumulation) and compared with the same GEMM on the BF16
    operands: the SQNR is the smaller of the whole result's and the median over its rows (a
    few outlier rows would otherwise hide that the others were flushed). A layer stays in FP8 when its worst GEMM's SQNR is ``>= threshold_db`` and,
    where the shape gate is applied, :func:`gpu_shape_gains` says the shape gains on an H100.

    Args:
        model: An FP32 model (prepared or not; FP8 linears are measured as plain linears).
        batch: One batch, as ``loss_fn`` takes it.
        loss_fn: ``loss_fn(model, batch) -> scalar``; ``None`` calls ``model(batch)`` and uses
            ``mean(output ** 2) / 2`` as the loss (gradients of some shape, not your loss's).
        recipe: ``tensorwise``, ``rowwise`` or ``rowwise_gw_hp``.
        threshold_db: Minimum SQNR (dB) of every FP8 GEMM of a layer kept in FP8.
        policy: Its FP32 islands are never FP8 (default: none but ``norm``).
        layers: Globs on qualified names to consider (default: every linear).
        shape_gate: Apply the GPU shape rule; ``None``: applied on a CUDA GPU with FP8 GEMMs
            (compute capability 8.9+), reported but not applied elsewhere.

    Returns:
        :class:`Fp8Plan`. Host syncs: one per operand statistic (a few per linear).

    Raises:
        ValueError: an unknown recipe, a non-positive threshold, a loss that is not a finite scalar.
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fp8_plan needs an nn.Module, got {type(model).__name__}")
    if recipe not in FP8_RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; use one of {', '.join(FP8_RECIPES)}.")
    if not (threshold_db > 0 and math.isfinite(threshold_db)):
        raise ValueError(f"threshold_db must be a positive number of dB, got {threshold_db!r} (default {DEFAULT_SQNR_DB}).")
    base = Policy.parse(policy) if policy is not None else Policy.parse("bf16-mixed")
    globs = list(layers) if layers is not None else None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    gate = (not fp8_emulated(device)) if shape_gate is None else bool(shape_gate)
    casts = _recipe_casts(recipe)

    work = copy.deepcopy(model)
    linears = [(n, m) for n, m in work.named_modules() if is_linear(m) and n]
    islands = island_members(work, base)
    captured: dict[str, dict[str, torch.Tensor]] = {}
    handles = []

    def fwd_hook(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if name not in captured and args and isinstance(args[0], torch.Tensor):
                x = args[0].detach()
                if torch.is_autocast_enabled(x.device.type):
                    x = x.to(torch.get_autocast_dtype(x.device.type))
                captured[name] = {"input": x}
        return hook

    def bwd_hook(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, grad_in: Any, grad_out: Any) -> None:
            rec = captured.get(name)
            if rec is not None and "grad_output" not in rec and grad_out and grad_out[0] is not None:
                rec["grad_output"] = grad_out[0].detach()
        return hook

    for name, mod in linears:
        handles.append(mod.register_forward_hook(fwd_hook(name)))
        handles.append(mod.register_full_backward_hook(bwd_hook(name)))
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), fp8_disabled(work):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                if loss_fn is not None:
                    loss = loss_fn(work, batch)
                else:
                    outs = [t for t in tree_leaves(work(batch)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
                    loss = sum((o.float().square().mean() / 2 for o in outs), torch.zeros((), device=device))
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"fp8_plan: loss_fn must return a scalar tensor, got {type(loss).__name__}")
            if not bool(torch.isfinite(loss.detach()).item()):
                raise ValueError(f"fp8_plan: the BF16 loss is {loss.item()}; the plan compares against a finite BF16 run.")
            with warnings.catch_warnings():
                # A first layer whose input needs no gradient still reports its grad_output: what we want.
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                loss.float().backward()
    finally:
        for h in handles:
            h.remove()

    decisions = []
    for name, mod in linears:
        if globs is not None and not any(fnmatch.fnmatchcase(name, g) for g in globs):
            continue
        k, n = linear_dims(mod)
        gain = gpu_shape_gains(recipe, k, n)
        why = None if is_fp8_linear(mod) else eligible_reason(mod, name, base, islands)
        rec = captured.get(name, {})
        if why is None and ("input" not in rec or "grad_output" not in rec):
            why = "did not run forward and backward on this batch"
        if why is not None:
            m_tokens = rec["input"].numel() // k if "input" in rec else 0
            decisions.append(Fp8LayerDecision(name, k, n, m_tokens, 6 * m_tokens * k * n, {}, {}, gain, False, why))
            continue
        x = rec["input"].reshape(-1, k)
        go = rec["grad_output"].reshape(-1, n)
        w = linear_weight(mod).detach()
        m_tokens = x.shape[0]
        ops = {
            "input": _op_stats(x, casts["output"][0]),
            "weight": _op_stats(w, casts["output"][1]),
            "grad_output": _op_stats(go, casts["grad_input"][0]),
        }
        sq = _gemm_sqnr(x, w, go, casts)
        worst_gemm = min(sq, key=lambda g: sq[g])
        if sq[worst_gemm] < threshold_db:
            op, st = _worst_operand(_gemm_operand_stats(worst_gemm, x, w, go, casts))
            reason = (
                f"{worst_gemm} GEMM SQNR {sq[worst_gemm]:.1f} dB < {threshold_db:g} dB: {op} amax {st.amax:.3g} under "
                f"{st.scaling} scaling flushes {st.frac_flushed:.1%} of its values and makes {st.frac_subnormal:.1%} subnormal"
            )
            fp8 = False
        elif gate and not gain:
            reason = f"SQNR ok ({sq[worst_gemm]:.1f} dB) but {k}x{n} is below torchao's H100 crossover for {recipe}"
            fp8 = False
        else:
            fp8 = True
            reason = f"worst GEMM ({worst_gemm}) SQNR {sq[worst_gemm]:.1f} dB >= {threshold_db:g} dB"
            if not gain:
                reason += "; too small to gain on an H100 (shape gate not applied here)"
        decisions.append(Fp8LayerDecision(name, k, n, m_tokens, 6 * m_tokens * k * n, ops, sq, gain, fp8, reason))
    return Fp8Plan(recipe, float(threshold_db), gate, str(device), tuple(decisions))


def _op_stats(t: torch.Tensor, cast: _Cast) -> Fp8CastStats:
    if cast.granularity == "hp":
        return fp8_cast_stats(t, "f8e4m3", "rowwise", cast.dim)  # reported only; this operand stays high precision
    return fp8_cast_stats(t, cast.dtype, cast.granularity, cast.dim, cast.pow2)


@torch.no_grad()
def _gemm_sqnr(x: torch.Tensor, w: torch.Tensor, go: torch.Tensor, casts: dict[str, tuple[_Cast, _Cast]]) -> dict[str, float]:
    """SQNR (dB) of each FP8 GEMM against the GEMM of the BF16 operands, both accumulated in FP32."""
    xb, wb, gb = x.to(torch.bfloat16).float(), w.to(torch.bfloat16).float(), go.to(torch.bfloat16).float()
    refs = {"output": xb @ wb.T, "grad_input": gb @ wb, "grad_weight": gb.T @ xb}
    operands = {"output": (x, w.T), "grad_input": (go, w), "grad_weight": (go.T, x)}
    out: dict[str, float] = {}
    for gemm, (a, b) in operands.items():
        ca, cb = casts[gemm]
        if ca.granularity == "hp":
            out[gemm] = math.inf
            continue
        # The casts' dims refer to the untransposed tensors (x, w, go); transpose back for the cast.
        qa = _quantize(a.T, ca)[0].T if gemm == "grad_weight" else _quantize(a, ca)[0]
        qb = _quantize(b.T, cb)[0].T if gemm == "output" else _quantize(b, cb)[0]
        ref, got = refs[gemm], qa @ qb
        # Whole-tensor SQNR is dominated by the largest rows (a few outlier tokens can hide that
        # every other row was flushed), so the per-row median counts too.
        per_row = _sqnr_rows_db(ref, got)
        out[gemm] = float(torch.minimum(_sqnr_db(ref, got), per_row.median()))
    return out


def _sqnr_rows_db(ref: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    ref, approx = ref.double(), approx.double()
    signal = ref.square().sum(-1)
    noise = (ref - approx).square().sum(-1)
    db = 10 * torch.log10(signal.clamp(min=1e-300) / noise.clamp(min=1e-300))
    return torch.where(noise == 0, math.inf, torch.where(signal == 0, -math.inf, db))
