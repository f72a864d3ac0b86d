"""Several rungs put on together (the first batch's plan: all blocks checkpointed *and* micro-batches), one of which
breaks the model: the one that broke it is found and turned off for the run, the others keep their levels. All of
them were turned off before, with the memory the plan needed. Real fits through the Lightning callback and the
plain-loop guard; the models break only where a rung really changes what they run (a checkpointed recomputation, a
micro-batch), and only the trained model, never the estimate's copy of it (whose prediction would keep the rung off)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import assert_same_parameters, probe, run, train_unguarded
from tests.models import regression_batches

LADDER = ("checkpointing", "microbatch")  # no AMP: the runs compare parameters with unguarded training
_TRAINED: list[nn.Module] = []  # the models the tests train (a copy is never among them)


class BreakableBlock(nn.Module):
    """A residual MLP block that raises, where its model says so, when it is recomputed (under the checkpointing
    rung) or when it runs a part of the batch (under the micro-batch rung)."""

    def __init__(self, width: int, owner: "BreakableStack") -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.owner = [owner]  # in a list: not a submodule (a copy's list holds the copy)

    def forward(self, x):
        owner = self.owner[0]
        if any(owner is model for model in _TRAINED):
            if owner.breaks == "checkpointing" and torch._C._current_graph_task_id() != -1:
                raise RuntimeError("this block cannot be recomputed")
            if owner.breaks == "microbatch" and x.shape[0] != owner.batch_size:
                raise RuntimeError(f"this model is built for batches of {owner.batch_size}")
        return x + self.down(torch.relu(self.up(x)))


class BreakableStack(nn.Module):
    def __init__(self, breaks: str = "", batch_size: int = 0, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.breaks, self.batch_size = breaks, batch_size
        self.inp = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[BreakableBlock(width, self) for _ in range(depth)])
        self.head = nn.Linear(width, 1)
        if breaks:
            _TRAINED.append(self)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def fit_planned(door: str, breaks: str, tmp_path, mitigations=LADDER):
    """A fit under half the monitored peak, where the plan puts on every block checkpointed and 2 or 4 micro-batches
    before the first step; the model breaks under the rung named."""
    data = regression_batches(3)
    peak = probe(door, BreakableStack(), data, tmp_path / "probe").highest(1)
    model = BreakableStack(breaks, batch_size=len(data[0][0]))
    result = run(door, model, data, tmp_path / "run", budget=int(peak / 2), mitigations=mitigations, explain=False)
    events = result.guard.events
    plan = events[events["action"] == "plan"]
    assert set(plan["rung"]) >= set(LADDER), plan  # the premise: the rungs go on together
    return result, events[events["action"].isin(["revert", "apply"]) & (events["step"] == 0)], data


@pytest.mark.parametrize("door", ["lightning", "loop"])
def test_micro_batches_that_break_the_model_are_found_at_once_and_the_blocks_stay_checkpointed(tmp_path, door):
    """The rung changed last is put back first: the batch then runs, so micro-batching is the culprit."""
    result, changes, data = fit_planned(door, "microbatch", tmp_path)
    assert list(zip(changes["action"], changes["rung"], changes["level"])) == [
        ("revert", "microbatch", 0), ("revert", "microbatch", 0)]
    assert "2 rungs changed together" in changes["reason"].iloc[0]
    assert "broke the step: the batch ran with it back at level 0" in changes["reason"].iloc[1]
    assert result.steps_done == 3 and result.guard.levels["microbatch"] == 0
    assert result.guard.levels["checkpointing"] == 6  # kept: before, every rung changed together was turned off
    assert_same_parameters(result.model, train_unguarded(BreakableStack(), data))


@pytest.mark.parametrize("door", ["lightning", "loop"])
def test_checkpointing_that_breaks_the_model_is_found_by_elimination_and_the_micro_batches_stay(tmp_path, door):
    """Micro-batches put back first and the step fails the same way: they go up again, and checkpointing, the one
    left, is the culprit without another trial."""
    result, changes, data = fit_planned(door, "checkpointing", tmp_path)
    split = int(changes["level"].iloc[1])
    assert list(zip(changes["action"], changes["rung"])) == [
        ("revert", "microbatch"), ("apply", "microbatch"), ("revert", "checkpointing")]
    assert split >= 1 and "not what broke the step" in changes["reason"].iloc[1]
    assert "the others were put back in turn and the step failed the same way" in changes["reason"].iloc[2]
    assert result.steps_done == 3 and result.guard.levels["checkpointing"] == 0
    assert result.guard.levels["microbatch"] >= split  # kept (and raised later where a step needs it)
    assert (result.guard.history["micro_batches"] > 1).all()
    assert len(result.warnings_with("checkpointing at level 6 broke the step")) == 1
    assert_same_parameters(result.model, train_unguarded(BreakableStack(), data))


def test_of_three_rungs_put_on_together_the_one_that_broke_is_found_by_its_trial(tmp_path):
    """AMP, checkpointing and micro-batches planned together: micro-batches (put back: the step still fails, so they
    go up again), then checkpointing (put back: the batch runs, so it is the culprit); AMP is never touched."""
    result, changes, _ = fit_planned("loop", "checkpointing", tmp_path, mitigations=("amp",) + LADDER)
    assert list(zip(changes["action"], changes["rung"])) == [
        ("revert", "microbatch"), ("apply", "microbatch"), ("revert", "checkpointing"), ("revert", "checkpointing")]
    assert "3 rungs changed together" in changes["reason"].iloc[0]
    assert result.steps_done == 3
    assert result.guard.levels["amp"] == 1 and result.guard.levels["checkpointing"] == 0
