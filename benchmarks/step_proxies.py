#!/usr/bin/env python
"""CPU proxies of the step's GPU cost, mixprec against the torch.amp recipe on the same model (issue 26).

    python benchmarks/step_proxies.py                       # 12 and 24 blocks, fused AdamW, every preset
    python benchmarks/step_proxies.py --optimizer foreach --depths 12
    python benchmarks/step_proxies.py --clip 1.0             # both sides clip the gradients (GPT-2's recipe)

Per preset and depth (a GPT-shaped model, 32 wide: ``mixprec.bench._step_cost``): aten ops dispatched
per training iteration (on a GPU each is at least one kernel launch) and the difference from the
torch.amp recipe with the same half dtype, host reads per iteration (a device sync on a GPU; reads of
torch optimizers' CPU step counters left out) and Python calls per iteration with their ratio to
torch.amp's. Goals (issue 26): 0 host reads; extra ops <= 10 and not growing with depth; Python
calls <= 1.25x torch.amp's. Deterministic: counts, not timings.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

try:
    import mixprec  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

PRESETS = "fp32,bf16-mixed,fp16-mixed,bf16-master,fp16-master,bf16-master-r16,bf16-pure"


def main(argv: list[str] | None = None) -> int:
    from mixprec.bench._step_cost import make_recipe, measure_recipe

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=PRESETS)
    ap.add_argument("--depths", default="12,24", help="blocks of the model (default 12,24)")
    ap.add_argument("--optimizer", choices=["fused", "foreach"], default="fused", help="torch AdamW's form, both sides")
    ap.add_argument("--clip", type=float, default=0.0, metavar="NORM",
                    help="clip the gradients to this norm every iteration, both sides (GPT-2 training clips at 1.0)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    fused = args.optimizer == "fused"
    foreach = None if fused else True
    clip = args.clip or None
    print(f"step_proxies: torch {torch.__version__}, AdamW {args.optimizer} on both sides"
          f"{f', clipped to {clip}' if clip else ''}; per training iteration")
    print(f"{'depth':>5s} {'recipe':15s} {'aten ops':>9s} {'extra':>7s} {'host reads':>10s} {'Python calls':>12s} {'ratio':>6s}")
    for depth in (int(d) for d in args.depths.split(",")):
        base = {}
        for amp in ("amp-bf16", "amp-fp16"):
            base[amp] = c = measure_recipe(*make_recipe(amp, depth, fused=fused, foreach=foreach, clip=clip))
            print(f"{depth:5d} {amp:15s} {c.ops:9.0f} {'':>7s} {c.host_reads:10.1f} {c.python_calls:12.0f}")
        for preset in args.presets.split(","):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                c = measure_recipe(*make_recipe(preset, depth, fused=fused, foreach=foreach, clip=clip))
            b = base["amp-fp16" if preset.startswith("fp16") else "amp-bf16"]
            print(f"{depth:5d} {preset:15s} {c.ops:9.0f} {c.ops - b.ops:+7.0f} {c.host_reads:10.1f} "
                  f"{c.python_calls:12.0f} {c.python_calls / b.python_calls:5.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
