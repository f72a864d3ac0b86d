"""The plain-loop guard under torch.distributed: two CPU processes (gloo) with DistributedDataParallel. Every rank
decides on the worst rank's numbers, so both split their batches the same way at the same step, and gradients are
all-reduced once per step (DDP's no_sync for all micro-batches but the last): the result equals plain DDP."""

import os

import pytest
import torch

from lightning_memguard import MemGuard
from tests.helpers import mse, train_plain
from tests.models import Stack, TaskHeads, task_batches, task_mse
from tests.ranks import (
    applied_alike, assert_each_rank_close, gloo_group, rank_csvs, rank_doubled, rank_parameters,
    save_full_parameters, wrap_for,
)
from tests.spawn import launch_rank_script, spawn_ranks

STEPS = 4


def _worker(rank: int, root: str, guarded: bool, plan: bool = False, tasks: bool = False,
            strategy: str = "ddp") -> None:
    with gloo_group(rank, root):
        # seeded: the same initial parameters on both ranks
        model = wrap_for(TaskHeads() if tasks else Stack(), strategy)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        # each rank its own data; rank 1's batches are larger, so it alone would cross the threshold first (tasks:
        # both the same size, task 1 where each rank's split leaves it in a different part, tests.models.task_batches)
        data, loss = (task_batches(rank, STEPS), task_mse) if tasks else (rank_doubled(rank, STEPS), mse)
        if guarded:
            # a whole batch peaks at ~7.8 MB on rank 1 (parameters, gradients, momentum ~2.2 MB), ~6.5 MB a rank
            # under FSDP2: only parts fit
            guard = MemGuard(model, optimizer, log_dir=root, budget="7MB" if strategy == "ddp" else "4MB",
                             mitigations=("microbatch",), min_gain=0.0, tensorboard=False, plan_at_start=plan)
            with guard:
                for batch in data:
                    guard.step(batch, loss)
        else:
            train_plain(model, optimizer, data, loss=loss)
        save_full_parameters(model, root, rank)


def _train(root, guarded: bool, plan: bool = False) -> dict:
    os.makedirs(root, exist_ok=True)
    spawn_ranks(_worker, (str(root), guarded, plan), timeout_s=240)
    return rank_parameters(root)


@pytest.mark.slow
def test_ranks_split_the_same_way_and_train_like_plain_ddp(tmp_path):
    reference = _train(tmp_path / "plain", guarded=False)
    split = _train(tmp_path / "guarded", guarded=True)
    events = rank_csvs(tmp_path / "guarded", "memguard_events.csv")
    applied = applied_alike(events)  # the same k on both ranks, at the same step
    assert len(applied) >= 1 and applied["rung"].eq("microbatch").all()
    # rank 0 acted on rank 1's numbers: on its own it was under the limit at the step the rung was first applied
    first = int(applied["step"].iloc[0])
    limit = 0.9 * events[0]["capacity_bytes"].iloc[0]
    peaks = {rank: frame[frame["step"] == first]["peak_bytes"].max()
             for rank, frame in rank_csvs(tmp_path / "guarded", "memguard_history.csv").items()}
    assert peaks[0] < limit <= peaks[1]
    # no rescue with several processes: the threshold drives the rung, and nothing is held back for an OOM
    assert not {"rescue", "hold"} & (set(events[0]["action"]) | set(events[1]["action"]))
    assert_each_rank_close(split, reference)
    for name, value in split[0].items():  # DDP kept the ranks' replicas equal
        torch.testing.assert_close(value, split[1][name], msg=name)


@pytest.mark.slow
def test_ranks_plan_the_same_micro_batches_from_their_own_batches(tmp_path):
    """plan_at_start estimates each rank's first batch: rank 0's fits whole, rank 1's only in parts. Both start split
    the same way (the highest level any rank planned), or DDP's collectives would not match."""
    reference = _train(tmp_path / "plain", guarded=False)
    split = _train(tmp_path / "guarded", guarded=True, plan=True)
    histories = rank_csvs(tmp_path / "guarded", "memguard_history.csv")
    first = {rank: frame[(frame["step"] == 0) & (frame["phase"] == "after_forward")]["micro_batches"].iloc[0]
             for rank, frame in histories.items()}
    assert first[0] == first[1] > 1
    plans = {rank: frame[frame["action"] == "plan"]["reason"].tolist()
             for rank, frame in rank_csvs(tmp_path / "guarded", "memguard_events.csv").items()}
    assert "levels raised to the highest any rank planned" in plans[0][0]  # rank 0 alone would not have split
    assert "micro-batches a step is predicted at" in plans[1][0]
    assert_each_rank_close(split, reference)


def test_the_plain_loop_guard_plans_a_ddp_rank_with_its_buckets(tmp_path):
    """A DistributedDataParallel module handed to the plain-loop guard (one gloo rank): the plan before the first
    step predicts the rank's step (the module's and DDP's gradient buckets), as ``estimate_memory`` of the DDP module
    does, not the module's alone."""
    import pandas as pd

    from lightning_memguard import estimate_memory

    with gloo_group(0, tmp_path, world_size=1):
        model = wrap_for(Stack(), "ddp")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        batch = rank_doubled(0, 1)[0]
        kwargs = dict(optimizer=optimizer, loss_fn=mse, target="cpu")
        rank, alone = estimate_memory(model, batch, **kwargs), estimate_memory(model.module, batch, **kwargs)
        assert rank.peak_bytes > alone.peak_bytes
        guard = MemGuard(model, optimizer, log_dir=str(tmp_path), budget="64MB", mitigations=("checkpointing",),
                         tensorboard=False, plan_at_start=True)
        with guard:
            guard.step(batch, mse)
    plan = pd.read_csv(tmp_path / "memguard_events.csv").query("action == 'plan'")
    assert len(plan) == 1 and plan["peak_before_bytes"].iloc[0] == rank.peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("door", ["torch", "fabric", "fsdp2"])
def test_micro_batches_whose_parts_reach_different_heads_train_like_plain_data_parallel(tmp_path, door):
    """Rank 0's last micro-batch runs no sample of task 1 (tests.models.task_batches), rank 1's does. Under DDP (torch's
    and Fabric's) without find_unused_parameters the backward that all-reduces expects every parameter's gradient,
    and rank 0's run failed: its last part's loss now reaches the head the earlier part trained. Under FSDP2 every
    part reduce-scatters the parameters that got a gradient: in their first part rank 0 reaches head 1 only, rank 1
    head 0 only, so the ranks' buffers did not line up and each head was trained on the other's gradients, silently
    (3 % off here); split steps now reduce a zero for a parameter without a gradient (mitigations/fsdp_unused.py).
    Each equal to the same data-parallel training unguarded."""
    roots = {name: tmp_path / name for name in ("plain", "guarded")}
    for name, root in roots.items():
        os.makedirs(root)
        if door == "fabric":
            launch_rank_script("tests.integration.fabric_heads_run", root, int(name == "guarded"))
        else:
            strategy = "fsdp" if door == "fsdp2" else "ddp"
            spawn_ranks(_worker, (str(root), name == "guarded", False, True, strategy), timeout_s=240)
    applied = applied_alike(rank_csvs(roots["guarded"], "memguard_events.csv"))
    assert len(applied) >= 1 and applied["rung"].eq("microbatch").all()
    assert_each_rank_close(rank_parameters(roots["guarded"]), rank_parameters(roots["plain"]))
