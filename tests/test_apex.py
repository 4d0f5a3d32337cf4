"""mixprec.apex: Apex amp's front end. Apex-style loops run unchanged and equal the MixedPrecision loop bit for bit.

Where no MixedPrecision loop is equivalent (several losses, each with its own scale, unscaled at
the end of its own ``scale_loss`` block) the run is compared with a hand-written reference of
Apex's algorithm (apex/amp/handle.py, scaler.py, _process_optimizer.py) in plain torch.
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import MixedPrecision, Policy
from mixprec import apex as amp

pytestmark = pytest.mark.filterwarnings("ignore:fp16 on CPU works:UserWarning")

LR = 0.05
# (opt level, overrides, the policy the front end must choose)
LEVELS = [
    ("O0", {}, "fp32"),
    ("O1", {}, "fp16-mixed"),
    ("O2", {}, "fp16-master"),
    ("O3", {}, "p=f16,c=f16,o=f32,m=none,ls=static:1,i=none,b=param"),
    ("O3", {"keep_batchnorm_fp32": True}, "fp16-pure"),
    ("O2", {"cast_model_type": torch.bfloat16}, "p=bf16,c=bf16,o=f32,m=f32,ls=dynamic,i=norm"),
    ("O3", {"loss_scale": "dynamic", "keep_batchnorm_fp32": "True"}, "p=f16,c=f16,ls=dynamic,i=norm"),
    ("O1", {"loss_scale": 128.0}, "p=f32,c=f16,ls=static:128"),
]
#: The policy of each opt level with Apex's defaults (O3 is pure FP16: no FP32 islands; Policy.parse("O3") is fp16-pure).
APEX_POLICY = {lvl: policy for lvl, o, policy in LEVELS if not o}
LEVEL_IDS = [f"{lvl}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for lvl, o, _ in LEVELS]


def _model(seed: int = 0, norm: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(4, 8)]
    if norm:
        layers.append(nn.BatchNorm1d(8))
    layers += [nn.ReLU(), nn.Linear(8, 3)]
    return nn.Sequential(*layers)


def _batches(n: int, overflow_at: tuple[int, ...] = (2,), seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Tiny regression batches; at ``overflow_at`` the targets are huge so FP16 gradients at scale 2**16 overflow."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 3, generator=g)
        out.append((x, y * 1e3 if i in overflow_at else y))
    return out


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [b.detach().clone() for b in model.buffers()]


def _assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        assert torch.equal(x, y), (x - y).abs().max()


# ----- the Apex loop and its MixedPrecision equivalent ------------------------------------------------------------
def _apex_loop(level: str, overrides: dict, batches, *, accumulate: int = 1, delay_unscale: bool = False):
    """Apex's documented loop, as research code wrote it (only the import differs)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0, **overrides)
    for i, (x, y) in enumerate(batches):
        loss = F.mse_loss(model(x), y) / accumulate
        last = (i + 1) % accumulate == 0
        with amp.scale_loss(loss, optimizer, delay_unscale=delay_unscale and not last) as scaled_loss:
            scaled_loss.backward()
        if last:
            optimizer.step()
            optimizer.zero_grad()
    return model, optimizer


def _mp_loop(policy: str, batches, *, accumulate: int = 1, autocast: bool = False):
    """The same training on MixedPrecision."""
    model = _model()
    prec = MixedPrecision(policy)
    model, optimizer = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    for i, (x, y) in enumerate(batches):
        if autocast:
            with prec.autocast():
                out = model(x)
        else:
            out = model(x)
        prec.backward(F.mse_loss(out, y) / accumulate)
        if (i + 1) % accumulate == 0:
            prec.step(optimizer)
            optimizer.zero_grad()
    return model, prec


@pytest.mark.parametrize(("level", "overrides", "policy"), LEVELS, ids=LEVEL_IDS)
def test_apex_loop_equals_mixed_precision_loop_bit_for_bit(level, overrides, policy):
    batches = _batches(5)
    a_model, _ = _apex_loop(level, overrides, batches)
    assert amp._state is not None and amp._state.policy == Policy.parse(policy)
    m_model, prec = _mp_loop(policy, batches, autocast=level == "O1")
    _assert_bitwise(_params(a_model), _params(m_model))
    # the same scale path: the front end's scaler 0 and the MixedPrecision scaler end equal
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == float(prec.scaler.loss_scale)
    if Policy.parse(policy).loss_scale == "dynamic" and Policy.parse(policy).compute_dtype == torch.float16:
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] < 2.0**16, "the overflow batch should have backed off"


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_the_initialized_model_pickles_and_the_loaded_copy_computes_the_same(level):
    """As with Apex, ``torch.save(model)`` works after ``initialize`` (its hooks were closures at first)."""
    model, _ = _apex_loop(level, {}, _batches(2, overflow_at=()))
    model.eval()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(5, 4)
    with torch.no_grad():
        expected, got = model(x), loaded(x)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)
    _assert_bitwise(_params(loaded), _params(model))


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_delay_unscale_accumulation_equals_mixed_precision_accumulation(level):
    batches = _batches(6, overflow_at=(3,))
    a_model, _ = _apex_loop(level, {}, batches, accumulate=2, delay_unscale=True)
    m_model, prec = _mp_loop(APEX_POLICY[level], batches, accumulate=2, autocast=level == "O1")
    _assert_bitwise(_params(a_model), _params(m_model))
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == float(prec.scaler.loss_scale)
    if level in ("O1", "O2"):
        assert float(prec.scaler.loss_scale) == 2.0**15, "the overflowing micro-batch should have backed off"


