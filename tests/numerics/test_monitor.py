"""NumericsMonitor: sampling, unscaling, stagnation, overflow risk, and the paper's loss-scaling finding."""

from __future__ import annotations

import copy
import json
import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import autocast
from mixprec.numerics import NumericsMonitor


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 1))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, mon: NumericsMonitor | None = None,
           loss_weight: float = 1.0) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        (model(x).pow(2).mean() * loss_weight).backward()
        opt.step()
        opt.zero_grad()
        if mon is not None and mon._manual:
            mon.step()


def test_samples_every_n_steps_and_detaches() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = NumericsMonitor(model, every=4)
    with mon:
        _train(model, opt, 10)
    assert mon._sampled_steps == 3  # steps 0, 4, 8
    rep = mon.report()
    assert rep.sampled_steps == 3 and rep.every == 4
    assert rep.module("0").samples == 3
    assert not mon._handles
    n_hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    assert n_hooks == 0 and all(not p._backward_hooks for p in model.parameters())


def test_gradient_accumulation_and_eval_forwards_stay_in_their_step() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NumericsMonitor(model, every=2, optimizer=opt) as mon:  # steps counted at opt.step()
        for _step in range(4):
            for _ in range(3):  # three micro-batches per step
                model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                model(torch.randn(4, 8))  # an evaluation forward
    # An evaluation forward after optimizer.step() belongs to the next step (it sees the new weights), so
    # the sampled steps are 0 (3 micro-batches), 2 (the eval forward after step 1's update, 3 micro-batches)
    # and 4 (the last eval forward): 3 steps, 8 forwards; one-forward-one-step counting would give 16 steps.
    assert mon._sampled_steps == 3
    assert mon.report().module("0").samples == 8
    assert "step" not in opt.__dict__  # the wrapper is gone after detach
    # without an optimizer, every forward that records a graph is a step; no_grad forwards are not
    with NumericsMonitor(model, every=2) as mon2:
        for _ in range(4):
            model(torch.randn(4, 8)).sum().backward()
            with torch.no_grad():
                model(torch.randn(4, 8))
    assert mon2._sampled_steps == 2 and mon2.report().module("0").samples == 4


def test_manual_step_counting_with_gradient_accumulation() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NumericsMonitor(model, every=2, manual_steps=True) as mon:
        for _step in range(4):
            for _ in range(3):  # three micro-batches per step
                model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    assert mon._sampled_steps == 2  # steps 0 and 2 (step 4, begun by the last step() call, saw nothing)
    assert mon.report().module("0").samples == 6  # 2 sampled steps x 3 micro-batches


def test_gradients_are_unscaled_by_the_loss_scale() -> None:
    def grad_max(scale: float | None) -> float:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with NumericsMonitor(model, loss_scale=scale) as mon:
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(3))
            (model(x).pow(2).mean() * (scale or 1.0)).backward()
            opt.step()
        rep = mon.report()
        assert rep.loss_scale == (scale or 1.0)
        return rep.grad_absmax

    assert grad_max(1024.0) == pytest.approx(grad_max(None), rel=1e-6)
    # a LossScaler-like object and a torch GradScaler are read too
    class FakeScaler:
        loss_scale = torch.tensor(256.0)

    model = _mlp()
    with NumericsMonitor(model, loss_scale=FakeScaler()) as mon:
        (model(torch.randn(4, 8)).sum() * 256).backward()
    assert mon.report().loss_scale == 256.0
    gs = torch.amp.GradScaler("cpu", init_scale=512.0)
    model = _mlp()
    with NumericsMonitor(model, loss_scale=gs) as mon:
        gs.scale(model(torch.randn(4, 8)).sum()).backward()
    assert mon.report().loss_scale == 512.0


def test_output_overflow_names_the_module_and_advises_bf16_not_an_island() -> None:
    # An FP32 island hands its outputs back in the compute dtype (_casting._island_forward): a module whose
    # output itself exceeds FP16's maximum still overflows inside one, so no island and no FP16 policy.
    model = _mlp()
    with torch.no_grad():
        model[0].weight.mul_(5e4)  # activations ~1e5: beyond FP16's 65504
    with NumericsMonitor(model) as mon:
        model(torch.randn(32, 8)).sum().backward()
    rep = mon.report()
    assert rep.overflow_risk[:2] == ["0", "1"]  # the Linear and the ReLU that passes its values on
    assert rep.module("0").act_overflow_f16 > 0 and rep.module("0").fp16_headroom_bits < 0
    assert rep.recommended_islands == []
    assert rep.module("2").norm_island
    finding = next(f for f in rep.findings if f.startswith("0 (Linear)"))
    assert "beyond the FP16 maximum" in finding and "island would not help" in finding and "BF16" in finding
    assert rep.fp16_policy is None


