"""A rare long batch under torch.distributed: two CPU processes (gloo), the plain-loop guard around DDP. Only rank 1's
batch at ``LONG`` has four times the tokens; each rank predicts its own batch and rank 1 alone runs that step as
micro-batches, then whole again: DDP reduces the gradients once a step, after the last part, so the ranks' collectives
match whatever each rank's count, and no collective is spent agreeing on it. The budget is placed from a monitor-only
run of the same two processes."""

import os

import pytest
import torch

from lightning_memguard import MemGuard
from tests.helpers import mse, train_plain
from tests.models import Stack
from tests.ranks import (
    assert_each_rank_close, budget_crossed_by_rank_one_at, gloo_group, rank_csvs, rank_parameters,
    save_full_parameters, token_batches, wrap_for,
)
from tests.spawn import spawn_ranks

STEPS, LONG = 6, 3


def rank_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token batches (per-token features and targets); rank 1's batch ``LONG`` has four times the tokens."""
    return token_batches(rank, STEPS, LONG)


def _worker(rank: int, root: str, settings: dict) -> None:
    with gloo_group(rank, root):
        model = wrap_for(Stack(), "ddp")  # seeded: the same initial parameters on both ranks
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if settings is None:
            train_plain(model, optimizer, rank_batches(rank))
        else:
            with MemGuard(model, optimizer, log_dir=root, tensorboard=False, explain=False, **settings) as guard:
                for batch in rank_batches(rank):
                    guard.step(batch, mse)
        save_full_parameters(model, root, rank)


def _train(root, settings=None) -> dict:
    os.makedirs(root, exist_ok=True)
    spawn_ranks(_worker, (str(root), settings), timeout_s=240)
    return rank_parameters(root)


@pytest.mark.slow
def test_the_rank_with_the_long_batch_splits_it_alone_and_both_train_like_plain_ddp(tmp_path):
    _train(tmp_path / "probe", dict(mitigations=(), cpu_sample_every=1))
    budget = budget_crossed_by_rank_one_at(tmp_path / "probe", LONG)

    reference = _train(tmp_path / "plain")
    split = _train(tmp_path / "guarded", dict(budget=budget, mitigations=("microbatch",)))

    events = rank_csvs(tmp_path / "guarded", "memguard_events.csv")
    assert events[1]["action"].tolist() == ["predicted_split"] and events[1]["step"].tolist() == [LONG]
    assert "4.0x the" in events[1]["reason"].iloc[0]
    assert events[0].empty  # rank 0's batch fits whole: it runs whole
    parts = {rank: frame.groupby("step")["micro_batches"].max()
             for rank, frame in rank_csvs(tmp_path / "guarded", "memguard_history.csv").items()}
    assert parts[1][LONG] > 1 and (parts[1].drop(LONG) == 1).all()  # that step only
    assert (parts[0] == 1).all()
    assert_each_rank_close(split, reference)
    for name, value in split[0].items():  # DDP kept the ranks' replicas equal
        torch.testing.assert_close(value, split[1][name], msg=name)