def _two_loss_loop_apex(level: str, batches, num_losses: int, overflow_at: tuple[int, ...] = ()) -> nn.Module:
    """Two losses from one forward, each in its own scale_loss block (loss_id 0 and num_losses - 1), clipped."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, num_losses=num_losses, verbosity=0)
    for i, (x, y) in enumerate(batches):
        out = model(x)
        loss0 = F.mse_loss(out, y)
        loss1 = (1e4 if i in overflow_at else 0.1) * out.pow(2).mean()
        optimizer.zero_grad()
        with amp.scale_loss(loss0, optimizer, loss_id=0) as scaled_loss:
            scaled_loss.backward(retain_graph=True)
        with amp.scale_loss(loss1, optimizer, loss_id=num_losses - 1) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 0.5)
        optimizer.step()
    return model


def _two_loss_loop_mp(policy: str, batches, autocast: bool, overflow_at: tuple[int, ...] = ()):
    model = _model()
    prec = MixedPrecision(policy)
    model, optimizer = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    for i, (x, y) in enumerate(batches):
        with prec.autocast() if autocast else contextlib.nullcontext():
            out = model(x)
        loss0 = F.mse_loss(out, y)
        loss1 = (1e4 if i in overflow_at else 0.1) * out.pow(2).mean()
        optimizer.zero_grad()
        prec.backward(loss0, retain_graph=True)
        prec.backward(loss1)
        prec.clip_grad_norm_(0.5)
        prec.step(optimizer)
    return model, prec


@pytest.mark.parametrize("num_losses", [1, 2])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_two_losses_equal_mixed_precision_bit_for_bit(level, num_losses):
    # Each block unscales its own gradients and adds them to the earlier ones; MixedPrecision accumulates
    # both scaled backwards and unscales once. With power-of-two scales the two are the same numbers.
    # An overflow only with one scale: two scales drift apart after it, and MixedPrecision has one.
    overflow_at = (2,) if num_losses == 1 else ()
    batches = _batches(5, overflow_at=())
    a_model = _two_loss_loop_apex(level, batches, num_losses, overflow_at)
    m_model, prec = _two_loss_loop_mp(APEX_POLICY[level], batches, level == "O1", overflow_at)
    _assert_bitwise(_params(a_model), _params(m_model))
    scales = [entry["loss_scale"] for entry in amp.state_dict().values()]
    assert len(scales) == num_losses and scales[0] == float(prec.scaler.loss_scale)
    if num_losses == 1 and level in ("O1", "O2"):
        assert scales == [2.0**15], "the overflowing second loss should have backed off"
    assert int(prec.last_step.applied_steps) == (4 if overflow_at and level in ("O1", "O2") else 5)


def _two_models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), nn.Sequential(nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_two_models_two_optimizers_skip_together_as_one_model(level):
    """Apex skips every optimizer of an overflowing scale_loss block, also one whose own gradients are finite.

    At batch 2 a huge penalty on the first model's output overflows its gradients; the second
    model's gradients stay finite. The run must equal one MixedPrecision over both models.
    """
    batches = _batches(5, overflow_at=())
    penalty = [1e4 if i == 2 else 1e-2 for i in range(len(batches))]
    m1, m2 = _two_models()
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=LR, momentum=0.9), torch.optim.SGD(m2.parameters(), lr=LR)
    [m1, m2], [o1, o2] = amp.initialize([m1, m2], [o1, o2], opt_level=level, verbosity=0)
    for (x, y), k in zip(batches, penalty):
        h = m1(x)
        loss = F.mse_loss(m2(h), y) + k * h.float().pow(2).mean()
        o1.zero_grad()
        o2.zero_grad()
        with amp.scale_loss(loss, [o1, o2]) as scaled_loss:
            scaled_loss.backward()
        o1.step()
        o2.step()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15

    r1, r2 = _two_models()
    ref = nn.Sequential(r1, r2)
    prec = MixedPrecision(APEX_POLICY[level])
    ref, opt = prec.prepare(ref, torch.optim.SGD([{"params": r1.parameters(), "momentum": 0.9},
                                                  {"params": r2.parameters()}], lr=LR))
    for (x, y), k in zip(batches, penalty):
        with prec.autocast() if level == "O1" else contextlib.nullcontext():
            # As amp's two prepared models: each casts its input to FP16 under O2 and returns FP32.
            h = r1(x if level == "O1" else x.half()).float()
            out = r2(h if level == "O1" else h.half())
        opt.zero_grad()
        prec.backward(F.mse_loss(out, y) + k * h.float().pow(2).mean())
        prec.step(opt)
    assert int(prec.last_step.applied_steps) == 4
    _assert_bitwise(_params(m1) + _params(m2), _params(r1) + _params(r2))


def test_delay_unscale_misuse_raises_and_zero_grad_ends_the_accumulation():
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), opt_level="O2", num_losses=2,
                                verbosity=0)
    x, y = _batches(1, overflow_at=())[0]
    with amp.scale_loss(F.mse_loss(model(x), y), opt, loss_id=0, delay_unscale=True) as scaled:
        scaled.backward()
    with (
        pytest.raises(ValueError, match=re.escape("scale_loss(loss_id=1) after scale_loss(loss_id=0, delay_unscale=True)")),
        amp.scale_loss(F.mse_loss(model(x), y), opt, loss_id=1),
    ):
        pass
    before = _params(model)
    with pytest.raises(ValueError, match=re.escape("optimizer.step() after scale_loss(..., delay_unscale=True)")):
        opt.step()
    _assert_bitwise(_params(model), before)
    opt.zero_grad()  # discards the scaled gradients: a new accumulation may start with any loss
    with amp.scale_loss(F.mse_loss(model(x), y), opt, loss_id=1) as scaled:
        scaled.backward()
    grads = [m.grad.clone() for m in amp.master_params(opt)]
    ref = _model()
    F.mse_loss(ref(x), y).backward()
    for g, r in zip(grads, (p.grad for p in ref.parameters())):
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-3)  # unscaled, and only this block's gradient
    opt.step()
    assert not torch.equal(_params(model)[0], before[0])


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_model_zero_grad_clears_like_optimizer_zero_grad(level):
    """Apex code often clears the model's gradients; under O2 the stale FP32 master gradients must not come back."""

    def run(clear: str) -> list[torch.Tensor]:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
        for x, y in _batches(4, overflow_at=()):
            loss = F.mse_loss(model(x), y)
            (model if clear == "model" else opt).zero_grad()
            with amp.scale_loss(loss, opt) as scaled_loss:
                scaled_loss.backward()
            opt.step()
        return _params(model)

    _assert_bitwise(run("model"), run("optimizer"))


def test_returned_optimizer_and_master_params():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt2 = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert isinstance(opt2, mixprec.MasterWeightOptimizer) and opt2.optimizer is opt
    masters = list(amp.master_params(opt2))
    assert masters and all(m.dtype == torch.float32 for m in masters)
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32  # BatchNorm island
    assert not any(m is p for m in masters for p in [model[0].weight, model[3].weight])
    model_o1 = _model()
    opt_o1 = torch.optim.SGD(model_o1.parameters(), lr=LR)
    model_o1, returned = amp.initialize(model_o1, opt_o1, opt_level="O1", verbosity=0)
    assert returned is opt_o1, "O1 has no masters: the optimizer itself comes back, as in Apex"
    assert [id(p) for p in amp.master_params(returned)] == [id(p) for p in model_o1.parameters()]


