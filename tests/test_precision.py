import copy
import io
import re
import warnings

import pytest
import torch
from _trees import equal_tree  # tests/_trees.py
from torch import nn

from mixprec._master import MasterWeightOptimizer
from mixprec._policy import Policy
from mixprec._precision import MixedPrecision
from mixprec.checkpoint import convert_state_dict, for_inference, fp32_state_dict

ALL = ["fp32", "tf32", "fp16-mixed", "bf16-mixed", "fp16-master", "bf16-master", "bf16-master-r16", "fp16-pure", "bf16-pure"]
# Loss-gap tolerance against FP32 after training, per compute dtype (relative).
TOL = {torch.float32: 1e-5, torch.bfloat16: 0.05, torch.float16: 0.02}


class TinyTransformer(nn.Module):
    def __init__(self, vocab=16, d=32, seq=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.block = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(self.norm(self.block(self.emb(ids) + self.pos)))


def mlp():
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def make(kind, seed=0):
    torch.manual_seed(seed)
    return mlp() if kind == "mlp" else TinyTransformer()


def batch(kind, step, n=16):
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "mlp":
        x = torch.randn(n, 8, generator=g)
        return x, (x[:, :4].argmax(1))
    ids = torch.randint(0, 16, (n, 8), generator=g)
    return ids, ids.roll(1, dims=1)  # learnable: predict the previous token


def loss_fn(model, b):
    x, y = b
    out = model(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def train(preset, kind="mlp", steps=20, lr=1e-2, seed=0, opt_cls=torch.optim.AdamW, start=0, state=None):
    model = make(kind, seed)
    prec = MixedPrecision(preset)
    kwargs = {}
    if preset == "fp16-pure" and opt_cls is torch.optim.AdamW:
        # fp16-pure keeps AdamW states in fp16, where the default eps=1e-8 rounds to 0 (prepare() warns).
        kwargs["eps"] = 1e-4
    model, opt = prec.prepare(model, opt_cls(model.parameters(), lr=lr, **kwargs))
    if state is not None:
        prec.load_state_dict(state)
    losses = []
    for s in range(start, start + steps):
        with prec.autocast():
            loss = loss_fn(model, batch(kind, s))
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return prec, model, opt, losses


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
@pytest.mark.parametrize("preset", ["fp16-master", "bf16-mixed", "bf16-master", "fp16-mixed"])
def test_tracks_fp32_reference(preset, kind):
    steps = 200
    _, ref_model, _, ref = train("fp32", kind, steps)
    prec, model, _, got = train(preset, kind, steps)
    tol = TOL[prec.policy.compute_dtype]
    # Both learn, and the smoothed final losses agree within the dtype's tolerance.
    tail = max(5, steps // 10)
    ref_tail, got_tail = sum(ref[-tail:]) / tail, sum(got[-tail:]) / tail
    assert ref_tail < 0.6 * ref[0]
    assert abs(got_tail - ref_tail) <= tol * max(1.0, ref_tail) + 0.02, (ref_tail, got_tail)
    # Held-out loss (a batch never trained on) agrees too.
    with torch.no_grad(), prec.autocast():
        held = loss_fn(model, batch(kind, 10_000)).item()
    with torch.no_grad():
        ref_held = loss_fn(ref_model, batch(kind, 10_000)).item()
    assert abs(held - ref_held) <= tol * max(1.0, ref_held) + 0.02, (ref_held, held)
    # The FP32 weights (masters where present) stay close to the reference's. The MLP is
    # compared per parameter; the transformer is driven to ~0 loss, where the trajectory drifts
    # along flat directions (measured 0.12-0.13 global relative difference for every half
    # preset, fp16 included), so it is compared globally with a bound that still catches a
    # broken update (an untrained or diverged model is at >= 0.5).
    fp32 = fp32_state_dict(prec)
    if kind == "mlp":
        for name, p in ref_model.named_parameters():
            rel = (fp32[name] - p.detach()).norm() / p.detach().norm()
            assert rel < {torch.float16: 0.01, torch.bfloat16: 0.05}[prec.policy.compute_dtype], (name, rel)
    else:
        ref_vec = torch.cat([p.detach().flatten() for _, p in ref_model.named_parameters()])
        got_vec = torch.cat([fp32[n].flatten() for n, _ in ref_model.named_parameters()])
        assert (got_vec - ref_vec).norm() / ref_vec.norm() < 0.25


def test_fp16_pure_warns_when_adam_eps_vanishes_in_fp16():
    model = make("mlp")
    with pytest.warns(UserWarning, match=re.escape("has eps=1e-08, below the smallest normal f16 number 6.1e-05")):
        MixedPrecision("fp16-pure").prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    model = make("mlp")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*below the smallest normal.*")
        MixedPrecision("fp16-pure").prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4))


@pytest.mark.parametrize("fused", [True, False])
def test_fp32_preset_equals_plain_torch(fused):
    """A foreach AdamW steps through torch's own fused kernel (the skip stays on the device, _stepping.FusedTwin):
    bit for bit torch's fused AdamW, and torch's foreach AdamW to FP32 rounding."""
    _, model, _, got = train("fp32", steps=10)
    torch.manual_seed(0)
    ref = make("mlp")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=fused)
    for s in range(10):
        opt.zero_grad()
        loss_fn(ref, batch("mlp", s)).backward()
        opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        if fused:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _snapshot(prec, opt):
    return copy.deepcopy(prec.state_dict())



@pytest.mark.parametrize("preset", ALL)
def test_injected_inf_is_skipped_bit_identically(preset):
    prec, model, opt, _ = train(preset, steps=3)
    before = _snapshot(prec, opt)
    with prec.autocast():
        loss = loss_fn(model, batch("mlp", 99))
    prec.backward(loss)
    first = next(iter(model.parameters()))
    grad_holder = opt.masters[0] if isinstance(opt, MasterWeightOptimizer) else first
    grad_holder.grad[0].fill_(float("inf") if "fp16" in preset else float("nan"))
    info = prec.step(opt)
    opt.zero_grad()
    assert info.skipped.item() and info.found_inf.item() == 1.0 and not info.applied()
    after = prec.state_dict()
    # bf16-pure: stochastic rounding's bits are a function of (seed, step, position), so a skipped
    # step leaves its optimizer state (seed included) bit-identical too.
    for key in ("model", "optimizers"):
        assert equal_tree(before[key], after[key]), key
    assert after["applied_steps"].item() == before["applied_steps"].item() == 3
    if prec.policy.loss_scale == "dynamic":
        assert prec.scaler.loss_scale.item() == info.scale.item() / 2  # backed off
    else:
        assert prec.scaler.loss_scale.item() == info.scale.item()


