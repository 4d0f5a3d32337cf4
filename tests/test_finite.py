"""all_finite and unscale_and_check_: results, no mutation, one fused kernel per (device, dtype) group."""

from __future__ import annotations

import pytest
import torch

from mixprec._finite import all_finite, unscale_and_check_
from mixprec.bench._timing import OpCounter

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BAD = [float("inf"), float("-inf"), float("nan")]



def _tensors(device, dtypes=FLOATS, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5 + i, generator=g).to(device=device, dtype=dt) for dt in dtypes for i in range(n)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bad", BAD)
def test_all_finite_detects_each_kind_of_non_finite(dtype, bad, device):
    ts = _tensors(device)
    assert all_finite(ts).item() is True
    ts[-1 if dtype == torch.float64 else FLOATS.index(dtype) * 3][2] = bad
    result = all_finite(ts)
    assert result.item() is False
    assert result.shape == () and result.dtype == torch.bool and result.device.type == torch.device(device).type


def test_all_finite_leaves_tensors_alone():
    ts = _tensors("cpu")
    ts[0][0] = float("nan")
    versions = [t._version for t in ts]
    copies = [t.clone() for t in ts]
    all_finite(ts)
    assert [t._version for t in ts] == versions
    for a, b in zip(ts, copies):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_all_finite_on_a_tensor_saved_for_backward():
    x = torch.randn(4, requires_grad=True)
    y = x.exp()  # exp saves its output for backward: an in-place check would break backward
    assert all_finite([y]).item()
    y.sum().backward()
    torch.testing.assert_close(x.grad, x.exp())


def test_all_finite_edge_cases():
    assert all_finite([]).item() is True
    assert all_finite([None, torch.arange(3), torch.tensor([True])]).item() is True  # ints/bools are finite
    assert all_finite(torch.tensor([1.0, float("inf")])).item() is False  # a single tensor
    assert all_finite(t for t in [torch.ones(2), torch.zeros(0)]).item() is True  # generator, empty tensor
    c = torch.tensor([1 + 1j, complex(float("nan"), 0)])
    assert all_finite([c]).item() is False
    s = torch.sparse_coo_tensor([[0, 2]], [1.0, float("inf")], (4,))
    assert all_finite([s]).item() is False
    assert all_finite([torch.sparse_coo_tensor([[0]], [1.0], (4,))]).item() is True


def test_all_finite_is_one_foreach_per_group_and_no_sync():
    ts = _tensors("cpu", n=50)  # 200 tensors in 4 dtype groups
    with OpCounter() as c:
        all_finite(ts)
    assert c.ops["_foreach_norm"] == 4
    assert c.ops["_local_scalar_dense"] == 0
    assert sum(c.ops.values()) == 4 + 3  # stack, lt, all: nothing per tensor


@pytest.mark.parametrize("dtype", FLOATS)
def test_unscale_and_check_multiplies_and_flags(dtype, device):
    ts = _tensors(device, [dtype])
    ref = [t.double() * 0.25 for t in ts]
    found = unscale_and_check_(ts, torch.tensor(0.25, device=device))
    assert found.item() == 0.0 and found.dtype == torch.float32 and found.shape == ()
    for t, r in zip(ts, ref):
        assert torch.equal(t, r.to(dtype))
    ts[1][0] = float("nan")
    assert unscale_and_check_(ts, torch.tensor(1.0, device=device)).item() == 1.0


def test_unscale_and_check_without_inv_scale_only_checks():
    ts = _tensors("cpu")
    before = [t.clone() for t in ts]
    assert unscale_and_check_(ts, None).item() == 0.0
    assert all(torch.equal(a, b) for a, b in zip(ts, before))
    ts[4][1] = float("-inf")
    assert unscale_and_check_(ts, None).item() == 1.0


def test_unscale_and_check_accumulates_into_a_given_flag():
    flag = torch.tensor(1.0)
    out = unscale_and_check_([torch.ones(3)], torch.tensor(0.5), flag)
    assert out is flag and flag.item() == 1.0  # never cleared
    flag = torch.zeros(())
    assert unscale_and_check_([torch.ones(3), None], torch.tensor(0.5), flag) is flag and flag.item() == 0.0


def test_unscale_and_check_with_nothing_to_check():
    assert unscale_and_check_([], torch.tensor(0.5)).item() == 0.0
    assert unscale_and_check_([None], None).device.type == "cpu"


def test_unscale_and_check_is_one_fused_call_per_group_and_no_sync():
    ts = _tensors("cpu", [torch.float32, torch.float16], n=75)  # 150 tensors, 2 groups
    with OpCounter() as c:
        unscale_and_check_(ts, torch.tensor(0.5))
    assert c.ops["_amp_foreach_non_finite_check_and_unscale_"] == 2
    assert c.ops["_local_scalar_dense"] == 0
    assert sum(c.ops.values()) <= 2 + 3  # the two fused calls plus the flag and the 1.0 factor at most


