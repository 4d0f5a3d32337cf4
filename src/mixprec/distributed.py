"""Distributed glue: every rank takes the same skip decision; DDP and FSDP2 under a mixprec policy.

* ``found_inf`` agreement: when ``torch.distributed`` is initialised with more than one rank, the
  scalers all-reduce their ``found_inf`` flag with ``MAX`` (:func:`agree_found_inf_`) before
  anyone decides to skip, so one rank's overflow makes every rank skip the step (otherwise the
  replicas' weights would drift apart). It, :func:`is_distributed`, :func:`resolve_group` and
  :func:`local_grad` are defined in the private leaf ``mixprec._dist`` and re-exported here.
* DDP (:func:`wrap_ddp`): prepare the plain model, then wrap it. mixprec's communication hook
  reduces gradients in FP32 (default) or in the compute dtype, and for master-weight policies
  with ``grad_accumulation="fp32"`` it accumulates the *reduced* gradient into the FP32 masters.
* FSDP2 (:func:`fully_shard`, :func:`fsdp_mixed_precision`): shard first, then build the
  optimizer and ``prepare``. FSDP2 keeps FP32 sharded parameters itself, so they are the masters
  of ``*-master`` policies; ``prepare`` then installs hooks but neither casts nor wraps. Under
  half-parameter policies without masters (``bf16-pure``, ``bf16-true``, ``fp16-pure``)
  ``prepare`` casts the shards themselves to BF16/FP16 (no FP32 copy on any rank; FP32 islands
  are sharded on their own) and converts the optimizer to ``mixprec.optim`` as in one process,
  its states sharded like the parameters and its stochastic rounding a function of the seed,
  the step and each element's global position (one seed on every rank).

See docs/distributed.md for the launch commands and the table of supported combinations.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

# The rank agreement and local shards live in the private leaf ``_dist`` (the core imports them
# from there, so the core never imports this module back); this is their public home.
from ._dist import agree_found_inf_, is_distributed, resolve_group
from ._dist import check_fsdp_policy as _check_fsdp_policy
from ._dist import check_prepare_target as check_prepare_target  # explicit re-export (not in __all__, as before)
from ._dist import fsdp_remainders as _fsdp_remainders
from ._dist import is_fsdp2 as _is_fsdp2
from ._dist import local_grad as local_grad  # explicit re-export (not in __all__, as before)
from ._master_grad import is_view
from ._stepping import dense_layout, same_layout

if TYPE_CHECKING:  # core modules are imported inside the functions that need them (this module sits on top)
    from torch.nn.parallel import DistributedDataParallel

    from ._policy import Policy
    from ._precision import MixedPrecision

__all__ = [
    "agree_found_inf_",
    "fsdp_mixed_precision",
    "fully_shard",
    "is_distributed",
    "reduce_dtype_for",
    "resolve_group",
    "wrap_ddp",
]

ReduceDtype = Literal["fp32", "compute"] | torch.dtype | str | None


def reduce_dtype_for(policy: Policy | str, reduce_dtype: ReduceDtype = None) -> torch.dtype:
    """The dtype gradients are reduced in across ranks under ``policy``.

    Args:
        policy: A :class:`mixprec.Policy` or anything ``Policy.parse`` accepts.
        reduce_dtype: ``None`` or ``"fp32"`` (default: FP32 for every policy, so sums of FP16
            gradients neither overflow nor lose low bits), ``"compute"`` (the policy's compute
            dtype: half the traffic), or an explicit ``f32``/``bf16``/``f16`` dtype.

    Returns:
        A ``torch.dtype``.

    Raises:
        ValueError: an unknown value.

    Example:
        >>> reduce_dtype_for("fp16-master"), reduce_dtype_for("bf16-mixed", "compute")
        (torch.float32, torch.bfloat16)
    """
    from ._dtypes import parse_dtype
    from ._policy import Policy

    policy = Policy.parse(policy)
    if reduce_dtype is None or reduce_dtype == "fp32":
        return torch.float32
    if reduce_dtype == "compute":
        return policy.compute_dtype
    try:
        dt = parse_dtype(reduce_dtype)
    except (ValueError, TypeError):
        dt = None
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"reduce_dtype={reduce_dtype!r} is not understood; use None/'fp32' (default), 'compute' (here "
            f"{policy.compute_dtype}), or one of torch.float32, torch.bfloat16, torch.float16."
        )
    return dt


# ----- DDP ------------------------------------------------------------------------------------------
def _refuse_comm_hook(*args: Any, **kwargs: Any) -> None:
    """``register_comm_hook`` of a module ``wrap_ddp`` built: torch allows one hook, and mixprec's is it."""
    raise RuntimeError(
        "this DistributedDataParallel module was built by mixprec.distributed.wrap_ddp, which registered its own "
        "communication hook (it reduces the gradients in the policy's reduce dtype and routes them into the FP32 "
        "masters); torch allows one per module. For compressed reduction pass wrap_ddp(..., reduce_dtype='compute'); "
        "for a hook of your own, wrap the prepared model in DistributedDataParallel yourself (see docs/distributed.md)."
    )


