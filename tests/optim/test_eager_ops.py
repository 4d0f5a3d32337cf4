"""The eager (uncompiled) step: a constant number of aten ops per step whatever the number of tensors (issue 27).

Also the pieces that make it cheap while keeping its bits: the int32 form of the counter hash, the
``where``-free stochastic rounding, the bit-select skip, and the cached layout's invalidation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec.optim as mo
from mixprec.bench._step_cost import StepCounter, gpt_model
from mixprec.optim._base import _unless_skipped
from mixprec.optim._rounding import (
    _FORMATS,
    _sr_counter_eager,
    counter_bits,
    counter_bits32,
    counter_bits_for,
    stochastic_round,
    to_int32_lanes,
)

from ._util import assert_bit_identical, snapshot

CASES = [(cls, comp) for cls in ("adamw", "sgd") for comp in ("kahan", "stochastic")]


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _optimizer(cls: str, comp: str, params, **kw) -> mo.LowPrecisionOptimizer:
    sdt = torch.float32 if comp == "kahan" else torch.bfloat16  # stochastic + BF16 states: the most random streams
    if cls == "sgd":
        return mo.SGD(params, lr=1e-2, momentum=0.9, compensation=comp, state_dtype=sdt, fused=False, seed=0, **kw)
    return mo.AdamW(params, lr=1e-3, compensation=comp, state_dtype=sdt, fused=False, seed=0, **kw)


def _ops_per_step(n_layer: int, cls: str, comp: str, found_inf: bool) -> tuple[int, int, StepCounter]:
    model = gpt_model(n_layer).to(torch.bfloat16)
    params = list(model.parameters())
    opt = _optimizer(cls, comp, params)
    kw = {"found_inf": torch.zeros(())} if found_inf else {}
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # the first step builds states and the cached layout
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step(**kw)
    counter = StepCounter((opt,))
    with counter:
        opt.step(**kw)
    return counter.total, len(params), counter


@pytest.mark.parametrize("found_inf", [False, True], ids=["plain", "found_inf"])
@pytest.mark.parametrize(("cls", "comp"), CASES)
def test_eager_step_ops_do_not_grow_with_the_number_of_tensors(cls, comp, found_inf):
    small, n_small, _ = _ops_per_step(2, cls, comp, found_inf)
    large, n_large, counter = _ops_per_step(6, cls, comp, found_inf)
    assert n_large >= 2 * n_small  # 29 vs 77 tensors
    # Both models fit one tile: the count is the same, not 3x (before issue 27: +12 ops per tensor,
    # 455 vs 1,031 for AdamW + Kahan: per-tensor view, expand and slice ops).
    assert large == small, (small, large)
    assert large < 300, counter.ops
    assert counter.host_reads == 0
    per_tensor = counter.ops["view"] + counter.ops["expand"] + counter.ops["slice"]
    assert per_tensor < n_large // 2, counter.ops


def test_eager_ops_grow_with_tiles_not_tensors():
    """Same elements in 8 or in 32 tensors, several tiles (small chunk_numel): the op counts are equal."""

    def ops(n_tensors: int) -> int:
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(4096 // n_tensors).to(torch.bfloat16)) for _ in range(n_tensors)]
        opt = _optimizer("adamw", "kahan", params, chunk_numel=1024)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step(found_inf=torch.zeros(()))
        counter = StepCounter((opt,))
        with counter:
            opt.step(found_inf=torch.zeros(()))
        return counter.total

    assert ops(8) == ops(32)  # 4 packed tiles of 1024 elements either way (2 or 8 tensors each)


# ----- bits ------------------------------------------------------------------------------------------------
def test_counter_bits32_equals_counter_bits():
    g = torch.Generator().manual_seed(0)
    ka = torch.randint(0, 2**32, (1000,), generator=g, dtype=torch.int64)
    kb = torch.randint(0, 2**32, (1000,), generator=g, dtype=torch.int64)
    index = torch.cat([torch.arange(500), torch.randint(0, 2**31, (500,), generator=g)])
    want = counter_bits(ka, kb, index)
    got = counter_bits32(to_int32_lanes(ka), to_int32_lanes(kb), index.to(torch.int32))
    assert got.dtype == torch.int32
    assert torch.equal(got.to(torch.int64) & 0xFFFFFFFF, want)


def _sr_where(x: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor) -> torch.Tensor:
    """The compiled step's formulation of counter-bit stochastic rounding (three ``where``), for reference."""
    mant, tiny, sub = _FORMATS[dtype]
    near = x.to(dtype)
    n32 = near.float()
    diff = x - n32
    a = n32.abs()
    step = torch.where(a < tiny, sub, a * (0.6 * 2.0**-mant))
    other = n32 + torch.where(diff >= 0, step, -step)
    if dtype == torch.bfloat16:
        other = torch.copysign(other, x)
    other = other.to(dtype)
    span = (other.float() - n32).abs()
    if dtype == torch.bfloat16:
        u = (bits >> 16).to(torch.float32) * 2.0**-16
        take = torch.where(a <= x.abs(), (1.0 - u) * span <= diff.abs(), u * span < diff.abs())
    else:
        take = (bits >> 8).to(torch.float32) * 2.0**-24 * span < diff.abs()
    return torch.where(take, other, near)


