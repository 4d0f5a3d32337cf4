"""Casting: floating tensors inside nested structures, and whole modules with FP32 islands.

``cast_module`` stores parameters in the policy's param dtype, keeps FP32 islands
(normalization layers by default) in FP32, leaves the other floating buffers in their own
dtype (unless the policy says ``b=param``), and wraps ``forward`` methods so that

* the root module casts floating inputs to the compute dtype (half-parameter policies)
  and floating outputs to the output dtype (every policy), and
* every island computes in FP32 with autocast off and hands the compute dtype back.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._dtypes import HALF, dtype_name, parse_dtype
from ._fp8 import revert_linears
from ._policy import Policy, find_islands
from ._tree import tree_map

__all__ = [
    "cast_module",
    "cast_root",
    "cast_tree",
    "for_inference",
    "is_prepared",
    "island_modules",
    "strip_forward_patches",
    "uncast_module",
]

T = TypeVar("T")
_CASTABLE = (torch.float32, torch.bfloat16, torch.float16)
_HOOKS_ATTR = "_mixprec_hooks"
_POLICY_ATTR = "_mixprec_policy"


def cast_tree(obj: T, dtype: torch.dtype, *, include_float64: bool = False) -> T:
    """Cast every floating tensor inside a nested structure to ``dtype``.

    The structure is walked by :func:`mixprec._tree.tree_map`: lists, tuples (namedtuples
    too), dicts (their own type: ``OrderedDict``, Hugging Face ``ModelOutput``) and dataclass
    instances (frozen too) are rebuilt with the same type; integer, bool and complex tensors,
    float64 tensors (unless ``include_float64``), float8 tensors and non-tensors are returned
    unchanged (the very same objects). A tensor already in ``dtype`` is returned as is,
    without a copy, and so is a container with nothing in it to cast.

    Args:
        obj: A tensor or a nesting of containers.
        dtype: The floating dtype to cast to.
        include_float64: Also cast float64 tensors.

    Returns:
        The same structure with floating tensors cast.

    Raises:
        TypeError: ``dtype`` is not a floating ``torch.dtype``.

    Example:
        >>> out = cast_tree({"x": torch.ones(2), "n": torch.arange(2)}, torch.bfloat16)
        >>> out["x"].dtype, out["n"].dtype
        (torch.bfloat16, torch.int64)
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"cast_tree needs a floating torch.dtype, got {dtype!r}")
    return tree_map(_caster(dtype, include_float64), obj)


