"""A model of torch's CUDA caching allocator, for the estimate of a CUDA step (framework-free, no torch needed).

``torch.cuda.max_memory_allocated`` is not the sum of what tensors asked for: it counts the *blocks* the caching
allocator hands out, and a block is sometimes larger than the request. :class:`CachingAllocatorModel` replays a
sequence of allocations and frees under the allocator's default policy (one device, one stream, expandable segments
off, no ``PYTORCH_CUDA_ALLOC_CONF`` options that change it: :func:`unmodelled_options` names those) and says how
large each handed-out block is, and the peaks of the allocated and reserved bytes. The rules, as torch's
``CUDACachingAllocator`` applies them:

* a request is rounded up to a multiple of 512 bytes (at least 512; a 0-byte request takes no block);
* requests of at most 1 MiB are served from the *small* pool, whose segments are 2 MiB; larger ones from the *large*
  pool, whose segments are 20 MiB for requests under 10 MiB and the request rounded up to 2 MiB above that;
* a request takes the smallest free cached block of its pool that fits (the lowest address among equal sizes); only
  where none fits is a new segment reserved (segments are never given back here: the cache of a run that did not
  run out of memory);
* the block taken is split, the front handed out and the rest left free, only where the rest is large enough: at
  least 512 bytes in the small pool, more than 1 MiB in the large one. Otherwise the whole block is handed out and
  counted as allocated — the slack between ``max_memory_allocated`` and the bytes requested;
* a freed block merges with the free blocks next to it in its segment.

So the allocated bytes depend on the order of the allocations and frees, and on what the cache holds from the steps
before: feed the model the whole history (the weights, a warm-up step, the measured step) to read a measured step.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Hashable, Mapping, Optional

__all__ = ["CachingAllocatorModel", "unmodelled_options", "ROUNDING", "SMALL_REQUEST", "SMALL_SEGMENT",
           "LARGE_SEGMENT", "LARGE_REQUEST", "LARGE_ROUNDING"]

#: Every request is rounded up to a multiple of this (and a block is at least this large).
ROUNDING = 512
#: Requests up to this size are served from the small pool; a large-pool block is split only where more than this
#: would be left.
SMALL_REQUEST = 2**20
#: The segment reserved for a small request that no cached block fits.
SMALL_SEGMENT = 2 * 2**20
#: The segment reserved for a large request under :data:`LARGE_REQUEST` that no cached block fits.
LARGE_SEGMENT = 20 * 2**20
#: From this size on a request gets a segment of its own size, rounded up to :data:`LARGE_ROUNDING`.
LARGE_REQUEST = 10 * 2**20
LARGE_ROUNDING = 2 * 2**20

#: Allocator options that change nothing this model replays: how the allocator locks, what CUDA graphs reuse, the
#: memory fraction (a cap on the capacity, not a policy), how an OOM is raised; host (pinned) memory's ``pinned_*``.
_NEUTRAL_OPTIONS = ("release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "graph_capture_record_stream_reuse",
                    "per_process_memory_fraction", "throw_on_cudamalloc_oom")
#: Options the model replays at one value only: their defaults.
_DEFAULT_VALUES = {"expandable_segments": "false", "backend": "native"}


def unmodelled_options(options: Mapping[str, str]) -> dict[str, str]:
    """The options of ``options`` (name -> value, PyTorch's allocator settings as
    :func:`~lightning_memguard.sources.cuda.allocator_options` reads them) under which the allocator's policy is not
    the one this model replays: every option but the neutral ones and ``expandable_segments`` / ``backend`` at their
    defaults (``False``, ``native``) — ``expandable_segments:True``, ``max_split_size_mb``,
    ``roundup_power2_divisions``, ``garbage_collection_threshold``, ``backend:cudaMallocAsync``, and any option
    this model does not know."""
    return {name: value for name, value in options.items()
            if not (name in _NEUTRAL_OPTIONS or name.startswith("pinned_")
                    or _DEFAULT_VALUES.get(name) == value.lower())}


@dataclass(eq=False, slots=True)
class _Block:
    """A contiguous range of a segment: handed out (``allocated``) or free in its pool."""

    address: int
    size: int
    small: bool
    allocated: bool = False
    requested: int = 0
    prev: Optional[_Block] = None
    next: Optional[_Block] = None


@dataclass(frozen=True)
class _Resized:
    """The key of a block being given back by :meth:`CachingAllocatorModel.resize`."""

    key: Hashable


class CachingAllocatorModel:
    """Replays allocations and frees under the CUDA caching allocator's policy (see the module's description).

    Each allocation is named by a key of the caller's (a storage's id, say): :meth:`malloc` returns the size of the
    block handed out for it, :meth:`free` gives it back. :attr:`allocated_bytes` and :attr:`reserved_bytes` are the
    running totals (``memory_allocated``, ``memory_reserved``), :attr:`peak_allocated_bytes` and
    :attr:`peak_reserved_bytes` their peaks since :meth:`reset_peaks`.

    Example::

        allocator = CachingAllocatorModel()
        allocator.malloc("a", 19 * 2**20)   # 19 MiB: a 20 MiB segment, whose 1 MiB rest is too small to split off
        allocator.allocated_bytes           # 20971520
    """

    def __init__(self) -> None:
        # per pool (small: True) the free blocks, sorted by (size, address): the best fit is a bisection away
        self._free: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}
        self._held: dict[Hashable, _Block] = {}
        self._next_address = 0
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0

    def malloc(self, key: Hashable, nbytes: int) -> int:
        """Allocates ``nbytes`` for ``key`` (which must hold nothing); returns the size of the block handed out."""
        if key in self._held:
            raise ValueError(f"key {key!r} already holds a block of {self._held[key].size} bytes: free it first")
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        if nbytes == 0:  # torch hands out no block for an empty allocation
            return 0
        size = max(ROUNDING, -(-nbytes // ROUNDING) * ROUNDING)
        small = size <= SMALL_REQUEST
        block = self._best_fit(small, size) or self._new_segment(small, size)
        rest = block.size - size
        if (rest >= ROUNDING) if small else (rest > SMALL_REQUEST):
            remainder = _Block(block.address + size, rest, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = remainder
            block.next = remainder
            block.size = size
            self._insert(remainder)
        block.allocated = True
        block.requested = nbytes
        self._held[key] = block
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        return block.size

    def free(self, key: Hashable) -> int:
        """Gives back ``key``'s block (nothing where it holds none: an empty allocation); returns its size."""
        block = self._held.pop(key, None)
        if block is None:
            return 0
        size = block.size
        self.allocated_bytes -= size
        block.allocated = False
        for neighbour in (block.prev, block.next):  # merge with the free neighbours in the segment
            if neighbour is not None and not neighbour.allocated:
                self._remove(neighbour)
                if neighbour is block.prev:
                    block.address = neighbour.address
                    block.prev = neighbour.prev
                    if block.prev is not None:
                        block.prev.next = block
                else:
                    block.next = neighbour.next
                    if block.next is not None:
                        block.next.prev = block
                block.size += neighbour.size
        self._insert(block)
        return size

    def hold(self, key: Hashable, nbytes: int) -> int:
        """The size of the block ``key`` holds for ``nbytes``: allocated where it holds none, moved by :meth:`resize`
        where it holds one for another size, else the block it holds."""
        block = self._held.get(key)
        if block is None:
            return self.malloc(key, nbytes)
        if block.requested != nbytes:
            return self.resize(key, nbytes)
        return block.size

    def resize(self, key: Hashable, nbytes: int) -> int:
        """Moves ``key`` to a block for ``nbytes``, as a storage's ``resize_`` does on CUDA: the new block is
        allocated before the old one is freed (the data is copied across). Returns the new block's size."""
        old = self._held.pop(key, None)
        try:
            size = self.malloc(key, nbytes)
        finally:
            if old is not None:
                self._held[_Resized(key)] = old
                self.free(_Resized(key))
        return size

    def rename(self, key: Hashable, new_key: Hashable) -> None:
        """Hands ``key``'s block (if any) to ``new_key``, which must hold none."""
        if new_key in self._held:
            raise ValueError(f"key {new_key!r} already holds a block of {self._held[new_key].size} bytes")
        block = self._held.pop(key, None)
        if block is not None:
            self._held[new_key] = block

    def block_size(self, key: Hashable) -> int:
        """The size of the block ``key`` holds (0 where none)."""
        block = self._held.get(key)
        return block.size if block is not None else 0

    def requested_bytes(self, key: Hashable) -> int:
        """What ``key``'s allocation asked for (0 where it holds no block)."""
        block = self._held.get(key)
        return block.requested if block is not None else 0

    def reset_peaks(self) -> None:
        """Starts the peaks again from the current totals (``torch.cuda.reset_peak_memory_stats``)."""
        self.peak_allocated_bytes = self.allocated_bytes
        self.peak_reserved_bytes = self.reserved_bytes

    def _best_fit(self, small: bool, size: int) -> Optional[_Block]:
        blocks = self._free[small]
        index = bisect.bisect_left(blocks, (size, -1))
        if index == len(blocks):
            return None
        return blocks.pop(index)[2]

    def _new_segment(self, small: bool, size: int) -> _Block:
        if small:
            segment = SMALL_SEGMENT
        elif size < LARGE_REQUEST:
            segment = LARGE_SEGMENT
        else:
            segment = -(-size // LARGE_ROUNDING) * LARGE_ROUNDING
        # segments at increasing addresses, never adjacent: blocks merge within a segment only
        block = _Block(self._next_address, segment, small)
        self._next_address += segment + LARGE_ROUNDING
        self.reserved_bytes += segment
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return block

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.address, block))

    def _remove(self, block: _Block) -> None:
        blocks = self._free[block.small]
        index = bisect.bisect_left(blocks, (block.size, block.address))
        del blocks[index]
