"""The skip-or-step protocol (``_stepping``): torch's AdamW/Adam/SGD skip on the device through their fused twin."""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from mixprec._master import EDIT_CHUNK, carry_edits_
from mixprec._prepare import warn_host_reads
from mixprec._stepping import FusedTwin, host_read_reason, step_or_skip
from mixprec.bench._step_cost import StepCounter
from mixprec.optim._rounding import with_edits

OPTIMIZERS = {
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
    "adam-amsgrad-wd": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, amsgrad=True, **kw),
    "adamw-maximize": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, maximize=True, **kw),
    "sgd": lambda ps, **kw: torch.optim.SGD(ps, lr=1e-2, **kw),
    "sgd-nesterov": lambda ps, **kw: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3, **kw),
}


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((7, 5), (5,), (3, 2, 2))]


def _grads(step: int, params: list[nn.Parameter], bad: bool = False) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    if bad:
        params[1].grad[0] = float("nan")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("foreach", [True, False])
def test_twin_equals_torchs_fused_bitwise_and_foreach_to_rounding(name: str, foreach: bool) -> None:
    """Steps with a skip in the middle: bit for bit torch's fused=True optimizer, torch's own form to FP32 rounding."""
    ps, fused_ps, own_ps = _params(), _params(), _params()
    opt = OPTIMIZERS[name](ps, foreach=foreach)
    fused = OPTIMIZERS[name](fused_ps, fused=True)
    own = OPTIMIZERS[name](own_ps, foreach=foreach)
    for step in range(6):
        bad = step == 2
        for params in (ps, fused_ps, own_ps):
            _grads(step, params, bad)
        found_inf = torch.tensor(float(bad))
        flag, _ = step_or_skip(opt, found_inf, None, (), {}, twin=True)
        assert flag is found_inf
        fused.found_inf, fused.grad_scale = found_inf, None
        fused.step()
        if not bad:
            own.step()
    for p, q, r in zip(ps, fused_ps, own_ps):
        assert torch.equal(p, q)
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    # the optimizer keeps the options it was built with (the switch lasts for the step only)
    assert all(g["fused"] in (None, False) and g["foreach"] is foreach for g in opt.param_groups)
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")


def test_twin_skips_with_no_host_read_and_leaves_weights_and_state_alone() -> None:
    ps = _params()
    opt = torch.optim.AdamW(ps, lr=1e-2, foreach=True)
    _grads(0, ps)
    step_or_skip(opt, torch.tensor(0.0), None, (), {}, twin=True)
    before = copy.deepcopy((list(ps), opt.state_dict()))
    _grads(1, ps, bad=True)
    with StepCounter((opt,)) as c:
        step_or_skip(opt, torch.tensor(1.0), None, (), {}, twin=True)
    assert c.host_reads == 0
    for p, q in zip(ps, before[0]):
        assert torch.equal(p, q)
    for k, st in opt.state_dict()["state"].items():
        for key, v in st.items():
            assert torch.equal(v, before[1]["state"][k][key]), key


def test_without_twin_the_host_decides() -> None:
    """GradScaler's path (twin=False) steps a foreach optimizer after one host read, as torch.amp does."""
    ps = _params()
    opt = torch.optim.AdamW(ps, lr=1e-2, foreach=True)
    _grads(0, ps)
    with StepCounter((opt,)) as c:
        step_or_skip(opt, torch.tensor(0.0), None, (), {})
    assert c.host_reads == 1


def test_sgd_with_dampening_reads_the_host_until_its_first_applied_step() -> None:
    """A zero momentum buffer is torch's first step (buf = grad) only without dampening; with it, the host decides."""
    ps, ref_ps = _params(), _params()
    opt = torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.5)
    ref = torch.optim.SGD(ref_ps, lr=1e-2, momentum=0.9, dampening=0.5)
    reads = []
    for step in range(4):
        bad = step == 0
        _grads(step, ps, bad)
        _grads(step, ref_ps, bad)
        with StepCounter((opt,)) as c:
            step_or_skip(opt, torch.tensor(float(bad)), None, (), {}, twin=True)
        reads.append(c.host_reads)
        if not bad:
            ref.step()
    assert reads == [1, 1, 0, 0]  # skipped first step, first applied step, then on the device
    for p, q in zip(ps, ref_ps):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_state_loaded_after_steps_keeps_stepping_on_the_twin() -> None:
    ps = _params()
    opt = torch.optim.AdamW(ps, lr=1e-2)
    for step in range(2):
        _grads(step, ps)
        step_or_skip(opt, torch.tensor(0.0), None, (), {}, twin=True)
    sd = copy.deepcopy(opt.state_dict())
    ref_ps = [nn.Parameter(p.detach().clone()) for p in ps]
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, fused=True)
    ref.load_state_dict(copy.deepcopy(sd))  # each its own copy: torch's load keeps same-device tensors as given
    opt.load_state_dict(sd)
    assert opt.__dict__["_mixprec_twin"]._ready is False  # the load post-hook: step counters checked again
    _grads(5, ps)
    _grads(5, ref_ps)
    step_or_skip(opt, torch.tensor(0.0), None, (), {}, twin=True)
    ref.step()
    for p, q in zip(ps, ref_ps):
        assert torch.equal(p, q)


