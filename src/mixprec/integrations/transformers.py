"""Hugging Face ``transformers.Trainer`` under a mixprec policy: ``MixprecTrainer``.

::

    from mixprec.integrations.transformers import MixprecTrainer

    trainer = MixprecTrainer(model=model, args=TrainingArguments(output_dir="out"), train_dataset=ds,
                             precision="bf16-master")   # a preset, a Policy or a MixedPrecision
    trainer.train()                                    # also trainer.train(resume_from_checkpoint=True)

Why a subclass that swaps in :class:`~mixprec.integrations.accelerate.MixprecAccelerator`:
``Trainer`` runs every step through its ``accelerator`` (``prepare``, ``backward``,
``clip_grad_norm_``, ``optimizer_step_was_skipped``), so the one place where all of them become
mixprec's is the accelerator; the ``Trainer``'s own loop, logging, callbacks and checkpoint
rotation stay untouched. Only the checkpoint hooks are overridden here. A factory that patched
an existing ``Trainer`` would do the same after construction, when ``bf16=True``/``fp16=True``
have already built an ``Accelerator`` with its own autocast; the subclass refuses those first.
``MixprecTrainerMixin`` puts the same in front of other ``Trainer`` subclasses (TRL's
``SFTTrainer``, ...): ``class MySFT(MixprecTrainerMixin, SFTTrainer)``.

What a training step does (``trainer.prec`` is the :class:`~mixprec.MixedPrecision`):

* the model and the optimizer ``Trainer`` creates go through ``prec.prepare`` in
  ``accelerator.prepare`` (cast, masters, compensated optimizers); the forward runs in
  ``prec.autocast()``; ``accelerator.backward`` is ``prec.backward`` (loss scaling);
* ``max_grad_norm`` clipping and the logged ``grad_norm`` are ``prec.clip_grad_norm_``: the true
  norm of the unscaled (FP32 master) gradients;
* ``optimizer.step()`` is ``prec.step`` (inf/NaN check, skip on the device, masters copied back);
  ``accelerator.optimizer_step_was_skipped`` is true exactly on skipped steps (one host read), so
  the LR scheduler does not advance then;
* checkpoints: ``mixprec.pt`` (``prec.state_dict()``: model, optimizer with FP32 masters, loss
  scaler, step count; written by :func:`mixprec.save`) and ``scheduler.pt`` replace
  ``optimizer.pt``; ``resume_from_checkpoint`` loads them back, so the run continues bit for bit;
  ``load_best_model_at_end`` restores the best checkpoint's FP32 masters, not only its half weights.

Refused with an error that says what to do instead: ``TrainingArguments(fp16=True)``/``bf16=True``
(Trainer's torch.autocast and GradScaler would run on top of mixprec: choose the precision with
``precision=`` alone; ``fp16=True`` is ``"fp16-mixed"``, ``bf16=True`` is ``"bf16-mixed"``),
``fp16_full_eval``/``bf16_full_eval`` (they cast the trained model in place; use
:func:`mixprec.checkpoint.for_inference`), DeepSpeed, FSDP and multi-process runs, and resuming
from a checkpoint without ``mixprec.pt``.

Note: ``save_model`` writes the model's own weights, which are BF16/FP16 under ``*-master`` and
``*-pure`` policies; the FP32 weights are ``mixprec.checkpoint.fp32_state_dict(trainer.prec)``.

``transformers`` is imported when ``MixprecTrainer`` is first used, with an install hint when it
is missing.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch

from .._checkpoint import load, save
from .._policy import Policy
from .._precision import MixedPrecision
from .accelerate import as_mixed_precision, attach

__all__ = ["MIXPREC_NAME", "MixprecTrainer", "MixprecTrainerMixin", "check_training_args"]

#: Built on first access by the module ``__getattr__`` below (it subclasses the optional dependency's class).
MixprecTrainer: Any

#: The file in each checkpoint folder that holds ``prec.state_dict()``.
MIXPREC_NAME = "mixprec.pt"
_SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer.SCHEDULER_NAME
INSTALL_HINT = "pip install transformers accelerate (both are in mixprec's test extra: pip install 'mixprec[test]')"


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as err:  # the optional dependency
        raise ImportError(f"mixprec.integrations.transformers needs the `transformers` package: {INSTALL_HINT}.") from err
    return transformers


def check_training_args(args: Any, prec: MixedPrecision) -> None:
    """Refuse ``TrainingArguments`` whose own precision settings would be combined with ``prec``'s.

    Raises:
        ValueError: ``fp16``, ``bf16``, ``fp16_full_eval`` or ``bf16_full_eval`` is set, or DeepSpeed/FSDP is.
    """
    if args is None:
        return
    name = prec.policy.label
    for flag, preset in (("fp16", "fp16-mixed"), ("bf16", "bf16-mixed")):
        if getattr(args, flag, False):
            raise ValueError(
                f"TrainingArguments({flag}=True) together with MixprecTrainer(precision={name!r}) would run two "
                f"mixed-precision systems at once (Trainer's torch.autocast/GradScaler on top of mixprec's casting, loss "
                f"scaling and masters). Set {flag}=False and choose the precision with precision= alone ({flag}=True "
                f"corresponds to precision={preset!r})."
            )
    for flag in ("fp16_full_eval", "bf16_full_eval"):
        if getattr(args, flag, False):
            raise ValueError(
                f"TrainingArguments({flag}=True) casts the model in place for evaluation, under MixprecTrainer"
                f"(precision={name!r}) whose model mixprec already cast; set {flag}=False (evaluation runs under the "
                "policy), or cast a trained model for inference with mixprec.checkpoint.for_inference(model, dtype)."
            )
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise ValueError(
            "MixprecTrainer supports single-process training only: DeepSpeed and FSDP bring their own mixed precision. "
            "Unset deepspeed=/fsdp=, or use mixprec.distributed with MixedPrecision in your own loop."
        )


class MixprecTrainerMixin:
    """Put in front of ``transformers.Trainer`` or a subclass of it: every step goes through ``self.prec``.

    Args:
        *args, **kwargs: The ``Trainer`` subclass's own arguments.
        precision: (keyword, required) A mixprec preset (``"bf16-master"``), alias, grammar string,
            ``Policy`` or ``MixedPrecision``; kept as ``self.prec``.

    Raises:
        ValueError: ``TrainingArguments`` precision flags, DeepSpeed/FSDP or a multi-process run
            (see :func:`check_training_args` and
            :func:`mixprec.integrations.accelerate.check_accelerator`).
    """

    prec: MixedPrecision

    def __init__(self, *args: Any, precision: MixedPrecision | Policy | str, **kwargs: Any) -> None:
        prec = as_mixed_precision(precision)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        check_training_args(training_args, prec)
        self.prec = prec  # before Trainer.__init__, which builds the accelerator
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator, turned into a ``MixprecAccelerator`` before anything is prepared on it."""
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        attach(self.accelerator, self.prec)  # type: ignore[attr-defined]
        args: Any = self.args  # type: ignore[attr-defined]
        if getattr(args, "n_gpu", 0) > 1:
            raise ValueError(
                f"MixprecTrainer runs on one device; this run would use torch.nn.DataParallel over {args.n_gpu} GPUs. "
                "Make one GPU visible (CUDA_VISIBLE_DEVICES=0)."
            )

    # ----- checkpoints -----------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """``mixprec.pt`` (``prec.state_dict()``, with the optimizer and its masters) and ``scheduler.pt``."""
        trainer: Any = self
        if not trainer.args.should_save:
            return
        save(self.prec.state_dict(), os.path.join(output_dir, MIXPREC_NAME))
        with warnings.catch_warnings(record=True) as caught:
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))
        _reissue(caught)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """``prec.load_state_dict`` from ``mixprec.pt`` (model, masters, optimizer, scaler) and the scheduler."""
        if checkpoint is None:
            return
        trainer: Any = self
        path = os.path.join(checkpoint, MIXPREC_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"resume_from_checkpoint={checkpoint!r}: there is no {MIXPREC_NAME} (the mixprec state: optimizer, FP32 "
                "masters, loss scaler): it was not saved by MixprecTrainer, or saved with save_only_model=True (weights "
                "only: not resumable, as with transformers' Trainer). To start from its weights only, "
                "load them into the model (from_pretrained) and train without resume_from_checkpoint."
            )
        self.prec.load_state_dict(load(path, expected_policy=self.prec.policy))
        scheduler = os.path.join(checkpoint, _SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            with warnings.catch_warnings(record=True) as caught:
                trainer.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
            _reissue(caught)


    def _load_best_model(self) -> None:
        """Trainer's best-model load (``load_best_model_at_end``), then the best checkpoint's exact FP32 weights.

        Trainer loads the checkpoint's model file, which holds the BF16/FP16 weights under
        ``*-master`` and ``*-pure``: the masters would keep the last step's values wherever the
        rounding agreed (a mix of two steps). The checkpoint's ``mixprec.pt`` has the masters:
        its FP32 weights are loaded through ``prec.load_model_state_dict``, which splits them
        exactly (the optimizer and scaler are left as they are: training is over). Under
        ``bf16-pure`` the whole run state is loaded (weights and compensation as saved).
        """
        super()._load_best_model()  # type: ignore[misc]
        trainer: Any = self
        best = trainer.state.best_model_checkpoint
        path = os.path.join(best, MIXPREC_NAME) if best else None
        if path is not None and os.path.isfile(path) and self.prec.policy.param_dtype != torch.float32:
            state = load(path, expected_policy=self.prec.policy)
            if self.prec.policy.compensation != "none":
                # bf16-pure: the whole run state (weights and their compensation exactly as saved); splitting
                # weight + compensation again would round the ties (a remainder of exactly half an ulp) the other way
                self.prec.load_state_dict(state)
                return
            from ..checkpoint import fp32_state_dict

            self.prec.load_model_state_dict(fp32_state_dict(state))


def _reissue(caught: list[warnings.WarningMessage]) -> None:
    # As transformers' reissue_pt_warnings: torch's "please also save or load the optimizer" notes are expected here.
    for w in caught:
        if w.category is not UserWarning or "optimizer" not in str(w.message):
            warnings.warn(w.message, w.category, stacklevel=3)


@functools.cache
def _trainer_class() -> type:
    transformers = _import_transformers()

    class MixprecTrainer(MixprecTrainerMixin, transformers.Trainer):  # type: ignore[name-defined]
        """``transformers.Trainer`` whose every step goes through mixprec (see ``mixprec.integrations.transformers``).

        Example:
            ``MixprecTrainer(model=model, args=TrainingArguments("out"), train_dataset=ds,
            precision="bf16-master").train()``
        """

    return MixprecTrainer


def __getattr__(name: str) -> Any:
    # MixprecTrainer subclasses transformers.Trainer, so it is built on first use (lazy import).
    if name == "MixprecTrainer":
        return _trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
