import math

import pytest
import torch

from mixprec.optim import kahan_add_, stochastic_round

from ._util import HALF

N = 100_000


def _neighbours(x: float, dtype: torch.dtype) -> tuple[float, float]:
    t = torch.tensor([x], dtype=torch.float32)
    near = t.to(dtype)
    toward = torch.tensor([math.inf if x >= near.float().item() else -math.inf], dtype=dtype)
    other = torch.nextafter(near, toward)
    a, b = sorted([near.float().item(), other.float().item()])
    return a, b


# (value, dtype): fractions of an ulp from 0.03 to 0.97, both signs, normal and (FP16) subnormal ranges.
CASES = [
    (1.0 + 0.03 * 2**-7, torch.bfloat16),
    (1.0 + 0.37 * 2**-7, torch.bfloat16),
    (-(3.0 + 0.5 * 2**-6), torch.bfloat16),
    (1.234567e-3, torch.bfloat16),
    (-98765.4321, torch.bfloat16),
    (1.0 + 0.9 * 2**-10, torch.float16),
    (-(0.3 + 0.123 * 2**-12), torch.float16),
    (3.1e-6, torch.float16),  # FP16 subnormal
    (-1234.567, torch.float16),
]


@pytest.mark.parametrize("x,dtype", CASES)
def test_stochastic_rounding_is_unbiased_on_the_two_neighbours(x, dtype, device):
    lo, hi = _neighbours(x, dtype)
    x32 = torch.tensor(x, dtype=torch.float32).item()  # the FP32 input actually rounded
    assert lo < x32 < hi
    gen = torch.Generator(device=device).manual_seed(1234)
    r = stochastic_round(torch.full((N,), x32, device=device), dtype, generator=gen)
    assert r.dtype == dtype
    values = set(r.float().unique().tolist())
    assert values == {lo, hi}, f"results {values} are not exactly the two neighbours {lo}, {hi}"
    frac = (x32 - lo) / (hi - lo)
    # The mean of N Bernoulli(frac) choices between lo and hi: standard error (hi-lo)*sqrt(f(1-f)/N).
    sigma = (hi - lo) * math.sqrt(frac * (1 - frac) / N)
    mean = r.double().mean().item()
    assert abs(mean - x32) < 5 * sigma, f"mean {mean} vs {x32}: {abs(mean - x32) / sigma:.1f} sigma"
    # The probability of rounding up is the distance: also a 5-sigma check on the count.
    ups = (r.float() == hi).double().mean().item()
    assert abs(ups - frac) < 5 * math.sqrt(frac * (1 - frac) / N)


@pytest.mark.parametrize("dtype", HALF)
def test_representable_values_are_exact_and_specials_are_kept(dtype, device):
    g = torch.Generator().manual_seed(0)
    exact = (torch.randn(10_000, generator=g) * 100).to(dtype).float().to(device)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan], device=device)
    x = torch.cat([exact, specials])
    r = stochastic_round(x, dtype, generator=torch.Generator(device=device).manual_seed(1)).float()
    assert torch.equal(r[:-1].view(torch.int32), x[:-1].view(torch.int32))  # bit-identical, -0.0 included
    assert torch.isnan(r[-1])


def test_nan_payloads_stay_nan_in_bf16():
    # Bit patterns whose int32 addition with the random bits would wrap around.
    pats = torch.tensor([0x7FFFFFFF, -1, 0x7FFF8001, -32767], dtype=torch.int32)  # -1 is 0xFFFFFFFF
    x = pats.view(torch.float32).repeat(1000)
    assert torch.isnan(x).all()
    r = stochastic_round(x, torch.bfloat16, generator=torch.Generator().manual_seed(0))
    assert torch.isnan(r.float()).all()


