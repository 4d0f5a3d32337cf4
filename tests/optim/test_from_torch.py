"""from_torch: torch.optim AdamW / Adam / SGD -> mixprec.optim, with groups, hyper-parameters and state."""

import re

import pytest
import torch

import mixprec.optim as mo

from ._util import mlp, train_step


def _groups(model):
    return [{"params": model[0].parameters(), "lr": 3e-2, "name": "first"},
            {"params": [p for m in list(model)[1:] for p in m.parameters()]}]


CASES = [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}, mo.AdamW),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}, mo.Adam),  # L2 weight decay, kept as L2
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True}, mo.Adam),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.2, "weight_decay": 1e-2}, mo.SGD),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "maximize": True}, mo.SGD),
]


@pytest.mark.parametrize("torch_cls,kw,ours_cls", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_converted_mid_training_continues_like_torch(torch_cls, kw, ours_cls):
    ref_model, model = mlp(), mlp()
    ref = torch_cls(_groups(ref_model), **kw)
    torch_opt = torch_cls(_groups(model), **kw)
    for step in range(3):
        train_step(ref_model, ref, step)
        train_step(model, torch_opt, step)
    ours = mo.from_torch(torch_opt, compensation="kahan", state_dtype=torch.float32)
    assert type(ours) is ours_cls
    assert ours.param_groups[0]["name"] == "first" and ours.param_groups[0]["lr"] == 3e-2
    for step in range(3, 7):
        train_step(ref_model, ref, step)
        train_step(model, ours, step)
    for a, b in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_adam_weight_decay_stays_l2():
    ours = mo.from_torch(torch.optim.Adam(mlp().parameters(), weight_decay=0.1))
    assert ours.param_groups[0]["decoupled_weight_decay"] is False
    ours = mo.from_torch(torch.optim.AdamW(mlp().parameters(), weight_decay=0.1))
    assert ours.param_groups[0]["decoupled_weight_decay"] is True


def test_groups_are_shared_so_a_scheduler_keeps_working():
    model = mlp()
    torch_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=1, gamma=0.5)
    ours = mo.from_torch(torch_opt)
    assert ours.param_groups is torch_opt.param_groups
    train_step(model, ours, 0)
    sched.step()
    assert ours.param_groups[0]["lr"] == pytest.approx(0.05)


def test_half_precision_conversion_with_seeded_compensation():
    # How MixedPrecision's bf16-pure preset uses it: FP32 weights kept, model cast, optimizer converted, seeded.
    model = mlp()
    w32 = {p: p.detach().clone() for p in model.parameters()}
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.to(torch.bfloat16)
    ours = mo.from_torch(torch_opt, compensation="kahan", state_dtype=torch.bfloat16)
    ours.load_full_precision_params_(w32)
    full = ours.full_precision_params()
    for p, w in w32.items():
        assert (full[p] - w).abs().max() <= (p.float() - w).abs().max() * 2**-7
    train_step(model, ours, 0)
    st = ours.state[model[0].weight]
    assert st["exp_avg"].dtype == torch.bfloat16 and st["kahan_comp"].dtype == torch.bfloat16


def test_state_is_carried_into_state_dtype():
    model = mlp()
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, torch_opt, 0)
    ours = mo.from_torch(torch_opt, compensation="stochastic", state_dtype="bf16", seed=3)
    st = ours.state[model[0].weight]
    assert st["exp_avg"].dtype == torch.bfloat16 and st["step"].item() == 1.0
    assert ours.compensation == "stochastic" and ours.seed == 3


def test_other_optimizers_are_refused_with_a_type_error():
    params = list(mlp().parameters())
    msg = ("from_torch converts torch.optim.AdamW, torch.optim.Adam and torch.optim.SGD; got "
           "torch.optim.rmsprop.RMSprop.")
    with pytest.raises(TypeError, match=re.escape(msg)):
        mo.from_torch(torch.optim.RMSprop(params))

    class MyAdamW(torch.optim.AdamW):
        pass

    with pytest.raises(TypeError, match="MyAdamW"):
        mo.from_torch(MyAdamW(params))
    with pytest.raises(TypeError, match="already a mixprec.optim.SGD"):
        mo.from_torch(mo.SGD(params, lr=0.1))
    with pytest.raises(TypeError, match="from_torch converts"):
        mo.from_torch("adamw")  # type: ignore[arg-type]


def test_differentiable_is_refused():
    with pytest.raises(ValueError, match="differentiable=True"):
        mo.from_torch(torch.optim.SGD(mlp().parameters(), lr=0.1, differentiable=True))


@pytest.mark.parametrize("torch_cls,kw,ours_cls", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_group_added_later_gets_the_users_hyper_parameters(torch_cls, kw, ours_cls):
    """``defaults`` are the torch optimizer's: add_param_group fills a new group as torch would (not with lr=1e-3)."""
    model = mlp()
    ref = torch_cls(model[0].parameters(), **kw)
    ours = mo.from_torch(torch_cls(model[0].parameters(), **kw))
    extra = [p for m in list(model)[1:] for p in m.parameters()]
    ref.add_param_group({"params": extra})
    ours.add_param_group({"params": extra})
    for key, value in ref.param_groups[1].items():
        if key not in ("params", "foreach", "fused", "capturable", "differentiable"):
            assert ours.param_groups[1][key] == value, key
    if ours_cls is not mo.SGD:
        want = ours_cls is mo.AdamW or kw.get("decoupled_weight_decay", False)
        assert ours.param_groups[1]["decoupled_weight_decay"] is want
