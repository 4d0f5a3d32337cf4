"""Reports for ``compare``: the terminal table and the JSON file (the environment record is ``_environment.py``)."""

from __future__ import annotations

import io
import json
import math
import os
import sys
from pathlib import Path
from typing import IO, Any

from ._environment import environment
from ._runner import CompareResult, RowResult
from ._seeds import MIN_SEEDS, SeedsResult

__all__ = ["environment", "format_seeds_table", "format_table_plain", "print_report", "print_seeds_report", "write_json"]


# ----- formatting -----------------------------------------------------------------------------
def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _num(x: float | None, fmt: str = ".4f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "nan" if isinstance(x, float) else "-"
    return format(x, fmt)


def _gap(x: float | None, fmt: str = "+.4f") -> str:
    return "-" if x is None else format(x, fmt)


def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def _scale(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 1024 and float(x).is_integer() and (int(x) & (int(x) - 1)) == 0:
        return f"2^{int(x).bit_length() - 1}"
    return f"{x:g}"


def table_rows(result: CompareResult) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the comparison table (strings), shared by rich and plain output."""
    unit = result.workload.get("unit", "samples")
    metric = result.workload.get("metric")
    gpu = result.settings.get("device", "cpu").startswith("cuda")
    header = [
        "precision", "step ms", "p10-p90", f"{'tok' if unit == 'tokens' else 'samples'}/s",
        "peak mem", "B/param", "train loss", "Δ fp32", "val loss", "Δ fp32",
    ]
    if metric:
        header += [f"val {metric[:3] if metric == 'accuracy' else metric}", "Δ fp32"]
    header += ["skipped", "scale"]
    if gpu:
        header.append("MFU")
    compiled = bool(result.settings.get("compile"))
    if compiled:
        header.insert(3, "compile s")
        header.insert(4, "warm s")
        header.insert(5, "recompiles")
    cells: list[list[str]] = []
    for r in result.rows:
        if r.status != "ok":
            cells.append([r.label, r.status] + ["-"] * (len(header) - 2))
            continue
        t = r.step_time_ms or {}
        row = [
            r.label,
            _num(t.get("median"), ".2f"),
            f"{_num(t.get('p10'), '.2f')}-{_num(t.get('p90'), '.2f')}",
            _rate(r.throughput),
            _bytes(r.peak_memory_bytes),
            _num(r.model_state_bytes_per_param, ".1f"),
            _num(r.final_train_loss),
            _gap(r.train_loss_gap),
            _num(r.val_loss),
            _gap(r.val_loss_gap),
        ]
        if metric:
            row += [_num(r.val_metric, ".3f"), _gap(r.val_metric_gap, "+.3f")]
        row += [str(r.skipped_steps if r.skipped_steps is not None else "-"), _scale(r.final_loss_scale)]
        if gpu:
            row.append("-" if r.mfu is None else f"{100 * r.mfu:.1f}%")
        if compiled:
            row.insert(3, _num(r.compile_seconds, ".1f"))
            row.insert(4, _num(r.warm_compile_seconds, ".1f"))
            row.insert(5, "-" if r.recompiles is None else str(r.recompiles))
        cells.append(row)
    return header, cells


def _title(result: CompareResult) -> str:
    w, s, e = result.workload, result.settings, result.environment
    return (
        f"mixprec compare: {w['name']} on {e.get('device_name') or s['device']} ({s['device']}), "
        f"{s['steps']} steps ({s['warmup']} warm-up), torch {e['torch']}"
        + (f", compiled ({s['compile']})" if s.get("compile") else "")
    )


def format_table_plain(result: CompareResult) -> str:
    """The table as plain aligned text (used when rich is not installed)."""
    header, cells = table_rows(result)
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    lines = [_title(result), result.workload.get("description", "")]
    lines.append("  ".join(h.ljust(widths[i]) for i, h in enumerate(header)))
    lines.append("  ".join("-" * widths[i] for i in range(len(header))))
    for c in cells:
        lines.append("  ".join(x.ljust(widths[i]) for i, x in enumerate(c)).rstrip())
    lines += [f"{r.label} {r.status}: {r.reason}" for r in result.rows if r.status != "ok"]
    lines += [f"* {n}" for n in result.notes]
    return "\n".join(lines)


def print_report(result: CompareResult, file: IO[str] | None = None) -> None:
    """Print the table (rich when installed, plain text otherwise) and the notes."""
    file = file if file is not None else sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table_plain(result), file=file)
        return
    probe = Console(file=file)
    console = Console(file=file, width=probe.width if probe.is_terminal else 200)
    header, cells = table_rows(result)
    styles = ["dim" if r.status != "ok" else ("italic" if r.kind == "baseline" else None) for r in result.rows]

    def build(cols: list[int], title: str | None, caption: str | None, label_width: int | None = None) -> Any:
        table = Table(title=title, caption=caption, header_style="bold")
        for i in cols:
            table.add_column(header[i], justify="left" if i == 0 else "right", no_wrap=i != 0,
                             min_width=label_width if i == 0 else None, max_width=label_width if i == 0 else None)
        for style, c in zip(styles, cells):
            table.add_row(*(c[i] for i in cols), style=style)
        return table

    wide = Console(file=io.StringIO(), width=10_000)
    everything = list(range(len(header)))
    table = build(everything, _title(result), result.workload.get("description"))
    if wide.measure(table).maximum <= console.width:
        console.print(table)
    else:
        # A narrow terminal: several tables, each led by the precision column (labels wrapped
        # at a fixed width), packed greedily with as many columns as fit.
        label_width = min(max(len(c[0]) for c in cells), max(12, console.width // 4))
        groups: list[list[int]] = [[0]]
        for i in everything[1:]:
            trial = groups[-1] + [i]
            if len(groups[-1]) > 1 and wide.measure(build(trial, None, None, label_width)).maximum > console.width:
                groups.append([0, i])
            else:
                groups[-1] = trial
        for k, cols in enumerate(groups):
            console.print(build(cols, _title(result) if k == 0 else None,
                                result.workload.get("description") if k == len(groups) - 1 else None, label_width))
    for r in result.rows:
        if r.status != "ok":
            console.print(f"{r.label} {r.status}: {r.reason}", highlight=False, markup=False)
    for n in result.notes:
        console.print(f"* {n}", highlight=False, markup=False)


def seeds_table_rows(result: SeedsResult) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the multi-seed table: per row the mean loss, the gap to fp32 and the verdict."""
    what = "val loss" if result.metric == "val_loss" else "train loss"
    header = ["precision", f"{what} (mean)", "gap mean", "spread (std)", "gap min..max", "verdict"]
    cells = []
    for r in result.rows:
        vals = [v for v in r.values if v is not None and math.isfinite(v)]
        mean = sum(vals) / len(vals) if len(vals) == len(r.values) else None
        span = "-" if r.gap_min is None or r.gap_max is None else f"{r.gap_min:+.4f}..{r.gap_max:+.4f}"
        cells.append([r.label, _num(mean), _gap(r.gap_mean), _num(r.gap_std), span, r.verdict])
    return header, cells


def format_seeds_table(result: SeedsResult) -> str:
    """The multi-seed summary as plain aligned text: one line per row, ending in its verdict."""
    header, cells = seeds_table_rows(result)
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    seeds = ",".join(str(s) for s in result.seeds)
    noise = "-" if result.noise is None else f"{result.noise:.4f}"
    lines = [f"Is the gap real? {len(result.seeds)} seeds ({seeds}); fp32 noise (std of its {result.metric} across "
             f"seeds) {noise}; within noise when the gap's 95 % interval lies inside ±{result.k:g} x noise "
             f"(no verdict with fewer than {MIN_SEEDS} seeds)"]
    lines.append("  ".join(h.ljust(widths[i]) for i, h in enumerate(header)).rstrip())
    lines.append("  ".join("-" * widths[i] for i in range(len(header))))
    for c in cells:
        lines.append("  ".join(x.ljust(widths[i]) for i, x in enumerate(c)).rstrip())
    lines += [f"* {n}" for n in result.notes]
    return "\n".join(lines)


def print_seeds_report(result: SeedsResult, file: IO[str] | None = None) -> None:
    """Print the first seed's full table (speed, memory, ...) and then the multi-seed summary."""
    file = file if file is not None else sys.stdout
    print(f"Seed {result.seeds[0]} (speed, memory and losses of one run; the seed summary follows):", file=file)
    print_report(result.runs[0], file)
    print("", file=file)
    print(format_seeds_table(result), file=file)


def write_json(result: CompareResult | SeedsResult, path: str | os.PathLike[str] | IO[str]) -> None:
    """Write the JSON record (``-`` for standard output); a :class:`SeedsResult` adds the ``seeds`` section."""
    text = json.dumps(result.to_dict(), indent=2, allow_nan=False)
    if hasattr(path, "write"):
        path.write(text + "\n")
        return
    if str(path) == "-":
        sys.stdout.write(text + "\n")
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text + "\n", encoding="utf-8")


__all__ += ["RowResult", "SeedsResult", "seeds_table_rows", "table_rows"]
