"""RunFiles: the tables of one fit — the history (a row per phase per step) and the events — and the files in the
run's directory: both as CSV, ``memguard_run.json`` and an OOM report. Each rank writes its own (``.rank<N>``); a run
that only evaluates names its files after its loop (``memguard_test_history.csv``). A run never replaces another's
files: where the directory already holds a run's files (a second Trainer given the same logger, a script run again
with the same ``log_dir``), this run's are versioned as Lightning's ``ModelCheckpoint`` versions a second checkpoint
of the same name (``memguard_history-v1.csv``, ``-v2`` …)."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Optional

from ..base.files import write_text
from .history import EVENTS_CSV, HISTORY_CSV, RUN_JSON, EventLog, MemoryHistory

__all__ = ["RunFiles", "latest_fit_history", "files_beside"]

_FIT_HISTORY = re.compile(r"memguard_history(?:-v(\d+))?\.csv")


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
        #: 0 for the first run's files in a directory, 1 for ``memguard_history-v1.csv``, …
        self.version = 0
        self.files_dir: Optional[str] = None

    def file_name(self, name: str) -> str:
        """``memguard_history.csv`` → ``memguard_test_history-v1.rank1.csv`` for a test run on rank 1 whose directory
        held a test run's files already."""
        return self._versioned(name, self.version)

    def _versioned(self, name: str, version: int) -> str:
        stem, dot, extension = name.rpartition(".")
        if self.name:
            stem = stem.replace("memguard_", f"memguard_{self.name}_", 1)
        if version:
            stem = f"{stem}-v{version}"
        return f"{stem}{self.rank_suffix}{dot}{extension}"

    def _first_free_version(self, files_dir: str) -> int:
        # this rank's tables decide: rank 0's run JSON alone would let a rank >0 reuse its own older files
        version = 0
        while any(os.path.exists(os.path.join(files_dir, self._versioned(table, version)))
                  for table in (HISTORY_CSV, EVENTS_CSV)):
            version += 1
        return version

    @property
    def rank_suffix(self) -> str:
        """``memguard_history.csv`` on rank 0, ``memguard_history.rank1.csv`` on rank 1."""
        return "" if self.rank == 0 else f".rank{self.rank}"

    def attach(self, files_dir: Optional[str], run_info: dict[str, Any], warn: Callable[[str], None],
               goes_on_in: Optional[int] = None) -> None:
        """Streams both tables to ``files_dir`` (``None``: no files) and, on rank zero, writes ``run_info`` (what
        the report command draws the threshold and capacity from). ``goes_on_in``: the version of the files whose
        rows the tables go on after (a further fit that continues the last one's steps); ``None``: new files, at the
        first version no run in ``files_dir`` has used. A file that cannot be written is one ``warn``."""
        self.files_dir = files_dir
        if files_dir is None:
            return
        append = goes_on_in is not None
        self.version = goes_on_in if append else self._first_free_version(files_dir)
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


def latest_fit_history(directory: str) -> tuple[Optional[str], int]:
    """The history CSV of the latest fit whose files are in ``directory`` (rank 0's: the highest version) and how
    many fits' histories it holds; ``(None, 0)`` where there is none."""
    versions = {}
    for entry in os.listdir(directory):
        match = _FIT_HISTORY.fullmatch(entry)
        if match:
            versions[int(match.group(1) or 0)] = entry
    if not versions:
        return None, 0
    return os.path.join(directory, versions[max(versions)]), len(versions)


def files_beside(history_csv: str) -> tuple[str, str]:
    """The events CSV and the run JSON written with ``history_csv`` (the same run, version and rank; the run JSON is
    rank 0's, the only one written)."""
    directory, name = os.path.split(history_csv)
    events = name.replace("_history", "_events", 1)
    run_json = re.sub(r"(\.rank\d+)?\.csv$", ".json", name.replace("_history", "_run", 1))
    return os.path.join(directory, events), os.path.join(directory, run_json)
