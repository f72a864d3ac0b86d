"""Memory that grows every step, named: a real Trainer on CPU and the plain loop keep losses with their graphs in a
list, detached outputs in a list, losses whose graphs keep their saved activations, values in a metric never reset;
the growth per step is right whether every step is counted or every 4th; normal models over 50 steps say nothing."""

import re

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_memguard import MemGuard, MemGuardCallback
from tests.helpers import bytes_saved_by_autograd, fit_module
from tests.models import Stack, lightning_class, pl, regression_batches
from tests.zoo.models import ZooModule

LightningModule = pl.LightningModule
TensorBoardLogger = lightning_class("loggers", "TensorBoardLogger")


# stays here: it leaks on purpose, for this file's tests
class KeepsLosses(LightningModule):
    """Keeps every step's per-sample losses, graph and all, in ``self.kept_losses`` (the bug of Lightning#14270)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Stack(width=32, depth=2)
        self.kept_losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        per_sample = (self.net(x) - y) ** 2
        self.kept_losses.append(per_sample)
        return per_sample.mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(regression_batches(4, size=32), batch_size=None)


# stays here: it grows on purpose, for this file's tests
class CatchesEveryLoss(KeepsLosses):
    """Accumulates every step's per-sample losses, detached, in a torchmetrics CatMetric that is never reset."""

    def __init__(self) -> None:
        super().__init__()
        from torchmetrics.aggregation import CatMetric

        self.every_loss = CatMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        per_sample = (self.net(x) - y) ** 2
        self.every_loss.update(per_sample.detach())
        return per_sample.mean()


# stays here: it grows on purpose, for this file's tests
class KeepsDetachedOutputs(KeepsLosses):
    """Appends a detached [32, 1024] float32 output (128 KiB) to ``self.kept_outputs`` every step."""

    KEPT_PER_STEP = 32 * 1024 * 4

    def __init__(self) -> None:
        super().__init__()
        self.wide = torch.nn.Linear(32, 1024)
        self.kept_outputs = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden = self.net.blocks(self.net.inp(x))
        self.kept_outputs.append(self.wide(hidden).detach())
        return ((self.net.head(hidden) - y) ** 2).mean()


