"""The fused step's tiles (issue 27): one compiled graph per configuration, whatever the parameter shapes.

Asserted: with a tile of 64 elements and at most 4 segments per packed tile (so that tiny tensors
exercise every case: full-tile slices of a large tensor stepped in place, its remainder packed, a
contiguous tensor split across two packed tiles, a non-contiguous tensor gathered by a copy, a 0-d
parameter, a tile closed by its segment limit, the zero padding of the last tile), the compiled
step equals the compiled step over one packed tile bit for bit (Kahan with FP32 states and a loss
scale; stochastic rounding with BF16 states, whose random bits depend on each element's global
position), through a skipped step, tracks the eager step, and compiles three graphs (direct tiles
of two sizes, packed tiles); a master-weight bucket that mixes mirrored BF16
weights and an FP32 parameter (no mirror) writes every mirror and carries data edits in, as the
eager step does.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import mixprec.optim as mo
from mixprec import MasterWeightOptimizer
from mixprec.optim import _fused_step, _parts

from ._util import assert_bit_identical, snapshot

TILE = 64
#: (shape, transposed): 160 elements = 2 full tiles + 32; 300 = one 4-tile slice + 44.
SHAPES = [((8, 20), False), ((5,), False), ((3,), False), ((), False), ((3, 7), True), ((2,), False),
          ((40,), False), ((64,), False), ((6,), False), ((300,), False)]
STEPS = 4
SKIP_STEP = 1


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    out = []
    for shape, transposed in SHAPES:
        t = torch.randn(shape, generator=g).to(torch.bfloat16)
        out.append(torch.nn.Parameter(t.t().contiguous().t() if transposed else t))  # same shape, other strides
    return out


def _run(params: list[torch.nn.Parameter], opt: mo.LowPrecisionOptimizer, scaled: bool) -> None:
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 + step)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * (8.0 if scaled else 1.0)).to(torch.bfloat16)
        kw = {"grad_scale": torch.tensor(8.0)} if scaled else {}
        opt.step(found_inf=torch.tensor(float(step == SKIP_STEP)), **kw)


@pytest.mark.parametrize(("compensation", "state_dtype", "scaled"),
                         [("kahan", torch.float32, True), ("stochastic", torch.bfloat16, False)])
def test_tiled_fused_step_is_independent_of_the_tiling_and_compiles_three_graphs(compensation, state_dtype, scaled,
                                                                                monkeypatch):
    """64-element tiles (direct, 4x direct and packed tiles) against one packed 2**16-element tile: bit for bit.

    The reference is the fused step itself with every parameter in one packed tile (the
    arithmetic is Inductor's in both, and the random bits a function of each element's global
    position, so the tiling must not show); the eager step is checked to FP32/BF16 rounding
    (it agrees bit for bit on the tiny shapes of ``test_fused.py``; on these it differs in
    single elements by an ulp, as the per-bucket compiled step before the tiles did).
    """
    monkeypatch.setattr(_fused_step, "_SEGS", 4)  # packed tiles close after 4 segments
    runs = []
    # The last two runs take the GPU's gather and scatter (cat of flat views, split + _foreach_copy_).
    for fused, chunk, one_op in ((False, TILE, True), (True, 1 << 16, True), (True, TILE, True), (False, TILE, False),
                                 (True, TILE, False)):
        monkeypatch.setattr(_parts, "_ONE_OP_COPY_DEVICES", frozenset({"cpu"} if one_op else ()))
        params = _params()
        assert not params[4].is_contiguous()
        opt = mo.AdamW(params, lr=1e-2, weight_decay=0.1, compensation=compensation, state_dtype=state_dtype,
                       chunk_numel=chunk, seed=5, fused=fused)
        graphs = counters["stats"]["unique_graphs"]
        _run(params, opt, scaled)
        if fused and chunk == TILE and one_op:
            # Three graphs: direct tiles of 64 and of 256 elements, packed tiles.
            assert len(opt._fused_fns) == 3 and opt._fused_off is None
            assert counters["stats"]["unique_graphs"] - graphs <= 3  # fewer: compiled by an earlier test here
            layout = opt._plan_cache[0][1][0].fused
            assert sorted(d for d in layout.direct if d) == [64, 64, 64, 256] and len(layout.tiles) >= 7
        runs.append(snapshot(opt))
    eager, one_tile, tiled, eager_gpu_copies, tiled_gpu_copies = runs
    assert_bit_identical(one_tile, tiled)
    assert_bit_identical(tiled, tiled_gpu_copies)
    assert_bit_identical(eager, eager_gpu_copies)
    for (k, a), (_, b) in zip(eager, tiled):
        torch.testing.assert_close(b.float(), a.float(), rtol=0, atol=2e-5 if "comp" in k or a.dtype == torch.float32
                                   else 1e-2, msg=k)
    assert not torch.equal(runs[2][0][1], _params()[0].detach())  # the run moved


def test_master_bucket_with_and_without_mirrors_writes_every_mirror_and_carries_edits():
    """BF16 weights (mirrors of FP32 masters) and an FP32 parameter (its own master) in one fused bucket."""
    runs = []
    for fused in (False, True):
        torch.manual_seed(0)
        half = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in [(8, 4), (8,)]]
        f32 = torch.nn.Parameter(torch.randn(5))
        opt = MasterWeightOptimizer(torch.optim.AdamW([*half, f32], lr=1e-2, weight_decay=0.1), fused=fused)
        for step in range(3):
            if step == 2:
                half[0].data.mul_((torch.arange(32).reshape(8, 4) % 3 != 0).to(torch.bfloat16))  # a pruning edit
            g = torch.Generator().manual_seed(step)
            for m in opt.masters:
                m.grad = torch.randn(m.shape, generator=g)
            opt.step()
        for p, m in zip(half, opt.masters):
            assert torch.equal(p.detach(), m.to(torch.bfloat16))  # copied back (in the kernel when fused)
        if fused:
            view = opt._shadow._view
            assert view is not None and len(view._fused_fns) == 1
        runs.append(([m.detach().clone() for m in opt.masters], half))
    (eager, _), (fused_masters, _) = runs
    for a, b in zip(eager, fused_masters):
        # mixprec's FP32 AdamW against torch's: FP32 rounding apart. A pruning edit the fused step
        # missed would leave O(1) differences in the masters of the pruned elements.
        torch.testing.assert_close(b, a, rtol=0, atol=2e-6)


@pytest.mark.parametrize(("compensation", "state_dtype"), [("kahan", torch.float32), ("stochastic", torch.bfloat16)])
def test_a_channels_last_weight_larger_than_a_tile_is_staged_and_steps_as_a_contiguous_one(compensation, state_dtype,
                                                                                          monkeypatch):
    """A non-contiguous parameter larger than a tile (a channels_last conv weight) cannot be sliced in place: it is
    staged through a contiguous stand-in in logical order, so the compiled step runs (no eager fallback, no
    warning) and equals, bit for bit, the compiled step of the same values laid out contiguously (the same
    global positions, hence the same random bits), and the eager step (see ``_eager_sqrt_is_exact``); the
    weight keeps its layout."""
    monkeypatch.setattr(_fused_step, "_CPU_FUSED_TILE", TILE)
    g = torch.Generator().manual_seed(0)
    conv = torch.randn(8, 4, 3, 3, generator=g).to(torch.bfloat16)  # 288 elements: 4 full tiles + 32
    vec = torch.randn(40, generator=g).to(torch.bfloat16)
    runs = {}
    for name, fused, fmt in (("eager", False, torch.channels_last), ("fused", True, torch.channels_last),
                             ("fused-contiguous", True, torch.contiguous_format)):
        params = [torch.nn.Parameter(conv.clone().to(memory_format=fmt)), torch.nn.Parameter(vec.clone())]
        assert params[0].is_contiguous() == (fmt == torch.contiguous_format)
        opt = mo.AdamW(params, lr=1e-2, weight_decay=0.1, compensation=compensation, state_dtype=state_dtype,
                       fused=fused, seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no "steps eagerly" warning
            _run(params, opt, scaled=compensation == "kahan")
        assert bool(opt._fused_fns) is fused
        if name == "fused":
            assert params[0].is_contiguous(memory_format=torch.channels_last)  # written back in place
            # its stand-ins: the weight, the Kahan buffer if it follows the weight's layout (states are contiguous)
            staged = [t for t in [params[0], *opt.state[params[0]].values()] if t.dim() and not t.is_contiguous()]
            pad = opt._plan_cache[0][1][0].fused.home_pad  # and the padding of the packed tile's state buffers
            assert opt.memory_bytes()["staging"] == sum(t.numel() * t.element_size() for t in staged) + pad > pad
        else:  # nothing staged (the padding of packed tiles' state buffers, if any, is counted)
            pad = opt._plan_cache[0][1][0].fused.home_pad if fused else 0
            assert opt.memory_bytes()["staging"] == pad
        runs[name] = [(k, v.contiguous()) for k, v in snapshot(opt)]
    assert_bit_identical(runs["fused"], runs["fused-contiguous"])
    if _eager_sqrt_is_exact():
        assert_bit_identical(runs["fused"], runs["eager"])
    else:  # a 1-ulp root moves a rare element of the weight or its Kahan remainder by one BF16 ulp
        for (k, a), (_, b) in zip(runs["fused"], runs["eager"]):
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-8, msg=k)
    assert not torch.equal(runs["fused"][0][1], conv)  # the weight moved


def _eager_sqrt_is_exact() -> bool:
    """Whether this torch build's eager FP32 ``sqrt`` on a CPU is correctly rounded, as Inductor's is.

    The fused step equals the eager one bit for bit only then: torch 2.13.0+cpu's eager ``sqrt`` is
    one ulp off for ~20% of FP32 inputs (measured 2026-11-27), so AdamW's denominator differs there
    and, rarely, an element of the update crosses a rounding boundary.
    """
    x = torch.linspace(1e-12, 4.0, 4096, dtype=torch.float32)
    return torch.equal(x.sqrt(), x.double().sqrt().float())


def test_a_bucket_that_cannot_be_tiled_steps_eagerly_with_one_warning_that_names_why(monkeypatch):
    """Mirrors of two dtypes cannot share a tile step: that bucket steps eagerly and the user is told once why."""
    opt = mo.AdamW([torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))], lr=1e-2, fused=True)
    params = opt.param_groups[0]["params"]
    opt.mirrors = {id(params[0]): torch.zeros(4, dtype=torch.bfloat16), id(params[1]): torch.zeros(3, dtype=torch.float16)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "mirrors of two dtypes" in msgs[0] and "steps eagerly" in msgs[0], msgs
    assert not opt._fused_fns


@pytest.mark.parametrize("preset", ["bf16-master", "bf16-master-r16"])
def test_channels_last_conv_weights_take_the_fused_master_step(preset, monkeypatch):
    """Through MixedPrecision: a channels_last conv net's master step runs compiled (its FP32 masters and half
    weights staged where they are not contiguous), writes the half weights back in their layout, says nothing
    about an eager fallback, and tracks the unfused master step."""
    import mixprec

    monkeypatch.setattr(_fused_step, "_CPU_FUSED_TILE", 256)

    def run(fused: bool) -> tuple[list[torch.Tensor], object, torch.nn.Module]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3))
        net = net.to(memory_format=torch.channels_last)  # the second weight: 2304 elements > 256
        prec = mixprec.MixedPrecision(preset, fused=fused)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # prepare's advice on a CPU
            model, opt = prec.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(3):
                x = torch.randn(4, 3, 10, 10, generator=torch.Generator().manual_seed(i))
                with prec.autocast():
                    loss = model(x.to(memory_format=torch.channels_last)).float().square().mean()
                prec.backward(loss)
                prec.step(opt)
                opt.zero_grad()
        assert not [w for w in caught if "eagerly" in str(w.message)]
        return [p.detach().float().clone() for p in model.parameters()], opt, model

    fused, opt, model = run(True)
    shadow = getattr(opt, "_shadow", None)
    assert shadow is not None and shadow._view is not None and shadow._view._fused_fns  # the compiled step ran
    assert model[2].weight.is_contiguous(memory_format=torch.channels_last)
    unfused, _, _ = run(False)
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-6)
    torch.manual_seed(0)  # the same initial weights as in run()
    start = torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3)
    assert not torch.equal(fused[2], start[2].weight.detach().to(torch.bfloat16).float())  # the step moved it


@pytest.mark.parametrize("fused", [True, None])
def test_a_tile_kind_that_fails_to_compile_changes_nothing_before_the_fallback(fused, monkeypatch):
    """Every tile kind compiles (on scratch copies) before any tile is stepped: when the packed kind fails after
    the direct kind compiled, fused=True raises with the weights untouched, and fused=None warns and steps
    eagerly, equal to an eager optimizer's step (no tile stepped twice)."""
    monkeypatch.setattr(_fused_step, "_CPU_FUSED_TILE", TILE)
    real = _fused_step.FusedStep._build_fused

    def build(self, hp, pdt, keys, scalar_keys, layout, direct, n):
        fn = real(self, hp, pdt, keys, scalar_keys, layout, direct, n)
        if direct:
            return fn

        def broken(*args):
            raise RuntimeError("simulated Inductor failure")
        return broken

    monkeypatch.setattr(_fused_step.FusedStep, "_build_fused", build)
    hp = {"lr": 1e-2, "eps": 1.2345e-7, "compensation": "kahan", "seed": 0}  # an eps no other test compiled
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(160, generator=g).to(torch.bfloat16), torch.randn(5, generator=g).to(torch.bfloat16)]
    grads = [torch.randn(160, generator=g).to(torch.bfloat16), torch.randn(5, generator=g).to(torch.bfloat16)]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = mo.AdamW(params, fused=fused, **hp)
    opt._prefer_fused = True  # what MixedPrecision sets for a compiled model: fused=None then compiles on a CPU
    for p, gr in zip(params, grads):
        p.grad = gr.clone()
    if fused:
        with pytest.raises(RuntimeError, match="simulated Inductor failure"):
            opt.step()
        assert all(torch.equal(p.detach(), t) for p, t in zip(params, init))  # the direct tiles were not stepped
        return
    with pytest.warns(RuntimeWarning, match="failed to build"):
        opt.step()
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    ref_opt = mo.AdamW(ref, fused=False, **hp)
    for p, gr in zip(ref, grads):
        p.grad = gr.clone()
    ref_opt.step()
    assert_bit_identical(snapshot(opt), snapshot(ref_opt))


