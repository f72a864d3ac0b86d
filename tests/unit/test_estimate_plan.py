"""choose_levels on peak models worked by hand: the one choice plan_configuration and plan_at_start make."""

from lightning_memguard.base.prediction import PeakModel, PhaseEstimate, cheapest_levels, floor_bytes
from lightning_memguard.estimate.plan import choose_levels

MiB = 2**20


def peaks(forward_mib, amp_forward_mib=None, held=10, optimizer=20, batch=1, batch_size=None):
    """A peak model whose step peaks in the forward at ``forward_mib`` per checkpointed-block count (the backward
    lower), with ``amp_forward_mib`` in mixed precision where given."""

    def phases(forward):
        forward = [f * MiB for f in forward]
        return PhaseEstimate(forward, [f // 2 for f in forward], optimizer * MiB, held * MiB, 0, batch * MiB)

    by_amp = {0: phases(forward_mib)}
    if amp_forward_mib is not None:
        by_amp[1] = phases(amp_forward_mib)
    return PeakModel(by_amp, batch_size)


def test_the_fewest_blocks_that_fit_and_full_precision_at_a_tie():
    model = peaks((100, 90, 80, 70, 60), amp_forward_mib=(75, 70, 65, 60, 55))
    plan = choose_levels(model, 85 * MiB)
    assert (plan.amp, plan.checkpointed_blocks, plan.fits, plan.expected_peak_bytes) == (True, 0, True, 75 * MiB)
    plan = choose_levels(model, 85 * MiB, amp=False)
    assert (plan.amp, plan.checkpointed_blocks, plan.expected_peak_bytes) == (False, 2, 80 * MiB)
    assert plan.n_blocks == 4 and "checkpointing 2/4 blocks is the cheapest" in plan.reason
    # a tie in blocks keeps full precision
    plan = choose_levels(peaks((100, 50, 40), amp_forward_mib=(90, 45, 40)), 60 * MiB)
    assert (plan.amp, plan.checkpointed_blocks) == (False, 1)


def test_block_counts_between_none_and_all_are_measured_where_given():
    model = peaks((100, 90, 80, 70, 60))  # the model's line says 2 blocks fit under 85 MiB
    asked = []

    def measure(amp, blocks):
        asked.append((amp, blocks))
        return (100, 95, 90, 84, 60)[blocks] * MiB  # the estimates say 3

    plan = choose_levels(model, 85 * MiB, amp=False, measure=measure)
    assert plan.checkpointed_blocks == 3 and plan.expected_peak_bytes == 84 * MiB
    assert asked and all(0 < blocks < 4 for _, blocks in asked)  # none and all come from the model


def test_the_configurations_a_plan_lists_read_in_order_whatever_order_they_were_estimated_in():
    def measure(amp, blocks):
        return (100, 95, 90, 84, 60)[blocks] * MiB

    plan = choose_levels(peaks((100, 90, 80, 70, 60), amp_forward_mib=(95, 85, 75, 65, 55)), 85 * MiB,
                         measure=measure)
    listed = plan.reason[plan.reason.index("(") + 1:].split("; ")
    configurations = [(text.split("+")[0], int(text.split("+")[1].split()[0])) for text in listed]
    assert len(configurations) > 2 and configurations == sorted(configurations, key=lambda c: (c[0] == "amp", c[1]))


def test_a_plan_estimates_the_block_count_the_line_picks_not_every_count_a_bisection_passes():
    """16 blocks, the model's line exact at none, one and all: the estimates put every count 2 MiB over the line. A
    bisection would estimate four counts; the plan estimates the one the line picks (over), then the next (fits)."""
    line = [100 - 2.5 * blocks for blocks in range(17)]  # 100 ... 60 MiB
    model = peaks(line)
    asked = []

    def measure(amp, blocks):
        asked.append(blocks)
        return int((line[blocks] + 2) * MiB)

    plan = choose_levels(model, 80 * MiB, amp=False, measure=measure)
    # the line says 8 blocks (80 MiB); estimated, 8 is at 82 and 9 at 79.5
    assert (plan.checkpointed_blocks, plan.expected_peak_bytes) == (9, int(79.5 * MiB))
    assert asked == [8, 9]
    # the reason lists what was estimated, not the line's guesses
    assert "fp32+8 blocks: 82.0 MiB" in plan.reason and "fp32+7 blocks" not in plan.reason


def test_a_count_the_line_puts_a_little_over_is_estimated_where_it_would_be_cheaper():
    """The line is a few per cent off either way: where it puts one block fewer just over the limit (within 3 %),
    that count is estimated, and chosen where it fits — also where it decides which precision needs fewer blocks."""
    line = (100, 95, 90, 85, 80, 75, 70)
    model = peaks(line, amp_forward_mib=(90, 86, 82, 78, 74, 70, 66))
    measured = {(False, blocks): line[blocks] - 1 for blocks in range(7)}
    measured.update({(True, blocks): (90, 86, 81, 76, 71, 66, 66)[blocks] for blocks in range(7)})
    asked = []

    def measure(amp, blocks):
        asked.append((amp, blocks))
        return measured[(amp, blocks)] * MiB

    # under 76 MiB the line needs 5 blocks in full precision (75) and 4 with AMP (74); 3 with AMP is 78 on the line
    # (2.6 % over), 76 estimated: fits. Full precision at 4 blocks (80 on the line, 5 % over) is not estimated
    plan = choose_levels(model, 76 * MiB, measure=measure)
    assert (plan.amp, plan.checkpointed_blocks, plan.expected_peak_bytes) == (True, 3, 76 * MiB)
    # (one block is the model's own estimate: read, never made again)
    assert {(amp, blocks) for amp, blocks in asked if blocks != 1} == {(True, 3)}


def test_where_some_precision_fits_with_no_block_no_block_count_is_estimated():
    """A model whose block counts are estimated when first read (as the guard's first batch leaves it): where AMP
    with no block fits, neither precision's block counts are read, so none is estimated."""
    from lightning_memguard.base.prediction import LaterPeaks

    made = []

    def phases(forward, backward, amp):
        def rest():
            made.append(amp)
            return [forward * MiB] * 5, [backward * MiB] * 5

        f, b = LaterPeaks.pair(forward * MiB, backward * MiB, 5, rest)
        return PhaseEstimate(f, b, 20 * MiB, 10 * MiB, 0, MiB)

    model = PeakModel({0: phases(100, 50, 0), 1: phases(70, 40, 1)})
    plan = choose_levels(model, 85 * MiB)
    assert (plan.amp, plan.checkpointed_blocks) == (True, 0) and made == []
    levels, peak = cheapest_levels(model.peak, {}, {"amp": 1, "checkpointing": 4}, lambda micro: 85 * MiB)
    assert levels == {"amp": 1, "checkpointing": 0, "microbatch": 0} and made == []


def test_under_a_cap_on_reserved_memory_the_segments_must_fit_too():
    # the allocated peaks say 2 blocks fit under the line (90 % of 100 MiB); the caching allocator's segments (130, 112,
    # 104 and 101 MiB from none to 3 blocks) fit the 100 MiB cap with 4 blocks only (the H200's AMP + 12/16 blocks:
    # allocated 84 % of its memory fraction, out of memory under it); the expected peak stays the allocated one
    model = peaks((100, 95, 85, 80, 60))
    reserved = {0: 130, 1: 112, 2: 104, 3: 101, 4: 70}

    def held(amp, blocks):
        return reserved[blocks] * MiB

    assert choose_levels(model, 90 * MiB, amp=False).checkpointed_blocks == 2
    plan = choose_levels(model, 90 * MiB, amp=False, reserved=held, reserved_limit=100 * MiB)
    assert (plan.checkpointed_blocks, plan.fits, plan.expected_peak_bytes) == (4, True, 60 * MiB)
    # 3 blocks: 101 MiB of segments over the cap reads as 90.9 MiB against the 90 MiB line
    assert "fp32+3 blocks: 90.9 MiB" in plan.reason
    # where the estimate has no reserved figure (a CPU target), the allocated peaks alone decide
    assert choose_levels(model, 90 * MiB, amp=False, reserved=lambda amp, blocks: None,
                         reserved_limit=100 * MiB).checkpointed_blocks == 2


def test_a_checking_search_reads_no_segments_where_the_allocated_peak_is_over_every_aim_already():
    """Each reading of a split's segments is an estimate; where the allocated peak is over every aim the reading could
    only raise it, so it is not made."""
    from lightning_memguard.base.prediction import ReservedSegments

    asked = []

    def split(amp, blocks, level, peak):
        asked.append((blocks, level))
        return peak + 30 * MiB

    segments = ReservedSegments(None, split, 100 * MiB, 90 * MiB)
    segments.checking = True
    assert segments.peak({"amp": 0, "checkpointing": 0, "microbatch": 1}, 95 * MiB) == 95 * MiB and asked == []
    # under the aim: read, and its segments (110 MiB, over the 100 MiB cap) put it over in the aim's units
    assert segments.peak({"amp": 0, "checkpointing": 2, "microbatch": 1}, 80 * MiB) == 99 * MiB
    assert asked == [(2, 1)]


def test_micro_batches_where_nothing_else_fits_and_the_state_that_cannot():
    model = peaks((300, 200, 160), held=40, batch_size=16)
    plan = choose_levels(model, 90 * MiB, amp=False)
    assert not plan.fits and plan.checkpointed_blocks == 2 and plan.micro_batch_level == 0
    split = choose_levels(model, 90 * MiB, amp=False, micro_batch_levels=4, micro_batch_aim=0.95 * 90 * MiB)
    # 40 MiB held; 2 micro-batches add half the activations (100 MiB with every block, over 85.5 MiB), 4 a quarter:
    # 70 MiB with 2 blocks, 80 MiB with 1 (160 MiB of activations / 4), 105 MiB with none. The fewest blocks win
    assert (split.fits, split.micro_batch_level, split.checkpointed_blocks) == (True, 2, 1)
    assert split.expected_peak_bytes == 80 * MiB
    assert "with checkpointing 1/2 blocks + 4 micro-batches a step is predicted at 80.0 MiB, which fits" in split.reason
    # parameters, gradients and optimizer state (the held bytes without the batch) over the limit: said first
    heavy = choose_levels(peaks((300, 200, 160), held=100, batch=5), 90 * MiB)
    assert not heavy.fits and heavy.reason.startswith("the training state cannot fit") and "95.0 MiB" in heavy.reason
    assert "an optimizer with less state" in heavy.reason and "lighter weights" in heavy.reason  # parts unknown
    # the same over a LoRA's frozen base (its adapters' gradients and state small): lighter or sharded weights only
    lora = choose_levels(peaks((300, 200, 160), held=100, batch=5), 90 * MiB,
                         sizes={"parameters": 92 * MiB, "gradients": 1 * MiB, "optimizer_state": 2 * MiB})
    assert lora.reason.startswith("the training state cannot fit") and "lighter weights" in lora.reason
    assert "an optimizer with less state" not in lora.reason and "fewer trainable parameters" not in lora.reason



def test_where_nothing_fits_the_lowest_peak_is_planned_a_split_included():
    """84 MiB held: no split fits under 85.5 MiB (16 micro-batches with every block: 84 + 76 / 16 = 88.75), and the
    whole batch's lowest is 160. The plan is the lowest peak of all, said not to fit — the split, as the closed loop
    would climb to it, not a whole batch that runs out of memory at once."""
    model = peaks((300, 200, 160), held=84, batch_size=16)
    lowest = {"amp": 0, "checkpointing": 2, "microbatch": 4}
    assert model.peak(lowest) < min(model.peak({**lowest, "microbatch": level}) for level in range(4))
    plan = choose_levels(model, 90 * MiB, amp=False, micro_batch_levels=4, micro_batch_aim=0.95 * 90 * MiB)
    assert not plan.fits and (plan.micro_batch_level, plan.checkpointed_blocks) == (4, 2)
    assert plan.expected_peak_bytes == model.peak(lowest) > 0.95 * 90 * MiB
    assert plan.reason.startswith("no configuration of the whole batch estimated fits under 90.0 MiB")
    assert "+ 16 micro-batches a step is predicted at 88.8 MiB, the lowest of any configuration estimated" in \
        plan.reason
    # a whole batch at its lowest where no split is lower (none allowed here)
    whole = choose_levels(model, 90 * MiB, amp=False)
    assert not whole.fits and (whole.micro_batch_level, whole.checkpointed_blocks) == (0, 2)


def test_a_split_planned_under_a_higher_line_than_the_whole_batch_s_says_why_the_lines_differ():
    """The guard's split aims nearer the capacity than AMP and checkpointing do: the reason names both lines, or
    "no configuration fits under 90 MiB ... fits under 95 MiB" reads as a contradiction."""
    model = peaks((300, 200, 160), held=40, batch_size=16)
    plan = choose_levels(model, 90 * MiB, amp=False, micro_batch_levels=4, micro_batch_aim=95 * MiB)
    assert plan.fits and plan.micro_batch_level >= 1
    assert plan.reason.startswith("no configuration of the whole batch estimated fits under 90.0 MiB")
    assert ("which fits under 95.0 MiB (a split may come nearer the capacity than the whole batch's 90.0 MiB: "
            "micro-batching is the last rung)") in plan.reason
    same_line = choose_levels(model, 90 * MiB, amp=False, micro_batch_levels=4)
    assert same_line.fits and "nearer the capacity" not in same_line.reason


def test_under_a_cap_on_reserved_memory_a_splits_segments_must_fit_too():
    # 4 micro-batches: 1 block is the split the allocated peaks choose (80 MiB, under the 85.5 MiB aim); a micro-batch's
    # step holds 30 MiB of the caching allocator's cache over its allocated peak, so its segments are at 110 MiB, over
    # the 100 MiB cap; with 2 blocks 70 + 30 = 100 fits
    model = peaks((300, 200, 160), held=40, batch_size=16)
    asked = []

    def segments(amp, blocks, level, peak):
        asked.append((amp, blocks, level))
        return peak + 30 * MiB

    split = dict(amp=False, micro_batch_levels=4, micro_batch_aim=85.5 * MiB)
    plan = choose_levels(model, 90 * MiB, **split)
    assert (plan.micro_batch_level, plan.checkpointed_blocks) == (2, 1)
    plan = choose_levels(model, 90 * MiB, **split, split_reserved=segments, reserved_limit=100 * MiB)
    assert (plan.micro_batch_level, plan.checkpointed_blocks, plan.fits) == (2, 2, True)
    assert plan.expected_peak_bytes == 70 * MiB  # the allocated peak, as for a whole batch
    assert "(the caching allocator's segments at 100.0 MiB), which fits under 85.5 MiB and the 100.0 MiB cap" in \
        plan.reason
    assert asked[0] == (False, 1, 2) and set(asked) <= {(False, b, level) for b in (0, 1, 2) for level in (1, 2)}
    # a split whose segments fit costs one estimate: the one of the split the allocated peaks chose
    asked.clear()
    plan = choose_levels(model, 90 * MiB, **split, split_reserved=segments, reserved_limit=110 * MiB)
    assert (plan.micro_batch_level, plan.checkpointed_blocks, plan.fits) == (2, 1, True) and asked == [(False, 1, 2)]
    # no split's segments under the cap: the allocated peaks' choice, said not to fit
    plan = choose_levels(model, 90 * MiB, **split, split_reserved=lambda *a: 200 * MiB, reserved_limit=100 * MiB)
    assert (plan.micro_batch_level, plan.checkpointed_blocks, plan.fits) == (2, 1, False)
    assert "no split's segments are predicted under the 100.0 MiB cap" in plan.reason
    # no reserved figure (a CPU target, allocator options the model does not cover): the allocated peaks decide
    plan = choose_levels(model, 90 * MiB, **split, split_reserved=lambda *a: None, reserved_limit=100 * MiB)
    assert (plan.micro_batch_level, plan.checkpointed_blocks, plan.fits) == (2, 1, True)


def test_the_cheapest_combination_takes_every_rung_together():
    """AMP, some blocks and micro-batches together: the fewest micro-batches first, then the fewest blocks, then full
    precision; never below the levels a rescue starts from."""
    model = peaks((300, 240, 200, 180, 160), amp_forward_mib=(200, 160, 130, 110, 100), held=40, batch_size=16)
    tops = {"amp": 1, "checkpointing": 4, "microbatch": 4}
    start = {"amp": 0, "checkpointing": 0, "microbatch": 0}
    # whole batches: nothing under 90 MiB; 2 micro-batches: AMP + 4 blocks is 40 + 60 / 2 = 70, AMP + 2 blocks 85
    levels, peak = cheapest_levels(model.peak, start, tops, lambda micro: 90 * MiB)
    assert levels == {"amp": 1, "checkpointing": 2, "microbatch": 1} and peak == 85 * MiB
    # from levels already raised, never lower
    levels, _ = cheapest_levels(model.peak, {"amp": 0, "checkpointing": 3, "microbatch": 0}, tops,
                                lambda micro: 90 * MiB)
    assert levels == {"amp": 1, "checkpointing": 3, "microbatch": 1}
    # a rung missing from tops stays where it is: without AMP 2 micro-batches do not fit (40 + 120 / 2 = 100 with
    # every block), 4 do with 1 block (40 + 200 / 4 = 90)
    levels, peak = cheapest_levels(model.peak, start, {"checkpointing": 4, "microbatch": 4}, lambda micro: 90 * MiB)
    assert levels == {"amp": 0, "checkpointing": 1, "microbatch": 2} and peak == 90 * MiB
    assert cheapest_levels(model.peak, start, {"checkpointing": 4}, lambda micro: 90 * MiB) is None
    assert floor_bytes(model) == 40 * MiB


def cheap_and_micro_aims(micro):
    """The policy's aims at a 100 MiB capacity and a 0.9 threshold, micro-batching the last resort: 95 % of the
    90 MiB limit for a step without micro-batches (and for the cheap rungs of one with), 95 % of the capacity with."""
    return 0.95 * (100 if micro else 90) * MiB


def test_with_micro_batches_the_blocks_go_under_the_threshold_aim_where_some_reach_it():
    """4 micro-batches are the fewest that fit under 95 MiB; 1 block fits there (90 MiB) but leaves the step over
    the threshold's 85.5 MiB, where the closed loop would raise checkpointing after the first step: 2 blocks (80)."""
    model = peaks((300, 240, 200, 180, 170), held=40, batch_size=16)  # 2 parts: 40 + 130 / 2 = 105 at best
    start, tops = {"amp": 0, "checkpointing": 0, "microbatch": 0}, {"checkpointing": 4, "microbatch": 4}
    levels, peak = cheapest_levels(model.peak, start, tops, cheap_and_micro_aims)
    assert levels == {"amp": 0, "checkpointing": 2, "microbatch": 2} and peak == 80 * MiB
    # never more micro-batches for it: 8 would fit 85.5 MiB with no block (40 + 260 / 8 = 72.5)
    assert model.peak({"microbatch": 3}) < 85.5 * MiB
    # one aim for the whole combination (micro-batching not the last resort): the fewest blocks under it, as before
    levels, _ = cheapest_levels(model.peak, start, tops, lambda micro: 95 * MiB)
    assert levels == {"amp": 0, "checkpointing": 1, "microbatch": 2}
    # AMP is a cheap rung too: with 4 micro-batches and 1 block, full precision is at 90 MiB and mixed precision at
    # 85 (40 + 180 / 4), under 85.5; full precision wins a tie in blocks only where it is under the aim too
    mixed = peaks((300, 240, 200, 180, 170), amp_forward_mib=(280, 220, 180, 170, 160), held=40, batch_size=16)
    levels, peak = cheapest_levels(mixed.peak, start, {**tops, "amp": 1}, cheap_and_micro_aims)
    assert levels == {"amp": 1, "checkpointing": 1, "microbatch": 2} and peak == 85 * MiB
    levels, _ = cheapest_levels(mixed.peak, start, {**tops, "amp": 1}, lambda micro: 95 * MiB)
    assert levels == {"amp": 0, "checkpointing": 1, "microbatch": 2}
    # the plan before the first step makes the same choice, given the policy's aims
    plan = choose_levels(model, 90 * MiB, amp=False, micro_batch_levels=4, micro_batch_aim=95 * MiB,
                         cheap_rungs_aim=85.5 * MiB)
    assert (plan.micro_batch_level, plan.checkpointed_blocks, plan.expected_peak_bytes) == (2, 2, 80 * MiB)
    assert choose_levels(model, 90 * MiB, amp=False, micro_batch_levels=4,
                         micro_batch_aim=95 * MiB).checkpointed_blocks == 1  # cheap rungs aimed at the 90 MiB limit


def test_with_micro_batches_where_no_block_count_reaches_the_threshold_aim_every_block_is_checkpointed():
    """60 MiB held: with 4 micro-batches 2 blocks fit under 95 MiB (60 + 140 / 4), and no block count brings the
    step under 85.5 MiB (every block: 91). The closed loop, when such a step crosses the threshold, takes
    checkpointing to its top (no level is predicted under its aim): the plan goes there at once."""
    model = peaks((300, 240, 200, 190, 184), held=60, batch_size=16)
    start, tops = {"amp": 0, "checkpointing": 0, "microbatch": 0}, {"checkpointing": 4, "microbatch": 4}
    levels, peak = cheapest_levels(model.peak, start, tops, cheap_and_micro_aims)
    assert levels == {"amp": 0, "checkpointing": 4, "microbatch": 2} and peak == 91 * MiB
    # without the cheap aim below the micro-batch aim, the fewest blocks under 95 MiB, as before
    levels, peak = cheapest_levels(model.peak, start, tops, lambda micro: 95 * MiB)
    assert levels == {"amp": 0, "checkpointing": 2, "microbatch": 2} and peak == 95 * MiB
    # and a rung missing from tops is not raised for it
    levels, _ = cheapest_levels(model.peak, {**start, "checkpointing": 2}, {"microbatch": 4}, cheap_and_micro_aims)
    assert levels == {"amp": 0, "checkpointing": 2, "microbatch": 2}


def test_a_cuda_plan_keeps_the_allocators_predicted_segments_under_the_capacity(monkeypatch):
    # a real estimate on meta: the allocator model's reserved bytes are ~35 % over the allocated peak here; with the
    # capacity set between them, the allocated peaks alone would change nothing while the segments need blocks
    import warnings

    import torch

    from lightning_memguard import estimate_memory
    from lightning_memguard.commands.demo import TinyGPT
    from lightning_memguard.estimate.plan import plan_configuration

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # the allocator's default policy
        monkeypatch.delenv(name, raising=False)
    torch.manual_seed(0)
    model = TinyGPT(d_model=256, nhead=4, nlayers=4, seq_len=512, batch_size=8, vocab_size=8000)
    batch = next(iter(model.train_dataloader()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = [estimate_memory(model, batch, precision="bf16-mixed", target="cuda", checkpointed_blocks=k)
                for k in range(5)]
        assert all(r.reserved_bytes > r.peak_bytes for r in runs)
        capacity = (runs[1].reserved_bytes + runs[2].reserved_bytes) // 2  # 2 blocks: the fewest whose segments fit
        assert runs[0].peak_bytes < 0.9 * capacity < runs[0].reserved_bytes
        plan = plan_configuration(model, batch, capacity, target="cuda", precision="bf16-mixed")
    assert (plan.checkpointed_blocks, plan.fits) == (2, True)
    assert plan.expected_peak_bytes == runs[2].peak_bytes  # the expected peak is still what the allocator hands out
    # with expandable segments the model's segments are no prediction: the allocated peaks alone decide, as before
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_configuration(model, batch, capacity, target="cuda", precision="bf16-mixed")
    assert (plan.checkpointed_blocks, plan.fits) == (0, True)
    # a CPU target has no caching allocator: no reserved figure
    assert estimate_memory(torch.nn.Linear(4, 2), torch.randn(3, 4), target="cpu").reserved_bytes is None


def test_the_default_plan_is_made_where_only_the_predicted_segments_are_over_a_cap():
    import torch
    from torch import nn

    from lightning_memguard.base.batches import BatchSize
    from lightning_memguard.estimate.plan import StepPredictions
    from lightning_memguard.guard.ladder import Ladder
    from lightning_memguard.guard.planning import needs_plan

    ladder = Ladder(("checkpointing",), 0.9, None, 0.03, warn=lambda message: None)  # no blocks: no rung, no matter
    ladder.setup(nn.Linear(2, 2), torch.device("cpu"), None, guarding=True)
    model = peaks((80, 75, 70, 65, 60))  # allocated: 80 MiB, under 95 % of a 100 MiB capacity
    asked = []

    def segments(amp, blocks):
        asked.append((amp, blocks))
        return 104 * MiB

    predictions = StepPredictions(model, None, None, {}, segments)
    ladder.predictor.use(predictions, BatchSize.of(torch.zeros(4, 2)))
    assert not needs_plan(ladder, 100 * MiB)  # a budget=: the allocated peak alone is the line's business
    assert needs_plan(ladder, 100 * MiB, capped=True) and asked == [(False, 0)]
    assert not needs_plan(ladder, 110 * MiB, capped=True)


def test_a_cuda_plan_that_splits_keeps_its_micro_batchs_predicted_segments_under_a_cap(monkeypatch):
    """Through the plan before the first step, on real estimates (meta, target cuda): at a 500 MiB cap no whole batch
    fits and two micro-batches with 2 of 4 blocks are what the allocated peaks choose; a micro-batch's step is
    estimated to reserve more than the cap holds with them, so the capped plan checkpoints one more block."""
    import warnings

    import torch

    from lightning_memguard.commands.demo import TinyGPT
    from lightning_memguard.guard.ladder import Ladder
    from lightning_memguard.guard.planning import plan_at_start

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # the allocator's default policy
        monkeypatch.delenv(name, raising=False)
    capacity, said = 500 * MiB, []

    def planned(capped):
        torch.manual_seed(0)  # a model of its own: the plan checkpoints its blocks
        model = TinyGPT(d_model=256, nhead=4, nlayers=4, seq_len=512, batch_size=8, vocab_size=8000)
        batch = next(iter(model.train_dataloader()))
        ladder = Ladder(("checkpointing", "microbatch"), 0.9, None, 0.03, warn=said.append)
        ladder.setup(model, torch.device("cpu"), None, guarding=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ladder.note_batch(batch, model, "cuda")
            decisions = plan_at_start(ladder, model, batch, capacity, 0, cuda=True, warn=said.append, capped=capped)
        return ladder, decisions

    ladder, decisions = planned(capped=False)
    predictions = ladder.predictor.predictions
    assert predictions.model.peak({"checkpointing": 4}) > 0.9 * capacity  # no whole batch fits the line
    assert (ladder.levels["microbatch"], ladder.levels["checkpointing"]) == (1, 2)
    plans = [d for d in decisions if d.action == "plan"]
    # an event a rung the plan put on, in the ladder's order, each with its level and the plan's one reason
    assert [(d.rung, d.level) for d in plans] == [("checkpointing", 2), ("microbatch", 1)]
    assert len({(d.reason, d.peak_before_bytes) for d in plans}) == 1
    plan = plans[0]
    assert "segments" not in plan.reason  # no cap on reserved memory (a budget=): the allocated peaks alone
    two_blocks = plan.peak_before_bytes  # the allocated peak, estimated at 2 blocks
    assert two_blocks < capacity < predictions.split_reserved(False, 2, 1, two_blocks)
    ladder, decisions = planned(capped=True)
    assert (ladder.levels["microbatch"], ladder.levels["checkpointing"]) == (1, 3)
    plan = next(d for d in decisions if d.action == "plan")
    held = ladder.predictor.predictions.split_reserved(False, 3, 1, plan.peak_before_bytes)
    assert held <= capacity and f"the caching allocator's segments at {held / MiB:.1f} MiB" in plan.reason
    # allocator options the model does not replay: no segments predicted, the allocated peaks' split stands
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    ladder, _ = planned(capped=True)
    assert (ladder.levels["microbatch"], ladder.levels["checkpointing"]) == (1, 2)
    # the plans fit: nothing said of them (what is said is the micro-batches' caveat)
    assert said and all(message.startswith("lightning-memguard: micro-batching weights") for message in said)


def test_a_micro_batch_that_cannot_be_estimated_leaves_the_split_to_its_allocated_peak_with_one_warning():
    """A model that takes batches of 8 samples only: its step on the whole batch is estimated, its step on a part is
    not. The split's segments are then unknown (one warning, never an error) and the allocated peaks decide."""
    import warnings

    import pytest
    import torch

    from lightning_memguard.estimate.plan import ladder_predictions
    from tests.models import Stack

    class EightOnly(Stack):
        def forward(self, x):
            if x.shape[0] != 8:
                raise ValueError(f"this model takes batches of 8 samples, not {x.shape[0]}")
            return super().forward(x)

    model, batch = EightOnly(width=64, depth=4), torch.randn(8, 4096, 16)  # activations well over the state
    predictions = ladder_predictions(model, batch, target="cuda")
    peak = predictions.model.peak({"microbatch": 1})
    with pytest.warns(UserWarning, match="segments of a micro-batch's step could not be estimated.*8 samples, not 4"):
        assert predictions.split_reserved(False, 0, 1, peak) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: no estimate is tried again
        assert predictions.split_reserved(False, 4, 2, peak) is None
        whole = predictions.model.peak({})
        plan = choose_levels(predictions.model, int(0.9 * whole), amp=False, checkpointing=False, micro_batch_levels=3,
                             split_reserved=predictions.split_reserved, reserved_limit=whole)
    assert plan.fits and plan.micro_batch_level >= 1 and "segments" not in plan.reason


def test_the_segments_reading_shared_by_the_plan_the_rescue_and_the_speed_trial():
    from lightning_memguard.base.prediction import ReservedSegments

    asked = []

    def whole(amp, blocks):
        asked.append(("whole", amp, blocks))
        return (120 - 10 * blocks) * MiB if blocks < 4 else None  # 4 blocks: no reserved figure

    def split(amp, blocks, level, peak):
        asked.append(("split", amp, blocks, level, peak))
        return peak + 30 * MiB

    segments = ReservedSegments(whole, split, 100 * MiB, 95 * MiB)
    assert segments.over({"amp": 0, "checkpointing": 1}, 80 * MiB)  # 110 MiB of segments over the 100 MiB cap
    assert not segments.over({"checkpointing": 2}, 70 * MiB) and not segments.over({"checkpointing": 4}, 60 * MiB)
    # a whole batch's segments are read once whatever the peak; a split's with the peak it holds on top
    assert segments.of({"checkpointing": 1}, 1) == 110 * MiB and segments.of({"microbatch": 1}, 60 * MiB) == 90 * MiB
    assert asked == [("whole", False, 1), ("whole", False, 2), ("whole", False, 4), ("split", False, 0, 1, 60 * MiB)]
    # the search reads the peak as it is until checking; then over the cap reads over the top aim, in proportion
    assert segments.peak({"checkpointing": 1}, 80 * MiB) == 80 * MiB
    segments.checking = True
    assert segments.peak({"checkpointing": 1}, 80 * MiB) == -(-110 * 95 * MiB // 100)
    assert segments.peak({"checkpointing": 2}, 70 * MiB) == 70 * MiB
    assert segments.peak({"checkpointing": 1}, None) is None
    # where the estimate reads none, nothing is over
    assert not ReservedSegments(None, None, 100 * MiB, 95 * MiB).over({"microbatch": 2}, 10**12)
