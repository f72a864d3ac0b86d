"""The guard's contract, the same through every front door: one table of scenarios, each run through the Lightning
callback (a real CPU Trainer with a TensorBoard logger), the Fabric guard and the plain-loop guard, each asserting
what a user sees — events (actions, rungs), levels, history rows and files, every batch trained once, parameters
equal to an unguarded run where the rung keeps the math.

Every budget and hard limit is placed between peaks probed from monitor-only runs of the same model through the same
door (tests/helpers.py), never copied from an earlier run's output. Models are tiny and runs a handful of steps: the
table runs each scenario three times."""

from __future__ import annotations

import os
import warnings

import pandas as pd
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_memguard import FabricMemGuard, MemGuard, MemGuardCallback, MemGuardOutOfMemoryError
from lightning_memguard.mitigations.checkpointing import is_checkpointed
from tests.helpers import (
    DOORS,
    all_finite,
    assert_same_state,
    budget_crossed_between,
    checkpoint_every_block,
    limit_between,
    probe,
    run,
    square_mean,
    train_unguarded,
)
from tests.models import ParameterHeavy, Stack, WideLinears, feature_batches, lightning_class, regression_batches

DEPTH = 8  # Stack's blocks


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    """``peaks(door, kind)``: the probed peaks of a model through ``door``, each probed once per module. Kinds:
    ``"stack"`` and ``"stack checkpointed"`` (every block), ``"parameter heavy"`` (SGD) and ``"parameter heavy
    adam"``."""
    probed = {}

    def get(door: str, kind: str):
        if (door, kind) not in probed:
            root = tmp_path_factory.mktemp(f"{door}-{kind.replace(' ', '-')}")
            if kind.startswith("stack"):
                model = checkpoint_every_block(Stack()) if kind.endswith("checkpointed") else Stack()
                probed[door, kind] = probe(door, model, regression_batches(3), root)
            else:
                probed[door, kind] = probe(door, ParameterHeavy(), feature_batches(3, 64, 512), root,
                                           loss=square_mean, lr=1e-4,
                                           optimizer="adam" if kind.endswith("adam") else "plain sgd")
        return probed[door, kind]

    return get


def stack_peaks(peaks, door: str) -> tuple[int, int]:
    """The steady (momentum allocated) step peaks of the stack, plain and with every block checkpointed."""
    plain, low = peaks(door, "stack").highest(from_step=1), peaks(door, "stack checkpointed").highest(from_step=1)
    assert low < 0.7 * plain  # the stack is activation-heavy, as these scenarios need
    return plain, low


def step_peaks(result) -> pd.Series:
    return result.guard.history.groupby("step")["peak_bytes"].max()


def actions(result) -> set:
    return set(result.guard.events["action"])


def assert_every_batch_once(result, steps: int) -> None:
    assert result.steps_done == steps and result.steps_seen() == list(range(steps))


SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


# --- monitoring -------------------------------------------------------------------------------------------------------
@scenario
def monitoring_reaches_history_csv_and_tensorboard(door, tmp_path, peaks):
    result = run(door, Stack(), regression_batches(3, size=64), tmp_path, cpu_sample_every=1)
    history = result.guard.history
    assert list(history["phase"].iloc[:4]) == ["batch_start", "after_forward", "after_backward",
                                               "after_optimizer_step"]
    assert sorted(history["step"].unique()) == [0, 1, 2] and len(history) == 12
    assert (history["peak_bytes"] > 0).all()
    assert result.guard.events.empty and not any(result.guard.levels.values())
    on_disk = pd.read_csv(os.path.join(result.log_dir, "memguard_history.csv"))
    pd.testing.assert_frame_equal(on_disk[["step", "phase", "peak_bytes"]], history[["step", "phase", "peak_bytes"]])
    files = [os.path.join(d, f) for d, _, names in os.walk(result.log_dir) for f in names if "tfevents" in f]
    assert len(files) == 1
    accumulator = EventAccumulator(files[0]).Reload()
    scalars = accumulator.Tags()["scalars"]
    assert "memguard/after_forward/peak_GiB" in scalars and "memguard/peak_share" not in scalars  # no budget
    logged = [e.step for e in accumulator.Scalars("memguard/after_backward/allocated_GiB")]
    assert logged == [0, 1, 2]  # the run's own step axis


