"""benchmarks/gpu_gpt2.py runs as one command: skips cleanly without CUDA, and its code path works
(checked on the CPU with --tiny)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_gpt2.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TINY = ["--tiny", "--steps", "3", "--warmup", "1"]


def _run_script(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """Run gpu_gpt2.py with ``args`` in a subprocess (one torch thread) and return what it printed."""
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout, check=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-GPU path")
def test_skips_cleanly_without_cuda() -> None:
    proc = _run_script(timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "needs a GPU. Skipped." in proc.stdout
    assert "Traceback" not in proc.stderr


def test_tiny_cpu_run_prints_each_pair_as_it_finishes_and_writes_json(tmp_path: Path) -> None:
    proc = _run_script(*TINY, "--presets", "bf16-mixed,fp16-mixed", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    first = out.index("bf16-mixed     vs torch-amp bf16: step time x")
    # the first pair's ratio is printed before the second pair's table: a run cut short keeps it
    assert first < out.index("fp16-mixed     vs torch-amp fp16: step time x") < out.rindex("torch-amp fp16")
    assert out.index("torch-amp bf16") < first
    d = json.loads((tmp_path / "gpu_gpt2.json").read_text())
    assert [p["preset"] for p in d["pairs"]] == ["bf16-mixed", "fp16-mixed"]
    assert [p["baseline"] for p in d["pairs"]] == ["torch-amp-bf16", "torch-amp-fp16"]
    assert d["left_out"] == []
    pair = json.loads((tmp_path / "compare-bf16-mixed.json").read_text())
    assert [r["name"] for r in pair["rows"]] == ["bf16-mixed", "torch-amp"]
    assert pair["workload"]["options"]["tie"] is True


def test_budget_leaves_out_the_pairs_that_would_not_fit(tmp_path: Path) -> None:
    proc = _run_script(*TINY, "--presets", "bf16-mixed,fp16-mixed,fp32", "--budget", "0.001", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "left out: fp16-mixed, fp32" in proc.stdout
    d = json.loads((tmp_path / "gpu_gpt2.json").read_text())
    assert [p["preset"] for p in d["pairs"]] == ["bf16-mixed"] and d["left_out"] == ["fp16-mixed", "fp32"]


def test_profile_prints_the_differences(tmp_path: Path) -> None:
    proc = _run_script(*TINY, "--presets", "bf16-master", "--profile", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "profile bf16-master minus torch-amp bf16: host time per step" in proc.stdout
    prof = json.loads((tmp_path / "gpu_gpt2.json").read_text())["pairs"][0]["profile"]
    assert prof["mixprec"]["host_ms_per_step"] > 0 and prof["top_differences"]
    # the master step's foreach edit check is among what mixprec runs and torch.amp does not
    assert "aten::where" in prof["mixprec"]["kernels_us_per_step"]  # (its flat where, on a CPU)


def test_tiny_cpu_run_compiled(tmp_path: Path) -> None:
    proc = _run_script(*TINY, "--presets", "bf16-mixed,bf16-master", "--compile", "aot_eager", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "compiled (aot_eager)" in proc.stdout and "compile s" in proc.stdout
    assert "bf16-master    vs torch-amp bf16: step time x" in proc.stdout
    assert ", compile cold " in proc.stdout and ", warm " in proc.stdout and ", recompiles 0 vs 0" in proc.stdout
    for preset in ("bf16-mixed", "bf16-master"):
        d = json.loads((tmp_path / f"compare-{preset}.json").read_text())
        assert d["settings"]["compile"] == "aot_eager"
        assert all(r["status"] == "ok" and r["compiled"] == "aot_eager" and r["compile_seconds"] is not None
                   and r["warm_compile_seconds"] is not None for r in d["rows"])


def test_cache_bypass_reasons_are_collected_per_pair_and_the_loggers_restored(load_benchmark: Any) -> None:
    import logging

    module = load_benchmark("gpu_gpt2")
    aot = logging.getLogger(module._CacheBypasses.LOGGERS[0])
    level = aot.level
    with module._CacheBypasses() as seen:
        aot.info("Bypassing autograd cache due to: %s", "Unsupported call_function target X")
        aot.info("Bypassing autograd cache due to: %s", "Unsupported call_function target X")
        logging.getLogger(module._CacheBypasses.LOGGERS[1]).info("FX graph cache hit")  # not a bypass
    assert seen.reasons == {"Bypassing autograd cache due to: Unsupported call_function target X": 2}
    assert aot.level == level and seen not in aot.handlers