def test_island_recommended_when_the_output_fits_fp16() -> None:
    # activations ~1e4: within FP16's range but inside the 16x margin: the output fits, an island keeps what
    # runs inside the module (and its backward) in FP32
    model = _mlp()
    with torch.no_grad():
        model[0].weight.mul_(4e3)
    with NumericsMonitor(model) as mon:
        model(torch.randn(32, 8)).sum().backward()
    rep = mon.report()
    m0 = rep.module("0")
    assert m0.act_overflow_f16 == 0 and 65504 / 16 <= m0.act_absmax < 65504
    assert "name:0" in rep.recommended_islands
    assert "LayerNorm" not in " ".join(rep.recommended_islands)  # norms are islands already
    assert rep.fp16_policy is not None and "i=norm+name:0" in rep.fp16_policy


def test_bf16_stagnation_of_tiny_updates() -> None:
    for lr, expect_high in ((1e-7, True), (1e-1, False)):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        with NumericsMonitor(model, optimizer=opt) as mon:
            _train(model, opt, 3)
        st = mon.report().stagnation
        if expect_high:
            # every element stagnates except biases that start at zero (any update of 0 is representable)
            assert st["bf16"] > 0.75 and st["f16"] > 0.5, st
            assert dict(st["worst"])["0.weight"] == 1.0
        else:  # only the LayerNorm weights (~1, small gradients) stagnate noticeably
            assert st["bf16"] < 0.3, st
        assert st["bf16"] >= st["f16"]  # BF16 has 3 fewer mantissa bits


def test_report_json_table_and_repr() -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    with NumericsMonitor(model, optimizer=opt) as mon:
        _train(model, opt, 2)
    rep = mon.report()
    d = json.loads(rep.to_json())
    assert d["schema"] == "mixprec.numerics/1" and d["recommended_preset"] == "bf16-mixed"
    assert set(d["histograms"]) == {"activations", "activation_grads", "param_grads"}
    text = rep.table()
    assert "Recommended preset: bf16-mixed" in text and "0.weight" in text
    assert "NumericsMonitor(4 modules, 6 params" in repr(mon)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"every=0: sample one step in every N"):
        NumericsMonitor(_mlp(), every=0)
    with pytest.raises(ValueError, match=r"modules=\['nope'\] not found"):
        NumericsMonitor(_mlp(), modules=["nope"])
    with pytest.raises(TypeError, match="watches an nn.Module"):
        NumericsMonitor("model")  # type: ignore[arg-type]


# ----- the paper's finding, small ----------------------------------------------------------------------
D, OUT, L = 32, 8, 10


def _deep_tanh() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(L):
        lin = nn.Linear(D, D)
        nn.init.normal_(lin.weight, std=0.5 / math.sqrt(D))  # gain 0.5: the signal halves every layer
        nn.init.zeros_(lin.bias)
        layers += [lin, nn.Tanh()]
    last = nn.Linear(D, OUT)
    nn.init.normal_(last.weight, std=0.5 / math.sqrt(D))
    nn.init.zeros_(last.bias)
    return nn.Sequential(*layers, last)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, D, generator=g)
    with torch.no_grad():
        scale = _deep_tanh()(x).abs().mean()
    return x, torch.sin(2 * x[:, :OUT]) * scale * 4


