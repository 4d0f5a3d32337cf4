"""torch.compile and prepared models: no graph breaks from mixprec, eager numerics, portable checkpoints.

Graph breaks are counted with ``torch._dynamo.explain`` (tracing only, no code generation), and
the ones mixprec causes are those of the prepared model minus those of the same model unprepared.
Training runs use the ``aot_eager`` backend (dynamo + AOTAutograd graphs, run by eager kernels):
it exercises the capture of forward and backward at a fraction of Inductor's compile time; one
test runs Inductor itself.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn

import mixprec as mp
from mixprec._checkpoint import canonical_name, key_mismatch_hint
from mixprec.bench._workloads import CharGPT
from mixprec.checkpoint import fp32_state_dict

PRESETS = ["fp32", "tf32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-pure", "fp16-pure"]
# Loss tolerance of a compiled run against the eager one, per compute dtype (10 steps).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
VOCAB, BLOCK = 32, 16


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    dynamo.reset()
    yield
    dynamo.reset()


def _gpt(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return CharGPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32)


def _batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, BLOCK), generator=g) for _ in range(n)]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).float().flatten(0, 1), x.flatten())


def _breaks(fn: Callable[..., Any], *args: Any) -> tuple[int, list[str]]:
    dynamo.reset()
    ex = dynamo.explain(fn)(*args)
    return ex.graph_break_count, [str(b.reason).splitlines()[0] for b in ex.break_reasons]


@pytest.mark.parametrize("preset", PRESETS)
def test_prepared_transformer_has_no_graph_breaks(preset: str) -> None:
    x = _batches(1)[0]
    plain = _gpt()
    base, _ = _breaks(lambda t: _loss(plain, t), x)
    model = _gpt()
    prec = mp.MixedPrecision(preset)
    model, _ = prec.prepare(model, torch.optim.AdamW(model.parameters()))
    assert any(prec.policy.is_fp32_island(m, n) for n, m in model.named_modules()) or prec.policy.compute_dtype == torch.float32

    def step(t: torch.Tensor) -> torch.Tensor:
        with prec.autocast():  # inside the traced function: a plain torch.autocast, no break
            return _loss(model, t)

    count, reasons = _breaks(step, x)
    assert count - base == 0, reasons


def _hf_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("preset", PRESETS)
def test_hf_gpt2_has_no_graph_breaks(preset: str) -> None:
    x = torch.randint(0, 64, (2, 16))
    build = _hf_gpt2
    plain = build()
    base, _ = _breaks(lambda t: plain(input_ids=t).logits.float().square().mean(), x)
    model = build()
    prec = mp.MixedPrecision(preset)
    model, _ = prec.prepare(model, torch.optim.AdamW(model.parameters()))

    def fwd(t: torch.Tensor) -> torch.Tensor:
        with prec.autocast():
            return model(input_ids=t).logits.float().square().mean()

    count, reasons = _breaks(fwd, x)
    assert count - base == 0, reasons


def _train(preset: str, order: str, steps: int = 10, backend: str = "aot_eager") -> list[float]:
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prec = mp.MixedPrecision(preset)
    if order == "compile-first":
        model = torch.compile(model, backend=backend)
    model, opt = prec.prepare(model, opt)
    if order == "prepare-first":
        model = torch.compile(model, backend=backend)
    return _run_segment(prec, model, opt, _batches(steps))


@pytest.mark.parametrize(
    "preset", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "bf16-master-r16", "fp16-master", "bf16-pure"]
)
@pytest.mark.parametrize("order", ["prepare-first", "compile-first"])
def test_compiled_training_matches_eager(preset: str, order: str) -> None:
    eager = _train(preset, "eager")
    compiled = _train(preset, order)
    tol = TOL[mp.Policy.parse(preset).compute_dtype]
    assert compiled == pytest.approx(eager, abs=tol)
    assert compiled[-1] < compiled[0]


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp16-master"])
def test_compiled_hf_gpt2_trains_like_eager(preset: str) -> None:
    def run(compiled: bool) -> list[float]:
        model = _hf_gpt2()
        prec = mp.MixedPrecision(preset)
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        if compiled:
            model = torch.compile(model, backend="aot_eager")
        g = torch.Generator().manual_seed(3)
        batches = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(2)]
        losses = []
        for i in range(10):
            x = batches[i % 2]  # two batches, revisited: the loss must fall
            with prec.autocast():
                loss = model(input_ids=x, labels=x).loss
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    eager, compiled = run(False), run(True)
    assert compiled == pytest.approx(eager, abs=TOL[mp.Policy.parse(preset).compute_dtype])
    assert compiled[-1] < compiled[0]


def test_inductor_training_matches_eager() -> None:
    # Inductor fuses elementwise chains (different rounding points): per-dtype tolerance, not bits.
    eager = _train("bf16-mixed", "eager", steps=6)
    compiled = _train("bf16-mixed", "prepare-first", steps=6, backend="inductor")
    assert compiled == pytest.approx(eager, abs=TOL[torch.bfloat16])


def test_compiled_island_runs_in_fp32_with_autocast_off() -> None:
    seen: list[tuple[torch.dtype, bool]] = []

    class Probe(nn.LayerNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            # Recorded at trace time under compile: what the graph computes in.
            seen.append((x.dtype, torch.is_autocast_enabled("cpu")))
            return out

    model = nn.Sequential(nn.Linear(8, 8), Probe(8), nn.Linear(8, 8))
    prec = mp.MixedPrecision("bf16-mixed")
    model, _ = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    compiled = torch.compile(model, backend="aot_eager")
    with prec.autocast():
        out = compiled(torch.randn(4, 8))
    assert seen and all(s == (torch.float32, False) for s in seen)
    assert out.dtype == torch.float32  # the output dtype of bf16-mixed
    with prec.autocast():
        eager = model(torch.randn(4, 8))
    assert eager.dtype == torch.float32


def _run_segment(prec: mp.MixedPrecision, model: nn.Module, opt: Any, batches: list[torch.Tensor]) -> list[float]:
    out = []
    for x in batches:
        with prec.autocast():
            loss = _loss(model, x)
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad()
        out.append(loss.item())
    return out


def _fresh(preset: str, compiled: bool, order: str = "compile-first",
           fused: bool | None = False, backend: str = "aot_eager") -> tuple[mp.MixedPrecision, nn.Module, Any]:
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # fused=False by default here: a compiled model turns the fused (Inductor) optimizer step on
    # under fused=None, and a compiled and an uncompiled segment must step alike to compare bits.
    prec = mp.MixedPrecision(preset, fused=fused)
    if compiled and order == "compile-first":
        model = torch.compile(model, backend=backend)
    model, opt = prec.prepare(model, opt)
    if compiled and order == "prepare-first":
        model = torch.compile(model, backend=backend)
    return prec, model, opt


def _saved(prec: mp.MixedPrecision, tmp_path: Any, name: str) -> dict[str, Any]:
    path = tmp_path / name
    mp.save(prec.state_dict(), path)
    return mp.load(path)


@pytest.mark.parametrize("preset", ["bf16-master", "bf16-pure", "fp16-mixed"])
def test_checkpoint_round_trips_compiled_uncompiled_compiled(preset: str, tmp_path: Any) -> None:
    batches = _batches(9)
    # Reference: one run per segment kind, never saved: the same model objects carry on.
    p1, m1, o1 = _fresh(preset, compiled=True)
    ref = _run_segment(p1, m1, o1, batches[:3])
    ref += _run_segment(p1, m1, o1, batches[3:6])
    ref += _run_segment(p1, m1, o1, batches[6:])

    pa, ma, oa = _fresh(preset, compiled=True)
    got = _run_segment(pa, ma, oa, batches[:3])
    state = _saved(pa, tmp_path, "a.pt")
    assert not any("_orig_mod" in k for k in state["model"])
    assert not any("_orig_mod" in n for names in state["param_names"] for n in names)

    pb, mb, ob = _fresh(preset, compiled=False)
    pb.load_state_dict(state)
    got += _run_segment(pb, mb, ob, batches[3:6])
    state = _saved(pb, tmp_path, "b.pt")

    pc, mc, oc = _fresh(preset, compiled=True)
    pc.load_state_dict(state)
    got += _run_segment(pc, mc, oc, batches[6:])
    assert got == ref  # bit for bit: aot_eager runs the eager kernels
    final_ref, final_got = p1.state_dict(), pc.state_dict()
    for k, v in final_ref["model"].items():
        assert torch.equal(v, final_got["model"][k]), k


def test_inductor_run_fuses_the_compensated_step_and_resumes_bit_identically(tmp_path: Any) -> None:
    """fused=None on an Inductor-compiled model: the compensated step runs compiled, and a resumed run equals an
    uninterrupted one; the master step keeps torch's fused kernel on a CPU (nothing to compile)."""
    batches = _batches(6)
    p1, m1, o1 = _fresh("bf16-pure", compiled=True, fused=None, backend="inductor")
    ref = _run_segment(p1, m1, o1, batches)
    assert p1._seen_compiled is True
    assert o1.prefer_fused and o1._fused_fns, "not fused"

    pa, ma, oa = _fresh("bf16-pure", compiled=True, fused=None, backend="inductor")
    got = _run_segment(pa, ma, oa, batches[:3])
    state = _saved(pa, tmp_path, "a.pt")
    pb, mb, ob = _fresh("bf16-pure", compiled=True, fused=None, backend="inductor")
    pb.load_state_dict(state)
    got += _run_segment(pb, mb, ob, batches[3:])
    assert got == ref
    for k, v in p1.state_dict()["model"].items():
        assert torch.equal(v, pb.state_dict()["model"][k]), k
    pm, mm, om = _fresh("bf16-master", compiled=True, fused=None, backend="inductor")
    _run_segment(pm, mm, om, batches[:1])
    assert pm._seen_compiled is True and om._fused_shadow() is None
    # A debugging backend (aot_eager) is not a reason to compile the step: it stays eager.
    pd, md, od = _fresh("bf16-pure", compiled=True, fused=None)
    _run_segment(pd, md, od, batches[:1])
    assert pd._seen_compiled is False and not od.prefer_fused and not od._fused_fns


