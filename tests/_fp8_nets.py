"""The small model the FP8 tests share (tests/test_fp8.py, tests/numerics/test_fp8*.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    """Two FP8-eligible linears around a LayerNorm island, then a head of ``head`` outputs.

    ``head=10`` makes the head ineligible for FP8 (not a multiple of 16); ``head=16`` keeps it eligible.
    """

    def __init__(self, head: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.ln = nn.LayerNorm(64)
        self.hidden = nn.Linear(64, 64)
        self.head = nn.Linear(64, head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.hidden(F.gelu(self.ln(self.inp(x))))))
