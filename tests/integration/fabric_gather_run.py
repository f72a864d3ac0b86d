"""Run by test_ranks_recover.py in a subprocess (a hang is a timeout, not a stuck test run): two gloo ranks under
Lightning Fabric's ddp_spawn train :class:`~tests.models.Stack` with FabricMemGuard, the loss function all-gathering
each batch's loss across the ranks (``fabric.all_gather``, a mean over the ranks); rank 1 runs out of memory once, at
step 2, in its loss function before the gather. Each rank writes its outcome under the given folder."""

import sys
import warnings

import torch
from lightning.fabric import Fabric

from lightning_memguard import FabricMemGuard
from tests.helpers import mse
from tests.models import Stack
from tests.ranks import run_recording_outcome

STEPS, FAILING_STEP = 4, 2


def train(fabric: Fabric, root: str) -> None:
    model = Stack()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    guard = FabricMemGuard(fabric, model, optimizer, log_dir=root, budget="1GiB", plan_at_start=False)
    generator = torch.Generator().manual_seed(fabric.global_rank)
    state = {"step": 0, "failed": False}

    def loss_fn(module, batch):
        loss = mse(module, batch)
        if fabric.global_rank == 1 and state["step"] == FAILING_STEP and not state["failed"]:
            state["failed"] = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated on rank 1)")
        state["mean"] = fabric.all_gather(loss.detach()).mean()
        return loss

    def fit() -> None:
        with guard:
            for step in range(STEPS):
                state["step"] = step
                x = torch.randn(64, 16, generator=generator)
                guard.step((x, x.sum(dim=1, keepdim=True).sin()), loss_fn)

    run_recording_outcome(fit, root, lambda: fabric.global_rank)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn").launch(train, sys.argv[1])
