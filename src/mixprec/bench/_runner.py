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
    "MIN_SEEDS",
    "NOISE_K",
    "CompareResult",
    "RowResult",
    "SeedRow",
    "SeedsResult",
    "default_presets",
    "parse_presets",
    "parse_seeds",
    "run_compare",
    "run_compare_seeds",
    "seed_verdict",
]

BASELINE = "torch-amp"
#: Every preset row ``compare`` knows, in display order.
ALL_PRESETS: tuple[str, ...] = (
    "fp32", "tf32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-pure", "fp16-pure",
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
                near = closest(item, [*ALL_PRESETS, BASELINE, "all"])
                hint = f" Did you mean {near!r}?" if near else ""
                raise BenchError(
                    f"unknown preset {item!r};{hint} choose from: {', '.join(ALL_PRESETS)}, or 'all' "
                    f"(the {BASELINE} baseline is set with --baseline)"
                )
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
    compile_seconds: float | None = None  # extra time of the warm-up steps over timed ones (compilation)

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(dataclasses.asdict(self))


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
            "environment": _json_safe(self.environment),
            "workload": _json_safe(self.workload),
            "settings": _json_safe(self.settings),
            "rows": [r.to_dict() for r in self.rows],
            "notes": list(self.notes),
        }


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
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
        self.compiled = False
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


class _MixprecRun(_Run):
    def __init__(self, preset: str, model: nn.Module, workload: Workload, device: torch.device, emulate: bool, seed: int,
                 row: RowResult, compile_backend: str | None = None) -> None:
        super().__init__(row, workload, device, emulate, seed)
        from .._precision import MixedPrecision

        self.prec = MixedPrecision(preset)
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
            step during which dynamo compiled again is moved out of the timed steps into it.

    Returns:
        A :class:`CompareResult`.

    Raises:
        BenchError: bad arguments or a workload that breaks the contract.
    """
    dev = resolve_device(device)
    if fp16_cpu not in ("emulate", "native"):
        raise BenchError(f"fp16_cpu={fp16_cpu!r}; use 'emulate' or 'native'")
    check_compile_backend(compile)
    names = parse_presets(presets, dev)
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
        pol = PRESETS[name]
        is_fp16 = torch.float16 in (pol.compute_dtype, pol.param_dtype)
        emu_row = emulate and is_fp16
        label = name + (" (fp16 emulated)" if emu_row else " (native CPU fp16)" if is_fp16 and dev.type == "cpu" else "")
        label += fp8_row_label(pol, dev)  # mixprec._fp8: " (FP8 emulated)" where no FP8 GEMM exists (CPU, pre-Hopper)
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
            runs.append(_MixprecRun(name, model, w_eval, dev, emu_row, seed, row, compile))
        except BenchError:
            raise
        except Exception as e:  # MixedPrecision rejected the preset here (or is not built yet)
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
        # Rows are instances of one model class: dynamo keeps one cache entry per row (and two per row
        # once evaluation runs under no_grad), so the default limit of 8 would send later rows to eager.
        from torch._dynamo import config as dynamo_config

        limits.enter_context(dynamo_config.patch(recompile_limit=max(8, 4 * len(runs)),
                                                        accumulated_recompile_limit=max(256, 16 * len(runs))))
    with limits:
        _train_and_evaluate(runs, batches, steps, warmup, progress, items, flops, dev, peak_tflops_override, n_params)
    _gaps(rows, w)
    unit = w.unit

    env = environment(dev)
    notes = _notes(dev, rows, emulate, amp_dtypes, env)
    if compile is not None:
        notes.append(
            f"Compiled: every row's model runs torch.compile(backend={compile!r}) (mixprec rows: prepare, then compile); "
            "step times exclude compilation, 'compile s' is the extra time of the warm-up steps (and of any later step "
            "that recompiled) over timed ones."
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
        "peak_tflops_override": peak_tflops_override, "compile": compile,
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


# ----- several seeds: is the gap real? ------------------------------------------------------------
#: The noise band is ``±NOISE_K * fp32 noise``: two standard deviations of FP32 against itself, the
#: usual "indistinguishable" band (about 95 % of a normal spread).
NOISE_K = 2.0
#: Fewer seeds give no verdict: with 2 seeds the 95 % interval of a mean is ±12.7 standard errors
#: (Student's t), wide enough to call almost any gap "within noise".
MIN_SEEDS = 3
# Student's t, two-sided 95 % (0.975 quantile), by degrees of freedom; 1.96 beyond the table.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def _t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (the table's next lower entry: conservative)."""
    return _T975[max(k for k in _T975 if k <= df)] if df < 120 else 1.96


