"""The step protocol of MixedPrecision: one scale update per iteration in every loop shape, and no silent bypass.

Issue 13: GAN-style alternating optimizers, optimizers on different schedules, a direct
``optimizer.step()``, torch's own ``clip_grad_norm_`` on the model, the wrapped optimizer stepped
directly, checkpoints taken in the middle of an iteration.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec._scaler import DynamicScaler

PRESETS = ["fp32", "bf16-mixed", "bf16-master", "bf16-pure", "fp16-mixed", "fp16-master"]


def _scaler() -> DynamicScaler:
    # growth every 2 clean iterations, halve on overflow: short schedules that still move
    return DynamicScaler(init_scale=2.0**10, growth_interval=2, hysteresis=1, log_overflow=False)


class _Schedule:
    """Hand-computed dynamic loss scale: one update per iteration with the OR of its overflow flags."""

    def __init__(self, scale: float = 2.0**10, interval: int = 2) -> None:
        self.scale, self.interval, self.tracker = scale, interval, 0

    def update(self, overflow: bool) -> float:
        if overflow:
            self.scale, self.tracker = self.scale * 0.5, 0
        else:
            self.tracker += 1
            if self.tracker == self.interval:
                self.scale, self.tracker = self.scale * 2.0, 0
        return self.scale


def _two_nets(seed: int = 0) -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(seed)
    d, g = nn.Linear(4, 1), nn.Linear(3, 4)
    return nn.ModuleDict({"d": d, "g": g}), d, g


def _d_loss(model: nn.Module, poison: bool = False) -> torch.Tensor:
    loss = model["d"](torch.randn(8, 4)).pow(2).mean()
    return loss * float("inf") if poison else loss


def _g_loss(model: nn.Module, poison: bool = False) -> torch.Tensor:
    loss = model["d"](model["g"](torch.randn(8, 3))).mean()
    return loss * float("inf") if poison else loss


def test_gan_loop_updates_the_scale_once_per_backward_step_pair():
    model, d, g = _two_nets()
    prec = mp.MixedPrecision("fp32", scaler=_scaler())
    model, opt_d, opt_g = prec.prepare(model, torch.optim.SGD(d.parameters(), lr=0.01),
                                       torch.optim.SGD(g.parameters(), lr=0.01))
    ref = _Schedule()
    seen, expected = [], []
    overflow_d = {3, 4, 9}
    overflow_g = {6}
    for it in range(12):
        opt_d.zero_grad()
        prec.backward(_d_loss(model, it in overflow_d))   # ends the previous (g) iteration
        if it > 0:
            expected.append(ref.update((it - 1) in overflow_g))
            seen.append(prec.scaler.loss_scale.item())
        prec.step(opt_d)
        opt_g.zero_grad()
        prec.backward(_g_loss(model, it in overflow_g))   # ends the d iteration
        expected.append(ref.update(it in overflow_d))
        seen.append(prec.scaler.loss_scale.item())
        prec.step(opt_g)
    assert seen == expected
    assert len(set(seen)) > 2  # the schedule really moved both ways


def test_one_backward_two_optimizers_update_once_after_the_last_step():
    model, d, g = _two_nets()
    prec = mp.MixedPrecision("fp32", scaler=_scaler())
    model, opt_d, opt_g = prec.prepare(model, torch.optim.SGD(d.parameters(), lr=0.01),
                                       torch.optim.SGD(g.parameters(), lr=0.01))
    ref = _Schedule()
    for it in range(10):
        prec.zero_grad()
        prec.backward(_g_loss(model, poison=it in (2, 7)))
        prec.step(opt_d)
        before = prec.scaler.loss_scale.item()
        assert before == ref.scale  # not yet updated after the first of two optimizers
        info = prec.step(opt_g)
        assert prec.scaler.loss_scale.item() == ref.update(it in (2, 7))
        assert bool(info.skipped) == (it in (2, 7))


def test_overflow_in_one_of_two_optimizers_backs_off_and_skips_only_that_one():
    model, d, g = _two_nets()
    prec = mp.MixedPrecision("fp32", scaler=_scaler())
    model, opt_d, opt_g = prec.prepare(model, torch.optim.SGD(d.parameters(), lr=0.01),
                                       torch.optim.SGD(g.parameters(), lr=0.01))
    prec.backward(_g_loss(model))
    g.weight.grad[0, 0] = float("nan")  # only g's gradients are bad
    d_before = copy.deepcopy(d.state_dict())
    g_before = copy.deepcopy(g.state_dict())
    info_d = prec.step(opt_d)
    info_g = prec.step(opt_g)
    assert not bool(info_d.skipped) and bool(info_g.skipped)
    assert not torch.equal(d.weight, d_before["weight"])
    assert torch.equal(g.weight, g_before["weight"])
    assert prec.scaler.loss_scale.item() == 2.0**9


def test_optimizers_on_different_schedules_update_once_per_iteration():
    model, d, g = _two_nets()
    prec = mp.MixedPrecision("fp32", scaler=_scaler())
    model, opt_d, opt_g = prec.prepare(model, torch.optim.SGD(d.parameters(), lr=0.01),
                                       torch.optim.SGD(g.parameters(), lr=0.01))
    ref = _Schedule()
    expected = []
    for it in range(12):
        prec.backward(_d_loss(model, poison=it in (5, 7)) + _g_loss(model))
        if it > 0:  # iteration it-1 has ended, by this backward or by g's step
            assert prec.scaler.loss_scale.item() == expected[-1]
        prec.step(opt_d)
        opt_d.zero_grad()
        if it % 4 == 3:  # g accumulates over four iterations, across scale changes
            prec.step(opt_g)
            opt_g.zero_grad()
        expected.append(ref.update(it in (5, 7)))
    assert expected[3:8] == [2.0**12, 2.0**12, 2.0**11, 2.0**11, 2.0**10]


def test_gradients_held_across_a_scale_change_are_rescaled_exactly():
    """g accumulates while d's iterations change the scale: its update equals the unscaled sum."""
    model, d, g = _two_nets()
    prec = mp.MixedPrecision("fp32", scaler=_scaler())
    model, opt_d, opt_g = prec.prepare(model, torch.optim.SGD(d.parameters(), lr=1.0),
                                       torch.optim.SGD(g.parameters(), lr=1.0))
    total = torch.zeros_like(g.weight)
    for it in range(4):
        torch.manual_seed(100 + it)
        loss = _g_loss(model, poison=False)
        plain = torch.autograd.grad(loss, g.weight, retain_graph=True)[0]
        total += plain
        prec.backward(loss)
        prec.step(opt_d)  # d's steps end iterations: the scale grows on the way
        opt_d.zero_grad()
    assert prec.scaler.loss_scale.item() == 2.0**11
    w0 = g.weight.detach().clone()
    prec.step(opt_g)
    torch.testing.assert_close(w0 - g.weight.detach(), total, rtol=1e-6, atol=1e-7)


