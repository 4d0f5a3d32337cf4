"""FP32 masters stored as the BF16 weight plus an int16 remainder (``bf16-master-r16``, issue 29).

The exact split/join primitives are tested in ``test_remainder.py``; here the storage mode inside
``MasterWeightOptimizer`` and a prepared run: training equal bit for bit to an FP32-master run that
rounds its forward weights the same way, loss within bf16-master's seed noise of FP32, every
checkpoint path bit-exact, bytes per parameter measured, and what differs from ``bf16-master``.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec import MasterWeightOptimizer, MixedPrecision, checkpoint
from mixprec._remainder import join, split
from mixprec.bench._memory import model_state_bytes, parameter_count
from mixprec.bench._workloads import CharGPT

VOCAB, BLOCK = 32, 16


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gpt(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return CharGPT(VOCAB, BLOCK, 2, 2, 32)


def batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # A learnable sequence (next = (cur * 3 + 1) mod VOCAB) plus noise tokens, so the loss falls.
    out = []
    for _ in range(n):
        start = torch.randint(0, VOCAB, (8, 1), generator=g)
        seq = [start]
        for _ in range(BLOCK - 1):
            seq.append((seq[-1] * 3 + 1) % VOCAB)
        out.append(torch.cat(seq, 1))
    return out


def prepared(preset: str, seed: int = 0, **kw: Any) -> tuple[MixedPrecision, nn.Module, Any]:
    prec = MixedPrecision(preset, **kw)
    model = gpt(seed)
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    return prec, model, opt


def train(prec: MixedPrecision, model: nn.Module, opt: Any, data: list[torch.Tensor], poison: int = -1) -> list[float]:
    losses = []
    for i, x in enumerate(data):
        with prec.autocast():
            logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        if i == poison:
            loss = loss * float("nan")
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(float("inf") if i == poison else float(loss.detach()))  # inf == inf (NaN != NaN)
    return losses


def ties_away_reference(seed: int = 0) -> tuple[MixedPrecision, nn.Module, MasterWeightOptimizer]:
    """bf16-master with full FP32 masters whose forward weights are rounded as split() rounds them (ties away)."""
    prec, model, opt = prepared("bf16-master", seed)
    assert isinstance(opt, MasterWeightOptimizer)
    params, masters = opt._pair_lists

    def copy_back() -> None:
        for p, m in zip(params, masters):
            p.copy_(split(m)[0])

    opt._sync_edits = lambda: None  # type: ignore[method-assign]  # the weights differ from round-to-even on purpose
    opt._copy_to_model = copy_back  # type: ignore[method-assign]
    with torch.no_grad():
        copy_back()
    return prec, model, opt


def values(opt: MasterWeightOptimizer) -> list[torch.Tensor]:
    return [v.clone() for v in opt.master_values()]


def assert_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and torch.equal(x.view(torch.int32) if x.dtype == torch.float32 else x,
                                                   y.view(torch.int32) if y.dtype == torch.float32 else y), i


# ----- the storage itself ------------------------------------------------------------------------------------------
def test_prepare_stores_each_master_as_weight_plus_remainder_exactly() -> None:
    fp32 = gpt()
    prec, model, opt = prepared("bf16-master-r16")
    assert opt.master_storage == "remainder"
    by_name = dict(fp32.named_parameters())
    for (name, p), v, r in zip(model.named_parameters(), opt.master_values(), opt.remainders):
        assert torch.equal(v, by_name[name].detach()), name  # the exact pre-cast FP32 weights
        if p.dtype == torch.bfloat16:
            assert r is not None and r.dtype == torch.int16
            assert torch.equal(join(p.detach(), r), v)
        else:
            assert r is None and p.dtype == torch.float32  # an FP32 island is its own master
    # Between steps the master tensors hold no FP32 storage of their own (a 4-byte placeholder).
    half = [m for p, m in zip(opt.model_params, opt.masters) if p.dtype == torch.bfloat16]
    assert half and all(m.untyped_storage().nbytes() == 4 for m in half)
    assert all(torch.isnan(m).all() for m in half)
    with pytest.raises(RuntimeError):
        half[0].add_(1.0)  # a write outside the step is refused, not lost


def test_two_hundred_steps_equal_an_fp32_master_run_bit_for_bit() -> None:
    """The masters after every 50 steps equal those of full FP32 masters (same kernel, same rounding of the weights)."""
    data = batches(200)
    prec, model, opt = prepared("bf16-master-r16")
    rprec, rmodel, ropt = ties_away_reference()
    first = None
    for start in range(0, 200, 50):
        got = train(prec, model, opt, data[start:start + 50], poison=10 - start)
        want = train(rprec, rmodel, ropt, data[start:start + 50], poison=10 - start)
        assert got == want
        first = got[0] if first is None else first
        assert_bits(values(opt), values(ropt))
        assert_bits([p.detach() for p in model.parameters()], [p.detach() for p in rmodel.parameters()])
    assert got[-1] < 0.5 * first  # it trained (the comparison is not vacuous)
    assert bool(prec.last_step is not None)


def test_loss_stays_within_bf16_masters_seed_noise_of_fp32() -> None:
    data = batches(120)
    finals: dict[str, list[float]] = {}
    for preset in ("fp32", "bf16-master", "bf16-master-r16"):
        finals[preset] = [sum(train(*prepared(preset, seed), data)[-10:]) / 10 for seed in (0, 1, 2)]
    fp32 = finals["fp32"]
    seed_noise = max(fp32) - min(fp32)
    gap_master = max(abs(a - b) for a, b in zip(finals["bf16-master"], fp32))
    gap_r16 = max(abs(a - b) for a, b in zip(finals["bf16-master-r16"], fp32))
    assert gap_r16 <= max(seed_noise, gap_master) * 1.5 + 1e-3, (finals, seed_noise, gap_master)


@pytest.mark.parametrize("accumulation", ["fp32", "compute"])
def test_the_step_skips_nan_bit_identically_and_splits_after_every_step(accumulation: str) -> None:
    prec, model, opt = prepared("bf16-master-r16", grad_accumulation=accumulation)
    data = batches(4)
    train(prec, model, opt, data[:2])
    before = values(opt), [p.detach().clone() for p in model.parameters()], [r.clone() for r in opt.remainders if r is not None]
    train(prec, model, opt, data[2:3], poison=0)
    assert bool(prec.last_step.skipped)
    assert_bits(values(opt), before[0])
    assert_bits([p.detach() for p in model.parameters()], before[1])
    assert_bits([r for r in opt.remainders if r is not None], before[2])
    train(prec, model, opt, data[3:])
    for p, m, v in zip(opt.model_params, opt.masters, opt.master_values()):
        if p.dtype == torch.bfloat16:
            assert torch.equal(p.detach(), split(v)[0]) and m.untyped_storage().nbytes() == 4


def test_fused_step_matches_the_eager_step() -> None:
    """The compiled master step (fused=True) on joined masters: one step equals the eager step to FP32 rounding.

    Later steps are not compared elementwise: a master one FP32 ulp off can round to another BF16
    weight, and Adam's normalised update turns the forward's difference into a full-size step
    (measured: 6e-8 after five steps, 4e-4 on one bias after six). The weights stay the split of the
    masters and the losses agree."""
    data = batches(6)
    pe, me, oe = prepared("bf16-master-r16", fused=False)
    pf, mf, of = prepared("bf16-master-r16", fused=True)
    train(pe, me, oe, data[:1])
    train(pf, mf, of, data[:1])
    assert of._shadow is not None and of._shadow.view() is not None  # the fused step ran
    for a, b in zip(oe.master_values(), of.master_values()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-8)
    eager = train(pe, me, oe, data[1:])
    fused = train(pf, mf, of, data[1:])
    assert max(abs(a - b) for a, b in zip(eager, fused)) < 1e-3
    for p, v in zip(of.model_params, of.master_values()):
        if p.dtype == torch.bfloat16:
            assert torch.equal(p.detach(), split(v)[0])


@pytest.mark.parametrize("make", [torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.NAdam])
def test_any_torch_optimizer_steps_the_exact_masters(make: Any) -> None:
    """Joined masters, the wrapped optimizer's own step, split again: as with full FP32 masters, rounded ties away."""
    torch.manual_seed(0)
    fp32 = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    ref = copy.deepcopy(fp32)
    init = {p: p.detach().clone() for p in fp32.parameters()}
    fp32.to(torch.bfloat16)
    opt = MasterWeightOptimizer(make(fp32.parameters(), lr=1e-2), initial_masters=init, master_storage="remainder")
    rmasters = [p.detach().clone() for p in ref.parameters()]
    ropt = make(rmasters, lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = torch.randn(4, 8, generator=g)
        fp32(x.bfloat16()).float().square().mean().backward()
        for m, p in zip(rmasters, fp32.parameters()):
            m.grad = p.grad.float()  # the same gradients (the view of the master's)
        opt.step()
        ropt.step()
        opt.zero_grad()
    assert_bits(opt.master_values(), rmasters)


# ----- what differs from bf16-master: edits of the weights ---------------------------------------------------------
def test_an_edited_weight_keeps_its_low_bits_and_a_pruned_one_is_zero() -> None:
    prec, model, opt = prepared("bf16-master-r16")
    train(prec, model, opt, batches(2))
    w = model.lm_head.weight
    new = torch.randn(w.shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        w.copy_(new.to(torch.bfloat16))  # as model.load_state_dict() would
        w[0].zero_()  # a pruned row
    master = dict(zip(map(id, opt.model_params), opt.master_values()))[id(w)]
    ulp = (w.detach().float().abs() * 2.0**-7).clamp_min(2.0**-133)
    assert bool(((master - w.detach().float()).abs() < ulp).all())  # within one BF16 ulp of the edit, not exact
    assert bool((master[0] == 0).all())
    # prec.load_model_state_dict is the exact way in: the masters take the FP32 values bit for bit.
    fresh = gpt(seed=7)
    prec.load_model_state_dict(fresh.state_dict())
    assert_bits(opt.master_values(), [p.detach() for p in fresh.parameters()])


# ----- checkpoints -------------------------------------------------------------------------------------------------
def test_resume_through_save_and_load_is_bit_exact(tmp_path: Any) -> None:
    data = batches(12)
    p1, m1, o1 = prepared("bf16-master-r16")
    want = train(p1, m1, o1, data)
    pa, ma, oa = prepared("bf16-master-r16")
    got = train(pa, ma, oa, data[:6])
    checkpoint.save(pa.state_dict(), tmp_path / "r16.pt")
    pb, mb, ob = prepared("bf16-master-r16", seed=3)  # other initial weights: everything comes from the file
    pb.load_state_dict(checkpoint.load(tmp_path / "r16.pt"))
    got += train(pb, mb, ob, data[6:])
    assert got == want
    assert_bits(values(ob), values(o1))
    assert_bits([p.detach() for p in mb.parameters()], [p.detach() for p in m1.parameters()])


@pytest.mark.parametrize("other", ["bf16-master", "fp32"])
def test_masters_convert_to_and_from_other_policies_bit_exactly(other: str, tmp_path: Any) -> None:
    prec, model, opt = prepared("bf16-master-r16")
    train(prec, model, opt, batches(3))
    exact = values(opt)
    checkpoint.save(prec.state_dict(), tmp_path / "r16.pt")
    # r16 -> other
    oprec, omodel, oopt = prepared(other, seed=3)
    oprec.load_state_dict(checkpoint.convert_state_dict(checkpoint.load(tmp_path / "r16.pt"), other))
    there = values(oopt) if isinstance(oopt, MasterWeightOptimizer) else [p.detach().clone() for p in omodel.parameters()]
    assert_bits(there, exact)
    # ... and back: other -> r16
    back_prec, _, back_opt = prepared("bf16-master-r16", seed=4)
    back_prec.load_state_dict(checkpoint.convert_state_dict(oprec.state_dict(), "bf16-master-r16"))
    assert_bits(values(back_opt), exact)
    # An FP32 export of the r16 run is its masters.
    exported = checkpoint.fp32_state_dict(prec)
    assert_bits([exported[n] for n, _ in model.named_parameters()], exact)


def test_a_bf16_master_checkpoint_needs_an_explicit_conversion() -> None:
    prec, model, opt = prepared("bf16-master")
    other, _, _ = prepared("bf16-master-r16")
    with pytest.raises(ValueError, match="convert_state_dict"):
        other.load_state_dict(prec.state_dict())


# ----- memory --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("accumulation", "full", "r16"), [("fp32", 18, 16), ("compute", 14, 12)])
def test_two_bytes_per_parameter_less_measured(accumulation: str, full: int, r16: int) -> None:
    """Bytes of every distinct storage after a step, per parameter (no FP32 islands: a stack of Linear layers)."""
    got = {}
    for preset in ("bf16-master", "bf16-master-r16"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        prec = MixedPrecision(preset, grad_accumulation=accumulation)  # type: ignore[arg-type]
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        with prec.autocast():
            loss = model(torch.randn(8, 64)).float().square().mean()
        prec.backward(loss)
        prec.step(opt)
        got[preset] = model_state_bytes(model, opt) / parameter_count(model)
    assert got["bf16-master"] == pytest.approx(full, abs=0.01)
    assert got["bf16-master-r16"] == pytest.approx(r16, abs=0.01)


# ----- refusals ------------------------------------------------------------------------------------------------------
def test_remainder_storage_refuses_fp16_parameters_and_other_master_dtypes() -> None:
    lin = nn.Linear(4, 4).half()
    with pytest.raises(ValueError, match="bf16"):
        MasterWeightOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), master_storage="remainder")
    with pytest.raises(ValueError, match="master_storage"):
        MasterWeightOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), master_storage="half")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="p=bf16"):
        mp.Policy.parse("p=f16,m=f32:r16")
    with pytest.raises(ValueError, match="r16"):
        mp.Policy.parse("p=bf16,m=f32:r8")


