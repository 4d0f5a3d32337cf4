"""Rank agreement and local shards: the part of ``torch.distributed`` the core needs.

A private leaf: it imports nothing from mixprec, so every core module (the scalers, the
fused checks, ``MixedPrecision``) can use it without importing :mod:`mixprec.distributed`,
the DDP/FSDP2 glue that sits on top of the core. ``mixprec.distributed`` re-exports these
names; that is their public home.

* :func:`agree_found_inf_`: all-reduce the ``found_inf`` flag with ``MAX`` before anyone
  decides to skip, so one rank's overflow makes every rank skip the step (otherwise the
  replicas' weights would drift apart).
* :func:`local_grad`: the local shard of a DTensor gradient (FSDP2), for in-place unscaling.
* :func:`is_distributed`, :func:`resolve_group`: the group questions both ask.
* :func:`check_prepare_target` (with :func:`is_fsdp2`, :func:`check_fsdp_policy`,
  :func:`fsdp_param_dtype`): what ``prepare`` checks of a DDP-wrapped or FSDP2-sharded model.
* :func:`cast_fsdp_shards`: ``prepare`` casts FSDP2's DTensor shards (``bf16-pure``: BF16 shards,
  no FP32 copy); :func:`agree_optimizers_` (with :func:`global_flat_offset`): one stochastic-rounding
  seed on every rank and the global position of each shard, for ``mixprec.optim``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "FoundInfJoinHook",
    "JoinState",
    "agree_found_inf_",
    "agree_optimizers_",
    "broadcast_from_last_joiner_",
    "cast_fsdp_shards",
    "check_fsdp_policy",
    "check_prepare_target",
    "dtensor_like",
    "fsdp_param_dtype",
    "fsdp_remainders",
    "global_flat_offset",
    "is_distributed",
    "is_dtensor",
    "is_fsdp2",
    "join_group",
    "local_grad",
    "local_tensor",
    "resolve_group",
]


def is_distributed(group: Any = None) -> bool:
    """Return ``True`` when ``torch.distributed`` is initialised and ``group`` (default: world) has more than one rank.

    Args:
        group: A process group, or ``None`` for the world.

    Returns:
        Whether a collective over ``group`` would involve another rank.

    Example:
        >>> is_distributed()  # no init_process_group in this process
        False
    """
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1)


def resolve_group(group: Any = None) -> Any:
    """Return the process group to use: ``group`` itself, or the world group when ``None``.

    Args:
        group: A process group, or ``None`` for the world.

    Returns:
        ``group``, or ``torch.distributed.group.WORLD``.

    Raises:
        ValueError: ``torch.distributed`` is not initialised (call ``init_process_group`` first).
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "torch.distributed is not initialised; call torch.distributed.init_process_group(...) first "
            "(torchrun sets the environment it reads)."
        )
    return group if group is not None else dist.group.WORLD


