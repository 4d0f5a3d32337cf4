"""The pre-flight check: FP32 vs policy, verdict with reasons."""

from __future__ import annotations

import copy
import json
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import NumericsError
from mixprec.numerics import CheckThresholds, check, preflight


class TinyLM(nn.Module):
    """A small pre-norm transformer language model (two nn.TransformerEncoderLayer blocks, dropout on)."""

    def __init__(self, vocab: int = 50, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(16, d) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True, norm_first=True) for _ in range(layers)
        )
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        for b in self.blocks:
            x = b(x, src_mask=mask, is_causal=True)
        return self.head(self.ln(x))


def lm_loss(m: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(idx[:, :-1]).reshape(-1, 50), idx[:, 1:].reshape(-1))


IDX = torch.randint(0, 50, (8, 16), generator=torch.Generator().manual_seed(0))


class Overflows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.big = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)  # an FP32 island: FP16 inf in, NaN out (tanh would hide an inf on CUDA)
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.big.weight.mul_(1e6)  # activations ~1e6 > 65504

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.big(self.a(x))))


X = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))


def mse(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).float().pow(2).mean()


def test_a_healthy_transformer_passes_under_bf16_mixed() -> None:
    model = TinyLM()
    before = copy.deepcopy(model.state_dict())
    r = check(model, IDX, "bf16-mixed", lm_loss)
    assert r.verdict == "pass", r.reasons
    assert r.ok and r.finite and not r.reasons
    assert r.loss_rel_err is not None and r.loss_rel_err < 1e-3
    assert r.output_sqnr_db is not None and r.output_sqnr_db > 30  # measured 48.6 dB
    assert r.grad_sqnr_db is not None and r.grad_sqnr_db > 20  # measured 36.0 dB
    assert r.grad_lost == 0.0 and len(r.params) == len(list(model.parameters()))
    # never touches the model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None and p.dtype == torch.float32 for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    d = json.loads(json.dumps(r.to_dict()))
    assert d["schema"] == "mixprec.check/1" and d["verdict"] == "pass"
    assert "mixprec check: bf16-mixed on cpu: PASS" in str(r)


def test_a_model_that_overflows_in_fp16_fails_with_a_reason() -> None:
    r = check(Overflows(), X, "fp16-mixed", mse)
    assert r.verdict == "fail" and not r.ok and not r.finite
    assert any("under fp16-mixed the forward" in x and "inf/NaN" in x for x in r.reasons)
    assert any(re.search(r"forward, in the output of 'big' \(Linear\); finite in FP32: precision is the cause", x)
               for x in r.reasons), r.reasons
    assert r.trace is not None and r.trace.module == "big"
    # the same model is fine in bf16
    assert check(Overflows(), X, "bf16-mixed", mse).verdict == "pass"