def test_host_read_reason_names_what_cannot_skip_on_the_device() -> None:
    ps = _params()
    assert host_read_reason(torch.optim.AdamW(ps)) is None
    assert host_read_reason(torch.optim.SGD(ps, lr=0.1, fused=True)) is None
    assert "torch.optim.rmsprop.RMSprop cannot skip a step on the device" in host_read_reason(torch.optim.RMSprop(ps))
    assert "differentiable=True" in host_read_reason(torch.optim.Adam(ps, differentiable=True))
    assert "fused=False" in host_read_reason(torch.optim.AdamW(ps, fused=False))  # an explicit choice is respected
    assert FusedTwin.unsupported(torch.optim.AdamW([nn.Parameter(torch.zeros(2, dtype=torch.complex64))])) is not None


def test_prepare_warns_once_about_a_host_read_on_a_gpu_only() -> None:
    ps = _params()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_host_reads([torch.optim.RMSprop(ps)], torch.device("cpu"))  # a read on a CPU costs nothing: silent
        warn_host_reads([torch.optim.AdamW(ps)], torch.device("cuda"))  # skips on the device: silent
    with pytest.warns(UserWarning, match=re.escape(
            "optimizer 0: torch.optim.rmsprop.RMSprop cannot skip a step on the device (it takes no found_inf and has "
            "no fused form that does), so mixprec reads found_inf on the host once per step")):
        warn_host_reads([torch.optim.RMSprop(ps)], torch.device("cuda"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_carry_edits_equals_the_elementwise_where(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The foreach edit check is ``where(w == round(m), m, w)`` element for element, over several passes too."""
    import mixprec._master as master_mod

    monkeypatch.setattr(master_mod, "EDIT_CHUNK", 50)  # several passes over these tensors
    assert EDIT_CHUNK >= 1 << 20
    g = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=g) * 10.0 ** torch.randint(-30, 4, (n,), generator=g) for n in (40, 7, 90, 1)]
    masters[0][:4] = torch.tensor([0.0, -0.0, 1e-40, -3.0e-42])  # zeros and FP32 subnormals
    if dtype == torch.bfloat16:
        masters[2][:2] = torch.tensor([3.0e38, -3.3e38])  # near FP32's largest: finite in BF16
    else:
        masters[2][:2] = torch.tensor([7.0e4, -1.0e5])  # past FP16's range: inf weights, the masters stay (not NaN)
    weights = [m.to(dtype) for m in masters]
    weights[0][5:9] = torch.tensor([1.0, -2.5, 0.0, 7.0], dtype=dtype)  # edited elements
    weights[2].mul_(torch.rand(90, generator=g) > 0.3)  # a pruning mask
    weights[3].fill_(float("nan"))  # a NaN edit
    want = [with_edits(m, w) for m, w in zip(masters, weights)]
    got = [m.clone() for m in masters]
    carry_edits_(got, weights)
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_an_optimizer_without_a_twin_is_checked_once_until_a_group_is_added(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = FusedTwin.unsupported
    monkeypatch.setattr(FusedTwin, "unsupported", staticmethod(lambda opt: calls.append(1) or real(opt)))
    bad = nn.Parameter(torch.zeros(2, dtype=torch.complex64))  # no fused kernel for complex parameters
    bad.grad = torch.ones(2, dtype=torch.complex64)
    opt = torch.optim.SGD([bad], lr=0.1)
    for _ in range(3):
        step_or_skip(opt, torch.tensor(0.0), None, (), {}, twin=True)
    assert opt.__dict__["_mixprec_twin"] is False and len(calls) == 1  # the per-parameter check ran once
    ps = _params()
    _grads(0, ps)
    opt.add_param_group({"params": ps})
    step_or_skip(opt, torch.tensor(0.0), None, (), {}, twin=True)
    assert len(calls) == 2  # checked again for the new group (still complex: the host decides)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_carry_edits_across_layouts_equals_the_elementwise_where(dtype: torch.dtype) -> None:
    """channels_last pairs take the flat passes (1-D in memory order); pairs laid out differently or with gaps
    take where() each; an empty pair is skipped."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(6, 10, generator=g)
    masters = [
        torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),  # dense, not contiguous
        torch.randn(4, 5, generator=g),  # its weight is channels_last below: a different layout
        big[:, ::2],  # gaps: not dense
        torch.randn(0, 3),
        torch.randn(17, generator=g),
    ]
    weights = [m.to(dtype) for m in masters]
    weights[1] = masters[1].to(dtype).t().contiguous().t()  # same values, transposed strides
    weights[0][0, 0, 0, :2] = torch.tensor([5.0, -1.0], dtype=dtype)  # edits, in each kind of pair
    weights[1][0, :2] = torch.tensor([2.0, 0.0], dtype=dtype)
    weights[2][1, :2] = torch.tensor([-7.0, 3.0], dtype=dtype)
    weights[4][3] = 0.0
    want = [with_edits(m, w) for m, w in zip(masters, weights)]
    got = [m.clone() for m in masters]  # preserve_format: the channels_last one stays channels_last
    got[2] = big.clone()[:, ::2]  # keep the gaps
    assert got[0].stride() == weights[0].stride() and got[1].stride() != weights[1].stride()
    carry_edits_(got, weights)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert got[0][0, 0, 0, 0] == 5.0 and got[4][3] == 0.0  # the edits landed


def test_the_edit_check_sees_a_weight_whose_storage_was_replaced() -> None:
    """``p.data = new`` moves the weight: the cached 1-D views are rebuilt, so the new storage's edits are carried."""
    import mixprec

    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    prec = mixprec.MixedPrecision("bf16-master")
    model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    for _ in range(2):  # the views are cached at the first step
        with prec.autocast():
            loss = model(torch.randn(4, 8)).float().square().mean()
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad()
    new = model.weight.detach().clone()
    new[0, 0] = 3.0
    model.weight.data = new.detach()  # new storage, with an edit
    with prec.autocast():
        loss = model(torch.randn(4, 8)).float().square().mean()
    prec.backward(loss)
    prec.step(opt)  # lr 0: the masters keep what the edit check carried in
    assert float(model.weight[0, 0].detach()) == 3.0  # the copy-back wrote the master, which took the edit
    assert float(opt.master_for(model.weight)[0, 0].detach()) == 3.0


@pytest.mark.parametrize("preset", ["fp16-mixed", "fp16-master"])
def test_a_fused_sgd_whose_first_step_is_skipped_keeps_clean_momentum(preset: str) -> None:
    """torch's SGD(momentum, fused=True) leaves uninitialised momentum buffers when its first step is skipped; through
    mixprec the buffers are made first, so the run equals the same optimizer's non-fused form (also the fused kernel)."""
    import mixprec

    def run(fused: bool | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        prec = mixprec.MixedPrecision(preset)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fp16 on a CPU
            model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused))
        torch.manual_seed(1)
        skipped = []
        for i in range(4):
            x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
            if i == 0:
                x[0, 0] = float("inf")  # the first step overflows and is skipped
            with prec.autocast():
                loss = torch.nn.functional.cross_entropy(model(x), y)
            prec.backward(loss)
            skipped.append(bool(prec.step(opt).skipped))
            opt.zero_grad()
        assert skipped == [True, False, False, False]
        return [p.detach().clone() for p in model.parameters()]

    fused, plain = run(True), run(None)
    for a, b in zip(fused, plain):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_half_sgd_on_a_cpu_is_not_routed_through_torchs_fused_kernel(dtype: torch.dtype, momentum: float) -> None:
    """torch's CPU fused SGD leaves FP16/BF16 parameters of 16+ elements unchanged (pytorch/pytorch#191763): a plain
    SGD over half parameters (fp16-pure, bf16-true, Apex O3) is stepped by its own step, equal to torch's foreach
    step; a user-built SGD(fused=True) over them gets a warning at prepare."""
    import mixprec as mp

    torch.manual_seed(0)
    init = torch.randn(64, dtype=dtype)
    grads = [torch.randn(64, dtype=dtype) for _ in range(2)]
    assert "pytorch/pytorch#191763" in (FusedTwin.unsupported(torch.optim.SGD([nn.Parameter(init.clone())], lr=0.1)) or "")
    p = nn.Parameter(init.clone())
    opt = torch.optim.SGD([p], lr=0.1, momentum=momentum)
    ref = nn.Parameter(init.clone())
    ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=momentum)  # torch's own (non-fused) step
    no_inf = torch.zeros(())
    for g in grads:
        p.grad, ref.grad = g.clone(), g.clone()
        step_or_skip(opt, no_inf, None, (), {}, twin=True)
        ref_opt.step()
    assert torch.equal(p, ref) and not torch.equal(p, init)
    model = nn.Linear(16, 16).to(dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp.MixedPrecision("p=bf16,c=bf16,o=f32,m=none" if dtype == torch.bfloat16 else "fp16-pure").prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1, fused=True))
    assert any("SGD(fused=True) with FP16/BF16 parameters on a CPU" in str(w.message) for w in caught)


