"""``MixedPrecision``: one object that owns the mixed-precision lifecycle of a training run.

cast (FP32 islands) -> autocast -> scaled backward -> unscale + inf/NaN check -> step or skip on
the device -> loss-scale update -> state_dict. The policy, the loss scaler, the master
weights and the optimizer state are saved and restored together, so a resumed run continues
bit for bit.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal
from typing import cast as typing_cast

import torch
from torch import nn
from torch.optim import Optimizer

from ._autocast import autocast
from ._casting import cast_module, is_prepared, uncast_module
from ._dtypes import check_device_support, dtype_name, parse_dtype
from ._master import GradAccumulation, MasterWeightOptimizer
from ._policy import Policy
from ._scaler import DynamicScaler, LossScaler, NoOpScaler, StaticScaler
from ._stepping import step_optimizer
from .distributed import check_prepare_target, local_grad

__all__ = [
    "MixedPrecision",
    "StepInfo",
    "convert_state_dict",
    "for_inference",
    "fp32_state_dict",
    "scaler_for_policy",
]

_STATE_VERSION = 1
_Stage = Literal["idle", "backward", "unscaled"]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What one :meth:`MixedPrecision.step` did, as 0-d tensors on the device (no host sync).

    Attributes:
        found_inf: 1.0 when a gradient was inf/NaN (float32).
        skipped: ``True`` when the optimizer step was skipped (bool).
        scale: The loss scale this step's gradients were divided by (float32; 1.0 unscaled).
        applied_steps: Optimizer steps applied so far in this run (int64).
    """

    found_inf: torch.Tensor
    skipped: torch.Tensor
    scale: torch.Tensor
    applied_steps: torch.Tensor

    def applied(self) -> bool:
        """Whether the step was applied. Host sync: reads ``skipped``."""
        return not bool(self.skipped.item())

    def mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """1 if the step was applied, 0 if skipped, as a 0-d tensor: gate EMA updates without a sync.

        Example:
            ``torch._foreach_lerp_(ema, params, (1 - decay) * info.mask())``
        """
        return (~self.skipped).to(dtype)


def scaler_for_policy(policy: Policy | str) -> LossScaler:
    """Return the loss scaler a policy asks for: none, static (``init_scale`` or 1) or dynamic (``init_scale`` or 2**16)."""
    policy = Policy.parse(policy)
    if policy.loss_scale == "none":
        return NoOpScaler()
    if policy.loss_scale == "static":
        return StaticScaler(policy.init_scale if policy.init_scale is not None else 1.0)
    if policy.init_scale is not None:
        return DynamicScaler(init_scale=policy.init_scale)
    return DynamicScaler()


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


