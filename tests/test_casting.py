import collections
import copy
import dataclasses
import re

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec._autocast import autocast
from mixprec._casting import cast_module, cast_tree, is_prepared, island_modules, uncast_module
from mixprec._policy import Policy
from mixprec.checkpoint import fp32_state_dict

HALF = [torch.float16, torch.bfloat16]


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    ids: torch.Tensor
    note: str = "x"


Pair = collections.namedtuple("Pair", "a b")


@pytest.mark.parametrize("dtype", HALF + [torch.float32])
def test_cast_tree_keeps_containers_and_non_floating_leaves(dtype):
    ids = torch.arange(3)
    mask = torch.tensor([True, False])
    f64 = torch.ones(2, dtype=torch.float64)
    src = torch.randn(2, 3, dtype=torch.float32 if dtype != torch.float32 else torch.float16)
    obj = {
        "x": [src, (ids, mask)],
        "p": Pair(src, 3),
        "o": Out(src, ids),
        "od": collections.OrderedDict(a=src, b=f64),
        "s": "text",
        "n": None,
    }
    out = cast_tree(obj, dtype)
    assert type(out["od"]) is collections.OrderedDict and type(out["p"]) is Pair and type(out["o"]) is Out
    assert isinstance(out["x"], list) and isinstance(out["x"][1], tuple)
    assert out["x"][0].dtype == dtype and out["p"].a.dtype == dtype and out["o"].logits.dtype == dtype
    assert out["x"][1][0] is ids and out["x"][1][1] is mask and out["o"].ids is ids
    assert out["od"]["b"] is f64  # float64 untouched unless asked
    assert out["s"] == "text" and out["n"] is None and out["p"].b == 3 and out["o"].note == "x"
    torch.testing.assert_close(out["x"][0].float(), src.to(dtype).float())
    assert cast_tree(f64, dtype, include_float64=True).dtype == dtype


def test_cast_tree_returns_same_tensor_when_already_right_dtype():
    t = torch.ones(2)
    assert cast_tree(t, torch.float32) is t
    tup = (t, 1)
    assert cast_tree(tup, torch.float32) is tup


def test_cast_tree_rejects_non_floating_target():
    with pytest.raises(TypeError, match=re.escape("cast_tree needs a floating torch.dtype, got torch.int64")):
        cast_tree(torch.ones(1), torch.int64)


class RecordingNorm(nn.LayerNorm):
    """A LayerNorm that records the dtypes it really computes with."""

    def forward(self, x):
        out = super().forward(x)
        self.seen = (x.dtype, self.weight.dtype, out.dtype, torch.is_autocast_enabled(x.device.type))
        return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc1 = nn.Linear(8, 8)
        self.norm = RecordingNorm(8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, ids, scale=1.0):
        h = self.emb(ids) * scale
        self.fc1_in = h.dtype
        h = self.fc1(h)
        h = self.norm(h)
        self.after_norm = h.dtype
        h = self.bn(h)
        return {"logits": self.head(h), "ids": ids}


@pytest.mark.parametrize("preset,half", [("bf16-master", torch.bfloat16), ("fp16-master", torch.float16), ("bf16-pure", torch.bfloat16)])
def test_cast_module_keeps_islands_fp32_and_they_compute_in_fp32(preset, half):
    torch.manual_seed(0)
    m = Net()
    fc_before = m.fc1.weight.detach().clone()
    pid = id(m.fc1.weight)
    cast_module(m, preset)
    assert id(m.fc1.weight) == pid  # parameters keep identity
    assert m.fc1.weight.dtype == half and m.emb.weight.dtype == half and m.head.weight.dtype == half
    assert m.norm.weight.dtype == torch.float32 and m.bn.weight.dtype == torch.float32
    assert m.bn.running_mean.dtype == torch.float32 and m.bn.num_batches_tracked.dtype == torch.int64
    torch.testing.assert_close(m.fc1.weight.float(), fc_before.to(half).float(), rtol=0, atol=0)
    with autocast(preset, "cpu"):
        out = m(torch.randint(0, 10, (4,)))
    x_dtype, w_dtype, out_dtype, ac = m.norm.seen
    assert (x_dtype, w_dtype, out_dtype, ac) == (torch.float32, torch.float32, torch.float32, False)
    assert m.after_norm == half  # the island hands the compute dtype back
    assert out["logits"].dtype == torch.float32  # output dtype
    assert out["ids"].dtype == torch.int64