# --- a rung engages and is kept ---------------------------------------------------------------------------------------
@scenario
def checkpointing_engages_between_steps_and_later_peaks_stay_under(door, tmp_path, peaks):
    plain, low = stack_peaks(peaks, door)
    capacity = budget_crossed_between(plain, low)
    # Lightning accumulates two batches a step: both must see the same blocks checkpointed
    accumulate = 2 if door == "lightning" else 1
    # the closed loop acting on a measured crossing: no plan before the first step (it would start checkpointed)
    result = run(door, Stack(), regression_batches(6 * accumulate), tmp_path, accumulate=accumulate,
                 budget=capacity, mitigations=("checkpointing",), plan_at_start=False)
    events, limit = result.guard.events, 0.9 * capacity
    applied = events[events["action"] == "apply"]
    assert len(applied) >= 1 and applied["rung"].eq("checkpointing").all()
    peaks_by_step = step_peaks(result)
    assert peaks_by_step.loc[int(applied["step"].iloc[0])] >= limit  # it acted on a real crossing ...
    last_change = int(events[events["action"].isin(["apply", "revert"])]["step"].max())
    assert (peaks_by_step.loc[last_change + 1:] < limit).all()  # ... and every step after its last change is under
    assert 0 < result.guard.levels["checkpointing"] < DEPTH  # as many blocks as needed, not all
    keep = events[events["action"] == "keep"]
    assert len(keep) >= 1 and (keep["peak_after_bytes"] < keep["peak_before_bytes"]).all()
    counts_by_step = {}
    for step, count in result.seen:
        counts_by_step.setdefault(step, set()).add(count)
    assert all(len(counts) == 1 for counts in counts_by_step.values())  # changes only between optimizer steps
    assert counts_by_step[0] == {0} and max(max(c) for c in counts_by_step.values()) > 0
    assert result.seen.count((0, 0)) == accumulate


# --- a rung that does not help is reverted; one that cannot help is said once -----------------------------------------
def parameter_heavy_run(door, root, optimizer="plain sgd", steps=6, **settings):
    return run(door, ParameterHeavy(), feature_batches(steps, 64, 512), root, loss=square_mean, lr=1e-4,
               optimizer=optimizer, **settings)


@scenario
def a_rung_that_raises_memory_is_reverted_and_the_ladder_reports_exhaustion(door, tmp_path, peaks):
    peak = int(peaks(door, "parameter heavy").per_step().loc[2])
    result = parameter_heavy_run(door, tmp_path, budget=int(peak / 0.95), mitigations=("amp",))
    amp = result.guard.events[result.guard.events["rung"] == "amp"]
    assert list(amp["action"]) == ["apply", "revert"] and result.guard.levels == {"amp": 0}
    assert amp["peak_after_bytes"].iloc[1] > amp["peak_before_bytes"].iloc[1]  # bf16 copies made it worse
    assert "exhausted" in actions(result)
    if door == "lightning":  # the original precision plugin is back
        assert type(result.trainer.strategy.precision_plugin) is lightning_class("plugins.precision", "Precision")


@scenario
def a_peak_in_the_optimizer_step_gets_one_clear_warning_and_no_flailing(door, tmp_path, peaks):
    last = peaks(door, "parameter heavy adam").per_phase(from_step=2)
    assert last.idxmax() == "after_optimizer_step"  # Adam's state update is the peak
    result = parameter_heavy_run(door, tmp_path, optimizer="adam", steps=5, budget=int(last.max() / 0.95))
    cannot = result.warnings_with("cannot lower it")
    assert len(cannot) == 1 and "after_optimizer_step" in cannot[0] and "MiB" in cannot[0]
    assert "apply" not in actions(result)
    assert set(result.guard.levels.values()) == {0}  # no rung touched (amp in the default ladder where bf16 is native)


# --- an OOM rescued on the same batch ---------------------------------------------------------------------------------
@scenario
def an_oom_is_rescued_on_the_same_batch_and_training_equals_an_unguarded_run(door, tmp_path, peaks):
    limit = limit_between(*stack_peaks(peaks, door))
    data = regression_batches(5)
    # threshold 1.0: no warning before the OOM, and no plan before the first step, so the rescue path is what saves
    # the run
    result = run(door, Stack(), data, tmp_path, cpu_hard_limit=limit, threshold=1.0, mitigations=("checkpointing",),
                 explain=False, plan_at_start=False)
    assert_every_batch_once(result, 5)
    rescues = result.guard.events[result.guard.events["action"] == "rescue"]
    assert len(rescues) >= 1 and "gave_up" not in actions(result)
    assert "out of memory in forward" in rescues["reason"].iloc[0] or "in backward" in rescues["reason"].iloc[0]
    calls = [step for step, _ in result.seen]
    for step, retries in rescues["step"].value_counts().items():
        assert calls.count(step) == 1 + retries  # the same batch, run again
    assert len(calls) == 5 + len(rescues)
    assert result.guard.levels["checkpointing"] > 0
    assert (result.guard.history["peak_bytes"] <= limit).all()
    # checkpointing recomputes, it does not change the math: no doubled gradients, no half-applied step
    assert_same_state(result.model, train_unguarded(Stack(), data))


