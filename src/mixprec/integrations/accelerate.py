"""Hugging Face Accelerate under a mixprec policy: ``MixprecAccelerator``.

``MixprecAccelerator`` is an ``accelerate.Accelerator`` whose training-step calls are
:class:`~mixprec.MixedPrecision`'s, so an Accelerate loop keeps its shape and only the constructor
changes::

    from mixprec.integrations.accelerate import MixprecAccelerator

    accelerator = MixprecAccelerator("fp16-mixed")      # a preset, a Policy or a MixedPrecision
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        loss = model(**batch).loss                   # the forward runs in prec.autocast()
        accelerator.backward(loss)                   # prec.backward: scaled when the policy scales
        accelerator.clip_grad_norm_(model.parameters(), 1.0)   # prec.clip_grad_norm_: unscaled norm
        optimizer.step()                             # prec.step: unscale, inf/NaN check, skip, masters
        scheduler.step()                             # does not advance on a skipped step
        optimizer.zero_grad()

What each call does:

* ``prepare(model, optimizer, ...)``: the model is moved to ``accelerator.device``, then
  ``prec.prepare(model, *optimizers)`` casts it and wraps the optimizers (masters, compensated
  optimizers), then Accelerate prepares the results. The model's ``forward`` runs inside
  ``prec.autocast()`` (as Accelerate's own ``mixed_precision`` wraps it in ``torch.autocast``), and
  ``prec`` is registered for checkpointing, so ``save_state``/``load_state`` hold the loss scaler,
  the FP32 masters and the step count. The model and its optimizers must come in one call.
* ``backward(loss)``: ``prec.backward(loss / gradient_accumulation_steps)``. ``loss.backward()``
  under a loss-scaling policy is refused at the next step with an error naming ``prec.backward``.
* ``clip_grad_norm_(model.parameters(), c)``: ``prec.clip_grad_norm_(c)`` (the true norm of the
  unscaled, FP32 master gradients); a subset of the parameters is clipped by torch's function after
  ``prec.unscale_``. ``unscale_gradients``/``clip_grad_value_`` unscale through ``prec`` too.
* ``optimizer.step()``: ``prec.step``; ``optimizer.step_was_skipped`` and
  ``accelerator.optimizer_step_was_skipped`` are true exactly when mixprec skipped the step (one
  host read of the 0-d ``skipped`` flag when asked), so a prepared scheduler does not advance.

Refused, with an error that names the fix: Accelerate's own mixed precision
(``mixed_precision="fp16"``/``"bf16"``/``"fp8"``, from the argument, ``accelerate config`` or
``ACCELERATE_MIXED_PRECISION``), which would run a second mixed-precision system on top of mixprec;
distributed types other than a single process (use :mod:`mixprec.distributed` in your own loop);
an optimizer prepared without its model.

``accelerate`` is imported when ``MixprecAccelerator`` is first used, with an install hint when it
is missing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .._policy import Policy
from .._precision import MixedPrecision
from .._prepare import model_params_of

__all__ = ["MixprecAccelerator", "as_mixed_precision", "attach", "check_accelerator"]

#: Built on first access by the module ``__getattr__`` below (it subclasses the optional dependency's class).
MixprecAccelerator: Any

INSTALL_HINT = "pip install accelerate (it is in mixprec's test extra: pip install 'mixprec[test]')"


def _import_accelerate() -> Any:
    try:
        import accelerate
    except ImportError as err:  # the optional dependency
        raise ImportError(f"mixprec.integrations.accelerate needs the `accelerate` package: {INSTALL_HINT}.") from err
    return accelerate


def as_mixed_precision(precision: MixedPrecision | Policy | str) -> MixedPrecision:
    """A :class:`MixedPrecision` from a preset, an alias, the grammar, a :class:`Policy` or one already built."""
    if isinstance(precision, MixedPrecision):
        return precision
    if isinstance(precision, (str, Policy)):
        return MixedPrecision(precision)
    raise TypeError(
        f"precision must be a mixprec preset (e.g. 'bf16-master'), a mixprec.Policy or a mixprec.MixedPrecision, "
        f"got {type(precision).__name__}"
    )


def check_accelerator(accelerator: Any, prec: MixedPrecision, *, where: str = "MixprecAccelerator") -> None:
    """Refuse an accelerator whose own mixed precision or distributed setup would bypass or double ``prec``.

    Raises:
        ValueError: ``accelerator.mixed_precision`` is not ``"no"``, or it is not a single process.
    """
    mixed = str(getattr(accelerator, "mixed_precision", "no") or "no")
    if mixed != "no":
        env = os.environ.get("ACCELERATE_MIXED_PRECISION")
        source = f" (ACCELERATE_MIXED_PRECISION={env!r} / accelerate config)" if env not in (None, "no") else ""
        preset = {"fp16": "fp16-mixed", "bf16": "bf16-mixed"}.get(mixed)
        hint = f" ('{mixed}' corresponds to the mixprec policy '{preset}')" if preset else ""
        raise ValueError(
            f"{where}: Accelerate's mixed_precision={mixed!r}{source} together with the mixprec policy "
            f"{prec.policy.label!r} would run two mixed-precision systems at once (torch.autocast and GradScaler on "
            "top of mixprec's casting, loss scaling and masters). Use mixed_precision='no' (the default) and choose "
            f"the precision with the mixprec policy only{hint}."
        )
    accelerate = _import_accelerate()
    dist_type = getattr(accelerator, "distributed_type", None)
    if dist_type is not None and dist_type != accelerate.DistributedType.NO:
        raise ValueError(
            f"{where}: distributed_type={dist_type!s} is not supported; the mixprec Accelerate integration runs in a "
            "single process (DistributedType.NO). For DDP or FSDP2 use mixprec.distributed.wrap_ddp / "
            "mixprec.distributed.fully_shard with MixedPrecision in your own loop."
        )


def _inner_optimizer(optimizer: Any) -> Any:
    """The optimizer inside Accelerate's ``AcceleratedOptimizer`` wrappers."""
    accelerate = _import_accelerate()
    while isinstance(optimizer, accelerate.optimizer.AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


class _Unbound:
    """``forward`` as something Accelerate can bind to the model again: calling it drops the bound model."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward

    def __call__(self, _model: Any, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)


class _AutocastForward:
    """``forward(*args)`` inside the run's autocast region: the ``forward`` of a model Accelerate prepared.

    An object, not a closure: ``copy.deepcopy(model)`` (``AveragedModel``, a teacher, a best-model
    snapshot) copies it with the model, so the copy's forward runs the copy's weights (a closure is
    copied by reference and ran the original's), and ``torch.save(model)`` pickles it. It holds the
    policy and the device, not the ``MixedPrecision``, so a copy of the model does not copy the run.
    """

    def __init__(self, forward: Any, policy: Any, device: torch.device | None) -> None:
        self.forward, self.policy, self.device = forward, policy, device
        with contextlib.suppress(TypeError, ValueError):  # Trainer reads the real arguments (unused-column removal)
            self.__signature__ = inspect.signature(forward)
        self.__name__ = getattr(forward, "__name__", "forward")
        self.__doc__ = getattr(forward, "__doc__", None)
        # Accelerate's unwrap_model(keep_fp32_wrapper=False) follows __wrapped__ and binds what it finds to the
        # model (types.MethodType): a callable that drops that first argument and calls the forward before ours.
        self.__wrapped__ = _Unbound(forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with MixedPrecision.autocast(self):  # type: ignore[arg-type]  # it reads .policy and .device only
            return self.forward(*args, **kwargs)


def _autocast_forward(model: nn.Module, prec: MixedPrecision) -> None:
    """Run ``model.forward`` inside ``prec.autocast()``, as Accelerate's ``mixed_precision`` does with ``torch.autocast``.

    The forward before wrapping is kept as ``model._original_forward``, where Accelerate's
    ``unwrap_model(..., keep_fp32_wrapper=False)`` looks for it.
    """
    forward = model.forward
    model._original_forward = forward  # type: ignore[assignment]  # a plain attribute on the module
    model.forward = _AutocastForward(forward, prec.policy, prec.device)


class _MixprecAcceleratorMixin:
    """The methods ``MixprecAccelerator`` puts in front of ``accelerate.Accelerator`` (see the module docstring)."""

    prec: MixedPrecision

    # ----- prepare ---------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool | None] | None = None) -> Any:
        """``prec.prepare(model, *optimizers)`` on the model and optimizers among ``args``, then Accelerate's ``prepare``.

        Raises:
            ValueError: an optimizer without its model (or the reverse) before the run is
                prepared, more than one model, or another model/optimizer after it was.
        """
        acc: Any = self
        prec = self.prec
        items = list(args)
        models = [i for i, a in enumerate(items) if isinstance(a, nn.Module)]
        opts = [i for i, a in enumerate(items) if isinstance(a, torch.optim.Optimizer)]
        if prec.model is None and (models or opts):
            if len(models) != 1 or not opts:
                raise ValueError(
                    "MixprecAccelerator.prepare needs the model and its optimizer(s) in one call, "
                    "accelerator.prepare(model, optimizer, ...): mixprec casts the model and wraps the optimizers "
                    f"together; got {len(models)} model(s) and {len(opts)} optimizer(s)."
                )
            model = items[models[0]]
            placement = device_placement[models[0]] if device_placement is not None else None
            if placement if placement is not None else acc.device_placement:
                model.to(acc.device)  # before prepare: the FP32 masters are made on the training device
            _, *wrapped = prec.prepare(model, *(items[i] for i in opts))
            for i, opt in zip(opts, wrapped):
                items[i] = opt
            _autocast_forward(model, prec)
            acc.register_for_checkpointing(prec)
        elif prec.model is not None:
            # A second prepare (Trainer.train() again, auto_find_batch_size): only the prepared objects.
            for i in models:
                if items[i] is not prec.model:
                    raise ValueError(
                        "MixprecAccelerator.prepare: this accelerator's MixedPrecision already prepared another model; "
                        "use one MixprecAccelerator (and one MixedPrecision) per model."
                    )
            for i in opts:
                if not any(_inner_optimizer(items[i]) is o for o in prec.optimizers):
                    raise ValueError(
                        "MixprecAccelerator.prepare: this optimizer was not prepared with the model; pass the model and "
                        "all its optimizers to one accelerator.prepare(model, optimizer, ...) call."
                    )
        return super().prepare(*items, device_placement=device_placement)  # type: ignore[misc]

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """Wrap an optimizer ``prec`` prepared in an ``AcceleratedOptimizer`` that reports mixprec's skips."""
        acc: Any = self
        if getattr(optimizer, "_is_accelerate_prepared", False):
            if optimizer not in acc._optimizers:
                acc._optimizers.append(optimizer)
            return optimizer
        if not any(optimizer is o for o in self.prec.optimizers):
            raise ValueError(
                "MixprecAccelerator.prepare_optimizer: this optimizer was not prepared by mixprec, so its step would "
                "bypass it; pass the model and its optimizer(s) together: accelerator.prepare(model, optimizer, ...)."
            )
        # No device placement (a state_dict round trip): the model went to the device before prec.prepare, so
        # the masters and states are there, and a round trip would replace the param_group dicts that a
        # converted optimizer (bf16-pure) shares with the one an LR scheduler was built on.
        wrapped = _accelerated_optimizer_class()(optimizer, self.prec, device_placement=False)
        acc._optimizers.append(wrapped)
        return wrapped

    # ----- the step --------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``prec.backward(loss / gradient_accumulation_steps)``: the loss is scaled when the policy scales."""
        acc: Any = self
        if "learning_rate" in kwargs:
            raise ValueError("MixprecAccelerator.backward: LOMO optimizers (learning_rate=) are not supported by mixprec.")
        steps = acc.gradient_accumulation_steps
        if steps != 1:
            loss = loss / steps
        self.prec.backward(loss, **kwargs)

    def autocast(self, autocast_handler: Any = None) -> Any:
        """``prec.autocast()``: the policy's compute dtype (``autocast_handler`` is not used)."""
        return self.prec.autocast()

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """``prec.unscale_`` on the given prepared optimizer(s), all of them by default (no host sync)."""
        if optimizer is None:
            opts = list(self.prec.optimizers)
        else:
            opts = [_inner_optimizer(o) for o in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])]
        for opt in opts:
            self.prec.unscale_(opt)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """The true (unscaled, FP32 master) gradient norm, clipped to ``max_norm``; no host sync.

        All the prepared parameters (``model.parameters()``): ``prec.clip_grad_norm_``. A subset:
        ``prec.unscale_`` of the optimizers that hold them first, then torch's ``clip_grad_norm_``
        on it (under ``*-master`` the gradients are views of the FP32 master gradients).
        """
        params = list(parameters)
        given = {id(p) for p in params}
        prepared = [p for opt in self.prec.optimizers for p in model_params_of(opt)]
        if prepared and all(id(p) in given for p in prepared):
            return self.prec.clip_grad_norm_(max_norm, norm_type)
        # only the optimizers that hold some of them: another may have stepped already (an actor-critic loop that
        # clips and steps each optimizer in turn), and unscaling it again was refused
        self.unscale_gradients([o for o in self.prec.optimizers if any(id(p) in given for p in model_params_of(o))]
                               or None)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)


