"""Shared pieces of the two-process tests: a tiny model, the data, one training loop, the spawner.

Every scenario trains the same tiny MLP (with a LayerNorm, an FP32 island) for ``STEPS`` steps
on a global batch of ``GLOBAL`` rows. Under DDP/FSDP2 rank ``r`` takes its slice of every
(micro-)batch; the single-process reference takes the whole global batch, so both compute the
same mean gradient. At ``POISON_STEP`` one gradient is set to inf after backward (on rank 1
only in the distributed run): every rank must skip that step.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

WORLD = 2
STEPS = 4
GLOBAL = 8
POISON_STEP = 2
POISON_RANK = 1
TIMEOUT_S = 150.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))


def make_prec(policy: str, **kwargs: Any) -> Any:
    """MixedPrecision for ``policy``; FP16 starts at scale 2**8 so only the poisoned step overflows."""
    from mixprec import DynamicScaler, MixedPrecision, Policy

    if Policy.parse(policy).loss_scale == "dynamic":
        kwargs.setdefault("scaler", DynamicScaler(init_scale=2.0**8))
    return MixedPrecision(policy, **kwargs)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL, 6, generator=g), torch.randn(GLOBAL, 3, generator=g)


def rows(step: int, micro: int, accum: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of micro-batch ``micro`` of ``step`` that ``rank`` of ``world`` processes (world=1: all of them)."""
    x, y = batch(step)
    per_micro = GLOBAL // accum
    per_rank = per_micro // world
    lo = micro * per_micro + rank * per_rank
    return x[lo:lo + per_rank], y[lo:lo + per_rank]


def poison_(prec: Any, opt: Any) -> None:
    """Set one gradient that ``prec.step(opt)`` will read to inf (this rank only)."""
    from mixprec._master import MasterWeightOptimizer
    from mixprec.distributed import local_grad

    if isinstance(opt, MasterWeightOptimizer):
        p, m = next((p, m) for p, m in zip(opt.model_params, opt.masters) if p is not m)
        g = local_grad(m.grad if m.grad is not None else p.grad)  # an FSDP2 shard's (bf16-master-r16): the local part
    else:
        g = local_grad(next(p for p in opt.param_groups[0]["params"] if p.grad is not None).grad)
    g.view(-1)[0] = float("inf")


def train(
    prec: Any,
    model: nn.Module,
    opt: Any,
    *,
    rank: int,
    world: int,
    accum: int = 1,
    poison: bool = True,
    no_sync: Callable[[], Any] | None = None,
    clear: Callable[[nn.Module, Any], None] | None = None,
) -> dict[str, Any]:
    """Run STEPS steps; return the skip flags and the scales seen.

    ``clear(model, opt)`` clears the gradients after each step (default ``opt.zero_grad()``).
    """
    import contextlib

    skipped, scales = [], []
    for step in range(STEPS):
        for micro in range(accum):
            x, y = rows(step, micro, accum, rank, world)
            ctx = no_sync() if (no_sync is not None and micro < accum - 1) else contextlib.nullcontext()
            with ctx:
                with prec.autocast():
                    out = model(x)
                loss = nn.functional.mse_loss(out.float(), y) / accum
                prec.backward(loss)
        if poison and step == POISON_STEP and (world == 1 or rank == POISON_RANK):
            poison_(prec, opt)
        info = prec.step(opt)
        skipped.append(bool(info.skipped.item()))
        scales.append(float(info.scale.item()))
        if clear is not None:
            clear(model, opt)
        else:
            opt.zero_grad(set_to_none=True)
    return {"skipped": skipped, "scales": scales}


def fp32_params(prec: Any, model: nn.Module) -> dict[str, list[float]]:
    """The FP32 weights (masters where there are masters), gathered when sharded."""
    from mixprec.checkpoint import fp32_state_dict

    out = {}
    for k, v in fp32_state_dict(prec).items():
        full = getattr(v, "full_tensor", None)
        v = full() if callable(full) else v
        out[k.replace("module.", "")] = v.float().reshape(-1).tolist()
    return out


def spawn(worker: Callable[..., None], out_dir: Path, *args: Any) -> list[dict[str, Any]]:
    """Run ``worker(rank, port, out_dir, *args)`` in two processes, bounded in time; return each rank's JSON."""
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = mp.start_processes(worker, args=(free_port(), str(out_dir), *args), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"the two-process run did not finish in {TIMEOUT_S} s")
    except mp.ProcessExitedException as e:
        # gloo's threads can still abort a worker at interpreter exit, after finish() ("terminate called
        # without an active exception", SIGABRT) on a loaded machine. Every rank writes its JSON only after
        # all its scenarios ran: when all are there and complete, the run is whole; otherwise it failed.
        try:
            results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
        except (OSError, ValueError):
            raise e from None
        if e.signal_name != "SIGABRT":
            raise
        return results
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


def init(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)


def finish() -> None:
    """Tear the process group down at the end of a worker (after its JSON is written).

    Without it gloo's threads can abort the process at interpreter exit ("terminate called
    without an active exception", SIGABRT), which fails the spawn although every scenario ran.
    """
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def max_diff(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(max(abs(x - y) for x, y in zip(a[k], b[k])) for k in a)
