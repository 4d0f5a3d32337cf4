"""The behaviours torch's own GradScaler tests cover, run on torch.amp.GradScaler("cpu") and mixprec.GradScaler.

torch tests its scaler (test/test_torch.py, test/test_cuda.py: ``test_grad_scaling_*``,
``test_pickle_gradscaler``, ...) for: the fused check-and-unscale on every gradient layout and
dtype, sparse gradients (FP16 ones coalesced before the check), state dicts loaded before and
after the lazy creation of the scale, pickling, a scale that must not grow to inf, gradients
broken after ``unscale_``, and training loops (clipping with and without ``unscale_``, a gradient
penalty, gradient accumulation, two models with two losses and two optimizers, every optimizer
on its foreach and fused paths) whose scaled run must match an unscaled control run that skips
the same iteration. These tests are ours: every scenario runs on both classes and must give the
same results bit for bit (and, for the loops, the control run's parameters), plus pickling at
every point of an iteration under FP32, FP16 and BF16 gradients.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.amp.grad_scaler import OptState

from mixprec import GradScaler

TorchGradScaler = torch.amp.GradScaler
CLASSES = (TorchGradScaler, GradScaler)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (so NaN equals the same NaN)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
                                    for x, y in zip(a, b))


def flag_sum(scaler: Any, opt: torch.optim.Optimizer) -> float:
    return float(sum(v.item() for v in scaler._found_inf_per_device(opt).values()))


def started(cls: type, init_scale: float = 4.0, **kw: Any) -> Any:
    """A scaler whose scale exists (torch creates it lazily, in the first scale())."""
    s = cls("cpu", init_scale=init_scale, **kw)
    s.scale(torch.ones(()))
    return s


# --------------------------------------------------------------------------------------------------
# unscale_: every gradient layout, inf and NaN found wherever they are
# --------------------------------------------------------------------------------------------------
LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda g: g.clone(),
    "transposed": lambda g: g.clone().t(),  # not contiguous, still dense
    "column-slice": lambda g: g.clone()[:, :5],  # not dense: the kernel's per-tensor path
    "rows-of-transposed": lambda g: g.clone().t()[2:7],
}
PAIRS = [("contiguous", "contiguous"), ("contiguous", "transposed"), ("contiguous", "column-slice"),
         ("column-slice", "column-slice"), ("transposed", "rows-of-transposed")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_unscale_any_layout(pair: tuple[str, str], dtype: torch.dtype) -> None:
    base = torch.full((12, 12), 8.0, dtype=dtype)
    for poison, where in [(None, 0), (math.inf, 0), (math.inf, 1), (math.nan, 0), (math.nan, 1), (-math.inf, 1)]:
        seen = []
        for cls in CLASSES:
            grads = [LAYOUTS[name](base) for name in pair]
            if poison is not None:
                grads[where][2, 1] = poison
            params = [nn.Parameter(torch.zeros(g.shape, dtype=dtype)) for g in grads]
            for p, g in zip(params, grads):
                p.grad = g
            opt = torch.optim.SGD(params, lr=1.0)
            s = started(cls, init_scale=8.0)
            assert s.unscale_(opt) is None or cls is GradScaler
            seen.append((flag_sum(s, opt), [p.grad.clone() for p in params], [p.grad.stride() for p in params]))
        (flag_t, grads_t, strides_t), (flag_o, grads_o, strides_o) = seen
        assert flag_t == flag_o == (0.0 if poison is None else 1.0), (poison, where)
        assert strides_t == strides_o and same_tensors(grads_t, grads_o)
        if poison is None:
            assert all(bool((g == 1).all()) for g in grads_o)


def _storm(inject: int) -> list[torch.Tensor]:
    """FP32, a non-dense FP32 slice, FP16, a non-dense FP16 slice and BF16 gradients; inf in one of them."""
    g = torch.full((10, 10), 4.0)
    grads = [g.clone(), g.clone()[:, :5], g.half(), g.half()[:, :5], g.bfloat16()]
    if inject >= 0:
        grads[inject][2, 2] = math.inf
    return grads


@pytest.mark.parametrize("inject", range(-1, 5), ids=["clean", "fp32", "fp32-slice", "fp16", "fp16-slice", "bf16"])
def test_unscale_grads_helper_mixed_dtypes(inject: int) -> None:
    """torch's private _unscale_grads_ (its own tests and subclasses call it): same flags, same gradients."""
    seen = []
    for cls in CLASSES:
        grads = _storm(inject)
        params = [torch.empty_like(g) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.SGD(params, lr=1.0)
        found = torch.zeros(1)
        per_device = cls("cpu")._unscale_grads_(opt, torch.full((1,), 0.25), found, True)
        assert found.item() == 0.0  # the flags are copies: what was passed stays as it was
        seen.append((per_device, [p.grad for p in params]))
    (dev_t, grads_t), (dev_o, grads_o) = seen
    assert list(dev_t) == list(dev_o) == [torch.device("cpu")]
    assert same_tensors(list(dev_t.values()), list(dev_o.values()))
    assert dev_o[torch.device("cpu")].item() == (0.0 if inject < 0 else 1.0)
    assert same_tensors(grads_t, grads_o)
    if inject < 0:
        assert all(bool((g == 1).all()) for g in grads_o)


@pytest.mark.parametrize("inject", range(-1, 5), ids=["clean", "fp32", "fp32-slice", "fp16", "fp16-slice", "bf16"])
def test_check_inf_per_device_takes_fp16_and_leaves_grads(inject: int) -> None:
    seen = []
    for cls in CLASSES:
        grads = _storm(inject)
        params = [torch.empty_like(g) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.SGD(params, lr=1.0)
        s = started(cls)
        returned = s._check_inf_per_device(opt)
        assert s._found_inf_per_device(opt) is returned
        seen.append(([v.clone() for v in returned.values()], [p.grad.clone() for p in params]))
    assert same_tensors(seen[0][0], seen[1][0]) and seen[1][0][0].item() == (0.0 if inject < 0 else 1.0)
    assert same_tensors(seen[0][1], seen[1][1]) and same_tensors(seen[1][1], _storm(inject))  # checked, not unscaled


def test_unscale_refuses_fp16_grads_and_changes_nothing() -> None:
    seen = []
    for cls in CLASSES:
        grads = _storm(-1)
        params = [torch.empty_like(g) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.SGD(params, lr=1.0)
        s = started(cls)
        with pytest.raises(ValueError) as e:
            s.unscale_(opt)
        with pytest.raises(ValueError) as e2:
            s._unscale_grads_(opt, torch.full((1,), 0.25), torch.zeros(1), False)
        assert s._per_optimizer_states[id(opt)]["stage"] is OptState.READY  # the next unscale_ may try again
        seen.append((str(e.value), str(e2.value), [p.grad for p in params]))
    assert seen[0][0] == seen[0][1] == "Attempting to unscale FP16 gradients."
    assert seen[1][0].startswith(seen[0][0]) and seen[1][1] == seen[1][0]
    assert same_tensors(seen[0][2], seen[1][2]) and same_tensors(seen[1][2], _storm(-1))


# --------------------------------------------------------------------------------------------------
# sparse gradients
# --------------------------------------------------------------------------------------------------
def _sparse(values: list[float], dtype: torch.dtype = torch.float32,
            indices: tuple[tuple[int, ...], ...] = ((0, 1, 1), (2, 0, 2))) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor(indices), torch.tensor(values), (2, 3), dtype=dtype,
                                   check_invariants=True)


@pytest.mark.parametrize("values, found", [([16.0, 32.0, 64.0], 0.0), ([16.0, 32.0, math.inf], 1.0),
                                           ([16.0, math.nan, 64.0], 1.0)], ids=["finite", "inf", "nan"])
def test_unscale_sparse_fp32(values: list[float], found: float) -> None:
    seen = []
    for cls in CLASSES:
        p = nn.Parameter(torch.zeros(2, 3))
        p.grad = _sparse(values)
        opt = torch.optim.SGD([p], lr=1.0)
        s = started(cls, init_scale=4.0)
        s.unscale_(opt)
        seen.append((flag_sum(s, opt), p.grad.to_dense()))
    assert seen[0][0] == seen[1][0] == found
    assert same_tensors([seen[0][1]], [seen[1][1]])
    if not found:
        assert torch.equal(seen[1][1], _sparse(values).to_dense() / 4)


def test_sparse_fp16_is_coalesced_before_the_check() -> None:
    """Duplicate indices: each 64000 fits in FP16, their sum does not; the check must see the sum."""
    seen = []
    for cls in CLASSES:
        p = nn.Parameter(torch.zeros(2, 3, dtype=torch.float16))
        p.grad = _sparse([64000.0, 32.0, 64000.0], torch.float16, ((0, 1, 0), (2, 0, 2)))
        assert not p.grad.is_coalesced()
        opt = torch.optim.SGD([p], lr=1.0)
        s = started(cls)
        s._check_inf_per_device(opt)
        coalesced = p.grad.is_coalesced()
        # and a finite FP16 sparse gradient unscales through the helper
        p.grad = _sparse([16.0, 32.0, 64.0], torch.float16)
        per_device = s._unscale_grads_(opt, torch.full((1,), 0.25), torch.zeros(1), True)
        seen.append((flag_sum(s, opt), coalesced, per_device[torch.device("cpu")].item(), p.grad.to_dense()))
    assert seen[0][:3] == seen[1][:3] == (1.0, True, 0.0)
    assert same_tensors([seen[0][3]], [seen[1][3]])
    assert torch.equal(seen[1][3], _sparse([4.0, 8.0, 16.0], torch.float16).to_dense())


# --------------------------------------------------------------------------------------------------
# state dicts and pickling around the lazy creation of the scale
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lazy_init", [False, True], ids=["before-first-scale", "after-first-scale"])
def test_load_state_dict_before_and_after_the_scale_exists(lazy_init: bool) -> None:
    seen = []
    for cls in CLASSES:
        src = cls("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        dst = cls("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
        dst._init_growth_tracker = 7  # to be overwritten by the load
        if lazy_init:
            dst.scale(torch.full((1,), 4.0))
            assert isinstance(dst._scale, torch.Tensor) and dst._scale.dtype == torch.float32
        dst.load_state_dict(src.state_dict())
        got = [dst.get_scale(), dst.get_growth_factor(), dst.get_backoff_factor(), dst.get_growth_interval(),
               dst._init_growth_tracker, dst._get_growth_tracker(), dst.state_dict()]
        # and it goes on with the loaded rule: two clean iterations grow 3 -> 12
        p = nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.0)
        for _ in range(3):
            dst.scale(p.sum()).backward()
            dst.step(opt)
            dst.update()
            got.append((dst.get_scale(), dst._get_growth_tracker()))
        seen.append(got)
    assert seen[0] == seen[1]
    assert seen[1][:6] == [3.0, 4.0, 0.5, 2, 0, 0] and seen[1][7:] == [(3.0, 1), (12.0, 0), (12.0, 1)]


@pytest.mark.parametrize("lazy_init", [False, True], ids=["before-first-scale", "after-first-scale"])
@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_pickle_before_and_after_the_scale_exists(lazy_init: bool, enabled: bool) -> None:
    seen = []
    for cls in CLASSES:
        a = cls("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2, enabled=enabled)
        if lazy_init:
            a.scale(torch.tensor([4.0]))
        b = pickle.loads(pickle.dumps(a))
        got: list[Any] = [b.is_enabled() == a.is_enabled(), b.is_enabled()]
        if b.is_enabled():
            got += [b.get_scale(), b.get_growth_factor(), b.get_backoff_factor(), b.get_growth_interval(),
                    b._init_growth_tracker, b._per_optimizer_states["any-key"]]  # the defaultdict's factory survived
            got.append(b.scale(torch.tensor([4.0])).tolist())
            got.append(b._scale.device)
        else:
            got += [b.get_scale(), b.state_dict(), b.scale(torch.tensor([4.0])).tolist()]
        seen.append(got)
    assert seen[0] == seen[1]
    if enabled:
        assert seen[1][2:] == [3.0, 4.0, 0.5, 2, 0, {"stage": OptState.READY, "found_inf_per_device": {}}, [12.0],
                               torch.device("cpu")]


@pytest.mark.parametrize("outputs", ["tensor", "list"])
def test_init_attributes_written_before_the_first_scale_are_what_it_starts_from(outputs: str) -> None:
    """torch creates its scale and growth tracker from _init_scale and _init_growth_tracker, read at the first scale()."""
    seen = []
    for cls in CLASSES:
        s = cls("cpu", growth_interval=4)
        s._init_scale, s._init_growth_tracker = 8.0, 3
        got: list[Any] = [s.get_scale(), s._get_growth_tracker()]
        p = nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.0)
        scaled = s.scale(p.sum()) if outputs == "tensor" else s.scale([p.sum()])[0]
        got.append(scaled.item())
        scaled.backward()
        s.step(opt)
        s.update()  # the 4th clean step: growth
        got += [s.get_scale(), s._get_growth_tracker()]
        seen.append(got)
    assert seen[0] == seen[1] == [8.0, 3, 16.0, 16.0, 0]  # the loss is 2: scaled by 8


def test_the_scale_never_grows_to_inf() -> None:
    seen = []
    for cls in CLASSES:
        torch.manual_seed(0)
        model = nn.Linear(5, 1)
        opt = torch.optim.Adam(model.parameters())
        s = cls("cpu", init_scale=1e38, growth_factor=2.0**4, growth_interval=1)
        x, y = torch.randn(1, 5), 1e-30 * torch.randn(1, 1)
        s.scale((model(x) - y).square().mean()).backward()
        s.step(opt)
        s.update()
        seen.append((s.get_scale(), s._get_growth_tracker(), [p.clone() for p in model.parameters()]))
    assert seen[0][:2] == seen[1][:2] and math.isfinite(seen[1][0]) and seen[1][0] == pytest.approx(1e38, rel=1e-6)
    assert same_tensors(seen[0][2], seen[1][2])


# --------------------------------------------------------------------------------------------------
# training loops: torch's scaler, ours, and an unscaled control run that skips the same iteration
# --------------------------------------------------------------------------------------------------
N_ITERS = 6
SKIP = 3  # the iteration with an inf planted in a gradient (an optimizer step at every loop shape below)
MAX_NORM = 0.2
ACCUMULATE = 2
INIT_SCALE = 128.0


def expected_scales() -> list[float]:
    """The schedule with growth_interval=1: double on every clean step, halve on the skipped one."""
    out, scale = [], INIT_SCALE
    for i in range(N_ITERS):
        scale = scale / 2 if i == SKIP else scale * 2
        out.append(scale)
    return out


def _make_opt(kind: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    name, _, path = kind.partition("-")
    flags: dict[str, Any] = {"foreach": False} if not path else {path: True}
    ctor: dict[str, Callable[..., torch.optim.Optimizer]] = {
        "sgd": lambda **kw: torch.optim.SGD(params, lr=0.05, momentum=0.9, **kw),
        "adam": lambda **kw: torch.optim.Adam(params, lr=1e-2, **kw),
        "adamw": lambda **kw: torch.optim.AdamW(params, lr=1e-2, **kw),
        "amsgrad": lambda **kw: torch.optim.Adam(params, lr=1e-2, amsgrad=True, **kw),
        "adagrad": lambda **kw: torch.optim.Adagrad(params, lr=0.05, **kw),
        "rmsprop": lambda **kw: torch.optim.RMSprop(params, lr=1e-2, **kw),
        "adadelta": lambda **kw: torch.optim.Adadelta(params, **kw),
        "adamax": lambda **kw: torch.optim.Adamax(params, lr=1e-2, **kw),
        "nadam": lambda **kw: torch.optim.NAdam(params, lr=1e-2, **kw),
        "radam": lambda **kw: torch.optim.RAdam(params, lr=1e-2, **kw),
        "asgd": lambda **kw: torch.optim.ASGD(params, lr=0.05, **kw),
        "rprop": lambda **kw: torch.optim.Rprop(params, lr=1e-2, **kw),
    }
    return ctor[name](**flags)


ALL_OPTIMIZERS = [f"{name}{path}" for name in ("sgd", "adam", "adamw", "amsgrad", "adagrad")
                  for path in ("", "-foreach", "-fused")]
ALL_OPTIMIZERS += [f"{name}{path}" for name in ("rmsprop", "adadelta", "adamax", "nadam", "radam", "asgd", "rprop")
                   for path in ("", "-foreach")]


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(N_ITERS)]


def _models(n: int, dtype: torch.dtype) -> list[nn.Sequential]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).to(dtype) for _ in range(n)]