@functools.cache
def _accelerated_optimizer_class() -> type:
    accelerate = _import_accelerate()

    class MixprecAcceleratedOptimizer(accelerate.optimizer.AcceleratedOptimizer):  # type: ignore[name-defined]
        """Accelerate's optimizer wrapper around an optimizer ``prec`` prepared: ``step_was_skipped`` is mixprec's."""

        def __init__(self, optimizer: torch.optim.Optimizer, prec: MixedPrecision, device_placement: bool = True) -> None:
            super().__init__(optimizer, device_placement=device_placement, scaler=None)
            self._mixprec = prec
            self._mixprec_skipped: torch.Tensor | None = None

        def step(self, closure: Callable[[], Any] | None = None) -> None:
            """The wrapped optimizer's ``step()``, which is ``prec.step(optimizer)`` (a no-op while accumulating)."""
            before = self._mixprec.last_step
            self._mixprec_skipped = None
            super().step(closure)
            info = self._mixprec.last_step
            if info is not None and info is not before:
                self._mixprec_skipped = info.skipped

        @property
        def step_was_skipped(self) -> bool:
            """Whether mixprec skipped the last step (inf/NaN gradients). Host sync: reads the 0-d flag."""
            return self._mixprec_skipped is not None and bool(self._mixprec_skipped.item())

    return MixprecAcceleratedOptimizer


