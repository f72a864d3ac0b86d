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

from ..base.checks import warn
from .tensor_diff import TensorDiff


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
    """Decides when to explain and writes the files.

    The first crossing of the threshold arms it (when ``enabled``): the next measured step is recorded with a
    :class:`~lightning_memguard.monitor.tensor_diff.TensorDiff` and, on CUDA, with allocation stacks, then the files are
    written. An OOM writes a CUDA snapshot at once. :meth:`arm` asks for the next step on demand.

    Args:
        enabled: explain the first crossing and OOMs.
        record_history: on CUDA, record allocation stacks from :meth:`start` on, not only for the explained step.
        max_entries: bound on the recorded allocation history.
    """

    def __init__(self, enabled: bool = True, record_history: bool = False, max_entries: int = 100_000) -> None:
        self.enabled = enabled
        self.record_history = record_history
        self.max_entries = max_entries
        self.armed = False
        self.cuda = False
        self.compiled = False
        self._diff: Optional[TensorDiff] = None
        self._snapshot_after_step: Optional[int] = None

    @property
    def recording(self) -> bool:
        return self._diff is not None

    def start(self, cuda: bool, compiled: bool = False) -> None:
        """``compiled``: the run calls compiled code (the tensor diff then labels no modules)."""
        self.cuda = cuda and torch.cuda.is_available()
        self.compiled = compiled
        if self.cuda and self.record_history:
            record_cuda_history(True, self.max_entries)

    def arm(self) -> None:
        self.armed = True

    def on_first_crossing(self, step: int) -> None:
        if not self.enabled:
            return
        self.armed = True
        if self.cuda:
            record_cuda_history(True, self.max_entries)  # the next step's allocations, with their stacks
            self._snapshot_after_step = step + 1

    def begin(self, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.armed = False
        self._diff = TensorDiff(model, optimizers, module_names=not self.compiled)
        self._diff.start()
        self._diff.mark("batch_start")

    def mark(self, phase: str) -> None:
        if self._diff is not None:
            self._diff.mark(phase)

    def after_step(self, step: int, log_dir: Optional[str]) -> list[str]:
        """Writes what the step asked for: ``memguard_tensor_diff_step<N>.csv`` (what appeared and disappeared
        between consecutive boundaries), ``memguard_top_consumers_step<N>.csv`` (live bytes by category and module
        at the boundary with the most live bytes) and the CUDA snapshot. Returns the paths written: none when
        ``log_dir`` is ``None`` (a run that writes no files) or a file cannot be written (one warning)."""
        written = self._write_diff(step, log_dir) if self._diff is not None else []
        if self._snapshot_after_step is not None and step >= self._snapshot_after_step:
            self._snapshot_after_step = None
            written += self._snapshot(log_dir, f"memguard_memory_snapshot_step{step}.pickle")
            if not self.record_history:
                record_cuda_history(False)
        return written

    def on_oom(self, step: int, log_dir: Optional[str]) -> list[str]:
        return self._snapshot(log_dir, f"memguard_memory_snapshot_oom_step{step}.pickle") if self.enabled else []

    def abort(self) -> None:
        if self._diff is not None:
            self._diff.stop()
            self._diff = None

    def _snapshot(self, log_dir: Optional[str], name: str) -> list[str]:
        if not self.cuda or log_dir is None:
            return []
        path = os.path.join(log_dir, name)
        try:
            return [p for p in [dump_cuda_snapshot(path)] if p]
        except OSError as err:
            warn(f"lightning-memguard: cannot write {path} ({err.strerror or err}); training goes on.")
            return []

    def _write_diff(self, step: int, log_dir: Optional[str]) -> list[str]:
        diff, self._diff = self._diff, None
        diff.stop()
        if log_dir is None:
            return []
        marks = diff.marks
        parts = [diff.diff(a, b).assign(between=f"{a} -> {b}") for a, b in zip(marks, marks[1:])]
        fullest = max(marks, key=lambda m: diff.consumers(m)["bytes"].sum())
        diff_path = os.path.join(log_dir, f"memguard_tensor_diff_step{step}.csv")
        consumers_path = os.path.join(log_dir, f"memguard_top_consumers_step{step}.csv")
        try:
            os.makedirs(log_dir, exist_ok=True)
            pd.concat(parts, ignore_index=True).to_csv(diff_path, index=False)
            diff.consumers(fullest).assign(at=fullest).to_csv(consumers_path, index=False)
        except OSError as err:
            warn(f"lightning-memguard: cannot write the explanation of step {step} to {log_dir} "
                 f"({err.strerror or err}); training goes on.")
            return []
        return [diff_path, consumers_path]
