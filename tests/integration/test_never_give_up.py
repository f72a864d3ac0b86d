"""Never give up while something could still fit: the micro-batch rung (same gradients as the whole batch), retries
that climb the whole ladder, a rescue that frees the failed attempt, optimizer-step OOMs explained (and retried where
safe), and plan_at_start that cannot break a fit. Real Trainers on CPU; OOMs are real under the CPU hard limit."""

import copy
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch

from lightning_memguard import MemGuardCallback, MemGuardOutOfMemoryError
from lightning_memguard.mitigations.microbatch import split_batch
from tests.helpers import (WatchesReleases, assert_same_parameters, budget_for_a_share_of_the_step, fit_module,
                           limit_where_only_micro_batches_of_all_blocks_fit, probe_module)
from tests.models import BlockStack, RecordedBlockStack, WideAdamW, WideLinears, lightning_class, pl, trainer_kwargs


def test_split_batch_splits_sample_leaves_and_passes_the_rest_whole():
    batch = {"x": torch.arange(10).view(10, 1), "mask": torch.ones(3, 3), "n": 7, "y": [torch.arange(10)]}
    chunks = split_batch(batch, 4)
    assert [len(c["x"]) for c, _ in chunks] == [3, 3, 2, 2]
    assert sum(share for _, share in chunks) == pytest.approx(1.0)
    assert all(c["mask"] is batch["mask"] and c["n"] == 7 for c, _ in chunks)
    assert torch.equal(torch.cat([c["y"][0] for c, _ in chunks]), batch["y"][0])
    with pytest.raises(ValueError, match="no tensor"):
        split_batch({"n": 3}, 2)


