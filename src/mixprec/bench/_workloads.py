"""Built-in benchmark workloads (all offline) and the contract for a user's own.

* ``gpt``: a small decoder-only transformer trained as a character-level language model on
  the English text of Python's documentation (``pydoc_data.topics``, shipped with CPython),
  with the last 10% of the text held out for validation.
* ``cnn``: a small convolutional network in plain ``torch.nn`` on scikit-learn's bundled
  8x8 digits (1797 images), 300 held out; the metric is held-out accuracy.
* ``hf-gpt2``: Hugging Face ``transformers`` GPT-2 built from a ``GPT2Config`` (no download),
  on the same characters as ``gpt``.
* ``MODULE:FUNCTION`` (or ``path/to/file.py:FUNCTION``): your own. ``FUNCTION(**options)``
  returns a :class:`Workload`, or a 4-tuple ``(model, optimizer_fn, batches, loss_fn)``:

  - ``model``: an ``nn.Module`` with FP32 parameters, on the CPU (the benchmark moves a copy
    to the device for every precision, so each starts from the same weights);
  - ``optimizer_fn(params) -> torch.optim.Optimizer``: builds the optimizer for a copy;
  - ``batches``: an iterable of batches (tensors or nested lists/tuples/dicts of tensors),
    at least ``--steps`` long; the same batches are given to every precision;
  - ``loss_fn(model, batch) -> Tensor``: the forward pass and a scalar loss.

  ``-o KEY=VALUE`` options are passed to ``FUNCTION`` as keyword arguments.

Every workload is deterministic: the model's initial weights and the batches depend only on
``seed``. ``mixprec compare --seed N`` builds the built-in workloads with ``seed=N`` (an explicit
``-o seed=...`` wins), so each seed is another initialisation and another batch order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import itertools
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import closest, unknown_choice
from .._tree import tree_leaves

__all__ = ["BUILTIN_WORKLOADS", "BenchError", "Workload", "load_workload"]


class BenchError(ValueError):
    """A user error in a benchmark request (unknown preset or workload, a bad user workload).

    The command line prints its message as one line and exits with status 2.
    """


@dataclasses.dataclass
class Workload:
    """What the benchmark trains: a model, its optimizer, data and loss.

    Attributes:
        name: Shown in reports.
        model: A fresh FP32 model (seeded); the benchmark deep-copies it for every precision.
        optimizer_fn: Builds the optimizer from a copy's parameters.
        batches: Training batches; the first ``steps`` are materialised once and shared.
        loss_fn: ``loss_fn(model, batch) -> scalar loss`` (forward included).
        eval_batches: Held-out batches for the validation loss (optional).
        metric_fn: ``metric_fn(model, batch) -> float``, a held-out metric averaged over
            ``eval_batches`` (optional; e.g. accuracy).
        metric_name: The metric's name in reports.
        higher_is_better: Whether a larger metric is better (accuracy: True).
        unit: What ``items_per_batch`` counts: ``"tokens"`` or ``"samples"``.
        items_per_batch: Tokens or samples per batch, for throughput; a number or a
            function of the batch (default: the first dimension of the first tensor).
        clip_grad_norm: Clip gradients to this norm every step (same for every precision).
        description: One line for reports.
        options: The size options the workload was built with (recorded in the JSON).
    """

    name: str
    model: nn.Module
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    batches: Iterable[Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    eval_batches: Sequence[Any] | None = None
    metric_fn: Callable[[nn.Module, Any], float] | None = None
    metric_name: str | None = None
    higher_is_better: bool = True
    unit: str = "samples"
    items_per_batch: int | Callable[[Any], int] | None = None
    clip_grad_norm: float | None = None
    description: str = ""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def count_items(self, batch: Any) -> int:
        """Tokens or samples in one batch."""
        if isinstance(self.items_per_batch, int):
            return self.items_per_batch
        if callable(self.items_per_batch):
            return int(self.items_per_batch(batch))
        t = _first_tensor(batch)
        return int(t.shape[0]) if t is not None and t.dim() > 0 else 1


def _first_tensor(obj: Any) -> torch.Tensor | None:
    return next(tree_leaves(obj), None)


# ----- text data shared by gpt and hf-gpt2 --------------------------------------------------------
_TEXT_CACHE: dict[str, Any] = {}


def char_corpus() -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Python's documentation as character ids: (train ids, held-out ids, vocabulary).

    The text is ``pydoc_data.topics`` joined in sorted-key order; the last 10% is held out.
    """
    if "corpus" not in _TEXT_CACHE:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
        vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(vocab)}
        ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
        cut = int(len(ids) * 0.9)
        _TEXT_CACHE["corpus"] = (ids[:cut], ids[cut:], vocab)
    return _TEXT_CACHE["corpus"]


