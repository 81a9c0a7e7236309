"""A tiny Lightning run with dropout and a random augmentation in the dataset, made exactly resumable by
`DetraceCallback`, the one line it adds.

    python examples/lightning_train.py --steps 6 --workers 2
    detrace check-resume --at 2 -- python examples/lightning_train.py --steps 6 --workers 2   # exact
    detrace check-resume --at 2 -- python examples/lightning_train.py --steps 6 --plain       # Lightning alone

Under DDP, 2 processes started by torchrun (Lightning takes the ranks from its environment):

    detrace check-resume --at 3 -- torchrun --standalone --nproc-per-node 2 \
        examples/lightning_train.py --devices 2 --steps 4                                    # exact

--val-every N runs Lightning's validation loop every N training batches (counted across epochs): an evaluation is
compared apart from the training, so one at the stop step changes nothing (`--val-every 5`: after step 3).

--poison INDEX gives the example of that index a target 1000 times off (a unit error of a broken data pipeline),
for `detrace ablate`, which names it with its defaults; --samples N makes the data set longer (24 by default, 3
steps an epoch):

    DETRACE_CKPT_DIR=ck DETRACE_CKPT_EVERY=4 detrace run --out orig -- python examples/lightning_train.py \
        --steps 12 --samples 96 --poison 47
    detrace spikes orig
    detrace ablate --step S --run orig -- python examples/lightning_train.py --steps 12 --samples 96 --poison 47

--plain leaves the callback out and resumes with Lightning's own `ckpt_path`, under the same stop/resume
contract (DETRACE_CKPT_DIR, DETRACE_STOP_AT, DETRACE_RESUME) through a small callback of its own.
--pass-ckpt hands the callback's checkpoint to `fit(ckpt_path=...)` as well, as a script that resumes from its
own path does. --report FILE appends one JSON line per run: the contract variables and the final parameters'
fingerprint.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch
from torch import nn

import detrace


class NoisyPoints(torch.utils.data.Dataset):
    """Fixed points; each read adds Gaussian noise drawn from torch's global RNG. The target of the example
    `poison` is 1000 times off."""

    def __init__(self, samples: int, poison: int | None = None) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(samples, 8, generator=generator)
        self.y = torch.randn(samples, 1, generator=generator)
        if poison is not None:
            self.y[poison] *= 1000

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + 0.1 * torch.randn(8), self.y[index]


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        # BatchNorm: under DDP each rank updates its own running statistics (detrace saves each rank's).
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)  # under DDP: the mean over the ranks
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}


class PlainContract(L.Callback):
    """Lightning alone: at DETRACE_STOP_AT, save a checkpoint into DETRACE_CKPT_DIR and stop."""

    @property
    def ckpt_path(self) -> str | None:
        if os.environ.get("DETRACE_RESUME") != "1":
            return None
        return str(sorted(Path(os.environ["DETRACE_CKPT_DIR"]).glob("*.ckpt"))[-1])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if trainer.global_step == int(os.environ.get("DETRACE_STOP_AT", "-1")):
            trainer.save_checkpoint(Path(os.environ["DETRACE_CKPT_DIR"]) / f"step-{trainer.global_step}.ckpt")
            trainer.should_stop = True


def fit(*, steps: int = 6, workers: int = 0, plain: bool = False, pass_ckpt: bool = False, devices: int = 1,
        val_every: int | None = None, samples: int = 24, poison: int | None = None) -> tuple[L.Trainer, Regressor]:
    """Train the model (in this process, or as one of `devices` DDP processes); the trainer and the model.
    `val_every`: a validation loop every that many training batches (counted across epochs); `samples` examples,
    the one at index `poison` with a target 1000 times off."""
    L.seed_everything(0, verbose=False)
    model = Regressor()
    if plain:
        callback: PlainContract | L.Callback = PlainContract()
    else:
        from detrace.integrations.lightning import DetraceCallback

        callback = DetraceCallback(deterministic=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        max_steps=steps, accumulate_grad_batches=2, callbacks=[callback],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **({"val_check_interval": val_every, "check_val_every_n_epoch": None} if val_every else
           {"limit_val_batches": 0}),
    )
    loader = torch.utils.data.DataLoader(NoisyPoints(samples, poison), batch_size=4, shuffle=True, num_workers=workers)
    validation = torch.utils.data.DataLoader(NoisyPoints(8), batch_size=4) if val_every else None
    # DetraceCallback resumes by itself; Lightning alone is handed its checkpoint.
    ckpt_path = callback.ckpt_path if plain or pass_ckpt else None  # type: ignore[union-attr]
    trainer.fit(model, loader, validation, ckpt_path=ckpt_path)
    return trainer, model


def digest(model: nn.Module) -> str:
    """The fingerprint of the model's final parameters, as hex."""
    return "".join(f"{p.digest:016x}" for p in detrace.fingerprint_many(list(model.state_dict().values())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--plain", action="store_true", help="without DetraceCallback: Lightning's own resume")
    parser.add_argument("--pass-ckpt", action="store_true", help="also pass the checkpoint to fit(ckpt_path=...)")
    parser.add_argument("--devices", type=int, default=1,
                        help="CPU processes, strategy ddp when more than 1 (under torchrun: its --nproc-per-node)")
    parser.add_argument("--val-every", type=int, help="a validation loop every N training batches")
    parser.add_argument("--samples", type=int, default=24, help="examples in the data set (8 a step)")
    parser.add_argument("--poison", type=int, metavar="INDEX", help="the example of this index gets a target 1000 "
                        "times off, for detrace ablate")
    parser.add_argument("--report", type=Path, help="append the final parameters' fingerprint to this file")
    options = parser.parse_args()

    torch.set_num_threads(1)
    trainer, model = fit(steps=options.steps, workers=options.workers, plain=options.plain,
                         pass_ckpt=options.pass_ckpt, devices=options.devices, val_every=options.val_every,
                         samples=options.samples, poison=options.poison)
    params = digest(model)
    print(f"final parameters: {params[:32]}")
    if options.report:
        contract = {name: os.environ.get(name) for name in ("DETRACE_STOP_AT", "DETRACE_RESUME", "DETRACE_RESUME_FROM",
                                                              "DETRACE_RESUME_CONTROL")}
        with options.report.open("a") as stream:
            stream.write(json.dumps({**contract, "workers": options.workers, "rank": trainer.global_rank,
                                     "params": params}) + "\n")


if __name__ == "__main__":
    main()
