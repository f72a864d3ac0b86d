"""Lightning Fabric with FSDP2 (``ModelParallelStrategy``, ``fully_shard`` on every decoder layer of a tiny Llama and
the root) on two CPU gloo ranks, under :class:`~lightning_memguard.FabricMemGuard`: rank 1 alone runs out of memory
once (tests/zoo/fabric_fsdp_run.py), both ranks run the batch again one rung higher and finish, and the gathered
parameters equal an unguarded Fabric run's on the same data. Fabric's FSDP2 gradient-sync context left every module
not reducing its gradients once a guarded step's last part left it (Lightning 2.6 sets sync to ``enabled`` on exit):
the ranks then chose the recovery's carrier differently and the retried step's collectives did not match."""

import pytest

from tests.ranks import assert_ranks_trained_alike, assert_rescued_together, rank_csvs, rank_parameters, rank_texts
from tests.spawn import launch_rank_script

FAILING_STEP = 2  # fabric_fsdp_run.FAILING_STEP (not imported: Fabric runs that module as each rank's script)
PHASES = {"checkpointing": "backward", "microbatch": "forward"}  # fabric_fsdp_run.RUNGS


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch of both ranks: the unguarded fit and one guarded fit per rung."""
    root = tmp_path_factory.mktemp("zoo_fabric_fsdp")
    launch_rank_script("tests.zoo.fabric_fsdp_run", root)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("rung", list(PHASES))
def test_one_ranks_oom_under_fabric_fsdp2_is_run_again_on_both_ranks(runs, rung):
    phase, folder = PHASES[rung], runs / rung
    assert rank_texts(runs / "plain", "outcome") == rank_texts(folder, "outcome") == {0: "finished", 1: "finished"}
    assert rank_texts(folder, "sync") == {0: "True", 1: "True"}  # the modules reduce their gradients after the guard
    events = rank_csvs(folder, "memguard_events.csv")
    assert_rescued_together(events, FAILING_STEP, rung, phase)
    # checkpointing recomputes the same ops: bit for bit; micro-batches add the parts' weighted gradients in another
    # order, which AdamW magnifies (as in tests/zoo/test_zoo_fsdp.py)
    tolerance = {"atol": 0.0, "rtol": 0.0} if rung == "checkpointing" else {"atol": 3e-5, "rtol": 1e-4}
    assert_ranks_trained_alike(rank_parameters(runs / "plain"), rank_parameters(folder), **tolerance)
