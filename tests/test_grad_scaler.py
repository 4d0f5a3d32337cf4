"""mixprec.GradScaler is a drop-in for torch.amp.GradScaler: same results bit for bit, same errors, same checkpoints."""

from __future__ import annotations

import copy
import pickle
import random
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from _trees import equal_tree  # tests/_trees.py

from mixprec._errors import NumericsError
from mixprec._grad_scaler import GradScaler
from mixprec.bench._timing import OpCounter

TorchGradScaler = torch.amp.GradScaler
TORCH_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}



def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _optimizer(kind, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "adamw-fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :4].argmax(1)


def train(scaler_cls, opt_kind, steps=40, clip=False, inject=frozenset(), dtype=torch.float16):
    model = _model()
    opt = _optimizer(opt_kind, model)
    # 2**28 overflows the fp16 activation gradients at first: real backoffs, then growth every 5 clean steps
    scaler = scaler_cls("cpu", init_scale=2.0**28, growth_interval=5)
    scales = []
    for step in range(steps):
        x, y = _batch(step)
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x).float(), y)
        if step in inject:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in model.parameters()], opt.state_dict(), scales



@pytest.mark.parametrize("opt_kind", ["sgd", "adamw", "adamw-fused"])
@pytest.mark.parametrize("clip", [False, True])
def test_bit_identical_to_torch_in_an_fp16_autocast_loop(opt_kind, clip):
    inject = frozenset({17, 18, 30})
    ref_params, ref_state, ref_scales = train(TorchGradScaler, opt_kind, clip=clip, inject=inject)
    params, state, scales = train(GradScaler, opt_kind, clip=clip, inject=inject)
    assert scales == ref_scales
    assert scales[0] < 2.0**28 and max(scales[5:]) > min(scales)  # it did back off and grow
    assert equal_tree(params, ref_params)
    assert equal_tree(state, ref_state)


def test_bit_identical_in_a_bf16_autocast_loop():
    ref = train(TorchGradScaler, "adamw", steps=15, dtype=torch.bfloat16, inject=frozenset({4}))
    got = train(GradScaler, "adamw", steps=15, dtype=torch.bfloat16, inject=frozenset({4}))
    assert equal_tree(got, ref)


def test_same_scale_sequence_under_random_overflows():
    rng = random.Random(7)
    pattern = [rng.random() < 0.2 for _ in range(500)]
    seqs = []
    for cls in (TorchGradScaler, GradScaler):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(3))
        opt = torch.optim.SGD([p], lr=0.01)
        scaler = cls("cpu", init_scale=2.0**10, growth_interval=3, growth_factor=1.5, backoff_factor=0.4)
        seq = []
        for bad in pattern:
            scaler.scale(p.square().sum()).backward()
            if bad:
                p.grad[1] = float("nan") if rng.random() < 0.5 else float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            seq.append(scaler.get_scale())
        seqs.append((seq, p.detach().clone()))
    assert seqs[0][0] == seqs[1][0]
    assert torch.equal(seqs[0][1], seqs[1][1])


def test_fused_optimizer_step_is_sync_free_and_plain_one_sync():
    for kind, syncs in (("adamw-fused", 0), ("sgd", 1)):
        counts = []
        for cls in (TorchGradScaler, GradScaler):
            model = _model()
            opt = _optimizer(kind, model)
            scaler = cls("cpu")
            x, y = _batch(0)
            scaler.scale(F.cross_entropy(model(x), y)).backward()  # create state outside the count
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            with OpCounter() as c:
                scaler.scale(F.cross_entropy(model(x), y)).backward()
                scaler.step(opt)
                scaler.update()
            counts.append(c.ops["_local_scalar_dense"])
        assert counts == [syncs, syncs], kind


def test_step_returns_skipped_without_a_sync():
    model = _model()
    opt = _optimizer("adamw-fused", model)
    scaler = GradScaler("cpu")
    x, y = _batch(0)
    scaler.scale(F.cross_entropy(model(x), y) * float("inf")).backward()
    skipped = scaler.step(opt)
    assert isinstance(skipped, torch.Tensor) and skipped.dtype == torch.bool and skipped.item()
    scaler.update()
    opt.zero_grad()
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    assert not scaler.step(opt).item()


