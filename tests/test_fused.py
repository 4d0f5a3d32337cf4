"""``mixprec._fused``: the compiled step of a plain torch optimizer, and when ``fused=None`` turns it on.

Asserted: ``runs_compiled`` sees a compiled region in a loss's graph in both orders of
``torch.compile`` and ``prepare``, and not in an eager one; a plain policy (``bf16-mixed``) with
``fused=True`` tracks torch's own AdamW step to FP32 rounding, skips an inf/NaN step leaving
parameters and state bit-identical, runs the torch optimizer's step hooks and follows its LR
scheduler; ``fused=None`` keeps torch's step on an eager model and fuses once the model runs
compiled; a ``load_state_dict`` of the wrapped optimizer rebinds the fused step to the new
state (it used to keep stepping the old moments); ``fused=True`` refuses an optimizer it cannot
fuse. One small structure, so the file compiles a handful of fused steps (cached process-wide).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec._fused import FusedShadow, runs_compiled

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-7)}  # one AdamW step: FP32 rounding, no fused multiply-add


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(n)]


def _prepared(preset: str = "bf16-mixed", fused: bool | None = True, compiled: bool = False,
              lr: float = 1e-2) -> tuple[mp.MixedPrecision, Any, torch.optim.Optimizer]:
    model = _model()
    prec = mp.MixedPrecision(preset, fused=fused)
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, foreach=True))
    if compiled:
        model = torch.compile(model)  # Inductor: what turns fused=None on
    return prec, model, opt


def _train(prec: mp.MixedPrecision, model: Any, opt: torch.optim.Optimizer, batches: list[Any],
           poison: int | None = None) -> list[float]:
    losses = []
    for i, (x, y) in enumerate(batches):
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        if i == poison:
            loss = loss * float("inf")
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _shadow(prec: mp.MixedPrecision) -> FusedShadow | None:
    return next(iter(prec._records.values())).shadow


def _ran_fused(shadow: FusedShadow | None) -> bool:
    return shadow is not None and shadow._view is not None and bool(shadow._view._fused_fns)


def test_runs_compiled_finds_an_inductor_region_in_either_order() -> None:
    x = torch.randn(2, 6)
    assert not runs_compiled(_model()(x).sum())
    assert not runs_compiled(torch.ones(()))  # no graph at all
    assert not runs_compiled(torch.compile(_model(), backend="aot_eager")(x).sum())  # a debugging backend
    for order in ("prepare-first", "compile-first"):
        m = _model()
        prec = mp.MixedPrecision("bf16-mixed", fused=False)
        if order == "compile-first":
            m = torch.compile(m)
        m, _ = prec.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
        if order == "prepare-first":
            m = torch.compile(m)
        with prec.autocast():
            loss = m(x).float().sum() * 2  # the compiled region sits below eager ops
        assert runs_compiled(loss), order


def test_fused_plain_step_tracks_torch_adamw_and_skips_bit_identically() -> None:
    batches = _data(5)
    ref_prec, ref_model, ref_opt = _prepared(fused=False)
    prec, model, opt = _prepared(fused=True)
    assert opt.__class__ is torch.optim.AdamW  # the user's optimizer, not a replacement
    for i, batch in enumerate(batches):
        skip = i == 2
        before = [p.detach().clone() for p in model.parameters()]
        state_before = copy.deepcopy(opt.state_dict()["state"])
        for pr, m, o in ((ref_prec, ref_model, ref_opt), (prec, model, opt)):
            _train(pr, m, o, [batch], poison=0 if skip else None)
        assert _ran_fused(_shadow(prec)) and not _ran_fused(_shadow(ref_prec))
        if skip:
            assert bool(prec.last_step.skipped)
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            after = opt.state_dict()["state"]
            for k, st in state_before.items():
                for name, v in st.items():
                    assert torch.equal(v, after[k][name]), (k, name)
        for a, b in zip(ref_model.parameters(), model.parameters()):
            torch.testing.assert_close(b, a, **TOL[torch.float32])
    ref_states = ref_opt.state_dict()["state"]
    for k, st in opt.state_dict()["state"].items():
        torch.testing.assert_close(st["exp_avg"], ref_states[k]["exp_avg"], rtol=1e-5, atol=1e-8)
        assert float(st["step"]) == float(ref_states[k]["step"]) == 4.0  # the skipped step did not count


def test_fused_plain_step_runs_the_step_hooks_and_follows_the_scheduler() -> None:
    prec, model, opt = _prepared(fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    calls: list[tuple[str, Any]] = []
    h1 = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o)))
    h2 = opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o)))
    with warnings.catch_warnings():
        # the fused step marks torch's step as run: no "lr_scheduler.step() before optimizer.step()"
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*optimizer.step")
        for batch in _data(3):
            _train(prec, model, opt, [batch])
            sched.step()
    assert calls == [("pre", opt), ("post", opt)] * 3
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 3)
    assert _ran_fused(_shadow(prec))
    # The learning rate the fused step used is the scheduler's: a zero LR freezes the weights
    # (weight decay is multiplied by it too).
    for g in opt.param_groups:
        g["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    _train(prec, model, opt, _data(1))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    h1.remove()
    h2.remove()


def test_fused_none_keeps_torchs_own_step_even_for_a_compiled_model() -> None:
    """A plain policy's torch AdamW compiles nothing unless fused=True: torch's fused kernel (its twin) steps it."""
    batches = _data(4)
    prec, model, opt = _prepared(fused=None)
    _train(prec, model, opt, batches)
    assert prec._seen_compiled is False and _shadow(prec) is None

    prec_c, model_c, opt_c = _prepared(fused=None, compiled=True)
    losses_c = _train(prec_c, model_c, opt_c, batches)
    assert prec_c._seen_compiled is True and _shadow(prec_c) is None
    prec_f, model_f, opt_f = _prepared(fused=True, compiled=True)
    losses_f = _train(prec_f, model_f, opt_f, batches)
    assert _ran_fused(_shadow(prec_f))
    losses = _train(*_prepared(fused=False), batches)
    # BF16 autocast forward in all (Inductor's and eager kernels), steps equal to FP32 rounding.
    assert losses_c == pytest.approx(losses, rel=2e-2) and losses_f == pytest.approx(losses_c, rel=2e-2)


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master"])
def test_load_state_dict_rebinds_the_fused_step(preset: str) -> None:
    """torch's load_state_dict replaces the optimizer's state and param_groups; the fused step must follow."""
    batches = _data(7)
    runs = []
    for fused in (False, True):
        prec, model, opt = _prepared(preset, fused=fused)
        _train(prec, model, opt, batches[:3])
        saved = copy.deepcopy(prec.state_dict())
        _train(prec, model, opt, batches[3:5])  # moves state on; the load must bring it back
        prec.load_state_dict(saved)
        for g in opt.param_groups:
            g["lr"] = 3e-2  # a hyper-parameter change after the load must reach the fused step
        _train(prec, model, opt, batches[5:])
        runs.append((prec, model, opt))
    (_, m_ref, o_ref), (p_f, m_f, o_f) = runs
    for a, b in zip(m_ref.parameters(), m_f.parameters()):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=1e-3)  # BF16 weights of the master policy
    s_ref, s_f = o_ref.state_dict(), o_f.state_dict()
    inner_ref = s_ref.get("optimizer", s_ref)["state"]
    inner_f = s_f.get("optimizer", s_f)["state"]
    for k in inner_ref:
        assert float(inner_f[k]["step"]) == float(inner_ref[k]["step"]) == 5.0


def test_fused_true_refuses_an_optimizer_it_cannot_fuse() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"fused step covers torch.optim.AdamW, Adam and SGD, got torch.optim.rmsprop.RMSprop"):
        mp.MixedPrecision("bf16-mixed", fused=True).prepare(model, torch.optim.RMSprop(model.parameters(), lr=0.1))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing changed
    with pytest.raises(ValueError, match="differentiable=True"):
        mp.MixedPrecision("bf16-mixed", fused=True).prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1, differentiable=True))
    # torch's own fused kernel is already one kernel: kept as it is.
    prec = mp.MixedPrecision("bf16-mixed", fused=True)
    _, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))
    assert _shadow(prec) is None


def test_fused_sgd_with_dampening_continues_torchs_momentum_buffers() -> None:
    """torch's SGD keeps no "step": buffers from its own steps (before prepare, or a torch checkpoint) must not
    make the fused step's next update a first one (coefficient 1 instead of 1 - dampening)."""
    batches = _data(4)

    def sgd(model: nn.Module) -> torch.optim.SGD:
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)

    ref_model = _model()
    ref_opt = sgd(ref_model)
    model = _model()
    opt = sgd(model)
    for x, y in batches[:2]:  # plain torch steps on both: momentum buffers, no "step" key
        for m, o in ((ref_model, ref_opt), (model, opt)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    opt.zero_grad()
    assert "step" not in next(iter(opt.state.values()))
    prec = mp.MixedPrecision("fp32", fused=True)
    model, opt = prec.prepare(model, opt)
    _train(prec, model, opt, batches[2:])
    assert _ran_fused(_shadow(prec))
    for x, y in batches[2:]:
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref_model(x), y).backward()
        ref_opt.step()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, **TOL[torch.float32])
    assert all(float(st["step"]) == 3.0 for st in opt.state.values())  # counted from 1: the buffers existed


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master"])
def test_fused_step_runs_torchs_global_step_hooks_once_with_the_users_optimizer(preset: str) -> None:
    """torch's global step hooks ran twice per fused step: also inside, for mixprec's internal optimizer."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    model = _model()
    prec = mp.MixedPrecision(preset, fused=True)
    users = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = prec.prepare(model, users)
    calls: list[tuple[str, Any]] = []
    handles = [register_optimizer_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o))),
               register_optimizer_step_post_hook(lambda o, args, kwargs: calls.append(("post", o)))]
    try:
        _train(prec, model, opt, _data(2))
    finally:
        for h in handles:
            h.remove()
    rec = next(iter(prec._records.values()))
    assert _ran_fused(rec.shadow if rec.shadow is not None else getattr(opt, "_shadow", None))
    # The torch optimizer the user built (bf16-master steps it inside its MasterWeightOptimizer, as when unfused).
    assert calls == [("pre", users), ("post", users)] * 2


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master", "bf16-pure"])
def test_the_profilers_optimizer_marker_and_step_range_are_kept(preset, monkeypatch):
    """torch's profiler finds optimizers by the frame of Optimizer._optimizer_step_code and the step range
    'Optimizer.step#<class>.step'; the fused step and the converted (bf16-pure) optimizer had dropped them."""
    import mixprec as mp

    marked = []
    original = torch.optim.Optimizer._optimizer_step_code
    monkeypatch.setattr(torch.optim.Optimizer, "_optimizer_step_code", lambda self: marked.append(self) or original(self))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    prec = mp.MixedPrecision(preset, fused=True)
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with prec.autocast():
            loss = model(torch.randn(4, 8)).float().square().mean()
        prec.backward(loss)
        prec.step(opt)
    assert len(marked) == 1
    assert any(e.name == "Optimizer.step#AdamW.step" for e in prof.events())