@pytest.fixture(scope="module")
def micro_budget(tmp_path_factory):
    """A budget under which only smaller micro-batches fit: what every step holds (parameters, gradients, Adam
    state) and a quarter of what a whole batch's step adds."""
    torch.manual_seed(0)
    return budget_for_a_share_of_the_step(probe_module(RecordedBlockStack(), tmp_path_factory.mktemp("probe")), 0.25)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_micro_batched_steps_train_the_same_parameters_as_whole_batches(tmp_path, accumulate, micro_budget):
    torch.manual_seed(0)
    reference = RecordedBlockStack()
    guarded = copy.deepcopy(reference)
    fit_module(reference, [], tmp_path / "whole", max_steps=4, accumulate_grad_batches=accumulate)
    # the closed loop raising the rung between steps (the plan before the first step would split from step 0)
    guard = MemGuardCallback(budget=micro_budget, mitigations=("microbatch",), min_gain=0.0, plan_at_start=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_module(guarded, [guard], tmp_path / "split", max_steps=4, accumulate_grad_batches=accumulate)
    assert guard.levels["microbatch"] >= 2 and min(guarded.step_sizes) <= 256 // 4
    assert guarded.finished == reference.finished  # every batch once, none skipped
    assert_same_parameters(guarded, reference)
    notices = [str(w.message) for w in caught if "a mean over the batch" in str(w.message)]
    assert len(notices) == 1  # said once, when the rung engaged
    assert set(guard.history.groupby("step")["phase"].count()) == {4}  # one row per phase per step


def peak_of(tmp_path, **model_kw):
    return probe_module(RecordedBlockStack(**model_kw), tmp_path).highest()


def test_when_only_smaller_micro_batches_fit_the_rescue_gets_there_and_finishes_every_batch(tmp_path):
    """The limit is under the peak of every single-batch configuration (AMP, every block checkpointed): only
    micro-batching fits. The old fixed count of three retries gave up here."""
    torch.manual_seed(0)
    limit = budget_for_a_share_of_the_step(probe_module(RecordedBlockStack(), tmp_path / "probe"), 0.25)
    model = RecordedBlockStack()
    guard = MemGuardCallback(cpu_hard_limit=limit, explain=False)
    trainer = fit_module(model, [guard], tmp_path / "run", max_steps=5)
    assert trainer.global_step == 5 and model.finished == [0, 1, 2, 3, 4]
    assert guard.levels["microbatch"] >= 1
    assert "gave_up" not in set(guard.events["action"])
    assert (guard.history["peak_bytes"] <= limit).all()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_rescue_frees_everything_the_failed_attempt_allocated(tmp_path, precision):
    torch.manual_seed(0)
    # no plan before the first step: the OOM and its rescue are what is tested
    guard = WatchesReleases(mitigations=("microbatch",), cpu_hard_limit="2.6MiB", explain=False, plan_at_start=False)
    fit_module(RecordedBlockStack(), [guard], tmp_path, max_steps=3, precision=precision)
    assert guard.releases
    for start, after_release in guard.releases:
        # nothing of the failed forward/backward stays alive: at most the batch-start memory (the gradients kept
        # from the previous step are released too, as the retry zeroes them anyway), give or take the few scalars
        # Lightning keeps of what the failed step logged
        assert after_release <= start + 64


PARAMS = WideLinears.PARAMETER_BYTES  # gradients the same, AdamW state twice that


@pytest.mark.parametrize("scheduler", [False, True])
def test_an_optimizer_state_that_cannot_fit_is_explained(tmp_path, scheduler):
    guard = MemGuardCallback(cpu_hard_limit=int(2.6 * PARAMS), explain=False)
    with pytest.raises(MemGuardOutOfMemoryError) as info:
        fit_module(WideAdamW(scheduler=scheduler), [guard], tmp_path, max_steps=3)
    report = info.value.report
    assert report["phase"] == "optimizer_step" and report["optimizer_state"] < 2 * PARAMS
    assert report["parameters"] == PARAMS and report["gradients"] == PARAMS
    text = (tmp_path / "memguard_oom_report.txt").read_text()
    for words in ("optimizer step ran out of memory", "parameters 1.0 MiB", "sharding", "a larger capacity"):
        assert words in text
    assert guard.events["action"].tolist()[-1] == "gave_up"
    assert guard.events["phase"].tolist()[-1] == "after_optimizer_step"
    assert guard.history["phase"].tolist()[-2:] == ["oom", "exception"]


@pytest.mark.parametrize("searched", [False, True])
def test_an_optimizer_step_whose_temporaries_do_not_fit_is_retried_one_parameter_at_a_time(tmp_path, searched):
    """State fits (4x parameters in all), the foreach step's whole-group temporaries do not; nothing was updated when
    it failed, so the step is retried with foreach=False, and training goes on. Also after a learning-rate search
    before the fit, whose trial steps ran through the guard and whose checkpoint took the optimizer state back: the
    fit's first step is still the one that creates the state."""
    torch.manual_seed(0)
    model = WideAdamW(foreach=True)
    reference = copy.deepcopy(model)
    # measured: the step peaks at 5.0x the parameters with foreach=True, 4.5x with foreach=False
    guard = MemGuardCallback(cpu_hard_limit=int(4.75 * PARAMS), explain=False)
    finders = [lightning_class("callbacks", "LearningRateFinder")(num_training_steps=4, update_attr=False)]
    trainer = fit_module(model, [guard, *(finders if searched else [])], tmp_path / "guarded", max_steps=3)
    assert trainer.global_step == 3
    rescue = guard.events[guard.events["rung"] == "optimizer"]
    assert len(rescue) == 1 and "foreach=False" in rescue["reason"].iloc[0]
    assert trainer.optimizers[0].param_groups[0]["foreach"] is False
    reference.foreach = False
    fit_module(reference, [], tmp_path / "reference", max_steps=3)
    assert_same_parameters(model, reference, atol=1e-6)  # the retried step updated exactly once


# stays here: it skips a batch on purpose, for this file's test only
class SkipsFirstBatch(BlockStack):
    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            return None  # a skipped batch: legal in Lightning
        return super().training_step(batch, batch_idx)


def test_plan_at_start_never_breaks_a_fit(tmp_path):
    guard = MemGuardCallback(budget="64MiB", plan_at_start=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit_module(SkipsFirstBatch(width=32, depth=4), [guard], tmp_path, max_steps=3)
    assert trainer.global_step == 3
    said = [str(w.message) for w in caught if "plan_at_start could not estimate" in str(w.message)]
    assert len(said) == 1 and "returned NoneType" in said[0]


def test_the_estimate_picks_the_level_so_a_run_fits_after_at_most_one_oom(tmp_path):
    """Under a hard limit where plain training runs out of memory, the rescue applies checkpointing straight at the
    level the estimate's per-block numbers say fits (it used to creep up a quarter of the blocks per OOM)."""
    torch.manual_seed(0)
    kw = {"width": 64, "depth": 8, "batch_size": 512, "optimizer": "sgd"}
    limit = int(0.8 * peak_of(tmp_path / "plain", **kw))
    model = RecordedBlockStack(**kw)
    guard = MemGuardCallback(mitigations=("checkpointing",), cpu_hard_limit=limit, explain=False)
    trainer = fit_module(model, [guard], tmp_path / "run", max_steps=5)
    assert trainer.global_step == 5 and model.finished == [0, 1, 2, 3, 4]
    events = guard.events
    assert (events["action"] == "rescue").sum() <= 1
    assert "gave_up" not in set(events["action"])
    assert 0 < guard.levels["checkpointing"] < 8  # not all blocks: as many as needed
    assert (guard.history["peak_bytes"] <= limit).all()


def test_micro_batching_survives_a_resume(tmp_path, micro_budget):
    torch.manual_seed(0)
    guard = MemGuardCallback(budget=micro_budget, mitigations=("microbatch",), min_gain=0.0)
    trainer = fit_module(RecordedBlockStack(), [guard], tmp_path / "first", max_steps=3)
    level = guard.levels["microbatch"]
    assert level >= 1
    ckpt = str(tmp_path / "run.ckpt")
    trainer.save_checkpoint(ckpt)
    resumed_model = RecordedBlockStack()
    resumed = MemGuardCallback(budget=micro_budget, mitigations=("microbatch",), min_gain=0.0)
    fit_module(resumed_model, resumed, tmp_path / "second", ckpt_path=ckpt, max_steps=5)
    assert resumed.levels["microbatch"] >= level
    assert resumed_model.step_sizes[0] == 256 // 2**level  # the first batch after the resume is already split


@pytest.mark.parametrize("plan_at_start", [True, None])
def test_plan_at_start_warns_before_step_one_when_the_optimizer_state_cannot_fit(tmp_path, plan_at_start):
    guard = MemGuardCallback(budget=int(2.6 * PARAMS), plan_at_start=plan_at_start, explain=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_module(WideAdamW(), [guard], tmp_path, max_steps=2)
    said = [str(w.message) for w in caught if "the training state cannot fit" in str(w.message)]
    assert len(said) == 1 and "optimizer with less state" in said[0]
    cannot = guard.events[guard.events["action"] == "cannot_help"]
    assert cannot["step"].tolist() == [0] and "parameters 1.0 MiB" in cannot["reason"].iloc[0]
    assert not {"plan", "apply", "rescue", "exhausted"} & set(guard.events["action"])  # no rung climbs


def test_micro_batching_stops_at_the_level_the_limit_needs_not_the_threshold(tmp_path):
    """Each micro-batch level costs throughput. Where an OOM can be rescued, a step that fits between the threshold
    and the capacity keeps its level (a `hold` event) instead of halving the micro-batch once more."""
    torch.manual_seed(0)
    plain = peak_of(tmp_path / "plain")
    # the peak of 2 micro-batches, measured: a soft budget just under plain's peak makes the rung take one level
    probe = MemGuardCallback(budget=int(0.98 * plain), mitigations=("microbatch",), cpu_sample_every=1,
                             explain=False)
    fit_module(RecordedBlockStack(), [probe], tmp_path / "probe", max_steps=4)
    assert probe.levels["microbatch"] == 1
    two = int(probe.history[probe.history["step"] >= 2]["peak_bytes"].max())
    limit = int(two / 0.95)  # 2 micro-batches fit at 95 % of the limit, above the 90 % threshold
    assert plain > limit  # a whole batch does not fit
    model = RecordedBlockStack()
    guard = MemGuardCallback(mitigations=("microbatch",), cpu_hard_limit=limit, explain=False, plan_at_start=False)
    trainer = fit_module(model, [guard], tmp_path / "run", max_steps=6)
    assert trainer.global_step == 6 and model.finished == [0, 1, 2, 3, 4, 5]
    events = guard.events
    assert guard.levels["microbatch"] == 1 and min(model.step_sizes) == 128
    # step 0 (no Adam state yet) fits a whole batch above the threshold, but it leaves the state behind, and with it
    # step 1 would not fit: 2 micro-batches from step 1 on, no OOM at all; then held there
    assert events[events["action"] == "apply"][["step", "level"]].values.tolist() == [[0, 1]]
    assert "rescue" not in set(events["action"])
    hold = events[events["action"] == "hold"]
    assert len(hold) == 1 and "under the capacity: microbatch stays at level 1" in hold["reason"].iloc[0]
    steady = guard.history[guard.history["step"] >= 1]["peak_bytes"].max()
    assert 0.9 * limit <= steady <= limit


def test_micro_batches_under_a_16_bit_grad_scaler_train_like_whole_batches(tmp_path):
    """fp16 autocast with Lightning's GradScaler (on CPU Lightning would turn "16-mixed" into bf16, so the plugin is
    given explicitly): every micro-batch's loss is scaled, the gradients are unscaled and checked once per step."""

    def fp16():
        # a scale low enough that no step overflows: which steps overflow at the default 2**16 differs between one
        # fp16 backward of the whole batch and several of smaller, share-weighted losses
        return pl.plugins.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))

    torch.manual_seed(0)
    # not Adam: it would hide a gradient left scaled (or unscaled twice)
    reference = RecordedBlockStack(optimizer="sgd", lr=0.1)
    initial = copy.deepcopy(reference)
    split = copy.deepcopy(reference)
    whole = pl.Trainer(default_root_dir=str(tmp_path / "whole"), logger=False, plugins=[fp16()],
                       **trainer_kwargs(max_steps=4))
    whole.fit(reference)
    guard = MemGuardCallback(budget="2.5MB", mitigations=("microbatch",), min_gain=0.0)
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path / "split"), logger=False, plugins=[fp16()],
                         **trainer_kwargs(max_steps=4))
    trainer.fit(split)
    assert guard.levels["microbatch"] >= 1 and min(split.step_sizes) < 256
    scaler = trainer.precision_plugin.scaler
    assert scaler is not None and scaler.get_scale() == whole.precision_plugin.scaler.get_scale() == 256.0
    assert split.finished == reference.finished
    assert_same_parameters(split, reference, atol=1e-3)
    moved = max((p - q).abs().max().item() for p, q in zip(reference.parameters(), initial.parameters()))
    assert moved > 0.02  # the steps moved the parameters far more than the tolerance