def _sr_bf16_int64(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """BF16's rule in int64 on the bit pattern, written from its definition: add the upper 16 random bits
    to the magnitude's pattern and cut the lower 16, except from the largest finite value's bucket up."""
    pattern = x.view(torch.int32).to(torch.int64)
    sign, mag = pattern & (1 << 31), pattern & 0x7FFFFFFF
    cut = ((mag + (bits >> 16)) >> 16) << 16
    out32 = torch.where(mag < 0x7F7F0000, (sign | cut), pattern)
    out32 = ((out32 ^ (1 << 31)) - (1 << 31)).to(torch.int32)  # back to the signed 32-bit pattern
    return out32.view(torch.float32).to(torch.bfloat16)  # exact where cut, to nearest from the top bucket up


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_eager_stochastic_rounding_equals_the_where_form_bit_for_bit(dtype):
    mant, tiny, sub = _FORMATS[dtype]
    fmax = torch.finfo(dtype).max
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), tiny, -tiny, tiny * 1.3,
                             tiny * 1.7, tiny * 0.999, sub, sub * 0.5, sub * 1.5, -sub * 0.7, fmax, -fmax,
                             fmax * 1.001, fmax * 0.999, 1.0, -1.0, 2.0, 0.5, 65520.0, 3e38, -3.4e38])
    g = torch.Generator().manual_seed(1)
    n = 20_000
    xs = [specials.repeat(200), torch.randn(n, generator=g), torch.randn(n, generator=g) * tiny * 4,
          torch.randn(n, generator=g) * sub * 8, (torch.rand(n, generator=g) * 2 - 1) * fmax * 1.01,
          torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32).view(torch.float32)]  # any pattern
    # Every upper half of the FP32 pattern (every BF16 value, sign, binade edge, subnormal, inf, NaN) with
    # the lower halves that decide a rounding: exact, just above, just below and at the tie, just above it.
    upper = torch.arange(-2**15, 2**15, dtype=torch.int32).mul_(2**16)
    xs += [(upper + low).view(torch.float32) for low in (0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF)]
    for x in xs:
        bits = torch.randint(0, 2**32, x.shape, generator=g, dtype=torch.int64)
        want = _sr_where(x, dtype, bits).view(torch.int16)
        if dtype == torch.bfloat16:
            assert torch.equal(_sr_bf16_int64(x, bits).view(torch.int16), want)
        assert torch.equal(_sr_counter_eager(x, dtype, bits).view(torch.int16), want)
        assert torch.equal(_sr_counter_eager(x, dtype, to_int32_lanes(bits)).view(torch.int16), want)
        assert torch.equal(stochastic_round(x, dtype, bits=bits).view(torch.int16), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lanes", [torch.int64, torch.int32])
def test_stochastic_rounding_broadcasts_its_bits(dtype, lanes):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 33, generator=g)
    row = torch.randint(0, 2**32, (33,), generator=g, dtype=torch.int64)
    bits = row if lanes == torch.int64 else to_int32_lanes(row)
    got = stochastic_round(x, dtype, bits=bits)
    assert torch.equal(got.view(torch.int16), stochastic_round(x, dtype, bits=bits.expand(64, 33)).view(torch.int16))
    assert torch.equal(got.view(torch.int16), _sr_where(x, dtype, row.expand(64, 33)).view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_stochastic_rounding_equals_the_eager_bit_form_on_every_upper_pattern(dtype):
    """The traced (float) form, as Inductor compiles it into the fused step, against the eager (bit) form."""
    upper = torch.arange(-2**15, 2**15, dtype=torch.int32).mul_(2**16)
    g = torch.Generator().manual_seed(2)
    x = torch.cat([(upper + low).view(torch.float32) for low in (0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF)]
                  + [torch.randint(-2**31, 2**31 - 1, (2**16,), generator=g, dtype=torch.int32).view(torch.float32)])
    bits = to_int32_lanes(torch.randint(0, 2**32, x.shape, generator=g, dtype=torch.int64))
    torch._dynamo.reset()
    from mixprec.optim._fused_step import _eager_division_options

    # The fused step's options: without emulate_precision_casts Inductor elides the half round trips.
    options = {"emulate_precision_casts": True, **_eager_division_options()}
    compiled = torch.compile(lambda v, b: stochastic_round(v, dtype, bits=b), fullgraph=True, options=options)
    assert torch.equal(compiled(x, bits).view(torch.int16), stochastic_round(x, dtype, bits=bits).view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("skip", [False, True])
def test_bit_select_skip_equals_where(dtype, skip):
    old = torch.tensor([1.0, -0.0, float("nan"), float("inf"), 3.5, 0.0], dtype=dtype)
    new = torch.tensor([2.0, 0.0, 1.0, float("nan"), -0.0, float("-inf")], dtype=dtype)
    flag = torch.tensor(skip)
    want = torch.where(flag, old, new)
    got = _unless_skipped(flag, old, new.clone(), {})
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("offset", [0, 2**31 - 100, 2**33 + 7])
def test_random_bits_follow_the_global_index_in_both_lanes(offset):
    """int32 lanes below 2**31, int64 lanes from there: the bits of counter_bits_for at the element's global index."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(300).to(torch.bfloat16))
    w0 = p.detach().float().clone()
    opt = mo.SGD([p], lr=0.1, compensation="stochastic", seed=5, fused=False)
    opt._set_global_offsets({p: offset})
    p.grad = torch.randn(300).to(torch.bfloat16)
    opt.step()
    expected = stochastic_round(w0 - p.grad.float() * 0.1, torch.bfloat16,
                                bits=counter_bits_for(5, 0, 0, 300, offset=offset))
    assert torch.equal(p.detach().view(torch.int16), expected.view(torch.int16))


# ----- the cached layout -----------------------------------------------------------------------------------------
def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    shapes = [(7, 5), (), (13,), (0,), (300, 20), (3, 4, 5), (600,)]
    ps = [nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in shapes]
    ps.insert(2, nn.Parameter(torch.randn(9, 6).to(torch.bfloat16).t()))  # non-contiguous
    return ps


def _run(opt, params, steps, *, swap_at=None, skip_at=None):
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        if step == swap_at:
            for p in params:
                p.data = p.data.clone()  # new storage: the cached views must be rebuilt
        opt.step(found_inf=torch.tensor(float(step == skip_at)))


@pytest.mark.parametrize(("cls", "comp"), CASES)
def test_tiling_does_not_change_the_bits(cls, comp):
    """Many tiles (slices and packed tensors, a non-contiguous and a 0-d one) equal one tile bit for bit."""
    a, b = _params(), _params()
    opt_a = _optimizer(cls, comp, a)
    opt_b = _optimizer(cls, comp, b, chunk_numel=100)
    _run(opt_a, a, 4, skip_at=2)
    _run(opt_b, b, 4, skip_at=2)
    assert_bit_identical(snapshot(opt_a), snapshot(opt_b))


def test_swapped_parameter_storage_and_loaded_state_rebuild_the_layout():
    a, b = _params(), _params()
    opt_a = _optimizer("adamw", "kahan", a)
    opt_b = _optimizer("adamw", "kahan", b)
    _run(opt_a, a, 4)
    _run(opt_b, b, 4, swap_at=2)
    assert_bit_identical(snapshot(opt_a), snapshot(opt_b))
    # load_state_dict replaces every state tensor: the next step writes into the new ones.
    c = [nn.Parameter(p.detach().clone()) for p in a]
    opt_c = _optimizer("adamw", "kahan", c)
    opt_c.load_state_dict(opt_a.state_dict())
    _run(opt_a, a, 2)
    _run(opt_c, c, 2)
    assert_bit_identical(snapshot(opt_a), snapshot(opt_c))
