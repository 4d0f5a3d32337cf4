"""The exact BF16 + int16 split of FP32 values (issue 29's groundwork)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mixprec._remainder import join, join_edited, join_into_, split, split_into_

TOPS_EDGE = [0x0000, 0x0001, 0x007F, 0x0080, 0x3F7F, 0x3F80, 0x7F7E, 0x7F7F, 0x8000, 0x8001, 0x807F, 0xBF80, 0xFF7F]
LOWS_EDGE = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF]


def _patterns(tops: torch.Tensor, lows: torch.Tensor) -> torch.Tensor:
    """Every (top, low) pair as an int32 bit pattern (int64 arithmetic, then wrapped)."""
    b = (tops.to(torch.int64)[:, None] << 16) | lows.to(torch.int64)[None, :]
    b = torch.where(b >= 2**31, b - 2**32, b)
    return b.reshape(-1).to(torch.int32)


def _finite_f32(bits: torch.Tensor) -> torch.Tensor:
    x = bits.view(torch.float32)
    return x[torch.isfinite(x)]


def _assert_roundtrip(x: torch.Tensor) -> None:
    hi, lo = split(x)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16 and hi.shape == x.shape
    back = join(hi, lo)
    mismatch = back.view(torch.int32) != x.view(torch.int32)
    assert not mismatch.any(), [hex(int(v)) for v in x.view(torch.int32)[mismatch][:5]]


def test_every_top_half_with_the_edge_low_halves_joins_back_bit_for_bit() -> None:
    x = _finite_f32(_patterns(torch.arange(0x10000), torch.tensor(LOWS_EDGE)))
    assert x.numel() > 6 * 0xFF00  # every finite exponent and sign
    _assert_roundtrip(x)


def test_every_low_half_with_the_edge_top_halves_joins_back_bit_for_bit() -> None:
    # zeros, subnormals, the smallest normal, values next to 1.0 (rounding up to a power of two), the largest finite
    x = _finite_f32(_patterns(torch.tensor(TOPS_EDGE), torch.arange(0x10000)))
    assert x.numel() == len(TOPS_EDGE) * 0x10000
    _assert_roundtrip(x)


def test_a_large_random_sample_of_bit_patterns_joins_back_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(29)
    bits = torch.randint(-(2**31), 2**31, (1 << 22,), generator=g, dtype=torch.int64).to(torch.int32)
    _assert_roundtrip(_finite_f32(bits))


def test_hi_is_torchs_cast_except_exact_ties_which_round_away_from_zero() -> None:
    x = _finite_f32(_patterns(torch.arange(0x10000), torch.tensor(LOWS_EDGE)))
    hi, lo = split(x)
    rne = x.to(torch.bfloat16)
    tie = (x.view(torch.int32) & 0xFFFF) == 0x8000
    same = hi.view(torch.int16) == rne.view(torch.int16)
    assert same[~tie].all()
    # at a tie: one ulp further from zero than truncation, whatever torch's even choice was
    trunc = (x.view(torch.int32)[tie] >> 16).to(torch.int16)
    assert (hi.view(torch.int16)[tie] == trunc + 1).all()
    assert (hi[tie].float().abs() > x[tie].abs()).all()
    assert (lo[tie] == -0x8000).all()
    assert 0 < int((~same).sum()) < int(tie.sum())  # half the ties differ from ties-to-even


def test_the_remainder_is_the_exact_fp32_difference() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g) * torch.logspace(-30, 30, 100_000)
    hi, lo = split(x)
    diff = x.double().abs() - hi.double().abs()  # exact in float64; the remainder is of the magnitude
    ulp = torch.ldexp(torch.ones_like(diff), torch.frexp(x.double())[1] - 24)  # one FP32 ulp of x
    scaled = diff / ulp
    assert torch.equal(scaled, lo.double())


def test_values_past_bf16s_largest_finite_become_inf_and_still_join_back() -> None:
    x = torch.tensor([3.4028234e38, -3.4028234e38, 3.3895314e38], dtype=torch.float32)
    hi, lo = split(x)
    assert torch.equal(hi[:2].float(), x[:2].to(torch.bfloat16).float())  # inf, as torch's cast
    assert torch.isinf(hi[:2]).all() and torch.isfinite(hi[2])
    assert torch.equal(join(hi, lo).view(torch.int32), x.view(torch.int32))


def test_non_finite_values_split_as_torchs_cast() -> None:
    x = torch.tensor([float("inf"), float("-inf"), float("nan")])
    hi, lo = split(x)
    assert torch.equal(lo, torch.zeros(3, dtype=torch.int16))
    back = join(hi, lo)
    assert back[0] == float("inf") and back[1] == float("-inf") and torch.isnan(back[2])


def test_every_nan_payload_splits_into_a_nan_not_inf_or_a_sign_flip() -> None:
    """NaN bit patterns whose low half would round into inf (0x7F800001) or carry across the sign (0x7FFFFFFF)."""
    patterns = [0x7F800001, 0x7F807FFF, 0x7F808000, 0x7FC00000, 0x7FFFFFFF, -0x007FFFFF, -0x00000001, -0x00400000]
    x = torch.tensor(patterns, dtype=torch.int32).view(torch.float32)
    assert torch.isnan(x).all()
    hi, lo = split(x)
    assert torch.isnan(hi).all() and torch.equal(lo, torch.zeros(len(patterns), dtype=torch.int16))
    assert torch.isnan(join(hi, lo)).all()


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)])
def test_in_place_forms_write_the_existing_buffers(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(1)
    master = torch.randn(shape, generator=g)
    weight = torch.empty(shape, dtype=torch.bfloat16)
    rem = torch.empty(shape, dtype=torch.int16)
    ptr = weight.data_ptr()
    split_into_(master, weight, rem)
    assert weight.data_ptr() == ptr
    out = torch.empty(shape)
    assert join_into_(out, weight, rem) is out and torch.equal(out, master)
    # an FP32 update lands exactly in the pair
    updated = out - 1e-3 * torch.randn(shape, generator=g)
    split_into_(updated, weight, rem)
    assert torch.equal(join(weight, rem), updated)


def test_non_contiguous_input_is_split_by_value() -> None:
    x = torch.randn(8, 6).t()
    hi, lo = split(x)
    assert torch.equal(join(hi, lo), x)


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="x must be float32.*got torch.float16"):
        split(torch.ones(2, dtype=torch.float16))
    with pytest.raises(TypeError, match="hi must be bfloat16"):
        join(torch.ones(2), torch.zeros(2, dtype=torch.int16))
    with pytest.raises(TypeError, match="lo must be int16"):
        join(torch.ones(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"same shape, got \(2,\) and \(3,\)"):
        join(torch.ones(2, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int16))
    with pytest.raises(ValueError, match="out must have hi's shape"):
        join_into_(torch.empty(3), torch.ones(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int16))
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        split([1.0])  # type: ignore[arg-type]


def test_the_cost_benchmark_runs_and_reports_ratios_to_a_cast(capsys: pytest.CaptureFixture[str], load_benchmark: Any) -> None:
    module = load_benchmark("remainder_cost")
    assert module.main(["--numel", "65536", "--repeats", "1", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "f32->bf16 copy_" in out and "1.00x" in out
    assert "split_into_ eager" in out and "join_into_ eager" in out and "exact ties" in out


def test_join_edited_gives_zero_and_inf_weights_exactly_and_joins_everything_else() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=g) * 0.02
    hi, lo = split(x)
    assert torch.equal(join_edited(hi, lo).view(torch.int32), x.view(torch.int32))  # untouched: exact
    edited = hi.clone()
    edited[:4] = torch.tensor([0.0, -0.0, float("inf"), float("-inf")], dtype=torch.bfloat16)
    lo[:4] = torch.tensor([-5, 7, 3, 9], dtype=torch.int16)  # pairs split() never makes: joined as bits, NaN or tiny
    assert torch.isnan(join(edited, lo)[[0, 2, 3]]).all()
    got = join_edited(edited, lo)
    assert torch.equal(got[:4].view(torch.int32), edited[:4].float().view(torch.int32))  # the weight itself, sign kept
    assert torch.equal(got[4:].view(torch.int32), x[4:].view(torch.int32))


# ----- RemainderBank: the flat join and split of many tensors --------------------------------------------------------
def _bank_case(shapes: list[tuple[int, ...]]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(FP32 values with edge patterns, BF16 weights, remainders, placeholder masters) of tensors of ``shapes``."""
    from mixprec._remainder import placeholder

    gen = torch.Generator().manual_seed(3)
    edge = _patterns(torch.tensor(TOPS_EDGE), torch.tensor(LOWS_EDGE)).view(torch.float32)
    values, weights, rems, masters = [], [], [], []
    for shape in shapes:
        n = int(torch.tensor(shape).prod())
        x = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-30, 30, (n,), generator=gen)
        k = min(n, edge.numel())
        x[:k] = edge[:k]
        x = x.reshape(shape)
        hi, lo = split(x)
        m = torch.empty(0)
        m.data = placeholder(hi)
        values.append(x), weights.append(hi.clone()), rems.append(lo), masters.append(m)
    return values, weights, rems, masters