def test_scale_outputs_like_torch():
    ours, ref = GradScaler("cpu", init_scale=4.0), TorchGradScaler("cpu", init_scale=4.0)
    t = torch.tensor([1.0, 2.0])
    for outputs in (t, [t, (t, t)], (t,)):
        a, b = ours.scale(outputs), ref.scale(outputs)
        assert type(a) is type(b) and equal_tree(a, b)
    a, b = ours.scale(iter([t])), ref.scale(iter([t]))
    assert equal_tree(list(a), list(b))
    assert ours.scale({"x": t})["x"].tolist() == [4.0, 8.0]  # beyond torch: dicts
    for s in (ours, ref):
        with pytest.raises(ValueError, match=re.escape("outputs must be a Tensor or an iterable of Tensors")):
            s.scale([t, 3])


# ----- misuse: the same errors as torch ----------------------------------------------------------------
def _loss(model):
    x, y = _batch(0)
    return F.cross_entropy(model(x), y)


def _unscale_twice(s, m, o):
    s.scale(_loss(m)).backward(); s.unscale_(o); s.unscale_(o)


def _unscale_after_step(s, m, o):
    s.scale(_loss(m)).backward(); s.step(o); s.unscale_(o)


def _step_twice(s, m, o):
    s.scale(_loss(m)).backward(); s.step(o); s.step(o)


def _step_before_scale(s, m, o):
    _loss(m).backward(); s.step(o)


def _unscale_before_scale(s, m, o):
    s.unscale_(o)


def _update_before_scale(s, m, o):
    s.update()


def _update_without_step(s, m, o):
    s.scale(_loss(m)).backward(); s.update()


def _closure(s, m, o):
    s.scale(_loss(m)).backward(); s.step(o, closure=lambda: 0.0)


def _fp16_grads(s, m, o):
    m.half()
    x, y = _batch(0)
    s.scale(F.cross_entropy(m(x.half()).float(), y)).backward()
    s.unscale_(o)


def _new_scale_two_elements(s, m, o):
    s.scale(_loss(m)).backward(); s.step(o); s.update(torch.ones(2))


def _new_scale_other_device(s, m, o):
    s.scale(_loss(m)).backward(); s.step(o); s.update(torch.ones((), device="meta"))


def _pickle_mid_iteration(s, m, o):
    s.scale(_loss(m)).backward(); s.step(o); pickle.dumps(s)


MISUSE = [_unscale_twice, _unscale_after_step, _step_twice, _step_before_scale, _unscale_before_scale,
          _update_before_scale, _update_without_step, _closure, _fp16_grads, _new_scale_two_elements,
          _new_scale_other_device, _pickle_mid_iteration]


@pytest.mark.parametrize("scenario", MISUSE, ids=[f.__name__[1:] for f in MISUSE])
def test_misuse_raises_the_same_error_as_torch(scenario):
    errors = []
    for cls in (TorchGradScaler, GradScaler):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(Exception) as e:
            scenario(cls("cpu"), model, opt)
        errors.append(e.value)
    theirs, ours = errors
    assert isinstance(ours, type(theirs)), (type(theirs), type(ours))
    assert str(theirs) in str(ours) or str(ours).startswith(str(theirs).split(" Got")[0])


