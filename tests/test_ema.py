"""mixprec.EMA: an FP32 average of the weights that skips skipped steps, with no host sync."""

from __future__ import annotations

import copy
import io
import re
import warnings

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec import EMA, MasterWeightOptimizer, MixedPrecision
from mixprec.bench._timing import OpCounter

PRESETS = ["fp32", "bf16-mixed", "bf16-master", "bf16-master-r16", "fp16-master", "bf16-pure"]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def setup(preset, decay=0.9, warmup=False, seed=0, model_fn=mlp):
    torch.manual_seed(seed)
    model = model_fn()
    prec = MixedPrecision(preset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU warns that it is slow
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=2e-2))
    return prec, model, opt, EMA(prec, decay=decay, warmup=warmup)


def train_step(prec, model, opt, step, plant_inf=False, noise=False, sched=None):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 8, generator=g)
    if noise:
        x = x + 0.1 * torch.randn(16, 8)  # from the global RNG: a resumed run must restore it
    y = x[:, :4].argmax(1)
    with prec.autocast():
        loss = nn.functional.cross_entropy(model(x).float(), y)
    prec.backward(loss)
    if plant_inf:
        holder = opt.masters[0] if isinstance(opt, MasterWeightOptimizer) else next(model.parameters())
        holder.grad[0].fill_(float("inf"))
    info = prec.step(opt, schedulers=[sched] if sched is not None else ())
    opt.zero_grad(set_to_none=True)
    return info


def truth(prec, model):
    """The FP32 weights the optimizer steps (masters where there are masters), by name, in float64."""
    masters = {}
    for opt in prec.optimizers:
        if isinstance(opt, MasterWeightOptimizer):
            masters.update({id(p): m for p, m in zip(opt.model_params, opt.master_values())})
    return {n: masters.get(id(p), p).detach().double() for n, p in model.named_parameters()}


def state_of(prec, model):
    """Every training tensor (model weights and masters) cloned, for bit-exact comparisons."""
    out = {f"model.{n}": t.detach().clone() for n, t in model.state_dict().items()}
    for i, opt in enumerate(prec.optimizers):
        if isinstance(opt, MasterWeightOptimizer):
            out.update({f"master.{i}.{j}": m.detach().clone() for j, m in enumerate(opt.master_values())})
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ----- the average ---------------------------------------------------------------------------------
@pytest.mark.parametrize("warmup", [False, True])
@pytest.mark.parametrize("preset", PRESETS)
def test_ema_equals_a_float64_reference_over_applied_steps_only(preset, warmup):
    prec, model, opt, ema = setup(preset, decay=0.8, warmup=warmup)
    ref = truth(prec, model)
    assert all(a.dtype == torch.float32 for a in ema.averages.values())
    for n, a in ema.averages.items():
        assert torch.equal(a.double(), ref[n]), n  # starts at the FP32 truth (masters, not rounded weights)
    n_applied = 0
    for step in range(8):
        planted = step == 3
        before = {n: a.clone() for n, a in ema.averages.items()}
        info = train_step(prec, model, opt, step, plant_inf=planted)
        ema.update()
        if planted:
            assert not info.applied()
        if not info.applied():  # the planted step (and any the scaler skips): the average is untouched
            for n, a in ema.averages.items():
                assert torch.equal(a, before[n]), n
            continue
        d = min(0.8, (1 + n_applied) / (10 + n_applied)) if warmup else 0.8
        w = truth(prec, model)
        ref = {n: r + (1 - d) * (w[n] - r) for n, r in ref.items()}
        n_applied += 1
    assert int(ema.num_updates) == n_applied == int(prec.last_step.applied_steps)
    assert n_applied >= 6
    for n, a in ema.averages.items():
        torch.testing.assert_close(a.double(), ref[n], rtol=1e-5, atol=1e-6, msg=n)
    # the average really moved away from the initial weights and differs from the current ones
    assert any(not torch.equal(a.double(), w[n]) for n, a in ema.averages.items())


