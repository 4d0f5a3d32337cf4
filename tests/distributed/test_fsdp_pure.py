"""``bf16-pure`` (BF16 parameters, compensated optimizers, no FP32 masters) under FSDP2 and DDP, on two CPU gloo ranks.

One pair of processes runs every scenario (spawned once per module); the single-process
references run in the pytest process. Asserted:

* FSDP2 ``bf16-pure`` with Kahan summation (SGD) and with stochastic rounding (AdamW, BF16 states,
  gradient clipping) trains like one process on the same global batch (gathered FP32 weights
  within the BF16 tolerance), both ranks end bit-identical, the shards and compensation buffers
  are BF16 DTensors holding part of each parameter, a poisoned gradient on rank 1 makes both
  ranks skip with every state untouched.
* The BF16 stall task (AdamW updates 39x below half a BF16 ulp): without compensation the
  sharded run does not move a bit; with Kahan it tracks the FP32 run.
* DCP (``torch.distributed.checkpoint``) save and resume on the same world size: bit for bit.
* DDP ``bf16-pure`` with stochastic rounding: ranks whose generators (and default optimizer
  seeds) differ stay bit-identical.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn

from . import _common as c

SR = "p=bf16,c=bf16,o=f32,comp=stochastic"
# BF16 tolerance on the gathered weights after 4 steps, as in test_fsdp.py (measured: Kahan/SGD 5.3e-4
# for weights that moved 0.14, stochastic rounding/AdamW 9.8e-4 for 0.09; a BF16 ulp at |w| ~ 0.2 is 9.8e-4).
TOL_BF16 = 3e-3
STALL_N, STALL_STEPS, STALL_LR, STALL_DIST = 4096, 300, 1e-4, 0.05


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    import mixprec.optim as mo

    if kind == "kahan":  # a torch SGD: prepare converts it to mixprec.optim.SGD(compensation="kahan")
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return mo.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01, compensation="stochastic",
                    state_dtype=torch.bfloat16)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _states(opt: Any) -> list[torch.Tensor]:
    """Every per-parameter tensor the optimizer keeps (local shards), copied."""
    return [_local(v).detach().clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _fp32(prec: Any) -> dict[str, list[float]]:
    """``fp32_state_dict(prec, compensation=True)``: BF16 weights + Kahan buffers, gathered into full tensors."""
    from mixprec.checkpoint import fp32_state_dict

    out = {}
    for k, v in fp32_state_dict(prec, compensation=True).items():
        assert type(v) is torch.Tensor and v.dtype == torch.float32, (k, type(v), v.dtype)  # gathered, FP32
        out[k] = v.reshape(-1).tolist()
    return out


def _run_pure(kind: str, rank: int, world: int) -> dict[str, Any]:
    """Train the shared tiny MLP for STEPS steps under bf16-pure; poison one gradient at POISON_STEP."""
    from mixprec.distributed import fully_shard

    policy = "bf16-pure" if kind == "kahan" else SR
    prec = c.make_prec(policy)
    model = c.make_model()
    if world > 1 and kind == "kahan":  # the user shards with torch's fully_shard and mixprec's policies
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        from mixprec.distributed import fsdp_mixed_precision

        torch_fully_shard(model.get_submodule("1"), mp_policy=fsdp_mixed_precision(policy, island=True))  # LayerNorm
        torch_fully_shard(model, mp_policy=fsdp_mixed_precision(policy, root=True))
    elif world > 1:
        fully_shard(model, policy)  # FP32 islands on their own, then the root; prepare casts the shards
    model, opt = prec.prepare(model, _optimizer(kind, model))
    out: dict[str, Any] = {"skipped": [], "untouched": None, "optimizer": type(opt).__name__}
    for step in range(c.STEPS):
        x, y = c.rows(step, 0, 1, rank, world)
        with prec.autocast():
            pred = model(x)
        prec.backward(nn.functional.mse_loss(pred.float(), y))
        if step == c.POISON_STEP:
            before = [_local(p).detach().clone() for p in model.parameters()] + _states(opt)
            if world == 1 or rank == c.POISON_RANK:
                c.poison_(prec, opt)
        if kind == "sr":  # the global norm over BF16 and FP32 (island) DTensor gradients; clips (norms ~1-2)
            out.setdefault("norms", []).append(float(prec.clip_grad_norm_(1.0)))
        info = prec.step(opt)
        if step == c.POISON_STEP:
            after = [_local(p).detach() for p in model.parameters()] + _states(opt)
            out["untouched"] = all(torch.equal(a, b) for a, b in zip(before, after)) and len(before) == len(after)
        out["skipped"].append(bool(info.skipped.item()))
        opt.zero_grad(set_to_none=True)
    out["params"] = _fp32(prec)
    out["dtypes"] = {n: [str(p.dtype), str(_local(p).dtype), type(p).__name__, _local(p).numel(), p.numel()]
                     for n, p in model.named_parameters()}
    sd = prec.state_dict()["optimizers"][0]["state"]
    out["state_kinds"] = sorted({f"{k}:{type(v).__name__}:{v.dtype}" for st in sd.values() for k, v in st.items()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0})
    out["state_local_numel"] = sum(_local(v).numel() for st in sd.values() for v in st.values()
                                   if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


class _Stall(nn.Module):
    """4096 weights in [1, 2) pulled 0.05 towards a target: Adam's ~lr = 1e-4 steps are 39x below half a BF16 ulp."""

    def __init__(self) -> None:
        super().__init__()
        w0, _, target = _stall_task()
        self.w = nn.Parameter(w0.clone())
        self.register_buffer("target", target)

    def forward(self, _: torch.Tensor) -> torch.Tensor:
        target = cast(torch.Tensor, self.target)
        return ((self.w.float() - target) ** 2).mean()


