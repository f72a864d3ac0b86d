"""The ladder holds the levels: its rungs are where they are, the policy decides from them, and a checkpoint saves
them beside the policy's state. Real rungs on a small CPU model; steps scripted as numbers, no Trainer."""

import pytest
import torch

from lightning_memguard.base.snapshot import Event
from lightning_memguard.guard.ladder import Ladder
from lightning_memguard.guard.policy import Decision, StepObservation
from lightning_memguard.mitigations.checkpointing import is_checkpointed
from tests.models import LinearStack

MiB = 2**20
CAP = 100 * MiB

#: What the previous version's ladder saved after the two steps of ``two_steps`` (printed by it, kept as written):
#: a checkpoint of that version must resume.
SAVED_BY_THE_PREVIOUS_VERSION = {
    "levels": {"checkpointing": 5, "microbatch": 0}, "failed": [],
    "trial": {"rung": "checkpointing", "from_level": 2, "to_level": 5, "step": 1, "peak_before": 110100480,
              "static_before": 10485760, "rescued": False, "activation_before": 110100480},
    "warned": ["threshold"], "gain_per_level": {"checkpointing": 7864320.0}, "last_retries": None}


def ladder_for(model, said=None, state=None):
    ladder = Ladder(("checkpointing", "microbatch"), 0.9, None, 0.03,
                    warn=(said if said is not None else []).append)
    ladder.setup(model, torch.device("cpu"), None, state=state)
    return ladder


def obs(step, forward, start=10):
    return StepObservation(step, {"batch_start": start * MiB, "after_forward": forward * MiB}, CAP,
                           static_bytes=start * MiB)


def checkpointed(model):
    return sum(is_checkpointed(block) for block in model.blocks)


def two_steps(ladder):
    """Step 0 over the threshold (checkpointing a quarter of the blocks), step 1 still over it (kept, and raised by
    the measured saving per block)."""
    return ladder.after_step(obs(0, forward=120)) + ladder.after_step(obs(1, forward=105))


def test_the_policys_decisions_set_the_rungs_and_the_next_decision_starts_from_them():
    model = LinearStack()
    ladder = ladder_for(model)
    decisions = two_steps(ladder)
    assert [(d.action, d.rung, d.level) for d in decisions] == [
        ("threshold", "", 0), ("apply", "checkpointing", 2), ("keep", "checkpointing", 2),
        ("apply", "checkpointing", 5)]
    assert ladder.levels == {"checkpointing": 5, "microbatch": 0}
    assert checkpointed(model) == 5  # the level is the rung's: five blocks are checkpointed


def test_a_rung_left_on_by_an_earlier_fit_is_where_the_policy_starts():
    model = LinearStack()
    two_steps(ladder_for(model))
    again = ladder_for(model)  # a second fit of the same model: its blocks are still checkpointed
    assert again.levels["checkpointing"] == 5
    # no measured saving per block in this fit: a quarter of the blocks more, from where the rung is
    assert [(d.action, d.level) for d in again.after_step(obs(0, forward=95))][-1] == ("apply", 7)
    assert checkpointed(model) == 7


def test_the_checkpoint_is_the_levels_beside_the_policys_state_as_the_previous_version_saved_it():
    ladder = ladder_for(LinearStack())
    two_steps(ladder)
    saved = ladder.state_dict()
    # and, since, the configurations the speed trial timed (none here: it is off without a speed_trial setting)
    assert saved.pop("speed_tried") == []
    assert saved == SAVED_BY_THE_PREVIOUS_VERSION


def test_a_checkpoint_of_the_previous_version_resumes_levels_and_measured_savings():
    model = LinearStack()
    resumed = ladder_for(model, state=SAVED_BY_THE_PREVIOUS_VERSION)
    assert resumed.levels == {"checkpointing": 5, "microbatch": 0} and checkpointed(model) == 5
    assert resumed.state_dict()["trial"] is None  # settled: a new process's first step is not comparable
    # the saved 7.5 MiB a block: (100 - 85.5) / 7.5 -> 2 more blocks
    assert [(d.action, d.level) for d in resumed.after_step(obs(2, forward=100))] == [("apply", 7)]


def test_a_rung_that_breaks_the_step_is_reverted_once_and_the_same_error_again_is_the_models():
    model = LinearStack()
    ladder = ladder_for(model)
    ladder.after_step(obs(0, forward=120))
    reverted = ladder.revert_untried(1, "RuntimeError: cannot be recomputed")
    assert [(d.action, d.rung, d.level) for d in reverted] == [("revert", "checkpointing", 0)]
    assert "checkpointing at level 2 broke the step" in reverted[0].reason
    assert checkpointed(model) == 0 and not ladder.usable("checkpointing")
    # the level put back is the one that ran: a second failure is not blamed on a rung
    assert ladder.revert_untried(1, "RuntimeError: cannot be recomputed") == []
    assert ladder.levels["checkpointing"] == 0


def test_a_step_that_ran_takes_the_rungs_off_probation():
    ladder = ladder_for(LinearStack())
    ladder.after_step(obs(0, forward=120))
    ladder.step_ran()
    assert ladder.revert_untried(1, "RuntimeError: the model's own") == []
    assert ladder.levels["checkpointing"] == 2


def test_a_plan_sets_only_usable_rungs():
    model = LinearStack()
    ladder = ladder_for(model)
    ladder.apply_plan({"checkpointing": 3, "amp": 1})  # no AMP rung here: left alone
    assert ladder.levels == {"checkpointing": 3, "microbatch": 0} and checkpointed(model) == 3


def test_the_micro_batch_rung_comes_down_to_what_the_first_batch_allows():
    said = []
    state = {**SAVED_BY_THE_PREVIOUS_VERSION, "levels": {"checkpointing": 0, "microbatch": 5}}
    model = LinearStack()
    ladder = ladder_for(model, said, state)
    ladder.note_batch((torch.randn(4, 8), torch.randn(4, 1)), model, None)
    assert ladder.levels["microbatch"] == 2 and ladder.parts.training() == 4  # one sample each
    assert ladder.policy.max_levels["microbatch"] == 2
    # a batch with no tensor to split: the rung is off, and its level with it
    unsplittable = ladder_for(model, said, state)
    unsplittable.note_batch({"text": "no tensors"}, model, None)
    assert unsplittable.levels["microbatch"] == 0 and unsplittable.parts.training() == 1
    assert [s for s in said if "the microbatch rung is off for this run" in s]


def test_a_decision_is_built_by_keyword_and_becomes_an_event_by_keyword():
    decision = Decision(step=3, action="apply", rung="checkpointing", level=2, reason="over", peak_before_bytes=95,
                        phase="after_forward")
    assert decision.to_event(CAP, 12.5) == Event(step=3, action="apply", rung="checkpointing", reason="over",
                                                 peak_before_bytes=95, peak_after_bytes=None, capacity_bytes=CAP,
                                                 phase="after_forward", level=2, time=12.5)
    assert decision.sets_level and not Decision(step=3, action="keep", reason="helped").sets_level
    with pytest.raises(TypeError):
        Decision(3, "apply", "over")  # a field reordered would silently mis-assign: never by position
