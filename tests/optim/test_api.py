"""Public surface and argument errors of mixprec.optim."""

import re

import pytest
import torch

import mixprec.optim as mo


def test_public_names():
    assert sorted(mo.__all__) == sorted([
        "SGD", "Adam", "AdamW", "Compensation", "LowPrecisionOptimizer", "from_torch", "kahan_add_", "stochastic_round",
    ])
    for name in mo.__all__:
        assert getattr(mo, name) is not None
    assert issubclass(mo.Adam, mo.AdamW) and issubclass(mo.AdamW, torch.optim.Optimizer)
    assert mo.AdamW._step_supports_amp_scaling and mo.SGD._step_supports_amp_scaling


def _p(dtype=torch.bfloat16):
    return [torch.nn.Parameter(torch.zeros(3, dtype=dtype))]


def test_unknown_compensation_lists_the_choices():
    msg = "unknown compensation 'kahn'; choose one of: kahan, stochastic, none. Did you mean 'kahan'?"
    with pytest.raises(ValueError, match=re.escape(msg)):
        mo.AdamW(_p(), compensation="kahn")


def test_fp16_states_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=re.escape("float16 is refused because exp_avg_sq holds squared gradients")):
        mo.AdamW(_p(), state_dtype=torch.float16)
    assert mo.AdamW(_p(), state_dtype="bf16").state_dtype == torch.bfloat16


@pytest.mark.parametrize("kw,match", [
    ({"lr": -1.0}, "invalid learning rate lr=-1.0; use lr >= 0."),
    ({"betas": (0.9, 1.0)}, "each beta must be in [0, 1)"),
    ({"eps": -1e-8}, "invalid eps"),
    ({"weight_decay": -0.1}, "invalid weight_decay"),
    ({"chunk_numel": 0}, "chunk_numel=0; use a positive int"),
])
def test_adamw_argument_errors(kw, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        mo.AdamW(_p(), **kw)


def test_sgd_argument_errors():
    with pytest.raises(ValueError, match=re.escape("nesterov=True needs momentum > 0 and dampening == 0")):
        mo.SGD(_p(), lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="invalid momentum"):
        mo.SGD(_p(), lr=0.1, momentum=-0.5)


def test_unsupported_parameters_and_gradients():
    with pytest.raises(ValueError, match=re.escape("got a torch.complex64 parameter of shape (3,)")):
        mo.SGD([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))], lr=0.1)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = mo.SGD(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()


def test_bad_group_is_not_added():
    opt = mo.SGD(_p(), lr=0.1)
    with pytest.raises(ValueError):
        opt.add_param_group({"params": _p(), "lr": -1.0})
    assert len(opt.param_groups) == 1


def test_fp64_parameters_compute_in_fp64():
    ref = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    ours = torch.nn.Parameter(ref.detach().clone())
    a = torch.optim.AdamW([ref], lr=1e-2)
    b = mo.AdamW([ours], lr=1e-2)
    for _ in range(3):
        for p, o in ((ref, a), (ours, b)):
            p.grad = torch.sin(p.detach() * 3)
            o.step()
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-14)


def test_a_cpu_tensor_lr_goes_to_the_device_by_value():
    """optim._parts.lr_on: a CPU lr for another device is written by a fill (no blocking copy, no host sync on a GPU),
    with .to()'s rounding; same-device and traced conversions stay .to()."""
    from mixprec.optim._parts import lr_on

    lr = torch.tensor([0.1], dtype=torch.float64)
    meta = lr_on(lr, torch.device("meta"), torch.float32)
    assert meta.device.type == "meta" and meta.shape == lr.shape and meta.dtype == torch.float32
    same = lr_on(lr, torch.device("cpu"), torch.float32)
    assert torch.equal(same, lr.to(torch.float32))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = lr_on(lr, torch.device("cuda"), torch.float32)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got.cpu(), lr.to(torch.float32))
