"""CPU proxies of what a training step costs on a GPU: host reads, aten ops and Python calls per step.

On a GPU every dispatched aten op is at least one kernel launch, every read of a device tensor
(``aten._local_scalar_dense``, ``aten.is_nonzero``) is a host sync, and every Python call is host
time the GPU may wait on. All three can be counted on a CPU, deterministically, for mixprec's
loop and for the ``torch.amp`` recipe on the same model (ARCHITECTURE.md, "Step or skip"):

* :class:`StepCounter`: a ``TorchDispatchMode`` that counts ops by name and the host reads,
  leaving out the reads of torch optimizers' own CPU ``step`` counters (torch keeps them on the
  CPU unless ``capturable``: reading them is no GPU sync).
* :func:`python_calls`: Python function calls (``sys.setprofile`` ``"call"`` events) made by a
  callable.
* :func:`measure_recipes`: both counts per step for mixprec's loop and the torch.amp recipe
  (``benchmarks/step_proxies.py`` prints them; ``tests/bench/test_step_cost.py`` asserts the goals).
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_READS", "StepCost", "StepCounter", "files_on_path", "make_recipe", "measure_recipe", "python_calls"]

#: The aten ops that read a tensor's value on the host (a device sync on a GPU).
HOST_READS = ("_local_scalar_dense", "is_nonzero")


class StepCounter(TorchDispatchMode):
    """Count dispatched aten ops by name, and host reads except those of optimizers' CPU ``step`` counters.

    Args:
        optimizers: torch optimizers whose ``state[p]["step"]`` tensors are exempt (looked up at
            each read, so state created during the count is covered).

    Attributes:
        ops: ``Counter`` of op names (a foreach op counts once, whatever the number of tensors).
        host_reads: reads of tensor values on the host, step counters left out.
    """

    def __init__(self, optimizers: tuple[Any, ...] = ()) -> None:
        super().__init__()
        self.optimizers = optimizers
        self.ops: collections.Counter[str] = collections.Counter()
        self.host_reads = 0

    def _is_step_counter(self, t: Any) -> bool:
        for opt in self.optimizers:
            inner = getattr(opt, "optimizer", opt)  # a MasterWeightOptimizer's wrapped optimizer holds the state
            for st in inner.state.values():
                if isinstance(st, dict) and st.get("step") is t:
                    return True
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in HOST_READS and not (args and self._is_step_counter(args[0])):
            self.host_reads += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """All ops counted."""
        return sum(self.ops.values())


def _profiled(fn: Callable[[], Any], on_call: Callable[[Any], None]) -> None:
    """Run ``fn()`` with ``on_call(frame)`` called for every Python function call it makes (``sys.setprofile``)."""

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            on_call(frame)

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(old)


def python_calls(fn: Callable[[], Any]) -> int:
    """The number of Python function calls ``fn()`` makes (``sys.setprofile`` ``"call"`` events, ``fn`` included)."""
    frames: list[None] = []
    _profiled(fn, lambda frame: frames.append(None))
    return len(frames)


def files_on_path(fn: Callable[[], Any], package: str = "mixprec") -> list[str]:
    """The source files of ``package`` whose functions ``fn()`` calls, in first-call order (``"_stepping.py"``, ...)."""
    marker = f"/{package}/"
    seen: dict[str, None] = {}

    def on_call(frame: Any) -> None:
        name = frame.f_code.co_filename
        i = name.rfind(marker)
        if i >= 0:
            seen.setdefault(name[i + len(marker):], None)

    _profiled(fn, on_call)
    return list(seen)


class StepCost(collections.namedtuple("StepCost", "ops host_reads python_calls op_names")):
    """Per-step averages: aten ops, host reads, Python calls; ``op_names`` counts by name over the measured steps."""


def gpt_model(n_layer: int, width: int = 32, vocab: int = 64, block: int = 16) -> nn.Module:
    """The GPT-shaped model the proxies are measured on (``bench``'s ``CharGPT``; 12 tensors a block)."""
    from ._workloads import CharGPT

    torch.manual_seed(0)
    return CharGPT(vocab, block, n_layer, 2, width)


def make_recipe(
    recipe: str, n_layer: int, *, fused: bool = False, foreach: bool | None = None, direct: bool = False,
    model: nn.Module | None = None, device: torch.device | str = "cpu", optimizer: str = "adamw",
    fused_step: bool | None = None, clip: float | None = None,
) -> tuple[Callable[[], None], tuple[Any, ...]]:
    """One training iteration, as a callable, for a preset or a torch.amp recipe; and its optimizers.

    Args:
        recipe: a mixprec preset (``"bf16-mixed"``, ``"fp16-master"``, ...) or ``"amp-bf16"`` /
            ``"amp-fp16"``: the torch.amp recipe (``torch.autocast``; FP16 adds
            ``torch.amp.GradScaler``: ``scale(loss).backward(); step(opt); update()``).
        n_layer: blocks of the GPT-shaped model (:func:`gpt_model`).
        fused, foreach: passed to the torch optimizer.
        direct: mixprec only: ``optimizer.step()`` instead of ``prec.step(optimizer)``.
        model: the model to use instead of a fresh :func:`gpt_model`.
        device: where the model and batches live.
        optimizer: ``"adamw"``, ``"adam"`` or ``"sgd"`` (momentum 0.9).
        fused_step: ``MixedPrecision(fused=...)``: the compiled optimizer step on, off or where it pays off.
        clip: clip the gradients to this norm every iteration (see :func:`recipe_step`).

    Returns:
        ``(iteration, optimizers)``: ``iteration()`` runs forward, backward, step and ``zero_grad``.
    """
    device = torch.device(device)
    net = (model if model is not None else gpt_model(n_layer)).to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (4, 16), generator=gen).to(device)
    y = torch.randint(0, 64, (4, 16), generator=gen).to(device)
    options: dict[str, Any] = dict(lr=1e-3, fused=fused or None, foreach=foreach)
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(net.parameters(), momentum=0.9, **options)
    elif optimizer == "adam":
        opt = torch.optim.Adam(net.parameters(), eps=1e-4, **options)
    else:
        opt = torch.optim.AdamW(net.parameters(), eps=1e-4, **options)  # eps an FP16 number: fp16-pure too

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]).float().flatten(0, 1), batch[1].flatten())

    step, optimizers = recipe_step(recipe, net, opt, loss_fn, device, direct=direct, fused_step=fused_step, clip=clip)
    return (lambda: step((x, y))), optimizers


