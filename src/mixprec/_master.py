"""FP32 master weights around any ``torch.optim`` optimizer (Micikevicius et al. 2018; Apex O2).

The model keeps its weights in FP16 or BF16. For each such parameter this wrapper holds an
FP32 *master*; the wrapped optimizer's ``param_groups`` hold the masters, so LR schedulers,
per-group options, ``add_param_group`` and weight decay act on FP32 values. After each
applied step the masters are copied back into the model's half-precision parameters.
"""

from __future__ import annotations

import copy
import functools
import operator
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, Literal

import torch
from torch.optim import Optimizer

import mixprec._edit_kernel as _edit_kernel  # its DEVICES read where used (tests widen it)

from ._dist import dtensor_like as _like
from ._dist import is_dtensor as _is_dtensor
from ._dist import local_tensor as _local
from ._dtypes import dtype_name, parse_dtype
from ._errors import check_fused
from ._finite import unscale_and_check_
from ._fused import FUSABLE, FusedShadow
from ._master_grad import FROM_VIEW, MasterGradView
from ._remainder import (
    RemainderBank,
    join_edited,
    join_flat_compilable_,
    placeholder,
    split,
    split_flat_compilable_,
    split_into_,
)
from ._stepping import dense_layout, same_layout, step_or_skip

__all__ = [
    "GradAccumulation",
    "MasterStorage",
    "MasterWeightOptimizer",
    "WeightEdits",
    "check_grad_accumulation",
    "check_weight_edits",
    "model_params_of",
]

GradAccumulation = Literal["fp32", "compute"]
WeightEdits = Literal["values", "versions"]
MasterStorage = Literal["full", "remainder"]
_STATE_VERSION = 1
_WARNED_UNFROZEN = False
_WARNED_ADDED = False  # add_param_group of half parameters: warned once per process