def test_o2_gradients_after_scale_loss_are_unscaled_fp32_masters_for_clipping():
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), opt_level="O2", verbosity=0)
    ref = _model()
    x, y = _batches(1, overflow_at=())[0]
    F.mse_loss(ref(x), y).backward()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        assert float(scaled.detach()) == pytest.approx(float(F.mse_loss(ref(x), y).detach()) * 2**16, rel=1e-2)
        scaled.backward()
    grads = [m.grad for m in amp.master_params(opt)]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    for g, r in zip(grads, (p.grad for p in ref.parameters())):
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-3)  # FP16 forward vs FP32 reference
    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1e-3)  # Apex's clipping recipe works on them
    assert float(torch.stack([g.norm() for g in grads]).norm()) == pytest.approx(1e-3, rel=1e-3)


def test_o1_runs_the_forward_in_fp16_autocast_and_disable_casts_turns_it_off():
    seen: dict[str, torch.dtype] = {}

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.lin(x)
            with amp.disable_casts():
                b = self.lin(x)
            seen["cast"], seen["disabled"] = a.dtype, b.dtype
            return a.float() + b

    net = Net()
    net, _ = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=LR), opt_level="O1", verbosity=0)
    out = net(torch.randn(2, 4))
    assert seen == {"cast": torch.float16, "disabled": torch.float32}
    assert out.dtype == torch.float32 and net.lin.weight.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu"), "autocast must end with the forward"
    with pytest.raises(RuntimeError):  # the region is left also when the forward raises
        net(torch.randn(2, 5))
    assert not torch.is_autocast_enabled("cpu")


def test_return_shapes_follow_what_was_passed():
    m1, m2 = _model(1), _model(2)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=LR), torch.optim.SGD(m2.parameters(), lr=LR)
    models, opts = amp.initialize([m1, m2], [o1, o2], opt_level="O1", verbosity=0)
    assert isinstance(models, list) and models == [m1, m2] and isinstance(opts, list) and opts == [o1, o2]
    m3 = _model(3)
    o3a = torch.optim.SGD(list(m3.parameters())[:2], lr=LR)
    o3b = torch.optim.SGD(list(m3.parameters())[2:], lr=LR)
    model, opts = amp.initialize(m3, [o3a, o3b], opt_level="O2", verbosity=0)
    assert model is m3 and isinstance(opts, list) and len(opts) == 2
    assert all(isinstance(o, mixprec.MasterWeightOptimizer) for o in opts)
    m4 = _model(4)
    only = amp.initialize(m4, opt_level="O2", verbosity=0)  # inference: the model alone
    assert only is m4 and m4[0].weight.dtype == torch.float16
    assert m4.eval()(torch.randn(2, 4)).dtype == torch.float32


