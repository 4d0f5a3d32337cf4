"""The Kahan AdamW step as one Triton kernel per bucket (``mixprec.optim._triton_step``).

On a CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, numpy arithmetic), which
executes the same kernel source the GPU compiles; these tests skip where Triton does not import.
The reference is the eager step (``fused=False``). One adjustment on the CPU: ATen's CPU ``sqrt``
of FP32 (SLEEF, 0.5001 ulp) is not always correctly rounded, the interpreter's and a GPU's (and
``torch.sqrt`` on CUDA) are; the fixture makes the reference's FP32 ``sqrt`` correctly rounded
(through FP64, exact for a square root), so that bit-for-bit equality tests the kernel's
arithmetic. The CUDA test at the end compares the compiled kernel with CUDA's eager step as it is.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import mixprec.optim as mo
import mixprec.optim._triton_step as ts
from mixprec.optim._parts import _DeviceCtx

from ._util import assert_bit_identical, snapshot

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the test extra)")

SHAPES = [(37, 5), (ts.BLOCK * 2 + 11,), (7,), (300, 3), (0,)]  # several blocks, tails, an empty tensor, 5 tensors


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The kernel on the CPU, in Triton's interpreter; yields a list that counts its launches."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ts, "DEVICES", frozenset({"cpu"}))
    ts.reset()
    sqrt = torch.Tensor.sqrt
    monkeypatch.setattr(torch.Tensor, "sqrt",
                        lambda self: sqrt(self.double()).float() if self.dtype == torch.float32 else sqrt(self))
    launches: list[int] = []
    real = ts._launch

    def counted(*args: Any) -> None:
        launches.append(1)
        real(*args)

    monkeypatch.setattr(ts, "_launch", counted)
    yield launches
    ts.reset()


def _params(seed: int = 0, shapes: list[tuple[int, ...]] = SHAPES,
            dtype: torch.dtype = torch.bfloat16) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in shapes]


def _train(fused: bool, steps: int = 4, *, grad_dtype: torch.dtype | None = None, scale: float | None = None,
           skip_at: int | None = None, shapes: list[tuple[int, ...]] = SHAPES, dtype: torch.dtype = torch.bfloat16,
           **kw: Any) -> mo.AdamW:
    ps = _params(shapes=shapes, dtype=dtype)
    grad_dtype = grad_dtype or dtype
    opt = mo.AdamW(ps, fused=fused, seed=11, **{"lr": 1e-3, **kw})
    g = torch.Generator().manual_seed(5)
    for i in range(steps):
        for p in ps:
            if grad_dtype != p.dtype:
                p.grad_dtype = grad_dtype
            p.grad = (torch.randn(p.shape, generator=g) * 10.0 ** torch.randint(-4, 0, p.shape, generator=g)).to(grad_dtype)
        extra: dict[str, torch.Tensor] = {}
        if scale is not None:
            extra["grad_scale"] = torch.tensor(scale)
        if skip_at is not None:
            extra["found_inf"] = torch.tensor(float(i == skip_at))
        opt.step(**extra)
    return opt


CASES = {
    "adamw": {},
    "no-decay": {"weight_decay": 0.0},
    "adam-l2": {"weight_decay": 0.05, "decoupled_weight_decay": False},
    "maximize": {"maximize": True, "betas": (0.8, 0.99), "eps": 1e-6},
    "grad-scale": {"scale": 1024.0},
    "skip": {"skip_at": 1},
    "fp32-grads": {"grad_dtype": torch.float32},
    "lr-tensor": {"lr": torch.tensor(3e-3)},
    "lr-1-element": {"lr": torch.tensor([3e-3]), "weight_decay": 0.3},  # (1,): no FP64 promotion in the eager step
    "lr-numpy": {"lr": np.float32(3e-3), "weight_decay": 0.3},  # 1 - lr * wd in FP64, as for a float
    "stochastic": {"compensation": "stochastic"},
    "round-to-nearest": {"compensation": "none"},
    "bf16-states": {"state_dtype": torch.bfloat16},
    "stochastic-bf16-states": {"compensation": "stochastic", "state_dtype": torch.bfloat16, "skip_at": 2},
    "fp32-island": {"dtype": torch.float32, "scale": 8.0},
    "fp32-island-bf16-states": {"dtype": torch.float32, "state_dtype": torch.bfloat16},
}


@needs_triton
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_kernel_equals_the_eager_step_bit_for_bit(interpreted: list[int], case: str) -> None:
    """Parameters, compensation, moments and step counts after four steps, one launch per step (one bucket)."""
    kw = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the first-use check passes: no warning
        fused = _train(True, **kw)
    eager = _train(False, **kw)
    assert_bit_identical(snapshot(fused), snapshot(eager))
    assert len(interpreted) == 4 + 1  # the first-use check's own launch, then one per step
    assert all(ts._state.values()) and ts._state
    plan = fused._plan_cache[0][1][0]
    assert isinstance(plan.triton, ts.AdamWTables) and plan.fused is None  # no compiled tile layout was built
    if case == "skip":
        assert float(fused.state[fused.param_groups[0]["params"][0]]["step"]) == 3.0


@needs_triton
def test_odd_tensor_counts_and_two_groups_equal_the_eager_step(interpreted: list[int]) -> None:
    """Three tensors (odd: the padded table sections) in one group and one in another: a launch per bucket."""
    def run(fused: bool) -> mo.AdamW:
        ps = _params(shapes=[(5,), (ts.BLOCK + 1,), (9, 2), (33,)])
        opt = mo.AdamW([{"params": ps[:3]}, {"params": ps[3:], "weight_decay": 0.0, "lr": 5e-3}], fused=fused, seed=3)
        for i in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            opt.step()
        return opt

    fused = run(True)
    assert_bit_identical(snapshot(fused), snapshot(run(False)))
    assert len(interpreted) == 2 + 3 * 2  # two variants checked (decay and none), two buckets per step


@needs_triton
def test_new_addresses_rebuild_the_tables(interpreted: list[int]) -> None:
    """A ``load_state_dict`` (new state tensors) and ``p.data = ...`` between steps: still the eager step, bit for bit."""
    def run(fused: bool) -> mo.AdamW:
        opt = _train(fused, steps=2)
        sd = opt.state_dict()
        opt.load_state_dict(sd)
        p0 = opt.param_groups[0]["params"][0]
        p0.data = p0.data.clone()
        for i in range(2):
            for p in opt.param_groups[0]["params"]:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(9 + i)).to(torch.bfloat16)
            opt.step()
        return opt

    fused = run(True)
    assert_bit_identical(snapshot(fused), snapshot(run(False)))
    tables = fused._plan_cache[0][1][0].triton
    assert tables.bufs[0] is fused.param_groups[0]["params"][0]  # rebuilt on the new storage


@needs_triton
def test_adamw_on_bf16_or_fp32_parameters_is_eligible(interpreted: list[int]) -> None:
    """AdamW/Adam without amsgrad on BF16 (any compensation) or FP32 parameters, FP32 or BF16 states; others
    (FP16 parameters, amsgrad, SGD, subclasses that change the arithmetic) are left to the compiled tile step."""
    def eligible(opt: torch.optim.Optimizer) -> bool:
        ps = opt.param_groups[0]["params"]
        for p in ps:
            p.grad = torch.zeros_like(p)
        group = opt.param_groups[0]
        plan = opt._plans(0, group)[0]
        return ts.eligible(opt, group, plan, opt._state_keys(group))

    assert eligible(mo.AdamW(_params(), fused=True))
    assert eligible(mo.Adam(_params(), fused=True))
    assert eligible(mo.AdamW(_params(), fused=True, compensation="stochastic", state_dtype=torch.bfloat16))
    assert eligible(mo.AdamW(_params(dtype=torch.float32), fused=True))
    assert not eligible(mo.AdamW(_params(), fused=True, amsgrad=True))
    assert not eligible(mo.AdamW([torch.nn.Parameter(torch.randn(4, dtype=torch.float16))], fused=True))
    assert not eligible(mo.AdamW([torch.nn.Parameter(torch.randn(4, dtype=torch.float64))], fused=True))
    assert not eligible(mo.SGD(_params(), lr=0.1, momentum=0.9, fused=True))

    class Custom(mo.AdamW):
        def _update(self, *a: Any, **k: Any) -> Any:  # a subclass's own arithmetic
            return super()._update(*a, **k)

    assert not eligible(Custom(_params(), fused=True))
    monkey = ts.DEVICES
    ts.DEVICES = frozenset({"cuda"})
    try:
        assert not eligible(mo.AdamW(_params(), fused=True))  # a CPU bucket on the default devices
    finally:
        ts.DEVICES = monkey


@needs_triton
def test_non_contiguous_tensors_are_left_to_the_other_steps(interpreted: list[int]) -> None:
    """A transposed parameter or gradient: ``step_bucket`` changes nothing and says so."""
    p = torch.nn.Parameter(torch.randn(6, 4).to(torch.bfloat16).t())
    q = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))
    opt = mo.AdamW([p, q], fused=True)
    for x in (p, q):
        x.grad = torch.ones_like(x)
    group = opt.param_groups[0]
    plan = opt._plans(0, group)[0]
    keys = opt._state_keys(group)
    sts = opt._ensure_states(plan.params, group, keys)
    b = opt._bucket(group, plan.params, opt._streams(), sts)
    before = [x.clone() for x in (p, q)]
    lr_t = torch.tensor([1e-3], dtype=torch.float64)
    assert not ts.step_bucket(opt, group, plan, b, _DeviceCtx(None, None, None), lr_t)
    p2 = torch.nn.Parameter(torch.randn(4, 6).to(torch.bfloat16))
    p2.grad = torch.ones(6, 4, dtype=torch.bfloat16).t()
    opt2 = mo.AdamW([p2], fused=True)
    plan2 = opt2._plans(0, opt2.param_groups[0])[0]
    sts2 = opt2._ensure_states(plan2.params, opt2.param_groups[0], keys)
    b2 = opt2._bucket(opt2.param_groups[0], plan2.params, opt2._streams(), sts2)
    assert not ts.step_bucket(opt2, opt2.param_groups[0], plan2, b2, _DeviceCtx(None, None, None), lr_t)
    assert all(torch.equal(x, y) for x, y in zip((p, q), before)) and interpreted == []


@needs_triton
def test_a_kernel_that_disagrees_warns_once_and_is_not_used(interpreted: list[int],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The first-use check compares with the eager step; a wrong kernel warns once and steps nothing."""
    monkeypatch.setattr(ts, "_launch", lambda *args: None)  # a "kernel" that writes nothing
    opt = mo.AdamW(_params(), fused=True)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    group = opt.param_groups[0]
    plan = opt._plans(0, group)[0]
    keys = opt._state_keys(group)
    b = opt._bucket(group, plan.params, opt._streams(), opt._ensure_states(plan.params, group, keys))
    before = snapshot(opt)
    lr_t = torch.tensor([1e-3], dtype=torch.float64)
    ctx = _DeviceCtx(None, None, None)
    with pytest.warns(RuntimeWarning, match=r"Triton AdamW step on cpu under TRITON_INTERPRET=1 is off: "
                                            r"it disagreed with the eager step"):
        assert not ts.step_bucket(opt, group, plan, b, ctx, lr_t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not ts.step_bucket(opt, group, plan, b, ctx, lr_t)  # decided: no second warning, no second try
    assert_bit_identical(snapshot(opt), before)


def test_the_kernel_is_only_for_cuda_by_default() -> None:
    assert sorted(ts.DEVICES) == ["cuda"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["adamw", "grad-scale", "skip", "stochastic-bf16-states", "fp32-island"])
def test_the_compiled_kernel_on_cuda_equals_cudas_eager_step(case: str) -> None:
    """GPT-2-like shapes on the GPU: the kernel (no warning: it passed its first-use check) equals the eager step."""
    ts.reset()
    shapes = [(768, 2304), (2304,), (768,), (3072, 768), (50, 768), (1,)]
    kw = dict(CASES[case])
    dtype = kw.pop("dtype", torch.bfloat16)
    opt_kw = {k: v for k, v in kw.items() if k in ("compensation", "state_dtype")}

    def run(fused: bool) -> mo.AdamW:
        torch.manual_seed(0)
        ps = [torch.nn.Parameter((torch.randn(s, device="cuda") * 0.02).to(dtype)) for s in shapes]
        opt = mo.AdamW(ps, lr=1e-3, fused=fused, seed=2, **opt_kw)
        g = torch.Generator(device="cuda").manual_seed(1)
        for i in range(5):
            for p in ps:
                p.grad = (torch.randn(p.shape, device="cuda", generator=g) * 1e-3).to(dtype)
            extra = {}
            if "scale" in kw:
                extra["grad_scale"] = torch.tensor(kw["scale"], device="cuda")
            if "skip_at" in kw:
                extra["found_inf"] = torch.tensor(float(i == kw["skip_at"]), device="cuda")
            opt.step(**extra)
        return opt

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fused = run(True)
    assert isinstance(fused._plan_cache[0][1][0].triton, ts.AdamWTables)
    assert_bit_identical(snapshot(fused), snapshot(run(False)))


@needs_triton
def test_a_misaligned_parameter_takes_the_unhinted_variant(interpreted: list[int]) -> None:
    """A parameter viewed at an odd element offset (contiguous, not 16-byte aligned): no alignment hint, same values."""
    def run(fused: bool) -> mo.AdamW:
        g = torch.Generator().manual_seed(4)
        base = torch.randn(ts.BLOCK + 9, generator=g).to(torch.bfloat16)
        p = torch.nn.Parameter(base[1:])  # a view 2 bytes into its storage
        q = torch.nn.Parameter(torch.randn(ts.BLOCK * 2, generator=g).to(torch.bfloat16))
        opt = mo.AdamW([p, q], fused=fused, seed=1)
        for i in range(2):
            for x in (p, q):
                x.grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            opt.step()
        return opt

    fused = run(True)
    assert_bit_identical(snapshot(fused), snapshot(run(False)))
    tables = fused._plan_cache[0][1][0].triton
    assert not tables.aligned and tables.full == 1 + 2 and tables.tail == 1


def _one_bucket(opt: mo.AdamW) -> tuple[dict[str, Any], Any, Any]:
    group = opt.param_groups[0]
    plan = opt._plans(0, group)[0]
    keys = opt._state_keys(group)
    b = opt._bucket(group, plan.params, opt._streams(), opt._ensure_states(plan.params, group, keys))
    return group, plan, b


@needs_triton
def test_the_step_holds_no_gradient_and_bumps_version_counters(interpreted: list[int]) -> None:
    """After ``zero_grad`` the step's gradients are freed (as after torch's step); a graph built before the step
    refuses its stale weights (autograd's in-place check), as after the eager step."""
    import weakref

    ps = _params(shapes=[(40, 3), (ts.BLOCK + 5,)])
    opt = mo.AdamW(ps, fused=True)
    for p in ps:
        p.grad = torch.ones_like(p)
    refs = [weakref.ref(p.grad) for p in ps]
    versions = [p._version for p in ps]
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert interpreted and all(r() is None for r in refs)
    assert all(p._version > v for p, v in zip(ps, versions))
    assert all(opt.state[p][k]._version > 0 for p in ps for k in ("exp_avg", "exp_avg_sq", "kahan_comp"))
    loss = (ps[0] * ps[0]).sum()  # saves ps[0] itself for backward
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@needs_triton
@pytest.mark.parametrize("change", ["state-dtype", "comp-dtype", "transposed-grad"])
def test_a_bucket_the_kernel_cannot_read_as_it_is_is_left_to_the_other_steps(interpreted: list[int],
                                                                               change: str) -> None:
    """A state or compensation in another dtype than the step writes, a gradient re-strided at the same address:
    checked every step, not only when an address changes (the kernel would read the bytes wrongly)."""
    ps = _params(shapes=[(64, 32)])
    opt = mo.AdamW(ps, fused=True)
    ps[0].grad = torch.ones_like(ps[0])
    opt.step()
    assert len(interpreted) == 2  # the first-use check, then the step
    st = opt.state[ps[0]]
    if change == "state-dtype":
        st["exp_avg"] = st["exp_avg"].to(torch.bfloat16)
        ps[0].grad = torch.ones_like(ps[0])
    elif change == "comp-dtype":
        st["kahan_comp"] = st["kahan_comp"].float()
        ps[0].grad = torch.ones_like(ps[0])
    else:
        ps[0].grad = torch.ones(32, 64, dtype=torch.bfloat16).t()
    group, plan, b = _one_bucket(opt)
    before = snapshot(opt)
    assert not ts.step_bucket(opt, group, plan, b, _DeviceCtx(None, None, None), torch.tensor([1e-3], dtype=torch.float64))
    assert len(interpreted) == 2 and plan.triton is None
    assert_bit_identical(snapshot(opt), before)


@needs_triton
@pytest.mark.parametrize("how", ["numpy", "tensor"])
def test_hyper_parameters_a_scheduler_writes_as_numpy_or_tensors(interpreted: list[int], how: str) -> None:
    """betas and weight decay set mid-run as NumPy FP32 scalars (taken as floats: the kernel) or tensors (the
    eager step; compiled in, the tiles could not take them): still the eager step's values, no warning."""
    def run(fused: bool) -> mo.AdamW:
        ps = _params(shapes=[(ts.BLOCK + 3,), (5, 7)])
        opt = mo.AdamW(ps, lr=0.3, weight_decay=0.5, fused=fused, seed=2)
        for i in range(4):
            if i == 2:
                conv = np.float32 if how == "numpy" else torch.tensor
                opt.param_groups[0]["weight_decay"] = conv(0.98278546)
                opt.param_groups[0]["betas"] = (conv(0.85), conv(0.995))
            for p in ps:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            opt.step()
        return opt

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fused = run(True)
    assert_bit_identical(snapshot(fused), snapshot(run(False)))
    assert len(interpreted) == 1 + (4 if how == "numpy" else 2)  # the check, then the steps the kernel took


@needs_triton
@pytest.mark.parametrize(("capability", "variant"), [
    (90, dict(P_BF16=True, COMP=1, S_BF16=False, G_BF16=True, HAS_SCALE=False, HAS_KEEP=False, DECAY=True)),  # bf16-pure
    (90, dict(P_BF16=True, COMP=2, S_BF16=True, G_BF16=True, HAS_SCALE=True, HAS_KEEP=True, DECAY=False)),
    (90, dict(P_BF16=False, COMP=0, S_BF16=False, G_BF16=False, HAS_SCALE=False, HAS_KEEP=True, DECAY=True)),  # islands
    (80, dict(P_BF16=True, COMP=1, S_BF16=False, G_BF16=True, HAS_SCALE=False, HAS_KEEP=True, DECAY=True)),
])
def test_the_kernel_compiles_for_nvidia_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capability: int,
                                             variant: dict[str, Any]) -> None:
    """The kernel lowers to machine code for Hopper and Ampere, both launches (no GPU needed: Triton's own ptxas);
    the full blocks of aligned tensors read and write with 16-byte vector instructions only (the step is bound by
    memory bandwidth: 2-byte scalar accesses would be several times slower)."""
    from _triton_aot import compile_for_gpu  # tests/_triton_aot.py

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled here, not found in a cache
    ts.reset()
    try:
        kernel = ts._build()
        tables = ["p_ptrs", "c_ptrs", "m_ptrs", "v_ptrs", "g_ptrs", "numels", "block_tensor", "block_start", "bases",
                  "ka_p", "kb_p", "ka_c", "kb_c", "ka_m", "kb_m", "ka_v", "kb_v"]
        types = {**dict.fromkeys(tables, "*i64"), **dict.fromkeys(["step_size", "bc2_sqrt", "decay", "scale", "keep"], "*fp32"),
                 **dict.fromkeys(["beta1c", "beta2", "beta2c", "eps", "wd"], "fp32")}
        for masked, aligned in ((False, True), (True, False)):
            compiled = compile_for_gpu(kernel, types, {**variant, "BLOCK": ts.BLOCK, "MASKED": masked, "ALIGNED": aligned,
                                                       "MAXIMIZE": False, "L2": False}, capability)
            ptx = compiled.asm["ptx"]
            assert compiled.asm["cubin"] and f"sm_{capability}" in ptx
            if not masked:
                ops = re.findall(r"(?:ld|st)\.global(?:\.v\d)?\.b(?:16|32)\b", ptx)  # not the 64-bit table reads
                scalar = [op for op in ops if ".v4." not in op]
                # the only scalar accesses: one value per tensor or per step (step size, bias correction, decay,
                # scale, keep), never the data
                assert len(ops) - len(scalar) >= 8 and all(op == "ld.global.b32" for op in scalar) and len(scalar) <= 5, ops
    finally:
        ts.reset()
