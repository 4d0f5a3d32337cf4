"""``benchmarks/step_overhead.py``: the GPT-2 shapes and the fused baseline of the compensated rows (issue 27, item 3)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch


def test_gpt2_shapes_are_gpt2_124m_parameter_tensors(load_benchmark: Any) -> None:
    module = load_benchmark("step_overhead")
    params = list(module.gpt2_shaped(torch.device("meta")).parameters())
    assert len(params) == 148
    assert sum(p.numel() for p in params) == 124_439_808  # GPT-2 124M, the head tied to wte
    assert params[0].shape == (50257, 768) and params[1].shape == (1024, 768)


def test_fused_compensated_rows_are_against_torchs_fused_adamw(capsys: pytest.CaptureFixture[str],
                                                                 load_benchmark: Any) -> None:
    module = load_benchmark("step_overhead")
    assert module.main(["--only-compensated", "--fused", "--rows", "pure-kahan-eager", "--params", "0.02",
                        "--rounds", "2", "--reps", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines() if line and not line.startswith(("#", "row"))}
    assert rows == {"adamw-fused": "adamw-fused", "pure-kahan-eager": "adamw-fused"}, out
    assert "AdamW fused" in out and "(linear)" in out


def test_fused_tile_sets_the_tile_of_the_fused_step(capsys: pytest.CaptureFixture[str], load_benchmark: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from mixprec.optim import _fused_step

    module = load_benchmark("step_overhead")
    monkeypatch.setattr(_fused_step, "_CPU_FUSED_TILE", _fused_step._CPU_FUSED_TILE)  # restored after the test
    monkeypatch.setattr(_fused_step, "_GPU_FUSED_TILE", _fused_step._GPU_FUSED_TILE)
    assert module.main(["--only-compensated", "--rows", "pure-kahan-fused", "--params", "0.02", "--rounds", "1",
                        "--reps", "1", "--device", "cpu", "--fused-tile", "1024"]) == 0
    assert _fused_step._CPU_FUSED_TILE == _fused_step._GPU_FUSED_TILE == 1024
    assert "pure-kahan-fused" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        module.main(["--fused-tile", "-5", "--only-compensated"])


def test_profile_attributes_each_rows_step(capsys: pytest.CaptureFixture[str], load_benchmark: Any,
                                           tmp_path: Any) -> None:
    module = load_benchmark("step_overhead")
    out_json = tmp_path / "p.json"
    assert module.main(["--rows", "bf16-master", "--params", "0.02", "--rounds", "1", "--reps", "1", "--device", "cpu",
                        "--profile", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "## profile bf16-master:" in out and "## profile torch:" in out, out
    import json

    prof = json.loads(out_json.read_text())["rows"]["bf16-master"]["profile"]
    assert prof["launches"] > 0 and prof["kernel_ms"] > 0
    # Python functions by own time, largest first, named by file:line(function)
    py = prof["top_python"]
    assert py and all(a["us"] >= b["us"] for a, b in itertools.pairwise(py)), py
    assert all(r["where"].endswith(")") and ":" in r["where"] for r in py), py  # file:line(function); builtins ~:0(...)
    assert any(k.startswith("aten::_foreach") for k in prof["top_kernels"]), prof["top_kernels"]


def test_tile_calls_dynamo_sends_every_fused_tile_call_through_dynamo(capsys: pytest.CaptureFixture[str],
                                                                       load_benchmark: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from mixprec.optim import _fused_step

    module = load_benchmark("step_overhead")
    monkeypatch.setattr(_fused_step, "_DIRECT_CALLS", True)  # restored after the test
    monkeypatch.setattr(_fused_step, "_FUSED_CACHE", {})  # compile here (the backend below sees it)
    known: list[bool] = []
    real = _fused_step._TileCall._backend

    def backend(self: Any, gm: Any, example_inputs: Any) -> Any:
        compiled = real(self, gm, example_inputs)
        known.append(self.picks is not None)

        def direct(*args: Any) -> None:
            raise AssertionError("a tile call went straight to the compiled graph under --tile-calls dynamo")

        self.graph_fn = direct  # dynamo keeps calling `compiled`; the direct path would call this
        return compiled

    monkeypatch.setattr(_fused_step._TileCall, "_backend", backend)
    assert module.main(["--only-compensated", "--rows", "pure-kahan-fused", "--params", "0.02", "--rounds", "1",
                        "--reps", "1", "--device", "cpu", "--tile-calls", "dynamo"]) == 0
    assert _fused_step._DIRECT_CALLS is False and "pure-kahan-fused" in capsys.readouterr().out
    assert known and all(known)  # the direct path was possible, and not taken