@pytest.mark.parametrize("preset", PRESETS)
def test_update_has_no_host_sync(preset, monkeypatch):
    prec, model, opt, ema = setup(preset)
    train_step(prec, model, opt, 0)
    info = train_step(prec, model, opt, 1, plant_inf=True)

    def refuse(*args, **kwargs):
        raise AssertionError("EMA.update read a tensor on the host")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    ema.update(info)
    monkeypatch.undo()
    assert int(ema.num_updates) == 0 and bool(info.skipped)


@pytest.mark.parametrize("preset", ["bf16-master", "bf16-pure"])
def test_update_reads_nothing_back_to_the_host(preset):
    # The CPU proxy of the CUDA test below: a 0-d tensor passed where torch takes a Scalar is read
    # with .item() (aten._local_scalar_dense), a host sync on a GPU.
    torch.manual_seed(0)
    model = mlp()
    prec = MixedPrecision(preset)
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ema = EMA(prec, decay=0.9, warmup=True)
    with prec.autocast():
        loss = model(torch.randn(16, 8)).float().square().mean()
    prec.backward(loss)
    prec.step(opt)
    with OpCounter() as c:
        ema.update()
    assert c.ops["_local_scalar_dense"] == 0 and c.ops["is_nonzero"] == 0
    assert int(ema.num_updates) == 1


@pytest.mark.cuda
def test_update_has_no_host_sync_on_cuda():
    torch.manual_seed(0)
    model = mlp().cuda()
    prec = MixedPrecision("bf16-master")
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    ema = EMA(prec, decay=0.9, warmup=True)
    x = torch.randn(16, 8, device="cuda")
    with prec.autocast():
        loss = model(x).float().square().mean()
    prec.backward(loss)
    prec.step(opt)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ema.update()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(ema.num_updates) == 1


def test_tied_parameters_are_averaged_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    torch.manual_seed(0)
    model = Tied()
    prec = MixedPrecision("bf16-master")
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ema = EMA(prec, decay=0.5)
    assert ema.names == ["emb.weight"]
    start = opt.master_for(model.emb.weight).clone()
    ids = torch.randint(0, 10, (4, 5))
    with prec.autocast():
        loss = model(ids).float().square().mean()
    prec.backward(loss)
    prec.step(opt)
    ema.update()
    master = opt.master_for(model.emb.weight)
    torch.testing.assert_close(ema.averages["emb.weight"], torch.lerp(start, master, 0.5), rtol=0, atol=0)
    with ema.applied():
        assert model.head.weight is model.emb.weight
        assert torch.equal(model.emb.weight, ema.averages["emb.weight"].to(torch.bfloat16))