# messages pinned for what torch does not have
def test_pinned_messages_for_our_errors():
    with pytest.raises(ValueError, match=re.escape("The growth factor must be > 1.0. Got growth_factor=1.0; torch's "
                                                   "default is 2.0.")):
        GradScaler("cpu", growth_factor=1.0)
    with pytest.raises(AssertionError, match=re.escape("The backoff factor must be < 1.0. Got backoff_factor=1.5")):
        GradScaler("cpu", backoff_factor=1.5)
    with pytest.raises(ValueError, match=re.escape("GradScaler: hysteresis must be an int >= 1, got 0.")):
        GradScaler("cpu", hysteresis=0)
    with pytest.raises(ValueError, match=re.escape("GradScaler: growth_interval must be an int >= 1, got 0.")):
        GradScaler("cpu", growth_interval=0)
    with pytest.raises(ValueError, match=re.escape("GradScaler: on_failure='raise' needs a floor (min_scale)")):
        GradScaler("cpu", on_failure="raise")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = GradScaler("cpu")
    with pytest.raises(RuntimeError, match=re.escape(
            "Attempted step but _scale is None.  This may indicate your script did not use scaler.scale(loss or "
            "outputs) earlier in the iteration.")):
        s.step(opt)
    with pytest.raises(ValueError, match=re.escape("Attempting to unscale FP16 gradients. GradScaler expects FP32 "
                                                   "parameters")):
        _fp16_grads(s, model, opt)


def test_disabled_is_a_pass_through():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = GradScaler("cpu", enabled=False)
    loss = _loss(model)
    assert s.scale(loss) is loss and not s.is_enabled()
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    assert s.unscale_(opt) is None
    s.step(opt)
    s.update()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # it stepped
    assert s.get_scale() == 1.0 and s.state_dict() == {} and s.statistics() == {}
    s.load_state_dict({})  # no-op, as torch
    assert pickle.loads(pickle.dumps(s)).is_enabled() is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_default_without_cuda_warns_and_disables():
    with pytest.warns(UserWarning, match=re.escape("mixprec.GradScaler(device='cuda') is enabled, but CUDA is not "
                                                   "available. Disabling.")):
        s = GradScaler()
    assert not s.is_enabled()


def test_getters_setters_and_new_scale():
    s = GradScaler("cpu", init_scale=8.0, growth_interval=2)
    assert s.get_scale() == 8.0 and s._scale is None and s._get_growth_tracker() == 0
    s.set_growth_factor(4.0)
    s.set_backoff_factor(0.25)
    s.set_growth_interval(1)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (4.0, 0.25, 1)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    s.scale(p.sum()).backward()
    s.step(opt)
    s.update()
    assert s.get_scale() == 32.0
    s.update(3.0)
    assert s.get_scale() == 3.0
    s.update(torch.tensor(5.0))
    assert s.get_scale() == 5.0
    c = GradScaler("cpu", init_scale=8.0, min_scale=1.0, max_scale=16.0)
    c.scale(p.sum())
    c.update(100.0)
    assert c.get_scale() == 16.0  # the ceiling applies to a manual scale too


# ----- state ----------------------------------------------------------------------------------------
def _run_pattern(scaler, pattern, p=None):
    p = p if p is not None else torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    for bad in pattern:
        scaler.scale(p.sum()).backward()
        if bad:
            p.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler


NON_DEFAULT = {"init_scale": 2.0**10, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 3, "hysteresis": 2,
                   "min_scale": 2.0, "max_scale": 2.0**20, "refill": "clean", "history": 16}


def test_state_dict_round_trip_every_field():
    rng = random.Random(2)
    s = _run_pattern(GradScaler("cpu", **NON_DEFAULT), [rng.random() < 0.4 for _ in range(41)])
    sd = s.state_dict(extended=True)  # the full state: torch's keys plus mixprec's
    assert sd.keys() >= TORCH_KEYS and sd["version"] == 1
    assert sd["_growth_tracker"] == s._get_growth_tracker() and sd["steps"] == 41
    fresh = GradScaler("cpu", history=16)  # every field default: all differ
    fresh.load_state_dict(copy.deepcopy(sd))
    assert fresh.state_dict(extended=True) == sd  # before the lazy state exists
    fresh.scale(torch.ones(()))
    assert fresh.state_dict(extended=True) == sd  # after
    assert (_run_pattern(fresh, [1, 0, 0, 0]).state_dict(extended=True)
            == _run_pattern(s, [1, 0, 0, 0]).state_dict(extended=True))