@pytest.mark.parametrize("preset", ["fp32", "bf16-mixed", "fp16-master", "bf16-master"])
def test_grad_accumulation_equals_big_batch_and_unscales_once(preset):
    def run(micro):
        torch.manual_seed(0)
        model = make("mlp")
        prec = MixedPrecision(preset)
        model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        calls = []
        orig = prec.scaler.unscale_grads_  # what prec.unscale_ calls with the gradients it collected
        prec.scaler.unscale_grads_ = lambda grads: calls.append(1) or orig(grads)  # type: ignore[method-assign]
        x, y = batch("mlp", 0, n=32)
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            with prec.autocast():
                loss = loss_fn(model, (xs, ys)) / micro
            prec.backward(loss)
        prec.step(opt)
        return fp32_state_dict(prec), len(calls)

    big, n_big = run(1)
    small, n_small = run(4)
    assert n_big == n_small == 1
    tol = 1e-6 if preset == "fp32" else 2e-3
    for k in big:
        torch.testing.assert_close(small[k], big[k], rtol=tol, atol=tol)


@pytest.mark.parametrize("preset", ALL)
def test_resume_is_bit_identical(preset):
    _, _, _, full = train(preset, steps=8)
    prec, _, _, first = train(preset, steps=5)
    buf = io.BytesIO()
    torch.save(prec.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, map_location="cpu", weights_only=True)
    prec2, model2, _, second = train(preset, steps=3, start=5, seed=123, state=state)  # other init: all comes from state
    assert first + second == full
    ref_prec, ref_model, _, _ = train(preset, steps=8)
    assert equal_tree(prec2.state_dict()["model"], ref_prec.state_dict()["model"])
    assert equal_tree(prec2.state_dict()["optimizers"], ref_prec.state_dict()["optimizers"])


def test_scheduler_and_ema_only_advance_on_applied_steps():
    torch.manual_seed(0)
    model = make("mlp")
    prec = MixedPrecision("bf16-mixed")
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ema = [p.detach().clone() for p in model.parameters()]
    for s, poison in enumerate([False, True, False]):
        with prec.autocast():
            loss = loss_fn(model, batch("mlp", s))
        prec.backward(loss * (float("nan") if poison else 1.0))
        info = prec.step(opt, schedulers=[sched])
        torch._foreach_lerp_(ema, [p.detach() for p in model.parameters()], 0.1 * info.mask())
        opt.zero_grad()
        if poison:
            ema_at_skip = [e.clone() for e in ema]
    assert sched.last_epoch == 2  # three steps, one skipped
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    assert info.applied_steps.item() == 2
    assert all(torch.isfinite(e).all() for e in ema)
    assert any(not torch.equal(a, b) for a, b in zip(ema_at_skip, ema))


def test_step_info_fields_are_device_tensors():
    prec, model, opt, _ = train("fp16-mixed", steps=1)
    with prec.autocast():
        loss = loss_fn(model, batch("mlp", 1))
    prec.backward(loss)
    info = prec.step(opt)
    assert info.found_inf.dtype == torch.float32 and info.found_inf.dim() == 0
    assert info.skipped.dtype == torch.bool and info.scale.item() == 2.0 ** 16
    assert info.applied_steps.dtype == torch.int64 and info.applied_steps.item() == 2


def test_clip_grad_norm_on_unscaled_gradients():
    torch.manual_seed(0)
    res = {}
    for preset in ("fp32", "fp16-master"):
        model = make("mlp")
        torch.manual_seed(0)
        model = make("mlp")
        prec = MixedPrecision(preset)
        model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with prec.autocast():
            loss = loss_fn(model, batch("mlp", 0))
        prec.backward(loss)
        res[preset] = prec.clip_grad_norm_(0.1)
        prec.step(opt)
    # the fp16-master norm is of unscaled gradients (not 65536x larger)
    torch.testing.assert_close(res["fp16-master"], res["fp32"], rtol=2e-2, atol=1e-4)


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _clip_step(preset, max_norm, plant=None, two_optimizers=False):
    """One step with prec.clip_grad_norm_; returns the norm, the gradients the step saw, the step info, params before/after."""
    torch.manual_seed(0)
    model = make("mlp")
    prec = MixedPrecision(preset)
    if two_optimizers:
        opts = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[3].parameters(), lr=0.1)]
    else:
        opts = [torch.optim.SGD(model.parameters(), lr=0.1)]
    model, *opts = prec.prepare(model, *opts)
    with prec.autocast():
        loss = loss_fn(model, batch("mlp", 0))
    prec.backward(loss)
    holders = [t for o in opts for g in o.param_groups for t in g["params"]]
    if plant is not None:
        holders[0].grad.view(-1)[3] = plant
    raw = [t.grad.clone() for t in holders]
    before = [t.detach().clone() for t in holders]
    with _OpCounter() as counter:
        norm = prec.clip_grad_norm_(max_norm)
        clipped = [t.grad.clone() for t in holders]
        infos = [prec.step(o) for o in opts]
    after = [t.detach().clone() for t in holders]
    return norm, raw, clipped, infos, before, after, counter.ops


