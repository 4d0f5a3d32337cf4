"""Shared pieces of the Trainer and Accelerate integration tests: a tiny GPT-2, its data, a planted overflow."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from mixprec._precision import MixedPrecision  # noqa: E402

VOCAB, SEQ, N_EXAMPLES, BATCH = 64, 12, 32, 4
PRESETS = ["bf16-mixed", "bf16-master", "fp16-mixed", "bf16-pure"]


class TokenDataset(torch.utils.data.Dataset):
    """``N_EXAMPLES`` random token rows, as a Trainer dataset (``input_ids`` and ``labels``)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (N_EXAMPLES, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def batch(self, step: int) -> torch.Tensor:
        """The ``step``-th batch of a sequential sampler."""
        return self.ids[step * BATCH:(step + 1) * BATCH]


def gpt2() -> torch.nn.Module:
    """A one-layer GPT-2 from a config (no download), the same weights every call."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


class Overflow:
    """Multiplies one weight's gradient by inf while ``on`` is set: a planted inf/NaN step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.on = False
        weight = model.transformer.h[0].mlp.c_fc.weight
        weight.register_hook(lambda g: g * float("inf") if self.on else g)


def reference_run(preset: str, data: TokenDataset, steps: int, *, lr: float = 1e-2, max_grad_norm: float = 1.0,
                  inf_step: int | None = None, trainer_loss: bool = False, micro: int = 1) -> dict[str, list]:
    """mixprec's own loop, step for step what the integrations should do: losses, norms, skips, learning rates."""
    args = transformers.TrainingArguments("unused", learning_rate=lr, use_cpu=True, report_to=[])
    model = gpt2()
    overflow = Overflow(model)
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args)
    prec = MixedPrecision(preset)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))  # Trainer.create_optimizer's groups
    groups = [{"params": [p for n, p in model.named_parameters() if (n in decay) == d],
               "weight_decay": args.weight_decay if d else 0.0} for d in (True, False)]
    opt = cls(groups, **kwargs)
    model, opt = prec.prepare(model, opt)
    sched = transformers.get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=steps)
    out: dict[str, list] = {"loss": [], "grad_norm": [], "skipped": [], "lr": []}
    for step in range(steps):
        x = data.batch(step)
        overflow.on = step == inf_step
        model.train()
        for mb in x.chunk(micro):  # gradient accumulation over `micro` micro-batches
            with prec.autocast():
                if trainer_loss:  # Trainer: sum over tokens / num_items_in_batch (all labels: loss_type is None)
                    loss = model(input_ids=mb, labels=mb, num_items_in_batch=x.ne(-100).sum() / 1).loss
                else:
                    loss = model(input_ids=mb, labels=mb).loss
            prec.backward(loss)
        norm = prec.clip_grad_norm_(max_grad_norm)
        out["lr"].append(opt.param_groups[0]["lr"])
        info = prec.step(opt, schedulers=[sched])
        opt.zero_grad(set_to_none=True)
        out["loss"].append(loss.item())
        out["grad_norm"].append(norm.item())
        out["skipped"].append(not info.applied())
    out["prec"] = [prec]
    return out