@pytest.mark.parametrize("dtype", HALF)
def test_reproducible_from_a_seed(dtype):
    x = torch.randn(1000) * 1e-2
    a = stochastic_round(x, dtype, generator=torch.Generator().manual_seed(7))
    b = stochastic_round(x, dtype, generator=torch.Generator().manual_seed(7))
    c = stochastic_round(x, dtype, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_fp32_target_and_bad_dtype():
    x = torch.randn(5)
    assert stochastic_round(x, torch.float32) is x
    assert stochastic_round(x.double(), "f32").dtype == torch.float32
    with pytest.raises(ValueError, match="only torch.bfloat16, torch.float16 and torch.float32"):
        stochastic_round(x, torch.float64)


@pytest.mark.parametrize("dtype", HALF)
def test_kahan_add_keeps_updates_far_below_half_an_ulp(dtype):
    n = 1000
    p = torch.ones(n, dtype=dtype)
    c = torch.zeros_like(p)
    plain = torch.ones(n, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        kahan_add_(p, c, torch.full((n,), 1e-4), generator=gen)
        plain.add_(torch.full((n,), 1e-4, dtype=dtype))
    # BF16 ulp at 1.0 is 2**-7 (FP16: 2**-10); 1e-4 is below half of either, so the plain add stalls...
    assert torch.equal(plain, torch.ones(n, dtype=dtype))
    # ...while the compensated pair carries 200 * 1e-4 = 0.02 (unbiased: the buffer itself is stored
    # with stochastic rounding, whose noise is 1/256 of a weight ulp per step), and the rounded weight follows.
    total = (p.double() + c.double())
    assert abs(total.mean().item() - (1 + 200 * torch.tensor(1e-4).item())) < 1e-5
    assert (total - 1.02).abs().max().item() < 5e-4
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    assert (p.float() - 1.02).abs().max().item() <= ulp / 2


# ----- counter-based random bits (the optimizers' source of randomness) -----------------------------------
def test_counter_bits_are_a_pure_function_of_seed_step_stream_and_position():
    from mixprec.optim._rounding import counter_bits_for

    whole = counter_bits_for(3, 5, 7, 1000)
    assert torch.equal(whole, counter_bits_for(3, 5, 7, 1000))  # no hidden state
    assert torch.equal(whole[600:], counter_bits_for(3, 5, 7, 400, offset=600))  # a shard gets its positions' bits
    assert whole.dtype == torch.int64 and int(whole.min()) >= 0 and int(whole.max()) < 2**32
    for other in (counter_bits_for(4, 5, 7, 1000), counter_bits_for(3, 6, 7, 1000), counter_bits_for(3, 5, 8, 1000)):
        assert (other == whole).float().mean() < 0.01  # seed, step and stream each change the bits
    # Roughly uniform and decorrelated between neighbouring positions (100k draws: 5-sigma bounds).
    u = counter_bits_for(0, 1, 2, N).double() / 2**32
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / N) ** 0.5
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 5 / N**0.5
    assert abs((u[u.argsort()] - torch.linspace(0, 1, N, dtype=torch.float64)).abs().max().item()) < 0.01  # KS


@pytest.mark.parametrize("x,dtype", CASES)
def test_rounding_with_counter_bits_is_unbiased_on_the_two_neighbours(x, dtype):
    from mixprec.optim._rounding import counter_bits_for

    bits = counter_bits_for(11, 1, 0, N)
    r = stochastic_round(torch.full((N,), x), dtype, bits=bits)
    lo, hi = _neighbours(x, dtype)
    vals = r.float()
    assert bool(((vals == lo) | (vals == hi)).all())
    p = (x - lo) / (hi - lo)
    assert abs((vals == hi).double().mean().item() - p) < 5 * (p * (1 - p) / N) ** 0.5 + 1e-9


@pytest.mark.parametrize("dtype", HALF)
def test_rounding_with_counter_bits_keeps_specials_and_lands_on_neighbours(dtype):
    from mixprec.optim._rounding import counter_bits_for

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * s for s in (1e-30, 1e-6, 1e-3, 1.0, 1e3)]
                  + [torch.tensor([0.0, -0.0, 1.0, -2.0, math.inf, -math.inf, 2.0**-126, 2.0**-14])])
    r = stochastic_round(x, dtype, bits=counter_bits_for(0, 0, 0, x.numel())).float()
    near = x.to(dtype)
    up = torch.nextafter(near, torch.full_like(near, math.inf)).float()
    down = torch.nextafter(near, torch.full_like(near, -math.inf)).float()
    lo = torch.where(near.float() <= x, near.float(), down)
    hi = torch.where(near.float() >= x, near.float(), up)
    assert bool(((r == lo) | (r == hi)).all())
    nan = stochastic_round(torch.tensor([math.nan]), dtype, bits=torch.zeros(1, dtype=torch.int64))
    assert bool(torch.isnan(nan).all())