# ----- evaluation with the average -----------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_applied_swaps_in_the_average_and_restores_bit_exactly(preset):
    prec, model, opt, ema = setup(preset, decay=0.5)
    for step in range(3):
        train_step(prec, model, opt, step)
        ema.update()
    before = state_of(prec, model)
    with ema.applied() as m:
        assert m is model
        for n, p in model.named_parameters():
            assert torch.equal(p, ema.averages[n].to(p.dtype)), n  # cast to the model's dtypes
        assert any(not torch.equal(p, before[f"model.{n}"]) for n, p in model.named_parameters())
    assert_same(state_of(prec, model), before)

    with pytest.raises(RuntimeError, match="evaluation failed"), ema.applied():
        raise RuntimeError("evaluation failed")
    assert_same(state_of(prec, model), before)

    # Training goes on exactly as in a run that never evaluated.
    prec2, model2, opt2, ema2 = setup(preset, decay=0.5)
    for step in range(3):
        train_step(prec2, model2, opt2, step)
        ema2.update()
    for step in range(3, 5):
        train_step(prec, model, opt, step)
        train_step(prec2, model2, opt2, step)
        ema.update()
        ema2.update()
    assert_same(state_of(prec, model), state_of(prec2, model2))
    assert_same(ema.averages, ema2.averages)


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master", "bf16-master-r16", "fp16-master"])
def test_training_or_saving_inside_applied_raises_and_changes_nothing(preset):
    prec, model, opt, ema = setup(preset, decay=0.5)
    for step in range(2):
        train_step(prec, model, opt, step)
        ema.update()
    before = state_of(prec, model)
    calls = {"prec.state_dict": prec.state_dict, "clip": lambda: prec.clip_grad_norm_(1.0)}
    if isinstance(opt, MasterWeightOptimizer):
        calls["optimizer.state_dict"] = opt.state_dict  # carries weight edits into the masters: the averages
    with ema.applied():
        for call in calls.values():
            with pytest.raises(RuntimeError, match=r"inside `with ema.applied\(\):`"):
                call()
        with pytest.raises(RuntimeError, match=r"backward\(\): called inside `with ema.applied"):
            train_step(prec, model, opt, 2)
        with ema.applied():  # nested: the inner block's end keeps the outer one's refusal
            pass
        with pytest.raises(RuntimeError, match="ema.applied"):
            prec.state_dict()
    assert_same(state_of(prec, model), before)
    prec.state_dict()  # after the block: allowed again
    with prec.autocast():
        loss = model(torch.randn(16, 8)).float().square().mean()
    prec.backward(loss)  # gradients before the block, the step inside: refused too (the update would be lost)
    with ema.applied():
        for step in (lambda: prec.step(opt), opt.step):
            with pytest.raises(RuntimeError, match=r"step\(\).*inside `with ema.applied"):
                step()
        assert int(prec.applied_steps) == 2  # reads of the run are fine in the block
        prec.update()
        if preset == "fp16-master":  # and the scaled-read check still holds there
            with pytest.raises(ValueError, match="still carries the loss scale"):
                model[0].weight.grad.norm()
    assert_same(state_of(prec, model), before)
    prec.step(opt)
    train_step(prec, model, opt, 2)


def test_an_ema_of_a_prepared_model_refuses_training_inside_applied_too():
    prec, model, opt, _ = setup("bf16-master", decay=0.5)
    ema = EMA(model)  # the module, not the run
    with ema.applied(), pytest.raises(RuntimeError, match="inside `with ema.applied"):
        train_step(prec, model, opt, 0)
    train_step(prec, model, opt, 0)


def test_applied_and_copy_to_another_model():
    prec, model, opt, ema = setup("bf16-master", decay=0.5)
    train_step(prec, model, opt, 0)
    ema.update()
    torch.manual_seed(1)
    other = mlp()  # an FP32 evaluation copy
    kept = copy.deepcopy(other.state_dict())
    with ema.applied(other) as m:
        assert m is other
        for n, p in other.named_parameters():
            assert torch.equal(p, ema.averages[n])
    assert_same(other.state_dict(), kept)
    ema.copy_to(other)
    for n, p in other.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, ema.averages[n])

    wrong = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 5))
    kept = copy.deepcopy(wrong.state_dict())
    with pytest.raises(ValueError, match=re.escape("EMA.copy_to(model): '3.weight' has shape (5, 16) in the model but (4, 16)")):
        ema.copy_to(wrong)
    missing = "EMA.applied(model): the model has no parameter(s) ['2.weight', '2.bias', '3.weight', '3.bias'] (4 of 6 tracked)"
    with pytest.raises(ValueError, match=re.escape(missing)), ema.applied(nn.Sequential(nn.Linear(8, 16))):
        pass
    assert_same(wrong.state_dict(), kept)


