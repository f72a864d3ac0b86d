"""Fragmentation found and explained: an out-of-memory error, or allocator retries, while the CUDA allocator's cache
held enough free memory for the request — free, but in pieces no request of that size fits. Numbers in (the
error's text, the allocator's readings), a diagnosis with its text and numbers out; no device calls here."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Optional

from ..base.snapshot import GiB, MemorySnapshot, MiB, format_bytes

__all__ = ["Fragmentation", "FragmentationWatch", "requested_bytes", "reserved_free_in", "diagnose_oom",
           "diagnose_retries", "RETRY_FREE_SHARE"]

#: Allocator retries count as fragmentation when the cache held at least this share of the capacity free: a retry
#: with a nearly empty cache is a device that is simply full.
RETRY_FREE_SHARE = 0.05

# sizes as PyTorch's allocator writes them in its messages ("20.00 MiB", "512 bytes")
_SIZE = r"(\d+(?:\.\d+)?)\s*(bytes|B|KiB|MiB|GiB|TiB)"
_SCALE = {"bytes": 1, "B": 1, "KiB": 1024, "MiB": MiB, "GiB": GiB, "TiB": 1024 * GiB}
_REQUESTED = re.compile(r"Tried to allocate " + _SIZE)
_UNALLOCATED = re.compile(_SIZE + r" is reserved by PyTorch but unallocated")
# the message of torch < 2.1: "(... 14.21 GiB already allocated; ... 14.50 GiB reserved in total by PyTorch)"
_OLD_ALLOCATED = re.compile(_SIZE + r" already allocated")
_OLD_RESERVED = re.compile(_SIZE + r" reserved in total by PyTorch")


def _size(match: Optional[re.Match]) -> Optional[int]:
    return int(float(match.group(1)) * _SCALE[match.group(2)]) if match is not None else None


def requested_bytes(error: str) -> Optional[int]:
    """The failed request of a CUDA out-of-memory message (``"Tried to allocate 2.00 GiB"``), else ``None``."""
    return _size(_REQUESTED.search(error))


def reserved_free_in(error: str) -> Optional[int]:
    """Reserved but unallocated bytes at the moment of the failure, as the CUDA message states them, else ``None``.
    Read from the message because the cache is emptied before MemGuard can look at it again."""
    unallocated = _size(_UNALLOCATED.search(error))
    if unallocated is not None:
        return unallocated
    allocated, reserved = _size(_OLD_ALLOCATED.search(error)), _size(_OLD_RESERVED.search(error))
    return max(reserved - allocated, 0) if allocated is not None and reserved is not None else None


@dataclass(frozen=True)
class Fragmentation:
    """A diagnosis: the cache held ``reserved_free_bytes`` free when a request failed (``kind="oom"``, the request
    ``requested_bytes``) or the allocator had to flush its cache ``new_retries`` times (``kind="retries"``)."""

    kind: str
    step: int
    reserved_free_bytes: int
    inactive_split_bytes: Optional[int]
    expandable_segments: bool
    requested_bytes: Optional[int] = None
    new_retries: Optional[int] = None

    @property
    def text(self) -> str:
        """What happened, with the numbers, and what helps."""
        split = (f", {format_bytes(self.inactive_split_bytes)} of it in blocks split off segments still in use"
                 if self.inactive_split_bytes else "")
        held = f"{format_bytes(self.reserved_free_bytes)} reserved but unallocated{split}"
        if self.kind == "oom":
            what = (f"fragmentation: a request of {format_bytes(self.requested_bytes)} ran out of memory while the "
                    f"allocator's cache held {held}; the free memory is in pieces too small for the request")
        else:
            what = (f"fragmentation: the allocator had to flush its cache and retry {self.new_retries} time(s) in "
                    f"step {self.step} while it held {held}; its free memory is in pieces too small for the "
                    f"requests")
        return f"{what}. {self.advice}."

    @property
    def advice(self) -> str:
        split = ("max_split_size_mb (in the same variable) keeps blocks above that size whole"
                 + (f", e.g. max_split_size_mb:{self._split_size_mb}" if self._split_size_mb else ""))
        if self.expandable_segments:
            return ("expandable_segments is already on in this run's allocator settings, so segments already "
                    f"grow in place; what may still help: {split}, or a lower peak (the ladder's rungs)")
        return ("What helps: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True set before CUDA starts (in the "
                "shell, or in os.environ before the first CUDA call), so segments grow in place instead of leaving "
                "free memory stranded between live blocks; it does not work with CUDA IPC (DataLoader workers or "
                f"torch.multiprocessing sharing CUDA tensors). Otherwise {split}")

    @property
    def _split_size_mb(self) -> Optional[int]:
        # blocks at least this large are never split, so a free one stays whole for a request of the failed size;
        # PyTorch does not take values of 20 MiB or less
        if self.requested_bytes is None or self.requested_bytes < 32 * MiB:
            return None
        return 1 << (int(self.requested_bytes // MiB).bit_length() - 1)

    def numbers(self) -> dict:
        """The diagnosis as plain values (bytes), for the report's dict."""
        return {"kind": self.kind, "step": self.step, "requested_bytes": self.requested_bytes,
                "reserved_free_bytes": self.reserved_free_bytes, "inactive_split_bytes": self.inactive_split_bytes,
                "new_retries": self.new_retries, "expandable_segments": self.expandable_segments}


