"""Apex ``amp`` on mixprec: training code that still says ``opt_level`` runs with one changed import.

NVIDIA Apex's ``amp`` was deprecated and removed; ``torch.amp`` only replaces its O1. This module
is Apex's front end (``initialize``, ``scale_loss``, ``master_params``, ``state_dict``,
``load_state_dict``, ``disable_casts``) on mixprec's machinery::

    from mixprec import apex as amp          # was: from apex import amp

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    for x, y in loader:
        loss = criterion(model(x), y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()                     # skipped after an overflow, as Apex did

How the pieces map (docs/apex.md has the full table):

* The opt level and its overrides (Apex's "properties") become one :class:`mixprec.Policy`:
  O0 ``fp32``, O1 ``fp16-mixed`` (torch.autocast around each model's forward), O2
  ``fp16-master`` (FP16 model, FP32 masters in a :class:`~mixprec.MasterWeightOptimizer`, norms
  in FP32), O3 pure FP16 (``keep_batchnorm_fp32=False``: no FP32 islands; with ``True`` it is the
  ``fp16-pure`` preset). ``cast_model_type=torch.bfloat16`` gives the BF16 variants.
* Each model (or the models one optimizer spans, together) is prepared by its own
  :class:`~mixprec.MixedPrecision` (casting, FP32 islands, masters, the guarded
  ``optimizer.step()``). Each ``initialize`` is a run of its own; ``_amp_state`` is the
  compatibility surface of Apex's private state (``loss_scalers[i].loss_scale()``, ...). Its own scaler is a :class:`~mixprec.NoOpScaler`
  (it only checks for inf/NaN, ORed with the overflow flags of the step's ``scale_loss`` blocks,
  so that every optimizer of an overflowing block skips, as in Apex): the loss scales live here,
  one mixprec scaler per ``loss_id`` (``num_losses``), because Apex unscales at the end of every
  ``scale_loss`` block and each loss may carry its own scale, which one ``MixedPrecision`` scaler
  cannot express.
* ``scale_loss(loss, optimizer, loss_id)``: on entry the gradients already accumulated (unscaled)
  are set aside; the block's ``backward`` of ``loss.float() * scale`` produces only this loss's
  gradients (FP32 master gradients under O2); on exit they are unscaled and checked by the loss's
  scaler (one fused kernel per device and dtype), the set-aside gradients are added back, and the
  loss's scale is updated (Apex's rule: x0.5 on overflow, x2 after 2000 clean steps, within
  ``[min_loss_scale, max_loss_scale]``). ``delay_unscale=True`` leaves the gradients scaled for a
  later block of the same loss, as Apex did.
* ``optimizer.step()`` is ``MixedPrecision.step``: the step is skipped on the device when a
  gradient is inf/NaN, and at ``verbosity >= 1`` Apex's line is printed:
  ``Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0``.

Differences from Apex, all deliberate and documented in docs/apex.md: a step with inf/NaN
gradients is skipped under a static loss scale too (Apex applied it); ``keep_batchnorm_fp32=True``
keeps every normalization layer in FP32 (mixprec's ``norm`` islands), not only BatchNorm; a
scaler at ``min_loss_scale`` never raises (as Apex). Options that cannot be expressed raise a
``ValueError`` naming what to use instead: nothing is silently ignored.

Host syncs: one per ``optimizer.step()`` at ``verbosity >= 1`` (reading whether it was skipped
and why, for the log line; Apex read its overflow flag at every ``scale_loss`` exit);
``state_dict``/``load_state_dict`` read the scales. Nothing else reads the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ._autocast import autocast, tf32
from ._casting import cast_module, cast_root, is_prepared
from ._finite import combine_found_inf
from ._master import MasterWeightOptimizer
from ._policy import Policy
from ._precision import MixedPrecision
from ._scaler import (
    DynamicScaler,
    NoOpScaler,
    ScalerStateError,
    StaticScaler,
    check_loaded_scale,
    check_static_scale,
    is_count,
)

__all__ = [
    "disable_casts",
    "float_function",
    "half_function",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]

_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16
# Apex's retired pre-initialize API: named in the AttributeError rather than a bare "no attribute".
_RETIRED = {"init": "amp.init()", "handle": "amp.handle"}


def __getattr__(name: str) -> Any:
    if name in _RETIRED:
        raise AttributeError(
            f"{_RETIRED[name]} is Apex's pre-initialize API (retired by Apex itself), not provided by mixprec.apex: use "
            "model, optimizer = amp.initialize(model, optimizer, opt_level=...) and `with amp.scale_loss(loss, "
            "optimizer) as scaled: scaled.backward()` (see docs/apex.md)."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: Apex's defaults (apex/amp/scaler.py): initial scale 2**16, x2 after 2000 clean steps, x0.5 on overflow.
_INIT_SCALE = 2.0**16
_GROWTH_INTERVAL = 2000
_DEFAULT_MAX_LOSS_SCALE = 2.0**24

# The properties Apex printed, in its order, and each opt level's defaults and one-line brief.
_OPTION_NAMES = (
    "enabled", "opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights",
    "loss_scale",
)
_LEVELS: dict[str, tuple[str, dict[str, Any]]] = {
    "O0": ("O0:  Pure FP32 training.\n", {
        "cast_model_type": _F32, "patch_torch_functions": False, "keep_batchnorm_fp32": None,
        "master_weights": False, "loss_scale": 1.0}),
    "O1": ("O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n", {
        "cast_model_type": None, "patch_torch_functions": True, "keep_batchnorm_fp32": None,
        "master_weights": None, "loss_scale": "dynamic"}),
    "O2": ("O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n", {
        "cast_model_type": _F16, "patch_torch_functions": False, "keep_batchnorm_fp32": True,
        "master_weights": True, "loss_scale": "dynamic"}),
    "O3": ("O3:  Pure FP16 training.", {
        "cast_model_type": _F16, "patch_torch_functions": False, "keep_batchnorm_fp32": False,
        "master_weights": False, "loss_scale": 1.0}),
}
_ZERO_TYPOS = {"00": "O0", "01": "O1", "02": "O2", "03": "O3"}

AmpScaler = DynamicScaler | StaticScaler
Stage = Literal["idle", "scaled", "unscaled"]


# --------------------------------------------------------------------------------------------------
# run state
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _OptimizerState:
    """What the front end tracks for one optimizer ``initialize`` returned.

    Attributes:
        optimizer: The optimizer ``initialize`` returned (a ``MasterWeightOptimizer`` under O2).
        prec: The ``MixedPrecision`` that prepared it.
        stage: ``"idle"`` (no gradients since the last step), ``"scaled"`` (a ``delay_unscale``
            block left them scaled) or ``"unscaled"`` (a block unscaled them; ready to step).
        scaled_loss_id: The ``loss_id`` whose scale the gradients carry while ``stage == "scaled"``.
        stash: Gradients set aside at a block's entry, parallel to :meth:`holders`.
        overflows: ``(loss_id, found_inf)`` of each block since the last step (0-d device tensors).
        depth: > 0 while the front end's ``step`` runs (mixprec calls ``optimizer.step`` again inside).
    """

    optimizer: Optimizer
    prec: MixedPrecision
    stage: Stage = "idle"
    scaled_loss_id: int | None = None
    stash: list[Tensor | None] | None = None
    overflows: list[tuple[int, Tensor]] = dataclasses.field(default_factory=list)
    depth: int = 0

    def holders(self) -> list[tuple[Tensor, Tensor]]:
        """``(model parameter, tensor whose .grad the step uses)``: the FP32 master under O2, else the parameter."""
        opt = self.optimizer
        if isinstance(opt, MasterWeightOptimizer):
            return list(zip(opt.model_params, opt.masters))
        return [(p, p) for g in opt.param_groups for p in g["params"]]

    def set_aside(self) -> None:
        """Apex's ``_prepare_amp_backward``: move the (unscaled) gradients aside so backward writes only new ones."""
        stash: list[Tensor | None] = []
        for param, holder in self.holders():
            if param is not holder and param.grad is None:
                # model.zero_grad() dropped the master-gradient view (Apex code often clears the model's
                # gradients, not the optimizer's): the master's gradient is stale, the next one replaces it.
                stash.append(None)
            else:
                stash.append(holder.grad)
            holder.grad = None
            if param is not holder:
                param.grad = None  # drop the master-gradient view: the next gradient replaces, not adds
        self.stash = stash

    def new_grads(self) -> list[Tensor]:
        """The gradients written since :meth:`set_aside` (all of them after a ``delay_unscale`` block)."""
        return [h.grad for _, h in self.holders() if h.grad is not None]

    @torch.no_grad()
    def add_back(self) -> None:
        """Add the set-aside gradients to the new, unscaled ones (Apex's ``unscale_with_stashed``)."""
        stash, self.stash = self.stash, None
        if not stash:
            return
        opt = self.optimizer
        for (param, holder), old in zip(self.holders(), stash):
            if old is None:
                continue
            if holder.grad is None:
                holder.grad = old
                if param is not holder and isinstance(opt, MasterWeightOptimizer):
                    param.grad = opt.grad_view(param)
            else:
                holder.grad.add_(old)


