"""Where memory numbers come from. Each source reads one kind of memory; none of them imports Lightning."""

from .base import AllocatorReading, MemorySource
from .cpu import CpuTensorAccountant
from .cuda import CudaAllocatorSource
from .nvml import NvmlReading, NvmlSampler

__all__ = [
    "AllocatorReading",
    "MemorySource",
    "CpuTensorAccountant",
    "CudaAllocatorSource",
    "NvmlReading",
    "NvmlSampler",
]
