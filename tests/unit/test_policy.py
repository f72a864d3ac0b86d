"""The policy with scripted numbers: no torch, no Trainer. The rungs' levels are kept here as the ladder keeps them:
handed to each call, and set by each decision that sets one."""

from types import SimpleNamespace

import pytest

from lightning_memguard.base.prediction import PeakModel, PhaseEstimate, model_from_numbers, model_numbers
from lightning_memguard.guard.policy import MitigationPolicy, StepObservation

MiB = 2**20
CAP = 100 * MiB


def obs(step, forward=50, backward=40, optimizer=20, start=10, capacity=CAP, retries=None):
    peaks = {"batch_start": start * MiB, "after_forward": forward * MiB, "after_backward": backward * MiB,
             "after_optimizer_step": optimizer * MiB}
    return StepObservation(step, peaks, capacity, static_bytes=start * MiB, alloc_retries=retries)


class PolicyWithLevels:
    """A policy and the levels it decides from, carried out as the ladder carries them out."""

    def __init__(self, policy: MitigationPolicy) -> None:
        self.policy = policy
        self.levels = {name: 0 for name in policy.ladder}

    def decide(self, observation):
        return self._carry_out(self.policy.decide(observation, self.levels))

    def escalate(self, observation, cause, skip=()):
        return self._carry_out(self.policy.escalate(observation, self.levels, cause, skip))

    def _carry_out(self, decisions):
        self.levels.update((d.rung, d.level) for d in decisions if d.sets_level)
        return decisions

    def state_dict(self):  # the ladder's format: the levels beside the policy's state
        return {"levels": dict(self.levels), **self.policy.state_dict()}

    def load_state_dict(self, state):
        self.policy.load_state_dict(state)
        self.levels = {name: state["levels"].get(name, 0) for name in self.policy.ladder}


def policy(**kw):
    kw.setdefault("ladder", ("amp", "checkpointing"))
    kw.setdefault("max_levels", {"amp": 1, "checkpointing": 8})
    return PolicyWithLevels(MitigationPolicy(threshold=kw.pop("threshold", 0.9), **kw))


def actions(decisions):
    return [(d.action, d.rung, d.level) for d in decisions]


def test_below_threshold_does_nothing():
    assert policy().decide(obs(3, forward=89)) == []


def test_a_rung_applied_at_step_zero_is_judged_on_what_the_step_adds_to_persistent_memory():
    """Step 1 has gradients and optimizer state that step 0 had not: its peak may be higher although the rung
    saved memory. The policy compares peak minus batch-start memory."""
    p = policy()
    assert actions(p.decide(obs(0, forward=95, start=10)))[-1] == ("apply", "amp", 1)
    decisions = p.decide(obs(1, forward=97, start=30))  # +20 MiB persistent, but the forward added 18 less
    assert actions(decisions)[0] == ("keep", "amp", 1)
    # like with like: what the step added, before and after; and why the total still rose
    assert "added above batch start 85.0 MiB -> 67.0 MiB, 18.0 MiB less" in decisions[0].reason
    assert "the step peak still rose, 95.0 MiB -> 97.0 MiB, because memory held across steps grew by 20.0 MiB" \
        in decisions[0].reason


def test_a_kept_rung_whose_step_peak_fell_says_so_plainly():
    p = policy()
    p.decide(obs(1, forward=95, start=10))
    reason = p.decide(obs(2, forward=80, start=10))[0].reason
    assert "added above batch start 85.0 MiB -> 70.0 MiB, 15.0 MiB less" in reason
    assert "step peak 95.0 MiB -> 80.0 MiB" in reason and "rose" not in reason


def test_no_capacity_means_monitor_only():
    assert policy().decide(obs(3, forward=500, capacity=None)) == []


def test_crossing_applies_the_first_rung_and_says_why():
    decisions = policy().decide(obs(1, forward=95))
    assert actions(decisions) == [("threshold", "", 0), ("apply", "amp", 1)]
    assert "95.0 MiB in after_forward >= 90% of capacity 100.0 MiB" in decisions[1].reason
    assert decisions[1].peak_before_bytes == 95 * MiB


