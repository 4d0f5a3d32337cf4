"""The fused (``torch.compile``d) master-weight step against the wrapped torch optimizer's own step.

Asserted, for a wrapped ``torch.optim.AdamW`` and ``SGD`` (momentum) on a BF16 model with FP32
masters, over steps with a loss scale handed in as ``grad_scale`` and one skipped step
(``found_inf``): the masters and states track the eager reference (torch's foreach step) to FP32
rounding (the compiled step computes without torch's fused multiply-adds, so not bit for bit); the
model weights are exactly the rounded masters (the copy back is in the compiled kernel); the skipped
step leaves masters, states, step counters and the model bit-identical; the state stays torch's
(an eager step can follow a fused one). Two compiled graphs for the file (one per optimizer).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from mixprec import MasterWeightOptimizer

SHAPES = [(8, 4), (8,)]
STEPS = 5
SKIP_STEP = 2


def _model_params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in SHAPES]


def _make(kind: str, fused: bool) -> MasterWeightOptimizer:
    params = _model_params()
    inner = (torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True) if kind == "adamw"
             else torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True))
    return MasterWeightOptimizer(inner, fused=fused)


def _step(opt: MasterWeightOptimizer, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for m in opt.masters:
        m.grad = torch.randn(m.shape, generator=g) * 4.0  # loss-scaled by 4
    opt.grad_scale = torch.tensor(4.0)  # as torch.amp.GradScaler hands them over
    opt.found_inf = torch.tensor(float(step == SKIP_STEP))
    opt.step()
    del opt.grad_scale, opt.found_inf


def _state(opt: MasterWeightOptimizer) -> list[torch.Tensor]:
    out = [m.detach().clone() for m in opt.masters] + [p.detach().clone() for p in opt.model_params]
    for m in opt.masters:
        out += [v.detach().clone() for _, v in sorted(opt.state[m].items()) if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_fused_master_step_tracks_the_eager_step_and_skips_on_the_device(kind, monkeypatch):
    import mixprec.optim._fused_step as base

    monkeypatch.setattr(base, "_FUSED_CACHE", {})  # compiled here, not found in the process-wide cache
    runs = []
    for fused in (False, True):
        opt = _make(kind, fused)
        for step in range(STEPS):
            before = _state(opt) if step == SKIP_STEP else None
            _step(opt, step)
            if before is not None:
                after = _state(opt)
                assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
        for p, m in zip(opt.model_params, opt.masters):
            assert torch.equal(p.detach(), m.to(torch.bfloat16))  # copied back, in the compiled kernel
        assert (opt._shadow is not None and opt._shadow._view is not None and bool(opt._shadow._view._fused_fns)) is fused
        runs.append(opt)
    eager, fused_opt = runs
    for me, mf in zip(eager.masters, fused_opt.masters):
        # FP32 rounding of a few steps of O(1e-2) updates: a handful of ulps of |w| ~ 1.
        torch.testing.assert_close(mf, me, rtol=0, atol=2e-6)
    assert not torch.equal(eager.masters[0], _model_params()[0].float())  # the runs moved
    for me, mf in zip(eager.masters, fused_opt.masters):
        se, sf = eager.state[me], fused_opt.state[mf]
        for k in se:
            if k == "step":
                assert se[k].item() == sf[k].item() == STEPS - 1  # the skipped step did not count
            else:
                torch.testing.assert_close(sf[k], se[k], rtol=1e-5, atol=1e-7)
    # The state is torch's: an eager step (the wrapped optimizer's own) can follow.
    fused_opt.fused = False
    before = fused_opt.masters[0].clone()
    _step(fused_opt, STEPS)
    assert not torch.equal(before, fused_opt.masters[0])
    if kind == "adamw":
        assert fused_opt.state[fused_opt.masters[0]]["step"].item() == STEPS
    assert eager.compile_seconds == 0.0 and fused_opt.compile_seconds > 0.0  # the first fused step compiled, timed


def test_fused_true_needs_a_supported_optimizer():
    params = _model_params()
    with pytest.raises(ValueError, match="fused master-weight step covers"):
        MasterWeightOptimizer(torch.optim.RMSprop(params, lr=0.1), fused=True)
    with pytest.raises(TypeError, match="fused must be True, False or None"):
        MasterWeightOptimizer(torch.optim.SGD(params, lr=0.1), fused=1)  # type: ignore[arg-type]
    opt = MasterWeightOptimizer(torch.optim.SGD(_model_params(), lr=0.1))
    assert opt.fused is None and opt._fused_shadow() is None  # default: eager on CPU (docs/optim.md)


@pytest.mark.parametrize("skip", [False, True])
def test_fused_step_carries_data_edits_into_the_masters_like_the_eager_check(skip):
    """weight_edits="values" in the fused kernel: a p.data edit (pruning mask, clamp) wins elementwise.

    The eager step runs ``sync_edits_`` (three kernels per weight) before the update; the fused
    step compares each weight with its rounded master inside the compiled kernel. Both must keep
    the edited elements (also through a skipped step, where the edited value is all that changes)
    and leave the untouched ones on their exact FP32 masters.
    """
    runs = []
    for fused in (False, True):
        opt = _make("adamw", fused)
        _step(opt, 0)  # masters now carry bits below BF16
        w, b = opt.model_params
        w.data.mul_((torch.arange(w.numel()).reshape(w.shape) % 3 != 0).to(w.dtype))  # prune every third
        b.data.clamp_(-0.1, 0.1)
        g = torch.Generator().manual_seed(7)
        for m in opt.masters:
            m.grad = torch.randn(m.shape, generator=g)
        opt.found_inf = torch.tensor(float(skip))
        opt.step()
        del opt.found_inf
        runs.append(opt)
        assert (opt._shadow is not None and opt._shadow._view is not None and bool(opt._shadow._view._fused_fns)) is fused
        for p, m in zip(opt.model_params, opt.masters):
            assert torch.equal(p.detach(), m.to(torch.bfloat16))
    eager, fused_opt = runs
    pruned = torch.arange(SHAPES[0][0] * SHAPES[0][1]).reshape(SHAPES[0]) % 3 == 0
    for opt in runs:
        w_master = opt.masters[0]
        if skip:
            assert torch.equal(w_master[pruned], torch.zeros_like(w_master[pruned]))  # the edit, exactly
        assert opt.masters[1].abs().max() <= 0.1 + 0.01  # clamped before the update (lr 1e-2)
    for me, mf in zip(eager.masters, fused_opt.masters):
        if skip:
            assert torch.equal(mf, me)  # nothing but the edit happened: bit for bit
        else:
            torch.testing.assert_close(mf, me, rtol=0, atol=2e-6)


@pytest.mark.parametrize("how", ["add_param_group", "unfreeze"])
def test_fused_step_moves_the_weights_of_masters_adopted_later(how, monkeypatch):
    """The fused kernel writes each master into its model weight (a mirror): masters created after the first
    fused step (a new param group, a parameter unfrozen) get theirs too, so their weights follow their masters."""
    import mixprec._master as master_mod

    monkeypatch.setattr(master_mod, "_WARNED_UNFROZEN", False)  # once per process: another test may have warned
    a = torch.nn.Parameter(torch.randn(4, 4).to(torch.bfloat16))
    b = torch.nn.Parameter(torch.randn(4, 4).to(torch.bfloat16), requires_grad=how == "add_param_group")
    params = [a] if how == "add_param_group" else [a, b]
    opt = MasterWeightOptimizer(torch.optim.AdamW(params, lr=1e-1), fused=True)
    opt.masters[0].grad = torch.ones(4, 4)
    opt.step()
    assert opt._shadow is not None and opt._shadow.view() is not None  # the fused step ran
    if how == "add_param_group":
        opt.add_param_group({"params": [b]})
    else:
        b.requires_grad_(True)
        b.grad = torch.ones(4, 4, dtype=torch.bfloat16)
    before = b.detach().clone()
    for p, m in zip(opt.model_params, opt.masters):
        if p is not m:
            m.grad = torch.ones(4, 4)
    with pytest.warns(UserWarning) if how == "unfreeze" else contextlib.nullcontext():
        opt.step()
    master = opt.master_for(b)
    assert master is not b and not torch.equal(b.detach(), before)
    assert torch.equal(b.detach(), master.to(torch.bfloat16))


class _SeeingMode(torch.utils._python_dispatch.TorchDispatchMode):
    """A stand-in for FlopCounterMode or a memory tracker around a training step."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_fused_master_step_under_a_dispatch_mode_runs_eagerly_with_the_edit_check(monkeypatch):
    """The first fused master step taken under a TorchDispatchMode: the eager step (no compile error), with
    the value-based edit check the fused kernel would have made (an edit through ``.data`` reaches the
    master); the later steps compile and the run equals one without the mode."""
    import mixprec.optim._fused_step as base

    runs = []
    for under_mode in (False, True):
        monkeypatch.setattr(base, "_FUSED_CACHE", {})  # the first step compiles
        opt = _make("adamw", True)
        opt.model_params[0].data[0, 0] = 3.0  # an edit through .data, before the first step
        with _SeeingMode() if under_mode else contextlib.nullcontext():
            _step(opt, 0)
        assert opt.masters[0][0, 0].item() != 0.0 and abs(opt.masters[0][0, 0].item() - 3.0) < 0.1
        assert bool(opt._fused_shadow()._fused_fns) is not under_mode  # compiled only outside the mode
        for step in (1, 3):
            _step(opt, step)
        assert opt._fused_shadow()._fused_fns  # compiled after the mode
        runs.append(_state(opt))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fused_sgd_with_dampening_resumes_a_checkpoint_of_the_eager_step():
    """A checkpoint of a fused=False run holds torch's SGD state (momentum buffers, no "step"); resumed with
    fused=True, the next update is not a first one (coefficient 1 - dampening, not 1)."""

    def make(fused: bool) -> MasterWeightOptimizer:
        inner = torch.optim.SGD(_model_params(), lr=0.05, momentum=0.9, dampening=0.5, foreach=True)
        return MasterWeightOptimizer(inner, fused=fused)

    def step(opt: MasterWeightOptimizer, i: int) -> None:
        g = torch.Generator().manual_seed(100 + i)
        for m in opt.masters:
            m.grad = torch.randn(m.shape, generator=g)
        opt.step()

    ref = make(False)
    for i in range(4):
        step(ref, i)
    first = make(False)
    for i in range(2):
        step(first, i)
    saved = first.state_dict()
    resumed = make(True)
    resumed.load_state_dict(saved)
    for i in range(2, 4):
        step(resumed, i)
    assert resumed._shadow is not None and resumed._shadow._view is not None and resumed._shadow._view._fused_fns
    for me, mf in zip(ref.masters, resumed.masters):
        torch.testing.assert_close(mf, me, rtol=0, atol=2e-6)  # FP32 rounding (was off by ~2e-2)