def _stall_task() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w0 = (1 + torch.rand(STALL_N, generator=g)).to(torch.bfloat16).float()  # exactly representable
    sign = torch.where(torch.rand(STALL_N, generator=g) < 0.5, -1.0, 1.0)
    return w0, sign, w0 + STALL_DIST * sign


def _progress(w: torch.Tensor) -> float:
    w0, sign, _ = _stall_task()
    return float(((w.float() - w0) * sign).mean()) / STALL_DIST


def _run_stall(policy: str, world: int) -> list[float]:
    from mixprec import MixedPrecision
    from mixprec.distributed import fully_shard

    prec = MixedPrecision(policy)
    model = _Stall()
    if world > 1:
        fully_shard(model, policy)
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=STALL_LR, weight_decay=0))
    progress = []
    dummy = torch.zeros(1)
    for t in range(STALL_STEPS):
        prec.backward(model(dummy))
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
        if (t + 1) % 100 == 0:
            progress.append(_progress(torch.tensor(c.fp32_params(prec, model)["w"])))
    return progress


def _run_dcp(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """Stochastic rounding + BF16 states: 2 steps, DCP save, 2 more; a fresh run loads the save and does the same 2."""
    import torch.distributed.checkpoint as dcp

    from mixprec.distributed import fully_shard

    def build(generator_seed: int | None) -> tuple[Any, nn.Module, Any]:
        prec = c.make_prec(SR)
        model = fully_shard(c.make_model(), SR)
        if generator_seed is not None:
            torch.manual_seed(generator_seed)  # another default optimizer seed: the checkpoint's must win
        model, opt = prec.prepare(model, _optimizer("sr", model))
        return prec, model, opt

    def steps(prec: Any, model: nn.Module, opt: Any, which: range) -> None:
        for step in which:
            x, y = c.rows(step, 0, 1, rank, world)
            with prec.autocast():
                pred = model(x)
            prec.backward(nn.functional.mse_loss(pred.float(), y))
            prec.step(opt)
            opt.zero_grad(set_to_none=True)

    prec, model, opt = build(None)
    steps(prec, model, opt, range(2))
    dcp.save(prec.state_dict(), checkpoint_id=ckpt)
    steps(prec, model, opt, range(2, 4))
    ref = [_local(p).detach().clone() for p in model.parameters()] + _states(opt)

    prec2, model2, opt2 = build(1234 + rank)
    seeds = (int(opt.seed), int(opt2.seed))
    sd = prec2.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)  # in place, each rank reads its shards
    prec2.load_state_dict(sd)
    steps(prec2, model2, opt2, range(2, 4))
    got = [_local(p).detach() for p in model2.parameters()] + _states(opt2)
    return {"bitwise": len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got)), "n": len(ref),
            "seeds": [*seeds, int(opt2.seed)]}


