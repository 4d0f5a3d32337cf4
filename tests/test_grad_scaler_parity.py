"""Parity of mixprec.GradScaler with torch.amp.GradScaler: the same script, run on both, gives the same trace.

Every scenario is a scripted sequence of calls (forward, scale, backward, unscale_, step, update,
getters, setters, state dicts, pickling, misuse). The runner executes it once against
``torch.amp.GradScaler("cpu")`` and once against ``mixprec.GradScaler("cpu")`` on identical
models and optimizers, and records after every call: the result, the error (type and message),
the scale, the growth tracker, the found_inf flags recorded per optimizer, and the parameters.
The traces must agree exactly (parameters bit for bit), with two documented extensions of ours:
``unscale_`` returns the found_inf flag and ``step`` a ``skipped`` bool tensor where torch
returns ``None``; they are checked against torch's recorded flags instead.
"""

from __future__ import annotations

import copy
import math
import pickle
import random
import re
import warnings
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _trees import equal_tree  # tests/_trees.py

from mixprec import GradScaler
from mixprec._grad_scaler import TORCH_STATE_KEYS

TorchGradScaler = torch.amp.GradScaler

# messages where ours is torch's message followed by more detail (torch's text stays a prefix)
EXTENDED_MESSAGES = ("The growth factor must be", "The backoff factor must be", "Attempting to unscale FP16",
                     "new_scale should be")


