"""FP8 linears through torchao: which ``nn.Linear`` an ``f8=`` policy converts, the conversion, FP8 on/off.

A policy with ``f8=tensorwise|rowwise|rowwise_gw_hp`` (the presets ``fp8-tensorwise`` and
``fp8-rowwise``) keeps everything ``bf16-mixed`` does (FP32 parameters, BF16 autocast, FP32
islands) and, at ``prepare``, replaces the chosen ``nn.Linear`` modules by a subclass of
torchao's ``Float8Linear`` (dynamic scaling; torchao's recipe of the same name). The
subclass shares the original ``weight``/``bias`` parameters (the optimizer keeps them), so
the state dict stays the plain FP32 ``weight``/``bias`` of ``nn.Linear``.

Which linears (``f8_layers``):

* eligible: an ``nn.Linear`` (or subclass), or a Hugging Face ``Conv1D`` (GPT-2's linears, a
  linear with the weight stored transposed, ``(in, out)``), outside the FP32 islands whose in
  and out features are multiples of 16 (the FP8 GEMM's requirement on GPUs; applied on the
  CPU too so a CPU run predicts the GPU's numerics). A converted ``Conv1D`` keeps its
  ``(in, out)`` weight, so its state dict still loads into ``Conv1D``;
* ``all`` (the presets): every eligible linear (the others stay BF16; :func:`mixprec.numerics.fp8_plan` lists each with the reason);
* ``<glob>+<glob>``: the eligible linears whose qualified names match; a glob that matches no
  linear, or an ineligible one, raises;
* ``auto``: measured by :func:`mixprec.numerics.fp8_plan` on ``prepare``'s ``check_batch``
  and ``loss_fn`` (required).

Where no FP8 GEMM exists (CPU, GPUs before compute capability 8.9) torchao runs in its
``emulate`` mode: the operands are scaled and rounded to FP8 exactly as on the GPU and the
GEMM runs in high precision: the numerics of FP8, not its speed.

torchao is an optional dependency (``pip install 'mixprec[fp8]'``), imported on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import logging
import typing
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._policy import Policy, find_islands

__all__ = [
    "INSTALL_HINT",
    "TORCHAO_RECIPES",
    "convert_for_policy",
    "convert_linears",
    "eligible_reason",
    "fp8_disabled",
    "fp8_emulated",
    "fp8_modules",
    "fp8_row_label",
    "fp8_summary",
    "import_float8",
    "is_fp8_linear",
    "is_linear",
    "linear_dims",
    "linear_weight",
    "revert_linears",
]

INSTALL_HINT = "pip install 'mixprec[fp8]'"
#: mixprec's recipe name -> torchao's ``Float8LinearRecipeName`` value.
TORCHAO_RECIPES = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}
#: The attribute each converted module carries with the reason it is in FP8.
_PLAN_ATTR = "_mixprec_fp8_plan"
#: The attribute each converted module keeps its original module in (sharing the parameters).
_ORIGINAL_ATTR = "_mixprec_original"


def import_float8() -> Any:
    """Import ``torchao.float8`` (quietly: its optional CUDA extensions log warnings on a CPU).

    Raises:
        ImportError: torchao is not installed; the message gives the install command.
    """
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in quiet]
    try:
        for lg in quiet:
            lg.setLevel(logging.ERROR)
        import torchao.float8 as float8
        import torchao.float8.float8_linear  # noqa: F401  (Float8Linear, as float8.float8_linear)
    except ImportError as e:
        raise ImportError(
            f"FP8 policies (f8=..., fp8-tensorwise, fp8-rowwise) run on torchao, which is not installed ({e}); "
            f"install it with: {INSTALL_HINT}"
        ) from None
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
    return float8


def fp8_emulated(device: torch.device | str) -> bool:
    """Whether FP8 GEMMs on ``device`` are emulated: everywhere but CUDA GPUs of compute capability 8.9+.

    Host sync: none (reads device properties).
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability(device) < (8, 9)


