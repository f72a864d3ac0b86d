"""The logged metric keys with their meanings, and the TensorBoard layout that groups them. Units are in the key.

:data:`KEY_TABLE` is the one list of what MemGuard logs; :data:`METRIC_KEYS` spells it out key by key. The README's
table of logged keys is :data:`KEY_TABLE` row for row, and ``MemGuardCallback``'s docstring lists the same keys
(``tests/unit/test_docs.py`` checks both).
"""

from __future__ import annotations

from typing import Iterable, Optional

from .snapshot import EVALUATION_PHASES, PHASES, GiB, MemorySnapshot

PREFIX = "memguard"

#: The rungs whose level is logged under :func:`rung_key` (the ladder's rung names; a test keeps the two equal).
RUNG_NAMES: tuple[str, ...] = ("amp", "checkpointing", "offload", "microbatch")


def phase_key(phase: str, quantity: str) -> str:
    """``phase_key("after_backward", "peak")`` → ``"memguard/after_backward/peak_GiB"``."""
    return f"{PREFIX}/{phase}/{quantity}_GiB"


def rung_key(name: str) -> str:
    """``rung_key("amp")`` → ``"memguard/rung/amp"``: the rung's level, logged at each event."""
    return f"{PREFIX}/rung/{name}"


#: Every logged key as the tables show it, with its meaning: ``<phase>`` stands for each of
#: :data:`~lightning_memguard.base.snapshot.PHASES`, ``<evaluation>`` for each of
#: :data:`~lightning_memguard.base.snapshot.EVALUATION_PHASES`, ``<name>`` for each of :data:`RUNG_NAMES`.
KEY_TABLE: dict[str, str] = {
    phase_key("<phase>", "allocated"): "allocated at the boundary",
    phase_key("<phase>", "peak"): "peak of the phase ending at the boundary; peaks are reset at every boundary, the "
                                  "logged value is the max over the logging interval, so no spike is missed",
    f"{PREFIX}/reserved_GiB": "CUDA caching allocator's reserved memory, the max over the step's boundaries",
    f"{PREFIX}/reserved_free_GiB": "reserved minus allocated: what the allocator caches but no tensor uses, the "
                                   "max over the step's boundaries (CUDA)",
    f"{PREFIX}/inactive_split_GiB": "of that, the free blocks split off segments still partly in use, which a larger "
                                    "request cannot use (fragmentation), the max over the step's boundaries (CUDA)",
    f"{PREFIX}/nvml_used_GiB": "device memory used as NVML / nvidia-smi sees it",
    f"{PREFIX}/nvml_process_GiB": "this process's device memory, where the driver reports it",
    f"{PREFIX}/capacity_GiB": "the capacity guarded: device total, the per-process memory fraction, or budget=",
    f"{PREFIX}/peak_share": "the step's highest phase peak / capacity (also mem% in the progress bar)",
    f"{PREFIX}/alloc_retries": "cumulative allocator retries: the allocator flushed its cache to satisfy a request, "
                               "a near-OOM sign",
    f"{PREFIX}/num_ooms": "cumulative out-of-memory errors",
    phase_key("<evaluation>", "peak"): "peak of one evaluation batch (validation, test, predict; all its parts), "
                                       "logged at every such batch on its own axis: the loop's batches counted "
                                       "from 0 in the run",
    phase_key("<evaluation>", "allocated"): "allocated after that evaluation batch, on the same axis",
    rung_key("<name>"): "a rung's level, logged at each event (amp, offload: 0/1; checkpointing: checkpointed "
                        "blocks; microbatch: L for 2^L micro-batches)",
}


def _spelled_out(pattern: str) -> list[str]:
    if "<phase>" in pattern:
        return [pattern.replace("<phase>", phase) for phase in PHASES]
    if "<evaluation>" in pattern:
        return [pattern.replace("<evaluation>", phase) for phase in EVALUATION_PHASES]
    if "<name>" in pattern:
        return [pattern.replace("<name>", name) for name in RUNG_NAMES]
    return [pattern]


#: Every key MemGuard logs, each with its meaning: :data:`KEY_TABLE` with ``<phase>`` and ``<name>`` spelled out.
METRIC_KEYS: dict[str, str] = {key: meaning for pattern, meaning in KEY_TABLE.items() for key in _spelled_out(pattern)}


def _gib(n: Optional[int]) -> Optional[float]:
    return None if n is None else n / GiB