@dataclasses.dataclass(eq=False)
class _AmpState:
    """One ``initialize`` call: its properties, policy, loss scalers and prepared optimizers."""

    enabled: bool
    verbosity: int
    properties: dict[str, Any] = dataclasses.field(default_factory=dict)
    policy: Policy | None = None
    scalers: list[AmpScaler] = dataclasses.field(default_factory=list)
    precs: list[MixedPrecision] = dataclasses.field(default_factory=list)
    optimizers: dict[int, _OptimizerState] = dataclasses.field(default_factory=dict)
    device_types: tuple[str, ...] = ()
    #: What initialize installed on the models beyond prepare (O1's autocast hooks, O2/O3's FP32
    #: state_dict hooks, per-model casts): removed by ``_amp_state.handle._deactivate()``.
    handles: list[Any] = dataclasses.field(default_factory=list)
    active: bool = True

    def record(self, optimizer: Any, what: str) -> _OptimizerState:
        rec = self.optimizers.get(id(optimizer))
        if rec is None or rec.optimizer is not optimizer:
            hint = ""
            if any(isinstance(r.optimizer, MasterWeightOptimizer) and r.optimizer.optimizer is optimizer
                   for r in self.optimizers.values()):
                hint = (" You passed the optimizer you gave amp.initialize; use the one it returned "
                        "(model, optimizer = amp.initialize(model, optimizer, ...)): it holds the FP32 masters.")
            raise ValueError(f"{what}: this optimizer was not returned by amp.initialize().{hint}")
        return rec


class _AmpPrecision(MixedPrecision):
    """The ``MixedPrecision`` of one model: its inf/NaN check also counts the ``scale_loss`` blocks' overflows.

    Apex skipped every optimizer of a ``scale_loss`` block that overflowed, also one whose own
    gradients are finite (e.g. the second of two chained models when only the first one's
    gradients overflowed). The flags are ORed on the device (no host sync).
    """

    _loss_scaled_elsewhere = True  # amp.scale_loss scales the loss with Apex's scaler

    def __init__(self, policy: Policy, keep_dtypes: bool = False) -> None:
        super().__init__(policy, scaler=NoOpScaler(on_failure="ignore"))
        self.amp_records: dict[int, _OptimizerState] = {}
        self._keep_dtypes = keep_dtypes  # Apex's uncast models (cast_model_type None/False): prepared as they are

    def unscale_(self, optimizer: Optimizer) -> Tensor:
        """``MixedPrecision.unscale_``'s ``found_inf``, ORed with the overflow flags of this step's blocks."""
        found_inf = super().unscale_(optimizer)
        rec = self.amp_records.get(id(optimizer))
        if rec is None or not rec.overflows:
            return found_inf
        return combine_found_inf([found_inf, *(f for _, f in rec.overflows)])


_state: _AmpState | None = None  # the latest initialize (amp.state_dict(), _amp_state)
#: The attribute of every optimizer initialize returned that holds its run: runs of several initialize calls stay
#: independent. (On the optimizer, not in a WeakKeyDictionary: the run holds its optimizers, so a dictionary value
#: would have kept every key alive, and every run's model, masters and state with it, for good.)
_OWNER_ATTR = "_mixprec_amp_run"


def _state_of(optimizers: list[Any], what: str) -> _AmpState | None:
    """The run the optimizers belong to (``None``: not returned by any initialize).

    Raises:
        ValueError: optimizers of two different ``initialize`` calls in one ``scale_loss``.
    """
    states: dict[int, _AmpState] = {}
    for o in optimizers:
        st = getattr(o, _OWNER_ATTR, None)
        if isinstance(st, _AmpState):
            states[id(st)] = st
    if len(states) > 1:
        raise ValueError(
            f"{what}: these optimizers were returned by different amp.initialize calls, whose loss scalers are "
            "separate; scale each run's loss with its own optimizers."
        )
    return next(iter(states.values()), None)


def _require(what: str) -> _AmpState:
    if _state is None:
        raise ValueError(
            f"{what} before amp.initialize(); call model, optimizer = amp.initialize(model, optimizer, opt_level=...) first."
        )
    return _state


def _maybe_print(state: _AmpState | None, msg: str, rank0: bool = False) -> None:
    """Print at verbosity >= 1 (on rank 0 only when ``rank0`` and torch.distributed runs), as Apex did."""
    if state is None or state.verbosity < 1:
        return
    dist = torch.distributed
    if rank0 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() != 0:
        return
    print(msg)


# --------------------------------------------------------------------------------------------------
# properties -> policy
# --------------------------------------------------------------------------------------------------
def _check_opt_level(opt_level: object) -> str:
    if isinstance(opt_level, str) and opt_level in _LEVELS:
        return opt_level
    hint = ""
    if isinstance(opt_level, str) and opt_level.strip() in _ZERO_TYPOS:
        hint = f" Did you mean {_ZERO_TYPOS[opt_level.strip()]!r}? The prefix is the letter O, not the digit zero."
    elif isinstance(opt_level, str) and opt_level.strip().upper() in _LEVELS:
        hint = f" Did you mean {opt_level.strip().upper()!r}? (a capital letter O)"
    raise ValueError(f"Unexpected optimization level {opt_level!r}. Options are 'O0', 'O1', 'O2', 'O3'.{hint}")


