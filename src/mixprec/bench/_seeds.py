"""Several seeds: is a precision's loss gap to FP32 real, or within the seed-to-seed noise?

:func:`run_compare_seeds` (``mixprec compare --seeds 0,1,2``) runs the whole comparison of
:mod:`._runner` once per seed and summarises, per row, the loss gap to FP32 of the same seed: its
mean over the seeds, its spread, and a verdict (:func:`seed_verdict`) against FP32's own
seed-to-seed noise that accounts for how many seeds there are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from ._runner import CompareResult, ProgressFn, json_safe, parse_presets, resolve_device, run_compare
from ._workloads import BUILTIN_WORKLOADS, BenchError, Workload

__all__ = ["MIN_SEEDS", "NOISE_K", "SeedRow", "SeedsResult", "parse_seeds", "run_compare_seeds", "seed_verdict"]


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
        return json_safe(dataclasses.asdict(self))


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
        return json_safe({
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
    backwards = ""
    try:
        if isinstance(spec, str):
            for part in (p.strip() for p in spec.split(",")):
                if not part:
                    continue
                lo, dash, hi = part.partition("-")
                if dash and lo.strip():
                    if int(hi) < int(lo):
                        backwards = part
                    out.extend(range(int(lo), int(hi) + 1))
                else:
                    out.append(int(part))
        else:
            out = [int(s) for s in spec]
    except ValueError:
        raise BenchError(f"--seeds {shown}: expected comma-separated integers, e.g. --seeds 0,1,2") from None
    if backwards:
        lo, _, hi = backwards.partition("-")
        raise BenchError(f"--seeds {shown}: the range {backwards} runs backwards; write it low-high, "
                         f"e.g. --seeds {hi.strip()}-{lo.strip()}")
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
