"""``mixprec.bench``: the side-by-side precision benchmark behind ``mixprec compare``.

Train the same model, from the same initial weights, on the same batches, under each
precision preset and a plain ``torch.amp`` baseline, interleaved step by step; report step
time (median, p10-p90), throughput, peak and model-state memory, final train/validation
loss (or accuracy) with the gap to FP32, skipped steps, the loss scale, and MFU on a GPU.

Example:
    >>> from mixprec.bench import run_compare
    >>> result = run_compare("gpt", "fp32,bf16-mixed", steps=20)      # doctest: +SKIP
    >>> result.row("bf16-mixed").val_loss_gap                          # doctest: +SKIP

Workloads: ``"gpt"``, ``"cnn"``, ``"hf-gpt2"`` or ``"MODULE:FUNCTION"`` (see
:func:`load_workload` for your own). JSON schema ``mixprec.compare/1``: top-level keys
``schema``, ``environment`` (torch, python, device, device_name, cpu: model/flags/threads,
cuda), ``workload`` (name, description, parameters, unit, items_per_step, flops_per_step,
options, initial_weights_sha256, batches_sha256, ...), ``settings`` (presets, baseline, steps,
warmup, device, fp16_cpu, seed, ...), ``rows`` (one per preset and the baseline: name, label,
kind, status, reason, policy, step_time_ms {median, p10, p90, mean, n}, throughput,
achieved_tflops, mfu, peak_memory_bytes, model_state_bytes(_per_param), final_train_loss,
val_loss, val_metric, *_gap, skipped_steps, final_loss_scale, losses, loss_scales,
init_weights_sha256, ...) and ``notes``. Non-finite numbers are written as ``null``.

Is the gap real? :func:`run_compare_seeds` (``mixprec compare --seeds 0,1,2``) runs the whole
comparison once per seed (a built-in workload's initial weights, batch order and RNG streams) and
reports, per row, the loss gap to FP32 of the same seed as a mean over seeds with its spread (sample
std), against the FP32 noise floor (the sample std of FP32's own loss across the seeds): "within
noise" when the mean gap's 95 % interval over the seeds lies inside ``±k * noise`` (``k`` =
:data:`NOISE_K` = 2), "outside noise" when it lies outside, no verdict when it straddles the band or with
fewer than :data:`MIN_SEEDS` (3) seeds. Its JSON record is the first
seed's ``mixprec.compare/1`` record plus a ``seeds`` section: ``seeds`` (the list), ``metric``
(``val_loss`` or ``final_train_loss``), ``noise``, ``k``, ``rule``, ``rows`` (name, label, kind,
values and gaps per seed, gap_mean, gap_std, gap_min, gap_max, within_noise, verdict), ``runs``
(per seed: seed, workload, settings, rows) and ``notes``.
"""

from ._fp16_emulation import FP16Emulation
from ._memory import LiveTensorTracker, model_state_bytes
from ._runner import (
    ALL_PRESETS,
    BASELINE,
    CompareResult,
    RowResult,
    default_presets,
    parse_presets,
    resolve_device,
    run_compare,
)
from ._seeds import MIN_SEEDS, NOISE_K, SeedRow, SeedsResult, parse_seeds, run_compare_seeds, seed_verdict
from ._timing import DENSE_PEAK_TFLOPS, peak_tflops
from ._workloads import BUILTIN_WORKLOADS, BenchError, Workload, load_workload

__all__ = [
    "ALL_PRESETS",
    "BASELINE",
    "BUILTIN_WORKLOADS",
    "DENSE_PEAK_TFLOPS",
    "MIN_SEEDS",
    "NOISE_K",
    "BenchError",
    "CompareResult",
    "FP16Emulation",
    "LiveTensorTracker",
    "RowResult",
    "SeedRow",
    "SeedsResult",
    "Workload",
    "default_presets",
    "load_workload",
    "model_state_bytes",
    "parse_presets",
    "parse_seeds",
    "peak_tflops",
    "resolve_device",
    "run_compare",
    "run_compare_seeds",
    "seed_verdict",
]