def _override(props: dict[str, Any], name: str, value: Any) -> None:
    """Apply one user override with Apex's consistency rules (Apex raised too, unless hard_override)."""
    level = props["opt_level"]
    if name == "cast_model_type":
        if value is not False and value not in (_F32, _F16, _BF16):
            raise ValueError(
                f"cast_model_type={value!r}; use torch.float16 (O2/O3), torch.bfloat16 (their BF16 variant), "
                "torch.float32 or None."
            )
        if level == "O1" and value not in (False, _F32):
            raise ValueError(
                "O1 inserts casts around Torch functions rather than model weights, so with O1 the model weights "
                f"stay FP32; cast_model_type was {value}. To cast the model use opt_level='O2' or 'O3' "
                "(with cast_model_type=torch.bfloat16 for BF16)."
            )
    elif name == "patch_torch_functions":
        if not isinstance(value, bool):
            raise TypeError(f"patch_torch_functions must be True, False or None, got {value!r}")
        if value and level != "O1":
            raise ValueError(
                f"patch_torch_functions=True with opt_level={level!r}: function patching (torch.autocast around the "
                "model's forward here) is O1; select opt_level='O1' instead."
            )
        if not value and level == "O1":
            raise ValueError(
                "opt_level='O1' with patch_torch_functions=False would leave nothing of O1 (an FP32 model with no "
                "casts), and Apex's own patching of individual torch functions cannot be expressed with "
                "torch.autocast; use opt_level='O0' (add loss_scale='dynamic' to keep a dynamic loss scale), or "
                "keep patch_torch_functions=None (O1 = torch.autocast in FP16)."
            )
    elif name == "keep_batchnorm_fp32":
        if value == "True":
            value = True
        elif value == "False":
            value = False
        if not isinstance(value, bool):
            raise TypeError(f"keep_batchnorm_fp32 must be a bool, the string 'True' or 'False', or None; got {value!r}")
        if level == "O1":
            raise ValueError(
                "With opt_level O1, batchnorm functions run in FP32 automatically (mixprec's FP32 islands), so "
                f"keep_batchnorm_fp32 should be None; it was {value}."
            )
    elif name == "master_weights":
        if not isinstance(value, bool):
            raise TypeError(f"master_weights must be True, False or None, got {value!r}")
        if level == "O1":
            raise ValueError(
                "master_weights with O1 has no meaning: with O1 the model weights themselves stay FP32 (they are the "
                "masters). For FP16 weights with FP32 masters use opt_level='O2'."
            )
    elif name == "loss_scale":
        value = _parse_loss_scale(value)
    props[name] = value


def _parse_loss_scale(value: Any) -> str | float:
    if value == "dynamic":
        return "dynamic"
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"loss_scale={value!r}; use 'dynamic', a number or a string holding one (e.g. 128.0 or '128.0')."
        ) from None
    if isinstance(value, bool) or not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"loss_scale={value!r}; a static loss scale is a positive finite number (or use 'dynamic').")
    return scale


def _policy_for(props: Mapping[str, Any], cast_model_outputs: Any,
                half_present: Sequence[torch.dtype] = ()) -> tuple[Policy, bool]:
    """The mixprec policy that the final properties describe (no property is dropped), and whether the models stay uncast.

    ``cast_model_type`` ``None``/``False`` (O1's default, or an override) leaves the models as they
    are, as Apex did: ``True`` is returned and ``MixedPrecision`` prepares them without casting.
    Master weights are then made for the half-precision parameters there are (``half_present``,
    under ``allow_incoming_model_not_fp32``); FP32 parameters are their own masters, as in Apex.
    """
    cast = props["cast_model_type"]
    keep = cast is None or cast is False
    if props["patch_torch_functions"]:
        param, compute = _F32, _F16  # O1: FP32 weights, torch.autocast in FP16
    elif cast in (None, False, _F32):
        param = compute = _F32
    else:
        param = compute = cast
    master = _F32 if props["master_weights"] else None
    if master is not None and param == _F32:
        if keep and half_present:
            # Apex's FP32 masters of an uncast model's FP16 (or BF16) parameters; FP32 ones are their own
            param = _F16 if _F16 in half_present else _BF16
            compute = param if not props["patch_torch_functions"] else compute
        else:
            master = None  # FP32 weights already are the masters: what Apex's copies would hold, without the copy
    islands_keep = props["keep_batchnorm_fp32"]
    # Half weights: keep_batchnorm_fp32 decides the FP32 islands; FP32 weights: the norm islands of the presets.
    islands: tuple[str, ...] = ("norm",) if param == _F32 or islands_keep else ()
    ls = props["loss_scale"]
    if ls == "dynamic":
        init = min(_INIT_SCALE, props["max_loss_scale"])
        kind, init_scale = "dynamic", (None if init == _INIT_SCALE else init)
    elif ls == 1.0 and compute == _F32 and master is None:
        kind, init_scale = "none", None  # Apex's O0: a scale of 1 on FP32 gradients scales nothing
    else:
        kind, init_scale = "static", float(ls)
    output = _F32 if cast_model_outputs is None else cast_model_outputs
    if output not in (_F32, _F16, _BF16):
        raise ValueError(f"cast_model_outputs={cast_model_outputs!r}; use torch.float32, torch.float16 or torch.bfloat16.")
    # A half model without FP32 islands is Apex's model.half(): BatchNorm's running statistics follow the
    # weights (b=param), as F.batch_norm needs them in the weights' dtype.
    buffers = "param" if param != _F32 and not islands else "keep"
    policy = Policy(
        param_dtype=param, compute_dtype=compute, output_dtype=output, master_dtype=master,
        loss_scale=kind, init_scale=init_scale, fp32_islands=islands, buffers=buffers,  # type: ignore[arg-type]
    )
    return policy, keep


def _make_scaler(loss_scale: str | float, min_loss_scale: float | None, max_loss_scale: float) -> AmpScaler:
    """One loss scaler with Apex's rule. Escalation is off: Apex kept skipping at its floor, and so do we."""
    if loss_scale == "dynamic":
        return DynamicScaler(
            init_scale=min(_INIT_SCALE, max_loss_scale), growth_factor=2.0, backoff_factor=0.5,
            growth_interval=_GROWTH_INTERVAL, min_scale=min_loss_scale, max_scale=max_loss_scale,
            on_failure="ignore", log_overflow=False,
        )
    return StaticScaler(float(loss_scale), on_failure="ignore")


