"""The precision audit flags silent downgrades."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec import cast_module
from mixprec.numerics import audit


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    dt = next(model.parameters()).dtype
    model(torch.randn(4, 8, dtype=dt)).float().sum().backward()
    opt.step()


def test_planted_downgrade_adamw_states_in_bf16_because_the_parameters_are() -> None:
    model = _model().to(torch.bfloat16)  # as under FSDP with BF16 parameters and no masters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    predicted = audit(model, opt)
    assert [r.detail for r in predicted.downgrades] == ["masters", "exp_avg (predicted)", "exp_avg_sq (predicted)"]
    _step(model, opt)
    res = audit(model, opt)
    states = {r.detail: r for r in res.rows_for("optimizer state")}
    assert states["exp_avg"].status == "downgrade" and states["exp_avg"].dtype == "bf16"
    assert "AdamW exp_avg in bf16 because the tensors it optimizes are bf16" in states["exp_avg"].note
    assert states["exp_avg"].tensors == 6 and states["exp_avg"].bytes == 2 * sum(p.numel() for p in model.parameters())
    assert not res.ok and len(res.downgrades) == 3
    assert "DOWNGRADE" in res.table() and "3 downgrade(s)." in str(res)
    assert json.loads(json.dumps(res.to_dict()))["downgrades"] == 3
    # normalization layers in bf16: a note without a policy, a downgrade against one that keeps them FP32
    assert res.rows_for("normalization layers")[0].status == "note"
    against = audit(model, opt, "bf16-master")
    assert against.rows_for("normalization layers")[0].status == "downgrade"
    assert "the policy keeps FP32 masters (m=f32) but this optimizer (AdamW) holds none" in against.rows_for("masters")[0].note


def test_a_clean_fp32_setup_has_no_downgrades() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    res = audit(model, opt, "fp32")
    assert res.ok, res.table()
    assert {r.component for r in res.rows} >= {"compute", "parameters", "normalization layers", "masters", "gradients",
                                                 "gradient accumulation", "optimizer state", "loss scaling",
                                                 "communication"}
    assert res.rows_for("optimizer state")[0].dtype == "f32"


def test_an_explicit_choice_is_a_note_not_a_downgrade() -> None:
    from mixprec.optim import AdamW

    model = cast_module(_model(), "bf16-pure")
    opt = AdamW(model.parameters(), lr=1e-3, compensation="kahan", state_dtype=torch.bfloat16)
    _step(model, opt)
    res = audit(model, opt)  # the policy comes from cast_module's record
    assert res.policy is not None and "comp=kahan" in res.policy
    assert res.ok, res.table()
    states = {r.detail: r for r in res.rows_for("optimizer state")}
    assert states["exp_avg"].status == "note" and "as requested (state_dtype=bf16)" in states["exp_avg"].note
    assert res.rows_for("masters")[0].note.startswith("half-precision parameters with kahan-compensated updates")


def test_master_weights_are_recognised() -> None:
    mwo = pytest.importorskip("mixprec._master", reason="MasterWeightOptimizer needs mixprec._finite")
    model = _model()
    inner = torch.optim.AdamW(model.parameters())
    cast_module(model, "bf16-master")
    opt = mwo.MasterWeightOptimizer(inner)
    _step(model, opt)
    res = audit(model, opt, "bf16-master")
    assert res.ok, res.table()
    masters = res.rows_for("masters")
    assert masters[0].dtype == "f32" and masters[0].detail == "separate copies"
    assert res.rows_for("gradient accumulation")[0].dtype == "f32"
    assert all(r.dtype == "f32" for r in res.rows_for("optimizer state"))


def test_remainder_stored_masters_are_reported_with_their_own_bytes() -> None:
    import mixprec as mp

    model = _model()
    prec = mp.MixedPrecision("bf16-master-r16")
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters()))
    _step(model, opt)
    res = audit(model, opt, prec)
    assert res.ok, res.table()
    row = res.rows_for("masters")[0]
    assert row.detail == "BF16 weight + int16 remainder" and row.dtype == "f32 (exact)"
    half = sum(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16)
    assert row.elements == half and row.bytes == 2 * half  # 2 bytes per element, not an FP32 copy's 4


@pytest.mark.distributed
def test_ddp_compression_and_fsdp2_reduce_dtype(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ddp = DDP(_model())
        assert audit(ddp).rows_for("communication")[0].status == "ok"
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        row = audit(ddp).rows_for("communication")[0]
        assert (row.dtype, row.status) == ("f16", "note") and "fp16_compress_hook" in row.note

        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = _model()
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        row = audit(model).rows_for("communication")[0]
        assert (row.dtype, row.status) == ("bf16", "downgrade") and "reduce_dtype unset" in row.note
        model = _model()
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        assert audit(model).rows_for("communication")[0].status == "ok"
    finally:
        dist.destroy_process_group()
