"""Masters that cannot drift (issue 18): every way a model's weights and gradients are touched
outside mixprec stays consistent with the FP32 masters.

Each recipe runs under ``bf16-master``, ``fp16-master``, ``bf16-pure`` and ``bf16-mixed`` and is
compared with the same loop written in plain FP32 PyTorch on the same data. Where a bug would
show (gradients accumulating across steps, an edit overwritten by the masters) the tests also
check that the broken FP32 loop lands far outside the tolerance, so the comparison can fail.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec import checkpoint
from mixprec._master import MasterWeightOptimizer
from mixprec._scaler import DynamicScaler

PRESETS = ["bf16-master", "bf16-master-r16", "fp16-master", "bf16-pure", "bf16-mixed"]
# max |weight - FP32 loop's weight| after a few SGD steps on O(1) weights: half-precision forward
# and backward, FP32 (or compensated) updates.
TOL = {"bf16": 5e-3, "fp16": 5e-4}


def tol(preset: str) -> float:
    return TOL[preset[:4]]


@dataclass
class Run:
    """One training run: the plain FP32 loop (``prec is None``) or a mixprec one."""

    model: nn.Module
    opt: Any
    given: torch.optim.Optimizer
    prec: mp.MixedPrecision | None

    def fwd(self) -> contextlib.AbstractContextManager[Any]:
        return self.prec.autocast() if self.prec is not None else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        if self.prec is not None:
            self.prec.backward(loss)
        else:
            loss.backward()

    def weights(self) -> dict[str, torch.Tensor]:
        if self.prec is None:
            return {k: v.detach().float().clone() for k, v in self.model.state_dict().items()}
        return {k: v.float().clone() for k, v in checkpoint.fp32_state_dict(self.prec).items()}


def make_run(
    preset: str | None, build: Callable[[], nn.Module], lr: float = 0.1, scaler: Any = None, **opt_kw: Any
) -> Run:
    torch.manual_seed(0)
    model = build()
    given = torch.optim.SGD(model.parameters(), lr=lr, **opt_kw)
    if preset is None:
        return Run(model, given, given, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU is slow: expected here
        if scaler is None and preset.startswith("fp16"):
            # a scale that does not overflow these small models: the tests here are about the masters
            scaler = DynamicScaler(init_scale=2.0**10, log_overflow=False)
        kw = {"scaler": scaler} if scaler is not None else {}
        prec = mp.MixedPrecision(preset, **kw)
        model, opt = prec.prepare(model, given)
    return Run(model, opt, given, prec)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point())


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


def batches(n: int, d_in: int = 6, d_out: int = 3) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(123)
    for _ in range(n):
        yield torch.randn(16, d_in, generator=g), torch.randn(16, d_out, generator=g)


# ----------------------------------------------------------------- 1. clearing gradients
def _clear(run: Run, how: str, set_to_none: bool) -> None:
    if how == "model":
        run.model.zero_grad(set_to_none=set_to_none)
    elif how == "returned":
        run.opt.zero_grad(set_to_none=set_to_none)
    elif how == "given":
        run.given.zero_grad(set_to_none=set_to_none)
    elif how == "prec":
        if run.prec is not None:
            run.prec.zero_grad(set_to_none=set_to_none)
        else:
            run.opt.zero_grad(set_to_none=set_to_none)
    elif how != "never":
        raise AssertionError(how)


def _train_clearing(run: Run, how: str, set_to_none: bool, steps: int = 6) -> dict[str, torch.Tensor]:
    for x, y in batches(steps):
        _clear(run, how, set_to_none)
        with run.fwd():
            loss = nn.functional.mse_loss(run.model(x).float(), y)
        run.backward(loss)
        run.opt.step()
    return run.weights()


@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zeros"])
@pytest.mark.parametrize("how", ["model", "returned", "given", "prec"])
@pytest.mark.parametrize("preset", PRESETS)
def test_every_way_to_clear_gradients_clears_what_the_step_uses(preset: str, how: str, set_to_none: bool) -> None:
    ref = _train_clearing(make_run(None, mlp), "model", set_to_none)
    got = _train_clearing(make_run(preset, mlp), how, set_to_none)
    assert max_diff(got, ref) <= tol(preset)
    # the comparison can fail: accumulating gradients across steps ends far away
    broken = _train_clearing(make_run(None, mlp), "never", set_to_none)
    assert max_diff(broken, ref) > 10 * tol(preset)


def test_model_zero_grad_after_an_fp16_overflow_does_not_keep_inf_in_the_masters() -> None:
    """The bug: inf stayed in a master gradient for good and every later step was skipped."""
    scaler = DynamicScaler(init_scale=2.0**20, growth_interval=1000, hysteresis=1, log_overflow=False)
    run = make_run("fp16-master", mlp, scaler=scaler)
    assert run.prec is not None
    applied = []
    for x, y in batches(16):
        run.model.zero_grad()
        with run.fwd():
            loss = nn.functional.mse_loss(run.model(x).float(), y)
        run.backward(loss)
        applied.append(run.prec.step(run.opt).applied())
    # 2**40 overflows fp16 gradients; halving reaches a finite scale after a bounded number of skips
    n_skipped = applied.index(True)
    assert n_skipped >= 1 and all(applied[n_skipped:]), applied
    # and the applied steps are the FP32 loop's steps on the same batches
    ref = make_run(None, mlp)
    for i, (x, y) in enumerate(batches(16)):
        ref.model.zero_grad()
        loss = nn.functional.mse_loss(ref.model(x), y)
        loss.backward()
        if applied[i]:
            ref.opt.step()
    assert max_diff(run.weights(), ref.weights()) <= tol("fp16")


class _Gen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class _Disc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _dcgan(preset: str | None, steps: int = 8) -> tuple[dict[str, torch.Tensor], list[float]]:
    """DCGAN's training loop shape: netD.zero_grad(), real+fake backward, optD.step(); netG.zero_grad(), ..."""
    torch.manual_seed(0)
    netG, netD = _Gen(), _Disc()
    both = nn.ModuleDict({"G": netG, "D": netD})
    optD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999), eps=1e-4)
    optG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999), eps=1e-4)
    prec = None
    if preset is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prec = mp.MixedPrecision(preset)
            both, optD, optG = prec.prepare(both, optD, optG)
    ctx = prec.autocast if prec is not None else contextlib.nullcontext
    backward = prec.backward if prec is not None else (lambda loss: loss.backward())
    bce = nn.functional.binary_cross_entropy_with_logits
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        real = torch.randn(16, 6, generator=g) * 0.5 + 1.0
        z = torch.randn(16, 4, generator=g)
        netD.zero_grad()
        with ctx():
            err_real = bce(netD(real).float(), torch.ones(16, 1))
        backward(err_real)
        with ctx():
            fake = netG(z)
            err_fake = bce(netD(fake.detach()).float(), torch.zeros(16, 1))
        backward(err_fake)
        optD.step()
        netG.zero_grad()
        with ctx():
            err_g = bce(netD(fake).float(), torch.ones(16, 1))
        backward(err_g)
        optG.step()
        losses.append(float(err_g.detach()))
    if prec is None:
        weights = {k: v.detach().clone() for k, v in both.state_dict().items()}
    else:
        weights = {k: v.float() for k, v in checkpoint.fp32_state_dict(prec).items()}
    return weights, losses