def _caster(dtype: torch.dtype, f64: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """The per-tensor cast of :func:`cast_tree`: FP32/BF16/FP16 (and FP64 if ``f64``) to ``dtype``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == dtype:
            return t
        if t.dtype in _CASTABLE or (f64 and t.dtype == torch.float64):
            return t.to(dtype)
        return t

    return cast


def island_modules(model: nn.Module, policy: Policy) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(qualified_name, module)`` for every FP32 island of ``model`` under ``policy`` (:func:`find_islands`)."""
    return find_islands(model, policy)


def is_prepared(model: nn.Module) -> bool:
    """Say whether ``cast_module`` has already been applied to ``model`` (hooks installed)."""
    return hasattr(model, _HOOKS_ATTR)


def _device_types(module: nn.Module) -> set[str]:
    types = {p.device.type for p in module.parameters()} | {b.device.type for b in module.buffers()}
    return types or {"cpu"}


class _ForwardPatch:
    """The handle of an island's wrapped ``forward``: ``remove()`` puts the previous one back.

    Like ``RemovableHandle`` for hooks, so :func:`uncast_module` undoes hooks and wrapped
    forwards alike. Picklable (no closures), so ``torch.save(model)`` and ``copy.deepcopy``
    of a prepared model work.
    """

    def __init__(self, module: nn.Module, previous: Any) -> None:
        self.module = module
        self.previous = previous  # an instance-level forward set before us, or None (the class's)

    def remove(self) -> None:
        if self.previous is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self.previous




def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in HALF else t


def _to_dtype(dtype: torch.dtype, t: torch.Tensor) -> torch.Tensor:
    return t.to(dtype) if t.dtype != dtype and t.dtype in _CASTABLE else t


def _without_autocast(device_types: tuple[str, ...], fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)`` with autocast disabled on every device type in ``device_types``."""
    if not device_types:
        return fn(*args, **kwargs)
    # A `with` block, not __enter__/__exit__ calls: dynamo traces it (no graph break).
    with torch.autocast(device_type=device_types[0], enabled=False):
        return _without_autocast(device_types[1:], fn, args, kwargs)


#: The functions dynamo puts in a graph for a ``with torch.autocast(...)`` block (an island's, traced).
_AUTOCAST_FNS = ("torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast")


def allow_autocast_in_aot_cache() -> None:
    """Let AOTAutograd's cache store graphs that switch autocast off inside (the FP32 islands' ``with`` blocks).

    AOTAutograd's on-disk cache refuses a graph holding any function outside its allowlist, and
    the autocast enter/exit functions dynamo emits for a ``with torch.autocast(...)`` are not on
    it, so a compiled model with islands re-ran AOTAutograd on every warm start (6-block GPT on a
    CPU: 3.6 s to the first step against 1.6 s for the torch.amp recipe, whose autocast region is
    outside the graph). Both functions are deterministic in their arguments (device type, dtype,
    enabled, cache flag), which are constants of the graph and so part of its cache key: marking
    them cacheable (Inductor's ``unsafe_marked_cacheable_functions``, keyed by torch's version)
    cannot serve a wrong graph. Process-wide; nothing where the config does not exist.
    """
    try:
        import torch._inductor.config as inductor_config
    except ImportError:  # pragma: no cover - a torch without Inductor
        return
    marked = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
    if isinstance(marked, dict):
        for name in _AUTOCAST_FNS:
            marked.setdefault(name, torch.__version__)


def _island_forward(
    module: nn.Module, previous: Any, compute_dtype: torch.dtype, device_types: tuple[str, ...], always: bool,
    *args: Any, **kwargs: Any
) -> Any:
    """An FP32 island's ``forward``: FP32 inputs, autocast off inside, outputs in the compute dtype (0-d ones kept).

    ``always``: cast the outputs even outside autocast (the model's other parameters are half,
    so the next layer computes in the compute dtype whatever the context); ``False`` under FP32
    parameters (``*-mixed``), where the model run outside ``prec.autocast()`` (an evaluation loop,
    ``torch.optim.swa_utils.update_bn``) is an FP32 model and the outputs stay FP32.

    Installed as the module's instance ``forward`` (a ``functools.partial`` of this function),
    not as forward hooks: hooks would have to enter and leave the autocast context in two
    calls, which dynamo cannot trace (one graph break per island under ``torch.compile``),
    while a ``with`` block inside one function compiles into the graph. Hooks the user
    registers on the island still run around it, as they would around any ``forward``.

    Eager calls take a shorter road (this runs once per norm layer per forward): one tensor in
    and out without a tree walk, and autocast switched off by its flag (``torch.autocast``'s
    context manager costs about a dozen Python calls) only where it is on; its cache and
    nesting are the enclosing region's, which this does not leave.
    """
    fn = previous if previous is not None else functools.partial(type(module).forward, module)
    if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:
        x = args[0]
        args = (x.float(),) if x.dtype in HALF else args
    else:
        args, kwargs = tree_map(_to_fp32, args), tree_map(_to_fp32, kwargs)
    on = tuple(filter(torch.is_autocast_enabled, device_types))  # C calls only (hot path)
    if not on:
        out = fn(*args, **kwargs)
    elif torch.compiler.is_compiling():
        out = _without_autocast(on, fn, args, kwargs)
    else:
        for d in on:
            torch.set_autocast_enabled(d, False)
        try:
            out = fn(*args, **kwargs)
        finally:
            for d in on:
                torch.set_autocast_enabled(d, True)
    if out is None or not (on or always):
        return out
    if type(out) is torch.Tensor:
        return out.to(compute_dtype) if out.dtype != compute_dtype and out.dtype in _CASTABLE and out.dim() else out
    return tree_map(functools.partial(_activation_to, compute_dtype), out)


def _refuse_scripted_islands(root: nn.Module, islands: dict[str, nn.Module], policy: Policy) -> None:
    """Raise ``ValueError`` when an FP32 island is, or is inside, a TorchScript module.

    An island computes in FP32 through a Python ``forward`` wrapper: a scripted parent calls its
    children's compiled code and never the wrapper (the island's FP32 weight then meets half
    activations), and a scripted island's copy (``copy.deepcopy``) drops the wrapper. Nothing is
    changed when this raises.
    """
    scripted = [(n, m) for n, m in root.named_modules() if isinstance(m, torch.jit.ScriptModule)]
    for name, island in islands.items():
        holder = next((sn for sn, sm in scripted if any(sub is island for sub in sm.modules())), None)
        if holder is not None:
            what = "is a TorchScript module" if holder == name else f"is inside the TorchScript module {holder!r}"
            raise ValueError(
                f"FP32 island {name!r} ({getattr(island, 'original_name', type(island).__name__)}) of policy "
                f"{policy.label!r} {what}: mixprec runs an island in FP32 through a Python forward wrapper, which "
                "TorchScript bypasses (a scripted parent calls its children's compiled code) or drops (copies), so it "
                "would compute in the compute dtype. Prepare the eager module (script an FP32 export afterwards: "
                "mixprec.checkpoint.fp32_state_dict), or leave it out of the islands (e.g. i=none, or name: globs "
                "that skip it)."
            )


def _activation_to(dtype: torch.dtype, t: torch.Tensor) -> torch.Tensor:
    """An island's output to ``dtype``, but a 0-d one (an auxiliary loss, a statistic) stays as it is: a 0-d FP32
    tensor does not promote the half tensors it meets (type promotion), and rounded it would move the loss."""
    return t.to(dtype) if t.dtype != dtype and t.dtype in _CASTABLE and t.dim() else t


#: Keyword arguments of the root's ``forward`` that the input cast leaves alone: targets, not
#: activations (Hugging Face's ``model(**batch)`` passes regression and soft labels as FP32
#: ``labels``; rounded to BF16 they move by up to 2**-9 relative, in FP16 beyond 65504 they are inf).
#: Only the Hugging Face spellings: ``target``/``targets`` are activations in some models (a
#: siamese ``forward(source, target)``), and left in FP32 they met a half Linear outside autocast.
TARGET_KWARGS = frozenset({"labels", "label"})


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """Floating inputs to the half parameter dtype: the root's input cast (keyword targets excepted: :data:`TARGET_KWARGS`)."""
    cast = functools.partial(_to_dtype, dtype)
    return tree_map(cast, args), {k: v if k in TARGET_KWARGS else tree_map(cast, v) for k, v in kwargs.items()}