def test_state_dict_before_first_scale_matches_torch():
    kw = {"init_scale": 128.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 9}
    ours, ref = GradScaler("cpu", **kw).state_dict(), TorchGradScaler("cpu", **kw).state_dict()
    assert {k: ours[k] for k in TORCH_KEYS} == ref


def test_checkpoints_interoperate_both_ways():
    rng = random.Random(4)
    pattern = [rng.random() < 0.3 for _ in range(60)]
    kw = {"init_scale": 2.0**12, "growth_interval": 4}
    theirs = _run_pattern(TorchGradScaler("cpu", **kw), pattern)
    ours = GradScaler("cpu")
    ours.load_state_dict(theirs.state_dict())
    assert {k: ours.state_dict()[k] for k in TORCH_KEYS} == theirs.state_dict()
    more = [rng.random() < 0.3 for _ in range(60)]
    seq_theirs = [_run_pattern(theirs, [b]).get_scale() for b in more]
    seq_ours = [_run_pattern(ours, [b]).get_scale() for b in more]
    assert seq_ours == seq_theirs
    back = TorchGradScaler("cpu")
    back.load_state_dict(ours.state_dict())  # torch ignores our extra keys
    assert back.state_dict() == theirs.state_dict()


def test_loading_an_empty_dict_raises_like_torch():
    with pytest.raises(RuntimeError, match=re.escape("The source state dict is empty, possibly because it was saved "
                                                     "from a disabled instance of GradScaler.")):
        GradScaler("cpu").load_state_dict({})
    with pytest.raises(ValueError, match=re.escape("GradScaler: not a loss-scaler state dict (missing 'scale'")):
        GradScaler("cpu").load_state_dict({"model": 1})


def test_pickling():
    s = GradScaler("cpu", **NON_DEFAULT)
    assert pickle.loads(pickle.dumps(s)).state_dict(extended=True) == s.state_dict(extended=True)  # before first use
    _run_pattern(s, [1, 0, 0, 1, 0])
    t = pickle.loads(pickle.dumps(s))
    assert t.state_dict(extended=True) == s.state_dict(extended=True) and t._scale is None  # re-created lazily, as torch
    assert (_run_pattern(t, [0, 0, 1]).state_dict(extended=True)
            == _run_pattern(s, [0, 0, 1]).state_dict(extended=True))


# ----- beyond torch ---------------------------------------------------------------------------------
def test_hysteresis_floor_and_escalation_in_the_drop_in():
    s = GradScaler("cpu", init_scale=8.0, hysteresis=2, min_scale=2.0, on_failure="raise", patience=3, check_interval=1)
    p = torch.nn.Parameter(torch.ones(2))
    _run_pattern(s, [1], p)
    assert s.get_scale() == 8.0  # tolerated
    _run_pattern(s, [1, 1], p)
    assert s.get_scale() == 2.0
    with pytest.raises(NumericsError, match="loss scaling has failed"):
        _run_pattern(s, [1] * 5, p)
    st = s.statistics()
    assert st["skipped_steps"] == st["steps"] and st["floor_streak"] >= 3


class LegacyOpt(torch.optim.SGD):
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):  # type: ignore[override]
        found = grad_scaler._check_inf_per_device(self)
        self.seen = (grad_scaler._get_scale_async().item(), [f.item() for f in found.values()])


def test_legacy_grad_scaler_keyword_protocol():
    p = torch.nn.Parameter(torch.ones(2))
    opt = LegacyOpt([p], lr=0.1)
    s = GradScaler("cpu", init_scale=4.0)
    s.scale(p.sum() * float("inf")).backward()
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
        s.step(opt)
    assert opt.seen == (4.0, [1.0])
    s.update()
    assert s.get_scale() == 2.0


def test_no_warnings_in_normal_use():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(GradScaler, "adamw-fused", steps=5)


