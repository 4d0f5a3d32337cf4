"""Fault-injection harness: poison training steps with inf/NaN and check that nothing is corrupted.

Over a long run of a tiny MLP under a precision policy, random steps are poisoned in one of
four places:

* ``loss``: the loss is multiplied by inf, -inf or NaN before backward;
* ``activation``: a forward hook writes inf/-inf/NaN into one module's output;
* ``grad_param``: a tensor hook writes inf/-inf/NaN into one parameter's gradient in backward;
* ``grad_activation``: a hook writes inf/-inf/NaN into the gradient flowing back through one
  module's output.

With gradient accumulation only one micro-batch of the step is poisoned. After every step the
harness checks (host-side, outside the library):

* every poisoned step was skipped, and no clean step was (``missed`` / ``false_skips``);
* every parameter, buffer, master weight and optimizer state is finite (``corrupted``);
* on a skipped step, parameters, buffers, masters and optimizer state are bit-identical to
  before the step and ``applied_steps`` did not move (``corrupted``); a random-generator state
  that advanced is counted apart (``rng_advanced``: 0 since stochastic rounding draws
  counter-based bits from seed, step and position, with no generator state to advance);
* a dynamic loss scale follows the rule (back off on overflow, grow after ``growth_interval``
  clean steps, floor and ceiling) exactly, and recovers to its ceiling after faults stop;
* persistent poisoning (every step from ``persistent_from`` on) ends in the scaler's
  :class:`mixprec.NumericsError` within ``steps to the floor + patience + check_interval``
  poisoned steps (no steps to a floor without dynamic scaling), with its diagnosis, and training continues cleanly once the poison stops.

Run it as a script for a long run and a summary table::

    python benchmarks/fault_injection.py                      # 5000 steps, every preset
    python benchmarks/fault_injection.py --steps 2000 --presets fp16-master bf16-mixed

``tests/test_faults.py`` runs the same harness over >= 1,000 steps in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mixprec._errors import NumericsError
from mixprec._precision import MixedPrecision
from mixprec._scaler import DynamicScaler, LossScaler, NoOpScaler, StaticScaler

KINDS = ("loss", "activation", "grad_param", "grad_activation")
POISONS = (float("inf"), float("-inf"), float("nan"))
PRESETS = ("fp32", "bf16-mixed", "bf16-master", "bf16-pure", "fp16-mixed", "fp16-master")


@dataclasses.dataclass(frozen=True)
class FaultConfig:
    """One harness run.

    Attributes:
        preset: The precision policy.
        steps: Steps with random faults (``[0, steps)``).
        fault_rate: Probability that a step in that range is poisoned.
        clean_tail: Clean steps after the random phase (the loss scale must recover in them).
        persistent: Poison every step after the tail until the scaler escalates (at most
            ``persistent_limit`` steps), then run ``after_escalation`` clean steps. A dynamic
            scaler escalates after backing off to its floor; the no-op and static scalers
            (FP32, BF16) after ``patience`` consecutive skips.
        micro_batches: Gradient-accumulation micro-batches per step (one of them is poisoned).
        clip: ``clip_grad_norm_`` max norm, or ``None``.
        optimizer: ``"adamw"`` or ``"sgd"``.
        seed: Seeds the model, the data and the fault schedule.
        init_scale, growth_interval, min_scale: The dynamic scaler's settings (FP16 policies);
            the scale starts at its ceiling (``max_scale = init_scale``).
        patience, check_interval: Every scaler's escalation settings.
    """

    preset: str = "fp16-master"
    steps: int = 1000
    fault_rate: float = 0.03
    clean_tail: int = 250
    persistent: bool = True
    persistent_limit: int = 400
    after_escalation: int = 20
    micro_batches: int = 1
    clip: float | None = 1.0
    optimizer: str = "adamw"
    seed: int = 0
    init_scale: float = 2.0**10
    growth_interval: int = 10
    min_scale: float = 1.0
    patience: int = 10
    check_interval: int = 10


@dataclasses.dataclass
class FaultReport:
    """What a run saw. ``ok()`` is the pass criterion."""

    preset: str
    steps_run: int = 0
    injected: Counter = dataclasses.field(default_factory=Counter)  # per kind
    skipped: int = 0
    missed: list[int] = dataclasses.field(default_factory=list)  # poisoned but applied
    false_skips: list[int] = dataclasses.field(default_factory=list)  # clean but skipped
    corrupted: list[str] = dataclasses.field(default_factory=list)  # "step N: what"
    rng_advanced: int = 0
    scale_rule_errors: list[str] = dataclasses.field(default_factory=list)
    scale_min: float = math.inf
    scale_max: float = -math.inf
    scale_final: float = math.nan
    scale_after_tail: float = math.nan  # after the clean tail, before persistent poisoning
    scale_ceiling: float | None = None
    recoveries: list[int] = dataclasses.field(default_factory=list)  # steps from a drop back to the ceiling
    escalation_after: int | None = None  # poisoned steps until NumericsError
    escalation_bound: int | None = None
    escalation_message: str = ""
    applied_steps: int = 0
    first_loss: float = math.nan
    last_loss: float = math.nan
    seconds: float = 0.0

    @property
    def faults(self) -> int:
        return sum(self.injected.values())

    def problems(self) -> list[str]:
        """Everything that went wrong (empty when the run passed)."""
        out = [f"poisoned step {s} was applied" for s in self.missed]
        out += [f"clean step {s} was skipped" for s in self.false_skips]
        out += self.corrupted + self.scale_rule_errors
        if self.scale_ceiling is not None and self.scale_after_tail != self.scale_ceiling:
            out.append(f"the loss scale did not recover: {self.scale_after_tail:g} after the clean tail, ceiling "
                       f"{self.scale_ceiling:g}")
        if self.escalation_bound is not None:
            if self.escalation_after is None:
                out.append(f"persistent poisoning did not escalate within {self.escalation_bound} steps")
            elif self.escalation_after > self.escalation_bound:
                out.append(f"escalation after {self.escalation_after} poisoned steps, bound {self.escalation_bound}")
        if not self.last_loss < self.first_loss:
            out.append(f"did not learn: loss {self.first_loss:.4f} -> {self.last_loss:.4f}")
        return out

    def ok(self) -> bool:
        return not self.problems()


# ----- the model, data and state ----------------------------------------------------------------------
def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def make_batches(seed: int, n: int = 32, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(size, 8, generator=g)
        out.append((x, x[:, :4].argmax(1)))
    return out


def _tensors(tree: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{path}.{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{path}[{i}]")


def training_state(prec: MixedPrecision, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter, buffer, master and optimizer-state tensor, by path (live references)."""
    assert prec.model is not None
    out = {f"model.{k}": v for k, v in prec.model.state_dict().items()}
    out.update({f"optimizer{k}": v for k, v in _tensors(opt.state_dict())})
    return out