def test_manual_scale_update_only_at_update():
    model, d, g = _two_nets()
    prec = mp.MixedPrecision("fp32", scaler=_scaler(), scale_update="manual")
    model, opt_d, opt_g = prec.prepare(model, torch.optim.SGD(d.parameters(), lr=0.01),
                                       torch.optim.SGD(g.parameters(), lr=0.01))
    ref = _Schedule()
    for it in range(6):
        prec.zero_grad()
        prec.backward(_d_loss(model, poison=it == 2))
        prec.step(opt_d)
        prec.backward(_g_loss(model))
        prec.step(opt_g)
        assert prec.scaler.loss_scale.item() == ref.scale
        prec.update()
        assert prec.scaler.loss_scale.item() == ref.update(it == 2)
    with pytest.raises(ValueError, match=re.escape("scale_update='sometimes'; use 'auto' (default) or 'manual'")):
        mp.MixedPrecision("fp32", scale_update="sometimes")  # type: ignore[arg-type]


def test_escalation_fires_with_two_optimizers():
    model, d, g = _two_nets()
    scaler = DynamicScaler(init_scale=2.0**4, growth_interval=100, min_scale=1.0, patience=3, check_interval=1,
                           log_overflow=False)
    prec = mp.MixedPrecision("fp32", scaler=scaler)
    model, opt_d, opt_g = prec.prepare(model, torch.optim.SGD(d.parameters(), lr=0.01),
                                       torch.optim.SGD(g.parameters(), lr=0.01))
    with pytest.raises(mp.NumericsError):
        for _ in range(40):
            prec.backward(_d_loss(model, poison=True))
            prec.step(opt_d)
            prec.backward(_g_loss(model, poison=True))
            prec.step(opt_g)
            prec.zero_grad()


