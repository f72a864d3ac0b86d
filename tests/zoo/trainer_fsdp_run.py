"""Run by test_zoo_model_parallel.py in a subprocess (Lightning starts the second rank by running this module again;
a hang is the test's timeout): two CPU gloo ranks fit a tiny Llama under Lightning's ``ModelParallelStrategy``,
sharded as torchtitan does (``fully_shard`` on every decoder layer, then the root) in ``configure_model``, with AdamW
on each rank's own padded token batches: a fit without a budget (the reference) in ``<root>/plain``, then one under
a CPU hard limit that rank 1 alone passes once, at step ``FAILING_STEP``, in a layer's backward, in
``<root>/recovered``. Each fit writes how it ended (``outcome.rank<N>.txt``) and its gathered parameters
(``parameters.rank<N>.pt``)."""

import os
import sys
import warnings

import torch
from torch.utils.data import DataLoader

from lightning_memguard import MemGuardCallback
from tests.models import pl, trainer_kwargs, two_rank_strategy
from tests.ranks import OneOffBallast, end_process_group, fit_recording_results
from tests.zoo.models import ZooModule, decoder_layers, fully_shard_layers, make_batch

STEPS, FAILING_STEP = 4, 2  # the OOM after complete steps: FSDP2's sequence of collectives is known by then
LIMIT = 32 * 2 ** 20  # far above a step; the ballast alone passes it


class ShardedLlama(ZooModule):
    """The zoo's Llama sharded in ``configure_model``; each rank trains on its own batches (no distributed sampler);
    with ``failing``, rank 1 runs out of memory once, at step ``FAILING_STEP``, in its second layer's backward."""

    def __init__(self, failing: bool) -> None:
        super().__init__("llama", optimizer="adamw")
        self.failing = failing

    def configure_model(self) -> None:
        fully_shard_layers(self.model, self.device_mesh["data_parallel"])

    def on_fit_start(self) -> None:  # the layers are sharded by now
        self.ballast = OneOffBallast(decoder_layers(self.model)[1], "backward", LIMIT)

    def on_train_batch_start(self, batch, batch_idx):
        self.ballast.armed = self.failing and self.global_rank == 1 and self.global_step == FAILING_STEP

    def train_dataloader(self):
        rank = self.global_rank
        return DataLoader([make_batch("llama", 10 * rank + index) for index in range(STEPS)], batch_size=None)


def fit(root: str, name: str, guard: MemGuardCallback, failing: bool) -> None:
    folder = os.path.join(root, name)
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=folder, logger=False, use_distributed_sampler=False,
                         **trainer_kwargs(strategy=two_rank_strategy("fsdp"), devices=2, max_steps=STEPS))
    model = ShardedLlama(failing)
    fit_recording_results(trainer, model, model.model, folder)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # two ranks on a busy machine: a second thread per rank only adds waiting
    fit(sys.argv[1], "plain", MemGuardCallback(mitigations=()), failing=False)
    fit(sys.argv[1], "recovered", MemGuardCallback(cpu_hard_limit=LIMIT, threshold=1.0, plan_at_start=False,
                                                   mitigations=("checkpointing",)), failing=True)
    end_process_group()
