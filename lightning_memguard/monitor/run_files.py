"""RunFiles: the tables of one fit — the history (a row per phase per step) and the events — and the files in the
run's directory: both as CSV, ``memguard_run.json`` and an OOM report. Each rank writes its own (``.rank<N>``); a run
that only evaluates names its files after its loop (``memguard_test_history.csv``), so a fit's are never
overwritten."""

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
        name: what the file names carry after ``memguard_`` (``"test"``: ``memguard_test_history.csv``); ``""`` for
            a fit.
    """

    def __init__(self, history_max_rows: Optional[int] = 100_000, rank: int = 0, name: str = "") -> None:
        self.history = MemoryHistory(max_rows=history_max_rows)
        self.events = EventLog()
        self.rank = rank
        self.name = name
        self.files_dir: Optional[str] = None

    def file_name(self, name: str) -> str:
        """``memguard_history.csv`` → ``memguard_test_history.rank1.csv`` for a test run on rank 1."""
        stem, dot, extension = name.rpartition(".")
        if self.name:
            stem = stem.replace("memguard_", f"memguard_{self.name}_", 1)
        return f"{stem}{self.rank_suffix}{dot}{extension}"

    @property
    def rank_suffix(self) -> str:
        """``memguard_history.csv`` on rank 0, ``memguard_history.rank1.csv`` on rank 1."""
        return "" if self.rank == 0 else f".rank{self.rank}"

    def attach(self, files_dir: Optional[str], run_info: dict[str, Any], warn: Callable[[str], None],
               append: bool = False) -> None:
        """Streams both tables to ``files_dir`` (``None``: no files) and, on rank zero, writes ``run_info`` (what
        the report command draws the threshold and capacity from). ``append``: the tables go on after the rows their
        files hold (a further fit that continues the last one's steps), else the files start anew. A file that
        cannot be written is one ``warn``."""
        self.files_dir = files_dir
        if files_dir is None:
            return
        self.history.attach_csv(os.path.join(files_dir, self.file_name(HISTORY_CSV)), append)
        self.events.attach_csv(os.path.join(files_dir, self.file_name(EVENTS_CSV)), append)
        if self.rank == 0:
            write_text(os.path.join(files_dir, self.file_name(RUN_JSON)), json.dumps(run_info, indent=1), warn)

    def write_oom_report(self, text: str, warn: Callable[[str], None]) -> None:
        if self.files_dir is not None:
            write_text(os.path.join(self.files_dir, self.file_name("memguard_oom_report.txt")), text + "\n", warn)

    def close(self) -> None:
        self.history.close()
        self.events.close()
