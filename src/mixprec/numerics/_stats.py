"""Where a tensor's values land in a low-precision format: ``tensor_stats`` and ``Log2Histogram``.

A value ``x`` stored in a floating format with round-to-nearest-even

* *flushes to zero* when ``|x| <= smallest_subnormal / 2`` (the tie rounds to the even
  neighbour, which is zero),
* becomes *subnormal* (fewer significant bits) when it is not flushed and rounds to a
  magnitude below ``smallest_normal``, i.e. ``|x| < smallest_normal - smallest_subnormal / 2``,
* *overflows* when it rounds past ``max``: ``|x| > max + ulp(max) / 2``, or exactly at that tie
  when ``max`` has an odd significand (all-ones: f16, bf16, f8e5m2). f8e4m3fn has no infinity:
  torch's cast turns such values into NaN or (torch 2.13 on CPU) *saturates* them to 448
  silently; either way the value is lost, so it counts as overflow here.

For FP16 that is: zero below 2**-25, subnormal below 2**-14, infinite from 65520 on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .._dtypes import dtype_name, limits, parse_dtype

__all__ = ["Log2Histogram", "TensorStats", "Thresholds", "fp8_scale", "tensor_stats", "thresholds"]

_EPS = 1e-12  # torchao's floor on amax before an FP8 scale is taken


def stored_values(t: torch.Tensor) -> torch.Tensor:
    """The values ``t`` stores, as a strided tensor: ``t`` itself, or a sparse tensor's values.

    A sparse gradient (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) holds
    the rows a batch touched; its other elements are implicit zeros that no computation made,
    and most elementwise ops (``isfinite``, ``reshape``) are not implemented for sparse layouts.
    Statistics of what was computed (inf/NaN, magnitudes, underflow) are therefore taken over the
    stored values. A COO tensor is coalesced first: an embedding's gradient lists a row once per
    lookup, and the gradient of that row is the sum of those entries.

    Args:
        t: Any tensor (strided, sparse COO, or a compressed sparse layout: CSR, CSC, BSR, BSC).

    Returns:
        ``t`` when it is strided; else its (coalesced) values, a strided tensor of ``t``'s dtype.

    Host syncs: none for a strided tensor; coalescing a COO tensor on a GPU reads its new number
    of entries back (one sync).

    Example:
        >>> g = torch.sparse_coo_tensor(torch.tensor([[1, 1]]), torch.tensor([[1.0], [2.0]]), (4, 1), check_invariants=True)
        >>> stored_values(g)
        tensor([[3.]])
    """
    if t.layout == torch.strided:
        return t
    if t.layout == torch.sparse_coo:
        return t.coalesce().values()
    return t.values()  # compressed layouts hold no duplicates


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """Magnitude thresholds of one format under round-to-nearest-even (see the module docstring).

    Attributes:
        dtype: Short name (``"f16"``).
        flush: Largest magnitude that rounds to zero (``smallest_subnormal / 2``; ties flush).
        normal: ``smallest_normal - smallest_subnormal / 2``: magnitudes below this (and above
            ``flush``) round to a subnormal.
        overflow: ``max + ulp(max) / 2``: magnitudes above it overflow.
        overflow_at_tie: Whether the tie ``|x| == overflow`` overflows too (odd ``max`` significand).
        max: Largest finite value.
        smallest_normal: Smallest positive normal value.
        smallest_subnormal: Smallest positive subnormal value.
        eps: Gap between 1 and the next value.
        mantissa_bits: Explicit significand bits.
    """

    dtype: str
    flush: float
    normal: float
    overflow: float
    overflow_at_tie: bool
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float
    mantissa_bits: int

    @property
    def log2_flush_bin(self) -> int:
        """Highest log2 bin ``k`` (values in ``[2**k, 2**(k+1))``) that flushes to zero entirely."""
        return int(math.log2(self.smallest_subnormal)) - 2

    @property
    def log2_normal_bin(self) -> int:
        """Lowest log2 bin whose values are normal (``log2(smallest_normal)``)."""
        return int(math.log2(self.smallest_normal))

    @property
    def log2_overflow_bin(self) -> int:
        """Lowest log2 bin that overflows entirely (``floor(log2(max)) + 1``)."""
        return math.floor(math.log2(self.max)) + 1


_THRESHOLDS: dict[torch.dtype, Thresholds] = {}


def thresholds(dtype: str | torch.dtype) -> Thresholds:
    """Return the rounding :class:`Thresholds` of a floating format.

    Example:
        >>> thresholds("f16").overflow
        65520.0
    """
    dt = parse_dtype(dtype)
    if dt not in _THRESHOLDS:
        lim = limits(dt)
        top_exp = math.floor(math.log2(lim.max))
        ulp_max = 2.0 ** (top_exp - lim.mantissa_bits)
        significand = round(lim.max / ulp_max)  # integer significand of max, e.g. 2047 for f16
        _THRESHOLDS[dt] = Thresholds(
            dtype=dtype_name(dt),
            flush=lim.smallest_subnormal / 2,
            normal=lim.smallest_normal - lim.smallest_subnormal / 2,
            overflow=lim.max + ulp_max / 2,
            overflow_at_tie=significand % 2 == 1,
            max=lim.max,
            smallest_normal=lim.smallest_normal,
            smallest_subnormal=lim.smallest_subnormal,
            eps=lim.eps,
            mantissa_bits=lim.mantissa_bits,
        )
    return _THRESHOLDS[dt]


@dataclasses.dataclass(frozen=True)
class TensorStats:
    """How a tensor's values would fare in one floating format (counts over all elements).

    Attributes:
        dtype: The format asked about (``"f16"``, ``"bf16"``, ``"f8e4m3"``, ``"f8e5m2"``, ...).
        source_dtype: The tensor's own dtype.
        numel: Number of elements.
        absmax: Largest magnitude, ignoring NaN (``inf`` when the tensor holds an infinity;
            0.0 for an empty tensor).
        min_nonzero: Smallest non-zero magnitude (``inf`` when every value is zero or NaN).
        n_zero: Elements that are exactly zero already.
        n_underflow: Non-zero finite elements that would flush to zero in ``dtype``.
        n_subnormal: Elements that would become subnormal in ``dtype`` (not counting flushes).
        n_overflow: Finite elements that would overflow ``dtype`` (become inf, or saturate for f8e4m3).
        n_nonfinite: Elements that are inf or NaN already.
        scaling: ``"none"`` (the values as they are), or the FP8 scaling the counts were taken
            under (``"tensorwise"``, ``"rowwise"``, ``"scale=<s>"``): then every count and
            ``absmax``/``min_nonzero`` describe the *scaled* values, as the FP8 cast sees them.
    """

    dtype: str
    source_dtype: str
    numel: int
    absmax: float
    min_nonzero: float
    n_zero: int
    n_underflow: int
    n_subnormal: int
    n_overflow: int
    n_nonfinite: int
    scaling: str = "none"

    def _frac(self, n: int) -> float:
        return n / self.numel if self.numel else 0.0

    @property
    def frac_zero(self) -> float:
        """Fraction of elements that are zero."""
        return self._frac(self.n_zero)

    @property
    def frac_underflow(self) -> float:
        """Fraction of elements that are non-zero but would flush to zero in ``dtype``."""
        return self._frac(self.n_underflow)

    @property
    def frac_subnormal(self) -> float:
        """Fraction of elements that would be subnormal in ``dtype``."""
        return self._frac(self.n_subnormal)

    @property
    def frac_overflow(self) -> float:
        """Fraction of elements that would overflow ``dtype``."""
        return self._frac(self.n_overflow)

    @property
    def frac_nonfinite(self) -> float:
        """Fraction of elements that are inf or NaN."""
        return self._frac(self.n_nonfinite)

    @property
    def all_finite(self) -> bool:
        """No inf/NaN now, and none after a cast to ``dtype``."""
        return self.n_nonfinite == 0 and self.n_overflow == 0

    def to_dict(self) -> dict[str, Any]:
        """The fields plus the ``frac_*`` properties, JSON-ready (non-finite floats as strings)."""
        d: dict[str, Any] = dataclasses.asdict(self)
        for k in ("frac_zero", "frac_underflow", "frac_subnormal", "frac_overflow", "frac_nonfinite"):
            d[k] = getattr(self, k)
        for k in ("absmax", "min_nonzero"):
            if not math.isfinite(d[k]):
                d[k] = str(d[k])
        return d

    def __str__(self) -> str:
        scaled = "" if self.scaling == "none" else f" ({self.scaling} scaling)"
        return (
            f"{self.source_dtype}[{self.numel}] in {self.dtype}{scaled}: absmax {self.absmax:.3g}, min nonzero "
            f"{self.min_nonzero:.3g}, zero {self.frac_zero:.2%}, underflow {self.frac_underflow:.2%}, "
            f"subnormal {self.frac_subnormal:.2%}, overflow {self.frac_overflow:.2%}, inf/nan {self.frac_nonfinite:.2%}"
        )


@torch.no_grad()
def tensor_stats(
    t: torch.Tensor, dtype: str | torch.dtype = "f16", scaling: str | float | None = None, dim: int = -1
) -> TensorStats:
    """Measure where ``t``'s values would land in the floating format ``dtype``.

    Algorithm: one ``abs`` in FP32 (FP64 for FP64 input), then masked counts against the
    format's round-to-nearest-even thresholds (:func:`thresholds`); the counts and extremes
    are stacked into one tensor and read back with a single host sync. No cast to ``dtype`` is
    made, so a saturating f8e4m3 cast cannot hide an overflow. About six passes over the tensor,
    cheap enough to run on every parameter.

    Args:
        t: Any floating tensor (an integer tensor is measured as float). A sparse tensor (a
            sparse gradient) is measured over its stored values (:func:`stored_values`): its
            implicit zeros are not counted in ``numel`` or ``n_zero``.
        dtype: ``"f16"``, ``"bf16"``, ``"f8e4m3"``, ``"f8e5m2"`` (or ``"f32"``, a ``torch.dtype``, an alias).
        scaling: For FP8 formats, count the values as an FP8 training recipe casts them:
            ``"tensorwise"`` or ``"rowwise"`` (torchao's dynamic scale, along ``dim`` for rowwise;
            :func:`mixprec.numerics.fp8_scale`) or a fixed scale (a number). ``None``: unscaled.
            Under dynamic scaling nothing overflows (the largest value lands on the format's
            maximum, 448 for E4M3, 57344 for E5M2); what is lost underflows.
        dim: The dimension a rowwise scale runs along (the GEMM's reduction dimension).

    Returns:
        :class:`TensorStats`.

    Host sync: one (the result is read back; a sparse COO ``t`` one more, to coalesce it).

    Example:
        >>> s = tensor_stats(torch.tensor([0.0, 1e-8, 1e-6, 1.0, 7e4]), "f16")
        >>> s.n_zero, s.n_underflow, s.n_subnormal, s.n_overflow
        (1, 1, 1, 1)
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor_stats needs a tensor, got {type(t).__name__}")
    if t.is_complex():
        raise TypeError(f"tensor_stats needs a real tensor, got {t.dtype} (the imaginary part would be dropped); pass "
                        "torch.view_as_real(t) to count both parts.")
    th = thresholds(dtype)
    x = stored_values(t.detach())
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    label = "none"
    zero_before = None
    if scaling is not None:
        zero_before = x.reshape(-1) == 0  # a value the scale multiplies down to 0 was not zero: it underflowed
        x, label = _fp8_scaled(x.to(work), dtype, scaling, dim)
    a = x.reshape(-1).to(work).abs()
    numel = a.numel()
    if numel == 0:
        return TensorStats(th.dtype, _src_name(t.dtype), 0, 0.0, math.inf, 0, 0, 0, 0, 0, label)
    nan = torch.isnan(a)
    finite = torch.isfinite(a)
    zero = a == 0 if zero_before is None else zero_before
    underflow = (a <= th.flush) & ~zero
    subnormal = (a > th.flush) & (a < th.normal)
    over = (a > th.overflow) | (a == th.overflow) if th.overflow_at_tie else a > th.overflow
    over = over & finite
    absmax = torch.where(nan, 0.0, a).amax()
    min_nonzero = torch.where(zero | nan, math.inf, a).amin()
    packed = torch.stack([
        absmax.to(torch.float64), min_nonzero.to(torch.float64),
        zero.sum().to(torch.float64), underflow.sum().to(torch.float64), subnormal.sum().to(torch.float64),
        over.sum().to(torch.float64), (~finite).sum().to(torch.float64),
    ]).tolist()  # the one host sync
    return TensorStats(
        dtype=th.dtype, source_dtype=_src_name(t.dtype), numel=numel, absmax=packed[0], min_nonzero=packed[1],
        n_zero=int(packed[2]), n_underflow=int(packed[3]), n_subnormal=int(packed[4]),
        n_overflow=int(packed[5]), n_nonfinite=int(packed[6]), scaling=label,
    )


def _check_f8(dtype: str | torch.dtype) -> torch.dtype:
    dt = parse_dtype(dtype)
    if dt not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"FP8 scaling is for f8e4m3 or f8e5m2, got {dtype_name(dt)}.")
    return dt


