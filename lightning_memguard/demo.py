"""A small transformer on random tokens: the model the demo, the tests and the benchmarks train. Nothing is
downloaded: Lightning's demo ``Transformer`` learns a synthetic copy task."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos import Transformer
from torch.utils.data import DataLoader, Dataset


class RandomTokens(Dataset):
    """Sequences of random token ids; the target is the input shifted by one (a next-token task)."""

    def __init__(self, vocab_size: int = 1000, seq_len: int = 64, length: int = 4096, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (length, seq_len + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.data[index]
        return row[:-1], row[1:]


class DemoTransformer(pl.LightningModule):
    """Lightning's demo ``Transformer`` (encoder and decoder stacks) trained with AdamW on :class:`RandomTokens`."""

    def __init__(
        self,
        vocab_size: int = 1000,
        d_model: int = 128,
        nhead: int = 4,
        d_ff: int = 512,
        nlayers: int = 4,
        seq_len: int = 64,
        batch_size: int = 16,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = Transformer(vocab_size=vocab_size, ninp=d_model, nhead=nhead, nhid=d_ff, nlayers=nlayers,
                                 dropout=0.0)

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.model(inputs, target)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        log_probs = self(inputs, target)
        loss = torch.nn.functional.nll_loss(log_probs, target.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        dataset = RandomTokens(self.hparams.vocab_size, self.hparams.seq_len)
        return DataLoader(dataset, batch_size=self.hparams.batch_size, shuffle=True)
