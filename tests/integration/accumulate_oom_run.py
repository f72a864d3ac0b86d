"""Run by test_accumulate_recover.py in a subprocess (Lightning starts the second rank by running this module again; a
hang is the test's timeout, not a stuck test run): two gloo ranks fit :class:`~tests.models.SizedStack` with
``accumulate_grad_batches=<accumulate>`` (2 unless given) under ``strategy`` (``ddp``, or ``fsdp``: FSDP2 on every
block and the root under ``ModelParallelStrategy``), where rank 1 alone runs out of memory once, at step
``failing_step`` (``FAILING_STEP`` unless given), in the forward (or, ``phase`` ``backward``, the backward) of its
fifth block, on the ``which``-th batch of that step's accumulation window. The guard's ladder is ``ladder`` (rung
names joined by commas; checkpointing unless given). With ``sync`` 1 the training step logs its loss each step with
``sync_dist=True`` (an all-reduce at the log call); with 2 it all-gathers its loss through a helper function (a
collective its source does not show); with 3 it calls ``self.all_gather`` itself; with 4 a helper all-gathers with
``torch.distributed`` itself (which the first batch's estimate runs); with 5 the helper's gather runs in a step that
runs as its Trainer's module only (no estimate runs that step).

``<strategy> <root> <which> [<ladder> <phase> <accumulate> <sync> <failing_step>]`` (``which`` -1: no guard and no
OOM, the reference).
How each rank ended goes to ``<root>/outcome.rank<N>.txt`` (``finished`` or the error's type and first line), a finished
fit's full (gathered) parameters to ``<root>/parameters.rank<N>.pt`` and the guard's levels at its end to
``<root>/levels.rank<N>.json``, an error's traceback to ``<root>/traceback.rank<N>.txt``. An error is caught so that
each rank writes its outcome (uncaught, Lightning's launcher could kill rank 0 before it does)."""

import faulthandler
import sys
import warnings

from lightning_memguard import MemGuardCallback
from tests.models import SizedStack, pl, trainer_kwargs, two_rank_strategy
from tests.ranks import OneOffBallast, end_process_group, fit_recording_results

STEPS = 4
FAILING_STEP = 2  # after complete steps: DDP settled its buckets, FSDP2's sequence of collectives is known
LIMIT = 32 * 2 ** 20  # far above a step; the ballast alone passes it


class OutOfMemoryOnceOnRankOne(SizedStack):
    """:class:`SizedStack` (batches of 64) whose rank 1 runs out of memory once, in the ``phase`` of its fifth block,
    on batch ``which`` of step ``failing_step``'s window of ``accumulate``."""

    def __init__(self, which: int, phase: str, accumulate: int, sync: int = 0, failing_step: int = FAILING_STEP,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.which, self.phase, self.accumulate, self.sync = which, phase, accumulate, sync
        self.failing_step = failing_step

    def on_fit_start(self) -> None:  # under FSDP2 the blocks are sharded by now (configure_model)
        self.ballast = OneOffBallast(self.net.blocks[4], self.phase, LIMIT)

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        self.ballast.armed = (self.global_rank == 1 and self.global_step == self.failing_step
                              and batch_idx % self.accumulate == self.which)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.sync == 1:
            self.log("train_loss", loss, on_step=True, on_epoch=False, sync_dist=True)
        return loss


class GathersInAHelper(OutOfMemoryOnceOnRankOne):
    """Its training step all-gathers through a helper function (``sync`` 2): its source shows no collective and no
    log call, so only a step that ran (or the first batch's estimate of it) tells the guard."""

    def training_step(self, batch, batch_idx):
        loss = SizedStack.training_step(self, batch, batch_idx)
        self.mean_loss = mean_over_ranks(self, loss)
        return loss


class AllGathersItself(OutOfMemoryOnceOnRankOne):
    """Its training step's own source shows the all_gather (``sync`` 3), and no log call."""

    def training_step(self, batch, batch_idx):
        loss = SizedStack.training_step(self, batch, batch_idx)
        self.mean_loss = self.all_gather(loss.detach()).mean()
        return loss


class GathersThroughTorch(OutOfMemoryOnceOnRankOne):
    """Its training step all-gathers with ``torch.distributed`` in a helper function (``sync`` 4): the source shows
    nothing, and unlike Lightning's ``self.all_gather`` (which asks the Trainer) the first batch's estimate runs it."""

    def training_step(self, batch, batch_idx):
        loss = SizedStack.training_step(self, batch, batch_idx)
        self.mean_loss = gathered_mean(loss)
        return loss


class AsksItsTrainerToGather(OutOfMemoryOnceOnRankOne):
    """Gathers through a helper in a step that runs as its Trainer's module only (``sync`` 5): the estimate's copy of
    the module is not (it reads the Trainer, whose module is the original), so no estimate runs the step, and before
    a step completed nothing tells the guard whether it issues collectives of its own."""

    def training_step(self, batch, batch_idx):
        if self.trainer.lightning_module is not self:
            raise RuntimeError("this step runs as its Trainer's module only")
        loss = SizedStack.training_step(self, batch, batch_idx)
        self.mean_loss = mean_over_ranks(self, loss)
        return loss


def gathered_mean(value):
    """The mean of ``value`` over the ranks, all-gathered with ``torch.distributed`` itself."""
    import torch
    import torch.distributed as dist

    parts = [torch.zeros_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, value.detach().contiguous())
    return torch.stack(parts).mean()


def mean_over_ranks(module: SizedStack, value):
    """The mean of ``value`` over the ranks, all-gathered here, where the training step's source does not show it."""
    return module.all_gather(value.detach()).mean()


def fit(strategy: str, root: str, which: int, ladder: str = "checkpointing", phase: str = "forward",
        accumulate: int = 2, sync: int = 0, failing_step: int = FAILING_STEP) -> None:
    guards = [MemGuardCallback(cpu_hard_limit=LIMIT, threshold=1.0, plan_at_start=False,
                               mitigations=tuple(ladder.split(",")))] if which >= 0 else []
    trainer = pl.Trainer(callbacks=guards, default_root_dir=root, logger=False, accumulate_grad_batches=accumulate,
                         **trainer_kwargs(strategy=two_rank_strategy(strategy), devices=2, max_steps=STEPS))
    model_class = {2: GathersInAHelper, 3: AllGathersItself, 4: GathersThroughTorch,
                   5: AsksItsTrainerToGather}.get(sync, OutOfMemoryOnceOnRankOne)
    model = model_class(which, phase, accumulate, sync, failing_step, batch_size=64,
                        n_samples=2 * accumulate * 64 * STEPS)
    fit_recording_results(trainer, model, model.net, root, guards[0] if guards else None)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    faulthandler.dump_traceback_later(100, exit=True)  # a hang ends this rank, with where it hung
    fit(*sys.argv[1:3], int(sys.argv[3]), *sys.argv[4:6], *[int(a) for a in sys.argv[6:9]])
    end_process_group()
