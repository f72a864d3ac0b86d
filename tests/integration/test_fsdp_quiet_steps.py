"""Two CPU processes (gloo), FSDP2 (``fully_shard`` on every block and the root) and the plain-loop guard: a quiet
step costs the ranks no collective of their own — whether any rank had news travels inside the smallest of FSDP2's
own reduce-scatters, one element more in each rank's chunk — and a step where only rank 1 crosses the threshold in its
forward is decided on by both ranks, with the same rung, at that step's end. The carried element changes no gradient:
the parameters equal an unguarded FSDP2 run's bit for bit (checkpointing recomputes the same ops). With the micro-batch
rung and a long batch on one rank: tests/integration/test_fsdp_long_batch.py."""

import json
import os

import pandas as pd
import pytest
import torch

from tests.helpers import applied_by_rank, gloo_group, guard_counting_agreements, mse, rank_csvs, wrap_for
from tests.models import Stack, regression_batches
from tests.spawn import spawn_ranks

STEPS = 7
CROSSING = 3  # rank 1's loss at this step holds 3 MB more through its forward: it alone crosses the threshold, once


def _worker(rank: int, root: str, budget) -> None:
    with gloo_group(rank, root):
        model = wrap_for(Stack(), "fsdp")  # seeded: the same parameters on both ranks
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        data = [(x[128 * rank:128 * (rank + 1)], y[128 * rank:128 * (rank + 1)])
                for x, y in regression_batches(STEPS, size=256)]
        if budget is None:
            for batch in data:
                optimizer.zero_grad(set_to_none=True)
                mse(model, batch).backward()
                optimizer.step()
        else:
            guard_counting_agreements(model, optimizer, data, root, rank, CROSSING, budget=budget,
                                      mitigations=("checkpointing",))
        full = {name: value.full_tensor().detach().clone() for name, value in model.state_dict().items()}
        torch.save(full, os.path.join(root, f"parameters.rank{rank}.pt"))


def _train(root, budget=None) -> dict:
    os.makedirs(root, exist_ok=True)
    spawn_ranks(_worker, (str(root), budget), timeout_s=240)
    return {rank: torch.load(os.path.join(root, f"parameters.rank{rank}.pt")) for rank in (0, 1)}


@pytest.mark.slow
def test_quiet_steps_cost_no_collective_under_fsdp2_and_a_forward_crossing_is_decided_by_both_at_that_step(tmp_path):
    reference = _train(tmp_path / "plain")
    # a budget whose threshold line lies between a step's peak and rank 1's crossing step's (3 MB more)
    probe = _train(tmp_path / "probe", budget="1GB")
    del probe
    peaks = {rank: frame.groupby("step")["peak_bytes"].max()
             for rank, frame in rank_csvs(tmp_path / "probe", "memguard_history.csv").items()}
    quiet = max(peaks[0].max(), peaks[1].drop(CROSSING).max())
    assert peaks[1][CROSSING] > quiet + 2_500_000
    budget = int((quiet + 1_000_000) / 0.9)
    guarded = _train(tmp_path / "guarded", budget=budget)

    agreed = {rank: json.load(open(tmp_path / "guarded" / f"agreed.rank{rank}.json")) for rank in (0, 1)}
    assert agreed[0] == agreed[1]  # every collective met on both ranks
    # the first step agrees (no reduce-scatter has carried news yet); then only the crossing step (its forward's news
    # heard in its own backward) and the one after it (the rung on trial is judged)
    assert [step for step in agreed[0] if step > 0] == [CROSSING, CROSSING + 1]
    events = rank_csvs(tmp_path / "guarded", "memguard_events.csv")
    applied = applied_by_rank(events)
    pd.testing.assert_frame_equal(applied[0], applied[1])  # the same rung at the same step on both ranks
    assert applied[0][["step", "rung"]].to_dict("records") == [{"step": CROSSING, "rung": "checkpointing"}]
    for rank in (0, 1):  # the news element changed no gradient, nor did checkpointing
        for name, value in guarded[rank].items():
            torch.testing.assert_close(value, reference[rank][name], atol=0, rtol=0, msg=name)
