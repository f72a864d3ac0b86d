"""SpawnedResults: a fit run in spawned processes (Lightning's ``ddp_spawn``) brings its history and events back to
the process that launched it.

Under ``ddp_spawn`` no hook runs in the launching process: the Trainer, callbacks included, is pickled into each
spawned rank, and only the model's weights and ``callback_metrics`` come back. What the launching process does run is
the pickling, so that is where a launch gets a hand-off directory (a unique name under ``tempfile.gettempdir()``); the
rank whose results Lightning brings back (local rank 0) writes there, as soon as its files are open, where they are,
and the launching process's guard reads them back (pandas) when its ``history`` or ``events`` are asked for. Written
at the start, the hand-off survives a rank that dies later (Lightning runs no hook in a rank that raises).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
import weakref
from multiprocessing.context import get_spawning_popen
from typing import Callable, Optional

import pandas as pd

from ..base.checks import warn
from ..base.snapshot import EVENT_COLUMNS, SNAPSHOT_COLUMNS
from ..monitor.history import read_rows

__all__ = ["SpawnedResults"]

#: in a launch's hand-off directory: {"history": <csv path>, "events": <csv path>} (``null``: no file)
HANDOFF_JSON = "memguard_files.json"
#: and the guard's state (its ``state_dict()``: the levels and the policy's state) where the fit ended
STATE_JSON = "memguard_state.json"


class SpawnedResults:
    """The hand-off between a launching process and the ranks it spawns (one per guard).

    In the launching process, pickling for a spawned process (``multiprocessing``'s spawn or forkserver start) gives
    the pickled copy the launch's hand-off directory and marks it as a rank's. Every rank of one launch is pickled
    before any of them writes (a rank writes after DDP's process group is up, which needs every rank started), so the
    pickles of one launch share a directory: a directory already written to belongs to an earlier launch, and the next
    launch gets a new one (the earlier one is removed), so results never come from an earlier fit. A copy made by
    ``copy.deepcopy`` or a plain ``pickle`` reads the same directory and never writes it.

    A run of the guard in the launching process itself (a fit without spawning) drops the hand-off: its own rows are
    the latest.
    """

    def __init__(self) -> None:
        self.directory: Optional[str] = None
        self.rank_copy = False  # True in a spawned rank's copy: it writes the hand-off, never reads it
        self._remove: Optional[weakref.finalize] = None  # removes a directory this process named, at exit at last
        self._written: Optional[tuple] = None
        self._read: Optional[tuple] = None  # (what the files were when read, (history, events))
        self._warned: Optional[str] = None  # the directory a failure to read was told for

    # --- pickling ---------------------------------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        spawning = get_spawning_popen() is not None
        if spawning and not self.rank_copy:
            self._prepare_launch()
        return {"directory": self.directory, "rank_copy": spawning}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
        self.directory, self.rank_copy = state["directory"], state["rank_copy"]

    def _prepare_launch(self) -> None:
        if self.directory is not None and not os.path.exists(self.directory):
            return  # another rank of the same launch (or a launch whose rank 0 never got to write): still unwritten
        self.drop()
        self.directory = os.path.join(tempfile.gettempdir(), f"memguard-spawn-{uuid.uuid4().hex}")
        self._remove = weakref.finalize(self, shutil.rmtree, self.directory, ignore_errors=True)

    def drop(self) -> None:
        """Forgets the hand-off (a run in this process, or a new launch), removing a directory this process named."""
        if self._remove is not None:
            self._remove()
        self.directory, self._remove, self._read, self._warned = None, None, None, None

    # --- in a spawned rank ------------------------------------------------------------------------------------------
    def begin_run(self) -> None:
        """A run of the guard starts in this process: in the launching process its own rows are now the latest."""
        if not self.rank_copy:
            self.drop()

    def hand_off(self, history_csv: Optional[str], events_csv: Optional[str], local_rank: int,
                 warn_rank: Callable[[str], None]) -> None:
        """In local rank 0 of a spawned launch: says where this run's files are (``None``: not written; a run that
        writes neither, ``fast_dev_run``, hands nothing off). Written atomically, once per run. A failure is one
        ``warn_rank``."""
        files = (history_csv, events_csv)
        if not self.rank_copy or self.directory is None or local_rank != 0 or files in (self._written, (None, None)):
            return
        error = self._write(HANDOFF_JSON, {"history": history_csv, "events": events_csv})
        if error is not None:
            warn_rank(f"lightning-memguard: cannot write {error}; the launching process's guard will not show this "
                      "run's history and events (they are in the run's files).")
        self._written = files

    def hand_off_state(self, state: dict, local_rank: int, warn_rank: Callable[[str], None]) -> None:
        """In local rank 0 of a spawned launch: the guard's state where the fit ended (its levels), for the launching
        process's ``state_dict()`` (a checkpoint saved there) and ``levels``. A failure is one ``warn_rank``."""
        if not self.rank_copy or self.directory is None or local_rank != 0:
            return
        error = self._write(STATE_JSON, state)
        if error is not None:
            warn_rank(f"lightning-memguard: cannot write {error}; the launching process's guard will show the levels "
                      "it started the fit at (the events say where the fit ended).")

    def _write(self, name: str, content: dict) -> Optional[str]:
        """Writes ``content`` as JSON to ``name`` in the hand-off directory, atomically (the launching process never
        reads half a file); the failure's text, else ``None``."""
        path = os.path.join(self.directory, name)
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            with open(path + ".tmp", "w") as file:
                json.dump(content, file)
            os.replace(path + ".tmp", path)
        except (OSError, TypeError, ValueError) as err:  # TypeError, ValueError: what JSON cannot hold
            return f"{path} ({getattr(err, 'strerror', None) or err})"
        return None

    # --- in the launching process -----------------------------------------------------------------------------------
    def read_state(self) -> Optional[dict]:
        """The guard's state a spawned launch's rank 0 handed off where its fit ended; ``None`` where there is none
        or it cannot be read (one warning)."""
        return self._read_json(STATE_JSON)

    def _read_json(self, name: str) -> Optional[dict]:
        """The mapping a rank wrote to ``name`` in the hand-off directory; ``None`` where there is none (no launch, or
        not written) or it cannot be read (one warning)."""
        if self.rank_copy or self.directory is None:
            return None
        path = os.path.join(self.directory, name)
        try:
            with open(path) as file:
                content = json.load(file)
            if not isinstance(content, dict):
                raise ValueError("not a mapping")
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            return self._cannot_read(path, err)
        return content

    def read(self, max_rows: Optional[int]) -> Optional[tuple[pd.DataFrame, pd.DataFrame]]:
        """The history (its last ``max_rows`` rows) and events a spawned launch handed off; ``None`` where there is
        none (no launch, or its rank 0 did not open its files) or they cannot be read (one warning)."""
        files = self._read_json(HANDOFF_JSON)
        if files is None:
            return None
        key = (files.get("history"), files.get("events"))
        try:
            seen = (key, *[_stamp(name) for name in key])
            if self._read is None or self._read[0] != seen:
                self._read = (seen, (_table(key[0], SNAPSHOT_COLUMNS, max_rows), _table(key[1], EVENT_COLUMNS, None)))
        except (OSError, ValueError) as err:  # pandas' parser and empty-data errors are ValueErrors
            return self._cannot_read(" or ".join(filter(None, key)), err)
        return self._read[1]

    def _cannot_read(self, what: str, err: Exception) -> None:
        if self._warned != self.directory:
            self._warned = self.directory
            warn(f"lightning-memguard: cannot read back the spawned ranks' results from {what} ({err}); history and "
                 "events show this process's own rows (the ranks' files hold theirs).")
        return None


def _stamp(path: Optional[str]) -> Optional[tuple[int, int]]:
    """What changes when a file is written to (files are final once a fit returns; a read during one is redone)."""
    if path is None:
        return None
    status = os.stat(path)
    return status.st_mtime_ns, status.st_size


def _table(path: Optional[str], columns, max_rows: Optional[int]) -> pd.DataFrame:
    return pd.DataFrame(columns=list(columns)) if path is None else read_rows(path, columns, max_rows)