def test_ema_of_a_plain_module():
    torch.manual_seed(0)
    model = mlp().to(torch.bfloat16)
    ema = EMA(model, decay=0.5)
    start = {n: p.detach().float() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()  # no MixedPrecision: every call is an applied step
    for n, p in model.named_parameters():
        torch.testing.assert_close(ema.averages[n], 0.5 * start[n] + 0.5 * p.float(), rtol=0, atol=0)
    assert int(ema.num_updates) == 1


# ----- checkpoints -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_state_dict_round_trips_every_field(preset):
    prec, model, opt, ema = setup(preset, decay=0.95, warmup=True)  # decay and warmup not the defaults
    for step in range(3):
        train_step(prec, model, opt, step)
        ema.update()
    sd = ema.state_dict()
    assert set(sd) == {"version", "decay", "warmup", "num_updates", "averages"}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)

    prec2, model2, opt2, ema2 = setup(preset, decay=0.95, warmup=True, seed=1)  # other weights
    ema2.load_state_dict(loaded)
    sd2 = ema2.state_dict()
    assert sd2["version"] == sd["version"] == 1
    assert sd2["decay"] == 0.95 and sd2["warmup"] is True
    assert int(sd2["num_updates"]) == int(sd["num_updates"]) == 3
    assert sd2["num_updates"].dtype == torch.int64
    assert_same(sd2["averages"], sd["averages"])
    assert any(not torch.equal(a, p.detach().float()) for a, p in zip(sd["averages"].values(), model.parameters()))


