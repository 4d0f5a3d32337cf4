"""The step on a GPU (issue 26): no host sync, and the whole step captured in a CUDA graph.

CUDA only (skipped elsewhere); their CPU proxies are in ``tests/bench/test_step_cost.py``. Kept
small so the file runs in seconds on a GPU.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec

pytestmark = pytest.mark.cuda

CAPTURE_PRESETS = ["bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-pure"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 10)).cuda()


def _batches(n: int, plant: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(16, 32, device="cuda", generator=gen)
        if i == plant:
            x = x * float("inf")  # inf activations: inf/NaN gradients, the step must be skipped
        out.append((x, torch.randint(0, 10, (16,), device="cuda", generator=gen)))
    return out


def _prepared(preset: str, model: nn.Module, *, capturable: bool = False):
    prec = mixprec.MixedPrecision(preset, fused=False)  # the eager step (no Inductor compile in this file)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return (prec, *prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4,
                                                             capturable=capturable)))


@pytest.mark.parametrize("route", ["prec.step", "optimizer.step"])
@pytest.mark.parametrize("preset", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-pure"])
def test_no_sync_in_twenty_steps(preset: str, route: str) -> None:
    prec, model, opt = _prepared(preset, _model())
    batches = _batches(25, plant=10)

    def iteration(x: torch.Tensor, y: torch.Tensor) -> None:
        with prec.autocast():
            loss = F.cross_entropy(model(x).float(), y)
        prec.backward(loss)
        opt.step() if route == "optimizer.step" else prec.step(opt)
        opt.zero_grad(set_to_none=True)

    for x, y in batches[:3]:  # the first steps make the optimizer state
        iteration(x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches[3:23]:
            iteration(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(prec.applied_steps) == 22  # the planted step was skipped


def test_the_periodic_check_does_not_sync() -> None:
    prec, model, opt = _prepared("fp16-mixed", _model())
    batches = _batches(8)
    for i in range(3):
        x, y = batches[i]
        with prec.autocast():
            loss = F.cross_entropy(model(x).float(), y)
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(120):  # two periodic checks (every 50 steps by default)
            x, y = batches[i % 8]
            with prec.autocast():
                loss = F.cross_entropy(model(x).float(), y)
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _state(prec: mixprec.MixedPrecision, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    assert prec.model is not None
    out = {f"model.{k}": v.detach().clone() for k, v in prec.model.state_dict().items()}
    for i, m in enumerate(getattr(opt, "masters", [])):
        out[f"master.{i}"] = m.detach().clone()
    out["scale"] = prec.scaler.loss_scale.detach().clone()
    return out


@pytest.mark.parametrize("preset", CAPTURE_PRESETS)
def test_captured_step_replays_like_eager_steps(preset: str) -> None:
    """forward + prec.backward + prec.step in one torch.cuda.graph; N replays == N eager steps, a skipped one included."""
    base = _model()
    n, plant = 8, 4
    batches = _batches(3 + n, plant=3 + plant)

    # eager reference
    prec_e, model_e, opt_e = _prepared(preset, copy.deepcopy(base), capturable=True)
    for x, y in batches:
        with prec_e.autocast():
            loss = F.cross_entropy(model_e(x).float(), y)
        prec_e.backward(loss)
        prec_e.step(opt_e)
        opt_e.zero_grad(set_to_none=True)

    # captured: three warm-up steps on a side stream, then one captured step replayed n times
    prec, model, opt = _prepared(preset, copy.deepcopy(base), capturable=True)
    sx, sy = batches[0][0].clone(), batches[0][1].clone()

    def step() -> mixprec.StepInfo:
        with prec.autocast():
            loss = F.cross_entropy(model(sx).float(), sy)
        prec.backward(loss)
        return prec.step(opt)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in batches[:3]:
            sx.copy_(x)
            sy.copy_(y)
            step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        info = step()
    skipped = []
    for i, (x, y) in enumerate(batches[3:]):
        sx.copy_(x)
        sy.copy_(y)
        scale_before = float(prec.scaler.loss_scale)
        graph.replay()
        skipped.append(bool(info.found_inf))
        if i == plant and preset.startswith("fp16"):
            assert float(prec.scaler.loss_scale) == scale_before / 2  # backed off inside the replay
    assert skipped == [i == plant for i in range(n)]
    got, want = _state(prec, opt), _state(prec_e, opt_e)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=k)
