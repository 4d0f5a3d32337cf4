"""``mixprec.GradScaler``: a drop-in replacement for ``torch.amp.GradScaler``.

Change one import::

    scaler = mixprec.GradScaler("cuda")          # was torch.amp.GradScaler("cuda")
    ...
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                   # optional, e.g. before clipping
    scaler.step(optimizer)
    scaler.update()

Same API, same errors for misuse, same scale sequence and the same parameters bit for bit,
and ``state_dict`` interoperates both ways. Beyond torch (all optional, off by default so the
behaviour is torch's): hysteresis, a floor and a ceiling, escalation of persistent overflow to
:class:`mixprec.NumericsError`, rate-limited overflow logging, statistics, ``found_inf``
agreement across ranks, and a ``step`` result that says whether the step was skipped without a
host sync.
"""

from __future__ import annotations

import enum
import inspect
import warnings
from collections import abc, defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ._finite import _group, _unscale_groups
from ._scaler import (
    DEFAULT_CHECK_INTERVAL,
    DEFAULT_HISTORY,
    DEFAULT_PATIENCE,
    STATE_VERSION,
    OnFailure,
    Refill,
    ScalerStateError,
    _check_state_dict,
    _Config,
    _Core,
)
from ._stepping import step_with_result
from .distributed import agree_found_inf_

__all__ = ["GradScaler", "OptState"]


class OptState(enum.Enum):
    """Where an optimizer is in the current iteration (the names torch.amp uses)."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_optimizer_state() -> dict[str, Any]:
    # module level (not a lambda) so a GradScaler with a defaultdict of these pickles
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class ScalerUsageError(RuntimeError, AssertionError):
    """Misuse of GradScaler's call order. Also an ``AssertionError``, which torch.amp raises for some of these."""


class ScalerValueError(ValueError, AssertionError):
    """A bad constructor value. Also an ``AssertionError``, which torch.amp raises for the factors."""


_STEP_TAKES_GRAD_SCALER: dict[Any, bool] = {}


def _takes_grad_scaler_kwarg(optimizer: Any) -> bool:
    step = optimizer.step
    key = getattr(step, "__func__", step)
    found = _STEP_TAKES_GRAD_SCALER.get(key)
    if found is None:
        found = _STEP_TAKES_GRAD_SCALER[key] = "grad_scaler" in inspect.signature(step).parameters
    return found