# ----- memory layouts the fused kernel would misread ------------------------------------------------
def _layout_case(case: str) -> tuple[list[nn.Parameter], Any]:
    """Parameters and a ``set_grads(step, params)`` for one layout torch's fused kernels would misread."""
    g = torch.Generator().manual_seed(3)
    if case == "views-of-one-tensor":  # two parameters viewing one tensor, only the first with a gradient
        base = torch.randn(4, 6, generator=g)
        ps = [nn.Parameter(base[:, :3]), nn.Parameter(base[:, 3:])]

        def set_grads(step: int, params: list[nn.Parameter]) -> None:
            params[0].grad = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
        return ps, set_grads
    ps = [nn.Parameter(torch.randn(8, 3, 3, 3, generator=g)), nn.Parameter(torch.randn(8, generator=g))]
    if case == "non-dense":
        ps[0] = nn.Parameter(torch.randn(8, 3, 3, 5, generator=g)[..., 1:4])

    def set_grads(step: int, params: list[nn.Parameter]) -> None:
        gg = torch.Generator().manual_seed(step)
        for p in params:
            grad = torch.randn(p.shape, generator=gg)
            # torch.autograd.grad of a conv fed channels_last input: every step, or only the first
            if p.dim() == 4 and (case == "grad-channels-last" or (case == "first-grad-channels-last" and step == 0)):
                grad = grad.contiguous(memory_format=torch.channels_last)
            if case == "format-changed-after-state" and step >= 2 and p.dim() == 4:
                grad = grad.contiguous(memory_format=torch.channels_last)
            p.grad = grad
        if case == "format-changed-after-state" and step == 2:  # model.to(memory_format=...) after step 2
            for p in params:
                if p.dim() == 4:
                    p.data = p.data.contiguous(memory_format=torch.channels_last)
    return ps, set_grads


