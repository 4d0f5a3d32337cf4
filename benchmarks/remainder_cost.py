#!/usr/bin/env python
"""The cost of splitting FP32 masters into BF16 + int16 remainders and joining them back (issue 29).

    python benchmarks/remainder_cost.py                 # 4M elements, eager and compiled (Inductor)
    python benchmarks/remainder_cost.py --numel 1048576 --no-compile

Prints, for one buffer of randn * 0.02 weights: the milliseconds of ``split_into_`` and
``join_into_`` (``mixprec._remainder``) eager and under ``torch.compile``, each as a ratio to one
f32 -> bf16 ``copy_`` of the same buffer measured in the same run (the cast a master step already
does), the compile seconds, whether compiled and eager agree bit for bit, and the share of exact
ties (the only values whose BF16 half differs from ``.to(torch.bfloat16)``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

try:
    import mixprec  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from mixprec._remainder import join_into_, split, split_into_


def _ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-compile", action="store_true", help="eager only (no Inductor compile)")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    master = torch.randn(a.numel) * 0.02
    weight = torch.empty(a.numel, dtype=torch.bfloat16)
    rem = torch.empty(a.numel, dtype=torch.int16)
    out = torch.empty(a.numel)
    cast = _ms(lambda: weight.copy_(master), a.repeats)
    print(f"{a.numel} elements, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"f32->bf16 copy_        {cast:8.3f} ms  1.00x")
    rows = [("split_into_", lambda: split_into_(master, weight, rem)), ("join_into_", lambda: join_into_(out, weight, rem))]
    for name, fn in rows:
        ms = _ms(fn, a.repeats)
        print(f"{name + ' eager':22} {ms:8.3f} ms  {ms / cast:.2f}x")
    if not a.no_compile:
        t0 = time.perf_counter()
        cs = torch.compile(split_into_, fullgraph=True)
        cj = torch.compile(join_into_, fullgraph=True)
        cs(master, weight, rem)
        cj(out, weight, rem)
        print(f"compile                {time.perf_counter() - t0:8.1f} s")
        for name, fn in [("split_into_", lambda: cs(master, weight, rem)), ("join_into_", lambda: cj(out, weight, rem))]:
            ms = _ms(fn, a.repeats)
            print(f"{name + ' compiled':22} {ms:8.3f} ms  {ms / cast:.2f}x")
        hi, lo = split(master)
        same = torch.equal(weight.view(torch.int16), hi.view(torch.int16)) and torch.equal(rem, lo)
        print(f"compiled == eager      {same}; joined == master {torch.equal(out, master)}")
    ties = ((master.view(torch.int32) & 0xFFFF) == 0x8000).float().mean().item()
    differ = (split(master)[0].view(torch.int16) != master.to(torch.bfloat16).view(torch.int16)).float().mean().item()
    print(f"exact ties {ties:.2e}; BF16 half differs from .to(bfloat16) for {differ:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
