"""An FP32 value as a BF16 value plus a 16-bit remainder, split and joined bit for bit.

The groundwork of issue 29 (FP32 masters at 2 extra bytes per parameter): a BF16 model's weight
already holds the top 16 bits of its FP32 master, so 16 more bits (an ``int16`` remainder) recover
the master exactly. Not wired into any policy yet; ``split``/``join`` are the exact primitives the
master step will call (reconstruct, update in FP32, split again).

The rounding, and why it is not round-to-nearest-even: the pair (BF16 weight, remainder) must
determine the FP32 value. With ties to even, an exact tie (low 16 bits ``0x8000``) rounded down has
the remainder ``+0x8000``, outside ``int16``, and storing the low bits unsigned instead leaves the tie
ambiguous (both roundings of a tie give an even BF16 pattern). So ``split`` rounds ties away from
zero (half up on the magnitude's bit pattern): the remainder, counted in FP32 ulps of the magnitude
(``|x| = |hi| + lo * ulp``), is then always in ``[-2^15, 2^15)``.
It differs from ``tensor.to(torch.bfloat16)`` only at exact ties, 1 low-half pattern in 65,536, and
there by one BF16 ulp, away from zero. Values that round past BF16's largest finite number become
``inf`` (as ``.to(torch.bfloat16)`` does) and still join back exactly. An ``inf`` splits as itself
with a zero remainder; a NaN as BF16's quiet NaN with a zero remainder (it joins back as a NaN;
sign and payload not kept).

No host syncs: every function is elementwise tensor arithmetic.
"""

from __future__ import annotations

import torch

__all__ = ["join", "join_edited", "join_into_", "placeholder", "split", "split_into_"]

_HALF = 0x8000
_BF16_NAN = 0x7FC0  # the quiet NaN torch's f32 -> bf16 cast gives


def _check_f32(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{what} must be float32 (the FP32 master), got {x.dtype}; pass the FP32 value")


def _check_pair(hi: torch.Tensor, lo: torch.Tensor, full: tuple[str, torch.Tensor] | None = None) -> None:
    """Check a (BF16, int16) pair and, when given, the FP32 tensor ``full = (name, tensor)`` of its shape."""
    if full is not None:
        _check_f32(full[1], full[0])
    if not isinstance(hi, torch.Tensor) or not isinstance(lo, torch.Tensor):
        raise TypeError(f"hi and lo must be tensors, got {type(hi).__name__} and {type(lo).__name__}")
    if hi.dtype != torch.bfloat16:
        raise TypeError(f"hi must be bfloat16 (the model's weight), got {hi.dtype}")
    if lo.dtype != torch.int16:
        raise TypeError(f"lo must be int16 (the remainder split() returned), got {lo.dtype}")
    if hi.shape != lo.shape:
        raise ValueError(f"hi and lo must have the same shape, got {tuple(hi.shape)} and {tuple(lo.shape)}")
    if full is not None and full[1].shape != hi.shape:
        raise ValueError(f"{full[0]} must have hi's shape {tuple(hi.shape)}, got {tuple(full[1].shape)}")


def placeholder(like: torch.Tensor) -> torch.Tensor:
    """A remainder-stored FP32 master's data between steps: one FP32 NaN broadcast to ``like``'s shape (4 bytes).

    It keeps the shape (gradients and optimizer state attach to the master) and reads as NaN, and
    an in-place write raises (its elements share one memory location): a master read or written
    outside the step is never a silently stale value.
    """
    return torch.full((), float("nan"), dtype=torch.float32, device=like.device).expand(like.shape)


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split FP32 values into a BF16 value and an ``int16`` remainder that together are exact.

    Algorithm, on the FP32 bit pattern ``b`` (as ``int32``): the BF16 pattern is
    ``top = (b + 0x8000) >> 16``, i.e. ``(b >> 16) + (low >= 0x8000)`` with ``low = b & 0xFFFF``
    (rounding the magnitude half up, so ties go away from zero); the remainder ``b - (top << 16)``,
    in ``[-2^15, 2^15)``, is ``b``'s low 16 bits read as ``int16``. ``join`` computes
    ``(hi << 16) + lo``. A NaN splits as BF16's quiet NaN with remainder 0.

    Args:
        x: float32 values, any shape and device.

    Returns:
        ``(hi, lo)``: ``hi`` bfloat16 (equal to ``x.to(torch.bfloat16)`` except at exact ties, which
        round away from zero), ``lo`` int16, both of ``x``'s shape.

    Raises:
        TypeError: ``x`` is not a float32 tensor.
    """
    _check_f32(x, "x")
    bits = x.contiguous().view(torch.int32)
    # floor((b + 2^15) / 2^16) is (b >> 16) + (low >= 2^15): the top half rounded half up on the
    # magnitude (the arithmetic shift keeps the sign bit), and b - (top << 16) is the signed remainder.
    top = (bits + _HALF) >> 16
    # Only NaNs need care (a payload in the low bits would round into inf or across the sign); inf
    # splits as (inf, 0) and values that round past BF16's largest finite number as (inf, negative).
    nan = torch.isnan(x)
    hi = torch.where(nan, _BF16_NAN, top).to(torch.int16).view(torch.bfloat16)
    # The remainder b - (top << 16) is in int16's range and equal to b modulo 2^16, so it *is* b's
    # low 16 bits read as int16: int32 -> int16 keeps exactly those (one pass, no subtraction).
    return hi, bits.to(torch.int16).masked_fill_(nan, 0)


def join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Rebuild the FP32 values that ``split`` took apart, bit for bit.

    Args:
        hi: the bfloat16 half (the model's weight).
        lo: the int16 remainder, of ``hi``'s shape.

    Returns:
        A new float32 tensor: ``(hi's pattern << 16) + lo`` reinterpreted as FP32.

    Raises:
        TypeError: wrong dtypes.
        ValueError: shapes differ.
    """
    _check_pair(hi, lo)
    # BF16 -> FP32 is exact: hi's 16 bits followed by 16 zero bits, i.e. hi << 16, in one pass.
    return hi.to(torch.float32).view(torch.int32).add_(lo).view(torch.float32)


def join_edited(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``join``, except where ``hi`` is ±0 or ±inf: there the value is ``hi`` itself.

    ``split`` never pairs a zero with a negative remainder nor an infinity with a positive one, but
    an edit of the BF16 half after the split can (a pruning mask, a clamp to inf), and joined as
    bits those pairs are NaN. What this changes for values ``split`` produced: magnitudes below
    2^-133 (their BF16 half is 0) come back as ±0, magnitudes beyond BF16's largest finite number
    (their BF16 half is inf) as ±inf.

    Raises:
        TypeError: wrong dtypes.
        ValueError: shapes differ.
    """
    _check_pair(hi, lo)
    hf = hi.to(torch.float32)
    joined = hf.view(torch.int32).add(lo).view(torch.float32)
    return torch.where((hf != 0) & (hf.abs() != float("inf")), joined, hf)


def join_into_(out: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``join`` into an existing float32 buffer (the step's scratch master); returns ``out``.

    Raises:
        TypeError: wrong dtypes.
        ValueError: shapes differ.
    """
    _check_pair(hi, lo, ("out", out))
    out.copy_(join(hi, lo))
    return out


def split_into_(x: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """``split`` ``x`` into the existing ``hi`` (the BF16 weight, in place) and ``lo`` buffers.

    Raises:
        TypeError: wrong dtypes.
        ValueError: shapes differ.
    """
    _check_pair(hi, lo, ("x", x))
    h, l_ = split(x)
    hi.copy_(h)
    lo.copy_(l_)
