"""Run by test_ddp.py in a subprocess (so a hang would be a timeout, not a stuck test run): two gloo ranks, rank 1
runs out of memory in its forward. Exits non-zero with the error, never hangs. What the launching process's guard
shows afterwards goes to ``launcher_history.csv`` and ``launcher_events.csv``."""

import os

import sys
import warnings

import torch

from lightning_memguard import MemGuardCallback
from tests.models import BlockStack, pl, trainer_kwargs


class OomOnRankOne(BlockStack):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated on rank 1)")
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    root = sys.argv[1]
    guard = MemGuardCallback(budget="1GiB")
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=root, logger=False,
                         **trainer_kwargs(strategy="ddp_spawn", devices=2, max_steps=6))
    try:
        trainer.fit(OomOnRankOne(log_loss=False))
    finally:
        guard.history.to_csv(os.path.join(root, "launcher_history.csv"), index=False)
        guard.events.to_csv(os.path.join(root, "launcher_events.csv"), index=False)
