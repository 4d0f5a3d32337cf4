"""`mixprec doctor` and `mixprec check`."""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from mixprec.cli import main

USER_MODULE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, scale):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.big = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)  # an FP32 island: FP16 inf in, NaN out (tanh would hide an inf on CUDA)
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.big.weight.mul_(scale)

    def forward(self, x):
        return self.head(self.norm(self.big(self.a(x))))


def batches():
    g = torch.Generator().manual_seed(0)
    while True:
        yield torch.randn(16, 8, generator=g)


def make(scale=1.0):
    return (Net(scale), lambda params: torch.optim.SGD(params, lr=0.1), batches(),
            lambda m, x: m(x).float().pow(2).mean())
'''


@pytest.fixture()
def user_module(tmp_path: Path) -> str:
    path = tmp_path / "my_model.py"
    path.write_text(textwrap.dedent(USER_MODULE))
    return str(path)


def test_check_fails_a_planted_fp16_overflow(user_module: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "check.json"
    code = main(["check", f"{user_module}:make", "-o", "scale=1e6", "--policy", "fp16-mixed", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 1
    assert re.search(r"mixprec check: fp16-mixed on \S+: FAIL", out), out
    assert "output of 'big' (Linear)" in out
    assert json.loads(out_json.read_text())["verdict"] == "fail"


def test_check_passes_a_healthy_model(user_module: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", f"{user_module}:make", "-p", "bf16-mixed"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_doctor_on_the_gpt_workload_writes_the_report_plot_and_json(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    opts = ["-o", "n_layer=1", "-o", "n_embd=32", "-o", "batch_size=4", "-o", "block_size=16"]
    code = main(["doctor", "-w", "gpt", *opts, "--steps", "2", "--out", str(tmp_path), "--json", "-"])
    captured = capsys.readouterr()
    assert code == 0
    record = json.loads(captured.out)  # --json -: stdout is JSON only, the report goes to stderr
    assert record["schema"] == "mixprec.doctor/1" and record["steps"] == 2
    assert record["report"]["recommended_preset"] == "bf16-mixed"
    assert record["check"]["verdict"] in ("pass", "warn")
    assert "Recommended preset" in captured.err and "FP16 loss-scale range" in captured.err
    png = tmp_path / "doctor-grad-hist.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "doctor.json").read_text())["workload"] == "gpt"


@pytest.mark.parametrize("argv, message", [
    (["check", "gpt", "--policy", "fp17-mixed"], "mixprec check: error: --policy: unknown precision preset 'fp17-mixed'"),
    (["check", "nope_module_xyz:make"], "mixprec check: error: workload 'nope_module_xyz:make': no module named"),
    (["doctor", "-w", "gpt", "--steps", "0"], "mixprec doctor: error: --steps 0: need at least 1"),
    (["doctor", "-o", "n_layer"], "mixprec doctor: error: -o/--option expects KEY=VALUE, got 'n_layer'"),
    (["check", "gpt", "--device", "tpu9"], "mixprec check: error: --device 'tpu9'"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message), err
    assert len(err.strip().splitlines()) == 1


# ----- the workload: positional or -w in every command (issue 15.4) ----------------------------------
def test_check_takes_the_workload_as_w_too(user_module: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "-w", f"{user_module}:make", "-p", "bf16-mixed"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["check", f"{user_module}:make", "--workload", f"{user_module}:make"]) == 0  # both, alike
    assert "PASS" in capsys.readouterr().out


def test_doctor_takes_the_workload_positional_too(user_module: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", f"{user_module}:make", "--steps", "1", "--no-plot", "--out", str(tmp_path / "d"),
                 "--json", "-"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["workload"] == f"{user_module}:make"


@pytest.mark.parametrize("command", ["check", "doctor", "compare"])
def test_a_workload_given_twice_and_disagreeing_is_a_usage_error(command: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "gpt", "-w", "cnn"]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == (
        f"mixprec {command}: error: the workload was given twice and the two disagree: 'gpt' (positional) and "
        f"'cnn' (-w/--workload); give it once (see mixprec {command} --help)"
    ), err
    assert not out


def test_check_without_a_workload_says_both_forms(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "-p", "bf16-mixed"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixprec check: error: a workload is required: mixprec check WORKLOAD or mixprec check -w "
                          "WORKLOAD"), err
    assert len(err.strip().splitlines()) == 1


# ----- path/to/file.py:function imports its sibling modules (issue 15.4) ------------------------------
SIBLING = "_mixprec_test_sibling_layers"

FILE_WITH_SIBLING = f'''
import torch
from {SIBLING} import make_model


