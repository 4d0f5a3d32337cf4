"""FP8 in the numerics tools: tensor_stats under a scaling, NumericsMonitor.fp8_stats, trace_nonfinite, check, doctor."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from _fp8_nets import Net as _Net  # tests/_fp8_nets.py
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mixprec import MixedPrecision
from mixprec._fp8 import fp8_modules, revert_linears
from mixprec.numerics import NumericsMonitor, check, fp8_cast_stats, tensor_stats, trace_nonfinite

pytest.importorskip("torchao")


Net = _Net


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(24, 32, generator=g), torch.randint(0, 16, (24,), generator=g)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(-1e5, 1e5, allow_nan=False, width=32), min_size=2, max_size=48),
    dtype=st.sampled_from(["f8e4m3", "f8e5m2"]),
    scaling=st.sampled_from(["tensorwise", "rowwise", 0.25]),
)
def test_tensor_stats_under_a_scaling_counts_what_the_cast_loses(values, dtype, scaling):
    t = torch.tensor(values[: len(values) // 2 * 2]).view(2, -1)
    ts = tensor_stats(t, dtype, scaling=scaling)
    cs = fp8_cast_stats(t, dtype, scaling)
    # Two counts of the same cast: by thresholds (tensor_stats) and by the cast's result (fp8_cast_stats).
    assert (ts.n_underflow, ts.n_subnormal, ts.n_overflow) == (cs.n_flushed, cs.n_subnormal, cs.n_saturated)
    assert ts.scaling == (scaling if isinstance(scaling, str) else "scale=0.25")
    if isinstance(scaling, str):
        assert ts.n_overflow == 0 and ts.absmax <= thresholds_max(dtype) * (1 + 1e-6)


def thresholds_max(dtype: str) -> float:
    return {"f8e4m3": 448.0, "f8e5m2": 57344.0}[dtype]


def test_tensor_stats_scaling_validation():
    x = torch.ones(4)
    with pytest.raises(ValueError, match="FP8 formats"):
        tensor_stats(x, "bf16", scaling="tensorwise")
    with pytest.raises(ValueError, match="scaling="):
        tensor_stats(x, "f8e4m3", scaling="blockwise")
    unscaled = tensor_stats(torch.tensor([1e6, 1.0]), "f8e4m3")
    assert unscaled.n_overflow == 1 and unscaled.scaling == "none"
    scaled = tensor_stats(torch.tensor([1e6, 1.0]), "f8e4m3", scaling="tensorwise")
    assert scaled.n_overflow == 0 and scaled.n_underflow == 1 and "tensorwise scaling" in str(scaled)


def test_monitor_counts_fp8_operands_as_the_recipe_casts_them():
    prec = MixedPrecision("fp8-tensorwise")
    model = _net()
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))  # lr 0: weights stay put
    batch = _batch()
    captured: dict[str, torch.Tensor] = {}
    model.hidden.register_forward_hook(lambda m, a, o, c=captured: c.update(x=a[0].detach()))
    model.hidden.register_full_backward_hook(lambda m, gi, go, c=captured: c.update(go=go[0].detach()))
    with NumericsMonitor(model, every=1, optimizer=opt) as mon:
        for _ in range(2):
            with prec.autocast():
                loss = _loss(model, batch)
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad()
    stats = mon.fp8_stats()
    assert list(stats) == ["inp", "hidden", "head"]
    hid = stats["hidden"]
    direct_x = fp8_cast_stats(captured["x"].to(torch.bfloat16), "f8e4m3", "tensorwise")
    direct_go = fp8_cast_stats(captured["go"], "f8e5m2", "tensorwise")
    # Two identical steps: the counts double, amax and SQNR stay.
    assert hid["input"].numel == 2 * direct_x.numel and hid["input"].n_subnormal == 2 * direct_x.n_subnormal
    assert hid["input"].amax == direct_x.amax and hid["input"].sqnr_db == pytest.approx(direct_x.sqnr_db, abs=1e-6)
    assert hid["grad_output"].dtype == "f8e5m2" and hid["grad_output"].n_flushed == 2 * direct_go.n_flushed
    assert hid["grad_output"].amax == pytest.approx(direct_go.amax, rel=1e-6)
    assert hid["weight"].dtype == "f8e4m3" and hid["weight"].sqnr_db > 25
    assert "grad_output" in mon.fp8_table()
    mon.reset()
    assert mon.fp8_stats() == {}


def test_monitor_fp8_option_measures_a_bf16_model():
    model = _net()
    with NumericsMonitor(model, every=1, fp8="rowwise") as mon:
        _loss(model, _batch()).backward()
    stats = mon.fp8_stats()
    assert list(stats) == ["inp", "hidden", "head"]  # eligible plain linears, under the recipe asked for
    assert stats["inp"]["grad_output"].dtype == "f8e4m3" and "rowwise" in stats["inp"]["grad_output"].scaling
    with pytest.raises(ValueError, match="fp8="):
        NumericsMonitor(model, fp8="e4m3")


def test_trace_names_the_fp8_layer_and_reruns_it_in_fp32_without_fp8():
    model = _net()
    with torch.no_grad():
        model.hidden.weight[3, 7] = float("inf")  # a bad weight in an FP8 layer: its dynamic scale becomes 0
    res = trace_nonfinite(model, _batch(), _loss, "fp8-tensorwise")
    assert res.found and res.phase == "forward" and res.module == "hidden" and res.where == "output"
    assert res.module_type == "MixprecFloat8Linear"
    assert res.fp32_rerun is not None and "FP8 off" in res.fp32_rerun.note
    assert res.fp32_rerun.precision_is_cause is False  # the inf is in the weight: FP32 fails too
    assert fp8_modules(model) == []  # the model itself is untouched
    # A clean model under an FP8 policy traces clean.
    assert not trace_nonfinite(_net(), _batch(), _loss, "fp8-rowwise").found


def test_check_runs_the_fp8_policy_against_fp32():
    model = _net()
    bf16 = check(model, _batch(), "bf16-mixed", _loss)
    fp8 = check(model, _batch(), "fp8-tensorwise", _loss)
    assert fp8.verdict != "fail" and bf16.verdict == "pass"
    # FP8 ran: its outputs are visibly further from FP32 than BF16's, and still close.
    assert 20 < fp8.output_sqnr_db < bf16.output_sqnr_db - 6
    # An FP8-prepared model is checked from its plain FP32 weights (the reference has no FP8 linears).
    prec = MixedPrecision("fp8-tensorwise")
    prepared = copy.deepcopy(model)
    prepared, _ = prec.prepare(prepared, torch.optim.SGD(prepared.parameters(), lr=0.1))
    again = check(prepared, _batch(), "fp8-tensorwise", _loss)
    assert again.output_sqnr_db == pytest.approx(fp8.output_sqnr_db, abs=1e-6)


def test_revert_linears_gives_plain_linears_with_the_same_parameters():
    prec = MixedPrecision("fp8-rowwise")
    model = _net()
    model, _ = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    w = model.inp.weight
    revert_linears(model)
    assert type(model.inp) is nn.Linear and model.inp.weight is w and fp8_modules(model) == []


def test_doctor_shows_the_fp8_table(tmp_path):
    from mixprec.bench import Workload
    from mixprec.cli._doctor import run_doctor

    batches = [_batch(i) for i in range(3)]
    wl = Workload(
        name="tiny", model=_net(), batches=batches, loss_fn=_loss,
        optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.05),
    )
    res = run_doctor(wl, "fp8-tensorwise", steps=2, run_check=False)
    assert res.fp8_plan is not None and res.fp8_plan.fp8_layers == ["inp", "hidden", "head"]
    assert set(res.fp8_stats) == {"inp", "hidden", "head"}
    d = json.loads(json.dumps(res.to_dict()))
    assert d["fp8_plan"]["recipe"] == "tensorwise" and "input" in d["fp8_stats"]["hidden"]
    assert run_doctor(wl, "bf16-mixed", steps=1, run_check=False).fp8_plan is None


def test_trace_explanation_points_an_fp8_layer_to_the_plan():
    from mixprec.numerics import FP32Rerun, TraceResult

    res = TraceResult(found=True, phase="forward", module="blocks.0.fc", module_type="MixprecFloat8Linear",
                      where="output", kind="nan", fp32_rerun=FP32Rerun(True, 3.0, [], True, "re-run"))
    assert "f8_layers=auto" in res.explanation and "i=norm+name:blocks.0.fc" in res.explanation


def test_audit_has_an_fp8_row():
    from mixprec.numerics import audit

    prec = MixedPrecision("fp8-rowwise")
    model = _net()
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rows = [r for r in audit(model, opt, prec).rows if r.detail.startswith("FP8 GEMMs")]
    assert len(rows) == 1 and rows[0].dtype == "f8e4m3" and rows[0].note.startswith("3 of 3 linears")
    assert "emulated" in rows[0].note  # on a CPU
    plain = _net()
    assert not [r for r in audit(plain, None, "bf16-mixed").rows if r.detail.startswith("FP8")]
    nothing = [r for r in audit(plain, None, "fp8-rowwise").rows if r.detail.startswith("FP8")]
    assert nothing[0].status == "note" and "no linear runs in FP8" in nothing[0].note
