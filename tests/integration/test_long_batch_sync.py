"""A rare long batch on two CPU processes (gloo), under Lightning's ``ddp`` and under its ``ModelParallelStrategy``
(FSDP2: ``fully_shard`` on every block and the root), where the training step logs its loss each step with
``sync_dist=True``: Lightning all-reduces that value at every log call, so a rank that ran its long batch as
micro-batches alone would issue that all-reduce once a part, alone (the other ranks would never match it). The guard
reads the logged results after the first batch and makes every rank run the same number of parts instead (one small
collective a batch): the fit finishes on both ranks, at the same levels, and trains as one without a guard
(:mod:`tests.integration.long_batch_sync_run`). The budget is placed from a monitor-only run of the same two
processes. An OOM under FSDP2 with such a step: tests/integration/test_accumulate_recover.py."""

import json

import pytest
import torch

from tests.ranks import assert_each_rank_close, budget_crossed_by_rank_one_at, rank_csvs, rank_parameters, rank_texts
from tests.spawn import launch_rank_script

LONG = 3  # long_batch_sync_run's


def _launch(root, mode: str, strategy: str) -> dict[int, dict]:
    """Both ranks of one ``long_batch_sync_run`` fit; returns each rank's parameters. A hang fails at the timeout."""
    root.mkdir(parents=True)
    launch_rank_script("tests.integration.long_batch_sync_run", root, mode, strategy, timeout_s=150)
    outcomes = rank_texts(root, "outcome")
    assert outcomes == {0: "finished", 1: "finished"}, outcomes
    return rank_parameters(root)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_long_batch_on_one_rank_is_split_on_every_rank_where_the_step_logs_with_sync_dist(tmp_path, strategy):
    _launch(tmp_path / "probe", "probe", strategy)
    budget = budget_crossed_by_rank_one_at(tmp_path / "probe", LONG)

    reference = _launch(tmp_path / "plain", "plain", strategy)
    split = _launch(tmp_path / "guarded", str(budget), strategy)

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
    levels = [json.loads((tmp_path / "guarded" / f"levels.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert levels[0] == levels[1] == {"microbatch": 0}, levels  # the split served that batch only, on both
    assert_each_rank_close(split, reference)  # the parts' gradients are added in another order
    if strategy == "fsdp":  # each rank gathered the same shards
        assert all(torch.equal(value, split[1][name]) for name, value in split[0].items())


@pytest.mark.slow
def test_a_long_batch_split_on_one_rank_alone_keeps_the_epochs_logged_mean_reducible(tmp_path):
    """The loss logged on_epoch only with ``sync_dist=True``: no collective in the step, so under DDP rank 1 splits its
    long batch alone. Its parts' shares of the batch size made Lightning's sum of batch sizes float32 where rank 0's
    stayed int64, and the reduction at the epoch's end aborted both ranks (gloo: "Received data size doesn't match
    expected size"). Now both finish, and the epoch's loss is the unguarded run's."""
    def launch(root, mode: str) -> dict[int, float]:
        root.mkdir(parents=True)
        launch_rank_script("tests.integration.long_batch_sync_run", root, mode, "ddp", "epoch", timeout_s=150)
        assert rank_texts(root, "outcome") == {0: "finished", 1: "finished"}, rank_texts(root, "outcome")
        return {rank: float(text) for rank, text in rank_texts(root, "train_loss").items()}

    launch(tmp_path / "probe", "probe")
    budget = budget_crossed_by_rank_one_at(tmp_path / "probe", LONG)
    reference = launch(tmp_path / "plain", "plain")
    guarded = launch(tmp_path / "guarded", str(budget))
    assert guarded == pytest.approx(reference, rel=1e-5)
    events = rank_csvs(tmp_path / "guarded", "memguard_events.csv")
    assert events[1]["action"].tolist() == ["predicted_split"], events[1]  # rank 1 alone
    assert events[0].empty, events[0]