@torch.no_grad()
def fp8_scale(
    t: torch.Tensor, dtype: str | torch.dtype = "f8e4m3", scaling: str = "tensorwise", dim: int = -1, pow2: bool | None = None
) -> torch.Tensor:
    """The dynamic scale torchao's recipe multiplies ``t`` by before casting to FP8.

    ``scale = fp8_max / max(amax, 1e-12)`` (in float64, rounded to float32), with ``amax`` over the tensor (``tensorwise``) or
    along ``dim`` (``rowwise``, one scale per slice, shaped to broadcast), rounded down to a
    power of two when ``pow2`` (default: on for rowwise, as torchao's rowwise recipes).

    Args:
        t: The high-precision operand.
        dtype: ``f8e4m3`` (max 448) or ``f8e5m2`` (max 57344).
        scaling: ``tensorwise`` or ``rowwise``.
        dim: The dimension a rowwise amax runs along (the GEMM's reduction dimension).
        pow2: Round the scale down to a power of two.

    Returns:
        An FP32 tensor: 0-d (tensorwise) or ``t``'s shape with ``dim`` of size 1. No host sync.

    Raises:
        ValueError: an unknown scaling or a non-FP8 dtype.
    """
    dt = _check_f8(dtype)
    if scaling not in ("tensorwise", "rowwise"):
        raise ValueError(f"FP8 scaling {scaling!r} is not known; use 'tensorwise' or 'rowwise'.")
    a = t.detach().float().abs()
    amax = a.amax() if scaling == "tensorwise" else a.amax(dim=dim, keepdim=True)
    # In float64, then rounded to float32, exactly as torchao (its amax_to_scale), so the scales agree bit for bit.
    scale = (torch.finfo(dt).max / amax.double().clamp(min=_EPS)).float()
    if pow2 if pow2 is not None else scaling == "rowwise":
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _fp8_scaled(x: torch.Tensor, dtype: str | torch.dtype, scaling: str | float, dim: int) -> tuple[torch.Tensor, str]:
    """``x`` times the FP8 scale of ``scaling`` (non-finite values kept as they are), and the scaling's label."""
    dt = parse_dtype(dtype)
    if dt not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(
            f"tensor_stats(scaling={scaling!r}) is for FP8 formats (f8e4m3, f8e5m2), got dtype={dtype_name(dt)}; "
            "drop scaling= for other formats."
        )
    if isinstance(scaling, (int, float)) and not isinstance(scaling, bool):
        if not (scaling > 0 and math.isfinite(scaling)):
            raise ValueError(f"a fixed FP8 scale must be positive and finite, got scaling={scaling!r}")
        return x * float(scaling), f"scale={float(scaling):g}"
    if scaling not in ("tensorwise", "rowwise"):
        raise ValueError(f"scaling={scaling!r}; use 'tensorwise', 'rowwise', a positive number, or None.")
    # The dynamic scale ignores inf/NaN as the amax would not (torchao's scale becomes 0 then).
    scale = fp8_scale(torch.where(torch.isfinite(x), x, 0.0), dt, scaling, dim)
    return x * scale.to(x.dtype), scaling


