"""docs/integrations.md: the Trainer, Accelerate and Lightning examples run as written (in a temporary directory)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def _example(section: str) -> str:
    text = DOC.read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    assert len(blocks) == 1, f"one python example expected under '## {section}'"
    return blocks[0]


def _run(code: str, ns: dict) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU warns that it is slow; transformers' config notes
        exec(compile(code, str(DOC), "exec"), ns)
    return ns


def test_trainer_example_runs_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _example("Hugging Face Trainer")
    head, resume = code.split("trainer.train(resume_from_checkpoint=")
    ns = _run(head, {})
    trainer = ns["trainer"]
    assert (tmp_path / "out" / "checkpoint-3" / "mixprec.pt").is_file()
    first = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(first) == 6
    _run("trainer.train(resume_from_checkpoint=" + resume, ns)  # steps 4-6 again, from the checkpoint
    again = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(again) == 6 and again[3:] == first[3:]


def test_accelerate_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = _run(_example("Accelerate"), {})
    prec = ns["accelerator"].prec
    assert int(prec.applied_steps) >= 6  # 8 batches; an early step may be skipped while the fp16 scale settles
    assert (tmp_path / "acc_state").is_dir()


def test_lightning_examples_run(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    monkeypatch.chdir(tmp_path)
    body = DOC.read_text().split("\n## Lightning\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    assert len(blocks) == 2, "a Trainer and a Fabric example expected under '## Lightning'"
    for code in blocks:
        _run(code, {"__name__": "__main__"})