@pytest.mark.parametrize("built", ["before", "after"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_lr_scheduler_built_before_or_after_initialize(level, built):
    """Apex code builds its scheduler after initialize (torch's scheduler then wraps the patched step)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5) if built == "before" else None
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    sched = sched or torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()", no "overridden"
        warnings.filterwarnings("ignore", "fp16 on CPU works")
        for x, y in _batches(3, overflow_at=(1,)):
            opt.zero_grad()
            with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled_loss:
                scaled_loss.backward()
            opt.step()
            sched.step()
    assert opt.param_groups[0]["lr"] == 0.1 / 8
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15, "the overflow still skips and backs off"


def test_disabled_amp_changes_nothing():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    got_model, got_opt = amp.initialize(model, opt, enabled=False, opt_level="O2")
    assert got_model is model and got_opt is opt and model[0].weight.dtype == torch.float32
    loss = F.mse_loss(model(torch.randn(16, 4)), torch.zeros(16, 3))
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss


# ----- overflow: skip, scale halving, the log line, per loss id -----------------------------------------------------
def test_overflow_skips_the_step_halves_the_scale_and_prints_apex_line(capsys):
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), opt_level="O2")
    capsys.readouterr()
    before = _params(model)
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    x, y = _batches(1, overflow_at=(0,))[0]
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15  # halved at the block's exit, as Apex
    opt.step()
    assert capsys.readouterr().out == "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0\n"
    _assert_bitwise(_params(model)[:4], before[:4])  # weights, BatchNorm included: untouched
    _assert_bitwise([m.detach() for m in amp.master_params(opt)], masters)
    # a clean step afterwards is applied and prints nothing
    opt.zero_grad()
    x, y = _batches(1, overflow_at=())[0]
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert capsys.readouterr().out == ""
    assert not torch.equal(model[0].weight, before[0])
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 32768.0, "unskipped": 1}}


def test_verbosity_zero_prints_nothing(capsys):
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), opt_level="O1", verbosity=0)
    x, y = _batches(1, overflow_at=(0,))[0]
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert capsys.readouterr().out == ""
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15


def _two_loss_batches(n: int, overflow_loss1_at: tuple[int, ...]) -> list:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(16, 4, generator=g), torch.randn(16, 3, generator=g), 1e4 if i in overflow_loss1_at else 0.1)
            for i in range(n)]


def _two_loss_apex(level: str, batches) -> tuple[nn.Module, list[str]]:
    model = _model(norm=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, num_losses=2, verbosity=0)
    for x, y, k in batches:
        out = model(x)
        loss0 = F.mse_loss(out, y)
        loss1 = k * out.pow(2).mean()
        optimizer.zero_grad()
        with amp.scale_loss(loss0, optimizer, loss_id=0) as scaled_loss:
            scaled_loss.backward(retain_graph=True)
        with amp.scale_loss(loss1, optimizer, loss_id=1) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    return model, []


def _two_loss_reference(level: str, batches) -> tuple[list[torch.Tensor], list[float]]:
    """Apex's algorithm written out: per loss, stash the grads, backward loss*scale_i, unscale the new ones,
    check them, add the stash back, update scale i (x0.5 on overflow, x2 after 2000 clean); skip the step if
    any loss overflowed."""
    model = _model(norm=False)
    scales, unskipped = [2.0**16, 2.0**16], [0, 0]
    if level == "O2":
        masters = [p.detach().clone() for p in model.parameters()]  # exact FP32 weights before the cast
        model.half()
        holders = masters
    else:
        holders = list(model.parameters())
    opt = torch.optim.SGD(holders, lr=LR)
    for x, y, k in batches:
        if level == "O2":
            out = model(x.half()).float()
        else:
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            out = out.float()
        losses = [F.mse_loss(out, y), k * out.pow(2).mean()]
        for p in (*model.parameters(), *holders):
            p.grad = None
        overflow = False
        for i, loss in enumerate(losses):
            stash = [h.grad for h in holders]
            for p, h in zip(model.parameters(), holders):
                p.grad = h.grad = None
            (loss.float() * scales[i]).backward(retain_graph=i == 0)
            inv = torch.tensor(scales[i], dtype=torch.float64).reciprocal().float()
            found = False
            for p, h, old in zip(model.parameters(), holders, stash):
                new = p.grad.float() if level == "O2" else p.grad
                new = new * inv
                found |= not bool(torch.isfinite(new).all())
                h.grad = new if old is None else new + old
            if found:
                scales[i] /= 2.0
                unskipped[i] = 0
            else:
                unskipped[i] += 1
                if unskipped[i] == 2000:
                    scales[i], unskipped[i] = min(2.0**24, scales[i] * 2.0), 0
            overflow |= found
        if not overflow:
            opt.step()
            if level == "O2":
                with torch.no_grad():
                    for p, m in zip(model.parameters(), masters):
                        p.copy_(m)
    return _params(model), scales


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_two_losses_have_their_own_scales_and_match_apex_reference(level):
    batches = _two_loss_batches(5, overflow_loss1_at=(1, 3))
    model, _ = _two_loss_apex(level, batches)
    ref_params, ref_scales = _two_loss_reference(level, batches)
    _assert_bitwise(_params(model), ref_params)
    sd = amp.state_dict()
    assert [sd["loss_scaler0"]["loss_scale"], sd["loss_scaler1"]["loss_scale"]] == ref_scales
    assert ref_scales[0] == 2.0**16 and ref_scales[1] < 2.0**16, "only loss 1 overflowed"


def test_overflow_line_names_the_loss_id(capsys):
    model = _model(norm=False)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), opt_level="O2", num_losses=2)
    capsys.readouterr()
    x, y, _ = _two_loss_batches(1, ())[0]
    out = model(x)
    with amp.scale_loss(F.mse_loss(out, y), opt, loss_id=0) as scaled:
        scaled.backward(retain_graph=True)
    with amp.scale_loss(1e4 * out.pow(2).mean(), opt, loss_id=1) as scaled:
        scaled.backward()
    opt.step()
    assert capsys.readouterr().out == "Gradient overflow.  Skipping step, loss scaler 1 reducing loss scale to 32768.0\n"
    assert amp.state_dict() == {
        "loss_scaler0": {"loss_scale": 65536.0, "unskipped": 1},
        "loss_scaler1": {"loss_scale": 32768.0, "unskipped": 0},
    }


def test_static_scale_overflow_is_skipped_and_said_so(capsys):
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), opt_level="O3",
                                keep_batchnorm_fp32=True)
    capsys.readouterr()
    before = _params(model)
    x, y = _batches(1, overflow_at=(0,))[0]
    with amp.scale_loss(F.mse_loss(model(x), y * 1e3), opt) as scaled:  # FP16 gradients overflow even at scale 1
        scaled.backward()
    opt.step()
    out = capsys.readouterr().out
    assert out.startswith("Gradient overflow.  Skipping step, loss scaler 0 keeps its static loss scale 1.0")
    _assert_bitwise(_params(model)[:4], before[:4])


# ----- checkpoints --------------------------------------------------------------------------------------------------
def test_state_dict_is_apex_shaped_and_round_trips():
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), opt_level="O2", num_losses=3,
                                min_loss_scale=4.0, verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 256.0, "unskipped": 17},
                         "loss_scaler1": {"loss_scale": 8.0, "unskipped": 1999},
                         "loss_scaler2": {"loss_scale": 4.0, "unskipped": 0}})
    sd = amp.state_dict()
    assert list(sd) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
    assert sd["loss_scaler1"] == {"loss_scale": 8.0, "unskipped": 1999}
    assert isinstance(sd["loss_scaler0"]["loss_scale"], float) and isinstance(sd["loss_scaler0"]["unskipped"], int)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True) == sd
    # the loaded unskipped counter drives growth: one clean block more and scaler 1 grows
    x, y = _batches(1, overflow_at=())[0]
    with amp.scale_loss(F.mse_loss(model(x), y), opt, loss_id=1) as scaled:
        scaled.backward()
    assert amp.state_dict()["loss_scaler1"] == {"loss_scale": 16.0, "unskipped": 0}
    # a static scaler saves its scale and its block count
    model3 = _model()
    model3, opt3 = amp.initialize(model3, torch.optim.SGD(model3.parameters(), lr=LR), opt_level="O3", verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 5}})
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 8.0, "unskipped": 5}}


def test_load_state_dict_refuses_foreign_keys_and_warns_on_count():
    model = _model()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), opt_level="O1", verbosity=0)
    with pytest.raises(ValueError, match=re.escape("Unexpected key(s) in state_dict: 'model'")):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}, "model": {}})
    with pytest.raises(ValueError, match="expected {'loss_scale': ..., 'unskipped': ...}"):
        amp.load_state_dict({"loss_scaler0": {"scale": 2.0}})
    with pytest.warns(UserWarning, match=re.escape("the state dict has 2 loss scaler(s), this run uses 1")):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 3},
                             "loss_scaler1": {"loss_scale": 4.0, "unskipped": 0}})
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 3}}


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_resume_from_apex_checkpoint_is_bit_for_bit(level, monkeypatch):
    monkeypatch.setattr(amp, "_GROWTH_INTERVAL", 3)  # let the scale grow within the test: unskipped matters
    batches = _batches(8, overflow_at=(1, 6))

    def run(model, optimizer, part):
        for x, y in part:
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()

    def fresh(seed=0):
        model = _model(seed)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)  # eps above FP16's smallest normal (O3)
        return amp.initialize(model, opt, opt_level=level, verbosity=0)

    model, opt = fresh()
    run(model, opt, batches)
    straight, straight_amp = _params(model), amp.state_dict()

    model, opt = fresh()
    run(model, opt, batches[:4])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}, buf)
    mid = amp.state_dict()
    if level in ("O1", "O2"):
        assert mid == {"loss_scaler0": {"loss_scale": 2.0**15, "unskipped": 2}}  # the next clean block grows it
    else:  # a static scale of 1 counts its blocks
        assert mid == {"loss_scaler0": {"loss_scale": 1.0, "unskipped": 4}}
    buf.seek(0)
    checkpoint = torch.load(buf, weights_only=True)
    model, opt = fresh(seed=7)  # different initial weights: everything must come from the checkpoint
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    run(model, opt, batches[4:])
    _assert_bitwise(_params(model), straight)
    assert amp.state_dict() == straight_amp


# ----- refused and unsupported options ------------------------------------------------------------------------------
ERRORS = [
    ({"opt_level": "01"}, "Unexpected optimization level '01'. Options are 'O0', 'O1', 'O2', 'O3'. Did you mean 'O1'?"),
    ({"opt_level": "o2"}, "Did you mean 'O2'?"),
    ({"opt_level": "O4"}, "Unexpected optimization level 'O4'"),
    ({"opt_level": "O1", "patch_torch_functions": False}, "use opt_level='O0'"),
    ({"opt_level": "O2", "patch_torch_functions": True}, "select opt_level='O1' instead"),
    ({"opt_level": "O1", "cast_model_type": torch.float16}, "O1 inserts casts around Torch functions"),
    ({"opt_level": "O2", "cast_model_type": torch.int8}, "cast_model_type=torch.int8"),
    ({"opt_level": "O1", "keep_batchnorm_fp32": True}, "keep_batchnorm_fp32 should be None"),
    ({"opt_level": "O2", "keep_batchnorm_fp32": "yes"}, "keep_batchnorm_fp32 must be a bool"),
    ({"opt_level": "O1", "master_weights": True}, "master_weights with O1 has no meaning"),
    ({"opt_level": "O3", "min_loss_scale": 1.0}, "min_loss_scale/max_loss_scale bound a dynamic loss scale"),
    ({"opt_level": "O2", "min_loss_scale": 2.0**20}, "min_loss_scale=1048576.0 is above the initial loss scale"),
    ({"opt_level": "O2", "loss_scale": "big"}, "loss_scale='big'; use 'dynamic', a number"),
    ({"opt_level": "O2", "loss_scale": -1.0}, "a static loss scale is a positive finite number"),
    ({"opt_level": "O2", "num_losses": 0}, "num_losses=0"),
    ({"opt_level": "O2", "cast_model_outputs": torch.int32}, "cast_model_outputs=torch.int32"),
]


@pytest.mark.parametrize(("kwargs", "message"), ERRORS, ids=[m[:40] for _, m in ERRORS])
def test_refused_options_raise_with_what_to_use(kwargs, message):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    error = TypeError if "must be a bool" in message else ValueError
    with pytest.raises(error, match=re.escape(message)):
        amp.initialize(model, opt, verbosity=0, **kwargs)
    assert model[0].weight.dtype == torch.float32, "nothing changes when initialize raises"


def test_scale_loss_misuse_raises():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt2 = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = _batches(1, overflow_at=())[0]
    refused = [
        ({"optimizers": opt}, "use the one it returned"),
        ({"optimizers": opt2, "loss_id": 1}, "loss_id=1 but amp.initialize(num_losses=1)"),
        ({"optimizers": opt2, "delay_overflow_check": True}, "delay_overflow_check=True) is not supported"),
    ]
    for kwargs, message in refused:
        with pytest.raises(ValueError, match=re.escape(message)), amp.scale_loss(F.mse_loss(model(x), y), **kwargs):
            pass
    with amp.scale_loss(F.mse_loss(model(x), y), opt2) as scaled:
        scaled.backward()
    with (
        pytest.raises(ValueError, match="would stay scaled and be added to unscaled ones"),
        amp.scale_loss(F.mse_loss(model(x), y), opt2, delay_unscale=True),
    ):
        pass


@pytest.mark.parametrize("name", ["register_half_function", "register_float_function", "register_promote_function"])
def test_o1_function_registries_are_refused_with_the_explicit_cast(name):
    with pytest.raises(ValueError, match=re.escape(f"amp.{name} is not supported")):
        getattr(amp, name)(torch, "bmm")
    with pytest.raises(ValueError, match="disable_casts"):
        amp.half_function(lambda x: x)


def test_missing_attribute_names_the_module():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        amp.no_such_thing  # noqa: B018 - the attribute access is the test


@pytest.mark.parametrize(("level", "preset"), [("O0", "fp32"), ("O1", "fp16-mixed"), ("O2", "fp16-master"),
                                               ("O3", "fp16-pure"), ("o2", "fp16-master"), (" O1 ", "fp16-mixed")])
def test_policy_parse_accepts_apex_opt_levels(level, preset):
    assert Policy.parse(level) == mixprec._policy.PRESETS[preset]
    assert MixedPrecision(level).policy == Policy.parse(preset)


@pytest.mark.parametrize("typo", ["00", "01", "02", "03"])
def test_policy_parse_answers_the_zero_typo(typo):
    right = "O" + typo[1]
    with pytest.raises(ValueError, match=re.escape(f"unknown precision preset {typo!r}; did you mean {right!r}?")):
        Policy.parse(typo)
    with pytest.raises(ValueError, match=re.escape(f"Did you mean {right!r}?")):
        amp.initialize(_model(), opt_level=typo, verbosity=0)


def test_before_initialize_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(amp, "_state", None)
    with pytest.raises(ValueError, match=re.escape("amp.state_dict() before amp.initialize()")):
        amp.state_dict()


# ----- the properties table -----------------------------------------------------------------------------------------
def test_initialize_prints_apex_properties_table(capsys):
    model = _model()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), opt_level="O3", loss_scale="dynamic",
                   keep_batchnorm_fp32="True")
    out = capsys.readouterr().out
    head, after = out.split("After processing overrides, optimization options are:\n")
    assert head.startswith("Selected optimization level O3:  Pure FP16 training.\nDefaults for this optimization level are:\n")
    assert "keep_batchnorm_fp32    : False\nmaster_weights         : False\nloss_scale             : 1.0\n" in head
    assert "Processing user overrides (additional kwargs that are not None)...\n" in head
    assert after.splitlines() == [
        "enabled                : True",
        "opt_level              : O3",
        "cast_model_type        : torch.float16",
        "patch_torch_functions  : False",
        "keep_batchnorm_fp32    : True",
        "master_weights         : False",
        "loss_scale             : dynamic",
        "mixprec policy         : p=f16,c=f16,o=f32,m=none,ls=dynamic,i=norm,tf32=0,comp=none",
    ]


# ----- docs/apex.md -------------------------------------------------------------------------------------------------
DOC = Path(__file__).resolve().parents[1] / "docs" / "apex.md"


def _doc_blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), flags=re.S)


def _exec_doc(code: str, ns: dict) -> dict:
    exec(compile(code, str(DOC), "exec"), ns)  # our own docs
    return ns


def test_docs_side_by_side_runs_and_the_loops_agree_bit_for_bit(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    setup, apex_loop, amp_loop, mp_loop, *others = _doc_blocks("python")
    # 1 -> 2: only the import line changes
    assert apex_loop.startswith("from apex import amp\n") and amp_loop.startswith("from mixprec import apex as amp\n")
    assert apex_loop.splitlines()[1:] == amp_loop.splitlines()[1:]
    assert "MixedPrecision" in mp_loop
    capsys.readouterr()
    a = _exec_doc(setup + amp_loop, {})
    table = capsys.readouterr().out
    assert table == _doc_blocks("text")[1], "the table printed in docs/apex.md is what initialize prints"
    assert (tmp_path / "amp.pt").is_file()
    m = _exec_doc(setup + mp_loop, {})
    assert (tmp_path / "mixprec.pt").is_file()
    _assert_bitwise(_params(a["model"]), _params(m["model"]))
    trained, trained_amp = _params(a["model"]), amp.state_dict()
    # the other examples run; the last one resumes from the checkpoint of the mixprec.apex loop
    assert len(others) == 4 and "amp.load_state_dict" in others[-1]
    for code in others:
        ns = _exec_doc(setup + code, {})
    _assert_bitwise(_params(ns["model"]), trained)
    assert amp.state_dict() == trained_amp
    _assert_bitwise([p.detach() for p in amp.master_params(ns["optimizer"])],
                    [p.detach() for p in amp.master_params(a["optimizer"])])


def test_docs_tables_name_every_refused_option_and_level():
    text = DOC.read_text()
    for level in ("O0", "O1", "O2", "O3"):
        assert f"| `{level}` |" in text
    for name in ("register_half_function", "delay_overflow_check", "patch_torch_functions=False", "_amp_state"):
        assert name in text


# ----- Apex's own patterns (issue 28) --------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_state_dict_is_fp32_at_every_opt_level_and_loads_both_ways(level):
    """Apex's O2/O3 state_dict hook: model.state_dict() is FP32, loads into an FP32 model and back."""
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), opt_level=level, verbosity=0)
    half = level in ("O2", "O3")
    assert (model[0].weight.dtype == torch.float16) is half
    sd = model.state_dict()
    assert all(v.dtype == torch.float32 for k, v in sd.items() if v.is_floating_point()), {k: v.dtype for k, v in sd.items()}
    assert model[0].state_dict()["weight"].dtype == torch.float32  # a submodule's too
    fp32 = _model(seed=3)
    fp32.load_state_dict(sd)  # into an FP32 model
    _assert_bitwise([fp32[0].weight.detach()], [model[0].weight.detach().float()])
    model.load_state_dict(_model(seed=5).state_dict())  # FP32 values back into the (half) model
    want = _model(seed=5)[0].weight.detach().to(model[0].weight.dtype)
    _assert_bitwise([model[0].weight.detach()], [want])
    if level == "O2":  # the masters take the loaded values at the next step (the edit check), then step
        x, y = _batches(1, overflow_at=())[0]
        with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        master = opt.master_for(model[0].weight)
        grad = master.grad.clone()
        opt.step()
        expect = want.float() - LR * grad
        torch.testing.assert_close(master, expect, rtol=0, atol=1e-6)