def _is_rng(path: str) -> bool:
    return ".generators." in path


def nonfinite(state: dict[str, torch.Tensor]) -> list[str]:
    floats = [(k, v) for k, v in state.items() if v.is_floating_point()]
    flat = torch.cat([v.detach().float().reshape(-1) for _, v in floats])
    if bool(flat.isfinite().all()):
        return []
    return [k for k, v in floats if not bool(v.isfinite().all())]


# ----- injection -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    value: float
    target: str  # module or parameter name ("" for the loss)
    index: int  # flat element index (modulo the tensor size)
    micro: int  # which micro-batch


def _poison(t: torch.Tensor, fault: Fault) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[fault.index % t.numel()] = fault.value
    return t


def install(model: nn.Module, fault: Fault) -> list[Any]:
    """Register the hooks a fault needs; returns handles to remove after backward."""
    if fault.kind == "activation":
        module = model.get_submodule(fault.target)
        return [module.register_forward_hook(lambda m, i, out: _poison(out, fault))]
    if fault.kind == "grad_activation":
        module = model.get_submodule(fault.target)

        def fwd(m: nn.Module, i: Any, out: torch.Tensor) -> None:
            out.register_hook(lambda g: _poison(g, fault))

        return [module.register_forward_hook(fwd)]
    if fault.kind == "grad_param":
        param = model.get_parameter(fault.target)
        return [param.register_hook(lambda g: _poison(g, fault))]
    return []


def draw_fault(rng: random.Random, model: nn.Module, micro_batches: int) -> Fault:
    kind = rng.choice(KINDS)
    # modules whose poisoned output provably reaches every gradient (before the LayerNorm mixes rows)
    modules = ["0", "1", "2"]
    params = [n for n, _ in model.named_parameters()]
    target = {"loss": "", "activation": rng.choice(modules), "grad_activation": rng.choice(modules + ["3"]),
              "grad_param": rng.choice(params)}[kind]
    return Fault(kind, rng.choice(POISONS), target, rng.randrange(1 << 16), rng.randrange(micro_batches))