class _DDPState:
    """What mixprec's DDP communication hook needs (one per wrapped model)."""

    def __init__(self, group: Any, reduce_dtype: torch.dtype, masters: dict[int, Tensor]) -> None:
        self.group = group
        self.world = torch.distributed.get_world_size(group)
        self.reduce_dtype = reduce_dtype
        self.masters = masters  # id(half param) -> FP32 master whose .grad gets the reduced gradient
        self.armed = True  # does DDP reduce in this backward (False inside ddp.no_sync())
        self.handles: list[Any] = []  # the gated accumulation hooks
        # (half param, master, its .grad view) of every FP32-accumulating parameter, and the ids of
        # those whose .grad this module set to None itself (so a None there is not the user's clear).
        self.pairs: list[tuple[Tensor, Tensor, Tensor]] = []
        self.cleared_by_us: set[int] = set()
        self.views_queued = False  # show_views is queued for the end of this backward

    def queue_show_views(self) -> None:
        """Have :meth:`show_views` run at the end of this backward, after DDP wrote ``param.grad``.

        DDP queues its own end-of-backward callback (which waits for the reductions and copies
        them into ``param.grad``) when the last bucket is ready, after this module's comm hook
        first ran: a callback queued from the hook would run before it. The autograd engine runs
        callbacks queued by a callback after those already queued, so this queues one that
        queues :meth:`show_views`.
        """
        if self.views_queued or not self.pairs:
            return
        engine = torch.autograd.Variable._execution_engine
        try:
            engine.queue_callback(lambda: engine.queue_callback(self.show_views))
        except RuntimeError:
            # Outside a backward: DDP's Join hook runs the comm hook on a rank whose inputs ran out,
            # to shadow the others' reductions; that rank trains no more, so there is nothing to show.
            return
        self.views_queued = True

    def show_views(self) -> None:
        """Put each reduced master's gradient view in ``param.grad`` in place of DDP's half copy.

        Right after backward, so that in-place edits of ``param.grad`` between backward and the
        step (torch's ``clip_grad_norm_``, ``p.grad.zero_()``, masking) act on the FP32 gradient the
        step uses, and reads of a still loss-scaled gradient raise, as without DDP (the half copy
        took the edits and the step never saw them).
        """
        self.views_queued = False
        for p, m, view in self.pairs:
            if m.grad is not None and p.grad is not view:
                # (also where DDP left p.grad None: a parameter unused in this backward whose master holds
                # the reduced sum of earlier micro-batches; None at the step then means the user cleared it)
                p.grad = view
                self.cleared_by_us.discard(id(p))

    @torch.no_grad()
    def before_forward(self) -> None:
        """Reconcile the masters' gradients with what the user did to ``param.grad`` since the last forward.

        * ``param.grad is None`` and we did not set it: the user cleared the gradients
          (``model.zero_grad()``), so the master's partial sum goes too.
        * a plain tensor: DDP's reduced copy of the last synchronised backward, which the
          master already holds in FP32 (not cleared: the next gradient adds to the master's).
        * the view: micro-batches under ``no_sync()`` accumulated into the master.

        Then, for a synchronising backward ``param.grad`` is set to ``None`` (DDP reduces the
        fresh local gradient; the comm hook adds the master's partial sum in FP32); under
        ``no_sync()`` to the view when the master holds a partial sum (autograd then adds
        into it in FP32).
        """
        for p, m, view in self.pairs:
            g = p.grad
            if g is None and id(p) not in self.cleared_by_us:
                m.grad = None
            if self.armed or m.grad is None:
                p.grad = None
                self.cleared_by_us.add(id(p))
            else:
                p.grad = view
                self.cleared_by_us.discard(id(p))