def fp8_summary(
    model: nn.Module, policy: Policy | None
) -> tuple[str, str, typing.Literal["ok", "note"], str] | None:
    """For :func:`mixprec.numerics.audit`: ``(detail, dtype, status, note)`` of the FP8 GEMMs, or ``None`` without FP8.

    ``status`` is ``"note"`` when the policy asks for FP8 and no linear of ``model`` runs in it.
    """
    mods = fp8_modules(model)
    asked = policy is not None and policy.fp8 != "none"
    if not mods:
        if not asked:
            return None
        return ("FP8 GEMMs (torchao)", "-", "note",
                f"f8={policy.fp8 if policy else ''} but no linear runs in FP8 (none eligible, or the model was not prepared)")
    recipes = sorted({str(getattr(m, "mixprec_recipe", "")) for _, m in mods})
    dtypes = {"tensorwise": "f8e4m3/f8e5m2", "rowwise": "f8e4m3", "rowwise_gw_hp": "f8e4m3 (grad_weight bf16)"}
    n_lin = sum(1 for _, m in model.named_modules() if is_linear(m))
    dev = next((p.device for _, m in mods for p in m.parameters()), torch.device("cpu"))
    emu = "; emulated (numerics only, no FP8 GEMM on this device)" if fp8_emulated(dev) else ""
    return (f"FP8 GEMMs (torchao {'/'.join(recipes)})", " | ".join(dtypes.get(r, r) for r in recipes), "ok",
            f"{len(mods)} of {n_lin} linears; the rest in the compute dtype{emu}")


def fp8_row_label(policy: Policy, device: torch.device | str) -> str:
    """The suffix benchmark rows of an FP8 policy carry: ``" (FP8 emulated)"`` where FP8 GEMMs are emulated, else ``""``."""
    return " (FP8 emulated)" if policy.fp8 != "none" and fp8_emulated(device) else ""


def _torchao_config(recipe: str, emulate: bool) -> Any:
    float8 = import_float8()
    config = float8.Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[recipe])
    return dataclasses.replace(config, emulate=emulate)


@functools.cache
def _linear_class() -> Any:
    """The ``Float8Linear`` subclass mixprec converts to (built on first use, so torchao stays optional)."""
    float8 = import_float8()

    class MixprecFloat8Linear(float8.float8_linear.Float8Linear):  # type: ignore[name-defined]
        """torchao's ``Float8Linear`` with an FP8 switch and autocast on every device type.

        torchao casts the input to the autocast dtype only under CUDA autocast; on a CPU the
        input is cast here, so BF16 is the high precision on every device (torchao's
        ``rowwise_with_gw_hp`` otherwise multiplies an FP32 input by a BF16 gradient).
        """

        mixprec_fp8_enabled: bool = True
        mixprec_recipe: str = ""
        #: The weight is stored ``(in, out)`` (a converted Hugging Face ``Conv1D``).
        mixprec_transposed: bool = False

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if not self.mixprec_fp8_enabled:  # plain path: autocast decides, as nn.Linear
                return F.linear(input, self.weight.t() if self.mixprec_transposed else self.weight, self.bias)
            dev = input.device.type
            if dev != "cuda" and torch.is_autocast_enabled(dev):
                input = input.to(torch.get_autocast_dtype(dev))
                with torch.autocast(dev, enabled=False):
                    return self._fp8_forward(input)
            if dev == "cuda" and torch.is_autocast_enabled(dev):
                input = input.to(torch.get_autocast_dtype(dev))
            return self._fp8_forward(input)

        def _fp8_forward(self, input: torch.Tensor) -> torch.Tensor:
            if not self.mixprec_transposed:
                return super().forward(input)
            # torchao's Float8Linear.forward with the (in, out) weight as its weight.t() operand.
            out = float8.float8_linear.matmul_with_hp_or_float8_args.apply(
                input, self.weight, self.linear_mm_config, self.config
            )
            return out if self.bias is None else out + self.bias.to(out.dtype)

    MixprecFloat8Linear.__qualname__ = MixprecFloat8Linear.__name__
    return MixprecFloat8Linear