def _run_o2(seed: int, batches, model=None):
    model = _model(seed) if model is None else model
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), opt_level="O2",
                                verbosity=0)
    return model, opt


def _o2_step(model, opt, batch):
    x, y = batch
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()


def test_two_initialize_calls_interleaved_equal_two_separate_runs():
    """A second initialize (a copy for evaluation, a checkpoint restored beside) leaves the first run working."""
    ba, bb = _batches(6, overflow_at=(2,)), _batches(6, overflow_at=(4,), seed=9)
    alone = []
    for seed, batches in ((0, ba), (1, bb)):
        model, opt = _run_o2(seed, batches)
        for batch in batches:
            _o2_step(model, opt, batch)
        alone.append((_params(model), amp.state_dict()))
    ma, oa = _run_o2(0, ba)
    mb, ob = _run_o2(1, bb)  # the latest initialize: amp.state_dict() is its scalers', as Apex's global state
    for batch_a, batch_b in zip(ba, bb):
        _o2_step(ma, oa, batch_a)
        _o2_step(mb, ob, batch_b)
    _assert_bitwise(_params(ma), alone[0][0])
    _assert_bitwise(_params(mb), alone[1][0])
    assert amp.state_dict() == alone[1][1]
    with pytest.raises(ValueError, match="returned by different amp.initialize calls"), \
            amp.scale_loss(F.mse_loss(ma(ba[0][0]), ba[0][1]), [oa, ob]):
        pass


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(4, 8), nn.LayerNorm(8)

    def forward(self, x):
        return torch.relu(self.norm(self.fc(x)))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_encoder_and_decoder_on_one_optimizer_with_two_losses(level, capsys):
    """One optimizer over two models, one scaler per loss: an overflow in loss 1 backs off scaler 1 only and skips the step."""
    torch.manual_seed(0)
    enc, dec = _Encoder(), nn.Linear(8, 3)
    opt = torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=LR, momentum=0.9)
    [enc, dec], opt = amp.initialize([enc, dec], opt, opt_level=level, num_losses=2, verbosity=1)
    capsys.readouterr()
    if level == "O2":
        assert enc.fc.weight.dtype == dec.weight.dtype == torch.float16 and enc.norm.weight.dtype == torch.float32
    batches = _batches(5, overflow_at=(2,))
    for i, (x, y) in enumerate(batches):
        before = _params(enc) + _params(dec)
        h = enc(x)
        assert h.dtype == torch.float32  # each model keeps its own output cast
        aux = h.pow(2).mean()  # loss 0: never overflows
        with amp.scale_loss(aux, opt, loss_id=0) as scaled:
            scaled.backward(retain_graph=True)
        with amp.scale_loss(F.mse_loss(dec(h), y), opt, loss_id=1) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        after = _params(enc) + _params(dec)
        changed = any(not torch.equal(a, b) for a, b in zip(after, before))
        assert changed is (i != 2), i  # the overflowing step is skipped for both models, as Apex did
    sd = amp.state_dict()
    assert sd["loss_scaler0"]["loss_scale"] == 2.0**16 and sd["loss_scaler0"]["unskipped"] == 5
    assert sd["loss_scaler1"]["loss_scale"] == 2.0**15 and sd["loss_scaler1"]["unskipped"] == 2
    assert "Gradient overflow.  Skipping step, loss scaler 1 reducing loss scale to 32768.0" in capsys.readouterr().out


