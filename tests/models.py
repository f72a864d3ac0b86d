"""Small real models for the tests, and the Lightning namespace they run under.

- :class:`Block` / :class:`BlockStack`: an activation-heavy residual MLP stack as a ``LightningModule`` (own data);
- :class:`Stack`: the same stack as a plain ``nn.Module``, the model of the scenarios every front door runs;
- :class:`ParameterHeavy`: big weights and a small batch, where autocast's bf16 weight copies outweigh the
  activations it halves;
- :class:`WideLinears`: four wide linears whose first AdamW step's temporaries are what does not fit;
- :class:`LinearStack`: blocks of a linear and a ReLU, optionally between an input projection and a head — narrow
  for scripted engine and ladder tests, wide where parameters and gradients dwarf the activations;
- :class:`BatchNormStack`: the residual MLP stack with BatchNorm in every block (running statistics to restore);
- :class:`ConvBatchNormNet`: a small conv net with BatchNorm in its stem and in its repeated blocks;
- :class:`TokenAttention`: per-sequence attention whose T x T scores grow with the square of the tokens;
- :class:`TaskHeads`: a trunk and a head per task, each sample's task picking its head (with
  :func:`task_batches`, :func:`task_mse`);
- :func:`regression_batches`, :func:`feature_batches` and :func:`regression_dataset`: fixed, seeded data for them.

LightningModules: :class:`BlockStack` (the stack with its own data), :class:`RecordedBlockStack` (it, counting its
calls), :class:`SizedStack` and :class:`SizedData` (a batch size to set, on the model or a datamodule),
:class:`WideAdamW` (:class:`WideLinears` under AdamW), :class:`EvaluatedStack` (:class:`Stack` with every
evaluation loop), :class:`LightningDemoTransformer` (Lightning's demo Transformer as its example trains it) and
:class:`TaskHeadsModule` (:class:`TaskHeads` on :func:`task_batches` of its rank).

A model whose whole point is one test's behaviour (it fails on purpose, leaks, reads its weights) stays in that test.

The Lightning namespace is ``lightning.pytorch``, or the one ``MEMGUARD_TEST_LIGHTNING`` names (``pytorch_lightning``
runs any test file under the standalone package; tests/integration/test_namespaces.py covers a handful of runs under
it in every suite). Tests take ``pl`` and Lightning's classes from here.
"""

from __future__ import annotations

import importlib
import os
from typing import Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NAMESPACE = os.environ.get("MEMGUARD_TEST_LIGHTNING", "lightning.pytorch")
pl = importlib.import_module(NAMESPACE)


def lightning_class(module: str, name: str, namespace: str = NAMESPACE):
    """``name`` from ``<namespace>.<module>``, e.g. ``lightning_class("loggers", "CSVLogger")``."""
    return getattr(importlib.import_module(f"{namespace}.{module}"), name)


def two_rank_strategy(name: str):
    """The Trainer's strategy for two data-parallel ranks: ``"fsdp"`` is ``ModelParallelStrategy`` over both (FSDP2:
    the module shards itself in ``configure_model``); another name (``"ddp"``) is passed on as it is."""
    if name != "fsdp":
        return name
    return lightning_class("strategies", "ModelParallelStrategy")(data_parallel_size=2, tensor_parallel_size=1)


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

    def __init__(self, width: int = 64, depth: int = 8, seed: int = 0, block: type = Block) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