def test_after_its_first_call_a_tile_step_calls_the_compiled_graph_without_dynamo(monkeypatch):
    """Each configuration's first call compiles through dynamo; later calls pass the graph's inputs straight to
    Inductor's compiled graph (no dynamo entry), equal bit for bit to steps that all go through dynamo."""
    monkeypatch.setattr(_fused_step, "_SEGS", 4)

    def make() -> tuple[list[torch.nn.Parameter], mo.AdamW]:
        params = _params()
        return params, mo.AdamW(params, lr=1e-2, weight_decay=0.1, compensation="kahan", chunk_numel=TILE, seed=5,
                                fused=True)

    params, opt = make()
    _run(params, opt, True)  # compiles (or reuses) every tile kind
    fns = list(opt._fused_fns.values())
    assert len(fns) == 3 and all(isinstance(f, _fused_step._TileCall) and f.picks is not None for f in fns)

    def no_dynamo(*args):
        raise AssertionError("a tile step went through dynamo after its graph was known")

    for f in fns:
        monkeypatch.setattr(f, "dynamo_fn", no_dynamo)
    _run(params, opt, True)  # four more steps, none through dynamo (no_dynamo would raise)
    direct = snapshot(opt)

    # The reference: the same eight steps with every call through dynamo (no graph input ever matched).
    cache = dict(_fused_step._FUSED_CACHE)
    _fused_step._FUSED_CACHE.clear()
    monkeypatch.setattr(_fused_step, "_input_picks", lambda args, inputs: None)
    try:
        params, opt = make()
        _run(params, opt, True)
        _run(params, opt, True)
        assert all(f.picks is None for f in opt._fused_fns.values())
    finally:
        _fused_step._FUSED_CACHE.clear()
        _fused_step._FUSED_CACHE.update(cache)  # later tests reuse the graphs compiled before
    assert_bit_identical(direct, snapshot(opt))


