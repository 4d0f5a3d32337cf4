"""mixprec.optim on FSDP2-style ``DTensor`` shards and on DDP replicas, two CPU gloo ranks.

One pair of processes (spawned once) runs both scenarios; the references run in the pytest process.

* ``DTensor`` parameters sharded ``Shard(0)`` over 2 ranks (eager and fused steps), unevenly (a (5, 4) weight is 3 + 2 rows,
  a (1, 3) one is 1 + 0 rows): the states and Kahan buffers are ``DTensor``s sharded like their
  parameters, and after a few steps (one skipped) the gathered parameters and states equal the
  unsharded single-process run **bit for bit**, stochastic rounding included: the random bits
  are a function of (seed, step, buffer, global element position), and the arithmetic is
  elementwise. ``state_dict`` round-trips sharded states.
* DDP: two replicas with different global RNG states (``torch.manual_seed(rank)``) and
  different local batches, gradients all-reduced by ``DistributedDataParallel``, stochastic
  rounding with BF16 states: the replicas stay bit-identical.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import _common as c  # tests/ is on sys.path (rootdir package layout)

import mixprec.optim as mo

SHAPES = [(5, 4), (3,), (1, 3)]
STEPS = 4
SKIP_STEP = 1
CASES = {
    "adamw-kahan-f32": (mo.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, "kahan", torch.float32),
    # The compiled step on the shards (each rank compiles its local shapes; rank 1 holds an empty one).
    "adamw-sr-bf16-fused": (mo.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}, "stochastic", torch.bfloat16),
    "adamw-sr-bf16": (mo.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, "stochastic", torch.bfloat16),
    "sgd-sr-f32": (mo.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, "stochastic", torch.float32),
}


def _full_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]


def _full_grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]


def _run(case: str, params: list[torch.Tensor], to_shard: Any, eager: bool = False) -> Any:
    """Train ``params`` (plain or DTensor) for STEPS steps; ``to_shard`` maps a full gradient to the params' layout."""
    cls, hp, comp, sdt = CASES[case]
    if eager:
        hp = {**hp, "fused": False}
    opt = cls(params, **hp, compensation=comp, state_dtype=sdt, seed=5)
    for step in range(STEPS):
        for p, g in zip(params, _full_grads(step)):
            p.grad = to_shard(g)
        opt.step(found_inf=torch.tensor(float(step == SKIP_STEP)))
    return opt


def _record(opt: Any, full: Any) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for i, p in enumerate(opt.param_groups[0]["params"]):
        out[f"p{i}"] = full(p).float().reshape(-1).tolist()
        for k, v in sorted(opt.state[p].items()):
            out[f"p{i}.{k}"] = full(v).float().reshape(-1).tolist()
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    c.init(rank, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (c.WORLD,))
    res: dict[str, Any] = {"sharded": {}, "layout": {}}
    for case in CASES:
        params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in _full_params()]
        opt = _run(case, params, lambda g: distribute_tensor(g, mesh, [Shard(0)]))
        res["sharded"][case] = _record(opt, lambda t: t.full_tensor() if isinstance(t, DTensor) else t)
        res["layout"][case] = sorted({f"{k}:{type(v).__name__}:{tuple(v.to_local().shape) == tuple(p.to_local().shape)}"
                                      for p in params for k, v in opt.state[p].items() if v.dim() > 0})
        # state_dict -> load into a fresh optimizer on the same shards: identical local states.
        sd = opt.state_dict()
        cls, hp, comp, sdt = CASES[case]
        opt2 = cls(params, **hp, compensation=comp, state_dtype=sdt, seed=0)
        opt2.load_state_dict(sd)
        res["layout"][case].append(all(
            isinstance(opt2.state[p][k], DTensor) and torch.equal(opt2.state[p][k].to_local(), v.to_local())
            for p in params for k, v in opt.state[p].items() if v.dim() > 0) and opt2.seed == 5)
    # DDP: different RNG states and batches per rank; the replicas must stay bit-identical.
    torch.manual_seed(rank)
    res["rng"] = torch.rand(1).item()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):  # identical start on both ranks, BF16
            p.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape) * (i + 1) * 0.3)
    model.to(torch.bfloat16)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = mo.AdamW(ddp.parameters(), lr=1e-2, compensation="stochastic", state_dtype=torch.bfloat16, seed=11)
    for _ in range(3):
        x = torch.randn(4, 4).to(torch.bfloat16)  # each rank's own batch, from its own generator
        ddp(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    res["ddp"] = [p.detach().float().reshape(-1).tolist() for p in model.parameters()] + [
        v.float().reshape(-1).tolist() for st in opt.state.values() for v in st.values()]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    c.finish()  # barrier + destroy_process_group: gloo may abort at exit otherwise


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return c.spawn(_worker, tmp_path_factory.mktemp("sharded"))


@pytest.mark.parametrize("case", list(CASES))
def test_dtensor_shards_equal_the_unsharded_run_bit_for_bit(ranks, case):
    params = [torch.nn.Parameter(t.clone()) for t in _full_params()]
    ref = _record(_run(case, params, lambda g: g, eager=True), lambda t: t)  # the fused case against eager
    for r in ranks:
        assert r["sharded"][case].keys() == ref.keys()
        for k, v in ref.items():
            assert r["sharded"][case][k] == v, (case, k)  # exact: same bits from the same global positions
    # The run moved and (stochastic cases) really rounded with the counter bits.
    assert ref["p0"] != _full_params()[0].float().reshape(-1).tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_states_are_sharded_like_their_parameters(ranks, case):
    for r in ranks:
        *kinds, reloaded = r["layout"][case]
        assert kinds and all(k.endswith(":DTensor:True") for k in kinds), kinds
        assert reloaded is True


def test_ddp_replicas_stay_bit_identical_without_shared_generator_state(ranks):
    assert ranks[0]["rng"] != ranks[1]["rng"]  # the generators really differ
    assert ranks[0]["ddp"] == ranks[1]["ddp"]