def _bucket_grad(flat: Tensor, offset: int, p: Tensor) -> Tensor:
    """``p``'s gradient in a DDP bucket's flat buffer ``flat``, as DDP's reducer lays it out: with ``p``'s
    strides when ``p`` is dense (a ``channels_last`` weight's gradient is in that memory order), else
    contiguous from ``offset``."""
    if p.is_contiguous() or not dense_layout(p):
        return flat[offset:offset + p.numel()].view(p.shape)
    return flat.as_strided(p.shape, p.stride(), flat.storage_offset() + offset)


def _reduce_hook(state, bucket):
    # (_DDPState, dist.GradBucket) -> Future[Tensor]. Unannotated on purpose: DDP compares the
    # annotations with its own types, and `from __future__ import annotations` makes them strings.
    """DDP comm hook: average a bucket in ``state.reduce_dtype``; feed FP32-accumulating masters.

    Algorithm, per bucket (a flat buffer of the parameters' local gradients, in their dtype):
        1. If some parameters accumulate into FP32 masters: upcast the bucket to FP32 and add
           the masters' partial sums (micro-batches run under ``no_sync``) at their offsets.
        2. Cast to the reduce dtype, divide by the world size, all-reduce (sum).
        3. Masters take their slices of the result in FP32 (``master.grad = reduced``); DDP gets
           the result back in the bucket's dtype and writes it into ``param.grad`` as usual.
    """
    dist = torch.distributed
    buf: Tensor = bucket.buffer()
    accum: list[tuple[int, Tensor, Tensor]] = []
    if state.masters:
        state.queue_show_views()
        offset = 0
        for p in bucket.parameters():
            m = state.masters.get(id(p))
            if m is not None:
                accum.append((offset, p, m))
            offset += p.numel()
    src = buf
    if accum:
        src = buf.to(torch.float32)
        for off, p, m in accum:
            if m.grad is not None:  # FP32 partial sum from micro-batches under no_sync()
                _bucket_grad(src, off, p).add_(m.grad)
    comm = src.to(state.reduce_dtype)  # no copy when the dtypes already match
    comm.div_(state.world)
    fut = dist.all_reduce(comm, group=state.group, async_op=True).get_future()

    def _done(f: torch.futures.Future[list[Tensor]]) -> Tensor:
        reduced = f.value()[0]
        if accum:
            r32 = reduced.to(torch.float32)
            for off, p, m in accum:
                g = _bucket_grad(r32, off, p)
                # In the master's memory order (the fused optimizer kernels pair elements in memory order); a
                # placeholder master (bf16-master-r16, zero strides) is joined in its weight's, which g has.
                m.grad = g if 0 in m.stride() or same_layout(g, m) else torch.empty_like(m).copy_(g)
        for p in bucket.parameters():
            state.cleared_by_us.discard(id(p))  # DDP writes the reduced gradient into p.grad next
        return reduced.to(buf.dtype)

    return fut.then(_done)


class _GatedAccumulate:
    """Post-accumulate-grad hook for DDP: move the local half gradient into the FP32 master only
    when DDP does not reduce in this backward (``no_sync``); otherwise leave it for DDP's reducer."""

    def __init__(self, state: _DDPState, master: Tensor, view: Tensor) -> None:
        self.state = state
        self.master = master
        self.view = view

    @torch.no_grad()
    def __call__(self, param: Tensor) -> None:
        g = param.grad
        if self.state.armed or g is None or is_view(g):  # a view: autograd already added into the master
            return
        if self.master.grad is None:
            self.master.grad = g.to(self.master.dtype)
        else:
            self.master.grad.add_(g)
        param.grad = self.view  # clearing param.grad now also tells the next forward to drop the partial sum
        self.state.cleared_by_us.discard(id(param))


