"""The plan before the first step, by default: where the estimate of the first batch already shows the step cannot fit,
the levels are chosen before it runs (no OOM first), every rung together; where what no rung lowers cannot fit, that is
said at step 0 and no rung climbs; a mixture of experts whose router loss micro-batching changes is told so. Real
Trainers on CPU; the budget is a hard limit (cpu_hard_limit), so a step over it is a real out-of-memory error."""

import copy
import warnings

import pandas as pd
import pytest
import torch

from lightning_memguard.base.snapshot import format_bytes
from lightning_memguard.mitigations.microbatch import MicroBatching, router_loss_text
from tests.helpers import (WatchesReleases, assert_same_parameters, fit_module,
                           limit_where_only_micro_batches_of_all_blocks_fit)
from tests.models import RecordedBlockStack, WideAdamW, WideLinears

PARAMS = WideLinears.PARAMETER_BYTES  # gradients the same, AdamW state twice that


def test_a_step_the_estimate_says_cannot_fit_starts_split_and_checkpointed_with_no_oom(tmp_path):
    """Only some blocks checkpointed with 4 micro-batches fit under the hard limit. With the default settings the
    plan sets both before step 0 runs: no failed attempt in the whole run, and (SGD, LayerNorm, no dropout: both rungs
    exact) the same parameters as an unguarded run of whole batches."""
    torch.manual_seed(0)
    model = RecordedBlockStack(optimizer="sgd")
    reference = copy.deepcopy(model)
    limit = limit_where_only_micro_batches_of_all_blocks_fit(model)
    fit_module(reference, [], tmp_path / "whole", max_steps=4)
    guard = WatchesReleases(mitigations=("checkpointing", "microbatch"), budget=limit, cpu_hard_limit=limit,
                            explain=False)
    trainer = fit_module(model, [guard], tmp_path / "guarded", max_steps=4)
    assert trainer.global_step == 4 and model.finished == reference.finished == [0, 1, 2, 3]
    assert guard.releases == [] and not {"rescue", "gave_up"} & set(guard.events["action"])
    plan = guard.events[guard.events["action"] == "plan"]
    assert set(plan["step"]) == {0} and "where it would run out of memory" in plan["reason"].iloc[0]
    assert guard.levels["microbatch"] >= 1 and guard.levels["checkpointing"] >= 1
    assert model.step_sizes[0] == 256 // 2 ** guard.levels["microbatch"]  # split from the first batch on
    # the plan is an event a rung it put on, with the level, as the events file says too
    written = pd.read_csv(tmp_path / "guarded" / "memguard_events.csv")
    for rows in (plan, written[written["action"] == "plan"]):
        assert list(rows["rung"]) == ["checkpointing", "microbatch"] and rows["reason"].nunique() == 1
        assert int(rows["level"].iloc[1]) == guard.levels["microbatch"] and int(rows["level"].iloc[0]) >= 1
    assert (guard.history["peak_bytes"] <= limit).all()
    assert_same_parameters(model, reference, atol=1e-6)


class WithoutBatchIndex(RecordedBlockStack):
    """:class:`RecordedBlockStack` whose ``training_step`` takes the batch alone, as Lightning allows."""

    def training_step(self, batch):
        return super().training_step(batch, 0)