def test_old_checkpoint_with_orig_mod_keys_loads_uncompiled() -> None:
    pa, ma, oa = _fresh("bf16-master", compiled=True)
    _run_segment(pa, ma, oa, _batches(2))
    state = pa.state_dict()
    # What mixprec 0.1 wrote for a model compiled before prepare.
    state["model"] = {"_orig_mod." + k: v for k, v in state["model"].items()}
    state["param_names"] = [["_orig_mod." + n for n in names] for names in state["param_names"]]
    pb, _, _ = _fresh("bf16-master", compiled=False)
    pb.load_state_dict(state)
    for k, v in pb.state_dict()["model"].items():
        assert torch.equal(v, state["model"]["_orig_mod." + k])


def test_fp32_export_of_a_compiled_run_loads_into_a_plain_model() -> None:
    prec, model, opt = _fresh("bf16-master", compiled=True)
    _run_segment(prec, model, opt, _batches(2))
    sd = fp32_state_dict(prec)
    plain = _gpt(seed=5)
    plain.load_state_dict(sd)  # torch's own strict load: no '_orig_mod.' keys
    assert all(v.dtype == torch.float32 for v in plain.state_dict().values() if v.is_floating_point())
    # And back into a compiled run through mixprec.
    prec2, _, _ = _fresh("bf16-master", compiled=True)
    prec2.load_model_state_dict(sd)
    masters = fp32_state_dict(prec2)
    assert all(torch.equal(masters[k], sd[k]) for k in sd)


