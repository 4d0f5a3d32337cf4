"""Regression tests of the numerics diagnosis: doctor, the monitor, check, trace_nonfinite.

Each test pins a case where the diagnosis was wrong: it blamed FP16 for an FP32 divergence, missed
BF16 stagnation of half-precision weights, passed a loss scale below the scaler's floor, printed an
FP16 policy without the island the check found necessary, ...
"""

from __future__ import annotations

import copy
import math
import re
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision, NumericsError
from mixprec.numerics import NumericsMonitor, check, preflight

# ----- 1. doctor on a run that diverges in FP32 itself ---------------------------------------------------------
DIVERGING_MODULE = '''
import torch
import torch.nn.functional as F
from torch import nn


def batches():
    g = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)


def make(lr=3.0):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    return (m, lambda p: torch.optim.SGD(p, lr=float(lr)), batches(), lambda m, b: F.mse_loss(m(b[0]).float(), b[1]))
'''


def _fp32_losses(lr: float, steps: int) -> list[float]:
    """The plain-torch FP32 reference of DIVERGING_MODULE's workload."""
    ns: dict[str, object] = {}
    exec(textwrap.dedent(DIVERGING_MODULE), ns)
    model, opt_fn, batches, loss_fn = ns["make"](lr)  # type: ignore[operator]
    opt = opt_fn(model.parameters())
    losses = []
    for _, b in zip(range(steps), batches):
        loss = loss_fn(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_fp32_divergence_is_recognised_from_the_losses() -> None:
    from mixprec.numerics._findings import fp32_divergence

    assert fp32_divergence([0.69, 14.9, 1.2e5, 2e17]) == "the loss grew from 0.69 to 1.2e+05 by step 2"
    assert "became nan at step 1" in (fp32_divergence([0.5, float("nan")]) or "")
    assert fp32_divergence([0.69, 0.6, 0.55, 0.7]) is None
    assert fp32_divergence([7e4, 6e4, 5e4]) is None  # large but not growing: not a divergence
    assert fp32_divergence([]) is None


def test_doctor_says_the_fp32_run_diverged_instead_of_blaming_fp16(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mixprec.cli import main

    assert not all(math.isfinite(v) for v in _fp32_losses(3.0, 6))  # the FP32 reference itself diverges
    path = tmp_path / "diverging.py"
    path.write_text(textwrap.dedent(DIVERGING_MODULE))
    code = main(["doctor", f"{path}:make", "-p", "fp16-mixed", "--steps", "6", "--no-plot", "--out", str(tmp_path),
                 "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 1, out  # a failed run
    assert "The monitored FP32 run itself diverged: the loss grew from 0.693 to" in out
    assert "not a precision problem" in out
    assert "Recommended preset: none: the FP32 run itself diverged" in out
    # no precision advice from a diverging model's statistics
    assert "FP16 loss-scale range" not in out and "recommended static scale" not in out
    assert "FP16 policy:" not in out and "Recommended bf16-mixed" not in out and "beyond the FP16 maximum" not in out


def test_doctor_leaves_a_healthy_run_alone() -> None:
    from mixprec.bench import Workload
    from mixprec.cli._doctor import run_doctor

    ns: dict[str, object] = {}
    exec(textwrap.dedent(DIVERGING_MODULE), ns)
    model, opt_fn, batches, loss_fn = ns["make"](0.01)  # type: ignore[operator]
    w = Workload(name="ok", model=model, optimizer_fn=opt_fn, batches=[next(batches) for _ in range(3)], loss_fn=loss_fn)
    res = run_doctor(w, "bf16-mixed", steps=3, device="cpu")
    assert res.losses == pytest.approx(_fp32_losses(0.01, 3), rel=1e-5)  # the FP32 reference, finite
    assert res.report.fp32_diverged is None and res.report.recommended_preset == "bf16-mixed"


# ----- 2. BF16 stagnation of weights stored in BF16 ------------------------------------------------------------
def _stagnation_run(policy: str) -> tuple[float, int, int]:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    with torch.no_grad():
        for p in base.parameters():
            p.add_(torch.sign(p) * 4)  # |w| in [4, 8): half a BF16 ulp is 2**-7, far above lr * grad
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)
    prec = MixedPrecision(policy)
    m = copy.deepcopy(base)
    m, opt = prec.prepare(m, torch.optim.SGD(m.parameters(), lr=1e-4))
    w0 = [p.detach().float().clone() for p in m.parameters()]
    with NumericsMonitor(m, optimizer=opt, policy=prec.policy) as mon:
        for i in range(4):
            with prec.autocast():
                loss = F.mse_loss(m(x[i * 16:(i + 1) * 16]).float(), y[i * 16:(i + 1) * 16])
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad()
    moved = sum(int((p.detach().float() != w).sum()) for p, w in zip(m.parameters(), w0))
    return mon.report().stagnation["bf16"], moved, sum(w.numel() for w in w0)


def test_monitor_sees_stagnation_of_weights_stored_in_bf16() -> None:
    fp32_stag, fp32_moved, n = _stagnation_run("fp32")
    assert fp32_moved > 0.99 * n and fp32_stag > 0.99  # FP32 run: they move, by less than half a BF16 ulp
    bf16_stag, bf16_moved, n = _stagnation_run("bf16-true")
    assert bf16_moved == 0  # plain fact: no BF16 weight changed
    assert bf16_stag == 1.0  # was 0% (only changed elements were counted)


def test_monitor_does_not_count_a_skipped_half_step_as_stagnation() -> None:
    class SkippingSGD(torch.optim.SGD):
        """A step a loss scaler skipped (a non-finite gradient): the weights stay as they were."""

        def step(self, closure: object = None) -> None:  # type: ignore[override]
            return None

    torch.manual_seed(0)
    m = nn.Linear(4, 4).to(torch.bfloat16)
    opt = SkippingSGD(m.parameters(), lr=0.1)
    with NumericsMonitor(m, optimizer=opt) as mon:
        m(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
        assert m.weight.grad is not None
        m.weight.grad[0, 0] = float("inf")
        opt.step()
    rep = mon.report()
    assert rep.stagnation["bf16"] == 0.0 and all(p.updated == 0 for p in rep.params)


# ----- 3. check() stops at the dynamic scaler's floor ----------------------------------------------------------
def _overflows_at_scale_1() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 4))
    with torch.no_grad():
        m[0].weight.mul_(1e-3)
        m[1].weight.mul_(2000)
    return m


def _big_loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
    return m(b).float().sum() * 50


def test_check_does_not_back_off_below_the_scalers_floor() -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    model = _overflows_at_scale_1()
    r = check(model, x, "fp16-mixed", _big_loss)
    assert r.verdict == "fail" and r.loss_scale == 1.0 and r.backoffs == 16  # 2**16 -> 1, DynamicScaler's floor
    assert "overflow even at the dynamic loss scale's floor 1" in r.reasons[0] and "bf16" in r.reasons[0]
    # what training does at that floor: every step skipped
    prec = MixedPrecision("fp16-mixed")
    mm = copy.deepcopy(model)
    mm, opt = prec.prepare(mm, torch.optim.SGD(mm.parameters(), lr=1e-6))
    skipped = 0
    for _ in range(3):
        with prec.autocast():
            loss = _big_loss(mm, x)
        prec.backward(loss)
        skipped += int(prec.step(opt).skipped)
        opt.zero_grad()
    assert skipped == 3
    # a scaler of one's own with a lower floor: the check may go there
    low = check(model, x, "fp16-mixed", _big_loss, min_scale=2.0**-8)
    assert low.finite and low.loss_scale < 1.0
    m2 = copy.deepcopy(model)
    with pytest.raises(NumericsError, match=re.escape("overflow even at the dynamic loss scale's floor 1")):
        MixedPrecision("fp16-mixed").prepare(m2, torch.optim.SGD(m2.parameters(), lr=1e-6),
                                             check_batch=x, loss_fn=_big_loss, on_check_fail="raise")


# ----- 8. the hint names the caller's argument --------------------------------------------------------------------
def test_the_raise_hint_names_the_callers_argument() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 4))
    with torch.no_grad():
        m[0].weight.mul_(1e5)  # FP16 forward overflow
    b = (torch.randn(8, 8), torch.randint(0, 4, (8,)))

    def lossf(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(b[0]).float(), b[1])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(NumericsError, match=re.escape("or pass on_check_fail='warn' to prepare() to train anyway")):
            MixedPrecision("fp16-mixed").prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), check_batch=b,
                                                 loss_fn=lossf, on_check_fail="raise")
        with pytest.raises(NumericsError, match=re.escape("or pass on_fail='warn' to train anyway")):
            preflight(m, b, "fp16-mixed", lossf, on_fail="raise")


