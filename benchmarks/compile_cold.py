#!/usr/bin/env python
"""Time to the first training step of a compiled model, cold and warm Inductor cache, per row (issue 27).

    python benchmarks/compile_cold.py                          # CPU: 4-block GPT, 64 wide, ~5 min on 2 cores
    python benchmarks/compile_cold.py --presets bf16-mixed --layers 2,6
    python benchmarks/compile_cold.py --optimizer-step --layers 2,6   # the optimizer step alone (issue 27, item 3)
    python benchmarks/compile_cold.py --device cuda            # on a GPU (benchmarks/gpu_suite.py runs it)

Each row runs in a process of its own (`torch.compile` state does not leak between rows), twice:
first with an empty ``TORCHINDUCTOR_CACHE_DIR`` (**cold**: everything is compiled), then again with
the same directory (**warm**: Inductor's FX graph and AOTAutograd caches hit, as on a second run of
the same script). Rows: the torch.amp bf16 recipe (``torch.compile(model)``, eager
``AdamW.step()``), and each preset prepared by ``mixprec.MixedPrecision`` then compiled the same way
(``fused=None``: the optimizer step is compiled too, once the first backward sees the compiled
model). The same model, batch and optimizer everywhere; one thread, so rows are comparable.

Printed per row and model depth: the seconds of the first step (model compile, backward compile,
the optimizer step's compile where there is one), the second step's time, the graphs dynamo
compiled, and the ratio of first-step seconds to the torch.amp row's, cold and warm; then, per preset, whether
the goal (``GOAL``: <= 1.25x, cold and warm, issue 27) is met at every depth.

``--optimizer-step``: the optimizer step alone on the same model's parameters (random gradients, no
forward): the baseline row is PyTorch's compiled-optimizer recipe, ``torch.compile(opt.step)`` of
``torch.optim.AdamW`` on FP32 parameters; the rows are ``mixprec.optim.AdamW(fused=True)`` on BF16
parameters, Kahan with FP32 states (``bf16-pure``'s step) and stochastic rounding with BF16 states,
``found_inf`` passed. Same goal, against the baseline's first step (issue 27, item 3, on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    import mixprec  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

AMP = "torch.amp bf16"
#: ``--optimizer-step`` rows: the baseline, then mixprec's fused compensated steps.
TORCH_STEP = "compile(AdamW.step)"
STEP_ROWS = {"kahan fused": ("kahan", "float32"), "sr-bf16 fused": ("stochastic", "bfloat16")}
#: Issue 27, item 1: the first step of a compiled model within 1.25x the torch.amp recipe's, cold and warm.
GOAL = 1.25


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def child(row: str, layers: int, width: int, steps: int, device: str = "cpu") -> dict[str, Any]:
    """Build the row, run ``steps`` training steps; return the first step's and the last step's seconds."""
    import torch
    from torch._dynamo.utils import counters
    from torch.nn import functional as F

    import mixprec
    from mixprec.bench._workloads import CharGPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    vocab, block = 96, 64
    model = CharGPT(vocab, block, layers, 4, width).to(device)
    x = torch.randint(0, vocab, (8, block), generator=torch.Generator().manual_seed(1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if row == AMP:
        cm = torch.compile(model)

        def step() -> None:
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                loss = F.cross_entropy(cm(x).float().flatten(0, 1), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        prec = mixprec.MixedPrecision(row)
        model, opt = prec.prepare(model, opt)
        cm = torch.compile(model)

        def step() -> None:
            with prec.autocast():
                loss = F.cross_entropy(cm(x).float().flatten(0, 1), x.flatten())
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad(set_to_none=True)

    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"first_s": times[0], "step_s": times[-1], "graphs": int(counters["stats"]["unique_graphs"])}


def child_step(row: str, layers: int, width: int, steps: int, device: str = "cpu") -> dict[str, Any]:
    """The optimizer step alone: ``steps`` steps of one ``--optimizer-step`` row; first and last step's seconds."""
    import torch
    from torch._dynamo.utils import counters

    import mixprec.optim as mo
    from mixprec.bench._workloads import CharGPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CharGPT(96, 64, layers, 4, width).to(device)
    found_inf = torch.zeros((), device=device)
    run: Any
    if row == TORCH_STEP:
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = torch.compile(opt.step)
    else:
        comp, sdt = STEP_ROWS[row]
        model.to(torch.bfloat16)
        opt = mo.AdamW(model.parameters(), lr=1e-3, compensation=comp, state_dtype=getattr(torch, sdt), fused=True)

        def run() -> None:
            opt.step(found_inf=found_inf)

    params = list(model.parameters())
    gen = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(device=device, dtype=p.dtype)
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"first_s": times[0], "step_s": times[-1], "graphs": int(counters["stats"]["unique_graphs"])}