@scenario
def a_batch_that_cannot_fit_ends_with_the_report_and_its_row(door, tmp_path, peaks):
    _, low = stack_peaks(peaks, door)
    limit = low // 3
    result = run(door, Stack(), regression_batches(2), tmp_path, cpu_hard_limit=limit, threshold=1.0,
                 mitigations=("checkpointing",), explain=False, raises=MemGuardOutOfMemoryError)
    text = str(result.error)
    # what persists across steps is over the limit: said at step 0 from the estimate, and no rung is raised
    for words in ("could not rescue step", "capacity", "what was tried", "the training state cannot fit",
                  "cannot lower that"):
        assert words in text
    assert result.guard.events["action"].iloc[0] == "cannot_help" and "rescue" not in actions(result)
    assert result.error.report["phase"] in ("forward", "backward")
    assert result.error.report["capacity_bytes"] == limit
    assert "oom" in set(result.guard.history["phase"]) and "gave_up" in actions(result)
    with open(os.path.join(result.log_dir, "memguard_oom_report.txt")) as f:
        report = f.read()
    assert report.startswith("lightning-memguard could not rescue") and "the training state cannot fit" in report
    rows = pd.read_csv(os.path.join(result.log_dir, "memguard_history.csv"))
    assert "oom" in set(rows["phase"])
    if door == "lightning":
        assert rows["phase"].iloc[-1] == "exception"  # the final snapshot, taken as the Trainer unwinds


# --- micro-batching ---------------------------------------------------------------------------------------------------
@scenario
def only_micro_batches_fit_and_the_step_still_sees_the_whole_batch(door, tmp_path, peaks):
    probed = peaks(door, "stack")
    held = probed.allocated("batch_start", from_step=1)  # parameters, momentum, the batch: what no rung lowers
    limit = held + (probed.highest(from_step=1) - held) // 3
    data = regression_batches(4)
    result = run(door, Stack(), data, tmp_path, cpu_hard_limit=limit, mitigations=("microbatch",), explain=False)
    assert_every_batch_once(result, 4)
    assert result.guard.levels["microbatch"] >= 1 and "gave_up" not in actions(result)
    assert result.guard.history["micro_batches"].max() >= 2
    assert (result.guard.history["peak_bytes"] <= limit).all()
    assert len(result.warnings_with("a mean over the batch")) == 1  # said once, when the rung engaged
    assert_same_state(result.model, train_unguarded(Stack(), data), atol=1e-6)


# --- AMP --------------------------------------------------------------------------------------------------------------
@scenario
def amp_switches_to_bf16_mid_run_and_training_stays_finite(door, tmp_path, peaks):
    plain, _ = stack_peaks(peaks, door)
    model = Stack()
    dtypes = []  # what the first block computes in (Fabric casts the model's output back to fp32)
    model.blocks[0].up.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    result = run(door, model, regression_batches(4), tmp_path, budget=int(plain / 0.8), threshold=0.8,
                 mitigations=("amp",), explain=False)
    assert result.guard.levels == {"amp": 1}
    assert dtypes[0] == torch.float32 and dtypes[-1] == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all_finite(result.losses)
    keep = result.guard.events[result.guard.events["action"] == "keep"]
    assert len(keep) == 1 and keep["peak_after_bytes"].iloc[0] < keep["peak_before_bytes"].iloc[0]
    if door == "lightning":
        plugin = result.plugins[-1]  # the last step's; after the fit the Trainer's own is back
        assert isinstance(plugin, lightning_class("plugins.precision", "MixedPrecision"))
        assert plugin.precision == "bf16-mixed" and result.trainer.precision == "32-true"


