"""A batch's size in elements (base/batches.py), the estimate's peak for a larger batch (base/prediction.py) and the
prediction before a batch runs (guard/long_batch.py), with scripted numbers on a real ladder: a batch predicted not to
fit whole runs as the fewest micro-batches predicted to fit, that batch only; the step it ran in is not judged; with
several processes every rank runs the same count; an estimate that fails says so once and splits nothing."""

from __future__ import annotations

import collections
import dataclasses

import torch
from torch import nn

from lightning_memguard.base.batches import BatchSize, batch_elements
from lightning_memguard.base.prediction import PeakModel, PhaseEstimate
from lightning_memguard.base.snapshot import format_bytes
from lightning_memguard.guard.ladder import Ladder
from lightning_memguard.guard.long_batch import LongBatches
from lightning_memguard.guard.policy import StepObservation

CAPACITY = 1_000_000
AIM = 0.95 * CAPACITY  # with a rescue, micro-batching aims under 95 % of the capacity
SAMPLES = 8


class Encoding(collections.UserDict):
    """A mapping that is not a dict, as transformers' BatchEncoding."""


@dataclasses.dataclass
class ImageBatch:
    pixels: torch.Tensor
    label: torch.Tensor
    positions: torch.Tensor  # shared by every sample: no sample dimension
    name: str = "images"


# --- batch_elements ---------------------------------------------------------------------------------------------------
def test_a_token_batch_counts_samples_times_tokens_of_each_tensor_with_the_sample_dimension():
    ids = torch.zeros(4, 10, dtype=torch.long)
    batch = Encoding({"input_ids": ids, "attention_mask": torch.ones(4, 10), "labels": ids.clone(),
                      "temperature": torch.tensor(2.0)})
    assert batch_elements(batch) == 3 * 4 * 10


def test_a_tuple_and_a_dataclass_count_what_has_the_sample_dimension():
    assert batch_elements((torch.zeros(4, 3, 8, 8), torch.zeros(4))) == 4 * 3 * 8 * 8 + 4
    batch = ImageBatch(torch.zeros(2, 3, 5, 5), torch.zeros(2), torch.zeros(1, 25))
    assert batch_elements(batch) == 2 * 3 * 5 * 5 + 2  # the shared positions are not the batch's


def test_a_batch_without_a_sample_dimension_has_no_elements():
    assert batch_elements({"scale": torch.tensor(1.0), "name": "x"}) == 0
    assert batch_elements(None) == 0


# --- the estimate for a larger batch ----------------------------------------------------------------------------------
PHASES = PhaseEstimate(forward=[450_000], backward=[400_000], optimizer_step=250_000, held_bytes=200_000,
                       gradient_bytes=50_000, batch_bytes=384)


def test_a_larger_batch_grows_the_activations_and_the_batch_but_not_what_persists():
    model = PeakModel({0: PHASES}, batch_size=SAMPLES)
    assert model.peak({}) == model.peak({}, 1.0) == 450_000  # the forward's peak, as estimated
    # twice the elements: twice the forward's activations and the batch; the backward's gradients stay one copy
    assert model.peak({}, 2.0) == 200_000 + 2 * 250_000 + 384
    activations_in_backward = 400_000 - 200_000 - 50_000
    backward_at_3 = 400_000 + 2 * activations_in_backward
    forward_at_3 = 200_000 + 3 * 250_000
    assert forward_at_3 > backward_at_3 and model.peak({}, 3.0) == forward_at_3 + 2 * 384


def test_a_larger_batch_split_in_two_holds_half_its_activations_and_the_samples_decide_the_share():
    model = PeakModel({0: PHASES}, batch_size=SAMPLES)
    half = 200_000 + 0.5 * 250_000 * 4
    assert model.peak({"microbatch": 1}, 4.0) == int(half + 3 * 384)
    # 3 samples in 2 parts: the larger part holds 2 of them
    assert model.peak({"microbatch": 1}, 4.0, samples=3) == int(200_000 + 2 / 3 * 250_000 * 4 + 3 * 384)


