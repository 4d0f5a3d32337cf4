#!/usr/bin/env python
"""The master step with remainder-stored masters (bf16-master-r16) against full FP32 masters (bf16-master).

    python benchmarks/remainder_step_cost.py                      # CPU: ~4M parameters in 24 tensors, eager and fused
    python benchmarks/remainder_step_cost.py --device cuda --no-fused

Both rows step the same BF16 parameters (a GPT-shaped list of tensors) through
``MasterWeightOptimizer(torch.optim.AdamW(...))`` with a ``found_inf`` handed in, as ``MixedPrecision``
does: the eager step is torch's fused AdamW kernel (which skips on the device), the fused step the
compiled mixprec master step (``fused=True``). ``master_storage="remainder"`` adds a join of every
master before the update and a split after it. Steps are timed interleaved (A, B, A, B, ...); the
medians and their ratio are printed, with the persistent bytes per parameter of each row
(weights, masters or remainders, FP32 gradients, AdamW states).
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

from mixprec import MasterWeightOptimizer
from mixprec.bench._memory import state_tensors


def shapes(width: int, blocks: int) -> list[tuple[int, ...]]:
    """A GPT block's weight matrices (attention in/out, MLP up/down) per block, no norms or biases."""
    out: list[tuple[int, ...]] = []
    for _ in range(blocks):
        out += [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)]
    return out


def build(storage: str, fused: bool, args: argparse.Namespace) -> tuple[list[torch.Tensor], MasterWeightOptimizer]:
    torch.manual_seed(0)
    from mixprec.bench._timing import device_or_exit

    dev = device_or_exit(args.device)
    masters = [torch.randn(s, device=dev) * 0.02 for s in shapes(args.width, args.blocks)]
    params = [torch.nn.Parameter(m.to(torch.bfloat16)) for m in masters]
    opt = MasterWeightOptimizer(
        torch.optim.AdamW(params, lr=1e-4), initial_masters=dict(zip(params, masters)),
        master_storage=storage, fused=fused,  # type: ignore[arg-type]
    )
    for m in opt.masters:  # the FP32 gradients the accumulation hook would have left
        m.grad = torch.randn(m.shape, device=dev) * 1e-3
    return params, opt


def step_ms(opt: MasterWeightOptimizer, found_inf: torch.Tensor, device: str) -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    opt.found_inf = found_inf  # type: ignore[attr-defined]  # the amp-scaling protocol MixedPrecision uses
    opt.step()
    sync()
    return (time.perf_counter() - t0) * 1e3


def bytes_per_param(params: list[torch.Tensor], opt: MasterWeightOptimizer) -> float:
    seen: dict[int, int] = {}
    for t in [*params, *state_tensors(torch.nn.Module(), opt)]:
        st = t.untyped_storage()
        if st.data_ptr():
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values()) / sum(p.numel() for p in params)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-fused", action="store_true", help="eager rows only (no Inductor compile)")
    args = ap.parse_args(argv)
    n = sum(torch.Size(s).numel() for s in shapes(args.width, args.blocks))
    print(f"# torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads; "
          f"{n / 1e6:.2f}M parameters in {4 * args.blocks} tensors, AdamW, found_inf handed in; medians of {args.steps}")
    print(f"{'step':8s} {'bf16-master ms':>15s} {'r16 ms':>8s} {'r16/full':>9s} {'full B/param':>13s} {'r16 B/param':>12s} {'compile s':>10s}")
    for fused in ([False] if args.no_fused else [False, True]):
        runs = {s: build(s, fused, args) for s in ("full", "remainder")}
        found_inf = torch.zeros((), device=args.device)
        compile_s = {}
        for s, (_, opt) in runs.items():
            t0 = time.perf_counter()
            step_ms(opt, found_inf, args.device)  # warm-up (and the compile of the fused step)
            compile_s[s] = time.perf_counter() - t0
        times: dict[str, list[float]] = {"full": [], "remainder": []}
        for _ in range(args.steps):
            for s, (_, opt) in runs.items():
                times[s].append(step_ms(opt, found_inf, args.device))
        full, rem = statistics.median(times["full"]), statistics.median(times["remainder"])
        bpp = {s: bytes_per_param(*runs[s]) for s in runs}
        comp = f"{compile_s['full']:.1f}/{compile_s['remainder']:.1f}" if fused else "-"
        print(f"{'fused' if fused else 'eager':8s} {full:15.2f} {rem:8.2f} {rem / full:8.2f}x {bpp['full']:13.2f} "
              f"{bpp['remainder']:12.2f} {comp:>10s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
