"""How an optimizer's step runs: with a closure it calls again (LBFGS), one parameter at a time or group-wide, and
which optimizer holds the state (framework-free)."""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

__all__ = ["is_zero_redundancy", "state_holder", "step_needs_closure", "steps_one_parameter_at_a_time",
           "zero_redundancy_ranks"]


def state_holder(optimizer: Any) -> Any:
    """The optimizer that keeps the per-parameter state and runs the update: a wrapper's (Fabric's, Lightning's) inner
    optimizer; for torch's ``ZeroRedundancyOptimizer`` the local one (``optim``) that owns this rank's partition of
    the parameters — the wrapper's own ``state`` stays empty and its groups carry only what it was given (its
    ``optim`` is missing until DDP's first step where it overlaps with DDP: then the wrapper)."""
    optimizer = _unwrapped(optimizer)
    local = getattr(optimizer, "optim", None) if is_zero_redundancy(optimizer) else None
    return local if isinstance(local, torch.optim.Optimizer) else optimizer


def is_zero_redundancy(optimizer: Any) -> bool:
    """Whether ``optimizer`` is torch's ``ZeroRedundancyOptimizer`` (or a subclass)."""
    # by name and module, not isinstance: torch.distributed.optim is not importable where distributed is not built
    kind = type(optimizer)
    return any(k.__name__ == "ZeroRedundancyOptimizer" and k.__module__.startswith("torch.distributed")
               for k in kind.__mro__)


def zero_redundancy_ranks(optimizers: Any) -> Optional[int]:
    """The ranks a ``ZeroRedundancyOptimizer`` among ``optimizers`` (one, or several; a Lightning or Fabric
    wrapper's inner one too) shards its optimizer state over; ``None`` where none does."""
    for optimizer in optimizers if isinstance(optimizers, (list, tuple)) else (optimizers,):
        optimizer = _unwrapped(optimizer)
        if is_zero_redundancy(optimizer):
            return getattr(optimizer, "world_size", None)
    return None


def _unwrapped(optimizer: Any) -> Any:
    """A wrapper's (Fabric's, Lightning's) inner optimizer; any other optimizer as it is."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def step_needs_closure(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` must be given a closure (``torch.optim.LBFGS``: its line search runs forward and
    backward again, several times a step); a wrapper's (Fabric's, Lightning's) inner optimizer is asked."""
    optimizer = state_holder(optimizer)
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (AttributeError, TypeError, ValueError):  # no step, or one whose signature Python cannot read
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def steps_one_parameter_at_a_time(optimizer: Any) -> bool:
    """Whether ``foreach=False`` would change nothing in ``optimizer``'s step: every group runs one parameter at a
    time already (``foreach=False``, or torch's default where that is no foreach: CPU tensors), runs fused kernels
    (``fused=True``: no temporaries of a whole group), or has no such choice (LBFGS, SparseAdam, transformers'
    Adafactor)."""
    optimizer = state_holder(optimizer)
    for group in getattr(optimizer, "param_groups", []):
        if "foreach" not in group or group.get("fused") or group["foreach"] is False:
            continue
        if group["foreach"] or _foreach_by_default(group):
            return False
    return True


def _foreach_by_default(group: dict) -> bool:
    """What torch picks for a group that leaves ``foreach`` to it (foreach where all its tensors are on CUDA)."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # another torch: assume the group-wide kernels, as on a GPU
        return True
    params = [p for p in group["params"] if isinstance(p, torch.Tensor)]
    return bool(_default_to_fused_or_foreach(params, bool(group.get("differentiable", False)))[1])
