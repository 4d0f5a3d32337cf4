"""``mixprec.autocast``: ``torch.autocast`` driven by a policy, and :func:`tf32`, the one TF32 switch.

Global state touched and restored on exit (also when the body raises): the autocast
state of the device type (through ``torch.autocast`` itself) and the TF32 settings of
CUDA matmuls and cuDNN convolutions/RNNs (through :func:`tf32`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, NamedTuple, TypeVar, cast

import torch
from torch import nn

from ._casting import cast_tree
from ._policy import Policy

__all__ = ["autocast", "resolve_device_type", "tf32", "tf32_enabled"]

F = TypeVar("F", bound=Callable[..., Any])


# ----- TF32 -------------------------------------------------------------------------------------------
# torch has two APIs for TF32. The legacy one (torch.backends.cuda.matmul.allow_tf32,
# torch.backends.cudnn.allow_tf32, torch.set_float32_matmul_precision) keeps a matmul precision
# enum and a cuDNN flag; torch >= 2.9 adds per-backend, per-op strings (``fp32_precision``:
# "ieee", "tf32", "bf16", "none" = inherit), and the legacy setters write both. Reading a legacy
# flag raises RuntimeError ("... you have used mix of the legacy and new APIs ...") when the two
# disagree, which is what a user of the new API (torch.backends.fp32_precision = "tf32", as
# transformers' enable_tf32 does) always has. So :func:`tf32` saves what can be read; switches
# with the legacy setters when the legacy flags read fine (legacy reads inside the region keep
# working: torch.compile's inductor reads them) and then sets the op strings explicitly (the
# legacy cuDNN setter alone can leave TF32 on, see _set_tf32); and on exit writes back the
# legacy state first, then every op string exactly as it was.
def _op_nodes() -> tuple[Any, ...]:
    """The ``fp32_precision`` settings of CUDA matmul, cuDNN conv and cuDNN RNN (empty before torch 2.9)."""
    try:
        nodes = (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn)  # type: ignore[attr-defined]  # runtime-only (torch>=2.9)
        for node in nodes:
            node.fp32_precision  # noqa: B018 - probe: AttributeError before torch 2.9
    except AttributeError:
        return ()
    return nodes


_OP_NODES = _op_nodes()


def _read(getter: Callable[[], Any]) -> Any:
    """A legacy TF32 setting, or ``None`` when torch refuses to read it (legacy and new APIs mixed)."""
    try:
        return getter()
    except RuntimeError:
        return None


def _legacy_matmul() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32)


def _legacy_cudnn() -> bool:
    return bool(torch.backends.cudnn.allow_tf32)


class _TF32State(NamedTuple):
    matmul: bool | None  # torch.backends.cuda.matmul.allow_tf32 (None: unreadable)
    cudnn: bool | None  # torch.backends.cudnn.allow_tf32 (None: unreadable)
    # torch.get_float32_matmul_precision() when it reads (None: unreadable, legacy and new APIs mixed):
    # the region switches with torch.set_float32_matmul_precision, which writes CUDA's and MKLDNN's
    # matmul strings alike (the matmul flag alone left MKLDNN's as it was: after "high" or "medium" the
    # two disagreed and the getter raised inside the region), and restores it with the MKLDNN string.
    matmul_precision: str | None
    mkldnn_matmul: str | None
    strings: tuple[str, ...]  # fp32_precision of each of _OP_NODES


def _save_tf32() -> _TF32State:
    compiling = torch.compiler.is_compiling()  # (first: dynamo traces the rest differently after the getter)
    matmul = _read(_legacy_matmul)
    precision = mkldnn = None
    if matmul is not None and _OP_NODES:
        current = _read(torch.get_float32_matmul_precision)
        # (traced by dynamo: the matmul flag alone where it gives the setting back, as before; the legacy
        # setter's MKLDNN string is another write dynamo skips, and inductor reads the flags once, at compile time)
        if current is not None and (current != ("high" if matmul else "highest") or not compiling):
            precision, mkldnn = current, torch.backends.mkldnn.matmul.fp32_precision  # type: ignore[attr-defined]  # runtime-only (torch>=2.9)
    return _TF32State(
        matmul=matmul, cudnn=_read(_legacy_cudnn), matmul_precision=precision, mkldnn_matmul=mkldnn,
        strings=tuple(node.fp32_precision for node in _OP_NODES),
    )


def _set_tf32(enabled: bool, saved: _TF32State) -> None:
    if saved.matmul_precision is not None:
        # the legacy setter writes CUDA's and MKLDNN's strings alike, so the getter still reads inside
        # the region, and an FP32 region is FP32 on a CPU too (after "medium" MKLDNN computed in BF16)
        torch.set_float32_matmul_precision("high" if enabled else "highest")
    elif saved.matmul is not None:
        torch.backends.cuda.matmul.allow_tf32 = enabled
    if saved.cudnn is not None:
        torch.backends.cudnn.allow_tf32 = enabled
    # Then the op strings, explicitly: the legacy cuDNN setter writes "none" for off, which
    # inherits "tf32" from torch.backends.fp32_precision when that is set, i.e. TF32 stays on.
    precision = "tf32" if enabled else "ieee"
    for node in _OP_NODES:
        node.fp32_precision = precision


def _restore_tf32(saved: _TF32State) -> None:
    if saved.matmul is not None:
        if saved.matmul_precision is not None:
            torch.set_float32_matmul_precision(saved.matmul_precision)
            torch.backends.mkldnn.matmul.fp32_precision = saved.mkldnn_matmul  # type: ignore[attr-defined]  # runtime-only (torch>=2.9)
        else:
            torch.backends.cuda.matmul.allow_tf32 = saved.matmul
    if saved.cudnn is not None:
        torch.backends.cudnn.allow_tf32 = saved.cudnn
    for node, value in zip(_OP_NODES, saved.strings):
        node.fp32_precision = value


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """Allow (or forbid) TF32 for FP32 matmuls and cuDNN convolutions/RNNs inside a region.

    On exit every TF32 setting is put back exactly as it was, also when the body raises:
    the legacy flags (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``,
    ``torch.get_float32_matmul_precision()``) and, on torch >= 2.9, the ``fp32_precision``
    strings. Inside, the switch goes through the legacy flags when they can be read, so code
    that reads them (``torch.compile``) sees the region's value; when the user set TF32 with
    the new ``fp32_precision`` API (torch then refuses legacy reads), it goes through that API
    instead and never reads or writes the legacy flags. Regions nest. TF32 only exists on
    NVIDIA Ampere and later; elsewhere (CPU) the switch has no effect on results.

    Args:
        enabled: ``True`` lets FP32 matmuls/convolutions use TF32 tensor cores; ``False``
            keeps them in full FP32 (IEEE).

    Yields:
        Nothing; use it as ``with tf32(True): ...`` (or as a decorator).

    Raises:
        TypeError: ``enabled`` is not a bool.

    Example:
        >>> before = torch.backends.cuda.matmul.allow_tf32
        >>> with tf32(True):
        ...     torch.backends.cuda.matmul.allow_tf32
        True
        >>> torch.backends.cuda.matmul.allow_tf32 == before
        True
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"tf32(enabled) needs True or False, got {type(enabled).__name__} {enabled!r}")
    saved = _save_tf32()
    try:
        _set_tf32(enabled, saved)
        yield
    finally:
        _restore_tf32(saved)