class JoinState:
    """What a scaler needs to take part in torch's ``Join`` context (uneven inputs under DDP).

    Agreeing on ``found_inf`` is a collective per ``unscale_``, which torch.amp's ``GradScaler``
    does not have: a rank whose inputs ran out leaves the other ranks' all-reduce unmatched
    (gloo aborts, NCCL hangs). As a joinable listed after the DDP module
    (``Join([ddp, prec])``), the joined rank shadows it: :meth:`main_hook` runs as many
    all-reduces of a zero flag per iteration as the owner ran in its last iteration.
    """

    def __init__(self) -> None:
        self.config: Any = None  # torch's _JoinConfig, set by Join on the owner
        self.agrees = 0  # all-reduces in the current iteration
        self.per_iteration = 1  # in the last completed one
        self.peers: list[Any] = []  # weak references to DDP modules wrapped for this run (wrap_ddp)

    def __getstate__(self) -> dict[str, Any]:
        # a copy (pickle, deepcopy) is in no Join and wraps no DDP module: weak references do not pickle
        return {**self.__dict__, "config": None, "peers": []}

    def count(self, who: str) -> None:
        """One flag all-reduce of this iteration, about to run: checked (:meth:`check`) and counted."""
        self.check(who)
        self.agrees += 1

    def end_iteration(self) -> None:
        """The iteration ended: its count of all-reduces is what a joined rank shadows next."""
        if self.agrees:
            self.per_iteration, self.agrees = self.agrees, 0

    def check(self, who: str) -> None:
        """Raise for a Join whose order cannot shadow the flag's all-reduce (called before each one)."""
        cfg = self.config
        if cfg is not None and cfg.enable and cfg.is_first_joinable:
            raise ValueError(
                f"{who} is the first joinable of torch's Join context; list it after the DDP module, "
                f"Join([ddp, {who}]): the joined ranks shadow DDP's gradient all-reduces first, then the inf/NaN flag's."
            )
        if cfg is None or not cfg.enable:
            for ref in self.peers:
                ddp = ref()
                peer = getattr(ddp, "_join_config", None) if ddp is not None else None
                if peer is not None and peer.enable:
                    raise ValueError(
                        f"the model wrapped by wrap_ddp is inside torch's Join context but {who} is not: it agrees on "
                        f"inf/NaN across ranks (an all-reduce per step) that a joined rank must shadow; list it after "
                        f"the DDP module, Join([ddp, {who}])."
                    )


class FoundInfJoinHook:
    """torch's ``JoinHook`` for a scaler's ``found_inf`` all-reduce (see :class:`JoinState`)."""

    def __init__(self, state: JoinState, device: torch.device, group: Any,
                 after: Callable[[bool], None] | None = None,
                 update: Callable[[list[Tensor]], None] | None = None) -> None:
        self.state, self.device, self.group, self.after, self.update = state, device, group, after, update

    def main_hook(self) -> None:
        """On a rank whose inputs ran out: match the other ranks' flag all-reduces of this iteration.

        Torch calls it once per DDP forward of the other ranks. Under ``no_sync()`` accumulation
        only the synchronising micro-batch is followed by a step: the DDP modules ``wrap_ddp``
        registered say which (DDP's own join hook, which runs first, sets their
        ``require_forward_param_sync`` from the other ranks). The agreed flags then go to
        ``update`` (the owner's scale update), so this rank's loss scale follows the others' and
        the replicas still agree after the ``Join``.
        """
        peers = [d for d in (ref() for ref in self.state.peers) if d is not None]
        if peers and not any(getattr(d, "require_forward_param_sync", True) for d in peers):
            return  # a no_sync() micro-batch on the other ranks: no step, no flag
        flags = []
        for _ in range(max(1, self.state.per_iteration)):
            flags.append(agree_found_inf_(torch.zeros((), dtype=torch.float32, device=self.device), self.group))
        if self.update is not None:
            self.update(flags)

    def post_hook(self, is_last_joiner: bool) -> None:
        """After all ranks joined: the owner's ``after`` (the masters follow DDP's final model), if any."""
        if self.after is not None:
            self.after(is_last_joiner)


def broadcast_from_last_joiner_(tensors: Iterable[Tensor], is_last_joiner: bool, group: Any,
                                device: torch.device) -> None:
    """Broadcast ``tensors`` in place from the rank that joined last (collective; after a ``Join``).

    DDP's join hook broadcasts the last joiner's parameters so the replicas end equal; state
    beside the parameters (FP32 masters) must follow from the same rank.
    """
    dist = torch.distributed
    me = torch.tensor([dist.get_rank(group) if is_last_joiner else -1], device=device)
    dist.all_reduce(me, op=dist.ReduceOp.MAX, group=group)
    src = dist.get_global_rank(group, int(me.item())) if group is not None else int(me.item())
    for t in tensors:
        dist.broadcast(t, src=src, group=group)


def join_group(group: Any) -> Any:
    """The process group a joinable reports to ``Join``: ``group``, or the default one (as DDP's)."""
    if group is not None:
        return group
    from torch.distributed.distributed_c10d import _get_default_group

    return _get_default_group()


