"""``mixprec compare --compile``: every row compiled (the baseline too), compile time apart from step time.

The ``aot_eager`` backend (dynamo + AOTAutograd, eager kernels) keeps these fast; it runs the
same capture path as Inductor without code generation.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

from mixprec.bench import BenchError, run_compare
from mixprec.bench._report import format_table_plain, table_rows
from mixprec.cli import main

TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4, eval_batches=1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(compile: str | None, presets: str = "fp32,bf16-mixed,bf16-master"):
    return run_compare("gpt", presets, baseline="bf16", steps=5, warmup=2, device="cpu", compile=compile,
                       workload_options=TINY)


def test_every_row_compiles_and_trains_like_eager() -> None:
    eager = _run(None)
    compiled = _run("aot_eager")
    assert compiled.settings["compile"] == "aot_eager" and eager.settings["compile"] is None
    names = [r.name for r in compiled.rows]
    assert names == ["fp32", "bf16-mixed", "bf16-master", "torch-amp"]
    tol = {"fp32": 1e-5, "bf16-mixed": 2e-2, "bf16-master": 2e-2, "torch-amp": 2e-2}
    for r in compiled.rows:
        assert r.status == "ok", (r.name, r.reason)
        assert r.compiled == "aot_eager"
        assert r.compile_seconds is not None and r.compile_seconds >= 0.0
        assert r.warm_compile_seconds is not None and r.warm_compile_seconds >= 0.0
        assert r.step_time_ms is not None
        ref = eager.row(r.name)
        assert ref.compiled is None and ref.compile_seconds is None and ref.recompiles is None
        assert ref.warm_compile_seconds is None
        # same shapes every step: nothing compiles again once the warm-up is over
        assert r.recompiles == 0, (r.name, r.recompiles)
        # the same weights and batches: the compiled run follows the eager one step for step
        assert len(r.losses) == len(ref.losses) == 5
        for a, b in zip(r.losses, ref.losses):
            assert a is not None and b is not None and math.isfinite(a)
            assert abs(a - b) <= tol[r.name] * max(1.0, abs(b)), (r.name, r.losses, ref.losses)


def test_the_table_shows_compile_time_as_its_own_column() -> None:
    result = _run("aot_eager", "bf16-mixed")
    header, cells = table_rows(result)
    col = header.index("compile s")
    assert header[1] == "step ms" and col == 3
    assert header[col + 1] == "warm s" and header[col + 2] == "recompiles"
    for c in cells:
        float(c[col])  # a number for every row, the baseline included
        float(c[col + 1])
        assert c[col + 2] == "0"  # fixed shapes: no timed step recompiled
    text = format_table_plain(result)
    assert "compiled (aot_eager)" in text
    assert any("torch.compile(backend='aot_eager')" in n for n in result.notes)
    plain = _run(None, "bf16-mixed")
    assert "compile s" not in table_rows(plain)[0] and "recompiles" not in table_rows(plain)[0]
    assert "warm s" not in table_rows(plain)[0]


def test_a_compiled_run_compiles_into_a_fresh_cache_and_restores_the_users(monkeypatch: pytest.MonkeyPatch) -> None:
    """'compile s' is a cold compile: the run's own Inductor cache directory, removed after; the user's setting comes back."""
    import os

    seen: list[str | None] = []
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/users")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    real = run_compare.__globals__["_warm_compile"]

    def spy(runs: Any, batch: Any) -> None:
        seen.append(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
        real(runs, batch)

    monkeypatch.setitem(run_compare.__globals__, "_warm_compile", spy)
    _run("aot_eager", "bf16-mixed")
    assert seen and seen[0] is not None and "mixprec-compare-" in seen[0]
    assert not os.path.exists(seen[0])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/users" and "TRITON_CACHE_DIR" not in os.environ


def test_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(BenchError, match="not one torch.compile knows; choose from .*inductor"):
        _run("inductr", "bf16-mixed")


def test_emulated_fp16_rows_are_unavailable_when_compiled_and_say_why() -> None:
    result = run_compare("gpt", "bf16-mixed,fp16-mixed", baseline="none", steps=3, warmup=1, device="cpu",
                         compile="aot_eager", workload_options=TINY)
    fp16 = result.row("fp16-mixed")
    assert fp16.status == "unavailable" and "--native-fp16" in (fp16.reason or "")
    assert result.row("bf16-mixed").status == "ok"


def test_cli_compile_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "-p", "bf16-mixed", "--baseline", "none", "--steps", "3", "--warmup", "1", "--compile",
                 "aot_eager", "--no-progress", "-o", "n_layer=1", "-o", "n_embd=16", "-o", "block_size=16",
                 "-o", "batch_size=4"]) == 0
    out = capsys.readouterr().out
    assert "compile s" in out and "compiled (aot_eager)" in out
    assert main(["compare", "--compile", "nope", "--steps", "3"]) == 2
    assert "not one torch.compile knows" in capsys.readouterr().err


def test_a_step_that_recompiles_after_the_warm_up_counts_as_compile_time() -> None:
    from mixprec.bench import load_workload

    w = load_workload("gpt", **TINY)
    batches = list(itertools.islice(iter(w.batches), 6))
    x, y = batches[4]
    batches[4] = (x[:2], y[:2])  # a new batch size at step 4: dynamo compiles again, in a timed step
    w.batches = batches
    result = run_compare(w, "bf16-mixed", baseline="none", steps=6, warmup=2, device="cpu", compile="aot_eager")
    row = result.row("bf16-mixed")
    assert row.status == "ok", row.reason
    assert row.step_time_ms is not None and row.step_time_ms["n"] == 3  # 4 timed steps, the recompiling one moved
    assert row.compile_seconds is not None and row.compile_seconds > 0
    # dynamo still compiles after the warm-up's memory step: no dispatch-mode tracker around a compiled row on CPU
    assert row.peak_memory_bytes is None and "not measured" in (row.memory_method or "")
    eager = run_compare(w, "bf16-mixed", baseline="none", steps=6, warmup=2, device="cpu", workload_options=None)
    assert eager.row("bf16-mixed").step_time_ms["n"] == 4  # eager: every step after the warm-up is timed


def test_compile_cold_reports_ratios_and_the_goal_per_preset(capsys: pytest.CaptureFixture[str], load_benchmark: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The table's ratios are first-step seconds over the torch.amp row's at the same depth; the goal line per preset
    holds only when every depth is within 1.25x cold and warm (the children, which compile, are stubbed here)."""
    module = load_benchmark("compile_cold")
    first = {("torch.amp bf16", 2): 10.0, ("bf16-mixed", 2): 12.0, ("bf16-pure", 2): 30.0,
             ("torch.amp bf16", 4): 20.0, ("bf16-mixed", 4): 26.0, ("bf16-pure", 4): 21.0}
    calls: list[str] = []

    devices: list[str] = []

    def fake_child(row: str, layers: int, width: int, steps: int, cache: str,
                   optimizer_step: bool = False, device: str = "cpu") -> dict[str, Any]:
        assert not optimizer_step
        calls.append(cache)
        devices.append(device)
        warm = calls.count(cache) == 2
        return {"first_s": first[(row, layers)] / (10.0 if warm else 1.0), "step_s": 0.01, "graphs": 1}

    monkeypatch.setattr(module, "run_child", fake_child)
    assert module.main(["--presets", "bf16-mixed,bf16-pure", "--layers", "2,4"]) == 0
    out = capsys.readouterr().out
    assert "1.20x" in out and "1.30x" in out and "3.00x" in out  # 12/10, 26/20, 30/10
    assert "goal bf16-mixed: cold and warm <= 1.25x torch.amp's at every depth: NOT met (at most 1.30x cold" in out
    assert "goal bf16-pure: cold and warm <= 1.25x torch.amp's at every depth: NOT met (at most 3.00x cold" in out
    first[("bf16-mixed", 4)] = 24.0
    calls.clear()
    assert module.main(["--presets", "bf16-mixed", "--layers", "2,4"]) == 0
    assert "goal bf16-mixed: cold and warm <= 1.25x torch.amp's at every depth: met (at most 1.20x cold, 1.20x warm)" in \
        capsys.readouterr().out
    assert set(devices) == {"cpu"}
    devices.clear()
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exit_info:  # a clear refusal here, not a traceback from every child
            module.main(["--presets", "bf16-mixed", "--layers", "2", "--device", "cuda"])
        assert exit_info.value.code == 2 and "this machine has no CUDA device" in capsys.readouterr().err
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the children are stubbed: check the forwarding
        monkeypatch.setattr(module, "device_or_exit", lambda name: torch.device(name), raising=False)
        import mixprec.bench._timing as timing

        monkeypatch.setattr(timing, "device_or_exit", lambda name: torch.device(name))
    assert module.main(["--presets", "bf16-mixed", "--layers", "2", "--device", "cuda"]) == 0
    assert devices == ["cuda"] * 4 and "# cuda;" in capsys.readouterr().out  # every child, cold and warm, on the GPU


