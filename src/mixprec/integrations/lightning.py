"""Lightning precision plugins that run the Trainer and Fabric on a :class:`mixprec.MixedPrecision`.

* :class:`MixprecPrecision`: ``Trainer(plugins=[MixprecPrecision("bf16-master")])``.
* :class:`MixprecFabricPrecision`: ``Fabric(plugins=[plugin])``, then
  ``model, optimizer = plugin.setup(fabric, model, optimizer)``.

Both are thin adapters: every hop is one :class:`~mixprec.MixedPrecision` call.

========================  ==========================================================================
Lightning hook            mixprec call
========================  ==========================================================================
``connect`` (Trainer)     ``prec.prepare(model, *optimizers)`` once ``configure_optimizers`` ran
``setup`` (Fabric)        ``prec.prepare(model, *optimizers)``, then ``fabric.setup(...)``
``forward_context``       ``prec.autocast(cache_enabled=False)``
``backward``              ``prec.backward(loss)`` (scales the loss when the policy scales)
``optimizer_step``        closure, ``prec.unscale_`` (hooks see true gradients), clipping, ``prec.step``
``clip_gradients``        ``prec.clip_grad_norm_`` on the unscaled (FP32 master) gradients
``state_dict``            ``prec.state_dict()``: model, optimizers with masters, scaler, step count
========================  ==========================================================================

Skipped steps and LR schedulers: Lightning steps schedulers itself after every optimizer step.
A scheduler attached to a prepared optimizer (``interval="step"`` in the Trainer, the
``scheduler=`` of :meth:`MixprecFabricPrecision.setup`) is made skip-aware: its ``step()`` does
nothing when the latest step of its optimizer was skipped (inf/NaN gradients), so the learning
rate schedule counts applied steps only. That costs one host read of ``skipped`` per scheduler
step. ``interval="epoch"`` schedulers are left alone (they advance once per epoch), also under manual
optimization: a scheduler you step per batch by hand is skip-aware when you declare it
``{"scheduler": s, "interval": "step"}`` (a list return means ``"epoch"``).

Strategies: single device only (``SingleDeviceStrategy``, what ``devices=1`` gives). Other
strategies (DDP, FSDP, DeepSpeed, ...) raise a ``ValueError`` naming the supported one; for
several GPUs use a plain loop with :func:`mixprec.distributed.wrap_ddp`.

``lightning`` is an optional dependency (``pip install lightning`` or ``mixprec[test]``); this
module imports it and raises an ``ImportError`` with that hint when it is missing.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from .._master import MasterWeightOptimizer
from .._precision import MixedPrecision
from .._stepping import StepInfo

try:
    from lightning.fabric.plugins.precision import Precision as _FabricPrecisionBase
    from lightning.fabric.strategies import SingleDeviceStrategy as _FabricSingleDevice
    from lightning.pytorch.core.optimizer import LightningOptimizer as _LightningOptimizer
    from lightning.pytorch.plugins.precision import Precision as _TrainerPrecisionBase
    from lightning.pytorch.strategies import SingleDeviceStrategy as _TrainerSingleDevice
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as e:  # pragma: no cover - exercised only without lightning
    raise ImportError(
        "mixprec.integrations.lightning needs the 'lightning' package: pip install lightning "
        "(or pip install 'mixprec[test]')."
    ) from e

__all__ = ["MixprecFabricPrecision", "MixprecPrecision"]

SUPPORTED_STRATEGIES = "SingleDeviceStrategy (accelerator='cpu'/'gpu', devices=1)"


def _lightning_precision(prec: MixedPrecision) -> Any:
    """The Lightning precision string closest to the policy (what ``trainer.precision`` reports)."""
    p = prec.policy
    if p.param_dtype == torch.float32:
        if p.compute_dtype == torch.bfloat16:
            return "bf16-mixed"
        if p.compute_dtype == torch.float16:
            return "16-mixed"
        return "32-true"
    return "bf16-true" if p.param_dtype == torch.bfloat16 else "16-true"


def _check_strategy(strategy: Any, allowed: type, where: str) -> None:
    if type(strategy) is not allowed:
        raise ValueError(
            f"{where}: mixprec's Lightning plugin supports {SUPPORTED_STRATEGIES}, got strategy "
            f"{type(strategy).__name__}. Use devices=1 (the default strategy), or for several devices train with a "
            "plain loop: model, opt = prec.prepare(model, opt); ddp = mixprec.distributed.wrap_ddp(prec, model)."
        )


def _unwrapped(optimizer: Any) -> Any:
    """The optimizer ``prepare`` returned, also when Lightning hands its ``LightningOptimizer`` wrapper of it."""
    return optimizer.optimizer if isinstance(optimizer, _LightningOptimizer) else optimizer


class _Adapter:
    """What the Trainer and Fabric plugins share: the run, the skip record, the scheduler gate."""

    def _init_adapter(self, policy: MixedPrecision | Any, mixprec_kwargs: dict[str, Any]) -> None:
        if isinstance(policy, MixedPrecision):
            if mixprec_kwargs:
                raise TypeError(
                    f"pass either a MixedPrecision or a policy with MixedPrecision keywords, not both (got {sorted(mixprec_kwargs)})."
                )
            self.prec = policy
        else:
            self.prec = MixedPrecision(policy, **mixprec_kwargs)
        self.precision = _lightning_precision(self.prec)
        self._last: dict[int, StepInfo] = {}  # id(prepared optimizer) -> the StepInfo of its latest step

    @property
    def prepared(self) -> bool:
        """Whether ``prec.prepare`` ran (the Trainer's ``connect``, :meth:`MixprecFabricPrecision.setup`)."""
        return self.prec.model is not None

    @property
    def last_step(self) -> StepInfo | None:
        """The :class:`~mixprec.StepInfo` of the latest optimizer step (``None`` before the first)."""
        return self.prec.last_step

    def _prepare(self, model: nn.Module, optimizers: list[Optimizer], schedulers: Iterable[Any]) -> list[Optimizer]:
        model_out, *wrapped = self.prec.prepare(model, *optimizers)
        del model_out  # the same object
        by_given = {id(g): w for g, w in zip(optimizers, wrapped)}
        for w in wrapped:  # a MasterWeightOptimizer's schedulers hold the optimizer it wraps
            inner = getattr(w, "optimizer", None)
            if isinstance(inner, Optimizer):
                by_given.setdefault(id(inner), w)
        for s in schedulers:
            target = by_given.get(id(getattr(s, "optimizer", None)))
            if target is not None:
                self._gate_scheduler(s, target)
        return list(wrapped)

    def _gate_scheduler(self, scheduler: Any, optimizer: Optimizer) -> None:
        """Make ``scheduler.step()`` a no-op after a skipped step of ``optimizer`` (one host read)."""
        cls = type(scheduler)
        if getattr(cls, "_mixprec_gated", False):
            return
        ref = weakref.ref(self)
        key = id(optimizer)

        def step(sched: Any, *args: Any, **kwargs: Any) -> Any:
            adapter = ref()
            info = adapter._last.get(key) if adapter is not None else None
            # Host sync: the scheduler is a host object, so the host must know whether the step was applied.
            if info is not None and not info.applied():
                return None
            return cls.step(sched, *args, **kwargs)

        # A subclass swapped in (no instance attribute): state_dict(), isinstance checks and
        # torch's step-order bookkeeping are unchanged.
        scheduler.__class__ = type(cls.__name__, (cls,), {"step": step, "_mixprec_gated": True, "__module__": cls.__module__})

    def _step(self, optimizer: Optimizer) -> StepInfo:
        info = self.prec.step(optimizer)
        self._last[id(optimizer)] = info
        return info

    def _clip_by_value(self, optimizer: Optimizer, clip_val: float) -> None:
        optimizer = _unwrapped(optimizer)
        self.prec.unscale_(optimizer)
        # param_groups hold what the step updates: the FP32 masters under *-master
        tensors = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_value_(tensors, clip_value=clip_val)

    def _state_dict(self) -> dict[str, Any]:
        if self.prepared:
            return self.prec.state_dict()
        return {}

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores it after connect() in fit; in validate/test/predict with ckpt_path= nothing is
        # prepared and Lightning's own entry restores the weights, so the training state is not needed.
        if state_dict and self.prepared:
            self.prec.load_state_dict(state_dict)


class MixprecPrecision(_Adapter, _TrainerPrecisionBase):
    """A ``lightning.pytorch`` precision plugin that trains through :class:`mixprec.MixedPrecision`.

    Args:
        policy: A policy, preset (``"bf16-master"``, ``"fp16-mixed"``, ...), alias or grammar
            string, or a ready :class:`~mixprec.MixedPrecision` (not yet prepared).
        **mixprec_kwargs: Passed to :class:`~mixprec.MixedPrecision` (``scaler=``, ...).

    Example::

        trainer = lightning.Trainer(plugins=[MixprecPrecision("bf16-master")], gradient_clip_val=1.0)
        trainer.fit(module, loader)

    The run is ``plugin.prec``: prepared in :meth:`connect`, after ``configure_optimizers``.
    ``gradient_clip_val`` clips the unscaled gradients (the FP32 masters' under ``*-master``);
    ``trainer.save_checkpoint`` stores ``prec.state_dict()`` under this class's name and
    ``ckpt_path=`` restores it. Manual optimization (``self.manual_backward``,
    ``opt.step()``, ``self.clip_gradients``) goes through the same calls.

    Raises:
        ValueError: a strategy other than the single-device one (at ``fit``).
    """

    def __init__(self, policy: MixedPrecision | Any = "bf16-mixed", **mixprec_kwargs: Any) -> None:
        self._init_adapter(policy, mixprec_kwargs)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Check the strategy; the cast happens in :meth:`connect`, where the optimizers exist."""
        trainer = getattr(module, "_trainer", None)
        if trainer is not None:
            _check_strategy(trainer.strategy, _TrainerSingleDevice, "Trainer")
        return module

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """``prec.prepare(model, *optimizers)``; step-interval schedulers become skip-aware."""
        if not optimizers or (self.prepared and [id(o) for o in optimizers] == [id(o) for o in self.prec.optimizers]):
            return model, optimizers, lr_schedulers  # validate/test/predict (before or after this run's fit)
        if self.prepared:
            raise ValueError(
                "Trainer.fit: this MixprecPrecision already prepared a run (its model is cast and its optimizers "
                "wrapped); use a new MixprecPrecision for each fit, and continue a run with "
                "trainer.save_checkpoint(path) then Trainer(plugins=[MixprecPrecision(...)]).fit(..., ckpt_path=path). "
                "After Lightning's Tuner (lr_find, scale_batch_size), whose trial fit prepared the model with this "
                "plugin (casting it in place): tune a copy of the model without the plugin (Lightning's own precision), "
                "then fit a fresh model with MixprecPrecision."
            )
        if type(model).__name__ == "DistributedDataParallel" or not isinstance(model, nn.Module):
            raise ValueError(f"Trainer: mixprec's Lightning plugin supports {SUPPORTED_STRATEGIES}, got a {type(model).__name__}.")
        # Only interval="step" schedulers are gated: an "epoch" one (the list return's default) advances once per
        # epoch, also when stepped by hand in manual optimization, where gating it on the epoch's last optimizer
        # step would lose the epoch's step whenever that one was skipped.
        step_schedulers = [c.scheduler for c in lr_schedulers if getattr(c, "interval", "step") == "step"]
        wrapped = self._prepare(model, list(optimizers), step_schedulers)
        if any(isinstance(w, MasterWeightOptimizer) for w in wrapped):
            _toggle_model_parameters(model)
        return model, wrapped, lr_schedulers

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """``prec.autocast(cache_enabled=False)``, as Lightning's own plugin: it spans a whole ``training_step``,
        where manual optimization steps and then runs forwards on the new weights."""
        with self.prec.autocast(cache_enabled=False):
            yield

    def backward(self, tensor: Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """``prec.backward(loss)``: scaled when the policy scales (``LightningModule.backward`` is not called)."""
        self.prec.backward(tensor, *args, **kwargs)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Closure, unscale (so hooks and clipping see true gradients), clip, then ``prec.step``."""
        if kwargs:
            raise TypeError(
                f"optimizer_step: mixprec steps take no extra keyword arguments, got {sorted(kwargs)}; the step is prec.step(optimizer)."
            )
        closure_result = closure()
        automatic = getattr(model, "automatic_optimization", True)
        if closure_result is None and automatic:
            # training_step returned None: Lightning skips backward and the step
            return closure_result
        self.prec.unscale_(optimizer)
        self._after_closure(model, optimizer)
        self._step(optimizer)
        return closure_result

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the unscaled gradients: ``prec.clip_grad_norm_`` (norm) or by value on what the step uses."""
        if clip_val <= 0:
            return
        optimizer = _unwrapped(optimizer)  # manual optimization's self.optimizers() hands a LightningOptimizer
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self._clip_by_value(optimizer, clip_val)
        else:
            self.prec.clip_grad_norm_(clip_val, optimizer=optimizer)

    def state_dict(self) -> dict[str, Any]:
        """``prec.state_dict()`` (empty before ``fit``); Lightning stores it in its checkpoint."""
        return self._state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``prec.load_state_dict``: scaler, masters, optimizer state and step count, bit for bit."""
        self._load_state_dict(state_dict)


def _params_of(optimizer: Any) -> list[Tensor]:
    """The model parameters an optimizer trains: a ``MasterWeightOptimizer``'s model parameters, not its masters."""
    opt = _unwrapped(optimizer)
    if isinstance(opt, MasterWeightOptimizer):
        return opt.model_params
    return [p for g in opt.param_groups for p in g["params"]]


def _toggle_model_parameters(module: nn.Module) -> None:
    """Give ``module`` (a LightningModule) ``toggle_optimizer``/``untoggle_optimizer`` that act on the model's parameters.

    Lightning's walk ``optimizer.param_groups``, which under master weights hold the FP32 masters:
    toggling them left every model parameter trainable, so in a GAN loop the discriminator kept the
    generator loss's gradient and stepped with it. These walk each optimizer's model parameters
    instead, with Lightning's semantics (bound methods of module-level functions: a deepcopy of the
    module carries them; an unpickled one has Lightning's again until its next fit under the plugin).
    A subclass that overrides the methods keeps its own.
    """
    from lightning.pytorch import LightningModule

    cls: Any = type(module)
    if not isinstance(module, LightningModule) or cls.toggle_optimizer is not LightningModule.toggle_optimizer \
            or cls.untoggle_optimizer is not LightningModule.untoggle_optimizer:
        return
    object.__setattr__(module, "toggle_optimizer", types.MethodType(_toggle_optimizer, module))
    object.__setattr__(module, "untoggle_optimizer", types.MethodType(_untoggle_optimizer, module))


def _toggle_optimizer(module: Any, optimizer: Any) -> None:
    """Lightning's ``toggle_optimizer`` over model parameters (see :func:`_toggle_model_parameters`)."""
    state: dict[Tensor, bool] = {}
    for opt in module.trainer.optimizers:
        for p in _params_of(opt):
            if p not in state:
                state[p] = p.requires_grad
                p.requires_grad = False
    for p in _params_of(optimizer):
        p.requires_grad = state[p]
    module._param_requires_grad_state = state


def _untoggle_optimizer(module: Any, optimizer: Any) -> None:
    """Lightning's ``untoggle_optimizer`` over model parameters (see :func:`_toggle_model_parameters`)."""
    target = _unwrapped(optimizer)
    state = module._param_requires_grad_state
    for opt in module.trainer.optimizers:
        if _unwrapped(opt) is not target:
            for p in _params_of(opt):
                if p in state:
                    p.requires_grad = state[p]
    module._param_requires_grad_state = {}


# A bound method pickles as getattr(instance, __name__): under Lightning's names an unpickled module finds its
# class's methods there, as before the patch (the next fit under the plugin patches it again), instead of failing.
_toggle_optimizer.__name__ = "toggle_optimizer"
_untoggle_optimizer.__name__ = "untoggle_optimizer"


def _clip_gradients_norm(plugin: Any, module: nn.Module, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0,
                         error_if_nonfinite: bool = True) -> Tensor:
    """Fabric's ``clip_gradients(..., max_norm=...)`` under the plugin: ``prec.clip_grad_norm_`` on that optimizer.

    ``error_if_nonfinite`` (Fabric's default ``True``) does not raise: an inf/NaN norm means inf/NaN
    gradients, and mixprec skips that step on the device (under FP16 it is the loss scale's normal
    overflow, and the scale backs off). Gradients that stay non-finite still end in an error: the
    scaler's escalation raises ``mixprec.NumericsError`` after ``patience`` skipped steps. No host
    read (Fabric's own check reads the norm).
    """
    return plugin.prec.clip_grad_norm_(float(max_norm), norm_type=float(norm_type), optimizer=optimizer)


class MixprecFabricPrecision(_Adapter, _FabricPrecisionBase):
    """A ``lightning.fabric`` precision plugin that trains through :class:`mixprec.MixedPrecision`.

    Fabric's precision plugins never see the optimizers, and mixprec needs them to build the
    FP32 masters from the exact weights before the cast, so set up through the plugin::

        plugin = MixprecFabricPrecision("bf16-master")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model, optimizer, scheduler = plugin.setup(fabric, model, optimizer, scheduler=scheduler)

    ``fabric.setup(model, ...)`` on a model the plugin did not prepare raises a ``ValueError``
    naming this call. ``fabric.backward(loss)``, ``optimizer.step()``,
    ``fabric.clip_gradients(model, optimizer, max_norm=...)`` and the model's forward then go
    through ``prec``. Save ``{"mixprec": plugin, ...}`` with ``fabric.save``: the plugin's state
    holds the model, the optimizers with masters, the scaler and the step count.

    Args:
        policy: As for :class:`MixprecPrecision`.
        **mixprec_kwargs: Passed to :class:`~mixprec.MixedPrecision`.
    """

    def __init__(self, policy: MixedPrecision | Any = "bf16-mixed", **mixprec_kwargs: Any) -> None:
        self._init_adapter(policy, mixprec_kwargs)

    def setup(self, fabric: Any, module: nn.Module, *optimizers: Optimizer, scheduler: Any = None) -> Any:
        """Move ``module`` to ``fabric.device``, ``prec.prepare`` it with ``optimizers``, then ``fabric.setup``.

        Returns:
            What ``fabric.setup`` returns: ``(model, *optimizers)``, plus ``scheduler`` when given
            (made skip-aware: its ``step()`` does nothing after a skipped step).

        Raises:
            ValueError: ``fabric`` does not use this plugin, or a strategy other than single device.
        """
        if fabric.strategy.precision is not self:
            raise ValueError("plugin.setup(fabric, ...): this Fabric was not built with this plugin; pass Fabric(plugins=[plugin]).")
        _check_strategy(fabric.strategy, _FabricSingleDevice, "Fabric")
        if not optimizers:
            raise ValueError("plugin.setup(fabric, model, optimizer, ...) needs the optimizers: prec.prepare builds the FP32 state from them.")
        module = module.to(fabric.device)
        wrapped = self._prepare(module, list(optimizers), [scheduler] if scheduler is not None else [])
        # fabric.clip_gradients(model, opt, max_norm=...) reaches the strategy's clip_gradients_norm: route it to
        # prec.clip_grad_norm_, so that Fabric's default error_if_nonfinite=True does not turn the inf/NaN of an
        # overflowing FP16 step (which mixprec skips) into an error.
        fabric.strategy.clip_gradients_norm = types.MethodType(_clip_gradients_norm, self)
        return fabric.setup(module, *wrapped, scheduler=scheduler)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Accept only the model :meth:`setup` prepared."""
        if self.prec.model is not module:
            raise ValueError(
                "fabric.setup(model, ...) with MixprecFabricPrecision: set up through the plugin instead, "
                "model, optimizer = plugin.setup(fabric, model, optimizer), so that mixprec prepares the model "
                "together with its optimizers (FP32 masters, loss scaling)."
            )
        return module

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """``prec.autocast(cache_enabled=False)``, as Lightning's own plugin: a region the user may hold across a
        step (``fabric.autocast()``), where a later forward must see the new weights."""
        with self.prec.autocast(cache_enabled=False):
            yield

    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """``prec.backward(loss)`` (scaled when the policy scales)."""
        self.prec.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``prec.step(optimizer)`` (after the closure, when one is given)."""
        closure = kwargs.pop("closure", None)
        if kwargs:
            raise TypeError(
                f"optimizer.step(): mixprec steps take only a closure, got {sorted(kwargs)}; the step is prec.step(optimizer)."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step(optimizer)
        return loss

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """``prec.unscale_``: ``fabric.clip_gradients`` then clips the true (FP32 master) gradients."""
        self.prec.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """``prec.state_dict()`` (empty before :meth:`setup`)."""
        return self._state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``prec.load_state_dict``."""
        self._load_state_dict(state_dict)
