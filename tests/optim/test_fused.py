"""The fused (``torch.compile``d) step against the eager foreach step, its reference.

Asserted: the compiled step equals the eager one bit for bit (parameters, compensation buffers,
states, step counters) for Kahan summation and for stochastic rounding with a fixed seed (the
counter-based bits are a pure function of seed, step and position, so "in distribution" is
"identical" here), FP32 and BF16 states, AdamW, Adam (L2) and SGD, with ``grad_scale`` and with a
skipped step (``found_inf`` on the device) in the run; a skipped compiled step leaves every state
bit-identical; the BF16 stall task (updates below half an ulp) stalls under the compiled step
without compensation and tracks FP32 with Kahan.

Compile cost: every distinct configuration costs seconds of Inductor C++ compilation on the CI
CPU. Compiled steps are cached process-wide by configuration (dtypes, hyper-parameters but the
LR, flags; not the parameters' shapes, issue 27), so every test here uses one of five
configurations (``CONFIGS``), and always passes ``found_inf``: 5 graphs for the whole file.
"""

from __future__ import annotations

import pytest
import torch

import mixprec.optim as mo
from mixprec.optim import _fused_step

from ._util import assert_bit_identical, snapshot

SHAPES = [(8, 4), (8,)]
STEPS = 5
SKIP_STEP = 2
#: name -> (class, hyper-parameters, compensation, state dtype, pass grad_scale)
CONFIGS = {
    "adamw-kahan-f32": (mo.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, "kahan", torch.float32, True),
    "adamw-sr-bf16": (mo.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, "stochastic", torch.bfloat16, True),
    "adam-kahan-bf16": (mo.Adam, {"lr": 1e-2, "weight_decay": 0.1}, "kahan", torch.bfloat16, False),
    "sgd-kahan-bf16": (mo.SGD, {"lr": 0.05, "momentum": 0.9}, "kahan", torch.bfloat16, False),
    "sgd-none-f32": (mo.SGD, {"lr": 0.05, "momentum": 0.9}, "none", torch.float32, False),
}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]
    if step == SKIP_STEP:
        out[1][3] = float("inf")  # what a scaler's check would have found
    return out


def _make(name: str, params: list[torch.nn.Parameter], fused: bool, seed: int = 7) -> mo.LowPrecisionOptimizer:
    cls, hp, comp, sdt, _ = CONFIGS[name]
    return cls(params, **hp, compensation=comp, state_dtype=sdt, seed=seed, fused=fused)


def _step(opt: mo.LowPrecisionOptimizer, name: str, step: int) -> None:
    params = [p for g in opt.param_groups for p in g["params"]]
    for p, g in zip(params, _grads(step)):
        p.grad = g * 4.0 if CONFIGS[name][4] else g
    found_inf = torch.tensor(float(step == SKIP_STEP))
    if CONFIGS[name][4]:
        opt.step(grad_scale=torch.tensor(4.0), found_inf=found_inf)
    else:
        opt.step(found_inf=found_inf)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_step_equals_eager_bit_for_bit(name):
    runs = []
    for fused in (False, True):
        opt = _make(name, _params(), fused)
        skipped_untouched = None
        for step in range(STEPS):
            before = snapshot(opt) if step == SKIP_STEP else None
            _step(opt, name, step)
            if before is not None:
                assert_bit_identical(before, snapshot(opt))  # the skipped step changed nothing
                skipped_untouched = True
        assert skipped_untouched
        assert bool(opt._fused_fns) is fused  # the compiled path really ran (and only when asked)
        runs.append(snapshot(opt))
    assert_bit_identical(*runs)
    # The run moved: a comparison of two frozen runs would prove nothing.
    assert not torch.equal(runs[1][0][1], _params()[0].detach())


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["adamw-kahan-f32", "adamw-sr-bf16"])
def test_fused_step_equals_eager_bit_for_bit_on_cuda(name, monkeypatch):
    """On a GPU too (Triton kernels): division rounded as eager's, no flush of subnormals, no FMA contraction;
    parameters larger than a tile take the direct tiles, the rest packed ones."""
    from mixprec.optim import _fused_step

    monkeypatch.setattr(_fused_step, "_GPU_FUSED_TILE", 1 << 18)  # small tiles: every kind on small tensors
    # 2**20: one direct tile of 4T; 2**19 + 5: two direct tiles of T and a packed remainder; the rest packed
    shapes = [(1 << 10, 1 << 10), ((1 << 19) + 5,), (3, 1000), (7,)]
    runs = []
    for fused in (False, True):
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16).cuda()) for s in shapes]
        cls, hp, comp, sdt, _ = CONFIGS[name]
        opt = cls(params, **hp, compensation=comp, state_dtype=sdt, seed=7, fused=fused)
        for step in range(STEPS):
            gg = torch.Generator().manual_seed(100 + step)
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gg) * 1e-3).to(torch.bfloat16).cuda()
            opt.step(grad_scale=torch.tensor(4.0, device="cuda"),
                     found_inf=torch.tensor(float(step == SKIP_STEP), device="cuda"))
        assert bool(opt._fused_fns) is fused
        runs.append([(k, v.cpu()) for k, v in snapshot(opt)])
    assert_bit_identical(*runs)