class ShiftedStack(Stack):
    """A :class:`Stack` with a buffer: DistributedDataParallel broadcasts it in the first forward after each training
    step (an evaluation's too), a collective in the evaluation batch."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.full((1,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shift


class BackwardBallast(torch.autograd.Function):
    """Identity whose backward allocates ``nbytes`` while it runs: memory that only backward needs."""

    @staticmethod
    def forward(ctx, x, nbytes):
        ctx.nbytes = nbytes
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ballast = torch.ones(ctx.nbytes // 4)
        return grad + ballast[:1] * 0, None


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


class LinearStack(nn.Module):
    """``depth`` blocks of a ``width``-wide linear and a ReLU, seeded, so two stacks are equal. With ``features`` an
    input projection from that many features comes first, with ``outputs`` a head to that many outputs comes last;
    without them the stack maps ``width`` features to ``width``."""

    def __init__(self, width: int = 8, depth: int = 8, features: Optional[int] = None, outputs: Optional[int] = None,
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(features, width) if features else nn.Identity()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])
        self.head = nn.Linear(width, outputs) if outputs else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


class BatchNormBlock(nn.Module):
    """A residual MLP block with BatchNorm on its 4x-wide hidden layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.norm = nn.Linear(width, 4 * width), nn.BatchNorm1d(4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.norm(self.up(x))))


class BatchNormStack(Stack):
    """:class:`Stack` with :class:`BatchNormBlock` blocks: every training forward updates running statistics."""

    def __init__(self, width: int = 64, depth: int = 6, seed: int = 0) -> None:
        super().__init__(width, depth, seed, block=BatchNormBlock)


class ConvBatchNormBlock(nn.Module):
    """A residual 3x3 convolution with BatchNorm (``momentum=None``: a cumulative average)."""

    def __init__(self, channels: int, momentum: Optional[float] = 0.1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.conv(x)))


