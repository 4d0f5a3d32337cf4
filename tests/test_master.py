import copy
import functools
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from mixprec._casting import cast_module
from mixprec._master import MasterWeightOptimizer
from mixprec._master_grad import MasterGradView
from mixprec.bench._timing import OpCounter

HALF = [torch.bfloat16, torch.float16]


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 3))


def _prepared(dtype, opt_fn=None, **kw):
    """An FP32 MLP cast to ``dtype`` (norm kept FP32) with exact FP32 masters."""
    model = _mlp()
    originals = {p: p.data for p in model.parameters()}
    cast_module(model, f"p={'bf16' if dtype == torch.bfloat16 else 'f16'},m=f32,ls=none")
    opt = (opt_fn or (lambda ps: torch.optim.SGD(ps, lr=0.1)))(model.parameters())
    return model, MasterWeightOptimizer(opt, initial_masters=originals, **kw), originals


def _batch(seed=1, n=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x).float(), y)


@pytest.mark.parametrize("dtype", HALF)
def test_masters_are_exact_fp32_and_live_in_param_groups(dtype):
    ref = _mlp()
    model, opt, _ = _prepared(dtype)
    for (name, p_ref), p, m in zip(ref.named_parameters(), opt.model_params, opt.masters):
        assert m.dtype == torch.float32
        torch.testing.assert_close(m, p_ref.detach(), rtol=0, atol=0)  # exact, not rounded through half
        expected_dtype = torch.float32 if name.startswith("2.") else dtype  # LayerNorm is an island
        assert p.dtype == expected_dtype
    held = [t for g in opt.param_groups for t in g["params"]]
    assert all(a is b for a, b in zip(held, opt.masters))
    assert all(t.dtype == torch.float32 for t in held)


@pytest.mark.parametrize("dtype", HALF)
def test_fp32_accumulation_hook_frees_half_grads(dtype):
    model, opt, _ = _prepared(dtype)
    x, y = _batch()
    for _ in range(3):
        _loss(model, x, y).backward()
    for p, m in zip(opt.model_params, opt.masters):
        # half grads freed (a storage-less view of the master's gradient); FP32 islands keep their own .grad
        assert p is m or isinstance(p.grad, MasterGradView)
        grad = m.grad if p is not m else p.grad
        assert grad is not None and grad.dtype == torch.float32
    # Three identical micro-batches sum to three times one micro-batch's gradient.
    model1, opt1, _ = _prepared(dtype)
    _loss(model1, x, y).backward()
    for m3, m1 in zip(opt.masters, opt1.masters):
        g3 = m3.grad
        g1 = m1.grad
        torch.testing.assert_close(g3, 3 * g1, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", HALF)
def test_compute_accumulation_keeps_half_grads_until_step(dtype):
    model, opt, _ = _prepared(dtype, grad_accumulation="compute")
    _loss(model, *_batch()).backward()
    half = [p for p, m in zip(opt.model_params, opt.masters) if p is not m]
    assert all(p.grad is not None and p.grad.dtype == dtype for p in half)
    grads = opt.master_grads()
    assert all(g.dtype == torch.float32 for g in grads)
    # the half buffers are gone; p.grad is now a storage-less view of the FP32 master gradient
    assert all(isinstance(p.grad, MasterGradView) and p.grad.master_grad() is m.grad
               for p, m in zip(opt.model_params, opt.masters) if p is not m)
    assert len(grads) == len(opt.masters)


@pytest.mark.parametrize("dtype", HALF)
def test_tracks_fp32_training(dtype):
    ref = _mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model, opt, _ = _prepared(dtype, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    for step in range(60):
        x, y = _batch(step)
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            _loss(m, x, y).backward()
            o.step()
    tol = {torch.bfloat16: 0.05, torch.float16: 0.01}[dtype]
    for p_ref, m in zip(ref.parameters(), opt.masters):
        torch.testing.assert_close(m, p_ref.detach(), rtol=tol, atol=tol)
    # the model's parameters are the rounded masters
    for p, m in zip(opt.model_params, opt.masters):
        torch.testing.assert_close(p, m.to(p.dtype), rtol=0, atol=0)


def _snapshot(opt):
    return (
        [p.detach().clone() for p in opt.model_params],
        [m.detach().clone() for m in opt.masters],
        copy.deepcopy(opt.optimizer.state_dict()["state"]),
    )


def _assert_same(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y)
    for k in a[2]:
        for name, v in a[2][k].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b[2][k][name]))


@pytest.mark.parametrize("fused", [False, True])
def test_found_inf_skips_bit_identically(fused):
    model, opt, _ = _prepared(torch.bfloat16, lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=fused))
    _loss(model, *_batch()).backward()
    opt.step()  # create optimizer state
    opt.zero_grad()
    before = _snapshot(opt)
    _loss(model, *_batch(2)).backward()
    opt.found_inf = torch.ones(())
    opt.grad_scale = None
    opt.step()
    del opt.found_inf, opt.grad_scale
    _assert_same(before, _snapshot(opt))
    opt.step()  # a clean step does change them
    assert not torch.equal(before[1][0], opt.masters[0])