def test_a_rung_that_helped_is_kept_and_the_next_one_waits_for_a_full_step():
    p = policy()
    p.decide(obs(1, forward=95))
    assert p.decide(obs(1, forward=95)) == []  # same step again: nothing to judge yet
    decisions = p.decide(obs(2, forward=80))
    assert actions(decisions) == [("keep", "amp", 1)]
    assert decisions[0].peak_after_bytes == 80 * MiB
    assert p.levels == {"amp": 1, "checkpointing": 0}


def test_a_rung_that_did_not_help_is_reverted_and_the_next_is_tried():
    p = policy()
    p.decide(obs(1, forward=95))
    decisions = p.decide(obs(2, forward=97))  # AMP raised the peak (bf16 weight copies)
    assert actions(decisions) == [("revert", "amp", 0), ("apply", "checkpointing", 2)]
    assert "did not help" in decisions[0].reason
    assert p.levels == {"amp": 0, "checkpointing": 2}


def test_checkpointing_escalates_by_the_measured_saving_per_block():
    p = policy(ladder=("checkpointing",), max_levels={"checkpointing": 12})
    assert actions(p.decide(obs(1, forward=120))) == [("threshold", "", 0), ("apply", "checkpointing", 3)]
    # 3 blocks saved 15 MiB: 5 MiB a block. Limit 90, aim 85.5: (105 - 85.5) / 5 -> 4 more blocks
    assert actions(p.decide(obs(2, forward=105))) == [("keep", "checkpointing", 3), ("apply", "checkpointing", 7)]
    assert actions(p.decide(obs(3, forward=85))) == [("keep", "checkpointing", 7)]
    assert p.decide(obs(4, forward=85)) == []


def test_peak_in_the_optimizer_step_cannot_be_helped_by_activation_rungs():
    p = policy()
    decisions = p.decide(obs(1, forward=50, optimizer=95, start=60))
    assert actions(decisions) == [("threshold", "", 0), ("cannot_help", "", 0)]
    assert "after_optimizer_step" in decisions[1].reason and "optimizer" in decisions[1].reason
    assert "60.0 MiB held across steps" in decisions[1].reason
    assert p.decide(obs(2, forward=50, optimizer=95, start=60)) == []  # said once
    assert p.levels == {"amp": 0, "checkpointing": 0}


def test_static_memory_over_the_limit_cannot_be_helped():
    decisions = policy().decide(obs(1, forward=99, start=92))
    assert [d.action for d in decisions] == ["threshold", "cannot_help"]
    # foreach=False lowers the optimizer step's temporaries, not what is held across steps: not named here
    assert "foreach=False" not in decisions[1].reason


def test_a_peak_in_the_optimizer_step_names_foreach_false_among_what_would_help():
    decisions = policy().decide(obs(1, forward=50, optimizer=95, start=60))
    assert "foreach=False in the optimizer" in decisions[1].reason


def test_a_cannot_help_names_the_remedies_for_the_parts_the_estimate_found_large_enough():
    """A LoRA-like state: frozen weights hold what does not fit, the adapters' gradients and optimizer state are
    small — lighter or sharded weights would help, another optimizer would not; without the estimate's parts every
    remedy is named."""
    unknown = [d for d in policy().decide(obs(1, forward=99, start=92)) if d.action == "cannot_help"][0]
    p = policy()
    p.policy.predictor.predictions = SimpleNamespace(sizes={"parameters": 80 * MiB, "gradients": MiB,
                                                            "optimizer_state": 2 * MiB})
    told = [d for d in p.decide(obs(1, forward=99, start=92)) if d.action == "cannot_help"][0]
    assert "lighter weights" in told.reason and "optimizer with less state" not in told.reason
    assert "lighter weights" in unknown.reason and "optimizer with less state" in unknown.reason


