"""lightning-memguard: per-phase memory monitoring and out-of-memory prevention for PyTorch training loops.

Three front doors share one framework-free engine (:mod:`lightning_memguard.guard.engine`):

- :class:`MemGuardCallback` for a Lightning ``Trainer`` (``lightning.pytorch`` or ``pytorch_lightning``),
- :class:`FabricMemGuard` for a Lightning Fabric loop,
- :class:`MemGuard` for a plain PyTorch loop.

:class:`LargestBatchSize` sets a Trainer's batch size to the largest one the estimate says fits (DDP and FSDP2 too).

Package layout, bottom to top (each folder imports only from those below it): ``base`` (records, checks, keys,
batches, prediction numbers), ``sources`` (CUDA allocator, NVML, CPU accounting) and ``mitigations`` (the rungs),
``estimate`` (pre-flight estimate and plan) and ``monitor`` (recorder, history, tensor diff), ``guard`` (settings,
policy, ladder, OOM handling, engine), ``adapters`` (the front doors), ``commands`` (the ``memguard`` command line, the
demo models, plots).

The Lightning front doors and the estimator are imported on first use, so a plain loop never imports Lightning and a
run that only monitors never loads the estimator.
"""

from __future__ import annotations

import importlib
from typing import Any

from .adapters.loop import MemGuard
from .base.checks import MemGuardWarning
from .base.keys import METRIC_KEYS
from .base.snapshot import PHASES, Event, MemorySnapshot, format_bytes, parse_bytes
from .guard.oom import MemGuardOutOfMemoryError
from .guard.settings import GuardSettings
from .mitigations.checkpointing import find_blocks
from .mitigations.rung import Rung
from .monitor.tensor_diff import TensorDiff
from .sources import CpuTensorAccountant, CudaAllocatorSource, NvmlSampler

# imported on first use: the Lightning front doors (a plain loop never imports Lightning) and the estimator (a run that
# only monitors never loads it)
_LAZY = {"MemGuardCallback": ".adapters.lightning_callback", "FabricMemGuard": ".adapters.fabric",
         "LargestBatchSize": ".adapters.lightning_batch_size",
         **dict.fromkeys(["EstimateFallbackWarning", "MemoryEstimate", "Plan", "estimate_memory", "largest_batch",
                          "plan_configuration"],
                         ".estimate")}

__all__ = [
    "MemGuardCallback",
    "FabricMemGuard",
    "MemGuard",
    "LargestBatchSize",
    "GuardSettings",
    "Rung",
    "MemGuardOutOfMemoryError",
    "MemGuardWarning",
    "EstimateFallbackWarning",
    "MemoryEstimate",
    "Plan",
    "TensorDiff",
    "estimate_memory",
    "largest_batch",
    "plan_configuration",
    "find_blocks",
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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
