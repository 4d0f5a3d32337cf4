"""The side-by-side runner behind ``mixprec compare``.

Protocol:

1. One workload: its model is deep-copied for every row before anything is cast, so every
   precision starts from the same FP32 weights; its first ``steps`` batches are materialised
   once and the same tensors are fed to every row; each row has its own RNG stream, seeded
   identically, so dropout masks match too. ``seed`` also builds the built-in workloads, so
   it picks their initial weights and batch order: another seed, another run of the same model.
2. Rows are trained *interleaved*: step ``i`` of every row runs before step ``i + 1`` of any,
   in an order rotated each step (A B C, B C A, ...), so drift in clocks, temperature or
   background load spreads over all rows instead of biasing the last one.
3. The first ``warmup`` steps are not timed (allocator warm-up, autotuning, lazy optimizer
   state); each timed step is bracketed by device synchronisations. Reported: median and
   p10-p90 of the per-step times.
4. Memory is measured on the last warm-up step (optimizer state exists by then): the CUDA
   allocator's peak on a GPU, a live-tensor tracker on a CPU, plus the row's persistent state.
5. At the end every row is evaluated on the held-out batches in its own precision.

The ``torch-amp`` baseline row is the loop the PyTorch AMP recipe recommends, verbatim:
``torch.autocast`` for the forward pass, ``torch.amp.GradScaler`` to scale the loss,
``scaler.unscale_`` before clipping, ``scaler.step`` and ``scaler.update``.

On a CPU, FP16 rows run under :class:`FP16Emulation` (FP16 storage and rounding, FP32
arithmetic, as GPU kernels do) unless native CPU FP16 is asked for.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import hashlib
import itertools
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn

from .._errors import closest
from .._fp8 import fp8_row_label
from .._policy import PRESETS, Policy
from .._tree import tree_map
from ._environment import environment
from ._fp16_emulation import FP16Emulation
from ._memory import measure_step_memory, model_state_bytes, parameter_count
from ._timing import count_flops, peak_tflops, summarize, timed
from ._workloads import BUILTIN_WORKLOADS, BenchError, Workload, load_workload

__all__ = [
    "ALL_PRESETS",
    "BASELINE",
    "CompareResult",
    "ProgressFn",
    "RowResult",
    "default_presets",
    "json_safe",
    "parse_presets",
    "resolve_device",
    "run_compare",
]

BASELINE = "torch-amp"
#: Every preset row ``compare`` knows, in display order.
ALL_PRESETS: tuple[str, ...] = (
    "fp32", "tf32", "bf16-mixed", "fp16-mixed", "bf16-master", "bf16-master-r16", "fp16-master", "bf16-pure", "fp16-pure",
)
# On a CPU the default list must finish in about three minutes on two cores: tf32 is fp32
# there, and the pure presets are for study (fp16-pure diverges by design).
_CPU_DEFAULT = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master")


def default_presets(device: torch.device | str) -> tuple[str, ...]:
    """The presets ``compare`` runs when none are given: all on a GPU, a short list on a CPU."""
    return ALL_PRESETS if torch.device(device).type == "cuda" else _CPU_DEFAULT


def parse_presets(spec: str | Sequence[str] | None, device: torch.device | str = "cpu") -> list[str]:
    """Turn ``"fp32,bf16-mixed"`` (or a list, ``"all"``, ``None`` for the default) into preset names.

    Aliases (``16-mixed``, ``mixed_bfloat16``, ...) resolve to their preset; ``torch-amp`` in
    the list is accepted and ignored (the baseline is controlled separately).

    Raises:
        BenchError: an unknown name (the message names the closest preset), or an empty list.
    """
    if spec is None:
        return list(default_presets(device))
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    items = [s for s in items if s]
    if not items:
        raise BenchError(f"no presets given; choose from: {', '.join(ALL_PRESETS)} (or 'all')")
    out: list[str] = []
    for item in items:
        key = item.lower()
        if key == "all":
            names: Sequence[str] = ALL_PRESETS
        elif key == BASELINE:
            continue
        elif key in PRESETS:
            names = [key]
        else:
            try:
                pol = Policy.parse(key) if "=" not in key else None
            except (ValueError, TypeError):
                pol = None
            if pol is not None and pol.name in PRESETS:
                names = [pol.name]
            else:
                fp8 = [n for n in PRESETS if n not in ALL_PRESETS and PRESETS[n].fp8 != "none"]
                choices = f"choose from: {', '.join([*ALL_PRESETS, *fp8])}, or 'all' (the {BASELINE} baseline is set with --baseline)"
                if pol is not None or "=" in key:
                    # an alias of a policy that is no preset (bf16-true), or a policy string the comma list cut up
                    what = f"{item!r} is the policy {str(pol)!r}" if pol is not None else f"{item!r} is part of a policy string"
                    raise BenchError(f"{what}, not one of the presets compare runs as its rows; {choices}")
                near = closest(item, [*ALL_PRESETS, *PRESETS, BASELINE, "all"])
                hint = f" (did you mean {near!r}?)" if near else ""
                raise BenchError(f"unknown preset {item!r}{hint}; {choices}")
        for n in names:
            if n not in out:
                out.append(n)
    return out


# ----- results ------------------------------------------------------------------------------------
@dataclasses.dataclass
class RowResult:
    """One row of the comparison (a preset or the baseline). Times in ms, memory in bytes."""

    name: str
    label: str
    kind: str  # "preset" | "baseline"
    status: str = "ok"  # "ok" | "unavailable" | "failed"
    reason: str | None = None
    policy: str | None = None
    compute_dtype: str | None = None
    param_dtype: str | None = None
    emulated_fp16: bool = False
    step_time_ms: dict[str, Any] | None = None
    throughput: float | None = None
    achieved_tflops: float | None = None
    mfu: float | None = None
    peak_memory_bytes: int | None = None
    activation_memory_bytes: int | None = None
    memory_method: str | None = None
    model_state_bytes: int | None = None
    model_state_bytes_per_param: float | None = None
    final_train_loss: float | None = None
    val_loss: float | None = None
    val_metric: float | None = None
    train_loss_gap: float | None = None
    val_loss_gap: float | None = None
    val_metric_gap: float | None = None
    skipped_steps: int | None = None
    final_loss_scale: float | None = None
    losses: list[float | None] = dataclasses.field(default_factory=list)
    loss_scales: list[float | None] = dataclasses.field(default_factory=list)
    init_weights_sha256: str | None = None
    wall_seconds: float | None = None
    compiled: str | None = None  # the torch.compile backend, None when eager
    compile_seconds: float | None = None  # extra time of the warm-up steps over timed ones (compilation, cold cache)
    warm_compile_seconds: float | None = None  # the same for one step after torch._dynamo.reset() (caches warm)
    recompiles: int | None = None  # timed steps during which dynamo compiled again (None when eager)

    def to_dict(self) -> dict[str, Any]:
        return json_safe(dataclasses.asdict(self))


@dataclasses.dataclass
class CompareResult:
    """Everything ``compare`` measured, with the environment it ran in."""

    environment: dict[str, Any]
    workload: dict[str, Any]
    settings: dict[str, Any]
    rows: list[RowResult]
    notes: list[str]

    def row(self, name: str) -> RowResult:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (schema ``mixprec.compare/1``; see ``mixprec.bench`` docs)."""
        return {
            "schema": "mixprec.compare/1",
            "environment": json_safe(self.environment),
            "workload": json_safe(self.workload),
            "settings": json_safe(self.settings),
            "rows": [r.to_dict() for r in self.rows],
            "notes": list(self.notes),
        }


