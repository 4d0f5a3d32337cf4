"""With FP32 parameters mixprec's optimizers are torch.optim's (any compensation, any chunking)."""

import pytest
import torch

import mixprec.optim as mo

from ._util import COMPENSATIONS, mlp, train_step

# Tolerance: on CPU the operation order is torch's single-tensor one, so AdamW/Adam and SGD without
# dampening agree to the last bit in practice; we allow a few FP32 ulps (rtol 1e-6). On CUDA torch
# uses its multi-tensor kernels (another operation order): rtol 1e-5 after 12 steps.
TOL = {"cpu": (1e-6, 1e-7), "cuda": (1e-5, 1e-6)}

ADAM_CONFIGS = [
    {},
    {"weight_decay": 0.1},
    {"weight_decay": 0.0, "betas": (0.8, 0.99), "eps": 1e-6},
    {"amsgrad": True, "weight_decay": 0.05},
    {"maximize": True},
]
SGD_CONFIGS = [
    {},
    {"momentum": 0.9},
    {"momentum": 0.9, "dampening": 0.3, "weight_decay": 1e-2},
    {"momentum": 0.8, "nesterov": True, "weight_decay": 1e-3},
    {"momentum": 0.5, "maximize": True},
]


def _groups(model, lr_scale=1.0):
    first, rest = list(model[0].parameters()), [p for m in list(model)[1:] for p in m.parameters()]
    return [{"params": first, "lr": 3e-2 * lr_scale}, {"params": rest}]


def _compare(ref_cls, ours_cls, cfg, lr, device, comp="kahan", chunk=None, steps=12):
    torch_model, our_model = mlp(device=device), mlp(device=device)
    ref = ref_cls(_groups(torch_model), lr=lr, **cfg)
    kw = {} if chunk is None else {"chunk_numel": chunk}
    ours = ours_cls(_groups(our_model), lr=lr, compensation=comp, **cfg, **kw)
    for step in range(steps):
        drop = step % 3 == 1  # first layer has no grad on some steps: its step counter lags the others
        train_step(torch_model, ref, step, device, drop_first_layer=drop)
        train_step(our_model, ours, step, device, drop_first_layer=drop)
    rtol, atol = TOL[torch.device(device).type]
    for (name, a), b in zip(torch_model.named_parameters(), our_model.parameters()):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
    for a, b in zip(torch_model.parameters(), our_model.parameters()):
        sa, sb = ref.state[a], ours.state[b]
        for k, v in sa.items():
            torch.testing.assert_close(sb[k].to(v.device).reshape(v.shape).to(v.dtype), v, rtol=rtol, atol=atol)


@pytest.mark.parametrize("cfg", ADAM_CONFIGS, ids=str)
def test_adamw_matches_torch_at_fp32(cfg, device):
    _compare(torch.optim.AdamW, mo.AdamW, cfg, 1e-2, device)


@pytest.mark.parametrize("cfg", [{"weight_decay": 0.1}, {"weight_decay": 0.1, "amsgrad": True}], ids=str)
def test_adam_l2_matches_torch_adam_at_fp32(cfg, device):
    _compare(torch.optim.Adam, mo.Adam, cfg, 1e-2, device)


@pytest.mark.parametrize("cfg", SGD_CONFIGS, ids=str)
def test_sgd_matches_torch_at_fp32(cfg, device):
    _compare(torch.optim.SGD, mo.SGD, cfg, 0.05, device)


@pytest.mark.parametrize("comp", COMPENSATIONS)
@pytest.mark.parametrize("chunk", [1, 7, 100])
def test_compensation_and_chunking_do_not_change_fp32_results(comp, chunk):
    # chunk_numel=7 cuts the 16x16 weight into slices and packs small tensors together; 1 is one element per chunk.
    _compare(torch.optim.AdamW, mo.AdamW, {"weight_decay": 0.1, "amsgrad": True}, 1e-2, "cpu", comp=comp, chunk=chunk, steps=6)
    _compare(torch.optim.SGD, mo.SGD, {"momentum": 0.9, "dampening": 0.2}, 0.05, "cpu", comp=comp, chunk=chunk, steps=6)


def test_tensor_lr_and_lr_scheduler():
    torch_model, our_model = mlp(), mlp()
    ref = torch.optim.AdamW(torch_model.parameters(), lr=torch.tensor(1e-2))
    ours = mo.AdamW(our_model.parameters(), lr=torch.tensor(1e-2))
    s_ref = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    s_ours = torch.optim.lr_scheduler.StepLR(ours, step_size=2, gamma=0.5)
    for step in range(6):
        train_step(torch_model, ref, step)
        train_step(our_model, ours, step)
        s_ref.step()
        s_ours.step()
    for a, b in zip(torch_model.parameters(), our_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_closure_is_called_with_grad_enabled():
    model = mlp()
    opt = mo.SGD(model.parameters(), lr=0.1)

    def closure():
        opt.zero_grad()
        assert torch.is_grad_enabled()
        from ._util import batch, loss_fn

        loss = loss_fn(model, *batch(0))
        loss.backward()
        return loss

    assert isinstance(opt.step(closure), torch.Tensor)


def test_non_contiguous_parameters_and_sliced_big_parameters():
    torch.manual_seed(0)
    base = [torch.randn(6, 40).t(), torch.randn(300), torch.randn(5, 7)]  # transposed, big (sliced), small
    assert not base[0].is_contiguous()
    ref_params = [torch.nn.Parameter(b.clone().t().contiguous().t() if i == 0 else b.clone()) for i, b in enumerate(base)]
    our_params = [torch.nn.Parameter(b.clone().t().contiguous().t() if i == 0 else b.clone()) for i, b in enumerate(base)]
    assert not our_params[0].is_contiguous()
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1)
    ours = mo.AdamW(our_params, lr=1e-2, weight_decay=0.1, chunk_numel=64)  # 300 -> 5 slices; 240 alone
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        for a, b in zip(ref_params, our_params):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        ref.step()
        ours.step()
    assert not our_params[0].is_contiguous()
    for a, b in zip(ref_params, our_params):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
