"""DDP on two CPU processes (gloo): every preset reduces, agrees on found_inf and matches one process.

One pair of processes runs every scenario (spawned once per module); the single-process
references run in the pytest process.
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

# name -> (policy, MixedPrecision kwargs, wrap_ddp kwargs, micro-batches per step)
SCENARIOS: dict[str, tuple[str, dict[str, Any], dict[str, Any], int]] = {
    "bf16-mixed": ("bf16-mixed", {}, {}, 1),
    "bf16-mixed/reduce=compute": ("bf16-mixed", {}, {"reduce_dtype": "compute"}, 1),
    "fp16-mixed": ("fp16-mixed", {}, {}, 1),
    "fp16-master": ("fp16-master", {}, {}, 1),
    "fp16-master/no_sync": ("fp16-master", {}, {}, 2),
    "fp16-master/accum=compute": ("fp16-master", {"grad_accumulation": "compute"}, {}, 1),
    "bf16-master/reduce=compute": ("bf16-master", {}, {"reduce_dtype": "compute"}, 2),
    # Masters stored as weight + remainder: the remainders are broadcast with the weights, the masters agree.
    "bf16-master-r16/no_sync": ("bf16-master-r16", {}, {}, 2),
}
# Per compute dtype, on parameters of order 0.1-1 after 4 steps (measured: bf16 <= 5.3e-4, fp16 <= 6.6e-5).
TOL = {"bf16": 3e-3, "fp16": 5e-4}


CNN_POLICIES = ("bf16-master", "fp16-master", "bf16-master-r16")

CLEARS = {
    "model.zero_grad()": lambda m, o: m.zero_grad(),
    "model.zero_grad(set_to_none=False)": lambda m, o: m.zero_grad(set_to_none=False),
    "opt.zero_grad(set_to_none=False)": lambda m, o: o.zero_grad(set_to_none=False),
}


def _run(policy: str, prec_kw: dict[str, Any], ddp_kw: dict[str, Any], accum: int, rank: int, world: int,
         clear: Any = None) -> dict[str, Any]:
    from mixprec.distributed import wrap_ddp

    prec = c.make_prec(policy, **prec_kw)
    model = c.make_model()
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    fwd, no_sync = model, None
    if world > 1:
        fwd = wrap_ddp(prec, model, **ddp_kw)
        no_sync = fwd.no_sync
    out = c.train(prec, fwd, opt, rank=rank, world=world, accum=accum, no_sync=no_sync, clear=clear)
    out["params"] = c.fp32_params(prec, model)
    return out


def _cnn_run(policy: str, after: bool, world: int) -> dict[str, Any]:
    """A channels_last CNN (converted before or after prepare), 3 SGD steps of 2 micro-batches (the first under
    no_sync), the same data on every rank: DDP's average is the one-process gradient. The FP32 weights, the host
    reads per step and mixprec's layout warnings."""
    import contextlib

    from mixprec.bench._step_cost import StepCounter
    from mixprec.distributed import wrap_ddp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 4 * 4, 3))
    if not after:
        model = model.to(memory_format=torch.channels_last)
    prec = c.make_prec(policy)
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    if after:
        model = model.to(memory_format=torch.channels_last)
    fwd = wrap_ddp(prec, model) if world > 1 else model
    g = torch.Generator().manual_seed(7)
    reads = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for micro in range(2):
                x = torch.randn(2, 3, 4, 4, generator=g).contiguous(memory_format=torch.channels_last)
                ctx = fwd.no_sync() if world > 1 and micro == 0 else contextlib.nullcontext()
                with ctx:
                    with prec.autocast():
                        loss = fwd(x).float().square().mean() / 2
                    prec.backward(loss)
            with StepCounter((opt,)) as counter:
                prec.step(opt)
            reads.append(counter.host_reads)
            opt.zero_grad(set_to_none=True)
    return {"params": c.fp32_params(prec, model), "reads": reads,
            "layout_warnings": [str(w.message) for w in caught if "memory order" in str(w.message)]}