def test_unscale_is_one_fused_call_per_dtype_group():
    model, opt, _ = _prepared(torch.float16)
    _loss(model, *_batch()).backward()
    with OpCounter() as counter:
        found = opt.unscale_(torch.tensor(0.5))
    assert counter.ops["_amp_foreach_non_finite_check_and_unscale_"] == 1  # all master grads are FP32 on one device: one group
    assert found.item() == 0.0
    opt.masters[0].grad[0, 0] = float("nan")
    assert opt.unscale_(None).item() == 1.0


def test_state_dict_round_trip_every_field():
    model, opt, _ = _prepared(torch.float16, lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1),
                              grad_accumulation="compute")
    for s in range(3):
        opt.zero_grad()
        _loss(model, *_batch(s)).backward()
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert sd["version"] == 1 and sd["grad_accumulation"] == "compute" and sd["master_dtype"] == "f32"
    model2, opt2, _ = _prepared(torch.float16, lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1),
                                grad_accumulation="compute")
    # As with any torch optimizer, parameters that are their own master (FP32 islands) come
    # from the model's state dict; the optimizer's holds masters and optimizer state.
    assert any(m is None for m in sd["masters"])
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    for a, b in zip(opt.masters + opt.model_params, opt2.masters + opt2.model_params):
        assert torch.equal(a, b)
    for s in range(3, 5):
        for m, o in ((model, opt), (model2, opt2)):
            o.zero_grad()
            _loss(m, *_batch(s)).backward()
            o.step()
    for a, b in zip(opt.masters, opt2.masters):
        assert torch.equal(a, b)


def test_load_foreign_state_dict_raises():
    model, opt, _ = _prepared(torch.float16)
    with pytest.raises(ValueError, match=re.escape("not a MasterWeightOptimizer state dict (keys: ['param_groups', 'state'])")):
        opt.load_state_dict(opt.optimizer.state_dict())
    sd = opt.state_dict()
    sd["masters"] = sd["masters"][:-1]
    with pytest.raises(ValueError, match="the checkpoint has 5 parameters but this optimizer manages 6"):
        opt.load_state_dict(sd)


def test_lr_scheduler_and_param_groups_work():
    model, opt, _ = _prepared(torch.bfloat16)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _loss(model, *_batch()).backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_add_param_group_gets_masters():
    model = nn.Linear(3, 3)
    extra = nn.Linear(3, 1)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    extra.half()
    opt.add_param_group({"params": extra.parameters(), "lr": 0.01})
    assert len(opt.param_groups) == 2
    assert all(t.dtype == torch.float32 for t in opt.param_groups[1]["params"])
    assert opt.master_for(extra.weight).dtype == torch.float32


def test_bad_arguments():
    with pytest.raises(TypeError, match="MasterWeightOptimizer wraps a torch.optim.Optimizer, got list"):
        MasterWeightOptimizer([])  # type: ignore[arg-type]
    opt = MasterWeightOptimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(TypeError, match="already a MasterWeightOptimizer"):
        MasterWeightOptimizer(opt)
    with pytest.raises(ValueError, match=re.escape("grad_accumulation='bf16'; use 'fp32' (default) or 'compute'.")):
        MasterWeightOptimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), grad_accumulation="bf16")  # type: ignore[arg-type]


def test_torch_grad_scaler_drives_it():
    """torch.amp.GradScaler unscales through param_groups (the masters) and steps through our protocol."""
    model, opt, _ = _prepared(torch.float16)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [m.clone() for m in opt.masters]
    scaler.scale(_loss(model, *_batch())).backward()
    scaler.step(opt)
    scaler.update()
    assert all(not torch.equal(a, b) for a, b in zip(before, opt.masters))
    # An inf gradient: skipped, scale backs off.
    opt.zero_grad()
    snap = _snapshot(opt)
    scaler.scale(_loss(model, *_batch()) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    _assert_same(snap, _snapshot(opt))
    assert scaler.get_scale() == 512.0


@pytest.mark.parametrize("mode", ["fp32", "compute"])
def test_which_gradient_buffers_persist(mode):
    model, opt, _ = _prepared(torch.bfloat16, grad_accumulation=mode)
    half = [(p, m) for p, m in zip(opt.model_params, opt.masters) if p is not m]
    _loss(model, *_batch()).backward()
    if mode == "fp32":  # accumulated into FP32 during backward; no half gradient kept
        assert all(isinstance(p.grad, MasterGradView) and m.grad is not None and m.grad.dtype == torch.float32
                   for p, m in half)
    else:  # half gradients only, until the step
        assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 and m.grad is None for p, m in half)
    opt.step()
    if mode == "fp32":  # the FP32 gradients stay until zero_grad (they may be accumulated into)
        assert all(m.grad is not None for _, m in half)
    else:  # the transient FP32 buffers and the consumed half gradients are gone
        assert all(p.grad is None and m.grad is None for p, m in half)


def test_state_the_optimizer_already_has_moves_to_the_masters():
    """An optimizer with state (earlier steps, a loaded checkpoint) keeps it when prepare wraps it: keyed by the masters."""
    import mixprec

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    buffers = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    prec = mixprec.MixedPrecision("bf16-master")
    model, mwo = prec.prepare(model, opt)
    assert list(mwo.state) == mwo.masters  # nothing orphaned under the (now BF16) model parameters
    for m, b in zip(mwo.masters, buffers):
        assert torch.equal(mwo.state[m]["momentum_buffer"], b)
    sd = mwo.state_dict()  # torch can name every state entry
    assert len(sd["optimizer"]["state"]) == 2
    with prec.autocast():
        loss = model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum()
    prec.backward(loss)
    prec.step(mwo)
    assert not any(torch.equal(mwo.state[m]["momentum_buffer"], b) for m, b in zip(mwo.masters, buffers))


