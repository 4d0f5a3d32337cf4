"""The step's GPU costs, measured on a CPU (issue 26): host reads, aten ops, Python calls, files.

Every preset steps with no host read, through ``prec.step`` and ``optimizer.step()``, with foreach
and fused torch optimizers; every ``*-mixed``/``*-master`` preset dispatches at most 10 aten ops
per iteration more than the torch.amp recipe on the same model and stays within 1.25x its Python
calls, at two depths; ``prec.step`` reaches the optimizer through at most 5 mixprec files.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec.bench._step_cost import StepCounter, gpt_model, make_recipe, measure_recipe

PRESETS = ["fp32", "tf32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-master-r16", "bf16-pure",
           "fp16-pure"]
AMP_PRESETS = ["bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-master-r16"]


def _amp_for(preset: str) -> str:
    return "amp-fp16" if "fp16" in preset else "amp-bf16"


@pytest.mark.parametrize("route", ["prec.step", "optimizer.step"])
@pytest.mark.parametrize("kind", ["foreach", "fused"])
@pytest.mark.parametrize("preset", PRESETS)
def test_no_host_read_per_step(preset: str, kind: str, route: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        it, opts = make_recipe(preset, 1, fused=kind == "fused", foreach=True if kind == "foreach" else None,
                               direct=route == "optimizer.step")
        cost = measure_recipe(it, opts, warmup=2, steps=3)
    assert cost.host_reads == 0, cost.op_names


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("preset", ["bf16-mixed", "fp16-master"])
def test_no_host_read_with_sgd_and_adam(preset: str, optimizer: str) -> None:
    it, opts = make_recipe(preset, 1, optimizer=optimizer)
    assert measure_recipe(it, opts, warmup=2, steps=3).host_reads == 0


def _loop(preset: str, optimizer: str = "adamw"):
    torch.manual_seed(0)
    model = gpt_model(1)
    prec = mixprec.MixedPrecision(preset)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    model, opt = prec.prepare(model, opt)
    x = torch.randint(0, 64, (2, 16))

    def iteration(plant: bool = False) -> mixprec.StepInfo:
        with prec.autocast():
            loss = F.cross_entropy(model(x).float().flatten(0, 1), x.flatten())
        if plant:
            loss = loss * float("nan")
        prec.backward(loss)
        info = prec.step(opt)
        opt.zero_grad(set_to_none=True)
        return info

    return prec, model, opt, iteration


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("preset", ["bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master"])
def test_a_planted_overflow_is_skipped_on_the_device(preset: str, optimizer: str) -> None:
    """The device-side skip really skips: weights, masters and optimizer state unchanged, no host read."""
    prec, model, opt, iteration = _loop(preset, optimizer)
    iteration()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = [{k: v.clone() for k, v in st.items()} for st in opt.state.values()]
    scale = prec.scaler.loss_scale.clone()
    with StepCounter((opt,)) as c:
        info = iteration(plant=True)
    assert c.host_reads == 0
    assert bool(info.skipped)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for st, old in zip(opt.state.values(), state_before):
        for k, v in st.items():
            assert torch.equal(v, old[k]), k
    if preset.startswith("fp16"):
        assert float(prec.scaler.loss_scale) == float(scale) / 2  # backed off on the device
    assert not bool(iteration().skipped)  # later steps apply
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_sgd_whose_first_step_is_skipped_starts_its_momentum_from_the_next_gradient() -> None:
    """torch's fused SGD leaves uninitialised momentum buffers when its first step is skipped; the twin does not."""
    prec, model, opt, iteration = _loop("fp16-mixed", "sgd")
    ref_model = gpt_model(1)
    ref_model.load_state_dict(model.state_dict())
    assert bool(iteration(plant=True).skipped)
    for st in opt.state.values():
        assert torch.count_nonzero(st["momentum_buffer"]) == 0
    iteration()
    # the first applied step is buf = grad, param -= lr * grad: finite and small
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.isfinite(p).all()
        assert (p - q).abs().max() < 1.0