def tf32_enabled() -> bool:
    """Whether FP32 CUDA matmuls may use TF32 now (the setting, whatever the device).

    Reads ``torch.backends.cuda.matmul.allow_tf32``, or the new ``fp32_precision`` API when
    torch refuses the legacy read because the two APIs were mixed.

    Returns:
        ``True`` when TF32 is allowed for CUDA matmuls.
    """
    legacy = _read(lambda: torch.backends.cuda.matmul.allow_tf32)
    if legacy is not None:
        return bool(legacy)
    return bool(torch.backends.cuda.matmul.fp32_precision == "tf32")


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
        for b in hint.buffers():
            return b.device.type
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


class autocast:
    """Run a region under a policy's compute dtype; a context manager and a decorator.

    Inside, ``torch.autocast`` runs with ``policy.compute_dtype`` (disabled for FP32
    compute) and TF32 is switched as the policy says. Everything is restored on exit, also
    when the body raises. Regions nest.

    Args:
        policy: A :class:`Policy`, preset name or grammar string.
        device_type: ``"cuda"``, ``"cpu"``, a device, a tensor or a module; ``None`` takes it
            from the first tensor or module argument when decorating, else CUDA if available,
            else CPU.
        enabled: ``False`` turns autocast off inside the region, as ``torch.autocast(enabled=False)``
            does (an enclosing autocast region included): ops run in their inputs' dtypes. Useful
            for toggling from config, and for an FP32 region inside a framework's autocast.
        cache_enabled: As ``torch.autocast``'s: the half copies of FP32 weights are cached for the
            region. ``False`` when an optimizer steps inside the region and a later forward in it
            must see the new weights (a whole ``training_step`` with manual optimization); ``None``
            (default) keeps the enclosing region's setting (torch's default outside any).

    Example:
        >>> with autocast("bf16-mixed", "cpu"):
        ...     y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
        >>> y.dtype
        torch.bfloat16
    """

    def __init__(self, policy: Policy | str, device_type: object = None, *, enabled: bool = True,
                 cache_enabled: bool | None = None) -> None:
        if isinstance(enabled, (str, bytes)):  # (a config string "false" is truthy: it would turn autocast on)
            raise TypeError(f"autocast(enabled=...) takes a bool, got the string {enabled!r}; parse it first.")
        self.policy = Policy.parse(policy)
        self._hint = device_type
        self.enabled = bool(enabled)
        self.cache_enabled = None if cache_enabled is None else bool(cache_enabled)
        self._stack: list[tuple[Any, Any]] = []

    @property
    def device_type(self) -> str:
        """The device type this region autocasts on."""
        return resolve_device_type(self._hint)

    def __enter__(self) -> autocast:
        self._enter(self.device_type)
        return self

    def _enter(self, device_type: str) -> None:
        ctx = torch.autocast(
            device_type=device_type,
            dtype=self.policy.compute_dtype if self.policy.uses_autocast else None,
            enabled=self.enabled and self.policy.uses_autocast,
            cache_enabled=self.cache_enabled,
        )
        switch = tf32(self.policy.tf32) if self.enabled else contextlib.nullcontext()
        switch.__enter__()
        try:
            ctx.__enter__()
        except BaseException:
            switch.__exit__(None, None, None)
            raise
        self._stack.append((ctx, switch))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        ctx, switch = self._stack.pop()
        try:
            ctx.__exit__(exc_type, exc, tb)
        finally:
            switch.__exit__(None, None, None)

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

        return cast(F, wrapper)

    @staticmethod
    def fp32(device_type: object = None) -> _FP32Region:
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

    def __enter__(self) -> _FP32Region:
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

        return cast(F, wrapper)
