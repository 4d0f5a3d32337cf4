"""Loss scaling on the device: ``LossScaler`` protocol, no-op, static and dynamic scalers.

FP16 gradients below about 6e-8 flush to zero and large ones overflow to inf. Loss scaling
multiplies the loss before backward, divides the gradients after (in place, fused with the
inf/NaN check), skips a step whose gradients are not finite and adapts the scale.

Everything per step stays on the device: the scale, the growth tracker, the hysteresis
allowance and the statistics are tensors, and :meth:`DynamicScaler.update` decides growth,
backoff, hysteresis and clamping with tensor arithmetic (no ``.item()``). Host reads happen
only where named:

* every ``check_interval`` steps, to escalate persistent overflow (every scaler: persistent
  inf/NaN at the floor, or, without a scale to lower, ``patience`` skips in a row) and to log
  overflows: one
  read of a small snapshot (on CUDA it is copied asynchronously into pinned memory and read
  one interval later, so it does not stall the stream either);
* :meth:`statistics`, :meth:`state_dict` and pickling (they return Python numbers);
* :func:`mixprec._stepping.step_or_skip` for an optimizer that cannot skip on the device
  (one read of ``found_inf``; torch's AdamW/Adam/SGD skip on the device through their fused kernel).

This module holds the configuration, the scalers and the scale algorithm; the statistics,
history and escalation bookkeeping (ring buffer, counters, periodic check, overflow log line,
the escalation messages) live in ``_scale_history.py``. ``mixprec.GradScaler`` (in
``_grad_scaler.py``) is the drop-in for ``torch.amp.GradScaler`` built on the same machinery.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Protocol, TypeVar, cast, runtime_checkable

import torch
from torch import Tensor

from ._dist import JoinState, agree_found_inf_
from ._errors import unknown_choice
from ._finite import unscale_and_check_
from ._scale_history import STATE_KEYS, ScaleHistory, fresh_statistics, loaded_statistics
from ._tree import tree_map

_dist_initialized = torch.distributed.is_initialized if torch.distributed.is_available() else (lambda: False)

__all__ = [
    "DynamicScaler",
    "LossScaler",
    "NoOpScaler",
    "StaticScaler",
]

T = TypeVar("T")
OnFailure = Literal["raise", "warn", "ignore"]
Refill = Literal["growth", "clean"]

#: Version of every scaler's ``state_dict`` format.
STATE_VERSION = 1

# Defaults, and why:
# - min_scale=1.0: DeepSpeed's ``min_loss_scale`` and Megatron-LM's ``--min-loss-scale`` default.
#   Below 1 the "scaled" gradients are smaller than the true ones, so an overflow there is not
#   a scaling problem but inf/NaN coming from the model itself (forward overflow, a bad batch).
# - max_scale=2**24: jmp's and the API's ceiling; 2**24 * 6e-8 ~ 1, so any larger scale only
#   moves already-representable gradients closer to overflow.
# - patience=20: DeepSpeed gives up at the first overflow at the floor (raise_error_at_min_scale);
#   one or two bad batches are transient, twenty consecutive overflows at scale 1 mean every
#   batch fails, and training is only burning steps.
# - check_interval=50: the check folds the ring into the counters (~30 tiny kernels) and reads a
#   9-value snapshot back (asynchronously on CUDA); every 50 steps that is < 1 kernel per step
#   (measured on an H100: every 10 steps cost ~2% of a GPT-2-small unscale step). Escalation then
#   fires at most patience + 2 * check_interval = 120 steps after the floor is reached.
DEFAULT_MIN_SCALE = 1.0
DEFAULT_MAX_SCALE = float(2**24)
DEFAULT_PATIENCE = 20
DEFAULT_CHECK_INTERVAL = 50
DEFAULT_HISTORY = 1024

_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class ScalerStateError(ValueError, RuntimeError):
    """A state dict that cannot be loaded into this scaler (empty, foreign, newer)."""


# --------------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------------
def _check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                  low_open: bool = False, high_open: bool = False, hint: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.{' ' + hint if hint else ''}")
    v = float(value)
    bad = (low is not None and (v <= low if low_open else v < low)) or (
        high is not None and (v >= high if high_open else v > high))
    if bad:
        lo = "" if low is None else (f"> {low:g}" if low_open else f">= {low:g}")
        hi = "" if high is None else (f"< {high:g}" if high_open else f"<= {high:g}")
        allowed = " and ".join(x for x in (lo, hi) if x)
        raise ValueError(f"{name} must be {allowed}, got {value!r}.{' ' + hint if hint else ''}")
    return v


#: The scale lives in a float32 tensor: the range a scale may take there, from the smallest power of two whose
#: reciprocal is finite in float32 (2**-127; torch's backoff reaches it, and its next halving gives 1/scale = inf)
#: up to float32's largest. Below it 1/scale is inf (and the scale soon 0), which turns every finite gradient into
#: inf/NaN after the inf/NaN check ran: a NaN update applied as a clean step.
F32_SCALE_RANGE = (2.0**-127, float(torch.finfo(torch.float32).max))


def _check_scale(name: str, value: float) -> float:
    lo, hi = F32_SCALE_RANGE
    if not lo <= value <= hi:
        raise ValueError(
            f"{name}={value!r} is outside [2**-127, {hi:g}], the range of a float32 loss scale (below it 1/scale is inf "
            "in float32 and the scale soon 0, which turns finite gradients into NaN after the inf/NaN check; above it "
            "float32 overflows); use a value in that range."
        )
    return value


def check_loaded_scale(sd: Mapping[str, Any], owner: str) -> None:
    """Raise ``ScalerStateError`` for a state dict whose scale no scaler can continue from (before anything is loaded).

    NaN and negative scales are damage; 0 (torch's GradScaler reaches it after ~150 overflows in a
    row, having no floor) and inf are clamped into the scaler's range by the load, as any other
    scale outside it.
    """
    if "scale" not in sd:
        return
    v = sd["scale"]
    v = float(v.item() if isinstance(v, torch.Tensor) else v)
    if math.isnan(v) or v < 0:
        raise ScalerStateError(
            f"{owner}.load_state_dict: the state's scale is {v!r}; a loss scale is >= 0 (a NaN scale would skip every "
            "step without escalating). The checkpoint is damaged: load an earlier one."
        )


def check_loaded_counters(sd: Mapping[str, Any], hysteresis: int) -> None:
    """Raise ``ScalerStateError`` for a growth tracker or hysteresis allowance no scaler can hold (before loading).

    (A growth tracker at or past ``growth_interval`` means growth at the next clean step:
    ``DynamicScaler.load_state_dict`` sets it to ``growth_interval - 1``; ``mixprec.GradScaler``
    keeps it as torch's does, where growth then waits for the next overflow's reset.)
    """
    for key, hi in (("_growth_tracker", math.inf), ("hysteresis_left", hysteresis - 1)):
        if key in sd and not is_count(sd[key], hi):
            raise ScalerStateError(f"load_state_dict: {key}={sd[key]!r}, outside [0, {hi:g}] for this scaler's "
                                   "configuration; the checkpoint is damaged or from another configuration.")


def is_count(value: Any, high: float = math.inf) -> bool:
    """Whether ``value`` (a number, a tensor or a numpy number) is a whole number in ``[0, high]`` (no bool)."""
    if not isinstance(value, (bool, int, float)) and callable(getattr(value, "item", None)):
        value = value.item()  # a tensor, a numpy number
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and float(value).is_integer()
            and 0 <= value <= high)


def check_static_scale(value: float, name: str = "loss scale") -> float:
    """A fixed loss scale, checked as ``StaticScaler`` checks it (finite, > 0, in a float32 scale's range)."""
    return _check_scale(name, _check_number(name, value, low=0.0, low_open=True))


def _check_int(name: str, value: Any, *, low: int, hint: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}.{' ' + hint if hint else ''}")
    return int(value)


@dataclasses.dataclass
class ScaleConfig:
    kind: Literal["noop", "static", "dynamic"]
    init_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None
    refill: Refill = "growth"
    on_failure: OnFailure = "ignore"
    patience: int = DEFAULT_PATIENCE
    check_interval: int = DEFAULT_CHECK_INTERVAL
    log_overflow: bool = False
    log_interval_s: float = 5.0
    history: int = DEFAULT_HISTORY

    def validate(self, owner: str) -> None:
        self.init_scale = _check_scale(f"{owner}: init_scale",
                                       _check_number(f"{owner}: init_scale", self.init_scale, low=0.0, low_open=True))
        if self.kind != "dynamic":
            self._validate_escalation(owner)
            return
        self.validate_rule(owner)
        lo = self.min_scale if self.min_scale is not None else 0.0
        hi = self.max_scale if self.max_scale is not None else math.inf
        if not lo <= self.init_scale <= hi:
            raise ValueError(f"{owner}: init_scale={self.init_scale:g} lies outside [min_scale, max_scale] = "
                             f"[{lo:g}, {hi:g}]; move init_scale inside or widen the range.")
        if self.on_failure in ("raise", "warn") and self.min_scale is None:
            raise ValueError(f"{owner}: on_failure={self.on_failure!r} needs a floor (min_scale): escalation fires "
                             "when the scale sits at min_scale and steps keep overflowing. Set min_scale (e.g. 1.0) "
                             "or on_failure='ignore'.")
        self._validate_escalation(owner)
        self.log_interval_s = _check_number(f"{owner}: log_interval_s", self.log_interval_s, low=0.0)

    def _validate_escalation(self, owner: str) -> None:
        if self.on_failure not in ("raise", "warn", "ignore"):
            raise unknown_choice(f"{owner}: on_failure", self.on_failure, ("raise", "warn", "ignore"))
        self.patience = _check_int(f"{owner}: patience", self.patience, low=1)
        self.check_interval = _check_int(f"{owner}: check_interval", self.check_interval, low=1)
        self.history = _check_int(f"{owner}: history", self.history, low=1)

    def validate_rule(self, owner: str) -> None:
        """Check the fields that shape the scale path (also run on values loaded from a state dict)."""
        self.growth_factor = _check_number(
            f"{owner}: growth_factor", self.growth_factor, low=1.0, low_open=True,
            hint="The scale is multiplied by it after growth_interval clean steps (torch, jmp, Keras: 2.0).")
        self.backoff_factor = _check_number(
            f"{owner}: backoff_factor", self.backoff_factor, low=0.0, high=1.0, low_open=True, high_open=True,
            hint="The scale is multiplied by it on overflow (torch: 0.5).")
        self.growth_interval = _check_int(f"{owner}: growth_interval", self.growth_interval, low=1,
                                          hint="It is the number of consecutive clean steps before the scale grows.")
        self.hysteresis = _check_int(f"{owner}: hysteresis", self.hysteresis, low=1,
                                     hint="1 backs off at every overflow (torch); N tolerates N-1 overflows first.")
        if self.min_scale is not None:
            lo = _check_number(f"{owner}: min_scale", self.min_scale, low=0.0, low_open=True,
                               hint="Pass None for no floor.")
            # a floor below a float32 scale's smallest is that smallest (what min_scale=None gives), as a ceiling
            # above float32's largest is none
            self.min_scale = _check_scale(f"{owner}: min_scale", max(lo, F32_SCALE_RANGE[0]))
        if self.max_scale is not None:
            hi = _check_number(f"{owner}: max_scale", self.max_scale, low=0.0, low_open=True,
                               hint="Pass None for no ceiling.")
            # a ceiling above float32's largest value is no ceiling (the scale is a float32 tensor)
            self.max_scale = _check_scale(f"{owner}: max_scale", min(hi, F32_SCALE_RANGE[1]))
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ValueError(f"{owner}: min_scale={self.min_scale:g} is above max_scale={self.max_scale:g}.")
        if self.refill not in ("growth", "clean"):
            raise unknown_choice(f"{owner}: hysteresis refill", self.refill, ("growth", "clean"))

    @property
    def floor(self) -> float:
        """The lowest scale the rule keeps: ``min_scale``, or with none a float32 scale's smallest (``F32_SCALE_RANGE``).

        With no floor ~150 backoffs in a row would reach ``1/scale = inf``, then 0 (NaN updates
        applied as clean steps); torch's GradScaler has none.
        """
        return self.min_scale if self.min_scale is not None else F32_SCALE_RANGE[0]

    def clamp(self, scale: float) -> float:
        hi = self.max_scale if self.max_scale is not None else F32_SCALE_RANGE[1]
        return min(max(scale, self.floor), hi)

    @property
    def checks(self) -> bool:
        """Whether update() reads a snapshot back every check_interval steps."""
        return self.on_failure != "ignore" or (self.kind == "dynamic" and self.log_overflow)


# --------------------------------------------------------------------------------------------------
# the device-resident state shared by every scaler (and by mixprec.GradScaler)
# --------------------------------------------------------------------------------------------------
class ScaleCore:
    """Scale, growth tracker and hysteresis allowance as tensors on one device, and their history.

    The scale rule runs here (:meth:`update`, :meth:`_decide`). What happened is recorded by
    ``self.history``, a :class:`mixprec._scale_history.ScaleHistory`: a ring buffer written
    with one kernel per step, counters folded every ``check_interval`` steps, the periodic
    check (overflow log line, escalation), statistics.
    """

    def __init__(self, config: ScaleConfig, device: torch.device | str | None = None) -> None:
        self.cfg = config
        self._dynamic = False
        self._derive_switches()
        self.explicit_device = torch.device(device) if device is not None else None
        self.bound = device is not None
        self.device = self.explicit_device
        self.scale: Tensor | None = None
        self.growth_tracker: Tensor | None = None
        self.hysteresis_left: Tensor | None = None
        self.history = ScaleHistory(config)
        self.pending_state: dict[str, Any] | None = None  # loaded before the tensors exist
        self._inv_cache: tuple[Tensor, Tensor] | None = None  # static scalers: (scale, 1/scale)

    def _derive_switches(self) -> None:
        """The per-step branches and the floor, decided off the step path (again when a loaded state changes the rule)."""
        self._dynamic = self.cfg.kind == "dynamic"
        self._lo = self.cfg.floor  # (cached off the step path: a property read is a Python call)

    @property
    def steps(self) -> int:
        """Number of :meth:`update` calls (restored by a loaded state)."""
        return self.history.steps

    # ----- materialisation -------------------------------------------------------------------------
    @property
    def materialised(self) -> bool:
        return self.scale is not None

    def ensure(self, device: torch.device | None, *, bind: bool = True) -> Tensor:
        """Create the tensors (on ``device``, the bound device, or CPU) and return the scale."""
        if self.scale is None:
            dev = self.device if self.bound else device
            self._materialise(dev if dev is not None else torch.device("cpu"))
            self.bound = self.bound or (bind and device is not None)
        elif bind and not self.bound and device is not None:
            if device != self.scale.device:  # read before first use (loss_scale, statistics): move once
                self._move(device)
            self.bound = True
        assert self.scale is not None
        return self.scale

    def _materialise(self, device: torch.device) -> None:
        cfg = self.cfg
        self.scale = torch.full((), cfg.init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.hysteresis_left = torch.full((), cfg.hysteresis - 1, dtype=torch.int32, device=device)
        self.history.materialise(device, cfg.init_scale)
        self.device = self.scale.device
        if self.pending_state is not None:
            state, self.pending_state = self.pending_state, None
            self.load(state)

    def _move(self, device: torch.device) -> None:
        for name in ("scale", "growth_tracker", "hysteresis_left"):
            setattr(self, name, getattr(self, name).to(device))
        self.history.move(device)
        self.device = device
        self._inv_cache = None

    # ----- per step --------------------------------------------------------------------------------
    def inv_scale(self) -> Tensor:
        """``1/scale`` as float32, correctly rounded: bit for bit what torch.amp's float64 round trip gives.

        torch.amp computes ``scale.double().reciprocal().float()`` (three kernels). One FP32
        ``reciprocal`` gives the same bits: IEEE division is correctly rounded, and rounding a
        quotient first to float64 and then to float32 cannot change the float32 result, because
        float64 carries more than 2 * 24 + 2 significand bits (double rounding is innocuous for
        division). Static scalers keep the result until the scale changes.
        """
        scale = self.scale
        assert scale is not None
        if self.cfg.kind == "static":
            if self._inv_cache is None or self._inv_cache[0] is not scale:
                self._inv_cache = (scale, scale.reciprocal())
            return self._inv_cache[1]
        return scale.reciprocal()

    def update(self, found_inf: Tensor, *, decide: bool = True, used: Tensor | None = None) -> None:
        """Record one step and (``decide``) apply the dynamic-scaling rule. No host sync, except the periodic check.

        Args:
            found_inf: The iteration's flag.
            decide: Apply the dynamic rule (``False``: record only).
            used: A snapshot of the scale before this update that nobody writes to later (the
                step's ``StepInfo.scale``): the history then records the step by reference,
                without a kernel (:meth:`ScaleHistory.record_snapshot`).
        """
        scale = self.scale
        if scale is None:
            scale = self.ensure(found_inf.device, bind=False)
        # the usual flag (0-d float32 on the scale's device) passes three cheap checks
        if found_inf.dtype is not torch.float32 or found_inf.dim() or found_inf.device != scale.device:
            found_inf = found_inf.to(scale.device, torch.float32, non_blocking=True).reshape(())
            used = None  # a converted flag is not the caller's tensor: record it eagerly
        history = self.history
        if used is None:
            history.flush(scale)  # steps recorded by snapshot end at the live scale, before this update
        if decide and self._dynamic:
            self._decide(found_inf)
        if used is not None:
            history.record_snapshot(used, found_inf, scale)
        else:
            # one kernel: (scale after the update, found_inf) into the ring; fold and check when due
            history.record(scale, found_inf)

    def _decide(self, found_inf: Tensor) -> None:
        """The dynamic rule (see DynamicScaler's docstring) with torch's fused update kernel at its core.

        ``torch._amp_update_scale_`` does backoff, growth on the growth_interval-th clean step and
        "no non-finite growth" in one kernel (products in float64, as torch does). Floor and ceiling
        are one clamp; hysteresis undoes the backoff while allowance is left.
        """
        cfg = self.cfg
        scale, tracker, left = self.scale, self.growth_tracker, self.hysteresis_left
        assert scale is not None and tracker is not None and left is not None
        before = scale.clone() if cfg.hysteresis > 1 else None
        torch._amp_update_scale_(scale, tracker, found_inf, cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval)
        scale.clamp_(min=self._lo, max=cfg.max_scale)
        if before is not None:
            overflow = found_inf > 0
            spend = overflow & (left > 0)
            scale.copy_(torch.where(spend, before, scale))
            # refill on growth (the tracker was reset by a clean step) or, optionally, on every clean step
            refill = ~overflow if cfg.refill == "clean" else (~overflow) & (tracker == 0)
            left.copy_(torch.where(refill, cfg.hysteresis - 1, left - spend.to(torch.int32)))

    # ----- statistics ------------------------------------------------------------------------------
    def statistics(self, *, check: bool = True) -> dict[str, Any]:
        """Fold, read everything back (host sync) and, when escalation is on, act on it."""
        if not self.materialised:  # nothing ran yet (or only a state was loaded): no tensors needed
            st = {**self.state()}
            st["growth_tracker"] = st["_growth_tracker"]
            keys = ("scale", "steps", "skipped_steps", "consecutive_skips", "last_overflow_step", "last_finite_step",
                    "floor_streak", "growth_tracker", "hysteresis_left", "scale_history", "overflow_history")
            return {k: st[k] for k in keys}
        assert self.scale is not None and self.growth_tracker is not None and self.hysteresis_left is not None
        return self.history.statistics(self.scale, self.growth_tracker, self.hysteresis_left, check=check)

    # ----- state -----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Every field as Python numbers (host sync when the tensors exist)."""
        cfg = self.cfg
        if not self.materialised and self.pending_state is not None:
            keep = ("scale", "_growth_tracker", "hysteresis_left", *STATE_KEYS)
            base: dict[str, Any] = {k: self.pending_state[k] for k in keep}
        elif not self.materialised:
            base = {"scale": cfg.init_scale, "_growth_tracker": 0, "hysteresis_left": cfg.hysteresis - 1,
                    **fresh_statistics()}
        else:
            s = self.statistics(check=False)
            base = {"scale": s["scale"], "_growth_tracker": s["growth_tracker"], "hysteresis_left": s["hysteresis_left"],
                    **{k: s[k] for k in STATE_KEYS if k in s},
                    "any_finite_step": self.history.any_finite(s["last_finite_step"])}
        base.update(growth_factor=cfg.growth_factor, backoff_factor=cfg.backoff_factor,
                    growth_interval=cfg.growth_interval, hysteresis=cfg.hysteresis, min_scale=cfg.min_scale,
                    max_scale=cfg.max_scale, refill=cfg.refill)
        return base

    def load(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state` output (or the torch.amp.GradScaler subset); config keys override ours."""
        cfg = self.cfg
        check_loaded_scale(sd, "loss scaler")  # before anything changes
        keys = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale", "max_scale", "refill")
        new_cfg = cfg
        if cfg.kind == "dynamic" and any(k in sd for k in keys):
            new_cfg = dataclasses.replace(cfg, **{k: sd[k] for k in keys if k in sd})
            new_cfg.validate_rule("load_state_dict")
        scale = float(sd["scale"]) if "scale" in sd else cfg.init_scale
        if cfg.kind != "dynamic" and not 0 < scale < math.inf:
            raise ScalerStateError(f"load_state_dict: a fixed loss scale of {scale!r}; it is finite and > 0. The "
                                   "checkpoint is damaged: load an earlier one.")
        if cfg.kind == "dynamic":
            check_loaded_counters(sd, new_cfg.hysteresis)  # still before anything changes
            for k in keys:
                setattr(cfg, k, getattr(new_cfg, k))
            self._derive_switches()  # a loaded floor or ceiling is the clamp's from now on
            scale = cfg.clamp(scale)  # e.g. a torch.amp.GradScaler checkpoint above our ceiling, or at 0
        cfg.init_scale = scale
        # what a torch.amp.GradScaler dict lacks starts fresh: full hysteresis allowance, statistics from zero
        sd = {"scale": scale, "_growth_tracker": sd.get("_growth_tracker", 0),
              "hysteresis_left": sd.get("hysteresis_left", cfg.hysteresis - 1), **loaded_statistics(sd)}
        if not self.materialised:
            self.pending_state = sd
            return
        assert self.scale is not None and self.growth_tracker is not None and self.hysteresis_left is not None
        self.scale.fill_(scale)
        self.growth_tracker.fill_(int(sd["_growth_tracker"]))
        self.hysteresis_left.fill_(int(sd["hysteresis_left"]))
        self.history.load(sd, scale)
        self._inv_cache = None

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["pending_state"] = self.state()
        for name in ("scale", "growth_tracker", "hysteresis_left"):
            d[name] = None
        d["_inv_cache"] = None
        # the unpickled copy re-creates its tensors lazily on its first use (like torch.amp.GradScaler);
        # the history pickles itself without its tensors
        d["bound"] = self.explicit_device is not None
        d["device"] = self.explicit_device
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._derive_switches()
        self.history.refresh_config()
        if self.pending_state is not None:
            self.history.steps = self.history.folded = int(self.pending_state.get("steps", 0))


def check_scaler_state(sd: Any, owner: str, kind: str) -> Mapping[str, Any]:
    """Raise ScalerStateError naming the likely cause for an empty, foreign or newer state dict."""
    if not isinstance(sd, Mapping):
        raise ScalerStateError(f"{owner}.load_state_dict needs a dict from {owner}.state_dict(), got {type(sd).__name__}.")
    if len(sd) == 0:
        raise ScalerStateError(
            f"{owner}.load_state_dict got an empty dict: it was probably saved from a disabled scaler "
            "(torch.amp.GradScaler/mixprec.GradScaler with enabled=False save {}), or the checkpoint has no scaler state.")
    version = sd.get("version")
    if version is not None and (not isinstance(version, int) or version > STATE_VERSION):
        raise ScalerStateError(f"{owner}: state dict version {version!r} is newer than this mixprec understands "
                               f"({STATE_VERSION}); upgrade mixprec.")
    got_kind = sd.get("kind")
    if got_kind is not None and got_kind != kind:
        names = {"noop": "NoOpScaler", "static": "StaticScaler", "dynamic": "DynamicScaler or GradScaler"}
        raise ScalerStateError(f"{owner}: this state dict is from a {names.get(got_kind, repr(got_kind))} "
                               f"(kind={got_kind!r}), not a {kind!r} scaler; build the matching scaler to load it.")
    if got_kind is None and kind == "dynamic":
        missing = [k for k in _TORCH_KEYS if k not in sd]
        if missing:
            keys = ", ".join(map(repr, list(sd)[:8]))
            raise ScalerStateError(
                f"{owner}: not a loss-scaler state dict (missing {', '.join(map(repr, missing))}; got keys {keys}). "
                "Pass the scaler's entry of a checkpoint (e.g. ckpt['scaler']), not the whole checkpoint.")
    elif got_kind is None:
        keys = ", ".join(map(repr, list(sd)[:8]))
        raise ScalerStateError(f"{owner}: not a {owner} state dict (no 'kind'/'version'; got keys {keys}). "
                               "Pass what this scaler's state_dict() returned.")
    return sd


# --------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------
@runtime_checkable
class LossScaler(Protocol):
    """What :class:`mixprec.MixedPrecision` needs from a loss scaler.

    Implementations: :class:`NoOpScaler`, :class:`StaticScaler`, :class:`DynamicScaler`.
    (``mixprec.GradScaler`` follows ``torch.amp.GradScaler``'s optimizer-based API instead.)
    """

    def scale(self, outputs: T) -> T:
        """Multiply the floating tensors in ``outputs`` (nested lists/tuples/dicts) by the scale."""
        ...

    def unscale_(self, grads_or_params: Iterable[Tensor]) -> Tensor:
        """Divide gradients in place by the scale; return ``found_inf`` (0-d float32, agreed across ranks)."""
        ...

    def update(self, found_inf: Tensor) -> None:
        """Adapt the scale to this step's ``found_inf`` on the device."""
        ...

    @property
    def loss_scale(self) -> Tensor:
        """The current scale, 0-d float32 on the device."""
        ...

    def statistics(self) -> dict[str, Any]:
        """Steps, skipped steps, consecutive skips, last overflow step, scale history (host sync)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, with a ``version``."""
        ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        ...


def _collect_grads(grads_or_params: Iterable[Tensor | None]) -> list[Tensor]:
    """Parameters (and leaf tensors that require grad) -> their ``.grad``; other tensors are gradients."""
    if isinstance(grads_or_params, Tensor):
        grads_or_params = [grads_or_params]
    parameter, plain = torch.nn.Parameter, Tensor
    out: list[Tensor] = []
    for t in grads_or_params:
        if t is None:
            continue
        # Type checks in order of cost: isinstance on Parameter goes through a metaclass hook (slow),
        # and gradients (the hot path) are plain Tensors, which can never be Parameters.
        kind = type(t)
        if kind is plain:
            holder = t.requires_grad and t.is_leaf
        else:
            holder = kind is parameter or isinstance(t, parameter) or (t.requires_grad and t.is_leaf)
        if holder:
            g = t.grad
            if g is None:
                continue
            if g.is_sparse and g.dtype == torch.float16:
                # duplicate indices of a scaled FP16 sparse gradient can overflow when summed: check the sum
                g = t.grad = g.coalesce()
            out.append(g)
        else:
            out.append(t)
    return out


class _ScalerBase:
    """Shared implementation of the LossScaler protocol on top of :class:`ScaleCore`."""

    _kind: Literal["noop", "static", "dynamic"]
    _owner = "Scaler"
    _join: JoinState | None = None  # (copies pickled before it existed take part in no Join)

    def __init__(self, config: ScaleConfig, *, device: torch.device | str | None, process_group: Any) -> None:
        config.validate(type(self).__name__)
        self._core = ScaleCore(config, device)
        self.process_group = process_group
        self._join = JoinState()

    # ----- per step --------------------------------------------------------------------------------
    def scale(self, outputs: T) -> T:
        """Multiply every floating tensor in ``outputs`` by the current scale.

        Tensors may be nested in lists, tuples, named tuples, dicts (Hugging Face ``ModelOutput``
        too) and dataclasses, rebuilt by :func:`mixprec._tree.tree_map`, the map that also casts
        them; non-floating tensors and other objects are returned as they are. The first call creates
        the scaler's state on the first tensor's device (unless a device was given). No host sync.

        Args:
            outputs: A loss tensor or nested outputs.

        Returns:
            ``outputs`` with floating tensors multiplied by the scale.
        """
        core = self._core
        if isinstance(outputs, Tensor):
            if not outputs.is_floating_point():
                return outputs
            scale = core.ensure(outputs.device)
            return cast(T, outputs * (scale if scale.device == outputs.device else scale.to(outputs.device, non_blocking=True)))
        per_device: dict[torch.device, Tensor] = {}

        def scale_for(device: torch.device) -> Tensor:
            s = per_device.get(device)
            if s is None:
                base = core.ensure(device)
                s = per_device[device] = base if base.device == device else base.to(device, non_blocking=True)
            return s

        return tree_map(lambda t: t * scale_for(t.device) if t.is_floating_point() else t, outputs)

    def unscale_(self, grads_or_params: Iterable[Tensor]) -> Tensor:
        """Divide gradients in place by the scale and check them for inf/NaN.

        Parameters are replaced by their ``.grad`` (``None`` skipped; FP16 sparse gradients are
        coalesced first); other tensors are taken as gradients. One fused
        ``torch._amp_foreach_non_finite_check_and_unscale_`` per (device, dtype) group, with
        ``1/scale`` the correctly rounded FP32 reciprocal (torch.amp's bits). When ``torch.distributed`` is initialised the flag is
        all-reduced (MAX) over ``process_group``, so every rank skips the same steps (a
        collective: every rank must call it). No host sync.

        Args:
            grads_or_params: Gradients, or parameters whose ``.grad`` to unscale.

        Returns:
            ``found_inf``: 0-d float32 on the gradients' device, 1.0 when any gradient is inf/NaN.
        """
        return self.unscale_grads_(_collect_grads(grads_or_params))

    def unscale_grads_(self, grads: list[Tensor], factor: Tensor | None = None) -> Tensor:
        """:meth:`unscale_` on gradients already collected (``MixedPrecision`` has them: no second pass).

        Args:
            grads: The gradients, unscaled and checked in place.
            factor: Only for a scaler that does not scale (:class:`NoOpScaler`): a 0-d float32
                factor the gradients are multiplied by in the same pass as the check (the
                clipping coefficient: ``MixedPrecision.clip_grad_norm_`` clips and checks in
                one read and write of the gradients, where torch.amp's recipe clips in one).

        Raises:
            ValueError: ``factor`` given to a scaler that scales the loss.
        """
        core = self._core
        if core.scale is None or not core.bound:
            core.ensure(grads[0].device if grads else None)
        if factor is not None:
            if self._kind != "noop":
                raise ValueError(f"unscale_grads_(factor=...) is for a scaler that does not scale the loss; this one is "
                                 f"{self._kind!r}: unscale first, then multiply.")
            inv: Tensor | None = factor
        else:
            inv = None if self._kind == "noop" else core.inv_scale()
        found_inf = unscale_and_check_(grads, inv)
        if self.process_group is not None or _dist_initialized():  # the test inline: no call when single-process
            join = self._join
            if join is not None:  # torch's Join (uneven inputs): counted, so a joined rank can shadow it
                join.count("prec")
            agree_found_inf_(found_inf, self.process_group)
        return found_inf

    def update(self, found_inf: Tensor, *, used: Tensor | None = None) -> None:
        """Record this step's ``found_inf`` (and, for :class:`DynamicScaler`, adapt the scale). No host sync.

        Call it once per iteration, after every optimizer stepped, with the (combined) flag.

        Args:
            found_inf: The iteration's 0-d flag (non-zero: a gradient was inf/NaN).
            used: A copy of the scale this iteration's gradients were divided by, that nobody writes
                later (``MixedPrecision.step`` keeps one in ``StepInfo.scale``): the history then
                records the step by reference, without a kernel.
        """
        if not isinstance(found_inf, Tensor):
            raise TypeError(f"update(found_inf) needs the 0-d tensor unscale_() returned, got {type(found_inf).__name__}.")
        self._core.update(found_inf, used=used)
        join = self._join
        if join is not None and join.agrees:
            join.end_iteration()

    @property
    def loss_scale(self) -> Tensor:
        """The current scale: the live 0-d float32 tensor on the device (clone it to keep a value). No host sync."""
        return self._core.ensure(None, bind=False)

    # ----- host side -------------------------------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        """Return the scaler's statistics as Python values. Host sync (one read of a few values).

        Keys: ``scale``, ``steps`` (update calls), ``skipped_steps``, ``consecutive_skips``,
        ``last_overflow_step`` / ``last_finite_step`` (0-based step index or ``None``),
        ``floor_streak`` (consecutive overflows at ``min_scale``; for the fixed-scale scalers,
        consecutive skips), ``growth_tracker``, ``hysteresis_left``, ``scale_history`` and
        ``overflow_history`` (the last ``history`` steps, oldest first). With escalation on
        (``on_failure`` not ``"ignore"``), reading the statistics also checks for failure (and may
        raise :class:`mixprec.NumericsError`).
        """
        return self._core.statistics()

    def state_dict(self) -> dict[str, Any]:
        """Return the scaler's state as Python values (host sync). Keys are documented on each class."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _stats_state(self) -> dict[str, Any]:
        st = self._core.state()
        keys = ("steps", "skipped_steps", "consecutive_skips", "last_overflow_step", "last_finite_step",
                "scale_history", "overflow_history", "any_finite_step")
        return {k: st[k] for k in keys}

    def __repr__(self) -> str:
        core = self._core
        where = core.device if core.device is not None else "lazy"
        fields = [self._describe(), f"device={where}", f"steps={core.steps}"]
        return f"{type(self).__name__}({', '.join(f for f in fields if f)})"

    def _describe(self) -> str:
        return ""


class NoOpScaler(_ScalerBase):
    """No loss scaling: ``scale`` returns the same objects; ``unscale_`` still checks for inf/NaN.

    Use it for FP32 and BF16 policies: the step is still skipped when a gradient is inf/NaN.
    ``loss_scale`` is 1.0.

    Escalation: with no scale to lower, ``patience`` consecutive skipped steps mean the inf/NaN
    comes from the model, the data or the learning rate; ``on_failure`` then raises
    :class:`mixprec.NumericsError` (default), warns, or is ignored, so persistent poisoning ends
    in a diagnosis instead of skipping forever. It is checked every ``check_interval`` steps in
    :meth:`update` (one host read of a 9-value snapshot; asynchronous on CUDA) and when
    :meth:`statistics` is read, so it fires at most ``patience + check_interval`` steps after
    the poisoning began. The message says whether any step of the run was ever applied: if
    none was, the gradients were inf/NaN from the first step (the model, data, initialisation,
    or an inf left in gradient buffers that are never cleared).

    Args:
        device: Where the state lives (default: the first gradient's device).
        process_group: Group for the found_inf agreement (default: world when distributed).
        history: Steps kept in ``scale_history``/``overflow_history``: the last
            ``max(history, check_interval)`` (the ring also holds the steps of one periodic check).
        on_failure: ``"raise"``, ``"warn"`` or ``"ignore"`` persistent inf/NaN.
        patience: Consecutive skipped steps that count as failure (default 20).
        check_interval: Steps between escalation checks (default 50).

    ``state_dict`` keys: ``version``, ``kind`` (``"noop"``), and the statistics ``steps``,
    ``skipped_steps``, ``consecutive_skips``, ``last_overflow_step``, ``last_finite_step``,
    ``scale_history``, ``overflow_history``, ``any_finite_step`` (whether any step of the run,
    also before a resume, had finite gradients; optional when loading).

    Example:
        >>> import torch
        >>> s = NoOpScaler()
        >>> loss = torch.tensor(2.0)
        >>> s.scale(loss) is loss
        True
    """

    _kind = "noop"

    def __init__(self, *, device: torch.device | str | None = None, process_group: Any = None,
                 history: int = DEFAULT_HISTORY, on_failure: OnFailure = "raise", patience: int = DEFAULT_PATIENCE,
                 check_interval: int = DEFAULT_CHECK_INTERVAL) -> None:
        super().__init__(ScaleConfig(kind="noop", init_scale=1.0, history=history, on_failure=on_failure,
                                 patience=patience, check_interval=check_interval),
                         device=device, process_group=process_group)

    def scale(self, outputs: T) -> T:
        """Return ``outputs`` itself (identity)."""
        return outputs

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "kind": "noop", statistics...}`` (host sync)."""
        return {"version": STATE_VERSION, "kind": "noop", **self._stats_state()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output. Raises ScalerStateError (a ValueError) for empty/foreign dicts."""
        sd = check_scaler_state(state_dict, "NoOpScaler", "noop")
        self._core.load({**sd, "scale": 1.0})


class StaticScaler(_ScalerBase):
    """A fixed loss scale: multiply the loss by ``scale``, divide gradients by it, skip inf/NaN steps.

    Args:
        scale: The loss scale (> 0, finite). Powers of two keep the unscale exact.
        device: Where the state lives (default: the first scaled tensor's device).
        process_group: Group for the found_inf agreement (default: world when distributed).
        history: Steps kept in ``scale_history``/``overflow_history``: the last
            ``max(history, check_interval)`` (the ring also holds the steps of one periodic check).
        on_failure, patience, check_interval: Escalation after ``patience`` consecutive skipped
            steps, as in :class:`NoOpScaler` (a fixed scale cannot back off, so persistent
            inf/NaN is a failure of the model or data, or a scale that is too large).

    ``state_dict`` keys: ``version``, ``kind`` (``"static"``), ``scale``, and the statistics of
    :class:`NoOpScaler`.

    Example:
        >>> import torch
        >>> s = StaticScaler(128.0)
        >>> s.scale(torch.tensor(0.5)).item()
        64.0
    """

    _kind = "static"

    def __init__(self, scale: float = 1.0, *, device: torch.device | str | None = None, process_group: Any = None,
                 history: int = DEFAULT_HISTORY, on_failure: OnFailure = "raise", patience: int = DEFAULT_PATIENCE,
                 check_interval: int = DEFAULT_CHECK_INTERVAL) -> None:
        super().__init__(ScaleConfig(kind="static", init_scale=scale, history=history, on_failure=on_failure,
                                 patience=patience, check_interval=check_interval),
                         device=device, process_group=process_group)

    def _describe(self) -> str:
        return f"scale={self._core.cfg.init_scale:g}"

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "kind": "static", "scale", statistics...}`` (host sync)."""
        return {"version": STATE_VERSION, "kind": "static", "scale": self._core.cfg.init_scale, **self._stats_state()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the saved scale replaces ours). Raises ScalerStateError for empty/foreign dicts."""
        sd = check_scaler_state(state_dict, "StaticScaler", "static")
        try:
            scale = check_static_scale(sd.get("scale", self._core.cfg.init_scale), "StaticScaler.load_state_dict: scale")
        except ValueError as e:
            raise ScalerStateError(str(e)) from None
        self._core.load({**sd, "scale": scale})


class DynamicScaler(_ScalerBase):
    """Dynamic loss scaling with hysteresis, floor, ceiling and escalation, decided on the device.

    The rule, applied by :meth:`update` to each step's ``found_inf``::

        overflow:  growth_tracker = 0
                   if hysteresis_left > 0: hysteresis_left -= 1            # tolerated: scale kept
                   else:                   scale = max(scale * backoff_factor, min_scale)
        clean:     growth_tracker += 1
                   if growth_tracker == growth_interval:                   # the interval-th clean step
                       growth_tracker = 0; hysteresis_left = hysteresis - 1 (refill="growth")
                       if isfinite(scale * growth_factor): scale = min(scale * growth_factor, max_scale)
                   if refill == "clean": hysteresis_left = hysteresis - 1

    ``hysteresis=1`` (default) backs off at every overflow, exactly as ``torch.amp.GradScaler``
    (same fused kernel, products in float64); ``hysteresis=N`` spends N-1 overflows first and
    refills on growth (DeepSpeed's and Megatron-LM's default) or after every clean step
    (``refill="clean"``, DeepSpeed's ``consecutive_hysteresis``).

    Escalation: when the scale sits at ``min_scale`` and ``patience`` consecutive steps still
    overflow, scaling has failed; ``on_failure`` raises :class:`mixprec.NumericsError` (default),
    warns, or ignores it. The message tells two failures apart: no step of the run was ever
    applied (inf/NaN from the first step: the model, data, initialisation or uncleared gradient
    buffers, which no scale fixes), or the scale collapsed after N applied steps (FP16's range:
    bf16, FP32 islands). Host syncs: a snapshot of the counters is read every
    ``check_interval`` steps (asynchronously on CUDA, one interval late) and whenever
    :meth:`statistics` is called; nothing else in the step reads the device.

    Args:
        init_scale: Initial scale (2**16, as torch).
        growth_factor: Multiplier on growth (> 1).
        backoff_factor: Multiplier on overflow (in (0, 1)).
        growth_interval: Consecutive clean steps before growth (>= 1).
        hysteresis: Overflows tolerated before backing off, plus one (>= 1).
        min_scale: Floor (default 1.0; ``None`` for none). See the module notes for the defaults.
        max_scale: Ceiling (default 2**24; ``None`` for none).
        refill: ``"growth"`` or ``"clean"``: when the hysteresis allowance refills.
        on_failure: ``"raise"``, ``"warn"`` or ``"ignore"`` persistent overflow at the floor
            (default: ``"raise"`` with a floor, ``"ignore"`` without one).
        patience: Consecutive overflowing steps at the floor that count as failure (default 20).
        check_interval: Steps between escalation/log checks (default 50).
        log_overflow: Log overflows on the ``mixprec.scaler`` logger (INFO), at most one line per
            check and per ``log_interval_s`` seconds.
        log_interval_s: Minimum seconds between two overflow log lines.
        history: Length of the scale history kept on the device (ring buffer).
        device: Where the state lives (default: the device of the first scaled tensor).
        process_group: Group for the found_inf agreement (default: world when distributed).

    ``state_dict`` keys (Python values; a superset of ``torch.amp.GradScaler``'s): ``version``,
    ``kind`` (``"dynamic"``), ``scale``, ``growth_factor``, ``backoff_factor``,
    ``growth_interval``, ``_growth_tracker``, ``hysteresis``, ``hysteresis_left``, ``min_scale``,
    ``max_scale``, ``refill``, ``steps``, ``skipped_steps``, ``consecutive_skips``,
    ``last_overflow_step``, ``last_finite_step``, ``floor_streak``, ``scale_history``,
    ``overflow_history``, ``any_finite_step`` (whether any step of the run, also before a
    resume, had finite gradients: it tells "no step was ever applied" from "the scale
    collapsed" when escalating; optional when loading, derived from ``last_finite_step``). A
    ``torch.amp.GradScaler`` state dict loads too (hysteresis, floor and ceiling keep their
    configured values; the allowance is full and the statistics start from zero), and this one
    loads into ``torch.amp.GradScaler``, which ignores the extra keys.

    Example:
        >>> import torch
        >>> s = DynamicScaler(init_scale=400.0, backoff_factor=0.5, min_scale=None)
        >>> for _ in range(4):
        ...     s.update(torch.tensor(1.0))
        >>> s.loss_scale.item()
        25.0
    """

    _kind = "dynamic"

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float | None = DEFAULT_MIN_SCALE,
        max_scale: float | None = DEFAULT_MAX_SCALE,
        *,
        refill: Refill = "growth",
        on_failure: OnFailure | None = None,
        patience: int = DEFAULT_PATIENCE,
        check_interval: int = DEFAULT_CHECK_INTERVAL,
        log_overflow: bool = True,
        log_interval_s: float = 5.0,
        history: int = DEFAULT_HISTORY,
        device: torch.device | str | None = None,
        process_group: Any = None,
    ) -> None:
        if on_failure is None:
            on_failure = "raise" if min_scale is not None else "ignore"  # no floor: nothing to escalate
        cfg = ScaleConfig(kind="dynamic", init_scale=init_scale, growth_factor=growth_factor,
                      backoff_factor=backoff_factor, growth_interval=growth_interval, hysteresis=hysteresis,
                      min_scale=min_scale, max_scale=max_scale, refill=refill, on_failure=on_failure,
                      patience=patience, check_interval=check_interval, log_overflow=log_overflow,
                      log_interval_s=log_interval_s, history=history)
        super().__init__(cfg, device=device, process_group=process_group)

    def _describe(self) -> str:
        c = self._core.cfg
        return (f"init_scale={c.init_scale:g}, growth_interval={c.growth_interval}, hysteresis={c.hysteresis}, "
                f"min_scale={c.min_scale}, max_scale={c.max_scale}")

    @property
    def growth_tracker(self) -> Tensor:
        """Consecutive clean steps since the last growth or overflow (0-d int32 on the device)."""
        self._core.ensure(None, bind=False)
        assert self._core.growth_tracker is not None
        return self._core.growth_tracker

    @property
    def hysteresis_left(self) -> Tensor:
        """Overflows still tolerated before the next backoff (0-d int32 on the device)."""
        self._core.ensure(None, bind=False)
        assert self._core.hysteresis_left is not None
        return self._core.hysteresis_left

    def state_dict(self) -> dict[str, Any]:
        """Return the state (keys in the class docstring) as Python values. Host sync."""
        return {"version": STATE_VERSION, "kind": "dynamic", **self._core.state()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output or a ``torch.amp.GradScaler`` state dict.

        Raises:
            ScalerStateError (a ValueError): empty dict (a disabled scaler saves ``{}``), a foreign
                dict (another scaler kind, a whole checkpoint), or a newer version.
        """
        sd = check_scaler_state(state_dict, "DynamicScaler", "dynamic")
        interval = sd.get("growth_interval", self._core.cfg.growth_interval)
        tracker = sd.get("_growth_tracker")
        if is_count(tracker) and is_count(interval) and int(interval) >= 1 and float(tracker) >= int(interval):  # type: ignore[arg-type]  # (is_count)
            # a tracker at or past the interval (a checkpoint of a longer interval) means growth at the next clean
            # step; torch's update kernel grows only when the count reaches the interval exactly, so it never would
            sd = {**sd, "_growth_tracker": int(interval) - 1}
        self._core.load(sd)