# stays here: it leaks on purpose, for this file's tests
class KeepsLossWithGraph(KeepsLosses):
    """Manual optimization: backward with ``retain_graph=True``, then the loss (a scalar) goes to
    ``self.kept_losses`` with its graph, which keeps every activation it saved."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def loss(self, batch):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss, retain_graph=True)
        optimizer.step()
        self.kept_losses.append(loss)

    def saved_bytes_per_step(self) -> int:
        """The bytes one step's graph saves besides the parameters and the batch, seen by autograd's own hooks as
        the forward saves them (each storage once)."""
        batch = regression_batches(1, size=32)[0]
        return bytes_saved_by_autograd(lambda: self.loss(batch), (*self.parameters(), *batch))


def growth_per_step(leak) -> float:
    """The bytes a leak event says the run added per optimizer step: its rise over the steps its reason names."""
    steps = int(re.search(r"per step over the (\d+) steps since step", leak["reason"]).group(1))
    return (leak["peak_after_bytes"] - leak["peak_before_bytes"]) / steps


def leak_events(events):
    return events[events["action"] == "leak"] if not events.empty else events


def test_a_trainer_names_the_list_attribute_that_keeps_the_losses(tmp_path):
    guard = MemGuardCallback(explain=False)  # monitor only: CPU steps are measured every 4th step
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    with pytest.warns(UserWarning, match="leak - memory at the start of a step rose") as caught:
        fit_module(KeepsLosses(), guard, tmp_path, logger=logger, max_steps=60)
    leaks = leak_events(guard.events)
    assert len(leaks) == 1, guard.events
    reason = leaks["reason"].iloc[0]
    assert "model.kept_losses (a list of" in reason
    assert "[32, 1] float32 on cpu, grad_fn=PowBackward0, made from the output of module net.head" in reason
    assert "Keep detached values (loss.detach() or loss.item())" in reason  # the graphs are what is kept
    assert leaks["peak_after_bytes"].iloc[0] > leaks["peak_before_bytes"].iloc[0]
    assert sum("leak -" in str(w.message) for w in caught) == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    texts = [t for tag in acc.Tags()["tensors"] for t in acc.Tensors(tag)]
    assert any(b"model.kept_losses" in t.tensor_proto.string_val[0] for t in texts if t.tensor_proto.string_val)


@pytest.mark.parametrize("sample_every", [None, 1], ids=["every_4th_step_counted", "every_step_counted"])
def test_a_metric_that_concatenates_detached_values_gets_reset_advice_not_detach_advice(tmp_path, sample_every):
    pytest.importorskip("torchmetrics")
    guard = MemGuardCallback(explain=False, cpu_sample_every=sample_every)
    with pytest.warns(UserWarning, match="leak - memory at the start of a step rose"):
        fit_module(CatchesEveryLoss(), guard, tmp_path, logger=False, max_steps=60)
    leaks = leak_events(guard.events)
    assert len(leaks) == 1, guard.events
    reason = leaks["reason"].iloc[0]
    assert "[32, 1] float32 on cpu" in reason and "grad_fn" not in reason
    assert "carry no autograd graph, so detaching would not help" in reason and "metric.reset()" in reason
    assert "Keep detached values" not in reason and "loss.detach()" not in reason
    assert "Held by model.every_loss" in reason, reason


def test_the_plain_loop_names_a_list_in_the_users_code(tmp_path):
    model = Stack(width=32, depth=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    kept = []

    def loss_fn(model, batch):
        x, y = batch
        loss = ((model(x) - y) ** 2).mean(dim=1)
        kept.append(loss)
        return loss.mean()

    with pytest.warns(UserWarning, match="leak"):
        with MemGuard(model, optimizer, cpu_sample_every=1, explain=False, log_dir=str(tmp_path)) as guard:
            for batch in regression_batches(4, size=16) * 5:
                guard.step(batch, loss_fn)
    leaks = leak_events(guard.events)
    assert len(leaks) == 1
    reason = leaks["reason"].iloc[0]
    assert "kept" in reason and "loss_fn" in reason, reason
    assert "[16] float32 on cpu, grad_fn=MeanBackward1" in reason


def test_a_normal_model_says_nothing_over_50_steps(tmp_path):
    guard = MemGuardCallback(cpu_sample_every=1, explain=False)
    fit_module(ZooModule("gpt2", n_batches=5, batch_size=2), guard, tmp_path, max_steps=50)
    assert leak_events(guard.events).empty
    rule = guard.engine.monitor.leaks.rule
    assert rule.streak < rule.confirm


@pytest.mark.parametrize("sample_every", [None, 1], ids=["every_4th_step_counted", "every_step_counted"])
def test_detached_outputs_kept_every_step_are_reported_at_their_full_size(tmp_path, sample_every):
    guard = MemGuardCallback(explain=False, cpu_sample_every=sample_every)
    with pytest.warns(UserWarning, match="leak - memory at the start of a step rose"):
        fit_module(KeepsDetachedOutputs(), guard, tmp_path, max_steps=60)
    assert guard.engine.monitor.settings.cpu_sample_every == (sample_every or 4)
    leaks = leak_events(guard.events)
    assert len(leaks) == 1, guard.events
    leak = leaks.iloc[0]
    assert "Held by model.kept_outputs (a list of" in leak["reason"]
    assert "detaching would not help" in leak["reason"] and "list.clear()" in leak["reason"]
    # the steps that are not counted keep their outputs too: counted when counting resumes
    assert growth_per_step(leak) == pytest.approx(KeepsDetachedOutputs.KEPT_PER_STEP, rel=0.1)


@pytest.mark.parametrize("sample_every", [None, 1], ids=["every_4th_step_counted", "every_step_counted"])
def test_a_loss_kept_with_its_graph_is_named_through_the_graph_with_detach_advice(tmp_path, sample_every):
    module = KeepsLossWithGraph()
    kept_per_step = module.saved_bytes_per_step()
    guard = MemGuardCallback(explain=False, cpu_sample_every=sample_every)
    with pytest.warns(UserWarning, match="leak - memory at the start of a step rose"):
        fit_module(module, guard, tmp_path, max_steps=60)
    leaks = leak_events(guard.events)
    assert len(leaks) == 1, guard.events
    leak = leaks.iloc[0]
    # what grows are the activations the graphs saved; what holds them is the list of losses, through the graphs
    assert "Held by model.kept_losses (a list of" in leak["reason"], leak["reason"]
    assert "through the autograd graphs of the tensors it keeps (" in leak["reason"]
    assert "[] float32 on cpu, grad_fn=MeanBackward0" in leak["reason"]
    assert "keep loss.detach() or loss.item() instead" in leak["reason"]
    assert "Their holder was not found" not in leak["reason"]
    assert growth_per_step(leak) == pytest.approx(kept_per_step, rel=0.1)