def agree_found_inf_(found_inf: Tensor, group: Any = None) -> Tensor:
    """All-reduce ``found_inf`` with ``MAX`` in place across ``group``; a no-op when not distributed.

    Collective: every rank of ``group`` must call it the same number of times, in the same order
    (the scalers call it once per ``unscale_``). It runs on the communication stream; no host
    sync. A CPU flag under the NCCL backend is reduced through a copy on the current CUDA device.

    Args:
        found_inf: 0-d float32 flag (1.0 = some gradient was inf/NaN on this rank).
        group: The process group (``None``: the default, world).

    Returns:
        ``found_inf`` itself, now the maximum over the group's ranks.

    Example:
        >>> import torch
        >>> agree_found_inf_(torch.tensor(0.0))  # not distributed: unchanged
        tensor(0.)
    """
    if not is_distributed(group):
        return found_inf
    dist = torch.distributed
    if found_inf.device.type == "cpu" and dist.get_backend(group) == "nccl":
        tmp = found_inf.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(tmp, op=dist.ReduceOp.MAX, group=group)
        found_inf.copy_(tmp)
        return found_inf
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf


def local_grad(t: Tensor) -> Tensor:
    """Return the local shard of a DTensor gradient (in-place ops on it change the DTensor), else ``t``.

    Args:
        t: A gradient: a plain tensor, or a DTensor (FSDP2 parameters' gradients).

    Returns:
        ``t.to_local()`` for a DTensor (a view of its local shard), ``t`` itself otherwise.

    Example:
        >>> import torch
        >>> g = torch.ones(2)
        >>> local_grad(g) is g
        True
    """
    if type(t) is Tensor:  # the common case, without an attribute lookup
        return t
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


_PLAIN = frozenset({Tensor, torch.nn.Parameter})  # tensor types that are never a DTensor


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 shard), without importing ``torch.distributed``."""
    return type(t) not in _PLAIN and callable(getattr(t, "to_local", None)) and hasattr(t, "placements")


def local_tensor(t: Tensor) -> Tensor:
    """A ``DTensor``'s local shard (the tensor itself: in-place writes reach the DTensor), else ``t``."""
    if type(t) in _PLAIN or not is_dtensor(t):  # the exact-type test inline: optimizer steps call this per tensor
        return t
    # _local_tensor, not to_local(): with grad mode on, to_local() returns a new autograd view each call.
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, Tensor) else t.to_local()  # type: ignore[attr-defined]


def dtensor_like(p: Tensor, local: Tensor) -> Tensor:
    """``local`` laid out like ``p``: a ``DTensor`` of ``p``'s mesh, placements, shape and stride when ``p`` is one."""
    if not is_dtensor(p):
        return local
    from torch.distributed.tensor import DTensor

    d: Any = p
    return DTensor.from_local(local, d.device_mesh, d.placements, run_check=False, shape=p.shape, stride=p.stride())


