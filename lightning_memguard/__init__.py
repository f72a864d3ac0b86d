"""lightning-memguard: per-phase memory monitoring and out-of-memory prevention for PyTorch Lightning."""

from .callback import MemGuardCallback
from .estimate import MemoryEstimate, estimate_memory
from .keys import METRIC_KEYS
from .plan import Plan, plan_configuration
from .rescue import MemGuardOutOfMemoryError
from .snapshot import PHASES, Event, MemorySnapshot, format_bytes, parse_bytes
from .sources import CpuTensorAccountant, CudaAllocatorSource, NvmlSampler
from .tensor_diff import TensorDiff

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
