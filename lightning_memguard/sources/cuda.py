"""The CUDA caching allocator, read once per boundary, and its settings."""

from __future__ import annotations

import os
from typing import Optional

import torch

from .base import AllocatorReading


def allocator_settings() -> str:
    """The caching allocator's settings as PyTorch holds them (``"expandable_segments:True,..."``), else the
    environment variables it reads them from; ``""`` when none are set."""
    get_settings = getattr(torch._C, "_accelerator_getAllocatorSettings", None)  # torch >= 2.9; private
    if get_settings is not None:
        try:
            return str(get_settings())
        except Exception:  # a private call must never be why a report is not written
            pass
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""


def expandable_segments_on(settings: Optional[str] = None) -> bool:
    """Whether the allocator grows its segments in place (``expandable_segments:True``), which keeps free memory
    from being stranded between live blocks. ``settings``: as :func:`allocator_settings` returns them."""
    settings = allocator_settings() if settings is None else settings
    for item in settings.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


class CudaAllocatorSource:
    """Reads the allocator's statistics once per boundary and resets the peak so each phase gets its own.

    ``memory_allocated``/``max_memory_allocated``/``memory_reserved`` each build the whole stats dict; reading the
    dict once gives all of them for the price of one host-side call (no device synchronisation).

    Args:
        device: a CUDA device (``torch.device("cuda:0")`` or an index).
        budget_bytes: if given, the capacity to guard instead of the device's total memory.
    """

    def __init__(self, device: torch.device | int | str = 0, budget_bytes: Optional[int] = None) -> None:
        self._device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if self._device.type != "cuda":
            raise ValueError(f"device={device!r} is not a CUDA device")
        if self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.device = str(self._device)
        self._budget_bytes = budget_bytes

    def start(self) -> None:
        torch.cuda.reset_peak_memory_stats(self._device)

    def stop(self) -> None:
        pass

    def read(self, reset_peak: bool = True) -> AllocatorReading:
        # the nested dict as the allocator returns it: torch.cuda.memory_stats() would flatten and sort its few
        # hundred entries in Python first, several times the cost of the read itself
        stats = torch.cuda.memory_stats_as_nested_dict(self._device)
        allocated = stats.get("allocated_bytes", {}).get("all", {})
        reserved = stats.get("reserved_bytes", {}).get("all", {})
        reading = AllocatorReading(
            allocated_bytes=allocated.get("current", 0),
            peak_bytes=allocated.get("peak", 0),
            reserved_bytes=reserved.get("current", 0),
            alloc_retries=stats.get("num_alloc_retries", 0),
            num_ooms=stats.get("num_ooms", 0),
            inactive_split_bytes=stats.get("inactive_split_bytes", {}).get("all", {}).get("current", 0),
        )
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(self._device)
        return reading

    def capacity_bytes(self) -> Optional[int]:
        """The budget if one was given, else total memory times the per-process fraction if one is set."""
        if self._budget_bytes is not None:
            return self._budget_bytes
        total = torch.cuda.get_device_properties(self._device).total_memory
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.7
        fraction = get_fraction(self._device) if get_fraction is not None else 1.0
        return int(total * fraction)
