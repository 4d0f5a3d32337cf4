"""tensor_stats and Log2Histogram against direct counts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mixprec.numerics import Log2Histogram, tensor_stats, thresholds

CASTABLE = ["f16", "bf16", "f8e5m2"]  # formats whose torch cast rounds to nearest and overflows to inf
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f8e5m2": torch.float8_e5m2, "f8e4m3": torch.float8_e4m3fn}


def _direct(x: torch.Tensor, name: str) -> dict[str, int]:
    """Count by casting to the format (torch rounds to nearest even)."""
    y = x.to(DTYPES[name]).float()
    finite = torch.isfinite(x)
    tiny = torch.finfo(DTYPES[name]).smallest_normal
    return {
        "n_zero": int((x == 0).sum()),
        "n_underflow": int(((y == 0) & (x != 0) & finite).sum()),
        "n_subnormal": int(((y != 0) & (y.abs() < tiny) & finite).sum()),
        "n_overflow": int((~torch.isfinite(y) & finite).sum()),
        "n_nonfinite": int((~finite).sum()),
    }


def _direct_e4m3(x: torch.Tensor) -> dict[str, int]:
    """f8e4m3fn saturates in torch's cast, so overflow is counted from first principles: 448 is the
    largest value (1.75 * 2**8), the ulp in [256, 512) is 32, so values above 448 + 16 round past it
    (464 itself is a tie that rounds to the even significand, 448)."""
    d = _direct(x, "f8e4m3")
    d["n_overflow"] = int(((x.abs().double() > 464) & torch.isfinite(x)).sum())
    return d


magnitudes = st.floats(min_value=-60, max_value=20, allow_nan=False)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Values spread over many binades (log-uniform), with signs, exact zeros, threshold values and inf/NaN."""
    n = draw(st.integers(1, 200))
    exps = draw(st.lists(magnitudes, min_size=n, max_size=n))
    signs = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=n, max_size=n))
    vals = [s * 2.0**e for s, e in zip(signs, exps)]
    specials = draw(st.lists(st.sampled_from(
        [0.0, 65504.0, 65519.0, 65520.0, 65536.0, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0001, 2.0**-14, 6.1e-5, 448.0, 464.0,
         465.0, 57344.0, 61440.0, 61439.0, 2.0**-17, 2.0**-10, 3.4e38, math.inf, -math.inf, math.nan, 1e-40]),
        max_size=20))
    return torch.tensor(vals + specials, dtype=torch.float32)


@given(tensors())
def test_fractions_agree_with_a_direct_count(x: torch.Tensor) -> None:
    for name in CASTABLE:
        s = tensor_stats(x, name)
        direct = _direct(x, name)
        assert {k: getattr(s, k) for k in direct} == direct, name
        assert s.numel == x.numel()
        assert s.frac_underflow == pytest.approx(direct["n_underflow"] / x.numel())
    s = tensor_stats(x, "f8e4m3")
    d = _direct_e4m3(x)
    assert {k: getattr(s, k) for k in d} == d


@given(tensors())
def test_extremes(x: torch.Tensor) -> None:
    s = tensor_stats(x, "f16")
    a = x.abs()
    clean = a[~torch.isnan(a)]
    assert s.absmax == (float(clean.max()) if clean.numel() else 0.0)
    nz = clean[clean > 0]
    assert s.min_nonzero == (float(nz.min()) if nz.numel() else math.inf)


def test_thresholds_of_fp16_and_friends() -> None:
    f16 = thresholds("f16")
    assert (f16.flush, f16.overflow, f16.overflow_at_tie) == (2.0**-25, 65520.0, True)
    assert (f16.log2_flush_bin, f16.log2_normal_bin, f16.log2_overflow_bin) == (-26, -14, 16)
    e4 = thresholds("f8e4m3")
    assert (e4.max, e4.overflow, e4.overflow_at_tie) == (448.0, 464.0, False)
    assert thresholds("bf16").overflow == 2.0**128 - 2.0**119


def test_e4m3_overflow_is_counted_whatever_the_cast_does() -> None:
    x = torch.tensor([1e6, 500.0, 448.0, 464.0])
    # torch's cast of 1e6 and 500 gives 448 (saturation; 2.13 on CPU) or NaN (2.11): lost either way
    assert all(v == 448.0 or math.isnan(v) for v in x.to(torch.float8_e4m3fn).float().tolist()[:2])
    assert tensor_stats(x, "f8e4m3").n_overflow == 2


def test_half_and_double_inputs_and_empty() -> None:
    h = torch.tensor([1.0, 0.0, float("inf")], dtype=torch.float16)
    s = tensor_stats(h, "bf16")
    assert (s.source_dtype, s.n_zero, s.n_nonfinite, s.absmax) == ("f16", 1, 1, math.inf)
    d = torch.tensor([1e-300, 1e300], dtype=torch.float64)
    s = tensor_stats(d, "bf16")
    assert (s.n_underflow, s.n_overflow) == (1, 1)
    e = tensor_stats(torch.empty(0), "f16")
    assert (e.numel, e.frac_zero, e.absmax) == (0, 0.0, 0.0)
    assert "absmax" in str(s) and s.to_dict()["frac_overflow"] == 0.5


def test_tensor_stats_rejects_non_tensors_and_unknown_formats() -> None:
    with pytest.raises(TypeError, match="needs a tensor"):
        tensor_stats([1.0], "f16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown dtype 'f12'"):
        tensor_stats(torch.ones(2), "f12")


def test_log2_histogram_bins_and_scaled_fractions() -> None:
    h = Log2Histogram()
    x = torch.tensor([0.0, 2.0**-30, 2.0**-20, 2.0**-10, 1.5, 2.0**17, float("nan")])
    h.add_(x)
    summ = h.summary()
    assert summ["bins"] == {-30: 1, -20: 1, -10: 1, 0: 1, 17: 1}
    assert (summ["zero"], summ["nonfinite"], summ["total"]) == (1, 1, 7)
    f = h.fractions("f16", 1.0)
    assert f["underflow"] == pytest.approx(1 / 7) and f["overflow"] == pytest.approx(1 / 7)
    assert f["subnormal"] == pytest.approx(1 / 7)  # 2**-20
    assert h.lost_fraction("f16", 1.0) == pytest.approx(1 / 5)
    # 2**-30 * 2**5 = 2**-25 is exactly the flush tie; the histogram counts bin -25 as kept (every other
    # value in it rounds up to 2**-24): the one-bin inexactness the class documents.
    assert h.lost_fraction("f16", 2.0**5) == 0.0
    assert h.smallest_scale_keeping("f16", max_lost=0.0) == 2.0**5
    # dividing by a loss scale records unscaled values
    g = Log2Histogram()
    g.add_(torch.tensor([2.0**-3]), scale=torch.tensor(2.0**10))
    assert g.bins() == {-13: 1}


def test_log2_histogram_matches_direct_flush_count_for_power_of_two_scales() -> None:
    torch.manual_seed(0)
    x = torch.randn(4096) * torch.exp2(torch.randint(-40, 5, (4096,)).float())
    h = Log2Histogram()
    h.add_(x)
    for s in (0, 4, 10, 16):
        direct = int(((x * 2.0**s).half() == 0).sum()) / int((x != 0).sum())
        assert h.lost_fraction("f16", 2.0**s) == pytest.approx(direct, abs=2e-3)


def test_histogram_subsampling_and_merge() -> None:
    h = Log2Histogram()
    h.add_(torch.ones(1000), max_elements=100)
    assert h.total == 100
    g = Log2Histogram().merge_(h).merge_(h)
    assert g.total == 200 and g.samples == 2
