"""The fused (compiled) step of a torch ``AdamW``/``Adam``/``SGD``, and when it runs.

``mixprec.optim``'s optimizers can run their update as one ``torch.compile``d kernel per
bucket (``optim/_fused_step.py``). :class:`FusedShadow` lends that step to a plain torch optimizer: a
``mixprec.optim`` optimizer (``compensation="none"``, FP32 arithmetic) bound to the torch
optimizer's own ``param_groups`` and ``state``, so LR schedulers, checkpoints and an eager step
all see one state. ``MasterWeightOptimizer`` steps its masters with it; ``MixedPrecision``
steps the optimizers of policies without masters with it (``bf16-mixed``) when ``fused=True``:
the update and the skip on ``found_inf`` then run in one kernel with no host sync (the gradients
were unscaled and checked before, in ``prec.unscale_``).

When (``fused=None``): only where :attr:`FusedShadow.prefer` is set (``MasterWeightOptimizer.prefer_fused``,
which ``MixedPrecision`` leaves off), on any device. A plain policy's optimizer keeps torch's own fused
kernel (it skips on the device too, is as fast and compiles nothing); the master step keeps the
wrapped optimizer's step plus mixprec's foreach edit check and copy-back, which on a GPU is the
faster of the two (GPT-2 124M on an H200: the compiled master step made ``bf16-master`` 1.47-1.79x
torch.amp's step, host-bound at ~0.4 ms per tile call; docs/optim.md). :func:`runs_compiled`
(has the model's backward passed through a region ``torch.compile`` compiled with Inductor?)
turns on only the compensated ``mixprec.optim`` step on a CPU; measurements in docs/optim.md.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["FUSABLE", "FusedShadow", "fusable_plain", "runs_compiled"]

#: torch optimizers whose update ``mixprec.optim`` implements (the same arithmetic in FP32).
FUSABLE = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
#: Autograd nodes walked at most when looking for a compiled region (a large eager graph stops early).
_WALK_LIMIT = 50_000


def fusable_plain(optimizer: Optimizer) -> bool:
    """Whether a plain policy's torch optimizer gets a fused step: exactly AdamW/Adam/SGD, and not torch's own fused kernel."""
    return type(optimizer) in FUSABLE and not any(g.get("fused") for g in optimizer.param_groups)


def runs_compiled(loss: Tensor) -> bool:
    """Whether ``loss``'s autograd graph passes through a region ``torch.compile`` compiled with Inductor.

    Algorithm: a depth-first walk over ``grad_fn.next_functions`` looking for AOTAutograd's
    backward node (``CompiledFunctionBackward``), which every compiled forward that needs a
    gradient leaves in the graph, whichever order ``torch.compile`` and ``prepare`` ran in; the
    region counts when its forward is Inductor's output (``torch._inductor``), so the debugging
    backends (``aot_eager``, ``eager``) keep the eager optimizer step. Host work only (no
    kernels); at most ``_WALK_LIMIT`` nodes. ``False`` if torch's internals change shape.
    """
    root = loss.grad_fn
    if root is None:
        return False
    stack: list[Any] = [root]
    seen: set[int] = set()
    while stack and len(seen) < _WALK_LIMIT:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__.startswith("CompiledFunction") and _inductor_region(node):
            return True
        stack.extend(f for f, _ in node.next_functions)
    return False


def _inductor_region(node: Any) -> bool:
    """Whether an AOTAutograd backward node's forward was compiled by Inductor (private torch attributes)."""
    fw = getattr(getattr(type(node), "_forward_cls", None), "compiled_fw", None)
    return type(fw).__module__.startswith("torch._inductor")