def test_fused_step_asks_inductor_for_eager_division_and_subnormals():
    """The options that make Triton round as eager does, under the installed torch's names (a no-op on a CPU)."""
    from torch._inductor import config

    opts = _fused_step._eager_division_options()
    assert opts and all(v is True for v in opts.values())
    current = config.get_config_copy()
    assert all(k in current for k in opts), opts  # names this torch's Inductor accepts as torch.compile options


def test_compiled_once_per_structure_and_cached_across_steps_and_optimizers():
    name = "adamw-kahan-f32"
    before = set(_fused_step._FUSED_CACHE)
    opt = _make(name, _params(), True)
    _step(opt, name, 0)  # compiles, or reuses the graph of a test above that ran first in this process
    spec = next(iter(opt._fused_fns))
    fn = _fused_step._FUSED_CACHE[spec]
    first = opt.compile_seconds
    assert (first > 0.0) == (spec not in before)  # the compile is timed by the optimizer that paid for it
    for step in range(1, 4):
        opt.param_groups[0]["lr"] = 1e-2 / (step + 1)  # a scheduler's LR is a tensor input: no recompile
        _step(opt, name, step)
    assert opt.compile_seconds == first and opt._fused_fns[spec] is fn
    # Another optimizer of the same structure (another seed: the keys are inputs) shares the graph.
    other = _make(name, _params(1), True, seed=123)
    _step(other, name, 0)
    assert other.compile_seconds == 0.0 and other._fused_fns[spec] is fn


