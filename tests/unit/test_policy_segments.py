"""The policy's rescue under a cap on what the CUDA caching allocator reserves (the card, a memory fraction), on real
estimates (meta, target cuda): the combination it goes to after an out-of-memory error keeps the allocator's
predicted segments under the cap, not only the allocated peak, so that the rescue is the last OOM."""

import warnings

import pytest
import torch

from lightning_memguard.commands.demo import TinyGPT
from lightning_memguard.guard.ladder import Ladder
from lightning_memguard.guard.policy import StepObservation

MiB = 2**20
CAPACITY = 500 * MiB


@pytest.fixture(autouse=True)
def default_allocator(monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # the allocator's default policy
        monkeypatch.delenv(name, raising=False)


def rescued(capped):
    """The ladder (checkpointing and micro-batching of TinyGPT, its first batch estimated for a CUDA target) and the
    rescue of an OOM in the forward at the levels the run started with, at a 500 MiB capacity."""
    torch.manual_seed(0)
    model = TinyGPT(d_model=256, nhead=4, nlayers=4, seq_len=512, batch_size=8, vocab_size=8000)
    batch = next(iter(model.train_dataloader()))
    ladder = Ladder(("checkpointing", "microbatch"), 0.9, None, 0.03, warn=lambda message: None)
    ladder.setup(model, torch.device("cpu"), None, guarding=True, capped=capped)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ladder.note_batch(batch, model, "cuda")
        held = ladder.predictor.predictions.model.by_amp[0].held_bytes
        # the allocation that failed reached the capacity: the estimate's step (785 MiB) is over it, no scaling
        failed = StepObservation(0, {"batch_start": held, "after_forward": CAPACITY}, CAPACITY, static_bytes=held)
        decisions = ladder.policy.escalate(failed, dict(ladder.levels), "out of memory in forward")
    assert [d.action for d in decisions] == ["rescue", "rescue"]
    return ladder, {d.rung: d.level for d in decisions}, decisions[-1]


def segments(ladder, levels, peak):
    return ladder.predictor.predictions.split_reserved(False, levels["checkpointing"], levels["microbatch"], peak)


def test_a_capped_rescue_goes_to_a_combination_whose_predicted_segments_fit_the_cap():
    ladder, levels, last = rescued(capped=False)
    # no cap on reserved memory (a budget=): the allocated peaks alone choose two micro-batches and 2 of 4 blocks,
    # whose micro-batch's segments the estimate puts over 500 MiB: under a real cap, a second OOM
    assert levels == {"checkpointing": 2, "microbatch": 1}
    allocated = ladder.predictor.peak({"checkpointing": 2, "microbatch": 1})
    assert last.peak_before_bytes == CAPACITY and f"predicted step peak {allocated / MiB:.1f} MiB" in last.reason
    assert allocated < 0.95 * CAPACITY < CAPACITY < segments(ladder, levels, allocated)
    assert "segments" not in last.reason  # a budget= caps no segments: none said
    ladder, levels, last = rescued(capped=True)
    # capped: one more block, whose segments fit (the policy read them as the plan and the speed trial do)
    assert levels == {"checkpointing": 3, "microbatch": 1}
    allocated = ladder.predictor.peak({"checkpointing": 3, "microbatch": 1})
    held = segments(ladder, levels, allocated)
    assert held <= CAPACITY
    # the event says both figures: what will be allocated, and the segments that the cap bites on
    assert f"predicted step peak {allocated / MiB:.1f} MiB; the caching allocator's segments {held / MiB:.1f} MiB, " \
           f"under the capacity {CAPACITY / MiB:.1f} MiB" in last.reason


def test_where_the_segments_are_not_predicted_the_allocated_peaks_choose_the_rescue(monkeypatch):
    # allocator options the model does not replay: no reserved figure, the allocated peaks' combination stands
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    ladder, levels, _ = rescued(capped=True)
    assert segments(ladder, levels, ladder.predictor.peak(levels)) is None
    assert levels == {"checkpointing": 2, "microbatch": 1}


def whole_batch_rescue(capacity, capped):
    """The rescue of an OOM in the forward of TinyGPT's whole batch in bf16 mixed precision, checkpointing its blocks
    only, at ``capacity``; the decision and the first batch's predictions."""
    torch.manual_seed(0)
    model = TinyGPT(d_model=256, nhead=4, nlayers=4, seq_len=512, batch_size=8, vocab_size=8000)
    batch = next(iter(model.train_dataloader()))
    ladder = Ladder(("checkpointing",), 0.9, None, 0.03, warn=lambda message: None)
    ladder.setup(model, torch.device("cpu"), None, guarding=True, capped=capped)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ladder.note_batch(batch, model, "cuda", precision="bf16-mixed")
        predictions = ladder.predictor.predictions
        held = predictions.model.by_amp[0].held_bytes
        failed = StepObservation(0, {"batch_start": held, "after_forward": capacity}, capacity, static_bytes=held)
        (decision,) = ladder.policy.escalate(failed, dict(ladder.levels), "out of memory in forward")
    assert (decision.action, decision.rung) == ("rescue", "checkpointing")
    return decision, predictions


def test_a_capped_rescue_of_a_whole_batch_checkpoints_until_its_predicted_segments_fit():
    """At a 700 MiB cap the step as it is (602 MiB allocated, 815 MiB of segments predicted) ran out of memory; the
    allocated peaks, scaled up to the capacity the failed attempt needed at least, choose 3 of 4 blocks, whose segments
    (718 MiB) are over the cap."""
    capacity, chosen = 700 * MiB, {}
    for capped in (False, True):
        decision, predictions = whole_batch_rescue(capacity, capped)
        assert predictions.model.peak({}) < capacity < predictions.measure_reserved(False, 0)
        chosen[capped] = decision.level
        reserved = predictions.measure_reserved(False, decision.level)
        assert (reserved > capacity) == (not capped)
        assert (f"segments {reserved / MiB:.1f} MiB, under the capacity" in decision.reason) == capped
    assert chosen == {False: 3, True: 4}


def test_where_no_levels_segments_fit_the_cap_the_allocated_peaks_choose_and_the_event_says_so():
    # at 650 MiB even every block checkpointed leaves 696 MiB of segments predicted: the allocated peaks' choice stands
    # (the estimate's best guess), and the event does not pretend that it fits
    capacity = 650 * MiB
    decision, predictions = whole_batch_rescue(capacity, capped=True)
    assert predictions.measure_reserved(False, 4) > capacity
    assert decision.level == whole_batch_rescue(capacity, capped=False)[0].level
    reserved = predictions.measure_reserved(False, decision.level)
    assert f"segments {reserved / MiB:.1f} MiB, still over the capacity {capacity / MiB:.1f} MiB" in decision.reason
