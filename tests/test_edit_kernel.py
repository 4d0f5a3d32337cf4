"""The master-weight edit check as one Triton kernel (``mixprec._edit_kernel``).

On a CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, numpy arithmetic), which
executes the same kernel source the GPU compiles; these tests skip where Triton does not import. The
CUDA test at the end runs the compiled kernel.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
import mixprec._edit_kernel as ek
import mixprec._master as master_mod
from mixprec._master import carry_edits_
from mixprec.optim._rounding import with_edits

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the test extra)")


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The kernel on the CPU, in Triton's interpreter; yields a list that counts its launches."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ek, "DEVICES", frozenset({"cpu"}))
    ek.reset()
    launches: list[int] = []
    real = ek.EditTables.launch
    monkeypatch.setattr(ek.EditTables, "launch", lambda self: launches.append(1) or real(self))
    real_first = ek.carry_edits_triton_

    def counted(tables: ek.EditTables) -> bool:  # later launches go through tables.run: count those too
        ok = real_first(tables)
        run = tables.run
        if ok:
            launches.append(1)  # the first launch, inside
        if run is not None:
            tables.run = lambda: launches.append(1) or run()
        return ok

    monkeypatch.setattr(ek, "carry_edits_triton_", counted)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)  # numpy's, in the interpreter's FP16 cast
        yield launches
    ek.reset()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num().view(torch.int32), b.nan_to_num().view(torch.int32))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_first_use_check_passes_on_every_16_bit_pattern(interpreted: list[int], dtype: torch.dtype) -> None:
    """Every upper half-word x lower halves 0, 0x7FFF, 0x8000, 0x8001, 0xFFFF, edits and a short tail: equal to where()."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
        assert ek._first_check(torch.device("cpu"), dtype)
    assert interpreted == [1]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_carry_edits_through_the_kernel_equals_the_elementwise_where(interpreted: list[int], dtype: torch.dtype) -> None:
    """Several blocks, a tail, zeros, subnormals, huge values, edits, a pruning mask, a NaN edit; one launch per group."""
    g = torch.Generator().manual_seed(0)
    sizes = (40, 7, ek.BLOCK * 2 + 3, 1, ek.BLOCK)
    masters = [torch.randn(n, generator=g) * 10.0 ** torch.randint(-30, 4, (n,), generator=g) for n in sizes]
    masters[0][:4] = torch.tensor([0.0, -0.0, 1e-40, -3.0e-42])
    masters[2][:2] = torch.tensor([3.0e38, -3.3e38]) if dtype == torch.bfloat16 else torch.tensor([7.0e4, -1.0e5])
    masters[4][:2] = float("nan")
    weights = [m.to(dtype) for m in masters]
    weights[0][5:9] = torch.tensor([1.0, -2.5, 0.0, 7.0], dtype=dtype)
    weights[2].mul_(torch.rand(sizes[2], generator=g) > 0.3)
    weights[3].fill_(float("nan"))
    weights[4][1] = 2.0  # a NaN master's weight edited: the master takes it
    want = [with_edits(m, w) for m, w in zip(masters, weights)]
    got = [m.clone() for m in masters]
    carry_edits_(got, weights)
    for a, b in zip(got, want):
        assert _same(a, b)
    assert got[4][1] == 2.0 and got[0][5] == 1.0
    assert len(interpreted) == 2  # the first-use check, then one launch for the whole group


@needs_triton
def test_layouts_and_dtypes_split_into_groups(interpreted: list[int]) -> None:
    """A BF16 and an FP16 group launch once each; a transposed pair takes where(); FP64 masters stay on foreach."""
    g = torch.Generator().manual_seed(2)
    masters = [torch.randn(3, 5, generator=g), torch.randn(9, generator=g), torch.randn(4, 4, generator=g),
               torch.randn(6, generator=g, dtype=torch.float64)]
    weights = [masters[0].to(torch.bfloat16), masters[1].to(torch.float16),
               masters[2].to(torch.bfloat16).t().contiguous().t(), masters[3].to(torch.bfloat16)]
    for w in weights:
        w[(0,) * w.dim()] = 0.5
    want = [with_edits(m, w) for m, w in zip(masters, weights)]
    got = [m.clone() for m in masters]
    carry_edits_(got, weights)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert len(interpreted) == 4  # two first-use checks, two group launches