class _Mixed(nn.Module):
    """FP32 and FP16 parameters side by side (what allow_incoming_model_not_fp32 lets in)."""

    def __init__(self, k: float) -> None:
        super().__init__()
        self.w32 = nn.Parameter(k + torch.arange(3, dtype=torch.float32))
        self.w16 = nn.Parameter(1.0 + k + torch.arange(3, dtype=torch.float16))

    def forward(self, x):
        return (x * self.w32 * self.w16.float()).sum()


def test_half_models_are_refused_without_the_switch():
    model = _Mixed(1.0)
    with pytest.raises(ValueError, match=re.escape("Found param w16 with type torch.float16, expected torch.float32")):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), opt_level="O2", verbosity=0)
    assert model.w32.dtype == torch.float32


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_uncast_models_with_the_switch_train_as_plain_torch(level, monkeypatch):
    """cast_model_type=False and the switch: the models keep their dtypes; two models on one optimizer, two scales."""
    monkeypatch.setattr(amp._amp_state, "allow_incoming_model_not_fp32", True)
    x = torch.ones(3)

    def run(use_amp: bool):
        m0, m1 = _Mixed(1.0), _Mixed(2.0)
        opt = torch.optim.SGD([{"params": m0.parameters(), "lr": 0.25}, {"params": m1.parameters(), "lr": 0.5}],
                              momentum=0.125)
        if use_amp:
            [m0, m1], opt = amp.initialize([m0, m1], opt, opt_level=level, verbosity=0, cast_model_type=False,
                                           num_losses=2)
            amp._amp_state.loss_scalers[0]._loss_scale = 4.0
            amp._amp_state.loss_scalers[1]._loss_scale = 8.0
            assert (m0.w32.dtype, m0.w16.dtype) == (torch.float32, torch.float16)
        grads = []
        for _ in range(3):
            for m in (m0, m1):
                m.zero_grad()
            if use_amp:
                for i, m in enumerate((m0, m1)):
                    with amp.scale_loss(m(x), opt, loss_id=i) as scaled:
                        scaled.backward()
                grads.append([p.grad.float().clone() for p in amp.master_params(opt)])
            else:
                m0(x).backward()
                m1(x).backward()
                grads.append([p.grad.float().clone() for p in (*m0.parameters(), *m1.parameters())])
            opt.step()
        return grads, [p.detach().float().clone() for p in (*m0.parameters(), *m1.parameters())]

    (g_amp, w_amp), (g_ref, w_ref) = run(True), run(False)
    flat = lambda grads, weights: [g for step in grads for g in step] + weights
    for a, b in zip(flat(g_amp, w_amp), flat(g_ref, w_ref)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)  # FP16 weights: half-precision steps on both sides
    if level == "O1":
        amp._amp_state.handle._deactivate()


