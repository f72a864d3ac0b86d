"""Per-phase summaries of a history table (framework-free; used by the demo and the report command)."""

from __future__ import annotations

import math
import re
import textwrap

import pandas as pd

from ..base.snapshot import PHASES, MiB


def phase_summary(history: pd.DataFrame) -> pd.DataFrame:
    """One row per phase: the max and p95 of the phase peak, mean allocated (MiB) and the max share of capacity."""
    if history.empty:
        return pd.DataFrame(columns=["phase", "peak_max_MiB", "peak_p95_MiB", "allocated_mean_MiB", "capacity_share"])
    rows = []
    for phase in [p for p in PHASES if p in set(history["phase"])]:
        part = history[history["phase"] == phase]
        peak = pd.to_numeric(part["peak_bytes"], errors="coerce")
        capacity = pd.to_numeric(part["capacity_bytes"], errors="coerce")
        share = (peak / capacity).max() if capacity.notna().any() else float("nan")
        rows.append({
            "phase": phase,
            "peak_max_MiB": peak.max() / MiB,
            "peak_p95_MiB": peak.quantile(0.95) / MiB,
            "allocated_mean_MiB": pd.to_numeric(part["allocated_bytes"], errors="coerce").mean() / MiB,
            "capacity_share": share,
        })
    return pd.DataFrame(rows)


def format_table(frame: pd.DataFrame, float_format: str = "{:.1f}") -> str:
    """A plain-text table, for terminals and logs."""
    if frame.empty:
        return "(no rows)"
    return frame.to_string(index=False, float_format=float_format.format)


def format_events(events: pd.DataFrame, width: int = 100) -> str:
    """The events for a terminal: a line per decision (step, action, the rungs and their levels) and its reason
    wrapped under it, indented. One decision that moved several rungs at once (a speed trial, a joint rescue) is
    written as several events with one reason: said once, the rungs together. A wide table would right-align the
    reasons, hundreds of characters each, into lines no terminal shows whole."""
    if events.empty:
        return "(no events)"
    lines, last = [], None
    for row in events.itertuples(index=False):
        rung, level = _text(getattr(row, "rung", "")), _level_text(getattr(row, "level", None))
        key = (row.step, row.action, _text(row.reason))
        if key == last and rung:
            lines[-2] += f", {rung}{level}"
            continue
        last = key
        lines.append(f"step {row.step}  {row.action}" + (f"  {rung}{level}" if rung else ""))
        # a figure and its unit stay on one line (a no-break space, which textwrap does not split at)
        reason = _FIGURE.sub("\\1\u00a0\\2", key[2])
        lines.append(textwrap.fill(reason, width, initial_indent="    ", subsequent_indent="    ").replace(
            "\u00a0", " ") or "    -")
    return "\n".join(lines)


_FIGURE = re.compile(r"(\d) (B|KiB|MiB|GiB|TiB|ms|s|blocks)\b")


def _text(value) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def _level_text(level) -> str:
    number = pd.to_numeric(level, errors="coerce")
    return "" if pd.isna(number) else f" {int(number)}"
