"""Files that explain a near-OOM step: the tensor diff between its boundaries, the top consumers at its fullest
moment and, on CUDA, an allocator snapshot for pytorch.org/memory_viz (framework-free).

Snapshot pickles are Python pickles: load them only from runs you trust.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

import pandas as pd
import torch
from torch import nn

from lightning_memguard.tensor_diff import TensorDiff


def dump_cuda_snapshot(path: str) -> Optional[str]:
    """Writes the CUDA allocator's state (segments, blocks and, if history is recorded, the stack of each
    allocation) to ``path``. Returns the path, or ``None`` without CUDA."""
    if not torch.cuda.is_available():
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.cuda.memory._dump_snapshot(path)
    return path


def record_cuda_history(enabled: bool, max_entries: int = 100_000) -> None:
    """Starts (or stops) recording a stack for every CUDA allocation, bounded to ``max_entries`` events. Costs time
    per allocation: switched on near the threshold only, unless asked for from the start."""
    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=max_entries)


class StepExplainer:
    """Records one step with a :class:`~lightning_memguard.tensor_diff.TensorDiff` and writes what it saw.

    ``arm()`` asks for the next step; the callback then calls ``begin``, ``mark`` at each boundary and ``end``.
    """

    def __init__(self) -> None:
        self.armed = False
        self._diff: Optional[TensorDiff] = None
        self.written: list[str] = []

    @property
    def recording(self) -> bool:
        return self._diff is not None

    def arm(self) -> None:
        self.armed = True

    def begin(self, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.armed = False
        self._diff = TensorDiff(model, optimizers)
        self._diff.start()
        self._diff.mark("batch_start")

    def mark(self, phase: str) -> None:
        if self._diff is not None:
            self._diff.mark(phase)

    def end(self, step: int, log_dir: str) -> list[str]:
        """Stops recording and writes ``memguard_tensor_diff_step<N>.csv`` (what appeared/disappeared between
        consecutive boundaries) and ``memguard_top_consumers_step<N>.csv`` (live bytes by category and module at
        the boundary with the most live bytes)."""
        diff, self._diff = self._diff, None
        if diff is None:
            return []
        diff.stop()
        marks = diff.marks
        parts = [diff.diff(a, b).assign(between=f"{a} -> {b}") for a, b in zip(marks, marks[1:])]
        fullest = max(marks, key=lambda m: diff.consumers(m)["bytes"].sum())
        os.makedirs(log_dir, exist_ok=True)
        diff_path = os.path.join(log_dir, f"memguard_tensor_diff_step{step}.csv")
        consumers_path = os.path.join(log_dir, f"memguard_top_consumers_step{step}.csv")
        pd.concat(parts, ignore_index=True).to_csv(diff_path, index=False)
        diff.consumers(fullest).assign(at=fullest).to_csv(consumers_path, index=False)
        self.written += [diff_path, consumers_path]
        return [diff_path, consumers_path]

    def abort(self) -> None:
        if self._diff is not None:
            self._diff.stop()
            self._diff = None