@dataclasses.dataclass
class SeedRow:
    """One row of a multi-seed comparison: its loss gap to FP32 per seed, their mean and spread, a verdict.

    ``values`` and ``gaps`` hold one entry per seed (``None`` where the row failed or diverged);
    ``gap_std`` is the sample standard deviation of the per-seed gaps (the seed-to-seed spread);
    ``within_noise`` is ``None`` when no verdict can be given (the row failed, or FP32 has no noise).
    """

    name: str
    label: str
    kind: str
    values: list[float | None]
    gaps: list[float | None]
    gap_mean: float | None = None
    gap_std: float | None = None
    gap_min: float | None = None
    gap_max: float | None = None
    within_noise: bool | None = None
    verdict: str = ""

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(dataclasses.asdict(self))


@dataclasses.dataclass
class SeedsResult:
    """What ``compare --seeds`` measured: one :class:`CompareResult` per seed and the per-row summary.

    ``metric`` is the loss compared (``"val_loss"`` when the workload has held-out batches, else
    ``"final_train_loss"``); ``noise`` is the FP32 noise floor, the sample standard deviation of FP32's
    own ``metric`` across the seeds; ``k`` the multiple of it a gap may reach and still be "within noise".
    """

    seeds: list[int]
    runs: list[CompareResult]
    rows: list[SeedRow]
    metric: str
    noise: float | None
    k: float
    notes: list[str]

    def row(self, name: str) -> SeedRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def run(self, seed: int) -> CompareResult:
        return self.runs[self.seeds.index(seed)]

    def seeds_dict(self) -> dict[str, Any]:
        """The ``seeds`` section of the JSON record (see ``mixprec.bench`` docs)."""
        runs = []
        for seed, r in zip(self.seeds, self.runs):
            d = r.to_dict()
            runs.append({"seed": seed, "workload": d["workload"], "settings": d["settings"], "rows": d["rows"]})
        return _json_safe({
            "seeds": list(self.seeds), "metric": self.metric, "noise": self.noise, "k": self.k,
            "rule": (f"within noise when gap_mean ± t95(n-1) * gap_std / sqrt(n) lies inside ±k * noise, outside when "
                     f"it lies outside, else no verdict; none with fewer than {MIN_SEEDS} seeds; noise = sample std "
                     f"of fp32's {self.metric} across seeds"),
            "rows": [r.to_dict() for r in self.rows], "runs": runs, "notes": list(self.notes),
        })

    def to_dict(self) -> dict[str, Any]:
        """The first seed's ``mixprec.compare/1`` record plus the ``seeds`` section."""
        d = self.runs[0].to_dict()
        d["seeds"] = self.seeds_dict()
        return d


def parse_seeds(spec: str | Sequence[int]) -> list[int]:
    """``"0,1,2"`` (or a list of ints) -> ``[0, 1, 2]``; ``"0-4"`` is ``0,1,2,3,4``.

    Raises:
        BenchError: not integers, a repeated seed, or fewer than two seeds.
    """
    shown = spec if isinstance(spec, str) else ",".join(str(s) for s in spec)
    out: list[int] = []
    try:
        if isinstance(spec, str):
            for part in (p.strip() for p in spec.split(",")):
                if not part:
                    continue
                lo, dash, hi = part.partition("-")
                if dash and lo.strip():
                    out.extend(range(int(lo), int(hi) + 1))
                else:
                    out.append(int(part))
        else:
            out = [int(s) for s in spec]
    except ValueError:
        raise BenchError(f"--seeds {shown}: expected comma-separated integers, e.g. --seeds 0,1,2") from None
    if len(set(out)) != len(out):
        raise BenchError(f"--seeds {shown}: a seed is repeated; give distinct seeds, e.g. --seeds 0,1,2")
    if len(out) < 2:
        raise BenchError(
            f"--seeds {shown}: need at least 2 seeds to measure the seed-to-seed noise, e.g. --seeds 0,1,2 "
            "(for a single run use --seed N)"
        )
    return out


