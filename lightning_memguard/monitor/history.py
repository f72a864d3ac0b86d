"""Rows of snapshots and events: a bounded in-memory table (pandas on demand) streamed to CSV."""

from __future__ import annotations

import csv
import os
import re
from collections import deque
from typing import Iterable, Optional, Sequence, TextIO

import pandas as pd

from ..base.checks import check_int, warn
from ..base.snapshot import EVENT_COLUMNS, SNAPSHOT_COLUMNS, Event, MemorySnapshot

#: The files of a run, in its log directory (other ranks' files carry a ``.rank<N>`` suffix).
HISTORY_CSV = "memguard_history.csv"
EVENTS_CSV = "memguard_events.csv"
RUN_JSON = "memguard_run.json"

__all__ = ["RowLog", "MemoryHistory", "EventLog", "read_rows"]


class RowLog:
    """A table that keeps the last ``max_rows`` rows in memory and streams every row to a CSV file.

    Memory stays bounded on long runs: older rows leave the in-memory table but are all in the CSV. Rows go to the
    open file as they come and reach the operating system at each :meth:`flush` at the latest (the engine flushes after
    every optimizer step), so a process killed hard loses at most the step in progress. No fsync: the OS keeps the
    data when the process dies; only a machine crash could lose it.

    A file that cannot be written is never the reason a run dies: one warning, and the rows stay in memory.
    """

    def __init__(self, columns: Iterable[str], max_rows: Optional[int] = 100_000) -> None:
        check_int("max_rows", max_rows, none_means="keep every row")
        self.columns = tuple(columns)
        self._rows: deque[tuple] = deque(maxlen=max_rows)
        self.path: Optional[str] = None
        self._file: Optional[TextIO] = None
        self._writer = None
        self._total = 0
        self._dirty = False  # whether the file's buffers may hold rows the operating system has not got yet

    def __len__(self) -> int:
        return self._total

    def append(self, record: object) -> None:
        """Appends an object with an attribute per column (an event), or a tuple in column order (a snapshot, which
        is one). Attribute by attribute: dataclasses.asdict deep-copies every field, ~15 µs a row on the training
        thread."""
        values = record if isinstance(record, tuple) else tuple(getattr(record, column) for column in self.columns)
        self._rows.append(values)
        self._total += 1
        if self._writer is not None:
            self._dirty = True
            self._write(self._writer.writerow, values)

    def extend(self, rows: Sequence[tuple]) -> None:
        """Appends tuples in column order (a step's snapshots) in one go: one call into the CSV writer, not one a
        row."""
        self._rows.extend(rows)
        self._total += len(rows)
        if self._writer is not None:
            self._dirty = True
            self._write(self._writer.writerows, rows)

    def attach_csv(self, path: str, append: bool = False) -> bool:
        """Streams rows to ``path`` from now on, starting with every row still held in memory. ``append``: add them
        after the rows a file of this table already holds (no second header), else the file starts anew. Returns
        False (after one warning) when the file cannot be written."""
        self.close()
        append = append and os.path.isfile(path) and os.path.getsize(path) > 0
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a" if append else "w", newline="")
        except OSError as err:
            self._give_up_file(path, err)
            return False
        self.path = path
        self._writer = csv.writer(self._file)
        self._dirty = True
        if not append:
            self._write(self._writer.writerow, self.columns)
        self._write(self._writer.writerows, list(self._rows))
        self.flush()
        return self._writer is not None

    def flush(self) -> None:
        """Hands the rows written so far to the operating system (nothing to do where every write already did)."""
        if self._file is not None and self._dirty:
            self._dirty = False
            self._write(self._file.flush)

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            if self._file is not None:
                self._file.close()
        self._file = self._writer = None

    def to_dataframe(self) -> pd.DataFrame:
        return pd.DataFrame(list(self._rows), columns=list(self.columns))

    def _write(self, write, *args) -> None:
        try:
            write(*args)
        except OSError as err:  # a full disk, a directory gone: keep training, keep the rows in memory
            self._give_up_file(self.path, err)

    def _give_up_file(self, path: Optional[str], err: OSError) -> None:
        warn(f"lightning-memguard: cannot write {path} ({err.strerror or err}); the rows stay in memory only "
             "(the guard's history / events) and training goes on.")
        file, self._file, self._writer = self._file, None, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass


#: The numbers of a history row between its device and its time, as the csv module writes them (``str``; ``None`` as
#: "None", emptied afterwards); the row's line is ``step,phase,device,<these>,repr(time),inactive_split_bytes``
_MIDDLE = ",".join(["%s"] * (SNAPSHOT_COLUMNS.index("time") - SNAPSHOT_COLUMNS.index("allocated_bytes")))
_FIRST_NUMBER, _TIME = SNAPSHOT_COLUMNS.index("allocated_bytes"), SNAPSHOT_COLUMNS.index("time")
assert SNAPSHOT_COLUMNS[:_FIRST_NUMBER] == ("step", "phase", "device") and len(SNAPSHOT_COLUMNS) == _TIME + 2
#: what makes the csv module quote a cell (its default dialect, minimal quoting), and the placeholder of an empty cell
_NOT_PLAIN = re.compile(r'[,"\r\n]|None')
#: the columns that hold text (a phase, a device): the only cells that could need quoting
_PHASE, _DEVICE = SNAPSHOT_COLUMNS.index("phase"), SNAPSHOT_COLUMNS.index("device")


