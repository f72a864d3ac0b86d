"""Run by test_ddp.py in a subprocess (Lightning starts the second rank by running this module again; a hang is the
test's timeout): two CPU gloo ranks fit tests.models.TaskHeads under Lightning's ``ModelParallelStrategy`` (FSDP2:
each block sharded, then the model, in ``configure_model``), each rank on its own task batches: unguarded in
``<root>/plain``, then under a budget only micro-batches fit in ``<root>/guarded``. Each fit writes how it ended
(``outcome.rank<N>.txt``) and its gathered parameters (``parameters.rank<N>.pt``)."""

import os
import sys
import warnings

import torch

from lightning_memguard import MemGuardCallback
from tests.models import TaskHeadsModule, pl, trainer_kwargs, two_rank_strategy
from tests.ranks import end_process_group, fit_recording_results


class ShardedTaskHeads(TaskHeadsModule):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def fit(root: str, name: str, callbacks: list) -> None:
    folder = os.path.join(root, name)
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(0)
    trainer = pl.Trainer(callbacks=callbacks, default_root_dir=folder, logger=False, use_distributed_sampler=False,
                         **trainer_kwargs(strategy=two_rank_strategy("fsdp"), devices=2, max_steps=4))
    model = ShardedTaskHeads()
    fit_recording_results(trainer, model, model.model, folder)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    fit(sys.argv[1], "plain", [])
    # a whole batch peaks at ~6.5 MB a rank: only parts fit
    fit(sys.argv[1], "guarded", [MemGuardCallback(budget="4MB", mitigations=("microbatch",), min_gain=0.0,
                                                  plan_at_start=False)])
    end_process_group()
