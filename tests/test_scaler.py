"""NoOpScaler, StaticScaler, DynamicScaler and the skip-or-step protocol: exact scale paths, statistics, escalation, state."""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import math
import pickle
import random
import re
import struct
import warnings
from collections.abc import Callable

import pytest
import torch
from _trees import equal_tree  # tests/_trees.py

from mixprec._errors import NumericsError
from mixprec._scaler import (
    DynamicScaler,
    LossScaler,
    NoOpScaler,
    ScalerStateError,
    StaticScaler,
)
from mixprec._stepping import step_with_result
from mixprec.bench._timing import OpCounter


def step_optimizer(opt, found_inf, grad_scale=None):
    """Step ``opt`` unless ``found_inf`` says skip (GradScaler's path: no fused twin); return ``skipped``."""
    return step_with_result(opt, found_inf, grad_scale, (), {})[0]

INF = torch.tensor(1.0)
CLEAN = torch.tensor(0.0)


def f32(x: float) -> float:
    """Round to float32 like a tensor store does (inf on overflow)."""
    if math.isinf(x) or math.isnan(x):
        return x
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


class Reference:
    """The documented rule, in plain Python (float64 products rounded to float32, as torch's kernel)."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 hysteresis=1, min_scale=None, max_scale=None, refill="growth"):
        self.scale, self.gf, self.bf, self.gi = f32(init_scale), growth_factor, backoff_factor, growth_interval
        self.h, self.lo, self.hi, self.refill = hysteresis, min_scale, max_scale, refill
        self.tracker, self.left = 0, hysteresis - 1

    def clamp(self, s):
        s = max(s, 2.0**-127 if self.lo is None else f32(self.lo))  # no floor: a float32 scale's (mixprec, not torch)
        if self.hi is not None:
            s = min(s, f32(self.hi))
        return s

    def update(self, overflow: bool) -> float:
        if overflow:
            self.tracker = 0
            if self.left > 0:
                self.left -= 1
            else:
                self.scale = self.clamp(f32(self.scale * self.bf))
        else:
            self.tracker += 1
            if self.tracker == self.gi:
                self.tracker = 0
                grown = f32(self.scale * self.gf)
                if math.isfinite(grown):
                    self.scale = self.clamp(grown)
                if self.refill == "growth":
                    self.left = self.h - 1
            if self.refill == "clean":
                self.left = self.h - 1
        return self.scale


def run(scaler, pattern):
    out = []
    for bad in pattern:
        scaler.update(INF if bad else CLEAN)
        out.append(scaler.loss_scale.item())
    return out


# ----- exact scale paths ------------------------------------------------------------------------------
def test_jmp_keras_backoff_scenario():
    s = DynamicScaler(init_scale=400.0, min_scale=None)
    assert run(s, [1, 1, 1, 1]) == [200.0, 100.0, 50.0, 25.0]


def test_jmp_keras_growth_scenario():
    s = DynamicScaler(init_scale=2.0, growth_interval=2)
    assert run(s, [0] * 8) == [2.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 32.0]


def test_deepspeed_hysteresis_scenario():
    s = DynamicScaler(init_scale=2.0**8, hysteresis=3)
    assert run(s, [1, 1, 1, 1]) == [2.0**8, 2.0**8, 2.0**7, 2.0**6]


def test_hysteresis_refills_on_growth_by_default():
    s = DynamicScaler(init_scale=2.0**8, hysteresis=2, growth_interval=3)
    # overflow spends the allowance; 3 clean steps grow and refill; the next overflow is tolerated again
    assert run(s, [1, 0, 0, 0, 1, 1]) == [256.0, 256.0, 256.0, 512.0, 512.0, 256.0]
    s = DynamicScaler(init_scale=2.0**8, hysteresis=2, growth_interval=3)
    # without growth in between there is no refill: the second overflow backs off
    assert run(s, [1, 0, 1]) == [256.0, 256.0, 128.0]


def test_hysteresis_refill_on_every_clean_step():
    s = DynamicScaler(init_scale=2.0**8, hysteresis=2, growth_interval=100, refill="clean")
    assert run(s, [1, 0, 1, 0, 1, 1]) == [256.0] * 5 + [128.0]


def test_floor_clamp():
    s = DynamicScaler(init_scale=4.0, min_scale=1.0, on_failure="ignore")
    assert run(s, [1] * 5) == [2.0, 1.0, 1.0, 1.0, 1.0]
    s = DynamicScaler(init_scale=3.0, min_scale=1.0, backoff_factor=0.25, on_failure="ignore")
    assert run(s, [1, 1]) == [1.0, 1.0]  # 0.75 clamps to the floor


def test_ceiling_clamp():
    s = DynamicScaler(init_scale=2.0**23, growth_interval=1)
    assert run(s, [0, 0, 0]) == [2.0**24] * 3
    s = DynamicScaler(init_scale=3.0, growth_interval=1, max_scale=10.0)
    assert run(s, [0, 0, 1]) == [6.0, 10.0, 5.0]


def test_non_finite_growth_does_not_happen():
    s = DynamicScaler(init_scale=2.0**127, growth_interval=1, max_scale=None)
    assert run(s, [0, 0, 1]) == [2.0**127, 2.0**127, 2.0**126]


CONFIGS = [
    {},
    {"growth_interval": 3},
    {"growth_interval": 2, "hysteresis": 2},
    {"growth_interval": 4, "hysteresis": 3, "refill": "clean"},
    {"init_scale": 8.0, "growth_interval": 2, "min_scale": 1.0, "max_scale": 64.0},
    {"init_scale": 2.0**10, "growth_interval": 5, "growth_factor": 1.7, "backoff_factor": 0.3, "min_scale": 0.01, "hysteresis": 2},
    {"init_scale": 2.0**120, "growth_interval": 1, "growth_factor": 4.0, "max_scale": None, "min_scale": None},
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[str(i) for i in range(len(CONFIGS))])
def test_exact_path_over_hundreds_of_steps(cfg, device):
    rng = random.Random(CONFIGS.index(cfg))
    for p_overflow in (0.05, 0.3, 0.7):
        pattern = [rng.random() < p_overflow for _ in range(400)]
        full = {"min_scale": None, "max_scale": None, "on_failure": "ignore"}
        full.update(cfg)
        ref = Reference(**{k: v for k, v in full.items() if k != "on_failure"})
        s = DynamicScaler(**full, device=device)
        assert run(s, pattern) == [ref.update(b) for b in pattern]
        assert s.loss_scale.device.type == torch.device(device).type


def test_same_path_as_torch_amp_update_scale():
    rng = random.Random(1)
    pattern = [rng.random() < 0.25 for _ in range(600)]
    s = DynamicScaler(growth_interval=4, growth_factor=1.5, backoff_factor=0.3, min_scale=None, max_scale=None)
    scale, tracker = torch.full((), 2.0**16), torch.zeros((), dtype=torch.int32)
    ref = []
    for bad in pattern:
        torch._amp_update_scale_(scale, tracker, INF if bad else CLEAN, 1.5, 0.3, 4)
        scale.clamp_(min=2.0**-127)  # the one deliberate difference: no floor stops where 1/scale is still finite
        ref.append(scale.item())
    assert run(s, pattern) == ref


def test_found_inf_other_than_one_counts_as_overflow():
    s = DynamicScaler(init_scale=8.0)
    s.update(torch.tensor(2.0))  # a sum over devices, as torch.amp produces
    assert s.loss_scale.item() == 4.0


# ----- no host sync ----------------------------------------------------------------------------------

@pytest.mark.parametrize("hysteresis", [1, 3])
def test_step_ops_do_not_read_the_device(hysteresis):
    s = DynamicScaler(hysteresis=hysteresis, check_interval=1000, history=1000)
    p = torch.nn.Parameter(torch.ones(4))
    with OpCounter() as c:
        for _i in range(20):
            loss = s.scale((p * 2).sum())
            loss.backward()
            found = s.unscale_([p])
            s.update(found)
            p.grad = None
    assert c.ops["_local_scalar_dense"] == 0
    assert c.ops["_amp_update_scale_"] == 20
    # the per-step bookkeeping is small: update() is at most a few kernels (+ the hysteresis fix-up)
    per_step = (c.ops["_amp_update_scale_"] + c.ops["clamp_"] + c.ops["stack"]) / 20
    assert per_step == 3


# ----- statistics -------------------------------------------------------------------------------------
def _reference_stats(pattern, scales, floor):
    steps = len(pattern)
    consec = 0
    for b in reversed(pattern):
        if not b:
            break
        consec += 1
    floor_streak = 0
    for i in range(steps - 1, -1, -1):
        before = scales[i - 1] if i else None
        if not (pattern[i] and before is not None and before <= floor):
            break
        floor_streak += 1
    ovf = [i for i, b in enumerate(pattern) if b]
    clean = [i for i, b in enumerate(pattern) if not b]
    return {"steps": steps, "skipped_steps": len(ovf), "consecutive_skips": consec,
                "last_overflow_step": ovf[-1] if ovf else None, "last_finite_step": clean[-1] if clean else None,
                "floor_streak": floor_streak}


@pytest.mark.parametrize("check_interval,history", [(7, 16), (10, 5), (3, 3)])
def test_statistics_match_the_pattern_across_folds(check_interval, history):
    rng = random.Random(check_interval)
    s = DynamicScaler(init_scale=16.0, growth_interval=3, min_scale=1.0, on_failure="ignore",
                      check_interval=check_interval, history=history)
    pattern, scales = [], []
    for n in (1, 2, 5, 13, 40, 41, 100):
        while len(pattern) < n:
            bad = rng.random() < 0.6
            pattern.append(bad)
            s.update(INF if bad else CLEAN)
            scales.append(s.loss_scale.item())
        st = s.statistics()
        ref = _reference_stats(pattern, scales, 1.0)
        for k, v in ref.items():
            assert st[k] == v, (n, k)
        ring = max(history, check_interval)
        assert st["scale_history"] == scales[-ring:]
        assert st["overflow_history"] == pattern[-ring:]
        assert st["scale"] == scales[-1]


def test_statistics_before_any_step():
    st = DynamicScaler().statistics()
    assert st["steps"] == 0 and st["skipped_steps"] == 0 and st["last_overflow_step"] is None
    assert st["scale_history"] == [] and st["scale"] == 2.0**16 and st["hysteresis_left"] == 0


def test_noop_and_static_keep_statistics_too():
    for s in (NoOpScaler(), StaticScaler(8.0)):
        run(s, [1, 0, 1, 1])
        st = s.statistics()
        assert (st["steps"], st["skipped_steps"], st["consecutive_skips"], st["last_finite_step"]) == (4, 3, 2, 1)
        assert st["scale_history"] == [st["scale"]] * 4


# ----- escalation -------------------------------------------------------------------------------------
def test_persistent_overflow_at_the_floor_raises():
    s = DynamicScaler(init_scale=4.0, min_scale=1.0, patience=5, check_interval=2)
    run(s, [0, 0])
    with pytest.raises(NumericsError) as e:
        for _i in range(40):
            s.update(INF)
    # floor reached after 2 overflows; 5 more at the floor; noticed at the next check (every 2 steps)
    assert s.statistics()["steps"] - 2 <= 2 + 5 + 2
    msg = str(e.value)
    for part in ("loss scaling has failed", "min_scale=1", "the last 6 steps there all had inf/NaN gradients",
                 "the last step with finite gradients was step 1", "bf16", "FP32 islands", "mixprec doctor"):
        assert part in msg, part


def test_transient_overflow_does_not_escalate():
    s = DynamicScaler(init_scale=2.0, min_scale=1.0, patience=5, check_interval=1, growth_interval=2)
    pattern = ([1] * 4 + [0]) * 40  # 4 overflows at the floor, then a clean step: never 5 in a row
    run(s, pattern)
    st = s.statistics()
    assert st["skipped_steps"] == 160 and st["floor_streak"] == 0


def test_escalation_warns_once_per_episode():
    s = DynamicScaler(init_scale=1.0, min_scale=1.0, patience=3, check_interval=1, on_failure="warn",
                      log_overflow=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        run(s, [1] * 10)
        assert sum("loss scaling has failed" in str(x.message) for x in w) == 1
        run(s, [0] + [1] * 4)  # recovered, then failed again: a second warning
        assert sum("loss scaling has failed" in str(x.message) for x in w) == 2


def test_escalation_ignore_and_statistics_trigger():
    s = DynamicScaler(init_scale=1.0, min_scale=1.0, patience=3, on_failure="ignore")
    run(s, [1] * 50)
    assert s.statistics()["floor_streak"] == 50
    s = DynamicScaler(init_scale=1.0, min_scale=1.0, patience=3, check_interval=1000)
    run(s, [1] * 4)  # no periodic check yet
    with pytest.raises(NumericsError):
        s.statistics()  # reading the statistics checks too


@pytest.mark.parametrize("make", [lambda **kw: NoOpScaler(**kw), lambda **kw: StaticScaler(8.0, **kw)],
                         ids=["noop", "static"])
def test_fixed_scale_scalers_escalate_persistent_skips(make):
    # transient: 4 skips then a clean step, over and over, never escalates
    s = make(patience=5, check_interval=1)
    run(s, ([1] * 4 + [0]) * 30)
    st = s.statistics()
    assert st["skipped_steps"] == 120 and st["floor_streak"] == 0 and st["consecutive_skips"] == 0
    # persistent: escalates within patience + check_interval steps, naming what happened and what to do
    s = make(patience=5, check_interval=3)
    run(s, [0, 0])
    with pytest.raises(NumericsError) as e:
        for _ in range(40):
            s.update(INF)
    assert 5 <= s.statistics()["steps"] - 2 <= 5 + 3
    msg = str(e.value)
    what = "without loss scaling" if isinstance(s, NoOpScaler) else "at the fixed loss scale 8"
    for part in (f"training has failed {what}", "the last 7 steps all had inf/NaN gradients",  # checks at steps 3, 6, 9
                 "the last step with finite gradients was step 1", "There is no scale to lower", "mixprec doctor"):
        assert part in msg, (part, msg)


def test_fixed_scale_escalation_warn_ignore_and_validation():
    s = NoOpScaler(patience=3, check_interval=1, on_failure="warn")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        run(s, [1] * 10)
    assert sum("training has failed without loss scaling" in str(x.message) for x in w) == 1
    s = StaticScaler(4.0, patience=3, on_failure="ignore")
    run(s, [1] * 60)
    assert s.statistics()["floor_streak"] == 60  # counted, never raised
    with pytest.raises(ValueError, match=re.escape("unknown NoOpScaler: on_failure 'stop'; choose one of: raise, warn, ignore.")):
        NoOpScaler(on_failure="stop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("StaticScaler: patience must be an int >= 1, got 0")):
        StaticScaler(2.0, patience=0)


def test_overflow_log_line_is_rate_limited(caplog):
    s = DynamicScaler(init_scale=2.0**16, check_interval=4, log_interval_s=0.0, on_failure="ignore")
    with caplog.at_level(logging.INFO, logger="mixprec.scaler"):
        run(s, [1, 0, 0, 0] + [0] * 8 + [1, 1, 0, 0])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # the two windows with overflows, none for the clean one
    assert lines[0].startswith("Gradient overflow. Skipping step") and "loss scale now 32768" in lines[0]
    assert "2 step(s) with inf/NaN gradients skipped since the last report (up to step 15)" in lines[1]
    caplog.clear()
    s = DynamicScaler(check_interval=1, log_interval_s=3600.0, on_failure="ignore")
    with caplog.at_level(logging.INFO, logger="mixprec.scaler"):
        run(s, [1] * 10)
    assert len(caplog.records) == 1


# ----- scale / unscale -------------------------------------------------------------------------------
def test_protocol():
    for s in (NoOpScaler(), StaticScaler(4.0), DynamicScaler()):
        assert isinstance(s, LossScaler)


def test_noop_is_identity_but_checks():
    s = NoOpScaler()
    loss = torch.tensor(3.0, requires_grad=True)
    outs = {"a": [loss], "b": 1}
    assert s.scale(loss) is loss and s.scale(outs) is outs
    g = torch.tensor([1.0, 2.0])
    assert s.unscale_([g]).item() == 0.0 and g.tolist() == [1.0, 2.0]
    g[0] = float("nan")
    assert s.unscale_([g]).item() == 1.0
    assert s.loss_scale.item() == 1.0


def test_static_scale_unscales_by_the_fp32_reciprocal_as_torch_amp():
    """Unscaling multiplies by the correctly rounded FP32 ``1/scale`` (torch.amp's float64 round trip gives the
    same bits), not divides: with scale 3 the two differ in the last bit for a third of these gradients."""
    s = StaticScaler(3.0)
    assert s.scale(torch.tensor(2.0)).item() == 6.0
    g0 = torch.tensor([67.28687286376953, 50.031368255615234, 72.92965698242188, 3.0])
    g = g0.clone()
    s.unscale_([g])
    inv = torch.tensor(3.0, dtype=torch.float64).reciprocal().float()  # torch.amp's reciprocal
    assert torch.equal(g, g0 * inv)
    assert not torch.equal(g, g0 / 3.0)  # a division would differ: the test can tell the two apart
    ref = torch.amp.GradScaler("cpu", init_scale=3.0)
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = g0.clone()
    opt = torch.optim.SGD([p], lr=0.1)
    ref.scale(torch.tensor(1.0))  # torch.amp makes its scale tensor here
    ref.unscale_(opt)
    assert torch.equal(g, p.grad)  # bit for bit torch.amp's unscale
    run(s, [1, 1, 0])
    assert s.loss_scale.item() == 3.0  # static: never changes


Pair = collections.namedtuple("Pair", "x y")


def test_scale_nested_outputs():
    s = DynamicScaler(init_scale=4.0)
    out = s.scale({"loss": torch.tensor(1.0), "parts": [torch.tensor([1.0, 2.0]), (torch.tensor(3.0), 7)],
                   "pair": Pair(torch.tensor(0.5), torch.tensor([1, 2])), "name": "x"})
    assert out["loss"].item() == 4.0 and out["parts"][0].tolist() == [4.0, 8.0]
    assert out["parts"][1][0].item() == 12.0 and out["parts"][1][1] == 7 and isinstance(out["parts"][1], tuple)
    assert isinstance(out["pair"], Pair) and out["pair"].x.item() == 2.0 and out["pair"].y.tolist() == [1, 2]
    assert out["name"] == "x"


@dataclasses.dataclass
class _Out:
    loss: torch.Tensor
    logits: torch.Tensor
    n: int = 0


@pytest.mark.parametrize("make", [lambda: StaticScaler(8.0), lambda: DynamicScaler(init_scale=8.0)],
                         ids=["static", "dynamic"])
def test_dataclass_namedtuple_and_dict_outputs_are_scaled_like_a_tensor(make):
    # one tree map (mixprec._tree) for casting and loss scaling: dataclass outputs used to be cast but not scaled
    s = make()
    loss, logits, ids = torch.tensor(1.5), torch.tensor([0.25, -2.0]), torch.tensor([1, 2])
    want_loss, want_logits = s.scale(loss), s.scale(logits)
    assert want_loss.item() == 12.0
    dc = s.scale(_Out(loss, logits, n=3))
    assert type(dc) is _Out and dc.n == 3
    assert torch.equal(dc.loss, want_loss) and torch.equal(dc.logits, want_logits)
    nt = s.scale(Pair(loss, ids))
    assert type(nt) is Pair and torch.equal(nt.x, want_loss) and nt.y is ids  # integer tensors are left alone
    d = s.scale({"loss": loss, "logits": logits, "ids": ids})
    assert type(d) is dict and list(d) == ["loss", "logits", "ids"]
    assert torch.equal(d["loss"], want_loss) and torch.equal(d["logits"], want_logits) and d["ids"] is ids
    # gradients flow through the rebuilt containers exactly as through the scaled tensor
    w = torch.tensor(2.0, requires_grad=True)
    s.scale(_Out(w * 3.0, w.reshape(1))).loss.backward()
    assert w.grad is not None and w.grad.item() == 3.0 * 8.0


def test_hugging_face_model_output_is_scaled():
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    s = DynamicScaler(init_scale=4.0)
    out = s.scale(modeling_outputs.CausalLMOutput(loss=torch.tensor(2.0), logits=torch.ones(1, 2)))
    assert type(out) is modeling_outputs.CausalLMOutput and list(out.keys()) == ["loss", "logits"]
    assert out.loss.item() == 8.0 and out["loss"].item() == 8.0 and out.logits.tolist() == [[4.0, 4.0]]


def test_scale_keeps_torch_dtype_promotion():
    s = DynamicScaler(init_scale=2.0**16)
    half = torch.tensor(1.5, dtype=torch.float16)
    assert s.scale(half).dtype == (half * torch.tensor(1.0)).dtype


def test_unscale_takes_params_or_grads():
    s = DynamicScaler(init_scale=4.0)
    a = torch.nn.Parameter(torch.ones(2))
    b = torch.nn.Parameter(torch.ones(2))  # no grad: skipped
    a.grad = torch.full((2,), 8.0)
    g = torch.full((3,), 8.0, dtype=torch.float16)  # a plain gradient, FP16 allowed
    assert s.unscale_([a, b, g, None]).item() == 0.0
    assert a.grad.tolist() == [2.0, 2.0] and g.tolist() == [2.0] * 3 and b.grad is None


@pytest.mark.parametrize("scaler", [NoOpScaler(), StaticScaler(8.0), DynamicScaler(init_scale=8.0)], ids=type)
def test_unscale_grads_with_a_factor_is_for_the_noop_scaler_only(scaler):
    """The clip coefficient as the check's factor: multiplies and flags in one call under a no-op scaler; a scaler
    that scales the loss refuses it (its gradients must be unscaled first) and leaves them untouched."""
    g = [torch.tensor([2.0, float("inf")]), torch.tensor([4.0])]
    if isinstance(scaler, NoOpScaler):
        assert scaler.unscale_grads_(g, factor=torch.tensor(0.5)).item() == 1.0
        assert g[0][0].item() == 1.0 and g[1].tolist() == [2.0]
        return
    with pytest.raises(ValueError, match="unscale first, then multiply"):
        scaler.unscale_grads_(g, factor=torch.tensor(0.5))
    assert g[1].tolist() == [4.0]


def test_device_binding_is_lazy(device):
    s = DynamicScaler()
    assert s.loss_scale.device.type == "cpu"  # read before use: CPU, not bound
    out = s.scale(torch.ones((), device=device))
    assert s.loss_scale.device == out.device
    assert DynamicScaler(device=device).loss_scale.device.type == torch.device(device).type


# ----- skipping -------------------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _snap(model, opt):
    return copy.deepcopy(([p.detach() for p in model.parameters()], opt.state_dict()))



@pytest.mark.parametrize("fused", [False, True])
def test_skipped_step_leaves_params_and_state_bit_identical(fused):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    s = DynamicScaler(init_scale=2.0**8)
    x = torch.randn(16, 4)
    for step in range(4):
        s.scale(model(x).square().mean()).backward()
        if step == 3:
            before = _snap(model, opt)
            next(model.parameters()).grad[0, 0] = float("inf")
        found = s.unscale_(model.parameters())
        skipped = step_optimizer(opt, found)
        assert skipped.dtype == torch.bool and skipped.shape == ()
        s.update(found)
        opt.zero_grad()
    assert skipped.item()
    assert equal_tree(before, _snap(model, opt))


class RecordingOpt(torch.optim.SGD):
    _step_supports_amp_scaling = True

    def step(self, closure=None):  # type: ignore[override]
        self.seen = (getattr(self, "grad_scale", "missing"), getattr(self, "found_inf", "missing"))


def test_step_optimizer_protocol_sets_and_removes_attributes():
    p = torch.nn.Parameter(torch.ones(2))
    opt = RecordingOpt([p], lr=0.1)
    f, gs = torch.tensor(0.0), torch.tensor(4.0)
    assert not step_optimizer(opt, f, gs).item()
    assert opt.seen[0] is gs and opt.seen[1] is f
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    opt.grad_scale = "user"  # a value set by someone else is restored
    step_optimizer(opt, f)
    assert opt.grad_scale == "user" and not hasattr(opt, "found_inf")


def test_step_optimizer_plain_optimizer_syncs_once_and_applies_grad_scale():
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 8.0)
    opt = torch.optim.SGD([p], lr=1.0)
    with OpCounter() as c:
        skipped = step_optimizer(opt, torch.tensor(0.0), torch.tensor(4.0))
    assert c.ops["_local_scalar_dense"] == 1
    assert not skipped.item() and p.tolist() == [-1.0, -1.0]  # grads unscaled to 2 first
    p.grad = torch.full((2,), float("inf"))
    assert step_optimizer(opt, torch.tensor(0.0), torch.tensor(4.0)).item()
    assert p.tolist() == [-1.0, -1.0]


# ----- state -----------------------------------------------------------------------------------------
NON_DEFAULT = {"init_scale": 2.0**10, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 3, "hysteresis": 3,
                   "min_scale": 2.0, "max_scale": 2.0**20, "refill": "clean"}


def _trained(steps=37, **kw):
    s = DynamicScaler(**{**NON_DEFAULT, **kw}, on_failure="ignore", history=16, check_interval=5)
    rng = random.Random(5)
    run(s, [rng.random() < 0.5 for _ in range(steps)])
    return s


def test_state_dict_round_trip_every_field():
    s = _trained()
    sd = s.state_dict()
    assert sd["version"] == 1 and sd["kind"] == "dynamic"
    for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"):
        assert k in sd  # torch.amp.GradScaler's keys
    assert sd["steps"] == 37 and sd["skipped_steps"] > 0 and len(sd["scale_history"]) == 16
    t = DynamicScaler(history=16, check_interval=5, on_failure="ignore")  # defaults: every field differs
    t.load_state_dict(copy.deepcopy(sd))
    assert t.state_dict() == sd
    t.scale(torch.ones(()))  # materialise the loaded state
    assert t.state_dict() == sd and t.statistics() == s.statistics()


def test_state_dict_before_the_lazy_state_exists():
    s = DynamicScaler(**NON_DEFAULT)
    sd = s.state_dict()
    assert sd["scale"] == 2.0**10 and sd["steps"] == 0 and sd["hysteresis_left"] == 2
    t = DynamicScaler()
    t.load_state_dict(sd)
    assert t.state_dict() == sd
    assert s._core.scale is None  # reading state_dict does not create the device state
    u = DynamicScaler()
    u.load_state_dict(_trained().state_dict())  # loaded before first use, then used
    assert run(u, [0]) == run(_trained(), [0])


def test_resume_equals_uninterrupted_run():
    rng = random.Random(3)
    pattern = [rng.random() < 0.3 for _ in range(300)]
    full = DynamicScaler(**NON_DEFAULT, on_failure="ignore")
    a = run(full, pattern)
    first = DynamicScaler(**NON_DEFAULT, on_failure="ignore")
    b = run(first, pattern[:150])
    second = DynamicScaler(on_failure="ignore")
    second.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
    b += run(second, pattern[150:])
    assert a == b
    assert second.statistics() == full.statistics()


def test_pickling_keeps_the_state():
    s = _trained()
    t = pickle.loads(pickle.dumps(s))
    assert t.state_dict() == s.state_dict()
    assert run(t, [1, 0, 0]) == run(s, [1, 0, 0])
    st = pickle.loads(pickle.dumps(StaticScaler(8.0)))
    assert st.loss_scale.item() == 8.0


def test_torch_checkpoint_interoperates_both_ways():
    g = torch.amp.GradScaler("cpu", init_scale=512.0, growth_factor=4.0, backoff_factor=0.125, growth_interval=7)
    g.load_state_dict({"scale": 256.0, "growth_factor": 4.0, "backoff_factor": 0.125, "growth_interval": 7,
                       "_growth_tracker": 5})
    s = DynamicScaler()
    s.load_state_dict(g.state_dict())
    sd = s.state_dict()
    assert (sd["scale"], sd["growth_factor"], sd["backoff_factor"], sd["growth_interval"], sd["_growth_tracker"]) == (
        256.0, 4.0, 0.125, 7, 5)
    assert sd["hysteresis_left"] == 0
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(_trained().state_dict())
    assert back.get_scale() == _trained().loss_scale.item()
    assert back.get_growth_factor() == 3.0 and back._get_growth_tracker() == _trained().growth_tracker.item()


def test_torch_checkpoint_above_our_ceiling_is_clamped():
    s = DynamicScaler()
    s.load_state_dict({"scale": 2.0**30, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                       "_growth_tracker": 0})
    assert s.loss_scale.item() == 2.0**24


@pytest.mark.parametrize("cls,sd,msg", [
    (DynamicScaler, {}, "got an empty dict: it was probably saved from a disabled scaler"),
    (StaticScaler, {}, "got an empty dict: it was probably saved from a disabled scaler"),
    (DynamicScaler, {"version": 1, "kind": "static", "scale": 1.0},
     "this state dict is from a StaticScaler (kind='static'), not a 'dynamic' scaler"),
    (StaticScaler, {"version": 1, "kind": "dynamic"}, "this state dict is from a DynamicScaler or GradScaler"),
    (DynamicScaler, {"model": {}, "optimizer": {}, "scaler": {}},
     ("not a loss-scaler state dict (missing 'scale', 'growth_factor', 'backoff_factor', 'growth_interval', "
     "'_growth_tracker'; got keys 'model', 'optimizer', 'scaler'). Pass the scaler's entry of a checkpoint")),
    (NoOpScaler, {"scale": 1.0}, "NoOpScaler: not a NoOpScaler state dict (no 'kind'/'version'"),
    (DynamicScaler, {"version": 99, "kind": "dynamic"}, "state dict version 99 is newer than this mixprec understands"),
])
def test_loading_a_wrong_state_dict_says_why(cls, sd, msg):
    s = cls()
    with pytest.raises(ScalerStateError, match=re.escape(msg)):
        s.load_state_dict(sd)
    assert issubclass(ScalerStateError, ValueError)


# ----- bad constructor values ----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,msg", [
    ({"growth_factor": 1.0}, "DynamicScaler: growth_factor must be > 1, got 1.0."),
    ({"backoff_factor": 1.0}, "DynamicScaler: backoff_factor must be > 0 and < 1, got 1.0."),
    ({"backoff_factor": 0}, "DynamicScaler: backoff_factor must be > 0 and < 1, got 0."),
    ({"growth_interval": 0}, "DynamicScaler: growth_interval must be an int >= 1, got 0."),
    ({"growth_interval": 2.5}, "DynamicScaler: growth_interval must be an int >= 1, got 2.5."),
    ({"hysteresis": 0}, "DynamicScaler: hysteresis must be an int >= 1, got 0."),
    ({"init_scale": -1.0}, "DynamicScaler: init_scale must be > 0, got -1.0."),
    ({"init_scale": float("inf")}, "DynamicScaler: init_scale must be a finite number, got inf."),
    ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, "DynamicScaler: min_scale=4 is above max_scale=2."),
    ({"init_scale": 2.0**30}, ("DynamicScaler: init_scale=1.07374e+09 lies outside [min_scale, max_scale] = "
                               "[1, 1.67772e+07]; move init_scale inside or widen the range.")),
    ({"on_failure": "rasie"}, ("unknown DynamicScaler: on_failure 'rasie'; choose one of: raise, warn, ignore. "
                               "Did you mean 'raise'?")),
    ({"refill": "grow"}, "unknown DynamicScaler: hysteresis refill 'grow'; choose one of: growth, clean."),
    ({"on_failure": "raise", "min_scale": None}, "DynamicScaler: on_failure='raise' needs a floor (min_scale)"),
    ({"patience": 0}, "DynamicScaler: patience must be an int >= 1, got 0."),
])
def test_bad_constructor_values(kwargs, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        DynamicScaler(**kwargs)


def test_bad_static_scale_and_update_argument():
    with pytest.raises(ValueError, match=re.escape("StaticScaler: init_scale must be > 0, got 0.")):
        StaticScaler(0)
    with pytest.raises(TypeError, match=re.escape("update(found_inf) needs the 0-d tensor unscale_() returned, got bool")):
        DynamicScaler().update(True)  # type: ignore[arg-type]


def test_repr():
    assert repr(DynamicScaler()).startswith("DynamicScaler(init_scale=65536, growth_interval=2000, hysteresis=1")
    assert repr(StaticScaler(2.0)) == "StaticScaler(scale=2, device=lazy, steps=0)"
    assert repr(NoOpScaler()) == "NoOpScaler(device=lazy, steps=0)"  # (was "NoOpScaler(, device=...")


def test_statistics_do_not_create_the_device_state():
    s = DynamicScaler(init_scale=8.0)
    assert s.statistics()["scale"] == 8.0 and s._core.scale is None
    assert list(s.statistics()) == list(_trained().statistics())  # same keys, same order


@pytest.mark.cuda
def test_cuda_steps_and_periodic_checks_never_sync():
    s = DynamicScaler(init_scale=4.0, min_scale=1.0, patience=4, check_interval=3, device="cuda")
    p = torch.nn.Parameter(torch.ones(8, device="cuda"))
    inf = torch.tensor(float("inf"), device="cuda")
    steps = 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(NumericsError, match="loss scaling has failed"):
            for steps in range(1, 200):
                loss = s.scale(p.sum() * (inf if steps > 20 else 1.0))
                loss.backward()
                s.update(s.unscale_([p]))
                p.grad = None
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # 20 clean steps, 2 to reach the floor, patience 4, then at most two check intervals late (async read)
    assert steps <= 20 + 2 + 4 + 2 * 3 + 1
    assert s.statistics()["floor_streak"] >= 4


# ----- escalation: no step ever applied vs the scale collapsed (issue 18 item 7) ----------------------
NEVER_CAUSES = (
    "Likely causes: the model, the data or the initialisation produce inf/NaN (an activation that overflows in the "
    "forward pass, a bad input), or an inf in the gradient buffers persists from step to step (gradients never "
    "cleared: call optimizer.zero_grad() every iteration)"
)
NEVER_FIX = (
    "Run `mixprec doctor` (or mixprec.numerics.trace_nonfinite) to find the first module that produces inf/NaN, check "
    "that the gradients are zeroed between steps and that the inputs and initial weights are finite, and keep the "
    "layers that overflow in FP32 (FP32 islands, Policy 'i=...')."
)
COLLAPSE_ADVICE = (
    "Skipping more steps would only hide it. Try bf16 (e.g. MixedPrecision('bf16-mixed')) where the hardware supports "
    "it, FP32 islands for the layers that overflow (Policy 'i=...'), or run `mixprec doctor` to find the first module "
    "that produces inf/NaN."
)


def _fail(s, pattern=()):
    run(s, pattern)
    for _ in range(60):
        s.update(INF)


def test_escalation_when_no_step_was_ever_applied():
    # 4 -> 2 -> 1 (floor), then 3 overflows at the floor: raised at the check after step 5
    s = DynamicScaler(init_scale=4.0, min_scale=1.0, patience=3, check_interval=1)
    msg = (
        "loss scaling has failed: the loss scale is at its floor (min_scale=1, scale 1) and the last 3 steps there all "
        "had inf/NaN gradients (5 consecutive skipped steps, 5 skipped of 5); no step of this run was ever applied: "
        "the gradients were inf/NaN from the first step on, at every loss scale down to the floor, so lowering the "
        f"scale cannot fix it. {NEVER_CAUSES}. {NEVER_FIX}"
    )
    with pytest.raises(NumericsError, match=re.escape(msg)) as e:
        _fail(s)
    assert "bf16" not in str(e.value) and str(e.value) == msg  # BF16 is not the advice for this failure
    assert s.state_dict()["any_finite_step"] is False


def test_escalation_when_the_scale_collapsed_after_applied_steps():
    s = DynamicScaler(init_scale=4.0, min_scale=1.0, patience=3, check_interval=1)
    msg = (
        "loss scaling has failed: the loss scale is at its floor (min_scale=1, scale 1) and the last 3 steps there all "
        "had inf/NaN gradients (5 consecutive skipped steps, 5 skipped of 8); the last step with finite gradients was "
        f"step 2: the scale collapsed after 3 applied steps. {COLLAPSE_ADVICE}"
    )
    with pytest.raises(NumericsError, match=re.escape(msg)) as e:
        _fail(s, [0, 0, 0])
    assert str(e.value) == msg and "no step of this run was ever applied" not in msg
    assert s.state_dict()["any_finite_step"] is True


@pytest.mark.parametrize("make,what,extra", [
    (lambda: NoOpScaler(patience=2, check_interval=1), "without loss scaling", ""),
    (lambda: StaticScaler(2.0**20, patience=2, check_interval=1), "at the fixed loss scale 1.04858e+06",
     ", or the fixed loss scale 1.04858e+06 is too large for the gradients' dtype (try a smaller one, or DynamicScaler)"),
], ids=["noop", "static"])
def test_fixed_scale_escalation_when_no_step_was_ever_applied(make, what, extra):
    msg = (
        f"training has failed {what}: the last 2 steps all had inf/NaN gradients and were skipped (2 skipped of 2); no "
        "step of this run was ever applied: the gradients were inf/NaN from the first step on. There is no scale to "
        f"lower. {NEVER_CAUSES}{extra}. {NEVER_FIX}"
    )
    s = make()
    with pytest.raises(NumericsError, match=re.escape(msg)) as e:
        _fail(s)
    assert str(e.value) == msg
    # one clean step first: the other message (the existing one)
    s = make()
    with pytest.raises(NumericsError, match=re.escape("the last step with finite gradients was step 0. There is no "
                                                      "scale to lower, so the inf/NaN comes from")):
        _fail(s, [0])


def test_ever_applied_survives_resume_and_pickling():
    # a run that applied steps, resumed: its collapse is still a collapse
    s = DynamicScaler(init_scale=4.0, min_scale=1.0, patience=3, check_interval=1)
    run(s, [0, 0, 1])
    sd = s.state_dict()
    assert sd["any_finite_step"] is True
    t = DynamicScaler(init_scale=4.0, min_scale=1.0, patience=3, check_interval=1)
    t.load_state_dict(pickle.loads(pickle.dumps(sd)))
    with pytest.raises(NumericsError, match=re.escape("finite gradients was step 1: the scale collapsed after 2 applied "
                                                      "steps.")):
        _fail(t)
    # a run that never applied a step, resumed (state dict, pickle): still never applied (64 -> 1 in 6 steps, 3 more)
    s = DynamicScaler(init_scale=64.0, min_scale=1.0, patience=3, check_interval=1)
    run(s, [1, 1])
    for t in (pickle.loads(pickle.dumps(s)), DynamicScaler(min_scale=1.0, patience=3, check_interval=1)):
        if not t.state_dict()["steps"]:
            t.load_state_dict(s.state_dict())
        assert t.state_dict() == s.state_dict() and t.state_dict()["any_finite_step"] is False
        with pytest.raises(NumericsError, match=re.escape("(9 consecutive skipped steps, 9 skipped of 9); no step of "
                                                          "this run was ever applied")):
            _fail(t)


def test_finite_steps_before_a_loaded_state_count():
    # the flag is kept even where last_finite_step is not (a torch.amp.GradScaler dict has no statistics)
    s = DynamicScaler(init_scale=4.0, min_scale=1.0, patience=3, check_interval=1)
    s.load_state_dict({"scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                       "_growth_tracker": 0})
    sd = s.state_dict()
    assert sd["any_finite_step"] is True and sd["last_finite_step"] is None
    with pytest.raises(NumericsError, match=re.escape(
            "; the last step with finite gradients came before the loaded state dict: the scale collapsed after "
            f"resuming. {COLLAPSE_ADVICE}")):
        _fail(s)
    n = NoOpScaler(patience=2, check_interval=1)
    n.load_state_dict({**NoOpScaler().state_dict(), "any_finite_step": True})
    with pytest.raises(NumericsError, match=re.escape(
            "the last step with finite gradients came before the loaded state dict. There is no scale to lower")):
        _fail(n)


def test_ever_applied_costs_no_extra_kernel():
    # it is read from the counters the periodic check already folds and reads: same launches as without it
    s = DynamicScaler(init_scale=2.0**4, min_scale=1.0, check_interval=5, on_failure="warn")
    with OpCounter() as c:
        run(s, [1, 0, 1, 1, 1] * 4)
    assert c.ops["_amp_update_scale_"] == 20 and c.ops["stack"] == 20 + 4  # one per step, one per fold (4 folds)


# state dicts written before any_finite_step and _scale_history.py existed (mixprec at e376f1a)
OLD_STATE = {
    "version": 1, "kind": "dynamic", "scale": 2.0, "_growth_tracker": 1, "hysteresis_left": 0, "steps": 7,
    "skipped_steps": 3, "consecutive_skips": 0, "last_overflow_step": 5, "last_finite_step": 6, "floor_streak": 0,
    "scale_history": [8.0, 4.0, 2.0, 2.0], "overflow_history": [False, True, True, False], "growth_factor": 2.0,
    "backoff_factor": 0.5, "growth_interval": 3, "hysteresis": 1, "min_scale": 1.0, "max_scale": 16777216.0,
    "refill": "growth",
}
OLD_NEVER_APPLIED = {
    "version": 1, "kind": "dynamic", "scale": 1.0, "_growth_tracker": 0, "hysteresis_left": 0, "steps": 3,
    "skipped_steps": 3, "consecutive_skips": 3, "last_overflow_step": 2, "last_finite_step": None, "floor_streak": 1,
    "scale_history": [2.0, 1.0, 1.0], "overflow_history": [True, True, True], "growth_factor": 2.0,
    "backoff_factor": 0.5, "growth_interval": 2000, "hysteresis": 1, "min_scale": 1.0, "max_scale": 16777216.0,
    "refill": "growth",
}

def test_checkpoints_written_before_still_load():
    s = DynamicScaler(history=4, check_interval=2, on_failure="ignore")
    s.load_state_dict(copy.deepcopy(OLD_STATE))
    assert s.state_dict() == {**OLD_STATE, "any_finite_step": True}  # derived from last_finite_step
    n = DynamicScaler(history=4, check_interval=2, on_failure="ignore")
    n.load_state_dict(copy.deepcopy(OLD_NEVER_APPLIED))
    assert n.state_dict() == {**OLD_NEVER_APPLIED, "any_finite_step": False}
    # an old noop/static dict (no any_finite_step) too
    noop = {k: v for k, v in NoOpScaler().state_dict().items() if k != "any_finite_step"}
    t = NoOpScaler()
    t.load_state_dict(noop)
    assert t.state_dict()["any_finite_step"] is False




# ------------------------------------------------ float32 range, damaged states, escalation episodes (user sweep)
@pytest.mark.parametrize("make", [
    lambda: StaticScaler(1e-46), lambda: DynamicScaler(init_scale=1e-46, min_scale=None),
    lambda: DynamicScaler(init_scale=1e39, max_scale=None),
    lambda: StaticScaler(1e39),
])
def test_a_scale_outside_float32s_normal_range_is_refused_at_construction(make) -> None:
    """The scale is a float32 tensor: 1e-46 became 0 (1/0 = inf turned finite gradients into NaN after the inf/NaN
    check, applied as a clean step), 1e39 failed at the first scale() with torch's bare overflow message."""
    with pytest.raises(ValueError, match=r"the range of a float32 loss scale"):
        make()


