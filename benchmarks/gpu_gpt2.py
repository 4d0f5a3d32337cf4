#!/usr/bin/env python
"""GPU benchmark: a GPT-2-small-shaped model (124M), mixprec vs the torch.amp baseline.

One command, one process::

    python benchmarks/gpu_gpt2.py                    # all defaults (about 1-2 minutes on an H100)
    python benchmarks/gpu_gpt2.py --out results/     # also compare.json and the PNG plots
    python benchmarks/gpu_gpt2.py --compile          # every row torch.compile'd (inductor), baselines too

The model is GPT-2 small's shape (12 layers, 12 heads, 768 wide, context 1024, vocabulary
50304, tied embeddings: 124.5M parameters) in plain torch.nn with
``F.scaled_dot_product_attention``, trained with fused AdamW on character ids of Python's
documentation. Rows: mixprec's presets and *two* torch.amp baselines (the PyTorch recipe
loop: ``torch.autocast`` + ``torch.amp.GradScaler`` for fp16, ``torch.autocast`` alone for
bf16), all from the same initial weights on the same batches, interleaved step by step in
this one process (A B C ..., then B C ... A), with warm-up, CUDA synchronisation around every
timed step, median and p10-p90 step times, MFU against the device's dense peak (table in
``mixprec.bench._timing``; ``--peak-tflops`` for a GPU it does not list) and peak memory from
the CUDA caching allocator.

Without a CUDA device it says so and exits 0 (nothing to measure).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

try:
    import mixprec  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

DEFAULT_PRESETS = "fp32,bf16-mixed,fp16-mixed,bf16-master,fp16-master,bf16-pure"
if importlib.util.find_spec("torchao") is not None:  # FP8 rows (mixprec[fp8]); compared with torch-amp bf16 below
    DEFAULT_PRESETS += ",fp8-tensorwise,fp8-rowwise"


def _ratio_lines(result: object) -> list[str]:
    """mixprec vs torch.amp, per half dtype: median step time, throughput and peak memory ratios."""
    rows = {r.name: r for r in result.rows if r.status == "ok"}  # type: ignore[attr-defined]
    lines = []
    for dt in ("bf16", "fp16"):
        base = rows.get(f"torch-amp-{dt}") or (rows.get("torch-amp") if result.settings["baseline"] == dt else None)  # type: ignore[attr-defined]
        if base is None or not base.step_time_ms:
            continue
        for name in (f"{dt}-mixed", f"{dt}-master", f"{dt}-pure", *(("fp8-tensorwise", "fp8-rowwise") if dt == "bf16" else ())):
            r = rows.get(name)
            if r is None or not r.step_time_ms:
                continue
            t = r.step_time_ms["median"] / base.step_time_ms["median"]
            m = (r.peak_memory_bytes or 0) / max(1, base.peak_memory_bytes or 1)
            mfu = f", MFU {100 * r.mfu:.1f}% vs {100 * base.mfu:.1f}%" if r.mfu is not None and base.mfu is not None else ""
            lines.append(
                f"{name:12s} vs torch-amp {dt}: step time x{t:.3f} ({r.step_time_ms['median']:.1f} vs "
                f"{base.step_time_ms['median']:.1f} ms), peak memory x{m:.3f}{mfu}"
            )
    bm = rows.get("bf16-mixed")  # issue 17's goal: FP8 against bf16-mixed
    for name in ("fp8-tensorwise", "fp8-rowwise"):
        r = rows.get(name)
        if bm is not None and r is not None and bm.step_time_ms and r.step_time_ms:
            mfu = f", MFU {100 * r.mfu:.1f}% vs {100 * bm.mfu:.1f}%" if r.mfu is not None and bm.mfu is not None else ""
            lines.append(f"{name} vs bf16-mixed: step time x{r.step_time_ms['median'] / bm.step_time_ms['median']:.3f}{mfu}")
    fp32 = rows.get("fp32")
    if fp32 is not None and fp32.step_time_ms:
        for name, r in rows.items():
            if name != "fp32" and r.step_time_ms:
                lines.append(f"{r.label:22s} speed-up over fp32: x{fp32.step_time_ms['median'] / r.step_time_ms['median']:.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default=DEFAULT_PRESETS, help=f"mixprec presets (default {DEFAULT_PRESETS})")
    p.add_argument("--baseline", default="fp16,bf16", help="torch-amp baseline rows (default: fp16,bf16)")
    p.add_argument("--steps", type=int, default=60, help="training steps per row (default 60)")
    p.add_argument("--warmup", type=int, default=10, help="untimed warm-up steps (default 10)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--block-size", type=int, default=1024, help="context length (default 1024)")
    p.add_argument("--n-embd", type=int, default=768, help="model width, heads of 64 (default 768; FP8 gains from ~2048)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense peak TFLOP/s when the GPU is not in the table")
    p.add_argument("--out", default=os.environ.get("OUT"), help="write compare.json and plots here (default: $OUT if set)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile every row's model, the torch-amp baselines' too (default backend inductor); "
                        "step times exclude compilation, reported per row as 'compile s'")
    p.add_argument("--tiny", action="store_true", help="a 1-layer, 32-wide model on the CPU: checks the script, measures nothing")
    args = p.parse_args(argv)

    if args.tiny:
        device = "cpu"
        options = dict(n_layer=1, n_head=2, n_embd=32, block_size=32, vocab_size=128, tie=True, fused=False,
                       batch_size=2, lr=6e-4, weight_decay=0.1, eval_batches=1, clip=1.0)
        return _run(args, device, options, "tiny CPU check")
    if not torch.cuda.is_available():
        print("gpu_gpt2: no CUDA device here (torch.cuda.is_available() is False); this benchmark needs a GPU. Skipped.")
        return 0

    options = dict(
        n_layer=12, n_head=args.n_embd // 64, n_embd=args.n_embd, block_size=args.block_size, vocab_size=50304, tie=True, fused=True,
        batch_size=args.batch_size, lr=6e-4, weight_decay=0.1, eval_batches=2, clip=1.0,
    )
    return _run(args, "cuda", options, torch.cuda.get_device_name())


def _run(args: argparse.Namespace, device: str, options: dict, device_name: str) -> int:
    from mixprec.bench import BenchError, run_compare
    from mixprec.bench._report import print_report, write_json

    print(f"gpu_gpt2: {device_name} | torch {torch.__version__} | presets {args.presets} | "
          f"baseline torch-amp {args.baseline} | {args.steps} steps ({args.warmup} warm-up), batch "
          f"{options['batch_size']}x{options['block_size']}" + (f" | compiled ({args.compile})" if args.compile else ""),
          flush=True)
    try:
        result = run_compare(
            "gpt", args.presets, baseline=args.baseline, steps=args.steps, warmup=args.warmup, device=device,
            peak_tflops_override=args.peak_tflops, workload_options=options, compile=args.compile,
        )
    except BenchError as e:
        print(f"gpu_gpt2: error: {e}", file=sys.stderr)
        return 2
    print_report(result)
    print()
    for line in _ratio_lines(result):
        print(line)
    if args.out:
        out = Path(args.out)
        write_json(result, out / "compare.json")
        try:
            from mixprec.bench._plots import write_plots

            write_plots(result, out)
        except BenchError as e:  # no matplotlib on this machine: the JSON is still there
            print(f"gpu_gpt2: plots skipped: {e}")
        print(f"gpu_gpt2: wrote {out}/compare.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
