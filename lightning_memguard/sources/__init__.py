"""Where memory numbers come from. Each source reads one kind of memory; none of them imports Lightning."""

from lightning_memguard.sources.base import AllocatorReading, MemorySource
from lightning_memguard.sources.cpu import CpuTensorAccountant
from lightning_memguard.sources.cuda import CudaAllocatorSource
from lightning_memguard.sources.nvml import NvmlReading, NvmlSampler

__all__ = [
    "AllocatorReading",
    "MemorySource",
    "CpuTensorAccountant",
    "CudaAllocatorSource",
    "NvmlReading",
    "NvmlSampler",
]