def test_no_floor_still_never_reaches_zero() -> None:
    """DynamicScaler(min_scale=None) after 200 overflows in a row stops at float32's smallest normal, not 0 (where
    torch.amp.GradScaler ends, and its next finite step writes NaN)."""
    s = DynamicScaler(init_scale=1.0, min_scale=None)
    for _ in range(200):
        s.update(torch.tensor(1.0))
    assert float(s.loss_scale) == 2.0**-127
    inv = 1.0 / s.loss_scale
    assert math.isfinite(float(inv))


@pytest.mark.parametrize("bad", [{"scale": float("nan")}, {"scale": -8.0},
                                 {"hysteresis_left": 99}, {"_growth_tracker": -5}, {"_growth_tracker": 2.7}])
def test_a_damaged_scaler_state_is_refused(bad) -> None:
    """A NaN scale loaded silently skipped every later step without escalating; a negative one was raised to the
    floor, an impossible hysteresis allowance or growth tracker accepted."""
    s = DynamicScaler(init_scale=64.0, hysteresis=2)
    sd = {**s.state_dict(), **bad}
    fresh = DynamicScaler(init_scale=64.0, hysteresis=2)
    with pytest.raises(ScalerStateError, match="load_state_dict"):
        fresh.load_state_dict(sd)


