"""``benchmarks/cuda_tests.py``: the CUDA-marked test files, one pytest process each, in parallel, with a time limit."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Two files with CUDA-marked tests that are quick to collect (every test skipped without CUDA).
FILES = [str(ROOT / "tests/test_ema.py"), str(ROOT / "tests/test_scaler.py")]


def test_it_finds_the_files_with_cuda_marked_tests_and_only_those(load_benchmark: Any) -> None:
    module = load_benchmark("cuda_tests")
    files = {p.relative_to(ROOT).as_posix() for p in module.cuda_test_files()}
    assert {"tests/test_gpu_step.py", "tests/optim/test_fused.py", "tests/optim/test_skip.py"} <= files
    assert "tests/test_policy.py" not in files and "tests/bench/test_cuda_tests.py" not in files


def test_each_file_reports_when_it_finishes_and_a_cpu_run_passes(capsys: pytest.CaptureFixture[str],
                                                                  load_benchmark: Any, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_benchmark("cuda_tests")
    files = FILES
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert module.main([*files, "--jobs", "2", "--timeout", "120"]) == 0
    assert not list(tmp_path.iterdir())  # the per-file logs are removed once printed
    out = capsys.readouterr().out
    for f in files:  # without CUDA each file's CUDA tests are skipped: a pass, with pytest's summary line
        assert any(line.startswith("ok") and f in line and "skipped" in line for line in out.splitlines()), out
    assert "2 of 2 files passed" in out


def test_a_file_past_the_time_limit_is_killed_and_the_run_fails(capsys: pytest.CaptureFixture[str],
                                                                load_benchmark: Any) -> None:
    module = load_benchmark("cuda_tests")
    files = FILES
    assert module.main([*files, "--jobs", "1", "--timeout", "0"]) == 1
    out = capsys.readouterr().out
    assert f"KILLED {files[0]}" in out and f"NOT RUN {files[1]}" in out and "0 of 2 files passed" in out
