"""`mixprec doctor` and `mixprec check`."""

from __future__ import annotations

import json
import re
import textwrap
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