def test_root_casts_float_inputs_for_half_params():
    net = nn.Sequential(nn.Linear(4, 4))
    seen = {}
    cast_module(net, "fp16-master")
    net.register_forward_pre_hook(lambda mod, args: seen.update(given=args[0].dtype))
    net[0].register_forward_pre_hook(lambda mod, args: seen.update(inp=args[0].dtype))
    y = net(torch.randn(2, 4))
    # the cast is the root's forward: hooks on the root see the inputs as given, the model the cast ones
    assert seen == {"given": torch.float32, "inp": torch.float16} and y.dtype == torch.float32


def test_root_forward_keeps_the_signature_and_uncasts():
    import inspect

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
            return self.lin(input_ids)

    m = Model()
    before = inspect.signature(m.forward)
    cast_module(m, "bf16-master")
    # Hugging Face's Trainer keeps only the dataset columns named in forward's signature
    assert inspect.signature(m.forward) == before
    assert list(inspect.signature(m.forward).parameters) == ["input_ids", "attention_mask"]
    uncast_module(m)
    assert "forward" not in m.__dict__ and inspect.signature(m.forward) == before


def test_mixed_policy_keeps_fp32_params_and_islands_disable_autocast():
    m = Net()
    cast_module(m, "bf16-mixed")
    assert all(p.dtype == torch.float32 for p in m.parameters())
    with autocast("bf16-mixed", "cpu"):
        out = m(torch.randint(0, 10, (4,)))
    assert m.norm.seen == (torch.float32, torch.float32, torch.float32, False)
    assert m.after_norm == torch.bfloat16
    assert torch.is_autocast_enabled("cpu") is False
    assert out["logits"].dtype == torch.float32


def test_fp32_policy_installs_no_island_hooks():
    m = Net()
    cast_module(m, "fp32")
    out = m(torch.randint(0, 10, (4,)))
    assert m.norm.seen == (torch.float32, torch.float32, torch.float32, False)
    assert out["logits"].dtype == torch.float32


def test_islands_by_name_and_type():
    m = Net()
    pol = Policy.parse("p=bf16,i=Embedding+name:head")
    names = [n for n, _ in island_modules(m, pol)]
    assert names == ["emb", "head"]
    cast_module(m, pol)
    assert m.emb.weight.dtype == torch.float32 and m.head.weight.dtype == torch.float32
    assert m.norm.weight.dtype == torch.bfloat16  # norm not listed: cast


def test_tied_weight_shared_with_island_stays_fp32():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.out = nn.Linear(4, 5, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, ids):
            return self.out(self.emb(ids))

    m = cast_module(Tied(), "p=f16,i=Embedding")
    assert m.out.weight is m.emb.weight and m.emb.weight.dtype == torch.float32


def test_island_hook_state_restored_when_forward_raises():
    class Boom(nn.LayerNorm):
        def forward(self, x):
            raise RuntimeError("boom")

    m = nn.Sequential(nn.Linear(4, 4), Boom(4))
    cast_module(m, "bf16-mixed")
    with autocast("bf16-mixed", "cpu"):
        with pytest.raises(RuntimeError, match="boom"):
            m(torch.randn(2, 4))
        assert torch.is_autocast_enabled("cpu")  # the island's "autocast off" was undone
    assert not torch.is_autocast_enabled("cpu")


