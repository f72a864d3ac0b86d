"""Run by test_loop_ddp.py in a subprocess (a hang is a timeout, not a stuck test run): two gloo ranks under
Lightning Fabric's ddp_spawn train tests.models.TaskHeads on their own task batches, with FabricMemGuard under a
budget only micro-batches fit (argument ``guarded`` 1) or unguarded (0); each rank saves its parameters under the
given folder."""

import sys
import warnings

import torch
from lightning.fabric import Fabric

from lightning_memguard import FabricMemGuard
from tests.models import TaskHeads, task_batches, task_mse
from tests.ranks import save_full_parameters

STEPS = 4


def train(fabric: Fabric, root: str, guarded: str) -> None:
    model = TaskHeads()  # seeded: the same initial parameters on both ranks
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    data = task_batches(fabric.global_rank, STEPS)
    if guarded == "1":  # a whole batch peaks at ~7.8 MB: only parts fit
        guard = FabricMemGuard(fabric, model, optimizer, log_dir=root, budget="7MB", mitigations=("microbatch",),
                               min_gain=0.0, plan_at_start=False)
        with guard:
            for batch in data:
                guard.step(batch, task_mse)
    else:
        for batch in data:
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(task_mse(model, batch))
            optimizer.step()
    save_full_parameters(model.module, root, fabric.global_rank)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn").launch(train, sys.argv[1], sys.argv[2])
