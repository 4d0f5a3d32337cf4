"""Compiled mixprec against the compiled torch.amp recipe: training-step time on the same model (issue 14).

One process, one model shape (a small pre-norm GPT: ``mixprec.bench._workloads.CharGPT``), the
same initial weights and batches for every row, all rows ``torch.compile``d with the same
backend, interleaved step by step (A B C, then B C A, ...) after a warm-up that compiles:

* ``torch.amp bf16``: FP32 parameters, ``torch.compile(model)``, ``torch.autocast(bf16)``,
  ``loss.backward()``, ``opt.step()`` (the PyTorch recipe for bf16: no GradScaler).
* ``bf16-mixed``: ``prec.prepare`` then ``torch.compile``; ``prec.autocast()``,
  ``prec.backward``, ``prec.step`` (FP32 parameters, FP32 islands for the LayerNorms).
* ``bf16-master``: the same with BF16 parameters and FP32 master weights.

Every optimizer is ``torch.optim.AdamW(foreach=True)``. The torch.amp row steps it eagerly, as
the recipe does; mixprec's rows (``fused=None``, the default) see the compiled model at the first
backward and run the same AdamW update as one compiled kernel that also skips on inf/NaN
(``mixprec._fused``): that is where their time goes below the baseline. ``--no-fused`` shows the
rows with torch's eager step, ``--amp-compiled-step`` adds the baseline with PyTorch's own
``torch.compile(opt.step)``.
Printed per row: compile time (the first step's extra time, and any recompile in warm-up),
median and p10-p90 step time, and the ratio of medians to the torch.amp row measured in the
same rounds. Goals on CPU: ``bf16-mixed`` <= 1.00x, ``bf16-master`` <= 1.05x.

Usage::

    python benchmarks/compile_overhead.py                       # inductor, ~2 min on 2 CPU cores
    python benchmarks/compile_overhead.py --backend aot_eager   # capture only (no code generation)
    python benchmarks/compile_overhead.py --eager               # the same rows without compile
    python benchmarks/compile_overhead.py --fused               # fused=True (the default fuses once the model is compiled)
    python benchmarks/compile_overhead.py --no-fused            # fused=False: torch's eager AdamW step in every row
    python benchmarks/compile_overhead.py --amp-compiled-step   # + torch.amp with torch.compile(opt.step)
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
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import mixprec
from mixprec.bench._workloads import CharGPT


def _model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    return CharGPT(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.width)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).float().flatten(0, 1), x.flatten())


def make_rows(args: argparse.Namespace, device: torch.device) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """One closure per row: a full training step on a batch, returning the loss (detached)."""
    compile_: Callable[[nn.Module], Any] = (
        (lambda m: m) if args.eager else (lambda m: torch.compile(m, backend=args.backend))
    )
    rows: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}

    def amp_row(compile_step: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        """The torch.amp bf16 recipe; with ``compile_step``, PyTorch's ``torch.compile(opt.step)`` too."""
        base = _model(args).to(device)
        opt = torch.optim.AdamW(base.parameters(), lr=1e-3, foreach=True)
        base_c = compile_(base)
        step = torch.compile(opt.step, backend=args.backend) if compile_step else opt.step

        def amp_step(x: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = _loss(base_c, x)
            loss.backward()
            step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return amp_step

    rows["torch.amp bf16"] = amp_row(False)
    if args.amp_compiled_step:
        rows["amp + comp. step"] = amp_row(True)

    for preset in args.presets:
        model = _model(args).to(device)
        prec = mixprec.MixedPrecision(preset, fused=args.fused)
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True))
        compiled = compile_(model)

        def mp_step(x: torch.Tensor, prec: mixprec.MixedPrecision = prec, model: Any = compiled,
                    opt: torch.optim.Optimizer = opt) -> torch.Tensor:
            with prec.autocast():
                loss = _loss(model, x)
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        rows[preset] = mp_step
    return rows


def measure(rows: dict[str, Callable[[torch.Tensor], torch.Tensor]], batches: list[torch.Tensor], warmup: int,
            device: torch.device) -> tuple[dict[str, list[float]], dict[str, float], dict[str, list[float]]]:
    """Step times per row (timed steps), compile seconds per row, and every row's losses."""
    names = list(rows)
    times: dict[str, list[float]] = {n: [] for n in names}
    warm: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for i, x in enumerate(batches):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            sync()
            t0 = time.perf_counter()
            loss = rows[n](x)
            sync()
            (warm if i < warmup else times)[n].append(time.perf_counter() - t0)
            losses[n].append(float(loss))
    compile_s = {}
    for n in names:
        typical = statistics.median(times[n])
        compile_s[n] = sum(max(0.0, t - typical) for t in warm[n])
    return times, compile_s, losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="bf16-mixed,bf16-master")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    ap.add_argument("--eager", action="store_true", help="no torch.compile (the same rows eager)")
    fused = ap.add_mutually_exclusive_group()
    fused.add_argument("--fused", dest="fused", action="store_const", const=True, default=None,
                       help="MixedPrecision(fused=True); the default (None) fuses the step once the model runs compiled")
    fused.add_argument("--no-fused", dest="fused", action="store_const", const=False,
                       help="MixedPrecision(fused=False): torch's eager AdamW step")
    ap.add_argument("--amp-compiled-step", action="store_true",
                    help="also time the torch.amp row with torch.compile(opt.step) (PyTorch's compiled-optimizer recipe)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per row (the first compiles)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    args.presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    warnings.filterwarnings("ignore", message="bf16 on CPU")
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.block), generator=g).to(device)
               for _ in range(args.warmup + args.steps)]
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * (1 + len(args.presets)))
    rows = make_rows(args, device)
    times, compile_s, losses = measure(rows, batches, args.warmup, device)

    base = "torch.amp bf16"
    fused_word = {None: "fused=None", True: "fused=True", False: "fused=False"}[args.fused]
    mode = ("eager" if args.eager else f"torch.compile(backend={args.backend!r})") + f", MixedPrecision({fused_word})"
    print(f"compile_overhead: CharGPT {args.layers} layers x {args.width} wide, batch {args.batch}x{args.block}, {mode}, "
          f"{device} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), torch {torch.__version__}; "
          f"{args.steps} timed steps after {args.warmup} warm-up, interleaved")
    print(f"{'row':16s} {'compile s':>9s} {'step ms':>8s} {'p10-p90 ms':>15s} {'vs amp':>7s} {'final loss':>10s}")
    out: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}, "rows": {}}
    for n in rows:
        t = sorted(times[n])
        med = statistics.median(t)
        p10, p90 = t[len(t) // 10], t[(9 * len(t)) // 10]
        # ratio of medians of the per-round ratios: both rows ran in the same rounds
        ratio = statistics.median(a / b for a, b in zip(times[n], times[base]))
        final = statistics.fmean(losses[n][-5:])
        print(f"{n:16s} {compile_s[n]:9.1f} {med * 1e3:8.2f} {p10 * 1e3:7.2f}-{p90 * 1e3:<7.2f} {ratio:6.3f}x {final:10.4f}")
        out["rows"][n] = {"compile_s": compile_s[n], "median_ms": med * 1e3, "ratio_vs_amp": ratio, "final_loss": final}
    goals = {"bf16-mixed": 1.00, "bf16-master": 1.05}
    for n, goal in goals.items():
        if n in out["rows"]:
            r = out["rows"][n]["ratio_vs_amp"]
            print(f"goal {n}: <= {goal:.2f}x the compiled torch.amp step: {'met' if r <= goal else 'NOT met'} ({r:.3f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
