"""``mixprec.GradScaler``: a drop-in replacement for ``torch.amp.GradScaler``.

Change one import::

    scaler = mixprec.GradScaler("cuda")          # was torch.amp.GradScaler("cuda")
    ...
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                   # optional, e.g. before clipping
    scaler.step(optimizer)
    scaler.update()

Same API, same errors for misuse (torch's exception type, or a subclass of it, and torch's
message), same scale sequence and the same parameters bit for bit, and ``state_dict`` has
exactly torch's keys and value types, so checkpoints interoperate both ways. Beyond torch (all
optional, off by default so the behaviour is torch's): hysteresis, a floor and a ceiling,
escalation of persistent overflow to :class:`mixprec.NumericsError`, rate-limited overflow
logging, statistics (``state_dict(extended=True)`` saves them), ``found_inf`` agreement across
ranks, and a ``step`` result that says whether the step was skipped without a host sync.

Where this deliberately differs from torch 2.13 (each is a case where torch raises by accident,
returns ``None``, or silently misbehaves):

* ``unscale_`` returns the ``found_inf`` flag and ``step`` returns a 0-d bool tensor
  ``skipped`` where torch returns ``None``.
* A scaler pickled between ``scale()`` and ``step()`` (torch allows it) can step in the copy;
  torch's copy raises "Attempted step but _scale is None".
* The constructor also rejects values that make torch's scaling silently degenerate
  (``init_scale`` not finite and > 0, ``backoff_factor <= 0``, ``growth_interval < 1``).
* ``update(new_scale)`` accepts an ``int`` and a tensor of shape ``(1,)`` (torch's documented
  "1-element" tensor); torch raises ``AttributeError`` / a broadcast ``RuntimeError``.
* ``scale`` rebuilds dicts and namedtuples (torch returns a lazy ``map`` of a dict's keys and
  raises ``TypeError`` for a namedtuple) and rejects ``str``/``bytes`` leaves.
* Disabled, the getters return the constructor's values (torch raises ``AttributeError``).
* ``_found_inf_per_device`` holds one flag on the scale's device (torch: one per gradient
  device), the flag that is all-reduced across ranks.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections import abc, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, overload

import torch
from torch import Tensor

# torch's own enum, so code that compares a stage with torch.amp.grad_scaler.OptState works on ours
from torch.amp.grad_scaler import OptState

from ._dist import FoundInfJoinHook, JoinState, agree_found_inf_, join_group
from ._errors import eager_only
from ._finite import combine_found_inf, group_by_device_and_dtype, unscale_groups
from ._scaler import (
    DEFAULT_CHECK_INTERVAL,
    DEFAULT_HISTORY,
    DEFAULT_PATIENCE,
    STATE_VERSION,
    OnFailure,
    Refill,
    ScaleConfig,
    ScaleCore,
    ScalerStateError,
    _dist_initialized,
    check_loaded_counters,
    check_loaded_scale,
    check_scaler_state,
)
from ._stepping import step_with_result

__all__ = ["GradScaler", "OptState"]

#: ``torch.amp.GradScaler.state_dict()``'s keys, in its order.
TORCH_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
# configuration keys of an extended state dict: the first three are torch's, the rest mixprec's
_TORCH_RULE_KEYS = ("growth_factor", "backoff_factor", "growth_interval")
_EXTRA_RULE_KEYS = ("hysteresis", "min_scale", "max_scale", "refill")
_CONFIG_KEYS = _TORCH_RULE_KEYS + _EXTRA_RULE_KEYS


def _fresh_optimizer_state() -> dict[str, Any]:
    # module level (not a lambda) so a GradScaler with a defaultdict of these pickles
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class ScalerUsageError(RuntimeError, AssertionError):
    """Misuse of GradScaler's call order.

    torch.amp raises ``RuntimeError`` for some of these and ``AssertionError`` for others; this is
    both, so ``except`` clauses written for torch catch it.
    """


class ScalerValueError(ValueError, AssertionError):
    """A bad constructor value. Also an ``AssertionError``, which torch.amp raises for the factors."""


class ScalerStateKeyError(ScalerStateError, KeyError):
    """A state dict without torch's keys. Also a ``KeyError``, which torch.amp raises for it."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""  # KeyError would quote the message


class ScalerStateTypeError(ScalerStateError, TypeError):
    """A state dict that is not a mapping. Also a ``TypeError``, which torch.amp raises for it."""


_FP16_GRADS = ("Attempting to unscale FP16 gradients. GradScaler expects FP32 parameters (FP16 only in autocast); "
               "for FP16 parameters use mixprec.MixedPrecision('fp16-master') or mixprec.DynamicScaler, whose "
               "unscale_ accepts FP16 gradients.")