# --------------------------------------------------------------------------------------------------
# the rig: one model, its optimizers and a scaler, built identically for both classes
# --------------------------------------------------------------------------------------------------
class ReturningSGD(torch.optim.SGD):
    """An optimizer whose step returns a value (torch's GradScaler.step passes it through)."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        super().step(closure)
        return "stepped"


class LegacyOpt(torch.optim.SGD):
    """The deprecated protocol: step(grad_scaler=...) checks the gradients itself."""

    _step_supports_amp_scaling = True

    def step(self, closure: Any = None, grad_scaler: Any = None) -> Any:  # type: ignore[override]
        found = grad_scaler._check_inf_per_device(self)
        if not sum(v.item() for v in found.values()):
            inv = 1.0 / grad_scaler._get_scale_async().item()
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inv)
            super().step()
        return None


def _make_optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, foreach=True)
    if kind == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    if kind == "sgd-fused":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)
    if kind == "returning":
        return ReturningSGD(params, lr=0.05)
    if kind == "legacy":
        return LegacyOpt(params, lr=0.05)
    raise ValueError(kind)


@dataclass
class Rig:
    """The state a script acts on."""

    scaler: Any
    model: torch.nn.Module
    opts: list[torch.optim.Optimizer]
    loss: Any = None
    scaled: Any = None
    kept: dict[str, Any] = field(default_factory=dict)


def build(cls: type, scaler_kw: dict[str, Any], opt: str = "sgd", n_opts: int = 1, dtype: torch.dtype = torch.float32,
          sparse: bool = False, frozen: bool = False) -> Rig:
    torch.manual_seed(0)
    if sparse:
        model: torch.nn.Module = torch.nn.ModuleDict({"emb": torch.nn.Embedding(12, 6, sparse=True),
                                                       "head": torch.nn.Linear(6, 3)})
    else:
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    model.to(dtype)
    params = list(model.parameters())
    if frozen:
        params[0].requires_grad_(False)  # a parameter the optimizer holds that never gets a gradient
    if n_opts == 1:
        opts = [_make_optimizer(opt, params)]
    else:
        half = len(params) // 2
        opts = [_make_optimizer(opt, params[:half]), _make_optimizer(opt, params[half:])]
    return Rig(cls(**scaler_kw), model, opts)


def _forward(rig: Rig, poison: str | None = None, autocast16: bool = False, step_seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step_seed)
    if isinstance(rig.model, torch.nn.ModuleDict):
        idx = torch.randint(0, 12, (10,), generator=g)
        idx[:3] = 5  # duplicate indices: the sparse gradient has repeated entries
        out = rig.model["head"](rig.model["emb"](idx))
    else:
        dtype = next(rig.model.parameters()).dtype
        x = torch.randn(8, 6, generator=g).to(dtype)
        if autocast16:
            with torch.autocast("cpu", dtype=torch.float16):
                out = rig.model(x)
        else:
            out = rig.model(x)
    loss = out.float().square().mean()
    if poison == "inf":
        loss = loss * math.inf
    elif poison == "nan":
        loss = loss * math.nan
    return loss


# --------------------------------------------------------------------------------------------------
# ops: each takes the rig and returns a result to record
# --------------------------------------------------------------------------------------------------
def op_fwd(rig: Rig, poison: str | None = None, seed: int = 0, autocast16: bool = False) -> None:
    rig.loss = _forward(rig, poison, autocast16, seed)


def op_scale(rig: Rig, how: str = "tensor") -> Any:
    if how == "tensor":
        rig.scaled = rig.scaler.scale(rig.loss)
    elif how == "list":
        rig.scaled = rig.scaler.scale([rig.loss, rig.loss * 0.5])
    elif how == "tuple":
        rig.scaled = rig.scaler.scale((rig.loss,))
    return rig.scaled


def op_backward(rig: Rig) -> None:
    scaled = rig.scaled
    if isinstance(scaled, (list, tuple)):
        scaled = sum(scaled)
    scaled.backward()


def op_poison(rig: Rig, value: float, opt: int = 0) -> None:
    for group in rig.opts[opt].param_groups:
        for p in group["params"]:
            if p.grad is not None:
                g = p.grad._values() if p.grad.is_sparse else p.grad
                g.view(-1)[0] = value
                return


def op_unscale(rig: Rig, opt: int = 0) -> Any:
    return rig.scaler.unscale_(rig.opts[opt])


def op_clip(rig: Rig) -> None:
    dense = [p for p in rig.model.parameters() if p.grad is not None and not p.grad.is_sparse]  # no sparse norm
    torch.nn.utils.clip_grad_norm_(dense, 0.5)


def op_step(rig: Rig, opt: int = 0, **kwargs: Any) -> Any:
    return rig.scaler.step(rig.opts[opt], **kwargs)


def op_step_positional_closure(rig: Rig) -> Any:
    return rig.scaler.step(rig.opts[0], lambda: 0.25)  # torch only refuses closure=...; this one reaches the optimizer


def op_update(rig: Rig, *args: Any) -> Any:
    return rig.scaler.update(*args)


def op_zero(rig: Rig) -> None:
    for o in rig.opts:
        o.zero_grad(set_to_none=True)


def op_pickle(rig: Rig) -> None:
    rig.scaler = pickle.loads(pickle.dumps(rig.scaler))


def op_deepcopy(rig: Rig) -> None:
    rig.scaler = copy.deepcopy(rig.scaler)


def op_get(rig: Rig) -> Any:
    s = rig.scaler
    if not s.is_enabled():  # torch's factor getters raise AttributeError then (ours: test_disabled_getters_...)
        return (s.get_scale(), s._get_growth_tracker(), s.is_enabled())
    return (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval(),
            s._get_growth_tracker(), s.is_enabled())


def op_set(rig: Rig, name: str, value: Any) -> None:
    getattr(rig.scaler, f"set_{name}")(value)


def op_sd(rig: Rig, keep: str | None = None) -> Any:
    sd = rig.scaler.state_dict()
    if keep:
        rig.kept[keep] = copy.deepcopy(sd)
    return sd


def op_load(rig: Rig, what: Any) -> None:
    rig.scaler.load_state_dict(rig.kept[what] if isinstance(what, str) else copy.deepcopy(what))


def op_check_inf(rig: Rig, opt: int = 0) -> Any:
    return rig.scaler._check_inf_per_device(rig.opts[opt])


def op_found_inf(rig: Rig, opt: int = 0) -> Any:
    return rig.scaler._found_inf_per_device(rig.opts[opt])


def op_attr(rig: Rig, name: str, value: Any, opt: int = 0) -> None:
    setattr(rig.opts[opt], name, value() if callable(value) else value)


def op_has_attr(rig: Rig, name: str, opt: int = 0) -> bool:
    return hasattr(rig.opts[opt], name)


def op_half(rig: Rig) -> None:
    rig.model.half()


def op_tensor_scale(rig: Rig) -> Any:
    return rig.scaler._get_scale_async()


class KW(dict):  # type: ignore[type-arg]
    """Keyword arguments of a script op (a plain dict is a positional argument)."""


OPS = {name[3:]: fn for name, fn in globals().items() if name.startswith("op_")}


def it(poison: str | None = None, seed: int = 0, clip: bool = False, grad: float | None = None,
       autocast16: bool = False) -> list[tuple[Any, ...]]:
    """One ordinary iteration."""
    ops: list[tuple[Any, ...]] = [("fwd", poison, seed, autocast16), ("scale",), ("backward",)]
    if grad is not None:
        ops.append(("poison", grad))
    if clip:
        ops += [("unscale",), ("clip",)]
    return ops + [("step",), ("update",), ("zero",)]


def loop(n: int, bad: dict[int, str] | None = None, **kw: Any) -> list[tuple[Any, ...]]:
    bad = bad or {}
    return [op for i in range(n) for op in it(bad.get(i), seed=i, **kw)]


# --------------------------------------------------------------------------------------------------
# the runner and the comparison
# --------------------------------------------------------------------------------------------------
@dataclass
class Event:
    op: tuple[Any, ...]
    result: Any
    error: BaseException | None
    scale: float
    tracker: int
    flags: list[float | None]
    params: list[torch.Tensor]
    warned: list[tuple[type, str]]


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


def _flags(rig: Rig) -> list[float | None]:
    states = getattr(rig.scaler, "_per_optimizer_states", {})
    out: list[float | None] = []
    for o in rig.opts:
        st = states.get(id(o))  # .get: reading must not create an entry
        out.append(None if st is None else float(sum(v.item() for v in st["found_inf_per_device"].values())))
    return out


def run(cls: type, script: list[tuple[Any, ...]], scaler_kw: dict[str, Any] | None = None, **rig_kw: Any) -> list[Event]:
    rig = build(cls, {"device": "cpu", **(scaler_kw or {})}, **rig_kw)
    events = []
    for op in script:
        name, *args = op
        kwargs = args.pop() if args and isinstance(args[-1], KW) else {}
        result: Any = None
        error: BaseException | None = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = _snapshot(OPS[name](rig, *args, **kwargs))
            except Exception as e:
                error = e
        events.append(Event(op, result, error, rig.scaler.get_scale(), rig.scaler._get_growth_tracker(), _flags(rig),
                            [p.detach().clone() for p in rig.model.parameters()],
                            [(w.category, str(w.message)) for w in caught]))
    return events


def assert_same_error(ours: BaseException | None, theirs: BaseException | None, where: str = "") -> None:
    if theirs is None:
        assert ours is None, f"{where}: torch succeeded, ours raised {type(ours).__name__}: {ours}"
        return
    assert ours is not None, f"{where}: torch raised {type(theirs).__name__}: {theirs}; ours did not"
    assert isinstance(ours, type(theirs)), f"{where}: {type(ours).__mro__} is not a {type(theirs)}"
    if str(theirs).startswith(EXTENDED_MESSAGES):
        assert str(ours).startswith(str(theirs)), f"{where}: {ours!s} does not start with {theirs!s}"
    else:
        assert str(ours) == str(theirs), f"{where}: {ours!s} != {theirs!s}"


def _same_result(op: tuple[Any, ...], ours: Any, theirs: Any, flags: list[float | None]) -> bool:
    if theirs is None and isinstance(ours, torch.Tensor) and op[0].startswith(("step", "unscale")):
        # our extension: the flag torch keeps in _per_optimizer_states, returned (step: as a bool)
        opt = op[1] if len(op) > 1 and isinstance(op[1], int) else 0
        want = flags[opt] or 0.0
        if op[0].startswith("step"):
            return ours.dtype == torch.bool and ours.dim() == 0 and bool(ours.item()) == (want > 0)
        return ours.dtype == torch.float32 and ours.dim() == 0 and ours.item() == want
    return same(theirs, ours) and _same_types(theirs, ours)


def same(a: Any, b: Any) -> bool:
    """equal_tree, with tensors compared bit for bit (so a NaN equals the same NaN)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return equal_tree(a, b)