class FusedShadow:
    """Runs a torch ``AdamW``/``Adam``/``SGD`` step as ``mixprec.optim``'s compiled step, on that optimizer's state.

    Args:
        optimizer: The torch optimizer (exactly ``torch.optim.AdamW``, ``Adam`` or ``SGD``).
        fused: ``True``: always (a compile error raises); ``None``: where it pays off (see the
            module docstring; :attr:`prefer` turns it on for every device).
        mirrors: ``id(tensor in optimizer) -> tensor`` that receives each committed value in its
            own dtype (the model's half weight of an FP32 master), written in the same kernel.
        remainders: ``id(tensor in optimizer) -> int16 remainder`` of remainder-stored masters
            (``bf16-master-r16``): such a tensor is a placeholder, its value is joined from its mirror
            and remainder, and the step writes the split of the new value into both.

    :meth:`view` returns the ``mixprec.optim`` optimizer to step, or ``None`` where the torch
    optimizer's own step must run: fused off for a device, or a torch option mixprec does not
    implement (``differentiable``). :meth:`step` steps a view and runs the torch optimizer's step
    hooks around it, as torch's ``step`` would.
    It rebinds itself when ``load_state_dict`` replaced the torch optimizer's ``state`` or
    ``param_groups`` objects (a view bound to the old ones would step stale moments).
    """

    def __init__(self, optimizer: Optimizer, fused: bool | None, mirrors: dict[int, Tensor] | None = None, *,
                 remainders: dict[int, Tensor] | None = None) -> None:
        self.optimizer = optimizer
        self.fused = fused
        self.mirrors: dict[int, Tensor] = dict(mirrors or {})
        self.remainders: dict[int, Tensor] = dict(remainders or {})
        self._prefer = False
        #: ``True`` once :meth:`view` found the torch optimizer's own step must run, for a reason that
        #: lasts until :attr:`prefer` changes: callers on the step path read it instead of calling view().
        self.off = False
        self._view: Any = None
        self._devices: set[torch.device] = set()
        self._compile_seconds = 0.0  # of views replaced by a rebind
        self._unsupported = False
        self._steps_on_device = False  # the state's step counters checked since the last torch step or rebind

    @property
    def prefer(self) -> bool:
        """``fused=None`` then turns on on any device (``MasterWeightOptimizer.prefer_fused`` sets it)."""
        return self._prefer

    @prefer.setter
    def prefer(self, value: bool) -> None:
        self._prefer = bool(value)
        self.off = False  # decided again at the next view()

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling fused steps so far (0.0 when none ran)."""
        return self._compile_seconds + (float(self._view.compile_seconds) if self._view is not None else 0.0)

    def view(self) -> Any:
        """The ``mixprec.optim`` optimizer to step now, or ``None`` (step the torch optimizer itself)."""
        opt = self.optimizer
        if self.fused is False or self._unsupported or (self.fused is None and not self._prefer):
            self._steps_on_device = False  # torch's own step runs: it may create CPU step counters
            self.off = True
            return None  # the last: a plain policy's eager model, the usual case, decided without a lookup
        view = self._view
        if view is not None and (view.state is not opt.state or view.param_groups is not opt.param_groups):
            self._compile_seconds += float(view.compile_seconds)
            view = self._view = None
        if view is None:
            from .optim import from_torch
            from .optim._convert import _HOOK_DICTS

            try:
                view = from_torch(opt, compensation="none", fused=self.fused)
            except ValueError:
                if self.fused:
                    raise
                self._unsupported = True  # e.g. differentiable=True: torch's step, always
                self.off = True
                return None
            view.state = opt.state  # shared: torch's AdamW/Adam/SGD state keys are mixprec's
            for name in _HOOK_DICTS:  # from_torch shares opt's hooks; step() runs them around the view, with opt
                setattr(view, name, OrderedDict())
            view.mirrors = self.mirrors
            view.remainders = self.remainders
            self._view = view
            self._devices = {p.device for g in opt.param_groups for p in g["params"]}
            self._steps_on_device = False
        view.prefer_fused = self._prefer
        devices = self._devices
        if not all(view.fused_enabled(d) for d in devices):
            self._steps_on_device = False
            self.off = True
            return None
        if not self._steps_on_device and any(d.type != "cpu" for d in devices):
            # Only torch's own step (or its load_state_dict, which rebinds) makes such counters:
            # checked once after either, not every step.
            for g in opt.param_groups:
                for p in g["params"]:  # torch keeps CUDA steps on the CPU unless capturable; the fused step reads them on the device
                    st = opt.state.get(p)
                    if st and isinstance(st.get("step"), Tensor) and st["step"].device != p.device:
                        st["step"] = st["step"].to(p.device)
        self._steps_on_device = True
        return view

    def step(self, view: Any, args: tuple[Any, ...], grad_scale: Tensor | None, found_inf: Tensor | None) -> Any:
        """``view.step(*args, grad_scale=..., found_inf=...)`` with the torch optimizer's step hooks around it.

        The hooks (torch's global ones, then the optimizer's) see the torch optimizer and the
        step's ``args`` exactly as around its own ``step``; a pre-hook may replace the arguments.
        """
        from torch.optim import optimizer as torch_optimizer

        opt = self.optimizer
        pre = [*torch_optimizer._global_optimizer_pre_hooks.values(), *opt._optimizer_step_pre_hooks.values()]
        kwargs: dict[str, Any] = {}
        for hook in pre:
            result = hook(opt, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"{hook} must return None or a tuple of (new_args, new_kwargs), but got {result}.")
                args, kwargs = result
        # Below torch's step wrapper of the view: its hooks (the global ones, again) ran above, with ``opt``; what
        # else that wrapper does is done here for ``opt``: the profiler's step range and its optimizer marker frame.
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(opt).__name__}.step"):
            out = view._step_unhooked(*args, **kwargs, grad_scale=grad_scale, found_inf=found_inf)
            torch_optimizer.Optimizer._optimizer_step_code(opt)
        opt._opt_called = True  # type: ignore[attr-defined]  # torch's mark that step ran (LR schedulers check it)
        for hook in [*opt._optimizer_step_post_hooks.values(), *torch_optimizer._global_optimizer_post_hooks.values()]:
            hook(opt, args, kwargs)
        return out
