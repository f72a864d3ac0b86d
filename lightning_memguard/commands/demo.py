"""The demo models, LightningModules on random data (nothing is downloaded) that the ``demo`` command, the tests and
the benchmarks train: Lightning's demo ``Transformer`` (encoder and decoder stacks) and a GPT-style decoder on random
tokens (a next-token task), and a small CNN on random images."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos import Transformer
from torch import nn
from torch.utils.data import DataLoader, Dataset


class RandomTokens(Dataset):
    """Sequences of random token ids; the target is the input shifted by one (a next-token task)."""

    def __init__(self, vocab_size: int = 1000, seq_len: int = 64, length: int = 4096, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (length, seq_len + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        # copies, not views: a view would keep the whole token table alive in every batch (and in the CPU
        # accounting of the training step)
        row = self.data[index]
        return row[:-1].clone(), row[1:].clone()


class _TokenModel(pl.LightningModule):
    """AdamW on :class:`RandomTokens`; subclasses save ``vocab_size``, ``seq_len``, ``batch_size`` and ``lr``."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        dataset = RandomTokens(self.hparams.vocab_size, self.hparams.seq_len)
        return DataLoader(dataset, batch_size=self.hparams.batch_size, shuffle=True)


class DemoTransformer(_TokenModel):
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


class GPTBlock(nn.Module):
    """Pre-norm causal self-attention and MLP, the shape of a GPT-2 block."""

    def __init__(self, d_model: int, nhead: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, nhead, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal_mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(_TokenModel):
    """A decoder-only language model on :class:`RandomTokens`: token and position embeddings, ``nlayers``
    :class:`GPTBlock` s, a tied output head; AdamW."""

    def __init__(self, vocab_size: int = 1000, d_model: int = 256, nhead: int = 4, nlayers: int = 6,
                 seq_len: int = 128, batch_size: int = 16, lr: float = 3e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(GPTBlock(d_model, nhead) for _ in range(nlayers))
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=tokens.device), diagonal=1)
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x, mask)
        return self.ln_f(x) @ self.tok.weight.T

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        logits = self(inputs)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        self.log("train_loss", loss)
        return loss


class SmallCNN(pl.LightningModule):
    """A small convolutional classifier (conv-BN-ReLU stages with in-place ReLU and pooling) on random images."""

    def __init__(self, channels: int = 32, image_size: int = 64, n_classes: int = 10, batch_size: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()

        def stage(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
                                 nn.Conv2d(c_out, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
                                 nn.MaxPool2d(2))

        self.features = nn.Sequential(stage(3, channels), stage(channels, 2 * channels),
                                      stage(2 * channels, 4 * channels))
        self.head = nn.Linear(4 * channels, n_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).mean(dim=(2, 3)))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomImages(self.hparams.image_size, self.hparams.n_classes),
                          batch_size=self.hparams.batch_size)


class RandomImages(Dataset):
    """Random images made per item (from a seed), so no batch keeps a whole image table alive."""

    def __init__(self, image_size: int = 64, n_classes: int = 10, length: int = 1024, seed: int = 0) -> None:
        self.image_size, self.n_classes, self.length, self.seed = image_size, n_classes, length, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randn(3, self.image_size, self.image_size, generator=generator)
        return image, torch.randint(0, self.n_classes, (), generator=generator)
