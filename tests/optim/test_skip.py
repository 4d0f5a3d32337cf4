"""grad_scale / found_inf: the step divides by the scale and skips on the device, bit for bit."""

import itertools
import warnings

import pytest
import torch

import mixprec.optim as mo

from ._util import COMPENSATIONS, assert_bit_identical, mlp, snapshot, train_step

CONFIGS = list(itertools.product(["adamw", "sgd"], COMPENSATIONS, [torch.float32, torch.bfloat16]))


def _half_model(dtype=torch.bfloat16, device="cpu"):
    model = mlp(device=device).to(dtype)
    model[2].float()  # an FP32 island inside a half-precision model: mixed dtype buckets
    return model


def _opt(kind, model, comp, sdt, **kw):
    if kind == "adamw":
        return mo.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True, compensation=comp,
                        state_dtype=sdt, seed=0, **kw)
    return mo.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2, compensation=comp,
                  state_dtype=sdt, seed=0, **kw)


def _poison(model):
    g = model[0].weight.grad
    g[0, 0] = float("inf")
    model[4].bias.grad[1] = float("nan")


@pytest.mark.parametrize("kind,comp,sdt", CONFIGS)
def test_found_inf_leaves_everything_bit_identical(kind, comp, sdt, device):
    model = _half_model(device=device)
    opt = _opt(kind, model, comp, sdt, chunk_numel=50)  # several chunks, the 16x16 weight cut in slices
    for step in range(3):
        train_step(model, opt, step, device)
    before = snapshot(opt)
    opt.zero_grad()
    from ._util import batch, loss_fn

    loss_fn(model, *batch(5, device)).backward()
    _poison(model)
    found_inf = torch.tensor(1.0, device=device)
    opt.step(found_inf=found_inf)
    assert_bit_identical(snapshot(opt), before)  # params, moments, kahan_comp and step counters
    # found_inf from torch.amp.GradScaler can be a sum over devices (2.0): still a skip.
    opt.step(found_inf=torch.tensor(2.0, device=device))
    assert_bit_identical(snapshot(opt), before)


@pytest.mark.parametrize("kind,comp,sdt", CONFIGS)
def test_found_inf_zero_equals_no_found_inf(kind, comp, sdt):
    a_model, b_model = _half_model(), _half_model()
    a, b = _opt(kind, a_model, comp, sdt), _opt(kind, b_model, comp, sdt)
    for step in range(4):
        train_step(a_model, a, step)
        train_step(b_model, b, step, found_inf=torch.tensor(0.0))
    assert_bit_identical(snapshot(a), snapshot(b))


def test_skipped_first_sgd_step_leaves_momentum_uninitialised():
    # torch's SGD initialises the buffer to the gradient on the first *applied* step (no dampening).
    ref_model, model = mlp(), mlp()
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9, dampening=0.5)
    ours = mo.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.5)
    train_step(model, ours, 0, found_inf=torch.tensor(1.0))  # skipped (torch: step not called)
    for step in range(1, 5):
        train_step(ref_model, ref, step)
        train_step(model, ours, step)
    for a, b in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("comp", COMPENSATIONS)
def test_grad_scale_divides_inside_the_step(comp):
    a_model, b_model = _half_model(), _half_model()
    a, b = _opt("adamw", a_model, comp, torch.float32), _opt("adamw", b_model, comp, torch.float32)
    for step in range(3):
        train_step(a_model, a, step)
        b.zero_grad()
        from ._util import batch, loss_fn

        (loss_fn(b_model, *batch(step)) * 1024).backward()
        grads = [p.grad.clone() for p in b_model.parameters()]
        b.step(grad_scale=torch.tensor(1024.0))
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, b_model.parameters()))  # grads not modified
    assert_bit_identical(snapshot(a), snapshot(b))  # a power-of-two scale divides exactly


def test_attributes_set_by_a_scaler_are_read():
    a_model, b_model = _half_model(), _half_model()
    a, b = _opt("sgd", a_model, "kahan", torch.float32), _opt("sgd", b_model, "kahan", torch.float32)
    assert a._step_supports_amp_scaling is True
    assert not hasattr(a, "grad_scale") and not hasattr(a, "found_inf")  # torch.amp.GradScaler uses getattr(..., 1)
    for opt, model in ((a, a_model), (b, b_model)):
        train_step(model, opt, 0)
    train_step(a_model, a, 1, found_inf=torch.tensor(1.0))
    before = snapshot(b)
    b.found_inf = torch.tensor(1.0)
    train_step(b_model, b, 1)
    assert_bit_identical(snapshot(b), before)
    del b.found_inf
    b.grad_scale = torch.tensor(1.0)
    for opt, model in ((a, a_model), (b, b_model)):
        train_step(model, opt, 2)
    assert_bit_identical(snapshot(a), snapshot(b))


@pytest.mark.parametrize("comp", COMPENSATIONS)
def test_torch_amp_grad_scaler_uses_the_on_device_path(comp):
    from ._util import batch, loss_fn

    ref_model, model = _half_model(), _half_model()
    ref, opt = _opt("adamw", ref_model, comp, torch.float32), _opt("adamw", model, comp, torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    calls = []
    real_step = opt.step
    opt.step = lambda *a, **k: calls.append((getattr(opt, "grad_scale", None), getattr(opt, "found_inf", None))) or real_step(*a, **k)
    for step in range(4):
        opt.zero_grad()
        scaler.scale(loss_fn(model, *batch(step))).backward()
        if step == 2:
            _poison(model)
            before = snapshot(opt)
        scaler.step(opt)
        scaler.update()
        if step == 2:
            assert_bit_identical(snapshot(opt), before)
            assert scaler.get_scale() == 2.0**9
        # The reference skips step 2 too: a skipped step still draws its random bits.
        train_step(ref_model, ref, step, found_inf=torch.tensor(float(step == 2)))
    assert len(calls) == 4 and all(gs is not None and fi is not None for gs, fi in calls)
    assert_bit_identical(snapshot(opt), snapshot(ref))


def test_mixprec_step_optimizer_uses_the_on_device_path():
    from mixprec._stepping import step_with_result

    model = _half_model()
    opt = _opt("adamw", model, "kahan", torch.float32)
    train_step(model, opt, 0)
    before = snapshot(opt)
    opt.zero_grad()
    from ._util import batch, loss_fn

    loss_fn(model, *batch(1)).backward()
    _poison(model)
    skipped, _ = step_with_result(opt, torch.tensor(1.0), None, (), {})
    assert bool(skipped)
    assert_bit_identical(snapshot(opt), before)


@pytest.mark.cuda
def test_no_host_sync_in_step_on_cuda():
    model = _half_model(device="cuda")
    opt = _opt("adamw", model, "stochastic", torch.bfloat16, chunk_numel=50)
    train_step(model, opt, 0, "cuda", found_inf=torch.tensor(0.0, device="cuda"))  # state created
    from ._util import batch, loss_fn

    opt.zero_grad()
    loss_fn(model, *batch(1, "cuda")).backward()
    found_inf = torch.tensor(1.0, device="cuda")
    scale = torch.tensor(1.0, device="cuda")
    # Both configurations compiled before the check (Inductor's compile syncs; under "error" it
    # failed and the step fell back to eager, found on an H200): the steady-state steps are checked.
    opt.step(grad_scale=scale, found_inf=found_inf)
    opt.step(found_inf=torch.ones_like(found_inf))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a fallback to the eager step fails the test
            opt.step(grad_scale=scale, found_inf=found_inf)
            opt.step(found_inf=torch.zeros_like(found_inf))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.fused_enabled("cuda")
