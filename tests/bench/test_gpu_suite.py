"""``benchmarks/gpu_suite.py``: every check names a script and options that exist (a typo would cost a GPU lease)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_check_runs_a_script_with_options_it_has(load_benchmark: Any) -> None:
    suite = load_benchmark("gpu_suite")
    names = [name for name, _, _ in suite.STEPS]
    assert len(set(names)) == len(names) and names[0] == "syncs"
    assert set(suite.NEEDS) <= set(names)
    for name, limit, cmd in suite.STEPS:
        assert limit > 0, name
        if cmd is None:
            continue
        assert cmd[0] == sys.executable, name
        if cmd[1] == "-m":  # pytest over test files
            for arg in cmd[3:]:
                if not arg.startswith("-"):
                    assert (ROOT / arg).exists() or arg == "cuda", (name, arg)
            continue
        script = ROOT / cmd[1]
        assert script.exists(), (name, script)
        source = script.read_text(encoding="utf-8")
        options = set(re.findall(r'add_argument\(\s*"(--[a-z0-9-]+)"', source))
        for arg in cmd[2:]:
            if arg.startswith("--"):
                assert arg in options, f"check {name!r}: {script.name} has no option {arg} (it has {sorted(options)})"


def test_a_check_whose_package_is_missing_is_skipped_with_the_way_to_bring_it(
        load_benchmark: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    suite = load_benchmark("gpu_suite")
    monkeypatch.setattr(suite.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(suite.torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(suite.importlib.util, "find_spec", lambda name, *a: None)
    assert suite.main(["--only", "fp8", "--out", str(tmp_path)]) == 0  # skipped is not failed
    out = capsys.readouterr().out
    assert re.search(r"^fp8 +skipped: no torchao \(on a CPU machine: pip download", out, re.M), out
    assert "=== fp8" not in out  # nothing started


def test_a_plain_run_makes_the_default_checks_and_all_adds_the_rest(
        load_benchmark: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The default run is issue 26's seven checks, in order; ``--all`` appends every other; a typo in ``--only`` stops."""
    suite = load_benchmark("gpu_suite")
    names = [name for name, _, _ in suite.STEPS]
    assert list(suite.DEFAULT) == names[:len(suite.DEFAULT)]
    assert set(suite.DEFAULT) == {"syncs", "capture", "gpt2-eager", "gpt2-compiled", "compensated", "step", "cuda-tests"}
    monkeypatch.setattr(suite.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(suite.torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(suite, "_syncs", lambda: 0)
    started: list[str] = []

    class FakeProc:
        def __init__(self, argv: list[str], **kw: Any) -> None:
            started.append(" ".join(argv))
            self.stdout: list[str] = []
            self.pid = -1

        def wait(self, timeout: float | None = None) -> int:
            return 0

    monkeypatch.setattr(suite.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(suite.importlib.util, "find_spec", lambda name, *a: object())
    assert suite.main(["--out", str(tmp_path)]) == 0
    ran = re.findall(r"^=== (\S+) \(limit", capsys.readouterr().out, re.M)
    assert ran == list(suite.DEFAULT) and len(started) == len(suite.DEFAULT) - 1  # syncs runs in-process
    assert suite.main(["--all", "--budget", "100000", "--out", str(tmp_path)]) == 0
    assert re.findall(r"^=== (\S+) \(limit", capsys.readouterr().out, re.M) == names
    assert suite.main(["--only", "syncs,compensated-t21", "--out", str(tmp_path)]) == 2
    assert "no check named compensated-t21" in capsys.readouterr().out
