"""Rounding FP32 results into BF16/FP16 storage: stochastic rounding and compensated (Kahan) pairs.

Stochastic rounding (SR) rounds ``x`` to one of its two neighbouring representable values
``lo <= x <= hi`` and picks ``hi`` with probability ``(x - lo) / (hi - lo)``, so that
``E[round(x)] == x``: an update far below half an ulp is applied on average instead of being
lost (Gupta et al. 2015; Zamirai et al., "Revisiting BFloat16 Training"; llm.c).

* BF16 keeps the upper 16 bits of an FP32 number, so SR is integer arithmetic on the FP32 bit
  pattern: add 16 uniformly random bits below the cut and truncate. The carry reaches the kept
  bits with probability exactly ``low16 / 2**16``, the distance to ``lo`` in units of the BF16
  ulp, for either sign (the bit pattern is sign-magnitude).
* FP16 is not a truncation of FP32: both neighbours are found with ``torch.nextafter`` and the
  upper one is taken when ``u < (x - lo) / (hi - lo)`` with ``u`` uniform in [0, 1).

A compensated pair ``(hi, lo)`` in a half dtype stores ``hi + lo`` with about twice the
mantissa bits: ``hi = round(w)``, ``lo = round(w - hi)``; :func:`kahan_add_` adds an update to
such a pair with the arithmetic in FP32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._dtypes import parse_dtype

__all__ = ["compensated_split", "kahan_add_", "stochastic_round"]

_HALF = (torch.bfloat16, torch.float16)


def stochastic_round(x: Tensor, dtype: torch.dtype | str, *, generator: torch.Generator | None = None) -> Tensor:
    """Round ``x`` to ``dtype`` stochastically: unbiased, onto one of the two neighbouring values.

    Args:
        x: The values; converted to FP32 first if they are another floating dtype (FP64 input is
            thus rounded to nearest FP32 before the stochastic rounding).
        dtype: ``torch.bfloat16`` or ``torch.float16`` (or a name such as ``"bf16"``);
            ``torch.float32`` returns ``x`` in FP32 unchanged.
        generator: Source of the random bits; it must live on ``x``'s device. ``None`` uses
            torch's default generator for that device.

    Returns:
        A new tensor of ``dtype`` and ``x``'s shape. Values already representable are returned
        exactly; ``inf``, ``-inf`` and NaN are kept. An FP32 value above the largest finite
        BF16/FP16 value may round to ``inf``, with the probability given by its distance.

    Raises:
        ValueError: ``dtype`` is not bfloat16, float16 or float32.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.full((100_000,), 1.0 + 2**-10)  # 1/8 of a BF16 ulp above 1.0
        >>> r = stochastic_round(x, torch.bfloat16, generator=g).float()
        >>> sorted(set(r.tolist())) == [1.0, 1.0 + 2**-7]
        True
        >>> abs(r.mean().item() - x[0].item()) < 1e-4
        True
    """
    dtype = parse_dtype(dtype)
    if x.dtype != torch.float32:
        x = x.float()
    if dtype == torch.float32:
        return x
    if dtype == torch.bfloat16:
        return _sr_bf16(x, generator)
    if dtype == torch.float16:
        return _sr_nextafter(x, dtype, generator)
    raise ValueError(f"stochastic_round to {dtype}: only torch.bfloat16, torch.float16 and torch.float32 are supported.")


def _sr_bf16(x: Tensor, generator: torch.Generator | None) -> Tensor:
    x = x.contiguous()
    bits = x.view(torch.int32)
    noise = torch.empty_like(bits).random_(0, 1 << 16, generator=generator)
    # int32 addition wraps only for NaN bit patterns whose mantissa is nearly all ones; the
    # where() below puts every NaN back so a NaN never turns into a number.
    rounded = (bits + noise).bitwise_and_(-65536).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded).to(torch.bfloat16)


def _sr_nextafter(x: Tensor, dtype: torch.dtype, generator: torch.Generator | None) -> Tensor:
    near = x.to(dtype)
    near32 = near.float()
    diff = x - near32  # exact: |diff| <= half an ulp of the target dtype
    toward = torch.where(diff >= 0, float("inf"), float("-inf")).to(dtype)
    other = torch.nextafter(near, toward)
    # In [0, 1/2]; NaN where near is inf/NaN, and then `u < prob` is False and near is kept.
    prob = diff / (other.float() - near32)
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    return torch.where(u < prob, other, near)


def compensated_split(w: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Split ``w`` into ``(hi, lo)`` of ``dtype`` with ``hi = round(w)`` and ``lo = round(w - hi)``.

    ``hi + lo`` represents ``w`` with about twice the mantissa bits of ``dtype`` (17 bits for
    BF16). ``w - hi`` is exact in FP32, only its rounding to ``dtype`` loses bits.

    Args:
        w: FP32 (or FP64) values.
        dtype: The storage dtype of both halves.

    Returns:
        ``(hi, lo)``, new tensors of ``dtype``.
    """
    hi = w.to(dtype)
    lo = (w - hi.to(w.dtype)).to(dtype)
    return hi, lo


@torch.no_grad()
def kahan_add_(
    param: Tensor, compensation: Tensor, update: Tensor, *, generator: torch.Generator | None = None
) -> None:
    """Add ``update`` to the compensated pair ``(param, compensation)`` in place, in FP32.

    Computes ``w = param + compensation + update`` in FP32, then ``param = round(w)`` (to
    nearest) and ``compensation = stochastic_round(w - param)``, the rule mixprec's optimizers
    use for ``compensation="kahan"``. ``w - param`` is exact in FP32; storing it with stochastic
    rounding keeps even updates below half an ulp of the compensation buffer (about 2**-18 of the
    weight) unbiased. With BF16 ``param`` an update far below half a BF16 ulp still moves
    ``param + compensation``, and ``param`` once enough accumulates; a plain BF16
    ``param += update`` loses it entirely.

    Args:
        param: A BF16/FP16 tensor, updated in place (an FP32 one is simply added to).
        compensation: Same shape and dtype as ``param``, updated in place (start from zeros).
        update: Broadcastable to ``param``; any floating dtype.
        generator: Random bits for the compensation's rounding (on ``param``'s device).

    Example:
        >>> p = torch.ones(4, dtype=torch.bfloat16); c = torch.zeros_like(p)
        >>> for _ in range(100):
        ...     kahan_add_(p, c, torch.full((4,), 1e-4))
        >>> p.float() + c.float()  # doctest: +SKIP
        tensor([1.0100, 1.0100, 1.0100, 1.0100])
    """
    acc = torch.promote_types(param.dtype, torch.float32)
    w = param.to(acc) + compensation.to(acc) + update.to(acc)
    hi = w.to(param.dtype)
    param.copy_(hi)
    if param.dtype in _HALF:
        compensation.copy_(stochastic_round(w - hi.to(acc), param.dtype, generator=generator))
    else:
        compensation.zero_()