# ----- 4. doctor's FP16 policy carries the island the check found necessary ---------------------------------------
class _Attn(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)  # unscaled: overflows FP16 inside, finite after softmax
        return self.o(scores.softmax(-1) @ self.v(x))


class _AttnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.attn, self.head = nn.Linear(8, 32), _Attn(), nn.Linear(32, 4)
        with torch.no_grad():
            self.attn.q.weight.mul_(80)
            self.attn.k.weight.mul_(80)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.emb(x)).mean(1))


def _cls_loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(m(b[0]).float(), b[1])


def test_doctor_fp16_policy_includes_the_island_the_check_needed() -> None:
    from mixprec.bench import Workload
    from mixprec.cli._doctor import run_doctor

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, 8, generator=g) * 3, torch.randint(0, 4, (4,), generator=g)) for _ in range(2)]
    model = _AttnNet()
    assert check(model, batches[0], "fp16-mixed", _cls_loss).verdict == "fail"  # the island is needed
    w = Workload(name="attn", model=model, optimizer_fn=lambda p: torch.optim.SGD(p, lr=1e-3), batches=batches,
                 loss_fn=_cls_loss)
    res = run_doctor(w, "fp16-mixed", steps=2, device="cpu")
    assert res.check.trace.recommended_island == "name:attn"
    assert "name:attn" in res.report.recommended_islands
    assert res.report.fp16_policy is not None and "i=norm+name:attn" in res.report.fp16_policy
    assert "FP32 islands for FP16: name:attn." in "\n".join(res.report.summary_lines())
    # the printed policy works: it passes the check the preset failed, as the island the trace named does
    assert check(model, batches[0], res.report.fp16_policy, _cls_loss).verdict in ("pass", "warn")


