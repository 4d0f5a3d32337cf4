"""Live-tensor tracker, model-state accounting, step-time summaries and the GPU peak table."""

from __future__ import annotations

import pytest
import torch

from mixprec.bench import LiveTensorTracker, model_state_bytes, peak_tflops
from mixprec.bench._memory import measure_step_memory, parameter_count
from mixprec.bench._timing import percentile, summarize


def test_tracker_counts_fresh_storages_and_frees() -> None:
    with LiveTensorTracker() as t:
        x = torch.ones(256)  # 1 KiB
        y = x * 2  # 1 KiB more
        del x
    assert (t.peak, t.current) == (2048, 1024)
    del y


def test_tracker_skips_views_and_in_place_results() -> None:
    base = torch.zeros(1024)
    with LiveTensorTracker() as t:
        v = base.view(32, 32).t()  # alias of an input
        base.add_(1.0)  # in place: no new memory
        w = v[0]  # view of a view
    assert t.peak == 0
    del v, w


def test_tracker_sees_backward_allocations() -> None:
    lin = torch.nn.Linear(64, 64)
    with LiveTensorTracker() as t:
        lin(torch.randn(32, 64)).sum().backward()
    # input + output + grads of weight (16 KiB) and bias at least
    assert t.peak >= 64 * 64 * 4 + 32 * 64 * 4
    lin.zero_grad(set_to_none=True)


def test_measure_step_memory_adds_persistent_state() -> None:
    with measure_step_memory(torch.device("cpu"), before_bytes=1000) as box:
        z = torch.empty(100, dtype=torch.float32)
        del z
    (m,) = box
    assert m.growth_bytes == 400 and m.peak_bytes == 1400


def test_model_state_bytes_adamw_fp32_is_16_per_param() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    n = parameter_count(model)
    # params (4) + grads (4) + exp_avg (4) + exp_avg_sq (4); the 0-d step counters add a few bytes
    per_param = model_state_bytes(model, opt) / n
    assert 16.0 <= per_param < 16.5


def test_model_state_counts_tied_weights_once() -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleList([emb, head])
    assert parameter_count(model) == 40
    assert model_state_bytes(model) == 160


def test_model_state_counts_masters_of_a_wrapper() -> None:
    class Wrapper:
        def __init__(self, inner: torch.optim.Optimizer, masters: list[torch.Tensor]) -> None:
            self.optimizer = inner
            self.masters = masters
            self.param_groups = inner.param_groups
            self.state = inner.state

    half = torch.nn.Linear(4, 4, bias=False).half()
    master = half.weight.detach().float().clone()
    inner = torch.optim.SGD([master], lr=0.1)
    assert model_state_bytes(half, Wrapper(inner, [master])) == 16 * 2 + 16 * 4


def test_percentiles_and_summary() -> None:
    xs = [float(i) for i in range(1, 11)]
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 10) == pytest.approx(1.9)
    assert percentile(xs, 90) == pytest.approx(9.1)
    s = summarize([x / 1000 for x in xs])  # seconds in, milliseconds out
    assert s["n"] == 10 and s["median"] == pytest.approx(5.5) and s["p10"] <= s["median"] <= s["p90"]


@pytest.mark.parametrize(
    ("name", "kind", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "fp16", 989.4),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA A10", "bf16", 125.0),
        ("NVIDIA L4", "fp16", 121.0),
        ("NVIDIA L40S", "bf16", 362.05),
        ("Tesla T4", "fp16", 65.0),
        ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 on Volta
        ("Some Future GPU", "bf16", None),
    ],
)
def test_peak_table_by_device_name(name: str, kind: str, expected: float | None) -> None:
    assert peak_tflops(name, kind) == expected