def test_key_mismatch_names_the_likely_wrapper() -> None:
    model = _gpt()
    prec = mp.MixedPrecision("bf16-mixed")
    prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ddp_keys = {"module." + k: v for k, v in _gpt().state_dict().items()}
    with pytest.raises(ValueError, match=r"DistributedDataParallel.*module\.") as err:
        prec.load_model_state_dict(ddp_keys)
    assert "nothing was loaded" in str(err.value)
    hint = key_mismatch_hint(["a.w"], ["_orig_mod.a.w"])
    assert "torch.compile" in hint
    assert key_mismatch_hint(["a.w"], ["b.w"]) == ""
    assert canonical_name("blocks.0._orig_mod.ln.weight") == "blocks.0.ln.weight"
    assert canonical_name("my_orig_mod.w") == "my_orig_mod.w"


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp16-master"])
def test_prepared_model_pickles_copies_and_uncasts(preset: str) -> None:
    model = _gpt()
    prec = mp.MixedPrecision(preset)
    model, _ = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = _batches(1)[0]
    with prec.autocast():
        want = model(x)
    buf = io.BytesIO()
    torch.save(model, buf)  # the island forwards and hooks are picklable (no closures)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    clone = copy.deepcopy(model)
    again = pickle.loads(pickle.dumps(model))
    for other in (loaded, clone, again):
        with prec.autocast():
            got = other(x)
        assert torch.equal(got, want)
        # The copy's islands call the copy's own modules, not the original's.
        assert other.blocks[0].ln_1.forward.args[0] is other.blocks[0].ln_1
    mp.uncast_module(model)
    assert "forward" not in vars(model.blocks[0].ln_1)
    assert not model._forward_hooks and not model._forward_pre_hooks