def test_compile_cold_optimizer_step_rows_are_against_torch_compile_of_adamw_step(
        capsys: pytest.CaptureFixture[str], load_benchmark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--optimizer-step``: torch.compile(AdamW.step) is the baseline row, the fused compensated steps are the rows,
    each child runs the step mode; a child really runs one fused Kahan step and reports its first step."""
    module = load_benchmark("compile_cold")
    seen: list[tuple[str, bool]] = []

    def fake_child(row: str, layers: int, width: int, steps: int, cache: str,
                   optimizer_step: bool = False, device: str = "cpu") -> dict[str, Any]:
        seen.append((row, optimizer_step))
        return {"first_s": {"compile(AdamW.step)": 8.0, "kahan fused": 4.0, "sr-bf16 fused": 11.0}[row],
                "step_s": 0.01, "graphs": 1}

    monkeypatch.setattr(module, "run_child", fake_child)
    assert module.main(["--optimizer-step", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert {r for r, _ in seen} == {"compile(AdamW.step)", "kahan fused", "sr-bf16 fused"}
    assert all(flag for _, flag in seen)
    assert "goal kahan fused: cold and warm <= 1.25x compile(AdamW.step)'s at every depth: met (at most 0.50x" in out
    assert "goal sr-bf16 fused: cold and warm <= 1.25x compile(AdamW.step)'s at every depth: NOT met (at most 1.38x" in out
    got = module.child_step("kahan fused", 1, 32, 2)
    assert got["first_s"] > 0 and got["step_s"] > 0 and got["graphs"] >= 1