# ----- 5. a layer whose FP16 gradients flush entirely is named ---------------------------------------------------
def test_monitor_names_a_layer_whose_fp16_gradients_are_all_zero() -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)

    def lf(m: nn.Module) -> torch.Tensor:
        return F.mse_loss(m(x).float(), y) * 1e-6  # gradients far below FP16's smallest subnormal in layer 0

    ref = copy.deepcopy(base)
    lf(ref).backward()
    assert ref[0].weight.grad is not None and bool((ref[0].weight.grad != 0).all())  # FP32: layer 0 has gradients
    prec = MixedPrecision("fp16-pure")  # static scale 1
    m = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        m, opt = prec.prepare(m, torch.optim.SGD(m.parameters(), lr=1.0))
    with NumericsMonitor(m, optimizer=opt, loss_scale=prec, policy=prec.policy) as mon:
        for _ in range(2):
            with prec.autocast():
                loss = lf(m)
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad()
    rep = mon.report()
    assert {p.name: p.grad_zero for p in rep.params}["0.weight"] == 1.0
    finding = next(f for f in rep.findings if f.startswith("Gradients computed in FP16 are largely exact zeros"))
    assert "every value zero in 0.weight, 0.bias: these weights never train" in finding


# ----- 6. trace_nonfinite leaves the RNG as it found it -----------------------------------------------------------
def test_trace_nonfinite_leaves_the_global_rng_alone() -> None:
    from mixprec.numerics import trace_nonfinite

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Linear(32, 4))
    b = (torch.randn(16, 8), torch.randint(0, 4, (16,)))
    for kwargs in ({"policy": "bf16-mixed"}, {"copy_model": False}):
        state = torch.get_rng_state()
        cuda_state = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        trace_nonfinite(m, b, _cls_loss, **kwargs)
        assert torch.equal(state, torch.get_rng_state()), kwargs
        if cuda_state is not None:
            assert all(torch.equal(a, c) for a, c in zip(cuda_state, torch.cuda.get_rng_state_all()))


