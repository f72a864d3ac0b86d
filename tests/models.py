"""Small real models for the tests: an activation-heavy residual MLP stack.

The Lightning namespace the tests run under is ``lightning.pytorch``, or the one ``MEMGUARD_TEST_LIGHTNING`` names
(``pytorch_lightning``: tests/integration/test_namespaces.py runs the integration tests again under it). Tests take
``pl`` and Lightning's classes from here.
"""

from __future__ import annotations

import importlib
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NAMESPACE = os.environ.get("MEMGUARD_TEST_LIGHTNING", "lightning.pytorch")
pl = importlib.import_module(NAMESPACE)


def lightning_class(module: str, name: str):
    """``name`` from ``<namespace>.<module>``, e.g. ``lightning_class("loggers", "CSVLogger")``."""
    return getattr(importlib.import_module(f"{NAMESPACE}.{module}"), name)


class Block(nn.Module):
    """A residual MLP block whose saved activations (4x width) dominate its parameters."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class BlockStack(pl.LightningModule):
    def __init__(self, width: int = 64, depth: int = 6, batch_size: int = 64, n_samples: int = 2048,
                 optimizer: str = "sgd", lr: float = 0.01, log_loss: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if self.hparams.log_loss:
            self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(self.hparams.n_samples, 16, generator=generator)
        y = x.sum(dim=1, keepdim=True).sin()
        return DataLoader(TensorDataset(x, y), batch_size=self.hparams.batch_size, shuffle=False)


def trainer_kwargs(**overrides):
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
    )
    kwargs.update(overrides)
    return kwargs
