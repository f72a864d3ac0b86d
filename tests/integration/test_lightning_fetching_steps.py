"""MemGuardCallback where the module's steps fetch their own batches (``training_step(self, dataloader_iter)``,
Lightning's flavor for prefetching by hand), in real CPU Trainers. Lightning's loop then hands the step an iterator
instead of a batch and its hooks the batch fetched last (none at the first step): every step ended in a KeyError of
MemGuard's. Now such a step is measured, planned from the first batch its hooks see, run whole (there is no batch in
hand to split), and run again after an OOM or a rung that broke it on the very batches it fetched — none skipped."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_memguard import MemGuardCallback, MemGuardOutOfMemoryError
from tests.helpers import assert_same_state, budget_for_a_share_of_the_step, fit_module, probe_module
from tests.models import BlockStack, regression_dataset


class FetchingStack(BlockStack):
    """:class:`BlockStack` (4 blocks of 64, batches of 256, Adam) whose training step fetches its batch itself and
    records the first value of each batch it fetched; a rung can break the step right after the fetch. ``manual``:
    the step runs its backward and optimizer itself."""

    broken = False

    def __init__(self, manual: bool = False, batch_size: int = 256) -> None:
        torch.manual_seed(0)
        super().__init__(depth=4, batch_size=batch_size, n_samples=16 * batch_size, optimizer="adam", log_loss=False)
        self.automatic_optimization = not manual
        self.fetched: list[float] = []

    def training_step(self, dataloader_iter):
        batch, batch_idx, _ = next(dataloader_iter)
        self.fetched.append(batch[0][0, 0].item())
        if self.broken:
            raise RuntimeError("the rung broke the step")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, batch_size=len(x))
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


def loader_firsts(n: int, batch_size: int = 256) -> list[float]:
    """The first value of each of the first ``n`` batches of :class:`FetchingStack`'s loader."""
    loader = FetchingStack(batch_size=batch_size).train_dataloader()
    return [batch[0][0, 0].item() for batch, _ in zip(loader, range(n))]


