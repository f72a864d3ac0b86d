"""Run by test_ranks_recover.py in a subprocess (a hang is a timeout, not a stuck test run): two gloo ranks under
Lightning Fabric's ddp_spawn train the rank-dependent batches of test_ranks_recover.py with FabricMemGuard under a
CPU hard limit only rank 1 crosses; each rank saves its parameters and its outcome under the given folder."""

import sys
import warnings

import torch
from lightning.fabric import Fabric

from lightning_memguard import FabricMemGuard
from tests.helpers import mse
from tests.models import Stack
from tests.ranks import rank_doubled, save_full_parameters

STEPS = 3


def train(fabric: Fabric, root: str, limit: str) -> None:
    model = Stack()  # seeded: the same initial parameters on both ranks
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    rank = fabric.global_rank
    data = rank_doubled(rank, STEPS)
    guard = FabricMemGuard(fabric, model, optimizer, log_dir=root, cpu_hard_limit=limit, mitigations=("microbatch",),
                           threshold=1.0, plan_at_start=False)
    with guard:
        for batch in data:
            guard.step(batch, mse)
    save_full_parameters(model.module, root, rank)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn")
    fabric.launch(train, sys.argv[1], sys.argv[2])
