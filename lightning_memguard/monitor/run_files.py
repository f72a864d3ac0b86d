"""RunFiles: the tables of one fit — the history (a row per phase per step) and the events — and the files in the
run's directory: both as CSV, ``memguard_run.json`` and an OOM report. Each rank writes its own (``.rank<N>``)."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

from ..base.files import write_text
from .history import EVENTS_CSV, HISTORY_CSV, RUN_JSON, EventLog, MemoryHistory

__all__ = ["RunFiles"]


class RunFiles:
    """The history and events of one fit, streamed to CSV files once :meth:`attach` is given a directory.

    Args:
        history_max_rows: history rows kept in memory (the CSV keeps all); ``None`` keeps all.
        rank: this process's rank.
    """

    def __init__(self, history_max_rows: Optional[int] = 100_000, rank: int = 0) -> None:
        self.history = MemoryHistory(max_rows=history_max_rows)
        self.events = EventLog()
        self.rank = rank
        self.files_dir: Optional[str] = None

    @property
    def rank_suffix(self) -> str:
        """``memguard_history.csv`` on rank 0, ``memguard_history.rank1.csv`` on rank 1."""
        return "" if self.rank == 0 else f".rank{self.rank}"

    def attach(self, files_dir: Optional[str], run_info: dict[str, Any], warn: Callable[[str], None]) -> None:
        """Streams both tables to ``files_dir`` (``None``: no files) and, on rank zero, writes ``run_info`` (what
        the report command draws the threshold and capacity from). A file that cannot be written is one ``warn``."""
        self.files_dir = files_dir
        if files_dir is None:
            return
        self.history.attach_csv(os.path.join(files_dir, HISTORY_CSV.replace(".csv", f"{self.rank_suffix}.csv")))
        self.events.attach_csv(os.path.join(files_dir, EVENTS_CSV.replace(".csv", f"{self.rank_suffix}.csv")))
        if self.rank == 0:
            write_text(os.path.join(files_dir, RUN_JSON), json.dumps(run_info, indent=1), warn)

    def write_oom_report(self, text: str, warn: Callable[[str], None]) -> None:
        if self.files_dir is not None:
            write_text(os.path.join(self.files_dir, f"memguard_oom_report{self.rank_suffix}.txt"), text + "\n", warn)

    def close(self) -> None:
        self.history.close()
        self.events.close()