def _outputs_to(dtype: torch.dtype, output: Any) -> Any:
    """Floating outputs to ``dtype`` (the root's output cast)."""
    if type(output) is torch.Tensor and (output.dtype == dtype or not output.is_floating_point()):
        return output  # the common case, without the tree walk
    return tree_map(functools.partial(_to_dtype, dtype), output)


def _root_forward(
    module: nn.Module, previous: Any, input_dtype: torch.dtype | None, output_dtype: torch.dtype,
    sentinels: list[tuple[torch.Tensor, torch.dtype]], *args: Any, **kwargs: Any
) -> Any:
    """The prepared root's ``forward``: floating inputs to ``input_dtype`` (if any), outputs to ``output_dtype``.

    ``sentinels``: ``(parameter, dtype)`` for every castable parameter and the dtype the cast gave
    it; a different dtype means the model, or a submodule, was cast again afterwards
    (``model.half()``, ``model.head.float()``, ``.to(dtype)``: they change ``.data`` of the same
    parameter objects), which raises here, at the first forward, instead of a dtype error deep
    inside torch or a run that silently trains in another precision (a loop of attribute reads,
    no Python calls: about 5 us for GPT-2's 148 parameters). The objects themselves are held, not
    looked up by name: FSDP2 swaps in unsharded parameters of its compute dtype for the forward.
    :func:`for_inference` empties the list of a run it ends (it casts on purpose).

    Installed as the root's instance ``forward`` (a ``functools.partial`` of this function that
    carries the original ``forward``'s ``__signature__``, so Hugging Face's Trainer and
    ``generate`` still see the real arguments), not as forward hooks: a compiled module runs its
    hooks outside the compiled frame, so dynamo compiled each hook as a graph of its own (two
    extra graphs, cache lookups and launches per step); inside ``forward`` the casts are part of
    the model's one graph. Hooks registered on the root run around it, as around any ``forward``.
    """
    for p, dt in sentinels:
        if p.dtype is not dt:
            _recast_error(module, p, dt)
    if input_dtype is not None:
        if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:  # one tensor: no tree walk (hot path)
            x = args[0]
            args = (x.to(input_dtype),) if x.dtype != input_dtype and x.dtype in _CASTABLE else args
        else:
            args, kwargs = _cast_inputs(input_dtype, module, args, kwargs)
    out = previous(*args, **kwargs) if previous is not None else type(module).forward(module, *args, **kwargs)
    return _outputs_to(output_dtype, out)


