"""trace_nonfinite names the first module that produced inf/NaN, in forward or backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mixprec import cast_module
from mixprec.numerics import trace_nonfinite

FP16 = "p=f32,c=f16"  # fp16 autocast, no loss scaling (the trace scales explicitly)


def _loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).float().pow(2).mean()


class Planted(nn.Module):
    """``big`` produces activations around 1e6 (> 65504): inf/NaN in FP16, finite in FP32 and BF16."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)  # in-place on a module output: the tracer must cope
        self.big = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.big.weight.mul_(1e6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.big(self.act(self.a(x)))))


class _Blow(torch.autograd.Function):
    """Identity forward, gradient x1e6 backward (a planted backward blow-up)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g * 1e6


class BlowUp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Blow.apply(x)


class PlantedBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.blowup = BlowUp()
        self.b = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.blowup(self.a(x))))


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def test_planted_forward_overflow_is_named_in_forward() -> None:
    r = trace_nonfinite(Planted(), X, _loss, FP16)
    assert r.found and (r.phase, r.module, r.where, r.module_type) == ("forward", "big", "output", "Linear")
    assert r.input_stats and r.input_stats[0].all_finite and r.input_stats[0].dtype == "f16"
    assert not r.output_stats[0].all_finite
    rr = r.fp32_rerun
    assert rr is not None and rr.finite and rr.precision_is_cause and rr.exceeds == ["f16"] and rr.absmax > 65504
    assert "'big' (Linear)" in r.explanation and "precision is the cause" in r.explanation
    # big's output itself (~1e6 in FP32) exceeds FP16: an island would hand it back in FP16 (see below)
    assert r.output_exceeds_range and "name:big" not in str(r)
    assert "island would not help" in r.advice and "bf16" in r.advice and "rescale" in r.advice
    assert r.to_dict()["module"] == "big"


def test_an_fp32_island_does_not_fix_an_output_beyond_fp16() -> None:
    # The reference for the advice above: with big an FP32 island its output is still inf in FP16.
    r = trace_nonfinite(Planted(), X, _loss, FP16 + ",i=norm+name:big")
    assert (r.module, r.where) == ("big", "output") and r.kind in ("inf", "nan", "inf and nan")
    assert r.fp32_rerun is not None and r.fp32_rerun.absmax is not None and r.fp32_rerun.absmax > 65504
    assert "island would not help" in r.advice


class _Intermediate(nn.Module):
    """Scales up then down in its own code: the intermediate (~1e6) overflows FP16, the output (~1) fits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 1e6) / 1e6


def _intermediate_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), _Intermediate(), nn.Linear(8, 1))


def test_an_intermediate_overflow_gets_island_advice_and_the_island_fixes_it() -> None:
    r = trace_nonfinite(_intermediate_model(), X, _loss, FP16)
    assert (r.module, r.where) == ("1", "output") and r.fp32_rerun is not None
    assert r.fp32_rerun.precision_is_cause and r.fp32_rerun.exceeds == [] and not r.output_exceeds_range
    assert "i=norm+name:1" in r.advice
    # and following the advice helps: the island computes the intermediate in FP32
    assert not trace_nonfinite(_intermediate_model(), X, _loss, FP16 + ",i=norm+name:1").found


def test_the_same_model_is_clean_in_bf16_and_fp32() -> None:
    for policy in ("bf16-mixed", "fp32"):
        r = trace_nonfinite(Planted(), X, _loss, policy)
        assert not r.found and r.loss is not None
        assert str(r).startswith("No inf/NaN")


