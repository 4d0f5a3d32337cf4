"""PNG plots of a comparison (matplotlib's Agg canvas; no display, no global backend change).

Files written to the output directory:

* ``loss_curves.png``: the training loss of every row on one chart (raw steps faint, an
  exponential moving average bold), with each row's validation loss as a marker at the end; for a
  multi-seed comparison (``seeds=``) the mean over seeds of each row's moving average, bold, in a
  band from its minimum to its maximum across the seeds;
* ``loss_scale.png``: the loss scale of every row per step (log2 axis);
* ``memory.png``: peak memory during a step and persistent model-state bytes, per row;
* ``speed.png``: median step time with p10-p90 whiskers, and throughput, per row.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ._runner import CompareResult, RowResult
from ._seeds import SeedsResult
from ._workloads import BenchError

__all__ = ["PLOT_FILES", "write_plots"]

PLOT_FILES = ("loss_curves.png", "loss_scale.png", "memory.png", "speed.png")


def _figure(w: float = 8.0, h: float = 4.8) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise BenchError("plots need matplotlib: pip install matplotlib (or pip install 'mixprec[cli]')") from None
    fig = Figure(figsize=(w, h), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _ema(xs: list[float | None], alpha: float) -> list[float]:
    out, m = [], math.nan
    for x in xs:
        if x is None or not math.isfinite(x):
            out.append(math.nan)
            continue
        m = x if not math.isfinite(m) else alpha * x + (1 - alpha) * m
        out.append(m)
    return out


def _ok(result: CompareResult) -> list[RowResult]:
    return [r for r in result.rows if r.status == "ok"]


def _subtitle(result: CompareResult) -> str:
    s, e = result.settings, result.environment
    text = f"{result.workload['name']} - {e.get('device_name') or s['device']} - torch {e['torch']}"
    if s["device"] == "cpu":
        text += "\nCPU timings: they do not show GPU speed-ups"
    return text


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, format="png")


def write_plots(result: CompareResult, out_dir: str | Path, seeds: SeedsResult | None = None) -> list[Path]:
    """Write the four PNGs into ``out_dir`` (created if needed); returns their paths.

    With ``seeds`` (``result`` is then one of its runs), the loss curves show every row's band across seeds.

    Raises:
        BenchError: matplotlib is not installed.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = _ok(result)
    paths = [out / name for name in PLOT_FILES]
    colors = _colors(len(result.rows))
    color_of = {r.name: colors[i] for i, r in enumerate(result.rows)}

    # --- loss curves ---
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    n = max((len(r.losses) for r in rows), default=0)
    alpha = 2.0 / (max(4, n // 20) + 1)
    if seeds is not None:
        _seed_bands(ax, seeds, rows, color_of, alpha)
    else:
        for r in rows:
            xs = list(range(1, len(r.losses) + 1))
            ys = [math.nan if v is None else v for v in r.losses]
            ax.plot(xs, ys, color=color_of[r.name], alpha=0.18, linewidth=0.8)
            diverged = any(v is None or not math.isfinite(v) for v in r.losses)
            ax.plot(xs, _ema(r.losses, alpha), color=color_of[r.name], linewidth=1.8,
                    label=r.label + (" (diverged)" if diverged else ""),
                    linestyle="--" if r.kind == "baseline" else "-")
            if r.val_loss is not None and math.isfinite(r.val_loss) and xs:
                ax.plot([xs[-1]], [r.val_loss], marker="o", color=color_of[r.name], markersize=5)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    legend_text = ("bold: mean over seeds of the moving average - band: min-max across seeds" if seeds is not None
                   else "faint: per step - bold: moving average - dot: validation loss")
    ax.text(0.99, 0.99, legend_text, transform=ax.transAxes,
            fontsize=7, va="top", ha="right", color="#555555")
    title = "Loss curves" if seeds is None else f"Loss curves, seeds {','.join(str(x) for x in seeds.seeds)}"
    ax.set_title(f"{title}\n{_subtitle(result)}", fontsize=10)
    if rows:
        ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 0.94))
    ax.grid(alpha=0.3)
    _save(fig, paths[0])

    # --- loss scale ---
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    unscaled = []
    for r in rows:
        scales = [math.nan if v is None or v <= 0 else math.log2(v) for v in r.loss_scales]
        if not any(math.isfinite(v) and v != 0 for v in scales):
            unscaled.append(r.label)
            continue
        ax.step(range(1, len(scales) + 1), scales, where="post", color=color_of[r.name], label=r.label,
                linestyle="--" if r.kind == "baseline" else "-")
        skipped = [i + 1 for i in range(1, len(scales)) if scales[i] < scales[i - 1]]
        if skipped:
            ax.plot(skipped, [scales[i - 1] for i in skipped], "v", color=color_of[r.name], markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("log2(loss scale)   (triangles: overflow, step skipped)")
    title = "Loss-scale history"
    if unscaled:
        ax.text(0.01, 0.01, "scale 1 throughout: " + ", ".join(unscaled), transform=ax.transAxes, fontsize=7,
                va="bottom", ha="left", wrap=True)
    if len(unscaled) == len(rows):
        title += " (no row scales its loss)"
    ax.set_title(f"{title}\n{_subtitle(result)}", fontsize=10)
    if len(unscaled) < len(rows):
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, paths[1])

    # --- memory bars ---
    fig = _figure(8.0, 4.8)
    ax = fig.add_subplot(1, 1, 1)
    labels = [r.label for r in rows]
    mib = 1 << 20
    peak = [(r.peak_memory_bytes or 0) / mib for r in rows]
    state = [(r.model_state_bytes or 0) / mib for r in rows]
    xs = list(range(len(rows)))
    ax.bar([x - 0.2 for x in xs], peak, width=0.4, label="peak during a step", color="#4c72b0")
    ax.bar([x + 0.2 for x in xs], state, width=0.4, label="model state (params, grads, optimizer, masters)", color="#dd8452")
    for x, r in zip(xs, rows):
        if r.model_state_bytes_per_param is not None:
            ax.annotate(f"{r.model_state_bytes_per_param:.1f} B/param", (x + 0.2, state[x]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("MiB")
    method = next((r.memory_method for r in rows if r.memory_method), "")
    ax.set_title(f"Memory ({method})\n{_subtitle(result)}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, paths[2])

    # --- speed bars ---
    fig = _figure(9.0, 4.8)
    ax1 = fig.add_subplot(1, 2, 1)
    ax2 = fig.add_subplot(1, 2, 2)
    med = [(r.step_time_ms or {}).get("median", 0.0) for r in rows]
    lo = [max(0.0, m - (r.step_time_ms or {}).get("p10", m)) for m, r in zip(med, rows)]
    hi = [max(0.0, (r.step_time_ms or {}).get("p90", m) - m) for m, r in zip(med, rows)]
    cols = [color_of[r.name] for r in rows]
    ax1.bar(xs, med, yerr=[lo, hi], capsize=3, color=cols)
    ax1.set_ylabel("step time, ms (median, p10-p90)")
    ax2.bar(xs, [r.throughput or 0.0 for r in rows], color=cols)
    unit = result.workload.get("unit", "samples")
    ax2.set_ylabel(f"{unit}/s")
    for ax in (ax1, ax2):
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Speed\n{_subtitle(result)}", fontsize=10)
    _save(fig, paths[3])
    return paths


def _seed_bands(ax: Any, seeds: SeedsResult, rows: list[RowResult], color_of: dict[str, str], alpha: float) -> None:
    """Per row: the mean over seeds of the moving-average loss, and its min-max band across the seeds."""
    for r in rows:
        curves = []
        for run in seeds.runs:
            other = next((x for x in run.rows if x.name == r.name and x.status == "ok"), None)
            if other is not None:
                curves.append(_ema(other.losses, alpha))
        n = min((len(c) for c in curves), default=0)
        if not n:
            continue
        xs = list(range(1, n + 1))
        cols = [[c[i] for c in curves] for i in range(n)]
        lo = [min(v) if all(math.isfinite(x) for x in v) else math.nan for v in cols]
        hi = [max(v) if all(math.isfinite(x) for x in v) else math.nan for v in cols]
        mean = [sum(v) / len(v) if all(math.isfinite(x) for x in v) else math.nan for v in cols]
        ax.fill_between(xs, lo, hi, color=color_of[r.name], alpha=0.12, linewidth=0)
        label = r.label
        with_verdict = next((s for s in seeds.rows if s.name == r.name), None)
        if with_verdict is not None and with_verdict.within_noise is not None:
            label += " (within noise)" if with_verdict.within_noise else " (outside noise)"
        ax.plot(xs, mean, color=color_of[r.name], linewidth=1.8, label=label,
                linestyle="--" if r.kind == "baseline" else "-")


def _colors(n: int) -> list[str]:
    base = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd"]
    return [base[i % len(base)] for i in range(n)]