def test_policy_spelling_round_trips() -> None:
    pol = mp.Policy.parse("bf16-master-r16")
    assert str(pol) == "p=bf16,c=bf16,o=f32,m=f32:r16,ls=none,i=norm,tf32=0,comp=none"
    assert mp.Policy.parse(str(pol)) == pol and pol.name == "bf16-master-r16"
    assert str(mp.Policy.parse("bf16-master")) == "p=bf16,c=bf16,o=f32,m=f32,ls=none,i=norm,tf32=0,comp=none"


def test_fsdp2_gathers_the_bf16_shards_as_they_are() -> None:
    """Under FSDP2 the shards are BF16 (prepare casts them) and the remainders are sharded beside them
    (tests/distributed/test_fsdp.py trains it on two ranks): no param_dtype cast, FP32 reduction."""
    from mixprec.distributed import fsdp_mixed_precision

    mp_policy = fsdp_mixed_precision("bf16-master-r16")
    assert mp_policy.param_dtype is None and mp_policy.reduce_dtype == torch.float32
    assert fsdp_mixed_precision("bf16-master").param_dtype == torch.bfloat16  # FP32 shards, cast when gathered


def test_copies_keep_the_remainders() -> None:
    prec, model, opt = prepared("bf16-master-r16")
    train(prec, model, opt, batches(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twin = copy.deepcopy(opt)
    assert_bits(values(twin), values(opt))
    assert all(a is not b for a, b in zip(twin.remainders, opt.remainders) if a is not None)
    # The copy steps its own weights and remainders (the original's stay as they were).
    before = values(opt)
    for p, m in zip(twin.model_params, twin.masters):
        if p.dtype == torch.bfloat16:
            m.grad = torch.ones(m.shape)
    twin.step()
    assert_bits(values(opt), before)
    moved = [not torch.equal(a, b) for a, b in zip(values(twin), before)]
    assert any(moved)


def test_the_step_cost_benchmark_reports_both_rows_and_their_bytes(capsys: pytest.CaptureFixture[str],
                                                                  load_benchmark: Any) -> None:
    module = load_benchmark("remainder_step_cost")
    assert module.main(["--width", "32", "--blocks", "1", "--steps", "2", "--no-fused", "--device", "cpu"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("eager"))
    cells = line.split()
    assert cells[3].endswith("x") and float(cells[4]) == 18.0 and float(cells[5]) == 16.0  # B/param: full, r16


@pytest.mark.parametrize("path", ["kernel", "eager fallback"])
def test_the_fused_step_joins_and_splits_in_its_kernel_and_in_its_eager_fallback(path: str, monkeypatch: Any) -> None:
    """With the fused step, the masters stay placeholders: the kernel reads weight + remainder and writes their
    split (no FP32 master is materialised); a bucket that falls back to the eager step (a compile failure under
    fused=None) joins and splits around it. Both equal the step on joined masters (fused=False) to FP32 rounding."""
    import mixprec._master as master_module
    from mixprec.optim import AdamW as MixprecAdamW

    # In the kernel on CUDA/XPU only by default (on a CPU the bit casts do not vectorise): the logic is the same here.
    monkeypatch.setattr(master_module, "REMAINDERS_IN_KERNEL", frozenset({"cpu", "cuda", "xpu"}))
    if path == "eager fallback":
        monkeypatch.setattr(MixprecAdamW, "_step_bucket_fused", lambda self, *a, **k: False)
    data = batches(3)
    pe, me, oe = prepared("bf16-master-r16", fused=False)
    pf, mf, of = prepared("bf16-master-r16", fused=True)
    joined: list[bool] = []
    real = type(of)._join_masters
    monkeypatch.setattr(type(of), "_join_masters", lambda self, *a: (joined.append(self is of), real(self, *a))[1])
    train(pe, me, oe, data[:1])
    train(pf, mf, of, data[:1])
    assert of._shadow is not None and of._shadow.remainders and not any(joined)  # the view stepped, nothing joined here
    for a, b in zip(oe.master_values(), of.master_values()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-8)
    for p, m, v in zip(of.model_params, of.masters, of.master_values()):
        if p.dtype == torch.bfloat16:
            assert torch.equal(p.detach(), split(v)[0]) and m.untyped_storage().nbytes() == 4
    train(pf, mf, of, data[1:2], poison=0)  # a skipped step leaves weights and remainders as they were
    assert bool(pf.last_step.skipped)


def test_the_step_joins_all_masters_in_one_flat_buffer_and_survives_a_replaced_weight() -> None:
    """One RemainderBank per device: its remainders are views of one buffer; ``p.data = ...`` rebuilds it, exactly."""
    data = batches(5)
    prec, model, opt = prepared("bf16-master-r16")
    rprec, rmodel, ropt = prepared("bf16-master-r16")
    train(prec, model, opt, data[:2])
    train(rprec, rmodel, ropt, data[:2])
    bank = opt._bank
    assert bank is not None and not bank.live and bank.flat.untyped_storage().nbytes() == 0
    rems = [r for r in opt.remainders if r is not None]
    assert len(rems) > 10 and all(r.untyped_storage().data_ptr() == bank.rem.untyped_storage().data_ptr() for r in rems)
    p = next(q for q in model.parameters() if q.dtype == torch.bfloat16 and q.dim() == 2)
    p.data = p.data.clone()  # new storage, same values (what .to(), some wrappers and user code do)
    train(prec, model, opt, data[2:])
    train(rprec, rmodel, ropt, data[2:])
    assert opt._bank is not bank  # rebuilt on the new weight
    for a, b in zip(opt.master_values(), ropt.master_values()):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for a, b in zip(model.parameters(), rmodel.parameters()):
        assert torch.equal(a, b)
