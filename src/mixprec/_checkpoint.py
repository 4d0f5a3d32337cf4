"""Checkpoints that survive a crash and refuse to run code: ``save`` and ``load``.

``save`` writes atomically: the checkpoint goes to a temporary file in the target's directory,
which is flushed and ``fsync``-ed, renamed over the target (``os.replace``, atomic on POSIX and
Windows) and the directory is ``fsync``-ed so that the rename itself is durable. A crash (or a
full disk, or an exception) at any point leaves either the old checkpoint or the new one, never
a half-written file under the target's name.

``load`` reads with ``torch.load(..., weights_only=True)``, so a file from an untrusted source
cannot execute code, then checks the format marker, the format version, a CRC32 over the
whole state and the mixprec state dict inside (its version and policy). Every failure is a
:class:`CheckpointError` (a ``ValueError``) that names the file and what to do.

File format (a ``torch.save`` zip file holding one dict)::

    {
        "format": "mixprec.checkpoint",     # marker: a non-mixprec file is recognised
        "format_version": 1,                # of this envelope; load refuses newer ones
        "mixprec_version": "0.1.0",         # informational
        "torch_version": "2.13.0+cpu",      # informational
        "checksum": {"algorithm": "crc32-v2", "value": int, "tensors": int, "bytes": int},
        "state": {...},                     # MixedPrecision.state_dict() (+ your own extra keys)
    }

The checksum covers every entry of ``state`` in order: each tensor's dtype, shape and bytes
(torch does not check the zip's CRCs, so a flipped bit in a tensor would otherwise load
silently), the ``repr`` of every other value with its key path, and every container (kind and
length, with its key path: an empty dict's key is covered too). Files written before containers
were covered (``"algorithm": "crc32"``) are verified the old way.

A file written by ``torch.save(prec.state_dict(), path)`` (no envelope) loads too, without the
checksum check.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import tempfile
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Union

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from ._dtypes import HALF
from ._master import model_params_of
from ._policy import Policy

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "STATE_VERSION",
    "CheckpointError",
    "check_model_state",
    "check_optimizer_entries",
    "convert_state_dict",
    "fp32_state_dict",
    "load",
    "parameter_names",
    "save",
    "validate_state",
]

#: The marker in every file ``save`` writes.
FORMAT = "mixprec.checkpoint"
#: Version of the envelope described in the module docstring.
FORMAT_VERSION = 1

PathLike = Union[str, "os.PathLike[str]"]
_LEAVES = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded: truncated, corrupted, foreign, unsafe or too new.

    The message names the file, what is wrong with it and what to do.
    """