@pytest.mark.parametrize("on_failure", ["raise", "warn"])
def test_a_second_collapse_after_a_short_recovery_escalates_again(on_failure) -> None:
    """Escalation fires once per episode; a recovery shorter than check_interval between two checks used to go
    unseen, so a second collapse at the floor was never reported (1,000 skipped steps)."""
    s = DynamicScaler(init_scale=4.0, min_scale=1.0, on_failure=on_failure, patience=20, check_interval=50)
    events: list[int] = []
    for i, flag in enumerate([1.0] * 100 + [0.0] * 40 + [1.0] * 200):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                s.update(torch.tensor(flag))
            except NumericsError:
                events.append(i)
        events.extend(i for w in caught if issubclass(w.category, RuntimeWarning))
    assert len(events) == 2 and events[0] < 100 <= 140 <= events[1]


def test_the_overflow_log_after_a_resume_counts_only_new_skips(caplog) -> None:
    """The first log line after load_state_dict counted the skips the saving run had already reported."""
    s = DynamicScaler(init_scale=2.0**10, log_overflow=True, log_interval_s=0.0, check_interval=1)
    with caplog.at_level(logging.INFO, logger="mixprec"):
        for _ in range(5):
            s.update(torch.tensor(1.0))
    sd = s.state_dict()
    resumed = DynamicScaler(init_scale=2.0**10, log_overflow=True, log_interval_s=0.0, check_interval=1)
    resumed.load_state_dict(sd)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mixprec"):
        resumed.update(torch.tensor(1.0))
    lines = [r.getMessage() for r in caplog.records if "skipped since the last report" in r.getMessage()]
    assert lines and lines[-1].split(": ")[1].startswith("1 step(s)"), lines