class MixedPrecision:
    """Train any model under a precision policy with one object.

    Args:
        policy: A :class:`Policy`, a preset (``"bf16-mixed"``, ``"fp16-master"``, ...), an alias or
            the ``p=...,c=...`` grammar.
        scaler: A loss scaler to use instead of the one the policy implies.
        grad_accumulation: For master-weight policies: ``"fp32"`` (default) accumulates gradients
            into the FP32 masters during backward; ``"compute"`` keeps them in the compute dtype
            until the step (least persistent memory).

    Lifecycle (each raises a clear error when called out of order)::

        prec = MixedPrecision("fp16-master")
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
        for x, y in loader:
            with prec.autocast():
                loss = F.cross_entropy(model(x), y)
            prec.backward(loss)           # scaled when the policy needs it
            prec.clip_grad_norm_(1.0)     # optional; on unscaled FP32 gradients
            info = prec.step(opt)         # skipped on inf/NaN, decided on the device
            opt.zero_grad(set_to_none=True)

    Every policy, also FP32 and BF16 ones without loss scaling, checks the gradients for
    inf/NaN and skips such a step, so a NaN never reaches the weights.

    Host syncs: none in ``backward``/``clip_grad_norm_``; none in ``step`` when the optimizer
    can skip on the device (``_step_supports_amp_scaling``: torch's ``fused=True`` optimizers,
    ``mixprec.optim``, and ``MasterWeightOptimizer`` around either); otherwise one read of
    ``found_inf`` per step. ``step(..., schedulers=...)`` adds one read of ``skipped``.
    """

    def __init__(
        self,
        policy: Policy | str = "bf16-mixed",
        *,
        scaler: LossScaler | None = None,
        grad_accumulation: GradAccumulation = "fp32",
    ) -> None:
        self.policy = Policy.parse(policy)
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise TypeError(f"scaler must implement mixprec.LossScaler, got {type(scaler).__name__}")
        if grad_accumulation not in ("fp32", "compute"):
            raise ValueError(f"grad_accumulation={grad_accumulation!r}; use 'fp32' (default) or 'compute'.")
        self.scaler: LossScaler = scaler if scaler is not None else scaler_for_policy(self.policy)
        self.grad_accumulation: GradAccumulation = grad_accumulation
        self.model: nn.Module | None = None
        self.optimizers: list[Optimizer] = []
        self.device: torch.device | None = None
        self._stage: dict[int, _Stage] = {}
        self._found_inf: dict[int, torch.Tensor] = {}
        self._iteration_found_inf: list[torch.Tensor] = []
        self._applied_steps: torch.Tensor | None = None
        self._param_names: list[list[str]] = []
        self.check_result: Any = None  # the pre-flight CheckResult when prepare(check_batch=...) ran it

    def __repr__(self) -> str:
        state = "prepared" if self.model is not None else "not prepared"
        return f"MixedPrecision({str(self.policy)!r}, scaler={type(self.scaler).__name__}, {state})"

    # ----- prepare ---------------------------------------------------------------------------------
    def prepare(
        self,
        model: nn.Module,
        *optimizers: Optimizer,
        check_batch: Any = None,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        on_check_fail: Literal["warn", "raise"] = "warn",
    ) -> tuple[Any, ...]:
        """Cast ``model`` for the policy and wrap the optimizers it needs.

        * ``fp32``/``tf32``/``*-mixed``: parameters stay FP32, FP32 islands and output casting
          are hooked in, the optimizers are returned unchanged.
        * ``*-master``: parameters are cast to half precision (islands stay FP32) and each
          optimizer is wrapped in a :class:`MasterWeightOptimizer` whose masters are the exact
          FP32 weights from before the cast.
        * compensated half parameters (``bf16-pure``): parameters are cast and a
          ``torch.optim`` AdamW/Adam/SGD is converted to the ``mixprec.optim`` optimizer with
          the policy's compensation, seeded with what the cast lost.
        * other half-parameter policies (``fp16-pure``, ``bf16-true``): cast, optimizer unchanged.

        Args:
            model: The model, with FP32 parameters on its training device.
            *optimizers: One or more optimizers built from ``model``'s parameters.
            check_batch: Optional first batch: before anything is cast, run the pre-flight check
                (:func:`mixprec.numerics.preflight`: one forward/backward in FP32 and under the
                policy, on copies of the model) and warn or raise on a bad verdict. Precision is
                never switched for you. The result is kept in ``self.check_result``.
            loss_fn: ``loss_fn(model, batch) -> scalar loss`` for the check (forward only if ``None``).
            on_check_fail: ``"warn"`` (default) or ``"raise"`` (:class:`mixprec.NumericsError`).

        Returns:
            ``(model, optimizer, ...)``: the same model object, then the optimizers to use from
            now on (wrapped where the policy needs it).

        Raises:
            ValueError: prepared twice; no optimizer; an optimizer holding tensors that are not
                this model's parameters; a half-precision model under a policy with FP32
                parameters; a dtype the device cannot compute in. Nothing is changed when it raises.
            TypeError: wrong argument types.
        """
        if self.model is not None:
            raise ValueError(
                "prepare() was already called on this MixedPrecision object; create a new MixedPrecision for another model."
            )
        if not isinstance(model, nn.Module):
            raise TypeError(f"prepare(model, optimizer): model must be an nn.Module, got {type(model).__name__}")
        if not optimizers:
            raise ValueError(
                "prepare(model) needs the optimizer(s) too: prepare(model, optimizer). For evaluation only, use "
                "mixprec.for_inference(model, 'bf16')."
            )
        if is_prepared(model):
            raise ValueError(
                "this model was already prepared by another MixedPrecision (or cast_module); prepare a fresh model, "
                "or call mixprec.uncast_module(model) first."
            )
        # DDP: raises (prepare first, then mixprec.distributed.wrap_ddp). FSDP2: its FP32 shards are the masters.
        fsdp = check_prepare_target(model, self.policy, self.grad_accumulation)
        model_params = list(model.parameters())
        by_id = {id(p): p for p in model_params}
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
        for i, opt in enumerate(optimizers):
            if isinstance(opt, MasterWeightOptimizer):
                raise TypeError(
                    f"optimizer {i} is already a MasterWeightOptimizer; pass the plain torch optimizer and let "
                    "prepare() wrap it."
                )
            if not isinstance(opt, Optimizer):
                raise TypeError(f"optimizer {i} must be a torch.optim.Optimizer, got {type(opt).__name__}")
            foreign = [p for g in opt.param_groups for p in g["params"] if id(p) not in by_id]
            if foreign:
                raise ValueError(
                    f"optimizer {i} holds {len(foreign)} tensor(s) that are not parameters of this model (first has shape "
                    f"{tuple(foreign[0].shape)}); build the optimizer from model.parameters() of the model you pass to "
                    "prepare()."
                )
        _check_disjoint(optimizers)
        if self.policy.has_masters:
            _check_no_frozen_masters(model, optimizers, self.policy)
        floating = [p for p in model_params if p.dtype.is_floating_point]
        half = sorted({dtype_name(p.dtype) for p in floating if p.dtype != torch.float32})
        if half and self.policy.param_dtype == torch.float32:
            raise ValueError(
                f"the model has {'/'.join(half)} parameters but policy {self.policy.name or str(self.policy)!r} keeps "
                "parameters in FP32 (they are the masters); call model.float() before prepare(), or choose a policy "
                "with half-precision parameters such as 'bf16-master' or 'fp16-master'."
            )
        device = _model_device(model)
        check_device_support(self.policy.compute_dtype, device)
        if half and self.policy.has_masters:
            warnings.warn(
                f"the model already has {'/'.join(half)} parameters, so its FP32 masters start from rounded values; "
                "prepare the FP32 model instead to keep the full-precision initial weights.",
                UserWarning,
                stacklevel=2,
            )
        if on_check_fail not in ("warn", "raise"):
            raise ValueError(f"on_check_fail={on_check_fail!r}; use 'warn' or 'raise'.")
        if self.policy.compensation != "none":
            _check_convertible(optimizers, self.policy)
        elif not self.policy.has_masters and self.policy.param_dtype != torch.float32:
            _warn_tiny_eps(optimizers, self.policy.param_dtype)

        if check_batch is not None:
            from .numerics import preflight

            self.check_result = preflight(model, check_batch, self.policy, loss_fn, on_fail=on_check_fail)

        # --- from here on the model and optimizers change ---
        originals = {id(p): p.data for p in floating}  # FP32 tensors the cast replaces (no copy)
        # FSDP2 gathers half-precision copies itself: hooks only, parameters (the masters) stay FP32.
        fsdp_masters = fsdp and self.policy.has_masters
        cast_module(model, self.policy.replace(param_dtype=torch.float32, master_dtype=None) if fsdp_masters else self.policy)
        wrapped: list[Optimizer] = []
        for opt in optimizers:
            if self.policy.has_masters and not fsdp:
                initial = {p: originals[id(p)] for g in opt.param_groups for p in g["params"] if id(p) in originals}
                opt = MasterWeightOptimizer(
                    opt, master_dtype=self.policy.master_dtype or torch.float32,
                    grad_accumulation=self.grad_accumulation, initial_masters=initial,
                )
            elif self.policy.compensation != "none":
                opt = _to_compensated(opt, self.policy, originals)
            wrapped.append(opt)
        self.model = model
        self.device = device
        self.optimizers = wrapped
        self._param_names = [[names.get(id(p), "") for p in _model_params_of(o)] for o in wrapped]
        self._stage = {id(o): "idle" for o in wrapped}
        self._applied_steps = torch.zeros((), dtype=torch.int64, device=device)
        return (model, *wrapped)

    def _require_prepared(self, what: str) -> nn.Module:
        if self.model is None:
            raise ValueError(f"{what} before prepare(); call model, optimizer = prec.prepare(model, optimizer) first.")
        return self.model

    def _check_optimizer(self, optimizer: Optimizer, what: str) -> None:
        if id(optimizer) not in self._stage:
            hint = ""
            if any(isinstance(o, MasterWeightOptimizer) and o.optimizer is optimizer for o in self.optimizers):
                hint = " You passed the optimizer you gave prepare(); use the one prepare() returned (it holds the masters)."
            raise ValueError(f"{what}: this optimizer was not returned by prepare().{hint}")

    # ----- the training step -----------------------------------------------------------------------
    def autocast(self) -> autocast:
        """A region that computes in the policy's compute dtype on the prepared model's device."""
        device = self.device if self.device is not None else None
        return autocast(self.policy, device)

    def backward(self, loss: torch.Tensor, **backward_kwargs: Any) -> None:
        """Backpropagate ``loss``, scaled when the policy scales.

        Call it once per micro-batch; gradients accumulate (in FP32 for master-weight policies)
        and are unscaled once, at :meth:`clip_grad_norm_` or :meth:`step`. Under a TF32 policy
        the backward matmuls run in TF32 as the forward ones do, and under any other policy
        without it (the global switches are restored afterwards).

        Args:
            loss: A scalar floating tensor that requires grad.
            **backward_kwargs: Passed to ``Tensor.backward`` (``retain_graph``, ...).

        Raises:
            ValueError: before ``prepare``; ``loss`` not a scalar with a graph; backward after the
                gradients were already unscaled for this step (call ``step`` first).
        """
        self._require_prepared("backward()")
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"backward(loss) needs a tensor, got {type(loss).__name__}")
        if loss.numel() != 1 or not loss.dtype.is_floating_point:
            raise ValueError(
                f"backward(loss) needs a scalar floating loss, got shape {tuple(loss.shape)} {loss.dtype}; reduce it "
                "(e.g. loss.mean()) first."
            )
        if not loss.requires_grad:
            raise ValueError("the loss does not require grad (computed under torch.no_grad(), or from detached tensors?).")
        for oid, stage in self._stage.items():
            if stage == "unscaled":
                raise ValueError(
                    "backward() after the gradients were unscaled (by clip_grad_norm_ or unscale_) in the same step would "
                    "mix scaled and unscaled gradients; call step() first."
                )
        # Autocast regions end before backward, so the TF32 switch they set is gone here; the
        # backward matmuls are as large as the forward ones and follow the policy too.
        saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = self.policy.tf32
        try:
            self.scaler.scale(loss).backward(**backward_kwargs)
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        for oid in self._stage:
            self._stage[oid] = "backward"

    def _grads(self, optimizer: Optimizer) -> list[torch.Tensor]:
        if isinstance(optimizer, MasterWeightOptimizer):
            return optimizer.master_grads()
        # FSDP2's DTensor gradients: unscale/check the local shard (found_inf is agreed across ranks after).
        return [local_grad(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

    def unscale_(self, optimizer: Optimizer) -> torch.Tensor:
        """Unscale this optimizer's gradients in place (once per step) and check them for inf/NaN.

        Returns:
            ``found_inf``: 0-d float32, 1.0 when any gradient is inf/NaN (agreed across ranks
            when torch.distributed is initialised). No host sync.

        Raises:
            ValueError: before any ``backward`` in this step, or for a foreign optimizer.
        """
        self._require_prepared("unscale_()")
        self._check_optimizer(optimizer, "unscale_()")
        stage = self._stage[id(optimizer)]
        if stage == "idle":
            holders = optimizer.masters if isinstance(optimizer, MasterWeightOptimizer) else _optimizer_tensors(optimizer)
            if any(t.grad is not None for t in (*holders, *_model_params_of(optimizer))):
                # e.g. loss.backward() instead of prec.backward(loss): FP16 gradients would be unscaled wrongly
                raise ValueError(
                    "unscale_()/clip_grad_norm_()/step() without backward() in this step: the gradients present did not "
                    "come from prec.backward(loss) since the last step. Call prec.backward(loss) instead of "
                    "loss.backward() (it scales the loss when the policy needs it), and zero_grad() after each step."
                )
            raise ValueError("unscale_()/clip_grad_norm_()/step() without backward() in this step: there are no new gradients.")
        if stage == "unscaled":
            return self._found_inf[id(optimizer)]
        found_inf = self.scaler.unscale_(self._grads(optimizer))
        self._found_inf[id(optimizer)] = found_inf
        self._stage[id(optimizer)] = "unscaled"
        return found_inf

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, optimizer: Optimizer | None = None
    ) -> torch.Tensor:
        """Clip the unscaled (FP32 for master policies) gradients to ``max_norm``; returns the total norm.

        Unscales first if needed. With inf/NaN gradients the norm is inf/NaN and the step will
        be skipped anyway. No host sync.
        """
        self._require_prepared("clip_grad_norm_()")
        opts = [optimizer] if optimizer is not None else self.optimizers
        tensors: list[torch.Tensor] = []
        for opt in opts:
            self.unscale_(opt)
            tensors += [t for t in _optimizer_tensors(opt) if t.grad is not None]
        return torch.nn.utils.clip_grad_norm_(tensors, max_norm, norm_type=norm_type)

    def step(self, optimizer: Optimizer, *, schedulers: Sequence[Any] = ()) -> StepInfo:
        """Unscale, check, and step ``optimizer`` unless a gradient is inf/NaN; update the loss scale.

        Args:
            optimizer: An optimizer returned by :meth:`prepare`.
            schedulers: LR schedulers (or anything with ``.step()``) to advance only when the step
                was applied. Host sync: one read of ``skipped`` when given.

        Returns:
            :class:`StepInfo` (0-d device tensors).

        Raises:
            ValueError: before ``prepare``, for an optimizer not returned by ``prepare``, or
                without a ``backward`` since the last step.
        """
        self._require_prepared("step()")
        self._check_optimizer(optimizer, "step()")
        found_inf = self.unscale_(optimizer)
        scale_used = self.scaler.loss_scale.detach().clone()
        skipped = step_optimizer(optimizer, found_inf)
        self._stage[id(optimizer)] = "idle"
        self._iteration_found_inf.append(found_inf)
        applied_steps = typing_cast(torch.Tensor, self._applied_steps)  # set by prepare()
        if all(s == "idle" for s in self._stage.values()):
            # Every optimizer of this iteration has stepped: one scale update for the iteration.
            flags = self._iteration_found_inf
            if len(flags) == 1:  # the common case: one optimizer, no combining kernels
                any_inf = flags[0]
            else:
                any_inf = torch.stack([f.to(found_inf.device) for f in flags]).amax()
            # Book-keeping first: update() may raise NumericsError (escalation), and a caller that
            # catches it must not carry this iteration's flag into the next one.
            self._iteration_found_inf = []
            clean = any_inf == 0
            applied_steps += clean if clean.device == applied_steps.device else clean.to(applied_steps.device)
            self.scaler.update(any_inf)
        info = StepInfo(found_inf=found_inf, skipped=skipped, scale=scale_used, applied_steps=applied_steps.clone())
        if schedulers and info.applied():
            for s in schedulers:
                s.step()
        return info

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``zero_grad`` on every prepared optimizer."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    # ----- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: policy, model, optimizers (with masters), scaler, step count.

        Keys:
            ``version`` (1), ``policy`` (the grammar string), ``model`` (``model.state_dict()``,
            parameters in the policy's dtypes), ``optimizers`` (one ``state_dict()`` per prepared
            optimizer; a ``MasterWeightOptimizer``'s includes the FP32 masters), ``param_names``
            (per optimizer, the qualified parameter names in param-group order), ``scaler``
            (the loss scaler's ``state_dict()``), ``applied_steps`` (int64 tensor).

        The tensors are references to live state (as ``nn.Module.state_dict`` returns); save it
        (``torch.save`` / ``mixprec.save``) before training on. Loads with ``weights_only=True``.
        """
        model = self._require_prepared("state_dict()")
        return {
            "version": _STATE_VERSION,
            "policy": str(self.policy),
            "model": model.state_dict(),
            "optimizers": [o.state_dict() for o in self.optimizers],
            "param_names": [list(n) for n in self._param_names],
            "scaler": self.scaler.state_dict(),
            "applied_steps": self._applied_steps,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (or a :func:`convert_state_dict` result) into a prepared run.

        Raises:
            ValueError: not a mixprec state dict, another version, a different policy (the message
                names both and the conversion function), or a model/optimizer that does not match.
                Everything is validated before anything is loaded.
        """
        model = self._require_prepared("load_state_dict()")
        sd = _validate_state(state_dict)
        saved = Policy.parse(sd["policy"])
        if saved != self.policy:
            raise ValueError(
                f"the checkpoint was saved under policy {str(saved)!r} but this run uses {str(self.policy)!r}; convert it "
                f"explicitly with mixprec.convert_state_dict(state, {self.policy.name or str(self.policy)!r}) before "
                "loading, or prepare the run with the saved policy."
            )
        if len(sd["optimizers"]) != len(self.optimizers):
            raise ValueError(f"the checkpoint has {len(sd['optimizers'])} optimizer(s), this run {len(self.optimizers)}.")
        _check_model_state(model, sd["model"])
        if [list(n) for n in sd["param_names"]] != self._param_names:
            raise ValueError("the checkpoint's optimizer parameter names differ from this run's (a different model?).")
        # What the loads below would only find out after the model was already overwritten:
        _check_optimizer_entries(self.optimizers, sd["optimizers"])
        if sd.get("scaler") is not None and getattr(self.scaler, "_kind", None) is not None:
            from ._scaler import _check_state_dict

            _check_state_dict(sd["scaler"], type(self.scaler).__name__, self.scaler._kind)  # type: ignore[attr-defined]
        model.load_state_dict(sd["model"])
        names = dict(model.named_parameters())
        for opt, entry, pnames in zip(self.optimizers, sd["optimizers"], sd["param_names"]):
            if isinstance(opt, MasterWeightOptimizer) and "masters" not in entry:
                # A converted checkpoint: FP32 weights are in sd["model"], state in torch format.
                opt.optimizer.load_state_dict(entry)
                values = {names[n]: sd["model"][n] for n in pnames if n in sd["model"]}
                opt.load_master_values_(values)
            else:
                opt.load_state_dict(entry)
        if sd.get("scaler") is not None:
            self.scaler.load_state_dict(sd["scaler"])
        typing_cast(torch.Tensor, self._applied_steps).copy_(sd["applied_steps"])

    @torch.no_grad()
    def load_model_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load a plain FP32 model checkpoint into the prepared run; masters take the exact FP32 values.

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
        own = model.state_dict()
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise ValueError(
                f"load_model_state_dict: the state dict does not match the model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}; nothing was loaded. Pass strict=False to load the matching entries only."
            )
        shapes = [k for k, v in state_dict.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
        if shapes:
            k = shapes[0]
            raise ValueError(
                f"load_model_state_dict: {k!r} has shape {tuple(state_dict[k].shape)} in the state dict but "
                f"{tuple(own[k].shape)} in the model ({len(shapes)} mismatch(es)); nothing was loaded."
            )
        model.load_state_dict(state_dict, strict=strict)
        named = dict(model.named_parameters())
        for opt in self.optimizers:
            if isinstance(opt, MasterWeightOptimizer):
                opt.load_master_values_({named[n]: v for n, v in state_dict.items() if n in named})


# ----- helpers for optimizers ---------------------------------------------------------------------------
def _warn_tiny_eps(optimizers: Sequence[Optimizer], dtype: torch.dtype) -> None:
    """Warn when an optimizer's ``eps`` vanishes in the parameters' half dtype (Adam-family NaNs).

    With half-precision parameters and no masters, torch's Adam/AdamW keep their states and
    compute ``sqrt(v) + eps`` in that dtype; an ``eps`` below the dtype's smallest normal number
    (FP16: 6.1e-5; the default 1e-8 rounds to 0) lets a zero second moment give ``0 / 0 = NaN``.
    """
    tiny = torch.finfo(dtype).tiny
    for i, opt in enumerate(optimizers):
        small = sorted({g["eps"] for g in opt.param_groups if isinstance(g.get("eps"), float) and g["eps"] < tiny})
        if small:
            warnings.warn(
                f"optimizer {i} ({type(opt).__name__}) has eps={small[0]:g}, below the smallest normal {dtype_name(dtype)} "
                f"number {tiny:.2g}: with {dtype_name(dtype)} parameters and states it rounds towards 0 and a zero second "
                f"moment gives NaN updates. Use eps >= {tiny:.0e} (e.g. 1e-4), or a preset with FP32 masters "
                "('fp16-master') or compensated updates ('bf16-pure').",
                UserWarning,
                stacklevel=3,
            )


def _optimizer_tensors(opt: Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _model_params_of(opt: Optimizer) -> list[torch.Tensor]:
    if isinstance(opt, MasterWeightOptimizer):
        return opt.model_params
    return _optimizer_tensors(opt)


def _check_disjoint(optimizers: Sequence[Optimizer]) -> None:
    """Each parameter in one optimizer only: a shared one would be unscaled twice, or get two masters."""
    owner: dict[int, int] = {}
    for i, opt in enumerate(optimizers):
        for j in range(i):
            if optimizers[j] is opt:
                raise ValueError(f"optimizer {i} is the same object as optimizer {j}; pass each optimizer to prepare() once.")
        for g in opt.param_groups:
            for p in g["params"]:
                j = owner.setdefault(id(p), i)
                if j != i:
                    raise ValueError(
                        f"a parameter of shape {tuple(p.shape)} is in optimizer {j} and optimizer {i}; mixprec needs each "
                        "parameter in exactly one optimizer (its gradient is unscaled, and its master kept, once). "
                        "Split the parameters between the optimizers."
                    )


def _check_optimizer_entries(optimizers: Sequence[Optimizer], entries: Sequence[Any]) -> None:
    """The saved optimizers have this run's param-group layout (torch checks it only inside the load)."""
    for i, (opt, entry) in enumerate(zip(optimizers, entries)):
        inner = entry.get("optimizer") if isinstance(entry, Mapping) and "masters" in entry else entry
        groups = inner.get("param_groups") if isinstance(inner, Mapping) else None
        if not isinstance(groups, Sequence):
            raise ValueError(f"the checkpoint's optimizer {i} is not an optimizer state dict (no 'param_groups').")
        saved = [len(g.get("params", ())) for g in groups]
        ours = [len(g["params"]) for g in opt.param_groups]
        if saved != ours:
            raise ValueError(
                f"the checkpoint's optimizer {i} has param groups of sizes {saved}, this run's {ours}; build the "
                "optimizer with the same param groups as the run that saved it."
            )


def _check_no_frozen_masters(model: nn.Module, optimizers: Sequence[Optimizer], policy: Policy) -> None:
    """Before anything is cast: a frozen parameter that would get a master has no gradient to feed it."""
    from ._casting import island_modules

    if policy.param_dtype == (policy.master_dtype or torch.float32):
        return
    islands = {id(p) for _, m in island_modules(model, policy) for p in m.parameters()}
    for i, opt in enumerate(optimizers):
        frozen = [p for g in opt.param_groups for p in g["params"]
                  if p.dtype.is_floating_point and not p.requires_grad and id(p) not in islands]
        if frozen:
            raise ValueError(
                f"optimizer {i} holds {len(frozen)} parameter(s) with requires_grad=False (first has shape "
                f"{tuple(frozen[0].shape)}) that policy {policy.name or str(policy)!r} would give FP32 masters; leave frozen "
                "parameters out of the optimizer, e.g. AdamW([p for p in model.parameters() if p.requires_grad])."
            )


def _check_convertible(optimizers: Sequence[Optimizer], policy: Policy) -> None:
    from . import optim as mp_optim

    for i, opt in enumerate(optimizers):
        comp = getattr(opt, "compensation", None)
        if isinstance(opt, (mp_optim.AdamW, mp_optim.SGD)):
            if comp != policy.compensation:
                raise ValueError(
                    f"optimizer {i} uses compensation={comp!r} but the policy says comp={policy.compensation}; build it "
                    f"with compensation={policy.compensation!r} or use the policy 'p=bf16,comp={comp}'."
                )
        elif type(opt) not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
            raise TypeError(
                f"policy {policy.name or str(policy)!r} updates half-precision parameters with compensated updates, which "
                f"needs mixprec.optim.AdamW or mixprec.optim.SGD (or a torch AdamW/Adam/SGD, converted for you); got "
                f"{type(opt).__name__}. Use a master-weight policy such as 'bf16-master' for other optimizers."
            )


def _to_compensated(opt: Optimizer, policy: Policy, originals: Mapping[int, torch.Tensor]) -> Optimizer:
    from . import optim as mp_optim

    if not isinstance(opt, (mp_optim.AdamW, mp_optim.SGD)):
        opt = mp_optim.from_torch(opt, compensation=policy.compensation)
    # Seed the compensation with what the cast to half precision lost.
    seed = {p: originals[id(p)] for g in opt.param_groups for p in g["params"] if id(p) in originals}
    opt.load_full_precision_params_(seed)
    return opt


# ----- state-dict helpers ---------------------------------------------------------------------------------
_REQUIRED = ("version", "policy", "model", "optimizers", "param_names", "scaler", "applied_steps")


def _validate_state(state_dict: Any) -> Mapping[str, Any]:
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"expected a mixprec state dict (a mapping), got {type(state_dict).__name__}")
    missing = [k for k in _REQUIRED if k not in state_dict]
    if missing:
        likely = ""
        if "state" in state_dict and "param_groups" in state_dict:
            likely = " It looks like a plain optimizer state dict; mixprec checkpoints come from MixedPrecision.state_dict()."
        elif state_dict and all(isinstance(v, torch.Tensor) for v in state_dict.values()):
            likely = " It looks like a model state dict; load it with prec.load_model_state_dict(sd)."
        raise ValueError(f"not a mixprec state dict: missing {missing} (has {sorted(map(str, state_dict))[:8]}).{likely}")
    if state_dict["version"] != _STATE_VERSION:
        raise ValueError(
            f"mixprec state version {state_dict['version']!r}; this mixprec reads version {_STATE_VERSION} (upgrade mixprec?)."
        )
    return state_dict


def _check_model_state(model: nn.Module, sd: Mapping[str, torch.Tensor]) -> None:
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    if missing or unexpected:
        raise ValueError(f"the checkpoint's model does not match: missing {missing[:5]}, unexpected {unexpected[:5]}.")
    for k, v in own.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise ValueError(f"the checkpoint's {k!r} has shape {tuple(sd[k].shape)}, the model's {tuple(v.shape)}.")


def fp32_state_dict(source: MixedPrecision | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Export the model's weights in FP32, taken from the masters where there are masters.

    Args:
        source: A prepared :class:`MixedPrecision`, or a state dict it saved.

    Returns:
        A model state dict (new tensors) with floating entries in FP32; load it into an FP32
        copy of the model for export or evaluation.
    """
    if isinstance(source, MixedPrecision):
        source = source.state_dict()
    sd = _validate_state(source)
    out = {k: (v.detach().float().clone() if v.dtype.is_floating_point else v.detach().clone()) for k, v in sd["model"].items()}
    for entry, pnames in zip(sd["optimizers"], sd["param_names"]):
        masters = entry.get("masters") if isinstance(entry, Mapping) else None
        if masters is None:
            continue
        for name, master in zip(pnames, masters):
            if master is not None and name in out:
                out[name] = master.detach().float().clone()
    return out


def convert_state_dict(state_dict: Mapping[str, Any], policy: Policy | str) -> dict[str, Any]:
    """Convert a checkpoint saved under one policy for loading under another.

    The model weights become the FP32 truth (masters where the saved run had them), the
    optimizer state is kept (it is FP32 state over the same parameters in every supported
    policy), and the loss-scaler state is kept when both policies scale the loss the same way
    and dropped otherwise (the new run starts with its policy's scaler).

    Args:
        state_dict: What :meth:`MixedPrecision.state_dict` returned.
        policy: The policy of the run that will load it.

    Returns:
        A state dict for ``MixedPrecision(policy).load_state_dict``.

    Raises:
        ValueError: a policy with compensated updates (``bf16-pure``) on either side: its
            optimizer keeps compensation buffers and possibly BF16 states, which do not map
            onto an FP32 optimizer; convert through ``fp32_state_dict`` and a fresh optimizer.
    """
    sd = _validate_state(state_dict)
    src, dst = Policy.parse(sd["policy"]), Policy.parse(policy)
    for side, pol in (("saved", src), ("target", dst)):
        if pol.compensation != "none":
            raise ValueError(
                f"cannot convert: the {side} policy {pol.name or str(pol)!r} uses compensated updates; export the weights "
                "with mixprec.fp32_state_dict(state) and start the optimizer afresh."
            )
    out = dict(sd)
    out["policy"] = str(dst)
    out["model"] = fp32_state_dict(sd)
    out["optimizers"] = [e["optimizer"] if isinstance(e, Mapping) and "masters" in e else e for e in sd["optimizers"]]
    same_scaling = (src.loss_scale, src.init_scale) == (dst.loss_scale, dst.init_scale)
    out["scaler"] = sd["scaler"] if same_scaling else None
    return out


def for_inference(
    model: nn.Module, dtype: torch.dtype | str = "bf16", *, fp32_islands: Iterable[str] = ("norm",)
) -> nn.Module:
    """Cast a trained model in place for evaluation in half precision, FP32 islands kept.

    Weight memory halves; normalization layers (or the islands given) stay FP32. Floating
    inputs are cast to ``dtype`` on the way in and outputs come back in FP32. The model is
    put in ``eval()`` mode. A model prepared for training has its hooks replaced.

    Args:
        model: The trained model.
        dtype: ``"bf16"`` or ``"fp16"``.
        fp32_islands: As in :class:`Policy`.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: a dtype other than bf16/fp16.
    """
    dt = parse_dtype(dtype)
    if dt not in (torch.bfloat16, torch.float16):
        raise ValueError(f"for_inference casts to 'bf16' or 'fp16', got {dtype!r}; for FP32 just call model.eval().")
    policy = Policy(dt, dt, torch.float32, fp32_islands=tuple(fp32_islands))
    if is_prepared(model):
        uncast_module(model)
    cast_module(model, policy)
    return model.eval()
