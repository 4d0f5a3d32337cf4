"""``EMA``: an FP32 exponential moving average of the weights that skips skipped steps, without a host sync.

The average is taken of the weights the optimizer really steps: the FP32 masters under
``*-master`` policies, the FP32 parameters under ``fp32``/``tf32``/``*-mixed``, and the
half-precision parameters upcast to FP32 under ``bf16-pure``/``fp16-pure``. A step that
``MixedPrecision.step`` skipped (inf/NaN gradients) leaves the average unchanged (``ema + 0``);
the decision stays on the device (``StepInfo.mask()``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ._casting import run_of
from ._checkpoint import canonical_name
from ._errors import eager_only
from ._master import MasterWeightOptimizer
from ._precision import MixedPrecision
from ._stepping import StepInfo

__all__ = ["EMA"]

#: Version of the dict :meth:`EMA.state_dict` returns.
EMA_STATE_VERSION = 1
_STATE_KEYS = ("version", "decay", "warmup", "num_updates", "averages")


@eager_only(
    "mixprec.EMA.update runs eagerly behind one graph break: keep it outside torch.compile(fullgraph=True)"
)
def _update_outside_trace(ema: EMA, info: StepInfo | None) -> None:
    """``EMA.update`` reached from a traced frame: eagerly, behind a graph break (the masters' edit check
    works on cached views made without gradients, which a trace refuses to see written)."""
    ema.update(info)


def _average_dtype(t: torch.Tensor) -> torch.dtype:
    """FP32 for a real parameter; a complex one keeps its complex dtype (``.float()`` would drop its imaginary part)."""
    return t.dtype if t.is_complex() else torch.float32


class EMA:
    """An FP32 exponential moving average of a model's weights, updated only on applied steps.

    Algorithm (per tracked parameter, in FP32, on the parameter's device)::

        w    = master (``*-master``) | parameter (FP32 policies) | float(parameter) (``*-pure``)
        m    = info.mask()                       # 1 if the step was applied, 0 if it was skipped
        d    = min(decay, (1 + n) / (10 + n)) if warmup else decay   # n: applied updates so far
        ema  = ema + (1 - d) * m * (w - ema)     # one torch._foreach_lerp_ over all parameters
        n    = n + m

    A skipped step has ``m = 0``: the average and ``n`` stay as they were. The warm-up is the
    one of TensorFlow's ``ExponentialMovingAverage(num_updates=...)``: early averages forget
    the random initialisation quickly, and it counts applied steps only.

    Every floating (or complex) parameter of the model is tracked once (tied parameters, e.g. GPT-2's
    ``wte``/``lm_head``, under their first name), frozen ones included. Buffers (BatchNorm
    running statistics) are not averaged: :meth:`applied` and :meth:`copy_to` leave them as
    they are.

    Args:
        source: A prepared :class:`MixedPrecision` (the usual case: the average follows its
            masters, and :meth:`update` reads ``prec.last_step``), or a plain ``nn.Module``
            (its parameters, upcast to FP32; :meth:`update` without ``info`` counts every call
            as an applied step).
        decay: The weight of the old average, in ``[0, 1]`` (default 0.999; 0.9999 for long
            runs).
        warmup: Use ``min(decay, (1 + n) / (10 + n))`` as the decay (default ``False``).

    Raises:
        TypeError: ``source`` is neither a ``MixedPrecision`` nor an ``nn.Module``; ``decay`` is
            not a number; ``warmup`` is not a bool.
        ValueError: ``source`` is a ``MixedPrecision`` that was not prepared; ``decay`` is
            outside ``[0, 1]``; the model has no floating parameters.

    Host syncs: none in the constructor's average or in :meth:`update`; :meth:`applied`,
    :meth:`copy_to` and :meth:`state_dict` need none either (the copies are device kernels).

    Example::

        prec = mp.MixedPrecision("bf16-master")
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
        ema = mp.EMA(prec, decay=0.999)
        for x, y in loader:
            with prec.autocast():
                loss = F.cross_entropy(model(x), y)
            prec.backward(loss)
            prec.step(opt)                  # or opt.step()
            ema.update()                    # no host sync; unchanged when the step was skipped
            opt.zero_grad(set_to_none=True)
        with ema.applied():                 # the averaged weights, cast to the model's dtypes
            evaluate(model)                 # training weights and masters restored afterwards
    """

    def __init__(self, source: MixedPrecision | nn.Module, decay: float = 0.999, *, warmup: bool = False) -> None:
        if isinstance(source, MixedPrecision):
            if source.model is None:
                raise ValueError(
                    "EMA(prec) before prec.prepare(...); call model, optimizer = prec.prepare(model, optimizer) first, "
                    "then ema = mixprec.EMA(prec, decay=...)."
                )
            model: nn.Module = source.model
            self.prec: MixedPrecision | None = source
        elif isinstance(source, nn.Module):
            model = source
            self.prec = None
        else:
            raise TypeError(
                f"EMA(source, ...) needs a prepared mixprec.MixedPrecision or an nn.Module, got {type(source).__name__}; "
                "pass the MixedPrecision whose prepare() you called (ema = mixprec.EMA(prec, decay=0.999))."
            )
        self.decay: float = _check_decay(decay)
        if not isinstance(warmup, bool):
            raise TypeError(f"EMA(..., warmup={warmup!r}) needs a bool (True or False).")
        self.warmup: bool = warmup
        self.model: nn.Module = model
        # tied ones once; names without torch.compile's '_orig_mod.' so a compiled run's EMA loads uncompiled
        named = [(canonical_name(n), p) for n, p in model.named_parameters() if p.dtype.is_floating_point or p.is_complex()]
        if not named:
            raise ValueError(f"EMA: the model ({type(model).__name__}) has no floating-point parameters to average.")
        self.names: list[str] = [n for n, _ in named]
        self._params: list[torch.Tensor] = [p for _, p in named]
        with torch.no_grad():
            self._averages: list[torch.Tensor] = [s.detach().to(_average_dtype(s), copy=True) for s in self._sources()]
        device = self._params[0].device
        self.num_updates: torch.Tensor = torch.zeros((), dtype=torch.int64, device=device)
        self._last_info: StepInfo | None = None

    def __repr__(self) -> str:
        source = "MixedPrecision" if self.prec is not None else type(self.model).__name__
        return f"EMA({source}, decay={self.decay}, warmup={self.warmup}, {len(self.names)} tensors)"

    # ----- what is averaged -----------------------------------------------------------------------
    def _sources(self) -> list[torch.Tensor]:
        """The FP32 truth of every tracked parameter: its master where it has one, else itself."""
        masters: dict[int, torch.Tensor] = {}
        if self.prec is not None:
            for opt in self.prec.optimizers:
                if isinstance(opt, MasterWeightOptimizer):
                    # Looked up at each call: masters of unfrozen parameters and added param groups appear later.
                    # master_values: exact FP32 values also where masters are stored as weight + remainder.
                    masters.update((id(p), m) for p, m in zip(opt.model_params, opt.master_values()) if p is not m)
        return [masters.get(id(p), p).detach() for p in self._params]

    @property
    def averages(self) -> dict[str, torch.Tensor]:
        """The FP32 averages by parameter name (the live tensors; clone them to keep a copy)."""
        return dict(zip(self.names, self._averages))

    def decay_now(self) -> torch.Tensor:
        """The decay the next applied :meth:`update` uses, as a 0-d FP32 tensor on the device (no host sync)."""
        if not self.warmup:
            return torch.full((), self.decay, dtype=torch.float32, device=self.num_updates.device)
        n = self.num_updates.to(torch.float32)
        return torch.clamp((1 + n) / (10 + n), max=self.decay)

    # ----- the update -------------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, info: StepInfo | None = None) -> None:
        """Move the average towards the current weights, unless the step was skipped.

        Call it once after each ``prec.step(opt)`` (or ``opt.step()`` on the optimizer
        ``prepare`` returned).

        Args:
            info: The :class:`StepInfo` of the step. Default: ``prec.last_step`` of the
                ``MixedPrecision`` this EMA follows; for an EMA over a plain module, every call
                counts as an applied step.

        Raises:
            ValueError: no step has been taken yet (``prec.last_step`` is ``None``), or this
                ``StepInfo`` was already used for an update (``update`` called twice after one
                step, e.g. once per micro-batch: call it once per optimizer step).
            TypeError: ``info`` is not a ``StepInfo``.

        Host syncs: none. The skip decision is ``info.mask()``, a 0-d tensor on the device; the
        update is ``torch._foreach_lerp_`` per device with 0-d tensor weights (a ``lerp_`` kernel per
        tensor; plus an FP32 upcast of half-precision parameters under ``*-pure`` policies).
        """
        if torch.compiler.is_compiling():  # torch.compile(ema.update), or a compiled train step around it
            return _update_outside_trace(self, info)
        if info is None and self.prec is not None:
            info = self.prec.last_step
            if info is None:
                raise ValueError(
                    "EMA.update() before any step: call it after prec.step(optimizer) (or optimizer.step()), once per step."
                )
        if info is not None:
            if not isinstance(info, StepInfo):
                raise TypeError(f"EMA.update(info) needs the StepInfo that prec.step() returned, got {type(info).__name__}.")
            if info is self._last_info:
                raise ValueError(
                    "EMA.update(): this step was already averaged (update() called twice after one step, e.g. once per "
                    "micro-batch under gradient accumulation), it came before ema.load_state_dict(), or no step ran "
                    "since (a batch skipped without a step); call ema.update() once after each prec.step(optimizer)."
                )
            self._last_info = info
            mask = info.mask(torch.float32).to(self.num_updates.device)
        else:
            mask = torch.ones((), dtype=torch.float32, device=self.num_updates.device)
        weight = (1 - self.decay_now()) * mask  # 0 on a skipped step: lerp leaves the average unchanged
        sources = [s if s.dtype == a.dtype else s.to(a.dtype) for s, a in zip(self._sources(), self._averages)]
        for device, (avgs, srcs) in _by_device(self._averages, sources).items():
            # A list of 0-d tensor weights, not the tensor itself: torch has no 0-d tensor overload of
            # _foreach_lerp_, so a bare tensor becomes a Python scalar (.item(): a host sync on a GPU,
            # measured on an H200). With per-tensor 0-d weights torch runs lerp_ per tensor in C++
            # (one kernel each, no sync), lerp's own rounding kept.
            w = weight if weight.device == device else weight.to(device)
            torch._foreach_lerp_(avgs, srcs, [w] * len(avgs))
        self.num_updates += mask.to(torch.int64)

    # ----- using the average --------------------------------------------------------------------------
    def _targets(self, model: nn.Module | None, what: str) -> list[torch.Tensor]:
        """The parameters of ``model`` (default: the tracked one) that receive the averages, checked first."""
        if model is None or model is self.model:
            return self._params
        if not isinstance(model, nn.Module):
            raise TypeError(f"EMA.{what}(model) needs an nn.Module, got {type(model).__name__}.")
        own = {canonical_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}
        missing = [n for n in self.names if n not in own]
        if missing:
            raise ValueError(
                f"EMA.{what}(model): the model has no parameter(s) {missing[:5]} ({len(missing)} of {len(self.names)} "
                "tracked); pass a model with the same structure as the one the EMA was built from."
            )
        shapes = [n for n, a in zip(self.names, self._averages) if tuple(own[n].shape) != tuple(a.shape)]
        if shapes:
            n = shapes[0]
            raise ValueError(
                f"EMA.{what}(model): {n!r} has shape {tuple(own[n].shape)} in the model but {tuple(self.averages[n].shape)} "
                f"in the EMA ({len(shapes)} mismatch(es)); pass a model with the same structure."
            )
        return [own[n] for n in self.names]

    @torch.no_grad()
    def copy_to(self, model: nn.Module | None = None) -> None:
        """Copy the averages into ``model``'s parameters, cast to each parameter's dtype (for export).

        Args:
            model: A model with the tracked parameter names and shapes, e.g. an FP32 copy for
                export. Default: the tracked model itself, whose training weights are then
                replaced (under ``*-master`` policies the masters take the rounded averages at
                the next step); use :meth:`applied` to evaluate and go on training.

        Raises:
            ValueError: ``model`` lacks a tracked parameter or has another shape; nothing is copied.
            TypeError: ``model`` is not an ``nn.Module``.
        """
        targets = self._targets(model, "copy_to")
        _copy(targets, self._averages)

    @contextlib.contextmanager
    def applied(self, model: nn.Module | None = None) -> Iterator[nn.Module]:
        """Swap the averages into the model for evaluation; restore the training weights on exit.

        The training weights are kept in a copy (in their own dtype) and copied back bit for bit
        when the block ends, also when it raises. Masters are never touched: they stay exact,
        and the restored half weights equal ``round(master)`` again, so no edit is carried into
        the masters at the next step. Inside the block (on the tracked model of an ``EMA(prec)``)
        ``prec.backward``, ``prec.step``/``optimizer.step()`` of a master-weight optimizer,
        ``prec.clip_grad_norm_`` and ``prec.state_dict()``/``optimizer.state_dict()`` raise a
        ``RuntimeError``: they would take the averages for the training weights (a checkpoint of
        the averages; under ``*-master`` the averages carried into the masters). Save after the
        block; save the averages with ``ema.state_dict()``.

        Args:
            model: Default: the tracked model. Or another model with the same parameter names
                and shapes (e.g. an evaluation copy).

        Yields:
            The model, holding the averages cast to its dtypes.

        Raises:
            ValueError: ``model`` lacks a tracked parameter or has another shape; nothing changes.
            TypeError: ``model`` is not an ``nn.Module``.

        Memory: one copy of the tracked parameters in the model's dtypes, for the block.
        """
        targets = self._targets(model, "applied")
        # The run's own model holds the averages for the block: refuse what would take them for the
        # training weights (backward, a step, state_dict, clipping) until it ends.
        marks = self._block_marks() if (model is None or model is self.model) else []
        with torch.no_grad():
            saved = [t.detach().clone() for t in targets]
            _copy(targets, self._averages)
        for obj, attr, _ in marks:
            setattr(obj, attr, _APPLIED_MESSAGE)
        try:
            yield model if model is not None else self.model
        finally:
            for obj, attr, before in marks:
                setattr(obj, attr, before)
            with torch.no_grad():
                _copy(targets, saved)

    def _block_marks(self) -> list[tuple[Any, str, Any]]:
        """``(object, attribute, value before)`` to set to the refusal during :meth:`applied` (nested blocks restore theirs).

        The run (``_ema_applied``: backward, clipping, ``state_dict``), its master-weight optimizers
        (their edit sync: step, ``state_dict``), and its optimizers' records (``blocked``: ``prec.step``,
        whose hot path reads nothing else; a step here updated the averages, which the block's end
        then overwrote: the update lost, its optimizer state and count kept).
        """
        prec = self.prec if self.prec is not None else run_of(self.model)  # EMA(model) of a prepared model: its run
        if prec is None:
            return []
        objs: list[tuple[Any, str]] = [(prec, "_ema_applied"),
                                       *((o, "_ema_applied") for o in prec.optimizers if isinstance(o, MasterWeightOptimizer)),
                                       *((rec, "blocked") for rec in prec._records.values())]
        return [(o, attr, getattr(o, attr, None)) for o, attr in objs]

    # ----- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The average and its settings, to save with the run.

        Keys (version 1):
            ``version`` (1), ``decay`` (float), ``warmup`` (bool), ``num_updates`` (0-d int64
            tensor: applied updates so far), ``averages`` (``{parameter name: FP32 tensor}``).

        The tensors are references to live state (as ``nn.Module.state_dict`` returns); save it
        before training on. It loads with ``torch.load(weights_only=True)``. Save it inside the
        mixprec checkpoint: ``state = prec.state_dict(); state["ema"] = ema.state_dict();
        mixprec.save(state, path)`` (docs/ema.md).
        """
        return {
            "version": EMA_STATE_VERSION,
            "decay": self.decay,
            "warmup": self.warmup,
            "num_updates": self.num_updates,
            "averages": self.averages,
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; everything is checked before anything is loaded.

        Raises:
            ValueError: not an EMA state dict, another version, a ``decay``/``warmup`` other than
                this EMA's (construct it with the saved ones), or averages that do not match the
                model (names or shapes: a different model).
            TypeError: ``state_dict`` is not a mapping.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"EMA.load_state_dict needs the dict EMA.state_dict() returned, got {type(state_dict).__name__}.")
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(
                f"not an EMA state dict: missing {missing} (has {sorted(map(str, state_dict))[:8]}); pass what "
                "EMA.state_dict() returned (e.g. state['ema'] of your checkpoint)."
            )
        if state_dict["version"] != EMA_STATE_VERSION:
            raise ValueError(
                f"EMA state version {state_dict['version']!r}; this mixprec reads version {EMA_STATE_VERSION} (upgrade mixprec?)."
            )
        if state_dict["decay"] != self.decay or state_dict["warmup"] != self.warmup:
            raise ValueError(
                f"the checkpoint's EMA has decay={state_dict['decay']!r}, warmup={state_dict['warmup']!r} but this EMA "
                f"decay={self.decay!r}, warmup={self.warmup!r}; construct it with the saved settings "
                f"(mixprec.EMA(prec, decay={state_dict['decay']!r}, warmup={state_dict['warmup']!r})) before loading."
            )
        averages = state_dict["averages"]
        if not isinstance(averages, Mapping):
            raise ValueError(f"the EMA state's 'averages' is a {type(averages).__name__}, not a dict of tensors.")
        missing_names = [n for n in self.names if n not in averages]
        unexpected = [n for n in averages if n not in self.names]
        if missing_names or unexpected:
            raise ValueError(
                f"the checkpoint's EMA does not match this model: missing {missing_names[:5]}, unexpected "
                f"{[str(n) for n in unexpected[:5]]}; load it into an EMA of the model it was saved from."
            )
        for n, a in zip(self.names, self._averages):
            v = averages[n]
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(a.shape):
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(
                    f"the checkpoint's EMA average {n!r} is {got}, the model's parameter {tuple(a.shape)}; load it into an "
                    "EMA of the model it was saved from."
                )
        n_up = state_dict["num_updates"]
        if not isinstance(n_up, torch.Tensor) or n_up.numel() != 1:
            raise ValueError(f"the EMA state's 'num_updates' must be a 0-d tensor, got {n_up!r}.")
        for n, a in zip(self.names, self._averages):
            a.copy_(averages[n])
        self.num_updates.copy_(n_up.reshape(()))
        # The step before the load is not one for these averages: update() waits for the next step.
        self._last_info = self.prec.last_step if self.prec is not None else None


