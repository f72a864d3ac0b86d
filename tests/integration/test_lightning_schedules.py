"""MemGuardCallback beside a learning-rate scheduler that steps every optimizer step (OneCycleLR, LambdaLR), in real
CPU Trainers under a hard limit the whole batch does not fit: the batch that runs out of memory runs again split, and
the scheduler still steps once per optimizer step, so the learning rates and parameters are the unguarded run's."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_memguard import MemGuardCallback
from tests.helpers import assert_same_parameters, budget_for_a_share_of_the_step, fit_module, probe_module
from tests.models import RecordedBlockStack

TORCH_ORDER_WARNING = "optimizer.step()` has been overridden after learning rate scheduler"


class ScheduledStack(RecordedBlockStack):
    """:class:`~tests.models.RecordedBlockStack` (4 blocks, batches of 256, SGD) with a scheduler stepped every
    optimizer step, recording the learning rate after each batch."""

    def __init__(self, schedule: str) -> None:
        torch.manual_seed(0)
        super().__init__(optimizer="sgd", n_samples=2048)
        self.schedule, self.rates = schedule, []

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        if self.schedule == "one_cycle":
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=20)
        else:
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.rates.append(self.trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize("schedule", ["one_cycle", "lambda"])
def test_a_per_step_scheduler_steps_once_an_optimizer_step_through_a_rescue_and_no_torch_warning(tmp_path, schedule):
    """The first batch runs out of memory under the hard limit and runs again in parts: the scheduler steps once for
    it (not once per attempt or part). And torch's scheduler, which marks the optimizer step it wrapped and warns at its
    first step when ``optimizer.step`` has no mark ("has been overridden after learning rate scheduler
    initialization", advice about the user's code), is quiet: the guard's step carries the mark of the step it calls."""
    peaks = probe_module(ScheduledStack(schedule), tmp_path / "probe", 2)
    limit = budget_for_a_share_of_the_step(peaks, 0.6)
    reference, model = ScheduledStack(schedule), ScheduledStack(schedule)
    fit_module(reference, [], tmp_path / "plain", max_steps=5)
    guard = MemGuardCallback(mitigations=("checkpointing", "microbatch"), budget=limit, cpu_hard_limit=limit,
                             plan_at_start=False, explain=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit_module(model, [guard], tmp_path / "guarded", max_steps=5)
    assert trainer.global_step == 5 and "rescue" in set(guard.events["action"])
    assert not [w for w in caught if TORCH_ORDER_WARNING in str(w.message)]
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 5  # stepped once a step, the rescued one too
    assert model.rates == reference.rates and len(model.rates) == 5
    assert_same_parameters(model, reference, atol=1e-6)


def test_a_monitor_only_guard_leaves_torchs_scheduler_warning_to_a_real_misorder(tmp_path):
    """Carrying the mark does not hide the warning where it is true: a scheduler stepped before any optimizer step
    still gets torch's other warning, with or without the guard."""

    class SchedulerFirst(ScheduledStack):
        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == 0:
                self.lr_schedulers().step()  # before the optimizer ever stepped: the misorder torch warns about

    seen = {}
    for name, callbacks in [("plain", []), ("guarded", [MemGuardCallback(mitigations=(), explain=False)])]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit_module(SchedulerFirst("lambda"), callbacks, tmp_path / name, max_steps=2)
        seen[name] = sorted({str(w.message)[:60] for w in caught if "lr_scheduler.step()" in str(w.message)
                             or TORCH_ORDER_WARNING in str(w.message)})
    assert seen["guarded"] == seen["plain"] and seen["plain"]  # "Detected call of `lr_scheduler.step()` before ..."
