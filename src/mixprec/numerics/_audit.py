"""Precision audit: the dtypes actually in use, and the silent downgrades among them.

One table of what a training setup really stores and computes in: parameters, normalization
layers, FP32 masters, gradients, gradient accumulation, optimizer states, buffers, the loss
scaler and gradient communication (DDP, FSDP, FSDP2). A row is flagged ``downgrade`` when
something ends up in lower precision than the setup implies without anybody asking for it;
the classic is AdamW's moments in BF16 because ``torch.optim`` creates them like the
parameters, which are BF16 (as users hit under FSDP with BF16 parameters).

The audit only reads attributes (duck typing): it understands mixprec's
``MasterWeightOptimizer`` (``.masters``, ``.model_params``, ``.grad_accumulation``),
``mixprec.optim`` optimizers (``.compensation``, ``.state_dtype``), ``MixedPrecision``
(``.policy``, ``.scaler``), ``torch.amp.GradScaler``, DDP and FSDP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from .._dtypes import HALF, dtype_name
from .._fp8 import fp8_summary
from .._master_grad import is_view
from .._policy import Policy
from ._findings import format_table, jsonable, print_tables

__all__ = ["AuditResult", "AuditRow", "audit"]

Status = Literal["ok", "note", "downgrade"]
_RANK = {torch.float64: 3, torch.float32: 2, torch.bfloat16: 1, torch.float16: 1}
_NORM_POLICY = Policy(fp32_islands=("norm",))


def _name(dt: torch.dtype) -> str:
    try:
        return dtype_name(dt)
    except ValueError:
        return str(dt).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class AuditRow:
    """One line of the audit.

    Attributes:
        component: ``"parameters"``, ``"normalization layers"``, ``"masters"``, ``"gradients"``,
            ``"gradient accumulation"``, ``"optimizer state"``, ``"buffers"``, ``"loss scaling"``,
            ``"communication"`` or ``"compute"``.
        detail: Which part (a state key such as ``exp_avg``, a module class).
        dtype: The dtype (short name), or a description.
        tensors / elements / bytes: How much is stored that way (0 when not applicable).
        status: ``"ok"``, ``"note"`` (deliberate or informational) or ``"downgrade"`` (lower
            precision than the setup implies, not asked for).
        note: Why, and what to do.
        example: One tensor's qualified name, to find it.
    """

    component: str
    detail: str
    dtype: str
    tensors: int = 0
    elements: int = 0
    bytes: int = 0
    status: Status = "ok"
    note: str = ""
    example: str = ""


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """The audit table.

    Attributes:
        rows: :class:`AuditRow` s, in component order.
        policy: The policy the audit compared against (grammar string), or ``None``.
    """

    rows: list[AuditRow]
    policy: str | None

    @property
    def downgrades(self) -> list[AuditRow]:
        """The rows flagged ``downgrade``."""
        return [r for r in self.rows if r.status == "downgrade"]

    @property
    def ok(self) -> bool:
        """No downgrade found."""
        return not self.downgrades

    def rows_for(self, component: str) -> list[AuditRow]:
        """The rows of one component."""
        return [r for r in self.rows if r.component == component]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (schema ``mixprec.audit/1``)."""
        d = jsonable(self)
        d["schema"] = "mixprec.audit/1"
        d["downgrades"] = len(self.downgrades)
        return d

    def _table(self) -> tuple[str, list[str], list[list[str]]]:
        rows = [[r.component, r.detail, r.dtype, str(r.tensors) if r.tensors else "", _bytes(r.bytes),
                 r.status.upper() if r.status == "downgrade" else r.status, r.note] for r in self.rows]
        title = "Precision audit" + (f" (policy {self.policy})" if self.policy else "")
        return title, ["component", "detail", "dtype", "tensors", "bytes", "status", "note"], rows

    def table(self) -> str:
        """Plain-text table, then a count of downgrades."""
        t, h, r = self._table()
        return format_table(h, r, t) + f"\n{len(self.downgrades)} downgrade(s)."

    def print(self, file: Any = None, use_rich: bool | None = None) -> None:
        """Print with rich when installed."""
        print_tables([self._table()], [f"{len(self.downgrades)} downgrade(s)."], file=file, use_rich=use_rich)

    def __str__(self) -> str:
        return self.table()


