"""The environment record of a comparison: versions, device, CPU flags, threads.

A leaf of :mod:`mixprec.bench`: the runner records it and the report prints it.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import sys
from typing import Any

import torch

__all__ = ["environment"]

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
        from .._version import __version__

        return __version__
    except Exception:  # pragma: no cover - a broken install still gets a report
        return "unknown"
