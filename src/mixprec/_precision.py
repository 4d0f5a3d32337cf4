"""``MixedPrecision``: one object that owns the mixed-precision lifecycle of a training run.

cast (FP32 islands) -> autocast -> scaled backward -> unscale + inf/NaN check -> step or skip on
the device -> loss-scale update -> state_dict. The policy, the loss scaler, the master
weights and the optimizer state are saved and restored together, so a resumed run continues
bit for bit.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Literal
from typing import cast as typing_cast

import torch
from torch import nn
from torch.optim import Optimizer

from ._autocast import autocast, resolve_device_type, tf32
from ._casting import AddedParamCheck, cast_module, guard_assign, register_run
from ._dist import FoundInfJoinHook, JoinState, broadcast_from_last_joiner_, is_distributed, join_group, local_grad
from ._errors import check_fused, eager_only
from ._finite import combine_found_inf
from ._fused import FusedShadow, fusable_plain, runs_compiled
from ._master import (
    CREATE_GRAPH_FP32_ACCUMULATION,
    GradAccumulation,
    MasterWeightOptimizer,
    WeightEdits,
    check_grad_accumulation,
    check_weight_edits,
)
from ._master_grad import FROM_VIEW, MasterGradView
from ._policy import DYNAMIC_SCALE_RANGE, Policy
from ._prepare import (
    Rollback,
    check_fusable,
    check_prepare,
    model_params_of,
    optimizer_tensors,
    warn_host_reads,
    wrap_optimizers,
)
from ._run_state import RunCheckpoint
from ._scaler import DynamicScaler, LossScaler, NoOpScaler, StaticScaler, _ScalerBase
from ._stepping import AppliedSteps, OptimizerRecord, StepInfo, install_step_guard, remove_step_guard, step_or_skip

__all__ = ["MixedPrecision", "scaler_for_policy"]

ScaleUpdate = Literal["auto", "manual"]


def scaler_for_policy(policy: Policy | str) -> LossScaler:
    """Return the loss scaler a policy asks for: none, static (``init_scale`` or 1) or dynamic (``init_scale`` or 2**16)."""
    policy = Policy.parse(policy)
    if policy.loss_scale == "none":
        return NoOpScaler()
    if policy.loss_scale == "static":
        return StaticScaler(policy.init_scale if policy.init_scale is not None else 1.0)
    if policy.init_scale is not None:
        # ls=dynamic:S outside the default [floor, ceiling] widens the range to start there (the grammar has no
        # floor/ceiling keys; a numerics report may recommend a scale past 2**24)
        low, high = DYNAMIC_SCALE_RANGE
        return DynamicScaler(init_scale=policy.init_scale, min_scale=min(low, policy.init_scale),
                             max_scale=max(high, policy.init_scale))
    return DynamicScaler()


# torch < 2.6 has clip_grad_norm_ but not its halves: clipping then unscales first, as before.
_NO_TOTAL_NORM = not (hasattr(torch.nn.utils, "get_total_norm") and hasattr(torch.nn.utils, "clip_grads_with_norm_"))


@eager_only(
    "mixprec's step (prec.step, optimizer.step() of a prepared optimizer) runs eagerly behind one graph break, as torch.amp's GradScaler.step does: keep it outside torch.compile(fullgraph=True)"
)
def _step_outside_trace(prec: MixedPrecision, optimizer: Optimizer, schedulers: Iterable[Any]) -> StepInfo:
    """``prec.step`` reached from a traced frame (``torch.compile`` of a whole train step, or of ``opt.step``).

    The step runs eagerly, behind one graph break (as torch.amp's ``GradScaler.step``, whose
    ``found_inf`` read breaks the graph too): traced, dynamo guarded on the run's Python
    bookkeeping (the scale history's step count: a recompile every step), built the fused
    step's optimizer mid-trace, and failed on the compiled tile step's symbolic shapes. The
    model's graph is unaffected, and the step keeps its own compiled kernels.
    """
    return prec.step(optimizer, schedulers=schedulers)


class MixedPrecision(RunCheckpoint):
    """Train any model under a precision policy with one object.

    Args:
        policy: A :class:`Policy`, a preset (``"bf16-mixed"``, ``"fp16-master"``, ...), an alias or
            the ``p=...,c=...`` grammar.
        scaler: A loss scaler to use instead of the one the policy implies.
        grad_accumulation: For master-weight policies: ``"fp32"`` (default) accumulates gradients
            into the FP32 masters during backward; ``"compute"`` keeps them in the compute dtype
            until the step (least persistent memory).
        scale_update: ``"auto"`` (default): the loss scale is updated once per iteration, as
            defined below, with no extra call. ``"manual"``: only :meth:`update` updates it.
        weight_edits: For master-weight policies, how edits of the model's half weights made
            outside the step are found and carried into the masters: ``"values"`` (default)
            compares every weight with its rounded master before each step, so edits through
            ``p.data`` (WGAN clipping, pruning masks) are seen; ``"versions"`` checks only the
            tensors' version counters (free, but blind to ``p.data``). See
            ``MasterWeightOptimizer.sync_edits_``.
        fused: The optimizer steps run as ``torch.compile``d kernels (``True``), as eager code
            (``False``), or where that pays off (``None``, default). Covered: the
            ``MasterWeightOptimizer`` of ``*-master`` around a torch AdamW/Adam/SGD, the converted
            ``mixprec.optim`` optimizer of compensated policies, and, for policies without
            masters, a torch AdamW/Adam/SGD you keep (it steps through ``mixprec._fused.FusedShadow``
            on its own state; torch's own ``fused=True`` optimizers are left as they are).
            ``None``: the compensated step on CUDA/XPU with Triton, and on any device once the
            first :meth:`backward` sees a model compiled by Inductor (``torch.compile``'s default
            backend: its eager step is 2-4x the compiled one's on a CPU); the master step and a
            plain policy's torch optimizer never (the wrapped optimizer's own step, torch's fused
            kernel where it has one: skips on the device and compiles nothing; on a GPU the
            compiled master step measured slower, see docs/optim.md).

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

    An *iteration* is the span between two loss-scale updates. Every ``step`` adds its
    optimizer's ``found_inf`` to the iteration, and the iteration ends (one scale update with
    the OR of those flags) at the first of:

    1. ``step`` of the last prepared optimizer that had not stepped in it (one optimizer: every
       step; several stepped after one backward: the last of them);
    2. ``backward`` after at least one step in it (GAN-style ``backward(d); step(d);
       backward(g); step(g)``: each pair is an iteration; optimizers stepped on different
       schedules: the next backward ends it);
    3. ``step`` of an optimizer that already stepped in it (loops that call ``loss.backward()``
       themselves under policies without loss scaling);
    4. an explicit :meth:`update` (the only one with ``scale_update="manual"``).

    Gradients that an optimizer holds across an iteration boundary without stepping are
    rescaled to the new scale on the device, so accumulating over a scale change stays exact.

    The optimizers ``prepare`` returns can also be stepped directly: ``optimizer.step()`` does
    exactly ``prec.step(optimizer)`` (this is what Trainer-style loops do). The optimizer passed
    to ``prepare`` and wrapped inside a ``MasterWeightOptimizer`` refuses a direct ``step()``.

    Every policy, also FP32 and BF16 ones without loss scaling, checks the gradients for
    inf/NaN and skips such a step, so a NaN from the forward or backward never reaches the
    weights. The check runs once per step, at ``unscale_`` (or ``clip_grad_norm_``, or the step
    when neither was called): an inf/NaN that code writes into the gradients after an explicit
    ``unscale_`` is not seen, as under ``torch.amp``'s ``GradScaler``.

    Host syncs: none in ``backward``/``clip_grad_norm_``; none in ``step`` for torch's AdamW, Adam
    and SGD (foreach and for-loop forms step through their own fused kernel, which skips on
    ``found_inf`` on the device: ``_stepping.FusedTwin``), ``mixprec.optim``, any optimizer with
    ``_step_supports_amp_scaling``, and ``MasterWeightOptimizer`` around any of them; for any other
    optimizer one read of ``found_inf`` per step, which ``prepare`` warns about on a GPU.
    ``step(..., schedulers=...)`` adds one read of ``skipped``. The scaler's periodic check
    (every ``check_interval`` steps) reads its counters from pinned memory copied one interval
    earlier on CUDA, so it never waits for the GPU either.
    """

    #: ``prepare`` leaves the model's dtypes as they are (``cast_module(keep_dtypes=True)``); set by
    #: ``mixprec.apex`` for Apex's uncast models. The policy then only says what the run does
    #: (masters for the half parameters there are, loss scaling, autocast).
    _keep_dtypes: bool = False

    def __init__(
        self,
        policy: Policy | str = "bf16-mixed",
        *,
        scaler: LossScaler | None = None,
        grad_accumulation: GradAccumulation = "fp32",
        scale_update: ScaleUpdate = "auto",
        weight_edits: WeightEdits = "values",
        fused: bool | None = None,
    ) -> None:
        self.policy = Policy.parse(policy)
        check_fused(fused)
        self.fused = fused
        if scaler is not None and not isinstance(scaler, LossScaler):
            from ._grad_scaler import GradScaler

            hint = (" mixprec.GradScaler is the drop-in for loops written around torch.amp.GradScaler, not a scaler a "
                    "MixedPrecision runs; its options (init_scale, growth_interval, ...) go to DynamicScaler."
                    if isinstance(scaler, (GradScaler, torch.amp.GradScaler)) else "")
            raise TypeError(
                f"scaler must implement mixprec.LossScaler, got {type(scaler).__name__} ({type(scaler).__module__}): pass "
                "mixprec.DynamicScaler(...), StaticScaler(scale) or NoOpScaler(), or leave it out for the policy's "
                f"default.{hint}"
            )
        check_grad_accumulation(grad_accumulation)
        if scale_update not in ("auto", "manual"):
            raise ValueError(f"scale_update={scale_update!r}; use 'auto' (default) or 'manual' (call prec.update()).")
        if isinstance(scaler, NoOpScaler) and not self._loss_scaled_elsewhere and self.policy.loss_scale != "none" and torch.float16 in (
                self.policy.compute_dtype, self.policy.param_dtype):
            warnings.warn(
                f"scaler=NoOpScaler() under policy {self.policy.label!r}, which scales the loss "
                f"(ls={self.policy.loss_scale}): FP16 gradients run unscaled, and those below ~6e-8 flush to zero. "
                "Say so in the policy (e.g. 'p=f32,c=f16,ls=none') to silence this, or pass a DynamicScaler/StaticScaler.",
                UserWarning, stacklevel=2)
        self.scaler: LossScaler = scaler if scaler is not None else scaler_for_policy(self.policy)
        self.grad_accumulation: GradAccumulation = grad_accumulation
        self.scale_update: ScaleUpdate = scale_update
        check_weight_edits(weight_edits)
        self.weight_edits: WeightEdits = weight_edits
        self.model: nn.Module | None = None
        self.optimizers: list[Optimizer] = []
        self.device: torch.device | None = None
        self.last_step: StepInfo | None = None  # what the latest step() (or optimizer.step()) did
        self._records: dict[int, OptimizerRecord] = {}
        self._iteration_flags: list[torch.Tensor] = []  # found_inf of each step in this iteration
        self._applied_steps: AppliedSteps | None = None
        self.check_result: Any = None  # the pre-flight CheckResult when prepare(check_batch=...) ran it
        #: Whether the first backward passed through an Inductor-compiled region (None: not seen yet).
        self._seen_compiled: bool | None = None

    #: A subclass that scales the loss itself around a NoOpScaler (the Apex shim's scale_loss).
    _loss_scaled_elsewhere = False

    def __getstate__(self) -> dict[str, Any]:
        """For ``copy.deepcopy`` and pickling: the records travel without their step guards (re-installed on load).

        The model's pending gradients travel too (a copy between ``backward`` and ``step``):
        torch copies a ``Parameter`` without its ``.grad``, and the twin's step would otherwise
        apply none, or only the FP32 islands' missing ones. Master gradients travel with their
        masters (plain tensors, copied with their ``.grad``).
        """
        d = self.__dict__.copy()
        d["_records"] = [dataclasses.replace(r, guard=None) for r in self._records.values()]
        if self.model is not None:
            d["_pending_grads"] = [(p, p.grad) for p in self.model.parameters()
                                   if p.grad is not None and not isinstance(p.grad, MasterGradView)]
        return d

    def __setstate__(self, state: dict[str, Any]) -> None:
        records = state.pop("_records")
        for p, g in state.pop("_pending_grads", ()):
            if p.grad is None:
                p.grad = g
        self.__dict__.update(state)
        self._records = {}
        # The records were keyed by id(optimizer): the copies are new objects. Their step() routes
        # to this copy, and master optimizers check reads of scaled gradients against it.
        for rec in records:
            opt = rec.optimizer
            rec.guard = install_step_guard(opt, "route", self._step_from_optimizer)
            if isinstance(opt, MasterWeightOptimizer):
                opt.set_unscale_callback(self._unscale_callback(opt))
            self._records[id(opt)] = rec
        model = self.model
        if model is not None and not getattr(self, "_closed", None):
            # for_inference(copy.model) ends the copy as it ends the original (the registry holds it weakly)
            for target in {id(m): m for m in (model, getattr(model, "_orig_mod", model))}.values():
                register_run(target, self._close_for_inference)

    def __repr__(self) -> str:
        state = "prepared" if self.model is not None else "not prepared"
        return f"MixedPrecision({str(self.policy)!r}, scaler={type(self.scaler).__name__}, {state})"

    # ----- torch's Join (uneven inputs under DDP) -----------------------------------------------------
    def join_hook(self, **kwargs: Any) -> Any:
        """The hook ``torch.distributed.algorithms.join.Join`` calls on a rank whose inputs ran out.

        Every step agrees on inf/NaN across ranks (an all-reduce per optimizer, which torch.amp's
        recipe does not have), so under ``Join`` list the run after the DDP module,
        ``Join([ddp, prec])``: the joined ranks then shadow that all-reduce. A ``wrap_ddp`` model
        in ``Join([ddp])`` alone raises at the step, naming this. When every rank has joined,
        DDP broadcasts the last joiner's parameters and this hook its FP32 masters (collectives),
        so the replicas end equal; optimizer states stay per rank, as in torch.

        Raises:
            TypeError: the run's scaler is not one of mixprec's (a custom ``LossScaler`` agrees
                on its own terms).
        """
        return FoundInfJoinHook(self._join_state(), self.join_device, self.join_process_group, self._sync_after_join,
                                self._update_while_joined)

    def _update_while_joined(self, flags: list[torch.Tensor]) -> None:
        """On a joined rank: the scale update the other ranks' iteration made (their agreed flags)."""
        self.scaler.update(combine_found_inf(flags))

    def _sync_after_join(self, is_last_joiner: bool) -> None:
        """After ``Join``: the FP32 masters (and remainders) follow DDP's final model from the last rank to join."""
        tensors = [m for o in self.optimizers if isinstance(o, MasterWeightOptimizer)
                   for p, m in zip(o.model_params, o.masters) if p is not m]
        tensors += [r for o in self.optimizers if isinstance(o, MasterWeightOptimizer)
                    for r in getattr(o, "_rems", ()) if r is not None]
        with torch.no_grad():
            broadcast_from_last_joiner_(tensors, is_last_joiner, self.join_process_group, self.join_device)

    @property
    def join_device(self) -> torch.device:
        """The device of the inf/NaN flag the steps all-reduce (for ``Join``)."""
        if self.device is None:
            raise ValueError("MixedPrecision in torch's Join before prepare(): prepare the model first.")
        return self.device

    @property
    def join_process_group(self) -> Any:
        """The group the steps agree over (for ``Join``): the scaler's, or the default one."""
        return join_group(getattr(self.scaler, "process_group", None))

    @property
    def _join_config(self) -> Any:
        join = getattr(self.scaler, "_join", None)
        return join.config if join is not None else None

    @_join_config.setter
    def _join_config(self, config: Any) -> None:
        self._join_state().config = config

    def _join_state(self) -> Any:
        join = getattr(self.scaler, "_join", None)
        if join is None and isinstance(self.scaler, _ScalerBase):  # a scaler pickled before Join support
            join = self.scaler._join = JoinState()
        if join is None:
            raise TypeError(
                f"MixedPrecision with a {type(self.scaler).__name__} scaler cannot take part in torch's Join: only "
                "mixprec's scalers (DynamicScaler, StaticScaler, NoOpScaler) count their all-reduces for it."
            )
        return join

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
          are hooked in, the optimizers are returned unchanged (with a guarded ``step``).
        * ``*-master``: parameters are cast to half precision (islands stay FP32) and each
          optimizer is wrapped in a :class:`MasterWeightOptimizer` whose masters are the exact
          FP32 weights from before the cast. Frozen parameters (``requires_grad=False``) get no
          master until they are unfrozen.
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
        if on_check_fail not in ("warn", "raise"):
            raise ValueError(f"on_check_fail={on_check_fail!r}; use 'warn' or 'raise'.")
        facts = check_prepare(model, optimizers, self.policy, self.grad_accumulation, keep_dtypes=self._keep_dtypes)
        if self.fused and not facts.fsdp and self.policy.compensation == "none":
            check_fusable(optimizers, self.policy.has_masters)  # before anything is cast: prepare changes nothing when it raises
        if check_batch is not None:
            from .numerics import preflight

            floor = self.scaler._core.cfg.floor if isinstance(self.scaler, DynamicScaler) else None
            self.check_result = preflight(model, check_batch, self.policy, loss_fn, on_fail=on_check_fail,
                                          _fail_arg="on_check_fail='warn' to prepare()", min_scale=floor)

        # --- from here on the model and optimizers change ---
        if self.policy.fp8 != "none":  # f8= policies: the chosen nn.Linear -> torchao FP8 (mixprec._fp8)
            from ._fp8 import convert_for_policy
            from .numerics import fp8_plan  # f8_layers=auto measures the layers (imported only for FP8 runs)

            convert_for_policy(model, self.policy, check_batch, loss_fn, planner=fp8_plan)
        originals = {id(p): p.data for p in facts.floating}  # FP32 tensors the cast replaces (no copy)
        # FSDP2 gathers half-precision copies itself: hooks only, parameters (the masters) stay FP32.
        # (bf16-master-r16 aside: its shards are cast to BF16 and its masters are remainders beside them.)
        fsdp_masters = facts.fsdp and self.policy.has_masters and self.policy.master_storage == "full"
        if facts.fsdp:  # FSDP2 DTensor shards are cast by swapping them (mixprec._dist, issue 16)
            from ._casting import island_modules
            from ._dist import cast_fsdp_shards

            cast_fsdp_shards(model, self.policy, island_modules)
        rollback = Rollback(model, optimizers) if not facts.fsdp and self.policy.fp8 == "none" else None
        try:
            cast_module(model, self.policy.replace(param_dtype=torch.float32, master_dtype=None) if fsdp_masters
                        else self.policy, keep_dtypes=self._keep_dtypes)
            wrapped = wrap_optimizers(optimizers, self.policy, self.grad_accumulation, facts, originals, fused=self.fused)
            guard_assign(model)  # load_state_dict(assign=True) would swap the parameters the optimizers hold
        except BaseException:
            if rollback is not None:  # nothing changed when prepare raises (FSDP2 shards and FP8 swaps aside)
                rollback.restore()
            raise
        warn_host_reads(wrapped, facts.device)
        if self.policy.param_dtype != torch.float32 and not self._keep_dtypes and not fsdp_masters:
            check = AddedParamCheck(model, self.policy)
            for opt in wrapped:
                if isinstance(opt, MasterWeightOptimizer) or hasattr(opt, "load_full_precision_params_"):
                    opt._added_check = check  # type: ignore[attr-defined]  # read by their add_param_group
        if facts.fsdp or self.policy.compensation == "stochastic":
            # one stochastic-rounding seed on every rank (a broadcast when distributed: plain DDP around a
            # bf16-pure model kept each rank's own seed, and the replicas drifted apart), global positions
            # of FSDP2's shards
            from ._dist import agree_optimizers_

            agree_optimizers_(wrapped)
        self.model = model
        self.device = facts.device
        self.optimizers = wrapped
        for target in {id(m): m for m in (model, getattr(model, "_orig_mod", model))}.values():
            register_run(target, self._close_for_inference)
        self._records = {}
        for given, opt in zip(optimizers, wrapped):
            rec = OptimizerRecord(opt)
            rec.guard = install_step_guard(opt, "route", self._step_from_optimizer)
            if opt is not given:
                # The optimizer the user built now steps inside ours (masters) or was replaced
                # (compensated): stepping it directly would bypass mixprec.
                refused = install_step_guard(given, "refuse")
                if not isinstance(opt, MasterWeightOptimizer):
                    # (from_torch linked it to ``given``: an LR scheduler built on ``given`` follows it, also
                    # through load_state_dict; mixprec.optim's StateIO.load_state_dict re-points the groups)
                    refused.converted_to = type(opt)
            if isinstance(opt, MasterWeightOptimizer):
                opt.set_unscale_callback(self._unscale_callback(opt))
                opt.weight_edits = self.weight_edits
            elif opt is given and self.fused is True and not facts.fsdp and fusable_plain(opt):
                # Update and skip in one compiled kernel, on request only: by default torch's own fused
                # kernel steps it (the twin, _stepping.py), as fast and with nothing to compile (docs/optim.md).
                rec.shadow = FusedShadow(opt, self.fused)
            self._records[id(opt)] = rec
        self._iteration_flags = []
        self._applied_steps = AppliedSteps(torch.zeros((), dtype=torch.int64, device=facts.device))
        self._seen_compiled = None
        return (model, *wrapped)

    def _unscale_callback(self, optimizer: Optimizer) -> Callable[[str], None]:
        """For a master optimizer's gradient views: refuse reads of gradients that still carry the loss scale."""
        import weakref

        ref = weakref.ref(self)

        def check_unscaled(op: str) -> None:
            prec = ref()
            if prec is None or not prec._scales_loss:
                return
            if torch._C._current_graph_task_id() != -1 and is_distributed():
                # Inside a backward under a process group: DDP's reducer reads the gradient of a no_sync()
                # micro-batch into its bucket, on the scaled gradient by design (as under torch.amp). A
                # single process has no reducer: a hook's read there is the user's, and is checked.
                return
            rec = prec._records.get(id(optimizer))
            if rec is not None and rec.stage == "backward":
                raise ValueError(
                    f"a gradient of this model was used by torch op {op!r} while it still carries the loss scale (policy "
                    f"{prec.policy.label!r}), so the result would be off by the scale; call prec.unscale_(optimizer) "
                    "first, or use prec.clip_grad_norm_(max_norm), which unscales for you (torch.amp's GradScaler asks "
                    "the same: scaler.unscale_(optimizer) before clipping). Edits the scale does not change work before "
                    "the unscale too: zero_(), fill_(0), masked_fill_(mask, 0), p.grad[mask] = 0, mul_/div_ by a mask or a factor."
                )

        return check_unscaled

    def _close_for_inference(self, reason: str | None = None) -> None:
        """``for_inference(model)`` on this run's model: the run closes (the cast that follows ends its training).

        The model keeps the weights it holds (an edit since the last step, ``ema.copy_to``,
        ``load_state_dict``, is what gets cast); the FP32 masters are not copied in, since a value
        edit that left a weight at its previous rounding could not be told from a stale master. For
        the masters' precision, cast an FP32 model loaded from ``fp32_state_dict(prec)``. The
        gradient hooks come off; every later call that needs the run raises a ``ValueError``
        naming ``for_inference`` (:meth:`_require_prepared`), or ``reason`` (``uncast_module``).
        """
        for opt in self.optimizers:
            if isinstance(opt, MasterWeightOptimizer):
                opt.remove_hooks()
        self._closed = reason or (
            "this run's model was cast for inference by for_inference(), which closed the run (the model now holds its "
            "weights in the inference dtype; training on would train that cast model). To evaluate during training "
            "use `with torch.no_grad(), prec.autocast(): model(x)`; to train on, load a checkpoint into a new "
            "MixedPrecision."
        )
        self._records = {}

    def _record(self, optimizer: Optimizer, what: str) -> OptimizerRecord:
        """The record of a prepared optimizer; raises when not prepared, or for a foreign optimizer (hot path: one lookup)."""
        rec = self._records.get(id(optimizer))
        if rec is None or rec.optimizer is not optimizer:
            self._require_prepared(what)
            hint = ""
            if any(isinstance(o, MasterWeightOptimizer) and o.optimizer is optimizer for o in self.optimizers):
                hint = " You passed the optimizer you gave prepare(); use the one prepare() returned (it holds the masters)."
            raise ValueError(f"{what}: this optimizer was not returned by prepare().{hint}")
        return rec

    @property
    def _scales_loss(self) -> bool:
        """Whether gradients can carry a loss scale (anything but a no-op scaler)."""
        return not isinstance(self.scaler, NoOpScaler)

    # ----- the training step -----------------------------------------------------------------------
    def autocast(self, *, cache_enabled: bool | None = None) -> autocast | torch.autocast:
        """A region that computes in the policy's compute dtype on the prepared model's device.

        ``cache_enabled`` is ``torch.autocast``'s: ``False`` when the optimizer steps inside the
        region and a later forward in it must see the new FP32 weights (the cached half copies
        would be the old ones under ``*-mixed``); the Lightning plugin passes ``False``, as
        Lightning's own mixed precision does. ``None`` (default): the enclosing region's setting.

        Inside a function that ``torch.compile`` is tracing, this is a plain ``torch.autocast``
        (which dynamo compiles into the graph, no graph break) when the policy does not ask for
        TF32: the TF32 switches are global backend flags that dynamo cannot trace, and inductor
        reads them once, at compile time. A TF32 policy keeps the full region (one graph break
        at its entry); set TF32 globally (``torch.backends.cuda.matmul.allow_tf32 = True``) and
        use ``torch.autocast`` yourself if that break matters. Off CUDA, where the switches act on
        nothing, it is a plain ``torch.autocast`` too (a policy without TF32 only): the switches
        would be pure per-step cost.
        """
        # Reads only .policy and .device: integrations.accelerate calls it on an object holding those two.
        policy, device = self.policy, self.device
        device_type = resolve_device_type(device)
        if not policy.tf32 and (device_type != "cuda" or torch.compiler.is_compiling()):
            return torch.autocast(
                device_type=device_type,
                dtype=policy.compute_dtype if policy.uses_autocast else None,
                enabled=policy.uses_autocast,
                cache_enabled=cache_enabled,
            )
        return autocast(policy, device, cache_enabled=cache_enabled)

    def backward(self, loss: torch.Tensor, **backward_kwargs: Any) -> None:
        """Backpropagate ``loss``, scaled when the policy scales.

        Call it once per micro-batch; gradients accumulate (in FP32 for master-weight policies)
        and are unscaled once, at :meth:`clip_grad_norm_` or :meth:`step`. A ``backward`` after a
        step ends the iteration (one scale update, see the class docstring) before the loss is
        scaled. For a CUDA loss, under a TF32 policy the backward matmuls run in TF32 as the
        forward ones do, and under any other policy without it (the global switches are restored
        afterwards); elsewhere the switches, which only act on cuBLAS/cuDNN, are left alone.

        Args:
            loss: A scalar floating tensor that requires grad.
            **backward_kwargs: Passed to ``Tensor.backward`` (``retain_graph``, ...).

        Raises:
            ValueError: before ``prepare``; ``loss`` not a scalar with a graph; backward after the
                gradients were already unscaled in this iteration, before any step (call ``step`` first);
                ``create_graph=True`` under master weights with ``grad_accumulation="fp32"``.
        """
        self._require_prepared("backward()")
        # One cheap test for the usual loss; the detailed messages only when it fails (hot path).
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad and loss.is_floating_point() and loss.numel() == 1):
            _check_loss(loss)
        if backward_kwargs and backward_kwargs.get("create_graph") and self.policy.has_masters \
                and self.grad_accumulation == "fp32":
            raise ValueError(CREATE_GRAPH_FP32_ACCUMULATION)
        records = self._records.values()
        for rec in records:
            if rec.stage == "unscaled":
                self._abandon_unscaled(rec)
        if self._iteration_flags and self.scale_update == "auto":
            self._end_iteration()
        # Autocast regions end before backward, so the TF32 switch they set is gone here; the
        # backward matmuls are as large as the forward ones and follow the policy too. The switches
        # only act on CUDA (cuBLAS/cuDNN): elsewhere the region would be pure per-step cost.
        if self._seen_compiled is None:
            self._note_compiled(loss)
        if loss.is_cuda:
            with tf32(self.policy.tf32):
                self.scaler.scale(loss).backward(**backward_kwargs)
        else:
            self.scaler.scale(loss).backward(**backward_kwargs)
        for rec in records:
            rec.stage = "backward"

    def _note_compiled(self, loss: torch.Tensor) -> None:
        """At the first backward: does the model run compiled? Then ``fused=None`` fuses the compensated steps on any device.

        Host work once per run (a walk over the loss's autograd graph, ``_fused.runs_compiled``).
        """
        self._seen_compiled = runs_compiled(loss)
        if not self._seen_compiled or self.fused is not None:
            return
        for rec in self._records.values():
            opt = rec.optimizer
            # Only the compensated optimizers, whose eager step is 2-4x the compiled one's. The master
            # step and a plain policy's torch optimizer keep torch's fused kernel on a CPU: as fast as
            # the compiled step there (compile_overhead.py: 0.95x vs 1.01x torch.amp's step for
            # bf16-mixed, 1.01x for bf16-master either way) without its seconds of compiling.
            if hasattr(opt, "prefer_fused") and not isinstance(opt, MasterWeightOptimizer):
                opt.prefer_fused = True

    def _grads(self, optimizer: Optimizer) -> list[torch.Tensor]:
        if isinstance(optimizer, MasterWeightOptimizer):
            grads = optimizer.master_grads()  # (DTensors for bf16-master-r16's FSDP2 shards)
        else:
            grads = [grad for g in optimizer.param_groups for p in g["params"] if (grad := p.grad) is not None]
        if len(set(map(type, grads))) > 1 or (grads and type(grads[0]) is not torch.Tensor):
            # FSDP2's DTensor gradients: unscale/check the local shard (found_inf is agreed across ranks after).
            grads = [local_grad(g) for g in grads]
        return grads

    def _abandon_unscaled(self, rec: OptimizerRecord, raise_if_left: bool = True, zeros: bool = True) -> None:
        """A backward after ``unscale_``/``clip_grad_norm_`` with no step: allowed when the gradients were cleared.

        That is a batch skipped on its gradient norm (``norm = prec.clip_grad_norm_(c); if not
        norm.isfinite(): opt.zero_grad(); continue``): the iteration ends without a step, its
        inf/NaN flag counted for the scale update (an overflow backs the FP16 scale off, as
        ``scaler.update()`` after a skipped ``scaler.step`` does in torch.amp). With gradients
        still there, the backward would add scaled gradients to unscaled ones: raises.
        """
        if not self._cleared(rec.optimizer, zeros):
            if not raise_if_left:
                return
            raise ValueError(
                "backward() after the gradients were unscaled (by clip_grad_norm_ or unscale_) in the same step "
                "would mix scaled and unscaled gradients; call step() first, or, to skip this batch, clear the "
                "gradients (optimizer.zero_grad()) before the next backward."
            )
        if rec.found_inf is not None:
            self._iteration_flags.append(rec.found_inf)
        rec.stage, rec.found_inf = "idle", None

    def _cleared(self, opt: Optimizer, zeros: bool = True) -> bool:
        """Whether ``opt``'s gradients were cleared since the unscale: ``None``, or (``zeros``) zeros (``set_to_none=False``).

        ``state_dict()`` asks with ``zeros=False``: between a clip and its step a batch's gradients
        may be exactly zero (a fully masked batch) and are still that step's.

        Host reads: one per gradient left as a tensor (this path runs only for a batch skipped after an unscale).
        """
        grads: list[torch.Tensor] = []
        if isinstance(opt, MasterWeightOptimizer):
            # under FP32 accumulation a master gradient written through a view the user dropped is stale
            grads += [p.grad for p in opt.model_params if p.grad is not None and not isinstance(p.grad, MasterGradView)]
            grads += [m.grad for p, m in zip(opt.model_params, opt.masters) if p is not m and m.grad is not None
                      and (getattr(m.grad, FROM_VIEW, False) is False or isinstance(p.grad, MasterGradView))]
        else:
            holders = optimizer_tensors(opt)
            grads += [t.grad for t in (*holders, *model_params_of(opt)) if t.grad is not None]
        if not zeros:
            return not grads
        return not any(bool((g.coalesce().values() if g.is_sparse else g).ne(0).any()) for g in grads)

    def _has_grads(self, optimizer: Optimizer) -> bool:
        holders = optimizer.masters if isinstance(optimizer, MasterWeightOptimizer) else optimizer_tensors(optimizer)
        return any(t.grad is not None for t in (*holders, *model_params_of(optimizer)))

    def unscale_(self, optimizer: Optimizer) -> torch.Tensor:
        """Unscale this optimizer's gradients in place (once per step) and check them for inf/NaN.

        Gradients from a plain ``loss.backward()`` are accepted under policies without loss
        scaling (they are what ``prec.backward`` would have produced); under a scaling policy
        they raise, because they were never scaled.

        Returns:
            ``found_inf``: 0-d float32, 1.0 when any gradient is inf/NaN (agreed across ranks
            when torch.distributed is initialised). No host sync.

        Raises:
            ValueError: no gradients since the last step, gradients from ``loss.backward()``
                under a scaling policy, or a foreign optimizer.
        """
        return self._unscale(self._record(optimizer, "unscale_()"))

    def _unscale(self, rec: OptimizerRecord) -> torch.Tensor:
        """:meth:`unscale_` for a known record (the step's hot path enters here)."""
        optimizer = rec.optimizer
        if rec.stage == "unscaled":
            return rec.found_inf  # type: ignore[return-value]  # set with the stage
        if rec.stage == "idle":
            if not self._has_grads(optimizer):
                raise ValueError(
                    "unscale_()/clip_grad_norm_()/step() without backward() in this step: there are no new gradients."
                )
            if self._scales_loss:
                # e.g. loss.backward() instead of prec.backward(loss): FP16 gradients would be unscaled wrongly
                raise ValueError(
                    "unscale_()/clip_grad_norm_()/step() without backward() in this step: the gradients present did not "
                    "come from prec.backward(loss) since the last step. Call prec.backward(loss) instead of "
                    "loss.backward() (it scales the loss when the policy needs it), and zero_grad() after each step."
                )
        scaler = self.scaler
        grads = self._grads(optimizer)
        # our scalers take the gradients as they are (no second pass sorting parameters from gradients)
        found_inf = scaler.unscale_grads_(grads) if isinstance(scaler, _ScalerBase) else scaler.unscale_(grads)
        rec.found_inf = found_inf
        rec.stage = "unscaled"
        return found_inf

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, optimizer: Optimizer | None = None
    ) -> torch.Tensor:
        """Clip the unscaled (FP32 for master policies) gradients to ``max_norm``; returns the total norm.

        Unscales first if needed. With inf/NaN gradients the norm is inf/NaN and the step will
        be skipped anyway. No host sync.

        The norm and the clipped gradients are bit for bit torch's ``clip_grad_norm_``. Under a
        policy without loss scaling (``bf16-mixed``, ``bf16-master``), when this step's FP32
        gradients have not been checked yet, the inf/NaN check rides on the clipping multiply:
        one ``torch._amp_foreach_non_finite_check_and_unscale_`` with the clip coefficient as
        its factor (it flags the values it reads, before multiplying) replaces torch's
        ``_foreach_mul_``, so clipping and checking read and write the gradients once, as
        torch.amp's bf16 recipe's clipping alone does (a GPU step saves a pass over them).
        """
        self._require_prepared("clip_grad_norm_()")
        opts = [optimizer] if optimizer is not None else self.optimizers
        tensors: list[torch.Tensor] = []
        deferred: list[tuple[OptimizerRecord, list[torch.Tensor]]] = []
        for opt in opts:
            at_clip = self._check_at_clip(opt)
            if at_clip is not None:  # checked below, in the clipping multiply
                deferred.append(at_clip)
                continue
            self.unscale_(opt)
            tensors += [t for t in optimizer_tensors(opt) if t.grad is not None]
        if not deferred:
            return torch.nn.utils.clip_grad_norm_(tensors, max_norm, norm_type=norm_type)
        # torch's clip_grad_norm_ in its two halves, the multiply of the deferred gradients fused with their check
        own = [g for _, grads in deferred for g in grads]
        total = torch.nn.utils.get_total_norm([*(typing_cast(torch.Tensor, t.grad) for t in tensors), *own], norm_type)
        if tensors:
            torch.nn.utils.clip_grads_with_norm_(tensors, max_norm, total)
        coef = (max_norm / (total + 1e-6)).clamp_(max=1.0)  # torch's clip_coef_clamped, bit for bit
        scaler = typing_cast(_ScalerBase, self.scaler)
        for rec, grads in deferred:
            rec.found_inf = scaler.unscale_grads_(grads, factor=coef)
            rec.stage = "unscaled"
        return total

    def _check_at_clip(self, optimizer: Optimizer) -> tuple[OptimizerRecord, list[torch.Tensor]] | None:
        """The record and gradients ``clip_grad_norm_`` may check in its multiply, or ``None`` to unscale first as usual.

        Only when nothing could differ from unscale-then-clip: a no-op scaler (no scale to take
        out first), gradients not yet checked this step, ``unscale_`` not extended by a subclass,
        and plain FP32 tensors on one device (one fused kernel call; what torch multiplies them
        by and what the kernel multiplies by round alike only in FP32).
        """
        rec = self._records.get(id(optimizer))
        if (
            rec is None or rec.optimizer is not optimizer or rec.stage == "unscaled" or _NO_TOTAL_NORM
            or type(self.scaler) is not NoOpScaler or type(self).unscale_ is not MixedPrecision.unscale_
        ):
            return None
        if rec.stage == "idle" and not self._has_grads(optimizer):
            return None  # unscale_ raises its error
        grads = self._grads(optimizer)
        if not grads:
            return None
        g0 = grads[0]
        device = g0.device
        for g in grads:
            if type(g) is not torch.Tensor or g.dtype != torch.float32 or g.device != device or g.is_sparse:
                return None
        return rec, grads

    def step(self, optimizer: Optimizer, *, schedulers: Iterable[Any] = ()) -> StepInfo:
        """Unscale, check, and step ``optimizer`` unless a gradient is inf/NaN; update the loss scale.

        ``optimizer.step()`` on an optimizer ``prepare`` returned does the same.

        Args:
            optimizer: An optimizer returned by :meth:`prepare`.
            schedulers: LR schedulers (or anything with ``.step()``) to advance only when the step
                was applied. Host sync: one read of ``skipped`` when given.

        Returns:
            :class:`StepInfo` (0-d device tensors); also kept as ``self.last_step``.

        Raises:
            ValueError: before ``prepare``, for an optimizer not returned by ``prepare``, or
                without a ``backward`` since the last step.
            TypeError: a scheduler whose ``step`` needs an argument (``ReduceLROnPlateau``), or one
                without ``step``: checked before anything steps.
            NumericsError: the scaler's escalation (persistent inf/NaN), after the step's
                bookkeeping is complete.
        """
        # The per-step hot path: its Python cost is what mixprec adds to every step of a small model
        # (issue 14: no more than torch.amp's), so lookups are inlined and nothing is validated twice.
        if torch.compiler.is_compiling():
            return _step_outside_trace(self, optimizer, schedulers)
        rec = self._record(optimizer, "step()")
        if rec.blocked is not None:
            raise RuntimeError(f"step(): {rec.blocked}")
        if schedulers:
            schedulers = _check_schedulers(schedulers)
        auto = self.scale_update == "auto"
        if rec.stepped and auto:
            self._end_iteration()  # rule 3: a second step of the same optimizer starts a new iteration
        # a subclass that extends unscale_ (mixprec.apex ORs its overflow flags in) keeps its say
        found_inf = self._unscale(rec) if type(self).unscale_ is MixedPrecision.unscale_ else self.unscale_(optimizer)
        scaler = self.scaler
        scale_used = scaler.loss_scale.clone()  # never requires grad: no detach
        guard = rec.guard
        if guard is not None:
            guard.depth += 1
        try:
            shadow = rec.shadow
            view = shadow.view() if shadow is not None and not shadow.off else None
            if view is not None:  # the compiled update: skips on found_inf inside the kernel, no host read
                shadow.step(view, (), None, found_inf)
                decided = found_inf
            else:
                decided = step_or_skip(optimizer, found_inf, None, (), {}, twin=True)[0]  # found_inf itself: skipped iff set
        finally:
            if guard is not None:
                guard.depth -= 1
        rec.stage = "idle"
        counter: AppliedSteps = self._applied_steps  # type: ignore[assignment]  # set by prepare()
        info = StepInfo(found_inf, scale_used, (counter.push(decided), counter), decided)
        self.last_step = info
        # torch's LR schedulers ask the optimizer whether its step ran (the mark their step wrapper sets): this step
        # reached the optimizer below that wrapper, so set the mark ("lr_scheduler.step() before optimizer.step()")
        optimizer._opt_called = True  # type: ignore[attr-defined]
        if schedulers and info.applied():
            # before the scale update, which may raise (escalation): an applied step has advanced its schedule
            for s in schedulers:
                sched_opt = getattr(s, "optimizer", None)
                if sched_opt is not None and sched_opt is not optimizer:
                    sched_opt._opt_called = True  # (the same mark, for a scheduler on the optimizer the user built)
                s.step()
        if auto and len(self._records) == 1 and not self._iteration_flags and isinstance(scaler, _ScalerBase):
            # Rule 1 for the usual loop (one optimizer, nothing pending): the iteration ends here,
            # with this step's flag and no gradients held across it; what _end_iteration does, inline.
            scaler.update(found_inf, used=scale_used)  # the history keeps the step's snapshot: no ring write
        else:
            rec.stepped = True
            self._iteration_flags.append(found_inf)
            if auto and all(r.stepped for r in self._records.values()):
                self._end_iteration()  # rule 1
        return info

    @property
    def applied_steps(self) -> torch.Tensor:
        """Optimizer steps applied so far in this run (0-d int64 on the device; no host sync).

        Skipped steps do not count; every prepared optimizer's applied step does. Restored by
        :meth:`load_state_dict`. Raises ``ValueError`` before :meth:`prepare`.
        """
        self._require_prepared("applied_steps")
        return typing_cast(AppliedSteps, self._applied_steps).fold()

    def _step_from_optimizer(self, optimizer: Optimizer) -> None:
        """What a direct ``optimizer.step()`` on a prepared optimizer runs."""
        self.step(optimizer)

    def update(self) -> None:
        """End the iteration now: one loss-scale update with the flags of the steps since the last one.

        A no-op when no optimizer stepped since the last update. Needed only with
        ``scale_update="manual"``, or to update at a point of your choosing.

        Raises:
            NumericsError: the scaler's escalation (persistent inf/NaN).
        """
        self._require_prepared("update()")
        self._end_iteration()

    def _end_iteration(self) -> None:
        """One scale update for the iteration; gradients held across it follow the new scale."""
        flags = self._iteration_flags
        if not flags:
            return
        any_inf = combine_found_inf(flags)  # one optimizer (the common case): the flag itself, no kernel
        holders = [r for r in self._records.values() if not r.stepped and r.stage != "idle"]
        old_scale = self.scaler.loss_scale.detach().clone() if holders and self._scales_loss else None
        # Book-keeping first: update() may raise NumericsError (escalation), and a caller that
        # catches it must not carry this iteration's flags into the next one.
        self._iteration_flags = []
        for r in self._records.values():
            r.stepped = False
        try:
            self.scaler.update(any_inf)
        finally:
            if old_scale is not None:
                self._rescale_held(holders, old_scale)

    def _rescale_held(self, holders: list[OptimizerRecord], old_scale: torch.Tensor) -> None:
        """Bring gradients that did not step in the ended iteration to the new loss scale (on the device)."""
        new_scale = self.scaler.loss_scale.detach()
        for rec in holders:
            grads = self._grads(rec.optimizer)
            if grads:
                factor = new_scale / old_scale if rec.stage == "backward" else new_scale.clone()
                for g in grads:
                    g.mul_(factor.to(g.device))
            rec.stage = "backward"  # scaled again: the next unscale_ divides by the new scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``zero_grad`` on every prepared optimizer."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def release(self) -> None:
        """End the run: undo the step guards ``prepare`` installed on the optimizers and its gradient hooks.

        The model stays cast (``mixprec.uncast_module(model)`` removes the casts). Every later call
        that needs the run (``backward``, ``step``, ``state_dict``, ...) raises a ``ValueError``
        saying it was released: a ``backward`` would still scale the loss, and the optimizers,
        unguarded now, would apply the scaled gradients.
        """
        for opt in self.optimizers:
            remove_step_guard(opt)
            if isinstance(opt, MasterWeightOptimizer):
                remove_step_guard(opt.optimizer)
        self._close_for_inference(
            "this run was ended by prec.release() (its optimizers step on their own now; a backward here would still "
            "scale the loss). Use a new MixedPrecision to train with mixprec again."
        )