def _fit(policy: str, scale: float, steps: int = 150) -> list[float]:
    x, y = _data()
    model = _deep_tanh()
    # Adam is invariant to the gradient's scale, so FP32 trains although every gradient is tiny; its
    # eps must sit below the gradients (the default 1e-8 is larger than most of them).
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-16)
    losses = []
    for _ in range(steps):
        with autocast(policy, "cpu"):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        (loss * scale).backward()
        for p in model.parameters():  # unscale in FP32 (the parameters and their gradients are FP32)
            p.grad.div_(scale)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_deep_unnormalised_network_needs_the_recommended_loss_scale() -> None:
    """A small reproduction of Micikevicius et al. 2018's SSD finding.

    A 10-layer tanh MLP without normalization, initialised with gain 0.5, halves its signal at every
    layer: the activation gradients of the lower layers and most weight gradients sit below FP16's
    smallest subnormal (2**-24). The monitor, run for three FP32 steps, reports the fraction that FP16
    flushes to zero and a loss-scale range. Then the same model trains for 150 full-batch Adam steps
    three times: FP32; ``p=f32,c=f16,ls=none`` (fp16-mixed without scaling); and fp16-mixed with the
    monitor's recommended static scale. FP16 runs with real FP16 compute (CPU autocast, FP16 matmuls;
    the layers are 32 wide, so it is fast enough), not an emulation.
    Measured: about 42% of the non-zero activation gradients flush at scale 1; unscaled FP16 makes ~30%
    of FP32's progress, the scaled run ends within 0.3% of FP32.
    """
    x, y = _data()
    model = _deep_tanh()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-16)
    with NumericsMonitor(model, optimizer=opt) as mon:
        for _ in range(3):
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    rep = mon.report()
    lost = rep.activation_grad_underflow["f16"]["scale_1"]
    assert lost > 0.25, lost
    assert rep.param_grad_underflow["f16"]["scale_1"] > 0.25
    sr = rep.scale_range
    assert sr.feasible and sr.low is not None and sr.high is not None
    assert sr.low >= 2.0**8 and sr.low <= sr.recommended <= sr.high
    assert rep.grad_absmax * sr.high < 65504 <= rep.grad_absmax * sr.high * 2
    assert any("flush to zero in FP16 without loss scaling" in f for f in rep.findings)
    # the report evaluated at the recommended scale: (almost) nothing lost
    assert mon.report(loss_scale=sr.recommended).activation_grad_underflow["f16"]["current_scale"] <= 0.001

    fp32 = _fit("fp32", 1.0)
    unscaled = _fit("p=f32,c=f16,ls=none", 1.0)
    scaled = _fit(f"p=f32,c=f16,ls=static:{sr.recommended:g}", sr.recommended)

    def progress(losses: list[float]) -> float:
        return (losses[0] - min(losses[-10:])) / (fp32[0] - min(fp32[-10:]))

    assert fp32[-1] < 0.2 * fp32[0]  # FP32 learns
    assert progress(unscaled) < 0.6 and unscaled[-1] > 2 * fp32[-1]  # FP16 without scaling lags
    assert progress(scaled) == pytest.approx(1.0, abs=0.03)  # the recommended scale tracks FP32
    assert scaled[-1] == pytest.approx(fp32[-1], rel=0.05)