@pytest.mark.parametrize("preset", ["fp32", "bf16-mixed", "bf16-master"])
@pytest.mark.parametrize("max_norm", [1e-3, 1e3])  # clipping and not
@pytest.mark.parametrize("two_optimizers", [False, True])
def test_clip_checks_in_its_multiply_bit_for_bit_torchs_clip(preset, max_norm, two_optimizers):
    norm, raw, clipped, infos, before, after, ops = _clip_step(preset, max_norm, two_optimizers=two_optimizers)
    ref = [g.clone() for g in raw]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in ref]
    for p, g in zip(params, ref):
        p.grad = g
    ref_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    assert torch.equal(norm, ref_norm)
    for got, p in zip(clipped, params):
        assert torch.equal(got, p.grad)
    assert (clipped[0] != raw[0]).any() == (max_norm < 1)
    assert all(not bool(i.skipped) for i in infos) and any(not torch.equal(a, b) for a, b in zip(before, after))
    # the check rode on the clip's multiply: one fused kernel per optimizer, no separate pass, no _foreach_mul_
    assert ops.get("_amp_foreach_non_finite_check_and_unscale_", 0) == len(infos)
    assert ops.get("_foreach_mul_", 0) == 0 and ops.get("_local_scalar_dense", 0) == 0


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("max_norm", [1e-3, 1e3])
def test_clip_check_flags_inf_and_nan_and_the_step_is_skipped(preset, bad, max_norm):
    norm, raw, clipped, infos, before, after, _ = _clip_step(preset, max_norm, plant=bad)
    assert not torch.isfinite(norm)
    assert all(bool(i.skipped) for i in infos) and float(infos[0].found_inf) == 1.0
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def test_clip_under_a_loss_scale_unscales_first():
    norm, raw, clipped, infos, before, after, ops = _clip_step("fp16-mixed", 1e3)
    # fp16-mixed: gradients are scaled until unscale_; the norm is the unscaled one (as torch.amp's recipe)
    assert ops.get("_foreach_mul_", 0) + ops.get("_amp_foreach_non_finite_check_and_unscale_", 0) >= 1
    ref = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g / 2.0**16) for g in raw]))
    torch.testing.assert_close(norm, ref, rtol=1e-6, atol=0)


def test_fp32_checkpoint_loads_into_master_run_and_exports_back():
    donor = make("mlp", seed=5)  # other weights than the run's
    fp32 = {k: v.clone() for k, v in donor.state_dict().items()}
    model = make("mlp")
    prec = MixedPrecision("bf16-master")
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    prec.load_model_state_dict(fp32)
    out = fp32_state_dict(prec)
    for k, v in fp32.items():
        assert torch.equal(out[k], v), k  # exact: masters were not rounded through bf16
    assert model[0].weight.dtype == torch.bfloat16
    assert torch.equal(model[0].weight, fp32["0.weight"].to(torch.bfloat16))


def test_fp32_checkpoint_loads_into_a_compensated_run_with_its_low_bits():
    """bf16-pure: load_model_state_dict seeds each weight's Kahan compensation with what its cast drops, as prepare
    does (it kept the compensation of the weights from before the load: up to 1.4e-3 off the checkpoint)."""
    donor = make("mlp", seed=5)
    fp32 = {k: v.clone() for k, v in donor.state_dict().items()}
    model = make("mlp")
    prec = MixedPrecision("bf16-pure")
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    prec.load_model_state_dict(fp32)
    halves = 0
    for name, p in model.named_parameters():
        if p.dtype == torch.bfloat16:  # (norm layers stay FP32, without compensation)
            halves += 1
            weight = p.float() + opt.state[p]["kahan_comp"].float()  # what the next step continues from
            torch.testing.assert_close(weight, fp32[name], rtol=2**-16, atol=1e-9)
    assert halves >= 2


def test_other_policy_checkpoint_raises_or_converts():
    prec, _, _, _ = train("fp16-master", steps=3)
    sd = copy.deepcopy(prec.state_dict())
    model = make("mlp")
    other = MixedPrecision("bf16-master")
    model, opt = other.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    msg = ("the checkpoint was saved under policy 'p=f16,c=f16,o=f32,m=f32,ls=dynamic,i=norm,tf32=0,comp=none' but this run "
           "uses 'p=bf16,c=bf16,o=f32,m=f32,ls=none,i=norm,tf32=0,comp=none'; convert it explicitly with "
           "mixprec.checkpoint.convert_state_dict(state, 'bf16-master')")
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=re.escape(msg)):
        other.load_state_dict(sd)
    assert equal_tree(before, other.state_dict())  # nothing changed
    other.load_state_dict(convert_state_dict(sd, "bf16-master"))
    exported = fp32_state_dict(other)
    for k, v in fp32_state_dict(sd).items():
        assert torch.equal(exported[k], v)
    # and to a mixed policy, where the FP32 params are the masters
    model3 = make("mlp")
    mixed = MixedPrecision("fp16-mixed")
    model3, opt3 = mixed.prepare(model3, torch.optim.AdamW(model3.parameters(), lr=1e-2))
    mixed.load_state_dict(convert_state_dict(sd, "fp16-mixed"))
    for k, v in fp32_state_dict(sd).items():
        assert torch.equal(model3.state_dict()[k], v)
    assert mixed.scaler.loss_scale.item() == prec.scaler.loss_scale.item()  # both scale dynamically: kept


def test_convert_refuses_compensated_policies():
    prec, _, _, _ = train("fp16-master", steps=1)
    with pytest.raises(ValueError, match=re.escape("cannot convert: the target policy 'bf16-pure' uses compensated updates")):
        convert_state_dict(prec.state_dict(), "bf16-pure")


