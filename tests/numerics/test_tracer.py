"""trace_nonfinite names the first module that produced inf/NaN, in forward or backward."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from torch import nn

from mixprec import autocast, cast_module
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
    with torch.no_grad():
        model.a.weight[0, 0] = 1.0  # prepare refuses weights beyond FP16's range: the 1e5 comes after it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on a CPU
        model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.no_grad():  # as a run whose master grew past FP16's range: the weight is its FP16 rounding
        opt.master_for(model.a.weight)[0, 0] = 1e5
        model.a.weight[0, 0] = 1e5
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


# ----- inf/NaN made in a module's own code, before it calls a submodule -------------------------------------
class _PaddedEncoder(nn.Module):
    """A healthy nn.TransformerEncoder with a key padding mask: the encoder's own code turns the boolean mask
    into an additive float mask holding -inf, before it calls its layers (torch's F._canonical_mask)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.e = nn.Embedding(30, 16)
        layer = nn.TransformerEncoderLayer(16, 4, 32, 0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.h = nn.Linear(16, 3)

    def forward(self, b: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.h(self.enc(self.e(b[0]), src_key_padding_mask=b[1]).mean(1))


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(4, 9, dtype=torch.bool)
    mask[:, 7:] = True
    return torch.randint(0, 30, (4, 9), generator=g), mask, torch.randint(0, 3, (4,), generator=g)


def _ce(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(m(b).float(), b[2])


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed", "bf16-master"])
def test_a_minus_inf_padding_mask_built_by_the_encoder_is_not_blamed_on_precision(policy: str) -> None:
    b = _padded_batch()
    assert torch.isfinite(_ce(_PaddedEncoder(), b))  # the FP32 reference: a healthy model, a finite loss
    r = trace_nonfinite(_PaddedEncoder(), b, _ce, policy)
    text = str(r)
    assert "not a precision problem" in text and "attention mask" in text
    assert "precision is the cause" not in text and "bf16" not in r.advice and r.advice == ""
    assert (r.phase, r.module, r.where, r.callee) == ("forward", "enc", "input", "enc.layers.0")
    # the value is the mask: exactly the padded positions are -inf, as in FP32
    assert r.output_stats[0].n_nonfinite == int(b[1].sum())
    rr = r.fp32_rerun
    assert rr is not None and rr.looked_at == "the inputs of 'enc.layers.0'"
    assert rr.finite is False and rr.precision_is_cause is False and rr.fp32_kind == "-inf"
    assert rr.output_absmax is not None and math.isfinite(rr.output_absmax)  # what the old re-run looked at


class _RootScale(nn.Module):
    """The root's own code multiplies by 1e6 before calling ``b`` (``rescale=False``: the value ~1e6
    exceeds FP16 in FP32 too), or multiplies and divides again (``rescale=True``: an intermediate
    overflows, the value handed to ``b`` fits)."""

    def __init__(self, rescale: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)
        self.rescale = rescale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * 1e6
        return self.b(h / 1e6 if self.rescale else h)


def test_a_value_beyond_fp16_made_in_the_roots_own_code_gets_no_fp32_region_advice() -> None:
    r = trace_nonfinite(_RootScale(False), X, _loss, FP16)
    assert "would not help" in r.advice and "run it in FP32" not in r.advice
    assert (r.module, r.where, r.callee) == ("", "input", "b")
    rr = r.fp32_rerun
    with torch.no_grad():
        ref = float((_RootScale(False).a(X) * 1e6).abs().max())  # the FP32 reference: the value handed to b
    assert rr is not None and rr.precision_is_cause and rr.finite and rr.absmax == pytest.approx(ref, rel=1e-6)
    assert rr.exceeds == ["f16"] and r.value_exceeds_range
    assert "would not help" in r.advice and "mixprec.autocast.fp32()" in r.advice and "Use bf16" in r.advice
    assert "run it in FP32" not in r.advice
    # an intermediate overflow whose value fits: running that code in FP32 is the advice, and it helps
    r = trace_nonfinite(_RootScale(True), X, _loss, FP16)
    assert (r.module, r.where) == ("", "input") and r.fp32_rerun is not None and r.fp32_rerun.precision_is_cause
    with torch.no_grad():
        assert r.fp32_rerun.absmax == pytest.approx(float(_RootScale(True).a(X).abs().max()), rel=1e-6)
    assert not r.value_exceeds_range and "run it in FP32 (mixprec.autocast.fp32())" in r.advice


class _Normed(nn.Module):
    """Own code: ``a``'s output x1e6 (FP16 inf) into ``lin``, whose output is normalised (fits FP16 again)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.a(x) * 1e6)
        return h / h.abs().amax(-1, keepdim=True)


class _NormedOuter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = _Normed()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def test_island_advice_for_a_parents_own_code_only_when_the_island_can_help() -> None:
    # The value handed to inner.lin exceeds FP16 in FP32 too, but inner's output fits: an island around
    # inner computes inner.lin in FP32 as well, and following the advice clears the trace.
    r = trace_nonfinite(_NormedOuter(), X, _loss, FP16)
    assert "i=norm+name:inner" in r.advice and not trace_nonfinite(_Outer(), X, _loss, FP16).advice.startswith("Keep")
    assert (r.module, r.where, r.callee) == ("inner", "input", "inner.lin") and r.value_exceeds_range
    assert r.fp32_rerun is not None and r.fp32_rerun.output_absmax == pytest.approx(1.0)
    assert "i=norm+name:inner" in r.advice and "would not help" not in r.advice
    assert not trace_nonfinite(_NormedOuter(), X, _loss, FP16 + ",i=norm+name:inner").found
    # _Outer's inner hands x1e6 to inner.out and returns ~5e5 itself: the island would not help, and does not
    r = trace_nonfinite(_Outer(), X, _loss, FP16)
    assert (r.module, r.where, r.callee) == ("inner", "input", "inner.out") and r.value_exceeds_range
    assert r.fp32_rerun is not None and r.fp32_rerun.output_absmax is not None and r.fp32_rerun.output_absmax > 65504
    assert "island would not help" in r.advice and "name:inner" not in r.advice
    assert trace_nonfinite(_Outer(), X, _loss, FP16 + ",i=norm+name:inner").found


class _MaskedOverflow(nn.Module):
    """Own code hands ``b`` an intermediate that overflows FP16 (x1e6 then /1e6) plus a deliberate -inf column."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(8)
        mask[-1] = -math.inf
        return self.b((self.a(x) * 1e6) / 1e6 + mask)


def test_a_mask_beside_an_overflow_in_the_same_value_still_blames_the_overflow() -> None:
    r = trace_nonfinite(_MaskedOverflow(), X, None, FP16, backward=False)
    assert "the -inf is there in FP32 too, but the other inf/NaN values are finite" in str(r)
    assert (r.module, r.where, r.callee) == ("", "input", "b")
    rr = r.fp32_rerun
    assert rr is not None and rr.precision_is_cause and rr.finite is False and rr.fp32_kind == "-inf"


class _LogGap(nn.Module):
    """Own code: log((h + 0.01) - h) with h ~ 100: the gap rounds to 0 in BF16/FP16 (-inf), is 0.01 in FP32."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * 100
        return self.head(torch.log((h + 1e-2) - h))


@pytest.mark.parametrize(("policy", "compute"), [("bf16-mixed", "bf16"), ("bf16-master", "bf16"), (FP16, "f16")])
def test_bf16_is_never_advised_to_a_step_that_computed_in_bf16(policy: str, compute: str) -> None:
    wrapped = nn.Sequential(_LogGap())
    r = trace_nonfinite(wrapped, X, _loss, policy)
    assert ("bf16" in r.advice) == (compute != "bf16")
    assert (r.module, r.where, r.callee, r.compute_dtype) == ("0", "input", "0.head", compute)
    assert r.fp32_rerun is not None and r.fp32_rerun.precision_is_cause
    with torch.no_grad():
        h = _LogGap().lin(X) * 100  # the FP32 reference: log of the true gap, finite
        assert r.fp32_rerun.absmax == pytest.approx(float(torch.log((h + 1e-2) - h).abs().max()), rel=1e-3)
    assert "i=norm+name:0" in r.advice


class _RootIntoNorm(nn.Module):
    """The root's own code hands ~1e6 to a LayerNorm, an FP32 island under every preset (i=norm)."""

    def __init__(self, fp32_region: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 1)
        self.fp32_region = fp32_region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with autocast.fp32() if self.fp32_region else contextlib.nullcontext():  # the advice, followed
            h = self.a(x) * 1e6
        return self.head(self.norm(h))


def test_a_value_beyond_fp16_handed_to_an_fp32_island_keeps_the_fp32_region_advice() -> None:
    r = trace_nonfinite(_RootIntoNorm(False), X, _loss, FP16)
    assert "run it in FP32 (mixprec.autocast.fp32())" in r.advice
    assert (r.module, r.where, r.callee, r.callee_island) == ("", "input", "norm", True)
    assert r.fp32_rerun is not None and r.fp32_rerun.exceeds == ["f16"] and not r.value_exceeds_range
    assert "run it in FP32 (mixprec.autocast.fp32())" in r.advice
    # and it helps: the island takes the FP32 value as it is and normalises it in FP32
    assert not trace_nonfinite(_RootIntoNorm(True), X, _loss, FP16).found