def _recast_error(root: nn.Module, p: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise: ``p`` had ``dtype`` after mixprec's cast and has another now (the model was cast again)."""
    name = next((n for n, q in root.named_parameters() if q is p), "a parameter")
    raise RuntimeError(
        f"parameter {name!r} is {dtype_name(p.dtype)} but mixprec's cast made it {dtype_name(dtype)}: the model (or a "
        "submodule) was cast again after prepare() (model.half(), model.head.float(), model.to(dtype)), which would train it in another "
        "precision than the policy's (or fail inside torch on a dtype mismatch). prepare() does the casting: drop the "
        "cast; to change precision, export with mixprec.checkpoint.fp32_state_dict(prec) and prepare a fresh FP32 "
        "model under the other policy, or call mixprec.uncast_module(model) first."
    )


class AddedParamCheck:
    """``add_param_group``'s check of a prepared run's optimizer: refuse parameters ``prepare`` did not cast.

    A module added to the model after ``prepare`` (a replaced classification head) keeps its FP32
    weights: under a policy that stores parameters in BF16/FP16 it would train in FP32 beside
    them (and evaluation outside ``autocast`` fails on the dtype mismatch). Parameters the cast
    saw (an FP32 island's, a frozen one's) and parameters already in the policy's dtype pass.
    Holds the model weakly; a copy (pickle, deepcopy) checks nothing.
    """

    def __init__(self, model: nn.Module, policy: Policy) -> None:
        self._model: Callable[[], nn.Module | None] | None = weakref.ref(model)
        self.policy = policy

    def __getstate__(self) -> dict[str, Any]:
        return {"_model": None, "policy": self.policy}

    def __call__(self, params: Sequence[Any]) -> None:
        model = self._model() if self._model is not None else None
        if model is None:
            return
        known = {id(p): p for checks in _recast_checks(model) for p, _ in checks}
        if not known:  # keep_dtypes=True, or a run for_inference closed: the user manages the dtypes
            return
        # FP32 parameters of modules the policy keeps in FP32 (a norm added after prepare): as its islands'
        known.update((id(p), p) for _, m in island_modules(_compile_target(model), self.policy)
                     for p in m.parameters() if p.dtype == torch.float32)
        dtype = self.policy.param_dtype
        for p in params:
            if (isinstance(p, torch.Tensor) and p.dtype in _CASTABLE and p.dtype != dtype
                    and known.get(id(p)) is not p):
                raise ValueError(
                    f"add_param_group: a {dtype_name(p.dtype)} parameter of shape {tuple(p.shape)} that prepare() did not "
                    f"cast (the policy stores parameters in {dtype_name(dtype)}): a module added to the model "
                    "after prepare() keeps its weights as built, so it would train in "
                    f"{dtype_name(p.dtype)}. Nothing was added. Add the module before prepare() (in a group with lr=0, "
                    "or frozen, until it should train), or cast it to the policy's dtype first "
                    f"(module.to({dtype}); its masters then "
                    "start from the rounded values)."
                )


def _recast_checks(model: nn.Module) -> Iterator[list[tuple[torch.Tensor, torch.dtype]]]:
    """The ``(parameter, dtype)`` lists of every root patch in ``model`` (every castable parameter at its cast)."""
    for m in model.modules():
        fwd = m.__dict__.get("forward")
        while isinstance(fwd, functools.partial) and fwd.func in (_island_forward, _root_forward):
            if fwd.func is _root_forward:
                yield fwd.args[4]
            fwd = fwd.args[1]


def _drop_recast_checks(model: nn.Module) -> None:
    """Empty the recast checks of every root patch in ``model`` (a run :func:`for_inference` ends and casts)."""
    for checks in _recast_checks(model):
        checks.clear()


def _patched_forward(module: nn.Module, function: Callable[..., Any], *extra: Any) -> _ForwardPatch:
    """Install ``partial(function, module, previous, *extra)`` as ``module.forward``; return its handle."""
    previous = module.__dict__.get("forward")
    try:
        signature: inspect.Signature | None = inspect.signature(module.forward)
    except (TypeError, ValueError):  # a forward inspect cannot read: nothing to carry over
        signature = None
    patch = functools.partial(function, module, previous, *extra)
    if signature is not None:
        patch.__signature__ = signature  # type: ignore[attr-defined]  # inspect reads it before unwrapping the partial
    module.forward = patch
    return _ForwardPatch(module, previous)


def strip_forward_patches(model: nn.Module) -> nn.Module:
    """Put back the ``forward`` every mixprec patch in ``model`` replaced (for FP32 copies of a prepared model)."""
    for module in model.modules():
        for key in [k for k, h in module._forward_pre_hooks.items() if h is _no_fast_path]:
            del module._forward_pre_hooks[key]
        fwd = module.__dict__.get("forward")
        while isinstance(fwd, functools.partial) and fwd.func in (_island_forward, _root_forward):
            previous = fwd.args[1]
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
            fwd = previous
    return model


def _compile_target(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (``OptimizedModule._orig_mod``), or ``model`` itself.

    Casting and hooks go on the inner module: its forward is what the compiled wrapper runs,
    so they are traced into the graph, and names have no ``_orig_mod.`` prefix.
    """
    inner = model
    while isinstance(inner, torch._dynamo.eval_frame.OptimizedModule):
        inner = inner._orig_mod
    return inner


def cast_module(model: nn.Module, policy: Policy | str, *, keep_dtypes: bool = False) -> nn.Module:
    """Cast ``model`` in place for ``policy`` and install its input/output/island hooks.

    Algorithm:
        1. Find the FP32 islands (``policy.fp32_islands``; an island's submodules belong to it).
        2. Cast every floating parameter outside the islands to ``policy.param_dtype`` (in
           place: the ``nn.Parameter`` objects keep their identity, so optimizers built on them
           stay valid); the islands' parameters and buffers (BatchNorm's running statistics)
           become FP32. A parameter or buffer shared by an island and a non-island module
           (tied weights) stays FP32.
        3. Floating buffers outside the islands keep their dtype (``policy.buffers == "keep"``,
           the default of every preset): they are constants or statistics, not trained
           weights, and rounding them loses precision for nothing (a Llama rotary embedding's
           ``inv_freq`` in BF16 shifts every position's angle). With ``b=param`` they are cast
           to ``policy.param_dtype`` with the parameters.
        4. Islands' ``forward``: FP32 inputs, autocast disabled inside, outputs cast to the compute dtype.
        5. The root's ``forward``: floating inputs to ``policy.param_dtype`` when parameters are half
           precision (with FP32 parameters autocast does the casting), floating outputs to
           ``policy.output_dtype``. Both are wrapped ``forward`` methods, not hooks, so that
           ``torch.compile`` traces them into the model's graph (see :func:`_root_forward`).

    FP32 buffers next to half activations: PyTorch's type promotion makes ``x + buf`` FP32
    when ``x`` is BF16/FP16 and ``buf`` an FP32 buffer with at least one dimension (a 0-d
    buffer does not promote). Inside :func:`mixprec.autocast` (every half-compute policy
    trains under it) the next autocast op (``linear``, ``matmul``, ``conv``) casts back to
    the compute dtype, so such a model runs, with the elementwise ops between in FP32. Run
    outside autocast, a half-parameter model then fails in that matmul with a dtype mismatch
    ("mat1 and mat2 must have the same dtype"): forward under ``mixprec.autocast``, or cast
    the buffers with ``b=param``. Models that upcast their buffers themselves (Hugging Face
    rotary embeddings compute in FP32 and cast ``cos``/``sin`` to the activation dtype) run
    either way.

    Args:
        model: The model (its parameters normally FP32).
        policy: A :class:`Policy` or anything :meth:`Policy.parse` accepts.
        keep_dtypes: Cast nothing (steps 2-3 skipped) and leave the inputs as they come (no input
            cast in step 5); islands whose parameters are all FP32 still compute in FP32, and
            outputs are still cast. What ``mixprec.apex`` does for Apex's uncast models
            (``cast_model_type=False``, or O1's ``None``), whose parameters Apex did not touch.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: ``model`` was already prepared (hooks installed); call
            :func:`uncast_module` first or prepare a fresh model.
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> m = cast_module(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)), "bf16-master")
        >>> m[0].weight.dtype, m[1].weight.dtype
        (torch.bfloat16, torch.float32)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"cast_module needs an nn.Module, got {type(model).__name__}")
    policy = Policy.parse(policy)
    if is_prepared(model):
        raise ValueError(
            f"this model was already prepared for policy {getattr(model, _POLICY_ATTR)!r}; preparing it again "
            f"for {str(policy)!r} would stack hooks. Build a fresh model, or call mixprec.uncast_module(model) first."
        )
    root = _compile_target(model)
    islands = dict(island_modules(root, policy))
    if policy.compute_dtype != torch.float32:
        _refuse_scripted_islands(root, islands, policy)
    if keep_dtypes:  # an island whose parameters stay half cannot compute in FP32: not an island then
        islands = {n: m for n, m in islands.items()
                   if all(p.dtype == torch.float32 for p in m.parameters() if p.dtype.is_floating_point)}
    target = policy.param_dtype
    with torch.no_grad():
        for module in islands.values() if not keep_dtypes else ():
            for p in module.parameters():
                if p.dtype in _CASTABLE and p.dtype != torch.float32:
                    p.data = p.data.float()
            _cast_buffers(module, torch.float32, skip=set())
        # After the islands' casts: _cast_buffers replaces buffers by new tensors.
        island_tensor_ids = {id(t) for m in islands.values() for t in (*m.parameters(), *m.buffers())}
        for p in model.parameters() if not keep_dtypes else ():
            if id(p) not in island_tensor_ids and p.dtype in _CASTABLE and p.dtype != target:
                p.data = p.data.to(target)
        if policy.buffers == "param" and not keep_dtypes:
            _cast_buffers(model, target, skip=island_tensor_ids)
        if not keep_dtypes:
            _cast_weight_buffers(model)

    handles: list[RemovableHandle | _ForwardPatch | _AttrPatch] = []
    devices = tuple(sorted(_device_types(model)))
    if policy.compute_dtype != torch.float32:
        for module in islands.values():
            always = policy.param_dtype != torch.float32
            handles.append(_patched_forward(module, _island_forward, policy.compute_dtype, devices, always))
        if islands:
            allow_autocast_in_aot_cache()
    half_inputs = policy.param_dtype != torch.float32 and root not in islands.values() and not keep_dtypes
    input_dtype = policy.param_dtype if half_inputs else None
    sentinels: list[tuple[torch.Tensor, torch.dtype]] = []
    if not keep_dtypes:
        # every castable parameter: a cast of one submodule (model.head.float()) changes only its own
        sentinels = [(p, p.dtype) for p in model.parameters() if p.dtype in _CASTABLE]
    handles.append(_patched_forward(root, _root_forward, input_dtype, policy.output_dtype, sentinels))
    handles.extend(_guard_fast_paths(model, policy.compute_dtype != torch.float32 and "cpu" in devices))
    object.__setattr__(model, _HOOKS_ATTR, handles)
    object.__setattr__(model, _POLICY_ATTR, str(policy))
    return model


def check_fp16_range(model: nn.Module, policy: Policy, *, inference: bool = False) -> None:
    """Refuse finite weights that the cast to FP16 would turn into inf (every step would then skip).

    Weights of every wider floating dtype are checked: FP32, FP64 and BF16 (a model loaded with
    ``torch_dtype=torch.bfloat16`` and prepared under an FP16 policy for a GPU without BF16).
    ``inference``: the cast of :func:`mixprec.checkpoint.for_inference` (the message says so).

    One reduction per parameter and one host read per device, at ``prepare`` only. FSDP2 shards
    (DTensors): each rank's local maximum, then one all-reduce (MAX) so every rank decides alike
    (a collective: every rank calls ``prepare``).
    """
    from ._dist import is_distributed, is_dtensor, local_tensor

    islands = [m for _, m in island_modules(model, policy)]
    kept = {id(t) for m in islands for t in m.parameters()}
    named: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in model.named_parameters() if id(p) not in kept
             and p.dtype in (torch.float32, torch.float64, torch.bfloat16) and (p.numel() or is_dtensor(p))]
    if inference:  # for_inference also casts the running statistics of BatchNorms outside the islands
        in_island = {id(sub) for m in islands for sub in m.modules()}
        named += [(f"{mn}.{bn}" if mn else bn, b) for mn, m in model.named_modules()
                  if isinstance(m, nn.modules.batchnorm._BatchNorm) and id(m) not in in_island
                  for bn, b in m.named_buffers(recurse=False) if b.dtype.is_floating_point and b.numel()]
    if not named:
        return
    sharded = any(is_dtensor(p) for _, p in named)
    with torch.no_grad():
        by_device: dict[torch.device, list[int]] = {}
        for i, (_, p) in enumerate(named):
            by_device.setdefault(local_tensor(p).device, []).append(i)
        peaks = torch.zeros(len(named))
        for idx in by_device.values():  # one host read per device
            local = [local_tensor(named[i][1]).detach() for i in idx]
            peaks[idx] = torch.stack([t.abs().amax() if t.numel() else t.new_zeros(()) for t in local]).float().cpu()
        if sharded and is_distributed():
            dist = torch.distributed
            dev = next(iter(by_device))
            both = peaks.to(dev)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            peaks = both.cpu()
    big = (peaks >= 65520.0).nonzero().flatten().tolist()  # what rounds to inf (65504 + half an ulp)
    if big:
        name = named[big[0]][0]
        owner = name.rpartition(".")[0]  # a root's own parameter has no module to make an island of
        island = f"keep the module in FP32 with an island (i=norm+name:{owner}), " if owner else ""
        if inference:
            island = f"keep the module in FP32 (fp32_islands=('norm', 'name:{owner}')), " if owner else ""
            raise ValueError(
                f"for_inference(..., 'fp16'): {'parameter' if isinstance(named[big[0]][1], nn.Parameter) else 'buffer'} "
                f"{name!r} has values up to {float(peaks[big[0]]):.4g}, beyond "
                f"FP16's maximum 65504: cast to FP16 they would become inf ({len(big)} such parameter(s)). Nothing was "
                f"cast. Use 'bf16' (FP32's range), {island}or rescale those weights."
            )
        raise ValueError(
            f"parameter {name!r} has values up to {float(peaks[big[0]]):.4g}, beyond FP16's maximum 65504: cast to FP16 "
            f"for policy {policy.label!r} they become inf and every step would be skipped ({len(big)} such "
            f"parameter(s)). Use a BF16 policy (FP32's range), {island}or rescale those weights."
        )