def _check_scale_limits(loss_scale: str | float, min_loss_scale: Any, max_loss_scale: Any) -> None:
    if max_loss_scale is None or isinstance(max_loss_scale, bool) or not isinstance(max_loss_scale, (int, float)) \
            or not max_loss_scale > 0:
        raise ValueError(f"max_loss_scale={max_loss_scale!r}; a positive number (Apex's default 2.**24).")
    if min_loss_scale is not None and (
        isinstance(min_loss_scale, bool) or not isinstance(min_loss_scale, (int, float)) or not min_loss_scale > 0
    ):
        raise ValueError(f"min_loss_scale={min_loss_scale!r}; a positive number, or None for no floor.")
    if loss_scale != "dynamic":
        if min_loss_scale is not None or max_loss_scale != _DEFAULT_MAX_LOSS_SCALE:
            raise ValueError(
                f"min_loss_scale/max_loss_scale bound a dynamic loss scale, but loss_scale={loss_scale!r} is static "
                "(Apex ignored them then; mixprec does not ignore options). Drop them, or pass loss_scale='dynamic'."
            )
        return
    init = min(_INIT_SCALE, float(max_loss_scale))
    if min_loss_scale is not None and min_loss_scale > init:
        raise ValueError(
            f"min_loss_scale={min_loss_scale!r} is above the initial loss scale {init:g} (2**16, or max_loss_scale "
            "when lower); lower min_loss_scale."
        )


def _print_options(state: _AmpState, props: Mapping[str, Any]) -> None:
    for name in _OPTION_NAMES:
        _maybe_print(state, f"{name:22} : {props[name]}", True)


# --------------------------------------------------------------------------------------------------
# initialize
# --------------------------------------------------------------------------------------------------
def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
) -> Any:
    """Prepare models and optimizers for an Apex opt level, on mixprec (Apex's ``amp.initialize``).

    Apex's signature and return shapes: ``model, optimizer = amp.initialize(model, optimizer, ...)``,
    lists in where lists were passed, only the model(s) when ``optimizers`` is ``None``. Call it
    after building the models and optimizers and before wrapping the model in DDP. Calling it
    again starts a new, independent run: the earlier runs' optimizers keep their own loss
    scalers and keep working (``amp.state_dict()`` and ``_amp_state`` follow the latest run).

    Algorithm:
        1. Start from the opt level's properties, apply the overrides that are not ``None`` with
           Apex's consistency rules, and print both tables at ``verbosity >= 1``.
        2. Map the properties to one :class:`mixprec.Policy` (printed as ``mixprec policy``).
        3. The models an optimizer spans are prepared together (one model, or a container of
           them, each keeping its own input/output casts) by one ``MixedPrecision(policy,
           scaler=NoOpScaler())`` whose check also counts the blocks' overflows; a model
           without an optimizer is only cast (``cast_module``). ``cast_model_type`` ``None``/
           ``False`` leaves the models uncast. Under O1 each model's forward runs in
           ``torch.autocast`` (FP16), entered by a forward pre-hook; at O2/O3 each module's
           ``state_dict()`` returns FP32 tensors (Apex's hook).
        4. ``num_losses`` loss scalers are built (dynamic: ``DynamicScaler`` with Apex's rule;
           static: ``StaticScaler``).

    Args:
        models: An ``nn.Module`` or a list of them, with FP32 parameters (half ones too once
            ``_amp_state.allow_incoming_model_not_fp32`` is set, as in Apex).
        optimizers: An optimizer, a list of them, or ``None`` (inference). An optimizer may hold
            the parameters of several models.
        enabled: ``False`` returns everything unchanged and makes ``scale_loss`` yield the loss.
        opt_level: ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"`` (the letter O).
        cast_model_type: Override: ``torch.float16``, ``torch.bfloat16`` (O2/O3 in BF16),
            ``torch.float32``, or ``False`` (leave the models as they are; at O2 the FP32 masters
            are then the FP32 parameters themselves, plus masters of any half ones).
        patch_torch_functions: Override: only ``True`` with O1 (it is O1's default).
        keep_batchnorm_fp32: Override: ``True``/``False`` (or the strings): normalization layers
            stay FP32 in a half-precision model.
        master_weights: Override: FP32 master weights for the half-precision parameters (FP32
            parameters are their own).
        loss_scale: Override: ``"dynamic"`` or a static scale (number or numeric string).
        cast_model_outputs: Dtype the models' floating outputs are cast to (default FP32).
        num_losses: Number of loss scalers; ``scale_loss(..., loss_id=i)`` uses scaler ``i``.
        verbosity: 0 silences the tables and the overflow lines.
        min_loss_scale: Floor of a dynamic scale (``None``: none).
        max_loss_scale: Ceiling of a dynamic scale.

    Returns:
        The model(s), or ``(model(s), optimizer(s))`` when optimizers were passed. Use the returned
        optimizers from now on (under O2 they are ``MasterWeightOptimizer``s holding the masters).

    Raises:
        ValueError: an unknown opt level (``"01"`` is answered with "Did you mean 'O1'?"), an
            override Apex refused or mixprec cannot express (the message names what to use), an
            optimizer holding parameters of none of the models, half-precision parameters without
            ``_amp_state.allow_incoming_model_not_fp32``, ``num_losses < 1``, and
            whatever ``MixedPrecision.prepare`` refuses (nothing is changed when it raises).
        TypeError: models or optimizers of the wrong type.
    """
    global _state
    state = _AmpState(enabled=bool(enabled), verbosity=int(verbosity))
    models_list = models if isinstance(models, (list, tuple)) else [models]
    opts_list: list[Any] = [] if optimizers is None else (
        list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers])
    for m in models_list:
        if not isinstance(m, nn.Module):
            raise TypeError(f"amp.initialize: models must be torch.nn.Module(s), got {type(m).__name__}")
    for o in opts_list:
        if not isinstance(o, Optimizer):
            larc = type(o).__name__ == "LARC" and isinstance(getattr(o, "optim", None), Optimizer)
            raise TypeError(
                f"amp.initialize: optimizers must be torch.optim.Optimizer(s), got {type(o).__name__}"
                + ("; wrap the optimizer amp.initialize returns instead: opt = LARC(amp.initialize(model, "
                   "inner_optimizer, ...)[1]) (LARC rescales the gradients the step reads, after the unscale)."
                   if larc else ".")
            )
    if not enabled:
        _state = state
        return models if optimizers is None else (models, optimizers)
    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"num_losses={num_losses!r}; the number of losses is an int >= 1.")

    # 1. properties
    level = _check_opt_level(opt_level)
    brief, defaults = _LEVELS[level]
    props: dict[str, Any] = {"enabled": True, "opt_level": level, **defaults}
    _maybe_print(state, f"Selected optimization level {brief}", True)
    _maybe_print(state, "Defaults for this optimization level are:", True)
    _print_options(state, props)
    _maybe_print(state, "Processing user overrides (additional kwargs that are not None)...", True)
    overrides = {"cast_model_type": cast_model_type, "patch_torch_functions": patch_torch_functions,
                 "keep_batchnorm_fp32": keep_batchnorm_fp32, "master_weights": master_weights, "loss_scale": loss_scale}
    for name, value in overrides.items():
        if value is not None:
            _override(props, name, value)
    _check_scale_limits(props["loss_scale"], min_loss_scale, max_loss_scale)
    props["max_loss_scale"] = float(max_loss_scale)
    # 2. policy
    half_present = sorted({p.dtype for m in models_list for p in m.parameters()
                           if p.dtype.is_floating_point and p.dtype != _F32}, key=str)
    for i, m in enumerate(models_list):
        # (only where the cast is what makes Apex's check below fail: its '.half()' advice would mislead)
        if half_present and is_prepared(m) and not _amp_state.allow_incoming_model_not_fp32:
            raise ValueError(
                f"amp.initialize: model {i} ({type(m).__name__}) was already initialized (by amp.initialize or "
                "mixprec's prepare: its weights are cast and its optimizers wrapped). Call amp.initialize once per model "
                "and keep using the model and optimizers it returned; for another opt_level start from the FP32 model."
            )
    if half_present and not _amp_state.allow_incoming_model_not_fp32:
        name, param = next((n, p) for m in models_list for n, p in m.named_parameters()
                           if p.dtype.is_floating_point and p.dtype != _F32)
        raise ValueError(
            f"Found param {name} with type {param.dtype}, expected torch.float32. When using amp.initialize, you do "
            "not need to call .half() on your model before passing it, no matter what optimization level you choose "
            "(Apex's check). Pass the FP32 model, or set amp._amp_state.allow_incoming_model_not_fp32 = True before "
            "amp.initialize to take the model with the dtypes it has, as Apex allowed."
        )
    policy, keep = _policy_for(props, cast_model_outputs, half_present)
    _maybe_print(state, "After processing overrides, optimization options are:", True)
    _print_options(state, props)
    _maybe_print(state, f"{'mixprec policy':22} : {policy.label}" + (" (models left uncast)" if keep else ""), True)
    state.properties = {k: props[k] for k in _OPTION_NAMES}
    state.policy = policy

    # 3. models and optimizers: the models an optimizer spans are prepared together (one MixedPrecision)
    owner_of = {id(p): i for i, m in enumerate(models_list) for p in m.parameters()}
    group_of = list(range(len(models_list)))  # union-find over models joined by an optimizer

    def find(i: int) -> int:
        while group_of[i] != i:
            i = group_of[i]
        return i

    for j, opt in enumerate(opts_list):
        owners = {owner_of.get(id(p), -1) for g in opt.param_groups for p in g["params"]}
        if -1 in owners:
            raise ValueError(
                f"amp.initialize: optimizer {j} holds parameters that belong to none of the models passed; build "
                "each optimizer from the parameters of the models you pass to amp.initialize."
            )
        first, *rest = sorted(owners)
        for i in rest:
            group_of[find(i)] = find(first)
    components: dict[int, list[int]] = {}
    for i in range(len(models_list)):
        components.setdefault(find(i), []).append(i)
    opts_of: dict[int, list[int]] = {root: [] for root in components}
    for j, opt in enumerate(opts_list):
        any_param = next(p for g in opt.param_groups for p in g["params"])
        opts_of[find(owner_of[id(any_param)])].append(j)

    if not keep and policy.param_dtype == _F32 and half_present:
        for m in models_list:  # Apex's model.to(torch.float32) of an incoming half model (O0)
            m.to(_F32)
    scalers = [_make_scaler(props["loss_scale"], min_loss_scale, float(max_loss_scale)) for _ in range(num_losses)]
    returned: list[Any] = list(opts_list)
    device_types: set[str] = set()
    for root, members in components.items():
        models_here = [models_list[i] for i in members]
        device = _model_device(models_here[0])
        device_types.update(_model_device(m).type for m in models_here)
        # One model, or the models one optimizer spans in a container (their own forwards are untouched
        # by it; each model gets its own input/output casts below, as Apex patched each model's forward).
        target = models_here[0] if len(models_here) == 1 else nn.ModuleList(models_here)
        if opts_of[root]:
            prec = _AmpPrecision(policy, keep)
            _, *wrapped = prec.prepare(target, *(opts_list[j] for j in opts_of[root]))
            state.precs.append(prec)
            for j, opt in zip(opts_of[root], wrapped):
                returned[j] = opt
                rec = _OptimizerState(opt, prec)
                state.optimizers[id(opt)] = rec
                prec.amp_records[id(opt)] = rec
                setattr(opt, _OWNER_ATTR, state)
                _install_step(rec, state)
            region = prec.autocast()
        else:
            cast_module(target, policy, keep_dtypes=keep)
            region = autocast(policy, device.type)
        if target is not models_here[0]:
            for m in models_here:
                state.handles.append(cast_root(m, policy, keep_dtypes=keep))
        for m in models_here:
            if props["patch_torch_functions"]:
                state.handles.extend(_autocast_forward(m, region))
            elif not keep and policy.param_dtype != _F32:
                state.handles.extend(_fp32_state_dict(m))
    state.scalers = scalers
    state.device_types = tuple(sorted(device_types))
    _state = state

    out_models = list(models_list) if isinstance(models, (list, tuple)) else models
    if optimizers is None:
        return out_models
    return out_models, (returned if isinstance(optimizers, (list, tuple)) else returned[0])


