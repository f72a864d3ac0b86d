"""Run by test_fsdp_agree.py in a subprocess (Lightning starts the second rank by running this module again; a hang is
the test's timeout, not a stuck test run): two gloo ranks fit :class:`WiderOnRankOne` (FSDP2 on every block and the
root, under ``ModelParallelStrategy``), whose rank 1 alone needs more memory.

``threshold <root> <mitigations>`` (``default`` or names joined by commas): a fit without a budget first (measured
only: the reference, and each rank's peak), then a fit under a budget whose threshold only rank 1's plain step
crosses. ``oom <root> <limit>``: one fit under a CPU hard limit (bytes) that only rank 1's step exceeds.
``recover <root> <phase>``: a fit without a budget (the reference), then one under a CPU hard limit that rank 1 alone
passes once, at step ``FAILING_STEP``, in ``phase`` (``forward`` or ``backward``) of a block. Each
finished fit's full (gathered) parameters go to ``<fit>/parameters.rank<N>.pt``, how it ended to
``<fit>/outcome.rank<N>.txt`` and an error's traceback to ``<fit>/traceback.rank<N>.txt``
(:func:`~tests.ranks.run_recording_outcome`)."""

import os
import sys
import warnings

import torch
import torch.distributed as dist

from lightning_memguard import MemGuardCallback
from tests.models import SizedStack, pl, trainer_kwargs, two_rank_strategy
from tests.ranks import OneOffBallast, end_process_group, fit_recording_results

STEPS = 4
FAILING_STEP = 2  # RECOVER's: after complete steps (FSDP2's sequence of collectives is known)
LIMIT = 32 * 2 ** 20  # far above a step; the ballast alone passes it


class WiderOnRankOne(SizedStack):
    """:class:`SizedStack` (batches of 64) whose rank 1 runs each batch's samples four times over: the same mean loss
    and gradients, four times the activations, so only rank 1's step crosses a threshold between the ranks' peaks."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1:
            batch = [torch.cat([t] * 4) for t in batch]
        return super().training_step(batch, batch_idx)


class OutOfMemoryOnceOnRankOne(SizedStack):
    """:class:`SizedStack` (batches of 64) whose rank 1 runs out of memory once, at step ``FAILING_STEP``, in
    ``phase`` of its fifth block (:class:`~tests.ranks.OneOffBallast`)."""

    def __init__(self, phase: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.phase = phase

    def on_fit_start(self) -> None:  # the blocks are sharded by now (configure_model)
        self.ballast = OneOffBallast(self.net.blocks[4], self.phase, LIMIT)

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        self.ballast.armed = self.global_rank == 1 and self.global_step == FAILING_STEP


def fit(root: str, name: str, guard: MemGuardCallback, phase: str = "") -> str:
    """One fit in ``root/name``; returns how it ended (``finished`` or the error's type and first line)."""
    trainer = pl.Trainer(callbacks=[guard], default_root_dir=os.path.join(root, name), logger=False,
                         **trainer_kwargs(strategy=two_rank_strategy("fsdp"), devices=2, max_steps=STEPS))
    model = (OutOfMemoryOnceOnRankOne(phase, batch_size=64, n_samples=2 * 64 * STEPS) if phase else
             WiderOnRankOne(batch_size=64, n_samples=2 * 64 * STEPS))
    return fit_recording_results(trainer, model, model.net, os.path.join(root, name))


def highest_peak_of_each_rank(guard: MemGuardCallback) -> list[int]:
    """Every rank's highest peak after the first step, gathered on every rank."""
    history = guard.history
    own = torch.tensor(int(history[history["step"] >= 1]["peak_bytes"].max()))
    peaks = [torch.zeros_like(own) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, own)
    return [int(peak) for peak in peaks]


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    mode, root, argument = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "threshold":
        monitor = MemGuardCallback(mitigations=(), cpu_sample_every=1)
        fit(root, "plain", monitor)
        low, high = highest_peak_of_each_rank(monitor)
        # a threshold halfway between the ranks' peaks: crossed by rank 1 alone
        budget = int((low + high) / 2 / 0.9)
        mitigations = tuple(argument.split(",")) if argument != "default" else None
        settings = {"mitigations": mitigations} if mitigations else {}
        fit(root, "budgeted", MemGuardCallback(budget=budget, **settings))
        if dist.get_rank() == 0:
            with open(os.path.join(root, "peaks.txt"), "w") as file:
                file.write(f"{low} {high} {budget}")
    elif mode == "recover":
        fit(root, "plain", MemGuardCallback(mitigations=()), argument)
        fit(root, "recovered", MemGuardCallback(cpu_hard_limit=LIMIT, threshold=1.0, plan_at_start=False,
                                                mitigations=("checkpointing",)), argument)
    else:
        fit(root, "limited", MemGuardCallback(cpu_hard_limit=argument, threshold=1.0, plan_at_start=False))
    end_process_group()