def test_a_step_that_fetches_its_own_batches_is_measured_planned_and_kept_under_its_budget(tmp_path):
    peaks = probe_module(FetchingStack(), tmp_path / "probe", 6)
    assert set(peaks.history["phase"]) >= {"batch_start", "after_forward", "after_backward", "after_optimizer_step"}
    budget = budget_for_a_share_of_the_step(peaks, 0.6)
    guard = MemGuardCallback(budget=budget, mitigations=("checkpointing", "microbatch"), explain=False)
    reference, model = FetchingStack(), FetchingStack()
    fit_module(reference, [], tmp_path / "plain", max_steps=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit_module(model, [guard], tmp_path / "guarded", max_steps=6)
    assert trainer.global_step == 6
    said = [str(w.message) for w in caught if "microbatch rung is off" in str(w.message)]
    assert len(said) == 1 and "dataloader_iter" in said[0]
    # the hooks see no batch at step 0: the plan is made from the first they see, the batch fetched at step 0
    events = guard.events
    plans = events[events["action"] == "plan"]
    assert plans["step"].tolist() == [1] and plans["rung"].tolist() == ["checkpointing"]
    history = guard.history
    planned = history[history["step"] >= 2]
    assert planned["peak_bytes"].max() <= 0.9 * budget
    # the estimate made at step 1's start is MemGuard's own, not counted into the step's batch-start peak
    starts = history[history["phase"] == "batch_start"].set_index("step")["peak_bytes"]
    assert starts[1] <= starts[2] * 1.01
    assert model.fetched == loader_firsts(6)
    assert_same_state(model, reference)  # checkpointing is exact, and every batch ran once


class BreakingRung:
    """A rung whose level 1 breaks the module's step (after its fetch), as an op autocast cannot run would."""

    name, levels = "breaking", 1

    def apply(self, module, level):
        module.broken = bool(level)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_step_a_rung_broke_runs_again_on_the_batch_it_fetched(tmp_path, manual):
    from lightning_memguard import Rung

    class Breaking(BreakingRung, Rung):
        pass

    peaks = probe_module(FetchingStack(manual), tmp_path / "probe", 6)
    reference, model = FetchingStack(manual), FetchingStack(manual)
    fit_module(reference, [], tmp_path / "plain", max_steps=6)
    guard = MemGuardCallback(budget=budget_for_a_share_of_the_step(peaks, 0.6), mitigations=(Breaking(),),
                             explain=False)
    trainer = fit_module(model, [guard], tmp_path / "guarded", max_steps=6)
    assert trainer.global_step == 6
    events = guard.events
    assert events[events["rung"] == "breaking"]["action"].tolist() == ["apply", "revert"]
    # the broken attempt fetched its step's batch (what it appended to the module's list was put back with the rest
    # of its state); the run again met that batch, not the next one: each batch once, in the loader's order
    assert model.fetched == loader_firsts(6)
    assert_same_state(model, reference)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_an_oom_in_a_step_that_fetches_its_own_batches_is_rescued_on_the_batch_it_fetched_at_once(tmp_path, manual):
    """Its hooks saw no batch to plan from, so the first step runs out of memory: it runs again on the batch it
    fetched, and — that batch noted from the failed attempt, so the rescue predicts what fits — one OOM is enough
    (climbing a checkpointed block an OOM took three here)."""
    history = probe_module(FetchingStack(manual, batch_size=2048), tmp_path / "probe", 4).history
    limit = int(0.6 * history.query("step == 0")["peak_bytes"].max())  # activations dominate: all steps alike
    guard = MemGuardCallback(budget=limit, cpu_hard_limit=limit, mitigations=("checkpointing",), explain=False)
    model = FetchingStack(manual, batch_size=2048)
    trainer = fit_module(model, [guard], tmp_path / "guarded", max_steps=4)
    assert trainer.global_step == 4
    rescues = guard.events.query("action == 'rescue'")
    assert rescues["step"].tolist() == [0] and rescues["level"].item() >= 2
    assert guard.history["num_ooms"].max() == 1
    assert model.fetched == loader_firsts(4, batch_size=2048)  # its batch again (the failed attempt's record put
    # back with its state), then on in order


class FetchingEvaluation(BlockStack):
    """:class:`BlockStack` whose validation step fetches its batch itself and holds 4 MiB a sample beside it."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(depth=2, batch_size=64, n_samples=256, log_loss=False)

    def validation_step(self, dataloader_iter):
        batch, _, _ = next(dataloader_iter)
        x, y = batch
        held = torch.empty(len(x), 1024 * 1024)
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y) + held[0, 0] * 0, batch_size=len(x))

    def val_dataloader(self):
        return DataLoader(regression_dataset(64, 1), batch_size=32)


def test_an_evaluation_step_that_fetches_its_own_batches_is_measured_and_its_oom_explained(tmp_path):
    guard = MemGuardCallback(budget="1GiB", mitigations=(), explain=False)
    fit_module(FetchingEvaluation(), [guard], tmp_path / "measured", max_steps=2, num_sanity_val_steps=0,
               val_check_interval=2)
    validation = guard.history[guard.history["phase"] == "validation"]
    assert len(validation) == 2 and (validation["peak_bytes"] >= 32 * 4 * 1024 * 1024).all()
    limit = 64 * 1024 * 1024  # under one batch's 128 MiB held
    guard = MemGuardCallback(budget=limit, cpu_hard_limit=limit, mitigations=(), explain=False)
    with pytest.raises(MemGuardOutOfMemoryError, match="fetches its own batches .*dataloader_iter"):
        fit_module(FetchingEvaluation(), [guard], tmp_path / "limited", max_steps=2, num_sanity_val_steps=0,
                   val_check_interval=2)