def make():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(16, 8, generator=g) for _ in range(4)]
    return (make_model(), lambda params: torch.optim.SGD(params, lr=0.1), batches,
            lambda m, x: m(x).float().pow(2).mean())
'''

SIBLING_MODULE = '''
import torch


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
'''


@pytest.fixture()
def file_with_sibling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    import sys

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(textwrap.dedent(FILE_WITH_SIBLING))
    (project / f"{SIBLING}.py").write_text(textwrap.dedent(SIBLING_MODULE))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not the file's folder: only the fix can find the sibling
    yield str(project / "train.py")
    sys.modules.pop(SIBLING, None)


@pytest.mark.parametrize("command", [
    ["check", "{spec}", "-p", "bf16-mixed"],
    ["doctor", "-w", "{spec}", "--steps", "1", "--no-plot", "--no-check"],
    ["compare", "-w", "{spec}", "-p", "fp32", "--baseline", "none", "--steps", "2", "--warmup", "1", "--no-progress"],
], ids=["check", "doctor", "compare"])
def test_a_file_workload_imports_its_sibling_module(file_with_sibling: str, command: list[str], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    path_before = list(sys.path)
    extra = ["--out", str(tmp_path / "out")] if command[0] == "doctor" else []
    code = main([a.format(spec=f"{file_with_sibling}:make") for a in command] + extra)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "no module named" not in (out + err).lower()
    assert sys.path == path_before  # the file's folder was on sys.path only while it loaded


@pytest.mark.parametrize("command", ["check", "doctor"])
def test_a_failing_run_is_one_stderr_line_and_exit_1_unless_debugging(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "failing_bench.py"
    f.write_text(textwrap.dedent(USER_MODULE) + textwrap.dedent('''
        def make_failing():
            def loss(m, x):
                raise RuntimeError("boom in the user's loss")
            net, opt, data, _ = make()
            return net, opt, data, loss
        '''))
    args = [command, f"{f}:make_failing", "--steps", "1", "--out", str(tmp_path / "o")] if command == "doctor" \
        else [command, f"{f}:make_failing"]
    monkeypatch.delenv("MIXPREC_DEBUG", raising=False)
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"mixprec {command}: error: the run failed: RuntimeError: boom in the user's loss "
                       "(MIXPREC_DEBUG=1 shows the traceback)")
    monkeypatch.setenv("MIXPREC_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom in the user's loss"):
        main(args)


ROOT_SCALES = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.norm, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x) * 1e5))  # the root's own code overflows FP16


def batches():
    g = torch.Generator().manual_seed(0)
    while True:
        yield torch.randn(8, 16, generator=g)


def make():
    return Net(), lambda params: torch.optim.SGD(params, lr=0.01), batches(), lambda m, x: m(x).float().pow(2).mean()
'''


def test_doctor_and_check_name_the_same_first_inf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An overflow in the root's own code: check's finding, its trace and doctor's first finding say the same place."""
    path = tmp_path / "root_scales.py"
    path.write_text(textwrap.dedent(ROOT_SCALES))
    place = "in the code of the root model (Net) itself, between 'fc1' and 'norm'"
    assert main(["check", str(path) + ":make", "--policy", "fp16-mixed"]) == 1
    out = capsys.readouterr().out
    assert f"first inf: forward, {place}; finite in FP32: precision is the cause." in out
    assert "input of 'the root model'" not in out  # the old wording read as if the model's input were inf
    rc = main(["doctor", str(path) + ":make", "--policy", "fp16-mixed", "--steps", "2", "--no-plot",
               "--out", str(tmp_path / "doc")])
    out = capsys.readouterr().out
    assert rc == 1, out  # doctor's exit status: the pre-flight check failed
    findings = out.split("Findings:\n", 1)[1].splitlines()
    assert findings[0].startswith(f"  - Under fp16-mixed the first inf appears in the forward {place} (finite in FP32: "
                                  "precision is the cause); the pre-flight check fails. Use bf16"), findings[0]
