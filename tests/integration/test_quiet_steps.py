"""Two CPU processes (gloo), DistributedDataParallel and the plain-loop guard: a quiet step costs the ranks no
collective of their own — whether any rank had news travels inside the gradients' own all-reduce — and a step where
only rank 1 crosses the threshold in its forward is decided on by both ranks, with the same rung, at that step's end
(the news rides the same step's backward)."""

import pytest
import torch

from tests.ranks import agreed_steps, applied_alike, rank_csvs, train_counting_agreements

STEPS = 7
CROSSING = 3  # rank 1's loss at this step holds 3 MB more through its forward: it alone crosses the threshold, once


@pytest.mark.slow
def test_quiet_steps_cost_no_collective_and_one_ranks_forward_crossing_is_decided_by_both_at_that_step(tmp_path):
    reference = train_counting_agreements(tmp_path / "plain", "ddp", STEPS, CROSSING)
    # a step peaks at ~6.1 MB, rank 1's crossing one at ~9.1 MB, over the budget: the micro-batch rung is raised
    guarded = train_counting_agreements(tmp_path / "guarded", "ddp", STEPS, CROSSING,
                                        {"budget": "8.2MB", "mitigations": ("microbatch",)})
    # the first two steps agree (no bucket carries news before a backward ran after DDP rebuilt its buckets, at the
    # second forward); then only the crossing step (its forward's news heard in its own backward) and the one after
    # it (the rung on trial is judged) — no collective on the quiet steps
    assert [step for step in agreed_steps(tmp_path / "guarded") if step > 1] == [CROSSING, CROSSING + 1]
    events = rank_csvs(tmp_path / "guarded", "memguard_events.csv")
    assert applied_alike(events).to_dict("records") == [{"step": CROSSING, "rung": "microbatch", "level": 1}]
    limit = 0.9 * events[0]["capacity_bytes"].iloc[0]
    peaks = {rank: frame.groupby("step")["peak_bytes"].max()
             for rank, frame in rank_csvs(tmp_path / "guarded", "memguard_history.csv").items()}
    assert peaks[1][CROSSING] >= limit and (peaks[1].drop(CROSSING) < limit).all() and (peaks[0] < limit).all()
    # rank 0 decided on rank 1's crossing: the worst peak since the last agreement, rank 1's at the crossing
    for rank in (0, 1):
        assert events[rank][events[rank]["action"] == "apply"]["peak_before_bytes"].iloc[0] == peaks[1][CROSSING]
    for rank in (0, 1):  # the news element changed no gradient: the run equals plain DDP's
        for name, value in guarded[rank].items():
            torch.testing.assert_close(value, reference[rank][name], atol=2e-5, rtol=1e-4, msg=name)
    for name, value in guarded[0].items():
        torch.testing.assert_close(value, guarded[1][name], msg=name)
