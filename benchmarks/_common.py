"""Shared by the benchmark scripts: a step timer and quiet defaults."""

from __future__ import annotations

import logging
import statistics
import time
import warnings

import torch
from lightning.pytorch.callbacks import Callback


def quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


class StepTimer(Callback):
    """Wall time from one batch start to the next: the whole step, every callback's hooks included."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now

    def mean(self, skip: int) -> float:
        """Mean step time after ``skip`` warm-up steps (the mean, not the median: rare slow steps count)."""
        return statistics.fmean(self.times[skip:])