# --- the prediction on a ladder ---------------------------------------------------------------------------------------
def token_batch(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``SAMPLES`` sequences: 3 float32 elements a token (384 bytes for 4 tokens)."""
    return torch.zeros(SAMPLES, tokens, 2), torch.zeros(SAMPLES, tokens, 1)


NORMAL, LONG = token_batch(4), token_batch(16)


def ladder_for(model: PeakModel | None) -> Ladder:
    ladder = Ladder(("microbatch",), 0.9, None, 0.03)
    module = nn.Linear(2, 1)
    ladder.setup(module, torch.device("cpu"), None, guarding=True, rescue=True)
    ladder.note_batch(NORMAL, module, target=None)  # learns how far the batch splits; no estimate
    if model is not None:  # as if estimated from the first batch
        ladder.predictor.model, ladder.predictor.batch = model, BatchSize.of(NORMAL)
    return ladder


def test_a_batch_predicted_not_to_fit_runs_as_the_fewest_micro_batches_that_fit_that_batch_only():
    model = PeakModel({0: PHASES}, batch_size=SAMPLES)
    ladder, batches = ladder_for(model), LongBatches()
    assert batches.before_batch(0, NORMAL, ladder, CAPACITY) is None  # the first batch: the estimate's own
    decision = batches.before_batch(1, LONG, ladder, CAPACITY)
    whole, halves = model.peak({}, 4.0), model.peak({"microbatch": 1}, 4.0)
    assert whole > AIM >= halves  # two micro-batches are the fewest predicted to fit
    assert (decision.action, decision.rung, decision.level) == ("predicted_split", "microbatch", 1)
    assert (decision.peak_before_bytes, decision.peak_after_bytes) == (whole, halves)
    assert decision.reason == (
        f"a batch of 384 elements, 4.0x the 96 of the first batch, is predicted to peak at {format_bytes(whole)}, "
        f"over 95% of the capacity {format_bytes(CAPACITY)}; it runs as 2 micro-batches (predicted "
        f"{format_bytes(halves)}), this batch only")
    assert ladder.parts.training() == 2 and ladder.levels["microbatch"] == 0  # no level changed
    assert [len(part[0]) for part, _ in ladder.parts.split(LONG)] == [4, 4]
    assert batches.before_batch(2, NORMAL, ladder, CAPACITY) is None and ladder.parts.training() == 1


def test_a_batch_no_larger_than_the_reference_is_left_to_the_ladder():
    ladder, batches = ladder_for(PeakModel({0: PHASES}, batch_size=SAMPLES)), LongBatches()
    batches.before_batch(0, NORMAL, ladder, CAPACITY)
    # predicted over a smaller capacity, but as large as the first batch: the policy's to judge after the step
    assert batches.before_batch(1, NORMAL, ladder, 300_000) is None and ladder.parts.training() == 1


def observed(step: int, forward: int = 450_000) -> StepObservation:
    return StepObservation(step=step, peaks={"batch_start": 900_000, "after_forward": forward,
                                             "after_backward": 400_000, "after_optimizer_step": 250_000},
                           capacity_bytes=CAPACITY, static_bytes=200_000, held_after_bytes=200_000)


def test_without_an_estimate_the_last_step_measured_whole_is_scaled_and_a_split_step_is_not_judged():
    ladder, batches = ladder_for(None), LongBatches()
    assert batches.before_batch(0, NORMAL, ladder, CAPACITY) is None  # nothing to predict from yet
    assert batches.after_step(observed(0), ladder.levels, gradients_at_start=0, gradients=50_000)
    decision = batches.before_batch(1, LONG, ladder, CAPACITY)
    # the forward adds 250 000 above batch start; four times the elements add three times more, and the batch's
    # 1152 extra bytes; batch_start's peak (what ran between steps) is no part of the step
    assert decision.peak_before_bytes == 450_000 + 3 * 250_000 + 1152
    # halves: each holds twice the reference's elements, and the first half's gradients during the second
    assert decision.peak_after_bytes == 450_000 + 250_000 + 50_000 + 1152 and ladder.parts.training() == 2
    assert "of step 0 (the last step measured whole)" in decision.reason
    assert not batches.after_step(observed(1, forward=760_000), ladder.levels, 0, 50_000)  # not the levels' doing
    assert "of step 0" in batches.before_batch(2, LONG, ladder, CAPACITY).reason  # still the reference


def test_with_an_estimate_the_measured_step_scales_the_prediction_up_never_down():
    model = PeakModel({0: PHASES}, batch_size=SAMPLES)
    ladder, batches = ladder_for(model), LongBatches()
    batches.before_batch(0, NORMAL, ladder, CAPACITY)
    batches.after_step(observed(0, forward=540_000), ladder.levels, 0, 50_000)  # 20 % over the estimate
    assert batches.before_batch(1, LONG, ladder, CAPACITY).peak_before_bytes == int(1.2 * model.peak({}, 4.0))
    batches.before_batch(2, NORMAL, ladder, CAPACITY)
    batches.after_step(observed(2, forward=300_000), ladder.levels, 0, 50_000)  # under it: not lowered
    assert batches.before_batch(3, LONG, ladder, CAPACITY).peak_before_bytes == model.peak({}, 4.0)


def test_with_several_processes_every_rank_runs_the_largest_count_asked_for():
    ladder, batches = ladder_for(PeakModel({0: PHASES}, batch_size=SAMPLES)), LongBatches()
    asked: list[list[int]] = []

    def reduce_max(values: list[int]) -> list[int]:
        asked.append(values)
        return [4]  # another rank's batch needs four

    batches.before_batch(0, NORMAL, ladder, CAPACITY, reduce_max)
    assert asked == [[1]] and ladder.parts.training() == 4
    decision = batches.before_batch(1, LONG, ladder, CAPACITY, reduce_max)
    assert asked[-1] == [2] and ladder.parts.training() == 4
    assert "runs as 4 micro-batches, as a batch on another rank needs (2 predicted at" in decision.reason


def test_an_estimate_that_fails_says_so_once_and_splits_nothing():
    class Broken(PeakModel):
        def peak(self, levels, size_ratio=1.0, samples=None):
            raise RuntimeError("no numbers")

    ladder, batches, said, asked = ladder_for(Broken({0: PHASES}, SAMPLES)), LongBatches(), [], []
    for step in range(3):
        assert batches.before_batch(step, LONG if step else NORMAL, ladder, CAPACITY,
                                    lambda values: asked.append(values) or values, said.append) is None
    assert len(said) == 1 and "RuntimeError: no numbers" in said[0] and ladder.parts.training() == 1
    assert asked == [[1], [1], [1]]  # the ranks still meet: none is left waiting in the collective


def test_a_long_batch_that_runs_out_of_memory_runs_again_in_twice_the_parts_and_is_remembered():
    ladder, batches = ladder_for(PeakModel({0: PHASES}, batch_size=SAMPLES)), LongBatches()
    batches.before_batch(0, NORMAL, ladder, CAPACITY)
    batches.before_batch(1, LONG, ladder, CAPACITY)
    counts, decisions = [ladder.parts.training()], []
    for _ in range(4):
        decision = batches.after_oom(1, ladder, "out of memory in forward of step 1")
        decisions.append(decision)
        counts.append(ladder.parts.training())
    assert counts == [2, 4, 8, 8, 8]  # capped at the batch's samples
    assert decisions[-1] is None  # one sample a part: the ladder's rescue decides
    first = decisions[0]
    assert (first.action, first.rung, first.level) == ("rescue_split", "microbatch", 2)
    assert "this batch only (the levels stay)" in first.reason and ladder.levels["microbatch"] == 0

    observation = StepObservation(step=1, peaks={"after_forward": 1}, capacity_bytes=CAPACITY, static_bytes=0)
    assert not batches.after_step(observation, ladder.levels, 0, 0)  # not judged by the policy
    batches.before_batch(2, NORMAL, ladder, CAPACITY)
    assert ladder.parts.training() == 1  # a normal batch runs whole again
    assert batches.after_oom(2, ladder, "out of memory") is None  # not larger than the reference: the ladder's
    again = batches.before_batch(3, LONG, ladder, CAPACITY)
    assert ladder.parts.training() == 8 and again.action == "predicted_split"  # as many parts as it needed
    assert "as that one needed" in again.reason


def test_with_several_ranks_the_agreed_parts_split_every_ranks_batch_and_only_the_long_one_is_remembered():
    """After an OOM, each rank says in how many parts its own batch would run again (0: not a long one); every rank
    splits by the largest, so a rank with an ordinary batch splits it too instead of raising the ladder's level."""
    ranks = [(ladder_for(PeakModel({0: PHASES}, batch_size=SAMPLES)), LongBatches()) for _ in range(2)]
    for (ladder, batches), batch in zip(ranks, (NORMAL, LONG)):  # rank 0's batch is ordinary, rank 1's long
        batches.before_batch(0, NORMAL, ladder, CAPACITY)
        batches.before_batch(1, batch, ladder, CAPACITY)
    running = [ladder.parts.training() for ladder, _ in ranks]
    own = [batches.oom_parts(ladder) for ladder, batches in ranks]
    assert own[0] == 0 and own[1] == 2 * running[1]
    assert [ladder.parts.training() for ladder, _ in ranks] == running  # asking changes nothing
    decisions = [batches.after_oom(1, ladder, "out of memory", agreed=max(own)) for ladder, batches in ranks]
    assert [(d.action, d.level) for d in decisions] == [("rescue_split", own[1].bit_length() - 1)] * 2
    assert "a larger batch on another rank" in decisions[0].reason
    assert [ladder.parts.training() for ladder, _ in ranks] == [own[1]] * 2
    assert all(ladder.levels["microbatch"] == 0 for ladder, _ in ranks)  # the levels stay on both
    observation = StepObservation(step=1, peaks={"after_forward": 1}, capacity_bytes=CAPACITY, static_bytes=0)
    assert not any(batches.after_step(observation, ladder.levels, 0, 0) for ladder, batches in ranks)
    learned = [ladder.parts.learned_for(384, SAMPLES) for ladder, _ in ranks]
    assert learned == [1, own[1]]  # rank 0's ordinary batch does not start split from now on
    assert all(batches.after_oom(2, ladder, "out of memory", agreed=0) is None for ladder, batches in ranks)


def test_a_batch_size_is_read_in_one_walk():
    size = BatchSize.of({"x": LONG[0], "y": LONG[1], "note": "kept"})
    assert (size.samples, size.elements, size.bytes) == (SAMPLES, 384, 1536)
    assert size == BatchSize(SAMPLES, 384, 1536) and hash(size) == hash(BatchSize(SAMPLES, 384, 1536))
    assert size.part_elements(3) == 384 * 3 / SAMPLES  # the largest of 3 parts holds 3 samples