def test_checkpoint_between_two_optimizers_resumes_the_same_schedule():
    # The pending flag of an unfinished iteration travels in the checkpoint (key "iteration").
    model, d, g = _two_nets()
    prec = mp.MixedPrecision("fp32", scaler=_scaler())
    model, opt_d, opt_g = prec.prepare(model, torch.optim.SGD(d.parameters(), lr=0.01),
                                       torch.optim.SGD(g.parameters(), lr=0.01))
    prec.backward(_g_loss(model, poison=True))
    prec.step(opt_d)
    state = prec.state_dict()
    assert state["version"] == 2 and state["iteration"]["stepped"] == [True, False]
    assert state["iteration"]["found_inf"].item() == 1.0
    model2, d2, g2 = _two_nets()
    prec2 = mp.MixedPrecision("fp32", scaler=_scaler())
    model2, opt_d2, opt_g2 = prec2.prepare(model2, torch.optim.SGD(d2.parameters(), lr=0.01),
                                           torch.optim.SGD(g2.parameters(), lr=0.01))
    prec2.load_state_dict(state)
    prec2.backward(_g_loss(model2))
    prec2.step(opt_g2)  # ends the resumed iteration with the saved overflow: backoff
    assert prec2.scaler.loss_scale.item() == 2.0**9


# ----- no silent bypass -------------------------------------------------------------------------------------
def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _data(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(n)]


def _train(preset: str, direct: bool, poison_at: int | None = None) -> tuple[dict, mp.MixedPrecision]:
    model = _mlp()
    prec = mp.MixedPrecision(preset)
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for i, (x, y) in enumerate(_data()):
        with prec.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        if i == poison_at:
            loss = loss * float("nan")
        prec.backward(loss)
        if direct:
            opt.step()
        else:
            prec.step(opt)
        opt.zero_grad(set_to_none=True)
    return mp.checkpoint.fp32_state_dict(prec), prec


@pytest.mark.parametrize("preset", PRESETS)
def test_direct_optimizer_step_equals_prec_step(preset):
    via_prec, p1 = _train(preset, direct=False, poison_at=2)
    direct, p2 = _train(preset, direct=True, poison_at=2)
    for k in via_prec:
        assert torch.equal(via_prec[k], direct[k]), k
    assert p1.scaler.loss_scale.item() == p2.scaler.loss_scale.item()
    assert int(p2.last_step.applied_steps) == 5  # the poisoned step was skipped
    assert torch.equal(p1.state_dict()["applied_steps"], p2.state_dict()["applied_steps"])


def test_direct_step_with_closure_and_an_lr_scheduler():
    model = _mlp()
    prec = mp.MixedPrecision("bf16-master")
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = _data(1)[0]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        with prec.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        prec.backward(loss)
        return loss

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        loss = opt.step(closure)
        sched.step()
    assert isinstance(loss, torch.Tensor) and prec.last_step is not None
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    with pytest.raises(TypeError, match=re.escape("optimizer.step() of a prepared optimizer takes only an optional")):
        opt.step(closure, 3)


@pytest.mark.parametrize("preset", ["bf16-master", "fp16-master", "bf16-pure"])
def test_the_optimizer_passed_to_prepare_refuses_a_direct_step(preset):
    model = _mlp()
    raw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prec = mp.MixedPrecision(preset)
    model, opt = prec.prepare(model, raw)
    with prec.autocast():
        loss = model(torch.randn(4, 8)).float().mean() * 1e-3  # no FP16 overflow at the initial scale
    prec.backward(loss)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=re.escape("was called on the optimizer passed to prepare()")):
        raw.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.step()  # the right one still works
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("preset", ["fp16-mixed", "fp16-master"])
def test_plain_loss_backward_under_a_scaling_policy_is_caught(preset):
    model = _mlp()
    prec = mp.MixedPrecision(preset)
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with prec.autocast():
        model(torch.randn(4, 8)).float().sum().backward()
    with pytest.raises(ValueError, match=re.escape("Call prec.backward(loss) instead of loss.backward()")):
        opt.step()


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master", "fp32"])
def test_plain_loss_backward_without_scaling_steps_like_prec_backward(preset):
    def run(plain: bool) -> dict:
        model = _mlp()
        prec = mp.MixedPrecision(preset)
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for x, y in _data(4):
            with prec.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward() if plain else prec.backward(loss)
            opt.step()
            model.zero_grad()
        return mp.checkpoint.fp32_state_dict(prec)

    a, b = run(True), run(False)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _true_norm(preset: str, unscale_first: bool) -> tuple[float, float, mp.MixedPrecision]:
    model = _mlp()
    ref = copy.deepcopy(model)
    x, y = _data(1)[0]
    nn.functional.mse_loss(ref(x), y).backward()
    true = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
    prec = mp.MixedPrecision(preset)
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with prec.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
    prec.backward(loss)
    if unscale_first:
        prec.unscale_(opt)
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3).item()
    return true, got, prec


