"""The misuse catalogue (docs/misuse.md): each misuse raises a pinned, clear error and leaves training state intact.

Every case builds a run in a known state (fresh, trained, in the middle of a step, ...), takes a
fingerprint of everything training depends on (parameter values, dtypes and gradients, master
weights and their gradients, optimizer state, loss-scaler state and statistics, the step stage,
the user's own optimizer), commits the misuse, checks the exception type and message, and
checks the fingerprint is unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _trees import equal_tree  # tests/_trees.py
from torch import nn

import mixprec._dtypes as dtypes
import mixprec.optim as mp_optim
from mixprec._casting import is_prepared
from mixprec._checkpoint import CheckpointError, load, save
from mixprec._master import MasterWeightOptimizer
from mixprec._master_grad import is_view
from mixprec._policy import Policy
from mixprec._precision import MixedPrecision
from mixprec._scaler import DynamicScaler, ScalerStateError, StaticScaler
from mixprec.checkpoint import convert_state_dict

DOC = Path(__file__).resolve().parents[1] / "docs" / "misuse.md"


# ----- runs in known states -----------------------------------------------------------------------------
def mlp(hidden: int = 16, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, 4))


X = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
Y = X[:, :4].argmax(1)


@dataclasses.dataclass
class Ctx:
    preset: str
    model: nn.Module
    raw_opt: torch.optim.Optimizer  # what the user built
    prec: MixedPrecision
    opt: torch.optim.Optimizer | None = None  # what prepare() returned
    tmp: Path | None = None
    monkeypatch: pytest.MonkeyPatch | None = None

    def loss(self) -> torch.Tensor:
        with self.prec.autocast():
            return nn.functional.cross_entropy(self.model(X), Y)

    def other_run(self, preset: str | None = None, **kw: Any) -> Ctx:
        return trained(preset or self.preset, **kw)


def _quiet_prepare(prec: MixedPrecision, model: nn.Module, *opts: torch.optim.Optimizer) -> tuple[Any, ...]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU is slow: known
        return prec.prepare(model, *opts)


def fresh(preset: str, hidden: int = 16, seed: int = 0, scaler: Any = None, groups: bool = False) -> Ctx:
    model = mlp(hidden, seed)
    params: Any = model.parameters()
    if groups:
        params = [{"params": model[0].parameters()}, {"params": list(model[2].parameters()) + list(model[3].parameters())}]
    return Ctx(preset, model, torch.optim.AdamW(params, lr=1e-3), MixedPrecision(preset, scaler=scaler))


def trained(preset: str, steps: int = 3, **kw: Any) -> Ctx:
    ctx = fresh(preset, **kw)
    ctx.model, ctx.opt = _quiet_prepare(ctx.prec, ctx.model, ctx.raw_opt)
    for s in range(steps):
        ctx.prec.backward(ctx.loss() * (float("inf") if s == 1 else 1.0))  # one skipped step: non-trivial statistics
        ctx.prec.step(ctx.opt)
        ctx.opt.zero_grad(set_to_none=True)
    return ctx


def mid_step(preset: str) -> Ctx:
    ctx = trained(preset)
    ctx.prec.backward(ctx.loss())
    return ctx


def unscaled(preset: str) -> Ctx:
    ctx = mid_step(preset)
    ctx.prec.clip_grad_norm_(1.0)
    return ctx


def stepped(preset: str) -> Ctx:
    ctx = mid_step(preset)
    ctx.prec.step(ctx.opt)  # gradients left in place: a second step would reuse them
    return ctx


SETUPS: dict[str, Callable[[str], Ctx]] = {
    "fresh": fresh, "trained": trained, "mid_step": mid_step, "unscaled": unscaled, "stepped": stepped,
}


def _grad_copy(p: torch.Tensor) -> torch.Tensor | None:
    # A master-weight parameter's .grad is a view of its FP32 master gradient; copy that directly
    # (reading the view while the gradients still carry the loss scale raises, by design).
    if p.grad is None:
        return None
    return p.grad.master_grad().clone() if is_view(p.grad) else p.grad.clone()


def fingerprint(ctx: Ctx) -> dict[str, Any]:
    m = ctx.model
    fp: dict[str, Any] = {
        "params": [(n, p.dtype, p.requires_grad, p.detach().clone(), _grad_copy(p)) for n, p in m.named_parameters()],
        "buffers": [(n, b.dtype, b.clone()) for n, b in m.named_buffers()],
        "prepared": is_prepared(m),
        "raw_opt": copy.deepcopy(ctx.raw_opt.state_dict()),
        "raw_opt_params": [[id(p) for p in g["params"]] for g in ctx.raw_opt.param_groups],
        "raw_opt_type": type(ctx.raw_opt),
    }
    prec = ctx.prec
    if prec.model is not None:
        fp["state"] = copy.deepcopy(prec.state_dict())
        fp["stage"] = [(r.stage, r.stepped) for r in prec._records.values()]
        fp["pending_found_inf"] = len(prec._iteration_flags)
        if isinstance(ctx.opt, MasterWeightOptimizer):
            fp["master_grads"] = [None if t.grad is None else t.grad.clone() for t in ctx.opt.masters]
    else:
        fp["scaler"] = prec.scaler.state_dict()
    return fp



# ----- the misuses ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Misuse:
    id: str
    setup: str
    preset: str
    act: Callable[[Ctx], Any]
    exc: type[BaseException]
    match: str  # a fragment of the message, matched literally
    arrange: Callable[[Ctx], Any] | None = None  # what the user did before (not part of the misuse)


def _sd_with(ctx: Ctx, **changes: Any) -> dict[str, Any]:
    sd = copy.deepcopy(ctx.other_run().prec.state_dict())
    sd.update(changes)
    return sd


def _device_cannot(ctx: Ctx) -> Any:
    assert ctx.monkeypatch is not None
    ctx.monkeypatch.setattr(dtypes, "device_supports", lambda dtype, device: dtype != torch.bfloat16)
    return ctx.prec.prepare(ctx.model, ctx.raw_opt)


def _static_scaler_loads_dynamic(ctx: Ctx) -> Any:
    sd = copy.deepcopy(ctx.other_run().prec.state_dict())  # dynamic scaler state (the policy's default)
    return ctx.prec.load_state_dict(sd)


def _save_model_sd(ctx: Ctx) -> Any:
    assert ctx.tmp is not None
    return save(ctx.model.state_dict(), ctx.tmp / "ckpt.pt")


def _load_foreign_file(ctx: Ctx) -> Any:
    assert ctx.tmp is not None
    torch.save(ctx.model.state_dict(), ctx.tmp / "model.pt")
    return ctx.prec.load_state_dict(load(ctx.tmp / "model.pt"))


def _load_truncated(ctx: Ctx) -> Any:
    assert ctx.tmp is not None
    path = ctx.tmp / "ckpt.pt"
    save(ctx.prec.state_dict(), path)
    path.write_bytes(path.read_bytes()[:1000])
    return ctx.prec.load_state_dict(load(path))


MISUSES = [
    # --- call order ---
    Misuse("backward-before-prepare", "fresh", "fp16-master", lambda c: c.prec.backward(c.loss()), ValueError,
           "backward() before prepare(); call model, optimizer = prec.prepare(model, optimizer) first."),
    Misuse("step-before-prepare", "fresh", "fp16-master", lambda c: c.prec.step(c.raw_opt), ValueError,
           "step() before prepare()"),
    Misuse("state-dict-before-prepare", "fresh", "bf16-mixed", lambda c: c.prec.state_dict(), ValueError,
           "state_dict() before prepare()"),
    Misuse("load-before-prepare", "fresh", "bf16-mixed",
           lambda c: c.prec.load_state_dict(c.other_run().prec.state_dict()), ValueError, "load_state_dict() before prepare()"),
    Misuse("step-without-backward", "trained", "fp16-master", lambda c: c.prec.step(c.opt), ValueError,
           "unscale_()/clip_grad_norm_()/step() without backward() in this step: there are no new gradients."),
    Misuse("step-twice", "stepped", "fp16-master", lambda c: c.prec.step(c.opt), ValueError,
           "the gradients present did not come from prec.backward(loss) since the last step."),
    Misuse("clip-without-backward", "trained", "bf16-master", lambda c: c.prec.clip_grad_norm_(1.0), ValueError,
           "unscale_()/clip_grad_norm_()/step() without backward() in this step"),
    Misuse("backward-after-clip", "unscaled", "fp16-mixed", lambda c: c.prec.backward(c.loss()), ValueError,
           "backward() after the gradients were unscaled (by clip_grad_norm_ or unscale_) in the same step would mix "
           "scaled and unscaled gradients; call step() first, or, to skip this batch, clear the gradients "
           "(optimizer.zero_grad()) before the next backward."),
    Misuse("plain-loss-backward", "trained", "fp16-mixed", lambda c: c.prec.step(c.opt), ValueError,
           "Call prec.backward(loss) instead of loss.backward() (it scales the loss when the policy needs it)",
           arrange=lambda c: c.loss().backward()),
    # --- prepare ---
    Misuse("prepare-twice", "trained", "bf16-mixed", lambda c: c.prec.prepare(c.model, c.opt), ValueError,
           "prepare() was already called on this MixedPrecision object; create a new MixedPrecision for another model."),
    Misuse("prepare-prepared-model", "trained", "bf16-mixed",
           lambda c: MixedPrecision("bf16-master").prepare(c.model, torch.optim.SGD(c.model.parameters(), lr=0.1)),
           ValueError, "this model was already prepared by another MixedPrecision (or cast_module)"),
    Misuse("prepare-nested-run", "trained", "bf16-mixed",
           lambda c: MixedPrecision("bf16-master").prepare(
               outer := nn.Sequential(c.model, nn.Linear(2, 2)), torch.optim.SGD(outer[1].parameters(), lr=0.1)),
           ValueError, "of this model was already prepared by another MixedPrecision"),
    Misuse("prepare-without-optimizer", "fresh", "fp16-master", lambda c: c.prec.prepare(c.model), ValueError,
           "prepare(model) needs the optimizer(s) too: prepare(model, optimizer)."),
    Misuse("prepare-not-a-module", "fresh", "bf16-mixed", lambda c: c.prec.prepare(list(c.model.parameters()), c.raw_opt),
           TypeError, "prepare(model, optimizer): model must be an nn.Module, got list"),
    Misuse("prepare-not-an-optimizer", "fresh", "bf16-mixed", lambda c: c.prec.prepare(c.model, list(c.model.parameters())),
           TypeError, "optimizer 0 must be a torch.optim.Optimizer, got list"),
    Misuse("prepare-wrapped-optimizer", "fresh", "fp16-master",
           lambda c: c.prec.prepare(c.model, MasterWeightOptimizer(torch.optim.SGD(mlp(seed=1).parameters(), lr=0.1))),
           TypeError, "optimizer 0 is already a MasterWeightOptimizer; pass the plain torch optimizer"),
    Misuse("optimizer-of-another-model", "fresh", "fp16-master",
           lambda c: c.prec.prepare(c.model, torch.optim.SGD(mlp(seed=1).parameters(), lr=0.1)), ValueError,
           "optimizer 0 holds 6 tensor(s) that are not parameters of this model"),
    Misuse("same-optimizer-twice", "fresh", "fp16-master", lambda c: c.prec.prepare(c.model, c.raw_opt, c.raw_opt),
           ValueError, "optimizer 1 is the same object as optimizer 0; pass each optimizer to prepare() once."),
    Misuse("overlapping-optimizers", "fresh", "fp16-mixed",
           lambda c: c.prec.prepare(c.model, c.raw_opt, torch.optim.SGD(c.model[3].parameters(), lr=0.1)), ValueError,
           "is in optimizer 0 and optimizer 1; mixprec needs each parameter in exactly one optimizer"),
    Misuse("compensated-policy-other-optimizer", "fresh", "bf16-pure",
           lambda c: c.prec.prepare(c.model, torch.optim.RMSprop(c.model.parameters())), TypeError,
           "needs mixprec.optim.AdamW or mixprec.optim.SGD (or a torch AdamW/Adam/SGD, converted for you); got RMSprop"),
    Misuse("compensated-policy-sparse-gradients", "fresh", "bf16-pure",
           lambda c: (lambda m: c.prec.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1)))(
               nn.Sequential(nn.Embedding(10, 8, sparse=True), c.model)), ValueError,
           "has sparse=True, so its weight gets sparse gradients; policy 'bf16-pure' steps it with a mixprec.optim"),
    Misuse("closure-optimizer", "fresh", "bf16-master",
           lambda c: c.prec.prepare(c.model, torch.optim.LBFGS(c.model.parameters())), ValueError,
           "optimizer 0 (LBFGS) needs a closure at every step (it re-evaluates the model inside its step"),
    Misuse("batchnorm-outside-islands", "fresh", "bf16-master",
           lambda c: (lambda m: MixedPrecision("p=bf16,c=bf16,o=f32,m=f32,i=none").prepare(
               m, torch.optim.SGD(m.parameters(), lr=0.1)))(nn.Sequential(c.model, nn.BatchNorm1d(4))), ValueError,
           "casts BatchNorm '1' (BatchNorm1d) to bf16 but keeps its FP32 running statistics (b=keep)"),
    Misuse("lazy-parameters", "fresh", "bf16-master",
           lambda c: (lambda m: c.prec.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1)))(
               nn.Sequential(nn.LazyLinear(8), c.model)), ValueError,
           "the model has 2 uninitialised lazy parameter(s) (first: '0.weight', from a Lazy* module), which policy "
           "'bf16-master' must cast and copy before they have a shape"),
    Misuse("compensation-mismatch", "fresh", "bf16-pure",
           lambda c: c.prec.prepare(c.model, mp_optim.AdamW(c.model.parameters(), compensation="stochastic")), ValueError,
           "optimizer 0 uses compensation='stochastic' but the policy says comp=kahan"),
    # --- the wrong optimizer at step time ---
    Misuse("step-with-unwrapped-optimizer", "mid_step", "fp16-master", lambda c: c.prec.step(c.raw_opt), ValueError,
           "You passed the optimizer you gave prepare(); use the one prepare() returned (it holds the masters)."),
    Misuse("plateau-in-schedulers", "mid_step", "fp16-master",
           lambda c: c.prec.step(c.opt, schedulers=[torch.optim.lr_scheduler.ReduceLROnPlateau(c.opt)]), TypeError,
           "step(schedulers=...): scheduler 0 is a ReduceLROnPlateau, whose step needs the metric it watches"),
    Misuse("step-with-foreign-optimizer", "mid_step", "bf16-mixed", lambda c: c.prec.step(c.other_run().opt),
           ValueError, "step(): this optimizer was not returned by prepare()."),
    # --- dtype surprises ---
    Misuse("half-model-under-mixed-policy", "fresh", "bf16-mixed", lambda c: c.prec.prepare(c.model, c.raw_opt),
           ValueError, "the model has bf16 parameters but policy 'bf16-mixed' keeps parameters in FP32 (they are the "
           "masters); call model.float() before prepare()", arrange=lambda c: c.model.to(torch.bfloat16)),
    Misuse("island-matches-nothing", "fresh", "bf16-mixed",
           lambda c: MixedPrecision("p=f32,c=bf16,i=LayerNrom").prepare(c.model, c.raw_opt), ValueError,
           "FP32 island 'LayerNrom' of policy 'p=f32,c=bf16,o=f32,m=none,ls=none,i=LayerNrom,tf32=0,comp=none' matches "
           "no module of the model, so nothing would stay in FP32 for it"),
    Misuse("float64-model", "fresh", "fp16-mixed", lambda c: c.prec.prepare(c.model, c.raw_opt), ValueError,
           "trainable parameters are all float64 (first: '0.weight'), which policy 'fp16-mixed' would leave in float64",
           arrange=lambda c: c.model.double()),
    Misuse("create-graph-fp32-accumulation", "trained", "bf16-master",
           lambda c: c.prec.backward(c.loss(), create_graph=True), ValueError,
           "backward(create_graph=True) under FP32 master weights with grad_accumulation='fp32'"),
    Misuse("integer-loss", "trained", "bf16-mixed", lambda c: c.prec.backward(Y.sum()), ValueError,
           "backward(loss) needs a scalar floating loss, got shape () torch.int64"),
    Misuse("non-scalar-loss", "trained", "fp16-master",
           lambda c: c.prec.backward(nn.functional.cross_entropy(c.model(X), Y, reduction="none")), ValueError,
           "backward(loss) needs a scalar floating loss, got shape (16,) torch.float32; reduce it (e.g. loss.mean()) first."),
    Misuse("python-number-loss", "trained", "bf16-mixed", lambda c: c.prec.backward(c.loss().item()), TypeError,
           "backward(loss) needs a tensor, got float"),
    Misuse("loss-without-graph", "trained", "fp16-mixed", lambda c: c.prec.backward(c.loss().detach()), ValueError,
           "the loss does not require grad (computed under torch.no_grad(), or from detached tensors?)."),
    Misuse("half-params-compute-other-half", "fresh", "fp32", lambda c: MixedPrecision("p=f16,c=bf16"), ValueError,
           "half-precision parameters compute in their own dtype, but p=f16 and c=bf16"),
    Misuse("float8-compute", "fresh", "fp32", lambda c: Policy.parse("p=f32,c=e4m3"), ValueError,
           "c=f8e4m3 is not supported in policy"),
    Misuse("preset-typo", "fresh", "fp32", lambda c: MixedPrecision("bf16-mixd"), ValueError,
           "unknown precision preset 'bf16-mixd'; choose one of: fp32, tf32, fp16-mixed, bf16-mixed"),
    # --- a policy the device cannot run ---
    Misuse("device-cannot-run-policy", "fresh", "bf16-mixed", _device_cannot, ValueError,
           "cannot compute in bf16; use an fp16 preset ('fp16-mixed' or 'fp16-master') on this GPU, or 'fp32'."),
    # --- foreign state dicts ---
    Misuse("load-optimizer-state-dict", "trained", "bf16-mixed", lambda c: c.prec.load_state_dict(c.raw_opt.state_dict()),
           ValueError, "It looks like a plain optimizer state dict; mixprec checkpoints come from MixedPrecision.state_dict()."),
    Misuse("load-model-state-dict", "trained", "fp16-master", lambda c: c.prec.load_state_dict(c.model.state_dict()),
           ValueError, "It looks like a model state dict; load it with prec.load_model_state_dict(sd)."),
    Misuse("load-other-policy", "trained", "bf16-master",
           lambda c: c.prec.load_state_dict(c.other_run("fp16-master").prec.state_dict()), ValueError,
           "convert it explicitly with mixprec.checkpoint.convert_state_dict(state, 'bf16-master') before loading"),
    Misuse("load-other-model", "trained", "fp16-master",
           lambda c: c.prec.load_state_dict(c.other_run(hidden=32).prec.state_dict()), ValueError,
           "the checkpoint's '0.weight' has shape (32, 8), the model's (16, 8)."),
    Misuse("load-other-optimizer-count", "trained", "bf16-mixed",
           lambda c: c.prec.load_state_dict(_sd_with(c, optimizers=[*c.prec.state_dict()["optimizers"]] * 2)), ValueError,
           "the checkpoint has 2 optimizer(s), this run 1."),
    Misuse("load-other-param-groups", "trained", "bf16-mixed",
           lambda c: c.prec.load_state_dict(trained("bf16-mixed", seed=1).prec.state_dict()), ValueError,
           "the checkpoint's optimizer 0 has param groups of sizes [6], this run's [2, 4]"),
    Misuse("load-newer-version", "trained", "fp16-master", lambda c: c.prec.load_state_dict(_sd_with(c, version=99)),
           ValueError, "mixprec state version 99; this mixprec reads versions [1, 2] (upgrade mixprec?)."),
    Misuse("load-other-scaler-kind", "trained", "fp16-mixed", _static_scaler_loads_dynamic, ScalerStateError,
           "StaticScaler: this state dict is from a DynamicScaler or GradScaler (kind='dynamic'), not a 'static' scaler"),
    Misuse("scaler-loads-disabled-gradscaler", "trained", "fp16-master", lambda c: c.prec.scaler.load_state_dict({}),
           ScalerStateError, "DynamicScaler.load_state_dict got an empty dict: it was probably saved from a disabled scaler"),
    Misuse("masters-load-plain-optimizer-state", "trained", "bf16-master",
           lambda c: c.opt.load_state_dict(c.raw_opt.state_dict()), ValueError,  # type: ignore[union-attr]
           "not a MasterWeightOptimizer state dict (keys: ['param_groups', 'state'])"),
    Misuse("load-model-state-dict-wrong-keys", "trained", "fp16-master",
           lambda c: c.prec.load_model_state_dict({**mlp(seed=1).state_dict(), "extra": torch.zeros(1)}), ValueError,
           "load_model_state_dict: the state dict does not match the model: missing [], unexpected ['extra']; nothing was loaded."),
    Misuse("load-model-state-dict-wrong-shape", "trained", "bf16-mixed",
           lambda c: c.prec.load_model_state_dict(mlp(hidden=32).state_dict()), ValueError,
           "load_model_state_dict: '0.weight' has shape (32, 8) in the state dict but (16, 8) in the model"),
    Misuse("convert-to-compensated", "trained", "fp16-master",
           lambda c: convert_state_dict(c.prec.state_dict(), "bf16-pure"), ValueError,
           "cannot convert: the target policy 'bf16-pure' uses compensated updates"),
    # --- constructor arguments ---
    Misuse("torch-gradscaler-as-scaler", "fresh", "fp16-mixed",
           lambda c: MixedPrecision("fp16-mixed", scaler=torch.amp.GradScaler("cpu")), TypeError,
           "scaler must implement mixprec.LossScaler, got GradScaler"),
    Misuse("grad-accumulation-dtype", "fresh", "fp16-master",
           lambda c: MixedPrecision("fp16-master", grad_accumulation="bf16"), ValueError,  # type: ignore[arg-type]
           "grad_accumulation='bf16'; use 'fp32' (default) or 'compute'."),
    Misuse("backoff-above-one", "fresh", "fp16-mixed", lambda c: DynamicScaler(backoff_factor=2.0), ValueError,
           "DynamicScaler: backoff_factor must be > 0 and < 1, got 2.0."),
    Misuse("escalation-without-floor", "fresh", "fp16-mixed",
           lambda c: DynamicScaler(min_scale=None, on_failure="raise"), ValueError,
           "DynamicScaler: on_failure='raise' needs a floor (min_scale)"),
    # --- checkpoint files ---
    Misuse("save-a-model-state-dict", "trained", "bf16-mixed", _save_model_sd, ValueError,
           "It looks like a model state dict; load it with prec.load_model_state_dict(sd)."),
    Misuse("load-a-foreign-file", "trained", "bf16-mixed", _load_foreign_file, CheckpointError,
           "is not a mixprec checkpoint: it holds a model state dict"),
    Misuse("load-a-truncated-file", "trained", "fp16-master", _load_truncated, CheckpointError,
           "it is a PyTorch (zip) file but truncated or corrupted"),
]


def _setup(case: Misuse, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ctx:
    if case.id == "load-other-scaler-kind":
        ctx = trained(case.preset, scaler=StaticScaler(128.0))
    elif case.id == "load-other-param-groups":
        ctx = trained(case.preset, groups=True)
    else:
        ctx = SETUPS[case.setup](case.preset)
    ctx.tmp, ctx.monkeypatch = tmp_path, monkeypatch
    if case.arrange is not None:
        case.arrange(ctx)
    return ctx


@pytest.mark.parametrize("case", MISUSES, ids=[c.id for c in MISUSES])
def test_misuse_raises_a_pinned_error_and_changes_nothing(case, tmp_path, monkeypatch):
    ctx = _setup(case, tmp_path, monkeypatch)
    before = fingerprint(ctx)
    with pytest.raises(case.exc, match=re.escape(case.match)):
        case.act(ctx)
    monkeypatch.undo()
    after = fingerprint(ctx)
    assert before.keys() == after.keys()
    changed = [k for k in before if not equal_tree(before[k], after[k])]
    assert changed == [], f"{case.id} changed {changed}"


def test_fingerprint_sees_a_change():
    """The check can fail: a "misuse" that nudges one master weight before raising is caught."""
    ctx = trained("fp16-master")
    before = fingerprint(ctx)
    with torch.no_grad():
        ctx.opt.masters[0].view(-1)[0] += 2.0**-20  # type: ignore[union-attr]
    after = fingerprint(ctx)
    assert [k for k in before if not equal_tree(before[k], after[k])] == ["state"]


def test_catalogue_is_large_and_unique():
    ids = [c.id for c in MISUSES]
    assert len(ids) == len(set(ids)) >= 20


def test_run_still_trains_after_every_kind_of_in_run_misuse():
    """A run that hit errors mid-step finishes the step and trains on, bit-identical to a run that never erred."""
    ctx = trained("fp16-master")
    ref = trained("fp16-master")
    for c in (ctx, ref):
        c.prec.backward(c.loss())
        c.prec.clip_grad_norm_(1.0)
    for bad in (lambda: ctx.prec.backward(ctx.loss()), lambda: ctx.prec.step(ctx.raw_opt),
                lambda: ctx.prec.load_state_dict(ctx.model.state_dict())):
        with pytest.raises(ValueError):
            bad()
    for c in (ctx, ref):
        c.prec.step(c.opt)
        c.opt.zero_grad()
    assert equal_tree(ctx.prec.state_dict(), ref.prec.state_dict())


def test_docs_table_lists_every_misuse():
    text = DOC.read_text()
    missing = [c.id for c in MISUSES if f"`{c.id}`" not in text]
    assert missing == []
    unworded = [c.id for c in MISUSES if c.match not in text]
    assert unworded == []
