"""A tiny transformers Trainer run with dropout and a random augmentation in the dataset, made exactly
resumable by one line: `callbacks=[DetraceCallback()]`.

    python examples/hf_train.py --steps 6 --workers 2
    detrace check-resume --at 3 -- python examples/hf_train.py --steps 6 --workers 2   # exact
    detrace check-resume --at 4 -- python examples/hf_train.py --steps 6 --plain       # HF alone: not exact
    detrace check-resume --at 3 -- python examples/hf_train.py --steps 6 --stream --workers 2   # a stream: exact

--spike STEP plants a loss spike for `detrace ablate` (the learning rate of step STEP is 100 times larger).
--poison INDEX poisons one example instead: the model is then a regression on each sequence (GPT-2 with a
sequence-regression head), and the example of that index has a target 1000 times off, a unit error of a broken
data pipeline, whichever step trains on it. --samples N makes the data set longer (24 by default, 3 steps an
epoch). A run `detrace ablate` names the example of, with its defaults:

    DETRACE_CKPT_DIR=ck DETRACE_CKPT_EVERY=4 detrace run --out orig -- python examples/hf_train.py --steps 16 \
        --samples 96 --poison 13
    detrace spikes orig
    detrace ablate --step S --run orig -- python examples/hf_train.py --steps 16 --samples 96 --poison 13
--stream reads the tokens as a stream instead: an HF `datasets` IterableDataset (pip install datasets torchdata),
whose position the callback saves and resumes from.

--plain leaves the callback out and resumes with HF's own `resume_from_checkpoint`, following the same
stop/resume contract (DETRACE_CKPT_DIR, DETRACE_STOP_AT, DETRACE_RESUME) with a three-line callback of its
own, so that the two can be compared. --report FILE appends one JSON line per run: the contract variables
it ran under and the fingerprint of the final parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

import detrace

VOCAB, LENGTH = 64, 8


class NoisyTokens(torch.utils.data.Dataset):
    """Fixed token sequences; each read replaces a random 25% of the tokens (drawn from torch's global RNG)."""

    def __init__(self, samples: int) -> None:
        self.tokens = torch.randint(0, VOCAB, (samples, LENGTH), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.tokens[index].clone()
        noise = torch.rand(LENGTH) < 0.25
        tokens[noise] = torch.randint(0, VOCAB, (int(noise.sum()),))
        return {"input_ids": tokens, "labels": tokens}


class PoisonedTargets(NoisyTokens):
    """The same sequences, each with a regression target (the mean of its clean tokens over the vocabulary's size),
    except the example `poison`, whose target is 1000 times off."""

    def __init__(self, samples: int, poison: int) -> None:
        super().__init__(samples)
        self.targets = self.tokens.float().mean(1) / VOCAB
        self.targets[poison] *= 1000

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": super().__getitem__(index)["input_ids"], "labels": self.targets[index]}


class PlainContract(TrainerCallback):
    """HF alone: at DETRACE_STOP_AT, save a checkpoint and stop (HF's own checkpoint and resume)."""

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == int(os.environ.get("DETRACE_STOP_AT", "-1")):
            control.should_save = control.should_training_stop = True


class LearningRateBump(TrainerCallback):
    """A planted loss spike for `detrace ablate`: optimizer step `step` (counted from 0) runs at 100 times the
    learning rate (HF's scheduler sets the next step's rate again), so the loss of the step after it jumps."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            for group in optimizer.param_groups:
                group["lr"] *= 100


def token_stream(samples: int) -> torch.utils.data.IterableDataset:
    """The same token sequences, unaugmented, as an HF `datasets` stream in 2 shards (one per DataLoader worker)."""
    import datasets

    tokens = NoisyTokens(samples).tokens
    rows = datasets.Dataset.from_dict({"input_ids": tokens.tolist(), "labels": tokens.tolist()})
    return rows.to_iterable_dataset(num_shards=2).with_format("torch")  # type: ignore[no-any-return]


def make_trainer(*, steps: int, workers: int, plain: bool, output_dir: str, stream: bool = False,
                 spike: int | None = None, samples: int = 24, poison: int | None = None) -> Trainer:
    """The Trainer of this example; with `plain`, HF alone under the same stop/resume contract; with `stream`, the
    data is a stream that says where it is; with `spike`, that step's learning rate is 100 times larger; with
    `poison`, a regression whose example of that index has a target 1000 times off; `samples` examples."""
    args = TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-2, logging_steps=1, save_strategy="no", dataloader_num_workers=workers, report_to="none",
        disable_tqdm=True, seed=0, use_cpu=True,
    )
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=1, n_head=2)
    if poison is None:
        model: torch.nn.Module = GPT2LMHeadModel(config)
    else:
        # pad_token_id: no token pads here (the head reads the last position), but a batch needs the id set.
        config.update({"num_labels": 1, "problem_type": "regression", "pad_token_id": VOCAB})
        model = GPT2ForSequenceClassification(config)
    if plain:
        callback: TrainerCallback = PlainContract()
        if os.environ.get("DETRACE_STOP_AT"):
            args.output_dir = os.environ["DETRACE_CKPT_DIR"]
        if os.environ.get("DETRACE_RESUME") == "1":
            args.resume_from_checkpoint = get_last_checkpoint(os.environ["DETRACE_CKPT_DIR"])
    else:
        from detrace.integrations.hf import DetraceCallback

        callback = DetraceCallback(deterministic=True)  # the one line
    data = (token_stream(samples) if stream else NoisyTokens(samples) if poison is None
            else PoisonedTargets(samples, poison))
    callbacks = [callback] if spike is None else [callback, LearningRateBump(spike)]
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def parameters_digest(trainer: Trainer) -> str:
    """The fingerprints of the model's final parameters, as one hex string (what --report records)."""
    return "".join(f"{p.digest:016x}" for p in detrace.fingerprint_many(list(trainer.model.state_dict().values())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--plain", action="store_true", help="without DetraceCallback: HF's own resume")
    parser.add_argument("--stream", action="store_true", help="the data as a stream (datasets, torchdata)")
    parser.add_argument("--spike", type=int, metavar="STEP", help="plant a loss spike: 100x the learning rate of "
                        "step STEP (from 0), for detrace ablate")
    parser.add_argument("--samples", type=int, default=24, help="examples in the data set (8 a step)")
    parser.add_argument("--poison", type=int, metavar="INDEX", help="a regression whose example of this index has a "
                        "target 1000 times off, for detrace ablate")
    parser.add_argument("--report", type=Path, help="append the final parameters' fingerprint to this file")
    parser.add_argument("--output-dir", help="HF's output directory (default: a temporary one)")
    options = parser.parse_args()

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = make_trainer(steps=options.steps, workers=options.workers, plain=options.plain,
                               output_dir=options.output_dir or scratch, stream=options.stream,
                               spike=options.spike, samples=options.samples, poison=options.poison)
        # HF's idiom: the script hands args.resume_from_checkpoint on (DetraceCallback fills it in on resume).
        trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)

    digest = parameters_digest(trainer)
    print(f"final parameters: {digest[:32]}")
    if options.report:
        contract = {name: os.environ.get(name) for name in ("DETRACE_STOP_AT", "DETRACE_RESUME", "DETRACE_RESUME_FROM",
                                                              "DETRACE_RESUME_CONTROL")}
        with options.report.open("a") as stream:
            stream.write(json.dumps({**contract, "workers": options.workers, "params": digest}) + "\n")


if __name__ == "__main__":
    main()
