"""The training step the first batch's estimates run for a LightningModule under automatic optimization: the
module's ``training_step(batch, 0)`` with ``self.all_gather`` stood in for on the estimate's copy, which has no
Trainer (:mod:`~lightning_memguard.estimate.gathers`), each gather counted as the collective it stands for
(:func:`~lightning_memguard.adapters.own_collectives.count_stand_in`), so a recovery knows before the first step that
the step issues one of its own."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..estimate.gathers import step_loss_with_gathers_stood_in
from .own_collectives import count_stand_in

__all__ = ["training_step_of_copy"]


def training_step_of_copy(model: nn.Module, batch: Any) -> Any:
    """``(model, batch) -> loss``: the module's ``training_step(batch, 0)``, as the estimate runs it by default, with
    ``all_gather`` stood in for where ``model`` is a copy without its Trainer, and counted."""
    return step_loss_with_gathers_stood_in(model, batch, on_gather=count_stand_in)