def guard_assign(model: nn.Module) -> None:
    """Refuse ``load_state_dict(..., assign=True)`` on a prepared run's model (hooks removed by :func:`uncast_module`).

    Installed by ``MixedPrecision.prepare`` (a run's optimizer and masters hold the parameters),
    not by :func:`cast_module` or :func:`for_inference` alone.
    """
    handles = model.__dict__.get(_HOOKS_ATTR)
    if handles is not None:
        # TorchScript modules take no load-state-dict hooks (torch raises): their parent's hook, which runs before
        # their tensors are loaded, refuses for them.
        script = torch.jit.ScriptModule
        handles.extend(m.register_load_state_dict_pre_hook(_refuse_assign) for m in model.modules()
                       if not isinstance(m, script) and (m._parameters or m._buffers or any(
                           isinstance(c, script) and any(True for _ in c.parameters()) for c in m.children())))


def _refuse_assign(module: nn.Module, state_dict: Any, prefix: str, local_metadata: dict[str, Any], *args: Any) -> None:
    """A load-state-dict pre-hook: ``load_state_dict(..., assign=True)`` would swap a cast model's tensors out.

    The loaded tensors would replace the parameters the optimizer (and its FP32 masters) hold,
    in the loaded dtypes: training would go on with the old ones, silently, at another precision.
    Runs before the module's own tensors are touched (a parent's hook before its children's), so
    nothing is changed. A module whose tensors are all on the meta device is left to torch.
    """
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    tensors = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
    if tensors and all(t.device.type == "meta" for t in tensors):
        return
    where = prefix[:-1] or type(module).__name__
    raise RuntimeError(
        f"load_state_dict(..., assign=True) on a model mixprec prepared (at {where!r}): it would replace the model's "
        "parameters by the loaded tensors, in their own dtypes, while the optimizer and its FP32 masters keep the old "
        "ones (training would silently stop, at another precision). Nothing was loaded. Load without assign=True "
        "(it copies into the existing parameters, casting), use prec.load_model_state_dict(state_dict), or load "
        "before prepare()."
    )