def _lm_batches(data: torch.Tensor, batch_size: int, block: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random windows (x, y = x shifted by one) from ``data``, seeded."""
    g = torch.Generator().manual_seed(seed)
    hi = len(data) - block - 1
    while True:
        starts = torch.randint(0, hi, (batch_size,), generator=g)
        x = torch.stack([data[s : s + block] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + 1 + block] for s in starts.tolist()])
        yield x, y


def _lm_eval_batches(data: torch.Tensor, batch_size: int, block: int, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(_lm_batches(data, batch_size, block, seed + 10_007), n))


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def _lm_workload(
    name: str,
    model: nn.Module,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    train: torch.Tensor,
    held_out: torch.Tensor,
    o: dict[str, Any],
    description: str,
) -> Workload:
    """A character-level language-model workload: the batches, held-out split and units every LM shares."""
    block = int(o["block_size"])
    _check_split(name, "characters of held-out text (block_size + 2)", min(len(train), len(held_out)), block + 2,
                 "block_size", block)
    return Workload(
        name=name,
        model=model,
        optimizer_fn=optimizer_fn,
        batches=_lm_batches(train, o["batch_size"], o["block_size"], o["seed"]),
        loss_fn=loss_fn,
        eval_batches=_lm_eval_batches(held_out, o["batch_size"], o["block_size"], o["eval_batches"], o["seed"]),
        unit="tokens",
        items_per_batch=o["batch_size"] * o["block_size"],
        clip_grad_norm=o["clip"] or None,
        description=description,
        options=o,
    )


# ----- gpt ------------------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class CharGPT(nn.Module):
    """A GPT-2-style decoder-only transformer (pre-norm blocks, learned positions, GELU MLP)."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, tie: bool = False) -> None:
        super().__init__()
        if n_embd % n_head:
            raise BenchError(f"gpt: n_embd={n_embd} must be a multiple of n_head={n_head}")
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / (2 * n_layer) ** 0.5 if name.endswith(("proj.weight",)) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        if tie:  # GPT-2 shares the token embedding with the output projection
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


_GPT_DEFAULTS: dict[str, Any] = dict(
    n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=16, lr=3e-3, weight_decay=0.01,
    eval_batches=4, clip=1.0, seed=0, vocab_size=0, tie=False, fused=False,
)


def make_gpt(**options: Any) -> Workload:
    """The ``gpt`` workload: a character-level GPT on Python's documentation."""
    o = _options("gpt", _GPT_DEFAULTS, options)
    train, held_out, vocab = char_corpus()
    n_vocab = o["vocab_size"] or len(vocab)
    if n_vocab < len(vocab):
        raise BenchError(f"gpt: vocab_size={n_vocab} is smaller than the {len(vocab)} characters of the text (0: exactly those)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(o["seed"])
        model = CharGPT(n_vocab, o["block_size"], o["n_layer"], o["n_head"], o["n_embd"], tie=o["tie"])
    lr, wd, fused = o["lr"], o["weight_decay"], o["fused"] or None

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return _lm_loss(m(x), y)

    n_params = sum(p.numel() for p in model.parameters())
    return _lm_workload(
        "gpt", model, lambda params: torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=wd, fused=fused),
        loss_fn, train, held_out, o,
        f"char-level GPT ({o['n_layer']} layers, {o['n_embd']} wide, {o['n_head']} heads, context "
        f"{o['block_size']}, vocab {n_vocab}{', tied' if o['tie'] else ''}, {n_params / 1e6:.2f}M params) on "
        f"pydoc_data.topics, batch {o['batch_size']}",
    )


# ----- cnn ------------------------------------------------------------------------------------------
class DigitsCNN(nn.Module):
    """Two conv blocks (conv, batch norm, ReLU) and a two-layer classifier for 8x8 digits."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * 16, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


_CNN_DEFAULTS: dict[str, Any] = dict(width=16, batch_size=64, lr=3e-3, weight_decay=0.01, held_out=300, seed=0, clip=0.0)


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    if "digits" not in _TEXT_CACHE:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise BenchError(
                "the cnn workload needs scikit-learn (its bundled digits data set): pip install scikit-learn"
            ) from None
        d = load_digits()
        x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(d.target, dtype=torch.int64)
        _TEXT_CACHE["digits"] = (x, y)
    return _TEXT_CACHE["digits"]


def _epoch_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x) - batch_size + 1, batch_size):
            idx = perm[i : i + batch_size]
            yield x[idx], y[idx]


def make_cnn(**options: Any) -> Workload:
    """The ``cnn`` workload: a small CNN on scikit-learn's 8x8 digits."""
    o = _options("cnn", _CNN_DEFAULTS, options)
    x, y = _digits()
    g = torch.Generator().manual_seed(o["seed"])
    perm = torch.randperm(len(x), generator=g)
    n_held = int(o["held_out"])
    _check_split("cnn", "images (held_out plus one training image)", len(x), n_held + 1, "held_out", n_held)
    _check_split("cnn", "training images", len(x) - n_held, int(o["batch_size"]), "batch_size", int(o["batch_size"]))
    held, train = perm[:n_held], perm[n_held:]
    mean, std = x[train].mean(), x[train].std()
    xn = (x - mean) / std
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(o["seed"])
        model = DigitsCNN(o["width"])
    lr, wd = o["lr"], o["weight_decay"]
    eval_batches = [(xn[held[i : i + 100]], y[held[i : i + 100]]) for i in range(0, n_held, 100)]

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        xb, yb = batch
        return F.cross_entropy(m(xb).float(), yb)

    def accuracy(m: nn.Module, batch: Any) -> float:
        xb, yb = batch
        return (m(xb).argmax(-1) == yb).float().mean().item()

    return Workload(
        name="cnn",
        model=model,
        optimizer_fn=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=wd),
        batches=_epoch_batches(xn[train], y[train], o["batch_size"], o["seed"]),
        loss_fn=loss_fn,
        eval_batches=eval_batches,
        metric_fn=accuracy,
        metric_name="accuracy",
        unit="samples",
        items_per_batch=o["batch_size"],
        clip_grad_norm=o["clip"] or None,
        description=(
            f"CNN (2 conv + batch norm, 2 FC, width {o['width']}) on scikit-learn digits "
            f"({len(train)} train / {n_held} held out), batch {o['batch_size']}"
        ),
        options=o,
    )


