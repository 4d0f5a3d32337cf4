#!/usr/bin/env python
"""GPU benchmark: a GPT-2-small-shaped model (124M), mixprec vs the torch.amp baseline, row by row.

One command, one process::

    python benchmarks/gpu_gpt2.py                    # all defaults (about 1-2 minutes on an H100)
    python benchmarks/gpu_gpt2.py --out results/     # also the JSON records (plots: mixprec compare --out)
    python benchmarks/gpu_gpt2.py --compile          # every row torch.compile'd (inductor), baselines too
    python benchmarks/gpu_gpt2.py --budget 120       # start no row that would end after 120 s
    python benchmarks/gpu_gpt2.py --profile          # per row: top CUDA kernels and CPU time, mixprec minus torch.amp
    python benchmarks/gpu_gpt2.py --presets bf16-master,fp16-master --weight-edits versions
                                                     # the master presets without the value-based edit check
    python benchmarks/gpu_gpt2.py --presets bf16-master --fused-step on   # the compiled master step

The model is GPT-2 small's shape (12 layers, 12 heads, 768 wide, context 1024, vocabulary
50304, tied embeddings: 124.5M parameters) in plain torch.nn with
``F.scaled_dot_product_attention``, trained with fused AdamW on character ids of Python's
documentation.

Each preset runs beside its own torch.amp baseline (the PyTorch recipe loop: ``torch.autocast`` +
``torch.amp.GradScaler`` for fp16 presets, ``torch.autocast`` alone for the others), from the same
initial weights on the same batches, interleaved step by step in this one process, with warm-up,
CUDA synchronisation around every timed step, median and p10-p90 step times, MFU against the
device's dense peak (table in ``mixprec.bench._timing``; ``--peak-tflops`` for a GPU it does not
list) and peak memory from the CUDA caching allocator. A pair's table and ratio are printed as soon
as it finishes and appended to ``gpu_gpt2.json`` (``--out``), so a run stopped by a time limit keeps
every finished row. Pairs run cheapest first (eager presets before FP8 and the compensated step).

``--profile`` runs a few steps of each pair under ``torch.profiler`` and prints, per row, the CUDA
kernels whose total time differs most from torch.amp's and the CPU time per step: where a gap comes
from, measured.

Without a CUDA device it says so and exits 0 (nothing to measure); ``--tiny`` checks the script on
the CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import mixprec  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

# Cheapest and most asked-about first: a run cut short by a time limit keeps these.
DEFAULT_PRESETS = "bf16-mixed,fp16-mixed,bf16-master,fp16-master,fp32,bf16-pure"
if importlib.util.find_spec("torchao") is not None:  # FP8 rows (mixprec[fp8]); compared with torch-amp bf16
    DEFAULT_PRESETS += ",fp8-tensorwise,fp8-rowwise"


#: ``--fused-step`` -> ``MixedPrecision(fused=...)``.
_FUSED_STEP: dict[str, bool | None] = {"auto": None, "on": True, "off": False}


def _baseline_for(preset: str) -> str:
    """The torch.amp recipe a preset is measured against: fp16 for fp16 presets, bf16 for the others."""
    return "fp16" if preset.startswith("fp16") else "bf16"


def _pair_line(result: object, preset: str, dt: str) -> str | None:
    """``preset vs torch-amp dt: step time xR (a vs b ms), peak memory xM, MFU``: one line from a pair's result."""
    rows = {r.name: r for r in result.rows if r.status == "ok"}  # type: ignore[attr-defined]
    r, base = rows.get(preset), rows.get("torch-amp")
    if r is None or base is None or not r.step_time_ms or not base.step_time_ms:
        return None
    t = r.step_time_ms["median"] / base.step_time_ms["median"]
    m = (r.peak_memory_bytes or 0) / max(1, base.peak_memory_bytes or 1)
    mfu = f", MFU {100 * r.mfu:.1f}% vs {100 * base.mfu:.1f}%" if r.mfu is not None and base.mfu is not None else ""
    comp = ""
    if r.compile_seconds is not None and base.compile_seconds is not None:
        comp = f", compile cold {r.compile_seconds:.1f} vs {base.compile_seconds:.1f} s"
        if r.warm_compile_seconds is not None and base.warm_compile_seconds is not None:
            comp += f", warm {r.warm_compile_seconds:.1f} vs {base.warm_compile_seconds:.1f} s"
        comp += f", recompiles {r.recompiles} vs {base.recompiles}"
    return (f"{preset:14s} vs torch-amp {dt}: step time x{t:.3f} ({r.step_time_ms['median']:.2f} vs "
            f"{base.step_time_ms['median']:.2f} ms), peak memory x{m:.3f}{mfu}{comp}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default=DEFAULT_PRESETS, help=f"mixprec presets, run in this order (default {DEFAULT_PRESETS})")
    p.add_argument("--steps", type=int, default=60,
                   help="training steps per row (default 60: on an H200 a 30-step row's p10-p90 spanned +-8%% of its "
                        "median, too wide for a 1-3%% gap)")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps (default 5)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--block-size", type=int, default=1024, help="context length (default 1024)")
    p.add_argument("--n-embd", type=int, default=768, help="model width, heads of 64 (default 768; FP8 gains from ~2048)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense peak TFLOP/s when the GPU is not in the table")
    p.add_argument("--out", default=os.environ.get("OUT"), help="write gpu_gpt2.json and each pair's JSON record here (default: $OUT if set)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile every row's model, the torch-amp baselines' too (default backend inductor); "
                        "step times exclude compilation, reported per row as cold and warm compile seconds "
                        "(mixprec.bench.run_compare: a fresh Inductor cache, then one step after torch._dynamo.reset()) "
                        "and recompiles")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="start no pair that would end after this many seconds (estimated from the slowest pair so "
                        "far); the pairs left out are named")
    p.add_argument("--profile", action="store_true",
                   help="also profile a few steps of each pair: top CUDA kernels and CPU time, mixprec minus torch.amp")
    p.add_argument("--f8-layers", default=None, metavar="WHICH",
                   help="the linears the FP8 rows convert instead of all: auto (the measured plan, issue 27 item 4: never "
                        "slower than bf16-mixed at 768 wide), globs joined by '+', all or none")
    p.add_argument("--weight-edits", choices=["values", "versions"], default=None,
                   help="MixedPrecision(weight_edits=...) for the master presets: 'versions' drops the value-based edit "
                        "check of the half weights (6 bytes per parameter and step as the Triton kernel on CUDA, ~48 as the foreach fallback), to measure its cost")
    p.add_argument("--fused-step", choices=["auto", "on", "off"], default="auto",
                   help="MixedPrecision(fused=...): 'on' compiles the optimizer steps mixprec covers, the master step "
                        "too (its edit check then runs inside the kernel); 'off' keeps them eager; 'auto' (default) "
                        "the preset's own rule")
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

    presets = [x.strip() for x in args.presets.split(",") if x.strip()]
    print(f"gpu_gpt2: {device_name} | torch {torch.__version__} | presets {','.join(presets)} | each beside its "
          f"torch-amp baseline | {args.steps} steps ({args.warmup} warm-up), batch "
          f"{options['batch_size']}x{options['block_size']}" + (f" | compiled ({args.compile})" if args.compile else "")
          + (f" | budget {args.budget:.0f} s" if args.budget else "")
          + (f" | weight_edits={args.weight_edits}" if args.weight_edits else "")
          + (f" | fused_step={args.fused_step}" if args.fused_step != "auto" else ""), flush=True)
    out = Path(args.out) if args.out else None
    summary: dict = {"schema": "mixprec.gpu_gpt2/1", "device": device_name, "torch": torch.__version__,
                     "settings": {k: v for k, v in vars(args).items() if k != "out"}, "pairs": [], "left_out": []}
    t_start = time.perf_counter()
    slowest = 0.0
    failed = False
    for i, preset in enumerate(presets):
        elapsed = time.perf_counter() - t_start
        if args.budget is not None and i and elapsed + slowest > args.budget:
            summary["left_out"] = presets[i:]
            print(f"gpu_gpt2: budget: {elapsed:.0f} s spent, the slowest pair took {slowest:.0f} s; left out: "
                  f"{', '.join(presets[i:])}", flush=True)
            break
        dt = _baseline_for(preset)
        t0 = time.perf_counter()
        try:
            with _CacheBypasses() as bypasses:
                result = run_compare(
                    "gpt", [preset], baseline=dt, steps=args.steps, warmup=args.warmup, device=device,
                    peak_tflops_override=args.peak_tflops, workload_options=options, compile=args.compile,
                    f8_layers=args.f8_layers, weight_edits=args.weight_edits,
                    fused_step=_FUSED_STEP[args.fused_step],
                )
        except BenchError as e:
            print(f"gpu_gpt2: {preset}: error: {e}", file=sys.stderr, flush=True)
            failed = True
            continue
        seconds = time.perf_counter() - t0
        slowest = max(slowest, seconds)
        print_report(result)
        line = _pair_line(result, preset, dt)
        if line and args.weight_edits and any("weight_edits=" in r.label for r in result.rows if r.name == preset):
            line += f", weight_edits={args.weight_edits}"
        if line and args.fused_step != "auto":
            line += f", fused_step={args.fused_step}"
        print(f"{line or preset + ': no ratio (a row failed, see the table)'}  [{seconds:.0f} s]", flush=True)
        for why, n in bypasses.reasons.items():  # why a warm compile still took long (FP8: 24 s against 1.6 s)
            print(f"gpu_gpt2: {preset} pair: {why} (x{n})", flush=True)
        pair = {"preset": preset, "baseline": f"torch-amp-{dt}", "weight_edits": args.weight_edits or "values",
                "fused_step": args.fused_step,
                "seconds": seconds, "line": line,
                "rows": result.to_dict()["rows"], "cache_bypasses": bypasses.reasons}
        if args.profile:
            pair["profile"] = _profile_pair(preset, dt, options, device, args.compile, weight_edits=args.weight_edits,
                                            fused_step=_FUSED_STEP[args.fused_step])
        summary["pairs"].append(pair)
        if out is not None:
            write_json(result, out / f"compare-{preset}.json")
            (out / "gpu_gpt2.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    print()
    for pair in summary["pairs"]:
        if pair["line"]:
            print(pair["line"])
    if out is not None:
        (out / "gpu_gpt2.json").parent.mkdir(parents=True, exist_ok=True)
        (out / "gpu_gpt2.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
        print(f"gpu_gpt2: wrote {out}/gpu_gpt2.json")
    print(f"gpu_gpt2: {len(summary['pairs'])} of {len(presets)} pairs in {time.perf_counter() - t_start:.0f} s", flush=True)
    return 1 if failed else 0


class _CacheBypasses(logging.Handler):
    """Collects why Inductor's FX graph cache or AOTAutograd's cache was bypassed while a pair ran.

    A bypassed cache compiles again after ``torch._dynamo.reset()``: the 'warm s' column. On an H200
    the FP8 rows' warm compile took 24 s against 1.6 s for torch.amp's (2026-11-27); torch logs the
    reason (at INFO) and nowhere else. ``reasons``: message (first 160 characters) -> count.
    """

    LOGGERS = ("torch._functorch._aot_autograd.autograd_cache", "torch._inductor.codecache")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: dict[str, int] = {}
        self._levels: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = " ".join(record.getMessage().split())
        if "bypass" in msg.lower():
            key = msg[:160]
            self.reasons[key] = self.reasons.get(key, 0) + 1

    def __enter__(self) -> _CacheBypasses:
        for name in self.LOGGERS:
            log = logging.getLogger(name)
            self._levels.append(log.level)
            if not log.isEnabledFor(logging.INFO):
                log.setLevel(logging.INFO)
            log.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, level in zip(self.LOGGERS, self._levels):
            log = logging.getLogger(name)
            log.removeHandler(self)
            log.setLevel(level)


def _profile_pair(preset: str, dt: str, options: dict, device: str, compile_backend: str | None,
                  steps: int = 5, top: int = 8, weight_edits: str | None = None,
                  fused_step: bool | None = None) -> dict:
    """Profile ``steps`` steps of ``preset`` and of its torch.amp recipe; print where the time differs.

    Per row: the host time per step (``perf_counter`` around the loop without synchronising, so it
    is the time the CPU spends issuing the step) and each CUDA kernel's total time per step. The
    kernels printed are those whose time differs most between the two rows (mixprec minus torch.amp).
    """
    import copy
    import itertools

    from mixprec._tree import tree_map
    from mixprec.bench import load_workload
    from mixprec.bench._step_cost import recipe_step

    wl = load_workload("gpt", **options)
    batches = [tree_map(lambda t: t.to(device), b) for b in itertools.islice(iter(wl.batches), steps + 3)]

    def loop(kind: str) -> Callable[[Any], None]:
        model = copy.deepcopy(wl.model).to(device)
        recipe = f"amp-{dt}" if kind == "amp" else preset
        return recipe_step(recipe, model, wl.optimizer_fn(model.parameters()), wl.loss_fn, device,
                           compile_backend=compile_backend, clip=wl.clip_grad_norm,  # the timed loop's clipping
                           weight_edits=weight_edits or "values", fused_step=fused_step)[0]

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    report: dict = {}
    for kind in ("mixprec", "amp"):
        step = loop(kind)
        for b in batches[:3]:
            step(b)
        sync()
        t0 = time.perf_counter()
        for b in batches[3:]:
            step(b)
        host_ms = (time.perf_counter() - t0) * 1e3 / steps
        sync()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for b in batches[3:]:
                step(b)
            sync()
        kernels: dict[str, list[float]] = {}
        events = prof.key_averages()
        # record_function ranges (Optimizer.step#AdamW.step) show on the device too, spanning the kernels and the
        # idle time between them: not kernels (on an H200 one read +37.5 ms where the kernels took 1.1 ms)
        ranges = {e.key for e in events if e.self_cpu_time_total > 0}
        for e in events:
            dev_us = getattr(e, "device_time_total", 0.0) or 0.0
            if dev_us > 0 and e.key not in ranges and (
                    getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA or device != "cuda"):
                kernels[e.key] = [dev_us / steps, e.count / steps]
        if device != "cuda":  # no kernels on a CPU: the aten ops' own CPU time stands in for them
            kernels = {e.key: [e.self_cpu_time_total / steps, e.count / steps] for e in prof.key_averages()
                       if e.key.startswith("aten::")}
        report[kind] = {"host_ms_per_step": host_ms, "kernels_us_per_step": kernels}
    mp, amp = report["mixprec"], report["amp"]
    names = set(mp["kernels_us_per_step"]) | set(amp["kernels_us_per_step"])
    diff = sorted(((mp["kernels_us_per_step"].get(k, [0, 0])[0] - amp["kernels_us_per_step"].get(k, [0, 0])[0], k)
                   for k in names), key=lambda d: -abs(d[0]))
    total = sum(d for d, _ in diff)
    what = "CUDA kernel" if device == "cuda" else "aten op (CPU)"
    print(f"profile {preset} minus torch-amp {dt}: host time per step {mp['host_ms_per_step']:.2f} - "
          f"{amp['host_ms_per_step']:.2f} = {mp['host_ms_per_step'] - amp['host_ms_per_step']:+.2f} ms; "
          f"{what} time per step {total:+.1f} us in all; largest differences:")
    for d, k in diff[:top]:
        n_mp = mp["kernels_us_per_step"].get(k, [0, 0])[1]
        n_amp = amp["kernels_us_per_step"].get(k, [0, 0])[1]
        print(f"    {d:+9.1f} us  ({n_mp:.0f} vs {n_amp:.0f} calls)  {k[:100]}")
    report["top_differences"] = [{"name": k, "us_per_step": d} for d, k in diff[:top]]
    return report


if __name__ == "__main__":
    sys.exit(main())