# ----- saving ---------------------------------------------------------------------------------------
def save(state: Any, path: PathLike) -> None:
    """Write a mixprec checkpoint atomically: a crash mid-write leaves the previous file intact.

    Algorithm:
        1. Check ``state`` (a mixprec state dict of loadable types) and compute its CRC32.
        2. ``torch.save`` the envelope into ``.<name>.<host>.<pid>.<random>.tmp`` in the target's
           directory; flush and ``fsync`` it.
        3. ``os.replace`` it over ``path`` (atomic), then ``fsync`` the directory (POSIX).
        4. Delete the temporary files of earlier saves to ``path`` whose process is gone.
        On any exception the temporary file is removed and the target is untouched.

    A process killed between 2 and 3 leaves its temporary file behind (the target is intact).
    The next successful save to the same path on the same host deletes it (step 4: same host
    name, and no process with its PID is alive); files of other hosts, or of a live process
    (a concurrent writer), are left alone. Checkpoints can be gigabytes, so they do not pile up.

    Args:
        state: ``MixedPrecision.state_dict()`` (you may add your own keys, e.g. ``"epoch"``, with
            values ``torch.load(weights_only=True)`` accepts: tensors, numbers, strings, None,
            and lists/tuples/dicts of them; tensor subclasses registered with
            ``torch.serialization.add_safe_globals``, such as torchao's low-bit optimizer states, are
            checksummed through their inner tensors), or a prepared ``MixedPrecision`` (its state dict is taken).
        path: The checkpoint file. Its directory must exist.

    Raises:
        TypeError: ``state`` is not a state dict or holds a value ``weights_only`` loading would
            refuse (the message gives its key path); ``path`` is not a path.
        ValueError: ``state`` is not a mixprec state dict (wrong keys, version or policy).
        FileNotFoundError: the directory does not exist.
        OSError: writing failed (e.g. disk full); the previous checkpoint is intact.

    Host syncs: every tensor is copied to the CPU (``torch.save`` does the same) and checksummed.

    Example:
        >>> mixprec.save(prec.state_dict(), "ckpt.pt")  # doctest: +SKIP
        >>> prec.load_state_dict(mixprec.load("ckpt.pt"))  # doctest: +SKIP
    """
    if not isinstance(state, Mapping) and callable(getattr(state, "state_dict", None)):
        state = state.state_dict()  # a prepared MixedPrecision
    if not isinstance(state, Mapping):
        raise TypeError(
            f"mixprec.save(state, path) needs the dict MixedPrecision.state_dict() returns, got {type(state).__name__}."
        )
    validate_state(state)
    _parse_policy(state["policy"], where="save()")
    target = _check_path(path, "save")
    directory = os.path.dirname(target) or "."
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"mixprec.save: the directory {directory!r} does not exist; create it first "
                                "(os.makedirs(d, exist_ok=True)).")
    crc, n_tensors, n_bytes = _checksum(state, check_types=True)
    envelope = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mixprec_version": _mixprec_version(),
        "torch_version": str(torch.__version__),  # TorchVersion is a str subclass weights_only refuses
        "checksum": {"algorithm": CHECKSUM, "value": crc, "tensors": n_tensors, "bytes": n_bytes},
        "state": state,
    }
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(target) + f"{_host()}.{os.getpid()}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(envelope, f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        _copy_mode(target, tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)  # makes the rename itself durable
    _remove_stale_temporaries(target)


def _tmp_prefix(target: str) -> str:
    return f".{os.path.basename(target)}."


def _host() -> str:
    # dots separate the fields of the temporary name: keep the host name free of them
    return (os.uname().nodename if hasattr(os, "uname") else "host").replace(".", "_") or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's) or cannot tell: keep its file
    return True


