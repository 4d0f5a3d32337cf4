"""benchmarks/gpu_gpt2.py runs as one command: skips cleanly without CUDA, and its code path works
(checked on the CPU with --tiny)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_gpt2.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-GPU path")
def test_skips_cleanly_without_cuda() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=ENV, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "needs a GPU. Skipped." in proc.stdout
    assert "Traceback" not in proc.stderr


def test_tiny_cpu_run_prints_ratios_and_writes_json(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--steps", "3", "--warmup", "1", "--presets", "bf16-mixed,fp16-mixed",
         "--out", str(tmp_path)],
        capture_output=True, text=True, env=ENV, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "bf16-mixed   vs torch-amp bf16: step time x" in proc.stdout
    assert "fp16-mixed   vs torch-amp fp16: step time x" in proc.stdout
    d = json.loads((tmp_path / "compare.json").read_text())
    assert [r["name"] for r in d["rows"]] == ["bf16-mixed", "fp16-mixed", "torch-amp-fp16", "torch-amp-bf16"]
    assert d["workload"]["options"]["tie"] is True


def test_tiny_cpu_run_compiled(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--steps", "3", "--warmup", "1", "--presets", "bf16-mixed,bf16-master",
         "--baseline", "bf16", "--compile", "aot_eager", "--out", str(tmp_path)],
        capture_output=True, text=True, env=ENV, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "compiled (aot_eager)" in proc.stdout and "compile s" in proc.stdout
    assert "bf16-master  vs torch-amp bf16: step time x" in proc.stdout
    d = json.loads((tmp_path / "compare.json").read_text())
    assert d["settings"]["compile"] == "aot_eager"
    assert all(r["status"] == "ok" and r["compiled"] == "aot_eager" and r["compile_seconds"] is not None for r in d["rows"])
