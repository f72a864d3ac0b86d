"""A split step's last micro-batch, made to reach every parameter the step trains, for DistributedDataParallel.

Under DDP only the last micro-batch's backward all-reduces (the others run under ``no_sync``), and without
``find_unused_parameters`` DDP waits in that backward for a gradient of every parameter. A parameter the whole batch
reaches but the last part does not — a task's head chosen per sample, a tower only some samples use — never reports
ready: the rank raises at its next forward, or, where another rank's last part did reach it, the ranks wait for each
other forever. Plain DDP on the same batches trains. So before the last part's backward, each parameter that already
holds a gradient from this step's earlier parts and that the part's graph does not reach gets a zero-valued term in
the loss: its gradient is unchanged (zero is added, without allocating: the sum's backward expands a scalar), and its
hook fires, once, as DDP expects.

What the graph reaches is found as DDP does itself with ``find_unused_parameters``: from the loss through every
node's inputs to the parameters' gradient accumulators. A reentrant checkpoint hides the parameters inside it (its
backward runs a second graph), and a term for one of them would have DDP see it ready twice: there the loss is left
as it is.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

__all__ = ["waits_for_every_parameter", "reached_parameters", "reaching_every_parameter"]

#: the backward node of ``torch.utils.checkpoint``'s reentrant variant: the parameters it uses are not its inputs
_HIDING_NODES = frozenset({"CheckpointFunctionBackward"})


def waits_for_every_parameter(module: Optional[nn.Module]) -> bool:
    """Whether ``module`` is a DistributedDataParallel module that expects every parameter's gradient in each
    backward that all-reduces (no ``find_unused_parameters``)."""
    return isinstance(module, nn.parallel.DistributedDataParallel) and not module.find_unused_parameters


def reached_parameters(loss: torch.Tensor) -> Optional[set[int]]:
    """The ids of the tensors whose gradient the backward of ``loss`` accumulates; ``None`` where its graph holds a
    node that hides what it reaches (a reentrant checkpoint)."""
    reached: set[int] = set()
    seen: set = set()  # the nodes themselves, not their ids: a node's Python object may be made anew on each visit
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # a gradient accumulator: a leaf's end of the graph
        if variable is not None:
            reached.add(id(variable))
            continue
        if type(node).__name__ in _HIDING_NODES:
            return None
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached


def reaching_every_parameter(loss: torch.Tensor, parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """``loss`` plus a zero for each of ``parameters`` that holds a gradient and that ``loss``'s graph does not reach
    (see the module's docstring); ``loss`` itself where it misses none, or where what it reaches cannot be told."""
    if loss.grad_fn is None:
        return loss
    missed = [p for p in parameters if p.requires_grad and p.grad is not None and p.is_floating_point()]
    if not missed:
        return loss
    reached = reached_parameters(loss)
    if reached is None:
        return loss
    missed = [p for p in missed if id(p) not in reached]
    for param in missed:
        # summed and zeroed in float32: a half-precision sum of a large parameter may overflow to inf (inf * 0 is nan)
        loss = loss + (param.sum(dtype=torch.float32) * 0.0).to(loss.dtype)
    return loss
