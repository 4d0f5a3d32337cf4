"""``mixprec check``: the pre-flight check of :func:`mixprec.numerics.check` on the command line.

Exit codes: 0 pass or warn, 1 the check failed or the run failed, 2 bad arguments (one line on
stderr, never a traceback; set ``MIXPREC_DEBUG=1`` for tracebacks of run failures).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..numerics import check
from . import _common
from ._common import WORKLOAD_HELP, ArgError, add_common, add_workload, resolve_workload

__all__ = ["add_check"]

_EPILOG_CHECK = """\
examples:
  mixprec check my_model:make --policy fp16-mixed
  mixprec check gpt -p bf16-master --json check.json
  mixprec check -w path/to/model.py:make             # the workload as -w, as in compare and doctor

The model runs twice on the first batch, in FP32 and under the policy (deep copies; nothing is
changed). Exit status: 0 pass or warn, 1 fail, 2 bad arguments.
"""


def add_check(subparsers: Any) -> None:
    """Add the ``check`` subcommand to ``mixprec``'s parser."""
    c = subparsers.add_parser(
        "check",
        help="pre-flight check: one step in FP32 and under a policy, compared, with a verdict",
        description="Run the workload's model on its first batch in FP32 and under --policy; compare loss, outputs and "
                    "gradients (relative error, SQNR in dB), check the device, and print a verdict with reasons.",
        epilog=_EPILOG_CHECK, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload(c, WORKLOAD_HELP + " (required: positional or -w)")
    c.add_argument("-p", "--policy", default="bf16-mixed", help="the policy to check (default bf16-mixed)")
    add_common(c)
    c.set_defaults(func=_cmd_check)


def _cmd_check(args: argparse.Namespace) -> int:
    prog = "mixprec check"
    resolve_workload(args, prog)
    try:
        opts = _common.options(args.option)
        pol = _common.policy(args.policy)
        dev = _common.device(args.device)
        _common.check_output_paths(None, args.json)
        w = _common.load(args.workload, opts)
        batch = _common.first_batches(w, 1, dev)[0]
    except ArgError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        res = check(w.model.to(dev), batch, pol, w.loss_fn, seed=args.seed)
    except Exception as e:
        return _common.run_failed(prog, e)
    json_to_stdout = args.json == "-"
    res.print(file=sys.stderr if json_to_stdout else sys.stdout)
    if args.json is not None:
        payload = json.dumps(res.to_dict(), indent=1)
        if json_to_stdout:
            print(payload)
        else:
            try:
                Path(args.json).write_text(payload)
            except OSError as e:
                _common.write_failed(prog, args.json, e)
                return 1
    return 1 if res.verdict == "fail" else 0