def _plant_inf(model: nn.Sequential) -> None:
    model[2].weight.grad.fill_(math.inf)


def train(shape: str, cls: type | None, opt_kind: str, dtype: torch.dtype = torch.float32,
          autocast: torch.dtype | None = None) -> tuple[list[torch.Tensor], list[float]]:
    """One loop shape; ``cls=None`` is the control run (no scaling, the SKIP iteration's step left out)."""
    models = _models(2 if shape == "two-models" else 1, dtype)
    opts = [_make_opt(opt_kind, list(m.parameters())) for m in models]
    s = cls("cpu", init_scale=INIT_SCALE, growth_interval=1) if cls is not None else None
    params = [p for m in models for p in m.parameters()]
    scales: list[float] = []

    def forward(x: torch.Tensor) -> list[torch.Tensor]:
        x = x.to(dtype)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            return [m(x).float() for m in models]

    def scaled(loss: torch.Tensor) -> torch.Tensor:
        return s.scale(loss) if s is not None else loss

    def finish(i: int, planted: list[nn.Sequential]) -> None:
        if s is None:
            for m, opt in zip(models, opts):
                if not (i == SKIP and m in planted):
                    opt.step()
            return
        if i == SKIP:
            for m in planted:
                _plant_inf(m)
        if shape == "clip":  # clip the scaled gradients, without unscale_
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM * s.get_scale())
        elif shape == "unscale-clip":
            s.unscale_(opts[0])
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM, error_if_nonfinite=False)
        elif shape == "two-models":
            s.unscale_(opts[0])  # one optimizer unscaled separately, the other by step()
        for opt in opts:
            s.step(opt)
        s.update()
        scales.append(s.get_scale())

    for i, (x, y) in enumerate(_data()):
        if shape == "accumulate":  # two half-batches per iteration, one step
            for half in (slice(0, 2), slice(2, 4)):
                (out,) = forward(x[half])
                scaled(F.mse_loss(out, y[half]) / ACCUMULATE).backward()
            finish(i, models)
        elif shape == "two-models":
            out0, out1 = forward(x)
            loss0 = F.mse_loss(0.3 * out0 + 0.7 * out1, y)
            loss1 = F.mse_loss(0.6 * out0 - 0.4 * out1, y)
            scaled(loss0).backward(retain_graph=True)
            scaled(loss1).backward()
            finish(i, models[1:])  # the inf lands in the second model only: the first one steps
        elif shape == "penalty":
            (out,) = forward(x)
            loss = F.mse_loss(out, y)
            grads = torch.autograd.grad(scaled(loss), params, create_graph=True)
            inv = 1.0 / s.get_scale() if s is not None else 1.0
            penalty = torch.stack([(g * inv).square().sum() for g in grads]).sum().sqrt()
            scaled(loss + penalty).backward()
            finish(i, models)
        else:
            (out,) = forward(x)
            scaled(F.mse_loss(out, y)).backward()
            if s is None and shape in ("clip", "unscale-clip"):
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            finish(i, models)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in params], scales


