"""Exceptions and the helpers that word mixprec's error messages.

Every user-facing error says what was passed, what is allowed and how to fix it. The helpers
here keep that wording uniform.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = ["NumericsError", "check_fused", "closest", "eager_only", "unknown_choice"]


class NumericsError(RuntimeError):
    """Training has failed numerically in a way mixprec cannot recover from by itself.

    Raised, for example, when dynamic loss scaling sits at its floor and every step
    still overflows: skipping further steps would only hide the problem. The message
    names what happened and what to try.
    """


def closest(value: str, choices: Iterable[str]) -> str | None:
    """Return the choice that looks most like ``value``, or ``None`` when nothing is close.

    Args:
        value: What the user typed.
        choices: The accepted spellings.

    Returns:
        The closest accepted spelling (difflib ratio >= 0.5), or ``None``.
    """
    found = difflib.get_close_matches(value.strip().lower(), [c.lower() for c in choices], n=1, cutoff=0.5)
    if not found:
        return None
    by_lower = {c.lower(): c for c in choices}
    return by_lower[found[0]]


def unknown_choice(what: str, value: object, choices: Iterable[str], hint: str = "") -> ValueError:
    """Build the ``ValueError`` for a value outside a fixed set of choices.

    The message echoes the value, lists every choice and names the closest one.

    Args:
        what: What the value is, e.g. ``"precision preset"``.
        value: The value the user passed.
        choices: Every accepted spelling.
        hint: An extra sentence on how to fix it.

    Returns:
        The exception (the caller raises it, so tracebacks point at the caller).
    """
    choices = list(choices)
    msg = f"unknown {what} {value!r}; choose one of: {', '.join(choices)}."
    if isinstance(value, str):
        near = closest(value, choices)
        if near is not None:
            msg += f" Did you mean {near!r}?"
    if hint:
        msg += f" {hint}"
    return ValueError(msg)


def check_fused(fused: object) -> None:
    """Validate a ``fused=`` argument (``MixedPrecision``, ``MasterWeightOptimizer``, ``mixprec.optim``).

    Raises:
        TypeError: not ``True``, ``False`` or ``None``.
    """
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused must be True, False or None (on where it pays off), got {fused!r}")


def eager_only(reason: str) -> Callable[[_F], _F]:
    """Decorator: the function runs eagerly when a ``torch.compile`` trace reaches it (one graph break).

    ``reason`` is what dynamo's graph-break message (``fullgraph=True``) says, instead of its
    generic "remove the torch.compiler.disable call".
    """
    def wrap(fn: _F) -> _F:
        import torch

        try:
            return torch._dynamo.disable(fn, reason=reason)
        except TypeError:  # a torch whose disable() takes no reason
            return torch._dynamo.disable(fn)
    return wrap