@functools.cache
def _accelerator_class() -> type:
    accelerate = _import_accelerate()

    class MixprecAccelerator(_MixprecAcceleratorMixin, accelerate.Accelerator):  # type: ignore[name-defined]
        """An ``accelerate.Accelerator`` that trains under a mixprec policy (see ``mixprec.integrations.accelerate``).

        Args:
            precision: A mixprec preset (``"bf16-master"``), alias, grammar string, ``Policy``
                or ``MixedPrecision``; kept as ``accelerator.prec``.
            **kwargs: ``accelerate.Accelerator``'s arguments; ``mixed_precision`` must be ``"no"``.

        Raises:
            ValueError: Accelerate's own mixed precision, or a distributed setup (see the module docstring).
        """

        def __init__(self, precision: MixedPrecision | Policy | str, **kwargs: Any) -> None:
            prec = as_mixed_precision(precision)
            mixed = kwargs.get("mixed_precision")
            if mixed not in (None, "no"):
                check_accelerator(_Stub(mixed), prec, where=f"MixprecAccelerator(mixed_precision={mixed!r})")
            self.prec = prec
            super().__init__(**kwargs)
            check_accelerator(self, prec)

    return MixprecAccelerator


class _Stub:
    """Only what ``check_accelerator`` reads, for a refusal before ``Accelerator.__init__`` changes global state."""

    def __init__(self, mixed_precision: str) -> None:
        self.mixed_precision = mixed_precision


