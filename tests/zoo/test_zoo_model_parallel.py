"""Lightning's ``ModelParallelStrategy`` on a transformers model: a tiny Llama sharded in ``configure_model`` as
torchtitan shards it (``fully_shard`` on every decoder layer, then the root), two CPU gloo ranks, AdamW, padded
token batches, under :class:`~lightning_memguard.MemGuardCallback` (tests/zoo/trainer_fsdp_run.py). Rank 1 alone
runs out of memory once in a layer's backward: both ranks run the batch again with a layer checkpointed, finish every
step, and the gathered parameters equal a fit without a guard's, bit for bit."""

import pytest

from tests.ranks import (
    assert_every_step_ran, assert_ranks_trained_alike, assert_rescued_together, rank_csvs, rank_parameters,
    rank_texts,
)
from tests.spawn import launch_rank_script

STEPS, FAILING_STEP = 4, 2  # trainer_fsdp_run's (not imported: Lightning runs that module as each rank's script)


@pytest.mark.slow
def test_one_ranks_oom_under_model_parallel_strategy_is_run_again_on_both_ranks(tmp_path):
    launch_rank_script("tests.zoo.trainer_fsdp_run", tmp_path)
    for name in ("plain", "recovered"):
        outcomes = rank_texts(tmp_path / name, "outcome")
        assert outcomes == {0: "finished", 1: "finished"}, (name, outcomes)
    folder = tmp_path / "recovered"
    assert_rescued_together(rank_csvs(folder, "memguard_events.csv"), FAILING_STEP, "checkpointing", "backward")
    assert_every_step_ran(folder, STEPS)
    # a checkpointed layer recomputes the same ops: bit for bit
    assert_ranks_trained_alike(rank_parameters(tmp_path / "plain"), rank_parameters(folder))