def seed_verdict(gap_mean: float, noise: float, k: float = NOISE_K, *, gap_std: float = 0.0,
                 n: int | None = None) -> tuple[bool | None, str]:
    """Whether a mean gap to FP32 is within the noise band ``±k * noise``, and the sentence that says so.

    With ``n`` (the number of seeds) the verdict accounts for how well ``n`` seeds pin the mean
    down: the gap's 95 % interval is ``gap_mean ± t(n-1) * gap_std / sqrt(n)`` (Student's t).
    "within noise" when the whole interval lies inside the band, "outside noise" when it lies
    wholly outside, no verdict when it straddles the band (more seeds narrow it) or when there
    are fewer than :data:`MIN_SEEDS` seeds. Without ``n`` the mean alone is compared (a screen).

    Example:
        >>> seed_verdict(0.01, 0.02)
        (True, 'within noise (gap +0.0100 vs noise 0.0200)')
        >>> seed_verdict(0.05, 0.02, gap_std=0.002, n=4)
        (False, 'outside noise (gap +0.0500 ± 0.0032 (95 %, 4 seeds) vs band ±0.0400)')
        >>> seed_verdict(0.01, 0.02, gap_std=0.01, n=2)[0] is None
        True
    """
    if not (math.isfinite(gap_mean) and math.isfinite(noise)):
        return None, "no verdict (non-finite loss)"
    if noise <= 0:
        return None, "no verdict (fp32 loss identical across seeds: does the workload take a seed?)"
    if n is None:
        within = abs(gap_mean) <= k * noise
        return within, f"{'within' if within else 'outside'} noise (gap {gap_mean:+.4f} vs noise {noise:.4f})"
    if n < MIN_SEEDS:
        return None, (f"no verdict: {n} seeds are too few (a verdict needs >= {MIN_SEEDS}; the 95 % interval of a "
                      f"{n}-seed mean is ±{_t975(n - 1):.1f} standard errors); gap {gap_mean:+.4f}, noise {noise:.4f}")
    half = _t975(n - 1) * gap_std / math.sqrt(n)
    band = k * noise
    what = f"gap {gap_mean:+.4f} ± {half:.4f} (95 %, {n} seeds) vs band ±{band:.4f}"
    if abs(gap_mean) + half <= band:
        return True, f"within noise ({what})"
    if abs(gap_mean) - half > band:
        return False, f"outside noise ({what})"
    return None, f"no verdict: the interval straddles the band, more seeds would narrow it ({what})"


