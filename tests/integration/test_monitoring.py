"""A real Trainer on CPU with real loggers; the files they write are read back."""

import csv
import logging
import os
import re
import warnings

import pandas as pd
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.util import tensor_util

from lightning_memguard import PHASES, MemGuardCallback
from tests.helpers import fit_module, probe, run
from tests.models import BlockStack, Stack, lightning_class, regression_batches

CSVLogger = lightning_class("loggers", "CSVLogger")
TensorBoardLogger = lightning_class("loggers", "TensorBoardLogger")


def event_accumulator(log_dir):
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_gets_every_phase_on_the_user_step_axis(tmp_path):
    guard = MemGuardCallback(cpu_sample_every=1)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = fit_module(BlockStack(), guard, tmp_path, logger=logger, max_steps=6, log_every_n_steps=2)
    acc = event_accumulator(logger.log_dir)
    tags = set(acc.Tags()["scalars"])
    user_steps = [e.step for e in acc.Scalars("train_loss")]
    assert user_steps == [1, 3, 5]
    for phase in PHASES:
        for quantity in ("allocated", "peak"):
            events = acc.Scalars(f"memguard/{phase}/{quantity}_GiB")
            assert [e.step for e in events] == user_steps, (phase, quantity)
            assert all(e.value > 0 for e in events)
    assert "memguard/reserved_GiB" not in tags  # CPU has no allocator cache: no fake zeros
    # the custom-scalars layout is in the event file, and its memory chart matches the logged GiB curves
    layout = layout_pb2.Layout()
    config = acc.Tensors("custom_scalars__config__")[0]
    layout.ParseFromString(tensor_util.make_ndarray(config.tensor_proto).item())
    (category,) = layout.category
    assert category.title == "memguard"
    pattern = re.compile(category.chart[0].multiline.tag[0])
    assert {t for t in tags if pattern.fullmatch(t)} == {t for t in tags if t.endswith("_GiB")}
    assert trainer.global_step == 6


def test_history_csv_matches_the_dataframe(tmp_path):
    guard = MemGuardCallback(cpu_sample_every=1)
    trainer = fit_module(BlockStack(), guard, tmp_path, logger=CSVLogger(str(tmp_path)), max_steps=5)
    history = guard.history
    assert len(history) == 5 * len(PHASES)
    assert list(history["phase"][:4]) == list(PHASES)
    assert sorted(set(history["step"])) == [0, 1, 2, 3, 4]
    assert history["device"].eq("cpu").all()
    assert history["nvml_used_bytes"].isna().all()
    path = os.path.join(trainer.log_dir, "memguard_history.csv")
    from_csv = pd.read_csv(path)
    assert len(from_csv) == len(history)
    assert (from_csv["peak_bytes"].to_numpy() == history["peak_bytes"].to_numpy()).all()
    # the real CSVLogger got our keys too, at the same steps as train_loss
    metrics = pd.read_csv(os.path.join(trainer.log_dir, "metrics.csv"))
    ours = metrics.dropna(subset=["memguard/after_forward/peak_GiB"])
    assert list(ours["step"]) == [0, 1, 2, 3, 4]


def test_larger_activations_show_a_larger_forward_peak(tmp_path):
    peaks = {}
    for batch_size in (32, 256):
        guard = MemGuardCallback(cpu_sample_every=1)
        fit_module(BlockStack(batch_size=batch_size), guard, tmp_path / str(batch_size), logger=False, max_steps=3)
        history = guard.history
        rows = history[history["step"] == 2].set_index("phase")
        peaks[batch_size] = int(rows.loc["after_forward", "peak_bytes"])
        peaks[batch_size, "graph"] = peaks[batch_size] - int(rows.loc["batch_start", "allocated_bytes"])
    assert peaks[256] > peaks[32]
    # what the forward added on top of weights and optimizer state grows with the batch: 8x the samples
    assert 6 * peaks[32, "graph"] < peaks[256, "graph"] < 10 * peaks[32, "graph"]


