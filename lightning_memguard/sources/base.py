"""The contract every allocator-like source keeps."""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol


class AllocatorReading(NamedTuple):
    """One read of an allocator at a boundary. Sizes in bytes; ``None`` where the source has no such counter."""

    allocated_bytes: Optional[int]  # None: not counted (the CPU accountant switched off for compiled code)
    peak_bytes: Optional[int]  # peak since the previous read that reset it
    reserved_bytes: Optional[int] = None
    alloc_retries: Optional[int] = None
    num_ooms: Optional[int] = None
    # free bytes in blocks split off a segment that is partly in use: cached, but no help to a larger request
    inactive_split_bytes: Optional[int] = None


class MemorySource(Protocol):
    """What the engine needs from a source: a device name, a read, a capacity and start/stop."""

    device: str

    def read(self, reset_peak: bool = True) -> AllocatorReading:
        """Current and peak bytes; ``reset_peak`` starts a new peak window from the current value."""
        ...

    def capacity_bytes(self) -> Optional[int]:
        """How much memory this device may use, or ``None`` if unknown (then there is nothing to guard)."""
        ...

    def start(self) -> None: ...

    def stop(self) -> None: ...