def test_unscale_and_check_sparse_values():
    s = torch.sparse_coo_tensor([[0, 2]], [2.0, 4.0], (4,)).coalesce()
    assert unscale_and_check_([s], torch.tensor(0.5)).item() == 0.0
    assert s.to_dense().tolist() == [1.0, 0.0, 2.0, 0.0]


@pytest.mark.parametrize("inv", [None, 0.5])
def test_check_only_off_the_cpu_reads_without_writing(inv):
    """Off the CPU a check only (no factor) is a read-only norm; a factor keeps the fused kernel (shapes on 'meta')."""
    ts = [torch.empty(5, device="meta"), torch.empty(3, 2, device="meta")]
    inv_t = None if inv is None else torch.tensor(inv, device="meta")
    with OpCounter() as c:
        unscale_and_check_(ts, inv_t)
    assert c.ops["_amp_foreach_non_finite_check_and_unscale_"] == (0 if inv is None else 1)
    assert c.ops["_foreach_norm"] == (1 if inv is None else 0)
    assert c.ops["_foreach_mul_"] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_check_only_on_cuda_flags_inf_and_nan_and_writes_nothing(dtype):
    for poison in (None, float("nan"), float("inf"), float("-inf")):
        ts = [torch.randn(1000, device="cuda", dtype=dtype), torch.randn(7, 3, device="cuda", dtype=dtype)]
        if poison is not None:
            ts[1][2, 1] = poison
        ref = [t.clone() for t in ts]
        versions = [t._version for t in ts]
        found = unscale_and_check_(ts, None)
        assert found.item() == (0.0 if poison is None else 1.0)
        assert [t._version for t in ts] == versions
        for a, b in zip(ts, ref):
            assert torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.cuda
def test_multi_device_groups_fold_into_one_flag():
    cpu, gpu = torch.ones(3), torch.ones(3, device="cuda")
    gpu[0] = float("inf")
    found = unscale_and_check_([cpu, gpu], torch.tensor(0.5))
    assert found.device.type == "cpu" and found.item() == 1.0
    assert cpu.tolist() == [0.5] * 3
    assert all_finite([cpu, gpu]).item() is False


def test_property_random_injections():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.given(st.lists(st.tuples(st.sampled_from(FLOATS), st.integers(0, 6)), min_size=1, max_size=8),
                      st.lists(st.tuples(st.integers(0, 100), st.integers(0, 100), st.sampled_from(BAD)), max_size=3),
                      st.sampled_from([0.5, 2.0**-16, 1.0 / 3.0]))
    def check(specs, injections, inv):
        g = torch.Generator().manual_seed(0)
        ts = [torch.randn(n, generator=g).to(dt) for dt, n in specs]
        for i, j, v in injections:
            t = ts[i % len(ts)]
            if t.numel():
                t[j % t.numel()] = v
        expect_finite = all(bool(torch.isfinite(t).all()) for t in ts)
        assert all_finite(ts).item() is expect_finite
        inv_t = torch.tensor(inv, dtype=torch.float64).float()
        ref = [t * inv_t for t in ts]  # what the kernel computes: x * inv in the tensor's dtype math
        found = unscale_and_check_(ts, inv_t)
        assert found.item() == (0.0 if expect_finite else 1.0)
        for a, b in zip(ts, ref):
            assert torch.equal(a.nan_to_num(), b.to(a.dtype).nan_to_num())

    check()


@pytest.mark.parametrize("inv", [None, 0.25, 2.0**-20])
def test_foreach_fallback_matches_the_fused_kernel(monkeypatch, inv):
    """Where torch has no fused kernel (bf16 on CUDA) the foreach fallback gives the same values and flag."""
    import mixprec._finite as fin

    for poison in (None, float("nan"), float("-inf")):
        a, b = _tensors("cpu", [torch.float32, torch.bfloat16]), _tensors("cpu", [torch.float32, torch.bfloat16])
        if poison is not None:
            a[4][1] = b[4][1] = poison
        inv_t = None if inv is None else torch.tensor(inv)
        fused = unscale_and_check_(a, inv_t)
        monkeypatch.setattr(fin, "_NO_FUSED_KERNEL", {("cpu", torch.float32), ("cpu", torch.bfloat16)})
        with OpCounter() as c:
            fallback = unscale_and_check_(b, inv_t)
        monkeypatch.undo()
        assert c.ops["_amp_foreach_non_finite_check_and_unscale_"] == 0 and c.ops["_foreach_norm"] == 2
        assert fused.item() == fallback.item() == (0.0 if poison is None else 1.0)
        for x, y in zip(a, b):
            assert torch.equal(x.nan_to_num(), y.nan_to_num())