def test_for_inference_halves_weights_keeps_islands():
    torch.manual_seed(0)
    model = make("transformer").eval()
    x = batch("transformer", 0)[0]
    with torch.no_grad():
        ref = model(x)
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    for_inference(model, "bf16")
    after = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model.norm.weight.dtype == torch.float32 and model.head.weight.dtype == torch.bfloat16
    assert after < 0.52 * before
    with torch.no_grad():
        out = model(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0.1, atol=0.1)
    with pytest.raises(ValueError, match=re.escape("for_inference casts to 'bf16' or 'fp16', got 'f32'")):
        for_inference(model, "f32")


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp16-master", "bf16-master", "bf16-pure"])
def test_for_inference_of_a_live_run_casts_its_weights_and_closes_it(preset):
    """for_inference on the model of a run still training: the weights it holds are cast; the run is closed, and
    training on raises instead of training the cast model (bf16-master and bf16-pure used to train on silently,
    *-mixed failed with a dtype error)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on a CPU
        prec, model, opt, _ = train(preset, steps=3)
    best = {id(p): p.detach().clone() for p in model.parameters()}  # what the model holds is what gets cast
    for_inference(model, "bf16")
    islands = 0
    for p in model.parameters():
        if p.dtype == torch.float32:  # an FP32 island (LayerNorm): its best value as it is
            islands += 1
            assert torch.equal(p, best[id(p)].float())
        else:
            assert torch.equal(p, best[id(p)].to(torch.bfloat16))
    assert islands > 0
    for call in (lambda: prec.backward(model(batch("mlp", 0)[0]).float().sum()), lambda: prec.step(opt), opt.step,
                 prec.state_dict):
        with pytest.raises(ValueError, match=re.escape("this run's model was cast for inference by for_inference()")):
            call()


def test_for_inference_islands_a_string_is_one_entry_and_a_misspelt_one_raises():
    """fp32_islands="norm" is the entry 'norm' (not the islands 'n', 'o', 'r', 'm'); an entry that matches no module
    raises before anything is cast."""
    torch.manual_seed(0)
    model = make("transformer")
    for_inference(model, "bf16", fp32_islands="norm")
    assert model.norm.weight.dtype == torch.float32 and model.head.weight.dtype == torch.bfloat16
    fresh = make("transformer")
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape("FP32 island 'LayerNrom' of policy") + ".*matches no module"):
        for_inference(fresh, "bf16", fp32_islands=("LayerNrom",))
    assert equal_tree(fresh.state_dict(), before)


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master", "bf16-pure"])
def test_a_copy_between_backward_and_step_takes_the_pending_step(preset):
    """deepcopy/pickle of a run with gradients pending: torch copies a Parameter without its .grad, so the twin's step
    applied nothing (or only the masters' part); the gradients now travel with the run."""
    import pickle

    prec, model, opt, _ = train(preset, steps=2)
    with prec.autocast():
        loss = loss_fn(model, batch("mlp", 5))
    prec.backward(loss)  # pending
    twins = [copy.deepcopy((prec, model, opt)), pickle.loads(pickle.dumps((prec, model, opt)))]
    prec.step(opt)
    for p2, m2, o2 in twins:
        p2.step(o2)
        for a, b in zip(model.parameters(), m2.parameters()):
            assert torch.equal(a, b)


# ----- misuse: each raises a clear error and leaves state intact ------------------------------------------
def test_prepare_twice():
    prec, model, opt, _ = train("bf16-mixed", steps=1)
    with pytest.raises(ValueError, match=re.escape("prepare() was already called on this MixedPrecision object")):
        prec.prepare(model, opt)
    with pytest.raises(ValueError, match=re.escape("this model was already prepared by another MixedPrecision")):
        MixedPrecision("bf16-mixed").prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_optimizer_of_another_model():
    model = make("mlp")
    other = make("mlp")
    with pytest.raises(ValueError, match=re.escape("optimizer 0 holds 6 tensor(s) that are not parameters of this model")):
        MixedPrecision("fp16-master").prepare(model, torch.optim.SGD(other.parameters(), lr=0.1))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # untouched


def test_half_model_under_mixed_policy():
    model = make("mlp").to(torch.bfloat16)
    with pytest.raises(ValueError, match=re.escape("the model has bf16 parameters but policy 'bf16-mixed' keeps parameters in FP32")):
        MixedPrecision("bf16-mixed").prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_step_without_backward_and_before_prepare():
    prec = MixedPrecision("fp16-mixed")
    with pytest.raises(ValueError, match=re.escape("step() before prepare()")):
        prec.step(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))
    model = make("mlp")
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=re.escape("unscale_()/clip_grad_norm_()/step() without backward() in this step")):
        prec.step(opt)


def test_step_with_the_unwrapped_optimizer():
    model = make("mlp")
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    prec = MixedPrecision("fp16-master")
    model, opt = prec.prepare(model, raw)
    with pytest.raises(ValueError, match=re.escape("use the one prepare() returned (it holds the masters)")):
        prec.step(raw)


def test_backward_after_clip_and_bad_losses():
    prec, model, opt, _ = train("fp16-mixed", steps=1)
    with prec.autocast():
        loss = loss_fn(model, batch("mlp", 1))
    prec.backward(loss, retain_graph=True)
    prec.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match=re.escape("backward() after the gradients were unscaled")):
        prec.backward(loss)
    with pytest.raises(ValueError, match=re.escape("backward(loss) needs a scalar floating loss, got shape (2,)")):
        prec.backward(torch.ones(2, requires_grad=True))
    with pytest.raises(ValueError, match=re.escape("the loss does not require grad")):
        prec.backward(torch.tensor(1.0))


def test_prepare_without_optimizer_and_bad_policy():
    with pytest.raises(ValueError, match=re.escape("prepare(model) needs the optimizer(s) too")):
        MixedPrecision("fp32").prepare(make("mlp"))
    with pytest.raises(ValueError, match=re.escape("unknown precision preset 'fp16-mixd'")):
        MixedPrecision("fp16-mixd")


def test_load_foreign_state_dict():
    prec, model, opt, _ = train("bf16-mixed", steps=1)
    with pytest.raises(ValueError, match=re.escape("It looks like a plain optimizer state dict")):
        prec.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match=re.escape("It looks like a model state dict; load it with prec.load_model_state_dict(sd)")):
        prec.load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match=re.escape("not a mixprec state dict: missing")):
        prec.load_state_dict({})


def test_policy_object_and_repr():
    prec = MixedPrecision(Policy.parse("p=f32,c=bf16,i=none"))
    assert prec.policy.fp32_islands == ()
    assert "not prepared" in repr(prec)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("preset", ["tf32", "fp32"])
