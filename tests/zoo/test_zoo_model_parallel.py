"""Lightning's ``ModelParallelStrategy`` on a transformers model: a tiny Llama sharded in ``configure_model`` as
torchtitan shards it (``fully_shard`` on every decoder layer, then the root), two CPU gloo ranks, AdamW, padded
token batches, under :class:`~lightning_memguard.MemGuardCallback` (tests/zoo/trainer_fsdp_run.py). Rank 1 alone
runs out of memory once in a layer's backward: both ranks run the batch again with a layer checkpointed, finish every
step, and the gathered parameters equal a fit without a guard's, bit for bit."""

import os
import subprocess
import sys

import pandas as pd
import pytest
import torch

from tests.helpers import rank_csvs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, FAILING_STEP = 4, 2  # trainer_fsdp_run's (not imported: Lightning runs that module as each rank's script)


@pytest.mark.slow
def test_one_ranks_oom_under_model_parallel_strategy_is_run_again_on_both_ranks(tmp_path):
    stale = ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK")
    env = {name: value for name, value in os.environ.items() if name not in stale}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-m", "tests.zoo.trainer_fsdp_run", str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("plain", "recovered"):
        outcomes = {rank: (tmp_path / name / f"outcome.rank{rank}.txt").read_text() for rank in (0, 1)}
        assert outcomes == {0: "finished", 1: "finished"}, (name, outcomes)
    folder = tmp_path / "recovered"
    events = rank_csvs(folder, "memguard_events.csv")
    decisions = {rank: frame[["step", "action", "rung", "level"]] for rank, frame in events.items()}
    pd.testing.assert_frame_equal(decisions[0], decisions[1])  # the same rung and level, at the same step
    rescues = decisions[0][decisions[0]["action"] == "rescue"]
    assert rescues[["step", "rung"]].values.tolist() == [[FAILING_STEP, "checkpointing"]], decisions[0]
    rescued = events[1]["action"] == "rescue"
    assert "(OutOfMemoryError: DefaultCPUAllocator" in events[1][rescued]["reason"].iloc[0]
    assert "(PeerOutOfMemoryError: another rank" in events[0][rescued]["reason"].iloc[0]
    for rank, history in rank_csvs(folder, "memguard_history.csv").items():
        assert set(history[history["phase"] == "after_optimizer_step"]["step"]) == set(range(STEPS)), rank
    reference = {rank: torch.load(tmp_path / "plain" / f"parameters.rank{rank}.pt") for rank in (0, 1)}
    guarded = {rank: torch.load(folder / f"parameters.rank{rank}.pt") for rank in (0, 1)}
    for key, value in reference[0].items():  # a checkpointed layer recomputes the same ops: bit for bit
        assert torch.equal(value, reference[1][key]) and torch.equal(guarded[0][key], guarded[1][key]), key
        assert torch.equal(guarded[0][key], value), key