def _remove_stale_temporaries(target: str) -> list[str]:
    """Delete ``.<name>.<host>.<pid>.*.tmp`` files next to ``target`` left by dead processes of this host.

    Returns the removed paths. Files of other hosts or of live processes are kept; errors are
    ignored (cleanup must never fail a save that already succeeded).
    """
    directory = os.path.dirname(target) or "."
    prefix = _tmp_prefix(target) + _host() + "."
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        pid_text = name[len(prefix):].split(".", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or _pid_alive(int(pid_text)):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    return removed


def _check_path(path: Any, what: str) -> str:
    if isinstance(path, (str, os.PathLike)):
        p = os.fspath(path)
        if isinstance(p, str):
            if not p or os.path.isdir(p) or (what == "save" and p.endswith(("/", os.sep))):
                raise CheckpointError(
                    f"mixprec.{what}(..., path): {p!r} is " + ("empty" if not p else "a directory")
                    + "; pass a file path such as 'ckpt/step1000.pt'."
                )
            return os.path.abspath(p)
    raise TypeError(
        f"mixprec.{what}(..., path) needs a file path (str or os.PathLike), got {type(path).__name__}; atomic writes and "
        "clear errors need a real file. For an in-memory buffer use torch.save/torch.load(..., weights_only=True)."
    )


def _copy_mode(target: str, tmp: str) -> None:
    """Give the new file the old one's permissions, or what ``open()`` would (mkstemp makes it 0600)."""
    try:
        mode = os.stat(target).st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    with contextlib.suppress(OSError):
        os.chmod(tmp, mode)


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask must set it to read it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _fsync_directory(directory: str) -> None:
    if os.name != "posix":  # Windows cannot open a directory; NTFS journals the rename
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems (e.g. certain network mounts) refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _mixprec_version() -> str:
    from ._version import __version__

    return __version__


# ----- the checksum ---------------------------------------------------------------------------------
def _walk(obj: Any, path: str, check_types: bool, dicts: bool = True) -> Iterator[tuple[str, Any]]:
    """Yield ``(key path, leaf)`` in a deterministic order; raise TypeError for unloadable values.

    Containers are entries too (their kind and length), so an empty one, and its key, is covered:
    a renamed key whose value is ``{}`` changes the checksum. ``dicts=False`` is the walk of
    checksums written before dicts were recorded (``"crc32"``; now ``"crc32-v2"``).
    """
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) and _flattenable(obj):
            # A wrapper subclass registered for weights_only loading (torchao's low-bit optimizer
            # states): its inner tensors and its flatten context are the entry.
            if check_types and not _safe_global(type(obj)):
                raise TypeError(
                    f"mixprec.save: {path} is a {type(obj).__name__} (a tensor subclass) that torch.load(weights_only=True) "
                    "refuses (not registered with torch.serialization.add_safe_globals); register it, or convert it "
                    "to a plain tensor first."
                )
            names, ctx = obj.__tensor_flatten__()  # type: ignore[attr-defined]  # (_flattenable)
            yield path, ("subclass", f"{type(obj).__module__}.{type(obj).__qualname__}", repr(ctx))
            for name in names:
                yield from _walk(getattr(obj, name), f"{path}.{name}", check_types, dicts)
            return
        if check_types and type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(
                f"mixprec.save: {path} is a {type(obj).__name__} (a tensor subclass), which torch.load(weights_only=True) "
                "may refuse; save sharded/distributed state with torch.distributed.checkpoint, or convert it to a plain "
                "tensor first."
            )
        yield path, obj
    elif isinstance(obj, (dict, OrderedDict)):
        if check_types and type(obj) not in (dict, OrderedDict):
            raise TypeError(f"mixprec.save: {path} is a {type(obj).__name__}; use a plain dict.")
        if dicts:
            yield path, ("dict", len(obj))
        for k, v in obj.items():
            if check_types and not isinstance(k, (str, int, float, bool, type(None))):
                raise TypeError(f"mixprec.save: {path} has a key of type {type(k).__name__}; use str or int keys.")
            yield from _walk(v, f"{path}[{k!r}]", check_types, dicts)
    elif isinstance(obj, (list, tuple)):
        if check_types and type(obj) not in (list, tuple):
            raise TypeError(
                f"mixprec.save: {path} is a {type(obj).__name__}; torch.load(weights_only=True) accepts plain lists and "
                "tuples only (convert it, e.g. tuple(x) or x._asdict())."
            )
        yield path, ("list" if isinstance(obj, list) else "tuple", len(obj))
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]", check_types, dicts)
    elif type(obj) in _LEAVES or (not check_types and isinstance(obj, _LEAVES)):
        yield path, obj  # exact types: weights_only refuses subclasses (IntEnum, TorchVersion, ...)
    else:
        raise TypeError(
            f"mixprec.save: {path} is a {type(obj).__name__}, which torch.load(weights_only=True) refuses to load (it "
            "would need to run code from the file). Store tensors, numbers, strings, None and lists/tuples/dicts of "
            "them; convert other objects (e.g. to a dict) first."
        )


def _flattenable(t: torch.Tensor) -> bool:
    """A traceable wrapper subclass (``__tensor_flatten__``) other than a DTensor (sharded: saved with DCP)."""
    return hasattr(type(t), "__tensor_flatten__") and type(t).__name__ != "DTensor"


def _safe_global(cls: type) -> bool:
    """Whether ``torch.load(weights_only=True)`` may construct ``cls`` (``torch.serialization.add_safe_globals``)."""
    return any((g[0] if isinstance(g, tuple) else g) is cls for g in torch.serialization.get_safe_globals())


