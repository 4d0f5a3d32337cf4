"""``benchmarks/edit_check_cost.py``: each route checks its result against where() and prints its row."""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import pytest

import mixprec._edit_kernel as ek


def test_the_foreach_row_on_a_cpu(load_benchmark: Any, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("edit_check_cost")
    assert bench.main(["--scale-down", "400", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^foreach +[\d.]+ +[\d.]+ +1\.000x$", out, re.M), out
    assert "triton" not in out.split("route")[1]  # no Triton route on a CPU


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the test extra)")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy's, in the interpreter's FP16 cast
def test_both_rows_in_the_interpreter(load_benchmark: Any, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ek, "DEVICES", frozenset({"cpu"}))
    ek.reset()
    try:
        bench = load_benchmark("edit_check_cost")
        assert bench.main(["--scale-down", "2000", "--reps", "1", "--dtype", "fp16"]) == 0
    finally:
        ek.reset()
    out = capsys.readouterr().out
    assert re.search(r"^triton +[\d.]+ +[\d.]+ +[\d.]+x$", out, re.M), out


def test_a_wrong_result_is_refused(load_benchmark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("edit_check_cost")
    monkeypatch.setattr(bench, "_carry_edits", lambda masters, weights, views=None: None)  # carries nothing
    with pytest.raises(RuntimeError, match="the foreach edit check disagrees with where"):
        bench.main(["--scale-down", "400", "--reps", "1"])