def _twin_beside_own(opt: Any, own: Any, ps: list[nn.Parameter], own_ps: list[nn.Parameter],
                     set_grads: Any) -> tuple[list[int], list[warnings.WarningMessage]]:
    """Five steps of ``opt`` through the twin beside ``own`` stepped by torch: the host reads per step, the warnings."""
    reads = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            set_grads(step, ps)
            set_grads(step, own_ps)
            with StepCounter((opt,)) as c:
                step_or_skip(opt, torch.tensor(0.0), None, (), {}, twin=True)
            reads.append(c.host_reads)
            own.step()
    return reads, caught


@pytest.mark.parametrize("case", ["grad-channels-last", "non-dense", "views-of-one-tensor"])
@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov"])
def test_a_layout_the_fused_kernel_would_misread_takes_the_optimizers_own_step(case: str, name: str) -> None:
    """torch's fused kernels pair elements in memory order: such steps run the optimizer's own step, equal to it bit for bit."""
    ps, set_grads = _layout_case(case)
    own_ps, _ = _layout_case(case)
    opt = OPTIMIZERS[name](ps, foreach=True)
    own = OPTIMIZERS[name](own_ps, foreach=True)
    reads, caught = _twin_beside_own(opt, own, ps, own_ps, set_grads)
    for p, q in zip(ps, own_ps):
        assert torch.equal(p, q)
    if case == "views-of-one-tensor":
        assert torch.equal(ps[1], own_ps[1])  # the other view untouched (the fused kernel wrote into it)
    msgs = [str(w.message) for w in caught if "memory order" in str(w.message)]
    assert len(msgs) == 1, msgs  # once per cause, not per step
    assert "strides" in msgs[0] and type(opt).__name__ in msgs[0]
    assert reads == [1] * 5


