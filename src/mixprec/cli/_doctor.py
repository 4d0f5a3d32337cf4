"""``mixprec doctor``: check, monitor, report and audit a workload for a policy.

:func:`run_doctor` is the engine (importable without the command line); the rest parses the
arguments and prints. Exit codes: 0 done, 1 the pre-flight check failed or the run failed, 2 bad
arguments (one line on stderr, never a traceback; set ``MIXPREC_DEBUG=1`` for tracebacks of run failures).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from .._autocast import autocast
from .._policy import Policy
from ..numerics import NumericsMonitor, audit, check
from ..numerics._findings import fp32_divergence, jsonable, mark_fp32_divergence
from ..numerics._fp8_plan import fp8_stats_table
from . import _common
from ._common import WORKLOAD_HELP, ArgError, add_common, add_workload, resolve_workload

__all__ = ["DoctorResult", "add_doctor", "run_doctor"]

_EPILOG_DOCTOR = """\
what it does:
  1. pre-flight check: one forward/backward of the workload's model in FP32 and under --policy on the
     first batch; loss, outputs and gradients compared (relative error, SQNR); on inf/NaN, the first
     module that produced it, re-run in FP32 to tell whether precision is the cause;
  2. --steps training steps in FP32 with a NumericsMonitor: activation, activation-gradient and
     parameter-gradient histograms against the FP16/BF16 ranges, BF16 stagnation of the updates;
  3. the report: modules at FP16 overflow risk (an FP32 island only where it can help: a module whose
     output itself exceeds FP16's range needs BF16 or rescaling), inf/NaN made in FP32 (not a precision
     problem) or entering the modules from outside them (the batch, the parent's code), gradients lost to underflow at scale 1 and at the policy's loss scale (and FP16 gradients
     that are mostly exact zeros: possibly flushed), the loss-scale range, FP32 islands and a preset;
  4. a precision audit of the workload prepared under --policy (dtypes of parameters, masters,
     gradients, optimizer states, communication; silent downgrades flagged);
  FP8 policies (f8=, fp8-tensorwise, fp8-rowwise) add the per-layer FP8 table: fp8_plan on the first
     batch (per linear: amax, flushed values, SQNR of each GEMM in FP8 against BF16, FLOPs, FP8 or BF16
     and why) and the E4M3/E5M2 saturation and underflow of each linear's GEMM operands over the steps;
  5. DIR/doctor-grad-hist.png (activation gradients in log2 bins with the FP16 and BF16 ranges, before and
     after the loss scale) and DIR/doctor.json.

examples:
  mixprec doctor                                  # gpt workload, fp16-mixed
  mixprec doctor -w cnn -p bf16-master --steps 20
  mixprec doctor -w my_model:make -o batch_size=8 --out diag/
  mixprec doctor cnn -p bf16-master               # the workload may also be positional, as in check
  mixprec doctor gpt -p fp8-rowwise --no-plot     # with the per-layer FP8 table

exit status: 0 done, 1 the pre-flight check failed (or the run failed, or the monitored FP32 run itself
  diverged: a non-finite or exploding loss, not a precision problem), 2 bad arguments.
"""


def _scale_for(policy: Any, check_result: Any) -> float:
    if policy.loss_scale == "none":
        return 1.0
    if check_result is not None and check_result.finite:
        return float(check_result.loss_scale)
    if policy.init_scale is not None:
        return float(policy.init_scale)
    return 2.0**16 if policy.loss_scale == "dynamic" else 1.0


def _with_island(report: Any, island: str | None) -> Any:
    """``report`` with the FP32 island the pre-flight check found necessary in its FP16 islands and policy.

    The FP32 monitored run cannot see an overflow inside FP16 computation (attention scores, say),
    so the check's trace is the only witness: the printed FP16 policy must carry its island, or it
    fails the same check.

    Args:
        report: The monitor's :class:`~mixprec.numerics.NumericsReport`.
        island: A policy ``i=`` entry (``"name:attn"``), or ``None`` (nothing to add).

    Returns:
        The report, updated (a copy) when the island was missing.
    """
    if island is None or island in report.recommended_islands:
        return report
    fp16_policy = report.fp16_policy
    if fp16_policy is not None:
        p = Policy.parse(fp16_policy)
        if island not in p.fp32_islands:
            fp16_policy = str(dataclasses.replace(p, fp32_islands=(*p.fp32_islands, island)))
    return dataclasses.replace(report, recommended_islands=[*report.recommended_islands, island],
                               fp16_policy=fp16_policy)


@dataclasses.dataclass
class DoctorResult:
    """Everything ``mixprec doctor`` found (see :func:`run_doctor`)."""

    workload: str
    policy: str
    device: str
    steps: int
    losses: list[float]
    report: Any
    check: Any
    audit: Any
    notes: list[str]
    fp8_plan: Any = None
    fp8_stats: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (schema ``mixprec.doctor/1``)."""
        return {
            "schema": "mixprec.doctor/1", "workload": self.workload, "policy": self.policy, "device": self.device,
            "steps": self.steps, "losses": jsonable(self.losses), "report": self.report.to_dict(),
            "check": self.check.to_dict() if self.check is not None else None,
            "audit": self.audit.to_dict() if self.audit is not None else None, "notes": self.notes,
            "fp8_plan": self.fp8_plan.to_dict() if self.fp8_plan is not None else None,
            "fp8_stats": (None if self.fp8_stats is None else
                          {m: {o: st.to_dict() for o, st in ops.items()} for m, ops in self.fp8_stats.items()}),
        }


def run_doctor(workload: Any, policy: Any = "fp16-mixed", *, steps: int = 10, every: int = 1, device: Any = None,
               seed: int = 0, options: dict[str, Any] | None = None, run_check: bool = True,
               max_elements: int | None = None) -> DoctorResult:
    """Check, monitor, report and audit a workload for a policy (the engine of ``mixprec doctor``).

    Args:
        workload: A :class:`mixprec.bench.Workload` or a spec for ``mixprec.bench.load_workload``.
        policy: The policy to diagnose.
        steps: FP32 training steps observed by the :class:`NumericsMonitor`.
        every: Monitor sampling interval.
        device: ``None``: CUDA when available, else CPU.
        seed: RNG seed of the monitored run and the check.
        options: Workload size options.
        run_check: Run the pre-flight check on the first batch.
        max_elements: Histogram subsampling for large tensors (see NumericsMonitor).

    Returns:
        :class:`DoctorResult`.
    """
    import torch

    pol = Policy.parse(policy)
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    w = _common.load(workload, options or {}) if isinstance(workload, str) else workload
    notes: list[str] = []
    base = w.model.to(dev)
    batches = _common.first_batches(w, max(steps, 1), dev)

    check_result = check(base, batches[0], pol, w.loss_fn, seed=seed) if run_check else None
    plan = None
    if pol.fp8 != "none":  # the per-layer FP8 table: measured on the first batch, as f8_layers=auto decides
        from ..numerics import fp8_plan

        plan = fp8_plan(base, batches[0], w.loss_fn, pol.fp8, policy=pol)

    # The monitored run is FP32, as in Micikevicius et al.: values that would flush or overflow
    # in FP16 are still visible, so the report can say what FP16 would do to them.
    model = copy.deepcopy(base)
    opt = w.optimizer_fn(model.parameters())
    losses: list[float] = []
    mon = NumericsMonitor(model, every=every, optimizer=opt, max_elements=max_elements, policy=pol,
                          fp8=None if pol.fp8 == "none" else pol.fp8)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        with mon, autocast.fp32(dev.type):
            for b in batches[:steps]:
                loss = w.loss_fn(model, b)
                loss.backward()
                if getattr(w, "clip_grad_norm", None):
                    torch.nn.utils.clip_grad_norm_(model.parameters(), w.clip_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
    report = mon.report(loss_scale=_scale_for(pol, check_result), device=dev)
    diverged = fp32_divergence(losses)
    if diverged is not None:
        # The reference run itself blew up: its huge activations and gradients would otherwise read as FP16
        # overflows and an absurd loss scale, with a precision change advised that diverges the same way.
        report = mark_fp32_divergence(report, diverged)
    trace = getattr(check_result, "trace", None)
    if check_result is not None and check_result.verdict == "fail" and trace is not None and trace.found:
        # The monitored run is FP32 (finite); the check ran the policy: its first inf/NaN leads the findings,
        # in the same words as the check's (TraceResult.location).
        cause = ""
        if trace.fp32_rerun is not None and trace.fp32_rerun.precision_is_cause is not None:
            cause = (" (finite in FP32: precision is the cause)" if trace.fp32_rerun.precision_is_cause
                     else " (also non-finite in FP32: not a precision problem)")
        advice = f" {trace.advice}" if trace.advice else ""
        # (after the FP32 run's own divergence, which explains it, when there was one)
        report.findings.insert(0 if diverged is None else 1, f"Under {pol.label} the first {trace.kind} appears in the {trace.phase} {trace.location}"
                                  f"{cause}; the pre-flight check fails.{advice}")
        if diverged is None and pol.compute_dtype == torch.float16:
            report = _with_island(report, trace.recommended_island)
    fp8_stats = mon.fp8_stats() if pol.fp8 != "none" else None

    audit_result = None
    try:
        from .._precision import MixedPrecision
    except ImportError as e:  # MixedPrecision needs the loss scalers; without them, no audit of the prepared setup
        notes.append(f"audit skipped: mixprec.MixedPrecision is unavailable ({e})")
    else:
        prepared = copy.deepcopy(base)
        # f8_layers=auto: the plan measured above, so prepare need not measure again
        prec = MixedPrecision(plan.policy(pol) if plan is not None and pol.fp8_layers == ("auto",) else pol)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            prepared, popt = prec.prepare(prepared, w.optimizer_fn(prepared.parameters()))
        audit_result = audit(prepared, popt, prec)
    return DoctorResult(workload=w.name, policy=str(pol), device=str(dev), steps=len(losses), losses=losses,
                        report=report, check=check_result, audit=audit_result, notes=notes, fp8_plan=plan,
                        fp8_stats=fp8_stats)


def _cmd_doctor(args: argparse.Namespace) -> int:
    prog = "mixprec doctor"
    resolve_workload(args, prog, default="gpt")
    try:
        opts = _common.options(args.option)
        pol = _common.policy(args.policy)
        dev = _common.device(args.device)
        if args.steps < 1:
            raise ArgError(f"--steps {args.steps}: need at least 1")
        if args.every < 1:
            raise ArgError(f"--every {args.every}: need at least 1")
        if args.threads is not None:
            if args.threads < 1:
                raise ArgError(f"--threads {args.threads}: must be at least 1")
            import torch

            torch.set_num_threads(args.threads)
        if not args.no_plot:
            try:
                from ..numerics._histogram import _pyplot

                _pyplot()
            except ImportError as e:
                raise ArgError(f"{e} (or pass --no-plot)") from None
        _common.check_output_paths(args.out, args.json)
        w = _common.load(args.workload, opts)
    except ArgError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    json_to_stdout = args.json == "-"
    out_file = sys.stderr if json_to_stdout else sys.stdout
    print(f"{prog}: workload {w.name}, policy {pol.label}, device {dev}, up to {args.steps} monitored FP32 step(s) "
          "(as many as the workload has batches)", file=out_file)
    try:
        res = run_doctor(w, pol, steps=args.steps, every=args.every, device=dev, seed=args.seed,
                         run_check=not args.no_check)
    except ArgError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        return _common.run_failed(prog, e)
    if res.check is not None:
        res.check.print(file=out_file)
        print(file=out_file)
    res.report.print(file=out_file)
    if res.fp8_plan is not None:
        print(file=out_file)
        print(res.fp8_plan.table(), file=out_file)
        if res.fp8_stats:
            print(f"\nFP8 casts of each linear's GEMM operands over the {res.steps} monitored step(s) "
                  f"({res.fp8_plan.recipe} scaling):", file=out_file)
            print(fp8_stats_table(res.fp8_stats), file=out_file)
    if res.audit is not None:
        print(file=out_file)
        res.audit.print(file=out_file)
    for n in res.notes:
        print(f"note: {n}", file=out_file)
    written = []
    out = Path(args.out)
    if not args.no_plot:
        from ..numerics._histogram import plot_gradient_histogram

        written.append(plot_gradient_histogram(res.report, out / "doctor-grad-hist.png",
                                               title=f"{w.name}: activation-gradient magnitudes (FP32 run, "
                                                     f"{res.steps} steps) vs the FP16/BF16 ranges"))
    payload = json.dumps(res.to_dict(), indent=1)
    unwritten = False
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "doctor.json").write_text(payload)
        written.append(out / "doctor.json")
    except OSError as e:
        _common.write_failed(prog, out / "doctor.json", e)
        unwritten = True
    if args.json is not None:
        if json_to_stdout:
            print(payload)
        else:
            try:
                Path(args.json).write_text(payload)
                written.append(Path(args.json))
            except OSError as e:
                _common.write_failed(prog, args.json, e)
                unwritten = True
    print(f"written: {', '.join(str(p) for p in written)}", file=out_file)
    # A diverged FP32 run is a failed run (exit 1): the report has no precision advice to act on.
    failed = res.report.fp32_diverged is not None or (res.check is not None and res.check.verdict == "fail")
    return 1 if unwritten or failed else 0


def add_doctor(subparsers: Any) -> None:
    """Add the ``doctor`` subcommand to ``mixprec``'s parser."""
    d = subparsers.add_parser(
        "doctor",
        help="diagnose a model's numerics: overflow, underflow, loss scale, stagnation, islands, preset",
        description="Check a workload under a policy, watch a few FP32 training steps with hooks, and report what "
                    "FP16/BF16 would do to its values, what loss scale and FP32 islands it needs, and which dtypes "
                    "the prepared setup really uses.",
        epilog=_EPILOG_DOCTOR, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload(d, WORKLOAD_HELP + " (default: gpt; positional or -w)")
    d.add_argument("-p", "--policy", default="fp16-mixed", help="the policy to diagnose (default fp16-mixed)")
    d.add_argument("--steps", type=int, default=10, help="monitored FP32 training steps (default 10)")
    d.add_argument("--every", type=int, default=1, help="monitor one step in N (default 1)")
    d.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    d.add_argument("--out", metavar="DIR", default="mixprec-out", help="where to write the PNG and doctor.json "
                   "(default mixprec-out)")
    d.add_argument("--no-plot", action="store_true", help="do not write the histogram PNG (no matplotlib needed)")
    d.add_argument("--no-check", action="store_true", help="skip the pre-flight check")
    add_common(d)
    d.set_defaults(func=_cmd_doctor)