@pytest.mark.parametrize("preset", AMP_PRESETS)
def test_extra_ops_and_python_calls_over_torch_amp(preset: str) -> None:
    """At most 10 extra aten ops per iteration and 1.25x the Python calls of torch.amp, at two depths.

    Growth with depth: the extra ops do not grow, and the Python calls a block adds stay within
    1.25x of what it adds to torch.amp's recipe (so the ratio stays under 1.25 at any depth).
    """
    extra, ratio, calls, base_calls = {}, {}, {}, {}
    for depth in (2, 4):
        base_it, base_opts = make_recipe(_amp_for(preset), depth, fused=True)
        it, opts = make_recipe(preset, depth, fused=True)
        base, ours = measure_recipe(base_it, base_opts), measure_recipe(it, opts)
        extra[depth] = ours.ops - base.ops
        calls[depth], base_calls[depth] = ours.python_calls, base.python_calls
        ratio[depth] = ours.python_calls / base.python_calls
        assert extra[depth] <= 10, (depth, ours.op_names - base.op_names)
        assert ratio[depth] <= 1.25, (depth, ratio)
    if preset.endswith("-mixed"):  # the same forward as torch.amp's: the extra is the step's alone
        assert extra[2] == extra[4]
    else:  # half weights: no per-forward weight casts, so deeper models save more
        assert extra[4] <= extra[2]
    assert calls[4] - calls[2] <= 1.25 * (base_calls[4] - base_calls[2])


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master"])
def test_clipping_carries_the_inf_nan_check(preset: str) -> None:
    """Clipping on both sides: mixprec's extra ops shrink (the check rides on the clip's multiply), no host read."""
    extra = {}
    for clip in (None, 1.0):
        base = measure_recipe(*make_recipe(_amp_for(preset), 2, fused=True, clip=clip))
        ours = measure_recipe(*make_recipe(preset, 2, fused=True, clip=clip))
        extra[clip] = ours.ops - base.ops
        assert ours.host_reads == 0
    assert extra[1.0] < extra[None], extra


def test_edit_check_and_copy_back_are_foreach() -> None:
    """The master step's aten ops do not grow with the number of parameter tensors."""
    counts = {}
    for depth in (1, 3):
        it, opts = make_recipe("bf16-master", depth, fused=True)
        cost = measure_recipe(it, opts)
        counts[depth] = {k: v for k, v in cost.op_names.items() if k in ("where", "eq", "_foreach_copy_")}
    assert counts[1] == counts[3]
    assert counts[1]["where"] == counts[1]["eq"]  # one flat where per pass (with its comparison), none per tensor


@pytest.mark.parametrize("preset", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-master-r16"])
def test_prec_step_reaches_the_optimizer_through_at_most_five_files(preset: str) -> None:
    """One path: prec.step -> unscale -> the skip-or-step dispatch -> the optimizer, in <= 5 mixprec files."""
    prec, model, opt, iteration = _loop(preset)
    iteration()
    with prec.autocast():
        loss = model(torch.randint(0, 64, (2, 16))).float().mean()
    prec.backward(loss)
    cls = type(getattr(opt, "optimizer", opt))  # a MasterWeightOptimizer steps the torch optimizer it wraps
    files = _files_before_reaching(prec, opt, cls)
    if preset == "bf16-master-r16":
        # Its masters' storage is one more mechanism, in its own file: bf16-master's path plus the join.
        assert files.pop() == "_remainder.py", files
    assert len(files) <= 5, files
    assert files[0] == "_precision.py" and "_stepping.py" in files


def _files_before_reaching(prec: mixprec.MixedPrecision, opt: object, cls: type) -> list[str]:
    """The mixprec files ``prec.step(opt)`` calls into before the torch optimizer's ``step`` runs."""
    import sys

    seen: list[str] = []
    real_step = cls.step

    def spy(self, *args, **kwargs):
        sys.setprofile(None)
        return real_step(self, *args, **kwargs)

    def profile(frame, event, arg) -> None:
        name = frame.f_code.co_filename
        i = name.rfind("/mixprec/")
        if event == "call" and i >= 0 and name[i + 9:] not in seen:
            seen.append(name[i + 9:])

    cls.step = spy  # type: ignore[method-assign]
    sys.setprofile(profile)
    try:
        prec.step(opt)  # type: ignore[arg-type]
    finally:
        sys.setprofile(None)
        cls.step = real_step  # type: ignore[method-assign]
    return seen
