"""``mixprec.integrations.transformers``: a real ``transformers.Trainer`` on a tiny GPT-2 built from a config.

What is pinned: the Trainer's losses, logged ``grad_norm`` and learning rates equal mixprec's own loop
(``_hf_common.reference_run``) under every preset family; a planted inf/NaN step is skipped, the LR
scheduler does not advance on it and nothing warns; the logged ``grad_norm`` is the true unscaled norm;
``resume_from_checkpoint`` continues bit for bit (losses, masters, loss scale); Trainer's own
``fp16``/``bf16`` flags are refused with the policy.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from mixprec.checkpoint import fp32_state_dict
from mixprec.integrations.transformers import MIXPREC_NAME, MixprecTrainer

from ._hf_common import PRESETS, TokenDataset, gpt2, reference_run, transformers

STEPS = 6
# Per-dtype tolerance of Trainer against mixprec's own loop. Same process, same kernels in the same order
# (the reference reproduces Trainer's param groups and its sum / num_items_in_batch loss): equal bit for bit.
TOL = {"bf16-mixed": 0.0, "bf16-master": 0.0, "fp16-mixed": 0.0, "bf16-pure": 0.0}


class _Planted(transformers.TrainerCallback):
    """Plants an inf gradient in global step ``inf_step`` (0-based) and records what the Trainer did."""

    def __init__(self, overflow, inf_step):
        self.overflow, self.inf_step = overflow, inf_step
        self.true_norms: list[float] = []

    def on_step_begin(self, args, state, control, **kw):
        self.overflow.on = state.global_step == self.inf_step

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        # after Trainer's clipping: the gradients the step will use, unscaled (FP32 views under *-master)
        grads = [p.grad.float() for p in model.parameters() if p.grad is not None]
        self.true_norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())


def _trainer(tmp_path, preset, *, inf_step=None, max_grad_norm=1.0, save_steps=None, per_device_train_batch_size=4,
             eval_dataset=None, **kw):
    from ._hf_common import Overflow

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, learning_rate=1e-2,
        logging_steps=1, report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0,
        train_sampling_strategy="sequential", max_grad_norm=max_grad_norm,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        per_device_train_batch_size=per_device_train_batch_size, **kw)
    model = gpt2()
    planted = _Planted(Overflow(model), inf_step)
    trainer = MixprecTrainer(model=model, args=args, train_dataset=TokenDataset(), eval_dataset=eval_dataset,
                             precision=preset, callbacks=[planted])
    return trainer, planted


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


@pytest.mark.parametrize("preset", PRESETS)
def test_trainer_equals_mixprec_loop_and_skips_planted_inf(tmp_path, preset):
    inf_step = 2
    trainer, planted = _trainer(tmp_path, preset, inf_step=inf_step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    ref = reference_run(preset, TokenDataset(), STEPS, inf_step=inf_step, trainer_loss=True)
    assert ref["skipped"] == [s == inf_step for s in range(STEPS)]

    losses, norms, lrs = _logged(trainer, "loss"), _logged(trainer, "grad_norm"), _logged(trainer, "learning_rate")
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["loss"]), rtol=TOL[preset], atol=0)
    finite = [s for s in range(STEPS) if s != inf_step]
    torch.testing.assert_close(torch.tensor([norms[s] for s in finite]), torch.tensor([ref["grad_norm"][s] for s in finite]),
                               rtol=TOL[preset], atol=0)
    assert not math.isfinite(norms[inf_step])  # the overflowing step's norm, as mixprec reports it
    # The scheduler did not advance on the skipped step: the step after it runs at the same learning rate.
    assert lrs == pytest.approx(ref["lr"], rel=1e-12)
    assert lrs[inf_step + 1] == lrs[inf_step]
    assert trainer.lr_scheduler.last_epoch == STEPS - 1
    assert int(trainer.prec.applied_steps) == STEPS - 1
    if preset == "fp16-mixed":
        assert float(trainer.prec.scaler.loss_scale) == 2.0**15  # backed off once from 2**16
    # No "lr_scheduler.step() before optimizer.step()" or skip warnings from torch/Trainer.
    assert not [w for w in caught if re.search(r"lr_scheduler|optimizer\.step|skipp", str(w.message))], \
        [str(w.message) for w in caught]


@pytest.mark.parametrize("preset", ["fp16-mixed", "bf16-master"])
def test_logged_grad_norm_is_the_true_unscaled_norm(tmp_path, preset):
    # max_grad_norm above every norm: the gradients the step sees are the ones the norm was taken of.
    trainer, planted = _trainer(tmp_path, preset, max_grad_norm=100.0)
    trainer.train()
    norms = _logged(trainer, "grad_norm")
    assert max(norms) < 100.0  # not multiplied by the loss scale (2**16 under fp16-mixed)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(planted.true_norms), rtol=1e-5, atol=0)
    # and within bf16/fp16 noise of the FP32 run's norms
    ref32 = reference_run("fp32", TokenDataset(), STEPS, max_grad_norm=100.0, trainer_loss=True)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref32["grad_norm"]), rtol=5e-2, atol=0)


@pytest.mark.parametrize("preset", ["fp16-mixed", "bf16-master"])
def test_gradient_accumulation_equals_mixprec_loop(tmp_path, preset):
    # two micro-batches of 2 per step: prec.backward twice (FP32 accumulation into the masters), one step
    trainer, _ = _trainer(tmp_path, preset, inf_step=1, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    trainer.train()
    ref = reference_run(preset, TokenDataset(), STEPS, inf_step=1, trainer_loss=True, micro=2)
    assert _logged(trainer, "grad_norm")[2:] == ref["grad_norm"][2:]
    assert _logged(trainer, "learning_rate") == ref["lr"]
    got, want = fp32_state_dict(trainer.prec), fp32_state_dict(ref["prec"][0])
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("preset", ["fp16-mixed", "bf16-master"])
def test_resume_from_checkpoint_is_bit_for_bit(tmp_path, preset):
    full, _ = _trainer(tmp_path / "full", preset, inf_step=1, save_steps=3)
    full.train()
    ckpt = tmp_path / "full" / "checkpoint-3"
    assert (ckpt / MIXPREC_NAME).is_file() and not (ckpt / "optimizer.pt").exists()

    resumed, _ = _trainer(tmp_path / "resumed", preset, inf_step=1, save_steps=3)
    resumed.train(resume_from_checkpoint=str(ckpt))
    # the log history holds the checkpoint's first 3 steps, then the 3 steps run after resuming
    for key in ("loss", "grad_norm", "learning_rate"):
        assert len(_logged(resumed, key)) == STEPS
        assert _logged(resumed, key)[3:] == _logged(full, key)[3:], key
    a, b = full.prec.state_dict(), resumed.prec.state_dict()
    assert torch.equal(full.prec.scaler.loss_scale, resumed.prec.scaler.loss_scale)
    if preset == "fp16-mixed":
        assert float(resumed.prec.scaler.loss_scale) == 2.0**15  # the skip before the checkpoint, restored
    assert int(a["applied_steps"]) == int(b["applied_steps"]) == STEPS - 1
    fa, fb = fp32_state_dict(full.prec), fp32_state_dict(resumed.prec)  # the FP32 masters
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
    assert _same(a["optimizers"], b["optimizers"])  # optimizer moments (and masters), bit for bit
    assert _same(a["model"], b["model"])


@pytest.mark.parametrize("preset", ["bf16-master", "bf16-pure"])
def test_load_best_model_at_end_restores_the_best_checkpoints_fp32_masters(tmp_path, preset):
    """Trainer loads the best checkpoint's half weights; the masters kept the last step's values where the rounding
    agreed (a mix of two steps) until the best checkpoint's mixprec.pt was read too."""
    from mixprec import load

    trainer, _ = _trainer(tmp_path, preset, save_steps=3, eval_strategy="steps", eval_steps=3,
                          load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True,
                          eval_dataset=TokenDataset())
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and best.endswith("checkpoint-3")  # greater_is_better on a falling loss: not the last
    saved = load(f"{best}/{MIXPREC_NAME}")
    want = fp32_state_dict(saved, compensation=True)
    got = fp32_state_dict(trainer.prec, compensation=True)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    model = {k.removeprefix("_orig_mod."): v for k, v in trainer.model.state_dict().items()}
    assert all(torch.equal(model[k], v) for k, v in saved["model"].items())  # the half weights too, bit for bit


def _same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    return x == y


@pytest.mark.parametrize("flag", ["bf16", "fp16"])
def test_trainer_precision_flags_are_refused_with_a_policy(tmp_path, flag):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    setattr(args, flag, True)
    preset = "fp16-mixed" if flag == "fp16" else "bf16-mixed"
    with pytest.raises(ValueError, match=re.escape(
            f"TrainingArguments({flag}=True) together with MixprecTrainer(precision='bf16-master') would run two "
            f"mixed-precision systems at once")) as err:
        MixprecTrainer(model=gpt2(), args=args, train_dataset=TokenDataset(), precision="bf16-master")
    assert f"Set {flag}=False" in str(err.value) and f"precision={preset!r}" in str(err.value)


def test_resume_without_mixprec_state_is_refused(tmp_path):
    trainer, _ = _trainer(tmp_path, "bf16-mixed")
    with pytest.raises(FileNotFoundError, match=re.escape(f"there is no {MIXPREC_NAME}") + ".*save_only_model=True"):
        trainer._load_optimizer_and_scheduler(str(tmp_path))
