"""The first batch's predictions for a CUDA target are estimated when a question first reads them: a step that fits
costs one estimate, a plan only those its choice looks at, and every level, reason and number is the one the
estimates made all at once give. A rung whose late estimate breaks the step is turned off as at the first batch."""

import warnings

import pytest
import torch
from torch import nn

import lightning_memguard.estimate.plan as plan_module
from lightning_memguard.adapters.torch_backend import AutocastSwitch
from lightning_memguard.base.prediction import floor_bytes
from lightning_memguard.guard.ladder import Ladder
from lightning_memguard.guard.planning import needs_plan, plan_at_start
from tests.models import Block, Stack

LEVELS = [{}, {"amp": 1}, {"checkpointing": 1}, {"checkpointing": 2}, {"checkpointing": 4}, {"microbatch": 1},
          {"amp": 1, "checkpointing": 3, "microbatch": 2}]


@pytest.fixture
def estimates(monkeypatch) -> list:
    """The (precision, checkpointed blocks) of every estimate the plan module makes, in order."""
    made, estimate_memory = [], plan_module.estimate_memory

    def counted(model, batch, **kwargs):
        made.append((kwargs["precision"], kwargs["checkpointed_blocks"]))
        return estimate_memory(model, batch, **kwargs)

    monkeypatch.setattr(plan_module, "estimate_memory", counted)
    return made


