"""Run by test_long_batch_sync.py in a subprocess (Lightning starts the second rank by running this module again; a
hang is the test's timeout): two gloo ranks fit :class:`LoggingStack` under Lightning's ``ddp``, whose training step
logs its loss each step with ``sync_dist=True`` (an all-reduce at every log call); only rank 1's batch at ``LONG`` has
four times the tokens (:func:`~tests.helpers.token_batches`).

``<root> <mode>``: ``plain`` (no guard), ``probe`` (a guard that only measures, sampling every op) or a budget in bytes
(the micro-batch rung alone). Each rank writes how it ended to ``<root>/outcome.rank<N>.txt`` (``finished`` or the
error's type and first line) and a finished fit's parameters to ``<root>/parameters.rank<N>.pt``."""

import faulthandler
import os
import sys
import warnings

import torch
from torch.utils.data import DataLoader

from lightning_memguard import MemGuardCallback
from tests.helpers import mse, run_recording_outcome, token_batches
from tests.models import Stack, pl, trainer_kwargs

STEPS, LONG = 6, 3


class LoggingStack(pl.LightningModule):
    """:class:`Stack` under SGD with momentum, on this rank's token batches; logs its loss each step, reduced."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Stack()

    def training_step(self, batch, batch_idx):
        loss = mse(self.net, batch)
        self.log("train_loss", loss, on_step=True, on_epoch=False, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(token_batches(self.global_rank, STEPS, LONG), batch_size=None)


def fit(root: str, mode: str) -> None:
    if mode == "plain":
        guards = []
    elif mode == "probe":
        guards = [MemGuardCallback(mitigations=(), cpu_sample_every=1, plan_at_start=False)]
    else:
        guards = [MemGuardCallback(budget=int(mode), mitigations=("microbatch",), plan_at_start=False)]
    trainer = pl.Trainer(callbacks=guards, default_root_dir=root, logger=False, use_distributed_sampler=False,
                         **trainer_kwargs(strategy="ddp", devices=2, max_steps=STEPS))
    model = LoggingStack()
    outcome = run_recording_outcome(lambda: trainer.fit(model), root, lambda: trainer.global_rank)
    if outcome == "finished":
        torch.save(model.net.state_dict(), os.path.join(root, f"parameters.rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    faulthandler.dump_traceback_later(100, exit=True)  # a hang ends this rank, with where it hung
    fit(sys.argv[1], sys.argv[2])
