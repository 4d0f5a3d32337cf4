#!/usr/bin/env python
"""Host time per tile call of the fused compensated step, direct against packed tiles (issue 27, item 3).

    python benchmarks/tile_host_cost.py                  # 48 tiles of 4096 elements, packed 4 and 16 tensors per tile
    python benchmarks/tile_host_cost.py --segments 4,16,64 --device cuda
    python benchmarks/tile_host_cost.py --device cuda --copies both   # packed rows with each gather/scatter route

The tiles are small (``--tile`` elements), so the arithmetic is negligible and what is left is
the host path of a tile: the call of the compiled graph, and for a packed tile the gather of its
parameters and gradients, the scatter of its parameters and, where its states do not live in the
tile (``_fused_step.FusedStep._home_states``), theirs. Rows: every tile *direct* (tensors of
exactly ``--tile`` elements, stepped in place) and every tile *packed* from N whole tensors of
``tile / N`` elements. Printed per row: the median step over ``--steps`` steps and that divided by
the tiles. The H200 runs of 2026-11-27 put a packed tile of GPT-2's step at ~0.9 ms and a direct
one at ~0.1 ms (docs/optim.md); this isolates the same cost on any machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

try:
    import mixprec  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch


def measure(n_tensors: int, numel: int, tile: int, device: torch.device, steps: int,
            one_op: bool | None = None) -> tuple[int, int, float]:
    """``(tiles, packed tiles, median step seconds)`` of a fused Kahan AdamW step over ``n_tensors`` of ``numel`` elements.

    ``one_op``: gather and scatter packed tiles with ``_chunk_cat``/``cat`` and ``split_with_sizes_copy``
    (True) or with ``_foreach_copy_`` through the bucket's two shared buffers (False,
    ``_fused_step._Copies``); None: the device's default (``mixprec.optim._parts._ONE_OP_COPY_DEVICES``).
    """
    import mixprec.optim as mo
    from mixprec.optim import _fused_step, _parts

    attr = "_CPU_FUSED_TILE" if device.type == "cpu" else "_GPU_FUSED_TILE"
    old = getattr(_fused_step, attr)
    old_devices = _parts._ONE_OP_COPY_DEVICES
    setattr(_fused_step, attr, tile)
    if one_op is not None:
        devices = old_devices | {device.type} if one_op else old_devices - {device.type}
        _parts._ONE_OP_COPY_DEVICES = frozenset(devices)
    try:
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(numel, generator=g).to(device, torch.bfloat16)) for _ in range(n_tensors)]
        opt = mo.AdamW(params, lr=1e-4, fused=True)
        found_inf = torch.zeros((), device=device)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device, torch.bfloat16) * 1e-3
        for _ in range(3):
            opt.step(found_inf=found_inf)
        layout = opt._plan_cache[0][1][0].fused
        times = []
        for _ in range(steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step(found_inf=found_inf)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        times.sort()
        return len(layout.tiles), sum(1 for d in layout.direct if not d), times[len(times) // 2]
    finally:
        setattr(_fused_step, attr, old)
        _parts._ONE_OP_COPY_DEVICES = old_devices


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tile", type=int, default=4096, help="elements per tile (default 4096)")
    ap.add_argument("--tiles", type=int, default=48, help="tiles per step (default 48)")
    ap.add_argument("--segments", default="4,16", help="tensors per packed tile, one row each (default 4,16)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per row (default 30)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--copies", choices=("auto", "one-op", "foreach", "both"), default="auto",
                    help="a packed tile's gather and scatter: the device's default (auto), _chunk_cat/cat + "
                         "split_with_sizes_copy (one-op, a CPU's), _foreach_copy_ through two shared buffers "
                         "(foreach, a GPU's), or each packed row both ways (both)")
    args = ap.parse_args(argv)
    from mixprec.bench._timing import device_or_exit

    device = device_or_exit(args.device)
    torch.set_num_threads(1)
    print(f"tile_host_cost: torch {torch.__version__}, {device}, 1 thread; {args.tiles} tiles of {args.tile} elements, "
          "fused Kahan AdamW (BF16 weights, FP32 states), median step")
    print(f"{'row':16s} {'tiles':>5s} {'packed':>6s} {'step ms':>8s} {'us/tile':>8s}")
    routes: list[tuple[str, bool | None]] = {"auto": [("", None)], "one-op": [("/one-op", True)],
                                             "foreach": [("/foreach", False)],
                                             "both": [("/one-op", True), ("/foreach", False)]}[args.copies]
    rows = [("direct", args.tiles, args.tile, None)] + [
        (f"packed{n}{suffix}", args.tiles * n, args.tile // n, one_op)
        for n in (int(s) for s in args.segments.split(",")) for suffix, one_op in routes]
    for name, n_tensors, numel, one_op in rows:
        tiles, packed, sec = measure(n_tensors, numel, args.tile, device, args.steps, one_op)
        print(f"{name:16s} {tiles:5d} {packed:6d} {sec * 1e3:8.2f} {sec * 1e6 / tiles:8.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
