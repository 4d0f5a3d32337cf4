import copy
import itertools
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mixprec._casting import island_modules
from mixprec._policy import ALIASES, PRESETS, Policy

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

EXPECTED = {
    # preset: (param, compute, output, master, loss scaling, tf32, compensation)
    "fp32": (F32, F32, F32, None, "none", False, "none"),
    "tf32": (F32, F32, F32, None, "none", True, "none"),
    "fp16-mixed": (F32, F16, F32, None, "dynamic", False, "none"),
    "bf16-mixed": (F32, BF16, F32, None, "none", False, "none"),
    "fp16-master": (F16, F16, F32, F32, "dynamic", False, "none"),
    "bf16-master": (BF16, BF16, F32, F32, "none", False, "none"),
    "bf16-pure": (BF16, BF16, F32, None, "none", False, "kahan"),
    "fp16-pure": (F16, F16, F32, None, "static", False, "none"),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_presets_expand_as_documented(name):
    p = Policy.parse(name)
    got = (p.param_dtype, p.compute_dtype, p.output_dtype, p.master_dtype, p.loss_scale, p.tf32, p.compensation)
    assert got == EXPECTED[name]
    assert p.fp32_islands == ("norm",)
    assert p.name == name
    assert Policy.parse(str(p)) == p


def test_fp16_pure_uses_static_scale_one():
    assert Policy.parse("fp16-pure").init_scale == 1.0


def test_issue_example_prints_the_grammar():
    assert str(Policy.parse("fp16-master")) == "p=f16,c=f16,o=f32,m=f32,ls=dynamic,i=norm,tf32=0,comp=none"


@pytest.mark.parametrize(
    "alias,preset",
    [("16-mixed", "fp16-mixed"), ("bf16-mixed", "bf16-mixed"), ("32-true", "fp32"), ("mixed_float16", "fp16-mixed"),
     ("mixed_bfloat16", "bf16-mixed"), ("16-true", "fp16-pure"), ("BF16-Mixed", "bf16-mixed")],
)
def test_aliases(alias, preset):
    assert Policy.parse(alias) == PRESETS[preset]


@pytest.mark.parametrize(
    "alias,preset",
    [("fp16", "fp16-mixed"), ("f16", "fp16-mixed"), ("half", "fp16-mixed"), ("float16", "fp16-mixed"),
     ("FP16", "fp16-mixed"), (" Half ", "fp16-mixed"), ("bf16", "bf16-mixed"), ("bfloat16", "bf16-mixed"),
     ("BFloat16", "bf16-mixed"), ("f32", "fp32"), ("float32", "fp32")],
)
def test_bare_dtype_names_mean_the_autocast_preset_of_that_dtype(alias, preset):
    # Issue 15: "fp16" was answered with "Did you mean 'bf16'?" (another dtype) and "f32" with
    # "'tf32'?". A bare dtype name resolves the way Lightning reads "bf16": the autocast recipe.
    p = Policy.parse(alias)
    assert p == PRESETS[preset] and p.name == preset
    assert Policy.parse(str(p)) == p
    assert ALIASES[alias.strip().lower()] == preset


@pytest.mark.parametrize(
    "typo,suggestion",
    [("fp16-mixd", "fp16-mixed"), ("fp16-mastr", "fp16-master"), ("bf16-pur", "bf16-pure"), ("hlaf", "half"),
     ("flaot16", "float16")],
)
def test_typos_still_get_the_closest_name(typo, suggestion):
    with pytest.raises(ValueError, match=re.escape(f"unknown precision preset {typo!r}; choose one of: fp32,")) as e:
        Policy.parse(typo)
    assert f"Did you mean {suggestion!r}?" in str(e.value)
    assert Policy.parse(suggestion) == Policy.parse(ALIASES.get(suggestion, suggestion))


def test_bf16_true_keeps_lightnings_meaning():
    p = Policy.parse("bf16-true")
    assert (p.param_dtype, p.compute_dtype, p.master_dtype, p.compensation) == (BF16, BF16, None, "none")
    assert p.name is None


def test_every_alias_parses():
    for alias in ALIASES:
        assert isinstance(Policy.parse(alias), Policy)


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("p=f32,c=f16", "p=f32,c=f16,o=f32,m=none,ls=dynamic,i=norm,tf32=0,comp=none"),  # ls cascades from c=f16
        ("p=bf16", "p=bf16,c=bf16,o=f32,m=none,ls=none,i=norm,tf32=0,comp=none"),  # c cascades from p
        ("c=bf16", "p=f32,c=bf16,o=f32,m=none,ls=none,i=norm,tf32=0,comp=none"),
        ("p=f16,m=f32,ls=static:128,i=none", "p=f16,c=f16,o=f32,m=f32,ls=static:128,i=none,tf32=0,comp=none"),
        ("p=half, c=half, i=norm+Embedding+name:*.lm_head", "p=f16,c=f16,o=f32,m=none,ls=dynamic,i=norm+Embedding+name:*.lm_head,tf32=0,comp=none"),
        ("ls=dynamic:1024,c=f16,tf32=1", "p=f32,c=f16,o=f32,m=none,ls=dynamic:1024,i=norm,tf32=1,comp=none"),
        ("p=bf16,comp=stochastic,ls=static:0.5", "p=bf16,c=bf16,o=f32,m=none,ls=static:0.5,i=norm,tf32=0,comp=stochastic"),
    ],
)
def test_grammar_defaults_cascade(spec, expected):
    assert str(Policy.parse(spec)) == expected


