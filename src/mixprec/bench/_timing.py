"""Step timing with device synchronisation, robust summaries, GPU peak throughput for MFU, op counts.

Every timed step is bracketed by a device synchronisation (``torch.cuda.synchronize`` on
CUDA; nothing to wait for on a CPU) and read with ``time.perf_counter``, so a step's time is
the wall time until its last kernel has finished. Summaries use the median and the 10th-90th
percentile range, which one slow step (a page fault, another process) does not move.
"""

from __future__ import annotations

import collections
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DENSE_PEAK_TFLOPS", "OpCounter", "device_or_exit", "peak_tflops", "percentile", "summarize", "synchronize",
           "timed"]

T = TypeVar("T")


def device_or_exit(name: str) -> torch.device:
    """A benchmark's ``--device``: the device, or exit 2 with a clear line when this machine has none such (no traceback)."""
    import sys

    try:
        device = torch.device(name)
    except RuntimeError as e:
        print(f"--device {name!r}: not a device ({e}); use cpu or cuda", file=sys.stderr)
        raise SystemExit(2) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {name}: this machine has no CUDA device (torch {torch.__version__}); run it on a GPU, or with "
              "--device cpu", file=sys.stderr)
        raise SystemExit(2)
    if device.type not in ("cpu", "cuda", "xpu"):
        print(f"--device {name}: the benchmarks run on cpu, cuda or xpu, got {device.type}", file=sys.stderr)
        raise SystemExit(2)
    try:
        torch.empty(1, device=device)  # cuda:N past the device count, xpu without one: fails here, not mid-benchmark
    except Exception as e:  # whatever the backend raises: one line, not its dispatch table
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"--device {name}: not usable on this machine ({type(e).__name__}: {first}); use cpu or cuda", file=sys.stderr)
        raise SystemExit(2) from None
    return device


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on ``device`` (a no-op on CPU, whose operators are synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu" and hasattr(torch, "xpu"):
        torch.xpu.synchronize(device)
    elif device.type == "mps" and hasattr(torch, "mps"):
        torch.mps.synchronize()


class OpCounter(TorchDispatchMode):
    """Count the ATen operators that reach the dispatcher inside ``with OpCounter() as c:``, by name.

    ``c.ops`` maps the op's name (``"_foreach_norm"``, ``"_local_scalar_dense"`` for a host read,
    ...) to its count; a fused foreach op counts once, whatever the number of tensors. On a GPU
    each is at least one kernel launch, so the counts show launches per step without a profiler.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """Run ``fn`` between two device synchronisations; return its result and the seconds taken."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between order statistics."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def summarize(seconds: Sequence[float]) -> dict[str, Any]:
    """Median, p10, p90, mean (milliseconds) and the number of timed steps."""
    ms = [s * 1e3 for s in seconds]
    return {
        "median": percentile(ms, 50),
        "p10": percentile(ms, 10),
        "p90": percentile(ms, 90),
        "mean": sum(ms) / len(ms) if ms else math.nan,
        "n": len(ms),
    }


# Dense (no 2:4 sparsity) peak tensor throughput in TFLOP/s by compute kind, from the vendors'
# data sheets (NVIDIA H100/H200/A100/L4/L40S/A10/T4/V100 product briefs; GeForce figures are
# FP16/BF16 with FP32 accumulation). "fp32" is the non-tensor-core FP32 rate.
# Matched against torch.cuda.get_device_name() in order: the first pattern that matches wins.
DENSE_PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    (r"GH200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (r"H200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (r"H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    (r"H100", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),  # SXM5 (e.g. "H100 80GB HBM3")
    (r"B200", {"fp32": 80.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0}),
    (r"A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05}),
    (r"L40\b", {"fp32": 90.5, "tf32": 90.5, "bf16": 181.0, "fp16": 181.0}),
    (r"\bL4\b", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    (r"\bA10\b", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    (r"RTX 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
    (r"RTX 3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}),
    (r"V100-PCIE|V100 PCIe", {"fp32": 14.0, "fp16": 112.0}),
    (r"V100", {"fp32": 15.7, "fp16": 125.0}),
    (r"\bT4\b", {"fp32": 8.1, "fp16": 65.0}),
]


def peak_tflops(device_name: str, kind: str) -> float | None:
    """The device's dense peak TFLOP/s for ``kind`` ("fp32", "tf32", "bf16", "fp16"), or ``None``
    when the device (or that kind on it) is not in :data:`DENSE_PEAK_TFLOPS`."""
    for pattern, peaks in DENSE_PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peaks.get(kind)
    return None


def count_flops(fn: Callable[[], Any]) -> int | None:
    """FLOPs of the matmuls, convolutions and attention that ``fn`` runs (forward and backward),
    by ``torch.utils.flop_counter``; ``None`` when counting fails."""
    try:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            fn()
        return int(counter.get_total_flops())
    except Exception:  # counting is best effort: an unknown op must not fail the benchmark
        return None