def test_input_picks_finds_each_graph_input_once_among_the_arguments():
    a, b, c = torch.zeros(2), torch.zeros(3), torch.zeros(4)
    args = (a, None, [b, c], 1.5)
    assert _fused_step._input_picks(args, [c, a, b]) == [(2, 1), (0, -1), (2, 0)]
    assert _fused_step._input_picks(args, [torch.zeros(2)]) is None  # not an argument
    assert _fused_step._input_picks((a, [a]), [a]) is None  # ambiguous: passed twice


def test_a_compiled_graph_that_takes_its_inputs_otherwise_falls_back_to_dynamo_at_its_first_direct_call(monkeypatch):
    """A calling-convention mismatch (another torch) surfaces as TypeError/IndexError before any kernel: the call
    then goes through dynamo, direct calls stay off, and the steps equal a run that never tried them."""
    monkeypatch.setattr(_fused_step, "_SEGS", 4)
    monkeypatch.setattr(_fused_step, "_FUSED_CACHE", {})
    real = _fused_step._TileCall._backend

    def backend(self, gm, example_inputs):
        compiled = real(self, gm, example_inputs)

        def boxed_only(*args):
            raise IndexError("list index out of range")  # what a graph taking one list raises on positional inputs

        if self.graph_fn is not None:
            self.graph_fn = boxed_only
        return compiled

    monkeypatch.setattr(_fused_step._TileCall, "_backend", backend)
    params = _params()
    opt = mo.AdamW(params, lr=1e-2, weight_decay=0.1, compensation="kahan", chunk_numel=TILE, seed=5, fused=True)
    _run(params, opt, True)
    _run(params, opt, True)
    assert all(f.picks is None and f.graph_fn is None for f in opt._fused_fns.values())
    got = snapshot(opt)
    monkeypatch.setattr(_fused_step, "_DIRECT_CALLS", False)
    monkeypatch.setattr(_fused_step, "_FUSED_CACHE", {})
    params = _params()
    opt = mo.AdamW(params, lr=1e-2, weight_decay=0.1, compensation="kahan", chunk_numel=TILE, seed=5, fused=True)
    _run(params, opt, True)
    _run(params, opt, True)
    assert_bit_identical(got, snapshot(opt))


