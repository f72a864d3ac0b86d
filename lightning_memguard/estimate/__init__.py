"""The pre-flight estimate: what a training step will need (parameters, gradients, optimizer state, activations) and
the cheapest configuration that fits a capacity, for the CPU or the CUDA kernels, without running the model."""

from .batch_size import largest_batch
from .memory import EstimateFallbackWarning, MemoryEstimate, estimate_memory
from .plan import Plan, plan_configuration

__all__ = ["EstimateFallbackWarning", "MemoryEstimate", "Plan", "estimate_memory", "largest_batch",
           "plan_configuration"]