_APPLIED_MESSAGE = (
    "called inside `with ema.applied():`, while the model holds the EMA averages, not its training weights (this "
    "would train on, clip or save the averages as the run's weights; under '*-master' they would be carried into the "
    "FP32 masters). Leave the block first: it restores the training weights bit for bit. To save the averages, "
    "save ema.state_dict() beside prec.state_dict()."
)


def _check_decay(decay: Any) -> float:
    if isinstance(decay, bool) or not isinstance(decay, (int, float)):
        raise TypeError(f"EMA(..., decay={decay!r}) needs a number in [0, 1], e.g. decay=0.999.")
    if not (math.isfinite(decay) and 0.0 <= decay <= 1.0):
        raise ValueError(f"EMA(..., decay={decay!r}): decay must be in [0, 1] (e.g. 0.999; 0.9999 for long runs).")
    return float(decay)


def _by_device(*lists: list[torch.Tensor]) -> dict[torch.device, tuple[list[torch.Tensor], ...]]:
    """Group parallel lists by the device of the first list's tensors (foreach kernels need one device)."""
    groups: dict[torch.device, tuple[list[torch.Tensor], ...]] = {}
    for items in zip(*lists):
        group = groups.setdefault(items[0].device, tuple([] for _ in lists))
        for bucket, t in zip(group, items):
            bucket.append(t)
    return groups


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` (casting to ``dst``'s dtype), fused per device."""
    for dsts, srcs in _by_device(dst, src).values():
        torch._foreach_copy_([d.detach() for d in dsts], srcs)