@pytest.mark.parametrize("one_op", [True, False], ids=["cpu-copies", "gpu-copies"])
@pytest.mark.parametrize(("compensation", "state_dtype"), [("kahan", torch.float32), ("stochastic", torch.bfloat16)])
def test_packed_tiles_of_whole_tensors_hold_their_states_and_a_checkpoint_resumes_bit_for_bit(compensation, state_dtype,
                                                                                             one_op, monkeypatch):
    """A packed tile of whole tensors keeps their states (and Kahan buffers) in one buffer per kind, stepped in place:
    the state tensors are the same objects, sharing that buffer; a ``state_dict`` saved mid-run and loaded into a
    fresh optimizer (which homes the loaded tensors again) resumes bit for bit; and the tiles that still gather
    (remainders of sliced tensors) step alike. With the GPU's copies (packed tiles' parameters and gradients
    through two shared buffers) too; the held buffers' padding stays zero either way."""
    import io

    monkeypatch.setattr(_fused_step, "_SEGS", 4)
    monkeypatch.setattr(_fused_step, "_CPU_FUSED_TILE", TILE)
    monkeypatch.setattr(_parts, "_ONE_OP_COPY_DEVICES", frozenset({"cpu"} if one_op else ()))
    if not one_op and compensation == "kahan":  # compiled here, on the copies' buffers (scratch copies of them)
        monkeypatch.setattr(_fused_step, "_FUSED_CACHE", {})

    def make() -> tuple[list[torch.nn.Parameter], mo.AdamW]:
        params = _params()
        return params, mo.AdamW(params, lr=1e-2, weight_decay=0.1, compensation=compensation, state_dtype=state_dtype,
                                seed=5, fused=True)

    def steps(params: list[torch.nn.Parameter], opt: mo.AdamW, first: int, n: int) -> None:
        for step in range(first, first + n):
            g = torch.Generator().manual_seed(10 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            opt.step(found_inf=torch.tensor(float(step == SKIP_STEP)))

    params, opt = make()
    steps(params, opt, 0, 2)
    layout = opt._plan_cache[0][1][0].fused
    homed = [(t, kind, buf) for t, homes in enumerate(layout.homes) for kind, buf in homes.items()]
    kinds = {kind for _, kind, _ in homed}
    assert kinds == ({"kahan_comp"} if compensation == "kahan" else set()) | {"exp_avg", "exp_avg_sq"}
    gathered = [t for t, d in enumerate(layout.direct) if not d and not layout.homes[t]]
    assert gathered  # the remainders of the sliced tensors: a tile that still gathers its states
    for t, d in enumerate(layout.direct):  # homed exactly when packed, of whole tensors and at least 3/4 full
        tile = layout.tiles[t]
        whole = all(s.start == 0 and s.stop == params[s.param].numel() for s in tile.segs)
        assert bool(layout.homes[t]) == (not d and whole and tile.total * 4 >= TILE * 3), (t, tile.segs)
    for t, kind, buf in homed:
        for s in layout.tiles[t].segs:
            st = opt.state[params[s.param]][kind]
            assert st.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    saved = [p.detach().clone() for p in params]
    steps(params, opt, 2, 2)
    resumed_params, resumed = make()
    with torch.no_grad():
        for p, v in zip(resumed_params, saved):
            p.copy_(v)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf))
    steps(resumed_params, resumed, 2, 2)
    assert_bit_identical(snapshot(opt), snapshot(resumed))
    again = resumed._plan_cache[0][1][0].fused
    assert {k for h in again.homes for k in h} == kinds  # the loaded tensors were homed in turn
    assert bool(again.copy_bufs) is not one_op and sum(c is not None for c in again.copies) == (0 if one_op else sum(
        1 for d, r in zip(again.direct, again.rem_tiles) if not d and not r))
    for t, homes in enumerate(again.homes):  # padding in, zeros out: nothing of another tile leaks into it
        for kind, buf in homes.items():
            assert not buf[again.tiles[t].total:].any(), (t, kind)