@needs_triton
def test_a_failing_kernel_warns_once_and_the_foreach_check_serves(interpreted: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: ek.EditTables) -> None:
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(ek.EditTables, "launch", broken)
    masters = [torch.randn(50)]
    weights = [masters[0].to(torch.bfloat16)]
    weights[0][3] = 9.0
    got = [masters[0].clone()]
    with pytest.warns(RuntimeWarning, match=r"Triton edit check .* cpu \(torch.bfloat16\) under TRITON_INTERPRET=1 is off: "
                      r"it failed \(RuntimeError: no kernel today\)"):
        carry_edits_(got, weights)
    assert torch.equal(got[0], with_edits(masters[0], weights[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        carry_edits_(got, weights)  # decided: no second warning, no second try
    assert not ek.available(torch.device("cpu"), torch.bfloat16, torch.float32)
    assert ek.available(torch.device("cpu"), torch.float16, torch.float32)  # per weight dtype


def test_without_triton_the_foreach_check_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Triton (CI's CPU machines may lack it): ``available`` says no, silently, and the check still runs."""
    import importlib

    monkeypatch.setattr(ek, "DEVICES", frozenset({"cpu"}))
    ek.reset()
    real = importlib.import_module

    def no_triton(name: str, package: str | None = None) -> object:
        if name.startswith("triton"):
            raise ImportError(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", no_triton)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not ek.available(torch.device("cpu"), torch.bfloat16, torch.float32)
            masters = [torch.randn(30)]
            weights = [masters[0].to(torch.bfloat16)]
            weights[0][0] = 4.0
            carry_edits_(masters, weights)
        assert masters[0][0] == 4.0
    finally:
        ek.reset()


def test_the_kernel_is_only_for_its_devices_and_dtypes() -> None:
    assert sorted(ek.DEVICES) == ["cuda"]
    assert not ek.available(torch.device("cpu"), torch.bfloat16, torch.float32)
    assert not ek.available(torch.device("meta"), torch.bfloat16, torch.float32)


@needs_triton
@pytest.mark.parametrize("preset", ["bf16-master", "fp16-master"])
def test_master_steps_with_edits_equal_the_foreach_route(interpreted: list[int], preset: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Three steps of a master preset with a pruning mask and a clamp through ``.data`` between them: the
    kernel's masters and weights equal the foreach route's bit for bit."""

    def run(kernel: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(ek, "DEVICES", frozenset({"cpu"} if kernel else ()))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 40), nn.LayerNorm(40), nn.Linear(40, 3))
        prec = mixprec.MixedPrecision(preset)
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for i in range(3):
            x = torch.randn(8, 12)
            with prec.autocast():
                loss = model(x).float().pow(2).mean()
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad()
            with torch.no_grad():
                model[0].weight.data.mul_(model[0].weight.data.abs() > 0.05)  # pruning through .data
                model[2].weight.data.clamp_(-0.1, 0.1 + i)
        opt.sync_edits_()
        return [*opt.masters, *(p.detach().clone() for p in model.parameters())]

    with_kernel = run(True)
    assert len(interpreted) == 5  # the first-use check, a launch per step and one in sync_edits_()
    for a, b in zip(with_kernel, run(False)):
        assert torch.equal(a, b)


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_compiled_kernel_on_cuda(dtype: torch.dtype) -> None:
    """The kernel Triton compiles for the GPU: its first-use check passes and it equals where() on random pairs."""
    ek.reset()
    dev = torch.device("cuda")
    assert ek.available(dev, dtype, torch.float32)
    assert ek._first_check(dev, dtype)
    masters = [torch.randn(n, device=dev) for n in (5, 3 * ek.BLOCK + 1, 1 << 20)]
    weights = [m.to(dtype) for m in masters]
    weights[1].mul_(torch.rand_like(masters[1]) > 0.5)
    want = [with_edits(m, w) for m, w in zip(masters, weights)]
    got = [m.clone() for m in masters]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        carry_edits_(got, weights)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    ek.reset()


def test_the_master_module_uses_this_one() -> None:
    assert master_mod._edit_kernel is ek


@needs_triton
def test_the_edit_check_under_torch_compile(interpreted: list[int]) -> None:
    """Under torch.compile (a compiled train step around prec.step) the check stays right: a traced part takes the
    foreach ops dynamo understands (not a launch through raw pointers whose writes Inductor cannot see), and a frame
    dynamo runs eagerly launches the kernel outside dynamo (``torch._dynamo.disable``)."""
    masters = [torch.randn(300), torch.randn(7)]
    weights = [m.to(torch.bfloat16) for m in masters]
    weights[0][5] = 3.0
    want = [with_edits(m, w) for m, w in zip(masters, weights)]
    views = master_mod.EditViews()
    warm = [m.clone() for m in masters]
    master_mod._carry_edits(warm, weights, views)  # eager: the first-use check and one launch
    assert len(interpreted) == 2

    @torch.compile(backend="eager")
    def traced(ms: list[torch.Tensor]) -> None:
        master_mod._carry_edits(ms, weights, views)

    got = [m.clone() for m in masters]
    torch._dynamo.reset()
    traced(got)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.cuda
@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_the_kernel_runs_on_the_tensors_device_not_the_current_one() -> None:
    """Triton launches on the current device: pairs on cuda:1 while cuda:0 is current are checked on cuda:1."""
    ek.reset()
    dev = torch.device("cuda", 1)
    masters = [torch.randn(n, device=dev) for n in (5, 3 * ek.BLOCK + 1)]
    weights = [m.to(torch.bfloat16) for m in masters]
    weights[1][7] = 3.0
    want = [with_edits(m, w) for m, w in zip(masters, weights)]
    with torch.cuda.device(0):
        views = master_mod.EditViews()
        for _ in range(2):  # the first call (check and launch), then the bound launch
            got = [m.clone() for m in masters]
            master_mod._carry_edits(got, weights, views)
            for a, b in zip(got, want):
                assert torch.equal(a, b)
    assert views.kernels  # the kernel ran, not the fallback
    ek.reset()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the test extra)")
@pytest.mark.parametrize("w_bf16", [True, False])
def test_the_kernel_compiles_for_nvidia_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, w_bf16: bool) -> None:
    """The edit check lowers to machine code for Hopper (no GPU needed: Triton's own ptxas)."""
    from _triton_aot import compile_for_gpu  # tests/_triton_aot.py

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled here, not found in a cache
    ek.reset()
    try:
        kernel = ek._build()
        types = dict.fromkeys(["m_ptrs", "w_ptrs", "numels", "first_block", "block_tensor"], "*i64")
        compiled = compile_for_gpu(kernel, types, {"BLOCK": ek.BLOCK, "W_BF16": w_bf16}, 90)
        assert compiled.asm["cubin"] and "sm_90" in compiled.asm["ptx"]
    finally:
        ek.reset()
