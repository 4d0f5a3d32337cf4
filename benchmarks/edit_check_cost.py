#!/usr/bin/env python
"""The master presets' edit check on GPT-2's parameter shapes: the Triton kernel against the foreach check.

    python benchmarks/edit_check_cost.py --device cuda      # both routes, side by side, with GB/s
    python benchmarks/edit_check_cost.py                     # a CPU: the foreach route only (no Triton there)
    python benchmarks/edit_check_cost.py --scale-down 64     # smaller shapes (the tests' size)

The check is ``master = where(weight == round(master), master, weight)`` over every (FP32 master,
half weight) pair before each ``*-master`` step (``_master.carry_edits_``). Rows: ``foreach`` (four
flat ops per group and 32M elements, ~48 bytes of traffic per element) and, where
``mixprec._edit_kernel`` runs (CUDA with Triton), ``triton`` (one launch per group, 6 bytes read
per element). Each row: the median of ``--reps`` timed calls (CUDA events on a GPU), the bytes
that row moves per call divided by that time, and the ratio to the foreach row measured in the
same process. Both rows also check their result against the elementwise ``where`` (a planted
edit in every tensor), so a wrong kernel cannot post a fast number.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

try:
    import mixprec  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

import mixprec._edit_kernel as ek
from mixprec._master import EditViews, _carry_edits
from mixprec.optim._rounding import with_edits

#: Bytes per element each route moves: foreach (two copies, a compare, a lerp); the kernel's reads.
BYTES = {"foreach": 48, "triton": 6}


def gpt2_shapes(scale_down: float) -> list[tuple[int, ...]]:
    """GPT-2 124M's parameter shapes (12 blocks, 768 wide, vocabulary 50257, 1024 positions), each dimension shrunk."""
    k = scale_down ** 0.5
    d, vocab, ctx = max(8, round(768 / k)), max(8, round(50257 / k)), max(8, round(1024 / k))
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(12):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [*shapes, (d,), (d,)]


def measure(route: str, masters: list[torch.Tensor], weights: list[torch.Tensor], reps: int) -> float:
    """Median seconds of one edit check through ``route`` ("foreach" or "triton"); raises if its result is wrong."""
    device = masters[0].device
    saved = ek.DEVICES
    ek.DEVICES = frozenset({device.type}) if route == "triton" else frozenset()
    try:
        views = EditViews()
        want = [with_edits(m, w) for m, w in zip(masters, weights)]
        got = [m.clone() for m in masters]
        _carry_edits(got, weights, views)
        if route == "triton" and not views.kernels:
            raise RuntimeError("the Triton route did not engage (no Triton, or its first-use check failed: see the warning)")
        for a, b in zip(got, want):
            if not torch.equal(a, b):
                raise RuntimeError(f"the {route} edit check disagrees with where()")
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                _carry_edits(got, weights, views)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                _carry_edits(got, weights, views)
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        ek.DEVICES = saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="the model's weights")
    ap.add_argument("--scale-down", type=float, default=1.0, help="divide the parameter count by about this")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    from mixprec.bench._timing import device_or_exit

    device = device_or_exit(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    g = torch.Generator().manual_seed(0)
    masters = [(torch.randn(s, generator=g) * 0.02).to(device) for s in gpt2_shapes(args.scale_down)]
    weights = [m.to(dtype) for m in masters]
    for w in weights:
        w.view(-1)[0] = 0.5  # one planted edit per tensor (the check must carry it)
    n = sum(m.numel() for m in masters)
    routes = ["foreach"] + (["triton"] if ek.available(device, dtype, torch.float32) or device.type in ek.DEVICES else [])
    print(f"edit_check_cost: torch {torch.__version__}, {device}, {args.dtype} weights, {len(masters)} tensors, "
          f"{n / 1e6:.1f}M elements, median of {args.reps}", flush=True)
    print(f"{'route':8s} {'ms':>8s} {'GB/s':>8s} {'vs foreach':>10s}", flush=True)
    base = None
    for route in routes:
        sec = measure(route, masters, weights, args.reps)
        base = base or sec
        print(f"{route:8s} {sec * 1e3:8.3f} {BYTES[route] * n / sec / 1e9:8.1f} {sec / base:9.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
