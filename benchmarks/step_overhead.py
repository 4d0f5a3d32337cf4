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

Compensated rows (``--compensated``; issue 14.2), the optimizer step alone (``opt.step``), against
``adamw-foreach`` (torch's foreach AdamW on FP32 parameters, no scaler; ``adamw-fused``, torch's
fused AdamW, with ``--fused``):

* ``pure-kahan-eager``: ``mixprec.optim.AdamW`` on BF16 parameters, Kahan, FP32 states,
  ``fused=False`` (the eager foreach reference), ``found_inf`` passed (the on-device skip).
* ``pure-sr-bf16-eager``: stochastic rounding with BF16 states, ``fused=False``, ``found_inf`` passed.
* ``pure-kahan-fused``: the same as ``pure-kahan-eager`` with ``fused=True`` (the ``torch.compile``d
  tile step on a CPU; on CUDA one Triton kernel per bucket, ``mixprec/optim/_triton_step.py``).
* ``pure-sr-bf16-fused``: stochastic rounding with BF16 states, ``fused=True`` (the same two routes).
* ``bf16-pure-fused``: ``MixedPrecision("bf16-pure").step(opt)`` around ``pure-kahan-fused``
  (the whole step: check + fused update + bookkeeping).
  First-step compile times are printed separately (``compile_seconds``), not in the medians.

The ratio printed is the median over rounds of (row / baseline) measured within the same round.
Goals: ``fp16-mixed`` <= 1.0 (issue 4); ``pure-kahan-fused`` <= 1.2 on CPU (issue 14); the eager
rows <= 2.0 (issue 27).

``--count-ops 2,12,24`` prints instead the aten ops one ``opt.step`` dispatches (counts, not
timings) on the GPT-shaped model of ``mixprec.bench._step_cost`` at those depths: torch's foreach
AdamW and mixprec's eager AdamW/SGD with Kahan (FP32 states) and stochastic rounding (BF16
states), ``found_inf`` passed (issue 27: constant in the number of tensors).

Usage::

    python benchmarks/step_overhead.py                     # CPU, ~1 min
    python benchmarks/step_overhead.py --params 16 --rounds 30 --json out.json
    python benchmarks/step_overhead.py --compensated       # + the fused rows (~1-2 min of compiling first)
    python benchmarks/step_overhead.py --count-ops 2,12,24 # aten ops per eager optimizer step, by depth
    python benchmarks/step_overhead.py --device cuda --only-compensated --fused --shapes gpt2
                                        # issue 27, item 3: bf16-pure's step on GPT-2 124M's tensors
    python benchmarks/step_overhead.py --only-compensated --fused --fused-tile 524288
                                        # the compiled tile step with 2**19-element tiles (on CUDA AdamW takes
                                        # the Triton kernel, which has no tiles)
    python benchmarks/step_overhead.py --device cuda --fused --profile
                                        # + per row: kernel time against the step's, top kernels and Python functions
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
from pathlib import Path
from typing import Any

import torch
from torch import nn

import mixprec

#: ``--shapes``: "linear" (``--params`` million parameters in 24 tensors) or "gpt2" (GPT-2 124M's).
SHAPES = "linear"


def gpt2_shaped(device: torch.device) -> nn.Module:
    """GPT-2 124M's parameter tensors (``wte``, tied to the head; ``wpe``; 12 blocks; ``ln_f``): 124.4M in 148 tensors.

    Only the shapes matter here (the optimizer step): a module that holds them, not a working GPT-2.
    """
    d, blocks = 768, 12
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Embedding(50257, d), nn.Embedding(1024, d)]
    for _ in range(blocks):
        layers += [nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, 4 * d),
                   nn.Linear(4 * d, d)]
    layers.append(nn.LayerNorm(d))
    return nn.ModuleList(layers).to(device)


def make_model(n_million: float, device: torch.device) -> nn.Module:
    """A stack of linear layers holding about ``n_million`` million parameters in 24 tensors (or :func:`gpt2_shaped`)."""
    if SHAPES == "gpt2":
        return gpt2_shaped(device)
    width = max(64, int((n_million * 1e6 / 12) ** 0.5))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(12)]).to(device)


def tile_summary(opt: torch.optim.Optimizer) -> str:
    """The fused step's tiles per step: calls, direct ones, packed ones and how many of those hold their states."""
    layouts = [plan.fused for _, plans in getattr(opt, "_plan_cache", {}).values() for plan in plans
               if getattr(plan, "fused", None) is not None]
    if not layouts:
        return "no fused tiles"
    direct = sum(1 for lay in layouts for d in lay.direct if d)
    packed = sum(1 for lay in layouts for d in lay.direct if not d)
    homed = sum(1 for lay in layouts for t, d in enumerate(lay.direct) if not d and lay.homes[t])
    return f"{direct + packed} tile calls per step ({direct} direct, {packed} packed, {homed} of them holding their states)"


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