# ----- 7. FP8 underflow advice -----------------------------------------------------------------------------------
def test_check_advises_per_layer_fp8_choices_not_a_loss_scale() -> None:
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    x[3, 4], x[10, 2] = 1e6, -1e6  # outliers: per-tensor scaling flushes the rest
    b = (x, torch.randint(0, 16, (64,)))
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    r = check(m, b, "fp8-tensorwise", _cls_loss)
    if r.grad_lost is None or r.grad_lost <= 0.1:
        pytest.skip(f"this torchao/CPU combination flushed {r.grad_lost} of the gradients: no underflow to advise on")
    reason = next(x for x in r.reasons if "gradient elements are zero" in x)
    assert "f8_layers=auto" in reason and "fp8-rowwise" in reason and "keep those layers in BF16" in reason
    assert "larger loss scale" not in reason
    assert check(m, b, "bf16-mixed", _cls_loss).verdict == "pass"  # BF16 without FP8 is fine


# ----- 9. trace_nonfinite names a parameter or buffer that was already non-finite ----------------------------------
def test_trace_names_a_parameter_or_buffer_already_nonfinite() -> None:
    from mixprec.numerics import trace_nonfinite

    torch.manual_seed(0)
    b = (torch.randn(8, 8), torch.randint(0, 4, (8,)))
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        m[2].weight[1, 3] = float("nan")
    t = trace_nonfinite(m, b, _cls_loss, "fp16-mixed")
    assert t.found and t.nonfinite_state == ["parameter '2.weight' (nan)"]
    assert "The model already held inf/NaN before this step: parameter '2.weight' (nan)." in str(t)

    class BufNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
            self.register_buffer("shift", torch.zeros(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) + self.shift)

    bn = BufNet()
    bn.shift[5] = float("inf")
    t = trace_nonfinite(bn, b, _cls_loss, "fp16-mixed")
    assert t.found and "buffer 'shift' (inf)" in str(t)
    healthy = trace_nonfinite(nn.Sequential(nn.Linear(8, 4)), b, _cls_loss, "fp16-mixed")
    assert not healthy.found and healthy.nonfinite_state == []


def test_monitor_keeps_delta_only_counting_for_compensated_bf16_updates() -> None:
    # bf16-pure's Kahan buffer keeps the updates that do not move the BF16 weight: none is lost, so an unchanged
    # weight is not stagnation there (only changed elements are counted, as in FP32 runs).
    stag, moved, n = _stagnation_run("bf16-pure")
    assert 0 < moved < n  # most BF16 weights have not moved yet (their updates wait in the buffer) ...
    assert stag == 0.0  # ... and are not reported as lost


def test_monitor_counts_no_stagnation_for_a_group_at_learning_rate_zero() -> None:
    # a warm-up's first step (HF's linear warm-up starts at lr=0): nothing was meant to move
    import mixprec as mp
    from mixprec.numerics import NumericsMonitor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    prec = mp.MixedPrecision("bf16-true")
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 2))
    x, y = torch.randn(32, 16), torch.randn(32, 1)
    with NumericsMonitor(model, every=1, optimizer=opt) as mon:
        for _ in range(4):
            with prec.autocast():
                loss = (model(x).float() - y).pow(2).mean()
            prec.backward(loss)
            prec.step(opt)
            sched.step()
            opt.zero_grad()
    assert mon.report().stagnation.get("bf16", 0.0) < 0.05
