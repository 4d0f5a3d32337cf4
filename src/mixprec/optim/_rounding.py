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

Random bits: :func:`counter_bits` makes 32 random bits per element as a pure function of
``(seed, step, stream, element index)``: a counter-based hash (three rounds of xorshift-multiply
on 32-bit values, the key injected twice), computed with int64 tensor ops that never overflow
(every product is below 2**59), so eager, ``torch.compile`` (Inductor C++/Triton) and every
device give the same bits. ``stochastic_round(..., bits=...)`` rounds with them: BF16 takes the
upper 16 bits as the noise, FP16 the upper 24 as ``u``. mixprec's optimizers use it so that DDP
replicas, resumed runs and shards of a tensor (given their global element offset) round
identically without sharing generator state.

A compensated pair ``(hi, lo)`` in a half dtype stores ``hi + lo`` with about twice the
mantissa bits: ``hi = round(w)``, ``lo = round(w - hi)``; :func:`kahan_add_` adds an update to
such a pair with the arithmetic in FP32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._dtypes import HALF, parse_dtype

__all__ = [
    "comp_of_weight", "compensated_split", "counter_bits", "counter_bits32", "kahan_add_", "stochastic_round", "with_edits",
]

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # odd, below 2**27: a 32-bit value times it stays below 2**59 in int64


def _round32(x: Any) -> Any:
    """One xorshift-multiply round on values in [0, 2**32) (Python ints or int64 tensors alike)."""
    return (((x >> 16) ^ x) * _MUL) & _M32


def _fin32(x: Any) -> Any:
    return (x >> 16) ^ x


def stream_key(seed: int, stream: int) -> tuple[int, int]:
    """The two 32-bit keys of a random stream, from the run seed and the stream id (host ints)."""
    a = _fin32(_round32(_round32((seed & _M32) ^ 0x243F6A88)))
    a = _fin32(_round32(_round32(a ^ ((seed >> 32) & _M32))))
    a = _fin32(_round32(_round32(a ^ (stream & _M32))))
    a = _fin32(_round32(_round32(a ^ ((stream >> 32) & _M32))))
    b = _fin32(_round32(_round32(a ^ 0x85A308D3)))
    return a, b


def step_keys(key: tuple[int, int] | tuple[Tensor, Tensor], step: Tensor) -> tuple[Tensor, Tensor]:
    """Mix a step count (a tensor of whole numbers, any dtype, e.g. the FP32 step counter) into a stream's keys.

    ``key`` holds Python ints or int64 tensors broadcastable to ``step``; the result is int64
    tensors of ``step``'s shape, on its device (no host sync).
    """
    t = step.to(torch.int64) & _M32
    ka, kb = key
    return _fin32(_round32(_round32(t ^ ka))), _fin32(_round32(_round32(t ^ kb)))


def counter_bits(ka: Tensor, kb: Tensor, index: Tensor) -> Tensor:
    """32 random bits per element (int64 in [0, 2**32)), a pure function of the keys and ``index``.

    Args:
        ka, kb: int64 keys from :func:`step_keys`, broadcastable to ``index``.
        index: int64 global element positions (non-negative).

    Returns:
        int64 tensor of ``index``'s broadcast shape.
    """
    x = _round32((index & _M32) ^ ka)
    x = _round32(x ^ kb ^ (index >> 32))
    return _fin32(_round32(x))


_CONSTS: dict[tuple[int | float, torch.dtype, torch.device], Tensor] = {}


def _consts(like: Tensor, *values: int | float) -> tuple[Any, ...]:
    """Cached 0-d tensors of ``values`` in ``like``'s dtype and device, never written (the values themselves under a trace).

    Eager operands for ``like``'s own dtype (int32 or FP32 here: the op's dtype and rounding are
    those of a Python scalar): a Python scalar becomes a fresh wrapped tensor on every call, which
    on a CPU costs ~1.5 us of a ~5 us bit operation on a tile. Inside a ``torch.compile`` trace
    (an outer compile of an eager step) the scalars are what the graph wants. One trace check for
    all of them (it is two Python calls; the eager step asks for ~10 constants per tile).
    """
    return values if torch.compiler.is_compiling() else _cached(like, *values)