class OptimizerLoop:
    """``opt.step()`` alone: torch's foreach AdamW on FP32 (``kind="torch"``), or mixprec's compensated AdamW on BF16."""

    def __init__(self, kind: str, n: float, device: torch.device, fused: bool = False, prec: bool = False) -> None:
        import mixprec.optim as mo

        self.model = make_model(n, device)
        self.prec = None
        self.found_inf = torch.zeros((), device=device)
        if kind in ("torch", "torch-fused"):
            self.opt: torch.optim.Optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=1e-4, **({"fused": True} if kind == "torch-fused" else {"foreach": True})
            )
            return
        comp, sdt = {"kahan": ("kahan", torch.float32), "sr-bf16": ("stochastic", torch.bfloat16)}[kind]
        if prec:
            self.prec = mixprec.MixedPrecision("bf16-pure")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.model, self.opt = self.prec.prepare(self.model, torch.optim.AdamW(self.model.parameters(), lr=1e-4))
            assert isinstance(self.opt, mo.LowPrecisionOptimizer) and self.opt.compensation == comp
            self.opt.fused = fused
        else:
            self.model.to(torch.bfloat16)
            self.opt = mo.AdamW(self.model.parameters(), lr=1e-4, compensation=comp, state_dtype=sdt, fused=fused)

    def backward(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.prec is not None:
            self.prec.backward(cheap_loss(self.model))
        else:
            cheap_loss(self.model).backward()

    def step(self) -> None:
        if self.prec is not None:
            self.prec.step(self.opt)
        elif isinstance(self.opt, torch.optim.AdamW):
            self.opt.step()
        else:
            self.opt.step(found_inf=self.found_inf)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(loop: TorchLoop | MixprecLoop | OptimizerLoop, device: torch.device, reps: int) -> float:
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


def profile_step(name: str, loop: TorchLoop | MixprecLoop | OptimizerLoop, device: torch.device, wall_ms: float,
                 steps: int = 3, top: int = 8) -> dict[str, Any]:
    """Print where one row's step spends its time: device kernels (torch.profiler) and Python (cProfile).

    Each of ``steps`` steps is profiled alone (its backward runs outside the profilers). The
    kernels' time per step beside ``wall_ms`` (the row's median step) says whether the step is
    bound by the device or by the host; cProfile's own time per function says which host code.
    On a CPU the aten ops' own CPU time stands in for the kernels. Profilers slow the host, so
    the times they print are for attribution, not for comparison with the table.
    """
    import cProfile
    import pstats

    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    kernels: dict[str, list[float]] = {}
    for _ in range(steps):
        loop.backward()
        sync(device)
        with torch.profiler.profile(activities=acts) as prof:
            loop.step()
            sync(device)
        events = prof.key_averages()
        ranges = {e.key for e in events if e.self_cpu_time_total > 0}  # record_function ranges show on the device too
        for e in events:
            if device.type == "cuda":
                us = float(getattr(e, "self_device_time_total", 0.0) or 0.0)
                keep = us > 0 and e.key not in ranges
            else:
                us, keep = float(e.self_cpu_time_total), e.key.startswith("aten::")
            if keep:
                acc = kernels.setdefault(e.key, [0.0, 0.0])
                acc[0] += us / steps
                acc[1] += e.count / steps
    prof_py = cProfile.Profile()
    for _ in range(steps):
        loop.backward()
        sync(device)
        prof_py.enable()
        loop.step()
        sync(device)
        prof_py.disable()
    stats = pstats.Stats(prof_py)
    rows = sorted(((tt / steps * 1e6, nc / steps, f"{Path(fn).name}:{line}({fname})")
                   for (fn, line, fname), (_, nc, tt, _, _) in stats.stats.items()),  # type: ignore[attr-defined]
                  reverse=True)
    k_total = sum(v[0] for v in kernels.values()) / 1e3
    launches = sum(v[1] for v in kernels.values())
    what = "CUDA kernels" if device.type == "cuda" else "aten ops (own CPU time)"
    bound = "" if device.type != "cuda" else (", host-bound" if k_total < 0.7 * wall_ms else ", device-bound")
    print(f"## profile {name}: step {wall_ms:.2f} ms (median above); {what} {k_total:.2f} ms in {launches:.0f} "
          f"per step{bound}")
    for us, (k, (_, n)) in sorted(((v[0], (k, v)) for k, v in kernels.items()), reverse=True)[:top]:
        print(f"    {us:9.1f} us  {n:5.0f}x  {k[:100]}")
    print(f"  Python, own time per step (cProfile, {steps} steps):")
    for us, n, where in rows[:top]:
        print(f"    {us:9.1f} us  {n:5.0f}x  {where[:100]}")
    return {"wall_ms": wall_ms, "kernel_ms": k_total, "launches": launches,
            "top_kernels": {k: v for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]},
            "top_python": [{"us": us, "calls": n, "where": w} for us, n, w in rows[:top]]}


