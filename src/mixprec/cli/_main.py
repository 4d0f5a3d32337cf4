"""``main`` and ``build_parser``: the ``mixprec`` parser with every subcommand, and the exit-code contract.

Re-exported by :mod:`mixprec.cli` (the console script is ``mixprec.cli:main``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._common import Parser, UsageError
from ._compare import add_compare

__all__ = ["build_parser", "main"]


def build_parser() -> tuple[argparse.ArgumentParser, str | None]:
    """The ``mixprec`` parser, and why ``doctor``/``check`` are missing (``None`` when present)."""
    from .._version import __version__

    parser = Parser(prog="mixprec", description="Mixed-precision training for PyTorch: benchmark and diagnostics.")
    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    add_compare(subparsers)
    missing: str | None = None
    try:
        from ._check import add_check
        from ._doctor import add_doctor
    except ModuleNotFoundError as e:
        missing = f"not installed in this build ({e})"
    except Exception as e:  # a broken numerics module must not take `compare` down with it
        missing = f"failed to load: {type(e).__name__}: {e}"
    else:
        try:
            add_doctor(subparsers)
            add_check(subparsers)
        except Exception as e:
            missing = f"failed to register: {type(e).__name__}: {e}"
    return parser, missing


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mixprec`` command line; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        parser, numerics_missing = build_parser()
        if args_list and args_list[0] in ("doctor", "check") and numerics_missing:
            raise UsageError(f"mixprec {args_list[0]}: unavailable: mixprec.numerics is {numerics_missing}")
        try:
            args = parser.parse_args(args_list)
        except SystemExit as e:  # --help / --version
            return int(e.code or 0) if not isinstance(e.code, str) else 2
        if getattr(args, "func", None) is None:
            parser.print_help(sys.stderr)
            return 2
        args.argv = None if argv is None else list(argv)
        return int(args.func(args))
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mixprec: interrupted", file=sys.stderr)
        return 130