def _fp32_state_dict(model: nn.Module) -> list[Any]:
    """Apex's O2/O3 ``state_dict`` hook: ``model.state_dict()`` (and every submodule's) returns FP32 tensors.

    Checkpoints then load into an FP32 model, and back into this one (``load_state_dict`` copies
    FP32 values into the half parameters, rounding; under O2 the FP32 masters take every changed
    value at the next step, through the master optimizer's edit check).
    """

    return [m.register_state_dict_post_hook(_StateDictToFP32()) for m in model.modules()]


class _StateDictToFP32:
    """The state-dict post-hook of :func:`_fp32_state_dict` (an object, not a closure: ``torch.save(model)`` pickles it)."""

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for key, value in state_dict.items():
            if key.startswith(prefix) and isinstance(value, Tensor) and value.dtype in (_F16, _BF16):
                state_dict[key] = value.float()


def _model_device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def _autocast_forward(model: nn.Module, region: contextlib.AbstractContextManager[Any]) -> list[Any]:
    """O1: run the model's forward inside ``region`` (torch.autocast in FP16), also when it raises; the hook handles.

    The hooks are objects, not closures, so the model still pickles (``torch.save(model)``), as under Apex.
    """
    return [model.register_forward_pre_hook(_EnterRegion(region)),
            model.register_forward_hook(_LeaveRegion(region), always_call=True)]


class _EnterRegion:
    """O1's forward pre-hook: enter the autocast region."""

    def __init__(self, region: contextlib.AbstractContextManager[Any]) -> None:
        self.region = region

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.region.__enter__()


class _LeaveRegion(_EnterRegion):
    """O1's forward hook (``always_call``): leave the autocast region."""

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:  # type: ignore[override]
        self.region.__exit__(None, None, None)