def _bytes(n: float) -> str:
    if not n:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _group(items: Iterable[tuple[str, torch.Tensor]]) -> dict[torch.dtype, list[tuple[str, torch.Tensor]]]:
    out: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for n, t in items:
        out.setdefault(t.dtype, []).append((n, t))
    return out


def _stored(t: torch.Tensor) -> tuple[int, int]:
    """(elements, bytes) that ``t`` stores: a sparse tensor's values and indices, not its dense shape.

    A sparse gradient (``nn.Embedding(sparse=True)``) of a 50k-row table holds the rows one batch
    touched; counting its dense ``numel()`` would report the whole table as stored.
    """
    if t.layout == torch.strided:
        return t.numel(), t.numel() * t.element_size()
    if t.layout == torch.sparse_coo:
        values, indices = t._values(), [t._indices()]  # as stored (uncoalesced: one entry per lookup)
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        values, indices = t.values(), [t.crow_indices(), t.col_indices()]
    else:  # sparse_csc, sparse_bsc
        values, indices = t.values(), [t.ccol_indices(), t.row_indices()]
    return values.numel(), values.numel() * values.element_size() + sum(i.numel() * i.element_size() for i in indices)


def _sizes(ts: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    stored = [_stored(t) for _, t in ts]
    return {"tensors": len(ts), "elements": sum(n for n, _ in stored), "bytes": sum(b for _, b in stored),
            "example": ts[0][0] if ts else ""}


def _resolve(policy: Any) -> tuple[Policy | None, Any]:
    """(policy, scaler) from a Policy, a string, a MixedPrecision-like object or None."""
    if policy is None:
        return None, None
    if isinstance(policy, (Policy, str)):
        return Policy.parse(policy), None
    if hasattr(policy, "policy"):
        return Policy.parse(policy.policy), getattr(policy, "scaler", None)
    raise TypeError(f"policy must be a Policy, a preset string or a MixedPrecision, got {type(policy).__name__}")


def _unwrap(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) and type(model).__name__ in (
        "DistributedDataParallel", "DataParallel", "FullyShardedDataParallel") else model


def audit(model: nn.Module, optimizer: Any = None, policy: Any = None, *, scaler: Any = None) -> AuditResult:
    """Tabulate the dtypes a training setup actually uses and flag silent downgrades.

    Args:
        model: The model (wrapped in DDP/FSDP or not).
        optimizer: The optimizer you step (a ``MasterWeightOptimizer``, a ``mixprec.optim``
            optimizer or any ``torch.optim`` optimizer), or ``None``.
        policy: What the setup is meant to be: a :class:`Policy`, a preset string or a
            ``MixedPrecision`` (its scaler is audited too). Default: the policy ``cast_module``
            recorded on the model, if any.
        scaler: A loss scaler (mixprec ``LossScaler`` or ``torch.amp.GradScaler``) to report.

    Returns:
        :class:`AuditResult`; ``.downgrades`` lists the flagged rows, ``str()`` is the table.

    Example:
        >>> m = torch.nn.Linear(4, 4).to(torch.bfloat16)
        >>> opt = torch.optim.AdamW(m.parameters())
        >>> [r.detail for r in audit(m, opt).downgrades]
        ['masters', 'exp_avg (predicted)', 'exp_avg_sq (predicted)']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"audit needs an nn.Module, got {type(model).__name__}")
    pol, prec_scaler = _resolve(policy)
    inner = _unwrap(model)
    recorded = getattr(inner, "_mixprec_policy", None)  # set by cast_module
    if pol is None and isinstance(recorded, str):
        pol = Policy.parse(recorded)
    scaler = scaler if scaler is not None else prec_scaler
    rows: list[AuditRow] = []
    named = list(inner.named_parameters())
    names = {id(p): n for n, p in named}

    # ----- compute -----
    if pol is not None:
        c = _name(pol.compute_dtype)
        how = "autocast" if pol.is_mixed else "parameter dtype" if pol.param_dtype != torch.float32 else "FP32"
        rows.append(AuditRow("compute", "forward/backward", c, note=f"{how}; TF32 {'on' if pol.tf32 else 'off'}",
                             status="ok"))
    fp8 = fp8_summary(inner, pol)  # mixprec._fp8: the linears whose GEMMs run in FP8 (f8= policies)
    if fp8 is not None:
        rows.append(AuditRow("compute", fp8[0], fp8[1], status=fp8[2], note=fp8[3]))

    # ----- parameters and normalization layers -----
    norm_ids: set[int] = set()
    for mname, m in inner.named_modules():
        if _NORM_POLICY.is_fp32_island(m, mname):
            norm_ids.update(id(p) for p in m.parameters())
    islands: set[int] = set()
    if pol is not None:
        from .._casting import island_modules
        for _, m in island_modules(inner, pol):
            islands.update(id(p) for p in m.parameters())
    main = [(n, p) for n, p in named if id(p) not in norm_ids]
    norms = [(n, p) for n, p in named if id(p) in norm_ids]
    for dt, ts in sorted(_group(main).items(), key=lambda kv: -_RANK.get(kv[0], 0)):
        status: Status = "ok"
        note = ""
        if pol is not None and dt.is_floating_point:
            wrong = [(n, p) for n, p in ts if id(p) not in islands and p.dtype != pol.param_dtype]
            if wrong and _RANK.get(dt, 0) < _RANK.get(pol.param_dtype, 0):
                status, note = "downgrade", f"the policy stores parameters in {_name(pol.param_dtype)}"
            elif wrong:
                status, note = "note", f"the policy stores parameters in {_name(pol.param_dtype)}"
        rows.append(AuditRow("parameters", "weights", _name(dt), status=status, note=note, **_sizes(ts)))
    for dt, ts in _group(norms).items():
        status = "ok"
        note = "FP32 island" if dt == torch.float32 else ""
        if dt in HALF:
            expects_island = pol is None or "norm" in pol.fp32_islands
            status = "downgrade" if pol is not None and expects_island else "note"
            note = (f"normalization weights in {_name(dt)}: mixprec keeps them in FP32 (policy i=norm); their "
                    "statistics lose precision in half types")
        rows.append(AuditRow("normalization layers", "weights", _name(dt), status=status, note=note, **_sizes(ts)))

    # ----- masters -----
    masters = getattr(optimizer, "masters", None) if optimizer is not None else None
    model_params = getattr(optimizer, "model_params", None) if optimizer is not None else None
    half_params = [(n, p) for n, p in named if p.dtype in HALF and p.requires_grad]
    state_dtype = getattr(optimizer, "state_dtype", None)
    compensation = getattr(optimizer, "compensation", None)
    opt_tensors: list[tuple[str, torch.Tensor]] = []
    if optimizer is not None:
        for g in getattr(optimizer, "param_groups", []):
            for p in g["params"]:
                opt_tensors.append((names.get(id(p), f"param{len(opt_tensors)}"), p))
    if isinstance(masters, list) and isinstance(model_params, list):
        pairs = [(names.get(id(p), f"param{i}"), p, m) for i, (p, m) in enumerate(zip(model_params, masters))]
        separate = [(n, m) for n, p, m in pairs if m is not p]
        opt_tensors = [(n, m) for n, _, m in pairs]
        if getattr(optimizer, "master_storage", "full") == "remainder":
            # bf16-master-r16: each master is its BF16 weight plus an int16 remainder (2 bytes of its own, not 4).
            rems = [(n, r) for (n, p, m), r in zip(pairs, getattr(optimizer, "remainders", [])) if r is not None]
            rows.append(AuditRow("masters", "BF16 weight + int16 remainder", "f32 (exact)",
                                 note=f"{type(optimizer).__name__} around {type(getattr(optimizer, 'optimizer', optimizer)).__name__}, "
                                      "master_storage='remainder': the bytes are the remainders'", **_sizes(rems)))
            separate = []
        for dt, ts in _group(separate).items():
            bad = dt in HALF
            rows.append(AuditRow("masters", "separate copies", _name(dt), status="downgrade" if bad else "ok",
                                 note="masters in half precision defeat their purpose" if bad else
                                 f"{type(optimizer).__name__} around {type(getattr(optimizer, 'optimizer', optimizer)).__name__}",
                                 **_sizes(ts)))
        own = [(n, p) for n, p, m in pairs if m is p]
        if own:
            rows.append(AuditRow("masters", "parameters are their own masters", "/".join(sorted({_name(p.dtype) for _, p in own})),
                                 note="FP32 parameters (islands) are updated directly", **_sizes(own)))
    elif optimizer is None:
        rows.append(AuditRow("masters", "unknown", "-", status="note", note="pass the optimizer to audit masters and states"))
    elif half_params:
        held = {id(p) for _, p in opt_tensors}
        hp = [(n, p) for n, p in half_params if id(p) in held]
        explicit = pol is not None and pol.param_dtype in HALF and pol.master_dtype is None
        if pol is not None and pol.has_masters:
            rows.append(AuditRow(
                "masters", "masters", "none", status="downgrade",
                note=f"the policy keeps FP32 masters (m={_name(pol.master_dtype or torch.float32)}) but this optimizer "
                     f"({type(optimizer).__name__}) holds none: step the optimizer MixedPrecision.prepare() returned",
                **_sizes(hp)))
        elif compensation not in (None, "none"):
            rows.append(AuditRow("masters", "none", "-", status="note",
                                 note=f"half-precision parameters with {compensation}-compensated updates", **_sizes(hp)))
        else:
            rows.append(AuditRow(
                "masters", "masters", "none", status="note" if explicit else "downgrade",
                note=("as the policy asks (no masters, no compensation): " if explicit else "")
                + "half-precision weights updated in place: updates below half an ulp are lost (stagnation); use "
                  "FP32 masters (bf16-master) or compensated updates (bf16-pure)", **_sizes(hp)))
    else:
        rows.append(AuditRow("masters", "parameters are the masters", "f32", note="FP32 parameters"))

    # ----- gradients -----
    # A master-weight parameter's .grad is a view of its master's FP32 gradient (no storage of its
    # own): the master's gradient is what is stored, and it is listed below.
    grads = [(n + ".grad", p.grad) for n, p in named if p.grad is not None and not is_view(p.grad)]
    if isinstance(masters, list):
        seen = {id(p) for _, p in named}
        grads += [(f"{n}.grad (master)", t.grad) for n, t in opt_tensors if id(t) not in seen and t.grad is not None]
    if grads:
        for dt, ts in _group(grads).items():
            rows.append(AuditRow("gradients", "stored", _name(dt), **_sizes(ts)))
    else:
        rows.append(AuditRow("gradients", "stored", "-", status="note", note="no gradients yet (run a backward first)"))

    # ----- gradient accumulation -----
    acc = getattr(optimizer, "grad_accumulation", None)
    if acc == "fp32":
        rows.append(AuditRow("gradient accumulation", "into the masters' .grad", "f32",
                             note="half gradients are added into FP32 during backward"))
    elif acc is not None:
        dts = "/".join(sorted({_name(p.dtype) for _, p in half_params})) or "param dtype"
        rows.append(AuditRow("gradient accumulation", "on the parameters", dts, status="note",
                             note=f"grad_accumulation={acc!r}: micro-batches accumulate in {dts} until the step"))
    else:
        names_ = sorted({_name(p.dtype) for _, p in named if p.requires_grad})
        half_names = [d for d in names_ if d in ("bf16", "f16")]
        rows.append(AuditRow("gradient accumulation", "on the parameters (.grad)", "/".join(names_) or "-",
                             status="note" if half_names else "ok",
                             note=f"micro-batch gradients accumulate in {'/'.join(half_names)} (like the parameters)"
                             if half_names else ""))

    # ----- optimizer state -----
    if optimizer is not None:
        rows += _state_rows(optimizer, opt_tensors, names, state_dtype, compensation)

    # ----- buffers -----
    bufs = [(n, b) for n, b in inner.named_buffers() if b.is_floating_point()]
    for dt, ts in _group(bufs).items():
        half = dt in HALF
        rows.append(AuditRow("buffers", "floating buffers", _name(dt), status="note" if half else "ok",
                             note="e.g. BatchNorm running statistics in half precision" if half else "", **_sizes(ts)))

    # ----- loss scaling -----
    if scaler is not None or pol is not None:
        rows.append(_scaler_row(scaler, pol))

    # ----- communication -----
    rows += _comm_rows(model)
    return AuditResult(rows=rows, policy=str(pol) if pol is not None else None)


def _state_rows(optimizer: Any, opt_tensors: list[tuple[str, torch.Tensor]], names: dict[int, str],
                state_dtype: Any, compensation: Any) -> list[AuditRow]:
    rows: list[AuditRow] = []
    inner_opt = getattr(optimizer, "optimizer", optimizer)
    state = getattr(optimizer, "state", {})
    tname = {id(t): n for n, t in opt_tensors}
    by_key: dict[tuple[str, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    per_element_keys: set[str] = set()
    for p, st in list(state.items()) if hasattr(state, "items") else []:
        if not isinstance(st, dict):
            continue
        for k, v in st.items():
            per_element = isinstance(p, torch.Tensor) and v.numel() == p.numel() and v.dim() > 0
            if isinstance(v, torch.Tensor) and v.is_floating_point() and per_element:
                per_element_keys.add(k)
                by_key.setdefault((k, v.dtype), []).append((f"{tname.get(id(p), names.get(id(p), '?'))}.{k}", v))
    opt_name = type(inner_opt).__name__
    if by_key:
        for (k, dt), ts in sorted(by_key.items(), key=lambda kv: (kv[0][0], -_RANK.get(kv[0][1], 0))):
            rows.append(_state_row(k, dt, ts, opt_name, state_dtype, compensation, predicted=False))
        return rows
    # No state yet: torch optimizers create per-element states like the tensors they hold.
    keys = _predicted_keys(inner_opt)
    if state_dtype is not None:
        for k in keys:
            ts = [(n, t) for n, t in opt_tensors if t.is_floating_point()]
            rows.append(_state_row(k, state_dtype, ts, opt_name, state_dtype, compensation, predicted=True))
        return rows
    held = _group([(n, t) for n, t in opt_tensors if t.is_floating_point()])
    for k in keys:
        for dt, ts in held.items():
            rows.append(_state_row(k, dt, ts, opt_name, state_dtype, compensation, predicted=True))
    if not keys:
        rows.append(AuditRow("optimizer state", "-", "-", status="note",
                             note=f"no state yet; audit again after the first step ({opt_name})"))
    return rows


def _predicted_keys(opt: Any) -> list[str]:
    name = type(opt).__name__
    if name in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax"):
        keys = ["exp_avg", "exp_avg_sq"] if name != "Adamax" else ["exp_avg", "exp_inf"]
        if any(g.get("amsgrad") for g in getattr(opt, "param_groups", [])):
            keys.append("max_exp_avg_sq")
        return keys
    if name == "SGD":
        return ["momentum_buffer"] if any(g.get("momentum", 0) for g in getattr(opt, "param_groups", [])) else []
    if name in ("RMSprop",):
        return ["square_avg"]
    if name == "Adagrad":
        return ["sum"]
    return []


def _state_row(key: str, dt: Any, ts: list[tuple[str, torch.Tensor]], opt_name: str, state_dtype: Any,
               compensation: Any, predicted: bool) -> AuditRow:
    detail = key + (" (predicted)" if predicted else "")
    sizes = _sizes(ts)
    if predicted:
        sizes["bytes"] = sizes["elements"] * (torch.empty((), dtype=dt).element_size())
    status: Status = "ok"
    note = ""
    if key in ("kahan_comp",) or "comp" in key:
        note = f"compensation buffer ({compensation}) in the parameter dtype, by design"
    elif dt in HALF:
        if state_dtype is not None and dt == state_dtype:
            status, note = "note", f"as requested (state_dtype={_name(dt)})"
        else:
            status = "downgrade"
            note = (f"{opt_name} {key} in {_name(dt)} because the tensors it optimizes are {_name(dt)}"
                    + (" (created at the first step like them)" if predicted else "")
                    + "; keep FP32 masters (MixedPrecision 'bf16-master') or use mixprec.optim with "
                      "state_dtype=torch.float32")
    return AuditRow("optimizer state", detail, _name(dt), status=status, note=note, **sizes)


def _scaler_row(scaler: Any, pol: Policy | None) -> AuditRow:
    needs = pol is not None and pol.compute_dtype == torch.float16
    if scaler is None:
        if pol is None:
            return AuditRow("loss scaling", "-", "-", status="note")
        kind = pol.loss_scale
        note = "FP16 compute without loss scaling: small gradients flush to zero" if needs and kind == "none" else ""
        return AuditRow("loss scaling", f"policy: {kind}", "-", status="note" if note else "ok", note=note)
    name = type(scaler).__name__
    scale: Any = None
    try:
        if hasattr(scaler, "get_scale") and hasattr(scaler, "is_enabled"):
            scale = scaler.get_scale() if scaler.is_enabled() else None
        elif hasattr(scaler, "loss_scale"):
            scale = float(scaler.loss_scale)
    except Exception:  # an uninitialised GradScaler has no scale yet
        scale = None
    disabled = (hasattr(scaler, "is_enabled") and not scaler.is_enabled()) or name == "NoOpScaler"
    note = f"scale {scale:g}" if isinstance(scale, (int, float)) else ""
    status: Status = "ok"
    if needs and disabled:
        status, note = "note", "FP16 compute with loss scaling disabled: small gradients flush to zero"
    return AuditRow("loss scaling", name, "f32", status=status, note=note)


def _comm_rows(model: nn.Module) -> list[AuditRow]:
    rows: list[AuditRow] = []
    tname = type(model).__name__
    if tname == "DistributedDataParallel":
        hooks = [getattr(h, "__qualname__", repr(h)) for h, _ in getattr(model, "_comm_hooks", [])]
        mp = getattr(model, "mixed_precision", None)
        params = [p for p in model.parameters() if p.requires_grad]
        dts = sorted({_name(p.dtype) for p in params})
        if hooks:
            compress = [h for h in hooks if "fp16" in h or "bf16" in h]
            rows.append(AuditRow("communication", "DDP gradient all-reduce", "f16" if any("fp16" in h for h in compress)
                                 else "bf16" if compress else "/".join(dts), status="note" if compress else "ok",
                                 note=f"comm hook {', '.join(hooks)}" + (": gradients are compressed to half precision "
                                                                        "for the all-reduce" if compress else "")))
        else:
            note = ""
            dt = "/".join(dts)
            if mp is not None and getattr(mp, "reduce_dtype", None) is not None:
                dt = _name(mp.reduce_dtype)
                note = "DDP mixed_precision reduce_dtype"
            rows.append(AuditRow("communication", "DDP gradient all-reduce", dt,
                                 status="note" if dt in ("bf16", "f16") else "ok",
                                 note=note or "in the gradients' dtype"))
        return rows
    if tname == "FullyShardedDataParallel":  # FSDP1
        mp = getattr(model, "mixed_precision", None)
        pdt = getattr(mp, "param_dtype", None)
        rdt = getattr(mp, "reduce_dtype", None)
        eff = rdt if rdt is not None else pdt
        rows.append(AuditRow("communication", "FSDP reduce-scatter", _name(eff) if eff is not None else "f32",
                             status="downgrade" if rdt is None and pdt in HALF else "ok",
                             note="reduce_dtype unset: gradients are reduced in param_dtype; set "
                                  "MixedPrecision(reduce_dtype=torch.float32)" if rdt is None and pdt in HALF else ""))
        return rows
    seen = False
    for mname, m in model.named_modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            group = get_state()._fsdp_param_group
        except Exception:
            continue
        if group is None:
            continue
        seen = True
        mp = group.mp_policy
        pdt, rdt = mp.param_dtype, mp.reduce_dtype
        eff = rdt if rdt is not None else pdt
        bad = rdt is None and pdt in HALF
        rows.append(AuditRow(
            "communication", f"FSDP2 reduce-scatter ({mname or 'root'})", _name(eff) if eff is not None else "param dtype",
            status="downgrade" if bad else "ok",
            note="reduce_dtype unset: gradients are reduce-scattered in param_dtype; set "
                 "MixedPrecisionPolicy(reduce_dtype=torch.float32)" if bad else ""))
    if not seen:
        rows.append(AuditRow("communication", "-", "-", note="not distributed (no DDP/FSDP wrapper found)"))
    return rows
