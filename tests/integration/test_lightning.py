"""mixprec.integrations.lightning: the Trainer and Fabric plugins give mixprec's own loop, bit for bit."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning")

import mixprec as mp  # noqa: E402
from mixprec.integrations.lightning import MixprecFabricPrecision, MixprecPrecision  # noqa: E402

POLICIES = ["bf16-mixed", "bf16-master", "fp16-mixed", "bf16-pure"]
# The plugins make the same calls in the same order as the reference loop, so the results are
# identical; the table is what "equal" may mean per parameter dtype if a kernel ever reorders.
TOL = {torch.float32: 0.0, torch.bfloat16: 0.0, torch.float16: 0.0}
STEPS, BATCH, LR, GAMMA = 6, 4, 1e-2, 0.5
TRAINER_KW = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)


pytestmark = [
    pytest.mark.filterwarnings("ignore:fp16 on CPU works"),  # mixprec's note: fp16 CPU kernels are slow
    pytest.mark.filterwarnings("ignore::UserWarning:lightning.*"),  # num_workers, ... hints
    pytest.mark.filterwarnings("ignore:.*LeafSpec"),  # lightning 2.6.6 on torch 2.13
]


def data(n: int = STEPS * BATCH) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))


def make_opt(net: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)


def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int, inf_at: int | None) -> torch.Tensor:
    loss = nn.functional.mse_loss(net(x), y)
    return loss * float("inf") if step == inf_at else loss


def reference(policy: str, clip: float | None = None, inf_at: int | None = None, steps: int = STEPS):
    """mixprec's own loop: the losses, pre-clip norms, final state and the scheduler's LR."""
    net = make_net()
    opt, sched = make_opt(net)
    prec = mp.MixedPrecision(policy)
    net, opt = prec.prepare(net, opt)
    losses, norms = [], []
    for i, (x, y) in enumerate(DataLoader(data(), batch_size=BATCH)):
        if i == steps:
            break
        with prec.autocast():
            loss = loss_of(net, x, y, i, inf_at)
        losses.append(loss.detach().float())
        prec.backward(loss)
        if clip is not None:
            norms.append(prec.clip_grad_norm_(clip))
        prec.step(opt, schedulers=[sched])
        opt.zero_grad(set_to_none=True)
    return {"losses": torch.stack(losses), "norms": norms, "params": [p.detach().clone() for p in net.parameters()],
            "lr": opt.param_groups[0]["lr"], "prec": prec}


class Module(L.LightningModule):
    def __init__(self, inf_at: int | None = None, manual: bool = False, clip: float | None = None,
                 interval: str | None = "step") -> None:
        super().__init__()
        self.net = make_net()
        self.inf_at, self.clip, self.interval = inf_at, clip, interval
        self.automatic_optimization = not manual
        self.losses: list[torch.Tensor] = []
        self.norms: list[torch.Tensor] = []
        self.after_clip: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_of(self.net, x, y, batch_idx, self.inf_at)
        self.losses.append(loss.detach().float())
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        self.manual_backward(loss)
        if self.clip is not None:
            self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt.step()
        self.lr_schedulers().step()  # manual optimization steps the scheduler itself: skip-aware too
        return None

    def validation_step(self, batch, batch_idx):
        self.val_autocast = torch.is_autocast_enabled("cpu")  # forward_context is prec.autocast() here too
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # what the step will use: the optimizer's param_groups (the FP32 masters under *-master)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.norms.append(torch.nn.utils.get_total_norm(grads))  # as torch's clip_grad_norm_ computes it
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.after_clip.append(torch.nn.utils.get_total_norm(grads))

    def configure_optimizers(self):
        opt, sched = make_opt(self.net)
        if self.interval is None:
            return [opt], [sched]  # the list form: Lightning's interval="epoch"
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval}}


def fit(policy: str, *, max_steps: int = STEPS, ckpt_path=None, n: int = STEPS * BATCH, accumulate: int = 1,
        callbacks=None, **module_kw):
    module = Module(**module_kw)
    plugin = MixprecPrecision(policy)
    clip = module_kw.get("clip")
    kw = dict(TRAINER_KW)
    if callbacks:
        kw.update(callbacks=callbacks, enable_checkpointing=True)
    trainer = L.Trainer(max_steps=max_steps, plugins=[plugin], **kw, accumulate_grad_batches=accumulate,
                        gradient_clip_val=clip if not module_kw.get("manual") else None)
    trainer.fit(module, DataLoader(data(n), batch_size=BATCH), ckpt_path=ckpt_path)
    return module, plugin, trainer


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        tol = TOL[a.dtype]
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_trainer_equals_mixprec_loop(policy):
    ref = reference(policy, clip=0.5)
    module, plugin, trainer = fit(policy, clip=0.5)
    assert plugin.prec.model is module and trainer.precision == plugin.precision
    assert_same([torch.stack(module.losses)], [ref["losses"]])
    assert_same(list(module.net.parameters()), ref["params"])
    # gradient_clip_val clipped the true (unscaled, FP32-master) gradients: the norm mixprec computes
    assert_same(module.norms, ref["norms"])
    rtol = 1e-2 if policy == "bf16-pure" else 1e-5  # bf16-pure clips BF16 gradients: the result is rounded to BF16
    for before, after in zip(module.norms, module.after_clip, strict=True):
        if torch.isfinite(before):
            torch.testing.assert_close(after, torch.clamp(before, max=0.5), rtol=rtol, atol=0)
    assert trainer.optimizers[0].param_groups[0]["lr"] == ref["lr"]


@pytest.mark.parametrize("policy", POLICIES)
def test_fabric_equals_mixprec_loop(policy):
    ref = reference(policy, clip=0.5)
    plugin = MixprecFabricPrecision(policy)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = make_net()
    opt, sched = make_opt(net)
    model, opt, sched = plugin.setup(fabric, net, opt, scheduler=sched)
    losses = []
    for x, y in fabric.setup_dataloaders(DataLoader(data(), batch_size=BATCH)):
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(loss.detach().float())
        fabric.backward(loss)
        norm = fabric.clip_gradients(model, opt, max_norm=0.5, error_if_nonfinite=False)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        assert norm is not None
    assert_same([torch.stack(losses)], [ref["losses"]])
    assert_same(list(net.parameters()), ref["params"])
    assert opt.param_groups[0]["lr"] == ref["lr"]


def test_fabric_setup_without_the_plugin_raises():
    plugin = MixprecFabricPrecision("bf16-master")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = make_net()
    with pytest.raises(ValueError, match=re.escape("model, optimizer = plugin.setup(fabric, model, optimizer)")):
        fabric.setup(net, make_opt(net)[0])


@pytest.mark.parametrize("policy", ["bf16-master", "fp16-mixed"])
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_planted_inf_is_skipped_and_the_scheduler_holds(policy, manual):
    ref = reference(policy, inf_at=2)
    module, plugin, trainer = fit(policy, inf_at=2, manual=manual)
    assert_same(list(module.net.parameters()), ref["params"])
    applied = int(ref["prec"].last_step.applied_steps)
    assert int(plugin.last_step.applied_steps) == applied < STEPS  # the planted step (and fp16's first) skipped
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == applied  # the scheduler counts applied steps only
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * GAMMA**applied, rel=0, abs=0)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR) and "step" not in vars(sched)


def test_planted_inf_leaves_the_weights_bit_identical():
    class Probe(Module):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.snapshots = [*getattr(self, "snapshots", []), [p.detach().clone() for p in self.net.parameters()]]

    module = Probe(inf_at=2)
    trainer = L.Trainer(max_steps=4, plugins=[MixprecPrecision("bf16-master")], **TRAINER_KW)
    trainer.fit(module, DataLoader(data(), batch_size=BATCH))
    assert_same(module.snapshots[2], module.snapshots[1])
    assert not all(torch.equal(a, b) for a, b in zip(module.snapshots[3], module.snapshots[2]))


@pytest.mark.parametrize("policy", ["bf16-master", "fp16-mixed"])
def test_checkpoint_resumes_bit_for_bit(policy, tmp_path):
    # One batch per epoch: Lightning itself resumes a plain DataLoader exactly only then (with several
    # batches per epoch its own FP32 run repeats a batch after ckpt_path=; checked with lightning 2.6.6).
    n = BATCH
    full, full_plugin, _ = fit(policy, n=n)
    _, _, first = fit(policy, max_steps=STEPS // 2, n=n)
    path = tmp_path / "half.ckpt"
    first.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=False)
    assert "MixprecPrecision" in ckpt  # the scaler, masters and step count are in Lightning's checkpoint
    resumed, resumed_plugin, _ = fit(policy, ckpt_path=path, n=n)
    assert_same(list(resumed.net.parameters()), list(full.net.parameters()))
    assert resumed_plugin.prec.scaler.state_dict().keys() == full_plugin.prec.scaler.state_dict().keys()
    assert float(resumed_plugin.prec.scaler.loss_scale) == float(full_plugin.prec.scaler.loss_scale)
    assert int(resumed_plugin.last_step.applied_steps) == int(full_plugin.last_step.applied_steps)
    masters = [o.state_dict() for o in full_plugin.prec.optimizers]
    again = [o.state_dict() for o in resumed_plugin.prec.optimizers]
    for a, b in zip(masters, again, strict=True):
        if policy.endswith("-master"):  # the FP32 masters (None: a LayerNorm parameter that is its own master)
            assert [m is None for m in a["masters"]] == [m is None for m in b["masters"]]
            assert sum(m is not None for m in a["masters"]) == 4
            assert_same([m for m in b["masters"] if m is not None], [m for m in a["masters"] if m is not None])


@pytest.mark.parametrize("policy", ["bf16-master", "fp16-mixed"])
def test_a_checkpoint_written_during_fit_resumes_bit_for_bit(policy, tmp_path):
    """ModelCheckpoint(every_n_train_steps=...) at an epoch's end (epochs of several batches): the resumed run equals
    the uninterrupted one (docs/integrations.md says which resume is exact: this one)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    n = STEPS // 2 * BATCH  # two epochs of three batches
    full, full_plugin, _ = fit(policy, n=n)
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=STEPS // 2, save_top_k=-1, filename="{step}")
    fit(policy, callbacks=[every], n=n)
    half = tmp_path / f"step={STEPS // 2}.ckpt"
    assert half.exists(), sorted(p.name for p in tmp_path.iterdir())
    resumed, resumed_plugin, _ = fit(policy, ckpt_path=half, n=n)
    assert_same(list(resumed.net.parameters()), list(full.net.parameters()))
    assert float(resumed_plugin.prec.scaler.loss_scale) == float(full_plugin.prec.scaler.loss_scale)
    assert int(resumed_plugin.last_step.applied_steps) == int(full_plugin.last_step.applied_steps)


