"""The speed trial with a real Trainer on CPU: the plan settles on checkpointed blocks, the estimate says one more
micro-batch halving with no block checkpointed fits too, and the guard times both and keeps the faster. Where the
blocks' forward is what costs (a sleep per sample, recomputed by checkpointing, split evenly by micro-batches) it ends
on the micro-batches; where every call of the model costs the same whatever the batch (a sleep per call, paid once
per micro-batch) it keeps the blocks checkpointed. With ``speed_trial=False`` the plan's levels stay."""

import re
import time

import pytest
import torch

from lightning_memguard import MemGuardCallback
from lightning_memguard.estimate.plan import ladder_peak_model
from tests.helpers import fit_module, one_intra_op_thread
from tests.models import Block, BlockStack

FULL_BATCH = 256


class TimedBlock(Block):
    """A residual block whose forward also sleeps ``seconds_per_batch`` for a whole batch, in proportion to the
    samples it gets: the cost of compute that checkpointing pays again and micro-batches share."""

    seconds_per_batch = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds_per_batch * x.shape[0] / FULL_BATCH)
        return super().forward(x)


class TimedStack(BlockStack):
    """:class:`BlockStack` (4 blocks, batches of 256, SGD) whose blocks cost ``block_seconds`` per whole batch and
    whose every forward call costs ``call_seconds`` more, whatever its batch."""

    def __init__(self, block_seconds: float, call_seconds: float) -> None:
        super().__init__(width=64, depth=4, batch_size=FULL_BATCH, n_samples=16 * FULL_BATCH, optimizer="sgd",
                         log_loss=False)
        torch.manual_seed(0)
        self.blocks = torch.nn.Sequential(*[TimedBlock(64) for _ in range(4)])
        for block in self.blocks:
            block.seconds_per_batch = block_seconds
        self.call_seconds = call_seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.call_seconds)
        return super().forward(x)


def budget_for_two_blocks(model: TimedStack) -> int:
    """A budget whose line (95 % of 0.9 of it) lies between the estimate's peak with one block checkpointed and with
    two, with 2 micro-batches and no block under it too: the plan picks two blocks, the speed trial's alternative is
    2 micro-batches with none."""
    peaks = ladder_peak_model(model, next(iter(model.train_dataloader())), target="cpu")
    one, two = peaks.peak({"checkpointing": 1}), peaks.peak({"checkpointing": 2})
    split = peaks.peak({"checkpointing": 0, "microbatch": 1})
    aim = (one + two) / 2
    assert two < aim and split < aim < one, (one, two, split)
    return int(aim / (0.95 * 0.9))


def fit_timed(model: TimedStack, root, enable_checkpointing: bool = False, **settings) -> MemGuardCallback:
    """Ten steps: two to settle on the plan's levels, a warm-up and three timed steps with each configuration, one
    after the verdict. On one thread: on a busy machine a second one makes tiny ops' cost swamp what is timed."""
    guard = MemGuardCallback(mitigations=("checkpointing", "microbatch"), budget=budget_for_two_blocks(model),
                             explain=False, **settings)
    with one_intra_op_thread():
        fit_module(model, [guard], root, max_steps=10, enable_checkpointing=enable_checkpointing)
    return guard


def milliseconds(reason: str) -> list[float]:
    return [float(ms) for ms in re.findall(r"([\d.]+) ms a step", reason)]


def test_where_recomputing_blocks_costs_more_than_a_split_the_guard_ends_on_micro_batches(tmp_path):
    guard = fit_timed(TimedStack(block_seconds=0.03, call_seconds=0.0), tmp_path)
    events = guard.events
    plan = events[events["action"] == "plan"]
    assert set(plan["step"]) == {0}
    switched = events[events["action"] == "speed_trial"]
    assert sorted(zip(switched["rung"], switched["level"])) == [("checkpointing", 0), ("microbatch", 1)]
    kept = events[events["action"] == "speed_keep"]
    assert len(kept) == 1, events[["step", "action", "reason"]]
    reason = kept["reason"].iloc[0]
    assert reason.startswith("kept checkpointing 0, microbatch 1, the faster")
    alternative, settled = milliseconds(reason)
    assert alternative < settled  # two blocks' forward recomputed (60 ms) against one more pass
    assert guard.levels == {"checkpointing": 0, "microbatch": 1}
    # the step after the verdict runs split, with no block checkpointed, and stays under the threshold
    history = guard.history
    after = history[history["step"] > kept["step"].iloc[0]]
    assert not after.empty and (after["peak_bytes"] < 0.9 * guard.engine.monitor.capacity_bytes()).all()
    assert not {"rescue", "speed_abandon", "apply"} & set(events["action"])


def test_where_each_pass_of_the_model_costs_more_the_guard_keeps_the_blocks_checkpointed(tmp_path):
    guard = fit_timed(TimedStack(block_seconds=0.002, call_seconds=0.08), tmp_path)
    events = guard.events
    switched = events[events["action"] == "speed_trial"]
    # there, and back
    assert list(zip(switched["rung"], switched["level"])) == [("checkpointing", 0), ("microbatch", 1),
                                                              ("checkpointing", 2), ("microbatch", 0)]
    kept = events[events["action"] == "speed_keep"]
    assert len(kept) == 1 and kept["reason"].iloc[0].startswith("kept checkpointing 2, microbatch 0, the faster")
    alternative, settled = milliseconds(kept["reason"].iloc[0])
    assert settled < alternative  # a second 80 ms pass against two small blocks recomputed
    assert guard.levels == {"checkpointing": 2, "microbatch": 0}


def test_with_the_speed_trial_off_the_plan_levels_stay(tmp_path):
    guard = fit_timed(TimedStack(block_seconds=0.03, call_seconds=0.0), tmp_path, speed_trial=False)
    assert not {"speed_trial", "speed_keep", "speed_abandon"} & set(guard.events["action"])
    assert guard.levels == {"checkpointing": 2, "microbatch": 0}


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_speed_trial_setting_that_is_not_a_bool_is_refused(value):
    with pytest.raises(ValueError, match=r"speed_trial=.* must be True or False"):
        MemGuardCallback(speed_trial=value)


def test_a_resumed_run_does_not_time_the_configuration_it_kept_again(tmp_path):
    model = TimedStack(block_seconds=0.002, call_seconds=0.08)
    first = fit_timed(model, tmp_path / "first", enable_checkpointing=True)
    assert first.levels == {"checkpointing": 2, "microbatch": 0}
    checkpoint = next((tmp_path / "first").rglob("*.ckpt"))
    state = torch.load(checkpoint, weights_only=False)["callbacks"]
    saved = next(value for key, value in state.items() if "MemGuard" in key)
    assert {"checkpointing": 2, "microbatch": 0} in saved["ladder"]["speed_tried"]
    guard = MemGuardCallback(mitigations=("checkpointing", "microbatch"), budget=budget_for_two_blocks(model),
                             explain=False)
    with one_intra_op_thread():
        fit_module(TimedStack(block_seconds=0.002, call_seconds=0.08), [guard], tmp_path / "second",
                   ckpt_path=str(checkpoint), max_steps=16)
    assert guard.levels == {"checkpointing": 2, "microbatch": 0}
    assert guard.history["step"].max() == 15  # six steps ran after the resume, settled, none of them on trial
    assert not {"speed_trial", "speed_keep", "speed_abandon"} & set(guard.events["action"])