def _install_step(rec: _OptimizerState, state: _AmpState) -> None:
    """Put the front end's ``step`` over mixprec's guarded one: Apex's overflow line, then a fresh iteration.

    ``zero_grad`` is wrapped too: cleared gradients end a ``delay_unscale`` accumulation.
    """
    opt = rec.optimizer
    guarded = opt.step  # mixprec's guard: a direct optimizer.step() is prec.step(optimizer)
    zero_grad = opt.zero_grad

    # A method bound to the optimizer, as torch's LR schedulers built after initialize() wrap
    # optimizer.step through its __func__ and rebind it.
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if rec.depth > 0:  # mixprec stepping the optimizer from inside prec.step: the real step
            return guarded(*args, **kwargs)
        if rec.stage == "scaled":
            raise ValueError(
                "optimizer.step() after scale_loss(..., delay_unscale=True): the gradients still carry the loss "
                "scale. As in Apex, the last block before a step leaves delay_unscale=False (it unscales the "
                "accumulated gradients); nothing was changed."
            )
        rec.depth += 1
        try:
            result = guarded(*args, **kwargs)
        finally:
            rec.depth -= 1
        overflows, rec.overflows, rec.stage = rec.overflows, [], "idle"
        if state.verbosity >= 1:
            _report_skip(state, rec, overflows)
        return result

    def clear(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = zero_grad(*args, **kwargs)
        rec.stage, rec.scaled_loss_id, rec.stash = "idle", None, None
        return result

    if getattr(guarded, "_wrapped_by_lr_sched", False):
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # an LR scheduler built before initialize
    step.__doc__, clear.__doc__ = guarded.__doc__, zero_grad.__doc__
    opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]
    opt.zero_grad = types.MethodType(clear, opt)  # type: ignore[method-assign]
    opt.state_dict = types.MethodType(_apex_state_dict, opt)  # type: ignore[method-assign]
    opt.load_state_dict = types.MethodType(_apex_load_state_dict, opt)  # type: ignore[method-assign]


#: The keys a MasterWeightOptimizer's own state dict adds to torch's (see _apex_state_dict).
_MASTER_KEYS = ("version", "masters", "master_dtype", "grad_accumulation")


def _apex_state_dict(self: Any) -> dict[str, Any]:
    """``state_dict()`` of an optimizer ``initialize`` returned: torch's format, whatever the opt level.

    As Apex's: it loads into the plain torch optimizer of any opt level (an O2 checkpoint restored
    into an O0 run, or before ``initialize``). Under O2 the FP32 masters ride along under extra
    keys (``masters``, ... ; torch's ``load_state_dict`` ignores them), so an O2 run resumes with
    its exact masters (Apex rebuilt them from the rounded weights).
    """
    if not isinstance(self, MasterWeightOptimizer):
        return type(self).state_dict(self)
    sd = MasterWeightOptimizer.state_dict(self)
    return {**sd["optimizer"], **{k: sd[k] for k in _MASTER_KEYS}}


def _apex_load_state_dict(self: Any, state_dict: Mapping[str, Any]) -> None:
    """``load_state_dict`` of an optimizer ``initialize`` returned: any opt level's state (see :func:`_apex_state_dict`).

    A state without masters (saved at O0/O1/O3, or by a plain torch optimizer) loaded under O2:
    the masters are taken from the model's current weights, as Apex did (load the model first).
    """
    masters: Mapping[str, Any] | None
    if "optimizer" in state_dict and "masters" in state_dict:  # MasterWeightOptimizer's own format
        inner, masters = state_dict["optimizer"], state_dict
    else:
        inner = {k: v for k, v in state_dict.items() if k not in _MASTER_KEYS}
        masters = state_dict if "masters" in state_dict else None
    if not isinstance(self, MasterWeightOptimizer):
        type(self).load_state_dict(self, inner)
        return
    if masters is not None:
        MasterWeightOptimizer.load_state_dict(self, {**{k: masters[k] for k in _MASTER_KEYS if k in masters}, "optimizer": inner})
        return
    self.optimizer.load_state_dict(inner)
    self.load_master_values_({p: p.detach() for p in self.model_params})


