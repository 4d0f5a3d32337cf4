"""Helpers shared by the mixprec.optim tests."""

from __future__ import annotations

import torch
from torch import nn

import mixprec.optim as mo

HALF = [torch.bfloat16, torch.float16]
COMPENSATIONS = ["kahan", "stochastic", "none"]


def mlp(seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)


def batch(step: int, device: str | torch.device = "cpu", n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 6, generator=g).to(device), torch.randint(0, 3, (n,), generator=g).to(device)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    for layer in model:  # each Linear in its own dtype: lets a test keep an FP32 island in a half model
        x = layer(x.to(layer.weight.dtype)) if isinstance(layer, nn.Linear) else layer(x)
    return nn.functional.cross_entropy(x.float(), y)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, device="cpu", drop_first_layer=False, **kw):
    opt.zero_grad(set_to_none=True)
    x, y = batch(step, device)
    loss_fn(model, x, y).backward()
    if drop_first_layer:  # a parameter without a gradient this step
        model[0].weight.grad = None
    opt.step(**kw)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (compare these for bit-identity, NaN and -0.0 included)."""
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def snapshot(opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Copies of every parameter and every state tensor, labelled."""
    out = []
    for gi, g in enumerate(opt.param_groups):
        for pi, p in enumerate(g["params"]):
            out.append((f"g{gi}p{pi}", p.detach().clone()))
            for k, v in sorted(opt.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    out.append((f"g{gi}p{pi}.{k}", v.detach().clone()))
    return out


def assert_bit_identical(a, b) -> None:
    assert [k for k, _ in a] == [k for k, _ in b]
    for (k, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(bits(x), bits(y)), f"{k} differs"


def make(kind: str, params, **kw) -> mo.LowPrecisionOptimizer:
    cls = {"adamw": mo.AdamW, "adam": mo.Adam, "sgd": mo.SGD}[kind]
    defaults = {"adamw": {"lr": 1e-2, "weight_decay": 0.1}, "adam": {"lr": 1e-2, "weight_decay": 0.1},
                "sgd": {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}}[kind]
    return cls(params, **{**defaults, **kw})