def test_o2_with_cast_model_type_false_is_fp32_training_with_a_dynamic_scale():
    batches = _batches(4, overflow_at=())
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), opt_level="O2",
                                cast_model_type=False, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not isinstance(opt, mixprec.MasterWeightOptimizer)  # FP32 weights are their own masters
    assert amp._amp_state.opt_properties.cast_model_type is False
    assert amp._amp_state.loss_scalers[0].dynamic and amp._amp_state.loss_scalers[0].loss_scale() == 2.0**16
    ref = _model()
    # fused=True: mixprec steps torch's foreach SGD through its fused kernel (the skip stays on the device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9, fused=True)
    for x, y in batches:
        with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _assert_bitwise(_params(model), _params(ref))  # a power-of-two scale on FP32 gradients is exact


def test_amp_state_reads_and_writes_round_trip_through_state_dict():
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), opt_level="O2", num_losses=2,
                                verbosity=0)
    st = amp._amp_state
    st.loss_scalers[1]._loss_scale = 128.0
    st.loss_scalers[0]._unskipped = 7
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 7},
                                "loss_scaler1": {"loss_scale": 128.0, "unskipped": 0}}
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 512.0, "unskipped": 3},
                         "loss_scaler1": {"loss_scale": 2.0, "unskipped": 1}})
    assert [s.loss_scale() for s in st.loss_scalers] == [512.0, 2.0]
    assert [s._unskipped for s in st.loss_scalers] == [3, 1]
    assert st.opt_properties.opt_level == "O2" and st.opt_properties.master_weights is True
    assert st.handle.is_active()
    st.verbosity = 0
    assert amp._state is not None and amp._state.verbosity == 0
    x, y = _batches(1, overflow_at=())[0]
    with amp.scale_loss(F.mse_loss(model(x), y), opt, loss_id=1) as scaled:
        assert float(scaled) == pytest.approx(2.0 * float(F.mse_loss(model(x), y).float()), rel=1e-3)  # the set scale is used
        scaled.backward()
    with pytest.raises(AttributeError):
        st.hard_override = True  # Apex's error-to-warning switch: not honoured, so not settable
    with pytest.raises(ValueError, match="_loss_scale=-1.0"):
        st.loss_scalers[0]._loss_scale = -1.0


@pytest.mark.parametrize("level", ["O0", "O3"])
def test_static_scale_unskipped_counts_applied_steps_only(level):
    model = _model()
    model, opt = amp.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4), opt_level=level,
                                verbosity=0)
    for i, (x, y) in enumerate(_batches(5, overflow_at=())):
        loss = F.mse_loss(model(x), y)
        with amp.scale_loss(loss * float("inf") if i == 1 else loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1.0, "unskipped": 4}


