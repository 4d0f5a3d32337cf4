"""Precision policies: a frozen recipe of dtypes and loss scaling, its presets and its grammar.

A policy says which dtype the model's parameters are stored in (``p``), which dtype
the forward and backward compute in (``c``), which dtype the model hands back (``o``),
whether FP32 master weights live in the optimizer (``m``), how the loss is scaled
(``ls``), which modules stay in FP32 (``i``, the FP32 islands), whether FP32 matmuls
may use TF32 (``tf32``), how low-precision updates are compensated (``comp``) and whether
floating-point buffers follow the parameters' dtype (``b``).

The string form is ``p=f16,c=f16,o=f32,m=f32,ls=dynamic,i=norm,tf32=0,comp=none`` and
``Policy.parse(str(p)) == p`` for every policy. Missing keys cascade: ``c`` defaults to
``p``, ``o`` to ``f32``, ``m`` to none, ``ls`` to ``dynamic`` when ``c`` is f16 and
``none`` otherwise, ``i`` to ``norm``, ``tf32`` to off, ``comp`` to ``none``, ``b`` to
``keep``. ``b`` is printed only when it is not ``keep`` (``...,comp=none,b=param``), so the
strings of the presets, and of every policy saved before ``b`` existed, stay as they were.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Iterable, Iterator
from typing import Any, Literal, cast, get_args

import torch
from torch import nn

from ._dtypes import dtype_name, parse_dtype
from ._errors import unknown_choice

__all__ = [
    "ALIASES", "FP8_RECIPES", "PRESETS", "BufferCast", "Compensation", "Fp8Recipe", "LossScaleKind", "MasterStorage",
    "Policy", "PresetName",
]

LossScaleKind = Literal["none", "static", "dynamic"]
Compensation = Literal["none", "kahan", "stochastic"]
BufferCast = Literal["keep", "param"]
Fp8Recipe = Literal["none", "tensorwise", "rowwise", "rowwise_gw_hp"]
#: How FP32 masters are stored: ``"full"`` (an FP32 tensor of their own) or ``"remainder"`` (the BF16
#: weight plus an ``int16`` remainder, exact; ``m=f32:r16``, issue 29).
MasterStorage = Literal["full", "remainder"]
#: The FP8 recipes of ``f8=`` (torchao's float8 training recipes; ``rowwise_gw_hp`` is torchao's
#: ``rowwise_with_gw_hp``: the weight-gradient GEMM stays in high precision).
FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_gw_hp")
_F8_LAYER_WORDS = ("auto", "all")
PresetName = Literal[
    "fp32", "tf32", "fp16-mixed", "bf16-mixed", "fp16-master", "bf16-master", "bf16-master-r16", "bf16-pure",
    "fp16-pure", "fp8-tensorwise", "fp8-rowwise",
]

_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KEYS = ("p", "c", "o", "m", "ls", "i", "tf32", "comp", "b", "f8", "f8_layers")
_KEY_HELP = (
    "p=param dtype, c=compute dtype, o=output dtype, m=master dtype or none, "
    "m=f32:r16 (FP32 masters stored as the BF16 weight plus a 16-bit remainder, p=bf16 only), "
    "ls=none|static[:scale]|dynamic[:init_scale], i=FP32 islands joined by '+' (norm, a module "
    "class name, name:<glob on qualified module names>) or none, tf32=0|1, comp=none|kahan|stochastic, "
    "b=keep|param (floating buffers keep their dtype, or take the param dtype), "
    "f8=none|tensorwise|rowwise|rowwise_gw_hp (nn.Linear GEMMs in FP8 through torchao), "
    "f8_layers=all|auto|<glob>+<glob>|none (which linears f8= converts)"
)
# A module class counts as a normalization layer when its name ends in "Norm" (LayerNorm,
# GroupNorm, RMSNorm, LlamaRMSNorm, T5LayerNorm), "Norm1d/2d/3d" (BatchNorm2d, InstanceNorm1d) or
# "NormGated" (MambaRMSNormGated, Qwen3NextRMSNormGated), and it holds no submodule with
# parameters of its own: a block named like a norm that wraps attention (DBRX's
# DbrxNormAttentionNorm) is not one (its own norms are islands, its attention is cast).
_NORM_NAME = re.compile(r"Norm(\dd|Gated)?$")
#: The dynamic scaler's default floor and ceiling (``_scaler.DEFAULT_MIN_SCALE``/``DEFAULT_MAX_SCALE``,
#: which this module cannot import; tests/test_policy.py checks they agree): ``ls=dynamic:S`` outside
#: them widens the scaler's range to start at S (``scaler_for_policy``).
DYNAMIC_SCALE_RANGE = (1.0, float(2**24))
_CLASS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_BAD_GLOB_CHARS = set(",=+ ")


def _fmt_scale(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


@dataclasses.dataclass(frozen=True)
class Policy:
    """A precision recipe: the dtypes of parameters, compute, outputs and masters, and loss scaling.

    Build one with :meth:`parse` (a preset, an alias or the ``p=...,c=...`` grammar) or
    directly; it is immutable and hashable, and ``str()`` gives the grammar back.

    Attributes:
        param_dtype: Storage dtype of the model's parameters (``p``).
        compute_dtype: Dtype of forward/backward compute (``c``); with FP32 parameters and a
            half compute dtype, compute runs under ``torch.autocast`` ("mixed").
        output_dtype: Dtype the model's floating outputs are cast to (``o``), FP32 by default
            so losses are computed in full precision.
        master_dtype: Dtype of the master weights kept by the optimizer wrapper (``m``), or
            ``None`` when the parameters themselves are updated.
        loss_scale: ``"none"``, ``"static"`` or ``"dynamic"`` (``ls``).
        init_scale: The static scale, or the dynamic scaler's initial scale; ``None`` takes
            the scaler's default (1.0 static, 2**16 dynamic).
        fp32_islands: Modules kept in FP32 (``i``): ``"norm"`` for every normalization layer,
            a class name such as ``"Embedding"`` (matched along the class's MRO), or
            ``"name:<glob>"`` matched against qualified module names.
        tf32: Let FP32 matmuls and convolutions use TF32 on Ampere+ GPUs (no effect on CPU).
        compensation: How updates to low-precision parameters without masters are
            compensated by mixprec's optimizers: ``"none"``, ``"kahan"`` or ``"stochastic"``.
        buffers: What ``cast_module`` does with floating-point buffers outside the FP32
            islands (``b``): ``"keep"`` (the default) leaves their dtype alone, so constants
            such as a rotary embedding's ``inv_freq`` keep FP32 precision; ``"param"`` casts
            them to ``param_dtype`` with the parameters. Buffers of FP32 islands (BatchNorm's
            running statistics) are FP32 either way.
        master_storage: How the FP32 masters are kept (``m=f32`` or ``m=f32:r16``): ``"full"``, an
            FP32 tensor per parameter (4 bytes); ``"remainder"``, the BF16 weight plus an ``int16``
            remainder (2 bytes more than the weight), joined into the exact FP32 master inside each
            step and split again (ties round away from zero; ``p=bf16`` only; docs/training-loop.md,
            "Masters at 2 extra bytes").

    Raises:
        ValueError / TypeError: on an inconsistent or unknown combination; see :meth:`parse`.

    Example:
        >>> str(Policy.parse("fp16-master"))
        'p=f16,c=f16,o=f32,m=f32,ls=dynamic,i=norm,tf32=0,comp=none'
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype | None = None
    loss_scale: LossScaleKind = "none"
    init_scale: float | None = None
    fp32_islands: tuple[str, ...] = ("norm",)
    tf32: bool = False
    compensation: Compensation = "none"
    buffers: BufferCast = "keep"
    fp8: Fp8Recipe = "none"
    fp8_layers: tuple[str, ...] = ("all",)
    master_storage: MasterStorage = "full"

    def __post_init__(self) -> None:
        # Accept aliases and module classes, normalise, then validate as one unit so the
        # error can name the combination.
        set_ = object.__setattr__
        set_(self, "param_dtype", parse_dtype(self.param_dtype))
        set_(self, "compute_dtype", parse_dtype(self.compute_dtype))
        set_(self, "output_dtype", parse_dtype(self.output_dtype))
        if self.master_dtype is not None:
            set_(self, "master_dtype", parse_dtype(self.master_dtype))
        islands = self.fp32_islands
        if isinstance(islands, (str, type)):
            islands = (islands,)
        for field, value in (("fp32_islands", islands), ("fp8_layers", self.fp8_layers)):
            if not isinstance(value, Iterable):
                raise TypeError(f"{field} must be a tuple of strings (or one string), got {value!r}; () means none.")
        set_(self, "fp32_islands", tuple(i.__name__ if isinstance(i, type) else i for i in islands))
        if isinstance(self.fp8_layers, str):
            set_(self, "fp8_layers", (self.fp8_layers,))
        set_(self, "fp8_layers", tuple(self.fp8_layers))
        if self.init_scale is not None:
            if isinstance(self.init_scale, bool) or not isinstance(self.init_scale, (int, float)):
                raise TypeError(f"init_scale must be a number, got {self.init_scale!r}")
            set_(self, "init_scale", float(self.init_scale))
        self._validate()

    def _validate(self) -> None:
        p, c, o, m = self.param_dtype, self.compute_dtype, self.output_dtype, self.master_dtype
        # (types first: the policy's string, quoted in every message below, joins these entries)
        for field, entries, what in (("fp32_islands", self.fp32_islands, "FP32 islands are strings or module classes"),
                                     ("fp8_layers", self.fp8_layers, "f8_layers entries are strings")):
            if not isinstance(entries, tuple):
                raise TypeError(f"{field} must be a tuple of strings, got {entries!r}")
            for entry in entries:
                if not isinstance(entry, str):
                    raise TypeError(f"{what}, got {entry!r} in {field}={entries!r}")
        where = f"in policy {self._grammar()!r}"
        for key, dt in (("p", p), ("c", c), ("o", o)):
            if dt not in _COMPUTE_DTYPES:
                raise ValueError(f"{key}={dtype_name(dt)} is not supported {where}; use f32, bf16 or f16.")
        if p != torch.float32 and c != p:
            raise ValueError(
                f"half-precision parameters compute in their own dtype, but p={dtype_name(p)} and "
                f"c={dtype_name(c)} {where}; set c={dtype_name(p)}, or keep p=f32 for autocast-style mixed precision."
            )
        if m is not None:
            if m != torch.float32:
                raise ValueError(f"m={dtype_name(m)} {where}: master weights are FP32; use m=f32 or m=none.")
            if p == torch.float32:
                raise ValueError(
                    f"m=f32 with p=f32 {where}: FP32 parameters already are the masters; drop m= or store "
                    "parameters in half precision (p=f16 or p=bf16)."
                )
        if self.master_storage not in get_args(MasterStorage):
            raise unknown_choice("master storage", self.master_storage, get_args(MasterStorage))
        if self.master_storage == "remainder" and (m is None or p != torch.bfloat16):
            raise ValueError(
                f"m=f32:r16 {where}: remainder-stored masters are the BF16 weight plus 16 bits, so they need p=bf16 and "
                "FP32 masters; use 'bf16-master-r16', or m=f32 (a full FP32 master) with other parameter dtypes."
            )
        if self.loss_scale not in get_args(LossScaleKind):
            raise unknown_choice("loss scaling", self.loss_scale, get_args(LossScaleKind))
        if self.init_scale is not None:
            if self.loss_scale == "none":
                raise ValueError(f"init_scale={self.init_scale} given but loss scaling is off {where}; use ls=static:S or ls=dynamic:S.")
            if not (self.init_scale > 0 and self.init_scale < float("inf")):
                raise ValueError(f"loss scale must be a positive finite number, got {self.init_scale} {where}.")
        if self.compensation not in get_args(Compensation):
            raise unknown_choice("update compensation", self.compensation, get_args(Compensation))
        if self.compensation != "none" and (p == torch.float32 or m is not None):
            raise ValueError(
                f"comp={self.compensation} {where}: compensated updates are for half-precision parameters "
                "without master weights (p=bf16 or p=f16, m=none)."
            )
        if self.buffers not in get_args(BufferCast):
            raise unknown_choice(
                "buffer cast", self.buffers, get_args(BufferCast),
                f"b=keep leaves floating buffers in their dtype, b=param casts them to the param dtype ({where}).",
            )
        if not isinstance(self.tf32, bool):
            raise TypeError(f"tf32 must be a bool, got {self.tf32!r}")
        for island in self.fp32_islands:
            if not isinstance(island, str):
                raise TypeError(f"FP32 islands are strings or module classes, got {island!r}")
            if island.lower() == "none":
                raise ValueError(f"FP32 island {island!r} {where}: 'none' means no islands (fp32_islands=()), it is "
                                 "not an entry; pass an empty tuple, or the module class or name:<glob> you meant.")
            if island == "norm" or _CLASS_NAME.match(island):
                continue
            if island.startswith("name:") and len(island) > 5 and not (_BAD_GLOB_CHARS & set(island[5:])):
                continue
            raise ValueError(
                f"FP32 island {island!r} is not understood {where}; use 'norm', a module class name such as "
                "'Embedding', or 'name:<glob>' such as 'name:*.lm_head' (no commas, '+', '=' or spaces)."
            )
        if len(set(self.fp32_islands)) != len(self.fp32_islands):
            raise ValueError(f"FP32 islands repeat an entry: {self.fp32_islands} {where}.")
        self._validate_fp8(where)

    def _validate_fp8(self, where: str) -> None:
        if self.fp8 != "none" and self.fp8 not in FP8_RECIPES:
            raise unknown_choice("FP8 recipe (f8=)", self.fp8, ("none", *FP8_RECIPES))
        layers = self.fp8_layers
        for entry in layers:
            if not isinstance(entry, str) or not entry or (_BAD_GLOB_CHARS & set(entry)) or entry.lower() == "none":
                raise ValueError(
                    f"f8_layers entry {entry!r} is not understood {where}; use 'all', 'auto' or globs on qualified "
                    "module names joined by '+' (e.g. 'f8_layers=blocks.*.mlp.*'), no commas, '=' or spaces; "
                    "an empty tuple (f8_layers=none) converts no layer."
                )
        words = [e for e in layers if e in _F8_LAYER_WORDS]
        if words and len(layers) > 1:
            raise ValueError(f"f8_layers={'+'.join(layers)} {where}: '{words[0]}' stands alone; give it or globs, not both.")
        if len(set(layers)) != len(layers):
            raise ValueError(f"f8_layers repeats an entry: {layers} {where}.")
        if self.fp8 == "none":
            if layers != ("all",):
                raise ValueError(f"f8_layers={'+'.join(layers) or 'none'} {where} but FP8 is off; add f8=tensorwise (or rowwise).")
        elif self.compute_dtype != torch.bfloat16:
            raise ValueError(
                f"f8={self.fp8} {where} needs c=bf16: the GEMMs outside FP8 and torchao's high-precision side run in "
                f"BF16; got c={dtype_name(self.compute_dtype)}. Use 'fp8-{self.fp8.split('_')[0]}' or add c=bf16."
            )

    # ----- derived properties -------------------------------------------------------------
    @property
    def uses_autocast(self) -> bool:
        """Compute runs under ``torch.autocast`` (any half compute dtype)."""
        return self.compute_dtype != torch.float32

    @property
    def is_mixed(self) -> bool:
        """FP32 parameters with half compute: the parameters are the masters (torch.amp O1)."""
        return self.param_dtype == torch.float32 and self.compute_dtype != torch.float32

    @property
    def has_masters(self) -> bool:
        """Half-precision parameters with FP32 master weights in the optimizer (Apex O2)."""
        return self.master_dtype is not None

    @property
    def name(self) -> str | None:
        """The preset this policy equals, or ``None``."""
        for preset, policy in PRESETS.items():
            if policy == self:
                return preset
        return None

    @property
    def label(self) -> str:
        """How messages name this policy: its preset name, otherwise its full string form."""
        return self.name or str(self)

    def replace(self, **changes: Any) -> Policy:
        """Return a copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ----- FP32 islands ------------------------------------------------------------------
    def is_fp32_island(self, module: nn.Module, qualified_name: str = "") -> bool:
        """Say whether ``module`` (at ``qualified_name`` in its model) is an FP32 island.

        Example:
            >>> Policy.parse("bf16-master").is_fp32_island(torch.nn.LayerNorm(4))
            True
        """
        mro_names = set(_class_names(module))
        for island in self.fp32_islands:
            if island == "norm":
                if _is_norm_layer(module):
                    return True
            elif island.startswith("name:"):
                if fnmatch.fnmatchcase(qualified_name, island[5:]):
                    return True
            elif island in mro_names:
                return True
        return False

    def check_islands(self, model: nn.Module) -> None:
        """Raise ``ValueError`` for an FP32 island entry that matches no module of ``model``.

        A misspelt class name or glob would otherwise leave the layers it meant in half precision
        without a word. ``"norm"`` (the default, for every normalization layer) may match none: a
        model without normalization layers is fine. A ``torch.compile``d model is checked by its
        original module (the names ``prepare`` casts).

        Raises:
            ValueError: the entry, the policy, and the model's module classes to choose from.
        """
        entries = [i for i in self.fp32_islands if i != "norm"]
        if not entries:
            return
        model = getattr(model, "_orig_mod", model)
        modules = list(model.named_modules(remove_duplicate=False))  # a shared module under each of its names
        mro_names = {n for _, m in modules for n in _class_names(m)}
        for island in entries:
            if island.startswith("name:"):
                hit = any(fnmatch.fnmatchcase(qn, island[5:]) for qn, _ in modules)
            else:
                hit = island in mro_names
            if not hit:
                classes = sorted({_class_names(m)[0] for _, m in modules})
                names = [qn for qn, _ in modules if qn][:6]
                raise ValueError(
                    f"FP32 island {island!r} of policy {self.label!r} matches no module of the model, so nothing would "
                    f"stay in FP32 for it; the model's module classes: {', '.join(classes[:20])}"
                    f"{', ...' if len(classes) > 20 else ''}; its module names start {names}. Use 'norm' (every "
                    "normalization layer), one of those class names, or 'name:<glob>' on the module names "
                    "(e.g. 'name:*lm_head')."
                )
        self._check_bypassed_islands(modules)

    def _check_bypassed_islands(self, modules: list[tuple[str, nn.Module]]) -> None:
        """Raise ``ValueError`` for an island whose ``forward`` its parent never calls.

        ``nn.MultiheadAttention`` reads ``out_proj.weight`` and ``.bias`` itself (torch's
        ``F.multi_head_attention_forward``): an island on ``out_proj`` alone would keep its weight in
        FP32 and still compute the projection in the compute dtype (and, outside autocast, meet
        half activations with an FP32 weight). The attention module itself can be the island.
        """
        for name, module in modules:
            if not isinstance(module, nn.MultiheadAttention) or self.is_fp32_island(module, name):
                continue
            proj = module.out_proj
            proj_names = [qn for qn, m in modules if m is proj]
            if any(self.is_fp32_island(proj, qn) for qn in proj_names) and not any(
                self.is_fp32_island(m, qn) for qn, m in modules if m is not proj and any(
                    sub is module for sub in m.modules())):
                where = proj_names[0] if proj_names else f"{name}.out_proj"
                raise ValueError(
                    f"FP32 island entries {'+'.join(i for i in self.fp32_islands if i != 'norm')!r} of policy "
                    f"{self.label!r} match {where!r}, the output projection of a MultiheadAttention, which torch's "
                    "attention computes from its weight directly, without calling its forward: it would run in the "
                    f"compute dtype, not FP32. Make the attention module the island ('name:{name or '*'}' or "
                    "'MultiheadAttention'), or leave its out_proj out of the island entries."
                )

    # ----- string form --------------------------------------------------------------------
    def _grammar(self) -> str:
        ls = self.loss_scale if self.init_scale is None else f"{self.loss_scale}:{_fmt_scale(self.init_scale)}"
        islands = "+".join(self.fp32_islands) if self.fp32_islands else "none"
        master = "none" if self.master_dtype is None else dtype_name(self.master_dtype)
        if self.master_storage == "remainder":
            master += ":r16"  # only then, so every string written before the storage mode existed reads the same
        # b= only when it is not the default, so the strings written before it existed still read the same.
        buffers = "" if self.buffers == "keep" else f",b={self.buffers}"
        # f8= only when FP8 is on, for the same reason.
        fp8 = "" if self.fp8 == "none" else f",f8={self.fp8},f8_layers={'+'.join(self.fp8_layers) or 'none'}"
        return (
            f"p={dtype_name(self.param_dtype)},c={dtype_name(self.compute_dtype)},o={dtype_name(self.output_dtype)},"
            f"m={master},ls={ls},i={islands},tf32={int(self.tf32)},comp={self.compensation}{buffers}{fp8}"
        )

    def __str__(self) -> str:
        return self._grammar()

    def __repr__(self) -> str:
        name = self.name
        return f"Policy({str(self)!r})" if name is None else f"Policy({str(self)!r}, preset={name!r})"

    @classmethod
    def parse(cls, spec: str | Policy) -> Policy:
        """Build a policy from a preset name, an alias or the ``key=value`` grammar.

        Args:
            spec: ``"bf16-mixed"``, ``"16-mixed"``, ``"mixed_float16"``, a bare dtype name
                (``"fp16"``, ``"f16"``, ``"half"``, ``"float16"`` mean ``fp16-mixed``;
                ``"bf16"``, ``"bfloat16"`` mean ``bf16-mixed``; ``"f32"``, ``"float32"`` mean
                ``fp32``), Apex's opt levels ``"O0"``..``"O3"`` (``fp32``, ``fp16-mixed``,
                ``fp16-master``, ``fp16-pure``; ``"01"`` with a zero is answered "did you mean 'O1'?"),
                or ``"p=f32,c=f16,o=f32,ls=dynamic"``; a :class:`Policy` is returned as is.

        Returns:
            The policy.

        Raises:
            TypeError: ``spec`` is not a string or a Policy.
            ValueError: an unknown name (the message lists the presets and the closest
                match), an unknown key, a repeated key, or an inconsistent combination.

        Example:
            >>> Policy.parse("p=f32,c=bf16") == Policy.parse("bf16-mixed")
            True
        """
        if isinstance(spec, Policy):
            return spec
        if not isinstance(spec, str):
            raise TypeError(f"a policy is a preset name or a 'p=...,c=...' string, got {type(spec).__name__} {spec!r}")
        text = spec.strip()
        key = text.lower()
        if key in PRESETS:
            return PRESETS[key]
        if key in ALIASES:
            return PRESETS[ALIASES[key]] if ALIASES[key] in PRESETS else cls._parse_grammar(ALIASES[key], spec)
        if key in _ZERO_TYPOS:
            raise ValueError(
                f"unknown precision preset {spec!r}; did you mean {_ZERO_TYPOS[key]!r}? Apex's opt levels start with the "
                "letter O, not the digit zero (O0=fp32, O1=fp16-mixed, O2=fp16-master, O3=fp16-pure)."
            )
        if "=" not in text:
            raise unknown_choice(
                "precision preset", spec, [*PRESETS, *ALIASES],
                f"Or spell a policy out: {_KEY_HELP}.",
            )
        return cls._parse_grammar(text, spec)

    @classmethod
    def _parse_grammar(cls, text: str, original: str) -> Policy:
        fields: dict[str, str] = {}
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise ValueError(f"policy {original!r}: {part!r} is not key=value; keys are {_KEY_HELP}.")
            k, v = (s.strip() for s in part.split("=", 1))
            k = k.lower()
            if k not in _KEYS:
                raise unknown_choice(f"policy key in {original!r}:", k, _KEYS, f"Keys: {_KEY_HELP}.")
            if k in fields:
                raise ValueError(f"policy {original!r} sets {k}= twice; give each key once.")
            fields[k] = v
        try:
            p = parse_dtype(fields.get("p", "f32"))
            c = parse_dtype(fields["c"]) if "c" in fields else p
            o = parse_dtype(fields.get("o", "f32"))
            m_txt, _, storage_txt = fields.get("m", "none").partition(":")
            m = None if m_txt.lower() in ("none", "-", "") else parse_dtype(m_txt)
        except ValueError as e:
            raise ValueError(f"policy {original!r}: {e}") from None
        ls_txt = fields.get("ls", "dynamic" if c == torch.float16 else "none").lower()
        ls_kind, _, scale_txt = ls_txt.partition(":")
        init_scale: float | None = None
        if scale_txt:
            try:
                init_scale = float(scale_txt)
            except ValueError:
                raise ValueError(f"policy {original!r}: loss scale {scale_txt!r} is not a number (e.g. ls=static:128).") from None
        i_txt = fields.get("i", "norm")
        islands = () if i_txt.lower() in ("none", "") else tuple(s for s in i_txt.split("+") if s)
        f8_txt = fields.get("f8_layers", "all")
        f8_layers = () if f8_txt.lower() in ("none", "") else tuple(s for s in f8_txt.split("+") if s)
        storage_txt = storage_txt.strip().lower()
        if storage_txt not in ("", "r16"):
            raise ValueError(
                f"policy {original!r}: m=...:{storage_txt} is not a master storage; use m=f32 (full FP32 masters) or "
                "m=f32:r16 (the BF16 weight plus a 16-bit remainder)."
            )
        tf32_txt = fields.get("tf32", "0").lower()
        if tf32_txt not in ("0", "1", "true", "false", "on", "off"):
            raise ValueError(f"policy {original!r}: tf32={tf32_txt!r}; use tf32=0 or tf32=1.")
        return cls(
            param_dtype=p, compute_dtype=c, output_dtype=o, master_dtype=m,
            loss_scale=cast(LossScaleKind, ls_kind),  # the three strings are checked in _validate
            init_scale=init_scale, fp32_islands=islands, tf32=tf32_txt in ("1", "true", "on"),
            compensation=cast(Compensation, fields.get("comp", "none").lower()),
            buffers=cast(BufferCast, fields.get("b", "keep").lower()),
            fp8=cast(Fp8Recipe, fields.get("f8", "none").lower()), fp8_layers=f8_layers,
            master_storage="remainder" if storage_txt == "r16" else "full",
        )


_f32, _bf16, _f16 = torch.float32, torch.bfloat16, torch.float16

#: The presets, by name (the table in README.md, "Presets").
PRESETS: dict[str, Policy] = {
    "fp32": Policy(_f32, _f32, _f32),
    "tf32": Policy(_f32, _f32, _f32, tf32=True),
    "fp16-mixed": Policy(_f32, _f16, _f32, loss_scale="dynamic"),
    "bf16-mixed": Policy(_f32, _bf16, _f32),
    "fp16-master": Policy(_f16, _f16, _f32, master_dtype=_f32, loss_scale="dynamic"),
    "bf16-master": Policy(_bf16, _bf16, _f32, master_dtype=_f32),
    # bf16-master with each FP32 master stored as the BF16 weight plus an int16 remainder (14 B/param with AdamW).
    "bf16-master-r16": Policy(_bf16, _bf16, _f32, master_dtype=_f32, master_storage="remainder"),
    "bf16-pure": Policy(_bf16, _bf16, _f32, compensation="kahan"),
    "fp16-pure": Policy(_f16, _f16, _f32, loss_scale="static", init_scale=1.0),
    # bf16-mixed with every eligible nn.Linear in FP8 through torchao (docs/fp8.md).
    "fp8-tensorwise": Policy(_f32, _bf16, _f32, fp8="tensorwise"),
    "fp8-rowwise": Policy(_f32, _bf16, _f32, fp8="rowwise"),
}

#: Spellings other libraries use, mapped to a preset name or a grammar string.
ALIASES: dict[str, str] = {
    # Lightning's precision flags.
    "32-true": "fp32", "32": "fp32", "16-mixed": "fp16-mixed", "16": "fp16-mixed", "bf16": "bf16-mixed",
    # Lightning's "-true" flags keep half parameters and a plain optimizer: no masters, no
    # compensation. We keep exactly that meaning rather than silently adding Kahan summation.
    "bf16-true": "p=bf16,c=bf16,o=f32,ls=none,comp=none",
    "16-true": "fp16-pure",
    # Keras mixed-precision policy names.
    "mixed_float16": "fp16-mixed", "mixed_bfloat16": "bf16-mixed", "float32": "fp32",
    # A bare dtype name means the safe autocast recipe of that dtype, as Lightning reads "bf16"
    # and "16": FP32 parameters, half compute (dynamic loss scaling for f16). Without these,
    # "fp16" was answered with "Did you mean 'bf16'?" and "f32" with "'tf32'?", other precisions.
    # (Keras's own "float16"/"bfloat16" policies are pure half; spell those fp16-pure / bf16-pure.)
    "fp16": "fp16-mixed", "f16": "fp16-mixed", "half": "fp16-mixed", "float16": "fp16-mixed",
    "bfloat16": "bf16-mixed", "f32": "fp32",
    # Apex amp's opt levels (mixprec.apex): O0 FP32, O1 autocast, O2 FP16 model + FP32 masters, O3 pure FP16.
    "o0": "fp32", "o1": "fp16-mixed", "o2": "fp16-master", "o3": "fp16-pure",
}

#: Apex opt levels typed with the digit zero instead of the letter O.
_ZERO_TYPOS = {"00": "O0", "01": "O1", "02": "O2", "03": "O3"}


def _has_parametrised_child(module: nn.Module) -> bool:
    """Whether a child of ``module`` that is not itself a norm holds parameters (a block, not a normalization layer).

    Not counted: a child norm (a norm wrapping a norm), and ``torch.nn.utils.parametrize``'s
    ``parametrizations`` container (the parametrized norm's own weight lives there).
    """
    for name, child in module.named_children():
        if name == "parametrizations" or _is_norm_layer(child):
            continue
        if any(True for _ in child.parameters()):
            return True
    return False


def find_islands(model: nn.Module, policy: Policy) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(qualified_name, module)`` for every FP32 island of ``model`` under ``policy``.

    Submodules of an island are part of it and are not yielded separately. A module registered under
    several names (shared between two parents) is an island when any of its names matches, and is
    yielded once, under its first name.
    """
    names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    inside: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if any(policy.is_fp32_island(module, n) for n in names[id(module)]):
            inside.update(map(id, module.modules()))
            yield name, module


def _class_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s classes (its MRO); for a TorchScript module, the scripted class's name first
    (``torch.jit.script(nn.LayerNorm(8))`` is a ``RecursiveScriptModule`` whose ``original_name`` is ``LayerNorm``)."""
    names = [c.__name__ for c in type(module).__mro__]
    original = getattr(module, "original_name", None) if isinstance(module, torch.jit.ScriptModule) else None
    return [original, *names] if isinstance(original, str) else names


#: Layers that compute with a weight rather than normalise: a subclass named like a norm (Tacotron's
#: ``LinearNorm(nn.Linear)``, ``ConvNorm(nn.Conv1d)``: a layer with a normalised initialisation) is not one.
_WEIGHT_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd, nn.Embedding, nn.EmbeddingBag, nn.RNNBase, nn.MultiheadAttention,
)


def _is_norm_layer(module: nn.Module) -> bool:
    """A normalization layer: named like one, no linear/conv/embedding/recurrent/attention layer (however named),
    with no parametrised child but norms of its own (recursive)."""
    return (any(_NORM_NAME.search(n) for n in _class_names(module)) and not isinstance(module, _WEIGHT_LAYERS)
            and not _has_parametrised_child(module))

