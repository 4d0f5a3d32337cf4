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

    def pure_forward_before_prepare() -> None:  # FSDP2 sized its gather buffers for FP32 shards
        m = fully_shard(c.make_model(), "bf16-pure")
        m(torch.randn(2, 6))
        MixedPrecision("bf16-pure").prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))

    for fn in (pure_island_not_sharded, pure_forward_before_prepare, wrong_fsdp_policy, island_not_sharded, compute_accumulation):
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
    ],
)
def test_fsdp2_unsupported_combinations_raise(ranks: list[dict[str, Any]], case: str, needle: str) -> None:
    for r in ranks:
        assert r[case] is not None and needle in r[case], r[case]