def test_double_prepare_raises_and_uncast_allows_again():
    m = Net()
    cast_module(m, "bf16-master")
    assert is_prepared(m)
    with pytest.raises(ValueError, match=re.escape("this model was already prepared for policy 'p=bf16,c=bf16")):
        cast_module(m, "fp16-master")
    uncast_module(m)
    assert not is_prepared(m)
    cast_module(m, "bf16-master")


def test_cast_module_type_error():
    with pytest.raises(TypeError, match="cast_module needs an nn.Module, got str"):
        cast_module("model", "fp32")  # type: ignore[arg-type]


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp16-mixed"])
def test_a_mixed_model_runs_as_fp32_outside_autocast(preset):
    """Under FP32 parameters a norm island casts its output to the compute dtype only inside autocast: outside (an eval
    loop, torch.optim.swa_utils.update_bn) the next FP32 Linear got a half input and torch raised a dtype mismatch."""
    import warnings

    from mixprec import MixedPrecision

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.LayerNorm(16), nn.Linear(16, 4))
    reference = copy.deepcopy(net).eval()
    prec = MixedPrecision(preset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU
        model, _ = prec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    model.eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = model(x)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, reference(x))
        with prec.autocast():
            assert model[2](model[1](model[0](x))).dtype == prec.policy.compute_dtype  # inside: as before
    torch.optim.swa_utils.update_bn([torch.randn(16, 8) for _ in range(2)], torch.optim.swa_utils.AveragedModel(model))


@pytest.mark.parametrize("preset,cast", [("bf16-master", "float"), ("bf16-master", "half"), ("bf16-mixed", "half"),
                                         ("bf16-pure", "float"), ("bf16-master", "bfloat16")])
def test_a_model_cast_again_after_prepare_is_refused_at_the_next_forward(preset, cast):
    """model.half()/.float()/.to(dtype) after prepare() raises a mixprec error naming the parameter at the next forward
    (it failed inside torch on a dtype mismatch, or trained silently in another precision than the policy's)."""
    import warnings

    from mixprec import MixedPrecision

    net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    prec = MixedPrecision(preset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = prec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with prec.autocast():
        model(torch.randn(3, 4))  # fine before
    getattr(model, cast)()
    with pytest.raises(RuntimeError, match=r"parameter '[0-9]\.weight' is (f32|f16|bf16) but mixprec's cast made it"), \
            prec.autocast():
        model(torch.randn(3, 4))


@pytest.mark.parametrize("preset,cast", [("bf16-pure", "float"), ("bf16-master", "float"), ("bf16-mixed", "half"),
                                         ("fp16-master", "float")])
def test_a_submodule_cast_after_prepare_is_refused_at_the_next_forward(preset, cast):
    """model.head.float() after prepare(): only the head's parameters change dtype (bf16-pure trained it in FP32 silently)."""
    import warnings

    from mixprec import MixedPrecision

    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 2))
    prec = MixedPrecision(preset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = prec.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    getattr(model[3], cast)()
    with pytest.raises(RuntimeError, match=r"parameter '3\.weight' is (f32|f16) but mixprec's cast made it"), \
            prec.autocast():
        model(torch.randn(3, 4))



def _encoder() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), 2)