def test_backward_runs_with_the_policys_tf32_switch(preset, device):
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(torch.backends.cuda.matmul.allow_tf32)
            return g

    model = make("mlp").to(device)
    prec = MixedPrecision(preset)
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = preset == "fp32"  # the opposite of the policy
    with prec.autocast():
        loss = Probe.apply(model(batch("mlp", 0)[0].to(device))).float().pow(2).mean()
    prec.backward(loss)
    # The switches act on cuBLAS/cuDNN only: a CUDA backward runs under the policy's setting, a CPU
    # one leaves them alone (no per-step cost).
    assert seen == [preset == ("tf32" if device == "cuda" else "fp32")]
    assert torch.backends.cuda.matmul.allow_tf32 == (preset == "fp32")  # restored / untouched
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("preset", ["bf16-master", "bf16-pure"])
def test_fused_reaches_the_optimizers_prepare_builds_and_trains_like_eager(preset, monkeypatch):
    import mixprec.optim._fused_step as fused_step

    monkeypatch.setattr(fused_step, "_FUSED_CACHE", {})  # compiled tiles are shared per process: compile here

    def run(fused):
        torch.manual_seed(0)
        model = make("mlp")
        prec = MixedPrecision(preset, fused=fused)
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        assert opt.fused is fused
        for i in range(3):
            with prec.autocast():
                loss = loss_fn(model, batch("mlp", i))
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad()
        return fp32_state_dict(prec), opt

    eager, _ = run(False)
    fused, opt = run(True)
    assert opt.compile_seconds > 0  # the compiled step ran (and says what it cost)
    for k in eager:  # Kahan: bit for bit; masters: torch's AdamW to FP32 rounding
        torch.testing.assert_close(fused[k], eager[k], rtol=1e-6, atol=1e-6)


def test_fused_true_with_an_optimizer_it_cannot_fuse_raises_before_anything_changes():
    model = make("mlp")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prec = MixedPrecision("bf16-master", fused=True)
    with pytest.raises(ValueError, match=r"fused=True.*RMSprop.*fused=None or False"):
        prec.prepare(model, torch.optim.RMSprop(model.parameters()))
    assert prec.model is None
    assert all(torch.equal(v, before[k]) and v.dtype == before[k].dtype for k, v in model.state_dict().items())
    with pytest.raises(TypeError, match="fused must be True, False or None"):
        MixedPrecision("bf16-master", fused="yes")


@pytest.mark.parametrize("read_every", [1, 4, 0])
def test_step_history_recorded_by_snapshot_equals_the_eager_record(read_every):
    """prec.step records its steps in the scaler's history by reference (no ring write per step).

    A run of prec.step with overflows at chosen steps, a 5-step history and a 3-step check
    interval (so the ring wraps and folds often), against a DynamicScaler fed the same flags
    through its public update() (the eager per-step ring write): statistics and state dicts
    equal, whether they are read every step, every 4th step or only at the end.
    """
    from mixprec._scaler import DynamicScaler

    def scaler():
        return DynamicScaler(init_scale=2.0**8, growth_interval=2, history=5, check_interval=3, min_scale=4.0,
                             on_failure="ignore")

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    prec = MixedPrecision("fp16-mixed", scaler=scaler())
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    eager = scaler()
    overflow_at = {2, 3, 4, 5, 6, 7, 11, 12}  # a streak down to the floor (256 -> 4), then recovery
    for i in range(17):
        loss = model(torch.ones(2, 3)).sum()
        prec.backward(loss * float("inf") if i in overflow_at else loss)
        info = prec.step(opt)
        opt.zero_grad()
        eager.update(torch.tensor(float(i in overflow_at)))
        assert info.skipped.item() == (i in overflow_at)
        if read_every and i % read_every == 0:
            assert prec.scaler.statistics() == eager.statistics(), i
    got, want = prec.scaler.statistics(), eager.statistics()
    assert got == want
    assert want["scale_history"] == [4.0, 4.0, 8.0, 8.0, 16.0] and want["overflow_history"][0] is True
    assert prec.scaler.state_dict() == eager.state_dict()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("preset", ["fp16-mixed", "bf16-master", "bf16-pure"])
def test_a_copied_run_trains_on_exactly_like_the_original(preset, how):
    """copy.deepcopy / pickle of a prepared MixedPrecision (model, optimizer and all) is a working twin.

    torch's Optimizer pickles three keys, which lost a MasterWeightOptimizer's masters; the copy's
    records were keyed by the original optimizer's id. The twin trains three more steps bit for bit
    like the original, its optimizer.step() routes through the twin (not the original), and the
    original is untouched by it.
    """
    import pickle

    def three_more_steps(run: MixedPrecision, step) -> None:
        for s in range(2, 5):
            with run.autocast():
                loss = loss_fn(run.model, batch("mlp", s))
            run.backward(loss)
            step()
            run.optimizers[0].zero_grad(set_to_none=True)

    prec, model, opt, _ = train(preset, steps=2)
    twin = copy.deepcopy(prec) if how == "deepcopy" else pickle.loads(pickle.dumps(prec))
    assert twin.model is not prec.model and twin.optimizers[0] is not opt
    before = fp32_state_dict(prec)
    t_opt = twin.optimizers[0]
    three_more_steps(twin, t_opt.step)  # the guarded step: must reach twin.step
    assert twin.last_step is not None and int(twin.last_step.applied_steps) == 5
    assert equal_tree(fp32_state_dict(prec), before)  # the original did not move
    three_more_steps(prec, lambda: prec.step(opt))
    assert equal_tree(fp32_state_dict(twin), fp32_state_dict(prec))
    if preset == "bf16-master":
        with pytest.raises(RuntimeError, match="called on the optimizer passed to prepare"):
            t_opt.optimizer.step()  # the wrapped optimizer of the twin still refuses a direct step


