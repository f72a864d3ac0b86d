"""Transformers models trained with manual optimization as their users write it: ``automatic_optimization = False``,
``manual_backward``, gradient clipping through ``self.clip_gradients``, AdamW and a warm-up schedule stepped in
``training_step`` (a GPT-2 and a Llama from tiny configs, padded token batches). The estimate runs such a step on
its Trainer-less copy with the optimizers, the backward and the schedulers stood in for: made before training, it
is each phase's peak as a monitor-only guard measures the fit's steps; under a budget it says is too small, the
guard plans before the first step, nothing runs over afterwards, and the model trains as unguarded; on two
``ddp_spawn`` ranks both plan alike."""

import pytest
import torch

from lightning_memguard import MemGuardCallback, estimate_memory
from tests.helpers import assert_same_state, budget_for_a_share_of_the_step, fit_module, probe_module
from tests.models import pl, trainer_kwargs
from tests.ranks import rank_csvs
from tests.spawn import ranks_killed_after
from tests.zoo.models import ZooModule

STEPS = 4
PHASES = {"forward": "after_forward", "backward": "after_backward", "optimizer_step": "after_optimizer_step"}


class OptimizedByHand(ZooModule):
    """A zoo model whose ``training_step`` optimizes it itself: the loss, ``manual_backward``, the gradients clipped to
    norm 1, AdamW's step and a linear warm-up's."""

    def __init__(self, name: str) -> None:
        super().__init__(name, n_batches=STEPS, batch_size=8, optimizer="adamw", lr=1e-3)
        self.automatic_optimization = False

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))]

    def training_step(self, batch, batch_idx):
        optimizer, schedule = self.optimizers(), self.lr_schedulers()
        loss = self.model(**batch).loss
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        optimizer.step()
        schedule.step()
        self.log("train_loss", loss)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_step_optimized_by_hand_is_estimated_before_training_and_planned_under_a_budget(tmp_path, name):
    model = OptimizedByHand(name)
    estimate = estimate_memory(model, model.batches[0])  # the batches are alike: the first stands for them
    peaks = probe_module(OptimizedByHand(name), tmp_path / "probe", STEPS)
    history = peaks.history[peaks.history["step"] >= 1]  # once AdamW's state exists
    for phase, boundary in PHASES.items():
        measured = history[history["phase"] == boundary]["peak_bytes"]
        # the module keeps its other batches (counted by the guard beside the step): the same on every step
        kept = sum(t.numel() * t.element_size() for batch in model.batches[1:] for t in batch.values()
                   if isinstance(t, torch.Tensor))
        assert (measured - kept).tolist() == pytest.approx([estimate.phase_peaks[phase]] * (STEPS - 1), rel=0.01), \
            phase

    reference, guarded = OptimizedByHand(name), OptimizedByHand(name)
    fit_module(reference, [], tmp_path / "plain", max_steps=STEPS)
    guard = MemGuardCallback(budget=budget_for_a_share_of_the_step(peaks, 0.6), mitigations=("checkpointing",),
                             explain=False)
    fit_module(guarded, [guard], tmp_path / "guarded", max_steps=STEPS)
    events = guard.events
    assert events[["step", "action", "rung"]].values.tolist() == [[0, "plan", "checkpointing"]], events
    later = guard.history[guard.history["step"] >= 1].groupby("step")["peak_bytes"].max()
    assert later.max() < guard.budget_bytes * 0.9
    assert_same_state(guarded, reference, atol=1e-6)  # checkpointing recomputes the same ops


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_port")
def test_two_ranks_stepping_by_hand_plan_alike_before_the_first_step(tmp_path):
    """Under ``ddp_spawn`` each rank estimates its own step (DDP's buckets too) with the optimizers stood in for: both
    plan the same checkpointing before the first batch, and nothing runs over the 2.3 MiB budget afterwards (the
    plain step measures ~2.58 MiB a rank)."""
    guard = MemGuardCallback(budget="2.3MiB", mitigations=("checkpointing",), explain=False)
    with ranks_killed_after(240):
        pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path), logger=False,
                   **trainer_kwargs(strategy="ddp_spawn", devices=2, max_steps=STEPS)).fit(OptimizedByHand("gpt2"))
    events = rank_csvs(tmp_path, "memguard_events.csv")
    decisions = {rank: frame[["step", "action", "rung", "level"]].values.tolist() for rank, frame in events.items()}
    assert decisions[0] == decisions[1] and [row[:3] for row in decisions[0]] == [[0, "plan", "checkpointing"]]
    for rank, history in rank_csvs(tmp_path, "memguard_history.csv").items():
        later = history[history["step"] >= 1]["peak_bytes"]
        assert later.max() == pytest.approx(events[rank]["peak_before_bytes"].iloc[0], rel=0.02), rank