def test_a_zero_scale_from_torch_loads_clamped_and_a_loaded_floor_is_the_clamps() -> None:
    """torch.amp.GradScaler reaches scale 0 after ~150 overflows (no floor): its state loads, clamped into the range
    (a first version refused it as damaged). A floor loaded from a state is the one the scale rule clamps to (the
    clamp's floor was cached at construction: the scale went below a loaded min_scale=128)."""
    s = DynamicScaler(init_scale=64.0, min_scale=1.0)
    s.load_state_dict({**DynamicScaler(init_scale=64.0).state_dict(), "scale": 0.0})
    assert float(s.loss_scale) == 1.0
    src = DynamicScaler(init_scale=1024.0, min_scale=128.0)
    dst = DynamicScaler(init_scale=1024.0, min_scale=1.0)
    dst.load_state_dict(src.state_dict())
    for _ in range(6):
        dst.update(torch.tensor(1.0))
    assert float(dst.loss_scale) == 128.0


def test_a_static_scale_outside_float32s_range_is_refused_at_load() -> None:
    """StaticScaler(1e-50) was refused but loading scale 1e-50 was not: 0 in float32, 1/0 = inf gradients applied."""
    s = StaticScaler(4.0)
    for bad in (1e-50, 1e39):
        with pytest.raises(ScalerStateError, match="range of a float32 loss scale"):
            s.load_state_dict({**s.state_dict(), "scale": bad})
    assert float(s.loss_scale) == 4.0