def test_planted_backward_blow_up_is_named_in_backward() -> None:
    r = trace_nonfinite(PlantedBackward(), X, _loss, FP16, loss_scale=2.0**10)
    assert (r.found, r.phase, r.module, r.where) == (True, "backward", "blowup", "grad_input")
    assert all(s.all_finite for s in r.input_stats)  # the gradient arriving at its output was finite
    assert r.fp32_rerun is not None and r.fp32_rerun.precision_is_cause
    assert "lower the loss scale" in r.explanation
    # with FP16 parameters (fp16-master) too; and no inf/NaN in FP32
    assert trace_nonfinite(PlantedBackward(), X, _loss, "fp16-master", loss_scale=2.0**10).module == "blowup"
    assert not trace_nonfinite(PlantedBackward(), X, _loss, "fp32", loss_scale=2.0**10).found


def test_a_parameter_gradient_overflow_names_its_module() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    # Large activations into the head: its weight gradient (activations x output gradient, summed over
    # the batch) overflows FP16 first, while the gradients flowing between modules stay finite.
    r = trace_nonfinite(m, X * 300, _loss, FP16, loss_scale=2.0**8)
    assert (r.phase, r.module, r.where) == ("backward", "1", "param_grad")
    assert "parameter 'weight'" in r.detail
    # A larger input overflows earlier: in the root's cast of the FP32 output gradient back to FP16
    # (cast_module's output cast is the root's own code), before any module's backward runs.
    r = trace_nonfinite(m, X * 1000, _loss, FP16, loss_scale=2.0**8)
    assert (r.phase, r.module, r.where) == ("backward", "", "grad_output")
    assert r.input_stats[0].absmax > 65504


class _Inner(nn.Module):
    """``lin``, optionally a LayerNorm, then x1e6 in its own code (inf in FP16), then ``out``."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8) if norm else None
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.norm is not None:
            h = self.norm(h)
        return self.out(h * 1e6)  # the multiply is _Inner's own code


class _Outer(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = _Inner(norm)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def test_overflow_in_a_parents_own_code_names_the_parent() -> None:
    r = trace_nonfinite(_Outer(), X, _loss, FP16)
    assert (r.phase, r.module, r.where) == ("forward", "inner", "input")
    assert "between 'inner.lin' and 'inner.out'" in r.detail
    assert r.fp32_rerun is not None and r.fp32_rerun.precision_is_cause


def test_bad_data_and_bad_loss_are_not_blamed_on_a_module() -> None:
    bad = X.clone()
    bad[0, 0] = float("nan")
    r = trace_nonfinite(Planted(), bad, _loss, "fp32")
    assert (r.phase, r.module, r.where, r.kind) == ("forward", None, "input", "nan")
    assert "the batch already contains nan" in str(r)
    r = trace_nonfinite(PlantedBackward(), X, lambda m, x: m(x).sum() * float("inf"), "fp32")
    assert (r.phase, r.module, r.where) == ("forward", None, "loss")


def test_precision_is_not_the_cause_when_fp32_fails_too() -> None:
    class LogNeg(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x - 100)  # NaN in any precision

    m = nn.Sequential(nn.Linear(8, 8), LogNeg(), nn.Linear(8, 1))
    r = trace_nonfinite(m, X, _loss, FP16)
    assert (r.module, r.where) == ("1", "output")
    assert r.fp32_rerun is not None and r.fp32_rerun.precision_is_cause is False
    assert "not a precision problem" in str(r)


def test_the_model_is_left_untouched() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    m(X).sum().backward()
    before = copy.deepcopy(m.state_dict())
    grads = [p.grad.clone() for p in m.parameters()]
    for kwargs in ({}, {"copy_model": False}):
        trace_nonfinite(m, X, _loss, **kwargs)
        assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), grads))
        assert not any(mod._forward_hooks or mod._forward_pre_hooks for mod in m.modules())
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items() if "running" not in k and "num_batches" not in k)
    trace_nonfinite(m, X, _loss, FP16)  # policy runs use a cast copy
    assert all(p.dtype == torch.float32 for p in m.parameters())


def test_a_prepared_model_is_traced_as_it_is() -> None:
    m = cast_module(Planted(), "fp16-master")
    with pytest.raises(ValueError, match="already prepared"):
        trace_nonfinite(m, X, _loss, "fp16-master")
    r = trace_nonfinite(m, X, _loss)  # half parameters compute in FP16 without autocast
    assert (r.phase, r.module) == ("forward", "big")


def test_forward_only_without_loss_fn() -> None:
    r = trace_nonfinite(Planted(), X, policy=FP16)
    assert (r.phase, r.module, r.loss) == ("forward", "big", None)


def test_the_fp32_rerun_of_a_module_with_an_fp32_island_runs_in_fp32() -> None:
    """The re-run copy drops mixprec's casting forwards: an island inside it would hand back FP16.

    ``_Inner`` multiplies by 1e6 in its own code (inf in FP16), so the tracer re-runs all of
    ``_Inner`` in FP32; it contains a LayerNorm, an FP32 island whose wrapped forward casts its
    output to the compute dtype. Kept in the copy, that output met an FP32 linear: "mat1 and mat2
    must have the same dtype", and no re-run.
    """
    m = cast_module(_Outer(norm=True), "fp16-master")  # traced as it is: FP16 weights, the LayerNorm an FP32 island
    r = trace_nonfinite(m, X, _loss)
    assert (r.phase, r.module) == ("forward", "inner")
    rr = r.fp32_rerun
    assert rr is not None and rr.precision_is_cause and rr.finite, rr
    assert callable(m.inner.norm.forward) and "forward" in m.inner.norm.__dict__  # the model itself keeps its island


class HugeWeight(nn.Module):
    """One weight of 1e5: finite in FP32, inf once the weights are stored in FP16."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.a.weight[0, 0] = 1e5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.a(x))