# ----- no recompiles after warm-up (issue 27) -------------------------------------------------------------------------
class _WithSpare(nn.Module):
    """A small GPT whose ``spare`` layer joins the optimizer later (``add_param_group``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt = CharGPT(VOCAB, BLOCK, 1, 2, 16)
        self.spare = nn.Linear(VOCAB, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.spare(self.gpt(idx))


def _recompile_scenario(preset: str, backend: str, fused: bool | None, steps: int = 60,
                        add_group: bool = True) -> tuple[int, int, float]:
    """Train compiled through a planted overflow, an LR schedule, scale growth, add_param_group and a
    load_state_dict; return (graphs compiled after warm-up, frames compiled after warm-up, final scale).

    Dynamo's counters: ``stats.unique_graphs`` and ``frames.total`` grow with every compile, a
    recompile included (dynamo keeps no separate recompile counter in torch 2.13)."""
    from torch._dynamo.utils import counters

    model = _WithSpare()
    scaler = mp.DynamicScaler(init_scale=2.0**8, growth_interval=5) if preset.startswith("fp16") else None
    prec = mp.MixedPrecision(preset, fused=fused, scaler=scaler)
    opt = torch.optim.AdamW(model.gpt.parameters(), lr=1e-3, eps=1e-4)
    model, opt = prec.prepare(model, opt)
    compiled = torch.compile(model, backend=backend)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (2, BLOCK), generator=g)
    warm = 3
    after_warm: tuple[int, int] = (0, 0)
    for i in range(steps):
        if i == warm:
            after_warm = (counters["stats"]["unique_graphs"], counters["frames"]["total"])
        with prec.autocast():
            loss = nn.functional.cross_entropy(compiled(x).float().flatten(0, 1), x.flatten())
        if i == 10:
            loss = loss * float("inf")  # a skipped step (and a backed-off scale under FP16)
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
        for group in opt.param_groups:  # an LR schedule (torch's schedulers do not follow add_param_group)
            group["lr"] = 1e-3 / (1.0 + 0.1 * i)
        if i == 20 and add_group:  # a new param group (the spare layer, trained from now on)
            opt.add_param_group({"params": list(model.spare.parameters()), "lr": 1e-3})
        if i == 30:
            prec.load_state_dict(copy.deepcopy(prec.state_dict()))
    end = (counters["stats"]["unique_graphs"], counters["frames"]["total"])
    return end[0] - after_warm[0], end[1] - after_warm[1], float(prec.scaler.loss_scale)


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-master", "bf16-master-r16", "bf16-pure", "fp16-mixed"])
def test_no_recompiles_after_warm_up(preset: str) -> None:
    new_graphs, recompiles, scale = _recompile_scenario(preset, "aot_eager", None)
    assert (new_graphs, recompiles) == (0, 0)
    if preset == "fp16-mixed":  # backed off once at the overflow, grown on the clean steps after it
        assert scale > 2.0**8


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["bf16-master", "bf16-master-r16"])
def test_no_recompiles_with_inductor_and_the_fused_step(preset: str) -> None:
    """The model and the fused (compiled) master step: nothing compiled after warm-up (overflow, LR, load_state_dict)."""
    new_graphs, recompiles, _ = _recompile_scenario(preset, "inductor", True, steps=40, add_group=False)
    assert (new_graphs, recompiles) == (0, 0)


@pytest.mark.slow
def test_a_param_group_added_later_compiles_nothing_new() -> None:
    """Issue 27: the fused step compiles one tile step per configuration, whatever the parameters' shapes."""
    new_graphs, recompiles, _ = _recompile_scenario("bf16-master", "inductor", True, steps=30)
    assert (new_graphs, recompiles) == (0, 0)