def is_fp8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a linear mixprec converted to FP8."""
    return hasattr(module, "mixprec_fp8_enabled")


def _set_fp8(module: nn.Module, on: bool) -> None:
    module.mixprec_fp8_enabled = on  # type: ignore[assignment]  # an FP8 linear's switch (a plain bool attribute)


def fp8_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every FP8 linear in ``model``, in module order."""
    return [(n, m) for n, m in model.named_modules() if is_fp8_linear(m)]


def _is_conv1d(module: nn.Module) -> bool:
    """A Hugging Face ``Conv1D`` (GPT-2, GPT): ``y = x @ weight + bias`` with ``weight`` of shape ``(in, out)``."""
    w = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D" and hasattr(module, "nf") and isinstance(w, torch.Tensor) and w.dim() == 2
    )


def is_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer FP8 can convert: ``nn.Linear`` or a Hugging Face ``Conv1D`` (or FP8 already)."""
    return isinstance(module, nn.Linear) or _is_conv1d(module) or is_fp8_linear(module)


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a linear (:func:`is_linear`): K and N of its forward GEMM."""
    w = typing.cast(torch.Tensor, module.weight)
    if _is_conv1d(module) or getattr(module, "mixprec_transposed", False):
        return int(w.shape[0]), int(w.shape[1])
    return int(w.shape[1]), int(w.shape[0])


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The weight as ``nn.Linear`` holds it, ``(out, in)`` (a transposed view for ``Conv1D``)."""
    w = typing.cast(torch.Tensor, module.weight)
    return w.t() if _is_conv1d(module) or getattr(module, "mixprec_transposed", False) else w


def island_members(model: nn.Module, policy: Policy) -> set[int]:
    """``id`` of every module inside an FP32 island of ``model`` (the islands and their submodules, shared ones under
    any of their names): what :func:`eligible_reason` keeps out of FP8."""
    return {id(m) for _, island in find_islands(model, policy) for m in island.modules()}


def eligible_reason(module: nn.Module, name: str, policy: Policy, islands: set[int] | None = None) -> str | None:
    """Why ``module`` cannot be an FP8 linear under ``policy``, or ``None`` when it can.

    ``islands``: :func:`island_members` of the model (a linear inside an island block is an island too); without
    it only ``module`` itself under ``name`` is matched against the islands.
    """
    if is_fp8_linear(module):
        return "already FP8"
    if not is_linear(module):
        return "not an nn.Linear"
    if (islands is not None and id(module) in islands) or policy.is_fp32_island(module, name):
        return "an FP32 island (i=)"
    k, n = linear_dims(module)
    if k % 16 or n % 16:
        return f"in/out features {k}x{n} not multiples of 16 (FP8 GEMM requirement)"
    return None


def _is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 (or another DTensor user) already holds ``model``'s parameters as DTensors."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if is_linear(m) and not is_fp8_linear(m) and n]


@torch.no_grad()
def convert_linears(model: nn.Module, names: dict[str, str], recipe: str, emulate: bool | None = None) -> None:
    """Replace the named ``nn.Linear`` children of ``model`` by FP8 linears (in place).

    Args:
        model: The model; its linears keep their ``weight``/``bias`` parameter objects.
        names: ``qualified name -> reason`` of the linears to convert (the reason is kept on the module).
        recipe: ``tensorwise``, ``rowwise`` or ``rowwise_gw_hp``.
        emulate: torchao's emulation; ``None`` picks it from the weights' device (:func:`fp8_emulated`).

    Raises:
        ImportError: torchao is missing (nothing is changed).
        ValueError: a name that is not a linear child of ``model`` (nothing is changed).
    """
    if recipe not in TORCHAO_RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; use one of {', '.join(TORCHAO_RECIPES)}.")
    cls = _linear_class()
    modules = dict(model.named_modules())
    targets = []
    for name in names:
        mod = modules.get(name)
        if not name or mod is None or not is_linear(mod) or is_fp8_linear(mod):
            raise ValueError(
                f"{name!r} is not an nn.Linear (or Conv1D) inside the model; FP8 converts the model's linear submodules."
            )
        parent_name, _, child = name.rpartition(".")
        targets.append((modules[parent_name], child, mod, name))
    configs: dict[bool, Any] = {}
    for parent, child, mod, name in targets:
        emu = fp8_emulated(mod.weight.device) if emulate is None else emulate
        if emu not in configs:
            configs[emu] = _torchao_config(recipe, emu)
        if isinstance(mod, nn.Linear):
            new = cls.from_float(mod, config=configs[emu])
        else:  # Conv1D: the same module, told that its weight is stored (in, out)
            k, n = linear_dims(mod)
            with torch.device("meta"):
                new = cls(k, n, bias=False, config=configs[emu])
            new.weight = mod.weight
            new.bias = mod.bias
            new.mixprec_transposed = True
        new.train(mod.training)
        object.__setattr__(new, _ORIGINAL_ATTR, mod)  # for revert_linears (not a submodule: no state dict keys)
        new.mixprec_recipe = recipe
        setattr(new, _PLAN_ATTR, names[name])
        # Forward/backward hooks the user registered on the linear stay with it.
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            getattr(new, attr).update(getattr(mod, attr))
        setattr(parent, child, new)


def convert_for_policy(
    model: nn.Module,
    policy: Policy,
    batch: Any = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    planner: Callable[..., Any] | None = None,
) -> dict[str, str]:
    """Convert the linears ``policy.fp8_layers`` chooses to FP8 (``prepare`` calls this); no-op without ``f8=``.

    Args:
        model: The FP32 model, on its training device.
        policy: The run's policy.
        batch, loss_fn: ``prepare``'s ``check_batch``/``loss_fn``; ``f8_layers=auto`` measures
            the plan on them.
        planner: :func:`mixprec.numerics.fp8_plan` (passed in: the core does not import numerics).

    Returns:
        ``{qualified name: reason}`` of the linears now in FP8 (empty when FP8 is off).

    FP8 linears already in ``model`` (converted before FSDP2 sharded it, by
    :func:`mixprec.distributed.fully_shard`) are kept; the rest is converted as the policy says.

    Raises:
        ImportError: torchao is missing. ValueError: ``f8_layers=auto`` without a batch or on a
        sharded model; a glob matching no linear, or an ineligible one; FP8 linears of another
        recipe; linears to convert in a model FSDP2 already sharded. Nothing is changed when it raises.
    """
    if policy.fp8 == "none":
        return {}
    import_float8()
    if isinstance(model, nn.Linear):
        raise ValueError(
            "FP8 policies convert the nn.Linear submodules of a model in place, but the model itself is an nn.Linear; "
            "wrap it (nn.Sequential(linear)) before prepare()."
        )
    # FP8 linears converted earlier (mixprec.distributed.fully_shard converts them before FSDP2 shards the model,
    # torchao's order) stay as they are; the recipe must be the policy's.
    existing = fp8_modules(model)
    for n, m in existing:
        if m.mixprec_recipe != policy.fp8:
            raise ValueError(
                f"{n!r} is already an FP8 linear with f8={m.mixprec_recipe}, but policy {policy.label!r} asks for "
                f"f8={policy.fp8}; use the same policy for fully_shard and MixedPrecision."
            )
    done = {n for n, _ in existing}
    islands = island_members(model, policy)
    sharded = _is_sharded(model)
    layers = policy.fp8_layers
    chosen: dict[str, str] = {}
    if layers == ("auto",):
        if batch is None or planner is None or sharded:
            where = (
                "the model is already sharded by FSDP2, and the plan measures the unsharded model: "
                if sharded else "it needs a batch: prepare(model, opt, check_batch=batch, loss_fn=loss_fn); or "
            )
            raise ValueError(
                f"policy {policy.label!r} chooses its FP8 layers by measurement (f8_layers=auto); {where}run "
                "mixprec.numerics.fp8_plan(model, batch, loss_fn, recipe) on the unsharded model and use plan.policy(...) "
                "(for fully_shard too), or give f8_layers=all / globs."
            )
        plan = planner(model, batch, loss_fn, policy.fp8, policy=policy)
        chosen = {d.name: d.reason for d in plan.layers if d.fp8 and d.name not in done}
    elif layers == ("all",):
        reasons: dict[str, str] = {}
        for name, mod in _linears(model):
            why = eligible_reason(mod, name, policy, islands)
            if why is None:
                chosen[name] = "f8_layers=all"
            else:
                reasons[name] = why
        if not chosen and not existing:
            import warnings

            first = next(iter(reasons.items()), None)
            warnings.warn(
                f"policy {policy.label!r} runs no layer in FP8: "
                + (f"none of the model's {len(reasons)} linear(s) can ({first[0]!r}: {first[1]}), "
                   if first else "the model has no nn.Linear, ")
                + "so the run is plain BF16 autocast. Choose a BF16 preset to say so, or make the linears eligible "
                "(docs/fp8.md).",
                UserWarning, stacklevel=3)
    else:
        linears = _linears(model) + existing
        for glob in layers:
            hits = [(n, m) for n, m in linears if fnmatch.fnmatchcase(n, glob)]
            if not hits:
                raise ValueError(
                    f"f8_layers glob {glob!r} of policy {policy.label!r} matches no nn.Linear of the model; linears: "
                    f"{', '.join(n for n, _ in linears[:8])}{' ...' if len(linears) > 8 else ''}."
                )
            for n, m in hits:
                if n in done:
                    continue
                why = eligible_reason(m, n, policy, islands)
                if why is not None:
                    raise ValueError(f"f8_layers glob {glob!r} selects {n!r}, which cannot run in FP8: {why}.")
                chosen[n] = f"f8_layers={glob}"
    if chosen and sharded:
        raise ValueError(
            f"policy {policy.label!r} runs {len(chosen)} linear(s) in FP8 (first {next(iter(chosen))!r}), but FSDP2 "
            "already sharded the model: FSDP2 keeps the parameters of the modules it saw, so the FP8 linears must exist "
            "before it. Shard with mixprec.distributed.fully_shard(model, policy), which converts them first."
        )
    convert_linears(model, chosen, policy.fp8)
    return chosen


@torch.no_grad()
def revert_linears(model: nn.Module) -> nn.Module:
    """Put back the original module (``nn.Linear``, ``Conv1D``) of every FP8 linear inside ``model``, with the same parameters (in place).

    For a model that leaves FP8 for good (export, a copy to compare against); to switch FP8 off
    for a while use :func:`fp8_disabled`. The root module itself is not replaced: an FP8 linear
    passed as ``model`` gets FP8 switched off instead.

    Returns:
        ``model``.
    """
    for name, mod in fp8_modules(model):
        if not name:
            _set_fp8(mod, False)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        plain = getattr(mod, _ORIGINAL_ATTR, None)
        if plain is None:
            k, n = linear_dims(mod)
            plain = nn.Linear(k, n, bias=mod.bias is not None, device="meta")
        plain.weight = mod.weight
        plain.bias = mod.bias
        plain.train(mod.training)
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            getattr(plain, attr).update(getattr(mod, attr))
        setattr(parent, child, plain)
    return model


@contextlib.contextmanager
def fp8_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model``'s FP8 linears as plain linears (BF16 under autocast) inside the block: evaluation.

    FP8 is a training speed-up; evaluate in the policy's high precision with::

        with mixprec.fp8_disabled(model), prec.autocast(), torch.no_grad():
            val_loss = loss_fn(model(x), y)

    The weights are the same FP32 parameters, so nothing is copied. Re-entrant; FP8 comes back
    on exit (also on an exception). A model without FP8 linears passes through unchanged.

    Yields:
        ``model``.
    """
    mods = [m for _, m in fp8_modules(model)]
    before = [bool(m.mixprec_fp8_enabled) for m in mods]
    for m in mods:
        _set_fp8(m, False)
    try:
        yield model
    finally:
        for m, on in zip(mods, before):
            _set_fp8(m, on)