@pytest.mark.parametrize("preset", PRESETS)
def test_dcgan_loop_with_module_zero_grad_trains_like_fp32(preset: str) -> None:
    ref_w, ref_losses = _dcgan(None)
    got_w, got_losses = _dcgan(preset)
    assert max_diff(got_w, ref_w) <= tol(preset)
    assert max(abs(a - b) for a, b in zip(got_losses, ref_losses)) <= 5 * tol(preset)


# ------------------------------------------------------------ 2. edits of the model's weights
def _edit_clamp(model: nn.Module) -> None:
    for p in model.parameters():
        p.data.clamp_(-0.05, 0.05)  # WGAN's idiom, through .data (no version-counter bump)


def _edit_clamp_no_grad(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.05, 0.05)


def _masks(model: nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {n: (torch.rand(p.shape, generator=g) > 0.5) for n, p in model.named_parameters() if p.dim() == 2}


def _train_editing(run: Run, edit: Callable[[nn.Module], None], steps: int = 5) -> dict[str, torch.Tensor]:
    for x, y in batches(steps):
        run.opt.zero_grad()
        with run.fwd():
            loss = nn.functional.mse_loss(run.model(x).float(), y)
        run.backward(loss)
        run.opt.step()
        edit(run.model)
    return run.weights()


@pytest.mark.parametrize("edit", [_edit_clamp, _edit_clamp_no_grad], ids=["data-clamp", "no-grad-clamp"])
@pytest.mark.parametrize("preset", PRESETS)
def test_weight_clipping_after_the_step_is_kept(preset: str, edit: Callable[[nn.Module], None]) -> None:
    got = _train_editing(make_run(preset, mlp, lr=0.5), edit)
    ref = _train_editing(make_run(None, mlp, lr=0.5), edit)
    assert max_diff(got, ref) <= tol(preset)
    for k, v in got.items():
        if "1." not in k:  # LayerNorm (index 1) is clipped too; every exported weight obeys the clip
            assert float(v.abs().max()) <= 0.05 * (1 + 2**-8), k  # the clip value rounded to bf16 at most
    unclipped = _train_editing(make_run(None, mlp, lr=0.5), lambda m: None)
    assert max_diff(unclipped, ref) > 10 * tol(preset)


@pytest.mark.parametrize("preset", PRESETS)
def test_pruning_masks_stay_pruned(preset: str) -> None:
    def prune(model: nn.Module) -> None:
        masks = _masks(model)
        for n, p in model.named_parameters():
            if n in masks:
                p.data.mul_(masks[n].to(p.dtype))

    got = _train_editing(make_run(preset, mlp), prune)
    ref = _train_editing(make_run(None, mlp), prune)
    assert max_diff(got, ref) <= tol(preset)
    masks = _masks(mlp())
    for n, m in masks.items():
        assert bool((got[n][~m] == 0).all()), f"{n}: pruned entries came back"


def _embedding_model() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 8, max_norm=1.0), nn.Linear(8, 3))