@pytest.mark.parametrize("how", ["bf16-master", "fp16-master", "bf16-pure", "for_inference"])
def test_transformer_encoder_eval_fast_path_with_fp32_norms_runs_and_matches_fp32(how: str) -> None:
    # torch's eval fast path (nested tensors, _transformer_encoder_layer_fwd) reads the layer's weights
    # directly, past the norm islands: FP32 norms beside half linears raised "expected scalar type Float".
    from mixprec.checkpoint import for_inference

    x = torch.randn(4, 9, 16)
    mask = torch.zeros(4, 9, dtype=torch.bool)
    mask[:, 7:] = True
    ref_model = _encoder().eval()
    with torch.no_grad():
        ref = ref_model(x, src_key_padding_mask=mask)
    model = _encoder()
    if how == "for_inference":
        model = for_inference(model, "bf16")
        dt = torch.bfloat16
    else:
        prec = mp.MixedPrecision(how)
        model, _ = prec.prepare(model, torch.optim.AdamW(model.parameters()))
        model.eval()
        dt = torch.float16 if how.startswith("fp16") else torch.bfloat16
    layer = model.layers[0]
    assert layer.norm1.weight.dtype == torch.float32 and layer.linear1.weight.dtype == dt
    with torch.no_grad():
        out = model(x, src_key_padding_mask=mask)
    keep = ~mask  # padded positions are zeros on torch's nested path and values on the ordinary one
    tol = 2e-2 if dt == torch.float16 else 1e-1
    torch.testing.assert_close(out.float()[keep], ref[keep], atol=tol, rtol=tol)


def test_fast_path_guard_only_on_mixed_layers_and_undone_by_uncast() -> None:
    model = _encoder()
    mp.cast_module(model, "bf16-master")
    assert model.use_nested_tensor is False
    assert all(len(layer._forward_pre_hooks) == 1 for layer in model.layers)
    mp.uncast_module(model)
    assert model.use_nested_tensor is True
    assert all(len(layer._forward_pre_hooks) == 0 for layer in model.layers)
    # one dtype in the layers (no islands inside them): torch's fast path stays on
    plain = _encoder()
    mp.cast_module(plain, "p=bf16,c=bf16,o=f32,m=f32,ls=none,i=none")
    assert plain.use_nested_tensor is True and not plain.layers[0]._forward_pre_hooks


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp16-mixed"])
def test_mixed_eval_of_an_encoder_with_a_padding_mask_under_cpu_autocast_runs_and_matches_fp32(preset: str) -> None:
    # torch takes the fast path under CPU autocast (not under CUDA's) and it fails there for FP32 weights with
    # half activations ("expected scalar type Float but found BFloat16"), plain torch.autocast too: FP32-weight
    # layers of a policy that autocasts on a CPU are kept off it.
    x = torch.randn(4, 9, 16)
    mask = torch.zeros(4, 9, dtype=torch.bool)
    mask[1, 6:] = True
    ref_model = _encoder().eval()
    with torch.no_grad():
        ref = ref_model(x, src_key_padding_mask=mask)
    prec = mp.MixedPrecision(preset)
    model = _encoder()
    model, _ = prec.prepare(model, torch.optim.AdamW(model.parameters()))
    model.eval()
    with torch.no_grad(), prec.autocast():
        out = model(x, src_key_padding_mask=mask)
    keep = ~mask
    torch.testing.assert_close(out.float()[keep], ref[keep], atol=1e-1, rtol=1e-1)
    # an FP32 policy keeps torch's fast path
    fp32 = mp.cast_module(_encoder(), "fp32")
    assert fp32.use_nested_tensor is True and not fp32.layers[0]._forward_pre_hooks


class _Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, weight: torch.Tensor | None = None) -> torch.Tensor:
        self.seen = {"x": x.dtype, "labels": labels.dtype if labels is not None else x.dtype}
        if weight is not None:
            self.seen["weight"] = weight.dtype
        out = self.lin(x).squeeze(-1)
        return out if labels is None else ((out.float() - labels) ** 2).mean()


@pytest.mark.parametrize("policy", ["bf16-master", "fp16-master", "bf16-pure"])
def test_keyword_labels_keep_their_dtype_through_the_root_input_cast(policy: str) -> None:
    # HF regression: model(**batch) with FP32 labels; rounded to half they moved (BF16) or overflowed (FP16 > 65504)
    model = cast_module(_Regressor(), policy)
    half = torch.float16 if policy.startswith("fp16") else torch.bfloat16
    labels = torch.tensor([1000.5, 70000.0])
    loss = model(torch.randn(2, 4), labels=labels, weight=torch.ones(2))
    assert model.seen == {"x": half, "labels": torch.float32, "weight": half}
    assert torch.isfinite(loss)
    model(torch.randn(2, 4), labels)  # a positional second input is an input: cast
    assert model.seen["labels"] == half


