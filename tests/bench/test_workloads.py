"""Built-in workloads (tiny sizes) and the MODULE:FUNCTION contract."""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import pytest
import torch

from mixprec.bench import BenchError, Workload, load_workload
from mixprec.bench._workloads import char_corpus

TINY_LM = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4, eval_batches=1)


def _first_batches(w: Workload, n: int = 2) -> list:
    return list(itertools.islice(iter(w.batches), n))


@pytest.mark.parametrize(("name", "opts"), [("gpt", TINY_LM), ("cnn", dict(width=4, batch_size=8))])
def test_builtin_workload_trains_one_step(name: str, opts: dict) -> None:
    w = load_workload(name, **opts)
    assert all(p.dtype == torch.float32 for p in w.model.parameters())
    batch = _first_batches(w, 1)[0]
    loss = w.loss_fn(w.model, batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    opt = w.optimizer_fn(w.model.parameters())
    loss.backward()
    opt.step()
    assert w.eval_batches and w.count_items(batch) > 0
    assert w.description


def test_hf_gpt2_builds_from_config_offline() -> None:
    pytest.importorskip("transformers")
    w = load_workload("hf-gpt2", **TINY_LM)
    cfg = w.model.config
    assert cfg.vocab_size == len(char_corpus()[2])
    assert 0 <= cfg.bos_token_id < cfg.vocab_size and 0 <= cfg.eos_token_id < cfg.vocab_size
    loss = w.loss_fn(w.model, _first_batches(w, 1)[0])
    assert torch.isfinite(loss)
    assert w.model.lm_head.weight is w.model.transformer.wte.weight  # tied, like GPT-2


def test_workloads_are_deterministic_in_their_seed() -> None:
    a, b = load_workload("gpt", **TINY_LM), load_workload("gpt", **TINY_LM)
    c = load_workload("gpt", **TINY_LM, seed=1)
    for k, v in a.model.state_dict().items():
        assert torch.equal(v, b.model.state_dict()[k])
    assert any(not torch.equal(v, c.model.state_dict()[k]) for k, v in a.model.state_dict().items())
    for (xa, ya), (xb, yb) in zip(_first_batches(a), _first_batches(b)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # next-character targets


def test_gpt_text_has_a_held_out_split() -> None:
    train, held_out, vocab = char_corpus()
    total = len(train) + len(held_out)
    assert total > 400_000 and abs(len(held_out) / total - 0.1) < 0.01
    w = load_workload("gpt", **TINY_LM)
    x, _ = w.eval_batches[0]
    assert int(x.max()) < len(vocab)


def test_cnn_held_out_digits_are_not_trained_on() -> None:
    w = load_workload("cnn", width=4, batch_size=8, held_out=300)
    held = torch.cat([x for x, _ in w.eval_batches])
    assert held.shape[0] == 300
    seen = torch.cat([x for x, _ in _first_batches(w, 200)])
    h = {tuple(t.flatten().tolist()) for t in held}
    s = {tuple(t.flatten().tolist()) for t in seen}
    # digits has a few duplicate images; the split is by index, so overlap stays tiny
    assert len(h & s) <= 3


def test_unknown_workload_names_the_closest() -> None:
    with pytest.raises(BenchError, match=r"unknown workload 'gtp'.*gpt, cnn, hf-gpt2.*Did you mean 'gpt'"):
        load_workload("gtp")


def test_unknown_option_names_the_closest() -> None:
    with pytest.raises(BenchError, match=r"unknown gpt workload option 'nlayer'.*Did you mean 'n_layer'"):
        load_workload("gpt", nlayer=2)
    with pytest.raises(BenchError, match="must be positive"):
        load_workload("gpt", n_layer=0)


# ----- MODULE:FUNCTION ---------------------------------------------------------------------------
USER_MODULE = '''
import torch

def _parts(width=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    g = torch.Generator().manual_seed(0)
    batches = ((torch.randn(8, width, generator=g), torch.randn(8, 1, generator=g)) for _ in range(1000))
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]).float(), b[1])
    return model, (lambda params: torch.optim.SGD(params, lr=0.01)), batches, loss_fn

def make(width=4):
    return _parts(width)

def make_workload():
    from mixprec.bench import Workload
    model, opt_fn, batches, loss_fn = _parts()
    return Workload(name="mine", model=model, optimizer_fn=opt_fn, batches=batches, loss_fn=loss_fn)

def returns_int():
    return 3

def returns_three():
    return _parts()[:3]

def bad_model():
    _, o, b, l = _parts()
    return "model", o, b, l

def bad_optimizer():
    m, _, b, l = _parts()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), b, l

def raises():
    raise RuntimeError("boom")

not_callable = 5
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "mixprec_user_wl.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "mixprec_user_wl"


def test_user_workload_tuple_and_workload(user_module: str) -> None:
    w = load_workload(f"{user_module}:make", width=6)
    assert isinstance(w, Workload) and w.name == f"{user_module}:make" and w.options == {"width": 6}
    assert w.model[0].in_features == 6
    w2 = load_workload(f"{user_module}:make_workload")
    assert w2.name == "mine"


def test_user_workload_from_a_file_path(tmp_path: Path) -> None:
    f = tmp_path / "bench_file.py"
    f.write_text(textwrap.dedent(USER_MODULE))
    assert isinstance(load_workload(f"{f}:make"), Workload)


def test_a_file_workload_imports_its_sibling_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As under ``python path/to/file.py``: the file's folder is on sys.path while it loads, not after."""
    import sys

    (tmp_path / "sibling_helpers_for_mixprec_test.py").write_text("WIDTH = 5\n")
    f = tmp_path / "bench_with_sibling.py"
    f.write_text(textwrap.dedent(USER_MODULE) + textwrap.dedent('''
        def make_wide():
            import sibling_helpers_for_mixprec_test as h  # a lazy sibling import, at call time
            return make()
        '''))
    f.write_text("import sibling_helpers_for_mixprec_test\n" + f.read_text())
    monkeypatch.chdir(Path("/"))
    before = list(sys.path)
    assert isinstance(load_workload(f"{f}:make_wide"), Workload)
    assert sys.path == before


@pytest.mark.parametrize(
    ("func", "message"),
    [
        ("nope", r"has no function 'nope'"),
        ("mak", r"Did you mean 'make'"),
        ("returns_int", r"must return a mixprec.bench.Workload or a 4-tuple .*got int 3"),
        ("returns_three", r"got a 3-tuple"),
        ("bad_model", r"model must be a torch.nn.Module, got str"),
        ("bad_optimizer", r"optimizer_fn must be a function of the parameters"),
        ("raises", r"raises\(\) raised RuntimeError: boom"),
        ("not_callable", r"is a int, not a function"),
    ],
)
def test_user_workload_errors_are_clear(user_module: str, func: str, message: str) -> None:
    with pytest.raises(BenchError, match=message):
        load_workload(f"{user_module}:{func}")


def test_missing_module_and_file() -> None:
    with pytest.raises(BenchError, match=r"no module named 'no_such_module_xyz'"):
        load_workload("no_such_module_xyz:make")
    with pytest.raises(BenchError, match=r"file 'missing/file.py' does not exist"):
        load_workload("missing/file.py:make")
