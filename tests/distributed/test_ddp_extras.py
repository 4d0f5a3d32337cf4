"""DDP features beside the main loop, two gloo ranks on the CPU: torch's ``Join`` (uneven inputs),
ZeroRedundancyOptimizer, user communication hooks, and bf16-pure under plain DDP.

Rank 0 has 2 batches, rank 1 has 4. mixprec agrees on inf/NaN across ranks (an all-reduce per
step that torch.amp's recipe does not have): listed after the DDP module, ``Join([ddp, prec])``
and ``Join([ddp, scaler])`` shadow it on the joined rank; the orders that cannot work are refused
by name instead of aborting inside gloo (or hanging under NCCL).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from . import _common as c

BATCHES = {0: 2, 1: 4}
POLICIES = ["bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master"]


def _data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(BATCHES[rank])]


def _flat(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).tolist()


def _wrap_ddp_run(policy: str, rank: int, order: str) -> dict[str, Any]:
    from torch.distributed.algorithms.join import Join

    from mixprec._master import MasterWeightOptimizer
    from mixprec.distributed import wrap_ddp

    prec = c.make_prec(policy)
    model = c.make_model()
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ddp = wrap_ddp(prec, model)
    joinables = {"ddp,prec": [ddp, prec], "ddp": [ddp], "prec,ddp": [prec, ddp]}[order]
    out: dict[str, Any] = {"error": None, "steps": 0}
    try:
        with Join(joinables):
            for x, y in _data(rank):
                with prec.autocast():
                    loss = nn.functional.mse_loss(ddp(x).float(), y)
                prec.backward(loss)
                prec.step(opt)
                opt.zero_grad(set_to_none=True)
                out["steps"] += 1
    except ValueError as e:
        out["error"] = str(e)
        return out
    # one more step on both ranks: the masters must have followed DDP's final model
    x, y = _data(1)[0]
    with prec.autocast():
        loss = nn.functional.mse_loss(ddp(x).float(), y)
    prec.backward(loss)
    prec.step(opt)
    out["weights"] = _flat(model)
    out["masters"] = [m.detach().float().reshape(-1).tolist() for m in opt.masters] \
        if isinstance(opt, MasterWeightOptimizer) else None
    return out


def _grad_scaler_run(rank: int) -> dict[str, Any]:
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    import mixprec as mp

    model = c.make_model()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mp.GradScaler("cpu", init_scale=2.0**8)
    steps = 0
    with Join([ddp, scaler]):
        for x, y in _data(rank):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(ddp(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            steps += 1
    return {"steps": steps, "weights": _flat(model)}


def _zero_under_masters() -> dict[str, Any]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from mixprec import MixedPrecision

    model = c.make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    try:
        MixedPrecision("bf16-master").prepare(model, zero)
    except TypeError as e:
        return {"error": str(e), "dtypes": sorted({str(p.dtype) for p in model.parameters()})}
    return {"error": None}


def _user_comm_hook() -> str | None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from mixprec.distributed import wrap_ddp

    prec = c.make_prec("bf16-mixed")
    model = c.make_model()
    model, _ = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ddp = wrap_ddp(prec, model)
    try:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    except RuntimeError as e:
        return str(e)
    return None


def _pure_stochastic_under_plain_ddp(rank: int) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel

    prec = c.make_prec("p=bf16,c=bf16,o=f32,m=none,ls=none,comp=stochastic")
    model = c.make_model()
    torch.manual_seed(100 + rank)  # the ranks' generators (and default rounding seeds) differ after the model was built
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ddp = DistributedDataParallel(model)
    for x, y in _data(1)[:3]:
        with prec.autocast():
            loss = nn.functional.mse_loss(ddp(x).float(), y)
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
    return _flat(model)


def _no_sync_accumulation(how: str, rank: int) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel

    from mixprec.distributed import wrap_ddp

    prec = c.make_prec("fp16-master")
    model = c.make_model()
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ddp = DistributedDataParallel(model) if how == "plain" else wrap_ddp(prec, model)
    c.train(prec, ddp, opt, rank=rank, world=c.WORLD, accum=2, poison=False, no_sync=ddp.no_sync)
    return _flat(model)


def _join_then_train_on(policy: str, rank: int, accum: int) -> dict[str, Any]:
    """Uneven inputs under Join with the last batch of each rank overflowing (FP16), no_sync accumulation, then
    two even steps: the joined rank's loss scale must have followed the others' (different scales, different steps)."""
    from contextlib import nullcontext

    from torch.distributed.algorithms.join import Join

    from mixprec.distributed import wrap_ddp

    prec = c.make_prec(policy)
    model = c.make_model()
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ddp = wrap_ddp(prec, model)
    data = _data(rank)

    def step(batch: list[tuple[torch.Tensor, torch.Tensor]], overflow: bool) -> None:
        for micro, (x, y) in enumerate(batch):
            with ddp.no_sync() if micro < len(batch) - 1 else nullcontext():
                with prec.autocast():
                    loss = nn.functional.mse_loss(ddp(x).float(), y)
                prec.backward(loss * float("inf") if overflow and micro == len(batch) - 1 else loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)

    with Join([ddp, prec]):
        for i in range(len(data)):
            step([data[i]] * accum, overflow=policy.startswith("fp16") and i == len(data) - 1)
    for x, y in _data(0):  # even again
        step([(x, y)] * accum, overflow=False)
    return {"weights": _flat(model), "scale": float(prec.scaler.loss_scale)}


def _fsdp_weight_beyond_fp16() -> str | None:
    """An FP32 weight of 1e6 on one rank's shard under FSDP2 fp16-master: every rank must refuse it alike."""
    import mixprec as mp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight[0, 0] = 1e6
    prec = mp.MixedPrecision("fp16-master")
    mp.distributed.fully_shard(model, prec.policy, modules=[model[0], model[2]])
    try:
        prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    except ValueError as e:
        return str(e)
    return None