def test_gradient_underflow_fails_without_loss_scaling() -> None:
    """A deep tanh MLP whose gradients sit below FP16's range: without loss scaling most vanish."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(10):
        lin = nn.Linear(32, 32)
        nn.init.normal_(lin.weight, std=0.5 / math.sqrt(32))
        layers += [lin, nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(32, 1))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))

    def loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return (m(b).float() - 1e-3).pow(2).mean() * 1e-3

    r = check(model, x, "p=f32,c=f16,ls=none", loss)
    assert r.verdict == "fail"
    assert r.grad_lost is not None and r.grad_lost > 0.1
    assert any("zero under" in x and "underflow" in x for x in r.reasons), r.reasons
    # the dynamic scaler's scale fixes it
    r = check(model, x, "fp16-mixed", loss)
    assert r.verdict in ("pass", "warn") and r.grad_lost is not None and r.grad_lost < 0.01


def test_dynamic_scaling_backs_off_like_a_scaler() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    r = check(model, X * 100, "fp16-mixed", mse)  # gradients ~1e4: 2**16 overflows them
    assert r.finite and r.backoffs > 0 and r.loss_scale == 2.0**16 / 2**r.backoffs
    assert any("halvings" in n for n in r.notes)


def test_thresholds_are_applied() -> None:
    strict = CheckThresholds(output_sqnr_warn_db=200.0, output_sqnr_fail_db=150.0)
    r = check(TinyLM(), IDX, "bf16-mixed", lm_loss, thresholds=strict)
    assert r.verdict == "fail" and any("outputs differ from FP32: SQNR" in x for x in r.reasons)
    warn_only = CheckThresholds(grad_sqnr_warn_db=100.0)
    r = check(TinyLM(), IDX, "bf16-mixed", lm_loss, thresholds=warn_only)
    assert r.verdict == "warn" and any("gradients are noisy" in x for x in r.reasons)


def test_forward_only_and_fp32_failures() -> None:
    r = check(TinyLM(), IDX, "bf16-mixed")  # no loss_fn: outputs only
    assert r.verdict == "pass" and r.grad_sqnr_db is None and r.loss_fp32 is None
    bad = X.clone()
    bad[0, 0] = float("nan")
    r = check(Overflows(), bad, "bf16-mixed", mse)
    assert r.verdict == "fail" and "inf/NaN in FP32 already" in r.reasons[0]


def test_preflight_warns_or_raises_and_never_switches() -> None:
    with pytest.warns(UserWarning, match="pre-flight check: FAIL"):
        r = preflight(Overflows(), X, "fp16-mixed", mse)
    assert r.verdict == "fail"
    with pytest.raises(NumericsError, match=re.escape("pre-flight check failed for policy 'fp16-mixed'")):
        preflight(Overflows(), X, "fp16-mixed", mse, on_fail="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert preflight(TinyLM(), IDX, "bf16-mixed", lm_loss, on_fail="raise").verdict == "pass"
    with pytest.raises(ValueError, match="on_fail='ignore'; use 'warn' or 'raise'"):
        preflight(TinyLM(), IDX, "bf16-mixed", lm_loss, on_fail="ignore")  # type: ignore[arg-type]


def test_dropout_is_switched_off_in_both_runs_unless_asked() -> None:
    from mixprec.numerics._preflight import _disable_dropout

    model = TinyLM()
    _disable_dropout(model)
    drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert drops and all(m.p == 0.0 for m in drops)
    assert all(m.dropout == 0.0 for m in model.modules() if isinstance(m, nn.MultiheadAttention))
    assert TinyLM().blocks[0].dropout.p == 0.1  # check() works on copies: the model keeps its dropout
    r = check(TinyLM(), IDX, "bf16-mixed", lm_loss, dropout=True)  # same seed: CPU kernels draw the same masks
    assert r.verdict == "pass"


def test_loss_fn_must_return_a_scalar() -> None:
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar loss tensor, got Tensor of shape \(16, 1\)"):
        check(Overflows(), X, "bf16-mixed", lambda m, b: m(b))


def test_mixed_precision_prepare_runs_the_check_on_the_first_batch() -> None:
    from mixprec import MixedPrecision

    model = Overflows()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prec = MixedPrecision("fp16-mixed")
    with pytest.raises(NumericsError, match=re.escape("pre-flight check failed for policy 'fp16-mixed'")):
        prec.prepare(model, opt, check_batch=X, loss_fn=mse, on_check_fail="raise")
    # Refused before anything changed: same weights, not prepared, the policy untouched.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert prec.model is None and str(prec.policy) == str(MixedPrecision("fp16-mixed").policy)
    model2 = TinyLM()
    prec2 = MixedPrecision("bf16-mixed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prec2.prepare(model2, torch.optim.SGD(model2.parameters(), lr=0.1), check_batch=IDX, loss_fn=lm_loss)
    assert prec2.check_result.verdict == "pass" and prec2.model is model2


def test_a_loss_without_a_graph_is_refused_not_passed():
    """A detached or integer loss: no gradient can be compared (and prec.backward would refuse it): a clear error, not
    a PASS that silently compared no gradients."""
    import re

    from mixprec.numerics import NumericsMonitor, check

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 1))
    x = torch.randn(8, 4)
    with pytest.raises(ValueError, match=re.escape("loss_fn returned a loss that does not require grad")):
        check(m, x, "bf16-master", lambda mm, b: mm(b).pow(2).mean().detach())
    with pytest.raises(ValueError, match=re.escape("loss_fn must return a scalar floating loss")):
        check(m, x, "bf16-master", lambda mm, b: (mm(b).sum() * 100).long())
    with pytest.raises(TypeError, match=re.escape("the check without loss_fn calls model(batch)") + ".*m\\(\\*\\*b\\)\\.loss"):
        check(m, {"input_ids": x}, "bf16-master")
    with pytest.raises(TypeError, match=re.escape("overflow_margin='16' must be a number >= 1")):
        NumericsMonitor(m, overflow_margin="16")


def test_a_nan_made_in_fp32_is_traced_to_its_module() -> None:
    """When the FP32 reference itself is non-finite the verdict says so and names the module that made it (the check
    used to stop at 'not a precision problem' without saying where)."""

    class Log(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x)

    model = nn.Sequential(nn.Linear(X.shape[1], 8), Log(), nn.Linear(8, 2))
    r = check(model, X, "bf16-mixed", lambda m, b: m(b).float().pow(2).mean())
    assert r.verdict == "fail" and "inf/NaN in FP32 already" in r.reasons[0]
    assert r.reasons[1] == "first nan in FP32: forward, in the output of '1' (Log)."
    assert r.trace is not None and r.trace.found


def test_an_fp8_policy_that_runs_no_layer_in_fp8_says_so_in_the_report() -> None:
    pytest.importorskip("torchao")
    from mixprec.numerics import check as run_check

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 4))  # 4 output features: no FP8 GEMM for it
    res = run_check(model, torch.randn(8, 16), "fp8-rowwise", lambda m, b: m(b).float().pow(2).mean())
    assert res.verdict == "pass"
    assert any("runs no layer in FP8" in n and "plain BF16 autocast" in n for n in res.notes), res.notes
    assert any("runs no layer in FP8" in n for n in res.to_dict()["notes"])