class ReadsItsTrainer(RecordedBlockStack):
    """:class:`RecordedBlockStack` with AdamW under a one-cycle schedule sized by the Trainer's total steps, logging
    its learning rate and epoch read from the Trainer, and stopping the fit early where a step says so (never here)."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3,
                                                       total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def training_step(self, batch, batch_idx):
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        self.log("epoch_read", float(self.trainer.current_epoch))
        self.trainer.should_stop = self.trainer.should_stop or batch_idx > 1000
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("module", [WithoutBatchIndex, ReadsItsTrainer])
def test_a_step_lightning_runs_its_own_way_is_estimated_and_planned_before_step_0(tmp_path, module):
    """The estimate runs the step on a copy of the module without the Trainer, as ``training_step(batch, 0)``. A step
    that takes no index (``training_step(self, batch)``) raised a TypeError; one whose module reads ``self.trainer``
    (a schedule sized by ``estimated_stepping_batches``, the usual warm-up recipe, or the epoch in the step) raised
    "not attached to a Trainer": no estimate, no plan, and the first step ran out of memory (here a rescue, on a GPU
    an OOM). The step is called as Lightning calls it, and the copy reads the Trainer, read only."""
    torch.manual_seed(0)
    limit = limit_where_only_micro_batches_of_all_blocks_fit(RecordedBlockStack(optimizer="adam"))
    model = module(optimizer="adam")
    guard = WatchesReleases(mitigations=("checkpointing", "microbatch"), budget=limit, cpu_hard_limit=limit,
                            explain=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit_module(model, [guard], tmp_path, max_steps=4)
    assert trainer.global_step == 4 and guard.releases == []
    assert not [w for w in caught if "cannot be predicted" in str(w.message) or "could not" in str(w.message)]
    plan = guard.events[guard.events["action"] == "plan"]
    assert set(plan["step"]) == {0} and not {"rescue", "gave_up"} & set(guard.events["action"])
    assert model.step_sizes[0] == 256 // 2 ** guard.levels["microbatch"] < 256  # split from the first batch on
    assert model.trainer is trainer and not hasattr(type(model), "_views_trainer")  # the module itself untouched


def test_a_step_that_fits_is_left_to_the_closed_loop(tmp_path):
    """No plan where the estimate puts the step under the capacity: the default costs nothing there."""
    torch.manual_seed(0)
    model = RecordedBlockStack(optimizer="sgd")
    guard = WatchesReleases(mitigations=("checkpointing", "microbatch"), budget="64MiB", explain=False)
    fit_module(model, [guard], tmp_path, max_steps=2)
    assert "plan" not in set(guard.events["action"]) and guard.levels == {"checkpointing": 0, "microbatch": 0}


def test_states_over_the_capacity_are_said_at_step_0_and_no_rung_climbs(tmp_path):
    """Parameters, gradients and AdamW state (4x the parameters) over a soft budget: the step-0 ``cannot_help`` gives
    the estimate's numbers (not what batch start holds before the optimizer state exists) and what would help; no
    rung is applied at any step, and nothing is called exhausted."""
    guard = WatchesReleases(budget=int(3.5 * PARAMS), explain=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit_module(WideAdamW(), [guard], tmp_path, max_steps=3)
    assert trainer.global_step == 3
    cannot = guard.events[guard.events["action"] == "cannot_help"]
    assert cannot["step"].tolist() == [0] and len(cannot) == 1
    reason = cannot["reason"].iloc[0]
    for words in ("parameters 1.0 MiB", "gradients 1.0 MiB", "optimizer state 2.0 MiB", "optimizer with less state",
                  "cannot lower that, so none is applied"):
        assert words in reason
    assert "foreach=False" not in reason  # it lowers the optimizer step's temporaries, none of what is held
    assert not {"apply", "rescue", "exhausted", "plan"} & set(guard.events["action"])
    assert set(guard.levels.values()) == {0}
    assert len([w for w in caught if "the training state cannot fit" in str(w.message)]) == 1


def test_states_over_a_hard_limit_end_with_the_step_0_reason_not_a_climb(tmp_path):
    guard = WatchesReleases(cpu_hard_limit=int(2.6 * PARAMS), explain=False)
    with pytest.raises(torch.OutOfMemoryError):
        fit_module(WideAdamW(), [guard], tmp_path, max_steps=3)
    actions = guard.events["action"].tolist()
    assert actions[0] == "cannot_help" and actions[-1] == "gave_up"
    assert not [a for a in actions if a in ("apply", "rescue", "exhausted")] or \
        set(guard.events[guard.events["action"] == "rescue"]["rung"]) <= {"optimizer"}  # only the foreach retry



class KeepsItsData(RecordedBlockStack):
    """:class:`RecordedBlockStack` that keeps a tensor of data in an attribute, as a tutorial's module keeps its
    dataset: live through every step, counted by the CPU accountant, not part of the step the estimate runs."""

    def __init__(self, kept_bytes: int, **kw):
        super().__init__(**kw)
        self.kept = torch.zeros(kept_bytes // 4)


def test_the_plan_leaves_room_for_what_the_run_holds_beside_the_step(tmp_path):
    """The capacity is the step's hard limit plus the data the module keeps. A plan of the step against the whole
    capacity sets too little, and step 0 runs out of memory (rescue is off: the fit would end); taking what the run
    holds beside the step off the capacity, the plan sets what fits, said in its reason, and no step runs over."""
    torch.manual_seed(0)
    step_limit = limit_where_only_micro_batches_of_all_blocks_fit(RecordedBlockStack(optimizer="sgd"))
    kept = step_limit // 2
    model = KeepsItsData(kept, optimizer="sgd")
    capacity = step_limit + kept
    guard = WatchesReleases(mitigations=("checkpointing", "microbatch"), budget=capacity, cpu_hard_limit=capacity,
                            rescue_oom=False, explain=False)
    trainer = fit_module(model, [guard], tmp_path, max_steps=3)
    assert trainer.global_step == 3 and guard.releases == []
    plan = guard.events[guard.events["action"] == "plan"]
    assert set(plan["step"]) == {0}
    assert f"{format_bytes(capacity)} less the {format_bytes(kept)} the run holds beside the step" in \
        plan["reason"].iloc[0]
    assert guard.levels["microbatch"] >= 1 and guard.levels["checkpointing"] >= 1
    assert (guard.history["peak_bytes"] <= capacity).all()
    # the plan's lines are the policy's, shares of the whole capacity, less what is held beside: planned under a
    # share of the room alone, the step ran above the threshold's line and the closed loop climbed at once
    assert not {"threshold", "apply"} & set(guard.events["action"])

# --- a mixture of experts with its router loss on ------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def tiny_mixtral(router_loss: bool):
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, output_router_logits=router_loss,
                                        router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def test_micro_batching_a_mixture_of_experts_with_its_router_loss_says_the_loss_is_per_part():
    model = tiny_mixtral(router_loss=True)
    rung = MicroBatching(model)
    rung.set_level(1)
    assert "router load-balancing loss" in rung.notices[0] and "computed per micro-batch" in rung.notices[0]
    assert "router_aux_loss_coef=0.5" in rung.notices[0]
    # it is said because it is true: the weighted micro-losses do not add up to the whole batch's loss
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    whole = model(**batch).loss
    parts = sum(weight * model(**part).loss for part, weight in rung.split(batch, 4))
    assert abs(float(parts) - float(whole)) > 1e-4
    # with the router loss off, micro-batching is exact and nothing is said
    plain = tiny_mixtral(router_loss=False)
    assert router_loss_text(plain) is None
    quiet = MicroBatching(plain)
    quiet.set_level(1)
    assert not any("router" in notice for notice in quiet.notices)
    whole = plain(**batch).loss
    parts = sum(weight * plain(**part).loss for part, weight in quiet.split(batch, 4))
    torch.testing.assert_close(parts, whole, atol=1e-6, rtol=1e-6)


def test_a_plan_for_a_trainer_in_bf16_true_names_the_configurations_in_bf16(tmp_path):
    """``precision="bf16-true"`` casts the model: the estimate runs its bf16 step as it is and the AMP rung is off, so
    the plan's configurations are bf16 ones — they were called "fp32+k blocks", a precision the run never had."""
    torch.manual_seed(0)
    probe_guard = WatchesReleases(mitigations=(), cpu_sample_every=1, explain=False)
    fit_module(RecordedBlockStack(optimizer="sgd"), [probe_guard], tmp_path / "probe", max_steps=2,
               precision="bf16-true")
    peak = int(probe_guard.history["peak_bytes"].max())
    guard = WatchesReleases(budget=int(0.6 * peak), explain=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the AMP rung's notice that the Trainer runs bf16-true
        fit_module(RecordedBlockStack(optimizer="sgd"), [guard], tmp_path / "guarded", max_steps=2,
                   precision="bf16-true")
    plan = guard.events[guard.events["action"] == "plan"]
    assert not plan.empty and "amp" not in set(plan["rung"])
    reason = plan["reason"].iloc[0]
    assert "bf16+0 blocks" in reason and "fp32" not in reason, reason