@pytest.mark.parametrize(("chunk", "compiled"), [(None, False), (50, False), (50, True)])
def test_a_bank_joins_and_splits_many_tensors_bit_for_bit(chunk: int | None, compiled: bool) -> None:
    """Flat passes (one, or one per few tensors) give each master join_edited(weight, remainder) and split it back.

    Compiled: the Inductor forms the step uses beside the fused step, on passes starting at unaligned offsets."""
    import mixprec._remainder as rmod
    from mixprec._master import _compiled_remainder_fns

    fns = _compiled_remainder_fns() if compiled else [None] * 4
    shapes = [(7, 5), (33,), (2, 3, 4), (120,), (1,), (16, 8)]
    values, weights, rems, masters = _bank_case(shapes)
    weights[0].view(-1)[:4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])  # edits the remainder must not join
    expected = [join_edited(w, r) for w, r in zip(weights, rems)]
    bank = rmod.RemainderBank(weights, masters, rems, chunk)
    assert len(bank.passes) == (1 if chunk is None else 6)  # 35 | 33 | 24 | 120 | 1 | 128 elements
    assert all(torch.equal(a, b) for a, b in zip(bank.remainders, rems))  # moved into one buffer, same values
    assert bank.flat.untyped_storage().nbytes() == 0  # no FP32 storage between steps
    bank.join(fns[2])
    for m, e in zip(masters, expected):
        assert m.shape == e.shape and torch.equal(m.view(torch.int32), e.view(torch.int32))
    # The step's new values, NaN included, split into the weights and remainders exactly as split() would.
    new = [v * 1.0001 for v in values]
    new[3].view(-1)[:3] = torch.tensor([float("nan"), float("inf"), 3.4e38])
    for m, v in zip(masters, new):
        m.copy_(v)
    bank.split(fns[3])
    for w, r, v in zip(weights, bank.remainders, new):
        hi, lo = split(v)
        assert torch.equal(w.view(torch.int16), hi.view(torch.int16)) and torch.equal(r, lo)
    assert all(m.untyped_storage().nbytes() == 4 and torch.isnan(m).all() for m in masters)  # placeholders again
    assert bank.flat.untyped_storage().nbytes() == 0
    bank.split()  # not joined: nothing happens
    assert bank.valid()
    weights[1].data = weights[1].clone()
    assert not bank.valid()  # a replaced weight: the cached views are stale, the owner rebuilds