# ----- hf-gpt2 --------------------------------------------------------------------------------------
_HF_DEFAULTS: dict[str, Any] = dict(
    n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=16, lr=3e-3, weight_decay=0.01,
    eval_batches=4, clip=1.0, dropout=0.0, seed=0,
)


def make_hf_gpt2(**options: Any) -> Workload:
    """The ``hf-gpt2`` workload: transformers' GPT2LMHeadModel from a config, on character ids."""
    o = _options("hf-gpt2", _HF_DEFAULTS, options)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise BenchError("the hf-gpt2 workload needs Hugging Face transformers: pip install transformers") from None
    train, held_out, vocab = char_corpus()
    # Tokenizers need the hub, so the model reads character ids; with a vocabulary this small,
    # GPT-2's default bos/eos id (50256) would be out of range: use the newline character.
    newline = vocab.index("\n")
    config = GPT2Config(
        vocab_size=len(vocab), n_positions=o["block_size"], n_embd=o["n_embd"], n_layer=o["n_layer"],
        n_head=o["n_head"], bos_token_id=newline, eos_token_id=newline, resid_pdrop=o["dropout"],
        embd_pdrop=o["dropout"], attn_pdrop=o["dropout"], use_cache=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(o["seed"])
        model = GPT2LMHeadModel(config)
    lr, wd = o["lr"], o["weight_decay"]

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return _lm_loss(m(input_ids=x, use_cache=False).logits, y)

    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return _lm_workload(
        "hf-gpt2", model, lambda params: torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=wd),
        loss_fn, train, held_out, o,
        f"transformers GPT2LMHeadModel from config ({o['n_layer']} layers, {o['n_embd']} wide, "
        f"{n_params / 1e6:.2f}M params, tied embeddings) on pydoc_data.topics characters, batch {o['batch_size']}",
    )


BUILTIN_WORKLOADS: dict[str, Callable[..., Workload]] = {"gpt": make_gpt, "cnn": make_cnn, "hf-gpt2": make_hf_gpt2}