def test_a_warm_start_loads_the_island_graph_from_aotautograds_cache(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Islands switch autocast off inside the graph; AOTAutograd's cache still stores it, so a second start hits it.

    Without mixprec marking the autocast enter/exit functions cacheable, AOTAutograd bypassed its cache for any
    graph with an island, and every warm start re-ran it (issue 27: 3.6 s against 1.6 s on a 6-block GPT).
    """
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(4, 8)

    def start() -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        prec = mp.MixedPrecision("bf16-mixed", fused=False)
        model, opt = prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        compiled = torch.compile(model)
        with prec.autocast():
            loss = compiled(x).float().square().mean()
        prec.backward(loss)
        prec.step(opt)

    dynamo.reset()
    counters.clear()
    start()
    assert counters["aot_autograd"]["autograd_cache_bypass"] == 0, dict(counters["aot_autograd"])
    assert counters["aot_autograd"]["autograd_cache_saved"] >= 1
    dynamo.reset()  # a new process, as far as dynamo and AOTAutograd know: only the disk caches remain
    counters.clear()
    start()
    assert counters["aot_autograd"]["autograd_cache_hit"] >= 1, dict(counters["aot_autograd"])
    dynamo.reset()


def _fused_step_graphs(layers: int) -> tuple[int, int]:
    """Graphs and frames dynamo compiles for the fused step of a ``layers``-block GPT (three steps, one skipped)."""
    from torch._dynamo.utils import counters

    import mixprec.optim as mo

    torch.manual_seed(0)
    model = CharGPT(VOCAB, BLOCK, layers, 2, 32).to(torch.bfloat16)
    params = list(model.parameters())
    opt = mo.AdamW(params, lr=1e-2, weight_decay=0.1, compensation="kahan", fused=True, seed=0)
    before = (counters["stats"]["unique_graphs"], counters["frames"]["total"])
    for i in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step(found_inf=torch.tensor(float(i == 1)))
    assert opt._fused_fns and opt._fused_off is None, "the fused step did not run"
    return counters["stats"]["unique_graphs"] - before[0], counters["frames"]["total"] - before[1]


def test_fused_step_compiles_the_same_graphs_for_2_and_6_blocks() -> None:
    """Issue 27: the compiled step is one graph per (dtypes, device, compensation, hyper-parameters, tile size),
    not per parameter shape or bucket size: a 6-block model compiles what a 2-block one does."""
    two = _fused_step_graphs(2)
    dynamo.reset()  # forget the compiled tile step: the 6-block model compiles its own from scratch
    from mixprec.optim import _fused_step

    _fused_step._FUSED_CACHE.clear()
    six = _fused_step_graphs(6)
    assert two == six
    assert two[0] == 1  # one graph: the tile step


@pytest.mark.parametrize("preset, fused", [("fp16-mixed", None), ("bf16-master", True), ("bf16-pure", None)])
def test_a_compiled_train_step_around_prec_step_and_ema_matches_eager_without_recompiles(preset, fused) -> None:
    """torch.compile of the whole step (forward, prec.backward, prec.step, ema.update): the step and the EMA run
    eagerly behind a graph break. Traced, the scale history recompiled every step, fused=True built its optimizer
    mid-trace (AttributeError) and the masters' edit check in ema.update raised a view error."""
    import torch._dynamo.utils as dutils

    import mixprec as mp

    def run(compiled: bool) -> tuple[list[torch.Tensor], list[int]]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        prec = mp.MixedPrecision(preset, fused=fused)
        model, opt = prec.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        ema = mp.EMA(prec, decay=0.9)

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with prec.autocast():
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad(set_to_none=True)
            ema.update()
            return loss.detach()

        step = torch.compile(train_step, backend="aot_eager") if compiled else train_step
        graphs = []
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            step(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
            graphs.append(int(dutils.counters["stats"]["unique_graphs"]))
        return [p.detach().float().clone() for p in model.parameters()] + list(ema.averages.values()), graphs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager, _ = run(False)
        traced, graphs = run(True)
    for a, b in zip(eager, traced):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert graphs[2] == graphs[-1], graphs  # no new graphs after the warm-up steps