def _check_loss(loss: Any) -> None:
    """Raise the error that says what is wrong with a loss handed to ``MixedPrecision.backward``."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"backward(loss) needs a tensor, got {type(loss).__name__}")
    if loss.numel() != 1 or not loss.dtype.is_floating_point:
        raise ValueError(
            f"backward(loss) needs a scalar floating loss, got shape {tuple(loss.shape)} {loss.dtype}; reduce it "
            "(e.g. loss.mean()) first."
        )
    if not loss.requires_grad:
        raise ValueError("the loss does not require grad (computed under torch.no_grad(), or from detached tensors?).")


def _check_schedulers(schedulers: Any) -> list[Any]:
    """The ``schedulers=`` argument of ``step()`` as a list; ``TypeError`` for what it cannot advance.

    Checked before the optimizer steps, so a refused call changes nothing. Any iterable of
    schedulers is accepted (a list, ``dict.values()``, a generator).
    """
    if callable(getattr(schedulers, "step", None)):
        raise TypeError(
            f"step(schedulers=...) takes a list of LR schedulers, got one {type(schedulers).__name__}; pass "
            "schedulers=[scheduler]. Nothing was stepped."
        )
    try:
        listed = list(schedulers)
    except TypeError:
        raise TypeError(
            f"step(schedulers=...) takes a list of LR schedulers, got {type(schedulers).__name__}; pass "
            "schedulers=[scheduler]. Nothing was stepped."
        ) from None
    for i, s in enumerate(listed):
        if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                f"step(schedulers=...): scheduler {i} is a ReduceLROnPlateau, whose step needs the metric it watches; "
                "step it yourself after validation, when the step was applied: "
                "info = prec.step(optimizer); if info.applied(): scheduler.step(val_loss). Nothing was stepped."
            )
        if not callable(getattr(s, "step", None)):
            raise TypeError(
                f"step(schedulers=...): entry {i} ({type(s).__name__}) has no step() method; pass a list of LR "
                "schedulers (torch.optim.lr_scheduler.*). Nothing was stepped."
            )
    return listed