def _no_fast_path(module: nn.Module, args: Any) -> None:
    """A forward pre-hook that does nothing: its presence turns torch's encoder-layer fast path off."""
    return None


class _AttrPatch:
    """Set ``module.<name>`` to ``value``; ``remove()`` restores the previous value (a handle of ``cast_module``)."""

    def __init__(self, module: nn.Module, name: str, value: Any) -> None:
        self.module, self.name, self.previous = module, name, getattr(module, name)
        setattr(module, name, value)

    def remove(self) -> None:
        setattr(self.module, self.name, self.previous)


def _guard_fast_paths(model: nn.Module, cpu_autocast: bool) -> list[RemovableHandle | _AttrPatch]:
    """Keep torch's Transformer inference fast path off layers whose parameters have several dtypes
    (and off layers with FP32 weights when the policy autocasts on a CPU: ``cpu_autocast``).

    In ``eval()`` without gradients, ``nn.TransformerEncoderLayer`` calls one fused kernel
    (``torch._transformer_encoder_layer_fwd``) on its weights directly, past the FP32 islands'
    forwards (its norms), and that kernel refuses FP32 norms beside half linears ("expected
    scalar type Float but found BFloat16"); ``nn.TransformerEncoder`` first packs the batch into a
    nested tensor for that path. torch skips the layer's fast path when a forward hook is attached,
    so such a layer gets a no-op pre-hook and its encoder ``use_nested_tensor = False``: the layer
    runs its ordinary modules, islands included, with the same math. Layers of one dtype keep
    the fast path, except under a policy that autocasts on a CPU: torch leaves the fast path off
    under CUDA autocast but takes it under CPU autocast, where, for a post-norm layer given a
    padding mask, it fails the same way (FP32 weights, half activations; plain ``torch.autocast``
    too, torch 2.13).
    """
    handles: list[RemovableHandle | _AttrPatch] = []
    mixed: set[int] = set()
    for module in model.modules():
        layer = isinstance(module, nn.TransformerEncoderLayer)
        dtypes = {p.dtype for p in module.parameters() if p.dtype.is_floating_point} if layer else set()
        if len(dtypes) > 1 or (cpu_autocast and torch.float32 in dtypes):
            mixed.add(id(module))
            handles.append(module.register_forward_pre_hook(_no_fast_path))
    for module in model.modules():
        nested = isinstance(module, nn.TransformerEncoder) and getattr(module, "use_nested_tensor", False)
        if nested and any(id(layer) in mixed for layer in module.modules()):
            handles.append(_AttrPatch(module, "use_nested_tensor", False))
    return handles


