"""MemGuardCallback beside Lightning's own training tools, in real CPU Trainers, with a budget small enough that the
ladder acts: an accumulation schedule that changes mid-fit and gradient clipping (norm and value) under micro-batching,
stochastic weight averaging with blocks checkpointed, checkpoints, early stopping and mid-epoch validation with a
resume from the saved file, and the learning-rate finder. Micro-batching and checkpointing change no arithmetic the
optimizer sees (LayerNorm, no dropout, SGD), so the guarded runs end at an unguarded run's parameters."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_memguard import MemGuardCallback
from tests.helpers import assert_same_parameters, budget_for_a_share_of_the_step, fit_module, probe_module
from tests.models import RecordedBlockStack, lightning_class


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
