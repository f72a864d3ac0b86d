"""The training step the first batch's estimates run for a LightningModule: the module's ``training_step(batch, 0)``
with ``self.all_gather`` stood in for on the estimate's copy, which has no Trainer
(:mod:`~lightning_memguard.estimate.gathers`; a manual step's optimizers and backward too:
:mod:`~lightning_memguard.estimate.manual_step`), each gather counted as the collective it stands for
(:func:`~lightning_memguard.adapters.own_collectives.count_stand_in`), so a recovery knows before the first step that
the step issues one of its own."""

from __future__ import annotations

from ..estimate.gathers import TrainingStep
from .own_collectives import count_stand_in

__all__ = ["training_step_of_copy"]

#: ``(model, batch) -> loss``: the module's ``training_step(batch, 0)``, as the estimate runs it by default, with
#: ``all_gather`` stood in for where ``model`` is a copy without its Trainer, and counted
training_step_of_copy = TrainingStep(on_gather=count_stand_in)
