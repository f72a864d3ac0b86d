"""Run by test_long_batch_sync.py in a subprocess (Lightning starts the second rank by running this module again; a
hang is the test's timeout): two gloo ranks fit :class:`LoggingStack` under Lightning's ``ddp`` or, ``fsdp``, its
``ModelParallelStrategy`` (FSDP2: ``fully_shard`` on every block and the root in ``configure_model``), whose training
step logs its loss each step with ``sync_dist=True`` (an all-reduce at every log call); only rank 1's batch at ``LONG``
has four times the tokens (:func:`~tests.ranks.token_batches`).

``<root> <mode> <strategy> [<logged>]``: ``plain`` (no guard), ``probe`` (a guard that only measures, sampling every
op) or a budget in bytes (the micro-batch rung alone); ``logged``: ``step`` (the default, as above) or ``epoch`` (the
loss logged ``on_epoch`` only, reduced once, at the epoch's end: no collective in the step, so a rank splits its long
batch alone; each rank writes the epoch's loss to ``<root>/train_loss.rank<N>.txt``). Each rank writes how it ended
to ``<root>/outcome.rank<N>.txt`` (``finished`` or the error's type and first line), and a finished fit its full
(gathered) parameters to ``<root>/parameters.rank<N>.pt`` and its guard's levels at the end to
``<root>/levels.rank<N>.json``."""

import faulthandler
import sys
import warnings

import torch
from torch.utils.data import DataLoader

from lightning_memguard import MemGuardCallback
from tests.helpers import mse
from tests.models import Stack, pl, trainer_kwargs, two_rank_strategy
from tests.ranks import end_process_group, fit_recording_results, token_batches, wrap_for

STEPS, LONG = 6, 3


class LoggingStack(pl.LightningModule):
    """:class:`Stack` under SGD with momentum, on this rank's token batches; logs its loss each step, reduced. Under
    ``ModelParallelStrategy`` ``configure_model`` shards every block and then the stack with FSDP2."""

    def __init__(self, logged: str = "step") -> None:
        super().__init__()
        self.net = Stack()  # seeded: the same parameters on both ranks
        self.logged = logged

    def configure_model(self) -> None:
        if self.device_mesh is not None:
            wrap_for(self.net, "fsdp", self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        loss = mse(self.net, batch)
        self.log("train_loss", loss, on_step=self.logged == "step", on_epoch=self.logged == "epoch", sync_dist=True)
        return loss

    def on_train_end(self) -> None:
        if self.logged == "epoch":
            with open(f"{self.trainer.default_root_dir}/train_loss.rank{self.global_rank}.txt", "w") as file:
                file.write(repr(float(self.trainer.callback_metrics["train_loss"])))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(token_batches(self.global_rank, STEPS, LONG), batch_size=None)


def fit(root: str, mode: str, strategy: str, logged: str = "step") -> None:
    if mode == "plain":
        guards = []
    elif mode == "probe":
        guards = [MemGuardCallback(mitigations=(), cpu_sample_every=1, plan_at_start=False)]
    else:
        guards = [MemGuardCallback(budget=int(mode), mitigations=("microbatch",), plan_at_start=False)]
    trainer = pl.Trainer(callbacks=guards, default_root_dir=root, logger=False, use_distributed_sampler=False,
                         **trainer_kwargs(strategy=two_rank_strategy(strategy), devices=2, max_steps=STEPS))
    model = LoggingStack(logged)
    fit_recording_results(trainer, model, model.net, root, guards[0] if guards else None)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    faulthandler.dump_traceback_later(100, exit=True)  # a hang ends this rank, with where it hung
    fit(*sys.argv[1:5])
    end_process_group()
