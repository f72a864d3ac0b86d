"""Lightning Fabric with FSDP2 (``ModelParallelStrategy``, ``fully_shard`` on every decoder layer of a tiny Llama and
the root) on two CPU gloo ranks, under :class:`~lightning_memguard.FabricMemGuard`: rank 1 alone runs out of memory
once (tests/zoo/fabric_fsdp_run.py), both ranks run the batch again one rung higher and finish, and the gathered
parameters equal an unguarded Fabric run's on the same data. Fabric's FSDP2 gradient-sync context left every module
not reducing its gradients once a guarded step's last part left it (Lightning 2.6 sets sync to ``enabled`` on exit):
the ranks then chose the recovery's carrier differently and the retried step's collectives did not match."""

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import assert_rescued_together, rank_csvs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAILING_STEP = 2  # fabric_fsdp_run.FAILING_STEP (not imported: Fabric runs that module as each rank's script)
PHASES = {"checkpointing": "backward", "microbatch": "forward"}  # fabric_fsdp_run.RUNGS


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch of both ranks: the unguarded fit and one guarded fit per rung."""
    root = tmp_path_factory.mktemp("zoo_fabric_fsdp")
    # a port or rank an earlier launch in this process left in the environment must not reach the new ranks
    stale = ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK")
    env = {name: value for name, value in os.environ.items() if name not in stale}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-m", "tests.zoo.fabric_fsdp_run", str(root)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def _read(folder, stem: str) -> dict[int, str]:
    return {rank: (folder / f"{stem}.rank{rank}.txt").read_text() for rank in (0, 1)}


@pytest.mark.slow
@pytest.mark.parametrize("rung", list(PHASES))
def test_one_ranks_oom_under_fabric_fsdp2_is_run_again_on_both_ranks(runs, rung):
    phase, folder = PHASES[rung], runs / rung
    assert _read(runs / "plain", "outcome") == _read(folder, "outcome") == {0: "finished", 1: "finished"}
    assert _read(folder, "sync") == {0: "True", 1: "True"}  # the modules reduce their gradients after the guard
    events = rank_csvs(folder, "memguard_events.csv")
    assert_rescued_together(events, FAILING_STEP, rung, phase)
    reference = {rank: torch.load(runs / "plain" / f"parameters.rank{rank}.pt") for rank in (0, 1)}
    guarded = {rank: torch.load(folder / f"parameters.rank{rank}.pt") for rank in (0, 1)}
    # checkpointing recomputes the same ops: bit for bit; micro-batches add the parts' weighted gradients in another
    # order, which AdamW magnifies (as in tests/zoo/test_zoo_fsdp.py)
    tolerance = {"atol": 0.0, "rtol": 0.0} if rung == "checkpointing" else {"atol": 3e-5, "rtol": 1e-4}
    for key, value in reference[0].items():
        assert torch.equal(value, reference[1][key]) and torch.equal(guarded[0][key], guarded[1][key]), key
        torch.testing.assert_close(guarded[0][key], value, msg=key, **tolerance)