def attach(accelerator: Any, precision: MixedPrecision | Policy | str) -> Any:
    """Turn an ``accelerate.Accelerator`` that was built elsewhere (``transformers.Trainer``'s) into a ``MixprecAccelerator``.

    Nothing may have been prepared on it yet. The object keeps its identity and state; its class
    becomes ``MixprecAccelerator``, so its ``prepare``/``backward``/``clip_grad_norm_`` are mixprec's.

    Returns:
        ``accelerator`` itself.

    Raises:
        ValueError: Accelerate's own mixed precision, a distributed setup, or models/optimizers
            already prepared on it.
    """
    cls: Any = _accelerator_class()
    prec = as_mixed_precision(precision)
    if isinstance(accelerator, cls):
        if accelerator.prec is not prec:
            raise ValueError("attach: this accelerator already runs another MixedPrecision.")
        return accelerator
    accelerate = _import_accelerate()
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(f"attach needs an accelerate.Accelerator, got {type(accelerator).__name__}")
    check_accelerator(accelerator, prec, where=f"attach({type(accelerator).__name__})")
    if accelerator._models or accelerator._optimizers:
        raise ValueError(
            "attach: the accelerator already prepared a model or optimizer outside mixprec; attach before prepare()."
        )
    accelerator.prec = prec
    accelerator.__class__ = cls  # same layout: a subclass that adds methods only
    return accelerator


def __getattr__(name: str) -> Any:
    # MixprecAccelerator subclasses accelerate.Accelerator, so it is built on first use (lazy import).
    if name == "MixprecAccelerator":
        return _accelerator_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