class _CountingMode(torch.utils._python_dispatch.TorchDispatchMode):
    """A stand-in for FlopCounterMode or a memory tracker: sees every op dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_step_under_a_dispatch_mode_runs_eagerly_and_the_fused_step_stays_on(monkeypatch):
    """Dynamo compiles nothing under a TorchDispatchMode (FlopCounterMode, a memory tracker): a first step
    under one is the eager step (bit for bit the fused one, its ops seen by the mode), not a compile error
    (fused=True) or the fused step turned off for good (fused=None), and the steps after it compile."""
    name = "adamw-kahan-f32"
    ref = _make(name, _params(), True)
    for step in range(3):
        _step(ref, name, step)
    for fused in (True, None):
        monkeypatch.setattr(_fused_step, "_FUSED_CACHE", {})  # nothing compiled yet: the first step would compile
        opt = _make(name, _params(), fused)
        opt._prefer_fused = True  # fused=None fuses on a CPU once the model runs compiled
        with _CountingMode() as mode:
            _step(opt, name, 0)
        assert mode.ops > 100 and not opt._fused_fns and opt._fused_off is None  # eager, seen, nothing turned off
        for step in (1, 2):
            _step(opt, name, step)
        assert opt._fused_fns and opt.fused_enabled("cpu")  # compiled at the steps outside the mode
        assert_bit_identical(snapshot(opt), snapshot(ref))


def test_with_torch_compile_disabled_the_step_runs_eagerly_until_it_is_enabled(monkeypatch):
    """TORCH_COMPILE_DISABLE=1 / torch._dynamo.config.disable: torch runs compiled code eagerly, and so does the
    fused step (no compile error under fused=True, nothing turned off); once enabled again it compiles."""
    import torch._dynamo.config as dynamo_config

    name = "adamw-kahan-f32"
    monkeypatch.setattr(_fused_step, "_FUSED_CACHE", {})
    ref = _make(name, _params(), False)
    opt = _make(name, _params(), True)
    with dynamo_config.patch(disable=True):  # (not monkeypatch: its undo deletes a config entry)
        for step in range(2):
            _step(opt, name, step)
            _step(ref, name, step)
    assert not opt._fused_fns and opt._fused_off is None
    _step(opt, name, 2)
    _step(ref, name, 2)
    assert opt._fused_fns
    assert_bit_identical(snapshot(opt), snapshot(ref))


def test_fused_argument_and_default_rule():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="fused must be True, False or None"):
        mo.AdamW([p], fused="yes")  # type: ignore[arg-type]
    assert mo.AdamW([p]).fused is None
    assert not mo.AdamW([p]).fused_enabled("cpu")  # default: off on CPU (see docs/optim.md)
    assert mo.AdamW([p], fused=True).fused_enabled("cpu")
    assert not mo.SGD([p], lr=0.1, fused=False).fused_enabled("cuda")
    assert mo.from_torch(torch.optim.AdamW([p]), fused=True).fused is True
    preferred = mo.AdamW([p])
    preferred._prefer_fused = True  # MixedPrecision's mark once the model ran compiled
    assert preferred.fused_enabled("cpu") and not mo.AdamW([p], fused=False).fused_enabled("cpu")


def test_buckets_follow_which_parameters_have_gradients():
    """The per-group bucket cache is rebuilt when a parameter gains or loses its gradient."""
    name = "sgd-none-f32"
    runs = []
    for fused in (False, True):
        params = _params()
        opt = _make(name, params, fused)
        _step(opt, name, 0)
        frozen = params[1].detach().clone()
        count = float(opt.state[params[1]]["step"])
        g = torch.Generator().manual_seed(5)
        params[0].grad = torch.randn(SHAPES[0], generator=g).to(torch.bfloat16)
        params[1].grad = None  # a parameter without a gradient this step (frozen branch, unused head)
        opt.step(found_inf=torch.tensor(0.0))
        assert torch.equal(params[1].detach(), frozen) and float(opt.state[params[1]]["step"]) == count
        _step(opt, name, 1)  # both again
        assert bool(opt._fused_fns) is fused
        runs.append(snapshot(opt))
    assert_bit_identical(*runs)


# ----- the BF16 stall task under the compiled step --------------------------------------------------------
def _stall(comp: str) -> tuple[float, torch.Tensor, torch.Tensor]:
    """SGD (momentum 0.9) pulls weights in [1, 2) by steps 40x below half a BF16 ulp; returns progress.

    Same shapes and hyper-parameters (but the LR) as the ``sgd-*`` configurations, so the compiled
    graphs are shared. Progress: mean signed distance moved / the FP32 run's.
    """
    g = torch.Generator().manual_seed(0)
    w0 = [(1 + torch.rand(s, generator=g)).to(torch.bfloat16) for s in SHAPES]  # exactly representable
    sign = [torch.where(torch.rand(s, generator=g) < 0.5, -1.0, 1.0) for s in SHAPES]
    lr, steps, g_abs = 1e-5, 200, 1.0  # momentum-steady step 1e-4 < half an ulp (3.9e-3 in [1, 2))
    p32 = [w.float().clone() for w in w0]
    ref = torch.optim.SGD([torch.nn.Parameter(w) for w in p32], lr=lr, momentum=0.9)
    ps = [torch.nn.Parameter(w.clone()) for w in w0]
    name = "sgd-kahan-bf16" if comp == "kahan" else "sgd-none-f32"
    opt = _make(name, ps, True)
    opt.param_groups[0]["lr"] = lr
    zero = torch.tensor(0.0)
    for _ in range(steps):
        for p, q, s in zip(ps, ref.param_groups[0]["params"], sign):
            p.grad = (-g_abs * s).to(torch.bfloat16)  # constant pull along sign
            q.grad = -g_abs * s
        opt.step(found_inf=zero)
        ref.step()
    full = opt.full_precision_params()  # weight + compensation (the weight alone without Kahan)
    moved = torch.cat([((full[p] - w.float()) * s).reshape(-1) for p, w, s in zip(ps, w0, sign)])
    moved32 = torch.cat([((q.detach() - w.float()) * s).reshape(-1)
                         for q, w, s in zip(ref.param_groups[0]["params"], w0, sign)])
    err = torch.cat([(full[p] - q.detach()).reshape(-1) for p, q in zip(ps, ref.param_groups[0]["params"])])
    return moved.mean().item() / moved32.mean().item(), moved, err


def test_bf16_stall_task_stalls_without_compensation_and_tracks_fp32_with_kahan_compiled():
    progress_none, moved_none, _ = _stall("none")
    assert progress_none == 0.0 and torch.count_nonzero(moved_none) == 0  # not a single weight moved a bit
    progress_kahan, _, err = _stall("kahan")
    # FP32 moves ~0.018 (2.3 BF16 ulps in [1, 2)); weight + compensation follows it to within the
    # compensation buffer's stochastic rounding (its ulp is ~2**-16 at ~2**-8 magnitude).
    assert abs(progress_kahan - 1.0) < 0.02
    assert err.abs().max().item() < 2.0**-11  # 8x below half a BF16 ulp of the weight