class GradScaler:
    """Drop-in replacement for ``torch.amp.GradScaler``, with on-device extras.

    Behaviour with the default arguments is torch's: the scale is multiplied by
    ``backoff_factor`` on every iteration with inf/NaN gradients and by ``growth_factor`` on the
    ``growth_interval``-th consecutive clean one (never to a non-finite value), computed by the
    same fused kernel; ``step`` skips ``optimizer.step()`` on inf/NaN gradients, on the device for
    optimizers with ``_step_supports_amp_scaling`` (torch's ``fused=True`` optimizers get
    ``grad_scale``/``found_inf`` and unscale in their kernel) and with one host read otherwise.

    Args:
        device: Device type, ``"cuda"`` (default; disabled with a warning when CUDA is not
            available, as torch does), ``"cpu"``, ...
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: As ``torch.amp.GradScaler``.
        hysteresis: Overflows tolerated (scale kept) before backing off, plus one (1 = torch).
        min_scale, max_scale: Floor and ceiling of the scale (``None`` = torch: none).
        refill: ``"growth"`` or ``"clean"``: when the hysteresis allowance refills.
        on_failure: ``"ignore"`` (default, torch), ``"warn"`` or ``"raise"`` (:class:`mixprec.NumericsError`)
            when the scale sits at ``min_scale`` and ``patience`` consecutive iterations overflow.
            Checked every ``check_interval`` updates (one small host read, asynchronous on CUDA).
        patience, check_interval: See ``on_failure``.
        log_overflow: Log overflows on the ``mixprec.scaler`` logger (off by default).
        history: Length of the scale history kept on the device.
        process_group: Group over which ``found_inf`` is all-reduced (MAX) when
            ``torch.distributed`` is initialised (default: world), so every rank skips the same steps.
        agree_across_ranks: Set ``False`` to skip that all-reduce (torch's behaviour).

    ``state_dict`` keys: torch's ``scale``, ``growth_factor``, ``backoff_factor``,
    ``growth_interval``, ``_growth_tracker`` (so a checkpoint loads into ``torch.amp.GradScaler``,
    which ignores the rest), plus ``version``, ``kind`` (``"dynamic"``), ``hysteresis``,
    ``hysteresis_left``, ``min_scale``, ``max_scale``, ``refill`` and the statistics
    (``steps``, ``skipped_steps``, ``consecutive_skips``, ``last_overflow_step``,
    ``last_finite_step``, ``floor_streak``, ``scale_history``, ``overflow_history``), which are
    optional when loading (a torch checkpoint loads into ours). A disabled scaler returns ``{}``.

    Host syncs: ``get_scale``, ``state_dict``, ``statistics``, pickling, ``step`` for an
    optimizer without ``_step_supports_amp_scaling`` (one read of ``found_inf``, as torch), and
    the periodic check when ``on_failure``/``log_overflow`` are on. ``scale``, ``unscale_``,
    ``update`` and the fused-optimizer ``step`` do not sync.

    Example:
        >>> import torch, mixprec
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = mixprec.GradScaler("cpu", init_scale=1024.0)
        >>> scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        >>> skipped = scaler.step(opt)
        >>> scaler.update()
        >>> bool(skipped), scaler.get_scale()
        (False, 1024.0)
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        refill: Refill = "growth",
        on_failure: OnFailure = "ignore",
        patience: int = DEFAULT_PATIENCE,
        check_interval: int = DEFAULT_CHECK_INTERVAL,
        log_overflow: bool = False,
        log_interval_s: float = 5.0,
        history: int = DEFAULT_HISTORY,
        process_group: Any = None,
        agree_across_ranks: bool = True,
    ) -> None:
        if isinstance(device, torch.device):
            device = device.type
        self._device = device
        self._enabled = bool(enabled)
        if self._device == "cuda" and self._enabled and not torch.cuda.is_available():
            warnings.warn("mixprec.GradScaler(device='cuda') is enabled, but CUDA is not available. Disabling. "
                          "Pass device='cpu' to scale on the CPU.", stacklevel=2)
            self._enabled = False
        self.process_group = process_group
        self.agree_across_ranks = agree_across_ranks
        self._per_optimizer_states: defaultdict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)
        self._core: _Core | None = None
        if not self._enabled:
            return
        # torch.amp raises AssertionError for these two; ours is a ValueError that is also one.
        if isinstance(growth_factor, (int, float)) and not isinstance(growth_factor, bool) and growth_factor <= 1.0:
            raise ScalerValueError(f"The growth factor must be > 1.0. Got growth_factor={growth_factor!r}; torch's default is 2.0.")
        if isinstance(backoff_factor, (int, float)) and not isinstance(backoff_factor, bool) and backoff_factor >= 1.0:
            raise ScalerValueError(f"The backoff factor must be < 1.0. Got backoff_factor={backoff_factor!r}; torch's default is 0.5.")
        cfg = _Config(kind="dynamic", init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                      growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale,
                      max_scale=max_scale, refill=refill, on_failure=on_failure, patience=patience,
                      check_interval=check_interval, log_overflow=log_overflow, log_interval_s=log_interval_s,
                      history=history)
        try:
            cfg.validate("GradScaler")
        except ValueError as e:
            raise ScalerValueError(str(e)) from None
        self._core = _Core(cfg)

    # ----- torch-compatible private surface (read by Lightning, accelerate, mixprec.numerics) ------
    @property
    def _scale(self) -> Tensor | None:
        """The scale tensor, or ``None`` before the first :meth:`scale` (as torch)."""
        return self._core.scale if self._core is not None else None

    @property
    def _growth_tracker(self) -> Tensor | None:
        return self._core.growth_tracker if self._core is not None else None

    @property
    def _init_scale(self) -> float:
        return self._core.cfg.init_scale if self._core is not None else 1.0

    def _get_scale_async(self) -> Tensor | None:
        return self._scale

    def _require_core(self, funcname: str) -> _Core:
        core = self._core
        if core is None or not core.materialised:
            raise ScalerUsageError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script did not use "
                "scaler.scale(loss or outputs) earlier in the iteration.")
        return core

    # ----- scale -----------------------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or every tensor of an iterable of tensors (lists/tuples/dicts, nested), by the scale.

        Returns ``outputs`` unchanged when disabled. The first call creates the scale on the
        output's device (as torch). No host sync.

        Raises:
            ValueError: a leaf that is not a tensor ("outputs must be a Tensor or an iterable of Tensors").
        """
        if not self._enabled:
            return outputs
        core = self._core
        assert core is not None
        if isinstance(outputs, Tensor):
            scale = core.scale
            if scale is None or not core.bound:
                scale = core.ensure(outputs.device)
            return outputs * scale.to(device=outputs.device, non_blocking=True)
        per_device: dict[torch.device, Tensor] = {}

        def apply(val: Any) -> Any:
            if isinstance(val, Tensor):
                s = per_device.get(val.device)
                if s is None:
                    base = core.ensure(val.device)
                    s = per_device[val.device] = base.to(device=val.device, non_blocking=True)
                return val * s
            if isinstance(val, Mapping):
                return type(val)({k: apply(v) for k, v in val.items()})  # type: ignore[call-arg]
            if isinstance(val, abc.Iterable) and not isinstance(val, (str, bytes)):
                it = map(apply, val)
                if isinstance(val, tuple) and hasattr(val, "_fields"):
                    return type(val)(*it)
                if isinstance(val, (list, tuple)):
                    return type(val)(it)
                return it
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    # ----- unscale ---------------------------------------------------------------------------------
    def _grads_of(self, optimizer: Any) -> list[Tensor]:
        # hot path: one comprehension, no per-parameter checks beyond "has a gradient"
        grads = [g for group in optimizer.param_groups for p in group["params"] if (g := p.grad) is not None]
        if any(g.is_sparse for g in grads):
            grads = []
            for group in optimizer.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is None:
                        continue
                    if g.is_sparse:
                        if g.dtype is torch.float16:
                            g = p.grad = g.coalesce()  # summing duplicate indices can overflow: check the sum
                        g = g._values()
                    grads.append(g)
        return grads

    def _check_grads(self, optimizer: Any, inv_scale: Tensor | None, allow_fp16: bool) -> dict[torch.device, Tensor]:
        core = self._core
        assert core is not None and core.scale is not None
        groups = _group(self._grads_of(optimizer))
        if not allow_fp16 and any(dtype == torch.float16 for _dev, dtype in groups):
            raise ValueError(
                "Attempting to unscale FP16 gradients. GradScaler expects FP32 parameters (FP16 only in "
                "autocast); for FP16 parameters use mixprec.MixedPrecision('fp16-master') or "
                "mixprec.DynamicScaler, whose unscale_ accepts FP16 gradients.")
        found_inf = torch.zeros((), dtype=torch.float32, device=core.scale.device)
        _unscale_groups(groups, inv_scale, found_inf)
        if self.agree_across_ranks:
            agree_found_inf_(found_inf, self.process_group)
        return {found_inf.device: found_inf}

    def unscale_(self, optimizer: Any) -> Tensor | None:
        """Divide this optimizer's gradients in place by the scale and check them for inf/NaN.

        Once per optimizer per iteration, after all its gradients were accumulated (as torch).
        One fused kernel per (device, dtype) group; ``1/scale`` computed in float64. No host sync.

        Returns:
            ``found_inf`` (0-d float32, 1.0 when a gradient is inf/NaN); ``None`` when disabled.
            (torch returns ``None``.)

        Raises:
            RuntimeError: called twice for the optimizer since the last ``update()``, or after ``step()``.
            ValueError: FP16 gradients (as torch).
        """
        if not self._enabled:
            return None
        core = self._require_core("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise ScalerUsageError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise ScalerUsageError("unscale_() is being called after step().")
        state["found_inf_per_device"] = self._check_grads(optimizer, core.inv_scale(), allow_fp16=False)
        state["stage"] = OptState.UNSCALED
        return next(iter(state["found_inf_per_device"].values()))

    # legacy protocol: optimizers whose step() takes ``grad_scaler`` call these (as with torch.amp)
    def _check_inf_per_device(self, optimizer: Any) -> dict[torch.device, Tensor]:
        self._require_core("_check_inf_per_device")
        found = self._check_grads(optimizer, None, allow_fp16=True)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    def _found_inf_per_device(self, optimizer: Any) -> dict[torch.device, Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]  # type: ignore[no-any-return]

    # ----- step ------------------------------------------------------------------------------------
    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done) and call ``optimizer.step(*args, **kwargs)`` unless gradients are inf/NaN.

        Returns:
            What ``optimizer.step`` returned when that is not ``None`` (as torch); otherwise a 0-d
            bool tensor ``skipped`` on the scale's device (no host sync to produce it). Disabled:
            ``optimizer.step(...)``'s result.

        Raises:
            RuntimeError: ``closure`` given (unsupported, as torch), or ``step()`` twice for the
                optimizer since the last ``update()``; or no ``scale()`` in this iteration.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise ScalerUsageError("Closure use is not currently supported if GradScaler is enabled.")
        core = self._require_core("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise ScalerUsageError("step() has already been called since the last update().")
        scale = core.scale
        assert scale is not None
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if _takes_grad_scaler_kwarg(optimizer):  # the deprecated protocol, as torch still honours it
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the passed optimizer. In the "
                    "near future GradScaler registers `grad_scale: Tensor` and `found_inf: Tensor` to the passed "
                    "optimizer and let the optimizer use them directly.", FutureWarning, stacklevel=2)
                ret = optimizer.step(*args, **{**kwargs, "grad_scaler": self})
                state["stage"] = OptState.STEPPED
                flags = list(state["found_inf_per_device"].values())
                return ret if ret is not None or not flags else _combine(flags, scale.device) > 0
            if state["stage"] is OptState.READY:
                state["found_inf_per_device"] = self._check_grads(optimizer, None, allow_fp16=True)
            found_inf = _combine(list(state["found_inf_per_device"].values()), scale.device)
            existing = getattr(optimizer, "grad_scale", None)
            if state["stage"] is OptState.UNSCALED:
                grad_scale = existing  # already unscaled: only a scale the user set remains
            else:
                grad_scale = scale if existing is None else scale * existing
            optimizer.grad_scale = grad_scale
            optimizer.found_inf = found_inf
            try:
                ret = optimizer.step(*args, **kwargs)
            finally:
                for name in ("grad_scale", "found_inf"):
                    if hasattr(optimizer, name):
                        delattr(optimizer, name)
            state["stage"] = OptState.STEPPED
            return ret if ret is not None else found_inf > 0
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        flags = list(state["found_inf_per_device"].values())
        if not flags:
            raise ScalerUsageError("No inf checks were recorded for this optimizer.")
        skipped, ret = step_with_result(optimizer, _combine(flags, scale.device), None, args, kwargs)
        state["stage"] = OptState.STEPPED
        return ret if ret is not None else skipped

    # ----- update ----------------------------------------------------------------------------------
    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Update the scale from this iteration's inf checks (or set it to ``new_scale``). No host sync.

        Call it once per iteration, after ``step`` for every optimizer. With hysteresis, floor
        and ceiling configured they apply (``new_scale`` is clamped into [min_scale, max_scale]).

        Raises:
            RuntimeError/AssertionError: no ``scale()`` yet, or no inf checks recorded (no ``step``/``unscale_``);
                a ``new_scale`` tensor on another device type, with more than one element, or requiring grad.
        """
        if not self._enabled:
            return
        core = self._core
        scale = core.scale if core is not None else None
        if scale is None:
            core = self._require_core("update")  # raises
            scale = core.scale
        assert core is not None and scale is not None
        flags = [f for st in self._per_optimizer_states.values() for f in st["found_inf_per_device"].values()]
        if new_scale is not None:
            if isinstance(new_scale, Tensor):
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor "
                          "with requires_grad=False.")
                if new_scale.device.type != self._device or new_scale.numel() != 1 or new_scale.requires_grad:
                    raise ScalerUsageError(reason + f" Got a tensor of shape {tuple(new_scale.shape)} on "
                                           f"{new_scale.device} (requires_grad={new_scale.requires_grad}).")
                scale.copy_(new_scale.reshape(()))
            else:
                scale.fill_(float(new_scale))
            cfg = core.cfg
            if cfg.min_scale is not None or cfg.max_scale is not None:
                scale.clamp_(min=cfg.min_scale, max=cfg.max_scale)
            if flags:  # keep the statistics: the iteration happened, the rule did not run
                core.update(_combine(flags, scale.device), decide=False)
        else:
            if not flags:
                raise ScalerUsageError("No inf checks were recorded prior to update.")
            core.update(_combine(flags, scale.device))
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    # ----- getters and setters ---------------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale as a Python float (``init_scale`` before the first ``scale``; 1.0 disabled). Host sync."""
        if not self._enabled:
            return 1.0
        assert self._core is not None
        s = self._core.scale
        return self._core.cfg.init_scale if s is None else float(s.item())

    def get_growth_factor(self) -> float:
        return self._core.cfg.growth_factor if self._core is not None else 2.0

    def set_growth_factor(self, new_factor: float) -> None:
        if self._core is not None:
            self._core.cfg.growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        return self._core.cfg.backoff_factor if self._core is not None else 0.5

    def set_backoff_factor(self, new_factor: float) -> None:
        if self._core is not None:
            self._core.cfg.backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        return self._core.cfg.growth_interval if self._core is not None else 2000

    def set_growth_interval(self, new_interval: int) -> None:
        if self._core is not None:
            self._core.cfg.growth_interval = new_interval

    def _get_growth_tracker(self) -> int:
        if self._core is None:
            return 0
        t = self._core.growth_tracker
        return int(self._core.state()["_growth_tracker"]) if t is None else int(t.item())

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self._enabled

    def statistics(self) -> dict[str, Any]:
        """Statistics as :meth:`mixprec.DynamicScaler.statistics` (host sync); ``{}`` when disabled."""
        if self._core is None:
            return {}
        return self._core.statistics()

    # ----- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state (keys in the class docstring) as Python values; ``{}`` when disabled. Host sync.

        As with torch, call it after :meth:`update` to checkpoint a finished iteration.
        """
        if self._core is None:
            return {}
        return {"version": STATE_VERSION, "kind": "dynamic", **self._core.state()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from ``state_dict()`` here or from ``torch.amp.GradScaler``. No-op when disabled.

        Raises:
            RuntimeError: an empty dict ("The source state dict is empty, possibly because it was
                saved from a disabled instance of GradScaler."), a foreign or newer one.
        """
        if self._core is None:
            return
        if isinstance(state_dict, Mapping) and len(state_dict) == 0:
            raise ScalerStateError("The source state dict is empty, possibly because it was saved from a disabled "
                                   "instance of GradScaler.")
        self._core.load(_check_state_dict(state_dict, "GradScaler", "dynamic"))

    def __getstate__(self) -> dict[str, Any]:
        if self._enabled and len(self._per_optimizer_states) != 0:
            raise ScalerUsageError("A GradScaler instance may only be pickled at the beginning of an iteration, or at "
                                   "the end after scaler.update().")
        state = self.__dict__.copy()
        state["_per_optimizer_states"] = defaultdict(_fresh_optimizer_state)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        if self._core is None:
            return f"GradScaler(device={self._device!r}, enabled=False)"
        c = self._core.cfg
        return (f"GradScaler(device={self._device!r}, init_scale={c.init_scale:g}, growth_factor={c.growth_factor:g}, "
                f"backoff_factor={c.backoff_factor:g}, growth_interval={c.growth_interval}, hysteresis={c.hysteresis}, "
                f"min_scale={c.min_scale}, max_scale={c.max_scale})")


def _combine(flags: list[Tensor], device: torch.device) -> Tensor:
    """One found_inf on ``device`` from several (non-zero when any is)."""
    first = flags[0] if flags[0].device == device else flags[0].to(device, non_blocking=True)
    if len(flags) == 1:
        return first
    total = first.clone()
    for f in flags[1:]:
        total += f.to(device, non_blocking=True)
    return total