def test_where_only_micro_batches_of_a_checkpointed_model_fit_one_oom_is_enough(tmp_path):
    """Every block checkpointed is not enough and 2 micro-batches of it are not either: the first OOM's rescue applies
    checkpointing at its top and the micro-batch level the estimate predicts to fit, together (it used to take an OOM
    for checkpointing, then one per halving of the micro-batch)."""
    torch.manual_seed(0)
    model = RecordedBlockStack()
    limit = limit_where_only_micro_batches_of_all_blocks_fit(model)
    # no plan before the first step: the OOM is what is tested
    guard = WatchesReleases(mitigations=("checkpointing", "microbatch"), cpu_hard_limit=limit, explain=False,
                            plan_at_start=False)
    trainer = fit_module(model, [guard], tmp_path, max_steps=5)
    assert trainer.global_step == 5 and model.finished == [0, 1, 2, 3, 4]
    assert len(guard.releases) == 1  # one failed attempt in the whole run
    rescues = guard.events[guard.events["action"] == "rescue"]
    # the cheapest combination predicted to fit: the fewest micro-batches, then the fewest blocks with them
    assert rescues[["step", "rung"]].values.tolist() == [[0, "checkpointing"], [0, "microbatch"]]
    assert "the cheapest combination predicted to fit" in rescues["reason"].iloc[0]
    assert 0 < guard.levels["checkpointing"] <= 4 and guard.levels["microbatch"] == 2
    assert min(model.step_sizes) == 256 // 4
    assert (guard.history["peak_bytes"] <= limit).all()