# --- resume -----------------------------------------------------------------------------------------------------------
@scenario
def resume_puts_the_rungs_back_once_before_the_first_step(door, tmp_path, peaks):
    capacity = budget_crossed_between(*stack_peaks(peaks, door))
    settings = dict(budget=capacity, mitigations=("checkpointing",), explain=False)
    first = run(door, Stack(), regression_batches(4), tmp_path / "first", **settings)
    level = first.guard.levels["checkpointing"]
    assert level > 0 and first.steps_done == 4
    model = Stack()
    second = run(door, model, regression_batches(2), tmp_path / "second", resume=first, **settings)
    assert second.guard.levels == first.guard.levels
    assert second.seen[0] == (4, level)  # the first resumed step already ran with the saved level
    assert sorted(second.guard.history["step"].unique()) == [4, 5]
    assert "apply" not in actions(second)
    assert (step_peaks(second) < 0.9 * capacity).all()
    for block in model.blocks:
        if is_checkpointed(block):
            assert block.forward.inner.__func__ is type(block).forward  # wrapped once, around the class's forward


# --- a first optimizer step whose temporaries do not fit --------------------------------------------------------------
@scenario
def a_first_optimizer_step_whose_temporaries_do_not_fit_is_retried_one_parameter_at_a_time(door, tmp_path, peaks):
    """Parameters, gradients and AdamW's state fit (4x the parameters), the foreach step's whole-group temporaries
    do not (the step peaks at 5.0x the parameters with foreach, 4.5x without: the limit lies between). Nothing was
    updated when the step failed, so it is retried with foreach=False and training goes on — the same parameters as
    a run that never used foreach."""
    data = feature_batches(3, 8, 256)
    result = run(door, WideLinears(), data, tmp_path, loss=square_mean, optimizer="adamw foreach", lr=1e-3,
                 cpu_hard_limit=int(4.75 * WideLinears.PARAMETER_BYTES), explain=False)
    retried = result.guard.events[result.guard.events["rung"] == "optimizer"]
    assert len(retried) == 1 and "foreach=False" in retried["reason"].iloc[0]
    assert "gave_up" not in actions(result)
    assert_every_batch_once(result, 3)
    assert result.optimizer.param_groups[0]["foreach"] is False
    reference = WideLinears()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)
    for batch in data:
        optimizer.zero_grad(set_to_none=True)
        square_mean(reference, batch).backward()
        optimizer.step()
    assert_same_state(result.model, reference, atol=1e-6)  # updated exactly once (lr 1e-3 per step)


# --- bad input --------------------------------------------------------------------------------------------------------
BAD_SETTINGS = [
    ({"threshold": 0}, "threshold=0"),
    ({"threshold": 2}, "threshold=2"),
    ({"threshold": 1.01}, "threshold=1.01"),
    ({"mitigations": ("amp", "teleport")}, "unknown rung"),
    ({"mitigations": "amp"}, "mitigations='amp'"),
    ({"mitigations": ("amp", "amp")}, "twice"),
    ({"blocks": ()}, "blocks=()"),
    ({"blocks": [int]}, "blocks="),
    ({"min_gain": -0.1}, "min_gain=-0.1"),
]


def construct(door: str, **settings):
    """A guard of ``door`` built on a tiny model, not run."""
    if door == "lightning":
        return MemGuardCallback(**settings)
    model = Stack(width=8, depth=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if door == "fabric":
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=1)
        model, optimizer = fabric.setup(model, optimizer)
        return FabricMemGuard(fabric, model, optimizer, **settings)
    return MemGuard(model, optimizer, **settings)


@scenario
def bad_input_fails_at_construction_naming_the_value(door, tmp_path, peaks):
    for settings, match in BAD_SETTINGS:
        with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            construct(door, **settings)
    if door == "loop":
        model = Stack(width=8, depth=2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ValueError, match=r"unknown setting\(s\) \['budgett'\]"):
            MemGuard(model, optimizer, budgett="1GiB")
        with pytest.raises(ValueError, match="must be a torch.nn.Module"):
            MemGuard("model", optimizer)
        guard = MemGuard(model, optimizer)
        with warnings.catch_warnings(), pytest.raises(ValueError, match=r"loss_fn returned Tensor\(8, 1\)"):
            warnings.simplefilter("ignore")  # the first step's notices: no CUDA device, no logger
            guard.step(regression_batches(1, size=8)[0], lambda m, b: m(b[0]))
        guard.close()
    if door == "fabric":
        model = Stack(width=8, depth=2)
        with pytest.raises(ValueError, match="must be a lightning.fabric.Fabric"):
            FabricMemGuard(None, model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name, door, tmp_path, peaks):
    SCENARIOS[name](door, tmp_path, peaks)
