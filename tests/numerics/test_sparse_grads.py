"""Sparse gradients (``nn.Embedding(sparse=True)``) through every numerics tool, against the dense model."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.numerics import Log2Histogram, NumericsMonitor, audit, check, tensor_stats, trace_nonfinite


class Bag(nn.Module):
    """Embedding (sparse or dense, same weights) -> mean over the sequence -> Linear."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.e = nn.Embedding(50, 16, sparse=sparse)
        self.l = nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.l(self.e(ids).mean(1))


IDS = torch.randint(0, 50, (8, 6), generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(1))


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(m(b[0]).float(), b[1])


def _sparse(rows: list[int], values: torch.Tensor, n: int = 4) -> torch.Tensor:
    """An uncoalesced COO gradient as nn.Embedding(sparse=True) makes it: one row per lookup."""
    return torch.sparse_coo_tensor(torch.tensor([rows]), values, (n, values.shape[1]), check_invariants=True)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_stored_values_coalesce_duplicate_rows() -> None:
    from mixprec.numerics._stats import stored_values

    g = _sparse([1, 1, 3], torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
    assert torch.equal(stored_values(g), g.to_dense()[[1, 3]])  # row 1 is the sum of its two lookups
    dense = torch.randn(3, 2)
    assert stored_values(dense) is dense
    csr = dense.to_sparse_csr()
    assert torch.equal(stored_values(csr), csr.values())


def test_tensor_stats_and_histogram_of_a_sparse_gradient_count_its_stored_values() -> None:
    # Row 1's two lookups sum past FP16's maximum (4e4 + 4e4 = 8e4 > 65504); row 3 is tiny (flushes in FP16).
    g = _sparse([1, 1, 3], torch.tensor([[4e4, 1.0], [4e4, 1.0], [1e-9, float("nan")]]))
    values = g.to_dense()[[1, 3]]  # the reference: the rows the gradient holds, summed
    s = tensor_stats(g, "f16")
    assert s == tensor_stats(values, "f16")
    assert (s.numel, s.n_overflow, s.n_underflow, s.n_nonfinite) == (4, 1, 1, 1)
    h, ref = Log2Histogram(), Log2Histogram()
    h.add_(g, scale=2.0)
    ref.add_(values, scale=2.0)
    assert h.summary() == ref.summary()


@pytest.mark.parametrize("policy", ["fp16-mixed", "bf16-mixed", "fp16-master"])
def test_check_compares_a_sparse_gradient_as_the_dense_model_does(policy: str) -> None:
    sparse, dense = check(Bag(True), (IDS, Y), policy, _loss), check(Bag(False), (IDS, Y), policy, _loss)
    assert sparse.verdict == dense.verdict == "pass"
    assert sparse.loss_policy == dense.loss_policy and sparse.loss_fp32 == dense.loss_fp32
    got = {p.name: p for p in sparse.params}
    for p in dense.params:  # the FP32 reference and the policy gradients agree element by element
        assert got[p.name].rel_err == pytest.approx(p.rel_err, rel=1e-6, abs=1e-12)
        assert got[p.name].lost == p.lost and got[p.name].finite
    # and prepare(check_batch=...) runs the same check before training
    model = Bag(True)
    prec = mp.MixedPrecision(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fp16 on a CPU
        prec.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), check_batch=(IDS, Y), loss_fn=_loss)
    assert prec.check_result.verdict == "pass"


class _Up(torch.autograd.Function):
    """Identity forward; the gradient times ``k`` backward."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, k: float) -> torch.Tensor:
        ctx.k = k  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.k, None  # type: ignore[attr-defined]


class Emb(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.e = nn.Embedding(4, 2, sparse=sparse)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.e(ids)


@pytest.mark.parametrize(("k", "policy"), [(2e38, None), (4e4, "fp16-master")])
def test_trace_names_a_sparse_gradient_overflow_as_in_the_dense_model(k: float, policy: str | None) -> None:
    # Row 1 is looked up twice: each lookup's gradient k fits, their sum 2k overflows (FP32 at 2e38, FP16 at 4e4).
    ids = torch.tensor([1, 1, 2])

    def loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return _Up.apply(m(b), k).float().sum()

    sparse, dense = trace_nonfinite(Emb(True), ids, loss, policy), trace_nonfinite(Emb(False), ids, loss, policy)
    for r in (sparse, dense):
        assert (r.found, r.phase, r.module, r.where, r.kind) == (True, "backward", "e", "param_grad", "inf")
        assert r.output_stats[0].n_nonfinite == 2  # row 1, both columns
    assert sparse.output_stats[0].numel == 4 and dense.output_stats[0].numel == 8  # stored rows vs the whole table
    if policy is not None:  # the FP32 re-run of the sparse gradient: finite, 2k, as the dense model's
        assert sparse.fp32_rerun == dense.fp32_rerun
        assert sparse.fp32_rerun is not None and sparse.fp32_rerun.precision_is_cause
        assert sparse.fp32_rerun.absmax == pytest.approx(2 * k)
    # a healthy sparse model traces clean under a policy
    assert not trace_nonfinite(Bag(True), (IDS, Y), _loss, "bf16-master").found


def test_monitor_records_a_sparse_gradient_as_the_fp32_reference_holds_it() -> None:
    model = Bag(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = NumericsMonitor(model, optimizer=opt).attach()
    _loss(model, (IDS, Y)).backward()
    grad = model.e.weight.grad
    assert grad is not None and grad.is_sparse
    ref = grad.coalesce().values().abs().max().item()  # plain torch's FP32 gradient, the rows it holds
    opt.step()
    rep = mon.report()
    p = {q.name: q for q in rep.params}["e.weight"]
    assert p.grad_absmax == pytest.approx(ref)
    assert p.grad_zero == 0.0  # the untouched rows are not stored, so not counted as zeros


def test_monitor_under_a_policy_and_audit_of_stored_sparse_gradients() -> None:
    model = Bag(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prec = mp.MixedPrecision("bf16-mixed")
    model, opt = prec.prepare(model, opt)
    mon = NumericsMonitor(model, optimizer=opt).attach()
    with prec.autocast():
        loss = _loss(model, (IDS, Y))
    prec.backward(loss)
    grad = model.e.weight.grad
    assert grad is not None and grad.is_sparse
    # the audit counts what the sparse gradient stores (values and indices), not the dense table
    row = next(r for r in audit(model, opt, prec).rows if r.component == "gradients")
    dense_params = sum(p.numel() for n, p in model.named_parameters() if n != "e.weight")
    lookups = IDS.numel()
    assert row.elements == lookups * 16 + dense_params
    assert row.bytes == 4 * (lookups * 16 + dense_params) + 8 * lookups
    prec.step(opt)
    assert {q.name for q in mon.report().params} == {"e.weight", "l.weight", "l.bias"}
