"""Complex parameters (a Fourier layer) in the pre-flight check and the trace, against the FP32 / plain-torch reference."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec import autocast, cast_module
from mixprec.numerics import check, trace_nonfinite


class FNO(nn.Module):
    """A one-layer Fourier neural operator: a complex spectral weight between two real linears."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lift = nn.Linear(2, 8)
        self.w = nn.Parameter(torch.randn(8, 8, 5, dtype=torch.cfloat) * 0.1)
        self.proj = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(x).transpose(1, 2)
        hf = torch.fft.rfft(h.float(), dim=-1)
        out = torch.zeros_like(hf)
        out[..., :5] = torch.einsum("bin,ion->bon", hf[..., :5], self.w)
        return self.proj(F.gelu(torch.fft.irfft(out, n=h.shape[-1], dim=-1) + h).transpose(1, 2))


X = torch.randn(4, 32, 2, generator=torch.Generator().manual_seed(0))
Y = X[..., :1].cumsum(1) * 0.1


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(m(b[0]).float(), b[1])


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| over complex values (both the real and the imaginary part)."""
    got, ref = got.detach().to(torch.complex128), ref.detach().to(torch.complex128)
    return float((got - ref).abs().pow(2).sum().sqrt() / ref.abs().pow(2).sum().sqrt())


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed", "bf16-master"])
def test_check_compares_a_complex_gradient_with_both_parts(policy: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ComplexWarning: a .double() that drops the imaginary part
        warnings.filterwarnings("ignore", "In CPU autocast", UserWarning)  # fp16 on a CPU
        res = check(FNO(), (X, Y), policy, _loss)
    assert res.verdict in ("pass", "warn") and res.finite
    w = {p.name: p for p in res.params}["w"]
    assert (w.dtype, w.grad_dtype) == ("complex64", "complex64")
    # The reference, by hand: FP32 gradient against the gradient under the policy (same cast, same autocast,
    # same loss scale).
    ref = FNO()
    _loss(ref, (X, Y)).backward()
    pol = cast_module(copy.deepcopy(FNO()), policy)
    with autocast(policy, "cpu"):
        loss = _loss(pol, (X, Y))
    (loss.float() * res.loss_scale).backward()
    g_ref, g_pol = ref.w.grad, pol.get_parameter("w").grad
    assert g_ref is not None and g_pol is not None
    assert w.rel_err == pytest.approx(_rel_err(g_pol / res.loss_scale, g_ref), rel=1e-6)
    assert w.sqnr_db == pytest.approx(-20 * math.log10(w.rel_err), rel=1e-6)
    # under "fp32" the complex gradient is the reference itself
    assert {p.name: p for p in check(FNO(), (X, Y), "fp32", _loss).params}["w"].rel_err == 0.0


def test_prepare_runs_the_check_on_a_model_with_a_complex_parameter() -> None:
    model = FNO()
    prec = mp.MixedPrecision("bf16-mixed")
    prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), check_batch=(X, Y), loss_fn=_loss)
    assert prec.check_result.verdict in ("pass", "warn")


class Spectrum(nn.Module):
    """Returns the complex spectrum itself (no real projection after it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lift = nn.Linear(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(self.lift(x).float(), dim=1)


def test_a_complex_output_is_compared_not_skipped() -> None:
    res = check(Spectrum(), X, "bf16-mixed")
    assert res.output_sqnr_db is not None and math.isfinite(res.output_sqnr_db)
    ref = Spectrum()(X)
    pol = cast_module(Spectrum(), "bf16-mixed")
    with autocast("bf16-mixed", "cpu"):
        got = pol(X)
    assert res.output_rel_err == pytest.approx(_rel_err(got, ref), rel=1e-6)


def test_trace_of_a_model_with_a_complex_parameter() -> None:
    assert not trace_nonfinite(FNO(), (X, Y), _loss, "bf16-mixed").found