def test_step_hooks_registered_on_the_master_optimizer_run_around_each_step() -> None:
    """register_step_pre_hook/register_step_post_hook on a MasterWeightOptimizer fire once per step, through
    prec.step and optimizer.step() alike and on a skipped step; a pre-hook may replace the closure."""
    import mixprec

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    prec = mixprec.MixedPrecision("fp16-master")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on a CPU
        model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre") if o is opt else None)
    opt.register_step_post_hook(lambda o, a, k: calls.append("post") if o is opt else None)
    for i in range(3):
        x = torch.randn(2, 4)
        if i == 1:
            x[0, 0] = float("inf")  # a skipped step is still a step call
        with prec.autocast():
            loss = model(x).float().sum()
        prec.backward(loss)
        prec.step(opt) if i != 2 else opt.step()
        opt.zero_grad()
    assert calls == ["pre", "post"] * 3
    seen = []
    handle = opt.register_step_pre_hook(lambda o, a, k: ((lambda: seen.append(1) or 0.0,), {}))
    with prec.autocast():
        loss = model(torch.randn(2, 4)).float().sum()
    prec.backward(loss)
    prec.step(opt)
    assert seen == [1]  # the replaced closure ran
    handle.remove()
    opt.register_step_pre_hook(lambda o, a, k: "nonsense")
    with prec.autocast():
        loss = model(torch.randn(2, 4)).float().sum()
    prec.backward(loss)
    with pytest.raises(RuntimeError, match="must return None or a tuple of"):
        opt.step()


def _lbfgs_loss_drop(dtype: torch.dtype, clear: str, **master_kw: Any) -> float:
    """The loss after 3 steps of MasterWeightOptimizer(LBFGS) on a linear fit, over the loss before (closure clears
    with ``opt.zero_grad()`` or ``model.zero_grad()``, as ``clear`` says)."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 1)
    model = nn.Linear(8, 1)
    cast_module(model, "p=bf16,c=bf16" if dtype == torch.bfloat16 else "p=f16,c=f16")
    opt = MasterWeightOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5), **master_kw)
    assert opt.optimizer._params is opt.param_groups[0]["params"]  # the masters

    def closure():
        (opt if clear == "opt" else model).zero_grad()
        loss = (model(x.to(dtype)).float() - y).pow(2).mean()
        loss.backward()
        return loss

    first = float(closure())
    for _ in range(3):
        opt.step(closure)
    return float(closure()) / first


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lbfgs_with_a_closure_trains_the_masters(dtype):
    """LBFGS keeps its own list of parameters and re-evaluates the closure after moving them: both must be the
    masters' (it used to step the half weights, which the copy-back then overwrote: no progress at all)."""
    assert _lbfgs_loss_drop(dtype, "opt") < 1e-3


@pytest.mark.parametrize("accumulation", ["fp32", "compute"])
def test_a_closure_step_moves_the_masters_in_both_accumulation_modes(accumulation):
    """opt.step(closure) with no backward before it: the closure's gradients reach the masters (under "compute" they
    were gathered before the closure ran, so nothing moved)."""

    def run(acc: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        cast_module(model, "p=bf16,c=bf16")
        opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grad_accumulation=acc)
        before = opt.masters[0].clone()

        def closure():
            opt.zero_grad()
            loss = model(torch.ones(3, 4, dtype=torch.bfloat16)).float().pow(2).sum()
            loss.backward()
            return loss

        opt.step(closure)
        return opt.masters[0] - before

    moved = run(accumulation)
    assert moved.abs().max() > 1e-3
    torch.testing.assert_close(moved, run("fp32"), rtol=0, atol=0)


def test_compute_accumulation_with_a_grad_scaler():
    """grad_accumulation="compute": mixprec.GradScaler materialises the FP32 master gradients before it unscales them
    (the step then equals the "fp32" one); torch.amp.GradScaler sees none, and step() says so instead of failing on
    an int found_inf or stepping scaled gradients."""
    import mixprec

    def run(acc: str, make_scaler: Any) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        cast_module(model, "p=f16,c=f16")
        opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grad_accumulation=acc)
        scaler = make_scaler()
        loss = model(torch.ones(3, 4, dtype=torch.float16)).float().pow(2).sum()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        return opt.masters[0].clone()

    ours = functools.partial(mixprec.GradScaler, "cpu", init_scale=1024.0)
    torch.testing.assert_close(run("compute", ours), run("fp32", ours), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.amp.GradScaler on a CPU
        with pytest.raises(ValueError, match="With grad_accumulation='compute' the FP32 master gradients exist only"):
            run("compute", functools.partial(torch.amp.GradScaler, "cpu", init_scale=1024.0))


@pytest.mark.parametrize("accumulation,storage", [("compute", "full"), ("fp32", "remainder"), ("compute", "remainder")])
def test_lbfgs_with_model_zero_grad_and_remainder_masters(accumulation, storage):
    """A closure that clears with model.zero_grad() under grad_accumulation="compute" (each evaluation's gradient used
    to pile onto the last: LBFGS diverged), and closures with remainder masters (they crashed on the placeholders):
    LBFGS converges as with FP32 accumulation and full masters."""
    assert _lbfgs_loss_drop(torch.bfloat16, "model", grad_accumulation=accumulation, master_storage=storage) < 1e-3


@pytest.mark.parametrize("preset", ["bf16-master", "fp16-master", "bf16-master-r16"])
@pytest.mark.parametrize("accumulation", ["fp32", "compute"])
def test_model_zero_grad_then_no_gradient_leaves_the_parameter_alone(preset, accumulation):
    """After model.zero_grad(), a parameter that gets no gradient in the next backward is not stepped (as torch skips a
    parameter whose .grad is None); it used to be stepped with its master's old gradient under FP32 accumulation."""
    from mixprec import MixedPrecision

    torch.manual_seed(0)
    net = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    prec = MixedPrecision(preset, grad_accumulation=accumulation)
    model, opt = prec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.0))
    x = torch.randn(2, 4)
    with prec.autocast():
        loss = model["a"](x).float().mean() + model["b"](x).float().mean()
    prec.backward(loss)
    prec.step(opt)
    model.zero_grad()
    before_a, before_b = model["a"].weight.detach().clone(), model["b"].weight.detach().clone()
    with prec.autocast():
        loss = model["a"](x).float().mean()
    prec.backward(loss)
    prec.step(opt)
    assert not torch.equal(model["a"].weight, before_a)  # the used layer trained
    assert torch.equal(model["b"].weight, before_b)