# ----- the run ---------------------------------------------------------------------------------------
def build(cfg: FaultConfig) -> tuple[MixedPrecision, nn.Module, torch.optim.Optimizer]:
    model = make_model(cfg.seed)
    policy = MixedPrecision(cfg.preset).policy
    esc = {"patience": cfg.patience, "check_interval": cfg.check_interval, "on_failure": "raise"}
    scaler: LossScaler
    if policy.loss_scale == "dynamic":
        scaler = DynamicScaler(init_scale=cfg.init_scale, max_scale=cfg.init_scale, min_scale=cfg.min_scale,
                               growth_interval=cfg.growth_interval, log_overflow=False, **esc)
    elif policy.loss_scale == "static":
        scaler = StaticScaler(policy.init_scale or 1.0, **esc)
    else:
        scaler = NoOpScaler(**esc)
    prec = MixedPrecision(cfg.preset, scaler=scaler)
    if cfg.optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU is slow: known
        model, opt = prec.prepare(model, opt)
    return prec, model, opt


def run(cfg: FaultConfig, *, progress: Callable[[int], None] | None = None) -> FaultReport:
    """Run the harness described in the module docstring and return what it saw."""
    t0 = time.perf_counter()
    prec, model, opt = build(cfg)
    batches = make_batches(cfg.seed)
    rep = FaultReport(cfg.preset)
    dynamic = isinstance(prec.scaler, DynamicScaler)
    if dynamic:
        rep.scale_ceiling = cfg.init_scale
    scale = float(prec.scaler.loss_scale.item())
    tracker = 0
    drop_at: int | None = None
    poisoned_run = 0  # consecutive poisoned steps in the persistent phase
    persistent_start_scale = scale
    end_random = cfg.steps
    end_tail = end_random + cfg.clean_tail
    persistent = cfg.persistent
    last = end_tail + (cfg.persistent_limit if persistent else 0)
    escalated_at: int | None = None
    losses: list[float] = []
    expected_applied = 0

    step = 0
    while step < last:
        in_persistent = persistent and step >= end_tail and escalated_at is None
        if escalated_at is not None and step >= escalated_at + 1 + cfg.after_escalation:
            break
        rng = random.Random(cfg.seed * 1_000_003 + step)
        if step < end_random:
            fault = draw_fault(rng, model, cfg.micro_batches) if rng.random() < cfg.fault_rate else None
        elif in_persistent:
            fault = draw_fault(rng, model, cfg.micro_batches)
            if poisoned_run == 0:
                persistent_start_scale = scale
            poisoned_run += 1
        else:
            fault = None

        before = None
        if fault is not None:
            rep.injected[fault.kind] += 1
            before = {k: v.detach().clone() for k, v in training_state(prec, opt).items()}
            applied_before = int(prec.applied_steps.item())
        step_loss = 0.0
        for m in range(cfg.micro_batches):
            x, y = batches[(step * cfg.micro_batches + m) % len(batches)]
            handles = install(model, fault) if fault is not None and fault.micro == m else []
            try:
                with prec.autocast():
                    loss = nn.functional.cross_entropy(model(x).float(), y) / cfg.micro_batches
                if fault is not None and fault.kind == "loss" and fault.micro == m:
                    loss = loss * fault.value
                prec.backward(loss)
            finally:
                for h in handles:
                    h.remove()
            step_loss += float(loss.detach())
        if cfg.clip is not None:
            prec.clip_grad_norm_(cfg.clip)
        raised: NumericsError | None = None
        try:
            info = prec.step(opt)
            skipped = bool(info.skipped.item())
        except NumericsError as e:  # escalation: the step itself was skipped before update() raised
            raised, skipped = e, True
        opt.zero_grad(set_to_none=True)
        rep.steps_run += 1
        if progress is not None:
            progress(step)

        # ---- checks, all from outside the library ----
        if skipped:
            rep.skipped += 1
        else:
            expected_applied += 1
        if int(prec.applied_steps.item()) != expected_applied:  # type: ignore[union-attr]
            rep.corrupted.append(f"step {step}: applied_steps {int(prec.applied_steps.item())}, "  # type: ignore[union-attr]
                                 f"{expected_applied} steps were applied")
        if fault is not None and not skipped:
            rep.missed.append(step)
        if fault is None and not skipped:
            losses.append(step_loss)
        if fault is None and skipped:
            rep.false_skips.append(step)
        now = training_state(prec, opt)
        bad = nonfinite(now)
        if bad:
            rep.corrupted.append(f"step {step}: non-finite {bad[:3]}")
        if before is not None and skipped:
            changed = [k for k, v in now.items() if not torch.equal(v, before[k])]
            if any(_is_rng(k) for k in changed):
                rep.rng_advanced += 1
            changed = [k for k in changed if not _is_rng(k)]
            if changed:
                rep.corrupted.append(f"step {step}: skipped step changed {changed[:3]}")
            if int(prec.applied_steps.item()) != applied_before:  # type: ignore[union-attr]
                rep.corrupted.append(f"step {step}: skipped step moved applied_steps")
        # the loss-scale rule, re-derived independently
        new_scale = float(prec.scaler.loss_scale.item())
        if dynamic:
            if skipped:
                expect, tracker = max(scale * 0.5, cfg.min_scale), 0
            else:
                tracker += 1
                expect = scale
                if tracker == cfg.growth_interval:
                    expect, tracker = min(scale * 2.0, cfg.init_scale), 0
            if new_scale != expect:
                rep.scale_rule_errors.append(f"step {step}: scale {new_scale:g}, rule says {expect:g}")
            if drop_at is None and new_scale < cfg.init_scale:
                drop_at = step
            elif drop_at is not None and new_scale == cfg.init_scale:
                rep.recoveries.append(step - drop_at)
                drop_at = None
        elif new_scale != scale:
            rep.scale_rule_errors.append(f"step {step}: a {type(prec.scaler).__name__}'s scale moved to {new_scale:g}")
        rep.scale_min, rep.scale_max = min(rep.scale_min, new_scale), max(rep.scale_max, new_scale)
        scale = new_scale
        if step == end_tail - 1:
            rep.scale_after_tail = scale
        if raised is not None:
            escalated_at = step
            rep.escalation_after = poisoned_run
            rep.escalation_message = str(raised)
            steps_to_floor = max(0, math.ceil(math.log2(persistent_start_scale / cfg.min_scale))) if dynamic else 0
            rep.escalation_bound = steps_to_floor + cfg.patience + cfg.check_interval
        step += 1

    if persistent and escalated_at is None:
        rep.escalation_bound = cfg.persistent_limit
    rep.scale_final = scale
    rep.applied_steps = int(prec.applied_steps.item())
    if losses:
        k = max(1, min(20, len(losses) // 10))
        rep.first_loss, rep.last_loss = sum(losses[:k]) / k, sum(losses[-k:]) / k
    rep.seconds = time.perf_counter() - t0
    return rep


# ----- the script ------------------------------------------------------------------------------------
def _table(reports: list[FaultReport]) -> str:
    head = ("preset", "steps", "loss", "act", "g_par", "g_act", "skipped", "missed", "false", "corrupt", "rng",
            "scale min/max/final", "recov max", "escal. after/bound", "loss first->last", "s")
    rows = []
    for r in reports:
        esc = "-" if r.escalation_bound is None else f"{r.escalation_after}/{r.escalation_bound}"
        rows.append((
            r.preset, str(r.steps_run), *(str(r.injected[k]) for k in KINDS), str(r.skipped), str(len(r.missed)),
            str(len(r.false_skips)), str(len(r.corrupted)), str(r.rng_advanced),
            f"{r.scale_min:g}/{r.scale_max:g}/{r.scale_final:g}", str(max(r.recoveries, default=0)), esc,
            f"{r.first_loss:.3f}->{r.last_loss:.3f}", f"{r.seconds:.1f}",
        ))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths)), *(fmt.format(*row) for row in rows)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5000, help="steps with random faults per preset")
    ap.add_argument("--rate", type=float, default=0.03, help="probability that a step is poisoned")
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {args.steps} random-fault steps per preset "
          f"at rate {args.rate}, {args.micro_batches} micro-batches, then a clean tail and persistent poisoning")
    reports = []
    for preset in args.presets:
        cfg = FaultConfig(preset=preset, steps=args.steps, fault_rate=args.rate, micro_batches=args.micro_batches,
                          seed=args.seed)
        reports.append(run(cfg))
    print(_table(reports))
    failed = False
    for r in reports:
        for p in r.problems():
            failed = True
            print(f"PROBLEM {r.preset}: {p}")
        if r.escalation_message:
            print(f"{r.preset} escalation: {r.escalation_message[:160]}...")
    total = sum(r.faults for r in reports)
    corrupted = sum(len(r.corrupted) for r in reports)
    print(f"faults injected {total}, survived {total - sum(len(r.missed) for r in reports)}, "
          f"state corrupted {corrupted}: {'FAIL' if failed else 'OK'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
