"""MemGuardCallback beside Lightning's own training tools, in real CPU Trainers, with a budget small enough that the
ladder acts: an accumulation schedule that changes mid-fit and gradient clipping (norm and value) under micro-batching,
stochastic weight averaging with blocks checkpointed, checkpoints, early stopping and mid-epoch validation with a
resume from the saved file, and the learning-rate finder. Micro-batching and checkpointing change no arithmetic the
optimizer sees (LayerNorm, no dropout, SGD), so the guarded runs end at an unguarded run's parameters."""

from __future__ import annotations

import os
from typing import Optional

import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_memguard import MemGuardCallback
from lightning_memguard.base.snapshot import format_bytes
from lightning_memguard.mitigations.checkpointing import is_checkpointed
from tests.helpers import (assert_same_parameters, assert_same_state, budget_for_a_share_of_the_step, fit_module,
                           probe_module)
from tests.models import (BatchNormStack, BlockStack, RecordedBlockStack, lightning_class, pl, regression_dataset,
                          trainer_kwargs)


def recorded_stack(n_samples: int = 1024) -> RecordedBlockStack:
    """4 blocks, batches of 256, SGD: both activation rungs are exact on it."""
    torch.manual_seed(0)
    return RecordedBlockStack(optimizer="sgd", n_samples=n_samples)


@pytest.fixture(scope="module")
def split_budget(tmp_path_factory) -> int:
    """A budget under which the stack's whole-batch step does not fit (what every step holds plus 60 % of what a step
    adds): the micro-batch rung splits the batches."""
    return budget_for_a_share_of_the_step(probe_module(recorded_stack(), tmp_path_factory.mktemp("probe"), 2), 0.6)


def split_guard(budget: int) -> MemGuardCallback:
    """Micro-batching only, climbed when a step is over the budget (no plan: the first step runs whole)."""
    return MemGuardCallback(mitigations=("microbatch",), budget=budget, plan_at_start=False, explain=False)


def applied(guard: MemGuardCallback, rung: str) -> list[tuple[int, int]]:
    """``(step, level)`` of every event that set ``rung`` higher (applied, planned or rescued)."""
    events = guard.events
    rows = events[(events["rung"] == rung) & events["action"].isin(["apply", "plan", "rescue"])]
    return list(zip(rows["step"].tolist(), rows["level"].tolist()))


# --- an accumulation schedule -----------------------------------------------------------------------------------------