# ----- prepare-time checks of DDP and FSDP2 models --------------------------------------------------
def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules is sharded with FSDP2 (``fully_shard``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def check_fsdp_policy(policy: Any) -> None:
    """Raise ``ValueError`` for a policy FSDP2 cannot represent: masters in another dtype than FP32.

    Every other policy maps onto FSDP2: ``*-master`` (FSDP2's FP32 shards are the masters),
    ``*-mixed``/``fp32`` (FP32 shards, autocast computes) and half parameters without masters
    (``bf16-pure``, ``bf16-true``, ``fp16-pure``: the shards themselves are BF16/FP16, see
    :func:`cast_fsdp_shards`).
    """
    if policy.has_masters and policy.master_dtype != torch.float32:
        raise ValueError(
            f"policy {policy.label!r} keeps {policy.master_dtype} masters, which FSDP2 cannot do: under FSDP2 the "
            "sharded FP32 parameters are the masters. Use m=f32 (as 'bf16-master' / 'fp16-master' do)."
        )


def fsdp_remainders(policy: Any) -> bool:
    """Whether ``policy`` keeps its masters as BF16 shards plus sharded ``int16`` remainders under FSDP2 (``m=f32:r16``)."""
    return getattr(policy, "master_storage", "full") == "remainder"


def _fsdp_half_params(policy: Any) -> bool:
    """Whether FSDP2 shards of ``policy`` hold half-precision parameters (no masters, or remainder-stored masters)."""
    return (not policy.has_masters or fsdp_remainders(policy)) and policy.param_dtype != torch.float32


def fsdp_param_dtype(module: Any) -> tuple[bool, torch.dtype | None]:
    """(known, param_dtype) of an FSDPModule's mixed-precision policy (private FSDP2 state)."""
    try:
        mp = module._get_fsdp_state()._mp_policy
    except AttributeError:
        return False, None
    return True, mp.param_dtype


def check_prepare_target(
    model: nn.Module, policy: Any, grad_accumulation: str,
    island_modules: Callable[[nn.Module, Any], Iterable[tuple[str, nn.Module]]],
) -> bool:
    """Validate a model handed to ``MixedPrecision.prepare``; return ``True`` for an FSDP2 model.

    Args:
        model: The model handed to ``prepare``.
        policy: The run's :class:`mixprec.Policy`.
        grad_accumulation: ``"fp32"`` or ``"compute"``.
        island_modules: ``mixprec._casting.island_modules`` (passed in: this leaf imports nothing from mixprec).

    Raises:
        ValueError: a DDP-wrapped model (prepare the plain model, then ``mixprec.distributed.wrap_ddp``);
            an FSDP2 model under a policy FSDP2 cannot represent, with ``grad_accumulation="compute"``,
            or whose ``MixedPrecisionPolicy`` computes in another dtype than ``policy`` (each
            message names the module and both dtypes).
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "prepare() got a DistributedDataParallel model. DDP builds its gradient buckets for the dtypes it sees, and "
            "prepare() may change them; prepare the plain model, then wrap it: model, opt = prec.prepare(model, opt); "
            "ddp = mixprec.distributed.wrap_ddp(prec, model)."
        )
    if not is_fsdp2(model):
        return False
    from torch.distributed.fsdp import FSDPModule

    name = policy.label
    check_fsdp_policy(policy)
    _check_not_started(model, policy)
    half = _fsdp_half_params(policy)
    remainders = fsdp_remainders(policy)
    if policy.has_masters and not remainders and grad_accumulation != "fp32":
        raise ValueError(
            f"grad_accumulation={grad_accumulation!r} with FSDP2: FSDP2 accumulates gradients in its FP32 sharded "
            "parameters' dtype, so compute-dtype accumulation is not available; use the default 'fp32'."
        )
    if remainders and grad_accumulation != "compute":
        raise ValueError(
            f"policy {name!r} under FSDP2 needs grad_accumulation='compute' (got {grad_accumulation!r}): its shards are "
            "BF16, so FSDP2 reduces and accumulates BF16 gradients, and the FP32 master gradients exist only inside the "
            "step. Pass MixedPrecision(..., grad_accumulation='compute'), or use 'bf16-master' (FP32 shards and gradients)."
        )
    separate = policy.has_masters or half  # islands must be FSDP groups of their own (FP32 next to half)
    islands = {id(m) for _, m in island_modules(model, policy)} if separate else set()
    named = dict(model.named_modules())
    want = policy.compute_dtype if policy.has_masters and not remainders else None
    # Half parameters without masters: the shards are cast to the param dtype, so FSDP2 gathers them
    # as they are; param_dtype=None or the param dtype itself (FSDP2 then casts nothing) both fit.
    for qname, mod in named.items():
        if not isinstance(mod, FSDPModule):
            continue
        known, pdt = fsdp_param_dtype(mod)
        if not known:
            continue
        pdt = None if pdt == torch.float32 else pdt
        expect = None if id(mod) in islands else want
        if half and id(mod) not in islands and pdt == policy.param_dtype:
            pdt = None
        if pdt != expect:
            if expect is not None:
                need = str(expect)
            elif half and id(mod) not in islands:
                need = f"its {policy.param_dtype} shards as they are (param_dtype=None)"
            else:
                need = "FP32 (autocast computes in " + str(policy.compute_dtype) + ")"
            raise ValueError(
                f"FSDP2 module {qname or '<root>'!r} gathers parameters in {pdt or 'their shards dtype'} but policy "
                f"{name!r} needs {need} there; "
                "shard with mixprec.distributed.fully_shard(model, policy) or "
                "mp_policy=mixprec.distributed.fsdp_mixed_precision(policy)."
            )
    if separate:
        # An island whose parameters sit in a half-precision FSDP group would compute in half.
        for qname, mod in island_modules(model, policy):
            if isinstance(mod, FSDPModule) or not any(True for _ in mod.parameters(recurse=False)):
                continue
            parts = qname.split(".") if qname else []
            for k in range(len(parts) - 1, -1, -1):
                owner = named.get(".".join(parts[:k]))
                if isinstance(owner, FSDPModule):
                    raise ValueError(
                        f"FP32 island {qname!r} is not sharded on its own, so FSDP2 would gather its parameters in "
                        f"{policy.compute_dtype} with its parent (and FSDP2 needs one parameter dtype per group); shard it first (mixprec.distributed.fully_shard does) "
                        "or drop it from the policy's fp32_islands."
                    )
    return True



# ----- FSDP2 shards in half precision, and optimizers that agree across ranks -------------------------
def _fsdp_params(model: nn.Module) -> list[Any]:
    """Every ``FSDPParam`` (FSDP2's record of one sharded parameter) of ``model``'s FSDP2 modules (private API)."""
    from torch.distributed.fsdp import FSDPModule

    out: list[Any] = []
    seen: set[int] = set()
    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        state = mod._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # older torch: one group per state
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            if id(group) in seen:
                continue
            seen.add(id(group))
            out.extend(group.fsdp_params)
    return out


def _check_not_started(model: nn.Module, policy: Any) -> None:
    """Half shards are cast by ``prepare``: refuse an FSDP2 model that already ran a forward."""
    from torch.distributed.fsdp import FSDPModule

    if not _fsdp_half_params(policy):
        return
    # FSDP2 sizes its gather buffers at the first forward (lazy init), in the shards' dtype then; the
    # root may even keep its parameters unsharded (plain tensors) after that forward.
    started = [q for q, m in model.named_modules()
               if isinstance(m, FSDPModule) and getattr(m._get_fsdp_state(), "_is_root", None) is not None]
    if started:
        raise ValueError(
            f"the FSDP2 model already ran a forward (module {started[0] or '<root>'!r} is initialised), so FSDP2 sized "
            f"its buffers for the shards' dtype then; policy {policy.label!r} casts the shards to {policy.param_dtype}. "
            "Call prec.prepare(model, optimizer) right after fully_shard and building the optimizer, before any forward."
        )


@torch.no_grad()
def cast_fsdp_shards(
    model: nn.Module, policy: Any,
    island_modules: Callable[[nn.Module, Any], Iterable[tuple[str, nn.Module]]],
) -> int:
    """Cast the FSDP2 shards of ``model`` in place to the dtypes ``policy`` stores parameters in.

    FSDP2 keeps each parameter's local shard as a ``DTensor`` and all-gathers from a flat copy
    of it; ``param.data = ...`` would change the DTensor's dtype but not its local tensor. So
    each parameter is swapped (``torch.utils.swap_tensors``: the ``nn.Parameter`` object, which
    optimizers hold, keeps its identity) with a cast copy, and FSDP2 re-reads its shards
    (``FSDPParam.reset_sharded_param``, what FSDP2 itself does after ``module.to(dtype)``).

    Targets: FP32 islands and ``*-master``/``*-mixed``/``fp32`` parameters FP32 (FSDP2's FP32
    shards are the masters); other parameters of a half-parameter policy without masters
    (``bf16-pure``, ``bf16-true``, ``fp16-pure``) the policy's ``param_dtype``. The memory of
    the old shards is freed once nothing else holds them.

    Args:
        model: A model sharded with FSDP2 (``fully_shard``), before its first forward.
        policy: The run's :class:`mixprec.Policy`.
        island_modules: ``mixprec._casting.island_modules`` (this leaf imports nothing from mixprec).

    Returns:
        The number of parameters cast.

    Raises:
        ValueError: a half-parameter policy and the model already ran a forward (FSDP2 sized
            its gather buffers for the old dtype); nothing is changed then.
    """
    from torch.distributed.tensor import DTensor

    half = _fsdp_half_params(policy)
    _check_not_started(model, policy)
    island_ids = {id(p) for _, m in island_modules(model, policy) for p in m.parameters()}
    todo: list[tuple[Tensor, torch.dtype]] = []
    for p in model.parameters():
        if not isinstance(p, DTensor) or p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            continue
        target = policy.param_dtype if (half and id(p) not in island_ids) else torch.float32
        if p.dtype != target:
            todo.append((p, target))
    if not todo:
        return 0
    for t, target in todo:
        # The nn.Parameter object (held by the optimizer) keeps its identity; its contents become the cast DTensor.
        torch.utils.swap_tensors(t, nn.Parameter(t.detach().to(target), requires_grad=t.requires_grad))
    for fsdp_param in _fsdp_params(model):
        fsdp_param.reset_sharded_param()  # re-read (and re-pad) the local shard, as after module.to(dtype)
    return len(todo)


def global_flat_offset(t: Tensor) -> int:
    """The row-major index, in the whole tensor, of the first element a ``DTensor`` shard holds (0 otherwise).

    Args:
        t: A parameter: a plain tensor (offset 0) or a ``DTensor``.

    Returns:
        The flat offset of the local shard's first element.

    Raises:
        ValueError: a shard whose elements are not consecutive in the whole tensor (e.g.
            ``Shard(1)`` of a matrix); counter-based stochastic rounding needs consecutive ones.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(t.shape)
    local, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    diff = [i for i, (a, b) in enumerate(zip(local, shape)) if a != b]
    if diff and (any(local[i] != 1 for i in range(diff[0])) or len(diff) > 1):
        raise ValueError(
            f"a DTensor parameter of shape {shape} with placements {tuple(t.placements)} holds a local block "
            f"{tuple(local)} whose elements are not consecutive in the whole tensor; mixprec's compensated optimizers "
            "need dim-0 sharding (FSDP2's default Shard(0); drop a custom shard_placement_fn)."
        )
    flat, stride = 0, 1
    for size, off in zip(reversed(shape), reversed(tuple(offset))):
        flat += off * stride
        stride *= size
    return flat


def agree_optimizers_(optimizers: Iterable[Any], group: Any = None) -> None:
    """Make mixprec's compensated optimizers round identically on every rank (collective; once, at setup).

    Stochastic rounding draws counter-based random bits from (seed, step, buffer, each element's
    global position). This sets every rank's seed to the first rank's (a broadcast; a rank's
    default seed is its own ``torch.initial_seed()``) and tells each optimizer the global
    position of its ``DTensor`` shards (:func:`global_flat_offset`), so DDP replicas round
    identically, FSDP2 shards round like the same elements of an unsharded run, and neither
    depends on the ranks' generator states. Other optimizers are left alone. A no-op when not
    distributed.

    Args:
        optimizers: The prepared optimizers.
        group: The process group (``None``: world).

    Raises:
        ValueError: see :func:`global_flat_offset`.
    """
    opts = [o for o in optimizers if callable(getattr(o, "_set_global_offsets", None)) and hasattr(o, "seed")]
    if not opts:
        return
    for o in opts:
        offsets = {p: global_flat_offset(p) for g in o.param_groups for p in g["params"]}
        o._set_global_offsets({p: off for p, off in offsets.items() if off})
    if not is_distributed(group):
        return
    dist = torch.distributed
    seeds: list[Any] = [[int(o.seed) for o in opts]]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(seeds, src=src, group=group)
    for o, seed in zip(opts, seeds[0]):
        if int(seed) != int(o.seed):
            o.seed = int(seed)
            for cache in ("_key_cache", "_fused_fns"):  # keyed by the seed's stream keys
                c = getattr(o, cache, None)
                if c is not None:
                    c.clear()
