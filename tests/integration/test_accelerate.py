"""``mixprec.integrations.accelerate``: a plain Accelerate loop on a tiny GPT-2 built from a config.

What is pinned: ``MixprecAccelerator``'s loop (``prepare``, ``backward``, ``clip_grad_norm_``,
``optimizer.step()``, a prepared scheduler) equals mixprec's own loop under every preset family; a
planted inf/NaN step is skipped, ``optimizer_step_was_skipped`` is true exactly then and the scheduler
does not advance; ``save_state``/``load_state`` carry the mixprec state; Accelerate's own mixed
precision, ``loss.backward()`` under loss scaling and an optimizer without its model are refused.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from mixprec.integrations.accelerate import MixprecAccelerator, attach

from ._hf_common import PRESETS, Overflow, TokenDataset, gpt2, reference_run, transformers

STEPS = 5
# Per-dtype tolerance against mixprec's own loop: the same calls in the same order, so bit for bit.
TOL = {"bf16-mixed": 0.0, "bf16-master": 0.0, "fp16-mixed": 0.0, "bf16-pure": 0.0}


def _loop(preset, steps=STEPS, inf_step=None):
    """The Accelerate loop as its docs write it, with Trainer's optimizer and scheduler."""
    # TrainingArguments resets Accelerate's global state: before the accelerator
    args = transformers.TrainingArguments("unused", learning_rate=1e-2, use_cpu=True, report_to=[])
    accelerator = MixprecAccelerator(preset, cpu=True)  # the reference runs on the CPU
    model = gpt2()
    overflow = Overflow(model)
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    groups = [{"params": [p for n, p in model.named_parameters() if (n in decay) == d], "weight_decay": 0.0}
              for d in (True, False)]
    optimizer = cls(groups, **kwargs)
    scheduler = transformers.get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    data = TokenDataset()
    out = {"loss": [], "grad_norm": [], "skipped": [], "lr": []}
    for step in range(steps):
        x = data.batch(step)
        overflow.on = step == inf_step
        loss = model(input_ids=x, labels=x).loss  # no autocast block: prepare() put the forward in prec.autocast()
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        out["lr"].append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        out["loss"].append(loss.item())
        out["grad_norm"].append(norm.item())
        out["skipped"].append(accelerator.optimizer_step_was_skipped)
    return out, accelerator, model


@pytest.mark.parametrize("preset", PRESETS)
def test_accelerate_loop_equals_mixprec_loop_and_skips_planted_inf(preset):
    inf_step = 1
    got, accelerator, _ = _loop(preset, inf_step=inf_step)
    ref = reference_run(preset, TokenDataset(), STEPS, inf_step=inf_step)
    assert got["skipped"] == ref["skipped"] == [s == inf_step for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(ref["loss"]), rtol=TOL[preset], atol=0)
    finite = [s for s in range(STEPS) if s != inf_step]
    torch.testing.assert_close(torch.tensor([got["grad_norm"][s] for s in finite]),
                               torch.tensor([ref["grad_norm"][s] for s in finite]), rtol=TOL[preset], atol=0)
    assert got["lr"] == ref["lr"] and got["lr"][inf_step + 1] == got["lr"][inf_step]  # no advance on the skip
    assert int(accelerator.prec.applied_steps) == STEPS - 1
    if preset == "fp16-mixed":
        assert float(accelerator.prec.scaler.loss_scale) == 2.0**15
        assert max(got["grad_norm"][s] for s in finite) < 10  # the unscaled norm, not times 2**16


def test_save_state_and_load_state_carry_the_mixprec_state(tmp_path):
    _, accelerator, model = _loop("fp16-mixed", steps=2, inf_step=0)  # one skip: the scale is 2**15
    accelerator.save_state(str(tmp_path))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    scale = accelerator.prec.scaler.loss_scale.clone()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    accelerator.prec.scaler.load_state_dict(type(accelerator.prec.scaler)().state_dict())
    accelerator.load_state(str(tmp_path))
    assert torch.equal(accelerator.prec.scaler.loss_scale, scale) and float(scale) == 2.0**15
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def test_accelerate_mixed_precision_is_refused_with_a_policy():
    with pytest.raises(ValueError, match=re.escape(
            "MixprecAccelerator(mixed_precision='bf16'): Accelerate's mixed_precision='bf16' together with the mixprec "
            "policy 'bf16-master' would run two mixed-precision systems at once")) as err:
        MixprecAccelerator("bf16-master", mixed_precision="bf16")
    assert "Use mixed_precision='no'" in str(err.value) and "'bf16-mixed'" in str(err.value)