@pytest.mark.parametrize("preset", PRESETS)
def test_save_and_resume_continue_identically(preset, tmp_path):
    def run(steps, resume_from=None, save_at=None):
        prec, model, opt, ema = setup(preset, decay=0.8, warmup=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        start = 0
        if resume_from is not None:
            state = mp.load(resume_from, expected_policy=preset)
            prec.load_state_dict(state)
            ema.load_state_dict(state["ema"])
            sched.load_state_dict(state["sched"])
            torch.set_rng_state(state["rng"])
            start = int(state["step"])
        else:
            torch.manual_seed(123)
        for step in range(start, steps):
            if step == save_at:
                # The one right way (docs/ema.md): extra keys in the mixprec state, one atomic file.
                state = prec.state_dict()
                state.update(ema=ema.state_dict(), sched=sched.state_dict(), rng=torch.get_rng_state(), step=step)
                mp.save(state, tmp_path / "ckpt.pt")
            train_step(prec, model, opt, step, plant_inf=step == 4, noise=True, sched=sched)
            ema.update()
        return prec, model, ema, sched

    prec_a, model_a, ema_a, sched_a = run(8, save_at=3)
    prec_b, model_b, ema_b, sched_b = run(8, resume_from=tmp_path / "ckpt.pt")
    assert_same(ema_a.averages, ema_b.averages)
    assert torch.equal(ema_a.num_updates, ema_b.num_updates) and int(ema_a.num_updates) == 7
    assert_same(state_of(prec_a, model_a), state_of(prec_b, model_b))
    assert sched_a.state_dict() == sched_b.state_dict()


# ----- errors ------------------------------------------------------------------------------------------------
def test_load_refuses_a_mismatched_state():
    prec, model, opt, ema = setup("bf16-master", decay=0.9)
    sd = copy.deepcopy(ema.state_dict())
    before = {n: a.clone() for n, a in ema.averages.items()}

    other = EMA(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 5)), decay=0.9)
    with pytest.raises(ValueError, match=re.escape("the checkpoint's EMA average '3.weight' is (4, 16), the model's parameter (5, 16)")):
        other.load_state_dict(sd)
    small = EMA(nn.Sequential(nn.Linear(8, 16)), decay=0.9)
    with pytest.raises(ValueError, match=re.escape("the checkpoint's EMA does not match this model: missing [], unexpected ['2.weight'")):
        small.load_state_dict(sd)
    with pytest.raises(ValueError, match=re.escape("the checkpoint's EMA has decay=0.9, warmup=False but this EMA decay=0.99")):
        EMA(prec, decay=0.99).load_state_dict(sd)
    with pytest.raises(ValueError, match=re.escape("EMA state version 2; this mixprec reads version 1")):
        ema.load_state_dict({**sd, "version": 2})
    with pytest.raises(ValueError, match=re.escape("not an EMA state dict: missing ['averages']")):
        ema.load_state_dict({k: v for k, v in sd.items() if k != "averages"})
    with pytest.raises(TypeError, match="needs the dict EMA.state_dict"):
        ema.load_state_dict([1, 2])  # type: ignore[arg-type]
    bad = copy.deepcopy(sd)
    bad["averages"]["0.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=re.escape("'0.weight' is (3,)")):
        ema.load_state_dict(bad)
    assert_same(ema.averages, before)  # nothing was loaded


def test_constructor_and_update_errors():
    with pytest.raises(ValueError, match=re.escape("EMA(prec) before prec.prepare(...)")):
        EMA(MixedPrecision("bf16-mixed"))
    with pytest.raises(TypeError, match="needs a prepared mixprec.MixedPrecision or an nn.Module, got list"):
        EMA([torch.zeros(2)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("decay=1.5): decay must be in [0, 1]")):
        EMA(mlp(), decay=1.5)
    with pytest.raises(TypeError, match=re.escape("decay=True) needs a number in [0, 1]")):
        EMA(mlp(), decay=True)
    with pytest.raises(TypeError, match=re.escape("warmup=1) needs a bool")):
        EMA(mlp(), warmup=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has no floating-point parameters"):
        EMA(nn.ReLU())

    prec, model, opt, ema = setup("bf16-mixed")
    with pytest.raises(ValueError, match=re.escape("EMA.update() before any step")):
        ema.update()
    train_step(prec, model, opt, 0)
    ema.update()
    with pytest.raises(ValueError, match="this step was already averaged"):
        ema.update()
    with pytest.raises(TypeError, match="needs the StepInfo that prec.step"):
        ema.update(object())  # type: ignore[arg-type]
    assert int(ema.num_updates) == 1


def test_step_info_mask_docstring_points_at_ema():
    doc = mp.StepInfo.mask.__doc__ or ""
    assert "mixprec.EMA" in doc and "_foreach_lerp_(ema, masters" not in doc


class _Spectral(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + (x.to(torch.complex64) @ self.w).real


def test_complex_parameters_are_averaged_as_torch_averaged_model_does() -> None:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = _Spectral()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    ref.update_parameters(model)  # torch's first update copies; mixprec's EMA starts from the weights
    prec = MixedPrecision("fp32")
    model, opt = prec.prepare(model, opt)
    ema = EMA(prec, decay=0.5, warmup=False)
    assert "w" in ema.names and ema.averages["w"].dtype == torch.complex64
    for _ in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad()
        ema.update()
        ref.update_parameters(model)
    assert not torch.equal(ema.averages["w"], model.w.detach())
    torch.testing.assert_close(ema.averages["w"], ref.module.w.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ema.averages["lin.weight"], ref.module.lin.weight.detach(), rtol=1e-6, atol=1e-6)
    loaded = EMA(prec, decay=0.5, warmup=False)
    loaded.load_state_dict(ema.state_dict())
    assert torch.equal(loaded.averages["w"], ema.averages["w"])


def test_an_update_after_a_load_waits_for_the_next_step() -> None:
    # Rolling the EMA back in the same process: the step taken before the load is not one for the loaded averages.
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    prec = MixedPrecision("bf16-mixed")
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ema = EMA(prec, decay=0.5)
    saved = ema.state_dict()
    saved = {k: (v.clone() if isinstance(v, torch.Tensor) else {n: t.clone() for n, t in v.items()}
                 if isinstance(v, dict) else v) for k, v in saved.items()}
    with prec.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    prec.backward(loss)
    prec.step(opt)
    ema.load_state_dict(saved)
    with pytest.raises(ValueError, match="already averaged"):
        ema.update()
    assert int(ema.num_updates) == int(saved["num_updates"])
