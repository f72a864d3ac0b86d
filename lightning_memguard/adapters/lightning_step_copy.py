"""The training step the first batch's estimates run for a LightningModule under automatic optimization.

The estimates run the step on a copy of the module, and Lightning copies a module without its Trainer (its state
drops the reference). A step that gathers across the ranks with ``self.all_gather`` — a contrastive loss taking its
negatives from every rank's batch — asks the Trainer's strategy, so on the copy it failed and the run had no plan:
its first steps, the likeliest to run out of memory, ran unpredicted. On the copy, ``all_gather`` is a stand-in that
communicates nothing: each tensor repeated once per rank, the shape and bytes of what Lightning's gather returns
(``(world_size, *shape)``, or the tensor itself without a process group), with a backward to every input as
``sync_grads=True`` has. Its values are this rank's repeated, which is all an estimate of memory needs. It counts as
the collective it stands for (:func:`~lightning_memguard.adapters.own_collectives.count_stand_in`), so a recovery
knows before the first step that the step issues one of its own."""

from __future__ import annotations

from numbers import Number
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..base.batches import map_tensors
from ..estimate.losses import default_loss
from .own_collectives import count_stand_in

__all__ = ["training_step_of_copy"]


def training_step_of_copy(model: nn.Module, batch: Any) -> Any:
    """``(model, batch) -> loss``: the module's ``training_step(batch, 0)``, as the estimate runs it by default, with
    ``all_gather`` stood in for where ``model`` is a copy without its Trainer."""
    if getattr(model, "_trainer", None) is not None or not callable(getattr(model, "all_gather", None)):
        return default_loss(model, batch)
    model.all_gather = _gathered_here  # on the instance, for this call
    try:
        return default_loss(model, batch)
    finally:
        del model.all_gather


def _gathered_here(data: Any, group: Optional[Any] = None, sync_grads: bool = False) -> Any:
    """What ``LightningModule.all_gather(data, group, sync_grads)`` returns, in shape and bytes, made on this rank."""
    if isinstance(data, Number):  # Lightning gathers a number as a tensor
        data = torch.tensor(data)
    if not (dist.is_available() and dist.is_initialized()):
        return data  # Lightning's gather without a process group: the data as it is
    world_size = dist.get_world_size(group)
    count_stand_in()

    def repeated(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.unsqueeze(0).expand(world_size, *tensor.shape).clone()

    return map_tensors(repeated, data)