def test_a_deep_copied_master_optimizer_steps_its_own_masters():
    params = [nn.Parameter(torch.randn(4, 3).to(torch.bfloat16)), nn.Parameter(torch.randn(3))]
    opt = MasterWeightOptimizer(torch.optim.SGD(params, lr=0.5))
    twin = copy.deepcopy(opt)
    assert twin.masters[0] is not opt.masters[0] and torch.equal(twin.masters[0], opt.masters[0])
    start = opt.masters[0].clone()
    p = twin.model_params[0]
    (p.float().sum() + twin.model_params[1].sum()).backward()
    assert isinstance(p.grad, torch.Tensor) and twin.masters[0].grad is not None  # the hook moved it into the master
    twin.step()
    assert torch.equal(opt.masters[0], start)  # the original's masters did not move
    torch.testing.assert_close(twin.masters[0], start - 0.5)
    assert torch.equal(p.detach(), twin.masters[0].to(torch.bfloat16))  # copied back into the twin's weights


def test_a_noop_scaler_under_an_fp16_policy_that_scales_warns():
    """scaler=NoOpScaler() under fp16-mixed (ls=dynamic): FP16 gradients run unscaled; said once, at construction."""
    from mixprec._scaler import NoOpScaler

    with pytest.warns(UserWarning, match=re.escape("scaler=NoOpScaler() under policy 'fp16-mixed', which scales the loss")):
        MixedPrecision("fp16-mixed", scaler=NoOpScaler())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MixedPrecision("p=f32,c=f16,ls=none", scaler=NoOpScaler())  # said in the policy
        MixedPrecision("bf16-mixed", scaler=NoOpScaler())


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master", "bf16-pure"])
def test_schedulers_stepped_by_prec_step_raise_no_order_warning(preset):
    """prec.step(opt, schedulers=[sched]): torch's "lr_scheduler.step() before optimizer.step()" warning is false
    there (the step reached the optimizer below the scheduler's wrapper); it is not raised."""
    torch.manual_seed(0)
    model = make("mlp")
    prec = MixedPrecision(preset)
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for s in range(2):
            with prec.autocast():
                loss = loss_fn(model, batch("mlp", s))
            prec.backward(loss)
            prec.step(opt, schedulers=[sched])
            opt.zero_grad()
    assert sched.last_epoch == 2


def test_stepping_the_optimizer_bf16_pure_converted_says_it_was_converted():
    torch.manual_seed(0)
    model = make("mlp")
    raw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prec = MixedPrecision("bf16-pure")
    model, opt = prec.prepare(model, raw)
    with prec.autocast():
        loss = loss_fn(model, batch("mlp", 0))
    prec.backward(loss)
    with pytest.raises(RuntimeError, match=re.escape("which prepare() converted into mixprec.optim.AdamW (compensated")):
        raw.step()
    prec.step(opt)  # the returned one steps



@pytest.mark.parametrize("weight_edits", ["values", "versions"])
def test_for_inference_keeps_edits_made_since_the_last_step(weight_edits):
    """Pruning through .data, then for_inference: the pruned weights stay 0 (the masters are taken after the
    value-based edit check, whatever weight_edits says)."""
    torch.manual_seed(0)
    model = make("mlp")
    prec = MixedPrecision("bf16-master", weight_edits=weight_edits)
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    with prec.autocast():
        loss = loss_fn(model, batch("mlp", 0))
    prec.backward(loss)
    prec.step(opt)
    w = next(p for p in model.parameters() if p.dim() == 2)
    with torch.no_grad():
        w.data[:, ::2] = 0
    for_inference(model, "fp16")
    assert (w[:, ::2] == 0).all()


def test_for_inference_of_a_submodule_or_a_wrapper_closes_the_run():
    """Casting a module inside the run's model (or a module around it) casts the run's weights too: the run closes."""
    for pick in (lambda m: m[0], lambda m: nn.Sequential(m)):
        torch.manual_seed(0)
        model = make("mlp")
        prec = MixedPrecision("bf16-master")
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for_inference(pick(model), "bf16")
        with pytest.raises(ValueError, match=re.escape("cast for inference by for_inference()")):
            prec.step(opt)


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp32", "bf16-master", "bf16-pure"])
def test_for_inference_of_a_submodule_then_the_whole_model_runs(preset):
    """Casting a module inside a run's model for inference, then running the whole model: the run's recast check (its
    weights keep the dtypes prepare gave them) is off once for_inference ends the run on purpose."""
    torch.manual_seed(0)
    model = make("mlp")
    prec = MixedPrecision(preset)
    model, _ = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for_inference(model[0], "bf16")
    with torch.no_grad():
        out = model(batch("mlp", 0)[0])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master"])
def test_for_inference_of_a_model_compiled_before_prepare(preset):
    """torch.compile, then prepare (marks on the compile wrapper, patches on the module it wraps), then for_inference
    of the compiled model: the run's patches come off (they stacked under the new ones and refused the cast)."""
    torch.manual_seed(0)
    compiled = torch.compile(make("mlp"), backend="eager")
    prec = MixedPrecision(preset)
    model, _ = prec.prepare(compiled, torch.optim.AdamW(compiled.parameters(), lr=1e-2))
    for_inference(model, "bf16")
    with torch.no_grad():
        out = model(batch("mlp", 0)[0])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert model._orig_mod[0].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master"])
def test_for_inference_of_a_model_compiled_after_prepare(preset):
    """prepare, then torch.compile, then for_inference of the compiled model: cast and closed (a first version of the
    compiled-before fix tried to uncast the compile wrapper, which holds no marks here: AttributeError)."""
    torch.manual_seed(0)
    model = make("mlp")
    prec = MixedPrecision(preset)
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    compiled = torch.compile(model, backend="eager")
    for_inference(compiled, "bf16")
    with torch.no_grad():
        out = compiled(batch("mlp", 0)[0])
    assert out.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=re.escape("cast for inference by for_inference()")):
        prec.step(opt)


def test_for_inference_of_a_wrapper_in_another_dtype_runs():
    """A module around a run's model cast to another dtype: the run's own casts come off too, so the forward runs."""
    torch.manual_seed(0)
    model = make("mlp")
    prec = MixedPrecision("bf16-master")
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    wrapper = nn.Sequential(model)
    for_inference(wrapper, "fp16")
    with torch.no_grad():
        out = wrapper(batch("mlp", 0)[0])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_for_inference_of_a_wrapper_around_a_compiled_run_model():
    torch.manual_seed(0)
    model = make("mlp")
    prec = MixedPrecision("bf16-master")
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    wrapper = nn.Sequential(torch.compile(model, backend="eager"))
    for_inference(wrapper, "fp16")  # (raised AttributeError on the compiled module, after closing the run)
    assert {p.dtype for p in model.parameters()} == {torch.float16, torch.float32}
    with pytest.raises(ValueError, match=re.escape("cast for inference by for_inference()")):
        prec.step(opt)


