"""An HF `Trainer` script of the kind users write, made resumable by `callbacks=[DetraceCallback()]`, for
torchrun (2 ranks on gloo): a tiny GPT-2 from a config, logging every step (HF's logging gathers the loss across
ranks), 6 steps.

    torchrun --standalone --nproc-per-node 2 tests/support/scripts/hf_ddp.py
    detrace check-resume --at 3 -- torchrun --standalone --nproc-per-node 2 tests/support/scripts/hf_ddp.py
"""

from __future__ import annotations

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from detrace.integrations.hf import DetraceCallback

VOCAB, LENGTH = 64, 8


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.data = torch.randint(0, VOCAB, (48, LENGTH), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=1, n_head=2))
    with tempfile.TemporaryDirectory() as scratch:
        args = TrainingArguments(output_dir=scratch, max_steps=6, per_device_train_batch_size=2, learning_rate=1e-2,
                                 logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
                                 use_cpu=True, ddp_backend="gloo")
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                          callbacks=[DetraceCallback(deterministic=True)])
        trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)


if __name__ == "__main__":
    main()
