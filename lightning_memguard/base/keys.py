"""The names of logged metrics and the TensorBoard layout that groups them. Units are in the key."""

from __future__ import annotations

from typing import Iterable, Optional

from .snapshot import PHASES, GiB, MemorySnapshot

PREFIX = "memguard"


def phase_key(phase: str, quantity: str) -> str:
    """``phase_key("after_backward", "peak")`` → ``"memguard/after_backward/peak_GiB"``."""
    return f"{PREFIX}/{phase}/{quantity}_GiB"


#: Every key :func:`step_metrics` can produce, with its meaning (the README table is generated from the same words).
METRIC_KEYS: dict[str, str] = {
    **{phase_key(p, "allocated"): f"bytes allocated at the {p} boundary, GiB" for p in PHASES},
    **{phase_key(p, "peak"): f"peak allocated during the phase ending at {p}, GiB (max over the logging interval)"
       for p in PHASES},
    f"{PREFIX}/reserved_GiB": "allocator reserved memory (CUDA), max over the step's boundaries, GiB",
    f"{PREFIX}/nvml_used_GiB": "device memory used as NVML/nvidia-smi sees it, GiB",
    f"{PREFIX}/nvml_process_GiB": "this process's device memory per NVML, GiB (where the driver reports it)",
    f"{PREFIX}/capacity_GiB": "the capacity guarded: device total, memory fraction or the given budget, GiB",
    f"{PREFIX}/peak_share": "the step's highest phase peak as a share of capacity (0-1)",
    f"{PREFIX}/alloc_retries": "cumulative allocator retries (cache flushed to satisfy an allocation; near-OOM)",
    f"{PREFIX}/num_ooms": "cumulative out-of-memory errors seen by the allocator",
}


def _gib(n: Optional[int]) -> Optional[float]:
    return None if n is None else n / GiB


def step_metrics(snapshots: Iterable[MemorySnapshot], interval_peaks: dict[str, int]) -> dict[str, float]:
    """Metrics for one logged step. ``interval_peaks`` (phase → bytes) are the peaks since the last logged step,
    so a spike between two logged steps is not lost. Values a source does not have are left out."""
    snapshots = list(snapshots)
    metrics: dict[str, Optional[float]] = {}
    for snap in snapshots:
        metrics[phase_key(snap.phase, "allocated")] = _gib(snap.allocated_bytes)
        metrics[phase_key(snap.phase, "peak")] = _gib(interval_peaks.get(snap.phase, snap.peak_bytes))
    if snapshots:
        last = snapshots[-1]
        reserved = [s.reserved_bytes for s in snapshots if s.reserved_bytes is not None]
        metrics[f"{PREFIX}/reserved_GiB"] = _gib(max(reserved)) if reserved else None
        metrics[f"{PREFIX}/nvml_used_GiB"] = _gib(last.nvml_used_bytes)
        metrics[f"{PREFIX}/nvml_process_GiB"] = _gib(last.nvml_process_bytes)
        metrics[f"{PREFIX}/capacity_GiB"] = _gib(last.capacity_bytes)
        peaks = [s.peak_bytes for s in snapshots if s.peak_bytes is not None]
        if last.capacity_bytes and peaks:
            metrics[f"{PREFIX}/peak_share"] = max(peaks) / last.capacity_bytes
        metrics[f"{PREFIX}/alloc_retries"] = last.alloc_retries
        metrics[f"{PREFIX}/num_ooms"] = last.num_ooms
    return {key: float(value) for key, value in metrics.items() if value is not None}


def tensorboard_layout() -> dict:
    """A custom-scalars layout: every memory curve in GiB on one chart, the capacity share and retries beside it.
    Multiline charts match tags by regular expression."""
    return {
        "memguard": {
            "memory (GiB): allocated, phase peaks, reserved, NVML used, capacity": [
                "Multiline", [rf"{PREFIX}/.*_GiB"]
            ],
            "phase peaks (GiB)": ["Multiline", [rf"{PREFIX}/[a-z_]+/peak_GiB"]],
            "peak share of capacity": ["Multiline", [rf"{PREFIX}/peak_share"]],
            "allocator retries and OOMs": ["Multiline", [rf"{PREFIX}/alloc_retries", rf"{PREFIX}/num_ooms"]],
        }
    }
