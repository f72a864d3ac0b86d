"""SpawnedResults: a fit run in other processes (Lightning's ``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``) brings
its history and events back to the process that launched it.

Under these strategies no hook runs in the launching process: the Trainer, callbacks included, is pickled into each
spawned rank (``ddp_spawn``) or copied with the process into each forked one (``ddp_fork``, ``ddp_notebook``), and
only the model's weights and ``callback_metrics`` come back. What the launching process does run is the pickling, or
the fork, so that is where a launch gets a hand-off directory (a unique name under ``tempfile.gettempdir()``): when
pickling for a spawned process (``__getstate__``), or, for a fork, in a hook Python runs just before it
(``os.register_at_fork``) that acts only when Lightning's multiprocessing launcher is forking the ranks of a Trainer
that holds the guard (its ``launch`` on the call stack; a DataLoader worker or a user's own fork is left alone). The
rank whose results Lightning brings back (local rank 0) writes there, as soon as its files are open, where they are,
and the launching process's guard reads them back (pandas) when its ``history`` or ``events`` are asked for. Written
at the start, the hand-off survives a rank that dies later (Lightning runs no hook in a rank that raises).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
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
#: the modules of Lightning's multiprocessing launcher, whose ``launch`` starts the ranks
LAUNCHER_MODULES = ("lightning.pytorch.strategies.launchers.multiprocessing",
                    "pytorch_lightning.strategies.launchers.multiprocessing")


class SpawnedResults:
    """The hand-off between a launching process and the ranks it spawns or forks (one per guard).

    In the launching process, pickling for a spawned process (``multiprocessing``'s spawn or forkserver start) gives
    the pickled copy the launch's hand-off directory and marks it as a rank's; forking the ranks of a Trainer that
    holds this object as an attribute of one of its callbacks (Lightning's fork start: ``ddp_fork``, ``ddp_notebook``)
    names the directory before the fork and marks the forked process's copy as a rank's. Every rank of one launch is
    pickled (forked) before any of them writes (a rank writes after DDP's process group is up, which needs every rank
    started), so the ranks of one launch share a directory: a directory already written to belongs to an earlier
    launch, and the next launch gets a new one (the earlier one is removed), so results never come from an earlier
    fit. A copy made by ``copy.deepcopy`` or a plain ``pickle`` reads the same directory and never writes it; other
    forks (DataLoader workers, a user's own, another Trainer's launch) leave this object as it is.

    A run of the guard in the launching process itself (a fit without spawning or forking) drops the hand-off: its own
    rows are the latest.
    """

    def __init__(self) -> None:
        self.directory: Optional[str] = None
        self.rank_copy = False  # True in a spawned rank's copy: it writes the hand-off, never reads it
        self._remove: Optional[weakref.finalize] = None  # removes a directory this process named, at exit at last
        self._written: Optional[tuple] = None
        self._read: Optional[tuple] = None  # (what the files were when read, (history, events))
        self._warned: Optional[str] = None  # the directory a failure to read was told for
        _watch_forks()

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

    def _become_rank_copy(self) -> None:
        """In a rank forked by a launch: this copy writes the hand-off and never reads it, nor removes the directory
        (the launching process's, removed there)."""
        if self._remove is not None:
            self._remove.detach()
        self.rank_copy, self._remove, self._written, self._read = True, None, None, None

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

    def handed_off_history(self) -> Optional[str]:
        """The history CSV a spawned launch's rank 0 handed off; ``None`` where none was."""
        files = self._read_json(HANDOFF_JSON)
        return None if files is None else files.get("history")

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


# --- forked launches (ddp_fork, ddp_notebook) ----------------------------------------------------------------------
_forking: list[SpawnedResults] = []  # the guards of the Trainer whose rank is being forked now (between the hooks)
_watching = False  # the fork hooks are registered in this process (a forked child inherits them)
_told: set[str] = set()  # the errors of preparing a hand-off said in this process


def _watch_forks() -> None:
    """Registers the fork hooks, once per process (where the platform forks at all)."""
    global _watching
    if not _watching and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_before_fork, after_in_parent=_forking.clear, after_in_child=_after_fork_in_child)
        _watching = True


def _before_fork() -> None:
    """Just before a fork in this process: where it is Lightning's launcher forking a rank, the guards of its Trainer
    get the launch's hand-off directory (each rank's fork of one launch shares it, as for pickles)."""
    try:
        trainer = _launching_trainer(sys._getframe(1))
        for callback in getattr(trainer, "callbacks", None) or ():
            for value in list(getattr(callback, "__dict__", {}).values()):
                if isinstance(value, SpawnedResults) and not value.rank_copy:
                    value._prepare_launch()
                    _forking.append(value)
    except Exception as err:  # a hook's error would only be printed; the launch goes on without a hand-off
        if repr(err) not in _told:  # each rank's fork meets it: said once
            _told.add(repr(err))
            warn(f"lightning-memguard: cannot prepare the forked ranks' hand-off ({err!r}); after the fit, history "
                 "and events show this process's own rows (the ranks' files hold theirs).")


def _after_fork_in_child() -> None:
    for results in _forking:
        results._become_rank_copy()
    _forking.clear()


def _launching_trainer(frame) -> object:
    """The Trainer whose ranks Lightning's multiprocessing launcher is starting, where this fork happens inside its
    ``launch``; else ``None``. (A rank's own forks, its DataLoader workers, have the launch on their stack too: its
    guards are rank copies already, which a launch leaves alone.)"""
    while frame is not None:
        if frame.f_code.co_name == "launch" and frame.f_globals.get("__name__") in LAUNCHER_MODULES:
            return frame.f_locals.get("trainer")
        frame = frame.f_back
    return None
