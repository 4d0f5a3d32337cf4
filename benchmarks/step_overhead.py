"""Per-step cost of mixprec's optimizer step versus plain ``torch.optim.AdamW`` + ``torch.amp.GradScaler``.

The timed region is the optimizer step only: unscale + inf/NaN check + AdamW step + scale update
(+ the copy back to the half-precision model for master-weight presets). A cheap backward that
touches every parameter runs before each timed step, outside the timed region, on both sides.

Rows (same parameter shapes, same AdamW settings, interleaved A B A B ..., order rotated each round):

* ``torch``: FP32 parameters, ``torch.amp.GradScaler(device)``: ``unscale_`` + ``step`` + ``update``
  (the loop the PyTorch AMP docs recommend; foreach AdamW).
* ``fp16-mixed``: ``mixprec.MixedPrecision("fp16-mixed").step(opt)`` with the same FP32
  parameters and a foreach AdamW: equal dtypes, so the ratio is the wrapper's overhead.
* ``bf16-master``: ``MixedPrecision("bf16-master")``: BF16 model, FP32 masters (accumulated in
  FP32), the step plus the copy back into the BF16 model. Not equal dtypes: the copy-back is real
  extra work the master recipe needs. Its edit check compares every weight with its rounded
  master (``weight_edits="values"``, the default, so ``p.data`` edits reach the masters).
* ``bf16-master/versions``: the same with ``weight_edits="versions"`` (version counters only).
* ``fused`` variants (``--fused``): ``fused=True`` AdamW on both sides (skips on the device).

The ratio printed is the median over rounds of (row / torch) measured within the same round.
Goal (issue 4): ``fp16-mixed`` <= 1.0 on CPU.

Usage::

    python benchmarks/step_overhead.py                     # CPU, ~1 min
    python benchmarks/step_overhead.py --params 16 --rounds 30 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

import mixprec


def make_model(n_million: float, device: torch.device) -> nn.Module:
    """A stack of linear layers holding about ``n_million`` million parameters in 24 tensors."""
    width = max(64, int((n_million * 1e6 / 12) ** 0.5))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(12)]).to(device)


def cheap_loss(model: nn.Module) -> torch.Tensor:
    """A loss whose gradient reaches every parameter at the cost of one elementwise pass."""
    return sum(p.float().sum() * 1e-3 for p in model.parameters())  # type: ignore[return-value]


class TorchLoop:
    """``torch.amp.GradScaler`` + ``torch.optim.AdamW`` on FP32 parameters."""

    def __init__(self, n: float, device: torch.device, fused: bool) -> None:
        self.model = make_model(n, device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused or None, foreach=None if fused else True)
        self.scaler = torch.amp.GradScaler(device.type, init_scale=1.0)

    def backward(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(cheap_loss(self.model)).backward()

    def step(self) -> None:
        self.scaler.unscale_(self.opt)
        self.scaler.step(self.opt)
        self.scaler.update()


class MixprecLoop:
    """``MixedPrecision(preset).step`` on the same shapes."""

    def __init__(self, preset: str, n: float, device: torch.device, fused: bool, weight_edits: str = "values") -> None:
        model = make_model(n, device)
        self.prec = mixprec.MixedPrecision(
            preset, scaler=mixprec.DynamicScaler(init_scale=1.0), weight_edits=weight_edits  # type: ignore[arg-type]
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None, foreach=None if fused else True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model, self.opt = self.prec.prepare(model, opt)

    def backward(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.prec.backward(cheap_loss(self.model))

    def step(self) -> None:
        self.prec.step(self.opt)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(loop: TorchLoop | MixprecLoop, device: torch.device, reps: int) -> float:
    """Median seconds of ``loop.step()`` over ``reps`` steps, each after an untimed backward."""
    times = []
    for _ in range(reps):
        loop.backward()
        sync(device)
        t0 = time.perf_counter()
        loop.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=4.0, help="millions of parameters (default 4)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=5, help="timed steps per row per round")
    ap.add_argument("--fused", action="store_true", help="fused AdamW on every row")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    rows: dict[str, Callable[[], TorchLoop | MixprecLoop]] = {
        "torch": lambda: TorchLoop(args.params, device, args.fused),
        "fp16-mixed": lambda: MixprecLoop("fp16-mixed", args.params, device, args.fused),
        "bf16-master": lambda: MixprecLoop("bf16-master", args.params, device, args.fused),
        "bf16-master/versions": lambda: MixprecLoop("bf16-master", args.params, device, args.fused, "versions"),
    }
    loops = {name: make() for name, make in rows.items()}
    for loop in loops.values():  # warm-up: allocate optimizer state
        time_step(loop, device, 2)
    per_round: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            per_round[name].append(time_step(loops[name], device, args.reps))
    n = sum(p.numel() for p in loops["torch"].model.parameters())
    print(f"# torch {torch.__version__}, {device}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads; {n / 1e6:.2f}M params in 24 tensors; "
          f"AdamW {'fused' if args.fused else 'foreach'}; {args.rounds} rounds x {args.reps} steps, interleaved")
    print(f"{'row':21s} {'median ms':>10s} {'ratio vs torch':>15s} {'ratio p10-p90':>15s}")
    result = {}
    for name in names:
        ratios = sorted(a / b for a, b in zip(per_round[name], per_round["torch"]))
        med = statistics.median(per_round[name]) * 1e3
        p10, p90 = ratios[len(ratios) // 10], ratios[(len(ratios) * 9) // 10 - (1 if len(ratios) % 10 == 0 else 0)]
        result[name] = {"median_ms": med, "ratio": statistics.median(ratios), "ratio_p10": p10, "ratio_p90": p90}
        print(f"{name:21s} {med:10.2f} {statistics.median(ratios):15.3f} {p10:7.3f}-{p90:<7.3f}")
    if args.json:
        env = {"torch": torch.__version__, "device": str(device), "python": sys.version.split()[0],
               "threads": torch.get_num_threads(), "params": n, "args": vars(args)}
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": result}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
