"""Shared fixtures of the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps process-wide singletons (AcceleratorState, GradientState): reset them around each test."""
    try:
        from accelerate.state import AcceleratorState, GradientState
    except ImportError:
        yield
        return
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