def test_an_accumulation_schedule_that_changes_mid_fit_trains_split_as_unsplit(tmp_path, split_budget):
    """GradientAccumulationScheduler takes windows of 1 batch in the first epoch, of 2 in the second: the micro-batch
    rung, climbed after the first step, splits every batch of both kinds of window, zeroes the gradients once a
    window and the optimizer sees each window's whole gradient."""
    schedule = {0: 1, 1: 2}
    scheduler = lightning_class("callbacks", "GradientAccumulationScheduler")
    model, reference = recorded_stack(512), recorded_stack(512)  # 2 batches an epoch
    fit_module(reference, [scheduler(schedule)], tmp_path / "plain", max_steps=-1, max_epochs=2)
    guard = split_guard(split_budget)
    trainer = fit_module(model, [guard, scheduler(schedule)], tmp_path / "guarded", max_steps=-1, max_epochs=2)
    assert trainer.global_step == 2 + 1 and model.finished == reference.finished == [0, 1, 0, 1]
    (step, level), = applied(guard, "microbatch")
    assert step == 0 and level >= 1 and guard.levels["microbatch"] == level
    parts = 2 ** level
    assert model.step_sizes == [256] + [256 // parts] * parts * 3  # 4 batches, the first whole
    stepped = guard.history[guard.history["phase"] == "after_optimizer_step"]
    assert stepped["step"].tolist() == [0, 1, 2]  # one row a window, on Lightning's own step axis
    assert (guard.history[guard.history["step"] >= 1]["peak_bytes"] <= split_budget).all()
    assert_same_parameters(model, reference, atol=1e-6)


# --- a batch size of the user's in self.log ---------------------------------------------------------------------------

class ConstantSizeLogs(RecordedBlockStack):
    """Logs its loss for the epoch with a ``batch_size=`` of its own, a constant (``batch_size=self.hparams...``), on
    each step and the epoch, and for the epoch only."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("constant_size_loss", loss, on_step=True, on_epoch=True, batch_size=256)
        self.log("constant_size_epoch_loss", loss, on_step=False, on_epoch=True, batch_size=256)
        return loss


def test_an_epoch_mean_logged_with_a_constant_batch_size_counts_each_split_batch_once(tmp_path, split_budget):
    """The rung splits from the second step on: epoch 0 has a whole batch and a split one, epoch 1 begins with a split
    one (whose first part's log starts the epoch's sum). A split batch weighs 256 in the epoch's mean, as unsplit, not
    256 a part (before, epoch 0's mean weighed its split batch k times as much as its whole one)."""
    torch.manual_seed(0)
    reference = ConstantSizeLogs(optimizer="sgd", n_samples=512)
    torch.manual_seed(0)
    model = ConstantSizeLogs(optimizer="sgd", n_samples=512)
    CSVLogger = lightning_class("loggers", "CSVLogger")
    logged = {}
    for name, module, callbacks in (("plain", reference, []), ("guarded", model, [split_guard(split_budget)])):
        logger = CSVLogger(str(tmp_path / name), name="csv")
        fit_module(module, callbacks, tmp_path / name, max_steps=-1, max_epochs=2, logger=logger)
        logged[name] = pd.read_csv(os.path.join(logger.log_dir, "metrics.csv"))
    assert model.step_sizes[0] == 256 and model.step_sizes[1] < 256  # the first batch whole, then parts
    for key in ("constant_size_loss_epoch", "constant_size_epoch_loss"):
        got, want = (torch.tensor(logged[name][key].dropna().to_numpy()) for name in ("guarded", "plain"))
        assert len(got) == 2, key
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=key)


# --- gradient clipping ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm, value", [("norm", 0.05), ("value", 0.002)])
def test_gradient_clipping_applies_once_to_the_whole_batchs_gradient(tmp_path, split_budget, algorithm, value):
    """Lightning clips after the closure, which runs every micro-batch: the clip sees the sum of the parts, the whole
    batch's gradient, so the parameters are those of unsplit batches clipped the same way (and not of unclipped
    ones: the clip bites)."""
    clip = dict(gradient_clip_val=value, gradient_clip_algorithm=algorithm)
    model, reference, unclipped = recorded_stack(512), recorded_stack(512), recorded_stack(512)
    fit_module(reference, [], tmp_path / "plain", max_steps=3, **clip)
    fit_module(unclipped, [], tmp_path / "unclipped", max_steps=3)
    guard = split_guard(split_budget)
    fit_module(model, [guard], tmp_path / "guarded", max_steps=3, **clip)
    assert applied(guard, "microbatch") and model.step_sizes[0] == 256 and len(model.step_sizes) > 3
    assert_same_parameters(model, reference, atol=1e-6)
    difference = max((p - q).abs().max().item() for p, q in zip(model.parameters(), unclipped.parameters()))
    assert difference > 1e-4


# --- stochastic weight averaging --------------------------------------------------------------------------------------

class BatchNormModule(pl.LightningModule):
    """:class:`~tests.models.BatchNormStack` (4 blocks, width 32) on 2 batches of 256 an epoch, SGD with momentum:
    BatchNorm makes StochasticWeightAveraging add its epoch that only runs forwards to recompute the statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.net = BatchNormStack(width=32, depth=4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(regression_dataset(512, 0), batch_size=256)


def test_weight_averaging_with_blocks_checkpointed_ends_at_the_unguarded_average(tmp_path):
    """StochasticWeightAveraging builds its SWALR at its first epoch, mid-fit, around the guard's optimizer step (the
    scheduler's constructor used to raise AttributeError on it), averages the weights, and runs an extra epoch of
    forwards only through the checkpointed blocks to recompute the BatchNorm statistics. Checkpointing is exact and a
    recomputation does not update the statistics: weights and statistics are the unguarded run's, bit for bit."""
    averaging = lightning_class("callbacks", "StochasticWeightAveraging")
    peaks = probe_module(BatchNormModule(), tmp_path / "probe", 2)
    reference, model = BatchNormModule(), BatchNormModule()
    fit_module(reference, [averaging(swa_lrs=0.005, swa_epoch_start=1)], tmp_path / "plain", max_steps=-1,
               max_epochs=3)
    guard = MemGuardCallback(mitigations=("checkpointing",), budget=budget_for_a_share_of_the_step(peaks, 0.9),
                             explain=False)
    trainer = fit_module(model, [guard, averaging(swa_lrs=0.005, swa_epoch_start=1)], tmp_path / "guarded",
                         max_steps=-1, max_epochs=3)
    assert trainer.current_epoch == 3 + 1  # the statistics' epoch ran
    assert 1 <= guard.levels["checkpointing"] < 4 and "gave_up" not in set(guard.events["action"])
    checkpointed = [is_checkpointed(block) for block in model.net.blocks]
    assert sum(checkpointed) == guard.levels["checkpointing"]
    # the statistics were reset and taken again over the extra epoch's 2 batches, by the guarded model's forwards
    assert all(block.norm.num_batches_tracked.item() == 2 for block in model.net.blocks)
    assert_same_state(model, reference)


def test_the_averaged_copy_a_callback_keeps_is_counted_on_cpu_and_the_plan_leaves_room_for_it(tmp_path):
    """WeightAveraging keeps an averaged copy of the model, made in its ``setup``, before the CPU accountant starts:
    it was never counted (every row showed the module alone) and the plan left it no room. The Trainer's callbacks'
    models are learned with the training state now: in every row, and taken off the capacity by the plan."""
    averaging = lightning_class("callbacks", "WeightAveraging")
    model = RecordedBlockStack(optimizer="sgd")
    copy_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + 8  # and its int64 count of averages
    watched = []
    for callbacks in ([], [averaging()]):
        guard = MemGuardCallback(mitigations=(), cpu_sample_every=1, explain=False)
        fit_module(RecordedBlockStack(optimizer="sgd"), [guard, *callbacks], tmp_path / f"watch{len(callbacks)}",
                   max_steps=3)
        watched.append(guard.history.query("phase == 'batch_start'")["allocated_bytes"].tolist())
    assert [averaged - alone for alone, averaged in zip(*watched)] == [copy_bytes] * 3
    peaks = probe_module(RecordedBlockStack(optimizer="sgd"), tmp_path / "probe", 3)
    budget = budget_for_a_share_of_the_step(peaks, 0.6) + copy_bytes
    guard = MemGuardCallback(budget=budget, mitigations=("checkpointing", "microbatch"), explain=False)
    fit_module(RecordedBlockStack(optimizer="sgd"), [guard, averaging()], tmp_path / "guarded", max_steps=4)
    plan = guard.events.query("action == 'plan'")
    assert set(plan["step"]) == {0} and f"the {format_bytes(copy_bytes)} the run holds beside" in plan["reason"].iloc[0]
    assert guard.history["peak_bytes"].max() < 0.9 * budget


# --- checkpoints, early stopping, mid-epoch validation, resume -------------------------------------------------------

class ValidatedStack(RecordedBlockStack):
    """:class:`~tests.models.RecordedBlockStack` (4 batches of 256 an epoch, SGD) with one validation batch of 256
    whose loss it logs as ``val_loss``."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        super().__init__(optimizer="sgd", n_samples=1024)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def val_dataloader(self):
        return DataLoader(regression_dataset(256, 1), batch_size=256)


def checkpointed_fit(model, guard, root, ckpt_path=None, max_epochs=3):
    """A fit validating twice an epoch, saving a checkpoint and ``last.ckpt`` at each validation under
    ``root/checkpoints``, stopped early at the second validation in a row that does not improve by 10 (the third)."""
    callbacks = [lightning_class("callbacks", "ModelCheckpoint")(dirpath=str(root / "checkpoints"), monitor="val_loss",
                                                                 save_top_k=-1, save_last=True),
                 lightning_class("callbacks", "EarlyStopping")(monitor="val_loss", min_delta=10.0, patience=2)]
    return fit_module(model, ([guard] if guard else []) + callbacks, root, ckpt_path=ckpt_path, max_steps=-1,
                      max_epochs=max_epochs, val_check_interval=0.5, num_sanity_val_steps=0,
                      enable_checkpointing=True)


def test_a_fit_stopped_early_mid_epoch_saves_the_levels_and_resumes_at_them(tmp_path, split_budget):
    """Validation after every 2 batches, a checkpoint at each, early stopping at the third (mid-epoch, step 6): the
    guarded fit stops where the unguarded one does, at its parameters; its checkpoint file holds the guard's levels,
    and a fit resumed from it with a new guard goes on split from its first batch (one resume event, no new climb)."""
    reference, model = ValidatedStack(), ValidatedStack()
    checkpointed_fit(reference, None, tmp_path / "plain")
    guard = split_guard(split_budget)
    trainer = checkpointed_fit(model, guard, tmp_path / "guarded")
    assert trainer.should_stop and trainer.global_step == 6
    (_, level), = applied(guard, "microbatch")
    assert_same_parameters(model, reference, atol=1e-6)
    validation = guard.history[guard.history["phase"] == "validation"]
    assert validation["step"].tolist() == [1, 3, 5]  # one row a validation, at the training step it followed

    last = tmp_path / "guarded" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=False)
    assert saved["global_step"] == 6 and saved["epoch"] == 1  # saved mid-epoch
    (state,) = [value for key, value in saved["callbacks"].items() if key.startswith("MemGuardCallback")]
    assert state["ladder"]["levels"] == {"microbatch": level}

    resumed = ValidatedStack(seed=1)
    again = split_guard(split_budget)
    trainer = checkpointed_fit(resumed, again, tmp_path / "resumed", ckpt_path=str(last), max_epochs=2)
    assert trainer.global_step == 8 and again.levels == {"microbatch": level}
    assert again.events[["step", "action"]].values.tolist() == [[6, "resume"]]
    assert resumed.step_sizes == [256 // 2 ** level] * 2 ** level * 2  # the epoch's last 2 batches, split
    assert again.history[again.history["phase"] == "after_optimizer_step"]["step"].tolist() == [6, 7]
    plain_resumed = ValidatedStack(seed=1)
    checkpointed_fit(plain_resumed, None, tmp_path / "plain resumed",
                     ckpt_path=str(tmp_path / "plain" / "checkpoints" / "last.ckpt"), max_epochs=2)
    assert_same_parameters(resumed, plain_resumed, atol=1e-6)  # went on from the saved parameters, split as whole


# --- the learning-rate finder -----------------------------------------------------------------------------------------

def test_a_learning_rate_search_before_the_fit_leaves_the_guards_results_to_the_fit(tmp_path, split_budget):
    """Tuner.lr_find runs its trial steps with every other callback off the Trainer and restores the checkpoint it
    saved at its start: the guard's history and events after the real fit are the fit's (steps from 0, the climb at
    step 0), as after a batch-size search."""
    model = recorded_stack()
    guard = split_guard(split_budget)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=3, callbacks=[guard], logger=False,
                                          default_root_dir=str(tmp_path)))
    lightning_class("tuner", "Tuner")(trainer).lr_find(model, num_training=4, update_attr=True)
    trials = len(model.step_sizes)
    assert trials == 4 and guard.history.empty and guard.events.empty
    trainer.fit(model)
    assert trainer.global_step == 3
    assert sorted(guard.history["step"].unique()) == [0, 1, 2]
    assert guard.events["action"].tolist() == ["threshold", "apply", "keep"] and guard.events["step"].tolist()[0] == 0
    (_, level), = applied(guard, "microbatch")
    assert model.step_sizes[trials:] == [256] + [256 // 2 ** level] * 2 ** level * 2


class WholeBatchOutOfMemory(RecordedBlockStack):
    """:func:`recorded_stack`'s model on a device where only 64 samples fit: a larger batch's training step raises the
    out-of-memory error CUDA would."""

    def training_step(self, batch, batch_idx):
        if len(batch[0]) > 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (only 64 samples fit)")
        return super().training_step(batch, batch_idx)


def learning_rate_search(model, root, how: str, guard=None):
    """The learning-rate search before a fit of 3 steps, by ``how``: ``Tuner.lr_find``, then the fit, or a
    ``LearningRateFinder`` callback (its search in its ``on_fit_start``, before the guard's). Returns the search's
    losses and suggestion."""
    trials = dict(min_lr=1e-4, max_lr=1.0, early_stop_threshold=None)
    callbacks = [guard] if guard is not None else []
    if how == "callback":
        finder = lightning_class("callbacks", "LearningRateFinder")(num_training_steps=14, **trials)
        callbacks.append(finder)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=3, callbacks=callbacks, logger=False, default_root_dir=str(root)))
    if how == "tuner":
        found = lightning_class("tuner", "Tuner")(trainer).lr_find(model, num_training=14, **trials)
    trainer.fit(model)
    assert trainer.global_step == 3
    if how == "callback":
        found = finder.optimal_lr
    return found.results["loss"], found.suggestion()


@pytest.mark.parametrize("how", ["tuner", "callback"])
def test_a_learning_rate_search_before_the_fit_on_batches_that_do_not_fit_runs_them_split(tmp_path, how):
    """Lightning runs a tuner's callbacks before every other, so the search's trial steps came before the guard's
    fit began: whole batches that do not fit ended the run before its first step. Now the guard begins the fit for
    the search: the first trial's OOM is rescued in parts, the trials run split and the search finds what it finds on
    a device where the batch fits; the fit starts at that level and runs no whole batch."""
    losses, suggestion = learning_rate_search(recorded_stack(4096), tmp_path / "fits", how)
    torch.manual_seed(0)
    model = WholeBatchOutOfMemory(optimizer="sgd", n_samples=4096)  # recorded_stack(4096)'s weights and optimizer
    guard = MemGuardCallback(mitigations=("microbatch",), budget="1GiB", plan_at_start=False, explain=False)
    split_losses, split_suggestion = learning_rate_search(model, tmp_path / "split", how, guard)
    torch.testing.assert_close(split_losses, losses, atol=1e-5, rtol=1e-5)
    assert split_suggestion == pytest.approx(suggestion)
    assert guard.levels["microbatch"] >= 2 and max(model.step_sizes) <= 64
    assert len(model.step_sizes) == (14 + 3) * 2 ** guard.levels["microbatch"]  # every trial and step, split


def fit_after_searches(root, learning_rate: Optional[str]):
    """A fit of 3 steps under a 16 MiB budget (and CPU hard limit) after a batch-size search, with a learning-rate
    search ``"before"`` or ``"after"`` it, or none. Returns the batch size picked and the guard."""
    limit = "16MiB"
    guard = MemGuardCallback(budget=limit, cpu_hard_limit=limit, explain=False)
    finders = [lightning_class("callbacks", "BatchSizeFinder")(mode="power", init_val=16, max_trials=10,
                                                               steps_per_trial=2)]
    if learning_rate is not None:
        rates = lightning_class("callbacks", "LearningRateFinder")(num_training_steps=12, early_stop_threshold=None)
        finders.insert(0 if learning_rate == "before" else 1, rates)
    model = BlockStack(width=64, depth=4, batch_size=16, n_samples=8192)
    assert fit_module(model, [guard, *finders], root, max_steps=3).global_step == 3
    return model.hparams.batch_size, guard


@pytest.mark.parametrize("learning_rate", ["before", "after"])
def test_both_searches_before_the_fit_pick_the_batch_size_that_fits_without_the_ladder(tmp_path, learning_rate):
    """A learning-rate search that runs first begins the fit, the guard's closures on the loop: the batch-size
    search after it still runs its trials as Lightning makes them (an out-of-memory trial reaches the finder, not
    the ladder), so it picks the size it picks alone, which the fit runs as it is."""
    alone, _ = fit_after_searches(tmp_path / "alone", None)
    size, guard = fit_after_searches(tmp_path / "both", learning_rate)
    assert 16 < size == alone < 8192  # the search ended at an out-of-memory trial
    assert guard.events.empty  # no rescue, no rung: the picked batch fits the budget as it is
    assert guard.history["peak_bytes"].max() <= 16 * 2**20


def test_a_learning_rate_search_in_the_middle_of_a_fit_is_not_a_resume_nor_the_next_steps_memory(tmp_path,
                                                                                                  split_budget):
    """A LearningRateFinder run at the start of the second epoch (Lightning's documented fine-tuning pattern) runs its
    trials through the guard's closures at its levels (split) and ends by restoring the checkpoint it saved, with
    the guard's state in it: that used to read as a resumed run (a ``resume`` event mid-fit), and the trials' peak
    landed in the next step's ``batch_start`` row."""

    class SearchAtEpochOne(lightning_class("callbacks", "LearningRateFinder")):
        def on_fit_start(self, trainer, pl_module):
            return

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:
                self.lr_find(trainer, pl_module)

    model = recorded_stack()  # 4 batches an epoch
    guard = split_guard(split_budget)
    finder = SearchAtEpochOne(num_training_steps=3)
    trainer = fit_module(model, [guard, finder], tmp_path, max_steps=6)
    assert trainer.global_step == 6 and finder.optimal_lr is not None and finder.optimal_lr.results["lr"]
    assert guard.events["action"].tolist() == ["threshold", "apply", "keep"]  # no resume
    (_, level), = applied(guard, "microbatch")
    assert guard.levels == {"microbatch": level}
    assert model.step_sizes[0] == 256 and set(model.step_sizes[1:]) == {256 // 2 ** level}  # the trials split too
    assert len(model.step_sizes) > 1 + 5 * 2 ** level  # steps 1 to 5 and at least one trial
    starts = guard.history[guard.history["phase"] == "batch_start"].set_index("step")["peak_bytes"]
    after_backward = guard.history[guard.history["phase"] == "after_backward"]["peak_bytes"]
    assert starts[4] < after_backward.min()  # what the step began with, not a trial's backward