def cast_root(model: nn.Module, policy: Policy | str, *, keep_dtypes: bool = False) -> _ForwardPatch:
    """Install only the root's input/output casts of :func:`cast_module` on ``model``; return the handle.

    For a model whose parameters a :func:`cast_module` of a container around it already cast
    (``mixprec.apex``: the models one optimizer spans are prepared together, and each keeps the
    entry and exit casts of its own ``forward``, as Apex patched each model's). ``remove()`` on
    the handle undoes it.
    """
    policy = Policy.parse(policy)
    root = _compile_target(model)
    half = policy.param_dtype != torch.float32 and not policy.is_fp32_island(root, "")
    return _patched_forward(root, _root_forward, policy.param_dtype if half else None, policy.output_dtype, [])


def uncast_module(model: nn.Module) -> nn.Module:
    """Remove the hooks ``cast_module`` installed (dtypes are left as they are).

    Parameters and buffers keep the dtypes ``cast_module`` gave them: buffers it left alone
    (the default ``b=keep``) are still in their original dtype, buffers cast with ``b=param``
    and island buffers stay cast. Call ``model.float()`` for an all-FP32 model.

    The ``MixedPrecision`` run that prepared ``model`` (if any) is closed first, as by
    :func:`for_inference`: without the casts it would go on training silently outside its policy
    (inputs and outputs no longer cast, the dtype checks gone), so its later calls raise a
    ``ValueError`` that says so, and its gradient hooks come off (a new ``prepare`` of the model
    starts clean).

    Args:
        model: A model prepared by :func:`cast_module` (an unprepared model is returned as is).

    Returns:
        ``model`` itself.
    """
    for m in (model, getattr(model, "_orig_mod", None)):
        ref = _RUN_CLOSERS.pop(m, None) if isinstance(m, nn.Module) else None
        close = ref() if ref is not None else None
        if close is not None:
            close(_UNCAST_REASON)
    for h in reversed(getattr(model, _HOOKS_ATTR, [])):  # last installed first: the root's forward wraps an island's
        h.remove()
    for attr in (_HOOKS_ATTR, _POLICY_ATTR):
        if hasattr(model, attr):
            object.__delattr__(model, attr)
    return model


def _cast_weight_buffers(model: nn.Module) -> None:
    """Give buffers that are part of a weight's computation that weight's dtype.

    Floating buffers keep their dtype by default (step 3 of :func:`cast_module`), but a few are
    multiplied with the weight they reparametrize, and torch refuses FP32 beside half there
    ("addmv input tensors must have the same dtype"): the power-iteration vectors of
    ``torch.nn.utils.spectral_norm`` (its forward pre-hook, used by GAN code) and the ``base`` of
    ``torch.nn.utils.parametrizations.orthogonal``. They take the dtype ``model.to(dtype)`` would
    give them. (``parametrizations.spectral_norm`` casts its vectors itself and keeps FP32 ones.)
    """
    from torch.nn.utils.spectral_norm import SpectralNorm

    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            name = hook.name if isinstance(hook, SpectralNorm) else None
            weight = getattr(module, f"{name}_orig", None) if name is not None else None
            if isinstance(weight, torch.Tensor):
                for leaf in (f"{name}_u", f"{name}_v"):
                    b = module._buffers.get(leaf)
                    if b is not None and b.dtype in _CASTABLE and b.dtype != weight.dtype:
                        module._buffers[leaf] = b.to(weight.dtype)
        lists = getattr(module, "parametrizations", None)
        for plist in lists.values() if isinstance(lists, nn.ModuleDict) else ():
            original = getattr(plist, "original", None)
            for sub in plist.children():
                b = sub._buffers.get("base") if type(sub).__name__ == "_Orthogonal" else None
                if isinstance(original, torch.Tensor) and b is not None and b.dtype in _CASTABLE and b.dtype != original.dtype:
                    sub._buffers["base"] = b.to(original.dtype)


def _cast_buffers(root: nn.Module, dtype: torch.dtype, skip: set[int]) -> None:
    """Cast ``root``'s FP32/BF16/FP16 buffers to ``dtype``, except those whose ``id`` is in ``skip``.

    A buffer registered under several names (shared between modules) is cast once and the
    one new tensor is set under every name, so the modules still share it.
    """
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (old, new); old kept alive so ids stay unique
    for module in root.modules():
        for leaf, b in list(module._buffers.items()):
            if b is None or id(b) in skip or b.dtype not in _CASTABLE or b.dtype == dtype:
                continue
            if id(b) not in done:
                done[id(b)] = (b, b.to(dtype))
            module._buffers[leaf] = done[id(b)][1]


#: A prepared model -> the (weakly held) method of its ``MixedPrecision`` that closes the run when
#: :func:`for_inference` casts the model (``MixedPrecision._close_for_inference``).
_RUN_CLOSERS: weakref.WeakKeyDictionary[nn.Module, weakref.WeakMethod[Callable[..., None]]] = weakref.WeakKeyDictionary()


_UNCAST_REASON = (
    "this run's model was uncast by mixprec.uncast_module(), which closed the run (without its casts it would train "
    "outside the policy). To train on under this run, do not uncast; to prepare the model again, build a new "
    "MixedPrecision and load this run's prec.state_dict() (still readable) after its prepare()."
)


def register_run(model: nn.Module, close: Callable[..., None]) -> None:
    """Remember the bound method that :func:`for_inference` calls before it casts ``model`` (weakly: no cycle kept alive)."""
    _RUN_CLOSERS[model] = weakref.WeakMethod(close)


