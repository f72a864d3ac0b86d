"""A training batch run again after an out-of-memory error counts once in what the training step measures: the
torchmetrics modules it updates and the values it logs with ``self.log(on_epoch=True)`` — the failed attempt's
updates are put back, as its running BatchNorm statistics are. Real OOMs: the CPU accountant's hard limit, hit in the
backward of the second batch, which needs memory in proportion to its samples there (so micro-batches fit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch.utils.data import DataLoader

from lightning_memguard import MemGuardCallback, Rung
from tests.helpers import assert_same_parameters, fit_module, probe, run
from tests.models import BackwardBallast, Stack, pl, regression_batches

BATCHES = 4
SIZE = 512


class CountingStack(Stack):
    """A Stack whose forward counts its samples in a torchmetrics metric; batch 1's backward needs
    ``ballast_per_sample`` bytes a sample more (``batch_index`` is set before each batch)."""

    def __init__(self, ballast_per_sample: int = 0) -> None:
        super().__init__(width=32, depth=4)
        self.seen = torchmetrics.SumMetric()
        self.ballast_per_sample, self.batch_index = ballast_per_sample, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_meta:  # the estimate's meta copy runs this forward too: it counts nothing real
            self.seen.update(torch.tensor(float(x.shape[0])))
        h = self.inp(x)
        if self.batch_index == 1 and self.ballast_per_sample:
            h = BackwardBallast.apply(h, self.ballast_per_sample * x.shape[0])
        return self.head(self.blocks(h))


def set_index(model: CountingStack, index: int) -> None:
    model.batch_index = index


@pytest.fixture(scope="module")
def ballast_and_limit(tmp_path_factory):
    """A limit 20 % over the plain step's peak, and batch 1's backward ballast as much again as that peak: the whole
    batch runs out of memory in backward, its micro-batches fit."""
    peak = probe("lightning", CountingStack(), regression_batches(2, SIZE),
                 tmp_path_factory.mktemp("probe")).highest()
    return int(1.2 * peak) // SIZE, int(1.2 * peak)


@pytest.mark.parametrize("door", ["lightning", "fabric", "loop"])
def test_a_batch_rescued_from_a_backward_oom_counts_once_in_the_models_metric(tmp_path, ballast_and_limit, door):
    ballast, limit = ballast_and_limit
    result = run(door, CountingStack(ballast), regression_batches(BATCHES, SIZE), tmp_path, before_batch=set_index,
                 cpu_hard_limit=limit, threshold=1.0, plan_at_start=False, mitigations=("microbatch",),
                 explain=False)
    assert result.steps_done == BATCHES
    rescues = result.guard.events[result.guard.events["action"] == "rescue"]
    assert list(rescues["step"]) == [1] and "in backward" in rescues["reason"].iloc[0]  # the failed attempt counted
    assert result.model.seen.compute().item() == BATCHES * SIZE  # the rescued batch's samples once


class LoggingModule(pl.LightningModule):
    """Logs each batch's samples (summed over the epoch) and its loss (the epoch's mean) before backward, and appends
    its samples to a list of the module's (Lightning's pattern for what ``training_epoch_end`` once received)."""

    def __init__(self, model: CountingStack, batches: list) -> None:
        super().__init__()
        self.model, self.batches = model, batches
        self.step_samples = []

    def training_step(self, batch, index):
        self.model.batch_index = index
        loss = F.mse_loss(self.model(batch[0]), batch[1])
        self.log("samples", float(batch[0].shape[0]), on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("epoch_loss", loss, on_step=False, on_epoch=True)
        self.step_samples.append(batch[0].shape[0])  # a micro-batch's: its samples
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(self.batches, batch_size=None)


def test_what_a_rescued_batch_logged_before_its_backward_oom_counts_once_in_the_epoch(tmp_path, ballast_and_limit):
    ballast, limit = ballast_and_limit
    batches = regression_batches(BATCHES, SIZE)
    reference = LoggingModule(CountingStack(ballast), batches)
    unguarded = fit_module(reference, [], tmp_path / "unguarded", max_epochs=1)
    module = LoggingModule(CountingStack(ballast), batches)
    guard = MemGuardCallback(cpu_hard_limit=limit, threshold=1.0, plan_at_start=False, mitigations=("microbatch",),
                             explain=False)
    trainer = fit_module(module, [guard], tmp_path / "guarded", max_epochs=1)
    assert trainer.global_step == BATCHES
    assert list(guard.events[guard.events["action"] == "rescue"]["step"]) == [1]
    logged, expected = trainer.callback_metrics, unguarded.callback_metrics
    assert logged["samples"].item() == expected["samples"].item() == BATCHES * SIZE
    torch.testing.assert_close(logged["epoch_loss"], expected["epoch_loss"], atol=1e-6, rtol=1e-5)
    assert module.model.seen.compute().item() == BATCHES * SIZE
    assert sum(module.step_samples) == sum(reference.step_samples) == BATCHES * SIZE  # the failed attempt's cut back
    assert_same_parameters(module, reference, atol=1e-6)


class BreaksForward(Rung):
    """A rung whose level 1 makes the module's forward raise after its metric counted the batch (as a rung that
    breaks a model midway would)."""

    name, levels = "breaks_forward", 1

    def apply(self, module, level):
        getattr(module, "model", module).breaks = bool(level)


class BreakableCountingStack(CountingStack):
    breaks = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.breaks and not x.is_meta:
            raise RuntimeError("the rung broke the forward")
        return out


@pytest.mark.parametrize("door", ["lightning", "loop"])
def test_a_batch_run_again_after_a_rung_broke_its_forward_counts_once_without_rescue(tmp_path, door):
    """With the OOM rescue off, a batch still runs again where a rung just put on broke it (the rung is put back):
    what that failed attempt counted in the model's metric is put back too."""
    batches = regression_batches(BATCHES, SIZE)
    peak = probe(door, CountingStack(), batches, tmp_path / "probe").highest()
    result = run(door, BreakableCountingStack(), batches, tmp_path / "guarded", budget=int(peak / 2),
                 rescue_oom=False, plan_at_start=False, mitigations=(BreaksForward(),), explain=False)
    assert result.steps_done == BATCHES
    events = result.guard.events
    assert set(events["action"]) >= {"apply", "revert"}, events[["step", "action", "rung"]]
    assert result.guard.levels == {"breaks_forward": 0}
    assert result.model.seen.compute().item() == BATCHES * SIZE  # the broken attempt's samples put back
