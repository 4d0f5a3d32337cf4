"""state_dict / load_state_dict, resume, and seeding the compensation from FP32 weights."""

import copy
import io
import itertools
import re

import pytest
import torch

import mixprec.optim as mo

from ._util import COMPENSATIONS, assert_bit_identical, make, mlp, snapshot, train_step

CONFIGS = list(itertools.product(["adamw", "sgd"], COMPENSATIONS, [torch.float32, torch.bfloat16]))


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _build(kind, comp, sdt, device="cpu", seed=0):
    model = mlp(device=device).to(torch.bfloat16)
    return model, make(kind, model.parameters(), compensation=comp, state_dtype=sdt, seed=seed, chunk_numel=64)


@pytest.mark.parametrize("kind,comp,sdt", CONFIGS)
def test_resume_is_bit_identical(kind, comp, sdt, device):
    model, opt = _build(kind, comp, sdt, device)
    for step in range(8):
        train_step(model, opt, step, device, drop_first_layer=step == 5,
                   found_inf=torch.tensor(float(step == 6), device=device))
        if step == 3:
            ckpt = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    # A fresh run, different construction seed (the checkpoint's seed must win).
    model2, opt2 = _build(kind, comp, sdt, device, seed=123)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    for step in range(4, 8):
        train_step(model2, opt2, step, device, drop_first_layer=step == 5,
                   found_inf=torch.tensor(float(step == 6), device=device))
    assert_bit_identical(snapshot(opt2), snapshot(opt))


def test_state_dict_contents():
    model, opt = _build("adamw", "stochastic", torch.bfloat16)
    train_step(model, opt, 0)
    sd = opt.state_dict()
    meta = sd["mixprec"]
    assert meta["version"] == 2 and meta["compensation"] == "stochastic" and meta["state_dtype"] == "bf16"
    assert meta["seed"] == 0 and "generators" not in meta  # counter-based bits: the seed is all there is
    st = sd["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
    assert st["exp_avg"].dtype == torch.bfloat16 and st["step"].dtype == torch.float32 and st["step"].dim() == 0
    model, opt = _build("adamw", "kahan", torch.float32)
    train_step(model, opt, 0)
    st = opt.state_dict()["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq", "kahan_comp"}
    assert st["kahan_comp"].dtype == torch.bfloat16 and st["exp_avg"].dtype == torch.float32


def test_a_version_1_state_dict_with_generator_states_loads():
    """mixprec before counter-based bits saved per-device generator states (version 1): they load, seed kept."""
    model, opt = _build("adamw", "stochastic", torch.bfloat16, seed=42)
    for step in range(3):
        train_step(model, opt, step)
    sd = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    old = copy.deepcopy(sd["opt"])
    old["mixprec"]["version"] = 1
    old["mixprec"]["generators"] = {"cpu": torch.Generator().manual_seed(42).get_state()}
    model2, opt2 = _build("adamw", "stochastic", torch.bfloat16, seed=7)
    model2.load_state_dict(sd["model"])
    opt2.load_state_dict(old)
    assert opt2.seed == 42 and "generators" not in opt2.state_dict()["mixprec"]
    # It continues exactly like a resume from the version-2 state (same seed, same step counters).
    model3, opt3 = _build("adamw", "stochastic", torch.bfloat16, seed=0)
    model3.load_state_dict(sd["model"])
    opt3.load_state_dict(sd["opt"])
    for step in range(3, 5):
        train_step(model2, opt2, step)
        train_step(model3, opt3, step)
    assert_bit_identical(snapshot(opt2), snapshot(opt3))
    with pytest.raises(ValueError, match=re.escape("reads versions (1, 2)")):
        opt2.load_state_dict({**old, "mixprec": {**old["mixprec"], "version": 3}})


def test_loading_keeps_this_optimizers_dtypes():
    # torch.optim.Optimizer.load_state_dict would cast FP32 moments to the BF16 parameter dtype.
    model, opt = _build("adamw", "kahan", torch.float32)
    train_step(model, opt, 0)
    sd = _roundtrip(opt.state_dict())
    model2, opt2 = _build("adamw", "kahan", torch.float32)
    opt2.load_state_dict(sd)
    st = opt2.state[model2[0].weight]
    assert st["exp_avg"].dtype == torch.float32 and st["kahan_comp"].dtype == torch.bfloat16
    assert torch.equal(st["exp_avg"], sd["state"][0]["exp_avg"])
    assert st["exp_avg"].data_ptr() != sd["state"][0]["exp_avg"].data_ptr()  # copied, not aliased
    # Loading into BF16 states casts (this is allowed; the compensation mode is not).
    model3, opt3 = _build("adamw", "kahan", torch.bfloat16)
    opt3.load_state_dict(sd)
    assert opt3.state[model3[0].weight]["exp_avg"].dtype == torch.bfloat16


def test_compensation_mismatch_is_refused():
    model, opt = _build("adamw", "kahan", torch.float32)
    train_step(model, opt, 0)
    _, other = _build("adamw", "stochastic", torch.float32)
    msg = "the checkpoint was written with compensation='kahan', this optimizer uses compensation='stochastic'"
    with pytest.raises(ValueError, match=re.escape(msg)):
        other.load_state_dict(opt.state_dict())


def test_group_count_mismatch_is_refused():
    model, opt = _build("sgd", "kahan", torch.float32)
    sd = opt.state_dict()
    other = mo.SGD([{"params": [model[0].weight]}, {"params": [model[0].bias]}], lr=0.1)
    with pytest.raises(ValueError, match="parameter group"):
        other.load_state_dict(sd)


def test_a_torch_checkpoint_loads_and_continues_like_torch():
    ref_model, model = mlp(), mlp()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True)
    for step in range(3):
        train_step(ref_model, ref, step)
    model.load_state_dict(ref_model.state_dict())
    ours = mo.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True)
    ours.load_state_dict(_roundtrip(ref.state_dict()))
    assert ours.state[model[0].weight]["step"].device == model[0].weight.device
    for step in range(3, 6):
        train_step(ref_model, ref, step)
        train_step(model, ours, step)
    for a, b in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    # And our checkpoint loads into torch (FP32 states, extra "mixprec" entry ignored).
    ref.load_state_dict(ours.state_dict())


