"""The pre-flight estimate: what a training step will need (parameters, gradients, optimizer state, activations) and
the cheapest configuration that fits a capacity, for the CPU or the CUDA kernels, without running the model."""

from .memory import EstimateFallbackWarning, MemoryEstimate, estimate_memory
from .plan import Plan, plan_configuration

__all__ = ["EstimateFallbackWarning", "MemoryEstimate", "Plan", "estimate_memory", "plan_configuration"]
