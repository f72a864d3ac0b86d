"""Plain records shared by every part of the package: phases, memory snapshots and events. No Lightning here."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from dataclasses import dataclass
from typing import NamedTuple, Optional

__all__ = ["PHASES", "EVALUATION_PHASES", "GiB", "MiB", "MemorySnapshot", "Event", "parse_bytes", "format_bytes",
           "format_bytes_apart"]

#: The four boundaries of a training batch, in the order they happen.
PHASES: tuple[str, ...] = ("batch_start", "after_forward", "after_backward", "after_optimizer_step")

#: The loops that run batches without an optimizer step: one history row per batch, with the phase named after its loop.
EVALUATION_PHASES: tuple[str, ...] = ("validation", "test", "predict")

MiB = 1024**2
GiB = 1024**3


class MemorySnapshot(NamedTuple):
    """Memory at one boundary of one optimizer step: one row of the history, its fields in the history's column
    order (immutable, like every row).

    All sizes are integer bytes; ``None`` means the source cannot tell (no CUDA, no NVML, ...).
    ``peak_bytes`` is the peak of the phase that just ended: peaks are reset at every boundary, and with gradient
    accumulation it is the maximum over the micro-batches of the step.

    A named tuple, not a dataclass: four are made on the training thread every step, and a frozen dataclass of these
    fields costs several times as much to build; the tuple is also the row the history keeps and writes as it is.
    """

    step: int
    phase: str
    device: str
    allocated_bytes: Optional[int]
    peak_bytes: Optional[int]
    reserved_bytes: Optional[int] = None
    alloc_retries: Optional[int] = None
    num_ooms: Optional[int] = None
    nvml_used_bytes: Optional[int] = None
    nvml_total_bytes: Optional[int] = None
    nvml_process_bytes: Optional[int] = None
    capacity_bytes: Optional[int] = None
    micro_batches: int = 1
    time: float = 0.0
    inactive_split_bytes: Optional[int] = None  # the allocator's free blocks split off partly used segments

    @property
    def reserved_free_bytes(self) -> Optional[int]:
        """What the allocator caches but no tensor uses (reserved − allocated); ``None`` without a cache."""
        if self.reserved_bytes is None or self.allocated_bytes is None:
            return None
        return max(self.reserved_bytes - self.allocated_bytes, 0)


#: Column order of the history DataFrame and CSV.
SNAPSHOT_COLUMNS: tuple[str, ...] = MemorySnapshot._fields


@dataclass(frozen=True)
class Event:
    """Something MemGuard did or noticed, with the reason and the numbers behind it."""

    step: int
    # e.g. "apply", "keep", "revert", "hold", "exhausted", "cannot_help", "rescue", "threshold", "eval_split"
    action: str
    rung: str
    reason: str
    peak_before_bytes: Optional[int] = None
    peak_after_bytes: Optional[int] = None
    capacity_bytes: Optional[int] = None
    phase: Optional[str] = None
    level: Optional[int] = None  # the rung's level after the action
    time: float = 0.0


EVENT_COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Event))

_UNITS = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": MiB, "gib": GiB, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, name: str = "size") -> int:
    """Turns ``1073741824``, ``2e9``, ``"1.5GiB"`` or ``"800MB"`` into integer bytes (> 0).

    Args:
        value: whole bytes as an int (NumPy's too) or an integral float, or a number with a unit.
        name: the argument's name, for the error message.

    Raises:
        ValueError: naming ``name`` and the value, if it is not a positive, finite size in B, KB, MB, GB, TB, KiB,
            MiB, GiB or TiB.
    """
    what = f"{name}={value!r}"
    how = "give bytes as an int or a string like '1.5GiB' or '800MB'"
    if isinstance(value, bool):
        raise ValueError(f"{what} is not a size; {how}")
    if isinstance(value, numbers.Integral):  # NumPy's too: a budget read off a history frame is an np.int64
        number, unit = int(value), ""
    elif isinstance(value, float):
        number, unit = value, ""
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"{what} is not a whole, finite number of bytes; {how}")
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise ValueError(f"{what} is not a size; {how}")
    if unit not in _UNITS:
        raise ValueError(f"{what} has unknown unit {unit!r}; allowed: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    scaled = number * _UNITS[unit]
    if not math.isfinite(scaled):
        raise ValueError(f"{what} is too large to be a size")
    size = int(scaled)
    if size <= 0:
        raise ValueError(f"{what} must be at least one byte")
    return size


def format_bytes(n: Optional[int], decimals: int = 1) -> str:
    """Human-readable size: ``format_bytes(3 * MiB) == '3.0 MiB'``; ``None`` → ``'n/a'``."""
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.{decimals}f} {unit}"
    return f"{n} B"


def format_bytes_apart(*sizes: Optional[int]) -> list[str]:
    """``sizes`` formatted as :func:`format_bytes` does, with more decimals (up to three) where two different sizes
    would read the same: a text comparing them must not say "1.1 MiB, under 1.1 MiB"."""
    for decimals in (1, 2, 3):
        texts = [format_bytes(size, decimals) for size in sizes]
        if all(texts[i] != texts[j] or sizes[i] == sizes[j]
               for i in range(len(sizes)) for j in range(i + 1, len(sizes))):
            break
    return texts