def test_deepcopy_and_pickle_keep_the_configuration():
    model, opt = _build("adamw", "stochastic", torch.bfloat16)
    train_step(model, opt, 0)
    clone = copy.deepcopy(opt)
    assert clone.compensation == "stochastic" and clone.state_dtype == torch.bfloat16
    assert "compensation=stochastic" in repr(clone)
    # The copy continues with the same random stream as the original.
    a_params = [p for g in clone.param_groups for p in g["params"]]
    for p, q in zip(a_params, model.parameters()):
        p.grad = q.grad.clone()
    opt.step()
    clone.step()
    assert all(torch.equal(p, q) for p, q in zip(a_params, model.parameters()))


@pytest.mark.parametrize("comp", COMPENSATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_load_full_precision_params_seeds_the_compensation(comp, dtype):
    w32 = [torch.randn(64, 32) * 0.05, torch.randn(32) + 1.0]
    params = [torch.nn.Parameter(torch.zeros_like(w, dtype=dtype)) for w in w32]
    opt = mo.AdamW(params, lr=1e-3, compensation=comp)
    opt.load_full_precision_params_(dict(zip(params, w32)))
    for p, w in zip(params, w32):
        assert torch.equal(p, w.to(dtype))  # the parameter is the nearest half-precision value
        err_param = (p.float() - w).abs().max().item()
        full = opt.full_precision_params()[p]
        err_full = (full - w).abs().max().item()
        if comp == "kahan":
            comp_buf = opt.state[p]["kahan_comp"]
            assert comp_buf.dtype == dtype
            assert torch.equal(comp_buf, (w - p.float()).to(dtype))
            # 8 (or 11) more bits kept: the pair is 2**-8 (FP16: 2**-11) times closer than the param alone.
            assert err_full <= err_param * (2**-7 if dtype == torch.bfloat16 else 2**-10)
        else:
            assert "kahan_comp" not in opt.state[p]
            assert err_full == err_param
        assert opt.state[p]["step"].item() == 0.0  # nothing else changes


def test_load_full_precision_params_errors():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    opt = mo.SGD([p], lr=0.1)
    with pytest.raises(ValueError, match=re.escape("is not a parameter of this optimizer")):
        opt.load_full_precision_params_({torch.zeros(3): torch.ones(3)})
    with pytest.raises(ValueError, match=re.escape("value of shape (4,) for a parameter of shape (3,)")):
        opt.load_full_precision_params_({p: torch.ones(4)})


def test_seeded_compensation_changes_training():
    # After seeding, the first small updates act on the exact FP32 weight, not on its rounding.
    w = torch.full((256,), 1.0 + 2**-9)  # exactly half way between two BF16 values... lost by the cast
    seeded = torch.nn.Parameter(w.to(torch.bfloat16))
    plain = torch.nn.Parameter(w.to(torch.bfloat16))
    a = mo.SGD([seeded], lr=1.0)
    b = mo.SGD([plain], lr=1.0)
    a.load_full_precision_params_({seeded: w})
    for opt, p in ((a, seeded), (b, plain)):
        p.grad = torch.full_like(p, -2**-10)  # moves the weight by +2**-10
        opt.step()
    assert (a.full_precision_params()[seeded] == 1.0 + 2**-9 + 2**-10).all()
    assert (b.full_precision_params()[plain] == 1.0 + 2**-10).all()


@pytest.mark.parametrize("order", ["model-then-optimizer", "optimizer-then-model"])
def test_a_plain_torch_checkpoint_loads_into_bf16_pure_with_its_fp32_digits_in_either_order(order: str) -> None:
    # Loading the torch optimizer state after load_model_state_dict reset the compensation it had seeded.
    import copy

    import torch.nn.functional as F

    import mixprec as mp
    from mixprec.checkpoint import fp32_state_dict

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    model, opt = build()
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        F.cross_entropy(model(torch.randn(8, 16, generator=g)), torch.randint(0, 4, (8,), generator=g)).backward()
        opt.step()
        opt.zero_grad()
    ck = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict())}
    model2, opt2 = build()
    prec = mp.MixedPrecision("bf16-pure")
    model2, opt2 = prec.prepare(model2, opt2)
    if order == "model-then-optimizer":
        prec.load_model_state_dict(ck["model"])
        opt2.load_state_dict(ck["optimizer"])
    else:
        opt2.load_state_dict(ck["optimizer"])
        prec.load_model_state_dict(ck["model"])
    full = fp32_state_dict(prec, compensation=True)
    for k, v in ck["model"].items():
        err = (full[k] - v).abs().max().item()
        assert err <= 2**-16 * v.abs().max().item(), (k, err)  # ~17 bits kept; BF16 rounding alone is 2**-9
    torch.testing.assert_close(opt2.state[model2[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"],
                               rtol=0, atol=0, check_dtype=False)


def test_parameters_absent_from_a_torch_checkpoint_keep_their_compensation_and_step() -> None:
    import copy

    import mixprec as mp
    from mixprec.checkpoint import fp32_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model[0].parameters(), lr=1e-2)  # the torch run trained layer 0 only
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    ck = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict())}
    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    prec = mp.MixedPrecision("bf16-pure")
    model2, opt2 = prec.prepare(model2, torch.optim.AdamW(model2[0].parameters(), lr=1e-2))
    opt2.add_param_group({"params": list(model2[1].parameters())})
    ck["optimizer"]["param_groups"].append({**ck["optimizer"]["param_groups"][0], "params": [2, 3]})
    prec.load_model_state_dict(ck["model"])
    opt2.load_state_dict(ck["optimizer"])  # no state for layer 1's parameters in the checkpoint
    full = fp32_state_dict(prec, compensation=True)
    for k, v in ck["model"].items():
        assert (full[k] - v).abs().max().item() <= 2**-16 * v.abs().max().item(), k
    with prec.autocast():
        loss = model2(torch.randn(4, 8)).float().sum()
    prec.backward(loss)
    prec.step(opt2)
    assert opt2.state[model2[1].weight]["exp_avg"].abs().sum() > 0  # its moments started at zero and stepped
