"""lightning-memguard: per-phase memory monitoring and out-of-memory prevention for PyTorch Lightning."""

from lightning_memguard.callback import MemGuardCallback
from lightning_memguard.estimate import MemoryEstimate, estimate_memory
from lightning_memguard.keys import METRIC_KEYS
from lightning_memguard.plan import Plan, plan_configuration
from lightning_memguard.rescue import MemGuardOutOfMemoryError
from lightning_memguard.snapshot import PHASES, Event, MemorySnapshot, format_bytes, parse_bytes
from lightning_memguard.sources import CpuTensorAccountant, CudaAllocatorSource, NvmlSampler
from lightning_memguard.tensor_diff import TensorDiff

__all__ = [
    "MemGuardCallback",
    "MemGuardOutOfMemoryError",
    "MemoryEstimate",
    "Plan",
    "TensorDiff",
    "estimate_memory",
    "plan_configuration",
    "METRIC_KEYS",
    "PHASES",
    "Event",
    "MemorySnapshot",
    "format_bytes",
    "parse_bytes",
    "CpuTensorAccountant",
    "CudaAllocatorSource",
    "NvmlSampler",
]
__version__ = "0.1.0"
