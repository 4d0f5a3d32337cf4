"""Checkpoints written by mixprec 0.1 (state version 1) still load and resume bit for bit.

``tests/data/v1_<preset>.pt`` were written by mixprec at commit e376f1a (before the state
format moved to version 2): a tiny model trained 3 AdamW steps, its ``prec.state_dict()``, and
the FP32 weights that mixprec reached after one more step from that state.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import mixprec as mp
from mixprec import checkpoint

DATA = Path(__file__).parent / "data"


def _build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


@pytest.mark.parametrize("preset", ["bf16-master", "fp16-mixed", "bf16-pure"])
def test_version_1_state_loads_and_resumes_bit_for_bit(preset: str) -> None:
    saved = torch.load(DATA / f"v1_{preset}.pt", weights_only=True)
    assert saved["state"]["version"] == 1
    model = _build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec = mp.MixedPrecision(preset)
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
    prec.load_state_dict(saved["state"])
    x, y = _batch(3)
    with prec.autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    prec.backward(loss)
    prec.step(opt)
    got = checkpoint.fp32_state_dict(prec)
    want = saved["after_one_more_step"]
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # and it saves in the current format
    assert prec.state_dict()["version"] == 2


def test_version_1_checkpoint_file_loads_through_mixprec_load() -> None:
    """The file written by mixprec 0.1's ``mp.save`` (envelope, CRC32) after the same 3 steps."""
    state = checkpoint.load(DATA / "v1_bf16-master.ckpt", expected_policy="bf16-master")
    reference = torch.load(DATA / "v1_bf16-master.pt", weights_only=True)["state"]
    assert state["version"] == 1
    for k, v in reference["model"].items():
        assert torch.equal(state["model"][k], v), k
    model = _build()
    prec = mp.MixedPrecision("bf16-master")
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
    prec.load_state_dict(state)
    exported = checkpoint.fp32_state_dict(prec)
    # the first half parameter's FP32 master comes back exactly (not rounded through BF16)
    assert torch.equal(exported["0.weight"], reference["optimizers"][0]["masters"][0])