class _Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (self.enc(source) - self.enc(target)).pow(2).sum(-1)


def test_a_keyword_target_that_is_an_activation_is_cast_like_a_positional_one() -> None:
    model = cast_module(_Siamese(), "bf16-master")
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    torch.testing.assert_close(model(a, target=b), model(a, b), rtol=0, atol=0)  # outside autocast: no dtype error


def _reparametrized(kind: str) -> nn.Module:
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    if kind == "spectral_norm":
        lin = nn.utils.spectral_norm(lin)  # torch's forward-pre-hook version, common in GAN code
    else:
        lin = nn.utils.parametrizations.orthogonal(lin)
    return nn.Sequential(lin, nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("kind", ["spectral_norm", "orthogonal"])
@pytest.mark.parametrize("how", ["bf16-master", "bf16-pure", "for_inference"])
def test_reparametrization_buffers_take_the_weight_dtype_and_the_model_runs(kind: str, how: str) -> None:
    # FP32 u/v (spectral_norm) or base (orthogonal) beside a BF16 weight: "addmv input tensors must have the same dtype"
    from mixprec.checkpoint import for_inference

    x = torch.randn(4, 8)
    with torch.no_grad():
        ref = _reparametrized(kind).eval()(x)
    model = _reparametrized(kind)
    if how == "for_inference":
        model = for_inference(model, "bf16")
    else:
        prec = mp.MixedPrecision(how)
        model, _ = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        model.eval()
    halves = {n: b.dtype for n, b in model.named_buffers() if b.is_floating_point()}
    assert halves and set(halves.values()) == {torch.bfloat16}, halves
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=5e-2)


def test_reparametrization_buffers_of_an_island_stay_fp32() -> None:
    model = _reparametrized("spectral_norm")
    cast_module(model, "p=bf16,c=bf16,o=f32,m=f32,ls=none,i=name:0")
    assert model[0].weight_u.dtype == torch.float32 and model[2].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master", "bf16-pure"])
def test_load_state_dict_with_assign_into_a_prepared_model_is_refused_before_anything_changes(preset):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    saved = {k: torch.randn_like(v.float()) if v.dtype.is_floating_point else v for k, v in model.state_dict().items()}
    prec = mp.MixedPrecision(preset)
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    params = list(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"assign=True.*at '0'.*Nothing was loaded"):
        model.load_state_dict(saved, assign=True)
    with pytest.raises(RuntimeError, match=r"assign=True.*at 'Linear'"):
        model[2].load_state_dict({k[2:]: v for k, v in saved.items() if k.startswith("2.")}, assign=True)
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    model.load_state_dict(saved)  # copies into the parameters, in their dtypes
    assert model[0].weight.dtype == params[0].dtype and torch.equal(model[0].weight, saved["0.weight"].to(params[0].dtype))
    mp.uncast_module(model)
    model.load_state_dict(saved, assign=True)  # the hooks come off with the rest
    assert model[0].weight.dtype == torch.float32


def test_load_state_dict_with_assign_into_an_inference_model_works():
    """No run holds an inference model's parameters: assign=True is torch's business there (refused at first)."""
    from mixprec.checkpoint import for_inference

    model = for_inference(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)), "bf16")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(saved, assign=True)
    assert model[0].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master"])