def test_the_compilable_forms_equal_the_in_place_ones() -> None:
    """What torch.compile receives computes the same bits (checked eagerly and under aot_eager)."""
    from mixprec._remainder import join_flat_, join_flat_compilable_, split_flat_, split_flat_compilable_

    values, weights, rems, _ = _bank_case([(300,)])
    flat = weights[0].to(torch.float32)
    a, b = flat.clone(), flat.clone()
    join_flat_(a, a.view(torch.int32), rems[0])
    torch.compile(join_flat_compilable_, backend="aot_eager", dynamic=True)(b, rems[0])
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    x = values[0].clone()
    x[:2] = float("nan")
    lo_a, lo_b = torch.empty_like(rems[0]), torch.empty_like(rems[0])
    top_a = split_flat_(x, x.view(torch.int32), lo_a)
    top_b = torch.compile(split_flat_compilable_, backend="aot_eager", dynamic=True)(x, lo_b)
    assert torch.equal(top_a, top_b) and torch.equal(lo_a, lo_b)
    hi, lo = split(x)
    assert torch.equal(top_a.to(torch.int16), hi.view(torch.int16)) and torch.equal(lo_a, lo)


def test_a_bank_refuses_what_it_cannot_view() -> None:
    from mixprec._remainder import RemainderBank

    _, weights, rems, masters = _bank_case([(4, 6), (5,)])
    with pytest.raises(ValueError, match="contiguous"):
        RemainderBank([weights[0].t(), weights[1]], masters, rems)
    with pytest.raises(ValueError, match="parallel"):
        RemainderBank(weights, masters[:1], rems)