def _std(xs: Sequence[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def run_compare_seeds(
    workload: str | Workload = "gpt",
    presets: str | Sequence[str] | None = None,
    *,
    seeds: str | Sequence[int] = (0, 1, 2),
    k: float = NOISE_K,
    device: str | torch.device | None = "auto",
    progress: ProgressFn | None = None,
    workload_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> SeedsResult:
    """Run :func:`run_compare` once per seed and say, per row, whether its loss gap to FP32 is real.

    For each seed ``s`` the whole comparison runs with ``seed=s`` (a built-in workload's initial
    weights, batch order and every row's RNG stream). Per row and seed, the gap is the row's loss
    minus FP32's loss *of the same seed* (validation loss when the workload has held-out batches,
    else the final training loss). Reported per row: the mean gap over seeds and its spread (the
    sample standard deviation across seeds). The noise floor is FP32 against itself: the sample
    standard deviation of FP32's loss across the seeds. Verdict (:func:`seed_verdict`): ``within
    noise`` when the mean gap's 95 % interval over the seeds lies inside ``±k * noise`` (``k`` =
    :data:`NOISE_K` = 2 by default), ``outside noise`` when it lies outside, no verdict when it
    straddles the band or with fewer than :data:`MIN_SEEDS` seeds.

    Args:
        workload: As :func:`run_compare`. A user workload seeds itself: unless its function takes
            ``seed`` (it gets each seed then), only the rows' RNG stream changes with the seed.
        presets: As :func:`run_compare`; ``fp32`` is added in front when missing (it is the reference).
        seeds: At least two distinct seeds, as a list or ``"0,1,2"``.
        k: The multiple of the FP32 noise a mean gap may reach and still be "within noise".
        device: As :func:`run_compare`.
        progress: As :func:`run_compare`; row labels are prefixed with ``seed S:``.
        workload_options: As :func:`run_compare`, without ``seed`` (each run sets it).
        **kwargs: The other keyword arguments of :func:`run_compare` (``baseline``, ``steps``, ...).

    Returns:
        A :class:`SeedsResult`.

    Raises:
        BenchError: fewer than two seeds, ``seed`` among ``workload_options`` or ``kwargs``, or
            anything :func:`run_compare` raises.

    Example:
        >>> from mixprec.bench import run_compare_seeds
        >>> r = run_compare_seeds("gpt", "bf16-mixed", seeds=[0, 1, 2], steps=20)   # doctest: +SKIP
        >>> r.row("bf16-mixed").verdict                                            # doctest: +SKIP
        'within noise (gap -0.0012 ± 0.0021 (95 %, 3 seeds) vs band ±0.0300)'
    """
    seed_list = parse_seeds(seeds)
    if "seed" in kwargs:
        raise BenchError("run_compare_seeds: give the seeds as seeds=[...], not seed=")
    if workload_options and "seed" in workload_options:
        raise BenchError(
            f"-o seed={workload_options['seed']} fixes the workload's seed, so --seeds would rerun the same weights "
            "and batches; drop -o seed (each run passes its seed to the workload)"
        )
    if not math.isfinite(k) or k <= 0:
        raise BenchError(f"k={k}: must be a positive number")
    dev = resolve_device(device)
    names = parse_presets(presets, dev)
    notes: list[str] = []
    if "fp32" not in names:
        names.insert(0, "fp32")
        notes.append("fp32 added to the presets: it is the reference every gap and the seed noise are measured against.")
    opts = dict(workload_options or {})
    user_seeded = False  # a MODULE:FUNCTION whose function takes seed= gets each seed
    if isinstance(workload, str) and workload.strip().lower() not in BUILTIN_WORKLOADS:
        user_seeded = _user_takes_seed(workload)
        if not user_seeded:
            notes.append(
                f"{workload}: its function takes no seed, so every seed starts from the same weights and batches; "
                "only the rows' RNG stream (dropout) changes, and the noise is underestimated."
            )
    elif not isinstance(workload, str):
        notes.append("A Workload object is already built: only the rows' RNG stream changes with the seed.")

    runs: list[CompareResult] = []
    for seed in seed_list:
        def prog(event: str, label: str, step: int, total: int, _s: int = seed) -> None:
            if progress is not None:
                progress(event, f"seed {_s}: {label}", step, total)

        seed_opts = {**opts, "seed": seed} if user_seeded else opts
        runs.append(run_compare(workload, names, device=dev, seed=seed, progress=prog if progress else None,
                                workload_options=seed_opts, **kwargs))

    metric = "val_loss" if all(r.row("fp32").val_loss is not None for r in runs) else "final_train_loss"
    fp32_values = [getattr(r.row("fp32"), metric) for r in runs]
    noise = _std(fp32_values) if all(_finite(v) for v in fp32_values) else None
    rows: list[SeedRow] = []
    for template in runs[0].rows:
        per_seed = [next((x for x in r.rows if x.name == template.name), None) for r in runs]
        values = [getattr(x, metric) if x is not None and x.status == "ok" else None for x in per_seed]
        gaps = [v - f if _finite(v) and _finite(f) else None for v, f in zip(values, fp32_values)]
        row = SeedRow(name=template.name, label=template.label, kind=template.kind, values=values, gaps=gaps)
        bad = [s for s, g in zip(seed_list, gaps) if g is None]
        if bad:
            failed = [s for s, x in zip(seed_list, per_seed) if x is None or x.status != "ok"]
            why = "failed" if failed else "non-finite loss"
            row.verdict = f"no verdict ({why} with seed {', '.join(str(s) for s in (failed or bad))})"
        else:
            g = [float(x) for x in gaps if x is not None]
            row.gap_mean, row.gap_std = sum(g) / len(g), _std(g)
            row.gap_min, row.gap_max = min(g), max(g)
            if template.name == "fp32":
                row.verdict = "reference (noise: fp32 against itself across seeds)"
            elif noise is None:
                row.verdict = "no verdict (fp32 loss non-finite)"
            else:
                row.within_noise, row.verdict = seed_verdict(row.gap_mean, noise, k, gap_std=row.gap_std,
                                                             n=len(g))
        rows.append(row)
    if noise is not None:
        notes.append(
            f"Seeds {','.join(str(s) for s in seed_list)}: gap = {metric} minus fp32's {metric} of the same seed; "
            f"spread = std of the gap across seeds; noise = std of fp32's {metric} across seeds ({noise:.4f}); "
            f"within noise when the gap's 95 % interval (Student's t over the seeds) lies inside ±{k:g} x noise, "
            f"outside when it lies outside; no verdict with fewer than {MIN_SEEDS} seeds."
        )
    return SeedsResult(seeds=seed_list, runs=runs, rows=rows, metric=metric, noise=noise, k=k, notes=notes)


def _user_takes_seed(spec: str) -> bool:
    """Whether the function behind ``MODULE:FUNCTION`` takes a ``seed`` keyword (False when it cannot be read)."""
    import inspect

    from ._workloads import _file_folder_on_path, _import_user_module

    module_name, _, func_name = spec.rpartition(":")
    try:
        with _file_folder_on_path(module_name):
            fn = getattr(_import_user_module(spec, module_name), func_name, None)
        params = inspect.signature(fn).parameters if callable(fn) else {}
    except Exception:  # an import error is reported by run_compare, with its own message
        return False
    return "seed" in params  # not **kwargs: it may forward to something that rejects seed
