"""Memory that grows every step, named: a real Trainer on CPU and the plain loop keep losses with their graphs in a
list; normal models over 50 steps say nothing."""

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_memguard import MemGuard, MemGuardCallback
from tests.helpers import fit_module
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


def test_a_metric_that_concatenates_detached_values_gets_reset_advice_not_detach_advice(tmp_path):
    pytest.importorskip("torchmetrics")
    guard = MemGuardCallback(explain=False, cpu_sample_every=1)
    with pytest.warns(UserWarning, match="leak - memory at the start of a step rose"):
        fit_module(CatchesEveryLoss(), guard, tmp_path, logger=False, max_steps=40)
    leaks = leak_events(guard.events)
    assert len(leaks) == 1, guard.events
    reason = leaks["reason"].iloc[0]
    assert "[32, 1] float32 on cpu" in reason and "grad_fn" not in reason
    assert "carry no autograd graph, so detaching would not help" in reason and "metric.reset()" in reason
    assert "Keep detached values" not in reason


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