class MasterWeightOptimizer(Optimizer):
    """Keep FP32 master weights for a half-precision model inside any torch optimizer.

    Algorithm (one optimizer step):
        1. Backward produces half-precision gradients. With ``grad_accumulation="fp32"``
           (default) a post-accumulate-grad hook adds each one into its master's FP32 ``.grad``
           and frees it, so micro-batch accumulation happens in FP32 and no half gradient
           buffer persists (Megatron's ``main_grad``). With ``"compute"`` the half gradients
           stay on the model and are upcast into transient FP32 buffers at step time, freed
           after the step (least persistent memory).
        2. The (possibly loss-scaled) FP32 gradients are unscaled and checked for inf/NaN by one
           fused kernel per (device, dtype) group (:meth:`unscale_`).
        3. The wrapped optimizer steps on the masters, skipping on the device when it supports
           ``grad_scale``/``found_inf`` (torch's fused/capturable optimizers, mixprec.optim);
           otherwise one host read of ``found_inf`` decides.
        4. The masters are copied back into the model parameters (``torch._foreach_copy_``);
           after a skipped step this rewrites the same values.

    FP32 parameters (FP32 islands such as norms) are their own masters: they are passed to
    the wrapped optimizer unchanged.

    What code outside the optimizer sees (so no path around it is silent):
        * ``param.grad`` of a half-precision parameter is a :class:`~mixprec._master_grad.MasterGradView`
          of its master's FP32 gradient once there is one: torch's ``clip_grad_norm_`` on the
          model's parameters, ``p.grad.norm()`` and ``model.zero_grad()`` act on the gradient the
          step uses (``model.zero_grad()`` drops the views, and the next backward replaces the
          master gradients instead of adding to them).
        * Edits of the model's half weights outside the step (weight clipping, also through
          ``p.data``; pruning masks, ``nn.Embedding(max_norm=...)``, ``load_state_dict`` on the
          model) are carried into the masters before the next step and in :meth:`state_dict`
          (:meth:`sync_edits_`, no host sync): an edited element takes the model's value, an
          untouched element keeps its exact FP32 master.
        * Parameters with ``requires_grad=False`` get no master (the wrapped optimizer holds the
          half parameter, which it skips without a gradient). When one is unfrozen, its master
          is created at the next step from the half value, with a one-time warning that the
          FP32 digits are gone.

    Args:
        optimizer: A constructed ``torch.optim.Optimizer`` over the model's parameters.
        master_dtype: The masters' dtype (FP32).
        grad_accumulation: ``"fp32"`` or ``"compute"``, see above.
        initial_masters: Optional map from a parameter to the full-precision tensor to use as
            its master (no copy is made). ``MixedPrecision.prepare`` passes the FP32 weights
            from before the model was cast, so the masters start exact rather than rounded.
        weight_edits: ``"values"`` (default) or ``"versions"``: how edits of the model's half
            weights are found, see :meth:`sync_edits_`.
        fused: The fused master-weight step (``torch.compile``): for a wrapped
            ``torch.optim.AdamW``, ``Adam`` or ``SGD``, steps 3-4 (unscale by a handed-in
            ``grad_scale``, the update of masters and states, the skip on ``found_inf``, and the
            copy back into the model) run as one compiled kernel per (device, dtype) bucket,
            skipping on the device (no host sync whatever the wrapped optimizer). The
            arithmetic is ``mixprec.optim``'s FP32 AdamW/SGD on the wrapped optimizer's own
            groups and state (same keys; equal to torch's update to FP32 rounding, not bit for
            bit: torch's CPU kernels fuse multiply-adds). ``True``: on (``ValueError`` for another
            optimizer class); ``False``: the wrapped optimizer's own ``step`` (the eager
            reference); ``None`` (default): on where :meth:`mixprec.optim.AdamW.fused_enabled`
            says it pays off (CUDA/XPU with Triton; on a CPU only once :attr:`prefer_fused` is
            set: ``MixedPrecision`` does not, torch's fused kernel being as fast there; see ``docs/optim.md``).
            ``compile_seconds`` reports the first-step compile time.
        master_storage: ``"full"`` (default): each master is an FP32 tensor of its own.
            ``"remainder"`` (``bf16-master-r16``): a BF16 parameter's master is the parameter
            itself plus an ``int16`` remainder (:mod:`mixprec._remainder`), 2 bytes per element
            instead of 4, and still exact. Inside :meth:`step` each master is joined into an FP32
            tensor (the one the wrapped optimizer holds; between steps its data is a one-element
            NaN placeholder broadcast to the parameter's shape, so the state keyed by it survives), the
            wrapped optimizer (or the fused step) updates it, and it is split again into the weight
            (FP32 rounded with ties away from zero, not to even) and the remainder. What differs
            from ``"full"``: edits of the model's weights outside the step are not compared with
            the masters (:meth:`sync_edits_` does nothing): an edited weight *is* the top half of its
            master, so the master becomes the edited value with the element's old 16 low bits
            (within one BF16 ulp of the edit; an untouched element keeps its exact master).
            :attr:`masters` and :meth:`master_for` give the placeholders (their ``.grad`` is the
            master gradient); :meth:`master_values` and :meth:`state_dict` give the exact FP32
            values. Needs ``master_dtype`` FP32 and BF16 half parameters.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or is already wrapped.
        ValueError: unknown ``grad_accumulation``, ``weight_edits`` or ``master_storage``;
            (at ``step``/``unscale_``) a parameter that was FP32 at the wrap was cast to half since;
            ``fused=True`` for an optimizer other than torch's AdamW, Adam or SGD;
            ``master_storage="remainder"`` with FP16 parameters or non-FP32 masters.

    Host syncs: none in ``step`` when the wrapped optimizer declares
    ``_step_supports_amp_scaling`` or the fused step runs; one (``found_inf`` read) otherwise,
    and only when a ``found_inf`` was handed in.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> fp32 = {p: p.detach().clone() for p in model.parameters()}
        >>> _ = model.half()  # in place: the parameter objects stay, their FP32 values are in fp32
        >>> opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), initial_masters=fp32)
        >>> model(torch.randn(3, 4).half()).float().sum().backward()
        >>> opt.step(); opt.zero_grad()
    """

    _step_supports_amp_scaling = True
    # The half (parameter, master) pairs and the same as two lists, cached off the step path;
    # None: rebuild at the next use (a copy rebuilds its own: __getstate__ drops them).
    _pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    _pair_lists: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    _live = False  # "remainder": the masters hold their joined FP32 values (inside a step)
    _edit_views: EditViews | None = None  # the edit check's cached 1-D views (built at its first use)
    _own32: tuple[torch.Tensor, ...] = ()  # set in __init__; the default reads instances pickled before it existed
    # grad_accumulation="compute": the parameters whose gradients the last step dropped (zero_grad(set_to_none=False)
    # gives them the zero gradient torch would have left).
    _dropped: tuple[tuple[torch.Tensor, torch.Tensor | None], ...] = ()  # (parameter, its zero if sparse)
    master_storage: MasterStorage = "full"  # set in __init__; the default reads instances pickled before it existed
    # How many more of the wrapped optimizer's steps to watch for writes to half weights
    # (_check_inner_step): set whenever the pairs are rebuilt (construction, parameters added or
    # unfrozen), for optimizers that are not torch's own; 0 after a step that moved a master.
    _watch_inner = 0
    # Set by ``EMA.applied()`` while the model holds the averages: carrying them into the masters
    # (a step, ``state_dict()``) would make them the training weights; the message says so.
    _ema_applied: str | None = None

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        master_dtype: torch.dtype | str = torch.float32,
        grad_accumulation: GradAccumulation = "fp32",
        initial_masters: Mapping[torch.Tensor, torch.Tensor] | None = None,
        weight_edits: WeightEdits = "values",
        fused: bool | None = None,
        master_storage: MasterStorage = "full",
    ) -> None:
        check_fused(fused)
        if fused and type(optimizer) not in FUSABLE:
            raise ValueError(
                f"fused=True: the fused master-weight step covers torch.optim.AdamW, Adam and SGD, got "
                f"{type(optimizer).__module__}.{type(optimizer).__qualname__}; use fused=False (its own step)."
            )
        if isinstance(optimizer, MasterWeightOptimizer):
            raise TypeError("this optimizer is already a MasterWeightOptimizer; wrap the plain torch optimizer once.")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"MasterWeightOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
            # ZeRO steps a per-rank optimizer it built over the model's parameters at construction; the
            # wrapper cannot point that one at the masters, so the weights never moved, silently.
            raise TypeError(
                "MasterWeightOptimizer (the '*-master' policies) cannot wrap torch's ZeroRedundancyOptimizer: ZeRO steps "
                "its own per-rank optimizer over the model's parameters, which cannot be pointed at the FP32 masters "
                "(the weights would never change). Use a '*-mixed' policy with ZeRO, FSDP2 (fully_shard) for sharded "
                "FP32 masters, or a plain optimizer under DDP (mixprec.distributed.wrap_ddp)."
            )
        check_grad_accumulation(grad_accumulation)
        check_weight_edits(weight_edits)
        if master_storage not in ("full", "remainder"):
            raise ValueError(
                f"master_storage={master_storage!r}; use 'full' (an FP32 tensor per master) or 'remainder' (the BF16 "
                "weight plus an int16 remainder, exact)."
            )
        if master_storage == "remainder" and parse_dtype(master_dtype) != torch.float32:
            raise ValueError(f"master_storage='remainder' keeps FP32 masters; got master_dtype={master_dtype!r}.")
        # Deliberately not calling Optimizer.__init__: state and param_groups live in the wrapped
        # optimizer. The attributes below are what torch's hooks and LR schedulers look for.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self.optimizer = optimizer
        self.master_dtype = parse_dtype(master_dtype)
        self.grad_accumulation: GradAccumulation = grad_accumulation
        self.weight_edits: WeightEdits = weight_edits
        self.fused: bool | None = fused
        self.master_storage: MasterStorage = master_storage
        # "remainder": model parameter i's int16 remainder, parallel to _model_params (None: no remainder).
        self._rems: list[torch.Tensor | None] = []
        self._rem_list: list[torch.Tensor] = []  # the remainders of the cached pairs, parallel to them
        self._bank: RemainderBank | None = None  # "remainder": the pairs' join and split in O(1) passes (built on first use)
        # FSDP2 shards: id(param) -> its gradient's versions (DTensor's, local tensor's) when taken
        self._grad_versions: dict[int, tuple[int, int]] = {}
        self._shadow: Any = None  # the _fused.FusedShadow that runs the fused step (built on first use)
        self._prefer_fused = False
        self._versions: list[tuple[int, int]] = []  # (version, data_ptr) of each half param after the last copy
        self._initial = dict(initial_masters or {})
        # Parallel lists: model parameter i has master i (the same tensor for FP32 params and for
        # frozen half params, which have no master until they are unfrozen).
        self._model_params: list[torch.Tensor] = []
        self._masters: list[torch.Tensor] = []
        self._hooks: list[Any] = []
        self._views: dict[int, MasterGradView] = {}  # id(model param) -> its .grad view
        self._frozen: list[torch.Tensor] = []  # half params adopted while frozen (no master yet)
        self._own32: tuple[torch.Tensor, ...] = ()  # params of the master dtype at adoption (their own masters)
        self._before_read: Callable[[str], None] | None = None
        try:
            for group in optimizer.param_groups:
                group["params"] = [self._adopt(p) for p in group["params"]]
        except BaseException:
            self.remove_hooks()  # the parameters adopted before the failure were hooked
            raise
        _realias_params(optimizer, {id(p): m for p, m in zip(self._model_params, self._masters) if p is not m})
        self._refresh_pairs()
        self._initial.clear()
        self._rekey_state()
        from ._stepping import install_step_guard

        # The wrapped optimizer steps the masters only from inside step(): called directly it would
        # apply gradients that may still be loss-scaled and never copy the masters back.
        self._inner_guard = install_step_guard(optimizer, "refuse")

    # ----- copies ---------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Everything (torch's ``Optimizer.__getstate__`` keeps three keys, which lost the masters).

        Left out, and rebuilt by ``__setstate__`` or the owner: gradient hooks and views (a copied
        parameter has no hooks), the fused step's compiled view, the unscale callback and step
        guards (a ``MixedPrecision`` run re-installs its own on its copy).
        """
        d = self.__dict__.copy()
        for key in ("step", "_mixprec_step_guard"):  # a MixedPrecision run's routing guard
            d.pop(key, None)
        d.update(_before_read=None, _shadow=None, _hooks=[], _views={}, _inner_guard=None, _pairs=None, _pair_lists=([], []),
                 _rem_list=[], _bank=None, _edit_views=None)
        # pickle drops a tensor's .grad (deepcopy keeps it): pending master gradients travel beside their masters
        d["_pending_master_grads"] = [(m, m.grad) for m in self._masters if m.grad is not None]
        return d

    def __setstate__(self, state: dict[str, Any]) -> None:
        for m, g in state.pop("_pending_master_grads", ()):
            if m.grad is None:
                m.grad = g
        self.__dict__.update(state)
        # A copied parameter has no gradient and no hooks (torch copies neither); a copied master
        # keeps its gradient, which the parameter's view shows again, as in the original.
        for p, m in self._half_pairs():
            self._attach(p, m)
            if self.grad_accumulation == "fp32" and m.grad is not None and id(p) in self._views:
                p.grad = self._views[id(p)]
        from ._stepping import install_step_guard

        self._inner_guard = install_step_guard(self.optimizer, "refuse")

    # ----- setup ----------------------------------------------------------------------------
    def _adopt(self, p: torch.Tensor) -> torch.Tensor:
        """Register ``p`` and return the tensor the wrapped optimizer should hold for it."""
        if any(p is q for q in self._model_params):
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} appears twice in the optimizer's param groups (a tied weight "
                "listed again?); torch only warns, but its FP32 master would be stepped twice: list each parameter once "
                "(model.parameters() yields a tied one once)."
            )
        self._pairs = None
        # A float64 parameter (a learned temperature) is its own master too: an FP32 master would round its updates.
        if not p.dtype.is_floating_point or p.dtype == self.master_dtype or p.dtype == torch.float64:
            self._model_params.append(p)
            self._masters.append(p)
            self._rems.append(None)
            if p.dtype == self.master_dtype:
                self._own32 = (*self._own32, p)
            return p
        if not p.requires_grad:
            # Frozen: no master (no memory) until unfrozen; the optimizer skips it without a gradient.
            self._model_params.append(p)
            self._masters.append(p)
            self._rems.append(None)
            self._frozen.append(p)
            return p
        src = self._initial.get(p)
        if src is not None:
            if src.shape != p.shape:
                raise ValueError(f"initial master of shape {tuple(src.shape)} for a parameter of shape {tuple(p.shape)}.")
            # No copy when the given tensor already has the right dtype and device.
            master = src.detach().to(device=p.device, dtype=self.master_dtype)
            if not dense_layout(master):  # a slice of a larger tensor: elementwise kernels need a whole one
                master = master.contiguous()
        else:
            master = p.detach().to(self.master_dtype).clone()
        rem = None
        if self.master_storage == "remainder":
            master, rem = self._to_remainder(p, master)
        master.requires_grad_(False)
        self._model_params.append(p)
        self._masters.append(master)
        self._rems.append(rem)
        self._attach(p, master)
        return master

    @staticmethod
    def _to_remainder(p: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Split the FP32 ``value`` into ``p`` (its BF16 top half, written in place) and a remainder.

        Returns:
            ``(master, remainder)``: the placeholder master the wrapped optimizer holds, and the ``int16`` remainder.
        """
        if p.dtype != torch.bfloat16:
            raise ValueError(
                f"master_storage='remainder' stores a master as its BF16 weight plus 16 bits, but a parameter of shape "
                f"{tuple(p.shape)} is {dtype_name(p.dtype)}; use master_storage='full' (bf16-master, fp16-master) for "
                "non-BF16 parameters."
            )
        with torch.no_grad():
            hi, lo = split(_local(value.detach()).contiguous())
            _local(p).copy_(hi)
        if _is_dtensor(p):
            # An FSDP2 shard: the master is a DTensor over the same mesh whose local tensor is swapped in the step.
            return _like(p, placeholder(_local(p))), lo
        master = torch.empty(0, dtype=torch.float32, device=p.device)
        master.data = placeholder(p)
        return master, lo

    def _attach(self, p: torch.Tensor, master: torch.Tensor) -> None:
        """Give ``p`` its gradient view and (FP32 accumulation) the hook that feeds the master.

        An FSDP2 shard (a DTensor, ``bf16-master-r16`` with ``grad_accumulation="compute"``) gets
        neither: FSDP2 accumulates into its own DTensor gradient, which stays on the parameter.
        """
        if _is_dtensor(p):
            return
        # (through a weak reference: the view is the parameter's .grad, which the garbage collector
        # cannot see through, so a bound method here kept every master-weight run alive for good)
        view = MasterGradView(p, master, _ReadHook(self))
        self._views[id(p)] = view
        if self.grad_accumulation == "fp32":
            self._hooks.append(p.register_post_accumulate_grad_hook(_AccumulateInto(master, view, p)))

    def _rekey_state(self) -> None:
        """Move state the wrapped optimizer already holds (a loaded checkpoint, earlier steps) to the masters.

        Its state is keyed by tensor: state kept under a model parameter that now has a master would
        be orphaned (never stepped, and ``state_dict()`` could not name it). Floating state tensors
        take the master dtype, as ``Optimizer.load_state_dict`` would give them.
        """
        state = self.optimizer.state
        for p, m in self._half_pairs():
            st = state.pop(p, None)
            if st is None:
                continue
            state[m] = {k: v.to(self.master_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step"
                        else v for k, v in st.items()}

    def grad_view(self, param: torch.Tensor) -> MasterGradView:
        """The ``.grad`` view of a half-precision model parameter (see :class:`MasterGradView`).

        Raises:
            KeyError: ``param`` has no master (an FP32 or frozen parameter) or is not managed here.
        """
        return self._views[id(param)]

    def set_unscale_callback(self, callback: Callable[[str], None] | None) -> None:
        """Called with the operation's name before torch code reads a gradient view (``MixedPrecision`` checks the scale there)."""
        self._before_read = callback

    def _promote_unfrozen(self, warn: bool = True) -> None:
        """Create the masters of parameters that were frozen at adoption and are trainable now.

        Args:
            warn: Warn (once per process) that such masters start from the rounded weights; off
                when a checkpoint's masters are loaded into them next.
        """
        thawed = [p for p in self._frozen if p.requires_grad]
        if not thawed:
            return
        global _WARNED_UNFROZEN
        if warn and not _WARNED_UNFROZEN:
            _WARNED_UNFROZEN = True
            warnings.warn(
                f"{len(thawed)} parameter(s) frozen when the optimizer was prepared are trainable now; their FP32 "
                "masters start from the half-precision weights (the FP32 digits were not kept for frozen parameters). "
                "Unfreeze before prepare() to keep them exact.",
                UserWarning,
                stacklevel=4,
            )
        for p in thawed:
            self._frozen = [q for q in self._frozen if q is not p]
            master = p.detach().to(self.master_dtype).clone()
            i = next(k for k, q in enumerate(self._model_params) if q is p)
            if self.master_storage == "remainder":
                master, self._rems[i] = self._to_remainder(p, master)  # remainder 0: the master is the BF16 weight
            self._masters[i] = master
            self._refresh_pairs()
            for group in self.optimizer.param_groups:
                group["params"] = [master if q is p else q for q in group["params"]]
            _realias_params(self.optimizer, {id(p): master})
            self._attach(p, master)
            if p.grad is not None and not isinstance(p.grad, MasterGradView):
                # gradients from before the hook existed
                master.grad = p.grad.to(self.master_dtype, memory_format=grad_format(master, p, p.grad))
                p.grad = self._views[id(p)] if self.grad_accumulation == "fp32" and id(p) in self._views else p.grad

    # ----- edits of the model's weights outside the step ----------------------------------------
    def _half_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, master) of every parameter with a master of its own (cached: the step reads it)."""
        if self._pairs is None:
            self._refresh_pairs()
        return self._pairs  # type: ignore[return-value]  # set by _refresh_pairs

    def _refresh_pairs(self) -> None:
        """Rebuild the cached pairs and :attr:`_pair_lists` (after parameters were adopted or unfrozen)."""
        bank = self.__dict__.get("_bank")
        if bank is not None:
            bank.split()  # (a no-op outside a step) the masters go back to their placeholders before the bank goes
            self._bank = None
        pairs = self._pairs = [(p, m) for p, m in zip(self._model_params, self._masters) if p is not m]
        self._watch_inner = _inner_watch_steps(self.optimizer)  # new pairs: watch the wrapped optimizer's next steps
        self._pair_lists = ([p for p, _ in pairs], [m for _, m in pairs])
        self._rem_list = [r for r in self._rems if r is not None]  # parallel to the pairs ("remainder" only)
        if self._shadow is not None:
            # The fused step writes each master's new value into its mirror (and remainder): masters adopted
            # later (add_param_group, unfreezing) need theirs too, or their model weights would never move.
            mirrors, remainders = self._shadow_maps()
            self._shadow.mirrors.update(mirrors)
            self._shadow.remainders.update(remainders)

    def _record_versions(self) -> None:
        """Remember each half parameter's (version, storage) after a copy (``weight_edits="versions"`` reads them)."""
        self._versions = [(p._version, p.data_ptr()) for p, _ in self._half_pairs()]

    @torch.no_grad()
    def sync_edits_(self) -> None:
        """Carry edits of the model's half weights made outside the step into the masters.

        Algorithm: after each step the model holds ``round(master)`` exactly, so for an edited
        half parameter ``master = where(param == round(master), master, param)``: elements
        nobody touched keep their exact FP32 value, edited ones take the model's. Which
        parameters are compared depends on :attr:`weight_edits`:

        * ``"values"`` (default): all of them. The common idioms ``p.data.clamp_(...)`` (WGAN)
          and ``p.data.mul_(mask)`` (pruning) edit through ``.data``, which has a version counter
          of its own, so only comparing the values sees them. Cost: on CUDA with Triton one
          kernel per (device, weight dtype) group reading 6 bytes per element
          (:mod:`mixprec._edit_kernel`; its first use per process compiles it and checks it, one
          host sync); elsewhere six flat ops (three foreach copies, a cast, a comparison and a
          ``where``) per (device, dtype) group and 32M elements, whatever the number of parameters
          (:func:`carry_edits_`; about 48 bytes of memory traffic per element).
        * ``"versions"``: those whose version counter or storage changed since the last copy
          (in-place ops on the parameter itself: ``torch.no_grad()`` edits,
          ``nn.Embedding(max_norm=...)``, ``load_state_dict``). Free when nothing changed;
          edits through ``.data`` are not seen.

        With ``master_storage="remainder"`` there is nothing to carry: the weight is the master's
        top half, so an edit is already in the master (with the element's old low 16 bits).

        No host sync in either mode (but the Triton kernel's one-time first-use check).
        """
        self._sync_edits()

    def _sync_edits(self) -> None:
        """:meth:`sync_edits_` without its ``no_grad`` decorator (the step runs with grad mode off)."""
        if self._ema_applied is not None:
            raise RuntimeError(f"{type(self).__name__} step()/state_dict() {self._ema_applied}")
        if self.master_storage == "remainder":
            return
        if self._pairs is None:
            self._refresh_pairs()
        if self.weight_edits == "versions":
            if len(self._half_pairs()) == len(self._versions):
                pairs = [(p, m) for (p, m), v in zip(self._half_pairs(), self._versions)
                         if (p._version, p.data_ptr()) != v]
            else:
                pairs = self._half_pairs()
            if pairs:
                _carry_edits([m for _, m in pairs], [p for p, _ in pairs])
            self._record_versions()
        else:
            params, masters = self._pair_lists
            if params:
                if self._edit_views is None:
                    self._edit_views = EditViews()
                _carry_edits(masters, params, self._edit_views)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group: its half-precision parameters get FP32 masters (taken from their current values).

        Their FP32 digits are gone by then (the model was cast without them): a one-time warning
        says so. Keep them exact by putting the parameters in the optimizer before ``prepare``
        (with ``lr=0`` until they should train), or by adding them while still FP32.
        """
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        check = self.__dict__.get("_added_check")  # set by MixedPrecision.prepare: parameters it cast
        if check is not None:
            check(params)
        rounded = [p for p in params if isinstance(p, torch.Tensor) and p.dtype.is_floating_point
                   and p.dtype != self.master_dtype and p.requires_grad and p not in self._initial]
        global _WARNED_ADDED
        if rounded and not _WARNED_ADDED:
            _WARNED_ADDED = True
            warnings.warn(
                f"add_param_group: {len(rounded)} {dtype_name(rounded[0].dtype)} parameter(s) get FP32 masters from "
                "their half-precision values (the FP32 digits were not kept for parameters outside the optimizer at "
                "prepare()). To keep them exact, put them in the optimizer before prepare(), e.g. in a group with "
                "lr=0 until they should train.",
                UserWarning,
                stacklevel=2,
            )
        group = dict(param_group)
        group["params"] = params
        n_before = len(self.optimizer.param_groups)
        self.optimizer.add_param_group(group)
        new = self.optimizer.param_groups[n_before]
        added = list(new["params"])
        new["params"] = [self._adopt(p) for p in added]
        # the inner optimizer's own lists took the half parameters (its add_param_group, or the user's append)
        _realias_params(self.optimizer, {id(p): m for p, m in zip(added, new["params"]) if p is not m})
        self._refresh_pairs()

    # ----- the optimizer surface ---------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's groups; their ``params`` are the masters."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-master state, also looked up by model parameter.

        ``opt.state[p]`` for a half model parameter ``p`` is its master's entry (torch-style
        logging loops over ``model.parameters()``): the state is keyed by the masters, and a
        lookup by the model parameter found nothing and left an empty entry behind that broke
        every later ``state_dict()``.
        """
        return _StateByParam(self)

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value._mwo.optimizer.state if isinstance(value, _StateByParam) else value

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's defaults."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def masters(self) -> list[torch.Tensor]:
        """The master tensors, in param-group order (FP32 parameters are their own masters).

        Their ``.grad`` is the FP32 gradient the step uses (clip it, read it). With
        ``master_storage="remainder"`` the values of BF16 parameters' masters exist only inside
        :meth:`step`: between steps these tensors read as NaN and refuse in-place writes (a
        one-element placeholder, see the class); :meth:`master_values` gives the exact values.
        """
        return list(self._masters)

    @torch.no_grad()
    def master_values(self) -> list[torch.Tensor]:
        """The masters' exact FP32 values, parallel to :attr:`masters`.

        Under ``"full"`` the masters themselves; under ``"remainder"`` new tensors joined from
        each weight and its remainder (no gradient; FP32 parameters are themselves).
        """
        self._sync_edits()
        return self._joined()

    @property
    def remainders(self) -> list[torch.Tensor | None]:
        """The ``int16`` remainders, parallel to :attr:`model_params` (``None`` without one; all ``None`` under ``"full"``)."""
        return list(self._rems)

    def _joined(self) -> list[torch.Tensor]:
        """Every master's FP32 value: joined from weight and remainder where there is one, else the tensor itself."""
        return [m if r is None else _like(p, join_edited(_local(p.detach()), r))
                for p, m, r in zip(self._model_params, self._masters, self._rems)]

    @property
    def model_params(self) -> list[torch.Tensor]:
        """The model's parameters, parallel to :attr:`masters`."""
        return list(self._model_params)

    def master_for(self, param: torch.Tensor) -> torch.Tensor:
        """Return the master of a model parameter (under ``"remainder"`` its placeholder: see :attr:`masters`).

        Raises:
            KeyError: ``param`` is not managed by this optimizer.
        """
        for p, m in zip(self._model_params, self._masters):
            if p is param:
                return m
        raise KeyError("this parameter is not in the optimizer")

    def __repr__(self) -> str:
        n_half = sum(1 for p, m in zip(self._model_params, self._masters) if p is not m)
        return (
            f"MasterWeightOptimizer({type(self.optimizer).__name__}, masters={dtype_name(self.master_dtype)}, "
            f"{n_half} half-precision params with masters, grad_accumulation={self.grad_accumulation!r}"
            + (", master_storage='remainder')" if self.master_storage == "remainder" else ")")
        )

    # ----- gradients ---------------------------------------------------------------------------
    def master_grads(self) -> list[torch.Tensor]:
        """Return the FP32 gradients the optimizer will use, materialising them if needed.

        With ``grad_accumulation="compute"`` this upcasts the model's half gradients into fresh
        FP32 buffers (one ``_foreach_copy_`` per dtype group) and frees the half ones. Call it
        once per step (``unscale_`` and ``step`` do).
        """
        if self._frozen:
            self._promote_unfrozen()
        if self._own32 and set(map(_DTYPE, self._own32)) != {self.master_dtype}:
            self._refuse_cast_after_wrap()
        if self.grad_accumulation == "compute":
            pending = [(p, m) for p, m in self._half_pairs() if p.grad is not None and not isinstance(p.grad, MasterGradView)]
            if pending and id(pending[0][0]) not in self._views:
                self._shard_grads(pending)
            elif pending:
                for p, m in pending:
                    if p.shape != m.shape:
                        raise RuntimeError(reshaped_message(p.shape, m.shape))
                # In the layout of the master the step reads (the fused kernels pair elements in memory order): m's
                # own, or for a placeholder (a broadcast NaN: zero strides) the weight's, which its join takes.
                grads = [p.grad for p, _ in pending if p.grad is not None]
                dense = [i for i, g in enumerate(grads) if g.layout is _STRIDED]
                bufs = [g.to(m.dtype) if g.layout is not _STRIDED  # a sparse gradient stays sparse, in FP32
                        else torch.empty_like(g, dtype=m.dtype) if 0 in m.stride() else torch.empty_like(m)
                        for g, (_, m) in zip(grads, pending)]
                if len(dense) == len(grads):
                    torch._foreach_copy_(bufs, grads)
                elif dense:
                    torch._foreach_copy_([bufs[i] for i in dense], [grads[i] for i in dense])
                for (p, m), b in zip(pending, bufs):
                    # A plain half gradient means the view was dropped since the last gather (p.grad = None:
                    # zero_grad, or model.zero_grad() inside a closure): it replaces the master gradient, which
                    # is stale, rather than adding to it (as _AccumulateInto does for "fp32").
                    setattr(b, FROM_VIEW, True)
                    m.grad = b
                    p.grad = self._views[id(p)]  # torch code reading p.grad now sees the FP32 gradient
            if _NONE_TYPE in set(map(type, map(_GRAD, self._pair_lists[0]))):
                self._drop_stale_grads()  # a view dropped after the gather (p.grad = None after unscale_)
        elif self._hooks:
            kinds = set(map(type, map(_GRAD, self._pair_lists[0])))  # C loops: no Python call per tensor
            if not _ONLY_VIEWS.issuperset(kinds):
                # The hooks moved every half gradient into its master and left the view, so something
                # assigned .grad afterwards: user code (p.grad = g from torch.autograd.grad, p.grad =
                # torch.zeros_like(p)), or DDP's reducer, which reduced the gradient the hook had taken.
                self._refuse_reducer_writes()
                self._take_plain_grads()
            if _NONE_TYPE in kinds:
                self._drop_stale_grads()
        elif self.grad_accumulation == "fp32":
            # mixprec.distributed.wrap_ddp owns the accumulation and shows each reduced master gradient's view
            # at the end of backward (in place of DDP's half copy). Anything else in p.grad now is the user's:
            # None (p.grad = None, model.zero_grad()) drops the master gradient, a plain tensor replaces it.
            for p, m in self._half_pairs():
                if p.grad is None and m.grad is not None:
                    m.grad = None
            self._take_plain_grads()
        return [*filter(_NOT_NONE, map(_GRAD, self._masters))]  # C loops: no Python call per tensor

    def _refuse_cast_after_wrap(self) -> None:
        """Raise: a parameter that was its own (FP32) master was cast to half precision after the wrap.

        Its FP32 digits are gone and the wrapped optimizer would step the half weight itself
        (plain half-precision training, silently); with a loss scaler its scaled gradients would
        also overflow.
        """
        cast = [p for p in self._own32 if p.dtype != self.master_dtype]
        raise ValueError(
            f"{len(cast)} parameter(s) were {dtype_name(self.master_dtype)} when MasterWeightOptimizer wrapped the "
            f"optimizer (so they were their own masters) and are {dtype_name(cast[0].dtype)} now (first has shape "
            f"{tuple(cast[0].shape)}): the model was cast after the wrap, so there are no FP32 masters for them. Cast the "
            "model first and wrap an optimizer built on its half parameters, passing the FP32 weights as "
            "initial_masters={param: fp32_tensor} to keep their digits (MixedPrecision.prepare does all of this)."
        )

    def _refuse_reducer_writes(self) -> None:
        """Raise when a plain gradient after the FP32 accumulation hooks is DDP's reducer's, not the user's.

        Under ``torch.distributed`` with more than one process such a gradient is almost surely DDP's
        reducer writing the reduced gradient of the last micro-batch only (the masters hold the
        local sums of earlier ones); outside it, the user assigned ``p.grad`` (:meth:`_take_plain_grads`).

        Raises:
            ValueError: a process group of more than one rank runs.
        """
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                "a half-precision parameter received a gradient after it was accumulated into its FP32 master; this "
                "happens when the model is wrapped in DistributedDataParallel directly (or when code assigns p.grad "
                "after backward). Wrap the model with mixprec.distributed.wrap_ddp(prec, model) instead (it reduces "
                "before accumulating), or use grad_accumulation='compute'; to change a gradient, write into it in "
                "place (p.grad.copy_(g), p.grad.zero_())."
            )

    def _take_plain_grads(self) -> None:
        """Take a half gradient assigned to ``param.grad`` after backward as the master's new gradient.

        As in torch, assigning ``p.grad`` sets the gradient the step uses: its FP32 copy replaces the
        master's gradient (loss-scaled or not, as the gradient it replaces; marked, as the
        accumulation's are) and ``p.grad`` shows the view again.
        """
        with torch.no_grad():
            for p, m in self._half_pairs():
                g = p.grad
                if g is not None and not isinstance(g, MasterGradView) and id(p) in self._views:
                    g32 = m.grad = g.to(m.dtype, copy=True, memory_format=grad_format(m, p, g))
                    setattr(g32, FROM_VIEW, True)
                    p.grad = self._views[id(p)]

    def _drop_stale_grads(self) -> None:
        """Drop a master gradient whose view was dropped (``model.zero_grad()``) and that no backward has refilled.

        ``param.grad = None`` drops the view but leaves the master's gradient: the next backward
        replaces it (:class:`_AccumulateInto`), but a parameter that gets no gradient in that
        backward would be stepped with the old one, where torch skips a parameter without a
        gradient. Only a gradient the accumulation wrote is dropped (it carries the ``FROM_VIEW`` mark): a
        master gradient set directly (``opt.masters[i].grad = g``) stays.
        """
        for p, m in self._half_pairs():
            g = m.grad
            if p.grad is None and g is not None and g.__dict__.get(FROM_VIEW):
                m.grad = None

    def _shard_grads(self, pending: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """FSDP2 shards (``bf16-master-r16``): each master's FP32 gradient from its shard's BF16 one, once per step.

        The BF16 gradient stays on the parameter (FSDP2 accumulates into it, ``zero_grad`` clears
        it); its version is remembered, so a change after this point (clipping ``p.grad`` after
        ``prec.unscale_``) is refused in :meth:`step` rather than silently not seen.
        """
        for p, m in pending:
            g = p.grad
            if g is None or m.grad is not None:
                continue
            m.grad = g.to(self.master_dtype)
            self._grad_versions[id(p)] = _grad_version(g)

    def _check_shard_grads(self) -> None:
        """Raise when a shard's BF16 gradient changed after its FP32 master gradient was taken (see :meth:`_shard_grads`)."""
        for p, m in self._half_pairs():
            v = self._grad_versions.get(id(p))
            if v is not None and (p.grad is None or _grad_version(p.grad) != v) and m.grad is not None:
                raise ValueError(
                    "a gradient of an FSDP2-sharded parameter changed after mixprec took its FP32 master gradient "
                    "(prec.unscale_ or prec.clip_grad_norm_ ran first); under 'bf16-master-r16' with FSDP2 the step uses "
                    "that FP32 copy. Clip with prec.clip_grad_norm_(optimizer, max_norm), or edit p.grad before calling "
                    "prec.unscale_."
                )
        self._grad_versions.clear()

    def unscale_(self, inv_scale: torch.Tensor | None, found_inf: torch.Tensor | None = None) -> torch.Tensor:
        """Unscale the master gradients in place and check them for inf/NaN.

        One fused ``torch._amp_foreach_non_finite_check_and_unscale_`` call per (device, dtype)
        group (through :func:`mixprec._finite.unscale_and_check_`).

        Args:
            inv_scale: 0-d FP32 tensor ``1/scale``, or ``None`` to check only.
            found_inf: Optional 0-d FP32 tensor to accumulate into.

        Returns:
            ``found_inf``: 0-d FP32 tensor, 1.0 if any gradient is not finite. No host sync.
        """
        return unscale_and_check_(self.master_grads(), inv_scale, found_inf)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the masters' gradients and any gradient left on the model's parameters.

        ``set_to_none=False`` under ``grad_accumulation="compute"``: a parameter whose gradient the
        last step dropped (to keep 2 bytes per parameter between steps) gets a zero gradient in its
        own dtype, the one torch would have left, so a parameter that the next backward does not
        reach is still stepped (momentum, weight decay) as torch steps it.
        """
        if self._dropped:
            if not set_to_none:
                for p, sparse_zero in self._dropped:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p) if sparse_zero is None else sparse_zero
            self._dropped = ()
        for t in (*self._masters, *self._model_params):
            if t.grad is not None:
                if set_to_none:
                    t.grad = None
                elif not isinstance(t.grad, MasterGradView):  # a view is zeroed with its master
                    # as torch.optim.Optimizer.zero_grad: a gradient that is a view (of a DDP bucket,
                    # of wrap_ddp's reduced buffer) cannot be detached in place
                    if t.grad.grad_fn is not None:
                        t.grad.detach_()
                    else:
                        t.grad.requires_grad_(False)
                    t.grad.zero_()

    # ----- step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def copy_to_model_(self) -> None:
        """Copy every master into its model parameter (rounding to the parameter's dtype)."""
        self._copy_to_model()

    def _copy_to_model(self) -> None:
        if self._pairs is None:
            self._refresh_pairs()
        params, masters = self._pair_lists
        if self.master_storage == "remainder":
            self._split_masters()
        elif params:
            torch._foreach_copy_(params, masters)  # one foreach op: the copy-back of every weight
        if self.weight_edits == "versions":
            self._record_versions()

    def _remainders_compiled(self, view: Any) -> bool:
        """Whether join and split run compiled (:func:`_compiled_remainder_fns`).

        Beside the fused (compiled) step (``view``, :meth:`_fused_shadow`'s, is not ``None``), and on
        CUDA/XPU with Triton unless ``fused=False``: eagerly they are several elementwise kernels per
        pass (on a CPU the compiled forms were faster, ``benchmarks/remainder_cost.py``, but cost a
        compile of about 3 s, which a run with an eager step does not pay).
        """
        if self.fused is False:
            return False
        if torch._C._len_torch_dispatch_stack() and not torch.compiler.is_compiling():  # (cheap test first: hot path)
            return False  # a TorchDispatchMode is active: nothing compiles under it (optim._parts._compile_blocked)
        if view is not None:
            return True
        if self._pairs is None:
            self._refresh_pairs()
        masters = self._pair_lists[1]
        if not masters or masters[0].device.type not in ("cuda", "xpu"):
            return False
        if masters[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False  # a first compile would invalidate a CUDA graph capture: the exact eager passes are captured
        from torch.utils._triton import has_triton

        return bool(has_triton())

    def _join_masters(self, compiled: bool = False) -> None:
        """``"remainder"``: give each placeholder master its exact FP32 value (joined from weight and remainder).

        Args:
            compiled: join through :func:`_compiled_remainder_fns` (contiguous weights; others eagerly).
        """
        if self._live:
            return
        if self._pairs is None:
            self._refresh_pairs()
        bank = self._bank
        if bank is None or list(map(_DATA_PTR, bank.params)) != bank.ptrs:  # RemainderBank.valid(), inline (hot path)
            bank = self._remainder_bank()
        if bank is not None:
            bank.join(_compiled_remainder_fns()[2] if compiled else None)
            self._live = True
            return
        params, masters = self._pair_lists
        join_fn = _compiled_remainder_fns()[0] if compiled else None
        for p, m, r in zip(params, masters, self._rem_list):
            w = _local(p)
            if join_fn is not None and w.is_contiguous():
                _set_local(m, join_fn(w.view(-1), r.view(-1)).view(w.shape))
            else:
                _set_local(m, join_edited(w, r))
        self._live = True

    def _remainder_bank(self) -> RemainderBank | None:
        """Build the pairs' :class:`~mixprec._remainder.RemainderBank` (none yet, or a weight was replaced: ``p.data = ...``).

        ``None`` where the pairs cannot share one: FSDP2 shards (DTensors), a non-contiguous
        weight, weights on several devices; those join and split one tensor at a time. Building
        moves the remainders into the bank's flat buffer (:attr:`remainders` then are views of it).
        """
        self._bank = None
        params, masters = self._pair_lists
        if not params or any(_is_dtensor(p) or not p.is_contiguous() or p.device != params[0].device for p in params):
            return None
        bank = self._bank = RemainderBank(params, masters, self._rem_list)
        it = iter(bank.remainders)
        self._rems = [r if r is None else next(it) for r in self._rems]
        self._rem_list = list(bank.remainders)
        if self._shadow is not None and self._shadow.remainders:
            self._shadow.remainders.update(self._shadow_maps()[1])  # the kernel writes the new remainders
        return bank

    def _split_masters(self, compiled: bool = False) -> None:
        """``"remainder"``: split each joined master into its weight and remainder, then drop its FP32 storage.

        Without joined masters (a copy-back outside a step: the weights and remainders already
        hold the masters) nothing happens.
        """
        if not self._live:
            return
        bank = self._bank
        if bank is not None and bank.live:
            bank.split(_compiled_remainder_fns()[3] if compiled else None)
            self._live = False
            return
        params, masters = self._pair_lists
        split_fn = _compiled_remainder_fns()[1] if compiled else None
        for p, m, r in zip(params, masters, self._rem_list):
            w, v = _local(p), _local(m)
            if split_fn is not None and w.is_contiguous() and v.is_contiguous():
                split_fn(v.view(-1), w.view(-1), r.view(-1))
            else:
                split_into_(v, w, r)
            _set_local(m, placeholder(w))
        self._live = False

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Step the wrapped optimizer on the masters, then copy the masters back.

        Honours ``self.grad_scale`` / ``self.found_inf`` set by a gradient scaler (the
        ``_step_supports_amp_scaling`` protocol of ``torch.amp.GradScaler`` and
        ``mixprec.GradScaler``): when the wrapped optimizer supports them they are passed on
        and nothing syncs; otherwise a given ``grad_scale`` is applied here by a fused unscale
        and one host read of ``found_inf`` decides whether to step. Step hooks registered on this
        optimizer (``register_step_pre_hook``/``register_step_post_hook``) run around it, as torch's
        optimizers run theirs (a skipped step included: it is a step call).

        Args:
            closure: Re-evaluates the model and returns the loss (passed to the wrapped optimizer).

        Returns:
            What the wrapped optimizer's ``step`` returns (``None`` when skipped).
        """
        if self._optimizer_step_pre_hooks:
            closure = self._run_pre_hooks(closure)
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and not isinstance(found_inf, torch.Tensor):
            # torch.amp.GradScaler hands sum([]) == 0 when it found no gradient in param_groups to check
            raise ValueError(
                f"step(): the gradient scaler handed found_inf={found_inf!r}, not a tensor: it checked no gradient. "
                + ("With grad_accumulation='compute' the FP32 master gradients exist only once materialised (in "
                   "step(), or master_grads()), so torch.amp.GradScaler's unscale_ sees none: use "
                   "grad_accumulation='fp32', mixprec.GradScaler (which materialises them), or MixedPrecision."
                   if self.grad_accumulation == "compute" else "Call backward on the scaled loss before step().")
            )
        self.master_grads()  # again after an unscale: p.grad may have been assigned or dropped since
        if self._grad_versions:
            self._check_shard_grads()
        if closure is not None:
            closure = self._master_closure(closure)
        args = (closure,) if closure is not None else ()
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # torch.no_grad() without its context manager's Python calls (hot path)
        try:
            result = self._step(args, grad_scale, found_inf)
        finally:
            torch._C._set_grad_enabled(grad_mode)
        if self.grad_accumulation == "compute":
            # The FP32 gradient buffers were transient: drop them so only the half gradients'
            # 2 bytes per parameter persist between steps (16 B/param with AdamW, not 20).
            dropped = []
            for p, m in self._half_pairs():
                if m.grad is not None:
                    # a sparse gradient's zero is sparse (nothing stored), as torch's zero_() of it
                    dropped.append((p, None if m.grad.layout is _STRIDED else torch.zeros_like(m.grad, dtype=p.dtype)))
                m.grad = None
                if isinstance(p.grad, MasterGradView) or id(p) not in self._views:  # (no view: an FSDP2 shard's)
                    p.grad = None
            self._dropped = tuple(dropped)
        if self._optimizer_step_post_hooks:
            for hook in list(self._optimizer_step_post_hooks.values()):
                hook(self, args, {})
        return result

    def _master_closure(self, closure: Callable[[], float]) -> Callable[[], float]:
        """``closure`` for the wrapped optimizer: each evaluation sees the masters' current values and leaves its gradients in them.

        A closure re-evaluates the model, whose weights are the half copies: optimizers that
        evaluate it after moving the parameters (LBFGS's line search) need the masters copied to
        the model first, and under ``grad_accumulation="compute"`` the gradients it makes moved
        into the masters after.
        """

        def evaluate() -> float:
            with torch.no_grad():
                live = self.master_storage == "remainder" and self._live
                self._copy_to_model()  # ("remainder": a split, which leaves the masters placeholders...)
                if live:
                    self._join_masters()  # (...so join them again: the step goes on updating them)
            with torch.enable_grad():
                loss = closure()
            with torch.no_grad():
                self.master_grads()
            return loss

        return evaluate

    def _run_pre_hooks(self, closure: Callable[[], float] | None) -> Callable[[], float] | None:
        """This optimizer's step pre-hooks (``register_step_pre_hook``), as torch runs them; returns the closure to use.

        Torch's global hooks (``register_optimizer_step_pre_hook``) run once, around the wrapped
        optimizer's own step (or the fused step, which runs them for it).
        """
        args: tuple[Any, ...] = (closure,) if closure is not None else ()
        kwargs: dict[str, Any] = {}
        for hook in list(self._optimizer_step_pre_hooks.values()):
            result = hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"an optimizer step pre-hook must return None or a tuple of (new_args, "
                                       f"new_kwargs), got {type(result).__name__}: {result!r}")
                args, kwargs = result
        return args[0] if args else kwargs.get("closure")

    def _step(self, args: tuple[Any, ...], grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> Any:
        """Steps 3-4 of the class docstring; with remainders, inside a join of the masters and a split after."""
        view = self._fused_shadow()  # the mixprec.optim optimizer that runs the fused step, or None
        if self.master_storage != "remainder":
            return self._update(args, grad_scale, found_inf, view)
        if view is not None and self._shadow.remainders:
            # The fused step joins and splits the masters itself (in its kernel, or around an eager fallback).
            return self._update(args, grad_scale, found_inf, view)
        compiled = self._remainders_compiled(view)
        self._join_masters(compiled)
        try:
            return self._update(args, grad_scale, found_inf, view)
        finally:
            # Also when the update raised: the weights and remainders then hold whatever it wrote (a
            # skipped or not-started update splits back into the very same bits). The copy-back has
            # split them already when the update ran to its end.
            if self._live:
                self._split_masters(compiled)

    def _update(self, args: tuple[Any, ...], grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None,
                view: Any) -> Any:
        """Steps 3-4 of the class docstring: edits carried in, the update (skipping on the device), the copy back.

        ``view``: :meth:`_fused_shadow`'s answer for this step (the caller asked it once).
        """
        # With "values" the fused kernel compares every weight it steps with its rounded master as it
        # reads them (optim/_fused_step.py, sync_mirrors); weights without a gradient (not stepped) keep an
        # edit in the model until their next step or state_dict(), which sync them.
        in_kernel = view is not None and self.weight_edits == "values" and self.master_storage != "remainder"
        if view is not None:
            view.sync_mirrors = in_kernel
        if not in_kernel:
            self._sync_edits()
        if view is not None:
            # One compiled kernel per bucket: update, skip on found_inf, copy back (into the mirrors).
            result = self._shadow.step(view, args, grad_scale, found_inf)
            if self.weight_edits == "versions":
                self._record_versions()
            return result
        guard = self._inner_guard  # the wrapped optimizer's step, below its refuse-guard (inside(), inlined)
        watch = self._watch_inner > 0 and not args
        if watch:
            params, masters = self._pair_lists
            before = [(_local(p)._version, _local(m)._version) for p, m in zip(params, masters)]
        guard.depth += 1
        try:
            if found_inf is None and grad_scale is None:
                result = self.optimizer.step(*args)
            else:
                if found_inf is None:
                    device = grad_scale.device if grad_scale is not None else self._masters[0].device
                    found_inf = torch.zeros((), dtype=torch.float32, device=device)
                # torch's AdamW/Adam/SGD step through their fused kernel: the skip stays on the device
                result = step_or_skip(self.optimizer, found_inf, grad_scale, args, {}, twin=True)[1]
        finally:
            guard.depth -= 1
        # (stepped below its LR-scheduler wrapper: torch's mark that its step ran, for a scheduler built on it)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        if watch:
            self._check_inner_step(params, masters, before)
        self._copy_to_model()
        return result

    def _check_inner_step(self, params: list[torch.Tensor], masters: list[torch.Tensor],
                          before: list[tuple[int, int]]) -> None:
        """Raise when the wrapped optimizer's step wrote a half model weight and not its master.

        An optimizer that keeps its own reference to the model's parameters where
        :func:`_realias_params` cannot re-point it (deeper containers, named tuples, objects) steps
        the half weights, which the copy back from the unchanged masters then overwrites: training
        would silently do nothing. Watched (version counters only, no host read) until the first
        step that moved a master (a skipped step moves nothing), at most :data:`_WATCH_STEPS` steps
        (torch's fused kernels do not bump version counters), and again after parameters are added.
        """
        self._watch_inner -= 1
        moved = False
        for i, ((p, m), (pv, mv)) in enumerate(zip(zip(params, masters), before)):
            m_moved = _local(m)._version != mv
            moved = moved or m_moved
            if _local(p)._version != pv and not m_moved:
                self._watch_inner = 0
                raise RuntimeError(
                    f"{type(self.optimizer).__name__}.step() wrote model parameter {i} of the master-weight pairs "
                    f"(shape {tuple(p.shape)}, {dtype_name(p.dtype)}) and not its FP32 master: the optimizer keeps its "
                    "own reference to the model's parameters (an attribute mixprec could not point at the masters: "
                    "nested deeper than two lists/dicts, a named tuple or another object), so under a '*-master' "
                    "policy its updates would be overwritten by the masters (no training). Step the tensors in "
                    "self.param_groups[i]['params'] (torch's convention), or keep the extra reference in a plain "
                    "list or dict attribute of the optimizer."
                )
        if moved:
            self._watch_inner = 0

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling the fused step so far (0.0 when it never ran)."""
        return float(self._shadow.compile_seconds) if self._shadow is not None else 0.0

    def _fused_shadow(self) -> Any:
        """The ``mixprec.optim`` optimizer that runs the fused step on the wrapped one's groups and state, or None.

        A :class:`~mixprec._fused.FusedShadow` of the wrapped optimizer, built once; half model
        parameters are registered as mirrors of their masters (the compiled step writes the
        rounded master into them).
        """
        if self.fused is False or type(self.optimizer) not in FUSABLE:
            return None
        if self._shadow is not None and self._shadow.off:  # decided: the wrapped optimizer's own step (no call)
            return None
        if self._shadow is None:
            mirrors, remainders = self._shadow_maps()
            self._shadow = FusedShadow(self.optimizer, self.fused, mirrors, remainders=remainders)
            self._shadow.prefer = self._prefer_fused
        return self._shadow.view()

    def _shadow_maps(self) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """What the fused step writes besides the masters: ``(mirrors, remainders)``, keyed by ``id(master)``.

        ``"full"``: each half parameter is its master's mirror (the rounded master, in the kernel).
        ``"remainder"``, on the devices of :data:`REMAINDERS_IN_KERNEL`: mirrors and remainders, so the
        kernel joins each master from its weight and remainder and splits the new value into them (the
        masters stay placeholders, no FP32 copy exists during the step). Elsewhere, and for FSDP2
        shards (DTensors), neither: :meth:`step` joins and splits around the step (compiled, beside it).
        """
        pairs = self._half_pairs()
        if self.master_storage == "full":
            return {id(m): p for p, m in pairs}, {}
        if any(_is_dtensor(p) or p.device.type not in REMAINDERS_IN_KERNEL for p, _ in pairs):
            return {}, {}
        return {id(m): p for p, m in pairs}, {id(m): r for (_, m), r in zip(pairs, self._rem_list)}

    @property
    def prefer_fused(self) -> bool:
        """``fused=None`` then fuses on any device (``MixedPrecision`` leaves it off: docs/optim.md)."""
        return self._prefer_fused

    @prefer_fused.setter
    def prefer_fused(self, value: bool) -> None:
        self._prefer_fused = bool(value)
        if self._shadow is not None:
            self._shadow.prefer = self._prefer_fused

    # ----- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Return the wrapped optimizer's state plus the masters.

        In-place edits of the model's weights are carried into the masters first (see the class).

        Keys:
            ``version`` (int, 1), ``optimizer`` (the wrapped optimizer's ``state_dict()``),
            ``masters`` (list of FP32 tensors in param-group order, ``None`` where the
            parameter is its own master), ``master_dtype`` (``"f32"``), ``grad_accumulation``.
            Under ``master_storage="remainder"`` the masters are the joined exact FP32 values (new
            tensors): the same format, so the state loads under ``"full"`` and back bit for bit.
            ``torch.optim.Optimizer``'s state-dict hooks (``register_state_dict_pre_hook``, ...) run on
            this outer dict, as torch runs them on its own.
        """
        for pre_hook in self.__dict__.get("_optimizer_state_dict_pre_hooks", {}).values():
            pre_hook(self)  # torch.optim.Optimizer's hooks, on this (outer) state dict
        self.sync_edits_()
        masters = self._joined() if self.master_storage == "remainder" else self._masters
        state_dict = {
            "version": _STATE_VERSION,
            "optimizer": self.optimizer.state_dict(),
            "masters": [m if p is not m else None for p, m in zip(self._model_params, masters)],
            "master_dtype": dtype_name(self.master_dtype),
            "grad_accumulation": self.grad_accumulation,
        }
        for post_hook in self.__dict__.get("_optimizer_state_dict_post_hooks", {}).values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict` output: optimizer state, then masters, then copy them to the model.

        Raises:
            ValueError: not a MasterWeightOptimizer state (e.g. a plain optimizer's state dict),
                a newer version, or masters that do not match this model's parameters.
        """
        if isinstance(state_dict, Mapping):
            state_dict = dict(state_dict)  # as torch's: a hook may edit it, the caller's stays as it was
            for pre_hook in self.__dict__.get("_optimizer_load_state_dict_pre_hooks", {}).values():
                result = pre_hook(self, state_dict)
                if result is not None:
                    state_dict = result
        if not isinstance(state_dict, Mapping) or "masters" not in state_dict or "optimizer" not in state_dict:
            keys = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise ValueError(
                f"not a MasterWeightOptimizer state dict (keys: {keys}); expected 'version', 'optimizer', 'masters'. "
                "A plain optimizer's state dict loads with mwo.optimizer.load_state_dict(sd), after which the masters "
                "still need loading (MixedPrecision.load_model_state_dict)."
            )
        self.check_loadable(state_dict)
        masters = state_dict["masters"]
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._set_masters(masters)
        for post_hook in self.__dict__.get("_optimizer_load_state_dict_post_hooks", {}).values():
            post_hook(self)

    def check_loadable(self, state_dict: Mapping[str, Any]) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state_dict``'s masters, loading nothing.

        A parameter frozen at ``prepare`` and trainable now gets its master here (as the next step
        would give it; the checkpoint's value replaces it), so a run that unfroze a layer resumes
        when the same layer is unfrozen before loading.

        Raises:
            ValueError: another version, another parameter count, a parameter with a master on one
                side only (the message says which and how to match), or a master of another shape.
        """
        version = state_dict.get("version")
        if version != _STATE_VERSION:
            raise ValueError(f"MasterWeightOptimizer state version {version!r}; this mixprec reads version {_STATE_VERSION}.")
        masters = state_dict["masters"]
        if len(masters) != len(self._masters):
            raise ValueError(
                f"the checkpoint has {len(masters)} parameters but this optimizer manages {len(self._masters)}; "
                "was it saved for a different model?"
            )
        self._promote_unfrozen(warn=False)
        for i, (src, p, m) in enumerate(zip(masters, self._model_params, self._masters)):
            if src is not None and p is m and not p.requires_grad and p.dtype != self.master_dtype:
                raise ValueError(
                    f"parameter {i} (shape {tuple(p.shape)}) has an FP32 master in the checkpoint but is frozen in this "
                    "run (a layer unfrozen during the saved run): unfreeze it, p.requires_grad_(True), before loading."
                )
            if src is None and p is not m:
                raise ValueError(
                    f"parameter {i} (shape {tuple(p.shape)}) has no master in the checkpoint (it was frozen when saved) "
                    "but has one here: freeze it, p.requires_grad_(False), before prepare() as the saved run did, or "
                    "load the weights only (MixedPrecision.load_model_state_dict)."
                )
            if (src is None) != (p is m):
                raise ValueError(f"parameter {i}: the checkpoint and this run disagree on whether it has a master "
                                 "(saved under a different policy?)")
            if src is not None and src.shape != m.shape:
                raise ValueError(f"parameter {i}: master of shape {tuple(src.shape)} in the checkpoint, {tuple(m.shape)} here.")

    def _set_masters(self, values: list[torch.Tensor | None]) -> None:
        """Give each master the value at its position (``None``: keep it), then copy the masters to the model."""
        if self.master_storage == "remainder":
            for src, p, m, r in zip(values, self._model_params, self._masters, self._rems):
                if src is None:
                    continue
                if r is None:
                    m.copy_(src)  # an FP32 parameter (or a frozen one): it is its own master
                else:
                    hi, lo = split(_local(_shard_like(src.detach(), p)).to(device=r.device, dtype=torch.float32).contiguous())
                    _local(p).copy_(hi)
                    r.copy_(lo)
            self._copy_to_model()  # records versions; the weights already hold the masters' top halves
            return
        for src, m in zip(values, self._masters):
            if src is not None:
                m.copy_(src)
        self.copy_to_model_()

    @torch.no_grad()
    def load_master_values_(self, values: Mapping[torch.Tensor, torch.Tensor]) -> None:
        """Set masters from full-precision values keyed by model parameter, then copy them to the model.

        Used to load a plain FP32 model checkpoint into a master-weights run without rounding
        the masters through the half-precision dtype.
        """
        self._set_masters([values.get(p) for p in self._model_params])

    def remove_hooks(self) -> None:
        """Remove the gradient-accumulation hooks from the model's parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


class _StateByParam(MutableMapping[Any, Any]):
    """:attr:`MasterWeightOptimizer.state`: the wrapped optimizer's state; a model parameter's key is its master."""

    __slots__ = ("_mwo",)

    def __init__(self, mwo: MasterWeightOptimizer) -> None:
        self._mwo = mwo

    def _key(self, key: Any) -> Any:
        # by id: the optimizer holds its model parameters, so no other live tensor can share one's id
        view = self._mwo._views.get(id(key)) if isinstance(key, torch.Tensor) else None
        return view._master if view is not None else key

    def __getitem__(self, key: Any) -> Any:
        return self._mwo.optimizer.state[self._key(key)]  # a defaultdict: a new entry goes under the master

    def get(self, key: Any, default: Any = None) -> Any:
        """As ``dict.get``: no entry is created (the defaultdict's ``[]`` would)."""
        return self._mwo.optimizer.state.get(self._key(key), default)  # dict.get: no defaultdict insert

    def pop(self, key: Any, *default: Any) -> Any:
        """As ``dict.pop``."""
        return self._mwo.optimizer.state.pop(self._key(key), *default)

    def __copy__(self) -> Any:
        return copy.copy(self._mwo.optimizer.state)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._mwo.optimizer.state[self._key(key)] = value

    def __delitem__(self, key: Any) -> None:
        del self._mwo.optimizer.state[self._key(key)]

    def __contains__(self, key: object) -> bool:
        return self._key(key) in self._mwo.optimizer.state

    def __iter__(self) -> Iterator[Any]:
        return iter(self._mwo.optimizer.state)

    def __len__(self) -> int:
        return len(self._mwo.optimizer.state)

    def __repr__(self) -> str:
        return repr(self._mwo.optimizer.state)


#: Steps of a wrapped optimizer (not one of torch's) watched for writes to half weights, at most: the watch ends
#: at the first step that moved a master; skipped steps (an FP16 run's first overflows) move nothing.
_WATCH_STEPS = 64


def _inner_watch_steps(optimizer: Optimizer) -> int:
    """How many steps of ``optimizer`` :meth:`MasterWeightOptimizer._check_inner_step` watches (torch's own: none, they step ``param_groups``)."""
    return 0 if type(optimizer).__module__.startswith("torch.optim") else _WATCH_STEPS


def _realias_params(optimizer: Optimizer, masters: Mapping[int, torch.Tensor]) -> None:
    """Point an optimizer's own aliases of its parameters at the masters.

    LBFGS keeps ``_params`` (taken at construction), and a user's optimizer may keep its own list
    (``self.plist = list(params)``) and step that: it would step the half weights, which the copy
    back from the unchanged masters then overwrote (silently no training). Every list, tuple or
    dict attribute (nested two deep) that holds an adopted parameter gets the masters in their places.

    Args:
        optimizer: The wrapped optimizer.
        masters: ``id(model parameter) -> master`` of the parameters that have one.
    """
    if isinstance(getattr(optimizer, "_params", None), list) and optimizer.param_groups:
        optimizer._params = optimizer.param_groups[0]["params"]  # type: ignore[attr-defined]  # the same list, as LBFGS built it
    if not masters:
        return
    for name, value in list(vars(optimizer).items()):
        if name not in ("param_groups", "state", "defaults"):
            swapped = _swap_tensors(value, masters, depth=2)
            if swapped is not value:
                setattr(optimizer, name, swapped)


def _swap_tensors(value: Any, masters: Mapping[int, torch.Tensor], depth: int) -> Any:
    """``value`` with adopted parameters replaced by their masters, in lists, tuples and dict values (nested
    up to ``depth``); ``value`` itself when nothing changed (and for anything else, named tuples included)."""
    if isinstance(value, torch.Tensor):
        return masters.get(id(value), value)
    if depth <= 0:
        return value
    if isinstance(value, dict):
        out = {k: _swap_tensors(v, masters, depth - 1) for k, v in value.items()}
        if any(out[k] is not v for k, v in value.items()):
            value.update(out)  # in place (a dict subclass keeps its type)
        return value
    if isinstance(value, (list, tuple)) and not hasattr(type(value), "_fields"):
        items = [_swap_tensors(v, masters, depth - 1) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if isinstance(value, list):
            value[:] = items  # in place: other references to the user's list see the masters too
            return value
        return type(value)(items)
    return value


def _grad_version(g: torch.Tensor) -> tuple[int, int]:
    """A DTensor gradient's version and its local tensor's: in-place ops on the DTensor bump the first, on the shard the second."""
    return g._version, _local(g)._version


def _set_local(master: torch.Tensor, value: torch.Tensor) -> None:
    """Give a remainder-stored master its data: a DTensor's local tensor, else ``.data`` (the object, and what is keyed by it, stays)."""
    if _is_dtensor(master):
        master._local_tensor = value  # type: ignore[attr-defined]  # what FSDP2 itself does to its shards
    else:
        master.data = value


def _shard_like(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``value`` as ``p``'s shard: a DTensor as it is, a full tensor distributed like ``p`` (a collective), else itself."""
    if not _is_dtensor(p) or _is_dtensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(p.device), p.device_mesh, p.placements)  # type: ignore[attr-defined]


_REMAINDER_FNS: list[Callable[..., Any]] = []


def _compiled_remainder_fns() -> list[Callable[..., Any]]:
    """``[join_edited, split_into_, join_flat_compilable_, split_flat_compilable_]`` of flat tensors under ``torch.compile(dynamic=True)``, built on first use.

    The first two serve one tensor at a time (FSDP2 shards), the last two a :class:`RemainderBank`'s passes.

    Dynamic shapes: one graph serves every parameter size (sizes 0 and 1 aside), so the compile
    (about 3 s on a CPU, once per process) does not grow with the model. Measured on one tensor of
    4M elements, 1 CPU thread (``benchmarks/remainder_cost.py``): split 2.4 ms against 13.5 eagerly,
    join 1.6 ms against 3.4 (its eager form is an FP32 cast and an integer add).
    """
    if not _REMAINDER_FNS:
        _REMAINDER_FNS.extend([torch.compile(f, dynamic=True) for f in (join_edited, split_into_, join_flat_compilable_, split_flat_compilable_)])
    return _REMAINDER_FNS


#: Devices where the fused step joins and splits remainder-stored masters inside its kernel. Not the
#: CPU: there Inductor's C++ loops do not vectorise the int16/bf16 bit casts, and the fused AdamW
#: kernel with them took 8.7 ms against 2.1 ms without (4M elements, 1 thread); the compiled join
#: and split beside the step cost less (``benchmarks/remainder_step_cost.py``). On a GPU the bit casts
#: are free and the step is memory-bound: 2+2 bytes read and written per element instead of 4+2,
#: and no FP32 masters during the step. Measured on an H200 (``benchmarks/gpu_suite.py``,
#: "remainder", 85M parameters in 48 tensors, 2026-11-27): fused 12.00 ms against 11.98 for full
#: FP32 masters, both host-bound; eager 2.87 against 2.78 ms. Since then the fused step runs only
#: under ``fused=True``; by default the masters are joined and split (compiled) around torch's step.
REMAINDERS_IN_KERNEL: frozenset[str] = frozenset({"cuda", "xpu"})

_GRAD = operator.attrgetter("grad")
_NOT_NONE = functools.partial(operator.is_not, None)
def reshaped_message(param_shape: Any, master_shape: Any) -> str:
    """The error for a half parameter whose shape no longer matches its FP32 master's."""
    return (
        f"a half-precision parameter of shape {tuple(param_shape)} has an FP32 master of shape {tuple(master_shape)}: "
        "the model's parameter changed shape after prepare() (resize_token_embeddings, a parameter's .data replaced "
        "by a tensor of another shape). Resize the model before prepare(), or prepare the resized model again with a "
        "fresh MixedPrecision and optimizer (mixprec.checkpoint.fp32_state_dict(prec) exports the trained weights)."
    )


CREATE_GRAPH_FP32_ACCUMULATION = (
    "backward(create_graph=True) under FP32 master weights with grad_accumulation='fp32': the half gradient is added "
    "into the FP32 master's gradient outside autograd, so p.grad would lose its graph (a penalty on p.grad, a "
    "Hessian-vector product, would silently get no gradient). Use MixedPrecision(policy, grad_accumulation='compute') "
    "(the half gradients keep their graph until the step), or compute the penalty with torch.autograd.grad(loss, "
    "params, create_graph=True)."
)
_DTYPE = operator.attrgetter("dtype")
_NONE_TYPE = type(None)
_STRIDED = torch.strided
_ONLY_VIEWS = frozenset({MasterGradView, _NONE_TYPE})
#: Elements carried through :func:`carry_edits_` per pass: bounds its temporaries (11 bytes per
#: element) to 352 MiB whatever the model's size.
EDIT_CHUNK = 1 << 25


@torch.no_grad()
def carry_edits_(masters: list[torch.Tensor], weights: list[torch.Tensor]) -> None:
    """``masters[i] = where(weights[i] == round(masters[i]), masters[i], weights[i])`` for every i, in a few passes.

    The edit check of :meth:`MasterWeightOptimizer.sync_edits_` (the per-tensor form is
    ``optim._rounding.with_edits``, which the fused step runs inside its kernel).

    On the devices of :data:`mixprec._edit_kernel.DEVICES` (CUDA) with Triton, each group of dense
    FP32 masters with BF16/FP16 weights is one Triton kernel (6 bytes per element; its first use
    per process checks it against ``where``, one host sync, and falls back here on a failure).
    Otherwise (the fallback):

    Algorithm, per (device, dtypes) group and per pass of at most :data:`EDIT_CHUNK` elements
    (three foreach copies, a cast, a comparison and a ``where`` over flat buffers, whatever the
    number of tensors; about 48 bytes of memory traffic per element):

    1. gather the masters into a flat FP32 buffer and ``float(w)`` into another (``_foreach_copy_``
       into their 1-D pieces, the tensors seen as 1-D in memory order);
    2. ``same = (round(m) == f)`` (both values of the weights' dtype: compared exactly);
    3. ``m = where(same, m, f)`` in the flat buffer, scattered back with one ``_foreach_copy_``.

    Exactly the elementwise ``where`` form (NaN and inf masters or weights included: a NaN master
    a user repairs takes the repair, a master past the weights' range with an inf weight stays).
    Pairs whose two tensors are laid out differently (or not densely) take ``where`` per
    pair. No host sync (but the kernel's first-use check, above).
    """
    _carry_edits(masters, weights)


class EditViews:
    """Cached 1-D views of the (master, weight) pairs the edit check reads, rebuilt when a pointer moves.

    Making a view costs about 1 us of host time per tensor, every step; the check that they still
    match (every data pointer, the weights' sizes: ``map`` over C methods, a few Python calls in
    all) a tenth of that. ``passes`` holds the flat passes (at most :data:`EDIT_CHUNK` elements
    each) as ``(1-D masters, 1-D weights, element counts, total)``.
    """

    __slots__ = ("deferred", "dtensors", "kernels", "key", "odd", "passes")

    def __init__(self) -> None:
        self.key: list[int] | None = None
        self.dtensors = False  # FSDP2 shards: the key and the views come from the local tensors
        self.passes: list[tuple[list[torch.Tensor], list[torch.Tensor], list[int], int]] = []
        self.odd: list[tuple[torch.Tensor, torch.Tensor]] = []  # pairs laid out differently: where() each
        self.deferred = False  # built during a CUDA graph capture without the kernel: build again after it
        # groups on the Triton kernel's devices (_edit_kernel.DEVICES): its tables, and the passes that serve
        # when it is off
        self.kernels: list[tuple[_edit_kernel.EditTables, list[tuple[list[torch.Tensor], list[torch.Tensor], list[int], int]]]] = []

    def get(self, masters: list[torch.Tensor], weights: list[torch.Tensor]) -> EditViews:
        """These views for ``masters``/``weights``, rebuilt first if any tensor moved or changed size."""
        if self.dtensors:
            masters, weights = [_local(t) for t in masters], [_local(t) for t in weights]
        try:
            key = [*map(_DATA_PTR, masters), *map(_DATA_PTR, weights), *map(_NUMEL, weights)]
        except RuntimeError:  # a tensor without storage (a DTensor): its local shard holds the data
            if self.dtensors:
                raise
            self.dtensors = True
            return self.get(masters, weights)
        if key != self.key or self.deferred:
            self._build(masters, weights)
            self.key = key
        return self

    def _build(self, masters: list[torch.Tensor], weights: list[torch.Tensor]) -> None:
        groups: dict[tuple[torch.device, torch.dtype, torch.dtype], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.passes, self.odd, self.kernels, self.deferred = [], [], [], False
        for m, w in zip(masters, weights):
            if m.numel() == 0:
                continue
            if not same_layout(m, w) or not dense_layout(m):
                self.odd.append((m, w))
            else:
                groups.setdefault((w.device, w.dtype, m.dtype), []).append((m, w))
        for (device, w_dtype, m_dtype), pairs in groups.items():
            # memory order: equal strides pair the elements
            ms = [m.as_strided((m.numel(),), (1,)) for m, _ in pairs]
            ws = [w.as_strided((w.numel(),), (1,)) for _, w in pairs]
            passes: list[tuple[list[torch.Tensor], list[torch.Tensor], list[int], int]] = []
            start, total = 0, 0
            for i, m in enumerate(ms):
                total += m.numel()
                if total >= EDIT_CHUNK or i == len(ms) - 1:
                    passes.append((ms[start:i + 1], ws[start:i + 1], [t.numel() for t in ms[start:i + 1]], total))
                    start, total = i + 1, 0
            if _edit_kernel.available(device, w_dtype, m_dtype):
                self.kernels.append((_edit_kernel.EditTables(ms, ws), passes))
            else:
                self.passes.extend(passes)
                # (the kernel is not built while a CUDA graph is captured: the foreach ops are captured instead,
                # and the next eager call builds again)
                self.deferred |= device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel


def grad_format(master: torch.Tensor, param: torch.Tensor, grad: torch.Tensor | None = None) -> torch.memory_format:
    """The memory format a gradient copied into ``master``'s dtype takes: the format of the master the step
    reads where it has a name (contiguous, ``channels_last``, ``channels_last_3d``), else the gradient's
    (``preserve_format``). A placeholder master (``bf16-master-r16``: a broadcast NaN, zero strides) is
    joined from its weight ``param`` in the weight's layout, so the weight's format is taken. A sparse
    ``grad`` (``Embedding(sparse=True)``) stays sparse: ``preserve_format``, the only format it takes."""
    if grad is not None and grad.layout != torch.strided:
        return torch.preserve_format
    if 0 in master.stride():
        master = param
    if master.is_contiguous():
        return torch.contiguous_format
    if master.dim() == 4 and master.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if master.dim() == 5 and master.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.preserve_format


def _carry_edits(masters: list[torch.Tensor], weights: list[torch.Tensor], views: EditViews | None = None) -> None:
    """:func:`carry_edits_` without its ``no_grad`` decorator (the step runs with grad mode off).

    ``views``: a cache of the pairs' 1-D views kept by the caller (one per optimizer); none: built here.
    """
    v = (views or EditViews()).get(masters, weights)
    for m, w in v.odd:  # optim._rounding.with_edits, inline (this module stays below mixprec.optim)
        torch.where(w == m.to(w.dtype), m, w.to(m.dtype), out=m)
    passes = list(v.passes)
    for tables, group_passes in v.kernels:
        # Traced (a compiled train step around prec.step): the foreach passes, which dynamo understands; a launch
        # through raw pointers hides its writes from Inductor's mutation analysis.
        if not torch.compiler.is_dynamo_compiling():
            if tables.run is not None:
                # Triton's launcher, arguments bound (no frame of _edit_kernel.py on the step's path). It launches
                # on the current CUDA device: the tables' device is made current first when it is another.
                if tables.device_index is None or tables.device_index == torch.cuda.current_device():
                    tables.run()
                else:
                    with torch.cuda.device(tables.device_index):
                        tables.run()
                continue
            if _edit_kernel.carry_edits_triton_(tables):
                continue
        passes += group_passes  # the kernel is off (or traced): its group's foreach passes
    for ms, ws, sizes, n in passes:
        _carry_edits_pass(ms, ws, sizes, n)


def _carry_edits_pass(ms: list[torch.Tensor], ws: list[torch.Tensor], sizes: list[int], n: int) -> None:
    flat = torch.empty(n, dtype=ms[0].dtype, device=ms[0].device)
    f = torch.empty(n, dtype=ms[0].dtype, device=ms[0].device)
    # torch.split_with_sizes, not Tensor.split: the C function without torch/_tensor.py's two Python calls
    pieces = torch.split_with_sizes(flat, sizes)
    torch._foreach_copy_(pieces, ms)  # the masters, gathered
    torch._foreach_copy_(torch.split_with_sizes(f, sizes), ws)  # float(w), exact
    same = torch.eq(flat.to(ws[0].dtype), f)  # round(m) == w, compared exactly (round(m) is a value of w's dtype)
    torch.where(same, flat, f, out=flat)  # where() itself: NaN/inf masters and weights as the where form has them
    torch._foreach_copy_(ms, pieces)  # scattered back


def model_params_of(opt: Optimizer) -> list[torch.Tensor]:
    """The model's tensors an optimizer updates: a ``MasterWeightOptimizer``'s model parameters, else its groups' tensors."""
    if isinstance(opt, MasterWeightOptimizer):
        return opt.model_params
    return [p for g in opt.param_groups for p in g["params"]]


def check_grad_accumulation(value: object) -> None:
    """Validate a ``grad_accumulation`` argument.

    Raises:
        ValueError: not ``"fp32"`` or ``"compute"``.
    """
    if value not in ("fp32", "compute"):
        raise ValueError(f"grad_accumulation={value!r}; use 'fp32' (default) or 'compute'.")


def check_weight_edits(value: object) -> None:
    """Validate a ``weight_edits`` argument.

    Raises:
        ValueError: not ``"values"`` or ``"versions"``.
    """
    if value not in ("values", "versions"):
        raise ValueError(
            f"weight_edits={value!r}; use 'values' (default: every edit of the model's half weights is carried into "
            "the masters, also through p.data) or 'versions' (free; edits through p.data are not seen)."
        )


class _ReadHook:
    """A gradient view's read callback: the optimizer's unscale callback, reached through a weak reference."""

    __slots__ = ("_ref",)

    def __init__(self, mwo: MasterWeightOptimizer) -> None:
        self._ref = weakref.ref(mwo)

    def __call__(self, op: str) -> None:
        mwo = self._ref()
        if mwo is not None and mwo._before_read is not None:
            mwo._before_read(op)


class _AccumulateInto:
    """Post-accumulate-grad hook: move a fresh half gradient into the FP32 master and leave the view.

    When ``param.grad`` is the view, autograd has already added into the master gradient (in
    FP32). A plain gradient means the view was dropped (``param.grad = None``: someone cleared
    the gradients), so it replaces the master gradient rather than adding to a stale one.
    """

    def __init__(self, master: torch.Tensor, view: MasterGradView, param: torch.Tensor) -> None:
        self.master = master
        self.view = view
        # A placeholder master (bf16-master-r16) is joined in its weight's layout, which autograd's gradient
        # follows as the weight's layout changes (model.to(memory_format=...) after prepare): kept as it is.
        self.format = torch.preserve_format if 0 in master.stride() else grad_format(master, param)

    def __call__(self, param: torch.Tensor) -> None:
        g = param.grad
        if g is None or g is self.view:
            return
        if g.requires_grad:  # backward(create_graph=True): the FP32 copy would cut the gradient's graph
            raise RuntimeError(CREATE_GRAPH_FP32_ACCUMULATION)
        if g.shape != self.master.shape:
            raise RuntimeError(reshaped_message(g.shape, self.master.shape))
        # Runs once per parameter per backward: torch.no_grad()'s decorator costs ~7 Python calls, and
        # autograd runs hooks with grad mode off anyway unless create_graph=True.
        # In the master's memory format (the half weight may be channels_last beside a contiguous master):
        # the fused optimizer kernels pair gradient and master elements in memory order.
        # A sparse gradient (Embedding(sparse=True)) takes no memory format but its own.
        fmt = self.format if g.layout is _STRIDED else torch.preserve_format
        if torch.is_grad_enabled():
            with torch.no_grad():
                g32 = self.master.grad = g.to(self.master.dtype, memory_format=fmt)
        else:
            g32 = self.master.grad = g.to(self.master.dtype, memory_format=fmt)
        setattr(g32, FROM_VIEW, True)
        param.grad = self.view