def recipe_step(
    recipe: str, model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    device: torch.device | str, *, direct: bool = False, fused_step: bool | None = None,
    compile_backend: str | None = None, clip: float | None = None, weight_edits: str = "values",
) -> tuple[Callable[[Any], None], tuple[Any, ...]]:
    """``step(batch)``: one training iteration of ``model`` under a preset or a torch.amp recipe (see :func:`make_recipe`).

    Args:
        recipe, direct, fused_step: As :func:`make_recipe`.
        model, opt: FP32 model on ``device`` and its torch optimizer (a preset prepares both).
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        compile_backend: ``torch.compile`` the model (after ``prepare``) with this backend.
        clip: clip the gradients to this norm before the step: torch.amp's recipe with
            ``scaler.unscale_(opt)`` (FP16) and ``torch.nn.utils.clip_grad_norm_``, a preset with
            ``prec.clip_grad_norm_`` (as ``mixprec compare`` clips).
        weight_edits: ``MixedPrecision(weight_edits=...)`` (master-weight presets read it).

    Returns:
        ``(step, optimizers)``.
    """
    import mixprec

    device_type = torch.device(device).type
    if recipe.startswith("amp-"):
        dtype = torch.float16 if recipe == "amp-fp16" else torch.bfloat16
        scaler = torch.amp.GradScaler(device_type) if dtype == torch.float16 else None
        net: Any = torch.compile(model, backend=compile_backend) if compile_backend else model

        def amp_step(batch: Any) -> None:
            with torch.autocast(device_type, dtype=dtype):
                loss = loss_fn(net, batch)
            if scaler is None:
                loss.backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
            else:
                scaler.scale(loss).backward()
                if clip:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                scaler.step(opt)
                scaler.update()
            opt.zero_grad(set_to_none=True)

        return amp_step, (opt,)

    prec = mixprec.MixedPrecision(recipe, fused=fused_step, weight_edits=weight_edits)  # type: ignore[arg-type]
    model, popt = prec.prepare(model, opt)
    compiled: Any = torch.compile(model, backend=compile_backend) if compile_backend else model

    def step(batch: Any) -> None:
        with prec.autocast():
            loss = loss_fn(compiled, batch)
        prec.backward(loss)
        if clip:
            prec.clip_grad_norm_(clip)
        if direct:
            popt.step()
        else:
            prec.step(popt)
        popt.zero_grad(set_to_none=True)

    return step, (popt,)


def measure_recipe(iteration: Callable[[], None], optimizers: tuple[Any, ...], *, warmup: int = 3,
                   steps: int = 3) -> StepCost:
    """Per-step ops, host reads and Python calls of ``iteration`` after ``warmup`` iterations."""
    for _ in range(warmup):
        iteration()
    counter = StepCounter(optimizers)
    with counter:
        for _ in range(steps):
            iteration()
    def run() -> None:
        for _ in range(steps):
            iteration()

    calls = python_calls(run)
    return StepCost(counter.total / steps, counter.host_reads / steps, calls / steps, counter.ops)
