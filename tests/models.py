"""Small real models for the tests, and the Lightning namespace they run under.

- :class:`Block` / :class:`BlockStack`: an activation-heavy residual MLP stack as a ``LightningModule`` (own data);
- :class:`Stack`: the same stack as a plain ``nn.Module``, the model of the scenarios every front door runs;
- :class:`ParameterHeavy`: big weights and a small batch, where autocast's bf16 weight copies outweigh the
  activations it halves;
- :class:`WideLinears`: four wide linears whose first AdamW step's temporaries are what does not fit;
- :func:`regression_batches` and :func:`feature_batches`: fixed, seeded batches for them.

The Lightning namespace is ``lightning.pytorch``, or the one ``MEMGUARD_TEST_LIGHTNING`` names (``pytorch_lightning``
runs any test file under the standalone package; tests/integration/test_namespaces.py covers a handful of runs under
it in every suite). Tests take ``pl`` and Lightning's classes from here.
"""

from __future__ import annotations

import importlib
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NAMESPACE = os.environ.get("MEMGUARD_TEST_LIGHTNING", "lightning.pytorch")
pl = importlib.import_module(NAMESPACE)


def lightning_class(module: str, name: str, namespace: str = NAMESPACE):
    """``name`` from ``<namespace>.<module>``, e.g. ``lightning_class("loggers", "CSVLogger")``."""
    return getattr(importlib.import_module(f"{namespace}.{module}"), name)


class Block(nn.Module):
    """A residual MLP block whose saved activations (4x width) dominate its parameters."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    """``depth`` residual blocks between a 16-feature input and one output; seeded, so two stacks are equal."""

    def __init__(self, width: int = 64, depth: int = 8, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


class ParameterHeavy(nn.Module):
    """Four 512-wide linears and a batch of 64: autocast's bf16 weight copies (2 MiB) outweigh the activations it
    halves (1 MiB in fp32), and with Adam the optimizer step is the peak."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class WideLinears(nn.Module):
    """Four 256-wide linears and a batch of 8: parameters, gradients and AdamW's state are what fills memory."""

    PARAMETER_BYTES = 4 * (256 * 256 + 256) * 4

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def regression_batches(n: int, size: int = 512, features: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` seeded ``(x, y)`` batches of ``size`` samples, ``y = sin(sum(x))``."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randn(size, features, generator=generator)
        out.append((x, x.sum(dim=1, keepdim=True).sin()))
    return out


def feature_batches(n: int, size: int, features: int) -> list[torch.Tensor]:
    """``n`` seeded input-only batches (the loss is :func:`tests.helpers.square_mean`)."""
    return [torch.randn(size, features, generator=torch.Generator().manual_seed(i)) for i in range(n)]


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