@pytest.mark.parametrize("islands", ["Sequential", "name:*"])
def test_a_batchnorm_inside_a_root_island_is_not_refused(islands):
    """The BatchNorm check (half weight, FP32 running statistics) counts a root that is itself the FP32 island as
    holding every BatchNorm (it used to refuse them: the root's prefix matched no child name)."""
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    prec = MixedPrecision(f"p=bf16,c=bf16,o=f32,m=f32,i={islands}")
    model, opt = prec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with prec.autocast():
        loss = model(torch.randn(5, 4)).float().pow(2).mean()
    prec.backward(loss)
    prec.step(opt)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


class _Fourier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lift = nn.Linear(4, 8)
        self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.complex64) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.fft.rfft(self.lift(x).float(), dim=-1)
        return torch.fft.irfft(h @ self.w[:, : h.shape[-1]].T[: h.shape[-1]], n=8, dim=-1)


@pytest.mark.parametrize("case", ["complex", "differentiable"])
def test_a_bf16_pure_conversion_refusal_leaves_model_and_optimizers_untouched(case: str) -> None:
    torch.manual_seed(0)
    model = _Fourier()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if case == "complex":
        opts = [torch.optim.AdamW([model.lift.weight, model.lift.bias]), torch.optim.AdamW([model.w])]
        match = r"optimizer 1 \(AdamW\) holds a torch.complex64 parameter of shape \(8, 8\); policy 'bf16-pure'"
    else:
        opts = [torch.optim.AdamW(model.parameters(), differentiable=True)]
        match = r"optimizer 0 \(AdamW\), param group 0, has differentiable=True; policy 'bf16-pure'"
    with pytest.raises(ValueError, match=match):
        MixedPrecision("bf16-pure").prepare(model, *opts)
    for n, p in model.named_parameters():
        assert p.dtype == before[n].dtype and torch.equal(p, before[n])
    # nothing left prepared: another policy takes the same model and optimizers
    prec = MixedPrecision("bf16-master")
    model, *opts = prec.prepare(model, *opts)
    assert model.lift.weight.dtype == torch.bfloat16


