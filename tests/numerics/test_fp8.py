"""FP8 numerics (mixprec.numerics._fp8_plan): cast statistics against direct counts, the per-layer plan, the planted outlier."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from _fp8_nets import Net as _Net  # tests/_fp8_nets.py
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mixprec import MixedPrecision, Policy
from mixprec._fp8 import fp8_modules
from mixprec.numerics import Fp8CastStats, Fp8Plan, fp8_cast_stats, fp8_plan
from mixprec.numerics._fp8_plan import fp8_scale, gpu_shape_gains

pytest.importorskip("torchao")

# Format constants written out (not read from torch), so the counts below are independent of the code under test:
# (max, smallest normal, smallest subnormal, the midpoint past the max above which a value rounds out of range).
FORMATS = {"f8e4m3": (448.0, 2.0**-6, 2.0**-9, 464.0), "f8e5m2": (57344.0, 2.0**-14, 2.0**-16, 61440.0)}


def _direct_counts(values: list[float], dtype: str, scale: float) -> tuple[int, int, int]:
    """(saturated, flushed, subnormal) by the format's thresholds under round-to-nearest-even.

    A scaled magnitude flushes when it is at most half the smallest subnormal (the midpoint rounds
    to the even zero); it stays subnormal when it is above that and below the smallest normal less
    half a subnormal step (that midpoint rounds up to the normal).
    """
    fmax, tiny, sub, bound = FORMATS[dtype]
    # The product as the code forms it: FP32 value times FP32 scale, rounded to FP32.
    scaled = (torch.tensor(values, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32)).tolist()
    sat = sum(abs(s) > bound for s in scaled)
    flushed = sum(0 < abs(s) <= sub / 2 for s, v in zip(scaled, values) if v != 0) + sum(
        1 for s, v in zip(scaled, values) if v != 0 and s == 0
    )
    subnormal = sum(sub / 2 < abs(s) < tiny - sub / 2 for s in scaled)
    return sat, flushed, subnormal


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.one_of(finite, st.sampled_from([0.0, 1e-30, -3e-7, 5e5])), min_size=1, max_size=64),
    dtype=st.sampled_from(sorted(FORMATS)),
    fixed=st.one_of(st.none(), st.sampled_from([1.0, 2.0**-4, 1024.0])),
)
def test_cast_stats_match_direct_counts(values, dtype, fixed):
    t = torch.tensor(values, dtype=torch.float32)
    amax = max(abs(v) for v in t.tolist())
    fmax = FORMATS[dtype][0]
    scale = fixed if fixed is not None else fmax / max(amax, 1e-12)
    # The tensorwise scale: written out here as torchao's formula (fp8 max over amax, floored at 1e-12), in FP32.
    if fixed is None:
        scale = float(torch.tensor(fmax / max(amax, 1e-12), dtype=torch.float32))
        assert float(fp8_scale(t, dtype)) == scale
    stats = fp8_cast_stats(t, dtype, "tensorwise" if fixed is None else fixed)
    sat, flushed, subnormal = _direct_counts(t.tolist(), dtype, scale)
    assert (stats.n_saturated, stats.n_flushed, stats.n_subnormal, stats.n_nonfinite) == (sat, flushed, subnormal, 0)
    assert stats.numel == len(values) and stats.amax == pytest.approx(amax, rel=0, abs=0)
    if fixed is None:
        assert stats.n_saturated == 0  # dynamic scaling puts amax on the format's maximum
    # SQNR of the round trip against a float64 computation of the same de-scaled values.
    ref = t.double()
    q = (t * scale).clamp(-fmax, fmax).to(getattr(torch, {"f8e4m3": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}[dtype]))
    err = (ref - (q.float() / torch.tensor(scale, dtype=torch.float32)).double()).square().sum().item()
    sig = ref.square().sum().item()
    if err == 0:
        assert stats.sqnr_db == math.inf
    elif sig > 0:
        assert stats.sqnr_db == pytest.approx(10 * math.log10(sig / err), abs=1e-6)


def test_rowwise_scale_is_torchaos():
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 48, generator=g) * torch.logspace(-3, 3, 8).unsqueeze(1)
    for dim in (-1, 0):
        ours = fp8_scale(x, "f8e4m3", "rowwise", dim)
        theirs = tensor_to_scale(
            x, torch.float8_e4m3fn, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
            round_scales_to_power_of_2=True,
        )
        assert torch.equal(ours, theirs)
    assert torch.equal(fp8_scale(x, "f8e5m2"), tensor_to_scale(x, torch.float8_e5m2))


def test_cast_stats_nonfinite_and_rowwise_flush():
    x = torch.ones(4, 16)
    x[0, 0] = 1e6  # one huge value: tensorwise flushes the rest, rowwise only its own row
    tw = fp8_cast_stats(x, "f8e4m3", "tensorwise")
    rw = fp8_cast_stats(x, "f8e4m3", "rowwise")
    assert tw.n_flushed == 63 and tw.frac_flushed == pytest.approx(63 / 64)
    assert rw.n_flushed == 15 and rw.n_subnormal == tw.n_subnormal == 0
    x[1, 1] = float("inf")
    assert fp8_cast_stats(x).n_nonfinite == 1
    rt = Fp8CastStats.from_dict(json.loads(json.dumps(tw.to_dict())))
    assert rt == tw
    assert "flushed 98.44%" in str(tw)
    with pytest.raises(ValueError, match="f8e4m3 or f8e5m2"):
        fp8_cast_stats(x, "bf16")
    with pytest.raises(ValueError, match="positive and finite"):
        fp8_cast_stats(x, "f8e4m3", -1.0)


def test_gpu_shape_gate_is_torchaos_rule():
    assert not gpu_shape_gains("tensorwise", 768, 768) and gpu_shape_gains("tensorwise", 768, 3072)
    assert not gpu_shape_gains("rowwise", 768, 3072) and gpu_shape_gains("rowwise", 4096, 4096)


# ----- the planted outlier --------------------------------------------------------------------------------


class Planted(_Net):
    """``inp`` sees an input with a few huge values (per batch, two elements of 1e6); the rest is N(0, 1)."""


_W_TRUE = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))


def _planted_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(64, 32, generator=g)
    y = (x @ _W_TRUE).argmax(-1)
    x[torch.randint(0, 64, (2,), generator=g), torch.randint(0, 32, (2,), generator=g)] = 1e6
    return x, y


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _planted() -> Planted:
    torch.manual_seed(0)
    return Planted()


def _train(policy: Policy | str, steps: int = 40) -> tuple[float, nn.Module]:
    model = _planted()
    prec = MixedPrecision(policy)
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    losses = []
    for i in range(steps):
        b = _planted_batch(i)
        with prec.autocast():
            loss = _loss(model, b)
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad()
        losses.append(loss.item())
    return sum(losses[-8:]) / 8, model


def test_plan_keeps_the_outlier_layer_in_bf16_and_says_why():
    model = _planted()
    before = copy.deepcopy(model.state_dict())
    plan = fp8_plan(model, _planted_batch(0), _loss, "tensorwise")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # measured on a copy
    assert all(p.grad is None for p in model.parameters())
    by = {d.name: d for d in plan.layers}
    assert plan.fp8_layers == ["hidden", "head"]
    inp = by["inp"]
    assert not inp.fp8 and inp.sqnr_db["output"] < 5
    assert inp.reason.startswith("output GEMM SQNR") and "input amax 9.99e+05" in inp.reason and "tensorwise" in inp.reason
    assert inp.operands["input"].frac_flushed > 0.9 and inp.operands["input"].n_saturated == 0
    assert by["hidden"].sqnr_db["output"] > 25 and by["hidden"].operands["input"].frac_flushed == 0
    assert inp.flops == 6 * 64 * 32 * 64 and inp.tokens == 64
    assert "BF16 output GEMM SQNR" in plan.table() and str(plan) == plan.table()
    # Rowwise scales each token on its own: the forward survives, the weight-gradient GEMM (scaled along tokens) does not.
    rw = fp8_plan(model, _planted_batch(0), _loss, "rowwise")
    assert rw.fp8_layers == ["hidden", "head"]
    assert {d.name: d for d in rw.layers}["inp"].reason.startswith("grad_weight GEMM")
    assert {d.name: d for d in rw.layers}["inp"].sqnr_db["output"] > 25
    # rowwise_gw_hp keeps that GEMM in BF16: everything may run in FP8.
    assert fp8_plan(model, _planted_batch(0), _loss, "rowwise_gw_hp").fp8_layers == ["inp", "hidden", "head"]


def test_forcing_the_outlier_layer_to_fp8_hurts_the_loss():
    plan = fp8_plan(_planted(), _planted_batch(0), _loss, "tensorwise")
    ref, _ = _train("bf16-mixed")
    planned, model = _train(plan.policy())
    forced, forced_model = _train("fp8-tensorwise")
    assert [n for n, _ in fp8_modules(model)] == ["hidden", "head"]
    assert [n for n, _ in fp8_modules(forced_model)] == ["inp", "hidden", "head"]
    assert abs(planned - ref) < 0.05, (planned, ref)  # measured 0.003
    assert forced > planned + 0.3, (forced, planned)  # measured 2.66 vs 1.96


def test_plan_serialises_and_is_accepted_by_the_policy(tmp_path):
    plan = fp8_plan(_planted(), _planted_batch(0), _loss, "rowwise")
    plan.save(tmp_path / "plan.json")
    back = Fp8Plan.load(tmp_path / "plan.json")
    assert back == plan
    pol = plan.policy("bf16-mixed")
    assert (pol.fp8, pol.fp8_layers) == ("rowwise", ("hidden", "head"))
    assert Policy.parse(str(pol)) == pol
    assert Policy.parse(str(pol)).label == str(pol)
    with pytest.raises(ValueError, match="version"):
        Fp8Plan.from_dict({**plan.to_dict(), "version": 99})
    # A plan without FP8 layers is a policy with f8_layers=none.
    empty = Fp8Plan("tensorwise", 20.0, False, "cpu", tuple(d for d in plan.layers if not d.fp8))
    assert empty.policy().fp8_layers == () and "f8_layers=none" in str(empty.policy())


def test_plan_sqnr_agrees_with_torchaos_fp8_linear():
    """The plan's emulated forward GEMM has the SQNR of torchao's own Float8Linear on the same input."""
    model = _planted()
    batch = _planted_batch(3)
    for recipe in ("tensorwise", "rowwise"):
        plan = fp8_plan(model, batch, _loss, recipe)
        hidden = {d.name: d for d in plan.layers}["hidden"]
        m = copy.deepcopy(model)
        MixedPrecision(Policy.parse(f"p=f32,c=bf16,f8={recipe}")).prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
        captured: dict[str, torch.Tensor] = {}
        m.hidden.register_forward_hook(lambda mod, a, out, c=captured: c.update(x=a[0].detach(), y=out.detach()))
        m.requires_grad_(False)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            m(batch[0])
        x = captured["x"].to(torch.bfloat16).float()
        ref = x @ m.hidden.weight.to(torch.bfloat16).float().T  # the BF16 GEMM (bias left out of both)
        got = captured["y"].float() - m.hidden.bias.to(torch.bfloat16).float()
        sqnr = 10 * math.log10(float(ref.square().sum() / (ref - got).square().sum()))
        assert sqnr == pytest.approx(hidden.sqnr_db["output"], abs=2.0), recipe


def test_plan_validates_arguments():
    with pytest.raises(ValueError, match="unknown FP8 recipe"):
        fp8_plan(_planted(), _planted_batch(0), _loss, "blockwise")
    with pytest.raises(ValueError, match="threshold_db"):
        fp8_plan(_planted(), _planted_batch(0), _loss, threshold_db=0)
    with pytest.raises(TypeError, match="nn.Module"):
        fp8_plan(lambda x: x, _planted_batch(0), _loss)  # type: ignore[arg-type]
    x = _planted_batch(0)[0]
    plan = fp8_plan(_planted(), x, None, "tensorwise", layers=["hid*"])
    assert [d.name for d in plan.layers] == ["hidden"]