def _cached(like: Tensor, *values: int | float) -> tuple[Tensor, ...]:
    """:func:`_consts` without the trace check, for code that a trace never reaches (:func:`_sr_counter_eager`)."""
    dtype, device = like.dtype, like.device
    out = []
    for value in values:
        key = (value, dtype, device)
        c = _CONSTS.get(key)
        if c is None:
            c = _CONSTS[key] = torch.tensor(value, dtype=dtype, device=device)
        out.append(c)
    return tuple(out)


def _round32_(x: Tensor, tmp: Tensor, consts: tuple[Any, ...]) -> Tensor:
    """:func:`_round32` in place on int32 lanes holding 32-bit values (two's complement); ``tmp``: scratch of ``x``'s shape.

    ``>>`` on int32 is arithmetic, so the mask restores the logical shift; int32 multiplication
    wraps modulo 2**32, which is the reference's ``& 0xFFFFFFFF``. ``consts``: ``_consts(x, 16,
    0xFFFF, _MUL)``.
    """
    s16, low16, mul = consts
    return x.bitwise_xor_(torch.bitwise_right_shift(x, s16, out=tmp).bitwise_and_(low16)).mul_(mul)


def to_int32_lanes(x: Tensor) -> Tensor:
    """int64 values in [0, 2**32) as int32 with the same 32 bits (two's complement), exactly."""
    return ((x ^ (1 << 31)) - (1 << 31)).to(torch.int32)


def counter_bits32(ka: Tensor, kb: Tensor, index: Tensor) -> Tensor:
    """:func:`counter_bits` in int32 lanes: the same 32 bits, as int32 (two's complement).

    Half the memory traffic of the int64 form, for the eager step. Valid for ``index`` in
    [0, 2**31) (then ``index >> 32`` is 0 and ``index & 0xFFFFFFFF`` is ``index``).

    Args:
        ka, kb: int32 keys (:func:`to_int32_lanes` of :func:`step_keys`'s), broadcastable to ``index``.
        index: int32 global element positions in [0, 2**31).

    Returns:
        A new int32 tensor of ``index``'s shape; ``counter_bits(...) == result & 0xFFFFFFFF``
        (read as unsigned). :func:`stochastic_round` takes either form as ``bits``.
    """
    x = index ^ ka
    tmp = torch.empty_like(x)  # one scratch buffer for the four shifts
    c = _consts(x, 16, 0xFFFF, _MUL)
    x = _round32_(x, tmp, c)
    x = _round32_(x.bitwise_xor_(kb), tmp, c)
    x = _round32_(x, tmp, c)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, c[0], out=tmp).bitwise_and_(c[1]))


def counter_bits_for(seed: int, step: int | Tensor, stream: int, numel: int, *, offset: int = 0,
                     device: torch.device | str | None = None) -> Tensor:
    """The random bits of elements ``offset .. offset + numel - 1`` of a stream at a step (int64, 1-D).

    A shard that holds elements ``offset ..`` of a tensor gets exactly the bits of those
    positions of the whole tensor.

    Example:
        >>> whole = counter_bits_for(0, 3, 7, 10)
        >>> torch.equal(whole[4:], counter_bits_for(0, 3, 7, 6, offset=4))
        True
    """
    step_t = torch.as_tensor(step, device=device)
    ka, kb = step_keys(stream_key(seed, stream), step_t)
    idx = torch.arange(offset, offset + numel, dtype=torch.int64, device=step_t.device)
    return counter_bits(ka, kb, idx)


