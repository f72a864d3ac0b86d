"""choose_levels on peak models worked by hand: the one choice plan_configuration and plan_at_start make."""

from lightning_memguard.base.prediction import PeakModel, PhaseEstimate
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


def test_micro_batches_where_nothing_else_fits_and_the_state_that_cannot():
    model = peaks((300, 200, 160), held=40, batch_size=16)
    plan = choose_levels(model, 90 * MiB, amp=False)
    assert not plan.fits and plan.checkpointed_blocks == 2 and plan.micro_batch_level == 0
    split = choose_levels(model, 90 * MiB, amp=False, micro_batch_levels=4, micro_batch_aim=0.95 * 90 * MiB)
    # 40 MiB held + 120 MiB of activations: 2 micro-batches 100 MiB, 4 micro-batches 70 MiB
    assert (split.fits, split.micro_batch_level, split.expected_peak_bytes) == (True, 2, 70 * MiB)
    assert "with 4 micro-batches a step is predicted at 70.0 MiB, which fits" in split.reason
    # parameters, gradients and optimizer state (the held bytes without the batch) over the limit: said first
    heavy = choose_levels(peaks((300, 200, 160), held=100, batch=5), 90 * MiB)
    assert not heavy.fits and heavy.reason.startswith("the optimizer state cannot fit") and "95.0 MiB" in heavy.reason