def test_a_master_gradient_set_directly_survives_a_dropped_view():
    """Only a gradient the FP32 accumulation wrote is dropped as stale: one the user put on a master is stepped."""
    model = nn.Linear(4, 2)
    cast_module(model, "p=bf16,c=bf16")
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    before = [m.detach().clone() for m in opt.masters]
    for m in opt.masters:
        m.grad = torch.ones_like(m)
    opt.step()
    for m, b in zip(opt.masters, before):
        torch.testing.assert_close(m.detach(), b - 1.0)


def test_create_graph_backward_is_refused_by_fp32_accumulation_and_works_with_compute():
    """A plain loss.backward(create_graph=True) would leave p.grad without its graph under FP32 accumulation (the
    copy into the master is outside autograd): the hook says so; "compute" keeps the graph and the penalty trains."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    cast_module(model, "p=bf16,c=bf16")
    MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="create_graph=True"):
        model(torch.randn(3, 4, dtype=torch.bfloat16)).float().pow(2).sum().backward(create_graph=True)
    model = nn.Linear(4, 2)
    cast_module(model, "p=bf16,c=bf16")
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grad_accumulation="compute")
    model(torch.randn(3, 4, dtype=torch.bfloat16)).float().pow(2).sum().backward(create_graph=True)
    assert all(p.grad.requires_grad for p in model.parameters())
    penalty = sum(p.grad.float().pow(2).sum() for p in model.parameters())
    before = [m.detach().clone() for m in opt.masters]
    penalty.backward()
    opt.step()
    assert all(not torch.equal(m, b) for m, b in zip(opt.masters, before))


@pytest.mark.parametrize("preset", ["bf16-master", "fp16-master", "bf16-master-r16"])
@pytest.mark.parametrize("accumulation", ["fp32", "compute"])
@pytest.mark.parametrize("how", ["none", "zeros"])
def test_a_gradient_dropped_or_zeroed_after_unscale_is_what_the_step_uses(preset, accumulation, how):
    """p.grad = None or p.grad = zeros after prec.unscale_ (freezing a layer for one step): the layer does not move,
    as in torch (the step used to read the master gradient unscale_ had already gathered)."""
    from mixprec import MixedPrecision

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    prec = MixedPrecision(preset, grad_accumulation=accumulation)
    model, opt = prec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(3, 4)
    for _ in range(2):  # the second iteration runs after the scale settled (fp16: no skipped step)
        with prec.autocast():
            loss = model(x).float().pow(2).mean()
        prec.backward(loss)
        prec.unscale_(opt)
        before = model[0].weight.detach().clone()
        model[0].weight.grad = None if how == "none" else torch.zeros_like(model[0].weight)
        info = prec.step(opt)
        opt.zero_grad()
    assert float(info.found_inf) == 0.0
    assert torch.equal(model[0].weight, before)


@pytest.mark.parametrize("preset", ["bf16-master", "bf16-master-r16"])
def test_gradients_assigned_from_autograd_grad_are_stepped(preset):
    """A functional loop: grads = torch.autograd.grad(loss, params); p.grad = g. The step uses them exactly as the
    FP32 masters' gradients (it used to raise an error about DistributedDataParallel)."""
    from mixprec import MixedPrecision

    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    prec = MixedPrecision(preset)
    model, opt = prec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))
    masters = [m.clone() for m in opt.master_values()]
    with prec.autocast():
        loss = model(torch.randn(3, 4)).float().pow(2).mean()
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params)
    for p, g in zip(params, grads):
        p.grad = g
    prec.step(opt)
    for m, before, g in zip(opt.master_values(), masters, grads):
        torch.testing.assert_close(m, before - 0.5 * g.float())


def test_optimizer_state_dict_hooks_run_on_the_master_state():
    """torch.optim.Optimizer's four state-dict hooks run on MasterWeightOptimizer's state dict as on torch's (they
    were registered and silently never called); a post hook's return value is what state_dict() returns."""
    model = nn.Linear(4, 2)
    cast_module(model, "p=bf16,c=bf16")
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("post") or {**sd, "extra": 7})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre") or {k: v for k, v in sd.items()
                                                                                    if k != "extra"})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    sd = opt.state_dict()
    assert sd["extra"] == 7
    opt.load_state_dict(sd)
    assert calls == ["pre", "post", "load_pre", "load_post"]
    assert "extra" in sd  # the caller's dict is not edited by the load hooks