class MemoryHistory(RowLog):
    """One row per :class:`~lightning_memguard.base.snapshot.MemorySnapshot`.

    A step's rows are written as the csv module writes them, but formatted here (about a third of the csv writer's time,
    on the training thread every step): the texts (phases, devices) are checked once each, and a row with one that
    would need quoting goes through the csv writer; a step's time (the same for its rows) is formatted once; a
    row's text between its step and its time (phase, device, sizes and counts) and after its time is formatted again
    only when its phase's values differ from that phase's last row, which in a steady run they seldom do. The step's
    text goes to the operating system in one write of the file's unbuffered layer (after whatever the buffered
    layers held), so the step's :meth:`flush` has nothing left to do: one system call a step instead of the text and
    buffer layers' work around it.
    """

    def __init__(self, max_rows: Optional[int] = 100_000) -> None:
        super().__init__(SNAPSHOT_COLUMNS, max_rows)
        self._plain_texts: set[str] = set()  # texts seen that the csv module writes as they are
        #: phase -> its last row's values from the device to the time, the value after the time, and their texts
        self._numbers: dict[str, tuple[tuple, object, str, str]] = {}

    def add(self, snapshot: MemorySnapshot) -> None:
        self.append(snapshot)

    def extend(self, rows: Sequence[tuple]) -> None:
        """Appends a step's snapshots, written to the CSV in one call."""
        self._rows.extend(rows)
        self._total += len(rows)
        file = self._file
        if file is None:
            return
        texts, known, lines = self._plain_texts, self._numbers, []
        last_time = time_text = None
        for row in rows:
            phase = row[_PHASE]
            if (phase not in texts or row[_DEVICE] not in texts) and not self._plain(row):
                self._dirty = True
                self._write(self._writer.writerows, rows)  # quoting: the csv writer's own
                return
            values = row[_DEVICE:_TIME]
            tail = row[_TIME + 1]
            entry = known.get(phase)
            if entry is None or entry[0] != values or entry[1] != tail:
                # "None" is no number's text and in no text checked: only the cells of None values hold it
                middle = f",{phase},{row[_DEVICE]},{_MIDDLE % row[_FIRST_NUMBER:_TIME]},".replace("None", "")
                entry = known[phase] = (values, tail, middle, f",{tail}\r\n".replace("None", ""))
            moment = row[_TIME]
            if moment is not last_time:  # a float's text as the csv module writes it: its repr
                last_time, time_text = moment, repr(moment)
            lines.append(f"{row[0]}{entry[2]}{time_text}{entry[3]}")
        if self._dirty:  # rows the csv writer left in the buffers go first
            self.flush()
            file = self._file
            if file is None:
                return
        try:
            data = "".join(lines).encode(file.encoding)  # the bytes the text layer would have written
            raw = file.buffer.raw
            written = raw.write(data)
            while written < len(data):  # a short write (rare on a regular file): the rest
                written += raw.write(data[written:])
        except OSError as err:
            self._give_up_file(self.path, err)

    def _plain(self, row: tuple) -> bool:
        """Whether every text cell of ``row`` is written by the csv module as it is (a non-empty string without a
        comma, a quote, a line break or "None")."""
        texts = self._plain_texts
        for index in (_PHASE, _DEVICE):
            text = row[index]
            if text not in texts:
                if not isinstance(text, str) or not text or _NOT_PLAIN.search(text):
                    return False
                texts.add(text)
        return True


class EventLog(RowLog):
    """One row per :class:`~lightning_memguard.base.snapshot.Event`; events are few, so all are kept."""

    def __init__(self) -> None:
        super().__init__(EVENT_COLUMNS, max_rows=None)

    def add(self, event: Event) -> None:
        self.append(event)


def read_rows(path: str, columns: Sequence[str], max_rows: Optional[int] = None) -> pd.DataFrame:
    """Reads back a table a :class:`RowLog` streamed to ``path``: ``columns`` in that order (one the file lacks,
    written by another version, is empty), its last ``max_rows`` rows (``None``: all). Empty cells (a value the row did
    not have) read back as NaN.

    Raises:
        OSError: the file cannot be read; ``pandas.errors.ParserError`` or ``ValueError``: it is not such a table.
    """
    frame = pd.read_csv(path)
    if max_rows is not None:
        frame = frame.tail(max_rows).reset_index(drop=True)
    return frame.reindex(columns=list(columns))
