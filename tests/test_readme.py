"""The README's example runs as written (in a temporary directory) and its commands exist."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import torch

import mixprec

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_trains_and_saves(tmp_path, monkeypatch):
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU warns that it is slow
        exec(compile(blocks[0], "README.md", "exec"), ns)  # our own README
    assert (tmp_path / "ckpt.pt").exists()
    assert not list(tmp_path.glob(".*.tmp")), "mixprec.save left a temporary file behind"
    info = ns["info"]
    assert int(info.applied_steps) >= 90  # a few early steps may be skipped while the scale settles
    raw = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert raw["format"] == "mixprec.checkpoint", "the README must save with mixprec.save, not torch.save"
    prec = ns["prec"]
    state = mixprec.load(tmp_path / "ckpt.pt", expected_policy=prec.policy)  # format, CRC32 and policy checked
    assert state["policy"] == str(prec.policy)
    prec.load_state_dict(state)  # the saved run resumes


def test_readme_set_up_commands_are_the_ci_ones():
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    test_cmd = ".venv/bin/python -m pytest -q -n auto --dist loadscope"
    assert f"```bash\n{test_cmd}\n```" in text
    assert ci.strip().splitlines()[-1] == test_cmd
    assert "pip install torch==2.13.0 -e '.[cli,test]' && .venv/bin/mixprec compare" in text


def test_cli_commands_named_in_the_readme_exist():
    out = subprocess.run([sys.executable, "-m", "mixprec.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for cmd in ("compare", "doctor", "check"):
        assert cmd in out.stdout


def test_nothing_refers_to_documents_outside_the_repository():
    """A newcomer has only the repository: no file may send them to the team's design notes or shared folder."""
    root = README.parent
    outside = re.compile(r"DESIGN\.md|\.\./shared|shared/MACHINE|MACHINE-NOTES")
    hits = []
    for path in [*root.glob("*.md"), *root.glob("docs/*.md"), *root.glob("src/**/*.py"), *root.glob("tests/**/*.py"),
                 *root.glob("benchmarks/*.py"), root / "pyproject.toml", root / ".ci" / "run"]:
        if path.name == "test_readme.py":
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if outside.search(line):
                hits.append(f"{path.relative_to(root)}:{i}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)