def _options(name: str, defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    unknown = [k for k in given if k not in defaults]
    if unknown:
        raise unknown_choice_error(f"{name} workload option", unknown[0], defaults)
    out = dict(defaults)
    for k, v in given.items():
        want = type(defaults[k])
        out[k] = _convert(name, k, v, want)
        if want in (int, float) and out[k] < 0:
            raise BenchError(f"{name} workload option {k}={v!r} must not be negative")
    for k in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "width", "eval_batches", "held_out"):
        if k in out and out[k] <= 0:
            raise BenchError(f"{name} workload option {k}={out[k]} must be positive")
    if "n_head" in out and "n_embd" in out and out["n_embd"] % out["n_head"]:
        raise BenchError(f"{name}: n_embd={out['n_embd']} must be a multiple of n_head={out['n_head']}")
    if "dropout" in out and not 0.0 <= out["dropout"] < 1.0:
        raise BenchError(f"{name} workload option dropout={out['dropout']} must be in [0, 1)")
    return out


def _check_split(name: str, what: str, n: int, need: int, key: str, value: int) -> None:
    """Refuse a size the data cannot serve (the batches would never come: an endless loop)."""
    if need > n:
        raise BenchError(f"{name} workload option {key}={value} needs {need} {what}, but there are {n}; use a smaller {key}.")


def _convert(name: str, key: str, v: Any, want: type) -> Any:
    if want is bool:
        if isinstance(v, bool):
            return v
        text = str(v).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
    elif want is int:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, str):
            try:
                return int(v)
            except ValueError:
                pass
    elif want is float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, str):
            try:
                return float(v)
            except ValueError:
                pass
    else:
        return v
    raise BenchError(f"{name} workload option {key}={v!r}: expected {'a bool (0/1)' if want is bool else 'an int' if want is int else 'a number'}")


def unknown_choice_error(what: str, value: str, choices: Iterable[str]) -> BenchError:
    return BenchError(str(unknown_choice(what, value, list(choices))))


# ----- loading --------------------------------------------------------------------------------------
def load_workload(spec: str | Workload, **options: Any) -> Workload:
    """Build a workload by name: ``"gpt"``, ``"cnn"``, ``"hf-gpt2"``, or ``"MODULE:FUNCTION"``.

    Args:
        spec: A built-in name, ``"package.module:function"``, or ``"path/to/file.py:function"``
            (a :class:`Workload` is returned unchanged).
        **options: Size options: for ``gpt``/``hf-gpt2`` ``n_layer, n_head, n_embd, block_size,
            batch_size, lr, weight_decay, eval_batches, clip, seed`` (``hf-gpt2`` also
            ``dropout``); for ``cnn`` ``width, batch_size, lr, weight_decay, held_out, clip,
            seed``; for a user function, its keyword arguments.

    Returns:
        The :class:`Workload`.

    Raises:
        BenchError: an unknown name or option, a module or function that cannot be found, or a
            function that raises or returns something other than a Workload or a 4-tuple.

    Example:
        >>> w = load_workload("gpt", n_layer=1, n_embd=32)
        >>> w.unit
        'tokens'
    """
    if isinstance(spec, Workload):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise BenchError(f"a workload is 'gpt', 'cnn', 'hf-gpt2' or 'MODULE:FUNCTION', got {spec!r}")
    spec = spec.strip()
    if ":" not in spec or spec.lower() in BUILTIN_WORKLOADS:
        key = spec.lower()
        if key not in BUILTIN_WORKLOADS:
            msg = f"unknown workload {spec!r}; choose one of: {', '.join(BUILTIN_WORKLOADS)}, or your own as MODULE:FUNCTION."
            near = closest(spec, BUILTIN_WORKLOADS)
            raise BenchError(msg + (f" Did you mean {near!r}?" if near else ""))
        return BUILTIN_WORKLOADS[key](**options)
    return _load_user_workload(spec, options)


def _load_user_workload(spec: str, options: dict[str, Any]) -> Workload:
    module_name, _, func_name = spec.rpartition(":")
    if not module_name or not func_name:
        raise BenchError(f"workload {spec!r}: expected MODULE:FUNCTION, e.g. my_bench:make")
    with _file_folder_on_path(module_name):
        return _make_user_workload(spec, module_name, func_name, options)


def _is_file_spec(module_name: str) -> bool:
    return module_name.endswith(".py") or os.sep in module_name or "/" in module_name


@contextlib.contextmanager
def _file_folder_on_path(module_name: str) -> Iterator[None]:
    """For ``path/to/file.py``, the file's folder first on ``sys.path`` while it is imported and called.

    So the file can import its sibling modules, as under ``python path/to/file.py``. Module
    names (``package.module``) leave ``sys.path`` alone. The entry is removed afterwards.
    """
    if not _is_file_spec(module_name):
        yield
        return
    folder = os.path.dirname(os.path.abspath(module_name))
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        try:
            sys.path.remove(folder)  # the first occurrence: the one inserted above
        except ValueError:
            pass