@pytest.mark.parametrize("preset", ["fp16-master", "fp16-pure"])
def test_the_fp32_rerun_takes_the_fp32_weights_not_the_cast_ones(preset: str) -> None:
    """Under a half-parameter policy the cast copy's weight is already inf: the FP32 re-run uses the model's FP32
    weights, so precision is (rightly) the cause; it used to copy the inf weight and blame something else."""
    r = trace_nonfinite(HugeWeight(), X, _loss, preset)
    assert r.found and r.module == "a"
    assert r.fp32_rerun is not None and r.fp32_rerun.precision_is_cause is True
    assert "the model's FP32 weights" in r.fp32_rerun.note and "precision is the cause" in str(r)


def test_the_fp32_rerun_of_a_prepared_run_takes_its_masters() -> None:
    import warnings

    import mixprec

    prec = mixprec.MixedPrecision("fp16-master")
    model = HugeWeight()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on a CPU
        model, _ = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert torch.isinf(model.a.weight).any()  # the FP16 weight; its master holds 1e5
    with prec.autocast():
        r = trace_nonfinite(model, X, _loss)
    assert r.found and r.module == "a"
    assert r.fp32_rerun is not None and r.fp32_rerun.precision_is_cause is True
    assert "the run's FP32 masters" in r.fp32_rerun.note


def test_no_precision_verdict_when_the_traced_step_ran_in_fp32() -> None:
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    m[0].register_forward_hook(lambda mod, i, o: o * float("inf"))  # a planted inf in an FP32 run
    r = trace_nonfinite(m, X, _loss)
    assert r.found and r.module == "0"
    assert r.fp32_rerun is not None and r.fp32_rerun.precision_is_cause is False and r.fp32_rerun.finite is None
    assert "already ran in FP32" in str(r) and "precision is the cause" not in str(r)


def test_a_trace_under_no_grad_still_runs_its_backward() -> None:
    with torch.no_grad():
        r = trace_nonfinite(PlantedBackward(), X, _loss, FP16, loss_scale=2.0**10)
    assert (r.found, r.phase, r.module) == (True, "backward", "blowup")