@pytest.mark.cuda
def test_cuda_fused_loop_matches_torch_and_never_syncs():
    def run(cls, check_sync):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = cls("cuda", init_scale=2.0**24, growth_interval=4)
        g = torch.Generator(device="cuda").manual_seed(0)
        xs = [torch.randn(32, 64, device="cuda", generator=g) for _ in range(30)]
        ys = [x[:, :8].argmax(1) for x in xs]
        scale_t = []
        torch.cuda.synchronize()
        if check_sync:
            torch.cuda.set_sync_debug_mode("error")
        try:
            for i, (x, y) in enumerate(zip(xs, ys)):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.cross_entropy(model(x).float(), y)
                scaler.scale(loss * (float("inf") if i == 11 else 1.0)).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                scale_t.append(scaler._scale.clone())
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return [p.detach().cpu() for p in model.parameters()], [s.item() for s in scale_t]

    ref_params, ref_scales = run(TorchGradScaler, False)
    params, scales = run(GradScaler, True)
    assert scales == ref_scales and min(scales) < 2.0**24
    assert equal_tree(params, ref_params)


def test_training_goes_on_after_a_caught_escalation() -> None:
    """update() raised NumericsError before forgetting the iteration: the next step() said step() had already been
    called, pickling was refused, and a second update() counted the iteration twice."""
    import pickle

    import mixprec as mp

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sc = mp.GradScaler("cpu", init_scale=4.0, min_scale=1.0, on_failure="raise", patience=3, check_interval=1)
    with pytest.raises(mp.NumericsError):
        for _ in range(10):
            sc.scale(model(torch.randn(3, 4)).sum() * float("inf")).backward()
            sc.step(opt)
            opt.zero_grad()
            sc.update()
    steps = sc.statistics()["steps"]
    with pytest.raises(RuntimeError, match="No inf checks were recorded"):
        sc.update()  # the iteration is over: not counted twice
    assert sc.statistics()["steps"] == steps
    opt.zero_grad()
    before = model.weight.detach().clone()
    sc.scale(model(torch.randn(3, 4)).sum()).backward()
    sc.step(opt)
    sc.update()
    assert not torch.equal(model.weight, before)
    pickle.loads(pickle.dumps(sc))


def test_fused_step_after_an_unscale_that_saw_no_gradients_refuses_the_scaled_ones():
    """unscale_ before backward (no gradients yet), then backward and step with a fused optimizer: the gradients, still
    scaled, were applied (a 1024x update, reported as not skipped)."""
    from mixprec import GradScaler

    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([w], lr=0.1, fused=True)
    scaler = GradScaler("cpu", init_scale=1024.0)
    scaler.scale(w.sum()).backward()  # one ordinary iteration
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    before = w.detach().clone()
    scaler.unscale_(opt)  # no gradients yet: nothing unscaled, nothing checked
    scaler.scale(w.sum()).backward()
    with pytest.raises(RuntimeError, match="No inf checks were recorded for this optimizer"):
        scaler.step(opt)
    assert torch.equal(w.detach(), before)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -2.0, "tensor-nan"])
def test_update_with_a_new_scale_that_is_not_finite_and_positive_is_refused(bad):
    from mixprec import GradScaler

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = GradScaler("cpu", init_scale=8.0)
    scaler.scale(w.sum()).backward()
    scaler.step(opt)
    new = torch.tensor(float("nan")) if bad == "tensor-nan" else bad
    with pytest.raises(ValueError, match=r"update\(new_scale=.*finite number > 0.*Nothing was changed"):
        scaler.update(new)
    assert scaler.get_scale() == 8.0
    scaler.update(4.0)
    assert scaler.get_scale() == 4.0


def test_the_grad_scaler_keyword_cache_does_not_grow_with_scheduled_optimizers():
    """torch's LR schedulers give each optimizer a step function of its own: one cache entry per optimizer, for good."""
    import mixprec._grad_scaler as gs
    from mixprec import GradScaler

    gs._STEP_TAKES_GRAD_SCALER.clear()
    for _ in range(5):
        w = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.AdamW([w], lr=0.1, fused=True)
        torch.optim.lr_scheduler.StepLR(opt, 1)
        scaler = GradScaler("cpu")
        scaler.scale(w.sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert len(gs._STEP_TAKES_GRAD_SCALER) == 1
