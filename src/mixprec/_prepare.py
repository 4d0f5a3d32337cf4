"""Prepare-time work of ``MixedPrecision.prepare``: validate the model and optimizers, then wrap them.

Everything here runs once, before training: checks that raise before anything is changed, and
the conversion of the user's optimizers into what the policy needs (``MasterWeightOptimizer``
for ``*-master``, ``mixprec.optim`` for compensated ``bf16-pure``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ._dtypes import check_device_support, dtype_name
from ._fused import FUSABLE
from ._master import GradAccumulation, MasterWeightOptimizer, model_params_of
from ._policy import Policy

__all__ = [
    "PrepareFacts",
    "check_disjoint",
    "check_fusable",
    "check_prepare",
    "model_device",
    "model_params_of",
    "optimizer_tensors",
    "wrap_optimizers",
]


class PrepareFacts:
    """What :func:`check_prepare` found out about the model (used by :func:`wrap_optimizers`)."""

    def __init__(self, device: torch.device, fsdp: bool, floating: Sequence[torch.Tensor]) -> None:
        self.device = device
        self.fsdp = fsdp
        self.floating = list(floating)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for an empty model."""
    for t in model.parameters():
        return t.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def check_prepare(
    model: nn.Module, optimizers: Sequence[Optimizer], policy: Policy, grad_accumulation: GradAccumulation,
    *, keep_dtypes: bool = False,
) -> PrepareFacts:
    """Validate ``prepare(model, *optimizers)`` before anything is changed.

    ``keep_dtypes``: the model is taken with the dtypes it has (``mixprec.apex``'s models that
    Apex did not cast): half parameters are accepted under any policy, without a warning.

    Raises:
        TypeError: not an ``nn.Module``; an optimizer that is not a ``torch.optim.Optimizer`` or is
            already a ``MasterWeightOptimizer``; an optimizer a compensated policy cannot convert.
        ValueError: no optimizer; a model already prepared; tensors that are not the model's
            parameters; a parameter in two optimizers; half-precision parameters under a policy
            with FP32 parameters; uninitialised lazy parameters under a policy that casts or copies
            them; a dtype the device cannot compute in.
    """
    from ._casting import check_fp16_range, enclosing_run_model, is_prepared, island_modules, run_of
    from ._dist import check_prepare_target

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
    if enclosing_run_model(model) is not None:
        raise ValueError(
            "this model is a submodule of a model another MixedPrecision prepared (a live run); preparing it here would "
            "cast it again under this policy and break that run. Prepare the modules that train together in one "
            "prepare(), or end the other run first (mixprec.uncast_module on its model). Nothing was changed."
        )
    # (a submodule cast for inference, e.g. a frozen teacher, holds no run: it is accepted as before)
    inner = next((n for n, m in model.named_modules() if n and is_prepared(m) and run_of(m) is not None), None)
    if inner is not None:
        # its run holds its parameters (masters, hooks, dtype checks): casting them again breaks it silently
        raise ValueError(
            f"submodule {inner!r} of this model was already prepared by another MixedPrecision (a live run); preparing "
            "the whole model would cast it again under this policy and break that run. Prepare the modules that train "
            "together in one prepare() (one MixedPrecision for the whole model), or end that run first "
            f"(mixprec.uncast_module(model.{inner})). Nothing was changed."
        )
    # DDP: raises (prepare first, then mixprec.distributed.wrap_ddp). FSDP2: its FP32 shards are the masters.
    fsdp = check_prepare_target(model, policy, grad_accumulation, island_modules)
    model_params = list(model.parameters())
    by_id = {id(p): p for p in model_params}
    for i, opt in enumerate(optimizers):
        if isinstance(opt, MasterWeightOptimizer):
            raise TypeError(
                f"optimizer {i} is already a MasterWeightOptimizer; pass the plain torch optimizer and let "
                "prepare() wrap it."
            )
        if not isinstance(opt, Optimizer):
            raise TypeError(f"optimizer {i} must be a torch.optim.Optimizer, got {type(opt).__name__}")
        if _needs_closure(opt):
            raise ValueError(
                f"optimizer {i} ({type(opt).__name__}) needs a closure at every step (it re-evaluates the model inside "
                "its step, as LBFGS's line search does), which MixedPrecision's step (unscale, skip on inf/NaN, one "
                "loss-scale update per step) cannot drive. Train it on the FP32 model without prepare(), or, for half "
                "weights with FP32 masters and no loss scaling, wrap it yourself: "
                "mixprec.MasterWeightOptimizer(opt).step(closure)."
            )
        foreign = [p for g in opt.param_groups for p in g["params"] if id(p) not in by_id]
        if foreign:
            raise ValueError(
                f"optimizer {i} holds {len(foreign)} tensor(s) that are not parameters of this model (first has shape "
                f"{tuple(foreign[0].shape)}); build the optimizer from model.parameters() of the model you pass to "
                "prepare()."
            )
    check_disjoint(optimizers)
    lazy = [n for n, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy and (policy.param_dtype != torch.float32 or policy.has_masters or policy.compensation != "none"):
        raise ValueError(
            f"the model has {len(lazy)} uninitialised lazy parameter(s) (first: {lazy[0]!r}, from a Lazy* module), "
            f"which policy {policy.label!r} must cast and copy before they have a shape; run one forward pass on a "
            "sample batch first, then build the optimizer and call prepare(). Nothing was changed."
        )
    floating = [p for p in model_params if p.dtype.is_floating_point]
    # FP64 is not "half": cast_module leaves it as it is under every policy (a learned temperature kept in float64).
    half = sorted({dtype_name(p.dtype) for p in floating if p.dtype not in (torch.float32, torch.float64)})
    if half and policy.param_dtype == torch.float32 and not keep_dtypes:
        raise ValueError(
            f"the model has {'/'.join(half)} parameters but policy {policy.label!r} keeps "
            "parameters in FP32 (they are the masters); call model.float() before prepare(), or choose a policy "
            "with half-precision parameters such as 'bf16-master' or 'fp16-master'."
        )
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.dtype.is_floating_point]
    if trainable and not keep_dtypes and all(p.dtype == torch.float64 for _, p in trainable):
        # cast_module casts FP32/BF16/FP16 only: a float64 model would stay float64 under any policy, silently.
        # (One float64 parameter in an FP32 model, a learned temperature, is kept and trained as it was.)
        raise ValueError(
            f"the model's {len(trainable)} trainable parameters are all float64 (first: {trainable[0][0]!r}), which "
            f"policy {policy.label!r} would leave in float64 (it casts FP32 weights): call model.float() before "
            "prepare()."
        )
    policy.check_islands(model)
    if policy.param_dtype != torch.float32 and policy.buffers == "keep" and not keep_dtypes:
        _check_batch_norms(model, policy, island_modules)
    if policy.param_dtype == torch.float16 and not keep_dtypes:
        check_fp16_range(model, policy)
    device = model_device(model)
    check_device_support(policy.compute_dtype, device)
    if half and policy.has_masters and not keep_dtypes:
        warnings.warn(
            f"the model already has {'/'.join(half)} parameters, so its FP32 masters start from rounded values; "
            "prepare the FP32 model instead to keep the full-precision initial weights.",
            UserWarning,
            stacklevel=3,
        )
    if policy.compensation != "none":
        check_convertible(optimizers, policy)
        check_dense_gradients(model, optimizers, policy)
    elif not policy.has_masters and policy.param_dtype != torch.float32:
        warn_tiny_eps(optimizers, policy.param_dtype)
    return PrepareFacts(device, fsdp, floating)


