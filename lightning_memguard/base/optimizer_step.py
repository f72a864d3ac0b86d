"""Optimizers whose ``step`` re-evaluates the loss (framework-free)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["step_needs_closure"]


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
