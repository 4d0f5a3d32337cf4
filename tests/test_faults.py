"""Fault injection: inf/NaN in the loss, activations and gradients never corrupt training state.

The harness lives in ``benchmarks/fault_injection.py`` (run it as a script for 5,000 steps and
a table); here it runs over >= 1,000 steps of a tiny MLP in CI.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from mixprec._errors import NumericsError

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "fault_injection.py"
_spec = importlib.util.spec_from_file_location("mixprec_fault_injection", _PATH)
assert _spec is not None and _spec.loader is not None
fi = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fi  # dataclasses look their module up while the file executes
_spec.loader.exec_module(fi)

# (preset, random-fault steps, micro-batches, optimizer): fp16-master is the long run (> 1,000
# steps with its clean tail and persistent phase); the others cover every kind of state.
CASES = [
    ("fp16-master", 1000, 1, "adamw"),
    ("fp16-mixed", 300, 2, "adamw"),
    ("bf16-mixed", 300, 2, "adamw"),
    ("bf16-master", 300, 1, "sgd"),
    ("bf16-pure", 250, 1, "adamw"),
    ("fp32", 250, 2, "sgd"),
]


@pytest.mark.parametrize(("preset", "steps", "micro", "optimizer"), CASES, ids=[c[0] for c in CASES])
def test_poisoned_steps_are_skipped_and_state_never_corrupted(preset, steps, micro, optimizer):
    cfg = fi.FaultConfig(preset=preset, steps=steps, micro_batches=micro, optimizer=optimizer,
                         fault_rate=0.05 if steps < 1000 else 0.03)
    rep = fi.run(cfg)
    assert rep.problems() == []
    # every kind of fault was injected, and each one was skipped (missed == [], false_skips == [])
    assert all(rep.injected[k] > 0 for k in fi.KINDS), rep.injected
    assert rep.skipped == rep.faults
    assert rep.corrupted == [] and rep.missed == [] and rep.false_skips == []
    assert rep.applied_steps == rep.steps_run - rep.skipped
    if preset.startswith("fp16"):
        assert rep.steps_run >= 1000 or steps < 1000
        assert rep.scale_min == cfg.min_scale and rep.scale_max == cfg.init_scale  # backed off, grew back
        assert rep.recoveries and rep.scale_after_tail == cfg.init_scale
        assert rep.scale_rule_errors == []
        # persistent poisoning escalated, no earlier than the rule allows and within the bound
        floor = 10  # log2(2**10 / 1) backoffs from the ceiling
        assert floor + cfg.patience <= rep.escalation_after <= rep.escalation_bound
        assert rep.escalation_bound == floor + cfg.patience + cfg.check_interval
    else:
        assert rep.scale_min == rep.scale_max == rep.scale_final == 1.0
        # no scale to lower: patience consecutive skips escalate, within one check interval
        assert cfg.patience <= rep.escalation_after <= rep.escalation_bound == cfg.patience + cfg.check_interval
        assert "There is no scale to lower" in rep.escalation_message
    # stochastic rounding draws counter-based bits (seed, step, position): a skipped step advances nothing
    assert rep.rng_advanced == 0


def test_long_run_covers_over_a_thousand_steps():
    rep = fi.run(fi.FaultConfig(preset="bf16-mixed", steps=1000, micro_batches=1, fault_rate=0.03,
                                clean_tail=20))
    assert rep.steps_run >= 1000 and rep.faults >= 20 and rep.ok(), rep.problems()


def test_escalation_message_and_training_continues_after_it():
    cfg = fi.FaultConfig(preset="fp16-master", steps=0, clean_tail=30, persistent_limit=100, after_escalation=25,
                         patience=5, check_interval=4, init_scale=2.0**3)
    rep = fi.run(cfg)
    assert rep.ok(), rep.problems()
    # 3 backoffs to the floor + 5 at the floor = 8 poisoned steps; checks run every 4 steps (30 + 8 = 38 is not
    # a multiple of 4, the next check is at 40): the error comes at the 10th poisoned step.
    assert rep.escalation_after == 10 and rep.escalation_bound == 3 + 5 + 4
    msg = rep.escalation_message
    for part in ("loss scaling has failed: the loss scale is at its floor (min_scale=1, scale 1)",
                 "the last step with finite gradients was step 29",
                 "Skipping more steps would only hide it",
                 "run `mixprec doctor` to find the first module that produces inf/NaN"):
        assert part in msg, (part, msg)
    # after the error, 25 clean steps were applied and counted (no stale overflow flag carried over)
    assert rep.applied_steps == 30 + 25 and rep.false_skips == []


@pytest.mark.parametrize(("preset", "pinned"), [
    ("fp16-mixed", "loss scaling has failed: the loss scale is at its floor"),
    ("bf16-mixed", "training has failed without loss scaling: the last 2 steps all had inf/NaN gradients"),
    ("fp32", "training has failed without loss scaling: the last 2 steps all had inf/NaN gradients"),
])
def test_escalation_raises_from_step_with_the_pinned_error(preset, pinned):
    cfg = fi.FaultConfig(preset=preset, patience=2, check_interval=2, init_scale=2.0)
    prec, model, opt = fi.build(cfg)
    x, y = fi.make_batches(0)[0]
    before = {k: v.clone() for k, v in fi.training_state(prec, opt).items()}
    with pytest.raises(NumericsError, match=re.escape(pinned)):
        for _ in range(10):
            with prec.autocast():
                loss = torch.nn.functional.cross_entropy(model(x), y)
            prec.backward(loss * float("nan"))
            prec.step(opt)
            opt.zero_grad()
    after = fi.training_state(prec, opt)
    assert all(torch.equal(before[k], v) for k, v in after.items() if k in before)
    # A skipped first step may create the optimizer's initial state (torch's fused kernels, which skip on the
    # device, make it before they skip): step 0 and zero moments, exactly what a fresh state holds.
    assert set(before) <= set(after)
    assert all(torch.count_nonzero(v) == 0 for k, v in after.items() if k not in before)


def test_harness_detects_a_broken_skip(monkeypatch):
    """The harness can fail: with the inf/NaN check disabled it reports missed skips and corruption."""
    import mixprec._precision as precision

    real = precision.step_or_skip
    monkeypatch.setattr(precision, "step_or_skip",
                        lambda opt, found_inf, *rest, **kw: real(opt, torch.zeros_like(found_inf), *rest, **kw))
    rep = fi.run(fi.FaultConfig(preset="bf16-mixed", steps=60, fault_rate=0.2, clean_tail=0))
    assert rep.missed and rep.corrupted and not rep.ok()
