"""``mixprec compare``: one workload under each precision preset and torch.amp, side by side.

The work is :func:`mixprec.bench.run_compare`; this module parses the arguments and prints.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from typing import Any

from ._common import ArgError, UsageError, add_workload, check_output_paths, parse_option, resolve_workload

__all__ = ["add_compare"]

_EPILOG_COMPARE = """\
examples:
  mixprec compare                                   # gpt workload, default presets for this device
  mixprec compare -w cnn -p fp32,bf16-mixed,fp16-mixed --steps 200 --out results/
  mixprec compare -w hf-gpt2 -o n_layer=4 -o n_embd=128 --json results.json
  mixprec compare cnn --steps 100                   # the workload may also be positional, as in check
  mixprec compare -p bf16-mixed,fp16-mixed --seeds 0,1,2   # is each gap to fp32 within the seed noise?
  mixprec compare --compile -p bf16-mixed,bf16-master   # every row torch.compile'd, the baseline too
  mixprec compare -w my_bench:make                  # your own: make() returns a Workload or
                                                    # (model, optimizer_fn, batches, loss_fn)

presets: fp32, tf32, bf16-mixed, fp16-mixed, bf16-master, bf16-master-r16, fp16-master, bf16-pure, fp16-pure, all;
and fp8-tensorwise, fp8-rowwise (torchao, pip install 'mixprec[fp8]'; not in 'all'; emulated on a CPU: numerics, not speed).
The torch-amp baseline row (torch.autocast + torch.amp.GradScaler, as the PyTorch recipe writes
it) is added unless --baseline none. On a CPU, fp16 rows run an FP16 emulation (FP16 storage and
rounding, FP32 arithmetic, like GPU kernels) unless --native-fp16; CPU timings do not show GPU
speed-ups.