def _most(values: Iterable[Optional[int]]) -> Optional[int]:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def step_metrics(snapshots: Iterable[MemorySnapshot], interval_peaks: dict[str, int]) -> dict[str, float]:
    """Metrics for one logged step. ``interval_peaks`` (phase → bytes) are the peaks since the last logged step,
    so a spike between two logged steps is not lost. Values a source does not have are left out."""
    snapshots = list(snapshots)
    metrics: dict[str, Optional[float]] = {}
    for snap in snapshots:  # one pass: the phases' keys in the rows' order, then the step's own
        phase = snap.phase
        allocated_key, peak_key = _PHASE_KEYS.get(phase) or _phase_keys(phase)
        metrics[allocated_key] = _gib(snap.allocated_bytes)
        metrics[peak_key] = _gib(interval_peaks.get(phase, snap.peak_bytes))
    if snapshots:
        last = snapshots[-1]
        reserved = [s.reserved_bytes for s in snapshots if s.reserved_bytes is not None]
        metrics[_RESERVED] = _gib(max(reserved)) if reserved else None
        metrics[_RESERVED_FREE] = _gib(_most([s.reserved_free_bytes for s in snapshots]))
        metrics[_INACTIVE_SPLIT] = _gib(_most([s.inactive_split_bytes for s in snapshots]))
        metrics[_NVML_USED] = _gib(last.nvml_used_bytes)
        metrics[_NVML_PROCESS] = _gib(last.nvml_process_bytes)
        metrics[_CAPACITY] = _gib(last.capacity_bytes)
        peaks = [s.peak_bytes for s in snapshots if s.peak_bytes is not None]
        if last.capacity_bytes and peaks:
            metrics[_PEAK_SHARE] = max(peaks) / last.capacity_bytes
        metrics[_RETRIES] = last.alloc_retries
        metrics[_OOMS] = last.num_ooms
    return {key: float(value) for key, value in metrics.items() if value is not None}


# the keys of every logged step, spelled once (with log_every_n_steps=1, step_metrics runs every step)
_RESERVED, _RESERVED_FREE, _INACTIVE_SPLIT = (f"{PREFIX}/reserved_GiB", f"{PREFIX}/reserved_free_GiB",
                                              f"{PREFIX}/inactive_split_GiB")
_NVML_USED, _NVML_PROCESS, _CAPACITY = (f"{PREFIX}/nvml_used_GiB", f"{PREFIX}/nvml_process_GiB",
                                        f"{PREFIX}/capacity_GiB")
_PEAK_SHARE, _RETRIES, _OOMS = f"{PREFIX}/peak_share", f"{PREFIX}/alloc_retries", f"{PREFIX}/num_ooms"
_PHASE_KEYS: dict[str, tuple[str, str]] = {}  # phase -> its allocated and peak keys


def _phase_keys(phase: str) -> tuple[str, str]:
    keys = _PHASE_KEYS[phase] = (phase_key(phase, "allocated"), phase_key(phase, "peak"))
    return keys


def evaluation_metrics(phase: str, snapshot: MemorySnapshot) -> dict[str, float]:
    """Metrics for one evaluation batch (``phase`` one of
    :data:`~lightning_memguard.base.snapshot.EVALUATION_PHASES`); values the source does not have are left out."""
    metrics = {phase_key(phase, "peak"): _gib(snapshot.peak_bytes),
               phase_key(phase, "allocated"): _gib(snapshot.allocated_bytes)}
    return {key: float(value) for key, value in metrics.items() if value is not None}


def tensorboard_layout() -> dict:
    """A custom-scalars layout: every memory curve of the training steps in GiB on one chart, the capacity share and
    retries beside it, and the evaluation batches' peaks on a chart of their own (their axis counts evaluation
    batches, not optimizer steps). Multiline charts match tags by regular expression."""
    evaluation = "|".join(EVALUATION_PHASES)
    return {
        "memguard": {
            "memory (GiB): allocated, phase peaks, reserved, NVML used, capacity": [
                "Multiline", [rf"{PREFIX}/(?!(?:{evaluation})/).*_GiB"]
            ],
            "phase peaks (GiB)": ["Multiline", [rf"{PREFIX}/(?:{'|'.join(PHASES)})/peak_GiB"]],
            "evaluation batch peaks (GiB)": ["Multiline", [rf"{PREFIX}/(?:{evaluation})/peak_GiB"]],
            "peak share of capacity": ["Multiline", [rf"{PREFIX}/peak_share"]],
            "allocator retries and OOMs": ["Multiline", [rf"{PREFIX}/alloc_retries", rf"{PREFIX}/num_ooms"]],
        }
    }