def _stagnating_norm_run(policy: Any = None) -> Any:
    """A Linear + LayerNorm model whose LayerNorm weights (~1) and Linear weights get updates far below BF16's half ulp."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))
    for lin in (model[0], model[2]):
        nn.init.zeros_(lin.bias)  # a zero weight never stagnates: only the three weights are named
    # lr 1e-5: updates ~1e-6, above FP32's half ulp of the weights (they move) and far below BF16's (2^-9 at 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    with NumericsMonitor(model, optimizer=opt, **({} if policy is None else {"policy": policy})) as mon:
        _train(model, opt, 1)
    return mon.report()


def test_bf16_stagnation_finding_skips_fp32_islands() -> None:
    # LayerNorm weights stay FP32 under every preset: the finding must not name them (issue 15.4).
    rep = _stagnating_norm_run()
    (finding,) = [f for f in rep.findings if "below half a BF16 ulp" in f]
    assert "0.weight" in finding and "2.weight" in finding
    assert "1.weight" not in finding and "1.bias" not in finding
    assert all(not name.startswith("1.") for name, _ in rep.stagnation["worst"]), rep.stagnation
    norm_w = next(p for p in rep.params if p.name == "1.weight")
    assert norm_w.fp32_island and norm_w.updated and norm_w.stagnant_bf16 == 1.0  # still measured, only left out of the finding
    assert not next(p for p in rep.params if p.name == "0.weight").fp32_island
    assert "FP32 island" in rep.table()


def test_bf16_stagnation_finding_follows_the_policys_islands() -> None:
    # Every stagnating weight is an island under this policy (norm + the Linears by name): no finding.
    rep = _stagnating_norm_run(policy="p=bf16,c=bf16,o=f32,m=f32,i=norm+name:0+name:2")
    assert not any("BF16 ulp" in f for f in rep.findings), rep.findings
    assert rep.stagnation["bf16"] == 0.0 and rep.stagnation["worst"] == []
    # A policy without islands stores the LayerNorm in BF16 too: then it is named.
    rep = _stagnating_norm_run(policy="p=bf16,c=bf16,o=f32,m=f32,i=none")
    (finding,) = [f for f in rep.findings if "below half a BF16 ulp" in f]
    assert "1.weight" in dict(rep.stagnation["worst"]) and not any(p.fp32_island for p in rep.params)


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master", "bf16-pure"])
def test_prec_step_and_optimizer_step_are_counted_alike(preset: str) -> None:
    """The README loop steps with prec.step(opt): the monitor counts those steps as it counts opt.step() (a step
    post-hook, not a wrapper of opt.step that prec.step never calls), so the figures match step for step."""
    import mixprec

    def run(route: str) -> tuple[int, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
        prec = mixprec.MixedPrecision(preset)
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        g = torch.Generator().manual_seed(1)
        with NumericsMonitor(model, optimizer=opt, every=2) as mon:
            for _ in range(6):
                with prec.autocast():
                    loss = model(torch.randn(8, 8, generator=g)).float().pow(2).mean()
                prec.backward(loss)
                prec.step(opt) if route == "prec" else opt.step()
                opt.zero_grad()
        assert not opt._optimizer_step_post_hooks  # removed on detach
        rep = mon.report()
        return rep.sampled_steps, str(rep)

    (n_prec, text_prec), (n_opt, text_opt) = run("prec"), run("opt")
    assert n_prec == n_opt == 3  # steps 0, 2, 4
    assert text_prec == text_opt


def test_a_report_of_nothing_sampled_says_so() -> None:
    """A monitor never attached records nothing: its report warns and says so in its first lines, not silently."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = NumericsMonitor(model, optimizer=opt)  # no `with`, no attach()
    _train(model, opt, 3)
    with pytest.warns(UserWarning, match=r"NOTHING WAS SAMPLED: the monitor records only while attached"):
        rep = mon.report()
    assert rep.sampled_steps == 0 and "NOTHING WAS SAMPLED" in str(rep).splitlines()[1]
    with mon:
        _train(model, opt, 2)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = mon.report()
    assert rep.sampled_steps == 2 and "NOTHING" not in str(rep)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_does_not_count_activations_twice(reentrant: bool) -> None:
    """The forward a checkpointed block recomputes inside backward is not sampled again: the same counts as without."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self, ckpt: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
            self.head = nn.Linear(8, 1)
            self.ckpt = ckpt

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.detach().requires_grad_()  # reentrant checkpointing needs an input that requires grad
            h = checkpoint(self.block, x, use_reentrant=reentrant) if self.ckpt else self.block(x)
            return self.head(h)

    counts = []
    for ckpt in (False, True):
        model = Net(ckpt)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with NumericsMonitor(model, optimizer=opt) as mon:
            _train(model, opt, 2)
        h = mon.histograms
        counts.append((h["activations"].total, h["activation_grads"].total, h["param_grads"].total))
    assert counts[0] == counts[1]


def _tiny_loss_run(policy: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """One step of a loss x1e-6 (gradients ~1e-8, below FP16's normal range) under ``policy``, monitored.

    Returns the report and the FP32 reference gradients of the same step.
    """
    import mixprec as mp

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
    ref = build()
    (F.mse_loss(ref(x), y) * 1e-6).backward()
    prec = mp.MixedPrecision(policy)
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fp16 on CPU is slow: prepare warns (once per process)
        model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    with NumericsMonitor(model, optimizer=opt, loss_scale=prec) as mon:
        with prec.autocast():
            loss = F.mse_loss(model(x), y) * 1e-6
        prec.backward(loss)
        prec.step(opt)
    return mon.report(), {n: p.grad for n, p in ref.named_parameters()}


def test_gradients_flushed_in_fp16_are_reported_though_they_arrive_as_zeros() -> None:
    rep, ref = _tiny_loss_run("p=f32,c=f16,ls=static:1")
    # the reference: most of these FP32 gradients flush to zero in FP16 (|g| <= 2**-25)
    g = torch.cat([t.flatten() for t in ref.values()])
    assert float(((g.abs() <= 2.0**-25) & (g != 0)).sum() / (g != 0).sum()) > 0.5
    # the flushed ones arrive as exact zeros: the underflow figure (non-zero values only) cannot see them ...
    assert rep.param_grad_underflow["f16"]["current_scale"] == 0.0
    assert rep.params[0].grad_zero > 0.5 and rep.params[0].grad_subnormal_f16_at_scale > 0.5
    # ... so a finding names them, says why, and what to do
    finding = next(f for f in rep.findings if "exact zeros" in f)
    assert "0.weight" in finding and "modules 0, 2" in finding and "underflow" in finding
    assert "larger loss scale" in finding and "bf16" in finding


def test_no_flushed_gradient_finding_at_a_good_scale_or_in_fp32() -> None:
    for policy in ("p=f32,c=f16,ls=static:65536", "fp32"):
        rep, _ = _tiny_loss_run(policy)
        assert max(p.grad_zero for p in rep.params) == 0.0, policy
        assert not any("exact zeros" in f for f in rep.findings), policy
    # zeros of ReLUs in an FP32 model are not underflow
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    with torch.no_grad():
        model[0].bias.fill_(-3.0)  # most hidden units dead: many exact-zero gradients
    with NumericsMonitor(model) as mon:
        model(torch.randn(32, 8)).sum().backward()
    rep = mon.report()
    assert max(p.grad_zero for p in rep.params) > 0.1
    assert not any("exact zeros" in f for f in rep.findings)


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def test_nan_made_in_fp32_is_not_a_precision_problem_and_propagators_are_not_blamed() -> None:
    model = nn.Sequential(_Log(), nn.Linear(16, 4), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt) as mon:
        for i in range(3):
            x = torch.rand(8, 16) + 0.5
            if i == 1:
                x[0, 0] = -1.0  # log(-1) = NaN, in FP32 as in any format
            F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()
            opt.step()  # step 1's NaN gradient makes the Linear's weights NaN: step 2 it outputs NaN from finite inputs
            opt.zero_grad()
    rep = mon.report()
    assert all(m.act_dtypes == ["f32"] for m in rep.modules)
    assert rep.module("0").act_nonfinite > 0 and not rep.module("0").nonfinite_input
    assert rep.module("1").act_nonfinite > 0 and rep.module("1").nonfinite_input  # NaN inputs, then NaN weights
    assert rep.overflow_risk == [] and rep.recommended_islands == []
    assert rep.fp16_policy is not None and "name:" not in rep.fp16_policy
    blamed = [f for f in rep.findings if "inf/NaN" in f]
    assert len(blamed) == 1 and blamed[0].startswith("0 (_Log)") and "not a precision problem" in blamed[0]
    assert not any(f.startswith(("1 (Linear)", "2 (ReLU)")) for f in rep.findings)
    assert not any("FP16 overflows" in f for f in rep.findings)


def test_nan_made_in_fp16_activations_still_gets_an_island() -> None:
    # the same NaN made in a half-precision run: the monitor cannot tell an intermediate overflow from bad
    # data, so the module gets its island (the tracer's FP32 re-run decides which it is)
    model = nn.Sequential(nn.Linear(16, 16), _Log(), nn.Linear(16, 4))
    with NumericsMonitor(model) as mon, torch.autocast("cpu", dtype=torch.bfloat16):
        model(-torch.rand(8, 16) - 1.0).float().sum().backward()
    rep = mon.report()
    assert rep.module("1").act_dtypes == ["bf16"] and rep.module("1").act_nonfinite > 0
    assert "1" in rep.overflow_risk and "2" not in rep.overflow_risk  # 2 only passed the NaN on
    assert "name:1" in rep.recommended_islands


def test_a_compiled_model_is_reported_under_plain_names() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    with torch.no_grad():
        model[0].weight.mul_(4e3)  # at risk in FP16: an island is recommended
    cm = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(cm.parameters(), lr=0.0)
    with NumericsMonitor(cm, optimizer=opt) as mon:
        cm(torch.randn(32, 8)).sum().backward()
        opt.step()
    rep = mon.report()
    assert [m.name for m in rep.modules] == ["0", "1", "2"]  # as the uncompiled model names them
    assert [p.name for p in rep.params] == [n for n, _ in model.named_parameters()]
    assert rep.recommended_islands and all("_orig_mod" not in i for i in rep.recommended_islands)
    assert rep.fp16_policy is not None and "_orig_mod" not in rep.fp16_policy
    # qualified names are given as users know them (a compiled model's own names still work)
    assert [n for n, _ in NumericsMonitor._select(cm, ["2", "_orig_mod.0"])] == ["2", "0"]


# ----- who made the inf/NaN (regressions of the pass-through rule) ----------------------------------------
class _Attn(nn.Module):
    """A leaf attention: q @ k^T of large projections overflows FP16; an additive mask is a keyword input."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.wq = nn.Parameter(torch.randn(d, d) * 30)
        self.wk = nn.Parameter(torch.randn(d, d) * 30)
        self.wv = nn.Parameter(torch.randn(d, d) * 0.1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        sc = q @ k.transpose(-1, -2)
        if mask is not None:
            sc = sc + mask
        return torch.softmax(sc.float(), -1).to(v.dtype) @ v


class _MaskedNet(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.attn = _Attn(d)
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(self.inp(x), mask=mask))


def _masked_run(half: bool) -> Any:
    torch.manual_seed(0)
    net = _MaskedNet()
    x = torch.randn(4, 8, 16) * 3
    mask = torch.triu(torch.full((8, 8), float("-inf")), 1)  # causal: -inf above the diagonal, legitimately
    with NumericsMonitor(net) as mon, torch.autocast("cpu", torch.float16, enabled=half):
        y = net(x, mask)
    return mon.report(), y


def test_a_minus_inf_mask_does_not_hide_an_overflow_in_the_module_it_is_given_to() -> None:
    # the reference: in FP32 the same step, mask included, is finite, and nothing is reported
    rep32, y32 = _masked_run(half=False)
    assert torch.isfinite(y32).all()
    assert all(m.act_nonfinite == 0 for m in rep32.modules) and not any("inf/NaN" in f for f in rep32.findings)
    # in FP16 q @ k^T overflows: attn made the NaN (the -inf of its mask input is no NaN it received) ...
    rep, y = _masked_run(half=True)
    assert (~torch.isfinite(y)).float().mean() > 0.5
    attn, out = rep.module("attn"), rep.module("out")
    assert attn.act_nonfinite > 0 and not attn.nonfinite_input and attn.computed_in_half
    assert out.act_nonfinite > 0 and out.nonfinite_input  # ... and out only passed it on
    assert rep.overflow_risk == ["attn"] and rep.recommended_islands == ["name:attn"]
    blamed = [f for f in rep.findings if "inf/NaN" in f]
    assert len(blamed) == 1 and blamed[0].startswith("attn (_Attn) produced inf/NaN activations in f16")


class _RootSqrt(nn.Module):
    """NaN made in the root's own code, between its two children (sqrt of a negative)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.sqrt(self.a(x)))


def _nan_from_outside(source: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.rand(8, 16)
    if source == "batch":
        x[0, 0] = float("nan")
        return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), x
    if source == "root code":
        model = _RootSqrt()
        with torch.no_grad():
            model.a.bias.fill_(-10.0)  # a's outputs negative: sqrt gives NaN in the root's own forward
        return model, x
    # weights made NaN by an earlier (non-finite) update, in a child of a child
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4))
    with torch.no_grad():
        model[0][0].weight[3, 5] = float("nan")
    return model, x


@pytest.mark.parametrize("source", ["batch", "root code", "weights"])
@pytest.mark.parametrize("modules", ["leaves", "all"])
def test_nan_from_outside_the_monitored_modules_is_reported_not_dropped(source: str, modules: str) -> None:
    model, x = _nan_from_outside(source)
    with NumericsMonitor(model, modules=modules) as mon:
        y = model(x)
        y.sum().backward()
    assert not torch.isfinite(y).all()  # the reference: the step did produce NaN
    rep = mon.report()
    seen = [m for m in rep.modules if m.act_nonfinite > 0]
    assert seen
    if source == "root code" and modules == "all":
        # the root is watched: its own code made the NaN from finite inputs and weights (in FP32)
        assert [m.name for m in seen if not m.nonfinite_input] == [""]
        assert any(f.startswith("(root) (_RootSqrt)") and "not a precision problem" in f for f in rep.findings)
        assert not any("entered the monitored modules" in f for f in rep.findings)
        return
    assert all(m.nonfinite_input for m in seen)  # nobody watched made it (the parents of NaN weights neither)
    finding = next(f for f in rep.findings if f.startswith("inf/NaN entered the monitored modules from outside"))
    assert "the batch" in finding and "own code" in finding and "weights made NaN" in finding
    assert seen[0].name in finding and "trace_nonfinite" in finding
    assert rep.overflow_risk == [] and rep.recommended_islands == []


class _Head(nn.Module):
    """An LM-style head: the matmul runs in the compute dtype, the logits come back as FP32 (``.float()``)."""

    def __init__(self, d: int, v: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(v, d) * 1e4)  # |w| < 65504: FP16 weights hold it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w.t()).float()


def test_inf_made_in_fp16_but_returned_in_fp32_is_a_precision_problem() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), _Head(64, 32))
    x = torch.randn(8, 16)
    with torch.no_grad():  # the reference: finite in FP32, beyond FP16's maximum
        ref = net(x)
    assert torch.isfinite(ref).all() and ref.abs().max() > 65504
    with NumericsMonitor(net) as mon, torch.autocast("cpu", torch.float16):
        y = net(x)
    assert y.dtype == torch.float32 and not torch.isfinite(y).all()
    rep = mon.report()
    assert not any("not a precision problem" in f for f in rep.findings)
    assert "2" in rep.overflow_risk and "name:2" in rep.recommended_islands
    finding = next(f for f in rep.findings if f.startswith("2 (_Head)"))
    assert "computed in half precision" in finding
    head = rep.module("2")
    assert head.act_dtypes == ["f32"] and head.nonfinite_made_in_half is True and head.computed_in_half
    # half weights without autocast: the same, told by the parameters' dtype
    half = copy.deepcopy(net).half()
    assert torch.isfinite(half[2].w).all()
    with NumericsMonitor(half) as mon16:
        assert not torch.isfinite(half(x.half())).all()
    head16 = mon16.report().module("2")
    assert head16.nonfinite_made_in_half is True and not head16.nonfinite_input


class _SqrtScale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x) * 5000


def test_nan_made_in_fp32_by_a_module_with_large_outputs_is_reported_consistently() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), _SqrtScale(), nn.Linear(16, 1))
    x = torch.randn(8, 16)
    with NumericsMonitor(net) as mon:
        net(x).sum().backward()
    rep = mon.report()
    with torch.no_grad():  # the reference: the module's finite outputs, NaN where its input is negative
        ref = net[1](net[0](x))
    m = rep.module("1")
    assert m.act_nonfinite == pytest.approx(float(ref.isnan().float().mean()))
    assert m.act_absmax == pytest.approx(float(ref.nan_to_num(0.0).abs().max()))
    assert not m.computed_in_half and m.act_absmax * 16 >= 65504  # within the 16x margin: at risk
    made = [f for f in rep.findings if f.startswith("1 (_SqrtScale)")]
    assert len(made) == 2
    assert "not a precision problem" in made[0] and "within 16x of the FP16 maximum" in made[1]
    assert not any("produced inf/NaN activations in" in f for f in rep.findings)  # no half-precision blame
    assert rep.recommended_islands == ["name:1"]  # for its large finite values, not for the NaN


def test_each_tensor_is_checked_for_inf_nan_once_per_step() -> None:
    # Cost: parameters once per step (not once per enclosing watched module), an input handed to several
    # modules once, outputs not read apart from their histogram (max_elements respected there).
    from torch.overrides import TorchFunctionMode

    reads: list[int] = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if getattr(func, "__name__", "") in ("isfinite", "isnan") and isinstance(args[0], torch.Tensor):
                reads.append(args[0].data_ptr())
            return func(*args, **(kwargs or {}))

    class Fork(nn.Module):  # one input, three consumers (as q, k, v projections)
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q(x) + self.k(x) + self.v(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(Fork(), nn.ReLU()), nn.Linear(64, 64))
    x = torch.randn(64, 64)
    with NumericsMonitor(model, modules="all", max_elements=16) as mon:
        for _ in range(2):
            with Count():
                model(x)
            assert len(reads) == len(set(reads)), "a tensor was checked twice in one step"
            assert {p.data_ptr() for p in model.parameters()} <= set(reads) and x.data_ptr() in reads
            reads.clear()
    assert mon.report().modules[0].act_nonfinite == 0
