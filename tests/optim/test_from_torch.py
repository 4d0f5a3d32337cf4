"""from_torch: torch.optim AdamW / Adam / SGD -> mixprec.optim, with groups, hyper-parameters and state."""

import copy
import gc
import pickle
import re
import warnings
import weakref

import pytest
import torch

import mixprec.optim as mo

from ._util import batch, loss_fn, mlp, train_step


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


def test_hooks_registered_before_the_conversion_run_with_the_converted_optimizer():
    model = mlp()
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = []
    torch_opt.register_step_pre_hook(lambda o, a, k: seen.append(("step_pre", o)))
    torch_opt.register_step_post_hook(lambda o, a, k: seen.append(("step_post", o)))
    torch_opt.register_state_dict_pre_hook(lambda o: seen.append(("state_dict_pre", o)))
    torch_opt.register_state_dict_post_hook(lambda o, sd: seen.append(("state_dict_post", o)))
    torch_opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append(("load_pre", o)))
    torch_opt.register_load_state_dict_post_hook(lambda o: seen.append(("load_post", o)))
    removed = torch_opt.register_step_post_hook(lambda o, a, k: seen.append(("removed", o)))
    ours = mo.from_torch(torch_opt)
    removed.remove()  # a handle from before the conversion still removes its hook
    train_step(model, ours, 0)
    ours.load_state_dict(ours.state_dict())
    assert seen == [("step_pre", ours), ("step_post", ours), ("state_dict_pre", ours), ("state_dict_post", ours),
                    ("load_pre", ours), ("load_post", ours)]


def test_bf16_pure_runs_the_hooks_of_the_users_optimizer():
    """bf16-pure converts the optimizer; hooks registered on the user's torch optimizer run, as under bf16-mixed."""
    import mixprec as mp

    fired = {}
    for preset in ("bf16-mixed", "bf16-pure"):
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        log = fired[preset] = []
        opt.register_step_pre_hook(lambda o, a, k, log=log: log.append("step_pre"))
        opt.register_step_post_hook(lambda o, a, k, log=log: log.append("step_post"))
        opt.register_state_dict_post_hook(lambda o, sd, log=log: log.append("state_dict_post"))
        prec = mp.MixedPrecision(preset)
        model, prepared = prec.prepare(model, opt)
        x, y = batch(0)
        with prec.autocast():
            loss = loss_fn(model, x, y)
        prec.backward(loss)
        prepared.step()
        prepared.zero_grad()
        prepared.state_dict()
    assert fired["bf16-pure"] == fired["bf16-mixed"] == ["step_pre", "step_post", "state_dict_post"]


_SCHED_WARNING = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


def _scheduler_warned(preset: str, built: str, step_first: bool) -> bool:
    import mixprec as mp

    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1) if built == "before" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec = mp.MixedPrecision(preset)
        model, prepared = prec.prepare(model, opt)
    if sched is None:
        sched = torch.optim.lr_scheduler.StepLR(prepared, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if step_first:
            x, y = batch(0)
            with prec.autocast():
                loss = loss_fn(model, x, y)
            prec.backward(loss)
            prepared.step()
        sched.step()
    return any(_SCHED_WARNING in str(w.message) for w in caught)


@pytest.mark.parametrize("built", ["before", "after"])
@pytest.mark.parametrize("step_first", [False, True])
def test_bf16_pure_warns_of_a_scheduler_stepped_first_as_the_other_policies(built, step_first):
    """torch's "lr_scheduler.step() before optimizer.step()" warning: bf16-pure used to hide it (the conversion
    marked the torch optimizer as stepped); it must warn exactly when bf16-mixed and bf16-master warn."""
    want = not step_first
    for preset in ("bf16-mixed", "bf16-master", "bf16-pure"):
        assert _scheduler_warned(preset, built, step_first) is want, preset


def test_the_converted_optimizers_steps_mark_the_torch_optimizer_for_its_scheduler():
    model = mlp()
    torch_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(torch_opt, 1)
    ours = mo.from_torch(torch_opt)
    assert not getattr(torch_opt, "_opt_called", False)  # converting is not stepping
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=re.escape(_SCHED_WARNING))
        train_step(model, ours, 0)
        sched.step()
    # A step before the conversion counts (torch's mark, set by the step wrapper of a scheduler built first).
    stepped = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(stepped, 1)
    train_step(model, stepped, 1)
    ours = mo.from_torch(stepped)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=re.escape(_SCHED_WARNING))
        torch.optim.lr_scheduler.StepLR(ours, 1).step()


def test_a_scheduler_on_the_torch_optimizer_follows_a_load_state_dict_of_the_converted_one():
    model = mlp()
    torch_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=1, gamma=0.5)
    ours = mo.from_torch(torch_opt)
    train_step(model, ours, 0)
    ours.load_state_dict(copy.deepcopy(ours.state_dict()))  # replaces the group dicts
    sched.step()
    assert ours.param_groups[0]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_bf16_pure_copied_run_keeps_its_scheduler_through_a_load(how):
    """A copy drops load_state_dict hooks (torch's Optimizer.__getstate__): the converted optimizer's own
    load_state_dict re-points the torch optimizer's groups, in a copy the copy of the torch optimizer's."""
    import mixprec as mp

    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # built before prepare, as usual
    prec = mp.MixedPrecision("bf16-pure")
    model, prepared = prec.prepare(model, opt)
    run = (prec, model, prepared, sched)
    run = copy.deepcopy(run) if how == "deepcopy" else pickle.loads(pickle.dumps(run))
    prec, model, prepared, sched = run
    prec.load_state_dict(copy.deepcopy(prec.state_dict()))
    lrs = []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=re.escape(_SCHED_WARNING))  # the copy's steps mark its torch optimizer
        warnings.filterwarnings("ignore", message=re.escape("Seems like `optimizer.step()` has been overridden"))  # torch's
        for i in range(3):
            x, y = batch(i)
            with prec.autocast():
                loss = loss_fn(model, x, y)
            prec.backward(loss)
            prepared.step()
            prepared.zero_grad()
            sched.step()
            lrs.append(prepared.param_groups[0]["lr"])
    assert lrs == pytest.approx([5e-3, 2.5e-3, 1.25e-3])


def test_the_converted_optimizer_holds_the_torch_optimizer_weakly():
    model = mlp()
    torch_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ours = mo.from_torch(torch_opt)
    ref = weakref.ref(torch_opt)
    del torch_opt
    gc.collect()
    assert ref() is None
    train_step(model, ours, 0)  # a dead source: nothing to mark
    copied = copy.deepcopy(ours)  # and nothing to copy
    assert copied._torch_source is None