@pytest.mark.parametrize("preset", PRESETS)
def test_embedding_max_norm_renormalisation_is_kept(preset: str) -> None:
    def train(run: Run) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(3)
        for _ in range(6):
            idx = torch.randint(0, 10, (16,), generator=g)
            y = torch.randn(16, 3, generator=g) * 4
            run.opt.zero_grad()
            with run.fwd():
                loss = nn.functional.mse_loss(run.model(idx).float(), y)
            run.backward(loss)
            run.opt.step()
        with torch.no_grad(), run.fwd():
            run.model(torch.arange(10))  # renormalise every row once more, as a last forward would
        return run.weights()

    got = train(make_run(preset, _embedding_model, lr=1.0))
    ref = train(make_run(None, _embedding_model, lr=1.0))
    norms = got["0.weight"].norm(dim=1)
    assert float(norms.max()) <= 1.0 + 1e-2, norms  # FP32 gives 1.006 at most; the bug gave 14
    assert max_diff(got, ref) <= 5 * tol(preset)


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def _parametrized() -> nn.Module:
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    torch.nn.utils.parametrize.register_parametrization(model[0], "weight", _Symmetric())
    return model


@pytest.mark.parametrize("preset", PRESETS)
def test_parametrize_trains_like_fp32(preset: str) -> None:
    got_run = make_run(preset, _parametrized)
    got = _train_clearing(got_run, "returned", True)
    ref = _train_clearing(make_run(None, _parametrized), "returned", True)
    assert max_diff(got, ref) <= tol(preset)
    w = got_run.model[0].weight.float()
    assert torch.equal(w, w.T)


