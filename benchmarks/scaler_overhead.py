"""Per-step cost of loss scaling (scale + unscale + update): mixprec vs torch.amp.GradScaler.

A GPT-2-small-shaped list of gradients (148 tensors, 124.4M elements; ``--scale-down F`` divides
the element count by about F for CPU runs, keeping the 148 tensors) is unscaled in place every
step. Variants, interleaved in one process (A B C A B C ..., rotating the order each round):

* ``torch``    ``torch.amp.GradScaler``: ``scale(loss)``, ``unscale_(opt)``, ``update()``
* ``drop-in``  ``mixprec.GradScaler``, same calls, torch-default configuration
* ``dynamic``  ``mixprec.DynamicScaler`` with its defaults (floor, ceiling, escalation and
  overflow-log checks every 10 steps): ``scale(loss)``, ``unscale_(params)``, ``update(found_inf)``

The scale is 1.0 so that repeated in-place unscaling keeps the values (and their speed: no
denormals); the kernels do the same work for any factor. Per-step time = block time / steps
per block (device synchronised at the block's end); the table gives median and p10-p90 over
the blocks. All variants unscale the same gradient tensors.

Kernel launches: for one ``unscale_`` the aten ops that reach the dispatcher are counted with a
``TorchDispatchMode`` (one fused ``_amp_foreach_non_finite_check_and_unscale_`` per
(device, dtype) group, nothing per parameter), for all-FP32 gradients and for a FP32 + BF16 mix;
on CUDA the profiler's kernel count is added (torch.amp cannot unscale BF16 gradients on CUDA:
it has no such kernel; mixprec falls back to two foreach ops for that group). The ratio is the median over rounds of
(variant / torch) within the same round.

Usage::

    python benchmarks/scaler_overhead.py --scale-down 16            # CPU
    python benchmarks/scaler_overhead.py --device cuda              # GPU, full size
    python benchmarks/scaler_overhead.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mixprec._grad_scaler import GradScaler
from mixprec._scaler import DynamicScaler
from mixprec.bench._timing import OpCounter


def gpt2_small_shapes(scale_down: float = 1.0) -> list[tuple[int, ...]]:
    """Parameter shapes of GPT-2 small (12 layers, d=768, vocab 50257, context 1024), optionally shrunk."""
    k = math.sqrt(scale_down)
    d, vocab, ctx = max(8, round(768 / k)), max(8, round(50257 / k)), max(8, round(1024 / k))
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(12):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    shapes += [(d,), (d,)]
    return shapes


def make_params(shapes: list[tuple[int, ...]], device: torch.device, mixed: bool = False) -> list[torch.nn.Parameter]:
    params = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for shape in shapes:
        dtype = torch.bfloat16 if mixed and len(shape) == 2 else torch.float32
        p = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        p.grad = (torch.randn(shape, generator=g) * 1e-3).to(device=device, dtype=dtype)
        params.append(p)
    return params



class Variant:
    """One scaler driven through scale + unscale + update."""

    def __init__(self, name: str, params: list[torch.nn.Parameter], device: torch.device) -> None:
        self.name = name
        self.params = params
        self.loss = torch.tensor(2.0, device=device)
        self.opt = torch.optim.SGD(params, lr=0.0)
        if name == "torch":
            self.scaler: Any = torch.amp.GradScaler(device.type, init_scale=1.0)
        elif name == "drop-in":
            self.scaler = GradScaler(device.type, init_scale=1.0)
        else:
            self.scaler = DynamicScaler(init_scale=1.0)

    def unscale(self) -> None:
        if self.name == "dynamic":
            self.found = self.scaler.unscale_(self.params)
        else:
            self.scaler.unscale_(self.opt)

    def step(self) -> None:
        self.scaler.scale(self.loss)
        self.unscale()
        if self.name == "dynamic":
            self.scaler.update(self.found)
        else:
            self.scaler.update()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_block(fn: Callable[[], None], n: int, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / n


def count_launches(name: str, params: list[torch.nn.Parameter], device: torch.device) -> dict[str, Any]:
    v = Variant(name, params, device)
    v.step()  # lazy state, caches
    v.scaler.scale(v.loss)
    with OpCounter() as c:
        v.unscale()
    out: dict[str, Any] = {"aten_ops": sum(c.ops.values()),
                           "fused_unscale_calls": c.ops["_amp_foreach_non_finite_check_and_unscale_"],
                           "ops": dict(c.ops)}
    if name == "dynamic":
        v.scaler.update(v.found)
    else:
        v.scaler.update()
    v.scaler.scale(v.loss)
    with OpCounter() as c:
        v.step()
    out["aten_ops_per_step"] = sum(c.ops.values())
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        v.scaler.scale(v.loss)
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            v.unscale()
            sync(device)
        out["cuda_kernels"] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        if name == "dynamic":
            v.scaler.update(v.found)
        else:
            v.scaler.update()
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            v.step()
            sync(device)
        out["cuda_kernels_per_step"] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scale-down", type=float, default=None,
                    help="divide the element count by about this (default: 16 on CPU, 1 on GPU)")
    ap.add_argument("--rounds", type=int, default=15, help="timed blocks per variant")
    ap.add_argument("--steps", type=int, default=None, help="steps per block (default: 5 on CPU, 50 on GPU)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up blocks per variant")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)

    from mixprec.bench._timing import device_or_exit

    device = device_or_exit(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    scale_down = args.scale_down if args.scale_down is not None else (1.0 if device.type == "cuda" else 16.0)
    steps = args.steps if args.steps is not None else (50 if device.type == "cuda" else 5)
    shapes = gpt2_small_shapes(scale_down)
    n_elem = sum(math.prod(s) for s in shapes)
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
           "threads": torch.get_num_threads(), "tensors": len(shapes), "elements": n_elem, "scale_down": scale_down,
           "steps_per_block": steps, "rounds": args.rounds}
    print(f"# scaler overhead: {len(shapes)} tensors, {n_elem / 1e6:.1f}M elements (scale-down {scale_down:g}), "
          f"{device}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")

    names = ["torch", "drop-in", "dynamic"]
    # all variants unscale the same gradient tensors (the scale is 1.0, so the values never change):
    # no variant gets luckier memory placement than another
    params = make_params(shapes, device)
    variants = {n: Variant(n, params, device) for n in names}
    for _ in range(args.warmup):
        for n in names:
            time_block(variants[n].step, steps, device)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % 3:] + names[: r % 3]
        for n in order:
            samples[n].append(time_block(variants[n].step, steps, device))

    def q(xs: list[float], p: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, max(0, round(p * (len(xs) - 1))))]

    rows = []
    print(f"\n{'variant':<10} {'median ms/step':>15} {'p10-p90 ms':>17} {'ratio vs torch':>15} {'p10-p90 ratio':>14}")
    for n in names:
        med = statistics.median(samples[n])
        # ratio per round (same moment, same machine state), then the median: robust to drift
        ratios = [a / b for a, b in zip(samples[n], samples["torch"])]
        ratio = statistics.median(ratios)
        rows.append({"variant": n, "median_ms": med * 1e3, "p10_ms": q(samples[n], 0.1) * 1e3,
                     "p90_ms": q(samples[n], 0.9) * 1e3, "ratio": ratio, "ratio_p10": q(ratios, 0.1),
                     "ratio_p90": q(ratios, 0.9)})
        print(f"{n:<10} {med * 1e3:>15.3f} {q(samples[n], 0.1) * 1e3:>8.3f}-{q(samples[n], 0.9) * 1e3:<8.3f} "
              f"{ratio:>15.3f} {q(ratios, 0.1):>6.3f}-{q(ratios, 0.9):<6.3f}")

    launches: dict[str, Any] = {}
    print("\nlaunches per unscale_ (aten ops reaching the dispatcher; fused = _amp_foreach_non_finite_check_and_unscale_)")
    for label, mixed in (("fp32 grads (1 group)", False), ("fp32+bf16 grads (2 groups)", True)):
        launches[label] = {}
        for n in names:
            try:
                c = count_launches(n, make_params(shapes, device, mixed=mixed), device)
            except (NotImplementedError, RuntimeError) as e:  # torch has no bf16 unscale kernel on CUDA
                launches[label][n] = {"error": str(e).splitlines()[0]}
                print(f"  {label:<27} {n:<8} fails: {str(e).splitlines()[0]}")
                continue
            launches[label][n] = c
            extra = (f", CUDA kernels {c['cuda_kernels']} per unscale / {c['cuda_kernels_per_step']} per step"
                     if "cuda_kernels" in c else "")
            print(f"  {label:<27} {n:<8} fused calls {c['fused_unscale_calls']}, aten ops {c['aten_ops']} per unscale, "
                  f"{c['aten_ops_per_step']} per scale+unscale+update{extra}")
    print(f"  ({len(shapes)} parameters: a per-parameter implementation would need >= {len(shapes)} launches)")
    if args.json:
        args.json.write_text(json.dumps({"env": env, "timing": rows, "launches": launches}, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