def test_unsupported_strategies_raise():
    msg = re.escape("mixprec's Lightning plugin supports SingleDeviceStrategy")
    plugin = MixprecPrecision("bf16-master")
    trainer = L.Trainer(strategy="ddp", plugins=[plugin], **TRAINER_KW)
    module = Module()
    module.trainer = trainer
    with pytest.raises(ValueError, match=msg):
        plugin.convert_module(module)  # the hook Trainer.fit calls first in strategy.setup
    fplugin = MixprecFabricPrecision("bf16-master")
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="ddp", plugins=[fplugin])
    net = make_net()
    with pytest.raises(ValueError, match=msg):
        fplugin.setup(fabric, net, make_opt(net)[0])
    assert fplugin.prec.model is None  # nothing was prepared


def test_policy_or_mixedprecision():
    prec = mp.MixedPrecision("fp16-mixed")
    assert MixprecPrecision(prec).prec is prec and MixprecPrecision(prec).precision == "16-mixed"
    assert MixprecPrecision("bf16-master").precision == "bf16-true"
    with pytest.raises(TypeError, match="not both"):
        MixprecPrecision(prec, scale_update="manual")


def test_a_second_fit_on_the_same_plugin_raises():
    module, plugin, trainer = fit("bf16-mixed", max_steps=2)
    trainer2 = L.Trainer(max_steps=2, plugins=[plugin], **TRAINER_KW)
    with pytest.raises(ValueError, match=re.escape("use a new MixprecPrecision for each fit")):
        trainer2.fit(Module(), DataLoader(data(), batch_size=BATCH))
    trainer.validate(module, DataLoader(data(), batch_size=BATCH), verbose=False)  # evaluation needs no optimizer
    assert module.val_autocast