def _check_batch_norms(model: nn.Module, policy: Policy, island_modules: Any) -> None:
    """Raise for a BatchNorm outside the FP32 islands whose running statistics would stay FP32 (``b=keep``).

    Its weight would take the half parameter dtype while its running mean and variance keep
    FP32, a mix torch's ``batch_norm`` refuses at the first forward ("expected scalar type ...").
    """
    inside = [name + "." if name else "" for name, _ in island_modules(model, policy)]  # "": the root is the island
    for name, m in model.named_modules():
        if not isinstance(m, nn.modules.batchnorm._BatchNorm) or any((name + ".").startswith(p) for p in inside):
            continue
        stats = m.running_mean
        if m.affine and stats is not None and stats.dtype == torch.float32 and m.weight.dtype.is_floating_point:
            raise ValueError(
                f"policy {policy.label!r} casts BatchNorm {name!r} ({type(m).__name__}) to "
                f"{dtype_name(policy.param_dtype)} but keeps its FP32 running statistics (b=keep), a mix torch's "
                "batch_norm refuses at the first forward. Keep norm layers in FP32 (add the island 'norm': i=norm), "
                "or cast floating buffers too (b=param)."
            )


def _needs_closure(opt: Optimizer) -> bool:
    """Whether ``type(opt).step`` takes a ``closure`` it cannot do without (no default: LBFGS)."""
    import inspect

    try:
        param = inspect.signature(type(opt).step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


def check_fusable(optimizers: Sequence[Optimizer], masters: bool) -> None:
    """Raise ``ValueError`` for an optimizer ``MixedPrecision(fused=True)`` cannot fuse.

    Covered: ``torch.optim.AdamW``, ``Adam`` and ``SGD`` (exactly those classes); without
    masters also any optimizer built with torch's own ``fused=True`` (already one kernel).
    """
    for opt in optimizers:
        if not masters and any(g.get("fused") for g in opt.param_groups):
            continue
        if type(opt) in FUSABLE and any(g.get("differentiable") for g in opt.param_groups):
            raise ValueError(
                f"MixedPrecision(fused=True): {type(opt).__name__} was built with differentiable=True, which the compiled "
                "step does not implement; build it with differentiable=False, or use fused=None or False (its own step)."
            )
        if type(opt) in FUSABLE:
            continue
        what = "master-weight step" if masters else "step"
        raise ValueError(
            f"MixedPrecision(fused=True): the fused {what} covers torch.optim.AdamW, Adam and SGD, got "
            f"{type(opt).__module__}.{type(opt).__qualname__}; use fused=None or False (its own step)."
        )


def wrap_optimizers(
    optimizers: Sequence[Optimizer],
    policy: Policy,
    grad_accumulation: GradAccumulation,
    facts: PrepareFacts,
    originals: Mapping[int, torch.Tensor],
    *,
    fused: bool | None = None,
) -> list[Optimizer]:
    """Return the optimizers the run steps: masters wrapped, compensated ones converted, others as given.

    Args:
        originals: ``id(param) -> FP32 tensor`` from before the model was cast; the masters (and
            the compensation of ``bf16-pure``) start from these exact values.
        fused: ``fused=`` of the wrappers and converted optimizers built here (``MixedPrecision(fused=...)``).
    """
    wrapped: list[Optimizer] = []
    try:
        for opt in optimizers:
            if policy.has_masters and (not facts.fsdp or policy.master_storage == "remainder"):
                initial = {p: originals[id(p)] for g in opt.param_groups for p in g["params"] if id(p) in originals}
                opt = MasterWeightOptimizer(
                    opt, master_dtype=policy.master_dtype or torch.float32,
                    grad_accumulation=grad_accumulation, initial_masters=initial,
                    fused=fused, master_storage=policy.master_storage,
                )
            elif policy.compensation != "none":
                opt = to_compensated(opt, policy, originals, fused=fused)
            wrapped.append(opt)
    except BaseException:
        from ._stepping import remove_step_guard

        for opt in wrapped:  # the wrappers already built hooked the parameters and guarded their optimizers
            if isinstance(opt, MasterWeightOptimizer):
                opt.remove_hooks()
                remove_step_guard(opt.optimizer)
        raise
    return wrapped


class Rollback:
    """What ``prepare`` changes in a model and its optimizers, held to put back if a later part raises.

    ``prepare`` promises that nothing changes when it raises; most refusals come from the checks
    before the cast, and this covers what can only fail while casting and wrapping (an optimizer
    conversion, a wrapper's own check): the parameters get their tensors back (the FP32 digits:
    references to the originals, no copies), the buffers their tensors, the model loses the
    casting hooks, and the optimizers their parameter lists and state.
    """

    def __init__(self, model: nn.Module, optimizers: Sequence[Optimizer]) -> None:
        self.model = model
        self.params = [(p, p.data) for p in model.parameters()]
        self.buffers = [(m, k, b) for m in model.modules() for k, b in m._buffers.items()]
        self.groups = [(o, [(g, list(g["params"])) for g in o.param_groups], dict(o.state)) for o in optimizers]

    def restore(self) -> None:
        """Put everything back as it was when this was built."""
        from ._casting import is_prepared, uncast_module

        with torch.no_grad():
            for p, data in self.params:
                p.data = data
        for m, k, b in self.buffers:
            m._buffers[k] = b
        if is_prepared(self.model):
            uncast_module(self.model)
        for opt, groups, state in self.groups:
            opt.param_groups[:] = [g for g, _ in groups]
            for g, params in groups:
                g["params"] = params
            opt.state.clear()
            opt.state.update(state)


def warn_host_reads(optimizers: Sequence[Optimizer], device: torch.device) -> None:
    """Warn, once per prepared optimizer, when its step on an accelerator costs a host read of ``found_inf``.

    mixprec skips inf/NaN steps on the device for torch's AdamW/Adam/SGD (foreach, for-loop and
    fused), ``mixprec.optim`` and any optimizer with ``_step_supports_amp_scaling``
    (``_stepping.host_read_reason``). Any other optimizer is stepped after one read of
    ``found_inf`` per step: a device sync on a GPU (on a CPU it costs nothing, and nothing is said).
    A ``MasterWeightOptimizer`` whose fused step can run (a wrapped torch AdamW/Adam/SGD) skips in its kernel.
    """
    from ._stepping import CPU_FUSED_SGD_HALF, cpu_fused_sgd_skips, host_read_reason

    for i, opt in enumerate(optimizers):
        if isinstance(opt, torch.optim.SGD) and any(
                g.get("fused") and any(map(cpu_fused_sgd_skips, g["params"])) for g in opt.param_groups):
            warnings.warn(
                f"optimizer {i}: SGD(fused=True) with FP16/BF16 parameters on a CPU: {CPU_FUSED_SGD_HALF}: "
                "those parameters would not train. Build it with fused=False (mixprec then steps it with its own "
                "step), or use a preset with FP32 masters.",
                UserWarning,
                stacklevel=3,
            )
    if device.type == "cpu":
        return

    for i, opt in enumerate(optimizers):
        inner = opt.optimizer if isinstance(opt, MasterWeightOptimizer) else opt
        reason = host_read_reason(inner)
        if reason is None:
            continue
        warnings.warn(
            f"optimizer {i}: {reason}, so mixprec reads found_inf on the host once per step to skip inf/NaN steps "
            f"(a device sync on {device.type}: the CPU waits for the GPU every step, and the step cannot be captured "
            "in a CUDA graph). torch.optim.AdamW, Adam and SGD, or an optimizer built with fused=True, keep the step "
            "sync-free.",
            UserWarning,
            stacklevel=3,
        )


def warn_tiny_eps(optimizers: Sequence[Optimizer], dtype: torch.dtype) -> None:
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
                stacklevel=4,
            )