def test_uncast_module_of_a_live_run_closes_the_run_and_its_gradient_hooks(preset):
    """uncast_module() removed the casts under a live run, which trained on silently outside its policy (BF16 logits
    under o=f32, no input casts), and a second prepare kept feeding the first run's master gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    prec = mp.MixedPrecision(preset)
    model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    mp.uncast_module(model)
    with prec.autocast():
        loss = model(torch.randn(3, 4).to(model[0].weight.dtype)).float().square().mean()
    with pytest.raises(ValueError, match=r"backward\(\): this run's model was uncast by mixprec.uncast_module"):
        prec.backward(loss)
    with pytest.raises(ValueError, match="uncast_module"):
        prec.clip_grad_norm_(1.0)
    saved = prec.state_dict()  # the run's state can still be saved (weights and masters are as they were)
    assert fp32_state_dict(saved).keys() == {k for k in model.state_dict()}
    prec2 = mp.MixedPrecision(preset)
    model, opt2 = prec2.prepare(model.float(), torch.optim.AdamW(model.parameters(), lr=1e-2))
    with prec2.autocast():
        loss = model(torch.randn(3, 4)).float().square().mean()
    prec2.backward(loss)
    if isinstance(opt, mp.MasterWeightOptimizer):
        own = [m for m, p in zip(opt.masters, opt.model_params) if m is not p]  # (FP32 islands are their own masters)
        assert len(own) == 4 and all(m.grad is None for m in own)  # the first run's hooks are off
    prec2.step(opt2)


@pytest.mark.parametrize("preset", ["fp32", "bf16-mixed", "bf16-master", "fp16-master", "bf16-pure"])
def test_torchscript_submodules_prepare_or_are_refused_as_islands(preset: str) -> None:
    """A scripted submodule: prepare raised torch's "not supported on ScriptModules" from mixprec's load-state-dict
    guard and left the model cast and patched. Now a scripted block that is no island prepares and trains as the eager
    one, bit for bit; a scripted norm (an island by its original name), or a norm inside a scripted block, is refused
    where islands act (TorchScript bypasses or drops their FP32 wrapper), with nothing changed; under fp32 it prepares;
    load_state_dict(assign=True) is refused before a scripted child's tensors are swapped."""
    import warnings

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l, self.n = nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.n(self.l(x))

    class Model(nn.Module):
        def __init__(self, script: str) -> None:
            super().__init__()
            self.a, self.b, self.n, self.h = nn.Linear(4, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)
            if script == "linear":
                self.b = torch.jit.script(self.b)
            elif script == "norm":
                self.n = torch.jit.script(self.n)
            elif script == "block":
                self.b = torch.jit.script(Block())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.h(self.n(self.b(self.a(x))))

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 3, generator=g)
    outs = []
    for script in ("none", "linear"):
        torch.manual_seed(0)
        model = Model(script)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fp16 on a CPU
            prec = mp.MixedPrecision(preset)
            model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for _ in range(3):
            with prec.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad()
        with prec.autocast():
            outs.append(model(x).float())
    assert torch.equal(outs[0], outs[1])
    seq = nn.Sequential(torch.jit.script(nn.Linear(4, 4)), nn.Linear(4, 2))  # the scripted child loads first
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp.MixedPrecision(preset).prepare(seq, torch.optim.SGD(seq.parameters()))
    sd = {k: v.clone() for k, v in seq.state_dict().items()}
    before = seq[0].weight.data_ptr()  # (a scripted module hands out a new Parameter object at each access)
    with pytest.raises(RuntimeError, match=r"load_state_dict\(..., assign=True\) on a model mixprec prepared"):
        seq.load_state_dict(sd, assign=True)
    assert seq[0].weight.data_ptr() == before  # the scripted child's tensor was not swapped
    for script, where in (("norm", "FP32 island 'n' \\(LayerNorm\\) .* is a TorchScript module"),
                          ("block", "FP32 island 'b.n' \\(LayerNorm\\) .* is inside the TorchScript module 'b'")):
        model = Model(script)
        if preset == "fp32":  # FP32 compute: islands do nothing, nothing to bypass
            mp.MixedPrecision(preset).prepare(model, torch.optim.SGD(model.parameters()))
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ValueError, match=where + ".*Prepare the eager module"):
                mp.MixedPrecision(preset).prepare(model, torch.optim.SGD(model.parameters()))
        assert model.a.weight.dtype == torch.float32 and "forward" not in model.__dict__  # nothing changed