def count_ops(depths: list[int]) -> None:
    """Print the aten ops of one ``opt.step`` (after two warm-up steps) per optimizer and depth."""
    import mixprec.optim as mo
    from mixprec.bench._step_cost import StepCounter, gpt_model

    torch.set_num_threads(1)
    kinds = [("torch-adamw-foreach", None), ("adamw", "kahan"), ("adamw", "stochastic"), ("sgd", "kahan"),
             ("sgd", "stochastic")]
    print(f"# torch {torch.__version__}; aten ops per optimizer step (foreach ops count once)")
    print(f"{'blocks':>6s} {'tensors':>7s} {'params':>8s} {'optimizer':20s} {'compensation':12s} {'ops':>6s}  most frequent")
    for depth in depths:
        for kind, comp in kinds:
            model = gpt_model(depth)
            kw: dict[str, torch.Tensor] = {}
            if comp is None:
                opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
            else:
                model.to(torch.bfloat16)
                sdt = torch.float32 if comp == "kahan" else torch.bfloat16
                cls = mo.AdamW if kind == "adamw" else mo.SGD
                extra = {"momentum": 0.9} if kind == "sgd" else {}
                opt = cls(model.parameters(), lr=1e-3, compensation=comp, state_dtype=sdt, fused=False, **extra)
                kw["found_inf"] = torch.zeros(())
            params = list(model.parameters())
            counter = StepCounter((opt,))
            for i in range(3):
                for p in params:
                    p.grad = torch.ones_like(p)
                if i < 2:
                    opt.step(**kw)
                else:
                    with counter:
                        opt.step(**kw)
            top = ", ".join(f"{k} {v}" for k, v in counter.ops.most_common(4))
            print(f"{depth:6d} {len(params):7d} {sum(p.numel() for p in params):8d} {kind:20s} {comp!s:12s} "
                  f"{counter.total:6d}  {top}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=4.0, help="millions of parameters (default 4)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=5, help="timed steps per row per round")
    ap.add_argument("--fused", action="store_true", help="fused AdamW on every row")
    ap.add_argument("--compensated", action="store_true", help="add the compensated (bf16-pure) eager and fused rows")
    ap.add_argument("--only-compensated", action="store_true", help="only the compensated rows and their baseline")
    ap.add_argument("--rows", default="", help="comma-separated row names to keep (default: all selected)")
    ap.add_argument("--shapes", choices=("linear", "gpt2"), default="linear",
                    help="parameter shapes: 'linear' (--params million in 24 tensors) or 'gpt2' (GPT-2 124M's "
                         "148 tensors, 124.4M elements; --params ignored)")
    ap.add_argument("--fused-tile", type=int, default=0, metavar="N",
                    help="elements per tile of the fused step on this device (default: mixprec's, 2**16 on a CPU, "
                         "2**21 on a GPU); to compare tile sizes")
    ap.add_argument("--tile-calls", choices=("direct", "dynamo"), default="direct",
                    help="fused step: tile calls after the first straight to the compiled graph (default) or all "
                         "through dynamo (the behaviour before; to measure what the direct calls save)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", action="store_true",
                    help="after the table, per row: device kernels and Python functions per step (where the time goes)")
    ap.add_argument("--count-ops", default="", metavar="DEPTHS",
                    help="print aten ops per eager optimizer step at these GPT depths (e.g. 2,12,24) and exit")
    args = ap.parse_args(argv)
    if args.count_ops:
        count_ops([int(d) for d in args.count_ops.split(",")])
        return 0
    global SHAPES
    SHAPES = args.shapes
    if args.fused_tile:
        from mixprec.optim import _fused_step

        if args.fused_tile < 1:
            ap.error(f"--fused-tile: a positive number of elements, got {args.fused_tile}")
        _fused_step._CPU_FUSED_TILE = _fused_step._GPU_FUSED_TILE = args.fused_tile
    if args.tile_calls == "dynamo":
        from mixprec.optim import _fused_step

        _fused_step._DIRECT_CALLS = False
    from mixprec.bench._timing import device_or_exit

    device = device_or_exit(args.device)
    rows: dict[str, Callable[[], TorchLoop | MixprecLoop | OptimizerLoop]] = {}
    baseline: dict[str, str] = {}
    if not args.only_compensated:
        rows.update({
            "torch": lambda: TorchLoop(args.params, device, args.fused),
            "fp16-mixed": lambda: MixprecLoop("fp16-mixed", args.params, device, args.fused),
            "bf16-master": lambda: MixprecLoop("bf16-master", args.params, device, args.fused),
            "bf16-master/versions": lambda: MixprecLoop("bf16-master", args.params, device, args.fused, "versions"),
        })
        baseline.update(dict.fromkeys(rows, "torch"))
    if args.compensated or args.only_compensated:
        # --fused: torch's fused AdamW is the baseline (issue 27: <= 1.1x it on a GPU).
        comp_base = "adamw-fused" if args.fused else "adamw-foreach"
        comp_rows: dict[str, Callable[[], OptimizerLoop]] = {
            comp_base: lambda: OptimizerLoop("torch-fused" if args.fused else "torch", args.params, device),
            "pure-kahan-eager": lambda: OptimizerLoop("kahan", args.params, device, fused=False),
            "pure-sr-bf16-eager": lambda: OptimizerLoop("sr-bf16", args.params, device, fused=False),
            "pure-kahan-fused": lambda: OptimizerLoop("kahan", args.params, device, fused=True),
            "pure-sr-bf16-fused": lambda: OptimizerLoop("sr-bf16", args.params, device, fused=True),
            "bf16-pure-fused": lambda: OptimizerLoop("kahan", args.params, device, fused=True, prec=True),
        }
        rows.update(comp_rows)
        baseline.update(dict.fromkeys(comp_rows, comp_base))
    if args.rows:
        keep = set(args.rows.split(","))
        unknown = keep - set(rows)
        if unknown:
            ap.error(f"--rows: unknown {sorted(unknown)}; choose from {sorted(rows)}")
        rows = {k: v for k, v in rows.items() if k in keep or k in {baseline[n] for n in keep}}
    loops = {name: make() for name, make in rows.items()}
    compile_s: dict[str, float] = {}
    for name, loop in loops.items():  # warm-up: allocate optimizer state (and compile the fused steps)
        t0 = time.perf_counter()
        time_step(loop, device, 2)
        if isinstance(loop, OptimizerLoop) and getattr(loop.opt, "fused", False):
            compile_s[name] = float(getattr(loop.opt, "compile_seconds", 0.0))
            print(f"# {name}: first steps {time.perf_counter() - t0:.1f} s, compile_seconds "
                  f"{compile_s[name]:.1f} s; {tile_summary(loop.opt)}", flush=True)
    per_round: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            per_round[name].append(time_step(loops[name], device, args.reps))
    first = list(next(iter(loops.values())).model.parameters())
    n, n_tensors = sum(p.numel() for p in first), len(first)
    print(f"# torch {torch.__version__}, {device}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads; {n / 1e6:.2f}M params in {n_tensors} tensors ({args.shapes}); "
          f"AdamW {'fused' if args.fused else 'foreach'}; {args.rounds} rounds x {args.reps} steps, interleaved")
    print(f"{'row':21s} {'median ms':>10s} {'ratio':>8s} {'ratio p10-p90':>15s}  baseline")
    result = {}
    for name in names:
        base = baseline[name]
        ratios = sorted(a / b for a, b in zip(per_round[name], per_round[base]))
        med = statistics.median(per_round[name]) * 1e3
        p10, p90 = ratios[len(ratios) // 10], ratios[(len(ratios) * 9) // 10 - (1 if len(ratios) % 10 == 0 else 0)]
        result[name] = {"median_ms": med, "ratio": statistics.median(ratios), "ratio_p10": p10, "ratio_p90": p90,
                        "baseline": base, "compile_seconds": compile_s.get(name)}
        print(f"{name:21s} {med:10.2f} {statistics.median(ratios):8.3f} {p10:7.3f}-{p90:<7.3f}  {base}")
    if args.profile:
        sys.stdout.flush()
        for name in names:
            result[name]["profile"] = profile_step(name, loops[name], device, result[name]["median_ms"])
    if args.json:
        env = {"torch": torch.__version__, "device": str(device), "python": sys.version.split()[0],
               "threads": torch.get_num_threads(), "params": n, "args": vars(args)}
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": result}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