def first_batch(model: nn.Module, batch, target: str = "cuda", all_at_once: bool = False,
                mitigations=("amp", "checkpointing", "microbatch")) -> tuple[Ladder, list[str]]:
    """A ladder that took ``batch``; ``all_at_once``: as with several ranks (every estimate made now)."""
    said: list[str] = []
    ladder = Ladder(mitigations, 0.9, None, 0.03, warn=said.append)
    ladder.setup(model, torch.device("cpu"), AutocastSwitch(torch.device("cpu")), guarding=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ladder.note_batch(batch, model, target, reduce_max=(lambda numbers: numbers) if all_at_once else None)
    return ladder, said


def planned(ladder: Ladder, model: nn.Module, batch, capacity: int, said: list[str], asked: bool = False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not asked and not needs_plan(ladder, capacity):
            return [], dict(ladder.levels)
        decisions = plan_at_start(ladder, model, batch, capacity, 0, cuda=True, warn=said.append, asked=asked)
    return [(d.action, d.reason, d.peak_before_bytes) for d in decisions], dict(ladder.levels)


def test_a_step_that_fits_costs_one_estimate_and_a_plan_chooses_as_from_every_estimate(estimates):
    batch = torch.randn(256, 128, 16)  # activations well over what no rung lowers
    model = Stack(width=64, depth=4)
    ladder, said = first_batch(model, batch)
    assert estimates == [("32-true", 0)]
    peak = ladder.predictor.peak({})
    assert planned(ladder, model, batch, 4 * peak, said) == ([], {"amp": 0, "checkpointing": 0, "microbatch": 0})
    assert estimates == [("32-true", 0)] and not said  # fits: nothing else was estimated
    for share in (0.8, 0.6, 0.4, 0.25):  # AMP, blocks, both, and micro-batches
        estimates.clear()
        lazy, lazy_said = first_batch(Stack(width=64, depth=4), batch)
        got = planned(lazy, model, batch, int(share * peak), lazy_said)
        made_later = len(estimates)
        eager, eager_said = first_batch(Stack(width=64, depth=4), batch, all_at_once=True)
        assert got == planned(eager, model, batch, int(share * peak), eager_said) and lazy_said == eager_said
        assert got[0] and made_later <= len(estimates) - made_later  # a plan, from no more estimates
        assert share != 0.8 or made_later < len(estimates) - made_later  # AMP alone: fewer
        # the closed loop's questions get the same answers
        assert [lazy.predictor.peak(levels) for levels in LEVELS] == [eager.predictor.peak(lv) for lv in LEVELS]
        assert lazy.predictor.held_bytes() == eager.predictor.held_bytes()
        assert lazy.predictor.model.made() == eager.predictor.model


def test_later_estimates_read_the_model_as_the_first_batch_found_it(estimates):
    """Estimated after training changed the model (its blocks checkpointed by the rung, its weights stepped, a
    layer frozen), the numbers are those of the first batch's model."""
    batch = torch.randn(64, 128, 16)
    model = Stack(width=64, depth=4)
    ladder, _ = first_batch(model, batch)
    ladder.apply_plan({"checkpointing": 4})
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(2)
    model.inp.requires_grad_(False)
    answers = [ladder.predictor.peak(levels) for levels in LEVELS]
    eager, _ = first_batch(Stack(width=64, depth=4), batch, all_at_once=True)
    assert answers == [eager.predictor.peak(levels) for levels in LEVELS]


def test_a_cpu_target_and_several_ranks_estimate_every_level_at_once(estimates):
    batch = torch.randn(32, 64, 16)
    first_batch(Stack(width=32, depth=4), batch, target="cpu")  # a real step on CPU is not run mid-fit
    assert len(estimates) == 6
    estimates.clear()
    first_batch(Stack(width=32, depth=4), batch, all_at_once=True)  # the ranks agree on every number now
    assert len(estimates) == 6


class BreaksWhenRecomputed(Block):
    """A block that raises when it runs inside backward: a checkpointed recomputation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError("this block cannot be recomputed")
        return super().forward(x)


def test_a_rung_whose_later_estimate_breaks_the_step_is_turned_off_once_and_answers_none(estimates):
    batch = torch.randn(64, 128, 16)
    model = Stack(width=64, depth=4, block=BreaksWhenRecomputed)
    ladder, said = first_batch(model, batch, mitigations=("checkpointing", "microbatch"))
    assert not said and estimates == [("32-true", 0)]  # the rung's estimate is not made yet
    peak, floor = ladder.predictor.peak({}), floor_bytes(ladder.predictor.model, (0,))
    assert not needs_plan(ladder, 4 * peak) and not said
    assert ladder.predictor.peak({"checkpointing": 2}) is None  # the closed loop asks: no exception, no prediction
    off = [s for s in said if "the checkpointing rung is off for this run" in s]
    assert len(said) == len(off) == 1 and "BreaksWhenRecomputed" not in off[0]
    assert "Stack fails with it (RuntimeError: this block cannot be recomputed" in off[0]
    assert not ladder.usable("checkpointing") and ladder.predictor.peak({}) is None
    # where the plan is the first to ask, the rung is off as at the first batch and the plan made without it: as a
    # plan asked for where every estimate was made at once (under a capacity the state fits, the step does not)
    capacity = (floor + peak) // 2
    lazy, lazy_said = first_batch(Stack(width=64, depth=4, block=BreaksWhenRecomputed), batch,
                                  mitigations=("checkpointing", "microbatch"))
    got = planned(lazy, model, batch, capacity, lazy_said, asked=True)
    eager, eager_said = first_batch(Stack(width=64, depth=4, block=BreaksWhenRecomputed), batch, all_at_once=True,
                                    mitigations=("checkpointing", "microbatch"))
    assert got == planned(eager, model, batch, capacity, eager_said, asked=True)
    assert lazy_said == eager_said and len([s for s in lazy_said if "rung is off" in s]) == 1
    assert got[1]["microbatch"] > 0 and got[1]["checkpointing"] == 0 and not lazy.usable("checkpointing")


class FullPrecisionOnly(Block):
    """A block that raises on bf16 activations (what autocast's linear layers hand it): the model breaks in mixed
    precision."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            raise RuntimeError("this block runs in full precision only")
        return super().forward(x)


def test_amp_whose_later_estimate_breaks_the_step_is_turned_off_once_when_the_loop_first_asks(estimates):
    batch = torch.randn(64, 128, 16)
    ladder, said = first_batch(Stack(width=64, depth=4, block=FullPrecisionOnly), batch)
    peak = ladder.predictor.peak({})
    assert not needs_plan(ladder, 4 * peak) and not said and ladder.predictor.covers("amp")
    assert ladder.predictor.peak({"amp": 1, "checkpointing": 2}) is None  # no exception into training
    (off,) = said
    assert off.startswith("lightning-memguard: the amp rung is off for this run: Stack fails with it (")
    assert "this block runs in full precision only" in off and not ladder.usable("amp")
    assert ladder.usable("checkpointing") and ladder.levels["amp"] == 0
    assert ladder.predictor.peak({"checkpointing": 2}) is None and said == [off]  # no prediction, said once