def _report_skip(state: _AmpState, rec: _OptimizerState, overflows: list[tuple[int, Tensor]]) -> None:
    """Print Apex's line when the step just taken was skipped. Host sync: one read of the flags."""
    info = rec.prec.last_step
    if info is None:
        return
    flags = [info.skipped.float().reshape(())] + [f.to(info.skipped.device).reshape(()) for _, f in overflows]
    values = torch.stack(flags).tolist()  # the one host read
    if not values[0]:
        return
    for (loss_id, _), flag in zip(overflows, values[1:]):
        if flag:
            scaler = state.scalers[loss_id]
            scale = float(scaler.loss_scale.item())
            if isinstance(scaler, DynamicScaler):
                _maybe_print(state, f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to {scale}")
            else:
                _maybe_print(state, f"Gradient overflow.  Skipping step, loss scaler {loss_id} keeps its static loss "
                                    f"scale {scale} (mixprec skips steps with inf/NaN gradients under any loss scale)")
            return
    _maybe_print(state, "Gradient overflow.  Skipping step: inf/NaN gradients found at optimizer.step()")


# --------------------------------------------------------------------------------------------------
# the training step
# --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def scale_loss(
    loss: Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: nn.Module | None = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[Tensor]:
    """Yield ``loss.float() * scale`` for backward; unscale, check and update the scale at exit (Apex's ``amp.scale_loss``).

    Algorithm:
        * Entry (unless ``delay_unscale`` or a previous ``delay_unscale`` block left the
          gradients scaled): the gradients already there (unscaled) are set aside.
        * The block calls ``scaled_loss.backward()``; under O2 the FP16 gradients go straight into
          the FP32 master gradients.
        * Exit (unless ``delay_unscale``): the new gradients are divided by loss ``loss_id``'s
          scale and checked for inf/NaN (one fused kernel per device and dtype), the set-aside
          gradients are added back, and that scale is updated (x0.5 on overflow, x2 after 2000
          clean blocks, within ``[min_loss_scale, max_loss_scale]``). An overflow makes the next
          ``optimizer.step()`` skip (on the device) and print Apex's line at ``verbosity >= 1``.

    Args:
        loss: The loss (a tensor; ``loss.float() * scale`` is yielded).
        optimizers: The optimizer(s) (returned by ``initialize``) this backward makes gradients for.
        loss_id: Which loss scaler (``0 <= loss_id < num_losses``).
        model: Unused, as in Apex (reserved there).
        delay_unscale: Leave the gradients scaled (gradient accumulation); a later block of the
            same ``loss_id`` without it unscales everything. Never needed; Apex advised against it.
        delay_overflow_check: Not supported (Apex used it with its fused optimizers only).

    Yields:
        The scaled loss.

    Raises:
        ValueError: before ``initialize``; an optimizer ``initialize`` did not return; a bad
            ``loss_id``; ``delay_overflow_check=True``; ``delay_unscale=True`` after a block that
            already unscaled this step's gradients (they would mix scaled and unscaled).
    """
    latest = _require("amp.scale_loss")
    opts = [optimizers] if isinstance(optimizers, Optimizer) else list(optimizers)
    owner = _state_of(opts, "amp.scale_loss")
    state = owner if owner is not None else latest
    if not state.enabled:
        yield loss
        return
    if delay_overflow_check:
        raise ValueError(
            "scale_loss(delay_overflow_check=True) is not supported: Apex used it only with its fused optimizers. "
            "mixprec checks on the device without a host sync anyway; drop the argument."
        )
    if not isinstance(loss, Tensor):
        raise TypeError(f"scale_loss needs the loss tensor, got {type(loss).__name__}")
    records = [state.record(o, "amp.scale_loss") for o in opts]
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < len(state.scalers):
        raise ValueError(
            f"loss_id={loss_id!r} but amp.initialize(num_losses={len(state.scalers)}) made loss scalers "
            f"0..{len(state.scalers) - 1}; pass num_losses=<number of losses> to amp.initialize."
        )
    mixed = [r.scaled_loss_id for r in records if r.stage == "scaled" and r.scaled_loss_id != loss_id]
    if mixed:
        raise ValueError(
            f"scale_loss(loss_id={loss_id}) after scale_loss(loss_id={mixed[0]}, delay_unscale=True): the gradients "
            f"still carry loss {mixed[0]}'s scale and would be mixed with loss {loss_id}'s. Finish loss {mixed[0]}'s "
            f"accumulation with a block of loss_id={mixed[0]} without delay_unscale first, or use delay_unscale=False."
        )
    if delay_unscale:
        if any(r.stage == "unscaled" for r in records):
            raise ValueError(
                "scale_loss(delay_unscale=True) after a scale_loss block that already unscaled this step's gradients: "
                "the new gradients would stay scaled and be added to unscaled ones. Use delay_unscale=False (the "
                "default: every block unscales its own gradients), or step the optimizer first."
            )
    else:
        for r in records:
            if r.stage != "scaled":
                r.set_aside()
    scaler = state.scalers[loss_id]
    scaled = scaler.scale(loss.float())
    with tf32(state.policy is not None and state.policy.tf32):  # the backward runs in here, under the policy's TF32 setting
        yield scaled
    if delay_unscale:
        for r in records:
            r.stage, r.scaled_loss_id = "scaled", loss_id
        return
    found_inf = scaler.unscale_([g for r in records for g in r.new_grads()])
    for r in records:
        r.add_back()
    scaler.update(found_inf)
    for r in records:
        r.stage, r.scaled_loss_id = "unscaled", None
        r.overflows.append((loss_id, found_inf))


def master_params(optimizer: Optimizer) -> Iterator[Tensor]:
    """Yield the tensors ``optimizer`` updates: the FP32 masters under O2, the model's parameters otherwise.

    After ``scale_loss`` their ``.grad`` is unscaled: clip with
    ``torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm)`` as in Apex.

    Args:
        optimizer: An optimizer ``initialize`` returned (under O2 a ``MasterWeightOptimizer``).

    Yields:
        Each parameter of each of its param groups, in order.

    Example:
        >>> torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)  # doctest: +SKIP
    """
    for group in optimizer.param_groups:
        yield from group["params"]


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """A region where autocast is off (Apex's ``amp.disable_casts``): ops run in their inputs' dtype.

    Under O1 the model's forward runs in ``torch.autocast``; code inside this block (e.g. a
    numerically sensitive custom op) runs without it. Cast its inputs to FP32 yourself where needed.
    The autocast state of each device type the models live on (CPU before ``initialize``) is
    saved on entry and restored on exit, also when the block raises.

    Yields:
        Nothing; the block runs without autocast.

    Example:
        >>> with amp.disable_casts():  # doctest: +SKIP
        ...     y = my_sensitive_op(x.float())
    """
    state = _state
    device_types = state.device_types if state is not None and state.device_types else ("cpu",)
    with contextlib.ExitStack() as stack:
        for dt in device_types:
            stack.enter_context(torch.autocast(device_type=dt, enabled=False))
        yield


# --------------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------------
def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """The loss scalers' state in Apex's format: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}``.

    ``unskipped`` means what Apex's meant: for a dynamic scale, the clean ``scale_loss`` blocks
    since the last overflow or growth (the growth counter); for a static scale, the blocks that
    were not skipped (Apex skipped none under a static scale, so it counted every block; mixprec
    skips a block's step when its gradients are inf/NaN, and does not count it). The scalers of
    the latest ``initialize`` call, as Apex's module-level state held. Save it with the model's
    and the returned optimizer's state dicts (under O2 the optimizer's holds the FP32 masters).
    Host sync: reads the scales.
    """
    state = _require("amp.state_dict()")
    out: dict[str, Any] = OrderedDict() if destination is None else destination
    for i, scaler in enumerate(state.scalers):
        scale, unskipped = _scaler_entry(scaler)
        out[f"loss_scaler{i}"] = {"loss_scale": scale, "unskipped": unskipped}
    return out


def _scaler_entry(scaler: AmpScaler) -> tuple[float, int]:
    """``(loss_scale, unskipped)`` of one scaler, as Apex counted (see :func:`state_dict`). Host sync."""
    sd = scaler.state_dict()
    if isinstance(scaler, DynamicScaler):
        return float(sd["scale"]), int(sd["_growth_tracker"])
    return float(sd["scale"]), int(sd["steps"]) - int(sd["skipped_steps"])


def _set_entry(scaler: AmpScaler, loss_scale: float | None = None, unskipped: int | None = None) -> None:
    """Set a scaler's scale and/or Apex counter (``load_state_dict``, ``_amp_state.loss_scalers[i]._loss_scale = s``)."""
    full = scaler.state_dict()
    if loss_scale is not None:
        full["scale"] = float(loss_scale)
    if unskipped is not None:
        if isinstance(scaler, DynamicScaler):
            full["_growth_tracker"] = int(unskipped)
        else:  # a static scaler counts its blocks: that many clean ones, none skipped
            full.update(steps=int(unskipped), skipped_steps=0, consecutive_skips=0, floor_streak=0,
                        last_overflow_step=None)
    scaler.load_state_dict(full)


def load_state_dict(state_dict: Mapping[str, Any]) -> None:
    """Restore :func:`state_dict` output (also one saved by Apex) into the loss scalers.

    As Apex: a different number of scalers warns and loads the first ones.

    Raises:
        ValueError: keys that are not ``loss_scalerN``, or entries without ``loss_scale``/``unskipped``.
        TypeError: not a mapping.
    """
    state = _require("amp.load_state_dict()")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"amp.load_state_dict needs the dict amp.state_dict() returned, got {type(state_dict).__name__}")
    unexpected = [k for k in state_dict if "loss_scaler" not in str(k)]
    if unexpected:
        raise ValueError(
            f"Error(s) in loading state_dict. Unexpected key(s) in state_dict: {', '.join(map(repr, unexpected))}. "
            "Pass what amp.state_dict() returned (e.g. checkpoint['amp'])."
        )
    entries = list(state_dict.values())
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or "loss_scale" not in entry or "unskipped" not in entry:
            raise ValueError(f"amp.load_state_dict: entry {i} is {entry!r}; expected {{'loss_scale': ..., 'unskipped': ...}}.")
        # every entry before any is loaded: a damaged one must not leave the others half-loaded
        check_loaded_scale({"scale": entry["loss_scale"]}, f"amp (loss scaler {i})")
        if not is_count(entry["unskipped"]):
            raise ScalerStateError(f"amp.load_state_dict: loss scaler {i} has unskipped={entry['unskipped']!r}; a count "
                                   "of clean iterations is an int >= 0. Nothing was loaded.")
        if i < len(state.scalers) and isinstance(state.scalers[i], StaticScaler) and entry["loss_scale"] is not None:
            try:
                check_static_scale(float(entry["loss_scale"]))
            except ValueError as e:
                raise ScalerStateError(f"amp.load_state_dict: loss scaler {i}: {e} Nothing was loaded.") from None
    if len(entries) != len(state.scalers):
        warnings.warn(
            f"amp.load_state_dict: the state dict has {len(entries)} loss scaler(s), this run uses {len(state.scalers)} "
            f"(num_losses); loading the first {min(len(entries), len(state.scalers))}.", stacklevel=2)
    for scaler, entry in zip(state.scalers, entries):
        _set_entry(scaler, entry["loss_scale"], entry["unskipped"])