def test_handle_deactivate_turns_o1_autocast_off():
    model = _model(norm=False)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), opt_level="O1", verbosity=0)
    seen = []
    model[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    x = torch.randn(2, 4)
    model(x)
    amp._amp_state.handle._deactivate()
    assert not amp._amp_state.handle.is_active()
    model(x)
    assert seen == [torch.float16, torch.float32]


@pytest.mark.parametrize(("saved", "restored", "before"), [("O2", "O0", False), ("O2", "O3", True), ("O0", "O2", True),
                                                           ("O1", "O2", False), ("O2", "O2", True)])
def test_optimizer_state_loads_across_opt_levels(saved, restored, before):
    """An optimizer's state_dict() is torch's format at every level (O2 adds its masters): Apex's checkpoints
    restore into another level, before or after initialize."""
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), opt_level=saved,
                                verbosity=0)
    for batch in _batches(3, overflow_at=()):
        _o2_step(model, opt, batch)
    ck = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    assert set(ck["optimizer"]) >= {"state", "param_groups"}
    assert ("masters" in ck["optimizer"]) is (saved == "O2")
    r_model = _model(seed=4)
    r_opt = torch.optim.SGD(r_model.parameters(), lr=LR, momentum=0.9)
    if before:
        r_model, r_opt = amp.initialize(r_model, r_opt, opt_level=restored, verbosity=0)
    r_model.load_state_dict(ck["model"])
    r_opt.load_state_dict(ck["optimizer"])
    if not before:
        r_model, r_opt = amp.initialize(r_model, r_opt, opt_level=restored, verbosity=0)
    want = opt.state_dict()["state"]
    got = r_opt.state_dict()["state"]
    for k in want:
        a, b = got[k]["momentum_buffer"], want[k]["momentum_buffer"]
        exact = a.dtype == b.dtype  # an O3 run holds its state in FP16, as torch's load casts it
        torch.testing.assert_close(a.to(b.dtype), b, rtol=0 if exact else 1e-3, atol=0 if exact else 1e-4)
    if restored == "O2":
        masters = {id(p): m for p, m in zip(r_opt.model_params, r_opt.masters)}
        if saved == "O2":  # the exact masters came along
            for a, b in zip(r_opt.masters, opt.masters):
                assert torch.equal(a, b)
        elif before:  # masters from the loaded (rounded) weights, as Apex rebuilt them
            assert torch.equal(masters[id(r_model[0].weight)], r_model[0].weight.float())
        else:  # loaded into the FP32 model first: the masters are its exact FP32 weights
            assert torch.equal(masters[id(r_model[0].weight)], ck["model"]["0.weight"])
    _o2_step(r_model, r_opt, _batches(1, overflow_at=())[0])  # and it trains on


def test_initialize_twice_says_the_model_was_already_initialized():
    """A second amp.initialize of the same model: a message about that, not Apex's '.half()' one; nothing changes."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape("amp.initialize: model 0 (") + r".*was already initialized"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_o2_does_not_warn_about_its_noop_scaler():
    """amp.initialize O2 (fp16 with masters) scales the loss in scale_loss: the MixedPrecision it builds around a
    NoOpScaler must not say that FP16 gradients run unscaled."""
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    assert not [w for w in caught if "NoOpScaler" in str(w.message)]


def test_the_retired_init_api_and_a_larc_wrapper_get_errors_that_name_the_way() -> None:
    """amp.init() (Apex's pre-initialize API) and amp.initialize(model, LARC(opt)): errors naming what to do instead
    (a bare 'no attribute' and a bare type error before)."""
    import mixprec.apex as amp_mod

    with pytest.raises(AttributeError, match=r"amp.init\(\) is Apex's pre-initialize API .* use model, optimizer = "
                                             r"amp.initialize"):
        amp_mod.init  # noqa: B018

    class LARC:  # Apex's apex.parallel.LARC holds the optimizer it wraps as .optim
        def __init__(self, optim: torch.optim.Optimizer) -> None:
            self.optim = optim

    model = nn.Linear(4, 2)
    with pytest.raises(TypeError, match=r"got LARC; wrap the optimizer amp.initialize returns instead"):
        amp_mod.initialize(model, LARC(torch.optim.SGD(model.parameters(), lr=0.1)), opt_level="O2")


@pytest.mark.parametrize("cast", [torch.float16, torch.bfloat16])
def test_o3_with_sgd_updates_every_weight_on_a_cpu(cast: torch.dtype) -> None:
    """O3 (half weights, no masters) with torch's SGD over a 16x16 Linear: one step changes the weights as plain
    half-precision SGD does (torch's CPU fused SGD, which mixprec routed it through, left them all unchanged)."""
    import mixprec.apex as amp_mod

    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_mod.initialize(model, opt, opt_level="O3", cast_model_type=cast, verbosity=0)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(8, 16, dtype=cast)
    before = model.weight.detach().clone()
    with amp_mod.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    ref(x).float().pow(2).mean().backward()
    ref_opt.step()
    assert (model.weight != before).float().mean() > 0.5
    assert torch.equal(model.weight, ref.weight)


def test_a_damaged_entry_leaves_every_scaler_as_it_was() -> None:
    """amp.load_state_dict checks every entry before loading any (entry 0 was loaded before entry 1 was refused)."""
    import mixprec.apex as amp_mod
    from mixprec._scaler import ScalerStateError

    model = nn.Linear(4, 2)
    amp_mod.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", num_losses=2,
                       cast_model_type=torch.bfloat16, loss_scale="dynamic", verbosity=0)
    before = amp_mod.state_dict()
    with pytest.raises(ScalerStateError, match="unskipped=-1"):
        amp_mod.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 5},
                                 "loss_scaler1": {"loss_scale": 512.0, "unskipped": -1}})
    assert amp_mod.state_dict() == before


def test_an_earlier_initialize_is_freed_once_a_later_one_replaces_it():
    """The optimizer -> run map was a WeakKeyDictionary whose values held their keys: no run was ever freed."""
    import gc
    import weakref

    refs = []
    for _ in range(2):
        model = _model()
        model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), opt_level="O2", verbosity=0)
        refs.append((weakref.ref(model), weakref.ref(optimizer)))
        del model, optimizer
    gc.collect()
    assert [r() is None for r in refs[0]] == [True, True]  # the latest stays: amp's global state, as in Apex
