"""Exact model-state bytes per parameter: param + grad + compensation + optimizer states."""

import pytest
import torch

import mixprec.optim as mo

from ._util import mlp, train_step

# (optimizer, param dtype, compensation, state dtype, extra kwargs) -> bytes per parameter
TABLE = [
    ("adamw", torch.float32, "kahan", torch.float32, {}, 16),  # FP32 reference: 4 + 4 + 4 + 4
    ("adamw", torch.float32, "kahan", torch.bfloat16, {}, 12),  # no compensation for FP32 params
    ("adamw", torch.bfloat16, "kahan", torch.float32, {}, 14),  # 2 + 2 + 2 + 4 + 4
    ("adamw", torch.bfloat16, "kahan", torch.bfloat16, {}, 10),  # 2 + 2 + 2 + 2 + 2
    ("adamw", torch.bfloat16, "stochastic", torch.bfloat16, {}, 8),  # 2 + 2 + 2 + 2
    ("adamw", torch.bfloat16, "stochastic", torch.float32, {}, 12),
    ("adamw", torch.bfloat16, "none", torch.bfloat16, {}, 8),
    ("adamw", torch.float16, "kahan", torch.float32, {}, 14),
    ("adamw", torch.bfloat16, "kahan", torch.float32, {"amsgrad": True}, 18),  # + max_exp_avg_sq
    ("sgd", torch.bfloat16, "kahan", torch.float32, {"momentum": 0.9}, 10),  # 2 + 2 + 2 + 4
    ("sgd", torch.bfloat16, "kahan", torch.bfloat16, {"momentum": 0.9}, 8),
    ("sgd", torch.bfloat16, "stochastic", torch.bfloat16, {"momentum": 0.9}, 6),
    ("sgd", torch.bfloat16, "kahan", torch.float32, {}, 6),  # no momentum: no state
    ("sgd", torch.bfloat16, "stochastic", torch.float32, {}, 4),
    ("sgd", torch.float32, "none", torch.float32, {"momentum": 0.9}, 12),
]


@pytest.mark.parametrize("kind,dtype,comp,sdt,kw,expected", TABLE, ids=lambda v: str(v).replace("torch.", ""))
def test_bytes_per_parameter(kind, dtype, comp, sdt, kw, expected):
    model = mlp().to(dtype)
    cls = mo.AdamW if kind == "adamw" else mo.SGD
    opt = cls(model.parameters(), lr=1e-3, compensation=comp, state_dtype=sdt, **kw)
    train_step(model, opt, 0)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    # Count the tensors directly: every per-element tensor that belongs to a parameter.
    counted = 0
    n_scalars = 0
    for p in params:
        counted += p.numel() * p.element_size() + p.grad.numel() * p.grad.element_size()
        for v in opt.state[p].values():
            if v.dim() == 0:
                n_scalars += 1
                continue
            assert v.shape == p.shape
            counted += v.numel() * v.element_size()
    assert counted == expected * numel
    assert n_scalars == len(params)  # one 0-d FP32 step counter per parameter tensor, not per element
    mem = opt.memory_bytes()
    assert mem["numel"] == numel
    assert mem["params"] + mem["grads"] + mem["compensation"] + mem["states"] == expected * numel
    assert mem["scalars"] == 4 * len(params)
    assert mem["total"] == expected * numel + 4 * len(params)
    assert (mem["compensation"] > 0) == (comp == "kahan" and dtype != torch.float32)
