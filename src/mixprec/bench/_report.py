"""Reports for ``compare``: the environment record, the terminal table, and the JSON file."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import io
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import IO, Any

import torch

from ._runner import CompareResult, RowResult

__all__ = ["environment", "format_table_plain", "print_report", "write_json"]

# CPU features that decide how fast half precision can be on a CPU.
_CPU_FLAGS_OF_INTEREST = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "avx_vnni", "asimd", "bf16", "fphp", "asimdhp", "sve",
)


def _cpu_info() -> dict[str, Any]:
    model: str = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.split()
                if model and flags and key == "":
                    break
    except OSError:
        pass
    present = [f for f in _CPU_FLAGS_OF_INTEREST if f in flags]
    return {
        "model": model,
        "flags": present,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def environment(device: torch.device | str) -> dict[str, Any]:
    """The software and hardware a comparison ran on: versions, device, CPU flags, threads."""
    dev = torch.device(device)
    env: dict[str, Any] = {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "mixprec": _mixprec_version(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": dev.type,
        "cpu": _cpu_info(),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env["device_name"] = torch.cuda.get_device_name(dev)
        env["cuda"] = {
            "capability": f"{props.major}.{props.minor}",
            "memory_bytes": props.total_memory,
            "multiprocessors": props.multi_processor_count,
            "cudnn": torch.backends.cudnn.version(),
            "driver_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        }
    else:
        env["device_name"] = env["cpu"]["model"]
    for module, dist in (("transformers", "transformers"), ("sklearn", "scikit-learn"), ("matplotlib", "matplotlib"),
                         ("rich", "rich")):
        if module in sys.modules:
            version: str | None
            try:
                version = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                version = getattr(sys.modules[module], "__version__", None)
            env.setdefault("packages", {})[dist] = version
    return env


def _mixprec_version() -> str:
    try:
        from .. import __version__

        return __version__
    except Exception:  # pragma: no cover - a broken install still gets a report
        return "unknown"


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
        cells.append(row)
    return header, cells


def _title(result: CompareResult) -> str:
    w, s, e = result.workload, result.settings, result.environment
    return (
        f"mixprec compare: {w['name']} on {e.get('device_name') or s['device']} ({s['device']}), "
        f"{s['steps']} steps ({s['warmup']} warm-up), torch {e['torch']}"
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


def write_json(result: CompareResult, path: str | os.PathLike[str] | IO[str]) -> None:
    """Write the JSON record (``-`` for standard output)."""
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


__all__ += ["RowResult", "table_rows"]