def diagnose_oom(step: int, error: str, reserved_free_bytes: Optional[int], inactive_split_bytes: Optional[int],
                 expandable_segments: bool) -> Optional[Fragmentation]:
    """Fragmentation when the error names its request and the cache held at least that much free (the message's
    own figure first, else ``reserved_free_bytes`` read after the failure); ``None`` otherwise, and always where
    there is no cache (CPU)."""
    requested = requested_bytes(error)
    free = reserved_free_in(error)
    free = free if free is not None else reserved_free_bytes
    if requested is None or free is None or free < requested:
        return None
    return Fragmentation("oom", step, free, inactive_split_bytes, expandable_segments, requested_bytes=requested)


def diagnose_retries(step: int, new_retries: int, reserved_free_bytes: Optional[int],
                     inactive_split_bytes: Optional[int], capacity_bytes: Optional[int],
                     expandable_segments: bool) -> Optional[Fragmentation]:
    """Fragmentation when the allocator retried ``new_retries`` times while its cache held at least
    :data:`RETRY_FREE_SHARE` of the capacity free (the request's size is not known here); else ``None``."""
    if new_retries <= 0 or not reserved_free_bytes:
        return None
    if capacity_bytes is not None and reserved_free_bytes < RETRY_FREE_SHARE * capacity_bytes:
        return None
    return Fragmentation("retries", step, reserved_free_bytes, inactive_split_bytes, expandable_segments,
                         new_retries=new_retries)


class FragmentationWatch:
    """Follows one fit's allocator readings: a rise of the retry count is compared with what the cache held at the
    boundary before it, and each kind of diagnosis is returned once per fit.

    Args:
        expandable_segments: tells whether the run's allocator has ``expandable_segments`` on; asked only when
            there is something to say.
    """

    def __init__(self, expandable_segments: Callable[[], bool]) -> None:
        self.expandable_segments = expandable_segments
        self._previous: Optional[MemorySnapshot] = None
        self._said: set[str] = set()

    def begin(self) -> None:
        """A new fit: nothing said yet."""
        self._previous, self._said = None, set()

    def after_step(self, snapshots: list[MemorySnapshot]) -> Optional[Fragmentation]:
        """The step's snapshots: a diagnosis the first time the retries rose with the cache holding free memory."""
        found = None
        for snap in snapshots:
            before, self._previous = self._previous, snap
            if found is not None or "retries" in self._said or before is None:
                continue
            if snap.alloc_retries is None or before.alloc_retries is None or snap.alloc_retries <= before.alloc_retries:
                continue
            # what the cache held before the flush that the retry made (the boundary before), or at the rise
            held = max((s for s in (before, snap) if s.reserved_free_bytes is not None),
                       key=lambda s: s.reserved_free_bytes, default=None)
            if held is None:
                continue
            found = diagnose_retries(snap.step, snap.alloc_retries - before.alloc_retries, held.reserved_free_bytes,
                                     held.inactive_split_bytes, snap.capacity_bytes, self.expandable_segments())
        if found is not None:
            self._said.add("retries")
        return found

    def at_oom(self, step: int, error: str, reserved_free_bytes: Optional[int],
               inactive_split_bytes: Optional[int]) -> tuple[Optional[Fragmentation], bool]:
        """``(the diagnosis of this OOM or None, whether it is the first of the fit: the one to record)``."""
        found = diagnose_oom(step, error, reserved_free_bytes, inactive_split_bytes, False)
        if found is None:
            return None, False
        found = dataclasses.replace(found, expandable_segments=self.expandable_segments())  # asked only now
        first = "oom" not in self._said
        if first:
            self._said.add("oom")
        return found, first
