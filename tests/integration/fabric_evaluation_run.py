"""Run by test_evaluation_ranks.py in a subprocess (a hang is a timeout): two gloo ranks under Lightning Fabric's
ddp_spawn train :class:`~tests.models.ShiftedStack` (a buffer DDP broadcasts in the first
forward after each training step) and evaluate between steps, without a guard (``<root>/plain``) and with
FabricMemGuard under a CPU hard limit (``<root>/guarded``), where rank 1's second evaluation batch runs out of memory
inside its forward. Each run writes, per rank, its evaluation outputs and its parameters."""

import os
import sys
import warnings

import torch
from lightning.fabric import Fabric

from lightning_memguard import FabricMemGuard
from tests.helpers import mse, predictions
from tests.models import ShiftedStack
from tests.ranks import OneOffBallast, rank_half, save_full_parameters

LIMIT = 32 * 2 ** 20  # far above a step of the stack; the ballast alone passes it


def run(fabric: Fabric, root: str) -> None:
    rank, data = fabric.global_rank, rank_half(fabric.global_rank, 4)
    for name in ("plain", "guarded"):
        folder = os.path.join(root, name)
        os.makedirs(folder, exist_ok=True)
        model = ShiftedStack()  # seeded: the same parameters on both ranks, in both runs
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
        guard = ballast = None
        if name == "guarded":
            guard = FabricMemGuard(fabric, model, optimizer, log_dir=folder, cpu_hard_limit=LIMIT, budget=LIMIT,
                                   plan_at_start=False)
            ballast = OneOffBallast(model.module.blocks[0], "forward", LIMIT)

        def train(batches):
            for batch in batches:
                if guard is not None:
                    guard.step(batch, mse)
                else:
                    optimizer.zero_grad(set_to_none=True)
                    fabric.backward(mse(model, batch))
                    optimizer.step()

        def evaluate(batch):
            if guard is not None:
                return guard.evaluate(batch, predictions)
            with torch.no_grad():
                return predictions(model, batch)

        outputs = []
        train(data[:2])
        outputs.append(evaluate(data[0]))
        train(data[2:3])
        if ballast is not None:
            ballast.armed = rank == 1
        outputs.append(evaluate(data[1]))
        train(data[3:])
        if guard is not None:
            guard.close()
        torch.save(outputs, os.path.join(folder, f"outputs.rank{rank}.pt"))
        save_full_parameters(model.module, folder, rank)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn").launch(run, sys.argv[1])