def test_a_refused_state_changes_nothing_and_no_floor_still_escalates() -> None:
    """A state refused for its hysteresis allowance had already replaced the rule's configuration (growth factor,
    floor, ceiling); and with 'no floor' (now a float32 scale's smallest) the escalation never counted a floor
    streak, so a loaded min_scale=None silently turned escalation off."""
    s = DynamicScaler(init_scale=1024.0, growth_factor=2.0, hysteresis=1)
    before = dataclasses.asdict(s._core.cfg)
    bad = {**DynamicScaler(init_scale=8.0, growth_factor=4.0, hysteresis=1, max_scale=64.0).state_dict(),
           "hysteresis_left": 3}
    with pytest.raises(ScalerStateError, match="hysteresis_left=3"):
        s.load_state_dict(bad)
    assert dataclasses.asdict(s._core.cfg) == before and float(s.loss_scale) == 1024.0
    esc = DynamicScaler(init_scale=2.0, min_scale=1.0, on_failure="raise", patience=5, check_interval=10)
    esc.load_state_dict(DynamicScaler(init_scale=2.0, min_scale=None).state_dict())
    with pytest.raises(NumericsError):
        for _ in range(400):
            esc.update(torch.tensor(1.0))


def test_counters_as_numpy_numbers_load() -> None:
    """States that passed through numpy (np.int64 counters) loaded before the counter checks and load again."""
    import numpy as np

    s = DynamicScaler(init_scale=8.0)
    s.load_state_dict({**s.state_dict(), "_growth_tracker": np.int64(3), "hysteresis_left": np.int64(0)})
    assert int(s.state_dict()["_growth_tracker"]) == 3


