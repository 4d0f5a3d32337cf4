"""The `mixprec` command line: compare smoke runs per workload, outputs, and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mixprec.cli import main

TINY_LM = ["-o", "n_layer=1", "-o", "n_head=2", "-o", "n_embd=16", "-o", "block_size=16", "-o", "batch_size=4",
           "-o", "eval_batches=1"]
FAST = ["--steps", "3", "--warmup", "1", "--no-progress"]


def _one_line_error(capsys: pytest.CaptureFixture[str], rc: int) -> str:
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_compare_gpt_smoke_with_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "out"
    rc = main(["compare", *TINY_LM, *FAST, "-p", "fp32,bf16-mixed,fp16-mixed", "--out", str(out_dir),
               "--json", str(tmp_path / "r.json")])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "fp16-mixed (fp16 emulated)" in out and "torch-amp fp16 (emulated)" in out
    assert "do not show GPU speed-ups" in out
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["schema"] == "mixprec.compare/1" and [r["name"] for r in d["rows"]] == ["fp32", "bf16-mixed", "fp16-mixed", "torch-amp"]
    assert json.loads((out_dir / "compare.json").read_text())["workload"]["name"] == "gpt"
    for name in ("loss_curves.png", "loss_scale.png", "memory.png", "speed.png"):
        assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_f8_layers_reaches_the_fp8_rows(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torchao")
    lm = [a if a != "n_embd=16" else "n_embd=32" for a in TINY_LM]  # linears FP8 takes (multiples of 16)
    rc = main(["compare", *lm, *FAST, "-p", "bf16-mixed,fp8-rowwise", "--baseline", "none", "--f8-layers", "none",
               "--json", "-"])
    out, _ = capsys.readouterr()
    assert rc == 0
    rows = {r["name"]: r for r in json.loads(out)["rows"]}
    assert rows["fp8-rowwise"]["policy"].endswith("f8_layers=none") and "f8" not in rows["bf16-mixed"]["policy"]


def test_compare_f8_layers_glob_that_matches_nothing_is_an_argument_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A --f8-layers typo used to become an 'unavailable' row and exit 0; it is the user's argument: exit 2."""
    pytest.importorskip("torchao")
    lm = [a if a != "n_embd=16" else "n_embd=32" for a in TINY_LM]
    line = _one_line_error(capsys, main(["compare", *lm, *FAST, "-p", "bf16-mixed,fp8-rowwise", "--baseline", "none",
                                         "--f8-layers", "nomatch.*"]))
    assert line.startswith("mixprec compare: error: --f8-layers 'nomatch.*': f8_layers glob 'nomatch.*' of policy")


def test_compare_cnn_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["compare", "-w", "cnn", "-o", "width=4", "-o", "batch_size=16", *FAST, "-p", "fp32,bf16-master",
               "--baseline", "bf16"])
    out, _ = capsys.readouterr()
    assert rc == 0 and "bf16-master" in out and "val acc" in out and "torch-amp bf16" in out


def test_compare_hf_gpt2_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    rc = main(["compare", "-w", "hf-gpt2", *TINY_LM, *FAST, "-p", "fp32,fp16-master", "--json", "-"])
    out, err = capsys.readouterr()
    assert rc == 0
    d = json.loads(out)  # the JSON alone on stdout; the table went to stderr
    assert d["workload"]["name"] == "hf-gpt2" and "fp16-master (fp16 emulated)" in err
    assert all(r["status"] == "ok" for r in d["rows"])