class ConvBatchNormNet(nn.Module):
    """RGB images to ``classes`` logits: a convolution and BatchNorm stem (BatchNorm outside the repeated blocks), one
    :class:`ConvBatchNormBlock` per entry of ``momenta`` (by default the middle one a cumulative average), a pooled
    linear head."""

    def __init__(self, channels: int = 8, momenta: tuple = (0.1, None, 0.1), classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels))
        self.blocks = nn.Sequential(*[ConvBatchNormBlock(channels, momentum=m) for m in momenta])
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class TokenAttention(nn.Module):
    """Per-sequence attention over ``(samples, tokens, features)`` batches that materialises its T x T scores: a
    step's memory grows with the square of the tokens. ``depth`` residual attention layers, one output a token."""

    def __init__(self, features: int = 16, width: int = 32, depth: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(features, width)
        self.queries = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for query in self.queries:
            scores = torch.softmax(query(h) @ h.transpose(1, 2) / 8, dim=-1)
            h = h + scores @ h
        return self.head(h)


class TaskHeads(nn.Module):
    """A multi-task model: a trunk of residual blocks and one head per task, each sample's task id picking the head
    it goes through. A batch holding every task reaches every head; a part of it may not."""

    def __init__(self, width: int = 64, depth: int = 8, tasks: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.heads = nn.ModuleList([nn.Linear(width, 1) for _ in range(tasks)])

    def forward(self, x: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.inp(x))
        out = h.new_zeros(len(x), 1)
        for index, head in enumerate(self.heads):
            rows = (task == index).nonzero().flatten()
            if len(rows):  # a head no sample of the batch asks for is not run
                out = out.index_copy(0, rows, head(h[rows]))
        return out


def task_batches(rank: int, steps: int, size: int = 256) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s ``steps`` seeded ``(x, task, y)`` batches for :class:`TaskHeads`: task 1 in a quarter of each
    batch's samples — its first quarter on rank 0, its last on rank 1 — task 0 in the rest. Split in two, rank 0's
    second part has no sample of task 1, rank 1's has."""
    out = []
    for x, y in regression_batches(steps, size):
        task = torch.zeros(size, dtype=torch.long)
        task[:size // 4] = 1
        out.append((x, task if rank == 0 else task.flip(0), y))
    return out


def task_mse(model: nn.Module, batch) -> torch.Tensor:
    """The loss of :func:`task_batches`' batches."""
    x, task, y = batch
    return nn.functional.mse_loss(model(x, task), y)


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


def regression_dataset(n: int, seed: int, features: int = 16) -> TensorDataset:
    """``n`` seeded samples ``(x, y)``, ``y = sin(sum(x))``, as a dataset for a DataLoader."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


class RecordedBlockStack(BlockStack):
    """:class:`BlockStack` (4 blocks, batches of 256, Adam unless told) that counts its training-step calls (the
    samples each got) and its finished batches; dropout-free, LayerNorm only: micro-batching is exact."""

    def __init__(self, **kw):
        super().__init__(**{"width": 64, "depth": 4, "batch_size": 256, "n_samples": 4096, "optimizer": "adam",
                            **kw})
        self.step_sizes, self.finished = [], []

    def training_step(self, batch, batch_idx):
        self.step_sizes.append(len(batch[0]))
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.finished.append(batch_idx)


class HeavierOnRankOne(BlockStack):
    """:class:`BlockStack` whose rank 1 holds an extra 8 MiB through forward and backward: the ranks' rows differ, and
    a limit between the two ranks' peaks is crossed by rank 1 only."""

    BALLAST_BYTES = 8 * 2**20

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1:
            self.ballast = torch.ones(self.BALLAST_BYTES // 4)
        return super().training_step(batch, batch_idx)

    def on_after_backward(self):
        self.ballast = None


class WiderOnRankOne(BlockStack):
    """Rank 1 runs each batch's samples four times over from the second batch on (the same mean loss, four times the
    activations), so only rank 1 runs out of memory, and not in the first step (DDP settles its gradient buckets
    there); micro-batching lowers what it needs, as for any batch."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx >= 1:
            batch = [torch.cat([t] * 4) for t in batch]
        return super().training_step(batch, batch_idx)


class SizedStack(pl.LightningModule):
    """:class:`Stack` (width 64, depth 8) under Adam whose batch size is an attribute for a batch-size search to set:
    ``model.batch_size`` when ``batch_size`` is given (its own dataloader of ``n_samples`` reads it), else none (the
    data comes from a datamodule, e.g. :class:`SizedData`). It records the samples of every training batch in
    ``seen``. Under ``ModelParallelStrategy`` ``configure_model`` shards every block and then the stack with FSDP2
    over the data-parallel ranks."""

    def __init__(self, batch_size: Optional[int] = None, n_samples: int = 4096) -> None:
        super().__init__()
        self.net = Stack(width=64, depth=8)
        if batch_size is not None:
            self.batch_size = batch_size
        self.n_samples, self.seen = n_samples, []

    def configure_model(self) -> None:
        if self.device_mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)  # the root the training step calls (FSDP2 gathers in the module's call)

    def on_train_batch_start(self, batch, batch_idx):  # not in training_step, which an estimate runs too
        self.seen.append(len(batch[0]))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(regression_dataset(self.n_samples, 0), batch_size=self.batch_size)


class ContrastiveStack(SizedStack):
    """:class:`SizedStack` whose loss adds an InfoNCE term taking its negatives from every rank's batch, gathered with
    Lightning's ``self.all_gather(..., sync_grads=True)`` as contrastive models do: each sample's embedding is scored
    against all ranks' embeddings, its own the positive."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        embedded = self.net.blocks(self.net.inp(x))
        own = torch.nn.functional.normalize(embedded, dim=-1)
        every = self.all_gather(own, sync_grads=True)
        every = every.flatten(0, 1) if every.dim() == 3 else every  # (ranks, batch, width) under a process group
        labels = torch.arange(len(own)) + self.global_rank * len(own)
        contrastive = torch.nn.functional.cross_entropy(own @ every.T / 0.1, labels)
        return contrastive + torch.nn.functional.mse_loss(self.net.head(embedded), y)


class SizedData(pl.LightningDataModule):
    """``n_samples`` seeded regression samples in batches of ``datamodule.batch_size``."""

    def __init__(self, batch_size: int = 8, n_samples: int = 4096) -> None:
        super().__init__()
        self.batch_size, self.n_samples = batch_size, n_samples

    def train_dataloader(self):
        return DataLoader(regression_dataset(self.n_samples, 0), batch_size=self.batch_size)


class WideAdamW(pl.LightningModule):
    """:class:`WideLinears` trained with AdamW (``foreach`` as given) on batches of 8: AdamW's state (2x parameters)
    is what does not fit. ``scheduler=True`` adds a StepLR."""

    def __init__(self, foreach=None, scheduler=False):
        super().__init__()
        self.layers = WideLinears().layers
        self.foreach, self.scheduler = foreach, scheduler

    def training_step(self, batch, batch_idx):
        return self.layers(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=self.foreach)
        if not self.scheduler:
            return optimizer
        # an LR scheduler wraps optimizer.step on the instance before MemGuard does
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    def train_dataloader(self):
        data = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data), batch_size=8)


class EvaluatedStack(pl.LightningModule):
    """:class:`Stack` with every evaluation loop, on batches of ``TRAIN``, ``VAL``, ``TEST`` and ``PREDICT`` samples
    (evaluation batches far larger than training's): ``val_loss`` logged on_epoch; a test step that updates a
    torchmetrics metric and logs before a test-time-augmented pass over 8 shifted copies of the batch (the pass that
    runs out of memory first, after the metric was updated); predictions."""

    TRAIN, VAL, TEST, PREDICT = 32, 1024, 128, 2048

    def __init__(self) -> None:
        import torchmetrics  # here: only this model needs it

        super().__init__()
        self.net = Stack()
        self.test_mse = torchmetrics.MeanSquaredError()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))  # on_epoch: a mean weighted by batch size

    def test_step(self, batch, batch_idx):
        x, y = batch
        preds = self(x)
        self.test_mse.update(preds, y)
        self.log("test_mse", self.test_mse)
        self.log("test_loss", torch.nn.functional.mse_loss(preds, y))
        shifted = torch.cat([x + 0.01 * k for k in range(8)])
        augmented = self(shifted).view(8, -1, 1).mean(dim=0)
        self.log("test_tta_loss", torch.nn.functional.mse_loss(augmented, y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(regression_dataset(4 * self.TRAIN, 0), batch_size=self.TRAIN)

    def val_dataloader(self):
        return DataLoader(regression_dataset(2 * self.VAL, 1), batch_size=self.VAL)

    def test_dataloader(self):
        return DataLoader(regression_dataset(3 * self.TEST, 2), batch_size=self.TEST)

    def predict_dataloader(self):
        return DataLoader(regression_dataset(self.PREDICT + self.PREDICT // 2, 3), batch_size=self.PREDICT)


class LightningDemoTransformer(pl.LightningModule):
    """Lightning's own demo Transformer as its LightningTransformer example trains it (dropout 0.2, SGD) on random
    tokens. The defaults are the issue's held-out case: 6+6 layers, d512, WikiText2's vocabulary, 32 x 256 tokens
    (~8 GiB on a GPU)."""

    def __init__(self, vocab_size: int = 33278, ninp: int = 512, nhead: int = 8, nhid: int = 2048, nlayers: int = 6,
                 seq_len: int = 256, batch_size: int = 32, n_samples: int = 256) -> None:
        super().__init__()
        self.save_hyperparameters()
        transformer = lightning_class("demos", "Transformer")
        self.model = transformer(vocab_size=vocab_size, ninp=ninp, nhead=nhead, nhid=nhid, nlayers=nlayers)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        return torch.nn.functional.nll_loss(self.model(inputs, target), target.view(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_dataloader(self):
        from lightning_memguard.commands.demo import RandomTokens

        tokens = RandomTokens(self.hparams.vocab_size, self.hparams.seq_len, length=self.hparams.n_samples)
        return DataLoader(tokens, batch_size=self.hparams.batch_size)


class TaskHeadsModule(pl.LightningModule):
    """:class:`TaskHeads` trained on :func:`task_batches` of its rank (``use_distributed_sampler=False``: each rank's
    batches are its own)."""

    def __init__(self, steps: int = 4) -> None:
        super().__init__()
        self.steps = steps
        self.model = TaskHeads()

    def training_step(self, batch, batch_idx):
        return task_mse(self.model, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(task_batches(self.global_rank, self.steps), batch_size=None)


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