def test_p_equals_preset_from_grammar():
    assert Policy.parse("p=f32,c=bf16") == Policy.parse("bf16-mixed")
    assert Policy.parse("p=f16,m=f32") == Policy.parse("fp16-master")


_dt = st.sampled_from([F32, BF16, F16])


@st.composite
def policies(draw):
    p = draw(_dt)
    c = draw(_dt) if p == F32 else p
    o = draw(_dt)
    m = draw(st.sampled_from([None, F32])) if p != F32 else None
    ls = draw(st.sampled_from(["none", "static", "dynamic"]))
    # (a dynamic scale starts inside the scaler's [1, 2**24]; a static one may be any positive number)
    scale = None if ls == "none" else draw(st.sampled_from([None, 1.0, 2.0 ** 15, 1000.0] + ([0.25] if ls == "static" else [])))
    islands = draw(st.lists(st.sampled_from(["norm", "Embedding", "Linear", "name:*.head", "name:blocks.?.attn"]),
                            unique=True, max_size=3))
    comp = draw(st.sampled_from(["none", "kahan", "stochastic"])) if (p != F32 and m is None) else "none"
    return Policy(p, c, o, m, ls, scale, tuple(islands), draw(st.booleans()), comp)


@given(policies())
def test_round_trip_every_valid_combination(policy):
    assert Policy.parse(str(policy)) == policy
    assert hash(Policy.parse(str(policy))) == hash(policy)


def test_round_trip_exhaustive_dtype_grid():
    n = 0
    for p, c, o in itertools.product([F32, BF16, F16], repeat=3):
        if p != F32 and c != p:
            continue
        for m in ([None, F32] if p != F32 else [None]):
            pol = Policy(p, c, o, m, "dynamic" if c == F16 else "none")
            assert Policy.parse(str(pol)) == pol
            n += 1
    assert n == 3 * 3 + 2 * 3 * 2


def test_frozen():
    p = Policy.parse("fp32")
    with pytest.raises(AttributeError):
        p.param_dtype = F16  # type: ignore[misc]
    assert p.replace(tf32=True) == Policy.parse("tf32")


def test_accepts_module_classes_as_islands():
    p = Policy(fp32_islands=(torch.nn.Embedding, "norm"))
    assert p.fp32_islands == ("Embedding", "norm")