def test_a_floor_below_float32s_range_is_its_smallest() -> None:
    """min_scale=1e-50 meant 'effectively no floor' (accepted before the range check): it is 2**-127, as None."""
    assert DynamicScaler(init_scale=1.0, min_scale=1e-50)._core.cfg.min_scale == 2.0**-127


def _poisoned_run(preset: str, steps: int, *, save_every: int = 0, resume_at: int = 0) -> int | None:
    """Train with inf losses from step 3 on; return the step that raised NumericsError (None if none did)."""
    import torch.nn.functional as F
    from torch import nn

    import mixprec as mp

    def build() -> tuple[mp.MixedPrecision, torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        if preset.startswith("fp16"):
            scaler = mp.DynamicScaler(init_scale=8.0, min_scale=1.0, patience=4, check_interval=5)
        else:
            scaler = mp.NoOpScaler(patience=4, check_interval=5)
        prec = mp.MixedPrecision(preset, scaler=scaler)
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        return prec, model, opt

    prec, model, opt = build()
    for step in range(steps):
        if resume_at and step == resume_at:
            state = prec.state_dict()
            prec, model, opt = build()
            prec.load_state_dict(state)
        g = torch.Generator().manual_seed(step)
        with prec.autocast():
            loss = F.cross_entropy(model(torch.randn(8, 8, generator=g)), torch.randint(0, 4, (8,), generator=g))
        prec.backward(loss * float("inf") if step >= 3 else loss)
        try:
            prec.step(opt)
        except mp.NumericsError:
            return step
        opt.zero_grad(set_to_none=True)
        if save_every and (step + 1) % save_every == 0:
            prec.state_dict()
    return None


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp16-mixed"])
def test_escalation_fires_at_the_same_step_with_checkpoints_and_after_a_resume(preset: str) -> None:
    # The check was counted from the last fold, and state_dict() folds: saving every 4 steps (under
    # the interval of 5) switched escalation off, and a resume shifted it.
    plain = _poisoned_run(preset, 60)
    assert plain is not None and plain < 20
    assert _poisoned_run(preset, 60, save_every=4) == plain
    assert _poisoned_run(preset, 60, save_every=3) == plain
    assert _poisoned_run(preset, 60, resume_at=7) == plain


def test_a_loaded_growth_tracker_past_the_interval_grows_at_the_next_clean_step():
    """A checkpoint of a longer growth_interval (tracker 1500, interval now 100): growth stalled until an overflow."""
    import mixprec as mp

    d = mp.DynamicScaler(init_scale=16.0, growth_interval=2000)
    for _ in range(1500):
        d.update(torch.tensor(0.0))
    sd = d.state_dict()
    sd["growth_interval"] = 100
    d2 = mp.DynamicScaler()
    d2.load_state_dict(sd)
    d2.update(torch.tensor(0.0))
    assert d2.statistics()["scale"] == 32.0
    for _ in range(100):
        d2.update(torch.tensor(0.0))
    assert d2.statistics()["scale"] == 64.0


@pytest.mark.parametrize("kind", ["noop", "static", "dynamic"])
def test_a_run_of_patience_skips_that_ends_between_two_checks_escalates_at_the_next(kind: str) -> None:
    """The rule is "20 in a row" whatever the phase of the 50-step check: a run of 20 (at the floor) that ended before
    the check (60-79, or one straddling a check) raised nothing, while a run of 40 ending at the check raised. Now the
    fold keeps the longest run since the last check; 19 in a row still pass; a run reported while it went on is not
    reported again when it ends."""

    def scaler(on_failure: str = "raise") -> LossScaler:
        kw = {"check_interval": 50, "patience": 20, "on_failure": on_failure}
        if kind == "noop":
            return NoOpScaler(**kw)
        if kind == "static":
            return StaticScaler(2.0, **kw)
        return DynamicScaler(init_scale=1.0, min_scale=1.0, **kw)  # at the floor from the start

    def steps(bad: set[int], n: int = 160, on_failure: str = "raise") -> tuple[int | None, str]:
        s = scaler(on_failure)
        for i in range(n):
            try:
                s.update(INF if i in bad else CLEAN)
            except NumericsError as e:
                return i, str(e)
        return None, ""

    assert steps(set(range(60, 79)))[0] is None  # 19 in a row
    at, msg = steps(set(range(60, 80)))  # 20, ended at 79: raised at the check after it
    assert at == 99 and "the 20 steps up to step 79" in msg and "finite gradients came back after step 79" in msg
    at, msg = steps(set(range(40, 60)))  # straddles the check at 49 (10 before it)
    assert at == 99 and "the 20 steps up to step 59" in msg
    at, msg = steps(set(range(60, 120)))  # going on at the check at 99: the message of an ongoing run, as before
    assert at == 99 and "the last 40 steps" in msg
    with warnings.catch_warnings(record=True) as seen:  # reported once while going on, not again after it ended
        warnings.simplefilter("always")
        assert steps(set(range(60, 110)), on_failure="warn")[0] is None
    assert sum("inf/NaN gradients" in str(w.message) for w in seen) == 1

    def reports_after_a_read(read: Callable[[LossScaler], object], at: int) -> int:
        """Reports of the run 60-79 when ``read(scaler)`` is called after step ``at``."""
        s = scaler("warn")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for i in range(160):
                s.update(INF if 60 <= i < 80 else CLEAN)
                if i == at:
                    read(s)
        return sum("the 20 steps up to step 79" in str(w.message) for w in seen)

    # an ended run reported by a statistics() read is not reported again by the next check
    assert reports_after_a_read(lambda s: s.statistics(), 85) == 1
    with warnings.catch_warnings(record=True) as seen:  # a second run after one reported while going on: reported too
        warnings.simplefilter("always")
        assert steps(set(range(60, 110)) | set(range(120, 145)), n=200, on_failure="warn")[0] is None
    assert [m for m in (str(w.message) for w in seen) if "inf/NaN gradients" in m][1].count("up to step 144") == 1
    # a state_dict() read at a run's last step folds it as going on; the next step is clean
    assert reports_after_a_read(lambda s: s.state_dict(), 79) == 1
    s = scaler()  # a checkpoint from before a run that ended, loaded after it: that run is not this state's
    state = s.state_dict()
    for i in range(40):
        s.update(INF if 10 <= i < 35 else CLEAN)
    s.load_state_dict(state)
    for _ in range(120):
        s.update(CLEAN)