def test_forward_peak_matches_the_activations_autograd_saves(tmp_path):
    """The accounted after_forward allocation minus batch_start is what the graph holds: compare it with the bytes
    autograd's saved-tensor hooks see for the same model and batch."""
    model = BlockStack(batch_size=128, depth=4)
    guard = MemGuardCallback(cpu_sample_every=1)
    fit_module(model, guard, tmp_path, logger=False, max_steps=2)
    history = guard.history.set_index(["step", "phase"])
    graph_bytes = history.loc[(1, "after_forward"), "allocated_bytes"] - history.loc[(1, "batch_start"),
                                                                                     "allocated_bytes"]
    x, _ = next(iter(model.train_dataloader()))
    saved = {}

    def pack(t):
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    not_activations = {t.untyped_storage()._cdata for t in [x, *model.parameters()]}
    activation_bytes = sum(n for key, n in saved.items() if key not in not_activations)
    # Lightning zeroes gradients (set to None) after the forward and before on_before_backward, so at the
    # after_forward boundary the previous step's gradients (one copy of the parameters) are gone.
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # besides saved activations the graph keeps the output and the loss: a few bytes per sample
    assert 0 <= graph_bytes + gradient_bytes - activation_bytes <= 128 * 8 + 64
    del out


def test_gradient_accumulation_gives_one_row_per_phase_per_optimizer_step(tmp_path):
    guard = MemGuardCallback(cpu_sample_every=1)
    fit_module(BlockStack(), guard, tmp_path, logger=False, max_steps=3, accumulate_grad_batches=3)
    history = guard.history
    assert sorted(set(history["step"])) == [0, 1, 2]
    rows = history.set_index(["step", "phase"])
    # the step's three micro-batches on each of its rows, its one optimizer step's too
    assert rows.loc[1, "micro_batches"].tolist() == [3, 3, 3, 3]


class ManualStack(BlockStack):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        if batch_idx % 2 == 1:  # steps every other batch
            optimizer.step()
        return loss


def test_manual_optimization_records_the_boundaries_that_exist(tmp_path):
    guard = MemGuardCallback(cpu_sample_every=1)
    trainer = fit_module(ManualStack(), guard, tmp_path, logger=False, max_steps=2, limit_train_batches=6)
    history = guard.history
    assert trainer.global_step == 2
    assert {"batch_start", "after_forward", "after_backward", "after_optimizer_step"} <= set(history["phase"])
    assert (history["peak_bytes"] > 0).all()