TOL = {"fp32": 1e-6, "bf16-mixed": 3e-2, "bf16-master": 3e-2, "bf16-pure": 3e-2, "fp16-mixed": 5e-3, "fp16-master": 5e-3}


@pytest.mark.parametrize("preset", PRESETS)
def test_torch_clip_grad_norm_on_the_model_sees_the_true_norm_and_clips_what_the_step_uses(preset):
    # FP16 policies: after prec.unscale_(opt), as torch.amp asks; the others need no call.
    true, got, prec = _true_norm(preset, unscale_first=preset.startswith("fp16"))
    assert got == pytest.approx(true, rel=TOL[preset])
    opt = prec.optimizers[0]
    # the gradients the step will use were clipped to 1e-3 (and unscaled: no scale left in them)
    used = [t.grad for g in opt.param_groups for t in g["params"] if t.grad is not None]
    assert torch.nn.utils.get_total_norm(used).item() == pytest.approx(1e-3, rel=1e-3)


def test_torch_clip_grad_norm_of_scaled_master_gradients_is_a_clear_error():
    with pytest.raises(ValueError, match=r"a gradient of this model was used by torch op '\w+' while it still carries "
                                         r"the loss scale \(policy 'fp16-master'\), so the result would be off by the scale; "
                                         r"call prec.unscale_\(optimizer\) first"):
        _true_norm("fp16-master", unscale_first=False)


def test_prec_clip_and_torch_clip_agree_under_fp16_master():
    _, got, _ = _true_norm("fp16-master", unscale_first=True)
    model = _mlp()
    prec = mp.MixedPrecision("fp16-master")
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(1)[0]
    with prec.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
    prec.backward(loss)
    assert prec.clip_grad_norm_(1e-3).item() == pytest.approx(got, rel=1e-6)


def _fp16_master_after_backward() -> tuple[mp.MixedPrecision, torch.optim.Optimizer, nn.Module]:
    model = _mlp()
    prec = mp.MixedPrecision("fp16-master")
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(1)[0]
    with prec.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
    prec.backward(loss)
    return prec, opt, model


@pytest.mark.parametrize("read", ["detach", "data"])
def test_reads_through_detach_or_data_of_a_scaled_master_gradient_raise_as_p_grad_does(read: str) -> None:
    # timm's adaptive clipping and older torch clipping read p.grad.detach(): unguarded, it saw the scaled value.
    prec, opt, model = _fp16_master_after_backward()
    w = model[0].weight
    with pytest.raises(ValueError, match="used by torch op 'linalg_vector_norm' while it still carries the loss scale"):
        (w.grad.detach() if read == "detach" else w.grad.data).norm()
    prec.unscale_(opt)
    true = w.grad.norm()
    got = (w.grad.detach() if read == "detach" else w.grad.data).norm()
    assert got.dtype == torch.float32 and torch.equal(got, true)
    assert 0 < true.item() < 100  # unscaled (the scale is 2**16)


