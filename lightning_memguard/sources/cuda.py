"""The CUDA caching allocator, read once per boundary, and its settings."""

from __future__ import annotations

import os
from typing import Optional

import torch

from .base import AllocatorReading

_EMPTY: dict = {}  # what a missing statistic reads as (never written to)
_new_reading = tuple.__new__


#: The environment variables PyTorch's CUDA caching allocator reads its options from: the first is the older name, the
#: second the newer, device-generic one (which of them wins where both are set has changed between versions).
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def allocator_options(settings: str) -> dict[str, str]:
    """``settings`` (``"expandable_segments:True,roundup_power2_divisions:[256:1,>:4]"``) as option -> value, split
    as PyTorch splits them: at the commas outside square brackets (a list value keeps its brackets and commas), each
    at its first colon, names and values stripped (a later option of the same name replaces an earlier one)."""
    options: dict[str, str] = {}
    depth, start = 0, 0
    for i, char in enumerate(settings + ","):
        if char == "[":
            depth += 1
        elif char == "]":
            depth = max(depth - 1, 0)
        elif char == "," and not depth:
            name, _, value = settings[start:i].partition(":")
            start = i + 1
            if name.strip():
                options[name.strip()] = value.strip()
    return options


def configured_allocator_options() -> list[dict[str, str]]:
    """The caching allocator's options as this process holds them (:func:`allocator_settings`) and as each of
    :data:`ALLOC_CONF_VARIABLES` sets them now, read at each call: an estimate made here may be for a run launched
    with these variables. One mapping per source, the empty ones left out."""
    sources = [allocator_settings(), *(os.environ.get(name, "") for name in ALLOC_CONF_VARIABLES)]
    return [options for options in map(allocator_options, sources) if options]


def allocator_settings() -> str:
    """The caching allocator's settings as PyTorch holds them (``"expandable_segments:True,..."``), else the
    environment variables it reads them from; ``""`` when none are set."""
    get_settings = getattr(torch._C, "_accelerator_getAllocatorSettings", None)  # torch >= 2.9; private
    if get_settings is not None:
        try:
            return str(get_settings())
        except Exception:  # a private call must never be why a report is not written
            pass
    return next((os.environ[name] for name in ALLOC_CONF_VARIABLES if os.environ.get(name)), "")


def expandable_segments_on(settings: Optional[str] = None) -> bool:
    """Whether the allocator grows its segments in place (``expandable_segments:True``), which keeps free memory
    from being stranded between live blocks. ``settings``: as :func:`allocator_settings` returns them."""
    settings = allocator_settings() if settings is None else settings
    return allocator_options(settings).get("expandable_segments", "").lower() == "true"


class CudaAllocatorSource:
    """Reads the allocator's statistics once per boundary and resets the peak so each phase gets its own.

    ``memory_allocated``/``max_memory_allocated``/``memory_reserved`` each build the whole stats dict; reading the
    dict once gives all of them for the price of one host-side call (no device synchronisation). The two calls into
    the allocator are :meth:`allocator_stats` and :meth:`reset_peak`: a subclass that answers them with fixed
    numbers measures everything else on a machine without CUDA (benchmarks/overhead.py does).

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
        self._index: int = self._device.index  # an index, not a device: torch resolves it with no parsing
        self._budget_bytes = budget_bytes
        self._total_bytes: Optional[int] = None

    def start(self) -> None:
        self.reset_peak()

    def stop(self) -> None:
        pass

    def allocator_stats(self) -> dict:
        """The allocator's statistics as it returns them, nested (``{"allocated_bytes": {"all": {"current": ...}}}``):
        ``torch.cuda.memory_stats()`` would flatten and sort its few hundred entries in Python first, several times the
        cost of the read itself. No device synchronisation."""
        return torch.cuda.memory_stats_as_nested_dict(self._index)

    def reset_peak(self) -> None:
        """Starts a new peak window from the current value."""
        torch.cuda.reset_peak_memory_stats(self._index)

    def read(self, reset_peak: bool = True) -> AllocatorReading:
        stats = self.allocator_stats()  # once per boundary: every field below comes from this one call
        try:  # every statistic there, as the allocator gives them: straight into the reading's tuple
            allocated = stats["allocated_bytes"]["all"]
            reading = _new_reading(AllocatorReading, (
                allocated["current"], allocated["peak"], stats["reserved_bytes"]["all"]["current"],
                stats["num_alloc_retries"], stats["num_ooms"], stats["inactive_split_bytes"]["all"]["current"]))
        except KeyError:  # a statistic missing (an older or another allocator) reads as 0
            allocated = stats.get("allocated_bytes", _EMPTY).get("all", _EMPTY)
            reading = AllocatorReading(
                allocated.get("current", 0),
                allocated.get("peak", 0),
                stats.get("reserved_bytes", _EMPTY).get("all", _EMPTY).get("current", 0),
                stats.get("num_alloc_retries", 0),
                stats.get("num_ooms", 0),
                stats.get("inactive_split_bytes", _EMPTY).get("all", _EMPTY).get("current", 0),
            )
        if reset_peak:
            self.reset_peak()
        return reading

    def capacity_bytes(self) -> Optional[int]:
        """The budget if one was given, else total memory times the per-process fraction if one is set (read at
        every call: it may be set after the run started; the total is read once)."""
        if self._budget_bytes is not None:
            return self._budget_bytes
        if self._total_bytes is None:
            self._total_bytes = torch.cuda.get_device_properties(self._device).total_memory
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.7
        fraction = get_fraction(self._index) if get_fraction is not None else 1.0
        return int(self._total_bytes * fraction)
