"""Fixed per-step cost of ``prec.backward(loss); prec.step(opt)`` against ``torch.amp.GradScaler`` (issue 14.3).

The model is tiny (24 parameter tensors of 8x8 / 8 by default) so that what is timed is the
per-step Python and small-kernel cost around the backward and the optimizer step, not the
arithmetic. Three loops on identical models, batches and optimizers (foreach SGD or AdamW on FP32
parameters, the same work for each), interleaved A B C A B C ..., the order rotated every round:

* ``plain``: ``loss.backward(); opt.step()`` (no scaling: the floor).
* ``torch.amp``: ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` with
  ``torch.amp.GradScaler`` (dynamic scaling).
* ``mixprec``: ``prec.backward(loss); prec.step(opt)`` with ``MixedPrecision("fp16-mixed")``
  (dynamic scaling; FP32 parameters, so the model runs the same kernels).

No autocast region on any side: the forward is identical and only the wrapper differs. Printed:
per-iteration time (median over rounds), the overhead over ``plain`` and the ratio of the two
wrappers' overheads measured in the same rounds. Goal: ``mixprec / torch.amp <= 1.00``.

Usage::

    python benchmarks/wrapper_overhead.py                  # ~10 s on CPU
    python benchmarks/wrapper_overhead.py --optimizer adamw --tensors 48 --json out.json
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


def _model(n_layers: int, width: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n_layers)]).to(device)


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-5, foreach=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)


def make_loops(kind: str, tensors: int, width: int, device: torch.device) -> dict[str, Callable[[], None]]:
    """The three loops of the module docstring, each a closure doing one training iteration."""
    n_layers = max(1, tensors // 2)
    x = torch.randn(4, width, device=device)
    loops: dict[str, Callable[[], None]] = {}

    m0 = _model(n_layers, width, device)
    o0 = _optimizer(kind, m0)

    def plain() -> None:
        m0(x).square().mean().backward()
        o0.step()
        o0.zero_grad()

    loops["plain"] = plain

    m1 = _model(n_layers, width, device)
    o1 = _optimizer(kind, m1)
    scaler = torch.amp.GradScaler(device.type)

    def amp() -> None:
        scaler.scale(m1(x).square().mean()).backward()
        scaler.step(o1)
        scaler.update()
        o1.zero_grad()

    loops["torch.amp"] = amp

    m2 = _model(n_layers, width, device)
    prec = mixprec.MixedPrecision("fp16-mixed")
    m2, o2 = prec.prepare(m2, _optimizer(kind, m2))

    def mp() -> None:
        prec.backward(m2(x).square().mean())
        prec.step(o2)
        o2.zero_grad()

    loops["mixprec"] = mp
    return loops


def measure(loops: dict[str, Callable[[], None]], rounds: int, reps: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds per iteration of each loop, one sample per round, interleaved and rotated."""
    names = list(loops)
    for f in loops.values():  # warm-up: allocator, lazy state, scaler materialisation
        for _ in range(max(10, reps)):
            f()
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            f = loops[n]
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            if device.type == "cuda":
                torch.cuda.synchronize()
            out[n].append((time.perf_counter() - t0) / reps)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    ap.add_argument("--tensors", type=int, default=24, help="parameter tensors (weights + biases; default 24)")
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=1, help="iterations per loop per round (1: finest interleaving)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: less noise)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # GradScaler on CPU, fp16-mixed without autocast: not what is measured
    device = torch.device(args.device)
    loops = make_loops(args.optimizer, args.tensors, args.width, device)
    times = measure(loops, args.rounds, args.reps, device)
    med = {n: statistics.median(v) for n, v in times.items()}
    # per round: each wrapper's overhead over plain, then the ratio of overheads
    over = {n: [a - b for a, b in zip(times[n], times["plain"])] for n in ("torch.amp", "mixprec")}
    ratios = [m / a for m, a in zip(over["mixprec"], over["torch.amp"]) if a > 0]
    total_ratio = statistics.median(m / a for m, a in zip(times["mixprec"], times["torch.amp"]))
    print(f"wrapper overhead, {args.tensors} tensors, {args.optimizer}, {device} ({platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {args.threads} thread(s)); {args.rounds} rounds x {args.reps} iterations")
    print(f"{'loop':12s} {'us/iter':>9s} {'over plain':>11s}")
    for n in times:
        extra = "" if n == "plain" else f"{statistics.median(over[n]) * 1e6:10.1f}"
        print(f"{n:12s} {med[n] * 1e6:9.1f} {extra:>11s}")
    overhead_ratio = statistics.median(ratios) if ratios else float("nan")
    print(f"mixprec / torch.amp: whole iteration {total_ratio:.3f}x, fixed overhead {overhead_ratio:.2f}x (goal <= 1.00)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_s": med, "overhead_ratio": overhead_ratio, "iteration_ratio": total_ratio,
                       "args": vars(args), "torch": torch.__version__}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
