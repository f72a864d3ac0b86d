"""A rare long batch under torch.distributed: two CPU processes (gloo), the plain-loop guard around DDP. Only rank 1's
batch at ``LONG`` has four times the tokens; each rank predicts its own batch and rank 1 alone runs that step as
micro-batches, then whole again: DDP reduces the gradients once a step, after the last part, so the ranks' collectives
match whatever each rank's count, and no collective is spent agreeing on it. The budget is placed from a monitor-only
run of the same two processes."""

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from lightning_memguard import MemGuard
from tests.helpers import budget_crossed_between, gloo_group, mse, rank_csvs, token_batches
from tests.models import Stack

STEPS, LONG = 6, 3


def rank_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token batches (per-token features and targets); rank 1's batch ``LONG`` has four times the tokens."""
    return token_batches(rank, STEPS, LONG)


def _worker(rank: int, root: str, settings: dict) -> None:
    with gloo_group(rank, root):
        torch.manual_seed(0)  # the same initial parameters on both ranks
        model = nn.parallel.DistributedDataParallel(Stack())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if settings is None:
            for batch in rank_batches(rank):
                optimizer.zero_grad(set_to_none=True)
                mse(model, batch).backward()
                optimizer.step()
        else:
            with MemGuard(model, optimizer, log_dir=root, tensorboard=False, explain=False, **settings) as guard:
                for batch in rank_batches(rank):
                    guard.step(batch, mse)
        torch.save(model.module.state_dict(), os.path.join(root, f"parameters.rank{rank}.pt"))


def _train(root, settings=None) -> dict:
    os.makedirs(root, exist_ok=True)
    mp.spawn(_worker, args=(str(root), settings), nprocs=2, join=True)
    return {rank: torch.load(os.path.join(root, f"parameters.rank{rank}.pt")) for rank in (0, 1)}


@pytest.mark.slow
def test_the_rank_with_the_long_batch_splits_it_alone_and_both_train_like_plain_ddp(tmp_path):
    _train(tmp_path / "probe", dict(mitigations=(), cpu_sample_every=1))
    probed = rank_csvs(tmp_path / "probe", "memguard_history.csv")
    per_step = {rank: frame.groupby("step")["peak_bytes"].max() for rank, frame in probed.items()}
    normal = max(int(per_step[0].max()), int(per_step[1].drop(LONG).max()))
    budget = budget_crossed_between(int(per_step[1][LONG]), normal)  # the threshold line between the two

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
    for rank in (0, 1):
        for name, value in split[rank].items():
            torch.testing.assert_close(value, reference[rank][name], atol=2e-5, rtol=1e-4, msg=name)
    for name, value in split[0].items():  # DDP kept the ranks' replicas equal
        torch.testing.assert_close(value, split[1][name], msg=name)
