"""An HF `Trainer` script of the kind users write, made resumable by `callbacks=[DetraceCallback()]`, for
torchrun (2 ranks on gloo): a tiny GPT-2 from a config with a BatchNorm in its MLP (under DDP each rank's forward
updates its own running statistics), logging every step (HF's logging gathers the loss across ranks), an evaluation
every 2 steps, where checkpoints are taken too (the usual set-up), 6 steps.

    torchrun --standalone --nproc-per-node 2 tests/support/scripts/hf_ddp.py
    detrace check-resume --at 2 -- torchrun --standalone --nproc-per-node 2 tests/support/scripts/hf_ddp.py
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from detrace.integrations.hf import DetraceCallback

VOCAB, LENGTH = 64, 8


class ChannelNorm(torch.nn.BatchNorm1d):
    """BatchNorm over the features of (batch, position, feature) activations."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2).contiguous()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, samples: int = 48, seed: int = 0) -> None:
        self.data = torch.randint(0, VOCAB, (samples, LENGTH), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=1, n_head=2))
    mlp = model.transformer.h[0].mlp
    mlp.act = torch.nn.Sequential(ChannelNorm(4 * 16), mlp.act)
    # One output directory for both ranks (HF saves into it from each), removed at the end.
    scratch = Path(tempfile.gettempdir()) / f"hf_ddp-{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}"
    try:
        args = TrainingArguments(output_dir=str(scratch), max_steps=6, per_device_train_batch_size=2,
                                 learning_rate=1e-2, logging_steps=1, eval_strategy="steps", eval_steps=2,
                                 save_strategy="steps", save_steps=2, report_to="none", disable_tqdm=True, seed=0,
                                 use_cpu=True, ddp_backend="gloo")
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(8, seed=1),
                          callbacks=[DetraceCallback(deterministic=True)])
        trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    finally:
        if os.environ.get("RANK", "0") == "0":
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