def optimizer_tensors(opt: Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def check_disjoint(optimizers: Sequence[Optimizer]) -> None:
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


def check_convertible(optimizers: Sequence[Optimizer], policy: Policy) -> None:
    from . import optim as mp_optim
    from .optim._parts import _PARAM_DTYPES  # what the converted optimizers accept (their add_param_group's check)

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
                f"policy {policy.label!r} updates half-precision parameters with compensated updates, which "
                f"needs mixprec.optim.AdamW or mixprec.optim.SGD (or a torch AdamW/Adam/SGD, converted for you); got "
                f"{type(opt).__name__}. Use a master-weight policy such as 'bf16-master' for other optimizers."
            )
        else:  # converted for you: what the conversion would refuse, refused before anything is cast
            for j, g in enumerate(opt.param_groups):
                if g.get("differentiable", False):
                    raise ValueError(
                        f"optimizer {i} ({type(opt).__name__}), param group {j}, has differentiable=True; policy "
                        f"{policy.label!r} steps with mixprec.optim, which is not differentiable. Build the optimizer "
                        "with differentiable=False, or use a master-weight policy such as 'bf16-master'."
                    )
                odd = next((t for t in g["params"] if t.dtype not in _PARAM_DTYPES), None)
                if odd is not None and not (odd.is_floating_point() or odd.is_complex()):
                    raise ValueError(  # an integer/bool tensor (an index table) cannot have a gradient
                        f"optimizer {i} ({type(opt).__name__}) holds a {odd.dtype} parameter of shape "
                        f"{tuple(odd.shape)}, which never gets a gradient; policy {policy.label!r} steps every optimizer "
                        "with mixprec.optim, which takes floating parameters only. Leave it out of the optimizer "
                        "(e.g. [p for p in model.parameters() if p.is_floating_point()]) or register it as a buffer, "
                        "or use a master-weight policy such as 'bf16-master' (torch's optimizer holds it there)."
                    )
                if odd is not None:
                    raise ValueError(
                        f"optimizer {i} ({type(opt).__name__}) holds a {odd.dtype} parameter of shape {tuple(odd.shape)}; "
                        f"policy {policy.label!r} steps every optimizer with mixprec.optim, which updates real "
                        "FP16/BF16/FP32/FP64 parameters only. Use a master-weight policy such as 'bf16-master' (torch's "
                        "optimizer steps it there), or keep it real (two real parameters, torch.complex in forward)."
                    )