def check_loop(shape: str, opt_kind: str, dtype: torch.dtype = torch.float32, autocast: torch.dtype | None = None,
               rtol: float | None = None, atol: float | None = None) -> None:
    p_torch, s_torch = train(shape, TorchGradScaler, opt_kind, dtype, autocast)
    p_ours, s_ours = train(shape, GradScaler, opt_kind, dtype, autocast)
    assert s_ours == s_torch == expected_scales()
    assert same_tensors(p_ours, p_torch), "parameters differ from torch's"
    p_control, _ = train(shape, None, opt_kind, dtype, autocast)
    torch.testing.assert_close(p_ours, p_control, rtol=rtol, atol=atol)
    # the steps did move the parameters
    assert not same_tensors(p_ours, [p.detach() for m in _models(len(p_ours) // 4, dtype) for p in m.parameters()])


@pytest.mark.parametrize("opt_kind", ALL_OPTIMIZERS)
def test_every_optimizer_matches_torch_and_the_control_run(opt_kind: str) -> None:
    check_loop("plain", opt_kind)


SHAPE_OPTIMIZERS = ["sgd", "adam-foreach", "adam-fused", "adagrad-fused"]


@pytest.mark.parametrize("opt_kind", SHAPE_OPTIMIZERS)
@pytest.mark.parametrize("shape", ["clip", "unscale-clip", "penalty", "accumulate", "two-models"])
def test_loop_shapes_match_torch_and_the_control_run(shape: str, opt_kind: str) -> None:
    check_loop(shape, opt_kind)


@pytest.mark.parametrize("opt_kind", ["sgd", "adamw-foreach", "adamw-fused"])
@pytest.mark.parametrize("grads", ["fp16-autocast", "bf16-autocast", "bf16-params"])
@pytest.mark.parametrize("shape", ["plain", "unscale-clip", "two-models"])
def test_low_precision_loops_match_torch(shape: str, grads: str, opt_kind: str) -> None:
    if grads == "bf16-params":
        # BF16 gradients unscale exactly by a power of two; the control differs by BF16 rounding only
        check_loop(shape, opt_kind, dtype=torch.bfloat16, rtol=2e-2, atol=1e-2)
    else:
        # scaled FP16/BF16 activation gradients round differently from unscaled ones: close, not equal
        check_loop(shape, opt_kind, autocast=torch.float16 if grads == "fp16-autocast" else torch.bfloat16,
                   rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("opt_kind", ["sgd", "adam-foreach", "adam-fused", "adamw-fused", "adagrad-fused"])
def test_grads_broken_after_unscale_are_not_checked_again(opt_kind: str) -> None:
    """unscale_ recorded "finite"; gradients made inf/NaN afterwards are stepped with (as torch)."""
    seen = []
    for cls in CLASSES:
        (model,) = _models(1, torch.float32)
        opt = _make_opt(opt_kind, list(model.parameters()))
        s = cls("cpu", init_scale=INIT_SCALE)
        x, y = _data()[0]
        s.scale(F.mse_loss(model(x), y)).backward()
        s.unscale_(opt)
        for j, p in enumerate(model.parameters()):
            p.grad.fill_(math.inf if j % 2 else math.nan)
        s.step(opt)
        s.update()
        seen.append(([p.detach().clone() for p in model.parameters()], s.get_scale(), s._get_growth_tracker()))
    assert seen[0][1:] == seen[1][1:] == (INIT_SCALE, 1)
    assert same_tensors(seen[0][0], seen[1][0])
    assert all(not bool(p.isfinite().all()) for p in seen[1][0])


# --------------------------------------------------------------------------------------------------
# pickling at every point of an iteration continues the exact schedule (issue 13's case: 512, not 256)
# --------------------------------------------------------------------------------------------------
STAGES = ("before_scale", "after_scale", "after_backward", "after_unscale", "after_step", "after_update")
REFUSED = ("after_unscale", "after_step")  # torch refuses to pickle between unscale_/step and update: so do we


def _round_trip(scaler: Any, via: str) -> Any:
    if via == "pickle":
        return pickle.loads(pickle.dumps(scaler))
    if via == "deepcopy":
        return copy.deepcopy(scaler)
    buf = io.BytesIO()
    torch.save(scaler, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _schedule_run(cls: type, stage: str | None, via: str, grads: str) -> dict[str, Any]:
    """growth_interval=2, 10 iterations, an inf planted at iteration 3: uninterrupted, the scale ends at 512."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if grads == "bf16-params" else torch.float32
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    s = cls("cpu", init_scale=64.0, growth_interval=2)
    autocast = {"fp16-autocast": torch.float16, "bf16-autocast": torch.bfloat16}.get(grads)
    refusals: list[tuple[int, str, type, str]] = []
    scales = []

    def at(point: str, i: int) -> None:
        nonlocal s
        if point != stage:
            return
        try:
            s = _round_trip(s, via)
        except Exception as e:  # the original scaler carries on, as a caller's except clause would
            refusals.append((i, point, type(e), str(e)))

    g = torch.Generator().manual_seed(1)
    for i in range(10):
        x = torch.randn(6, 4, generator=g).to(dtype)
        at("before_scale", i)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(x).float().square().mean()
        scaled = s.scale(loss)
        at("after_scale", i)
        scaled.backward()
        if i == 3:
            model[0].weight.grad[0, 0] = math.inf
        at("after_backward", i)
        s.unscale_(opt)
        at("after_unscale", i)
        s.step(opt)
        at("after_step", i)
        s.update()
        at("after_update", i)
        opt.zero_grad(set_to_none=True)
        scales.append((s.get_scale(), s._get_growth_tracker()))
    return {"scales": scales, "params": [p.detach().clone() for p in model.parameters()],
            "state": s.state_dict(), "refusals": refusals}


@pytest.mark.parametrize("grads", ["fp32", "fp16-autocast", "bf16-autocast", "bf16-params"])
@pytest.mark.parametrize("via", ["pickle", "deepcopy", "torch.save"])
@pytest.mark.parametrize("stage", STAGES)
def test_round_trip_at_any_stage_continues_the_exact_schedule(stage: str, via: str, grads: str) -> None:
    reference = _schedule_run(TorchGradScaler, None, via, grads)
    assert reference["scales"][-1] == (512.0, 0)
    ours = _schedule_run(GradScaler, stage, via, grads)
    assert ours["scales"] == reference["scales"]
    assert same_tensors(ours["params"], reference["params"])
    assert ours["state"] == reference["state"]
    if stage in REFUSED:
        torch_refusals = _schedule_run(TorchGradScaler, stage, via, grads)["refusals"]
        assert len(torch_refusals) == len(ours["refusals"]) == 10
        for (_, _, t_type, t_msg), (_, _, o_type, o_msg) in zip(torch_refusals, ours["refusals"]):
            assert issubclass(o_type, t_type) and o_msg == t_msg
    else:
        assert ours["refusals"] == []
    if stage in ("before_scale", "after_update"):  # where torch's own copy carries on too
        assert _schedule_run(TorchGradScaler, stage, via, grads)["scales"] == reference["scales"]


def test_state_dict_round_trip_at_each_update_continues_the_exact_schedule() -> None:
    """A checkpoint written after every update() and loaded into a fresh scaler of the other class."""
    runs = {}
    for src, dst in [(GradScaler, TorchGradScaler), (TorchGradScaler, GradScaler), (GradScaler, GradScaler)]:
        p = nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.0)
        s: Any = src("cpu", init_scale=64.0, growth_interval=2)
        seq = []
        for i in range(10):
            s.scale(p.sum()).backward()
            if i == 3:
                p.grad[0] = math.inf
            s.step(opt)
            s.update()
            opt.zero_grad()
            fresh = dst("cpu")
            fresh.load_state_dict(s.state_dict())
            s, src, dst = fresh, dst, src
            seq.append((s.get_scale(), s._get_growth_tracker()))
        runs[(src, dst)] = seq
    first = next(iter(runs.values()))
    assert all(seq == first for seq in runs.values()) and first[-1] == (512.0, 0)


# --------------------------------------------------------------------------------------------------
# CUDA: the scale on the first output's device, copies to the others; a CUDA scaler pickled mid-run
# --------------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_scale_outputs_on_several_devices_like_torch() -> None:
    seen = []
    for cls in CLASSES:
        s = cls("cuda", init_scale=2.0)
        cuda, cpu = torch.full((1,), 4.0, device="cuda"), torch.full((1,), 4.0)
        out = s.scale((cuda.clone(), (cpu.clone(), cuda.clone()), [cpu.clone(), (cuda.clone(), cpu.clone())]))
        flat = [out[0], *out[1], out[2][0], *out[2][1]]
        seen.append(([(t.item(), t.device) for t in flat], s._scale.device))
    assert seen[0] == seen[1]
    assert all(v == 8.0 for v, _ in seen[1][0]) and seen[1][1].type == "cuda"


@pytest.mark.cuda
@pytest.mark.parametrize("stage", ["after_scale", "after_backward", "after_update"])
def test_cuda_fused_round_trip_continues_the_exact_schedule(stage: str) -> None:
    def run(cls: type, pickle_at: str | None) -> tuple[list[tuple[float, int]], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Linear(8, 8, device="cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        s = cls("cuda", init_scale=64.0, growth_interval=2)
        seq = []
        for i in range(10):
            with torch.autocast("cuda", dtype=torch.float16):
                scaled = s.scale(model(torch.ones(4, 8, device="cuda")).float().square().mean())
            if pickle_at == "after_scale":
                s = pickle.loads(pickle.dumps(s))
            scaled.backward()
            if i == 3:
                model.weight.grad[0, 0] = math.inf
            if pickle_at == "after_backward":
                s = pickle.loads(pickle.dumps(s))
            s.step(opt)
            s.update()
            if pickle_at == "after_update":
                s = pickle.loads(pickle.dumps(s))
            opt.zero_grad()
            seq.append((s.get_scale(), s._get_growth_tracker()))
        return seq, [p.detach().cpu() for p in model.parameters()]

    ref_seq, ref_params = run(TorchGradScaler, None)
    seq, params = run(GradScaler, stage)
    assert seq == ref_seq and ref_seq[-1] == (512.0, 0)
    assert same_tensors(params, ref_params)
