"""Run by test_accumulate_recover.py in a subprocess (Lightning starts the second rank by running this module again; a
hang is the test's timeout, not a stuck test run): two gloo ranks fit :class:`~tests.models.SizedStack` with
``accumulate_grad_batches=2`` under ``strategy`` (``ddp``, or ``fsdp``: FSDP2 on every block and the root under
``ModelParallelStrategy``), where rank 1 alone runs out of memory once, at step ``FAILING_STEP``, in the forward of its
fifth block, on the ``which``-th batch (0 or 1) of that step's accumulation window.

``<strategy> <root> <which>`` (``which`` -1: no guard and no OOM, the reference). How each rank ended goes to ``<root>/outcome.rank<N>.txt`` (``finished`` or the
error's type and first line), a finished fit's full (gathered) parameters to ``<root>/parameters.rank<N>.pt``, an
error's traceback to ``<root>/traceback.rank<N>.txt``. An error is caught so that
each rank writes its outcome (uncaught, Lightning's launcher could kill rank 0 before it does)."""

import faulthandler
import os
import sys
import traceback
import warnings

import torch

from lightning_memguard import MemGuardCallback
from tests.helpers import OneOffBallast
from tests.models import SizedStack, lightning_class, pl, trainer_kwargs

STEPS = 4
FAILING_STEP = 2  # after complete steps: DDP settled its buckets, FSDP2's sequence of collectives is known
LIMIT = 32 * 2 ** 20  # far above a step; the ballast alone passes it


class OutOfMemoryOnceOnRankOne(SizedStack):
    """:class:`SizedStack` (batches of 64) whose rank 1 runs out of memory once, in the forward of its fifth block, on
    batch ``which`` of step ``FAILING_STEP``'s window of two."""

    def __init__(self, which: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.which = which

    def on_fit_start(self) -> None:  # under FSDP2 the blocks are sharded by now (configure_model)
        self.ballast = OneOffBallast(self.net.blocks[4], "forward", LIMIT)

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        self.ballast.armed = (self.global_rank == 1 and self.global_step == FAILING_STEP
                              and batch_idx % 2 == self.which)


def fit(strategy_name: str, root: str, which: int) -> None:
    if strategy_name == "fsdp":
        strategy = lightning_class("strategies", "ModelParallelStrategy")(data_parallel_size=2,
                                                                         tensor_parallel_size=1)
    else:
        strategy = "ddp"
    guards = [MemGuardCallback(cpu_hard_limit=LIMIT, threshold=1.0, plan_at_start=False,
                               mitigations=("checkpointing",))] if which >= 0 else []
    trainer = pl.Trainer(callbacks=guards, default_root_dir=root, logger=False, accumulate_grad_batches=2,
                         **trainer_kwargs(strategy=strategy, devices=2, max_steps=STEPS))
    outcome = "finished"
    model = OutOfMemoryOnceOnRankOne(which, batch_size=64, n_samples=2 * 2 * 64 * STEPS)
    try:
        trainer.fit(model)
    except Exception as error:  # what ended this rank, for the test to read
        outcome = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        with open(os.path.join(root, f"traceback.rank{trainer.global_rank}.txt"), "w") as file:
            traceback.print_exc(file=file)
    with open(os.path.join(root, f"outcome.rank{trainer.global_rank}.txt"), "w") as file:
        file.write(outcome)
    if outcome == "finished":  # gathering the shards is a collective: only after a fit both ranks finished
        full = {key: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
                for key, value in model.net.state_dict().items()}
        torch.save(full, os.path.join(root, f"parameters.rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    faulthandler.dump_traceback_later(100, exit=True)  # a hang ends this rank, with where it hung
    fit(sys.argv[1], sys.argv[2], int(sys.argv[3]))
