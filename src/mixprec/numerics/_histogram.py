"""The activation-gradient histogram of ``mixprec doctor`` (matplotlib, imported lazily, Agg backend).

After Micikevicius et al. 2018, Fig. 3: magnitudes in log2 bins against the FP16 range (zero,
subnormal, normal, overflow) and BF16's range, before and after multiplying by the loss scale.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ._findings import NumericsReport
from ._stats import thresholds

__all__ = ["plot_gradient_histogram"]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install matplotlib (or pip install 'mixprec[cli]')") from None
    matplotlib.use("Agg")  # no display needed; also safe when a GUI backend was configured
    import matplotlib.pyplot as plt

    return plt


def plot_gradient_histogram(
    report: NumericsReport | dict[str, Any],
    path: str | Path,
    *,
    loss_scale: float | None = None,
    which: str = "activation_grads",
    title: str | None = None,
) -> Path:
    """Write a PNG of gradient magnitudes (log2 bins) with the FP16 and BF16 ranges, before and after scaling.

    Args:
        report: A :class:`NumericsReport` or its ``to_dict()``.
        path: The PNG file to write (parent directories are created).
        loss_scale: The scale of the lower panel; default: the report's recommended static scale
            (its current scale when there is none).
        which: ``"activation_grads"`` (default) or ``"param_grads"``.
        title: Figure title.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is missing (with an install hint).
        KeyError: ``which`` is not in the report's histograms.
    """
    plt = _pyplot()
    d = report.to_dict() if isinstance(report, NumericsReport) else report
    hist = d["histograms"][which]
    bins = {int(k): int(v) for k, v in hist["bins"].items()}
    total = int(hist["total"]) or 1
    zero = int(hist["zero"])
    if loss_scale is None:
        sr = d.get("scale_range") or {}
        loss_scale = sr.get("recommended") or d.get("loss_scale") or 1.0
    shift = round(math.log2(loss_scale))
    f16, bf16 = thresholds("f16"), thresholds("bf16")
    ks = sorted(bins) or [0]
    lo = min(ks[0] - 2, f16.log2_flush_bin - 4)
    hi = max(ks[-1] + shift + 2, f16.log2_overflow_bin + 3)

    # Constrained layout with the legend outside, below the axes: it leaves room for the legend, so
    # the legend never covers the panel titles, the figure title or the data (it once sat on them).
    fig, axes = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True, layout="constrained")
    for ax, s, label in ((axes[0], 0, "unscaled (loss scale 1)"), (axes[1], shift, f"after the loss scale 2^{shift}")):
        xs = [k + s for k in ks]
        ys = [bins.get(k, 0) / total for k in ks]
        # FP16 regions (value v in bin k: 2**k <= v < 2**(k+1))
        ax.axvspan(lo, f16.log2_flush_bin + 1, color="#d62728", alpha=0.12, label="FP16: flushes to 0")
        ax.axvspan(f16.log2_flush_bin + 1, f16.log2_normal_bin, color="#ff7f0e", alpha=0.12, label="FP16: subnormal")
        ax.axvspan(f16.log2_normal_bin, f16.log2_overflow_bin, color="#2ca02c", alpha=0.10, label="FP16: normal")
        ax.axvspan(f16.log2_overflow_bin, hi, color="#9467bd", alpha=0.12, label="FP16: overflows")
        bf_lo = int(math.log2(bf16.smallest_normal))
        bf_hi = bf16.log2_overflow_bin
        if lo <= bf_lo:
            ax.axvline(bf_lo, color="k", ls="--", lw=1, label="BF16 smallest normal (2^-126)")
        if hi >= bf_hi:
            ax.axvline(bf_hi, color="k", ls=":", lw=1, label="BF16 overflow (2^128)")
        ax.bar(xs, ys, width=0.9, align="edge", color="#1f77b4", label="gradient values")
        lost = sum(bins.get(k, 0) for k in ks if k + s <= f16.log2_flush_bin) / max(total - zero, 1)
        over = sum(bins.get(k, 0) for k in ks if k + s >= f16.log2_overflow_bin) / total
        ax.set_title(f"{label}: {lost:.1%} of non-zero values flush to zero in FP16, {over:.2%} overflow", fontsize=10)
        ax.set_ylabel("fraction of values")
        ax.set_xlim(lo, hi)
        if lo > bf_lo and hi < bf_hi:  # a legend-only entry: BF16's normal range covers the whole axis
            ax.plot([], [], " ", label=f"BF16: normal over the whole axis (2^{bf_lo}..2^{bf_hi - 1})")
    axes[1].set_xlabel("log2(|gradient|)   (bin k holds [2^k, 2^(k+1)))")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=8, framealpha=0.9)
    zero_txt = f"; {zero / total:.1%} exactly zero (not shown)" if zero else ""
    fig.suptitle(title or f"Activation-gradient magnitudes vs the FP16/BF16 ranges{zero_txt}", fontsize=11)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