def test_an_island_on_a_multihead_attentions_out_proj_alone_is_refused() -> None:
    """torch's attention computes ``out_proj`` from its weight without calling its ``forward``: an island there kept an
    FP32 weight and still projected in BF16 (bit for bit plain bf16-master), and failed outside autocast. Refused,
    naming the fix; the attention module itself as the island runs in FP32."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.MultiheadAttention(16, 2, batch_first=True)
            self.h = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.h(self.a(x, x, x, need_weights=False)[0])

    for islands in ("name:a.out_proj", "NonDynamicallyQuantizableLinear", "Linear"):
        model = Model()
        with pytest.raises(ValueError, match=r"match 'a.out_proj', the output projection of a MultiheadAttention.*"
                                             r"Make the attention module the island \('name:a' or 'MultiheadAttention'\)"):
            mp.MixedPrecision(f"p=bf16,c=bf16,m=f32,i=norm+{islands}").prepare(model, torch.optim.SGD(model.parameters()))
        assert model.a.out_proj.weight.dtype == torch.float32 and model.h.weight.dtype == torch.float32  # unchanged
    torch.manual_seed(0)
    ref = Model()
    x = torch.randn(2, 5, 16)
    half = copy.deepcopy(ref)
    mp.MixedPrecision("bf16-master").prepare(half, torch.optim.SGD(half.parameters()))
    model = copy.deepcopy(ref)
    prec = mp.MixedPrecision("p=bf16,c=bf16,o=f32,m=f32,i=norm+name:a")
    prec.prepare(model, torch.optim.SGD(model.parameters()))
    assert model.a.out_proj.weight.dtype == torch.float32 and model.a.in_proj_weight.dtype == torch.float32
    with torch.no_grad():
        exact = ref.a(x, x, x, need_weights=False)[0]
        island = model.a(x.bfloat16(), x.bfloat16(), x.bfloat16(), need_weights=False)[0].float()
        plain = half.a(x.bfloat16(), x.bfloat16(), x.bfloat16(), need_weights=False)[0].float()
    # the island's only rounding is its inputs' and output's (to BF16); the plain BF16 attention rounds throughout
    assert (island - exact).abs().max() < (plain - exact).abs().max()


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master"])
def test_an_islands_0d_outputs_stay_fp32(preset: str) -> None:
    """An MoE router made an island returns (logits, an auxiliary loss): the logits go on in the compute dtype, the
    0-d auxiliary loss stays FP32 (rounded to BF16 it moved the loss by 1e-3 relative; a 0-d FP32 tensor does not
    promote the half tensors it meets)."""

    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(16, 8, bias=False)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.w(x)
            p = logits.softmax(-1)
            return logits, (p.mean(0) * 8).pow(2).sum() / 8

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.router = nn.Linear(16, 16), Router()

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits, aux = self.router(self.inp(x))
            self.seen = (logits.dtype, aux.dtype, (logits * aux).dtype)  # what the model's own code gets
            return logits, aux

    torch.manual_seed(0)
    ref = Model()
    model = copy.deepcopy(ref)
    prec = mp.MixedPrecision(Policy.parse(preset).replace(fp32_islands=("norm", "name:router")))
    prec.prepare(model, torch.optim.SGD(model.parameters()))
    x = torch.randn(256, 16)
    with prec.autocast():
        _, aux = model(x)
    # the logits in BF16, the 0-d FP32 loss, which leaves the activations it scales in BF16
    assert model.seen == (torch.bfloat16, torch.float32, torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = ref.inp(x)
        with torch.autocast("cpu", enabled=False):
            _, ref_aux = ref.router(h.float() if preset == "bf16-mixed" else h.bfloat16().float())
    torch.testing.assert_close(aux.detach(), ref_aux, rtol=1e-6, atol=0)
