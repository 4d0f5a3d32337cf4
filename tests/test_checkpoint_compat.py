"""Checkpoints written by mixprec 0.1 (state version 1) still load and resume bit for bit.

``tests/data/v1_<preset>.pt`` were written by mixprec at commit e376f1a (before the state
format moved to version 2): a tiny model trained 3 AdamW steps, its ``prec.state_dict()``, and
the FP32 weights that mixprec reached after one more step from that state. Resuming the v1 state
equals resuming the same state re-saved as version 2 bit for bit; the stored weights were computed
on another CPU, so they are compared within a tolerance that a lost state would exceed.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from _trees import equal_tree  # tests/_trees.py

import mixprec as mp
from mixprec import checkpoint

DATA = Path(__file__).parent / "data"


def _build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _loaded(preset: str, state: dict) -> tuple[mp.MixedPrecision, torch.nn.Module, torch.optim.Optimizer]:
    """A fresh run of ``preset`` (the model and AdamW of the saved run) with ``state`` loaded."""
    model = _build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec = mp.MixedPrecision(preset)
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
    prec.load_state_dict(state)
    return prec, model, opt


def _resume(preset: str, state: dict) -> tuple[mp.MixedPrecision, dict[str, torch.Tensor]]:
    """Load ``state`` into a fresh run, take one more step; return the run and its FP32 weights."""
    prec, model, opt = _loaded(preset, state)
    x, y = _batch(3)
    with prec.autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    prec.backward(loss)
    prec.step(opt)
    return prec, checkpoint.fp32_state_dict(prec)


@pytest.mark.parametrize("preset", ["bf16-master", "fp16-mixed", "bf16-pure"])
def test_version_1_state_loads_and_resumes_bit_for_bit(preset: str) -> None:
    saved = torch.load(DATA / f"v1_{preset}.pt", weights_only=True)
    assert saved["state"]["version"] == 1
    kept = copy.deepcopy(saved["state"])
    v2_state = _v2_before_step(preset, saved["state"])
    prec, got = _resume(preset, saved["state"])
    # the loaded state dict is the caller's: training on does not write into it (torch's optimizer
    # load keeps same-device tensors as they are; mixprec gives the optimizer its own copies)
    assert equal_tree(saved["state"], kept)
    # Bit for bit against the same state in today's format, resumed in this process: the v1 load
    # lost nothing. (Against the weights saved by 0.1 only closely: they were computed on another
    # CPU, and FP16/BF16 kernels differ in the last bits between CPUs with and without
    # avx512_fp16/avx512_bf16.)
    current = prec.state_dict()
    assert current["version"] == 2
    _, again = _resume(preset, v2_state)
    want = saved["after_one_more_step"]
    assert got.keys() == want.keys() == again.keys()
    for k in want:
        assert torch.equal(got[k], again[k]), k
        # a lost optimizer state or loss scale moves a weight by about the LR (1e-2)
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-3, msg=k)


def _v2_before_step(preset: str, v1_state: dict) -> dict:
    """The v1 state loaded and saved again (version 2), before any step."""
    state = _loaded(preset, v1_state)[0].state_dict()
    assert state["version"] == 2
    return state


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