@pytest.mark.parametrize("case", ["format-changed-after-state", "first-grad-channels-last"])
@pytest.mark.parametrize("name", ["adamw", "sgd-dampened"])
def test_state_in_another_layout_is_laid_out_as_its_parameter_and_stays_on_the_fused_kernel(case: str, name: str) -> None:
    """A model moved to channels_last after its state exists, or SGD's momentum cloned from a channels_last gradient by
    a step that fell back: the state is copied into its parameter's layout and later steps are fused again (no host
    read), equal to torch's own step to rounding."""
    make = OPTIMIZERS.get(name) or (lambda ps, **kw: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.1, **kw))
    ps, set_grads = _layout_case(case)
    own_ps, _ = _layout_case(case)
    opt, own = make(ps, foreach=True), make(own_ps, foreach=True)
    reads, caught = _twin_beside_own(opt, own, ps, own_ps, set_grads)
    for p, q in zip(ps, own_ps):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and v.dim():
                assert v.stride() == p.stride(), k
    first = case == "first-grad-channels-last"  # its first step's gradient itself cannot take the kernel
    # (SGD with dampening reads the host until its first applied step anyway)
    assert reads[1:] == [0] * 4 and reads[0] == int(first or name == "sgd-dampened")
    assert len([w for w in caught if "memory order" in str(w.message)]) == int(first)


def test_one_memory_order_everywhere_stays_on_the_fused_kernel() -> None:
    """channels_last parameters with channels_last gradients and states, 1x1 and depthwise convs (their size-1
    dimensions' strides differ between formats), an empty parameter: no host read, no warning, torch's fused result."""
    cl = torch.channels_last
    shapes = [(8, 3, 3, 3), (8, 8, 1, 1), (8, 1, 3, 3), (4, 0)]

    def make() -> list[nn.Parameter]:
        g = torch.Generator().manual_seed(4)
        return [nn.Parameter(torch.randn(s, generator=g).contiguous(memory_format=cl) if len(s) == 4 else torch.empty(s))
                for s in shapes]

    ps, fused_ps = make(), make()
    opt, fused = torch.optim.AdamW(ps, lr=1e-2, foreach=True), torch.optim.AdamW(fused_ps, lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            for p, q in zip(ps, fused_ps):
                # autograd's gradient: the channels_last strides on big dimensions, contiguous ones on size-1 dimensions
                grad = torch.randn(p.shape, generator=g)
                grad = grad.contiguous(memory_format=cl) if p.dim() == 4 and p.shape[2] > 1 and p.shape[1] > 1 else grad
                p.grad, q.grad = grad.clone(), grad.clone()
            with StepCounter((opt,)) as c:
                step_or_skip(opt, torch.tensor(0.0), None, (), {}, twin=True)
            assert c.host_reads == 0
            fused.step()
    for p, q in zip(ps, fused_ps):
        assert torch.equal(p, q)


def test_a_sparse_gradient_is_decided_on_the_host_without_a_layout_warning() -> None:
    emb = nn.Embedding(20, 8, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            emb(torch.tensor([1, 3, 3])).sum().backward()
            with StepCounter((opt,)) as c:
                step_or_skip(opt, torch.tensor(0.0), None, (), {}, twin=True)
            assert c.host_reads == 1
            opt.zero_grad()
    assert opt._mixprec_twin.sparse


def test_the_layout_check_costs_no_python_call_per_parameter_and_ignores_frozen_slices() -> None:
    """A channels_last model (the per-parameter stride comparison runs every step): the twin's decision makes as many
    Python calls for 24 parameters as for 6; a frozen parameter that views part of a larger tensor (no gradient) does
    not take the step off the fused kernel."""
    from mixprec.bench._step_cost import python_calls

    def calls(n: int) -> int:
        g = torch.Generator().manual_seed(6)
        ps = [nn.Parameter(torch.randn(4, 3, 3, 3, generator=g).contiguous(memory_format=torch.channels_last))
              for _ in range(n)]
        frozen = nn.Parameter(torch.randn(4, 10, generator=g)[:, 2:5], requires_grad=False)
        opt = torch.optim.AdamW([*ps, frozen], lr=1e-2, foreach=True)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).contiguous(memory_format=torch.channels_last)
        twin = FusedTwin(opt)
        assert not twin.needs_host_read()  # made ready here (the per-parameter work of the first step)
        return python_calls(twin.needs_host_read)

    assert calls(6) == calls(24)
