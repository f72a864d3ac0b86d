"""The collectives a training step issues of its own, counted while an attempt runs (in a one-rank gloo group): what
torch.distributed's functions, torch.distributed.nn's autograd all_gather and Lightning call count, the recovery's own
reductions and calls after the attempt do not; after an OOM, whether the step's own collectives may still be pending
(fewer issued than a complete attempt of as many parts issued). Before a step ran, the module's source and layers
say whether it issues any, and so do the collectives the first batch's estimate issues (a copy of the step)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_memguard.adapters.ddp_recovery import DDPRecovery
from lightning_memguard.adapters.logged_sync import collectives_in_source
from lightning_memguard.adapters.lightning_step_copy import training_step_of_copy
from lightning_memguard.adapters.own_collectives import CollectiveCount, uncounted
from tests.models import BlockStack, ContrastiveStack
from tests.ranks import gloo_group


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.distributed.nn's all_gather: what Lightning calls
def test_the_calls_of_an_attempt_are_counted_and_the_recoverys_own_reductions_are_not(tmp_path):
    with gloo_group(0, tmp_path, world_size=1):
        count = CollectiveCount()
        x = torch.ones(3, requires_grad=True)
        count.watch()
        dist.all_reduce(torch.ones(2))
        gathered = torch.distributed.nn.functional.all_gather(x)  # autograd's: calls dist.all_gather
        assert count.issued == 2
        gathered[0].sum().backward()  # its backward reduces the gradient across the ranks
        backward = count.issued - 2
        assert backward >= 1
        with uncounted():  # how a recovery reduces, and FSDP2 gathers: not counted
            dist.all_reduce(torch.ones(2))
        assert count.issued == 2 + backward
        count.complete(1)
        dist.all_reduce(torch.ones(2))  # after the attempt (an evaluation's, a step's end): not the step's
        assert count.issued == 2 + backward and count.seen


def test_after_an_oom_the_steps_own_collectives_are_pending_until_as_many_were_issued_as_a_complete_attempt():
    count = CollectiveCount()
    assert count.pending(1) and not count.known  # nothing ran: not known, so taken as pending
    with count.estimating(lambda: True):  # the first batch's estimate ran the step and issued none
        pass
    assert count.known and not count.pending(1)  # nothing guessed
    assert count.pending(1, guessed=True)  # the source calls one: until a step has run, taken as pending
    count.watch()
    count.issued = 2  # as the wrappers count
    count.complete(1)
    count.watch()
    assert count.pending(1) and count.pending(1, guessed=True)  # the OOM came before the step's two
    count.issued = 1
    assert count.pending(1)
    count.issued = 2
    assert not count.pending(1)  # both ran: only gradient reductions are left
    assert count.pending(2)  # a batch in two parts issues them twice: not known yet
    quiet = CollectiveCount()
    quiet.watch()
    quiet.complete(1)
    quiet.watch()
    assert not quiet.pending(1) and not quiet.pending(1, guessed=True)  # steps ran and issued none: the count rules


def test_a_ddp_recovery_counts_the_collectives_of_its_attempts_but_not_its_gradient_reductions(tmp_path):
    with gloo_group(0, tmp_path, world_size=1):
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
        recovery = DDPRecovery(ddp)
        for _ in range(2):
            recovery.begin_attempt()
            ddp(torch.ones(2, 4)).sum().backward()  # its bucket goes through the recovery's hook
            recovery.attempt_complete(1)
        assert not recovery.own_collectives_seen
        recovery.begin_attempt()
        loss = ddp(torch.ones(2, 4)).sum()
        dist.all_reduce(loss.detach().clone())  # the step's own: a mean over the ranks, say
        assert recovery.own_collectives_seen and not recovery.own_collectives_pending(1)  # the last step issued none
        loss.backward()
        recovery.attempt_complete(1)
        recovery.begin_attempt()
        assert recovery.own_collectives_pending(1)  # an OOM now: the others may wait in that all_reduce


class GathersInItsStep(BlockStack):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.mean_loss = self.all_gather(loss.detach()).mean()
        return loss


class GathersInAHelper(BlockStack):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.mean_loss = _mean_over_ranks(self, loss)
        return loss


def _mean_over_ranks(module, value):
    return module.all_gather(value.detach()).mean()


class SyncedNorm(BlockStack):
    def __init__(self):
        super().__init__()
        self.norm = nn.SyncBatchNorm(64)


def test_the_source_and_the_layers_say_whether_a_step_issues_collectives_before_it_ran():
    assert collectives_in_source(GathersInItsStep())
    assert collectives_in_source(SyncedNorm())
    assert not collectives_in_source(BlockStack())  # logs without sync_dist, gathers nothing
    assert not collectives_in_source(GathersInAHelper())  # not seen: counted once a step ran


def test_the_collectives_the_first_batchs_estimate_issues_are_the_steps_own_before_any_attempt_completed(tmp_path):
    with gloo_group(0, tmp_path, world_size=1):
        count = CollectiveCount()
        with count.estimating(lambda: True):  # a helper function all-gathers: the source shows nothing
            dist.all_gather([torch.zeros(2)], torch.ones(2))
            with uncounted():  # the guard's own agreement on the estimates: not the step's
                dist.all_reduce(torch.ones(2))
        assert count.estimated == 1 and count.known and count.seen and count.pending(1)
        dist.all_reduce(torch.ones(2))  # after the estimates: not counted
        assert count.issued == 0
        count.watch()
        count.complete(1)  # a complete attempt issued none: the count of steps rules from now on
        assert not count.seen and not count.pending(1)
        failed = CollectiveCount()
        with failed.estimating(lambda: False):  # the estimate could not run the step (it asked the Trainer)
            pass
        assert not failed.known and failed.pending(1) and not failed.seen



class RecordsItsGathers(ContrastiveStack):
    def training_step(self, batch, batch_idx):
        features = self.net.inp(batch[0])
        # Lightning's gather keeps a graph to the input only where sync_grads asks for one
        self.kept_graph = [self.all_gather(features).requires_grad,
                           self.all_gather(features, sync_grads=True).requires_grad]
        self.gathered = [tuple(self.all_gather(batch[0]).shape), tuple(self.all_gather(2.5).shape)]
        return super().training_step(batch, batch_idx)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_estimates_copy_of_a_step_that_gathers_runs_and_its_gathers_count(tmp_path):
    """Lightning copies a module without its Trainer, so ``self.all_gather`` failed on the estimate's copy; the copy's
    gather is stood in for: what Lightning's returns (``(ranks, *shape)`` in a process group, the data itself outside
    one), gradients to the embeddings as ``sync_grads=True`` gives, and each gather counted as a collective."""
    module = copy.deepcopy(RecordsItsGathers(batch_size=8))
    batch = next(iter(module.train_dataloader()))
    with pytest.raises(RuntimeError, match="not attached to a `Trainer`"):
        module.training_step(batch, 0)
    training_step_of_copy(module, batch).backward()  # no process group: the data as it is
    assert module.gathered == [(8, 16), ()] and "all_gather" not in vars(module)
    module.zero_grad()
    with gloo_group(0, tmp_path, world_size=1):
        count = CollectiveCount()
        with count.estimating(lambda: True):
            loss = training_step_of_copy(module, batch)
        assert module.gathered == [(1, 8, 16), (1,)] and module.kept_graph == [False, True]
        assert count.estimated == 5 and count.seen  # the four recorded and the step's own
        loss.backward()
        assert all(p.grad is not None for p in module.parameters())


def test_a_refusing_count_raises_instead_of_issuing_and_the_evaluation_reads_it_through_a_wrapping_error(tmp_path):
    """An evaluation batch run on one rank alone before its step is known to issue no collective: each collective its
    parts try raises before it is issued (the other ranks would never meet it), uncounted and unissued; a library
    that raises its own error from it still ends the batch with the report's reason."""
    from lightning_memguard.adapters.ddp_evaluation import EvaluationAlone
    from lightning_memguard.adapters.own_collectives import CollectiveRefused

    with gloo_group(0, tmp_path, world_size=1):
        count = CollectiveCount()
        count.watch()
        count.refusing = True
        tensor = torch.ones(2)
        with pytest.raises(CollectiveRefused, match="all_reduce"):
            dist.all_reduce(tensor)
        assert count.issued == 0
        with uncounted():  # a recovery's own reductions are never refused
            dist.all_reduce(tensor)
        assert tensor.tolist() == [1.0, 1.0]
        count.refusing = False
        count.complete(0)

    alone = EvaluationAlone()
    try:
        try:
            raise CollectiveRefused("torch.distributed.all_gather in a batch run on this rank alone")
        except CollectiveRefused as refused:
            raise RuntimeError("could not sync the metric") from refused
    except RuntimeError as wrapped:
        assert "issues collectives of its own" in alone.refusal("test", wrapped)
    assert alone.refusal("test", RuntimeError("the model's own")) is None
