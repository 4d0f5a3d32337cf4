"""``mixprec.autocast``: ``torch.autocast`` driven by a policy, with TF32 set and restored.

Global state touched and restored on exit (also when the body raises): the autocast
state of the device type (through ``torch.autocast`` itself) and the TF32 switches
``torch.backends.cuda.matmul.allow_tf32`` and ``torch.backends.cudnn.allow_tf32``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn

from ._casting import cast_tree
from ._policy import Policy

__all__ = ["autocast", "resolve_device_type"]

F = TypeVar("F", bound=Callable[..., Any])


def resolve_device_type(hint: object = None) -> str:
    """Work out the autocast device type from a hint.

    Args:
        hint: ``None`` (CUDA when available, else CPU), a device type string, a
            ``torch.device``, a tensor, or a module (the device of its first parameter or buffer).

    Returns:
        ``"cuda"``, ``"cpu"``, ... as ``torch.autocast`` expects.

    Raises:
        TypeError: the hint is none of the above.
    """
    if hint is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(hint, str):
        return torch.device(hint).type
    if isinstance(hint, torch.device):
        return hint.type
    if isinstance(hint, torch.Tensor):
        return hint.device.type
    if isinstance(hint, nn.Module):
        for t in hint.parameters():
            return t.device.type
        for t in hint.buffers():
            return t.device.type
        return "cpu"
    raise TypeError(
        f"cannot tell a device from {type(hint).__name__}; pass device_type='cuda' or 'cpu', a torch.device, "
        "a tensor or a module"
    )


def _device_from_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, (torch.Tensor, nn.Module)):
            return resolve_device_type(a)
    return None


class autocast:  # noqa: N801 - reads like torch.autocast, which it wraps
    """Run a region under a policy's compute dtype; a context manager and a decorator.

    Inside, ``torch.autocast`` runs with ``policy.compute_dtype`` (disabled for FP32
    compute) and TF32 is switched as the policy says. Everything is restored on exit, also
    when the body raises. Regions nest.

    Args:
        policy: A :class:`Policy`, preset name or grammar string.
        device_type: ``"cuda"``, ``"cpu"``, a device, a tensor or a module; ``None`` takes it
            from the first tensor or module argument when decorating, else CUDA if available,
            else CPU.
        enabled: ``False`` makes the region a no-op (useful for toggling from config).

    Example:
        >>> with autocast("bf16-mixed", "cpu"):
        ...     y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
        >>> y.dtype
        torch.bfloat16
    """

    def __init__(self, policy: Policy | str, device_type: object = None, *, enabled: bool = True) -> None:
        self.policy = Policy.parse(policy)
        self._hint = device_type
        self.enabled = enabled
        self._stack: list[tuple[Any, bool, bool]] = []

    @property
    def device_type(self) -> str:
        """The device type this region autocasts on."""
        return resolve_device_type(self._hint)

    def __enter__(self) -> "autocast":
        self._enter(self.device_type)
        return self

    def _enter(self, device_type: str) -> None:
        saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        ctx = torch.autocast(
            device_type=device_type,
            dtype=self.policy.compute_dtype if self.policy.uses_autocast else None,
            enabled=self.enabled and self.policy.uses_autocast,
        )
        if self.enabled:
            torch.backends.cuda.matmul.allow_tf32 = self.policy.tf32
            torch.backends.cudnn.allow_tf32 = self.policy.tf32
        try:
            ctx.__enter__()
        except BaseException:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
            raise
        self._stack.append((ctx, *saved))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        ctx, mm, cudnn = self._stack.pop()
        try:
            ctx.__exit__(exc_type, exc, tb)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = mm
            torch.backends.cudnn.allow_tf32 = cudnn

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            device = resolve_device_type(self._hint) if self._hint is not None else _device_from_args(args, kwargs)
            self._enter(device or resolve_device_type(None))
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                self.__exit__(type(e), e, e.__traceback__)
                raise
            self.__exit__(None, None, None)
            return result

        return wrapper  # type: ignore[return-value]

    @staticmethod
    def fp32(device_type: object = None) -> "_FP32Region":
        """A region that computes in FP32: autocast off (the advice for linalg, pre- and post-processing).

        As a decorator it also casts floating tensor arguments to FP32.

        Example:
            >>> with autocast("bf16-mixed", "cpu"):
            ...     with autocast.fp32("cpu"):
            ...         y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
            >>> y.dtype
            torch.float32
        """
        return _FP32Region(device_type)


class _FP32Region:
    """Autocast disabled on one device type (all of CPU and CUDA when none is given)."""

    def __init__(self, device_type: object = None) -> None:
        self._hint = device_type
        self._stack: list[list[Any]] = []

    def _types(self) -> list[str]:
        if self._hint is not None:
            return [resolve_device_type(self._hint)]
        return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]

    def __enter__(self) -> "_FP32Region":
        contexts = [torch.autocast(device_type=d, enabled=False) for d in self._types()]
        entered = []
        try:
            for c in contexts:
                c.__enter__()
                entered.append(c)
        except BaseException:
            for c in reversed(entered):
                c.__exit__(None, None, None)
            raise
        self._stack.append(entered)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        for c in reversed(self._stack.pop()):
            c.__exit__(exc_type, exc, tb)

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*cast_tree(args, torch.float32), **cast_tree(kwargs, torch.float32))

        return wrapper  # type: ignore[return-value]
