"""Per-phase summaries of a history table (framework-free; used by the demo and the report command)."""

from __future__ import annotations

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