def test_a_failure_while_wrapping_rolls_back_casts_hooks_and_optimizers(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare changes nothing when it raises, also for a failure after the model was cast."""
    import mixprec._prepare as prep

    made = []

    class Failing(MasterWeightOptimizer):
        def __init__(self, *args, **kwargs):
            if made:
                raise RuntimeError("second wrapper fails")
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(prep, "MasterWeightOptimizer", Failing)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    o1, o2 = torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.AdamW(model[2].parameters())
    params1 = list(o1.param_groups[0]["params"])
    with pytest.raises(RuntimeError, match="second wrapper fails"):
        MixedPrecision("bf16-master").prepare(model, o1, o2)
    assert made, "the first wrapper was built (and hooked the parameters) before the failure"
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[n])
        assert not getattr(p, "_post_accumulate_grad_hooks", None)
    assert o1.param_groups[0]["params"] == params1 and not o1.state
    assert "forward" not in model.__dict__  # the root's patched forward is gone
    monkeypatch.undo()
    prec = MixedPrecision("bf16-master")
    model, o1, o2 = prec.prepare(model, o1, o2)
    x = torch.randn(3, 4)
    with prec.autocast():
        loss = model(x).float().pow(2).mean()
    prec.backward(loss)
    prec.step(o1)
    prec.step(o2)
    assert not torch.equal(model[0].weight.float(), before["0.weight"].bfloat16().float())


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_for_inference_ends_a_copied_run_as_it_ends_the_original(how: str) -> None:
    # The twin's model was not registered: after for_inference the twin trained the cast model on.
    import pickle

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    prec = MixedPrecision("bf16-master")
    prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    twin = copy.deepcopy(prec) if how == "deepcopy" else pickle.loads(pickle.dumps(prec))
    assert twin.model is not model
    for_inference(twin.model, "bf16")
    with torch.no_grad():
        assert twin.model(torch.randn(3, 4)).dtype == torch.float32
    with pytest.raises(ValueError, match="cast for inference by for_inference"):
        twin.backward(twin.model(torch.randn(3, 4)).float().sum())
    # the original run goes on
    with prec.autocast():
        loss = prec.model(torch.randn(3, 4)).float().pow(2).sum()
    prec.backward(loss)
    prec.step(prec.optimizers[0])


def test_for_inference_without_islands_casts_batchnorm_statistics_like_model_half() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    model.train()
    model(torch.randn(8, 3, 6, 6))  # running statistics away from their defaults
    ref = copy.deepcopy(model).half().eval()
    x = torch.randn(2, 3, 6, 6)
    out = for_inference(model, "fp16", fp32_islands=())(x)
    assert model[1].running_mean.dtype == torch.float16 and model[1].num_batches_tracked.dtype == torch.int64
    torch.testing.assert_close(out.half(), ref(x.half()), rtol=0, atol=0)
    # with the default islands the BatchNorm stays FP32, statistics included
    kept = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    for_inference(kept, "fp16")
    assert kept[1].weight.dtype == kept[1].running_mean.dtype == torch.float32


def test_a_prepare_that_raises_in_a_later_optimizer_leaves_no_hooks_or_step_guards() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    adam = torch.optim.Adam(model[0].parameters())
    sgd = torch.optim.SGD([model[1].weight, model[1].bias, model[1].weight], lr=0.1)  # listed twice
    with pytest.raises(ValueError, match=r"a parameter of shape \(2, 8\) appears twice"):
        MixedPrecision("fp16-master").prepare(model, adam, sgd)
    assert "step" not in adam.__dict__ and "step" not in sgd.__dict__  # no guard left on either optimizer
    for p in model.parameters():
        assert p.dtype == torch.float32 and not getattr(p, "_post_accumulate_grad_hooks", None)
    model(torch.randn(3, 4)).sum().backward()  # plain FP32 training goes on
    adam.step()


@pytest.mark.parametrize("policy", ["fp16-master", "p=f16,c=f16,o=f32,m=none,ls=dynamic"])
def test_weights_beyond_fp16_range_are_refused_before_the_cast_makes_them_inf(policy: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight[3, 1] = 1.5e5
    before = model[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"parameter '0.weight' has values up to 1.5e\+05, beyond FP16's maximum 65504"):
        MixedPrecision(policy).prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model[0].weight.dtype == torch.float32 and torch.equal(model[0].weight, before)
    # an FP32 island or a BF16 policy takes it
    MixedPrecision("bf16-master").prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("source", [torch.bfloat16])
def test_weights_beyond_fp16_range_in_a_bf16_model_are_refused_too(source: torch.dtype) -> None:
    """A model loaded in BF16 (from_pretrained(torch_dtype=bfloat16)) prepared under fp16-master for a GPU without BF16:
    only FP32 weights were checked, so these became inf silently and every step skipped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(source)
    with torch.no_grad():
        model[0].weight[1, 1] = 99840.0
    before = model[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"parameter '0.weight' has values up to 9.984e\+04, beyond FP16's maximum"):
        MixedPrecision("fp16-master").prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model[0].weight.dtype == source and torch.equal(model[0].weight, before)


def test_for_inference_in_fp16_refuses_weights_beyond_its_range_before_casting() -> None:
    from mixprec.checkpoint import for_inference

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    with torch.no_grad():
        model[2].weight[0, 0] = 1e5
        model[1].bias[0] = 1e5  # in an FP32 island: kept in FP32, not refused
    with pytest.raises(ValueError, match=r"for_inference\(..., 'fp16'\): parameter '2.weight' has values up to 1e\+05.*"
                                         r"Nothing was cast.*fp32_islands=\('norm', 'name:2'\)"):
        for_inference(model, "fp16")
    assert model[2].weight.dtype == torch.float32
    for_inference(model, "fp16", fp32_islands=("norm", "name:2"))
    assert model[0].weight.dtype == torch.float16 and model[2].weight.dtype == torch.float32
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    bn[1].running_var.fill_(1e6)  # cast with the weights when the BatchNorm is not an island
    with pytest.raises(ValueError, match=r"buffer '1.running_var' has values up to 1e\+06"):
        for_inference(bn, "fp16", fp32_islands=())
    for_inference(bn, "fp16")  # the default islands keep it in FP32
    assert bn[1].running_var.dtype == torch.float32


def test_release_ends_the_run_so_a_backward_cannot_scale_for_an_unguarded_step():
    """After release() a backward still scaled the loss and the unguarded optimizer applied x65536 gradients, silently."""
    torch.manual_seed(0)
    model = make("mlp")
    prec = MixedPrecision("bf16-mixed")
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    prec.release()
    with prec.autocast():
        loss = model(batch("mlp", 0)[0]).float().square().mean()
    with pytest.raises(ValueError, match=r"backward\(\): this run was ended by prec.release\(\)"):
        prec.backward(loss)
    loss.backward()  # the optimizer is the user's again
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_a_model_holding_a_prepared_submodule_or_inside_a_prepared_model_is_refused() -> None:
    """A second prepare cast the first run's parameters again (bf16 -> fp16) and both runs failed at every forward with
    an error that blamed a user's model.half()."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    p1 = MixedPrecision("bf16-master")
    enc, _ = p1.prepare(enc, torch.optim.AdamW(enc.parameters(), lr=1e-3))
    outer = nn.Sequential(enc, nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"submodule '0' of this model was already prepared.*Nothing was changed"):
        MixedPrecision("fp16-master").prepare(outer, torch.optim.AdamW(outer[1].parameters(), lr=1e-3))
    assert outer[1].weight.dtype == torch.float32 and enc[0].weight.dtype == torch.bfloat16

    whole = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    run = MixedPrecision("bf16-mixed")
    run.prepare(whole, torch.optim.AdamW(whole.parameters(), lr=1e-3))
    with pytest.raises(ValueError, match="this model is a submodule of a model another MixedPrecision prepared"):
        MixedPrecision("bf16-master").prepare(whole[1], torch.optim.AdamW(whole[1].parameters(), lr=1e-3))
    assert whole[1].weight.dtype == torch.float32
    del run
    import gc

    gc.collect()  # the run is gone: nothing holds the model's parameters any more
    MixedPrecision("bf16-master").prepare(whole[1], torch.optim.AdamW(whole[1].parameters(), lr=1e-3))


@pytest.mark.parametrize("preset", ["bf16-master", "bf16-pure"])
def test_a_distillation_wrapper_with_a_teacher_cast_for_inference_is_prepared(preset: str) -> None:
    """A frozen teacher cast by for_inference holds no run: the wrapper (student + teacher) prepares and trains, the
    teacher untouched (the nested-run refusal first refused it too: Lightning prepares the whole LightningModule)."""
    from mixprec.checkpoint import for_inference

    torch.manual_seed(0)
    teacher = for_inference(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)), "bf16")
    teacher.requires_grad_(False)
    wrapper = nn.ModuleDict({"student": nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 2)),
                             "teacher": teacher})
    kept = [p.detach().clone() for p in teacher.parameters()]
    prec = MixedPrecision(preset)
    wrapper, opt = prec.prepare(wrapper, torch.optim.AdamW(wrapper["student"].parameters(), lr=1e-2))
    x = torch.randn(8, 4)
    losses = []
    for _ in range(3):
        with prec.autocast():
            with torch.no_grad():
                target = wrapper["teacher"](x.to(torch.bfloat16)).float()
            loss = (wrapper["student"](x.to(wrapper["student"][0].weight.dtype)).float() - target).square().mean()
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(a, b) for a, b in zip(teacher.parameters(), kept))
