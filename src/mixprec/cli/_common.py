"""What the ``mixprec`` subcommands share: the parser class, usage errors, ``-o KEY=VALUE``, workloads.

A leaf of :mod:`mixprec.cli`: it imports no other module of the package at import time.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Any, NoReturn

WORKLOAD_HELP = ("gpt, cnn, hf-gpt2, or MODULE:FUNCTION where FUNCTION(**options) returns a mixprec.bench.Workload "
                 "or a 4-tuple (model, optimizer_fn, batches, loss_fn): optimizer_fn(params) -> optimizer, batches "
                 "an iterable of batches, loss_fn(model, batch) -> scalar loss; MODULE may be a file, "
                 "path/to/file.py, which can import the modules next to it")


class UsageError(Exception):
    """Bad command-line arguments: printed as one line, exit status 2."""


class ArgError(Exception):
    """Bad input to ``doctor``/``check``: one line on stderr (prefixed with the command), exit status 2."""


def check_output_paths(out_dir: str | None = None, json_path: str | None = None) -> None:
    """Refuse, before any run, output paths that could not be written (the run's results would be lost after it).

    ``out_dir``: a directory, created when missing (not an existing file); ``json_path``: a file
    (``'-'``: stdout), not a directory. Either must lie under a directory this process can write.

    Raises:
        ArgError: the option, the path and why.
    """
    from pathlib import Path

    def writable_ancestor(p: Path) -> bool:
        for parent in (p, *p.parents):
            if parent.exists():
                return parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)
        return False

    if out_dir is not None:
        p = Path(out_dir)
        if p.exists() and not p.is_dir():
            raise ArgError(f"--out {out_dir}: exists and is not a directory; give a directory (created if missing)")
        if not writable_ancestor(p):
            raise ArgError(f"--out {out_dir}: cannot be created or written here; give a writable directory")
        try:  # made now (it would be at the end): a path the OS refuses fails before the run, not after it
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ArgError(f"--out {out_dir}: cannot be created ({e.strerror}); give a writable directory") from None
    if json_path is not None and json_path != "-":
        p = Path(json_path)
        if p.is_dir():
            raise ArgError(f"--json {json_path}: is a directory; give a file path (or '-' for stdout)")
        if not writable_ancestor(p.parent) or (p.exists() and not os.access(p, os.W_OK)):
            raise ArgError(f"--json {json_path}: cannot be written here; give a writable file path (or '-' for stdout)")
        existed = p.exists()
        try:  # opened (and, when new, removed again) now: a path the OS refuses fails before the run
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p, "a"):
                pass
            if not existed:
                p.unlink()
        except OSError as e:
            raise ArgError(f"--json {json_path}: cannot be written ({e.strerror}); give a writable file path") from None


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise :class:`UsageError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> ``(key, value)``, the value as an int, float or bool when it reads as one."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"mixprec compare: error: -o/--option expects KEY=VALUE, got {text!r} (e.g. -o n_layer=4)")
    v: Any = value.strip()
    for conv in (int, float):
        try:
            v = conv(value)
            break
        except ValueError:
            continue
    if isinstance(v, str) and v.lower() in ("true", "false"):
        v = v.lower() == "true"
    return key.strip(), v


# ----- doctor and check -----------------------------------------------------------------------------
def options(items: list[str]) -> dict[str, Any]:
    """The ``-o`` options of ``doctor``/``check`` as keyword arguments of the workload."""
    out: dict[str, Any] = {}
    for text in items:
        try:
            k, v = parse_option(text)
        except UsageError:
            raise ArgError(f"-o/--option expects KEY=VALUE, got {text!r} (e.g. -o n_layer=4)") from None
        out[k] = v
    return out


def policy(text: str) -> Any:
    """``--policy`` as a :class:`mixprec.Policy`."""
    from .._policy import Policy

    try:
        return Policy.parse(text)
    except (ValueError, TypeError) as e:
        raise ArgError(f"--policy: {e}") from None


def device(text: str) -> Any:
    """``--device`` (auto, cpu, cuda, cuda:N) as a ``torch.device``."""
    import torch

    if text in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, TypeError):
        raise ArgError(f"--device {text!r}: use auto, cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ArgError("--device cuda was asked for but no CUDA device is available")
    return dev


def add_workload(p: argparse.ArgumentParser, help: str) -> None:
    """The workload, as a positional argument or ``-w/--workload``: either form, in every subcommand.

    :func:`resolve_workload` turns the two into one (``args.workload``) after parsing.
    """
    p.add_argument("workload_pos", nargs="?", default=None, metavar="WORKLOAD", help=help)
    p.add_argument("-w", "--workload", default=None, metavar="WORKLOAD",
                   help="the workload as an option, the same as the positional WORKLOAD (give one, or both alike)")


def resolve_workload(args: argparse.Namespace, prog: str, default: str | None = None) -> str:
    """The workload of :func:`add_workload`'s two forms; :class:`UsageError` when they disagree or none is given.

    Stores the result in ``args.workload`` and returns it.
    """
    pos, opt = args.workload_pos, args.workload
    if pos is not None and opt is not None and pos.strip() != opt.strip():
        raise UsageError(f"{prog}: error: the workload was given twice and the two disagree: {pos!r} (positional) "
                         f"and {opt!r} (-w/--workload); give it once (see {prog} --help)")
    spec = pos if pos is not None else opt if opt is not None else default
    if spec is None:
        raise UsageError(f"{prog}: error: a workload is required: {prog} WORKLOAD or {prog} -w WORKLOAD "
                         f"(see {prog} --help)")
    args.workload = spec
    return spec


def run_failed(prog: str, error: Exception) -> int:
    """Report a failure of the user's run on one stderr line and return exit status 1.

    With ``MIXPREC_DEBUG`` set the exception propagates instead (its traceback is shown).
    """
    if os.environ.get("MIXPREC_DEBUG"):
        raise error
    print(f"{prog}: error: the run failed: {type(error).__name__}: {error} (MIXPREC_DEBUG=1 shows the traceback)",
          file=sys.stderr)
    return 1


def write_failed(prog: str, path: Any, error: OSError) -> None:
    """Report an output file that could not be written (one stderr line); the caller writes the rest and exits 1."""
    print(f"{prog}: error: could not write {path}: {error.strerror or error}", file=sys.stderr)


def load(spec: str, opts: dict[str, Any]) -> Any:
    """The workload, via mixprec.bench.load_workload (its errors are user errors)."""
    from ..bench import BenchError, load_workload

    try:
        return load_workload(spec, **opts)
    except BenchError as e:
        raise ArgError(str(e)) from None


def first_batches(workload: Any, n: int, device: Any) -> list[Any]:
    """The workload's first ``n`` batches, moved to ``device``."""
    from .._tree import tree_map

    batches = list(itertools.islice(iter(workload.batches), n))
    if not batches:
        raise ArgError(f"workload {workload.name!r} yields no batches")
    return [tree_map(lambda t: t.to(device), b) for b in batches]


def add_common(p: argparse.ArgumentParser) -> None:
    """The arguments ``doctor`` and ``check`` share."""
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="workload option, repeatable (gpt: n_layer, n_embd, batch_size, ...; your function's keyword arguments)")
    p.add_argument("--device", default="auto", help="auto (default), cpu or cuda")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the JSON record to PATH ('-': stdout)")