def test_plan_at_start_splits_from_the_first_step_where_only_micro_batches_fit(tmp_path):
    torch.manual_seed(0)
    model = RecordedBlockStack()
    limit = limit_where_only_micro_batches_of_all_blocks_fit(model)
    guard = WatchesReleases(mitigations=("checkpointing", "microbatch"), cpu_hard_limit=limit, plan_at_start=True,
                            explain=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit_module(model, [guard], tmp_path, max_steps=4)
    assert trainer.global_step == 4 and model.finished == [0, 1, 2, 3]
    assert guard.releases == [] and "rescue" not in set(guard.events["action"])  # no OOM at all
    assert model.step_sizes[0] == 256 // 4 and guard.levels["microbatch"] == 2
    assert 0 < guard.levels["checkpointing"] <= 4
    plan = guard.events[guard.events["action"] == "plan"]["reason"].iloc[0]
    assert "4 micro-batches a step is predicted at" in plan
    assert not [w for w in caught if "plan_at_start:" in str(w.message)]  # a plan that fits is no warning
    assert (guard.history["peak_bytes"] <= limit).all()


def test_every_history_row_of_a_split_step_says_its_micro_batches(tmp_path):
    """A step run in 4 micro-batches is 4 on each of its rows in the CSV the callback streams, its batch start and
    optimizer step too (read once a step, they were 1)."""
    torch.manual_seed(0)
    model = RecordedBlockStack()
    limit = limit_where_only_micro_batches_of_all_blocks_fit(model)
    guard = MemGuardCallback(mitigations=("checkpointing", "microbatch"), cpu_hard_limit=limit, plan_at_start=True,
                             explain=False)
    trainer = fit_module(model, [guard], tmp_path, max_steps=3)
    assert guard.levels["microbatch"] == 2 and model.step_sizes[0] == 256 // 4  # each step ran in 4 parts
    rows = pd.read_csv(Path(trainer.log_dir) / "memguard_history.csv")
    steps = rows[rows["phase"].isin(["batch_start", "after_forward", "after_backward", "after_optimizer_step"])]
    assert len(steps) == 3 * 4 and set(steps["phase"]) == {"batch_start", "after_forward", "after_backward",
                                                          "after_optimizer_step"}
    assert (steps["micro_batches"] == 4).all(), steps[["step", "phase", "micro_batches"]]