def _same_types(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return all(_same_types(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return all(_same_types(x, y) for x, y in zip(a, b))
    return type(a) is type(b) or isinstance(a, torch.Tensor)


def assert_same_trace(theirs: list[Event], ours: list[Event]) -> None:
    assert len(theirs) == len(ours)
    for i, (t, o) in enumerate(zip(theirs, ours)):
        where = f"op {i} {t.op}"
        assert_same_error(o.error, t.error, where)
        assert _same_result(t.op, o.result, t.result, t.flags), f"{where}: result {o.result!r} != torch's {t.result!r}"
        assert (o.scale, o.tracker) == (t.scale, t.tracker), f"{where}: scale/tracker {(o.scale, o.tracker)} != {(t.scale, t.tracker)}"
        assert type(o.scale) is type(t.scale), where
        assert o.flags == t.flags, f"{where}: found_inf flags {o.flags} != {t.flags}"
        assert same(o.params, t.params), f"{where}: parameters differ"
        assert o.warned == t.warned, f"{where}: warnings {o.warned} != {t.warned}"


# --------------------------------------------------------------------------------------------------
# scenarios
# --------------------------------------------------------------------------------------------------
BAD = {2: "inf", 3: "inf", 9: "nan", 15: "inf"}
G = {"growth_interval": 3, "init_scale": 2.0**10}

SCENARIOS: dict[str, tuple[list[tuple[Any, ...]], dict[str, Any], dict[str, Any]]] = {
    # (script, scaler kwargs, rig kwargs)
    "loop-sgd": (loop(24, BAD), G, {}),
    "loop-adamw-foreach": (loop(24, BAD), G, {"opt": "adamw"}),
    "loop-clip": (loop(24, BAD, clip=True), G, {}),
    "loop-adamw-fused": (loop(24, BAD), G, {"opt": "adamw-fused"}),
    "loop-sgd-fused": (loop(24, BAD), G, {"opt": "sgd-fused"}),
    "loop-fused-unscale-clip": (loop(24, BAD, clip=True), G, {"opt": "adamw-fused"}),
    "loop-planted-grads": ([op for i in range(20) for op in it(seed=i, grad=[None, math.inf, -math.inf, math.nan][i % 4])],
                           {"growth_interval": 1, "init_scale": 16.0}, {}),
    "loop-fp16-autocast-natural-overflow": (loop(16, {7: "inf"}, autocast16=True),
                                            {"growth_interval": 2, "init_scale": 2.0**30}, {"opt": "adamw"}),
    "loop-bf16-params": (loop(12, {4: "inf"}), G, {"dtype": torch.bfloat16}),
    "loop-factors": (loop(24, BAD), {"growth_interval": 2, "growth_factor": 3.0, "backoff_factor": 0.3,
                                     "init_scale": 100.0}, {}),
    "sparse-grads": (loop(10, {4: "inf"}), G, {"sparse": True}),
    "sparse-grads-clip": (loop(10, {4: "nan"}, clip=True), G, {"sparse": True}),
    "params-without-grads": (loop(10, {3: "inf"}), G, {"frozen": True}),
    "two-optimizers": ([op for i in range(12) for op in [
        ("fwd", None, i), ("scale",), ("backward",), *([("poison", math.inf, 1)] if i in (3, 7) else []),
        ("unscale", 1), ("step", 0), ("step", 1), ("update",), ("zero",)]], G, {"n_opts": 2}),
    "two-optimizers-fused": ([op for i in range(12) for op in [
        ("fwd", None, i), ("scale",), ("backward",), *([("poison", math.inf, 0)] if i in (3, 7) else []),
        ("step", 0), ("step", 1), ("update",), ("zero",)]], G, {"n_opts": 2, "opt": "adamw-fused"}),
    "gradient-accumulation": ([op for i in range(10) for op in [
        ("fwd", "inf" if i == 4 else None, 2 * i), ("scale",), ("backward",), ("fwd", None, 2 * i + 1), ("scale",),
        ("backward",), ("step",), ("update",), ("zero",)]], G, {}),
    "multiple-outputs": ([op for i in range(8) for op in [
        ("fwd", None, i), ("scale", "list"), ("backward",), ("step",), ("update",), ("zero",),
        ("fwd", None, i), ("scale", "tuple"), ("backward",), ("step",), ("update",), ("zero",)]], G, {}),
    "optimizer-return-value": (loop(8, {3: "inf"}), G, {"opt": "returning"}),
    "closure-none-keyword-then-positional": ([("fwd",), ("scale",), ("backward",), ("step", KW(closure=None)),
                                              ("step_positional_closure",), ("update",), ("get",), *loop(2)], G, {}),
    "positional-closure-skipped": ([("fwd", "inf"), ("scale",), ("backward",), ("step_positional_closure",),
                                    ("update",), ("get",)], G, {}),
    "legacy-grad-scaler-kwarg": (loop(8, {3: "inf"}), G, {"opt": "legacy"}),
    "fused-user-grad-scale": ([("fwd",), ("scale",), ("backward",), ("attr", "grad_scale", lambda: torch.tensor(2.0)),
                               ("step",), ("has_attr", "grad_scale"), ("has_attr", "found_inf"), ("update",),
                               ("zero",), *loop(3)], G, {"opt": "adamw-fused"}),
    "fused-user-grad-scale-after-unscale": ([("fwd",), ("scale",), ("backward",), ("unscale",),
                                             ("attr", "grad_scale", lambda: torch.tensor(1.0)), ("step",),
                                             ("has_attr", "grad_scale"), ("update",), ("zero",), *loop(3)],
                                            G, {"opt": "adamw-fused"}),
    # getters, setters, state, pickling mid-run
    "getters-before-first-scale": ([("get",), ("tensor_scale",), ("sd",), ("found_inf",), ("get",)],
                                   {"init_scale": 1024, "growth_factor": 4, "backoff_factor": 0.25,
                                    "growth_interval": 7}, {}),
    "setters-mid-run": ([*loop(4), ("set", "growth_factor", 4.0), ("set", "backoff_factor", 0.125),
                         ("set", "growth_interval", 1), ("get",), *loop(6, {2: "inf"}), ("set", "growth_factor", 3),
                         ("set", "growth_interval", 2), ("get",), ("sd",), *loop(4)], G, {}),
    "state-dict-round-trip-mid-run": ([*loop(5, {1: "inf"}), ("sd", "a"), *loop(5, {2: "inf"}), ("load", "a"),
                                       ("get",), ("sd",), *loop(6), ("sd",)], G, {}),
    "load-before-first-scale": ([("load", {"scale": 512.0, "growth_factor": 4.0, "backoff_factor": 0.25,
                                           "growth_interval": 2, "_growth_tracker": 1}), ("get",), ("sd",),
                                 *loop(6, {3: "inf"}), ("sd",)], G, {}),
    "load-int-values": ([("load", {"scale": 512, "growth_factor": 4, "backoff_factor": 0.25, "growth_interval": 2,
                                   "_growth_tracker": 1}), ("get",), ("sd",), *loop(3), ("sd",)], G, {}),
    "load-extra-keys-ignored": ([("load", {"scale": 64.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                           "growth_interval": 2, "_growth_tracker": 0, "something_else": 1}),
                                 *loop(4), ("sd",)], G, {}),
    "pickle-between-iterations": ([op for i in range(16) for op in [*it("inf" if i in (3, 4) else None, i),
                                                                    ("pickle",), ("get",)]], G, {}),
    "deepcopy-between-iterations": ([op for i in range(8) for op in [*it("inf" if i == 3 else None, i),
                                                                     ("deepcopy",)]], G, {}),
    "pickle-mid-iteration-refused": ([("fwd",), ("scale",), ("backward",), ("unscale",), ("pickle",), ("step",),
                                      ("pickle",), ("deepcopy",), ("update",), ("pickle",), *loop(3)], G, {}),
    "pickle-after-found-inf-read": ([*loop(2), ("found_inf",), ("pickle",), ("fwd",), ("scale",), ("backward",),
                                     ("step",), ("update",), ("pickle",), ("get",)], G, {}),
    # misuse, and carrying on afterwards
    "unscale-twice": ([("fwd",), ("scale",), ("backward",), ("unscale",), ("unscale",), ("step",), ("update",),
                       *loop(3)], G, {}),
    "unscale-after-step": ([("fwd",), ("scale",), ("backward",), ("step",), ("unscale",), ("update",), *loop(2)], G, {}),
    "step-twice": ([("fwd",), ("scale",), ("backward",), ("step",), ("step",), ("update",), *loop(2)], G, {}),
    "step-twice-fused": ([("fwd",), ("scale",), ("backward",), ("step",), ("step",), ("update",), *loop(2)],
                         G, {"opt": "adamw-fused"}),
    "calls-before-first-scale": ([("unscale",), ("step",), ("update",), ("update", 4.0), ("check_inf",),
                                  ("found_inf",), ("pickle",), ("get",), *loop(2)], G, {}),
    "update-without-step": ([("fwd",), ("scale",), ("backward",), ("update",), ("step",), ("update",), *loop(2)], G, {}),
    "update-twice": ([*it(), ("update",), ("get",), *loop(2)], G, {}),
    "no-grads-step": ([("fwd",), ("scale",), ("step",), ("step",), ("update",), ("unscale",), ("update", 8.0),
                       *loop(2)], G, {}),
    "no-grads-unscale-then-update": ([("fwd",), ("scale",), ("unscale",), ("found_inf",), ("update",), ("pickle",),
                                      ("update", 2.0), *loop(2)], G, {}),
    "no-grads-fused": ([("fwd",), ("scale",), ("step",), ("update",), ("update", 16.0), *loop(2)],
                       G, {"opt": "adamw-fused"}),
    "closure": ([("fwd",), ("scale",), ("backward",), ("step", KW(closure=lambda: 0.0)), ("step",), ("update",)],
                G, {}),
    "fp16-grads": ([("half",), ("fwd",), ("scale",), ("backward",), ("unscale",), ("step",), ("found_inf",),
                    ("check_inf",), ("update",), ("get",)], G, {}),
    "fp16-grads-check-inf-allowed": ([("half",), ("fwd", "inf"), ("scale",), ("backward",), ("check_inf",),
                                      ("found_inf",), ("update",), ("get",)], G, {}),
    "check-inf-does-not-unscale": ([("fwd",), ("scale",), ("backward",), ("check_inf",), ("step",), ("update",),
                                    *loop(2)], G, {}),
    "new-scale-float": ([*it(), ("fwd",), ("scale",), ("backward",), ("step",), ("update", 3.0), ("get",), *loop(4)],
                        G, {}),
    "new-scale-tensor": ([*it(), ("fwd",), ("scale",), ("backward",), ("step",), ("update", torch.tensor(5.0)),
                          ("get",), ("update", torch.tensor(7, dtype=torch.int64)), ("get",),
                          ("update", torch.tensor(9.0, dtype=torch.float64)), ("get",), *loop(4)], G, {}),
    "new-scale-without-step": ([("fwd",), ("scale",), ("backward",), ("update", 32.0), ("get",), *loop(3)], G, {}),
    "new-scale-bad-tensors": ([*it(), ("fwd",), ("scale",), ("backward",), ("step",),
                               ("update", torch.ones(2)), ("update", torch.ones((), requires_grad=True)),
                               ("update", torch.ones((), device="meta")), ("update",), *loop(2)], G, {}),
    # disabled: a pass-through for everything
    "disabled": ([*loop(4, {1: "inf"}, clip=True), ("get",), ("sd",), ("load", {}), ("load", {"x": 1}),
                  ("update", 3.0), ("pickle",), ("get",), ("sd",), ("set", "growth_factor", 5.0),
                  ("get",), *loop(2)], {"enabled": False}, {}),
    "disabled-closure": ([("fwd",), ("scale",), ("backward",), ("step", KW(closure=lambda: 0.0)), ("get",)],
                         {"enabled": False}, {}),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_same_trace_as_torch(name: str) -> None:
    script, scaler_kw, rig_kw = SCENARIOS[name]
    theirs = run(TorchGradScaler, script, scaler_kw, **rig_kw)
    ours = run(GradScaler, script, scaler_kw, **rig_kw)
    assert_same_trace(theirs, ours)
    if scaler_kw.get("enabled", True) and name.startswith("loop"):
        scales = [e.scale for e in theirs if e.op[0] == "update"]
        assert min(scales) < max(scales)  # the scenario did move the scale


def test_step_before_scale() -> None:
    errors = []
    for cls in (TorchGradScaler, GradScaler):
        rig = build(cls, {"device": "cpu"})
        _forward(rig).backward()
        with pytest.raises(Exception) as e:
            cls.step(rig.scaler, rig.opts[0])
        errors.append(e.value)
    assert_same_error(errors[1], errors[0])
    assert str(errors[0]) == ("Attempted step but _scale is None.  This may indicate your script did not use "
                              "scaler.scale(loss or outputs) earlier in the iteration.")


# --------------------------------------------------------------------------------------------------
# pickling at every point of an iteration continues the exact scale schedule
# --------------------------------------------------------------------------------------------------
POINTS = ("after_scale", "after_backward", "after_unscale", "after_step", "after_update")


def _pickle_run(cls: type, points: tuple[str, ...], via: str = "pickle", n: int = 40) -> dict[str, Any]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([p], lr=0.01)
    scaler = cls("cpu", init_scale=64.0, growth_interval=2)
    rng = random.Random(3)
    bad = {i for i in range(n) if rng.random() < 0.2}
    errors: list[tuple[int, str, BaseException]] = []
    seq: list[tuple[float, int]] = []

    def maybe(point: str, i: int) -> None:
        nonlocal scaler
        if point not in points:
            return
        try:
            scaler = pickle.loads(pickle.dumps(scaler)) if via == "pickle" else copy.deepcopy(scaler)
        except Exception as e:
            errors.append((i, point, e))

    for i in range(n):
        scaled = scaler.scale(p.square().sum())
        maybe("after_scale", i)
        scaled.backward()
        if i in bad:
            p.grad[i % 4] = math.inf if i % 3 else math.nan
        maybe("after_backward", i)
        scaler.unscale_(opt)
        maybe("after_unscale", i)
        scaler.step(opt)
        maybe("after_step", i)
        scaler.update()
        maybe("after_update", i)
        opt.zero_grad()
        seq.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return {"seq": seq, "param": p.detach().clone(), "sd": scaler.state_dict(), "errors": errors}


@pytest.mark.parametrize("via", ["pickle", "deepcopy"])
@pytest.mark.parametrize("points", [(p,) for p in POINTS] + [POINTS], ids=[*POINTS, "everywhere"])
def test_pickling_at_any_point_continues_the_exact_schedule(points: tuple[str, ...], via: str) -> None:
    reference = _pickle_run(TorchGradScaler, ())  # torch, never pickled
    ours = _pickle_run(GradScaler, points, via)
    assert ours["seq"] == reference["seq"]
    assert len({s for s, _ in reference["seq"]}) > 3  # it backed off and grew
    assert torch.equal(ours["param"], reference["param"])
    assert equal_tree(ours["sd"], reference["sd"])
    # where torch refuses to pickle, ours refuses with the same error, at the same points
    refusing = [pt for pt in points if pt in ("after_unscale", "after_step")]
    assert [(i, pt) for i, pt, _ in ours["errors"]] == [(i, pt) for i in range(40) for pt in POINTS if pt in refusing]
    if refusing:
        torch_errors = _pickle_run(TorchGradScaler, tuple(refusing), via, n=1)["errors"]
        assert torch_errors and all(isinstance(e, AssertionError) for _, _, e in torch_errors)
        for _, _, e in ours["errors"]:
            assert_same_error(e, torch_errors[0][2])
    if points == ("after_update",):  # torch allows this one and continues exactly too
        assert _pickle_run(TorchGradScaler, points, via)["seq"] == reference["seq"]


def test_the_reported_pickling_bug_ends_at_512() -> None:
    def final(cls: type, pickled: bool) -> float:
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.0)
        s = cls("cpu", init_scale=64.0, growth_interval=2)
        for i in range(10):
            s.scale(p.sum()).backward()
            if i == 3:
                p.grad[0] = math.inf
            s.step(opt)
            s.update()
            opt.zero_grad()
            if pickled:
                s = pickle.loads(pickle.dumps(s))
        return s.get_scale()

    assert final(TorchGradScaler, False) == final(TorchGradScaler, True) == 512.0
    assert final(GradScaler, True) == final(GradScaler, False) == 512.0


def test_pickled_after_scale_the_copy_steps_where_torchs_raises() -> None:
    """Documented difference: torch allows pickling after scale() but its copy cannot step."""
    results = {}
    for cls in (TorchGradScaler, GradScaler):
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.5)
        s = cls("cpu", init_scale=8.0)
        s.scale(p.sum()).backward()
        copy_ = pickle.loads(pickle.dumps(s))
        try:
            copy_.step(opt)
            copy_.update()
            results[cls] = (copy_.get_scale(), p.tolist())
        except AssertionError as e:
            results[cls] = str(e)
    assert results[TorchGradScaler].startswith("Attempted step but _scale is None.")
    assert results[GradScaler] == (8.0, [0.5, 0.5])  # unscaled by 8 before the step


# --------------------------------------------------------------------------------------------------
# constructor, getters, setters
# --------------------------------------------------------------------------------------------------
CONSTRUCTOR_CASES = [
    {},
    {"init_scale": 1024},
    {"init_scale": 2.0**10, "growth_factor": 4, "backoff_factor": 0.25, "growth_interval": 7},
    {"init_scale": 3.0, "growth_factor": 1.5, "backoff_factor": 0.9, "growth_interval": 1},
    {"growth_factor": 1.0},
    {"growth_factor": 0.5},
    {"growth_factor": True},
    {"backoff_factor": 1.0},
    {"backoff_factor": 2},
    {"growth_factor": "2"},
    {"backoff_factor": "x"},
    {"growth_factor": 1.0, "backoff_factor": 2.0},
    {"growth_factor": 1.0, "enabled": False},
    {"backoff_factor": 3.0, "init_scale": -1.0, "enabled": False},
    {"enabled": False},
    {"enabled": 0},
    {"enabled": 1},
    {"device": torch.device("cpu")},
]


@pytest.mark.parametrize("kw", CONSTRUCTOR_CASES, ids=[repr(k) for k in CONSTRUCTOR_CASES])
def test_constructor_getters_and_state_like_torch(kw: dict[str, Any]) -> None:
    kw = {"device": "cpu", **kw}
    made: list[Any] = []
    errors: list[BaseException | None] = []
    for cls in (TorchGradScaler, GradScaler):
        try:
            made.append(cls(**kw))
            errors.append(None)
        except Exception as e:
            made.append(None)
            errors.append(e)
    assert_same_error(errors[1], errors[0])
    theirs, ours = made
    if theirs is None:
        return

    def observe(s: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"enabled": s.is_enabled(), "scale": s.get_scale(), "tracker": s._get_growth_tracker(),
                               "sd": s.state_dict()}
        if s.is_enabled():  # torch's getters raise AttributeError when disabled (ours return the values)
            out["getters"] = (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval())
        return out

    a, b = observe(theirs), observe(ours)
    assert equal_tree(a, b) and _same_types(a, b), (a, b)


def test_setters_take_any_value_like_torch() -> None:
    for cls in (TorchGradScaler, GradScaler):
        s = cls("cpu")
        s.set_growth_factor(1.0)  # the constructor refuses it, the setter does not (torch)
        s.set_backoff_factor(0.0)
        s.set_growth_interval(5)
        assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (1.0, 0.0, 5)
        assert s.state_dict()["growth_factor"] == 1.0


def test_disabled_getters_return_the_constructor_values() -> None:
    """Documented difference: torch's raise AttributeError when disabled."""
    s = GradScaler("cpu", growth_factor=3.0, backoff_factor=0.25, growth_interval=9, enabled=False)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (3.0, 0.25, 9)
    with pytest.raises(AttributeError):
        TorchGradScaler("cpu", enabled=False).get_growth_factor()


@pytest.mark.parametrize("kw, message", [
    ({"init_scale": 0.0}, "GradScaler: init_scale must be > 0, got 0.0."),
    ({"init_scale": math.inf}, "GradScaler: init_scale must be a finite number, got inf."),
    ({"backoff_factor": 0.0}, "GradScaler: backoff_factor must be > 0 and < 1, got 0.0."),
    ({"growth_interval": 0}, "GradScaler: growth_interval must be an int >= 1, got 0."),
    ({"growth_interval": 2.0}, "GradScaler: growth_interval must be an int >= 1, got 2.0."),
])
def test_constructor_rejects_what_degenerates_silently_in_torch(kw: dict[str, Any], message: str) -> None:
    TorchGradScaler("cpu", **kw)  # torch accepts these; its scale then collapses, NaNs or never grows
    with pytest.raises(ValueError, match=re.escape(message)):
        GradScaler("cpu", **kw)


# --------------------------------------------------------------------------------------------------
# scale() on tensors and iterables
# --------------------------------------------------------------------------------------------------
T = torch.tensor([1.0, -2.0])
SCALE_CASES: dict[str, Any] = {
    "tensor": lambda: T,
    "fp16-tensor": lambda: T.half(),
    "bf16-tensor": lambda: T.bfloat16(),
    "int-tensor": lambda: torch.tensor([1, 2]),
    "0-d": lambda: torch.tensor(3.0),
    "list": lambda: [T, T * 2],
    "tuple": lambda: (T,),
    "nested": lambda: [T, (T, [T.half()]), []],
    "empty-list": lambda: [],
    "generator": lambda: (t for t in [T, T]),
    "set": lambda: {T},
    "bad-leaf": lambda: [T, 3],
    "nested-bad-leaf": lambda: [T, [None]],
    "int": lambda: 3,
    "none": lambda: None,
}


@pytest.mark.parametrize("name", list(SCALE_CASES))
def test_scale_like_torch(name: str) -> None:
    got: list[Any] = []
    for cls in (TorchGradScaler, GradScaler):
        s = cls("cpu", init_scale=4.0)
        try:
            out = s.scale(SCALE_CASES[name]())
            lazy = s._scale is None  # a map is consumed lazily: the scale is created on consumption
            if not isinstance(out, (torch.Tensor, list, tuple)):
                out = ("map", list(out))
            got.append((out, lazy, s._scale is None, None))
        except Exception as e:
            got.append((None, None, None, e))
    (a, lazy_a, none_a, err_a), (b, lazy_b, none_b, err_b) = got
    assert_same_error(err_b, err_a)
    assert (lazy_a, none_a) == (lazy_b, none_b)
    assert same(a, b) and _same_types(a, b)


def test_scale_beyond_torch_dicts_namedtuples_and_strings() -> None:
    """Documented differences: torch maps over a dict's keys and cannot rebuild a namedtuple."""
    Pair = namedtuple("Pair", "a b")
    s = GradScaler("cpu", init_scale=4.0)
    assert s.scale({"x": T})["x"].tolist() == [4.0, -8.0]
    assert s.scale(Pair(T, T)).b.tolist() == [4.0, -8.0]
    with pytest.raises(ValueError, match=re.escape("outputs must be a Tensor or an iterable of Tensors")):
        s.scale(["loss"])
    with pytest.raises(TypeError):
        TorchGradScaler("cpu").scale(Pair(T, T))


# --------------------------------------------------------------------------------------------------
# state dicts: torch's keys and types, both directions, extended state, old checkpoints
# --------------------------------------------------------------------------------------------------
def _pattern_run(scaler: Any, pattern: list[bool], p: torch.nn.Parameter | None = None) -> Any:
    p = p if p is not None else torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    for bad in pattern:
        scaler.scale(p.sum()).backward()
        if bad:
            p.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler


@pytest.mark.parametrize("steps", [0, 1, 7, 30])
def test_plain_state_dict_is_exactly_torchs(steps: int) -> None:
    rng = random.Random(steps)
    pattern = [rng.random() < 0.3 for _ in range(steps)]
    kw = {"init_scale": 2.0**12, "growth_interval": 3, "growth_factor": 3.0, "backoff_factor": 0.25}
    theirs = _pattern_run(TorchGradScaler("cpu", **kw), pattern).state_dict()
    ours = _pattern_run(GradScaler("cpu", **kw), pattern).state_dict()
    assert list(ours) == list(TORCH_STATE_KEYS) == list(theirs)
    assert equal_tree(ours, theirs) and _same_types(ours, theirs)
    assert all(not isinstance(v, torch.Tensor) for v in ours.values())


@pytest.mark.parametrize("direction", ["torch->mixprec", "mixprec->torch", "mixprec->mixprec"])
@pytest.mark.parametrize("when", ["before-first-scale", "mid-run"])
def test_state_dict_interoperates(direction: str, when: str) -> None:
    rng = random.Random(11)
    first = [rng.random() < 0.3 for _ in range(25)] if when == "mid-run" else []
    then = [rng.random() < 0.3 for _ in range(40)]
    kw = {"init_scale": 2.0**12, "growth_interval": 3}
    src_cls, dst_cls = {"torch->mixprec": (TorchGradScaler, GradScaler), "mixprec->torch": (GradScaler, TorchGradScaler),
                        "mixprec->mixprec": (GradScaler, GradScaler)}[direction]
    reference = _pattern_run(TorchGradScaler("cpu", **kw), first)
    src = _pattern_run(src_cls("cpu", **kw), first)
    dst = dst_cls("cpu")  # defaults everywhere: the loaded state must replace them
    if when == "mid-run":
        _pattern_run(dst, [False, True])  # a destination that already has tensors
    dst.load_state_dict(src.state_dict())
    assert equal_tree(dst.state_dict(), reference.state_dict())
    seq_ref = [_pattern_run(reference, [b]).get_scale() for b in then]
    seq_dst = [_pattern_run(dst, [b]).get_scale() for b in then]
    assert seq_dst == seq_ref
    assert equal_tree(dst.state_dict(), reference.state_dict())


def test_extended_state_dict() -> None:
    s = _pattern_run(GradScaler("cpu", init_scale=256.0, growth_interval=2, hysteresis=2, min_scale=1.0),
                     [True, False, True, True, False, False, False])
    plain, ext = s.state_dict(), s.state_dict(extended=True)
    assert list(ext)[:5] == list(TORCH_STATE_KEYS) and {k: ext[k] for k in plain} == plain
    assert ext["version"] == 1 and ext["kind"] == "dynamic" and ext["steps"] == 7 and ext["hysteresis"] == 2
    assert {"hysteresis_left", "min_scale", "max_scale", "refill", "skipped_steps", "scale_history"} <= ext.keys()
    # torch loads it (ignoring our keys) and ours restores everything from it
    t = TorchGradScaler("cpu")
    t.load_state_dict(ext)
    assert t.state_dict() == plain
    r = GradScaler("cpu")
    r.load_state_dict(ext)
    assert r.state_dict(extended=True) == ext
    more = [False, True, False, False, True]
    assert (_pattern_run(r, more).state_dict(extended=True) == _pattern_run(s, more).state_dict(extended=True))
    assert GradScaler("cpu", enabled=False).state_dict(extended=True) == {}


def test_checkpoints_of_earlier_mixprec_versions_still_load() -> None:
    """The extended layout earlier mixprec versions wrote from plain ``state_dict()``."""
    old = {"version": 1, "kind": "dynamic", "scale": 512.0, "_growth_tracker": 2, "hysteresis_left": 0, "steps": 9,
           "skipped_steps": 3, "consecutive_skips": 0, "last_overflow_step": 5, "last_finite_step": 8,
           "floor_streak": 0, "scale_history": [1024.0, 512.0, 512.0, 512.0], "overflow_history": [False, True, False,
                                                                                                     False],
           "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 4, "hysteresis": 1, "min_scale": None,
           "max_scale": None, "refill": "growth"}
    s = GradScaler("cpu")
    s.load_state_dict(old)
    assert s.state_dict() == {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 4,
                              "_growth_tracker": 2}
    ext = s.state_dict(extended=True)
    assert ext["steps"] == 9 and ext["skipped_steps"] == 3 and ext["last_overflow_step"] == 5
    _pattern_run(s, [False, False])
    assert (s.get_scale(), s._get_growth_tracker()) == (1024.0, 0)  # the tracker carried on: 2 + 2 = growth_interval


LOAD_ERROR_CASES: dict[str, Any] = {
    "empty-dict": {},
    "empty-list": [],
    "missing-keys": {"scale": 1.0},
    "whole-checkpoint": {"model": {}, "optimizer": {}},
    "list": [1, 2],
}


@pytest.mark.parametrize("name", list(LOAD_ERROR_CASES))
@pytest.mark.parametrize("started", [False, True])
def test_load_errors_like_torch(name: str, started: bool) -> None:
    errors = []
    for cls in (TorchGradScaler, GradScaler):
        s = cls("cpu")
        if started:
            _pattern_run(s, [False])
        with pytest.raises(Exception) as e:
            s.load_state_dict(LOAD_ERROR_CASES[name])
        errors.append(e.value)
    theirs, ours = errors
    assert isinstance(ours, type(theirs)), (type(theirs), type(ours))
    if name.startswith("empty"):
        assert str(ours) == str(theirs) == ("The source state dict is empty, possibly because it was saved from a "
                                            "disabled instance of GradScaler.")
    elif isinstance(ours, KeyError):
        assert str(ours).startswith("GradScaler: not a loss-scaler state dict (missing ")


def test_load_into_disabled_is_a_no_op_like_torch() -> None:
    for cls in (TorchGradScaler, GradScaler):
        s = cls("cpu", enabled=False)
        s.load_state_dict({})
        s.load_state_dict({"anything": 1})
        assert s.state_dict() == {}


def test_foreign_and_newer_state_dicts_are_refused() -> None:
    s = GradScaler("cpu")
    with pytest.raises(RuntimeError, match=re.escape("GradScaler: this state dict is from a StaticScaler")):
        s.load_state_dict({"version": 1, "kind": "static", "scale": 4.0})
    with pytest.raises(RuntimeError, match=re.escape("state dict version 99 is newer")):
        s.load_state_dict({"version": 99, "kind": "dynamic", **GradScaler("cpu").state_dict()})
    with pytest.raises(ValueError, match=re.escape("GradScaler.load_state_dict: hysteresis must be an int >= 1")):
        s.load_state_dict({**GradScaler("cpu").state_dict(), "hysteresis": 0})


# --------------------------------------------------------------------------------------------------
# other documented differences
# --------------------------------------------------------------------------------------------------
def test_update_accepts_an_int_and_a_one_element_vector() -> None:
    """Documented difference: torch raises AttributeError for an int and a broadcast error for shape (1,)."""
    s = GradScaler("cpu")
    s.scale(torch.ones(()))
    s.update(8)
    assert s.get_scale() == 8.0
    s.update(torch.tensor([16.0]))
    assert s.get_scale() == 16.0
    t = TorchGradScaler("cpu")
    t.scale(torch.ones(()))
    with pytest.raises(AttributeError):
        t.update(8)
    with pytest.raises(RuntimeError):
        t.update(torch.tensor([16.0]))


def test_uses_torchs_opt_state_enum() -> None:
    from torch.amp.grad_scaler import OptState

    from mixprec._grad_scaler import OptState as Ours

    assert Ours is OptState
    s = GradScaler("cpu")
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    s.scale(p.sum()).backward()
    s.unscale_(opt)
    assert s._per_optimizer_states[id(opt)]["stage"] is OptState.UNSCALED


def test_fp16_loss_gradients_do_not_sync_in_fused_step() -> None:
    """Same (zero) host reads as torch on the fused path; F is used so the import is exercised."""
    from mixprec.bench._timing import OpCounter

    counts = []
    for cls in (TorchGradScaler, GradScaler):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        s = cls("cpu")
        x = torch.randn(3, 4)
        s.scale(F.mse_loss(model(x), torch.zeros(3, 2))).backward()
        s.step(opt)
        s.update()
        opt.zero_grad()
        with OpCounter() as c:
            s.scale(F.mse_loss(model(x), torch.zeros(3, 2))).backward()
            s.unscale_(opt)
            s.step(opt)
            s.update()
        counts.append(c.ops["_local_scalar_dense"])
    assert counts == [0, 0]
