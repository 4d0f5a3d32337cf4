"""``param.grad`` of a half-precision parameter whose gradient lives in its FP32 master.

Under master-weight policies the gradient that the optimizer uses is the FP32 master's
``.grad``. Framework and user code does not know that: it calls ``model.zero_grad()``, torch's
``clip_grad_norm_(model.parameters(), ...)``, logs ``p.grad.norm()``. If the model parameter's
``.grad`` were ``None`` (as it was in mixprec 0.1) all of these would silently act on nothing.

So after backward each such parameter's ``.grad`` is a :class:`MasterGradView`: a tensor with
the parameter's dtype and shape and no storage of its own, whose every operation runs on the
master's FP32 gradient:

* autograd's accumulation into ``param.grad`` (``grad += new``) adds into the master gradient
  in FP32: this *is* the FP32 gradient accumulation;
* reads (``norm``, ``clone``, ``abs``, ...) compute on the FP32 master gradient. While the
  gradients still carry a loss scale (FP16 policies, after ``backward`` and before
  ``prec.unscale_``/``prec.clip_grad_norm_``/``prec.step``) a read raises and names the call,
  as the answer would be off by the scale: torch's ``clip_grad_norm_`` reads FP32 island
  gradients before the views, so an unscale triggered by the view would come too late;
* in-place writes (``mul_`` from clipping, ``zero_``, ``clamp_``) change the master gradient;
  edits that commute with the loss scale (``zero_``, ``fill_(0)``, ``masked_fill_(mask, 0)``,
  ``p.grad[mask] = 0``, ``mul_``/``div_`` by a mask or a factor) are allowed before the unscale too;
* ``detach()`` and ``.data`` return another view of the same master gradient (same guard);
  ``numpy()``, ``tolist()``, ``copy.deepcopy`` and pickling (``torch.save``) give the FP32 master
  gradient's, checked the same way;
* a read inside a backward (a gradient hook) is checked too, except under a process group, where
  DDP's reducer reads a ``no_sync()`` micro-batch's accumulated gradient into its bucket;
* ``param.grad = None`` (``model.zero_grad()``) drops the view: the next backward's gradient
  then *replaces* the master gradient instead of adding to it, so clearing the model's
  gradients clears what the next step uses.

Results of out-of-place ops are FP32 tensors (the master gradient's dtype), not the
parameter's dtype: the view never rounds the gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["FROM_VIEW", "MasterGradView", "is_view"]

# A tensor attribute marking a master gradient that FP32 accumulation wrote (set without a Python
# call on the backward path): model.zero_grad() drops the view and makes it stale, while a master
# gradient set directly carries no mark (MasterWeightOptimizer._drop_stale_grads).
FROM_VIEW = "_mixprec_from_view"

_ADD_ = torch.ops.aten.add_.Tensor
_DETACH = torch.ops.aten.detach.default
_aten = torch.ops.aten
# Operations that neither read the gradient's values nor depend on its scale.
_NO_READ = {_aten.zero_.default, _aten.detach_.default, _DETACH, _aten.zeros_like.default, _aten.ones_like.default,
            _aten.empty_like.default, _aten.full_like.default}
# In-place edits that commute with the loss scale, (s * g) op x == s * (g op x), so they are as right
# before the unscale as after it: masking and scaling by a factor (torch.amp's GradScaler allows them
# too). Filling or masking with a value is scale-free only when the value is 0 (_scale_free).
_SCALE_FREE = {_aten.mul_.Tensor, _aten.mul_.Scalar, _aten.div_.Tensor, _aten.div_.Scalar}
_ZERO_FILL = {_aten.fill_.Scalar, _aten.masked_fill_.Scalar}
_INDEX_PUT_ = _aten.index_put_.default


def _scale_free(func: Any, args: Any) -> bool:
    """Whether ``func(*args)`` on a still-scaled view is an in-place edit the loss scale does not change."""
    if func in _SCALE_FREE:
        return isinstance(args[0], MasterGradView) and not isinstance(args[1], MasterGradView)
    if func in _ZERO_FILL:
        value = args[-1]
        return isinstance(args[0], MasterGradView) and isinstance(value, (int, float)) and value == 0
    if func is _INDEX_PUT_:  # p.grad[mask] = 0: a Python 0 arrives as a CPU scalar tensor (read without a sync)
        values, accumulate = args[2], args[3] if len(args) > 3 else False
        return (isinstance(args[0], MasterGradView) and not accumulate and isinstance(values, torch.Tensor)
                and not isinstance(values, MasterGradView) and values.device.type == "cpu" and values.numel() == 1
                and values.item() == 0)
    return False


class MasterGradView(torch.Tensor):
    """The ``.grad`` of a half-precision model parameter: a window on its FP32 master's gradient.

    Args:
        param: The model parameter (dtype, shape and device of the view).
        master: The FP32 master whose ``.grad`` holds the gradient.
        before_read: Called with the operation's name before any operation that reads the
            gradient or depends on its scale (not accumulation, detaching, zeroing, ``fill_(0)``,
            ``masked_fill_(mask, 0)``, ``mul_``/``div_`` by a mask or factor); the run raises there
            while the gradients still carry the loss scale. ``None`` for none.
    """

    _master: torch.Tensor
    _before_read: Callable[[str], None] | None

    @staticmethod
    def __new__(
        cls, param: torch.Tensor, master: torch.Tensor, before_read: Callable[[str], None] | None = None
    ) -> MasterGradView:
        # The parameter's strides (a channels_last weight's): autograd, adding a micro-batch's gradient into the
        # view, otherwise warns that the gradient does not obey the layout contract.
        view = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, strides=param.stride(), dtype=param.dtype, device=param.device, requires_grad=False
        )
        view._master = master
        view._before_read = before_read
        return view

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # the work is in __new__
        super().__init__()

    def __repr__(self) -> str:  # type: ignore[override]  # torch's __repr__ takes tensor_contents=, unused here
        g = self._master.grad
        state = "empty" if g is None else f"norm {float(g.norm()):.4g}"
        return f"MasterGradView(shape={tuple(self.shape)}, {self.dtype} parameter, FP32 master gradient: {state})"

    # Tensor methods that do not dispatch to aten (they need storage): checked, then the master gradient's.
    def _checked(self, op: str) -> torch.Tensor:
        if self._before_read is not None:
            self._before_read(op)
        return self.master_grad()

    def numpy(self, *, force: bool = False) -> Any:
        """The FP32 master gradient as a NumPy array (gradient logging: ``p.grad.detach().cpu().numpy()``)."""
        return self._checked("numpy").numpy(force=force)

    def tolist(self) -> Any:
        """The FP32 master gradient as nested lists."""
        return self._checked("tolist").tolist()

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        """A plain copy of the FP32 master gradient (a copy has no master to be a window on)."""
        return self._checked("deepcopy").clone()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickle (``torch.save(p.grad)``) as the plain FP32 master gradient."""
        return self._checked("pickle").__reduce_ex__(protocol)

    def master_grad(self) -> torch.Tensor:
        """The FP32 master gradient (zeros if it was cleared), as a plain tensor."""
        g = self._master.grad
        if g is None:
            g = self._master.grad = torch.zeros_like(self._master)
        return g

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's stub types the disabled default, not the protocol
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _ADD_ and isinstance(args[0], cls) and not isinstance(args[1], cls):
            # autograd's AccumulateGrad (grad += new): accumulate in FP32, still scaled.
            master, new = args[0]._master, args[1]
            alpha = kwargs.get("alpha", 1)
            if master.grad is None:
                g = master.grad = new.to(master.dtype) if alpha == 1 else new.to(master.dtype).mul_(alpha)
                setattr(g, FROM_VIEW, True)
            else:
                master.grad.add_(new, alpha=alpha)
            return args[0]
        if func is _DETACH and isinstance(args[0], cls):
            # p.grad.detach() and p.grad.data: another window on the same master gradient, so what is
            # read through it is guarded as p.grad is (a plain FP32 tensor here escaped the check).
            return cls(args[0], args[0]._master, args[0]._before_read)
        leaves, _ = tree_flatten((args, kwargs))
        seen: set[int] = set()
        for leaf in leaves if func not in _NO_READ and not _scale_free(func, args) else ():
            if isinstance(leaf, cls) and leaf._before_read is not None and id(leaf._before_read) not in seen:
                seen.add(id(leaf._before_read))
                leaf._before_read(func.overloadpacket.__name__)
        unwrapped = tree_map(_unwrap, args)
        if func is _INDEX_PUT_ and isinstance(args[0], cls) and isinstance(unwrapped[2], torch.Tensor):
            # p.grad[idx] = v: the values come in the parameter's dtype, index_put_ wants the master's
            unwrapped = (*unwrapped[:2], unwrapped[2].to(unwrapped[0].dtype), *unwrapped[3:])
        out = func(*unwrapped, **tree_map(_unwrap, kwargs))
        schema = func._schema
        first = schema.arguments[0] if schema.arguments else None
        if first is not None and first.alias_info is not None and first.alias_info.is_write:
            # In-place on the view: the master gradient changed; return what the caller passed.
            return None if isinstance(args[0], (list, tuple)) else args[0]
        return out


def _unwrap(x: Any) -> Any:
    return x.master_grad() if isinstance(x, MasterGradView) else x


def is_view(t: Any) -> bool:
    """Whether ``t`` is a :class:`MasterGradView`."""
    return isinstance(t, MasterGradView)