# --------------------------------------------------------------------------------------------------
# _amp_state: Apex's private module state, as far as Apex-era code reads and writes it
# --------------------------------------------------------------------------------------------------
class _LossScalerView:
    """``_amp_state.loss_scalers[i]``: Apex's ``LossScaler`` surface over mixprec loss scaler ``i``.

    ``loss_scale()`` (what training scripts log), ``_loss_scale`` (tests set it: the scaler's
    scale is set on the device), ``_unskipped`` (see :func:`state_dict`) and ``dynamic``. Reading
    either value is a host sync.
    """

    __slots__ = ("_scaler",)

    def __init__(self, scaler: AmpScaler) -> None:
        self._scaler = scaler

    def loss_scale(self) -> float:
        """The current loss scale (host sync)."""
        return _scaler_entry(self._scaler)[0]

    @property
    def _loss_scale(self) -> float:
        return _scaler_entry(self._scaler)[0]

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
            raise ValueError(f"_loss_scale={value!r}; a loss scale is a positive finite number.")
        _set_entry(self._scaler, loss_scale=float(value))

    @property
    def _unskipped(self) -> int:
        return _scaler_entry(self._scaler)[1]

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        _set_entry(self._scaler, unskipped=int(value))

    @property
    def dynamic(self) -> bool:
        """Whether the scale adapts (``loss_scale="dynamic"``)."""
        return isinstance(self._scaler, DynamicScaler)


class _Handle:
    """``_amp_state.handle``: Apex's ``AmpHandle`` of the latest ``initialize`` (``_deactivate``, ``is_active``)."""

    __slots__ = ("_run",)

    def __init__(self, run: _AmpState) -> None:
        self._run = run

    def is_active(self) -> bool:
        """Whether what ``initialize`` installed on the models is still there."""
        return self._run.enabled and self._run.active

    def _deactivate(self) -> None:
        """Remove what ``initialize`` installed on the models beyond ``prepare``: O1's autocast around each
        model's forward (the models then run in FP32, as after Apex's ``_deactivate``), O2/O3's FP32
        ``state_dict`` hooks and per-model casts. The optimizers keep working."""
        for h in reversed(self._run.handles):
            h.remove()
        self._run.handles.clear()
        self._run.active = False


class _AmpStateView:
    """``mixprec.apex._amp_state``: what Apex-era code reads and writes of Apex's private ``_amp_state``.

    A compatibility surface, not mixprec's API (use :func:`state_dict` and ``MixedPrecision``):

    * ``loss_scalers``: ``[_LossScalerView]`` of the latest ``initialize`` (``loss_scale()``,
      a settable ``_loss_scale``, ``_unskipped``, ``dynamic``);
    * ``opt_properties``: the latest run's properties (``opt_level``, ``cast_model_type``,
      ``keep_batchnorm_fp32``, ``master_weights``, ``loss_scale``, ...), read-only;
    * ``handle``: ``_deactivate()`` and ``is_active()``;
    * ``verbosity``: the latest run's, settable;
    * ``allow_incoming_model_not_fp32``: set it to ``True`` before ``initialize`` to pass models that
      already hold FP16/BF16 parameters (refused otherwise, as in Apex).

    Other attributes of Apex's (``hard_override``, which downgraded Apex's errors to warnings) do
    not exist: setting one raises rather than being silently ignored.
    """

    __slots__ = ("allow_incoming_model_not_fp32",)

    def __init__(self) -> None:
        self.allow_incoming_model_not_fp32 = False

    @property
    def loss_scalers(self) -> list[_LossScalerView]:
        return [_LossScalerView(s) for s in _require("amp._amp_state.loss_scalers").scalers]

    @property
    def opt_properties(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(**_require("amp._amp_state.opt_properties").properties)

    @property
    def handle(self) -> _Handle:
        return _Handle(_require("amp._amp_state.handle"))

    @property
    def verbosity(self) -> int:
        return _require("amp._amp_state.verbosity").verbosity

    @verbosity.setter
    def verbosity(self, value: int) -> None:
        _require("amp._amp_state.verbosity").verbosity = int(value)


_amp_state = _AmpStateView()


# --------------------------------------------------------------------------------------------------
# Apex's O1 registries: torch.autocast's op lists are fixed
# --------------------------------------------------------------------------------------------------
def _no_registry(name: str) -> ValueError:
    return ValueError(
        f"amp.{name} is not supported: under mixprec O1 is torch.autocast, whose per-op casting lists cannot be "
        "extended. Cast explicitly instead: call the function inside `with amp.disable_casts():` on inputs cast with "
        ".float() (FP32), or inside `with torch.autocast(device_type, dtype=torch.float16):` (FP16)."
    )


def register_half_function(module: Any, name: str) -> None:
    """Refused: torch.autocast's op lists are fixed (the error names the explicit cast to use)."""
    raise _no_registry("register_half_function")


def register_float_function(module: Any, name: str) -> None:
    """Refused: torch.autocast's op lists are fixed (the error names the explicit cast to use)."""
    raise _no_registry("register_float_function")


def register_promote_function(module: Any, name: str) -> None:
    """Refused: torch.autocast's op lists are fixed (the error names the explicit cast to use)."""
    raise _no_registry("register_promote_function")


def half_function(fn: Any) -> Any:
    """Refused: torch.autocast's op lists are fixed (the error names the explicit cast to use)."""
    raise _no_registry("half_function")


def float_function(fn: Any) -> Any:
    """Refused: torch.autocast's op lists are fixed (the error names the explicit cast to use)."""
    raise _no_registry("float_function")


def promote_function(fn: Any) -> Any:
    """Refused: torch.autocast's op lists are fixed (the error names the explicit cast to use)."""
    raise _no_registry("promote_function")