def run_child(row: str, layers: int, width: int, steps: int, cache: str, optimizer_step: bool = False,
              device: str = "cpu") -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--child", row, "--layers", str(layers), "--width", str(width), "--steps", str(steps),
           "--device", device]
    if optimizer_step:
        cmd.append("--optimizer-step")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{row} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="bf16-mixed,bf16-master")
    ap.add_argument("--layers", default="4", help="comma-separated depths")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default="")
    ap.add_argument("--optimizer-step", action="store_true",
                    help="the optimizer step alone: mixprec's fused compensated AdamW against torch.compile(AdamW.step)")
    ap.add_argument("--device", default="cpu", help="where the rows run (default cpu; cuda on a GPU)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    from mixprec.bench._timing import device_or_exit

    device_or_exit(a.device)  # (a clear exit here, not a traceback from every child)
    if a.child:
        fn = child_step if a.optimizer_step else child
        print(json.dumps(fn(a.child, int(a.layers), a.width, a.steps, a.device)))
        return 0
    base_row = TORCH_STEP if a.optimizer_step else AMP
    base_name = TORCH_STEP if a.optimizer_step else "torch.amp"
    if a.optimizer_step:
        rows = [TORCH_STEP, *STEP_ROWS]
    else:
        rows = [AMP, *[p.strip() for p in a.presets.split(",") if p.strip()]]
    results: list[dict[str, Any]] = []
    print(f"# {a.device}; each row in its own process, 1 thread; cold: empty TORCHINDUCTOR_CACHE_DIR, warm: the same "
          "directory again")
    print(f"{'row':20s} {'layers':>6s} {'cold s':>7s} {'warm s':>7s} {'step ms':>8s} {'graphs':>6s} {'cold/base':>9s} "
          f"{'warm/base':>9s}")
    for layers in [int(n) for n in a.layers.split(",")]:
        base: dict[str, float] = {}
        for row in rows:
            with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
                cold = run_child(row, layers, a.width, a.steps, cache, a.optimizer_step, a.device)
                warm = run_child(row, layers, a.width, a.steps, cache, a.optimizer_step, a.device)
            if row == base_row:
                base = {"cold": cold["first_s"], "warm": warm["first_s"]}
            r = {"row": row, "layers": layers, "cold_s": cold["first_s"], "warm_s": warm["first_s"],
                 "step_ms": 1e3 * warm["step_s"], "graphs": cold["graphs"],
                 "cold_ratio": cold["first_s"] / base["cold"], "warm_ratio": warm["first_s"] / base["warm"]}
            results.append(r)
            print(f"{row:20s} {layers:6d} {r['cold_s']:7.1f} {r['warm_s']:7.1f} {r['step_ms']:8.1f} {r['graphs']:6d} "
                  f"{r['cold_ratio']:8.2f}x {r['warm_ratio']:8.2f}x", flush=True)
    for row in rows[1:]:
        mine = [r for r in results if r["row"] == row]
        cold, warm = max(r["cold_ratio"] for r in mine), max(r["warm_ratio"] for r in mine)
        met = "met" if cold <= GOAL and warm <= GOAL else "NOT met"
        print(f"goal {row}: cold and warm <= {GOAL:.2f}x {base_name}'s at every depth: {met} (at most {cold:.2f}x cold, "
              f"{warm:.2f}x warm)")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
