"""A rare long batch under Lightning's ``ddp`` on two CPU processes (gloo), where the training step logs its loss each
step with ``sync_dist=True``: Lightning all-reduces that value at every log call, so a rank that ran its long batch as
micro-batches alone would issue that all-reduce once a part, alone (the other ranks would never match it). The guard
reads the logged results after the first batch and makes every rank run the same number of parts instead (one small
collective a batch): the fit finishes and trains as one without a guard (:mod:`tests.integration.long_batch_sync_run`).
The budget is placed from a monitor-only run of the same two processes."""

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import budget_crossed_between, rank_csvs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = 3  # long_batch_sync_run's


def _launch(root, mode: str) -> dict[int, dict]:
    """Both ranks of one ``long_batch_sync_run`` fit; returns each rank's parameters. A hang fails at the timeout."""
    root.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MASTER_PORT", None)
    result = subprocess.run([sys.executable, "-m", "tests.integration.long_batch_sync_run", str(root), mode],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = {rank: (root / f"outcome.rank{rank}.txt").read_text() for rank in (0, 1)}
    assert outcomes == {0: "finished", 1: "finished"}, outcomes
    return {rank: torch.load(root / f"parameters.rank{rank}.pt") for rank in (0, 1)}


@pytest.mark.slow
def test_a_long_batch_on_one_rank_is_split_on_every_rank_where_the_step_logs_with_sync_dist(tmp_path):
    _launch(tmp_path / "probe", "probe")
    probed = rank_csvs(tmp_path / "probe", "memguard_history.csv")
    per_step = {rank: frame.groupby("step")["peak_bytes"].max() for rank, frame in probed.items()}
    normal = max(int(per_step[0].max()), int(per_step[1].drop(LONG).max()))
    budget = budget_crossed_between(int(per_step[1][LONG]), normal)  # the threshold line between the two

    reference = _launch(tmp_path / "plain", "plain")
    split = _launch(tmp_path / "guarded", str(budget))

    events = rank_csvs(tmp_path / "guarded", "memguard_events.csv")
    for rank in (0, 1):  # both ranks split that step alike: rank 1 for its own batch, rank 0 for rank 1's
        assert events[rank]["action"].tolist() == ["predicted_split"], events[rank]
        assert events[rank]["step"].tolist() == [LONG]
    assert "4.0x the" in events[1]["reason"].iloc[0]
    assert "a batch on another rank is predicted not to fit whole" in events[0]["reason"].iloc[0]
    parts = {rank: frame.groupby("step")["micro_batches"].max()
             for rank, frame in rank_csvs(tmp_path / "guarded", "memguard_history.csv").items()}
    assert parts[1][LONG] > 1 and parts[0][LONG] == parts[1][LONG], parts  # as many parts on both ranks
    assert (parts[0].drop(LONG) == 1).all() and (parts[1].drop(LONG) == 1).all()  # that step only
    for rank in (0, 1):  # the parts' gradients are added in another order
        for name, value in split[rank].items():
            torch.testing.assert_close(value, reference[rank][name], atol=2e-5, rtol=1e-4, msg=name)