def test_a_model_cast_after_the_wrap_is_refused_at_the_step():
    """Wrapping the FP32 model's optimizer and casting the model afterwards leaves no FP32 masters (FP32 parameters are
    their own masters): the step says so instead of training the half weights as if they were masters."""
    model = nn.Linear(4, 2)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model.half()
    model(torch.randn(3, 4).half()).float().sum().backward()
    with pytest.raises(ValueError, match=r"2 parameter\(s\) were f32 when MasterWeightOptimizer wrapped the optimizer"):
        opt.step()
    model = nn.Linear(4, 2)  # the docstring's way: cast first, FP32 values as initial masters
    fp32 = {p: p.detach().clone() for p in model.parameters()}
    model.half()
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), initial_masters=fp32)
    assert all(m.dtype == torch.float32 and torch.equal(m, fp32[p]) for p, m in zip(model.parameters(), opt.masters))


@pytest.mark.parametrize("preset", ["bf16-master", "bf16-master-r16", "bf16-pure", "bf16-mixed"])
def test_a_parameter_resized_after_prepare_gets_a_clear_error(preset):
    """resize_token_embeddings-style growth of a parameter after prepare(): a mixprec error that says the parameter
    changed shape (torch-internal size errors before; under *-mixed torch's fused kernel, picked for a foreach
    optimizer, corrupted memory once the state existed)."""
    from mixprec import MixedPrecision

    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 4))
    prec = MixedPrecision(preset)
    model, opt = prec.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    ids = torch.randint(0, 16, (5,))

    def step() -> None:
        with prec.autocast():
            loss = model(ids).float().pow(2).mean()
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad()

    step()  # the optimizer's state exists now
    emb = model[0].weight
    with torch.no_grad():
        emb.data = torch.cat([emb.data, emb.data[:4]])  # what resize_token_embeddings does to the parameter
    with pytest.raises(RuntimeError, match=r"changed shape after"):
        step()


@pytest.mark.parametrize("preset", ["bf16-master", "fp16-master", "bf16-master-r16"])
def test_optimizer_state_looked_up_by_model_parameter_is_the_masters_and_saving_still_works(preset: str) -> None:
    # torch-style logging: opt.state[p] for p in model.parameters(); it found {} and left an entry that broke saves
    import mixprec as mp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    prec = mp.MixedPrecision(preset)
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(prec, model, opt, 2)
    for p in model.parameters():
        st = opt.state[p]
        assert st is opt.optimizer.state[opt.master_for(p)] and "exp_avg_sq" in st
        assert p in opt.state
    assert len(opt.state) == len(list(model.parameters()))
    prec.state_dict()  # no stray entry under a model parameter