def _run_ddp_sr(rank: int, world: int) -> dict[str, Any]:
    from mixprec.distributed import wrap_ddp

    prec = c.make_prec(SR)
    model = c.make_model()  # same initial weights on every rank (manual_seed(0))
    torch.manual_seed(100 + rank)  # ...but different generator states, hence different default optimizer seeds
    own_seed = torch.initial_seed()
    model, opt = prec.prepare(model, _optimizer("sr", model))
    seed_before = int(opt.seed)
    ddp = wrap_ddp(prec, model)
    for step in range(c.STEPS):
        x, y = c.rows(step, 0, 1, rank, world)
        with prec.autocast():
            pred = ddp(x)
        prec.backward(nn.functional.mse_loss(pred.float(), y))
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
    return {
        "own_seed": own_seed,
        "seed_before": seed_before,
        "seed_after": int(opt.seed),
        "params": {n: p.detach().float().reshape(-1).tolist() for n, p in model.named_parameters()},
        "states": [v.float().reshape(-1).tolist() for v in _states(opt) if v.dim() > 0],
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    c.init(rank, port)
    warnings.simplefilter("ignore")
    results: dict[str, Any] = {}
    for kind in ("kahan", "sr"):
        results[f"fsdp/{kind}"] = _run_pure(kind, rank, c.WORLD)
    results["stall/none"] = _run_stall("bf16-true", c.WORLD)
    results["stall/kahan"] = _run_stall("bf16-pure", c.WORLD)
    results["dcp"] = _run_dcp(rank, c.WORLD, str(Path(out_dir) / "ckpt"))
    results["ddp/sr"] = _run_ddp_sr(rank, c.WORLD)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    c.finish()  # seen once in six runs without it: SIGABRT at exit


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return c.spawn(_worker, tmp_path_factory.mktemp("fsdp_pure"))


@pytest.mark.parametrize("kind", ["kahan", "sr"])
def test_fsdp2_bf16_pure_matches_single_process(ranks: list[dict[str, Any]], kind: str) -> None:
    r0, r1 = ranks[0][f"fsdp/{kind}"], ranks[1][f"fsdp/{kind}"]
    expected_skips = [s == c.POISON_STEP for s in range(c.STEPS)]
    assert r0["skipped"] == r1["skipped"] == expected_skips  # only rank 1 was poisoned
    assert r0["untouched"] and r1["untouched"], "a skipped step changed a parameter or an optimizer state"
    assert r0["optimizer"] == ("SGD" if kind == "kahan" else "AdamW")  # mixprec.optim's
    assert c.max_diff(r0["params"], r1["params"]) == 0.0
    for name, (dt, local_dt, kind_, local_n, n) in r0["dtypes"].items():
        island = name.startswith("1.")  # the LayerNorm: an FP32 island sharded on its own
        assert (dt, local_dt) == (("torch.float32",) * 2 if island else ("torch.bfloat16",) * 2), (name, dt, local_dt)
        assert kind_ == "DTensor" and local_n + r1["dtypes"][name][3] == n and local_n < n, (name, local_n, n)
    states = r0["state_kinds"]
    assert all(":DTensor:" in s for s in states), states  # sharded like their parameters
    if kind == "kahan":
        assert states == ["kahan_comp:DTensor:torch.bfloat16", "momentum_buffer:DTensor:torch.float32"], states
    else:
        assert states == ["exp_avg:DTensor:torch.bfloat16", "exp_avg_sq:DTensor:torch.bfloat16"], states
    total = sum(v[4] for v in r0["dtypes"].values())
    half = sum(v[4] for n, v in r0["dtypes"].items() if not n.startswith("1."))
    # SGD: momentum + kahan_comp of the BF16 parameters; AdamW: exp_avg, exp_avg_sq
    expected = total + half if kind == "kahan" else 2 * total
    assert r0["state_local_numel"] + r1["state_local_numel"] == expected  # each element on one rank only

    ref = _run_pure(kind, rank=0, world=1)
    assert ref["skipped"] == expected_skips and ref["untouched"]
    if kind == "sr":
        assert r0["norms"] == r1["norms"]  # one global norm
        for a, b, s in zip(r0["norms"], ref["norms"], range(c.STEPS)):
            assert (a == b == float("inf")) if s == c.POISON_STEP else (b > 1.0 and abs(a - b) < 1e-2 * b), (a, b)
    diff = c.max_diff(r0["params"], ref["params"])
    init = {k: v.float().reshape(-1).tolist() for k, v in c.make_model().state_dict().items()}
    moved = c.max_diff(init, ref["params"])
    assert diff <= TOL_BF16 and moved > 10 * diff, f"{kind}: max |fsdp2 - single| = {diff:.3g}, moved {moved:.3g}"
    print(f"\nfsdp2 bf16-pure/{kind}: max|fsdp2 - single| = {diff:.3g}, weights moved {moved:.3g}")


def test_fsdp2_stall_task_kahan_tracks_fp32_plain_bf16_stalls(ranks: list[dict[str, Any]]) -> None:
    w0, _, target = _stall_task()
    p = nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([p], lr=STALL_LR, weight_decay=0)
    ref = []
    for t in range(STALL_STEPS):
        opt.zero_grad()
        ((p - target) ** 2).mean().backward()
        opt.step()
        if (t + 1) % 100 == 0:
            ref.append(_progress(p.detach()))
    assert ref[-1] > 0.3  # the FP32 run does move
    for r in ranks:
        assert r["stall/none"] == [0.0] * len(ref)  # every update rounds away, on the shards too
        for a, b in zip(r["stall/kahan"], ref):
            assert abs(a - b) < 0.10, (r["stall/kahan"], ref)
    assert ranks[0]["stall/kahan"] == ranks[1]["stall/kahan"]


def test_fsdp2_dcp_save_resume_bit_for_bit(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["dcp"]["bitwise"] and r["dcp"]["n"] > 0, r["dcp"]
        saved, fresh, resumed = r["dcp"]["seeds"]
        assert fresh != saved and resumed == saved  # the resumed run took the checkpoint's seed


def test_ddp_stochastic_rounding_replicas_stay_identical(ranks: list[dict[str, Any]]) -> None:
    r0, r1 = ranks[0]["ddp/sr"], ranks[1]["ddp/sr"]
    assert r0["own_seed"] != r1["own_seed"]  # the generators really differed
    # prepare already agreed on rank 0's seed (plain DDP needs it too); wrap_ddp keeps it
    assert r0["seed_before"] == r1["seed_before"] == r0["own_seed"]
    assert r0["seed_after"] == r1["seed_after"] == r0["own_seed"]
    assert r0["params"] == r1["params"] and r0["states"] == r1["states"]
    init = {k: v.float().reshape(-1).tolist() for k, v in c.make_model().state_dict().items()}
    assert c.max_diff(init, r0["params"]) > 1e-2  # it trained


def test_fp32_state_dict_with_compensation_is_weight_plus_kahan_buffer() -> None:
    """Single process: ``compensation=True`` returns what the optimizer steps from (``full_precision_params``)."""
    from mixprec import MixedPrecision
    from mixprec.checkpoint import fp32_state_dict

    prec = MixedPrecision("bf16-pure")
    model = c.make_model()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    exact = fp32_state_dict(prec, compensation=True)
    plain = fp32_state_dict(prec)
    # Right after prepare the Kahan buffers hold what the cast dropped: weight + buffer is the FP32 init
    # to ~16 bits, the plain export only to BF16's 8.
    err_exact = max(float((exact[k] - init[k]).abs().max()) for k in init)
    err_plain = max(float((plain[k] - init[k]).abs().max()) for k in init)
    assert err_exact < 1e-5 < 1e-4 < err_plain, (err_exact, err_plain)
    full = {id(p): v for p, v in opt.full_precision_params().items()}
    for name, p in model.named_parameters():
        assert torch.equal(exact[name], full[id(p)]), name


def test_fsdp_mixed_precision_for_half_parameters_without_masters() -> None:
    from mixprec.distributed import fsdp_mixed_precision

    for policy, half in (("bf16-pure", torch.bfloat16), ("bf16-true", torch.bfloat16), ("fp16-pure", torch.float16)):
        inner = fsdp_mixed_precision(policy)
        root = fsdp_mixed_precision(policy, root=True)
        island = fsdp_mixed_precision(policy, island=True)
        # the shards are already half: gathered as they are; gradients reduce-scattered in FP32 by default
        assert inner.param_dtype is None and inner.reduce_dtype == torch.float32 and inner.output_dtype is None
        assert root.output_dtype == torch.float32 and island.param_dtype is None
        assert fsdp_mixed_precision(policy, reduce_dtype="compute").reduce_dtype == half