@pytest.mark.parametrize("policy", ["bf16-master", "fp16-mixed"])
def test_fabric_save_load_resumes_bit_for_bit(policy, tmp_path):
    def run(steps: int, load: bool = False):
        plugin = MixprecFabricPrecision(policy)
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        net = make_net()
        opt, sched = make_opt(net)
        model, opt, sched = plugin.setup(fabric, net, opt, scheduler=sched)
        state = {"mixprec": plugin, "scheduler": sched}
        batches = list(DataLoader(data(), batch_size=BATCH))
        start = 0
        if load:
            fabric.load(tmp_path / "run.pt", state)
            start = STEPS // 2
        for x, y in batches[start:steps]:
            fabric.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return net, plugin, sched, fabric, state

    full_net, full_plugin, full_sched, _, _ = run(STEPS)
    _, _, _, fabric, state = run(STEPS // 2)
    fabric.save(tmp_path / "run.pt", state)
    net, plugin, sched, _, _ = run(STEPS, load=True)
    assert_same(list(net.parameters()), list(full_net.parameters()))
    assert float(plugin.prec.scaler.loss_scale) == float(full_plugin.prec.scaler.loss_scale)
    assert sched.last_epoch == full_sched.last_epoch == int(full_plugin.last_step.applied_steps)


def test_gradient_accumulation_equals_mixprec_loop():
    module, plugin, trainer = fit("fp16-mixed", max_steps=STEPS // 2, accumulate=2)
    net = make_net()
    opt, sched = make_opt(net)
    prec = mp.MixedPrecision("fp16-mixed")
    net, opt = prec.prepare(net, opt)
    for i, (x, y) in enumerate(DataLoader(data(), batch_size=BATCH)):
        with prec.autocast():
            loss = nn.functional.mse_loss(net(x), y) / 2  # Lightning divides by accumulate_grad_batches
        prec.backward(loss)
        if i % 2 == 1:
            prec.step(opt, schedulers=[sched])
            opt.zero_grad(set_to_none=True)
    assert_same(list(module.net.parameters()), list(net.parameters()))
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == int(prec.last_step.applied_steps)


def test_a_lightning_precision_flag_with_the_plugin_is_refused():
    with pytest.raises(ValueError, match="Choose one"):  # Lightning's own check: never combined silently
        L.Trainer(precision="bf16-mixed", plugins=[MixprecPrecision("bf16-master")], **TRAINER_KW)


def test_fabric_clip_gradients_with_fabric_defaults_skips_an_overflow_instead_of_raising():
    """fabric.clip_gradients(model, opt, max_norm=...) with Fabric's default error_if_nonfinite=True: an inf/NaN
    step under fp16-mixed is skipped (scale backed off), as mixprec's own loop does; later steps apply."""
    ref = reference("fp16-mixed", clip=0.5, inf_at=2)
    plugin = MixprecFabricPrecision("fp16-mixed")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = make_net()
    opt, sched = make_opt(net)
    model, opt, sched = plugin.setup(fabric, net, opt, scheduler=sched)
    skipped = []
    for i, (x, y) in enumerate(fabric.setup_dataloaders(DataLoader(data(), batch_size=BATCH))):
        loss = loss_of(model, x, y, i, inf_at=2)
        fabric.backward(loss)
        norm = fabric.clip_gradients(model, opt, max_norm=0.5)  # Fabric's defaults
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        skipped.append(not bool(torch.isfinite(norm)))
    # the natural overflows of the first steps (the scale starts at 2**16) and the planted one, as mixprec's own loop
    assert skipped == [not bool(torch.isfinite(n)) for n in ref["norms"]] and skipped[2] and not skipped[-1]
    assert_same(list(net.parameters()), ref["params"])  # exactly mixprec's own loop with the same clipping
    assert opt.param_groups[0]["lr"] == ref["lr"]  # the scheduler did not advance on the skipped step


@pytest.mark.parametrize("policy", ["bf16-master", "fp16-mixed"])
def test_manual_optimization_clips_through_self_optimizers(policy):
    """Lightning's documented manual loop: self.clip_gradients(self.optimizers(), ...) (a LightningOptimizer) clips
    through prec; a scheduler of the list return (interval "epoch") stepped per batch by hand is not gated (an epoch
    scheduler would lose steps): declare interval "step" for that."""
    ref = reference(policy, clip=0.5, inf_at=2)
    module, plugin, trainer = fit(policy, inf_at=2, manual=True, clip=0.5, interval=None)
    applied = int(ref["prec"].last_step.applied_steps)
    assert int(plugin.last_step.applied_steps) == applied < STEPS
    assert all(torch.isfinite(p).all() for p in module.net.parameters())
    assert trainer.lr_scheduler_configs[0].interval == "epoch"
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == STEPS  # stepped by hand every batch, not gated


class _Gan(L.LightningModule):
    """Lightning's documented GAN loop: the generator steps with the discriminator toggled off."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.g, self.d = nn.Linear(8, 8), nn.Linear(8, 1)
        self.seen: list[tuple[bool, bool]] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_g)
        self.manual_backward(-self.d(self.g(x)).float().mean())
        self.seen.append((self.d.weight.requires_grad, self.d.weight.grad is not None))
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        self.manual_backward(self.d(self.g(x).detach()).float().mean())
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        return torch.optim.SGD(self.g.parameters(), lr=0.1), torch.optim.SGD(self.d.parameters(), lr=0.1)


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-master"])
def test_toggle_optimizer_freezes_the_other_models_parameters(policy):
    """Under master weights the optimizers' param_groups hold the FP32 masters: Lightning's toggle_optimizer froze
    those, so the discriminator stayed trainable and stepped with the generator loss's gradient. Both toggles now act
    on the model's parameters, as under Lightning's own precision."""
    module = _Gan()
    data = DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4)
    L.Trainer(max_steps=2, plugins=[MixprecPrecision(policy)], **TRAINER_KW).fit(module, data)
    assert module.seen and all(s == (False, False) for s in module.seen), module.seen
    assert all(p.requires_grad for p in module.parameters())  # untoggled again


class _StepThenForward(L.LightningModule):
    """Manual optimization that runs a forward after its step inside one training_step (a GAN's D then G)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = nn.Linear(16, 1)
        self.seen: list[tuple[float, float]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        loss = ((self.net(x).float() - y) ** 2).mean()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        after = ((self.net(x).float() - y) ** 2).mean()
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            true = ((x @ self.net.weight.float().t() + self.net.bias.float() - y) ** 2).mean()
        self.seen.append((after.item(), true.item()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-master"])
def test_a_forward_after_a_manual_step_in_the_same_training_step_sees_the_new_weights(policy):
    """The training_step's autocast region cached the half copies of the FP32 weights: under *-mixed the forward after
    opt.step() ran on the old ones (a GAN's generator step through the discriminator it had just stepped)."""
    module = _StepThenForward()
    data = TensorDataset(torch.randn(32, 16), torch.randn(32, 1))
    L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False,
              plugins=[MixprecPrecision(policy)]).fit(module, DataLoader(data, batch_size=32))
    after, true = module.seen[0]
    assert abs(after - true) < 2e-3 * abs(true)  # bf16 compute of the stepped weights (the stale ones: ~30% off)