def test_tracing_a_live_master_run_in_place_keeps_its_pending_master_gradients() -> None:
    """copy_model=False between backward and step of a bf16-master run: the trace's backward runs the run's
    accumulation hooks; the FP32 master gradients are restored with the parameters' own."""
    import warnings

    import mixprec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    prec = mixprec.MixedPrecision("bf16-master")
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with prec.autocast():
        prec.backward(model(X).float().pow(2).mean())
    before = [m.grad.clone() for m in opt.masters]
    with warnings.catch_warnings(), prec.autocast():
        warnings.simplefilter("ignore")
        trace_nonfinite(model, X * 3, _loss, copy_model=False)
    assert all(torch.equal(m.grad, b) for m, b in zip(opt.masters, before))
    with pytest.raises(ValueError, match="under torch.inference_mode"), torch.inference_mode():
        trace_nonfinite(model, X, _loss)


def _compiled(model: nn.Module, calls: list[int]) -> nn.Module:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        calls.append(1)  # counts the graphs dynamo compiles
        return gm.forward

    return torch.compile(model, backend=backend)


def test_a_compiled_model_is_traced_under_plain_names_without_compiling() -> None:
    calls: list[int] = []
    cm = _compiled(_intermediate_model(), calls)
    r = trace_nonfinite(cm, X, _loss, FP16)
    assert (r.module, r.where) == ("1", "output")  # not '_orig_mod.1'
    assert "_orig_mod" not in r.advice and "i=norm+name:1" in r.advice
    assert calls == []  # the inner module ran eagerly: no dynamo frames, so no graph breaks
    # the advised island is accepted by a compiled model's policy and fixes it
    assert not trace_nonfinite(_compiled(_intermediate_model(), calls), X, _loss, FP16 + ",i=norm+name:1").found
    # the same without a policy, in place, on a compiled model of FP16 weights
    cm16 = _compiled(_intermediate_model().half(), calls)
    r16 = trace_nonfinite(cm16, X.half(), _loss, copy_model=False)
    assert (r16.module, r16.where) == ("1", "output") and calls == []
    assert r16.fp32_rerun is not None and r16.fp32_rerun.precision_is_cause


def test_input_statistics_are_labelled_with_the_dtype_the_step_ran_in() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), _Log())
    x = -X.abs() - 1.0  # log of negatives: NaN in any format
    r = trace_nonfinite(m, x, _loss)  # a plain FP32 model, no policy
    assert r.found and r.module == "1" and r.stats_dtype == "f32"
    assert r.input_stats[0].dtype == "f32" and r.input_stats[0].source_dtype == "f32"
    assert " in f32." in r.explanation and " in f16" not in r.explanation
    # under an FP16 policy the statistics are for FP16, the compute dtype
    assert trace_nonfinite(m, x, _loss, FP16).stats_dtype == "f16"


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def test_a_prepared_mixed_model_traced_outside_autocast_is_labelled_with_the_dtype_it_ran_in() -> None:
    import warnings

    import mixprec as mp

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), _Log(), nn.Linear(8, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fp16 on CPU is slow: prepare warns
        prec = mp.MixedPrecision("fp16-mixed")
        model, _ = prec.prepare(m, torch.optim.SGD(m.parameters(), lr=0.0))
    seen: list[torch.dtype] = []  # the reference: the dtype the failing module's input really had
    h = model[1].register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    try:
        x = -X.abs() - 1.0  # FP32 weights outside autocast: an FP32 step
        r = trace_nonfinite(model, x, _loss)
        assert r.found and r.module == "1" and seen[-1] == torch.float32
        assert r.stats_dtype == "f32" and r.input_stats[0].dtype == "f32" and " in f16" not in r.explanation
        # inside the run's autocast the same step computes in FP16, and the label says so
        with prec.autocast():
            r16 = trace_nonfinite(model, x, _loss)
        assert r16.module == "1" and seen[-1] == torch.float16 and r16.stats_dtype == "f16"
    finally:
        h.remove()