def test_attach_refuses_an_accelerator_with_its_own_mixed_precision():
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    with pytest.raises(ValueError, match=re.escape("attach(Accelerator): Accelerate's mixed_precision='bf16'")):
        attach(accelerator, "fp16-mixed")


def test_loss_backward_under_loss_scaling_is_refused_by_name():
    accelerator = MixprecAccelerator("fp16-mixed", cpu=True)
    model = gpt2()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = TokenDataset().batch(0)
    model(input_ids=x, labels=x).loss.backward()  # bypasses accelerator.backward: never scaled
    with pytest.raises(ValueError, match=re.escape("Call prec.backward(loss) instead of loss.backward()")):
        optimizer.step()


def test_optimizer_without_its_model_is_refused():
    accelerator = MixprecAccelerator("bf16-master", cpu=True)
    model = gpt2()
    with pytest.raises(ValueError, match=re.escape("needs the model and its optimizer(s) in one call")):
        accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.raises(ValueError, match=re.escape("this optimizer was not prepared by mixprec")):
        accelerator.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))


def test_the_frameworks_are_imported_lazily_with_an_install_hint(monkeypatch):
    import subprocess
    import sys

    code = ("import sys, mixprec.integrations, mixprec.integrations.accelerate, mixprec.integrations.transformers; "
            "print(sorted(m for m in ('accelerate', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

    from mixprec.integrations import accelerate as acc_mod
    from mixprec.integrations import transformers as tr_mod

    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate -> ImportError
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=re.escape("needs the `accelerate` package: pip install accelerate")):
        acc_mod._import_accelerate()
    with pytest.raises(ImportError, match=re.escape("needs the `transformers` package: pip install transformers")):
        tr_mod._import_transformers()


def test_a_deep_copy_of_the_prepared_model_runs_its_own_weights_and_the_model_pickles(tmp_path):
    # The forward Accelerate's prepare installs was a closure: deepcopy (AveragedModel, a best-model
    # snapshot, a teacher) kept the original's, so the copy ran the live weights; torch.save failed.
    import copy

    transformers.TrainingArguments("unused", use_cpu=True, report_to=[])
    accelerator = MixprecAccelerator("bf16-mixed", cpu=True)
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = TokenDataset().batch(0)
    snapshot = copy.deepcopy(model)
    with torch.no_grad():
        for p in snapshot.parameters():
            p.zero_()
        zeroed = snapshot(input_ids=x).logits
        live = model(input_ids=x).logits
    assert torch.count_nonzero(zeroed) == 0 and torch.count_nonzero(live) > 0
    assert zeroed.dtype == live.dtype == torch.float32  # the copy still runs under the run's autocast and casts
    torch.save(model, tmp_path / "model.pt")
    again = torch.load(tmp_path / "model.pt", weights_only=False)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=x).logits, live, rtol=0, atol=0)
    assert "input_ids" in __import__("inspect").signature(model.forward).parameters  # Trainer's column filter


@pytest.mark.parametrize("preset", ["fp16-mixed", "fp16-master"])
def test_clipping_each_optimizers_parameters_before_its_own_step(preset):
    """Actor-critic: clip and step the actor's optimizer, then the critic's. Clipping a subset unscaled every optimizer,
    the stepped one again: refused with an error that blamed a missing backward."""
    import warnings

    torch.manual_seed(0)
    trunk, pi, v = torch.nn.Linear(8, 32), torch.nn.Linear(32, 4), torch.nn.Linear(32, 1)
    model = torch.nn.ModuleList([trunk, pi, v])
    actor = [*trunk.parameters(), *pi.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU is slow
        accelerator = MixprecAccelerator(preset, cpu=True)
        model, oa, oc = accelerator.prepare(model, torch.optim.Adam(actor, 1e-3), torch.optim.Adam(v.parameters(), 1e-3))
    x = torch.randn(16, 8).to(trunk.weight.dtype)  # (a ModuleList has no forward to cast the input)
    for _ in range(2):
        h = torch.tanh(trunk(x))
        accelerator.backward(pi(h).float().logsumexp(-1).mean() + v(h).float().square().mean())
        norm = accelerator.clip_grad_norm_(actor, 0.5)
        oa.step()
        accelerator.clip_grad_norm_(v.parameters(), 0.1)
        oc.step()
        oa.zero_grad()
        oc.zero_grad()
        assert torch.isfinite(norm) and float(norm) < 100  # the true (unscaled) norm