def test_under_a_budget_a_step_that_optimizes_itself_has_its_levels_predicted(tmp_path):
    """The rung levels are predicted from estimates of the step, which run it with its optimizers and backward stood
    in for: a step that optimizes manually was named as why they could not be."""
    guard = MemGuardCallback(budget="64MiB", mitigations=("checkpointing",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit_module(ManualStack(), guard, tmp_path, logger=False, max_steps=2, limit_train_batches=6)
    assert trainer.global_step == 2
    assert not [str(w.message) for w in caught if "cannot be predicted" in str(w.message)]


def test_logger_false_is_said_once_as_a_notice_and_the_csv_is_still_written(tmp_path, caplog):
    guard = MemGuardCallback(cpu_sample_every=1)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        trainer = fit_module(BlockStack(), guard, tmp_path, logger=False, max_steps=2)
    assert not [w for w in caught if "logger" in str(w.message)]
    assert len([r for r in caplog.records if "logging is off for the Trainer" in r.getMessage()]) == 1
    with open(os.path.join(trainer.default_root_dir, "memguard_history.csv")) as f:
        assert len(list(csv.DictReader(f))) == 2 * len(PHASES)


def test_fit_twice_with_the_same_callback(tmp_path):
    guard = MemGuardCallback(cpu_sample_every=1)
    model = BlockStack()
    fit_module(model, guard, tmp_path / "a", logger=False, max_steps=2)
    fit_module(model, guard, tmp_path / "b", logger=False, max_steps=4)
    assert len(guard.history) > 0
    assert not guard.source.started  # the dispatch mode was left


def test_crash_mid_epoch_keeps_the_rows_up_to_the_last_interval(tmp_path):
    class Crashes(BlockStack):
        def training_step(self, batch, batch_idx):
            if batch_idx == 5:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    guard = MemGuardCallback(cpu_sample_every=1)
    with pytest.raises(RuntimeError, match="boom"):
        fit_module(Crashes(), guard, tmp_path, logger=False, max_steps=10, log_every_n_steps=2)
    rows = pd.read_csv(tmp_path / "memguard_history.csv")
    assert sorted(set(rows["step"])) == [0, 1, 2, 3, 4, 5]  # steps 0-4 complete, step 5's batch_start too
    assert len(rows[rows["step"] == 4]) == len(PHASES)


def test_sampled_cpu_counting_matches_counting_every_step(tmp_path):
    """Counting every 3rd step re-tracks what was created while counting was off (gradients, optimizer state,
    the batch), so its rows equal those of counting every step, up to the few bytes of small tensors that other
    objects keep across steps (Lightning keeps the last logged loss, a 4-byte scalar)."""
    dense, sampled = MemGuardCallback(cpu_sample_every=1), MemGuardCallback(cpu_sample_every=3)
    for name, guard in (("dense", dense), ("sampled", sampled)):
        fit_module(BlockStack(optimizer="adam"), guard, tmp_path / name, logger=False, max_steps=7)
    dense_rows, sampled_rows = dense.history.set_index(["step", "phase"]), sampled.history.set_index(["step", "phase"])
    assert sorted(set(sampled.history["step"])) == [0, 3, 6]
    for step in (3, 6):
        for phase in PHASES:
            for column in ("allocated_bytes", "peak_bytes"):
                if column == "peak_bytes" and phase == "batch_start":
                    continue  # the first window after a gap starts at the re-tracked total
                difference = sampled_rows.loc[(step, phase), column] - dense_rows.loc[(step, phase), column]
                assert -64 <= difference <= 0, (step, phase, column)


def test_default_samples_every_fourth_step_without_budget_and_every_step_with_one():
    assert MemGuardCallback().cpu_sample_every == 4
    assert MemGuardCallback(budget="1GiB").cpu_sample_every == 1
    assert MemGuardCallback(cpu_hard_limit="1GiB").cpu_sample_every == 1


def test_progress_bar_shows_the_peak_share_of_capacity(tmp_path):
    guard = MemGuardCallback(budget="64MiB", mitigations=())
    trainer = fit_module(BlockStack(), guard, tmp_path, logger=False, max_steps=3, enable_progress_bar=True)
    history = guard.history
    last = history[history["step"] == 2]
    expected = round(100 * last["peak_bytes"].max() / (64 * 2**20), 1)
    assert trainer.progress_bar_metrics["mem%"] == pytest.approx(expected)
    quiet = MemGuardCallback(budget="64MiB", mitigations=(), progress_bar=False)
    trainer = fit_module(BlockStack(), quiet, tmp_path / "off", logger=False, max_steps=3, enable_progress_bar=True)
    assert "mem%" not in trainer.progress_bar_metrics
    # a Trainer without a progress bar: nothing to show it in, and self.log costs ~1 ms a call on a slow core
    trainer = fit_module(BlockStack(), MemGuardCallback(budget="64MiB", mitigations=()), tmp_path / "no_bar",
                         logger=False, max_steps=3)
    assert "mem%" not in trainer.progress_bar_metrics


def test_events_reach_tensorboard_as_rung_scalars_and_text(tmp_path):
    data = regression_batches(5, size=256)
    plain = probe("lightning", Stack(), data[:3], tmp_path / "probe").highest(from_step=1)
    # the plain step crosses the threshold (0.9) of this budget: checkpointing engages
    result = run("lightning", Stack(), data, tmp_path / "run", budget=int(plain / 0.95), mitigations=("checkpointing",))
    applied = result.guard.events[result.guard.events["action"] == "apply"]
    assert len(applied) >= 1
    acc = event_accumulator(result.log_dir)
    rung = {e.step: e.value for e in acc.Scalars("memguard/rung/checkpointing")}
    first = int(applied["step"].iloc[0])
    assert rung[first] == applied["level"].iloc[0]  # the level after the action, at the step it was taken
    texts = [tensor_util.make_ndarray(e.tensor_proto).item().decode()
             for e in acc.Tensors("memguard/events/text_summary")]
    assert any("apply checkpointing" in t for t in texts)