def json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, torch.dtype):
        return str(obj).replace("torch.", "")
    return obj


# ----- helpers ------------------------------------------------------------------------------------
def _to_device(obj: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device, non_blocking=False), obj)


def _hash_tensors(objs: Any) -> str:
    # not mixprec._tree: the hash covers dict keys and non-tensor leaves too, not only the tensors
    h = hashlib.sha256()

    def visit(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous().reshape(-1)
            h.update(f"{t.dtype}{tuple(o.shape)}".encode())
            if t.numel():
                # the raw bytes in one copy (bytes(storage) goes element by element: seconds per model)
                raw = t.view(torch.uint8)
                h.update(ctypes.string_at(raw.data_ptr(), raw.numel()))
        elif isinstance(o, dict):
            for k in o:
                h.update(str(k).encode())
                visit(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                visit(v)
        else:
            h.update(repr(o).encode())

    visit(objs)
    return h.hexdigest()


def _dtype_short(dt: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt, str(dt))


def _check_loss(loss: Any, workload: Workload) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise BenchError(f"workload {workload.name!r}: loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.numel() != 1 or not loss.dtype.is_floating_point:
        raise BenchError(
            f"workload {workload.name!r}: loss_fn must return a scalar floating tensor, got shape "
            f"{tuple(loss.shape)} {loss.dtype} (reduce it, e.g. .mean())"
        )
    if not loss.requires_grad:
        raise BenchError(f"workload {workload.name!r}: the loss does not require grad (is the model's output detached?)")
    return loss


class _RNG:
    """A private RNG stream per row: swapped in around each of its steps."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            self.cpu = torch.get_rng_state()
            self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state(self.device) if self.cuda is not None else None
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        try:
            yield
        finally:
            self.cpu = torch.get_rng_state()
            torch.set_rng_state(saved_cpu)
            if self.cuda is not None and saved_cuda is not None:
                self.cuda = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(saved_cuda, self.device)


# ----- the rows -----------------------------------------------------------------------------------
class _Run:
    """State of one row while training."""

    def __init__(self, row: RowResult, workload: Workload, device: torch.device, emulate: bool, seed: int) -> None:
        self.row = row
        self.workload = workload
        self.device = device
        self.emulation = FP16Emulation() if emulate else None
        self.rng = _RNG(seed, device)
        self.losses: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []
        self.skipped: list[torch.Tensor] = []
        self.times: list[float] = []
        self.warmup_times: list[float] = []  # and timed steps during which dynamo compiled (see step())
        self.recompiles = 0  # those timed steps: a compiled row should have none after its warm-up
        self.compiled = False
        self.compiled_step = False  # MixedPrecision(fused=True): the optimizer steps mixprec covers compile
        self.model: nn.Module
        self.active_seconds = 0.0

    def _emu(self) -> contextlib.AbstractContextManager[Any]:
        return self.emulation if self.emulation is not None else contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def train_step(self, batch: Any, measure: bool) -> None:
        raise NotImplementedError

    def optimizer(self) -> Any:
        raise NotImplementedError

    def final_scale(self) -> float:
        raise NotImplementedError

    def step(self, batch: Any, *, timed_step: bool, measure: bool) -> None:
        frames = _compiled_frames() if self.compiled else 0
        with self.rng.active(), self._emu():
            _, seconds = timed(lambda: self.train_step(batch, measure), self.device)
        self.active_seconds += seconds
        # A compiled row's step that compiled (a recompile after the warm-up: a new shape, a torchao
        # subclass dispatch, ...) is compile time, not step time.
        recompiled = self.compiled and _compiled_frames() != frames
        self.recompiles += timed_step and recompiled
        (self.times if timed_step and not recompiled else self.warmup_times).append(seconds)

    def _memory_region(self, measure: bool, optimizer: Any) -> contextlib.AbstractContextManager[Any]:
        """The step-memory measurement around one step (``measure``), or nothing.

        Not for a compiled row off CUDA: the CPU measurement is a ``TorchDispatchMode``, which
        cannot see inside compiled graphs, and a frame dynamo meets under a dispatch mode is
        skipped for good (the model would run eagerly from then on).
        """
        if not measure:
            return contextlib.nullcontext()
        if self.compiled and self.device.type != "cuda":
            self.row.memory_method = "not measured: compiled on a CPU (the live-tensor tracker cannot see into compiled graphs)"
            return contextlib.nullcontext()
        # fused_step=True: under the tracker (a dispatch mode) the optimizer step would run eagerly, not compiled.
        if self.compiled_step and self.device.type != "cuda":
            self.row.memory_method = ("not measured: compiled optimizer step on a CPU (the live-tensor tracker cannot see "
                                      "into compiled graphs)")
            return contextlib.nullcontext()
        return measure_step_memory(self.device, model_state_bytes(self.model, optimizer))

    def _measure_state(self) -> None:
        self.row.model_state_bytes = model_state_bytes(self.model, self.optimizer())

    def _record_memory(self, box: list[Any] | None) -> None:
        if box:
            m = box[0]
            self.row.peak_memory_bytes = m.peak_bytes
            self.row.activation_memory_bytes = m.growth_bytes
            self.row.memory_method = m.method

    @torch.no_grad()
    def evaluate(self) -> None:
        w = self.workload
        if not w.eval_batches:
            return
        was_training = self.model.training
        self.model.eval()
        try:
            with self.rng.active(), self._emu():
                losses, metrics = [], []
                for b in w.eval_batches:
                    with self.autocast():
                        losses.append(w.loss_fn(self.model, b).float())
                        if w.metric_fn is not None:
                            metrics.append(float(w.metric_fn(self.model, b)))
                self.row.val_loss = float(torch.stack(losses).mean().item())
                if metrics:
                    self.row.val_metric = sum(metrics) / len(metrics)
        finally:
            self.model.train(was_training)


def _with_f8_layers(pol: Policy, f8_layers: str | None) -> Policy:
    """``pol`` with its FP8 layer choice replaced (FP8 policies only; ``pol`` itself otherwise or for ``None``).

    Raises:
        BenchError: ``f8_layers`` is not a valid ``f8_layers=`` value.
    """
    if f8_layers is None or pol.fp8 == "none":
        return pol
    text = str(pol).replace(f"f8_layers={'+'.join(pol.fp8_layers) or 'none'}", f"f8_layers={f8_layers}")
    try:
        return Policy.parse(text)
    except ValueError as e:
        raise BenchError(f"f8_layers={f8_layers!r}: {e}") from None


class _MixprecRun(_Run):
    def __init__(self, preset: str | Policy, model: nn.Module, workload: Workload, device: torch.device, emulate: bool,
                 seed: int, row: RowResult, compile_backend: str | None = None, first_batch: Any = None,
                 weight_edits: str = "values", fused_step: bool | None = None) -> None:
        super().__init__(row, workload, device, emulate, seed)
        from .._precision import MixedPrecision

        self.prec = MixedPrecision(preset, weight_edits=weight_edits,  # type: ignore[arg-type]  # checked in run_compare
                                   fused=fused_step)
        self.compiled_step = fused_step is True
        model = model.to(device)
        opt = workload.optimizer_fn(model.parameters())
        if not isinstance(opt, torch.optim.Optimizer):
            raise BenchError(
                f"workload {workload.name!r}: optimizer_fn must return a torch.optim.Optimizer, got {type(opt).__name__}"
            )
        with warnings.catch_warnings():
            if emulate:  # the FP16-on-CPU speed warning does not apply to the emulation
                warnings.filterwarnings("ignore", message="fp16 on CPU", category=UserWarning)
            warnings.filterwarnings("ignore", message="bf16 on CPU", category=UserWarning)
            if self.prec.policy.fp8_layers == ("auto",):  # the plan is measured on a batch, with the workload's loss
                self.model, self.opt = self.prec.prepare(model, opt, check_batch=first_batch, loss_fn=workload.loss_fn)
            else:
                self.model, self.opt = self.prec.prepare(model, opt)
        if compile_backend is not None:  # prepare first, then compile: the order the README recommends
            self.model = cast(nn.Module, torch.compile(self.model, backend=compile_backend))
            self.compiled = True

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self.prec.autocast()

    def optimizer(self) -> Any:
        return self.opt

    def train_step(self, batch: Any, measure: bool) -> None:
        w, prec = self.workload, self.prec
        mem_ctx = self._memory_region(measure, self.opt)
        with mem_ctx as box:
            with prec.autocast():
                loss = w.loss_fn(self.model, batch)
            if not self.losses:
                _check_loss(loss, w)
            prec.backward(loss)
            if w.clip_grad_norm:
                prec.clip_grad_norm_(w.clip_grad_norm)
            info = prec.step(self.opt)
            if measure:
                self._measure_state()
            self.opt.zero_grad(set_to_none=True)
        if measure:
            self._record_memory(box)
        self.losses.append(loss.detach().float())
        self.scales.append(info.scale.detach().float().reshape(()))
        self.skipped.append(info.skipped.detach().reshape(()))

    def final_scale(self) -> float:
        return float(self.prec.scaler.loss_scale.item())


class _TorchAmpRun(_Run):
    """The baseline, written as the PyTorch AMP recipe recommends (autocast + GradScaler)."""

    def __init__(self, dtype: torch.dtype, model: nn.Module, workload: Workload, device: torch.device, emulate: bool,
                 seed: int, row: RowResult, compile_backend: str | None = None) -> None:
        super().__init__(row, workload, device, emulate, seed)
        self.dtype = dtype
        self.model = model.to(device)
        self.opt = workload.optimizer_fn(self.model.parameters())
        if compile_backend is not None:
            self.model = cast(nn.Module, torch.compile(self.model, backend=compile_backend))
            self.compiled = True
        if not isinstance(self.opt, torch.optim.Optimizer):
            raise BenchError(
                f"workload {workload.name!r}: optimizer_fn must return a torch.optim.Optimizer, got {type(self.opt).__name__}"
            )
        # GradScaler is needed for float16 only; with enabled=False it is a pass-through.
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        self.one = torch.ones((), device=device)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def optimizer(self) -> Any:
        return self.opt

    def _scale(self) -> torch.Tensor:
        s = getattr(self.scaler, "_scale", None)  # the scale tensor; get_scale() would sync
        return s.detach().clone().float().reshape(()) if isinstance(s, torch.Tensor) and self.scaler.is_enabled() else self.one

    def train_step(self, batch: Any, measure: bool) -> None:
        w, model, opt, scaler = self.workload, self.model, self.opt, self.scaler
        mem_ctx = self._memory_region(measure, opt)
        with mem_ctx as box:
            with torch.autocast(device_type=self.device.type, dtype=self.dtype):
                loss = w.loss_fn(model, batch)
            if not self.losses:
                _check_loss(loss, w)
            scaler.scale(loss).backward()
            if w.clip_grad_norm:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), w.clip_grad_norm)
            scale_used = self._scale()
            scaler.step(opt)
            scaler.update()
            if measure:
                self._measure_state()
            opt.zero_grad(set_to_none=True)
        if measure:
            self._record_memory(box)
        self.losses.append(loss.detach().float())
        self.scales.append(scale_used)
        # GradScaler skips exactly the steps whose gradients overflowed, and then backs off.
        self.skipped.append(self._scale() < scale_used)

    def final_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0


# ----- the comparison -----------------------------------------------------------------------------
ProgressFn = Callable[[str, str, int, int], None]  # (event, row label, step, total steps)

_EMU_COMPILE = (
    "the CPU FP16 emulation rounds at every operator through a dispatch mode that torch.compile does not trace; "
    "run fp16 rows compiled on a GPU, or with --native-fp16 (torch's CPU FP16 kernels)"
)


def _compiled_frames() -> int:
    """How many frames dynamo has compiled in this process (its ``frames.total`` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def check_compile_backend(backend: str | None) -> None:
    """Raise :class:`BenchError` unless ``backend`` is ``None`` or a ``torch.compile`` backend name."""
    if backend is None:
        return
    if not isinstance(backend, str) or not backend:
        raise BenchError(f"compile={backend!r}: give a torch.compile backend name such as 'inductor', or None for eager")
    from torch._dynamo import list_backends

    known = sorted(set(list_backends(exclude_tags=())) | {"inductor"})
    if backend not in known:
        raise BenchError(f"compile backend {backend!r} is not one torch.compile knows; choose from {', '.join(known)}")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"``/``None`` -> CUDA when available, else CPU; checks that CUDA exists when asked."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise BenchError(f"unknown device {device!r}; use auto, cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda was asked for but no CUDA device is available (torch.cuda.is_available() is False)")
    if dev.type not in ("cpu", "cuda"):
        raise BenchError(f"device {device!r} is not supported by compare; use cpu or cuda")
    return dev


def _baseline_dtypes(baseline: str, device: torch.device, presets: Sequence[str], emulate_fp16: bool) -> list[torch.dtype]:
    """The torch-amp baseline rows asked for: ``auto``, ``fp16``, ``bf16``, ``fp16,bf16`` or ``none``."""
    out: list[torch.dtype] = []
    for part in [p.strip().lower() for p in baseline.split(",") if p.strip()] or ["none"]:
        if part in ("none", "off", "no"):
            continue
        if part == "fp16":
            dt = torch.float16
        elif part == "bf16":
            dt = torch.bfloat16
        elif part == "auto":
            if device.type == "cuda":
                dt = torch.float16  # the recipe's canonical case: float16 autocast + GradScaler
            else:
                # On a CPU, FP16 autocast is only meaningful under the emulation; otherwise BF16.
                uses_fp16 = any(PRESETS[p].compute_dtype == torch.float16 for p in presets)
                dt = torch.float16 if (emulate_fp16 and uses_fp16) else torch.bfloat16
        else:
            raise BenchError(f"unknown baseline {part!r}; use auto, fp16, bf16, fp16,bf16 or none")
        if dt not in out:
            out.append(dt)
    return out


def run_compare(
    workload: str | Workload = "gpt",
    presets: str | Sequence[str] | None = None,
    *,
    baseline: str = "auto",
    steps: int | None = None,
    warmup: int | None = None,
    device: str | torch.device | None = "auto",
    fp16_cpu: str = "emulate",
    seed: int = 0,
    peak_tflops_override: float | None = None,
    progress: ProgressFn | None = None,
    workload_options: dict[str, Any] | None = None,
    compile: str | None = None,
    f8_layers: str | None = None,
    weight_edits: str | None = None,
    fused_step: bool | None = None,
) -> CompareResult:
    """Train ``workload`` under each preset (and the torch-amp baseline) side by side.

    Args:
        workload: A built-in name, ``"MODULE:FUNCTION"``, or a :class:`Workload`.
        presets: Comma-separated names, a list, ``"all"`` or ``None`` (the device's default).
        baseline: ``"auto"`` (fp16 on CUDA; on a CPU fp16 when the FP16 emulation runs an fp16
            preset, else bf16), ``"fp16"``, ``"bf16"``, ``"fp16,bf16"`` (two baseline rows, named
            ``torch-amp-fp16`` and ``torch-amp-bf16``) or ``"none"``. One baseline row is named ``torch-amp``.
        steps: Training steps per row (default: 200 on a CPU, 300 on a GPU).
        warmup: Untimed steps at the start (default: 5 on a CPU, 10 on a GPU; at most steps - 1).
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or a device.
        fp16_cpu: ``"emulate"`` (FP16 storage, FP32 arithmetic) or ``"native"`` (torch's CPU
            FP16 kernels: slow, and their accumulation differs from a GPU's).
        seed: Seeds a built-in workload's model initialisation and data order (its ``seed``
            option, unless ``workload_options`` sets ``seed`` itself) and every row's private
            RNG stream (dropout and other random ops). All rows of one run share the same
            initial weights and batches whatever the seed; a user workload (``MODULE:FUNCTION``
            or a :class:`Workload`) seeds itself (``-o seed=...`` when its function takes a seed).
        peak_tflops_override: The device's dense peak TFLOP/s for MFU, when it is not in
            :data:`mixprec.bench._timing.DENSE_PEAK_TFLOPS`.
        progress: ``progress(event, row_label, step, total)`` with event ``"start"``, ``"step"``,
            ``"eval"`` or ``"done"``.
        workload_options: Size options for :func:`load_workload` (when ``workload`` is a name).
        compile: A ``torch.compile`` backend (``"inductor"``, ``"aot_eager"``, ...) to compile every
            row's model with, the baseline's included (mixprec rows: ``prepare`` first, then
            ``torch.compile``), or ``None`` for eager. Step times then exclude compilation, which
            is reported per row as ``compile_seconds``: the time the warm-up steps took beyond as
            many timed steps (the first step compiles; a recompile in warm-up counts too); a later
            step during which dynamo compiled again is moved out of the timed steps into it. The run
            compiles into a fresh ``TORCHINDUCTOR_CACHE_DIR`` (and ``TRITON_CACHE_DIR``), so this is
            the cold compile (rows whose graphs are identical share them). After training, each row
            takes one more step after ``torch._dynamo.reset()``: its time beyond a typical step is
            ``warm_compile_seconds``, the compile with Inductor's caches warm (in this process; a
            second run of a script also loads them from disk: ``benchmarks/compile_cold.py``
            measures both in fresh processes).

        f8_layers: Which linears the FP8 rows (``fp8-tensorwise``, ``fp8-rowwise``) convert,
            instead of their ``f8_layers=all``: ``"auto"`` (the measured plan,
            :func:`mixprec.numerics.fp8_plan`, run at ``prepare`` on the first batch with the
            workload's loss), globs joined by ``+``, ``"all"`` or ``"none"``. The row keeps its
            preset's name, its label says ``f8_layers=...`` and its ``policy`` is the full string.
            Other rows are unaffected.
        weight_edits: ``MixedPrecision(weight_edits=...)`` for every mixprec row (``"values"``,
            the default, or ``"versions"``; only master-weight presets read it): what the
            value-based edit check of the half weights costs a master preset's step. A row that
            differs from the default says ``weight_edits=...`` in its label.
        fused_step: ``MixedPrecision(fused=...)`` for every mixprec row: ``True`` runs the optimizer
            steps mixprec covers as compiled kernels (the master step too, whose edit check is then
            inside the kernel), ``False`` eager, ``None`` (default) the preset's own rule. A row
            run with ``True`` or ``False`` says ``fused_step=...`` in its label.
    Returns:
        A :class:`CompareResult`.

    Raises:
        BenchError: bad arguments or a workload that breaks the contract.
    """
    dev = resolve_device(device)
    if fp16_cpu not in ("emulate", "native"):
        raise BenchError(f"fp16_cpu={fp16_cpu!r}; use 'emulate' or 'native'")
    check_compile_backend(compile)
    if weight_edits is not None:
        from .._master import check_weight_edits

        try:
            check_weight_edits(weight_edits)
        except ValueError as e:
            raise BenchError(str(e)) from None
    names = parse_presets(presets, dev)
    if f8_layers is not None and not any(PRESETS[n].fp8 != "none" for n in names):
        raise BenchError(
            f"--f8-layers {f8_layers!r} applies to the FP8 rows (fp8-tensorwise, fp8-rowwise), and none of the presets "
            f"({', '.join(names)}) is one; add an FP8 preset or drop --f8-layers"
        )
    steps = steps if steps is not None else (300 if dev.type == "cuda" else 200)
    if steps < 2:
        raise BenchError(f"--steps {steps}: need at least 2 steps (one warm-up, one timed)")
    warmup = warmup if warmup is not None else (10 if dev.type == "cuda" else 5)
    if warmup < 1:
        raise BenchError(f"--warmup {warmup}: need at least 1 warm-up step (memory is measured on the last one)")
    warmup = min(warmup, steps - 1)
    emulate = dev.type == "cpu" and fp16_cpu == "emulate"
    amp_dtypes = _baseline_dtypes(baseline, dev, names, emulate)
    w = load_workload(workload, **_workload_options(workload, seed, workload_options))

    # --- the shared inputs: initial weights and batches ---
    pristine = w.model.float() if any(p.dtype != torch.float32 for p in w.model.parameters() if p.is_floating_point()) else w.model
    n_params = parameter_count(pristine)
    try:
        cpu_batches = list(itertools.islice(iter(w.batches), steps))
    except BenchError:
        raise
    except Exception as e:
        raise BenchError(f"workload {w.name!r}: iterating its batches raised {type(e).__name__}: {e}") from None
    if len(cpu_batches) < steps:
        raise BenchError(f"workload {w.name!r}: its batches ran out after {len(cpu_batches)} of the {steps} steps asked for")
    batches = [_to_device(b, dev) for b in cpu_batches]
    w_eval = copy.copy(w)
    w_eval.eval_batches = [_to_device(b, dev) for b in (w.eval_batches or [])]
    items = w.count_items(cpu_batches[0])
    init_sha = _hash_tensors(pristine.state_dict())
    batches_sha = _hash_tensors(cpu_batches)

    # FLOPs of one training step (forward + backward), counted once in FP32 on a throwaway copy.
    flops = _count_step_flops(pristine, w, batches[0], dev)

    # --- the rows ---
    runs: list[_Run] = []
    rows: list[RowResult] = []
    for name in names:
        pol = _with_f8_layers(PRESETS[name], f8_layers)
        is_fp16 = torch.float16 in (pol.compute_dtype, pol.param_dtype)
        emu_row = emulate and is_fp16
        label = name + (" (fp16 emulated)" if emu_row else " (native CPU fp16)" if is_fp16 and dev.type == "cpu" else "")
        if pol is not PRESETS[name]:
            label += f" f8_layers={'+'.join(pol.fp8_layers) or 'none'}"
        label += fp8_row_label(pol, dev)  # mixprec._fp8: " (FP8 emulated)" where no FP8 GEMM exists (CPU, pre-Hopper)
        if weight_edits not in (None, "values") and pol.master_dtype is not None:
            label += f" weight_edits={weight_edits}"
        if fused_step is not None:
            label += f" fused_step={'on' if fused_step else 'off'}"
        row = RowResult(
            name=name, label=label, kind="preset", policy=str(pol), compute_dtype=_dtype_short(pol.compute_dtype),
            param_dtype=_dtype_short(pol.param_dtype), emulated_fp16=emu_row,
        )
        rows.append(row)
        row.compiled = compile
        try:
            model = copy.deepcopy(pristine)
            row.init_weights_sha256 = _hash_tensors(model.state_dict())
            if compile is not None and emu_row:
                raise ValueError(_EMU_COMPILE)
            runs.append(_MixprecRun(name if pol is PRESETS[name] else pol, model, w_eval, dev, emu_row, seed, row, compile,
                                    first_batch=batches[0], weight_edits=weight_edits or "values",
                                    fused_step=fused_step))
        except BenchError:
            raise
        except Exception as e:  # MixedPrecision rejected the preset here (or is not built yet)
            if pol is not PRESETS[name] and str(e).startswith("f8_layers glob"):
                raise BenchError(f"--f8-layers {f8_layers!r}: {_one_line(e)}") from None  # the user's argument
            row.status, row.reason = "unavailable", _one_line(e)
    for amp_dtype in amp_dtypes:
        emu_row = emulate and amp_dtype == torch.float16
        short = _dtype_short(amp_dtype)
        label = f"{BASELINE} {short}" + (" (emulated)" if emu_row else " (native CPU fp16)" if short == "fp16" and dev.type == "cpu" else "")
        row = RowResult(name=BASELINE if len(amp_dtypes) == 1 else f"{BASELINE}-{short}", label=label, kind="baseline", compute_dtype=short, param_dtype="fp32",
                        emulated_fp16=emu_row, policy=f"torch.autocast({short}) + torch.amp.GradScaler")
        rows.append(row)
        row.compiled = compile
        try:
            model = copy.deepcopy(pristine)
            row.init_weights_sha256 = _hash_tensors(model.state_dict())
            if compile is not None and emu_row:
                raise ValueError(_EMU_COMPILE)
            runs.append(_TorchAmpRun(amp_dtype, model, w_eval, dev, emu_row, seed, row, compile))
        except BenchError:
            raise
        except Exception as e:
            row.status, row.reason = "unavailable", _one_line(e)

    # --- interleaved training ---
    if progress:
        for r in runs:
            progress("start", r.row.label, 0, steps)
    limits = contextlib.ExitStack()
    if compile is not None:
        limits.enter_context(_fresh_compile_caches())
        # Rows are instances of one model class: dynamo keeps one cache entry per row (and two per row
        # once evaluation runs under no_grad), so the default limit of 8 would send later rows to eager.
        from torch._dynamo import config as dynamo_config

        limits.enter_context(dynamo_config.patch(recompile_limit=max(8, 4 * len(runs)),
                                                        accumulated_recompile_limit=max(256, 16 * len(runs))))
    with limits:
        _train_and_evaluate(runs, batches, steps, warmup, progress, items, flops, dev, peak_tflops_override, n_params)
        if compile is not None:
            _warm_compile(runs, batches[0])
    _gaps(rows, w)
    unit = w.unit

    env = environment(dev)
    notes = _notes(dev, rows, emulate, amp_dtypes, env)
    if compile is not None:
        notes.append(
            f"Compiled: every row's model runs torch.compile(backend={compile!r}) (mixprec rows: prepare, then compile); "
            "step times exclude compilation, 'compile s' is the extra time of the warm-up steps (and of any later step "
            "that recompiled) over timed ones, compiled into a fresh Inductor cache (cold; a row whose graphs an earlier "
            "row compiled reuses them), 'warm s' the same for one step after torch._dynamo.reset() (caches warm)."
            + (" Peak memory is not measured for compiled rows on a CPU (the live-tensor tracker cannot see into "
               "compiled graphs, and dynamo stops compiling a model it meets under it)." if dev.type != "cuda" else "")
        )
    workload_info = {
        "name": w.name, "description": w.description, "parameters": n_params, "unit": unit,
        "items_per_step": items, "flops_per_step": flops, "options": dict(w.options),
        "eval_batches": len(w.eval_batches or []), "metric": w.metric_name,
        "metric_higher_is_better": w.higher_is_better, "clip_grad_norm": w.clip_grad_norm,
        "initial_weights_sha256": init_sha, "batches_sha256": batches_sha,
        "final_train_loss_window": _window(steps),
    }
    settings = {
        "presets": names, "baseline": ",".join(_dtype_short(d) for d in amp_dtypes) or None, "steps": steps,
        "warmup": warmup, "timed_steps": steps - warmup, "memory_step": warmup - 1, "device": str(dev),
        "fp16_cpu": fp16_cpu if dev.type == "cpu" else None, "seed": seed, "interleaved": True,
        "peak_tflops_override": peak_tflops_override, "compile": compile, "f8_layers": f8_layers,
        "weight_edits": weight_edits or "values", "fused_step": fused_step,
    }
    return CompareResult(environment=env, workload=workload_info, settings=settings, rows=rows, notes=notes)



def _train_and_evaluate(runs: list[_Run], batches: list[Any], steps: int, warmup: int, progress: ProgressFn | None,
                        items: int, flops: int | None, dev: torch.device, peak_tflops_override: float | None,
                        n_params: int) -> None:
    """Train every row interleaved (A B C ..., then B C ... A), then evaluate and summarise each."""
    for step in range(steps):
        k = step % max(1, len(runs))
        for run in runs[k:] + runs[:k]:
            if run.row.status != "ok":
                continue
            try:
                run.step(batches[step], timed_step=step >= warmup, measure=step == warmup - 1)
            except BenchError:
                raise
            except Exception as e:
                run.row.status, run.row.reason = "failed", f"step {step}: {_one_line(e)}"
                continue
            if progress:
                progress("step", run.row.label, step + 1, steps)

    # --- evaluation and summaries ---
    for run in runs:
        row = run.row
        if row.status != "ok":
            continue
        if progress:
            progress("eval", row.label, steps, steps)
        try:
            run.evaluate()
        except Exception as e:
            row.status, row.reason = "failed", f"evaluation: {_one_line(e)}"
            continue
        _summarise(run, row, items, flops, dev, peak_tflops_override, n_params)
        if progress:
            progress("done", row.label, steps, steps)


@contextlib.contextmanager
def _fresh_compile_caches() -> Iterator[None]:
    """Point Inductor's and Triton's on-disk caches at a new temporary directory for the block (then restore them)."""
    import tempfile

    keys = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    old = {k: os.environ.get(k) for k in keys}
    with tempfile.TemporaryDirectory(prefix="mixprec-compare-") as d:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(d, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(d, "triton")
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _warm_compile(runs: list[_Run], batch: Any) -> None:
    """Each compiled row: one more step after ``torch._dynamo.reset()``; its time beyond a typical step is the warm compile."""
    for run in runs:
        if run.row.status != "ok" or not run.times:
            continue
        torch._dynamo.reset()

        def one_step(run: _Run = run) -> None:
            run.train_step(batch, False)

        with run.rng.active(), run._emu():
            _, seconds = timed(one_step, run.device)
        typical = sorted(run.times)[len(run.times) // 2]
        run.row.warm_compile_seconds = max(0.0, seconds - typical)


def _workload_options(workload: str | Workload, seed: int, given: dict[str, Any] | None) -> dict[str, Any]:
    """The options a workload is built with: a built-in one takes ``seed`` unless it is given explicitly."""
    options = dict(given or {})
    if isinstance(workload, str) and workload.strip().lower() in BUILTIN_WORKLOADS:
        options.setdefault("seed", seed)
    return options


def _count_step_flops(model: nn.Module, w: Workload, batch: Any, dev: torch.device) -> int | None:
    probe = copy.deepcopy(model).to(dev)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        return count_flops(lambda: w.loss_fn(probe, batch).backward())


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if not isinstance(e, (ValueError, TypeError)) else text


def _window(steps: int) -> int:
    return max(1, steps // 10)


def _summarise(run: _Run, row: RowResult, items: int, flops: int | None, dev: torch.device,
               peak_override: float | None, n_params: int) -> None:
    losses = torch.stack(run.losses).cpu().tolist() if run.losses else []
    row.losses = [float(x) for x in losses]
    row.loss_scales = [float(x) for x in torch.stack(run.scales).cpu().tolist()] if run.scales else []
    row.skipped_steps = int(torch.stack(run.skipped).sum().item()) if run.skipped else 0
    row.final_loss_scale = run.final_scale()
    k = _window(len(losses))
    tail = [x for x in losses[-k:]]
    row.final_train_loss = sum(tail) / len(tail) if tail else None
    if run.times:
        row.step_time_ms = summarize(run.times)
        med_s = row.step_time_ms["median"] / 1e3
        row.throughput = items / med_s if med_s > 0 else None
        if flops:
            row.achieved_tflops = flops / med_s / 1e12
            if dev.type == "cuda":
                kind = row.compute_dtype or "fp32"
                if kind == "fp32" and row.policy and "tf32=1" in row.policy:
                    kind = "tf32"
                peak = peak_override or peak_tflops(torch.cuda.get_device_name(dev), kind)
                row.mfu = row.achieved_tflops / peak if peak else None
    if row.model_state_bytes is not None and n_params:
        row.model_state_bytes_per_param = row.model_state_bytes / n_params
    row.wall_seconds = run.active_seconds
    if row.compiled is not None and run.times:
        typical = sorted(run.times)[len(run.times) // 2]
        row.compile_seconds = sum(max(0.0, t - typical) for t in run.warmup_times)
    if row.compiled is not None:
        row.recompiles = run.recompiles


def _gaps(rows: list[RowResult], w: Workload) -> None:
    ref = next((r for r in rows if r.name == "fp32" and r.status == "ok"), None)
    if ref is None:
        return
    for r in rows:
        if r.status != "ok":
            continue
        if r.final_train_loss is not None and ref.final_train_loss is not None:
            r.train_loss_gap = r.final_train_loss - ref.final_train_loss
        if r.val_loss is not None and ref.val_loss is not None:
            r.val_loss_gap = r.val_loss - ref.val_loss
        if r.val_metric is not None and ref.val_metric is not None:
            r.val_metric_gap = r.val_metric - ref.val_metric


def _notes(dev: torch.device, rows: list[RowResult], emulate: bool, amp_dtypes: list[torch.dtype],
           env: dict[str, Any]) -> list[str]:
    notes: list[str] = []
    if dev.type == "cpu":
        flags = set(env.get("cpu", {}).get("flags", []))
        bf16_hw = "native BF16 dot products (avx512_bf16)" if "avx512_bf16" in flags or "amx_bf16" in flags else "no native BF16 instructions"
        fp16_hw = "AVX512-FP16/AMX-FP16" if ("avx512_fp16" in flags or "amx_fp16" in flags) else "no FP16 arithmetic units"
        notes.append(
            f"CPU run: these timings do not show GPU speed-ups. This CPU has {bf16_hw} and {fp16_hw}; half "
            "precision is usually slower than FP32 here, while on a GPU with tensor cores BF16/FP16 are typically "
            "1.5-3x faster. Read the loss, accuracy and memory columns; run on a GPU to measure speed."
        )
        if emulate and any(r.emulated_fp16 for r in rows):
            notes.append(
                "fp16 (emulated): FP16 storage and rounding at every operator, FP32 arithmetic (as GPU kernels "
                "compute); its numerics match a GPU's, its time is not a GPU's. Which ops autocast runs in fp16 follows "
                "torch's CPU autocast lists (CUDA's keep a few more ops, e.g. layer_norm, in FP32). --native-fp16 runs "
                "torch's CPU FP16 kernels instead."
            )
        notes.append("CPU memory: a live-tensor tracker (bytes of tensors alive at the peak, kernel workspaces excluded) plus persistent state.")
    for amp_dtype in amp_dtypes:
        notes.append(
            f"{BASELINE} {_dtype_short(amp_dtype)}: the PyTorch recipe loop (torch.autocast {_dtype_short(amp_dtype)}"
            + (" + torch.amp.GradScaler" if amp_dtype == torch.float16 else ", GradScaler disabled as the recipe does for bf16")
            + ") on FP32 parameters, same model, batches and optimizer."
        )
    for r in rows:
        bad = next((i for i, x in enumerate(r.losses) if x is None or not math.isfinite(x)), None)
        if r.status == "ok" and bad is not None:
            extra = " (fp16-pure is the unsafe baseline, kept for study)" if r.name == "fp16-pure" else ""
            notes.append(f"{r.label}: the training loss became non-finite at step {bad + 1}{extra}.")
    if not any(r.name == "fp32" and r.status == "ok" for r in rows):
        notes.append("No fp32 row: the gap columns need the fp32 preset in --presets.")
    return notes
