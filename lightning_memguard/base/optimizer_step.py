"""How an optimizer's step runs: with a closure it calls again (LBFGS), one parameter at a time or group-wide
(framework-free)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["step_needs_closure", "steps_one_parameter_at_a_time"]


def step_needs_closure(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` must be given a closure (``torch.optim.LBFGS``: its line search runs forward and
    backward again, several times a step); a wrapper's (Fabric's, Lightning's) inner optimizer is asked."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner
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
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner
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