_STEP_TAKES_GRAD_SCALER: dict[Any, bool] = {}


def _check_new_scale(value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` (``update(new_scale)``) is a finite number > 0."""
    try:
        ok = math.isfinite(value) and value > 0
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(
            f"update(new_scale={value!r}): the new scale must be a finite number > 0 (NaN or inf would skip every "
            "later step, 0 or less would flush every gradient); pass e.g. 2.0**16, or None for the dynamic rule. "
            "Nothing was changed."
        )


def _takes_grad_scaler_kwarg(optimizer: Any) -> bool:
    step = optimizer.step
    key = getattr(step, "__func__", step)
    # torch's LR schedulers wrap each optimizer's step in a function of its own: key by what it wraps,
    # or the cache would grow by one entry per optimizer for good
    while hasattr(key, "__wrapped__"):
        key = getattr(key.__wrapped__, "__func__", key.__wrapped__)
    found = _STEP_TAKES_GRAD_SCALER.get(key)
    if found is None:
        found = _STEP_TAKES_GRAD_SCALER[key] = "grad_scaler" in inspect.signature(step).parameters
    return found


@eager_only(
    "mixprec.GradScaler.update runs eagerly behind one graph break (its statistics are Python state): keep it outside torch.compile(fullgraph=True)"
)
def _update_outside_trace(scaler: GradScaler, new_scale: float | Tensor | None) -> None:
    """``GradScaler.update`` reached from a traced frame: eagerly, behind a graph break.

    Traced, dynamo guarded on the scale history's Python step count and pending list, which
    change every step: a recompile per step until the recompile limit.
    """
    scaler.update(new_scale)


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
            available, as torch does), ``"cpu"``, ... A ``torch.device`` is taken by its type.
        init_scale: Initial scale (2**16). Finite and > 0.
        growth_factor: Multiplier on growth (> 1; torch's check, same ``AssertionError``).
        backoff_factor: Multiplier on overflow (in (0, 1); torch checks < 1).
        growth_interval: Consecutive clean iterations before growth (an int >= 1).
        enabled: ``False`` makes every method a pass-through (as torch).
        hysteresis: Overflows tolerated (scale kept) before backing off, plus one (1 = torch).
        min_scale, max_scale: Floor and ceiling of the scale (``None`` = torch: none).
        refill: ``"growth"`` or ``"clean"``: when the hysteresis allowance refills.
        on_failure: ``"ignore"`` (default, torch), ``"warn"`` or ``"raise"`` (:class:`mixprec.NumericsError`)
            when the scale sits at ``min_scale`` and ``patience`` consecutive iterations overflow.
            Checked every ``check_interval`` updates (one small host read, asynchronous on CUDA).
        patience, check_interval: See ``on_failure``.
        log_overflow: Log overflows on the ``mixprec.scaler`` logger (off by default).
        log_interval_s: Minimum seconds between two overflow log lines.
        history: Length of the scale history kept on the device.
        process_group: Group over which ``found_inf`` is all-reduced (MAX) when
            ``torch.distributed`` is initialised (default: world), so every rank skips the same steps.
        agree_across_ranks: Set ``False`` to skip that all-reduce (torch's behaviour).

    Raises:
        ValueError: (also ``AssertionError``) ``growth_factor <= 1`` or ``backoff_factor >= 1``
            (torch's messages), or another value outside the ranges above.

    ``state_dict()`` keys, exactly torch's: ``scale`` (float), ``growth_factor``,
    ``backoff_factor``, ``growth_interval``, ``_growth_tracker`` (int); ``{}`` when disabled.
    ``state_dict(extended=True)`` adds ``version``, ``kind`` (``"dynamic"``), ``hysteresis``,
    ``hysteresis_left``, ``min_scale``, ``max_scale``, ``refill`` and the statistics (``steps``,
    ``skipped_steps``, ...); save that one when hysteresis or the statistics must survive a resume.
    ``load_state_dict`` takes either (and torch's, and checkpoints of earlier mixprec versions).

    Host syncs: ``get_scale``, ``_get_growth_tracker``, ``state_dict``, ``statistics``,
    pickling, ``step`` for an optimizer without ``_step_supports_amp_scaling`` (one read of
    ``found_inf``, as torch), and the periodic check when ``on_failure``/``log_overflow`` are on.
    ``scale``, ``unscale_``, ``update`` and the fused-optimizer ``step`` do not sync.

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
        self._enabled = enabled  # kept as given: torch's is_enabled() returns it unchanged
        if self._device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn("mixprec.GradScaler(device='cuda') is enabled, but CUDA is not available. Disabling. "
                          "Pass device='cpu' to scale on the CPU.", stacklevel=2)
            self._enabled = False
        self.process_group = process_group
        self.agree_across_ranks = agree_across_ranks
        self._join = JoinState()
        self._per_optimizer_states: defaultdict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)
        # torch's lazy state: the scale and growth tracker the tensors start from (as passed, loaded or unpickled)
        self._init_scale: float = init_scale
        self._init_growth_tracker: int = 0
        # set by scale(), cleared by update(): a copy pickled in between must be able to step
        self._scaled_since_update = False
        self._resume_device: str | None = None
        cfg = ScaleConfig(kind="dynamic", init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                      growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale,
                      max_scale=max_scale, refill=refill, on_failure=on_failure, patience=patience,
                      check_interval=check_interval, log_overflow=log_overflow, log_interval_s=log_interval_s,
                      history=history)
        self._cfg = cfg  # disabled: unvalidated, only read by the getters (as torch, which checks nothing then)
        self._core: ScaleCore | None = None
        if not self._enabled:
            return
        # torch's two checks first, with its comparisons (so a str raises torch's TypeError) and its messages
        if growth_factor <= 1.0:
            raise ScalerValueError(f"The growth factor must be > 1.0. Got growth_factor={growth_factor!r}; torch's "
                                   "default is 2.0.")
        if backoff_factor >= 1.0:
            raise ScalerValueError(f"The backoff factor must be < 1.0. Got backoff_factor={backoff_factor!r}; torch's "
                                   "default is 0.5.")
        try:
            cfg.validate("GradScaler")
        except ValueError as e:
            raise ScalerValueError(str(e)) from None
        # validation normalised the numbers to float; torch keeps what was passed (its getters and state_dict return it)
        cfg.growth_factor, cfg.backoff_factor = growth_factor, backoff_factor
        self._core = ScaleCore(cfg)

    # ----- torch-compatible private surface (read by Lightning, accelerate, mixprec.numerics) ------
    @property
    def _scale(self) -> Tensor | None:
        """The scale tensor, or ``None`` before the first :meth:`scale` (as torch)."""
        return self._core.scale if self._core is not None else None

    @property
    def _growth_tracker(self) -> Tensor | None:
        """The growth tracker tensor (0-d int32), or ``None`` before the first :meth:`scale` (as torch)."""
        return self._core.growth_tracker if self._core is not None else None

    def _get_scale_async(self) -> Tensor | None:
        """The scale tensor without a host sync (``None`` before the first :meth:`scale`), as torch."""
        return self._scale

    def _require_core(self, funcname: str) -> ScaleCore:
        """The core with its tensors, or torch's error for a call before any ``scale()``."""
        core = self._core
        if core is not None and not core.materialised and self._resume_device is not None:
            # pickled between scale() and step(): the gradients carry the scale, so re-create it where it was
            self._ensure(core, torch.device(self._resume_device))
        if core is None or not core.materialised:
            raise ScalerUsageError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script did not use "
                "scaler.scale(loss or outputs) earlier in the iteration.")
        return core

    def _ensure(self, core: ScaleCore, device: torch.device) -> Tensor:
        """``core.ensure``, first taking ``_init_scale``/``_init_growth_tracker`` written directly (as torch's lazy init).

        torch creates its tensors from these two attributes; ours mirror the core's state (set by
        the constructor, ``load_state_dict`` and unpickling), so they differ only when someone wrote them.
        """
        if not core.materialised:
            state = core.state()
            if (state["scale"], state["_growth_tracker"]) != (self._init_scale, self._init_growth_tracker):
                kept = {k: v for k, v in state.items() if k not in _CONFIG_KEYS}
                core.load({**kept, "scale": self._init_scale, "_growth_tracker": self._init_growth_tracker})
        return core.ensure(device)

    # ----- scale -----------------------------------------------------------------------------------
    @overload
    def scale(self, outputs: Tensor) -> Tensor: ...

    @overload
    def scale(self, outputs: list[Tensor]) -> list[Tensor]: ...

    @overload
    def scale(self, outputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[Tensor]) -> Iterable[Tensor]: ...

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or every tensor of an iterable of tensors (nested), by the scale.

        Lists and tuples come back as the same type, dicts and namedtuples rebuilt, other
        iterables (generators, sets) as a lazy ``map`` (as torch). The first call creates the
        scale on the first tensor's device (as torch). No host sync.

        Args:
            outputs: A tensor (typically the loss) or a nested iterable of tensors.

        Returns:
            The scaled outputs; ``outputs`` itself when disabled.

        Raises:
            ValueError: a leaf that is not a tensor ("outputs must be a Tensor or an iterable of Tensors").
        """
        if not self._enabled:
            return outputs
        core = self._core
        assert core is not None  # enabled means a core was built (internal invariant)
        self._scaled_since_update = True
        if isinstance(outputs, Tensor):
            scale = core.scale
            if scale is None or not core.bound:
                scale = self._ensure(core, outputs.device)
            return outputs * scale.to(device=outputs.device, non_blocking=True)
        per_device: dict[torch.device, Tensor] = {}

        # not _tree.tree_map: torch's contract (any iterable, a lazy map for iterators, ValueError on a non-tensor)
        def apply(val: Any) -> Any:
            if isinstance(val, Tensor):
                s = per_device.get(val.device)
                if s is None:
                    base = self._ensure(core, val.device)
                    s = per_device[val.device] = base.to(device=val.device, non_blocking=True)
                return val * s
            if isinstance(val, Mapping):
                scaled = {k: apply(v) for k, v in val.items()}
                try:
                    return type(val)(scaled)  # type: ignore[call-arg]  # Mapping constructors vary; TypeError handled below
                except TypeError:  # e.g. a defaultdict, whose first argument is its factory
                    return scaled
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
    @staticmethod
    def _grads_of(optimizer: Any, allow_fp16: bool) -> list[Tensor]:
        """The optimizer's gradients to unscale (sparse ones by their values), in torch's order."""
        if getattr(optimizer, "grad_accumulation", None) == "compute" and callable(getattr(optimizer, "master_grads", None)):
            # a MasterWeightOptimizer accumulating in half precision: its FP32 gradients exist once materialised
            optimizer.master_grads()
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
                        if g.dtype is torch.float16 and allow_fp16:
                            # summing duplicate indices of scaled FP16 values can overflow: check the sum (as torch)
                            g = p.grad = g.coalesce()
                        g = g._values()
                    grads.append(g)
        return grads

    def _check_grads(self, optimizer: Any, inv_scale: Tensor | None,
                     allow_fp16: bool) -> tuple[dict[torch.device, Tensor], Tensor]:
        """Unscale (``inv_scale``; ``None``: check only) and check; return (found_inf_per_device, found_inf).

        ``found_inf_per_device`` is empty when the optimizer has no gradients (as torch, whose
        ``step``/``update`` then raise "No inf checks were recorded ...").
        """
        core = self._core
        assert core is not None and core.scale is not None  # callers ran _require_core (internal invariant)
        grads = self._grads_of(optimizer, allow_fp16)
        groups = group_by_device_and_dtype(grads) if grads else {}
        if not allow_fp16 and any(dtype == torch.float16 for _dev, dtype in groups):
            raise ValueError(_FP16_GRADS)
        found_inf = torch.zeros((), dtype=torch.float32, device=core.scale.device)
        if groups:
            unscale_groups(groups, inv_scale, found_inf)
        if self.agree_across_ranks:
            # a collective: every rank runs it, also one without gradients, so the calls stay matched
            join = self.__dict__.get("_join")
            if join is not None and (self.process_group is not None or _dist_initialized()):
                join.count("scaler")  # torch's Join (uneven inputs): counted, so a joined rank can shadow it
            agree_found_inf_(found_inf, self.process_group)
        return ({found_inf.device: found_inf} if grads else {}), found_inf

    def unscale_(self, optimizer: Any) -> Tensor | None:
        """Divide this optimizer's gradients in place by the scale and check them for inf/NaN.

        Once per optimizer per iteration, after all its gradients were accumulated (as torch).
        One fused kernel per (device, dtype) group; ``1/scale`` the correctly rounded FP32 reciprocal (torch.amp's bits). Sparse
        gradients are unscaled through their values. No host sync.

        Args:
            optimizer: The optimizer whose ``param_groups`` hold the gradients.

        Returns:
            ``found_inf`` (0-d float32, 1.0 when a gradient is inf/NaN); ``None`` when disabled.
            (torch returns ``None``.)

        Raises:
            RuntimeError: called twice for the optimizer since the last ``update()``, or after
                ``step()``; or (also ``AssertionError``) before any ``scale()``.
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
        state["found_inf_per_device"], found_inf = self._check_grads(optimizer, core.inv_scale(), allow_fp16=False)
        state["stage"] = OptState.UNSCALED
        return found_inf

    def _unscale_grads_(self, optimizer: Any, inv_scale: Tensor, found_inf: Tensor,
                        allow_fp16: bool) -> dict[torch.device, Tensor]:
        """torch.amp.GradScaler's unscale helper, for code written against it (and torch's own tests).

        Multiplies the optimizer's gradients in place by ``inv_scale`` and checks them for
        inf/NaN, as torch: FP16 sparse gradients are coalesced first, and each gradient device
        gets its own flag, a copy of ``found_inf`` (left unchanged) set to 1.0 on inf/NaN.
        Unlike :meth:`unscale_` it records nothing and does not all-reduce across ranks. No host sync.

        Args:
            optimizer: The optimizer whose ``param_groups`` hold the gradients.
            inv_scale: 1-element float32 tensor, the factor.
            found_inf: 1-element float32 tensor the per-device flags start from.
            allow_fp16: Whether FP16 gradients are accepted.

        Returns:
            ``{device: found_inf}``, one entry per device holding a gradient (``{}`` when none has one).

        Raises:
            ValueError: an FP16 gradient while ``allow_fp16`` is ``False`` (nothing unscaled then).
        """
        if not allow_fp16 and any(p.grad is not None and p.grad.dtype == torch.float16
                                  for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(_FP16_GRADS)
        grads = self._grads_of(optimizer, allow_fp16=True)
        groups = group_by_device_and_dtype(grads) if grads else {}
        per_device: dict[torch.device, Tensor] = {}
        for dev, _dtype in groups:
            if dev not in per_device:
                per_device[dev] = found_inf.to(dev, non_blocking=True, copy=True)
        for dev, flag in per_device.items():
            inv = inv_scale.to(dev, non_blocking=True).reshape(())
            # a 0-d view: the fused kernel and its fallback write through it into the flag returned
            unscale_groups({k: g for k, g in groups.items() if k[0] == dev}, inv, flag.view(()))
        return per_device

    # legacy protocol: optimizers whose step() takes ``grad_scaler`` call these (as with torch.amp)
    def _check_inf_per_device(self, optimizer: Any) -> dict[torch.device, Tensor]:
        """Check this optimizer's gradients for inf/NaN without unscaling them (FP16 allowed). No host sync.

        Args:
            optimizer: The optimizer whose gradients to check.

        Returns:
            ``{device: found_inf}`` (empty when no parameter has a gradient), also recorded for ``update``.

        Raises:
            RuntimeError: (also ``AssertionError``) before any ``scale()``.
        """
        self._require_core("_check_inf_per_device")
        found, _ = self._check_grads(optimizer, None, allow_fp16=True)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    def _found_inf_per_device(self, optimizer: Any) -> dict[torch.device, Tensor]:
        """The ``found_inf`` flags recorded for this optimizer in this iteration (``{}`` when none)."""
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    # ----- step ------------------------------------------------------------------------------------
    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done) and call ``optimizer.step(*args, **kwargs)`` unless gradients are inf/NaN.

        Optimizers with ``_step_supports_amp_scaling`` get ``optimizer.grad_scale`` (the scale,
        times a ``grad_scale`` you set; ``None`` after ``unscale_``) and ``optimizer.found_inf``
        for the call and skip on the device (no host sync); an optimizer whose ``step`` takes
        ``grad_scaler`` is passed this scaler instead (torch's deprecated protocol, with its
        ``FutureWarning``). Any other optimizer: one host read of ``found_inf`` decides.

        Args:
            optimizer: The optimizer to step.
            *args, **kwargs: Passed to ``optimizer.step``.

        Returns:
            What ``optimizer.step`` returned when that is not ``None`` (as torch); otherwise a 0-d
            bool tensor ``skipped`` on the scale's device (no host sync to produce it). Disabled:
            ``optimizer.step(...)``'s result.

        Raises:
            RuntimeError: ``closure`` given (unsupported, as torch), or ``step()`` twice for the
                optimizer since the last ``update()``; (also ``AssertionError``) no ``scale()``
                yet, or no gradients to check ("No inf checks were recorded for this optimizer.").
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
        assert scale is not None  # _require_core materialised it (internal invariant)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if _takes_grad_scaler_kwarg(optimizer):  # the deprecated protocol, as torch still honours it
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the passed optimizer. In the "
                    "near future GradScaler registers `grad_scale: Tensor` and `found_inf: Tensor` to the passed "
                    "optimizer and let the optimizer use them directly.", FutureWarning, stacklevel=2)
                ret = optimizer.step(*args, **{**kwargs, "grad_scaler": self})
                state["stage"] = OptState.STEPPED
                flags = list(state["found_inf_per_device"].values())
                return ret if ret is not None or not flags else combine_found_inf(flags, scale.device) > 0
            if state["stage"] is OptState.READY:
                self._check_inf_per_device(optimizer)
            flags = list(state["found_inf_per_device"].values())
            if not flags and state["stage"] is OptState.UNSCALED and any(
                    p.grad is not None for g in optimizer.param_groups for p in g["params"]):
                # gradients that came after an unscale_ that found none are still scaled: stepping applied them
                # (torch fails here too, by accident: an int found_inf)
                raise ScalerUsageError("No inf checks were recorded for this optimizer.")
            found_inf = combine_found_inf(flags, scale.device) if flags else torch.zeros((), dtype=torch.float32, device=scale.device)
            if state["stage"] is OptState.UNSCALED:
                grad_scale = getattr(optimizer, "grad_scale", None)  # unscaled already: only a scale you set remains
            else:
                grad_scale = scale * getattr(optimizer, "grad_scale", 1)  # torch's product with a scale you set
            # torch consumes a grad_scale/found_inf you set: removed now, step_with_result removes its own after
            for name in ("grad_scale", "found_inf"):
                optimizer.__dict__.pop(name, None)
            skipped, ret = step_with_result(optimizer, found_inf, grad_scale, args, kwargs)
            state["stage"] = OptState.STEPPED
            return ret if ret is not None else skipped
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        flags = list(state["found_inf_per_device"].values())
        if not flags:
            raise ScalerUsageError("No inf checks were recorded for this optimizer.")
        # Host sync (inside step_with_result): this optimizer cannot skip on the device.
        skipped, ret = step_with_result(optimizer, combine_found_inf(flags, scale.device), None, args, kwargs)
        state["stage"] = OptState.STEPPED
        return ret if ret is not None else skipped

    # ----- update ----------------------------------------------------------------------------------
    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Update the scale from this iteration's inf checks (or set it to ``new_scale``). No host sync.

        Call it once per iteration, after ``step`` for every optimizer. With hysteresis, floor
        and ceiling configured they apply (``new_scale`` is clamped into [min_scale, max_scale]).
        ``new_scale`` leaves the growth tracker as it is (as torch).

        Args:
            new_scale: ``None`` (the dynamic rule), a number, or a 1-element tensor on the
                scaler's device type with ``requires_grad=False`` (copied, not kept).

        Raises:
            RuntimeError: (also ``AssertionError``) no ``scale()`` yet; no inf checks recorded
                (no ``step``/``unscale_`` with gradients); a ``new_scale`` tensor on another
                device type, with more than one element, or requiring grad.
            ValueError: ``new_scale`` is not a finite number > 0 (NaN or inf would skip every
                later step; torch accepts them), checked before anything changes.

        Host sync: one read of a ``new_scale`` tensor's value (none for ``None`` or a number).
        """
        if not self._enabled:
            return
        if torch.compiler.is_compiling():  # a compiled train step around scaler.update(): see _update_outside_trace
            return _update_outside_trace(self, new_scale)
        core = self._require_core("update")
        scale = core.scale
        assert scale is not None  # _require_core materialised it (internal invariant)
        flags = [f for st in self._per_optimizer_states.values() for f in st["found_inf_per_device"].values()]
        if new_scale is not None:
            core.history.flush(scale)  # steps recorded by snapshot end at the scale before this write
            if isinstance(new_scale, Tensor):
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor "
                          "with requires_grad=False.")
                if new_scale.device.type != self._device or new_scale.numel() != 1 or new_scale.requires_grad:
                    raise ScalerUsageError(reason + f" Got a tensor of shape {tuple(new_scale.shape)} on "
                                           f"{new_scale.device} (requires_grad={new_scale.requires_grad}).")
                # Host sync: one read of the given value (a user's explicit scale, not the step path)
                _check_new_scale(float(new_scale.reshape(()).item()))
                scale.copy_(new_scale.reshape(()))
            else:
                _check_new_scale(new_scale)
                scale.fill_(new_scale)
            cfg = core.cfg
            scale.clamp_(min=cfg.floor, max=cfg.max_scale)  # (also with no floor: see ScaleConfig.floor)
            if flags:  # keep the statistics: the iteration happened, the rule did not run
                self._end_iteration()  # book-keeping first: the update may raise (escalation)
                core.update(combine_found_inf(flags, scale.device), decide=False)
        else:
            if not flags:
                raise ScalerUsageError("No inf checks were recorded prior to update.")
            found = combine_found_inf(flags, scale.device)
            # Book-keeping first: core.update may raise NumericsError (escalation) after applying the rule; the
            # iteration is over either way, so a caught error leaves a scaler the next step() can use.
            self._end_iteration()
            core.update(found)
            return
        self._end_iteration()

    def _end_iteration(self) -> None:
        """Forget the iteration's per-optimizer states (the next ``step`` starts a new one)."""
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
        self._scaled_since_update = False
        self._resume_device = None
        join = self.__dict__.get("_join")
        if join is not None and join.agrees:
            join.end_iteration()

    # ----- torch's Join (uneven inputs under DDP) ------------------------------------------------------
    def join_hook(self, **kwargs: Any) -> FoundInfJoinHook:
        """The hook ``torch.distributed.algorithms.join.Join`` calls on a rank whose inputs ran out.

        This scaler agrees on inf/NaN across ranks (an all-reduce per ``unscale_``, which torch's
        ``GradScaler`` does not have), so under ``Join`` list it after the DDP module,
        ``Join([ddp, scaler])``; the joined ranks then shadow that all-reduce. (Or build it with
        ``agree_across_ranks=False``, torch's behaviour, and list only the DDP module.)
        """
        return FoundInfJoinHook(self._join_state(), self.join_device, self.join_process_group,
                                update=self._update_while_joined)

    def _update_while_joined(self, flags: list[Tensor]) -> None:
        """On a joined rank: the scale update the other ranks' ``update()`` made (their agreed flags)."""
        core = self._core
        if core is not None and core.scale is not None:
            core.update(combine_found_inf(flags, core.scale.device))

    @property
    def join_device(self) -> torch.device:
        """The device of the flags this scaler all-reduces (for ``Join``)."""
        return torch.device(self._device if self._device != "cuda" else f"cuda:{torch.cuda.current_device()}")

    @property
    def join_process_group(self) -> Any:
        """The group this scaler agrees over (for ``Join``): ``process_group`` or the default one."""
        return join_group(self.process_group)

    @property
    def _join_config(self) -> Any:
        return self._join_state().config

    @_join_config.setter
    def _join_config(self, config: Any) -> None:
        self._join_state().config = config

    def _join_state(self) -> JoinState:
        join = self.__dict__.get("_join")
        if join is None:  # a copy pickled before Join support
            join = self.__dict__["_join"] = JoinState()
        return join

    # ----- getters and setters ---------------------------------------------------------------------
    def get_scale(self) -> float:
        """Return the current scale as a Python float. Host sync.

        Returns:
            The scale; before the first ``scale()`` the initial (or loaded) one as given; 1.0 disabled.
        """
        if not self._enabled:
            return 1.0
        scale = self._scale
        return self._init_scale if scale is None else float(scale.item())

    def get_growth_factor(self) -> float:
        """Return the growth factor (as passed or set)."""
        return self._cfg.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor used by the next ``update`` (not checked, as torch).

        Args:
            new_factor: The new growth factor.
        """
        self._cfg.growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        """Return the backoff factor (as passed or set)."""
        return self._cfg.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor used by the next ``update`` (not checked, as torch).

        Args:
            new_factor: The new backoff factor.
        """
        self._cfg.backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        """Return the growth interval (as passed or set)."""
        return self._cfg.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval used by the next ``update`` (not checked, as torch).

        Args:
            new_interval: The new growth interval.
        """
        self._cfg.growth_interval = new_interval

    def _get_growth_tracker(self) -> int:
        """Consecutive clean iterations since the last growth or overflow (host sync); 0 disabled."""
        if not self._enabled:
            return 0
        tracker = self._growth_tracker
        return self._init_growth_tracker if tracker is None else int(tracker.item())

    def is_enabled(self) -> bool:
        """Whether scaling is enabled (``enabled`` as passed, ``False`` when CUDA was missing)."""
        return self._enabled

    def statistics(self) -> dict[str, Any]:
        """Statistics as :meth:`mixprec.DynamicScaler.statistics` (host sync); ``{}`` when disabled."""
        if self._core is None:
            return {}
        return self._core.statistics()

    # ----- state -----------------------------------------------------------------------------------
    def state_dict(self, *, extended: bool = False) -> dict[str, Any]:
        """Return the state as Python values. Host sync (two reads; more with ``extended``).

        As with torch, call it after :meth:`update` to checkpoint a finished iteration.

        Args:
            extended: Add mixprec's keys (``version``, ``kind``, hysteresis, floor, ceiling,
                statistics) after torch's. Without it the dict is exactly torch's.

        Returns:
            ``{"scale": float, "growth_factor", "backoff_factor", "growth_interval",
            "_growth_tracker": int}`` (+ the extras); ``{}`` when disabled.
        """
        if not self._enabled:
            return {}
        cfg = self._cfg
        sd: dict[str, Any] = {
            "scale": self.get_scale(),
            "growth_factor": cfg.growth_factor,
            "backoff_factor": cfg.backoff_factor,
            "growth_interval": cfg.growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }
        if extended:
            assert self._core is not None  # enabled (internal invariant)
            sd["version"] = STATE_VERSION
            sd["kind"] = "dynamic"
            sd.update((k, v) for k, v in self._core.state().items() if k not in sd)
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load ``state_dict()`` output (plain or extended), torch's, or an older mixprec checkpoint.

        A no-op when disabled (as torch). Torch's keys are taken as they are (as torch); the
        extended keys restore hysteresis, floor, ceiling and statistics. A dict without them
        keeps the configured hysteresis, floor and ceiling, with a full hysteresis allowance
        and statistics from zero.

        Args:
            state_dict: The dict to load.

        Raises:
            RuntimeError: (a ``ScalerStateError``, also a ``ValueError``) an empty dict
                ("The source state dict is empty, ..." as torch), a dict of another scaler kind
                or a newer version, an invalid extended value; also a ``KeyError`` when torch's
                keys are missing, a ``TypeError`` when it is not a mapping.
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise ScalerStateError("The source state dict is empty, possibly because it was saved from a disabled "
                                   "instance of GradScaler.")
        if not isinstance(state_dict, Mapping):
            raise ScalerStateTypeError(f"GradScaler.load_state_dict needs the dict GradScaler.state_dict() returned, "
                                       f"got {type(state_dict).__name__}.")
        missing = [k for k in TORCH_STATE_KEYS if k not in state_dict]
        if missing and state_dict.get("kind") in (None, "dynamic"):
            keys = ", ".join(map(repr, list(state_dict)[:8]))
            raise ScalerStateKeyError(
                f"GradScaler: not a loss-scaler state dict (missing {', '.join(map(repr, missing))}; got keys {keys}). "
                "Pass the scaler's entry of a checkpoint (e.g. ckpt['scaler']), not the whole checkpoint.")
        check_scaler_state(state_dict, "GradScaler", "dynamic")  # another scaler kind, a newer version
        check_loaded_scale(state_dict, "GradScaler")  # a NaN or negative scale: refused before anything changes
        core, cfg = self._core, self._cfg
        check_loaded_counters(state_dict, state_dict.get("hysteresis", cfg.hysteresis) if cfg is not None else 1)
        assert core is not None  # enabled (internal invariant)
        extra = {k: state_dict[k] for k in _EXTRA_RULE_KEYS if k in state_dict}
        if extra:
            # mixprec's keys are checked as the constructor checks them; torch's are taken as they are (as torch)
            probe = dataclasses.replace(cfg, growth_factor=2.0, backoff_factor=0.5, growth_interval=1, **extra)
            try:
                probe.validate_rule("GradScaler.load_state_dict")
            except ValueError as e:
                raise ScalerStateError(str(e)) from None
            for k in extra:
                setattr(cfg, k, getattr(probe, k))
        for k in _TORCH_RULE_KEYS:
            setattr(cfg, k, state_dict[k])
        self._init_scale = cfg.clamp(state_dict["scale"])
        self._init_growth_tracker = state_dict["_growth_tracker"]
        core.load({k: v for k, v in state_dict.items() if k not in _CONFIG_KEYS})

    # ----- pickling --------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """The state for pickle/deepcopy: no tensors (re-created lazily, as torch). Host sync.

        Raises:
            RuntimeError: (also ``AssertionError``, torch's message) after ``unscale_``/``step``
                and before ``update`` (torch refuses that too); allowed at the start of an
                iteration, after ``scale()``/``backward()`` and after ``update()``.
        """
        if self._enabled and len(self._per_optimizer_states) != 0:
            raise ScalerUsageError("A GradScaler instance may only be pickled at the beginning of an iteration, or at "
                                   "the end after scaler.update().")
        state = self.__dict__.copy()
        state["_per_optimizer_states"] = defaultdict(_fresh_optimizer_state)
        core = self._core
        if core is not None:
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_core"] = None
            # the configuration travels in _cfg; everything else the core knows (tracker, hysteresis, statistics)
            state["_core_state"] = {k: v for k, v in core.state().items() if k not in _CONFIG_KEYS}
            if self._scaled_since_update and core.scale is not None:
                state["_resume_device"] = str(core.scale.device)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore :meth:`__getstate__` output (or a pickle of an earlier mixprec version)."""
        state = dict(state)
        core_state = state.pop("_core_state", None)
        self.__dict__.update(state)
        if core_state is not None:
            core = ScaleCore(self._cfg)
            core.load(core_state)
            self._core = core
        elif "_cfg" not in state:  # pickled by an earlier mixprec: the core pickled itself, tensors dropped
            old = state.get("_core")
            self._cfg = old.cfg if old is not None else ScaleConfig(kind="dynamic")
            values = old.state() if old is not None else {"scale": 1.0, "_growth_tracker": 0}
            self._init_scale, self._init_growth_tracker = float(values["scale"]), int(values["_growth_tracker"])
            self._scaled_since_update, self._resume_device = False, None

    def __repr__(self) -> str:
        """The configuration, as a constructor call."""
        c = self._cfg
        if not self._enabled:
            return f"GradScaler(device={self._device!r}, enabled=False)"
        return (f"GradScaler(device={self._device!r}, init_scale={c.init_scale:g}, growth_factor={c.growth_factor:g}, "
                f"backoff_factor={c.backoff_factor:g}, growth_interval={c.growth_interval}, hysteresis={c.hysteresis}, "
                f"min_scale={c.min_scale}, max_scale={c.max_scale})")