def _worker(rank: int, port: int, out_dir: str) -> None:
    c.init(rank, port)
    warnings.simplefilter("ignore")
    from torch.nn.parallel import DistributedDataParallel

    from mixprec.distributed import wrap_ddp

    results: dict[str, Any] = {}
    for name, (policy, prec_kw, ddp_kw, accum) in SCENARIOS.items():
        results[name] = _run(policy, prec_kw, ddp_kw, accum, rank, c.WORLD)
    # Every way to clear gradients under wrap_ddp clears what the next step uses (issue 18), also
    # after the poisoned step and across no_sync() micro-batches.
    for accum in (1, 2):
        results[f"clear/{accum}/reference"] = _run("bf16-master", {}, {}, accum, rank, c.WORLD)
        for how, clear in CLEARS.items():
            results[f"clear/{accum}/{how}"] = _run("bf16-master", {}, {}, accum, rank, c.WORLD, clear=clear)
    # Plain DDP around an FP32-accumulating master-weight model: the master-gradient views give
    # DDP's reducer the FP32 gradient to reduce (in the model's half dtype) and take the reduced
    # one back, so it trains like wrap_ddp, up to the precision of the reduction.
    for policy in ("bf16-master", "fp16-master"):
        finals = {}
        for mode in ("plain", "wrap"):
            prec = c.make_prec(policy)
            model = c.make_model()
            model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            fwd = DistributedDataParallel(model) if mode == "plain" else wrap_ddp(prec, model)
            for step in range(3):
                with prec.autocast():
                    loss = fwd(c.rows(step, 0, 1, rank, c.WORLD)[0]).float().square().mean()
                prec.backward(loss)
                prec.step(opt)
                prec.zero_grad()
            finals[mode] = {str(i): m.detach().float().flatten().tolist() for i, m in enumerate(opt.masters)}
        results["plain_ddp_init"] = {
            str(i): p.detach().float().flatten().tolist() for i, p in enumerate(c.make_model().parameters())
        }
        results[f"plain_ddp_{policy}"] = {"diff": c.max_diff(finals["plain"], finals["wrap"]), "moved": finals["wrap"]}
    # In-place edits of p.grad between backward and the step under wrap_ddp (torch's clip_grad_norm_, zeroing) act on
    # the FP32 gradients the step uses, as without DDP (they edited DDP's half copy, which the step never read).
    for policy in ("bf16-mixed", "bf16-master", "fp16-master"):
        for how in ("prec", "torch", "zero"):
            prec = c.make_prec(policy)
            model = c.make_model()
            model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
            fwd = wrap_ddp(prec, model)
            with prec.autocast():
                loss = fwd(c.rows(0, 0, 1, rank, c.WORLD)[0]).float().square().mean()
            prec.backward(loss)
            before = [p.detach().float().clone() for p in model.parameters()]
            if how == "prec":
                prec.clip_grad_norm_(1e-3)
            elif how == "torch":
                if policy == "fp16-master":  # a read of a gradient that still carries the loss scale raises
                    try:
                        torch.nn.utils.clip_grad_norm_(fwd.parameters(), 1e-3)
                        results["ddp_scaled_read_error"] = None
                    except ValueError as e:
                        results["ddp_scaled_read_error"] = str(e)
                    prec.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(fwd.parameters(), 1e-3)
            else:
                for p in fwd.parameters():
                    p.grad.zero_()
            prec.step(opt)
            results[f"grad_edit/{policy}/{how}"] = {
                "params": {str(i): p.detach().float().flatten().tolist() for i, p in enumerate(model.parameters())},
                "moved": max((p.detach().float() - b).abs().max().item() for p, b in zip(model.parameters(), before)),
            }
    # channels_last models: DDP lays each gradient out in its parameter's memory order in the bucket; the masters'
    # gradients are read from it in that order (were reinterpreted as contiguous: scrambled).
    for policy in CNN_POLICIES:
        for after in (False, True):
            results[f"cnn/{policy}/{after}"] = _cnn_run(policy, after, c.WORLD)
    # Misuse: wrap_ddp on the torch.compile'd model (compile the DDP module instead).
    prec = c.make_prec("bf16-mixed")
    m = c.make_model()
    model, _ = prec.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
    try:
        wrap_ddp(prec, torch.compile(model))
        results["wrap_compiled_error"] = None
    except ValueError as e:
        results["wrap_compiled_error"] = str(e)
    # Misuse: prepare() on a DDP-wrapped model.
    try:
        MixedPrecision("bf16-mixed").prepare(DistributedDataParallel(c.make_model()), torch.optim.SGD([torch.zeros(1)], lr=1))
        results["prepare_ddp_error"] = None
    except ValueError as e:
        results["prepare_ddp_error"] = str(e)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    c.finish()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return c.spawn(_worker, tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ddp_matches_single_process(ranks: list[dict[str, Any]], name: str) -> None:
    policy, prec_kw, _, accum = SCENARIOS[name]
    r0, r1 = ranks[0][name], ranks[1][name]
    expected_skips = [s == c.POISON_STEP for s in range(c.STEPS)]
    # rank 1 alone saw the inf; both skipped the same step, with the same loss scales
    assert r0["skipped"] == r1["skipped"] == expected_skips
    assert r0["scales"] == r1["scales"]
    # the replicas are bit-identical (the reduced gradients are the same on every rank)
    assert c.max_diff(r0["params"], r1["params"]) == 0.0
    ref = _run(policy, prec_kw, {}, accum, rank=0, world=1)
    assert ref["skipped"] == expected_skips
    assert ref["scales"] == r0["scales"]
    diff = c.max_diff(r0["params"], ref["params"])
    assert diff <= TOL[policy[:4]], f"{name}: max |ddp - single| = {diff:.3g}"
    # and training moved the weights (the comparison is not vacuous)
    init = {k: v.float().reshape(-1).tolist() for k, v in c.make_model().state_dict().items()}
    moved = c.max_diff(init, ref["params"])
    assert moved > 1e-2 and moved > 10 * diff, (moved, diff)
    print(f"\n{name}: max|ddp - single| = {diff:.3g}, weights moved {moved:.3g}")


@pytest.mark.parametrize("how", list(CLEARS))
@pytest.mark.parametrize("accum", [1, 2])
def test_every_way_to_clear_gradients_under_wrap_ddp_matches_opt_zero_grad(
    ranks: list[dict[str, Any]], accum: int, how: str
) -> None:
    for r in ranks:
        ref, got = r[f"clear/{accum}/reference"], r[f"clear/{accum}/{how}"]  # reference: opt.zero_grad()
        assert got["skipped"] == ref["skipped"] == [s == c.POISON_STEP for s in range(c.STEPS)]
        assert c.max_diff(got["params"], ref["params"]) == 0.0


@pytest.mark.parametrize("policy", ["bf16-master", "fp16-master"])
def test_plain_ddp_around_masters_trains_like_wrap_ddp(ranks: list[dict[str, Any]], policy: str) -> None:
    init = ranks[0]["plain_ddp_init"]
    for r in ranks:
        got = r[f"plain_ddp_{policy}"]
        # plain DDP reduces in the half dtype, wrap_ddp in FP32: they agree to that dtype's rounding
        assert got["diff"] <= TOL[policy[:4]], got["diff"]
        assert c.max_diff(init, got["moved"]) > 10 * max(got["diff"], 1e-6)


def test_prepare_on_ddp_model_is_refused(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["prepare_ddp_error"] is not None and "prepare the plain model, then wrap it" in r["prepare_ddp_error"]


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-master", "fp16-master"])
def test_gradient_edits_between_backward_and_step_reach_the_step_under_wrap_ddp(
    ranks: list[dict[str, Any]], policy: str
) -> None:
    for r in ranks:
        clipped, torch_clipped = r[f"grad_edit/{policy}/prec"], r[f"grad_edit/{policy}/torch"]
        assert c.max_diff(torch_clipped["params"], clipped["params"]) <= 1e-6  # torch's clip = prec.clip_grad_norm_
        assert 0 < clipped["moved"] < 2e-3  # clipped to a 1e-3 norm: a small step, not the raw one (~0.4)
        assert r[f"grad_edit/{policy}/zero"]["moved"] == 0.0  # zeroed gradients: no step at all
    assert "still carries the loss scale" in (ranks[0]["ddp_scaled_read_error"] or "")


def test_wrap_ddp_of_a_compiled_model_says_to_compile_the_ddp_module(ranks: list[dict[str, Any]]) -> None:
    assert "compile the result instead: torch.compile(wrap_ddp(prec, model))" in (ranks[0]["wrap_compiled_error"] or "")


@pytest.mark.parametrize("after", [False, True], ids=["channels_last-before-prepare", "channels_last-after-prepare"])
@pytest.mark.parametrize("policy", CNN_POLICIES)
def test_a_channels_last_model_under_wrap_ddp_matches_one_process(ranks: list[dict[str, Any]], policy: str,
                                                                  after: bool) -> None:
    ref = _cnn_run(policy, after, world=1)
    for r in ranks:
        got = r[f"cnn/{policy}/{after}"]
        assert got["reads"] == [0, 0, 0] and got["layout_warnings"] == []
        # every rank saw the same data: the reduction (in FP32) of equal gradients is the one-process gradient
        diff = c.max_diff(got["params"], ref["params"])
        assert diff <= TOL[policy[:4]], diff
    assert c.max_diff(ranks[0][f"cnn/{policy}/{after}"]["params"], ranks[1][f"cnn/{policy}/{after}"]["params"]) == 0.0