def test_unknown_preset_names_closest_and_lists_choices():
    with pytest.raises(ValueError, match=re.escape("unknown precision preset 'bf16-mixd'; choose one of: fp32, tf32, fp16-mixed")) as e:
        Policy.parse("bf16-mixd")
    assert "Did you mean 'bf16-mixed'?" in str(e.value)
    assert "p=param dtype" in str(e.value)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("p=f16,c=bf16", "half-precision parameters compute in their own dtype, but p=f16 and c=bf16"),
        ("p=f32,m=f32", "m=f32 with p=f32 in policy"),
        ("p=f16,m=bf16", "m=bf16 in policy"),
        ("p=f8e4m3", "p=f8e4m3 is not supported"),
        ("q=1", "unknown policy key in 'q=1': 'q'"),
        ("p=f32,p=f16", "policy 'p=f32,p=f16' sets p= twice"),
        ("p=f32,ls=static:abc", "loss scale 'abc' is not a number"),
        ("p=f32,ls=none:4", "init_scale=4.0 given but loss scaling is off"),
        ("p=f32,ls=static:0", "loss scale must be a positive finite number, got 0.0"),
        ("p=f32,ls=sometimes", "unknown loss scaling 'sometimes'"),
        ("p=f32,comp=kahan", "comp=kahan in policy"),
        ("p=f16,m=f32,comp=kahan", "compensated updates are for half-precision parameters without master weights"),
        ("p=f32,tf32=maybe", "tf32='maybe'; use tf32=0 or tf32=1"),
        ("p=f32,i=a.b", "FP32 island 'a.b' is not understood"),
        ("p=f32,i=norm+norm", "FP32 islands repeat an entry"),
        ("p=float33", "policy 'p=float33': unknown dtype 'float33'"),
        ("p=f32,c", "policy 'p=f32,c': 'c' is not key=value"),
    ],
)
def test_bad_policies_raise_clear_errors(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Policy.parse(spec)


def test_wrong_type():
    with pytest.raises(TypeError, match=re.escape("a policy is a preset name or a 'p=...,c=...' string, got int 16")):
        Policy.parse(16)  # type: ignore[arg-type]


def test_island_matching():
    p = Policy(fp32_islands=("norm", "Embedding", "name:head*"))

    class LlamaRMSNorm(torch.nn.Module):
        pass

    class MyEmbedding(torch.nn.Embedding):
        pass

    assert p.is_fp32_island(torch.nn.LayerNorm(2))
    assert p.is_fp32_island(torch.nn.BatchNorm2d(2))
    assert p.is_fp32_island(LlamaRMSNorm())
    assert p.is_fp32_island(MyEmbedding(3, 2))  # matched along the MRO
    assert p.is_fp32_island(torch.nn.Linear(2, 2), "head.proj")
    assert not p.is_fp32_island(torch.nn.Linear(2, 2), "body.proj")
    assert not p.is_fp32_island(torch.nn.Linear(2, 2))


def test_derived_properties():
    assert Policy.parse("fp16-mixed").is_mixed and Policy.parse("fp16-mixed").uses_autocast
    assert not Policy.parse("fp16-master").is_mixed and Policy.parse("fp16-master").has_masters
    assert not Policy.parse("fp32").uses_autocast


def test_the_norm_island_is_normalization_layers_only():
    """'norm' matches classes named like a norm (…Norm, …Norm2d, …NormGated) that hold no parametrised submodule:
    a block named like a norm that wraps attention (DBRX's DbrxNormAttentionNorm) is cast, its own norms stay FP32."""
    from torch import nn

    class DbrxNormAttentionNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm_1, self.attn, self.norm_2 = nn.LayerNorm(4), nn.Linear(4, 4), nn.LayerNorm(4)

    class MambaRMSNormGated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

    class ScaledNorm(nn.Module):  # a norm whose only child has no parameters
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.Identity()
            self.weight = nn.Parameter(torch.ones(4))

    policy = Policy.parse("bf16-master")
    block = DbrxNormAttentionNorm()
    assert not policy.is_fp32_island(block)
    assert policy.is_fp32_island(block.norm_1) and not policy.is_fp32_island(block.attn)
    assert policy.is_fp32_island(MambaRMSNormGated()) and policy.is_fp32_island(ScaledNorm())
    assert policy.is_fp32_island(nn.BatchNorm2d(3)) and policy.is_fp32_island(nn.GroupNorm(2, 4))


@pytest.mark.parametrize("scale", ["0.5", "33554432"])
def test_a_dynamic_initial_scale_outside_the_default_range_widens_it(scale):
    """ls=dynamic:S outside the dynamic scaler's default [1, 2**24]: the run's scaler starts at S with its floor or
    ceiling moved to S (it used to parse, then fail in MixedPrecision naming constructor arguments never passed;
    a numerics report may recommend such a scale)."""
    from mixprec import MixedPrecision
    from mixprec._policy import DYNAMIC_SCALE_RANGE
    from mixprec._scaler import DEFAULT_MAX_SCALE, DEFAULT_MIN_SCALE

    assert (DEFAULT_MIN_SCALE, DEFAULT_MAX_SCALE) == DYNAMIC_SCALE_RANGE
    prec = MixedPrecision(f"p=f32,c=f16,ls=dynamic:{scale}")
    assert float(prec.scaler.loss_scale) == float(scale)
    cfg = prec.scaler._core.cfg
    assert cfg.min_scale == min(1.0, float(scale)) and cfg.max_scale == max(2.0 ** 24, float(scale))


def test_the_norm_island_keeps_parametrized_norms_and_norms_around_norms():
    from torch import nn
    from torch.nn.utils import parametrize

    class Positive(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w.abs()

    class SandwichNorm(nn.Module):  # its own gain around an inner LayerNorm
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.LayerNorm(4)
            self.g = nn.Parameter(torch.ones(4))

    ln = nn.LayerNorm(4)
    parametrize.register_parametrization(ln, "weight", Positive())
    policy = Policy.parse("bf16-master")
    assert policy.is_fp32_island(ln)
    assert policy.is_fp32_island(SandwichNorm())


def test_a_norm_named_block_inside_a_norm_named_block_is_not_an_island():
    from torch import nn

    class PreNorm(nn.Module):
        def __init__(self, fn: nn.Module) -> None:
            super().__init__()
            self.norm, self.fn = nn.LayerNorm(4), fn

    class AdaLayerNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear, self.norm = nn.Linear(4, 8), nn.LayerNorm(4)

    class OuterNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ada = AdaLayerNorm()

    policy = Policy.parse("bf16-master")
    assert not policy.is_fp32_island(PreNorm(PreNorm(nn.Linear(4, 4))))
    assert not policy.is_fp32_island(OuterNorm())


@pytest.mark.parametrize("kw", [{"fp32_islands": ("None",)}, {"fp32_islands": ("NONE",)}])
def test_an_island_spelt_none_is_refused_so_str_round_trips(kw) -> None:
    """'None' printed as i=None parsed back as no islands (Policy.parse(str(p)) != p); an entry spelt none in any case
    is refused now, and the wrong types get the intended TypeError (the policy's string, built first, raised)."""
    with pytest.raises(ValueError, match="'none' means no islands"):
        Policy(**kw)
    with pytest.raises(TypeError, match=r"FP32 islands are strings or module classes, got 1"):
        Policy(fp32_islands=(1,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"fp32_islands must be a tuple of strings"):
        Policy(fp32_islands=None)  # type: ignore[arg-type]


def test_islands_from_any_iterable_and_a_frozen_float64_constant() -> None:
    """Sets, generators and dict keys of islands are taken (a first version of the type check refused every container
    but tuple and list); a frozen float64 parameter stays as it is under a half-parameter policy, a trainable one is
    refused (it stayed float64, silently)."""
    import torch

    from mixprec import MixedPrecision

    assert Policy(fp32_islands={"norm"}).fp32_islands == ("norm",)
    assert Policy(fp32_islands=(i for i in ("norm", "Embedding"))).fp32_islands == ("norm", "Embedding")
    model = torch.nn.Linear(4, 2)
    model.k = torch.nn.Parameter(torch.tensor(2.0, dtype=torch.float64), requires_grad=False)
    MixedPrecision("bf16-master").prepare(model, torch.optim.SGD([model.weight, model.bias], lr=0.1))
    assert model.k.dtype == torch.float64 and model.weight.dtype == torch.bfloat16
    wide = torch.nn.Linear(4, 2).double()
    with pytest.raises(ValueError, match="trainable parameters are all float64"):
        MixedPrecision("bf16-master").prepare(wide, torch.optim.SGD(wide.parameters(), lr=0.1))
    one = torch.nn.Linear(4, 2)  # a learned float64 temperature in an FP32 model: kept and trained, as before
    one.temp = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
    MixedPrecision("bf16-master").prepare(one, torch.optim.SGD(one.parameters(), lr=0.1))
    assert one.temp.dtype == torch.float64


@pytest.mark.parametrize("preset", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-master-r16"])
def test_a_float64_temperature_in_an_fp32_model_stays_float64_and_trains(preset: str) -> None:
    """One learned float64 parameter beside FP32 weights (a temperature): FP32-parameter policies keep it in float64
    and train it as torch does (they refused it as a "half" dtype, with advice to pick a half-parameter policy); master
    policies step it as its own float64 master (an FP32 master rounded every update to FP32; bf16-master-r16 refused
    it); an overflowing step is skipped for it too."""
    import copy
    import warnings

    from mixprec import MixedPrecision

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)
            self.temp = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).float() / self.temp.float()

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 3, generator=g)
    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on a CPU
        prec = MixedPrecision(preset)
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(4):
        with prec.autocast():
            loss = torch.nn.functional.mse_loss(model(x), y)
        prec.backward(loss * (float("inf") if step == 1 else 1.0))
        assert prec.step(opt).applied() == (step != 1)
        opt.zero_grad()
        if step != 1:
            torch.nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    assert model.temp.dtype == torch.float64 and float(model.temp) != 1.5
    if "master" in preset:
        assert any(m is model.temp for m in opt.masters)  # its own master: stepped in float64
        assert float(model.temp) != float(torch.tensor(float(model.temp)).float())  # not an FP32 number
    # the compute dtype's rounding of the gradient only (FP32: the same update)
    tol = 0.0 if preset == "fp32" else 1e-4 if preset.startswith("bf16") else 1e-5
    assert abs(float(model.temp) - float(ref.temp)) <= tol


def test_an_island_glob_matches_a_shared_module_under_any_of_its_names() -> None:
    """A module registered under two names (shared by an encoder and a decoder): ``name:`` matches either name
    (the second was refused as matching nothing, and was not an island)."""
    from mixprec import MixedPrecision

    shared = torch.nn.Linear(4, 4)
    model = torch.nn.ModuleDict({"enc": torch.nn.Sequential(torch.nn.Linear(4, 4), shared),
                                 "dec": torch.nn.Sequential(shared, torch.nn.Linear(4, 2))})
    for glob in ("enc.1", "dec.0"):
        pol = Policy.parse(f"p=bf16,c=bf16,m=f32,i=norm+name:{glob}")
        pol.check_islands(model)
        assert [m for _, m in island_modules(model, pol)] == [shared]
    m = copy.deepcopy(model)
    MixedPrecision("p=bf16,c=bf16,m=f32,i=norm+name:dec.0").prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
    assert m["dec"][0].weight.dtype == torch.float32 and m["enc"][0].weight.dtype == torch.bfloat16


def test_norm_detection_by_what_a_layer_is_not_only_its_name() -> None:
    """A scripted LayerNorm (``RecursiveScriptModule``, ``original_name`` LayerNorm) is a norm; a Linear or Conv
    subclass named like one (Tacotron's ``LinearNorm``/``ConvNorm``: a layer with a normalised initialisation) is not."""

    class LinearNorm(torch.nn.Linear):
        pass

    class ConvNorm(torch.nn.Conv1d):
        pass

    class RMSNorm(torch.nn.Module):  # a custom norm without torch's classes
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))

    pol = Policy.parse("bf16-master")
    assert pol.is_fp32_island(torch.jit.script(torch.nn.LayerNorm(4)))
    assert pol.is_fp32_island(RMSNorm())
    assert not pol.is_fp32_island(LinearNorm(4, 4)) and not pol.is_fp32_island(ConvNorm(4, 4, 3))
    assert Policy.parse("p=bf16,c=bf16,m=f32,i=LayerNorm").is_fp32_island(torch.jit.script(torch.nn.LayerNorm(4)))


def test_bf16_pure_names_the_fix_for_an_integer_parameter() -> None:
    """A frozen integer parameter (an index table) in the optimizer under bf16-pure: refused with the advice for it
    (it said to "keep it real", written for complex parameters), and nothing is cast."""
    from mixprec import MixedPrecision

    model = torch.nn.Linear(4, 3)
    model.idx = torch.nn.Parameter(torch.arange(3), requires_grad=False)
    with pytest.raises(ValueError, match=r"holds a torch.int64 parameter of shape \(3,\), which never gets a gradient;.*"
                                         r"Leave it out of the optimizer \(e.g. \[p for p in model.parameters\(\) if "
                                         r"p.is_floating_point\(\)\]\) or register it as a buffer"):
        MixedPrecision("bf16-pure").prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.weight.dtype == torch.float32