def _src_name(dt: torch.dtype) -> str:
    try:
        return dtype_name(dt)
    except ValueError:
        return str(dt).removeprefix("torch.")


class Log2Histogram:
    """Counts of magnitudes in power-of-two bins, kept on the tensor's device (no host sync to add).

    Bin ``k`` holds magnitudes in ``[2**k, 2**(k+1))`` for ``k`` in ``[K_MIN + 1, K_MAX]``; bin
    ``K_MIN`` (-127) lumps everything below 2**-126 (FP32's subnormals; FP16 flushes all of it, BF16
    keeps a little). Zeros and inf/NaN have their own counts. Values are binned as FP32 (FP64 input
    beyond FP32's range lands in the zero or inf/NaN count). This is the histogram of Micikevicius
    et al. 2018 (Fig. 3): from it the fraction that flushes to zero, turns subnormal or overflows
    in a format after multiplying by a power-of-two loss scale ``2**s`` follows by shifting the bins
    by ``s`` (exact up to the one bin that straddles a rounding threshold).

    The bin of a value is its FP32 exponent field, read from the bits (``view(int32) >> 23``),
    so adding a tensor costs about ten elementwise kernels.

    Example:
        >>> h = Log2Histogram()
        >>> h.add_(torch.tensor([1e-9, 1e-3, 0.0]))
        >>> round(h.lost_fraction("f16", scale=1.0), 3), round(h.lost_fraction("f16", scale=2.0**10), 3)
        (0.5, 0.0)
    """

    K_MIN = -127
    K_MAX = 127
    N_BINS = K_MAX - K_MIN + 1  # 255: FP32 exponent fields 0..254; field 255 is inf/NaN
    _NONFINITE = N_BINS  # counts layout: [bins..., inf/NaN, zero]
    _ZERO = N_BINS + 1

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.counts: torch.Tensor | None = None  # int64[N_BINS + 2]
        self.absmax: torch.Tensor | None = None  # float32 0-d, over finite values
        self.samples = 0

    def _ensure(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.counts is None or self.absmax is None:
            self.device = device
            self.counts = torch.zeros(self.N_BINS + 2, dtype=torch.int64, device=device)
            self.absmax = torch.zeros((), dtype=torch.float32, device=device)
        return self.counts, self.absmax

    @torch.no_grad()
    def add_(self, t: torch.Tensor, scale: torch.Tensor | float | None = None, max_elements: int | None = None) -> None:
        """Add the magnitudes of ``t`` (divided by ``scale`` when given) to the counts.

        Args:
            t: A floating tensor; a sparse one (a sparse gradient) adds its stored values
                (:func:`stored_values`), not its implicit zeros.
            scale: Divide by this first (a loss scale, to record unscaled gradients); a 0-d tensor
                stays on the device.
            max_elements: For tensors larger than this, count a strided subset (an estimate).

        Host syncs: none (a sparse COO ``t``: one, to coalesce it, :func:`stored_values`).
        """
        counts, amax = self._ensure(t.device if self.counts is None else self.counts.device)
        a = stored_values(t.detach()).reshape(-1)
        if a.device != counts.device:
            a = a.to(counts.device)
        if max_elements is not None and a.numel() > max_elements:
            a = a[:: -(-a.numel() // max_elements)]
        a = a.float().abs()
        if scale is not None:
            a = a / (scale.to(a.device, torch.float32) if isinstance(scale, torch.Tensor) else float(scale))
        bits = a.view(torch.int32)  # sign bit clear: exponent field = bits >> 23, inf/NaN: field 255
        idx = torch.where(bits == 0, self._ZERO, bits >> 23)
        counts.index_add_(0, idx, torch.ones_like(idx, dtype=torch.int64))
        if a.numel():
            finite_max = torch.where(bits < 0x7F800000, a, 0.0).amax()
            torch.maximum(amax, finite_max, out=amax)
        self.samples += 1

    def nonfinite_count(self) -> torch.Tensor | None:
        """The inf/NaN count so far, as a 0-d int64 tensor on the histogram's device (``None``: nothing added).

        A copy: later :meth:`add_` calls do not change it, so the difference between two of them
        is what the adds in between counted (with ``max_elements``, in their strided subsets).

        Returns:
            The count, or ``None`` before the first :meth:`add_`.

        Host syncs: none.
        """
        return None if self.counts is None else self.counts[self._NONFINITE].clone()

    def merge_(self, other: Log2Histogram) -> Log2Histogram:
        """Add another histogram's counts into this one (returns self)."""
        if other.counts is None or other.absmax is None:
            return self
        counts, amax = self._ensure(other.counts.device)
        counts.add_(other.counts.to(counts.device))
        torch.maximum(amax, other.absmax.to(amax.device), out=amax)
        self.samples += other.samples
        return self

    # ----- host-side queries (each syncs once through _host) -----
    def _host(self) -> tuple[list[int], int, int, float]:
        """(bins, zero count, inf/NaN count, absmax) on the host (one sync each for counts and absmax)."""
        if self.counts is None or self.absmax is None:
            return [0] * self.N_BINS, 0, 0, 0.0
        c = self.counts.tolist()
        return c[: self.N_BINS], c[self._ZERO], c[self._NONFINITE], float(self.absmax)

    @property
    def total(self) -> int:
        """Number of values counted."""
        bins, zero, nonfinite, _ = self._host()
        return sum(bins) + zero + nonfinite

    def bins(self) -> dict[int, int]:
        """Non-empty bins as ``{k: count}`` (magnitudes in ``[2**k, 2**(k+1))``)."""
        b, _, _, _ = self._host()
        return {self.K_MIN + i: n for i, n in enumerate(b) if n}

    def summary(self) -> dict[str, Any]:
        """Counts for reports: ``total``, ``zero``, ``nonfinite``, ``absmax``, ``bins`` ({k: count})."""
        b, zero, nonfinite, amax = self._host()
        return {
            "total": sum(b) + zero + nonfinite, "zero": zero, "nonfinite": nonfinite, "absmax": amax,
            "bins": {self.K_MIN + i: n for i, n in enumerate(b) if n},
        }

    @staticmethod
    def _shift(scale: float) -> int:
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"a loss scale must be positive and finite, got {scale}")
        return round(math.log2(scale))

    def fractions(self, dtype: str | torch.dtype = "f16", scale: float = 1.0) -> dict[str, float]:
        """Fractions of all counted values that, multiplied by ``scale``, would flush / be subnormal / overflow.

        ``scale`` is rounded to the nearest power of two for the bin shift. Also returns
        ``zero`` (exact zeros), ``nonfinite`` and ``lost_of_nonzero`` (flushed / non-zero finite).
        """
        th = thresholds(dtype)
        s = self._shift(scale)
        b, zero, nonfinite, _ = self._host()
        total = sum(b) + zero + nonfinite
        flushed = sub = over = 0
        for i, n in enumerate(b):
            if not n:
                continue
            k = self.K_MIN + i + s
            if k <= th.log2_flush_bin:
                flushed += n
            elif k < th.log2_normal_bin:
                sub += n
            elif k >= th.log2_overflow_bin:
                over += n
        nonzero = sum(b)
        denom = total or 1
        return {
            "underflow": flushed / denom, "subnormal": sub / denom, "overflow": over / denom,
            "zero": zero / denom, "nonfinite": nonfinite / denom,
            "lost_of_nonzero": flushed / nonzero if nonzero else 0.0,
        }

    def lost_fraction(self, dtype: str | torch.dtype = "f16", scale: float = 1.0) -> float:
        """Fraction of the non-zero finite values that flush to zero in ``dtype`` after scaling by ``scale``."""
        return self.fractions(dtype, scale)["lost_of_nonzero"]

    def smallest_scale_keeping(self, dtype: str | torch.dtype = "f16", max_lost: float = 0.001,
                               max_log2: int = 40) -> float | None:
        """Smallest power-of-two scale (>= 1) at which at most ``max_lost`` of the non-zero values flush.

        Returns ``None`` when even ``2**max_log2`` loses more.
        """
        th = thresholds(dtype)
        b, _, _, _ = self._host()
        nonzero = sum(b)
        if not nonzero:
            return 1.0
        # cumulative count of values in bins <= k, walking up from the bottom
        for s in range(max_log2 + 1):
            limit = th.log2_flush_bin - s  # bins k <= limit flush at scale 2**s
            lost = sum(n for i, n in enumerate(b) if self.K_MIN + i <= limit)
            if lost / nonzero <= max_lost:
                return float(2**s)
        return None
