"""Two CPU processes (gloo), FSDP2 (``fully_shard`` on every block and the root) and the plain-loop guard: a quiet
step costs the ranks no collective of their own — whether any rank had news travels inside the smallest of FSDP2's
own reduce-scatters, one element more in each rank's chunk — and a step where only rank 1 crosses the threshold in its
forward is decided on by both ranks, with the same rung, at that step's end. The carried element changes no gradient:
the parameters equal an unguarded FSDP2 run's bit for bit (checkpointing recomputes the same ops). With the micro-batch
rung and a long batch on one rank: tests/integration/test_fsdp_long_batch.py."""

import pytest
import torch

from tests.ranks import agreed_steps, applied_alike, rank_csvs, train_counting_agreements

STEPS = 7
CROSSING = 3  # rank 1's loss at this step holds 3 MB more through its forward: it alone crosses the threshold, once
SETTINGS = {"mitigations": ("checkpointing",)}


@pytest.mark.slow
def test_quiet_steps_cost_no_collective_under_fsdp2_and_a_forward_crossing_is_decided_by_both_at_that_step(tmp_path):
    reference = train_counting_agreements(tmp_path / "plain", "fsdp", STEPS, CROSSING)
    # a budget whose threshold line lies between a step's peak and rank 1's crossing step's (3 MB more)
    train_counting_agreements(tmp_path / "probe", "fsdp", STEPS, CROSSING, SETTINGS | {"budget": "1GB"})
    peaks = {rank: frame.groupby("step")["peak_bytes"].max()
             for rank, frame in rank_csvs(tmp_path / "probe", "memguard_history.csv").items()}
    quiet = max(peaks[0].max(), peaks[1].drop(CROSSING).max())
    assert peaks[1][CROSSING] > quiet + 2_500_000
    budget = int((quiet + 1_000_000) / 0.9)
    guarded = train_counting_agreements(tmp_path / "guarded", "fsdp", STEPS, CROSSING, SETTINGS | {"budget": budget})

    # the first step agrees (no reduce-scatter has carried news yet); then only the crossing step (its forward's news
    # heard in its own backward) and the one after it (the rung on trial is judged)
    assert [step for step in agreed_steps(tmp_path / "guarded") if step > 0] == [CROSSING, CROSSING + 1]
    applied = applied_alike(rank_csvs(tmp_path / "guarded", "memguard_events.csv"))
    assert applied[["step", "rung"]].to_dict("records") == [{"step": CROSSING, "rung": "checkpointing"}]
    for rank in (0, 1):  # the news element changed no gradient, nor did checkpointing
        for name, value in guarded[rank].items():
            torch.testing.assert_close(value, reference[rank][name], atol=0, rtol=0, msg=name)
