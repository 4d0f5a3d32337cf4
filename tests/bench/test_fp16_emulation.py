"""FP16 emulation (FP16 storage, FP32 arithmetic) against torch's native CPU FP16 kernels."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from mixprec.bench import FP16Emulation

HALF_EPS = 2.0**-10  # spacing of FP16 numbers in [1, 2)


def ulp_bound(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One FP16 rounding step at each element's magnitude (the noise of FP32 summation order after
    rounding to FP16); values near zero get the spacing at a small fraction of the tensor's scale."""
    mag = torch.maximum(a.abs(), b.abs()).float()
    return HALF_EPS * torch.maximum(mag, 1e-3 * scale) + 2.0**-24


def assert_within_one_rounding(emu: torch.Tensor, nat: torch.Tensor) -> None:
    assert emu.dtype == nat.dtype and emu.shape == nat.shape
    scale = nat.float().abs().max()
    diff = (emu.float() - nat.float()).abs()
    bound = ulp_bound(emu, nat, scale)
    worst = (diff / bound).max().item()
    assert worst <= 1.0, f"emulation differs from native FP16 by {worst:.2f} rounding steps"


OPS = {
    "mm": lambda a, b: a @ b,
    "linear": lambda a, b: F.linear(a, b, b[0]),
    "bmm": lambda a, b: torch.bmm(a.view(4, 8, 32), b.view(4, 32, 8)),
    "add_scaled": lambda a, b: a + 0.3 * b,
    "mul": lambda a, b: a * b,
    "softmax": lambda a, b: torch.softmax(a, -1),
    "log_softmax": lambda a, b: torch.log_softmax(a, -1),
    "layer_norm": lambda a, b: F.layer_norm(a, (32,), b[0], b[1]),
    "gelu": lambda a, b: F.gelu(a),
    "sum": lambda a, b: a.sum(0),
    "mean": lambda a, b: a.mean(-1),
    "mse_loss": lambda a, b: F.mse_loss(a, b),
    "cross_entropy": lambda a, b: F.cross_entropy(a, torch.arange(32) % 32),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_matches_native_fp16_within_one_rounding(name: str) -> None:
    torch.manual_seed(0)
    a, b = torch.randn(32, 32).half(), torch.randn(32, 32).half()
    native = OPS[name](a, b)
    with FP16Emulation() as mode:
        emulated = OPS[name](a, b)
    assert mode.emulated_ops >= 1
    assert_within_one_rounding(emulated, native)


@pytest.mark.parametrize("name", ["mm", "linear", "bmm", "add_scaled", "mul", "softmax", "layer_norm", "sum", "mse_loss"])
def test_mostly_bit_identical_where_native_accumulates_in_fp32(name: str) -> None:
    torch.manual_seed(1)
    a, b = torch.randn(32, 32).half(), torch.randn(32, 32).half()
    native = OPS[name](a, b)
    with FP16Emulation():
        emulated = OPS[name](a, b)
    same = (emulated == native).float().mean().item()
    assert same >= 0.99, f"only {same:.1%} of elements are bit-identical"


def test_products_of_fp16_are_exact_in_the_fp32_arithmetic() -> None:
    # x * y of two FP16 numbers fits in FP32 exactly; the emulation rounds once, at the end.
    x = torch.tensor([1 + 2**-10], dtype=torch.float16)
    y = torch.tensor([1 - 2**-10], dtype=torch.float16)
    with FP16Emulation():
        z = x * y
    assert z.dtype == torch.float16
    assert z.item() == torch.tensor(1 - 2**-20).half().item()  # the exact product, rounded once


def test_outputs_keep_native_dtypes_and_views_stay_views() -> None:
    a = torch.randn(8, 8).half()
    with FP16Emulation():
        t = a.t()
        s = a.sum(dtype=torch.float32)
        p = torch.softmax(a.float(), -1)  # an FP32 tensor: untouched
        b = a.to(torch.float32)
        h = torch.log_softmax(a, -1, dtype=torch.float32)
    assert t.dtype == torch.float16 and t.data_ptr() == a.data_ptr()
    assert s.dtype == torch.float32 and b.dtype == torch.float32 and h.dtype == torch.float32
    assert p.dtype == torch.float32
    torch.testing.assert_close(s, a.float().sum())


def test_in_place_and_foreach_write_rounded_fp16_back() -> None:
    p = torch.randn(64).half()
    q = p.clone()
    g = torch.randn(64).half()
    p.add_(g, alpha=-0.01)
    with FP16Emulation():
        r = q.add_(g, alpha=-0.01)
        ys = [torch.ones(4).half(), torch.full((4,), 2.0).half()]
        torch._foreach_mul_(ys, 0.5)
    assert r is q and q.dtype == torch.float16
    assert torch.equal(p, q)
    assert torch.equal(ys[0], torch.full((4,), 0.5).half()) and torch.equal(ys[1], torch.ones(4).half())


def test_other_dtypes_pass_through_untouched() -> None:
    x, y = torch.randn(16, 16), torch.randn(16, 16).bfloat16()
    with FP16Emulation() as mode:
        a, b = x @ x, y @ y
    assert mode.emulated_ops == 0 and mode.passthrough_ops == 0
    assert torch.equal(a, x @ x) and torch.equal(b, y @ y)


def _train_fp16_mlp(emulate: bool) -> tuple[list[float], torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    losses = []
    with FP16Emulation() if emulate else contextlib.nullcontext():
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return losses, model[0].weight.detach().clone()


def test_autocast_training_matches_native_fp16() -> None:
    native_losses, native_w = _train_fp16_mlp(emulate=False)
    emu_losses, emu_w = _train_fp16_mlp(emulate=True)
    assert native_losses[0] == emu_losses[0]
    torch.testing.assert_close(torch.tensor(emu_losses), torch.tensor(native_losses), rtol=2e-3, atol=0)
    torch.testing.assert_close(emu_w, native_w, rtol=1e-3, atol=1e-4)


def test_attention_as_accurate_as_native() -> None:
    # The fused CPU attention kernel rounds its probabilities to FP16 before the second matmul
    # (as GPU flash attention does), so elementwise it is not a one-rounding match; judged
    # against FP64, both are equally accurate.
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 32).half() for _ in range(3))

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    ref = attn(q.double(), k.double(), v.double())
    native = attn(q, k, v)
    with FP16Emulation():
        emulated = attn(q, k, v)
    assert emulated.dtype == torch.float16
    err = lambda t: ((t.double() - ref).abs().max() / ref.abs().max()).item()
    assert err(emulated) <= 1.5 * err(native) + 1e-6
    assert err(emulated) < HALF_EPS


def test_conv_backward_is_at_least_as_accurate_as_native() -> None:
    # Native CPU FP16 convolution backward accumulates with FP16 intermediates on some builds;
    # the emulation accumulates in FP32 like GPU kernels. Both are judged against FP64.
    torch.manual_seed(0)
    x, w, g = torch.randn(4, 3, 8, 8).half(), torch.randn(5, 3, 3, 3).half(), torch.randn(4, 5, 8, 8).half()

    def grad_input(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_()
        F.conv2d(x, w, padding=1).backward(g)
        assert x.grad is not None
        return x.grad

    ref = grad_input(x.double(), w.double(), g.double())
    native = grad_input(x, w, g)
    with FP16Emulation():
        emulated = grad_input(x, w, g)
    assert emulated.dtype == torch.float16
    err = lambda t: ((t.double() - ref).abs().max() / ref.abs().max()).item()
    assert err(emulated) <= err(native) + 1e-6
    assert err(emulated) < 2 * HALF_EPS