# bf16-master-r16 keeps each element's low 16 bits through an edit of its weight (docs/training-loop.md):
# tests/test_master_remainder.py checks what it does instead.
@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "bf16-master-r16"])
def test_loading_weights_into_the_model_reaches_the_masters(preset: str) -> None:
    run = make_run(preset, mlp)
    _train_clearing(run, "returned", True, steps=2)
    torch.manual_seed(9)
    fresh = mlp()
    run.model.load_state_dict({k: v.to(run.model.state_dict()[k].dtype) for k, v in fresh.state_dict().items()})
    got = run.weights()
    want = {k: v.to(run.model.state_dict()[k].dtype).float() for k, v in fresh.state_dict().items()}
    assert max_diff(got, want) == 0.0


# --------------------------------------------------------------------------- 3. tied weights
def _tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return transformers.GPT2LMHeadModel(cfg)


def _train_lm(run: Run, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 64, (4, 12), generator=g)
        run.opt.zero_grad()
        with run.fwd():
            out = run.model(input_ids=ids, labels=ids)
        run.backward(out.loss.float())
        run.opt.step()


@pytest.mark.parametrize("preset", PRESETS)
def test_tied_gpt2_exports_and_converts_the_master_for_every_alias(preset: str) -> None:
    run = make_run(preset, _tiny_gpt2, lr=0.5)
    assert run.prec is not None
    _train_lm(run)
    assert run.model.transformer.wte.weight is run.model.lm_head.weight
    master = _master_of(run, run.model.transformer.wte.weight)
    exported = checkpoint.fp32_state_dict(run.prec)
    assert torch.equal(exported["transformer.wte.weight"], master)
    assert torch.equal(exported["lm_head.weight"], master)
    if preset != "bf16-pure":  # compensated runs export, they do not convert (pinned in test_misuse)
        converted = checkpoint.convert_state_dict(run.prec.state_dict(), "fp32")
        assert torch.equal(converted["model"]["lm_head.weight"], master)
        assert torch.equal(converted["model"]["transformer.wte.weight"], master)
    # an FP32 model loads it and holds the master whichever key is read last
    torch.manual_seed(1)
    fp32 = _tiny_gpt2()
    fp32.load_state_dict(exported)
    assert torch.equal(fp32.lm_head.weight, master)
    for name, p in fp32.named_parameters():
        assert torch.equal(p, exported[name].float()), name


def _master_of(run: Run, p: torch.Tensor) -> torch.Tensor:
    if isinstance(run.opt, MasterWeightOptimizer):
        return dict(zip(map(id, run.opt.model_params), run.opt.master_values()))[id(p)].float()
    return p.detach().float()


