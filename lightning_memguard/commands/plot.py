"""The picture of a run: memory per phase over steps, capacity and threshold, and what MemGuard did when.
matplotlib with the Agg backend: no display needed."""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass, field
from typing import Optional

import pandas as pd

from ..base.snapshot import PHASES, GiB, MiB
from ..monitor.history import HISTORY_CSV
from ..monitor.run_files import files_beside, latest_fit_history

_PHASE_STYLE = {
    "batch_start": ("#8c8c8c", "batch start"),
    "after_forward": ("#1f77b4", "forward"),
    "after_backward": ("#9467bd", "backward"),
    "after_optimizer_step": ("#2ca02c", "optimizer step"),
}
_EVENT_STYLE = {
    "plan": ("#17becf", "planned"),
    "apply": ("#ff7f0e", "rung applied"),
    "revert": ("#8c564b", "rung reverted"),
    "rescue": ("#d62728", "OOM rescued"),
    "rescue_split": ("#e377c2", "OOM rescued, that batch split"),
    "gave_up": ("#000000", "OOM, gave up"),
}


#: Columns a history CSV must have to be read back.
REQUIRED_HISTORY_COLUMNS = ("step", "phase", "device", "peak_bytes", "capacity_bytes")


@dataclass
class Run:
    """A run's files, read back: history, events and the settings it ran with, plus notes on what was skipped."""

    history: pd.DataFrame
    events: pd.DataFrame
    settings: dict
    directory: str
    notes: list[str] = field(default_factory=list)

    @property
    def threshold(self) -> Optional[float]:
        threshold = self.settings.get("threshold")
        return threshold if isinstance(threshold, (int, float)) and 0 < threshold <= 1 else None


def load_run(path: str) -> Run:
    """Reads a run from its log directory or its history CSV (events and settings beside it, if present).

    A run killed mid-write may end in a partial row: it is skipped, with a note. Events and settings are optional:
    an unreadable one is left out, with a note.

    Raises:
        ValueError: one sentence saying why the history cannot be read (missing, not a CSV, missing columns).
    """
    notes: list[str] = []
    history_path: Optional[str] = path
    if os.path.isdir(path):
        history_path, fits = latest_fit_history(path)
        if fits > 1:
            notes.append(f"{fits} fits' files are in {path}: reading the latest, {os.path.basename(history_path)}; "
                         f"give a history CSV to read another")
    if history_path is None or not os.path.isfile(history_path):
        raise ValueError(f"no {HISTORY_CSV} in {path!r}: give a run's log directory or its history CSV")
    directory = os.path.dirname(os.path.abspath(history_path))
    history = _read_csv(history_path, REQUIRED_HISTORY_COLUMNS, notes)
    events = pd.DataFrame(columns=["step", "action", "rung", "level", "reason"])
    events_path, settings_path = files_beside(history_path)
    if os.path.isfile(events_path):
        try:
            events = _read_csv(events_path, ("step", "action", "rung", "level", "reason"), notes)
        except ValueError as err:
            notes.append(f"events left out: {err}")
    settings: dict = {}
    if os.path.isfile(settings_path):
        try:
            with open(settings_path) as f:
                settings = json.load(f)
            if not isinstance(settings, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as err:
            settings = {}
            notes.append(f"{os.path.basename(settings_path)} left out ({err}); no threshold line")
    return Run(history, events, settings, directory, notes)


def _read_csv(path: str, required: tuple[str, ...], notes: list[str]) -> pd.DataFrame:
    """A MemGuard CSV without its partial last row (a process killed mid-write), or a ValueError saying why not."""
    name = os.path.basename(path)
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} cannot be read as text ({type(err).__name__}); is it a MemGuard CSV?") from None
    lines = text.splitlines(keepends=True)
    if not lines:
        raise ValueError(f"{path} is empty: not even a header was written")
    rows = list(csv.reader(lines))
    header = rows[0]
    missing = [c for c in required if c not in header]
    if missing:
        raise ValueError(f"{path} lacks the column(s) {missing}; is it a MemGuard {name}?")
    if len(rows) > 1 and (not lines[-1].endswith("\n") or len(rows[-1]) != len(header)):
        rows.pop()
        notes.append(f"the last row of {name} was cut off when it was written (a killed run?) and is skipped")
    for number, fields in enumerate(rows[1:], start=2):
        if len(fields) != len(header):
            raise ValueError(f"{path} is not a readable CSV: line {number} has {len(fields)} fields, the header "
                             f"{len(header)}")
    buffer = io.StringIO()
    csv.writer(buffer).writerows(rows)
    buffer.seek(0)
    frame = pd.read_csv(buffer)  # the rows are sound now: let pandas infer the column types
    if len(frame) and not pd.api.types.is_numeric_dtype(frame["step"]):
        raise ValueError(f"{path} has steps that are not numbers; is it a MemGuard {name}?")
    return frame


def plot_run(run: Run, out: str, title: Optional[str] = None) -> str:
    """Writes the PNG and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = run.history[run.history["phase"].isin(PHASES)]
    peak = pd.to_numeric(history["peak_bytes"], errors="coerce")
    capacity = pd.to_numeric(history["capacity_bytes"], errors="coerce").dropna()
    scale, unit = (GiB, "GiB") if max(peak.max(), capacity.max() if len(capacity) else 0) >= 4 * GiB else (MiB, "MiB")

    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    for phase in PHASES:
        rows = history[history["phase"] == phase]
        if rows.empty:
            continue
        color, label = _PHASE_STYLE[phase]
        ax.plot(rows["step"], pd.to_numeric(rows["peak_bytes"]) / scale, color=color, lw=2 if phase != "batch_start"
                else 1.2, label=f"peak in {label}", marker="o" if len(rows) <= 60 else None, ms=3)
    if len(capacity):
        cap = capacity.iloc[-1] / scale
        ax.axhline(cap, color="#222222", lw=1.5, label=f"capacity {cap:.1f} {unit}")
        if run.threshold:
            ax.axhline(cap * run.threshold, color="#d62728", lw=1.2, ls="--",
                       label=f"threshold {run.threshold:.0%}")
    top = max(peak.max(), capacity.max() if len(capacity) else 0) / scale
    ax.set_ylim(0, top * 1.25)  # headroom for the event labels
    used = set()
    labelled = 0
    for row in run.events.itertuples():
        style = _EVENT_STYLE.get(row.action)
        if style is None:
            continue
        color, label = style
        # a rung changes between two steps: draw it there; a rescue happens inside its step
        x = row.step + 0.5 if row.action in ("apply", "revert", "plan") else row.step
        ax.axvline(x, color=color, lw=1.2, ls=":", label=None if row.action in used else label)
        used.add(row.action)
        rung = row.rung if isinstance(getattr(row, "rung", None), str) else ""
        level = int(row.level) if pd.notna(getattr(row, "level", None)) else None
        text = {"apply": f"{rung} -> {level}", "revert": f"{rung} off", "rescue": f"rescue: {rung} -> {level}",
                "rescue_split": f"rescue: {2 ** level if level else 1} parts, that batch",
                "plan": f"plan: {rung} -> {level}" if rung else "plan", "gave_up": "gave up"}[row.action]
        ax.text(x + 0.15, top * (1.2 - 0.07 * (labelled % 4)), text, fontsize=8, color=color, va="top",
                bbox=dict(facecolor="white", edgecolor="none", alpha=0.85, pad=1))
        labelled += 1
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"memory ({unit})")
    device = str(history["device"].iloc[0]) if len(history) else ""
    ax.set_title(title or f"MemGuard: phase peaks per step ({device})")
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9, frameon=False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
