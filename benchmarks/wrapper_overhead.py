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

No autocast region on any side: the forward is identical and only the wrapper differs. Each
iteration is timed twice: the region the goal names (from the loss to the end of the step:
``backward`` + ``step`` (+ ``update``), the forward and ``zero_grad`` outside it) and the whole
iteration. Printed: per-iteration medians over rounds, each wrapper's overhead over ``plain`` and
the ratio of the two wrappers' overheads measured in the same rounds, for both. Goal (issue 14.3):
``mixprec / torch.amp <= 1.00`` for the backward + step region.

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


Loop = Callable[[], "tuple[Callable[[], None], Callable[[], None]]"]


def make_loops(kind: str, tensors: int, width: int, device: torch.device) -> dict[str, Loop]:
    """The three loops of the module docstring.

    Each is a closure that runs the forward and returns ``(timed, after)``: ``timed`` does the
    backward and the optimizer step (the region the goal names), ``after`` the ``zero_grad``.
    """
    n_layers = max(1, tensors // 2)
    x = torch.randn(4, width, device=device)
    loops: dict[str, Loop] = {}

    m0 = _model(n_layers, width, device)
    o0 = _optimizer(kind, m0)

    def plain() -> tuple[Callable[[], None], Callable[[], None]]:
        loss = m0(x).square().mean()

        def timed() -> None:
            loss.backward()
            o0.step()

        return timed, o0.zero_grad

    loops["plain"] = plain

    m1 = _model(n_layers, width, device)
    o1 = _optimizer(kind, m1)
    scaler = torch.amp.GradScaler(device.type)

    def amp() -> tuple[Callable[[], None], Callable[[], None]]:
        loss = m1(x).square().mean()

        def timed() -> None:
            scaler.scale(loss).backward()
            scaler.step(o1)
            scaler.update()

        return timed, o1.zero_grad

    loops["torch.amp"] = amp

    m2 = _model(n_layers, width, device)
    prec = mixprec.MixedPrecision("fp16-mixed")
    m2, o2 = prec.prepare(m2, _optimizer(kind, m2))

    def mp() -> tuple[Callable[[], None], Callable[[], None]]:
        loss = m2(x).square().mean()

        def timed() -> None:
            prec.backward(loss)
            prec.step(o2)

        return timed, o2.zero_grad

    loops["mixprec"] = mp
    return loops


def measure(loops: dict[str, Loop], rounds: int, reps: int,
            device: torch.device) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per iteration of each loop, one sample per round, interleaved and rotated.

    Returns ``(region, whole)``: the backward + step region and the whole iteration.
    """
    names = list(loops)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for f in loops.values():  # warm-up: allocator, lazy state, scaler materialisation
        for _ in range(max(10, reps)):
            timed, after = f()
            timed()
            after()
    region: dict[str, list[float]] = {n: [] for n in names}
    whole: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            f = loops[n]
            inside = 0.0
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                timed, after = f()
                sync()
                t1 = time.perf_counter()
                timed()
                sync()
                inside += time.perf_counter() - t1
                after()
            sync()
            whole[n].append((time.perf_counter() - t0) / reps)
            region[n].append(inside / reps)
    return region, whole


def _ratios(times: dict[str, list[float]]) -> tuple[dict[str, float], float, float]:
    """Overheads over ``plain`` (medians), and the per-round ratio of mixprec's to torch.amp's (median)."""
    over = {n: [a - b for a, b in zip(times[n], times["plain"])] for n in ("torch.amp", "mixprec")}
    ratios = [m / a for m, a in zip(over["mixprec"], over["torch.amp"]) if a > 0]
    total = statistics.median(m / a for m, a in zip(times["mixprec"], times["torch.amp"]))
    return ({n: statistics.median(v) for n, v in over.items()},
            statistics.median(ratios) if ratios else float("nan"), total)


def _fmt_ratio(ratio: float, over: dict[str, float]) -> str:
    """The overhead ratio, or why there is none (a negative overhead: that loop cost less than the plain one)."""
    if over["mixprec"] <= 0 or over["torch.amp"] <= 0:
        who = [n for n in ("mixprec", "torch.amp") if over[n] <= 0]
        return f"n/a ({' and '.join(who)} cost less than the plain loop in the median round: no overhead to compare)"
    return f"{ratio:.2f}x"


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
    from mixprec.bench._timing import device_or_exit

    device = device_or_exit(args.device)
    loops = make_loops(args.optimizer, args.tensors, args.width, device)
    region, whole = measure(loops, args.rounds, args.reps, device)
    print(f"wrapper overhead, {args.tensors} tensors, {args.optimizer}, {device} ({platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {args.threads} thread(s)); {args.rounds} rounds x {args.reps} iterations")
    print(f"{'loop':12s} {'region us':>10s} {'over plain':>11s} {'iteration us':>13s} {'over plain':>11s}")
    r_over, r_ratio, r_total = _ratios(region)
    w_over, w_ratio, w_total = _ratios(whole)
    for n in loops:
        extra_r = "" if n == "plain" else f"{r_over[n] * 1e6:10.1f}"
        extra_w = "" if n == "plain" else f"{w_over[n] * 1e6:10.1f}"
        print(f"{n:12s} {statistics.median(region[n]) * 1e6:10.1f} {extra_r:>11s} "
              f"{statistics.median(whole[n]) * 1e6:13.1f} {extra_w:>11s}")
    print(f"mixprec / torch.amp, backward + step: {r_total:.3f}x, fixed overhead {_fmt_ratio(r_ratio, r_over)} "
          "(goal <= 1.00)")
    print(f"mixprec / torch.amp, whole iteration (forward, zero_grad too): {w_total:.3f}x, "
          f"fixed overhead {_fmt_ratio(w_ratio, w_over)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"region_median_s": {n: statistics.median(v) for n, v in region.items()},
                       "iteration_median_s": {n: statistics.median(v) for n, v in whole.items()},
                       "overhead_ratio": r_ratio, "region_ratio": r_total, "iteration_overhead_ratio": w_ratio,
                       "iteration_ratio": w_total, "args": vars(args), "torch": torch.__version__}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
