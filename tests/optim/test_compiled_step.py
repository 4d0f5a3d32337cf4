"""``torch.compile(opt.step)`` on a ``mixprec.optim`` optimizer used on its own (not prepared).

Traced, the step was wrong: Inductor folded the Kahan remainder ``w - round(w)`` to 0 (the
compensation stayed 0: BF16 updates below half an ulp were lost) and stochastic rounding stalled,
and with a single parameter tensor AOTAutograd refused the step ("A view was created in no_grad
mode ..."). The step now runs eagerly behind one graph break, so the compiled step equals the
eager one bit for bit: parameters, compensation buffers, states and step counters.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import mixprec.optim as mo

from ._util import assert_bit_identical, snapshot

STEPS = 4


def _run(compile_backend: str | None, compensation: str, n_params: int,
         hooks: list[str] | None = None) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    w0 = torch.randn(64)
    # Tiny updates (lr * grad ~ 1e-4 of weights ~1): below half a BF16 ulp, which only compensation keeps.
    ps = [torch.nn.Parameter((w0 + i).to(torch.bfloat16)) for i in range(n_params)]
    opt = mo.SGD(ps, lr=1e-4, momentum=0.9, compensation=compensation, seed=3)
    if hooks is not None:
        opt.register_step_pre_hook(lambda o, a, k: hooks.append("pre"))
        opt.register_step_post_hook(lambda o, a, k: hooks.append("post"))
    step: Callable[[], Any] = opt.step
    if compile_backend is not None:
        torch._dynamo.reset()
        step = torch.compile(opt.step, backend=compile_backend)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        step()
    return snapshot(opt)


@pytest.mark.parametrize("n_params", [1, 2])
@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
def test_compiled_bare_step_equals_the_eager_step(compensation: str, n_params: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = _run(None, compensation, n_params)
        compiled = _run("aot_eager", compensation, n_params)
    assert_bit_identical(eager, compiled)
    if compensation == "kahan":  # the compensation did its work (it was all zeros when traced)
        assert any(k.endswith(".kahan_comp") and bool((v != 0).any()) for k, v in compiled)


def test_inductor_compiled_bare_step_keeps_the_kahan_remainder() -> None:
    """The Inductor case of the report: the round trip of ``w - round(w)`` was folded away."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = _run(None, "kahan", 2)
        compiled = _run("inductor", "kahan", 2)
    assert_bit_identical(eager, compiled)


def test_compiled_bare_step_breaks_the_graph_once_with_the_reason_and_runs_hooks_once() -> None:
    hooks: list[str] = []
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _run("aot_eager", "kahan", 2, hooks)
    assert hooks == ["pre", "post"] * STEPS
    reasons = [str(r) for r in counters["graph_break"]]
    assert len(reasons) == 1, reasons
    assert "mixprec.optim's step runs eagerly behind one graph break" in reasons[0]
