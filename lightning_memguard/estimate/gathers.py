"""A training step's ``self.all_gather`` on the estimate's copy of a module (framework-free).

The estimate runs the step on a copy of the module, and Lightning copies a module without its Trainer (its state
drops the reference). A step that gathers across the ranks with ``self.all_gather`` — a contrastive loss taking its
negatives from every rank's batch — asks the Trainer's strategy, so on the copy it failed and nothing could be
estimated: not before training, nor the first batch's plan. On the copy, ``all_gather`` is a stand-in that
communicates nothing: each tensor repeated once per rank, the shape and bytes of what Lightning's gather returns
(``(world_size, *shape)``, or the data itself with one process), made as Lightning makes it (one tensor a rank,
then stacked), with a backward to every input where ``sync_grads=True`` asks for one. Its values are this rank's
repeated, which is all an estimate of memory needs."""

from __future__ import annotations

import contextlib
from numbers import Number
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..base.batches import map_tensors
from .losses import default_loss

__all__ = ["TrainingStep", "step_loss_with_gathers_stood_in"]


class TrainingStep:
    """``(model, batch) -> loss``: the model's own step, as the estimate runs it by default
    (:func:`step_loss_with_gathers_stood_in` with ``world_size`` and ``on_gather``). The estimate tells it from a loss
    function of the caller's: a LightningModule that optimizes itself runs its step with its optimizers stood in for
    (manual_step.py) only where the step is its own."""

    def __init__(self, world_size: Optional[int] = None, on_gather: Optional[Callable[[], None]] = None) -> None:
        self.world_size, self.on_gather = world_size, on_gather

    def __call__(self, model: nn.Module, batch: Any) -> Any:
        return step_loss_with_gathers_stood_in(model, batch, self.world_size, self.on_gather)


def step_loss_with_gathers_stood_in(model: nn.Module, batch: Any, world_size: Optional[int] = None,
                                    on_gather: Optional[Callable[[], None]] = None) -> Any:
    """:func:`~lightning_memguard.estimate.losses.default_loss` (a LightningModule's ``training_step(batch, 0)``),
    with ``model.all_gather`` stood in for where ``model`` has one and no Trainer.

    Args:
        world_size: the ranks the gather spans where no process group is initialized (an estimate made before
            training, ``strategy=`` and ``world_size=`` given); inside one, its size. ``None`` without a process
            group: one process, whose gather returns the data as it is.
        on_gather: called at each gather stood in (the guard counts it as the collective it stands for).
    """
    if getattr(model, "_trainer", None) is not None or not callable(getattr(model, "all_gather", None)):
        return default_loss(model, batch)

    def gathered_here(data: Any, group: Optional[Any] = None, sync_grads: bool = False) -> Any:
        if isinstance(data, Number):  # Lightning gathers a number as a tensor
            data = torch.tensor(data)
        ranks = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else world_size
        if ranks is None:
            return data
        if on_gather is not None:
            on_gather()

        def gathered(tensor: torch.Tensor) -> torch.Tensor:
            # as Lightning's: one tensor a rank, stacked (both alive at once), the graph kept only for sync_grads
            with contextlib.nullcontext() if sync_grads else torch.no_grad():
                return torch.stack([tensor.clone() for _ in range(ranks)])

        return map_tensors(gathered, data)

    model.all_gather = gathered_here  # on the instance, for this call
    try:
        return default_loss(model, batch)
    finally:
        del model.all_gather
