"""Shared test set-up: one thread per process, CUDA markers, hypothesis profile."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

# Two-core CI machines: a second busy process makes every parallel op spin-wait (~4 ms per op,
# measured), so tests run single-threaded.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    from hypothesis import settings

    settings.register_profile("mixprec", deadline=None, max_examples=60, print_blob=True)
    settings.load_profile("mixprec")
except ImportError:  # hypothesis is in the test extra; tests that need it import it themselves
    pass

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Every available device: cpu always, cuda when present."""
    return torch.device(request.param)


@pytest.fixture
def load_benchmark() -> Callable[[str], ModuleType]:
    """``load_benchmark("remainder_cost")``: a script of ``benchmarks/`` imported as a module (to call its ``main``)."""

    def load(name: str) -> ModuleType:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise FileNotFoundError(path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