def test_the_gpu_tile_grows_with_the_bucket_in_two_sizes_and_chunk_numel_caps_it():
    """A GPU bucket of at most 2**22 elements takes 2**21-element tiles, a larger one 2**23 (fewer host calls:
    GPT-2's Kahan step 15.0 ms at 2**21, 8.3 ms at 2**23 on an H200); a CPU 2**16; ``chunk_numel`` caps all."""
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = mo.AdamW([p], fused=False)
    cuda = torch.device("cuda")
    assert opt._fused_tile_numel(cuda, 1000) == opt._fused_tile_numel(cuda, 1 << 22) == 1 << 21
    assert opt._fused_tile_numel(cuda, (1 << 22) + 1) == opt._fused_tile_numel(cuda, 124_000_000) == 1 << 23
    assert opt._fused_tile_numel(torch.device("cpu"), 124_000_000) == 1 << 16
    assert mo.AdamW([p], fused=False, chunk_numel=1 << 20)._fused_tile_numel(cuda, 124_000_000) == 1 << 20


def test_copies_move_a_packed_tiles_tensors_through_the_shared_buffers_and_zero_what_another_tile_left():
    """The GPU's route for a packed tile (``_fused_step._Copies``): whole tensors (one transposed, one 0-d) and part
    of a larger one land in logical order in the parameter and gradient buffers, the padding after them is zeroed
    (a fuller tile stepped before left values there), and the parameters go back from the buffer."""
    from mixprec.optim._parts import _Segment, _Tile

    g = torch.Generator().manual_seed(0)
    params = [torch.randn(3, 5, generator=g).t(), torch.randn((), generator=g), torch.randn(40, generator=g)]
    grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in params]
    segs = [_Segment(0, 0, 15), _Segment(1, 0, 1), _Segment(2, 8, 30)]  # the last: elements 8..29 of a 40-element one
    tile = _Tile(segs, [0, 15, 16], torch.device("cpu"))
    tile.bind(None, params)
    pbuf, gbuf = torch.full((64,), 7.0), torch.full((64,), 7.0, dtype=torch.bfloat16)  # another tile's leftovers
    copies = _fused_step._Copies(tile, pbuf, gbuf)
    copies.gather(grads)
    want_p = torch.cat([params[0].reshape(-1), params[1].reshape(1), params[2][8:30]])
    want_g = torch.cat([grads[0].reshape(-1), grads[1].reshape(1), grads[2][8:30]])
    assert torch.equal(pbuf[:38], want_p) and torch.equal(gbuf[:38], want_g)
    assert not pbuf[38:].any() and not gbuf[38:].any()
    pbuf.mul_(2.0)  # "the step"
    before = [p.clone() for p in params]
    copies.scatter()
    assert torch.equal(params[0], before[0] * 2) and torch.equal(params[1], before[1] * 2)
    assert torch.equal(params[2][8:30], before[2][8:30] * 2)
    assert torch.equal(params[2][:8], before[2][:8]) and torch.equal(params[2][30:], before[2][30:])  # not its part
