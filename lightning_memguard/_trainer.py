"""Small facts read from, or done through, a Lightning Trainer (used by the callback only)."""

from __future__ import annotations

from typing import Iterator, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from .checks import MemGuardWarning
from .snapshot import PHASES
from .sources.cpu import optimizer_state_tensors, storage_bytes


def memguard_warn(message: str) -> None:
    """One warning on rank zero, printed as the sentence alone (:class:`~lightning_memguard.checks.MemGuardWarning`)."""
    rank_zero_warn(message, category=MemGuardWarning)


def optimizer_step_index(trainer: pl.Trainer) -> int:
    """The step on the axis of the module's own ``self.log`` metrics. Lightning logs at this counter and increments
    it only after ``on_train_batch_end``, so all four boundaries of a step share it (``global_step`` is already +1
    inside ``on_train_batch_end``)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def run_dir(trainer: pl.Trainer) -> str:
    """Where a run's files go: the first logger's directory, else the Trainer's root directory."""
    return trainer.log_dir or trainer.default_root_dir


def training_state_tensors(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Iterator[torch.Tensor]:
    """Tensors that live across steps: parameters, their gradients, buffers and optimizer state."""
    for param in pl_module.parameters():
        yield param
        if param.grad is not None:
            yield param.grad
    yield from pl_module.buffers()
    yield from optimizer_state_tensors(trainer.optimizers)


def training_state_bytes(trainer: pl.Trainer) -> dict[str, int]:
    """Bytes of the parameters, gradients and optimizer state (each storage once)."""
    module = trainer.lightning_module
    params = list(module.parameters())
    return {"parameters": storage_bytes(params), "gradients": storage_bytes(p.grad for p in params),
            "optimizer_state": storage_bytes(optimizer_state_tensors(trainer.optimizers))}


def reduce_max(trainer: pl.Trainer, peaks: dict[str, int], static: Optional[int], retries: Optional[int]):
    """The element-wise maximum over ranks of a step's numbers, in one collective (-1 stands for "no value")."""
    phases = [p for p in PHASES if p in peaks]
    values = [peaks[p] for p in phases] + [-1 if static is None else static, -1 if retries is None else retries]
    reduced = trainer.strategy.reduce(torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device),
                                      reduce_op="max").tolist()
    as_int = [int(v) for v in reduced]
    return (dict(zip(phases, as_int)), None if as_int[-2] < 0 else as_int[-2], None if as_int[-1] < 0 else as_int[-1])
