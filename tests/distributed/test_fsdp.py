"""FSDP2 (fully_shard) on two CPU processes (gloo): sharded DTensor gradients unscale, the scaler agrees.

One pair of processes runs every scenario; the single-process references (plain
``MixedPrecision`` with the same policy) run in the pytest process.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from mixprec import MixedPrecision

from . import _common as c

POLICIES = ["bf16-mixed", "fp16-mixed", "fp16-master", "bf16-master"]
TOL = {"bf16": 3e-3, "fp16": 5e-4}


def _run(policy: str, rank: int, world: int) -> dict[str, Any]:
    from mixprec.distributed import fully_shard

    prec = c.make_prec(policy)
    model = c.make_model()
    if world > 1:
        fully_shard(model, policy)  # before the optimizer: FSDP2 replaces the parameters by DTensors
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    out = c.train(prec, model, opt, rank=rank, world=world)
    out["params"] = c.fp32_params(prec, model)
    out["optimizer"] = type(opt).__name__
    return out


R16 = "bf16-master-r16"


def _run_r16(rank: int, world: int) -> dict[str, Any]:
    """bf16-master-r16 under FSDP2: BF16 shards plus sharded int16 remainders, a MasterWeightOptimizer over AdamW."""
    from mixprec._master import MasterWeightOptimizer
    from mixprec.distributed import fully_shard

    prec = c.make_prec(R16, grad_accumulation="compute")
    model = c.make_model()
    if world > 1:
        fully_shard(model, R16)
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    assert isinstance(opt, MasterWeightOptimizer)
    out = c.train(prec, model, opt, rank=rank, world=world)
    out["params"] = c.fp32_params(prec, model)
    local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    out["dtypes"] = [str(p.dtype) for p in local]
    out["remainder_rows"] = [None if r is None else list(r.shape) for r in opt.remainders]
    out["weight_rows"] = [list(p.shape) for p in local]
    # Bytes this rank holds per parameter of the model between backward and step (the most: BF16
    # gradients on the shards), each storage once: shards, gradients, remainders, AdamW states.
    with prec.autocast():
        loss = model(c.rows(0, 0, 1, rank, world)[0]).float().square().mean()
    prec.backward(loss)
    seen: dict[int, int] = {}
    tensors = [*model.parameters(), *(p.grad for p in model.parameters()), *(r for r in opt.remainders if r is not None),
               *(v for st in opt.state.values() for v in st.values())]
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = getattr(t, "_local_tensor", t).untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    out["bytes_per_param"] = sum(seen.values()) / sum(p.numel() for p in model.parameters())
    prec.step(opt)
    return out


def _run_r16_dcp(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """bf16-master-r16 under FSDP2: 2 steps, DCP save, 2 more; a fresh run loads the save and does the same 2."""
    import torch.distributed.checkpoint as dcp

    from mixprec.distributed import fully_shard

    def build() -> tuple[Any, Any, Any]:
        prec = c.make_prec(R16, grad_accumulation="compute")
        model = fully_shard(c.make_model(), R16)
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05))
        return prec, model, opt

    def steps(prec: Any, model: Any, opt: Any, which: range) -> None:
        for step in which:
            x, y = c.rows(step, 0, 1, rank, world)
            with prec.autocast():
                pred = model(x)
            prec.backward(torch.nn.functional.mse_loss(pred.float(), y))
            prec.step(opt)
            opt.zero_grad(set_to_none=True)

    def local_state(model: Any, opt: Any) -> list[torch.Tensor]:
        return ([getattr(p, "_local_tensor", p).detach().clone() for p in model.parameters()]
                + [r.clone() for r in opt.remainders if r is not None])

    prec, model, opt = build()
    steps(prec, model, opt, range(2))
    dcp.save(prec.state_dict(), checkpoint_id=ckpt)
    steps(prec, model, opt, range(2, 4))
    ref = local_state(model, opt)
    prec2, model2, opt2 = build()
    # torch's AdamW creates its states at its first step: take one (docs/distributed.md), then everything is loaded over it.
    steps(prec2, model2, opt2, range(7, 8))
    sd = prec2.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)  # in place, each rank reads its shards
    prec2.load_state_dict(sd)
    steps(prec2, model2, opt2, range(2, 4))
    got = local_state(model2, opt2)
    return {"bitwise": len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got)), "n": len(ref)}


def _error(fn: Any) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _worker(rank: int, port: int, out_dir: str) -> None:
    c.init(rank, port)
    warnings.simplefilter("ignore")
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from mixprec.distributed import fsdp_mixed_precision, fully_shard

    results: dict[str, Any] = {p: _run(p, rank, c.WORLD) for p in POLICIES}
    results[R16] = _run_r16(rank, c.WORLD)
    results["r16_dcp"] = _run_r16_dcp(rank, c.WORLD, str(Path(out_dir) / "r16_ckpt"))

    def pure_island_not_sharded() -> None:  # bf16-pure: the FP32 LayerNorm needs an FSDP2 group of its own
        m = torch_fully_shard(c.make_model(), mp_policy=fsdp_mixed_precision("bf16-pure", root=True))
        MixedPrecision("bf16-pure").prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))

    def wrong_fsdp_policy() -> None:  # FSDP2 computes in bf16 but the run says fp16-master
        m = torch_fully_shard(c.make_model(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        MixedPrecision("fp16-master").prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))

    def island_not_sharded() -> None:  # the LayerNorm would be gathered in fp16 with its parent
        m = torch_fully_shard(c.make_model(), mp_policy=fsdp_mixed_precision("fp16-master", root=True))
        MixedPrecision("fp16-master").prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))

    def compute_accumulation() -> None:
        m = fully_shard(c.make_model(), "bf16-master")
        MixedPrecision("bf16-master", grad_accumulation="compute").prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))

    def r16_fp32_accumulation() -> None:  # BF16 shards: FSDP2 accumulates BF16 gradients
        m = fully_shard(c.make_model(), R16)
        MixedPrecision(R16).prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))

    def r16_grad_edited_after_unscale() -> None:  # the step would use the FP32 copy taken at unscale_
        m = fully_shard(c.make_model(), R16)
        prec = MixedPrecision(R16, grad_accumulation="compute")
        m, o = prec.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
        with prec.autocast():
            loss = m(c.rows(0, 0, 1, rank, c.WORLD)[0]).float().square().mean()
        prec.backward(loss)
        prec.unscale_(o)
        next(m.parameters()).grad.mul_(0.5)
        prec.step(o)

    def pure_forward_before_prepare() -> None:  # FSDP2 sized its gather buffers for FP32 shards
        m = fully_shard(c.make_model(), "bf16-pure")
        m(torch.randn(2, 6))
        MixedPrecision("bf16-pure").prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))

    for fn in (pure_island_not_sharded, pure_forward_before_prepare, wrong_fsdp_policy, island_not_sharded, compute_accumulation,
               r16_fp32_accumulation, r16_grad_edited_after_unscale):
        results[fn.__name__] = _error(fn)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    c.finish()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return c.spawn(_worker, tmp_path_factory.mktemp("fsdp"))


@pytest.mark.parametrize("policy", POLICIES)
def test_fsdp2_matches_single_process(ranks: list[dict[str, Any]], policy: str) -> None:
    r0, r1 = ranks[0][policy], ranks[1][policy]
    expected_skips = [s == c.POISON_STEP for s in range(c.STEPS)]
    # only rank 1's shard was poisoned: the all-reduced found_inf makes both ranks skip
    assert r0["skipped"] == r1["skipped"] == expected_skips
    assert r0["scales"] == r1["scales"]
    assert r0["optimizer"] == "SGD"  # FSDP2's FP32 shards are the masters: no MasterWeightOptimizer
    assert c.max_diff(r0["params"], r1["params"]) == 0.0
    ref = _run(policy, rank=0, world=1)
    assert ref["skipped"] == expected_skips and ref["scales"] == r0["scales"]
    diff = c.max_diff(r0["params"], ref["params"])
    assert diff <= TOL[policy[:4]], f"{policy}: max |fsdp2 - single| = {diff:.3g}"
    init = {k: v.float().reshape(-1).tolist() for k, v in c.make_model().state_dict().items()}
    moved = c.max_diff(init, ref["params"])
    assert moved > 1e-2 and moved > 10 * diff, (moved, diff)
    print(f"\nfsdp2 {policy}: max|fsdp2 - single| = {diff:.3g}, weights moved {moved:.3g}")


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("pure_island_not_sharded", "FP32 island '1' is not sharded on its own"),
        ("pure_forward_before_prepare", "the FSDP2 model already ran a forward"),
        ("wrong_fsdp_policy", "gathers parameters in torch.bfloat16 but policy 'fp16-master' needs torch.float16"),
        ("island_not_sharded", "FP32 island '1' is not sharded on its own"),
        ("compute_accumulation", "grad_accumulation='compute' with FSDP2"),
        ("r16_fp32_accumulation", "needs grad_accumulation='compute'"),
        ("r16_grad_edited_after_unscale", "Clip with prec.clip_grad_norm_"),
    ],
)
def test_fsdp2_unsupported_combinations_raise(ranks: list[dict[str, Any]], case: str, needle: str) -> None:
    for r in ranks:
        assert r[case] is not None and needle in r[case], r[case]


def test_fsdp2_r16_shards_weights_and_remainders_and_matches_single_process(ranks: list[dict[str, Any]]) -> None:
    r0, r1 = ranks[0][R16], ranks[1][R16]
    expected_skips = [s == c.POISON_STEP for s in range(c.STEPS)]
    assert r0["skipped"] == r1["skipped"] == expected_skips
    assert c.max_diff(r0["params"], r1["params"]) == 0.0
    # BF16 shards (the LayerNorm island FP32), each with a remainder of its own local shape: the 3-row layer
    # splits 2 + 1 rows across the ranks, so nothing is replicated.
    for r in (r0, r1):
        assert r["dtypes"] == ["torch.bfloat16", "torch.bfloat16", "torch.float32", "torch.float32",
                               "torch.bfloat16", "torch.bfloat16"]
        assert [w if rem is not None else None for w, rem in zip(r["weight_rows"], r["remainder_rows"])] == \
            r["remainder_rows"]
    assert r0["remainder_rows"][4][0] + r1["remainder_rows"][4][0] == 3
    ref = _run_r16(rank=0, world=1)
    assert ref["skipped"] == expected_skips
    diff = c.max_diff(r0["params"], ref["params"])
    assert diff <= TOL["bf16"], f"max |fsdp2 - single| = {diff:.3g}"
    init = {k: v.float().reshape(-1).tolist() for k, v in c.make_model().state_dict().items()}
    assert c.max_diff(init, ref["params"]) > 10 * diff
    # Issue 29's goal: <= 14 / W + 0.5 bytes per parameter per rank (the FP32 LayerNorm island costs extra here:
    # 16 of the model's 91 parameters are FP32 with FP32 gradients and states).
    for r in (r0, r1):
        assert r["bytes_per_param"] <= 14 / c.WORLD + 0.5 + 16 * (4 + 4 - 2 - 2) / 91, r["bytes_per_param"]
    print(f"\nfsdp2 {R16}: max|fsdp2 - single| = {diff:.3g}; B/param/rank {r0['bytes_per_param']:.2f}, "
          f"{r1['bytes_per_param']:.2f}")


def test_fsdp2_r16_dcp_save_resume_bit_for_bit(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["r16_dcp"]["bitwise"] and r["r16_dcp"]["n"] > 0, r["r16_dcp"]
