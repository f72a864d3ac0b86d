"""What every front door shows of its guard: results and settings."""

from __future__ import annotations

from typing import Optional

import pandas as pd

from ..guard.engine import MemGuardEngine
from ..guard.settings import GuardSettings

__all__ = ["GuardResults"]


class GuardResults:
    """What every front door shows of its engine (``self._engine``): the latest run's results and its settings. A run
    is a fit (with its validation), or an evaluation on its own (``trainer.validate``, ``test``, ``predict``; a loop's
    ``evaluate`` before its first step), which starts its own tables and files (``memguard_test_history.csv``): after
    ``trainer.fit`` then ``trainer.test``, :attr:`history` holds the test's rows and the fit's stay in their CSV."""

    _engine: MemGuardEngine

    @property
    def engine(self) -> MemGuardEngine:
        """The framework-free engine behind this front door (read-only): what measures, decides and rescues — its
        ``monitor``, ``recorder``, ``source`` and rescue calls (``on_oom``, looked up at every out-of-memory error) are
        there to inspect. The front door's own methods and properties are the way to use it."""
        return self._engine

    @property
    def history(self) -> pd.DataFrame:
        """The latest run's rows, one per phase per optimizer step and one per evaluation batch (phase ``validation``,
        ``test`` or ``predict``) (columns: step, phase, device, allocated_bytes,
        peak_bytes, reserved_bytes, alloc_retries, num_ooms, nvml_*_bytes, capacity_bytes, micro_batches, time,
        inactive_split_bytes)."""
        return self._engine.history

    @property
    def events(self) -> pd.DataFrame:
        """The latest run's actions and notices, one row each (columns: step, action, rung, reason,
        peak_before_bytes, peak_after_bytes, capacity_bytes, phase, level, time)."""
        return self._engine.events

    @property
    def history_csv(self) -> Optional[str]:
        """The file the latest run's history is streamed to (``None``: none written): ``memguard_history.csv`` in the
        run's directory, ``memguard_history-v1.csv`` where that directory held another run's files already (a second
        Trainer given the same logger), ``memguard_test_history.csv`` for a test run; its events are beside it
        (``_history`` → ``_events``)."""
        return self._engine.history_csv

    @property
    def levels(self) -> dict[str, int]:
        """The level of each rung now (``amp``: 0/1, ``checkpointing``: number of checkpointed blocks,
        ``microbatch``: L for 2**L micro-batches)."""
        return self._engine.levels

    @property
    def source(self):
        """The memory source in use during a fit (CUDA allocator or CPU accountant), else ``None``."""
        return self._engine.source

    @property
    def settings(self) -> GuardSettings:
        """The guard's checked settings (given by keyword or as a :class:`GuardSettings`)."""
        return self._engine.settings

    @property
    def threshold(self) -> float:
        return self.settings.threshold

    @property
    def mitigations(self) -> tuple[str, ...]:
        return self.settings.mitigations

    @property
    def budget_bytes(self) -> Optional[int]:
        return self.settings.budget_bytes

    @property
    def cpu_hard_limit_bytes(self) -> Optional[int]:
        return self.settings.cpu_hard_limit_bytes

    @property
    def rescue_oom(self) -> bool:
        return self.settings.rescue_oom

    @property
    def cpu_sample_every(self) -> int:
        return self.settings.cpu_sample_every

    def explain_next_step(self) -> None:
        """Records the next measured step with a tensor diff and writes the explanation files (see ``explain``)."""
        self._engine.monitor.explain_next_step()