def enclosing_run_model(module: nn.Module) -> nn.Module | None:
    """The model of a live run that contains ``module`` as a submodule (not as itself), or ``None``."""
    for run_model, ref in list(_RUN_CLOSERS.items()):
        if ref() is None:  # the run is gone (garbage-collected): nothing holds the model's parameters
            _RUN_CLOSERS.pop(run_model, None)
        elif run_model is not module and any(m is module for m in run_model.modules()):
            return run_model
    return None


def run_of(model: Any) -> Any:
    """The live ``MixedPrecision`` that prepared ``model`` (or its compile target), or ``None``."""
    for m in (model, getattr(model, "_orig_mod", None)):
        ref = _RUN_CLOSERS.get(m) if isinstance(m, nn.Module) else None
        method = ref() if ref is not None else None
        if method is not None:
            return getattr(method, "__self__", None)
    return None


def for_inference(
    model: nn.Module, dtype: torch.dtype | str = "bf16", *, fp32_islands: Iterable[str] = ("norm",)
) -> nn.Module:
    """Cast a trained model in place for evaluation in half precision, FP32 islands kept.

    Weight memory halves; normalization layers (or the islands given) stay FP32. Floating
    inputs are cast to ``dtype`` on the way in and outputs come back in FP32. The model is
    put in ``eval()`` mode. A model prepared for training has its hooks replaced, and its run
    ends here (also when ``model`` is a module inside the run's model or around it): the weights
    it holds are cast (for the FP32 masters' precision, cast an FP32 model loaded from
    ``mixprec.checkpoint.fp32_state_dict(prec)``), and the ``MixedPrecision`` is closed (its ``backward``, ``step``, ... then raise a ``ValueError``
    saying so: training on would train the cast model). A module inside a run whose other layers
    hold half weights (``*-master``, ``bf16-pure``) returns its outputs in their dtype, so the
    whole model still runs. To evaluate in the middle of training use
    ``with torch.no_grad(), prec.autocast(): model(x)`` instead. No autocast runs here: a
    ``forward`` that upcasts an activation itself (``h(x.float())`` with a half ``h``) fails with a
    dtype mismatch, as in any half model; call such a model under ``torch.autocast(device, dtype)``
    or make that layer an FP32 island (``fp32_islands=("norm", "name:h")``).

    Args:
        model: The trained model.
        dtype: ``"bf16"`` or ``"fp16"``.
        fp32_islands: As in :class:`Policy`.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: a dtype other than bf16/fp16; an FP32 island entry that matches no module.
    """
    dt = parse_dtype(dtype)
    if dt not in HALF:
        raise ValueError(f"for_inference casts to 'bf16' or 'fp16', got {dtype!r}; for FP32 just call model.eval().")
    # (a str is one entry, as Policy reads it: tuple("norm") would be four one-letter islands)
    islands = (fp32_islands,) if isinstance(fp32_islands, str) else tuple(fp32_islands)
    policy = Policy(dt, dt, torch.float32, fp32_islands=islands)
    target = _compile_target(model)  # a torch.compile'd model: the module it wraps
    policy.check_islands(target)
    if dt == torch.float16:
        check_fp16_range(target, policy, inference=True)  # before anything changes
    # Every live run whose model this cast touches (the model itself, a module around it, one inside it).
    inside = set(map(id, target.modules()))
    for run_model, ref in list(_RUN_CLOSERS.items()):
        if id(run_model) in inside or any(m is target for m in run_model.modules()):
            outer = _compile_target(run_model)
            if outer is not target and id(outer) not in inside and is_prepared(outer):
                # The target is a layer of a run whose other layers hold half weights: hand them its outputs in
                # their dtype (FP32 outputs would meet a BF16 Linear next: a dtype error in the whole model's forward).
                run_dtype = Policy.parse(getattr(outer, _POLICY_ATTR)).param_dtype
                if run_dtype != torch.float32:
                    policy = dataclasses.replace(policy, output_dtype=run_dtype)
            _RUN_CLOSERS.pop(run_model, None)
            # a run around the target keeps its casts (its other layers) but not the check that its weights keep
            # the dtypes it gave them: this cast changes some on purpose
            _drop_recast_checks(_compile_target(run_model))
            close = ref()
            if close is not None:
                close()
    # The model and any prepared model inside it (a wrapper of a run's model); a model compiled before prepare()
    # carries the prepared marks on its compile wrapper, the patches on the module it wraps.
    if model is not target and _HOOKS_ATTR in model.__dict__:  # compiled before prepare(): the marks on the wrapper
        uncast_module(model)
    for m in list(target.modules()):
        if _compile_target(m) is m and is_prepared(m):  # (a compiled module: its _orig_mod is visited itself)
            uncast_module(m)
    revert_linears(target)  # FP8 linears (f8= policies) evaluate as the plain linears they were
    cast_module(target, policy)
    # A BatchNorm outside the islands (fp32_islands=() for an all-half model): its running statistics
    # take the dtype too, as model.half() gives them (FP32 statistics beside a half weight: torch's
    # "expected scalar type Half but found Float" at the first forward). prepare() refuses this
    # for training; in eval the statistics are constants.
    kept = {id(m) for _, island in island_modules(target, policy) for m in island.modules()}
    for m in target.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and id(m) not in kept:
            _cast_buffers(m, dt, skip=set())
    return model.eval()
