"""Memory measurement for the benchmark: peak during a training step, and model-state bytes.

On CUDA the caching allocator's own counters give the peak (``max_memory_allocated``). A CPU
has no such counter (and RSS is useless for per-step peaks: the allocator reuses memory), so
:class:`LiveTensorTracker` counts the bytes of live tensor storages created by ATen operators
inside a region: a ``TorchDispatchMode`` records each fresh output storage once and forgets it
when its storage is freed. Outputs that alias an input (views, in-place results) are not new
memory and are skipped. It cannot see workspaces that a kernel allocates and frees inside one
operator (oneDNN's BF16 matmul temporaries, for instance), which is what a GPU's activation
memory also excludes from the tensors a model keeps.

Both report the same quantity: the bytes held before the step by this run (parameters,
buffers, masters, optimizer state) plus the largest growth during the step.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .._master_grad import is_view
from .._tree import tree_leaves

__all__ = ["LiveTensorTracker", "StepMemory", "measure_step_memory", "model_state_bytes", "state_tensors"]


class LiveTensorTracker(TorchDispatchMode):
    """Count the bytes of live tensor storages that operators create inside the region.

    Attributes:
        current: Bytes of tracked storages alive now.
        peak: The largest ``current`` seen.

    Example:
        >>> with LiveTensorTracker() as t:
        ...     x = torch.ones(256)          # 1 KiB
        ...     y = x * 2                    # another 1 KiB
        ...     del x
        >>> t.peak, t.current
        (2048, 1024)
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}  # id(storage) -> nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {id(s) for s in _storages(args)} | {id(s) for s in _storages(kwargs.values())}
        for st in _storages(out if isinstance(out, (list, tuple)) else (out,)):
            key = id(st)
            if key in inputs or key in self._live:
                continue
            n = st.nbytes()
            if n == 0:
                continue
            self._live[key] = n
            self.current += n
            self.peak = max(self.peak, self.current)
            weakref.finalize(st, self._free, key)
        return out

    def _free(self, key: int) -> None:
        n = self._live.pop(key, 0)
        self.current -= n


def _storages(values: Iterable[Any]) -> Iterator[torch.UntypedStorage]:
    # aten arguments under __torch_dispatch__ (tensors and tensor lists, never user containers): not _tree, on the hot path
    for v in values:
        if isinstance(v, torch.Tensor):
            # A master-gradient view has no storage of its own (its master's gradient is counted).
            if v.device.type != "meta" and not is_view(v):
                yield v.untyped_storage()
        elif isinstance(v, (list, tuple)):
            yield from _storages(v)


def state_tensors(model: nn.Module, optimizer: Any = None) -> list[torch.Tensor]:
    """Every tensor a training run keeps between steps: parameters, their gradients, buffers,
    optimizer state, and master weights (for wrappers such as ``MasterWeightOptimizer`` that
    keep them outside ``optimizer.state``)."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out.append(p)
        if p.grad is not None and not is_view(p.grad):  # a view has no storage: its master's grad is counted
            out.append(p.grad)
    out.extend(model.buffers())
    seen_opts: set[int] = set()

    def visit_opt(opt: Any) -> None:
        if opt is None or id(opt) in seen_opts:
            return
        seen_opts.add(id(opt))
        for group in getattr(opt, "param_groups", []):
            for p in group.get("params", []):
                if isinstance(p, torch.Tensor):
                    out.append(p)
                    if p.grad is not None and not is_view(p.grad):
                        out.append(p.grad)
        state = getattr(opt, "state", {})
        values = state.values() if hasattr(state, "values") else []
        for s in values:
            out.extend(tree_leaves(s))
        for attr in ("_masters", "_rems"):  # the tensors themselves ("masters" may join remainder-stored ones anew)
            m = getattr(opt, attr, None)
            if isinstance(m, (list, tuple)):
                for t in m:
                    if isinstance(t, torch.Tensor):
                        out.append(t)
                        if t.grad is not None:
                            out.append(t.grad)
        inner = getattr(opt, "optimizer", None)
        if inner is not None and inner is not opt:
            visit_opt(inner)

    visit_opt(optimizer)
    return out


def model_state_bytes(model: nn.Module, optimizer: Any = None) -> int:
    """Bytes of the run's persistent state, each storage counted once (tied weights, a master
    that *is* an FP32 parameter)."""
    seen: dict[tuple[str, int], int] = {}
    for t in state_tensors(model, optimizer):
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        if st.data_ptr() == 0:
            continue
        seen[key] = max(seen.get(key, 0), st.nbytes())
    return sum(seen.values())


def parameter_count(model: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


class StepMemory:
    """Result of :func:`measure_step_memory`: ``peak_bytes`` = ``before_bytes`` + ``growth_bytes``."""

    def __init__(self, before_bytes: int, growth_bytes: int, method: str) -> None:
        self.before_bytes = before_bytes
        self.growth_bytes = growth_bytes
        self.method = method

    @property
    def peak_bytes(self) -> int:
        return self.before_bytes + self.growth_bytes


@contextlib.contextmanager
def measure_step_memory(device: torch.device, before_bytes: int) -> Iterator[list[StepMemory]]:
    """Measure the growth of memory during the region; yields a list that receives the result.

    Args:
        device: Where the step runs: CUDA uses the allocator's peak counter, anything else the
            live-tensor tracker.
        before_bytes: The run's persistent bytes at the start (from :func:`model_state_bytes`).
    """
    box: list[StepMemory] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield box
        torch.cuda.synchronize(device)
        growth = max(0, torch.cuda.max_memory_allocated(device) - start)
        box.append(StepMemory(before_bytes, growth, "CUDA caching allocator (max_memory_allocated)"))
    else:
        tracker = LiveTensorTracker()
        with tracker:
            yield box
        box.append(StepMemory(before_bytes, tracker.peak, "live-tensor tracker (excludes intra-op workspaces)"))
