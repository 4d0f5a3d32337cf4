import re
import warnings

import pytest
import torch

from mixprec import _dtypes
from mixprec._dtypes import ALIASES, check_device_support, dtype_name, limits, parse_dtype


@pytest.mark.parametrize(
    "name,dtype",
    [("f32", torch.float32), ("float32", torch.float32), ("full", torch.float32), ("bf16", torch.bfloat16),
     ("bfloat16", torch.bfloat16), ("f16", torch.float16), ("float16", torch.float16), ("half", torch.float16),
     ("f8e4m3", torch.float8_e4m3fn), ("f8e5m2", torch.float8_e5m2), ("torch.float16", torch.float16), ("HALF", torch.float16)],
)
def test_aliases_parse(name, dtype):
    assert parse_dtype(name) is dtype


def test_every_alias_round_trips_through_its_short_name():
    for alias, dt in ALIASES.items():
        assert parse_dtype(dtype_name(parse_dtype(alias))) is dt


def test_unknown_dtype_lists_choices_and_closest():
    with pytest.raises(ValueError, match=re.escape("unknown dtype 'bfloat61'")) as e:
        parse_dtype("bfloat61")
    assert "Did you mean 'bfloat16'?" in str(e.value)
    assert "f8e5m2" in str(e.value)


def test_non_floating_dtype_rejected():
    with pytest.raises(ValueError, match=re.escape("unknown floating dtype 'torch.int32'")):
        parse_dtype(torch.int32)
    with pytest.raises(TypeError, match="expected a dtype name or torch.dtype, got int 3"):
        parse_dtype(3)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16", "f8e4m3", "f8e5m2"])
def test_limits_match_the_format(dtype):
    lim = limits(dtype)
    dt = parse_dtype(dtype)
    one = torch.tensor(1.0, dtype=torch.float32)
    # eps: 1 + eps is representable and distinct from 1; 1 + eps/4 rounds back to 1.
    assert (one + lim.eps).to(dt).float().item() > 1.0
    assert (one + lim.eps / 4).to(dt).float().item() == 1.0
    # smallest subnormal survives the cast; a quarter of it flushes to zero.
    sub = torch.tensor(lim.smallest_subnormal, dtype=torch.float64)
    assert sub.to(dt).double().item() == pytest.approx(lim.smallest_subnormal)
    assert (sub / 4).to(dt).double().item() == 0.0
    assert lim.smallest_subnormal < lim.smallest_normal < 1 < lim.max
    assert 2 ** -lim.mantissa_bits == pytest.approx(lim.eps)


def test_known_values():
    assert limits("f16").max == 65504.0
    assert limits("f16").smallest_subnormal == 2.0 ** -24
    assert limits("bf16").eps == 2.0 ** -7
    assert limits("f8e4m3").max == 448.0
    assert limits("f8e5m2").max == 57344.0


def test_fp16_on_cpu_warns_once(monkeypatch):
    monkeypatch.setattr(_dtypes, "_warned", set())
    with pytest.warns(UserWarning, match="no fast fp16 kernel"):
        check_device_support("f16", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_device_support("f16", "cpu")  # second call: silent
        check_device_support("bf16", "cpu")
        check_device_support("f32", "cpu")


def test_bf16_on_old_gpu_raises_with_suggestion(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    with pytest.raises(ValueError, match=re.escape("device 'Tesla V100' cannot compute in bf16; use an fp16 preset")):
        check_device_support("bf16", "cuda")