EDITS = {
    "fill_(0)": lambda g, m: g.fill_(0),
    "masked_fill_(m, 0)": lambda g, m: g.masked_fill_(m, 0),
    "mul_(mask)": lambda g, m: g.mul_(~m),
    "mul_(0.5)": lambda g, m: g.mul_(0.5),
    "div_(2)": lambda g, m: g.div_(2),
    "data.fill_(0)": lambda g, m: g.data.fill_(0),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_scale_free_gradient_edits_before_the_unscale_match_fp16_mixed(edit: str) -> None:
    """Edits that commute with the loss scale work before prec.unscale_ under fp16-master, as torch.amp allows."""
    weights = {}
    for preset in ["fp16-mixed", "fp16-master"]:
        model = _mlp()
        prec = mp.MixedPrecision(preset)
        model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in _data(3):
            with prec.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            prec.backward(loss)
            g = model[0].weight.grad
            EDITS[edit](g, torch.arange(g.numel()).reshape(g.shape) % 3 == 0)
            prec.step(opt)
            opt.zero_grad()
        weights[preset] = model[0].weight.detach().float().clone()
    before = _mlp()[0].weight.detach()
    assert not torch.equal(weights["fp16-master"], before)
    # fp16-mixed keeps its gradients in FP16, fp16-master in FP32: equal to FP16 rounding of the update
    torch.testing.assert_close(weights["fp16-master"], weights["fp16-mixed"], atol=2e-3, rtol=0)
    if edit in ("fill_(0)", "data.fill_(0)"):
        torch.testing.assert_close(weights["fp16-master"], before, atol=1e-3, rtol=0)


def test_a_scale_dependent_edit_of_a_scaled_master_gradient_names_the_op() -> None:
    prec, opt, model = _fp16_master_after_backward()
    with pytest.raises(ValueError, match="used by torch op 'clamp_' while it still carries the loss scale"):
        model[0].weight.grad.clamp_(-1, 1)
    with pytest.raises(ValueError, match="used by torch op 'fill_'"):
        model[0].weight.grad.fill_(1.0)  # a value: right only for unscaled gradients
    prec.unscale_(opt)
    model[0].weight.grad.clamp_(-1e-3, 1e-3)
    assert model[0].weight.grad.abs().max().item() == pytest.approx(1e-3)  # clamped, in FP32


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master", "fp16-mixed", "fp16-master"])
def test_lr_scheduler_built_before_or_after_prepare_sees_direct_steps(preset: str, when: str) -> None:
    """torch's scheduler marks optimizer.step; the step guard keeps the mark, so no spurious warnings."""
    import warnings

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    given = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(given, 1, gamma=0.5) if when == "before" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU
        prec = mp.MixedPrecision(preset, scaler=DynamicScaler(init_scale=16.0) if preset.startswith("fp16") else None)
        model, opt = prec.prepare(model, given)
    if sched is None:
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "overridden after scheduler initialization", "called before optimizer.step()"
        for _ in range(3):
            with prec.autocast():
                loss = model(torch.randn(3, 4)).float().sum()
            prec.backward(loss)
            opt.step()
            opt.zero_grad()
            sched.step()
    assert sched.get_last_lr() == [0.125] and opt.param_groups[0]["lr"] == 0.125
    assert int(prec.last_step.applied_steps) == 3 if prec.last_step is not None else False


def test_scheduler_built_before_prepare_keeps_driving_a_converted_optimizer_after_a_resume() -> None:
    """bf16-pure replaces the torch optimizer; load_state_dict replaces its group dicts: the scheduler must follow."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    given = torch.optim.AdamW(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(given, lambda s: 0.5**s)
    prec = mp.MixedPrecision("bf16-pure")
    model, opt = prec.prepare(model, given)
    assert opt is not given

    def step() -> None:
        prec.backward(model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum())
        prec.step(opt, schedulers=[sched])
        opt.zero_grad()

    step()
    assert opt.param_groups[0]["lr"] == 0.5
    prec.load_state_dict(copy.deepcopy(prec.state_dict()))
    step()
    assert sched.get_last_lr() == [0.25] and opt.param_groups[0]["lr"] == 0.25
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # a framework loading the optimizer directly
    step()
    assert opt.param_groups[0]["lr"] == 0.125


def test_schedulers_take_any_iterable_and_refuse_a_lone_scheduler_before_stepping() -> None:
    """step(schedulers=...) accepts dict.values() and generators (as before the ReduceLROnPlateau check); a lone
    scheduler or a ReduceLROnPlateau is refused before the optimizer steps."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    prec = mp.MixedPrecision("bf16-mixed")
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    scheds = {"a": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)}

    def backward() -> None:
        with prec.autocast():
            prec.backward(model(torch.ones(2, 4)).float().sum())

    backward()
    prec.step(opt, schedulers=scheds.values())
    opt.zero_grad()
    backward()
    prec.step(opt, schedulers=(s for s in scheds.values()))
    assert opt.param_groups[0]["lr"] == 0.25
    opt.zero_grad()
    backward()
    before = model.weight.detach().clone()
    with pytest.raises(TypeError, match="got one StepLR; pass schedulers=\\[scheduler\\]"):
        prec.step(opt, schedulers=scheds["a"])  # type: ignore[arg-type]
    assert torch.equal(model.weight, before) and int(prec.applied_steps) == 2