# ----------------------------------------------------------------- 4. add_param_group after prepare
def _run_with_head_group_added_after_prepare(preset: str) -> tuple[nn.Module, Any, mp.MixedPrecision]:
    """A body prepared with its optimizer, then a head added with ``add_param_group``."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": mlp(), "head": nn.Linear(3, 2)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec = mp.MixedPrecision(preset)
        model, opt = prec.prepare(model, torch.optim.SGD(model["body"].parameters(), lr=0.1))
    opt.add_param_group({"params": list(model["head"].parameters()), "lr": 0.3})
    return model, opt, prec


@pytest.mark.parametrize("preset", ["bf16-master", "bf16-master-r16", "fp16-master", "bf16-mixed"])
def test_param_group_added_after_prepare_round_trips_through_save_convert_and_export(preset: str, tmp_path) -> None:
    model, opt, prec = _run_with_head_group_added_after_prepare(preset)
    for x, y in batches(3):
        opt.zero_grad()
        with prec.autocast():
            loss = nn.functional.mse_loss(model["head"](model["body"](x)).float(), y[:, :2])
        prec.backward(loss)
        opt.step()
    sd = prec.state_dict()
    names = [n for group in sd["param_names"] for n in group]
    assert "head.weight" in names and "head.bias" in names
    exported = checkpoint.fp32_state_dict(prec)
    for n, p in model.named_parameters():
        assert torch.equal(exported[n], _master_of(Run(model, opt, opt, prec), p)), n
    # save, load into a fresh run built the same way (group added after prepare), identical weights
    checkpoint.save(sd, tmp_path / "ck.pt")
    _, _, prec2 = _run_with_head_group_added_after_prepare(preset)
    prec2.load_state_dict(checkpoint.load(tmp_path / "ck.pt"))
    assert max_diff(checkpoint.fp32_state_dict(prec2), exported) == 0.0
    # convert to another preset: the new group keeps its trained values (the bug: initial values)
    other = "bf16-master" if preset != "bf16-master" else "bf16-mixed"
    _, _, prec3 = _run_with_head_group_added_after_prepare(other)
    prec3.load_state_dict(checkpoint.convert_state_dict(sd, other))
    assert max_diff(checkpoint.fp32_state_dict(prec3), exported) == 0.0


# -------------------------------------------------------------------------------- 5. buffers
def _tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("preset", [*PRESETS, "fp16-mixed"])
def test_llama_rotary_buffers_keep_fp32(preset: str) -> None:
    run = make_run(preset, _tiny_llama)
    bufs = {n: b for n, b in run.model.named_buffers() if "inv_freq" in n}
    assert bufs, "no rotary buffer found"
    torch.manual_seed(1)
    fresh = _tiny_llama()
    want = dict(fresh.named_buffers())
    for n, b in bufs.items():
        assert b.dtype == torch.float32, (n, b.dtype)
        assert torch.equal(b, want[n]), n


@pytest.mark.parametrize("preset", PRESETS)
def test_island_buffers_stay_fp32_and_other_buffers_keep_their_dtype(preset: str) -> None:
    def build() -> nn.Module:
        m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        m.register_buffer("scale", torch.full((2,), 1.0 / 3.0))
        return m

    run = make_run(preset, build)
    bn = run.model[1]
    assert bn.running_mean.dtype == torch.float32 and bn.running_var.dtype == torch.float32
    assert run.model.scale.dtype == torch.float32 and float(run.model.scale[0]) == pytest.approx(1 / 3, rel=1e-7)


def test_buffers_follow_the_params_when_the_policy_says_so() -> None:
    model = nn.Sequential(nn.Linear(4, 2))
    model.register_buffer("scale", torch.ones(2))
    prec = mp.MixedPrecision("p=bf16,c=bf16,o=f32,m=f32,ls=none,b=param")
    model, _ = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.scale.dtype == torch.bfloat16
    assert str(prec.policy).endswith(",b=param")


# ------------------------------------------------------------------------------- 6. freezing
def _frozen_first() -> nn.Module:
    m = mlp()
    for p in m[0].parameters():
        p.requires_grad_(False)
    return m


@pytest.mark.parametrize("preset", PRESETS)
def test_freezing_before_prepare_trains_like_freezing_after(preset: str) -> None:
    before = make_run(preset, _frozen_first)
    got_before = _train_clearing(before, "returned", True)
    after = make_run(preset, mlp)
    for p in after.model[0].parameters():
        p.requires_grad_(False)
    got_after = _train_clearing(after, "returned", True)
    ref = _train_clearing(make_run(None, _frozen_first), "returned", True)
    assert max_diff(got_before, ref) <= tol(preset)
    assert max_diff(got_after, ref) <= tol(preset)
    torch.manual_seed(0)
    init = {k: v.float() for k, v in _frozen_first().state_dict().items()}
    assert torch.equal(got_before["0.weight"], init["0.weight"].to(before.model[0].weight.dtype).float())


@pytest.mark.parametrize("preset", ["bf16-master", "bf16-master-r16", "fp16-master"])
def test_unfreezing_later_warns_once_and_then_trains(preset: str, monkeypatch) -> None:
    import mixprec._master as master_mod

    monkeypatch.setattr(master_mod, "_WARNED_UNFROZEN", False)
    run = make_run(preset, _frozen_first)
    _train_clearing(run, "returned", True, steps=2)
    frozen_value = run.model[0].weight.detach().clone()
    for p in run.model[0].parameters():
        p.requires_grad_(True)
    with pytest.warns(UserWarning, match="masters start from the half-precision weights"):
        _train_clearing(run, "returned", True, steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train_clearing(run, "returned", True, steps=1)  # once only
    assert not torch.equal(run.model[0].weight, frozen_value)  # it trains now
    assert isinstance(run.opt, MasterWeightOptimizer)
    assert run.opt.master_for(run.model[0].weight).dtype == torch.float32


def test_weight_edits_versions_mode_sees_in_place_edits_but_not_data_edits() -> None:
    """The cheaper mode is documented as blind to p.data; pin both halves of that."""
    def run(edit: Callable[[nn.Module], None]) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = mlp()
        prec = mp.MixedPrecision("bf16-master", weight_edits="versions")
        model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
        return _train_editing(Run(model, opt, opt, prec), edit)

    ref = _train_editing(make_run(None, mlp, lr=0.5), _edit_clamp)
    assert max_diff(run(_edit_clamp_no_grad), ref) <= tol("bf16")
    assert max_diff(run(_edit_clamp), ref) > 10 * tol("bf16")  # .data edits are overwritten in this mode
    with pytest.raises(ValueError, match="weight_edits='value'; use 'values'"):
        mp.MixedPrecision("bf16-master", weight_edits="value")  # type: ignore[arg-type]


@pytest.mark.parametrize("preset", PRESETS)
def test_llama_export_convert_and_reload_into_fp32_equal_the_masters(preset: str) -> None:
    run = make_run(preset, _tiny_llama, lr=0.5)
    assert run.prec is not None
    _train_lm(run, steps=2)
    exported = checkpoint.fp32_state_dict(run.prec)
    masters = {n: _master_of(run, p) for n, p in run.model.named_parameters()}
    torch.manual_seed(1)
    fp32 = _tiny_llama()
    fp32.load_state_dict(exported, strict=False)  # the rotary inv_freq is not persistent in recent transformers
    for n, p in fp32.named_parameters():
        assert torch.equal(p, masters[n]), n
    for n, b in fp32.named_buffers():
        assert torch.equal(b, dict(run.model.named_buffers())[n].float()), n
    if preset != "bf16-pure":
        converted = checkpoint.convert_state_dict(run.prec.state_dict(), "fp32")
        for n, v in masters.items():
            assert torch.equal(converted["model"][n], v), n


@pytest.mark.parametrize("preset", ["bf16-master", "fp16-master"])
def test_a_half_param_group_added_after_prepare_warns_once_that_its_digits_are_gone(preset: str, monkeypatch) -> None:
    """A head that was in no optimizer at prepare() was cast without its FP32 digits: add_param_group says so (once),
    as unfreezing does, instead of silently starting its masters from the rounded weights."""
    import mixprec._master as master_mod

    monkeypatch.setattr(master_mod, "_WARNED_ADDED", False)
    with pytest.warns(UserWarning, match=r"add_param_group: 2 (bf16|f16) parameter\(s\) get FP32 masters from"):
        model, opt, _ = _run_with_head_group_added_after_prepare(preset)
    head = model["head"].weight
    assert torch.equal(_master_of(Run(model, opt, opt, None), head), head.float())  # from the rounded weight
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run_with_head_group_added_after_prepare(preset)  # once only
