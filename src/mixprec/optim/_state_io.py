"""The state of a :class:`~mixprec.optim.LowPrecisionOptimizer`: creation, checkpoints, full-precision weights, memory."""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Mapping
from copy import deepcopy
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._dtypes import dtype_name
from ._parts import (
    _COMP_KEY,
    _READABLE_VERSIONS,
    _STATE_VERSION,
    _STEP_KEY,
    OptimizerParts,
    _as_state_tensor,
    _local,
    _local_value,
    _nbytes,
    _zeros_like,
)
from ._rounding import comp_of_weight

__all__ = ["StateIO"]


class StateIO(OptimizerParts):
    """State of ``LowPrecisionOptimizer``: per-parameter creation, ``state_dict``/``load_state_dict``, FP32 weights, memory."""

    #: The torch optimizer this one was converted from (``from_torch``; ``LowPrecisionOptimizer._link_source``).
    _torch_source: weakref.ReferenceType[Optimizer] | None = None

    def _init_state(self, p: Tensor, group: Mapping[str, Any]) -> None:
        st = self.state[p]
        keys = self._state_keys(group)
        if _STEP_KEY not in st:
            # Buffers without a step count: torch's SGD state (it keeps no "step"), shared by a fused step
            # (_fused.FusedShadow) after torch's own steps or a torch checkpoint. The next step is not the
            # first (SGD's dampening applies), as _import_state decides for loaded state.
            started = any(st.get(k) is not None for k in keys)
            st[_STEP_KEY] = torch.full((), float(started), dtype=torch.float32, device=p.device)
        for k in keys:
            if st.get(k) is None:  # (None: an unset momentum_buffer of an old torch state, a first step as torch's)
                st[k] = _zeros_like(p, self._state_dtype_for(p))
        if self._uses_kahan(p) and _COMP_KEY not in st:
            st[_COMP_KEY] = _zeros_like(p, p.dtype)

    def _import_state(self, p: Tensor, group: Mapping[str, Any], value: Mapping[str, Any], copy: bool) -> dict[str, Any]:
        """One parameter's state from a checkpoint or a torch optimizer, in this optimizer's dtypes."""
        keys = self._state_keys(group)
        out: dict[str, Any] = {}
        for k, v in value.items():
            if v is None:
                continue  # e.g. an unset momentum_buffer in old torch checkpoints
            if k == _STEP_KEY:
                t = torch.as_tensor(v).to(device=p.device, dtype=torch.float32).reshape(())
                out[k] = t.clone() if copy else t
            elif k == _COMP_KEY:
                if not self._uses_kahan(p):
                    continue  # resolved by the compensation check in load_state_dict
                out[k] = _as_state_tensor(v, p, p.dtype, copy, self._offset(p))
            elif k in keys or k in self._ALL_STATE_KEYS:
                out[k] = _as_state_tensor(v, p, self._state_dtype_for(p), copy, self._offset(p))
            else:
                out[k] = deepcopy(v) if copy else v
        if _STEP_KEY not in out and any(k in out for k in keys):
            out[_STEP_KEY] = torch.ones((), dtype=torch.float32, device=p.device)  # buffers exist: not the first step
        return out

    def state_dict(self) -> dict[str, Any]:
        """The ``torch.optim`` state dict plus a ``"mixprec"`` entry.

        Per-parameter ``state`` holds ``step`` (0-d FP32), the moments in ``state_dtype`` and,
        for ``compensation="kahan"`` on FP16/BF16 parameters, ``kahan_comp`` (parameter dtype).
        ``"mixprec"`` holds ``version`` (2), ``compensation``, ``state_dtype`` (name) and ``seed``.
        The random bits of stochastic rounding are a function of the seed, the step counters and
        the element positions, so these entries resume a run bit for bit, stochastic rounding
        included (version 1 also held per-device generator states). Tensors are the live state
        (as in torch); save or copy it. After a fused step the states of small parameters share
        storage (one buffer per packed tile, :meth:`FusedStep._home_states`): ``torch.save`` writes
        each buffer once; for a format that refuses shared tensors (safetensors), save clones.
        """
        sd = super().state_dict()
        sd["mixprec"] = {
            "version": _STATE_VERSION,
            "compensation": self.compensation,
            "state_dtype": dtype_name(self.state_dtype),
            "seed": self.seed,
        }
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` or from a ``torch.optim`` optimizer of the same algorithm.

        Tensors are copied into this optimizer's dtypes and devices (moments into
        ``state_dtype``, ``kahan_comp`` into the parameter dtype, ``step`` to a 0-d FP32 tensor on
        the parameter's device). A torch checkpoint has no compensation: each parameter keeps the
        one it has (the compensation is the rest of the weight's FP32 value, not optimizer state),
        or starts at zero. To move FP32 weights into this run without losing what the cast drops,
        use :meth:`load_full_precision_params_` (before or after this load).

        A version-1 state dict (mixprec before counter-based stochastic rounding) loads: its
        seed is kept and its generator states are dropped, so stochastic rounding continues with
        the counter-based bits of that seed (the steps after resuming round differently from
        what the old version would have done; everything else resumes exactly).

        Raises:
            ValueError: different group or parameter counts; a mixprec checkpoint whose
                ``compensation`` differs from this optimizer's (resuming would silently drop or
                invent compensation buffers); an unknown ``version``; a checkpoint of another
                optimizer class (:meth:`check_loadable`). Nothing is loaded when it raises.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)  # type: ignore[arg-type]  # torch types it dict; any Mapping passes through, as in torch
            if result is not None:
                state_dict = result
        self.check_loadable(state_dict)
        meta = state_dict.get("mixprec")
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                          chain.from_iterable(g["params"] for g in groups)))
        new_groups = self._merged_groups(saved_groups)
        for sg in new_groups:  # checked by check_loadable; run again on these copies for what it normalises
            self._validate_group(sg)
        owner = {id(p): g for g in new_groups for p in g["params"]}
        state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        for k, v in state_dict["state"].items():
            if k in id_map:
                p = id_map[k]
                state[p] = self._import_state(p, owner[id(p)], v, copy=True)
            else:
                state[k] = v
        if meta is None:
            # A torch checkpoint has no compensation; each parameter's (with an entry there or not) belongs to its
            # weight (the rest of its FP32 value, e.g. seeded by load_full_precision_params_), not to the moments.
            for p in chain.from_iterable(g["params"] for g in groups):
                kept = self.state.get(p, {}).get(_COMP_KEY)
                if kept is not None and _COMP_KEY not in state.get(p, {}):
                    state[p][_COMP_KEY] = kept
        self.__setstate__({"state": state, "param_groups": new_groups})
        source = self._torch_source() if self._torch_source is not None else None
        if source is not None:
            # The torch optimizer this one was converted from (from_torch) shares its groups: an LR scheduler
            # built on it drives the new ones. Also after a deepcopy or pickle, which drop load_state_dict hooks.
            source.param_groups = self.param_groups
        self._key_cache.clear()
        self._plan_cache.clear()  # the eager step's cached views would keep the old states' memory alive
        if meta is not None and int(meta.get("seed", self.seed)) != self.seed:
            self.seed = int(meta["seed"])
            self._key_cache.clear()
            self._fused_fns.clear()  # the seed's stream keys are constants of the compiled steps
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def check_loadable(self, state_dict: Mapping[str, Any]) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state_dict``, loading nothing.

        Raises:
            ValueError: an unknown ``version``; another ``compensation``; different group or
                parameter counts; hyper-parameters this optimizer does not accept, or missing
                (a checkpoint of another optimizer class: an AdamW state has no ``momentum``).
        """
        meta = state_dict.get("mixprec")
        if meta is not None:
            if meta.get("version") not in _READABLE_VERSIONS:
                raise ValueError(f"mixprec optimizer state version {meta.get('version')!r}; this mixprec reads "
                                 f"versions {_READABLE_VERSIONS} (upgrade mixprec?).")
            if meta.get("compensation") != self.compensation:
                raise ValueError(
                    f"the checkpoint was written with compensation={meta.get('compensation')!r}, this optimizer uses "
                    f"compensation={self.compensation!r}; build it with compensation={meta.get('compensation')!r} to "
                    "resume, or move only the weights (load_full_precision_params_)."
                )
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} parameter group(s), this optimizer {len(groups)}.")
        for i, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(f"parameter group {i} has {len(g['params'])} parameters here and "
                                 f"{len(sg['params'])} in the state dict.")
        for i, sg in enumerate(self._merged_groups(deepcopy(list(saved_groups)))):
            try:
                self._validate_group(sg)
            except KeyError as e:
                raise ValueError(
                    f"parameter group {i} of the state dict has no hyper-parameter {e.args[0]!r}, which "
                    f"{type(self).__name__} needs: a checkpoint of another optimizer class? (its keys: "
                    f"{sorted(k for k in sg if k != 'params')}). Build the optimizer the checkpoint was saved with."
                ) from None

    def _merged_groups(self, saved_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The saved groups (copies, edited in place) holding this optimizer's parameters and names."""
        for g, sg in zip(self.param_groups, saved_groups):
            sg["params"] = g["params"]
            if "param_names" in g and "param_names" not in sg:
                sg["param_names"] = g["param_names"]
        return saved_groups

    # ----- full-precision weights --------------------------------------------------------------------------
    @torch.no_grad()
    def load_full_precision_params_(self, values: Mapping[Tensor, Tensor]) -> None:
        """Set parameters from full-precision values, seeding the compensation with what the cast loses.

        For each ``param: value``, ``param`` becomes ``value`` rounded to nearest in the parameter
        dtype and, with ``compensation="kahan"`` on an FP16/BF16 parameter, its compensation
        buffer becomes ``round(value - param)``, so ``param + compensation`` equals the FP32
        weight to about 17 significant bits instead of 8 and nothing the cast dropped is lost
        for the updates that follow. With ``"stochastic"`` or ``"none"`` there is no buffer:
        only the nearest rounding is kept. Step counters and moments are left as they are
        (created, at zero, when missing).

        Args:
            values: Maps parameters of this optimizer (the tensor objects in ``param_groups``)
                to tensors of the same shape, any floating dtype and device (typically the FP32
                weights from before the model was cast).

        Raises:
            ValueError: a key that is not a parameter of this optimizer, or a shape mismatch.

        Example:
            >>> from mixprec.optim import AdamW
            >>> w32 = torch.randn(8)
            >>> p = torch.nn.Parameter(w32.to(torch.bfloat16))
            >>> opt = AdamW([p], compensation="kahan")
            >>> opt.load_full_precision_params_({p: w32})
            >>> bool((opt.full_precision_params()[p] - w32).abs().max() < 1e-4 * w32.abs().max())
            True
        """
        owner: dict[int, dict[str, Any]] = {id(p): g for g in self.param_groups for p in g["params"]}
        for p, v in values.items():
            group = owner.get(id(p))
            if group is None:
                raise ValueError(f"load_full_precision_params_: a tensor of shape {tuple(p.shape)} is not a parameter "
                                 "of this optimizer; key the mapping by the optimizer's own parameter tensors.")
            if tuple(v.shape) != tuple(p.shape):
                raise ValueError(f"load_full_precision_params_: value of shape {tuple(v.shape)} for a parameter of "
                                 f"shape {tuple(p.shape)}.")
        for p, v in values.items():
            group = owner[id(p)]
            self._init_state(p, group)
            lp = _local(p)
            lv = _local_value(v.detach(), p, self._offset(p)).to(lp.device)
            lp.copy_(lv)
            if self._uses_kahan(p):
                acc = torch.promote_types(lv.dtype, torch.float32)
                _local(self.state[p][_COMP_KEY]).copy_(lv.to(acc) - lp.to(acc))

    @torch.no_grad()
    def full_precision_params(self) -> dict[Tensor, Tensor]:
        """The weights as the optimizer sees them: ``param + compensation`` in FP32 (a new tensor each).

        The compensation counts up to half an ulp of its weight, as in the step
        (:func:`~mixprec.optim._rounding.comp_of_weight`: an edited weight's stale one does not).

        For parameters without a compensation buffer this is ``param`` upcast to FP32 (FP64
        parameters stay FP64). Use it to export or evaluate the run's best estimate of the weights.

        Returns:
            ``{param: tensor}`` over every parameter of every group.
        """
        out: dict[Tensor, Tensor] = {}
        for g in self.param_groups:
            for p in g["params"]:
                acc = torch.promote_types(p.dtype, torch.float32)
                w = p.detach().to(acc)
                comp = self.state.get(p, {}).get(_COMP_KEY)
                out[p] = w + comp_of_weight(w, comp, p.dtype) if comp is not None else w.clone()
        return out

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held per category over all parameters of all groups (persistent model state).

        Returns:
            ``numel`` (parameter elements this process holds: a ``DTensor``'s local shard), ``params``, ``grads`` (existing ``.grad`` tensors),
            ``compensation`` (``kahan_comp``), ``states`` (moments and other per-element
            buffers), ``scalars`` (0-d step counters), ``staging`` (the fused step's contiguous
            stand-ins for non-contiguous tensors larger than a tile, e.g. ``channels_last``
            weights, the padding of the buffers that hold a packed tile's states and, off the CPU,
            the two buffers packed tiles' parameters and gradients pass through; 0 for the eager
            step) and ``total`` (all but ``numel``).
            ``(params + grads + compensation + states) / numel`` is the bytes-per-parameter
            figure: 14 for Kahan with FP32 states on BF16 AdamW, 10 with BF16 states, 8 for
            stochastic rounding with BF16 states, 16 for FP32 parameters with FP32 states.
        """
        out = dict.fromkeys(("numel", "params", "grads", "compensation", "states", "scalars", "staging"), 0)
        for g in self.param_groups:
            for p in g["params"]:
                out["numel"] += _local(p).numel()
                out["params"] += _nbytes(p)
                if p.grad is not None:
                    out["grads"] += _nbytes(p.grad)
                for k, v in self.state.get(p, {}).items():
                    if not isinstance(v, Tensor):
                        continue
                    if k == _COMP_KEY:
                        out["compensation"] += _nbytes(v)
                    elif v.dim() == 0:
                        out["scalars"] += _nbytes(v)
                    else:
                        out["states"] += _nbytes(v)
        for _, plans in self._plan_cache.values():
            for plan in plans:
                out["staging"] += sum(_nbytes(t) for t in getattr(plan.fused, "stage_bufs", ()))
                out["staging"] += sum(_nbytes(t) for t in getattr(plan.fused, "copy_bufs", ()))  # (off the CPU)
                out["staging"] += getattr(plan.fused, "home_pad", 0)  # the padding of packed tiles' state buffers
        out["total"] = sum(v for k, v in out.items() if k != "numel")
        return out


# ----- helpers ------------------------------------------------------------------------------------------------