def wrap_ddp(
    prec: MixedPrecision,
    model: nn.Module,
    *,
    reduce_dtype: ReduceDtype = None,
    process_group: Any = None,
    **ddp_kwargs: Any,
) -> DistributedDataParallel:
    """Wrap a model prepared by ``prec`` in ``DistributedDataParallel`` with mixprec's gradient reduction.

    Order: ``model, opt = prec.prepare(model, opt)`` first, then ``ddp = wrap_ddp(prec, model)``;
    run the forward through ``ddp`` and keep using ``prec.backward``/``prec.step(opt)``.

    What it does:
        * registers a communication hook that averages gradients in :func:`reduce_dtype_for`
          (FP32 by default, also for FP16/BF16 parameters; ``"compute"`` halves the traffic);
        * master-weight policies with ``grad_accumulation="fp32"``: the optimizer's own
          accumulation hooks (which would hide the gradients from DDP's reducer) are replaced by
          hooks that accumulate into the FP32 masters only under ``ddp.no_sync()``, and the comm
          hook adds those partial sums to the last micro-batch's gradient and hands the reduced
          FP32 result to the masters: accumulation and reduction both stay in FP32;
        * broadcasts the FP32 masters from the group's first rank (DDP broadcasts only the
          model's half-precision parameters);
        * compensated optimizers (``bf16-pure``): every rank takes the first rank's seed for
          stochastic rounding (its bits are a function of seed, step and element position, so
          replicas round identically without sharing generator states) and its per-element
          states (Kahan buffers);
        * the scaler agrees ``found_inf`` over ``process_group`` (it is set on the scaler when
          the scaler has none).

    Args:
        prec: A prepared :class:`mixprec.MixedPrecision`.
        model: The model passed to ``prec.prepare`` (not yet wrapped).
        reduce_dtype: See :func:`reduce_dtype_for`.
        process_group: The DDP group (default: world).
        **ddp_kwargs: Passed to ``DistributedDataParallel`` (``device_ids``, ``bucket_cap_mb``, ...).

    Returns:
        The ``DistributedDataParallel`` module.

    Raises:
        ValueError: ``prec`` not prepared, or prepared for another model; a model already wrapped;
            torch.distributed not initialised; an unknown ``reduce_dtype``; an FSDP2 model.

    Host syncs: none per step; a broadcast of the masters (and compensated states, seeds) once, here.
    """
    from torch.nn.parallel import DistributedDataParallel

    from ._master import MasterWeightOptimizer

    if isinstance(prec, nn.Module) and not isinstance(model, nn.Module):
        raise TypeError(
            f"wrap_ddp(prec, model) takes the MixedPrecision first, then the model; got a {type(prec).__name__} and a "
            f"{type(model).__name__}: call wrap_ddp(prec, model) (DistributedDataParallel takes the module first)."
        )
    if prec.model is None:
        raise ValueError("wrap_ddp(prec, model): prec is not prepared; call model, opt = prec.prepare(model, opt) first.")
    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "wrap_ddp(prec, model) got a model already wrapped in DistributedDataParallel; pass the plain prepared "
            "model and let wrap_ddp build the DDP module (it must register its gradient hooks first)."
        )
    if model is not prec.model:
        if getattr(model, "_orig_mod", None) is prec.model:
            raise ValueError(
                "wrap_ddp(prec, model) got the torch.compile'd model; wrap the model prec.prepare() returned and "
                "compile the result instead: torch.compile(wrap_ddp(prec, model)) (DDP's hooks must see the plain module)."
            )
        raise ValueError("wrap_ddp(prec, model): model is not the model prec.prepare() returned; pass that one.")
    if _is_fsdp2(model):
        raise ValueError("wrap_ddp: this model is sharded with FSDP2 (fully_shard); FSDP2 and DDP do not combine.")
    group = resolve_group(process_group)
    rdtype = reduce_dtype_for(prec.policy, reduce_dtype)
    masters: dict[int, Tensor] = {}
    mwos = [o for o in prec.optimizers if isinstance(o, MasterWeightOptimizer)]
    for o in mwos:
        for p, m in zip(o.model_params, o.masters):
            if p is not m and o.grad_accumulation == "fp32":
                masters[id(p)] = m
    state = _DDPState(group, rdtype, masters)
    ddp = DistributedDataParallel(model, process_group=process_group, **ddp_kwargs)
    ddp.register_comm_hook(state, _reduce_hook)
    ddp.register_comm_hook = _refuse_comm_hook  # type: ignore[method-assign]  # torch's "called once" error named no reason
    join = getattr(prec.scaler, "_join", None)
    if join is not None:  # a Join([ddp]) without the run is refused at the step, by name (_dist.JoinState.check)
        join.peers.append(weakref.ref(ddp))

    def _arm(module: nn.Module, args: Any) -> None:
        # DDP prepares its reducer in forward iff grad is on and it is not under no_sync().
        state.armed = bool(torch.is_grad_enabled() and ddp.require_backward_grad_sync)
        if torch.is_grad_enabled():
            state.before_forward()

    ddp.register_forward_pre_hook(_arm)
    by_id = {id(p): p for p in model.parameters()}
    for o in mwos:
        if o.grad_accumulation == "fp32":
            o.remove_hooks()
            for p, m in zip(o.model_params, o.masters):
                if p is not m:
                    view = o.grad_view(p)
                    state.pairs.append((by_id[id(p)], m, view))
                    # Kept on the state, not in o._hooks: an MWO without hooks reads only master.grad.
                    state.handles.append(
                        by_id[id(p)].register_post_accumulate_grad_hook(_GatedAccumulate(state, m, view))
                    )
        # DDP broadcast the half parameters from the first rank; the masters must follow.
        src = torch.distributed.get_global_rank(group, 0) if process_group is not None else 0
        with torch.no_grad():
            # Remainder-stored masters: DDP broadcast the weights (their top halves); the remainders follow.
            for p, m, r in zip(o.model_params, o.masters, o.remainders):
                if p is not m:
                    # int16 as float16 bits: a broadcast only copies bytes, and gloo has no int16
                    torch.distributed.broadcast(m if r is None else r.view(torch.float16), src=src, group=process_group)
            o.copy_to_model_()
    _agree_compensated(prec.optimizers, process_group)
    scaler = prec.scaler
    if process_group is not None and getattr(scaler, "process_group", "absent") is None:
        scaler.process_group = process_group  # type: ignore[attr-defined]  # not in the LossScaler protocol; presence checked above
    return ddp


