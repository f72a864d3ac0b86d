"""MemGuardCallback under Lightning's ``ModelParallelStrategy`` (FSDP2: ``fully_shard`` on every block and the root) on
two CPU gloo ranks, where only rank 1's step needs more memory (tests/integration/fsdp_agree_run.py):

- a threshold only rank 1 crosses: both ranks take the same rung at the same level at the same step, each in its
  own events file, finish every step, and the full parameters equal a run without a budget — checkpointing a
  sharded block recomputes it inside FSDP2's gathering of that block, micro-batches reduce-scatter each part's
  gradients and add them up;
- an out-of-memory error on rank 1 alone (the CPU hard limit) after complete steps, in the forward or in the
  backward: rank 1 carries rank 0 through the rest of FSDP2's collectives, both ranks take the same rung at the same
  step, run the batch again and finish, with the parameters of a run without a budget;
- the same in the first step, before any step showed FSDP2's sequence of collectives: rank 1 stops with the report,
  and rank 0 stops too, with its next collective's error, instead of hanging."""

import re

import pandas as pd
import pytest
import torch

from tests.models import Stack
from tests.ranks import (
    assert_every_step_ran, assert_ranks_trained_alike, assert_rescued_together, rank_csvs, rank_parameters,
    rank_texts,
)
from tests.spawn import launch_rank_script

STEPS = 4  # fsdp_agree_run.STEPS (not imported: Lightning runs that module as each rank's script)
FAILING_STEP = 2  # fsdp_agree_run.FAILING_STEP


def _launch(mode: str, root, argument: str) -> None:
    """Both ranks of one ``fsdp_agree_run`` launch; a hang fails at the timeout."""
    launch_rank_script("tests.integration.fsdp_agree_run", mode, root, argument, timeout_s=120)


def _outcomes(folder) -> dict[int, str]:
    return rank_texts(folder, "outcome")


@pytest.mark.slow
@pytest.mark.parametrize("mitigations, rung, atol", [
    ("default", "checkpointing", 0.0),  # the same ops recomputed on the same inputs: bit for bit
    ("microbatch", "microbatch", 1e-6),  # the parts' weighted gradients add up in another order (1.2e-7 seen)
])
def test_a_threshold_one_rank_crosses_moves_both_ranks_alike_and_trains_as_without_a_budget(tmp_path, mitigations,
                                                                                            rung, atol):
    _launch("threshold", tmp_path, mitigations)
    plain, budgeted = tmp_path / "plain", tmp_path / "budgeted"
    assert _outcomes(plain) == _outcomes(budgeted) == {0: "finished", 1: "finished"}
    low, high, budget = (int(n) for n in (tmp_path / "peaks.txt").read_text().split())
    assert low < 0.9 * budget < high

    events = rank_csvs(budgeted, "memguard_events.csv")
    decisions = {rank: frame[frame["action"].isin(["apply", "keep", "revert"])][["step", "action", "rung", "level"]]
                 .reset_index(drop=True) for rank, frame in events.items()}
    assert len(decisions[0]) >= 1 and set(decisions[0]["rung"]) == {rung}, decisions[0]
    pd.testing.assert_frame_equal(decisions[0], decisions[1])  # the same rung and level, at the same step
    histories = rank_csvs(budgeted, "memguard_history.csv")
    first = int(decisions[0]["step"].iloc[0])
    assert_every_step_ran(budgeted, STEPS)
    # rank 0 acted on rank 1's numbers: its own step stayed under the threshold where the rung was applied
    rank0_peak = histories[0][histories[0]["step"] == first]["peak_bytes"].max()
    rank1_peak = histories[1][histories[1]["step"] == first]["peak_bytes"].max()
    assert rank0_peak < 0.9 * budget <= rank1_peak
    if rung == "microbatch":  # every rank ran its batches in the same number of parts
        parts = [history.groupby("step")["micro_batches"].max().tolist() for history in histories.values()]
        assert parts[0] == parts[1] and max(parts[0]) == 2, parts

    # each rank gathered the full parameters from both ranks' shards: the same on both, trained, and the guarded
    # run's equal to the run without a budget
    reference, guarded = rank_parameters(plain), rank_parameters(budgeted)
    initial = Stack(width=64, depth=8).state_dict()  # seeded: SizedStack's stack before training
    assert initial.keys() == reference[0].keys()
    assert not torch.equal(initial["head.weight"], reference[0]["head.weight"])
    assert_ranks_trained_alike(reference, guarded, atol=atol, rtol=10 * atol)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_an_oom_on_one_rank_is_run_again_on_both_ranks_one_rung_higher(tmp_path, phase):
    _launch("recover", tmp_path, phase)
    plain, recovered = tmp_path / "plain", tmp_path / "recovered"
    assert _outcomes(plain) == _outcomes(recovered) == {0: "finished", 1: "finished"}
    assert_rescued_together(rank_csvs(recovered, "memguard_events.csv"), FAILING_STEP, "checkpointing", phase)
    assert_every_step_ran(recovered, STEPS)
    # checkpointing recomputes the same ops: bit for bit
    assert_ranks_trained_alike(rank_parameters(plain), rank_parameters(recovered))


@pytest.mark.slow
def test_an_oom_on_one_rank_in_the_first_step_stops_both_ranks_without_a_hang(tmp_path):
    # rank 0's step peaks near 3.8 MB, rank 1's near 6.5 MB (four times the samples): only rank 1 hits the limit
    _launch("oom", tmp_path, "5500000")
    limited = tmp_path / "limited"
    outcomes = _outcomes(limited)
    assert outcomes[1].startswith("MemGuardOutOfMemoryError: lightning-memguard could not rescue step 0: out of "
                                  "memory under FSDP2 before"), outcomes
    report = (limited / "memguard_oom_report.rank1.txt").read_text()
    assert "out of memory in: forward" in report and "CPU tensor memory limit exceeded" in report
    events = rank_csvs(limited, "memguard_events.csv")
    assert events[1]["action"].tolist() == ["gave_up"]
    # rank 0 did not run out of memory: its next collective fails (the closed connection, on gloo), and it stops with
    # rank 1's report as its own error, report file and gave_up event, and a last history row saying where it was
    assert outcomes[0] == outcomes[1], outcomes
    assert re.search("Connection (closed|reset) by peer", (limited / "traceback.rank0.txt").read_text())
    first_line = report.splitlines()[0]
    assert events[0]["action"].tolist() == ["gave_up"]
    assert events[0]["reason"][0].startswith(f"rank 1 ran out of memory and could not be rescued ({first_line})")
    assert (limited / "memguard_oom_report.txt").read_text() == report
    assert rank_csvs(limited, "memguard_history.csv")[0]["phase"].tolist()[-1] == "exception"
