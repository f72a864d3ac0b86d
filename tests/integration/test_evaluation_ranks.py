"""An evaluation batch that runs out of memory on one rank of two (gloo, a DistributedDataParallel model in a plain
loop): it is not split on that rank alone, and the report says why in terms true of the run. The reason for training
batches ("can retry a batch together only under DistributedDataParallel ...") named the very setup the run had, as if
it could have been rescued."""

import os
from pathlib import Path

import pytest
import torch

from lightning_memguard import MemGuard, MemGuardOutOfMemoryError
from tests.helpers import mse
from tests.models import Stack
from tests.ranks import OneOffBallast, gloo_group, rank_half, rank_texts, wrap_for
from tests.spawn import spawn_ranks

LIMIT = 32 * 2 ** 20  # far above a step of the stack; the ballast alone passes it


def _worker(rank: int, root: str) -> None:
    with gloo_group(rank, root):
        model = wrap_for(Stack(), "ddp")  # seeded: the same parameters on both ranks
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        ballast = OneOffBallast(model.module.blocks[0], "forward", LIMIT)
        data = rank_half(rank, 2)
        outcome = "finished"
        with MemGuard(model, optimizer, log_dir=root, cpu_hard_limit=LIMIT, budget=LIMIT, tensorboard=False,
                      plan_at_start=False) as guard:
            for batch in data:
                guard.step(batch, mse)
            ballast.armed = rank == 1  # rank 1's evaluation batch alone runs out of memory
            try:
                guard.evaluate(data[0], mse)
            except MemGuardOutOfMemoryError as error:
                outcome = str(error)
        Path(root, f"outcome.rank{rank}.txt").write_text(outcome)


@pytest.mark.slow
def test_one_ranks_evaluation_oom_ends_with_a_report_that_says_why_it_is_not_split(tmp_path):
    os.makedirs(tmp_path, exist_ok=True)
    spawn_ranks(_worker, (str(tmp_path),), timeout_s=240)
    outcomes = rank_texts(tmp_path, "outcome")
    assert outcomes[0] == "finished"
    assert outcomes[1].startswith("lightning-memguard could not rescue a validation batch of 128 samples: the run has "
                                  "several processes, and an evaluation batch is not split on one rank alone")
    assert "smaller batches" in outcomes[1]  # what to do instead
    assert "can retry a batch together only under DistributedDataParallel" not in outcomes[1]