def _train(prec, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` ordinary steps on random batches of 3 x 4 (a squared-output loss)."""
    for _ in range(steps):
        with prec.autocast():
            loss = model(torch.randn(3, 4)).float().pow(2).mean()
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad()


class _SignSGD(torch.optim.Optimizer):
    """A user optimizer that steps its own cached list of parameters (as LBFGS keeps ``_params``)."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        params = list(params)
        super().__init__(params, {"lr": lr})
        self.plist = list(params)

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.plist:
            if p.grad is not None:
                p.add_(p.grad.sign(), alpha=-self.param_groups[0]["lr"])


@pytest.mark.parametrize("preset", ["bf16-master", "fp16-master", "bf16-master-r16"])
def test_a_user_optimizer_stepping_its_own_parameter_list_trains_the_masters(preset: str) -> None:
    import mixprec as mp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    before = [p.detach().clone() for p in model.parameters()]
    prec = mp.MixedPrecision(preset)
    model, opt = prec.prepare(model, _SignSGD(model.parameters(), lr=1e-2))
    _train(prec, model, opt, 3)
    for p, b in zip(model.parameters(), before):
        assert (p.float() - b).abs().max() > 0.02  # three sign steps of 0.01 (it moved by rounding only before)


class _DeepSGD(torch.optim.Optimizer):
    """Keeps its parameters three containers deep, where mixprec does not re-point them."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        params = list(params)
        super().__init__(params, {"lr": lr})
        self.holder = {"a": {"b": [params]}}

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.holder["a"]["b"][0]:
            if p.grad is not None:
                p.add_(p.grad.sign(), alpha=-self.param_groups[0]["lr"])


@pytest.mark.parametrize("preset", ["bf16-master", "fp16-master", "bf16-master-r16", "fp16-master-skips"])
def test_an_optimizer_stepping_half_weights_it_keeps_out_of_reach_is_an_error(preset: str) -> None:
    import mixprec as mp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    skips = 10 if preset == "fp16-master-skips" else 0  # an FP16 run's first steps overflow: they move nothing
    preset = preset.removesuffix("-skips")
    prec = mp.MixedPrecision(preset, scaler=mp.DynamicScaler(init_scale=2.0) if preset.startswith("fp16") else None)
    model, opt = prec.prepare(model, _DeepSGD(model.parameters()))
    for _ in range(skips):
        with prec.autocast():
            loss = model(torch.randn(3, 4)).float().pow(2).mean()
        prec.backward(loss * float("inf"))
        assert prec.step(opt).skipped
        opt.zero_grad()
    with prec.autocast():
        loss = model(torch.randn(3, 4)).float().pow(2).mean()
    prec.backward(loss)
    with pytest.raises(RuntimeError, match=r"_DeepSGD.step\(\) wrote model parameter 0 .* not its FP32 master"):
        prec.step(opt)


def test_the_inner_step_watch_ends_after_the_first_step_that_moved_a_master() -> None:
    import mixprec as mp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    prec = mp.MixedPrecision("bf16-master")
    model, opt = prec.prepare(model, _SignSGD(model.parameters()))  # (torch's optimizers are not watched)
    assert opt._watch_inner == 64
    for _ in range(2):
        _train(prec, model, opt, 1)
        assert opt._watch_inner == 0  # one step: the masters moved
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]})
    assert opt._watch_inner == 64  # watched again for the new parameters


def test_state_get_and_pop_of_a_parameter_without_state_insert_nothing() -> None:
    import mixprec as mp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)  # a frozen backbone outside the optimizer
    prec = mp.MixedPrecision("bf16-master")
    model, opt = prec.prepare(model, torch.optim.AdamW(model[1].parameters(), lr=1e-2))
    with prec.autocast():
        loss = model(torch.randn(3, 4)).float().pow(2).mean()
    prec.backward(loss)
    prec.step(opt)
    n = len(opt.state)
    assert [opt.state.get(p) is not None for p in model.parameters()] == [False, False, True, True]
    assert opt.state.pop(model[0].weight, "default") == "default"
    assert len(opt.state) == n
    prec.state_dict()


class _NestedSGD(torch.optim.Optimizer):
    """Keeps its parameters per group and by index, and adds to its list in add_param_group."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        self.per_group: list[list[torch.Tensor]] = []
        super().__init__(params, {"lr": lr})

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        self.per_group.append(list(self.param_groups[-1]["params"]))

    @torch.no_grad()
    def step(self, closure=None):
        for params in self.per_group:
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-self.param_groups[0]["lr"])


def test_nested_parameter_lists_and_groups_added_later_train_the_masters() -> None:
    import mixprec as mp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    head_before = model[1].weight.detach().clone()
    prec = mp.MixedPrecision("bf16-master")
    with pytest.warns(UserWarning, match="add_param_group"):
        model, opt = prec.prepare(model, _NestedSGD(model[0].parameters()))
        import mixprec._master as master_mod

        master_mod._WARNED_ADDED = False
        opt.add_param_group({"params": list(model[1].parameters())})
    _train(prec, model, opt, 3)
    assert all(t.dtype == torch.float32 for params in opt.optimizer.per_group for t in params)  # the masters
    assert (model[1].weight.float() - head_before).abs().max() > 0.02


@pytest.mark.parametrize("preset", ["bf16-master", "fp16-master", "bf16-pure"])
def test_a_module_added_after_prepare_is_refused_by_add_param_group_until_cast(preset: str) -> None:
    """A replaced head keeps its FP32 weights: it trained in FP32 beside the policy's half weights, silently."""
    import warnings

    import mixprec as mp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    prec = mp.MixedPrecision(preset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = prec.prepare(model, torch.optim.AdamW(model[0].parameters(), lr=1e-2))
    opt.add_param_group({"params": list(model[1].parameters())})  # an FP32 island prepare() cast: accepted
    model.append(torch.nn.LayerNorm(2))  # a norm added later, in FP32 as the policy's islands keep norms: accepted
    opt.add_param_group({"params": list(model[3].parameters())})
    del model[3]
    model[2] = torch.nn.Linear(8, 3)
    n = len(opt.param_groups)
    with pytest.raises(ValueError, match=r"f32 parameter of shape \(3, 8\) that prepare\(\) did not cast"):
        opt.add_param_group({"params": list(model[2].parameters())})
    assert len(opt.param_groups) == n
    model[2].to(prec.policy.param_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # masters from the rounded values
        opt.add_param_group({"params": list(model[2].parameters())})
    before = model[2].weight.detach().clone()
    _train(prec, model, opt, 2)
    assert model[2].weight.dtype == prec.policy.param_dtype and not torch.equal(model[2].weight, before)


@pytest.mark.parametrize("preset", ["bf16-master", "fp16-master", "bf16-master-r16"])
def test_a_dropped_master_weight_run_is_freed(preset: str) -> None:
    """The gradient views (the parameters' .grad, which gc cannot see through) held the optimizer through a bound method:
    every master-weight run stayed alive for good (model, masters, optimizer state)."""
    import gc
    import warnings
    import weakref

    import mixprec as mp

    def run():
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))
        prec = mp.MixedPrecision(preset)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        with prec.autocast():
            loss = model(torch.randn(4, 8)).float().square().mean()
        prec.backward(loss)
        prec.step(opt)
        return weakref.ref(model), weakref.ref(opt), weakref.ref(prec), weakref.ref(opt.masters[0])

    refs = run()
    gc.collect()
    assert [r() is None for r in refs] == [True] * 4


def test_a_scheduler_built_after_prepare_on_the_wrapped_optimizer_does_not_warn_falsely() -> None:
    """The inner step runs below torch's scheduler wrapper of the user's optimizer: its 'step ran' mark was never set, so
    a scheduler built on it after prepare warned 'lr_scheduler.step() before optimizer.step()' on a correct loop."""
    import warnings

    import mixprec as mp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prec = mp.MixedPrecision("bf16-master", fused=False)
    model, opt = prec.prepare(model, inner)
    sched = torch.optim.lr_scheduler.StepLR(inner, 1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with prec.autocast():
            loss = model(torch.randn(3, 4)).float().square().mean()
        prec.backward(loss)
        opt.step()
        sched.step()
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("accumulation", ["fp32", "compute"])
@pytest.mark.parametrize("preset", ["bf16-master", "fp16-master", "bf16-master-r16"])
def test_master_gradients_take_the_masters_memory_format(preset: str, accumulation: str, fused: bool) -> None:
    """A model moved to channels_last before or after prepare (half weights channels_last, FP32 masters channels_last
    or not): the master gradients are in the layout of the master the step reads, so torch's fused kernel (the
    user's ``fused=True``, or the twin of a foreach AdamW) reads them right: no host read, no warning, same result."""
    import mixprec as mp
    from mixprec.bench._step_cost import StepCounter

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 3, 6, 6, generator=g).contiguous(memory_format=torch.channels_last) for _ in range(4)]
    ys = [torch.randint(0, 5, (4,), generator=g) for _ in range(4)]
    results = []
    for after in (False, True):
        model = _cnn()
        if not after:
            model = model.to(memory_format=torch.channels_last)
        prec = mp.MixedPrecision(preset, grad_accumulation=accumulation)
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or None))
        if after:
            model = model.to(memory_format=torch.channels_last)
        reads = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for x, y in zip(xs, ys):
                with prec.autocast():
                    loss = nn.functional.cross_entropy(model(x).float(), y)
                prec.backward(loss)
                with StepCounter((opt,)) as c:
                    prec.step(opt)
                reads.append(c.host_reads)
                opt.zero_grad(set_to_none=True)
        assert reads == [0] * len(xs)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_parameter_viewing_part_of_a_larger_tensor_gets_a_whole_master() -> None:
    """``nn.Parameter(base[:, 3:9])`` under a master preset: its master is a dense copy with its values (elementwise
    fused kernels walk memory), and training matches the same model built from a whole tensor."""
    import mixprec as mp

    class M(nn.Module):
        def __init__(self, whole: bool) -> None:
            super().__init__()
            base = torch.randn(8, 20, generator=torch.Generator().manual_seed(0))
            self.w = nn.Parameter(base[:, 3:9].clone() if whole else base[:, 3:9])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x @ self.w).pow(2).mean()

    runs = []
    for whole in (False, True):
        model = M(whole)
        fp32 = model.w.detach().clone()
        prec = mp.MixedPrecision("bf16-master")
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        master = opt.masters[0]
        assert master.is_contiguous() and torch.equal(master, fp32)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for step in range(3):
                with prec.autocast():
                    loss = model(torch.randn(5, 8, generator=torch.Generator().manual_seed(step)))
                prec.backward(loss)
                prec.step(opt)
                opt.zero_grad(set_to_none=True)
        runs.append(opt.masters[0].clone())
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("preset", ["bf16-master", "bf16-master-r16"])
def test_assigned_gradients_of_another_layout_become_master_gradients_the_fused_step_reads(preset: str) -> None:
    """``p.grad = g`` from ``torch.autograd.grad`` of a conv fed channels_last input (g channels_last, the weight
    contiguous): the FP32 master gradient is in the master's layout: no fallback, no warning, the backward's result."""
    import mixprec as mp
    from mixprec.bench._step_cost import StepCounter

    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 6, 6, generator=g).contiguous(memory_format=torch.channels_last)
    results = []
    for assign in (False, True):
        model = _cnn()
        prec = mp.MixedPrecision(preset)
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                with prec.autocast():
                    loss = model(x).float().pow(2).mean()
                if assign:
                    params = list(model.parameters())
                    for p, grad in zip(params, torch.autograd.grad(loss, params)):
                        p.grad = grad
                else:
                    prec.backward(loss)
                with StepCounter((opt,)) as c:
                    prec.step(opt)
                assert c.host_reads == 0
                opt.zero_grad(set_to_none=True)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_accumulating_a_channels_last_models_gradients_gives_no_layout_contract_warning() -> None:
    """The master-gradient view has its parameter's strides: autograd adding a second micro-batch into it does not
    warn "grad and param do not obey the gradient layout contract" (plain torch does not either)."""
    import mixprec as mp

    model = _cnn().to(memory_format=torch.channels_last)
    prec = mp.MixedPrecision("bf16-master")
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randn(2, 3, 6, 6).contiguous(memory_format=torch.channels_last)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with prec.autocast():
                loss = model(x).float().pow(2).mean()
            prec.backward(loss)
        prec.step(opt)
    conv = next(model.parameters())
    assert isinstance(conv.grad, MasterGradView) and conv.grad.stride() == conv.stride()




@pytest.mark.parametrize("accumulation", ["fp32", "compute"])
@pytest.mark.parametrize("preset", ["bf16-master", "fp16-master", "bf16-master-r16"])
def test_a_sparse_embedding_trains_its_fp32_master_as_a_dense_one_does(preset: str, accumulation: str) -> None:
    """``Embedding(sparse=True)`` (the model bf16-pure's refusal sends to a master preset): its sparse half gradient
    becomes a sparse FP32 master gradient, accumulated over micro-batches, and the master moves as the same run with
    a dense embedding moves it (to the rounding of summing in another order), near an FP32 run of torch's SGD; rows
    no batch touched stay as they were."""
    import mixprec
    from mixprec.checkpoint import fp32_state_dict

    class Model(nn.Module):
        def __init__(self, sparse: bool) -> None:
            super().__init__()
            self.emb = nn.Embedding(20, 8, sparse=sparse)
            self.head = nn.Linear(8, 3)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids).mean(1)).float()

    # torch's autograd cannot add two sparse FP16 gradients on a CPU ("cadd_sparse" not implemented for 'Half'):
    # fp16 gradients accumulated in fp16 take one micro-batch per step.
    micro = 1 if (preset, accumulation) == ("fp16-master", "compute") else 2
    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 16, (4, 5), generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(6)]

    def updates(sparse: bool | None) -> torch.Tensor:
        torch.manual_seed(0)
        model = Model(bool(sparse))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        if sparse is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # fp16 on a CPU
                prec = mixprec.MixedPrecision(preset, grad_accumulation=accumulation)
                model, opt = prec.prepare(model, opt)
        start = model.emb.weight.detach().clone() if sparse is None else fp32_state_dict(prec)["emb.weight"]
        for step in range(3):
            for ids, y in data[micro * step: micro * step + micro]:
                if sparse is None:
                    nn.functional.cross_entropy(model(ids), y).div(micro).backward()
                    continue
                with prec.autocast():
                    loss = nn.functional.cross_entropy(model(ids), y).div(micro)
                prec.backward(loss)
            if sparse is None:
                opt.step()
            else:
                assert prec.step(opt).applied()
            opt.zero_grad()
        end = model.emb.weight.detach() if sparse is None else fp32_state_dict(prec)["emb.weight"]
        return end - start

    sparse, dense, fp32 = updates(True), updates(False), updates(None)
    assert fp32[:16].abs().amax() > 1e-2 and torch.equal(fp32[16:], torch.zeros(4, 8))
    ulp = 2.0**-8 if "bf16" in preset else 2.0**-11
    torch.testing.assert_close(sparse, dense, atol=ulp * 4e-2, rtol=0)  # updates ~2.5e-2
    torch.testing.assert_close(sparse, fp32, atol=ulp * 0.5, rtol=0)
    assert torch.equal(sparse[16:], torch.zeros(4, 8))  # rows no id reached


@pytest.mark.parametrize("preset", ["bf16-master", "fp16-master", "bf16-master-r16"])
def test_zero_grad_keeping_zeros_steps_an_unreached_parameter_under_compute_accumulation(preset: str) -> None:
    """``zero_grad(set_to_none=False)`` leaves a zero gradient, so AdamW keeps stepping a parameter the next backward
    does not reach (an unused branch, an expert without tokens: momentum and weight decay). Under
    ``grad_accumulation="compute"`` the step had dropped the gradient, so that parameter stopped moving; now it moves
    as under FP32 accumulation (as torch moves it), bit for bit."""
    import mixprec
    from mixprec.checkpoint import fp32_state_dict

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.h = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
            return self.h(torch.relu(self.a(x) + (self.b(x) if use_b else 0)))

    def run(accumulation: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = Branchy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fp16 on a CPU
            prec = mixprec.MixedPrecision(preset, grad_accumulation=accumulation)
            model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
        seen = []
        for i in range(5):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with prec.autocast():
                loss = nn.functional.cross_entropy(model(x, use_b=i < 2), y)  # b unreached from step 2 on
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad(set_to_none=False)
            seen.append(fp32_state_dict(prec)["b.weight"])
        return seen

    fp32, compute = run("fp32"), run("compute")
    for a, b in zip(fp32, compute):
        assert torch.equal(a, b)
    assert all((compute[i] - compute[i - 1]).abs().max() > 1e-3 for i in range(2, 5))  # still stepped


@pytest.mark.parametrize("preset", ["bf16-master", "bf16-master-r16"])
def test_zero_grad_keeping_zeros_keeps_a_sparse_gradient_sparse_under_compute_accumulation(preset: str) -> None:
    """The zero gradient ``zero_grad(set_to_none=False)`` leaves for a sparse embedding is sparse (torch zeroes it in
    place): a dense zero made the next gradient dense, and SparseAdam refused it at the second step."""
    import mixprec

    model = nn.Sequential(nn.Embedding(20, 8, sparse=True), nn.Linear(8, 3))
    prec = mixprec.MixedPrecision(preset, grad_accumulation="compute")
    emb_opt = torch.optim.SparseAdam(list(model[0].parameters()), lr=1e-2)
    head_opt = torch.optim.AdamW(model[1].parameters(), lr=1e-2)
    model, emb_opt, head_opt = prec.prepare(model, emb_opt, head_opt)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids, y = torch.randint(0, 20, (4, 5), generator=g), torch.randint(0, 3, (4,), generator=g)
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(ids).mean(1).float(), y)
        prec.backward(loss)
        assert model[0].weight.grad is not None and model[0].weight.grad.is_sparse
        prec.step(emb_opt)
        prec.step(head_opt)
        prec.zero_grad(set_to_none=False)
        grad = model[0].weight.grad
        assert grad is not None and grad.is_sparse and grad._nnz() == 0
