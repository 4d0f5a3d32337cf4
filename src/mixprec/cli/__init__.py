"""The ``mixprec`` command: ``compare`` (``_compare.py``), ``doctor`` (``_doctor.py``), ``check`` (``_check.py``).

Each subcommand module has an ``add_<name>(subparsers)`` that adds its parser and sets the function that
runs it; the work itself lives in the library (:mod:`mixprec.bench`, :mod:`mixprec.numerics`). ``doctor`` and
``check`` need :mod:`mixprec.numerics`: when it cannot be imported, the other commands still work and these
two say why they are unavailable.

Exit codes: 0 success, 1 a failure while running, 2 bad arguments (one line on stderr,
never a traceback), 130 interrupted.
"""

from ._common import UsageError as UsageError  # raised by the parsers; importable here as before
from ._main import build_parser, main

__all__ = ["build_parser", "main"]
