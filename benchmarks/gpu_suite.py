#!/usr/bin/env python
"""Every GPU check of mixprec in one call, most important first, printing as it goes (issue 26).

    python benchmarks/gpu_suite.py                  # the default checks, within 8 minutes (--budget 480)
    python benchmarks/gpu_suite.py --all --budget 570   # then issue 27's and the diagnostics, as many as fit
    python benchmarks/gpu_suite.py --budget 300     # fewer checks: each starts only if it fits
    PYTHONPATH=src python benchmarks/gpu_suite.py   # from a checkout that is not installed
    python benchmarks/gpu_suite.py --only fp8,compensated --budget 400   # some checks (in the order below)

Timing: the default run is the seven checks issue 26 names. On an H200 (torch 2.11, 2026-11-27) a run
of twelve checks, these seven among them, took 557 s; timed one by one in earlier runs, gpt2-eager
took 102 s, compensated 49 s (with the compiled Kahan step it had then) and cuda-tests 53 s. The
summary prints each check's seconds. Each check has its own time limit, cut to what is left of
``--budget`` (default 480 s); a check that would not start with 20 s left is named in the summary
as left out.

The default run, in order:

1. ``syncs``: host syncs per step for every preset and both torch.amp recipes
   (``torch.cuda.set_sync_debug_mode("warn")``, a 4-block GPT-shaped model, torch's foreach and
   fused AdamW, ``prec.step`` and ``optimizer.step()``), with the CPU proxies beside them (aten ops
   and Python calls per step against torch.amp's).
2. ``capture``: ``tests/test_gpu_step.py`` (no sync in 20 steps; forward + backward + step
   captured in a CUDA graph, replays equal eager steps, a planted overflow included).
3. ``gpt2-eager``: ``gpu_gpt2.py`` (GPT-2 124M, each preset beside its torch.amp recipe; not the
   eager FP8 rows, 4.5-6.4x torch.amp's step: FP8 is measured compiled, below).
4. ``compensated``: ``step_overhead.py --device cuda --only-compensated --fused --shapes gpt2``
   (``bf16-pure``'s steps on GPT-2 124M's tensors against torch's fused AdamW: eager Kahan, the
   fused Kahan step, one Triton kernel per bucket on CUDA since stop 43, and stochastic rounding with
   BF16 states, still the compiled tiles; first-step compile seconds; issue 27, item 3), with
   ``--profile``: per row the kernels' time against the step's and the top Python functions.
5. ``gpt2-compiled``: ``gpu_gpt2.py --compile`` for ``bf16-mixed,bf16-master``.
6. ``cuda-tests``: every CUDA-marked test, ``benchmarks/cuda_tests.py``: one pytest process per
   test file, the files in parallel (compiles are host work), each file's result as it finishes.
7. ``step``: ``step_overhead.py --device cuda --fused --profile`` (the optimizer step alone, attributed).

With ``--all``, then (each only if it fits what is left of the budget):

8. ``compile-cold``: ``compile_cold.py --device cuda --layers 4``: the first step of a compiled
   model, each row in a fresh process with an empty Inductor cache and then a warm one, against the
   torch.amp recipe's (issue 27, item 1, on a GPU; the GPT-2 rows of 5. share one process and cache).
9. ``fp8`` (issue 27, item 4; needs torchao, skipped without it): ``gpu_gpt2.py --compile`` at
   ``--n-embd 2048`` for ``fp8-tensorwise`` and ``fp8-rowwise`` with ``--f8-layers auto``, each
   beside torch-amp bf16 (``bf16-mixed`` compiled measured 0.989x of it there; ``fp8-rowwise``
   with every linear 1.096x). ``fp8-auto``: the same rows at GPT-2's 768 width (the measured plan,
   with the shape gate on an FP8 GPU): never slower than ``bf16-mixed`` is the goal.
10. ``mixed-profile``: ``gpu_gpt2.py --profile`` for ``bf16-mixed,fp16-mixed`` (their eager gap,
   1.011-1.033x on an H200, attributed to kernels and host time; a CPU diff of every aten op of one
   iteration, dtypes and shapes included, found the same GPU work on both sides within a few
   scalar kernels).
11. Diagnostics: ``remainder`` (``bf16-master-r16``'s master step, issue 29), ``master-profile``
   (the master rows attributed), ``edit-check`` (the Triton edit check against the foreach check on
   GPT-2's shapes), ``master-versions`` (the master rows without the edit check), ``master-fused``
   (the compiled master step), ``tile-host`` (host time per tile of the compiled step).

Everything a step prints goes to this process's output as it comes; ``--out`` (default ``$OUT``)
also gets ``gpu_suite.txt`` (the whole log) and the JSON of the GPT-2 runs.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL a step's whole process group (it was started in a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _syncs() -> int:
    """Check 1, in this process: host syncs per step (warnings counted) and the CPU proxies, per recipe."""
    from mixprec.bench._step_cost import make_recipe, measure_recipe

    recipes = ["amp-bf16", "amp-fp16", "fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "bf16-master-r16", "fp16-master",
               "bf16-pure", "bf16-master*"]  # *: the compiled (Inductor) master step, fused_step=True; the others eagerly
    print(f"{'recipe':12s} {'optimizer':9s} {'route':15s} {'syncs/step':>10s}")
    bad = 0
    for recipe in recipes:
        compiled = recipe.endswith("*")
        recipe = recipe.rstrip("*")
        for kind in (("foreach",) if compiled else ("foreach", "fused")):
            for route in (("prec.step", "optimizer.step") if not recipe.startswith("amp") else ("-",)):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    it, _ = make_recipe(recipe, 4, fused=kind == "fused", foreach=True if kind == "foreach" else None,
                                        direct=route == "optimizer.step", device="cuda",
                                        fused_step=compiled)
                    for _ in range(3):
                        it()
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        for _ in range(20):
                            it()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                n = sum("synchroniz" in str(w.message) for w in caught) / 20
                bad += n > 0 and not recipe.startswith("amp")
                print(f"{recipe + ('*' if compiled else ''):12s} {kind:9s} {route:15s} {n:10.2f}", flush=True)
    print("\nCPU proxies (12 blocks, fused AdamW; extra = preset minus its torch.amp recipe):")
    for preset in ("bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master"):
        base = "amp-fp16" if preset.startswith("fp16") else "amp-bf16"
        b = measure_recipe(*make_recipe(base, 12, fused=True))
        c = measure_recipe(*make_recipe(preset, 12, fused=True))
        print(f"{preset:12s} aten ops {c.ops:6.0f} (extra {c.ops - b.ops:+.0f}), host reads {c.host_reads:.0f}, "
              f"Python calls {c.python_calls:6.0f} (x{c.python_calls / b.python_calls:.2f})", flush=True)
    return 1 if bad else 0


STEPS: list[tuple[str, float, list[str] | None]] = [
    # --- the default run (issue 26, item 5: syncs, capture, GPT-2 eager and compiled, the optimizer steps, the
    # CUDA tests; about 6-7 minutes on an H200 from the checks' times of 2026-11-27) ---
    ("syncs", 90, None),
    ("capture", 90, [sys.executable, "-m", "pytest", "-q", "-x", "tests/test_gpu_step.py"]),
    # Eager FP8 rows left out: 4.5x and 6.4x torch.amp's step on an H200 (tensor-subclass dispatch per op, 2026-11-27).
    ("gpt2-eager", 150, [sys.executable, "benchmarks/gpu_gpt2.py", "--presets",
                         "bf16-mixed,fp16-mixed,bf16-master,fp16-master,fp32,bf16-pure", "--budget", "{budget}",
                         "--out", "{out}/eager"]),
    ("compensated", 90, [sys.executable, "benchmarks/step_overhead.py", "--device", "cuda", "--only-compensated",
                         "--fused", "--shapes", "gpt2", "--rounds", "5", "--rows",
                         "pure-kahan-eager,pure-kahan-fused,pure-sr-bf16-fused", "--profile"]),
    ("gpt2-compiled", 180, [sys.executable, "benchmarks/gpu_gpt2.py", "--compile", "--presets", "bf16-mixed,bf16-master",
                            "--budget", "{budget}", "--out", "{out}/compiled"]),
    ("cuda-tests", 90, [sys.executable, "benchmarks/cuda_tests.py", "--timeout", "{budget}"]),
    ("step", 60, [sys.executable, "benchmarks/step_overhead.py", "--device", "cuda", "--fused", "--rounds", "5",
                  "--profile"]),
    # --- with --all, after the default ones (issue 27 and diagnostics), each only if it fits what is left ---
    ("compile-cold", 150, [sys.executable, "benchmarks/compile_cold.py", "--device", "cuda", "--layers", "4"]),
    # No bf16-mixed pair: compiled it is torch.amp's step (0.989x at 2048 wide, 1.002x at 768 on an H200), and one
    # compiled pair at 2048 takes ~120-200 s; each FP8 row is compared with the torch-amp bf16 row beside it.
    # The plan (measured numerics + torchao's shape gate): rowwise with every linear was 1.096x torch.amp at 2048.
    ("fp8", 240, [sys.executable, "benchmarks/gpu_gpt2.py", "--compile", "--presets", "fp8-tensorwise,fp8-rowwise",
                  "--f8-layers", "auto", "--n-embd", "2048", "--steps", "15", "--warmup", "4", "--budget", "{budget}",
                  "--out", "{out}/fp8"]),
    ("fp8-auto", 200, [sys.executable, "benchmarks/gpu_gpt2.py", "--compile", "--presets",
                       "fp8-tensorwise,fp8-rowwise", "--f8-layers", "auto", "--steps", "15", "--warmup", "4",
                       "--budget", "{budget}", "--out", "{out}/fp8-auto"]),
    # The eager *-mixed gap (1.011-1.033x on an H200): kernels and host time against torch.amp's, attributed.
    ("mixed-profile", 120, [sys.executable, "benchmarks/gpu_gpt2.py", "--presets", "bf16-mixed,fp16-mixed", "--profile",
                            "--steps", "30", "--budget", "{budget}", "--out", "{out}/mixed-profile"]),
    ("remainder", 90, [sys.executable, "benchmarks/remainder_step_cost.py", "--device", "cuda", "--width", "768",
                       "--blocks", "12"]),
    ("master-profile", 120, [sys.executable, "benchmarks/gpu_gpt2.py", "--presets", "bf16-master,fp16-master",
                             "--profile", "--steps", "30", "--budget", "{budget}", "--out", "{out}/master-profile"]),
    ("edit-check", 60, [sys.executable, "benchmarks/edit_check_cost.py", "--device", "cuda"]),
    ("master-versions", 100, [sys.executable, "benchmarks/gpu_gpt2.py", "--presets", "bf16-master,fp16-master",
                              "--weight-edits", "versions", "--budget", "{budget}", "--out", "{out}/master-versions"]),
    ("master-fused", 150, [sys.executable, "benchmarks/gpu_gpt2.py", "--presets", "bf16-master", "--fused-step", "on",
                           "--budget", "{budget}", "--out", "{out}/master-fused"]),
    ("tile-host", 60, [sys.executable, "benchmarks/tile_host_cost.py", "--device", "cuda", "--segments", "4,16,64",
                       "--copies", "both"]),
]
#: The checks a plain run makes (the rest need ``--all`` or ``--only``).
DEFAULT = ("syncs", "capture", "gpt2-eager", "compensated", "gpt2-compiled", "cuda-tests", "step")
#: Checks that need an optional package, and how to bring it to a machine with no package index.
_TORCHAO = ("torchao", "on a CPU machine: pip download --no-deps --only-binary=:all: --python-version 3.12 "
                       "--platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0; carry .whl; there: pip install "
                       "--no-index --no-deps --target /tmp/site .whl/*.whl and PYTHONPATH=/tmp/site")
NEEDS = {"fp8": _TORCHAO, "fp8-auto": _TORCHAO}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole suite (default 480)")
    ap.add_argument("--only", default="", help="comma-separated check names to run (in the suite's order)")
    ap.add_argument("--all", action="store_true",
                    help="after the default checks, every other one that fits the budget (issue 27's, diagnostics)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_suite_out", help="where logs and JSON go")
    args = ap.parse_args(argv)
    only = {s for s in args.only.split(",") if s}
    unknown = only - {name for name, _, _ in STEPS}
    if unknown:  # before anything starts: a typo would cost a GPU lease
        print(f"gpu_suite: no check named {', '.join(sorted(unknown))}; the checks: {', '.join(n for n, _, _ in STEPS)}")
        return 2
    if not torch.cuda.is_available():
        print("gpu_suite: no CUDA device here; these checks need a GPU. Skipped.")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "gpu_suite.txt").open("w", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    print(f"gpu_suite: {torch.cuda.get_device_name()} | torch {torch.__version__} | budget {args.budget:.0f} s", flush=True)
    t0 = time.perf_counter()
    results: list[tuple[str, str]] = []
    for name, limit, cmd in STEPS:
        if only and name not in only:
            continue
        if not only and not args.all and name not in DEFAULT:
            continue
        need = NEEDS.get(name)
        if need is not None and importlib.util.find_spec(need[0]) is None:
            results.append((name, f"skipped: no {need[0]} ({need[1]})"))
            continue
        left = args.budget - (time.perf_counter() - t0)
        if left < 20:
            results.append((name, "left out (budget)"))
            continue
        limit = min(limit, left)
        print(f"\n=== {name} (limit {limit:.0f} s) ===", flush=True)
        start = time.perf_counter()
        if cmd is None:
            try:
                rc = _syncs()
            except Exception as e:  # one check failing must not lose the others
                print(f"gpu_suite: {name}: {type(e).__name__}: {e}", flush=True)
                rc = 1
            status = "ok" if rc == 0 else "FAILED"
        else:
            argv_ = [a.format(budget=int(limit - 15), out=out) for a in cmd]
            # Its own process group: a limit kills the step's children too (pytest workers, compile workers).
            proc = subprocess.Popen(argv_, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            kill = functools.partial(_kill_group, proc)
            # A step silent past its limit (a long compile) is killed by the timer, not at its next line.
            timer = threading.Timer(limit, kill)
            timer.start()
            try:
                assert proc.stdout is not None
                for line in proc.stdout:  # streamed: a step stopped by its limit keeps what it printed
                    print(line, end="", flush=True)
                    log.write(line)
                    if time.perf_counter() - start > limit:
                        kill()
                        break
                rc = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill()
                rc = -9
            finally:
                timer.cancel()
            status = "ok" if rc == 0 else ("stopped at its limit" if rc in (-9, 137) else f"FAILED (exit {rc})")
        results.append((name, f"{status} in {time.perf_counter() - start:.0f} s"))
        log.flush()
    print("\n=== summary ===")
    for name, status in results:
        print(f"{name:14s} {status}")
        log.write(f"{name:14s} {status}\n")
    log.close()
    return 0 if all(s.startswith(("ok", "skipped")) for _, s in results) else 1


if __name__ == "__main__":
    sys.exit(main())