def _tensor_bytes(t: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """A zero-copy buffer over ``t``'s bytes (CPU, contiguous) and the tensor that owns them."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.int_repr()
    t = t.resolve_conj().resolve_neg().to("cpu").contiguous()
    n = t.numel() * t.element_size()
    return (ctypes.c_char * n).from_address(t.data_ptr()), t  # keep ``t`` alive while the buffer is read


#: The checksum :func:`save` writes; ``"crc32"`` (dicts not recorded) is still verified on load.
CHECKSUM = "crc32-v2"


def _checksum(state: Mapping[str, Any], *, check_types: bool = False, algorithm: str = CHECKSUM) -> tuple[int, int, int]:
    """CRC32 over every entry of ``state`` (see the module docstring); returns (crc, tensors, bytes)."""
    crc, n_tensors, n_bytes = 0, 0, 0
    for path, leaf in _walk(state, "state", check_types, dicts=algorithm != "crc32"):
        if isinstance(leaf, torch.Tensor):
            n_tensors += 1
            crc = zlib.crc32(f"{path}:T:{leaf.dtype}:{tuple(leaf.shape)}".encode(), crc)
            if leaf.numel() and leaf.device.type != "meta":
                buf, _owner = _tensor_bytes(leaf)
                crc = zlib.crc32(buf, crc)
                n_bytes += len(buf)
        else:
            crc = zlib.crc32(f"{path}:{type(leaf).__name__}:{leaf!r}".encode(), crc)
    return crc, n_tensors, n_bytes


# ----- loading --------------------------------------------------------------------------------------
def load(
    path: PathLike,
    *,
    map_location: Any = "cpu",
    expected_policy: Policy | str | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` safely and check it before you use it.

    Args:
        path: The checkpoint file.
        map_location: As ``torch.load`` (default ``"cpu"``; ``MixedPrecision.load_state_dict``
            copies the values onto the run's device).
        expected_policy: When given, the checkpoint must have been saved under this policy
            (compared as :class:`Policy`, so presets and grammar strings both work).
        verify: Recompute the CRC32 and compare (reads every byte once more; about 3 GB/s).

    Returns:
        The state dict, ready for ``MixedPrecision.load_state_dict``; your extra keys included.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        CheckpointError: (a ``ValueError``) the file is empty, truncated or corrupted (checksum
            mismatch), not a PyTorch file, holds objects ``weights_only`` refuses to unpickle
            (code execution), is not a mixprec checkpoint, has a newer format version, holds an
            invalid state or policy, or its policy differs from ``expected_policy``.
        TypeError: ``path`` is not a path.

    Example:
        >>> state = mixprec.load("ckpt.pt", expected_policy="fp16-master")  # doctest: +SKIP
    """
    file = _check_path(path, "load")
    if not os.path.exists(file):
        raise FileNotFoundError(f"mixprec.load: no checkpoint at {file!r}.")
    size = os.path.getsize(file)
    if size == 0:
        raise CheckpointError(
            f"the checkpoint {file!r} is empty (0 bytes): it was cut short while being written (not by mixprec.save, "
            "which replaces files atomically); use an earlier checkpoint."
        )
    try:
        obj = torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "GLOBAL" in str(e):  # a reference to a Python callable or class: what weights_only exists to refuse
            raise CheckpointError(
                f"refusing to load {file!r}: it holds Python objects other than tensors and containers, and unpickling "
                "them could run code from the file (mixprec.load always uses weights_only=True). mixprec.save never "
                "writes such files. Only if you trust where the file came from: torch.load(path, weights_only=False). "
                f"torch said: {_unpickler_reason(e)}"
            ) from e
        raise _unreadable(file, size, e) from e
    except MemoryError:
        raise
    except Exception as e:  # torch reports broken files as RuntimeError, EOFError, OSError, KeyError, ...
        raise _unreadable(file, size, e) from e

    if isinstance(obj, Mapping) and obj.get("format") == FORMAT:
        version = obj.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CheckpointError(
                f"the checkpoint {file!r} has format version {version!r} (written by mixprec "
                f"{obj.get('mixprec_version', '?')}); this mixprec {_mixprec_version()} reads format version "
                f"{FORMAT_VERSION} and older. Upgrade mixprec."
            )
        lacking = [k for k in ("state", "checksum") if k not in obj]
        if lacking:
            raise CheckpointError(f"the checkpoint {file!r} is damaged: its envelope has no {lacking[0]!r} entry.")
        state = obj["state"]
        if verify:
            _verify(file, state, obj["checksum"])
    elif isinstance(obj, Mapping) and all(k in obj for k in ("version", "policy", "model", "optimizers")):
        state = obj  # torch.save(prec.state_dict(), path): no envelope, nothing to verify against
    else:
        raise CheckpointError(f"{file!r} is not a mixprec checkpoint: {_describe(obj)}")

    if not isinstance(state, Mapping):
        raise CheckpointError(f"the checkpoint {file!r} is damaged: its state is a {type(state).__name__}, not a dict.")
    try:
        validate_state(state)
    except ValueError as e:
        raise CheckpointError(f"the checkpoint {file!r} does not hold a valid mixprec state: {e}") from e
    saved = _parse_policy(state["policy"], where=f"the checkpoint {file!r}")
    if expected_policy is not None:
        want = Policy.parse(expected_policy)
        if saved != want:
            raise CheckpointError(
                f"the checkpoint {file!r} was saved under policy {str(saved)!r} but {str(want)!r} was expected; convert "
                f"it with mixprec.checkpoint.convert_state_dict(state, {want.label!r}) (load without expected_policy "
                "first), or resume with the saved policy."
            )
    return dict(state)


def _verify(file: str, state: Any, checksum: Any) -> None:
    algorithm = checksum.get("algorithm") if isinstance(checksum, Mapping) else None
    if algorithm not in (CHECKSUM, "crc32"):
        raise CheckpointError(f"the checkpoint {file!r} has an unknown checksum {checksum!r}; upgrade mixprec.")
    if not isinstance(state, Mapping):
        return  # reported by the caller
    try:
        crc, n_tensors, n_bytes = _checksum(state, algorithm=algorithm)
    except TypeError as e:
        raise CheckpointError(f"the checkpoint {file!r} is damaged: {e}") from e
    if (crc, n_tensors, n_bytes) != (checksum.get("value"), checksum.get("tensors"), checksum.get("bytes")):
        raise CheckpointError(
            f"the checkpoint {file!r} is corrupted: its contents do not match the checksum written with it "
            f"(crc32 {crc:#010x} over {n_tensors} tensors / {n_bytes} bytes, saved {checksum.get('value', 0):#010x} over "
            f"{checksum.get('tensors')} tensors / {checksum.get('bytes')} bytes). The file changed after it was written "
            "(disk, transfer or copy error); use another copy or an earlier checkpoint."
        )


def _unreadable(file: str, size: int, err: BaseException) -> CheckpointError:
    with open(file, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04":
        what = ("it is a PyTorch (zip) file but truncated or corrupted (e.g. cut short by a crash while it was written "
                "without mixprec.save, or by an unfinished copy)")
    else:
        what = "it is truncated, corrupted, or not a file written by torch.save / mixprec.save"
    return CheckpointError(
        f"cannot read the checkpoint {file!r} ({size} bytes): {what}. Use an earlier checkpoint. "
        f"({type(err).__name__}: {_first_line(err)})"
    )


def _unpickler_reason(err: BaseException) -> str:
    for line in str(err).splitlines():
        if "GLOBAL" in line:
            return line.strip()[:300]
    return _first_line(err)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else repr(err)


def _describe(obj: Any) -> str:
    if not isinstance(obj, Mapping):
        return f"it holds a {type(obj).__name__}, not a mixprec checkpoint dict (write it with mixprec.save)."
    keys = sorted(map(str, obj))[:8]
    if "state" in obj and "param_groups" in obj:
        return f"it holds a plain optimizer state dict (keys {keys}); mixprec checkpoints come from mixprec.save(prec.state_dict(), path)."
    if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return (f"it holds a model state dict (keys {keys}); load it with prec.load_model_state_dict("
                "torch.load(path, weights_only=True)).")
    return f"it has no mixprec format marker (keys {keys}); write checkpoints with mixprec.save(prec.state_dict(), path)."


def _parse_policy(spec: Any, *, where: str) -> Policy:
    if not isinstance(spec, str):
        raise CheckpointError(f"{where}: the state's 'policy' must be the policy string, got {type(spec).__name__}.")
    try:
        return Policy.parse(spec)
    except ValueError as e:
        raise CheckpointError(f"{where}: the state's policy {spec!r} is not valid for this mixprec: {e}") from e


# ----- the state format of MixedPrecision.state_dict() ------------------------------------------------------
STATE_VERSION = 2
# Version 1 (mixprec 0.1) had no "tied" and no "iteration"; it loads as an idle iteration without aliases.
_READABLE_VERSIONS = (1, 2)
_REQUIRED = ("version", "policy", "model", "optimizers", "param_names", "scaler", "applied_steps")


def validate_state(state_dict: Any) -> Mapping[str, Any]:
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"expected a mixprec state dict (a mapping), got {type(state_dict).__name__}")
    missing = [k for k in _REQUIRED if k not in state_dict]
    if missing:
        likely = ""
        if "state" in state_dict and "param_groups" in state_dict:
            likely = " It looks like a plain optimizer state dict; mixprec checkpoints come from MixedPrecision.state_dict()."
        elif state_dict and all(isinstance(v, torch.Tensor) for v in state_dict.values()):
            likely = " It looks like a model state dict; load it with prec.load_model_state_dict(sd)."
        raise ValueError(f"not a mixprec state dict: missing {missing} (has {sorted(map(str, state_dict))[:8]}).{likely}")
    if state_dict["version"] not in _READABLE_VERSIONS:
        raise ValueError(
            f"mixprec state version {state_dict['version']!r}; this mixprec reads versions {list(_READABLE_VERSIONS)} "
            "(upgrade mixprec?)."
        )
    if any(_COMPILE_WRAPPER in k for k in state_dict["model"]):  # saved by a compiled run of mixprec 0.1
        state_dict = {
            **state_dict,
            "model": canonical_state(state_dict["model"]),
            "param_names": [[canonical_name(n) for n in names] for names in state_dict["param_names"]],
            "tied": {canonical_name(a): canonical_name(b) for a, b in state_dict.get("tied", {}).items()},
        }
    return state_dict


_COMPILE_WRAPPER = "_orig_mod"  # the attribute torch.compile's OptimizedModule keeps the model under


def canonical_name(name: str) -> str:
    """A parameter or state-dict key without ``torch.compile``'s ``_orig_mod.`` components.

    ``torch.compile(model)`` returns an ``OptimizedModule`` whose ``state_dict()`` keys all start
    with ``_orig_mod.`` (and a compiled submodule adds ``_orig_mod.`` in the middle of its keys).
    mixprec saves and compares canonical names, so a checkpoint moves between compiled and
    uncompiled runs in both directions.

    Example:
        >>> canonical_name("_orig_mod.blocks.0._orig_mod.ln.weight")
        'blocks.0.ln.weight'
    """
    if _COMPILE_WRAPPER not in name:
        return name
    return ".".join(part for part in name.split(".") if part != _COMPILE_WRAPPER)


def model_state(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with canonical keys (see :func:`canonical_name`)."""
    return {canonical_name(k): v for k, v in model.state_dict().items()}


def canonical_state(sd: Mapping[str, Any]) -> dict[str, Any]:
    """A state dict's entries under canonical keys (a checkpoint written by a compiled run of mixprec 0.1)."""
    return {canonical_name(k): v for k, v in sd.items()}


def load_model_state(model: nn.Module, sd: Mapping[str, Any], strict: bool = True) -> None:
    """``model.load_state_dict(sd)`` with keys matched by canonical name, compiled or not on either side."""
    actual = {canonical_name(k): k for k in model.state_dict()}
    model.load_state_dict({actual.get(canonical_name(k), k): v for k, v in sd.items()}, strict=strict)


def key_mismatch_hint(missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """A likely cause when two key sets differ by a wrapper's prefix on every key ('' when none applies)."""
    for prefix, cause in (
        ("_orig_mod.", "torch.compile (an OptimizedModule keeps the model under '_orig_mod.')"),
        ("module.", "a DistributedDataParallel/DataParallel wrapper (it keeps the model under 'module.')"),
    ):
        for extra, other, side in ((unexpected, missing, "the checkpoint's"), (missing, unexpected, "the model's")):
            if extra and other and all(k.startswith(prefix) for k in extra) and {k[len(prefix):] for k in extra} >= set(other):
                return (
                    f" Every one of {side} extra keys starts with {prefix!r}: the likely cause is {cause}. Load "
                    f"through mixprec (prec.load_state_dict / prec.load_model_state_dict match keys without "
                    f"'_orig_mod.'), or strip the prefix: {{k.removeprefix({prefix!r}): v for k, v in sd.items()}}."
                )
    return ""


def check_model_state(model: nn.Module, sd: Mapping[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` unless ``sd`` has exactly the model's keys (canonical names) and shapes."""
    own = model_state(model)
    sd = canonical_state(sd)
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint's model does not match: missing {missing[:5]}, unexpected {unexpected[:5]}."
            + key_mismatch_hint(missing, unexpected)
        )
    for k, v in own.items():
        if is_lazy(v):
            continue  # an unmaterialised lazy module's tensor: torch's load materialises it in the saved shape
        if tuple(sd[k].shape) != tuple(v.shape):
            raise ValueError(f"the checkpoint's {k!r} has shape {tuple(sd[k].shape)}, the model's {tuple(v.shape)}.")


def fp32_state_dict(source: Any, *, compensation: bool = False) -> dict[str, torch.Tensor]:
    """Export the model's weights in FP32, taken from the masters where there are masters.

    Args:
        source: A prepared :class:`~mixprec.MixedPrecision` (anything with ``state_dict()``), or a
            state dict it saved.
        compensation: Compensated runs (``bf16-pure``): add each parameter's Kahan buffer to its
            BF16/FP16 weight (about 16 significant bits instead of 8; what the optimizer steps
            from). Off by default: after a direct edit of the weights (pruning, a
            ``model.load_state_dict``) the buffer still holds the old remainder (dropped where it
            exceeds half an ulp of the edited weight, as the step drops it, which catches pruning
            to zero but not every edit).

    Returns:
        A model state dict (new tensors) with floating entries in FP32; load it into an FP32
        copy of the model for export or evaluation. Sharded (FSDP2 ``DTensor``) entries are
        gathered into full tensors: under FSDP2 every rank must call this (a collective).
    """
    if not isinstance(source, Mapping) and callable(getattr(source, "state_dict", None)):
        source = source.state_dict()
    sd = validate_state(source)
    out = {k: (v.detach().float().clone() if v.dtype.is_floating_point else v.detach().clone()) for k, v in sd["model"].items()}
    for entry, pnames in zip(sd["optimizers"], sd["param_names"]):
        masters = entry.get("masters") if isinstance(entry, Mapping) else None
        states = entry.get("state") if compensation and isinstance(entry, Mapping) and masters is None else None
        per_param: Mapping[Any, Any] = states if isinstance(states, Mapping) else {}
        for i, name in enumerate(pnames if per_param else ()):
            st = per_param.get(i)
            comp = st.get("kahan_comp") if isinstance(st, Mapping) else None
            if comp is not None and name in out:  # BF16/FP16 weight + Kahan remainder: ~16 significant bits
                comp = comp.detach()
                if type(comp) is torch.Tensor and type(out[name]) is torch.Tensor and comp.dtype in HALF:
                    from .optim._rounding import comp_of_weight  # (lazy: optim imports this module's neighbours)

                    # as the step adds it: a remainder beyond half an ulp of the weight is stale (an edit)
                    out[name] = out[name] + comp_of_weight(out[name], comp, comp.dtype)
                else:  # a DTensor shard: the plain sum
                    out[name] = out[name] + comp.float()
        if masters is None:
            continue
        for name, master in zip(pnames, masters):
            if master is not None and name in out:
                out[name] = master.detach().float().clone()
    # Tied parameters (GPT-2's wte/lm_head): every alias takes its primary name's value.
    for alias, primary in sd.get("tied", {}).items():
        if alias in out and primary in out:
            out[alias] = out[primary]
    # FSDP2 (DTensor) entries are gathered: a collective, every rank must call this (issue 16).
    return {k: v.full_tensor() if callable(getattr(v, "full_tensor", None)) else v for k, v in out.items()}


def convert_state_dict(state_dict: Mapping[str, Any], policy: Policy | str) -> dict[str, Any]:
    """Convert a checkpoint saved under one policy for loading under another.

    The model weights become the FP32 truth (masters where the saved run had them), the
    optimizer state is kept (the same state over the same parameters: FP32 under every
    policy with FP32 or master weights; under ``fp16-pure`` and ``bf16-true`` torch's optimizer
    keeps it in the half dtype, so converting to or from those rounds or widens it as the
    loading optimizer's own ``load_state_dict`` casts it), and the loss-scaler state is kept when both policies scale the loss the same way
    and dropped otherwise (the new run starts with its policy's scaler).

    Args:
        state_dict: What :meth:`MixedPrecision.state_dict` returned.
        policy: The policy of the run that will load it.

    Returns:
        A state dict for ``MixedPrecision(policy).load_state_dict``.

    Raises:
        ValueError: a policy with compensated updates (``bf16-pure``) on either side: its
            optimizer keeps compensation buffers and possibly BF16 states, which do not map
            onto an FP32 optimizer; convert through ``fp32_state_dict`` and a fresh optimizer.
    """
    sd = validate_state(state_dict)
    src, dst = Policy.parse(sd["policy"]), Policy.parse(policy)
    for side, pol in (("saved", src), ("target", dst)):
        if pol.compensation != "none":
            raise ValueError(
                f"cannot convert: the {side} policy {pol.label!r} uses compensated updates; export the weights "
                "with mixprec.checkpoint.fp32_state_dict(state) and start the optimizer afresh."
            )
    out = dict(sd)
    out["policy"] = str(dst)
    out["model"] = fp32_state_dict(sd)
    out["optimizers"] = [e["optimizer"] if isinstance(e, Mapping) and "masters" in e else e for e in sd["optimizers"]]
    same_scaling = (src.loss_scale, src.init_scale) == (dst.loss_scale, dst.init_scale)
    out["scaler"] = sd["scaler"] if same_scaling else None
    return out




def check_optimizer_entries(optimizers: Sequence[Any], entries: Sequence[Any]) -> None:
    """The saved optimizers load into this run's (torch checks the layout only inside the load).

    Checked before the model is loaded: the param-group layout, and the optimizers' own
    ``check_loadable`` where they have one (``MasterWeightOptimizer``'s masters, ``mixprec.optim``'s
    compensation and hyper-parameters), so a mismatch raises with nothing overwritten.
    """
    for i, (opt, entry) in enumerate(zip(optimizers, entries)):
        inner = entry.get("optimizer") if isinstance(entry, Mapping) and "masters" in entry else entry
        groups = inner.get("param_groups") if isinstance(inner, Mapping) else None
        if not isinstance(groups, Sequence):
            raise ValueError(f"the checkpoint's optimizer {i} is not an optimizer state dict (no 'param_groups').")
        saved = [len(g.get("params", ())) for g in groups]
        ours = [len(g["params"]) for g in opt.param_groups]
        if saved != ours:
            raise ValueError(
                f"the checkpoint's optimizer {i} has param groups of sizes {saved}, this run's {ours}; build the "
                "optimizer with the same param groups as the run that saved it."
            )
        masters = isinstance(entry, Mapping) and "masters" in entry
        check = getattr(opt, "check_loadable", None)
        if check is not None and (masters or not hasattr(opt, "model_params")):
            try:
                check(entry)
            except ValueError as e:
                raise ValueError(f"the checkpoint's optimizer {i}: {e}") from None


def parameter_names(model: nn.Module, optimizers: Sequence[Any]) -> tuple[list[list[str]], dict[str, str]]:
    """Derive, from the live model, each optimizer's parameter names and the tied aliases.

    Names are taken now, not remembered from ``prepare``, so parameters added later with
    ``add_param_group`` are named too.

    Returns:
        ``(param_names, tied)``: per optimizer, the primary qualified name of each model parameter
        in param-group order (``""`` for a tensor that is not a model parameter), and
        ``{alias: primary}`` for every further name of a tied parameter.
    """
    primary: dict[int, str] = {}
    tied: dict[str, str] = {}
    for qualified, p in model.named_parameters(remove_duplicate=False):
        name = canonical_name(qualified)
        first = primary.setdefault(id(p), name)
        if first != name:
            tied[name] = first
    return [[primary.get(id(p), "") for p in model_params_of(o)] for o in optimizers], tied
