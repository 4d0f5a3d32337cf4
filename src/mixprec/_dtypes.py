"""Floating-point dtypes mixprec reasons about: names, aliases, limits and device support.

The short names (``f32``, ``bf16``, ``f16``, ``f8e4m3``, ``f8e5m2``) are the ones the
policy grammar prints; the aliases are the spellings users already type.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

import torch

from ._errors import unknown_choice

__all__ = [
    "ALIASES",
    "HALF",
    "DTypeLimits",
    "DTypeName",
    "check_device_support",
    "device_supports",
    "dtype_name",
    "limits",
    "parse_dtype",
]

#: The 16-bit floating-point dtypes: what "half precision" means throughout mixprec.
HALF: tuple[torch.dtype, torch.dtype] = (torch.bfloat16, torch.float16)

DTypeName = Literal["f64", "f32", "bf16", "f16", "f8e4m3", "f8e5m2"]

_CANONICAL: dict[torch.dtype, str] = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float8_e4m3fn: "f8e4m3",
    torch.float8_e5m2: "f8e5m2",
}

#: Every accepted spelling, lower case, mapped to its dtype.
ALIASES: dict[str, torch.dtype] = {
    "f64": torch.float64, "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
    "f32": torch.float32, "float32": torch.float32, "fp32": torch.float32, "full": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "f16": torch.float16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "f8e4m3": torch.float8_e4m3fn, "e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn, "fp8e4m3": torch.float8_e4m3fn,
    "f8e5m2": torch.float8_e5m2, "e5m2": torch.float8_e5m2, "float8_e5m2": torch.float8_e5m2, "fp8e5m2": torch.float8_e5m2,
}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """Turn a dtype name, alias or ``torch.dtype`` into a floating ``torch.dtype``.

    Args:
        value: ``"bf16"``, ``"half"``, ``"torch.float32"``, ``torch.float16``, ...

    Returns:
        The dtype.

    Raises:
        TypeError: ``value`` is neither a string nor a ``torch.dtype``.
        ValueError: the name is unknown or the dtype is not a floating type mixprec supports;
            the message lists every accepted name and the closest one.

    Example:
        >>> parse_dtype("half")
        torch.float16
    """
    if isinstance(value, torch.dtype):
        if value not in _CANONICAL:
            raise unknown_choice("floating dtype", str(value), sorted(set(_CANONICAL.values())),
                                 "mixprec handles float64/32, bfloat16, float16 and the two float8 formats.")
        return value
    if not isinstance(value, str):
        raise TypeError(f"expected a dtype name or torch.dtype, got {type(value).__name__} {value!r}")
    key = value.strip().lower().removeprefix("torch.")
    if key not in ALIASES:
        raise unknown_choice("dtype", value, list(ALIASES))
    return ALIASES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """Return the short name of ``dtype`` used in policy strings (``torch.bfloat16`` -> ``"bf16"``).

    Raises:
        ValueError: ``dtype`` is not one mixprec supports.
    """
    return _CANONICAL[parse_dtype(dtype)]


@dataclasses.dataclass(frozen=True)
class DTypeLimits:
    """The numeric limits of a floating format that mixed-precision reasoning uses.

    Attributes:
        dtype: The format.
        max: Largest finite value (65504 for f16).
        smallest_normal: Smallest positive normal value (2**-14 for f16).
        smallest_subnormal: Smallest positive subnormal value (2**-24 ~ 6e-8 for f16);
            anything below half of it rounds to zero.
        eps: Machine epsilon, the gap between 1 and the next value (2**-10 for f16,
            2**-7 for bf16).
        mantissa_bits: Explicit mantissa (fraction) bits.
        bits: Storage width.
    """

    dtype: torch.dtype
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float
    mantissa_bits: int
    bits: int


def limits(dtype: str | torch.dtype) -> DTypeLimits:
    """Return the :class:`DTypeLimits` of a floating dtype.

    Example:
        >>> limits("f16").max
        65504.0
    """
    dt = parse_dtype(dtype)
    fi = torch.finfo(dt)
    # finfo.eps is 2**-mantissa_bits for every IEEE-like format, including float8.
    mantissa = round(-torch.log2(torch.tensor(fi.eps, dtype=torch.float64)).item())
    return DTypeLimits(
        dtype=dt,
        max=float(fi.max),
        smallest_normal=float(fi.smallest_normal),
        smallest_subnormal=float(fi.smallest_normal) * float(fi.eps),
        eps=float(fi.eps),
        mantissa_bits=mantissa,
        bits=fi.bits,
    )


_warned: set[tuple[str, torch.dtype]] = set()


def device_supports(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Say whether ``device`` can compute in ``dtype`` at all (not whether it is fast).

    CUDA bf16 needs compute capability 8.0 (Ampere) or newer; float8 matmul needs 8.9.
    Every dtype runs on the CPU (fp16 and bf16 slowly, see :func:`check_device_support`).
    """
    dev = torch.device(device)
    dt = parse_dtype(dtype)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return False
        if dt == torch.bfloat16:
            return bool(torch.cuda.is_bf16_supported())
        if dt in (torch.float8_e4m3fn, torch.float8_e5m2):
            return torch.cuda.get_device_capability(dev) >= (8, 9)
    return True


def check_device_support(dtype: str | torch.dtype, device: torch.device | str) -> None:
    """Raise if ``device`` cannot compute in ``dtype``; warn once if it can but slowly.

    Args:
        dtype: The compute dtype a policy asks for.
        device: Where the model lives.

    Raises:
        ValueError: the device cannot run the dtype (e.g. bf16 on a pre-Ampere GPU); the
            message suggests what to use instead. mixprec never switches precision for you.

    Warns:
        UserWarning: once per (device type, dtype) for fp16 on CPU, which has no fast
            kernel on most CPUs (20-170x slower than fp32 matmul on our CI machines), and
            for bf16 on a CPU without native bf16 instructions.
    """
    dt = parse_dtype(dtype)
    dev = torch.device(device)
    if not device_supports(dt, dev):
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" and torch.cuda.is_available() else str(dev)
        if dt == torch.bfloat16:
            hint = "use an fp16 preset ('fp16-mixed' or 'fp16-master') on this GPU, or 'fp32'."
        else:
            hint = "use 'bf16-mixed' or 'fp16-mixed' instead."
        raise ValueError(f"device {name!r} cannot compute in {dtype_name(dt)}; {hint}")
    if dev.type == "cpu" and (dev.type, dt) not in _warned and dt == torch.float16:
        _warned.add((dev.type, dt))
        warnings.warn(
            "fp16 on CPU works but most CPUs have no fast fp16 kernel (matmul is 20-170x slower "
            "than fp32 here); use it to study numerics, or use bf16 / a GPU for speed.",
            UserWarning,
            stacklevel=3,
        )
