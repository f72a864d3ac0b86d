"""The guard is never the reason a run dies or gets worse, the same in every front door (the Lightning callback, the
plain-loop guard, the Fabric guard): a rung that breaks the model is reverted and the batch runs again, a rung that
raises memory is reverted, a rung that changes nothing is not called helpful, and a failed attempt's buffer updates
are undone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memguard.mitigations.checkpointing import checkpoint_module, is_checkpointed
from tests.helpers import DOORS, assert_same_state, probe, run, train_unguarded
from tests.models import BatchNormStack, LinearStack, regression_batches


def set_batch_index(model: nn.Module, index: int) -> None:
    model.batch_index = index


def fit(door: str, model: nn.Module, data: list, root, optimizer: str = "sgd", **settings):
    """Trains ``model`` on ``data`` through ``door`` (the model knows which batch it runs)."""
    return run(door, model, data, root, optimizer=optimizer, before_batch=set_batch_index, **settings)


def unguarded(model: nn.Module, data: list, optimizer: str = "sgd") -> nn.Module:
    return train_unguarded(model, data, optimizer=optimizer, before_batch=set_batch_index)


def step0_peak(door: str, make_model, data: list, root, optimizer: str = "sgd") -> int:
    """The first step's highest phase peak through ``door``, measured by a monitoring-only guard."""
    return probe(door, make_model(), data[:1], root / "probe", optimizer=optimizer,
                 before_batch=set_batch_index).highest()


# --- a rung that breaks the model ---------------------------------------------------------------------------------
# FragileBlock and FragileStack stay here: they break under checkpointing on purpose, for this file's tests only
class FragileBlock(nn.Module):
    """A residual MLP block that raises when it runs inside backward (a checkpointed recomputation) once the model
    reached ``fail_from`` batches: the model trains fine unless MemGuard checkpoints it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        root = self.root_ref()
        if torch._C._current_graph_task_id() != -1 and root.batch_index >= root.fail_from:
            raise RuntimeError("this block cannot be recomputed")
        return x + self.down(torch.relu(self.up(x)))


class FragileStack(nn.Module):
    def __init__(self, fail_from: int, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fail_from, self.batch_index = fail_from, 0
        self.inp = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[FragileBlock(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)
        for block in self.blocks:
            block.root_ref = lambda: self

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


@pytest.mark.parametrize("door", DOORS)
def test_a_rung_that_breaks_the_step_is_reverted_and_the_batch_runs_again(tmp_path, door):
    data = regression_batches(4)
    peak = step0_peak(door, lambda: FragileStack(fail_from=99), data, tmp_path)
    model = FragileStack(fail_from=1)  # the first batch's estimate and step 0 run; step 1's recomputation raises
    # no plan before the first step: the rung must first run at step 1, where the model breaks under it
    result = fit(door, model, data, tmp_path / "run", budget=int(peak / 0.95), mitigations=("checkpointing",),
                 cpu_sample_every=1, plan_at_start=False)
    events = result.guard.events
    applied = events.query("action == 'apply' and rung == 'checkpointing'")
    reverted = events.query("action == 'revert' and rung == 'checkpointing'")
    assert list(applied["step"]) == [0] and list(reverted["step"]) == [1]
    assert "broke the step (RuntimeError: this block cannot be recomputed)" in reverted["reason"].iloc[0]
    assert len(result.warnings_with("broke the step")) == 1
    assert not any(is_checkpointed(b) for b in model.blocks) and result.guard.levels["checkpointing"] == 0
    assert sorted(result.guard.history["step"].unique()) == [0, 1, 2, 3]  # no batch skipped
    assert_same_state(model, unguarded(FragileStack(fail_from=99), data))


@pytest.mark.parametrize("door", ["lightning", "loop"])
def test_a_rung_whose_prediction_fails_is_never_applied(tmp_path, door):
    data = regression_batches(3)
    peak = step0_peak(door, lambda: FragileStack(fail_from=99), data, tmp_path)
    model = FragileStack(fail_from=0)  # checkpointed, it fails already in the first batch's estimate
    result = fit(door, model, data, tmp_path / "run", budget=int(peak / 0.95), mitigations=("checkpointing",),
                 cpu_sample_every=1)
    off = result.warnings_with("the checkpointing rung is off for this run")
    assert [s for s in off if "cannot be recomputed" in s]
    assert result.guard.events.query("rung == 'checkpointing' and action in ('apply', 'rescue')").empty
    assert_same_state(model, unguarded(FragileStack(fail_from=99), data))


# --- the judge compares like with like ----------------------------------------------------------------------------
def wide_stack() -> nn.Module:
    """Six 1024-wide linear blocks: parameters and gradients dwarf the activations of small batches."""
    return LinearStack(width=1024, depth=6, features=16, outputs=1)


@pytest.mark.parametrize("rung, batch_size", [
    # checkpointing six blocks of a batch of 4 saves a few KiB of activations next to 24 MiB of gradients: the
    # estimate says so, and it is passed over rather than tried
    ("checkpointing", 4),
    # bf16 weight copies of a parameter-heavy model outweigh the activations they halve: memory rises
    ("amp", 8),
], ids=["changes-nothing", "raises-memory"])
@pytest.mark.parametrize("door", DOORS)
def test_a_rung_that_does_not_lower_the_peak_is_never_kept_as_helpful(tmp_path, door, rung, batch_size):
    data = regression_batches(3, size=batch_size)
    peak = step0_peak(door, wide_stack, data, tmp_path, optimizer="plain sgd")
    result = fit(door, wide_stack(), data, tmp_path / "run", optimizer="plain sgd", budget=int(peak / 0.95),
                 mitigations=(rung,), cpu_sample_every=1)
    events = result.guard.events
    assert result.guard.levels[rung] == 0
    if rung == "checkpointing":
        # the estimate puts every block checkpointed at the peak as it is: not tried for a step, nothing to revert
        assert events.query("action in ('apply', 'keep', 'revert')").empty, events
        assert "exhausted" in set(events["action"])
        return
    assert list(events.query("action == 'apply'")["rung"]) == [rung]
    judged = events.query("action in ('keep', 'revert')")
    assert list(judged["action"]) == ["revert"], judged["reason"].tolist()


# --- a failed attempt's buffer updates are undone -----------------------------------------------------------------
def steady_peak(door: str, model: nn.Module, data: list, root) -> int:
    return probe(door, model, data, root).highest()


@pytest.mark.parametrize("door", DOORS)
def test_a_rescued_batch_updates_batchnorm_statistics_once(tmp_path, door):
    data = regression_batches(3)
    plain = steady_peak(door, BatchNormStack(), data, tmp_path / "plain")
    checkpointed = BatchNormStack()
    for block in checkpointed.blocks:
        checkpoint_module(block)
    low = steady_peak(door, checkpointed, data, tmp_path / "low")
    assert low < 0.8 * plain
    limit = (plain + low) // 2  # only a checkpointed step fits: the first attempt runs out of memory mid-step
    model = BatchNormStack()
    result = fit(door, model, data, tmp_path / "run", budget=limit, cpu_hard_limit=limit,
                 mitigations=("checkpointing",), cpu_sample_every=1, plan_at_start=False)  # a rescue, not the plan
    events = result.guard.events
    assert list(events.query("action == 'rescue'")["step"]) == [0] and result.guard.levels["checkpointing"] > 0
    reference = unguarded(BatchNormStack(), data)
    assert int(model.blocks[0].norm.num_batches_tracked) == len(data)  # once per step, as unguarded
    assert_same_state(model, reference)  # running means and variances included