--seeds 0,1,2 runs the whole comparison once per seed (initial weights, batch order, dropout) and
reports, per row, the loss gap to fp32 (same seed) as a mean over seeds with its spread (std), and a
verdict: "within noise" when the gap's 95% interval over the seeds (Student's t) lies inside +-2 x the
noise of fp32 against itself (the std of fp32's loss across the seeds), "outside noise" when it lies
outside, no verdict when it straddles that band or with fewer than 3 seeds. fp32 is added to the
presets when missing. The JSON gets a
"seeds" section; the loss plot shows a min-max band across seeds per row.
"""


def _baseline_arg(text: str) -> str:
    parts = [p.strip().lower() for p in text.split(",") if p.strip()]
    allowed = ("auto", "fp16", "bf16", "none")
    bad = [p for p in parts if p not in allowed]
    if not parts or bad:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from auto, fp16, bf16, fp16,bf16, none)")
    return ",".join(parts)


def _peak_tflops_arg(text: str) -> float:
    """``--peak-tflops``: a finite number above 0 (0, negative or NaN would give no MFU or a meaningless one)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number of TFLOP/s, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expects a finite number of TFLOP/s above 0 (e.g. 989 for an H100), got {text!r}")
    return value


def add_compare(subparsers: Any) -> None:
    """Add the ``compare`` subcommand to ``mixprec``'s parser."""
    p = subparsers.add_parser(
        "compare",
        help="train one model under each precision preset and torch.amp, side by side",
        description="Train the same model, data and seed under each precision preset and a torch.amp "
        "baseline, interleaved, and report speed, memory and accuracy side by side.",
        epilog=_EPILOG_COMPARE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload(p, "gpt (default), cnn, hf-gpt2, or MODULE:FUNCTION (positional or -w)")
    p.add_argument("-p", "--presets", default=None,
                   help="comma-separated presets, or 'all' (default: all on a GPU; fp32,bf16-mixed,fp16-mixed,"
                        "bf16-master,fp16-master on a CPU)")
    p.add_argument("--baseline", default="auto", type=_baseline_arg,
                   help="torch-amp baseline dtype: auto, fp16, bf16, fp16,bf16 (two rows) or none (auto: fp16 on "
                        "a GPU; on a CPU fp16 emulated when an fp16 preset runs emulated, else bf16)")
    p.add_argument("--steps", type=int, default=None, help="training steps per row (default: 200 on CPU, 300 on GPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 5 on CPU, 10 on GPU)")
    p.add_argument("--device", default="auto", help="auto (default), cpu or cuda")
    p.add_argument("--native-fp16", action="store_true",
                   help="on a CPU, run fp16 rows with torch's native CPU fp16 kernels instead of the emulation (slow)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="workload size option, repeatable (gpt/hf-gpt2: n_layer, n_head, n_embd, block_size, "
                        "batch_size, lr, ...; cnn: width, batch_size, ...; your function's keyword arguments)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the built-in workload's initial weights and batch order (unless -o seed=S) and "
                        "of every row's RNG stream; every row starts from the same weights and batches (default 0)")
    p.add_argument("--seeds", default=None, metavar="S,S,...",
                   help="run every row once per seed (at least 2, e.g. 0,1,2 or 0-4) and report each gap to fp32 as "
                        "mean and spread across seeds, with a verdict: within the seed noise of fp32 or not")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile every row's model, the torch-amp baseline's too (BACKEND default inductor; "
                        "aot_eager compiles fastest); step times exclude compilation, shown as 'compile s' (cold: a fresh Inductor "
                        "cache), 'warm s' (one step after torch._dynamo.reset(), caches warm), with 'recompiles' (timed steps "
                        "that compiled again)")
    p.add_argument("--f8-layers", default=None, metavar="WHICH",
                   help="the linears the FP8 rows convert instead of all: auto (the plan measured at prepare on the first "
                        "batch), globs joined by '+', all or none")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the JSON record to PATH ('-': stdout)")
    p.add_argument("--out", metavar="DIR", default=None, help="write PNG plots and compare.json into DIR")
    p.add_argument("--peak-tflops", type=_peak_tflops_arg, default=None,
                   help="the GPU's dense peak TFLOP/s for MFU, when its name is not in mixprec's table")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_compare)



# ----- the command ------------------------------------------------------------------------------------
def _cmd_compare(args: argparse.Namespace) -> int:
    import torch

    from ..bench import BenchError, parse_seeds

    prog = "mixprec compare"
    try:
        resolve_workload(args, prog, default="gpt")
        options = dict(parse_option(o) for o in args.option)
        if args.threads is not None:
            if args.threads < 1:
                raise BenchError(f"--threads {args.threads}: must be at least 1")
            torch.set_num_threads(args.threads)
        if args.steps is not None and args.steps < 2:
            raise BenchError(f"--steps {args.steps}: need at least 2")
        if args.warmup is not None and args.warmup < 1:
            raise BenchError(f"--warmup {args.warmup}: need at least 1 (memory is measured on the last warm-up step)")
        if args.seeds is not None:
            if args.seed is not None:
                raise BenchError(f"--seed {args.seed} and --seeds {args.seeds}: give one (--seeds runs every row once "
                                 "per seed; --seed N runs once)")
            parse_seeds(args.seeds)  # validates before the (slower) runs
        from ..bench._runner import check_compile_backend

        check_compile_backend(args.compile)
        try:
            check_output_paths(args.out, args.json)
        except ArgError as e:
            raise BenchError(str(e)) from None
        if args.out is not None:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise BenchError("--out needs matplotlib for the plots: pip install matplotlib (or 'mixprec[cli]')") from None
        return _run_compare(args, options)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return 2
    except BenchError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def _run_compare(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from pathlib import Path

    from ..bench import SeedsResult, parse_presets, resolve_device, run_compare, run_compare_seeds
    from ..bench._plots import write_plots
    from ..bench._report import print_report, print_seeds_report, write_json

    device = resolve_device(args.device)
    presets = parse_presets(args.presets, device)  # validates before the (slower) workload build
    json_to_stdout = args.json == "-"
    report_file = sys.stderr if json_to_stdout else sys.stdout
    console = _console(report_file)
    intro = (
        f"mixprec compare: {args.workload} on {device}, presets {', '.join(presets)}"
        + ("" if args.baseline == "none" else f" + torch-amp baseline ({args.baseline})")
    )
    if args.seeds is not None:
        intro += f", once per seed ({args.seeds})"
    if args.compile:
        intro += f", compiled ({args.compile}; the first steps compile, expect a pause)"
    if device.type == "cpu":
        intro += ". CPU run: timings here do not show GPU speed-ups."
    _say(console, report_file, intro)

    progress = _Progress(enabled=not args.no_progress)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        common: dict[str, Any] = dict(
            baseline=args.baseline, steps=args.steps, warmup=args.warmup, device=device,
            fp16_cpu="native" if args.native_fp16 else "emulate", peak_tflops_override=args.peak_tflops,
            progress=progress, workload_options=options, compile=args.compile, f8_layers=args.f8_layers,
        )
        seeds: SeedsResult | None = None
        try:
            if args.seeds is not None:
                seeds = run_compare_seeds(args.workload, presets, seeds=args.seeds, **common)
                result = seeds.runs[0]
            else:
                result = run_compare(args.workload, presets, seed=0 if args.seed is None else args.seed, **common)
        finally:
            progress.close()
    command = "mixprec " + " ".join(sys.argv[1:] if args.argv is None else args.argv)
    for run in seeds.runs if seeds is not None else [result]:
        run.settings["command"] = command
    if seeds is not None:
        print_seeds_report(seeds, report_file)
    else:
        print_report(result, report_file)
    seen: set[str] = set()
    for w in caught:
        if issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning, FutureWarning)):
            continue
        msg = " ".join(str(w.message).split())
        if msg not in seen and not msg.startswith("fp16 on CPU"):
            seen.add(msg)
            _say(console, report_file, f"warning: {msg}", dim=True)
    from . import _common

    unwritten = False  # an output that cannot be written (a full disk) must not cost the others
    if args.json is not None:
        try:
            write_json(seeds if seeds is not None else result, args.json)
            if not json_to_stdout:
                _say(console, report_file, f"JSON written to {args.json}")
        except OSError as e:
            _common.write_failed("mixprec compare", args.json, e)
            unwritten = True
    if args.out is not None:
        out = Path(args.out)
        try:
            paths = write_plots(result, out, seeds=seeds)
            write_json(seeds if seeds is not None else result, out / "compare.json")
            _say(console, report_file, f"Plots and compare.json written to {out}/: {', '.join(p.name for p in paths)}")
        except OSError as e:
            _common.write_failed("mixprec compare", out, e)
            unwritten = True
    elif args.json is None:
        _say(console, report_file, "Add --out DIR for plots (loss curves, loss scale, memory, speed) and JSON.", dim=True)
    # Exit 1 when nothing could be measured (every row unavailable or failed), or an output was not written.
    ok = any(r.status == "ok" for run in (seeds.runs if seeds else [result]) for r in run.rows)
    return 0 if ok and not unwritten else 1


def _console(file: Any) -> Any:
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(file=file)


def _say(console: Any, file: Any, text: str, dim: bool = False) -> None:
    if console is None:
        print(text, file=file)
    else:
        console.print(f"[dim]{text}[/dim]" if dim else text, highlight=False, markup=dim, soft_wrap=True)


class _Progress:
    """Progress bars on stderr (one per row) when stderr is a terminal and rich is installed."""

    def __init__(self, enabled: bool) -> None:
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}
        if not enabled or not sys.stderr.isatty():
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:
            return
        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=Console(file=sys.stderr), transient=True,
        )
        self._progress.start()

    def __call__(self, event: str, label: str, step: int, total: int) -> None:
        if self._progress is None:
            return
        if event == "start":
            self._tasks[label] = self._progress.add_task(label, total=total)
        elif event == "step" and label in self._tasks:
            self._progress.update(self._tasks[label], completed=step)
        elif event == "eval" and label in self._tasks:
            self._progress.update(self._tasks[label], description=f"{label} (evaluating)")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
