"""Rows of snapshots and events: a bounded in-memory table (pandas on demand) streamed to CSV."""

from __future__ import annotations

import csv
import os
from collections import deque
from typing import Iterable, Optional

import pandas as pd

from .snapshot import EVENT_COLUMNS, SNAPSHOT_COLUMNS, Event, MemorySnapshot

__all__ = ["RowLog", "MemoryHistory", "EventLog"]


class RowLog:
    """A table that keeps the last ``max_rows`` rows in memory and streams every row to a CSV file.

    Memory stays bounded on long runs: older rows leave the in-memory table but are all in the CSV. Rows are
    buffered and written on :meth:`flush` (the callback flushes at each logging interval, at the end of training
    and on an exception), so a crash keeps everything up to the last flush.
    """

    def __init__(self, columns: Iterable[str], max_rows: Optional[int] = 100_000) -> None:
        if max_rows is not None and max_rows <= 0:
            raise ValueError(f"max_rows={max_rows!r} must be a positive int or None (unbounded)")
        self.columns = tuple(columns)
        self._rows: deque[tuple] = deque(maxlen=max_rows)
        self._pending: list[tuple] = []
        self.path: Optional[str] = None
        self._total = 0

    def __len__(self) -> int:
        return self._total

    def append(self, record: object) -> None:
        """Appends an object with an attribute per column (a snapshot or an event). Attribute by attribute:
        dataclasses.asdict deep-copies every field, ~15 µs a row on the training thread."""
        values = tuple(getattr(record, column) for column in self.columns)
        self._rows.append(values)
        if self.path is not None:
            self._pending.append(values)
        self._total += 1

    def attach_csv(self, path: str) -> None:
        """Streams rows to ``path`` from now on, starting with every row still held in memory."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", newline="") as f:
            csv.writer(f).writerow(self.columns)
        self.path = path
        self._pending = list(self._rows)

    def flush(self) -> None:
        if self.path is None or not self._pending:
            return
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerows(self._pending)
        self._pending.clear()

    def to_dataframe(self) -> pd.DataFrame:
        return pd.DataFrame(list(self._rows), columns=list(self.columns))


class MemoryHistory(RowLog):
    """One row per :class:`~lightning_memguard.snapshot.MemorySnapshot`."""

    def __init__(self, max_rows: Optional[int] = 100_000) -> None:
        super().__init__(SNAPSHOT_COLUMNS, max_rows)

    def add(self, snapshot: MemorySnapshot) -> None:
        self.append(snapshot)


class EventLog(RowLog):
    """One row per :class:`~lightning_memguard.snapshot.Event`; events are few, so all are kept."""

    def __init__(self) -> None:
        super().__init__(EVENT_COLUMNS, max_rows=None)

    def add(self, event: Event) -> None:
        self.append(event)