def test_exhausted_ladder_is_reported_once():
    p = policy(ladder=("amp",), max_levels={"amp": 1})
    p.decide(obs(1, forward=95))
    decisions = p.decide(obs(2, forward=94))
    assert actions(decisions) == [("revert", "amp", 0), ("exhausted", "", 0)]
    said = decisions[-1].reason
    assert said.endswith("no rung of the ladder can be raised to lower it: amp at 0/1: reverted (it did not help "
                         "enough)"), said
    assert p.decide(obs(3, forward=95)) == []


def test_rising_alloc_retries_count_as_near_oom():
    p = policy()
    assert p.decide(obs(1, forward=50, retries=0)) == []
    decisions = p.decide(obs(2, forward=50, retries=3))
    assert actions(decisions)[-1] == ("apply", "amp", 1)
    assert "retry" in decisions[-1].reason


def test_state_dict_round_trip_continues_the_trial():
    p = policy()
    p.decide(obs(1, forward=95))
    restored = policy()
    restored.load_state_dict(p.state_dict())
    assert restored.levels == {"amp": 1, "checkpointing": 0}
    assert actions(restored.decide(obs(2, forward=80))) == [("keep", "amp", 1)]


@pytest.mark.parametrize("kw,match", [({"threshold": 0}, "threshold=0"), ({"threshold": 1.2}, "threshold=1.2"),
                                      ({"min_gain": 1}, "min_gain=1"), ({"max_levels": {"amp": 1}}, "no max level")])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        policy(**kw)


def test_a_rung_applied_to_rescue_an_oom_is_kept_even_if_the_numbers_look_flat():
    p = policy()
    assert actions(p.escalate(obs(2, forward=99), "out of memory in forward")) == [("rescue", "amp", 1)]
    # the failed attempt's peak (99) understates what the step needed; the next step peaks at 98.5: kept anyway
    assert actions(p.decide(obs(3, forward=98.5)))[0] == ("keep", "amp", 1)
    assert p.levels["amp"] == 1


def test_a_rescue_whose_failed_attempt_stopped_below_the_next_steps_peak_says_so_without_negative_savings():
    """An attempt that fails early (its first large allocation) peaks below what the rescued step then uses: the
    reason says where it stopped and where the step peaked, not "-6.0 MiB less" nor a growth of held memory."""
    p = policy()
    p.escalate(obs(2, forward=60, start=10), "out of memory in forward")
    reason = p.decide(obs(3, forward=80, start=9))[0].reason
    assert "the failed attempt reached 60.0 MiB where its allocation failed" in reason
    assert "peaking at 80.0 MiB" in reason
    assert "less" not in reason and "grew" not in reason


def test_a_step_peak_that_rose_while_held_memory_fell_is_not_blamed_on_held_memory():
    p = policy()
    p.decide(obs(1, forward=95, start=10))
    reason = p.decide(obs(2, forward=96, start=8))[0].reason
    assert "the step peak rose, 95.0 MiB -> 96.0 MiB" in reason and "grew" not in reason


def test_escalate_skips_rungs_unsafe_mid_step_and_reports_exhaustion():
    p = policy()
    assert actions(p.escalate(obs(1, forward=99), "oom", skip=("amp",))) == [("rescue", "checkpointing", 2)]
    p = policy(ladder=("amp",), max_levels={"amp": 1})
    assert p.escalate(obs(1, forward=99), "oom", skip=("amp",)) == []


def test_a_peak_between_steps_is_not_blamed_on_the_optimizer():
    # validation or data loading between two steps peaks at batch_start; the training step itself is fine
    observation = StepObservation(1, {"batch_start": 95 * MiB, "after_forward": 50 * MiB,
                                      "after_backward": 40 * MiB, "after_optimizer_step": 20 * MiB},
                                  CAP, static_bytes=10 * MiB)
    decisions = policy().decide(observation)
    assert [d.action for d in decisions] == ["threshold", "cannot_help"]
    assert "between optimizer steps" in decisions[1].reason and "validation" in decisions[1].reason


