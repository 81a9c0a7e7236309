"""An unmodified HF `Trainer` script (nothing of detrace in it): a tiny GPT-2 built from a config, 8 steps,
a checkpoint every 4 steps, resumable with HF's own `resume_from_checkpoint`.

    python tests/support/scripts/hf_trainer.py --out DIR [--augment] [--resume]

--augment  the dataset's __getitem__ draws from torch's global RNG (a random token substitution), as data
           augmentations do
--resume   resume from DIR/checkpoint-4 (written by an earlier run with the same --out)
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB = 64
LENGTH = 16


class Tokens(torch.utils.data.Dataset):
    def __init__(self, augment: bool) -> None:
        self.data = torch.randint(0, VOCAB, (64, LENGTH), generator=torch.Generator().manual_seed(0))
        self.augment = augment

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i].clone()
        if self.augment:
            where = torch.rand(LENGTH) < 0.25
            ids[where] = torch.randint(0, VOCAB, (int(where.sum()),))
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--augment", action="store_true")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(output_dir=args.out, max_steps=8, save_steps=4, per_device_train_batch_size=4,
                                 learning_rate=1e-3, logging_steps=100, report_to=[], dataloader_num_workers=0,
                                 use_cpu=True, seed=0, save_only_model=False, disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(args.augment))
    trainer.train(resume_from_checkpoint=f"{args.out}/checkpoint-4" if args.resume else None)


if __name__ == "__main__":
    main()
