"""Shared by the benchmark scripts: a step timer and quiet defaults. Importing it puts the checkout first on
``sys.path``, so a script runs this checkout's ``lightning_memguard`` (and its tests' models), not an installed one."""

from __future__ import annotations

import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402


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
