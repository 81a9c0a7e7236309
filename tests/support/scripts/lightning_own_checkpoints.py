"""An unmodified Lightning script (nothing of detrace in it) that checkpoints by itself: `ModelCheckpoint` every 2
steps into ckpts/, and with --resume, `fit(ckpt_path=...)` from the latest one there. For check-resume --native.

    python tests/support/scripts/lightning_own_checkpoints.py [--steps 6] [--devices 2] [--resume]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from torch import nn


class Points(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(48, 8, generator=generator), torch.randn(48, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()
L.seed_everything(0, verbose=False)
torch.set_num_threads(1)
saves = L.pytorch.callbacks.ModelCheckpoint(dirpath="ckpts", filename="{step}", every_n_train_steps=2, save_top_k=-1)
trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
                    max_steps=args.steps, callbacks=[saves], deterministic=True, logger=False,
                    enable_progress_bar=False, enable_model_summary=False)
found = sorted(Path("ckpts").glob("step=*.ckpt"), key=lambda path: int(path.stem.split("=")[1]))
loader = torch.utils.data.DataLoader(Points(), batch_size=4, shuffle=True)
trainer.fit(Regressor(), loader, ckpt_path=str(found[-1]) if args.resume and found else None)
