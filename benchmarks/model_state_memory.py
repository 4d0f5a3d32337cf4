"""Persistent bytes per parameter after one AdamW step, and the peak of a training step, per preset.

For each configuration a fresh model is prepared with ``mixprec.MixedPrecision`` and trained for
one step (forward, backward, ``step``; gradients are kept, as they are between ``backward`` and
``zero_grad`` in every training loop). Then:

* ``state B/param``: bytes of every distinct storage the run keeps (parameters, gradients,
  FP32 master weights and their gradients, optimizer state, compensation buffers), counted
  from the tensors (``mixprec.bench`` ``model_state_bytes``), divided by the parameter count;
* ``peak MiB``: persistent bytes before a second step plus the largest growth during it,
  measured by a live-tensor tracker (a ``TorchDispatchMode`` counting fresh output storages;
  on CUDA the allocator's peak counter). Intra-op workspaces are not visible to the tracker.

The model is a stack of square ``Linear`` layers (no norms), so FP32 islands do not blur the
per-parameter numbers; ``--layernorm`` adds a LayerNorm per layer (kept in FP32 by every preset).

Targets (issue 4 and 5): fp32 / ``*-mixed`` 16 B/param (4 weight + 4 grad + 8 AdamW states);
``*-master`` with compute-dtype gradients 16 (2 + 2 + 4 master + 8) between backward and step;
the step consumes the half gradients and frees its transient FP32 copies, so 14 is measured
after it; with FP32 gradient accumulation 18 (2 + 4 master grad + 4 master + 8; no half
gradient persists, the FP32 gradients stay until ``zero_grad``); ``bf16-master-r16`` (issue 29: each
master is the BF16 weight plus a 2-byte remainder) 2 less in both: 16 with FP32 accumulation, 12 after
the step with compute-dtype gradients (14 while the half gradients exist); ``bf16-pure``
Kahan with FP32 states 14 (2 + 2 + 2 compensation + 8), Kahan with BF16 states 10, stochastic
rounding with BF16 states 8.

Usage::

    python benchmarks/model_state_memory.py                   # CPU, ~20 s
    python benchmarks/model_state_memory.py --width 2048 --layers 4 --batch 64 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec.bench._memory import measure_step_memory, model_state_bytes, parameter_count


@dataclass(frozen=True)
class Config:
    """One row: a preset plus the options that change its memory."""

    label: str
    preset: str
    grad_accumulation: str = "fp32"
    compensation: str | None = None  # bf16-pure: "kahan" | "stochastic"
    state_dtype: str | None = None  # bf16-pure: "f32" | "bf16"
    target: float | None = None


CONFIGS = [
    Config("fp32", "fp32", target=16),
    Config("bf16-mixed", "bf16-mixed", target=16),
    Config("fp16-mixed", "fp16-mixed", target=16),
    Config("bf16-master (fp32 grad accumulation)", "bf16-master", target=18),
    Config("bf16-master (compute-dtype grads)", "bf16-master", grad_accumulation="compute", target=14),
    Config("bf16-master-r16 (fp32 grad accumulation)", "bf16-master-r16", target=16),
    Config("bf16-master-r16 (compute-dtype grads)", "bf16-master-r16", grad_accumulation="compute", target=12),
    Config("fp16-master (fp32 grad accumulation)", "fp16-master", target=18),
    Config("fp16-master (compute-dtype grads)", "fp16-master", grad_accumulation="compute", target=14),
    Config("bf16-pure kahan, fp32 states", "bf16-pure", compensation="kahan", state_dtype="f32", target=14),
    Config("bf16-pure kahan, bf16 states", "bf16-pure", compensation="kahan", state_dtype="bf16", target=10),
    Config("bf16-pure stochastic, bf16 states", "bf16-pure", compensation="stochastic", state_dtype="bf16", target=8),
]


def make_model(width: int, layers: int, layernorm: bool, device: torch.device) -> nn.Module:
    """A stack of ``width x width`` linear layers (optionally each followed by a LayerNorm)."""
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.GELU()]
        if layernorm:
            mods.append(nn.LayerNorm(width))
    return nn.Sequential(*mods).to(device)


def prepare(cfg: Config, model: nn.Module) -> tuple[mixprec.MixedPrecision, torch.optim.Optimizer]:
    """Prepare ``model`` under ``cfg`` with AdamW (converted to ``mixprec.optim.AdamW`` for bf16-pure)."""
    if cfg.compensation is not None:
        # The compensated optimizer is built by the user to choose its state dtype; prepare()
        # checks that its compensation matches the policy and seeds it with what the cast lost.
        policy = dataclasses.replace(mixprec.Policy.parse(cfg.preset), compensation=cfg.compensation)
        prec = mixprec.MixedPrecision(policy)
        opt: torch.optim.Optimizer = mixprec.optim.AdamW(
            model.parameters(), lr=1e-3, compensation=cfg.compensation, state_dtype=cfg.state_dtype, seed=0
        )
    else:
        prec = mixprec.MixedPrecision(cfg.preset, grad_accumulation=cfg.grad_accumulation)  # type: ignore[arg-type]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _, opt = prec.prepare(model, opt)
    return prec, opt


def train_step(prec: mixprec.MixedPrecision, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """One forward/backward/step; gradients are left in place (as between backward and zero_grad)."""
    opt.zero_grad(set_to_none=True)
    with prec.autocast():
        loss = model(x).float().pow(2).mean()
    prec.backward(loss)
    prec.step(opt)


def measure(cfg: Config, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Bytes/param after one step and the peak of the next step for one configuration."""
    model = make_model(args.width, args.layers, args.layernorm, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fp16-on-CPU speed warning
        prec, opt = prepare(cfg, model)
        x = torch.randn(args.batch, args.width, device=device)
        train_step(prec, model, opt, x)
        n = parameter_count(model)
        state = model_state_bytes(model, opt)
        with measure_step_memory(device, state) as box:
            train_step(prec, model, opt, x)
    peak = box[0]
    return {
        "config": cfg.label,
        "preset": cfg.preset,
        "params": n,
        "state_bytes": state,
        "bytes_per_param": state / n,
        "target": cfg.target,
        "peak_bytes": peak.peak_bytes,
        "peak_method": peak.method,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layernorm", action="store_true", help="add a LayerNorm (an FP32 island) after each layer")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default="", help="comma-separated preset names to keep")
    ap.add_argument("--json", default="", help="write the rows and the environment to this file")
    args = ap.parse_args(argv)
    from mixprec.bench._timing import device_or_exit

    device = device_or_exit(args.device)
    keep = {s.strip() for s in args.only.split(",") if s.strip()}
    rows = [measure(cfg, args, device) for cfg in CONFIGS if not keep or cfg.preset in keep]
    print(f"# torch {torch.__version__}, {device}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads; {args.layers} x Linear({args.width}, {args.width})"
          f"{' + LayerNorm' if args.layernorm else ''}, batch {args.batch}, AdamW")
    print(f"{'configuration':42s} {'state B/param':>13s} {'target':>7s} {'peak MiB':>9s}")
    for r in rows:
        target = f"{r['target']:g}" if r["target"] is not None else "-"
        print(f"{r['config']:42s} {r['bytes_per_param']:13.2f} {target:>7s} {r['peak_bytes'] / 2**20:9.1f}")
    print(f"peak: {rows[0]['peak_method']}")
    if args.json:
        env = {"torch": torch.__version__, "device": str(device), "python": sys.version.split()[0],
               "threads": torch.get_num_threads(), "args": vars(args)}
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