def stochastic_round(
    x: Tensor, dtype: torch.dtype | str, *, generator: torch.Generator | None = None, bits: Tensor | None = None
) -> Tensor:
    """Round ``x`` to ``dtype`` stochastically: unbiased, onto one of the two neighbouring values.

    Args:
        x: The values; converted to FP32 first if they are another floating dtype (FP64 input is
            thus rounded to nearest FP32 before the stochastic rounding).
        dtype: ``torch.bfloat16`` or ``torch.float16`` (or a name such as ``"bf16"``);
            ``torch.float32`` returns ``x`` in FP32 unchanged.
        generator: Source of the random bits; it must live on ``x``'s device. ``None`` uses
            torch's default generator for that device.
        bits: Instead of a generator: 32 random bits per element (int64 in [0, 2**32) of
            ``x``'s shape, e.g. from :func:`counter_bits`, or their int32 form from
            :func:`counter_bits32`); the result is then a pure function of ``x`` and ``bits``,
            the same eager, compiled and on every device (the rule per format:
            :func:`_sr_counter`; BF16 adds the upper 16 bits below the cut, as ``generator`` does).

    Returns:
        A new tensor of ``dtype`` and ``x``'s shape. Values already representable are returned
        exactly; ``inf``, ``-inf`` and NaN are kept. With ``generator``, an FP32 value above the
        largest finite BF16/FP16 value may round to ``inf``, with the probability given by its
        distance; with ``bits`` it rounds to nearest there.

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
    if x.is_complex():
        raise TypeError(f"stochastic_round needs real values, got {x.dtype} (the imaginary part would be dropped); "
                        "round torch.view_as_real(x) instead.")
    if x.dtype != torch.float32:
        x = x.float()
    if dtype == torch.float32:
        return x
    if bits is not None and generator is not None:
        raise ValueError("stochastic_round: pass either generator= or bits=, not both.")
    if bits is not None:
        return _sr_counter(x, dtype, bits)
    if dtype == torch.bfloat16:
        return _sr_bf16(x, generator)
    if dtype == torch.float16:
        return _sr_nextafter(x, dtype, generator)
    raise ValueError(f"stochastic_round to {dtype}: only torch.bfloat16, torch.float16 and torch.float32 are supported.")


def _sr_bf16(x: Tensor, generator: torch.Generator | None) -> Tensor:
    x = x.contiguous()
    pattern = x.view(torch.int32)
    noise = torch.empty_like(pattern).random_(0, 1 << 16, generator=generator)
    # int32 addition wraps only for NaN bit patterns whose mantissa is nearly all ones; the
    # where() below puts every NaN back so a NaN never turns into a number.
    rounded = (pattern + noise).bitwise_and_(-65536).view(torch.float32)
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


#: (mantissa bits, smallest normal, subnormal spacing) of the half formats.
_FORMATS = {torch.bfloat16: (7, 2.0**-126, 2.0**-133), torch.float16: (10, 2.0**-14, 2.0**-24)}


def _sr_counter(x: Tensor, dtype: torch.dtype, bits: Tensor) -> Tensor:
    """Stochastic rounding with given random bits: the rule per format, in floating-point arithmetic inside a trace.

    The rule (what every path computes, bit for bit):

    * BF16 (``x`` finite and below the largest finite BF16 value's bucket): the FP32 bit pattern
      plus ``n``, the upper 16 of the 32 random bits, truncated to its upper 16 bits; the
      magnitude moves away from zero with probability exactly ``low16 / 2**16`` (the distance to
      the neighbour towards zero, in units of the BF16 spacing), as with a generator
      (:func:`_sr_bf16`). inf, NaN and values from the largest finite value up round to
      nearest. Outside ``torch.compile`` it is computed so (:func:`_sr_counter_eager`: 9 integer
      operations and a conversion).
    * FP16 (not a truncation of FP32): ``near = round(x)`` and ``other``, the neighbour on
      ``x``'s side; ``x`` takes ``other`` when ``u * |other - near| < |x - near|``, with ``u``
      the upper 24 of the 32 bits over 2**24 (the product is exact, the spacing being a power
      of two, so the probability is ``|x - near| / spacing`` to 24 bits without a division).
      inf and NaN are kept (the comparison is False there); values beyond the largest finite
      value round to nearest.

    Inside a trace both are written without bit casts (Inductor lowers a bit cast to a
    per-element loop on CPU, measured 1.45x the float form's time on a 2**16 tile). The
    neighbour: for a normal ``near`` with ``m`` mantissa bits, ``round(near ± |near| * 0.6 *
    2**-m)`` is the next value in that direction (0.6 to 1.2 ulps, so round-to-nearest lands on
    the neighbour in every binade, also at a power of two where the spacing below is half);
    below the smallest normal the spacing is fixed. BF16's rule in those terms: when ``near`` is
    the neighbour towards zero (``|near| <= |x|``), take ``other`` when ``(1 - n / 2**16) *
    spacing <= |x - near|``, else when ``n / 2**16 * spacing < |x - near|`` (both products exact).
    """
    if not torch.compiler.is_compiling():
        return _sr_counter_eager(x, dtype, bits)
    mant, tiny, sub = _FORMATS[dtype]
    near = x.to(dtype)
    n32 = near.float()
    diff = x - n32  # exact: |diff| <= half an ulp of the target dtype
    a = n32.abs()
    step = torch.where(a < tiny, sub, a * (0.6 * 2.0**-mant))
    other = n32 + torch.where(diff >= 0, step, -step)
    if dtype == torch.bfloat16:  # x's sign on a zero neighbour (-sub + sub is +0.0), as the bit form keeps it
        other = torch.copysign(other, x)
    other = other.to(dtype)
    span = (other.float() - n32).abs()
    dist = diff.abs()
    if dtype == torch.bfloat16:
        u = _uniform16(bits)
        # NaN and inf fail every comparison below and keep ``near``.
        take = torch.where(a <= x.abs(), (1.0 - u) * span <= dist, u * span < dist)
    else:
        take = _uniform24(bits) * span < dist
    return torch.where(take, other, near)


def _uniform16(bits: Tensor) -> Tensor:
    """The upper 16 of 32 random bits over 2**16: exact in FP32, in [0, 1) (int64 or int32 lanes)."""
    hi = bits >> 16
    if bits.dtype == torch.int32:  # counter_bits32: the shift was arithmetic, keep the 16 bits
        hi = hi.bitwise_and_(0xFFFF)
    return hi.to(torch.float32).mul_(2.0**-16)


def _uniform24(bits: Tensor) -> Tensor:
    """The upper 24 of 32 random bits over 2**24: exact in FP32, in [0, 1) (int64 or int32 lanes)."""
    hi = bits >> 8
    if bits.dtype == torch.int32:  # counter_bits32: the shift was arithmetic, keep the 24 bits
        hi = hi.bitwise_and_(0xFFFFFF)
    return hi.to(torch.float32).mul_(2.0**-24)


#: The FP32 bit pattern of BF16's largest finite value: from its bucket up, BF16 rounding is to nearest.
_BF16_TOP = 0x7F7F0000


def _sr_bf16_bits_eager(x: Tensor, bits: Tensor) -> Tensor:
    """:func:`_sr_counter`'s BF16 rule in integer operations on the FP32 bit pattern (exact on every device).

    ``keep`` is ``0xFFFF`` below the top bucket and 0 from it up (inf and NaN included): there
    the noise is masked out and nothing truncated, so the final conversion rounds to nearest,
    and a NaN's payload can never carry into the sign or turn it into an infinity.
    """
    pattern = x.view(torch.int32)
    magnitude, top, s31, low16 = _cached(pattern, 0x7FFFFFFF, _BF16_TOP, 31, 0xFFFF)
    keep = pattern.bitwise_and(magnitude).sub_(top)
    keep.bitwise_right_shift_(s31).bitwise_and_(low16)  # 0xFFFF or 0
    (s16,) = _cached(bits, 16)
    noise = torch.bitwise_right_shift(bits, s16)  # upper 16 bits (and sign copies in int32 lanes)
    if noise.dtype != torch.int32:
        noise = noise.to(torch.int32)  # below 2**16 in int64 lanes: exact
    if noise.shape != pattern.shape:  # bits that broadcast, as the float form allows
        noise = noise.expand(pattern.shape).clone()
    # Two fresh tile-sized buffers, not three: on a CPU a third crossed glibc's trim threshold on a
    # 2**17 tile (every call then faulted in fresh pages: 57 -> 645 us measured).
    out = noise.bitwise_and_(keep).add_(pattern).bitwise_and_(keep.bitwise_not_())  # no overflow: below the top
    return out.view(torch.float32).to(torch.bfloat16)  # exact where truncated


def _sr_counter_eager(x: Tensor, dtype: torch.dtype, bits: Tensor) -> Tensor:
    """:func:`_sr_counter`, bit for bit, in faster eager kernels.

    BF16 by :func:`_sr_bf16_bits_eager`. FP16 with the three ``where`` of the traced form replaced:

    * ``where(|near| < tiny, sub, |near| * c)`` becomes ``max(|near| * c, sub)``: they differ only
      for ``tiny <= |near| < tiny / 0.6``, where both offsets (0.6 to 1 times ``sub``, the spacing
      there) round to the same neighbour.
    * ``where(diff >= 0, step, -step)`` becomes ``copysign(step, diff)``: ``diff`` is never -0.0
      (``x - n`` with ``x == n`` is +0.0) and a NaN ``diff`` (``x`` inf or NaN) keeps ``near``.
    * The final select is ``near ^ ((near ^ other) & -take)`` on the bit patterns.
    """
    if dtype == torch.bfloat16:
        return _sr_bf16_bits_eager(x, bits)
    mant, _, sub = _FORMATS[dtype]
    # In place where the buffer is ours: on a CPU every fresh tile-sized buffer costs page faults.
    near = x.to(dtype)
    n32 = near.float()
    diff = x - n32  # exact: |diff| <= half an ulp of the target dtype
    offset, scale24 = _cached(n32, 0.6 * 2.0**-mant, 2.0**-24)
    s8, low24 = _cached(bits, 8, 0xFFFFFF)
    t = n32.abs().mul_(offset).clamp_min_(sub)
    other = torch.copysign(t, diff, out=t).add_(n32).to(dtype)
    span = t.copy_(other).sub_(n32).abs_()  # |other - near|, exact
    hi = torch.bitwise_right_shift(bits, s8)  # (`bits >> 8` takes a 5x slower broadcast path on a CPU)
    if bits.dtype == torch.int32:  # counter_bits32: the shift was arithmetic, keep the 24 bits
        hi.bitwise_and_(low24)
    take = n32.copy_(hi).mul_(scale24).mul_(span) < diff.abs_()  # u * span < |x - near|, u in [0, 1)
    del hi, t, n32, diff
    nb = near.view(torch.int16)
    out = other.view(torch.int16)
    out.bitwise_xor_(nb).bitwise_and_(take.to(torch.int16).neg_()).bitwise_xor_(nb)
    return other


def with_edits(master: Tensor, weight: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``master`` with the edits of its rounded copy ``weight`` carried in, in ``master``'s dtype.

    After a step ``weight == round(master)`` exactly, so an element where they differ was edited
    outside the step (``p.data.clamp_``, a pruning mask) and takes ``weight``'s value; the others
    keep ``master``'s exact value. MasterWeightOptimizer's edit check (``weight_edits="values"``)
    and the fused step's in-kernel form of it.

    Args:
        master: The FP32 master (or its FP32 working copy inside a step).
        weight: The half-precision weight the model holds.
        out: Where to write the result (``master`` itself for an in-place sync).

    Returns:
        The result (``out`` when given).
    """
    return torch.where(weight == master.to(weight.dtype), master, weight.to(master.dtype), out=out)


#: Per half dtype: (half an ulp relative to the power of two below the value, 2**-(mantissa bits + 1);
#: the smallest subnormal, the finest step a compensation in that dtype can take).
_HALF_ULP = {torch.bfloat16: (2.0**-8, 2.0**-133), torch.float16: (2.0**-11, 2.0**-24)}


def comp_of_weight(weight: Tensor, comp: Tensor, dtype: torch.dtype) -> Tensor:
    """The Kahan compensation ``comp`` where it can belong to the ``dtype`` weight, else 0, in ``weight``'s dtype.

    After a step ``weight = round(w)`` (to nearest) and ``comp`` is the remainder ``w - weight``
    rounded stochastically, so ``|comp| <= max(ulp(weight) / 2, min_subnormal)`` (the bound is a
    power of two, representable, so the rounding of ``comp`` cannot cross it): nothing is dropped
    then. A weight edited outside the step (``p.data.mul_(mask)``, ``p.data.clamp_``) usually
    breaks the bound: the compensation belongs to the old value, and adding it back would undo
    the edit (a pruned zero would come back as the old remainder), so it is dropped. ``ulp/2`` is
    ``2**(e - m - 1)`` for a weight in ``[2**e, 2**(e+1))`` with ``m`` mantissa bits: the FP32
    exponent bits of ``|weight|`` with the mantissa cleared, scaled (no transcendental op).

    Args:
        weight: The weight upcast to FP32.
        comp: The compensation buffer (``dtype``).
        dtype: The weight's storage dtype (BF16 or FP16).

    Returns:
        A new FP32 tensor of ``weight``'s shape.
    """
    rel, finest = _HALF_ULP[dtype]
    bound = weight.abs().view(torch.int32).bitwise_and_(0x7F800000).view(torch.float32).mul_(rel).clamp_min_(finest)
    c = comp.to(weight.dtype)
    return torch.where(c.abs() <= bound, c, 0.0)


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
    if param.dtype in HALF:
        compensation.copy_(stochastic_round(w - hi.to(acc), param.dtype, generator=generator))
    else:
        compensation.zero_()