def test_a_scheduler_advances_for_an_applied_step_whose_scale_update_escalates() -> None:
    """Two optimizers, A's gradients always NaN: the escalation raised from the scale update after B's applied step
    left B's scheduler a step behind (the schedulers advanced after the update)."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    model = nn.ModuleDict({"a": a, "b": b})
    prec = mp.MixedPrecision("p=f32,c=f32,ls=dynamic", scaler=mp.DynamicScaler(
        init_scale=4.0, min_scale=1.0, on_failure="raise", patience=2, check_interval=1))
    model, oa, ob = prec.prepare(model, torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(ob, 1, gamma=0.5)
    caught, applied_b = False, 0
    for _ in range(8):
        x = torch.randn(3, 4)
        prec.backward(model["a"](x).sum() * float("nan") + model["b"](x).sum())
        prec.step(oa)
        try:
            prec.step(ob, schedulers=[sched])
        except mp.NumericsError:
            caught = True
            break
        finally:
            assert prec.last_step is not None
            applied_b += int(prec.last_step.applied())  # B's step, also the one whose scale update raised
            oa.zero_grad()
            ob.zero_grad()
    assert caught and applied_b >= 2
    assert sched.last_epoch == applied_b


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master", "fp16-mixed", "fp16-master"])
@pytest.mark.parametrize("clear", ["optimizer", "model", "zeros"])
def test_a_batch_skipped_on_its_gradient_norm_after_clipping_is_dropped(preset: str, clear: str) -> None:
    """norm = prec.clip_grad_norm_(c); if too large: zero_grad and go on (raised 'call step() first')."""
    def run(skip_batch: bool) -> tuple[torch.Tensor, float, int]:
        model = _mlp()
        prec = mp.MixedPrecision(preset, scaler=_scaler() if preset.startswith("fp16") else None)
        model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for i, (x, y) in enumerate(_data(4)):
            if i == 1 and not skip_batch:
                continue  # the reference never sees batch 1
            with prec.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            prec.backward(loss * float("inf") if i == 1 else loss)
            norm = prec.clip_grad_norm_(1e3)
            if i == 1:
                assert not torch.isfinite(norm)
                if clear == "zeros":
                    opt.zero_grad(set_to_none=False)  # cleared to zeros: the documented alternative
                else:
                    (opt if clear == "optimizer" else model).zero_grad()
                continue
            prec.step(opt)
            opt.zero_grad()
        return model[0].weight.detach().float().clone(), float(prec.scaler.loss_scale), int(prec.applied_steps)

    skipped, scale_skipped, applied_skipped = run(True)
    ref, scale_ref, applied_ref = run(False)
    assert torch.equal(skipped, ref)  # the dropped batch changed no weight
    assert applied_skipped == applied_ref == 3
    if preset.startswith("fp16"):
        assert scale_skipped == scale_ref / 2  # its overflow backed the scale off, as scaler.update() would


def test_backward_after_clip_with_the_gradients_still_there_says_how_to_skip() -> None:
    model = _mlp()
    prec = mp.MixedPrecision("bf16-mixed")
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(1)[0]
    for _ in range(2):
        with prec.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        if _:
            with pytest.raises(ValueError, match=r"call step\(\) first, or, to skip this batch, clear the gradients"):
                prec.backward(loss)
        else:
            prec.backward(loss)
            prec.clip_grad_norm_(1.0)


def test_logging_idioms_on_detached_master_gradients_work_after_the_unscale_and_raise_before() -> None:
    import io
    import pickle

    prec, opt, model = _fp16_master_after_backward()
    g = model[0].weight.grad
    for read in (lambda: g.detach().cpu().numpy(), lambda: g.data.tolist(), lambda: copy.deepcopy(g.detach()),
                 lambda: pickle.dumps(g.detach())):
        with pytest.raises(ValueError, match="while it still carries the loss scale"):
            read()
    prec.unscale_(opt)
    master = opt.master_for(model[0].weight).grad
    assert (g.detach().cpu().numpy() == master.numpy()).all()
    assert g.data.tolist() == master.tolist()
    copied = copy.deepcopy(g.data)
    assert type(copied) is torch.Tensor and torch.equal(copied, master) and copied.data_ptr() != master.data_ptr()
    buf = io.BytesIO()
    torch.save(g.detach(), buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=True), master)


def test_zeroing_gradient_rows_by_mask_before_the_unscale_matches_after() -> None:
    results = []
    for before in (True, False):
        prec, opt, model = _fp16_master_after_backward()
        mask = torch.zeros(16, dtype=torch.bool)
        mask[::3] = True
        if not before:
            prec.unscale_(opt)
        model[0].weight.grad[mask] = 0  # index_put_ of a Python 0: scale-free
        prec.step(opt)
        results.append(model[0].weight.detach().clone())
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    prec, opt, model = _fp16_master_after_backward()
    with pytest.raises(ValueError, match="torch op 'slice'"):
        model[0].weight.grad[:4] = 0


def test_a_scaled_read_in_a_gradient_hook_of_a_single_process_is_caught() -> None:
    model = _mlp()
    prec = mp.MixedPrecision("fp16-master")
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.norm()))
    x, y = _data(1)[0]
    for micro in range(2):  # the second backward accumulates into the view: its read goes through the check
        with prec.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        if micro:
            with pytest.raises(ValueError, match="while it still carries the loss scale"):
                prec.backward(loss)
        else:
            prec.backward(loss)


def test_a_checkpoint_right_after_a_skipped_batch_keeps_its_scale_back_off() -> None:
    def build() -> tuple[mp.MixedPrecision, nn.Module, torch.optim.Optimizer]:
        model = _mlp()
        prec = mp.MixedPrecision("fp16-mixed", scaler=_scaler())
        model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return prec, model, opt

    def batch(prec: mp.MixedPrecision, model: nn.Module, opt: torch.optim.Optimizer, i: int, skip: bool) -> None:
        x, y = _data(4)[i]
        with prec.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        prec.backward(loss * float("inf") if skip else loss)
        prec.clip_grad_norm_(1e3)
        if skip:
            opt.zero_grad()
            return
        prec.step(opt)
        opt.zero_grad()

    prec, model, opt = build()
    batch(prec, model, opt, 0, False)
    batch(prec, model, opt, 1, True)
    state = copy.deepcopy(prec.state_dict())
    for i in (2, 3):
        batch(prec, model, opt, i, False)
    prec2, model2, opt2 = build()
    prec2.load_state_dict(state)
    for i in (2, 3):
        batch(prec2, model2, opt2, i, False)
    assert float(prec2.scaler.loss_scale) == float(prec.scaler.loss_scale)
    assert prec2.scaler.statistics()["skipped_steps"] == prec.scaler.statistics()["skipped_steps"] == 1
    assert torch.equal(model2[0].weight, model[0].weight)


@pytest.mark.parametrize("preset", ["fp16-mixed", "fp16-master", "bf16-master"])
def test_state_dict_between_clip_and_step_of_an_all_zero_gradient_batch_changes_nothing(preset: str) -> None:
    # a fully masked batch: its gradients are exactly zero and still that step's (state_dict folded them as cleared)
    def run(save: bool) -> torch.Tensor:
        model = _mlp()
        prec = mp.MixedPrecision(preset, scaler=_scaler() if preset.startswith("fp16") else None)
        model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for i, (x, y) in enumerate(_data(3)):
            with prec.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            prec.backward(loss * 0 if i == 1 else loss)
            prec.clip_grad_norm_(1.0)
            if save:
                prec.state_dict()
            prec.step(opt)
            opt.zero_grad(set_to_none=False)
        return model[0].weight.detach().float().clone()

    assert torch.equal(run(True), run(False))