def _make_user_workload(spec: str, module_name: str, func_name: str, options: dict[str, Any]) -> Workload:
    module = _import_user_module(spec, module_name)
    fn = getattr(module, func_name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        near = closest(func_name, public)
        listing = f"; it defines: {', '.join(public[:12])}{', ...' if len(public) > 12 else ''}" if public else ""
        hint = f" Did you mean {near!r}?" if near else ""
        raise BenchError(f"workload {spec!r}: module {module_name!r} has no function {func_name!r}{listing}.{hint}")
    if not callable(fn):
        raise BenchError(f"workload {spec!r}: {func_name!r} in {module_name!r} is a {type(fn).__name__}, not a function")
    try:
        made = fn(**options)
    except BenchError:
        raise
    except TypeError as e:
        if options and "argument" in str(e):
            raise BenchError(f"workload {spec!r}: {func_name}(**{options}) failed: {e}") from None
        raise BenchError(f"workload {spec!r}: {func_name}() raised TypeError: {e}") from None
    except Exception as e:  # the user's code: report it as one line, the command exits 2
        raise BenchError(f"workload {spec!r}: {func_name}() raised {type(e).__name__}: {e}") from None
    return _as_workload(spec, made, options)


def _import_user_module(spec: str, module_name: str) -> Any:
    path = Path(module_name)
    if _is_file_spec(module_name):
        if not path.is_file():
            raise BenchError(f"workload {spec!r}: file {module_name!r} does not exist")
        mod_spec = importlib.util.spec_from_file_location(f"_mixprec_user_{path.stem}", path)
        if mod_spec is None or mod_spec.loader is None:
            raise BenchError(f"workload {spec!r}: cannot import {module_name!r} as a Python file")
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            raise BenchError(f"workload {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from None
        return module
    # Like `python -m`, look in the current directory too (the console script's sys.path[0]
    # is its own bin directory).
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise BenchError(
                f"workload {spec!r}: no module named {module_name!r} (run from its directory, or put it on PYTHONPATH)"
            ) from None
        raise BenchError(f"workload {spec!r}: importing {module_name!r} failed: {e}") from None
    except Exception as e:
        raise BenchError(f"workload {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from None


_CONTRACT = "a mixprec.bench.Workload or a 4-tuple (model, optimizer_fn, batches, loss_fn)"


def _as_workload(spec: str, made: Any, options: dict[str, Any]) -> Workload:
    if isinstance(made, Workload):
        w = made
    elif isinstance(made, tuple) and len(made) == 4:
        model, optimizer_fn, batches, loss_fn = made
        w = Workload(name=spec, model=model, optimizer_fn=optimizer_fn, batches=batches, loss_fn=loss_fn)
    else:
        got = f"a {len(made)}-tuple" if isinstance(made, tuple) else f"{type(made).__name__} {_short(made)}"
        raise BenchError(f"workload {spec!r} must return {_CONTRACT}; got {got}")
    if not isinstance(w.model, nn.Module):
        raise BenchError(f"workload {spec!r}: model must be a torch.nn.Module, got {type(w.model).__name__}")
    if not any(p.requires_grad for p in w.model.parameters()):
        raise BenchError(f"workload {spec!r}: the model has no trainable parameters")
    if not callable(w.optimizer_fn):
        raise BenchError(
            f"workload {spec!r}: optimizer_fn must be a function of the parameters returning an optimizer, e.g. "
            f"lambda params: torch.optim.AdamW(params, lr=1e-3); got {type(w.optimizer_fn).__name__}"
        )
    if isinstance(w.optimizer_fn, torch.optim.Optimizer):
        raise BenchError(f"workload {spec!r}: optimizer_fn must build a new optimizer from parameters, not be one")
    if not isinstance(w.batches, Iterable) or isinstance(w.batches, (str, bytes, torch.Tensor)):
        raise BenchError(f"workload {spec!r}: batches must be an iterable of batches, got {type(w.batches).__name__}")
    if not callable(w.loss_fn):
        raise BenchError(f"workload {spec!r}: loss_fn must be a function (model, batch) -> loss, got {type(w.loss_fn).__name__}")
    if not w.options:
        w.options = dict(options)
    return w


def _short(obj: Any) -> str:
    r = repr(obj)
    return r if len(r) <= 40 else r[:37] + "..."