def test_rungs_are_tried_when_a_training_phase_is_over_even_if_another_phase_is_higher():
    observation = StepObservation(1, {"batch_start": 99 * MiB, "after_forward": 95 * MiB,
                                      "after_backward": 40 * MiB, "after_optimizer_step": 20 * MiB},
                                  CAP, static_bytes=10 * MiB)
    assert actions(policy().decide(observation))[-1] == ("apply", "amp", 1)


def checkpointing_model(peaks_mib, held=10, gradients=0, optimizer=20, batch_size=None):
    """A peak model whose forward peaks at ``peaks_mib`` per checkpointed-block count (the backward lower)."""
    forward = [m * MiB for m in peaks_mib]
    return PeakModel({0: PhaseEstimate(forward, [f // 2 for f in forward], optimizer * MiB, held * MiB,
                                       gradients * MiB)}, batch_size)


def test_a_predicted_rung_is_applied_at_the_level_predicted_to_fit():
    p = policy(ladder=("checkpointing",), max_levels={"checkpointing": 8})
    # estimated peaks per checkpointed-block count; the measured step runs 10 % above the estimate
    p.policy.predictor.model = checkpointing_model((100, 95, 90, 85, 80, 75, 70, 65, 60))
    decisions = p.decide(obs(1, forward=110))
    # 95 % of the 90 MiB limit is 85.5 MiB: 1.1 x 75 = 82.5 fits at level 5, 1.1 x 80 = 88 at level 4 does not
    assert actions(decisions)[-1] == ("apply", "checkpointing", 5)
    assert "trying checkpointing at level 5 (predicted step peak 82.5 MiB)" in decisions[-1].reason


def test_a_rescue_never_scales_the_prediction_down():
    p = policy(ladder=("checkpointing",), max_levels={"checkpointing": 8})
    p.policy.predictor.model = checkpointing_model((200, 180, 160, 140, 120, 100, 80, 60, 40))
    # the failed allocation was read at 91 MiB, far short of the 200 the step needs: trust the estimate
    decisions = p.escalate(obs(1, forward=91), "out of memory")
    # scaled down to 91/200 it would pick level 1; unscaled, level 6 (80 MiB) is the first under 85.5 MiB
    assert actions(decisions) == [("rescue", "checkpointing", 6)]


def test_the_peak_model_divides_what_a_step_adds_by_the_micro_batches():
    model = checkpointing_model((100, 60), held=20, gradients=8, optimizer=25, batch_size=10)
    assert model.peak({}) == 100 * MiB
    assert model.peak({"checkpointing": 1}) == 60 * MiB
    # 2 micro-batches of 5: the forward adds half of 80; the backward (50 at level 0, 30 over what is held) half of
    # 30 + the 8 MiB of gradients a whole batch's backward starts without
    assert model.peak({"microbatch": 1}) == 60 * MiB
    assert model.peak({"checkpointing": 1, "microbatch": 1}) == 40 * MiB
    # 4 parts of 10 samples are 3, 3, 2, 2: the largest counts
    assert model.micro_batch_share(2) == pytest.approx(0.3)
    # the optimizer step's peak stays: micro-batching cannot go below it
    assert model.peak({"checkpointing": 1, "microbatch": 4}) == 25 * MiB
    assert model.peak({"checkpointing": 2}) is None  # past the levels it was estimated for
    assert model.covers("checkpointing") and model.covers("microbatch") and not model.covers("amp")


def test_a_rescue_applies_every_rung_a_fit_needs_at_once():
    """All blocks checkpointed is predicted not to fit: the rescue goes to the cheapest combination predicted to fit
    under the capacity — the fewest micro-batches, then the fewest blocks with them — so one OOM is enough (it used
    to take one OOM per rung and per halving, then all blocks before any micro-batch)."""
    p = policy(ladder=("checkpointing", "microbatch"), max_levels={"checkpointing": 2, "microbatch": 4},
               single_step=("microbatch",), last_resort=("microbatch",))
    model = checkpointing_model((300, 200, 160), held=40, gradients=10, optimizer=45, batch_size=16)
    p.policy.predictor.model = model
    decisions = p.escalate(obs(0, forward=99), "out of memory in forward of step 0")
    # 2 micro-batches of every block: 40 + 120 / 2 = 100 > 95 % of 100; 4 of 1 block: 40 + 160 / 4 = 80 fit
    assert actions(decisions) == [("rescue", "checkpointing", 1), ("rescue", "microbatch", 2)]
    assert "checkpointing to level 1, with microbatch at 2: the cheapest combination predicted to fit" \
        in decisions[0].reason
    assert "retrying the batch with microbatch at level 2 too (predicted step peak 80.0 MiB)" in decisions[1].reason
    assert sum("retrying the batch" in d.reason for d in decisions) == 1  # one OOM, one retry
    assert p.levels == {"checkpointing": 1, "microbatch": 2}
    # the next step is judged as a rescue: kept
    assert actions(p.decide(obs(1, forward=80)))[0] == ("keep", "microbatch", 2)


def test_a_rescue_scales_an_estimate_that_fell_short_up_to_the_capacity():
    """A step predicted to fit ran out of memory: it needed more than the capacity, so the estimate fell short by at
    least capacity / predicted, and the rescue scales every prediction up by as much (else it would pick a level the
    estimate's error puts over the capacity again: one OOM per rung)."""
    p = policy(ladder=("checkpointing",), max_levels={"checkpointing": 8})
    p.policy.predictor.model = checkpointing_model((80, 75, 70, 65, 60, 55, 50, 45, 40))
    p.levels["checkpointing"] = 0
    # predicted 80 MiB whole, yet the attempt failed at a 100 MiB capacity (read at 60 MiB when it failed): the
    # estimate is at least 100 / 80 = 1.25x short; 85.5 / 1.25 = 68.4 MiB: level 3 (65 MiB), not level 0 or 1
    decisions = p.escalate(obs(0, forward=60), "out of memory")
    assert actions(decisions) == [("rescue", "checkpointing", 3)]
    assert "predicted step peak 81.2 MiB" in decisions[0].reason


def test_between_steps_micro_batching_goes_to_the_level_predicted_to_fit_under_the_capacity():
    p = policy(ladder=("checkpointing", "microbatch"), max_levels={"checkpointing": 1, "microbatch": 4},
               single_step=("microbatch",), last_resort=("microbatch",))
    p.policy.predictor.model = checkpointing_model((300, 200), held=40, gradients=10, optimizer=45, batch_size=16)
    p.levels["checkpointing"] = 1
    # a soft budget: the step peaked at 200 MiB against 100; 2 micro-batches predicted at 40 + 160 / 2 = 120, 4 at
    # 80 (under 95 % of the capacity, above the threshold: where micro-batching holds)
    assert actions(p.decide(obs(3, forward=200)))[-1] == ("apply", "microbatch", 2)
    # without a prediction it halves one level at a time
    q = policy(ladder=("checkpointing", "microbatch"), max_levels={"checkpointing": 1, "microbatch": 4},
               single_step=("microbatch",), last_resort=("microbatch",))
    q.levels["checkpointing"] = 1
    assert actions(q.decide(obs(3, forward=200)))[-1] == ("apply", "microbatch", 1)


def micro_batching_policy(rescue: bool):
    return policy(ladder=("checkpointing", "microbatch"), max_levels={"checkpointing": 1, "microbatch": 4},
                  single_step=("microbatch",), last_resort=("microbatch",) if rescue else ())


def test_with_a_rescue_micro_batching_waits_for_a_step_that_does_not_fit():
    p = micro_batching_policy(rescue=True)
    p.levels["checkpointing"] = 1
    p.levels["microbatch"] = 2  # where an OOM rescue left it
    # above the threshold, under the capacity: hold, said once for this level, and nothing changes
    decisions = p.decide(obs(3, forward=94))
    assert actions(decisions) == [("threshold", "", 0), ("hold", "microbatch", 2)]
    assert "94.0 MiB in after_forward >= 90% of capacity 100.0 MiB, but under the capacity" in decisions[1].reason
    assert p.decide(obs(4, forward=95)) == [] and p.levels["microbatch"] == 2
    # a rescue raises it as any rung
    assert actions(p.escalate(obs(5, forward=99), "out of memory in forward")) == [("rescue", "microbatch", 3)]
    # a peak over the capacity itself (a soft budget on CPU) or allocator retries raise it at the step boundary
    p = micro_batching_policy(rescue=True)
    p.levels["checkpointing"] = 1
    assert actions(p.decide(obs(1, forward=101)))[-1] == ("apply", "microbatch", 1)
    p = micro_batching_policy(rescue=True)
    p.levels["checkpointing"] = 1
    p.decide(obs(1, forward=50, retries=0))
    assert actions(p.decide(obs(2, forward=93, retries=1)))[-1] == ("apply", "microbatch", 1)


def test_without_a_rescue_micro_batching_follows_the_threshold():
    # several processes: an OOM would fail the run, so the threshold must keep every rung ahead of it
    p = micro_batching_policy(rescue=False)
    p.levels["checkpointing"] = 1
    assert actions(p.decide(obs(3, forward=94)))[-1] == ("apply", "microbatch", 1)


def test_a_first_step_that_will_not_fit_once_the_optimizer_state_exists_is_not_held():
    # step 0 fitted at 94 MiB, but it left 8 MiB more allocated than it started with (gradients and optimizer state
    # now exist): step 1 would reach ~102 MiB, over the capacity, so micro-batching climbs now instead of waiting
    p = micro_batching_policy(rescue=True)
    p.levels["checkpointing"] = 1
    first = StepObservation(0, {"batch_start": 10 * MiB, "after_forward": 94 * MiB, "after_optimizer_step": 30 * MiB},
                            CAP, static_bytes=10 * MiB, held_after_bytes=18 * MiB)
    assert first.next_peak_bytes == 102 * MiB
    decisions = p.decide(first)
    assert actions(decisions)[-1] == ("apply", "microbatch", 1)
    assert "the next step will need about 102.0 MiB (this one left 8.0 MiB more allocated" in decisions[-1].reason
    # a steady step leaves nothing behind: it is held
    p = micro_batching_policy(rescue=True)
    p.levels["checkpointing"] = 1
    steady = StepObservation(5, {"batch_start": 18 * MiB, "after_forward": 94 * MiB}, CAP, static_bytes=18 * MiB,
                             held_after_bytes=18 * MiB)
    assert actions(p.decide(steady))[-1] == ("hold", "microbatch", 0)


def test_ranks_agree_on_the_worst_ranks_peak_model():
    """With several processes each rank estimates its own batch; the element-wise maximum of the models' numbers is
    one model every rank decides with (a rank choosing other micro-batches would mismatch DDP's collectives)."""
    small = checkpointing_model((300, 200, 160), held=40, gradients=10, optimizer=45, batch_size=16)
    large = checkpointing_model((500, 300, 220), held=40, gradients=10, optimizer=45, batch_size=32)
    shape = ((0,), 3)
    worst = [max(a, b) for a, b in zip(model_numbers(small, *shape), model_numbers(large, *shape))]
    agreed = model_from_numbers(worst, *shape)
    assert agreed == large
    assert model_from_numbers(model_numbers(small, *shape), *shape) == small  # the numbers are the model
    # a rank without a model (its estimate failed), or with one of another shape: no rank uses one
    assert model_from_numbers([max(a, b) for a, b in zip(model_numbers(None, *shape), model_numbers(small, *shape))],
                              *shape) is None
    assert model_numbers(small, (0,), 4) == model_numbers(None, (0,), 4)


def test_a_policy_told_that_no_rung_can_help_never_climbs_and_keeps_the_reason():
    p = policy()
    p.policy.stop_climbing("parameters and optimizer state alone are over the capacity")
    # over the threshold: the crossing is noted, nothing is applied and the cannot_help is not said again
    assert actions(p.decide(obs(0, forward=99))) == [("threshold", "", 0)]
    assert p.escalate(obs(1, forward=99), "out of memory") == [] and p.levels == {"amp": 0, "checkpointing": 0}
    resumed = policy()
    resumed.load_state_dict(p.state_dict())
    assert resumed.policy.stuck_reason == "parameters and optimizer state alone are over the capacity"


def test_between_steps_a_rung_predicted_not_enough_at_its_top_comes_with_the_rest_of_the_combination():
    """A step over the capacity (a soft budget), where every block checkpointed is predicted over it: checkpointing
    alone would leave the next step over too (on a GPU, an OOM); the cheapest combination goes on at once."""
    p = policy(ladder=("checkpointing", "microbatch"), max_levels={"checkpointing": 2, "microbatch": 4},
               single_step=("microbatch",), last_resort=("microbatch",))
    p.policy.predictor.model = checkpointing_model((300, 200, 160), held=40, gradients=10, optimizer=45, batch_size=16)
    decisions = p.decide(obs(1, forward=300))
    # 2 micro-batches of every block: 100 MiB, over 95 % of the capacity; 4 of 1 block: 80 MiB
    assert actions(decisions) == [("threshold", "", 0), ("apply", "checkpointing", 1), ("apply", "microbatch", 2)]
    assert "the cheapest combination predicted to fit" in decisions[1].reason
    assert "trying microbatch at level 2 (predicted step peak 80.0 MiB)" in decisions[2].reason
    assert p.levels == {"checkpointing": 1, "microbatch": 2}


def test_a_step_0_cannot_help_gives_the_state_the_next_steps_will_hold():
    """Step 0 starts before gradients and optimizer state exist: what it measured held is not what every later step
    holds; the estimate's steady step says that."""
    p = policy()
    p.policy.predictor.model = checkpointing_model((100, 95, 90, 85, 80, 75, 70, 65, 60), held=95)
    decisions = p.decide(obs(0, forward=60, backward=50, optimizer=99, start=10))
    cannot = [d for d in decisions if d.action == "cannot_help"]
    assert len(cannot) == 1 and "10.0 MiB held across steps" in cannot[0].reason
    assert "95.0 MiB from the next step on by the estimate" in cannot[0].reason


def test_a_rescue_with_micro_batches_brings_the_blocks_under_the_threshold_aim_so_the_loop_settles():
    """4 micro-batches are the fewest predicted under 95 % of the capacity; with them 1 block (90 MiB) fits there but
    crosses the threshold, where the next step would have checkpointing raised: the rescue takes 2 blocks (80 MiB),
    and the step after it changes nothing. Where no block count reaches the threshold's aim, every block is
    checkpointed, which is where the loop would take checkpointing at the first step over the threshold."""
    def rescued(held, forward_mib):
        p = policy(ladder=("checkpointing", "microbatch"), max_levels={"checkpointing": 4, "microbatch": 4},
                   single_step=("microbatch",), last_resort=("microbatch",))
        p.policy.predictor.model = checkpointing_model(forward_mib, held=held, optimizer=45, batch_size=16)
        return p, p.escalate(obs(0, forward=99), "out of memory in forward of step 0")

    p, decisions = rescued(40, (300, 240, 200, 180, 170))
    assert actions(decisions) == [("rescue", "checkpointing", 2), ("rescue", "microbatch", 2)]
    assert "predicted step peak 80.0 MiB" in decisions[-1].reason
    assert actions(p.decide(obs(1, forward=80))) == [("keep", "microbatch", 2)]
    assert p.decide(obs(2, forward=80)) == [] and p.levels == {"checkpointing": 2, "microbatch": 2}
    # the combination with 1 block, measured where predicted, crosses the threshold: the loop raises checkpointing
    before = policy(ladder=("checkpointing", "microbatch"), max_levels={"checkpointing": 4, "microbatch": 4},
                    single_step=("microbatch",), last_resort=("microbatch",))
    before.policy.predictor.model = p.policy.predictor.model
    before.levels.update(checkpointing=1, microbatch=2)
    assert actions(before.decide(obs(1, forward=90)))[-1] == ("apply", "checkpointing", 2)

    # 60 MiB held: 2 blocks fit under 95 MiB (60 + 140 / 4), every block leaves 91, over 85.5
    p, decisions = rescued(60, (300, 240, 200, 190, 184))
    assert actions(decisions) == [("rescue", "checkpointing", 4), ("rescue", "microbatch", 2)]
    assert actions(p.decide(obs(1, forward=91))) == [("keep", "microbatch", 2), ("threshold", "", 0),
                                                     ("hold", "microbatch", 2)]
    assert p.levels == {"checkpointing": 4, "microbatch": 2}


def test_an_observation_built_for_a_step_is_the_one_the_constructor_builds():
    fast = StepObservation.of_step(3, {"after_forward": 90, "after_backward": 70}, 100, 20, 1, 35)
    built = StepObservation(step=3, peaks={"after_forward": 90, "after_backward": 70}, capacity_bytes=100,
                            static_bytes=20, alloc_retries=1, held_after_bytes=35)
    assert fast == built and repr(fast) == repr(built) and (fast.peak_bytes, fast.next_peak_bytes) == (90, 105)
    with pytest.raises(AttributeError):  # frozen as the constructor's
        fast.step = 4


def test_a_rung_whose_top_is_predicted_to_save_nothing_is_passed_over_for_the_next():
    """Every block checkpointed is predicted at the peak as it is (what no block holds is the peak): trying it would
    spend a step to learn what the estimate says, and revert it. The next rung goes on instead; where there is none,
    the ladder says it is exhausted."""
    p = micro_batching_policy(rescue=False)
    p.policy.predictor.model = checkpointing_model((100, 99.5), held=40, batch_size=16)
    decisions = p.decide(obs(1, forward=100))
    assert actions(decisions)[-1] == ("apply", "microbatch", 1) and p.levels["checkpointing"] == 0
    alone = policy(ladder=("checkpointing",), max_levels={"checkpointing": 1})
    alone.policy.predictor.model = checkpointing_model((100, 99.5), held=40)
    decisions = alone.decide(obs(1, forward=100))
    assert [a for a, _, _ in actions(decisions)] == ["threshold", "exhausted"]
    # it was never applied: the reason says it was predicted not to help, by how much, not that it "did not help"
    said = decisions[-1].reason
    assert "checkpointing at 0/1: predicted not to help" in said and "99.5 MiB against 100.0 MiB" in said, said
    assert "0.5% less" in said and "applied or did not help" not in said
    # a top that saves enough is tried, as before
    saving = micro_batching_policy(rescue=False)
    saving.policy.predictor.model = checkpointing_model((100, 90), held=40, batch_size=16)
    assert actions(saving.decide(obs(1, forward=100)))[-1] == ("apply", "checkpointing", 1)


def test_a_rescue_with_no_rung_predicted_to_help_says_which_rungs_are_at_their_top_and_which_would_not_help():
    """amp is on already; every block checkpointed is predicted to save 0.5 %: the give-up's reason says both, not
    that every rung "is at its top level or did not help"."""
    p = policy(max_levels={"amp": 1, "checkpointing": 1})
    p.levels["amp"] = 1
    p.policy.predictor.model = checkpointing_model((100, 99.5), held=40)
    assert p.escalate(obs(1, forward=100), "out of memory") == []
    said = p.policy.exhausted_reason
    assert "amp at 1/1: at its top level" in said and "checkpointing at 0/1: predicted not to help" in said, said
    assert "did not help" not in said.replace("not to help", "")
    # a rung the step failed with says so, also after a resume; one that could not be switched inside the step too
    p = policy(max_levels={"amp": 1, "checkpointing": 1})
    p.policy.disable("checkpointing")
    p.load_state_dict(p.state_dict())
    assert p.escalate(obs(1, forward=100), "oom", skip=("amp",)) == []
    said = p.policy.exhausted_reason
    assert "amp at 0/1: cannot be switched inside a step" in said, said
    assert "checkpointing at 0/1: off (the step failed with it)" in said, said
    assert actions(p.escalate(obs(1, forward=100), "oom")) == [("rescue", "amp", 1)]
    assert p.policy.exhausted_reason == ""  # it raised one