def test_compare_seeds_reports_the_verdict_and_the_json_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["compare", *TINY_LM, *FAST, "-p", "bf16-mixed", "--baseline", "none", "--seeds", "0,1",
               "--json", str(tmp_path / "r.json")])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "Is the gap real? 2 seeds (0,1)" in out and "fp32 added to the presets" in out
    line = next(x for x in out.splitlines() if x.startswith("bf16-mixed ") and "noise" in x)
    # two seeds cannot tell: the 95 % interval of a 2-seed mean is ±12.7 standard errors
    assert "no verdict: 2 seeds are too few (a verdict needs >= 3;" in line
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["seeds"]["seeds"] == [0, 1] and [r["name"] for r in d["seeds"]["rows"]] == ["fp32", "bf16-mixed"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--seed", "1", "--seeds", "0,1"], "--seed 1 and --seeds 0,1: give one"),
        (["--seeds", "3"], "--seeds 3: need at least 2 seeds"),
    ],
)
def test_compare_seeds_errors_are_one_line(args: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(capsys, main(["compare", *FAST, *args]))
    assert line.startswith("mixprec compare: error: ") and expected in line


USER_MODULE = '''
import torch

def make(width=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, width, generator=g), torch.randn(8, 1, generator=g)) for _ in range(10)]
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]).float(), b[1])
    return model, (lambda params: torch.optim.SGD(params, lr=0.01)), batches, loss_fn

def wrong():
    return {"model": None}

def not_scalar():
    model, opt_fn, batches, _ = make()
    return model, opt_fn, batches, (lambda m, b: m(b[0]))
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "mixprec_cli_wl.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return "mixprec_cli_wl"


def test_compare_user_workload_smoke(user_module: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["compare", "-w", f"{user_module}:make", "-o", "width=3", *FAST, "-p", "fp32,bf16-mixed", "--baseline", "none"])
    out, _ = capsys.readouterr()
    assert rc == 0 and "bf16-mixed" in out and "torch-amp" not in out


def test_compare_takes_the_workload_positional_too(user_module: str, capsys: pytest.CaptureFixture[str]) -> None:
    for form in ([f"{user_module}:make"], [f"{user_module}:make", "-w", f"{user_module}:make"]):
        rc = main(["compare", *form, "-o", "width=3", *FAST, "-p", "fp32", "--baseline", "none"])
        out, _ = capsys.readouterr()
        assert rc == 0 and f"mixprec compare: {user_module}:make on " in out


def test_compare_workload_given_twice_and_disagreeing_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(capsys, main(["compare", "cnn", "--workload", "gpt", *FAST]))
    assert line == ("mixprec compare: error: the workload was given twice and the two disagree: 'cnn' (positional) "
                    "and 'gpt' (-w/--workload); give it once (see mixprec compare --help)")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["-p", "fp32,bf16-mixd"], "unknown preset 'bf16-mixd' (did you mean 'bf16-mixed'?); choose from"),
        (["-p", "bf16-true"], "'bf16-true' is the policy 'p=bf16,c=bf16,o=f32,m=none,ls=none,i=norm,tf32=0,comp=none', "
                              "not one of the presets compare runs as its rows; choose from: fp32,"),
        (["-p", "p=f32,c=bf16"], "'p=f32' is part of a policy string, not one of the presets compare runs as its rows"),
        (["--peak-tflops", "0"], "--peak-tflops: expects a finite number of TFLOP/s above 0 (e.g. 989 for an H100), got '0'"),
        (["--peak-tflops", "-1"], "got '-1'"),
        (["--peak-tflops", "nan"], "got 'nan'"),
        (["-w", "gtp"], "unknown workload 'gtp'; choose one of: gpt, cnn, hf-gpt2, or your own as MODULE:FUNCTION. Did you mean 'gpt'?"),
        (["-w", "no_such_module_xyz:make"], "no module named 'no_such_module_xyz'"),
        (["-w", "mixprec_cli_wl:nope"], "module 'mixprec_cli_wl' has no function 'nope'"),
        (["-w", "mixprec_cli_wl:wrong"], "must return a mixprec.bench.Workload or a 4-tuple (model, optimizer_fn, batches, loss_fn); got dict"),
        (["-w", "mixprec_cli_wl:not_scalar", "--baseline", "none"], "loss_fn must return a scalar floating tensor"),
        (["-w", "mixprec_cli_wl:make", "--steps", "50"], "its batches ran out after 10 of the 50 steps"),
        (["-o", "nlayer=2"], "unknown gpt workload option 'nlayer'"),
        (["-o", "n_layer"], "-o/--option expects KEY=VALUE"),
        (["--steps", "1"], "--steps 1: need at least 2"),
        (["-p", "bf16-mixed", "--f8-layers", "auto"], "--f8-layers 'auto' applies to the FP8 rows"),
        (["--device", "cuda:0"] if not __import__("torch").cuda.is_available() else ["--device", "tpu"], "device"),
        (["--baseline", "fp8"], "argument --baseline: invalid choice: 'fp8'"),
        (["--steps", "many"], "argument --steps: invalid int value: 'many'"),
    ],
)
def test_bad_arguments_give_one_clear_line_and_exit_2(
    user_module: str, args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _one_line_error(capsys, main(["compare", *FAST, *args]))
    assert line.startswith("mixprec compare: error: ")
    assert expected in line


def test_unknown_subcommand_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(capsys, main(["comprae"]))
    assert "invalid choice: 'comprae'" in line
    assert main(["compare", "--help"]) == 0
    assert "MODULE:FUNCTION" in capsys.readouterr().out
    assert main(["--version"]) == 0


def test_doctor_and_check_register_when_numerics_exists(capsys: pytest.CaptureFixture[str]) -> None:
    """mixprec.numerics ships with mixprec, so both commands must import and register (a broken import fails here)."""
    import mixprec.cli._check
    import mixprec.cli._doctor

    assert callable(mixprec.cli._doctor.run_doctor)
    for command, option in (("doctor", "--policy"), ("check", "--policy")):
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert f"usage: mixprec {command}" in out and option in out, out
        assert "unavailable" not in out


def test_console_entry_point_errors_without_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec.cli", "compare", "-p", "fp16-mixd"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120, check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "mixprec compare: error: unknown preset 'fp16-mixd' (did you mean 'fp16-mixed'?); choose from: fp32, tf32, "
        "bf16-mixed, fp16-mixed, bf16-master, bf16-master-r16, fp16-master, bf16-pure, fp16-pure, fp8-tensorwise, fp8-rowwise, or "
        "'all' (the torch-amp baseline is set with --baseline)"
    )


def test_unwritable_output_paths_are_refused_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--out naming a file, --json naming a directory: exit 2 with the reason, before any training (the run's results
    used to be lost to a traceback after it)."""
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    assert main(["compare", *TINY_LM, *FAST, "-p", "fp32", "--baseline", "none", "--out", str(a_file)]) == 2
    err = capsys.readouterr().err
    assert f"--out {a_file}: exists and is not a directory" in err
    assert main(["compare", *TINY_LM, *FAST, "-p", "fp32", "--baseline", "none", "--json", str(tmp_path)]) == 2
    assert f"--json {tmp_path}: is a directory" in capsys.readouterr().err
    assert main(["doctor", "--out", str(a_file)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("args, says", [
    (["-w", "cnn", "-o", "batch_size=1498"], "batch_size=1498 needs 1498 training images, but there are 1497"),
    (["-w", "cnn", "-o", "held_out=1797"], "held_out=1797 needs 1798 images"),
    (["-w", "gpt", "-o", "block_size=50000"], "block_size=50000 needs 50002 characters of held-out text"),
    (["-w", "hf-gpt2", "-o", "n_embd=30"], "hf-gpt2: n_embd=30 must be a multiple of n_head=4"),
    (["-w", "hf-gpt2", "-o", "dropout=2"], "dropout=2.0 must be in [0, 1)"),
])
def test_workload_sizes_the_data_cannot_serve_are_usage_errors(args: list[str], says: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # a cnn batch larger than its training split looped forever; the others were tracebacks from torch/transformers
    line = _one_line_error(capsys, main(["compare", *args, *FAST, "-p", "bf16-mixed"]))
    assert says in line


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a write that fails: disk full)")
def test_an_output_that_cannot_be_written_is_one_error_line_and_the_others_are_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "plots"
    rc = main(["compare", *TINY_LM, *FAST, "-p", "fp32", "--baseline", "none", "--out", str(out_dir), "--json", "/dev/full"])
    out, err = capsys.readouterr()
    assert rc == 1 and "Traceback" not in err
    assert "mixprec compare: error: could not write /dev/full" in err
    assert (out_dir / "compare.json").exists() and list(out_dir.glob("*.png"))
    rc = main(["check", "gpt", *TINY_LM, "--json", "/dev/full"])
    out, err = capsys.readouterr()
    assert rc == 1 and err.strip().splitlines()[-1].startswith("mixprec check: error: could not write /dev/full")
