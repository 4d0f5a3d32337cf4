import pytest
import torch

from mixprec._autocast import autocast, resolve_device_type


def _lin():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8)


@pytest.mark.parametrize("preset,dtype", [("bf16-mixed", torch.bfloat16), ("fp16-mixed", torch.float16), ("fp32", torch.float32), ("tf32", torch.float32)])
def test_compute_dtype_inside_region(preset, dtype):
    lin = _lin()
    with autocast(preset, "cpu"):
        y = lin(torch.randn(2, 8))
        assert torch.is_autocast_enabled("cpu") == (dtype != torch.float32)
    assert y.dtype == dtype
    assert not torch.is_autocast_enabled("cpu")


def test_tf32_set_and_restored():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    with autocast("tf32", "cpu"):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        with autocast("fp32", "cpu"):
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


@pytest.mark.parametrize("user", ["medium", "high"])
def test_matmul_precision_stays_readable_inside_and_is_restored(user):
    """After torch.set_float32_matmul_precision("medium"/"high") (Lightning's and torch's advice) the region set CUDA's
    matmul flag alone: torch.get_float32_matmul_precision() raised inside ("mix of the legacy and new APIs"; inductor
    calls it), and an FP32 region kept the MKLDNN matmul in BF16/TF32 on a CPU."""
    torch.set_float32_matmul_precision(user)
    mkldnn = torch.backends.mkldnn.matmul.fp32_precision
    try:
        for policy in ("fp32", "bf16-mixed"):
            with autocast(policy, "cpu"):
                assert torch.get_float32_matmul_precision() == "highest"
                assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
                with autocast("tf32", "cpu"):
                    assert torch.get_float32_matmul_precision() == "high"
                    with autocast("fp32", "cpu"):
                        assert torch.get_float32_matmul_precision() == "highest"
                assert torch.get_float32_matmul_precision() == "highest"
            assert torch.get_float32_matmul_precision() == user
            assert torch.backends.mkldnn.matmul.fp32_precision == mkldnn
    finally:
        torch.set_float32_matmul_precision("highest")


def test_nesting_restores_outer_dtype():
    # Separate modules: torch.autocast caches one cast per leaf weight, whatever the dtype.
    inner, outer = _lin(), _lin()
    with autocast("bf16-mixed", "cpu"):
        with autocast("fp16-mixed", "cpu"):
            assert inner(torch.randn(1, 8)).dtype == torch.float16
        assert outer(torch.randn(1, 8)).dtype == torch.bfloat16
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_exception_restores_all_state():
    before_dtype = torch.get_autocast_dtype("cpu")
    before_tf32 = torch.backends.cuda.matmul.allow_tf32
    with pytest.raises(ZeroDivisionError), autocast("tf32", "cpu"), autocast("bf16-mixed", "cpu"):
        _ = 1 / 0
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") == before_dtype
    assert torch.backends.cuda.matmul.allow_tf32 == before_tf32


def test_decorator_takes_device_from_arguments_and_restores_on_raise():
    lin = _lin()

    @autocast("bf16-mixed")
    def fwd(model, x):
        assert torch.is_autocast_enabled("cpu")
        return model(x)

    assert fwd(lin, torch.randn(2, 8)).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")

    @autocast("bf16-mixed", "cpu")
    def bad(x):
        raise ValueError("x")

    with pytest.raises(ValueError):
        bad(1)
    assert not torch.is_autocast_enabled("cpu")


def test_fp32_region_and_decorator():
    lin = _lin()
    with autocast("bf16-mixed", "cpu"):
        with autocast.fp32("cpu"):
            assert lin(torch.randn(2, 8)).dtype == torch.float32
        assert lin(torch.randn(2, 8)).dtype == torch.bfloat16

        @autocast.fp32()
        def solve(a, b):
            return torch.linalg.solve(a, b)

        a = torch.eye(3, dtype=torch.bfloat16) * 2
        out = solve(a, torch.ones(3, 1, dtype=torch.bfloat16))
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, torch.full((3, 1), 0.5))
        assert torch.is_autocast_enabled("cpu")


def test_disabled_region_is_a_no_op():
    with autocast("bf16-mixed", "cpu", enabled=False):
        assert not torch.is_autocast_enabled("cpu")


def test_resolve_device_type():
    assert resolve_device_type("cpu") == "cpu"
    assert resolve_device_type(torch.device("cpu")) == "cpu"
    assert resolve_device_type(torch.ones(1)) == "cpu"
    assert resolve_device_type(torch.nn.Linear(1, 1)) == "cpu"
    with pytest.raises(TypeError, match="cannot tell a device from int"):
        resolve_device_type(3)


def test_a_nested_region_keeps_the_enclosing_weight_cache_setting():
    """cache_enabled=True passed explicitly switched the cache back on inside a cache-free region (the Lightning
    plugin's): a forward after a step in the outer region ran on the old cached half weights."""
    import mixprec as mp

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), autocast("bf16-mixed", "cpu"):
        first = lin(x)
        first.float().square().sum().backward()
        opt.step()
        second = lin(x)
        assert not torch.equal(first, second)
    prec = mp.MixedPrecision("bf16-mixed")
    other = torch.nn.Linear(8, 8)
    prec.prepare(other, torch.optim.SGD(other.parameters(), lr=0.5))
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), prec.autocast():
        assert not torch.is_autocast_cache_enabled()