def _agree_compensated(optimizers: Iterable[Any], process_group: Any) -> None:
    """DDP replicas of a compensated run (``bf16-pure``): one seed, and the first rank's buffers.

    Stochastic rounding's bits are a function of (seed, step, buffer, element position); the
    seed is agreed (:func:`mixprec._dist.agree_optimizers_`) so replicas round identically
    whatever their generator states. The per-element states (the Kahan buffers seeded by
    ``prepare`` from each rank's FP32 weights, the moments) are broadcast from the first rank,
    as DDP broadcasts the parameters.
    """
    from ._dist import agree_optimizers_

    opts = [o for o in optimizers if callable(getattr(o, "_set_global_offsets", None))]
    if not opts:
        return
    agree_optimizers_(opts, process_group)
    src = torch.distributed.get_global_rank(process_group, 0) if process_group is not None else 0
    with torch.no_grad():
        for o in opts:
            for g in o.param_groups:
                for p in g["params"]:
                    for v in o.state.get(p, {}).values():
                        if isinstance(v, Tensor) and v.dim() > 0:
                            torch.distributed.broadcast(v, src=src, group=process_group)


# ----- FSDP2 ----------------------------------------------------------------------------------------
def fsdp_mixed_precision(
    policy: Policy | str, *, reduce_dtype: ReduceDtype = None, island: bool = False, root: bool = False
) -> Any:
    """Map a mixprec policy onto FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy``.

    * ``*-mixed``/``fp32``/``tf32`` (FP32 parameters, autocast compute): ``param_dtype=None`` (FSDP2
      gathers FP32; ``prec.autocast()`` computes in the compute dtype), gradients reduced in FP32.
    * ``*-master``: ``param_dtype`` = the compute dtype (FSDP2 gathers half-precision parameters
      and keeps the FP32 shards: those are the masters), ``output_dtype`` on the root only.
      FP32 islands (``island=True``) keep ``param_dtype=None``.
    * Half parameters without masters (``bf16-pure``, ``bf16-true``, ``fp16-pure``):
      ``param_dtype=None``: the shards themselves are BF16/FP16 (``prepare`` casts them) and
      FSDP2 gathers them as they are; islands stay FP32 shards; ``output_dtype`` on the root.
      Gradients are reduce-scattered in ``reduce_dtype`` (FP32 by default) and stored in the
      shards' dtype.

    Args:
        policy: A :class:`mixprec.Policy` or preset.
        reduce_dtype: See :func:`reduce_dtype_for` (default FP32).
        island: The policy for a separately sharded FP32 island (normalization layers).
        root: The policy for the root module (sets ``output_dtype``).

    Returns:
        A ``MixedPrecisionPolicy``.

    Raises:
        ValueError: masters in another dtype than FP32; an unknown ``reduce_dtype``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ._policy import Policy

    policy = Policy.parse(policy)
    _check_fsdp_policy(policy)
    rdtype = reduce_dtype_for(policy, reduce_dtype)
    # bf16-master-r16: the shards are BF16 already (prepare casts them), so FSDP2 gathers them as they are.
    half_params = policy.has_masters and not island and not _fsdp_remainders(policy)
    return MixedPrecisionPolicy(
        param_dtype=policy.compute_dtype if half_params else None,
        reduce_dtype=rdtype,
        output_dtype=policy.output_dtype if (root and policy.param_dtype != torch.float32) else None,
        cast_forward_inputs=True,
    )


def fully_shard(
    model: nn.Module,
    policy: Policy | str,
    *,
    modules: Iterable[nn.Module] = (),
    reduce_dtype: ReduceDtype = None,
    **fsdp_kwargs: Any,
) -> nn.Module:
    """Apply FSDP2's ``fully_shard`` bottom-up with the mapped mixed-precision policies.

    Order: for policies with half-precision parameters (``*-master``, ``bf16-pure``,
    ``bf16-true``, ``fp16-pure``) every FP32 island (normalization layers by default) with
    parameters is sharded on its own with ``param_dtype=None`` so it keeps FP32 shards and
    computes in FP32; then each of ``modules`` (e.g. transformer blocks); then the root, with
    ``output_dtype``. Call it on the FP32 model *before* building the optimizer (FSDP2 replaces
    the parameters by DTensors) and before ``prec.prepare(model, optimizer)``.

    ``*-master``: the FP32 shards are the masters. Half parameters without masters: ``prepare``
    casts the shards to BF16/FP16 in place (seeding Kahan compensation with what the cast
    drops), so no rank keeps an FP32 copy of those weights; until then the shards are FP32
    (``4 / world_size`` bytes per parameter per rank).

    Args:
        model: The FP32 model.
        policy: The policy the run will be prepared with.
        modules: Submodules to shard as their own units (each one gathered separately).
        reduce_dtype: See :func:`reduce_dtype_for` (default FP32).
        **fsdp_kwargs: Passed to every ``fully_shard`` call (``mesh``, ``reshard_after_forward``...).

    Returns:
        ``model`` (now an ``FSDPModule``).

    Raises:
        ValueError: a policy FSDP2 cannot represent (see :func:`fsdp_mixed_precision`).
    """
    from torch.distributed.fsdp import fully_shard as _fully_shard

    from ._casting import island_modules
    from ._policy import Policy

    policy = Policy.parse(policy)
    _check_fsdp_policy(policy)
    from ._fp8 import convert_for_policy

    convert_for_policy(model, policy)  # f8= policies: FP8 linears before FSDP2 takes their parameters (torchao's order)
    if policy.param_dtype != torch.float32:
        isl = fsdp_mixed_precision(policy, reduce_dtype=reduce_dtype, island=True)
        for _, mod in island_modules(model, policy):
            if mod is not model and any(True for _ in mod.parameters()):
                _fully_shard(mod, mp_policy=isl, **fsdp_kwargs)
    inner = fsdp_mixed_precision(policy, reduce_dtype=reduce_dtype)
    for mod in modules:
        _fully_shard(mod, mp_policy=inner, **fsdp_kwargs)
    _fully_shard(model, mp_policy=fsdp_mixed_precision(policy, reduce_dtype=reduce_dtype, root=True), **fsdp_kwargs)
    return model
