"""Ranks recover an out-of-memory error together: two CPU processes (gloo) train a DistributedDataParallel model
under the plain-loop guard; rank 1's batches are twice rank 0's, and only rank 1 runs out of memory (the CPU hard
limit). Rank 1 shadows the gradient reductions it did not run, rank 0's backward completes and finds the mark, the
ranks agree once and both run the batch again as micro-batches: no rank dies of a closed connection, no batch is
skipped, the parameters stay equal across ranks and to plain DDP's, and what the guard handed the process group's
worker threads is let go of before the rank ends."""

import os

import pandas as pd
import pytest
import torch

from lightning_memguard import MemGuard, MemGuardOutOfMemoryError
from lightning_memguard.adapters import worker_release
from tests.helpers import mse, train_plain
from tests.models import Stack
from tests.ranks import (
    assert_each_rank_close, gloo_group, rank_doubled, rank_parameters, rank_texts, save_full_parameters, wrap_for,
)
from tests.spawn import launch_rank_script, spawn_ranks

STEPS = 3


def _worker(rank: int, root: str, limit) -> None:
    with gloo_group(rank, root):
        model = wrap_for(Stack(), "ddp")  # seeded: the same initial parameters on both ranks
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        data = rank_doubled(rank, STEPS)
        outcome = "finished"
        if limit is None:
            train_plain(model, optimizer, data)
        else:
            # no plan and no threshold crossing first: the OOM itself, on rank 1 only, is what is tested
            guard = MemGuard(model, optimizer, log_dir=root, cpu_hard_limit=limit, mitigations=("microbatch",),
                             threshold=1.0, plan_at_start=False, tensorboard=False)
            try:
                with guard:
                    for batch in data:
                        guard.step(batch, mse)
            except MemGuardOutOfMemoryError as err:
                outcome = str(err).splitlines()[0]
            # what the guard handed the process group's workers is let go of by now: nothing holds a rank at exit
            if not (worker_release.registered() > 0 and worker_release.wait_for_workers(at_most_s=10)):
                outcome = f"{worker_release.still_held()} of {worker_release.registered()} objects still held"
        with open(os.path.join(root, f"outcome.rank{rank}.txt"), "w") as out:
            out.write(outcome)
        save_full_parameters(model, root, rank)


def _train(root, limit=None) -> tuple[dict, dict]:
    os.makedirs(root, exist_ok=True)
    spawn_ranks(_worker, (str(root), limit), timeout_s=240)
    return rank_parameters(root), rank_texts(root, "outcome")


def _events(root, rank: int) -> pd.DataFrame:
    return pd.read_csv(os.path.join(root, "memguard_events.csv" if rank == 0 else f"memguard_events.rank{rank}.csv"))


@pytest.mark.slow
def test_one_ranks_oom_is_recovered_on_both_and_trains_like_plain_ddp(tmp_path):
    reference, _ = _train(tmp_path / "plain")
    # rank 1's first step fits (DDP's buckets counted from the start), its second, with momentum, does not
    recovered, outcomes = _train(tmp_path / "guarded", limit="8MB")
    assert outcomes == {0: "finished", 1: "finished"}
    events = {rank: _events(tmp_path / "guarded", rank) for rank in (0, 1)}
    rescues = {rank: frame[frame["action"] == "rescue"][["step", "rung", "level"]].reset_index(drop=True)
               for rank, frame in events.items()}
    assert len(rescues[1]) >= 1 and rescues[1]["rung"].eq("microbatch").all()
    pd.testing.assert_frame_equal(rescues[0], rescues[1])  # the same rung, at the same step, on both ranks
    assert "another rank ran out of memory" in " ".join(events[0]["reason"])  # rank 0 did not run out itself
    assert_each_rank_close(recovered, reference)
    for name, value in recovered[0].items():
        torch.testing.assert_close(value, recovered[1][name], msg=name)


@pytest.mark.slow
def test_where_nothing_fits_on_one_rank_every_rank_stops_with_the_report(tmp_path):
    # under what rank 1's parameters, gradients and momentum need: no rung can help, and neither rank hangs
    _, outcomes = _train(tmp_path / "guarded", limit="2.4MB")
    assert outcomes[0].startswith("lightning-memguard could not rescue step 0") and outcomes[1] == outcomes[0]


@pytest.mark.slow
def test_under_fabric_ddp_one_ranks_oom_is_recovered_on_both(tmp_path):
    reference, _ = _train(tmp_path / "plain")
    guarded = tmp_path / "fabric"
    guarded.mkdir()
    launch_rank_script("tests.integration.fabric_ddp_run", guarded, "8MB")
    events = {rank: _events(guarded, rank) for rank in (0, 1)}
    rescues = {rank: frame[frame["action"] == "rescue"][["step", "rung", "level"]].reset_index(drop=True)
               for rank, frame in events.items()}
    assert len(rescues[1]) >= 1
    pd.testing.assert_frame_equal(rescues[0], rescues[1])
    assert_each_rank_close(rank_parameters(guarded), reference)


@pytest.mark.slow
def test_under_fabric_ddp_an_oom_before_the_loss_functions_all_gather_stops_both_ranks(tmp_path):
    """Rank 1 runs out of memory before its loss function's ``fabric.all_gather``, which rank 0 waits in: rank 1
    cannot stand in for it (it hung there, reducing zeros in place of gradients), so both stop with one report."""
    launch_rank_script("tests.integration.fabric_gather_run", tmp_path)
    outcomes = rank_texts(tmp_path, "outcome")
    first_line = ("MemGuardOutOfMemoryError: lightning-memguard could not rescue step 2: out of memory with several "
                  "processes whose training step issues collectives of its own")
    assert outcomes[0].startswith(first_line) and outcomes[1] == outcomes[0], outcomes
