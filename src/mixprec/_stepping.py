"""The one skip-or-step protocol: run an optimizer's step unless ``found_inf`` says skip.

Every path that steps an optimizer for mixprec (``MixedPrecision.step``,
``MasterWeightOptimizer.step``, ``GradScaler.step``, the guarded ``optimizer.step()`` of a
prepared optimizer) ends here, so the decision is made the same way everywhere: on the device
for optimizers that accept ``grad_scale``/``found_inf`` (``_step_supports_amp_scaling``),
with one named host read otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import os
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Literal
from typing import cast as typing_cast

import torch
from torch import Tensor

from ._dtypes import HALF
from ._finite import unscale_and_check_

_SHAPE = operator.attrgetter("shape")
_STRIDE = operator.methodcaller("stride")
_GRAD = operator.attrgetter("grad")
_CONTIGUOUS = operator.methodcaller("is_contiguous")
_LAYOUT = operator.attrgetter("layout")
_STRIDED = {torch.strided}


def _outside_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` for its caller's first frame outside mixprec and torch (the user's line)."""
    inside = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__))  # not torchvision
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def same_layout(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` (one shape) hold their elements in one memory order: equal strides on every
    dimension of more than one element (a size-1 dimension's stride is arbitrary: a 1x1 conv weight in
    ``channels_last`` is also contiguous)."""
    if a.stride() == b.stride() or a.numel() == 0:
        return True
    return all(s == t for n, s, t in zip(a.shape, a.stride(), b.stride()) if n > 1)


def dense_layout(t: Tensor) -> bool:
    """Whether ``t``'s elements fill its memory span with no gaps or overlaps (contiguous in some dimension order).

    A dense tensor's memory order is a permutation of its logical order (``channels_last``, a
    transposed matrix); elementwise kernels that walk memory (torch's fused optimizers, Triton
    kernels over pointer tables) pair its elements correctly with another tensor's of the same
    strides. A view of part of a larger tensor (``base[:, 3:9]``) or an expanded one is not dense.
    """
    if t.numel() == 0:
        return True
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda ss: ss[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True

__all__ = [
    "CPU_FUSED_SGD_HALF",
    "FUSED_TWINS",
    "AppliedSteps",
    "FusedTwin",
    "OptimizerRecord",
    "StepGuard",
    "StepInfo",
    "cpu_fused_sgd_skips",
    "fused_twin",
    "host_read_reason",
    "install_step_guard",
    "remove_step_guard",
    "step_or_skip",
    "step_with_result",
]


def step_with_result(optimizer: Any, found_inf: Tensor, grad_scale: Tensor | None, args: tuple[Any, ...],
                     kwargs: dict[str, Any], *, twin: bool = False) -> tuple[Tensor, Any]:
    """Step ``optimizer`` unless ``found_inf`` says skip (:func:`step_or_skip`); return ``(skipped, what step returned)``.

    ``skipped`` is a 0-d bool tensor on ``found_inf``'s device; the step's result is ``None`` when skipped.
    """
    flag, ret = step_or_skip(optimizer, found_inf, grad_scale, args, kwargs, twin=twin)
    return flag > 0, ret


#: torch optimizers whose ``fused=True`` kernel takes ``found_inf``/``grad_scale``: their foreach and
#: for-loop forms step through it (:class:`FusedTwin`), so the skip stays on the device.
FUSED_TWINS = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
# torch's CPU fused SGD (2.12, 2.13) leaves FP16/BF16 parameters of 16 or more elements unchanged (it updates only the
# tail after the last full SIMD block; pytorch/pytorch#191763): measured, every element of a 64-element half
# parameter unchanged after two steps, FP32 and the fused Adam/AdamW right.
CPU_FUSED_SGD_HALF = (
    "torch's fused SGD on a CPU leaves FP16/BF16 parameters of 16 or more elements unchanged (pytorch/pytorch#191763)"
)


def cpu_fused_sgd_skips(p: Tensor) -> bool:
    """Whether torch's fused SGD would leave ``p`` untrained (:data:`CPU_FUSED_SGD_HALF`): a half tensor on a CPU."""
    return p.device.type == "cpu" and p.dtype in HALF


def host_read_reason(optimizer: Any) -> str | None:
    """Why ``step_or_skip(..., twin=True)`` must read ``found_inf`` on the host for ``optimizer`` (``None``: it need not).

    Decided from the optimizer's class and options, as at ``prepare``: it skips on the device when
    it declares ``_step_supports_amp_scaling`` (torch's ``fused=True`` optimizers,
    ``mixprec.optim``, ``MasterWeightOptimizer``) or when :class:`FusedTwin` can step it.
    """
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    if type(optimizer) not in FUSED_TWINS:
        return (f"{type(optimizer).__module__}.{type(optimizer).__qualname__} cannot skip a step on the device (it takes "
                "no found_inf and has no fused form that does)")
    return FusedTwin.unsupported(optimizer)


class FusedTwin:
    """Steps a torch ``AdamW``/``Adam``/``SGD`` (foreach or for-loop) through its own ``fused=True`` kernel.

    torch's fused kernels take ``found_inf`` (and ``grad_scale``) and skip on the device; their
    foreach and for-loop forms cannot, so stepping them after an inf/NaN check needs a host read
    (``torch.amp.GradScaler`` does one per step). The fused kernel is the same update (torch's
    AdamW/Adam/SGD, FP32 arithmetic) computed in one pass: equal to the foreach step to rounding
    (a few ulp where multiply-adds are fused), not bit for bit. It is also fewer kernels.

    Algorithm (each step): set ``fused=True``/``foreach=False`` on every param group, set
    ``optimizer.found_inf``/``grad_scale`` (the attributes torch's ``step`` reads), call the
    optimizer's own ``step``, put the groups' options back. Before the first step, and after
    each ``load_state_dict``, the ``step`` counters move to their parameters' device (the fused
    kernel reads them there; torch keeps them on the CPU for the foreach form). SGD with
    momentum gets zero momentum buffers before its first step: torch's fused SGD leaves
    uninitialised buffers behind when its first step is skipped, and with ``dampening=0`` a
    zero buffer gives exactly the first step's ``buf = grad``.

    The optimizer's ``state_dict()`` keeps the options the user gave (the switch lasts for the
    step only). Torch's step hooks run as around any ``step``. An optimizer built with an explicit
    ``fused=False`` keeps its own step (and the host read; ``prepare`` says so on a GPU).

    Memory layouts: torch's fused kernels pair a parameter's elements with its gradient's and
    state's in memory order, ignoring strides (the foreach step does not). State tensors in
    another order than their parameter (a model moved to ``channels_last`` after its state was
    made, a checkpoint of another layout) are copied into the parameter's layout when the twin
    is made ready (the first step, a parameter's strides changed, ``load_state_dict``). Each step
    checks, on the host, that every parameter is dense (:func:`dense_layout`) and that its
    gradient is in its order (:func:`same_layout`; C-level passes while everything is
    contiguous); a step where that fails (a gradient from ``torch.autograd.grad`` in another
    layout, a parameter that views part of a larger tensor) runs the optimizer's own step after
    one host read, with a warning naming the tensor.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._ready = False  # step counters on the device, momentum buffers made
        self._groups = -1  # len(param_groups) when last made ready (add_param_group makes it unready)
        self._damped = False  # SGD with dampening != 0 whose momentum buffers do not exist yet
        self.sparse = False  # a step met sparse gradients (the fused SGD refuses them): host reads from then on
        # Every parameter and its shape when last made ready: torch's fused kernels do not check that a state
        # tensor matches its parameter (a parameter resized after its state exists corrupts memory there).
        self._params: list[Tensor] = []
        self._shapes: list[Any] = []
        self._strides: list[Any] = []  # every parameter's strides when last made ready
        self._contiguous = True  # every parameter contiguous then
        self._non_dense: list[Tensor] = []  # parameters that view part of a larger tensor (when last made ready)
        self._warned: set[str] = set()
        optimizer.register_load_state_dict_post_hook(_unready)

    @staticmethod
    def unsupported(optimizer: Any) -> str | None:
        """Why ``optimizer``'s fused kernel cannot step it (``None``: it can)."""
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        devices = _get_fused_kernels_supported_devices()
        name = type(optimizer).__name__
        is_sgd = isinstance(optimizer, torch.optim.SGD)
        for g in optimizer.param_groups:
            if g.get("differentiable"):
                return f"{name}(differentiable=True) has no fused form"
            if g.get("fused") is False:  # asked for by name: respected (foreach/for-loop, decided on the host)
                return f"{name}(fused=False) asks for its non-fused step"
            for p in g["params"]:
                if not p.is_floating_point() or p.device.type not in devices:
                    return (f"{name}'s fused kernel takes floating parameters on {sorted(devices)}, got a {p.dtype} "
                            f"parameter on {p.device.type}")
                if is_sgd and cpu_fused_sgd_skips(p):
                    return CPU_FUSED_SGD_HALF + ", so it is not used for them"
                if p.layout != torch.strided:
                    return f"{name}'s fused kernel takes no sparse tensors"
                if type(p) not in (Tensor, torch.nn.Parameter):
                    # FSDP2's DTensor shards: torch's DTensor has no sharding rule for every fused kernel
                    return f"{name}'s fused kernel is not used on {type(p).__name__} parameters (FSDP2 shards)"
        return None

    def _make_ready(self) -> None:
        """Step counters onto their parameters' devices; zero momentum buffers (SGD, ``dampening=0``).

        Raises:
            RuntimeError: a state tensor whose shape is not its parameter's (the parameter was resized
                after its state was made), which torch's fused kernel would not notice.
        """
        opt = self.optimizer
        is_sgd = isinstance(opt, torch.optim.SGD)
        for g in opt.param_groups:
            make_buffers = is_sgd and g.get("momentum", 0) and not g.get("dampening", 0)
            for p in g["params"]:
                st = opt.state.get(p)
                for k, v in (st or {}).items():
                    if isinstance(v, Tensor) and v.dim() and v.shape != p.shape:
                        raise RuntimeError(
                            f"{type(opt).__name__}: a parameter of shape {tuple(p.shape)} has optimizer state {k!r} of "
                            f"shape {tuple(v.shape)}: the parameter changed shape after its state was created "
                            "(resize_token_embeddings, a parameter's .data replaced by a tensor of another shape). "
                            "Resize before the first step, or drop that parameter's state (del optimizer.state[p]) "
                            "to start it afresh."
                        )
                if st:
                    step = st.get("step")
                    if isinstance(step, Tensor) and step.device != p.device:
                        st["step"] = step.to(p.device, torch.float32)
                if make_buffers and (not st or st.get("momentum_buffer") is None):
                    opt.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        self._ready = True
        self._groups = len(opt.param_groups)
        self._params = [p for g in opt.param_groups for p in g["params"]]
        self._shapes = list(map(_SHAPE, self._params))
        self._strides = list(map(_STRIDE, self._params))
        self._contiguous = all(map(_CONTIGUOUS, self._params))
        self._align_states()
        self._damped = is_sgd and self._missing_damped_buffers()

    def _align_states(self) -> None:
        """Lay every state tensor out as its parameter (values kept); note the parameters that are not dense.

        A state in another memory order than its parameter (a model moved to ``channels_last`` after
        its state was made, a checkpoint of another layout loaded, SGD's momentum cloned from a
        gradient of another layout) is replaced by a copy in the parameter's layout, so the fused
        kernel reads it right.
        """
        opt = self.optimizer
        self._non_dense = [p for p in self._params if not dense_layout(p)]
        for p in self._params:
            if self._non_dense and any(p is q for q in self._non_dense):
                continue  # no layout of its own to copy into (its steps are the optimizer's own)
            st = opt.state.get(p)
            for k, v in list((st or {}).items()):
                if isinstance(v, Tensor) and v.dim() and v.shape == p.shape and not same_layout(v, p):
                    st[k] = torch.empty_like(p, dtype=v.dtype).copy_(v)  # p is dense: empty_like keeps its strides

    def _non_dense_layout(self) -> str | None:
        """Why a parameter with a gradient cannot take the fused kernel (not dense), or ``None``.

        Frozen or gradient-less slices of a larger tensor do not count: the fused step skips them.
        """
        for p in self._non_dense:
            if p.grad is not None:
                return (f"a parameter of shape {tuple(p.shape)} with strides {p.stride()} is not dense (it views part "
                        "of a larger tensor)")
        return None

    def _grad_layout(self) -> str | None:
        """Why a gradient cannot take the fused kernel now (``None``: every one can). Host work, no sync.

        A sparse gradient sets :attr:`sparse` (the host decides from then on, as before: torch's fused
        SGD refuses them) and answers ``None``.
        """
        grads = [g for g in map(_GRAD, self._params) if g is not None]
        if set(map(_LAYOUT, grads)) - _STRIDED:  # C loops, as below: no Python call per tensor
            self.sparse = True
            return None
        if self._contiguous and all(map(_CONTIGUOUS, grads)):
            return None
        for p in self._params:  # (a channels_last model every step: C-level stride compares, no call per tensor)
            g = p.grad
            if g is not None and g.stride() != p.stride() and not same_layout(g, p):
                return (f"a parameter of shape {tuple(p.shape)} has strides {p.stride()} and its gradient "
                        f"{g.stride()} (a gradient assigned in another memory format, e.g. from torch.autograd.grad)")
        return None

    def _layout_mismatch(self) -> bool:
        """Whether a parameter or gradient layout keeps this step off the fused kernel (warned once per cause)."""
        bad = self._non_dense_layout() if self._non_dense else None
        why = bad or self._grad_layout()
        if why is None:
            return self.sparse
        if bad is None:
            # The step below is the optimizer's own: a state it makes (SGD's momentum, a clone of the gradient)
            # may take the gradient's layout; the next step lays it out as its parameter again (_align_states).
            self._ready = False
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(
                f"mixprec: {type(self.optimizer).__name__} steps through torch's fused kernel so that it can skip "
                f"overflowing steps without a host sync, and that kernel pairs elements in memory order: {why}. "
                f"This step runs {type(self.optimizer).__name__}'s own step after one host read (found_inf.item()), "
                "as every step while it lasts. Give each parameter and its gradient one memory format (assign "
                "gradients with p.grad = g.to(memory_format=...) matching the parameter's; keep parameters as "
                "whole tensors, not slices of a larger one).",
                UserWarning,
                stacklevel=_outside_stacklevel(),
            )
        return True

    def _missing_damped_buffers(self) -> bool:
        opt = self.optimizer
        return any(g.get("momentum", 0) and g.get("dampening", 0)
                   and any(opt.state.get(p, {}).get("momentum_buffer") is None for p in g["params"])
                   for g in opt.param_groups)

    def needs_host_read(self) -> bool:
        """Whether this step must be decided on the host: sparse gradients seen, a memory layout the
        fused kernel would misread (see the class docstring), or SGD with ``dampening`` != 0 before
        its first applied step (its first step is ``buf = grad``, not a dampened zero buffer). No
        host sync to answer."""
        if self.sparse:
            return True
        if not self._ready or self._groups != len(self.optimizer.param_groups) \
                or list(map(_SHAPE, self._params)) != self._shapes \
                or list(map(_STRIDE, self._params)) != self._strides:  # C-level: no Python call per parameter
            self._make_ready()
        if self._layout_mismatch():
            return True
        if self._damped:
            self._damped = self._missing_damped_buffers()
        return self._damped

    def step(self, found_inf: Tensor, grad_scale: Tensor | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The optimizer's own ``step`` through its fused kernel, skipping on ``found_inf`` on the device."""
        opt = self.optimizer
        groups = opt.param_groups
        saved = [(g.get("fused"), g.get("foreach")) for g in groups]
        for g in groups:
            g["fused"], g["foreach"] = True, False
        opt.grad_scale, opt.found_inf = grad_scale, found_inf
        try:
            return _own_step(opt)(*args, **kwargs)
        finally:
            del opt.grad_scale, opt.found_inf
            for g, (fused, foreach) in zip(groups, saved):
                g["fused"], g["foreach"] = fused, foreach


def _unready(optimizer: Any) -> None:
    """``load_state_dict`` post-hook: the loaded state may hold CPU step counters again."""
    twin = optimizer.__dict__.get("_mixprec_twin")
    if twin is not None:
        twin._ready = False


def fused_twin(optimizer: Any) -> FusedTwin | None:
    """The optimizer's :class:`FusedTwin` (made on first use), or ``None`` where it cannot have one.

    The answer is kept on the optimizer (``_mixprec_twin``; ``False`` for none), so the per-parameter
    check runs once, not every step; a param group added later is checked again.
    """
    twin = optimizer.__dict__.get("_mixprec_twin")
    if twin is False and optimizer.__dict__.get("_mixprec_twin_groups") == len(optimizer.param_groups):
        return None
    if not twin:
        if type(optimizer) not in FUSED_TWINS or FusedTwin.unsupported(optimizer) is not None:
            optimizer._mixprec_twin, optimizer._mixprec_twin_groups = False, len(optimizer.param_groups)
            return None
        twin = optimizer._mixprec_twin = FusedTwin(optimizer)
    return twin


def step_or_skip(optimizer: Any, found_inf: Tensor, grad_scale: Tensor | None, args: tuple[Any, ...],
                 kwargs: dict[str, Any], *, twin: bool = False) -> tuple[Tensor, Any]:
    """Step or skip; return the flag that decided (non-zero: skipped) and what ``step`` returned.

    The flag is ``found_inf`` itself when ``grad_scale`` is ``None``, so a caller that already
    holds ``found_inf`` pays no kernel for a ``skipped`` it may never read.

    The skip, in order of preference: the optimizer's own (``_step_supports_amp_scaling``: it is
    handed ``found_inf``/``grad_scale``); with ``twin`` (mixprec's presets), torch's fused
    kernel of a foreach/for-loop AdamW/Adam/SGD (:class:`FusedTwin`; also for a torch SGD built
    with ``fused=True``, whose own skipped first step would leave garbage momentum buffers);
    otherwise one host read.
    ``GradScaler`` passes ``twin=False``: it steps what it is given exactly as torch.amp does.
    """
    # torch's SGD(fused=True) skips on the device too, but its first step, skipped, leaves uninitialised
    # momentum buffers behind (the next applied step writes them into the weights): with twin, it goes
    # through FusedTwin, which makes the buffers first (the same fused kernel otherwise).
    if getattr(optimizer, "_step_supports_amp_scaling", False) and not (twin and type(optimizer) is torch.optim.SGD):
        sentinel = object()
        old = (getattr(optimizer, "grad_scale", sentinel), getattr(optimizer, "found_inf", sentinel))
        optimizer.grad_scale = grad_scale
        optimizer.found_inf = found_inf
        try:
            ret = _own_step(optimizer)(*args, **kwargs)
        finally:
            for name, value in zip(("grad_scale", "found_inf"), old):
                if value is sentinel:
                    try:
                        delattr(optimizer, name)
                    except AttributeError:
                        pass
                else:
                    setattr(optimizer, name, value)
        return found_inf, ret
    if twin:
        fused = optimizer.__dict__.get("_mixprec_twin") or fused_twin(optimizer)
        if fused and not fused.needs_host_read():
            try:
                return found_inf, fused.step(found_inf, grad_scale, args, kwargs)
            except RuntimeError as e:  # torch's fused SGD refuses sparse gradients before it changes anything
                if "sparse" not in str(e):
                    raise
                fused.sparse = True
    if grad_scale is not None:
        # the optimizer cannot unscale: do it here, fused, and fold its flag in
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        found_inf = unscale_and_check_(grads, grad_scale.reciprocal(), found_inf.clone())
    # Host sync: this optimizer cannot skip on the device, so the host decides whether to call it.
    if found_inf.item() > 0:
        return found_inf, None
    return found_inf, _own_step(optimizer)(*args, **kwargs)


def _own_step(optimizer: Any) -> Callable[..., Any]:
    """``optimizer.step``, or below its :class:`StepGuard` when mixprec is already stepping it (two calls fewer)."""
    guard = optimizer.__dict__.get("_mixprec_step_guard")
    if guard is not None and guard.depth > 0:
        return functools.partial(guard.raw_step, optimizer)
    return optimizer.step


# --------------------------------------------------------------------------------------------------
# The per-optimizer record of a MixedPrecision run
# --------------------------------------------------------------------------------------------------
Stage = Literal["idle", "backward", "unscaled"]


@dataclasses.dataclass(eq=False)
class OptimizerRecord:
    """What a :class:`~mixprec.MixedPrecision` run knows about one prepared optimizer in this iteration.

    Attributes:
        optimizer: The optimizer ``prepare`` returned.
        stage: ``"idle"`` (no gradients since its last step), ``"backward"`` (gradients that
            may still carry the loss scale) or ``"unscaled"`` (unscaled and checked).
        found_inf: The 0-d flag of the last ``unscale_`` (valid in stage ``"unscaled"``).
        stepped: Whether it stepped in the current iteration (see ``MixedPrecision``).
        guard: The step guard installed on the optimizer (``None`` when none could be).
        shadow: The ``_fused.FusedShadow`` that runs a plain torch optimizer's step compiled
            (``None``: its own step).
        blocked: Why a step is refused now (``EMA.applied()``: the model holds the averages), or ``None``.
    """

    optimizer: Any
    stage: Stage = "idle"
    found_inf: Tensor | None = None
    stepped: bool = False
    guard: StepGuard | None = None
    shadow: Any = None
    blocked: str | None = None


# --------------------------------------------------------------------------------------------------
# optimizer.step() called directly
# --------------------------------------------------------------------------------------------------
class StepGuard:
    """Routes a direct ``optimizer.step()`` through mixprec, or refuses it.

    mixprec installs ``step`` as an instance attribute (a bound method, so torch's LR schedulers
    can still wrap it) on:

    * the optimizer ``prepare`` returned (``mode="route"``): a direct ``optimizer.step()`` runs
      ``MixedPrecision.step(optimizer)`` (unscale, inf/NaN check, skip on the device, masters
      copied back, one scale update per iteration). ``step(closure)`` evaluates the closure
      first (under ``torch.enable_grad``), as Lightning and ``torch.optim`` do.
    * the optimizer wrapped inside a ``MasterWeightOptimizer`` (``mode="refuse"``): stepping it
      directly would update the masters with gradients that may still be scaled and never copy
      them to the model, so it raises and names the call to use.

    While mixprec itself steps (``inside()``), the call goes to the optimizer's own ``step``
    (the previous instance attribute if there was one, such as a scheduler's wrapper, otherwise
    the class's method).
    """

    def __init__(self, optimizer: Any, mode: Literal["route", "refuse"], run: Callable[[Any], Any] | None) -> None:
        self.mode = mode
        self._run = run
        #: How deep mixprec's own step calls are nested (> 0: ``optimizer.step`` is the real step). The step
        #: path raises and lowers it directly (``inside()`` costs three Python calls per step).
        self.depth = 0
        self._previous = optimizer.__dict__.get("step")  # a scheduler's wrapper, a monitor's, ...
        #: ``"refuse"`` on an optimizer ``prepare`` converted (``bf16-pure``): the class it became (the message).
        self.converted_to: type | None = None

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Calls of ``optimizer.step`` in this block are mixprec's own: they reach the real step."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def raw_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """The optimizer's own step, below the guard."""
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        # looked up per call, not kept: torch wraps optimizer classes' step, and a guard holding that
        # wrapper could not be pickled
        return type(optimizer).step(optimizer, *args, **kwargs)

    def __call__(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if self.depth > 0:
            return self.raw_step(optimizer, *args, **kwargs)
        if self.mode == "refuse" and self.converted_to is not None:
            new = self.converted_to
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() was called on the optimizer passed to prepare(), which prepare() "
                f"converted into {new.__module__.replace('._adamw', '').replace('._sgd', '')}.{new.__qualname__} "
                "(compensated updates of the half-precision weights, on the same param groups and state); stepping it "
                "directly would update the weights without their compensation. Call prec.step(optimizer) or "
                "optimizer.step() on the optimizer prepare() returned."
            )
        if self.mode == "refuse":
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() was called on the optimizer passed to prepare(), which now steps the "
                "FP32 master weights inside the MasterWeightOptimizer that prepare() returned; calling it directly would "
                "apply gradients that may still be loss-scaled and never copy the masters back to the model. Call "
                "prec.step(optimizer) or optimizer.step() on the optimizer prepare() returned."
            )
        closure = kwargs.pop("closure", None)
        if args:
            closure, args = args[0], args[1:]
        if args or kwargs:
            raise TypeError(
                f"optimizer.step() of a prepared optimizer takes only an optional closure, got {len(args)} more "
                f"positional and {sorted(kwargs)} keyword argument(s); call prec.step(optimizer) instead."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._run is None:
            raise RuntimeError("this optimizer's MixedPrecision run is gone; prepare the model again.")
        self._run(optimizer)
        return loss


def _guarded_step(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``step`` of an optimizer under mixprec (see :class:`StepGuard`)."""
    guard = self.__dict__.get("_mixprec_step_guard")
    if guard is None:  # the guard was removed but this bound method survived in a wrapper
        return type(self).step(self, *args, **kwargs)
    return guard(self, *args, **kwargs)


def install_step_guard(optimizer: Any, mode: Literal["route", "refuse"],
                       run: Callable[[Any], Any] | None = None) -> StepGuard:
    """Install a :class:`StepGuard` on ``optimizer`` (idempotent per mode) and return it."""
    existing = optimizer.__dict__.get("_mixprec_step_guard")
    if existing is not None:
        existing.mode, existing._run = mode, run
        return existing
    guard = StepGuard(optimizer, mode, run)
    optimizer._mixprec_step_guard = guard
    if getattr(guard._previous, "_wrapped_by_lr_sched", False):
        # An LR scheduler built before prepare() wrapped step; it warns "optimizer.step() has been
        # overridden after learning rate scheduler initialization" unless step still carries its
        # mark. The scheduler's wrapper runs below the guard (raw_step), so its counter still ticks.
        ref = weakref.ref(optimizer)

        def step(*args: Any, **kwargs: Any) -> Any:
            return _guarded_step(ref(), *args, **kwargs)

        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # torch's scheduler reads this mark
        optimizer.step = step
    else:
        optimizer.step = types.MethodType(_guarded_step, optimizer)
    return guard


def remove_step_guard(optimizer: Any) -> None:
    """Undo :func:`install_step_guard` (the optimizer's previous ``step`` comes back)."""
    guard = optimizer.__dict__.pop("_mixprec_step_guard", None)
    if guard is None:
        return
    if guard._previous is not None:
        optimizer.step = guard._previous
    else:
        optimizer.__dict__.pop("step", None)


# --------------------------------------------------------------------------------------------------
# The applied-step counter, materialised on demand
# --------------------------------------------------------------------------------------------------
class AppliedSteps:
    """A device count of applied optimizer steps that costs no kernel per step until it is read.

    Algorithm: each step appends its 0-d skip flag (``found_inf``, or a bool ``skipped``: non-zero
    means skipped) and a one-slot cell for the step's :class:`~mixprec.StepInfo` to a pending
    list; reading the count, or a pending step's own
    value, folds the list: ``values = base + cumsum(stack(flags) == 0)`` (three kernels for any
    number of steps), fills every pending cell with its step's value and makes the last one the
    new base. The list is folded every ``fold_every`` steps as well, so it stays small when
    nothing reads it. Training loops that never look at ``applied_steps`` pay nothing per step;
    a loop that reads it every step pays what an eager counter would. No host sync.
    """

    fold_every = 256

    def __init__(self, base: Tensor) -> None:
        self.base = base
        self._flags: list[Tensor] = []
        self._cells: list[list[Tensor | None]] = []

    def push(self, skipped: Tensor) -> list[Tensor | None]:
        """Record one step's skip flag (non-zero: skipped); return the cell its value will be written to."""
        cell: list[Tensor | None] = [None]
        self._flags.append(skipped)
        self._cells.append(cell)
        if len(self._flags) >= self.fold_every:
            self.fold()
        return cell

    def fold(self) -> Tensor:
        """Materialise every pending step's count; return the current count (0-d int64)."""
        flags, cells = self._flags, self._cells
        if not flags:
            return self.base
        self._flags, self._cells = [], []
        base = self.base
        dev = base.device
        if len(flags) == 1:  # read every step: one kernel, as an eager counter
            skip = flags[0] if flags[0].device == dev else flags[0].to(dev)
            values: tuple[Tensor, ...] = (base + (skip == 0),)
        else:
            clean = torch.stack([f if f.device == dev else f.to(dev) for f in flags]) == 0
            values = (torch.cumsum(clean, 0, dtype=torch.int64) + base).unbind(0)
        for cell, value in zip(cells, values):
            cell[0] = value
        self.base = values[-1]
        return self.base

    def reset(self, value: Tensor) -> None:
        """Set the count (``load_state_dict``): pending steps are materialised first, then forgotten."""
        self.fold()
        self.base = value


# --------------------------------------------------------------------------------------------------
# What one step did
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What one :meth:`MixedPrecision.step` did, as 0-d tensors on the device (no host sync).

    Attributes:
        found_inf: 1.0 when a gradient was inf/NaN (float32).
        skipped: ``True`` when the optimizer step was skipped (bool).
        scale: The loss scale this step's gradients were divided by (float32; 1.0 unscaled).
        applied_steps: Optimizer steps applied so far in this run, over all prepared optimizers
            (int64).
    """

    found_inf: torch.Tensor
    scale: torch.Tensor
    # A tensor, or the cell (and the counter that fills it) of a step whose count is not read yet.
    _applied: torch.Tensor | tuple[list[torch.Tensor | None], AppliedSteps] = dataclasses.field(repr=False)
    # The flag the step decided on (non-zero: skipped; ``found_inf`` itself on every mixprec path).
    _decided: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    # ``_decided > 0``, computed on first read (one kernel the hot path does not pay).
    _skipped: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    @property
    def skipped(self) -> torch.Tensor:
        """``True`` when the optimizer step was skipped (0-d bool; computed on first read, no host sync)."""
        value = self._skipped
        if value is None:
            value = (self._decided if self._decided is not None else self.found_inf) > 0
            object.__setattr__(self, "_skipped", value)
        return value

    @property
    def applied_steps(self) -> torch.Tensor:
        """Optimizer steps applied so far in this run, as of this step (0-d int64; no host sync).

        Computed on first read (with every other pending step's count, in three kernels), so
        loops that never read it pay no kernel per step.
        """
        value = self._applied
        if isinstance(value, torch.Tensor):
            return value
        cell, counter = value
        if cell[0] is None:
            counter.fold()
        result = typing_cast(torch.Tensor, cell[0])
        object.__setattr__(self, "_applied", result)
        return result

    def applied(self) -> bool:
        """Whether the step was applied. Host sync: reads ``skipped``."""
        return not bool(self.skipped.item())

    def mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """1 if the step was applied, 0 if skipped, as a 0-d tensor: gate EMA updates without a sync.

        For a moving average of the weights use :class:`mixprec.EMA` (``ema.update(info)``):
        it averages the FP32 masters where there are masters and upcasts half-precision
        parameters (``lerp`` needs both sides in one dtype, so lerping an FP32 average towards
        BF16/FP16 parameters fails).

        Example:
            ``weight = (1 - decay) * info.mask()`` is ``1 - decay`` on an applied step and ``0`` on a
            skipped one: ``torch._foreach_lerp_(ema, fp32_weights, weight)`` then leaves ``ema``
            unchanged on a skipped step, with no host sync (docs/ema.md).
        """
        return (~self.skipped).to(dtype)
