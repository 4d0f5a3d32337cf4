"""A run's checkpoint: what ``MixedPrecision`` saves and restores, apart from the lifecycle.

:class:`RunCheckpoint` is the part of :class:`mixprec.MixedPrecision` that turns a prepared run
into a state dict and back (``state_dict``, ``load_state_dict``, ``load_model_state_dict``); the
file format, its checks and conversions are ``_checkpoint.py``'s.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any
from typing import cast as typing_cast

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.optim import Optimizer

from ._casting import _UNCAST_REASON
from ._checkpoint import (
    STATE_VERSION,
    canonical_name,
    canonical_state,
    check_model_state,
    check_optimizer_entries,
    key_mismatch_hint,
    load_model_state,
    model_state,
    parameter_names,
    validate_state,
)
from ._finite import combine_found_inf
from ._master import MasterWeightOptimizer
from ._policy import Policy
from ._scaler import LossScaler, check_scaler_state
from ._stepping import AppliedSteps, OptimizerRecord
from ._tree import tree_leaves

__all__ = ["RunCheckpoint"]


#: What ``EMA.applied()`` refuses while the model holds the averages: calls that would take them for the
#: training weights (``step()`` is refused through its optimizer's record).
_REFUSED_UNDER_EMA = ("backward()", "clip_grad_norm_()", "state_dict()", "load_state_dict()", "load_model_state_dict()")


def _names_mismatch(saved: list[list[str]], own: list[list[str]]) -> str:
    """The message for a checkpoint whose optimizers (as many as this run's) hold other parameters than this run's."""
    if sorted(map(tuple, saved)) == sorted(map(tuple, own)):
        return ("the checkpoint's optimizers hold the same parameters as this run's but in another order: pass the "
                "optimizers to prepare() in the order of the saved run. Nothing was loaded.")
    i = next(i for i, (a, b) in enumerate(zip(saved, own)) if a != b)
    a, b = saved[i], own[i]
    only_saved = [n for n in a if n not in b][:3]
    only_own = [n for n in b if n not in a][:3]
    detail = (f"the checkpoint's has {only_saved} where this run's has {only_own}" if only_saved or only_own
              else "the same names in another order (param groups built in another order?)")
    return (f"the checkpoint's optimizer {i} holds other parameters than this run's optimizer {i} ({len(a)} vs "
            f"{len(b)}; {detail}): a different model, or optimizers built over other parameters. Nothing was loaded.")


class RunCheckpoint:
    """Save and restore a prepared run (the checkpoint part of ``MixedPrecision``).

    The attributes are ``MixedPrecision``'s, set by its constructor and ``prepare``.
    """

    policy: Policy
    scaler: LossScaler
    model: nn.Module | None
    optimizers: list[Optimizer]
    _records: dict[int, OptimizerRecord]
    _iteration_flags: list[torch.Tensor]
    _applied_steps: AppliedSteps | None

    def _require_prepared(self, what: str) -> nn.Module:
        if self.model is None:
            raise ValueError(f"{what} before prepare(); call model, optimizer = prec.prepare(model, optimizer) first.")
        closed = self.__dict__.get("_closed")  # set by for_inference() on this run's model
        if closed and not (what == "state_dict()" and closed == _UNCAST_REASON):
            # (uncast_module leaves the weights and masters as they were: the run's state can still be saved)
            raise ValueError(f"{what}: {closed}")
        applied = self.__dict__.get("_ema_applied")  # set by EMA.applied() while the model holds the averages
        if applied and what in _REFUSED_UNDER_EMA:  # (reads of the run, e.g. applied_steps, are fine there)
            raise RuntimeError(f"{what}: {applied}")
        return self.model

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: policy, model, optimizers (with masters), scaler, step count.

        Keys (version 2):
            ``version`` (2), ``policy`` (the grammar string), ``model`` (``model.state_dict()`` with
            ``torch.compile``'s ``_orig_mod.`` left out of the keys, so compiled and uncompiled runs share checkpoints;
            parameters in the policy's dtypes), ``optimizers`` (one ``state_dict()`` per prepared
            optimizer; a ``MasterWeightOptimizer``'s includes the FP32 masters), ``param_names``
            (per optimizer, the qualified parameter names in param-group order, derived now, so
            ``add_param_group`` after ``prepare`` is covered), ``tied`` (``{alias: name}`` for
            tied parameters), ``scaler`` (the loss scaler's ``state_dict()``),
            ``applied_steps`` (int64 tensor), ``iteration`` (``{"found_inf": 0-d tensor or None,
            "stepped": [bool per optimizer]}``: the steps of an iteration that has not ended yet,
            so a checkpoint taken between two optimizers' steps resumes the same scale schedule).

        The tensors are references to live state (as ``nn.Module.state_dict`` returns); save it
        (``torch.save`` / ``mixprec.save``) before training on. Loads with ``weights_only=True``.

        Gradients are not saved (as in torch's checkpoints): taken after a ``backward`` and before
        its ``step`` (mid gradient accumulation), the checkpoint resumes from the weights before
        that step, without the micro-batches gathered so far or their inf/NaN check; a one-time
        ``UserWarning`` per run says so. Checkpoint after ``step()``.
        """
        model = self._require_prepared("state_dict()")
        if not self.__dict__.get("_warned_pending") and any(r.stage == "backward" for r in self._records.values()):
            self._warned_pending = True
            warnings.warn(
                "prec.state_dict() with gradients pending (a backward since the last step, e.g. mid gradient "
                "accumulation): checkpoints hold no gradients, so resuming from this one starts again from the weights "
                "before this step, without the micro-batches gathered so far (or their inf/NaN check). Take "
                "checkpoints after step() to resume bit for bit. (Said once per run.)",
                UserWarning,
                stacklevel=2,
            )
        names, tied = parameter_names(model, self.optimizers)
        abandon = getattr(self, "_abandon_unscaled", None)
        for rec in self._records.values():
            if rec.stage == "unscaled" and abandon is not None:
                # a batch skipped after its unscale (gradients cleared, no step): its inf/NaN flag joins the open
                # iteration now, as the next backward would fold it, so the checkpoint keeps the scale's back-off
                abandon(rec, raise_if_left=False, zeros=False)
        flags = self._iteration_flags
        pending = None
        if flags:
            pending = combine_found_inf(flags).clone()
        return {
            "version": STATE_VERSION,
            "policy": str(self.policy),
            "model": model_state(model),
            "optimizers": [o.state_dict() for o in self.optimizers],
            "param_names": names,
            "tied": tied,
            "scaler": self.scaler.state_dict(),
            "applied_steps": typing_cast(AppliedSteps, self._applied_steps).fold(),
            # (a run uncast_module closed has no records left: nothing stepped in its open iteration)
            "iteration": {"found_inf": pending, "stepped": [getattr(self._records.get(id(o)), "stepped", False)
                                                            for o in self.optimizers]},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (or a :func:`convert_state_dict` result) into a prepared run.

        Checkpoints of mixprec 0.1 (state version 1) load too.

        Raises:
            ValueError: not a mixprec state dict, another version, a different policy (the message
                names both and the conversion function), or a model/optimizer that does not match.
                Everything is validated before anything is loaded.
        """
        model = self._require_prepared("load_state_dict()")
        sd = validate_state(state_dict)
        saved = Policy.parse(sd["policy"])
        if saved != self.policy:
            raise ValueError(
                f"the checkpoint was saved under policy {str(saved)!r} but this run uses {str(self.policy)!r}; convert it "
                f"explicitly with mixprec.checkpoint.convert_state_dict(state, {self.policy.label!r}) "
                "before loading, or prepare the run with the saved policy."
            )
        if len(sd["optimizers"]) != len(self.optimizers):
            raise ValueError(f"the checkpoint has {len(sd['optimizers'])} optimizer(s), this run {len(self.optimizers)}.")
        check_model_state(model, sd["model"])
        names, _ = parameter_names(model, self.optimizers)
        saved_names = [list(n) for n in sd["param_names"]]
        if saved_names != names:
            raise ValueError(_names_mismatch(saved_names, names))
        # What the loads below would only find out after the model was already overwritten:
        check_optimizer_entries(self.optimizers, sd["optimizers"])
        _warn_stateless_entries(self.optimizers, sd["optimizers"], sd["applied_steps"])
        kind = getattr(self.scaler, "_kind", None)  # mixprec's scalers; a user's LossScaler checks its own
        if sd.get("scaler") is not None and kind is not None:
            check_scaler_state(sd["scaler"], type(self.scaler).__name__, kind)
        load_model_state(model, sd["model"])
        named = {canonical_name(n): p for n, p in model.named_parameters()}
        for opt, entry, pnames in zip(self.optimizers, sd["optimizers"], sd["param_names"]):
            if isinstance(opt, MasterWeightOptimizer) and "masters" not in entry:
                # A converted checkpoint: FP32 weights are in sd["model"], state in torch format.
                opt.optimizer.load_state_dict(entry)
                values: dict[torch.Tensor, torch.Tensor] = {named[n]: sd["model"][n] for n in pnames if n in sd["model"]}
                opt.load_master_values_(values)
            else:
                opt.load_state_dict(entry)
            _unalias_state(opt, entry)
        if sd.get("scaler") is not None:
            self.scaler.load_state_dict(sd["scaler"])
        counter = typing_cast(AppliedSteps, self._applied_steps)
        # A fresh tensor: the old one may be held by a StepInfo (or an earlier state_dict()).
        steps = sd["applied_steps"].to(device=counter.base.device, dtype=torch.int64, copy=True)
        counter.reset(steps)
        iteration = sd.get("iteration") or {}
        pending = iteration.get("found_inf")
        self._iteration_flags = [pending.to(steps.device)] if pending is not None else []
        stepped = iteration.get("stepped") or [False] * len(self.optimizers)
        for opt, was in zip(self.optimizers, stepped):
            rec = self._records[id(opt)]
            rec.stepped, rec.stage, rec.found_inf = bool(was), "idle", None

    @torch.no_grad()
    def load_model_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load a plain FP32 model checkpoint into the prepared run; masters take the exact FP32 values.

        Under a compensated policy (``bf16-pure``) each weight's compensation takes what its cast
        drops, as at ``prepare`` (``param + compensation`` is the loaded value to ~17 bits).

        Args:
            state_dict: ``model.state_dict()`` of an FP32 model (any dtype is accepted; values are
                cast into the model's dtypes).
            strict: As ``nn.Module.load_state_dict``.

        Raises:
            ValueError: (checked before anything is loaded: ``nn.Module.load_state_dict`` would
                copy the matching entries first) missing/unexpected keys with ``strict``, or a
                shape that differs from the model's.
        """
        model = self._require_prepared("load_model_state_dict()")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_model_state_dict needs a model state dict (a mapping), got {type(state_dict).__name__}")
        own = model_state(model)
        state_dict = canonical_state(state_dict)  # keys of a compiled model (or for one) match by canonical name
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise ValueError(
                f"load_model_state_dict: the state dict does not match the model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}; nothing was loaded. Pass strict=False to load the matching entries only."
                + key_mismatch_hint(missing, unexpected)
            )
        # (an unmaterialised lazy module's tensor takes the saved shape: torch's load materialises it)
        shapes = [k for k, v in state_dict.items()
                  if k in own and not is_lazy(own[k]) and tuple(v.shape) != tuple(own[k].shape)]
        if shapes:
            k = shapes[0]
            raise ValueError(
                f"load_model_state_dict: {k!r} has shape {tuple(state_dict[k].shape)} in the state dict but "
                f"{tuple(own[k].shape)} in the model ({len(shapes)} mismatch(es)); nothing was loaded."
            )
        load_model_state(model, state_dict, strict=strict)
        named = {canonical_name(n): p for n, p in model.named_parameters()}
        for opt in self.optimizers:
            if isinstance(opt, MasterWeightOptimizer):
                opt.load_master_values_({named[n]: v for n, v in state_dict.items() if n in named})
            elif hasattr(opt, "load_full_precision_params_"):
                # a compensated optimizer (bf16-pure): the compensation takes what the cast of each loaded
                # value drops; the one from before the load belongs to other weights
                mine = {id(p) for g in opt.param_groups for p in g["params"]}
                opt.load_full_precision_params_(
                    {named[n]: v for n, v in state_dict.items() if n in named and id(named[n]) in mine}
                )


def _unalias_state(optimizer: Optimizer, entry: Any) -> None:
    """Give the optimizer its own copy of every state tensor it took over from ``entry`` itself.

    ``torch.optim.Optimizer.load_state_dict`` keeps a state tensor that already has the right
    dtype and device as it is, so the next step would write into the caller's state dict: a
    state dict kept to roll back to (or compared against) would silently change. Only tensors
    that alias the given ones are copied (a load from another device copied them already).
    """
    # Plain tensors only: a tensor subclass (torchao's quantised optimizer states) may have no storage
    # of its own and no clone; it stays shared with the given dict.
    given = {t.data_ptr() for t in tree_leaves(entry) if type(t) is torch.Tensor and t.numel()}
    if not given:
        return
    for state in optimizer.state.values():
        if isinstance(state, dict):
            for k, v in state.items():
                if type(v) is torch.Tensor and v.numel() and v.data_ptr() in given:
                    state[k] = v.clone()


#: torch optimizers that hold state after their first step (SGD only with momentum; mixprec.optim's always).
_STATEFUL = (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adamax,
             torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta)


def _warn_stateless_entries(optimizers: list[Any], entries: list[Any], applied_steps: Any) -> None:
    """Warn when an optimizer that keeps state loads none although the checkpoint's run applied steps.

    The usual cause: ``torch.distributed.checkpoint.load`` into a template taken before the
    first step (torch's AdamW creates its state lazily, so the template has no entries and the
    saved moments are never read). A warning, not an error: an optimizer of a multi-optimizer run
    that never stepped legitimately has no state. Host read of the step count (loading only).
    """
    applied = int(applied_steps) if isinstance(applied_steps, torch.Tensor) else int(applied_steps or 0)
    if applied <= 0:
        return
    from .optim import LowPrecisionOptimizer

    for i, (opt, entry) in enumerate(zip(optimizers, entries)):
        inner_entry = entry.get("optimizer") if isinstance(entry, Mapping) and "masters" in entry else entry
        if not isinstance(inner_entry, Mapping) or inner_entry.get("state"):
            continue
        inner = opt.optimizer if isinstance(opt, MasterWeightOptimizer) else opt
        stateful = isinstance(inner, (*_STATEFUL, LowPrecisionOptimizer)) or (
            isinstance(inner, torch.optim.SGD) and any(g.get("momentum", 0) for g in inner.param_groups))
        if stateful:
            warnings.warn(
                f"load_state_dict(): optimizer {i} ({type(inner).__name__}) loads no state (moments, step counts) "
                f"although the checkpoint's run applied {applied} step(s), so it starts afresh. With "
                "torch.distributed.checkpoint the template passed to dcp.load was taken before the optimizer's first "
                "step, when it had no state entries to fill: take one step first, or initialise the state as "
                "torch.distributed.checkpoint.state_dict does (docs/distributed.md). If this optimizer never stepped "
                "in that run, ignore this.",
                UserWarning, stacklevel=3)

