"""Statistics, history and escalation bookkeeping of a loss scaler.

The scale algorithm (backoff, hysteresis, growth, floor, ceiling) lives in ``_scaler.ScaleCore``;
this module records what happened and acts on it. :class:`ScaleHistory` keeps, on the device:

* a ring buffer of ``(scale after the update, found_inf)``, one row per step, written by one
  kernel per step (:meth:`ScaleHistory.record`);
* six counters (float64, exact for integers below 2**53): skipped steps, consecutive skips,
  last overflow step, last finite step, the streak of overflows at the floor, and the scale
  before the next unfolded ring entry. They are not updated counter by counter each step
  (that would be ~8 tiny kernels): a *fold* every ``check_interval`` (or ``history``) steps
  turns the new ring entries into the counters (~20 tiny kernels, amortised).

Host reads happen only where named:

* the periodic check, every ``check_interval`` steps when escalation or overflow logging is
  on: one read of a 9-value snapshot (counters, scale, the latest long run that ended since the last check). On CUDA the snapshot is copied
  asynchronously into pinned memory and read one interval later, so it does not stall the
  stream. It drives the rate-limited overflow log line and escalation (raise or warn);
* :meth:`ScaleHistory.statistics` (and through it the scalers' ``state_dict``) and pickling.

Escalation tells two failures apart from the snapshot it already reads (no extra kernel and
no extra sync: the last finite step is one of the counters):

* *no step was ever applied*: the gradients have been inf/NaN since the first step of the run
  (``last_finite_step`` is none and the loaded state, if any, had no finite step either). A
  loss scale cannot fix that: the model, the data, the initialisation, or an inf that persists
  in the gradient buffers (gradients never cleared) is the cause;
* *the scale collapsed after N applied steps*: training was going and then overflowed at the
  floor (or, without a scale to lower, kept skipping) for ``patience`` steps.

Whether any step was ever finite is kept in the state dict as ``any_finite_step``, so a
resumed run keeps telling the two apart. Older state dicts without the key still load: it is
derived from ``last_finite_step``, and a ``torch.amp.GradScaler`` state dict (no statistics)
counts as a run that applied steps, since its history is unknown.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import Tensor

from ._errors import NumericsError

__all__ = ["STATE_KEYS", "HistoryConfig", "ScaleHistory", "fresh_statistics", "loaded_statistics"]

logger = logging.getLogger("mixprec.scaler")

# counters vector (float64, exact for integers below 2**53):
_SKIPPED, _CONSEC, _LAST_OVF, _LAST_CLEAN, _FLOOR, _PREV_SCALE = range(6)

#: The statistics keys of a scaler's state dict, in order (``any_finite_step`` is the newest:
#: optional when loading).
STATE_KEYS = ("steps", "skipped_steps", "consecutive_skips", "last_overflow_step", "last_finite_step",
              "floor_streak", "scale_history", "overflow_history", "any_finite_step")


class HistoryConfig(Protocol):
    """The configuration fields the bookkeeping reads (``_scaler.ScaleConfig`` has them).

    Read live at every use: ``load_state_dict`` may change ``min_scale``.
    """

    @property
    def kind(self) -> str: ...
    @property
    def min_scale(self) -> float | None: ...
    @property
    def floor(self) -> float: ...
    @property
    def on_failure(self) -> str: ...
    @property
    def patience(self) -> int: ...
    @property
    def check_interval(self) -> int: ...
    @property
    def log_overflow(self) -> bool: ...
    @property
    def log_interval_s(self) -> float: ...
    @property
    def history(self) -> int: ...
    @property
    def checks(self) -> bool: ...


def fresh_statistics() -> dict[str, Any]:
    """Return the statistics of a scaler that has not stepped yet (the :data:`STATE_KEYS`)."""
    return {"steps": 0, "skipped_steps": 0, "consecutive_skips": 0, "last_overflow_step": None,
            "last_finite_step": None, "floor_streak": 0, "scale_history": [], "overflow_history": [],
            "any_finite_step": False}


def loaded_statistics(sd: Mapping[str, Any]) -> dict[str, Any]:
    """Return the :data:`STATE_KEYS` of a state dict being loaded, missing ones filled in.

    What a ``torch.amp.GradScaler`` dict lacks starts fresh (statistics from zero).
    ``any_finite_step``, absent from state dicts written before it existed, is derived: from
    ``last_finite_step`` when the dict has statistics, else (a ``torch.amp.GradScaler`` dict,
    whose history is unknown) ``True``, so escalation never claims that no step was applied.

    Args:
        sd: A scaler state dict (ours, of any version, or ``torch.amp.GradScaler``'s).

    Returns:
        A new dict with exactly the :data:`STATE_KEYS`, in order.
    """
    out = fresh_statistics()
    out.update({k: sd[k] for k in STATE_KEYS if k in sd})
    if "any_finite_step" not in sd:
        out["any_finite_step"] = out["last_finite_step"] is not None if "steps" in sd else True
    out["any_finite_step"] = bool(out["any_finite_step"])
    return out


class ScaleHistory:
    """A scaler's step history, counters, periodic check, statistics and escalation (see the module notes).

    Args:
        config: The scaler's configuration (kept by reference and read live).

    The device tensors are created by :meth:`materialise` (the owner decides where and when).
    """

    # The first step of the last run reported (a run is reported once, while it goes on or after it ended); a class
    # default for copies pickled before it existed.
    _reported_start: float | None = None
    # [length, last step] of the latest run of `patience` or more at the floor that ended since the last check: such
    # a run escalates as one still going would (device, float64; made with the counters)
    _run: Tensor | None = None

    def __init__(self, config: HistoryConfig) -> None:
        self.cfg = config
        self.ring_len = max(config.history, config.check_interval)
        self._interval = 0
        self.refresh_config()
        self.ring: Tensor | None = None
        self._rows: tuple[Tensor, ...] = ()
        self.counters: Tensor | None = None
        self.steps = 0
        self.folded = 0
        # a finite step happened before the counters started (it came with a loaded state dict)
        self.finite_before = False
        self._pos_cache: dict[tuple[int, torch.device], Tensor] = {}
        # Steps recorded by reference and not yet written to the ring (record_snapshot): the scale
        # each used (a snapshot taken before its update) and its found_inf, oldest first.
        self._pending: list[tuple[Tensor, Tensor]] = []
        self._snapshot: tuple[Tensor, Any, int] | None = None  # (pinned host copy, cuda event, step)
        self._reported_start: float | None = None
        self._last_log = -math.inf
        self._logged_skipped = 0.0

    def refresh_config(self) -> None:
        """Recompute what ``record`` derives from the configuration (after unpickling)."""
        # steps between folds: the check interval when checks are on, else when the ring is full
        self._interval = self.cfg.check_interval if self.cfg.checks else self.ring_len

    # ----- device state ----------------------------------------------------------------------------
    def materialise(self, device: torch.device, scale: float) -> None:
        """Create the ring and the counters on ``device`` (``scale``: the scale before the first step)."""
        self.ring = torch.zeros(self.ring_len, 2, dtype=torch.float32, device=device)
        self._rows = self.ring.unbind(0)
        # [skipped, consecutive, last_overflow, last_clean, floor_streak, prev_scale], filled on the device (no copy)
        self.counters = torch.zeros(6, dtype=torch.float64, device=device)
        self.counters[_LAST_OVF:_LAST_CLEAN + 1].fill_(-1.0)
        self.counters[_PREV_SCALE].fill_(scale)
        self._run = torch.zeros(2, dtype=torch.float64, device=device)  # here, not in a fold a CUDA graph may capture

    def move(self, device: torch.device) -> None:
        """Move the ring and the counters to ``device`` (before first use only)."""
        assert self.ring is not None and self.counters is not None
        self.ring = self.ring.to(device)
        self.counters = self.counters.to(device)
        self._run = torch.zeros(2, dtype=torch.float64, device=device)
        self._rows = self.ring.unbind(0)
        self._pos_cache.clear()
        self._snapshot = None

    # ----- per step --------------------------------------------------------------------------------
    def record(self, scale: Tensor, found_inf: Tensor) -> None:
        """Record one step: ``(scale, found_inf)`` into the ring (one kernel); fold and check when due.

        Args:
            scale: The scale after this step's update (0-d float32, the ring's device).
            found_inf: This step's flag (0-d float32, the ring's device).

        Raises:
            NumericsError: escalation with ``on_failure="raise"`` (at a periodic check).

        No host sync, except the periodic check.
        """
        if self._pending:
            raise RuntimeError("ScaleHistory.record: flush(scale) the snapshot-recorded steps before the update")
        steps = self.steps
        torch.stack([scale, found_inf], out=self._rows[steps % self.ring_len])
        self.steps = steps = steps + 1
        if steps % self._interval == 0:  # absolute steps: see record_snapshot
            self.fold()
            if self.cfg.checks:
                self._periodic_check(scale)

    def record_snapshot(self, used: Tensor, found_inf: Tensor, scale: Tensor) -> None:
        """Record one step by reference, with no kernel: ``(used, found_inf)`` wait until the next fold.

        The ring holds each step's scale *after* its update, which is the scale the next step
        used; so a caller that already keeps a snapshot of the scale a step used (``StepInfo``'s)
        needs no per-step ring write: :meth:`flush` writes the waiting rows in a few kernels at
        the next fold, taking the last row's scale from the live one.

        Args:
            used: The scale this step's gradients were divided by: a tensor nobody writes to later.
            found_inf: This step's flag (0-d float32, the ring's device), not written to later.
            scale: The live scale, after this step's update.

        Raises:
            NumericsError: escalation with ``on_failure="raise"`` (at a periodic check).
        """
        self._pending.append((used, found_inf))
        self.steps = steps = self.steps + 1
        if steps % self._interval == 0:
            # Due at multiples of the interval in absolute steps, not counted from the last fold:
            # state_dict() folds (statistics), and a count restarted there never reached the check
            # when checkpoints came more often than the interval (escalation off); a resumed run
            # checks at the same steps as an uninterrupted one. A fold never waits longer than the
            # interval, which is at most the ring's length.
            self.fold(scale)
            if self.cfg.checks:
                self._periodic_check(scale)

    def flush(self, scale: Tensor | None) -> None:
        """Write the steps waiting from :meth:`record_snapshot` into the ring.

        Args:
            scale: The live scale, which must not have changed since the last waiting step's
                update (it is that step's scale after the update). ``None`` drops them unwritten
                (their statistics are being replaced, e.g. by a loaded state).
        """
        pending = self._pending
        if not pending:
            return
        self._pending = []
        if scale is None or self.ring is None:
            return
        n = len(pending)  # <= check interval <= ring length: rows [steps - n, steps) never wrap onto each other
        after = [u for u, _ in pending[1:]]
        after.append(scale)
        rows = torch.stack([torch.stack(after), torch.stack([f for _, f in pending])], dim=1)
        start = (self.steps - n) % self.ring_len
        head = min(n, self.ring_len - start)
        self.ring[start:start + head].copy_(rows[:head])
        if head < n:
            self.ring[: n - head].copy_(rows[head:])

    def _positions(self, n: int) -> Tensor:
        assert self.ring is not None  # materialised
        key = (n, self.ring.device)
        pos = self._pos_cache.get(key)
        if pos is None:
            pos = self._pos_cache[key] = torch.arange(n, dtype=torch.float64, device=self.ring.device)
        return pos

    def fold(self, scale: Tensor | None = None) -> Tensor | None:
        """Fold ring entries [folded, steps) into the counters; return the window's overflow count (device).

        Args:
            scale: The live scale, for steps still waiting from :meth:`record_snapshot` (required
                when there are any).
        """
        if self._pending:
            if scale is None:
                raise RuntimeError("ScaleHistory.fold: steps recorded by snapshot need the live scale to be written")
            self.flush(scale)
        n = self.steps - self.folded
        if n == 0 or self.ring is None or self.counters is None:
            return None
        start = self.folded % self.ring_len
        if start + n <= self.ring_len:
            window = self.ring[start:start + n]
        else:
            window = torch.cat([self.ring[start:], self.ring[: start + n - self.ring_len]])
        c = self.counters
        scales, flags = window[:, 0], window[:, 1] > 0
        pos = self._positions(n)
        base = float(self.folded)
        overflows = flags.sum(dtype=torch.float64)

        def trailing_run(x: Tensor, carry: Tensor) -> Tensor:
            last_false = torch.where(x, -1.0, pos).max()
            return torch.where(last_false < 0, carry + n, (n - 1) - last_false)

        last_true = torch.where(flags, pos, -1.0).max()
        last_false = torch.where(flags, -1.0, pos).max()
        carry = c[_FLOOR].clone()
        before = torch.cat([c[_PREV_SCALE:].float(), scales[:-1]])
        if self.cfg.kind == "dynamic":
            floor = self.cfg.floor  # with no floor, a float32 scale's smallest: escalation counts there too
            at_floor = flags & (before <= floor)
        else:  # a fixed scale is always "at its floor": the streak is the run of consecutive skips
            at_floor = flags
        new = torch.stack([
            c[_SKIPPED] + overflows,
            trailing_run(flags, c[_CONSEC]),
            torch.where(last_true >= 0, base + last_true, c[_LAST_OVF]),
            torch.where(last_false >= 0, base + last_false, c[_LAST_CLEAN]),
            trailing_run(at_floor, c[_FLOOR]),
            scales[-1].double(),
        ])
        c.copy_(new)
        # The latest run at the floor of `patience` or more that ended in this window (the run carried in counts from
        # its start): [length, step it ended at]. A run that ends before the next check escalates there too (a few
        # kernels per fold, none per step); a run still going at the window's end is the counters' floor streak.
        latest_clean = torch.cummax(torch.where(at_floor, -1.0, pos), 0).values
        runs = torch.where(at_floor, pos - latest_clean + torch.where(latest_clean < 0, carry, 0.0), 0.0)
        ended = at_floor & torch.cat([~at_floor[1:], at_floor.new_zeros(1)])
        end = torch.where(ended & (runs >= self.cfg.patience), pos, -1.0).max()
        if self._run is None or self._run.device != c.device:
            self._run = torch.zeros(2, dtype=torch.float64, device=c.device)
        found = torch.cat([runs.gather(0, end.clamp(min=0).long().reshape(1)), (base + end).reshape(1)])
        # A run carried in that ended at the window's edge (the previous fold, a state_dict() read mid-run, saw it
        # going on; this window starts clean): it ended at step base - 1.
        edge = (carry >= self.cfg.patience) & ~at_floor[0] & (end < 0)
        found = torch.where(edge, torch.cat([carry.reshape(1), (carry * 0 + (base - 1.0)).reshape(1)]), found)
        self._run.copy_(torch.where((end >= 0) | edge, found, self._run))
        self.folded = self.steps
        return overflows

    def snapshot(self, scale: Tensor) -> Tensor:
        """[skipped, consecutive, last_overflow, last_clean, floor_streak, prev_scale, scale, the length and last step
        of the latest run of ``patience`` at the floor that ended since the last check (0, 0: none)] on the device."""
        assert self.counters is not None
        run = self._run if self._run is not None else self.counters.new_zeros(2)
        return torch.cat([self.counters, scale.double().reshape(1), run])

    def _periodic_check(self, scale: Tensor) -> None:
        """Every check_interval steps: read the counters and act (escalate, log).

        Host read: on CPU it is immediate; on CUDA the snapshot is copied asynchronously into
        pinned memory and read at the next check (after its event completed), so no sync. Not
        while a CUDA graph is being captured: ``event.query()`` would invalidate the capture, and a
        captured copy into a host buffer dropped after its read would write freed memory at every
        replay. The next check outside the capture reads the counters (statistics of replayed
        steps are not counted: the counters advance once per capture, not per replay).
        """
        if scale.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        snap = self.snapshot(scale)
        if self._run is not None:
            self._run.zero_()  # the next check looks at the runs after this snapshot (a copy: cat)
        if snap.device.type != "cuda":
            self.act(snap.tolist(), self.steps)
            return
        if self._snapshot is not None:
            host, event, at = self._snapshot
            if event.query():
                self.act(host.tolist(), at)
                self._snapshot = None
        if self._snapshot is None:
            host = torch.empty(snap.shape, dtype=snap.dtype, pin_memory=True)
            host.copy_(snap, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._snapshot = (host, event, self.steps)

    # ----- acting on a snapshot --------------------------------------------------------------------
    def act(self, values: list[float], at_step: int) -> None:
        """Log overflows (rate-limited) and escalate persistent failure, from a snapshot read on the host.

        Args:
            values: :meth:`snapshot` as Python numbers.
            at_step: ``steps`` when the snapshot was taken.

        Raises:
            NumericsError: ``on_failure="raise"`` and ``patience`` overflows at the floor (for
                the fixed-scale scalers: consecutive skips), once per episode.
        """
        skipped, _consec, _last_ovf, _last_clean, floor_streak, _prev, scale, run_len, end = values
        cfg = self.cfg
        if cfg.log_overflow:
            window_skips = skipped - self._logged_skipped
            now = time.monotonic()
            if window_skips > 0 and now - self._last_log >= cfg.log_interval_s:
                logger.info(
                    "Gradient overflow. Skipping step: %d step(s) with inf/NaN gradients skipped since the last report "
                    "(up to step %d); loss scale now %g.", int(window_skips), at_step - 1, scale)
                self._last_log = now
                self._logged_skipped = skipped
        if floor_streak >= cfg.patience:  # a run going on: it started floor_streak steps before at_step
            start = at_step - floor_streak
        elif run_len >= cfg.patience:  # a run that ended since the last check, at step `end`
            start = end - run_len + 1
        else:
            return
        if start == self._reported_start or cfg.on_failure == "ignore":
            return  # reported already (while it went on, or by a statistics() read)
        self._reported_start = start
        msg = self.failure_message(values, at_step)
        if cfg.on_failure == "raise":
            raise NumericsError(msg)
        # stacklevel 5: the frame it named before this code moved here (the scaler's update() on the periodic
        # path, act <- _periodic_check <- record <- ScaleCore.update <- update; the caller of statistics() there)
        warnings.warn(msg, RuntimeWarning, stacklevel=5)
        logger.warning(msg)

    def failure_message(self, values: list[float], at_step: int) -> str:
        """The escalation message for a snapshot: what failed, whether any step was ever applied, what to do.

        Args:
            values: :meth:`snapshot` as Python numbers.
            at_step: ``steps`` when the snapshot was taken.

        Returns:
            One of four messages: (dynamic scale at its floor | no scale to lower) x (no step of
            this run was ever applied | steps were applied, then it collapsed); about the run
            that ended since the last check when the current one is shorter than ``patience``.
        """
        skipped, consec, _last_ovf, last_clean, floor_streak, _prev, scale, run_len, end = values
        cfg = self.cfg
        ended = floor_streak < cfg.patience <= run_len  # the run ended between two checks
        run = f"the {int(run_len)} steps up to step {int(end)}" if ended else f"the last {int(floor_streak)} steps"
        came_back = f"finite gradients came back after step {int(end)}"
        applied = at_step - int(skipped)
        never = last_clean < 0 and not self.finite_before and not ended
        never_applied = "no step of this run was ever applied: the gradients were inf/NaN from the first step on"
        causes = ("Likely causes: the model, the data or the initialisation produce inf/NaN (an activation that "
                  "overflows in the forward pass, a bad input), or an inf in the gradient buffers persists from step "
                  "to step (gradients never cleared: call optimizer.zero_grad() every iteration)")
        fix = ("Run `mixprec doctor` (or mixprec.numerics.trace_nonfinite) to find the first module that produces "
               "inf/NaN, check that the gradients are zeroed between steps and that the inputs and initial weights "
               "are finite, and keep the layers that overflow in FP32 (FP32 islands, Policy 'i=...').")
        if cfg.kind != "dynamic":
            what = "without loss scaling" if cfg.kind == "noop" else f"at the fixed loss scale {scale:g}"
            head = (f"training has failed {what}: {run} all had inf/NaN gradients and "
                    f"were skipped ({int(skipped)} skipped of {at_step})")
            if never:
                too_large = (f", or the fixed loss scale {scale:g} is too large for the gradients' dtype (try a smaller "
                             "one, or DynamicScaler)") if cfg.kind == "static" else ""
                return f"{head}; {never_applied}. There is no scale to lower. {causes}{too_large}. {fix}"
            last = f"was step {int(last_clean)}" if last_clean >= 0 else "came before the loaded state dict"
            return (
                f"{head}; {came_back if ended else f'the last step with finite gradients {last}'}. "
                "There is no scale to lower, so the inf/NaN comes from the model, the data or the learning rate, and "
                "skipping more steps would only hide it. Run `mixprec doctor` (or mixprec.numerics.trace_nonfinite) "
                "to find the first module that produces inf/NaN, check the inputs and the learning rate, and keep the "
                "offending layers in FP32 (Policy 'i=...')."
            )
        min_scale = cfg.floor
        head = (f"loss scaling has failed: the loss scale is at its floor (min_scale={min_scale:g}, "
                f"scale {scale:g}) and {run} there all had inf/NaN gradients "
                f"({'' if ended else f'{int(consec)} consecutive skipped steps, '}{int(skipped)} skipped of {at_step})")
        if never:
            return (f"{head}; {never_applied}, at every loss scale down to the floor, so lowering the scale cannot fix "
                    f"it. {causes}. {fix}")
        if ended:
            collapsed = f"the scale collapsed there; {came_back}"
        elif last_clean >= 0:
            collapsed = (f"the last step with finite gradients was step {int(last_clean)}: the scale collapsed after "
                         f"{applied} applied step{'s' if applied != 1 else ''}")
        else:  # finite steps came with the loaded state dict (or its history is unknown: torch.amp's)
            collapsed = "the last step with finite gradients came before the loaded state dict: the scale collapsed after resuming"
        return (
            f"{head}; {collapsed}. Skipping more steps would only hide it. Try bf16 (e.g. "
            "MixedPrecision('bf16-mixed')) where the hardware supports it, FP32 islands for the layers that "
            "overflow (Policy 'i=...'), or run `mixprec doctor` to find "
            "the first module that produces inf/NaN."
        )

    # ----- host side -------------------------------------------------------------------------------
    def any_finite(self, last_finite_step: int | None) -> bool:
        """Whether any step so far (also before a loaded state) had finite gradients, given the last finite step."""
        return self.finite_before or last_finite_step is not None

    def statistics(self, scale: Tensor, growth_tracker: Tensor, hysteresis_left: Tensor, *,
                   check: bool = True) -> dict[str, Any]:
        """Fold, read everything back and, when ``check`` and escalation is on, act on it.

        Host syncs: one read of the 9-value snapshot, one of the ring's last ``history`` rows,
        one each of ``growth_tracker`` and ``hysteresis_left``.

        Args:
            scale: The current scale (0-d float32, the ring's device).
            growth_tracker: The scaler's growth tracker (0-d int32).
            hysteresis_left: The scaler's hysteresis allowance (0-d int32).
            check: Act on the snapshot (escalate, log) as a periodic check does.

        Returns:
            ``scale``, ``steps``, ``skipped_steps``, ``consecutive_skips``, ``last_overflow_step``,
            ``last_finite_step``, ``floor_streak``, ``growth_tracker``, ``hysteresis_left``,
            ``scale_history``, ``overflow_history`` as Python values.

        Raises:
            NumericsError: escalation with ``on_failure="raise"`` (only with ``check``).
        """
        assert self.ring is not None
        self.fold(scale)
        values = self.snapshot(scale).tolist()
        if check and self._run is not None:
            self._run.zero_()  # acted on below: the periodic check looks at the runs after this one
        skipped, consec, last_ovf, last_clean, floor_streak, _prev, scale_now, _run_len, _end = values
        n = min(self.steps, self.ring_len)
        idx = [(self.steps - n + i) % self.ring_len for i in range(n)]
        hist = self.ring[idx].tolist() if n else []
        stats: dict[str, Any] = {
            "scale": scale_now,
            "steps": self.steps,
            "skipped_steps": int(skipped),
            "consecutive_skips": int(consec),
            "last_overflow_step": None if last_ovf < 0 else int(last_ovf),
            "last_finite_step": None if last_clean < 0 else int(last_clean),
            "floor_streak": int(floor_streak),
            "growth_tracker": int(growth_tracker.item()),
            "hysteresis_left": int(hysteresis_left.item()),
            "scale_history": [h[0] for h in hist],
            "overflow_history": [h[1] > 0 for h in hist],
        }
        if check and self.cfg.on_failure != "ignore":
            self.act(values, self.steps)
        return stats

    def load(self, sd: Mapping[str, Any], scale: float) -> None:
        """Restore the statistics of a state dict normalised by :func:`loaded_statistics` (tensors must exist).

        Args:
            sd: Has every key of :data:`STATE_KEYS`.
            scale: The loaded scale (the scale before the next step).
        """
        assert self.ring is not None and self.counters is not None
        self.flush(None)  # their statistics are replaced
        self.steps = self.folded = int(sd["steps"])
        hist = list(sd["scale_history"])[-self.ring_len:]
        flags = list(sd["overflow_history"])[-self.ring_len:]
        self.ring.zero_()
        if hist and len(flags) == len(hist) and len(hist) <= self.steps:
            rows = torch.tensor([[s, float(bool(f))] for s, f in zip(hist, flags)], dtype=torch.float32)
            idx = torch.tensor([(self.steps - len(hist) + i) % self.ring_len for i in range(len(hist))])
            self.ring[idx.to(self.ring.device)] = rows.to(self.ring.device)

        def opt(v: Any) -> float:
            return -1.0 if v is None else float(v)

        # A fixed scale is always at its floor: the streak is the run of consecutive skips (the
        # noop and static state dicts do not carry floor_streak; starting it at 0 delayed escalation).
        streak = sd["floor_streak"] if self.cfg.kind == "dynamic" else sd["consecutive_skips"]
        self.counters.copy_(torch.tensor([
            float(sd["skipped_steps"]), float(sd["consecutive_skips"]), opt(sd["last_overflow_step"]),
            opt(sd["last_finite_step"]), float(streak), scale], dtype=torch.float64))
        self.finite_before = bool(sd["any_finite_step"])
        self._snapshot = None
        self._reported_start = None
        if self._run is not None:
            self._run.zero_()  # runs folded before the load are not this state's
        if self._logged_skipped == 0:  # a fresh scaler resuming: the saving run reported (most of) its skips; a
            self._logged_skipped = float(sd["skipped_steps"])  # copy (pickle, deepcopy) carries its own count

    def __getstate__(self) -> dict[str, Any]:
        # the owner pickles the statistics in its pending state; the copy re-creates the tensors lazily
        d = self.__dict__.copy()
        d["ring"] = d["counters"] = d["_run"] = None
        d["steps"] = d["folded"] = 0
        d["_pos_cache"], d["_snapshot"], d["_rows"], d["_pending"] = {}, None, (), []
        d["_last_log"] = -math.inf
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
