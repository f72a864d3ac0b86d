"""The ladder in a real Trainer on CPU, where only Lightning has the case: warn-only, blocks that match nothing,
plan_at_start, state restored after setup, a second fit of the same model. (The scenarios every front door shares —
engage and keep, revert, cannot-help, AMP, resume, bad settings — are in test_scenarios.py.) Budgets lie between the
probed peaks of the stack, plain and with every block checkpointed."""

import pytest
from torch import nn

from lightning_memguard import MemGuardCallback
from lightning_memguard.mitigations.checkpointing import is_checkpointed
from tests.helpers import budget_crossed_between, checkpoint_every_block, probe, run
from tests.models import BlockStack, Stack, pl, regression_batches, trainer_kwargs

DEPTH = 8


@pytest.fixture(scope="module")
def budget(tmp_path_factory):
    """threshold x budget halfway between the fully checkpointed and the plain steady step peak."""
    root = tmp_path_factory.mktemp("budget")
    plain = probe("lightning", Stack(), regression_batches(3), root / "plain").highest(from_step=1)
    low = probe("lightning", checkpoint_every_block(Stack()), regression_batches(3), root / "low").highest(1)
    assert low < 0.7 * plain  # the model is activation-heavy, as these tests need
    return budget_crossed_between(plain, low), plain, low


def test_warn_only_records_the_crossing_and_changes_nothing(tmp_path, budget):
    capacity, _, _ = budget
    result = run("lightning", Stack(), regression_batches(4), tmp_path, budget=capacity, mitigations=())
    assert list(result.guard.events["action"]) == ["threshold", "exhausted", "explain"]
    assert "warn only" in result.guard.events["reason"].iloc[1]


def test_blocks_that_match_nothing_fail_at_setup_with_the_reason(tmp_path):
    guard = MemGuardCallback(budget="1GiB", blocks={nn.GRU})
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path), logger=False,
                         **trainer_kwargs(max_steps=1))
    with pytest.raises(ValueError, match="no blocks to checkpoint in BlockStack"):
        trainer.fit(BlockStack(width=64, depth=DEPTH, batch_size=512))


def test_plan_at_start_begins_mitigated_so_a_run_that_would_oom_at_once_does_not(tmp_path, budget):
    capacity, _, _ = budget
    # the hard limit is below the plain peak and rescue is off: only the plan can save this run
    result = run("lightning", Stack(), regression_batches(5), tmp_path, budget=capacity, cpu_hard_limit=capacity,
                 plan_at_start=True, rescue_oom=False)
    assert result.steps_done == 5
    guard = result.guard
    plan = guard.events[guard.events["action"] == "plan"]
    assert set(plan["step"]) == {0} and "cheapest configuration" in plan["reason"].iloc[0]
    assert result.seen[0][1] == guard.levels["checkpointing"] or guard.levels["amp"] == 1  # on from the first batch
    peaks = guard.history.groupby("step")["peak_bytes"].max()
    assert (peaks < 0.9 * capacity).all()
    # the estimate it planned with is what the run then measured
    assert plan["peak_before_bytes"].iloc[0] == pytest.approx(peaks.loc[1:].max(), rel=0.05)


def test_state_loaded_after_setup_is_applied_at_once(tmp_path):
    """FSDP and DeepSpeed restore callback state after on_fit_start: the rungs must still be set before a step."""
    model = Stack()
    result = run("lightning", model, regression_batches(1), tmp_path, mitigations=("checkpointing",))
    guard = result.guard
    assert guard.levels == {"checkpointing": 0}
    guard.load_state_dict({"ladder": {"levels": {"checkpointing": 3}}})
    assert guard.levels == {"checkpointing": 3}
    assert [is_checkpointed(b) for b in model.blocks] == [True] * 3 + [False] * (DEPTH - 3)


def test_a_second_fit_of_the_same_model_knows_the_blocks_left_checkpointed(tmp_path, budget):
    capacity, _, _ = budget
    model = Stack()
    first = run("lightning", model, regression_batches(5), tmp_path / "first", budget=capacity,
                mitigations=("checkpointing",))
    level = first.guard.levels["checkpointing"]
    assert level > 0
    again = run("lightning", model, regression_batches(3), tmp_path / "second", budget=capacity,
                mitigations=("checkpointing",))
    assert again.guard.levels["checkpointing"] == level == sum(is_checkpointed(b) for b in model.blocks)
    assert "apply" not in set(again.guard.events["action"])  # nothing to do: already under the threshold
