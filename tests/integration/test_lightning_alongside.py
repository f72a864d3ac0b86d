"""MemGuardCallback in a Trainer configured as users configure it: ``barebones=True`` and ``log_every_n_steps=0``
(Lightning logs nothing), and the callbacks users put beside it — ModelCheckpoint ranking by ``train_loss``,
EarlyStopping, LearningRateMonitor, ThroughputMonitor, a callback of their own — under micro-batches, planned from a
budget, rescued under a hard limit, or resumed at four parts. Each sees what it sees in the same fit without the guard:
one ``on_train_batch_end`` per batch with the whole batch and its outputs, the same ``global_step``, the same values
logged ``on_step`` (the whole batch's, not the last micro-batch's), checkpoints at the same steps with the same
names. The model is a small MLP (no dropout, SGD): micro-batching changes no number beyond rounding."""

from __future__ import annotations

import os
import warnings

import pandas as pd
import pytest
import torch
import torchmetrics
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memguard import MemGuardCallback
from tests.helpers import budget_for_a_share_of_the_step, fit_module, probe_module
from tests.models import lightning_class, pl

PARTS = 4


def regression_data(n: int, seed: int = 1) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


class Regressor(pl.LightningModule):
    """An MLP that logs its loss as users do (``self.log("train_loss", loss)``: on_step, a mean), its largest and
    summed squared error (``reduce_fx`` max and sum), the gradient norm after backward, and returns its predictions
    beside the loss."""

    def __init__(self, batch_size: int = 16, n_samples: int = 96, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                 nn.Linear(width, 1))
        self.batch_size, self.n_samples = batch_size, n_samples

    def training_step(self, batch, batch_idx):
        x, y = batch
        prediction = self.net(x)
        errors = (prediction - y).pow(2)
        loss = errors.mean()
        self.log("train_loss", loss, prog_bar=True)
        self.log("worst_error", errors.max(), reduce_fx="max")
        self.log("error_sum", errors.sum(), reduce_fx="sum")
        return {"loss": loss, "prediction": prediction.detach()}

    def on_after_backward(self):
        # after the last part the gradients are the whole batch's: its value is the one to keep
        self.log("grad_norm", torch.stack([p.grad.norm() for p in self.parameters()]).norm())

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(regression_data(self.n_samples), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(regression_data(32, seed=2), batch_size=16)


class Records(pl.Callback):
    """What a user's callback sees: each batch's start and end (index, ``global_step``, samples, the outputs' loss
    and prediction shape), the values logged on_step as the step ends, validation ends and checkpoint saves."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rows.append(("start", batch_idx, trainer.global_step, len(batch[0])))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(("end", batch_idx, trainer.global_step, len(batch[0]), round(outputs["loss"].item(), 5),
                          tuple(outputs["prediction"].shape)))

    def on_validation_end(self, trainer, pl_module):
        self.rows.append(("validation", trainer.global_step))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.rows.append(("checkpoint", trainer.global_step))


def at_four_parts(**settings) -> MemGuardCallback:
    """A guard at 4 micro-batches from the first batch (as resumed at that level)."""
    guard = MemGuardCallback(**{"budget": "1GiB", "mitigations": ("microbatch",), "explain": False, **settings})
    guard.load_state_dict({"ladder": {"levels": {"microbatch": 2}}})
    return guard


def fit(guard, root, model: Regressor = None, callbacks=(), **trainer):
    """Fits a :class:`Regressor` (or ``model``) for two epochs with :class:`Records`, ``callbacks`` and the guard (if
    any) under a CSVLogger; returns the model, the records, the Trainer and the CSV's rows."""
    model = model or Regressor()
    records = Records()
    options = dict(max_steps=-1, max_epochs=2, logger=lightning_class("loggers", "CSVLogger")(str(root)))
    options.update(trainer)
    callbacks = [records, *callbacks] + ([guard] if guard is not None else [])
    fitted = fit_module(model, callbacks, root, **options)
    csv = [logger for logger in fitted.loggers if isinstance(logger, lightning_class("loggers", "CSVLogger"))]
    rows = pd.read_csv(os.path.join(csv[0].log_dir, "metrics.csv")) if csv else None
    return model, records, fitted, rows


def assert_same_logged(rows: pd.DataFrame, reference: pd.DataFrame, key: str) -> None:
    """Both logged ``key`` at the same steps, the same values up to rounding."""
    got, want = rows.dropna(subset=[key]), reference.dropna(subset=[key])
    assert got["step"].tolist() == want["step"].tolist(), key
    assert got[key].tolist() == pytest.approx(want[key].tolist(), rel=1e-6, abs=1e-6), key


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def checkpoints(trainer) -> list[str]:
    return sorted(os.listdir(trainer.checkpoint_callback.dirpath))


def ranking_callbacks() -> list:
    """ModelCheckpoint keeping the two best steps by ``train_loss`` (the step's value decides), EarlyStopping on the
    validation loss checked mid-epoch, LearningRateMonitor."""
    callbacks = lightning_class("callbacks", "ModelCheckpoint"), lightning_class("callbacks", "EarlyStopping")
    return [callbacks[0](monitor="train_loss", save_top_k=2, every_n_train_steps=1, filename="{step}-{train_loss:.4f}"),
            callbacks[1](monitor="val_loss", patience=0, min_delta=0.05, check_on_train_epoch_end=False),
            lightning_class("callbacks", "LearningRateMonitor")("step")]


# --- values logged on_step under micro-batches ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hard_limit(tmp_path_factory) -> int:
    """A CPU limit under which the whole batch of 512 samples does not fit (what every step holds plus 60 % of what a
    step adds): the first step runs out of memory and is rescued in parts."""
    peaks = probe_module(Regressor(batch_size=512, n_samples=2048, width=64), tmp_path_factory.mktemp("probe"), 3)
    return budget_for_a_share_of_the_step(peaks, 0.6)


@pytest.mark.parametrize("how", ["four parts", "hard limit"])
def test_values_logged_on_step_and_the_checkpoints_ranked_by_them_are_the_whole_batchs(tmp_path, how, request):
    """``self.log("train_loss", loss)`` in a micro-batched step: the loggers, ModelCheckpoint's ranking and file names,
    EarlyStopping and the callbacks see the whole batch's value (a max and a sum reduced as such), not the last
    part's."""
    if how == "four parts":
        make_model, guard = Regressor, at_four_parts()
        trainer = dict(val_check_interval=3)
    else:
        limit = request.getfixturevalue("hard_limit")
        make_model = lambda: Regressor(batch_size=512, n_samples=2048, width=64)  # noqa: E731
        guard = MemGuardCallback(cpu_hard_limit=limit, plan_at_start=False, mitigations=("microbatch",),
                                 explain=False)
        trainer = dict(val_check_interval=2)
    reference, plain, plain_trainer, plain_rows = fit(None, tmp_path / "plain", make_model(), ranking_callbacks(),
                                                      enable_checkpointing=True, **trainer)
    model, records, guarded_trainer, rows = fit(guard, tmp_path / "guarded", make_model(), ranking_callbacks(),
                                                enable_checkpointing=True, **trainer)
    assert guard.history["micro_batches"].max() > 1, "the batches must run in parts"
    if how == "hard limit":
        assert (guard.events["action"] == "rescue").any()
    for key in ("train_loss", "worst_error", "error_sum", "grad_norm"):
        assert_same_logged(rows, plain_rows, key)
    assert checkpoints(guarded_trainer) == checkpoints(plain_trainer)
    assert records.rows == plain.rows
    assert guarded_trainer.global_step == plain_trainer.global_step
    assert_same_parameters(model, reference)


def test_the_progress_bar_and_callback_metrics_show_the_whole_batchs_loss(tmp_path):
    _, _, plain, _ = fit(None, tmp_path / "plain", enable_progress_bar=True, max_epochs=1)
    guard = at_four_parts()
    _, _, guarded, _ = fit(guard, tmp_path / "guarded", enable_progress_bar=True, max_epochs=1)
    assert guarded.progress_bar_metrics["train_loss"] == pytest.approx(plain.progress_bar_metrics["train_loss"],
                                                                       abs=1e-6)
    assert guarded.callback_metrics["train_loss"].item() == pytest.approx(
        plain.callback_metrics["train_loss"].item(), abs=1e-6)
    assert "mem%" in guarded.progress_bar_metrics


class MeteredRegressor(Regressor):
    """A :class:`Regressor` that logs torchmetrics metrics as themselves, on the step and the epoch: a mean squared
    error (summed states), the largest error (a max state, its update reads it), an AUROC of the sign (concatenated
    states), and a collection through ``log_dict``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.mse = torchmetrics.MeanSquaredError()
        self.largest = torchmetrics.MaxMetric()
        self.auroc = torchmetrics.classification.BinaryAUROC()
        self.precision = torchmetrics.classification.BinaryPrecision()
        self.collection = torchmetrics.MetricCollection({"mae": torchmetrics.MeanAbsoluteError(),
                                                         "r2": torchmetrics.R2Score()}, prefix="train_")

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        prediction, target = out["prediction"].squeeze(1), batch[1].squeeze(1)
        self.mse(prediction, target)
        self.log("train_mse", self.mse, on_step=True, on_epoch=True)
        self.largest((prediction - target).abs().max())
        self.log("train_largest", self.largest, on_step=True, on_epoch=False)
        # probabilities: torchmetrics reads a call's values as logits when any is outside [0, 1], part by part
        self.auroc(prediction.sigmoid(), (target > 0).long())
        self.log("train_auroc", self.auroc, on_step=True, on_epoch=True)
        self.log_dict(self.collection(prediction, target), on_step=True, on_epoch=True)
        self.log("train_error_1_5", (prediction - target).abs().pow(1.5).mean(), on_step=False, on_epoch=True)
        self.log("train_precision", self.precision(prediction.sigmoid(), (target > 0).long()), on_step=False,
                 on_epoch=True)  # a metric's value for the epoch only: the mean of the batches' values
        return out


@pytest.mark.parametrize("how", ["four parts", "hard limit"])
def test_torchmetrics_logged_on_step_show_the_whole_batchs_value_and_count_it_once(tmp_path, how, request):
    """A batch run in parts updates each metric once a part: the step's value Lightning logs is the metric over
    the whole batch (not the last part's), and the epoch's is the metric over every sample once — also where the
    whole batch ran out of memory first (its attempt's updates put back) and was rescued in parts."""
    if how == "four parts":
        make_model, guard = MeteredRegressor, at_four_parts()
    else:
        make_model = lambda: MeteredRegressor(batch_size=512, n_samples=2048, width=64)  # noqa: E731
        guard = MemGuardCallback(cpu_hard_limit=request.getfixturevalue("hard_limit"), plan_at_start=False,
                                 mitigations=("microbatch",), explain=False)
    _, _, _, plain_rows = fit(None, tmp_path / "plain", make_model(), log_every_n_steps=1)
    _, _, _, rows = fit(guard, tmp_path / "guarded", make_model(), log_every_n_steps=1)
    assert guard.history["micro_batches"].max() > 1
    if how == "hard limit":
        assert (guard.events["action"] == "rescue").any()
    for key in ("train_mse_step", "train_mse_epoch", "train_largest", "train_auroc_step", "train_auroc_epoch",
                "train_mae_step", "train_mae_epoch", "train_r2_step", "train_r2_epoch", "train_error_1_5",
                "train_precision", "train_loss"):
        assert_same_logged(rows, plain_rows, key)


class OutOfMemoryOnceInTheSecondEpoch(Regressor):
    """A :class:`Regressor` that also logs its mean absolute error for the epoch, and whose first attempt at the second
    epoch's first batch runs out of memory after logging (a scripted OOM: the batch is rescued in parts)."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train_mae", (out["prediction"] - batch[1]).abs().mean(), on_step=False, on_epoch=True)
        if self.current_epoch == 1 and batch_idx == 0 and not self.failed:
            self.failed = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (scripted)")
        return out


def test_a_batch_rescued_at_an_epochs_start_counts_that_epoch_alone_in_its_mean(tmp_path):
    """The failed attempt's first ``self.log`` cleared the epoch before's values, and putting the logged values back
    brings those back: the batch run again clears them again, so the second epoch's mean is its own samples'."""
    unguarded = OutOfMemoryOnceInTheSecondEpoch()
    unguarded.failed = True  # never fails
    _, _, _, plain_rows = fit(None, tmp_path / "plain", unguarded)
    guard = MemGuardCallback(budget="1GiB", mitigations=("microbatch",), explain=False, plan_at_start=False)
    model, _, _, rows = fit(guard, tmp_path / "guarded", OutOfMemoryOnceInTheSecondEpoch())
    assert model.failed and (guard.events["action"] == "rescue").any()
    assert_same_logged(rows, plain_rows, "train_mae")


# --- Trainer flags ----------------------------------------------------------------------------------------------------

def test_barebones_trains_split_as_unsplit_and_keeps_the_history(tmp_path):
    """``Trainer(barebones=True)`` sets ``log_every_n_steps=0``: the guard logs nothing either, and trains."""
    options = dict(barebones=True, logger=False, enable_progress_bar=None, enable_model_summary=None,
                   log_every_n_steps=None)
    reference, plain, _, _ = fit(None, tmp_path / "plain", **options)
    guard = at_four_parts()
    model, records, trainer, _ = fit(guard, tmp_path / "guarded", **options)
    assert records.rows == plain.rows
    assert_same_parameters(model, reference)
    assert sorted(guard.history["step"].unique()) == list(range(trainer.global_step))


def test_log_every_n_steps_zero_logs_no_step_memory_and_training_goes_on(tmp_path):
    """``log_every_n_steps=0`` with a logger: Lightning logs no step metrics, nor does the guard (its evaluation
    batches, logged on their own axis at every batch, and epoch-end values stay)."""
    guard = at_four_parts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, trainer, rows = fit(guard, tmp_path, log_every_n_steps=0)
    assert trainer.global_step == 12 and len(guard.history) > 0
    assert not [key for key in rows.columns if key.startswith("memguard/") and key.split("/")[1] in
                ("batch_start", "after_forward", "after_backward", "after_optimizer_step", "peak_share")]
    assert "train_loss" not in rows.columns and "val_loss" in rows.columns


# --- callbacks beside the guard ---------------------------------------------------------------------------------------

class ChangesTheBatch(pl.Callback):
    """Scales the batch's inputs in place as the batch starts (an augmentation in a callback)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        batch[0].mul_(0.5)


class TransferHooks(Regressor):
    """Counts the samples each transfer hook sees, and adds 1 to the inputs after the transfer."""

    def __init__(self) -> None:
        super().__init__()
        self.transfers: list[tuple[str, int]] = []

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.transfers.append(("before", len(batch[0])))
        return batch

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.transfers.append(("after", len(batch[0])))
        return [batch[0] + 1, batch[1]]


def test_user_hooks_and_monitors_see_whole_batches_once_each(tmp_path):
    """The transfer hooks and a callback that changes the batch run once per batch on the whole batch, before the
    guard splits it; ThroughputMonitor counts the whole batch's samples; a TensorBoard and a CSV logger together."""
    loggers = lambda root: [lightning_class("loggers", "TensorBoardLogger")(str(root)),  # noqa: E731
                            lightning_class("loggers", "CSVLogger")(str(root), version="csv")]
    throughput = lambda: lightning_class("callbacks", "ThroughputMonitor")(  # noqa: E731
        batch_size_fn=lambda batch: len(batch[0]))
    reference = TransferHooks()
    _, plain, _, _ = fit(None, tmp_path / "plain", reference, [ChangesTheBatch(), throughput()],
                         logger=loggers(tmp_path / "plain"))
    model, guard = TransferHooks(), at_four_parts()
    _, records, trainer, _ = fit(guard, tmp_path / "guarded", model, [ChangesTheBatch(), throughput()],
                                 logger=loggers(tmp_path / "guarded"))
    assert model.transfers == reference.transfers and records.rows == plain.rows
    assert_same_parameters(model, reference)
    seen = [pd.read_csv(root / "lightning_logs" / "csv" / "metrics.csv").dropna(subset=["train/samples"])
            for root in (tmp_path / "plain", tmp_path / "guarded")]
    assert seen[1]["train/samples"].tolist() == seen[0]["train/samples"].tolist() == [16.0 * i for i in range(1, 13)]
    assert os.path.exists(os.path.join(trainer.log_dir, "memguard_history.csv"))