def _worker(rank: int, port: int, out_dir: str) -> None:
    c.init(rank, port)
    warnings.simplefilter("ignore")
    results: dict[str, Any] = {}
    for policy in POLICIES:
        results[policy] = _wrap_ddp_run(policy, rank, "ddp,prec")
    results["ddp-only"] = _wrap_ddp_run("bf16-mixed", rank, "ddp")
    results["prec-first"] = _wrap_ddp_run("bf16-master", rank, "prec,ddp")
    results["grad-scaler"] = _grad_scaler_run(rank)
    results["weights0"] = _flat(c.make_model())
    results["zero-master"] = _zero_under_masters()
    results["comm-hook"] = _user_comm_hook()
    results["pure-sr"] = _pure_stochastic_under_plain_ddp(rank)
    results["no-sync-plain"] = _no_sync_accumulation("plain", rank)
    results["join-fp16"] = _join_then_train_on("fp16-master", rank, 1)
    results["fsdp-range"] = _fsdp_weight_beyond_fp16()
    results["join-accum"] = _join_then_train_on("bf16-mixed", rank, 2)
    results["join-fp16-accum"] = _join_then_train_on("fp16-mixed", rank, 2)
    results["no-sync-wrap"] = _no_sync_accumulation("wrap", rank)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    c.finish()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return c.spawn(_worker, tmp_path_factory.mktemp("join"))


@pytest.mark.parametrize("policy", POLICIES)
def test_uneven_inputs_under_join_with_the_run_listed_after_ddp(ranks: list[dict[str, Any]], policy: str) -> None:
    r0, r1 = ranks[0][policy], ranks[1][policy]
    assert r0["error"] is None and r1["error"] is None
    assert (r0["steps"], r1["steps"]) == (BATCHES[0], BATCHES[1])
    # DDP broadcast the last joiner's parameters and the run its masters: one more step keeps them equal
    assert r0["weights"] == r1["weights"]
    assert r0["masters"] == r1["masters"]


def test_join_without_the_run_or_with_it_first_is_refused_by_name(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["ddp-only"]["steps"] == 0
        assert "inside torch's Join context but prec is not" in r["ddp-only"]["error"]
        assert "Join([ddp, prec])" in r["ddp-only"]["error"]
        assert "prec is the first joinable of torch's Join context" in r["prec-first"]["error"]


def test_mixprec_grad_scaler_under_join_with_uneven_inputs(ranks: list[dict[str, Any]]) -> None:
    r0, r1 = ranks[0]["grad-scaler"], ranks[1]["grad-scaler"]
    assert (r0["steps"], r1["steps"]) == (BATCHES[0], BATCHES[1])
    assert r0["weights"] == r1["weights"]  # DDP's final-model broadcast


def test_zero_redundancy_optimizer_under_master_weights_is_refused_and_nothing_changes(
    ranks: list[dict[str, Any]],
) -> None:
    # ZeRO steps its own optimizer over the model's parameters: under masters the weights never moved
    for r in ranks:
        assert "cannot wrap torch's ZeroRedundancyOptimizer" in r["zero-master"]["error"]
        assert r["zero-master"]["dtypes"] == ["torch.float32"]  # prepare rolled back its cast


def test_a_comm_hook_on_the_wrap_ddp_module_names_the_reason(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert "was built by mixprec.distributed.wrap_ddp, which registered its own communication hook" in r["comm-hook"]


def test_bf16_pure_stochastic_rounding_under_plain_ddp_keeps_the_replicas_identical(
    ranks: list[dict[str, Any]],
) -> None:
    # prepare agrees the rounding seed across ranks; each rank's own seed made the replicas drift
    assert ranks[0]["pure-sr"] == ranks[1]["pure-sr"]


def test_plain_ddp_no_sync_accumulation_under_fp16_master_trains_like_wrap_ddp(ranks: list[dict[str, Any]]) -> None:
    # DDP's reducer reads the accumulated (still scaled) gradient view inside the synchronising backward:
    # that read is autograd's, not the user's, and raised "call prec.unscale_ first"
    plain, wrapped = torch.tensor(ranks[0]["no-sync-plain"]), torch.tensor(ranks[0]["no-sync-wrap"])
    assert ranks[0]["no-sync-plain"] == ranks[1]["no-sync-plain"]
    assert not torch.equal(plain, torch.tensor(ranks[0]["weights0"]))
    torch.testing.assert_close(plain, wrapped, atol=2e-3, rtol=0)  # the reductions differ: FP16 vs FP32


@pytest.mark.parametrize("name", ["join-fp16", "join-accum", "join-fp16-accum"])
def test_after_a_join_the_replicas_and_loss_scales_stay_equal(ranks: list[dict[str, Any]], name: str) -> None:
    # the joined rank's scale did not back off with the others' (replicas drifted after the Join); no_sync()
    # micro-batches made the joined rank shadow a flag all-reduce per forward (gloo aborted)
    r0, r1 = ranks[0][name], ranks[1][name]
    assert r0["scale"] == r1["scale"]
    assert r0["weights"] == r1["weights"]
    if name != "join-accum":
        assert r0["scale"] < 2.0**8  # both backed off for the overflows (make_prec starts FP16 at 2**8)


def test_fsdp2_shards_beyond_fp16_range_are_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    # the check skipped DTensor shards: NaN losses and no applied step, no error
    for r in ranks:
        assert "parameter '0.weight' has values up to 1e+06, beyond FP16's maximum 65504" in (r["fsdp-range"] or "")