def check_dense_gradients(model: nn.Module, optimizers: Sequence[Optimizer], policy: Policy) -> None:
    """Raise ``ValueError`` for a module with ``sparse=True`` whose weight a compensated policy would step.

    ``mixprec.optim`` (what a compensated policy steps with, a torch SGD converted) takes dense
    gradients only; refused here, before anything is cast, rather than at the first step.
    """
    stepped = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if getattr(module, "sparse", False) is True and isinstance(weight, torch.Tensor) and id(weight) in stepped:
            raise ValueError(
                f"module {name or type(module).__name__!r} ({type(module).__name__}) has sparse=True, so its weight "
                f"gets sparse gradients; policy {policy.label!r} steps it with a mixprec.optim optimizer (compensated "
                "updates of half-precision weights), which takes dense gradients only. Build it with sparse=False, or "
                "use a master-weight policy such as 'bf16-master' (FP32 masters, your optimizer as it is)."
            )


def to_compensated(opt: Optimizer, policy: Policy, originals: Mapping[int, torch.Tensor], *,
                   fused: bool | None = None) -> Optimizer:
    from . import optim as mp_optim

    if not isinstance(opt, (mp_optim.AdamW, mp_optim.SGD)):
        opt = mp_optim.from_torch(opt, compensation=policy.compensation, fused=fused)
    elif fused is not None:
        opt.fused = fused  # a mixprec optimizer the user built: MixedPrecision(fused=...) is the later word
    # Seed the compensation with what the cast to half precision lost. A parameter whose value the
    # cast kept exactly and whose state already holds a compensation buffer (an optimizer state loaded
    # before prepare, as nanoGPT's resume does, into a model loaded from the half weights) keeps the
    # loaded buffer: it is the remainder the weights lost when they were saved, a reseed would zero it.
    # Host sync: one comparison per such parameter, at prepare only.
    seed = {}
    for g in opt.param_groups:
        for p in g["params"]:
            value = originals.get(id(p))
            if value is None:
                continue
            comp = opt.state.get(p, {}).get("kahan_comp")
            if (isinstance(comp, torch.Tensor) and comp.shape == p.shape and comp.count_nonzero() > 0
                    and torch.equal(value, value.to(p.dtype).to(value.dtype))):
                continue
            seed[p] = value
    opt.load_full_precision_params_(seed)
    return opt
