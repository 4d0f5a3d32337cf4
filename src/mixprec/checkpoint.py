"""``mixprec.checkpoint``: saving, loading and exporting a training run.

* :func:`save` / :func:`load`: the checkpoint file: written atomically (temporary file, fsync,
  rename), read with ``weights_only=True`` and checked (format, version, CRC32, policy).
  ``save`` and ``load`` are also ``mixprec.save`` / ``mixprec.load``.
* :func:`convert_state_dict`: a state dict saved under one policy, converted for another.
* :func:`fp32_state_dict`: the model's weights in FP32 (from the masters where there are masters).
* :func:`for_inference`: a trained model cast in place to BF16/FP16 for evaluation, FP32 islands kept.
* :class:`CheckpointError`: (a ``ValueError``) a file that cannot be loaded, and why.

Example:
    >>> import mixprec as mp
    >>> mp.save(prec.state_dict(), "ckpt.pt")  # doctest: +SKIP
    >>> prec.load_state_dict(mp.load("ckpt.pt", expected_policy=prec.policy))  # doctest: +SKIP
    >>> weights = mp.checkpoint.fp32_state_dict(prec)  # doctest: +SKIP
"""

from __future__ import annotations

from ._casting import for_inference
from ._checkpoint import CheckpointError, convert_state_dict, fp32_state_dict, load, save

__all__ = [
    "CheckpointError",
    "convert_state_dict",
    "for_inference",
    "fp32_state_dict",
    "load",
    "save",
]
